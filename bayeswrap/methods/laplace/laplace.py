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
training set); the curvature c_n and how it is fitted are derived in
:mod:`bayeswrap.methods.laplace.fitting`.

The method is one class over files of one concept each:

* this module: the options, the prior precision δ, the posterior variances v and the draws
  θ_s ~ N(θ*, P⁻¹) (:meth:`Laplace.sample`);
* :mod:`bayeswrap.methods.laplace.fitting`: the curvature (``"ggn"``, ``"fisher"``, ``"empirical_fisher"``),
  :meth:`Laplace.fit_curvature` and its warning when the sampled weights are mostly noise;
* :mod:`bayeswrap.methods.laplace.glm`: the predictive, linearised (``pred_type="glm"``, probit or Monte Carlo
  link) or sampled (``"nn"``);
* :mod:`bayeswrap.methods.laplace.marglik`: the marginal likelihood, the Newton searches for δ (and for a
  learned noise std) and the validation-NLL search;
* :mod:`bayeswrap.methods.laplace.structures` and :mod:`bayeswrap.methods.laplace.curvature`: the full and
  Kronecker-factored posteriors, and the per-layer curvature engine;
* :mod:`bayeswrap.methods.laplace.lowrank` (``hessian_structure="lowrank"``: the top-k eigenpairs of the GGN by
  randomised subspace iteration, matrix-free) and :mod:`bayeswrap.methods.laplace.subnetwork`
  (``subset_of_weights="subnetwork"``: a dense posterior over the highest-scoring entries; Daxberger et al. 2021,
  ICML).

Laplace-LoRA (Yang et al. 2024) is this class on a peft model's adapters:

    bnn = bw.wrap(peft_model, "laplace", params="adapters", hessian_structure="kron", num_data=N)
    bw.fit(bnn, train_loader, ...)              # MAP on the adapters; after_fit fits the curvature
    bnn.optimize_prior_precision("marglik")     # the evidence-tuned δ (Immer et al. 2021; MacKay 1992)
    probs = bnn.predict(batch)                  # the probit GLM predictive over (B, K) logits

LoRA's A (r × in) and B (out × r) are separate ``nn.Linear`` modules, so each gets its own Kronecker factors
G ⊗ A (:mod:`bayeswrap.methods.laplace.structures`; inputs with token dims are flattened into examples, KFAC
"expand"); the frozen base is differentiated through but has no posterior. peft's ``modules_to_save`` head stays a
point estimate with ``params="adapters"`` (``params=None`` makes it Bayesian too). The curvature and the Kronecker
factors are fp32 for bf16/fp16 adapters (:mod:`bayeswrap.core.adapters`). For a causal LM read as a classifier at
each sequence's last non-padding token (Yang et al.'s next-token logits over the answer tokens), wrap with
``output_reduction="pick_last"`` (:mod:`bayeswrap.core.reductions`). Equal to laplace-torch's ``KronLaplace``
over the same ``requires_grad`` parameters (its LoRA path) to 1e-6 (``tests/test_laplace_lora.py``).

Language-model likelihoods (``likelihood="causal_lm"`` / ``"token_categorical"``, logits (B, T, V) and labels
(B, T) with -100 ignored; :mod:`bayeswrap.core.token_likelihoods`): a sequence's log-likelihood is the sum over its
target tokens, so its GGN is Σ_t J_tᵀ (diag(p_t) − p_t p_tᵀ) J_t over the positions t that score a label
(:func:`~bayeswrap.methods.laplace.fitting.ggn_vectors`), ``num_data`` and the N/n scaling count target tokens,
the Kronecker factor A averages over the sequences' positions (KFAC "expand"), and the (empirical) Fisher takes
each sequence's summed gradient. The exact GGN backpropagates T·V vectors per sequence and the probit GLM
predictive T·V unit vectors (``curvature_chunk_size`` per backward pass): for a real vocabulary use ``curvature="fisher"`` (one sampled sequence per
example) and ``link_approx="mc"`` (forward-mode linearised samples), which give (B, T, V) probabilities too.
Computed by the per-layer engine only (``curvature_backend="layers"``).

