"""Run folders and the command line, issue 34: input ranges, names and Markdown in tables, data.json shapes, a
failed write named, symlinked folders, and compare's cost over a resume.
"""

import csv
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import bayeswrap as bw
import bayeswrap.app.cli as cli
import bayeswrap.core.io as core_io
from bayeswrap.app import config, reports, runner

FAST = ["--batch-size", "64", "--shift-rotations", "0", "--shift-noise", "0", "--progress", "false"]
REPO = Path(bw.__file__).resolve().parents[1]  # the checkout under test


@pytest.fixture(scope="module")
def map_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("issue34")
    assert cli.main(["fit", "--method", "map", "--epochs", "1", "--num-samples", "0", "--out-dir", str(out),
                     *FAST]) == 0
    return out / "digits-mlp-map"


def _copy(run, tmp_path, name="run"):
    """A copy of a run folder to change (the fixture's stays as fit wrote it)."""
    return Path(shutil.copytree(run, tmp_path / name, symlinks=True))


def _predict(run, inputs, tmp_path, *flags):
    out = tmp_path / "pred.csv"
    return cli.main(["predict", str(run), str(inputs), "--out", str(out), "--overwrite", *flags]), out


# --------------------------------------------------------------------------- integer .npy inputs and the input range


def test_data_json_records_the_training_input_range(map_run):
    from bayeswrap.app.build import load_splits

    record = json.loads((map_run / "data.json").read_text())
    splits, _ = load_splits(bw.load_run(map_run).config)
    x = splits.train.inputs
    assert record["input_range"] == [float(x.min()), float(x.max())] == [0.0, 1.0]  # digits: pixels / 16
    assert bw.load_run(map_run).input_range == (0.0, 1.0)


