"""Progress on long work and honest first tables (issue 33, deliverables 3 and 4).

Oracles: the chance-level rule worked out by hand (K = 10 classes, n = 400: random guessing errs 0.9 with standard
error 0.015, so the limit is 0.87; log 10 = 2.302585), a temperature fitted by ``fit_temperature`` on labels that
the scores do not predict (its optimum is T → ∞, so it stops at the cap), counts of warnings raised by the test
itself, and the history ``fit`` returns.
"""

import csv
import io
import math
import re
import warnings

import pytest
import torch

import bayeswrap as bw
from bayeswrap.app import cli, compare, reports
from bayeswrap.app.progress import CompareProgress, counted_warnings, warning_details, warning_summary
from bayeswrap.evaluation import calibration
from bayeswrap.training import epoch_summary


def _report(error=0.1, nll=0.3, k=10, n=400, temperature=1.0, ece=0.02, predictive="Sampled()"):
    rep = {"n_classes": k, "n_examples": n, "T1": {"error": error, "nll": nll, "ece": ece},
           "predictive": predictive}
    if temperature is not None:
        rep["temperature"] = temperature
    return rep


# ----------------------------------------------------------------------------------------------- notes


def test_chance_level_rule_by_hand():
    """K = 10, n = 400: guessing errs 0.9 with SE sqrt(0.9 · 0.1 / 400) = 0.015; the limit is 0.9 − 2 · 0.015."""
    limit = 0.9 - 2 * 0.015
    assert reports.report_notes(_report(error=limit - 1e-3, nll=1.0)) == []
    (note,) = reports.report_notes(_report(error=limit + 1e-3, nll=1.0))
    assert note.startswith("chance level: test error 0.871 >= 0.870 (guessing among K = 10 classes errs")
    # the NLL rule: within 5 % of the uniform predictive's log K = 2.302585
    bound = 0.95 * math.log(10)
    assert reports.report_notes(_report(error=0.5, nll=bound - 1e-3)) == []
    (note,) = reports.report_notes(_report(error=0.5, nll=bound + 1e-3))
    assert f">= 0.95 log K = {bound:.3f}" in note and "log K = 2.303" in note
    # both: one note naming both reasons; a uniform predictive (error 0.9, NLL log K) is caught by both
    (note,) = reports.report_notes(_report(error=0.9, nll=math.log(10)))
    assert "test error 0.900" in note and "NLL 2.303" in note and ";" not in note
    # the standard error shrinks with n: the same error is chance level on 10 000 examples, not on 100
    assert reports.report_notes(_report(error=0.86, nll=1.0, n=100)) != []
    assert reports.report_notes(_report(error=0.86, nll=1.0, n=10_000)) == []


def test_a_temperature_at_its_cap_is_flagged_and_the_bounds_are_fit_temperatures():
    assert reports.temperature_bounds() == (0.01, 100.0)
    # scores that do not predict the labels: validation NLL falls as T grows, so the fit stops at the cap
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(400, 10, generator=g)
    labels = torch.randint(0, 10, (400,), generator=g)
    probs = logits.softmax(-1).double()
    rep = calibration.report(probs, labels, val=(probs, labels))
    assert rep["temperature"] == pytest.approx(100.0, rel=1e-9)
    notes = reports.report_notes(rep)
    assert [n.split(":")[0] for n in notes] == ["chance level", "T at bound"]
    assert "is 100, the upper end of its range [0.01, 100]" in notes[1]
    assert reports.report_notes(_report(temperature=99.9)) == []
    (low,) = reports.report_notes(_report(temperature=0.01))
    assert low.startswith("T at bound: the temperature fitted on validation is 0.01, the lower end")
    assert reports.report_notes(_report(temperature=None)) == []  # no validation data: no temperature


# ----------------------------------------------------------------------------------------------- tables


def _results():
    """MAP (S = 0 and 5 the same network, numbers equal up to rounding), VI (S = 0 and 5 differ), a chance-level
    ensemble with its temperature at the cap."""
    def run(final, seconds):
        return {"history": [{"seconds": seconds}], "final": final, "tuning": {"options": {"prior_std": 0.3}}}

    return {
        "map": run({"0": _report(predictive="PosteriorMean()"), "5": _report(nll=0.3 + 1e-12)}, 10.0),
        "vi": run({"0": _report(predictive="PosteriorMean()"), "5": _report(nll=0.25)}, 15.0),
        "ensemble": run({"0": _report(error=0.9, nll=2.3, temperature=100.0, predictive="Mixture()"),
                         "5": _report(error=0.9, nll=2.3, temperature=100.0, predictive="Mixture()")}, 50.0),
    }


