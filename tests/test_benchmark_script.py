"""scripts/benchmark.py in a tiny configuration: JSON structure, finite positive ratios, targets marked."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

import bayeswrap as bw
from scripts import benchmark

BAYESDLL_SRC = Path(os.environ.get("BAYESDLL_SRC", "/work/bayesdll"))

TINY = ["--img-size", "32", "--batch-sizes", "2", "--batch-size", "2", "--repeats", "1", "--warmup", "0",
        "--no-memory", "--curvature-models", "mlp", "--curvature-examples", "4", "--curvature-repeats", "1",
        "--epoch-train-size", "128", "--epoch-repeats", "1", "--predict-model", "mlp", "--num-samples", "2"]


def ratios(tree, path=""):
    """Every number under a key naming a ratio or speed-up, with its path."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            here = f"{path}/{k}"
            if any(word in k for word in ("ratio", "speedup", "ours_over_theirs")):
                yield from numbers(v, here)
            else:
                yield from ratios(v, here)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from ratios(v, f"{path}[{i}]")


def numbers(tree, path):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from numbers(v, f"{path}/{k}")
    else:
        yield path, tree


def run(tmp_path, extra, one_thread) -> tuple[dict, dict, str]:
    bench = benchmark
    out = tmp_path / "bench"
    returned = bench.main(TINY + ["--out", str(out)] + extra)
    result = json.loads(out.with_suffix(".json").read_text())
    assert returned["step"].keys() == result["step"].keys()
    md = out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").exists()
    return result, bench, md


def check_common(result: dict, md: str, methods: list[str]) -> None:
    found = list(ratios(result))
    assert len(found) > 20
    for path, value in found:
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (path, value)
    (step,) = result["step"].values()
    assert step["methods"] == methods
    for key in ("seconds", "ratio", "cpu_seconds", "cpu_ratio"):
        assert set(step[key]) == set(methods)
    assert step["ratio"]["plain"] == 1.0
    (curv,) = result["curvature"].values()
    assert "naive_loop" in curv["examples_per_s"]
    assert any(k.startswith("bayeswrap_ef_") for k in curv["examples_per_s"])
    assert any(k.startswith("bayeswrap_ggn_") for k in curv["examples_per_s"])
    assert {"bayeswrap_map", "bayeswrap_vi"} <= set(result["mlp_epoch"]["seconds"])
    (pred,) = result["predict"].values()
    assert set(pred) == {"1", "2"}
    assert set(pred["1"]["ratio"]) == {"vi", "glm_mc", "glm_probit"}
    # targets: structured in the JSON and marked in the Markdown
    sections = {c["section"] for c in result["targets"]}
    assert {"step", "curvature", "predict"} <= sections
    for c in result["targets"]:
        assert isinstance(c["met"], bool) and c["op"] in ("<=", ">=")
    for title in ("## Training step", "## Laplace curvature", "## Small-MLP epoch", "## Posterior predictive"):
        assert title in md
    assert "| target | status |" in md
    assert ("| met |" in md or "met;" in md) or "| gap (" in md
    assert f"Targets: {sum(c['met'] for c in result['targets'])} of {len(result['targets'])} met." in md


def test_benchmark_without_bayesdll(tmp_path, one_thread):
    result, _, md = run(tmp_path, ["--models", "mlp", "--methods", "plain,map,vi,vi_lrt,ivon,mc_dropout,sgld"],
                        one_thread)
    check_common(result, md, ["plain", "map", "vi", "vi_lrt", "ivon", "mc_dropout", "sgld"])
    assert result["bayesdll"] is None
    assert "bayesdll_" not in md and "BayesDLL VI" not in md and "BayesDLL: `" not in md
    assert "ours_over_theirs" not in result["step"]["mlp (batch 2)"]
    assert "ours_over_theirs" not in result["mlp_epoch"]