def test_an_int64_array_far_outside_the_training_range_is_refused_naming_file_and_ranges(map_run, tmp_path, capsys):
    x = np.zeros((3, 64), dtype=np.int64)
    x[1, 5] = 2**62
    path = tmp_path / "codes.npy"
    np.save(path, x)
    rc, out = _predict(map_run, path, tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert f"inputs '{path}' hold values in [0, 4.61169e+18]" in err
    assert f"outside the range [0, 1] of the training inputs ({map_run / 'data.json'})" in err
    assert "beyond 2**24 = 16,777,216" in err and "--allow-out-of-range" in err and "Traceback" not in err
    # the flag predicts them anyway, with the warning
    rc, out = _predict(map_run, path, tmp_path, "--allow-out-of-range")
    err = capsys.readouterr().err
    assert rc == 0 and len(list(csv.DictReader(open(out)))) == 3
    assert "bayeswrap: warning: inputs" in err and "predicted anyway (allowed)" in err


def test_a_modest_excursion_warns_and_inputs_inside_the_range_are_silent(map_run, tmp_path, capsys):
    inside = tmp_path / "inside.npy"
    np.save(inside, np.full((2, 64), 0.5, dtype=np.float32))
    assert _predict(map_run, inside, tmp_path)[0] == 0
    assert "warning" not in capsys.readouterr().err
    brighter = tmp_path / "brighter.npy"
    np.save(brighter, np.full((2, 64), 1.5, dtype=np.float32))  # half a width beyond the range
    assert _predict(map_run, brighter, tmp_path)[0] == 0
    err = capsys.readouterr().err
    assert "outside the range [0, 1] of the training inputs" in err and "by 0.5 times its width" in err


def test_the_range_rule_at_its_bounds():
    from bayeswrap.app.input_range import InputRangeError, InputRangeWarning, check_input_range

    recorded = (0.0, 2.0)  # width 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_input_range(torch.tensor([[0.0, 2.0]]), recorded, "x") is None  # inside: silent
    with pytest.warns(InputRangeWarning, match=r"by 10 times its width"):
        check_input_range(torch.tensor([[0.0, 22.0]]), recorded, "x")  # 10 widths: warned
    with pytest.raises(InputRangeError, match=r"inputs x hold values in \[-20\.2, 0\], outside the range \[0, 2\] "
                                              r"of the training inputs .* by 10\.1 times its width"):
        check_input_range(torch.tensor([[-20.2, 0.0]]), recorded, "x")  # beyond 10 widths: refused
    with pytest.warns(InputRangeWarning, match="predicted anyway"):
        check_input_range(torch.tensor([[-20.2, 0.0]]), recorded, "x", allow=True)
    # without a recorded range (older runs, image runs) only a magnitude beyond 2**24 is refused
    assert check_input_range(torch.tensor([[1e6]]), None, "x") is None
    with pytest.raises(InputRangeError, match=r"records no training input range, and beyond 2\*\*24"):
        check_input_range(torch.tensor([[2.0**25]]), None, "x")
    # a recorded range that holds such magnitudes accepts them
    assert check_input_range(torch.tensor([[2.0**30]]), (0.0, 2.0**31), "x") is None


def test_an_older_run_without_a_recorded_range_loads_and_still_refuses_huge_values(map_run, tmp_path, capsys):
    from bayeswrap.app.input_range import InputRangeError

    run = _copy(map_run, tmp_path)
    record = json.loads((run / "data.json").read_text())
    del record["input_range"]
    (run / "data.json").write_text(json.dumps(record))
    loaded = bw.load_run(run)
    assert loaded.input_range is None
    x = torch.full((2, 64), 3.0)  # beyond digits' range, but no range is recorded: predicted silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loaded.sample_probs(x, 0).shape == (1, 2, 8)
    with pytest.raises(InputRangeError, match=r"inputs hold values in \[0, 4\.61169e\+18\]"):
        loaded.sample_probs(torch.tensor([[2.0**62] + [0.0] * 63]), 0)


# --------------------------------------------------------------------------- names read back, Markdown escaped


def test_markdown_text_escapes_what_markdown_reads():
    from bayeswrap.app.markdown import markdown_text

    assert markdown_text("prior_std=0.3, kl_weight=0.01") == "prior_std=0.3, kl_weight=0.01"  # intraword _
    assert markdown_text("laplace (val)") == "laplace (val)"
    assert markdown_text("a|b") == r"a\|b"
    assert markdown_text("`code` *bold* _em_") == r"\`code\` \*bold\* \_em\_"
    assert markdown_text("<img src=x>") == r"\<img src=x\>"
    assert markdown_text("[link](http://x)") == r"\[link\](http://x)"
    assert markdown_text("two\nlines\r\nthree") == "two lines three"
    assert markdown_text(r"back\slash") == r"back\\slash"


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row: split at the pipes that are not escaped."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_every_table_cell_is_escaped():
    final = {"0": {"T1": {"error": 0.1, "ece": 0.02, "nll": 0.3}, "predictive": "X(a='|`')"}}
    results = {"map": {"history": [], "final": final},
               "vi": {"history": [], "final": final, "operating_point": "a|b\n<script>",
                      "tuning": {"options": {"prior_std": 0.3}}}}
    rows = reports.comparison_rows(results, "map")
    for full, columns in ((False, len(reports.SUMMARY_COLUMNS)), (True, len(reports.COMPARE_COLUMNS))):
        table = reports.markdown_table(rows, full=full)
        lines = [line for line in table.splitlines() if line.startswith("|")]
        assert len(lines) == 4 and all(len(_cells(line)) == columns for line in lines)  # no cell split, no row broken
        assert r"vi (a\|b \<script\>)" in table and "<script>" not in table
        assert (r"X(a='\|\`')" if full else r"X \|\`") in table  # the compact table drops brackets and quotes
    assert r"Tuned by validation NLL: vi (a\|b \<script\>) prior_std=0.3." in reports.markdown_table(rows)


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """compare map,vi (2 epochs, no tuning) interrupted after vi's first epoch, as the folder then stands."""
    out = tmp_path_factory.mktemp("compare34")
    real, saved = runner.save_checkpoint, []

    def interrupt_vi_after_epoch_1(path, obj, *args, **kwargs):
        result = real(path, obj, *args, **kwargs)
        if Path(path).parent.name == "vi" and Path(path).name == "last.pt":
            saved.append(path)
            raise KeyboardInterrupt
        return result

    runner.save_checkpoint = interrupt_vi_after_epoch_1
    try:
        rc = cli.main(["compare", "--methods", "map,vi", "--num-samples", "0", "--no-tune", "--epochs", "2",
                       "--out-dir", str(out), *FAST])
    finally:
        runner.save_checkpoint = real
    assert rc == 130 and len(saved) == 1
    base = out / "compare-digits-mlp"
    assert (base / "map" / "metrics.json").is_file() and not (base / "vi" / "metrics.json").exists()
    return base


def test_a_name_read_back_from_metrics_json_is_refused_naming_file_and_value(comparison, tmp_path, capsys):
    base = _copy(comparison, tmp_path, "compare")
    path = base / "map" / "metrics.json"
    metrics = json.loads(path.read_text())
    path.write_text(json.dumps({**metrics, "operating_point": "x | `y`"}))
    assert cli.main(["compare", "--resume", str(base)]) == 2
    err = capsys.readouterr().err
    assert f"'{path}': operating_point 'x | `y`' is not a valid name" in err and "Traceback" not in err
    assert not (base / "comparison.md").exists() and not (base / ".lock").exists()


# --------------------------------------------------------------------------- compare's cost over a resume


def test_a_resumed_comparison_counts_the_epochs_trained_before_the_resume(comparison, tmp_path):
    """cost is the sum of the epochs' seconds, which last.pt keeps: the epoch vi trained before the interruption
    counts (here made 1000 s, as on a loaded machine)."""
    base = _copy(comparison, tmp_path, "compare")
    last = base / "vi" / "last.pt"
    ckpt = core_io.load_checkpoint(last)
    assert ckpt["epoch"] == 1 and ckpt["history"][0]["seconds"] > 0  # vi's first session, up to its checkpoint
    ckpt["history"][0]["seconds"] = 1000.0
    core_io.save_checkpoint(last, ckpt)
    assert cli.main(["compare", "--resume", str(base)]) == 0
    map_seconds = sum(h["seconds"] for h in json.loads((base / "map" / "metrics.json").read_text())["history"])
    vi_history = json.loads((base / "vi" / "metrics.json").read_text())["history"]
    assert [h["epoch"] for h in vi_history] == [1, 2] and vi_history[0]["seconds"] == 1000.0
    rows = {r["method"]: r for r in csv.DictReader(open(base / "comparison.csv"))}
    assert float(rows["vi"]["cost"]) == pytest.approx((1000.0 + vi_history[1]["seconds"]) / map_seconds)


# --------------------------------------------------------------------------- data.json shapes


@pytest.mark.parametrize("shape", [[100_000_000], [4096, 4097], [1, 2**31]])
def test_an_oversized_data_json_shape_is_refused_naming_the_file_and_value(map_run, tmp_path, shape):
    values = config.read_json_file(map_run / "data.json")
    path = tmp_path / "data.json"
    with pytest.raises(ValueError, match=rf"'{path}': input_shape={re.escape(str(shape))} is not valid; accepted: a "
                                         r"list of 1 to 8 positive integers holding at most 16,777,216 values"):
        config.check_data_json({**values, "input_shape": shape}, path)
    assert config.check_data_json({**values, "input_shape": [3, 2048, 2048]}, path)  # a large image passes


def test_predict_with_an_oversized_data_json_shape_names_the_file_before_building_the_model(map_run, tmp_path,
                                                                                            capsys):
    run = _copy(map_run, tmp_path)
    record = json.loads((run / "data.json").read_text())
    (run / "data.json").write_text(json.dumps({**record, "input_shape": [100_000_000]}))
    inputs = tmp_path / "x.npy"
    np.save(inputs, np.zeros((1, 64), dtype=np.float32))
    assert _predict(run, inputs, tmp_path)[0] == 2
    err = capsys.readouterr().err
    assert f"{run / 'data.json'}" in err and "input_shape=[100000000] is not valid" in err


# --------------------------------------------------------------------------- a failed write is named


def _full_disk_for(name: str, monkeypatch):
    """atomic_write fails as on a full disk (ENOSPC, no file named) for files called ``name``."""
    real = core_io.atomic_write

    def write(path, writer):
        if Path(path).name == name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, writer)

    monkeypatch.setattr(core_io, "atomic_write", write)


