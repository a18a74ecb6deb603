"""Run configuration: YAML defaults plus command-line overrides, as in timm's ``train.py``.

Every option is a field of :class:`RunConfig` with its default and help text;
``configs/*.yaml`` set values, ``--key value`` flags override them, and the
resolved configuration is saved as ``config.yaml`` beside each run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml

from bayeswrap.app.options import coerce_option, option_specs, option_users
from bayeswrap.app.values import Bounds, StrictLoader, parse_bool, parse_number, unknown_name
from bayeswrap.core.checks import MAX_PREDICTIVE_SAMPLES, SCALE_RANGE, check_device
from bayeswrap.core.io import file_kind
from bayeswrap.data.corruptions import CORRUPTIONS, SEVERITIES, corruption_names, require_library
from bayeswrap.data.datasets import DATASETS
from bayeswrap.evaluation.conformal import SCORES as CONFORMAL_SCORES
from bayeswrap.methods import METHODS, wrap
from bayeswrap.methods.run_info import RunInfo


def _f(default, help: str, **kw):
    if isinstance(default, dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# BayesDLL's MNIST settings (its README), applied only where a config asks for them with
# ``per_method: bayesdll_mnist``. vanilla's wd=1e-4 is prior_std = 1/sqrt(wd * num_data) ~ 4 for 628 examples.
BAYESDLL_PER_METHOD = {
    "map": {"prior_std": 4.0, "num_samples": 0},
    "vi": {"prior_std": 1.0, "kl_weight": 1e-3, "bias": "informative"},
    "mc_dropout": {"prior_std": 1.0, "p_drop": 0.1, "kl_weight": 1e-3, "bias": "gaussian"},
    "sgld": {"prior_std": 1.0, "num_data_inflate": 1000.0, "noise_scale": 1.0, "burn_in_epochs": 5,
             "thinning": 10, "bias": "informative"},
    "laplace": {"prior_std": 0.01, "num_data_inflate": 1000.0, "bias": "informative"},
}

#: the prior and initial stds a run accepts: σ, 1/σ² and log σ stay finite in float32 (as the API checks)
PRIOR_STD_RANGE = SCALE_RANGE

#: the built-in per-method run settings, read from each method class's ``recommended`` (e.g. the step size of a
#: method that owns its update); method options are not among them: their defaults are the constructor's
DEFAULT_PER_METHOD = {name: dict(cls.recommended) for name, cls in METHODS.items() if cls.recommended}
#: named ``per_method`` mappings a config can ask for
PER_METHOD_PRESETS = {"bayesdll_mnist": BAYESDLL_PER_METHOD}


@dataclass
class RunConfig:
    """All options of ``bayeswrap fit`` / ``compare`` (see ``bayeswrap fit --help``)."""

    # data
    dataset: str = _f("digits", "dataset: digits (bundled), pets, flowers102, imagefolder")
    data_root: str = _f("data", "data directory (torchvision layout; imagefolder: root/train, root/test)")
    download: bool = _f(False, "download pets/flowers102 into data_root if missing")
    val_fraction: float = _f(0.5, "fraction of the non-test data held out for validation, in [0, 1)")
    img_size: int = _f(0, "image side for the default transform and the input side of timm models that take one "
                       "(timm's img_size: ViT, Swin; torchvision's ViT image_size); 0 = the model's default (224; 32 for digits)")
    # model
    model: str = _f("mlp", "backbone: 'mlp', a timm name (resnet101, vit_large_patch32_224) or tv:<torchvision name>")
    pretrained: bool = _f(False, "load pretrained weights (they become the prior mean; the new head's is zero)")
    init_checkpoint: str = _f("", "local weights file (safetensors or torch) used as initial weights and prior mean")
    dropout: float = _f(0.0, "the backbone's own dropout: mlp after each hidden layer, timm drop_rate, torchvision "
                                "every dropout layer (VGG, ViT, EfficientNet, MobileNet; refused for models without "
                                "one, e.g. tv:resnet18); 0 = none; mc_dropout --mode layers samples it")
    # inference method
    method: str = _f("vi", "inference method: " + ", ".join(METHODS))
    prior_std: float = _f(1.0, "prior std σ of N(θ̄, σ² I) (BayesDLL prior_sig)")
    prior_mean: str = _f("auto", "θ̄: auto (pretrained/init-checkpoint weights, else zero), init, zero")
    bias: str = _f("informative", "bias prior: informative, uninformative (mc_dropout: gaussian, spikymix, ignore)")
    params: str = _f("", "the Bayesian parameters: last_layer (the classifier's weight and bias, as "
                     "bw.wrap(params='last_layer')), comma-separated glob patterns over parameter names (fc.*,head.*) "
                     "or empty = all trainable ones")
    kl_weight: float = _f(1.0, "weight of the KL/prior term (BayesDLL kld)")
    num_data_inflate: float = _f(1.0, "num_data = train size x this factor (BayesDLL Ninflate)")
    num_samples: int = _f(5, "posterior samples S for test predictions (0 = posterior mean; at most "
                          f"{MAX_PREDICTIVE_SAMPLES:,}; BayesDLL nst)")
    burn_in_epochs: str = _f("auto", "sgld: burn-in in epochs (converted to optimizer steps), or auto (the first "
                             "half of training)")
    noise_scale: float = _f(1.0, "sgld: Langevin noise multiplier (BayesDLL nd); < 1 is a cold posterior, "
                            "temperature noise_scale²")
    method_options: dict = _f({}, "the method's own options, {option: value}: only those given; every other option "
                              "keeps the library default (flags: bayeswrap fit --help, 'method options')")
    # optimisation
    epochs: int = _f(40, "training epochs")
    lr: float = _f(0.05, "learning rate of the body")
    lr_head: float = _f(0.0, "learning rate of the classifier head; 0 = same as lr")
    momentum: float = _f(0.9, "SGD momentum (sgd only; not used by sgld or ivon, which have their own update)")
    optimizer: str = _f("sgd", "optimizer of methods without their own update (sgld and ivon have theirs): sgd "
                        "(with momentum) or adamw")
    weight_decay: float = _f(0.0, "weight decay of the point-estimate (non-Bayesian) parameters; Bayesian "
                             "parameters get their prior in the loss instead (AdamW: decoupled)")
    scheduler: str = _f("constant", "learning-rate schedule over epochs: constant or cosine (to 0), both after "
                        "the linear warm-up")
    warmup_epochs: int = _f(0, "epochs of linear learning-rate warm-up (from lr/(warmup_epochs+1) to lr)")
    grad_clip_norm: float = _f(0.0, "clip the gradient norm to this value; 0 = no clipping")
    batch_size: int = _f(32, "batch size")
    seed: int = _f(0, "random seed (data split, initialisation, sampling), an integer in [0, 2^32 - 1]")
    device: str = _f("auto", "auto (cuda if available), cpu, cuda, cuda:N, mps")
    amp: str = _f("none", "mixed precision of the training forward passes: none, bf16 (bfloat16 autocast) or fp16 "
                  "(float16 autocast with a gradient scaler); a bare --amp, true or yes mean bf16, false means none")
    num_workers: int = _f(0, "DataLoader worker processes")
    n_bins: int = _f(15, "bins of ECE/MCE and reliability diagrams")
    conformal_alpha: float = _f(0.1, "miscoverage α of the split conformal prediction sets (threshold from the "
                                "validation set, coverage and set size on test), in (0, 1)")
    conformal_score: str = _f("lac", "conformity score of the conformal sets (non-randomized): lac (1 - p_y, "
                              "Sadinle et al. 2019; MAPIE's default: the smallest sets), aps (Romano et al. 2020) or "
                              "raps (Angelopoulos et al. 2021, k_reg=1, lambda=0.01); non-randomized aps/raps sets are "
                              "empty where the top label's probability exceeds the threshold")
    # evaluation under shift and out of distribution
    shift_rotations: str = _f(",".join(str(a) for a in range(0, 181, 15)),
                              "rotation angles (degrees) of the shift evaluation (Ovadia et al. 2019); empty = none")
    shift_noise: str = _f("0,0.1,0.2,0.3,0.5,0.75,1", "std of additive Gaussian pixel noise (on [0, 1] images) of "
                          "the shift evaluation; empty = none")
    shift_corruptions: str = _f("", "image corruptions of Hendrycks & Dietterich (2019) in the shift evaluation: all "
                                "(the 15), comma-separated names (" + ", ".join(CORRUPTIONS) + ") or empty = none; "
                                'needs pip install "bayeswrap[corruptions]"')
    shift_severities: str = _f("1,2,3,4,5", "severities of the corruptions: comma-separated integers in 1..5")
    ood_classes: str = _f("auto", "classes held out of training and scored as out-of-distribution: comma-separated "
                          "indices, auto (8,9 on digits and mnist5k, none otherwise) or empty")
    # output
    out_dir: str = _f("runs", "parent folder of run folders")
    run_name: str = _f("", "run folder name inside out_dir (one path component); empty = "
                       "<dataset>-<model>-<method>")
    overwrite: bool = _f(False, "replace an existing run folder (only a bayeswrap run folder inside out_dir that "
                         "no live run is using)")
    progress: bool = _f(True, "show progress bars (only when stderr is a terminal)")
    per_method: dict = _f(DEFAULT_PER_METHOD, "per-method option overrides {method: {option: value}}, applied over the config "
                          "file, under command-line flags (YAML mapping), or bayesdll_mnist for BayesDLL's "
                          "per-method MNIST settings")

    def validate(self) -> RunConfig:
        """Checks every option's type, choice and range; touches no file.

        Raises:
            ValueError: naming the bad value and the accepted ones.
        """
        if self.method not in METHODS:
            raise ValueError(unknown_name("method", self.method, METHODS))
        self.amp = amp_value(self.amp)  # older configs and callers: True/False
        for name, accepted in CHOICES.items():
            if getattr(self, name) not in accepted:
                raise ValueError(unknown_name(name, getattr(self, name), accepted))
        for name, (ok, rule) in RANGES.items():
            value = getattr(self, name)
            kind = type(FIELDS[name].default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    kind is int and not isinstance(value, int)):
                raise ValueError(f"{name}={value!r} is not {'an integer' if kind is int else 'a number'}; "
                                 f"accepted: {rule}")
            if not (math.isfinite(value) and ok(value)):
                raise ValueError(f"{name}={value!r} is out of range; accepted: {rule}")
        if self.warmup_epochs >= self.epochs:
            raise ValueError(f"warmup_epochs={self.warmup_epochs} is out of range; accepted: an integer in "
                             f"[0, epochs={self.epochs})")
        self.check_method_options()
        for name in ("overwrite", "progress", "download", "pretrained"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is not a boolean; accepted: true, false")
        check_run_name(self.run_name)
        check_device("device", self.device)  # the form only: a saved config may come from another machine
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            raise ValueError(f"out_dir={self.out_dir!r} is a file; accepted: a folder (created if missing)")
        self.rotation_angles(), self.noise_stds(), self.held_out_classes()  # parse (raises on bad lists)
        self.severities()
        if self.corruptions():
            try:
                require_library()
            except ImportError as err:
                raise ValueError(f"shift_corruptions={self.shift_corruptions!r}: {err}") from None
        self.burn_in()
        return self

    def option(self, name: str) -> Any:
        """The value of one of the method's options: the one given, else the library default.

        Raises:
            ValueError: if ``name`` is not an option of ``self.method``.
        """
        specs = option_specs(self.method)
        if name not in specs:
            raise ValueError(f"{name} is not an option of method {self.method!r}; accepted: "
                             f"{', '.join(specs) or 'none'}")
        return self.method_options.get(name, specs[name].default)

    def with_options(self, **values) -> RunConfig:
        """A copy with run options and method options changed (method options by their names, e.g. ``p_drop``)."""
        fields = {k: v for k, v in values.items() if k in FIELDS}
        options = {k: v for k, v in values.items() if k not in FIELDS}
        return dataclasses.replace(self, **fields, method_options={**self.method_options, **options})

    def check_method_options(self) -> None:
        """Checks ``method_options`` by the method's own constructor, on a two-weight stand-in model.

        A full-batch sampler's ``run_chains`` options are checked by its ``check_run_options`` (before any
        sampling), including the kept draws per chain that the diagnostics of every run need.

        Raises:
            ValueError: for an option the method does not take (listing those it does), or a value the
                method's constructor (or ``check_run_options``) refuses (its message names the value and the
                accepted ones).
        """
        if not isinstance(self.method_options, dict):
            raise ValueError(f"method_options={self.method_options!r} is not a mapping {{option: value}}")
        specs = option_specs(self.method)
        for name in self.method_options:
            if name not in specs:
                users = option_users().get(name)
                raise ValueError(f"{name} is not an option of method {self.method!r}" + (
                    f" (it is an option of {', '.join(users)})" if users else "") +
                    f"; accepted: {', '.join(specs) or 'none'}")
        arguments = self.init_arguments()  # what the run implies for the method (its run_options) checked too
        # a Linear, with a dropout module for a method that samples the model's own dropout (which refuses a model
        # without one)
        stand_in = wrap(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)), self.method, num_data=10,
                        prior_std=self.prior_std, bias=self.bias, kl_weight=self.kl_weight, **arguments)
        check_run = getattr(stand_in, "check_run_options", None)
        if check_run is not None:
            run = self.method_arguments("run")
            try:
                check_run(**run)
            except ValueError as err:  # name the run options as the command line does (num_samples: chain_samples)
                text = str(err)
                for argument, option in {s.argument: n for n, s in option_specs(self.method).items()
                                         if s.target == "run" and s.argument != n}.items():
                    text = re.sub(rf"\b{argument}\b", option, text)
                raise ValueError(f"method={self.method!r}: {text}") from None

    def method_arguments(self, target: str) -> dict[str, Any]:
        """The given method options as arguments of the constructor (``"init"``) or of ``run_chains`` (``"run"``)."""
        specs = option_specs(self.method)
        return {specs[k].argument: v for k, v in self.method_options.items() if specs[k].target == target}

    def run_info(self, steps_per_epoch: int | None = None, *, pretrained: bool = False,
                 head: tuple[str, ...] | list[str] = ()) -> RunInfo:
        """The :class:`~bayeswrap.methods.run_info.RunInfo` of a run of this config (what ``run_options`` read).

        Args:
            steps_per_epoch: optimizer steps per epoch; None before the data are read.
            pretrained: whether the backbone starts from pretrained weights (with a new head).
            head: the parameter names of the backbone's classifier head.
        """
        return RunInfo(epochs=self.epochs, steps_per_epoch=steps_per_epoch, options=self.method_arguments("init"),
                       pretrained=pretrained, head=tuple(head), burn_in_epochs=self.burn_in(),
                       scheduler=self.scheduler, warmup_epochs=self.warmup_epochs)

    def init_arguments(self, run: RunInfo | None = None) -> dict[str, Any]:
        """The method's constructor arguments for ``run`` (default: :meth:`run_info` without data): those given,
        with what the run implies for the method (its class's ``run_options``) over them.

        Raises:
            ValueError: naming the values, for a run the method cannot train with (its ``run_options``).
        """
        run = self.run_info() if run is None else run
        return {**run.options, **METHODS[self.method].run_options(run)}

    def burn_in(self) -> float | None:
        """The burn-in in epochs of a method that discards the start of its chain (a finite number >= 0), or None
        for ``auto``.
        """
        text = str(self.burn_in_epochs).strip()
        if text == "auto":
            return None
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"burn_in_epochs={self.burn_in_epochs!r} is not valid; accepted: auto or a number >= 0")
        return value

    def rotation_angles(self) -> tuple[float, ...]:
        """The rotation grid in degrees (finite numbers)."""
        return _number_list("shift_rotations", self.shift_rotations, lambda v: math.isfinite(v), "finite numbers")

    def noise_stds(self) -> tuple[float, ...]:
        """The Gaussian-noise grid (pixel std, finite and >= 0)."""
        return _number_list("shift_noise", self.shift_noise, lambda v: math.isfinite(v) and v >= 0,
                            "finite numbers >= 0")

    def corruptions(self) -> tuple[str, ...]:
        """The corruptions of the shift evaluation (``all``: the 15 of Hendrycks & Dietterich), or ()."""
        return corruption_names(self.shift_corruptions)

    def severities(self) -> tuple[int, ...]:
        """The corruption severities: distinct integers in 1..5."""
        values = _number_list("shift_severities", self.shift_severities, lambda v: v in SEVERITIES,
                              "distinct integers in 1..5, at least one")
        if not values or len(set(values)) != len(values):
            raise ValueError(f"shift_severities={self.shift_severities!r} is not valid; accepted: comma-separated "
                             "distinct integers in 1..5, at least one")
        return tuple(int(v) for v in values)

    def held_out_classes(self, dataset: str | None = None) -> tuple[int, ...]:
        """The class indices held out as out-of-distribution (``auto`` resolved for ``dataset``)."""
        if self.ood_classes.strip() == "auto":
            return (8, 9) if (dataset or self.dataset) in ("digits", "mnist5k") else ()
        values = _number_list("ood_classes", self.ood_classes, lambda v: v.is_integer() and v >= 0,
                              "integers >= 0, or auto")
        return tuple(int(v) for v in values)

    @property
    def name(self) -> str:
        """The run folder name."""
        return self.run_name or f"{self.dataset}-{self.model.replace(':', '_')}-{self.method}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _number_list(name: str, text: str, ok, accepted: str) -> tuple[float, ...]:
    """Parses a comma-separated list of numbers, naming the bad entry."""
    values = []
    for item in (t.strip() for t in str(text).split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not ok(value):
            raise ValueError(f"{name}={text!r}: {item!r} is not valid; accepted: comma-separated {accepted}")
        values.append(value)
    return tuple(values)


FIELDS = {f.name: f for f in dataclasses.fields(RunConfig)}

#: options with a fixed set of values (``method``, ``bias`` and ``model`` are checked against the registry,
#: the method and the model zoo)
CHOICES: dict[str, tuple[str, ...]] = {
    "dataset": DATASETS, "prior_mean": ("auto", "init", "zero"), "optimizer": ("sgd", "adamw"),
    "scheduler": ("constant", "cosine"),
    "amp": ("none", "bf16", "fp16"), "conformal_score": CONFORMAL_SCORES,
}

#: spellings ``amp`` accepts, and the value each stands for (booleans: configs written before fp16 existed)
AMP_ALIASES = {"none": "none", "false": "none", "no": "none", "off": "none", "0": "none", "fp32": "none",
               "bf16": "bf16", "bfloat16": "bf16", "true": "bf16", "yes": "bf16", "on": "bf16", "1": "bf16",
               "fp16": "fp16", "float16": "fp16", "half": "fp16"}


def amp_value(value: Any) -> str:
    """The ``amp`` option as ``"none"``, ``"bf16"`` or ``"fp16"`` (booleans: True = bf16, False = none).

    Raises:
        ValueError: naming the value and listing the accepted ones.
    """
    key = ("true" if value else "false") if isinstance(value, bool) else str(value).strip().lower()
    if key not in AMP_ALIASES:
        raise ValueError(f"amp={value!r} is not known; accepted: none, bf16, fp16 (aliases: bfloat16, float16, "
                         f"half; true/yes/on = bf16, false/no/off = none)")
    return AMP_ALIASES[key]
#: numeric options: (the accepted interval, the same in words); the command line checks it before importing torch
RANGES: dict[str, tuple[Bounds, str]] = {
    "epochs": (Bounds(1), "an integer >= 1"),
    "batch_size": (Bounds(1), "an integer >= 1"),
    "num_samples": (Bounds(0, MAX_PREDICTIVE_SAMPLES),
                    f"an integer >= 0 and <= {MAX_PREDICTIVE_SAMPLES} (posterior samples of the predictive)"),
    "img_size": (Bounds(0), "an integer >= 0"),
    "num_workers": (Bounds(0), "an integer >= 0"),
    "n_bins": (Bounds(1), "an integer >= 1"),
    "warmup_epochs": (Bounds(0), "an integer >= 0, below epochs"),
    "seed": (Bounds(0, 2**32 - 1), "an integer in [0, 2^32 - 1]"),
    "lr": (Bounds(0, low_open=True), "a finite number > 0"),
    "lr_head": (Bounds(0), "a finite number >= 0 (0 = lr)"),
    "momentum": (Bounds(0, 1, high_open=True), "a number in [0, 1)"),
    "weight_decay": (Bounds(0), "a finite number >= 0"),
    "grad_clip_norm": (Bounds(0), "a finite number >= 0 (0 = no clipping)"),
    "val_fraction": (Bounds(0, 1, high_open=True), "a number in [0, 1)"),
    "dropout": (Bounds(0, 1, high_open=True), "a number in [0, 1) (the backbone's dropout probability)"),
    "prior_std": (Bounds(*PRIOR_STD_RANGE),
                  f"a number in [{PRIOR_STD_RANGE[0]:g}, {PRIOR_STD_RANGE[1]:g}]"),
    "kl_weight": (Bounds(0), "a finite number >= 0"),
    "num_data_inflate": (Bounds(0, low_open=True), "a finite number > 0"),
    "noise_scale": (Bounds(0), "a finite number >= 0"),
    "conformal_alpha": (Bounds(0, 1, low_open=True, high_open=True), "a number in (0, 1) (miscoverage of the conformal sets)"),
}
#: options a resumed run may change: they do not touch the data, the split, the model or the method
RESUME_ALLOWED = ("epochs", "lr", "lr_head", "momentum", "weight_decay", "scheduler", "warmup_epochs",
                  "grad_clip_norm", "num_samples", "n_bins", "shift_rotations", "shift_noise", "shift_corruptions",
                  "shift_severities", "device",
                  "num_workers", "progress", "amp", "conformal_alpha", "conformal_score")


def check_run_name(name: str) -> str:
    """``name`` if it is a single path component (a folder name inside ``out_dir``), else a ValueError."""
    if name == "":
        return name
    bad = (not isinstance(name, str) or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
           or os.path.isabs(name) or len(name) > 255 or name != name.strip() or name.startswith("."))
    if bad:
        raise ValueError(f"run_name={name!r} is not valid; accepted: one folder name inside out_dir (no '/', "
                         f"'\\', '..', leading '.' or surrounding spaces), or empty for <dataset>-<model>-<method>")
    return name


def coerce(name: str, value: Any) -> Any:
    """Converts a YAML or command-line value to the option's type.

    Integers accept integral numbers (``3``, ``3.0``, ``"1e3"``), never booleans,
    NaN, infinities or fractions; a missing value (YAML ``~`` or an empty
    ``key:``) is refused rather than read as the default.

    Raises:
        ValueError: for an unknown option or a value of the wrong type, naming
            the option, the value and what is accepted.
    """
    if name == "resume":
        raise ValueError("resume is not a config option; resume a run with: bayeswrap fit --resume RUN_DIR")
    if name not in FIELDS:
        if name in option_users():
            return coerce_option(name, value)
        raise ValueError(f"unknown option {name!r}; accepted: {', '.join(FIELDS)}, or a method option: "
                         f"{', '.join(option_users())}")
    kind = type(FIELDS[name].default) if FIELDS[name].default is not dataclasses.MISSING else dict
    if name == "amp" and value is not None:
        return amp_value(value)
    if value is None:
        default = FIELDS[name].default if kind is not dict else DEFAULT_PER_METHOD
        raise ValueError(f"{name}=None (an empty value) is not valid; give a {kind.__name__} or leave the option "
                         f"out to use its default {default!r}")
    if name == "method_options":
        if not isinstance(value, dict):
            raise ValueError(f"method_options={value!r} must be a mapping {{option: value}}")
        return {str(k): coerce(str(k), v) for k, v in value.items()}
    if kind is dict:
        if isinstance(value, str) and value.strip() in PER_METHOD_PRESETS:
            return copy.deepcopy(PER_METHOD_PRESETS[value.strip()])
        if isinstance(value, str):
            try:
                value = yaml.load(value, Loader=StrictLoader)
            except yaml.YAMLError as err:
                raise ValueError(f"{name}={value!r} is not a YAML mapping ({err})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r} must be a mapping {{method: {{option: value}}}} or one of "
                             f"{', '.join(PER_METHOD_PRESETS)}")
        for method, opts in value.items():
            if method not in METHODS or not isinstance(opts, dict):
                raise ValueError(f"{name}: {method!r} is not a method with an option mapping; "
                                 f"accepted methods: {', '.join(METHODS)}")
            for k in opts:
                if k in ("method", "per_method"):
                    raise ValueError(f"{name}.{method} cannot set {k!r}")
                users = method_fields().get(k)
                if users is not None and method not in users:
                    raise ValueError(f"{name}.{method} sets {k}, which method {method!r} does not use; {k} is an "
                                     f"option of {', '.join(users)}")
                coerce(k, opts[k])
        return value
    if kind is bool:
        return parse_bool(name, value)
    if kind is str and isinstance(value, (list, tuple)):  # YAML lists for the list-valued options
        return ",".join(str(v) for v in value)
    if kind is str and not isinstance(value, (str, int, float)) or isinstance(value, bool) and kind is not str:
        what = {int: "an integer", float: "a number", str: "a string"}[kind]
        raise ValueError(f"{name}={value!r} is not {what}; accepted: {RANGES.get(name, (0, what))[1]}")
    if kind is str:
        return str(value)
    number = parse_number(name, value, kind, RANGES.get(name, (0, "a float"))[1])
    if kind is int and not RANGES[name][0](number):
        raise ValueError(f"{name}={value!r} is out of range; accepted: {RANGES[name][1]}")
    return number


def method_fields() -> dict[str, tuple[str, ...]]:
    """``{option: methods that use it}`` for the options only some methods use (the rest apply to all)."""
    users = {k: list(v) for k, v in option_users().items()}
    for method, cls in METHODS.items():
        for name in cls.run_fields:  # run settings only this method reads (a sampler's burn-in epochs)
            users.setdefault(name, []).append(method)
    return {k: tuple(v) for k, v in users.items()}


def from_values(values: dict[str, Any], *, foreign: str = "error") -> RunConfig:
    """A validated :class:`RunConfig` from flat ``{option: value}`` (run fields and method options mixed).

    Method options are gathered into ``method_options`` (over any ``method_options`` mapping in ``values``).

    Args:
        values: coerced values (see :func:`coerce`).
        foreign: what to do with a method option that the run's method does not take: ``"error"`` or
            ``"drop"`` (a config file or a comparison's shared options may serve several methods).

    Raises:
        ValueError: naming a bad value or an option the method does not take.
    """
    fields = {k: v for k, v in values.items() if k in FIELDS}
    options = dict(fields.pop("method_options", {}))
    options.update({k: v for k, v in values.items() if k not in FIELDS})
    method = fields.get("method", RunConfig.method)
    if foreign == "drop" and method in METHODS:
        options = {k: v for k, v in options.items() if k in option_specs(method)}
    return RunConfig(**fields, method_options=options).validate()


#: the largest YAML file bayeswrap reads (a config, a run's config.yaml, a comparison's compare.yaml: a few KB)
MAX_YAML_BYTES = 1 << 20
#: the largest JSON file read back from a run folder (data.json, tuning_<method>.json, metrics.json)
MAX_JSON_BYTES = 64 << 20


def read_bounded(path: str | os.PathLike, max_bytes: int, what: str = "file", kind: str = "") -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (the size is checked before reading, and the read is
    capped, so a file that grows meanwhile or a device node cannot make it unbounded).

    Args:
        path: the file.
        max_bytes: the bound.
        what: how the messages name the file (``"config file"``, ``"run file"``).
        kind: the format, for the messages (``"YAML"``: "accepted: a YAML file").

    Raises:
        FileNotFoundError: if it does not exist.
        ValueError: naming the file, if it is a folder, a device, a pipe or another non-regular file, or larger
            than ``max_bytes``.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    accepted = f"a {kind} file" if kind else "a file"
    found = file_kind(path, follow_symlinks=True)  # a config file may be reached through a link
    if found == "a folder":
        raise ValueError(f"{what} {str(path)!r} is a folder; accepted: {accepted}")
    if found is not None:
        raise ValueError(f"{what} {str(path)!r} is not a regular file ({found}); accepted: {accepted}")
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{what} {str(path)!r} is larger than {max_bytes:,} bytes; accepted: a file of at most "
                         f"{max_bytes:,} bytes")
    return data


def read_yaml_file(path: str | os.PathLike, what: str = "config file") -> Any:
    """Parses a YAML file (UTF-8, at most :data:`MAX_YAML_BYTES`, no anchors or aliases, no duplicate keys) with
    the safe loader (:class:`~bayeswrap.app.options.StrictLoader`).

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: naming the file, for a folder or other non-regular file, a file above the size bound,
            non-UTF-8 bytes, a syntax error (with its line and column), an anchor or alias, or a duplicate key.
    """
    data = read_bounded(path, MAX_YAML_BYTES, what, "YAML")
    try:
        return yaml.load(data.decode("utf-8"), Loader=StrictLoader)
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text (byte {err.start}: "
                         f"{err.object[err.start:err.start + 1]!r}); accepted: a UTF-8 YAML file") from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ValueError(f"{what} {str(path)!r} is not valid YAML{at}: {problem}") from None


def read_json_file(path: str | os.PathLike, max_bytes: int = MAX_JSON_BYTES, what: str = "run file") -> Any:
    """Parses a JSON file read back from a run folder: a regular UTF-8 file of at most ``max_bytes``, with no
    duplicate keys.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: naming the file, for a non-regular file, a file above the size bound, non-UTF-8 bytes, a
            syntax error (with its line and column) or a duplicate key.
    """
    data = read_bounded(path, max_bytes, what, "JSON")

    def no_duplicates(pairs):
        out = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"duplicate key {key!r}")
            out[key] = value
        return out

    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=no_duplicates)
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text (byte {err.start}); accepted: a JSON file "
                         "written by bayeswrap") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON at line {err.lineno}, column {err.colno}: "
                         f"{err.msg}") from None
    except ValueError as err:
        raise ValueError(f"{what} {str(path)!r} is not valid: {err}") from None


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a config file into ``{option: value}``.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it is not a YAML mapping, has unknown options or bad
            values (see :func:`read_yaml_file` and :func:`coerce`).
    """
    data = read_yaml_file(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of option: value, not a "
                         f"{type(data).__name__}")
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        try:
            out[name] = coerce(name, value)
        except ValueError as err:
            raise ValueError(f"config file {str(path)!r}: {err}") from None
    return out


def resolve(config_path: str | None, overrides: dict[str, Any]) -> RunConfig:
    """Resolves a run's options: defaults < ``per_method[method]`` < YAML file < command line.

    The built-in per-method settings (:data:`DEFAULT_PER_METHOD`: the step
    sizes of the methods that own their update) fill in only what the YAML file does not set.
    BayesDLL's per-method MNIST settings apply only where a config asks for
    them (``per_method: bayesdll_mnist``). A ``per_method`` mapping in the YAML file or on the command line
    applies over the file's plain values, so one file can hold a comparison's
    shared and per-method settings.

    Raises:
        ValueError: for unknown options or bad values (naming them).
        FileNotFoundError: if ``config_path`` does not exist.
    """
    return resolve_values(load_yaml(config_path) if config_path else {}, overrides)


def resolve_values(values: dict[str, Any], overrides: dict[str, Any], *, foreign_flags: str = "error"
                   ) -> RunConfig:
    """:func:`resolve` with the config file's values already read (``load_yaml``).

    ``foreign_flags="drop"`` ignores the method options in ``overrides`` that the method does not take
    (``compare`` shares one set of flags among methods); ``"error"`` refuses them.
    """
    cli = {k: coerce(k, v) for k, v in overrides.items()}
    merged = {**values, **cli}
    method = merged.get("method", RunConfig.method)
    per_method = merged.get("per_method", RunConfig().per_method).get(method, {})
    per_method = {k: coerce(k, v) for k, v in per_method.items()}
    if "per_method" in values or "per_method" in cli:
        values = {**values, **per_method}
    else:
        values = {**per_method, **values}
    # a file's (or a comparison's shared) method options serve the methods that take them; a flag of this
    # run's own must be one of its method's options
    accepted = option_specs(method) if method in METHODS else {}
    shared = {k for k in values if k not in FIELDS and k not in accepted}
    if foreign_flags == "drop":
        shared |= {k for k in cli if k not in FIELDS and k not in accepted}
    return from_values({k: v for k, v in {**values, **cli}.items() if k not in shared})


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """The config saved in a run folder's ``config.yaml`` (``resume`` keys of older runs are ignored).

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: naming the file, if it is not a valid run config.
    """
    data = read_yaml_file(path, what="run config")
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} is not a run config (a mapping of option: value)")
    data.pop("resume", None)
    # run folders written before method options were read from the method classes hold every method's
    # options as flat fields: each is kept for the method that takes it and dropped for the others; any other
    # key was not written by bayeswrap
    users = option_users()
    unknown = [str(k) for k in data if not (isinstance(k, str) and (k in FIELDS or k in users))]
    if unknown:
        raise ValueError(f"{str(path)!r} is not a valid run config: {', '.join(map(repr, unknown))} is not a run "
                         f"option; accepted: {', '.join(FIELDS)}, or a method option")
    try:
        values = {k: coerce(k, v) for k, v in data.items()}
        return from_values(values, foreign="drop")
    except (TypeError, ValueError) as err:
        raise ValueError(f"{str(path)!r} is not a valid run config: {err}") from None


#: what ``data.json`` holds (:class:`bayeswrap.app.build.DataInfo`): field -> (check, accepted in words)
_MAX_CLASSES = 1_000_000
#: the most values one model input of a run may hold (the product of ``input_shape``): 2**24, 64 MiB as float32,
#: above a 3 x 2048 x 2048 image; a ``data.json`` claiming more is refused before the model is built from it
MAX_INPUT_VALUES = 1 << 24


def _shape(value) -> bool:
    return isinstance(value, list) and 1 <= len(value) <= 8 and all(
        isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_INPUT_VALUES for v in value) \
        and math.prod(value) <= MAX_INPUT_VALUES


def _input_range(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value) \
        and value[0] <= value[1]


DATA_JSON_FIELDS: dict[str, tuple[Any, str]] = {
    "dataset": (lambda v: isinstance(v, str) and 0 < len(v) <= 255, "a dataset name (a non-empty string)"),
    "class_names": (lambda v: isinstance(v, list) and 1 <= len(v) <= _MAX_CLASSES
                    and all(isinstance(c, str) and len(c) <= 4096 for c in v),
                    f"a list of 1 to {_MAX_CLASSES:,} class names (strings)"),
    "input_shape": (_shape, f"a list of 1 to 8 positive integers holding at most {MAX_INPUT_VALUES:,} values in all "
                            "(their product), e.g. [64] or [3, 224, 224]"),
    "image_shape": (_shape, f"a list of 1 to 8 positive integers holding at most {MAX_INPUT_VALUES:,} values in all "
                            "(their product), e.g. [1, 8, 8]"),
    "num_train": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
    "steps_per_epoch": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "an integer >= 0"),
    "input_range": (_input_range, "[min, max] of the training inputs, two finite numbers with min <= max"),
}
#: the fields of ``data.json`` that older runs lack (written since issue 34: ``input_range``)
OPTIONAL_DATA_JSON_FIELDS = ("input_range",)


