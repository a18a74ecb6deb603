"""Backbones by name, with the classification head replaced for the task.

Names:

- a timm model name, e.g. ``"resnet18"``, ``"resnet101"``, ``"vit_tiny_patch16_224"``,
  ``"vit_large_patch32_224"`` (a pretrained tag such as ``"resnet18.a1_in1k"`` is allowed);
- a torchvision classification model with a ``tv:`` prefix, e.g. ``"tv:resnet101"``,
  ``"tv:vit_l_32"`` (BayesDLL's pair), ``"tv:resnet18"``;
- ``"mlp"``: the built-in :class:`MLP` for flat inputs such as the 64-d digits.

The head is the last linear layer mapping features to logits. For timm models and
:class:`MLP` it is what ``model.get_classifier()`` returns; for torchvision models it
is found by :func:`find_head` from the model's attributes (see :data:`TV_HEAD_ATTRS`).
:func:`head_parameter_names` lists its parameters, e.g. for an ``lr_head`` param group
and to centre the new head's prior at zero (BayesDLL).

Example:
    >>> model = create_model("mlp", num_classes=10, in_features=64)
    >>> head_parameter_names(model)
    ['head.weight', 'head.bias']
"""

from __future__ import annotations

import difflib
import os
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bayeswrap.core.io import CheckpointError

__all__ = [
    "DEFAULT_MLP_HIDDEN",
    "TV_HEAD_ATTRS",
    "TV_PREFIX",
    "CheckpointError",
    "LoadedCheckpoint",
    "MLP",
    "PretrainedWeightsError",
    "available_models",
    "check_model_name",
    "create_model",
    "data_config",
    "find_head",
    "head_parameter_names",
    "load_checkpoint",
    "load_state_dict_file",
    "set_dropout",
    "tv_image_size",
]

#: Prefix that selects a torchvision model, e.g. ``"tv:resnet101"``.
TV_PREFIX = "tv:"

#: Default hidden sizes of the built-in MLP. BayesDLL §5.1 uses three hidden layers
#: of 1000 ReLU units; two of 256 suit the 1,797 64-d digits and train in seconds on a
#: CPU. Pass ``hidden_sizes=(1000, 1000, 1000)`` for the paper's network.
DEFAULT_MLP_HIDDEN: tuple[int, ...] = (256, 256)

#: Attributes of torchvision classifiers that hold the head, tried in order; the head is
#: the attribute itself if it is an ``nn.Linear``, else the last ``nn.Linear`` inside it.
#: ``fc``: ResNet/ResNeXt/Wide-ResNet, RegNet, ShuffleNet, GoogLeNet, Inception;
#: ``heads``: ViT (``heads.head``); ``head``: Swin; ``classifier``: VGG, AlexNet,
#: DenseNet, MobileNet, EfficientNet, ConvNeXt, MNASNet, MaxViT.
TV_HEAD_ATTRS: tuple[str, ...] = ("fc", "heads", "head", "classifier")



class PretrainedWeightsError(RuntimeError):
    """Pretrained weights could not be obtained (typically: no internet)."""


