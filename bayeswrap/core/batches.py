"""Batch structure and input checks shared by training, prediction and every method.

A loader batch is an ``(inputs, targets)`` pair; inputs are a tensor or a tuple of
positional tensors. These helpers take a batch apart, check that floating inputs
are finite, and find the device inputs live on.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["batch_pair", "check_inputs_finite", "x_device"]


def batch_pair(batch, where: str = "the loader"):
    """``(inputs, targets)`` of one loader batch, or a ValueError saying what the batch was.

    Args:
        batch: one item yielded by a loader.
        where: how to name the loader and batch in the message, e.g. ``"train_loader batch 3"``.

    Raises:
        ValueError: unless ``batch`` is a pair (tuple or list of length 2).
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        got = f"a {type(batch).__name__} with keys {list(batch)[:8]}"
    elif isinstance(batch, (tuple, list)):
        got = f"a {type(batch).__name__} of length {len(batch)}"
    elif isinstance(batch, torch.Tensor):
        got = f"a single tensor of shape {tuple(batch.shape)}"
    else:
        got = f"a {type(batch).__name__}"
    raise ValueError(f"{where} yielded {got}; accepted: (inputs, targets) pairs, e.g. a DataLoader over a "
                     "TensorDataset(x, y) or a list of (x, y) tuples (wrap other loaders so they yield pairs)")


def check_inputs_finite(x, name: str = "x") -> None:
    """Raises ValueError if a floating input tensor (or one of a tuple of inputs) holds a NaN or an infinity.

    One ``torch.isfinite(x).all()`` per floating tensor (one device sync); non-tensor inputs are not inspected.

    Args:
        x: a model input, or a tuple/list of positional inputs.
        name: how the message names the input.

    Raises:
        ValueError: naming the input, its shape and the number of non-finite values.
    """
    parts = x if isinstance(x, (tuple, list)) else (x,)
    for i, t in enumerate(parts):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta and t.numel() \
                and not bool(torch.isfinite(t).all()):
            label = name if len(parts) == 1 and not isinstance(x, (tuple, list)) else f"{name}[{i}]"
            count = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{label} (shape {tuple(t.shape)}) contains {count} non-finite values (NaN or inf); "
                             "accepted: finite inputs")


def x_device(x) -> torch.device:
    """The device of a model input (a tensor, or the first tensor of a tuple of inputs)."""
    if isinstance(x, torch.Tensor):
        return x.device
    return next(t.device for t in x if isinstance(t, torch.Tensor))
