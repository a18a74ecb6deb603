"""Dataset shift (rotation, Gaussian noise) and held-out-class splits for evaluating uncertainty.

The protocol is the one of Ovadia et al. (2019): a model trained on clean data is
scored on test inputs shifted by increasing amounts, here

* ``"rotation"``: the image is rotated counter-clockwise by ``intensity`` degrees
  about its centre (bilinear, zero fill), Ovadia's rotated MNIST on the grid
  :data:`ROTATION_ANGLES` (0 to 180 degrees in steps of 15);
* ``"noise"``: independent Gaussian noise of standard deviation ``intensity`` (in
  pixel units of ``[0, 1]`` images) is added to every pixel and the result clipped to
  ``[0, 1]``, the ``gaussian_noise`` corruption of Hendrycks & Dietterich (2019) used by
  Ovadia et al., on the grid :data:`NOISE_STDS`;
* ``"corruption:<name>"``: Hendrycks & Dietterich's corruption ``<name>`` (one of
  :data:`~bayeswrap.data.corruptions.CORRUPTIONS`) at severity ``intensity`` (0..5;
  0 = clean), Ovadia et al.'s corrupted images (:mod:`bayeswrap.data.corruptions`,
  which needs the optional ``imagecorruptions`` package);

and on out-of-distribution inputs made by holding whole classes out of training
(:func:`hold_out_classes`).

Every shift works in pixel space: inputs are float tensors with values in ``[0, 1]``
laid out as ``(..., C, H, W)``. Flat vectors (digits, mnist5k) are reshaped to their
``DataSplits.image_shape`` first (:class:`ShiftedDataset`); decoded image datasets
(:class:`~bayeswrap.data.TransformSubset`) get the shift inserted into their transform
right before ``Normalize`` (:func:`shifted_transform`). :func:`shifted_dataset` picks the
right one.

Randomness: noise and corruptions are reproducible. :class:`ShiftedDataset` seeds one generator per item
from ``(seed, index)``; the transform path, which never sees the index, seeds it from
``(seed, the bytes of the [0, 1] image tensor)``. Either way an item's noise does not
depend on batching, shuffling, the order of access or DataLoader workers.

Example:
    >>> from bayeswrap.data import load_data
    >>> splits = load_data("mnist5k")
    >>> rotated = shifted_dataset(splits.test, "rotation", 45, image_shape=splits.image_shape)
    >>> in_splits, ood_test = hold_out_classes(splits, [8, 9])
    >>> in_splits.num_classes, sorted(set(ood_test.targets))
    (8, [8, 9])

References:
    Ovadia, Fertig, Ren, Nado, Sculley, Nowozin, Dillon, Lakshminarayanan, Snoek.
    Can You Trust Your Model's Uncertainty? Evaluating Predictive Uncertainty Under
    Dataset Shift. NeurIPS 2019 (rotated MNIST, §4.1; image corruptions, §4.2).
    Hendrycks, Dietterich. Benchmarking Neural Network Robustness to Common
    Corruptions and Perturbations. ICLR 2019 (``gaussian_noise`` corruption).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import numbers
import operator
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2 as T2
from torchvision.transforms.v2 import functional as TF

from bayeswrap.data import corruptions
from bayeswrap.data.datasets import ArrayDataset, DataSplits, TransformSubset, _dataset_targets

__all__ = [
    "NOISE_STDS",
    "ROTATION_ANGLES",
    "SHIFTS",
    "ShiftedDataset",
    "apply_shift",
    "gaussian_noise",
    "hold_out_classes",
    "rotate",
    "shifted_dataset",
    "shifted_transform",
]

SHIFTS: tuple[str, ...] = ("rotation", "noise")
"""Accepted values of ``kind``: ``"rotation"`` (intensity in degrees) and ``"noise"`` (intensity a std), and
``CORRUPTION + name`` for a corruption of :data:`~bayeswrap.data.corruptions.CORRUPTIONS` (intensity a severity)."""

CORRUPTION = "corruption:"
"""Prefix of the corruption kinds: ``"corruption:fog"`` is the ``fog`` corruption."""

ROTATION_ANGLES: tuple[int, ...] = tuple(range(0, 181, 15))
"""Default rotation grid in degrees, ``(0, 15, ..., 180)``: Ovadia et al.'s rotated MNIST."""

NOISE_STDS: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
"""Default Gaussian-noise grid: standard deviations in pixel units of ``[0, 1]`` images."""