def check_data_json(values: Any, path: str | os.PathLike) -> dict[str, Any]:
    """The fields of a run's ``data.json`` (as :func:`read_json_file` read them), checked against
    :data:`DATA_JSON_FIELDS` before the model is rebuilt from them.

    Returns:
        ``values`` (the keyword arguments of :class:`bayeswrap.app.build.DataInfo`).

    Raises:
        ValueError: naming the file and the field, for a value that is not a mapping, a missing or unknown
            field, or a field of the wrong type or range (``input_shape`` must be positive integers holding at
            most :data:`MAX_INPUT_VALUES` values in all; ``input_range``, optional, two finite numbers).
    """
    if not isinstance(values, dict):
        raise ValueError(f"{str(path)!r} is not a data record (a mapping of field: value), but a "
                         f"{type(values).__name__}")
    unknown = [k for k in values if k not in DATA_JSON_FIELDS]
    missing = [k for k in DATA_JSON_FIELDS if k not in values and k not in OPTIONAL_DATA_JSON_FIELDS]
    if unknown or missing:
        raise ValueError(f"{str(path)!r} is not a valid data record: " + "; ".join(
            ([f"unknown field(s) {', '.join(map(repr, unknown))}"] if unknown else []) +
            ([f"missing field(s) {', '.join(missing)}"] if missing else [])) +
            f"; accepted fields: {', '.join(DATA_JSON_FIELDS)}")
    for name, (ok, accepted) in DATA_JSON_FIELDS.items():
        if name in values and not ok(values[name]):
            shown = repr(values[name])
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ValueError(f"{str(path)!r}: {name}={shown} is not valid; accepted: {accepted}")
    return values


