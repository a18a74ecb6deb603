"""The command line end to end: compare/evaluate on digits, fit on fake Pets/Flowers/image folders."""

import csv
import json

import pytest
import torch

import bayeswrap.app.cli as cli
from bayeswrap.app.backbones import create_model
from bayeswrap.core.io import load_checkpoint
from bayeswrap.methods import TUNING

FAST = ["--progress", "false", "--batch-size", "64"]


def test_compare_writes_table_and_evaluate_recomputes_it(tmp_path):
    out = tmp_path / "runs"
    assert cli.main(["compare", "--epochs", "2", "--out-dir", str(out), "--num-samples", "0,3", "--shift-rotations",
                     "0,45", "--shift-noise", "0,0.5", "--no-tune", *FAST]) == 0
    base = out / "compare-digits-mlp"
    rows = list(csv.DictReader(open(base / "comparison.csv")))
    assert [(r["method"], r["num_samples"]) for r in rows] == [
        (m, s) for m in ("map", "vi", "ivon", "mc_dropout", "sgld", "laplace") for s in ("0", "3")]
    assert (base / "comparison.md").read_text().startswith(
        "| method | num_samples | error | ece | nll | ece_Topt | nll_Topt | temperature | shift_error | shift_ece | "
        "shift_nll | shift_ece_Topt | shift_nll_Topt | ood_auroc_entropy | ood_auroc_mi |")
    for name in ("reliability.png", "shift.png", "risk_coverage.png", "gamma.png"):
        assert (base / name).stat().st_size > 10_000, name
    for method in ("map", "vi", "ivon", "mc_dropout", "sgld", "laplace"):
        run = base / method
        for name in ("config.yaml", "metrics.json", "best.pt", "last.pt", "train.log", "reliability_T1.png",
                     "reliability_Topt.png", "temperature_curve.png", "training_curves.png", "shift.png",
                     "risk_coverage.png"):
            assert (run / name).is_file(), (method, name)
        metrics = json.loads((run / "metrics.json").read_text())
        assert "tuning" not in metrics  # --no-tune
        assert [h["epoch"] for h in metrics["history"]] == [1, 2]
        assert {"train_nll", "val_nll", "test_nll", "train_error", "val_error", "test_error"} <= set(
            metrics["history"][0])
        for s in (0, 3):
            again = cli.evaluate_run(run, s)
            saved = metrics["final"][str(s)]
            for key in ("error", "ece", "mce", "nll", "brier"):
                assert again["T1"][key] == pytest.approx(saved["T1"][key], rel=1e-9, abs=1e-12), (method, s, key)
            assert again["temperature"] == pytest.approx(saved["temperature"], rel=1e-9)
            assert again["shift"]["summary"] == pytest.approx(saved["shift"]["summary"], rel=1e-9)
            assert again["ood"]["entropy"] == pytest.approx(saved["ood"]["entropy"], rel=1e-9)
            # the unshifted members of the shift grids are the in-distribution test set, sampled alike
            for kind in ("rotation", "noise"):
                curve = saved["shift"][kind]
                assert curve["intensity"][0] == 0
                for key in ("error", "nll", "ece"):
                    assert curve["T1"][key][0] == pytest.approx(saved["T1"][key], rel=1e-12, abs=1e-15), (kind, key)
                    assert curve["Topt"][key][0] == pytest.approx(saved["Topt"][key], rel=1e-9, abs=1e-12)
            # digits hold out classes 8 and 9: an 8-class model, OOD scored on the 108 test 8s and 9s
            assert saved["n_classes"] == 8 and saved["ood"]["classes"] == [8, 9]
            assert saved["ood"]["n_out"] == 106 and saved["ood"]["n_in"] == saved["n_examples"]
            if s == 0 or method == "map":  # a point estimate has no epistemic spread to score by
                assert saved["ood"]["mutual_information"] is None
            summary = saved["shift"]["summary"]
            nonzero = [v for kind in ("rotation", "noise") for v, i in
                       zip(saved["shift"][kind]["T1"]["nll"], saved["shift"][kind]["intensity"]) if i != 0]
            assert summary["nll"] == pytest.approx(sum(nonzero) / len(nonzero), rel=1e-12)
        row = next(r for r in rows if r["method"] == method and r["num_samples"] == "3")
        assert float(row["nll"]) == pytest.approx(metrics["final"]["3"]["T1"]["nll"], rel=1e-9)
        assert float(row["shift_nll_Topt"]) == pytest.approx(metrics["final"]["3"]["shift"]["summary"]["nll_Topt"],
                                                             rel=1e-9)
        assert float(row["ood_auroc_entropy"]) == pytest.approx(
            metrics["final"]["3"]["ood"]["entropy"]["auroc"], rel=1e-9)


