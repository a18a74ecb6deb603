"""Calibration figures: reliability diagrams and temperature-scaling curves.

Figures are built as bare :class:`matplotlib.figure.Figure` objects rendered by
the Agg canvas: nothing is registered with ``pyplot`` (so no figure is left
open, ``plt.get_fignums()`` is unchanged), the global backend is never
switched, and ``plt.show()`` is never called. Files are written atomically: to
a temporary file in the destination folder, then ``os.replace``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .evaluation import calibration as cal
from .io import atomic_write

__all__ = ["reliability_diagram", "temperature_curve", "training_curves", "image_grid", "save_figure"]

_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}


def _new_figure(**kwargs: Any):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 150) -> str:
    """Writes ``fig`` to ``path`` atomically (temp file in the same folder, then ``os.replace``).

    The format follows the suffix (``.png``, ``.pdf``, ``.svg``); anything else is
    written as PNG. Missing parent folders are created. A reader never sees a
    half-written file, and on error no temp file is left behind.

    Args:
        fig: a matplotlib Figure.
        path: destination file.
        dpi: resolution for raster output.

    Returns:
        The destination path as a string.
    """
    fmt = _FORMATS.get(os.path.splitext(os.fspath(path))[1].lower(), "png")
    atomic_write(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=dpi))
    return os.fspath(path)


def reliability_diagram(probs: Any, labels: Any, path: str | os.PathLike | None = None, n_bins: int = 15,
                        title: str | None = None, *, kind: str = "top_label", dpi: int = 150):
    """Reliability diagram with a confidence histogram (Guo et al. 2017, Fig. 1).

    Top panel: one bar per confidence bin at the bin's accuracy, against the
    dashed diagonal of perfect calibration; the gap between accuracy and mean
    confidence is shaded (red hatched bars from accuracy to confidence). ECE,
    MCE (of ``kind``) and NLL are printed in the upper-left corner. Bottom panel:
    the fraction of items per bin, with the mean confidence and accuracy marked.

    The ``{1.0}`` bin of :func:`bayeswrap.calibration.bin_stats` (confidences
    exactly 1) is drawn merged into the last bar; the printed ECE/MCE use the
    exact torchmetrics binning.

    Args:
        probs: (N, K) predictive probabilities (torch or numpy); rows sum to 1.
        labels: (N,) integer labels in ``[0, K)``.
        path: if given, the figure is also written there (PNG unless the suffix
            says ``.pdf``/``.svg``), atomically.
        n_bins: number of equal-width bins (>= 1).
        title: optional title of the top panel.
        kind: ``"top_label"`` (default) or ``"all_class"`` (BayesDLL's binning).
        dpi: resolution of the written file.

    Returns:
        The matplotlib Figure (not registered with pyplot; ``plt.show()`` is never
        called). Axes: ``fig.axes[0]`` the reliability panel (ylabel
        "Accuracy", containers ``[accuracy bars, gap bars]``, each with
        ``n_bins`` bars), ``fig.axes[1]`` the histogram (xlabel "Confidence",
        ``n_bins`` bars).

    Raises:
        ValueError: on bad input (see :func:`bayeswrap.calibration.bin_stats`).

    Example:
        >>> probs = torch.softmax(3 * torch.randn(500, 10), dim=1)
        >>> labels = torch.multinomial(probs, 1).squeeze(1)
        >>> fig = reliability_diagram(probs, labels, n_bins=10, title="VI, T = 1")  # path="x.png" writes it
        >>> [ax.get_ylabel() for ax in fig.axes], len(fig.axes[0].containers[0])
        (['Accuracy', 'Fraction'], 10)
    """
    stats = cal.bin_stats(probs, labels, n_bins, kind)
    metrics = {"ECE": stats.ece, "MCE": stats.mce, "NLL": cal.nll(probs, labels)}

    count = stats.count[:-1].astype(np.float64).copy()
    sum_conf = stats.confidence[:-1] * count
    sum_acc = stats.accuracy[:-1] * count
    count[-1] += stats.count[-1]  # merge the {1.0} bin into the last bar for display
    sum_conf[-1] += stats.confidence[-1] * stats.count[-1]
    sum_acc[-1] += stats.accuracy[-1] * stats.count[-1]
    safe = np.maximum(count, 1.0)
    conf, acc = sum_conf / safe, sum_acc / safe
    filled = count > 0
    left, width = stats.lower[:-1], stats.upper[:-1] - stats.lower[:-1]
    centers = left + width / 2

    fig = _new_figure(figsize=(5.0, 6.2), layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=(3, 1))
    ax = fig.add_subplot(grid[0])
    ax_hist = fig.add_subplot(grid[1], sharex=ax)

    ax.bar(centers, np.where(filled, acc, 0.0), width=width, color="tab:blue", edgecolor="black",
           linewidth=0.6, label="Accuracy")
    gap_bottom = np.where(filled, acc, 0.0)
    gap_height = np.where(filled, conf - acc, 0.0)
    ax.bar(centers, gap_height, bottom=gap_bottom, width=width, color="tab:red", alpha=0.3, edgecolor="tab:red",
           hatch="//", linewidth=0.6, label="Gap")
    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1.2, label="Perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("Accuracy")
    ax.tick_params(labelbottom=False)
    ax.legend(loc="lower right", fontsize="small")
    suffix = "" if kind == "top_label" else " (all-class)"
    text = "\n".join([f"ECE{suffix} = {100 * metrics['ECE']:.2f}%", f"MCE{suffix} = {100 * metrics['MCE']:.2f}%",
                      f"NLL = {metrics['NLL']:.4f}"])
    ax.text(0.03, 0.97, text, transform=ax.transAxes, va="top", ha="left", fontsize="small",
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85})
    if title is not None:
        ax.set_title(title)

    frac = count / count.sum()
    ax_hist.bar(centers, frac, width=width, color="tab:gray", edgecolor="black", linewidth=0.6)
    mean_conf = float(np.sum(stats.confidence * stats.count) / np.sum(stats.count))
    mean_acc = float(np.sum(stats.accuracy * stats.count) / np.sum(stats.count))
    ax_hist.axvline(mean_conf, color="tab:red", linestyle="--", linewidth=1.2, label="Mean confidence")
    ax_hist.axvline(mean_acc, color="tab:blue", linestyle="-", linewidth=1.2, label="Mean accuracy")
    ax_hist.set_xlabel("Confidence")
    ax_hist.set_ylabel("Fraction")
    ax_hist.set_ylim(0, max(float(frac.max()) * 1.1, 1e-3))
    ax_hist.legend(loc="upper left", fontsize="x-small")

    if path is not None:
        save_figure(fig, path, dpi=dpi)
    return fig


def _history_arrays(history: Any) -> tuple[np.ndarray, np.ndarray, float | None]:
    if isinstance(history, cal.TemperatureFit):
        return np.asarray(history.temperatures, float), np.asarray(history.nlls, float), history.temperature
    if isinstance(history, Mapping) and "temperatures" in history and "nlls" in history:
        return (np.asarray(history["temperatures"], float), np.asarray(history["nlls"], float),
                history.get("temperature"))
    raise ValueError("history must be a TemperatureFit (fit_temperature(..., return_history=True)) or a mapping "
                     f"with 'temperatures' and 'nlls' lists; got {type(history).__name__}")


def temperature_curve(history: Any, path: str | os.PathLike | None = None, *, title: str | None = None,
                      dpi: int = 150):
    """Temperature T and validation NLL against the LBFGS iteration (BayesDLL Fig. 2(c)).

    Args:
        history: the :class:`bayeswrap.calibration.TemperatureFit` returned by
            ``fit_temperature(..., return_history=True)``, or a mapping with
            equal-length ``"temperatures"`` and ``"nlls"`` lists (e.g. its ``to_dict()``).
        path: if given, the figure is also written there (PNG unless the
            suffix says ``.pdf``/``.svg``), atomically.
        title: optional figure title.
        dpi: resolution of the written file.

    Returns:
        The matplotlib Figure with two axes: ``fig.axes[0]`` T per iteration,
        ``fig.axes[1]`` validation NLL per iteration (xlabel "Iteration" on both).

    Raises:
        ValueError: if ``history`` is of the wrong type, empty, or its lists differ in length.

    Example:
        >>> from bayeswrap.evaluation.calibration import fit_temperature
        >>> logits = 3 * torch.randn(1000, 5)
        >>> labels = torch.multinomial(torch.softmax(logits / 2, 1), 1).squeeze(1)
        >>> fit = fit_temperature(logits, labels, return_history=True)
        >>> fig = temperature_curve(fit)  # temperature_curve(fit, "runs/x/temperature.png") writes it
        >>> [ax.get_title() for ax in fig.axes]
        ['Temperature T', 'NLL on validation set']
    """
    temps, nlls, t_final = _history_arrays(history)
    if temps.ndim != 1 or temps.shape != nlls.shape or temps.size == 0:
        raise ValueError("history needs non-empty 'temperatures' and 'nlls' of equal length; got lengths "
                         f"{temps.size} and {nlls.size}")
    iters = np.arange(temps.size)
    fig = _new_figure(figsize=(8.0, 3.2), layout="constrained")
    ax_t, ax_n = fig.subplots(1, 2)
    ax_t.plot(iters, temps, marker="o", markersize=3, color="tab:blue")
    if t_final is not None:
        ax_t.axhline(float(t_final), color="gray", linestyle="--", linewidth=1, label=f"T = {float(t_final):.3f}")
        ax_t.legend(loc="best", fontsize="small")
    ax_t.set_xlabel("Iteration")
    ax_t.set_ylabel("Temperature T")
    ax_t.set_title("Temperature T")
    ax_n.plot(iters, nlls, marker="o", markersize=3, color="tab:red")
    ax_n.set_xlabel("Iteration")
    ax_n.set_ylabel("NLL")
    ax_n.set_title("NLL on validation set")
    if title is not None:
        fig.suptitle(title)
    if path is not None:
        save_figure(fig, path, dpi=dpi)
    return fig


def _finish(fig, path, title: str | None, dpi: int):
    """Title, layout and optional atomic save shared by the multi-panel figures."""
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path, dpi=dpi)
    return fig


def training_curves(history: list[Mapping[str, Any]], path: str | os.PathLike | None = None, *,
                    title: str | None = None, dpi: int = 150):
    """Loss (NLL) and error per epoch for the train, val and test splits.

    Args:
        history: per-epoch records as returned by :func:`bayeswrap.fit`
            (keys ``epoch``, ``train_nll``, ``val_nll``, ``test_nll``, ``*_error``;
            missing keys are skipped).
        path: optional PNG destination (written atomically).
        title: optional figure title.

    Returns:
        The matplotlib Figure (two axes: NLL and error against the epoch).

    Raises:
        ValueError: if ``history`` is empty.
    """
    if not history:
        raise ValueError("training_curves needs at least one epoch record; got an empty history")
    fig = _new_figure(figsize=(9, 3.6))
    axes = fig.subplots(1, 2)
    epochs = [h["epoch"] for h in history]
    for ax, metric in zip(axes, ("nll", "error")):
        for split in ("train", "val", "test"):
            key = f"{split}_{metric}"
            if all(key in h for h in history):
                ax.plot(epochs, [h[key] for h in history], marker="o", ms=3, label=split)
        ax.set_xlabel("epoch")
        ax.set_ylabel("NLL (nats)" if metric == "nll" else "error")
        ax.grid(alpha=0.3)
        ax.legend()
    return _finish(fig, path, title, dpi)


def image_grid(images: list[tuple[str, str | os.PathLike]], path: str | os.PathLike | None = None, *,
               title: str | None = None, columns: int = 5, dpi: int = 150):
    """Tiles saved PNG figures (e.g. one reliability diagram per method) into one figure.

    Args:
        images: ``(caption, png_path)`` pairs.
        path: optional destination (written atomically).
        title: optional figure title.
        columns: tiles per row.

    Returns:
        The matplotlib Figure.

    Raises:
        ValueError: if ``images`` is empty.
    """
    import matplotlib.image as mpimg

    if not images:
        raise ValueError("image_grid needs at least one (caption, path) pair")
    cols = min(columns, len(images))
    rows = (len(images) + cols - 1) // cols
    fig = _new_figure(figsize=(3.6 * cols, 3.6 * rows))
    axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
    for ax in axes:
        ax.axis("off")
    for ax, (caption, img) in zip(axes, images):
        ax.imshow(mpimg.imread(os.fspath(img)))
        ax.set_title(caption)
    return _finish(fig, path, title, dpi)
