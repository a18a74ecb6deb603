"""The evaluation protocol (in distribution, shift, OOD) against direct computations with the metric modules."""

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from bayeswrap.evaluation import calibration as cal
from bayeswrap.evaluation import protocol
from bayeswrap.evaluation.selective import aurc
from bayeswrap.evaluation.uncertainty import gamma_curve, mutual_information, predictive_entropy


def _sample_probs(s, n, k, seed, concentration=0.5):
    """(S, N, K) float64 rows drawn from a symmetric Dirichlet."""
    return torch.from_numpy(np.random.default_rng(seed).dirichlet(np.full(k, concentration), size=(s, n)))


def _normalise(x):
    return x / x.sum(-1, keepdim=True)


@pytest.fixture
def data():
    sp = _sample_probs(6, 300, 4, seed=0)
    labels = torch.multinomial(sp.mean(0), 1, generator=torch.Generator().manual_seed(1)).squeeze(1)
    val_sp = _sample_probs(6, 200, 4, seed=2)
    val_labels = torch.multinomial(val_sp.mean(0), 1, generator=torch.Generator().manual_seed(3)).squeeze(1)
    return sp, labels, val_sp, val_labels


def test_prediction_report_matches_the_metric_modules(data):
    sp, labels, val_sp, val_labels = data
    rep = protocol.prediction_report(sp, labels, val=(val_sp, val_labels), n_bins=10)
    probs = sp.mean(0)
    expected = cal.report(probs, labels, val=(val_sp.mean(0), val_labels), n_bins=10)
    assert rep["T1"] == expected["T1"] and rep["Topt"] == expected["Topt"]
    assert rep["temperature"] == expected["temperature"]
    assert rep["bins"]["count"] == cal.bin_stats(probs, labels, 10).count.tolist()
    conf, pred = probs.max(1)
    correct = pred == labels
    assert rep["selective"]["aurc"] == pytest.approx(aurc(conf, correct), rel=1e-12)
    assert rep["selective"]["coverage"][0] > 0 and rep["selective"]["coverage"][-1] == 1.0
    assert len(rep["selective"]["coverage"]) <= 200
    assert rep["selective"]["risk"][-1] == pytest.approx(1 - float(correct.double().mean()), rel=1e-12)
    assert set(rep["gamma"]) == {"alphas", "entropy", "mutual_information", "variation_ratio", "predictive_std"}
    np.testing.assert_allclose(rep["gamma"]["mutual_information"],
                               gamma_curve(mutual_information(sp), correct, rep["gamma"]["alphas"]).numpy())


def test_identical_samples_are_scored_as_one(data):
    sp, labels, _, _ = data
    same = sp[:1].expand(5, -1, -1).clone()
    assert protocol.distinct_samples(same).shape[0] == 1
    assert protocol.distinct_samples(sp).shape[0] == 6
    rep = protocol.prediction_report(same, labels)
    assert set(rep["gamma"]) == {"alphas", "entropy"}
    ood = protocol.ood_report(same, sp[:1, :50].expand(5, -1, -1).clone())
    assert ood["mutual_information"] is None


def test_gamma_is_none_without_errors():
    probs = torch.eye(3, dtype=torch.float64)[None].expand(2, -1, -1)
    rep = protocol.prediction_report(probs, torch.arange(3))
    assert rep["gamma"] is None and rep["T1"]["error"] == 0.0


