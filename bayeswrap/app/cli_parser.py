"""The ``bayeswrap`` command line's parser, its help and the checks of a flag's value, without importing torch.

Everything here reads the option table (:func:`bayeswrap.app.cli_spec.load_spec`: the run options and every
method's options with their types, defaults, choices and help lines), so ``bayeswrap --help``, ``bayeswrap fit
--method laplace --help`` and the refusal of an unknown flag, an unknown method or a value of the wrong type take
a fraction of a second; :mod:`bayeswrap.app.cli` imports the library only for a command that runs.

``bayeswrap fit --help`` lists the run options shared by every method and the methods; ``bayeswrap fit --method
NAME --help`` adds NAME's own options, each with its type, default and choices.
"""

from __future__ import annotations

import argparse
import ast
from typing import Any

from bayeswrap.app.cli_spec import load_spec
from bayeswrap.app.values import Bounds, coerce_kind, did_you_mean, parse_bool, parse_number, unknown_name

__all__ = ["EXAMPLES", "make_parser", "parse", "check_args", "method_hint", "int_list"]

#: the commands the help shows as examples (the README's among them; a test runs each)
EXAMPLES = {
    "fit": ("bayeswrap fit --method laplace --epochs 5",
            "bayeswrap fit --method laplace --help",
            "bayeswrap fit -c configs/pets_resnet101.yaml --method vi --data-root data --download",
            "bayeswrap fit --model resnet18 --dataset pets --data-root data --download --pretrained --params "
            "last_layer --method laplace",
            "bayeswrap fit --resume runs/digits-mlp-laplace --epochs 10"),
    "compare": ("bayeswrap compare",
                "bayeswrap compare --dataset mnist5k --methods map,vi,laplace --num-samples 0,5",
                "bayeswrap compare --methods map,swag,ensemble --no-tune --epochs 5"),
    "evaluate": ("bayeswrap evaluate runs/digits-mlp-vi --num-samples 20",),
    "predict": ("bayeswrap predict runs/digits-mlp-vi digit.png --out predictions.csv",),
}

_TYPE = {"int": int, "float": float, "bool": bool, "str": str, "list": tuple, "mapping": dict, "any": None}
_METAVAR = {"int": "INT", "float": "FLOAT", "bool": "BOOL", "str": "STR", "list": "LIST", "mapping": "YAML",
            "any": "VALUE"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _examples(*commands: str) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for c in commands for line in EXAMPLES[c])


def _escape(text: str) -> str:
    return text.replace("%", "%%")


def _metavar(entry: dict) -> str:
    if entry["choices"]:
        return "{" + ",".join(entry["choices"]) + "}"
    if "|" in entry["annotation"]:  # e.g. int | float | str: the help line says which
        return "VALUE"
    return _METAVAR[entry["type"]]


def _method_list(spec: dict, width: int = 100) -> str:
    """One line per method: its name, class and what it is (cut to one line)."""
    lines = []
    for name, entry in spec["methods"].items():
        text = f"  {name:<16} {entry['class']}: {entry['summary']}"
        lines.append(text if len(text) <= width else text[:width - 3].rstrip() + "...")
    return "\n".join(lines)


