"""scripts/posterior_quality.py in --fast mode: the benchmark's files, table and targets (smoke test)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pq")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "posterior_quality.py"), "--fast", "--out", str(out)],
                   check=True, cwd=ROOT, env=env, capture_output=True, timeout=600)
    return out


def test_fast_mode_writes_table_json_and_figure(fast_run):
    md = (fast_run / "posterior_quality.md").read_text()
    assert "FAST MODE" in md and "| method | error % | NLL | ECE | rot. NLL |" in md
    assert (fast_run / "posterior_quality.png").stat().st_size > 10_000
    data = json.loads((fast_run / "posterior_quality.json").read_text())
    table = data["datasets"]["digits"]["table"]
    assert set(table) == {"map", "vi", "ivon", "mc_dropout", "sgld", "laplace", "map+ts"}
    for method, row in table.items():
        for key in ("error", "nll", "ece", "rotation_nll", "noise_nll"):
            mean, std = row[key]
            assert mean >= 0 and std >= 0, (method, key)
        assert 0 <= row["error"][0] <= 1 and 0 <= row["ece"][0] <= 1
    # MAP + TS is MAP at its validation temperature: same error, the temperature-scaled NLL
    per_seed = data["datasets"]["digits"]["per_seed"][0]
    assert table["map+ts"]["error"][0] == pytest.approx(table["map"]["error"][0])
    assert table["map+ts"]["nll"][0] == pytest.approx(per_seed["map"]["nll_Topt"])
    assert table["map+ts"]["rotation_nll"][0] == pytest.approx(per_seed["map"]["rotation_nll_Topt"])
    # every tuned method records the option it chose
    assert {m: t[0]["option"] for m, t in data["datasets"]["digits"]["tuned"].items()} == {
        "map": "prior_std", "vi": "kl_weight", "ivon": "kl_weight", "mc_dropout": "p_drop", "sgld": "noise_scale",
        "laplace": "prior_precision"}
    sweep = data["datasets"]["digits"]["laplace_sweep"]
    assert set(sweep["error"]) == {"probit", "mc"} and len(sweep["error"]["probit"]) == 9
    assert sum(line.startswith("- met") or line.startswith("- NOT met") for line in md.splitlines()) == 10
