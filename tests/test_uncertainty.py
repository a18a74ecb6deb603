"""Per-example uncertainty measures, OOD metrics and selective prediction, against known answers."""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import norm
from sklearn.metrics import average_precision_score, roc_auc_score

import bayeswrap as bw
import bayeswrap.uncertainty as U
from bayeswrap.evaluation import ood, selective, uncertainty
from bayeswrap.uncertainty import (
    aurc,
    aurc_optimal,
    excess_aurc,
    expected_entropy,
    ga_cutoff,
    ga_uncertainty,
    gamma_curve,
    mutual_information,
    ood_metrics,
    predictive_entropy,
    predictive_std,
    regression_uncertainty,
    risk_coverage,
    variation_ratio,
)

LN2 = math.log(2.0)


def dirichlet_samples(seed: int, s: int, b: int, k: int, concentration: float = 0.5) -> np.ndarray:
    """(S, B, K) random probabilities; a small concentration gives near-one-hot rows."""
    return np.random.default_rng(seed).dirichlet(np.full(k, concentration), size=(s, b))


def votes_to_probs(votes: list[list[int]], k: int) -> torch.Tensor:
    """(S, B) argmax votes -> (S, B, K) one-hot probabilities."""
    return F.one_hot(torch.tensor(votes), k).double()


# S = 2 samples, B = 2 examples, K = 3 classes
HAND = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]],
                     [[0.5, 0.0, 0.5], [0.0, 0.0, 1.0]]])


# --------------------------------------------------------------------------------------------------
# hand-computed examples
# --------------------------------------------------------------------------------------------------
def test_entropy_measures_by_hand():
    # example 0: mean = (0.5, 0.25, 0.25): H = -(0.5 ln 0.5 + 2 * 0.25 ln 0.25) = 0.5 ln2 + ln2 = 1.5 ln2
    #            each sample is a fair coin over two classes: H = ln2, so E[H] = ln2 and MI = 0.5 ln2
    # example 1: mean = (0.5, 0, 0.5): H = ln2; each sample is one-hot: E[H] = 0, MI = ln2
    torch.testing.assert_close(predictive_entropy(HAND), torch.tensor([1.5 * LN2, LN2], dtype=torch.float64))
    torch.testing.assert_close(expected_entropy(HAND), torch.tensor([LN2, 0.0], dtype=torch.float64))
    torch.testing.assert_close(mutual_information(HAND), torch.tensor([0.5 * LN2, LN2], dtype=torch.float64))


def test_variation_ratio_by_hand():
    # HAND: example 0 votes (0, 0) (ties -> lowest index): C = 2, VR = 1 - 2/2 = 0
    #       example 1 votes (0, 2): C = 1, VR = 1 - 1/2 = 0.5
    torch.testing.assert_close(variation_ratio(HAND), torch.tensor([0.0, 0.5], dtype=torch.float64))
    # S = 5 votes (0, 0, 1, 2, 0): C = 3, VR = 1 - 3/5 = 0.4; all agree: 0; S = 1: 0
    sp = votes_to_probs([[0, 1], [0, 1], [1, 1], [2, 1], [0, 1]], 3)
    torch.testing.assert_close(variation_ratio(sp), torch.tensor([0.4, 0.0], dtype=torch.float64))
    torch.testing.assert_close(variation_ratio(sp[:1]), torch.tensor([0.0, 0.0], dtype=torch.float64))


def test_predictive_std_by_hand():
    # example 0: mean (0.5, 0.25, 0.25) -> class 0, whose samples are (0.5, 0.5): std 0
    # example 1: mean (0.5, 0, 0.5) -> class 0 (tie -> lowest), samples (1, 0): sqrt((0.5^2 + 0.5^2) / 1)
    torch.testing.assert_close(predictive_std(HAND), torch.tensor([0.0, math.sqrt(0.5)], dtype=torch.float64))
    # reduction="none": class 1 of example 0 has samples (0.5, 0): sqrt(2 * 0.25^2) = sqrt(0.125)
    expected = torch.tensor([[0.0, math.sqrt(0.125), math.sqrt(0.125)],
                             [math.sqrt(0.5), 0.0, math.sqrt(0.5)]], dtype=torch.float64)
    torch.testing.assert_close(predictive_std(HAND, reduction="none"), expected)


