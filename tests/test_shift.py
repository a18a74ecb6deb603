"""Tests for bayeswrap.data.shift: rotation / Gaussian-noise shifts and held-out-class OOD splits."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.transforms import v2 as T2

from bayeswrap.data.datasets import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ArrayDataset,
    TransformSubset,
    build_transforms,
    load_data,
)
from bayeswrap.data.shift import (
    NOISE_STDS,
    ROTATION_ANGLES,
    SHIFTS,
    ShiftedDataset,
    apply_shift,
    gaussian_noise,
    hold_out_classes,
    rotate,
    shifted_dataset,
    shifted_transform,
)


@pytest.fixture(scope="module")
def digits():
    return load_data("digits", seed=0)


def _blob(side: int = 9) -> torch.Tensor:
    """A centred Gaussian blob, (1, side, side), peak 1 at the centre pixel."""
    r = torch.arange(side, dtype=torch.float32) - (side - 1) / 2
    return torch.exp(-(r[:, None] ** 2 + r[None, :] ** 2) / 4.0)[None]


# --------------------------------------------------------------------------- constants


def test_default_grids():
    assert SHIFTS == ("rotation", "noise")
    assert ROTATION_ANGLES == tuple(range(0, 181, 15)) and len(ROTATION_ANGLES) == 13
    assert NOISE_STDS == (0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)


# --------------------------------------------------------------------------- rotation


@pytest.mark.parametrize("angle", [0, 0.0, 360, -360, 720.0])
def test_rotation_by_multiple_of_360_is_exact_copy(angle):
    x = torch.rand(2, 3, 7, 5)
    out = rotate(x, angle)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    assert torch.equal(apply_shift(x, "rotation", angle), x)


def test_rotation_by_90_is_counter_clockwise_rot90():
    x = torch.rand(4, 3, 6, 6, dtype=torch.float32)
    out = rotate(x, 90)
    assert (out - torch.rot90(x, 1, dims=(-2, -1))).abs().max() <= 1e-6
    assert (rotate(x, -90) - torch.rot90(x, -1, dims=(-2, -1))).abs().max() <= 1e-6
    # counter-clockwise as displayed (row 0 on top): the top-right pixel moves to the top-left corner
    corner = torch.zeros(1, 5, 5)
    corner[0, 0, 4] = 1.0
    moved = rotate(corner, 90)
    assert moved[0, 0, 0] == pytest.approx(1.0, abs=1e-6) and moved.sum() == pytest.approx(1.0, abs=1e-6)


def test_rotation_by_180_twice_is_identity_on_centred_pattern():
    x = _blob(9)
    once = rotate(x, 180)
    assert torch.allclose(once, torch.flip(x, dims=(-2, -1)), atol=1e-6)
    assert torch.allclose(rotate(once, 180), x, atol=1e-6)


def test_rotation_keeps_shape_dtype_and_batches_independently():
    x = torch.rand(2, 3, 1, 8, 8, dtype=torch.float64)
    out = rotate(x, 30)
    assert out.shape == x.shape and out.dtype == torch.float64
    assert torch.equal(out[1, 2], rotate(x[1, 2], 30))
    assert out[0, 0, 0, 0, 0] == 0.0  # the corner comes from outside the image: filled with 0
    blob = _blob(15)
    assert rotate(blob, 45).sum() == pytest.approx(float(blob.sum()), rel=1e-2)  # centred mass stays
    assert rotate(torch.zeros(0, 1, 4, 4), 30).shape == (0, 1, 4, 4)


# --------------------------------------------------------------------------- noise


def test_zero_noise_is_exact_copy_without_clamping():
    x = torch.tensor([[[-0.5, 0.25], [1.5, 0.75]]])
    for out in (gaussian_noise(x, 0), gaussian_noise(x, 0.0), apply_shift(x, "noise", 0.0)):
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_noise_std_matches_on_mid_grey():
    x = torch.full((4, 1, 100, 100), 0.5)
    std = 0.05  # 10 sigma from the clamping bounds
    out = gaussian_noise(x, std, generator=torch.Generator().manual_seed(0))
    diff = (out - x).double()
    assert abs(diff.std().item() - std) <= 0.02 * std
    assert abs(diff.mean().item()) <= 4 * std / math.sqrt(diff.numel())
    assert out.shape == x.shape and out.dtype == x.dtype


def test_noise_output_stays_in_unit_interval():
    x = torch.rand(3, 16, 16)
    out = gaussian_noise(x, 1.0, generator=torch.Generator().manual_seed(1))
    assert float(out.min()) == 0.0 and float(out.max()) == 1.0  # clamping bites at std 1
    assert ((out > 0) & (out < 1)).any()


def test_noise_generator_reproducible():
    x = torch.rand(1, 8, 8)
    a = gaussian_noise(x, 0.2, generator=torch.Generator().manual_seed(3))
    b = gaussian_noise(x, 0.2, generator=torch.Generator().manual_seed(3))
    c = gaussian_noise(x, 0.2, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


# --------------------------------------------------------------------------- ShiftedDataset


def test_shifted_dataset_on_flat_digits_equals_rotating_the_image(digits):
    ds = ShiftedDataset(digits.test, "rotation", 30, digits.image_shape)
    assert len(ds) == len(digits.test) and ds.targets is digits.test.targets
    for i in (0, 7, len(ds) - 1):
        x, y = ds[i]
        expected = rotate(digits.test.inputs[i].reshape(1, 8, 8), 30).reshape(64)
        assert x.shape == (64,) and x.dtype == torch.float32 and torch.equal(x, expected)
        assert y == digits.test.targets[i]
    assert torch.equal(ds[-1][0], ds[len(ds) - 1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_shifted_dataset_on_image_digits_without_image_shape():
    s = load_data("digits", flatten=False)
    ds = ShiftedDataset(s.test, "rotation", 90, None)
    assert torch.allclose(ds[3][0], torch.rot90(s.test.inputs[3], 1, dims=(-2, -1)), atol=1e-6)


def test_shifted_dataset_noise_is_per_index_and_order_independent(digits):
    ds = ShiftedDataset(digits.test, "noise", 0.3, digits.image_shape, seed=5)
    n = 40
    forward = torch.stack([ds[i][0] for i in range(n)])
    backward = torch.stack([ds[i][0] for i in reversed(range(n))]).flip(0)
    assert torch.equal(forward, backward)
    batched = torch.cat([x for x, _ in DataLoader(ds, batch_size=7)])[:n]
    assert torch.equal(batched, forward)
    again = ShiftedDataset(digits.test, "noise", 0.3, digits.image_shape, seed=5)
    assert torch.equal(again[11][0], forward[11])
    other = ShiftedDataset(digits.test, "noise", 0.3, digits.image_shape, seed=6)
    assert not torch.equal(other[11][0], forward[11])
    noise = forward - digits.test.inputs[:n]
    assert not torch.equal(noise[0], noise[1])  # items get independent noise
    assert float(forward.min()) >= 0.0 and float(forward.max()) <= 1.0


# --------------------------------------------------------------------------- transforms


def _tiny_image(seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _unnormalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.tensor(IMAGENET_STD)[:, None, None] + torch.tensor(IMAGENET_MEAN)[:, None, None]


def test_shifted_transform_rotation_zero_equals_plain_transform():
    _, tf = build_transforms(img_size=8)
    img = _tiny_image()
    assert torch.equal(shifted_transform(tf, "rotation", 0)(img), tf(img))
    assert torch.equal(shifted_transform(tf, "noise", 0.0)(img), tf(img))


def test_shifted_transform_inserts_before_normalize_without_mutating():
    _, tf = build_transforms(img_size=8)
    before = list(tf.transforms)
    shifted = shifted_transform(tf, "rotation", 90)
    assert tf.transforms == before  # the original is untouched
    names = [type(t).__name__ for t in shifted.transforms]
    assert names[-1] == "Normalize" and len(names) == len(before) + 1
    assert names.index("Normalize") == names.index("ToTensor") + 2
    img = _tiny_image()
    clean = T.ToTensor()(T.Resize((8, 8))(img))
    expected = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(torch.rot90(clean, 1, dims=(-2, -1)))
    assert (shifted(img) - expected).abs().max() <= 1e-5


def test_shifted_transform_noise_acts_in_pixel_space():
    _, tf = build_transforms(img_size=8)
    img = _tiny_image()
    clean = T.ToTensor()(T.Resize((8, 8))(img))
    shifted = shifted_transform(tf, "noise", 0.2, seed=1)
    step = shifted.transforms[-2]
    # the new transform is exactly Normalize(step(ToTensor(Resize(img)))), step adding clipped noise
    out = shifted(img)
    assert torch.allclose(out, T.Normalize(IMAGENET_MEAN, IMAGENET_STD)(step(clean)), atol=1e-6)
    assert torch.equal(shifted(img), out)  # reproducible per image
    assert not torch.equal(shifted(_tiny_image(1)) - tf(_tiny_image(1)), out - tf(img))
    pixel = _unnormalise(out)
    assert float(pixel.min()) >= -1e-5 and float(pixel.max()) <= 1 + 1e-5
    # huge noise clips every pixel to 0 or 1 *before* normalising
    saturated = _unnormalise(shifted_transform(tf, "noise", 1e6)(img))
    assert torch.allclose(saturated, saturated.round(), atol=1e-5)
    assert {0.0, 1.0} == set(saturated.round().unique().tolist())


def test_shifted_transform_without_normalize_nested_and_v2():
    img = _tiny_image()
    plain = T.Compose([T.Resize((8, 8)), T.ToTensor()])
    shifted = shifted_transform(plain, "rotation", 90)
    assert torch.allclose(shifted(img), torch.rot90(plain(img), 1, dims=(-2, -1)), atol=1e-6)
    nested = T.Compose([T.Resize((8, 8)), T.Compose([T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])])
    inner = shifted_transform(nested, "rotation", 90).transforms[1].transforms
    assert len(inner) == 3 and isinstance(inner[0], T.ToTensor) and isinstance(inner[2], T.Normalize)
    assert repr(inner[1]) == "PixelShift(kind='rotation', intensity=90, seed=0)"
    assert len(nested.transforms[1].transforms) == 2
    v2 = T2.Compose([T2.PILToTensor(), T2.ToDtype(torch.float32, scale=True), T2.Normalize((0.5,) * 3, (0.5,) * 3)])
    out = shifted_transform(v2, "noise", 0.1)
    assert type(out) is T2.Compose and isinstance(out.transforms[-1], T2.Normalize) and len(out.transforms) == 4
    bare = shifted_transform(None, "rotation", 90)
    x = torch.rand(1, 4, 4)
    assert torch.allclose(bare(x), torch.rot90(x, 1, dims=(-2, -1)), atol=1e-6)
    with pytest.raises(ValueError, match="Image"):
        shifted_transform(T.Resize((8, 8)), "rotation", 10)(img)  # never becomes a tensor


def test_shifted_dataset_dispatch(fake_imagefolder_root, digits):
    s = load_data("imagefolder", root=fake_imagefolder_root, img_size=8)
    view = shifted_dataset(s.test, "rotation", 90, image_shape=s.image_shape)
    assert isinstance(view, TransformSubset) and view is not s.test
    assert view.dataset is s.test.dataset and view.indices == s.test.indices and view.targets == s.test.targets
    assert view.transform is not s.test.transform and len(s.test.transform.transforms) == 3
    x, y = view[1]
    assert y == s.test[1][1]
    assert torch.allclose(_unnormalise(x), torch.rot90(_unnormalise(s.test[1][0]), 1, dims=(-2, -1)), atol=1e-5)
    flat = shifted_dataset(digits.test, "noise", 0.1, image_shape=digits.image_shape, seed=2)
    assert isinstance(flat, ShiftedDataset) and flat.seed == 2 and flat[0][0].shape == (64,)


def test_shifted_transform_with_timm_eval_transform(fake_pets_root):
    cfg = {"input_size": (3, 20, 20), "interpolation": "bilinear", "mean": (0.5,) * 3, "std": (0.5,) * 3,
           "crop_pct": 0.9, "crop_mode": "center"}
    s = load_data("pets", root=fake_pets_root, data_config=cfg)
    view = shifted_dataset(s.test, "rotation", 0, image_shape=s.image_shape)
    names = [type(t).__name__ for t in view.transform.transforms]
    assert names[-1] == "Normalize" and names[-3] == "MaybeToTensor"
    assert torch.equal(view[0][0], s.test[0][0])


# --------------------------------------------------------------------------- held-out classes


def test_hold_out_classes_on_digits(digits):
    held = [7, 3]
    in_splits, ood = hold_out_classes(digits, held)
    kept = [0, 1, 2, 4, 5, 6, 8, 9]
    remap = {k: i for i, k in enumerate(kept)}
    assert in_splits.num_classes == 8 and in_splits.class_names == [str(k) for k in kept]
    assert in_splits.name == "digits" and in_splits.image_shape == (1, 8, 8) and in_splits.input_shape == (64,)
    for name in ("train", "val", "test"):
        orig, new = getattr(digits, name), getattr(in_splits, name)
        counts = Counter(orig.targets)
        assert len(new) == len(orig) - counts[3] - counts[7]
        mask = ~np.isin(orig.targets, held)
        assert new.targets == [remap[t] for t in np.asarray(orig.targets)[mask]]
        assert Counter(new.targets) == {remap[k]: counts[k] for k in kept}
        assert torch.equal(new.inputs, orig.inputs[torch.as_tensor(mask)])
        assert new.indices == np.asarray(orig.indices)[mask].tolist()
        x, y = new[0]
        assert x.shape == (64,) and y == new.targets[0]
    test_mask = np.isin(digits.test.targets, held)
    assert isinstance(ood, ArrayDataset) and len(ood) == int(test_mask.sum())
    assert Counter(ood.targets) == {k: Counter(digits.test.targets)[k] for k in held}
    assert torch.equal(ood.inputs, digits.test.inputs[torch.as_tensor(test_mask)])
    assert set(ood.indices) == {i for i, t in zip(digits.test.indices, digits.test.targets) if t in held}
    assert len(digits.test) == 540 and digits.num_classes == 10  # input untouched


def test_hold_out_classes_on_imagefolder_without_decoding(fake_imagefolder_root):
    s = load_data("imagefolder", root=fake_imagefolder_root, val_fraction=0.25, seed=0, img_size=8)

    def no_decode(path):
        raise AssertionError(f"image decoded: {path}")

    base_train, base_test = s.train.dataset, s.test.dataset
    loaders = base_train.loader, base_test.loader
    base_train.loader = base_test.loader = no_decode
    in_splits, ood = hold_out_classes(s, [0])  # hold out cat; dog -> 0, fox -> 1
    base_train.loader, base_test.loader = loaders

    assert in_splits.num_classes == 2 and in_splits.class_names == ["dog", "fox"]
    for name in ("train", "val"):
        orig, new = getattr(s, name), getattr(in_splits, name)
        assert isinstance(new, TransformSubset) and new.transform is orig.transform and new.dataset is orig.dataset
        assert len(new) == len(orig) - Counter(orig.targets)[0]
        assert new.targets == [t - 1 for t in orig.targets if t != 0]
        assert new.indices == [i for i, t in zip(orig.indices, orig.targets) if t != 0]
    assert in_splits.test.targets == [1, 1]  # the test split has cat and fox only
    paths = [base_test.samples[i][0] for i in in_splits.test.indices]
    assert all("fox" in p for p in paths)
    assert isinstance(ood, TransformSubset) and ood.targets == [0, 0] and len(ood) == 2
    assert all("cat" in base_test.samples[i][0] for i in ood.indices)
    x, y = ood[0]
    assert x.shape == (3, 8, 8) and y == 0
    x, y = in_splits.train[0]
    assert x.shape == (3, 8, 8) and y == in_splits.train.targets[0]
    assert len(s.test) == 4 and Counter(s.test.targets) == {0: 2, 2: 2}  # input untouched


def test_hold_out_classes_generic_dataset_and_empty_ood(fake_imagefolder_root, digits):
    shifted = dataclasses.replace(
        digits, **{n: ShiftedDataset(getattr(digits, n), "rotation", 30, (1, 8, 8)) for n in ("train", "val", "test")}
    )
    in_splits, ood = hold_out_classes(shifted, [9])
    assert Counter(ood.targets) == {9: Counter(digits.test.targets)[9]}
    first = int(np.flatnonzero(np.asarray(digits.test.targets) == 9)[0])
    assert torch.equal(ood[0][0], shifted.test[first][0]) and ood[0][1] == 9
    assert max(in_splits.train.targets) == 8 and len(in_splits.train[0]) == 2
    s = load_data("imagefolder", root=fake_imagefolder_root, img_size=8)
    with pytest.raises(ValueError, match=r"\[1\].*empty"):
        hold_out_classes(s, [1])  # no dog in the test split


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("angle", [float("nan"), float("inf"), -float("inf"), "30", None, True])
def test_rotate_bad_angle(angle):
    with pytest.raises(ValueError, match="angle") as err:
        rotate(torch.rand(1, 4, 4), angle)
    assert repr(angle) in str(err.value)


@pytest.mark.parametrize(
    ("images", "match"),
    [(torch.rand(4, 4), r"\(4, 4\)"), (torch.ones(1, 4, 4, dtype=torch.uint8), "torch.uint8"),
     (np.zeros((1, 4, 4)), "ndarray")],
)
def test_rotate_bad_images(images, match):
    with pytest.raises(ValueError, match=match):
        rotate(images, 10)


@pytest.mark.parametrize("std", [-0.1, float("nan"), float("inf"), "0.1", None])
def test_noise_bad_std(std):
    with pytest.raises(ValueError, match="std") as err:
        gaussian_noise(torch.rand(1, 4, 4), std)
    assert repr(std) in str(err.value)


def test_noise_bad_dtype_and_unknown_kind():
    with pytest.raises(ValueError, match="torch.int64"):
        gaussian_noise(torch.ones(1, 4, 4, dtype=torch.int64), 0.1)
    with pytest.raises(ValueError, match="'blur'") as err:
        apply_shift(torch.rand(1, 4, 4), "blur", 1.0)
    assert all(kind in str(err.value) for kind in SHIFTS)


def test_shifted_dataset_bad_arguments(digits):
    with pytest.raises(ValueError, match="'blur'"):
        ShiftedDataset(digits.test, "blur", 1.0, (1, 8, 8))
    with pytest.raises(ValueError, match="-0.5"):
        ShiftedDataset(digits.test, "noise", -0.5, (1, 8, 8))
    for shape in ((8, 8), (1, 0, 8), (1, 8.0, 8)):
        with pytest.raises(ValueError, match="image_shape") as err:
            ShiftedDataset(digits.test, "rotation", 10, shape)
        assert repr(shape) in str(err.value)
    for seed in (-1, 1.5):
        with pytest.raises(ValueError, match=f"seed.*{seed}"):
            ShiftedDataset(digits.test, "noise", 0.1, (1, 8, 8), seed=seed)
    wrong = ShiftedDataset(digits.test, "rotation", 10, (1, 9, 9))
    with pytest.raises(ValueError, match=r"\(64,\).*\(1, 9, 9\)"):
        wrong[0]
    with pytest.raises(ValueError, match="'blur'"):
        shifted_dataset(load_data("digits").test, "blur", 1.0, image_shape=(1, 8, 8))
    with pytest.raises(ValueError, match="std"):
        shifted_transform(build_transforms(img_size=8)[1], "noise", float("nan"))


@pytest.mark.parametrize(
    ("classes", "match"),
    [([10], r"\[10\].*\[0, 10\)"), ([-1, 2], r"\[-1\].*\[0, 10\)"), ([1, 1, 2], r"duplicates \[1\]"),
     (list(range(10)), "all 10 classes"), ([], "empty"), ([1.5], "1.5"), ("3", "'3'"), ([True], "True"), (3, "3")],
)
def test_hold_out_classes_bad_classes(digits, classes, match):
    with pytest.raises(ValueError, match=match) as err:
        hold_out_classes(digits, classes)
    assert "[0, 10)" in str(err.value)
