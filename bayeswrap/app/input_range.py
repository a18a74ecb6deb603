"""New inputs against the range of the inputs a run was trained on (``bayeswrap predict``, ``LoadedRun``).

A network scores any finite input, and far outside its training range it does so confidently: an int64 array holding
2**62 (raw codes, or a wrong dtype) was predicted one-hot without a word. A run records ``[min, max]`` over its
training inputs in ``data.json`` (``input_range``, :func:`bayeswrap.app.build.training_input_range`; runs written
before it was recorded, and runs on image files, have none), and new inputs are compared with it:

* inside the recorded range: nothing is said;
* beyond it by at most :data:`REFUSE_WIDTHS` times the range's width (a test input a little brighter than any
  training input): a warning (:class:`InputRangeWarning`) naming the inputs, their range and the recorded one;
* beyond it by more, or holding a value whose magnitude exceeds :data:`EXACT_INTEGER_LIMIT` (2**24, past which
  float32 no longer holds every integer; checked also without a recorded range): refused
  (:class:`InputRangeError`), unless allowed (``--allow-out-of-range``), which turns the refusal into a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

#: float32 holds every integer up to 2**24; a larger value is rounded, and no preprocessed model input lies there
EXACT_INTEGER_LIMIT = float(2**24)
#: inputs beyond the recorded range by more than this many widths of it are refused (orders of magnitude: raw
#: integer codes, or pixels 0..255 given to a model trained on 0..1 lie far beyond it)
REFUSE_WIDTHS = 10.0
#: the flag that allows refused inputs (the Python API's keyword is ``allow_out_of_range``)
ALLOW_FLAG = "--allow-out-of-range"


class InputRangeError(ValueError):
    """Inputs far outside the range a run was trained on; the message names them, their range and the run's."""


class InputRangeWarning(UserWarning):
    """Inputs outside the range a run was trained on, by a modest amount (or allowed by the flag)."""


def check_input_range(inputs: torch.Tensor, recorded: Sequence[float] | None, source: str, *,
                      allow: bool = False, where: str = "the run's data.json") -> str | None:
    """Compares inputs with a run's recorded training input range (see the module docstring for the rule).

    Args:
        inputs: (N, ...) finite model inputs, as the model sees them.
        recorded: ``[min, max]`` of the training inputs, or None where the run recorded none.
        source: what the inputs are (a file name), for the messages.
        allow: warn instead of refusing.
        where: where ``recorded`` was read from, for the messages.

    Returns:
        The warning's message (also issued as an :class:`InputRangeWarning`), or None when nothing was said.

    Raises:
        InputRangeError: naming ``source``, the inputs' range and the recorded one, for inputs beyond
            :data:`REFUSE_WIDTHS` widths of the recorded range or with a magnitude above
            :data:`EXACT_INTEGER_LIMIT` (outside the recorded range), unless ``allow``.
    """
    if not inputs.numel():
        return None
    low, high = float(inputs.min()), float(inputs.max())
    found = f"inputs {source} hold values in [{low:g}, {high:g}]"
    if recorded is None:
        beyond, text = 0.0, f"{found}; {where} records no training input range"
        outside = True
    else:
        lo, hi = float(recorded[0]), float(recorded[1])
        width = hi - lo if hi > lo else max(abs(lo), abs(hi), 1.0)
        beyond = max(lo - low, high - hi, 0.0) / width
        outside = beyond > 0
        text = (f"{found}, outside the range [{lo:g}, {hi:g}] of the training inputs ({where}) by {beyond:.3g} "
                f"times its width")
    huge = max(abs(low), abs(high)) > EXACT_INTEGER_LIMIT and outside
    refused = huge or beyond > REFUSE_WIDTHS
    if not outside or (recorded is None and not huge):
        return None
    if huge:
        text += (f", and beyond 2**24 = {EXACT_INTEGER_LIMIT:,.0f}, where float32 no longer holds every integer "
                 "(raw integer codes or a wrong dtype?)")
    if refused and not allow:
        raise InputRangeError(
            f"{text}; the model never saw such inputs and would score them with unfounded confidence. Check how "
            f"they were preprocessed (scale, dtype); accepted: values within {REFUSE_WIDTHS:g} widths of the "
            f"training range and of magnitude at most 2**24. {ALLOW_FLAG} (allow_out_of_range=True) predicts them "
            "anyway, with a warning")
    message = text + ("; predicted anyway (allowed)" if refused else
                      "; the predictions of inputs outside the training range are less reliable")
    warnings.warn(message, InputRangeWarning, stacklevel=3)
    return message

