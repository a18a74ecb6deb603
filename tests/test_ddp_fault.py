"""A rank killed or hung mid-epoch under ``torchrun`` (issue 34, item 7): the run folder stays consistent, the other
rank stops within a bounded time saying why, and ``--resume`` under ``torchrun`` ends where an uninterrupted run ends.

Four ``torchrun --nproc_per_node=2`` launches of ``bayeswrap fit`` (gloo, CPU, one thread each) train SGLD (its
Langevin noise comes from the global random stream, so a resume must restore it) on the bundled digits for 3
epochs of 8 steps: (a) uninterrupted; (b) the same with rank 1 SIGKILLed at its 4th step of epoch 2; (c)
``--resume`` of (b) with ``BAYESWRAP_COLLECTIVE_TIMEOUT=4`` and rank 0, the writer, hung at the 4th step of epoch 3:
rank 1 gives up after 4 s naming the collective and the timeout, and torchrun's SIGTERM ends rank 0 (its lock is
left behind); (d) ``--resume`` of (c) to the end, which must equal (a): history, best epoch, final metrics and
every tensor of ``best.pt``. A last, one-process case: a finished run resumed for more epochs and interrupted no
longer looks finished (before, its old ``metrics.json`` stayed beside a replaced ``best.pt``).

This file is also the launched program: run as a script it is ``bayeswrap``'s CLI, and ``BW_TEST_FAULT=R:K:how``
makes rank R, at its K-th gradient all-reduce, kill itself with SIGKILL (``how=kill``) or sleep (``how=hang``).
The fault lands at the same step every time, with the other rank inside or on its way into that collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

FAULT_ENV = "BW_TEST_FAULT"
REPO = Path(__file__).resolve().parents[1]


def _worker() -> int:
    """torchrun's program: bayeswrap's CLI, with the fault of ``BW_TEST_FAULT`` (if set) planted on its rank."""
    from bayeswrap.app import cli
    from bayeswrap.core import distributed

    fault = os.environ.get(FAULT_ENV, "")
    if fault:
        rank, step, how = fault.split(":")
        if os.environ.get("RANK") == rank:
            real, calls = distributed.all_reduce_gradients_, []

            def faulty(*args, **kwargs):
                calls.append(1)
                if len(calls) == int(step):
                    if how == "kill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    time.sleep(600)  # hung: torchrun's SIGTERM ends it once the other rank has failed
                return real(*args, **kwargs)

            distributed.all_reduce_gradients_ = faulty
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(_worker())

import pytest  # noqa: E402
import torch  # noqa: E402

from bayeswrap.app import cli, runner, runs  # noqa: E402
from bayeswrap.core import distributed  # noqa: E402
from bayeswrap.core.io import load_checkpoint  # noqa: E402

# digits with ood_classes auto and val_fraction 0.5: 504 training examples, so 8 steps of 64 per epoch
STEPS = 8
ARGS = ["fit", "--method", "sgld", "--epochs", "3", "--burn-in-epochs", "1", "--thinning", "2", "--batch-size",
        "64", "--num-samples", "3", "--device", "cpu", "--shift-rotations", "", "--shift-noise", "",
        "--progress", "false", "--run-name", "run"]
#: seconds a launch may take (about 10 s alone on 2 cores; a hang without a bounded collective timeout exceeds it)
LAUNCH_TIMEOUT_S = 180
#: what a run folder holds once an epoch is complete (tensorboard: if the package is installed)
AFTER_EPOCH = {".bayeswrap-run", "config.yaml", "data.json", "train.log", "best.pt", "last.pt", "history.csv"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """The process ids below ``pid`` (children, their children, ...), read from Linux's /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _torchrun(args: list[str], cwd: Path, fault: str = "", **env) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2`` of this file; torchrun and its ranks are killed after LAUNCH_TIMEOUT_S."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO),
           "BAYESWRAP_RENDEZVOUS_TIMEOUT": "60", FAULT_ENV: fault, **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "--monitor_interval=0.2", str(Path(__file__).resolve()), *args]
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(proc.pid), proc.pid]:  # the ranks run in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"torchrun {' '.join(args)} (fault {fault!r}) still ran after {LAUNCH_TIMEOUT_S} s: a rank "
                        f"hangs; its stderr ends with:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _plain(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in history]


