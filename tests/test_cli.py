"""The command line end to end: compare/evaluate on digits, fit on fake Pets/Flowers/image folders."""

import csv
import json

import pytest
import torch

import bayeswrap.app.cli as cli
from bayeswrap.app import compare, reports, runner
from bayeswrap.app.backbones import create_model
from bayeswrap.app.build import build
from bayeswrap.app.config import RunConfig, load_yaml
from bayeswrap.core.io import load_checkpoint
from bayeswrap.methods import METHODS, TUNING, Ensemble

FAST = ["--progress", "false", "--batch-size", "64"]
#: what `compare` runs without --methods, in registration order
DEFAULT_COMPARISON = tuple(m for m, cls in METHODS.items() if cls.in_default_comparison)
#: its rows without tuning: each method, then its further operating points (Laplace's marglik)
DEFAULT_ROWS = tuple(label for m in DEFAULT_COMPARISON
                     for label in (m, *(f"{m} ({p})" for p in METHODS[m].operating_points)))


def test_compare_writes_table_and_evaluate_recomputes_it(tmp_path):
    out = tmp_path / "runs"
    assert cli.main(["compare", "--epochs", "2", "--out-dir", str(out), "--num-samples", "0,3", "--shift-rotations",
                     "0,45", "--shift-noise", "0,0.5", "--no-tune", *FAST]) == 0
    base = out / "compare-digits-mlp"
    rows = list(csv.DictReader(open(base / "comparison.csv")))
    assert [(r["method"], r["num_samples"]) for r in rows] == [(m, s) for m in DEFAULT_ROWS for s in ("0", "3")]
    assert "laplace (marglik)" in DEFAULT_ROWS
    cost = {r["method"]: float(r["cost"]) for r in rows}  # training time as a multiple of MAP's
    seconds = {m: sum(h["seconds"] for h in json.loads((base / m / "metrics.json").read_text())["history"])
               for m in DEFAULT_COMPARISON}
    assert cost == pytest.approx({m: seconds[m.split(" ")[0]] / seconds["map"] for m in cost}, rel=1e-3)
    assert (base / "comparison_full.md").read_text().startswith(  # every column; comparison.md is the compact one
        "| method | tuned | cost | num_samples | predictive | error | ece | nll | ece_Topt | nll_Topt | temperature | "
        "shift_error | shift_ece | shift_nll | shift_ece_Topt | shift_nll_Topt | ood_auroc_entropy | ood_auroc_mi |")
    assert [c.strip() for c in (base / "comparison.md").read_text().splitlines()[0].split("|")[1:-1]] == [
        header for header, _ in reports.SUMMARY_COLUMNS]
    # each row names the predictive it was scored with: Laplace's own, the closed-form probit GLM
    # (S = 0 is the posterior mean for each, an ensemble's the mixture of its members' means)
    named = {(r["method"], r["num_samples"]): r["predictive"] for r in rows}
    assert {v for (m, s), v in named.items() if m.startswith("laplace") and s == "3"} == {"GLM(link='probit')"}
    assert {v for (m, s), v in named.items() if m in ("map", "vi") and s == "3"} == {"Sampled()"}
    assert {v for (m, s), v in named.items() if m in ("map", "vi", "laplace (val)") and s == "0"} == {"PosteriorMean()"}
    assert named[("ensemble", "0")] == "Mixture()"
    for name in ("reliability.png", "shift.png", "risk_coverage.png", "gamma.png"):
        assert (base / name).stat().st_size > 10_000, name
    for method in DEFAULT_COMPARISON:
        run = base / method
        for name in ("config.yaml", "metrics.json", "best.pt", "last.pt", "train.log", "reliability_T1.png",
                     "reliability_Topt.png", "temperature_curve.png", "training_curves.png", "shift.png",
                     "risk_coverage.png"):
            assert (run / name).is_file(), (method, name)
        metrics = json.loads((run / "metrics.json").read_text())
        assert "tuning" not in metrics  # --no-tune
        assert all(r["tuned"] == "" for r in rows if r["method"] == method)
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
            ensemble = issubclass(METHODS[method], Ensemble)  # its S = 0 predictive: one mean per member
            if (s == 0 or method == "map") and not ensemble:  # a point estimate has no epistemic spread
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


