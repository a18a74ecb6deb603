"""Inputs for ``bayeswrap predict``: an image file, a folder of images, or a ``.npy`` array of model inputs."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bayeswrap.data.datasets import display_name, read_image

__all__ = ["MAX_NPY_VALUES", "load_inputs"]

#: The most values a ``.npy`` input file may hold (2**28, 1 GiB as float32): a file whose header
#: claims more is refused before any of its data is read.
MAX_NPY_VALUES = 2**28

#: why each refused numpy dtype kind is not a model input
_REFUSED_KINDS = {
    "c": "complex numbers (a model input is real)",
    "m": "time spans (timedelta64), not numbers a model reads",
    "M": "dates (datetime64), not numbers a model reads",
    "O": "Python objects (reading them would unpickle, which bayeswrap never does)",
    "S": "byte strings",
    "U": "text strings",
    "V": "structured records or raw bytes",
}


def load_inputs(
    path: str | os.PathLike[str],
    transform: Callable[[Any], torch.Tensor],
    input_shape: Sequence[int],
) -> tuple[torch.Tensor, list[str]]:
    """Read inputs to predict: an image file, a folder of images, or a ``.npy`` array.

    **Images** (every mode PIL opens) are read by
    :func:`bayeswrap.data.datasets.read_image` with their real range: 16-bit pixels
    divided by 65535, float pixels (float TIFF) taken as intensities in [0, 1] (a
    float image outside [0, 1] is refused), palette, alpha (dropped) and CMYK
    converted to RGB; they reach ``transform`` as the 8-bit ``"L"`` (one-channel
    files) or ``"RGB"`` image it reads. An image over PIL's decompression-bomb limit
    (``PIL.Image.MAX_IMAGE_PIXELS``) is refused. File names that are not UTF-8 are
    read, and named with ``\\xNN`` escapes.

    **Arrays** (``.npy``) are checked from their header before any data is read, and
    never unpickled: the dtype must be bool, integer or float (complex, timedelta,
    datetime, object, string and structured arrays are refused, with the reason),
    the array must hold at most :data:`MAX_NPY_VALUES` values, and the file must hold
    all the bytes its header claims. A **uint8** array is taken as 8-bit pixels
    0..255 and divided by 255 (as ``ToTensor`` reads an 8-bit image); every other
    dtype is taken as the values the model sees, converted to float32.

    Args:
        path: an image file (any extension torchvision's ``ImageFolder`` reads), a
            folder searched recursively for such files (sorted by path), or a
            ``.npy`` file of model inputs, shape ``(N, *input_shape)`` (or one input of
            ``input_shape``; any shape with ``prod(input_shape)`` values per input is
            reshaped), already preprocessed as the model sees them (uint8: pixels, see above).
        transform: PIL image (8-bit ``"L"`` or ``"RGB"``) -> float32 tensor of ``input_shape``
            (a run's eval transform).
        input_shape: the shape of one model input.

    Returns:
        ``(inputs, names)``: float32 ``(N, *input_shape)`` and N names (the file paths,
        or ``"<file>[i]"`` for array rows; bytes that are not UTF-8 as ``\\xNN``).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the path, for a folder without images, an unreadable
            image, an image over PIL's decompression-bomb limit, a float image
            outside [0, 1] or an integer one beyond 16 bits, an array whose header
            is not readable or whose dtype is not bool/integer/float, an array of
            more than :data:`MAX_NPY_VALUES` values, a truncated array, an array of
            the wrong size or with non-finite values, or another file type.
    """
    from torchvision.datasets.folder import IMG_EXTENSIONS

    path, shape = Path(path), tuple(int(s) for s in input_shape)
    shown = display_name(path)
    if not path.exists():
        raise FileNotFoundError(f"inputs {shown!r} do not exist; accepted: an image file, a folder of images "
                                f"or a .npy array")
    if path.is_file() and path.suffix.lower() == ".npy":
        x = _load_npy(path, shape)
        return x, [f"{display_name(path.name)}[{i}]" for i in range(len(x))]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS)
        if not files:
            raise ValueError(f"inputs folder {shown!r} holds no image file; accepted extensions: "
                             f"{', '.join(IMG_EXTENSIONS)}")
    elif path.suffix.lower() in IMG_EXTENSIONS:
        files = [path]
    else:
        raise ValueError(f"inputs {shown!r} are not an image file, a folder or a .npy array; accepted image "
                         f"extensions: {', '.join(IMG_EXTENSIONS)}")
    tensors = []
    for file in files:
        x = transform(read_image(file, mode=None))
        tensors.append(torch.as_tensor(x, dtype=torch.float32).reshape(shape))
    return torch.stack(tensors), [display_name(f) for f in files]


def _load_npy(path: Path, shape: tuple[int, ...]) -> torch.Tensor:
    """A ``.npy`` file of model inputs as float32 ``(N, *shape)``, checked from its header first (see load_inputs)."""
    shown = display_name(path)
    per_input = math.prod(shape)
    accepted_shape = f"(N, {', '.join(map(str, shape))}) or N inputs of {per_input} values each"
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                array_shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                array_shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            else:  # 3.0 only adds UTF-8 field names: structured arrays, which are refused anyway
                raise ValueError(f"format version {version[0]}.{version[1]} (written only for structured arrays); "
                                 "accepted: versions 1.0 and 2.0")
            data_bytes = os.fstat(f.fileno()).st_size - f.tell()
    except (ValueError, OSError, EOFError, SyntaxError, TypeError) as err:
        raise ValueError(f"inputs {shown!r} cannot be read as a .npy array ({err})") from None
    if dtype.kind not in "biuf":
        reason = _REFUSED_KINDS.get(dtype.kind, f"dtype kind {dtype.kind!r}")
        raise ValueError(f"inputs {shown!r} hold dtype {dtype}: {reason}; accepted: a numeric array of bool, "
                         "integer or float dtype")
    size = math.prod(array_shape)
    if any(s < 0 for s in array_shape) or size > MAX_NPY_VALUES:
        raise ValueError(f"inputs {shown!r}: the header claims shape {tuple(array_shape)} ({size} values); accepted: "
                         f"at most {MAX_NPY_VALUES} values (bayeswrap.data.inputs.MAX_NPY_VALUES) per file: split the "
                         "inputs over several files")
    if size == 0 or size % per_input or (len(array_shape) >= 1 and array_shape[0] * per_input != size
                                         and size != per_input):
        raise ValueError(f"inputs {shown!r} have shape {tuple(array_shape)}; accepted: {accepted_shape}")
    if data_bytes < size * dtype.itemsize:
        raise ValueError(f"inputs {shown!r} are truncated: the header claims shape {tuple(array_shape)} of {dtype} "
                         f"({size * dtype.itemsize} bytes) but the file holds {data_bytes} bytes of data")
    try:
        arr = np.load(path, allow_pickle=False)  # header already checked: numeric, bounded, complete
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"inputs {shown!r} cannot be read as a .npy array ({err})") from None
    with np.errstate(over="ignore"):  # float64 beyond float32's range becomes inf, refused below
        values = arr.astype(np.float32)
    if arr.dtype == np.uint8:  # 8-bit pixels 0..255, read as ToTensor reads an 8-bit image
        values /= np.float32(255)
    x = torch.from_numpy(values).reshape(-1, *shape)
    if not torch.isfinite(x).all():
        raise ValueError(f"inputs {shown!r} hold NaN or infinite values (or values beyond float32's range); "
                         "accepted: finite numbers")
    return x