def test_compare_tunes_each_method_by_validation_nll(tmp_path):
    """Default compare: every method's key option is chosen as the grid point with the lowest validation NLL."""
    out = tmp_path / "runs"
    assert cli.main(["compare", "--methods", "map,vi,laplace", "--epochs", "2", "--out-dir", str(out),
                     "--num-samples", "3", "--shift-rotations", "0", "--shift-noise", "0", *FAST]) == 0
    base = out / "compare-digits-mlp"
    for method, option in (("map", "prior_std"), ("vi", "kl_weight"), ("laplace", "prior_precision")):
        run = base / method
        tuning = json.loads((run / "metrics.json").read_text())["tuning"]
        assert tuning["option"] == option and tuning["grid"] == list(TUNING[method][1])
        assert len(tuning["val_nll"]) == len(tuning["grid"])
        best = min(range(len(tuning["grid"])), key=lambda i: tuning["val_nll"][i])
        assert tuning["chosen"] == tuning["grid"][best]
        if option == "prior_precision":  # set post hoc on the fitted Laplace, saved in the checkpoint
            bnn = cli.build(cli.RunConfig(**cli.load_yaml(run / "config.yaml")).validate(), for_evaluation=True)[2]
            bnn.load_state_dict(load_checkpoint(run / "best.pt"))
            assert bnn.prior_precision == pytest.approx(tuning["chosen"])
        else:  # the final run used the chosen value, and retraining it reproduces its validation NLL
            cfg = cli.RunConfig(**cli.load_yaml(run / "config.yaml")).validate()
            assert getattr(cfg, option) == tuning["chosen"]
            assert cli.tuning_score(cfg, 3) == pytest.approx(tuning["val_nll"][best], rel=1e-6)


@pytest.mark.parametrize("dataset, fixture", [("pets", "fake_pets_root"), ("flowers102", "fake_flowers_root"),
                                              ("imagefolder", "fake_imagefolder_root")])
def test_fit_on_image_datasets_with_tiny_timm_model(request, tmp_path, dataset, fixture):
    if dataset == "flowers102":
        request.getfixturevalue("skip_flowers_md5")
    root = request.getfixturevalue(fixture)
    if dataset == "pets":
        root = root.parent if root.name == "oxford-iiit-pet" else root
    if dataset == "flowers102":
        root = root.parent if root.name == "flowers-102" else root
    args = ["fit", "--dataset", dataset, "--data-root", str(root), "--model", "resnet18", "--img-size", "32",
            "--method", "vi", "--epochs", "1", "--batch-size", "4", "--num-samples", "2", "--lr-head", "0.1",
            "--out-dir", str(tmp_path / "runs"), "--progress", "false"]
    assert cli.main(args) == 0
    run = tmp_path / "runs" / f"{dataset}-resnet18-vi"
    metrics = json.loads((run / "metrics.json").read_text())
    report = metrics["final"]["2"]
    assert 0.0 <= report["T1"]["error"] <= 1.0 and report["T1"]["nll"] > 0
    assert report["n_classes"] >= 2
    assert (run / "reliability_T1.png").is_file()


def test_init_checkpoint_becomes_prior_mean(tmp_path):
    torch.manual_seed(123)
    weights = create_model("mlp", 10, in_features=64).state_dict()
    path = tmp_path / "init.pt"
    torch.save(weights, path)
    assert cli.main(["fit", "--init-checkpoint", str(path), "--method", "vi", "--epochs", "1", "--ood-classes", "",
                     "--out-dir", str(tmp_path / "runs"), *FAST]) == 0
    state = load_checkpoint(tmp_path / "runs" / "digits-mlp-vi" / "best.pt")
    for name, tensor in weights.items():
        assert torch.equal(state["prior.mean." + name.replace(".", "/")], tensor), name


