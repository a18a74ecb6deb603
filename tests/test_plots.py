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
from bayeswrap import plots  # noqa: E402


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
    assert acc_bars.get_label() == "Accuracy" and gap_bars.get_label() == "Gap"
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
