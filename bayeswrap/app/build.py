"""From a run config to the objects of a run: data, backbone, Bayesian model, optimizer and schedule.

Nothing here writes a file; :mod:`bayeswrap.app.runner` runs and records what this builds,
and :func:`bayeswrap.app.runs.load_run` rebuilds a saved run's model from its
``config.yaml`` and ``data.json`` without the training data.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from bayeswrap.app.backbones import (
    TV_PREFIX,
    check_model_name,
    create_model,
    data_config,
    head_parameter_names,
    tv_image_size,
)
from bayeswrap.app.config import RunConfig
from bayeswrap.core import distributed
from bayeswrap.core.checks import check_device
from bayeswrap.core.functional import select_parameters
from bayeswrap.core.io import file_kind
from bayeswrap.data.datasets import NUM_CLASSES, DataSplits, build_transforms, load_data
from bayeswrap.data.shift import hold_out_classes
from bayeswrap.methods import wrap

log = logging.getLogger("bayeswrap")

#: the autocast dtype of each ``amp`` value (fp16 also gets a gradient scaler)
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class EpochLoader:
    """A shuffling loader whose order depends only on (seed, epoch), so resumed runs repeat it exactly.

    :func:`bayeswrap.fit` calls :meth:`set_epoch` before each epoch.

    Data-parallel (``num_replicas`` W > 1): ``batch_size`` is the *global*
    batch B, a multiple of W. Every rank draws the same permutation and cuts it
    into the same global batches as one process would; rank r loads the r-th of
    the W equal slices of each global batch (B/W examples). The last, partial
    global batch is split as evenly as possible (fit's batch-size-weighted
    gradient average keeps it exact); if it has fewer than W examples it is
    dropped on every rank. So a W-process run sees exactly the one-process
    run's batches, except for those at most W − 1 dropped examples per epoch.

    Raises:
        ValueError: if ``batch_size`` is not a multiple of ``num_replicas``.
    """

    def __init__(self, dataset, batch_size: int, seed: int, num_workers: int = 0, *, num_replicas: int = 1,
                 rank: int = 0):
        if batch_size % num_replicas:
            raise ValueError(f"batch_size={batch_size} is not a multiple of the world size {num_replicas}; "
                             f"accepted: a multiple of {num_replicas} (batch_size is the global batch, split "
                             f"equally over the {num_replicas} processes)")
        self.dataset, self.batch_size, self.seed, self.num_workers = dataset, batch_size, seed, num_workers
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0

    def __len__(self) -> int:
        n, b, w = len(self.dataset), self.batch_size, self.num_replicas
        full, last = divmod(n, b)
        return full + (1 if last >= w or (last and w == 1) else 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        if self.num_replicas == 1:
            return iter(DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, generator=g,
                                   num_workers=self.num_workers))
        # DataLoader(shuffle=True, generator=g) draws its workers' base seed from g, then the permutation
        torch.empty((), dtype=torch.int64).random_(generator=g)
        order = torch.randperm(len(self.dataset), generator=g).tolist()
        w, r = self.num_replicas, self.rank
        batches = []
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            if len(chunk) < w:
                break
            batches.append(chunk[r * len(chunk) // w:(r + 1) * len(chunk) // w])
        return iter(DataLoader(self.dataset, batch_sampler=batches, num_workers=self.num_workers,
                               generator=g))  # g, not the global generator, seeds the workers


def eval_loader(dataset, cfg: RunConfig) -> DataLoader:
    """An in-order loader for evaluation (batch at least 128).

    It has its own generator (seeded by ``cfg.seed``), from which each iteration draws its workers' base seed:
    without one, a ``DataLoader`` draws that seed from torch's global generator, so every evaluation would move
    the random stream of whatever trains next.
    """
    return DataLoader(dataset, batch_size=max(cfg.batch_size, 128), shuffle=False, num_workers=cfg.num_workers,
                      generator=torch.Generator().manual_seed(cfg.seed))


def device_of(name: str) -> torch.device:
    """``auto`` (cuda if available), ``cpu``, ``cuda`` or ``cuda:N`` as a device.

    Under ``torchrun`` with several processes (``WORLD_SIZE`` > 1), ``auto`` and
    ``cuda`` mean ``cuda:LOCAL_RANK``: one GPU per process.

    Raises:
        ValueError: naming the value, for anything else, or ``cuda:N`` under
            torchrun with several processes.
    """
    if name == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(f"device={name!r} is not valid; accepted: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and distributed.env_world_size() > 1:
        if device.index is not None:
            raise ValueError(f"device={name!r} under torchrun with {distributed.env_world_size()} processes; "
                             "accepted: auto or cuda (each process uses cuda:LOCAL_RANK), or cpu")
        device = torch.device("cuda", distributed.local_rank())
    return device


@dataclass
class DataInfo:
    """What a saved run needs to know about its data to rebuild the model and read new inputs (``data.json``).

    Attributes:
        dataset: the dataset name.
        class_names: the K names of the model's outputs, in output order.
        input_shape: the shape of one model input, e.g. ``(64,)`` or ``(3, 224, 224)``.
        image_shape: its ``(C, H, W)`` image layout.
        num_train: training-set size (before ``num_data_inflate``).
        steps_per_epoch: optimizer steps per epoch.
        input_range: ``[min, max]`` over every value of the training inputs, for a training split held in memory
            (:func:`training_input_range`); None where it is not known (image files, runs written before it was
            recorded). ``predict`` compares new array inputs with it (:mod:`bayeswrap.app.input_range`).
    """

    dataset: str
    class_names: list[str]
    input_shape: list[int]
    image_shape: list[int]
    num_train: int
    steps_per_epoch: int
    input_range: list[float] | None = None
    num_classes: int = field(init=False)

    def __post_init__(self):
        self.num_classes = len(self.class_names)
        self.input_shape, self.image_shape = list(self.input_shape), list(self.image_shape)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("num_classes")
        if out["input_range"] is None:  # unknown: left out, as in the data.json of older runs
            out.pop("input_range")
        return out


def data_info(splits: DataSplits, cfg: RunConfig) -> DataInfo:
    """The :class:`DataInfo` of a run's (held-out-class filtered) splits."""
    names = list(splits.class_names) if len(splits.class_names) == splits.num_classes else \
        [str(i) for i in range(splits.num_classes)]
    return DataInfo(dataset=splits.name, class_names=names, input_shape=list(splits.input_shape),
                    image_shape=list(splits.image_shape or splits.input_shape), num_train=len(splits.train),
                    steps_per_epoch=(len(splits.train) + cfg.batch_size - 1) // cfg.batch_size,
                    input_range=training_input_range(splits.train))


