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
import math
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

import yaml

from bayeswrap.methods import METHODS, method_option_defaults

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
    return dict(_class_specs(METHODS[method], method))


@cache
def _class_specs(cls: type, method: str) -> dict[str, OptionSpec]:
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
    out: dict[str, OptionSpec] = {}
    for method in METHODS:
        for name, spec in option_specs(method).items():
            out.setdefault(name, spec)
    return out


def option_users() -> dict[str, tuple[str, ...]]:
    """``{option: the methods that take it}`` for every method option."""
    users: dict[str, list[str]] = {}
    for method in METHODS:
        for name in option_specs(method):
            users.setdefault(name, []).append(method)
    return {k: tuple(v) for k, v in users.items()}


def _kind(name: str) -> type | None:
    """The type of an option's value, from the library defaults (None where a default is None)."""
    kinds = {type(specs[name].default) for specs in map(option_specs, METHODS) if name in specs
             and specs[name].default is not None}
    if not kinds:
        return None
    if kinds == {int, float}:
        return float
    return kinds.pop() if len(kinds) == 1 else None


def parse_bool(name: str, value: Any) -> bool:
    """A boolean option of the command line or a YAML file: True/False, or the text or integer
    true/yes/on/1 and false/no/off/0 (any case).

    Raises:
        ValueError: naming the option and the value, for anything else (other numbers, lists, None, ...).
    """
    if isinstance(value, bool):
        return value
    if not isinstance(value, (str, int)):
        raise ValueError(f"{name}={value!r} is not a boolean; accepted: true, false (also yes/no, on/off, 1/0)")
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; accepted: true, false (also yes/no, on/off, 1/0)")


class YAMLAliasError(yaml.composer.ComposerError):
    """A YAML anchor (``&name``) or alias (``*name``): refused, since bayeswrap's files and values never need one
    and aliases nested in aliases expand exponentially (a 1.5 KB "billion laughs" file exhausts memory).
    """


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses anchors and aliases, and a mapping with a duplicate key (PyYAML keeps the
    last one silently).

    Anchors and aliases are refused while the document is parsed, before any node is built, so an alias bomb
    fails at its first anchor in constant memory.
    """

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            what = "alias" if isinstance(event, yaml.AliasEvent) else "anchor"
            sign = "*" if what == "alias" else "&"
            raise YAMLAliasError(None, None, f"YAML {what} {sign}{event.anchor} is not accepted (anchors and "
                                 f"aliases are refused; write the value out)", event.start_mark)
        return super().compose_node(parent, index)


def _no_duplicates(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicates)


def _parse_scalar(text: str) -> Any:
    """A command-line string as a number where it spells one (``1e-3`` too, which YAML 1.1 reads as text), else
    as a YAML value (``true``, ``[250, 250]``; no anchors or aliases, see :class:`StrictLoader`), else the text
    itself.
    """
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    try:
        parsed = yaml.load(text, Loader=StrictLoader)
    except YAMLAliasError as err:
        raise ValueError(f"{text[:60]!r}{'...' if len(text) > 60 else ''}: {err.problem}") from None
    except yaml.YAMLError:
        return text
    return text if parsed is None else parsed


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
    kind = _kind(name)
    if isinstance(value, str) and kind is not str:
        value = _parse_scalar(value)
    if kind is bool:
        return parse_bool(name, value)
    if kind is int or kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}={value!r} is not {'an integer' if kind is int else 'a number'}")
        if kind is int:
            if not (math.isfinite(value) and float(value).is_integer()):
                raise ValueError(f"{name}={value!r} is not an integer")
            return int(value)
        return float(value)
    if kind is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}={value!r} is not a list; accepted: a YAML list such as [250, 250]")
        return tuple(value)
    if kind is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = repr(value)  # an unquoted YAML number: the text the command line passes (e.g. swa_start 0.33)
        if not isinstance(value, str):
            raise ValueError(f"{name}={value!r} is not a string")
        return value
    return value
