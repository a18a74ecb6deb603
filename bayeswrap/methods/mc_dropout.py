"""MC-dropout applied to parameters, towards the prior mean (BayesDLL §2.2).

Each parameter is kept with probability 1 − p or reset to its prior mean:
θ = z ⊙ m + (1 − z) ⊙ θ̄ with z ~ Bernoulli(1 − p), i.e. q(θ_i) is the spiky
mixture (1 − p) δ(m_i) + p δ(θ̄_i). The loss is BayesDLL's eq. 10:

    L(m) = NLL(y | x, θ) + kl_weight · Σ_i (1 − p_i) (m_i − θ̄_i)² / (2 σ² N).

Reference: Gal & Ghahramani 2016, "Dropout as a Bayesian Approximation".
"""

from __future__ import annotations

import torch

from bayeswrap.core import fused
from bayeswrap.core.checks import check_bool
from bayeswrap.core.functional import NamedTensors, is_bias
from bayeswrap.core.fused import dropout_sample, uniform_like
from bayeswrap.methods.base import BayesianModel, check_float, check_int, register_method

BIAS_OPTIONS = ("informative", "uninformative", "gaussian", "spikymix", "ignore")


@register_method("mc_dropout")
class MCDropout(BayesianModel):
    """Parameter dropout towards θ̄.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        p_drop: probability p ∈ [0, 1) that a parameter is reset to its prior
            mean in a sample (BayesDLL default 0.1).
        bias: how ``*.bias`` parameters are treated:
            ``"informative"`` / ``"spikymix"``: like weights (dropout and the
            (1 − p)-scaled prior term);
            ``"gaussian"``: no dropout (p_b = 0), full Gaussian prior term
            (the original MC-dropout);
            ``"uninformative"``: dropout, but no prior term (p(θ_b) ∝ 1);
            ``"ignore"``: neither dropout nor prior term.
        num_train_samples: dropout masks per training step (≥ 1).
        fused: draw the training sample and the prior term with the fused
            bucketed kernel and closed-form gradients
            (:func:`bayeswrap.core.fused.dropout_sample`); False uses the plain
            autograd reference. Same values and gradients.

    Raises:
        ValueError: if ``p_drop`` is not a number in [0, 1), ``num_train_samples`` not an
            integer ≥ 1 or ``bias`` unknown.

    Attributes:
        theta: the kept values m, ``{name: Parameter}``.
    """

    bias_options = BIAS_OPTIONS
    tuning = ("p_drop", (0.02, 0.05, 0.1, 0.2, 0.3))  # the dropout rate sets the posterior spread
    in_default_comparison = True

    def __init__(self, model, *, p_drop: float = 0.1, num_train_samples: int = 1, fused: bool = True, **kwargs):
        self.fused = check_bool("fused", fused)
        self.p_drop = check_float("p_drop", p_drop, low=0.0, high=1.0, high_open=True,
                                  note="the probability that a parameter is reset to its prior mean")
        self.num_train_samples = check_int("num_train_samples", num_train_samples, minimum=1)
        super().__init__(model, **kwargs)

    def _prior_bias(self, bias):
        return "uninformative" if bias in ("uninformative", "ignore") else "informative"

    def _init_posterior(self, init):
        self.theta = NamedTensors(init, trainable=True)
        no_drop_bias = self.bias in ("gaussian", "ignore")
        self.drop_prob = {n: 0.0 if (no_drop_bias and is_bias(n)) else self.p_drop for n in init}

    def _masked(self, shape_prefix=(), generator=None):
        out = {}
        dropped = [n for n in self.theta.keys() if self.drop_prob[n] > 0.0]
        # a training sample draws its u exactly as the fused kernel does (bayeswrap.core.fused.uniform_like)
        u = dict(zip(dropped, uniform_like([self.theta[n] for n in dropped], generator))) \
            if not shape_prefix and dropped else {}
        for n, m in self.theta.items():
            p = self.drop_prob[n]
            if p == 0.0:
                out[n] = m.expand(*shape_prefix, *m.shape) if shape_prefix else m
                continue
            draws = u[n] if n in u else torch.rand((*shape_prefix, *m.shape), device=m.device, generator=generator)
            out[n] = torch.where(draws >= p, m, self.prior.mean[n])
        return out

    def _train_sample(self):
        return self._masked()

    def _sample_and_regularizer(self):
        if not self.fused or not fused.available():
            return super()._sample_and_regularizer()
        names = self.theta.keys()
        dropped = [n for n in names if self.drop_prob[n] > 0.0]
        if not dropped:
            return super()._sample_and_regularizer()
        kept = [n for n in names if self.drop_prob[n] == 0.0]
        scales = [(1.0 - self.drop_prob[n]) * 0.5 / self.prior_std**2 if self.prior.applies_to(n) else 0.0
                  for n in dropped]
        theta, penalty = dropout_sample([self.theta[n] for n in dropped], [self.drop_prob[n] for n in dropped],
                                        [self.prior.mean[n] for n in dropped], scales)
        sample = dict(zip(dropped, theta))
        if kept:
            sample.update({n: self.theta[n] for n in kept})
            penalty = penalty + self.prior.penalty({n: self.theta[n] for n in kept})
        return {n: sample[n] for n in names}, penalty

    def regularizer(self) -> torch.Tensor:
        """Σ_i (1 − p_i)(m_i − θ̄_i)² / (2σ²), the KL approximation of eq. 10, in nats."""
        return self.prior.penalty(self.theta.as_dict(), scale={n: 1.0 - p for n, p in self.drop_prob.items()})

    def posterior_mean(self):
        """Mixture mean (1 − p) m + p θ̄, ``{name: tensor}``."""
        return {n: m if self.drop_prob[n] == 0 else (1 - self.drop_prob[n]) * m + self.drop_prob[n] * self.prior.mean[n]
                for n, m in self.theta.items()}

    def posterior_std(self):
        """Mixture std sqrt(p (1 − p)) |m − θ̄|, ``{name: tensor}``."""
        return {n: (self.drop_prob[n] * (1 - self.drop_prob[n])) ** 0.5 * (m - self.prior.mean[n]).abs()
                for n, m in self.theta.items()}

    def sample(self, num_samples, generator=None):
        """Draws S dropout samples θ_s = z_s ⊙ m + (1 − z_s) ⊙ θ̄, ``{name: (S, *shape)}``."""
        num_samples = check_int("num_samples", num_samples, minimum=1)
        return self._masked((num_samples,), generator)
