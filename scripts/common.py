"""Helpers shared by the experiment scripts that the package does not offer publicly (``new_figure`` is re-exported
from :mod:`bayeswrap.evaluation.plots`).

What the scripts share with the application (parsers, optimizers, seeded subsets and loaders, scores) lives in
:mod:`bayeswrap.app.experiments`; this module holds the rest.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import TensorDataset

from bayeswrap.app import experiments as ex
from bayeswrap.evaluation.plots import new_figure

__all__ = ["new_figure", "tensor_dataset"]


def tensor_dataset(split: Any, limit: int | None = None, seed: int = 0) -> TensorDataset:
    """One split of :func:`bayeswrap.data.load_data` as a :class:`~torch.utils.data.TensorDataset`.

    Args:
        split: a split (``.inputs``, ``.targets``), e.g. ``splits.train``.
        limit: keep the first ``limit`` items of a seeded permutation (:func:`bayeswrap.app.experiments.seeded_subset`);
            ``None`` keeps every item in its order.
        seed: seeds that permutation.

    Returns:
        ``TensorDataset(x, y)``: float32 inputs ``(N, ...)`` and int64 labels ``(N,)``.
    """
    return TensorDataset(*ex.split_tensors(split, limit, seed))