def training_input_range(dataset) -> list[float] | None:
    """``[min, max]`` over every value of a training split's inputs when they are held in memory as one tensor
    (:class:`~bayeswrap.data.datasets.ArrayDataset`: digits, mnist5k), read without a pass over the data; None for
    a split that decodes its inputs (image files), whose range would cost a pass over every image.
    """
    inputs = getattr(dataset, "inputs", None)
    if not isinstance(inputs, torch.Tensor) or not inputs.numel() or inputs.dtype == torch.bool or inputs.is_complex():
        return None
    low, high = float(inputs.min()), float(inputs.max())
    return [low, high] if math.isfinite(low) and math.isfinite(high) else None


def run_data_config(cfg: RunConfig, model: torch.nn.Module) -> dict | None:
    """The pretrained model's timm data config (:func:`~bayeswrap.app.backbones.data_config`), at the run's
    ``img_size`` where one is set (the side the model was built for).
    """
    config = data_config(model)
    if config is not None and cfg.img_size:
        config = {**config, "input_size": (config["input_size"][0], cfg.img_size, cfg.img_size)}
    return config


def load_splits(cfg: RunConfig, model: torch.nn.Module | None = None):
    """The run's data splits (held-out classes removed) and the held-out-class test set (or None)."""
    is_mlp = cfg.model == "mlp"
    kwargs = dict(root=cfg.data_root, download=cfg.download, val_fraction=cfg.val_fraction, seed=cfg.seed)
    if model is not None:
        splits = load_data(cfg.dataset, **kwargs, data_config=run_data_config(cfg, model))
    else:
        splits = load_data(cfg.dataset, **kwargs, flatten=is_mlp,
                           img_size=cfg.img_size or (None if cfg.dataset != "digits" or is_mlp else 32))
    shape = splits.image_shape
    if cfg.corruptions() and (shape is None or len(shape) != 3 or shape[0] not in (1, 3)):  # before any weights
        raise ValueError(f"shift_corruptions={cfg.shift_corruptions!r}: image corruptions need gray or RGB images "
                         f"(C, H, W) with C = 1 or 3, but dataset {cfg.dataset!r} has inputs of image shape {shape}; "
                         "accepted: an image dataset, or shift_corruptions empty")
    held_out = cfg.held_out_classes(splits.name)
    ood_test = None
    if held_out:
        splits, ood_test = hold_out_classes(splits, held_out)
    return splits, ood_test


