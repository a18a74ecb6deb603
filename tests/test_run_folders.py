"""Run folders, locks, resume, predict from a saved run, and the training options of the command line."""

import csv
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import damage_file

import bayeswrap as bw
import bayeswrap.app.cli as cli
from bayeswrap.app import compare, runner, runs
from bayeswrap.app.build import lr_factor, make_optimizer
from bayeswrap.app.config import resolve
from bayeswrap.core.io import CheckpointError, load_checkpoint, save_checkpoint

FAST = ["--batch-size", "64", "--shift-rotations", "0", "--shift-noise", "0", "--progress", "false"]


def _fit(tmp_path, *args, method="map", epochs=2):
    return cli.main(["fit", "--method", method, "--epochs", str(epochs), "--out-dir", str(tmp_path), *FAST, *args])


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------- run names and --overwrite


@pytest.mark.parametrize("name", ["/abs/dir", "../x", "a/b", ".", "..", ".hidden", " padded", "a\\b"])
def test_run_name_must_be_one_folder_name(tmp_path, capsys, name):
    assert _fit(tmp_path / "out", "--run-name", name) == 2
    assert f"run_name={name!r} is not valid; accepted: one folder name inside out_dir" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


def test_overwrite_with_absolute_run_name_and_bad_option_deletes_nothing(tmp_path, capsys):
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "thesis.tex").write_text("do not delete")
    code = cli.main(["fit", "--run-name", str(victim), "--overwrite", "--noise-scale", "-1", "--method", "sgld",
                     "--out-dir", str(tmp_path / "runs"), *FAST])
    assert code == 2
    assert (victim / "thesis.tex").read_text() == "do not delete"
    assert not (tmp_path / "runs").exists()  # validated before anything touched the filesystem


def test_overwrite_refuses_a_folder_bayeswrap_did_not_make(tmp_path, capsys):
    folder = tmp_path / "digits-mlp-map"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert _fit(tmp_path, "--overwrite") == 2
    assert "is not a bayeswrap run folder" in capsys.readouterr().err
    assert (folder / "notes.txt").read_text() == "mine"


def test_overwrite_refuses_a_folder_a_live_run_holds_and_takes_over_a_stale_lock(tmp_path, capsys):
    assert _fit(tmp_path) == 0
    run_dir = tmp_path / "digits-mlp-map"
    before = _snapshot(run_dir)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run_dir / runs.LOCK).write_text(f"{live.pid} {os.uname().nodename}\n")
        assert _fit(tmp_path, "--overwrite") == 2
        assert f"is in use by process {live.pid}" in capsys.readouterr().err
        assert _snapshot(run_dir) == {**before, __import__("pathlib").Path(runs.LOCK): f"{live.pid} {os.uname().nodename}\n".encode()}
    finally:
        live.kill()
        live.wait()
    # the process is gone: its lock is stale, and orphan temporary files go with it
    (run_dir / ".last.pt.abc123.tmp").write_bytes(b"half a checkpoint")
    assert _fit(tmp_path, "--overwrite") == 0
    assert not (run_dir / runs.LOCK).exists() and not (run_dir / ".last.pt.abc123.tmp").exists()
    assert (run_dir / "metrics.json").is_file()


def test_lock_is_exclusive_and_released():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with runs.RunLock(d) as lock:
            assert lock.owner() == (os.getpid(), os.uname().nodename)
            with pytest.raises(runs.RunFolderError, match=f"in use by process {os.getpid()}"):
                runs.RunLock(d).acquire()
        assert runs.RunLock(d).owner() is None
        assert not os.path.exists(os.path.join(d, runs.LOCK))


# --------------------------------------------------------------------------- resume


def test_resume_refuses_changes_to_data_split_model_or_method_and_rewrites_nothing(tmp_path, capsys):
    assert _fit(tmp_path, epochs=2) == 0
    run_dir = tmp_path / "digits-mlp-map"
    before = _snapshot(run_dir)
    for flag, value in [("--seed", "1"), ("--method", "vi"), ("--model", "resnet18"), ("--val-fraction", "0.3"),
                        ("--batch-size", "32"), ("--prior-std", "3"), ("--dataset", "mnist5k"), ("--ood-classes", "")]:
        assert cli.main(["fit", "--resume", str(run_dir), flag, value]) == 2
        err = capsys.readouterr().err
        assert f"{flag[2:].replace('-', '_')}=" in err and "Accepted changes: epochs, lr" in err, err
    assert cli.main(["fit", "--resume", str(run_dir), "-c", "configs/digits.yaml"]) == 2
    assert cli.main(["fit", "--resume", str(run_dir), "--epochs", "1"]) == 2  # below what it has trained
    assert "epochs=1 is below the 2 epochs" in capsys.readouterr().err
    assert _snapshot(run_dir) == before