class MLP(nn.Sequential):
    """A ReLU multilayer perceptron for flat inputs.

    Layers: ``flatten -> [fc{i} -> act{i} (-> drop{i})] * len(hidden_sizes) -> head``.
    Inputs of shape ``(B, *)`` are flattened to ``(B, in_features)``; outputs are
    logits ``(B, num_classes)``. It follows timm's head API (``get_classifier``,
    ``reset_classifier``) so the rest of bayeswrap treats it like a timm model.

    Args:
        in_features: Size of one flattened input (64 for digits).
        num_classes: Number of output logits.
        hidden_sizes: Widths of the hidden layers (default :data:`DEFAULT_MLP_HIDDEN`).
        dropout: Dropout probability after each hidden activation (0 = no dropout
            layer; MC dropout wants > 0).

    Raises:
        ValueError: A non-positive size or a dropout outside ``[0, 1)``.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden_sizes: Sequence[int] = DEFAULT_MLP_HIDDEN,
        dropout: float = 0.0,
    ):
        sizes = [int(in_features), *(int(h) for h in hidden_sizes)]
        if min(sizes) <= 0 or int(num_classes) <= 0:
            raise ValueError(f"MLP sizes must be positive, got in_features={in_features}, "
                             f"hidden_sizes={tuple(hidden_sizes)}, num_classes={num_classes}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        layers: list[tuple[str, nn.Module]] = [("flatten", nn.Flatten())]
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers += [(f"fc{i}", nn.Linear(n_in, n_out)), (f"act{i}", nn.ReLU())]
            if dropout > 0:
                layers.append((f"drop{i}", nn.Dropout(dropout)))
        layers.append(("head", nn.Linear(sizes[-1], int(num_classes))))
        super().__init__(OrderedDict(layers))
        self.in_features = sizes[0]
        self.num_features = sizes[-1]
        self.num_classes = int(num_classes)

    def get_classifier(self) -> nn.Module:
        """Return the head, ``nn.Linear(num_features, num_classes)``."""
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head by a freshly initialised one with ``num_classes`` outputs."""
        self.head = nn.Linear(self.num_features, int(num_classes))
        self.num_classes = int(num_classes)


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` did.

    Attributes:
        path: The checkpoint file.
        loaded: Names of the state-dict entries copied into the model.
        head_loaded: True if the head came from the checkpoint; False if the checkpoint's
            head was absent or had another number of classes and the model's freshly
            initialised head was kept.
    """

    path: Path
    loaded: tuple[str, ...]
    head_loaded: bool


# --------------------------------------------------------------------------- names


def _tv_models() -> list[str]:
    import torchvision

    return list(torchvision.models.list_models(module=torchvision.models))


def available_models(pattern: str = "*") -> list[str]:
    """List model names accepted by :func:`create_model`.

    Args:
        pattern: fnmatch-style filter, e.g. ``"*resnet*"`` (applied to timm names and to
            torchvision names without their prefix).

    Returns:
        ``["mlp", <timm names>..., "tv:<torchvision names>"...]`` matching ``pattern``.
    """
    import fnmatch

    import timm

    tv = [TV_PREFIX + n for n in _tv_models() if fnmatch.fnmatch(n, pattern)]
    return (["mlp"] if fnmatch.fnmatch("mlp", pattern) else []) + list(timm.list_models(pattern)) + tv


def _unknown(name: str, choices: Sequence[str], kind: str) -> ValueError:
    close = difflib.get_close_matches(name, choices, n=5, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ValueError(
        f"unknown {kind} model {name!r}.{hint} Choices: 'mlp', a timm name (timm.list_models(), e.g. "
        f"'resnet101', 'vit_large_patch32_224') or 'tv:' + a torchvision classification model "
        f"(e.g. 'tv:resnet101', 'tv:vit_l_32')."
    )


def check_model_name(name: str, *, pretrained: bool = False, init_checkpoint=None) -> str:
    """The checks of :func:`create_model` that need no weights: the name is known, ``mlp`` is not pretrained.

    Cheap (the registries of timm and torchvision, no model is built): the command line runs it before
    loading data or weights.

    Raises:
        ValueError: for an unknown name (suggesting close matches), or ``mlp`` with ``pretrained`` and no
            ``init_checkpoint``.
    """
    if name == "mlp":
        if pretrained and init_checkpoint is None:
            raise ValueError("the 'mlp' model has no pretrained weights; use pretrained=False or init_checkpoint")
    elif name.startswith(TV_PREFIX):
        names = _tv_models()
        if name[len(TV_PREFIX):] not in names:
            raise _unknown(name, [TV_PREFIX + n for n in names], "torchvision")
    else:
        import timm

        if not timm.is_model(name.split(".", 1)[0]):  # a pretrained tag such as ".a1_in1k" is allowed
            raise _unknown(name, ["mlp", *timm.list_models(), *(TV_PREFIX + n for n in _tv_models())], "timm")
    return name


# --------------------------------------------------------------------------- creation


def create_model(
    name: str,
    num_classes: int,
    *,
    pretrained: bool = False,
    init_checkpoint: str | os.PathLike[str] | None = None,
    in_features: int | None = None,
    hidden_sizes: Sequence[int] = DEFAULT_MLP_HIDDEN,
    dropout: float = 0.0,
    img_size: int | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build a classifier by name with a ``num_classes``-way head.

    The returned model maps a batch ``(B, *input_shape)`` (float32) to logits
    ``(B, num_classes)``.

    Args:
        name: timm model name, ``"tv:<torchvision name>"`` or ``"mlp"`` (see module doc).
        num_classes: Number of classes ``K`` of the new head.
        pretrained: Load pretrained (ImageNet) body weights: timm ``pretrained=True``,
            torchvision ``weights="DEFAULT"``. The head is always new (random init).
            Ignored when ``init_checkpoint`` is given (the checkpoint supplies the
            weights, so nothing is downloaded).
        init_checkpoint: Local weights file (``.safetensors``, or a ``torch.save`` file
            loadable with ``weights_only=True``) loaded as initial weights by
            :func:`load_checkpoint`. Its head is used if its shape matches ``K``
            classes; otherwise (e.g. a 1000-class ImageNet checkpoint) the head stays
            freshly initialised, with a ``UserWarning`` saying so.
        in_features: ``mlp`` only, required: flattened input size (64 for digits).
        hidden_sizes: ``mlp`` only: hidden widths (default :data:`DEFAULT_MLP_HIDDEN`).
        dropout: ``mlp``: dropout after each hidden layer. timm: passed as ``drop_rate``
            (dropout before the head) when > 0. torchvision: the probability of every
            dropout layer of the model (what the builders' ``dropout`` argument sets, for
            VGG, AlexNet, ViT, EfficientNet, MobileNet, ...); a torchvision model without
            dropout layers (ResNet, ...) refuses a ``dropout`` > 0.
        img_size: the input side the model is built for, for the models whose constructor
            takes one: timm's ``img_size`` (ViT, DeiT, Swin, ...: as timm's ``--input-size``;
            pretrained position embeddings are resampled by timm), torchvision's
            ``image_size`` (ViT; its pretrained weights only at their own side). Others
            (CNNs) take any side and ignore it. None or 0: the model's default. Not used by
            ``mlp``.
        **kwargs: Extra keyword arguments for ``timm.create_model`` (e.g. ``img_size=32``,
            ``in_chans=1``) or ``torchvision.models.get_model``. For torchvision models,
            ``in_chans`` (e.g. 1 for gray images) replaces the first 3-channel convolution by one
            with ``in_chans`` channels, its (pretrained) weights summed over the channels as timm's
            ``in_chans`` does (``timm.models.adapt_input_conv``).

    Returns:
        The model, in train mode, on the CPU, float32.

    Raises:
        ValueError: Unknown name (the message suggests close matches), ``mlp`` without
            ``in_features`` or with ``pretrained``, a non-positive ``num_classes``, or a
            ``dropout`` > 0 for a model that has no dropout to set (naming the families that do).
        PretrainedWeightsError: Pretrained weights could not be downloaded; the message
            suggests ``--init-checkpoint``.
        CheckpointError: ``init_checkpoint`` is missing, unreadable or mismatched.
    """
    if int(num_classes) <= 0:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    num_classes = int(num_classes)
    use_pretrained = bool(pretrained) and init_checkpoint is None
    check_model_name(name, pretrained=pretrained, init_checkpoint=init_checkpoint)
    if name == "mlp":
        if in_features is None:
            raise ValueError("the 'mlp' model needs in_features (the flattened input size, 64 for digits)")
        model: nn.Module = MLP(in_features, num_classes, hidden_sizes, dropout)
    elif name.startswith(TV_PREFIX):
        model = _create_torchvision(name[len(TV_PREFIX):], num_classes, use_pretrained, dropout,
                                    {**kwargs, "img_size": img_size})
    else:
        model = _create_timm(name, num_classes, use_pretrained, dropout, {**kwargs, "img_size": img_size})
    if init_checkpoint is not None:
        loaded = load_checkpoint(model, init_checkpoint)
        if not loaded.head_loaded:
            warnings.warn(f"init_checkpoint {str(init_checkpoint)!r} has no {num_classes}-class head (e.g. an ImageNet "
                          f"checkpoint): its body is loaded and the classifier head starts freshly initialised",
                          stacklevel=2)
    return model


def _pretrained_failed(name: str, err: BaseException) -> PretrainedWeightsError:
    return PretrainedWeightsError(
        f"could not load pretrained weights for {name!r}: {type(err).__name__}: {err}. If this machine is "
        f"offline, download the weights elsewhere (a .safetensors or torch state-dict file) and pass "
        f"--init-checkpoint PATH instead of --pretrained, or run with pretrained disabled."
    )


def _create_timm(name: str, num_classes: int, pretrained: bool, dropout: float, kwargs: dict) -> nn.Module:
    import timm

    arch = name.split(".", 1)[0]  # drop a pretrained tag such as ".a1_in1k"
    if not timm.is_model(arch):
        raise _unknown(name, ["mlp", *timm.list_models(), *(TV_PREFIX + n for n in _tv_models())], "timm")
    kwargs = _timm_arguments(name, num_classes, dropout, kwargs)
    if not pretrained:
        return timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs)
    offline = hub_offline()
    try:
        with _hub_offline_mode(offline):  # offline: the local cache only, failing at once instead of retrying
            return timm.create_model(name, pretrained=True, num_classes=num_classes, **kwargs)
    except (OSError, RuntimeError, ValueError) as err:  # huggingface_hub / urllib errors are OSErrors
        if offline:
            err = OSError(f"the Hugging Face Hub is unreachable (HF_HUB_OFFLINE is set, or no connection to "
                          f"{_hub_host()} within {HUB_PROBE_TIMEOUT:g} s) and the weights are not in the local "
                          f"cache ({type(err).__name__}: {err})")
        raise _pretrained_failed(name, err) from None


#: seconds to wait for a TCP connection to the Hub before treating the machine as offline
HUB_PROBE_TIMEOUT = 3.0


def _hub_host() -> str:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    return urlparse(constants.ENDPOINT).hostname or "huggingface.co"


def hub_offline() -> bool:
    """Whether pretrained weights must come from the local cache.

    True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set, or when no
    TCP connection to the Hub opens within :data:`HUB_PROBE_TIMEOUT` seconds
    (without a proxy configured). Without this, ``huggingface_hub`` retries for
    about 50 s before an offline ``--pretrained`` fails.
    """
    import socket

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # the connection goes through a proxy: let huggingface_hub try
    try:
        socket.create_connection((_hub_host(), 443), timeout=HUB_PROBE_TIMEOUT).close()
    except OSError:
        return True
    return False


class _hub_offline_mode:
    """Sets ``huggingface_hub``'s offline flag for the duration of a block (it reads the environment at import)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        if self.enabled:
            from huggingface_hub import constants

            self.saved = constants.HF_HUB_OFFLINE
            constants.HF_HUB_OFFLINE = True

    def __exit__(self, *exc):
        if self.enabled:
            from huggingface_hub import constants

            constants.HF_HUB_OFFLINE = self.saved


def _create_torchvision(arch: str, num_classes: int, pretrained: bool, dropout: float, kwargs: dict) -> nn.Module:
    import torchvision

    names = _tv_models()
    if arch not in names:
        raise _unknown(TV_PREFIX + arch, [TV_PREFIX + n for n in names], "torchvision")
    weights = torchvision.models.get_model_weights(arch).DEFAULT if pretrained else None
    in_chans = kwargs.pop("in_chans", 3)
    kwargs = tv_image_size(arch, weights, kwargs)
    try:
        # Built with its default (ImageNet) head so that pretrained and random models go through
        # the same head replacement below.
        model = torchvision.models.get_model(arch, weights=weights, **kwargs)
    except (OSError, RuntimeError) as err:  # urllib.error.URLError is an OSError
        if not pretrained:
            raise
        raise _pretrained_failed(TV_PREFIX + arch, err) from err
    if dropout > 0:
        set_dropout(model, dropout, TV_PREFIX + arch)
    if in_chans != 3:
        _set_input_channels(model, int(in_chans), TV_PREFIX + arch)
    path, head = find_head(model)
    if head.out_features != num_classes:
        _set_submodule(model, path, nn.Linear(head.in_features, num_classes, bias=head.bias is not None))
    model.pretrained_cfg = _tv_data_config(arch)  # read by timm.data.resolve_data_config
    return model


def tv_image_size(arch: str, weights, kwargs: dict) -> dict:
    """``kwargs`` with the run's ``img_size`` as torchvision's ``image_size`` for a model that takes one (ViT;
    probed on the meta device), and without it for the others.

    Raises:
        ValueError: for pretrained weights made for another side (torchvision cannot resample them).
    """
    import torchvision

    img_size = kwargs.pop("img_size", None)
    if not img_size:
        return kwargs
    try:
        with torch.device("meta"):
            torchvision.models.get_model(arch, image_size=int(img_size), **kwargs)
    except TypeError as err:
        if "image_size" in str(err):
            return kwargs  # a model for any input side (a CNN)
        raise
    side = (weights.meta.get("min_size") or (None,))[0] if weights is not None else None
    if side is not None and side != img_size:
        raise ValueError(f"img_size={img_size}: the pretrained weights of {TV_PREFIX + arch} are for {side} px images "
                         f"(torchvision does not resample them); accepted: img_size 0 or {side} with pretrained, any "
                         f"side without, or a timm ViT (timm resamples the position embeddings)")
    return {"image_size": int(img_size), **kwargs} if weights is None else kwargs


def _set_input_channels(model: nn.Module, in_chans: int, name: str) -> None:
    """Replaces the first convolution with 3 input channels by one with ``in_chans``, its weights adapted as timm's
    ``in_chans`` adapts pretrained ones (``timm.models.adapt_input_conv``: summed over the RGB channels for one).

    Raises:
        ValueError: if the model has no such convolution.
    """
    from timm.models import adapt_input_conv

    for path, conv in model.named_modules():
        if isinstance(conv, nn.Conv2d) and conv.in_channels == 3:
            new = nn.Conv2d(in_chans, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                            conv.groups, conv.bias is not None, conv.padding_mode, device=conv.weight.device,
                            dtype=conv.weight.dtype)
            if conv.weight.device.type != "meta":
                with torch.no_grad():
                    new.weight.copy_(adapt_input_conv(in_chans, conv.weight))
                    if conv.bias is not None:
                        new.bias.copy_(conv.bias)
            _set_submodule(model, path, new)
            return
    raise ValueError(f"model {name!r} has no convolution with 3 input channels to adapt to {in_chans}-channel images; "
                     "accepted: an RGB dataset, or a timm model (in_chans)")


#: what the refusal of ``dropout`` names: the backbones whose dropout it sets
DROPOUT_FAMILIES = ("mlp (after each hidden layer)", "timm models (drop_rate, before the head)",
                    "torchvision models with dropout layers (e.g. tv:vgg11, tv:alexnet, tv:vit_b_16, "
                    "tv:efficientnet_b0, tv:mobilenet_v3_small)")


def set_dropout(model: nn.Module, p: float, name: str = "") -> int:
    """Sets the probability of every dropout layer (``nn.Dropout``, ``nn.Dropout1d/2d/3d``, ``nn.AlphaDropout``)
    of ``model`` to ``p``, as a torchvision builder's ``dropout`` argument does.

    Returns:
        The number of layers set.

    Raises:
        ValueError: if the model has no dropout layer, naming the backbones whose dropout can be set.
    """
    layers = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    if not layers:
        raise ValueError(f"dropout={p!r}: model {name or type(model).__name__!r} has no dropout layer to set; "
                         f"accepted: dropout 0 with this model, or a backbone with dropout: "
                         f"{', '.join(DROPOUT_FAMILIES)}")
    for layer in layers:
        layer.p = float(p)
    return len(layers)


def _timm_arguments(name: str, num_classes: int, dropout: float, kwargs: dict) -> dict:
    """The keyword arguments of ``timm.create_model`` for ``name``: ``drop_rate`` for a dropout > 0, and
    ``img_size`` only for a model whose constructor takes it (probed by building it on the meta device).

    Raises:
        ValueError: for a dropout > 0 that the model's constructor does not take.
    """
    import timm

    img_size = kwargs.pop("img_size", None)
    if dropout > 0:
        kwargs = {"drop_rate": dropout, **kwargs}
    if not img_size and not dropout > 0:
        return kwargs
    with torch.device("meta"):  # no memory, no weights: the constructor's arguments only
        for extra in ({"img_size": int(img_size)} if img_size else {}, {}):
            try:
                timm.create_model(name, pretrained=False, num_classes=num_classes, **kwargs, **extra)
            except TypeError as err:
                if "drop_rate" in str(err):
                    raise ValueError(f"dropout={dropout!r}: timm model {name!r} does not take drop_rate; accepted: "
                                     f"dropout 0 with this model, or a backbone with dropout: "
                                     f"{', '.join(DROPOUT_FAMILIES)}") from None
                if "img_size" in str(err) and extra:
                    continue  # a model for any input size (a CNN)
                raise
            except Exception:  # noqa: BLE001 - anything else is for the real build to report
                return {**kwargs, **extra}
            return {**kwargs, **extra}
    return kwargs


def _tv_data_config(arch: str) -> dict[str, Any]:
    """timm-style data config from the torchvision weights' eval transform."""
    import torchvision

    try:
        tf = torchvision.models.get_model_weights(arch).DEFAULT.transforms()
    except Exception:  # models without weights: timm's defaults
        return {}
    crop, resize = int(tf.crop_size[0]), int(tf.resize_size[0])
    return {
        "input_size": (3, crop, crop),
        "interpolation": str(tf.interpolation.value),
        "mean": tuple(float(m) for m in tf.mean),
        "std": tuple(float(s) for s in tf.std),
        "crop_pct": crop / resize,
        "crop_mode": "center",
    }


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, module)


# --------------------------------------------------------------------------- head


def find_head(model: nn.Module) -> tuple[str, nn.Module]:
    """Locate the classification head of a model.

    timm models and :class:`MLP`: the module returned by ``model.get_classifier()``.
    Other models (torchvision): the first attribute of :data:`TV_HEAD_ATTRS` that the
    model has; the head is that module if it is an ``nn.Linear``, else the last
    ``nn.Linear`` inside it (e.g. ``classifier.6`` for VGG, ``heads.head`` for ViT).

    Args:
        model: The classifier.

    Returns:
        ``(path, module)``: the head's dotted name as in ``model.named_modules()`` and
        the module itself.

    Raises:
        ValueError: No head could be found.
    """
    if hasattr(model, "get_classifier"):
        head = model.get_classifier()
        for path, module in model.named_modules():
            if module is head and path:
                return path, module
        raise ValueError(f"{type(model).__name__}.get_classifier() returned a module that is not a submodule")
    for attr in TV_HEAD_ATTRS:
        container = getattr(model, attr, None)
        if not isinstance(container, nn.Module):
            continue
        if isinstance(container, nn.Linear):
            return attr, container
        linears = [(p, m) for p, m in container.named_modules() if isinstance(m, nn.Linear)]
        if linears:
            path, module = linears[-1]
            return f"{attr}.{path}", module
    raise ValueError(
        f"cannot find the classification head of {type(model).__name__}: it has no get_classifier() and "
        f"no nn.Linear under any of the attributes {TV_HEAD_ATTRS}"
    )


def head_parameter_names(model: nn.Module) -> list[str]:
    """Names of the head's parameters, as in ``model.named_parameters()``.

    Args:
        model: A model from :func:`create_model` (or any model :func:`find_head` handles).

    Returns:
        E.g. ``["fc.weight", "fc.bias"]`` (ResNet), ``["head.weight", "head.bias"]``
        (timm ViT, MLP), ``["heads.head.weight", "heads.head.bias"]`` (torchvision ViT).
        Empty if the head has no parameters (e.g. timm with ``num_classes=0``).

    Raises:
        ValueError: No head could be found.
    """
    path, head = find_head(model)
    return [f"{path}.{n}" for n, _ in head.named_parameters()]


def data_config(model: nn.Module) -> dict[str, Any] | None:
    """The timm data config matching the model's pretrained weights.

    Pass it to :func:`bayeswrap.data.load_data` (``data_config=``) so images are
    resized, cropped and normalised as in pre-training. For torchvision models it is
    derived from the weights' eval transform (crop/resize size, interpolation, mean, std).

    Args:
        model: A model from :func:`create_model`.

    Returns:
        ``timm.data.resolve_data_config({}, model=model)``: a dict with ``input_size``
        ``(C, H, W)``, ``interpolation``, ``mean``, ``std``, ``crop_pct``, ``crop_mode``;
        ``None`` for :class:`MLP` (no image input).
    """
    if isinstance(model, MLP):
        return None
    from timm.data import resolve_data_config

    return dict(resolve_data_config({}, model=model))


# --------------------------------------------------------------------------- checkpoints


def load_state_dict_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read a state dict from a weights file without unpickling arbitrary objects.

    ``*.safetensors`` files are read with ``safetensors.torch.load_file``; any other
    file with ``torch.load(..., map_location="cpu", weights_only=True)``. A dict that
    wraps the weights under ``"state_dict"``, ``"model"`` or ``"model_state_dict"`` is
    unwrapped, and a ``"module."`` prefix (DataParallel) is stripped.

    Args:
        path: The file.

    Returns:
        Mapping from names to tensors (on the CPU).

    Raises:
        CheckpointError: The file is missing, unreadable, not loadable with
            ``weights_only=True``, or holds no tensor mapping. The message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file '{path}' does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            obj: Any = load_file(str(path), device="cpu")
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"checkpoint '{path}' cannot be loaded with weights_only=True (it pickles Python objects); "
            f"save a plain state dict with torch.save(model.state_dict(), path) or use safetensors ({err})"
        ) from err
    except Exception as err:  # corrupt file, wrong format, ...
        raise CheckpointError(f"cannot read checkpoint '{path}': {type(err).__name__}: {err}") from err
    for _ in range(2):  # {"state_dict": {...}} or {"model": {...}}, possibly once nested
        if isinstance(obj, Mapping):
            inner = next((obj[k] for k in ("state_dict", "model", "model_state_dict")
                          if isinstance(obj.get(k), Mapping)), None)
            if inner is not None:
                obj = inner
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"checkpoint '{path}' does not hold a state dict (a non-empty name -> tensor mapping)")
    state = {str(k): v for k, v in obj.items()}
    if all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_checkpoint(model: nn.Module, path: str | os.PathLike[str]) -> LoadedCheckpoint:
    """Load a weights file into ``model`` in place, as its initial weights.

    The body must match exactly (same names and shapes). The head is loaded when the
    checkpoint's head entries match the model's shapes; when they are absent or have a
    different number of classes (e.g. an ImageNet checkpoint for a 37-class task) the
    model's freshly initialised head is kept (``head_loaded=False``).

    Args:
        model: The model to fill (e.g. from :func:`create_model`).
        path: A ``.safetensors`` or ``torch.save`` weights file (see
            :func:`load_state_dict_file`).

    Returns:
        A :class:`LoadedCheckpoint`.

    Raises:
        CheckpointError: The file is unreadable or its body does not match the model
            (the message names the file and lists missing, unexpected and mis-shaped keys).
    """
    path = Path(path)
    state = load_state_dict_file(path)
    target = model.state_dict()
    try:
        head_path, head = find_head(model)
        head_keys = {f"{head_path}.{k}" for k in head.state_dict()}
    except ValueError:
        head_keys = set()
    head_in_ckpt = bool(head_keys) and head_keys <= state.keys()
    head_loaded = head_in_ckpt and all(state[k].shape == target[k].shape for k in head_keys)
    if not head_loaded:
        state = {k: v for k, v in state.items() if k not in head_keys}
        expected = {k for k in target if k not in head_keys}
    else:
        expected = set(target)
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - target.keys())
    shapes = sorted(k for k in state.keys() & target.keys() if state[k].shape != target[k].shape)
    if missing or unexpected or shapes:
        def show(keys: list[str]) -> str:
            return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")

        parts = [f"missing {len(missing)}: {show(missing)}" if missing else "",
                 f"unexpected {len(unexpected)}: {show(unexpected)}" if unexpected else "",
                 "shape mismatch: " + show([f"{k} {tuple(state[k].shape)} vs {tuple(target[k].shape)}"
                                             for k in shapes]) if shapes else ""]
        raise CheckpointError(
            f"checkpoint '{path}' does not match model {type(model).__name__}: "
            + "; ".join(p for p in parts if p)
        )
    model.load_state_dict(state, strict=False)
    return LoadedCheckpoint(path=path, loaded=tuple(sorted(state)), head_loaded=head_loaded)
