"""The command line's help and option errors: fast (no torch import), per method, with choices and close names.

``--help``, an unknown flag, an unknown method and a value of the wrong type are answered from the committed
option table (``bayeswrap/app/cli_spec.json``), which must equal what the live classes give.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bayeswrap.app import cli
from bayeswrap.app.cli_parser import EXAMPLES
from bayeswrap.app.cli_spec import REGENERATE, SPEC_PATH, build_spec, load_spec, plain_text, render_spec
from bayeswrap.app.config import FIELDS, RANGES, resolve
from bayeswrap.app.values import Bounds

ROOT = Path(__file__).parents[1]


def test_the_committed_option_table_is_what_the_classes_give():
    live = render_spec(build_spec())
    assert SPEC_PATH.read_text(encoding="utf-8") == live, (
        f"{SPEC_PATH} is out of date with the method classes and RunConfig; regenerate it with: {REGENERATE}")


def test_the_option_table_reads_choices_from_the_classes():
    methods = json.loads(SPEC_PATH.read_text(encoding="utf-8"))["methods"]
    laplace = methods["laplace"]["options"]
    assert laplace["curvature"]["choices"] == ["ggn", "fisher", "empirical_fisher"]
    assert laplace["pred_type"]["choices"] == ["glm", "nn"]
    assert laplace["hessian_structure"]["choices"] == ["diag", "kron", "full"]
    assert methods["mc_dropout"]["options"]["mode"]["choices"] == ["params", "layers"]
    assert methods["swag"]["options"]["swa_start"]["choices"] is None  # also takes numbers
    assert methods["vi"]["options"]["init_std"] == {
        "type": "float", "annotation": "float", "default": "0.001", "choices": None, "target": "init",
        "help": methods["vi"]["options"]["init_std"]["help"]}


def test_plain_text_strips_rest_markup():
    assert plain_text('``"glm"`` (:class:`~bayeswrap.methods.laplace.glm.GLM`), see :data:`AUTO`\n  and '
                      ':meth:`predict`') == '"glm" (GLM), see AUTO and predict'


_NO_TORCH = """
import sys
from bayeswrap.app import cli
codes = []
for argv in {argvs!r}:
    try:
        codes.append(cli.main(argv))
    except SystemExit as exit:
        codes.append(exit.code)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "torchvision", "timm", "numpy")
               or m.startswith("bayeswrap.methods"))
print(codes, heavy)
"""


def test_help_and_option_errors_import_no_torch():
    argvs = [["--help"], ["fit", "--help"], ["fit", "--method", "laplace", "--help"], ["compare", "--help"],
             ["evaluate", "--help"], ["predict", "--help"], ["fit", "--method", "swa"], ["fit", "--epohcs", "3"],
             ["fit", "--epochs", "abc"], ["fit", "--p-drop", "0.2"], ["compare", "--methods", "map,swa"],
             ["fit", "--method", "laplace", "--curvature-samples", "x"], ["fit", "--optimizer", "adam"],
             ["fit", "--epochs", "0"], ["compare", "--momentum", "1"], ["fit", "--prior-std", "1e20"],
             ["fit", "--lr", "nan"]]
    result = subprocess.run([sys.executable, "-c", _NO_TORCH.format(argvs=argvs)], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    codes, heavy = result.stdout.strip().splitlines()[-1].split("] ")
    assert codes == "[" + ", ".join(["0"] * 6 + ["2"] * 11) and heavy == "[]", result.stdout[-2000:]
    err = result.stderr
    for message in ("method='swa' is not known; accepted: map, vi, ", "Did you mean: swag?",
                    "unrecognized arguments: --epohcs 3. Did you mean: --epochs",
                    "epochs='abc' is not an integer; accepted: an integer >= 1",
                    "p_drop is not an option of method 'vi' (it is an option of mc_dropout)",
                    "--methods swa not known; accepted: map, vi,", "curvature_samples='x' is not an integer",
                    "optimizer='adam' is not known; accepted: sgd, adamw. Did you mean: adamw?",
                    # ranges: the same words as RunConfig's check after the library is imported
                    "epochs='0' is out of range; accepted: an integer >= 1",
                    "momentum=1.0 is out of range; accepted: a number in [0, 1)",
                    "prior_std=1e+20 is out of range; accepted: a number in [1e-18, 1e+18]",
                    "lr=nan is out of range; accepted: a finite number > 0"):
        assert message in err, message


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    assert exit.value.code == 0
    return capsys.readouterr().out


def test_fit_help_is_short_and_per_method_help_lists_the_methods_options(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width: the same count wherever it runs
    plain = _help(["fit", "--help"], capsys)
    laplace = _help(["fit", "--method", "laplace", "--help"], capsys)
    before = _help(["fit", "--help", "--method", "laplace"], capsys)  # --method after --help: the same help
    assert before == laplace
    assert len(plain.splitlines()) < 200 and "--curvature" not in plain and "--p-drop" not in plain
    assert "'bayeswrap fit --method NAME --help' lists NAME's own options" in " ".join(plain.split())
    assert re.search(r"^  laplace +Laplace: ", plain, re.M) and re.search(r"^  swag +SWAG: ", plain, re.M)
    laplace = " ".join(laplace.split())  # as one line, wherever the terminal's width wraps it
    assert "--curvature {ggn,fisher,empirical_fisher}" in laplace
    assert "--hessian-structure {diag,kron,full}" in laplace and "(str; default: 'diag')" in laplace
    assert "--curvature-chunk-size INT" in laplace and "(int; default: 32)" in laplace
    assert "--p-drop" not in laplace and "--swa-start" not in laplace  # other methods' options
    assert "--optimizer {sgd,adamw}" in laplace and "--dataset {digits," in laplace  # the shared options
    with pytest.raises(SystemExit) as exit:  # a misspelt method: its name, not the generic help
        cli.main(["fit", "--method", "lapalce", "--help"])
    assert exit.value.code == 2 and "Did you mean: laplace?" in capsys.readouterr().err
    for text in (plain, laplace, _help(["fit", "--method", "swag", "--help"], capsys)):
        assert "``" not in text and ":class:" not in text and ":data:" not in text and "examples:" in text


def _readme_commands() -> list[str]:
    """The ``bayeswrap`` commands of README.md's bash blocks (each part of a ``&&`` chain; no ``.venv/bin/``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    parts = [part.strip().split("/bin/", 1)[-1] for block in re.findall(r"```bash\n(.*?)```", readme, re.S)
             for line in block.splitlines() for part in line.split("&&")]
    return [p for p in parts if p == "bayeswrap" or p.startswith("bayeswrap ")]


