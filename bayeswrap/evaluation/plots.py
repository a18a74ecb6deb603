"""Figures: reliability diagrams, temperature scaling, training curves, shift, selective prediction and γ curves.

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

from bayeswrap.core.io import atomic_write
from bayeswrap.evaluation import calibration as cal

__all__ = ["reliability_diagram", "temperature_curve", "training_curves", "reliability_grid", "shift_curves",
           "risk_coverage_curves", "gamma_curves", "trace_plot", "rank_plot", "new_figure", "save_figure",
           "plain_number", "GAP_LABEL"]

_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}


def new_figure(**kwargs: Any):
    """A matplotlib ``Figure`` on its own Agg canvas, outside pyplot's global state (nothing is shown or kept open).

    matplotlib is imported here, on the first figure, so importing this module stays cheap.

    Args:
        **kwargs: ``matplotlib.figure.Figure`` arguments, e.g. ``figsize=(6, 4)``, ``layout="constrained"``.

    Returns:
        The figure; write it with :func:`save_figure`.
    """
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


def _display_bins(stats: cal.BinStats) -> tuple[np.ndarray, ...]:
    """Bars of a reliability diagram: the {1.0} bin merged into the last bar; (centers, width, count, conf, acc)."""
    count = stats.count[:-1].astype(np.float64).copy()
    sum_conf = stats.confidence[:-1] * count
    sum_acc = stats.accuracy[:-1] * count
    count[-1] += stats.count[-1]  # merge the {1.0} bin into the last bar for display
    sum_conf[-1] += stats.confidence[-1] * stats.count[-1]
    sum_acc[-1] += stats.accuracy[-1] * stats.count[-1]
    safe = np.maximum(count, 1.0)
    left, width = stats.lower[:-1], stats.upper[:-1] - stats.lower[:-1]
    return left + width / 2, width, count, sum_conf / safe, sum_acc / safe


GAP_LABEL = "Gap (accuracy − mean confidence)"
"""Legend entry of the hatched bars of a reliability diagram, which span a bin's accuracy to its mean confidence."""


def _draw_reliability(ax, stats: cal.BinStats, *, counts: bool = False):
    """Accuracy bars, hatched gap to the mean confidence and the diagonal; optionally bin counts above bars."""
    centers, width, count, conf, acc = _display_bins(stats)
    filled = count > 0
    ax.bar(centers, np.where(filled, acc, 0.0), width=width, color="tab:blue", edgecolor="black",
           linewidth=0.6, label="Accuracy")
    gap_bottom = np.where(filled, acc, 0.0)
    gap_height = np.where(filled, conf - acc, 0.0)
    ax.bar(centers, gap_height, bottom=gap_bottom, width=width, color="tab:red", alpha=0.3, edgecolor="tab:red",
           hatch="//", linewidth=0.6, label=GAP_LABEL)
    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1.2, label="Perfect calibration")
    if counts:  # a strip above y = 1 with the number of items in each bin
        for x, n in zip(centers, count):
            if n > 0:
                ax.text(x, 1.015, f"{int(n)}", ha="center", va="bottom", fontsize=5.5, color="black")
    return centers, width, count


def reliability_diagram(probs: Any, labels: Any, path: str | os.PathLike | None = None, n_bins: int = 15,
                        title: str | None = None, *, kind: str = "top_label", dpi: int = 150):
    """Reliability diagram with a confidence histogram (Guo et al. 2017, Fig. 1).

    Top panel: one bar per confidence bin at the bin's accuracy, against the
    dashed diagonal of perfect calibration; the gap between accuracy and mean
    confidence is shaded (red hatched bars from accuracy to confidence, labelled
    :data:`GAP_LABEL`). ECE, MCE (of ``kind``) and NLL are printed in the upper-left corner. Bottom panel:
    the fraction of items per bin, with the mean confidence and accuracy marked. One legend for both
    panels sits under the figure, outside the axes, so it covers no bar.

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
        ``n_bins`` bars); ``fig.legends[0]`` the legend of both, under them.

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

    fig = new_figure(figsize=(5.0, 6.2), layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=(3, 1))
    ax = fig.add_subplot(grid[0])
    ax_hist = fig.add_subplot(grid[1], sharex=ax)
    centers, width, count = _draw_reliability(ax, stats)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("Accuracy")
    ax.tick_params(labelbottom=False)
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
    handles, names = ax.get_legend_handles_labels()
    hist_handles, hist_names = ax_hist.get_legend_handles_labels()
    fig.legend(handles + hist_handles, names + hist_names, loc="outside lower center", ncols=2, fontsize="small")

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
    fig = new_figure(figsize=(8.0, 3.2), layout="constrained")
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
        The matplotlib Figure (two axes: NLL and error against the epoch, ticks at whole epochs).

    Raises:
        ValueError: if ``history`` is empty.
    """
    from matplotlib.ticker import MaxNLocator

    if not history:
        raise ValueError("training_curves needs at least one epoch record; got an empty history")
    fig = new_figure(figsize=(9, 3.6))
    axes = fig.subplots(1, 2)
    epochs = [h["epoch"] for h in history]
    for ax, metric in zip(axes, ("nll", "error")):
        for split in ("train", "val", "test"):
            key = f"{split}_{metric}"
            if all(key in h for h in history):
                ax.plot(epochs, [h[key] for h in history], marker="o", ms=3, label=split)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers: no tick at 1.5
        ax.set_ylabel("NLL (nats)" if metric == "nll" else "error")
        ax.grid(alpha=0.3)
        ax.legend()
    return _finish(fig, path, title, dpi)