def _check_stage(stage: dict) -> None:
    """A bracketed stage: sorted grid, its argmin chosen, interior unless a bound is recorded."""
    grid, nll = stage["grid"], stage["val_nll"]
    assert grid == sorted(grid) and len(nll) == len(grid)
    best = min(range(len(grid)), key=lambda i: nll[i])
    assert stage["chosen"] == grid[best] == grid[stage["chosen_index"]]
    assert set(stage["extensions"]) <= set(grid)
    if stage["bound_hit"] is None:
        assert 0 < best < len(grid) - 1, stage
    else:
        assert stage["bound_hit"]["reason"] in ("value_bound", "max_extensions", "non_finite"), stage


def test_compare_tunes_each_method_by_validation_nll(tmp_path, capsys):
    """Default compare: MAP's prior std, then each method's knob at MAP's σ and its own σ, by validation NLL."""
    out = tmp_path / "runs"
    assert cli.main(["compare", "--methods", "vi,map,laplace", "--epochs", "2", "--out-dir", str(out),
                     "--num-samples", "3", "--shift-rotations", "0", "--shift-noise", "0", *FAST]) == 0
    printed = capsys.readouterr().out
    base = out / "compare-digits-mlp"
    records = {m: json.loads((base / m / "metrics.json").read_text())["tuning"] for m in ("map", "vi", "laplace")}
    sigma = records["map"]["options"]["prior_std"]
    assert [s["stage"] for s in records["map"]["stages"]] == ["knob"]
    assert set(TUNING["map"][1]) <= set(records["map"]["stages"][0]["grid"])
    # Laplace is scored at both operating points: δ tuned by validation NLL, and δ by marginal likelihood
    assert [r["method"] for r in csv.DictReader(open(base / "comparison.csv"))] == [
        "vi", "map", "laplace (val)", "laplace (marglik)"]
    assert [s["stage"] for s in records["vi"]["stages"]] == ["knob", "prior_std"]
    assert [s["stage"] for s in records["laplace"]["stages"]] == ["prior_std", "post_hoc"]
    for method, tuning in records.items():
        for stage in tuning["stages"]:
            _check_stage(stage)
        assert tuning["prior_std_from"] == ("config" if method == "map" else "map")
        if method != "map":  # stage 1 starts from MAP's σ; the prior std stage scores σ/3, σ and 3σ
            first = tuning["stages"][0]
            assert first["fixed"].get("prior_std", sigma) == sigma
            prior = next(s for s in tuning["stages"] if s["stage"] == "prior_std")
            assert {sigma, sigma * 3} <= set(prior["grid"]) or sigma * 3 > 1e3
            assert tuning["choice"] == ("inherit" if prior["chosen"] == sigma else "joint")
        label = "laplace (val)" if method == "laplace" else method
        row = next(r for r in csv.DictReader(open(base / "comparison.csv")) if r["method"] == label)
        assert row["tuned"] == ", ".join(f"{k}={v:g}" for k, v in tuning["options"].items()) != ""
        assert f"{label} {row['tuned']}" in " ".join(printed.split())  # the compact table's "Tuned by" lines
    assert list(records["vi"]["options"]) == ["prior_std", "kl_weight"]
    assert list(records["laplace"]["options"]) == ["prior_std", "prior_precision"]
    # the final runs used the chosen values; retraining VI at them reproduces its validation NLL
    cfg = RunConfig(**load_yaml(base / "vi" / "config.yaml")).validate()
    assert cfg.prior_std == records["vi"]["options"]["prior_std"]
    assert cfg.kl_weight == records["vi"]["options"]["kl_weight"]
    assert compare.tuning_score(cfg, 3) == pytest.approx(records["vi"]["val_nll"], rel=1e-6)
    run = base / "laplace"  # set post hoc on the fitted Laplace, saved in the checkpoint
    cfg = RunConfig(**load_yaml(run / "config.yaml")).validate()
    assert cfg.prior_std == records["laplace"]["options"]["prior_std"]
    splits, ood_test, bnn, _, device = build(cfg, for_evaluation=True)
    bnn.load_state_dict(load_checkpoint(run / "best.pt"))
    assert bnn.prior_precision == pytest.approx(records["laplace"]["options"]["prior_precision"])
    # the marglik row: the same fitted posterior at the δ that maximises the marginal likelihood
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["operating_point"] == "val"
    point = metrics["operating_points"]["marglik"]
    delta = bnn.optimize_prior_precision("marglik")
    assert point["options"] == {"prior_precision": pytest.approx(delta, rel=1e-12)}
    assert delta != pytest.approx(records["laplace"]["options"]["prior_precision"])
    report = reports.final_reports(bnn, splits, ood_test, cfg, 3, device)[0]
    row = next(r for r in csv.DictReader(open(base / "comparison.csv")) if r["method"] == "laplace (marglik)")
    assert float(row["nll"]) == pytest.approx(report["T1"]["nll"], rel=1e-9) == point["final"]["3"]["T1"]["nll"]
    assert row["tuned"] == f"prior_std={cfg.prior_std:g}, prior_precision={delta:g}"


