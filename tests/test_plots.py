"""Reliability diagram and temperature curve: axes, labels, bar counts, files, no figure left open."""

import os

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from bayeswrap import calibration as cal  # noqa: E402
from bayeswrap.evaluation import plots  # noqa: E402


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    logits = 4.0 * torch.randn(500, 10, generator=g)
    labels = torch.multinomial(torch.softmax(logits / 2.0, 1), 1, generator=g).squeeze(1)
    return torch.softmax(logits, 1), labels


@pytest.mark.parametrize("n_bins", [5, 15])
def test_reliability_diagram_axes_and_bars(data, tmp_path, n_bins):
    probs, labels = data
    before = plt.get_fignums()
    path = tmp_path / "sub" / "reliability.png"
    fig = cal.reliability_diagram(probs, labels, path=path, n_bins=n_bins, title="VI, T = 1")
    assert isinstance(fig, Figure)
    assert plt.get_fignums() == before  # nothing left open in pyplot
    ax, ax_hist = fig.axes
    assert ax.get_ylabel() == "Accuracy" and ax_hist.get_xlabel() == "Confidence"
    assert ax.get_title() == "VI, T = 1"
    assert ax.get_xlim() == (0.0, 1.0) and ax.get_ylim() == (0.0, 1.0)
    acc_bars, gap_bars = ax.containers
    assert len(acc_bars) == len(gap_bars) == n_bins
    assert acc_bars.get_label() == "Accuracy" and gap_bars.get_label() == plots.GAP_LABEL
    assert len(ax_hist.containers) == 1 and len(ax_hist.containers[0]) == n_bins
    # bar heights are the per-bin accuracies; the histogram sums to 1
    stats = cal.bin_stats(probs, labels, n_bins)
    filled = stats.count[:-1] > 0
    heights = np.array([b.get_height() for b in acc_bars])
    assert stats.count[-1] == 0  # no confidence exactly 1 here, so bars equal the bins
    np.testing.assert_allclose(heights[filled], stats.accuracy[:-1][filled])
    assert sum(b.get_height() for b in ax_hist.containers[0]) == pytest.approx(1.0)
    # diagonal and the metrics text
    assert any(np.allclose(line.get_xdata(), [0, 1]) and np.allclose(line.get_ydata(), [0, 1]) for line in ax.lines)
    text = " ".join(t.get_text() for t in ax.texts)
    assert f"ECE = {100 * cal.ece(probs, labels, n_bins):.2f}%" in text and "MCE" in text and "NLL" in text
    # atomic PNG write, no temp file left
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(path.parent) == ["reliability.png"]


def test_reliability_diagram_without_path_and_all_class(data):
    probs, labels = data
    before = plt.get_fignums()
    fig = plots.reliability_diagram(probs.numpy(), labels.numpy(), n_bins=10, kind="all_class")
    assert plt.get_fignums() == before
    assert "all-class" in fig.axes[0].texts[0].get_text()


def test_reliability_diagram_merges_confidence_one(tmp_path):
    probs = np.array([[1.0, 0.0], [0.95, 0.05], [0.6, 0.4]])
    fig = cal.reliability_diagram(probs, [1, 0, 0], n_bins=4)
    bars = fig.axes[0].containers[0]
    assert len(bars) == 4
    assert bars[-1].get_height() == pytest.approx(0.5)  # {1.0} (wrong) merged with 0.95 (right)


def test_reliability_diagram_bad_input_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="sum to 1"):
        cal.reliability_diagram(np.array([[0.5, 0.2]]), [0], path=tmp_path / "x.png")
    assert list(tmp_path.iterdir()) == []


def test_temperature_curve(tmp_path):
    g = torch.Generator().manual_seed(1)
    logits = 3.0 * torch.randn(2000, 5, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 2.0, 1), 1, generator=g).squeeze(1)
    fit = cal.fit_temperature(logits, labels, return_history=True)
    before = plt.get_fignums()
    path = tmp_path / "temperature.png"
    fig = cal.temperature_curve(fit, path)
    assert plt.get_fignums() == before
    ax_t, ax_n = fig.axes
    assert ax_t.get_xlabel() == ax_n.get_xlabel() == "Iteration"
    assert ax_t.get_ylabel() == "Temperature T" and ax_n.get_ylabel() == "NLL"
    np.testing.assert_allclose(ax_t.lines[0].get_ydata(), fit.temperatures)
    np.testing.assert_allclose(ax_n.lines[0].get_ydata(), fit.nlls)
    assert path.read_bytes()[:4] == b"\x89PNG"
    # the JSON form works too
    fig2 = plots.temperature_curve(fit.to_dict())
    assert len(fig2.axes) == 2
    with pytest.raises(ValueError, match="TemperatureFit"):
        plots.temperature_curve([1.0, 0.9])
    with pytest.raises(ValueError, match="equal length"):
        plots.temperature_curve({"temperatures": [1.0, 2.0], "nlls": [0.5]})


