"""Fused hot-path kernels with analytic gradients (``torch.autograd.Function`` + foreach ops).

Every training step of a Bayesian method does a few passes over all
parameters besides the network itself: drawing a sample, the KL or prior term,
and their gradients. Written as plain per-tensor autograd expressions these
are ~15–20 elementwise passes and ~10 small ops per parameter tensor. The
functions here compute the same values with multi-tensor (``torch._foreach_*``)
kernels and write the gradients in closed form, so no intermediate is kept for
backward beyond the tensors autograd keeps anyway.

The plain autograd versions are kept as the reference implementations
(``VI(..., fused=False)``, ``GaussianPrior.penalty(..., fused=False)``); the
tests check that both give the same loss and gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def standard_normal_like(tensors: Sequence[torch.Tensor], generator: torch.Generator | None = None,
                         ) -> list[torch.Tensor]:
    """ε ~ N(0, I) shaped like each tensor, drawn with one ``randn`` call and split into views.

    Args:
        tensors: reference tensors (same dtype and device).
        generator: optional ``torch.Generator``.

    Returns:
        A list of tensors of the reference shapes.
    """
    numels = [t.numel() for t in tensors]
    ref = tensors[0]
    flat = torch.randn(sum(numels), generator=generator, device=ref.device, dtype=ref.dtype)
    return [chunk.view(t.shape) for chunk, t in zip(flat.split(numels), tensors)]


def _sum_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(tensors)).pow(2).sum()


class _MeanFieldSample(torch.autograd.Function):
    """θ = m + exp(κρ) ⊙ ε and KL(N(m, s²) || N(θ̄, σ²)) in one pass, gradients in closed form.

    Inputs: ``(info, *m, *rho)``; outputs ``(*theta, kl)``. Saved for backward:
    m and ρ (the parameters themselves), θ (which the network keeps for its own
    backward anyway) and s = exp(κρ) (one parameter-sized copy). ε is
    recovered as (θ − m)/s.
    """

    @staticmethod
    def forward(ctx, info, *tensors):
        n, prior_idx, prior_means, var0, log_std0, generator, kappa = info
        m, rho = list(tensors[:n]), list(tensors[n:])
        s = torch._foreach_exp(torch._foreach_mul(rho, kappa))
        theta = torch._foreach_addcmul(m, s, standard_normal_like(m, generator))
        kl = m[0].new_zeros(())
        if prior_idx:
            mp, sp = [m[i] for i in prior_idx], [s[i] for i in prior_idx]
            diff = torch._foreach_sub(mp, prior_means)
            log_s = kappa * torch.stack([rho[i].sum() for i in prior_idx]).sum()  # Σ log s = κ Σ ρ
            count = sum(t.numel() for t in mp)
            kl = (_sum_squares(diff) + _sum_squares(sp)) / (2 * var0) - log_s + count * (log_std0 - 0.5)
        ctx.info = (n, prior_idx, prior_means, var0, kappa)
        ctx.save_for_backward(*m, *rho, *theta, *s)
        return (*theta, kl)

    @staticmethod
    def backward(ctx, *grads):
        n, prior_idx, prior_means, var0, kappa = ctx.info
        saved = ctx.saved_tensors
        m, rho, theta, s = (list(saved[i * n:(i + 1) * n]) for i in range(4))
        g = [torch.zeros_like(t) if gi is None else gi for gi, t in zip(grads[:n], theta)]
        k = 0.0 if grads[n] is None or not prior_idx else float(grads[n])  # d loss / d KL
        # ∂L/∂s = g ⊙ ε + k (s/σ² − 1/s) and ∂s/∂ρ = κ s, so with ε = (θ − m)/s
        # ∂L/∂ρ = κ [g ⊙ (θ − m) + k (s²/σ² − 1)]  (no division by s)
        grad_rho = list(torch._foreach_sub(theta, m))
        torch._foreach_mul_(grad_rho, g)
        grad_m = list(g)  # ∂L/∂m = g + k (m − θ̄)/σ²
        if k:
            gp, sp = [grad_rho[i] for i in prior_idx], [s[i] for i in prior_idx]
            torch._foreach_addcmul_(gp, sp, sp, value=k / var0)
            torch._foreach_add_(gp, -k)
            diff = torch._foreach_sub([m[i] for i in prior_idx], prior_means)
            for i, gm in zip(prior_idx, torch._foreach_add([g[i] for i in prior_idx], diff, alpha=k / var0)):
                grad_m[i] = gm
        torch._foreach_mul_(grad_rho, kappa)
        return (None, *grad_m, *grad_rho)


def mean_field_sample(m: list[torch.Tensor], rho: list[torch.Tensor], prior_idx: list[int],
                      prior_means: list[torch.Tensor], prior_std: float, log_std_scale: float = 1.0,
                      generator: torch.Generator | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Reparameterised sample of a mean-field Gaussian and its analytic KL to N(θ̄, σ² I).

    θ_i = m_i + s_i ε_i with s_i = exp(κ ρ_i) and ε ~ N(0, I) (Blundell et al.
    2015; the std parameterisation of :class:`bayeswrap.VI`), and
    KL = Σ_{i ∈ prior_idx} [log(σ/s_i) + (s_i² + (m_i − θ̄_i)²)/(2σ²) − 1/2]
    (BayesDLL eq. 7). Gradients w.r.t. m and ρ are written in closed form.

    Args:
        m: variational means, one tensor per parameter.
        rho: scaled log-stds ρ = log(s)/κ, same shapes.
        prior_idx: indices of the tensors that have a prior (the others get no KL term).
        prior_means: θ̄ for the tensors in ``prior_idx``, in that order.
        prior_std: σ > 0.
        log_std_scale: κ > 0.
        generator: optional ``torch.Generator`` for ε.

    Returns:
        ``(theta, kl)``: the sampled tensors and the scalar KL in nats.
    """
    info = (len(m), list(prior_idx), list(prior_means), float(prior_std) ** 2, math.log(prior_std), generator,
            float(log_std_scale))
    out = _MeanFieldSample.apply(info, *m, *rho)
    return list(out[:-1]), out[-1]


class _GaussianPenalty(torch.autograd.Function):
    """Σ_i c_i ‖θ_i − θ̄_i‖² with gradient 2 c_i (θ_i − θ̄_i), via foreach kernels."""

    @staticmethod
    def forward(ctx, info, *theta):
        means, scales = info
        diff = torch._foreach_sub(list(theta), means)
        norms = torch.stack(torch._foreach_norm(diff))
        ctx.info = info
        ctx.save_for_backward(*theta)
        return (norms.pow(2) * norms.new_tensor(scales)).sum()

    @staticmethod
    def backward(ctx, grad):
        means, scales = ctx.info
        diff = torch._foreach_sub(list(ctx.saved_tensors), means)
        torch._foreach_mul_(diff, [2.0 * c * float(grad) for c in scales])
        return (None, *diff)


def gaussian_penalty(theta: list[torch.Tensor], means: list[torch.Tensor], scales: list[float]) -> torch.Tensor:
    """Σ_i c_i ‖θ_i − θ̄_i‖² (a Gaussian negative log prior up to a constant), fused.

    Args:
        theta: parameter tensors.
        means: prior means θ̄_i, same shapes.
        scales: per-tensor factors c_i (e.g. (1 − p)/(2σ²)).

    Returns:
        A scalar tensor.
    """
    return _GaussianPenalty.apply((list(means), list(scales)), *theta)
