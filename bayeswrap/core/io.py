"""Atomic file output (a reader never sees a half-written file) and safe checkpoint loading."""

from __future__ import annotations

import errno
import json
import os
import pickle
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
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if _disk_full(err):
            raise OSError(errno.ENOSPC, f"writing {path} failed: no space left on the device "
                                        f"({type(err).__name__}: {err}); {path} is unchanged") from err
        raise
    return path


def _disk_full(err: BaseException) -> bool:
    """Whether a write failed for lack of space (torch's zip writer says only "unexpected pos")."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("unexpected pos" in text or "No space left" in text)


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


class CheckpointError(ValueError):
    """A checkpoint or weights file that is missing, unreadable or does not match; the message names the file."""


def load_checkpoint(path, required: dict[str, type | tuple[type, ...]] | None = None) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``: never unrestricted pickle.

    Args:
        path: the file.
        required: optional ``{key: type}`` the loaded mapping must hold.

    Raises:
        CheckpointError: naming the file, if it is missing, empty, truncated,
            not a torch checkpoint, pickles Python objects, or lacks a required
            key or holds one of the wrong type.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes); it was not written completely")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint {path} cannot be loaded with weights_only=True (it holds Python objects "
                              f"other than tensors and plain containers): {err}") from None
    except Exception as err:  # truncated zip, random bytes, ...: EOFError, RuntimeError, ...
        raise CheckpointError(f"checkpoint {path} cannot be read, it is damaged or not a torch checkpoint "
                              f"({type(err).__name__}: {err})") from None
    if required:
        if not isinstance(obj, dict):
            raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}; expected a mapping with keys "
                                  f"{', '.join(required)}")
        missing = [k for k in required if k not in obj]
        if missing:
            raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}; expected keys "
                                  f"{', '.join(required)}")
        wrong = [f"{k} ({type(obj[k]).__name__}, expected {_type_names(t)})" for k, t in required.items()
                 if not isinstance(obj[k], t)]
        if wrong:
            raise CheckpointError(f"checkpoint {path} has entries of the wrong type: {', '.join(wrong)}")
    return obj


def _type_names(t) -> str:
    return " or ".join(x.__name__ for x in (t if isinstance(t, tuple) else (t,)))
