"""Integrity of the files bayeswrap writes (issue 34, item 1): a damaged ``bw.save`` file or run checkpoint is
refused, naming the file, the tensor and both digests; a file without a digest loads with a warning.

Oracles: the bit flips are made in the file on disk, inside the zip record that holds each tensor's storage
(``<archive>/data/<n>``, stored uncompressed: located from the zip directory and the record's local header); plain
``torch.load`` of the damaged file says which tensor changed, and the expected and found SHA-256 are recomputed
here with ``hashlib`` over the tensor's dtype, shape and bytes (the documented digest). Every flip must be
refused, or load contents equal to the saved ones; the count of refused flips must equal the number of bits the
stored tensors hold (each storage here is one whole tensor, so no flip can be harmless).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import struct
import warnings
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

import bayeswrap as bw
import bayeswrap.app.cli as cli
from bayeswrap.core.io import CheckpointError, IntegrityError, NoDigestWarning, load_checkpoint

FAST = ["--batch-size", "64", "--shift-rotations", "0", "--shift-noise", "0", "--progress", "false"]


def _mlp() -> nn.Module:
    """A tiny model with float32 parameters and buffers and an int64 buffer (BatchNorm's batch count)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))


def _saved(tmp_path) -> tuple:
    """A VI model of :func:`_mlp` after one training step (BatchNorm statistics and batch count set), saved."""
    bnn = bw.wrap(_mlp(), "vi", num_data=8)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 2, generator=gen), torch.randint(0, 2, (8,), generator=gen)
    bw.fit(bnn, [(x, y)], epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1))
    path = tmp_path / "bnn.pt"
    bw.save(bnn, path)
    return bnn, path, x


def _sha256(t: torch.Tensor) -> str:
    """The documented digest of a tensor: SHA-256 of ``f"{dtype}|{shape}|"`` and its row-major bytes."""
    t = t.contiguous()
    return hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()
                          ).hexdigest()


