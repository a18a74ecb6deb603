"""Optimizers that are part of an inference method: SGLD.

Reference: Welling & Teh 2011, "Bayesian Learning via Stochastic Gradient
Langevin Dynamics"; BayesDLL eq. 12.
"""

from __future__ import annotations

import math

import torch


class SGLD(torch.optim.Optimizer):
    """Stochastic-gradient Langevin dynamics for a per-datum loss.

    For the per-datum objective L(θ) = U(θ)/N (U the negative log posterior),
    each step is

        θ ← θ − lr · ∇L(θ) + noise_scale · sqrt(2 · lr / N) · ε,    ε ~ N(0, I),

    i.e. Langevin dynamics on U with step size lr/N. ``noise_scale`` is
    BayesDLL's ``nd`` (1 = the exact posterior; < 1 a cold posterior). There is
    no momentum: the Langevin noise must never pass through a momentum buffer.

    Args:
        params: parameters or parameter groups; a group may set its own
            ``noise_scale`` (``BayesianModel.param_groups()`` gives point
            estimates ``noise_scale=0``).
        lr: learning rate (> 0).
        num_data: N (≥ 1), the same N as the model's ``num_data``.
        noise_scale: multiplier of the injected noise (≥ 0).
        generator: optional ``torch.Generator`` for the noise.

    Raises:
        ValueError: on a non-positive ``lr`` or ``num_data`` or negative ``noise_scale``.
    """

    def __init__(self, params, lr: float, num_data: int, noise_scale: float = 1.0,
                 generator: torch.Generator | None = None):
        if not lr > 0:
            raise ValueError(f"lr={lr!r} must be > 0")
        if not num_data >= 1:
            raise ValueError(f"num_data={num_data!r} must be >= 1")
        if not noise_scale >= 0:
            raise ValueError(f"noise_scale={noise_scale!r} must be >= 0")
        super().__init__(params, dict(lr=lr, num_data=num_data, noise_scale=noise_scale))
        self.generator = generator

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one Langevin step; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])
            scale = group["noise_scale"] * math.sqrt(2.0 * group["lr"] / group["num_data"])
            if scale > 0:
                noise = [torch.randn(p.shape, generator=self.generator, device=p.device, dtype=p.dtype)
                         for p in params]
                torch._foreach_add_(params, noise, alpha=scale)
        return loss
