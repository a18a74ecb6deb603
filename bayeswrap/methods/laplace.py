"""Diagonal Laplace approximation with the (empirical) Fisher (BayesDLL §2.4).

Training is MAP with the prior term. Afterwards :meth:`Laplace.fit_curvature`
computes the diagonal posterior variance (eqs. 17–19)

    v_i = 1 / (1/σ² + (N / n) Σ_{n} g_{n,i}²),    g_n = ∇_θ [−log p(y_n | x_n, θ*)],

from per-example gradients obtained with ``torch.func.vmap(torch.func.grad(...))``
over chunks of each batch (no Python loop over examples). n is the number of
examples seen; with n = N (one pass over the training set) the factor is 1.
The posterior is N(θ*, diag(v)).

Reference: MacKay 1992; Ritter et al. 2018; Daxberger et al. 2021 (laplace-torch).
"""

from __future__ import annotations

import warnings

import torch
from torch.func import grad, vmap

from ..functional import NamedTensors
from .base import NotFittedError, register_method
from .map import MAP

CURVATURES = ("empirical_fisher", "fisher")


@register_method("laplace")
class Laplace(MAP):
    """Diagonal Laplace approximation around the MAP estimate.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        curvature: ``"empirical_fisher"`` (gradients at the observed labels,
            the default) or ``"fisher"`` (labels sampled from the model's own
            predictive p(y | x, θ*): one Monte Carlo sample of the true Fisher).
        curvature_chunk_size: examples per ``vmap`` chunk when computing
            per-example gradients; bounds memory to that many gradient copies.

    Attributes:
        theta: θ* (trained as MAP).
        posterior_var: v, ``{name: tensor}`` (zeros until fitted).
        curvature_fitted: 0-d bool buffer.
    """

    def __init__(self, model, *, curvature: str = "empirical_fisher", curvature_chunk_size: int = 32, **kwargs):
        if curvature not in CURVATURES:
            raise ValueError(f"curvature={curvature!r} is not known; accepted: {CURVATURES}")
        if int(curvature_chunk_size) < 1:
            raise ValueError(f"curvature_chunk_size={curvature_chunk_size!r} must be >= 1")
        self.curvature = curvature
        self.curvature_chunk_size = int(curvature_chunk_size)
        super().__init__(model, **kwargs)

    def _init_posterior(self, init):
        super()._init_posterior(init)
        self.posterior_var = NamedTensors({n: torch.zeros_like(t) for n, t in init.items()}, trainable=False)
        self.register_buffer("curvature_fitted", torch.zeros((), dtype=torch.bool))

    def is_ready(self) -> bool:
        return bool(self.curvature_fitted)

    def _not_ready_message(self):
        return ("the Laplace posterior has no curvature yet: call bnn.fit_curvature(train_loader) first "
                "(bayeswrap.fit does this after training)")

    def _point_estimate(self):
        return self.theta.as_dict()

    def posterior_std(self):
        """sqrt(v), ``{name: tensor}``.

        Raises:
            NotFittedError: before :meth:`fit_curvature`.
        """
        if not self.is_ready():
            raise NotFittedError(self._not_ready_message())
        return {n: v.sqrt() for n, v in self.posterior_var.items()}

    def after_fit(self, train_loader) -> None:
        """Fits the curvature on the training data once MAP training is done."""
        self.fit_curvature(train_loader)

    def per_example_grads(self, x: torch.Tensor, y: torch.Tensor, theta=None) -> dict[str, torch.Tensor]:
        """∇_θ −log p(y_n | x_n, θ) for every example, vectorised with vmap.

        Args:
            x: inputs, (B, ...).
            y: targets, (B,) labels or (B, D) values.
            theta: Bayesian parameters to differentiate at; θ* by default.

        Returns:
            ``{name: tensor of shape (B, *param_shape)}``.
        """
        theta = {n: t.detach() for n, t in (theta or self.theta.as_dict()).items()}

        def nll_one(th, x1, y1):
            return self.likelihood.nll(self.forward_with(th, x1.unsqueeze(0)), y1.unsqueeze(0))

        return vmap(grad(nll_one), in_dims=(None, 0, 0))(theta, x, y)

    @torch.no_grad()
    def fit_curvature(self, train_loader, generator: torch.Generator | None = None) -> "Laplace":
        """Computes the diagonal (empirical) Fisher and the posterior variances (eqs. 17–19).

        The model is evaluated in eval mode (BatchNorm uses its running
        statistics, dropout is off) so that per-example gradients are defined.

        Args:
            train_loader: iterable of ``(inputs, targets)`` batches, usually the
                training set (one pass).
            generator: optional ``torch.Generator`` for the labels sampled by
                ``curvature="fisher"``.

        Returns:
            self, with ``posterior_var`` filled and ``curvature_fitted`` set.

        Raises:
            ValueError: if the loader yields no examples.
        """
        was_training = self.training
        self.eval()
        device = self.theta.values()[0].device
        theta = {n: t.detach() for n, t in self.theta.items()}
        fisher = {n: torch.zeros_like(t) for n, t in theta.items()}
        seen = 0
        try:
            for x, y in train_loader:
                x, y = x.to(device), y.to(device)
                if self.curvature == "fisher":
                    y = self.likelihood.sample_targets(self.forward_with(theta, x), generator=generator)
                else:
                    self.likelihood.check_targets(self.forward_with(theta, x[:1]), y[:1])
                for start in range(0, x.shape[0], self.curvature_chunk_size):
                    sl = slice(start, start + self.curvature_chunk_size)
                    with torch.enable_grad():
                        g = self.per_example_grads(x[sl], y[sl], theta)
                    # Σ_n g_n² as a squared norm over the example dim: one read of the (chunk, *shape)
                    # gradients, no chunk-sized temporary
                    torch._foreach_add_(list(fisher.values()),
                                        [torch.linalg.vector_norm(g[n], dim=0).square_() for n in fisher])
                seen += x.shape[0]
        finally:
            self.train(was_training)
        if seen == 0:
            raise ValueError("fit_curvature got an empty loader; it needs at least one (inputs, targets) batch")
        scale = self.num_data / seen
        flat_prior = False
        for n, f in fisher.items():
            precision = self.prior.precision(n) + scale * f
            flat_prior |= bool((precision == 0).any())
            # a parameter with neither prior nor data curvature stays at θ* (zero variance)
            self.posterior_var[n] = torch.where(precision > 0, 1.0 / precision, torch.zeros_like(precision))
        if flat_prior:
            warnings.warn("some parameters have zero prior precision and zero Fisher; their Laplace variance "
                          "is set to 0 (they stay at the MAP value)", RuntimeWarning, stacklevel=2)
        self.curvature_fitted.fill_(True)
        return self