def test_benchmark_with_bayesdll(tmp_path, one_thread):
    if not (BAYESDLL_SRC / "methods" / "vi.py").exists():
        pytest.skip(f"no BayesDLL checkout at {BAYESDLL_SRC} (set BAYESDLL_SRC)")
    result, _, md = run(tmp_path, ["--models", "resnet18", "--methods", "plain,map,vi,mc_dropout,sgld",
                                   "--bayesdll-src", str(BAYESDLL_SRC)], one_thread)
    check_common(result, md, ["plain", "map", "vi", "mc_dropout", "sgld",
                              "bayesdll_vi", "bayesdll_mc_dropout", "bayesdll_sgld"])
    assert result["bayesdll"]["path"] == str(BAYESDLL_SRC.resolve())
    assert result["bayesdll"]["commit"]
    (step,) = result["step"].values()
    assert set(step["ours_over_theirs"]) == {"vi", "mc_dropout", "sgld"}
    assert "bayeswrap VI / BayesDLL VI" in md
    assert "bayesdll_la" in next(iter(result["curvature"].values()))["examples_per_s"]
    assert set(result["mlp_epoch"]["ours_over_theirs"]) >= {"map/bayesdll_vanilla", "vi/bayesdll_vi"}
    items = {(c["section"], c["item"]) for c in result["targets"]}
    assert ("step", "vi time / bayesdll_vi") in items
    assert ("mlp_epoch", "epoch time vi/bayesdll_vi") in items
    assert any(s == "curvature" and "bayesdll_la" in i for s, i in items)
    assert result["bayesdll"]["commit"] in md


def test_benchmark_lora_section(tmp_path, one_thread, capsys):
    """--sections lora --lora-fast: every method's row (laplace measured or skipped with its reason), ratios to
    plain, the issue's targets marked; the memory child's JSON; plain and bayeswrap score the same causal-LM NLL."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    from scripts.benchmarks import lora

    out = tmp_path / "lora"
    result = benchmark.main(["--sections", "lora", "--lora-fast", "--lora-repeats", "1", "--lora-warmup", "0",
                             "--no-memory", "--lora-methods", ",".join(lora.LORA_METHODS), "--out", str(out)])
    assert json.loads(out.with_suffix(".json").read_text())["lora"]["methods"] == result["lora"]["methods"]
    r = result["lora"]
    assert set(r["methods"]) | set(r["skipped"]) == set(lora.LORA_METHODS)
    assert set(r["methods"]) >= set(lora.LORA_METHODS) - {"laplace"}
    assert r["ratio"]["plain"] == r["cpu_ratio"]["plain"] == 1.0
    for key in ("ratio", "cpu_ratio", "seconds", "cpu_seconds"):
        assert set(r[key]) == set(r["methods"])
        assert all(math.isfinite(v) and v > 0 for v in r[key].values())
    assert r["config"]["adapter_params"] == 2 * (8 * 32 + 8 * 3 * 32)  # 2 layers of c_attn: A (8, 32), B (96, 8)
    items = {c["item"] for c in result["targets"] if c["section"] == "lora"}
    assert items == {"vi step time / plain", "ivon step time / plain"}  # memory targets need the children
    md = out.with_suffix(".md").read_text()
    assert "## LoRA fine-tuning" in md and "| vi_blob |" in md and "| ensemble |" in md
    # the memory child (run in-process here): the peak of a step is at least the resident set before it
    capsys.readouterr()
    benchmark.main(["--child-memory", "lora", "vi", "--lora-fast"])
    mem = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert mem["peak_mib"] >= mem["before_step_mib"] > 10
    # like with like: plain peft's loss and bayeswrap's causal_lm NLL of the same model and batch agree
    model = lora.lora_model(fast=True).eval()
    x, y = lora.lora_batch(model, 2, 16)
    bnn = bw.wrap(model, "map", **lora.wrap_options("map")[1]).eval()
    with torch.no_grad():
        assert bnn.loss(x, y).nll.item() == pytest.approx(model(**x, labels=y).loss.item(), rel=1e-6)
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--lora-methods", "vi,bogus"])
