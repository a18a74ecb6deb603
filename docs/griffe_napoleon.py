"""A griffe extension that reads bayeswrap's docstrings as Sphinx's napoleon reads Google style (mkdocs.yml loads it).

griffe's Google parser is stricter than napoleon in two ways that the docstrings rely on:

* ``Example:`` is napoleon's alias of ``Examples:`` (griffe would render the doctest as prose);
* ``a, b: description`` documents several arguments at once (expanded to one entry per name);

and reStructuredText roles (``:class:`~bayeswrap.BayesianModel```) become Markdown code spans. A function whose
docstring has ``{placeholders}`` that the code fills at import (``bw.wrap`` lists the registered methods) gets its
docstring as imported.
"""

from __future__ import annotations

import inspect
import re

from griffe import Extension, Object, dynamic_import

_SECTION = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":\w+:`(~?)([^`]+)`")
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")
_ARGS_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params):\s*$")


def _role(match: re.Match) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def _expand_grouped_args(text: str) -> str:
    """``a, b: text`` entries of Args sections as ``a: text`` and ``b: text`` (each with the continuation lines)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        header = _ARGS_HEADER.match(lines[i])
        out.append(lines[i])
        i += 1
        if not header:
            continue
        entry_indent = None
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(header[1])):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if entry_indent is None and line.strip():
                entry_indent = indent
            block = [line]
            i += 1
            while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > (entry_indent or 0):
                block.append(lines[i])
                i += 1
            names, sep, rest = line.strip().partition(":")
            if indent == entry_indent and sep and "," in names and "(" not in names:
                for name in (n.strip() for n in names.split(",")):
                    out.append(" " * indent + f"{name}:{rest}")
                    out.extend(block[1:])
            else:
                out.extend(block)
    return "\n".join(out)


class NapoleonGoogle(Extension):
    """Rewrites each docstring once its object is loaded (see the module docstring)."""

    def on_object(self, *, obj: Object, **kwargs) -> None:  # noqa: D102
        if obj.docstring is None or obj.is_alias:
            return
        if obj.is_function and _PLACEHOLDER.search(obj.docstring.value):
            try:
                imported = inspect.getdoc(dynamic_import(obj.path))
            except Exception:  # noqa: BLE001  (the docstring as written is still documentation)
                imported = None
            if imported and imported != obj.docstring.value:
                obj.docstring.value = imported
        text = _SECTION.sub(r"\1Examples:", obj.docstring.value)
        obj.docstring.value = _ROLE.sub(_role, _expand_grouped_args(text))
