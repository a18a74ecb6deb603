"""``bayeswrap fit`` / ``compare`` report a bad option before loading any data or weights.

The data loader and the backbone builder are replaced by functions that record the call and raise: a bad
option must end the command with exit status 2 and a message naming the option and the accepted values
while neither was called, and nothing may be written. These are the options that were checked only after
loading (found by running ``fit`` with one bad value per option): the model name, ``pretrained`` with the
MLP, ``init_checkpoint``, an unavailable ``device``, ``ood_classes`` outside the dataset's classes, and an
existing, foreign or busy run folder.
"""

from __future__ import annotations

import os
import re
import socket

import pytest
import torch

from bayeswrap.app import build, cli


class Loaded(RuntimeError):
    """What the patched loader and builder raise: the command went past validation."""


@pytest.fixture
def loads(monkeypatch):
    """The calls of the data loader and the backbone builder (each raises :class:`Loaded`)."""
    calls = []

    def record(what):
        def called(*args, **kwargs):
            calls.append(what)
            raise Loaded(f"{what} was called")
        return called

    monkeypatch.setattr(build, "load_data", record("load_data"))
    monkeypatch.setattr(build, "create_model", record("create_model"))
    return calls


def _run(argv, capsys) -> tuple[int, str]:
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


def _foreign_folder(out):
    (out / "taken").mkdir(parents=True)


def _busy_run_folder(out):
    run = out / "taken"
    run.mkdir(parents=True)
    (run / ".bayeswrap-run").write_text('{"kind": "run"}\n')
    (run / ".lock").write_text(f"{os.getpid()} {socket.gethostname()}\n")  # this live process holds it


def _image_folder(root):
    for split in ("train", "test"):
        for name in ("cat", "dog"):
            (root / "images" / split / name).mkdir(parents=True)


LATE = [
    pytest.param(["--model", "resnet1O1"], None, r"unknown timm model 'resnet1O1'\. Did you mean: resnet101.*Choices",
                 id="model-timm"),
    pytest.param(["--model", "tv:resnet1O1"], None, r"unknown torchvision model 'tv:resnet1O1'.*tv:resnet101",
                 id="model-torchvision"),
    pytest.param(["--pretrained"], None, r"'mlp' model has no pretrained weights; use pretrained=False or "
                 "init_checkpoint", id="pretrained-mlp"),
    pytest.param(["--init-checkpoint", "{tmp}/missing.safetensors"], None,
                 r"init_checkpoint='.*missing\.safetensors' does not exist; accepted: a local weights file",
                 id="init-checkpoint-missing"),
    pytest.param(["--init-checkpoint", "{tmp}"], None, r"init_checkpoint='.*' is a folder; accepted: a local weights",
                 id="init-checkpoint-folder"),
    pytest.param(["--device", "cuda:7"], None, r"device='cuda:7' is not available on this machine.*accepted here: cpu",
                 id="device-unavailable"),
    pytest.param(["--ood-classes", "12"], None, r"ood_classes='12': class 12 is not a class of digits \(10 classes\); "
                 r"accepted: comma-separated distinct class indices in \[0, 10\)", id="ood-classes-range"),
    pytest.param(["--ood-classes", "0,1,2,3,4,5,6,7,8,9"], None, r"ood_classes=.* holds out all 10 classes of "
                 r"digits.*accepted", id="ood-classes-all"),
    pytest.param(["--ood-classes", "3,3"], None, r"ood_classes='3,3' repeats a class; accepted", id="ood-repeated"),
    pytest.param(["--dataset", "imagefolder", "--data-root", "{tmp}/images", "--ood-classes", "2"], _image_folder,
                 r"class 2 is not a class of imagefolder \(2 classes\); accepted: .* in \[0, 2\)",
                 id="ood-classes-image-folder"),
    pytest.param(["--run-name", "taken"], _foreign_folder, r"run folder .*taken exists; pass --resume .*taken to "
                 "continue it or --overwrite to replace it", id="run-folder-exists"),
    pytest.param(["--run-name", "taken", "--overwrite"], _foreign_folder,
                 r"--overwrite: .*taken is not a bayeswrap run folder", id="overwrite-foreign-folder"),
    pytest.param(["--run-name", "taken", "--overwrite"], _busy_run_folder,
                 rf"run folder .*taken is in use by process {os.getpid()}", id="overwrite-busy-run"),
]


@pytest.mark.parametrize(("flags", "setup", "message"), LATE)
def test_fit_refuses_a_bad_option_before_loading_data_or_weights(flags, setup, message, loads, tmp_path, capsys):
    if "cuda:7" in flags and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    out = tmp_path / "out"
    if setup is not None:
        setup(out if "taken" in flags else tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    argv = ["fit", "--out-dir", str(out), "--epochs", "1"] + [f.format(tmp=tmp_path) for f in flags]
    rc, err = _run(argv, capsys)
    assert loads == [], f"loaded before refusing: {err}"
    assert rc == 2, err
    assert err.startswith("bayeswrap: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_compare_checks_every_method_before_loading(loads, tmp_path, capsys):
    rc, err = _run(["compare", "--out-dir", str(tmp_path / "out"), "--methods", "map,vi", "--no-tune",
                    "--ood-classes", "10"], capsys)
    assert (rc, loads) == (2, []) and re.search(r"class 10 is not a class of digits \(10 classes\)", err)
    assert not (tmp_path / "out").exists()


def test_valid_options_reach_the_loader(loads, tmp_path, capsys):
    """The control: with good options (a run folder that may be replaced) the patched loader is what stops fit."""
    out = tmp_path / "out"
    (out / "taken").mkdir(parents=True)
    (out / "taken" / ".bayeswrap-run").write_text('{"kind": "run"}\n')
    rc, err = _run(["fit", "--out-dir", str(out), "--run-name", "taken", "--overwrite", "--ood-classes", "9",
                    "--device", "cpu"], capsys)
    assert loads == ["load_data"] and rc == 1 and "load_data was called" in err
