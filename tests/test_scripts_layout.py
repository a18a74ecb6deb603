"""The reproduction scripts stay thin (issue 31, item 8): no file over 500 lines, no private bayeswrap name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
FILES = sorted(SCRIPTS.rglob("*.py"))
MAX_LINES = 500


def _bayeswrap_aliases(tree: ast.Module) -> set[str]:
    """Local names bound to a bayeswrap module or object by the file's imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "bayeswrap"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bayeswrap":
            names |= {a.asname or a.name for a in node.names}
    return names


def private_uses(source: str) -> list[str]:
    """Private names (a leading underscore, not dunder) imported from bayeswrap or read off a bayeswrap name."""
    tree = ast.parse(source)
    aliases = _bayeswrap_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bayeswrap":
            parts = node.module.split(".") + [a.name for a in node.names]
            found += [f"from {node.module} import {p}" for p in parts if p.startswith("_") and not p.startswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_the_checker_finds_private_names():
    src = ("import bayeswrap as bw\nfrom bayeswrap.app import cli\nfrom bayeswrap.evaluation.plots import _x\n"
           "bw.methods._y\ncli._eval_loader\nself._ok\nbw.__version__\n")
    assert private_uses(src) == ["from bayeswrap.evaluation.plots import _x", "bw.methods._y (line 4)",
                                 "cli._eval_loader (line 5)"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_script_file_is_thin_and_public(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{path.name}: {len(text.splitlines())} lines > {MAX_LINES}"
    assert private_uses(text) == []