def test_predictive_std_against_numpy_loop():
    for seed, (s, b, k) in enumerate([(2, 7, 3), (10, 20, 5), (33, 4, 2)]):
        sp = dirichlet_samples(seed, s, b, k)
        got = predictive_std(sp)
        for i in range(b):
            pred = int(np.argmax(sp[:, i].mean(0)))
            assert got[i].item() == pytest.approx(np.std(sp[:, i, pred], ddof=1), abs=1e-12)
        np.testing.assert_allclose(predictive_std(sp, reduction="none").numpy(), sp.std(axis=0, ddof=1),
                                   atol=1e-12)


# --------------------------------------------------------------------------------------------------
# invariants on random samples
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 7, 4), (2, 5, 3), (10, 50, 10), (30, 20, 2)])
def test_entropy_invariants(seed, shape):
    s, b, k = shape
    sp = dirichlet_samples(seed, *shape, concentration=0.3)
    sp[0, 0] = np.eye(k)[0]  # an exactly one-hot row: 0 log 0 = 0
    h, eh, mi = predictive_entropy(sp), expected_entropy(sp), mutual_information(sp)
    for t in (h, eh, mi):
        assert t.shape == (b,) and t.dtype == torch.float64 and t.device.type == "cpu"
    assert (mi >= 0).all() and (mi <= h).all() and (eh >= 0).all()
    assert (h <= math.log(k) + 1e-12).all()
    torch.testing.assert_close(h, eh + mi, rtol=0, atol=1e-12)
    vr = variation_ratio(sp)
    assert (vr >= 0).all() and (vr <= 1 - 1 / k + 1e-12).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_identical_samples_have_no_epistemic_uncertainty(seed):
    one = dirichlet_samples(seed, 1, 40, 6)
    sp = np.repeat(one, 9, axis=0)  # S = 9 identical samples
    assert mutual_information(sp).abs().max() <= 1e-12
    assert (variation_ratio(sp) == 0).all()
    assert predictive_std(sp).abs().max() <= 1e-12
    assert predictive_std(sp, reduction="none").abs().max() <= 1e-12
    torch.testing.assert_close(predictive_entropy(sp), expected_entropy(sp), rtol=0, atol=1e-12)


def test_inputs_torch_any_dtype_numpy_and_device():
    sp64 = dirichlet_samples(5, 4, 6, 3)
    sp32 = torch.tensor(sp64, dtype=torch.float32)
    for fn in (predictive_entropy, expected_entropy, mutual_information, variation_ratio, predictive_std):
        a, b = fn(sp64), fn(sp32)
        assert a.dtype == b.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    if torch.cuda.is_available():
        got = mutual_information(sp32.cuda())
        assert got.device.type == "cpu"
        torch.testing.assert_close(got, mutual_information(sp32))


# --------------------------------------------------------------------------------------------------
# Gaussian-approximation uncertainty, γ-metric, cutoff choice
# --------------------------------------------------------------------------------------------------
# S = 5 samples, K = 5 classes; columns are examples with G = C - 1 = 0, 1, 2, 3, 4 agreeing other samples
GA_VOTES = [[0, 0, 0, 0, 0],
            [1, 0, 0, 0, 0],
            [2, 1, 0, 0, 0],
            [3, 2, 1, 0, 0],
            [4, 3, 2, 1, 0]]


def test_ga_uncertainty_against_scipy():
    sp = votes_to_probs(GA_VOTES, 5)
    n = 4  # S - 1
    for cutoff in (-1.0, 0.0, 0.5, 1.5, 2.0, 2.5, 3.5, 4.5, 7.0):
        expected = []
        for g in range(5):
            p_hat = g / n
            if 0 < p_hat < 1:
                expected.append(norm.cdf(cutoff, loc=n * p_hat, scale=math.sqrt(n * p_hat * (1 - p_hat))))
            else:  # point mass at n * p_hat
                expected.append(1.0 if n * p_hat < cutoff else 0.0)
        np.testing.assert_allclose(ga_uncertainty(sp, cutoff).numpy(), expected, rtol=0, atol=1e-12)