def test_resumed_compare_applies_only_tuned_options_from_a_tuning_file(tmp_path, capsys):
    """A tuning_<method>.json may set the method's prior std and knob, nothing else (not e.g. out_dir)."""
    args = ["compare", "--methods", "map", "--epochs", "1", "--num-samples", "0", "--shift-rotations", "0",
            "--shift-noise", "0", "--out-dir", str(tmp_path), *FAST]
    assert cli.main(args) == 0
    base = tmp_path / "compare-digits-mlp"
    path = base / "tuning_map.json"
    assert json.loads(path.read_text())["options"] == json.loads(
        (base / "map" / "metrics.json").read_text())["tuning"]["options"]
    (base / "map" / "metrics.json").unlink()  # as if interrupted before the final run finished
    capsys.readouterr()
    for options, message in (({"prior_std": 0.5, "out_dir": "/tmp/elsewhere"},
                               "out_dir is not a tuned option of method 'map'; accepted: prior_std"),
                              ({"kl_weight": 0.5}, "kl_weight is not a tuned option"),
                              ({"prior_std": "0.5"}, r"prior_std='0.5' is not a finite number")):
        path.write_text(json.dumps({"options": options}))
        assert cli.main(["compare", "--resume", str(base)]) == 2
        assert f"{path}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere").exists() and not (base / "map" / "metrics.json").exists()
    path.write_text(json.dumps({"options": {"prior_std": 0.5}, "stages": []}))
    assert cli.main(["compare", "--resume", str(base)]) == 0
    assert RunConfig(**load_yaml(base / "map" / "config.yaml")).prior_std == 0.5
    assert json.loads((base / "map" / "metrics.json").read_text())["tuning"]["options"] == {"prior_std": 0.5}
    assert "prior_std=0.5" in (base / "comparison.md").read_text()


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

    real_save, saves = runner.save_checkpoint, []

    def interrupting_save(path, obj):
        real_save(path, obj)
        saves.append(path.name)
        if saves.count("last.pt") == 2:
            raise KeyboardInterrupt  # killed right after epoch 2 was checkpointed

    monkeypatch.setattr(runner, "save_checkpoint", interrupting_save)
    assert cli.main(common + ["--out-dir", str(tmp_path / "b")]) == 130  # Ctrl-C: exit status 130
    run_dir = tmp_path / "b" / "digits-mlp-sgld"
    assert f"Resume with: bayeswrap fit --resume {run_dir}" in capsys.readouterr().err
    monkeypatch.setattr(runner, "save_checkpoint", real_save)
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
    (["--method", "nuts"], "method='nuts' is not known; accepted: map, vi, ivon, mc_dropout, sgld, swag, laplace"),
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
