"""MAP: the deterministic baseline (BayesDLL's "vanilla").

The Bayesian parameters are a point estimate θ trained on
loss = NLL + kl_weight · Σ (θ − θ̄)² / (2 σ² N): an L2 pull towards the prior
mean θ̄, scaled exactly like the prior term of the other methods. With
``prior_std=None`` there is no prior: plain maximum likelihood (BayesDLL's
vanilla with wd = 0).
"""

from __future__ import annotations

import torch

from bayeswrap.core import fused
from bayeswrap.core.functional import NamedTensors
from bayeswrap.methods.base import BayesianModel, register_method


@register_method("map", order=10)
class MAP(BayesianModel):
    """Maximum a posteriori point estimate, BayesDLL's "vanilla" (Kim & Hospedales 2023); the posterior is a point
    mass at θ; ``prior_std=None`` is maximum likelihood.

    Takes exactly the arguments of :class:`~bayeswrap.BayesianModel`
    (``prior_std=None`` is accepted here and means no prior).

    Attributes:
        theta: the Bayesian parameters θ (trainable), initialised at the model's weights.
    """

    allows_no_prior = True
    tuning = ("prior_std", (0.1, 0.3, 1.0, 3.0, 10.0))  # the weight decay 1/(N σ²) of the plain network
    in_default_comparison = True

    def _init_posterior(self, init):
        self.theta = NamedTensors(init, trainable=True)

    def _train_sample(self):
        return self.theta.as_dict()

    def _sample_and_regularizer(self):
        """θ and the prior term from one fused node per bucket (:func:`bayeswrap.core.fused.penalised`): the
        prior's gradient is added to the network's as it passes instead of being summed by autograd. The same
        values and gradients as ``_train_sample()`` and ``regularizer()``, which subclasses that override either
        (and the unfused reference, ``fused=False`` of the prior) keep using.
        """
        cls = type(self)
        if cls._train_sample is not MAP._train_sample or cls.regularizer is not MAP.regularizer:
            return super()._sample_and_regularizer()
        theta = self.theta.as_dict()
        names = [n for n in theta if self.prior.applies_to(n)]
        if not names:
            return super()._sample_and_regularizer()
        views, penalty = fused.penalised([theta[n] for n in names], [self.prior.mean[n] for n in names],
                                         [0.5 / self.prior_std**2] * len(names))
        theta.update(zip(names, views))
        return theta, penalty

    def regularizer(self) -> torch.Tensor:
        """Σ_i (θ_i − θ̄_i)² / (2σ²): −log N(θ; θ̄, σ²I) up to a constant (0 without a prior)."""
        return self.prior.penalty(self.theta.as_dict())

    def posterior_mean(self):
        """θ itself, ``{name: tensor}``."""
        return self.theta.as_dict()

    def posterior_std(self):
        """Zeros: a point estimate has no spread."""
        return {n: torch.zeros_like(t) for n, t in self.theta.items()}
