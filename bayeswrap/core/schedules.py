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

The cyclical step size of cyclical SG-MCMC (Zhang et al. 2020, "Cyclical
Stochastic Gradient MCMC for Bayesian Deep Learning", ICLR, eq. 1) lives here
too as pure functions of the step (:func:`cyclical_step_size`,
:func:`cyclical_position`, :func:`exploration_steps`); the SGLD model applies
them per optimizer step (``bw.wrap(model, "sgld", cycles=M)``).
"""

from __future__ import annotations

import math
import numbers

from bayeswrap.core.checks import check_int

__all__ = ["KLSchedule", "constant", "check_factor", "cycle_length", "cyclical_position",
           "cyclical_step_size", "exploration_steps"]


def _count(name: str, value) -> int:
    return check_int(name, value, minimum=0, note="epochs")


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


# ---------------------------------------------------------------------- cyclical SG-MCMC (Zhang et al. 2020)
def _positive_int(name: str, value) -> int:
    return check_int(name, value, minimum=1)


def cycle_length(num_steps: int, cycles: int) -> int:
    """Steps per cycle, ⌈K/M⌉ for K = ``num_steps`` steps in M = ``cycles`` cycles.

    The last cycle is shorter when M does not divide K (it ends at step K).

    Raises:
        ValueError: if K or M is not an integer >= 1, or M > K.
    """
    num_steps, cycles = _positive_int("num_steps", num_steps), _positive_int("cycles", cycles)
    if cycles > num_steps:
        raise ValueError(f"cycles={cycles} must be <= num_steps={num_steps} (at least one step per cycle)")
    return -(-num_steps // cycles)


def cyclical_position(step: int, num_steps: int, cycles: int) -> float:
    """Where step k lies in its cycle, r(k) = mod(k − 1, ⌈K/M⌉) / ⌈K/M⌉ ∈ [0, 1).

    Zhang et al. (2020) call the steps with r(k) < β the *exploration* stage and
    the rest the *sampling* stage.

    Args:
        step: k, 1-based optimizer step (1 ≤ k ≤ K).
        num_steps: K, total steps.
        cycles: M, number of cycles.

    Raises:
        ValueError: for k outside [1, K] or invalid K, M.
    """
    length = cycle_length(num_steps, cycles)
    step = _positive_int("step", step)
    if step > num_steps:
        raise ValueError(f"step={step} must be <= num_steps={num_steps}")
    return ((step - 1) % length) / length


def cyclical_step_size(step: int, num_steps: int, cycles: int, lr0: float) -> float:
    """Cosine cyclical step size (Zhang et al. 2020, eq. 1).

        α_k = α_0 / 2 · [cos(π · mod(k − 1, ⌈K/M⌉) / ⌈K/M⌉) + 1],

    i.e. α_0 at the first step of every cycle, decaying to near 0 at its end.

    Args:
        step: k, 1-based optimizer step (1 ≤ k ≤ K).
        num_steps: K, total steps.
        cycles: M ≥ 1 cycles (M = 1: a single cosine decay).
        lr0: α_0 > 0, the initial step size (same units as the optimizer's ``lr``).

    Returns:
        α_k, a float in (0, α_0].

    Raises:
        ValueError: for k outside [1, K], invalid K or M, or ``lr0`` <= 0.

    Example:
        >>> [round(cyclical_step_size(k, 8, 2, 1.0), 4) for k in range(1, 9)]
        [1.0, 0.8536, 0.5, 0.1464, 1.0, 0.8536, 0.5, 0.1464]
    """
    if not (isinstance(lr0, numbers.Real) and math.isfinite(lr0) and lr0 > 0):
        raise ValueError(f"lr0={lr0!r} must be a finite number > 0")
    return lr0 / 2 * (math.cos(math.pi * cyclical_position(step, num_steps, cycles)) + 1)


def exploration_steps(num_steps: int, cycles: int, exploration: float) -> int:
    """Number of exploration steps at the start of each full cycle.

    The steps of a cycle at positions p = 0, 1, ... (p = mod(k − 1, ⌈K/M⌉)) with
    p / ⌈K/M⌉ < β form the exploration stage; this is the first p for which that
    fails, computed with the same floating-point comparison as
    ``cyclical_position(k, K, M) < β``.

    Args:
        num_steps: K.
        cycles: M.
        exploration: β ∈ [0, 1), the fraction of each cycle spent exploring.

    Raises:
        ValueError: for β outside [0, 1) or invalid K, M.
    """
    length = cycle_length(num_steps, cycles)
    if not (isinstance(exploration, numbers.Real) and 0 <= exploration < 1):
        raise ValueError(f"exploration={exploration!r} must be a number in [0, 1)")
    n = min(length, math.ceil(exploration * length))
    while n > 0 and (n - 1) / length >= exploration:
        n -= 1
    while n < length and n / length < exploration:
        n += 1
    return n


def restore_param_groups(optimizer, recorded: dict[str, str]) -> None:
    """Gives every parameter group back the values a method recorded in it when it took over the schedule.

    A method that drives the optimizer's step size per step (cyclical SGLD, SWAG's
    ``swa_lr``) records each group's base value under its own key (so it survives
    ``optimizer.state_dict()`` and a resume); at the end of the fit this restores
    and removes them.

    Args:
        optimizer: a ``torch.optim.Optimizer``.
        recorded: ``{record key: group key}``, e.g. ``{"sgld_base_lr": "lr"}``.
    """
    for group in optimizer.param_groups:
        for record, key in recorded.items():
            if record in group:
                group[key] = group.pop(record)
