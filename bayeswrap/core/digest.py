"""Content digests of the files bayeswrap writes with ``torch.save``: SHA-256 per tensor and per container.

torch's zip reader does not check the CRC-32 of the records it reads, so a flipped bit in a stored tensor loads
silently. :func:`content_digest` records, at save time, the SHA-256 of every tensor (its dtype, shape and bytes)
and of every container (its type, its keys in order, and its plain values: numbers, strings, None, dtypes,
devices), each under its key path (``['state']['0.weight']``). The record is one extra entry,
``<archive>/bayeswrap_digest.json``, in the torch zip file itself (:func:`append_record`), beside ``data.pkl``
and ``data/<n>``: ``torch.load`` ignores records it does not know, so a file keeps loading with plain
``torch.load(path, weights_only=True)`` (a run's ``best.pt`` stays a bare ``state_dict``), and the digest travels
with the file when it is copied. A file saved again by plain ``torch.save`` simply has no digest.

:func:`bayeswrap.core.io.load_checkpoint` reads the record (:func:`read_record`) and compares it with the loaded
contents (:func:`mismatches`): every ``bw.load``, ``load_run``, ``predict``, ``evaluate`` and ``--resume``
goes through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch

#: the name of the digest record inside the file's zip archive (after the archive's own folder name)
RECORD = "bayeswrap_digest.json"
#: the ``format`` and ``version`` of the record this bayeswrap writes and reads
FORMAT, VERSION = "bayeswrap.digest", 1
#: the hash of every entry
ALGORITHM = "sha256"
#: the largest record read back (a damaged size field must not make the reader allocate gigabytes)
MAX_RECORD_BYTES = 256 * 2**20


#: the key under which a state_dict's ``_metadata`` attribute is walked (no dict key is this object)
_METADATA = object()


class DigestRecordError(ValueError):
    """A digest record that is present but damaged or of a layout this bayeswrap does not read."""


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 (hex) of a tensor's dtype, shape and bytes (row-major, as on a little-endian CPU).

    Args:
        tensor: any dense, sparse or meta tensor on any device (copied to the CPU when it is elsewhere).

    Returns:
        64 hex digits; equal for two tensors exactly when their dtype, shape and every element's bits are
        equal (strides, storage offsets and devices do not enter).
    """
    t = tensor.detach()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.is_meta:
        h.update(b"meta")
        return h.hexdigest()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    t = t.resolve_conj().resolve_neg().cpu().contiguous()
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def content_digest(obj: Any) -> dict:
    """The digest record of ``obj``, what :func:`append_record` stores.

    The record::

        {"format": "bayeswrap.digest", "version": 1, "algorithm": "sha256",
         "tensors": {key path: sha256 of the tensor}, "containers": {key path: sha256 of the container}}

    A container's digest covers its kind (mapping, list or tuple), its keys in order and, per entry, either the
    plain value (type and ``repr``: floats exactly, NaN and -0.0 included) or the kind of what it holds (a
    tensor, another container), so every non-tensor value and the layout are covered. The top level's path is
    ``""``; a key path is the ``repr`` of each key in brackets, e.g. ``['optimizer']['state'][0]['exp_avg']``.
    A ``state_dict``'s ``_metadata`` attribute (the module versions ``load_state_dict`` reads) is covered as the
    container ``<path>._metadata``.

    Args:
        obj: what is passed to ``torch.save``: tensors, plain values, and mappings, lists and tuples of them.
    """
    tensors, containers = {}, {}
    for path, kind, value in _walk(obj, ""):
        if kind == "tensor":
            tensors[path] = tensor_sha256(value)
        else:
            containers[path] = value
    return {"format": FORMAT, "version": VERSION, "algorithm": ALGORITHM, "tensors": tensors,
            "containers": containers}


def _walk(obj: Any, path: str, within: tuple[int, ...] = ()) -> Iterator[tuple[str, str, Any]]:
    """``(path, "tensor", tensor)`` per tensor and ``(path, "container", sha256)`` per container, depth first.

    ``within`` holds the ids of the enclosing containers: a container that holds itself (a cycle, which a damaged
    pickle can make) is recorded as ``"cycle"``, not followed.
    """
    if isinstance(obj, torch.Tensor):
        yield path, "tensor", obj
        return
    kind = _container_kind(obj)
    items = (list(obj.items()) if kind == "mapping" else list(enumerate(obj)) if kind else [(None, obj)])
    metadata = getattr(obj, "_metadata", None) if kind == "mapping" else None
    if isinstance(metadata, Mapping):  # a state_dict's per-module versions, which load_state_dict reads
        items.append((_METADATA, metadata))
    within = (*within, id(obj))
    entries = []
    for key, value in items:
        inner = "tensor" if isinstance(value, torch.Tensor) else _container_kind(value)
        if inner and id(value) in within:
            inner = "cycle"
        shown = "._metadata" if key is _METADATA else repr(key)
        entries.append([shown, inner or _plain(value)])
        if inner and inner != "cycle":
            child = path if key is None else path + shown if key is _METADATA else f"{path}[{shown}]"
            yield from _walk(value, child, within)
    text = json.dumps([kind or "value", entries], separators=(",", ":"), ensure_ascii=True)
    yield path, "container", hashlib.sha256(text.encode()).hexdigest()


