"""Warm-up adaptation of the full-batch kernels: step size, mass matrix and proposal scale, per chain.

* :class:`DualAveraging`: the HMC step size ε. Hoffman & Gelman 2014, Algorithm 5 (eqs. 5–6), target acceptance
  δ, γ = 0.05, t₀ = 10, κ = 0.75: log ε_t = μ − √t/γ · H̄_t with H̄_t the running mean of δ − α_t, μ = log 10ε₀.
  The mean acceptance probability of the adapting step sizes converges to δ; the averaged step size ε̄ kept
  for sampling is their geometric mean with weights t^−κ, whose acceptance is a little higher (as in Stan).
* :class:`WindowedMassAdaptation`: the HMC diagonal inverse mass matrix, the regularised variance
  (n/(n+5)) · var + 10⁻³ · 5/(n+5) of the draws in Stan's doubling slow windows (:func:`adaptation_windows`:
  initial buffer 75, base window 25, terminal buffer 50; 15 % / 75 % / 10 % for short warm-ups).
* :class:`ProposalAdaptation`: the random-walk MH proposal θ' = θ + s · d ⊙ ε. The scale s of each chain follows
  a Robbins–Monro recursion log s ← log s + (α − α*) / t^0.6 towards the acceptance α* (0.234, 0.44 in one
  dimension; Roberts, Gelman & Gilks 1997), and the shape d is set once, at the end of warm-up, to the
  standard deviations of the warm-up's second half relative to their mean variance (clamped to [10⁻³, 10³]
  in variance).
"""

from __future__ import annotations

import math

import torch


class DualAveraging:
    """Hoffman & Gelman 2014, Algorithm 5, per chain (module docstring).

    Args:
        step: the starting step size ε₀ of every chain, (C,).
        target: the target acceptance probability δ in (0, 1).
        gamma, t0, kappa: the algorithm's constants (γ, t₀, κ).

    Attributes:
        step: the step size to use in the next warm-up transition, (C,).
    """

    def __init__(self, step: torch.Tensor, target: float, gamma: float = 0.05, t0: float = 10.0,
                 kappa: float = 0.75):
        self.mu = torch.log(10 * step)
        self.target, self.gamma, self.t0, self.kappa = target, gamma, t0, kappa
        self.h_bar = torch.zeros_like(step)
        self.log_bar = torch.log(step)
        self.step = step
        self.t = 0

    def update(self, accept_prob: torch.Tensor) -> None:
        """Folds in the acceptance probabilities α_t, (C,), of the last transition."""
        self.t += 1
        t = self.t
        w = 1.0 / (t + self.t0)
        self.h_bar = (1 - w) * self.h_bar + w * (self.target - accept_prob)
        log_step = self.mu - math.sqrt(t) / self.gamma * self.h_bar
        eta = t ** -self.kappa
        self.log_bar = eta * log_step + (1 - eta) * self.log_bar
        self.step = log_step.exp()

    @property
    def final(self) -> torch.Tensor:
        """The averaged step size ε̄ kept for sampling, (C,)."""
        return self.log_bar.exp()


def adaptation_windows(num_warmup: int) -> list[tuple[int, int]]:
    """Stan's slow adaptation windows ``[(start, end)]`` for the inverse mass matrix (doubling sizes).

    Args:
        num_warmup: the number of warm-up transitions (< 20: no windows).

    Returns:
        Half-open iteration ranges, in order; the last is stretched to the terminal buffer.
    """
    if num_warmup < 20:
        return []
    init, term, base = 75, 50, 25
    if init + term + base > num_warmup:
        init, term = int(0.15 * num_warmup), int(0.1 * num_warmup)
        base = num_warmup - init - term
    windows, start, size = [], init, base
    end_slow = num_warmup - term
    while start < end_slow:
        end = start + size
        if end + 2 * size > end_slow:  # the next window would not fit: stretch this one to the end
            end = end_slow
        windows.append((start, end))
        start, size = end, 2 * size
    return windows


class WindowedMassAdaptation:
    """The diagonal inverse mass matrix from the draws of each slow window (module docstring).

    Args:
        num_warmup: the number of warm-up transitions.
        enabled: False: no windows, the mass matrix stays the identity.
    """

    def __init__(self, num_warmup: int, enabled: bool = True):
        self.windows = adaptation_windows(num_warmup) if enabled else []
        self._draws: list[torch.Tensor] = []

    def update(self, it: int, states: torch.Tensor) -> torch.Tensor | None:
        """Records the states (C, P) after warm-up transition ``it`` (0-based).

        Returns:
            The new inverse mass matrix diagonal (C, P) at the end of a window that collected more than two draws
            (the draws then start again), else None (a shorter window's draws carry over into the next).
        """
        if any(start <= it < end for start, end in self.windows):
            self._draws.append(states)
        if any(it == end - 1 for _, end in self.windows) and len(self._draws) > 2:
            n = len(self._draws)
            var = torch.stack(self._draws).var(0)
            self._draws = []
            return (n / (n + 5.0)) * var + 1e-3 * (5.0 / (n + 5.0))  # Stan's regularisation
        return None


class ProposalAdaptation:
    """The random-walk proposal's scale s (C,) and shape d (C, P) per chain (module docstring).

    Args:
        init_scale: s at the start (> 0).
        target: the acceptance rate α* the scale adapts to.
        num_warmup: the number of warm-up transitions.
        states: the starting states (C, P) (their shape, dtype and device).
    """

    def __init__(self, init_scale: float, target: float, num_warmup: int, states: torch.Tensor):
        self.target, self.num_warmup = target, num_warmup
        self.log_scale = torch.full((states.shape[0],), math.log(init_scale), dtype=states.dtype,
                                    device=states.device)
        self.shape = torch.ones_like(states)
        self._second_half: list[torch.Tensor] = []

    @property
    def scale(self) -> torch.Tensor:
        """The proposal scale s of every chain, (C,)."""
        return self.log_scale.exp()

    def update(self, it: int, accept_prob: torch.Tensor, states: torch.Tensor) -> None:
        """Folds in warm-up transition ``it`` (0-based): its acceptance probabilities (C,) and the states (C, P)."""
        self.log_scale = self.log_scale + (accept_prob - self.target) / (it + 1) ** 0.6
        if it >= self.num_warmup // 2:
            self._second_half.append(states)
        if it == self.num_warmup - 1 and len(self._second_half) > 10:
            var = torch.stack(self._second_half).var(0)  # (C, P)
            scale = var.mean(1, keepdim=True).clamp_min(1e-30)
            self.shape = (var / scale).clamp(1e-3, 1e3).sqrt()  # the shape of the posterior per chain
