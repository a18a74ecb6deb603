"""The method class is the single source of truth: registering it is all it takes.

* No command-line default differs from the library default, for any option of any method (the CLI passes only
  the options a user gives; the rest keep the constructor's, or ``run_chains``'s, default).
* A toy method registered here appears in ``bw.wrap``, the CLI flags and ``--help``, and ``compare`` (its
  tuning knob and grid come from its class).
"""

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bayeswrap as bw
import bayeswrap.app.build as build_module
import bayeswrap.app.cli as cli
from bayeswrap.app.config import FIELDS, load_run_config, resolve
from bayeswrap.app.options import option_specs
from bayeswrap.methods import (
    MAP,
    METHODS,
    discover_methods,
    method_options,
    method_table,
    register_method,
    tuning_option,
)

#: settings the run protocol makes on purpose (documented in bayeswrap.app.build): SGLD's burn-in is set in epochs
PROTOCOL = {"sgld": {"burn_in", "cycles"}}


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
    for name in method_specific - {"burn_in"}:
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
        cli.make_parser().parse_args(["fit", "--method", "toy", "--help"])
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


#: the order methods are listed in (messages, --help, the docs, the main job's table): part of the interface
LISTING_ORDER = ["map", "vi", "ivon", "mc_dropout", "sgld", "swag", "laplace", "laplace_ll_kfac", "tfb", "sparse_vd",
                 "kingma_vd", "lbbnn", "mh", "hmc", "ensemble", "multiswag"]


def test_the_package_walk_finds_every_method_in_its_listing_order():
    assert list(METHODS) == LISTING_ORDER
    assert [bw.__all__.index(cls.__name__) for cls in METHODS.values()] == sorted(
        bw.__all__.index(cls.__name__) for cls in METHODS.values())
    # no hand-kept list of method modules: the package's __init__ names no method module
    source = (Path(bw.methods.__file__)).read_text()
    assert "isort: skip" not in source and not any(f"methods.{name}" in source for name in LISTING_ORDER)


def test_wraps_docstring_lists_every_registered_method_and_its_options(toy):
    doc = inspect.getdoc(bw.wrap)
    for name, cls in METHODS.items():
        assert f'``"{name}"`` (:class:`~bayeswrap.{cls.__name__}`)' in doc
        assert f"* {name}: " in doc
    assert "* toy: ``toy_scale``" in doc and doc.index('"mh"') < doc.index('"toy"')  # no order: listed last


def test_register_method_refuses_a_bad_name_or_order():
    with pytest.raises(ValueError, match=r"name='My Method' is not a method name; accepted: lowercase"):
        register_method("My Method")
    for order in (float("nan"), "10", True):
        with pytest.raises(ValueError, match=r"order=.* must be a finite number"):
            register_method("toy", order=order)


def _plugin_package(root: Path) -> str:
    """A package with a method in a module, one in a subpackage's module, and modules that register nothing."""
    package = root / "toy_plugins"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("SCALE = 2.0\n")
    (package / "sub" / "__init__.py").write_text("")
    method = '''
from bayeswrap.methods.base import register_method
from bayeswrap.methods.map import MAP


@register_method("{name}", order={order})
class {cls}(MAP):
    """A MAP variant (a test double)."""

    def __init__(self, model, *, {option}: float = 1.0, **kwargs):
        self.{option} = {option}
        super().__init__(model, **kwargs)
'''
    (package / "early.py").write_text(method.format(name="toy_early", order=15, cls="ToyEarly", option="early_scale"))
    (package / "sub" / "late.py").write_text(method.format(name="toy_late", order=1000, cls="ToyLate",
                                                             option="late_scale"))
    return package.name


def test_discovery_walks_subpackages_and_sorts_by_order(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _plugin_package(tmp_path)
    try:
        discover_methods(name)
        assert list(METHODS) == ["map", "toy_early", *LISTING_ORDER[1:], "toy_late"]
        assert method_options("toy_late") == ("late_scale",)
        assert isinstance(bw.wrap(torch.nn.Linear(2, 2), "toy_early", num_data=4, early_scale=3.0), MAP)
        assert '``"toy_late"``' in inspect.getdoc(bw.wrap) and '`"toy_early"`' in method_table()
        discover_methods(name)  # a second walk imports nothing again and changes nothing
        assert list(METHODS).count("toy_late") == 1
    finally:
        METHODS.pop("toy_early", None), METHODS.pop("toy_late", None)
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module]


def test_a_method_is_one_new_file(tmp_path):
    """A module dropped into a copy of bayeswrap/methods is a method everywhere: the one file is the whole change."""
    copy = tmp_path / "src"
    shutil.copytree(Path(bw.__file__).parent, copy / "bayeswrap", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "bayeswrap" / "methods" / "toy_method.py").write_text('''"""A toy method."""

from bayeswrap.methods.base import register_method
from bayeswrap.methods.map import MAP


@register_method("toy", order=55)
class Toy(MAP):
    """A MAP variant whose prior penalty is scaled (a test double).

    Args:
        toy_scale: multiplier of the prior penalty (a number > 0).
    """

    tuning = ("toy_scale", (0.5, 2.0))

    def __init__(self, model, *, toy_scale: float = 1.0, **kwargs):
        self.toy_scale = float(toy_scale)
        super().__init__(model, **kwargs)

    def regularizer(self):
        return self.toy_scale * super().regularizer()
''')
    check = '''
import contextlib, inspect, io, torch
import bayeswrap as bw
from bayeswrap.app import cli
from bayeswrap.app.config import resolve
from bayeswrap.methods import METHODS, TUNING, method_table

assert list(METHODS)[5:7] == ["toy", "swag"], list(METHODS)
assert "Toy" in bw.__all__ and bw.Toy is METHODS["toy"]
assert bw.wrap(torch.nn.Linear(3, 2), "toy", num_data=10, toy_scale=0.5).toy_scale == 0.5
assert bw.method_options("toy") == ("toy_scale",) and TUNING["toy"] == ("toy_scale", (0.5, 2.0))
assert '``"toy"`` (:class:`~bayeswrap.Toy`)' in inspect.getdoc(bw.wrap)
assert '| `"toy"` | `Toy` | A MAP variant whose prior penalty is scaled (a test double). | `toy_scale` |' in method_table()
assert resolve(None, {"method": "toy", "toy_scale": "0.25"}).option("toy_scale") == 0.25
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    cli.make_parser().parse_args(["fit", "--method", "toy", "--help"])
assert "--toy-scale" in out.getvalue()
print("ok")
'''
    env = {**os.environ, "PYTHONPATH": str(copy)}
    result = subprocess.run([sys.executable, "-c", check], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_the_readme_method_table_is_rendered_from_the_registry():
    """README.md holds :func:`method_table` verbatim (print it: ``bw.methods.method_table()``)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    assert method_table() in readme