def _grid(n: int, columns: int, size: tuple[float, float]):
    cols = max(1, min(columns, n))
    rows = (n + cols - 1) // cols
    fig = new_figure(figsize=(size[0] * cols, size[1] * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _require(results: Mapping[str, Any], what: str) -> None:
    if not results:
        raise ValueError(f"{what} needs at least one method's results; got none")


def method_colors(methods) -> dict[str, Any]:
    """One distinct colour per method, in order: matplotlib's default cycle (C0–C9) for up to 10 methods, else
    tab20's 20 colours (the default cycle repeats after 10, so an 11th curve took the first one's colour).

    Raises:
        ValueError: for more than 20 methods (colours would repeat).
    """
    names = list(methods)
    if len(names) > 20:
        raise ValueError(f"{len(names)} methods in one figure; accepted: at most 20 (one distinct colour each)")
    if len(names) <= 10:
        return {m: f"C{i}" for i, m in enumerate(names)}
    from matplotlib import colormaps  # imported on first use, as in new_figure

    palette = colormaps["tab20"].colors
    return {m: palette[i] for i, m in enumerate(names)}


def plain_number(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits in positional notation, never scientific.

    Example:
        >>> plain_number(0.5771), plain_number(0.0117), plain_number(0.000512), plain_number(12.5)
        ('0.577', '0.0117', '0.000512', '12.5')
    """
    return np.format_float_positional(float(value), precision=digits, unique=False, fractional=False, trim="k")


_REPEAT_STYLE = {"linestyle": (0, (3, 2)), "marker": "x", "zorder": 2.5}
"""How a curve is drawn over an equal one drawn before it: dashed with crosses, on top (the solid line and the
dots of the first show between the dashes)."""


def _close(a: Any, b: Any) -> bool:
    """Whether two series are equal to display precision (same length, within 1e-3 relative)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-3, atol=1e-6))


def _aliases(curves: Mapping[str, list[Any]]) -> dict[str, str]:
    """``{method: label}``: ``"<method> (= <earlier>)"`` (or ``≈`` when not bit-equal) for a method all of whose
    series equal those of an earlier one, which would otherwise hide it, else the method's name.
    """
    labels: dict[str, str] = {}
    originals: list[str] = []
    for method, series in curves.items():
        labels[method] = method
        for other in originals:
            theirs = curves[other]
            if len(theirs) == len(series) and series and all(_close(a, b) for a, b in zip(series, theirs)):
                exact = all(np.array_equal(np.asarray(a, float), np.asarray(b, float)) for a, b in zip(series, theirs))
                labels[method] = f"{method} ({'=' if exact else '≈'} {other})"
                break
        else:
            originals.append(method)
    return labels


def _plot_curve(ax, x: Any, y: Any, drawn: list[tuple[Any, Any]], **style: Any):
    """``ax.plot(x, y, **style)``, in :data:`_REPEAT_STYLE` when an equal curve is already on ``ax``; records it."""
    if any(_close(x, dx) and _close(y, dy) for dx, dy in drawn):
        style = {**style, **_REPEAT_STYLE, "markevery": max(1, len(np.atleast_1d(x)) // 15)}  # ~15 crosses
    drawn.append((x, y))
    return ax.plot(x, y, **style)


def reliability_grid(bins: Mapping[str, Mapping[str, Any]], path: str | os.PathLike | None = None, *,
                     num_samples: int | Mapping[str, int] | None = None, columns: int = 3,
                     title: str | None = None, dpi: int = 150):
    """One reliability diagram per method as subplots of one figure, with bin counts.

    Each panel shows accuracy bars per confidence bin, the hatched gap to the
    bin's mean confidence, the diagonal, the number of test examples in each bin
    above its bar, and ECE/MCE; its title names the method (or operating point, e.g.
    ``"laplace (marglik)"``) and S. One shared legend sits under the panels.

    Args:
        bins: ``{method: BinStats.to_dict()}`` (the ``"bins"`` entry of
            :func:`bayeswrap.evaluation.protocol.prediction_report`), in panel order.
        path: optional destination (written atomically).
        num_samples: S for every panel, or ``{method: S}``; shown in the titles.
        columns: panels per row.
        title: optional figure title.
        dpi: resolution of the written file.

    Returns:
        The matplotlib Figure (one axis per method; titles ``"<method>, S = <S>"``).

    Raises:
        ValueError: if ``bins`` is empty.
    """
    _require(bins, "reliability_grid")
    fig, axes = _grid(len(bins), columns, (3.4, 3.4))
    for ax, (method, d) in zip(axes, bins.items()):
        stats = cal.BinStats(**{k: (v if k == "kind" else np.asarray(v)) for k, v in d.items()})
        _draw_reliability(ax, stats, counts=True)
        s = num_samples.get(method) if isinstance(num_samples, Mapping) else num_samples
        ax.set_title(method if s is None else f"{method}, S = {s}")
        ax.text(0.03, 0.9, f"ECE = {100 * stats.ece:.2f}%\nMCE = {100 * stats.mce:.2f}%", transform=ax.transAxes,
                va="top", ha="left", fontsize="small", bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85})
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.09)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_xlabel("Confidence")
        ax.set_ylabel("Accuracy")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=3, fontsize="small",
               title="numbers above the bars: test examples per bin")
    if title:
        fig.suptitle(title)
    if path is not None:
        save_figure(fig, path, dpi=dpi)
    return fig


