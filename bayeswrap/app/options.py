"""Method options on the command line, read from the method classes: never mirrored.

Every keyword-only option of a registered method's constructor (through its
class hierarchy) becomes a run option and a ``--flag`` of ``bayeswrap fit`` and
``compare``: its default, its type and its help text are the constructor's
default, the default's type and the line of the class docstring's ``Args:``
section. Full-batch samplers also expose the options of their ``run_chains``
(``num_samples`` as ``chain_samples``, so that it does not clash with the
predictive's S). An option the user does not set is not passed at all, so the
library default applies: the command line cannot drift from the library.

The options shared by every method (``num_data``, ``prior_std``, ``prior_mean``,
``bias``, ``params``, ``likelihood``, ``noise_std``, ``kl_weight``,
``chunk_size``) are run-config fields or set by the run itself.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from bayeswrap.app.values import StrictLoader, YAMLAliasError, coerce_kind, parse_bool

__all__ = ["OptionSpec", "option_specs", "all_option_specs", "coerce_option", "option_users", "parse_bool",
           "SAMPLER_RENAMES", "StrictLoader", "YAMLAliasError"]

#: ``run_chains`` argument -> run option name (``num_samples`` is the predictive's S on the command line)
SAMPLER_RENAMES = {"num_samples": "chain_samples"}
#: ``run_chains`` arguments that are not run options (they come from the run itself)
_SAMPLER_SKIP = ("generator", "init", "inputs", "targets")


@dataclass(frozen=True)
class OptionSpec:
    """One method option as the command line sees it.

    Attributes:
        name: the run option (and ``--flag`` with ``_`` as ``-``).
        default: the library default (the constructor's or ``run_chains``'s).
        help: the docstring's description of the argument.
        target: ``"init"`` (a constructor argument) or ``"run"`` (a ``run_chains`` argument).
        argument: the argument's name in the constructor or in ``run_chains``.
    """

    name: str
    default: Any
    help: str
    target: str = "init"
    argument: str = ""


def _docstring_args(obj) -> dict[str, str]:
    """``{argument: description}`` from the ``Args:`` sections of a Google-style docstring."""
    doc = inspect.getdoc(obj) or ""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "Args:":
            base = name = None
            first = False
            i += 1
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                line = lines[i]
                indent = len(line) - len(line.lstrip())
                m = re.match(r"\s+(\*{0,2}\w+)(?: \([^)]*\))?: ?(.*)", line)
                if line.strip() and (base is None or indent <= base) and m:
                    base, name = indent, m.group(1)
                    first = name not in out
                    out.setdefault(name, m.group(2).strip())
                elif line.strip() and name is not None and first:
                    out[name] = f"{out[name]} {line.strip()}"
                i += 1
        else:
            i += 1
    return out


def _help(cls: type, argument: str, extra=()) -> str:
    for obj in [*extra, *cls.__mro__]:
        if obj is object:
            continue
        text = _docstring_args(obj).get(argument)
        if text:
            return " ".join(text.split())
    return ""


def option_specs(method: str) -> dict[str, OptionSpec]:
    """The run options of ``method`` derived from its class, ``{name: OptionSpec}``.

    Raises:
        KeyError: for an unregistered method.
    """
    from bayeswrap.methods import METHODS

    return dict(_class_specs(METHODS[method], method))


@cache
def _class_specs(cls: type, method: str) -> dict[str, OptionSpec]:
    from bayeswrap.methods import method_option_defaults

    specs = {name: OptionSpec(name, default, _help(cls, name), "init", name)
             for name, default in method_option_defaults(method).items()}
    run = getattr(cls, "run_chains", None)
    if run is not None:
        for p in inspect.signature(run).parameters.values():
            if p.kind is not p.KEYWORD_ONLY or p.name in _SAMPLER_SKIP or p.name in specs:
                continue
            name = SAMPLER_RENAMES.get(p.name, p.name)
            specs[name] = OptionSpec(name, p.default, _help(cls, p.name, extra=(run,)), "run", p.name)
    return specs


def all_option_specs() -> dict[str, OptionSpec]:
    """Every registered method's options, the first spec of each name (the flags of the command line)."""
    from bayeswrap.methods import METHODS

    out: dict[str, OptionSpec] = {}
    for method in METHODS:
        for name, spec in option_specs(method).items():
            out.setdefault(name, spec)
    return out


def option_users() -> dict[str, tuple[str, ...]]:
    """``{option: the methods that take it}`` for every method option."""
    from bayeswrap.methods import METHODS

    users: dict[str, list[str]] = {}
    for method in METHODS:
        for name in option_specs(method):
            users.setdefault(name, []).append(method)
    return {k: tuple(v) for k, v in users.items()}


def _kind(name: str) -> type | None:
    """The type of an option's value, from the library defaults (None where a default is None)."""
    from bayeswrap.methods import METHODS

    kinds = {type(specs[name].default) for specs in map(option_specs, METHODS) if name in specs
             and specs[name].default is not None}
    if not kinds:
        return None
    if kinds == {int, float}:
        return float
    return kinds.pop() if len(kinds) == 1 else None


def coerce_option(name: str, value: Any) -> Any:
    """A method option's command-line or YAML value as the type of its library default.

    Integers accept integral numbers (``3``, ``3.0``, ``"1e3"``), never booleans
    or fractions; booleans accept true/false/yes/no/on/off/1/0; a string option
    given a number (an unquoted YAML ``swa_start: 0.3``) gets its text, as the
    command line passes it, for the method to parse; tuples accept a
    YAML list (``[250, 250]``); options whose default is None take any YAML
    scalar. The range is checked by the method's constructor (see
    :meth:`RunConfig.validate`).

    Raises:
        ValueError: for an unknown option or a value of the wrong type, naming
            the option, the value and what is accepted.
    """
    users = option_users()
    if name not in users:
        raise ValueError(f"unknown method option {name!r}; accepted: {', '.join(users)}")
    if value is None:
        raise ValueError(f"{name}=None (an empty value) is not valid; give a value or leave the option out to "
                         f"use the method's default")
    return coerce_kind(name, value, _kind(name))
