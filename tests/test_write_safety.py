"""Nothing written outside the folder bayeswrap owns, no run file replaced, nothing written through a planted link.

The four dangerous cases of the second hardening round (``predict --out`` onto a run's checkpoint, a run steered
out of its comparison folder by a tuning file, writes through planted symbolic links, a device node replaced),
each refused with every byte outside the run folder checked unchanged; and the smaller leaks (a killed
``predict``'s temporary file, formula injection through class names, ``predict`` racing a ``fit --resume``).
"""

import csv
import os
import socket
import stat

import numpy as np
import pytest
import torch

import bayeswrap.app.cli as cli
from bayeswrap.app import reports, runs
from bayeswrap.core.io import UnsafePathError, atomic_write, file_kind, open_append, remove_stale_tmp_of, write_text

FAST = ["--batch-size", "64", "--shift-rotations", "0", "--shift-noise", "0", "--progress", "false"]


def _tree(folder):
    """Every entry under ``folder``: its kind, and its bytes for regular files (links not followed)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        kind = file_kind(p)
        out[p.relative_to(folder)] = kind if kind is not None else p.read_bytes()
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished MAP run and its inputs, in a module folder the tests copy from."""
    out = tmp_path_factory.mktemp("runs")
    assert cli.main(["fit", "--method", "map", "--epochs", "1", "--out-dir", str(out), "--run-name", "r", *FAST]) == 0
    return out / "r"


@pytest.fixture
def run(finished, tmp_path):
    """A private copy of the finished run (tests plant links in it), and an input file outside it."""
    import shutil
    run_dir = tmp_path / "runs" / "r"
    shutil.copytree(finished, run_dir, symlinks=True)
    np.save(tmp_path / "x.npy", np.random.default_rng(0).random((3, 64), dtype=np.float32))
    return run_dir


def test_predict_never_writes_into_a_run_folder(run, tmp_path, capsys):
    before = _tree(tmp_path)
    for target in (run / "best.pt", run / "new.csv", run / "tensorboard" / "x.csv", run.parent / "r" / "metrics.json"):
        code = cli.main(["predict", str(run), str(tmp_path / "x.npy"), "--out", str(target), "--overwrite"])
        assert code == 2, target
        assert f"lies inside the bayeswrap run folder {run}" in capsys.readouterr().err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("kind", ["character device", "named pipe", "symbolic link", "folder"])
