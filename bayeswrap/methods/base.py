"""The ``BayesianModel`` contract shared by every inference method.

A method differs from the others in only a few places, each a method here:

* ``_train_sample()``: the parameter value used for one training forward pass
  (a reparameterised draw for VI, a dropout mask for MC-dropout, the iterate for
  MAP/SGLD/Laplace);
* ``regularizer()``: the KL or negative-log-prior term, in nats;
* ``posterior_mean()`` / ``posterior_std()`` / ``sample()``: the approximate
  posterior used by the posterior predictive;
* ``after_step()`` / ``after_fit()``: hooks that :func:`bayeswrap.fit` calls
  (SGLD collects moments, Laplace fits its curvature).

Everything else (the functional forward, the loss, the posterior predictive,
``state_dict``) lives here once.
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from torch import nn
from torch.func import vmap

from bayeswrap.core import fused
from bayeswrap.core.batches import NonFiniteInputError, check_inputs_finite, class_labels, without_key, x_device
from bayeswrap.core.checks import SCALE_RANGE, check_float, check_int, check_scale
from bayeswrap.core.functional import (
    NamedTensors,
    ParamSelector,
    call,
    nonfinite_names,
    select_parameters,
    split_state,
)
from bayeswrap.core.layers import LRTLayer, find_lrt_layers, lrt_copy
from bayeswrap.core.likelihoods import make_likelihood
from bayeswrap.core.priors import GaussianPrior

METHODS: dict[str, type[BayesianModel]] = {}


def register_method(name: str):
    """Class decorator adding a method class to the registry under ``name``."""

    def deco(cls):
        cls.method = name
        METHODS[name] = cls
        return cls

    return deco


#: the options of :class:`BayesianModel` itself, which every method takes (the rest are a method's own)
COMMON_OPTIONS = ("num_data", "prior_std", "prior_mean", "bias", "params", "likelihood", "noise_std", "kl_weight",
                  "chunk_size", "output_key", "label_key")


def method_option_defaults(method: str) -> dict:
    """``{option: library default}`` of a registered method's own keyword options (its constructors' along the MRO).

    Raises:
        KeyError: for an unregistered method.
    """
    defaults: dict = {}
    for klass in METHODS[method].__mro__:
        if klass is BayesianModel or "__init__" not in vars(klass):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in COMMON_OPTIONS and p.name not in defaults:
                defaults[p.name] = p.default
    return defaults


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
            ``torch.compile`` is accepted and unwrapped (:func:`unwrap_compiled`): parameter names are the
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
        params: which parameters are Bayesian: ``None`` (all trainable ones), a
            list of glob patterns over parameter names, or a callable
            ``(name, tensor) -> bool``.
        likelihood: ``"categorical"`` (cross-entropy on logits), ``"gaussian"``
            (regression, eq. 2) or ``"heteroscedastic"`` (the model outputs (B, 2D): means
            and log-variances; :class:`~bayeswrap.core.likelihoods.Heteroscedastic`).
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
                 label_key: str = "labels"):
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
        self.likelihood = make_likelihood(likelihood, noise_std)
        if getattr(self.likelihood, "learned", False) and not self.supports_learned_noise:
            raise ValueError(f"noise_std='learn' is not accepted by method {self.method!r}; accepted: a fixed number "
                             "in [1e-18, 1e18] (or a method trained by bayeswrap.fit with one set of weights, e.g. "
                             "'map', 'vi' or 'laplace')")
        _check_model_tensors(model)
        dtypes = [t.dtype for t in model.parameters() if t.is_floating_point()]
        self.likelihood.to(dtypes[0] if dtypes else torch.get_default_dtype())  # a learned log σ in the model's dtype

        self.bayesian_names = select_parameters(model, params)
        all_params, buffers = split_state(model)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        init = {n: all_params[n] for n in self.bayesian_names}
        chosen = set(self.bayesian_names)
        self.point = NamedTensors({n: t for n, t in all_params.items() if n in trainable and n not in chosen},
                                  trainable=True)
        self.frozen = NamedTensors({n: t for n, t in all_params.items() if n not in trainable}, trainable=False)
        self.model_buffers = NamedTensors(buffers, trainable=False)
        self.prior = GaussianPrior(init, self.prior_std, prior_mean, bias=self._prior_bias(bias))
        self._skeleton = [_storage_free_copy(model)]
        self._lrt: list[LRTLayer] = []  # set by methods with local reparameterisation (enable_local_reparam)
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
    #: whether the posterior has inclusion variables (LBBNN), which ``model="mpm"`` predictions need
    has_inclusion = False

    def enable_local_reparam(self) -> list[LRTLayer]:
        """Switches supported layers to pre-activation sampling (see :mod:`bayeswrap.core.layers`).

        Builds a second storage-free copy of the model in which each ``nn.Linear`` /
        ``nn.Conv2d`` whose weight is Bayesian samples its pre-activations from
        moments that the method passes as ``theta[name]`` (mean) and
        ``theta[name + "_var"]`` (variance); see :meth:`forward_with`.

        Returns:
            The layers that got a local-reparameterisation forward.

        Raises:
            ValueError: if no Bayesian parameter is the weight of an ``nn.Linear`` or
                ``nn.Conv2d`` (every other layer type falls back to weight sampling).
        """
        layers = find_lrt_layers(self.model, self.bayesian_names)
        if not layers:
            raise ValueError(f"local_reparam=True needs an nn.Linear or nn.Conv2d (padding_mode='zeros') whose "
                             f"weight is Bayesian; the Bayesian parameters {self.bayesian_names[:6]} include none. "
                             f"Accepted: local_reparam=False, or params= selecting such a layer's weight")
        self._lrt = layers
        self._skeleton = [self._skeleton[0], lrt_copy(self._skeleton[0], layers)]
        self._lrt_var_names = {n for layer in layers for n in (layer.weight_var, layer.bias_var) if n}
        return layers

    @property
    def lrt_layers(self) -> list[LRTLayer]:
        """The layers whose pre-activations are sampled (empty without local reparameterisation)."""
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

    def _check_predictive_model(self, model: str) -> str:
        accepted = ("full", "mpm") if self.has_inclusion else ("full",)
        if model not in accepted:
            hint = "" if self.has_inclusion else " (the median probability model needs inclusion variables: " \
                                                 "method 'lbbnn')"
            raise ValueError(f"model={model!r} is not accepted by method {self.method!r}; accepted: "
                             f"{', '.join(map(repr, accepted))}{hint}")
        return model

    def param_groups(self, head: Iterable[str] = (), lr_head: float | None = None) -> list[dict]:
        """Optimizer parameter groups: posterior parameters, then point estimates, then a learned noise std.

        Each group is split further into the model's body and the parameters
        whose model names are in ``head`` (e.g. a new classifier, which often
        wants a larger learning rate, as in BayesDLL's ``lr_head``). Point-estimate
        groups carry ``noise_scale=0.0`` so that :class:`bayeswrap.optim.SGLD`
        adds no Langevin noise to non-Bayesian parameters; other optimizers
        ignore the extra key. Posterior groups carry ``weight_decay=0.0``: their
        prior is already in the loss (the KL or −log prior term), so an
        optimizer's own weight decay (AdamW's default 0.01) would count it twice.
        A learned noise std (``noise_std="learn"``) is its own group ``"likelihood"``, with
        ``weight_decay=0.0`` (no prior on it) and ``noise_scale=0.0`` (a point estimate).
        Empty groups are omitted.

        Args:
            head: model parameter names (as in ``model.named_parameters()``); a single
                string is one name.
            lr_head: learning rate of the head groups (set as the group's ``lr``),
                ``None`` or a finite number > 0.

        Returns:
            ``[{"params": [...], "name": "posterior" | "posterior/head" | "point" | "point/head" | "likelihood",
            ...}]``.

        Raises:
            ValueError: if a ``head`` name is not a parameter of the wrapped model (it
                would silently get the body's learning rate), or ``lr_head`` is not
                ``None`` or a finite number > 0.
        """
        head = {head} if isinstance(head, str) else set(head)
        unknown = sorted(head - {n for n, _ in self.model.named_parameters(remove_duplicate=False)}, key=str)
        if unknown:
            raise ValueError(f"head names {unknown[:8]} are not parameters of the wrapped model; accepted: names "
                             f"from model.named_parameters(), e.g. {[*self.bayesian_names, *self.point][-4:]}")
        lr_head = check_float("lr_head", lr_head, low=0.0, low_open=True, allow_none=True)
        groups: dict[str, dict] = {}
        for full_name, p in self.named_parameters():
            container, mangled = full_name.split(".", 1)
            if container == "likelihood":  # a learned noise std: a point estimate without prior
                groups.setdefault("likelihood", {"params": [], "name": "likelihood", "noise_scale": 0.0,
                                                 "weight_decay": 0.0})["params"].append(p)
                continue
            name = "point" if container == "point" else "posterior"
            if mangled.replace("/", ".") in head:
                name += "/head"
            group = groups.setdefault(name, {"params": [], "name": name})
            group["params"].append(p)
            if name.startswith("point"):
                group["noise_scale"] = 0.0
            else:
                group["weight_decay"] = 0.0
            if name.endswith("/head") and lr_head is not None:
                group["lr"] = lr_head
        order = ["posterior", "posterior/head", "point", "point/head", "likelihood"]
        return [groups[k] for k in order if k in groups]

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
        tensors = {**self.point.as_dict(), **self.frozen.as_dict(), **theta}
        net = self.model
        if self._lrt and any(n in self._lrt_var_names for n in theta):  # moments: sample pre-activations
            net = self._skeleton[1]
        return call(net, tensors, self.model_buffers.as_dict(), without_key(x, self.label_key), self.output_key)

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
                floating input holds NaN or inf (naming the input, its shape and the
                count). The check reads the loss once (the device sync that reading the
                loss costs anyway) and looks at the inputs only when the loss is not
                finite; a non-finite loss from finite inputs is returned as it is, for
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
        return self._checked_loss(self._loss_output(outs, kl, y), x)

    @staticmethod
    def _checked_loss(out: LossOutput, x) -> LossOutput:
        """``out``, or a :class:`NonFiniteInputError` naming the input when the loss is not finite because of it."""
        if not math.isfinite(out.loss.item()):  # one scalar read; the inputs are looked at only after a bad loss
            try:
                check_inputs_finite(x)
            except NonFiniteInputError as err:
                raise NonFiniteInputError(f"loss: {err}", output=out) from None
        return out

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
        """Draws θ_s ~ q(θ), s = 1..S, for the Bayesian parameters.

        The default is the diagonal Gaussian N(posterior_mean, posterior_std²).

        Args:
            num_samples: S ≥ 1.
            generator: optional ``torch.Generator`` for reproducible draws.

        Returns:
            ``{name: tensor of shape (S, *param_shape)}``.

        Raises:
            ValueError: if ``num_samples`` is not an integer >= 1.
            NotFittedError: if the posterior does not exist yet.
        """
        num_samples = check_int("num_samples", num_samples, minimum=1)
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

    def sample_logits(self, x, num_samples: int, generator: torch.Generator | None = None,
                      model: str = "full") -> torch.Tensor:
        """Model outputs under S posterior samples.

        Samples are drawn and evaluated ``chunk_size`` at a time; within a chunk
        the forward passes run as one ``torch.func.vmap`` over samples (in train
        mode with BatchNorm, whose in-place statistics updates cannot be vmapped,
        they run one after another).

        Args:
            x: model input with batch size B (a tensor, or a tuple of positional inputs).
            num_samples: S ≥ 1 (an integer; numpy integers and integral floats are accepted).
            generator: optional ``torch.Generator``.
            model: ``"full"``, or ``"mpm"`` for methods with inclusion variables (see :meth:`predict`).

        Returns:
            Tensor of shape (S, B, K) (or (S, B, D) for regression).

        Raises:
            NotFittedError: if the posterior does not exist yet.
            ValueError: if ``num_samples`` is not an integer >= 1, or a floating input
                contains NaN or inf.
        """
        num_samples = check_int("num_samples", num_samples, minimum=1)
        self._check_predictive_model(model)
        self._check_ready()
        check_inputs_finite(x)
        if model != "full":
            return self._sample_logits_mpm(x, num_samples, generator)
        return self._sample_logits(x, num_samples, generator)

    def _sample_logits(self, x, num_samples: int, generator: torch.Generator | None,
                       sample=None) -> torch.Tensor:
        """:meth:`sample_logits` on checked arguments (methods with their own draws override this).

        ``sample`` draws the stacked parameters (default :meth:`sample`). Under local
        reparameterisation the pre-activation noise comes from the global RNG; with a
        ``generator`` it is seeded from it, so a seeded generator still reproduces the outputs.
        """
        sample = sample or self.sample
        outs = []
        for start in range(0, num_samples, self.chunk_size):
            thetas = sample(min(self.chunk_size, num_samples - start), generator=generator)
            if self._lrt and generator is not None:
                seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
                with torch.random.fork_rng(devices=[] if x_device(x).type == "cpu" else [x_device(x)]):
                    torch.manual_seed(seed)
                    outs.append(self._forward_many(thetas, x))
            else:
                outs.append(self._forward_many(thetas, x))
        return torch.cat(outs, 0)

    def _sample_logits_mpm(self, x, num_samples: int, generator: torch.Generator | None) -> torch.Tensor:
        """Outputs of the median probability model; methods with inclusion variables (LBBNN) override this."""
        self._check_predictive_model("mpm")  # a ValueError for every method without inclusion variables
        raise NotImplementedError(f"method {self.method!r} has inclusion variables but no MPM sampler")

    def mpm_mean(self) -> dict[str, torch.Tensor]:
        """The weights of the median probability model (methods with inclusion variables).

        Raises:
            ValueError: for a method without inclusion variables.
        """
        self._check_predictive_model("mpm")
        raise NotImplementedError(f"method {self.method!r} has inclusion variables but no MPM mean")

    def _forward_many(self, thetas: dict[str, torch.Tensor], x) -> torch.Tensor:
        """Outputs under each of the stacked samples ``thetas`` ({name: (S, *shape)}), (S, B, ...).

        One ``vmap`` over the samples where possible. If ``vmap`` fails, the samples
        are evaluated one at a time: if that fails too, the error is the model's
        own (e.g. an input of the wrong shape) and is raised as it is, with vmap
        left on; only if it succeeds is the model taken to lack a batching rule,
        and vmap is switched off for this model (with one warning).
        """
        count = next(iter(thetas.values())).shape[0]
        sequential = count == 1 or not self._vmap_ok or (self.training and len(self.model_buffers) > 0)
        vmap_error = None
        if not sequential:
            try:
                out = vmap(lambda th: self.forward_with(th, x), randomness="different")(thetas)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # maybe an op without a batching rule: decided below
                vmap_error = err
            else:
                self.likelihood.check_outputs(out[0] if isinstance(out, torch.Tensor) else out)
                return out
        outs = [self.forward_with({n: t[i] for n, t in thetas.items()}, x) for i in range(count)]
        self.likelihood.check_outputs(outs[0])
        out = torch.stack(outs)
        if vmap_error is not None:  # the samples run one at a time but not under vmap: a genuine vmap limitation
            self._vmap_ok = False
            warnings.warn(f"vmap over posterior samples failed ({type(vmap_error).__name__}: {vmap_error}); "
                          "this model's samples are evaluated one at a time from now on", RuntimeWarning,
                          stacklevel=4)
        return out

    @torch.no_grad()
    def predict(self, x, num_samples: int = 5, generator: torch.Generator | None = None, model: str = "full"):
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
                contains NaN or inf (one ``torch.isfinite(x).all()`` per call), or
                a categorical model's outputs are not logits of shape (B, K), K >= 2.
            TypeError: if the model does not return a tensor.
        """
        num_samples = check_int("num_samples", num_samples, minimum=0)
        self._check_predictive_model(model)
        self._check_ready()
        check_inputs_finite(x)
        if model != "full":
            return self._predictive(self.sample_logits(x, max(num_samples, 1), generator, model=model)
                                    if num_samples else self.forward_with(self.mpm_mean(), x).unsqueeze(0))
        if num_samples == 0:
            outs = self._mean_outputs(x)
        else:
            outs = self._sample_logits(x, num_samples, generator)
        return self._predictive(outs)

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
        * LBBNN: the median probability model's weights (:meth:`mpm_mean`, as
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
        values = {**self.point.as_dict(), **self.frozen.as_dict(), **self._deterministic_mean()}
        skeleton = self.model
        if not any(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()]):
            raise ValueError("the wrapped model could not be deep-copied when it was wrapped, so bayeswrap has no "
                             "separate structure to fill; build the module yourself and load "
                             "bnn.posterior_mean() into it")
        with torch.no_grad():
            return _materialised_copy(skeleton, values, self._deterministic_buffers()).eval()

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
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"state_dict must be a mapping from names to tensors (bnn.state_dict()), got "
                             f"{type(state_dict).__name__}")
        bad = nonfinite_names(((k, v) for k, v in state_dict.items() if k not in self._nonfinite_state_keys),
                              nan_only=lambda k: k.startswith("model_buffers."))
        if bad:
            count = int((~torch.isfinite(state_dict[bad[0]])).sum())
            raise ValueError(f"state_dict[{bad[0]!r}] contains {count} non-finite values (NaN or inf)"
                             f"{f'; so do {bad[1:4]}' if len(bad) > 1 else ''}; accepted: a checkpoint with finite "
                             "values (was it saved after training diverged?)")
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


