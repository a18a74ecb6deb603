"""Validation of option values: one message style for every option of the API.

Each check returns the value in its canonical type, or raises a ``ValueError``
that names the option, the value given and what is accepted, e.g.
``chunk_size=2.7 must be an integer >= 1``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

#: positive scale options (prior_std, init_std, noise_std, kl_weight > 0, ...) must lie in this range, so that
#: float32 holds what is derived from them: σ², 1/σ² (≤ 1e36 < 3.4e38) and log σ
SCALE_RANGE = (1e-18, 1e18)
_SCALE_NOTE = "float32 must hold its square, its inverse square and its log"


def _scalar(value):
    """The Python number inside a 0-d real tensor or 0-d numpy array; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() \
            and value.dtype != torch.bool and not value.is_meta:
        return value.item()
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf":
        return value.item()
    return value


def _integer_value(value) -> int | None:
    """``value`` as an int if it is an integer (int, numpy integer, integral finite float, 0-d tensor), else None."""
    value = _scalar(value)
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return None


def _not_a(value) -> str:
    """``", not str"`` for a value of the wrong type (bools and non-numbers), ``""`` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, torch.Tensor)):
        return f", not {type(value).__name__}"
    return ""


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None,
              allow_none: bool = False, note: str = "") -> int | None:
    """Validates an integer option and returns it as an ``int``.

    Accepted: ``int``, numpy integer scalars, integral finite floats (``3.0``)
    and 0-d integer (or integral) tensors; refused: bools, non-integral,
    NaN or infinite floats, strings and anything else.

    Args:
        name: the option's name, for the message.
        value: the value given.
        minimum, maximum: inclusive bounds (``None``: unbounded).
        allow_none: whether ``None`` is accepted (and returned).
        note: what the option means, appended to the message in parentheses.

    Raises:
        ValueError: naming the value and the accepted range, e.g.
            ``chunk_size=2.7 must be an integer >= 1``.
    """
    if value is None and allow_none:
        return None
    if minimum is not None and maximum is not None:
        accepted = f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        accepted = f"an integer >= {minimum}"
    elif maximum is not None:
        accepted = f"an integer <= {maximum}"
    else:
        accepted = "an integer"
    accepted = ("None or " if allow_none else "") + accepted + (f" ({note})" if note else "")
    v = _integer_value(value)
    if v is None:
        raise ValueError(f"{name}={value!r} must be {accepted}{_not_a(value)}")
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise ValueError(f"{name}={value!r} must be {accepted}")
    return v


def check_float(name: str, value, *, low: float | None = None, high: float | None = None, low_open: bool = False,
                high_open: bool = False, allow_inf: bool = False, allow_none: bool = False,
                note: str = "") -> float | None:
    """Validates a real-valued option and returns it as a ``float``.

    Accepted: Python and numpy real scalars and 0-d real tensors; refused:
    bools, strings, NaN, infinities (unless ``allow_inf`` and within the bounds)
    and values outside the bounds.

    Args:
        name: the option's name, for the message.
        value: the value given.
        low, high: bounds (``None``: unbounded); ``low_open``/``high_open`` make them exclusive.
        allow_inf: whether ±inf is accepted (if within the bounds), e.g. ``clip_radius=inf``.
        allow_none: whether ``None`` is accepted (and returned).
        note: what the option means, appended to the message in parentheses.

    Raises:
        ValueError: naming the value and the accepted range, e.g.
            ``grad_clip_norm=-1 must be a finite number > 0``.
    """
    if value is None and allow_none:
        return None
    finite = "" if allow_inf else "finite "
    if low is not None and high is not None:  # a bounded interval: "finite" goes without saying
        accepted = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        accepted = f"a {finite}number {'>' if low_open else '>='} {low:g}"
    elif high is not None:
        accepted = f"a {finite}number {'<' if high_open else '<='} {high:g}"
    else:
        accepted = f"a {finite}number"
    accepted = ("None or " if allow_none else "") + accepted + (f" ({note})" if note else "")
    v = _scalar(value)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name}={value!r} must be {accepted}{_not_a(value)}")
    v = float(v)
    if math.isnan(v) or (math.isinf(v) and not allow_inf) \
            or (low is not None and (v < low or (low_open and v == low))) \
            or (high is not None and (v > high or (high_open and v == high))):
        raise ValueError(f"{name}={value!r} must be {accepted}")
    return v


def check_scale(name: str, value, *, allow_zero: bool = False) -> float:
    """A positive scale option (a std, a weight) within :data:`SCALE_RANGE`, or exactly 0 if ``allow_zero``.

    Args:
        name: the option's name, for the message.
        value: the value given.
        allow_zero: whether exactly 0 is accepted too (``kl_weight``).

    Raises:
        ValueError: e.g. ``prior_std=1e-300 must be a number in [1e-18, 1e+18] (...)``.
    """
    try:
        v = check_float(name, value)
    except ValueError:
        v = None
    if v is None or not (SCALE_RANGE[0] <= v <= SCALE_RANGE[1] or (allow_zero and v == 0)):
        raise ValueError(f"{name}={value!r} must be {'0 or ' if allow_zero else ''}a number in "
                         f"[{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}] ({_SCALE_NOTE}){_not_a(value)}")
    return v


def check_bool(name: str, value) -> bool:
    """Validates a boolean option and returns it as a ``bool``.

    Accepted: ``True``/``False``, numpy booleans and 0-d boolean tensors; refused:
    everything else, strings included (``"false"`` is truthy in Python, so it is
    never read as a flag here; the command line and YAML files parse
    true/false/yes/no themselves, see :func:`bayeswrap.app.options.parse_bool`).

    Raises:
        ValueError: e.g. ``jitter='false' must be True or False, not str``.
    """
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.bool and not value.is_meta:
        return bool(value.item())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    hint = " (a string is not parsed here: pass the Python value True or False)" if isinstance(value, str) else ""
    raise ValueError(f"{name}={value!r} must be True or False, not {type(value).__name__}{hint}")


#: the seeds ``bayeswrap predict --seed`` accepts (a ``torch.Generator`` seed, kept to a signed 64-bit integer)
SEED_RANGE = (0, 2**63 - 1)


def check_seed(name: str, value) -> int:
    """A seed: an integer in :data:`SEED_RANGE`, given as a number or as command-line text (``"42"``).

    Text is read exactly (``int("...")``, so a 19-digit seed is not rounded through a float); integral text
    such as ``"1e3"`` is accepted too.

    Raises:
        ValueError: e.g. ``--seed '123456789012345678901' is not valid; accepted: an integer in
            [0, 9223372036854775807] (2^63 - 1)`` (a command-line flag, ``--`` in ``name``) or
            ``seed=-1 must be an integer in [0, 9223372036854775807]``.
    """
    number = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text)
        except ValueError:
            try:
                as_float = float(text)
            except ValueError:
                as_float = math.nan
            exact = math.isfinite(as_float) and as_float.is_integer() and abs(as_float) < 2**53
            number = int(as_float) if exact else value
    try:
        return check_int(name, number, minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])
    except ValueError:  # name the value as given (the command line's text), not as parsed
        if name.startswith("--"):
            raise ValueError(f"{name} {value!r} is not valid; accepted: an integer in [{SEED_RANGE[0]}, "
                             f"{SEED_RANGE[1]}] (2^63 - 1)") from None
        raise ValueError(f"{name}={value!r} must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]") from None


#: the device types a run accepts (``meta`` and the rest of torch's device types hold no data to compute on)
DEVICE_TYPES = ("cpu", "cuda", "mps")
_DEVICES_ACCEPTED = "auto, cpu, cuda, cuda:N, mps"


def check_device(name: str, value, *, available: bool = False, allow_auto: bool = True) -> str:
    """A device option: ``auto`` (if ``allow_auto``), ``cpu``, ``cuda``, ``cuda:N`` or ``mps``; returns the text.

    Args:
        name: the option's name, for the message (``device``, ``--device``).
        value: the value given.
        available: also require the device to exist on this machine (CUDA available and ``N`` below the
            device count; MPS available). Off for a saved config, which may come from another machine.
        allow_auto: whether ``auto`` (cuda if available, else cpu) is accepted.

    Raises:
        ValueError: naming the value and the accepted ones, e.g. ``device='meta' is not valid; accepted:
            auto, cpu, cuda, cuda:N, mps (meta and other device types are not devices bayeswrap runs on)``.
    """
    accepted = _DEVICES_ACCEPTED if allow_auto else _DEVICES_ACCEPTED.replace("auto, ", "")
    text = value.strip() if isinstance(value, str) else None
    if text == "auto" and allow_auto:
        return text
    device = None
    if text:
        try:
            device = torch.device(text)
        except (RuntimeError, ValueError):
            device = None
    well_formed = device is not None and device.type in DEVICE_TYPES and (
        text == device.type or (device.type == "cuda" and text == f"cuda:{device.index}"))
    if not well_formed:
        raise ValueError(f"{name}={value!r} is not valid; accepted: {accepted} (meta and other device types are "
                         f"not devices bayeswrap runs on)")
    if available:
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0 or (device.index is not None and device.index >= count):
                raise ValueError(f"{name}={value!r} is not available on this machine ({count} CUDA device(s)); "
                                 f"accepted here: cpu" + (f", cuda, cuda:0 ... cuda:{count - 1}" if count else "")
                                 + (", mps" if _mps_available() else ""))
        if device.type == "mps" and not _mps_available():
            raise ValueError(f"{name}={value!r} is not available on this machine (no MPS backend); accepted here: "
                             "cpu" + (", cuda, cuda:N" if torch.cuda.is_available() else ""))
    return text


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


#: the most posterior samples S a run's predictive draws (``--num-samples``): the predictive holds S × N × K
#: probabilities in memory (100,000 × 434 digits test images × 8 classes is 1.4 GB in float32)
MAX_PREDICTIVE_SAMPLES = 100_000


def check_choice(name: str, value, accepted: tuple[str, ...]) -> str:
    """Validates an option that takes one of a fixed set of names and returns it.

    Raises:
        ValueError: e.g. ``link_approx='bridge' is not known; accepted: ('mc', 'probit')``.
    """
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not known; accepted: {accepted}")
    return value