def test_the_readme_commands_are_in_the_help_examples():
    commands = _readme_commands()
    examples = {e for lines in EXAMPLES.values() for e in lines}
    assert "bayeswrap compare" in commands and len(commands) >= 3  # the quick start's and the CLI section's
    assert set(commands) <= examples, set(commands) - examples


def _examples() -> list[str]:
    runnable = [e for lines in EXAMPLES.values() for e in lines if e.split()[1] in ("fit", "compare")]
    return list(dict.fromkeys([*_readme_commands(), *runnable]))


@pytest.mark.parametrize("command", [c for c in _examples() if "--help" not in c and "--resume" not in c])
def test_each_example_passes_every_check_before_loading_data(command, data_loads, monkeypatch, tmp_path, capsys):
    """Each README and help example: parsed, resolved and preflighted; the patched loader is what stops it."""
    monkeypatch.chdir(ROOT)  # the examples' config files are relative to the repository
    rc = cli.main([*command.split()[1:], "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert rc == 1 and "load_data was called" in err and data_loads == ["load_data"], err


def test_every_subcommand_has_help(capsys):
    for argv in (["--help"], ["fit", "--help"], ["compare", "--help"], ["evaluate", "--help"], ["predict", "--help"]):
        text = _help(argv, capsys)
        assert text.startswith("usage: bayeswrap") and "examples:" in text, argv


@pytest.mark.parametrize("name", sorted(RANGES))
def test_the_early_range_check_equals_the_config_check_at_and_beside_each_bound(name):
    """Each declarative bound is checked alike by the command line (from cli_spec.json) and by RunConfig."""
    bounds, _ = RANGES[name]
    entry = load_spec()["run_options"][name]
    assert Bounds(*entry["bounds"]) == bounds
    is_int = isinstance(FIELDS[name].default, int)
    edges = [b for b in (bounds.low, bounds.high) if b is not None]
    for edge in edges:
        beside = (edge - 1, edge, edge + 1) if is_int else (edge * (1 - 1e-9) - 1e-12, edge, edge * (1 + 1e-9) + 1e-12)
        for value in beside:
            early = Bounds(*entry["bounds"])(value)
            try:
                resolve(None, {name: value, **({"epochs": 10} if name == "warmup_epochs" else {})})
                late = True
            except ValueError as err:
                assert "out of range" in str(err) and name in str(err), str(err)
                late = False
            assert early == late, (name, value)


_WAIT_POLICY = """
import os, sys
from bayeswrap.app import cli
try:
    cli.main(["--help"])
except SystemExit:
    pass
print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


@pytest.mark.parametrize("policy, spins, expected", [(None, None, ["PASSIVE", "1000"]), ("ACTIVE", None, ["ACTIVE", "None"]),
                                                    ("PASSIVE", None, ["PASSIVE", "None"]),
                                                    (None, "50", ["PASSIVE", "50"])])
def test_the_command_line_sets_a_passive_openmp_wait_policy_unless_the_user_set_one(policy, spins, expected):
    """Idle OpenMP threads must sleep after a short spin, not spin on shared cores (issue 34, figures/
    thread_contention.md: compare beside another 2-thread torch process took 3.0x its time alone with spinning
    threads, 1.70x with this default; PASSIVE alone was 1.31x slower than it); set before torch loads, never
    over the user's own setting."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update({k: v for k, v in (("OMP_WAIT_POLICY", policy), ("GOMP_SPINCOUNT", spins)) if v is not None})
    result = subprocess.run([sys.executable, "-c", _WAIT_POLICY], capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=120)
    assert result.stdout.split()[-3:] == [*expected, "False"], result.stdout + result.stderr[-2000:]