def test_shift_report_curves_and_summary(data):
    sp, labels, _, _ = data
    # a fake model: at intensity i the predictive is tempered towards uniform by 1 + i
    calls = []

    def predict_shifted(kind, level):
        calls.append((kind, level))
        logp = sp.clamp_min(1e-300).log() / (1.0 + level)
        return torch.softmax(logp, -1), labels

    grids = {"rotation": (0, 30, 60), "noise": (0.0, 0.5), "empty": ()}
    rep = protocol.shift_report(predict_shifted, grids, temperature=2.0, n_bins=15)
    assert calls == [("rotation", 0.0), ("rotation", 30.0), ("rotation", 60.0), ("noise", 0.0), ("noise", 0.5)]
    assert "empty" not in rep and rep["rotation"]["intensity"] == [0.0, 30.0, 60.0]
    for kind, grid in (("rotation", (0, 30, 60)), ("noise", (0.0, 0.5))):
        for i, level in enumerate(grid):
            probs, y = predict_shifted(kind, level)
            p = probs.mean(0)
            assert rep[kind]["T1"]["nll"][i] == pytest.approx(cal.nll(p, y), rel=1e-12)
            assert rep[kind]["T1"]["ece"][i] == pytest.approx(cal.ece(p, y), rel=1e-12)
            scaled = cal.apply_temperature(p.log(), 2.0)
            assert rep[kind]["Topt"]["nll"][i] == pytest.approx(cal.nll(scaled, y), rel=1e-12)
            assert rep[kind]["Topt"]["error"][i] == rep[kind]["T1"]["error"][i]  # T keeps the argmax
    shifted = rep["rotation"]["T1"]["nll"][1:] + rep["noise"]["T1"]["nll"][1:]
    assert rep["summary"]["nll"] == pytest.approx(sum(shifted) / 3, rel=1e-12)
    assert set(rep["summary"]) == {"error", "nll", "ece", "error_Topt", "nll_Topt", "ece_Topt"}
    assert protocol.shift_report(predict_shifted, {"rotation": (0,)})["summary"] == {}


def test_ood_report_pools_scores_like_sklearn(data):
    # torchmetrics computes the AUROC with float32 rates: it agrees with scikit-learn's to about 1e-6
    sp, _, _, _ = data
    sp_out = _normalise(sp[:, :120] + 2.0)  # flatter: more entropy
    rep = protocol.ood_report(sp, sp_out)
    assert rep["n_in"] == 300 and rep["n_out"] == 120
    h_in, h_out = predictive_entropy(sp), predictive_entropy(sp_out)
    expected = roc_auc_score(np.r_[np.zeros(300), np.ones(120)], np.r_[h_in.numpy(), h_out.numpy()])
    assert rep["entropy"]["auroc"] == pytest.approx(expected, abs=1e-6)
    assert rep["entropy"]["auroc"] > 0.9
    mi = roc_auc_score(np.r_[np.zeros(300), np.ones(120)],
                       np.r_[mutual_information(sp).numpy(), mutual_information(sp_out).numpy()])
    assert rep["mutual_information"]["auroc"] == pytest.approx(mi, abs=1e-6)
    conf = roc_auc_score(np.r_[np.zeros(300), np.ones(120)],
                         np.r_[1 - sp.mean(0).max(1).values.numpy(), 1 - sp_out.mean(0).max(1).values.numpy()])
    assert rep["confidence"]["auroc"] == pytest.approx(conf, abs=1e-6)
    with pytest.raises(ValueError, match="K = 4 and 3"):
        protocol.ood_report(sp, sp_out[..., :3] / sp_out[..., :3].sum(-1, keepdim=True))


def test_ood_report_scores_the_temperature_scaled_entropy_like_sklearn(data):
    sp, _, _, _ = data
    sp_out = _normalise(sp[:, :120] + 0.3)
    labels = np.r_[np.zeros(300), np.ones(120)]
    for T in (0.4, 1.0, 3.0):
        rep = protocol.ood_report(sp, sp_out, temperature=T)
        scores = []
        for p in (sp, sp_out):  # softmax(log p̄ / T) written out, one example at a time
            q = np.exp(np.log(p.mean(0).numpy()) / T)
            q /= q.sum(1, keepdims=True)
            scores.append(-(q * np.log(q)).sum(1))
        assert rep["entropy_Topt"]["auroc"] == pytest.approx(roc_auc_score(labels, np.r_[scores[0], scores[1]]),
                                                             abs=1e-6)
    assert rep["entropy_Topt"]["auroc"] != rep["entropy"]["auroc"]  # a temperature can re-rank the inputs
    assert "entropy_Topt" not in protocol.ood_report(sp, sp_out)
