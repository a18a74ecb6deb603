"""Helpers shared by the experiment scripts that the package does not offer publicly.

What the scripts share with the application (parsers, optimizers, seeded subsets and loaders, scores) lives in
:mod:`bayeswrap.app.experiments`; this module holds the rest.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import TensorDataset

from bayeswrap.app import experiments as ex

__all__ = ["new_figure", "tensor_dataset"]


def new_figure(**kwargs: Any):
    """A bare :class:`matplotlib.figure.Figure` on the Agg canvas: nothing registered with ``pyplot``.

    Local workaround: :mod:`bayeswrap.evaluation.plots` builds its figures this way with a private helper; once
    the package exports one, the scripts should use it instead.

    Args:
        **kwargs: passed to ``Figure`` (e.g. ``figsize=(6, 4)``, ``layout="constrained"``).

    Returns:
        The figure, ready for :func:`bayeswrap.evaluation.plots.save_figure`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


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