def _check_stopped_at(run: Path, epoch: int) -> None:
    """The folder of a run stopped during epoch ``epoch + 1``: whole files of its last complete epoch, nothing
    that says it finished, nothing half-written."""
    names = {p.name for p in run.iterdir()}
    assert not {n for n in names if ".tmp" in n}, names  # no torn write left
    assert "metrics.json" not in names, names  # no "done" state
    assert AFTER_EPOCH <= names <= AFTER_EPOCH | {".lock", "tensorboard"}, names
    last = load_checkpoint(run / "last.pt")
    assert last["epoch"] == epoch and len(last["history"]) == epoch
    assert len((run / "history.csv").read_text().strip().splitlines()) == 1 + epoch  # a header, one row per epoch
    load_checkpoint(run / "best.pt")
    log = (run / "train.log").read_text()
    assert f"epoch {epoch + 1}:" not in log


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The torchrun results and folder listings of (a) to (d) (see the module docstring), in one temporary folder."""
    tmp = tmp_path_factory.mktemp("ddp_fault")
    out = {"tmp": tmp}
    out["a"] = _torchrun([*ARGS, "--out-dir", str(tmp / "a")], tmp)
    assert out["a"].returncode == 0, out["a"].stderr[-4000:]
    run = tmp / "b" / "run"
    out["b"] = _torchrun([*ARGS, "--out-dir", str(tmp / "b")], tmp, fault=f"1:{STEPS + 4}:kill")
    out["b_files"] = sorted(p.name for p in run.iterdir())
    _check_stopped_at(run, 1)
    out["c"] = _torchrun(["fit", "--resume", str(run)], tmp, fault=f"0:{STEPS + 4}:hang",  # epochs 2, 3 of 3
                         BAYESWRAP_COLLECTIVE_TIMEOUT="4")
    out["c_files"] = sorted(p.name for p in run.iterdir())
    _check_stopped_at(run, 2)
    out["d"] = _torchrun(["fit", "--resume", str(run)], tmp)
    return out


def _error(stderr: str, rank: int) -> str:
    assert f"bayeswrap (rank {rank}): error:" in stderr, stderr[-4000:]
    return stderr.split(f"bayeswrap (rank {rank}): error:")[1].splitlines()[0]


def test_a_rank_killed_mid_epoch_stops_both_and_keeps_the_last_complete_epoch(launches):
    b = launches["b"]
    assert b.returncode != 0
    assert "exitcode  : -9" in b.stderr  # torchrun: rank 1 died of SIGKILL
    # rank 0 said what happened, unless torchrun's SIGTERM stopped it first; either way the folder is whole
    if "bayeswrap (rank 0): error:" in b.stderr:
        message = _error(b.stderr, 0)
        assert "data-parallel: rank 0 of 2 lost the other processes during the all-reduce of the gradients" in message
        assert ("last.pt keeps its last complete epoch. Resume with: torchrun --nproc_per_node=2 -m bayeswrap fit "
                f"--resume {launches['tmp'] / 'b' / 'run'}") in message
        assert ".lock" not in launches["b_files"]  # released on the way out
    assert sorted(p.name for p in launches["tmp"].iterdir()) == ["a", "b"]  # nothing written outside the run folders


def test_a_hung_rank_ends_the_run_after_the_collective_timeout_naming_it(launches):
    c = launches["c"]
    assert c.returncode != 0
    message = _error(c.stderr, 1)
    assert "data-parallel: rank 1 of 2 lost the other processes during the all-reduce of the gradients" in message
    assert "the collective timeout is 4 s (BAYESWRAP_COLLECTIVE_TIMEOUT sets it)" in message
    assert "last.pt keeps its last complete epoch. Resume with: torchrun --nproc_per_node=2 -m bayeswrap fit" in message
    assert "exitcode  : -15" in c.stderr  # torchrun ended the hung rank 0
    assert ".lock" in launches["c_files"]  # rank 0 died holding it: a stale lock, which the resume takes over


def test_resume_under_torchrun_ends_where_the_uninterrupted_run_ends(launches):
    tmp, d = launches["tmp"], launches["d"]
    assert d.returncode == 0, d.stderr[-4000:]
    assert d.stdout.count("test error=") == 1  # rank 0 reports once
    run = tmp / "b" / "run"
    assert not (run / ".lock").exists()
    a = json.loads((tmp / "a" / "run" / "metrics.json").read_text())
    b = json.loads((run / "metrics.json").read_text())
    assert len(b["history"]) == 3 and _plain(b["history"]) == _plain(a["history"])
    assert b["best_epoch"] == a["best_epoch"]
    assert b["final"]["3"]["T1"] == a["final"]["3"]["T1"]
    best_a, best_b = load_checkpoint(tmp / "a" / "run" / "best.pt"), load_checkpoint(run / "best.pt")
    assert best_a.keys() == best_b.keys()
    for name, value in best_a.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(best_b[name], value, rtol=0, atol=0, msg=name)
    log = (run / "train.log").read_text()
    assert log.count("resumed from") == 2
    assert [log.count(f"epoch {e}:") for e in (1, 2, 3)] == [1, 1, 1]  # the lost tries of epochs 2 and 3 left none


def test_collective_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv(distributed.COLLECTIVE_TIMEOUT_ENV, raising=False)
    assert distributed.collective_timeout() == distributed.COLLECTIVE_TIMEOUT_S == 1800.0
    monkeypatch.setenv(distributed.COLLECTIVE_TIMEOUT_ENV, "2.5")
    assert distributed.collective_timeout() == 2.5
    for bad in ("0", "-3", "inf", "soon"):
        monkeypatch.setenv(distributed.COLLECTIVE_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=rf"BAYESWRAP_COLLECTIVE_TIMEOUT='{bad}' in the environment is not "
                                             rf"valid; accepted: a number of seconds > 0 \(default 1800\)"):
            distributed.collective_timeout()
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1", distributed.COLLECTIVE_TIMEOUT_ENV: "-1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="BAYESWRAP_COLLECTIVE_TIMEOUT='-1'"):  # before any waiting
        distributed.init_from_env("cpu")
    assert not distributed.is_initialized()


def test_a_finished_run_resumed_for_more_epochs_is_unfinished_until_it_ends(tmp_path, monkeypatch, capsys):
    args = ["fit", "--method", "laplace", "--epochs", "1", "--batch-size", "64", "--num-samples", "2",
            "--shift-rotations", "", "--shift-noise", "", "--progress", "false", "--out-dir", str(tmp_path),
            "--run-name", "run"]
    assert cli.main(args) == 0
    run = tmp_path / "run"
    assert (run / "metrics.json").is_file()
    real_save = runner.save_checkpoint

    def interrupting_save(path, obj):
        real_save(path, obj)
        if path.name == "last.pt":
            raise KeyboardInterrupt  # stopped right after epoch 2, best.pt already replaced by a raw epoch state

    monkeypatch.setattr(runner, "save_checkpoint", interrupting_save)
    assert cli.main(["fit", "--resume", str(run), "--epochs", "2"]) == 130
    assert not (run / "metrics.json").exists()  # before: the 1-epoch run's metrics.json beside epoch 2's best.pt
    with pytest.raises(runs.RunFolderError, match="has not finished"):
        runs.load_run(run)
    monkeypatch.setattr(runner, "save_checkpoint", real_save)
    assert cli.main(["fit", "--resume", str(run)]) == 0
    assert len(json.loads((run / "metrics.json").read_text())["history"]) == 2
    capsys.readouterr()
