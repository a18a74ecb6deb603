"""A ``compare`` row reproduces from its recorded settings (issue 32, item 4).

Each method's final run in a comparison must be the network its tuning chose, and ``bayeswrap fit`` at the
options of the row's tuning record must give the row again: nothing that the comparison ran before (other
methods, the tuning candidates) or that a run evaluates between epochs may reach a run's random stream.
"""

import csv
import json
import math

import pytest
import torch

import bayeswrap.app.cli as cli
from bayeswrap import wrap
from bayeswrap.app.build import build, eval_loader
from bayeswrap.app.compare import member_method, tuned_option_names
from bayeswrap.app.config import RunConfig, load_yaml
from bayeswrap.core.io import load_checkpoint
from bayeswrap.predictive import evaluate
from bayeswrap.training import fit, rng_preserved

SHORT = ["--epochs", "2", "--num-samples", "5", "--shift-rotations", "0,90", "--shift-noise", "0,0.5",
         "--progress", "false", "--batch-size", "64"]
METHODS = ("map", "vi", "swag")
TOL = 1e-6


def _numbers(report: dict, prefix: str = "") -> dict:
    """Every number of a final report, by its dotted path."""
    out = {}
    for key, value in report.items():
        if isinstance(value, dict):
            out.update(_numbers(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[prefix + key] = float(value)
    return out


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    bad = {k: (a[k], b[k]) for k in a if not (a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k]))
                                              or abs(a[k] - b[k]) <= TOL)}
    assert not bad, f"{what}: {len(bad)} numbers differ, e.g. {dict(list(bad.items())[:4])}"


def _rows(base) -> dict:
    with open(base / "comparison.csv") as f:
        return {(r["method"], r["num_samples"]): r for r in csv.DictReader(f)}


def _row_numbers(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if k not in ("method", "tuned", "cost", "predictive", "note")
            and v != ""}


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    assert cli.main(["compare", "--methods", ",".join(METHODS), "--out-dir", str(out), *SHORT]) == 0
    return out / "compare-digits-mlp"


def test_final_run_is_the_chosen_tuning_candidate(comparison):
    """The final run trains the network its tuning scored: its validation NLL at S is the record's.

    Before, the final run also scored the test set every epoch, and that loader drew its base seed from the
    global generator, so VI's training draws (and its network) differed from the candidate's.
    """
    for method in METHODS:
        run = comparison / method
        tuning = json.loads((run / "metrics.json").read_text())["tuning"]
        cfg = RunConfig(**load_yaml(run / "config.yaml")).validate()
        splits, _, bnn, _, device = build(cfg, for_evaluation=True)
        bnn.load_state_dict(load_checkpoint(run / "best.pt"))
        bnn.eval()
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        nll = evaluate(bnn, eval_loader(splits.val, cfg), 5, generator=gen)["nll"]
        assert nll == pytest.approx(tuning["val_nll"], rel=TOL, abs=TOL), method


def test_fit_at_the_tuned_options_gives_the_row(comparison, tmp_path):
    """``bayeswrap fit`` with the options of the row's tuning record, in its own folder: the same numbers."""
    rows = _rows(comparison)
    for method in METHODS:
        tuning = json.loads((comparison / method / "metrics.json").read_text())["tuning"]
        names = tuned_option_names(method)
        args = ["fit", "--method", method, "--out-dir", str(tmp_path), "--run-name", method, *SHORT]
        for key, value in tuning["options"].items():
            if key in names:
                args += [f"--{key.replace('_', '-')}", repr(value)]
        assert cli.main(args) == 0
        direct = json.loads((tmp_path / method / "metrics.json").read_text())["final"]["5"]
        compared = json.loads((comparison / method / "metrics.json").read_text())["final"]["5"]
        _same(_numbers(compared), _numbers(direct), f"{method}: comparison vs fit at {tuning['options']}")
        # the table's row is the run's report
        row = _row_numbers(rows[(method, "5")])
        assert row["nll"] == pytest.approx(direct["T1"]["nll"], abs=1e-4)
        assert row["error"] == pytest.approx(direct["T1"]["error"], abs=1e-4)


