"""The method class is the single source of truth: registering it is all it takes.

* No command-line default differs from the library default, for any option of any method (the CLI passes only
  the options a user gives; the rest keep the constructor's, or ``run_chains``'s, default).
* A toy method registered here appears in ``bw.wrap``, the CLI flags and ``--help``, and ``compare`` (its
  tuning knob and grid come from its class).
"""

import inspect
import json

import pytest
import torch

import bayeswrap as bw
import bayeswrap.app.build as build_module
import bayeswrap.app.cli as cli
from bayeswrap.app.config import FIELDS, load_run_config, resolve
from bayeswrap.app.options import option_specs
from bayeswrap.methods import MAP, METHODS, register_method, tuning_option

#: settings the run protocol makes on purpose (documented in bayeswrap.app.build): the reports score every method
#: by the same S-sample predictive (Laplace's GLM predictive is sampled), and SGLD's burn-in is set in epochs
PROTOCOL = {"laplace": {"link_approx"}, "sgld": {"burn_in", "cycles"}}


def _library_defaults(cls) -> dict:
    defaults = {}
    for klass in reversed(cls.__mro__):
        if "__init__" in vars(klass):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.kind is p.KEYWORD_ONLY:
                    defaults[p.name] = p.default
    return defaults


@pytest.mark.parametrize("method", list(METHODS))
def test_no_cli_default_differs_from_the_library_default(method, monkeypatch):
    cfg = resolve(None, {"method": method})
    assert cfg.method_options == {}
    specs = option_specs(method)
    lib = _library_defaults(METHODS[method])
    for name, spec in specs.items():
        expected = lib[spec.argument] if spec.target == "init" else \
            inspect.signature(METHODS[method].run_chains).parameters[spec.argument].default
        assert spec.default == expected, name
        assert cfg.option(name) == expected, name
    # what the run hands the constructor: nothing but the run-level options and the documented protocol settings
    seen = {}

    def spy(model, name, **kwargs):
        seen.update(kwargs)
        return bw.wrap(model, name, **kwargs)

    monkeypatch.setattr(build_module, "wrap", spy)
    cfg = resolve(None, {"method": method, "epochs": 2})
    splits, _ = build_module.load_splits(cfg)
    build_module.build_model(cfg, build_module.data_info(splits, cfg))
    method_specific = set(seen) - {"num_data", "prior_std", "prior_mean", "bias", "params", "kl_weight"}
    assert method_specific <= PROTOCOL.get(method, set())
    for name in method_specific - {"burn_in", "link_approx"}:
        assert seen[name] == lib[name], name


def test_hmc_from_the_command_line_keeps_the_draws_the_python_call_keeps():
    """``fit --method hmc --chain-samples 1000`` keeps 1000 draws per chain, as ``run_chains(num_samples=1000)``."""
    cfg = resolve(None, {"method": "hmc", "chain_samples": 1000})
    py = inspect.signature(METHODS["hmc"].run_chains).parameters
    assert cfg.option("chain_samples") == 1000
    assert cfg.option("thinning") == py["thinning"].default == 1
    assert cfg.option("max_samples") == _library_defaults(METHODS["hmc"])["max_samples"] == 1000
    assert cfg.option("num_warmup") == py["num_warmup"].default


def test_a_method_option_the_method_does_not_take_is_refused_by_fit_and_shared_by_compare():
    with pytest.raises(ValueError, match=r"p_drop is not an option of method 'vi' \(it is an option of mc_dropout\)"):
        resolve(None, {"method": "vi", "p_drop": 0.2})
    assert resolve(None, {"method": "mc_dropout", "p_drop": "0.2"}).option("p_drop") == 0.2
    assert not set(option_specs("map")) & set(FIELDS)


class _Toy(MAP):
    """A MAP variant that scales its prior penalty (a test double for registration).

    Args:
        toy_scale: multiplier of the prior penalty (a number > 0).
    """

    tuning = ("toy_scale", (0.5, 2.0))

    def __init__(self, model, *, toy_scale: float = 1.0, **kwargs):
        if not toy_scale > 0:
            raise ValueError(f"toy_scale={toy_scale!r} must be a number > 0")
        self.toy_scale = float(toy_scale)
        super().__init__(model, **kwargs)

    def regularizer(self) -> torch.Tensor:
        return self.toy_scale * super().regularizer()


@pytest.fixture
def toy():
    register_method("toy")(_Toy)
    try:
        yield _Toy
    finally:
        METHODS.pop("toy")


def test_a_registered_method_appears_in_wrap_the_cli_and_compare(toy, tmp_path, capsys):
    net = torch.nn.Linear(3, 2)
    bnn = bw.wrap(net, "toy", num_data=10, toy_scale=0.25)
    assert isinstance(bnn, toy) and bnn.toy_scale == 0.25 and bw.method_options("toy") == ("toy_scale",)
    assert bnn.regularizer().item() == 0.0  # at the prior mean
    # the CLI: a flag from the constructor, with the docstring's help, validated by the constructor
    with pytest.raises(SystemExit):
        cli.make_parser().parse_args(["fit", "--help"])
    assert "--toy-scale" in capsys.readouterr().out
    assert resolve(None, {"method": "toy", "toy_scale": "0.5"}).option("toy_scale") == 0.5
    with pytest.raises(ValueError, match=r"toy_scale=-1.0 must be a number > 0"):
        resolve(None, {"method": "toy", "toy_scale": "-1"})
    # compare: the knob and grid come from the class
    assert tuning_option("toy") == ("toy_scale", (0.5, 2.0))
    out = tmp_path / "runs"
    assert cli.main(["compare", "--methods", "toy", "--epochs", "1", "--out-dir", str(out), "--num-samples", "0",
                     "--shift-rotations", "0", "--shift-noise", "0", "--progress", "false", "--batch-size",
                     "128"]) == 0
    tuning = json.loads((out / "compare-digits-mlp" / "toy" / "metrics.json").read_text())["tuning"]
    knob, prior = tuning["stages"]  # its knob at the configured prior std (no MAP compared), then the prior std
    assert knob["option"] == "toy_scale" and {0.5, 2.0} <= set(knob["grid"]) and prior["option"] == "prior_std"
    for stage in (knob, prior):
        assert stage["chosen"] == stage["grid"][min(range(len(stage["grid"])), key=lambda i: stage["val_nll"][i])]
    assert tuning["options"] == {"prior_std": prior["chosen"], "toy_scale": knob["chosen"]}
    saved = load_run_config(out / "compare-digits-mlp" / "toy" / "config.yaml")
    assert resolve(None, {"method": "toy", **saved.method_options}).option("toy_scale") == knob["chosen"]
    assert saved.prior_std == prior["chosen"]
