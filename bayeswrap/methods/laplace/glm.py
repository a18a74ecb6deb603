"""The Laplace predictive: linearised (GLM) with a probit or Monte Carlo link, or sampled.

Predictions use ``pred_type="glm"`` (default) or ``"nn"``:

* ``"glm"``, the linearised predictive (Immer et al. 2021; MacKay 1992):
  f_lin(x; θ) = f(x; θ*) + J(x)(θ − θ*) with θ ~ N(θ*, diag(v)).
  ``link_approx="probit"`` (default, as in laplace-torch) uses the diagonal of
  the functional covariance J diag(v) Jᵀ, computed with per-example
  vector-Jacobian products, in softmax(f / sqrt(1 + π/8 · var)) (MacKay 1992;
  Spiegelhalter & Lauritzen 1990), or, for the Gaussian likelihood, in the
  exact predictive N(f, var + noise_std²). ``link_approx="mc"`` averages over
  linearised samples, one ``torch.func.jvp`` per sample, vectorised with
  ``vmap``. No Jacobian over all examples and parameters is ever materialised.
* ``"nn"``: the network evaluated at sampled weights, (1/S) Σ_s p(y | x, θ_s).
  Where the posterior variance is large against the weights themselves (weak
  data curvature, or a prior variance 1/δ that is large where the curvature is
  ~0), the sampled weights are mostly noise and the predictive can lose the
  MAP's accuracy entirely; :meth:`Laplace.fit_curvature` warns then.

Memory of the vectorised chunks (P = number of Bayesian parameters): the probit and Gaussian variances
take Jacobian rows as the exact GGN does (``curvature_chunk_size`` × P, see
:mod:`bayeswrap.methods.laplace.fitting`); Monte Carlo ``chunk_size`` × (P + the activations of one
forward).

Cost: the probit/Gaussian variances take K vector-Jacobian products per
example (like the exact GGN); Monte Carlo takes S forward-mode passes per
batch, which is cheaper when K is large (e.g. ImageNet): set
``link_approx="mc"`` there.

References:
    MacKay 1992 (the probit link); Spiegelhalter & Lauritzen 1990 (probit approximation);
    Immer et al. 2021, "Improving predictions of Bayesian neural nets via local linearization"
    (GLM predictive); Daxberger et al. 2021, "Laplace Redux" (laplace-torch).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
from torch.func import jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from bayeswrap.core.batches import check_inputs_finite, take, unsqueeze
from bayeswrap.core.checks import check_choice
from bayeswrap.core.functional import outside_inference_mode, vmap_over_examples
from bayeswrap.core.likelihoods import at_least_float32
from bayeswrap.methods.laplace.fitting import basis_vectors, is_token_likelihood
from bayeswrap.methods.laplace.kernels import has_recurrent, native_kernels
from bayeswrap.methods.laplace.memory import plan_chunk
from bayeswrap.methods.laplace.structures import FullPosterior
from bayeswrap.methods.predictives import Predictive, refuse_options

PRED_TYPES = ("glm", "nn")
LINK_APPROXES = ("mc", "probit")


class LinearisedPredictive:
    """The predictive half of :class:`~bayeswrap.Laplace` (a mixin; the class documents the options)."""

    def _resolve(self, pred_type: str | None, link_approx: str | None) -> tuple[str, str]:
        """Per-call options or the model's defaults; ``"nn"`` always samples (link ``"mc"``)."""
        pred_type = self.pred_type if pred_type is None else check_choice("pred_type", pred_type, PRED_TYPES)
        if link_approx is None:
            return pred_type, self.link_approx if pred_type == "glm" else "mc"
        check_choice("link_approx", link_approx, LINK_APPROXES)
        if link_approx == "probit" and pred_type != "glm":
            raise ValueError("link_approx='probit' needs pred_type='glm'; pred_type='nn' accepts only "
                             "link_approx='mc' (or None)")
        return pred_type, link_approx

    @contextlib.contextmanager
    def _evaluating(self):
        """Eval mode inside (restored after), with PyTorch's own kernels for a recurrent network
        (:mod:`bayeswrap.methods.laplace.kernels`).
        """
        was_training = self.training
        self.eval()
        try:
            with native_kernels(has_recurrent(self.model)):
                yield
        finally:
            self.train(was_training)

    @outside_inference_mode
    def functional_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and marginal variances of the linearised function, f_lin(x) ~ N(f(x; θ*), J diag(v) Jᵀ).

        For ``hessian_structure`` ``"full"``/``"kron"`` the covariance is
        J P⁻¹ Jᵀ and its diagonal is computed as in
        :mod:`bayeswrap.methods.laplace.structures` (full: J from the head's
        features, or ``jacrev`` per ``curvature_chunk_size`` examples; Kron:
        from the unit vectors backpropagated to each layer, without J).

        var_k(x) = Σ_i J_{k,i}(x)² v_i, the diagonal of the functional covariance
        (what the probit link of laplace-torch uses). ``curvature_backend="layers"``:
        the K unit vectors e_k are backpropagated through the batch
        (max(1, ``curvature_chunk_size`` // B) per backward pass) and J_{k,i}² v_i
        is summed per layer from its input and output gradient
        (:meth:`bayeswrap.methods.laplace.curvature.LayerCurvature.weighted_row_norms`);
        ``"vmap"``: per-example vector-Jacobian products in chunks of
        ``curvature_chunk_size`` Jacobian rows. Evaluated in eval mode.

        Args:
            x: inputs, (B, ...).

        Returns:
            ``(f_mu, f_var)``, each (B, K) (the model's output shape), in the
            parameters' dtype.

        Raises:
            NotFittedError: before :meth:`fit_curvature`.
            ValueError: if a floating input contains NaN or inf.
            MemoryBudgetError: (a ``MemoryError``) if the estimated peak exceeds ``memory_budget`` even at
                ``curvature_chunk_size=1`` (checked before the work; a default chunk is lowered to fit).
        """
        self._check_ready()
        check_inputs_finite(x)
        return self._functional_moments(x)

    def _functional_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`functional_moments` on checked inputs, with the chunk sized to ``memory_budget`` (or refused
        before any work: :class:`~bayeswrap.core.memory.MemoryBudgetError`).
        """
        chunk_given = self.curvature_chunk_size
        with self._evaluating():
            self.curvature_chunk_size = plan_chunk(self, x, "glm", {})
        try:
            if self._structure is not None:
                return self._structured_moments(x)
            return self._diag_moments(x, self.posterior_var.as_dict())
        finally:
            self.curvature_chunk_size = chunk_given

    def _structured_moments(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """f(x; θ*) and diag(J P^{-1} Jᵀ) for ``hessian_structure`` ``"full"`` or ``"kron"``."""
        theta = {n: t.detach() for n, t in self.theta.items()}
        delta = self._delta()
        structure = self._structure
        with self._evaluating():
            if hasattr(structure, "functional_moments"):  # lowrank: diag(1/a) by the diagonal machinery, C by jvp
                f, var = structure.functional_moments(self, x, delta)
                return f.detach(), var.to(f.dtype)
            if isinstance(structure, FullPosterior) and self.last_layer_name is not None:
                f, a, d = self._head_terms(x, theta)
                var = structure.feature_variance(a.to(structure.H.dtype), d.to(structure.H.dtype), len(theta) == 2,
                                                 delta)
                return f, var.t().to(f.dtype).reshape(f.shape)
            if isinstance(structure, FullPosterior):
                fs, vs = [], []
                for sl in self._example_slices(x):
                    f, jac = self._jacobian(take(x, sl), theta)
                    fs.append(f.detach())
                    vs.append(structure.functional_variance(jac.to(structure.H.dtype), delta).to(f.dtype))
                f = torch.cat(fs)
                return f, torch.cat(vs).reshape(f.shape)
            capture = self._capture()
            f, seen = capture.run(lambda inp: self.forward_with(theta, inp), x)
            k = f[0].numel()
            # the unit vectors, all at once (the T·V of a token likelihood: curvature_chunk_size at a time)
            step = self.curvature_chunk_size if is_token_likelihood(self.likelihood) else k
            parts = []
            for basis in basis_vectors()(f, step):
                picked, deltas = self._picked_head(x, seen, capture.pullback(f, seen, basis))
                parts.append(structure.functional_variance(picked, deltas, delta))
            var = None if parts[0] is None else torch.cat(parts)
            var = torch.zeros(k, f.shape[0], dtype=f.dtype, device=f.device) if var is None else var.t()
            f = f.detach()
            if structure.diag_names:  # the diagonal blocks: Σ_i J_{k,i}² v_i over those parameters only
                masked = {n: (v if n in structure.diag_names else torch.zeros_like(v))
                          for n, v in self.posterior_var.items()}
                var = var + self._diag_moments(x, masked)[1].reshape(var.shape)
            return f, var.to(f.dtype).reshape(f.shape)

    def _diag_moments(self, x, var) -> tuple[torch.Tensor, torch.Tensor]:
        """f(x; θ*) and Σ_i J_{k,i}² v_i for the diagonal variances ``var``."""
        theta = {n: t.detach() for n, t in self.theta.items()}
        with self._evaluating():
            engine = self._layer_engine()
            if engine is not None:  # rows of J backpropagated through the batch, contracted per layer
                f_mu, norms = engine.weighted_row_norms(self.forward_with, theta, x, basis_vectors(), var)
                return f_mu, norms.t().reshape(f_mu.shape)

        def one(x1, basis, class_chunks):
            f1, vjp_fn = vjp(lambda th: self.forward_with(th, unsqueeze(x1)).reshape(-1), theta)
            parts = []
            for ks in class_chunks:
                (rows,) = vmap_over_examples(vjp_fn)(basis[ks])
                parts.append(sum((r.square() * var[n]).flatten(1).sum(1) for n, r in rows.items()))
            return f1, torch.cat(parts)

        with self._evaluating(), torch.enable_grad():
            chunks = list(self._per_example_chunks(x, one, theta))
            shape = self.forward_with(theta, take(x, slice(0, 1))).shape[1:]
        f_mu = torch.cat([c[0] for c in chunks]).detach()
        f_var = torch.cat([c[1] for c in chunks]).detach()
        return f_mu.reshape(-1, *shape), f_var.reshape(-1, *shape)

    def _linearised_outputs(self, x, num_samples: int, generator: torch.Generator | None) -> torch.Tensor:
        """f(x; θ*) + J(x) δ_s for ``num_samples`` draws δ_s = θ_s − θ*, with forward-mode AD.

        ``scaled_dot_product_attention`` runs its math kernel here: the fused
        (flash / memory-efficient) kernels have no forward-mode derivative.
        """
        theta = {n: t.detach() for n, t in self.theta.items()}
        f = self.forward_with(theta, x)
        self.likelihood.check_outputs(f)

        def lin(delta):
            return jvp(lambda th: self.forward_with(th, x), (theta,), (delta,))[1]

        outs = []
        with sdpa_kernel([SDPBackend.MATH]), warnings.catch_warnings():
            # torch's first forward-mode call scripts its jvp decompositions (torch._decomp.decompositions_for_jvp)
            # and warns 18 times that torch.jit.script is deprecated: torch's own, nothing the user can act on
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
            for start in range(0, num_samples, self.chunk_size):
                deltas = self._sample_deltas(min(self.chunk_size, num_samples - start), generator)
                count = next(iter(deltas.values())).shape[0]
                tangents, vmap_error = None, None
                if count > 1 and self._vmap_ok:
                    try:
                        tangents = vmap(lin, randomness="different")(deltas)
                    except torch.OutOfMemoryError:
                        raise
                    except Exception as err:  # maybe an op without a batching rule: decided below
                        _raise_if_no_forward_ad(err)
                        vmap_error = err
                if tangents is None:
                    try:
                        tangents = torch.stack([lin({n: d[i] for n, d in deltas.items()}) for i in range(count)])
                    except Exception as err:  # the model's own error (e.g. a mis-shaped input): vmap stays on
                        _raise_if_no_forward_ad(err)
                        raise
                    if vmap_error is not None:  # one at a time works, vmap does not: a genuine vmap limitation
                        self._vmap_ok = False
                        warnings.warn(f"vmap over linearised samples failed ({type(vmap_error).__name__}: "
                                      f"{vmap_error}); this model's samples are evaluated one at a time from now on",
                                      RuntimeWarning, stacklevel=5)
                outs.append(f + tangents)
        return torch.cat(outs, 0)

    def default_predictive(self, model: str = "full", *, pred_type: str | None = None,
                           link_approx: str | None = None, **options) -> Predictive:
        """The predictive of :meth:`predict` and :meth:`sample_logits` for the legacy options.

        ``pred_type="glm"`` gives :class:`GLM` with ``link_approx``; ``"nn"`` gives
        :class:`~bayeswrap.methods.predictives.Sampled` (sampled weights, link ``"mc"`` only).
        ``None`` takes the model's :attr:`pred_type` / :attr:`link_approx` (the constructor's,
        ``"mc"`` for ``"nn"``). Nothing on the model changes: ``bnn.predict(x, S, pred_type="nn")``
        is ``bnn.predict(x, S, predictive=Sampled())``, ``bnn.predict(x, S, link_approx="mc")``
        is ``bnn.predict(x, S, predictive=GLM("mc"))``.

        Args:
            model: ``"full"`` only (Laplace has no inclusion variables).
            pred_type: ``"glm"`` or ``"nn"``; ``None`` uses :attr:`pred_type`.
            link_approx: ``"probit"`` or ``"mc"``; ``None`` uses :attr:`link_approx` (``"mc"`` for ``"nn"``).
            **options: none accepted.

        Returns:
            A :class:`GLM` or a :class:`~bayeswrap.methods.predictives.Sampled`.

        Raises:
            ValueError: on a ``model`` other than ``"full"``, an unknown ``pred_type`` or
                ``link_approx``, or ``"probit"`` with ``"nn"``.
            TypeError: on any other option, naming it and the accepted ones.
        """
        refuse_options(self, options, ("model", "pred_type", "link_approx"))
        sampled = super().default_predictive(model=model)  # checks model
        pred_type, link_approx = self._resolve(pred_type, link_approx)
        return sampled if pred_type == "nn" else GLM(link_approx)


class GLM(Predictive):
    """The linearised (GLM) predictive of a fitted :class:`~bayeswrap.Laplace` (Immer et al. 2021).

    * ``num_samples=0``: the MAP, p(y | x, θ*) (for either link).
    * ``link="probit"``, categorical: the deterministic softmax(f_k / sqrt(1 + π/8 · var_k)) with
      var_k the functional variance (MacKay 1992; laplace-torch's default); any S ≥ 1 gives the
      same result.
    * ``link="probit"``, Gaussian: the exact linearised predictive, mean f(x; θ*) and variance
      diag(J P⁻¹ Jᵀ) + noise_std².
    * ``link="mc"``: the likelihood's average over S linearised samples, i.e. :meth:`outputs` for the
      same generator state (softmax averaged; Gaussian: sample mean, sample variance + noise_std²).

    :meth:`outputs` are always the S linearised samples f(x; θ*) + J(x)(θ_s − θ*), one
    ``torch.func.jvp`` per sample, ``chunk_size`` samples per ``vmap``; the same generator state gives the
    same θ_s as :meth:`~bayeswrap.BayesianModel.sample`. Both are evaluated in eval mode (the network
    :meth:`~bayeswrap.Laplace.fit_curvature` linearised) and outside ``torch.inference_mode`` (autograd
    is needed). With the probit link, :func:`~bayeswrap.predictive.predict_loader` is not the average of
    :func:`~bayeswrap.predictive.sample_probs_loader` (which samples); with ``"mc"`` it is.

    Args:
        link: ``"probit"`` (default) or ``"mc"``.

    Raises:
        ValueError: on an unknown ``link``; when used, on a categorical model whose outputs are not
            logits of shape (B, K), K >= 2.
        NotImplementedError: ``"mc"`` on a model with an operation that has no forward-mode derivative.
    """

    def __init__(self, link: str = "probit"):
        self.link = check_choice("link", link, LINK_APPROXES)

    @outside_inference_mode
    def outputs(self, bnn, x, num_samples, generator):
        _check_laplace(bnn)
        with bnn._evaluating(), torch.no_grad():
            return bnn._linearised_outputs(x, num_samples, generator)

    @outside_inference_mode
    @torch.no_grad()
    def predict(self, bnn, x, num_samples, generator):
        _check_laplace(bnn)
        if num_samples == 0 or self.link == "mc":
            return super().predict(bnn, x, num_samples, generator)
        f_mu, f_var = bnn._functional_moments(x)
        bnn.likelihood.check_outputs(f_mu)
        if bnn.likelihood.name == "categorical" or is_token_likelihood(bnn.likelihood):  # softmax over the last dim
            kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * f_var)
            return at_least_float32(kappa * f_mu).softmax(-1)
        return f_mu, f_var + bnn.likelihood.noise_std**2

    def is_sample_average(self, bnn, num_samples):
        """``"mc"``: True (the average of the linearised samples); ``"probit"``: True only at S = 0 (the MAP)."""
        return self.link == "mc" or num_samples == 0

    def __repr__(self) -> str:
        return f"GLM(link={self.link!r})"


def _check_laplace(bnn) -> None:
    """A TypeError unless ``bnn`` is a Laplace model (the only one with a linearisation to evaluate)."""
    if not isinstance(bnn, LinearisedPredictive):
        raise TypeError(f"predictive=GLM(...) is the linearised predictive of method 'laplace', not of method "
                        f"{getattr(bnn, 'method', type(bnn).__name__)!r}; accepted: a Laplace model (other methods: "
                        "Sampled() or PosteriorMean())")


def _raise_if_no_forward_ad(err: Exception) -> None:
    """Turns PyTorch's "no forward AD formula" error into advice on what to use instead."""
    if "forward AD" in str(err):
        raise NotImplementedError(
            "the linearised samples of pred_type='glm' with link_approx='mc' need forward-mode AD "
            f"(torch.func.jvp), which an operation of this model lacks ({err}); use link_approx='probit' "
            "(reverse mode) or pred_type='nn'") from err

