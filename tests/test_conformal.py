"""Split conformal prediction sets: coverage on exchangeable data, naive references, MAPIE, and the CLI report."""

import csv
import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import bayeswrap.app.cli as cli
from bayeswrap.app.build import build, eval_loader
from bayeswrap.app.config import load_run_config
from bayeswrap.evaluation import conformal
from bayeswrap.predictive import sample_probs_loader

VARIANTS = [("lac", False), ("aps", False), ("aps", True), ("raps", False), ("raps", True)]
FAST = ["--progress", "false", "--batch-size", "64"]


def _calibrated(rng, shape, k, concentration=0.5):
    """Dirichlet probabilities and labels drawn from them: a calibrated classifier on exchangeable data."""
    p = rng.dirichlet(np.full(k, concentration), size=shape)
    y = (rng.random(shape)[..., None] > p.cumsum(-1)).sum(-1).clip(max=k - 1)
    return p, y


def _options(score, randomized, seed=0):
    return dict(score=score, randomized=randomized, k_reg=2, lam=0.05,
                generator=torch.Generator().manual_seed(seed) if randomized else None)


@pytest.mark.parametrize("score, randomized", VARIANTS)
def test_coverage_is_k_over_n_plus_1_on_exchangeable_data(score, randomized):
    """Mean test coverage over R independent calibration/test draws equals ceil((n+1)(1-α))/(n+1) within 4 se.

    Without ties, the coverage given the calibration set is Beta(k, n + 1 - k) and the m test hits are
    binomial given it, so the per-draw coverage has variance Var(C) + E[C(1 - C)]/m (Vovk 2012).
    """
    rng = np.random.default_rng(1)
    R, n, m, K, alpha = 400, 49, 100, 10, 0.1  # se ~ 0.0026: an off-by-one quantile (1/(n+1) = 0.02) fails
    p, y = _calibrated(rng, (R, n + m), K)
    opts = _options(score, randomized)
    cover = []
    for r in range(R):
        q = conformal.calibrate(p[r, :n], y[r, :n], alpha, **opts)
        sets = conformal.prediction_sets(p[r, n:], q, **opts)
        cover.append(conformal.coverage_report(sets, y[r, n:])["coverage"])
    k = math.ceil((n + 1) * (1 - Fraction("0.1")))
    a, b = k, n + 1 - k
    mean = a / (a + b)
    var_c = a * b / ((a + b) ** 2 * (a + b + 1))
    var = var_c + (mean - (var_c + mean**2)) / m
    se = math.sqrt(var / R)
    assert mean == 0.9
    assert abs(np.mean(cover) - mean) < 4 * se, (np.mean(cover), mean, se)
    assert np.mean(cover) >= 1 - alpha - 4 * se
    # the spread over draws is the Beta-binomial one, not smaller (a too-tight spread would mean a biased quantile)
    assert np.std(cover, ddof=1) == pytest.approx(math.sqrt(var), rel=0.25)