def test_compact_table_drops_identical_rows_and_keeps_differing_ones():
    rows = reports.comparison_rows(_results(), "map")
    assert [(r["method"], r["num_samples"]) for r in rows] == [("map", 0), ("map", 5), ("vi", 0), ("vi", 5),
                                                              ("ensemble", 0), ("ensemble", 5)]
    assert [(r["method"], r["num_samples"]) for r in reports.compact_rows(rows)] == [
        ("map", [0, 5]), ("vi", [0]), ("vi", [5]), ("ensemble", [0, 5])]
    table = reports.markdown_table(rows)
    lines = table.splitlines()
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == [
        "method", "S", "predictive", "error", "NLL", "ECE", "shift err", "shift NLL", "OOD AUROC", "cost", "note"]
    body = [line for line in lines[2:] if line.startswith("|")]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in body]
    assert cells == [
        ["map", "0, 5", "Sampled", "0.100", "0.300", "0.020", "", "", "", "1.00", ""],
        ["vi", "0", "PosteriorMean", "0.100", "0.300", "0.020", "", "", "", "1.50", ""],
        ["vi", "5", "Sampled", "0.100", "0.250", "0.020", "", "", "", "1.50", ""],
        ["ensemble", "0, 5", "Mixture", "0.900", "2.300", "0.020", "", "", "", "5.00", "[1, 2]"]]
    assert len({len(line) for line in lines if line.startswith("|")}) == 1  # aligned
    assert max(len(line) for line in lines) <= reports.TABLE_WIDTH
    # the footnotes: the notes of the kept ensemble row, numbered as in its note cell
    text = " ".join(table.split())
    assert "[1] ensemble (S = 0, 5): chance level: test error 0.900 >= 0.870" in text
    assert "[2] ensemble (S = 0, 5): T at bound: the temperature fitted on validation is 100" in text
    assert "Tuned by validation NLL: map prior_std=0.3; vi prior_std=0.3; ensemble prior_std=0.3." in text
    # the full table and the CSV keep every row and every column, the notes in full
    full = reports.markdown_table(rows, full=True).splitlines()
    assert full[0] == "| " + " | ".join(reports.COMPARE_COLUMNS) + " |" and len(full) == 2 + len(rows)
    parsed = list(csv.DictReader(io.StringIO(reports.csv_table(rows))))
    assert [r["num_samples"] for r in parsed] == ["0", "5", "0", "5", "0", "5"]
    assert parsed[4]["note"] == "; ".join(reports.report_notes(_results()["ensemble"]["final"]["0"]))
    assert parsed[0]["note"] == ""
    # the terminal lines: one per method and note, the S it holds for
    warned = reports.row_warnings(rows)
    assert [w.split(":")[0] for w in warned] == ["ensemble (S = 0, 5)", "ensemble (S = 0, 5)"]


def test_short_predictive_names():
    assert reports.short_predictive("GLM(link='probit')") == "GLM probit"
    assert reports.short_predictive("Sampled()") == "Sampled"
    assert reports.short_predictive(None) == "" and reports.short_predictive("odd") == "odd"


def test_bracket_text_is_a_sentence():
    stage = {"option": "prior_std", "chosen": 81.0, "grid": [0.33, 1.0, 3.0, 9.0, 27.0, 81.0],
             "extensions": [9.0, 27.0, 81.0], "bounds": [1e-3, 1e3],
             "bound_hit": {"side": "high", "reason": "max_extensions"}}
    assert compare.bracket_text(stage) == ("prior_std 81 is the highest value scored (after 3 extensions of the grid, "
                                           "the most allowed): the best value may lie above it")
    stage.update(chosen=1e-3, bound_hit={"side": "low", "reason": "value_bound"})
    assert compare.bracket_text(stage) == ("prior_std 0.001 is the lowest value scored (the lower end of its range "
                                           "[0.001, 1000]): the best value may lie below it")
    assert compare.bracket_text({**stage, "bound_hit": None}) is None


# ----------------------------------------------------------------------------------------------- warnings


