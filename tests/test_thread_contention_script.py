"""scripts/thread_contention.py (issue 34, item 6): its summary of the rounds and its option checks."""

from __future__ import annotations

import pytest

from scripts import thread_contention as tc


def test_summary_takes_medians_per_policy_and_ratios_of_them():
    runs = [{"policy": p, "beside_hog": b, "seconds": s, "hog_rate": h}
            for p, b, s, h in [("default", False, 40.0, None), ("default", False, 44.0, None),
                               ("default", False, 90.0, None),  # an outlier the median ignores
                               ("default", True, 60.0, 50.0), ("default", True, 62.0, 40.0),
                               ("default", True, 70.0, 45.0),
                               ("ACTIVE", False, 42.0, None), ("ACTIVE", True, 300.0, 10.0)]]
    rows = tc.summarise(runs, hog_alone=[100.0, 80.0, 90.0], policies=["default", "ACTIVE"])
    assert [r["policy"] for r in rows] == ["default", "ACTIVE"]
    d, a = rows
    assert (d["alone_s"], d["beside_s"], d["n"]) == (44.0, 62.0, 3)
    assert d["ratio"] == pytest.approx(62.0 / 44.0)
    assert d["hog_ratio"] == pytest.approx(45.0 / 90.0)
    assert a["ratio"] == pytest.approx(300.0 / 42.0) and a["hog_ratio"] == pytest.approx(10.0 / 90.0)


@pytest.mark.parametrize("argv, message", [(["--policies", "BUSY"], "accepted values are default, PASSIVE, ACTIVE"),
                                           (["--repeats", "0"], "must be at least 1")])
def test_bad_options_are_refused_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        tc.parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_hog_runs_without_our_wait_policy_and_the_compare_gets_the_one_asked_for(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "OMP_WAIT_POLICY" not in tc._env(None) and "OMP_NUM_THREADS" not in tc._env(None)
    assert "OMP_WAIT_POLICY" not in tc._env("default")
    assert tc._env("ACTIVE")["OMP_WAIT_POLICY"] == "ACTIVE"
