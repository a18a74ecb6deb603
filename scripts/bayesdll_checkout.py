"""BayesDLL's own code, imported at run time from a checkout outside this repository (nothing of it is copied).

BayesDLL (Kim & Hospedales 2023, github.com/SamsungLabs/BayesDLL) is not a package: its ``methods/*.py`` import
``calibration`` and ``utils`` from the checkout's root at top level. :func:`load_file` loads one of its files
under a name of its own, and :func:`commit_of` says which commit was measured. Used by ``scripts/benchmark.py``
and ``scripts/bayesdll_table2.py``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import warnings
from pathlib import Path
from types import ModuleType

__all__ = ["load_file", "commit_of"]


def load_file(name: str, path: Path) -> ModuleType:
    """Executes the Python file ``path`` as a module named ``name`` (not added to ``sys.modules``).

    The checkout's root must be on ``sys.path`` while its method files load. Their docstrings' invalid escape
    sequences (``"\\p"``, ``"\\s"``) are not reported.

    Args:
        name: the module's name, e.g. ``"bayesdll_vi"``.
        path: the file, e.g. ``<checkout>/methods/vi.py``.

    Returns:
        The executed module.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", SyntaxWarning)
        spec.loader.exec_module(module)
    return module


def commit_of(root: str | Path, *, short: bool = False) -> str:
    """The commit ``git rev-parse HEAD`` names in the repository at ``root``, or ``"unknown"`` (no git, no repo).

    Args:
        root: a folder inside a git work tree.
        short: the abbreviated hash (``--short``).
    """
    cmd = ["git", "-C", str(root), "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        commit = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit or "unknown"
