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
