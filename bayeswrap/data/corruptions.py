"""The 15 image corruptions of Hendrycks & Dietterich (2019) at severities 1 to 5, for the shift protocol.

Ovadia et al. (2019, §4.2) score a model trained on clean images on the test set
corrupted by each of the 15 corruptions of ImageNet-C / CIFAR-10-C at 5 severities, and
report per-corruption curves and their mean against severity. The corruptions are those
of the ``imagecorruptions`` package (Michaelis et al. 2019), which implements Hendrycks &
Dietterich's code for images of any size; it is an optional dependency, imported only
when a corruption is applied (``pip install "bayeswrap[corruptions]"``):

* noise: ``gaussian_noise``, ``shot_noise``, ``impulse_noise``;
* blur: ``defocus_blur``, ``glass_blur``, ``motion_blur``, ``zoom_blur``;
* weather: ``snow``, ``frost``, ``fog``, ``brightness``;
* digital: ``contrast``, ``elastic_transform``, ``pixelate``, ``jpeg_compression``.

:func:`corrupt_array` corrupts one 8-bit image (the library's own format);
:func:`corrupt` corrupts ``[0, 1]`` float tensors ``(..., C, H, W)`` image by image (the
library works on one image at a time, so there is no vectorised form). In the
shift protocol a corruption is the shift kind ``"corruption:<name>"`` of
:func:`bayeswrap.data.shift.shifted_dataset`, with the severity as its intensity.

Conventions:

* Pixels are quantised to 8 bits (``round(255 x)``) before the corruption and the
  result is ``uint8 / 255``: corrupted images lie on the 8-bit grid, as ImageNet-C does.
  Severity 0 is the clean image, returned unchanged (no quantisation).
* Grayscale images (C = 1) are corrupted as RGB images with three equal channels and
  converted back with PIL's ``convert("L")`` (ITU-R 601-2 luma,
  ``L = 0.299 R + 0.587 G + 0.114 B``; equal channels give back the same value).
* The library needs images of at least :data:`MIN_SIDE` = 32 pixels a side (frost crops
  stored 32+ pixel textures, motion and zoom blur use kernels of up to 41 pixels). A
  smaller image (8x8 digits, 28x28 MNIST) is upsampled with PIL's bilinear filter so
  that its shorter side is 32, corrupted, and resized back (PIL's antialiased bilinear);
  the round trip alone changes a clean image slightly (a mild blur).

Cost: most corruptions take milliseconds per 224x224 image on one CPU core, but the library's
``glass_blur`` shuffles pixels in a Python loop, about 1 to 2.5 s per 224x224 image (0.1 s at
32x32): on a test set of thousands of large images, leave it out or expect hours.

Randomness: 9 of the 15 corruptions (the three noises, glass and motion blur, snow, frost,
fog, elastic transform) draw random numbers, from numpy's global RNG. :func:`corrupt_array`
seeds it with ``np.random.seed(seed)`` for the call and restores the previous state after
it, under a lock, so the global state is left as it was and the result is a function of
``(image, name, severity, seed)``. :func:`corrupt` draws one 63-bit integer per image from
a ``torch.Generator`` and seeds each image with ``SeedSequence([draw, position of name in
CORRUPTIONS])``: the same generator gives the same draws at every severity (common random
numbers: the severity curve of an image is not blurred by fresh noise at each step), and
different corruptions get independent streams. :mod:`bayeswrap.data.shift` seeds that
generator per ``(seed, image index)`` (or per image content on the transform path).

Compatibility: ``imagecorruptions`` 1.1.2 (the latest release) predates numpy 2 and
scikit-image 0.19's ``channel_axis``; three of its functions fail or are not
reproducible on current versions. :func:`corrupt_array` fixes them for the duration of
the call only, by swapping names in the ``imagecorruptions.corruptions`` module (never in
numpy or scikit-image themselves), and only for the corruption that needs it:

* ``glass_blur``: ``skimage.filters.gaussian(..., multichannel=True)`` became
  ``channel_axis=-1`` (scikit-image 0.19 deprecated, later releases removed it); the
  call is translated exactly as scikit-image's own deprecation shim did.
* ``fog``: ``np.float_`` (removed in numpy 2) is provided as ``np.float64``, the type
  it always named.
* ``impulse_noise``: ``skimage.util.random_noise`` draws from a fresh
  ``np.random.default_rng()`` (since scikit-image 0.19), ignoring the global seed; it is
  given ``rng=`` an integer drawn from the seeded global RNG, so the salt-and-pepper
  pattern is reproducible (same distribution, amount ``c`` of the severity).

Example:
    >>> import torch
    >>> images = torch.rand(4, 3, 32, 32)
    >>> out = corrupt(images, "fog", 3, generator=torch.Generator().manual_seed(0))
    >>> out.shape, out.dtype
    (torch.Size([4, 3, 32, 32]), torch.float32)

References:
    Hendrycks, Dietterich. Benchmarking Neural Network Robustness to Common Corruptions
    and Perturbations. ICLR 2019 (the 15 corruptions and their 5 severities, §3, Fig. 1).
    Ovadia et al. Can You Trust Your Model's Uncertainty? Evaluating Predictive
    Uncertainty Under Dataset Shift. NeurIPS 2019, §4.2 (the protocol).
    Michaelis et al. Benchmarking Robustness in Object Detection: Autonomous Driving
    when Winter is Coming. 2019 (the ``imagecorruptions`` package).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from bayeswrap.core.checks import check_int

__all__ = ["CORRUPTIONS", "INSTALL_HINT", "MIN_SIDE", "SEVERITIES", "check_corruption", "check_severity",
           "corrupt", "corrupt_array", "corruption_names", "require_library"]

CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise", "shot_noise", "impulse_noise",
    "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness",
    "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
"""Hendrycks & Dietterich's 15 corruptions, in their order (noise, blur, weather, digital)."""

SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)
"""The severities of every corruption (0 is the clean image)."""

MIN_SIDE = 32
"""The smallest image side ``imagecorruptions`` accepts; smaller images are resized around the corruption."""

INSTALL_HINT = 'pip install "bayeswrap[corruptions]"'
"""How to install the optional dependency."""

_LOCK = threading.RLock()  # numpy's global RNG and the library's module names are shared state


# --------------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------------
def check_corruption(name: Any) -> str:
    """``name`` if it is one of :data:`CORRUPTIONS`, else a ValueError listing them."""
    if not isinstance(name, str) or name not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {name!r}; accepted: {', '.join(CORRUPTIONS)}")
    return name


def check_severity(severity: Any) -> int:
    """``severity`` as an int in ``0..5`` (0 = clean); integral floats are accepted, bools are not.

    Raises:
        ValueError: naming the value and the accepted ones.
    """
    accepted = "an integer in 0..5 (0 = clean, 1..5 the severities of Hendrycks & Dietterich 2019)"
    if isinstance(severity, bool) or not isinstance(severity, numbers.Real):
        raise ValueError(f"severity={severity!r} is not valid; accepted: {accepted}")
    value = float(severity)
    if not (math.isfinite(value) and value.is_integer() and 0 <= value <= 5):
        raise ValueError(f"severity={severity!r} is not valid; accepted: {accepted}")
    return int(value)


def corruption_names(spec: str | Sequence[str]) -> tuple[str, ...]:
    """The corruptions a run asks for: ``"all"`` (the 15), a comma-separated list, or none.

    Args:
        spec: ``"all"``, ``""`` / ``"none"`` (no corruption), names separated by commas
            (``"fog,contrast"``), or a sequence of names.

    Returns:
        The names, in the order given (``"all"``: :data:`CORRUPTIONS`' order).

    Raises:
        ValueError: an unknown or repeated name (the message lists :data:`CORRUPTIONS`).
    """
    items = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    items = [s for s in items if s]
    if items in ([], ["none"]):
        return ()
    if items == ["all"]:
        return CORRUPTIONS
    accepted = f"all, none, or comma-separated names from: {', '.join(CORRUPTIONS)}"
    unknown = [s for s in items if s not in CORRUPTIONS]
    if unknown:
        raise ValueError(f"shift_corruptions={spec!r}: unknown corruption {', '.join(map(repr, unknown))}; "
                         f"accepted: {accepted}")
    repeated = sorted({s for s in items if items.count(s) > 1})
    if repeated:
        raise ValueError(f"shift_corruptions={spec!r} names {', '.join(repeated)} more than once; accepted: {accepted}")
    return tuple(items)