def test_predict_refuses_a_destination_that_is_not_a_regular_file(run, tmp_path, capsys, kind):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    if kind == "character device":
        out = "/dev/null"
    elif kind == "named pipe":
        out = tmp_path / "fifo"
        os.mkfifo(out)
    elif kind == "symbolic link":
        out = tmp_path / "link.csv"
        out.symlink_to(victim)
    else:
        out = tmp_path / "folder"
        out.mkdir()
    before = _tree(tmp_path)
    assert cli.main(["predict", str(run), str(tmp_path / "x.npy"), "--out", str(out), "--overwrite"]) == 2
    assert f"--out {out} is a {kind}" in capsys.readouterr().err
    assert _tree(tmp_path) == before and victim.read_text() == "keep me"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_predict_out_in_a_missing_folder_or_under_a_file_is_refused_before_loading(run, tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    for out, message in ((tmp_path / "afile" / "p.csv", "is not a folder"), (tmp_path / "nope" / "p.csv",
                                                                               "does not exist")):
        assert cli.main(["predict", str(run), str(tmp_path / "x.npy"), "--out", str(out)]) == 2
        assert f"its folder {out.parent} {message}" in capsys.readouterr().err


def test_resume_refuses_a_planted_log_or_tensorboard_link_and_writes_nothing_outside(run, tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.log").write_text("untouched\n")
    (run / "train.log").unlink()
    (run / "train.log").symlink_to(outside / "secret.log")
    before = _tree(tmp_path)
    assert cli.main(["fit", "--resume", str(run), "--epochs", "2"]) == 2
    assert f"refusing to write {run / 'train.log'}: it is a symbolic link" in capsys.readouterr().err
    assert _tree(tmp_path) == before  # the log's target and the run itself unchanged
    with pytest.raises(UnsafePathError, match="it is a symbolic link"):
        open_append(run / "train.log")
    pytest.importorskip("torch.utils.tensorboard", exc_type=ImportError)
    (run / "train.log").unlink()
    (run / "train.log").write_text("")
    if (run / "tensorboard").exists():
        import shutil
        shutil.rmtree(run / "tensorboard")
    (run / "tensorboard").symlink_to(outside, target_is_directory=True)
    assert cli.main(["fit", "--resume", str(run), "--epochs", "2"]) == 2
    assert "refusing to write TensorBoard events into" in capsys.readouterr().err
    assert sorted(p.name for p in outside.iterdir()) == ["secret.log"]


def test_a_checkpoint_linked_from_outside_is_never_loaded(run, tmp_path, capsys):
    outside = tmp_path / "elsewhere.pt"
    (run / "best.pt").rename(outside)
    (run / "best.pt").symlink_to(outside)
    assert cli.main(["predict", str(run), str(tmp_path / "x.npy"), "--out", str(tmp_path / "p.csv")]) == 2
    assert "is a symbolic link or lies outside its run folder" in capsys.readouterr().err
    assert not (tmp_path / "p.csv").exists()
    with pytest.raises(UnsafePathError):
        runs.load_run(run)


def test_atomic_writes_refuse_links_and_devices_and_a_killed_writers_tmp_is_removed(tmp_path):
    target = tmp_path / "t.txt"
    target.write_text("keep")
    link = tmp_path / "l.txt"
    link.symlink_to(target)
    for path in (link, "/dev/null", tmp_path):
        with pytest.raises(UnsafePathError, match="refusing to write"):
            write_text(path, "x")
    assert target.read_text() == "keep" and link.is_symlink()
    # a temporary file whose writer is gone is removed; one of a live writer (this process) is kept
    dead = tmp_path / ".t.txt.999999999.abc.tmp"
    live = tmp_path / f".t.txt.{os.getpid()}.abc.tmp"
    dead.write_text("half")
    live.write_text("half")
    assert remove_stale_tmp_of(target) == [dead]
    assert live.exists() and not dead.exists()
    atomic_write(target, lambda p: open(p, "w").write("new"))
    assert target.read_text() == "new"


def test_predict_removes_what_a_killed_predict_left_beside_its_output(run, tmp_path):
    out = tmp_path / "p.csv"
    left = tmp_path / ".p.csv.999999999.x1y2.tmp"
    left.write_text("torn")
    assert cli.main(["predict", str(run), str(tmp_path / "x.npy"), "--out", str(out)]) == 0
    assert not left.exists() and len(list(csv.DictReader(open(out)))) == 3


def test_names_that_a_spreadsheet_would_run_are_escaped_in_the_csv():
    probs = torch.tensor([[[0.9, 0.1], [0.2, 0.8]]])
    rows = reports.predict_rows(probs, ["=HYPERLINK(1)", "ok.png"], ["+cmd", "@x"])
    assert rows[0]["input"] == "'=HYPERLINK(1)" and rows[1]["input"] == "ok.png"
    assert rows[0]["predicted_label"] == "'+cmd" and rows[1]["predicted_label"] == "'@x"
    assert list(rows[0])[4:6] == ["prob_'+cmd", "prob_'@x"]
    assert reports.csv_text("-1") == "'-1" and reports.csv_text("a=b") == "a=b"


def test_predict_refuses_a_run_another_process_is_writing(run, tmp_path, capsys):
    (run / runs.LOCK).write_text(f"{os.getppid()} {socket.gethostname()}\n")  # a live process holds it
    assert cli.main(["predict", str(run), str(tmp_path / "x.npy"), "--out", str(tmp_path / "p.csv")]) == 2
    assert f"run folder {run} is being written by process {os.getppid()}" in capsys.readouterr().err
    (run / runs.LOCK).write_text(f"999999999 {socket.gethostname()}\n")  # a stale lock does not block reading
    assert cli.main(["predict", str(run), str(tmp_path / "x.npy"), "--out", str(tmp_path / "p.csv")]) == 0


def test_loaded_run_takes_numpy_integers_and_float64(run):
    loaded = runs.load_run(run)
    x = np.random.default_rng(1).random((4, 64))
    from_float64 = loaded.sample_probs(x, 0)
    torch.testing.assert_close(from_float64, loaded.sample_probs(torch.as_tensor(x, dtype=torch.float32), 0))
    ints = np.arange(4 * 64, dtype=np.int64).reshape(4, 64) % 2
    torch.testing.assert_close(loaded.sample_probs(ints, 0), loaded.sample_probs(torch.as_tensor(ints).float(), 0))
    with pytest.raises(ValueError, match="not model inputs"):
        loaded.sample_probs(np.zeros((4, 64), dtype=complex), 0)