class _Help(argparse.Action):
    """``-h/--help``: the help of the method given so far (``--method NAME`` before or after ``--help``)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        method = getattr(namespace, "method", None) or getattr(parser, "method_hint", None)
        methods = load_spec()["methods"]
        if method and method not in methods:
            parser.error(unknown_name("method", method, list(methods)))
        build = getattr(parser, "rebuild", None)
        shown = build(method) if build is not None and method else parser
        shown.print_help()
        parser.exit()


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=32, width=min(110, max(80, _terminal_width())))


def _terminal_width() -> int:
    import shutil

    return shutil.get_terminal_size((100, 24)).columns


def _add_run_options(parser: argparse.ArgumentParser, spec: dict, skip=()) -> None:
    """The run options of ``fit`` / ``compare`` (a flag each; an unset flag keeps the config's value)."""
    parser.add_argument("-c", "--config", metavar="CONFIG",
                        help="YAML file with option defaults (command-line flags override it)")
    group = parser
    for name, entry in spec["run_options"].items():
        if name in spec["groups"]:
            group = parser.add_argument_group(spec["groups"][name])
        if name in skip:
            continue
        help_text = _escape(f"{entry['help']} (default: {entry['default']})")
        if name == "amp":  # a bare --amp (the older boolean flag) is bf16
            group.add_argument(_flag(name), nargs="?", const="bf16", default=argparse.SUPPRESS, dest=name,
                               metavar="{none,bf16,fp16}", help=help_text)
        elif entry["type"] == "bool":
            group.add_argument(_flag(name), nargs="?", const="true", default=argparse.SUPPRESS, dest=name,
                               metavar="BOOL", help=help_text)
        else:
            metavar = "METHOD" if name == "method" else _metavar(entry)
            group.add_argument(_flag(name), default=argparse.SUPPRESS, dest=name, metavar=metavar, help=help_text)


def _add_method_options(parser: argparse.ArgumentParser, spec: dict, method: str | None) -> None:
    """Every method's options (a flag each, parsed for any method); those of ``method`` are shown in the help."""
    shown = spec["methods"].get(method, {}).get("options", {}) if method else {}
    if shown:
        group = parser.add_argument_group(
            f"{method} options ({spec['methods'][method]['class']}; an unset flag keeps the method's default)")
    added = set()
    for entry in (shown, *(m["options"] for m in spec["methods"].values())):
        for name, option in entry.items():
            if name in added or name in spec["run_options"]:
                continue
            added.add(name)
            visible = name in shown
            text = f"{option['help']} ({option['annotation'] or option['type']}; default: {option['default']})"
            kwargs = dict(default=argparse.SUPPRESS, dest=name, metavar=_metavar(option),
                          help=_escape(text) if visible else argparse.SUPPRESS)
            if option["type"] == "bool":
                kwargs.update(nargs="?", const="true")
            (group if visible else parser).add_argument(_flag(name), **kwargs)


def _fit_parser(sub, spec: dict, method: str | None):
    methods = "\n".join([
        "methods (--method NAME; 'bayeswrap fit --method NAME --help' lists NAME's own options with their types, "
        "defaults and choices):", _method_list(spec)])
    description = "Train one method and write a run folder (runs/<dataset>-<model>-<method>)."
    if method in spec["methods"]:
        description += f"\n\n{method}: {spec['methods'][method]['summary']}"
    p_fit = sub.add_parser(
        "fit", help="train one method and write a run folder", add_help=False, formatter_class=_Formatter,
        description=description, usage="bayeswrap fit [-h] [-c CONFIG] [--method METHOD] [--OPTION VALUE ...] "
        "[--resume RUN_DIR]", epilog=(methods + "\n\n" if method not in spec["methods"] else "") + _examples("fit"))
    p_fit.add_argument("-h", "--help", action=_Help, help="show this help (with --method NAME: NAME's options too)")
    _add_run_options(p_fit, spec)
    _add_method_options(p_fit, spec, method)
    p_fit.add_argument("--resume", metavar="RUN_DIR", default=None,
                       help="continue the run in RUN_DIR from its last checkpoint, with its own config.yaml; "
                            f"only these options may change: {', '.join(spec['resume_allowed'])}")
    return p_fit


def _compare_parser(sub, spec: dict):
    compared = spec["compare_methods"]
    others = [m for m in spec["methods"] if m not in compared]
    p_cmp = sub.add_parser(
        "compare", help="run several methods on the same data and split; write a table", add_help=False,
        formatter_class=_Formatter, usage="bayeswrap compare [-h] [-c CONFIG] [--methods M1,M2,...] "
        "[--num-samples S1,S2,...] [--no-tune] [--OPTION VALUE ...] [--resume COMPARE_DIR]",
        description="Run several methods on the same data and split (each tuned by validation NLL unless "
                    "--no-tune) and write comparison.md, comparison.csv and figures.",
        epilog="methods (a method's own options, e.g. --p-drop, are passed to the methods that take them; "
               "'bayeswrap fit --method NAME --help' lists them):\n" + _method_list(spec) + "\n\n" +
               _examples("compare"))
    p_cmp.add_argument("-h", "--help", action=_Help, help="show this help")
    _add_run_options(p_cmp, spec, skip=("method", "num_samples"))
    _add_method_options(p_cmp, spec, None)
    p_cmp.add_argument("--methods", default=",".join(compared), metavar="M1,M2,...",
                       help=f"comma-separated methods (default: {', '.join(compared)}; also: {', '.join(others)})")
    p_cmp.add_argument("--num-samples", default="0,5", dest="num_samples_list", metavar="S1,S2,...",
                       help="comma-separated posterior sample counts S (default: 0,5)")
    p_cmp.add_argument("--no-tune", action="store_false", dest="tune",
                       help="skip the tuning of each method's key option and prior std by validation NLL "
                            "(bayeswrap.evaluation.tuning); use the configured values")
    p_cmp.add_argument("--resume", metavar="COMPARE_DIR", default=None,
                       help="continue an interrupted comparison in COMPARE_DIR with its own compare.yaml (finished "
                            "methods are kept)")
    return p_cmp


def make_parser(method: str | None = None) -> argparse.ArgumentParser:
    """The ``bayeswrap`` parser (no torch import).

    Args:
        method: the method whose options ``fit --help`` shows (a ``--method`` on the command line takes
            precedence); None lists the methods instead.
    """
    spec = load_spec()
    parser = argparse.ArgumentParser(
        prog="bayeswrap", formatter_class=_Formatter,
        description="Bayesian fine-tuning of any PyTorch model: bayeswrap COMMAND --help shows a command's options.",
        epilog=_examples("fit", "compare", "evaluate", "predict"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="{fit,compare,evaluate,predict}")
    p_fit = _fit_parser(sub, spec, method)
    p_fit.method_hint = method

    def rebuild(name: str) -> argparse.ArgumentParser:
        return _fit_parser(argparse.ArgumentParser(prog="bayeswrap").add_subparsers(), spec, name)

    p_fit.rebuild = rebuild
    _compare_parser(sub, spec)
    p_ev = sub.add_parser("evaluate", help="re-evaluate a saved run (calibration, shift, OOD) with another number "
                                           "of samples", formatter_class=_Formatter, epilog=_examples("evaluate"))
    p_ev.add_argument("run_dir", help="a run folder written by fit/compare")
    p_ev.add_argument("--num-samples", default=None, help="S (default: the run's num_samples)")
    p_pr = sub.add_parser("predict", help="predict new inputs with a saved run: class, probabilities, entropy and "
                                          "mutual information per input, as CSV", formatter_class=_Formatter,
                          epilog=_examples("predict"))
    p_pr.add_argument("run_dir", help="a finished run folder written by fit/compare")
    p_pr.add_argument("inputs", help="an image file, a folder of images (searched recursively) or a .npy array of "
                                     "model inputs (N, *input_shape)")
    p_pr.add_argument("--num-samples", default=None, help="posterior samples S (default: the run's num_samples)")
    p_pr.add_argument("--out", default="predictions.csv", help="CSV file to write (default: predictions.csv); "
                                                               "written atomically, never inside RUN_DIR's files")
    p_pr.add_argument("--batch-size", default="128", help="inputs per forward pass (default: 128)")
    p_pr.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p_pr.add_argument("--device", default=None, help="device: auto, cpu, cuda, cuda:N or mps, where available "
                                                     "(default: the run's)")
    p_pr.add_argument("--seed", default="0", help="seed of the posterior samples, an integer in [0, 2^63 - 1] "
                                                  "(default: 0)")
    p_pr.add_argument("--allow-out-of-range", action="store_true",
                      help="predict array inputs far outside the training inputs' range (the run's data.json "
                           "input_range) with a warning instead of refusing them. Without it: inside the range, "
                           "nothing is said; beyond it by at most 10 times its width, a warning; beyond it by more, "
                           "or a value of magnitude above 2^24 (where float32 no longer holds every integer), an "
                           "error naming the file, its range and the recorded one")
    parser.subcommands = sub.choices
    return parser


def method_hint(argv: list[str]) -> str | None:
    """The value of the last ``--method`` in ``argv`` (for ``--help`` given before it), or None."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--method" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--method="):
            found = arg.split("=", 1)[1]
    return found


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, naming the closest flags for an unknown one (exit status 2)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = getattr(args, "command", None)
        target = parser.subcommands.get(command, parser)
        flags = [s for action in target._actions for s in action.option_strings if s.startswith("--")]
        unknown = [a for a in extra if a.startswith("-")]
        hints = "".join(did_you_mean(a.split("=", 1)[0], flags) for a in unknown)
        shown = " ".join(extra)
        target.error(f"unrecognized arguments: {shown}.{hints}" if hints else f"unrecognized arguments: {shown}")
    return args


def _default(entry: dict) -> Any:
    return ast.literal_eval(entry["default"])


def check_args(args: argparse.Namespace) -> None:
    """The checks of ``fit`` / ``compare`` flags that need no library: each value's type, range and choice, the method's
    name, and (for ``fit`` without a config file) that each method option is one of the method's.

    The messages are those of :func:`bayeswrap.app.config.resolve`, which checks the rest (values from config
    files, options that depend on each other, the method's constructor) after the library is imported.

    Raises:
        ValueError: naming the option, the value and the accepted ones (with the closest names for a name).
    """
    if args.command not in ("fit", "compare"):
        return
    spec = load_spec()
    methods = spec["methods"]
    given = vars(args)
    for name, entry in spec["run_options"].items():
        if name not in given:
            continue
        value = given[name]
        if entry["type"] in ("int", "float"):
            number = parse_number(name, value, _TYPE[entry["type"]], entry["accepted"] or "a float")
            if entry.get("bounds") and not Bounds(*entry["bounds"])(number):
                shown = value if entry["type"] == "int" else number  # as RunConfig words it: '0', 0.0
                raise ValueError(f"{name}={shown!r} is out of range; accepted: {entry['accepted']}")
        elif entry["type"] == "bool":
            parse_bool(name, value)
        elif entry["choices"] and name != "amp" and value not in entry["choices"]:
            raise ValueError(unknown_name(name, value, entry["choices"]))
    users: dict[str, list[str]] = {}
    for method, entry in methods.items():
        for name in entry["options"]:
            users.setdefault(name, []).append(method)
    kinds = {name: option["type"] for entry in methods.values() for name, option in entry["options"].items()}
    for name, kind in kinds.items():
        if name in given and name not in spec["run_options"]:
            coerce_kind(name, given[name], _TYPE[kind])
    if args.command == "compare":
        listed = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in listed if m not in methods]
        if unknown:
            hints = "".join(did_you_mean(m, list(methods)) for m in unknown)
            raise ValueError(f"--methods {','.join(unknown)} not known; accepted: {', '.join(methods)}" +
                             (f".{hints}" if hints else ""))
        return
    if args.resume is not None or args.config or "per_method" in given:
        return  # the method and its options may come from a file: resolve() checks them
    method = given.get("method", _default(spec["run_options"]["method"]))
    accepted = methods[method]["options"]
    for name in given:
        if name in users and name not in spec["run_options"] and name not in accepted:
            raise ValueError(f"{name} is not an option of method {method!r} (it is an option of "
                             f"{', '.join(users[name])}); accepted: {', '.join(accepted) or 'none'}")


def int_list(text: str) -> list[int]:
    """``--num-samples 0,5`` as ``[0, 5]``.

    Raises:
        ValueError: naming the flag, for anything but comma-separated integers >= 0.
    """
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--num-samples {text!r} must be comma-separated integers, e.g. 0,5") from None
    if not values or min(values) < 0:
        raise ValueError(f"--num-samples {text!r} must list integers >= 0")
    return values