def test_warnings_of_a_loop_are_counted_once_per_site():
    def candidate(i):
        warnings.warn(f"variance sums to {i}", RuntimeWarning)  # one site, the numbers differ
        return i

    with counted_warnings() as caught:
        for i in range(7):
            candidate(i)
        warnings.warn("other", UserWarning)
    lines = warning_summary(caught)
    assert len(lines) == 2
    assert re.fullmatch(r"7 × RuntimeWarning at tests/test_progress_tables\.py:\d+ \(7 different messages\), "
                        r"the last: variance sums to 6", lines[0]), lines[0]
    assert re.fullmatch(r"UserWarning at tests/test_progress_tables\.py:\d+: other", lines[1]), lines[1]
    assert warning_summary(caught, max_chars=10)[0].endswith("the last: variance s …")  # cut, and marked
    details = warning_details(caught).splitlines()  # every message whole, with its count
    assert details[0].endswith("7 ×:") and details[1:8] == [f"  1 × variance sums to {i}" for i in range(7)]
    assert details[8].startswith("UserWarning at") and details[9] == "  1 × other"
    # Python's filters keep their effect: an ignored warning is not recorded, an error filter still raises
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with counted_warnings() as caught:
            candidate(0)
        assert caught == []
        warnings.simplefilter("error", RuntimeWarning)
        with counted_warnings(), pytest.raises(RuntimeWarning):
            candidate(0)


# ----------------------------------------------------------------------------------------------- progress


def test_compare_progress_counts_methods_and_fits():
    out = io.StringIO()
    progress = CompareProgress({"map": (5, 1), "vi": (7, 1), "ensemble": (0, 5)}, bar=False, file=out)
    with progress:
        progress.start_method("map", "tuning prior_std")
        for i in range(5):
            progress.candidate({"stage": "knob", "option": "prior_std", "value": 0.1 * 3**i, "index": i + 1,
                                "total": 5, "fixed": {}})
            progress.fit_done(tuning=True)
        progress.candidate({"stage": "knob", "option": "prior_std", "value": 30.0, "index": 6, "total": 6,
                            "fixed": {}})
        progress.fit_done(tuning=True)  # a grid extension: one fit more than planned
        assert (progress.n, progress.total) == (6, 20)
        progress.final_run()
        progress.fit_done()
        progress.end_method()
        progress.start_method("vi", "tuning kl_weight")
        progress.candidate({"stage": "knob", "option": "kl_weight", "value": 0.01, "index": 3, "total": 5,
                            "fixed": {"prior_std": 0.3}})
        assert progress.bar.desc.startswith("vi 2/3: tuning kl_weight 3/5 = 0.01, prior_std 0.3")
        progress.fit_done(tuning=True)
        progress.end_method()  # 6 planned tuning fits were not trained: they leave the total
        assert (progress.n, progress.total) == (8, 14)
        progress.start_method("ensemble", "5 map members")
        progress.final_run()
        progress.fit_done(5)
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] for line in lines] == ["compare map 1/3", "compare map 1/3", "compare vi 2/3",
                                                      "compare ensemble 3/3", "compare ensemble 3/3"]
    assert lines[0] == "compare map 1/3: tuning prior_std [fits 0/19, 00:00 elapsed]"  # no ETA before a fit
    assert re.search(r"\[fits 8/14, \d\d:\d\d elapsed, ETA \d\d:\d\d\]$", lines[3])
    # a resumed comparison: finished methods count as done from the start
    assert CompareProgress({"map": (5, 1), "vi": (7, 1)}, done=("map",), bar=False, file=out).n == 6
    with pytest.raises(ValueError, match=r"done=\['lbbnn'\]"):
        CompareProgress({"map": (5, 1)}, done=("lbbnn",), bar=False, file=out)


