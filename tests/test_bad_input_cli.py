"""Bad input on the command line, in config files and in checkpoints: a clear error that names the value.

Every case exits with status 2, prints one ``bayeswrap: error:`` line (no
traceback) that names the bad value, and leaves no run folder behind.
"""

import re

import numpy as np
import pytest
import torch
from conftest import damage_file

import bayeswrap.app.cli as cli

FAST = ["--epochs", "1", "--batch-size", "64", "--shift-rotations", "0", "--shift-noise", "0",
        "--progress", "false"]

FLAG_CASES = [
    (["--epochs", "nan"], r"epochs='nan' is not an integer; accepted: an integer >= 1"),
    (["--epochs", "inf"], r"epochs='inf' is not an integer"),
    (["--epochs", "abc"], r"epochs='abc' is not an integer"),
    (["--epochs", "2.5"], r"epochs='2.5' is not an integer"),
    (["--epochs", "0"], r"epochs='0' is out of range; accepted: an integer >= 1"),
    (["--batch-size", "0"], r"batch_size='0' is out of range; accepted: an integer >= 1"),
    (["--batch-size", "-3"], r"batch_size='-3' is out of range"),
    (["--seed", "1e30"], r"seed='1e30' is out of range; accepted: an integer in \[0, 2\^32 - 1\]"),
    (["--seed", "-1"], r"seed='-1' is out of range; accepted: an integer in \[0, 2\^32 - 1\]"),
    (["--seed", "abc"], r"seed='abc' is not an integer"),
    (["--num-samples", "-1"], r"num_samples='-1' is out of range; accepted: an integer >= 0"),
    (["--num-samples", "2.7"], r"num_samples='2.7' is not an integer"),
    (["--num-train-samples", "2.7"], r"num_train_samples=2.7 is not an integer"),
    (["--num-train-samples", "0"], r"num_train_samples=0 must be an integer >= 1"),
    (["--method", "sgld", "--thinning", "0"], r"thinning=0 must be an integer >= 1"),
    (["--thinning", "2"], r"thinning is not an option of method 'vi' \(it is an option of sgld, mh, hmc\)"),
    (["--method", "sgld", "--max-samples", "-1"], r"max_samples=-1 must be an integer >= 0"),
    (["--method", "sgld", "--cycles", "-1"], r"cycles=-1 must be None or an integer >= 1"),
    (["--n-bins", "0"], r"n_bins='0' is out of range"),
    (["--num-workers", "-1"], r"num_workers='-1' is out of range"),
    (["--img-size", "-1"], r"img_size='-1' is out of range"),
    (["--warmup-epochs", "1"], r"warmup_epochs=1 is out of range; accepted: an integer in \[0, epochs=1\)"),
    (["--warmup-epochs", "-1"], r"warmup_epochs='-1' is out of range"),
    (["--lr", "0"], r"lr=0.0 is out of range; accepted: a finite number > 0"),
    (["--lr", "-1"], r"lr=-1.0 is out of range"),
    (["--lr", "nan"], r"lr=nan is out of range"),
    (["--lr", "inf"], r"lr=inf is out of range"),
    (["--lr", "abc"], r"lr='abc' is not a number; accepted: a finite number > 0"),
    (["--lr-head", "-1"], r"lr_head=-1.0 is out of range; accepted: a finite number >= 0"),
    (["--momentum", "1"], r"momentum=1.0 is out of range; accepted: a number in \[0, 1\)"),
    (["--momentum", "-0.1"], r"momentum=-0.1 is out of range"),
    (["--weight-decay", "-1"], r"weight_decay=-1.0 is out of range"),
    (["--grad-clip-norm", "-1"], r"grad_clip_norm=-1.0 is out of range; accepted: a finite number >= 0"),
    (["--grad-clip-norm", "nan"], r"grad_clip_norm=nan is out of range"),
    (["--val-fraction", "1"], r"val_fraction=1.0 is out of range; accepted: a number in \[0, 1\)"),
    (["--val-fraction", "-0.1"], r"val_fraction=-0.1 is out of range"),
    (["--prior-std", "0"], r"prior_std=0.0 is out of range"),
    (["--prior-std", "1e-300"], r"prior_std=1e-300 is out of range; accepted: a number in \[1e-18, 1e\+18\]"),
    (["--prior-std", "inf"], r"prior_std=inf is out of range"),
    (["--kl-weight", "-1"], r"kl_weight=-1.0 is out of range"),
    (["--num-data-inflate", "0"], r"num_data_inflate=0.0 is out of range"),
    (["--init-std", "1e-300"], r"init_std=1e-300 must be a number in \[1e-18, 1e\+18\]"),
    (["--method", "mc_dropout", "--p-drop", "1"], r"p_drop=1.0 must be a number in \[0, 1\)"),
    (["--noise-scale", "-1"], r"noise_scale=-1.0 is out of range"),
    (["--method", "sgld", "--exploration", "1"], r"exploration=1.0 must be a number in \[0, 1\)"),
    (["--optimizer", "adam"], r"optimizer='adam' is not known; accepted: sgd, adamw"),
    (["--scheduler", "step"], r"scheduler='step' is not known; accepted: constant, cosine"),
    (["--method", "sgld", "--predictive", "mean"], r"predictive='mean' is not accepted; accepted: \('ensemble', 'gaussian'\)"),
    (["--method", "laplace", "--pred-type", "linear"], r"pred_type='linear' is not known; accepted: \('glm', 'nn'\)"),
    (["--method", "laplace", "--curvature", "kfac"], r"curvature='kfac' is not known; accepted: \('ggn', 'fisher', 'empirical_fisher'\)"),
    (["--method", "sgld", "--sample-dtype", "int8"], r"sample_dtype='int8' is not accepted; accepted: None, \('float32'"),
    (["--prior-mean", "pretrained"], r"prior_mean='pretrained' is not known; accepted: auto, init, zero"),
    (["--dataset", "mnist"], r"dataset='mnist' is not known; accepted: digits, mnist5k, pets"),
    (["--method", "nuts"], r"method='nuts' is not known; accepted: map, vi"),
    (["--device", "tpu"], r"device='tpu' is not valid; accepted: auto, cpu, cuda, cuda:N"),
    (["--pretrained", "maybe"], r"pretrained='maybe' is not a boolean; accepted: true, false"),
    (["--overwrite", "2"], r"overwrite='2' is not a boolean"),
    (["--burn-in-epochs", "-1"], r"burn_in_epochs='-1' is not valid; accepted: auto or a number >= 0"),
    (["--shift-rotations", "0,abc"], r"shift_rotations='0,abc': 'abc' is not valid"),
    (["--ood-classes", "8,x"], r"ood_classes='8,x': 'x' is not valid"),
    (["--per-method", "{vi: {p_drop: 0.3}}"], r"per_method.vi sets p_drop, which method 'vi' does not use; p_drop is an option of mc_dropout"),
    (["--per-method", "{nuts: {lr: 1}}"], r"per_method: 'nuts' is not a method with an option mapping"),
    (["--per-method", "[1, 2]"], r"per_method=\[1, 2\] must be a mapping"),
    (["--per-method", "{vi: {lr: abc}}"], r"lr='abc' is not a number"),
    (["--method", "sgld", "--cycles", "2", "--scheduler", "cosine"],
     r"scheduler='cosine', warmup_epochs=0: cyclical SGLD \(cycles=2\) sets its own step size"),
    (["--bias", "gaussian"], r"bias='gaussian' is not accepted by method 'vi'"),
    (["--model", "resnet_nope"], r"resnet_nope"),
    (["--params", "nothing.*"], r"params pattern 'nothing.\*' matches no trainable parameter"),
]