_SHIFT_LABELS = {"error": "error", "nll": "NLL (nats)", "ece": "ECE"}
_SHIFT_X = {"rotation": "rotation angle (degrees)", "noise": "Gaussian noise std (pixels in [0, 1])"}


def shift_curves(shift: Mapping[str, Mapping[str, Any]], path: str | os.PathLike | None = None, *,
                 temperature_scaled: str | None = "map", title: str | None = None, dpi: int = 150,
                 corruption: Mapping[str, Mapping[str, Any]] | None = None):
    """Error, NLL and ECE against shift intensity, one line per method (Ovadia et al. 2019, Figs. 2 and 3).

    Args:
        shift: ``{method: shift report}``, each the output of
            :func:`bayeswrap.evaluation.protocol.shift_report` (may hold no curve when
            ``corruption`` is given).
        corruption: optional ``{method: corruption report}``, each the output of
            :func:`bayeswrap.evaluation.protocol.corruption_report`: one more row against
            severity, the mean over corruptions as a bold line per method and each
            corruption as a thin line of the method's colour.
        path: optional destination (written atomically).
        temperature_scaled: a method whose temperature-scaled curves (``Topt``) are
            added as a dashed line labelled ``"<method> + TS"`` (the baseline every
            Bayesian method must beat); ``None`` for none.

    A curve equal to one drawn before it on its panel is dashed with crosses over it;
    a method whose curves all equal an earlier method's is labelled ``"<method> (= <earlier>)"``.
        title: optional figure title.
        dpi: resolution of the written file.

    Returns:
        The matplotlib Figure: one row per shift kind (and one for the corruptions),
        columns error, NLL, ECE.

    Raises:
        ValueError: if ``shift`` is empty or holds no shift curves and no corruption report is given.
    """
    _require(shift, "shift_curves")
    kinds = [k for k in ("rotation", "noise") if any(k in r for r in shift.values())]
    corruption = {m: r for m, r in (corruption or {}).items() if r}
    if not kinds and not corruption:
        raise ValueError("shift_curves: the reports hold no 'rotation' or 'noise' curves and no corruption report")
    rows = len(kinds) + bool(corruption)
    fig = new_figure(figsize=(12, 3.3 * rows), layout="constrained")
    axes = np.atleast_2d(fig.subplots(rows, 3, squeeze=False))
    colors = method_colors({**shift, **corruption})
    names = _aliases({m: [shift.get(m, {}).get(k, {}).get("T1", {}).get(metric, []) for k in kinds
                          for metric in ("error", "nll", "ece")]
                      + [corruption[m]["mean"]["T1"][metric] for metric in ("error", "nll", "ece") if m in corruption]
                      for m in colors})
    if corruption:
        _corruption_row(axes[-1], corruption, colors, temperature_scaled, names)
    for row, kind in zip(axes, kinds):
        for ax, metric in zip(row, ("error", "nll", "ece")):
            drawn: list = []
            for method, rep in shift.items():
                if kind not in rep:
                    continue
                x = rep[kind]["intensity"]
                _plot_curve(ax, x, rep[kind]["T1"][metric], drawn, marker="o", ms=3, color=colors[method],
                            label=names[method])
                if method == temperature_scaled:
                    ax.plot(x, rep[kind]["Topt"][metric], marker="s", ms=3, linestyle="--", color="black",
                            label=f"{method} + TS")
            ax.set_xlabel(_SHIFT_X[kind])
            ax.set_ylabel(_SHIFT_LABELS[metric])
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6))
    if title:
        fig.suptitle(title)
    if path is not None:
        save_figure(fig, path, dpi=dpi)
    return fig