def check_compare_record(record: Any, path: str | os.PathLike) -> dict[str, Any]:
    """A comparison's ``compare.yaml`` (as :func:`read_yaml_file` read it), checked before any of it is used.

    Returns:
        ``{"config_file": {option: value}, "overrides": {option: value}, "methods": [str], "num_samples":
        [int], "tune": bool}`` with the options coerced (:func:`coerce`).

    Raises:
        ValueError: naming the file and the field, for a missing or unknown field or a value of the wrong
            type: ``methods`` a non-empty list of distinct method names, ``num_samples`` a non-empty list of
            distinct integers in [0, MAX_PREDICTIVE_SAMPLES], ``tune`` a boolean (YAML true/false).
    """
    fields = ("config_file", "overrides", "methods", "num_samples", "tune")
    if not isinstance(record, dict):
        raise ValueError(f"{str(path)!r} is not a valid comparison record: not a mapping of field: value")
    unknown = [str(k) for k in record if k not in fields]
    missing = [k for k in fields if k not in record]
    if unknown or missing:
        raise ValueError(f"{str(path)!r} is not a valid comparison record: " + "; ".join(
            ([f"unknown field(s) {', '.join(map(repr, unknown))}"] if unknown else []) +
            ([f"missing field(s) {', '.join(missing)}"] if missing else [])) + f"; accepted fields: "
            f"{', '.join(fields)}")
    out: dict[str, Any] = {}
    for name in ("config_file", "overrides"):
        if not isinstance(record[name], dict):
            raise ValueError(f"{str(path)!r}: {name}={record[name]!r} is not valid; accepted: a mapping of "
                             "option: value")
        try:
            out[name] = {str(k): coerce(str(k), v) for k, v in record[name].items()}
        except ValueError as err:
            raise ValueError(f"{str(path)!r}: {name}: {err}") from None
    methods = record["methods"]
    if not (isinstance(methods, list) and methods and all(isinstance(m, str) for m in methods)):
        raise ValueError(f"{str(path)!r}: methods={methods!r} is not valid; accepted: a non-empty list of method "
                         f"names ({', '.join(METHODS)})")
    counts = record["num_samples"]
    if not (isinstance(counts, list) and counts and all(
            isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_PREDICTIVE_SAMPLES for c in counts)):
        raise ValueError(f"{str(path)!r}: num_samples={counts!r} is not valid; accepted: a non-empty list of "
                         f"integers in [0, {MAX_PREDICTIVE_SAMPLES}]")
    if not isinstance(record["tune"], bool):
        raise ValueError(f"{str(path)!r}: tune={record['tune']!r} is not valid; accepted: true or false")
    return {**out, "methods": list(methods), "num_samples": list(counts), "tune": record["tune"]}


