"""Inputs for ``bayeswrap predict``: an image file, a folder of images, or a ``.npy`` array of model inputs."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["load_inputs"]


def load_inputs(
    path: str | os.PathLike[str],
    transform: Callable[[Any], torch.Tensor],
    input_shape: Sequence[int],
) -> tuple[torch.Tensor, list[str]]:
    """Read inputs to predict: an image file, a folder of images, or a ``.npy`` array.

    Args:
        path: an image file (any extension torchvision's ``ImageFolder`` reads), a
            folder searched recursively for such files (sorted by path), or a
            ``.npy`` file of model inputs, shape ``(N, *input_shape)`` (or one input of
            ``input_shape``; any shape with ``prod(input_shape)`` values per input is
            reshaped), already preprocessed as the model sees them.
        transform: PIL image -> float32 tensor of ``input_shape`` (a run's eval transform).
        input_shape: the shape of one model input.

    Returns:
        ``(inputs, names)``: float32 ``(N, *input_shape)`` and N names (the file paths,
        or ``"<file>[i]"`` for array rows).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the path, for a folder without images, an unreadable
            image, an array that is not numeric, has the wrong size or holds
            non-finite values, or another file type.
    """
    from PIL import Image, UnidentifiedImageError
    from torchvision.datasets.folder import IMG_EXTENSIONS

    path, shape = Path(path), tuple(int(s) for s in input_shape)
    per_input = int(np.prod(shape))
    if not path.exists():
        raise FileNotFoundError(f"inputs {str(path)!r} do not exist; accepted: an image file, a folder of images "
                                f"or a .npy array")
    if path.is_file() and path.suffix.lower() == ".npy":
        try:
            arr = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise ValueError(f"inputs {str(path)!r} cannot be read as a .npy array ({err})") from None
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise ValueError(f"inputs {str(path)!r} hold dtype {arr.dtype}; accepted: a numeric array")
        if arr.size == 0 or arr.size % per_input or (arr.ndim >= 1 and arr.shape[0] * per_input != arr.size
                                                     and arr.size != per_input):
            raise ValueError(f"inputs {str(path)!r} have shape {arr.shape}; accepted: (N, {', '.join(map(str, shape))})"
                             f" or N inputs of {per_input} values each")
        x = torch.as_tensor(arr.astype(np.float32)).reshape(-1, *shape)
        if not torch.isfinite(x).all():
            raise ValueError(f"inputs {str(path)!r} hold NaN or infinite values; accepted: finite numbers")
        return x, [f"{path.name}[{i}]" for i in range(len(x))]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMG_EXTENSIONS)
        if not files:
            raise ValueError(f"inputs folder {str(path)!r} holds no image file; accepted extensions: "
                             f"{', '.join(IMG_EXTENSIONS)}")
    elif path.suffix.lower() in IMG_EXTENSIONS:
        files = [path]
    else:
        raise ValueError(f"inputs {str(path)!r} are not an image file, a folder or a .npy array; accepted image "
                         f"extensions: {', '.join(IMG_EXTENSIONS)}")
    tensors = []
    for file in files:
        try:
            with Image.open(file) as image:
                image.load()
                x = transform(image)
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"image {str(file)!r} cannot be read ({err})") from None
        tensors.append(torch.as_tensor(x, dtype=torch.float32).reshape(shape))
    return torch.stack(tensors), [str(f) for f in files]