def test_docstring_examples():
    import doctest

    result = doctest.testmod(plots, extraglobs={"torch": torch, "np": np})
    assert result.attempted > 5 and result.failed == 0


# ------------------------------------------------------------------ comparison figures of the evaluation protocol
@pytest.fixture(scope="module")
def reports(data):
    from bayeswrap.evaluation import protocol

    probs, labels = data
    g = torch.Generator().manual_seed(5)
    out = {}
    for i, method in enumerate(("map", "vi")):
        sp = torch.softmax(probs.log()[None] + i * 0.5 * torch.randn(4, *probs.shape, generator=g), -1)
        rep = protocol.prediction_report(sp, labels, n_bins=10)
        rep["num_samples"] = 4
        rep["shift"] = protocol.shift_report(lambda kind, level, sp=sp: (torch.softmax(sp.log() / (1 + level), -1),
                                                                         labels),
                                             {"rotation": (0, 45, 90), "noise": (0.0, 0.5)}, temperature=1.5)
        out[method] = rep
    return out


def test_reliability_grid_titles_counts_and_legend(reports, tmp_path):
    before = plt.get_fignums()
    fig = plots.reliability_grid({m: r["bins"] for m, r in reports.items()}, tmp_path / "grid.png", num_samples=4)
    assert plt.get_fignums() == before and (tmp_path / "grid.png").stat().st_size > 10_000
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["map, S = 4", "vi, S = 4"]
    counts = reports["map"]["bins"]["count"]
    texts = sorted(int(t.get_text()) for t in visible[0].texts if t.get_text().isdigit())
    merged = counts[:-2] + [counts[-2] + counts[-1]]  # the {1.0} bin is drawn in the last bar
    assert texts == sorted(c for c in merged if c > 0) and sum(texts) == 500
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["Perfect calibration", "Accuracy", plots.GAP_LABEL]


def test_shift_curves_lines_per_method_and_temperature_scaled_baseline(reports):
    fig = plots.shift_curves({m: r["shift"] for m, r in reports.items()}, temperature_scaled="map")
    assert len(fig.axes) == 6
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["map", "map + TS", "vi"]
    nll_rotation = fig.axes[1]
    line = next(ln for ln in nll_rotation.get_lines() if ln.get_label() == "map + TS")
    np.testing.assert_allclose(line.get_ydata(), reports["map"]["shift"]["rotation"]["Topt"]["nll"])
    np.testing.assert_allclose(line.get_xdata(), [0, 45, 90])
    assert fig.axes[3].get_xlabel().startswith("Gaussian noise std")


def test_risk_coverage_and_gamma_curves(reports, tmp_path):
    fig = plots.risk_coverage_curves({m: r["selective"] for m, r in reports.items()}, tmp_path / "rc.png")
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("coverage") and len(ax.get_lines()) == 2
    aurc = reports["map"]["selective"]["aurc"]
    assert ax.get_legend().get_texts()[0].get_text() == f"map, AURC {plots.plain_number(aurc)}"
    assert float(plots.plain_number(aurc)) == pytest.approx(aurc, rel=5e-3)
    fig = plots.gamma_curves({m: r["gamma"] for m, r in reports.items()}, tmp_path / "gamma.png")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["entropy", "mutual information", "variation ratio", "predictive std"]
    np.testing.assert_allclose(fig.axes[0].get_lines()[1].get_ydata(), reports["vi"]["gamma"]["entropy"])
    with pytest.raises(ValueError, match="no method has gamma curves"):
        plots.gamma_curves({"map": None})
    with pytest.raises(ValueError, match="at least one method"):
        plots.shift_curves({})