def _corruption_row(row: Any, corruption: Mapping[str, Mapping[str, Any]], colors: dict[str, str],
                    temperature_scaled: str | None, names: Mapping[str, str]) -> None:
    """Error, NLL and ECE against corruption severity: thin per-corruption lines, the bold mean per method."""
    kinds = sorted({n for rep in corruption.values() for n in rep["corruptions"]})
    row[0].set_title(f"corruptions: mean over {len(kinds)} (bold), each (thin)", fontsize="medium")
    for ax, metric in zip(row, ("error", "nll", "ece")):
        drawn: list = []
        for method, rep in corruption.items():
            x = rep["severity"]
            for curve in rep["corruptions"].values():
                ax.plot(x, curve["T1"][metric], color=colors[method], alpha=0.25, linewidth=0.8)
            _plot_curve(ax, x, rep["mean"]["T1"][metric], drawn, marker="o", ms=3, linewidth=2, color=colors[method],
                        label=names[method])
            if method == temperature_scaled:
                ax.plot(x, rep["mean"]["Topt"][metric], marker="s", ms=3, linestyle="--", color="black",
                        label=f"{method} + TS")
        ax.set_xlabel("corruption severity (0 = clean)")
        ax.set_xticks(sorted({v for rep in corruption.values() for v in rep["severity"]}))
        ax.set_ylabel(_SHIFT_LABELS[metric])
        ax.grid(alpha=0.3)


def risk_coverage_curves(selective: Mapping[str, Mapping[str, Any]], path: str | os.PathLike | None = None, *,
                         title: str | None = None, dpi: int = 150):
    """Selective risk against coverage, one line per method, AURC in the legend (``"map, AURC 0.0117"``).

    A curve equal to an earlier method's is drawn dashed with crosses over it and labelled
    ``"<method> (= <earlier>)"``.

    Args:
        selective: ``{method: {"coverage": [...], "risk": [...], "aurc": float}}``
            (the ``"selective"`` entry of :func:`bayeswrap.evaluation.protocol.prediction_report`).
        path: optional destination (written atomically).
        title: optional figure title.
        dpi: resolution of the written file.

    Returns:
        The matplotlib Figure (one axis: x coverage, y risk).

    Raises:
        ValueError: if ``selective`` is empty.
    """
    _require(selective, "risk_coverage_curves")
    fig = new_figure(figsize=(5.5, 4.2))
    ax = fig.subplots()
    names = _aliases({m: [rep["coverage"], rep["risk"]] for m, rep in selective.items()})
    drawn: list = []
    colors = method_colors(selective)
    for method, rep in selective.items():
        _plot_curve(ax, rep["coverage"], rep["risk"], drawn, color=colors[method],
                    label=f"{names[method]}, AURC {plain_number(rep['aurc'])}")
    ax.set_xlabel("coverage (fraction of test examples kept, most confident first)")
    ax.set_ylabel("risk (error among kept)")
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _finish(fig, path, title, dpi)


