"""Atomic file output (a reader never sees a half-written file) and safe checkpoint loading.

Every write goes through :func:`atomic_write` (or, for an appended log, :func:`open_append`): a write never
replaces or follows anything but a regular file, so a planted symbolic link, a device node (``/dev/null``), a
named pipe or a folder at the destination is refused, never written through or renamed over
(:class:`UnsafePathError`).

Every torch file bayeswrap writes (:func:`save_checkpoint`: ``bw.save`` files, a run's ``best.pt`` and
``last.pt``) carries the SHA-256 of each tensor and container it holds (:mod:`bayeswrap.core.digest`), and
:func:`load_checkpoint`, the one reader of those files, checks it: a changed bit is refused
(:class:`IntegrityError`, naming the file, the entry and both digests) instead of loading silently, since
torch's reader does not check the zip's CRC-32. A file without a digest (an older bayeswrap's) loads with a
:class:`NoDigestWarning`.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import pickle
import stat
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from bayeswrap.core import digest


class UnsafePathError(ValueError):
    """A destination or source that is a symbolic link, a device, a pipe, a folder or outside its run folder."""


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))


def file_kind(path: str | os.PathLike, follow_symlinks: bool = False) -> str | None:
    """What ``path`` is when it exists and is not a regular file ("a symbolic link", "a character device", ...);
    None for a regular file or a missing path (a link is not followed unless ``follow_symlinks``).
    """
    try:
        mode = os.stat(path, follow_symlinks=follow_symlinks).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def check_replaceable(path: str | os.PathLike) -> None:
    """Refuses a destination that exists and is not a regular file.

    Raises:
        UnsafePathError: naming the path and what it is.
    """
    kind = file_kind(path)
    if kind is not None:
        raise UnsafePathError(f"refusing to write {path}: it is {kind}; accepted: a new file or a regular file")


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Calls ``write(tmp_path)`` on a temporary file beside ``path``, then renames it over ``path``.

    The temporary file is ``.<name>.<pid>.<random>.tmp``; :func:`remove_stale_tmp_of` removes those a killed
    writer left.

    Args:
        path: destination; parent folders are created.
        write: writes the complete content to the given temporary path.

    Returns:
        ``path`` as a ``Path``. On error the temporary file is removed and
        ``path`` is left as it was.

    Raises:
        UnsafePathError: if ``path`` exists and is not a regular file (a symbolic
            link, a device such as ``/dev/null``, a pipe or a folder): it is
            neither written through nor replaced.
    """
    path = Path(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
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


def remove_stale_tmp_of(path: str | os.PathLike) -> list[Path]:
    """Removes the temporary files of :func:`atomic_write` for ``path`` whose writing process is gone.

    Returns:
        The removed files (regular files named ``.<name>.<pid>.*.tmp`` with ``pid`` not a live process).
    """
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and file_kind(tmp) is None and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # exists, owned by someone else (or not a pid)
        return True
    return True


def open_append(path: str | os.PathLike):
    """Opens a log file for appending (UTF-8 text), never through a symbolic link or into a non-regular file.

    Raises:
        UnsafePathError: if ``path`` is a symbolic link or exists and is not a regular file.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    check_replaceable(path)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(f"refusing to write {path}: it is a symbolic link; accepted: a new file or a "
                                  "regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between the check and the open
        os.close(fd)
        raise UnsafePathError(f"refusing to write {path}: it is not a regular file")
    return os.fdopen(fd, "a", encoding="utf-8")


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


class _NoAliasDumper(yaml.SafeDumper):
    """Writes an object that appears twice in full: bayeswrap refuses YAML anchors and aliases when it reads back."""

    def ignore_aliases(self, data):
        return True


def write_yaml(path, obj: Any) -> Path:
    """Writes ``obj`` as YAML atomically, without anchors or aliases."""
    return write_text(path, yaml.dump(obj, Dumper=_NoAliasDumper, sort_keys=False))


def save_checkpoint(path, obj: Any) -> Path:
    """``torch.save`` atomically, with the SHA-256 of every tensor and container inside the file.

    ``obj`` must be loadable with ``torch.load(..., weights_only=True)``; it still is, unchanged: the digest
    (:func:`bayeswrap.core.digest.content_digest`) is an extra record of the zip archive that ``torch.load``
    ignores and :func:`load_checkpoint` checks.
    """
    record = digest.content_digest(obj)

    def write(tmp):
        torch.save(obj, tmp)
        digest.append_record(tmp, record)

    return atomic_write(path, write)


class CheckpointError(ValueError):
    """A checkpoint or weights file that is missing, unreadable or does not match; the message names the file."""


class IntegrityError(CheckpointError):
    """A file whose contents differ from the digest recorded when it was written (damaged on disk or in a copy).

    The message names the file, the first entry (tensor or container key path) that differs, and the expected
    and found SHA-256; :attr:`entry`, :attr:`expected` and :attr:`found` hold them.
    """

    def __init__(self, message: str, entry: str | None = None, expected: str | None = None,
                 found: str | None = None):
        super().__init__(message)
        self.entry, self.expected, self.found = entry, expected, found


class NoDigestWarning(UserWarning):
    """A checkpoint without a digest of its contents (an older bayeswrap's, or saved again by plain ``torch.save``).

    It is loaded, but damage to its data cannot be detected.
    """


def load_checkpoint(path, required: dict[str, type | tuple[type, ...]] | None = None, *,
                    inside: str | os.PathLike | None = None) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)``: never unrestricted pickle; the contents are
    checked against the file's digest (:func:`verify_digest`).

    Args:
        path: the file.
        required: optional ``{key: type}`` the loaded mapping must hold.
        inside: optional folder (a run folder) the checkpoint must be a regular file of: a symbolic link, or a
            path that resolves elsewhere, is refused.

    Raises:
        CheckpointError: naming the file, if it is missing, empty, truncated,
            not a torch checkpoint, pickles Python objects, or lacks a required
            key or holds one of the wrong type; :class:`IntegrityError` (a
            subclass) if its contents differ from its digest.
        UnsafePathError: with ``inside``, for a symbolic link or a file outside that folder.

    Warns:
        NoDigestWarning: for a file without a digest (loaded unchecked).
    """
    path = Path(path)
    if inside is not None and (path.is_symlink() or path.resolve().parent != Path(inside).resolve()):
        raise UnsafePathError(f"checkpoint {path} is a symbolic link or lies outside its run folder {inside}; "
                              "accepted: a regular file in the run folder (bayeswrap never loads a checkpoint "
                              "from elsewhere through a run folder)")
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
    verify_digest(path, obj)
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


def verify_digest(path, obj: Any) -> None:
    """Compares ``obj``, loaded from ``path``, with the digest recorded in the file (:mod:`bayeswrap.core.digest`).

    Raises:
        IntegrityError: naming the file, the first tensor or container (key path) whose SHA-256 differs and both
            digests (with the count of further differences), or a damaged or unknown digest record.

    Warns:
        NoDigestWarning: if the file carries no digest (an older bayeswrap's, or one saved again with plain
            ``torch.save``); it is then not checked.
    """
    try:
        record = digest.read_record(path)
    except digest.DigestRecordError as err:
        raise IntegrityError(f"checkpoint {path} cannot be checked: {err}; write it again (bw.save, or rerun) or "
                             "restore it from a copy") from None
    if record is None:
        warnings.warn(f"checkpoint {path} has no digest of its contents (written by an older bayeswrap, or saved "
                      "again with plain torch.save): it is loaded without checking that its data is undamaged; "
                      "save it again with bayeswrap to add one", NoDigestWarning, stacklevel=3)
        return
    differences = digest.mismatches(record, obj)
    if differences:
        what, entry, expected, found = differences[0]
        more = f" (and {len(differences) - 1} more entries differ)" if len(differences) > 1 else ""
        shown = entry or "(the top level)"
        if expected is None:
            detail = f"{what} {shown} is not in the digest recorded when it was written (found SHA-256 {found})"
        elif found is None:
            detail = (f"{what} {shown} is in the digest recorded when it was written (SHA-256 {expected}) but "
                      "missing from the file")
        else:
            detail = (f"{what} {shown} has SHA-256 {found}, but the digest recorded when it was written is "
                      f"{expected}")
        raise IntegrityError(f"checkpoint {path} is damaged: {detail}{more}; its data changed after it was written "
                             "(a disk or copy error); restore it from a copy or write it again", entry, expected,
                             found)


def _type_names(t) -> str:
    return " or ".join(x.__name__ for x in (t if isinstance(t, tuple) else (t,)))
