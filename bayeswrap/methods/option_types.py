"""The types of the methods' own options, read from their constructors' annotations and checked before use.

:func:`bayeswrap.wrap` (and an ensemble, for its ``member_kwargs``) calls :func:`check_option_types` before it
builds the method, so that an option of the wrong kind (``flow_hidden=10`` for a tuple of widths) is refused
naming the method, the option, the value, its type and the expected type, instead of failing inside the
constructor with an error such as ``TypeError: 'int' object is not iterable``.

The check is about kinds, not values: each option's own check (:mod:`bayeswrap.core.checks`) still refuses a
value of the right kind that is out of range. A refusal from ``bw.wrap`` also quotes that check's message when it
names the option (its accepted values, e.g. ``'auto' or an integer >= 0`` where the annotation says ``int | str``).
The rules:

* ``int`` accepts every real number but bools (``3.0``, a numpy integer, a 0-d tensor: the option's
  ``check_int`` then refuses ``2.5``, NaN or inf with its range); ``float`` accepts every real number but bools
  (ints included); ``bool`` accepts ``True``/``False``, numpy booleans and 0-d boolean tensors;
* ``str`` a string, ``None`` only ``None``, ``Literal[...]`` one of its values, a union any of its members;
* ``tuple[T, ...]``, ``tuple[T1, T2]``, ``list[T]`` and ``Sequence[T]`` a tuple or a list (never a string) of
  that length whose items match; ``dict``/``Mapping`` a mapping; another class an instance of it;
* an annotation that is missing, cannot be resolved or is of another form (``Callable``, a type alias of the
  ``TYPE_CHECKING`` block, ``Any``) is not checked.
"""

from __future__ import annotations

import collections.abc
import inspect
import numbers
import sys
import types
import typing
import warnings
from collections.abc import Callable, Mapping

import numpy as np
import torch

__all__ = ["check_option_types", "describe", "matches", "option_annotations"]

#: the result of :func:`matches` for an annotation it does not check
UNCHECKED = None
_SEQUENCES = (tuple, list, collections.abc.Sequence)


def option_annotations(cls: type) -> dict[str, object]:
    """``{option: resolved annotation}`` of a method class's own keyword options (as
    :func:`~bayeswrap.methods.registry.method_options`), along its constructors' MRO; options without an
    annotation, or whose annotation does not resolve, are left out.
    """
    from bayeswrap.methods.base import COMMON_OPTIONS, BayesianModel  # base imports the registry

    found: dict[str, object] = {}
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass is BayesianModel or "__init__" not in vars(klass):
            continue
        namespace = vars(sys.modules[klass.__module__])
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is not p.KEYWORD_ONLY or p.name in COMMON_OPTIONS or p.name in seen:
                continue
            seen.add(p.name)  # the most derived constructor's annotation counts
            annotation = p.annotation
            if annotation is p.empty:
                continue
            if isinstance(annotation, str):
                try:
                    annotation = eval(annotation, dict(namespace))  # noqa: S307 (the package's own annotation)
                except Exception:  # an alias of a TYPE_CHECKING block, a forward reference: not checked
                    continue
            found[p.name] = annotation
    return found


def _real(value) -> bool:
    """A real number that is not a bool: Python or numpy scalars, 0-d real tensors and arrays."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and value.dtype != torch.bool and not value.is_complex()
    if isinstance(value, np.ndarray):
        return value.ndim == 0 and value.dtype.kind in "iuf"
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _boolean(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and value.dtype == torch.bool
    return isinstance(value, (bool, np.bool_))


def matches(value, annotation) -> bool | None:
    """Whether ``value`` is of the kind ``annotation`` names (the module's rules); ``None`` where it is not checked."""
    if annotation is typing.Any or annotation is object:
        return UNCHECKED
    if annotation is None or annotation is type(None):
        return value is None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(annotation, types.UnionType)):
        results = [matches(value, a) for a in args]
        return True if any(r is not False for r in results) else False
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if annotation is bool:
        return _boolean(value)
    if annotation is int or annotation is float:
        return _real(value)
    if annotation is str:
        return isinstance(value, str)
    if origin in _SEQUENCES or annotation in _SEQUENCES:
        if not isinstance(value, (tuple, list)):
            return False
        if not args:
            return True
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                return False
            results = [matches(v, a) for v, a in zip(value, args)]
        else:
            results = [matches(v, args[0]) for v in value]
        return all(r is not False for r in results)
    if origin in (dict, Mapping, collections.abc.Mapping) or annotation in (dict, Mapping, collections.abc.Mapping):
        return isinstance(value, Mapping)
    if isinstance(annotation, type) and origin is None:
        return isinstance(value, annotation)
    return UNCHECKED


