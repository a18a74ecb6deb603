"""Reading option values from the command line and YAML files: booleans, numbers, YAML scalars, names.

Pure Python and PyYAML (no torch), so that the command line checks a flag's value before it imports the library;
:mod:`bayeswrap.app.config` and :mod:`bayeswrap.app.options` read values with the same functions, so the messages
are the same wherever a value is refused.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["Bounds", "StrictLoader", "YAMLAliasError", "parse_bool", "parse_scalar", "parse_number", "coerce_kind",
           "did_you_mean", "unknown_name"]


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


def parse_scalar(text: str) -> Any:
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


@dataclass(frozen=True)
class Bounds:
    """The accepted interval of a numeric run option, as data (so the command line checks it without torch).

    ``Bounds(low, high, low_open, high_open)(v)`` is ``low <= v <= high``, with ``<`` on an open side and no
    bound where ``low`` or ``high`` is None; a non-finite ``v`` is outside every interval.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __call__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def as_list(self) -> list:
        """``[low, high, low_open, high_open]``, as the option table stores it."""
        return [self.low, self.high, self.low_open, self.high_open]


def parse_number(name: str, value: Any, kind: type, accepted: str) -> int | float:
    """A run option's number from a YAML or command-line value: an integer for ``kind`` int (integral numbers such
    as ``3.0`` and ``"1e3"`` too, never NaN, infinities or fractions), a float (NaN and infinities included, for
    the range check to refuse) for ``kind`` float.

    Raises:
        ValueError: ``"{name}={value!r} is not an integer; accepted: {accepted}"`` (or ``a number``).
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if kind is int:
        if number is None or not math.isfinite(number) or not number.is_integer():
            raise ValueError(f"{name}={value!r} is not an integer; accepted: {accepted}")
        return int(number) if not isinstance(value, int) else value
    if number is None:
        raise ValueError(f"{name}={value!r} is not a number; accepted: {accepted}")
    return number


def coerce_kind(name: str, value: Any, kind: type | None) -> Any:
    """A method option's command-line or YAML value as ``kind``, the type of its library default (None: any).

    See :func:`bayeswrap.app.options.coerce_option`.

    Raises:
        ValueError: for a value of the wrong type, naming the option, the value and what is accepted.
    """
    if isinstance(value, str) and kind is not str:
        value = parse_scalar(value)
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


def did_you_mean(value: str, names: Sequence[str], prefix: str = "") -> str:
    """`` Did you mean: a, b?`` naming the names closest to ``value`` (:func:`difflib.get_close_matches`), or ``""``."""
    close = difflib.get_close_matches(str(value), list(names), n=3, cutoff=0.6)
    return f" Did you mean: {', '.join(prefix + c for c in close)}?" if close else ""


def unknown_name(name: str, value: Any, accepted: Sequence[str]) -> str:
    """The message for a value outside a fixed set: ``"{name}={value!r} is not known; accepted: a, b"``, with the
    closest names suggested.
    """
    hint = did_you_mean(str(value), accepted)
    return f"{name}={value!r} is not known; accepted: {', '.join(accepted)}" + (f".{hint}" if hint else "")