_NORMALIZE_TYPES = (T.Normalize, T2.Normalize)
_COMPOSE_TYPES = (T.Compose, T2.Compose)


# --------------------------------------------------------------------------------------------------
# input checking
# --------------------------------------------------------------------------------------------------
def _finite(value: Any, name: str) -> float:
    """``value`` as a float; ValueError unless it is a finite real number (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite real number; got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite; got {value!r}")
    return out


def _check_images(images: Any, min_ndim: int, what: str) -> None:
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"images must be a torch.Tensor; got {type(images).__name__}")
    if not images.dtype.is_floating_point:
        raise ValueError(f"images must have a floating dtype (pixel values in [0, 1]); got dtype {images.dtype}")
    if images.ndim < min_ndim:
        raise ValueError(f"images must have shape {what} (at least {min_ndim} dims); got shape {tuple(images.shape)}")


def _check_kind(kind: Any) -> str:
    if isinstance(kind, str) and kind.startswith(CORRUPTION) and kind[len(CORRUPTION):] in corruptions.CORRUPTIONS:
        return kind
    if kind not in SHIFTS:
        raise ValueError(f"unknown shift kind {kind!r}; choose one of: {', '.join(SHIFTS)}, or {CORRUPTION}<name> "
                         f"with <name> one of {', '.join(corruptions.CORRUPTIONS)}")
    return str(kind)


def _check_intensity(kind: str, intensity: Any) -> float:
    if kind.startswith(CORRUPTION):
        return float(corruptions.check_severity(intensity))
    if kind == "rotation":
        return _finite(intensity, "angle")
    std = _finite(intensity, "std")
    if std < 0:
        raise ValueError(f"std must be >= 0; got {intensity!r}")
    return std


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool):
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    try:
        value = operator.index(seed)
    except TypeError:
        raise ValueError(f"seed must be a non-negative int; got {seed!r} ({type(seed).__name__})") from None
    if value < 0:
        raise ValueError(f"seed must be a non-negative int; got {seed!r}")
    return value


def _check_image_shape(image_shape: Any) -> tuple[int, ...] | None:
    if image_shape is None:
        return None
    try:
        shape = tuple(operator.index(s) for s in image_shape)
    except TypeError:
        raise ValueError(f"image_shape must be a (C, H, W) tuple of positive ints; got {image_shape!r}") from None
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"image_shape must be a (C, H, W) tuple of positive ints; got {image_shape!r}")
    return shape


def _generator(*entropy: int) -> torch.Generator:
    """A CPU generator seeded from non-negative ints through numpy's SeedSequence (well mixed)."""
    state = np.random.SeedSequence([int(e) for e in entropy]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


# --------------------------------------------------------------------------------------------------
# shifts on tensors
# --------------------------------------------------------------------------------------------------
def rotate(images: torch.Tensor, angle: float) -> torch.Tensor:
    """Rotate images counter-clockwise about their centre (bilinear, zero fill, same size).

    Args:
        images: Float tensor of shape ``(..., C, H, W)`` in pixel space (any leading batch
            dims, any device). Parts of the output that come from outside the input are 0.
        angle: Rotation angle in degrees, counter-clockwise (negative: clockwise). A
            multiple of 360 (including 0) returns an exact copy of ``images``; 90 equals
            ``torch.rot90(images, 1, dims=(-2, -1))``.

    Returns:
        Float tensor of the shape, dtype and device of ``images`` (a new tensor).

    Raises:
        ValueError: ``angle`` is not a finite real number, or ``images`` is not a float
            tensor with at least 3 dims.

    Source:
        ``torchvision.transforms.v2.functional.rotate`` with ``InterpolationMode.BILINEAR``;
        Ovadia et al. 2019, §4.1 (rotated MNIST).
    """
    angle = _finite(angle, "angle")
    _check_images(images, 3, "(..., C, H, W)")
    if angle % 360.0 == 0.0 or images.numel() == 0:
        return images.clone()
    return TF.rotate(images, angle, interpolation=InterpolationMode.BILINEAR, expand=False, fill=0.0)


def gaussian_noise(images: torch.Tensor, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Add ``N(0, std**2)`` noise to every pixel and clip to ``[0, 1]``.

    Args:
        images: Float tensor of any shape with pixel values in ``[0, 1]`` (any device).
        std: Noise standard deviation in pixel units of ``[0, 1]`` images; finite, >= 0.
            ``0`` returns an exact copy of ``images`` (no clipping).
        generator: Optional ``torch.Generator`` drawing the noise (on any device; the
            noise is moved to ``images``' device). ``None`` uses the global RNG.

    Returns:
        ``clamp(images + std * eps, 0, 1)`` with ``eps ~ N(0, 1)`` i.i.d. per element, a
        new tensor of the shape, dtype and device of ``images``. The noise is drawn in
        float32 (float64 for float64 images).

    Raises:
        ValueError: ``std`` negative or not a finite real number, or ``images`` not a
            float tensor.

    Source:
        Hendrycks & Dietterich 2019, ``gaussian_noise`` (``np.clip(x + N(0, c**2), 0, 1)``
        on ``[0, 1]`` images), as used by Ovadia et al. 2019, §4.2.
    """
    std = _check_intensity("noise", std)
    _check_images(images, 0, "(...)")
    if std == 0.0:
        return images.clone()
    dtype = torch.float64 if images.dtype == torch.float64 else torch.float32
    device = generator.device if generator is not None else images.device
    eps = torch.randn(images.shape, generator=generator, device=device, dtype=dtype).to(images.device)
    return (images.to(dtype) + std * eps).clamp_(0.0, 1.0).to(images.dtype)


def apply_shift(
    images: torch.Tensor, kind: str, intensity: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Apply the shift ``kind`` of strength ``intensity`` to images in pixel space.

    Args:
        images: Float tensor ``(..., C, H, W)`` with values in ``[0, 1]`` (for
            ``"noise"`` any shape).
        kind: One of :data:`SHIFTS`: ``"rotation"`` (:func:`rotate`) or ``"noise"``
            (:func:`gaussian_noise`), or ``"corruption:<name>"``
            (:func:`bayeswrap.data.corruptions.corrupt`; ``(..., C, H, W)`` with C 1 or 3).
        intensity: Angle in degrees for ``"rotation"``; noise std (pixel units) for ``"noise"``;
            severity 0..5 for a corruption.
        generator: Generator of the noise or of the corruption's per-image seeds; ignored by
            ``"rotation"``.

    Returns:
        The shifted images, same shape, dtype and device (always a new tensor).

    Raises:
        ValueError: Unknown ``kind`` (the message lists :data:`SHIFTS`), or a bad
            ``intensity`` or ``images`` (see :func:`rotate`, :func:`gaussian_noise`).
    """
    kind = _check_kind(kind)
    if kind.startswith(CORRUPTION):
        return corruptions.corrupt(images, kind[len(CORRUPTION):], _check_intensity(kind, intensity), generator)
    if kind == "rotation":
        return rotate(images, intensity)
    return gaussian_noise(images, intensity, generator=generator)


# --------------------------------------------------------------------------------------------------
# shifted datasets
# --------------------------------------------------------------------------------------------------
class ShiftedDataset(Dataset):
    """A shifted view of a dataset of ``[0, 1]`` pixel tensors (e.g. digits / mnist5k splits).

    Item ``i`` is ``(shift(x_i), y_i)``: ``x_i`` (float tensor, flat or image) is reshaped
    to ``image_shape``, shifted by :func:`apply_shift` and reshaped back, so the item keeps
    the shape and dtype of the wrapped one. Noise for item ``i`` comes from a generator
    seeded from ``(seed, i)``: it is the same whatever the batching, order of access or
    DataLoader worker, and different items get independent noise.

    Args:
        dataset: Map-style dataset with items ``(x, y)``: ``x`` a float tensor of pixels
            in ``[0, 1]`` with ``prod(image_shape)`` elements, ``y`` an int.
        kind: One of :data:`SHIFTS`, or ``"corruption:<name>"``.
        intensity: Angle in degrees (``"rotation"``), noise std in pixel units (``"noise"``) or
            severity 0..5 (``"corruption:<name>"``).
        image_shape: ``(C, H, W)`` layout of one ``x`` (``DataSplits.image_shape``), or
            ``None`` if items are already ``(C, H, W)`` images.
        seed: Non-negative int seeding the per-item noise.

    Attributes:
        targets: The labels of ``dataset`` (its own ``targets`` list when it has one).

    Raises:
        ValueError: Unknown ``kind``, bad ``intensity``, ``image_shape`` not three
            positive ints, or a negative / non-integer ``seed``. At item access: an
            ``x`` whose size does not match ``image_shape`` (or that is not a float tensor).
    """

    def __init__(
        self,
        dataset: Dataset,
        kind: str,
        intensity: float,
        image_shape: Sequence[int] | None,
        seed: int = 0,
    ):
        self.kind = _check_kind(kind)
        self.intensity = _check_intensity(self.kind, intensity)
        self.image_shape = _check_image_shape(image_shape)
        self.seed = _check_seed(seed)
        self.dataset = dataset
        targets = getattr(dataset, "targets", None)
        self.targets: list[int] = targets if targets is not None else _dataset_targets(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        n = len(self)
        i = operator.index(idx)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {idx} out of range for a dataset of {n} items")
        x, y = self.dataset[i]
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"ShiftedDataset needs tensor inputs; item {i} holds a {type(x).__name__}")
        shape = self.image_shape if self.image_shape is not None else tuple(x.shape)
        if x.numel() != math.prod(shape):
            raise ValueError(
                f"item {i} has shape {tuple(x.shape)} ({x.numel()} values), which does not fit "
                f"image_shape {shape} ({math.prod(shape)} values)"
            )
        generator = _generator(self.seed, i) if self.kind != "rotation" else None
        out = apply_shift(x.reshape(shape), self.kind, self.intensity, generator=generator)
        return out.reshape(x.shape), y

    def __repr__(self) -> str:
        return (f"ShiftedDataset(kind={self.kind!r}, intensity={self.intensity:g}, "
                f"image_shape={self.image_shape}, seed={self.seed}, n={len(self)})")


class _PixelShift:
    """Transform step shifting one ``[0, 1]`` image tensor ``(C, H, W)``; noise seeded by content."""

    def __init__(self, kind: str, intensity: float, seed: int = 0):
        self.kind = _check_kind(kind)
        self.intensity = _check_intensity(self.kind, intensity)
        self.seed = _check_seed(seed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise ValueError(
                f"the shift step needs a tensor in [0, 1] pixel space but got a {type(x).__name__}; "
                "the transform must convert images to tensors (ToTensor / PILToTensor + ToDtype) "
                "before Normalize or at its end"
            )
        generator = None
        if self.kind != "rotation" and self.intensity > 0:
            raw = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            digest = hashlib.blake2b(raw.tobytes(), digest_size=8).digest()
            generator = _generator(self.seed, int.from_bytes(digest, "little"))
        return apply_shift(x, self.kind, self.intensity, generator=generator)

    def __repr__(self) -> str:
        return f"PixelShift(kind={self.kind!r}, intensity={self.intensity:g}, seed={self.seed})"


def _insert_before_normalize(compose: Any, step: _PixelShift) -> Any | None:
    """A copy of ``compose`` with ``step`` before its first Normalize (depth first), or None."""
    steps = list(compose.transforms)
    for i, t in enumerate(steps):
        if isinstance(t, _NORMALIZE_TYPES):
            return type(compose)([*steps[:i], step, *steps[i:]])
        if isinstance(t, _COMPOSE_TYPES):
            inner = _insert_before_normalize(t, step)
            if inner is not None:
                return type(compose)([*steps[:i], inner, *steps[i + 1:]])
    return None


def shifted_transform(
    transform: Callable[[Any], torch.Tensor] | None, kind: str, intensity: float, seed: int = 0
) -> Callable[[Any], torch.Tensor]:
    """Return a copy of an image transform that applies a shift in ``[0, 1]`` pixel space.

    The shift step is inserted right before the first ``Normalize``
    (``torchvision.transforms.Normalize`` or its ``v2`` twin) found in a ``Compose``
    (also inside nested ``Compose`` s), i.e. after ``ToTensor``, where pixels are in
    ``[0, 1]``; this is where timm's and :func:`bayeswrap.data.build_transforms`' eval
    transforms normalise. With no ``Normalize`` the step is applied after the whole
    transform. ``transform`` itself is not modified.

    Noise is reproducible per image: the generator is seeded from ``(seed, a hash of the
    [0, 1] image tensor's bytes)`` (the transform never sees the dataset index), so an
    image gets the same noise whatever the order, batching or worker, different images
    get independent noise, and identical images get identical noise.

    Args:
        transform: Transform mapping an input (e.g. a PIL image) to a float tensor
            ``(C, H, W)``, a ``Compose`` or any callable; ``None`` means inputs already are
            ``[0, 1]`` tensors.
        kind: One of :data:`SHIFTS`, or ``"corruption:<name>"``.
        intensity: Angle in degrees (``"rotation"``), noise std in pixel units (``"noise"``) or
            severity 0..5 (``"corruption:<name>"``).
        seed: Non-negative int seeding the noise.

    Returns:
        A new transform (a ``Compose`` of the same class as ``transform`` when it is one).

    Raises:
        ValueError: Unknown ``kind``, bad ``intensity`` or ``seed``. When called: the
            value reaching the shift step is not a tensor.
    """
    step = _PixelShift(kind, intensity, seed)
    if transform is None:
        return step
    if isinstance(transform, _NORMALIZE_TYPES):
        return T.Compose([step, transform])
    if isinstance(transform, _COMPOSE_TYPES):
        inserted = _insert_before_normalize(transform, step)
        return inserted if inserted is not None else type(transform)([*transform.transforms, step])
    return T.Compose([transform, step])


def shifted_dataset(
    dataset: Dataset,
    kind: str,
    intensity: float,
    *,
    image_shape: Sequence[int] | None,
    seed: int = 0,
) -> Dataset:
    """A shifted view of a split of :func:`bayeswrap.data.load_data`, whatever its kind.

    Args:
        dataset: A :class:`~bayeswrap.data.TransformSubset` (pets, flowers102,
            imagefolder: the shift goes into its transform, see :func:`shifted_transform`)
            or any dataset of ``[0, 1]`` pixel tensors (digits, mnist5k: wrapped in a
            :class:`ShiftedDataset`).
        kind: One of :data:`SHIFTS`, or ``"corruption:<name>"``.
        intensity: Angle in degrees (``"rotation"``), noise std in pixel units (``"noise"``) or
            severity 0..5 (``"corruption:<name>"``).
        image_shape: ``(C, H, W)`` layout of one input (``DataSplits.image_shape``); unused
            for a ``TransformSubset``.
        seed: Non-negative int seeding the noise.

    Returns:
        For a ``TransformSubset``: a shallow copy sharing its base dataset, indices and
        targets, with the shifted transform (the original is untouched). Otherwise a
        :class:`ShiftedDataset`. Both have ``targets``.

    Raises:
        ValueError: As :class:`ShiftedDataset` / :func:`shifted_transform`.
    """
    if isinstance(dataset, TransformSubset):
        out = copy.copy(dataset)
        out.transform = shifted_transform(dataset.transform, kind, intensity, seed)
        return out
    return ShiftedDataset(dataset, kind, intensity, image_shape, seed)


# --------------------------------------------------------------------------------------------------
# held-out classes
# --------------------------------------------------------------------------------------------------
class _ClassSubset(Dataset):
    """Items ``indices`` of a generic dataset, with labels replaced by ``targets``."""

    def __init__(self, dataset: Dataset, indices: Sequence[int], targets: Sequence[int]):
        self.dataset = dataset
        self.indices = [int(i) for i in indices]
        self.targets: list[int] = [int(t) for t in targets]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, idx: int) -> tuple[Any, int]:
        x, _ = self.dataset[self.indices[idx]]
        return x, self.targets[idx]


def _select(dataset: Dataset, positions: np.ndarray, targets: np.ndarray) -> Dataset:
    """Items at ``positions`` of ``dataset`` with labels ``targets``, without reading any image."""
    if isinstance(dataset, ArrayDataset):
        indices = None if dataset.indices is None else np.asarray(dataset.indices, dtype=np.int64)[positions]
        return ArrayDataset(dataset.inputs[torch.as_tensor(positions, dtype=torch.long)], targets, indices)
    if isinstance(dataset, TransformSubset):
        out = copy.copy(dataset)
        out.indices = np.asarray(dataset.indices, dtype=np.int64)[positions].tolist()
        out.targets = targets.tolist()
        return out
    return _ClassSubset(dataset, positions.tolist(), targets.tolist())


def _check_classes(classes: Any, num_classes: int) -> np.ndarray:
    accepted = f"accepted: distinct ints in [0, {num_classes}), at least one class kept"
    if isinstance(classes, (str, bytes)) or not hasattr(classes, "__iter__"):
        raise ValueError(f"classes must be a sequence of class indices; got {classes!r} ({accepted})")
    values: list[int] = []
    for c in classes:
        if isinstance(c, (bool, np.bool_)) or (isinstance(c, torch.Tensor) and c.dtype == torch.bool):
            raise ValueError(f"classes must hold ints; got {c!r} ({accepted})")
        try:
            values.append(operator.index(c))
        except TypeError:
            raise ValueError(f"classes must hold ints; got {c!r} ({type(c).__name__}; {accepted})") from None
    if not values:
        raise ValueError(f"classes is empty; give at least one class index to hold out ({accepted})")
    out = [v for v in values if not 0 <= v < num_classes]
    if out:
        raise ValueError(f"classes {out} out of range [0, {num_classes}) ({accepted})")
    dup = sorted(v for v, n in Counter(values).items() if n > 1)
    if dup:
        raise ValueError(f"classes contains duplicates {dup} ({accepted})")
    if len(values) >= num_classes:
        raise ValueError(f"classes {sorted(values)} holds out all {num_classes} classes; keep at least one "
                         f"({accepted})")
    return np.asarray(sorted(values), dtype=np.int64)


def _targets_array(dataset: Dataset, split: str, num_classes: int) -> np.ndarray:
    y = np.asarray(_dataset_targets(dataset), dtype=np.int64).reshape(-1)
    bad = (y < 0) | (y >= num_classes)
    if bad.any():
        raise ValueError(f"{split} split has label {int(y[bad][0])} outside [0, {num_classes}) "
                         f"(num_classes = {num_classes})")
    return y


def hold_out_classes(splits: DataSplits, classes: Sequence[int]) -> tuple[DataSplits, Dataset]:
    """Hold whole classes out of a dataset: in-distribution splits and an OOD test set.

    Train a model on ``in_splits`` (the kept ``K'`` classes) and score how well its
    uncertainty separates ``in_splits.test`` from ``ood_test`` (examples of classes it
    never saw). Only labels are read (``targets``); no image is decoded.

    Args:
        splits: The :class:`~bayeswrap.data.DataSplits` of a dataset with ``K =
            splits.num_classes`` classes. Splits may be
            :class:`~bayeswrap.data.ArrayDataset`, :class:`~bayeswrap.data.TransformSubset`
            or any dataset with ``targets`` (others are read item by item for labels).
        classes: Class indices to hold out: distinct ints in ``[0, K)``, at least one,
            and fewer than ``K`` (at least one class is kept).

    Returns:
        ``(in_splits, ood_test)``. ``in_splits`` is a new ``DataSplits`` (same name,
        shapes and transforms) whose train/val/test hold only the kept classes, with
        labels remapped to ``0..K'-1`` in increasing order of the original label,
        ``num_classes = K'`` and ``class_names`` filtered the same way (empty if
        ``splits.class_names`` does not have ``K`` entries). ``ood_test`` holds the test
        examples of the held-out classes, in test order, with their original labels.
        Datasets of the same type as the input splits (a generic wrapper otherwise),
        each with a ``targets`` list; the input splits are not modified.

    Raises:
        ValueError: ``classes`` not a sequence of ints, empty, with values outside
            ``[0, K)`` or duplicates, or holding out every class (the message names the
            values and the accepted range); a split label outside ``[0, K)``; or no test
            example of the held-out classes (empty OOD set).
    """
    num_classes = int(splits.num_classes)
    held = _check_classes(classes, num_classes)
    kept = np.setdiff1d(np.arange(num_classes), held)
    new_label = np.full(num_classes, -1, dtype=np.int64)
    new_label[kept] = np.arange(len(kept))

    def keep(dataset: Dataset, split: str) -> Dataset:
        y = _targets_array(dataset, split, num_classes)
        positions = np.flatnonzero(~np.isin(y, held))
        return _select(dataset, positions, new_label[y[positions]])

    test_y = _targets_array(splits.test, "test", num_classes)
    ood_positions = np.flatnonzero(np.isin(test_y, held))
    if len(ood_positions) == 0:
        raise ValueError(f"the test split has no example of the held-out classes {held.tolist()}; "
                         "the OOD test set would be empty")
    names = list(splits.class_names)
    in_splits = dataclasses.replace(
        splits,
        train=keep(splits.train, "train"),
        val=keep(splits.val, "val"),
        test=keep(splits.test, "test"),
        num_classes=len(kept),
        class_names=[names[k] for k in kept] if len(names) == num_classes else [],
    )
    ood_test = _select(splits.test, ood_positions, test_y[ood_positions])
    return in_splits, ood_test