def gamma_curves(gamma: Mapping[str, Mapping[str, Any] | None], path: str | os.PathLike | None = None, *,
                 measures: tuple[str, ...] = ("entropy", "mutual_information", "variation_ratio", "predictive_std"),
                 title: str | None = None, dpi: int = 150):
    """γ(α) of each uncertainty measure, one panel per measure, one line per method.

    γ(α) is the fraction of correctly classified test examples whose uncertainty
    is below the α-quantile of the misclassified examples' uncertainties (see
    :func:`bayeswrap.evaluation.uncertainty.gamma_curve`); higher is better. A curve
    equal to one drawn before it is dashed with crosses; a method whose curves all
    equal an earlier method's is labelled ``"<method> (= <earlier>)"``.

    Args:
        gamma: ``{method: {"alphas": [...], measure: [...], ...} or None}`` (the
            ``"gamma"`` entry of :func:`bayeswrap.evaluation.protocol.prediction_report`).
        path: optional destination (written atomically).
        measures: the measures to draw, where present.
        title: optional figure title.
        dpi: resolution of the written file.

    Returns:
        The matplotlib Figure (one axis per measure present in any method's results).

    Raises:
        ValueError: if no method has γ curves.
    """
    present = [m for m in measures if any(g and m in g for g in gamma.values())]
    if not present:
        raise ValueError("gamma_curves: no method has gamma curves (needs correct and misclassified examples)")
    fig, axes = _grid(len(present), 4, (3.6, 3.4))
    names = _aliases({m: [g[k] for k in present if k in g] for m, g in gamma.items() if g})
    colors = method_colors(gamma)
    for ax, measure in zip(axes, present):
        drawn: list = []
        for method, g in gamma.items():
            if g and measure in g:
                _plot_curve(ax, g["alphas"], g[measure], drawn, marker="o", ms=3, color=colors[method],
                            label=names[method])
        ax.set_title(measure.replace("_", " "))
        ax.set_xlabel("α")
        ax.set_ylabel("γ(α)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    if title:
        fig.suptitle(title)
    if path is not None:
        save_figure(fig, path, dpi=dpi)
    return fig


def _chain_series(draws: Mapping[str, Any], max_series: int) -> list[tuple[str, np.ndarray]]:
    """Up to ``max_series`` scalar coordinates ``(label, (chains, draws))`` spread over the tensors."""
    series = []
    for name, d in draws.items():
        arr = np.asarray(d.detach().cpu().double() if hasattr(d, "detach") else d, dtype=float)
        flat = arr.reshape(arr.shape[0], arr.shape[1], -1)
        for j in np.unique(np.linspace(0, flat.shape[2] - 1, min(2, flat.shape[2])).round().astype(int)):
            series.append((f"{name}[{j}]", flat[:, :, j]))
    return series[:max_series]


def trace_plot(draws: Mapping[str, Any], path: str | os.PathLike | None = None, *, max_series: int = 6,
               title: str | None = None, dpi: int = 120):
    """Trace plots of MCMC draws: one panel per coordinate, one line per chain.

    Args:
        draws: ``{name: (chains, draws, *shape)}`` (e.g. ``bnn.chain_draws()``); up to two
            coordinates per tensor (its first and last entry) are shown.
        path: optional file to write atomically.
        max_series: most panels.

    Returns:
        The matplotlib Figure.
    """
    series = _chain_series(draws, max_series)
    fig, axes = _grid(len(series), 2, (5.0, 2.2))
    for ax, (label, arr) in zip(axes, series):
        for c, chain in enumerate(arr):
            ax.plot(chain, lw=0.6, label=f"chain {c}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("kept draw")
    if series:
        axes[0].legend(fontsize=7)
    return _save_constrained(fig, path, title, dpi)


def rank_plot(draws: Mapping[str, Any], path: str | os.PathLike | None = None, *, max_series: int = 6,
              bins: int = 20, title: str | None = None, dpi: int = 120):
    """Rank plots (Vehtari et al. 2021, §4.5): histograms of each chain's ranks among all draws.

    Well-mixed chains give flat histograms; a chain stuck elsewhere piles its
    ranks at one end.

    Args:
        draws: ``{name: (chains, draws, *shape)}``.
        path: optional file to write atomically.
        max_series: most panels; bins: histogram bins.

    Returns:
        The matplotlib Figure.
    """
    from scipy.stats import rankdata

    series = _chain_series(draws, max_series)
    fig, axes = _grid(len(series), 2, (5.0, 2.2))
    for ax, (label, arr) in zip(axes, series):
        ranks = rankdata(arr.reshape(-1)).reshape(arr.shape)
        edges = np.linspace(0, ranks.size, bins + 1)
        for c, r in enumerate(ranks):
            ax.hist(r, bins=edges, histtype="step", label=f"chain {c}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("rank")
    return _save_constrained(fig, path, title, dpi)


def _save_constrained(fig, path, title: str | None, dpi: int):
    """Title and optional atomic save of a figure laid out by matplotlib's constrained layout."""
    if title:
        fig.suptitle(title)
    if path is not None:
        save_figure(fig, path, dpi=dpi)
    return fig