def require_library() -> Any:
    """The ``imagecorruptions`` package, imported on first use.

    Its import-time warnings (``pkg_resources`` and ``scipy.ndimage.interpolation``
    deprecations, which a user cannot act on) are silenced.

    Raises:
        ImportError: the package (or the ``pkg_resources`` it imports, which setuptools
            81 removed) is missing; the message names ``pip install "bayeswrap[corruptions]"``.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"pkg_resources is deprecated", category=UserWarning)
            warnings.filterwarnings("ignore", message=r".*scipy\.ndimage\.interpolation", category=DeprecationWarning)
            import imagecorruptions
            import imagecorruptions.corruptions  # noqa: F401  (the module whose names are adapted)
    except ImportError as err:
        raise ImportError(f"the image corruptions need the imagecorruptions package and setuptools < 81 "
                          f"({err}); install them with: {INSTALL_HINT}") from err
    return imagecorruptions


# --------------------------------------------------------------------------------------------------
# compatibility of imagecorruptions 1.1.2 with numpy 2 and scikit-image >= 0.19
# --------------------------------------------------------------------------------------------------
class _Overlay:
    """A stand-in for a module: the given attributes replaced, every other one read from the module."""

    def __init__(self, module: Any, **attributes: Any):
        self._module = module
        self.__dict__.update(attributes)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._module, attribute)


def _gaussian_with_multichannel(gaussian: Any) -> Any:
    """The ``gaussian`` of scikit-image, accepting the removed ``multichannel`` flag (True = ``channel_axis=-1``)."""

    @functools.wraps(gaussian)
    def wrapped(image: Any, *args: Any, multichannel: bool | None = None, **kwargs: Any) -> Any:
        if multichannel is not None:
            kwargs["channel_axis"] = -1 if multichannel else None
        return gaussian(image, *args, **kwargs)

    return wrapped


def _random_noise_from_global_rng(random_noise: Any) -> Any:
    """The ``random_noise`` of scikit-image, drawing its generator's seed from numpy's (seeded) global RNG."""

    @functools.wraps(random_noise)
    def wrapped(image: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rng") is None:
            kwargs["rng"] = int(np.random.randint(0, 2**31 - 1))
        return random_noise(image, *args, **kwargs)

    return wrapped


def _adaptations(module: Any, name: str) -> dict[str, Any]:
    """The names of ``imagecorruptions.corruptions`` to swap while corruption ``name`` runs."""
    out: dict[str, Any] = {}
    if name == "glass_blur" and "multichannel" not in inspect.signature(module.gaussian).parameters:
        out["gaussian"] = _gaussian_with_multichannel(module.gaussian)
    if name == "fog" and "float_" not in dir(np):
        out["np"] = _Overlay(np, float_=np.float64)
    if name == "impulse_noise" and "rng" in inspect.signature(module.sk.util.random_noise).parameters:
        out["sk"] = _Overlay(module.sk, util=_Overlay(module.sk.util, random_noise=_random_noise_from_global_rng(
            module.sk.util.random_noise)))
    return out


@contextlib.contextmanager
def _adapted(module: Any, name: str, seed: int) -> Iterator[None]:
    """Seed numpy's global RNG and swap the names of :func:`_adaptations`; restore both on exit."""
    with _LOCK:
        swaps = _adaptations(module, name)
        saved = {k: getattr(module, k) for k in swaps}
        state = np.random.get_state()
        try:
            for k, v in swaps.items():
                setattr(module, k, v)
            np.random.seed(seed)
            yield
        finally:
            np.random.set_state(state)
            for k, v in saved.items():
                setattr(module, k, v)


# --------------------------------------------------------------------------------------------------
# corruptions
# --------------------------------------------------------------------------------------------------
def corrupt_array(image: np.ndarray, name: str, severity: int, seed: int = 0) -> np.ndarray:
    """Corrupt one 8-bit image with ``imagecorruptions`` (any size, gray or RGB, reproducibly).

    Args:
        image: ``uint8`` array ``(H, W)``, ``(H, W, 1)`` (gray) or ``(H, W, 3)`` (RGB), any
            ``H, W >= 1``. Gray images are corrupted as three equal channels and converted
            back to gray (ITU-R 601-2 luma); images with a side below :data:`MIN_SIDE` are
            bilinearly upsampled to a shorter side of 32 and resized back afterwards.
        name: One of :data:`CORRUPTIONS`.
        severity: ``0..5``; 0 returns a copy of ``image``.
        seed: Integer in ``[0, 2^32 - 1]``: numpy's global RNG is seeded with
            ``np.random.seed(seed)`` for the call (as a user of the library would) and its
            previous state restored afterwards.

    Returns:
        ``uint8`` array of the shape of ``image``: ``imagecorruptions.corrupt(image,
        severity, corruption_name=name)`` under the compatibility fixes of the module
        docstring.

    Raises:
        ValueError: ``image`` not a uint8 array of one of those shapes, or an unknown
            ``name``, a bad ``severity`` or ``seed`` (each message lists the accepted values).
        ImportError: ``imagecorruptions`` is not installed (see :func:`require_library`).

    Source:
        Hendrycks & Dietterich 2019 (§3), through ``imagecorruptions.corrupt``.
    """
    name, severity, seed = check_corruption(name), check_severity(severity), check_int("seed", seed, minimum=0, maximum=2**32 - 1, note="numpy's seed range")
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        got = f"dtype {image.dtype}" if isinstance(image, np.ndarray) else type(image).__name__
        raise ValueError(f"image must be a uint8 numpy array; got {got}")
    gray = image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 1)
    if not (gray or (image.ndim == 3 and image.shape[2] == 3)) or 0 in image.shape:
        raise ValueError(f"image has shape {image.shape}; accepted: (H, W), (H, W, 1) or (H, W, 3) with H, W >= 1")
    if severity == 0:
        return image.copy()
    library = require_library()
    height, width = image.shape[:2]
    rgb = np.repeat(image.reshape(height, width, 1), 3, axis=2) if gray else image
    small = min(height, width) < MIN_SIDE
    if small:
        scale = MIN_SIDE / min(height, width)
        size = (max(MIN_SIDE, math.ceil(width * scale)), max(MIN_SIDE, math.ceil(height * scale)))
        rgb = np.asarray(Image.fromarray(rgb).resize(size, Image.BILINEAR))
    with _adapted(library.corruptions, name, seed):
        out = library.corrupt(np.ascontiguousarray(rgb), severity=severity, corruption_name=name)
    picture = Image.fromarray(np.asarray(out, dtype=np.uint8))
    if small:
        picture = picture.resize((width, height), Image.BILINEAR)
    if gray:
        return np.asarray(picture.convert("L")).reshape(image.shape)
    return np.asarray(picture.convert("RGB"))