def test_resume_applies_lr_and_epochs_to_the_restored_optimizer_and_records_them(tmp_path):
    assert _fit(tmp_path, epochs=2) == 0
    run_dir = tmp_path / "digits-mlp-map"
    assert cli.main(["fit", "--resume", str(run_dir), "--lr", "0.01", "--epochs", "4"]) == 0
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [h["lr"] for h in metrics["history"]] == [0.05, 0.05, 0.01, 0.01]
    assert metrics["resumes"] == [{"epoch": 2, "changes": {"lr": [0.05, 0.01], "epochs": [2, 4]}}]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["lr"] == 0.01 and saved["epochs"] == 4
    last = load_checkpoint(run_dir / "last.pt")
    assert {g["lr"] for g in last["optimizer"]["param_groups"]} == {0.01}
    rows = list(csv.DictReader(open(run_dir / "history.csv")))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    assert float(rows[2]["lr"]) == 0.01


def test_resume_of_a_run_killed_before_its_first_checkpoint_restarts_cleanly(tmp_path, monkeypatch):
    assert _fit(tmp_path / "ref", epochs=2) == 0
    reference = json.loads((tmp_path / "ref" / "digits-mlp-map" / "metrics.json").read_text())

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "fit", killed)  # Ctrl-C during the first epoch
    assert _fit(tmp_path / "b", epochs=2) == 130
    run_dir = tmp_path / "b" / "digits-mlp-map"
    assert not (run_dir / "last.pt").exists() and (run_dir / "config.yaml").exists()
    (run_dir / ".config.yaml.x1.tmp").write_text("orphan")
    monkeypatch.undo()
    assert cli.main(["fit", "--resume", str(run_dir)]) == 0
    resumed = json.loads((run_dir / "metrics.json").read_text())
    assert resumed["final"] == reference["final"]
    assert not (run_dir / ".config.yaml.x1.tmp").exists()


