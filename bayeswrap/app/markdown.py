"""Text that reaches a Markdown table: names read back from run files are checked, every cell is escaped.

``compare`` builds ``comparison.md`` from each method's ``metrics.json``; a resumed comparison reads finished
methods' files back. A name in such a file (an operating point, a tuned option, a predictive) went into the table
as it stood, so ``metrics.json`` could add columns (``|``), links or HTML to the table. Now:

* :func:`check_metrics_names` refuses, naming the file and the value, a name read back that does not match its
  pattern (:data:`NAME_PATTERN`, :data:`PREDICTIVE_PATTERN`);
* :func:`markdown_text` escapes what Markdown reads in every text cell and every name under the table
  (:mod:`bayeswrap.app.reports` writes every Markdown table through it).
"""

from __future__ import annotations

import os
import re
from typing import Any

#: an operating point's or option's name: a letter or ``_``, then letters, digits, ``_``, ``.``, ``-`` (64 at most)
NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")
#: a predictive's ``repr``: ``Name(arguments)`` on one line, at most 200 characters, without ``|`` or backticks
PREDICTIVE_PATTERN = re.compile(r"[A-Za-z_]\w{0,63}\([^\n\r|`]{0,135}\)")

#: characters escaped with a backslash wherever they stand (CommonMark escapes any ASCII punctuation this way)
_ALWAYS = "\\`*|<>[]&"
#: an ``_`` between two letters or digits is left as it is (``prior_std``: Markdown reads no emphasis there)
_LONE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def markdown_text(value: Any) -> str:
    """``value`` as text for a Markdown table cell (or a line under the table), read as the characters it holds.

    Line breaks (``\\r``, ``\\n`` and the other line separators of :meth:`str.splitlines`) become spaces, so a
    cell stays on its row; backslash, backtick, ``*``, ``|``, ``<``, ``>``, ``[``, ``]`` and ``&`` are escaped with
    a backslash, and so is an ``_`` that is not between two letters or digits (``prior_std`` stays as it is).

    >>> markdown_text("a|b <i>*x*</i>\\nnext")
    'a\\\\|b \\\\<i\\\\>\\\\*x\\\\*\\\\</i\\\\> next'
    """
    text = " ".join(str(value).splitlines()) if value is not None else ""
    text = "".join("\\" + c if c in _ALWAYS else c for c in text)
    return _LONE_UNDERSCORE.sub(r"\\_", text)


def check_name(value: Any, field: str, path: str | os.PathLike, pattern: re.Pattern = NAME_PATTERN) -> str:
    """A name read back from a run file, checked against ``pattern`` before it reaches a table.

    Raises:
        ValueError: naming the file, the field and the value, and the accepted pattern.
    """
    if isinstance(value, str) and pattern.fullmatch(value):
        return value
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise ValueError(f"{str(path)!r}: {field} {shown} is not a valid name; accepted: text matching "
                     f"{pattern.pattern} (a name bayeswrap writes). The file was changed after the run wrote it: "
                     "rerun that method (delete its folder and resume the comparison)")


def check_metrics_names(metrics: Any, path: str | os.PathLike) -> dict:
    """The names in a run's ``metrics.json`` that reach ``compare``'s tables, checked (:func:`check_name`).

    Checked: ``operating_point``, the keys and option names of ``operating_points``, the option names of
    ``tuning["options"]`` (and a one-knob record's ``option``), and each final report's ``predictive``.

    Returns:
        ``metrics``.

    Raises:
        ValueError: naming the file, the field and the value, for a name that does not match, or a file that is
            not a mapping with a ``final`` mapping of reports.
    """
    if not isinstance(metrics, dict) or not isinstance(metrics.get("final"), dict):
        raise ValueError(f"{str(path)!r} is not a run's metrics (a mapping with a 'final' mapping of reports)")
    if metrics.get("operating_point") is not None:
        check_name(metrics["operating_point"], "operating_point", path)
    tuning = metrics.get("tuning") or {}
    if not isinstance(tuning, dict):
        raise ValueError(f"{str(path)!r}: tuning is not a mapping")
    for key in (tuning.get("options") or {}):
        check_name(key, "tuning option", path)
    if "option" in tuning:
        check_name(tuning["option"], "tuning option", path)
    points = metrics.get("operating_points") or {}
    if not isinstance(points, dict):
        raise ValueError(f"{str(path)!r}: operating_points is not a mapping")
    reports = list(metrics["final"].values())
    for name, point in points.items():
        check_name(name, "operating point", path)
        if not isinstance(point, dict) or not isinstance(point.get("final"), dict):
            raise ValueError(f"{str(path)!r}: operating point {name!r} has no 'final' mapping of reports")
        for key in (point.get("options") or {}):
            check_name(key, f"option of operating point {name!r}", path)
        reports += list(point["final"].values())
    for report in reports:
        if isinstance(report, dict) and report.get("predictive") is not None:
            check_name(report["predictive"], "predictive", path, PREDICTIVE_PATTERN)
    return metrics
