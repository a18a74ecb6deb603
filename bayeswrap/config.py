"""Run configuration: YAML defaults plus command-line overrides, as in timm's ``train.py``.

Every option is a field of :class:`RunConfig` with its default and help text;
``configs/*.yaml`` set values, ``--key value`` flags override them, and the
resolved configuration is saved as ``config.yaml`` beside each run.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from .methods import METHODS


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

#: the built-in per-method settings: methods with their own optimizer take their own step size (IVON's lr
#: scales an averaged gradient, with no momentum sum; SGLD has no momentum), chosen on digits' validation NLL
DEFAULT_PER_METHOD = {"ivon": {"lr": 0.5}, "sgld": {"lr": 0.2}}
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
    img_size: int = _f(0, "image side for the default transform; 0 = the model's default (224)")
    # model
    model: str = _f("mlp", "backbone: 'mlp', a timm name (resnet101, vit_large_patch32_224) or tv:<torchvision name>")
    pretrained: bool = _f(False, "load pretrained weights (they become the prior mean; the new head's is zero)")
    init_checkpoint: str = _f("", "local weights file (safetensors or torch) used as initial weights and prior mean")
    # inference method
    method: str = _f("vi", "inference method: " + ", ".join(METHODS))
    prior_std: float = _f(1.0, "prior std σ of N(θ̄, σ² I) (BayesDLL prior_sig)")
    prior_mean: str = _f("auto", "θ̄: auto (pretrained/init-checkpoint weights, else zero), init, zero")
    bias: str = _f("informative", "bias prior: informative, uninformative (mc_dropout: gaussian, spikymix, ignore)")
    params: str = _f("", "comma-separated glob patterns of the Bayesian parameters; empty = all")
    kl_weight: float = _f(1.0, "weight of the KL/prior term (BayesDLL kld)")
    num_data_inflate: float = _f(1.0, "num_data = train size x this factor (BayesDLL Ninflate)")
    num_samples: int = _f(5, "posterior samples S for test predictions (0 = posterior mean; BayesDLL nst)")
    init_std: float = _f(1e-3, "vi: initial posterior std")
    num_train_samples: int = _f(1, "vi/mc_dropout: Monte Carlo samples per training step")
    p_drop: float = _f(0.1, "mc_dropout: drop probability")
    burn_in_epochs: str = _f("auto", "sgld: burn-in in epochs (converted to optimizer steps), or auto (the first "
                             "half of training)")
    thinning: int = _f(10, "sgld: keep every n-th iterate after burn-in (optimizer steps; BayesDLL thin)")
    noise_scale: float = _f(1.0, "sgld: Langevin noise multiplier (BayesDLL nd); < 1 is a cold posterior, "
                            "temperature noise_scale²")
    predictive: str = _f("ensemble", "sgld: ensemble (of the kept iterates) or gaussian (moment-matched, diagonal)")
    max_samples: int = _f(100, "sgld: most kept iterates stored for the ensemble (thinned by 2 when full)")
    sample_dtype: str = _f("float32", "sgld: dtype of the stored iterates: float32, bfloat16, float16, float64")
    cycles: int = _f(0, "sgld: cyclical SGLD cycles (Zhang et al. 2020); 0 = plain SGLD")
    exploration: float = _f(0.5, "sgld: fraction of each cycle spent exploring (no noise, no samples)")
    curvature: str = _f("ggn", "laplace: ggn (exact diagonal generalised Gauss-Newton), fisher (Monte Carlo GGN) "
                        "or empirical_fisher")
    pred_type: str = _f("glm", "laplace: glm (linearised predictive, Immer et al. 2021) or nn (sampled network)")
    # optimisation
    epochs: int = _f(40, "training epochs")
    lr: float = _f(0.05, "learning rate of the body")
    lr_head: float = _f(0.0, "learning rate of the classifier head; 0 = same as lr")
    momentum: float = _f(0.9, "SGD momentum (not used by sgld)")
    batch_size: int = _f(32, "batch size")
    seed: int = _f(0, "random seed (data split, initialisation, sampling)")
    device: str = _f("auto", "auto (cuda if available), cpu, cuda, cuda:N")
    amp: bool = _f(False, "bf16 autocast for forward passes")
    num_workers: int = _f(0, "DataLoader worker processes")
    n_bins: int = _f(15, "bins of ECE/MCE and reliability diagrams")
    # evaluation under shift and out of distribution
    shift_rotations: str = _f(",".join(str(a) for a in range(0, 181, 15)),
                              "rotation angles (degrees) of the shift evaluation (Ovadia et al. 2019); empty = none")
    shift_noise: str = _f("0,0.1,0.2,0.3,0.5,0.75,1", "std of additive Gaussian pixel noise (on [0, 1] images) of "
                          "the shift evaluation; empty = none")
    ood_classes: str = _f("auto", "classes held out of training and scored as out-of-distribution: comma-separated "
                          "indices, auto (8,9 on digits and mnist5k, none otherwise) or empty")
    # output
    out_dir: str = _f("runs", "parent folder of run folders")
    run_name: str = _f("", "run folder name; empty = <dataset>-<model>-<method>")
    resume: bool = _f(False, "continue an interrupted run from its last checkpoint")
    overwrite: bool = _f(False, "replace an existing run folder")
    progress: bool = _f(True, "show progress bars")
    per_method: dict = _f(DEFAULT_PER_METHOD, "per-method option overrides {method: {option: value}}, applied over the config "
                          "file, under command-line flags (YAML mapping), or bayesdll_mnist for BayesDLL's "
                          "per-method MNIST settings")

    def validate(self) -> RunConfig:
        """Checks choices and ranges.

        Raises:
            ValueError: naming the bad value and the accepted ones.
        """
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is not known; accepted: {', '.join(METHODS)}")
        if self.prior_mean not in ("auto", "init", "zero"):
            raise ValueError(f"prior_mean={self.prior_mean!r} is not known; accepted: auto, init, zero")
        checks = [("epochs", self.epochs >= 1, ">= 1"), ("batch_size", self.batch_size >= 1, ">= 1"),
                  ("lr", self.lr > 0, "> 0"), ("lr_head", self.lr_head >= 0, ">= 0"),
                  ("momentum", 0 <= self.momentum < 1, "in [0, 1)"),
                  ("val_fraction", 0 <= self.val_fraction < 1, "in [0, 1)"),
                  ("prior_std", self.prior_std > 0, "> 0"), ("kl_weight", self.kl_weight >= 0, ">= 0"),
                  ("num_data_inflate", self.num_data_inflate > 0, "> 0"),
                  ("num_samples", self.num_samples >= 0, ">= 0"), ("n_bins", self.n_bins >= 1, ">= 1"),
                  ("thinning", self.thinning >= 1, ">= 1"), ("max_samples", self.max_samples >= 0, ">= 0"),
                  ("cycles", self.cycles >= 0, ">= 0"), ("exploration", 0 <= self.exploration < 1, "in [0, 1)"),
                  ("img_size", self.img_size >= 0, ">= 0"), ("num_workers", self.num_workers >= 0, ">= 0")]
        self.rotation_angles(), self.noise_stds(), self.held_out_classes()  # parse (raises on bad lists)
        self.burn_in()
        for name, accepted in (("predictive", ("ensemble", "gaussian")), ("pred_type", ("glm", "nn")),
                               ("curvature", ("ggn", "fisher", "empirical_fisher")),
                               ("sample_dtype", ("float32", "bfloat16", "float16", "float64"))):
            if getattr(self, name) not in accepted:
                raise ValueError(f"{name}={getattr(self, name)!r} is not known; accepted: {', '.join(accepted)}")
        for name, ok, rule in checks:
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                ok = False
            if not ok:
                raise ValueError(f"{name}={value!r} is out of range; accepted: {rule}")
        return self

    def burn_in(self) -> float | None:
        """SGLD burn-in in epochs (a finite number >= 0), or None for ``auto``."""
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


def coerce(name: str, value: Any) -> Any:
    """Converts a YAML or command-line value to the option's type.

    Raises:
        ValueError: for an unknown option or a value of the wrong type.
    """
    if name not in FIELDS:
        raise ValueError(f"unknown option {name!r}; accepted: {', '.join(FIELDS)}")
    kind = type(FIELDS[name].default) if FIELDS[name].default is not dataclasses.MISSING else dict
    if kind is dict:
        if isinstance(value, str) and value.strip() in PER_METHOD_PRESETS:
            return copy.deepcopy(PER_METHOD_PRESETS[value.strip()])
        if isinstance(value, str):
            value = yaml.safe_load(value)
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
                coerce(k, opts[k])
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={value!r} is not a boolean; accepted: true, false")
    if value is None:
        return FIELDS[name].default
    if kind is str and isinstance(value, (list, tuple)):  # YAML lists for the list-valued options
        return ",".join(str(v) for v in value)
    try:
        if kind is int:
            as_float = float(value)
            if not as_float.is_integer():
                raise ValueError
            return int(as_float)
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} is not a valid {kind.__name__}") from None


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a config file into ``{option: value}``.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it is not a YAML mapping or has unknown options.
    """
    with open(path) as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of option: value")
    return {k.replace("-", "_"): coerce(k.replace("-", "_"), v) for k, v in data.items()}


