"""Laplace approximation with a linearised (GLM) predictive (BayesDLL §2.4; Daxberger et al. 2021).

This docstring derives the diagonal posterior (``hessian_structure="diag"``,
the default). The dense and Kronecker-factored posteriors
(``hessian_structure="full"``/``"kron"``) and ``subset_of_weights="last_layer"``
are derived in :mod:`bayeswrap.methods.laplace.structures`; they share the
curvature options, the (N/n) scaling, the GLM predictive (with the functional
variance diag(J P⁻¹ Jᵀ)) and the marginal likelihood below, with Σ_i log(1 + h_i/δ)
taken over the eigenvalues h_i of the structured H.

Training is MAP with the prior term. Afterwards :meth:`Laplace.fit_curvature`
computes a diagonal curvature c_n for every training example and the diagonal
posterior N(θ*, diag(v)) with (eqs. 17–19)

    v_i = 1 / (δ · 1[θ_i has a prior] + h_i),    h_i = (N / n) Σ_n c_{n,i},

where δ is the posterior's prior precision (:attr:`Laplace.prior_precision`,
1/σ² of the training prior until :meth:`Laplace.optimize_prior_precision`
changes it) and n the number of examples seen (n = N for one pass over the
training set). The curvature c_n is one of

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

Memory of the vectorised chunks (P = number of Bayesian parameters, K = outputs):

* per-example gradients (``"fisher"``, ``"empirical_fisher"``):
  ``curvature_chunk_size`` × P;
* Jacobian rows (``"ggn"``, probit and Gaussian GLM variances):
  ``curvature_chunk_size`` × P in rows of J (min(K, chunk) classes of
  max(1, chunk // K) examples at a time), plus one P-sized term per example;
* GLM Monte Carlo: ``chunk_size`` × (P + the activations of one forward).

Cost: the probit/Gaussian variances take K vector-Jacobian products per
example (like the exact GGN); Monte Carlo takes S forward-mode passes per
batch, which is cheaper when K is large (e.g. ImageNet): set
``link_approx="mc"`` there.

Learned noise (``likelihood="gaussian", noise_std="learn"``): the GGN of the Gaussian
likelihood is Jᵀ J / σ², so the curvature fitted at σ₀ scales by σ₀²/σ², and
log p(D | θ*, σ) = −RSS/(2σ²) − M log σ − (M/2) log 2π with RSS = Σ_n |y_n − f(x_n; θ*)|²
and M the number of scalar targets (both (N/n)-scaled). :meth:`Laplace.optimize_prior_precision`
with ``"marglik"`` then maximises the Laplace evidence jointly over (log δ, log σ), as
laplace-torch's ``log_marginal_likelihood(prior_precision, sigma_noise)`` (Immer et al.
2021, §3); for a linear-Gaussian model the evidence is exact (MacKay 1992).

References:
    MacKay 1992, "A practical Bayesian framework for backpropagation networks"
    (Laplace, evidence, the probit link and the fixed point δ = γ / |θ* − θ̄|²);
    Spiegelhalter & Lauritzen 1990 (probit approximation); Ritter et al. 2018;
    Kunstner et al. 2019 (limitations of the empirical Fisher); Immer et al. 2021,
    "Improving predictions of Bayesian neural nets via local linearization"
    (GLM predictive); Daxberger et al. 2021, "Laplace Redux" (laplace-torch).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
from torch.func import grad, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from bayeswrap.core.batches import batch_size, check_inputs_finite, loader_pair, take, unsqueeze
from bayeswrap.core.checks import SCALE_RANGE, check_scale
from bayeswrap.core.distributed import all_reduce_sum_
from bayeswrap.core.functional import (
    NamedTensors,
    _mangle,
    nonfinite_names,
    outside_inference_mode,
    vmap_over_examples,
)
from bayeswrap.core.likelihoods import at_least_float32
from bayeswrap.evaluation.tuning import select_by_val_nll
from bayeswrap.methods.base import BayesianModel, NotFittedError, check_float, check_int, register_method
from bayeswrap.methods.laplace.curvature import LayerCurvature, basis_vectors, ggn_vectors, nll_gradient_vectors
from bayeswrap.methods.laplace.structures import (
    HESSIAN_STRUCTURES,
    SUBSETS_OF_WEIGHTS,
    FullPosterior,
    KronPosterior,
    LinearCapture,
    delta_of,
    find_last_layer,
    kron_layer,
    last_layer_params,
    network_jacobian,
)
from bayeswrap.methods.map import MAP
from bayeswrap.predictive import evaluate, model_device

CURVATURES = ("ggn", "fisher", "empirical_fisher")
PRED_TYPES = ("glm", "nn")
LINK_APPROXES = ("mc", "probit")
CURVATURE_BACKENDS = ("layers", "vmap")
TUNING_METHODS = ("marglik", "val")
#: ``subset_of_weights="auto"`` makes only the last layer Bayesian above this many trainable parameters: full-network
#: curvature of a large backbone costs minutes to hours per epoch of data and, diagonal, gains little over the last
#: layer (Daxberger et al. 2021, §5); every model the command line builds from timm or torchvision is above it
AUTO_LAST_LAYER_ABOVE = 1_000_000
#: accepted ``prior_structure`` of :meth:`Laplace.optimize_prior_precision` (laplace-torch's names)
PRIOR_STRUCTURES = ("scalar", "layerwise")
#: Newton steps of the layerwise prior precision search of the "full" structure
MARGLIK_NEWTON_ITERATIONS = 100
#: fit_curvature warns when the posterior variance sums to more than this multiple of Σ θ*²
NOISE_TO_SIGNAL_WARN = 10.0
#: a parameter is "prior-dominated" when its data curvature h_i is below this fraction of δ
PRIOR_DOMINATED_RATIO = 0.01
#: the marginal-likelihood search for δ stays within these bounds
MARGLIK_BOUNDS = (1e-10, 1e10)
#: the likelihoods Laplace supports (the heteroscedastic one would need the GGN of Immer et al. 2023)
LAPLACE_LIKELIHOODS = ("categorical", "gaussian")
#: default grid of the validation search for δ
DEFAULT_GRID = tuple(10.0 ** (k / 2.5) for k in range(-10, 11))  # logspace(-4, 4, 21)
#: accepted prior precisions δ = 1/σ² for σ in the prior_std range [1e-18, 1e18]: float32 holds δ and 1/δ
PRECISION_RANGE = (1e-36, 1e36)


@register_method("laplace")
class Laplace(MAP):
    """Laplace approximation around the MAP estimate (diagonal, Kronecker-factored or full), with a GLM predictive.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        curvature: ``"ggn"`` (exact diagonal generalised Gauss-Newton, the
            default), ``"fisher"`` (Monte Carlo GGN: gradients at labels sampled
            from the model) or ``"empirical_fisher"`` (gradients at the observed
            labels). See the module docstring.
        curvature_chunk_size: bounds the memory of the curvature and of the
            GLM variances. ``"vmap"`` backend (and the GLM variances):
            per-example gradients (or Jacobian rows) per ``vmap`` chunk, i.e.
            that many copies of the Bayesian parameters. ``"layers"`` backend:
            per-example gradients of one layer at a time for that many
            (example, output vector) rows, and max(1, chunk // B) output
            vectors per backward pass of a batch of B examples (``"ggn"``
            backpropagates K vectors per batch).
        curvature_samples: labels sampled per example for ``curvature="fisher"``
            (the number of Monte Carlo samples of the GGN); integer ≥ 1.
        pred_type: default predictive of :meth:`predict` and
            :meth:`sample_logits`: ``"glm"`` (linearised) or ``"nn"`` (sampled
            weights). Calls may override it.
        link_approx: default link of the ``"glm"`` :meth:`predict`:
            ``"probit"`` (deterministic; exact for the Gaussian likelihood) or
            ``"mc"`` (linearised samples). Calls may override it.
        curvature_backend: how :meth:`fit_curvature` (and :meth:`ggn_diagonal`)
            sum squared per-example gradients. ``"layers"`` (default): one
            batched forward and backward pass with per-layer closed forms
            (:mod:`bayeswrap.methods.laplace.curvature`; Linear, Conv1d/2d, LayerNorm, GroupNorm,
            eval-mode BatchNorm, and exact per-module or whole-network ``vmap``
            fallbacks for everything else), several times faster. ``"vmap"``:
            the reference, ``torch.func.vmap`` over examples of the whole
            network's vector-Jacobian products. Both give the same numbers up to
            floating-point rounding; ``"layers"`` uses ``"vmap"`` by itself for
            models that couple the examples of a batch (BatchNorm without
            running statistics).
        hessian_structure: the posterior precision's structure (laplace-torch's
            name): ``"diag"`` (default), ``"kron"`` (KFAC per ``nn.Linear``
            and ``nn.Conv2d``: weight G ⊗ A and bias G blocks, other
            parameters diagonal) or ``"full"`` (dense, at most 20,000
            Bayesian parameters). ``curvature`` chooses what is approximated
            (GGN, Monte Carlo GGN or empirical Fisher) in every structure. See
            :mod:`bayeswrap.methods.laplace.structures`.
        subset_of_weights: ``"auto"`` (default): ``"last_layer"`` for a model with more than
            :data:`AUTO_LAST_LAYER_ABOVE` (1,000,000) trainable parameters and no ``params``
            (every timm/torchvision ResNet, ViT or ConvNeXt, BERT; laplace-torch always
            defaults to the last layer), else ``"all"``. ``"all"``: the parameters ``params``
            selects, all trainable ones unless given. ``"last_layer"`` (also
            ``params="last_layer"``): the weight and bias of the classifier (timm's
            ``get_classifier()``, torchvision's ``fc``, ``classifier``, ``head`` or
            ``heads.head``, Hugging Face's ``classifier`` or ``score``, else the last
            ``nn.Linear``; see :func:`bayeswrap.core.functional.find_last_layer`); the rest of
            the network is a point estimate, and the ``"full"``/``"kron"``
            curvatures and GLM variances use the head's recorded input
            features without differentiating the body. After construction
            ``subset_of_weights`` holds the resolved choice.

    Attributes:
        theta: θ* (trained as MAP).
        posterior_var: v, ``{name: tensor}`` (zeros until fitted).
        curvature_diag: h = (N/n) Σ_n c_n, the data term of the diagonal
            posterior precision, ``{name: tensor}`` (zeros until fitted).
        train_log_likelihood: 0-d float64 buffer, (N/n) Σ_n log p(y_n | x_n, θ*).
        curvature_fitted: 0-d bool buffer.
        prior_precision: δ, the posterior's prior precision (a float property
            backed by the 0-d buffer ``_prior_precision``); setting it
            recomputes ``posterior_var``.
        pred_type: the default predictive, ``"glm"`` or ``"nn"``.
        link_approx: the default link of the GLM predictive, ``"probit"`` or ``"mc"``.
        val_search: after ``optimize_prior_precision("val")``, ``{"grid": [...], "nll": [...]}``.

    Raises:
        ValueError: on an unknown ``curvature``, ``pred_type``,
            ``link_approx``, ``curvature_backend``, ``hessian_structure`` or
            ``subset_of_weights`` (the message names the value and lists the
            accepted ones), a ``curvature_chunk_size`` / ``curvature_samples``
            that is not an integer >= 1, ``params`` together with
            ``subset_of_weights="last_layer"``, a model without an
            ``nn.Linear`` for ``"last_layer"``, ``hessian_structure="full"``
            over more than ``MAX_FULL_PARAMS`` parameters, or ``"full"``/``"kron"``
            with a flat bias prior (``bias="uninformative"``).

    Warns:
        RuntimeWarning: ``hessian_structure="kron"`` with Bayesian parameters
            outside ``nn.Linear`` and ``nn.Conv2d`` layers (they keep a
            diagonal curvature).
    """

    #: a checkpoint from before the log-likelihood was stored has it as NaN (see _load_from_state_dict)
    _nonfinite_state_keys = ("train_log_likelihood",)
    #: post hoc, on the fitted curvature (no retraining; :meth:`optimize_prior_precision`)
    tuning = ("prior_precision", tuple(10.0 ** k for k in range(-4, 5)))
    in_default_comparison = True
    #: besides the prior precision compare tunes by validation NLL: laplace-torch's default, the scalar δ that
    #: maximises the marginal likelihood (no validation data; Daxberger et al. 2021, §4)
    operating_points = ("marglik",)

    @classmethod
    def run_options(cls, run) -> dict:
        """A run scores every method by the same S-sample predictive: the GLM predictive is sampled
        (``link_approx="mc"``) unless the run sets ``link_approx``.
        """
        return {} if "link_approx" in run.options else {"link_approx": "mc"}

    def __init__(self, model, *, curvature: str = "ggn", curvature_chunk_size: int = 32,
                 curvature_samples: int = 1, pred_type: str = "glm", link_approx: str = "probit",
                 curvature_backend: str = "layers", hessian_structure: str = "diag",
                 subset_of_weights: str = "auto", **kwargs):
        if curvature not in CURVATURES:
            raise ValueError(f"curvature={curvature!r} is not known; accepted: {CURVATURES}")
        self.hessian_structure = _check_choice("hessian_structure", hessian_structure, HESSIAN_STRUCTURES)
        subset_of_weights = _check_choice("subset_of_weights", subset_of_weights, SUBSETS_OF_WEIGHTS + ("auto",))
        if kwargs.get("params") == "last_layer":  # the same choice as subset_of_weights="last_layer"
            if subset_of_weights == "all":
                raise ValueError("params='last_layer' and subset_of_weights='all' contradict each other; accepted: "
                                 "one of them")
            kwargs["params"], subset_of_weights = None, "last_layer"
        if subset_of_weights == "auto":
            subset_of_weights = "all" if kwargs.get("params") is not None or _trainable_count(model) <= \
                AUTO_LAST_LAYER_ABOVE else "last_layer"
        self.subset_of_weights = subset_of_weights
        self.last_layer_name: str | None = None
        if subset_of_weights == "last_layer":
            if kwargs.get("params") is not None:
                raise ValueError("params=... and subset_of_weights='last_layer' both choose the Bayesian parameters; "
                                 "accepted: one of them (subset_of_weights='all' with params=[...])")
            self.last_layer_name = find_last_layer(model)
            kwargs["params"] = last_layer_params(model, self.last_layer_name)
        self.curvature = curvature
        self.curvature_backend = _check_choice("curvature_backend", curvature_backend, CURVATURE_BACKENDS)
        self.curvature_chunk_size = check_int("curvature_chunk_size", curvature_chunk_size, minimum=1)
        self.curvature_samples = check_int("curvature_samples", curvature_samples, minimum=1)
        self.pred_type = _check_choice("pred_type", pred_type, PRED_TYPES)
        self.link_approx = _check_choice("link_approx", link_approx, LINK_APPROXES)
        if kwargs.get("likelihood") == "heteroscedastic":
            raise ValueError(f"likelihood='heteroscedastic' is not supported by method 'laplace'; accepted: "
                             f"{LAPLACE_LIKELIHOODS} (for a learned homoscedastic noise: likelihood='gaussian', "
                             "noise_std='learn')")
        super().__init__(model, **kwargs)

    def _init_posterior(self, init):
        super()._init_posterior(init)
        self.posterior_var = NamedTensors({n: torch.zeros_like(t) for n, t in init.items()}, trainable=False)
        self.curvature_diag = NamedTensors({n: torch.zeros_like(t) for n, t in init.items()}, trainable=False)
        self.register_buffer("curvature_fitted", torch.zeros((), dtype=torch.bool))
        self.register_buffer("train_log_likelihood", torch.zeros((), dtype=torch.float64))
        if self._learns_noise:  # (N/n)-scaled [Σ_n |y_n − f_n|², number of targets]: log p(D | θ*, σ) for any σ
            self.register_buffer("train_residuals", torch.zeros(2, dtype=torch.float64))
        # δ per Bayesian parameter tensor (all equal unless set "layerwise"); entries of flat-prior tensors unused
        self.register_buffer("_prior_precision", torch.full((len(init),), 1.0 / self.prior_std**2, dtype=torch.float64))
        self._structure = None if self.hessian_structure == "diag" else self._make_structure(init)

    def _make_structure(self, init):
        """The :class:`FullPosterior` or :class:`KronPosterior` of ``hessian_structure`` (not yet fitted)."""
        flat = [n for n in init if not self.prior.applies_to(n)]
        if flat:
            raise ValueError(f"hessian_structure={self.hessian_structure!r} needs a prior on every Bayesian "
                             f"parameter, but {flat[:4]} have a flat one (bias='uninformative'); accepted: "
                             "bias='informative', or hessian_structure='diag'")
        ref = next(iter(init.values()))
        shapes = {n: t.shape for n, t in init.items()}
        if self.hessian_structure == "full":
            return FullPosterior(shapes, ref.dtype, ref.device)
        layers, covered = {}, set()
        for name, module in self.model.named_modules():
            if not kron_layer(module):
                continue
            prefix = f"{name}." if name else ""
            w, b = prefix + "weight", prefix + "bias"
            if w in init:
                layers[name] = (w, b if b in init else None)
                covered |= {w, b}
        rest = [n for n in init if n not in covered]
        if rest:
            warnings.warn(f"hessian_structure='kron' covers the weight and bias of nn.Linear and nn.Conv2d layers "
                          f"(groups=1, numeric zero padding); the Bayesian "
                          f"parameters {rest[:6]}{' ...' if len(rest) > 6 else ''} keep a diagonal curvature",
                          RuntimeWarning, stacklevel=4)
        return KronPosterior(layers, rest, shapes, ref.dtype, ref.device)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Loads checkpoints saved before the curvature, δ and log-likelihood were stored.

        Such a checkpoint has ``posterior_var`` = 1/(1/prior_std² + h); h is
        recovered from it, δ is 1/prior_std², and the training log-likelihood is
        unknown (NaN: :meth:`log_marginal_likelihood` asks for a new fit).
        ``load_state_dict`` works on its own copy of the mapping.
        """
        var_keys = {n: f"{prefix}posterior_var.{_mangle(n)}" for n in self.posterior_var}
        key = f"{prefix}_prior_precision"
        if torch.is_tensor(state_dict.get(key)) and state_dict[key].dim() == 0:  # saved before layerwise δ
            state_dict[key] = state_dict[key].expand(len(self.posterior_var)).clone()
        if key not in state_dict and all(k in state_dict for k in var_keys.values()):
            delta = 1.0 / self.prior_std**2
            state_dict[key] = torch.full((len(self.posterior_var),), delta, dtype=torch.float64)
            state_dict.setdefault(f"{prefix}train_log_likelihood", torch.tensor(math.nan, dtype=torch.float64))
            for n, key in var_keys.items():
                v = state_dict[key]
                h = torch.where(v > 0, 1.0 / v - (delta if self.prior.applies_to(n) else 0.0), torch.zeros_like(v))
                state_dict.setdefault(f"{prefix}curvature_diag.{_mangle(n)}", h.clamp_min(0))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def _learns_noise(self) -> bool:
        """Whether the Gaussian noise std is learned (``noise_std="learn"``), by the marginal likelihood here."""
        return bool(getattr(self.likelihood, "learned", False))

    def _set_noise_std_property(self, value) -> None:
        """Sets σ; once the curvature is fitted, a learned σ moves the posterior with it (:meth:`_set_noise_std`)."""
        if not self.is_ready() or self.likelihood.name != "gaussian":
            BayesianModel.noise_std.fset(self, value)
        elif self._learns_noise:
            self._set_noise_std(check_scale("noise_std", value))
        else:
            raise ValueError("noise_std cannot change after fit_curvature with a fixed noise std (the curvature and "
                             "the log-likelihood were computed with it); accepted: set it before fit_curvature, or "
                             "wrap with noise_std='learn'")

    noise_std = BayesianModel.noise_std.setter(_set_noise_std_property)

    # ------------------------------------------------------------------ posterior
    def is_ready(self) -> bool:
        if self._structure is not None and not bool(self._structure.fitted):
            return False
        return bool(self.curvature_fitted)

    def _not_ready_message(self):
        return ("the Laplace posterior has no curvature yet: call bnn.fit_curvature(train_loader) first "
                "(bayeswrap.fit does this after training)")

    def _point_estimate(self):
        return self.theta.as_dict()

    @property
    def prior_precision(self) -> float | torch.Tensor:
        """δ, the prior precision of the posterior (1/prior_std² unless changed).

        A float when every Bayesian parameter tensor has the same δ (a scalar
        prior precision); else a float64 tensor (T,) with one δ per Bayesian
        parameter tensor, in :attr:`bayesian_names` order (laplace-torch's
        "layerwise" prior precision, which also has one entry per weight and per
        bias). Only the posterior uses it (v = 1/(δ + h)); the MAP training
        objective keeps the prior N(θ̄, prior_std²). Setting it (a positive
        finite number, or T of them as a sequence or 1-D tensor) recomputes
        ``posterior_var`` when the curvature is fitted.

        Raises:
            ValueError: when set to a non-positive or non-finite value, or to a
                sequence whose length is not T.
        """
        values = self._prior_precision
        if bool((values == values[0]).all()):
            return float(values[0])
        return values.detach().clone()

    @prior_precision.setter
    def prior_precision(self, value) -> None:
        self._prior_precision.copy_(self._precision_vector(value))
        if self.is_ready():
            self._update_posterior_var()

    def _precision_vector(self, value) -> torch.Tensor:
        """A scalar or per-tensor prior precision, checked, as the float64 vector (T,) of the buffer."""
        count = len(self._prior_precision)
        if torch.is_tensor(value) and value.dim() == 0:
            value = float(value.detach())
        if isinstance(value, (int, float)) or not hasattr(value, "__len__"):
            return torch.full((count,), _positive_precision(value), dtype=torch.float64)
        values = value.detach().flatten().tolist() if torch.is_tensor(value) else list(value)
        if len(values) not in (1, count):
            raise ValueError(f"prior_precision has {len(values)} values; accepted: one number, or one per Bayesian "
                             f"parameter tensor ({count}: {list(self.theta.keys())[:6]}"
                             f"{' ...' if count > 6 else ''})")
        checked = [_positive_precision(v, f"prior_precision[{i}]") for i, v in enumerate(values)]
        return torch.tensor(checked * (count if len(checked) == 1 else 1), dtype=torch.float64)

    def _delta(self):
        """δ for the structures: a float (scalar prior precision) or ``{name: δ}`` (one per Bayesian tensor)."""
        value = self.prior_precision
        if isinstance(value, float):
            return value
        return dict(zip(self.theta.keys(), value.tolist()))

    def posterior_std(self):
        """sqrt(v), ``{name: tensor}``.

        Raises:
            NotFittedError: before :meth:`fit_curvature`.
        """
        if not self.is_ready():
            raise NotFittedError(self._not_ready_message())
        return {n: v.sqrt() for n, v in self.posterior_var.items()}

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Draws θ_s ~ N(θ*, P^{-1}) with the posterior's structure (diagonal, full or Kron).

        Args:
            num_samples: S ≥ 1.
            generator: optional ``torch.Generator``.

        Returns:
            ``{name: tensor of shape (S, *param_shape)}``.

        Raises:
            ValueError: if ``num_samples`` is not an integer >= 1.
            NotFittedError: before :meth:`fit_curvature`.
        """
        if self._structure is None:
            return super().sample(num_samples, generator)
        num_samples = check_int("num_samples", num_samples, minimum=1)
        deltas = self._sample_deltas(num_samples, generator)
        return {n: t.detach() + deltas[n] for n, t in self.theta.items()}

    def posterior_precision(self) -> torch.Tensor:
        """The dense posterior precision P = H + δ I over the flattened Bayesian parameters, (P, P), float64.

        For ``"kron"`` the block-diagonal matrix the Kronecker factors define
        (weights row-major, then biases, in parameter order); for ``"diag"``,
        diag(h + δ). Meant for tests and small models.

        Raises:
            NotFittedError: before :meth:`fit_curvature`.
        """
        self._check_ready()
        delta = self._delta()
        structure = self._structure
        if structure is None:
            return torch.diag(torch.cat([(self.curvature_diag[n].double() + delta_of(delta, n)).flatten()
                                         for n in self.curvature_diag]))
        if isinstance(structure, FullPosterior):
            return structure.precision(delta).double()
        blocks = {}
        for layer, (w, b) in structure.layers.items():
            blocks[w] = torch.kron(structure.G[layer], structure.A[layer])
            if b is not None:
                blocks[b] = structure.G[layer]
        for n in structure.diag_names:
            blocks[n] = torch.diag(structure.h[n].flatten())
        h = torch.block_diag(*[blocks[n].double() for n in self.theta.keys()])
        diagonal = torch.cat([torch.full((self.theta[n].numel(),), delta_of(delta, n), dtype=h.dtype)
                              for n in self.theta.keys()])
        return h + torch.diag(diagonal.to(h.device))

    def _update_posterior_var(self) -> bool:
        """V = 1 / (δ·1[prior] + h); returns whether some parameter has zero precision (kept at v = 0).

        For ``hessian_structure`` ``"full"``/``"kron"``: the marginal variances diag(P^{-1}).
        """
        delta = self._delta()
        if self._structure is not None:
            with torch.no_grad():
                for n, v in self._structure.marginal_variances(delta).items():
                    self.posterior_var[n] = v.to(self.posterior_var[n].dtype)
            return False
        degenerate = False
        with torch.no_grad():
            for n, h in self.curvature_diag.items():
                precision = h + (delta_of(delta, n) if self.prior.applies_to(n) else 0.0)
                degenerate |= bool((precision == 0).any())
                # a parameter with neither prior nor data curvature stays at θ* (zero variance)
                self.posterior_var[n] = torch.where(precision > 0, 1.0 / precision, torch.zeros_like(precision))
        return degenerate

    # ------------------------------------------------------------------ curvature
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

    def ggn_diagonal(self, x: torch.Tensor, theta=None) -> dict[str, torch.Tensor]:
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

        Returns:
            ``{name: tensor of the parameter's shape}``, summed over the batch.
        """
        theta = {n: t.detach() for n, t in (theta or self.theta.as_dict()).items()}
        engine = self._layer_engine()
        if engine is not None:
            return engine.squared_grad_sums(self.forward_with, theta, x, ggn_vectors(self.likelihood))
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
        number of examples seen), so that a subset of the training set
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
        seen = 0
        structure = self._structure
        diag_wanted = structure is None or bool(getattr(structure, "diag_names", ()))
        if structure is not None:
            structure.fitted.fill_(False)
            structure.reset()
        try:
            for index, batch in enumerate(train_loader):
                x, y = loader_pair(batch, f"fit_curvature's loader batch {index}", self.label_key, device,
                                   self.likelihood.name == "categorical")
                out = self.forward_with(theta, x)
                self.likelihood.check_targets(out, y)
                batch_log_lik = -self.likelihood.nll(out, y, reduction="none").double().sum()
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
                        continue
                with torch.enable_grad():
                    if self.curvature == "ggn":
                        torch._foreach_add_(list(curv.values()), list(self.ggn_diagonal(x, theta).values()))
                    elif self.curvature == "fisher":
                        sampled = [self.likelihood.sample_targets(out, generator=generator)
                                   for _ in range(self.curvature_samples)]
                        self._add_squared_grads(curv, x, sampled, theta, 1.0 / self.curvature_samples)
                    else:
                        self._add_squared_grads(curv, x, y, theta, 1.0)
                seen += batch_size(x)
            # data-parallel fits: every rank saw its own shard; the curvature, the log-likelihood and
            # the example count are sums over examples, so summing them over the ranks gives the full terms
            count = torch.tensor(float(seen), dtype=torch.float64, device=device)
            all_reduce_sum_([*curv.values(), log_lik, count, residuals,
                             *([] if structure is None else [t for t in structure.buffers() if t.is_floating_point()])])
            seen = int(round(float(count)))
        finally:
            self.train(was_training)
        if seen == 0:
            raise ValueError("fit_curvature got an empty loader; it needs at least one (inputs, targets) batch")
        bad = nonfinite_names(curv.items())
        if bad:
            raise FloatingPointError(f"the curvature of parameter {bad[0]!r} is non-finite (NaN or inf) after {seen} "
                                     "examples with finite inputs and log-likelihood (the squared gradients overflow; "
                                     "is θ* diverged?); the posterior was left unchanged")
        scale = self.num_data / seen
        if structure is not None:
            if isinstance(structure, FullPosterior):
                structure.finish(scale)
                diag = structure._split(torch.diagonal(structure.H))
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
        f = f.detach()
        if self.curvature == "ggn":
            vectors = ggn_vectors(self.likelihood)
        elif self.curvature == "fisher":
            vectors = nll_gradient_vectors(self.likelihood, sampled, 1.0 / len(sampled))
        else:
            vectors = nll_gradient_vectors(self.likelihood, [y])
        return torch.cat(list(vectors(f, max(f[0].numel(), len(sampled or ())))), 0)

    def _capture(self) -> LinearCapture:
        """Records the inputs and outputs of the Kron layers (or of the last layer, whose body is not differentiated)."""
        if self.last_layer_name is not None:
            return LinearCapture({self.last_layer_name: self.model.get_submodule(self.last_layer_name)},
                                 detach_input=True)
        return LinearCapture({n: self.model.get_submodule(n) for n in self._structure.layers})

    def _example_slices(self, x) -> list[slice]:
        """Slices of ``curvature_chunk_size`` examples (bounds the (c, K, P) Jacobians of ``"full"`` over all)."""
        c = self.curvature_chunk_size
        return [slice(s, s + c) for s in range(0, batch_size(x), c)]

    def _jacobian(self, x, theta) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs f (B, *out) and the per-example Jacobian J (B, K, P) by ``jacrev`` under ``vmap`` (``"full"``, all)."""
        with torch.enable_grad():
            jac = network_jacobian(self.forward_with, theta, x, max(1, self.curvature_chunk_size))
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
        d = capture.pullback(f, seen, v)[self.last_layer_name]
        a = seen[self.last_layer_name][0]
        if a.dim() != 2:
            raise ValueError(f"subset_of_weights='last_layer' with hessian_structure='full' needs the last layer's "
                             f"input to be (B, D) features, got shape {tuple(a.shape)}; accepted: "
                             "hessian_structure='kron' or 'diag'")
        return f.detach(), a, d

    def _accumulate_structure(self, x, y, theta, sampled) -> None:
        """Adds one batch to the full H or to the Kron factors."""
        structure = self._structure
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
        v = self._curvature_vectors(f, y, sampled)
        structure.add(seen, capture.pullback(f, seen, v))

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
        noise = sum(float(v.double().sum()) for v in self.posterior_var.values())
        signal = sum(float(t.detach().double().square().sum()) for t in self.theta.values())
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

    # ------------------------------------------------------------------ predictive
    def _resolve(self, pred_type: str | None, link_approx: str | None) -> tuple[str, str]:
        """Per-call options or the model's defaults; ``"nn"`` always samples (link ``"mc"``)."""
        pred_type = self.pred_type if pred_type is None else _check_choice("pred_type", pred_type, PRED_TYPES)
        if link_approx is None:
            return pred_type, self.link_approx if pred_type == "glm" else "mc"
        _check_choice("link_approx", link_approx, LINK_APPROXES)
        if link_approx == "probit" and pred_type != "glm":
            raise ValueError("link_approx='probit' needs pred_type='glm'; pred_type='nn' accepts only "
                             "link_approx='mc' (or None)")
        return pred_type, link_approx

    @contextlib.contextmanager
    def _evaluating(self):
        was_training = self.training
        self.eval()
        try:
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
        """
        self._check_ready()
        check_inputs_finite(x)
        return self._functional_moments(x)

    def _functional_moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`functional_moments` on checked inputs."""
        if self._structure is not None:
            return self._structured_moments(x)
        return self._diag_moments(x, self.posterior_var.as_dict())

    def _structured_moments(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        """f(x; θ*) and diag(J P^{-1} Jᵀ) for ``hessian_structure`` ``"full"`` or ``"kron"``."""
        theta = {n: t.detach() for n, t in self.theta.items()}
        delta = self._delta()
        structure = self._structure
        with self._evaluating():
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
            basis = torch.eye(k, dtype=f.dtype, device=f.device)[:, None].expand(-1, f.shape[0], -1)
            deltas = capture.pullback(f, seen, basis.reshape(k, *f.shape))
            var = structure.functional_variance(seen, deltas, delta)
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

    def _sample_deltas(self, count: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """θ_s − θ* = sqrt(v) ε, drawn like :meth:`sample` draws (the same ε for the same generator)."""
        if self._structure is not None:
            self._check_ready()
            deltas = self._structure.sample_deltas(count, generator, self._delta())
            return {n: d.to(self.theta[n].dtype) for n, d in deltas.items()}
        out = {}
        for n, std in self.posterior_std().items():
            eps = torch.randn((count, *std.shape), generator=generator, device=std.device, dtype=std.dtype)
            out[n] = std * eps
        return out

    def _glm_sample_logits(self, x, num_samples: int, generator: torch.Generator | None) -> torch.Tensor:
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
        with sdpa_kernel([SDPBackend.MATH]):
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

    @outside_inference_mode
    def sample_logits(self, x, num_samples: int, generator: torch.Generator | None = None, *,
                      pred_type: str | None = None) -> torch.Tensor:
        """Model outputs under S posterior samples, linearised (``"glm"``) or not (``"nn"``).

        ``"glm"``: f(x; θ*) + J(x)(θ_s − θ*), one ``torch.func.jvp`` per sample,
        ``chunk_size`` samples per ``vmap`` (eval mode). ``"nn"``: f(x; θ_s), see
        :meth:`BayesianModel.sample_logits`. The same generator state gives the
        same θ_s for both.

        Args:
            x: model input with batch size B.
            num_samples: S ≥ 1.
            generator: optional ``torch.Generator``.
            pred_type: ``"glm"`` or ``"nn"``; ``None`` uses :attr:`pred_type`.

        Returns:
            Tensor of shape (S, B, K) (or (S, B, D) for regression).

        Raises:
            NotFittedError: before :meth:`fit_curvature`.
            ValueError: on a ``num_samples`` that is not an integer >= 1, an unknown
                ``pred_type``, or a floating input that contains NaN or inf.
        """
        pred_type, _ = self._resolve(pred_type, None)
        if pred_type == "nn":
            return super().sample_logits(x, num_samples, generator=generator)
        num_samples = check_int("num_samples", num_samples, minimum=1)
        self._check_ready()
        check_inputs_finite(x)
        with self._evaluating(), torch.no_grad():
            return self._glm_sample_logits(x, num_samples, generator)

    @outside_inference_mode
    @torch.no_grad()
    def predict(self, x, num_samples: int = 5, generator: torch.Generator | None = None, *,
                pred_type: str | None = None, link_approx: str | None = None):
        """Posterior predictive p(y | x, D), linearised (``"glm"``) or sampled (``"nn"``).

        * ``num_samples=0``: the MAP, p(y | x, θ*) (for every pred_type and link).
        * ``"glm"`` with ``"probit"`` (the default link), categorical: the
          deterministic softmax(f_k / sqrt(1 + π/8 · var_k)) with var_k the
          functional variance (MacKay 1992; laplace-torch's default); any S ≥ 1
          gives the same result.
        * ``"glm"`` with ``"probit"``, Gaussian: the exact linearised predictive,
          mean f(x; θ*) and variance diag(J diag(v) Jᵀ) + noise_std².
        * ``"glm"`` with ``"mc"``: the likelihood's average over S linearised
          samples, i.e. ``sample_logits(x, S)`` for the same generator state
          (softmax averaged; Gaussian: sample mean, sample variance + noise_std²).
        * ``"nn"``: (1/S) Σ_s p(y | x, θ_s), see :meth:`BayesianModel.predict`
          (link ``"mc"`` only).

        The GLM predictive is evaluated in eval mode (the network that
        :meth:`fit_curvature` linearised). With the probit link,
        :func:`~bayeswrap.predictive.predict_loader` is not the average of
        :func:`~bayeswrap.predictive.sample_probs_loader` (which samples); with
        ``link_approx="mc"`` it is. Probit costs K vector-Jacobian products per
        example, Monte Carlo S jvps per batch.

        Args:
            x: model input with batch size B.
            num_samples: S ≥ 0.
            generator: optional ``torch.Generator``.
            pred_type: ``"glm"`` or ``"nn"``; ``None`` uses :attr:`pred_type`.
            link_approx: ``"probit"`` or ``"mc"``; ``None`` uses :attr:`link_approx`
                (``"mc"`` for ``"nn"``).

        Returns:
            Categorical: probabilities (B, K) (float32, or float64 for a float64
            model). Gaussian: ``(mean, variance)``, each (B, D).

        Raises:
            NotFittedError: before :meth:`fit_curvature`.
            ValueError: on a ``num_samples`` that is not an integer >= 0, an unknown
                ``pred_type`` or ``link_approx``, ``"probit"`` with ``"nn"``, a
                floating input that contains NaN or inf, or a categorical model
                whose outputs are not logits of shape (B, K), K >= 2.
        """
        pred_type, link_approx = self._resolve(pred_type, link_approx)
        num_samples = check_int("num_samples", num_samples, minimum=0)
        self._check_ready()
        check_inputs_finite(x)
        if num_samples == 0:
            return self._predictive(self.forward_with(self.posterior_mean(), x).unsqueeze(0))
        if pred_type == "nn":
            return self._predictive(BayesianModel._sample_logits(self, x, num_samples, generator))
        if link_approx == "probit":
            f_mu, f_var = self._functional_moments(x)
            self.likelihood.check_outputs(f_mu)
            if self.likelihood.name == "categorical":
                kappa = 1.0 / torch.sqrt(1.0 + math.pi / 8.0 * f_var)
                return at_least_float32(kappa * f_mu).softmax(-1)
            return f_mu, f_var + self.likelihood.noise_std**2
        with self._evaluating():
            return self._predictive(self._glm_sample_logits(x, num_samples, generator))

    # ------------------------------------------------------------------ evidence and prior precision
    def _marglik_terms(self) -> tuple[list[str], dict[str, torch.Tensor] | None, dict[str, torch.Tensor], torch.Tensor]:
        """The parameters with a prior, and per such tensor t: the eigenvalues λ_t of H's block (``None`` for
        ``"full"``, whose H couples the tensors), (θ*_t − θ̄_t)² summed (float64 0-d), and log p(D | θ*).
        """
        self._check_ready()
        names = [n for n in self.curvature_diag if self.prior.applies_to(n)]
        if not names:
            raise ValueError("no Bayesian parameter has a prior (bias='uninformative' leaves only flat priors), "
                             "so the marginal likelihood does not depend on the prior precision")
        if isinstance(self._structure, FullPosterior):
            blocks = None
        elif self._structure is not None:
            blocks = self._structure.block_eigenvalues()
        else:
            blocks = {n: self.curvature_diag[n].detach().double().flatten() for n in names}
        sq = {n: (self.theta[n].detach().double() - self.prior.mean[n].double()).square().sum() for n in names}
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
        if bool((delta == delta[0]).all()) and not delta.requires_grad:  # scalar: H's eigenvalues serve every δ
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
          :meth:`predict` (with ``pred_type``/``link_approx``, ``num_samples``
          samples and a generator re-seeded with ``seed`` for every grid value,
          so that all values see the same noise); the first one on ties. Scalar only.

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
        method = _check_choice("method", method, TUNING_METHODS)
        prior_structure = _check_choice("prior_structure", prior_structure, PRIOR_STRUCTURES)
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
            num_samples = check_int("num_samples", num_samples, minimum=1)
            seed = check_int("seed", seed)
            self.prior_precision = self._grid_search(val_loader, _check_grid(grid), pred_type, link_approx,
                                                     num_samples, seed)
        return self.prior_precision

    def _maximise_marglik(self) -> float:
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

    def _maximise_marglik_layerwise(self) -> torch.Tensor:
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

    def _grid_search(self, val_loader, grid: list[float], pred_type, link_approx, num_samples: int,
                     seed: int) -> float:

        pred_type, link_approx = self._resolve(pred_type, link_approx)
        device = model_device(self)
        start, defaults = self.prior_precision, (self.pred_type, self.link_approx)
        self.pred_type, self.link_approx = pred_type, link_approx  # what evaluate's predict calls use
        nlls = []
        try:
            for delta in grid:
                self.prior_precision = delta
                generator = torch.Generator(device=device).manual_seed(seed)
                try:
                    nll = evaluate(self, val_loader, num_samples, generator=generator)["nll"]
                except ValueError as err:
                    if "yielded no batches" in str(err):
                        raise ValueError("val_loader yielded no batches") from None
                    raise
                nlls.append(nll if math.isfinite(nll) else math.inf)
        except BaseException:
            self.prior_precision = start
            raise
        finally:
            self.pred_type, self.link_approx = defaults
        self.val_search = {"grid": list(grid), "nll": nlls}
        return grid[select_by_val_nll(grid, nlls)]


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


def _raise_if_no_forward_ad(err: Exception) -> None:
    """Turns PyTorch's "no forward AD formula" error into advice on what to use instead."""
    if "forward AD" in str(err):
        raise NotImplementedError(
            "the linearised samples of pred_type='glm' with link_approx='mc' need forward-mode AD "
            f"(torch.func.jvp), which an operation of this model lacks ({err}); use link_approx='probit' "
            "(reverse mode) or pred_type='nn'") from err


def _trainable_count(model) -> int:
    """The number of trainable parameter entries of ``model`` (tied tensors once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _check_choice(name: str, value, accepted: tuple[str, ...]) -> str:
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not known; accepted: {accepted}")
    return value


def _positive_precision(value, name: str = "prior_precision") -> float:
    return check_float(name, value, low=PRECISION_RANGE[0], high=PRECISION_RANGE[1],
                       note="δ = 1/σ²; float32 must hold δ and the prior variance 1/δ")


def _check_grid(grid) -> list[float]:
    if grid is None:
        return list(DEFAULT_GRID)
    values = grid.detach().flatten().tolist() if torch.is_tensor(grid) else list(grid)
    if not values:
        raise ValueError("grid is empty; accepted: positive prior precisions, e.g. torch.logspace(-4, 4, 21)")
    return [_positive_precision(v, f"grid[{i}]") for i, v in enumerate(values)]