def test_a_full_disk_during_evaluate_names_the_file_and_leaves_no_lock(map_run, monkeypatch, capsys):
    _full_disk_for("eval_S0.json", monkeypatch)
    assert cli.main(["evaluate", str(map_run), "--num-samples", "0"]) == 1
    err = capsys.readouterr().err
    assert f"writing eval_S0.json in {map_run}: No space left on device (errno 28)" in err
    assert "Free space on that disk" in err
    assert not (map_run / ".lock").exists() and not (map_run / "eval_S0.json").exists()


def test_a_full_disk_during_fit_names_metrics_json_and_leaves_no_lock(tmp_path, monkeypatch, capsys):
    _full_disk_for("metrics.json", monkeypatch)
    assert cli.main(["fit", "--method", "map", "--epochs", "1", "--num-samples", "0", "--out-dir", str(tmp_path),
                     *FAST]) == 1
    run = tmp_path / "digits-mlp-map"
    assert f"writing metrics.json in {run}: No space left on device" in capsys.readouterr().err
    assert not (run / ".lock").exists() and not (run / "metrics.json").exists()


def test_a_full_disk_writing_the_comparison_table_names_it(comparison, tmp_path, monkeypatch, capsys):
    base = _copy(comparison, tmp_path, "compare")
    _full_disk_for("comparison.md", monkeypatch)
    assert cli.main(["compare", "--resume", str(base)]) == 1
    assert f"writing comparison.md in {base}: No space left on device" in capsys.readouterr().err
    assert not (base / ".lock").exists()