def test_ga_uncertainty_lower_tail_keeps_relative_accuracy():
    # S = 1001 samples of K = 2 classes: 900 vote for class 0 (G = 899, p̂ = 0.899, sd ≈ 9.53); the cutoff 800.5
    # is z ≈ -10.3 standard deviations below the mean, where (1 + erf)/2 cancels to 0 but Φ is ≈ 3.2e-25
    votes = torch.zeros(1001, dtype=torch.long)
    votes[900:] = 1
    sp = torch.nn.functional.one_hot(votes, 2).double()[:, None, :]
    g, n = 899, 1000
    expected = norm.cdf(800.5, loc=g, scale=math.sqrt(g * (n - g) / n))
    assert 0 < expected < 1e-20
    np.testing.assert_allclose(ga_uncertainty(sp, 800.5).numpy(), [expected], rtol=1e-9)


def test_ga_uncertainty_by_hand():
    sp = votes_to_probs(GA_VOTES, 5)
    u = ga_uncertainty(sp, 2.5)
    # G = 2: p = 1/2, var = 4 * 1/4 = 1: Phi((2.5 - 2) / 1) = Phi(0.5) = 0.691462...
    assert u[2].item() == pytest.approx(0.6914624612740131, abs=1e-12)
    # G = 1: p = 1/4, var = 4 * 1/4 * 3/4 = 0.75: Phi(1.5 / sqrt(0.75)) = Phi(1.7320508) = 0.958368...
    assert u[1].item() == pytest.approx(0.9583677416682821, abs=1e-12)
    # p = 0 (G = 0): point mass at 0 < 2.5 -> 1; p = 1 (G = 4): point mass at 4 >= 2.5 -> 0
    assert u[0].item() == 1.0 and u[4].item() == 0.0
    # at the point mass itself: P(G < 0) = 0 for G = 0; P(G < 4) = 0 for G = 4
    assert ga_uncertainty(sp, 0.0)[0].item() == 0.0 and ga_uncertainty(sp, 4.0)[4].item() == 0.0
    # S = 2: G is 0 (disagree, point mass at 0) or 1 (agree, point mass at 1)
    assert ga_uncertainty(votes_to_probs([[0, 0], [1, 0]], 2), 0.5).tolist() == [1.0, 0.0]


def test_gamma_curve_by_hand():
    # misclassified u = (0.2, 0.4, 0.6, 0.8); numpy's linear quantile at position (4 - 1) * alpha:
    #   alpha 0.1 -> 0.3 -> 0.2 + 0.3 * 0.2 = 0.26;   alpha 0.25 -> 0.75 -> 0.35
    #   alpha 0.5 -> 1.5 -> 0.4 + 0.5 * 0.2 = 0.50;   alpha 0.9 -> 2.7 -> 0.6 + 0.7 * 0.2 = 0.74
    # correct u = (0.1, 0.3, 0.34, 0.55): strictly below 0.26: 1; 0.35: 3; 0.5: 3; 0.74: 4 (of 4)
    u = torch.tensor([0.2, 0.1, 0.4, 0.3, 0.6, 0.34, 0.8, 0.55], dtype=torch.float64)
    correct = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    alphas = [0.1, 0.25, 0.5, 0.9]
    np.testing.assert_allclose(np.quantile([0.2, 0.4, 0.6, 0.8], alphas), [0.26, 0.35, 0.5, 0.74])
    got = gamma_curve(u, correct, alphas)
    assert got.dtype == torch.float64 and got.shape == (4,)
    assert got.tolist() == [0.25, 0.75, 0.75, 1.0]
    assert gamma_curve(u.numpy(), correct.bool(), 0.9).tolist() == [1.0]  # a scalar level -> shape (1,)


def test_gamma_curve_perfect_separator():
    rng = np.random.default_rng(0)
    u = np.concatenate([rng.uniform(0, 1, 300), rng.uniform(2, 3, 40)])
    correct = np.r_[np.ones(300, bool), np.zeros(40, bool)]
    assert gamma_curve(u, correct, np.linspace(0.01, 0.99, 25)).tolist() == [1.0] * 25