def _image_seed(draw: int, name: str) -> int:
    """The numpy seed of one image: ``SeedSequence([draw, position of name])``'s first 32-bit word."""
    return int(np.random.SeedSequence([draw, CORRUPTIONS.index(name)]).generate_state(1)[0])


def corrupt(images: torch.Tensor, name: str, severity: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Corrupt ``[0, 1]`` images with Hendrycks & Dietterich's corruption ``name`` at ``severity``.

    Each image is quantised to 8 bits, corrupted by :func:`corrupt_array` with its own
    seed and scaled back to ``[0, 1]``. The seeds are one 63-bit draw per image from
    ``generator`` (in the row-major order of the leading dims), mixed with the
    corruption's position in :data:`CORRUPTIONS` (see the module docstring).

    Args:
        images: Float tensor ``(..., C, H, W)`` with ``C`` 1 or 3 and finite values in
            ``[0, 1]`` (pixel space, before any ``Normalize``), on any device.
        name: One of :data:`CORRUPTIONS`.
        severity: ``0..5``; 0 returns an exact copy of ``images``.
        generator: ``torch.Generator`` (any device) drawing the per-image seeds; ``None``
            uses torch's global RNG.

    Returns:
        Tensor of the shape, dtype and device of ``images``, with values ``k / 255``.

    Raises:
        ValueError: unknown ``name`` or bad ``severity`` (the messages list the accepted
            values); ``images`` not a float tensor ``(..., C, H, W)`` with ``C`` in {1, 3},
            or with values outside ``[0, 1]`` or not finite (the message gives the range).
        ImportError: ``imagecorruptions`` is not installed (see :func:`require_library`).

    Source:
        Hendrycks & Dietterich 2019, §3; Ovadia et al. 2019, §4.2.
    """
    name, severity = check_corruption(name), check_severity(severity)
    if not isinstance(images, torch.Tensor) or not images.dtype.is_floating_point:
        got = f"dtype {images.dtype}" if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a float torch.Tensor (..., C, H, W) in [0, 1]; got {got}")
    if images.ndim < 3 or images.shape[-3] not in (1, 3):
        raise ValueError(f"images must have shape (..., C, H, W) with C = 1 (gray) or 3 (RGB); got shape "
                         f"{tuple(images.shape)}")
    if severity == 0 or images.numel() == 0:
        return images.clone()
    pixels = images.detach().to("cpu", torch.float64)
    low, high = float(pixels.min()), float(pixels.max())
    if not (math.isfinite(low) and math.isfinite(high) and low >= -1e-6 and high <= 1 + 1e-6):
        raise ValueError(f"images must hold finite pixel values in [0, 1] (corrupt before Normalize); got values "
                         f"in [{low:g}, {high:g}]")
    c, h, w = images.shape[-3:]
    flat = (pixels.reshape(-1, c, h, w).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    device = generator.device if generator is not None else "cpu"
    draws = torch.randint(0, 2**63 - 1, (len(flat),), generator=generator, device=device).tolist()
    out = np.stack([corrupt_array(image, name, severity, _image_seed(draw, name)) for image, draw in zip(flat, draws)])
    result = torch.from_numpy(out).permute(0, 3, 1, 2).to(torch.float64) / 255.0
    return result.reshape(images.shape).to(device=images.device, dtype=images.dtype)