def test_compare_prints_method_counters_and_one_line_per_warning_site(tmp_path, monkeypatch, capsys):
    """A real comparison (tuning scores stubbed: each candidate warns once and scores a paraboloid in log values): the
    terminal gets ``k/n`` per method and one summary line for the candidates' warnings, not one per candidate."""
    def score(cfg, num_samples):
        warnings.warn(f"candidate at prior_std {cfg.prior_std:g} is noisy", RuntimeWarning)
        return math.log10(cfg.prior_std) ** 2 + (math.log10(cfg.kl_weight) + 2) ** 2

    monkeypatch.setattr(compare, "tuning_score", score)
    assert cli.main(["compare", "--methods", "map,vi", "--epochs", "1", "--num-samples", "0,2", "--shift-rotations",
                     "0", "--shift-noise", "0", "--out-dir", str(tmp_path), "--batch-size", "64"]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[0].startswith("compare map 1/2: tuning prior_std by validation NLL over 0.1, 0.3, 1, 3, 10 [fits 0/")
    assert any(line.startswith("compare vi 2/2: tuning kl_weight by validation NLL over") for line in err)
    base = tmp_path / "compare-digits-mlp"
    tuning = {m: compare.read_tuning_file(base / f"tuning_{m}.json", m) for m in ("map", "vi")}
    for method, record in tuning.items():
        count = sum(len(s["grid"]) - len(s["reused"]) for s in record["stages"])
        summary = [line for line in err if "RuntimeWarning" in line and line.startswith(f"compare {method} ")]
        assert len(summary) == 1 and f": warning: {count} × RuntimeWarning at tests/test_progress_tables.py:" in \
            summary[0], err
        assert f"(every message: {method}/warnings.log)" in summary[0]
        log = (base / method / "warnings.log").read_text()  # every distinct message whole, with its count
        assert log.startswith("RuntimeWarning at tests/test_progress_tables.py:") and f", {count} ×:\n" in log
        assert sum(int(line.split(" × ")[0]) for line in log.splitlines()[1:]) == count, log
    assert not any("{" in line for line in err)  # no raw dicts
    assert not any(line.startswith("compare") for line in captured.out.splitlines())
    # the terminal table is comparison.md; comparison_full.md and the CSV hold every column
    assert captured.out.startswith((base / "comparison.md").read_text())
    assert (base / "comparison_full.md").read_text().startswith("| " + " | ".join(reports.COMPARE_COLUMNS) + " |")


# ----------------------------------------------------------------------------------------------- fit bar


def _fit(progress, epochs=3):
    torch.manual_seed(0)
    x = torch.randn(256, 6)
    y = (x[:, 0] > 0).long()
    batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    bnn = bw.wrap(net, "map", num_data=256)
    return bw.fit(bnn, batches, epochs=epochs, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1),
                  val_loader=batches[:2], progress=progress)


def test_fit_keeps_one_bar_with_the_last_epochs_metrics(capsys):
    buf = io.StringIO()
    history = _fit({"file": buf, "disable": False, "desc": "map", "mininterval": 0})
    final = buf.getvalue().split("\r")[-1]
    assert final.endswith("\n")  # left on the terminal (leave=True), not cleared
    assert final.startswith("map epoch 3/3: 100%|") and "| 24/24 [" in final
    summary = epoch_summary(history[-1])
    assert summary == (f"train nll {history[-1]['train_nll']:.3g} err {history[-1]['train_error']:.3g} | "
                       f"val nll {history[-1]['val_nll']:.3g} err {history[-1]['val_error']:.3g}")
    assert final.rstrip().endswith(summary + "]")
    # one bar for the whole fit: every epoch's description on the same line, no bar per epoch
    assert buf.getvalue().count("\n") == 1 and "map epoch 1/3" in buf.getvalue()
    # the default (True) draws only on a terminal: pytest's stderr is not one
    _fit(True, epochs=1)
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match=r"progress='yes' is not accepted; accepted: True, False, or a mapping"):
        _fit("yes", epochs=1)
    assert epoch_summary({"train_nll": 0.5, "val_nll": 0.25, "val_rmse": 1.5}) == \
        "train nll 0.5 | val nll 0.25 rmse 1.5"


def test_a_note_shared_by_rows_is_one_footnote():
    """Two VI rows (S = 0 and 5 differ in NLL) with the same chance-level note: one footnote naming both."""
    final = {"0": _report(error=0.9, nll=1.0), "5": _report(error=0.9, nll=1.1)}  # the NLL is not in the note
    rows = reports.comparison_rows({"vi": {"history": [], "final": final}}, "map")
    table = reports.markdown_table(rows)
    assert [line.split("|")[-2].strip() for line in table.splitlines()[2:4]] == ["[1]", "[1]"]
    assert " ".join(table.split()).count("[1] vi (S = 0), vi (S = 5): chance level: test error 0.900 >= 0.870") == 1
    assert "[2]" not in table
    assert reports.row_warnings(rows) == [f"vi (S = 0, 5): {rows[0]['note']}"]
