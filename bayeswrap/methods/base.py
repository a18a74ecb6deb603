"""The ``BayesianModel`` contract shared by every inference method.

The public ``loss``, ``sample``, ``sample_logits`` and ``predict`` are template methods: they validate once here
and no method overrides them (tests/test_contract.py; the ensemble's composite ``loss`` is the one exception).
A method implements ``_init_posterior``, ``_train_sample`` (the parameters of one training forward),
``regularizer`` (the KL or negative log prior, in nats), ``posterior_mean`` and ``posterior_std``; optionally
``_draw`` (posterior draws; default: the diagonal Gaussian), ``default_predictive`` (a
:mod:`~bayeswrap.methods.predictives` object; default: ``Sampled()``) and the hooks :func:`bayeswrap.fit` calls
(``before_fit``, ``after_step``, ``after_fit``). The functional forward, the posterior predictive and the
checkpoint checks live here once.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from torch import nn

from bayeswrap.core import fused
from bayeswrap.core.batches import (
    NonFiniteInputError,
    check_dict_inputs,
    check_inputs_finite,
    class_labels,
    without_key,
)
from bayeswrap.core.checks import SCALE_RANGE, check_float, check_int, check_scale  # noqa: F401 (re-exported)
from bayeswrap.core.functional import (
    NamedTensors,
    ParamSelector,
    call,
    check_finite_state,
    select_parameters,
)
from bayeswrap.core.layers import LRTLayer
from bayeswrap.core.likelihoods import make_likelihood
from bayeswrap.core.modules import check_model_tensors, materialised_copy, storage_free_copy, unwrap_compiled
from bayeswrap.core.priors import GaussianPrior
from bayeswrap.core.reductions import check_output_reduction, reduce_output
from bayeswrap.methods.param_groups import param_groups
from bayeswrap.methods.predictives import Predictive, Sampled, given_predictive, refuse_options
from bayeswrap.methods.registry import METHODS, method_option_defaults, register_method  # noqa: F401 (re-exported)

#: the options of :class:`BayesianModel` itself, which every method takes (the rest are a method's own)
COMMON_OPTIONS = ("num_data", "prior_std", "prior_mean", "bias", "params", "likelihood", "noise_std", "kl_weight",
                  "chunk_size", "output_key", "label_key", "dict_inputs", "output_reduction")


class NotFittedError(RuntimeError):
    """Raised when the posterior is used before it exists (e.g. Laplace before ``fit_curvature``)."""


class LossOutput(NamedTuple):
    """What :meth:`BayesianModel.loss` returns.

    Attributes:
        loss: scalar per-datum objective to minimise, ``nll + kl_weight * kl / num_data``.
        nll: scalar batch-mean negative log-likelihood (nats per datum), averaged
            over the ``num_train_samples`` Monte Carlo samples.
        kl: scalar KL divergence (VI) or negative log prior up to a constant
            (MAP, SGLD, Laplace, MC-dropout), in nats, before scaling.
        logits: model outputs of the last Monte Carlo sample, shape (B, K) or (B, D).
    """

    loss: torch.Tensor
    nll: torch.Tensor
    kl: torch.Tensor
    logits: torch.Tensor


class BayesianModel(nn.Module, ABC):
    """A Bayesian view of an arbitrary ``nn.Module`` (BayesDLL §1–2).

    The prior is p(θ) = N(θ̄, prior_std² I) (eq. 1) over the selected Bayesian
    parameters; every other trainable parameter is a point estimate trained
    without a prior. The wrapped model is never mutated: bayeswrap keeps its own
    copies of all tensors and evaluates the model with
    ``torch.func.functional_call`` on a storage-free (``meta``) copy of it.

    Args:
        model: any ``nn.Module``, e.g. a pretrained timm/torchvision ResNet or ViT,
            with real, finite weights (not on the ``meta`` device). A module compiled with
            ``torch.compile`` is accepted and unwrapped (:func:`~bayeswrap.core.modules.unwrap_compiled`): parameter names are the
            plain model's, without the ``_orig_mod.`` prefix.
        num_data: N, the number of training examples that scales the prior or KL
            term (BayesDLL's ``ND * Ninflate``). Integer ≥ 1 (numpy integers,
            0-d integer tensors and integral floats are accepted).
        prior_std: σ of the Gaussian prior, in [1e-18, 1e18]. ``None`` means no prior
            (only for ``"map"``: maximum likelihood).
        prior_mean: θ̄: ``"init"`` (the model's current weights), ``"zero"``, or a
            mapping ``{parameter name: tensor}`` covering the Bayesian parameters.
        bias: ``"informative"`` (biases share the weights' prior) or
            ``"uninformative"`` (p(θ_b) ∝ 1: no prior/KL term for ``*.bias``).
            MC-dropout accepts more options, see :class:`~bayeswrap.MCDropout`.
        params: which parameters are Bayesian: ``None`` (all trainable ones), ``"last_layer"``,
            ``"adapters"`` (a peft model's adapter tensors, e.g. LoRA's A and B; ``"adapters_A"``: A only,
            BLoB; :mod:`bayeswrap.core.adapters`), a list of glob patterns over parameter names, or a
            callable ``(name, tensor) -> bool``.
        likelihood: ``"categorical"`` (cross-entropy on logits), ``"gaussian"``
            (regression, eq. 2) or ``"heteroscedastic"`` (the model outputs (B, 2D): means
            and log-variances; :class:`~bayeswrap.core.likelihoods.Heteroscedastic`), or the token
            likelihoods ``"causal_lm"`` / ``"token_categorical"`` of (B, T, V) language-model logits
            (:class:`~bayeswrap.core.token_likelihoods.TokenCategorical`; ``num_data`` in target tokens).
        noise_std: output noise std of the Gaussian likelihood, in target units, or
            ``"learn"``: a point estimate of log σ (starting at σ = 1) that ``parameters()``
            exposes, trained jointly in the loss (Laplace: by the marginal likelihood in
            ``optimize_prior_precision("marglik")``); see :attr:`noise_std`.
        kl_weight: multiplies the KL/prior term (BayesDLL's ``kld``); 1 is the
            exact posterior, smaller values discount the prior (e.g. to account
            for data augmentation). 0 or a number in [1e-18, 1e18].
        chunk_size: number of posterior samples evaluated at once under ``vmap``
            by :meth:`sample_logits` (integer ≥ 1); bounds memory to ``chunk_size``
            copies of the Bayesian parameters.
        output_key: for a model that returns a mapping or a Hugging Face ``ModelOutput``,
            the key of its outputs (``"logits"``); a model that returns a tuple is read at
            its first element (:func:`bayeswrap.core.functional.model_output`).
        label_key: for loaders that yield mappings (Hugging Face batches), the key of the
            targets (``"labels"``); the other keys are the model's keyword inputs
            (:func:`bayeswrap.core.batches.batch_pair`). ``predict`` drops this key from a
            mapping input.
        dict_inputs: how dict inputs reach the model: ``"auto"`` (from its ``forward``'s signature),
            ``"kwargs"`` (``model(**inputs)``, a Hugging Face model) or ``"positional"`` (``model(inputs)``, a
            ``forward(self, batch)``); the rule: :mod:`bayeswrap.core.batches`.
        output_reduction: ``None`` (default: the outputs as the model returns them), or ``"pick_last"`` /
            ``"pick_first"``: the model's (B, T, K) outputs are read at the last (first) non-padding token of each
            sequence, by the inputs' ``"attention_mask"`` when they are a mapping that holds one, else at position
            T − 1 (0): a sequence classifier on a causal LM (laplace-torch's ``feature_reduction="pick_last"``;
            :mod:`bayeswrap.core.reductions`).

    Raises:
        ValueError: on an unknown likelihood or bias option; ``num_data`` or
            ``chunk_size`` not an integer >= 1; ``prior_std``, ``kl_weight`` (> 0)
            or ``noise_std`` outside [1e-18, 1e18] (float32 must hold σ², 1/σ²
            and log σ); ``params`` that select nothing (an empty list, or a
            pattern that matches no trainable parameter); a model whose tensors
            are on the ``meta`` device or uninitialised, or whose weights (or
            ``prior_mean`` tensors) contain NaN or inf. Every message names the
            value and lists the accepted ones.
    """

    method = "base"
    #: optimizer class a method must be trained with (SGLD and IVON own their update), or None for any
    required_optimizer: type | None = None
    #: whether a run keeps its best-validation epoch (False for samplers, whose posterior is the whole chain)
    select_best_epoch = True
    bias_options: tuple[str, ...] = ("informative", "uninformative")
    allows_no_prior = False
    #: ``(option, grid)`` that ``bayeswrap compare`` tunes by validation NLL (Ovadia et al. 2019, §4), or None;
    #: the starting grid (at most 5 trained points), log-spaced around the library default; compare extends it past
    #: a winning edge, within ``tuning_bounds``
    tuning: tuple[str, tuple[float, ...]] | None = None
    #: whether the knob in ``tuning`` (a ``kl_weight`` w) tempers the whole posterior: ``bayeswrap compare`` then
    #: trains a candidate w at prior_std = σ √w, so that w / prior_std² = 1/σ² keeps the prior's pull on the means
    #: at σ's and only the posterior's spread is tempered (:func:`bayeswrap.evaluation.tuning.tune_with_prior`,
    #: ``tempered``); False: the knob is scored at the prior std as it is
    knob_tempers_posterior: bool = False
    #: ``{option: (low, high)}``: how far ``bayeswrap compare`` may extend a tuning grid past its edge
    #: (:func:`bayeswrap.evaluation.tuning.tune`); the prior std of every method and each knob by name (p_drop < 0.5
    #: keeps half of the weights, noise_scale <= 1 keeps the temperature <= 1); an option not listed is bounded only
    #: by the number of extensions. A method with a new knob adds it: ``{**BayesianModel.tuning_bounds, ...}``
    tuning_bounds: dict[str, tuple[float, float]] = {
        "prior_std": (1e-3, 1e3), "kl_weight": (1e-5, 10.0), "p_drop": (0.01, 0.5), "noise_scale": (0.01, 1.0),
        "prior_precision": (1e-6, 1e8)}
    #: run settings the command line uses for this method unless the config sets them (e.g. the step size of
    #: a method that owns its update); method options are never listed here: their defaults are the constructor's
    recommended: dict = {}
    #: whether ``bayeswrap compare`` runs this method when ``--methods`` is not given
    in_default_comparison = False
    #: state-dict prefixes the training loss never reads (stored draws, running moments), which an ensemble
    #: leaves out when it evaluates its members under ``vmap``
    loss_free_state: tuple[str, ...] = ()
    #: further operating points of one fitted posterior, which ``bayeswrap compare`` scores as rows of their own,
    #: "<method> (<name>)" (Laplace: "marglik"); :meth:`use_operating_point` moves the model to one
    operating_points: tuple[str, ...] = ()
    #: whether ``noise_std="learn"`` is accepted (not by ensembles, whose members would each need their own σ, nor by
    #: full-batch samplers, which do not train point estimates)
    supports_learned_noise = True
    #: run settings (fields of the command line's run config) that only this method reads, e.g. a sampler's
    #: burn-in in epochs; a ``per_method`` entry may set them for this method only
    run_fields: tuple[str, ...] = ()
    #: whether :meth:`after_fit` iterates the training loader again (Laplace's curvature, SWAG's BatchNorm
    #: updates), so that :func:`bayeswrap.fit` refuses a one-shot iterator (a generator) as ``train_loader``
    reads_train_loader_after_fit = False

    @classmethod
    def run_options(cls, run) -> dict:
        """What a training run implies for this method: constructor arguments, over those the run gives.

        The application calls it before it builds the model, ``wrap(model, method, **{**run.options,
        **cls.run_options(run)})``, and when it checks a config (then ``run.steps_per_epoch`` is None: no data are
        read yet), so that it names no method. A method leaves the arguments the run gives alone unless it
        translates them. The base class implies nothing.

        Args:
            run: the run, a :class:`~bayeswrap.methods.run_info.RunInfo` (epochs, steps per epoch, the
                arguments given, pretrained weights and head, schedule).

        Returns:
            ``{argument: value}``, constructor arguments of this class.

        Raises:
            ValueError: naming the values and the accepted ones, for a run this method cannot train with.
        """
        return {}

    def __init__(self, model: nn.Module, *, num_data: int, prior_std: float | None = 1.0, prior_mean="init",
                 bias: str = "informative", params: ParamSelector = None, likelihood: str = "categorical",
                 noise_std: float | str = 1.0, kl_weight: float = 1.0, chunk_size: int = 8, output_key: str = "logits",
                 label_key: str = "labels", dict_inputs: str = "auto", output_reduction: str | None = None):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        model = unwrap_compiled(model)
        self.num_data = check_int("num_data", num_data, minimum=1, note="the training-set size N")
        if bias not in self.bias_options:
            raise ValueError(f"bias={bias!r} is not accepted by method {self.method!r}; "
                             f"accepted: {self.bias_options}")
        if prior_std is None and not self.allows_no_prior:
            raise ValueError("prior_std=None (no prior) is only accepted by method 'map'; accepted: a finite "
                             f"number in [{SCALE_RANGE[0]:g}, {SCALE_RANGE[1]:g}]")
        self.prior_std = None if prior_std is None else check_scale("prior_std", prior_std)
        self.kl_weight = check_scale("kl_weight", kl_weight, allow_zero=True)
        self.chunk_size = check_int("chunk_size", chunk_size, minimum=1, note="posterior samples per vmap chunk")
        self.bias = bias
        self.output_key = _check_key("output_key", output_key)
        self.label_key = _check_key("label_key", label_key)
        self.dict_inputs = check_dict_inputs(dict_inputs)
        self.output_reduction = check_output_reduction(output_reduction)
        self.likelihood = make_likelihood(likelihood, noise_std)
        if getattr(self.likelihood, "learned", False) and not self.supports_learned_noise:
            raise ValueError(f"noise_std='learn' is not accepted by method {self.method!r}; accepted: a fixed number "
                             "in [1e-18, 1e18] (or a method trained by bayeswrap.fit with one set of weights, e.g. "
                             "'map', 'vi' or 'laplace')")
        check_model_tensors(model)
        dtypes = [t.dtype for t in model.parameters() if t.is_floating_point()]
        self.likelihood.to(dtypes[0] if dtypes else torch.get_default_dtype())  # a learned log σ in the model's dtype

        self.bayesian_names = select_parameters(model, params)
        named = dict(model.named_parameters())
        trainable = {n for n, p in named.items() if p.requires_grad}
        chosen = set(self.bayesian_names)
        # the Bayesian tensors are copied here (the initial posterior), point estimates and buffers by NamedTensors
        # below; the frozen ones (requires_grad=False: a peft model's base) are referenced, never copied, cast or
        # written to (core.functional.NamedTensors(referenced=True))
        all_params = {n: p.detach().clone() if n in chosen else p.detach() for n, p in named.items()}
        buffers = {n: b.detach() for n, b in model.named_buffers()}
        # the posterior state is fp32 for half-precision Bayesian parameters (a bf16 model's adapters); each value
        # is cast back to the parameter's dtype where the model is called (at_call), so the base is never cast
        self._call_dtypes = {n: all_params[n].dtype for n in self.bayesian_names
                             if all_params[n].dtype in (torch.float16, torch.bfloat16)}
        init = {n: all_params[n].float() if n in self._call_dtypes else all_params[n] for n in self.bayesian_names}
        self.point = NamedTensors({n: t for n, t in all_params.items() if n in trainable and n not in chosen},
                                  trainable=True)
        self.frozen = NamedTensors({n: t for n, t in all_params.items() if n not in trainable}, trainable=False,
                                   referenced=True)
        self.model_buffers = NamedTensors(buffers, trainable=False)
        self.prior = GaussianPrior(init, self.prior_std, prior_mean, bias=self._prior_bias(bias))
        self._skeleton = [storage_free_copy(model)]
        self._lrt: list[LRTLayer] = []  # set by methods with local reparameterisation (methods.lrt)
        self._vmap_ok = True
        self._init_posterior(init)

    # ------------------------------------------------------------------ method hooks
    def _prior_bias(self, bias: str) -> str:
        """Maps the method's bias option onto the prior's ("informative"/"uninformative")."""
        return bias

    @abstractmethod
    def _init_posterior(self, init: dict[str, torch.Tensor]) -> None:
        """Creates the posterior's parameters from the model's current values ``init``."""

    @abstractmethod
    def _train_sample(self) -> dict[str, torch.Tensor]:
        """One differentiable value of the Bayesian parameters for a training forward."""

    @abstractmethod
    def regularizer(self) -> torch.Tensor:
        """KL(q || p) or −log p(θ) up to a constant, in nats (a scalar tensor)."""

    @abstractmethod
    def posterior_mean(self) -> dict[str, torch.Tensor]:
        """E_q[θ] as ``{name: tensor of the parameter's shape}``."""

    @abstractmethod
    def posterior_std(self) -> dict[str, torch.Tensor]:
        """Marginal standard deviations of q, ``{name: tensor of the parameter's shape}``."""

    def use_operating_point(self, name: str) -> dict:
        """Moves the fitted posterior to one of :attr:`operating_points`, without retraining.

        Args:
            name: an entry of :attr:`operating_points`.

        Returns:
            ``{option: value}``: what the operating point set (e.g. ``{"prior_precision": 0.4}``).

        Raises:
            ValueError: for a name that is not one of this method's operating points.
        """
        raise ValueError(f"operating point {name!r} is not known to {type(self).__name__}; accepted: "
                         f"{self.operating_points}")

    def not_trained_by_fit(self) -> str | None:
        """Why :func:`bayeswrap.fit` cannot train this model (full-batch samplers), or None."""
        return None

    def _deterministic_mean(self) -> dict[str, torch.Tensor]:
        """The Bayesian parameters :meth:`to_deterministic` deploys (the posterior mean; LBBNN: the MPM's)."""
        return self.posterior_mean()

    def _deterministic_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers :meth:`to_deterministic` deploys (the model's; SWAG: BatchNorm statistics of θ_SWA)."""
        return self.model_buffers.as_dict()

    def _point_estimate(self) -> dict[str, torch.Tensor]:
        """The centre of the current training state (used for validation while training)."""
        return self.posterior_mean()

    def _mean_outputs(self, x) -> torch.Tensor:
        """Outputs at the posterior mean, (1, B, ·): ``predict(x, num_samples=0)`` before averaging.

        Methods whose mean needs more than a forward (SWAG's BatchNorm update) or
        that have several (an ensemble: one per member, (M, B, ·)) override this.
        """
        return self.forward_with(self.posterior_mean(), x).unsqueeze(0)

    def _point_predictive(self, x):
        """The predictive of the current training state's centre (validation before the posterior exists)."""
        return self._predictive(self.forward_with(self._point_estimate(), x).unsqueeze(0))

    def is_ready(self) -> bool:
        """Whether the posterior exists (False for Laplace before ``fit_curvature``, SGLD before samples)."""
        return True

    def _sample_and_regularizer(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """A training sample and the regulariser; methods may fuse the two (VI does)."""
        return self._train_sample(), self.regularizer()

    def before_fit(self, num_steps: int | None, optimizer: torch.optim.Optimizer | None = None,
                   steps_per_epoch: int | None = None) -> None:
        """Called by :func:`bayeswrap.fit` before the first step.

        Args:
            num_steps: optimizer steps the fit will run (epochs × batches per
                epoch, counting from ``start_epoch``), or ``None`` when the loader
                has no length. SGLD uses it for ``burn_in="auto"``.
            optimizer: the optimizer the fit steps (a method that drives its
                own step-size schedule, e.g. cyclical SGLD, sets it per step).
            steps_per_epoch: batches per epoch (``len(train_loader)``), or ``None``
                when the loader has no length (SWAG collects once per epoch).
        """

    def after_step(self) -> None:
        """Called by :func:`bayeswrap.fit` after every optimizer step."""

    def after_fit(self, train_loader) -> None:
        """Called by :func:`bayeswrap.fit` once training has finished."""

    # ------------------------------------------------------------------ shared machinery
    @property
    def model(self) -> nn.Module:
        """The storage-free copy of the wrapped module's structure used as a function."""
        return self._skeleton[0]

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.train(mode)  # the structure's mode decides BatchNorm/dropout behaviour
        if self._lrt:
            self._skeleton[1].train(mode)
        return self

    # ------------------------------------------------------------------ layer-level methods
    @property
    def lrt_layers(self) -> list[LRTLayer]:
        """The layers whose pre-activations are sampled (empty without local reparameterisation,
        :meth:`~bayeswrap.methods.lrt.LocalReparamMixin.enable_local_reparam`).
        """
        return list(self._lrt)

    @property
    def noise_std(self) -> float | None:
        """The Gaussian likelihood's noise std σ now (float; the learned value for ``noise_std="learn"``), or
        ``None`` for the categorical and heteroscedastic likelihoods. Settable (a number in [1e-18, 1e18]),
        e.g. to start a learned σ elsewhere than 1.
        """
        return getattr(self.likelihood, "noise_std", None)

    @noise_std.setter
    def noise_std(self, value: float) -> None:
        if not hasattr(self.likelihood, "noise_std"):
            raise ValueError(f"noise_std cannot be set for likelihood={self.likelihood.name!r}; accepted: "
                             "likelihood='gaussian'")
        self.likelihood.noise_std = value

    def param_groups(self, head: Iterable[str] = (), lr_head: float | None = None) -> list[dict]:
        """Optimizer parameter groups: posterior parameters, then point estimates, then a learned noise std.

        See :func:`bayeswrap.methods.param_groups.param_groups` (the groups' names and settings, and the errors).
        """
        return param_groups(self, head, lr_head)

    def _call_tensors(self, theta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every parameter tensor of a call of the model: point estimates, frozen ones and ``theta``, the latter in
        the dtypes of the model's own parameters.

        The posterior state of a half-precision (bf16/fp16) Bayesian parameter is kept in fp32 (means, stds,
        curvature, stored draws); its values, and its variance ``name + "_var"`` under local reparameterisation,
        are cast (differentiably) to the parameter's dtype here. Other values pass unchanged.

        Args:
            theta: ``{name: tensor}`` of Bayesian parameters.

        Returns:
            ``{name: tensor}`` for ``torch.func.functional_call``.
        """
        dtypes = self._call_dtypes
        if not dtypes:  # every Bayesian parameter in fp32 or wider: theta as it is
            return {**self.point.as_dict(), **self.frozen.as_dict(), **theta}
        tensors = {**self.point.as_dict(), **self.frozen.as_dict()}
        for n, t in theta.items():
            dtype = dtypes.get(n[:-4] if n.endswith("_var") and n not in dtypes else n)
            tensors[n] = t if dtype is None else t.to(dtype)
        return tensors

    def forward_with(self, theta: Mapping[str, torch.Tensor], x) -> torch.Tensor:
        """Evaluates the model with Bayesian parameters ``theta`` (point estimates as they are).

        Args:
            theta: ``{name: tensor}`` for every Bayesian parameter. Under local
                reparameterisation it may instead hold, for each layer of
                :attr:`lrt_layers`, the mean of its weight (and bias) under the
                parameter's name and the variance under ``name + "_var"``: those
                layers then sample their pre-activations (:mod:`bayeswrap.core.layers`).
            x: model input, e.g. images of shape (B, C, H, W).

        Returns:
            Model outputs, e.g. logits of shape (B, K).
        """
        tensors = self._call_tensors(theta)
        net = self.model
        if self._lrt and any(n in self._lrt_var_names for n in theta):  # moments: sample pre-activations
            net = self._skeleton[1]
        out = call(net, tensors, self.model_buffers.as_dict(), without_key(x, self.label_key), self.output_key,
                   self.dict_inputs)
        return reduce_output(out, x, self.output_reduction)

    def forward(self, x, num_samples: int = 0) -> torch.Tensor:
        """Posterior predictive, see :meth:`predict`."""
        return self.predict(x, num_samples=num_samples)

    def loss(self, x, y) -> LossOutput:
        """The per-datum training objective on a batch (negative ELBO, eq. 6 / eq. 10 / MAP).

        loss = (1/S) Σ_s NLL(y | x, θ_s) + kl_weight · KL / num_data, where θ_s come from
        ``_train_sample()`` and S is ``num_train_samples`` (1 for point methods).

        Args:
            x: inputs, e.g. (B, C, H, W) float; or a tuple of tensors (the model is called as
                ``model(x1, x2)``), or a dict of named tensors.
            y: targets: (B,) class labels in [0, K) of any integer dtype (int32, int16,
                uint8, ... are cast to int64) or (B, D) float regression targets.

        Returns:
            A :class:`LossOutput` (``loss``, ``nll``, ``kl``, ``logits``).

        Raises:
            NonFiniteInputError: a ValueError, if the loss is NaN or infinite and a
                floating input, or a regression target, holds NaN or inf (naming it,
                its shape and the count). The check reads the loss once (the device sync
                that reading the loss costs anyway) and looks at the data only when the
                loss is not finite; a non-finite loss from finite data is returned as it is, for
                :func:`bayeswrap.fit` to say whether the parameters or the initial
                state caused it.
            ValueError: if class labels are out of range, targets mis-shaped, or a
                categorical model's outputs are not logits of shape (B, K), K >= 2.
            TypeError: if the model does not return a tensor.
        """
        if self.likelihood.name == "categorical":
            y = class_labels(y)
        outs, kl = self._train_outputs(x)
        self.likelihood.check_targets(outs[0], y)
        return self._checked_loss(self._loss_output(outs, kl, y), x, y)

    @staticmethod
    def _checked_loss(out: LossOutput, x, y=None) -> LossOutput:
        """``out``, or a :class:`NonFiniteInputError` naming the inputs or the targets when the loss is not finite
        because of them.
        """
        if not math.isfinite(out.loss.item()):  # one scalar read; the data are looked at only after a bad loss
            try:
                check_inputs_finite(x)
            except NonFiniteInputError as err:
                raise NonFiniteInputError(f"loss: {err}", output=out) from None
            if isinstance(y, torch.Tensor) and y.is_floating_point() and not bool(torch.isfinite(y).all()):
                count = int((~torch.isfinite(y)).sum())
                raise NonFiniteInputError(f"loss: the targets (shape {tuple(y.shape)}) contain {count} non-finite "
                                          "values (NaN or inf); accepted: finite regression targets", output=out)
        return out

    def _unchecked_loss(self, x, y) -> LossOutput:
        """:meth:`loss` without its data checks, for targets already checked or cast (class labels as int64).

        Pure in its tensors (no host sync, no data-dependent branch), so that ``torch.compile`` captures it in one
        graph (:mod:`bayeswrap.compiled`, ``bw.fit(..., compile=True)``); the caller checks the targets.
        """
        outs, kl = self._train_outputs(x)
        return self._loss_output(outs, kl, y)

    def _train_outputs(self, x) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The training forward passes of :meth:`loss`: ``num_train_samples`` outputs and the regulariser.

        Pure in its tensors (no data-dependent checks), so an ensemble can run it under ``vmap``.
        """
        num = getattr(self, "num_train_samples", 1)
        theta, kl = self._sample_and_regularizer()
        outs = [self.forward_with(theta, x)]
        outs += [self.forward_with(self._train_sample(), x) for _ in range(num - 1)]
        return outs, kl

    def _loss_output(self, outs: list[torch.Tensor], kl: torch.Tensor, y) -> LossOutput:
        """:meth:`loss` from the training outputs and the regulariser (targets already checked)."""
        nll = sum(self.likelihood.nll(out, y) for out in outs) / len(outs)
        return LossOutput(nll + (self.kl_weight / self.num_data) * kl, nll, kl, outs[-1])

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Draws θ_s ~ q(θ), s = 1..S, for the Bayesian parameters (the method's :meth:`_draw`).

        Args:
            num_samples: S ≥ 1 (an integer; numpy integers and integral floats are accepted).
            generator: optional ``torch.Generator`` for reproducible draws.

        Returns:
            ``{name: tensor of shape (S, *param_shape)}`` (under local reparameterisation, the LRT layers'
            pre-activation moments instead of their weights, see :meth:`forward_with`).

        Raises:
            ValueError: if ``num_samples`` is not an integer >= 1.
            NotFittedError: if the posterior does not exist yet.
        """
        num_samples = check_int("num_samples", num_samples, minimum=1)
        self._check_ready()
        return self._draw(num_samples, generator)

    def _draw(self, num_samples: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """S draws on checked arguments, ``{name: (S, *shape)}``; the default is N(posterior_mean, posterior_std²).

        Methods whose posterior is not a diagonal Gaussian (or that sample pre-activation moments) override this.
        """
        mean, std = self.posterior_mean(), self.posterior_std()
        ref = next(iter(mean.values()))
        if ref.device.type == "cpu" and num_samples * sum(m.numel() for m in mean.values()) >= fused.RNG_PARALLEL_MIN:
            # large models on the CPU: parallel noise streams (bayeswrap.core.fused.random_buckets), θ written in place
            eps = fused.standard_normal_like([m.expand(num_samples, *m.shape) for m in mean.values()], generator)
            if torch.is_grad_enabled():  # differentiable draws (e.g. a training sample): out of place
                return {n: m + std[n] * e for (n, m), e in zip(mean.items(), eps)}
            return {n: e.mul_(std[n]).add_(m) for (n, m), e in zip(mean.items(), eps)}
        out = {}
        for n, m in mean.items():
            eps = torch.randn((num_samples, *m.shape), generator=generator, device=m.device, dtype=m.dtype)
            out[n] = m + std[n] * eps
        return out

    def default_predictive(self, model: str = "full", **options) -> Predictive:
        """The predictive :meth:`predict` and :meth:`sample_logits` use when none is given: :class:`Sampled`.

        The old keyword arguments of ``predict`` map to predictives here (``model="mpm"`` of a method with
        inclusion variables: :class:`MedianModel`); methods with other options (Laplace's ``pred_type``,
        ``link_approx``) override this. Nothing on the model changes.

        Args:
            model: ``"full"`` (full Bayesian model averaging); methods with inclusion variables also accept
                ``"mpm"``.
            **options: a method's own predictive options (none here).

        Raises:
            ValueError: on a ``model`` the method does not accept.
            TypeError: on an option the method does not take, naming it and the accepted ones.
        """
        refuse_options(self, options, ("model",))
        if model != "full":
            raise ValueError(f"model={model!r} is not accepted by method {self.method!r}; accepted: 'full' (the "
                             "median probability model needs inclusion variables: method 'lbbnn')")
        return Sampled()

    def sample_logits(self, x, num_samples: int, generator: torch.Generator | None = None, model: str = "full", *,
                      predictive: Predictive | None = None, **options) -> torch.Tensor:
        """Model outputs under S posterior samples.

        With the default :class:`Sampled` predictive, samples are drawn and evaluated ``chunk_size``
        at a time; within a chunk the forward passes run as one ``torch.func.vmap`` over samples (in
        train mode with BatchNorm, whose in-place statistics updates cannot be vmapped, they run one
        after another).

        Args:
            x: model input with batch size B (a tensor, or a tuple of positional inputs).
            num_samples: S ≥ 1 (an integer; numpy integers and integral floats are accepted).
            generator: optional ``torch.Generator``.
            model: ``"full"``, or ``"mpm"`` for methods with inclusion variables (see :meth:`predict`).
            predictive: a :class:`~bayeswrap.methods.predictives.Predictive` to use instead of
                :meth:`default_predictive`'s.
            **options: a method's own predictive options (Laplace: ``pred_type``), see :meth:`default_predictive`.

        Returns:
            Tensor of shape (S, B, K) (or (S, B, D) for regression).

        Raises:
            NotFittedError: if the posterior does not exist yet.
            ValueError: if ``num_samples`` is not an integer >= 1, a floating input contains NaN or inf,
                or ``predictive`` is given together with ``model``/options.
            TypeError: on an option the method does not take, or a ``predictive`` that is not a Predictive.
        """
        num_samples, chosen = _checked_call(self, x, num_samples, 1, predictive, model, options)
        return chosen.outputs(self, x, num_samples, generator)

    @torch.no_grad()
    def predict(self, x, num_samples: int = 5, generator: torch.Generator | None = None, model: str = "full", *,
                predictive: Predictive | None = None, **options):
        """Posterior predictive p(y|x, D) ≈ (1/S) Σ_s p(y|x, θ_s) (BayesDLL eqs. 5 and 9).

        Args:
            x: model input with batch size B (a tensor, or a tuple of positional inputs).
            num_samples: S. ``0`` uses the posterior mean instead of samples
                (BayesDLL's ``nst=0``).
            generator: optional ``torch.Generator`` for reproducible samples.
            model: ``"full"`` (full Bayesian model averaging) or, for methods with
                inclusion variables (``"lbbnn"``), ``"mpm"``: the median probability
                model, the weights with inclusion probability > 0.5 (Barbieri &
                Berger 2004).
            predictive: a :class:`~bayeswrap.methods.predictives.Predictive` (``Sampled()``,
                ``PosteriorMean()``, ...) to use instead of :meth:`default_predictive`'s.
            **options: a method's own predictive options (Laplace: ``pred_type``, ``link_approx``),
                see :meth:`default_predictive`.

        Returns:
            Categorical likelihood: probabilities of shape (B, K) (float32, or float64 for a float64 model),
            averaged in probability space (rows sum to 1).
            Gaussian likelihood: ``(mean, variance)``, each (B, D), where the
            variance is noise_std² plus the variance of the sampled means.
            Heteroscedastic: ``(mean, variance)`` of the mixture of the sampled Gaussians, each
            (B, D): the variance is the mean of the predicted variances plus the variance of
            the sampled means.

        Raises:
            NotFittedError: if the posterior does not exist yet (Laplace before
                ``fit_curvature``, SGLD before any sample was kept).
            ValueError: if ``num_samples`` is not an integer >= 0, a floating input
                contains NaN or inf (one ``torch.isfinite(x).all()`` per call), a
                categorical model's outputs are not logits of shape (B, K), K >= 2, or
                ``predictive`` is given together with ``model``/options.
            TypeError: if the model does not return a tensor, on an option the method does not take,
                or a ``predictive`` that is not a Predictive.
        """
        num_samples, chosen = _checked_call(self, x, num_samples, 0, predictive, model, options)
        return chosen.predict(self, x, num_samples, generator)

    def _predictive(self, outs: torch.Tensor):
        """Averages (S, B, ·) outputs into the predictive of the likelihood (after checking their shape)."""
        self.likelihood.check_outputs(outs[0] if isinstance(outs, torch.Tensor) and outs.dim() else outs)
        return self.likelihood.predictive(outs)

    def _check_ready(self) -> None:
        if not self.is_ready():
            raise NotFittedError(self._not_ready_message())

    def _not_ready_message(self) -> str:
        return f"the {self.method!r} posterior is not available yet"

    def to_deterministic(self) -> nn.Module:
        """The posterior mean as a plain ``nn.Module``, for deployment without bayeswrap.

        A new deep copy of the wrapped model's structure (its class, with real storage on
        this model's device, in eval mode) holding the Bayesian parameters at the posterior
        mean that ``predict(x, num_samples=0)`` evaluates, the point estimates and frozen
        parameters as they are and the current buffers; tied parameters stay tied.
        ``net(x)`` equals the outputs of ``predict(x, num_samples=0)`` before the softmax
        (the model's own output type). It shares no tensor with this model, and the
        wrapped model itself is not touched. The mean, per method:

        * MAP, Laplace: θ (θ_MAP); VI, IVON: the mean m; sparse and Kingma VD: the mean
          with pruned weights exactly 0; SGLD, MH, HMC: the mean of the kept draws;
        * MC-dropout: ``mode="params"``: the mixture mean (1 − p) m + p θ̄ (the
          weight-scaling rule of dropout); ``mode="layers"``: the weights, dropout off;
        * SWAG: θ_SWA, with BatchNorm statistics recomputed for it (Maddox et al. 2019, §4);
        * LBBNN: the median probability model's weights (``LBBNN.mpm_mean``, as
          ``predict(x, 0, model="mpm")``).

        An ensemble has no single mean network and refuses: deploy a member with
        ``bnn.members[m].to_deterministic()``.

        Returns:
            An ``nn.Module`` of the wrapped model's class, in eval mode.

        Raises:
            NotFittedError: if the posterior does not exist yet (Laplace before ``fit_curvature``,
                SGLD, SWAG, MH and HMC before a draw is kept).
            ValueError: for an ensemble, or a model that could not be deep-copied when it was wrapped.
        """
        self._check_ready()
        values = self._call_tensors(self._deterministic_mean())
        skeleton = self.model
        if not any(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()]):
            raise ValueError("the wrapped model could not be deep-copied when it was wrapped, so bayeswrap has no "
                             "separate structure to fill; build the module yourself and load "
                             "bnn.posterior_mean() into it")
        with torch.no_grad():
            return materialised_copy(skeleton, values, self._deterministic_buffers()).eval()

    # ------------------------------------------------------------------ checkpoints
    #: state_dict keys whose values may legitimately be NaN or inf (e.g. Laplace's unknown log-likelihood)
    _nonfinite_state_keys: tuple[str, ...] = ()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, after checking that the checkpoint holds no NaN or inf.

        Every floating tensor is checked once (the wrapped model's buffers for
        NaN only: ``-inf`` is a legitimate attention mask).

        Raises:
            ValueError: naming the first key whose tensor holds NaN or inf; or a
                checkpoint of another method or other Bayesian parameters.
            RuntimeError: as ``nn.Module.load_state_dict`` for missing/unexpected keys or shapes.
        """
        check_finite_state(state_dict, skip=self._nonfinite_state_keys, nan_only=lambda k: k.startswith("model_buffers."))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def get_extra_state(self):
        return {"method": self.method, "bayesian_names": list(self.bayesian_names)}

    def set_extra_state(self, state):
        if state.get("method") != self.method:
            raise ValueError(f"checkpoint is for method {state.get('method')!r}, "
                             f"but this model uses method {self.method!r}")
        if list(state.get("bayesian_names", [])) != list(self.bayesian_names):
            theirs, ours = set(state.get("bayesian_names", [])), set(self.bayesian_names)
            raise ValueError("checkpoint's Bayesian parameters do not match this model's: "
                             f"only in checkpoint {sorted(theirs - ours)[:8]}, "
                             f"only in model {sorted(ours - theirs)[:8]}")


def _checked_call(bnn: BayesianModel, x, num_samples, minimum: int, predictive, model: str,
                  options: dict) -> tuple[int, Predictive]:
    """The checks of :meth:`BayesianModel.predict` and :meth:`~BayesianModel.sample_logits`, once per call.

    S as an int (at least ``minimum``), then the predictive (``predictive``, or the method's default for the
    legacy ``model``/options, never both), then that the posterior exists and that ``x`` is finite.
    """
    num_samples = check_int("num_samples", num_samples, minimum=minimum)
    chosen = bnn.default_predictive(model=model, **options) if predictive is None else \
        given_predictive(predictive, model, options)
    bnn._check_ready()
    check_inputs_finite(x)
    return num_samples, chosen


def _check_key(name: str, value) -> str:
    """A non-empty string key (``output_key``/``label_key``), or a ValueError naming the value."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}={value!r} is not accepted; accepted: a non-empty string key such as "
                         f"{'logits' if name == 'output_key' else 'labels'!r}")
    return value