def describe(annotation) -> str:
    """The kind an annotation accepts, in words: ``int | None`` → ``"None or an integer"``."""
    if annotation is None or annotation is type(None):
        return "None"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(annotation, types.UnionType)):
        parts = [describe(a) for a in args]
        parts.sort(key=lambda p: p != "None")  # "None or ..." as the other messages say it
        return " or ".join(parts)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    simple = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}
    if annotation in simple:
        return simple[annotation]
    if origin in _SEQUENCES or annotation in _SEQUENCES:
        if not args:
            return "a tuple or list"
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return f"a tuple (or list) of {len(args)}: ({', '.join(describe(a) for a in args)})"
        item = describe(args[0])
        return f"a tuple (or list) of {item.removeprefix('an ').removeprefix('a ')}s" if item in simple.values() \
            else f"a tuple (or list) whose items are each {item}"
    if origin in (dict, Mapping, collections.abc.Mapping) or annotation in (dict, Mapping, collections.abc.Mapping):
        return "a mapping (dict)"
    if isinstance(annotation, type):
        return f"a {annotation.__module__ + '.' if annotation.__module__ not in ('builtins',) else ''}" \
               f"{annotation.__qualname__}"
    return str(annotation)


def check_option_types(cls: type, options: Mapping, build: Callable[[], object] | None = None) -> None:
    """Refuses a method option whose value is not of the kind its constructor annotates.

    Args:
        cls: the method's class (e.g. ``METHODS["lbbnn"]``).
        options: ``{option: value}`` given for it; names that are not the method's own annotated options (the
            common options, unknown names) are not checked here.
        build: optional, builds the method with these options (``bw.wrap`` passes it). Called only once an
            option is refused, to add what the option's own check says (its accepted values, e.g. ``'auto'`` or
            an integer >= 0, which an annotation such as ``int | str`` does not tell) when that check names the
            option in a ValueError; any other outcome is ignored. Torch's CPU random state is kept.

    Raises:
        ValueError: for the first option of the wrong kind, e.g. ``flow_hidden=10 (of type int) is not accepted
            by method 'lbbnn'; accepted: a tuple (or list) of integers (annotated tuple[int, ...])``.
    """
    annotations = option_annotations(cls)
    for name, value in options.items():
        if name in annotations and matches(value, annotations[name]) is False:
            message = (f"{name}={value!r} (of type {type(value).__name__}) is not accepted by method "
                       f"{getattr(cls, 'method', cls.__name__)!r}; accepted: {describe(annotations[name])} "
                       f"(annotated {_annotation_text(annotations[name])})")
            own = None if build is None else _own_check(build, name)
            raise ValueError(message + (f"; the option's own check: {own}" if own else ""))


def _own_check(build: Callable[[], object], name: str) -> str | None:
    """The message of the ValueError that ``build()`` raises naming option ``name`` (``name=...``), else None."""
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            build()
        except ValueError as err:
            text = str(err)
            return text if text.startswith(f"{name}=") or f" {name}=" in text else None
        except Exception:  # the obscure failure the type check is there to prevent: nothing to add
            return None
    return None


def _annotation_text(annotation) -> str:
    """An annotation as written: ``tuple[int, ...]``, ``int | None``, ``torch.device``."""
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__name__ if annotation.__module__ == "builtins" else \
            f"{annotation.__module__}.{annotation.__qualname__}"
    return str(annotation).replace("typing.", "")