def test_ga_cutoff_doctest_example():
    # errors have G = 4, 4, 2 and the correct examples G = 3, 3, 4 (S = 5). For c <= 3.5 the two errors with
    # G = 4 >= c get U = 0, so the error median K_0.5 = 0 and nothing is strictly below it (γ = 0); at c = 4.5
    # the errors get U = (1, 1, Phi(2.5)) -> K_0.5 = 1 and the correct ones (Phi(1.5/sqrt(.75)) x2, 1): γ = 2/3
    votes = [[0, 1, 0, 0, 1, 0], [0, 1, 0, 0, 1, 0], [0, 1, 0, 0, 1, 0], [0, 1, 1, 0, 1, 0], [0, 1, 1, 1, 0, 0]]
    sp = votes_to_probs(votes, 2)
    correct = torch.tensor([False, False, False, True, True, True])
    assert ga_cutoff(sp, correct, alpha=0.5) == 4.5
    assert gamma_curve(ga_uncertainty(sp, 4.5), correct, 0.5).item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_ga_cutoff_is_brute_force_argmax(seed):
    rng = np.random.default_rng(seed)
    s, b, k = int(rng.integers(2, 12)), 80, int(rng.integers(2, 5))
    sp = dirichlet_samples(seed, s, b, k, concentration=0.4)
    pred = sp.mean(0).argmax(-1)
    labels = np.where(rng.uniform(size=b) < 0.7, pred, rng.integers(0, k, b))
    correct = pred == labels
    for alpha in (0.1, 0.5):
        best_c, best_g = None, -1.0
        for c in np.arange(s) + 0.5:  # 0.5, 1.5, ..., S - 0.5; strict > keeps the smallest c on ties
            g = gamma_curve(ga_uncertainty(sp, c), correct, alpha).item()
            if g > best_g:
                best_c, best_g = float(c), g
        got = ga_cutoff(sp, correct, alpha)
        assert isinstance(got, float) and got == best_c