def _leaves(obj, path=""):
    """``{key path: value}`` of every tensor and plain value of nested mappings, lists and tuples."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return {path: obj}
    out = {}
    for key, value in items:
        out.update(_leaves(value, f"{path}[{key!r}]"))
    return out


def _equal(a, b) -> bool:
    """Same key paths, tensors equal in dtype, shape and every bit, plain values equal (NaN equals NaN)."""
    la, lb = _leaves(a), _leaves(b)
    if list(la) != list(lb):
        return False
    for key, x in la.items():
        y = lb[key]
        if torch.is_tensor(x) != torch.is_tensor(y):
            return False
        if torch.is_tensor(x):
            if x.dtype != y.dtype or x.shape != y.shape or _sha256(x) != _sha256(y):
                return False
        elif type(x) is not type(y) or (x != y and not (x != x and y != y)):
            return False
    return True


def _records(path, pattern=r"[^/]+/data/\d+") -> list[tuple[str, int, int]]:
    """``(name, offset of its first byte in the file, size)`` of the zip records whose names match."""
    out = []
    with zipfile.ZipFile(path) as archive, open(path, "rb") as fh:
        for info in archive.infolist():
            if re.fullmatch(pattern, info.filename):
                assert info.compress_type == zipfile.ZIP_STORED
                fh.seek(info.header_offset)
                header = fh.read(30)
                assert header[:4] == b"PK\x03\x04"
                name_len, extra_len = struct.unpack("<HH", header[26:30])
                out.append((info.filename, info.header_offset + 30 + name_len + extra_len, info.file_size))
    return out


def _flip(fh, offset: int, bit: int) -> None:
    fh.seek(offset)
    byte = fh.read(1)[0]
    fh.seek(offset)
    fh.write(bytes([byte ^ (1 << bit)]))
    fh.flush()


def _changed_tensors(original, path) -> list[str]:
    """Key paths of the tensors that plain ``torch.load`` of ``path`` gives differently from ``original``."""
    damaged = _leaves(torch.load(path, weights_only=True))
    return [k for k, v in _leaves(original).items() if torch.is_tensor(v) and _sha256(v) != _sha256(damaged[k])]


# --------------------------------------------------------------------------- bw.save files


def test_every_single_bit_flip_of_every_stored_tensor_is_refused(tmp_path):
    _, path, _ = _saved(tmp_path)
    original = torch.load(path, weights_only=True)
    tensors = {k: v for k, v in _leaves(original).items() if torch.is_tensor(v)}
    assert {t.dtype for t in tensors.values()} == {torch.float32, torch.int64}
    records = _records(path)
    assert len(records) == len(tensors) and sum(size for *_, size in records) == sum(
        t.numel() * t.element_size() for t in tensors.values())
    refused, identical, named = 0, 0, set()
    with open(path, "r+b") as fh:
        for name, start, size in records:
            _flip(fh, start, 0)  # which tensor this storage holds, by plain torch.load
            owners = _changed_tensors(original, path)
            _flip(fh, start, 0)
            assert len(owners) == 1, (name, owners)
            owner = owners[0]
            for offset in range(start, start + size):
                for bit in range(8):
                    _flip(fh, offset, bit)
                    try:
                        loaded = load_checkpoint(path)
                    except IntegrityError as err:
                        refused += 1
                        assert (err.entry, err.expected) == (owner, _sha256(tensors[owner])), (name, offset, bit)
                        assert err.found != err.expected and re.fullmatch("[0-9a-f]{64}", err.found)
                        named.add(owner)
                    else:
                        identical += 1
                        assert _equal(loaded, original), (name, offset, bit)
                    finally:
                        _flip(fh, offset, bit)
    assert refused == 8 * sum(size for *_, size in records) and identical == 0
    assert named == set(tensors)
    assert _equal(load_checkpoint(path), original)  # every flip undone


def test_bw_load_refuses_a_flip_naming_the_file_the_tensor_and_both_digests(tmp_path):
    bnn, path, x = _saved(tmp_path)
    original = torch.load(path, weights_only=True)
    with open(path, "r+b") as fh:
        for _, start, size in _records(path):
            offset, bit = start + size - 1, 7  # the sign bit of the last element (little-endian)
            _flip(fh, offset, bit)
            (owner,) = _changed_tensors(original, path)
            found = _sha256(_leaves(torch.load(path, weights_only=True))[owner])
            with pytest.raises(IntegrityError) as err:
                bw.load(path, _mlp())
            message = str(err.value)
            assert f"checkpoint {path} is damaged: tensor {owner} has SHA-256 {found}, but the digest recorded " \
                   f"when it was written is {_sha256(_leaves(original)[owner])}" in message
            _flip(fh, offset, bit)
    loaded = bw.load(path, _mlp())
    gen = [torch.Generator().manual_seed(3) for _ in range(2)]
    assert torch.equal(loaded.predict(x, 4, generator=gen[0]), bnn.predict(x, 4, generator=gen[1]))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's note on a damaged protocol byte
def test_flips_in_the_pickled_data_are_refused_or_load_identically(tmp_path):
    """``data.pkl`` holds the plain data (wrap arguments, architecture, keys): one bit of every fifth byte flipped."""
    _, path, _ = _saved(tmp_path)
    original = torch.load(path, weights_only=True)
    ((_, start, size),) = _records(path, r"[^/]+/data\.pkl")
    outcomes = {"integrity": 0, "unreadable": 0, "identical": 0}
    with open(path, "r+b") as fh:
        for i, offset in enumerate(range(start, start + size, 5)):  # every fifth byte, each bit in turn
            _flip(fh, offset, i % 8)
            try:
                loaded = load_checkpoint(path)
            except IntegrityError as err:
                outcomes["integrity"] += 1
                assert str(path) in str(err) and err.expected != err.found
            except CheckpointError as err:  # torch's unpickler refuses it before any digest is compared
                outcomes["unreadable"] += 1
                assert str(path) in str(err)
            else:
                outcomes["identical"] += 1
                assert _equal(loaded, original), (offset, i % 8)
            finally:
                _flip(fh, offset, i % 8)
    assert sum(outcomes.values()) == len(range(0, size, 5)) and outcomes["integrity"] > 0, outcomes


def test_a_flip_in_the_digest_record_itself_is_refused(tmp_path):
    _, path, _ = _saved(tmp_path)
    ((_, start, size),) = _records(path, r"[^/]+/bayeswrap_digest\.json")
    with open(path, "r+b") as fh:
        for i, offset in enumerate(range(start, start + size, 29)):  # every 29th byte, each bit in turn
            _flip(fh, offset, i % 8)
            with pytest.raises(IntegrityError, match=f"checkpoint {re.escape(str(path))} "):
                load_checkpoint(path)
            _flip(fh, offset, i % 8)


def test_a_file_without_a_digest_loads_with_a_warning_and_the_same_predictions(tmp_path):
    bnn, path, x = _saved(tmp_path)
    old = tmp_path / "old.pt"
    torch.save(torch.load(path, weights_only=True), old)  # what bayeswrap wrote before digests
    assert not any(n.endswith("bayeswrap_digest.json") for n in zipfile.ZipFile(old).namelist())
    with pytest.warns(NoDigestWarning, match=f"checkpoint {re.escape(str(old))} has no digest of its contents"):
        loaded = bw.load(old, _mlp())
    gen = [torch.Generator().manual_seed(3) for _ in range(2)]
    assert torch.equal(loaded.predict(x, 4, generator=gen[0]), bnn.predict(x, 4, generator=gen[1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bw.load(path, _mlp())  # a file with a digest: no warning
    # plain torch.load still reads a file with a digest, unchanged
    assert _equal(torch.load(path, weights_only=True), torch.load(old, weights_only=True))


# --------------------------------------------------------------------------- run checkpoints


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert cli.main(["fit", "--method", "map", "--epochs", "1", "--num-samples", "0", "--out-dir", str(out),
                     *FAST]) == 0
    return out / "digits-mlp-map"


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_best_pt_stays_a_state_dict_that_plain_torch_load_reads(run_dir):
    state = torch.load(run_dir / "best.pt", weights_only=True)
    run = bw.load_run(run_dir)
    run.model.load_state_dict(state)  # strict: no extra key
    assert list(state) == list(run.model.state_dict())


def test_flips_of_every_tensor_in_best_and_last_are_refused(run_dir, tmp_path):
    for name in ("best.pt", "last.pt"):
        path = tmp_path / name
        shutil.copy(run_dir / name, path)
        original = torch.load(path, weights_only=True)
        with open(path, "r+b") as fh:
            for record, start, size in _records(path):
                for bit in [b for b in (*range(0, 32, 3), 31) if b < 8 * size]:  # a float32: mantissa to sign
                    _flip(fh, start + bit // 8, bit % 8)
                    with pytest.raises(IntegrityError, match=rf"checkpoint {re.escape(str(path))} is damaged: "
                                                             r"tensor \["):
                        load_checkpoint(path)
                    _flip(fh, start + bit // 8, bit % 8)
        assert _equal(load_checkpoint(path), original)


def _damaged_copy(run_dir, tmp_path, name: str):
    """A copy of the run with one exponent bit of a float32 in ``name``'s first tensor flipped.

    Returns:
        The copy, the damaged file, the key path of the tensor that changed and its saved SHA-256.
    """
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    path = run / name
    original = torch.load(path, weights_only=True)
    _, start, size = _records(path)[0]
    with open(path, "r+b") as fh:
        _flip(fh, start + size - 1, 6)  # the value changes by orders of magnitude
    (owner,) = _changed_tensors(original, path)
    return run, path, owner, _sha256(_leaves(original)[owner])


def test_load_run_predict_and_evaluate_refuse_a_damaged_best_pt(run_dir, tmp_path, capsys):
    run, best, owner, expected = _damaged_copy(run_dir, tmp_path, "best.pt")
    with pytest.raises(IntegrityError, match=rf"checkpoint {re.escape(str(best))} is damaged: tensor "
                                             rf"{re.escape(owner)} has SHA-256 [0-9a-f]{{64}}, but .* is {expected}"):
        bw.load_run(run)
    np.save(tmp_path / "x.npy", np.zeros((2, 64), dtype=np.float32))
    before = _snapshot(run)
    for argv in (["predict", str(run), str(tmp_path / "x.npy"), "--out", str(tmp_path / "p.csv")],
                 ["evaluate", str(run), "--num-samples", "0"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"checkpoint {best} is damaged: tensor {owner}" in err and expected in err and "Traceback" not in err
    assert _snapshot(run) == before and not (tmp_path / "p.csv").exists()


def test_resume_refuses_a_damaged_last_pt_and_rewrites_nothing(run_dir, tmp_path, capsys):
    run, last, owner, expected = _damaged_copy(run_dir, tmp_path, "last.pt")
    before = _snapshot(run)
    assert cli.main(["fit", "--resume", str(run), "--epochs", "2"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {last} is damaged: tensor {owner}" in err and expected in err
    assert _snapshot(run) == before


def test_a_run_without_digests_loads_with_a_warning_and_the_same_predictions(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    torch.save(torch.load(run / "best.pt", weights_only=True), run / "best.pt")  # a run of an older bayeswrap
    x = torch.rand(5, 64)
    with pytest.warns(NoDigestWarning, match=f"checkpoint {re.escape(str(run / 'best.pt'))} has no digest"):
        old = bw.load_run(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = bw.load_run(run_dir)
    assert torch.equal(old.sample_probs(x, 0), new.sample_probs(x, 0))
