"""Mean-field Gaussian variational inference, Bayes-by-backprop (BayesDLL §2.1).

q(θ) = N(m, diag(s²)) with s = softplus(ρ). The loss is the negative ELBO per
datum (eq. 6):

    L(m, ρ) = (1/S) Σ_s NLL(y | x, m + s ⊙ ε_s) + kl_weight · KL(q || p) / N,

with ε_s ~ N(0, I) (the reparameterisation trick) and the analytic Gaussian KL
(eq. 7). Gradients come from autograd.

Reference: Blundell et al. 2015, "Weight Uncertainty in Neural Networks".
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..functional import NamedTensors
from ..fused import mean_field_sample, standard_normal_like
from ..sparsity import SparsityMixin
from .base import BayesianModel, _positive, register_method


def inverse_softplus(value: float) -> float:
    """ρ with softplus(ρ) = value (value > 0)."""
    return value + math.log(-math.expm1(-value))


@register_method("vi")
class VI(SparsityMixin, BayesianModel):  # + sparsity/prune/prune_random/to_deterministic (bayeswrap.sparsity)
    """Mean-field Gaussian VI over the Bayesian parameters.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        init_std: initial posterior std s₀ (> 0), in parameter units. The
            means m start at the model's weights (= θ̄ for ``prior_mean="init"``).
            BayesDLL starts at s = 1e-6 with a clamped direct parameterisation;
            with s = softplus(ρ) a start of 1e-3 keeps ρ's gradient usable.
        num_train_samples: Monte Carlo samples of θ per training step (≥ 1).
        fused: draw the sample and the KL with the fused multi-tensor kernel
            and closed-form gradients (:func:`bayeswrap.fused.mean_field_sample`);
            False uses the plain autograd reference. Same values and gradients.

    Attributes:
        mean: variational means m, ``{name: Parameter}``.
        rho: softplus-inverse of the stds, ``{name: Parameter}``.
    """

    def __init__(self, model, *, init_std: float = 1e-3, num_train_samples: int = 1, fused: bool = True, **kwargs):
        self.init_std = _positive("init_std", init_std)
        self.fused = bool(fused)
        self.num_train_samples = int(_positive("num_train_samples", num_train_samples))
        super().__init__(model, **kwargs)

    def _init_posterior(self, init):
        self.mean = NamedTensors(init, trainable=True)
        rho0 = inverse_softplus(self.init_std)
        self.rho = NamedTensors({n: torch.full_like(t, rho0) for n, t in init.items()}, trainable=True)

    def _train_sample(self):
        means = self.mean.values()
        eps = standard_normal_like(means)
        return {n: m + F.softplus(r) * e for n, m, r, e in zip(self.mean.keys(), means, self.rho.values(), eps)}

    def _sample_and_regularizer(self):
        if not self.fused:
            return super()._sample_and_regularizer()
        names = self.mean.keys()
        prior_idx = [i for i, n in enumerate(names) if self.prior.applies_to(n)]
        theta, kl = mean_field_sample(self.mean.values(), self.rho.values(), prior_idx,
                                      [self.prior.mean[names[i]] for i in prior_idx], self.prior_std)
        return dict(zip(names, theta)), kl

    def regularizer(self) -> torch.Tensor:
        """Analytic KL(N(m, s²) || N(θ̄, σ²)) in nats (BayesDLL eq. 7)."""
        return self.prior.kl(self.mean.as_dict(), self.posterior_std())

    def posterior_mean(self):
        """m, ``{name: tensor}``."""
        return self.mean.as_dict()

    def posterior_std(self):
        """s = softplus(ρ), ``{name: tensor}``."""
        return {n: F.softplus(r) for n, r in self.rho.items()}