def test_digits_logistic_regression_coverage_over_random_splits():
    """Real data: sklearn digits, a logistic regression's probabilities, 100 random calibration/test splits."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(y))
    train, pool = order[:400], order[400:]
    model = LogisticRegression(max_iter=300, C=0.01).fit(x[train] / 16, y[train])
    probs, labels = model.predict_proba(x[pool] / 16), y[pool]
    n, alpha = 500, 0.1
    for score in ("lac", "aps", "raps"):
        cover, size = [], []
        for r in range(100):
            idx = rng.permutation(len(labels))
            cal, test = idx[:n], idx[n:]
            report = conformal.conformal_report(probs[cal], labels[cal], probs[test], labels[test], alpha, score=score)
            cover.append(report["coverage"])
            size.append(report["mean_set_size"])
        se = np.std(cover, ddof=1) / math.sqrt(len(cover))
        assert 1 - alpha - 3 * se <= np.mean(cover) <= 1 - alpha + 1 / (n + 1) + 3 * se, (score, np.mean(cover), se)
        assert report["target_coverage"] == math.ceil(0.9 * (n + 1)) / (n + 1)
        assert 1 <= np.mean(size) < 3  # informative sets on a ~93 % accurate model


def _naive_scores(p, score, k_reg, lam, u):
    """One example at a time: rank labels by decreasing probability (ties by index) and add up the mass."""
    out = np.empty_like(p)
    for i in range(p.shape[0]):
        ranked = sorted(range(p.shape[1]), key=lambda j: (-p[i, j], j))
        mass = 0.0
        for rank, j in enumerate(ranked, start=1):
            if score == "lac":
                out[i, j] = 1.0 - p[i, j]
                continue
            mass += p[i, j]
            out[i, j] = mass - (1.0 - u[i]) * p[i, j] + (lam * max(rank - k_reg, 0) if score == "raps" else 0.0)
    return out


@pytest.mark.parametrize("score, randomized", VARIANTS)
def test_threshold_and_sets_equal_a_naive_reference(score, randomized):
    rng = np.random.default_rng(2)
    p, y = _calibrated(rng, 157, 7)
    p[:10, :3] = p[:10, :3].mean(1, keepdims=True)  # tied probabilities are ranked by class index
    alpha = 0.15
    u = (torch.rand(len(y), 1, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).squeeze(1).numpy()
         if randomized else np.ones(len(y)))
    s = _naive_scores(p, score, 2, 0.05, u)
    true = sorted(s[i, y[i]] for i in range(len(y)))
    k = next(k for k in range(1, len(y) + 2) if k >= (len(y) + 1) * (1 - Fraction("0.15")))
    q = conformal.calibrate(p, y, alpha, **_options(score, randomized))
    assert q == true[k - 1]
    sets = conformal.prediction_sets(p, q, **_options(score, randomized))
    assert sets.tolist() == [[bool(s[i, j] <= q) for j in range(7)] for i in range(len(y))]
    assert conformal.conformity_scores(p, **_options(score, randomized)).numpy() == pytest.approx(s, abs=0)


def test_quantile_index_is_exact_and_a_small_calibration_set_gives_full_sets():
    assert conformal.quantile_index(99, 0.45) == 55 and math.ceil(100 * (1 - 0.45)) == 56  # float rounding
    assert conformal.quantile_index(9, 0.1) == 9 and conformal.quantile_index(8, 0.1) == 9
    assert conformal.quantile_index(1000, 0.1) == 901
    rng = np.random.default_rng(3)
    p, y = _calibrated(rng, 20, 4)
    with pytest.warns(UserWarning, match="needs at least 9 calibration examples, got n=8"):
        assert conformal.calibrate(p[:8], y[:8], 0.1) == math.inf
    q9 = conformal.calibrate(p[:9], y[:9], 0.1, score="lac")  # k = n = 9: the largest score
    assert q9 == max(1 - p[i, y[i]] for i in range(9))
    with pytest.warns(UserWarning):
        report = conformal.conformal_report(p[:8], y[:8], p[8:], y[8:], 0.1, score="raps")
    assert report["full_sets"] is True and report["threshold"] is None and report["target_coverage"] == 1.0
    assert report["coverage"] == 1.0 and report["mean_set_size"] == 4.0
    assert report["by_size"] == {"4": {"count": 12, "coverage": 1.0}}
    json.dumps(report, allow_nan=False)  # metrics.json stays valid JSON


@pytest.mark.parametrize("score, randomized", VARIANTS)
def test_sets_are_nested_in_alpha(score, randomized):
    rng = np.random.default_rng(4)
    p, y = _calibrated(rng, 600, 8)
    alphas = (0.4, 0.2, 0.1, 0.05, 0.02)
    thresholds = [conformal.calibrate(p[:300], y[:300], a, **_options(score, randomized, seed=1)) for a in alphas]
    sets = [conformal.prediction_sets(p[300:], q, **_options(score, randomized, seed=2)) for q in thresholds]
    assert thresholds == sorted(thresholds)
    for small, large in zip(sets, sets[1:]):
        assert bool((small <= large).all())  # C_α ⊆ C_α' for α > α'
    sizes = [float(s.sum(1).double().mean()) for s in sets]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]


def test_oracle_model_gives_singletons():
    """A model that puts 0.99 on the true label: every score calibrates to singleton sets with full coverage."""
    K, n = 6, 200
    y = torch.arange(2 * n) % K
    p = torch.full((2 * n, K), 0.01 / (K - 1), dtype=torch.float64).scatter_(1, y[:, None], 0.99)
    for score in conformal.SCORES:
        report = conformal.conformal_report(p[:n], y[:n], p[n:], y[n:], 0.1, score=score)
        assert report["coverage"] == 1.0 and report["mean_set_size"] == 1.0, score
        assert report["by_size"] == {"1": {"count": n, "coverage": 1.0}}
    one_hot = torch.nn.functional.one_hot(y, K).double()
    for score in ("lac", "raps"):
        assert conformal.conformal_report(one_hot[:n], y[:n], one_hot[n:], y[n:], 0.1, score=score)[
            "mean_set_size"] == 1.0
    # documented: without randomization, zero-probability labels share the APS score 1 of the true label
    assert conformal.conformal_report(one_hot[:n], y[:n], one_hot[n:], y[n:], 0.1)["mean_set_size"] == K


def test_lac_matches_mapie():
    mapie = pytest.importorskip("mapie")
    from mapie.classification import SplitConformalClassifier
    from mapie.metrics.classification import classification_coverage_score, classification_mean_width_score
    from sklearn.base import BaseEstimator, ClassifierMixin

    class Identity(ClassifierMixin, BaseEstimator):  # the "model" is the precomputed predictive
        def fit(self, X, y):
            self.classes_ = np.arange(np.shape(X)[1])
            return self

        def predict_proba(self, X):
            return np.asarray(X)

        def predict(self, X):
            return np.asarray(X).argmax(1)

    assert mapie.__version__
    rng = np.random.default_rng(5)
    p, y = _calibrated(rng, 900, 5)
    for alpha in (0.05, 0.1, 0.3):
        ref = SplitConformalClassifier(Identity().fit(p, y), confidence_level=1 - alpha, conformity_score="lac",
                                       prefit=True).conformalize(p[:400], y[:400])
        _, ref_sets = ref.predict_set(p[400:])
        q = conformal.calibrate(p[:400], y[:400], alpha, score="lac")
        assert q == pytest.approx(float(ref._mapie_classifier.conformity_score_function_.quantiles_[0]), abs=1e-15)
        sets = conformal.prediction_sets(p[400:], q, score="lac")
        assert np.array_equal(sets.numpy(), ref_sets[:, :, 0])
        report = conformal.coverage_report(sets, y[400:])
        assert report["coverage"] == pytest.approx(float(classification_coverage_score(y[400:], ref_sets)[0]))
        assert report["mean_set_size"] == pytest.approx(float(classification_mean_width_score(ref_sets)[0]))


def test_coverage_report_against_a_loop():
    rng = np.random.default_rng(6)
    sets = rng.random((300, 5)) < rng.random((300, 1))
    y = rng.integers(0, 5, 300)
    report = conformal.coverage_report(torch.from_numpy(sets), y)
    covered = [bool(sets[i, y[i]]) for i in range(300)]
    sizes = [int(sets[i].sum()) for i in range(300)]
    assert report["coverage"] == pytest.approx(sum(covered) / 300, abs=1e-15)
    assert report["coverage_se"] == pytest.approx(math.sqrt(report["coverage"] * (1 - report["coverage"]) / 300))
    assert report["mean_set_size"] == pytest.approx(sum(sizes) / 300)
    assert report["empty_fraction"] == pytest.approx(sizes.count(0) / 300)
    ordered = sorted(sizes)
    assert report["set_size_percentiles"] == {str(q): ordered[math.ceil(q / 100 * 300) - 1] for q in (50, 90, 99)}
    assert report["by_size"] == {str(s): {"count": sizes.count(s), "coverage": pytest.approx(
        sum(c for c, z in zip(covered, sizes) if z == s) / sizes.count(s))} for s in sorted(set(sizes))}
    assert conformal.coverage_report(sets.astype(np.int64), y) == report  # 0/1 masks too


@pytest.mark.parametrize("call, message", [
    (lambda p, y: conformal.calibrate(p, y, 0.0), "alpha=0.0 must be a number in (0, 1)"),
    (lambda p, y: conformal.calibrate(p, y, 1.0), "alpha=1.0 must be a number in (0, 1)"),
    (lambda p, y: conformal.calibrate(p, y, float("nan")), "alpha=nan must be"),
    (lambda p, y: conformal.calibrate(p, y, True), "alpha=True must be"),
    (lambda p, y: conformal.calibrate(p, y, score="thr"), "score='thr' is not known; accepted: lac, aps, raps"),
    (lambda p, y: conformal.calibrate(p, y, score="lac", randomized=True), "accepted with score='lac'"),
    (lambda p, y: conformal.calibrate(p, y, score="raps", k_reg=-1), "k_reg=-1 must be an integer >= 0"),
    (lambda p, y: conformal.calibrate(p, y, score="raps", lam=-0.1), "lam=-0.1 must be a finite number >= 0"),
    (lambda p, y: conformal.calibrate(p * 0.5, y), "rows of probs must sum to 1"),
    (lambda p, y: conformal.calibrate(p, y + 4), "labels_val[0] = 4 is out of range; accepted: integers in [0, 4)"),
    (lambda p, y: conformal.prediction_sets(p, float("nan")), "threshold=nan must be"),
    (lambda p, y: conformal.coverage_report(p, y), "sets must be a boolean (or 0/1) mask"),
    (lambda p, y: conformal.conformal_report(p, y, p[:, :3] / p[:, :3].sum(1, keepdims=True), y % 3),
     "probs_val has K = 4 classes and probs_test K = 3"),
])
def test_bad_input_is_refused_with_the_accepted_values(call, message):
    p, y = _calibrated(np.random.default_rng(7), 30, 4)
    with pytest.raises(ValueError) as err:
        call(p, y)
    assert message in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--conformal-alpha", "1.5"], "conformal_alpha=1.5 is out of range; accepted: a number in (0, 1)"),
    (["--conformal-score", "thr"], "conformal_score='thr' is not known; accepted: lac, aps, raps"),
])
def test_cli_refuses_bad_conformal_options_before_loading_data(tmp_path, capsys, args, message):
    out = tmp_path / "runs"
    assert cli.main(["fit", "--out-dir", str(out), "--epochs", "1", "--dataset", "pets", "--data-root",
                     str(tmp_path / "none"), *FAST, *args]) == 2  # refused before it looks for the missing data
    assert message in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


def test_compare_writes_coverage_and_set_size(tmp_path):
    """The run's conformal report: RAPS threshold from the validation predictive, coverage on test (naive recount)."""
    out = tmp_path / "runs"
    assert cli.main(["compare", "--methods", "map", "--epochs", "1", "--out-dir", str(out), "--num-samples", "0",
                     "--shift-rotations", "", "--shift-noise", "", "--no-tune", "--conformal-score", "raps",
                     "--conformal-alpha", "0.2", "--optimizer", "adamw", "--lr", "0.01", *FAST]) == 0
    base = out / "compare-digits-mlp"
    metrics = json.loads((base / "map" / "metrics.json").read_text())
    report = metrics["final"]["0"]["conformal"]
    assert {k: report[k] for k in ("alpha", "score", "randomized", "k_reg", "lam")} == {
        "alpha": 0.2, "score": "raps", "randomized": False, "k_reg": 1, "lam": 0.01}
    # recompute from the saved posterior: the predictive on val and test, naive scores, quantile and recount
    cfg = load_run_config(base / "map" / "config.yaml")
    splits, _, bnn, _, _ = build(cfg, for_evaluation=True)
    bnn.load_state_dict(torch.load(base / "map" / "best.pt", weights_only=True))
    bnn.eval()
    (pv, yv), (pt, yt) = [sample_probs_loader(bnn, eval_loader(d, cfg), 0) for d in (splits.val, splits.test)]
    pv, pt, yv, yt = pv[0].double().numpy(), pt[0].double().numpy(), yv.numpy(), yt.numpy()
    n = len(yv)
    sv = _naive_scores(pv, "raps", 1, 0.01, np.ones(n))
    k = math.ceil((n + 1) * (1 - Fraction("0.2")))
    q = sorted(sv[i, yv[i]] for i in range(n))[k - 1]
    assert report["n_calibration"] == n > 100 and report["threshold"] == pytest.approx(q, rel=1e-12)
    assert report["target_coverage"] == k / (n + 1)
    st = _naive_scores(pt, "raps", 1, 0.01, np.ones(len(yt)))
    covered = [st[i, yt[i]] <= q for i in range(len(yt))]
    assert report["n_examples"] == len(yt) == metrics["final"]["0"]["n_examples"]
    assert report["coverage"] == pytest.approx(sum(covered) / len(yt), abs=1e-12)
    assert report["mean_set_size"] == pytest.approx(float((st <= q).sum()) / len(yt), abs=1e-12)
    assert abs(report["coverage"] - 0.8) < 4 * report["coverage_se"] + 1 / (n + 1)
    row = next(csv.DictReader(open(base / "comparison.csv")))
    assert float(row["coverage"]) == pytest.approx(report["coverage"], rel=1e-12)
    assert float(row["set_size"]) == pytest.approx(report["mean_set_size"], rel=1e-12)
    assert (base / "comparison_full.md").read_text().splitlines()[0].endswith(
        "| ood_auroc_mi | coverage | set_size | note |")
    assert cli.evaluate_run(base / "map", 0)["conformal"] == report  # evaluate recomputes the same sets