def test_rows_do_not_depend_on_the_other_methods(comparison, tmp_path):
    """Another order of the methods, or a method alone at its tuned options, gives the same rows."""
    assert cli.main(["compare", "--methods", ",".join(reversed(METHODS)), "--out-dir", str(tmp_path / "reversed"),
                     *SHORT]) == 0
    first, again = _rows(comparison), _rows(tmp_path / "reversed" / "compare-digits-mlp")
    assert first.keys() == again.keys()
    for key, row in first.items():
        assert again[key]["tuned"] == row["tuned"], key
        _same(_row_numbers(row), _row_numbers(again[key]), f"{key}: reversed order")
    method = "vi"
    options = json.loads((comparison / method / "metrics.json").read_text())["tuning"]["options"]
    assert member_method(RunConfig(method=method)) is None
    args = ["compare", "--methods", method, "--no-tune", "--out-dir", str(tmp_path / "alone"), *SHORT]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", repr(value)]
    assert cli.main(args) == 0
    alone = _rows(tmp_path / "alone" / "compare-digits-mlp")[(method, "5")]
    _same(_row_numbers(first[(method, "5")]), _row_numbers(alone), f"{method} alone")


def _vi_training(val_loader, rounds: int = 1):
    torch.manual_seed(0)
    x, y = torch.randn(96, 6), torch.randint(0, 3, (96,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    bnn = wrap(model, "vi", num_data=96, prior_std=1.0, init_std=0.05)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                                        generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(bnn.parameters(), lr=0.05, momentum=0.9)
    fit(bnn, train, epochs=rounds + 1, optimizer=optimizer, val_loader=val_loader, progress=False,
        val_num_samples=3 if val_loader is not None else 0)
    return torch.cat([p.detach().flatten() for p in bnn.parameters()])


def test_validation_between_epochs_does_not_move_the_training_stream():
    """fit's validation (a loader without its own generator, sampled at S = 3) leaves the training draws alone."""
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,))),
                                      batch_size=16)
    assert torch.equal(_vi_training(None), _vi_training(val))
    state = torch.get_rng_state()
    with rng_preserved("cpu"):
        torch.randn(10)
        list(val)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("method, options", [
    ("vi", {}), ("vi", {"local_reparam": True}), ("vi", {"fused": False}), ("mc_dropout", {}),
])
def test_sampled_predictive_depends_only_on_the_generator(method, options):
    """S draws under a fixed generator: the same outputs whatever the global RNG, which they leave untouched.

    Covers the vmapped forward (``torch.func.vmap(randomness="different")`` over the samples), its sequential
    fallback, local reparameterisation (pre-activation noise) and MC-dropout masks.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(12, 3))
    bnn = wrap(model, method, num_data=50, prior_std=1.0, prior_mean="zero", **options).eval()
    x = torch.randn(7, 5)
    outs = []
    for global_seed, vmap_ok in ((1, True), (2, True), (1, False)):
        bnn._vmap_ok = vmap_ok
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        with torch.no_grad():
            outs.append(bnn.sample_logits(x, 4, generator=torch.Generator().manual_seed(3)))
        assert torch.equal(state, torch.get_rng_state()), "the global RNG moved"
    assert torch.equal(outs[0], outs[1])
    assert outs[0].shape == (4, 7, 3) and not torch.allclose(outs[0][0], outs[0][1])  # distinct draws
    if method == "vi" and not options.get("local_reparam"):
        # weight samples: the vmapped and the one-at-a-time forward see the same draws
        torch.testing.assert_close(outs[2], outs[0], rtol=1e-5, atol=1e-6)


def test_vi_std_cache_sees_a_set_posterior():
    """VI's cached posterior std (eval mode, no autograd) follows ρ set through ``bnn.rho[name] = value``."""
    torch.manual_seed(0)
    bnn = wrap(torch.nn.Linear(3, 2), "vi", num_data=10, prior_std=1.0).eval()
    name = bnn.rho.keys()[0]
    with torch.no_grad():
        before = bnn.posterior_std()[name].clone()
        bnn.rho[name] = bnn.rho[name] * 0.5
        after = bnn.posterior_std()[name]
    torch.testing.assert_close(after, torch.exp(bnn.log_std_scale * bnn.rho[name].detach()), rtol=0, atol=0)
    torch.testing.assert_close(after, before.sqrt(), rtol=1e-6, atol=0)  # s = exp(κρ): halving ρ gives √s
