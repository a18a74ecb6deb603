"""scripts/benchmark.py's laplace section: its helpers, and a tiny run with and without laplace-torch."""

from __future__ import annotations

import json
import math

import pytest
import torch

from scripts import benchmark

TINY = ["--sections", "laplace", "--laplace-models", "resnet18", "--laplace-img-size", "32", "--laplace-train", "4",
        "--laplace-batch-size", "2", "--laplace-test", "2", "--laplace-kron-train", "16",
        "--laplace-kron-batch-size", "8", "--laplace-repeats", "1"]


def test_small_cnn_maps_images_to_ten_logits():
    model = benchmark.small_cnn()
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, benchmark.LAPLACE_CLASSES)
    assert sum(p.numel() for p in model.parameters()) == 25_578


def test_digits_data_is_fixed_and_disjoint():
    a, b = benchmark.digits_data(0, 10), benchmark.digits_data(10, 5)
    assert torch.equal(a.tensors[0], benchmark.digits_data(0, 10).tensors[0])
    assert a.tensors[0].shape == (10, 64) and b.tensors[0].shape == (5, 64)
    assert 0.0 <= float(a.tensors[0].min()) and float(a.tensors[0].max()) <= 1.0
    assert not any(torch.equal(r, s) for r in a.tensors[0] for s in b.tensors[0])
    with pytest.raises(ValueError, match="digits has 1797 examples"):
        benchmark.digits_data(1790, 10)


def test_probit_agreement_numbers():
    p = torch.tensor([[0.5, 0.5], [0.2, 0.8]])
    q = torch.tensor([[0.5, 0.5], [0.25, 0.75]])
    p_map = torch.tensor([[0.6, 0.4], [0.2, 0.8]])
    var = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a = benchmark.probit_agreement(p, q, p_map, var * 1.01, var)
    assert a["probit_max_abs_diff"] == pytest.approx(0.05)
    assert a["probit_vs_map_max_abs_diff"] == pytest.approx(0.1)
    assert a["f_var_max_rel_diff"] == pytest.approx(0.01)
    assert a["f_var_median"] == pytest.approx(2.0)
    assert benchmark.probit_agreement(p, p, p, torch.zeros(2, 2), torch.zeros(2, 2))["f_var_max_rel_diff"] == 0.0


def test_strict_target():
    assert benchmark.check(0.99, "<", 1.0)["met"] and not benchmark.check(1.0, "<", 1.0)["met"]
    assert benchmark.check(1.0, "<", 1.0)["target"] == "< 1x"


def test_regenerate_command(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    line = benchmark.regenerate_command(["--sections", "laplace", "--out", "figures/a b"])
    assert line.startswith("OMP_NUM_THREADS=1 ") and line.endswith("scripts/benchmark.py --sections laplace --out "
                                                                     "'figures/a b'")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert not benchmark.regenerate_command([]).startswith("OMP")


def run(tmp_path, one_thread) -> tuple[dict, str]:
    out = tmp_path / "laplace"
    returned = benchmark.main(TINY + ["--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    assert returned["laplace"].keys() == result["laplace"].keys()
    return result, out.with_suffix(".md").read_text()


def test_laplace_section_against_laplace_torch(tmp_path, one_thread):
    pytest.importorskip("laplace")
    result, md = run(tmp_path, one_thread)
    lap = result["laplace"]
    assert lap["laplace_torch"]["version"] and lap["laplace_torch"]["backend"]
    assert set(lap["last_layer"]) == {"resnet18"} and set(lap["all_weights"]) == {"mlp", "cnn"}
    for part in ("last_layer", "all_weights"):
        for r in lap[part].values():
            assert all(math.isfinite(v) and v > 0 for v in r["ratio"].values())
            # the same posterior predictive on both sides (float32 rounding apart)
            assert r["agreement"]["probit_max_abs_diff"] < 1e-4
            assert r["agreement"]["f_var_max_rel_diff"] < 1e-2
    assert set(lap["last_layer"]["resnet18"]["ratio"]) == {"fit_vs_laplace_torch", "predict_vs_laplace_torch",
                                                         "predict_vs_forward"}
    assert lap["last_layer"]["resnet18"]["bayesian_params"] == 512 * 10 + 10
    items = {(c["key"], c["item"]) for c in result["targets"] if c["section"] == "laplace"}
    assert items == {("resnet18", item) for item in list(benchmark.LAPLACE_TARGETS)[:3]} | {
        (m, "all-weights KFAC fit / laplace-torch") for m in ("mlp", "cnn")}
    assert md.startswith(f"Regenerate: `{result['command']}`") and "--sections laplace" in result["command"]
    assert "## Laplace: bayeswrap against laplace-torch" in md and "### Do both compute the same predictive?" in md
    assert f"Targets: {sum(c['met'] for c in result['targets'])} of {len(result['targets'])} met." in md


def test_laplace_section_without_laplace_torch(tmp_path, one_thread, monkeypatch):
    monkeypatch.setattr(benchmark, "load_laplace_torch", lambda: None)
    result, md = run(tmp_path, one_thread)
    lap = result["laplace"]
    assert lap["laplace_torch"] is None
    assert lap["last_layer"]["resnet18"]["ratio"].keys() == {"predict_vs_forward"}
    assert all(not r["ratio"] and "agreement" not in r for r in lap["all_weights"].values())
    assert [c["item"] for c in result["targets"]] == ["GLM probit / 1 forward"]
    assert "laplace-torch is not importable here" in md and "laplace-torch: not measured" in md
    assert "### Do both compute the same predictive?" not in md