def check_method_list(methods: list[str], flag: str = "--methods") -> list[str]:
    """A comparison's methods: known, at least one, each once.

    Raises:
        ValueError: naming the list, for an unknown or repeated method, or an empty list.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"{flag} {','.join(unknown or methods) or repr('')} not known; accepted: "
                         f"{', '.join(METHODS)}")
    _refuse_repeats(flag, methods, "method once (each gets one run folder)")
    return list(methods)


def _refuse_repeats(flag: str, items: list, accepted: str) -> None:
    """A ValueError naming the list and its repeated items, if an item appears more than once."""
    repeated = list(dict.fromkeys(str(i) for i in items if items.count(i) > 1))
    if repeated:
        raise ValueError(f"{flag} {','.join(map(str, items))} lists {', '.join(repeated)} more than once; accepted: "
                         f"each {accepted}")


def check_sample_counts(counts: list[int], flag: str = "--num-samples") -> list[int]:
    """A comparison's posterior sample counts S: at least one, each an integer in [0, MAX_PREDICTIVE_SAMPLES], each
    once.

    Raises:
        ValueError: naming the list and the bad value.
    """
    if not counts:
        raise ValueError(f"{flag}: no sample count given; accepted: comma-separated integers in "
                         f"[0, {MAX_PREDICTIVE_SAMPLES}], e.g. 0,5")
    for c in counts:
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= MAX_PREDICTIVE_SAMPLES:
            raise ValueError(f"{flag} {','.join(map(str, counts))}: {c!r} is not valid; accepted: integers in "
                             f"[0, {MAX_PREDICTIVE_SAMPLES:,}] (the predictive holds S x N x K probabilities)")
    _refuse_repeats(flag, counts, "sample count once")
    return list(counts)


def needs_validation_data(methods: list[str], tune_options: bool, knob_of) -> list[str]:
    """The methods of a comparison that need validation data: with ``tune_options``, every method with a tuned
    knob (``knob_of(method)`` is not None), since each candidate is scored by its validation NLL (a
    post hoc prior precision included); none without tuning.
    """
    return [m for m in methods if tune_options and knob_of(m) is not None]
