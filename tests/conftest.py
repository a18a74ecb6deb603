"""Shared fixtures: tiny fake datasets in torchvision's on-disk layouts (no network).

Under pytest-xdist (the README's ``-n 2``: one worker per core of a 2-core machine) each worker, and every
subprocess a test starts, runs torch with one intra-op thread and passive OpenMP waits, set before torch is
imported: two workers with two spinning threads each would oversubscribe the cores.
"""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import numpy as np
import pytest
import torch
from PIL import Image

# Pets: three breeds (class ids 1..3 as in list.txt); 4 trainval + 2 test images each.
PETS_BREEDS = ("Abyssinian", "american_bulldog", "Bengal")
# Flowers: 12 images, 1-based labels, official split ids (1-based image ids).
FLOWERS_LABELS = (1, 2, 3, 1, 2, 3, 1, 2, 3, 5, 5, 5)
FLOWERS_SETID = {"trnid": [1, 2, 3, 10], "valid": [4, 5, 6, 11], "tstid": [7, 8, 9, 12]}


def _jpeg(path: Path, seed: int, size: tuple[int, int] = (12, 10)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="JPEG")


@pytest.fixture
def make_jpeg():
    """The helper writing a small random JPEG: ``make_jpeg(path, seed, size=(w, h))``."""
    return _jpeg


@pytest.fixture
def fake_flowers_meta() -> dict:
    """What :func:`fake_flowers_root` writes: 1-based ``labels`` and the official ``setid`` ids."""
    return {"labels": list(FLOWERS_LABELS), "setid": {k: list(v) for k, v in FLOWERS_SETID.items()}}


@pytest.fixture
def fake_pets_root(tmp_path: Path) -> Path:
    """``root/oxford-iiit-pet/{images,annotations}`` as OxfordIIITPet expects; 12 trainval, 6 test."""
    base = tmp_path / "pets" / "oxford-iiit-pet"
    (base / "annotations").mkdir(parents=True)
    lines: dict[str, list[str]] = {"trainval": [], "test": []}
    for cls, breed in enumerate(PETS_BREEDS, start=1):
        species = 1 if breed[0].isupper() else 2  # cats are capitalised in the real data
        for i in range(1, 7):
            image_id = f"{breed}_{i}"
            _jpeg(base / "images" / f"{image_id}.jpg", seed=cls * 100 + i)
            lines["trainval" if i <= 4 else "test"].append(f"{image_id} {cls} {species} {i}")
    for split, rows in lines.items():
        (base / "annotations" / f"{split}.txt").write_text("\n".join(rows) + "\n")
    return tmp_path / "pets"


@pytest.fixture
def fake_flowers_root(tmp_path: Path) -> Path:
    """``root/flowers-102/{jpg/image_XXXXX.jpg, imagelabels.mat, setid.mat}`` (md5s will not match)."""
    from scipy.io import savemat

    base = tmp_path / "flowers" / "flowers-102"
    for image_id in range(1, len(FLOWERS_LABELS) + 1):
        _jpeg(base / "jpg" / f"image_{image_id:05d}.jpg", seed=image_id)
    savemat(base / "imagelabels.mat", {"labels": np.array(FLOWERS_LABELS, dtype=np.uint8)})
    savemat(base / "setid.mat", {k: np.array(v, dtype=np.uint16) for k, v in FLOWERS_SETID.items()})
    return tmp_path / "flowers"


@pytest.fixture
def skip_flowers_md5(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace only Flowers102's md5 check by an existence check (the fake .mat files differ)."""
    import os

    import torchvision.datasets.flowers102 as flowers_module

    monkeypatch.setattr(flowers_module, "check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


@pytest.fixture
def fake_imagefolder_root(tmp_path: Path) -> Path:
    """``root/train/{cat,dog,fox}`` (4 images each) and ``root/test/{cat,fox}`` (2 each; no dog)."""
    root = tmp_path / "folder"
    for split, classes, n in (("train", ("cat", "dog", "fox"), 4), ("test", ("cat", "fox"), 2)):
        for c, name in enumerate(classes):
            for i in range(n):
                _jpeg(root / split / name / f"{name}{i}.jpg", seed=1000 * c + 10 * i + len(split))
    return root


@pytest.fixture
def one_thread():
    """One intra-op thread: tiny tensors only pay for thread synchronisation, which is slow on a busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def damage_file(path, kind: str) -> bool:
    """Damages a file the ways a crash or a bad copy does: ``empty``, ``truncated`` or ``random`` bytes.

    Returns False (leaving the file alone) for any other ``kind``.
    """
    import numpy as np

    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[:300])
    elif kind == "random":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        return False
    return True


def load_script(filename: str):
    """The module ``scripts.<stem>`` of ``scripts/<filename>`` (``scripts`` is a package on pytest's pythonpath)."""
    import importlib

    return importlib.import_module(f"scripts.{Path(filename).stem}")


@pytest.fixture
def data_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The calls of the command line's data loader, each of which raises: a command that reaches the loader has
    passed every check (``rc == 1``, ``"load_data was called"`` on stderr)."""
    from bayeswrap.app import build

    calls: list[str] = []

    def load_data(*args, **kwargs):
        calls.append("load_data")
        raise RuntimeError("load_data was called")

    monkeypatch.setattr(build, "load_data", load_data)
    return calls
