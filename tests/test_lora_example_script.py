"""scripts/lora_example.py (Bayesian LoRA on a tiny GPT-2 the script pretrains) in --fast mode.

The fast runs are subprocesses, as from the command line, with ``OMP_WAIT_POLICY=PASSIVE`` set before torch starts.
A second run with two methods checks that the same seed gives the same numbers (pretraining included).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("mlxtend")

from scripts import lora_example as script  # noqa: E402
from scripts import lora_example_report as report  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "lora_example.py"


def _run(out: Path, *extra: str) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--fast", "--out", str(out), *extra], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / f"{report.STEM}.json").read_text())


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_example")
    return _run(out), out


def test_every_method_row_is_present_finite_and_in_range(fast_run):
    data, out = fast_run
    assert data["fast"] is True and list(data["results"]) == list(script.ROWS)
    assert data["sets"] == ["test", *script.FAST["shifts"]]
    for row, r in data["results"].items():
        assert r["failed_seeds"] == 0, (row, [s.get("message") for s in r["per_seed"]])
        assert [s["seed"] for s in r["per_seed"]] == list(script.FAST["seeds"])
        for seed_run in r["per_seed"]:
            assert seed_run["num_samples"] == (0 if row == "map" else script.FAST["num_samples"])
            for name in data["sets"]:
                scores = seed_run["scores"][name]
                assert math.isfinite(scores["temperature"]) and scores["temperature"] > 0
                for scale in ("T1", "TS"):
                    s = scores[scale]
                    assert 0.0 <= s["error"] <= 1.0 and 0.0 <= s["ece"] <= 1.0, (row, name, scale)
                    assert math.isfinite(s["nll"]) and s["nll"] >= 0.0, (row, name, scale)
                # temperature scaling never changes the argmax, and T is fitted to lower the validation NLL
                assert scores["TS"]["error"] == pytest.approx(scores["T1"]["error"])
    blob, vi = data["results"]["blob"]["per_seed"][0], data["results"]["vi"]["per_seed"][0]
    assert 0 < blob["bayesian_parameters"] < vi["bayesian_parameters"]  # BLoB: A only
    assert data["rows"]["blob"]["options"] == {"params": "adapters_A"}
    assert {p.name for p in out.iterdir()} == {f"{report.STEM}.{ext}" for ext in ("md", "json", "png")}
    assert (out / f"{report.STEM}.png").stat().st_size > 10_000


def test_markdown_tables_equal_the_json(fast_run):
    data, out = fast_run
    text = (out / f"{report.STEM}.md").read_text()
    assert "FAST MODE" in text and data["command"] in text and "--fast" in data["command"]
    sections = text.split("\n## ")
    t1 = next(s for s in sections if s.startswith("Every method at temperature 1"))
    ts = next(s for s in sections if s.startswith("Every method with temperature scaling"))
    for section, scale in ((t1, "T1"), (ts, "TS")):
        rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| method")]
        expected = [("map", "T1"), ("map", "TS")] if scale == "T1" else []
        expected += [(r, scale) for r in data["results"] if not (r == "map" and scale == "T1")]
        assert len(rows) == len(expected)
        for line, (row, sc) in zip(rows, expected):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert cells[0] in (row, f"{row} + TS", report.REFERENCE)
            values = [float(c.split("±")[0]) for c in cells[2:]]
            want = [data["results"][row][s][sc][m]["mean"] for s in data["sets"] for m in report.METRICS]
            assert values == pytest.approx(want, abs=5e-4), row


def test_the_discussion_is_derived_from_the_numbers(fast_run):
    data, out = fast_run
    text = (out / f"{report.STEM}.md").read_text()
    ref = data["results"]["map"]
    for row, c in data["comparisons"].items():
        for entry in c["better"] + c["not_better"]:
            kind, metric = entry["score"].split()
            name = {v: k for k, v in report.SET_LABELS.items()}[kind]
            assert entry["value"] == data["results"][row][name]["T1"][metric.lower()]["mean"]
            assert entry["reference"] == ref[name]["TS"][metric.lower()]["mean"]
            assert (entry in c["better"]) == (entry["value"] < entry["reference"])
            assert entry["resolved"] is False  # one seed in fast mode resolves nothing
        assert report.LABELS[row] in text
    assert len(data["comparisons"]) == len(script.ROWS) - 1


def test_the_same_seed_gives_the_same_numbers(fast_run, tmp_path):
    data, _ = fast_run
    again = _run(tmp_path, "--methods", "vi,ensemble")
    assert list(again["results"]) == ["map", "vi", "ensemble"]
    assert again["upstream"]["held_out_nll"] == data["upstream"]["held_out_nll"]
    for row in again["results"]:
        first = [s["scores"] for s in data["results"][row]["per_seed"]]
        assert [s["scores"] for s in again["results"][row]["per_seed"]] == first, row


def _synthetic(map_ts_nll: list[float], vi_nll: list[float]) -> dict:
    """A results dict of two rows on one set, per seed, as run_experiment returns it (NLL only varies)."""
    def runs(values, scale):
        return [{"seed": k, "status": "ok", "scores": {"test": {scale: {"error": 0.1, "nll": v, "ece": 0.05}}}}
                for k, v in enumerate(values)]

    def stat(values):
        return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1))}

    fixed = {"error": stat([0.1, 0.1]), "ece": stat([0.05, 0.05])}
    return {"sets": ["test"], "results": {
        "map": {"per_seed": runs(map_ts_nll, "TS"), "test": {"TS": {**fixed, "nll": stat(map_ts_nll)}}},
        "vi": {"per_seed": runs(vi_nll, "T1"), "test": {"T1": {**fixed, "nll": stat(vi_nll)}}}}}


def test_a_difference_is_resolved_only_when_the_paired_seeds_agree():
    # seeds vary a lot (0.5 .. 0.9) but VI is 0.02 lower on every one: the paired differences resolve it
    paired = report.comparisons(_synthetic([0.5, 0.7, 0.9], [0.48, 0.68, 0.88]))["vi"]
    nll = next(e for e in paired["better"] if e["score"] == "test NLL")
    assert nll["value"] == pytest.approx(0.68) and nll["reference"] == pytest.approx(0.70) and nll["resolved"]
    # the same means, but VI lower on one seed and higher on another: not resolved
    mixed = report.comparisons(_synthetic([0.5, 0.7, 0.9], [0.40, 0.76, 0.88]))["vi"]
    nll = next(e for e in mixed["better"] if e["score"] == "test NLL")
    assert nll["value"] == pytest.approx(0.68) and not nll["resolved"]
    ece = next(e for e in mixed["not_better"] if e["score"] == "test ECE")  # equal: not better, not resolved
    assert ece["value"] == ece["reference"] and not ece["resolved"]


def test_tokens_encode_position_and_pattern():
    images = torch.zeros(2, 1, 8, 8)
    images[1, 0, 0, 1] = 1.0   # patch 0, top-right pixel: pattern 0b0100
    images[1, 0, 7, 7] = 0.5   # patch 15, bottom-right pixel: pattern 0b0001 (binarised at 0.5)
    ids = script.tokenise(images)
    assert ids.shape == (2, 17) and ids[:, -1].tolist() == [script.CLS_ID] * 2
    assert ids[0, :16].tolist() == [16 * p for p in range(16)]
    assert ids[1, 0] == 4 and ids[1, 15] == 16 * 15 + 1
    assert int(ids.max()) < script.VOCAB - 1  # the padding id never occurs


def test_splits_are_class_balanced_and_disjoint():
    y = torch.arange(10).repeat_interleave(12)
    cfg = {"train_per_class": 3, "val_per_class": 2, "test_per_class": 4}
    idx = script.class_splits(y, cfg, seed=0)
    assert [torch.bincount(y[idx[k]]).tolist() for k in ("train", "val", "test")] == [[3] * 10, [2] * 10, [4] * 10]
    assert len(set(torch.cat(list(idx.values())).tolist())) == 90
    assert not torch.equal(script.class_splits(y, cfg, seed=1)["train"], idx["train"])
    with pytest.raises(ValueError, match="fewer than"):
        script.class_splits(y, {**cfg, "test_per_class": 8}, seed=0)
