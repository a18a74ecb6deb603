"""The run reports score each method's own predictive (issue 32).

* :func:`bayeswrap.predictive.predictive_loader`: for a predictive that is the mean of its samples (sampled
  weights, the GLM's Monte Carlo link) one pass of ``sample_probs_loader`` gives both, bit for bit; Laplace's
  probit link is ``predict_loader``'s closed form, with the linearised samples beside it for the sample measures.
* :func:`bayeswrap.app.reports.final_reports` of a sampled method equals the reports computed from the
  per-sample probabilities as before (a copy of that code below is the reference); of Laplace, every point
  metric is of the probit predictive, and the row records which predictive it used.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import bayeswrap as bw
import bayeswrap.predictive as predictive_module
from bayeswrap.app import reports
from bayeswrap.app.build import build, eval_loader
from bayeswrap.app.config import load_yaml, resolve_values
from bayeswrap.data.shift import shifted_dataset
from bayeswrap.evaluation import calibration, conformal, protocol
from bayeswrap.methods.laplace.glm import GLM
from bayeswrap.methods.predictives import Sampled
from bayeswrap.predictive import predict_loader, predictive_loader, sample_probs_loader

pytestmark = pytest.mark.usefixtures("one_thread")


def _batches():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x[:200], dtype=torch.float32) / 16.0, torch.tensor(y[:200])
    return [(x[i:i + 50], y[i:i + 50]) for i in range(0, 200, 50)]


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


def _laplace(**options):
    batches = _batches()
    bnn = bw.wrap(_net(), "laplace", num_data=200, prior_std=1.0, **options)
    bw.fit(bnn, batches, epochs=5, optimizer=torch.optim.Adam(bnn.parameters(), lr=1e-2), progress=False)
    return bnn.eval(), batches


def _fail(*args, **kwargs):
    raise AssertionError("a second pass over the loader")


def test_a_sampled_predictive_is_one_pass_of_the_samples(monkeypatch):
    batches = _batches()
    bnn = bw.wrap(_net(), "vi", num_data=200, prior_std=1.0).eval()
    assert bnn.default_predictive().is_sample_average(bnn, 4)
    ref, y_ref = sample_probs_loader(bnn, batches, 4, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(predictive_module, "predict_loader", _fail)
    probs, samples, y = predictive_loader(bnn, batches, 4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(samples, ref) and torch.equal(y, y_ref)
    assert probs.dtype == torch.float64 and torch.equal(probs, ref.double().mean(0))
    probs, none, _ = predictive_loader(bnn, batches, 4, generator=torch.Generator().manual_seed(3), samples=False)
    assert none is None and torch.equal(probs, ref.double().mean(0))


def test_laplace_probit_is_the_closed_form_and_its_samples_are_linearised():
    bnn, batches = _laplace()
    assert repr(bnn.default_predictive()) == "GLM(link='probit')"
    assert not bnn.default_predictive().is_sample_average(bnn, 3)
    assert bnn.default_predictive().is_sample_average(bnn, 0)  # S = 0: the MAP, for either link
    probs, samples, y = predictive_loader(bnn, batches, 3, generator=torch.Generator().manual_seed(1))
    closed, y_ref = predict_loader(bnn, batches, 3)
    assert torch.equal(probs, closed.double()) and torch.equal(y, y_ref)
    # the closed form itself: softmax(f / sqrt(1 + π/8 var)) of the functional moments
    x = torch.cat([b[0] for b in batches])
    f, var = bnn.functional_moments(x)
    torch.testing.assert_close(probs, (f / (1 + torch.pi / 8 * var).sqrt()).softmax(-1).double(), rtol=1e-5,
                               atol=1e-7)
    ref = sample_probs_loader(bnn, batches, 3, generator=torch.Generator().manual_seed(1))[0]
    assert torch.equal(samples, ref)
    assert not torch.allclose(samples.double().mean(0), probs, atol=1e-3)  # not the samples' mean
    # S < 2: no sample measure exists, so no second pass
    assert predictive_loader(bnn, batches, 1)[1] is None
    # the Monte Carlo link is the samples' mean again
    mc = bw.wrap(_net(), "laplace", num_data=200, prior_std=1.0, link_approx="mc")
    mc.load_state_dict(bnn.state_dict())
    mc.eval()
    assert mc.default_predictive().is_sample_average(mc, 3)
    probs, samples, _ = predictive_loader(mc, batches, 3, generator=torch.Generator().manual_seed(1))
    assert torch.equal(samples, ref) and torch.equal(probs, ref.double().mean(0))


# ------------------------------------------------------------------------------------------------ final reports
def _old_final_reports(bnn, splits, ood_test, cfg, num_samples, device) -> dict:
    """The reports as computed before issue 32, every metric from the per-sample probabilities (the reference)."""
    bnn.eval()

    def predict(dataset, seed_offset=0):
        gen = torch.Generator(device=device).manual_seed(cfg.seed + seed_offset)
        return sample_probs_loader(bnn, eval_loader(dataset, cfg), num_samples, generator=gen)

    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    test = sample_probs_loader(bnn, eval_loader(splits.test, cfg), num_samples, generator=gen)
    val = sample_probs_loader(bnn, eval_loader(splits.val, cfg), num_samples, generator=gen)
    report = protocol.prediction_report(*test, val=val, n_bins=cfg.n_bins)
    report["num_samples"] = num_samples
    report["conformal"] = conformal.conformal_report(
        val[0].double().mean(0), val[1], test[0].double().mean(0), test[1], cfg.conformal_alpha,
        score=cfg.conformal_score)
    grids = {"rotation": cfg.rotation_angles(), "noise": cfg.noise_stds()}
    report["shift"] = protocol.shift_report(
        lambda kind, level: predict(shifted_dataset(splits.test, kind, level, image_shape=splits.image_shape,
                                                    seed=cfg.seed)),
        grids, temperature=report.get("temperature", 1.0), n_bins=cfg.n_bins)
    report["ood"] = {"classes": list(cfg.held_out_classes(splits.name)),
                     **protocol.ood_report(test[0], predict(ood_test, 1)[0],
                                           temperature=report.get("temperature"))}
    return report


def _run(method: str, **options):
    overrides = {"method": method, "epochs": 2, "batch_size": 64, "progress": False, "shift_rotations": "0,60",
                 "shift_noise": "0,0.5", **options}
    cfg = resolve_values(load_yaml("configs/digits.yaml"), overrides, foreign_flags="drop").validate()
    splits, ood_test, bnn, _, device = build(cfg)
    loader = eval_loader(splits.train, cfg)
    bw.fit(bnn, loader, epochs=2, optimizer=torch.optim.Adam(bnn.parameters(), lr=1e-2), progress=False,
           finalize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Laplace's "sampled weights are mostly noise" advice
        bnn.after_fit(loader)
    return cfg, splits, ood_test, bnn, device


def test_a_sampled_methods_reports_are_those_of_its_samples_bit_for_bit():
    cfg, splits, ood_test, bnn, device = _run("vi")
    report, arrays = reports.final_reports(bnn, splits, ood_test, cfg, 3, device)
    assert report.pop("predictive") == "Sampled()"
    assert report == _old_final_reports(bnn, splits, ood_test, cfg, 3, device)
    assert report["ood"]["mutual_information"] is not None


def test_laplace_reports_score_the_probit_predictive():
    cfg, splits, ood_test, bnn, device = _run("laplace")
    assert bnn.link_approx == "probit"  # the run no longer forces the sampled link
    report, arrays = reports.final_reports(bnn, splits, ood_test, cfg, 3, device)
    assert report["predictive"] == "GLM(link='probit')"
    probs, y = predict_loader(bnn, eval_loader(splits.test, cfg), 3)
    assert report["T1"]["nll"] == calibration.nll(probs.double(), y)
    assert report["T1"]["error"] == 1 - calibration.accuracy(probs.double(), y)
    assert torch.equal(arrays["test"][0], probs.double())
    val_probs, val_y = predict_loader(bnn, eval_loader(splits.val, cfg), 3)
    assert report["temperature"] == calibration.report(probs.double(), y, val=(val_probs.double(), val_y),
                                                       n_bins=cfg.n_bins)["temperature"]
    # shift: the unshifted member of each grid is the test set, scored by the same predictive
    for kind in ("rotation", "noise"):
        assert report["shift"][kind]["T1"]["nll"][0] == report["T1"]["nll"]
    rotated, y_rot = predict_loader(bnn, eval_loader(shifted_dataset(splits.test, "rotation", 60.0,
                                                                     image_shape=splits.image_shape,
                                                                     seed=cfg.seed), cfg), 3)
    assert report["shift"]["rotation"]["T1"]["nll"][1] == calibration.nll(rotated.double(), y_rot)
    # OOD: entropy of the probit predictive, mutual information of the linearised samples
    ood_probs, _ = predict_loader(bnn, eval_loader(ood_test, cfg), 3)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    test_samples = sample_probs_loader(bnn, eval_loader(splits.test, cfg), 3, generator=gen)[0]
    ood_samples = sample_probs_loader(bnn, eval_loader(ood_test, cfg), 3,
                                      generator=torch.Generator(device=device).manual_seed(cfg.seed + 1))[0]
    expected = protocol.ood_report(test_samples, ood_samples, probs_in=probs, probs_out=ood_probs)
    assert {k: report["ood"][k] for k in expected} == expected
    assert report["ood"]["mutual_information"] is not None
    # the old report (the linearised samples' mean) is a different predictive
    assert _old_final_reports(bnn, splits, ood_test, cfg, 3, device)["T1"]["nll"] != report["T1"]["nll"]


def test_comparison_rows_show_the_predictive():
    metrics = {"history": [], "final": {"3": {"T1": {"error": 0.1, "ece": 0.02, "nll": 0.3},
                                              "predictive": "GLM(link='probit')"}}}
    old = {"history": [], "final": {"3": {"T1": {"error": 0.1, "ece": 0.02, "nll": 0.3}}}}
    rows = reports.comparison_rows({"laplace": metrics, "map": old}, "map")
    assert [r["predictive"] for r in rows] == ["GLM(link='probit')", None]
    table = reports.markdown_table(rows, full=True)  # every column: comparison_full.md
    assert table.startswith("| method | tuned | cost | num_samples | predictive | error |")
    assert "| laplace |  |  | 3 | GLM(link='probit') | 0.1000 |" in table
    compact = reports.markdown_table(rows)  # comparison.md and the terminal: the predictive without its brackets
    assert "| laplace | 3 | GLM probit | 0.100 |" in compact


def test_protocol_takes_a_predictive_beside_its_samples():
    """prediction_report/ood_report with ``probs``: the point metrics of ``probs``, the sample measures of the
    samples; a (N, K) predictive alone has no sample measure.
    """
    g = torch.Generator().manual_seed(0)
    samples = torch.randn(4, 60, 5, generator=g).softmax(-1)
    probs = torch.randn(60, 5, generator=g).softmax(-1).double()
    labels = torch.randint(0, 5, (60,), generator=g)
    rep = protocol.prediction_report(samples, labels, probs=probs, n_bins=10)
    assert rep["T1"] == calibration.report(probs, labels, n_bins=10)["T1"]
    measures = protocol.measures(samples, probs)
    torch.testing.assert_close(measures["entropy"], -(probs * probs.log()).sum(-1))
    assert torch.equal(measures["mutual_information"], protocol.measures(samples)["mutual_information"])
    alone = protocol.prediction_report(probs, labels, n_bins=10)
    assert alone["T1"] == rep["T1"] and set(alone["gamma"]) == {"alphas", "entropy"}
    ood = protocol.ood_report(None, None, probs_in=probs, probs_out=probs[:20])
    assert ood["mutual_information"] is None and ood["n_in"] == 60 and ood["n_out"] == 20
    with pytest.raises(ValueError, match="probs_in and probs_out both given, or both None"):
        protocol.ood_report(samples, samples, probs_in=probs)


def test_glm_and_sampled_declare_whether_they_average_their_samples():
    bnn, _ = _laplace()
    assert GLM("mc").is_sample_average(bnn, 5) and not GLM("probit").is_sample_average(bnn, 5)
    assert Sampled().is_sample_average(bnn, 5)
