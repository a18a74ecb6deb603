"""What the benchmark runs on: the shared settings, its models and data, and the optimizer of plain training.

Every model is built by :func:`bayeswrap.app.backbones.create_model` (timm models, and the built-in ``mlp`` for
the digits) except :func:`small_cnn`, the laplace section's small convolutional network. Each builder seeds the
global generator first, so a model's initial weights do not depend on what ran before it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from bayeswrap.app import experiments as ex
from bayeswrap.app.backbones import create_model

#: N of every wrapped model in the step, curvature and predict sections (its prior's data count).
NUM_DATA = 10_000
#: Classes of the timm models of the step, curvature and predict sections.
NUM_CLASSES = 100
#: The learning rate of plain training and every method in the step section.
LR = 1e-4
#: The prior std of every wrapped model, N(0, 1) per weight.
PRIOR_STD = 1.0
#: Classes of the digits (and of the digits MLP).
DIGITS_CLASSES = 10
#: Classes of the laplace section's models.
LAPLACE_CLASSES = 10


def digits_mlp() -> torch.nn.Module:
    """The 64-100-100-10 ReLU MLP for flattened 8×8 digits (:class:`~bayeswrap.app.backbones.MLP`, head ``head``).

    Returns:
        The model, seeded with ``torch.manual_seed(0)``: inputs ``(B, 64)``, logits ``(B, 10)``.
    """
    torch.manual_seed(0)
    return create_model("mlp", DIGITS_CLASSES, in_features=64, hidden_sizes=(100, 100))


def timm_model(name: str, num_classes: int, img_size: int) -> torch.nn.Module:
    """A freshly initialised timm model (seeded with 0) with ``num_classes`` classes; ViTs built for ``img_size``."""
    kwargs = {"img_size": img_size} if "vit" in name else {}
    torch.manual_seed(0)
    return create_model(name, num_classes, **kwargs)


def make_model(name: str, img_size: int) -> torch.nn.Module:
    """A freshly initialised model: ``"mlp"`` (:func:`digits_mlp`), ``"cnn"`` (:func:`small_cnn`) or a timm model
    with 100 classes.

    Args:
        name: ``"mlp"``, ``"cnn"`` or a timm model name.
        img_size: input side (ViTs are built for it; ignored by the MLP and the CNN, which takes 32×32).
    """
    if name == "mlp":
        return digits_mlp()
    if name == "cnn":
        return small_cnn()
    return timm_model(name, NUM_CLASSES, img_size)


def small_cnn() -> torch.nn.Module:
    """Two 3×3 convolutions (16 and 32 channels), each followed by ReLU and 2×2 max-pooling, and a Linear head:
    3×32×32 images to 10 classes (25,578 parameters).
    """
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict([
        ("conv1", torch.nn.Conv2d(3, 16, 3, padding=1)), ("act1", torch.nn.ReLU()), ("pool1", torch.nn.MaxPool2d(2)),
        ("conv2", torch.nn.Conv2d(16, 32, 3, padding=1)), ("act2", torch.nn.ReLU()), ("pool2", torch.nn.MaxPool2d(2)),
        ("flatten", torch.nn.Flatten()), ("head", torch.nn.Linear(32 * 8 * 8, LAPLACE_CLASSES))]))


def classifier_name(model: torch.nn.Module) -> str:
    """The name of the classifier module (``"fc"`` for ResNets, ``"head"`` for ViTs and the MLP)."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    return cfg.get("classifier", "head")


def batch(name: str, batch_size: int, img_size: int, device: torch.device):
    """A fixed random batch: images (B, 3, H, W) with 100 classes, digits-shaped (B, 64) with 10, or for ``"cnn"``
    images (B, 3, 32, 32) with :data:`LAPLACE_CLASSES`.
    """
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        x = torch.randn(batch_size, 64, generator=g)
        y = torch.randint(0, DIGITS_CLASSES, (batch_size,), generator=g)
    elif name == "cnn":
        x = torch.randn(batch_size, 3, 32, 32, generator=g)
        y = torch.randint(0, LAPLACE_CLASSES, (batch_size,), generator=g)
    else:
        x = torch.randn(batch_size, 3, img_size, img_size, generator=g)
        y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)
    return x.to(device), y.to(device)


def image_data(count: int, size: int, seed: int) -> torch.utils.data.TensorDataset:
    """``count`` random images (3, size, size) with random labels of :data:`LAPLACE_CLASSES` classes."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(count, 3, size, size, generator=g),
                                          torch.randint(0, LAPLACE_CLASSES, (count,), generator=g))


def digits_data(start: int, count: int) -> torch.utils.data.TensorDataset:
    """The digits ``start:start + count`` of sklearn's 1,797 in a fixed shuffled order (pixels / 16), for the MLP.

    Raises:
        ValueError: if fewer than ``count`` digits are left from ``start``.
    """
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[start:start + count]
    if len(perm) < count:
        raise ValueError(f"digits has {len(x)} examples; {start} + {count} were asked for")
    return torch.utils.data.TensorDataset(torch.as_tensor(x, dtype=torch.float32)[perm] / 16.0,
                                          torch.as_tensor(y)[perm])


def digits_loader(num_train: int, batch_size: int):
    """A shuffling DataLoader (seed 0) over the first ``num_train`` digits of :func:`digits_data`'s order."""
    return ex.shuffled_loader(digits_data(0, num_train), batch_size, seed=0)


def sgd(params, lr: float = LR):
    """The optimizer of plain training and of every SGD-trained method: fused SGD with momentum where supported."""
    try:
        return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)