def preflight(cfg: RunConfig) -> None:
    """The checks of :func:`build` that need no data and no weights, so that a bad option fails at once.

    :meth:`RunConfig.validate` has checked each option's type, choice and range (and the method's options, by
    its constructor on a stand-in model); these depend on this machine, its files, the model zoo and the
    dataset's classes, which ``build`` would otherwise meet only after loading the data (and, for
    ``pretrained``, the weights).

    Raises:
        ValueError: naming the option, the value and the accepted ones: an unknown ``model`` (close names
            suggested) or ``model=mlp`` with ``pretrained``; an ``init_checkpoint`` that is not a file; a
            ``device`` this machine lacks; ``ood_classes`` outside the dataset's classes, repeated, or all of them.
    """
    check_model_name(cfg.model, pretrained=cfg.pretrained, init_checkpoint=cfg.init_checkpoint or None)
    if cfg.init_checkpoint:
        kind = file_kind(cfg.init_checkpoint, follow_symlinks=True)
        if kind is not None or not os.path.exists(cfg.init_checkpoint):
            raise ValueError(f"init_checkpoint={cfg.init_checkpoint!r} {f'is {kind}' if kind else 'does not exist'}; "
                             "accepted: a local weights file (.safetensors, or a torch.save state dict)")
    check_device("device", cfg.device, available=True)
    check_backbone(cfg)
    classes = cfg.held_out_classes(cfg.dataset)
    num_classes = dataset_classes(cfg)
    if not classes or num_classes is None:
        return
    accepted = (f"accepted: comma-separated distinct class indices in [0, {num_classes}) that keep at least one "
                "class, auto or empty")
    outside = [c for c in classes if c >= num_classes]
    if outside:
        raise ValueError(f"ood_classes={cfg.ood_classes!r}: class {outside[0]} is not a class of {cfg.dataset} "
                         f"({num_classes} classes); {accepted}")
    if len(set(classes)) < len(classes):
        raise ValueError(f"ood_classes={cfg.ood_classes!r} repeats a class; {accepted}")
    if len(classes) >= num_classes:
        raise ValueError(f"ood_classes={cfg.ood_classes!r} holds out all {num_classes} classes of {cfg.dataset}, "
                         f"leaving none to train on; {accepted}")


def _backbone_arguments(cfg: RunConfig, info_dataset: str, input_size: int | None = None) -> dict:
    """The keyword arguments of :func:`~bayeswrap.app.backbones.create_model` that the run's options set."""
    # the model's input side is the data's: img_size, else 32 for the digits (see load_splits), else the
    # model's default (which a pretrained model's data config then gives the data)
    side = cfg.img_size or (32 if info_dataset == "digits" and not cfg.pretrained else None)
    extra: dict = {"dropout": cfg.dropout, "img_size": side}
    if cfg.model == "mlp":
        extra["in_features"] = input_size if input_size is not None else 64
    elif info_dataset in ("digits", "mnist5k"):  # gray images: a timm model's or torchvision's first conv adapted
        extra["in_chans"] = 1
    return extra