def test_resume_after_interruption_matches_uninterrupted_run(tmp_path, monkeypatch, capsys):
    common = ["fit", "--method", "sgld", "--epochs", "3", "--burn-in-epochs", "1", "--thinning", "2",
              "--num-samples", "3", *FAST]
    assert cli.main(common + ["--out-dir", str(tmp_path / "a")]) == 0
    reference = json.loads((tmp_path / "a" / "digits-mlp-sgld" / "metrics.json").read_text())

    real_save, saves = cli.save_checkpoint, []

    def interrupting_save(path, obj):
        real_save(path, obj)
        saves.append(path.name)
        if saves.count("last.pt") == 2:
            raise KeyboardInterrupt  # killed right after epoch 2 was checkpointed

    monkeypatch.setattr(cli, "save_checkpoint", interrupting_save)
    assert cli.main(common + ["--out-dir", str(tmp_path / "b")]) == 130  # Ctrl-C: exit status 130
    run_dir = tmp_path / "b" / "digits-mlp-sgld"
    assert f"Resume with: bayeswrap fit --resume {run_dir}" in capsys.readouterr().err
    monkeypatch.setattr(cli, "save_checkpoint", real_save)
    assert not (run_dir / "metrics.json").exists()
    assert not (run_dir / ".lock").exists()  # released on the way out
    assert cli.main(["fit", "--resume", str(run_dir)]) == 0  # the run's own config.yaml, nothing else
    resumed = json.loads((tmp_path / "b" / "digits-mlp-sgld" / "metrics.json").read_text())
    assert resumed["final"]["3"]["T1"] == reference["final"]["3"]["T1"]
    for a, b in zip(resumed["history"], reference["history"]):
        assert {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}


@pytest.mark.parametrize("args, message", [
    (["--model", "resnet_nope"], "resnet_nope"),
    (["--dataset", "mnist"], "dataset"),
    (["--method", "nuts"], "method='nuts' is not known; accepted: map, vi, ivon, mc_dropout, sgld, laplace"),
    (["--dataset", "pets", "--data-root", "/nonexistent/pets"], "--download"),
    (["--init-checkpoint", "/nonexistent/w.pt"], "/nonexistent/w.pt"),
    (["--lr", "abc"], "lr='abc' is not a number; accepted: a finite number > 0"),
    (["--epochs", "0"], "epochs='0' is out of range; accepted: an integer >= 1"),
    (["--val-fraction", "1.5"], "val_fraction=1.5 is out of range"),
    (["--bias", "gaussian"], "bias='gaussian' is not accepted by method 'vi'"),
])
def test_bad_input_exits_nonzero_without_run_folder(tmp_path, capsys, args, message):
    out = tmp_path / "runs"
    assert cli.main(["fit", "--out-dir", str(out), "--epochs", "1", *FAST, *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() or not any(out.iterdir())


def test_existing_run_folder_needs_resume_or_overwrite(tmp_path, capsys):
    args = ["fit", "--method", "map", "--epochs", "1", "--out-dir", str(tmp_path), *FAST]
    assert cli.main(args) == 0
    assert cli.main(args) == 2
    run_dir = tmp_path / "digits-mlp-map"
    assert f"exists; pass --resume {run_dir} to continue it or --overwrite to replace it" in capsys.readouterr().err
    assert cli.main(args + ["--overwrite"]) == 0


def test_mismatched_or_unreadable_checkpoint(tmp_path, capsys):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    assert cli.main(["fit", "--init-checkpoint", str(bad), "--out-dir", str(tmp_path / "r"), *FAST]) == 2
    assert str(bad) in capsys.readouterr().err
    wrong = tmp_path / "wrong.pt"
    torch.save(create_model("mlp", 10, in_features=64, hidden_sizes=(7,)).state_dict(), wrong)
    assert cli.main(["fit", "--init-checkpoint", str(wrong), "--out-dir", str(tmp_path / "r"), *FAST]) == 2
    assert str(wrong) in capsys.readouterr().err


def test_nan_loss_stops_with_message(tmp_path, capsys):
    code = cli.main(["fit", "--method", "map", "--lr", "1e12", "--epochs", "2", "--out-dir", str(tmp_path), *FAST])
    assert code == 1
    assert "non-finite loss" in capsys.readouterr().err


def test_help_documents_every_option_with_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--pretrained", "--init-checkpoint", "--dataset", "--data-root", "--download",
                 "--val-fraction", "--method", "--prior-std", "--kl-weight", "--num-samples", "--epochs", "--lr",
                 "--lr-head", "--momentum", "--batch-size", "--seed", "--device", "--amp", "--out-dir"):
        assert flag in text, flag
    assert "(default: 0.5)" in text
