"""Variational dropout with the log-uniform prior: sparse VD (Molchanov) and Kingma's VD.

Both put the improper log-uniform prior p(|w|) ∝ 1/|w| on every Bayesian
weight and a Gaussian posterior on it. The KL to this prior is defined only up
to an additive constant and depends only on the dropout rate α = σ²/θ²; both
methods use a closed-form approximation of it.

``"sparse_vd"``, Molchanov et al. 2017, "Variational Dropout Sparsifies Deep
Neural Networks" (ICML), §4.1–4.2 (additive reparameterisation, unbounded α):

    q(w) = N(θ, σ²),   w = θ + σ ε,   ε ~ N(0, 1),   log α = log σ² − log θ²,
    −KL(q || p) ≈ k1 · sigmoid(k2 + k3 · log α) − 0.5 · log1p(1/α) − k1         (eq. 14)
    k1 = 0.63576, k2 = 1.87320, k3 = 1.48695.

The constant −k1 makes the KL vanish as α → ∞. The exact value up to that
constant is 0.5 log α − E_{ε~N(1, α)} log|ε| − (γ + log 2)/2 (eq. 9 with
Molchanov's normalisation); the approximation is within 0.009 nats of it for
log α ∈ [−4, 4] (tests/test_sparse_vd.py). Weights with log α > 3 are pruned
(:mod:`bayeswrap.methods.sparsity`).

``"kingma_vd"``, Kingma, Salimans & Welling 2015, "Variational Dropout and the
Local Reparameterization Trick" (NeurIPS), §3.3 and eq. (12), with one α per weight:

    w = θ · (1 + √α ε),   q(w) = N(θ, α θ²),   α ≤ 1 (clipped, as in the paper),
    −KL ≈ 0.5 · log α + c1 α + c2 α² + c3 α³ (+ const)
    c1 = 1.16145124, c2 = −1.50204118, c3 = 0.58629921.

The constant is left out (as in the paper), so the reported KL can be negative.
Because α ≤ 1 means SNR = 1/√α ≥ 1, no weight reaches log α > 3 or SNR < 0.83:
Kingma's VD does not sparsify; that bound is what Molchanov removed.

Model-agnostic noise. Both papers train with the local reparameterisation trick
(noise on the pre-activations of fully connected and convolutional layers).
bayeswrap wraps any module through ``torch.func.functional_call`` and does not
know its layers, so it samples the weights themselves, one draw per training
step shared by the batch (as :class:`~bayeswrap.VI` does); the objective is the
same, its gradient is noisier. ``num_train_samples`` > 1 averages draws.

Numerical safety: in the KL, log α is computed as log σ² − log(θ² + 1e-16)
and clipped to [−10, 10] (sparse VD; as in Molchanov et al.'s code), where the
approximation is flat to < 5e-5 nats; Kingma's log α is kept ≤ 0 by clipping
in the forward pass and by projecting the parameter after every optimizer step.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch
import torch.nn.functional as F

from bayeswrap.core.functional import NamedTensors, is_bias
from bayeswrap.methods.base import BayesianModel, check_float, check_int, register_method
from bayeswrap.methods.sparsity import SparsityMixin

K1, K2, K3 = 0.63576, 1.87320, 1.48695
C1, C2, C3 = 1.16145124, -1.50204118, 0.58629921
LOG_ALPHA_CLIP = (-10.0, 10.0)
#: accepted initial log-variances (log σ², log α): exp(±80) ≈ 5.5e34 / 1.8e-35, so float32 holds
#: exp(v), exp(v/2) and their inverses
LOG_VAR_RANGE = (-80.0, 80.0)
THETA_EPS = 1e-16
PRIORS = ("log_uniform",)

__all__ = ["SparseVD", "KingmaVD", "sparse_vd_kl", "kingma_vd_kl", "PRIORS", "LOG_ALPHA_CLIP"]


def sparse_vd_kl(log_alpha: torch.Tensor) -> torch.Tensor:
    """Molchanov's approximation of KL(N(θ, αθ²) || log-uniform), elementwise (eq. 14).

    KL ≈ k1 − k1 · sigmoid(k2 + k3 · log α) + 0.5 · log1p(1/α), with
    log1p(1/α) = softplus(−log α) for stability. It is ≥ 0 and → 0 as α → ∞.

    Args:
        log_alpha: log α, any shape.

    Returns:
        KL in nats, the shape of ``log_alpha``.
    """
    return K1 - K1 * torch.sigmoid(K2 + K3 * log_alpha) + 0.5 * F.softplus(-log_alpha)


def kingma_vd_kl(log_alpha: torch.Tensor) -> torch.Tensor:
    """Kingma et al.'s approximation of KL(N(θ, αθ²) || log-uniform) up to a constant, elementwise.

    KL ≈ −(0.5 log α + c1 α + c2 α² + c3 α³) (Kingma et al. 2015, eq. 12),
    meant for α ∈ (0, 1].

    Args:
        log_alpha: log α ≤ 0, any shape.

    Returns:
        KL in nats up to a constant (can be negative), the shape of ``log_alpha``.
    """
    alpha = log_alpha.exp()
    return -(0.5 * log_alpha + alpha * (C1 + alpha * (C2 + alpha * C3)))


class _LogUniformVD(SparsityMixin, BayesianModel):
    """What sparse and Kingma VD share: the log-uniform prior, the keep mask, pruning."""

    allows_no_prior = True
    default_sparsity_rule = "log_alpha"

    def __init__(self, model, *, prior: str = "log_uniform", num_train_samples: int = 1, **kwargs):
        if prior not in PRIORS:
            raise ValueError(f"prior={prior!r} is not known for method {self.method!r}; accepted: {PRIORS} "
                             "(for a Gaussian prior use method 'vi')")
        self.prior_name = prior
        self.num_train_samples = check_int("num_train_samples", num_train_samples, minimum=1)
        super().__init__(model, **kwargs)

    def _has_kl(self, name: str) -> bool:
        return not (self.bias == "uninformative" and is_bias(name))

    def _init_keep(self, init):
        self.keep = NamedTensors({n: torch.ones_like(t, dtype=torch.bool) for n, t in init.items()},
                                 trainable=False)

    @abstractmethod
    def _theta(self) -> dict[str, torch.Tensor]:
        """The weight means θ, ``{name: tensor}``."""

    @abstractmethod
    def _std(self) -> dict[str, torch.Tensor]:
        """The weight stds σ, ``{name: tensor}``."""

    @abstractmethod
    def _kl_elementwise(self, name: str) -> torch.Tensor:
        """The approximate KL of every weight of parameter ``name``, its shape."""

    def regularizer(self) -> torch.Tensor:
        """Σ over unpruned weights with a prior of the approximate KL, in nats (see the module docstring).

        Pruned weights (the α → ∞ limit, removed from the model) contribute 0;
        biases too with ``bias="uninformative"``.
        """
        total = None
        for n, keep in self.keep.items():
            if not self._has_kl(n):
                continue
            term = torch.where(keep, self._kl_elementwise(n), 0.0).sum()
            total = term if total is None else total + term
        if total is None:
            return next(iter(self._theta().values())).new_zeros(())
        return total

    def posterior_mean(self):
        """θ with pruned weights at 0, ``{name: tensor}``."""
        return {n: torch.where(self.keep[n], t, 0.0) for n, t in self._theta().items()}

    def posterior_std(self):
        """σ with pruned weights at 0, ``{name: tensor}``."""
        return {n: torch.where(self.keep[n], s, 0.0) for n, s in self._std().items()}

    def _train_sample(self):
        mean, std = self.posterior_mean(), self.posterior_std()
        return {n: m + std[n] * torch.randn_like(m) for n, m in mean.items()}


    def log_alpha(self) -> dict[str, torch.Tensor]:
        """Log α = log σ² − log θ² of every weight (unclipped; +inf where pruned), ``{name: tensor}``."""
        with torch.no_grad():
            mean, std = self.posterior_mean(), self.posterior_std()
            return {n: torch.where(self.keep[n], torch.log(std[n].pow(2)) - torch.log(m.pow(2)), math.inf)
                    for n, m in mean.items()}


@register_method("sparse_vd")
class SparseVD(_LogUniformVD):
    """Sparse variational dropout (Molchanov et al. 2017): per-weight α, unbounded, log-uniform prior.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` (``prior_std`` and
    ``prior_mean`` are accepted for a uniform interface and ignored: the
    log-uniform prior has no scale and is centred at 0) plus:

    Args:
        init_log_var: initial log σ² of every weight, in [−80, 80] (default −10, as in
            Molchanov et al.'s code). The means θ start at the model's
            (e.g. pretrained) weights.
        prior: ``"log_uniform"`` (the only one; anything else is a ValueError).
        num_train_samples: weight draws per training step (integer ≥ 1).
        bias: ``"informative"`` (biases get the prior and can be pruned) or
            ``"uninformative"`` (no KL term for ``*.bias``).

    Raises:
        ValueError: for ``init_log_var`` outside [−80, 80] (float32 must hold σ²),
            an unknown ``prior``, or ``num_train_samples`` not an integer ≥ 1.

    Attributes:
        theta: the means θ, ``{name: Parameter}``.
        log_sigma2: log σ², ``{name: Parameter}``.
        keep: bool masks, False where pruned (buffers).

    Example:
        >>> bnn = bw.wrap(pretrained_mlp, "sparse_vd", num_data=len(train_set))
        >>> bw.fit(bnn, loader, epochs=100, optimizer=torch.optim.Adam(bnn.parameters(), 1e-3))
        >>> print(bnn.sparsity())       # log α > 3
        >>> bnn.prune(); net = bnn.to_deterministic()
    """

    def __init__(self, model, *, init_log_var: float = -10.0, prior: str = "log_uniform",
                 num_train_samples: int = 1, **kwargs):
        self.init_log_var = check_float("init_log_var", init_log_var, low=LOG_VAR_RANGE[0], high=LOG_VAR_RANGE[1],
                                        note="log σ²; float32 must hold σ² = exp(init_log_var)")
        super().__init__(model, prior=prior, num_train_samples=num_train_samples, **kwargs)

    def _init_posterior(self, init):
        self.theta = NamedTensors(init, trainable=True)
        self.log_sigma2 = NamedTensors({n: torch.full_like(t, self.init_log_var) for n, t in init.items()},
                                       trainable=True)
        self._init_keep(init)

    def _theta(self):
        return self.theta.as_dict()

    def _std(self):
        return {n: (0.5 * v).exp() for n, v in self.log_sigma2.items()}

    def clipped_log_alpha(self, name: str) -> torch.Tensor:
        """clip(log σ² − log(θ² + 1e-16), −10, 10) of one tensor (differentiable), used in the KL."""
        theta = self.theta[name]
        return (self.log_sigma2[name] - torch.log(theta * theta + THETA_EPS)).clamp(*LOG_ALPHA_CLIP)

    def _kl_elementwise(self, name):
        return sparse_vd_kl(self.clipped_log_alpha(name))

    def _apply_prune(self, masks):
        for n, m in masks.items():
            self.keep[n] = self.keep[n] & ~m
            self.theta[n].data.masked_fill_(m, 0.0)


@register_method("kingma_vd")
class KingmaVD(_LogUniformVD):
    """Kingma et al.'s variational dropout: multiplicative noise, α ≤ 1, log-uniform prior.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` (``prior_std`` and
    ``prior_mean`` are accepted and ignored, as for :class:`SparseVD`) plus:

    Args:
        init_log_alpha: initial log α in [−80, 0] of every weight (default −4, i.e.
            α ≈ 0.018, Gaussian dropout with a small rate). θ starts at the model's weights.
        prior: ``"log_uniform"`` only.
        num_train_samples: weight draws per training step (integer ≥ 1).

    Raises:
        ValueError: for ``init_log_alpha`` outside [−80, 0], an unknown ``prior``, or
            ``num_train_samples`` not an integer ≥ 1.

    Attributes:
        theta: the means θ, ``{name: Parameter}``.
        log_alpha_param: log α, projected to ≤ 0 after every step, ``{name: Parameter}``.
        keep: bool masks, False where pruned.
    """

    def __init__(self, model, *, init_log_alpha: float = -4.0, prior: str = "log_uniform",
                 num_train_samples: int = 1, **kwargs):
        self.init_log_alpha = check_float("init_log_alpha", init_log_alpha, low=LOG_VAR_RANGE[0], high=0.0,
                                          note="log α; α ≤ 1 and float32 must hold α = exp(init_log_alpha)")
        super().__init__(model, prior=prior, num_train_samples=num_train_samples, **kwargs)

    def _init_posterior(self, init):
        self.theta = NamedTensors(init, trainable=True)
        self.log_alpha_param = NamedTensors({n: torch.full_like(t, self.init_log_alpha) for n, t in init.items()},
                                            trainable=True)
        self._init_keep(init)

    def _clipped(self, name: str) -> torch.Tensor:
        return self.log_alpha_param[name].clamp(max=0.0)

    def _theta(self):
        return self.theta.as_dict()

    def _std(self):
        """√α · |θ|."""
        return {n: (0.5 * self._clipped(n)).exp() * t.abs() for n, t in self.theta.items()}

    def _train_sample(self):
        """W = θ (1 + √α ε) (pruned weights 0)."""
        out = {}
        for n, t in self.theta.items():
            w = t * (1 + (0.5 * self._clipped(n)).exp() * torch.randn_like(t))
            out[n] = torch.where(self.keep[n], w, 0.0)
        return out

    def _kl_elementwise(self, name):
        return kingma_vd_kl(self._clipped(name))

    @torch.no_grad()
    def after_step(self) -> None:
        """Projects log α onto (−∞, 0] (α ≤ 1) and counts the step."""
        super().after_step()
        for p in self.log_alpha_param.values():
            p.clamp_(max=0.0)

    def _apply_prune(self, masks):
        for n, m in masks.items():
            self.keep[n] = self.keep[n] & ~m
            self.theta[n].data.masked_fill_(m, 0.0)
