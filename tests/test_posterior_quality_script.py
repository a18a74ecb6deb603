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
    rows = {"map", "vi", "ivon", "mc_dropout", "sgld", "laplace (val)", "laplace (marglik)", "laplace_ll_kfac",
            "swag", "ensemble", "multiswag"}
    assert set(table) == rows | {f"{m}+ts" for m in rows}  # every row and its temperature-scaled twin
    assert table["map"]["cost"][0] == pytest.approx(1.0)
    assert table["ensemble"]["cost"][0] > 1.0  # five networks, trained at once
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
    for m in rows:  # every method's +TS twin: its own validation temperature, the same cost
        assert table[f"{m}+ts"]["ece"][0] == pytest.approx(per_seed[m]["ece_Topt"])
        assert table[f"{m}+ts"]["noise_nll"][0] == pytest.approx(per_seed[m]["noise_nll_Topt"])
        assert table[f"{m}+ts"]["cost"] == table[m]["cost"]
    # every tuned method records the options it chose: its prior std and its knob, both in the table
    tuned = data["datasets"]["digits"]["tuned"]
    assert {m: list(t[0]) for m, t in tuned.items()} == {
        "map": ["prior_std"], "vi": ["prior_std", "kl_weight"], "ivon": ["prior_std", "kl_weight"],
        "mc_dropout": ["prior_std", "p_drop"], "sgld": ["prior_std", "noise_scale"],
        "laplace (val)": ["prior_std", "prior_precision"], "laplace (marglik)": ["prior_std", "prior_precision"],
        "laplace_ll_kfac": ["prior_std"], "swag": ["prior_std"],
        "ensemble": ["prior_std"], "multiswag": ["prior_std"]}
    # Laplace's two operating points share the trained network and differ in the prior precision
    assert tuned["laplace (marglik)"][0]["prior_std"] == tuned["laplace (val)"][0]["prior_std"]
    assert tuned["laplace (marglik)"][0]["prior_precision"] != tuned["laplace (val)"][0]["prior_precision"]
    assert table["laplace (marglik)"]["cost"] == table["laplace (val)"]["cost"]
    # ensembles take their member method's tuned options (MAP's for the deep ensemble, SWAG's for MultiSWAG)
    assert tuned["ensemble"][0] == tuned["map"][0] and tuned["multiswag"][0] == tuned["swag"][0]
    vi_row = next(line for line in md.splitlines() if line.startswith("| vi |"))
    assert vi_row.endswith(f"| prior_std={tuned['vi'][0]['prior_std']:g}, kl_weight={tuned['vi'][0]['kl_weight']:g} |")
    sweep = data["datasets"]["digits"]["laplace_sweep"]
    assert set(sweep["error"]) == {"probit", "mc"} and len(sweep["error"]["probit"]) == 9
    # digits: two peer columns, VI and IVON against MAP under shift, the single-model ECE and NLL targets, the
    # Laplace sweep's two links
    assert sum(line.startswith("- met") or line.startswith("- NOT met") for line in md.splitlines()) == 8
