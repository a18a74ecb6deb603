"""A griffe extension that reads bayeswrap's docstrings as Sphinx's napoleon reads Google style (mkdocs.yml loads it).

griffe's Google parser is stricter than napoleon in two ways that the docstrings rely on:

* ``Example:`` is napoleon's alias of ``Examples:`` (griffe would render the doctest as prose);
* ``a, b: description`` documents several arguments at once (expanded to one entry per name);

reStructuredText roles (``:class:`~bayeswrap.BayesianModel```) become Markdown code spans, and LaTeX maths
(``:math:`\\hat p_b``` and ``.. math::`` blocks) becomes MathML with latex2mathml, which browsers render without
scripts or fonts from the network; TeX it cannot convert is a warning (an error under ``mkdocs build --strict``). A function whose
docstring has ``{placeholders}`` that the code fills at import (``bw.wrap`` lists the registered methods) gets its
docstring as imported.
"""

from __future__ import annotations

import inspect
import logging
import re

from griffe import Extension, Object, dynamic_import
from latex2mathml.converter import convert

log = logging.getLogger("mkdocs.plugins.griffe_napoleon")  # under "mkdocs": --strict counts its warnings

_SECTION = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_ROLE = re.compile(r":\w+:`(~?)([^`]+)`")
_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_MATH_BLOCK = re.compile(r"^(\s*)\.\. math::\s*$")
#: TeX that latex2mathml does not know, in terms it knows
_TEX_FIXES = ((re.compile(r"\\arg(?![A-Za-z])"), r"\\operatorname{arg}"),)
_PLACEHOLDER = re.compile(r"\{[a-z_]+\}")
_ARGS_HEADER = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params):\s*$")


def _role(match: re.Match) -> str:
    title, _, target = match.group(2).rpartition("<")
    if title:  # :meth:`shown text <a.b.c>`
        return f"`{title.strip()}`"
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def mathml(tex: str, display: str = "inline") -> str:
    """LaTeX ``tex`` as one line of MathML (``display``: ``"inline"`` or ``"block"``); a code span if it fails."""
    fixed = tex
    for pattern, replacement in _TEX_FIXES:
        fixed = pattern.sub(replacement, fixed)
    try:
        out = convert(fixed, display=display)
        problem = "an unknown command" if "\\" in out else ""  # passed through unconverted
    except Exception as error:  # noqa: BLE001  (latex2mathml raises its own exception types)
        problem = repr(error)
    if problem:
        log.warning(f"latex2mathml cannot convert the TeX {tex!r}: {problem}")
        return f"`{tex}`"
    return out


def markdown_roles(text: str) -> str:
    """The reStructuredText roles of ``text`` as Markdown: ``:math:`` as MathML, the others as code spans.

    ``:class:`a.B``` gives ```a.B```, ``:class:`~a.B``` gives ```B``` and ``:meth:`text <a.b>``` gives ```text```.
    """
    # in a <span>: a line that starts with <math> (a block-level tag to Python-Markdown) would end the paragraph
    return _ROLE.sub(_role, _MATH_ROLE.sub(lambda m: f'<span class="math">{mathml(m.group(1))}</span>', text))


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block_end(lines: list[str], start: int, indent: int, blanks: bool = True) -> int:
    """The index after the run of lines from ``start`` indented deeper than ``indent`` (and blank ones if ``blanks``)."""
    i = start
    while i < len(lines) and (_indent(lines[i]) > indent if lines[i].strip() else blanks):
        i += 1
    return i


def _math_blocks(text: str) -> str:
    """Each ``.. math::`` directive and its indented TeX as one line of block MathML at the directive's indent."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        directive = _MATH_BLOCK.match(lines[i])
        if not directive:
            out.append(lines[i])
            i += 1
            continue
        end = _block_end(lines, i + 1, len(directive[1]))
        out += [directive[1] + mathml(" ".join(" ".join(lines[i + 1:end]).split()), "block"), ""]
        i = end
    return "\n".join(out)


def _expand_grouped_args(text: str) -> str:
    """``a, b: text`` entries of Args sections as ``a: text`` and ``b: text`` (each with the continuation lines)."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        header = _ARGS_HEADER.match(lines[i])
        out.append(lines[i])
        i += 1
        if not header:
            continue
        end = _block_end(lines, i, len(header[1]))
        entry_indent = min((_indent(line) for line in lines[i:end] if line.strip()), default=0)
        while i < end:
            stop = _block_end(lines, i + 1, entry_indent, blanks=False) if lines[i].strip() else i + 1
            names, sep, rest = lines[i].strip().partition(":")
            if lines[i].strip() and sep and "," in names and "(" not in names:
                for name in (n.strip() for n in names.split(",")):
                    out += [" " * entry_indent + f"{name}:{rest}", *lines[i + 1:stop]]
            else:
                out += lines[i:stop]
            i = stop
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
        obj.docstring.value = markdown_roles(_math_blocks(_expand_grouped_args(text)))
