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


#: modules a script may import before it sets the OpenMP wait policy: the standard library's, which load no OpenMP
_STDLIB = set(__import__("sys").stdlib_module_names) | {"__future__"}


def wait_policy_problems(source: str) -> list[str]:
    """Why a runnable script would start OpenMP without a passive wait policy (issue 34, item 6): it must call
    ``os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")`` at module level before its first non-stdlib import."""
    tree = ast.parse(source)
    if not any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body):
        return []
    for node in tree.body:
        if isinstance(node, ast.Expr) and ast.unparse(node) == "os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')":
            return []
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            late = [n for n in names if (n or "").split(".")[0] not in _STDLIB]
            if late:
                return [f"line {node.lineno} imports {late[0]} before OMP_WAIT_POLICY is set"]
    return ["OMP_WAIT_POLICY is never set"]


def test_the_wait_policy_checker_finds_late_and_missing_settings():
    ok = 'import os\nos.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")\nimport torch\nif __name__ == "__main__":\n 1'
    late = 'import os\nimport torch\nos.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")\nif __name__ == "__main__":\n 1'
    assert wait_policy_problems(ok) == []
    assert wait_policy_problems(late) == ["line 2 imports torch before OMP_WAIT_POLICY is set"]
    assert wait_policy_problems("import os\nif __name__ == '__main__':\n 1") == ["OMP_WAIT_POLICY is never set"]
    assert wait_policy_problems("import torch\n") == []  # a module, not a script


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SCRIPTS)))
def test_every_script_sets_a_passive_wait_policy_before_loading_torch(path):
    assert wait_policy_problems(path.read_text()) == []
