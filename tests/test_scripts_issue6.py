"""The issue-6 scripts in test mode: regression bands widen in the gaps; the sparsity table is written."""

import json

import pytest

from scripts import regression_demo, sparsity_digits


def test_regression_demo_bands_widen_inside_the_largest_gap(tmp_path):
    demo = regression_demo
    res = demo.run(test_mode=True, out_dir=tmp_path)
    toy = res["summary"]["toy"]
    assert list(toy) == list(demo.METHODS)
    for method in ("vi", "sparse_vd"):
        assert toy[method]["std_largest_gap"] > toy[method]["std_train"], (method, toy[method])
    # SGLD's default predictive is the ensemble of its iterates: the demo's short full-batch chain (step 1e-4)
    # moves as one function, so its band barely differs between the gap and the data (ratio ~1.00); the old
    # diagonal-Gaussian predictive widened it by sampling every weight independently.
    assert toy["sgld"]["std_largest_gap"] > 0.98 * toy["sgld"]["std_train"], toy["sgld"]
    # the deterministic net's predictive std is the likelihood noise everywhere
    assert toy["deterministic"]["std_largest_gap"] == pytest.approx(demo.LIKELIHOOD_STD, rel=1e-5)
    assert toy["deterministic"]["std_train"] == pytest.approx(demo.LIKELIHOOD_STD, rel=1e-5)
    for method, r in toy.items():
        for region in demo.REGIONS:
            assert r["scores"][region]["rmse"] > 0 and r["scores"][region]["nll"] == r["scores"][region]["nll"]
    assert set(res["diabetes"]) == set(demo.METHODS)
    for method, d in res["diabetes"].items():
        assert 30 < d["rmse"][0] < 120, (method, d)  # targets range 25..346, std 77
    png, md, js = res["paths"]
    assert png.stat().st_size > 20_000
    text = md.read_text()
    assert "| method | RMSE gap | NLL gap |" in text and "## Diabetes" in text
    assert json.loads(js.read_text())["toy"]["vi"]["std_train"] == toy["vi"]["std_train"]


def test_sparsity_script_runs_in_test_mode_and_writes_its_table(tmp_path):
    script = sparsity_digits
    res = script.run(test_mode=True, out_dir=tmp_path)
    md_path, png_path, json_path = res["paths"]
    text = md_path.read_text()
    for needle in ("## Sparsity per layer", "| fc1 | 19500 |", "| fc2 | 30100 |", "| fc3 | 1010 |",
                   "pruned by the rule", "random, same count per layer", "T = 100",
                   "blocks.0.mlp.fc1.weight", "**FFN total**", "TEST MODE"):
        assert needle in text, needle
    assert png_path.stat().st_size > 10_000
    data = json.loads(json_path.read_text())
    for method in ("sparse_vd", "vi"):
        m = res["lenet"]["methods"][method]
        report = m["report"]
        assert report["total"] == 64 * 300 + 300 + 300 * 100 + 100 + 100 * 10 + 10
        assert report["pruned"] == sum(t["pruned"] for t in report["tensors"])
        assert set(m["acc_vs_T_pruned"]) == set(script.SAMPLE_COUNTS)
        # the deployed plain module is the pruned posterior mean
        assert m["acc_deterministic_pruned_net"] == pytest.approx(m["acc_pruned"], abs=1e-9)
        assert data["lenet"]["methods"][method]["acc_pruned"] == m["acc_pruned"]
    vit = res["vit"]
    assert all(t["name"].startswith("blocks.") and ".mlp." in t["name"] for t in vit["report"]["tensors"])
    assert vit["bayesian_params"] < vit["all_params"]
