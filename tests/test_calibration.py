"""Calibration metrics and temperature scaling against known answers and torchmetrics."""

import json
import math

import numpy as np
import pytest
import torch

from bayeswrap import calibration as cal

torchmetrics_cls = pytest.importorskip("torchmetrics.classification")

# torchmetrics' documented example; hand-computed below for n_bins = 3.
HAND_PROBS = [[0.25, 0.20, 0.55], [0.55, 0.05, 0.40], [0.10, 0.30, 0.60], [0.90, 0.05, 0.05]]
HAND_LABELS = [0, 1, 2, 0]


def _table(kind, n=1000, k=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = {"random": 1.0, "peaked": 30.0}[kind]
    probs = torch.softmax(scale * torch.randn(n, k, generator=g), dim=1)
    labels = torch.randint(0, k, (n,), generator=g)
    return probs, labels


def _sample_labels(probs, rng):
    """Draws y_i ~ Categorical(probs_i) (vectorised inverse CDF)."""
    cdf = np.cumsum(probs, axis=1)
    u = rng.random((len(probs), 1)) * cdf[:, -1:]
    return np.minimum((u > cdf).sum(axis=1), probs.shape[1] - 1)


# ----------------------------------------------------------------------------------------------
# ECE / MCE
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("table", ["random", "peaked"])
@pytest.mark.parametrize("n_bins", [1, 3, 10, 15, 25])
@pytest.mark.parametrize("seed", [0, 1])
def test_top_label_matches_torchmetrics(table, n_bins, seed):
    probs, labels = _table(table, seed=seed)
    if table == "peaked":  # exercises torchmetrics' extra bin for confidence exactly 1.0
        assert (probs.max(dim=1).values == 1.0).any()
    k = probs.shape[1]
    for norm, ours in (("l1", cal.ece), ("max", cal.mce)):
        ref = torchmetrics_cls.MulticlassCalibrationError(num_classes=k, n_bins=n_bins, norm=norm)(probs, labels)
        assert ours(probs, labels, n_bins=n_bins) == pytest.approx(ref.item(), abs=1e-6)
        assert ours(probs.numpy(), labels.numpy(), n_bins=n_bins) == pytest.approx(ref.item(), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_bins", [4, 5, 10])
def test_confidences_on_bin_edges_match_torchmetrics(dtype, n_bins):
    # Binary tables whose top confidences sit exactly on bin edges (and at 1.0): bins are
    # [b_m, b_{m+1}), an edge value goes right, and 1.0 gets torchmetrics' bin of its own.
    rng = np.random.default_rng(0)
    edges = np.linspace(0, 1, n_bins + 1)
    conf = rng.choice(np.append(edges[edges >= 0.5], [0.55, 0.95]), size=400)
    probs = torch.tensor(np.stack([conf, 1 - conf], axis=1), dtype=dtype)
    labels = torch.as_tensor(rng.integers(0, 2, size=400))
    for norm, ours in (("l1", cal.ece), ("max", cal.mce)):
        ref = torchmetrics_cls.MulticlassCalibrationError(num_classes=2, n_bins=n_bins, norm=norm)(probs, labels)
        assert ours(probs, labels, n_bins=n_bins) == pytest.approx(ref.item(), abs=1e-6)


def _naive_ce(conf, correct, edges):
    """Reference loop: items in [edges[m], edges[m+1]) or, at confidence exactly 1, a bin of their own."""
    bins = {}
    for c, a in zip(conf, correct):
        m = len(edges) - 1 if c == 1.0 else next(m for m in range(len(edges) - 1) if edges[m] <= c < edges[m + 1])
        bins.setdefault(m, []).append((c, a))
    gaps = {m: abs(sum(a for _, a in v) / len(v) - sum(c for c, _ in v) / len(v)) for m, v in bins.items()}
    return sum(len(bins[m]) * g for m, g in gaps.items()) / len(conf), max(gaps.values())


def _naive_items(probs, labels, kind):
    if kind == "top_label":
        return [max(row) for row in probs], [float(int(np.argmax(row)) == y) for row, y in zip(probs, labels)]
    return [p for row in probs for p in row], [float(j == y) for row, y in zip(probs, labels) for j in range(len(row))]


@pytest.mark.parametrize("kind", cal.ECE_KINDS)
@pytest.mark.parametrize("n_bins", [1, 3, 10, 15])
def test_ece_and_mce_match_a_reference_loop(kind, n_bins):
    # torchmetrics computes ece/mce; this loop (and bin_stats, bayeswrap's own binning) checks that it is
    # given the right items, norm and bins: float64 in, float64 out, to rounding
    probs, labels = _table("random", n=300, k=4, seed=n_bins)
    probs = probs.double().numpy()
    edges = [m / n_bins for m in range(n_bins + 1)]
    ref_ece, ref_mce = _naive_ce(*_naive_items(probs.tolist(), labels.tolist(), kind), edges)
    assert cal.ece(probs, labels, n_bins=n_bins, kind=kind) == pytest.approx(ref_ece, abs=1e-12)
    assert cal.mce(probs, labels, n_bins=n_bins, kind=kind) == pytest.approx(ref_mce, abs=1e-12)
    stats = cal.bin_stats(probs, labels, n_bins=n_bins, kind=kind)
    assert stats.ece == pytest.approx(ref_ece, abs=1e-12) and stats.mce == pytest.approx(ref_mce, abs=1e-12)
    report = cal.report(probs, labels, n_bins=n_bins)["T1"]
    assert report["ece" if kind == "top_label" else "ece_all_class"] == pytest.approx(ref_ece, abs=1e-12)
    if kind == "top_label":
        assert report["mce"] == pytest.approx(ref_mce, abs=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n_bins", [4, 8])
def test_reference_loop_on_bin_edges(dtype, n_bins):
    # confidences exactly on the edges (k/4, k/8 are exact in both precisions) and at 1.0
    rng = np.random.default_rng(n_bins)
    conf = rng.choice([0.5, 0.625, 0.75, 0.875, 1.0], size=200)
    probs = np.stack([conf, 1 - conf], axis=1).astype(dtype)
    labels = rng.integers(0, 2, size=200)
    edges = [m / n_bins for m in range(n_bins + 1)]
    for kind in cal.ECE_KINDS:
        ref_ece, ref_mce = _naive_ce(*_naive_items(probs.astype(np.float64).tolist(), labels.tolist(), kind), edges)
        assert cal.ece(probs, labels, n_bins=n_bins, kind=kind) == pytest.approx(ref_ece, abs=1e-6)
        assert cal.mce(probs, labels, n_bins=n_bins, kind=kind) == pytest.approx(ref_mce, abs=1e-6)


def test_float32_input_is_binned_as_torchmetrics_does():
    # 0.7 in float32 is 0.69999999: torchmetrics bins it with the float32 edge 0.7 (on the edge: the upper bin)
    probs = torch.tensor([[0.7, 0.3], [0.65, 0.35]], dtype=torch.float32)
    labels = torch.tensor([0, 1])
    ref = torchmetrics_cls.MulticlassCalibrationError(num_classes=2, n_bins=10, norm="l1")(probs, labels)
    assert cal.ece(probs, labels, n_bins=10) == ref.item()
    assert cal.ece(probs, labels, n_bins=10) == pytest.approx((0.3 + 0.65) / 2, abs=1e-7)  # two bins of one
    assert cal.bin_stats(probs, labels, n_bins=10).count[6:8].tolist() == [1, 1]


def test_edge_convention_bins():
    probs = np.array([[0.5, 0.5], [0.75, 0.25], [1.0, 0.0], [0.74, 0.26]])
    s = cal.bin_stats(probs, [0, 0, 1, 0], n_bins=4)
    # bins [0,.25) [.25,.5) [.5,.75) [.75,1) {1}
    assert s.count.tolist() == [0, 0, 2, 1, 1]
    assert s.lower.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert s.upper.tolist() == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert s.accuracy.tolist() == [0.0, 0.0, 1.0, 1.0, 0.0]
    assert s.confidence[2] == pytest.approx(0.62)
    assert s.confidence[4] == 1.0


def test_hand_computed_three_bins():
    probs = np.array(HAND_PROBS, dtype=np.float64)
    labels = np.array(HAND_LABELS)
    # top_label: confidences .55 (wrong), .55 (wrong), .60 (right), .90 (right)
    #   bin [1/3, 2/3): conf (.55+.55+.60)/3 = 17/30, acc 1/3 -> gap 7/30
    #   bin [2/3, 1):   conf .90, acc 1              -> gap 1/10
    #   ECE = 3/4 * 7/30 + 1/4 * 1/10 = 0.2;  MCE = 7/30
    assert cal.ece(probs, labels, n_bins=3) == pytest.approx(0.2, abs=1e-12)
    assert cal.mce(probs, labels, n_bins=3) == pytest.approx(7 / 30, abs=1e-12)
    # all_class: 12 (probability, indicator) pairs
    #   bin [0, 1/3):   .25(1) .20(0) .05(1) .10(0) .30(0) .05(0) .05(0): 7 items, sum p 1.0, sum 1[.] 2 -> |2-1| = 1
    #   bin [1/3, 2/3): .55(0) .55(0) .40(0) .60(1):                      4 items, sum p 2.1, sum 1[.] 1 -> 1.1
    #   bin [2/3, 1):   .90(1):                                            1 item,  sum p 0.9, sum 1[.] 1 -> 0.1
    #   ECE = (1 + 1.1 + 0.1) / 12 = 2.2/12;  MCE = max(1/7, 1.1/4, 0.1) = 0.275
    assert cal.ece(probs, labels, n_bins=3, kind="all_class") == pytest.approx(2.2 / 12, abs=1e-12)
    assert cal.mce(probs, labels, n_bins=3, kind="all_class") == pytest.approx(0.275, abs=1e-12)
    s = cal.bin_stats(probs, labels, n_bins=3, kind="all_class")
    assert s.count.tolist() == [7, 4, 1, 0]
    assert s.accuracy[:3] == pytest.approx([2 / 7, 1 / 4, 1.0], abs=1e-12)
    assert s.confidence[:3] == pytest.approx([1 / 7, 2.1 / 4, 0.9], abs=1e-12)
    assert isinstance(cal.ece(probs, labels, n_bins=3), float)


def test_all_class_is_much_smaller_for_many_classes():
    rng = np.random.default_rng(0)
    logits = 3.0 * rng.standard_normal((2000, 100))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    labels = rng.integers(0, 100, size=2000)  # badly calibrated: labels unrelated to probs
    top, allc = cal.ece(probs, labels), cal.ece(probs, labels, kind="all_class")
    assert top > 0.3
    assert allc < top / 20
    s = cal.bin_stats(probs, labels, kind="all_class")
    assert s.count.sum() == 2000 * 100 and s.count[0] / s.count.sum() > 0.9  # the diluting first bin


def test_perfectly_calibrated_predictor_has_small_ece():
    rng = np.random.default_rng(1)
    n, k = 200_000, 10
    probs = rng.dirichlet(np.full(k, 0.3), size=n)
    labels = _sample_labels(probs, rng)
    assert cal.ece(probs, labels) < 0.01
    assert cal.ece(probs, labels, kind="all_class") < 0.01
    # the same predictor made overconfident is clearly detected
    sharp = probs**3 / (probs**3).sum(1, keepdims=True)
    assert cal.ece(sharp, labels) > 0.05


def test_empty_bins_are_skipped():
    probs = np.array([[0.95, 0.05], [0.955, 0.045]])
    s = cal.bin_stats(probs, [0, 1], n_bins=100)
    assert (s.count > 0).sum() == 1 and np.isfinite(s.confidence).all() and np.isfinite(s.accuracy).all()
    assert cal.ece(probs, [0, 1], n_bins=100) == pytest.approx(0.9525 - 0.5)
    assert cal.mce(probs, [0, 1], n_bins=100) == pytest.approx(0.9525 - 0.5)


# ----------------------------------------------------------------------------------------------
# NLL, Brier, accuracy, entropy
# ----------------------------------------------------------------------------------------------
def test_scalar_metrics_known_values():
    probs = np.array([[0.5, 0.5, 0.0], [0.9, 0.1, 0.0], [0.2, 0.2, 0.6]])
    labels = np.array([0, 0, 1])
    assert cal.nll(probs, labels) == pytest.approx(-(math.log(0.5) + math.log(0.9) + math.log(0.2)) / 3, abs=1e-12)
    assert cal.brier(probs, labels) == pytest.approx((0.5 + 0.02 + (0.04 + 0.64 + 0.36)) / 3, abs=1e-12)
    assert cal.accuracy(probs, labels) == pytest.approx(2 / 3)  # tie in row 0 goes to class 0
    h = [math.log(2), -(0.9 * math.log(0.9) + 0.1 * math.log(0.1)), -(2 * 0.2 * math.log(0.2) + 0.6 * math.log(0.6))]
    assert cal.predictive_entropy(probs, reduction="none") == pytest.approx(h, abs=1e-12)
    assert cal.predictive_entropy(probs) == pytest.approx(np.mean(h), abs=1e-12)
    assert cal.predictive_entropy(probs, reduction="sum") == pytest.approx(np.sum(h), abs=1e-12)
    for f in (cal.nll, cal.brier, cal.accuracy, cal.ece, cal.mce):
        assert type(f(probs, labels)) is float
        assert f(torch.tensor(probs), torch.tensor(labels)) == f(probs, labels)


def test_nll_is_finite_for_zero_probability():
    value = cal.nll(np.array([[1.0, 0.0]]), np.array([1]))
    assert math.isfinite(value) and value == pytest.approx(-math.log(cal.NLL_EPS))


def test_metrics_accept_other_dtypes():
    probs, labels = _table("random", n=50)
    ref = cal.ece(probs.double(), labels)
    assert cal.ece(probs, labels.int()) == pytest.approx(ref, abs=1e-6)
    assert cal.ece(probs.numpy().astype(np.float64), labels.numpy().astype(np.int32)) == pytest.approx(ref)
    assert cal.ece(probs.clone().requires_grad_(), labels) == pytest.approx(ref, abs=1e-6)
    assert cal.ece(probs.tolist(), labels.tolist()) == pytest.approx(ref, abs=1e-6)


# ----------------------------------------------------------------------------------------------
# temperature scaling
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("true_t", [0.5, 2.0, 4.0])
def test_temperature_recovered(true_t):
    g = torch.Generator().manual_seed(0)
    n, k = 20_000, 10
    logits = 3.0 * torch.randn(n, k, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / true_t, dim=1), 1, generator=g).squeeze(1)
    fit = cal.fit_temperature(logits, labels, return_history=True)
    assert fit.temperature == pytest.approx(true_t, rel=0.05)
    assert fit.nll_after < fit.nll_before
    assert fit.converged and not fit.fell_back
    assert fit.temperatures[0] == 1.0 and fit.nlls[0] == pytest.approx(fit.nll_before)
    assert len(fit.temperatures) == len(fit.nlls) == len(fit.iterations) >= 2
    assert np.all(np.diff(fit.nlls) <= 1e-12)  # LBFGS with strong Wolfe never goes up
    # float return, and the same T from log-probabilities (softmax is shift invariant)
    t = cal.fit_temperature(torch.log_softmax(logits, 1).float(), labels.numpy())
    assert type(t) is float and t == pytest.approx(fit.temperature, rel=1e-4)
    json.dumps(fit.to_dict())


def test_temperature_never_increases_nll():
    rng = np.random.default_rng(3)
    for seed in range(3):
        probs = rng.dirichlet(np.full(5, 0.5), size=3000)
        labels = _sample_labels(probs, rng)  # already calibrated: T* close to 1
        fit = cal.fit_temperature(np.log(probs), labels, return_history=True)
        assert fit.nll_after <= fit.nll_before
        assert fit.temperature == pytest.approx(1.0, abs=0.1)
        assert cal.nll(cal.apply_temperature(np.log(probs), fit.temperature), labels) <= cal.nll(probs, labels) + 1e-12


def test_temperature_falls_back_to_one_when_no_improvement():
    rng = np.random.default_rng(4)
    probs = rng.dirichlet(np.ones(4), size=2000)
    labels = _sample_labels(probs, rng)
    fit = cal.fit_temperature(np.log(probs), labels, bounds=(3.0, 100.0), return_history=True)
    assert fit.fell_back and fit.temperature == 1.0 and fit.nll_after == fit.nll_before
    assert min(fit.temperatures) >= 3.0
    assert cal.fit_temperature(np.log(probs), labels, max_iter=0) == 1.0


def test_temperature_handles_separable_data_and_log_zero():
    # all correct with a margin: NLL keeps falling as T -> 0, so T stops at the lower bound
    log_probs = torch.log(torch.tensor([[1.0, 0.0], [0.2, 0.8]] * 10))
    labels = torch.tensor([0, 1] * 10)
    t = cal.fit_temperature(log_probs, labels, bounds=(0.05, 20.0))
    assert 0.05 <= t < 1.0 and math.isfinite(t)


def test_apply_temperature():
    probs = torch.tensor([[0.8, 0.2], [0.5, 0.5], [1.0, 0.0]], dtype=torch.float64)
    out = cal.apply_temperature(torch.log(probs), 2.0)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    assert out[0].tolist() == pytest.approx([2 / 3, 1 / 3])  # sqrt of the 4:1 odds
    assert out[1].tolist() == pytest.approx([0.5, 0.5]) and out[2].tolist() == pytest.approx([1.0, 0.0])
    log_np = torch.log(probs).numpy()  # contains -inf (log 0), which is accepted
    np.testing.assert_allclose(cal.apply_temperature(log_np, 1.0), probs.numpy(), atol=1e-12)
    assert isinstance(cal.apply_temperature(log_np, 0.5), np.ndarray)
    assert torch.allclose(out.sum(1), torch.ones(3, dtype=torch.float64))
    # logits and log-probabilities give the same result
    logits = torch.randn(5, 4, dtype=torch.float64)
    assert torch.allclose(cal.apply_temperature(logits, 1.7), cal.apply_temperature(torch.log_softmax(logits, 1), 1.7))


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def test_report_structure_and_values():
    g = torch.Generator().manual_seed(5)
    logits = 3.0 * torch.randn(3000, 5, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 2.0, 1), 1, generator=g).squeeze(1)
    probs = torch.softmax(logits, 1)  # overconfident by T = 2
    test, val = slice(0, 1500), slice(1500, 3000)
    r = cal.report(probs[test], labels[test], n_bins=10)
    assert set(r) == {"n_examples", "n_classes", "n_bins", "T1"}
    keys = {"accuracy", "error", "ece", "ece_all_class", "mce", "nll", "brier"}
    assert set(r["T1"]) == keys
    t1 = r["T1"]
    assert t1["ece"] == pytest.approx(cal.ece(probs[test], labels[test], 10))
    assert t1["ece_all_class"] == pytest.approx(cal.ece(probs[test], labels[test], 10, kind="all_class"))
    assert t1["mce"] == pytest.approx(cal.mce(probs[test], labels[test], 10))
    assert t1["nll"] == pytest.approx(cal.nll(probs[test], labels[test]))
    assert t1["brier"] == pytest.approx(cal.brier(probs[test], labels[test]))
    assert t1["accuracy"] + t1["error"] == pytest.approx(1.0)

    r = cal.report(probs[test], labels[test], val=(probs[val], labels[val]), n_bins=10)
    json.loads(json.dumps(r))
    assert set(r) == {"n_examples", "n_classes", "n_bins", "T1", "temperature", "Topt", "val"}
    assert set(r["Topt"]) == keys
    assert r["temperature"] == pytest.approx(2.0, rel=0.15)
    assert r["Topt"]["accuracy"] == r["T1"]["accuracy"]
    assert r["Topt"]["nll"] < r["T1"]["nll"] and r["Topt"]["ece"] < r["T1"]["ece"]
    assert r["val"]["nll_Topt"] <= r["val"]["nll_T1"]
    scaled = cal.apply_temperature(torch.log(probs[test]), r["temperature"])
    assert r["Topt"]["ece"] == pytest.approx(cal.ece(scaled, labels[test], 10))


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
P = np.array([[0.7, 0.3], [0.4, 0.6]])
Y = np.array([0, 1])

BAD_CALLS = {
    "probs 1-D": (lambda: cal.ece(np.array([0.5, 0.5]), Y), r"shape \(N, K\)"),
    "labels length": (lambda: cal.ece(P, np.array([0, 1, 1])), r"shape \(N,\) = \(2,\)"),
    "labels 2-D": (lambda: cal.nll(P, Y[:, None]), r"shape \(N,\)"),
    "rows not summing to 1": (lambda: cal.ece(np.array([[0.7, 0.2], [0.4, 0.6]]), Y), r"sum to 1 within 0.0001"),
    "logits instead of probs": (lambda: cal.brier(np.array([[2.0, -1.0], [0.0, 1.0]]), Y), r"not a probability"),
    "negative probability": (lambda: cal.accuracy(np.array([[1.2, -0.2], [0.4, 0.6]]), Y), r"in \[0, 1\]"),
    "label too large": (lambda: cal.ece(P, np.array([0, 2])), r"labels\[1\] = 2 .*\[0, 2\)"),
    "negative label": (lambda: cal.mce(P, np.array([-1, 0])), r"labels\[0\] = -1 .*\[0, 2\)"),
    "float labels": (lambda: cal.nll(P, np.array([0.0, 1.0])), r"integer"),
    "n_bins 0": (lambda: cal.ece(P, Y, n_bins=0), r"n_bins must be an integer >= 1; got 0"),
    "n_bins float": (lambda: cal.bin_stats(P, Y, n_bins=2.5), r"n_bins .* got 2.5"),
    "empty probs": (lambda: cal.ece(np.zeros((0, 3)), np.zeros(0, dtype=int)), r"empty"),
    "empty classes": (lambda: cal.nll(np.zeros((2, 0)), Y), r"empty"),
    "NaN probs": (lambda: cal.ece(np.array([[np.nan, 0.5], [0.4, 0.6]]), Y), r"NaN"),
    "NaN torch": (lambda: cal.brier(torch.tensor([[0.5, 0.5], [float("nan"), 0.6]]), torch.tensor([0, 1])), r"NaN"),
    "unknown kind": (lambda: cal.ece(P, Y, kind="classwise"), r"'classwise'.*'top_label', 'all_class'"),
    "unknown kind mce": (lambda: cal.mce(P, Y, kind="top"), r"accepted kinds"),
    "unknown reduction": (lambda: cal.predictive_entropy(P, reduction="max"), r"'max'"),
    "T zero": (lambda: cal.apply_temperature(np.log(P), 0.0), r"positive finite.*0.0"),
    "T nan": (lambda: cal.apply_temperature(np.log(P), float("nan")), r"positive finite"),
    "fit NaN": (lambda: cal.fit_temperature(np.array([[np.nan, 0.0], [0.0, 1.0]]), Y), r"NaN"),
    "fit +inf": (lambda: cal.fit_temperature(np.array([[np.inf, 0.0], [0.0, 1.0]]), Y), r"\+inf"),
    "fit label range": (lambda: cal.fit_temperature(np.log(P), np.array([0, 5])), r"labels_val\[1\] = 5"),
    "fit empty": (lambda: cal.fit_temperature(np.zeros((0, 2)), np.zeros(0, dtype=int)), r"empty"),
    "fit shape": (lambda: cal.fit_temperature(np.log(P), Y[:1]), r"shape"),
    "fit bounds": (lambda: cal.fit_temperature(np.log(P), Y, bounds=(0.0, 10.0)), r"bounds"),
    "fit max_iter": (lambda: cal.fit_temperature(np.log(P), Y, max_iter=-1), r"max_iter"),
    "report val not pair": (lambda: cal.report(P, Y, val=P), r"pair"),
    "report val classes": (lambda: cal.report(P, Y, val=(np.full((2, 4), 0.25), Y)), r"K = 4"),
    "report n_bins": (lambda: cal.report(P, Y, n_bins=-3), r"n_bins .* got -3"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_raises(name):
    call, match = BAD_CALLS[name]
    with pytest.raises(ValueError, match=match):
        call()


def test_docstring_examples():
    import doctest

    from bayeswrap.evaluation import calibration as evaluation_calibration

    result = doctest.testmod(evaluation_calibration, extraglobs={"torch": torch, "np": np})
    assert result.attempted > 10 and result.failed == 0
