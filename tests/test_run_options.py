"""What a run implies for a method (``BayesianModel.run_options``), and an application that names no method."""

import ast
import inspect
import logging
import pathlib
import subprocess
import sys

import pytest

import bayeswrap
from bayeswrap.app.config import resolve
from bayeswrap.methods import METHODS
from bayeswrap.methods.run_info import RunInfo

APP = pathlib.Path(bayeswrap.__file__).parent / "app"


def test_a_run_keeps_laplaces_own_link():
    """A run implies nothing for Laplace: its predictive is the constructor's link (probit unless the run sets one).
    """
    laplace = METHODS["laplace"]
    assert laplace.run_options(RunInfo(epochs=2)) == {}
    assert laplace.run_options(RunInfo(epochs=2, options={"link_approx": "mc"})) == {}
    assert "link_approx" not in resolve(None, {"method": "laplace"}).init_arguments()
    assert inspect.signature(laplace.__init__).parameters["link_approx"].default == "probit"


def test_sgld_burn_in_from_the_run_epochs_and_cycles():
    sgld = METHODS["sgld"]
    assert sgld.run_options(RunInfo(epochs=4, steps_per_epoch=10)) == {"burn_in": 20}  # half of 40 steps
    assert sgld.run_options(RunInfo(epochs=4, steps_per_epoch=10, burn_in_epochs=1.5)) == {"burn_in": 15}
    assert sgld.run_options(RunInfo(epochs=4, steps_per_epoch=10, options={"burn_in": 7})) == {}
    assert sgld.run_options(RunInfo(epochs=4, steps_per_epoch=10, options={"cycles": 2})) == {"burn_in": "auto"}
    # the command line's cycles=0 is no cycles
    assert sgld.run_options(RunInfo(epochs=4, steps_per_epoch=10, options={"cycles": 0})) == {"cycles": None,
                                                                                               "burn_in": 20}
    assert sgld.run_options(RunInfo(epochs=4, options={"cycles": 0})) == {"cycles": None}  # no data read yet
    with pytest.raises(ValueError, match=r"scheduler='cosine', warmup_epochs=0: cyclical SGLD \(cycles=2\) sets"):
        sgld.run_options(RunInfo(epochs=4, options={"cycles": 2}, scheduler="cosine"))


def test_sgld_burn_in_leaves_samples_in_a_short_run(caplog):
    sgld = METHODS["sgld"]
    with caplog.at_level(logging.WARNING, logger="bayeswrap"):
        out = sgld.run_options(RunInfo(epochs=1, steps_per_epoch=8, burn_in_epochs=3.0, options={"thinning": 5}))
    assert out == {"burn_in": 3}  # at most 8 // 2 = 4 steps and one thinning interval (5) before the end
    assert "sgld: burn_in_epochs=3 leaves too few samples in 1 epochs; burn-in shortened to 3 steps" in caplog.text


def test_a_fine_tuned_ensemble_reinitialises_the_head_of_every_member():
    for name in ("ensemble", "multiswag"):
        cls = METHODS[name]
        run = RunInfo(epochs=2, pretrained=True, head=("fc.weight", "fc.bias", "head.proj.weight"))
        assert cls.run_options(run) == {"reinit": ["fc", "head.proj"]}
        assert cls.run_options(RunInfo(epochs=2, pretrained=True, head=("fc.weight",),
                                       options={"reinit": "all"})) == {}
        assert cls.run_options(RunInfo(epochs=2, head=("fc.weight",))) == {}  # from scratch: the constructor's


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("sgld", "laplace", "ensemble", "multiswag")])
def test_other_methods_take_the_run_options_as_given(method):
    assert METHODS[method].run_options(RunInfo(epochs=3, steps_per_epoch=5, pretrained=True, head=("fc.weight",))) \
        == {}


def test_a_config_checks_what_the_run_implies():
    with pytest.raises(ValueError, match="cyclical SGLD"):
        resolve(None, {"method": "sgld", "cycles": 2, "warmup_epochs": 1})
    assert resolve(None, {"method": "sgld", "cycles": 0}).init_arguments() == {"cycles": None}


def _method_names_in_branches(tree: ast.AST) -> list[str]:
    """Method names compared against, and method classes named, in a module's code."""
    names, classes = set(METHODS), {cls.__name__ for cls in METHODS.values()}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and sub.value in names:
                    found.append(f"line {node.lineno}: compares with {sub.value!r}")
        if isinstance(node, ast.Name) and node.id in classes:
            found.append(f"line {node.lineno}: names class {node.id}")
        if isinstance(node, ast.Attribute) and node.attr in classes:
            found.append(f"line {node.lineno}: names class {node.attr}")
        if isinstance(node, ast.ImportFrom) and any(a.name in classes for a in node.names):
            found.append(f"line {node.lineno}: imports a method class")
    return found


@pytest.mark.parametrize("path", sorted(APP.glob("*.py")), ids=lambda p: p.name)
def test_the_application_names_no_method(path):
    assert _method_names_in_branches(ast.parse(path.read_text(encoding="utf-8"))) == []


def test_import_bayeswrap_loads_no_application_module():
    code = ("import sys, bayeswrap; print(sorted(m for m in sys.modules if m.startswith('bayeswrap.app'))); "
            "bayeswrap.load_run; print('bayeswrap.app.runs' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(bayeswrap.__file__).parent.parent).stdout.split("\n")
    assert out[:2] == ["[]", "True"]