def test_a_lock_that_cannot_be_written_is_named_and_removed(map_run):
    """Every write fails (RLIMIT_FSIZE = 0: EFBIG, as a full disk fails the first byte): evaluate takes the lock
    first, names it, and leaves no empty lock behind."""
    script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)); "
              "import bayeswrap.app.cli as cli; sys.exit(cli.main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-c", script, "evaluate", str(map_run), "--num-samples", "0"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert f"taking the lock: writing .lock in {map_run}: File too large (errno 27)" in proc.stderr
    assert not (map_run / ".lock").exists()


# --------------------------------------------------------------------------- symlinked run and method folders


def test_evaluate_and_resume_through_a_symlinked_run_folder_say_it_is_a_link(map_run, tmp_path, capsys):
    link = tmp_path / "alias"
    link.symlink_to(map_run)
    for args in (["evaluate", str(link)], ["fit", "--resume", str(link)]):
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert f"{link}: the run folder is a symbolic link to {map_run}" in err, err
        assert f"Pass the real path instead: {map_run.resolve()}" in err and "Traceback" not in err
    assert not (map_run / ".lock").exists()
    # a new run whose folder name is taken by a link: neither --resume nor --overwrite applies
    for flags in ([], ["--overwrite"]):
        assert cli.main(["fit", "--method", "map", "--epochs", "1", "--out-dir", str(tmp_path), "--run-name", "alias",
                         *flags, *FAST]) == 2
        err = capsys.readouterr().err
        assert f"run folder {link} is a symbolic link to {map_run}" in err and "pass --resume" not in err
        assert "choose another --run-name or --out-dir" in err
    assert link.is_symlink() and (map_run / "best.pt").is_file()


def test_a_symlinked_method_folder_of_a_comparison_is_refused_saying_where_it_points(comparison, tmp_path,
                                                                                   capsys):
    base = _copy(comparison, tmp_path, "compare")
    elsewhere = Path(shutil.move(base / "map", tmp_path / "elsewhere"))
    (base / "map").symlink_to(elsewhere)
    assert cli.main(["compare", "--resume", str(base)]) == 2
    err = capsys.readouterr().err
    assert f"the method folder {base / 'map'} of the comparison is a symbolic link to {elsewhere}" in err
    assert f"move {elsewhere.resolve()} to {base / 'map'}" in err and "Traceback" not in err
    assert not (base / "comparison.md").exists() and not (base / ".lock").exists()
