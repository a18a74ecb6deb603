"""scripts/mcmc_dissertation.py and scripts/posterior_fidelity.py in --fast mode (smoke tests), plus their helpers.

The fast runs are subprocesses, as from the command line, with ``OMP_WAIT_POLICY=PASSIVE`` set before torch
starts (see tests/test_pretrained_prior_script.py).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import mcmc_dissertation, mcmc_logistic, posterior_fidelity

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _run_fast(script: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, str(SCRIPTS / script), "--fast", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the body of the Markdown table whose header line starts with ``header``."""
    block = text.split(header, 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.strip().splitlines()[2:]]


# --------------------------------------------------------------------------- mcmc_dissertation.py

@pytest.fixture(scope="module")
def dissertation():
    return mcmc_dissertation


@pytest.fixture(scope="module")
def dissertation_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mcmc_dissertation")
    proc = _run_fast("mcmc_dissertation.py", out)
    return out, proc


def test_dissertation_fast_mode_writes_every_file(dissertation_run):
    out, proc = dissertation_run
    for name in ("mcmc_logistic.md", "mcmc_logistic.json", "mcmc_logistic.png", "mcmc_digits.md", "mcmc_digits.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "mcmc_logistic.png").stat().st_size > 10_000
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporary files
    for name in ("mcmc_logistic.md", "mcmc_digits.md"):
        text = (out / name).read_text()
        assert "FAST MODE" in text and "scripts/mcmc_dissertation.py --fast" in text and " s wall time" in text
    assert "wrote" in proc.stdout


def test_logistic_json_is_sensible_and_samplers_agree_with_newton(dissertation_run, dissertation):
    out, _ = dissertation_run
    data = json.loads((out / "mcmc_logistic.json").read_text())
    assert data["fast"] is True
    newton = data["map_newton"]
    assert len(newton["beta"]) == 3 and _finite(*newton["beta"]) and newton["final_grad_norm"] < 1e-6
    assert all(s > 0 for s in newton["laplace_std"])
    assert set(data["samplers"]) == {"mh", "hmc"}
    for method, s in data["samplers"].items():
        cfg = dissertation.FAST["logistic"][method]
        assert s["kept_draws_per_chain"] == cfg["draws"] and len(s["acceptance_rate"]) == cfg["chains"]
        assert all(0 < a <= 1 for a in s["acceptance_rate"]), (method, s["acceptance_rate"])
        assert all(_finite(r) and r >= 0.9 for r in s["rhat"]), (method, s["rhat"])
        assert all(_finite(e) and e > 0 for e in s["ess_bulk"] + s["ess_tail"]), method
        assert s["seconds"] > 0 and all(v > 0 for v in s["std"])
        # the posterior of 3 parameters from 100 points is close to its Laplace approximation
        for i in range(3):
            assert abs(s["mean"][i] - newton["beta"][i]) < newton["laplace_std"][i], (method, i)
            assert 0.5 < s["std"][i] / newton["laplace_std"][i] < 2.0, (method, i)
    sweep = data["leapfrog_sweep"]
    steps = sorted({*dissertation.FAST["logistic"]["leapfrog_sweep"], dissertation.FAST["logistic"]["hmc"]["leapfrog"]})
    assert [(r["jitter"], r["leapfrog"]) for r in sweep] == [(j, s) for j in (False, True) for s in steps]
    assert all(0 < r["acceptance_mean"] <= 1 and r["ess_bulk_min"] > 0 and r["rhat_max"] >= 0.9 for r in sweep)
    assert 0 <= data["surface_max_abs_gap_hmc_mh"] <= 1


def test_logistic_markdown_has_every_parameter_and_sampler_row(dissertation_run, dissertation):
    out, _ = dissertation_run
    text = (out / "mcmc_logistic.md").read_text()
    data = json.loads((out / "mcmc_logistic.json").read_text())
    rows = _table_rows(text, "| parameter | true |")
    assert [r[0] for r in rows] == list(mcmc_logistic.PARAM_NAMES)
    for i, row in enumerate(rows):
        mean, std = (float(v) for v in row[4].split("±"))  # the HMC column
        assert mean == pytest.approx(data["samplers"]["hmc"]["mean"][i], abs=5e-4)
        assert std == pytest.approx(data["samplers"]["hmc"]["std"][i], abs=5e-4)
    samplers = _table_rows(text, "| sampler | chains × kept draws |")
    assert [r[0].split(",")[0] for r in samplers] == ["MH", "HMC"]
    assert len(_table_rows(text, "| leapfrog steps L |")) == len(data["leapfrog_sweep"])
    assert "![posterior predictive heatmaps](mcmc_logistic.png)" in text


def test_digits_json_and_markdown_have_every_method(dissertation_run, dissertation):
    out, _ = dissertation_run
    data = json.loads((out / "mcmc_digits.json").read_text())
    assert list(data["rows"]) == list(dissertation.DIGITS_METHODS)
    for method, r in data["rows"].items():
        assert r["status"] == "ok", (method, r.get("message"))
        assert 0 <= r["accuracy"] <= 1 and _finite(r["nll"]) and r["nll"] >= 0 and r["seconds"] > 0, method
    h = data["rows"]["hmc"]
    assert all(0 < a <= 1 for a in h["acceptance_rate"])
    assert _finite(h["rhat_max"], h["predictive_rhat_max"]) and h["rhat_max"] >= 0.9 and h["predictive_rhat_max"] >= 0.9
    assert 0 < h["ess_bulk_min"] <= h["ess_bulk_median"] and 0 < h["ess_tail_min"] <= h["ess_tail_median"]
    assert data["rows"]["map"]["num_samples"] == 0
    text = (out / "mcmc_digits.md").read_text()
    rows = _table_rows(text, "| method | test accuracy |")
    assert len(rows) == len(dissertation.DIGITS_METHODS)
    for row, method in zip(rows, dissertation.DIGITS_METHODS):
        assert float(row[1]) == pytest.approx(data["rows"][method]["accuracy"], abs=5e-5)
    assert "95.14 %" in text and "1 h 15 min" in text and "98.18 %" in text and "1 h 34 min" in text
    assert "neither the accuracies nor the times are comparable" in text


def test_newton_raphson_finds_the_map_and_its_hessian(dissertation):
    x, y = mcmc_logistic.simulate_logistic(80, (0.3, -1.0, 2.0), seed=3)
    res = mcmc_logistic.newton_map(x, y, prior_std=1.5)
    xt = torch.cat([torch.ones(len(x), 1, dtype=x.dtype), x], 1)

    def neg_log_post(b):
        z = xt @ b
        return (torch.nn.functional.softplus(z) - y.to(z.dtype) * z).sum() + b.square().sum() / (2 * 1.5**2)

    beta = res["beta"].clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(neg_log_post(beta), beta)
    assert grad.abs().max() < 1e-8
    hess = torch.autograd.functional.hessian(neg_log_post, res["beta"])
    torch.testing.assert_close(res["cov"], torch.linalg.inv(hess))
    # the same MAP through the wrapped 2-logit model: its potential has zero gradient there
    import bayeswrap as bw

    model = mcmc_logistic.Logistic().double()
    with torch.no_grad():
        model.linear.bias.copy_(res["beta"][:1])
        model.linear.weight.copy_(res["beta"][1:][None])
    bnn = bw.wrap(model, "map", num_data=len(y), prior_std=1.5, prior_mean="zero").double()
    loss = bnn.loss(x, y).loss * len(y)
    grads = torch.autograd.grad(loss, list(bnn.parameters()))
    assert max(float(g.abs().max()) for g in grads) < 1e-8


def test_dissertation_rejects_unknown_part(dissertation, tmp_path):
    with pytest.raises(SystemExit):
        dissertation.main(["--fast", "--parts", "mnist", "--out", str(tmp_path)])


# --------------------------------------------------------------------------- posterior_fidelity.py

@pytest.fixture(scope="module")
def fidelity():
    return posterior_fidelity


@pytest.fixture(scope="module")
def fidelity_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("posterior_fidelity")
    proc = _run_fast("posterior_fidelity.py", out)
    return out, proc


def test_fidelity_fast_mode_json_is_sensible(fidelity_run, fidelity):
    out, proc = fidelity_run
    data = json.loads((out / "posterior_fidelity.json").read_text())
    assert data["fast"] is True and "wrote" in proc.stdout
    methods = fidelity.available_methods()
    assert {"map", "vi", "ivon", "mc_dropout", "sgld", "laplace", "lbbnn"} <= set(methods)
    assert list(data["methods"]) == methods
    for method, r in data["methods"].items():
        assert r["status"] == "ok", (method, r.get("message"))
        assert 0 <= r["tv"] <= 1 and 0 <= r["agreement"] <= 1 and 0 <= r["accuracy"] <= 1, method
        assert _finite(r["nll"]) and r["nll"] >= 0, method
    h = data["hmc"]
    assert h["chains"] >= 4 and len(h["acceptance_rate"]) == h["chains"]
    assert all(0 < a <= 1 for a in h["acceptance_rate"])
    for key in ("predictive_rhat", "parameter_rhat"):
        q = h[key]
        assert _finite(q["max"], q["median"]) and 0.9 <= q["median"] <= q["q99"] <= q["max"], key
        assert 0 <= q["frac_below_1.05"] <= 1
    assert h["converged"] == (h["predictive_rhat"]["max"] < data["rhat_threshold"])
    assert 0 <= h["halves"]["tv"] <= 1 and 0 <= h["halves"]["agreement"] <= 1
    assert h["predict_matches_per_draw_mean"] < 1e-4  # bnn.predict averages exactly the per-chain draws
    assert 0 <= data["hmc_scores"]["accuracy"] <= 1
    tvs = [data["methods"][m]["tv"] for m in data["order_by_tv"]]
    assert sorted(data["order_by_tv"]) == sorted(methods) and tvs == sorted(tvs)


def test_fidelity_markdown_table_is_sorted_by_tv_and_matches_json(fidelity_run):
    out, _ = fidelity_run
    text = (out / "posterior_fidelity.md").read_text()
    data = json.loads((out / "posterior_fidelity.json").read_text())
    assert "FAST MODE" in text and "yardstick for every method" in text
    assert ("NOT converged" in text) == (not data["hmc"]["converged"])
    rows = _table_rows(text, "| method | TV to HMC ↓ |")
    assert rows[0][0] == "HMC (reference)" and rows[1][0].startswith("HMC chains")
    assert [r[0] for r in rows[2:]] == data["order_by_tv"]
    for row in rows[2:]:
        r = data["methods"][row[0]]
        assert float(row[1]) == pytest.approx(r["tv"], abs=5e-4)
        assert float(row[2]) == pytest.approx(r["agreement"], abs=5e-4)


def test_fidelity_scores(fidelity):
    labels = torch.tensor([0, 1, 2])
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    same = fidelity.scores(p, labels, p)
    assert same["tv"] == pytest.approx(0.0) and same["agreement"] == 1.0 and same["accuracy"] == 1.0
    assert same["nll"] == pytest.approx(-torch.log(torch.tensor([0.7, 0.8, 0.4])).mean().item())
    one_hot = torch.eye(3)
    disjoint = fidelity.scores(one_hot, labels, one_hot[[1, 2, 0]])
    assert disjoint["tv"] == pytest.approx(1.0) and disjoint["agreement"] == 0.0


def test_fidelity_rejects_unknown_method(fidelity, tmp_path):
    with pytest.raises(SystemExit):
        fidelity.main(["--fast", "--methods", "hmc", "--out", str(tmp_path)])