@pytest.mark.parametrize("args, message", FLAG_CASES, ids=[" ".join(a) for a, _ in FLAG_CASES])
def test_bad_flag(tmp_path, capsys, args, message):
    out = tmp_path / "runs"
    assert cli.main(["fit", "--out-dir", str(out), *FAST, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bayeswrap: error: ") and "Traceback" not in err, err
    assert re.search(message, err), err
    assert not out.exists() or not any(out.iterdir())


YAML_CASES = [
    (b"lr: 0.1\nepochs: 2\nlr: 0.2\n", r"config file '.*c.yaml' is not valid YAML at line 3, column 1: "
                                      r"duplicate key 'lr' \(first at line 1\)"),
    (b"lr: 0.1\nepochs: [2\n", r"config file '.*c.yaml' is not valid YAML at line 3"),
    (b"lr: 0.1\nmodel: r\xe9snet\n", r"config file '.*c.yaml' is not UTF-8 text \(byte 16: b'\\xe9'\)"),
    (b"epochs: true\n", r"config file '.*c.yaml': epochs=True is not an integer; accepted: an integer >= 1"),
    (b"epochs: ~\n", r"epochs=None \(an empty value\) is not valid; give a int or leave the option out to use its "
                     r"default 40"),
    (b"epochs:\n", r"epochs=None \(an empty value\) is not valid"),
    (b"- lr: 0.1\n", r"config file '.*c.yaml' must hold a mapping of option: value, not a list"),
    (b"epoch: 3\n", r"unknown option 'epoch'; accepted: dataset"),
    (b"resume: true\n", r"resume is not a config option; resume a run with: bayeswrap fit --resume RUN_DIR"),
    (b"lr: [1, 2]\n", r"lr=\[1, 2\] is not a number"),
    (b"method: 3\n", r"method='3' is not known"),
    (b"prior_std: .nan\n", r"prior_std=nan is out of range"),
    (b"run_name: ../../etc\n", r"run_name='../../etc' is not valid"),
    (b"overwrite: yes please\n", r"overwrite='yes please' is not a boolean"),
    (b"per_method: {vi: {epochs: 0.5}}\n", r"epochs=0.5 is not an integer"),
]


@pytest.mark.parametrize("content, message", YAML_CASES, ids=[c[:20].decode("latin-1") for c, _ in YAML_CASES])
def test_bad_config_file(tmp_path, capsys, content, message):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    out = tmp_path / "runs"
    assert cli.main(["fit", "-c", str(path), "--out-dir", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
    assert not out.exists()


def test_config_path_is_a_folder_or_missing(tmp_path, capsys):
    assert cli.main(["fit", "-c", str(tmp_path), *FAST]) == 2
    assert f"config file '{tmp_path}' is a folder; accepted: a YAML file" in capsys.readouterr().err
    assert cli.main(["fit", "-c", str(tmp_path / "none.yaml"), *FAST]) == 2
    assert "none.yaml" in capsys.readouterr().err


def test_out_dir_is_a_file(tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("x")
    assert cli.main(["fit", "--out-dir", str(target), *FAST]) == 2
    assert f"out_dir={str(target)!r} is a file; accepted: a folder" in capsys.readouterr().err
    assert target.read_text() == "x"


@pytest.mark.parametrize("kind", ["empty", "truncated", "random", "pickled_object", "not_a_state_dict"])
def test_bad_init_checkpoint_names_the_file(tmp_path, capsys, kind):
    from bayeswrap.app.backbones import create_model

    path = tmp_path / "w.pt"
    torch.save(create_model("mlp", 8, in_features=64).state_dict(), path)
    if damage_file(path, kind):
        pass
    elif kind == "pickled_object":
        torch.save({"w": torch.zeros(1), "fn": print}, path)
    else:
        torch.save([1, 2, 3], path)
    assert cli.main(["fit", "--init-checkpoint", str(path), "--out-dir", str(tmp_path / "r"), *FAST]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "Traceback" not in err, err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One finished MAP run, shared by the refusals below (none of them writes to it)."""
    out = tmp_path_factory.mktemp("bad_subcommand")
    assert cli.main(["fit", "--method", "map", "--out-dir", str(out), "--run-name", "run", *FAST]) == 0
    return out / "run"


@pytest.mark.parametrize("args, message", [
    (["evaluate", "RUN", "--num-samples", "abc"], r"--num-samples 'abc' is not valid; accepted: an integer in \[0, 100000\]"),
    (["evaluate", "RUN", "--num-samples", "-1"], r"--num-samples '-1' is not valid"),
    (["evaluate", "NOT_A_RUN"], r"is not a finished run folder"),
    (["predict", "RUN", "X", "--batch-size", "0"], r"--batch-size '0' is not valid; accepted: an integer >= 1"),
    (["predict", "RUN", "X", "--seed", "-1"], r"--seed '-1' is not valid"),
    (["predict", "RUN", "X", "--num-samples", "1.5"], r"--num-samples '1.5' is not valid"),
    (["predict", "RUN", "X", "--out", "OUTDIR"], r"--out .* is a folder; accepted: a path for a new or regular CSV file"),
    (["fit", "--resume", "NOT_A_RUN"], r"--resume .*: no config.yaml there"),
    (["compare", "--resume", "NOT_A_RUN"], r"--resume .*: no compare.yaml there"),
    (["compare", "--methods", "map,nuts", "--out-dir", "OUTDIR"], r"--methods nuts not known; accepted: map"),
    (["compare", "--num-samples", "0,x", "--out-dir", "OUTDIR"], r"--num-samples '0,x' must be comma-separated"),
])
def test_bad_subcommand_arguments(tmp_path, capsys, finished_run, args, message):
    run = finished_run
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "outdir").mkdir()
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((2, 64), dtype=np.float32))
    mapping = {"RUN": str(run), "NOT_A_RUN": str(tmp_path / "not_a_run"), "X": str(x), "OUTDIR": str(tmp_path / "outdir")}
    argv = [mapping.get(a, a) for a in args]
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir())
    assert cli.main(argv) == 2
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run.iterdir()) == before  # refused, nothing written
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err, err