def _check_key(name: str, value) -> str:
    """A non-empty string key (``output_key``/``label_key``), or a ValueError naming the value."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}={value!r} is not accepted; accepted: a non-empty string key such as "
                         f"{'logits' if name == 'output_key' else 'labels'!r}")
    return value


def _check_model_tensors(model: nn.Module) -> None:
    """Refuses models whose weights cannot become the initial posterior and prior mean (once, at wrap time)."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    lazy = [n for n, t in named if nn.parameter.is_lazy(t)]
    if lazy:
        raise ValueError(f"the model has uninitialised (lazy) tensors, e.g. {lazy[:3]}; run one forward pass "
                         "before wrapping it so that their shapes are known")
    meta = [n for n, t in named if t.is_meta]
    if meta:
        raise ValueError(f"the model's tensors are on the 'meta' device (e.g. {meta[:3]}), which holds no values: "
                         "they cannot become the prior mean and the initial posterior; accepted: a model with "
                         "real weights (materialise it first, e.g. model.to_empty(device='cpu') and then "
                         "model.load_state_dict(weights))")
    bad = nonfinite_names(model.named_parameters())
    if bad:
        t = dict(model.named_parameters())[bad[0]]
        raise ValueError(f"the model's parameter {bad[0]!r} contains {int((~torch.isfinite(t)).sum())} non-finite "
                         f"values (NaN or inf){f'; so do {bad[1:4]}' if len(bad) > 1 else ''}; bayeswrap copies "
                         "the weights as the initial posterior and the prior mean, so they must be finite")
    bad = nonfinite_names(model.named_buffers(), nan_only=lambda n: True)
    if bad:
        raise ValueError(f"the model's buffer {bad[0]!r} contains NaN; accepted: buffers without NaN "
                         "(e.g. reset BatchNorm statistics with module.reset_running_stats())")