@pytest.mark.parametrize("damage", ["empty", "truncated", "random", "missing_keys", "wrong_types", "not_a_run"])
def test_damaged_last_checkpoint_names_the_file_and_rewrites_nothing(tmp_path, capsys, damage):
    assert _fit(tmp_path, epochs=1) == 0
    run_dir = tmp_path / "digits-mlp-map"
    last = run_dir / "last.pt"
    good = load_checkpoint(last)
    if damage_file(last, damage):
        pass
    elif damage == "missing_keys":
        torch.save({k: v for k, v in good.items() if k != "optimizer"}, last)
    elif damage == "wrong_types":
        torch.save({**good, "epoch": "three"}, last)
    else:
        torch.save({**good, "model": {"w": torch.zeros(3)}}, last)
    before = _snapshot(run_dir)
    assert cli.main(["fit", "--resume", str(run_dir), "--epochs", "2"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {last}" in err and "Traceback" not in err
    assert _snapshot(run_dir) == before


def test_compare_resume_after_ctrl_c_keeps_finished_methods(tmp_path, monkeypatch, capsys):
    args = ["compare", "--methods", "map,vi", "--num-samples", "0,2", "--no-tune", "--epochs", "2",
            "--out-dir", str(tmp_path), *FAST]
    real_fit, calls = compare.run_fit, []

    def interrupted_second(*a, **k):
        calls.append(a[0].method)
        if len(calls) == 2:
            raise cli.RunInterrupted(tmp_path / "compare-digits-mlp", "bayeswrap compare --resume X")
        return real_fit(*a, **k)

    monkeypatch.setattr(compare, "run_fit", interrupted_second)
    assert cli.main(args) == 130
    monkeypatch.undo()
    base = tmp_path / "compare-digits-mlp"
    assert "Resume with: bayeswrap compare --resume" in capsys.readouterr().err
    map_metrics = (base / "map" / "metrics.json").read_bytes()
    assert cli.main(args) == 2  # a plain re-run refuses the existing folder and says how to resume
    assert f"pass --resume {base}" in capsys.readouterr().err
    assert cli.main(["compare", "--resume", str(base), "--seed", "3"]) == 2
    assert "seed=3 differs" in capsys.readouterr().err
    assert cli.main(["compare", "--resume", str(base)]) == 0
    assert (base / "map" / "metrics.json").read_bytes() == map_metrics  # kept, not retrained
    rows = list(csv.DictReader(open(base / "comparison.csv")))
    assert [(r["method"], r["num_samples"]) for r in rows] == [("map", "0"), ("map", "2"), ("vi", "0"), ("vi", "2")]


# --------------------------------------------------------------------------- predict and load_run


@pytest.fixture(scope="module")
def vi_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("predict")
    assert cli.main(["fit", "--method", "vi", "--epochs", "3", "--num-samples", "4", "--out-dir", str(out),
                     *FAST]) == 0
    return out / "digits-mlp-vi"


def test_load_run_rebuilds_the_trained_model_without_the_training_data(vi_run, monkeypatch):
    import bayeswrap.app.build as experiment

    monkeypatch.setattr(experiment, "load_data", lambda *a, **k: pytest.fail("load_run read the dataset"))
    run = bw.load_run(vi_run)
    assert run.class_names == [str(i) for i in range(8)] and run.input_shape == (64,)
    monkeypatch.undo()
    splits, _ = experiment.load_splits(run.config)
    x = torch.stack([splits.test[i][0] for i in range(len(splits.test))])
    y = torch.tensor(splits.test.targets)
    probs = run.sample_probs(x, 0)
    error = (probs.mean(0).argmax(1) != y).double().mean().item()
    assert error == pytest.approx(cli.evaluate_run(vi_run, 0)["T1"]["error"], abs=1e-12)
    again = run.sample_probs(x, 4, seed=1)
    assert again.shape == (4, len(x), 8) and torch.equal(again, run.sample_probs(x, 4, seed=1))
    with pytest.raises(ValueError, match=r"inputs of shape \(3, 63\) do not fit this run; accepted: \(N, 64\)"):
        run.sample_probs(torch.zeros(3, 63))
    with pytest.raises(ValueError, match="NaN or infinite"):
        run.sample_probs(torch.full((2, 64), float("nan")))


def test_predict_writes_class_probabilities_and_uncertainty(vi_run, tmp_path):
    from bayeswrap.app.build import load_splits
    from bayeswrap.evaluation.uncertainty import mutual_information, predictive_entropy

    run = bw.load_run(vi_run)
    splits, _ = load_splits(run.config)
    x = torch.stack([splits.test[i][0] for i in range(20)])
    np.save(tmp_path / "x.npy", x.numpy())
    out = tmp_path / "preds.csv"
    assert cli.main(["predict", str(vi_run), str(tmp_path / "x.npy"), "--num-samples", "6", "--seed", "2",
                     "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 20 and rows[0]["input"] == "x.npy[0]"
    reference = run.sample_probs(x, 6, seed=2)
    mean = reference.mean(0)
    for i, row in enumerate(rows):
        probs = [float(row[f"prob_{c}"]) for c in run.class_names]
        assert probs == pytest.approx(mean[i].tolist(), abs=1e-6) and sum(probs) == pytest.approx(1, abs=1e-5)
        assert int(row["predicted_class"]) == int(mean[i].argmax()) and row["predicted_label"] == row["predicted_class"]
        assert float(row["entropy"]) == pytest.approx(predictive_entropy(reference)[i].item(), abs=1e-6)
        assert float(row["mutual_information"]) == pytest.approx(mutual_information(reference)[i].item(), abs=1e-6)
    # an existing --out is not replaced without --overwrite
    assert cli.main(["predict", str(vi_run), str(tmp_path / "x.npy"), "--out", str(out)]) == 2


def test_predict_of_a_laplace_run_writes_the_probit_predictive_its_metrics_scored(tmp_path):
    """Laplace's CSV holds its probit GLM predictive (``metrics.json``'s), not the mean of its linearised samples."""
    from bayeswrap.app.build import load_splits
    from bayeswrap.evaluation.uncertainty import mutual_information, predictive_entropy

    assert _fit(tmp_path, "--num-samples", "5", method="laplace") == 0
    run_dir = tmp_path / "digits-mlp-laplace"
    run = bw.load_run(run_dir)
    splits, _ = load_splits(run.config)
    x = torch.stack([splits.test[i][0] for i in range(30)])
    np.save(tmp_path / "x.npy", x.numpy())
    out = tmp_path / "preds.csv"
    assert cli.main(["predict", str(run_dir), str(tmp_path / "x.npy"), "--seed", "3", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    with torch.no_grad():
        probit = run.model.predict(x, 5).double()  # the default predictive: GLM(link="probit"), closed form
    samples = run.sample_probs(x, 5, seed=3)
    assert not torch.allclose(samples.double().mean(0), probit, atol=1e-3)  # the two predictives differ here
    for i, row in enumerate(rows):
        assert [float(row[f"prob_{c}"]) for c in run.class_names] == pytest.approx(probit[i].tolist(), abs=1e-6)
        assert float(row["entropy"]) == pytest.approx(predictive_entropy(probit[None])[i].item(), abs=1e-6)
        assert float(row["mutual_information"]) == pytest.approx(mutual_information(samples)[i].item(), abs=1e-6)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["final"]["5"]["predictive"] == "GLM(link='probit')"


def test_predict_reads_an_image_folder_and_a_single_image(vi_run, tmp_path):
    from PIL import Image

    from bayeswrap.app.build import load_splits

    run = bw.load_run(vi_run)
    splits, _ = load_splits(run.config)
    x = torch.stack([splits.test[i][0] for i in range(6)])
    folder = tmp_path / "imgs" / "sub"
    folder.mkdir(parents=True)
    for i in range(6):  # 8x8 grey PNGs of the digits (ink bright, as in the data)
        Image.fromarray((x[i].reshape(8, 8).numpy() * 255).round().astype(np.uint8), mode="L").save(folder / f"{i}.png")
    (folder / "readme.txt").write_text("not an image")
    assert cli.main(["predict", str(vi_run), str(tmp_path / "imgs"), "--num-samples", "0",
                     "--out", str(tmp_path / "f.csv")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "f.csv")))
    assert [os.path.basename(r["input"]) for r in rows] == [f"{i}.png" for i in range(6)]
    exact = run.sample_probs(x, 0).mean(0)
    for i, row in enumerate(rows):  # the PNG holds the pixels to 1/255
        assert [float(row[f"prob_{c}"]) for c in run.class_names] == pytest.approx(exact[i].tolist(), abs=0.02)
    assert cli.main(["predict", str(vi_run), str(folder / "3.png"), "--out", str(tmp_path / "one.csv")]) == 0
    assert len(list(csv.DictReader(open(tmp_path / "one.csv")))) == 1


@pytest.mark.parametrize("inputs, message", [
    ("missing.npy", "do not exist"),
    ("bad_shape.npy", r"have shape \(3, 5\); accepted: \(N, 64\)"),
    ("nan.npy", "NaN or infinite"),
    ("strings.npy", "accepted: a numeric array"),
    ("empty_dir", "holds no image file"),
    ("notes.txt", r"are not an image file, a folder or a \.npy array"),
    ("broken.png", "cannot be read"),
])
def test_predict_bad_inputs(vi_run, tmp_path, capsys, inputs, message):
    np.save(tmp_path / "bad_shape.npy", np.zeros((3, 5)))
    np.save(tmp_path / "nan.npy", np.full((2, 64), np.nan))
    np.save(tmp_path / "strings.npy", np.array(["a", "b"]))
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not really")
    assert cli.main(["predict", str(vi_run), str(tmp_path / inputs), "--out", str(tmp_path / "o.csv")]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "o.csv").exists()


def test_predict_refuses_a_folder_that_is_not_a_finished_run(tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.zeros((1, 64)))
    assert cli.main(["predict", str(tmp_path), str(tmp_path / "x.npy"), "--out", str(tmp_path / "o.csv")]) == 2
    assert "is not a finished run folder: it has no config.yaml" in capsys.readouterr().err


# --------------------------------------------------------------------------- training options


def test_cosine_schedule_with_warmup_and_resume_match_an_uninterrupted_run(tmp_path, monkeypatch):
    args = ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01", "--scheduler", "cosine",
            "--warmup-epochs", "1", "--grad-clip-norm", "5"]
    assert _fit(tmp_path / "a", *args, epochs=4) == 0
    reference = json.loads((tmp_path / "a" / "digits-mlp-map" / "metrics.json").read_text())
    cfg = resolve(None, {"epochs": 4, "warmup_epochs": 1, "scheduler": "cosine"})
    assert [h["lr"] for h in reference["history"]] == pytest.approx(
        [0.01 * lr_factor(cfg, e) for e in range(4)], rel=1e-12)
    assert [lr_factor(cfg, e) for e in range(4)] == pytest.approx([0.5, 1.0, 0.75, 0.25])

    real_save, saves = runner.save_checkpoint, []

    def interrupting_save(path, obj):
        real_save(path, obj)
        saves.append(path.name)
        if saves.count("last.pt") == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "save_checkpoint", interrupting_save)
    assert _fit(tmp_path / "b", *args, epochs=4) == 130
    monkeypatch.undo()
    assert cli.main(["fit", "--resume", str(tmp_path / "b" / "digits-mlp-map")]) == 0
    resumed = json.loads((tmp_path / "b" / "digits-mlp-map" / "metrics.json").read_text())
    assert resumed["final"] == reference["final"]
    for a, b in zip(resumed["history"], reference["history"]):
        assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}


def test_adamw_decays_only_point_estimates():
    cfg = resolve(None, {"method": "vi", "optimizer": "adamw", "weight_decay": 0.05, "params": "fc0.*"})
    from bayeswrap.app.backbones import create_model

    bnn = bw.wrap(create_model("mlp", 3, in_features=4), "vi", num_data=10, params=["fc0.*"])
    opt = make_optimizer(cfg, bnn, head=[])
    assert isinstance(opt, torch.optim.AdamW)
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"posterior": 0.0, "point": 0.05}


def test_history_csv_tensorboard_and_no_progress_bar_off_a_terminal(tmp_path, capsys):
    assert _fit(tmp_path, "--progress", "true", epochs=2) == 0
    err = capsys.readouterr().err
    assert "epoch 1/2" not in err and "it/s" not in err  # stderr is not a terminal here
    run_dir = tmp_path / "digits-mlp-map"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rows = list(csv.DictReader(open(run_dir / "history.csv")))
    assert [float(r["val_nll"]) for r in rows] == [h["val_nll"] for h in metrics["history"]]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("val_nll")] == pytest.approx([h["val_nll"] for h in metrics["history"]])