def resolve(config_path: str | None, overrides: dict[str, Any]) -> RunConfig:
    """Resolves a run's options: defaults < ``per_method[method]`` < YAML file < command line.

    The built-in per-method settings (:data:`DEFAULT_PER_METHOD`: the step
    sizes of IVON and SGLD) fill in only what the YAML file does not set.
    BayesDLL's per-method MNIST settings apply only where a config asks for
    them (``per_method: bayesdll_mnist``). A ``per_method`` mapping in the YAML file or on the command line
    applies over the file's plain values, so one file can hold a comparison's
    shared and per-method settings.

    Raises:
        ValueError: for unknown options or bad values (naming them).
        FileNotFoundError: if ``config_path`` does not exist.
    """
    values: dict[str, Any] = load_yaml(config_path) if config_path else {}
    cli = {k: coerce(k, v) for k, v in overrides.items()}
    merged = {**values, **cli}
    method = merged.get("method", RunConfig.method)
    per_method = merged.get("per_method", RunConfig().per_method).get(method, {})
    per_method = {k: coerce(k, v) for k, v in per_method.items()}
    if "per_method" in values or "per_method" in cli:
        values = {**values, **per_method}
    else:
        values = {**per_method, **values}
    return RunConfig(**{**values, **cli}).validate()