# --------------------------------------------------------------------------------------------------
# regression
# --------------------------------------------------------------------------------------------------
def test_regression_uncertainty_by_hand():
    # S = 3 samples of B = 1 example with D = 2 outputs: output 0 = (1, 2, 3): var 2/3; output 1 = (0, 0, 0): 0
    means = torch.tensor([[[1.0, 0.0]], [[2.0, 0.0]], [[3.0, 0.0]]])
    r = regression_uncertainty(means, torch.tensor([0.1, 0.5]))  # per-output noise variances
    torch.testing.assert_close(r.epistemic, torch.tensor([[2 / 3, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(r.aleatoric, torch.tensor([[0.1, 0.5]], dtype=torch.float64))
    torch.testing.assert_close(r.total, torch.tensor([[0.1 + 2 / 3, 0.5]], dtype=torch.float64))
    aleatoric, epistemic, total = regression_uncertainty(means.numpy(), 0)
    assert aleatoric.shape == (1, 2) and (aleatoric == 0).all() and torch.equal(total, epistemic)


def test_regression_total_matches_bayeswrap_predictive():
    torch.manual_seed(0)
    bnn = bw.wrap(torch.nn.Linear(3, 2), "vi", num_data=10, likelihood="gaussian", noise_std=0.5, init_std=0.3)
    x = torch.randn(6, 3)
    with torch.no_grad():
        outs = bnn.sample_logits(x, 9, generator=torch.Generator().manual_seed(1))
    _, var = bnn.predict(x, 9, generator=torch.Generator().manual_seed(1))
    r = regression_uncertainty(outs, 0.5**2)
    assert r.epistemic.min() > 1e-3  # the posterior samples really differ
    torch.testing.assert_close(r.total, var.double(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# OOD metrics
# --------------------------------------------------------------------------------------------------
def fpr_at_95_scan(score_in: np.ndarray, score_out: np.ndarray) -> float:
    """Thresholds from high to low; the first where >= 95% of OOD scores are >= it."""
    for t in np.unique(np.concatenate([score_in, score_out]))[::-1]:
        if np.mean(score_out >= t) >= 0.95:
            return float(np.mean(score_in >= t))
    raise AssertionError("unreachable")


# torchmetrics (the implementation) counts in float32; scikit-learn (the oracle) in float64
SKLEARN_TOL = 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ties", [False, True])
def test_ood_metrics_match_sklearn(seed, ties):
    rng = np.random.default_rng(seed)
    s_in, s_out = rng.normal(0, 1, 300), rng.normal(1, 1, 120)
    if ties:
        s_in, s_out = np.round(s_in), np.round(s_out)
    m = ood_metrics(torch.tensor(s_in), s_out)
    labels = np.r_[np.zeros(300), np.ones(120)]
    scores = np.r_[s_in, s_out]
    assert set(m) == {"auroc", "aupr_in", "aupr_out", "fpr95"}
    assert all(isinstance(v, float) for v in m.values())
    assert m["auroc"] == pytest.approx(roc_auc_score(labels, scores), abs=SKLEARN_TOL)
    assert m["aupr_out"] == pytest.approx(average_precision_score(labels, scores), abs=SKLEARN_TOL)
    assert m["aupr_in"] == pytest.approx(average_precision_score(1 - labels, -scores), abs=SKLEARN_TOL)
    assert m["fpr95"] == pytest.approx(fpr_at_95_scan(s_in, s_out), abs=SKLEARN_TOL)
    swapped = ood_metrics(s_out, s_in)
    assert swapped["auroc"] == pytest.approx(1 - m["auroc"], abs=SKLEARN_TOL)
    mirrored = ood_metrics(-s_out, -s_in)  # same ranking problem with the roles of in and out exchanged
    assert mirrored["auroc"] == pytest.approx(m["auroc"], abs=SKLEARN_TOL)
    assert mirrored["aupr_in"] == pytest.approx(m["aupr_out"], abs=SKLEARN_TOL)
    assert mirrored["aupr_out"] == pytest.approx(m["aupr_in"], abs=SKLEARN_TOL)


@pytest.mark.parametrize("shift, scale", [(1e3, 1.0), (-50.0, 1.0), (0.0, 1e-9), (1e6, 1e-3)])
def test_ood_metrics_depend_only_on_the_order(shift, scale):
    # torchmetrics reads scores outside [0, 1] as logits and applies a sigmoid, which saturates (float64 at
    # about 37): the scores must reach it as ranks, or large or close scores would become ties
    rng = np.random.default_rng(3)
    s_in, s_out = rng.normal(0, 1, 200), rng.normal(0.7, 1, 80)
    ref = ood_metrics(s_in, s_out)
    labels = np.r_[np.zeros(200), np.ones(80)]
    moved = ood_metrics(shift + scale * s_in, shift + scale * s_out)
    for name in ref:
        assert moved[name] == pytest.approx(ref[name], abs=1e-12), name
    assert ref["auroc"] == pytest.approx(roc_auc_score(labels, np.r_[s_in, s_out]), abs=SKLEARN_TOL)


def test_ood_metrics_all_tied_and_large_inputs():
    m = ood_metrics(np.full(7, 3.0), np.full(5, 3.0))  # one threshold: every example flagged at once
    assert m == pytest.approx({"auroc": 0.5, "aupr_in": 7 / 12, "aupr_out": 5 / 12, "fpr95": 1.0})
    rng = np.random.default_rng(4)
    s_in, s_out = rng.gamma(2.0, 1.0, 60_000), rng.gamma(2.5, 1.0, 40_000)
    labels, scores = np.r_[np.zeros(60_000), np.ones(40_000)], np.r_[s_in, s_out]
    m = ood_metrics(s_in, s_out)
    assert m["auroc"] == pytest.approx(roc_auc_score(labels, scores), abs=SKLEARN_TOL)
    assert m["aupr_out"] == pytest.approx(average_precision_score(labels, scores), abs=SKLEARN_TOL)
    assert m["aupr_in"] == pytest.approx(average_precision_score(1 - labels, -scores), abs=SKLEARN_TOL)


def test_ood_metrics_perfect_separator_and_hand_example():
    m = ood_metrics(np.linspace(0, 1, 50), np.linspace(2, 3, 20))
    assert m == {"auroc": 1.0, "aupr_in": 1.0, "aupr_out": 1.0, "fpr95": 0.0}
    # in = (0.1, 0.2, 0.3, 0.6), out = (0.5, 0.7, 0.8): 11 of 12 (out, in) pairs ordered; 95% of OOD detected
    # first at threshold 0.5, which also flags 0.6 among the 4 in-distribution scores
    m = ood_metrics([0.1, 0.2, 0.3, 0.6], [0.5, 0.7, 0.8])
    assert m["auroc"] == pytest.approx(11 / 12) and m["fpr95"] == 0.25
    # AP with OOD positive: ranks 0.8 (P = 1), 0.7 (P = 1), 0.6 (in), 0.5 (P = 3/4): (1 + 1 + 3/4) / 3
    assert m["aupr_out"] == pytest.approx(11 / 12)


# --------------------------------------------------------------------------------------------------
# selective prediction
# --------------------------------------------------------------------------------------------------
def naive_aurc(confidence: np.ndarray, correct: np.ndarray) -> float:
    """O(N^2): mean over k of the error rate of the k most confident examples (distinct confidences)."""
    n = len(confidence)
    kth = np.sort(confidence)[::-1]
    risks = []
    for k in range(1, n + 1):
        accepted = [i for i in range(n) if confidence[i] >= kth[k - 1]]
        risks.append(sum(not correct[i] for i in accepted) / len(accepted))
    return sum(risks) / n


def discrete_optimum(n: int, e: int) -> float:
    return sum((k - (n - e)) / k for k in range(n - e + 1, n + 1)) / n


def test_risk_coverage_by_hand_with_ties():
    # confidences 0.9 (ok), 0.8 (wrong), 0.8 (ok), 0.3 (wrong), 0.3 (ok): thresholds 0.9, 0.8, 0.3
    cov, risk = risk_coverage(torch.tensor([0.8, 0.9, 0.3, 0.8, 0.3]), torch.tensor([0, 1, 0, 1, 1]))
    assert cov.dtype == risk.dtype == torch.float64
    assert cov.tolist() == [0.2, 0.6, 1.0]
    assert risk.tolist() == pytest.approx([0.0, 1 / 3, 2 / 5])
    # step integration: 0 * 0.2 + 1/3 * 0.4 + 2/5 * 0.4
    assert aurc([0.8, 0.9, 0.3, 0.8, 0.3], [0, 1, 0, 1, 1]) == pytest.approx(0.4 / 3 + 0.16)
    # all tied: one point (1, error rate); AURC = error rate
    cov, risk = risk_coverage(np.full(4, 0.5), [True, False, True, True])
    assert cov.tolist() == [1.0] and risk.tolist() == [0.25]
    assert aurc(np.full(4, 0.5), [True, False, True, True]) == 0.25


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aurc_matches_naive_loop_without_ties(seed):
    rng = np.random.default_rng(seed)
    conf = rng.permutation(200) / 200.0
    correct = rng.uniform(size=200) < conf + 0.2
    assert aurc(conf, correct) == pytest.approx(naive_aurc(conf, correct), abs=1e-12)
    cov, _ = risk_coverage(conf, correct)
    assert len(cov) == 200 and (np.diff(cov.numpy()) > 0).all() and cov[-1].item() == 1.0


@pytest.mark.parametrize("n,e", [(10, 3), (57, 1), (200, 100), (30, 0), (8, 8)])
def test_aurc_of_perfect_ranking_is_the_optimum(n, e):
    correct = np.r_[np.ones(n - e, bool), np.zeros(e, bool)]
    conf = -np.arange(n, dtype=float)  # all correct examples first, distinct confidences
    assert aurc_optimal(correct) == pytest.approx(discrete_optimum(n, e), abs=1e-12)
    assert aurc(conf, correct) == pytest.approx(discrete_optimum(n, e), abs=1e-12)
    assert excess_aurc(conf, correct) == pytest.approx(0.0, abs=1e-12)


def test_aurc_optimum_approaches_geifman_closed_form():
    n, r = 100_000, 0.2
    correct = np.r_[np.ones(int(n * (1 - r)), bool), np.zeros(int(n * r), bool)]
    assert aurc_optimal(correct) == pytest.approx(r + (1 - r) * math.log(1 - r), abs=1e-4)


def test_aurc_of_random_ranking_is_the_error_rate():
    rng = np.random.default_rng(0)
    correct = rng.uniform(size=20_000) > 0.3
    rate = 1 - correct.mean()
    assert aurc(rng.uniform(size=20_000), correct) == pytest.approx(rate, abs=0.01)
    assert excess_aurc(rng.uniform(size=20_000), correct) > 0.1


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------
SP = dirichlet_samples(0, 3, 4, 2)  # a valid (S, B, K) = (3, 4, 2)


@pytest.mark.parametrize("fn", [predictive_entropy, expected_entropy, mutual_information, variation_ratio,
                                predictive_std, lambda p: ga_uncertainty(p, 1.5),
                                lambda p: ga_cutoff(p, [True, False, True, True])])
def test_bad_sample_probs(fn):
    with pytest.raises(ValueError, match=r"shape \(S, B, K\).*got shape \(4, 2\).*no sample axis"):
        fn(SP[0])
    with pytest.raises(ValueError, match=r"got shape \(3, 4, 2, 1\)"):
        fn(SP[..., None])
    bad = SP.copy()
    bad[1, 2] = [0.9, 0.8]
    with pytest.raises(ValueError, match=r"row \[1, 2\] sums to 1\.7.*softmax"):
        fn(bad)
    bad[1, 2] = [np.nan, 0.5]
    with pytest.raises(ValueError, match=r"NaN \(1 entries, first at \[1, 2, 0\]\)"):
        fn(bad)
    bad[1, 2] = [-0.5, 1.5]
    with pytest.raises(ValueError, match=r"sample_probs\[1, 2, 0\] = -0\.5 is not a probability"):
        fn(bad)
    with pytest.raises(ValueError, match=r"sample_probs is empty \(shape \(3, 0, 2\)\)"):
        fn(SP[:, :0])
    bad[1, 2] = [np.inf, 0.5]
    with pytest.raises(ValueError, match=r"sample_probs\[1, 2, 0\] = inf is not finite"):
        fn(torch.tensor(bad, dtype=torch.float32))


@pytest.mark.parametrize("fn,name", [(predictive_std, "predictive_std"),
                                     (lambda p: ga_uncertainty(p, 0.5), "ga_uncertainty"),
                                     (lambda p: ga_cutoff(p, [True, False, True, True]), "ga_cutoff")])
def test_single_sample_rejected_where_two_are_needed(fn, name):
    with pytest.raises(ValueError, match=rf"{name} needs at least 2 posterior samples, got S = 1"):
        fn(SP[:1])


def test_bad_reduction_and_cutoff():
    with pytest.raises(ValueError, match=r"unknown reduction 'mean'; accepted: 'predicted', 'none'"):
        predictive_std(SP, reduction="mean")
    for cutoff, shown in ((float("nan"), "nan"), (float("inf"), "inf"), ("a", "'a'"), (None, "None"), (True, "True")):
        with pytest.raises(ValueError, match=rf"cutoff must be a finite number; got {shown}"):
            ga_uncertainty(SP, cutoff)


def test_bad_gamma_and_cutoff_inputs():
    u, ok = np.array([0.1, 0.5, 0.3, 0.9]), np.array([True, False, True, False])
    with pytest.raises(ValueError, match=r"alphas\[1\] = 1\.0 is outside \(0, 1\)"):
        gamma_curve(u, ok, [0.5, 1.0])
    with pytest.raises(ValueError, match=r"alphas = 0\.0 is outside \(0, 1\)"):
        gamma_curve(u, ok, 0.0)
    with pytest.raises(ValueError, match=r"alphas\[0\] = nan is outside"):
        gamma_curve(u, ok, [float("nan")])
    with pytest.raises(ValueError, match=r"alphas must be .* non-empty.*got shape \(0,\)"):
        gamma_curve(u, ok, [])
    for alpha, shown in ((1.5, "1.5"), (-0.1, "-0.1"), (0, "0.0"), (1, "1.0")):
        with pytest.raises(ValueError, match=rf"alpha = {shown} is outside \(0, 1\)"):
            ga_cutoff(SP, ok, alpha)
    with pytest.raises(ValueError, match=r"correct has length 3 but uncertainty has length 4"):
        gamma_curve(u, ok[:3], 0.5)
    with pytest.raises(ValueError, match=r"correct has length 5 but the example axis B of sample_probs \(shape \(3, 4, 2\)\) has length 4"):
        ga_cutoff(SP, [True] * 5)
    with pytest.raises(ValueError, match=r"correct\[1\] = 2\.0 is not boolean"):
        gamma_curve(u, [1, 2, 0, 1], 0.5)
    with pytest.raises(ValueError, match=r"correct\[0\] = 0\.5 is not boolean"):
        ga_cutoff(SP, [0.5, 1, 0, 1])
    with pytest.raises(ValueError, match=r"got 4 correct and 0 misclassified of 4"):
        gamma_curve(u, np.ones(4, bool), 0.5)
    with pytest.raises(ValueError, match=r"got 0 correct and 4 misclassified of 4"):
        ga_cutoff(SP, np.zeros(4, bool))
    with pytest.raises(ValueError, match=r"uncertainty is empty"):
        gamma_curve([], [], 0.5)
    with pytest.raises(ValueError, match=r"uncertainty contains NaN \(1 entries, first at \[2\]\)"):
        gamma_curve([0.1, 0.2, np.nan], [1, 0, 1], 0.5)
    with pytest.raises(ValueError, match=r"uncertainty must have shape \(N,\).*got shape \(2, 2\)"):
        gamma_curve(u.reshape(2, 2), ok, 0.5)


def test_bad_ood_inputs():
    good = np.array([0.1, 0.2])
    with pytest.raises(ValueError, match=r"score_in is empty.*at least one in-distribution example"):
        ood_metrics(np.array([]), good)
    with pytest.raises(ValueError, match=r"score_out is empty.*at least one out-of-distribution example"):
        ood_metrics(good, torch.tensor([]))
    with pytest.raises(ValueError, match=r"score_out contains NaN \(1 entries, first at \[1\]\)"):
        ood_metrics(good, [0.3, float("nan")])
    with pytest.raises(ValueError, match=r"score_in\[0\] = inf is not finite"):
        ood_metrics([float("inf"), 0.0], good)
    with pytest.raises(ValueError, match=r"score_in must have shape \(N,\).*got shape \(2, 1\)"):
        ood_metrics(good[:, None], good)


def test_bad_selective_inputs():
    with pytest.raises(ValueError, match=r"correct has length 2 but confidence has length 3"):
        risk_coverage([0.1, 0.2, 0.3], [True, False])
    with pytest.raises(ValueError, match=r"correct\[2\] = 3\.0 is not boolean"):
        aurc([0.1, 0.2, 0.3], [1, 0, 3])
    with pytest.raises(ValueError, match=r"confidence is empty"):
        aurc([], [])
    with pytest.raises(ValueError, match=r"correct is empty"):
        aurc_optimal([])
    with pytest.raises(ValueError, match=r"confidence contains NaN"):
        excess_aurc([0.1, np.nan], [1, 0])
    with pytest.raises(ValueError, match=r"correct must have shape \(N,\).*got shape \(1, 2\)"):
        aurc_optimal([[1, 0]])


def test_bad_regression_inputs():
    means = torch.zeros(3, 4, 2)
    with pytest.raises(ValueError, match=r"must have shape \(S, B, D\).*got shape \(3, 4\).*\[\.\.\., None\]"):
        regression_uncertainty(means[..., 0], 1.0)
    with pytest.raises(ValueError, match=r"noise_var must be >= 0.*got minimum -0\.5"):
        regression_uncertainty(means, -0.5)
    with pytest.raises(ValueError, match=r"noise_var of shape \(3,\) is not broadcastable to \(B, D\) = \(4, 2\)"):
        regression_uncertainty(means, torch.ones(3))
    with pytest.raises(ValueError, match=r"noise_var contains NaN"):
        regression_uncertainty(means, float("nan"))
    with pytest.raises(ValueError, match=r"sample_means contains NaN"):
        regression_uncertainty(means.index_fill(0, torch.tensor([1]), float("nan")), 1.0)
    with pytest.raises(ValueError, match=r"sample_means is empty"):
        regression_uncertainty(means[:0], 1.0)


# --------------------------------------------------------------------------------------------------
# facade and doctests
# --------------------------------------------------------------------------------------------------
def test_facade_reexports_everything_public():
    modules = (uncertainty, ood, selective)
    assert U.__all__ == [name for m in modules for name in m.__all__]
    for m in modules:
        for name in m.__all__:
            assert getattr(U, name) is getattr(m, name)
    assert len(set(U.__all__)) == len(U.__all__)


@pytest.mark.parametrize("module", [uncertainty, ood, selective])
def test_doctests(module):
    result = doctest.testmod(module, extraglobs={"torch": torch, "np": np})
    assert result.attempted >= 3 and result.failed == 0
