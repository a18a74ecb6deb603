"""The files ``fit``, ``compare`` and ``evaluate`` write, with a failed write named: the file, its folder and the
operation.

:mod:`bayeswrap.core.io` writes atomically (a failed write leaves the destination as it was); an ``OSError`` it
raises (a full disk, a quota, a read-only or failing disk) named no file, or only the temporary one. Each writer
here calls its :mod:`bayeswrap.core.io` namesake and raises a failure as :class:`RunOutputError`, e.g.
``writing metrics.json in runs/digits-mlp-vi: No space left on device (errno 28); metrics.json is left as it
was. Free space on that disk, then run the command again``. The run's lock is released by the run as it ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bayeswrap.core import io as core_io

#: errors that say the disk (or the user's quota) is full
_FULL = (errno.ENOSPC, errno.EDQUOT)
#: the temporary name of :func:`bayeswrap.core.io.atomic_write`: ``.<name>.<pid>.<random>.tmp``
_TMP_NAME = re.compile(r"\.(?P<name>.+)\.\d+\.[^.]+\.tmp")


class RunOutputError(OSError):
    """A file of a run that could not be written; the message names the file, its folder and the operation."""

    def __str__(self) -> str:  # the message alone: it names the errno itself
        return str(self.strerror)


def output_error(err: OSError, path: str | os.PathLike | None, operation: str = "writing",
                 folder: str | os.PathLike | None = None) -> RunOutputError:
    """``err`` as a :class:`RunOutputError` naming ``path`` (its name and folder) and ``operation``.

    Args:
        err: the failure.
        path: the file being written (None: the one ``err`` names, if any).
        operation: what was being done, e.g. ``"writing"`` or ``"taking the lock: writing"``.
        folder: the folder written into, named when neither ``path`` nor ``err`` names a file.
    """
    if isinstance(err, RunOutputError):
        return err
    if path is None and getattr(err, "filename", None):
        path = Path(err.filename)
        match = _TMP_NAME.fullmatch(path.name)
        path = path.with_name(match["name"]) if match else path
    code = getattr(err, "errno", None)
    reason = f"{os.strerror(code)} (errno {code})" if code else str(err)
    if path is None and code and err.strerror and err.strerror != os.strerror(code):  # core.io's, naming the file
        reason += f" [{err.strerror}]"
    if path is not None:
        path = Path(path)
        where = f"{operation} {path.name} in {path.parent}"
        kept = f"; {path.name} is left as it was" if operation == "writing" else ""
    else:
        where, kept = f"{operation} in {folder}", ""
    advice = ". Free space on that disk (or raise the quota), then run the command again" if code in _FULL else ""
    return RunOutputError(code or errno.EIO, f"{where}: {reason}{kept}{advice}")


@contextlib.contextmanager
def naming_failures(folder: str | os.PathLike, operation: str = "writing") -> Iterator[None]:
    """Re-raises an ``OSError`` of the block as a :class:`RunOutputError` naming the file it names (or ``folder``)."""
    try:
        yield
    except RunOutputError:
        raise
    except OSError as err:
        raise output_error(err, None, operation, folder) from err


def _named(write, path, *args, **kwargs) -> Path:
    try:
        return write(path, *args, **kwargs)
    except RunOutputError:
        raise
    except OSError as err:
        raise output_error(err, path) from err


def write_text(path: str | os.PathLike, text: str) -> Path:
    """:func:`bayeswrap.core.io.write_text`; a failure raises :class:`RunOutputError` naming the file."""
    return _named(core_io.write_text, path, text)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """:func:`bayeswrap.core.io.write_json`; a failure raises :class:`RunOutputError` naming the file."""
    return _named(core_io.write_json, path, obj)


def write_yaml(path: str | os.PathLike, obj: Any) -> Path:
    """:func:`bayeswrap.core.io.write_yaml`; a failure raises :class:`RunOutputError` naming the file."""
    return _named(core_io.write_yaml, path, obj)


def save_checkpoint(path: str | os.PathLike, obj: Any, *args, **kwargs) -> Path:
    """:func:`bayeswrap.core.io.save_checkpoint`; a failure raises :class:`RunOutputError` naming the file."""
    return _named(core_io.save_checkpoint, path, obj, *args, **kwargs)