def test_help_has_no_internal_reprs(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--help"])
    text = capsys.readouterr().out
    assert not any(bad in text for bad in ("_MISSING", "<class", "object at 0x", "<function", "<factory>"))
    assert "--per-method YAML" in text and "--resume RUN_DIR" in text and "--optimizer" in text


def test_offline_pretrained_fails_fast_with_advice(monkeypatch):
    import socket

    from bayeswrap.app import backbones as models

    def unreachable(*args, **kwargs):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    assert models.hub_offline()
    with pytest.raises(models.PretrainedWeightsError, match=r"Hub is unreachable .* --init-checkpoint"):
        models.create_model("resnet18", 3, pretrained=True)


def test_disk_full_names_the_file_and_leaves_no_partial_file(tmp_path, monkeypatch):
    def full(obj, path):
        with open(path, "wb") as fh:
            fh.write(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=rf"writing {tmp_path / 'last.pt'} failed: no space left on the device"):
        save_checkpoint(tmp_path / "last.pt", {"x": torch.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def test_load_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "best.pt"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is empty"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"epoch": 1.5}, path)
    with pytest.raises(CheckpointError, match=r"wrong type: epoch \(float, expected int\)"):
        load_checkpoint(path, required={"epoch": int})
    assert math.isfinite(load_checkpoint(path)["epoch"])


def test_init_checkpoint_with_another_head_warns(tmp_path):
    from bayeswrap.app.backbones import create_model

    path = tmp_path / "imagenet_like.pt"
    torch.save(create_model("mlp", 10, in_features=64).state_dict(), path)
    with pytest.warns(UserWarning, match=r"has no 3-class head .* classifier head starts freshly initialised"):
        model = create_model("mlp", 3, in_features=64, init_checkpoint=path)
    body = torch.load(path, weights_only=True)
    assert torch.equal(model.state_dict()["fc0.weight"], body["fc0.weight"])
