"""KL annealing schedules for :func:`bayeswrap.fit` (``kl_schedule=``).

A schedule maps the (0-based) epoch index to a factor in [0, 1] that
multiplies the model's ``kl_weight`` during that epoch. The loss of an epoch is

    loss = NLL + factor(epoch) · kl_weight · KL / N.

:class:`KLSchedule` is the warm-up-then-linear-ramp schedule (Sønderby et al.
2016, "Ladder Variational Autoencoders", §2.4 "warm-up"; Molchanov et al. 2017
train sparse VD from a pretrained net the same way): for ``warmup_epochs`` epochs
the factor is 0 — the posterior noise is still injected, only the KL term is
switched off — then it grows linearly to 1 over ``ramp_epochs`` epochs,

    factor(C) = min(C / T, 1),   C = epoch − warmup_epochs + 1 (the C-th ramp epoch),  T = ramp_epochs,

so KL(C) = (C / T) · KL_max, and the full weight is reached in the T-th ramp
epoch. Any callable ``epoch -> float`` works as a schedule too.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["KLSchedule", "constant", "check_factor"]


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or int(value) != value or value < 0:
        raise ValueError(f"{name}={value!r} must be an integer >= 0 (epochs)")
    return int(value)


class KLSchedule:
    """KL weight 0 for ``warmup_epochs`` epochs, then a linear ramp to 1 over ``ramp_epochs`` epochs.

    Args:
        warmup_epochs: W ≥ 0 epochs with factor 0 (noise injected, no KL).
        ramp_epochs: T ≥ 0 epochs of linear ramp; 0 jumps to 1 right after warm-up.

    Raises:
        ValueError: for a negative or non-integer epoch count.

    Example:
        >>> s = KLSchedule(warmup_epochs=2, ramp_epochs=4)
        >>> [s(e) for e in range(8)]
        [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    """

    def __init__(self, warmup_epochs: int = 0, ramp_epochs: int = 0):
        self.warmup_epochs = _count("warmup_epochs", warmup_epochs)
        self.ramp_epochs = _count("ramp_epochs", ramp_epochs)

    def __call__(self, epoch: int) -> float:
        """The factor for 0-based ``epoch`` (an integer ≥ 0)."""
        epoch = _count("epoch", epoch)
        if epoch < self.warmup_epochs:
            return 0.0
        if self.ramp_epochs == 0:
            return 1.0
        return min((epoch - self.warmup_epochs + 1) / self.ramp_epochs, 1.0)

    def __repr__(self) -> str:
        return f"KLSchedule(warmup_epochs={self.warmup_epochs}, ramp_epochs={self.ramp_epochs})"


def constant(factor: float = 1.0):
    """A schedule that always returns ``factor`` (e.g. 0 to train on the likelihood alone)."""
    factor = check_factor(factor, "constant")
    return lambda epoch: factor


def check_factor(value, where: str = "kl_schedule") -> float:
    """Validates a schedule's output: a finite number ≥ 0.

    Raises:
        ValueError: otherwise (the message names ``where``).
    """
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} returned {value!r}, not a number") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{where} returned {value!r}; a KL factor must be finite and >= 0")
    return v
