"""Fitting the Laplace curvature: :meth:`Laplace.fit_curvature` and what it warns about.

After MAP training, the diagonal posterior of :mod:`bayeswrap.methods.laplace.laplace` needs
h_i = (N / n) Σ_n c_{n,i} over the n training examples seen (the full and Kron posteriors of
:mod:`bayeswrap.methods.laplace.structures` the same sums of outer products). The curvature c_n is one of

* ``"ggn"`` (default): the exact diagonal of the generalised Gauss-Newton
  J_nᵀ Λ_n J_n, with J_n = ∂f(x_n; θ)/∂θ and Λ_n = −∂² log p(y_n | f)/∂f² the
  likelihood's Hessian in output space (softmax: diag(p) − ppᵀ; Gaussian:
  I / noise_std²). It is the exact Hessian of the log-likelihood of the
  linearised model, which makes it the curvature consistent with the GLM
  predictive and the marginal likelihood (Immer et al. 2021). It is the
  default (as in laplace-torch) because, unlike the empirical Fisher, it does
  not vanish where the MAP fits the training labels well; its cost is K
  vector-Jacobian products per example (``"fisher"`` needs one).
* ``"fisher"``: g_n² with g_n the gradient at labels ỹ ~ p(y | x_n, θ*) sampled
  from the model, averaged over ``curvature_samples`` draws. Since
  E_ỹ[g gᵀ] = Jᵀ Λ J for the categorical and the Gaussian likelihood, this is
  the Monte Carlo estimate of the GGN ("MC-GGN", unbiased, K times cheaper).
* ``"empirical_fisher"``: g_n² at the observed labels (BayesDLL's choice). At
  a well-fitted MAP these gradients are ~0, so most v_i fall back to the prior
  variance 1/δ (Kunstner et al. 2019).

Each is a sum over output-space vectors v_{n,m} of squared pullbacks (∂(v_{n,m}ᵀ f(x_n; θ))/∂θ)²
(:func:`ggn_vectors`, :func:`nll_gradient_vectors`), summed layer by layer by
:class:`bayeswrap.methods.laplace.curvature.LayerCurvature` (``curvature_backend="layers"``) or by ``vmap``
over per-example vector-Jacobian products (``"vmap"``, the reference).

Where the posterior variance is large against the weights themselves (weak data curvature, or a prior
variance 1/δ that is large where the curvature is ~0), weights sampled from the posterior are mostly
noise and the sampled predictive (``pred_type="nn"``) can lose the MAP's accuracy entirely;
:meth:`Laplace.noise_to_signal` measures it and :meth:`Laplace.fit_curvature` warns.

Memory of the vectorised chunks (P = number of Bayesian parameters, K = outputs):

* per-example gradients (``"fisher"``, ``"empirical_fisher"``): ``curvature_chunk_size`` × P;
* Jacobian rows (``"ggn"``, and the GLM variances of :mod:`bayeswrap.methods.laplace.glm`):
  ``curvature_chunk_size`` × P in rows of J (min(K, chunk) classes of max(1, chunk // K) examples
  at a time), plus one P-sized term per example.

References:
    Kunstner et al. 2019, "Limitations of the empirical Fisher approximation"; Dangel et al. 2020,
    "BackPACK" (DiagGGNExact); Immer et al. 2021 (the GGN of the linearised model).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.func import grad, vjp

from bayeswrap.core.batches import batch_size, check_inputs_finite, loader_pair, take, unsqueeze
from bayeswrap.core.distributed import all_reduce_sum_
from bayeswrap.core.functional import nonfinite_names, outside_inference_mode, vmap_over_examples
from bayeswrap.core.likelihoods import at_least_float32
from bayeswrap.core.reductions import gather_tokens, token_index
from bayeswrap.core.token_likelihoods import IGNORE_INDEX, TOKEN_LIKELIHOODS
from bayeswrap.methods.laplace.curvature import LayerCurvature
from bayeswrap.methods.laplace.kernels import has_recurrent, native_kernels
from bayeswrap.methods.laplace.memory import plan_chunk
from bayeswrap.methods.laplace.structures import FullPosterior, LinearCapture, delta_of, network_jacobian

if TYPE_CHECKING:
    from bayeswrap.methods.laplace.laplace import Laplace

CURVATURES = ("ggn", "fisher", "empirical_fisher")
CURVATURE_BACKENDS = ("layers", "vmap")
#: fit_curvature warns when the posterior variance sums to more than this multiple of Σ θ*²
NOISE_TO_SIGNAL_WARN = 10.0
#: a parameter is "prior-dominated" when its data curvature h_i is below this fraction of δ
PRIOR_DOMINATED_RATIO = 0.01


class CurvatureFitting:
    """The curvature half of :class:`~bayeswrap.Laplace` (a mixin; the class documents the options).

    Fits h (or the full or Kron curvature) and the training log-likelihood at θ*; also the Jacobian
    machinery the GLM predictive reuses (per-example chunks, the last layer's features, the layer engine).
    """

    reads_train_loader_after_fit = True  # after_fit fits the curvature on it

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
            return self.likelihood.nll(self.forward_with(th, unsqueeze(x1)), y1.unsqueeze(0))

        return vmap_over_examples(grad(nll_one), in_dims=(None, 0, 0))(theta, x, y)

    def ggn_diagonal(self, x: torch.Tensor, theta=None, y=None) -> dict[str, torch.Tensor]:
        """Σ_n diag(J_nᵀ Λ_n J_n) over a batch: the exact diagonal GGN, without labels.

        Softmax: diag(Jᵀ (diag(p) − ppᵀ) J)_i = Σ_k p_k (J_{k,i} − m_i)² with
        m = pᵀJ. Gaussian: Σ_k J_{k,i}² / noise_std². With
        ``curvature_backend="layers"`` the K columns s_k = sqrt(p_k)(e_k − p)
        (Gaussian: e_k / noise_std) of a factor of Λ_n are backpropagated
        through the batch and contracted per layer (Dangel et al. 2020,
        BackPACK's DiagGGNExact; :mod:`bayeswrap.methods.laplace.curvature`); with ``"vmap"``
        rows of J come from ``vmap`` over per-example vector-Jacobian products.
        Evaluated in the model's current mode (:meth:`fit_curvature` uses eval mode).

        Args:
            x: inputs, (B, ...).
            theta: Bayesian parameters; θ* by default.
            y: the labels, needed (only) by the token likelihoods, whose Λ_n covers the positions with a target.

        Returns:
            ``{name: tensor of the parameter's shape}``, summed over the batch.

        Raises:
            ValueError: for a token likelihood without ``y``, or with the ``"vmap"`` reference.
        """
        theta = {n: t.detach() for n, t in (theta or self.theta.as_dict()).items()}
        engine = self._layer_engine()
        if engine is not None:
            return engine.squared_grad_sums(self.forward_with, theta, x, ggn_vectors(self.likelihood, y))
        if is_token_likelihood(self.likelihood):
            raise ValueError(f"likelihood={self.likelihood.name!r}: the exact GGN is computed by the per-layer engine "
                             "only (curvature_backend='layers', on a model that does not couple the examples of a "
                             "batch); accepted: curvature_backend='layers', or curvature='fisher'")
        return self._ggn_diagonal_vmap(x, theta)

    def _layer_engine(self) -> LayerCurvature | None:
        """The per-layer curvature engine of ``curvature_backend="layers"``, or None (vmap reference)."""
        if self.curvature_backend != "layers":
            return None
        engine = self.__dict__.get("_layer_curvature")
        if engine is None or engine.chunk_size != self.curvature_chunk_size or engine.model is not self.model:
            engine = LayerCurvature(self.model, list(self.theta.keys()), self.curvature_chunk_size)
            self.__dict__["_layer_curvature"] = engine
        return engine if engine.usable else None

    def _ggn_diagonal_vmap(self, x: torch.Tensor, theta) -> dict[str, torch.Tensor]:
        """:meth:`ggn_diagonal` by vmap over examples (the reference of ``curvature_backend="vmap"``), at ``theta``
        (detached, as :meth:`ggn_diagonal` passes it).
        """
        categorical = self.likelihood.name == "categorical"
        total = {n: torch.zeros_like(t) for n, t in theta.items()}

        def one(x1, basis, class_chunks):
            f1, vjp_fn = vjp(lambda th: self.forward_with(th, unsqueeze(x1)).reshape(-1), theta)
            acc = {n: torch.zeros_like(t) for n, t in theta.items()}
            if categorical:
                p = at_least_float32(f1).softmax(-1).to(f1.dtype)
                (mean,) = vjp_fn(p)
            for ks in class_chunks:
                (rows,) = vmap_over_examples(vjp_fn)(basis[ks])
                for n, r in rows.items():
                    if categorical:
                        w = p[ks].reshape(-1, *([1] * (r.dim() - 1)))
                        acc[n] = acc[n] + ((r - mean[n]).square() * w).sum(0)
                    else:
                        acc[n] = acc[n] + r.square().sum(0)
            if not categorical:
                acc = {n: a / self.likelihood.noise_std**2 for n, a in acc.items()}
            return acc

        for per_example in self._per_example_chunks(x, one, theta):
            torch._foreach_add_(list(total.values()), [per_example[n].sum(0) for n in total])
        return total

    def _per_example_chunks(self, x: torch.Tensor, one, theta):
        """Runs ``one(x1, basis, class_chunks)`` under ``vmap`` over chunks of examples.

        Chunks hold at most ``curvature_chunk_size`` Jacobian rows: all K classes of
        max(1, chunk // K) examples, or chunks of the classes of one example.
        """
        with torch.no_grad():
            k = self.forward_with(theta, take(x, slice(0, 1))).numel()
        ref = next(iter(theta.values()))
        basis = torch.eye(k, dtype=ref.dtype, device=ref.device)
        rows = self.curvature_chunk_size
        per_class = min(k, rows)
        class_chunks = [slice(s, s + per_class) for s in range(0, k, per_class)]
        per_example = max(1, rows // k)
        for start in range(0, batch_size(x), per_example):
            yield vmap_over_examples(lambda x1: one(x1, basis, class_chunks))(take(x, slice(start, start + per_example)))

    @outside_inference_mode
    @torch.no_grad()
    def fit_curvature(self, train_loader, generator: torch.Generator | None = None) -> "Laplace":
        """Computes the curvature, the training log-likelihood and the posterior variances.

        ``hessian_structure="diag"``: the diagonal h; ``"full"``/``"kron"``: the
        dense H or the Kronecker factors (:mod:`bayeswrap.methods.laplace.structures`),
        with ``curvature_diag`` set to diag(H) and ``posterior_var`` to the
        marginal variances diag(P⁻¹).

        The model is evaluated in eval mode (BatchNorm uses its running
        statistics, dropout is off) so that per-example quantities are defined.
        Both the curvature and the log-likelihood are scaled by N/n (n the
        number of examples seen; of target tokens for the token likelihoods, whose
        ``num_data`` counts tokens), so that a subset of the training set
        estimates the full-data terms.

        Args:
            train_loader: iterable of ``(inputs, targets)`` batches, usually the
                training set (one pass). Inputs are a tensor, a tuple of tensors
                (``model(x1, x2)``) or a dict of named tensors, moved to the model's
                device; class labels of any integer dtype are read as int64.
                ``hessian_structure="full"`` over all weights still needs tensor inputs (its
                per-example Jacobians, ``structures.network_jacobian``, slice a tensor).
            generator: optional ``torch.Generator`` for the labels sampled by
                ``curvature="fisher"``.

        Returns:
            self, with ``curvature_diag``, ``train_log_likelihood`` and
            ``posterior_var`` filled and ``curvature_fitted`` set.

        Raises:
            ValueError: if the loader yields no examples or something other than
                ``(inputs, targets)`` pairs, the targets do not fit the likelihood,
                or a batch's inputs (or regression targets) contain NaN or inf
                (the message names the batch index).
            FloatingPointError: if the log-likelihood or the curvature is not
                finite although the inputs are (θ* non-finite, or overflow). The
                posterior is left unchanged on any error.
            MemoryBudgetError: (a ``MemoryError``) if a batch's estimated peak exceeds ``memory_budget`` even at
                ``curvature_chunk_size=1``, before the batch's work (the message names the estimate, the budget
                and the structures that fit; :mod:`bayeswrap.methods.laplace.memory`). A default chunk size is
                lowered, for this fit only, until the estimate fits.

        Warns:
            RuntimeWarning: if Σ_i v_i > 10 Σ_i θ*_i² (the weights sampled by
                ``pred_type="nn"`` are mostly noise; see :meth:`noise_to_signal`),
                or if some parameter has neither prior nor curvature.
        """
        was_training = self.training
        self.eval()
        device = self.theta.values()[0].device
        theta = {n: t.detach() for n, t in self.theta.items()}
        curv = {n: torch.zeros_like(t) for n, t in theta.items()}
        log_lik = torch.zeros((), dtype=torch.float64, device=device)
        residuals = torch.zeros(2, dtype=torch.float64, device=device)
        seen = 0  # examples (sequences): the Kronecker factor A averages over them
        units = 0  # what num_data counts: examples, or target tokens for a token likelihood
        structure = self._structure
        diag_wanted = (structure is None or bool(getattr(structure, "diag_names", ()))
                       or getattr(structure, "wants_diagonal", False))
        chunk_given, budget_plan = self.curvature_chunk_size, {}
        if structure is not None:
            structure.fitted.fill_(False)
            structure.reset()
            if hasattr(structure, "prepare"):  # subnetwork: choose the entries; lowrank: draw the first basis
                structure.prepare(self, train_loader, generator)
        with native_kernels(has_recurrent(self.model)):  # cuDNN's RNN: no backward in eval mode
            try:
                for index, batch in enumerate(train_loader):
                    x, y = loader_pair(batch, f"fit_curvature's loader batch {index}", self.label_key, device,
                                       self.likelihood.name == "categorical")
                    # the batch's peak estimated before its work: the chunk sized to memory_budget, or refused
                    self.curvature_chunk_size = plan_chunk(self, x, "fit", budget_plan)
                    # the per-layer engine's recorded forward serves the log-likelihood too (one forward per batch)
                    engine = self._layer_engine() if structure is None else None
                    out = self.forward_with(theta, x) if engine is None else engine.forward(self.forward_with, theta, x)
                    self.likelihood.check_targets(out, y)
                    batch_log_lik = -example_nll(self.likelihood, out, y).double().sum()
                    if not bool(torch.isfinite(batch_log_lik)):  # one sync per batch (check_targets syncs anyway)
                        self._raise_nonfinite_batch(index, x, y, theta)
                    log_lik += batch_log_lik
                    if self._learns_noise:
                        residuals += torch.stack([(y - out).double().square().sum(), residuals.new_tensor(y.numel())])
                    if structure is not None:
                        sampled = None
                        if self.curvature == "fisher":
                            sampled = [self.likelihood.sample_targets(out, generator=generator)
                                       for _ in range(self.curvature_samples)]
                        self._accumulate_structure(x, y, theta, sampled)
                        if not diag_wanted:
                            seen += batch_size(x)
                            units += data_units(self.likelihood, x, y)
                            continue
                    with torch.enable_grad():
                        if self.curvature == "ggn":
                            torch._foreach_add_(list(curv.values()), list(self.ggn_diagonal(x, theta, y).values()))
                        elif self.curvature == "fisher":
                            sampled = [self.likelihood.sample_targets(out, generator=generator)
                                       for _ in range(self.curvature_samples)]
                            self._add_squared_grads(curv, x, sampled, theta, 1.0 / self.curvature_samples)
                        else:
                            self._add_squared_grads(curv, x, y, theta, 1.0)
                    seen += batch_size(x)
                    units += data_units(self.likelihood, x, y)
                # data-parallel fits: every rank saw its own shard; the curvature, the log-likelihood and
                # the example count are sums over examples, so summing them over the ranks gives the full terms
                count = torch.tensor([float(seen), float(units)], dtype=torch.float64, device=device)
                factors = [] if structure is None else [t for t in structure.buffers() if t.is_floating_point()]
                all_reduce_sum_([*curv.values(), log_lik, count, residuals, *factors])
                seen, units = (int(round(float(c))) for c in count)
            finally:
                self.curvature_chunk_size = chunk_given
                self.train(was_training)
        if seen == 0:
            raise ValueError("fit_curvature got an empty loader; it needs at least one (inputs, targets) batch")
        bad = nonfinite_names(curv.items())
        if bad:
            raise FloatingPointError(f"the curvature of parameter {bad[0]!r} is non-finite (NaN or inf) after {seen} "
                                     "examples with finite inputs and log-likelihood (the squared gradients overflow; "
                                     "is θ* diverged?); the posterior was left unchanged")
        scale = self.num_data / units
        if structure is not None:
            if isinstance(structure, FullPosterior):
                structure.finish(scale)
                diag = structure._split(torch.diagonal(structure.H))
            elif hasattr(structure, "complete"):  # lowrank: the remaining passes of the subspace iteration
                diag = structure.complete(self, train_loader, scale,
                                          {n: scale * c for n, c in curv.items()} if diag_wanted else None)
            else:
                structure.finish(seen, scale, {n: scale * curv[n] for n in structure.diag_names})
                diag = {**{w: torch.outer(torch.diagonal(structure.G[layer]),
                                          torch.diagonal(structure.A[layer])).reshape(curv[w].shape)
                           for layer, (w, _) in structure.layers.items()},
                        **{b: torch.diagonal(structure.G[layer]) for layer, (_, b) in structure.layers.items()
                           if b is not None}, **structure.h}
            curv = {n: diag[n] / scale for n in curv}
            structure.fitted.fill_(True)
        for n, c in curv.items():
            self.curvature_diag[n] = scale * c
        self.train_log_likelihood.fill_(float(scale * log_lik))
        if self._learns_noise:
            self.train_residuals.copy_(scale * residuals)
        self.curvature_fitted.fill_(True)
        if self._update_posterior_var():  # stacklevel 4: the caller, behind the two decorators' wrappers
            warnings.warn("some parameters have zero prior precision and zero curvature; their Laplace variance "
                          "is set to 0 (they stay at the MAP value)", RuntimeWarning, stacklevel=4)
        self._warn_if_prior_dominated()
        return self

    def _curvature_vectors(self, f: torch.Tensor, y, sampled) -> torch.Tensor:
        """The output-space vectors v (M, B, *out) whose pullbacks' outer products sum to the curvature.

        GGN: the K columns of a factor of Λ_n; Fisher: NLL gradients at the sampled labels, each weighted 1/S;
        empirical Fisher: the NLL gradient at the observed label.
        """
        return torch.cat(list(self._curvature_vector_chunks(f, y, sampled, whole=True)), 0)

    def _curvature_vector_chunks(self, f: torch.Tensor, y, sampled, whole: bool = False):
        """:meth:`_curvature_vectors` in chunks: all at once, except the T·V GGN vectors of a token likelihood,
        ``curvature_chunk_size`` at a time (each chunk one batched backward pass), unless ``whole``.
        """
        f = f.detach()
        if self.curvature == "ggn":
            vectors = ggn_vectors(self.likelihood, y)
        elif self.curvature == "fisher":
            vectors = nll_gradient_vectors(self.likelihood, sampled, 1.0 / len(sampled))
        else:
            vectors = nll_gradient_vectors(self.likelihood, [y])
        size = max(f[0].numel(), len(sampled or ()))
        if not whole and is_token_likelihood(self.likelihood):
            size = self.curvature_chunk_size
        return vectors(f, size)

    def _capture(self) -> LinearCapture:
        """Records the inputs and outputs of the Kron layers (or of the last layer, whose body is not differentiated)."""
        if self.last_layer_name is not None:
            return LinearCapture({self.last_layer_name: self.model.get_submodule(self.last_layer_name)},
                                 detach_input=True)
        return LinearCapture({n: self.model.get_submodule(n) for n in self._structure.layers})

    def _picked_head(self, x, seen, deltas):
        """Last layer with ``output_reduction``: the head's input a (B, T, D) and pulled-back vectors (M, B, T, K)
        read at the token the outputs are read at, (B, D) and (M, B, K) (laplace-torch's ``feature_reduction``).

        The outputs depend on the head only through that token, so the vectors are zero at every other position and
        the per-example Jacobian δ_{n,t_n} ã_{n,t_n}ᵀ is unchanged; the Kronecker factor A = (1/n) Σ_n a aᵀ then
        averages the picked features only, as laplace-torch's last-layer KFAC does on a network that pools the
        features before its head (its ``feature_reduction`` KFAC averages A over every position instead; see
        :mod:`bayeswrap.core.reductions`). Anything else is returned as it is.
        """
        name = self.last_layer_name
        if name is None or self.output_reduction is None or seen[name][0].dim() != 3:
            return seen, deltas
        a, z = seen[name]
        index = token_index(x, a.shape[:2], self.output_reduction, a.device)
        return {name: (gather_tokens(a, index), z)}, {name: gather_tokens(deltas[name], index, dim=2)}

    def _example_slices(self, x) -> list[slice]:
        """Slices of ``curvature_chunk_size`` examples (bounds the (c, K, P) Jacobians of ``"full"`` over all)."""
        c = self.curvature_chunk_size
        return [slice(s, s + c) for s in range(0, batch_size(x), c)]

    def _jacobian(self, x, theta) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs f (B, *out) and the per-example Jacobian J (B, K, P) by ``jacrev`` under ``vmap`` (``"full"``, all)."""
        names = getattr(self._structure, "jacobian_names", None)  # subnetwork: only the tensors it touches
        wrt, forward = theta, self.forward_with
        if names is not None:
            wrt = {n: theta[n] for n in names()}
            forward = lambda th, inp: self.forward_with({**theta, **th}, inp)  # noqa: E731
        with torch.enable_grad():
            jac = network_jacobian(forward, wrt, x, max(1, self.curvature_chunk_size))
        return self.forward_with(theta, x), jac

    def _head_terms(self, x, theta, vectors=None):
        """Last layer: f, the head's input features a (B, D), and vectors pulled back to the head's output.

        ``vectors(f)`` gives the output-space vectors (M, B, *out); ``None``: the unit vectors (rows of J).
        """
        capture = self._capture()
        f, seen = capture.run(lambda inp: self.forward_with(theta, inp), x)
        k = f[0].numel()
        if vectors is None:
            v = torch.eye(k, dtype=f.dtype, device=f.device)[:, None].expand(-1, f.shape[0], -1).reshape(k, *f.shape)
        else:
            v = vectors(f)
        seen, deltas = self._picked_head(x, seen, capture.pullback(f, seen, v))
        d = deltas[self.last_layer_name]
        a = seen[self.last_layer_name][0]
        if a.dim() != 2:
            raise ValueError(f"subset_of_weights='last_layer' with hessian_structure='full' needs the last layer's "
                             f"input to be (B, D) features, got shape {tuple(a.shape)}; accepted: "
                             "hessian_structure='kron' or 'diag'")
        return f.detach(), a, d

    def _accumulate_structure(self, x, y, theta, sampled) -> None:
        """Adds one batch to the full H or to the Kron factors."""
        structure = self._structure
        if hasattr(structure, "accumulate"):  # lowrank: H Q over the batch, matrix-free
            structure.accumulate(self, x, y, theta, sampled)
            return
        if isinstance(structure, FullPosterior) and self.last_layer_name is not None:
            _, a, d = self._head_terms(x, theta, lambda f: self._curvature_vectors(f, y, sampled))
            structure.add_features(a, d.to(structure.H.dtype), len(theta) == 2)
            return
        if isinstance(structure, FullPosterior):  # curvature_chunk_size examples' Jacobians (c, K, P) at a time
            for sl in self._example_slices(x):
                f, jac = self._jacobian(take(x, sl), theta)
                ys = None if sampled is None else [t[sl] for t in sampled]
                v = self._curvature_vectors(f, y[sl], ys).reshape(-1, f.shape[0], jac.shape[1])  # (M, c, K)
                structure.add_rows(torch.einsum("mbk,bkp->mbp", v.to(jac.dtype), jac).reshape(-1, jac.shape[-1]))
            return
        capture = self._capture()
        f, seen = capture.run(lambda inp: self.forward_with(theta, inp), x)
        for i, v in enumerate(self._curvature_vector_chunks(f, y, sampled)):
            structure.add(*self._picked_head(x, seen, capture.pullback(f, seen, v)), inputs=i == 0)

    def _raise_nonfinite_batch(self, index: int, x, y, theta) -> None:
        """Says why the log-likelihood of batch ``index`` is not finite: its inputs, its targets or θ*."""
        where = f"fit_curvature: the log-likelihood of batch {index} is non-finite"
        check_inputs_finite(x, name=f"{where}: its input x")
        if y.is_floating_point() and not bool(torch.isfinite(y).all()):
            raise ValueError(f"{where}: its targets contain {int((~torch.isfinite(y)).sum())} non-finite values "
                             "(NaN or inf); accepted: finite targets")
        bad = nonfinite_names(theta.items())
        if bad:
            raise FloatingPointError(f"{where}: the MAP parameter {bad[0]!r} contains NaN or inf (training "
                                     "diverged?); the posterior was left unchanged")
        raise FloatingPointError(f"{where} although its inputs and θ* are finite (the model's outputs overflow); "
                                 "the posterior was left unchanged")

    def _add_squared_grads(self, acc, x, y, theta, weight: float) -> None:
        """Acc += weight · Σ_n g_n² (g_n the NLL gradient of example n at targets ``y``).

        ``y`` is a target tensor or a list of them (several sampled label sets,
        each weighted by ``weight``). ``"layers"`` backend: one forward and one
        (batched) backward pass and per-layer contractions; ``"vmap"``:
        ``curvature_chunk_size``-example vmap chunks of per-example gradients.
        """
        ys = list(y) if isinstance(y, (list, tuple)) else [y]
        engine = self._layer_engine()
        if engine is not None:
            sums = engine.squared_grad_sums(self.forward_with, theta, x,
                                            nll_gradient_vectors(self.likelihood, ys, weight))
            torch._foreach_add_(list(acc.values()), [sums[n] for n in acc])
            return
        if is_token_likelihood(self.likelihood):  # per_example_grads would take each sequence's mean token NLL
            raise ValueError(f"likelihood={self.likelihood.name!r}: the (empirical) Fisher of a token likelihood is "
                             "computed by the per-layer engine only, which this model cannot use (it couples the "
                             "examples of a batch); accepted: a model without BatchNorm in training mode")
        for y1 in ys:
            for start in range(0, batch_size(x), self.curvature_chunk_size):
                sl = slice(start, start + self.curvature_chunk_size)
                g = self.per_example_grads(take(x, sl), y1[sl], theta)
                # Σ_n g_n² as a squared norm over the example dim: one read of the (chunk, *shape)
                # gradients, no chunk-sized temporary
                torch._foreach_add_(list(acc.values()),
                                    [torch.linalg.vector_norm(g[n], dim=0).square_() for n in acc], alpha=weight)

    def noise_to_signal(self) -> tuple[float, float]:
        """How much the sampled ``"nn"`` predictive perturbs the weights, for the current δ.

        Returns:
            ``(ratio, prior_dominated)``: ratio = Σ_i v_i / Σ_i θ*_i² over the
            Bayesian parameters (the expected squared size of θ − θ* against
            that of θ*), and the fraction of the parameters with a prior whose
            data curvature h_i is below 1% of δ (their v_i is the prior's 1/δ).
            The ratio predicts the collapse of the sampled predictive much
            better than the fraction, which is largest for strong priors, where
            1/δ is small and sampling is harmless.

        Raises:
            NotFittedError: before :meth:`fit_curvature`.
        """
        self._check_ready()
        # float64 sums without float64 copies of the tensors
        noise = sum(float(v.sum(dtype=torch.float64)) for v in self.posterior_var.values())
        signal = sum(float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64)) ** 2 for t in self.theta.values())
        small = total = 0
        delta = self._delta()
        for n, h in self.curvature_diag.items():
            if self.prior.applies_to(n):
                small += int((h < PRIOR_DOMINATED_RATIO * delta_of(delta, n)).sum())
                total += h.numel()
        ratio = noise / signal if signal > 0 else (math.inf if noise > 0 else 0.0)
        return ratio, (small / total if total else 0.0)

    def _warn_if_prior_dominated(self) -> None:
        ratio, prior_dominated = self.noise_to_signal()
        if ratio > NOISE_TO_SIGNAL_WARN:
            advice = ("this model's default pred_type='glm' (the linearised predictive) is much less affected"
                      if self.pred_type == "glm" else "use pred_type='glm' (the linearised predictive)")
            delta = self.prior_precision
            delta = delta if isinstance(delta, float) else float(delta.min())  # the weakest prior's variance
            warnings.warn(
                f"the Laplace posterior variance sums to {ratio:.3g} × Σθ*² (prior precision {delta:.3g}; "
                f"{prior_dominated:.0%} of the parameters with a prior have data curvature (N/n)·c_i below "
                f"{PRIOR_DOMINATED_RATIO:.0%} of it, so their variance is the prior's 1/{delta:.3g}): the weights "
                f"sampled by pred_type='nn' (and bnn.sample()) are mostly noise and that predictive can lose the "
                f"MAP's accuracy; {advice}, and consider bnn.optimize_prior_precision()",
                RuntimeWarning, stacklevel=5)  # the caller of fit_curvature (behind the decorators' wrappers)


# ---------------------------------------------------------------------- output-space vectors
def nll_gradient_vectors(likelihood, targets: Iterable[torch.Tensor], weight: float = 1.0
                         ) -> Callable[[torch.Tensor, int], Iterator[torch.Tensor]]:
    """Vectors of the (empirical) Fisher: sqrt(weight) ∂ −log p(y_n | f_n)/∂f_n, one per target set.

    Args:
        likelihood: a bayeswrap likelihood (its per-example ``nll``).
        targets: one or more target tensors (observed labels for the empirical
            Fisher; sampled labels for the Fisher), each (B,) or (B, D).
        weight: multiplies every squared gradient (e.g. 1/S for S sampled labels).

    Returns:
        ``vectors(f, m)`` for :meth:`LayerCurvature.squared_grad_sums`, yielding
        (m_j, B, *out) chunks.
    """
    targets = list(targets)

    def vectors(f, m):
        scale = weight**0.5
        for start in range(0, len(targets), m):
            out = []
            for y in targets[start:start + m]:
                fd = f.detach().requires_grad_(True)
                with torch.enable_grad():
                    (g,) = torch.autograd.grad(example_nll(likelihood, fd, y).sum(), fd)
                out.append(g * scale if weight != 1.0 else g)
            yield torch.stack(out)

    return vectors


def ggn_vectors(likelihood, y=None) -> Callable[[torch.Tensor, int], Iterator[torch.Tensor]]:
    """Columns of a factor of the output Hessian, Λ_n = Σ_k s_{n,k} s_{n,k}ᵀ (BackPACK's ``DiagGGNExact``).

    Softmax (categorical): s_{n,k} = sqrt(p_{n,k}) (e_k − p_n), with p_n the
    class probabilities; Gaussian: s_{n,k} = e_k / noise_std over the flattened
    outputs. Token likelihoods (``"causal_lm"``, ``"token_categorical"``; logits (B, T, V)): the sequence's
    NLL is a sum over its target positions, so Λ_n is block-diagonal over positions and
    s_{n,(t,k)} = 1[position t has a target] sqrt(p_{n,t,k}) (e_{t,k} − p_{n,t}) (the logits at t score the
    label at t + 1 with the causal shift); T·V vectors per sequence, zero at positions without a target.

    Args:
        likelihood: a bayeswrap likelihood.
        y: the labels (B, T); needed by the token likelihoods only (which positions have a target).

    Returns:
        ``vectors(f, m)`` yielding (m_j, B, *out) chunks of the K vectors
        (K the number of outputs per example).
    """
    if is_token_likelihood(likelihood):
        if y is None:
            raise ValueError(f"likelihood={likelihood.name!r}: the GGN's output Hessian needs the labels (which "
                             "positions have a target)")
        return _token_ggn_vectors(likelihood, y)
    categorical = likelihood.name == "categorical"

    def vectors(f, m):
        batch = f.shape[0]
        k = f[0].numel()
        if categorical:
            p = at_least_float32(f).softmax(-1).to(f.dtype)
            root = p.sqrt()
        for start in range(0, k, m):
            ks = torch.arange(start, min(start + m, k), device=f.device)
            eye = F.one_hot(ks, k).to(f.dtype)  # (m, K)
            if categorical:
                v = root.t()[ks].unsqueeze(-1) * (eye.unsqueeze(1) - p.unsqueeze(0))  # (m, B, K)
            else:
                v = (eye / likelihood.noise_std).unsqueeze(1).expand(-1, batch, -1)
            yield v.reshape(len(ks), *f.shape)

    return vectors


def _token_ggn_vectors(likelihood, y) -> Callable[[torch.Tensor, int], Iterator[torch.Tensor]]:
    """:func:`ggn_vectors` of a token likelihood: (m_j, B, T, V) chunks, one (position, token) pair per vector."""

    def vectors(f, m):
        length, vocab = f.shape[1], f.shape[2]
        p = at_least_float32(f).softmax(-1).to(f.dtype)  # (B, T, V)
        root = p.sqrt() * target_positions(likelihood, y).to(f.dtype).unsqueeze(-1)
        for start in range(0, length * vocab, m):
            flat = torch.arange(start, min(start + m, length * vocab), device=f.device)
            t, k = flat // vocab, flat % vocab
            column = root[:, t, k].t().unsqueeze(-1) * (F.one_hot(k, vocab).to(f.dtype).unsqueeze(1)
                                                        - p[:, t].transpose(0, 1))  # (m, B, V)
            v = f.new_zeros(len(flat), f.shape[0], length, vocab)
            v[torch.arange(len(flat), device=f.device), :, t] = column
            yield v

    return vectors


def is_token_likelihood(likelihood) -> bool:
    """Whether the likelihood scores (B, T, V) logits token by token (``"causal_lm"``, ``"token_categorical"``)."""
    return likelihood.name in TOKEN_LIKELIHOODS


def target_positions(likelihood, y: torch.Tensor) -> torch.Tensor:
    """Token likelihoods: which positions of the (B, T, V) logits score a label, bool (B, T) (with the causal shift,
    position t when label t + 1 is not -100; the last position never).
    """
    present = y != IGNORE_INDEX
    if likelihood.shift:
        return torch.cat([present[:, 1:], torch.zeros_like(present[:, :1])], 1)
    return present


def example_nll(likelihood, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """−log p(y_n | f_n) per example, (B,): for a token likelihood the sum over the sequence's target tokens (its
    ``reduction="none"`` is that times B / the batch's number of targets).
    """
    per = likelihood.nll(f, y, reduction="none")
    if not is_token_likelihood(likelihood):
        return per
    return per * (target_positions(likelihood, y).sum() / per.shape[0])


def data_units(likelihood, x, y) -> int:
    """What ``num_data`` counts in a batch: its examples, or its target tokens for a token likelihood
    (:mod:`bayeswrap.core.token_likelihoods`).
    """
    if is_token_likelihood(likelihood):
        return int(target_positions(likelihood, y).sum())
    return batch_size(x)


def basis_vectors() -> Callable[[torch.Tensor, int], Iterator[torch.Tensor]]:
    """The unit vectors e_k of the (flattened) output space, the same for every example: rows of J.

    Returns:
        ``vectors(f, m)`` yielding (m_j, B, *out) chunks of the K vectors.
    """

    def vectors(f, m):
        k = f[0].numel()
        for start in range(0, k, m):
            ks = torch.arange(start, min(start + m, k), device=f.device)
            eye = F.one_hot(ks, k).to(f.dtype)
            yield eye.unsqueeze(1).expand(-1, f.shape[0], -1).reshape(len(ks), *f.shape)

    return vectors
