"""The command line's option table, generated from the live classes and committed as ``cli_spec.json``.

``bayeswrap --help``, ``bayeswrap fit --method laplace --help`` and the option errors (an unknown flag, an unknown
method, a value of the wrong type) need the names, types, defaults, choices and help lines of every run option
(:class:`~bayeswrap.app.config.RunConfig`) and of every method's options (:mod:`bayeswrap.app.options`, read from
the constructors). Reading them from the classes imports torch and every method (about 5 s); this module writes
them once into ``bayeswrap/app/cli_spec.json``, which the command line reads in milliseconds. A test asserts that
the committed file equals what the live classes give; after changing a method's options or a run option,
regenerate it with::

    python -m bayeswrap.app.cli_spec

Where the method classes are already imported (a Python session, the tests, a method registered at run time),
:func:`load_spec` builds the table from them instead, so nothing registered since the file was written is missed.
"""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["SPEC_PATH", "REGENERATE", "build_spec", "load_spec", "render_spec", "plain_text"]

#: the committed table
SPEC_PATH = Path(__file__).with_name("cli_spec.json")
#: the command that rewrites it
REGENERATE = "python -m bayeswrap.app.cli_spec"

#: the first run option of each group of ``bayeswrap fit --help`` (RunConfig's fields are in this order)
_GROUPS = {"dataset": "data", "model": "model", "method": "inference method", "epochs": "optimisation",
           "shift_rotations": "evaluation under shift and out of distribution", "out_dir": "output"}


def plain_text(text: str) -> str:
    """``text`` with its reStructuredText roles and literals as plain text, on one line.

    ``:class:`~a.b.C``` -> ``C``, ``:data:`X``` -> ``X``, double-backquoted literals lose their quotes.
    """
    text = re.sub(r":\w+:`(~?)([^`]+)`",
                  lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return " ".join(text.replace("``", "").split())


def _shown(value: Any) -> str:
    """A default as ``--help`` shows it: a mapping in YAML flow style, anything else by ``repr``."""
    if isinstance(value, dict):
        import yaml

        return yaml.safe_dump(value, default_flow_style=True).strip()
    return repr(value)


def _kind_name(kind: type | None) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", tuple: "list", dict: "mapping"}.get(kind, "any")


def _annotation(cls: type, argument: str) -> str:
    """The annotation of ``argument`` in the first constructor along ``cls``'s MRO that takes it (as written)."""
    import inspect

    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            p = inspect.signature(klass.__init__).parameters.get(argument)
            if p is not None and p.annotation is not p.empty:
                return str(p.annotation) if not isinstance(p.annotation, type) else p.annotation.__name__
    run = getattr(cls, "run_chains", None)
    if run is not None:
        p = inspect.signature(run).parameters.get(argument)
        if p is not None and p.annotation is not p.empty:
            return str(p.annotation) if not isinstance(p.annotation, type) else p.annotation.__name__
    return ""


def _choices(method: str, name: str, spec, annotation: str) -> list[str] | None:
    """The values of a string option that takes one of a few names, or None.

    The candidates are the quoted names its help line lists (``"glm"``, ``"nn"``); they are the choices where the
    annotation is exactly ``str``, the constructor refuses a name outside them, and accepts each of them on a
    two-weight stand-in model.
    """
    if annotation != "str" or spec.target != "init" or not isinstance(spec.default, str):
        return None
    candidates = list(dict.fromkeys(re.findall(r'``"([A-Za-z0-9_]+)"``', spec.help)))
    if spec.default not in candidates:
        return None
    import warnings

    import torch

    from bayeswrap.methods import wrap

    def builds(value: str) -> bool:
        stand_in = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                wrap(stand_in, method, num_data=10, **{spec.argument: value})
        except ImportError:
            return True  # a choice that needs an optional package (hmc's kernel="nuts": pyro-ppl)
        except (ValueError, TypeError) as err:
            return name not in str(err) and value not in str(err)  # refused for another reason: not this value
        return True

    if builds("__not_a_choice__"):
        return None
    return [c for c in candidates if builds(c)] or None


def build_spec() -> dict[str, Any]:
    """The option table from the live classes (imports torch and every method).

    Returns:
        ``{"run_options": {name: entry}, "groups": {first option: title}, "methods": {name: {"class", "summary",
        "options": {name: entry}, "in_default_comparison"}}, "compare_methods": [...], "resume_allowed": [...]}``;
        an entry holds ``type`` (``int``, ``float``, ``bool``, ``str``, ``list``, ``mapping`` or ``any``: how a
        value is read), ``annotation`` (as the constructor writes it), ``default`` (as ``--help`` shows it),
        ``help`` (plain text), ``choices`` (or None) and, for run options, ``accepted`` (the accepted values in
        words, as the error messages say them) or None and ``bounds`` (``Bounds.as_list()`` of the accepted
        interval) or None.
    """
    import dataclasses

    from bayeswrap.app.config import CHOICES, FIELDS, RANGES, RESUME_ALLOWED
    from bayeswrap.app.options import _kind, option_specs
    from bayeswrap.methods import METHODS
    from bayeswrap.methods.registry import summary

    run_options = {}
    for name, f in FIELDS.items():
        if name == "method_options":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = list(CHOICES[name]) if name in CHOICES else list(METHODS) if name == "method" else None
        run_options[name] = {"type": _kind_name(type(default)), "annotation": _kind_name(type(default)),
                             "default": _shown(default), "help": plain_text(f.metadata["help"]),
                             "choices": choices, "accepted": RANGES[name][1] if name in RANGES else None,
                             "bounds": RANGES[name][0].as_list() if name in RANGES else None}
    methods = {}
    for method, cls in METHODS.items():
        options = {}
        for name, spec in option_specs(method).items():
            annotation = _annotation(cls, spec.argument)
            options[name] = {"type": _kind_name(_kind(name)), "annotation": annotation,
                             "default": _shown(spec.default), "help": plain_text(spec.help),
                             "choices": _choices(method, name, spec, annotation), "target": spec.target}
        methods[method] = {"class": cls.__name__, "summary": plain_text(summary(cls)), "options": options,
                           "in_default_comparison": bool(getattr(cls, "in_default_comparison", False))}
    return {"run_options": run_options, "groups": dict(_GROUPS), "methods": methods,
            "compare_methods": [m for m, entry in methods.items() if entry["in_default_comparison"]],
            "resume_allowed": list(RESUME_ALLOWED)}


def render_spec(spec: dict[str, Any]) -> str:
    """The text of ``cli_spec.json`` for ``spec`` (stable: sorted as built, two-space indent, final newline)."""
    return json.dumps(spec, indent=1, ensure_ascii=False) + "\n"


@cache
def _committed() -> dict[str, Any]:
    try:
        return json.loads(SPEC_PATH.read_text(encoding="utf-8"))
    except FileNotFoundError:  # an installation without the package data: slower, still right
        return build_spec()


@cache
def _live(methods: tuple[tuple[str, type], ...]) -> dict[str, Any]:
    return build_spec()


def load_spec() -> dict[str, Any]:
    """The option table: built from the live classes where :mod:`bayeswrap.methods` is already imported (no cost,
    and a method registered at run time is included), else read from the committed ``cli_spec.json`` (no torch).
    """
    registry = sys.modules.get("bayeswrap.methods.registry")
    if registry is not None and getattr(registry, "METHODS", None):
        return _live(tuple(registry.METHODS.items()))
    return _committed()


if __name__ == "__main__":
    SPEC_PATH.write_text(render_spec(build_spec()), encoding="utf-8")
    print(f"wrote {SPEC_PATH}")
