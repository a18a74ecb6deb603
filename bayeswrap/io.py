"""Atomic file output: a reader never sees a half-written file."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Calls ``write(tmp_path)`` on a temporary file beside ``path``, then renames it over ``path``.

    Args:
        path: destination; parent folders are created.
        write: writes the complete content to the given temporary path.

    Returns:
        ``path`` as a ``Path``. On error the temporary file is removed and
        ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_text(path, text: str) -> Path:
    """Writes ``text`` (UTF-8) atomically."""
    return atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))


def write_json(path, obj: Any) -> Path:
    """Writes ``obj`` as indented JSON atomically."""
    return write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_yaml(path, obj: Any) -> Path:
    """Writes ``obj`` as YAML atomically."""
    return write_text(path, yaml.safe_dump(obj, sort_keys=False))


def save_checkpoint(path, obj: Any) -> Path:
    """``torch.save`` atomically; ``obj`` must be loadable with ``torch.load(..., weights_only=True)``."""
    return atomic_write(path, lambda p: torch.save(obj, p))


def load_checkpoint(path) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``: never unrestricted pickle."""
    return torch.load(path, map_location="cpu", weights_only=True)