# ------------------------------------------------------------------ figure structure (issue 33): legends, ticks, panels
def _boxes(fig):
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def test_reliability_legend_is_outside_the_axes_and_explains_the_gap(data):
    probs, labels = data
    # an under-confident predictor: bars in the lower-right corner, where the old in-axes legend sat
    flat = torch.softmax(probs.log() / 3.0, 1)
    for fig in (plots.reliability_diagram(probs, labels, n_bins=10), plots.reliability_diagram(flat, labels, n_bins=10)):
        renderer = _boxes(fig)
        assert not any(ax.get_legend() for ax in fig.axes)  # one figure legend, none inside an axis
        legend = fig.legends[0].get_window_extent(renderer)
        for ax in fig.axes:
            assert not legend.overlaps(ax.get_window_extent(renderer))
            for container in ax.containers:
                assert not any(legend.overlaps(bar.get_window_extent(renderer)) for bar in container)
        texts = [t.get_text() for t in fig.legends[0].get_texts()]
        assert texts == ["Perfect calibration", "Accuracy", plots.GAP_LABEL, "Mean confidence", "Mean accuracy"]
        assert "accuracy" in plots.GAP_LABEL and "confidence" in plots.GAP_LABEL


def test_plain_numbers_in_legends():
    assert [plots.plain_number(v) for v in (0.5771, 0.0117, 0.000512, 1.0, 0.0)] == [
        "0.577", "0.0117", "0.000512", "1.00", "0.00"]
    curve = {"coverage": [0.5, 1.0], "risk": [0.4, 0.5771], "aurc": 0.5771}
    fig = plots.risk_coverage_curves({"map": curve})
    (text,) = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert text == "map, AURC 0.577" and "e-" not in text


@pytest.mark.parametrize("epochs", [2, 3, 7])
def test_training_curves_tick_whole_epochs(epochs):
    history = [{"epoch": e, "train_nll": 1 / e, "val_nll": 1.2 / e, "train_error": 0.5 / e} for e in range(1, epochs + 1)]
    fig = plots.training_curves(history)
    _boxes(fig)
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks


def _copy(report):
    import copy

    return copy.deepcopy(report)


def test_equal_curves_stay_visible_and_each_operating_point_gets_its_panel(reports):
    # laplace (val) repeats MAP's numbers exactly (a huge prior precision), laplace (marglik) differs
    rows = {"map": reports["map"], "laplace (val)": _copy(reports["map"]), "laplace (marglik)": reports["vi"]}
    fig = plots.risk_coverage_curves({m: r["selective"] for m, r in rows.items()})
    lines = {ln.get_label().split(",")[0]: ln for ln in fig.axes[0].get_lines()}
    assert set(lines) == {"map", "laplace (val) (= map)", "laplace (marglik)"}
    assert lines["map"].get_linestyle() == "-" and lines["laplace (marglik)"].get_linestyle() == "-"
    repeat = lines["laplace (val) (= map)"]
    assert repeat.get_linestyle() == "--" and repeat.get_marker() == "x"
    assert repeat.get_zorder() > lines["map"].get_zorder()  # drawn over the curve it repeats
    assert repeat.get_color() != lines["map"].get_color()

    fig = plots.shift_curves({m: r["shift"] for m, r in rows.items()}, temperature_scaled="map")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["map", "map + TS", "laplace (val) (= map)", "laplace (marglik)"]
    for ax in fig.axes:
        styles = {ln.get_label(): ln.get_linestyle() for ln in ax.get_lines()}
        assert styles["laplace (val) (= map)"] == "--" and styles["map"] == "-"

    near = _copy(reports["map"])  # equal to display precision only: "≈"
    near["gamma"] = {k: (list(np.asarray(v) * (1 + 1e-5)) if k != "alphas" else v) for k, v in near["gamma"].items()}
    fig = plots.gamma_curves({"map": reports["map"]["gamma"], "laplace (val)": near["gamma"]})
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["map", "laplace (val) (≈ map)"]

    fig = plots.reliability_grid({m: r["bins"] for m, r in rows.items()}, num_samples=4)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["map, S = 4", "laplace (val), S = 4", "laplace (marglik), S = 4"]


def test_curves_that_differ_keep_their_own_style(reports):
    fig = plots.gamma_curves({m: r["gamma"] for m, r in reports.items()})
    for ax in fig.axes:
        assert all(ln.get_linestyle() == "-" for ln in ax.get_lines())
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["map", "vi"]


def test_eleven_methods_get_eleven_distinct_colours_in_every_figure():
    """The compare figures drew an 11th method (multiswag) in map's colour: matplotlib's cycle has 10."""
    from matplotlib.colors import to_rgba

    from bayeswrap.evaluation.plots import method_colors

    for n in (3, 10, 11, 20):
        colours = [to_rgba(c) for c in method_colors([f"m{i}" for i in range(n)]).values()]
        assert len(set(colours)) == n
    assert method_colors(["a", "b"]) == {"a": "C0", "b": "C1"}  # the default cycle while it suffices
    with pytest.raises(ValueError, match="21 methods"):
        method_colors([f"m{i}" for i in range(21)])