References:
    MacKay 1992, "A practical Bayesian framework for backpropagation networks";
    Ritter et al. 2018; Immer et al. 2021, "Improving predictions of Bayesian neural
    nets via local linearization"; Daxberger et al. 2021, "Laplace Redux" (laplace-torch);
    Yang, Robeyns, Wang, Aitchison 2024, "Bayesian low-rank adaptation for large language models", ICLR
    (Laplace-LoRA: KFAC over the LoRA adapters, the prior precision by the marginal likelihood).
"""

from __future__ import annotations

import math
import warnings

import torch

from bayeswrap.core.checks import check_bool, check_choice, check_scale
from bayeswrap.core.functional import NamedTensors, _mangle
from bayeswrap.core.memory import parse_budget
from bayeswrap.core.token_likelihoods import TOKEN_LIKELIHOODS
from bayeswrap.methods.base import BayesianModel, NotFittedError, check_int, register_method
from bayeswrap.methods.laplace.fitting import CURVATURE_BACKENDS, CURVATURES, CurvatureFitting
from bayeswrap.methods.laplace.glm import LINK_APPROXES, PRED_TYPES, LinearisedPredictive
from bayeswrap.methods.laplace.lowrank import LowRankPosterior
from bayeswrap.methods.laplace.marglik import PriorPrecisionSearch, positive_precision
from bayeswrap.methods.laplace.memory import check_draws, check_stored
from bayeswrap.methods.laplace.structures import (
    HESSIAN_STRUCTURES,
    MAX_FULL_PARAMS,
    SUBSETS_OF_WEIGHTS,
    FullPosterior,
    KronPosterior,
    delta_of,
    find_last_layer,
    kron_layer,
    last_layer_params,
)
from bayeswrap.methods.laplace.subnetwork import SUBNETWORK_SCORES, SubnetPosterior
from bayeswrap.methods.map import MAP

#: ``subset_of_weights="auto"`` makes only the last layer Bayesian above this many trainable parameters: full-network
#: curvature of a large backbone costs minutes to hours per epoch of data and, diagonal, gains little over the last
#: layer (Daxberger et al. 2021, §5); every model the command line builds from timm or torchvision is above it
AUTO_LAST_LAYER_ABOVE = 1_000_000
#: the likelihoods Laplace supports (the heteroscedastic one would need the GGN of Immer et al. 2023)
LAPLACE_LIKELIHOODS = ("categorical", "gaussian", *TOKEN_LIKELIHOODS)


@register_method("laplace", order=70)
class Laplace(CurvatureFitting, LinearisedPredictive, PriorPrecisionSearch, MAP):
    """Laplace approximation around the MAP estimate (diagonal, Kronecker-factored or full), with a GLM predictive
    (MacKay 1992; Ritter et al. 2018; Immer et al. 2021; Daxberger et al. 2021).

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
            :meth:`sample_logits`: ``"glm"`` (linearised,
            :class:`~bayeswrap.methods.laplace.glm.GLM`) or ``"nn"`` (sampled
            weights, :class:`~bayeswrap.methods.predictives.Sampled`). Calls may
            override it (``pred_type=``, or ``predictive=``; see :meth:`default_predictive`).
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
            parameters diagonal), ``"full"`` (dense, at most 20,000
            Bayesian parameters) or ``"lowrank"`` (the ``low_rank`` leading
            eigenpairs of H by randomised subspace iteration, matrix-free; see
            :mod:`bayeswrap.methods.laplace.lowrank`). ``curvature`` chooses what is approximated
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
            features without differentiating the body. ``"subnetwork"`` (with
            ``hessian_structure="full"``): a dense posterior over the
            ``n_params_subnet`` entries of the Bayesian parameters with the largest
            ``subnetwork_score``, the others at the MAP (Daxberger et al. 2021, ICML;
            :mod:`bayeswrap.methods.laplace.subnetwork`). After construction
            ``subset_of_weights`` holds the resolved choice.
        low_rank: ``hessian_structure="lowrank"``: k, the eigenpairs of H kept,
            an integer in [1, P] (P the number of Bayesian parameters; laplace-torch's
            ``low_rank``).
        low_rank_diagonal: ``"lowrank"``: also keep the diagonal remainder
            D = max(0, diag(H) − diag(U diag(λ) Uᵀ)) (the exact diagonal of H
            where the k directions miss it); P = U diag(λ) Uᵀ + D + δ I.
        low_rank_power_iterations: ``"lowrank"``: q ≥ 0 subspace iterations
            (2 + q passes over the training data; Halko et al. 2011, Alg. 4.4).
        n_params_subnet: ``subset_of_weights="subnetwork"``: n, the entries kept,
            an integer in [1, min(P, 20,000)] (laplace-torch's name); required there.
        subnetwork_score: ``"subnetwork"``: ``"largest_variance"`` (default: the
            variance 1/(h + δ) of the diagonal Laplace posterior) or
            ``"largest_magnitude"`` (|θ*|); other scores (e.g. SWAG's variances)
            by :meth:`use_subnetwork_scores`.
        memory_budget: the bytes the curvature fit, the GLM predictive and the draws may allocate at their peak:
            ``None`` (default: the device's free memory at the time of each check), a number of bytes, or a
            string such as ``"2GiB"`` or ``"500MB"`` (:func:`bayeswrap.core.memory.parse_budget`). Each estimates
            its peak before allocating (:mod:`bayeswrap.methods.laplace.memory`); a ``curvature_chunk_size`` left
            at its default 32 is halved until the estimate fits, and what cannot fit raises
            :class:`~bayeswrap.core.memory.MemoryBudgetError` naming the estimate, the budget and the
            structures whose estimate fits. The posterior's own storage (the dense P × P matrix of ``"full"``,
            the Kronecker factors) is checked at construction.

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
            with a flat bias prior (``bias="uninformative"``), or a token likelihood (``"causal_lm"``,
            ``"token_categorical"``) with ``curvature_backend="vmap"``, or a ``memory_budget`` that is not a
            memory size (the message lists the accepted forms).
        MemoryBudgetError: (a ``MemoryError``) if the posterior's storage (and its eigendecomposition) is
            estimated above ``memory_budget``, before it is allocated.

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

    def __init__(self, model, *, curvature: str = "ggn", curvature_chunk_size: int = 32,
                 curvature_samples: int = 1, pred_type: str = "glm", link_approx: str = "probit",
                 curvature_backend: str = "layers", hessian_structure: str = "diag",
                 subset_of_weights: str = "auto", low_rank: int = 10, low_rank_diagonal: bool = False,
                 low_rank_power_iterations: int = 2, n_params_subnet: int | None = None,
                 subnetwork_score: str = "largest_variance",
                 memory_budget: int | str | None = None, **kwargs):
        check_choice("curvature", curvature, CURVATURES)
        self.memory_budget = parse_budget(memory_budget)
        self.hessian_structure = check_choice("hessian_structure", hessian_structure, HESSIAN_STRUCTURES)
        subset_of_weights = check_choice("subset_of_weights", subset_of_weights, SUBSETS_OF_WEIGHTS + ("auto",))
        if kwargs.get("params") == "last_layer":  # the same choice as subset_of_weights="last_layer"
            if subset_of_weights == "all":
                raise ValueError("params='last_layer' and subset_of_weights='all' contradict each other; accepted: "
                                 "one of them")
            kwargs["params"], subset_of_weights = None, "last_layer"
        if subset_of_weights == "auto":
            subset_of_weights = "all" if kwargs.get("params") is not None or _trainable_count(model) <= \
                AUTO_LAST_LAYER_ABOVE else "last_layer"
        self.subset_of_weights = subset_of_weights
        self.low_rank = check_int("low_rank", low_rank, minimum=1)
        self.low_rank_diagonal = check_bool("low_rank_diagonal", low_rank_diagonal)
        self.low_rank_power_iterations = check_int("low_rank_power_iterations", low_rank_power_iterations, minimum=0)
        self.subnetwork_score = check_choice("subnetwork_score", subnetwork_score, SUBNETWORK_SCORES)
        if subset_of_weights == "subnetwork":
            if self.hessian_structure != "full":
                raise ValueError(f"subset_of_weights='subnetwork' keeps a dense posterior over the chosen entries; "
                                 f"got hessian_structure={self.hessian_structure!r}; accepted: "
                                 "hessian_structure='full'")
            if n_params_subnet is None:
                raise ValueError("subset_of_weights='subnetwork' needs n_params_subnet, the number of parameter "
                                 "entries of the subnetwork; accepted: an integer >= 1")
        self.n_params_subnet = None if n_params_subnet is None else check_int("n_params_subnet", n_params_subnet,
                                                                              minimum=1)
        self.last_layer_name: str | None = None
        if subset_of_weights == "last_layer":
            if kwargs.get("params") is not None:
                raise ValueError("params=... and subset_of_weights='last_layer' both choose the Bayesian parameters; "
                                 "accepted: one of them (subset_of_weights='all' with params=[...])")
            self.last_layer_name = find_last_layer(model)
            kwargs["params"] = last_layer_params(model, self.last_layer_name)
        self.curvature = curvature
        self.curvature_backend = check_choice("curvature_backend", curvature_backend, CURVATURE_BACKENDS)
        self.curvature_chunk_size = check_int("curvature_chunk_size", curvature_chunk_size, minimum=1)
        self.curvature_samples = check_int("curvature_samples", curvature_samples, minimum=1)
        self.pred_type = check_choice("pred_type", pred_type, PRED_TYPES)
        self.link_approx = check_choice("link_approx", link_approx, LINK_APPROXES)
        if kwargs.get("likelihood") == "heteroscedastic":
            raise ValueError(f"likelihood='heteroscedastic' is not supported by method 'laplace'; accepted: "
                             f"{LAPLACE_LIKELIHOODS} (for a learned homoscedastic noise: likelihood='gaussian', "
                             "noise_std='learn')")
        if kwargs.get("likelihood") in TOKEN_LIKELIHOODS and self.curvature_backend != "layers":
            raise ValueError(f"likelihood={kwargs['likelihood']!r} with curvature_backend={self.curvature_backend!r}: "
                             "the token likelihoods' curvature is computed by the per-layer engine only; accepted: "
                             "curvature_backend='layers'")
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
        layers, covered = {}, set()
        for name, module in self.model.named_modules():
            if not kron_layer(module):
                continue
            prefix = f"{name}." if name else ""
            w, b = prefix + "weight", prefix + "bias"
            if w in init:
                layers[name] = (w, b if b in init else None)
                covered |= {w, b}
        if self.subset_of_weights == "subnetwork":
            if self.n_params_subnet <= MAX_FULL_PARAMS:  # else SubnetPosterior says so
                check_stored(self, "subnetwork", layers)
            return SubnetPosterior(shapes, self.n_params_subnet, self.subnetwork_score, ref.dtype, ref.device)
        if self.hessian_structure == "lowrank":
            if self.low_rank <= sum(t.numel() for t in init.values()):  # else LowRankPosterior says so
                check_stored(self, "lowrank", layers)
            return LowRankPosterior(shapes, self.low_rank, self.low_rank_diagonal, self.low_rank_power_iterations,
                                    ref.dtype, ref.device)
        if self.hessian_structure == "full":
            if sum(t.numel() for t in init.values()) <= MAX_FULL_PARAMS:  # else FullPosterior says so
                check_stored(self, "full", layers)  # the Kron layers: is "kron" an alternative that fits
            return FullPosterior(shapes, ref.dtype, ref.device)
        rest = [n for n in init if n not in covered]
        if rest:
            warnings.warn(f"hessian_structure='kron' covers the weight and bias of nn.Linear and nn.Conv2d layers "
                          f"(groups=1, numeric zero padding); the Bayesian "
                          f"parameters {rest[:6]}{' ...' if len(rest) > 6 else ''} keep a diagonal curvature",
                          RuntimeWarning, stacklevel=4)
        check_stored(self, "kron", layers)
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
            return torch.full((count,), positive_precision(value), dtype=torch.float64)
        values = value.detach().flatten().tolist() if torch.is_tensor(value) else list(value)
        if len(values) not in (1, count):
            raise ValueError(f"prior_precision has {len(values)} values; accepted: one number, or one per Bayesian "
                             f"parameter tensor ({count}: {list(self.theta.keys())[:6]}"
                             f"{' ...' if count > 6 else ''})")
        checked = [positive_precision(v, f"prior_precision[{i}]") for i, v in enumerate(values)]
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

    def _draw(self, num_samples: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """θ_s ~ N(θ*, P⁻¹) with the posterior's structure, ``{name: (S, *param_shape)}``.

        Diagonal: the base class's N(θ*, diag(v)); full or Kron: θ* + P^{-1/2} ε
        (:meth:`~bayeswrap.methods.laplace.structures.FullPosterior.sample_deltas`).
        """
        if self._structure is None:
            check_draws(self, num_samples)
            return super()._draw(num_samples, generator)
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
        if isinstance(structure, (FullPosterior, LowRankPosterior)):  # subnetwork: the (n, n) block of its entries
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

    def use_subnetwork_scores(self, scores) -> None:
        """Gives the scores whose top ``n_params_subnet`` entries :meth:`fit_curvature` keeps (``"subnetwork"``).

        E.g. ``bnn.use_subnetwork_scores(subnetwork.swag_variances(swag_bnn))``: the largest-variance subnetwork
        by SWAG's diagonal variances (laplace-torch's ``LargestVarianceSWAGSubnetMask``). ``None`` goes back to
        ``subnetwork_score``. Takes effect at the next :meth:`fit_curvature`.

        Args:
            scores: ``{name: tensor of the parameter's shape}`` for every Bayesian parameter, finite, or None.

        Raises:
            ValueError: without ``subset_of_weights="subnetwork"``, or on missing names, wrong shapes or
                non-finite scores.
        """
        if not isinstance(self._structure, SubnetPosterior):
            raise ValueError(f"use_subnetwork_scores needs subset_of_weights='subnetwork'; this model has "
                             f"subset_of_weights={self.subset_of_weights!r}; accepted: a subnetwork Laplace")
        if scores is None:
            self._structure.scores = None
            return
        checked = {}
        for n, t in self.theta.items():
            value = scores.get(n) if hasattr(scores, "get") else None
            if value is None or tuple(torch.as_tensor(value).shape) != tuple(t.shape):
                raise ValueError(f"use_subnetwork_scores: the score of {n!r} is missing or not of shape "
                                 f"{tuple(t.shape)}; accepted: {{name: tensor}} for every Bayesian parameter "
                                 f"({list(self.theta.keys())[:4]} ...)")
            value = torch.as_tensor(value).detach().to(t.device, torch.float64)
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"use_subnetwork_scores: the score of {n!r} has NaN or inf; accepted: finite scores")
            checked[n] = value
        self._structure.scores = checked

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
                if precision.numel() and bool(precision.amin() > 0):  # the usual case: one pass, in place
                    self.posterior_var[n] = precision.reciprocal_()
                    continue
                degenerate |= bool((precision == 0).any())
                # a parameter with neither prior nor data curvature stays at θ* (zero variance)
                self.posterior_var[n] = torch.where(precision > 0, 1.0 / precision, torch.zeros_like(precision))
        return degenerate

    def _sample_deltas(self, count: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """θ_s − θ* = sqrt(v) ε, drawn like :meth:`sample` draws (the same ε for the same generator)."""
        check_draws(self, count)
        if self._structure is not None:
            self._check_ready()
            deltas = self._structure.sample_deltas(count, generator, self._delta())
            return {n: d.to(self.theta[n].dtype) for n, d in deltas.items()}
        out = {}
        for n, std in self.posterior_std().items():
            eps = torch.randn((count, *std.shape), generator=generator, device=std.device, dtype=std.dtype)
            out[n] = std * eps
        return out


def _trainable_count(model) -> int:
    """The number of trainable parameter entries of ``model`` (tied tensors once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