def _container_kind(value: Any) -> str | None:
    """``"mapping"``, ``"list"`` or ``"tuple"`` (``torch.Size`` and ``OrderedDict`` included), else None."""
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list" if isinstance(value, list) else "tuple"
    return None


def _plain(value: Any) -> str:
    """A plain value as text that differs whenever its type or value does (``repr`` round-trips floats)."""
    for kind in (bool, int, float, complex, str, bytes):
        if isinstance(value, kind):
            return f"{kind.__name__}:{kind(value)!r}"
    return f"{type(value).__name__}:{value!r}"


def append_record(path: str | os.PathLike, record: dict) -> None:
    """Adds ``record`` as ``<archive>/bayeswrap_digest.json`` to the torch zip file at ``path`` (in place).

    Raises:
        ValueError: if ``path`` is not a torch zip file (one entry ``<archive>/data.pkl``).
    """
    with zipfile.ZipFile(path, "a") as archive:
        folder = _archive_folder(archive, path)
        info = zipfile.ZipInfo(f"{folder}/{RECORD}", date_time=(1980, 1, 1, 0, 0, 0))
        archive.writestr(info, json.dumps(record, separators=(",", ":"), ensure_ascii=True))


def read_record(path: str | os.PathLike) -> dict | None:
    """The digest record of the torch file at ``path``, or None if it has none.

    A file has none when it is not a zip archive (torch's legacy format) or its archive lacks the record (written
    by an older bayeswrap, or saved again with plain ``torch.save``).

    Raises:
        DigestRecordError: if the record is present but unreadable, not the JSON of :func:`content_digest`, or
            of a layout this bayeswrap does not read (a newer one, or a damaged version field).
    """
    if not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            folder = _archive_folder(archive, path)
            try:
                info = archive.getinfo(f"{folder}/{RECORD}")
            except KeyError:
                return None
            if info.file_size > MAX_RECORD_BYTES:
                raise DigestRecordError(f"its digest record claims {info.file_size} bytes (at most "
                                        f"{MAX_RECORD_BYTES} are read)")
            text = archive.read(info)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as err:
        if isinstance(err, DigestRecordError):
            raise
        raise DigestRecordError(f"its zip directory or digest record cannot be read ({type(err).__name__}: "
                                f"{err})") from None
    try:
        record = json.loads(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as err:
        raise DigestRecordError(f"its digest record is not valid JSON ({err})") from None
    if not isinstance(record, dict) or set(record) != {"format", "version", "algorithm", "tensors", "containers"}:
        raise DigestRecordError("its digest record is damaged (expected the entries format, version, algorithm, "
                                "tensors, containers)")
    if (record["format"], record["version"], record["algorithm"]) != (FORMAT, VERSION, ALGORITHM):
        raise DigestRecordError(f"its digest record is format {record['format']!r} version {record['version']!r} "
                                f"algorithm {record['algorithm']!r}; this bayeswrap reads {FORMAT!r} version "
                                f"{VERSION} algorithm {ALGORITHM!r} (the file was written by a newer bayeswrap, or "
                                "the record is damaged)")
    for section in ("tensors", "containers"):
        entries = record[section]
        if not isinstance(entries, dict) or not all(isinstance(v, str) for v in entries.values()):
            raise DigestRecordError(f"its digest record's {section} entry is damaged (expected key path: hex)")
    return record


def _archive_folder(archive: zipfile.ZipFile, path) -> str:
    """The folder every record of a torch zip file lies in (torch names it after the file it first wrote)."""
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise ValueError(f"{path} is not a torch zip file (expected one <archive>/data.pkl entry, found "
                         f"{len(pickles)})")
    return pickles[0].split("/", 1)[0]


def mismatches(record: dict, obj: Any) -> list[tuple[str, str, str | None, str | None]]:
    """What differs between a digest record and loaded contents, tensors first.

    Returns:
        ``(what, key path, expected sha256, found sha256)`` per difference, where ``what`` is ``"tensor"`` or
        ``"container"`` and a digest is None for an entry missing on that side; empty when everything matches.
    """
    found = content_digest(obj)
    out = []
    for section, what in (("tensors", "tensor"), ("containers", "container")):
        expected, ours = record[section], found[section]
        for key in [*expected, *(k for k in ours if k not in expected)]:
            if expected.get(key) != ours.get(key):
                out.append((what, key, expected.get(key), ours.get(key)))
    return out


__all__ = ["ALGORITHM", "FORMAT", "RECORD", "VERSION", "DigestRecordError", "append_record", "content_digest",
           "mismatches", "read_record", "tensor_sha256"]
