"""The Laplace evidence and the choice of the prior precision δ (and of a learned noise std).

The Laplace approximation of the marginal likelihood (MacKay 1992; Immer et al. 2021, eq. 6) is

    log p(D | δ) ≈ log p(D | θ*) − ½ [Σ_i log(1 + λ_i/δ) + δ |θ* − θ̄|²]

over the eigenvalues λ_i of the curvature H (:meth:`Laplace.log_marginal_likelihood`
has the structured and layerwise forms). :meth:`Laplace.optimize_prior_precision`
maximises it by Newton's method in log δ (``"marglik"``), or picks the δ of a grid with the lowest
validation NLL of the predictive (``"val"``, :func:`validation_search`: a search that takes a predictive
object and leaves the model as it was, also used by ``compare`` to bracket its post hoc grid).

Learned noise (``likelihood="gaussian", noise_std="learn"``): the GGN of the Gaussian
likelihood is Jᵀ J / σ², so the curvature fitted at σ₀ scales by σ₀²/σ², and
log p(D | θ*, σ) = −RSS/(2σ²) − M log σ − (M/2) log 2π with RSS = Σ_n |y_n − f(x_n; θ*)|²
and M the number of scalar targets (both (N/n)-scaled). :meth:`Laplace.optimize_prior_precision`
with ``"marglik"`` then maximises the Laplace evidence jointly over (log δ, log σ), as
laplace-torch's ``log_marginal_likelihood(prior_precision, sigma_noise)`` (Immer et al.
2021, §3); for a linear-Gaussian model the evidence is exact (MacKay 1992).

References:
    MacKay 1992, "A practical Bayesian framework for backpropagation networks"
    (evidence and the fixed point δ = γ / |θ* − θ̄|²); Immer et al. 2021, §3;
    Daxberger et al. 2021, "Laplace Redux" (laplace-torch's ``optimize_prior_precision``).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from bayeswrap.core.batches import check_reiterable
from bayeswrap.core.checks import SCALE_RANGE, check_choice, check_float, check_int, check_scale
from bayeswrap.core.functional import outside_inference_mode
from bayeswrap.evaluation.tuning import select_by_val_nll, tune
from bayeswrap.methods.base import NotFittedError
from bayeswrap.methods.laplace.structures import FullPosterior
from bayeswrap.methods.predictives import Predictive
from bayeswrap.predictive import evaluate, model_device

TUNING_METHODS = ("marglik", "val")
#: accepted ``prior_structure`` of :meth:`Laplace.optimize_prior_precision` (laplace-torch's names)
PRIOR_STRUCTURES = ("scalar", "layerwise")
#: Newton steps of the layerwise prior precision search of the "full" structure
MARGLIK_NEWTON_ITERATIONS = 100
#: the marginal-likelihood search for δ stays within these bounds
MARGLIK_BOUNDS = (1e-10, 1e10)
#: default grid of the validation search for δ
DEFAULT_GRID = tuple(10.0 ** (k / 2.5) for k in range(-10, 11))  # logspace(-4, 4, 21)
#: accepted prior precisions δ = 1/σ² for σ in the prior_std range [1e-18, 1e18]: float32 holds δ and 1/δ
PRECISION_RANGE = (1e-36, 1e36)


class PriorPrecisionSearch:
    """The evidence half of :class:`~bayeswrap.Laplace` (a mixin; the class documents the options)."""

    def validation_search(self, val_loader, grid=None, *, predictive: Predictive | None = None,
                          num_samples: int = 100, seed: int = 0, bounds: tuple[float, float] | None = None) -> dict:
        """:func:`validation_search` on this model: the validation NLL at each prior precision; nothing is changed.

        ``bayeswrap compare`` calls this (with ``bounds``) for the post hoc prior precision of a fitted
        posterior, then sets the chosen value; see :func:`validation_search` for the arguments, return value
        and errors.
        """
        return validation_search(self, val_loader, grid, predictive=predictive, num_samples=num_samples, seed=seed,
                                 bounds=bounds)

    def _marglik_terms(self) -> tuple[list[str], dict[str, torch.Tensor] | None, dict[str, torch.Tensor], torch.Tensor]:
        """The parameters with a prior, and per such tensor t: the eigenvalues λ_t of H's block (``None`` for
        ``"full"``, whose H couples the tensors), (θ*_t − θ̄_t)² summed (float64 0-d), and log p(D | θ*).
        """
        self._check_ready()
        names = [n for n in self.curvature_diag if self.prior.applies_to(n)]
        if not names:
            raise ValueError("no Bayesian parameter has a prior (bias='uninformative' leaves only flat priors), "
                             "so the marginal likelihood does not depend on the prior precision")
        if isinstance(self._structure, FullPosterior) or hasattr(self._structure, "log_det_ratio"):
            blocks = None  # H couples the tensors (full, subnetwork, lowrank)
        elif self._structure is not None:
            blocks = self._structure.block_eigenvalues()
        else:
            blocks = {n: self.curvature_diag[n].detach().double().flatten() for n in names}
        sq = {n: (self.theta[n].detach().double() - self.prior.mean[n].double()).square() for n in names}
        mask = self._structure.mask() if hasattr(self._structure, "mask") else {}  # subnetwork: its entries only
        sq = {n: (v[mask[n]] if n in mask else v).sum() for n, v in sq.items()}
        return names, blocks, sq, self.train_log_likelihood.double()

    @outside_inference_mode
    def log_marginal_likelihood(self, prior_precision=None, noise_std=None) -> torch.Tensor:
        """Laplace approximation of log p(D | δ, σ) (MacKay 1992; Immer et al. 2021, eq. 6; laplace-torch).

        log p(D | δ) ≈ log p(D | θ*)
                       − ½ [log det P_post − log det P_prior + (θ* − θ̄)ᵀ P_prior (θ* − θ̄)],

        with P_prior = diag(δ) (δ a scalar, or one per Bayesian parameter
        tensor), P_post = H + P_prior, H the structure's curvature ((N/n)-scaled
        as in :meth:`fit_curvature`) and log p(D | θ*) the (N/n)-scaled training
        log-likelihood stored there. For the diagonal and Kron structures, whose
        H is block-diagonal over the tensors, the bracket is
        Σ_t Σ_i [log(1 + λ_{t,i}/δ_t)] + Σ_t δ_t |θ*_t − θ̄_t|² over the
        eigenvalues λ_t of each block; for ``"full"`` with one δ per tensor,
        log det(H + diag(δ)) comes from a Cholesky factor. The sums run over the
        Bayesian parameters with a prior: a parameter with a flat prior
        (``bias="uninformative"``) has no normalisable prior, so its Occam factor
        (a term that does not depend on δ) is left out. The constant
        −(P/2) log 2π of the prior and posterior cancels. With a learned Gaussian
        noise std, ``noise_std`` evaluates the evidence at another σ (laplace-torch's
        ``sigma_noise``): H scales by σ_now²/σ² (the GGN is Jᵀ J / σ²) and
        log p(D | θ*, σ) = −RSS/(2σ²) − M log σ − (M/2) log 2π (RSS and M stored by
        :meth:`fit_curvature`).

        Args:
            prior_precision: δ > 0: a float, a 0-d tensor, or T values (a
                sequence or 1-D tensor, one per Bayesian parameter tensor, in
                :attr:`bayesian_names` order). A tensor with ``requires_grad``
                gives a differentiable result. ``None`` uses
                :attr:`prior_precision`. The model is not changed.
            noise_std: σ > 0 in [1e-18, 1e18] (a float or a 0-d tensor; one with
                ``requires_grad`` gives a differentiable result), only with
                ``noise_std="learn"``; ``None`` uses the current σ.

        Returns:
            A 0-d float64 tensor (nats).

        Raises:
            NotFittedError: before :meth:`fit_curvature`.
            ValueError: on a non-positive ``prior_precision``, one whose length
                is neither 1 nor T, when no Bayesian parameter has a prior, or a
                ``noise_std`` out of range or given without ``noise_std="learn"``.
        """
        names, blocks, sq, log_lik = self._marglik_terms()
        if torch.isnan(log_lik):
            raise NotFittedError("the training log-likelihood is unknown (a checkpoint saved before bayeswrap "
                                 "stored it): call bnn.fit_curvature(train_loader) again")
        if prior_precision is None:
            delta = self._prior_precision.double()
        elif torch.is_tensor(prior_precision) and prior_precision.requires_grad:
            self._precision_vector(prior_precision)  # checks the values and the length
            delta = prior_precision.reshape(-1).to(log_lik).expand(len(self._prior_precision))
        else:
            delta = self._precision_vector(prior_precision).to(log_lik.device)
        scale = 1.0  # of the curvature, σ_now² / σ²
        if noise_std is not None:
            log_lik, scale = self._noise_terms(noise_std, log_lik)
        index = {n: i for i, n in enumerate(self.theta.keys())}
        d = {n: delta[index[n]] for n in names}
        penalty = sum(d[n] * sq[n] for n in names)
        if blocks is not None:
            return log_lik - 0.5 * (sum(torch.log1p(scale * blocks[n] / d[n]).sum() for n in names) + penalty)
        structure = self._structure
        if hasattr(structure, "log_det_ratio"):  # subnetwork, lowrank: their own determinant (differentiable)
            log_det_ratio = structure.log_det_ratio(d, scale)
        elif bool((delta == delta[0]).all()) and not delta.requires_grad:  # scalar: H's eigenvalues serve every δ
            log_det_ratio = torch.log1p(scale * structure.eigenvalues() / delta[0]).sum()
        else:
            diagonal = torch.cat([d[n].expand(self.theta[n].numel()) for n in names])
            chol = torch.linalg.cholesky(scale * structure.H.double() + torch.diag(diagonal))
            log_det_ratio = 2 * chol.diagonal().log().sum() - diagonal.log().sum()
        return log_lik - 0.5 * (log_det_ratio + penalty)

    def _noise_terms(self, noise_std, log_lik: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
        """The log-likelihood log p(D | θ*, σ) = −RSS/(2σ²) − M log σ − (M/2) log 2π, and the factor σ_now²/σ²."""
        if not self._learns_noise:
            raise ValueError(f"noise_std={noise_std!r} is accepted only with a learned noise std; this model has "
                             f"likelihood={self.likelihood.name!r} with "
                             f"{'a fixed noise std' if self.likelihood.name == 'gaussian' else 'no noise std'}; "
                             "accepted: noise_std=None, or wrap with likelihood='gaussian', noise_std='learn'")
        if torch.is_tensor(noise_std) and noise_std.requires_grad:
            check_scale("noise_std", float(noise_std.detach()))
            sigma = noise_std.reshape(()).to(log_lik)
        else:
            sigma = torch.tensor(check_scale("noise_std", noise_std), dtype=torch.float64, device=log_lik.device)
        rss, count = self.train_residuals.double().unbind()
        value = -0.5 * rss / sigma**2 - count * torch.log(sigma) - 0.5 * count * math.log(2 * math.pi)
        return value, self.likelihood.noise_std**2 / sigma**2

    def _set_noise_std(self, sigma: float) -> None:
        """Moves the fitted posterior to noise std σ: the curvature scales by σ_now²/σ², the log-likelihood follows."""
        factor = self.likelihood.noise_std**2 / sigma**2
        with torch.no_grad():
            for n, h in self.curvature_diag.items():
                self.curvature_diag[n] = h * factor
            structure = self._structure
            if isinstance(structure, FullPosterior):
                structure.H.mul_(factor)
            elif hasattr(structure, "scale_"):  # lowrank
                structure.scale_(factor)
            elif structure is not None:
                torch._foreach_mul_([*structure.G.values(), *structure.h.values()], factor)
            if structure is not None:
                structure._cache = None  # the eigendecomposition is recomputed for the new factors
            self.likelihood.noise_std = sigma
            self.train_log_likelihood.fill_(float(self._noise_terms(sigma, self.train_log_likelihood)[0]))
        self._update_posterior_var()

    def use_operating_point(self, name: str) -> dict:
        """``"marglik"``: :meth:`optimize_prior_precision` by marginal likelihood (scalar δ, and σ when learned);
        see the base class.
        """
        if name != "marglik":
            return super().use_operating_point(name)
        options = {"prior_precision": self.optimize_prior_precision("marglik")}
        if self._learns_noise:
            options["noise_std"] = self.likelihood.noise_std
        return options

    @outside_inference_mode
    def optimize_prior_precision(self, method: str = "marglik", val_loader=None, grid=None,
                                 pred_type: str | None = None, link_approx: str | None = None, *,
                                 num_samples: int = 100, seed: int = 0,
                                 prior_structure: str = "scalar") -> float | torch.Tensor:
        """Chooses the posterior's prior precision δ after training and sets :attr:`prior_precision`.

        * ``"marglik"``: argmax of :meth:`log_marginal_likelihood`, each δ in
          [1e-10, 1e10]. ``prior_structure="scalar"``: one δ. In t = log δ the
          objective is strictly concave, with derivative
          ½ [Σ_i λ_i / (δ + λ_i) − δ |θ* − θ̄|²] (λ the eigenvalues of H); its root
          is found by safeguarded Newton steps (bisection fallback) to machine
          precision. At the optimum δ = γ / |θ* − θ̄|², with γ = Σ_i λ_i/(δ + λ_i)
          the effective number of parameters (MacKay 1992).
          ``prior_structure="layerwise"``: one δ per Bayesian parameter tensor
          (laplace-torch's name; a weight and its bias are separate). For the
          diagonal and Kron structures the objective separates over the tensors,
          and each δ_t is the same one-dimensional Newton search on its block's
          eigenvalues; for ``"full"`` the δ_t are coupled and found by Newton's
          method in log δ with backtracking, on the gradient
          ½ [n_t − δ_t tr_t(P⁻¹) − δ_t |θ*_t − θ̄_t|²] (whose root is MacKay's
          1992 fixed point δ_t = γ_t / |θ*_t − θ̄_t|²) and its exact Hessian,
          one Cholesky factorisation of P per step.
          With a learned noise std (``noise_std="learn"``) σ is found jointly with δ
          (scalar or layerwise): Newton's method with backtracking on
          (log δ, log σ), with the gradient and Hessian of
          :meth:`log_marginal_likelihood` by autograd; the curvature and the
          training log-likelihood are then moved to the new σ (the GGN scales
          by 1/σ²), and :attr:`noise_std` reports it.
        * ``"val"``: the value of ``grid`` with the lowest validation NLL of
          :meth:`predict` (with the predictive ``pred_type``/``link_approx`` choose,
          see :meth:`default_predictive`, ``num_samples`` samples and a generator
          re-seeded with ``seed`` for every grid value, so that all values see the
          same noise); the first one on ties. Scalar only. The search is
          :func:`validation_search`, which leaves the model as it was; this method
          then sets the chosen δ and :attr:`val_search`.

        Only the posterior changes (``posterior_var``, the predictive); θ* and
        the training prior stay.

        Args:
            method: ``"marglik"`` or ``"val"``.
            val_loader: ``(inputs, targets)`` batches, required by ``"val"``.
            grid: positive prior precisions for ``"val"``; default
                logspace(-4, 4, 21).
            pred_type: predictive for ``"val"`` (default :attr:`pred_type`).
            link_approx: link for ``"val"``, see :meth:`predict`.
            num_samples: S for ``"val"`` with a sampled predictive.
            seed: seed of the ``"val"`` generator.
            prior_structure: ``"scalar"`` (default) or ``"layerwise"`` (``"marglik"`` only).

        Returns:
            The chosen δ: a float, or for ``"layerwise"`` a float64 tensor (T,)
            (a float if all its entries are equal), as :attr:`prior_precision` reads.

        Raises:
            NotFittedError: before :meth:`fit_curvature`.
            ValueError: on an unknown method or prior_structure, ``"layerwise"``
                with ``"val"``, ``"val"`` without ``val_loader``,
                ``val_loader``/``grid`` with ``"marglik"``, an empty, non-positive
                or non-finite grid value, ``num_samples`` < 1, or an empty ``val_loader``.

        Warns:
            RuntimeWarning: if the marginal likelihood is maximal at a bound of
                the search interval (for a tensor, with ``"layerwise"``), or
                the ``"full"`` layerwise search has not converged.
        """
        method = check_choice("method", method, TUNING_METHODS)
        prior_structure = check_choice("prior_structure", prior_structure, PRIOR_STRUCTURES)
        self._check_ready()
        if method == "marglik":
            if val_loader is not None or grid is not None:
                raise ValueError("val_loader and grid are used only by method='val'; method='marglik' maximises "
                                 "the marginal likelihood over the training data")
            if self._learns_noise:
                delta, sigma = self._maximise_marglik_with_noise(prior_structure)
                self._set_noise_std(sigma)
                self.prior_precision = delta
            else:
                self.prior_precision = (self._maximise_marglik() if prior_structure == "scalar"
                                        else self._maximise_marglik_layerwise())
        else:
            if prior_structure != "scalar":
                raise ValueError(f"prior_structure={prior_structure!r} is not accepted with method='val' (a grid "
                                 "over one value); accepted: 'scalar', or method='marglik' for 'layerwise'")
            if val_loader is None:
                raise ValueError("method='val' needs val_loader, an iterable of (inputs, targets) batches")
            predictive = self.default_predictive(pred_type=pred_type, link_approx=link_approx)
            record = validation_search(self, val_loader, grid, predictive=predictive, num_samples=num_samples,
                                       seed=seed)
            self.prior_precision = record["chosen"]
            self.val_search = {"grid": record["grid"], "nll": record["val_nll"]}
        return self.prior_precision

    def _maximise_marglik(self) -> float:
        if getattr(self._structure, "matrix_free", False) and bool(self._structure.D.any()):
            return float(self._maximise_marglik_autograd("scalar")[0])  # lowrank with D: no eigenvalues of H
        names, blocks, sq, _ = self._marglik_terms()
        h = self._structure.eigenvalues() if blocks is None else torch.cat([blocks[n] for n in names])
        start = self.prior_precision
        start = start if isinstance(start, float) else float(start.double().log().mean().exp())
        return _newton_marglik(h, float(sum(sq.values())), start, "")

    def _maximise_marglik_with_noise(self, prior_structure: str) -> tuple[float | torch.Tensor, float]:
        """Argmax over (δ, σ) of the Laplace evidence (δ scalar or one per tensor with a prior), by Newton in logs."""
        names, _, _, _ = self._marglik_terms()
        index = {n: i for i, n in enumerate(self.theta.keys())}
        base = self._prior_precision.double().clone()
        if prior_structure == "scalar":
            rows = None
            start = base[[index[n] for n in names]].log().mean().reshape(1)
        else:
            rows = torch.tensor(sorted({index[n] for n in names}))
            start = base[rows].log()
        z = torch.cat([start, torch.tensor([math.log(self.likelihood.noise_std)], dtype=torch.float64)])
        low = torch.tensor([math.log(MARGLIK_BOUNDS[0])] * len(start) + [math.log(SCALE_RANGE[0])], dtype=z.dtype)
        high = torch.tensor([math.log(MARGLIK_BOUNDS[1])] * len(start) + [math.log(SCALE_RANGE[1])], dtype=z.dtype)

        def objective(t):
            delta = t[:-1].exp() if rows is None else base.index_copy(0, rows, t[:-1].exp())
            return self.log_marginal_likelihood(delta, noise_std=t[-1].exp())

        z = _newton_ascent(objective, z.clamp(low, high), low, high, float(self.train_residuals[1]))
        delta = float(z[0].exp()) if rows is None else base.index_copy(0, rows, z[:-1].exp())
        return delta, float(z[-1].exp())

    def _maximise_marglik_autograd(self, prior_structure: str) -> torch.Tensor:
        """Argmax of :meth:`log_marginal_likelihood` over log δ (one, or one per tensor with a prior) by Newton's
        method with autograd derivatives: the subnetwork and lowrank posteriors, whose determinant is not a sum over
        eigenvalues of H for every δ.
        """
        names, _, _, _ = self._marglik_terms()
        index = {n: i for i, n in enumerate(self.theta.keys())}
        base = self._prior_precision.double().clone()
        rows = torch.tensor(sorted({index[n] for n in names}))
        start = base[rows].log().mean().reshape(1) if prior_structure == "scalar" else base[rows].log()
        low = torch.full_like(start, math.log(MARGLIK_BOUNDS[0]))
        high = torch.full_like(start, math.log(MARGLIK_BOUNDS[1]))

        def objective(t):
            return self.log_marginal_likelihood(base.index_copy(0, rows, t.exp().expand(len(rows))))

        size = float(sum(self.theta[n].numel() for n in names))
        z = _newton_ascent(objective, start.clamp(low, high), low, high, size)
        return base.index_copy(0, rows, z.exp().expand(len(rows)))

    def _maximise_marglik_layerwise(self) -> torch.Tensor:
        if hasattr(self._structure, "log_det_ratio"):
            return self._maximise_marglik_autograd("layerwise")
        names, blocks, sq, _ = self._marglik_terms()
        delta = self._prior_precision.clone()
        index = {n: i for i, n in enumerate(self.theta.keys())}
        if blocks is not None:  # separable: one Newton search per tensor
            for n in names:
                delta[index[n]] = _newton_marglik(blocks[n], float(sq[n]), float(delta[index[n]]), f" of {n}")
            return delta
        structure = self._structure
        slices, offset = [], 0
        for n in self.theta.keys():  # positions of each tensor in the flattened parameters
            slices.append((n, slice(offset, offset + self.theta[n].numel())))
            offset += self.theta[n].numel()
        slices = [(n, sl) for n, sl in slices if n in sq]
        counts = torch.tensor([float(sl.stop - sl.start) for _, sl in slices], dtype=torch.float64)
        sqs = torch.stack([sq[n] for n, _ in slices])
        rows = [index[n] for n, _ in slices]
        h = structure.H.double()
        low, high = (math.log(b) for b in MARGLIK_BOUNDS)

        def evidence_terms(t):  # LML up to a constant, its gradient and Hessian in log δ (Σ = P⁻¹)
            d = t.exp()
            diagonal = torch.cat([d[i].expand(sl.stop - sl.start) for i, (_, sl) in enumerate(slices)])
            chol = torch.linalg.cholesky(h + torch.diag(diagonal))
            value = -0.5 * (2 * chol.diagonal().log().sum() - (counts * t).sum() + (d * sqs).sum())
            cov = torch.cholesky_inverse(chol)
            traces = torch.stack([cov[sl, sl].diagonal().sum() for _, sl in slices])
            blocks = torch.stack([torch.stack([cov[a, b].square().sum() for _, b in slices]) for _, a in slices])
            grad = 0.5 * (counts - d * traces - d * sqs)
            hess = 0.5 * (torch.outer(d, d) * blocks - torch.diag(d * (traces + sqs)))
            return float(value), grad, hess

        t = delta[rows].log().clamp(low, high)
        value, grad, hess = evidence_terms(t)
        for _ in range(MARGLIK_NEWTON_ITERATIONS):
            if float(grad.abs().max()) < 1e-10 * max(1.0, float(counts.max())):
                break
            try:  # Newton where the Hessian is negative definite, else a gradient step
                torch.linalg.cholesky(-hess)
                step = torch.linalg.solve(hess, -grad)
            except RuntimeError:
                step = grad / (grad.abs().max() + 1.0)
            for _ in range(60):  # backtracking: the evidence must not decrease
                trial = (t + step).clamp(low, high)
                new_value, new_grad, new_hess = evidence_terms(trial)
                if new_value >= value:
                    break
                step = step / 2
            else:
                break
            converged = float((trial - t).abs().max()) < 1e-13
            t, value, grad, hess = trial, new_value, new_grad, new_hess
            if converged:
                break
        else:
            warnings.warn(f"the layerwise marginal-likelihood search stopped after {MARGLIK_NEWTON_ITERATIONS} "
                          f"Newton steps with gradient {float(grad.abs().max()):.3g} in log δ; the last iterate is "
                          "set", RuntimeWarning, stacklevel=4)
        delta[rows] = t.exp()
        return delta


@outside_inference_mode
def validation_search(bnn, val_loader, grid=None, *, predictive: Predictive | None = None, num_samples: int = 100,
                      seed: int = 0, bounds: tuple[float, float] | None = None) -> dict:
    """The validation NLL of a predictive at each prior precision δ of a grid; the model is left as it was.

    Each δ is scored by :func:`~bayeswrap.predictive.evaluate`: the mean NLL over ``val_loader`` of
    ``bnn.predict(x, num_samples, generator, predictive=predictive)``, with a generator on the model's
    device re-seeded with ``seed`` for every δ, so that all values see the same noise. δ is set on ``bnn``
    while a value is scored; afterwards (also after an error) the prior precision and the posterior
    variances are put back exactly as they were, and nothing else (``pred_type``, ``link_approx``,
    ``val_search``) is touched. :meth:`Laplace.optimize_prior_precision` with ``"val"`` calls this and then
    sets the chosen δ; ``compare`` calls it with ``bounds`` to bracket its post hoc grid.

    Args:
        bnn: a :class:`~bayeswrap.Laplace` with a fitted curvature.
        val_loader: iterable of ``(inputs, targets)`` batches (iterated once per δ).
        grid: positive prior precisions (a sequence or a tensor); default :data:`DEFAULT_GRID`,
            logspace(-4, 4, 21).
        predictive: the :class:`~bayeswrap.methods.predictives.Predictive` scored, e.g. ``GLM("probit")``,
            ``GLM("mc")`` or ``Sampled()``; ``None``: ``bnn.default_predictive()`` (the constructor's
            ``pred_type`` and ``link_approx``).
        num_samples: S ≥ 1, the draws of a sampled predictive.
        seed: seed of the generator, re-seeded for every δ.
        bounds: ``None`` scores exactly ``grid`` and chooses its value with the lowest NLL (the first one on
            ties, :func:`~bayeswrap.evaluation.tuning.select_by_val_nll`). ``(low, high)`` brackets the
            optimum as ``compare`` does: :func:`~bayeswrap.evaluation.tuning.tune` extends the grid past an
            edge that wins, within the bounds.

    Returns:
        ``{"grid": [...], "val_nll": [...], "chosen": δ, "chosen_index": i}``: the scored values in the
        order given and their NLLs (non-finite ones as ``inf``). With ``bounds``, the record of
        :func:`~bayeswrap.evaluation.tuning.tune` (the same keys, the grid sorted ascending with its
        extensions, plus ``"extensions"``, ``"reused"``, ``"bound_hit"`` and ``"bounds"``).

    Raises:
        NotFittedError: before :meth:`Laplace.fit_curvature`.
        TypeError: if ``bnn`` is not a Laplace model, or ``predictive`` is not a Predictive.
        ValueError: on an empty, non-positive or non-finite grid value, ``num_samples`` < 1, a ``seed``
            that is not an integer, an empty ``val_loader``, or when every δ gives a non-finite NLL.
    """
    if not isinstance(bnn, PriorPrecisionSearch):
        raise TypeError(f"validation_search searches the prior precision of a Laplace model; got "
                        f"{getattr(bnn, 'method', type(bnn).__name__)!r}; accepted: a model of method 'laplace'")
    bnn._check_ready()
    grid = _check_grid(grid)
    num_samples = check_int("num_samples", num_samples, minimum=1)  # S = 0 would score the MAP at every δ
    seed = check_int("seed", seed)
    check_reiterable(val_loader, "val_loader", 2 if bounds is not None else len(grid),
                     f"the search scores it once per prior precision ({len(grid)} in the grid)")
    device = model_device(bnn)

    def val_nll_of(delta: float) -> float:
        bnn.prior_precision = delta
        generator = torch.Generator(device=device).manual_seed(seed)
        try:
            nll = evaluate(bnn, val_loader, num_samples, generator=generator, predictive=predictive)["nll"]
        except ValueError as err:
            if "yielded no batches" in str(err):
                raise ValueError("val_loader yielded no batches") from None
            raise
        return nll if math.isfinite(nll) else math.inf

    with _posterior_kept(bnn):
        if bounds is not None:
            return tune(grid, val_nll_of, bounds=bounds)
        nlls = [val_nll_of(delta) for delta in grid]
    index = select_by_val_nll(grid, nlls)
    return {"grid": grid, "val_nll": nlls, "chosen": grid[index], "chosen_index": index}


@contextlib.contextmanager
def _posterior_kept(bnn):
    """Puts δ and the posterior variances back as they were on exit (a search sets δ while it scores)."""
    delta = bnn._prior_precision.clone()
    var = {n: v.clone() for n, v in bnn.posterior_var.items()}
    try:
        yield
    finally:
        with torch.no_grad():
            bnn._prior_precision.copy_(delta)
            for n, v in var.items():
                bnn.posterior_var[n] = v


def _newton_marglik(h: torch.Tensor, sq: float, start: float, what: str) -> float:
    """Argmax over δ ∈ :data:`MARGLIK_BOUNDS` of −½ Σ_i log(1 + h_i/δ) − ½ δ sq (concave in log δ).

    Safeguarded Newton steps on the derivative in t = log δ, ½ [Σ_i h_i/(δ + h_i) − δ sq], with a bisection
    fallback, to machine precision. Warns (``what`` names the tensor) and returns the bound when the optimum is
    at one.
    """
    def slope(t):  # d LML / d log δ, and its derivative (< 0: concave)
        d = math.exp(t)
        r = h / (d + h)
        return 0.5 * (float(r.sum()) - d * sq), -0.5 * (float((r * (1 - r)).sum()) + d * sq)

    lo, hi = math.log(MARGLIK_BOUNDS[0]), math.log(MARGLIK_BOUNDS[1])
    if slope(lo)[0] <= 0 or slope(hi)[0] >= 0:
        at = MARGLIK_BOUNDS[0] if slope(lo)[0] <= 0 else MARGLIK_BOUNDS[1]
        warnings.warn(f"the marginal likelihood{what} is maximal at the bound {at:g} of the search interval "
                      f"{MARGLIK_BOUNDS} (|θ* − θ̄|² = {sq:.3g}, Σλ = {float(h.sum()):.3g}); "
                      "prior_precision set to that bound", RuntimeWarning, stacklevel=5)
        return at
    t = min(max(math.log(start), lo), hi)
    for _ in range(200):
        g, dg = slope(t)
        if g > 0:
            lo = t
        else:
            hi = t
        step = -g / dg if dg < 0 else float("inf")
        new = t + step
        if not lo < new < hi:
            new = 0.5 * (lo + hi)
        if abs(new - t) < 1e-13 * max(1.0, abs(t)) or hi - lo < 1e-13:
            t = new
            break
        t = new
    return math.exp(t)


def _newton_ascent(objective, z: torch.Tensor, low: torch.Tensor, high: torch.Tensor, size: float) -> torch.Tensor:
    """Maximises a smooth concave ``objective`` of a float64 vector within [low, high], by Newton with backtracking.

    The gradient and Hessian come from autograd; where the Hessian is not negative definite the step is a
    scaled gradient step. Stops when the gradient is below 1e-10 · max(1, ``size``) (the objective's scale, e.g.
    the number of targets) or the step below 1e-13. Warns if the iterations run out.
    """
    def terms(t):
        with torch.enable_grad():
            t = t.detach().requires_grad_(True)
            value = objective(t)
            (g,) = torch.autograd.grad(value, t, create_graph=True)
            h = torch.stack([torch.autograd.grad(g[i], t, retain_graph=i + 1 < len(g))[0] for i in range(len(g))])
        return float(value.detach()), g.detach(), h.detach()

    value, g, h = terms(z)
    for _ in range(MARGLIK_NEWTON_ITERATIONS):
        free = ~(((z <= low) & (g < 0)) | ((z >= high) & (g > 0)))  # coordinates not pushed against a bound
        if float(torch.where(free, g, 0.0).abs().max()) < 1e-10 * max(1.0, size):
            break
        try:
            torch.linalg.cholesky(-h)
            step = torch.linalg.solve(h, -g)
        except RuntimeError:
            step = g / (g.abs().max() + 1.0)
        for _ in range(60):  # backtracking: the objective must not decrease
            trial = torch.minimum(torch.maximum(z + step, low), high)
            new = terms(trial)
            if new[0] >= value:
                break
            step = step / 2
        else:
            break
        converged = float((trial - z).abs().max()) < 1e-13
        z, (value, g, h) = trial, new
        if converged:
            break
    else:
        warnings.warn(f"the marginal-likelihood search over the prior precision and the noise std stopped after "
                      f"{MARGLIK_NEWTON_ITERATIONS} Newton steps with gradient {float(g.abs().max()):.3g}; the last "
                      "iterate is set", RuntimeWarning, stacklevel=4)
    return z



def positive_precision(value, name: str = "prior_precision") -> float:
    """A prior precision δ checked to lie in :data:`PRECISION_RANGE`, as a float.

    Raises:
        ValueError: naming ``name`` and the value, for a non-positive, non-finite or out-of-range δ.
    """
    return check_float(name, value, low=PRECISION_RANGE[0], high=PRECISION_RANGE[1],
                       note="δ = 1/σ²; float32 must hold δ and the prior variance 1/δ")


def _check_grid(grid) -> list[float]:
    if grid is None:
        return list(DEFAULT_GRID)
    values = grid.detach().flatten().tolist() if torch.is_tensor(grid) else list(grid)
    if not values:
        raise ValueError("grid is empty; accepted: positive prior precisions, e.g. torch.logspace(-4, 4, 21)")
    return [positive_precision(v, f"grid[{i}]") for i, v in enumerate(values)]