def check_backbone(cfg: RunConfig) -> None:
    """Builds the backbone on the meta device (no memory, no weights) when ``dropout`` or ``img_size`` is set, so
    that a model that cannot take them is refused before any data are loaded.

    Raises:
        ValueError: for a ``dropout`` > 0 on a backbone without dropout (naming those with it), a model whose
            constructor refuses the run's ``img_size``, or torchvision weights made for another side.
    """
    if cfg.model == "mlp" or not (cfg.dropout > 0 or cfg.img_size):
        return
    arguments = _backbone_arguments(cfg, cfg.dataset)
    if cfg.pretrained and cfg.model.startswith(TV_PREFIX) and arguments["img_size"]:  # weights for one side only
        import torchvision

        arch = cfg.model[len(TV_PREFIX):]
        tv_image_size(arch, torchvision.models.get_model_weights(arch).DEFAULT, {"img_size": arguments["img_size"]})
    try:
        with torch.device("meta"):
            create_model(cfg.model, dataset_classes(cfg) or 2, **arguments)
    except (TypeError, AssertionError, RuntimeError) as err:
        raise ValueError(f"model={cfg.model!r} cannot be built with img_size={cfg.img_size}, "
                         f"dropout={cfg.dropout}: {err}") from None


def dataset_classes(cfg: RunConfig) -> int | None:
    """The number of classes of the run's dataset, known without loading it (None: an image folder not found)."""
    if cfg.dataset in NUM_CLASSES:
        return NUM_CLASSES[cfg.dataset]
    train = Path(cfg.data_root) / "train"  # imagefolder: one class per folder
    return sum(1 for p in train.iterdir() if p.is_dir()) if train.is_dir() else None


def build(cfg: RunConfig, *, for_evaluation: bool = False):
    """Data, backbone and Bayesian model for a config (nothing is written).

    With ``for_evaluation`` no pretrained weights are fetched: the checkpoint
    about to be loaded holds every tensor.

    With held-out classes (``cfg.ood_classes``) the splits hold only the kept
    classes, relabelled 0..K'-1, and the model has K' outputs.

    Returns:
        ``(splits, ood_test, bnn, head_names, device)``; ``ood_test`` is the dataset
        of held-out-class test examples, or None.
    """
    splits, ood_test = load_splits(cfg)
    info = data_info(splits, cfg)
    bnn, head, device, model = build_model(cfg, info, for_evaluation=for_evaluation)
    if cfg.pretrained and cfg.model != "mlp":  # the pretrained model decides the transforms
        splits, ood_test = load_splits(cfg, model)
    return splits, ood_test, bnn, head, device


def build_model(cfg: RunConfig, info: DataInfo, *, for_evaluation: bool = False):
    """The backbone and its Bayesian wrapper for data described by ``info``.

    Returns:
        ``(bnn, head_names, device, backbone)``; ``bnn`` is on ``device``.
    """
    torch.manual_seed(cfg.seed)
    is_mlp = cfg.model == "mlp"
    pretrained = cfg.pretrained and not for_evaluation
    init_checkpoint = None if for_evaluation else (cfg.init_checkpoint or None)
    extra = _backbone_arguments(cfg, info.dataset, int(math.prod(info.input_shape)) if is_mlp else None)
    model = create_model(cfg.model, info.num_classes, pretrained=pretrained, init_checkpoint=init_checkpoint,
                         **extra)
    head = head_parameter_names(model)
    patterns = params_selector(cfg.params)
    bayesian = select_parameters(model, patterns)
    if cfg.prior_mean == "auto" and cfg.pretrained and not cfg.init_checkpoint:
        # BayesDLL: the pretrained body is the prior mean, the new head's prior mean is zero
        params = dict(model.named_parameters())
        prior_mean = {n: torch.zeros_like(params[n]) if n in head else params[n].detach() for n in bayesian}
    elif cfg.prior_mean == "auto":
        prior_mean = "init" if cfg.init_checkpoint else "zero"
    else:
        prior_mean = cfg.prior_mean
    num_data = max(1, round(info.num_train * cfg.num_data_inflate))
    options = cfg.init_arguments(cfg.run_info(info.steps_per_epoch, pretrained=pretrained, head=head))
    bnn = wrap(model, cfg.method, num_data=num_data, prior_std=cfg.prior_std, prior_mean=prior_mean,
               bias=cfg.bias, params=patterns, kl_weight=cfg.kl_weight, **options)
    device = device_of(cfg.device)
    return bnn.to(device), head, device, model