def _materialised_copy(skeleton: nn.Module, params: Mapping[str, torch.Tensor],
                       buffers: Mapping[str, torch.Tensor]) -> nn.Module:
    """A deep copy of the storage-free ``skeleton`` whose meta tensors are replaced by copies of ``params``/``buffers``.

    Tied tensors (one tensor under several names) stay tied: one copy, found under any of the names.

    Raises:
        ValueError: naming a parameter or buffer of the skeleton that has no value.
    """
    net = copy.deepcopy(skeleton)
    for values, parameter in ((params, True), (buffers, False)):
        groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
        named = net.named_parameters(remove_duplicate=False) if parameter else net.named_buffers(remove_duplicate=False)
        for name, t in named:
            groups.setdefault(id(t), []).append((name, t))
        for aliases in groups.values():
            canonical = next((n for n, _ in aliases if n in values), None)
            if canonical is None:
                raise ValueError(f"no value for {aliases[0][0]!r} of the wrapped model")
            value = values[canonical].detach().clone()
            new = nn.Parameter(value, requires_grad=aliases[0][1].requires_grad) if parameter else value
            for name, _ in aliases:
                prefix, _, leaf = name.rpartition(".")
                owner = net.get_submodule(prefix) if prefix else net
                (owner._parameters if parameter else owner._buffers)[leaf] = new
    return net


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile(module)`` wrapped (its ``_orig_mod``), or ``model`` itself.

    bayeswrap evaluates the model with ``torch.func.functional_call`` on a storage-free copy of its
    structure, which calls the modules' ``forward`` eagerly: a compiled wrapper's graph would never run.
    Wrapping the original keeps the parameter names (no ``_orig_mod.`` prefix), so ``params`` patterns,
    checkpoints and :func:`bayeswrap.save` files match the plain model.

    Args:
        model: any ``nn.Module``; a ``torch._dynamo`` ``OptimizedModule`` (possibly nested) is unwrapped.

    Returns:
        The innermost original module (the same object, never a copy).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def _storage_free_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers live on the ``meta`` device (no memory).

    The copy is made with a ``deepcopy`` memo that maps every tensor to a meta
    tensor of the same shape, so tied parameters stay tied and no real
    parameter memory is duplicated, even transiently.
    """
    memo = {}
    for t in model.parameters():
        memo[id(t)] = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # modules that cannot be deep-copied are used as-is (still never written to)
        return model