def params_selector(text: str) -> str | list[str] | None:
    """The ``params`` of :func:`bayeswrap.wrap` that the ``params`` option spells: ``last_layer`` (the classifier's
    weight and bias, as ``bw.wrap(params="last_layer")``), comma-separated glob patterns, or None (empty: every
    trainable parameter).
    """
    if text.strip() == "last_layer":
        return "last_layer"
    return [p.strip() for p in text.split(",") if p.strip()] or None


def input_transform(cfg: RunConfig, info: DataInfo, model: torch.nn.Module):
    """The eval-time transform from a PIL image to one model input of shape ``info.input_shape`` (float32).

    Image datasets use the run's eval transform (the pretrained model's timm
    data config, else resize + ImageNet normalisation). The bundled digit
    datasets take the image as grey levels in [0, 1] (ink bright on a dark
    background, as in the data), resized to the dataset's image side and then
    to the model's input (flat for the MLP).
    """
    shape = tuple(info.input_shape)
    if info.dataset in ("digits", "mnist5k"):
        import torchvision.transforms.functional as TF

        side = info.image_shape[-1]

        def transform(image):
            x = TF.to_tensor(TF.resize(image.convert("L"), [side, side], antialias=True))  # (1, side, side)
            return x.reshape(shape)

        return transform
    if cfg.pretrained and cfg.model != "mlp":
        tf = build_transforms(data_config=run_data_config(cfg, model))[1]
    else:
        tf = build_transforms(img_size=cfg.img_size or None)[1]
    return lambda image: tf(image.convert("RGB"))


def make_optimizer(cfg: RunConfig, bnn, head) -> torch.optim.Optimizer:
    """The optimizer of a run: the method's own (``required_optimizer``) if it has one, else SGD with momentum or
    AdamW.

    A method's own optimizer gets ``lr`` and, where its constructor takes them, the model's ``num_data`` and the
    run's ``noise_scale`` (a Langevin optimizer's). ``weight_decay`` applies to the point-estimate groups only;
    the Bayesian groups carry ``weight_decay=0`` (their prior is in the loss).
    """
    groups = bnn.param_groups(head, cfg.lr_head or None)
    own = bnn.required_optimizer
    if own is not None:
        accepted = inspect.signature(own).parameters
        run = {k: v for k, v in {"num_data": bnn.num_data, "noise_scale": cfg.noise_scale}.items() if k in accepted}
        return own(groups, lr=cfg.lr, **run)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def lr_factor(cfg: RunConfig, epoch: int) -> float:
    """The learning-rate multiplier of 0-based ``epoch``: linear warm-up, then constant or cosine.

    Warm-up epoch e < w has (e + 1)/(w + 1); then ``constant`` is 1 and
    ``cosine`` is ½(1 + cos(π (e − w)/(E − w))) (Loshchilov & Hutter 2017, eq. 5
    without restarts, annealed towards 0 at epoch E).
    """
    w, total = cfg.warmup_epochs, cfg.epochs
    if epoch < w:
        return (epoch + 1) / (w + 1)
    if cfg.scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * (epoch - w) / max(1, total - w)))
    return 1.0


def make_scheduler(cfg: RunConfig, optimizer: torch.optim.Optimizer, start_epoch: int = 0):
    """A per-epoch ``LambdaLR`` of :func:`lr_factor` (None for a constant lr without warm-up).

    For a resumed run (``start_epoch`` > 0) the schedule continues at
    ``start_epoch`` from each group's ``initial_lr`` (set from the config), so a
    changed ``lr`` or ``epochs`` applies from the next epoch on.

    A method that sets its own step size refuses a schedule in its ``run_options``, which
    :meth:`RunConfig.validate` calls.
    """
    if cfg.scheduler == "constant" and cfg.warmup_epochs == 0:
        return None
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: lr_factor(cfg, e), last_epoch=start_epoch - 1)
