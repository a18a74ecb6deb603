"""Inputs read correctly or refused (issue 23, section 3): image modes, decompression bombs, non-UTF-8 names,
``.npy`` headers, tuple and dict batches, narrow integer labels, NaN inputs at the loss.
"""

import csv
import os
from collections import namedtuple

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch import nn

import bayeswrap as bw
import bayeswrap.app.cli as cli
from bayeswrap.core.batches import NonFiniteInputError, batch_size, check_inputs_finite, take, to_device
from bayeswrap.data.datasets import IMAGENET_MEAN, IMAGENET_STD, image_values, load_data, read_image
from bayeswrap.data.inputs import MAX_NPY_VALUES, load_inputs
from bayeswrap.predictive import evaluate, predict_loader, sample_probs_loader

FAST = ["--batch-size", "64", "--shift-rotations", "0", "--shift-noise", "0", "--progress", "false"]


def _grey(side=2):
    """The digits runs' transform: an 8-bit grey image, resized, as a flat float vector."""
    return lambda image: TF.to_tensor(TF.resize(image.convert("L"), [side, side], antialias=True)).reshape(-1)


def _png16(path, pixels):
    Image.fromarray(np.asarray(pixels, dtype=np.uint16)).save(path)
    return path


# --------------------------------------------------------------------------- 1. image modes


def test_a_16bit_png_reads_with_its_real_range(tmp_path):
    path = _png16(tmp_path / "a.png", [[0, 32768], [65535, 257]])
    with Image.open(path) as image:
        assert image.mode == "I;16"
        values = image_values(image)
    assert values[0, 1] == pytest.approx(0.50001, abs=1e-5) and values[0, 1] == pytest.approx(32768 / 65535)
    assert values.tolist()[1] == [1.0, pytest.approx(257 / 65535)]
    # the 8-bit image the transforms read: 32768 → 128, 65535 → 255 (PIL's own convert gave 255 and 255: clipped)
    assert np.asarray(read_image(path, mode=None)).tolist() == [[0, 128], [255, 1]]
    x, names = load_inputs(path, _grey(), (4,))
    assert names == [str(path)]
    torch.testing.assert_close(x, torch.tensor([[0, 128, 255, 1]]) / 255.0)


def test_a_float_tiff_keeps_its_values_and_one_outside_0_1_is_refused(tmp_path):
    Image.fromarray(np.array([[0.25, 0.5], [1.0, 0.0]], dtype=np.float32)).save(tmp_path / "ok.tif")
    with Image.open(tmp_path / "ok.tif") as image:
        assert image.mode == "F" and image_values(image).tolist() == [[0.25, 0.5], [1.0, 0.0]]
    x, _ = load_inputs(tmp_path / "ok.tif", _grey(), (4,))
    torch.testing.assert_close(x, torch.tensor([[64, 128, 255, 0]]) / 255.0)
    Image.fromarray(np.array([[0.25, 1.5]], dtype=np.float32)).save(tmp_path / "hdr.tif")
    with pytest.raises(ValueError, match=r"image '.*hdr\.tif' is a float image \(mode 'F'\) with pixels from 0\.25 "
                                         r"to 1\.5; accepted: float pixels in \[0, 1\]"):
        load_inputs(tmp_path / "hdr.tif", _grey(), (4,))
    Image.fromarray(np.array([[0.25, np.nan]], dtype=np.float32)).save(tmp_path / "nan.tif")
    with pytest.raises(ValueError, match=r"nan\.tif' is a float image \(mode 'F'\) with 1 NaN or infinite pixels"):
        read_image(tmp_path / "nan.tif")


def test_a_32bit_integer_image_beyond_16_bits_is_refused(tmp_path):
    Image.fromarray(np.array([[0, 70000]], dtype=np.int32)).save(tmp_path / "i.tif")
    with Image.open(tmp_path / "i.tif") as image:
        assert image.mode == "I"
    with pytest.raises(ValueError, match=r"i\.tif' is a 32-bit integer image \(mode 'I'\) with pixels from 0 to "
                                         r"70000; accepted: pixels in 0\.\.65535"):
        read_image(tmp_path / "i.tif")
    Image.fromarray(np.array([[0, 32768]], dtype=np.int32)).save(tmp_path / "i16.tif")
    assert np.asarray(read_image(tmp_path / "i16.tif", mode=None)).tolist() == [[0, 128]]


def test_palette_alpha_and_cmyk_images_become_rgb_or_grey(tmp_path):
    palette = Image.new("P", (2, 1))
    palette.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    palette.putpixel((1, 0), 1)
    palette.save(tmp_path / "p.png")
    assert np.asarray(read_image(tmp_path / "p.png")).tolist() == [[[255, 0, 0], [0, 255, 0]]]
    Image.new("RGBA", (1, 1), (10, 20, 30, 0)).save(tmp_path / "rgba.png")  # alpha dropped, colour kept
    assert np.asarray(read_image(tmp_path / "rgba.png")).tolist() == [[[10, 20, 30]]]
    Image.new("LA", (1, 1), (100, 5)).save(tmp_path / "la.png")
    assert read_image(tmp_path / "la.png", mode=None).mode == "L"
    assert np.asarray(read_image(tmp_path / "la.png", mode=None)).tolist() == [[100]]
    assert np.asarray(read_image(tmp_path / "la.png")).tolist() == [[[100, 100, 100]]]
    Image.new("CMYK", (1, 1), (0, 255, 255, 0)).save(tmp_path / "cmyk.tif")
    assert np.asarray(read_image(tmp_path / "cmyk.tif")).tolist() == [[[255, 0, 0]]]
    Image.new("1", (2, 1), 1).save(tmp_path / "bw.png")
    assert np.asarray(read_image(tmp_path / "bw.png", mode=None)).tolist() == [[255, 255]]


def test_image_folder_training_reads_16bit_pngs_with_their_real_range(tmp_path):
    for split in ("train", "test"):
        for cls, level in (("dark", 8192), ("light", 32768)):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(2):
                _png16(tmp_path / split / cls / f"{i}.png", np.full((6, 6), level))
    splits = load_data("imagefolder", root=tmp_path, img_size=4, val_fraction=0.0)
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    for x, y in (splits.train[i] for i in range(len(splits.train))):
        level = round((8192 if y == 0 else 32768) / 65535 * 255)  # 32 and 128, not 255 (clipped) as before
        torch.testing.assert_close(x, ((torch.full((3, 4, 4), level / 255.0) - mean) / std))
    assert sorted(splits.train.targets) == [0, 0, 1, 1]


# --------------------------------------------------------------------------- 2. bombs and file names


@pytest.mark.parametrize("side", [12, 30])  # above PIL's warning limit (100 pixels here), above its error limit (200)
def test_a_decompression_bomb_is_a_value_error_naming_the_file_and_the_limit(tmp_path, monkeypatch, side):
    Image.new("L", (side, side)).save(tmp_path / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    message = (r"image '.*bomb\.png' is refused: it is larger than PIL's decompression-bomb limit of 100 pixels .*"
               r"raise PIL\.Image\.MAX_IMAGE_PIXELS")
    with pytest.raises(ValueError, match=message):
        load_inputs(tmp_path / "bomb.png", _grey(), (4,))
    with pytest.raises(ValueError, match=message):
        read_image(tmp_path / "bomb.png")  # the image-folder loader


def test_an_image_whose_name_is_not_utf8_is_read(tmp_path):
    name = os.fsdecode(b"caf\xe9.png")
    Image.new("L", (2, 2), 51).save(tmp_path / name)
    x, names = load_inputs(tmp_path / name, _grey(), (4,))
    torch.testing.assert_close(x, torch.full((1, 4), 0.2))
    assert names == [str(tmp_path / "caf\\xe9.png")]
    x, names = load_inputs(tmp_path, _grey(), (4,))  # in a folder too
    assert names == [str(tmp_path / "caf\\xe9.png")] and x.shape == (1, 4)
    names[0].encode("utf-8")  # printable into a UTF-8 CSV


# --------------------------------------------------------------------------- 3. .npy files


@pytest.mark.parametrize("array, reason", [
    (np.zeros((2, 3), complex), r"complex128: complex numbers \(a model input is real\)"),
    (np.zeros((2, 3), "m8[s]"), r"timedelta64\[s\]: time spans"),
    (np.zeros((2, 3), "M8[D]"), r"datetime64\[D\]: dates"),
    (np.array([["a", "b", "c"]]), r"<U1: text strings"),
    (np.zeros(2, dtype=[("a", "f4", 3)]), r"\[\('a', '<f4', \(3,\)\)\]: structured records or raw bytes"),
])
def test_npy_of_a_non_numeric_dtype_is_refused_with_the_reason(tmp_path, array, reason):
    np.save(tmp_path / "x.npy", array)
    with pytest.raises(ValueError, match=rf"inputs '.*x\.npy' hold dtype {reason}.*; accepted: a numeric array of "
                                         r"bool, integer or float dtype"):
        load_inputs(tmp_path / "x.npy", None, (3,))


class _Planted:
    def __reduce__(self):
        return (open, (os.environ["PLANTED_PATH"], "w"))


def test_npy_of_objects_is_refused_and_never_unpickled(tmp_path, monkeypatch):
    planted = tmp_path / "planted"
    monkeypatch.setenv("PLANTED_PATH", str(planted))
    np.save(tmp_path / "x.npy", np.array([[_Planted()] * 3], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"hold dtype object: Python objects \(reading them would unpickle, which "
                                         r"bayeswrap never does\)"):
        load_inputs(tmp_path / "x.npy", None, (3,))
    assert not planted.exists()


def test_npy_header_claiming_1e9_rows_is_refused_before_reading(tmp_path, monkeypatch):
    with open(tmp_path / "huge.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": (10**9, 3)})
        f.write(b"\0" * 12)
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("the data was read"))
    with pytest.raises(ValueError, match=rf"huge\.npy': the header claims shape \(1000000000, 3\) \(3000000000 values\); "
                                         rf"accepted: at most {MAX_NPY_VALUES} values"):
        load_inputs(tmp_path / "huge.npy", None, (3,))
    with open(tmp_path / "short.npy", "wb") as f:
        np.lib.format.write_array_header_2_0(f, {"descr": "<f4", "fortran_order": False, "shape": (1000, 3)})
        f.write(b"\0" * 12)
    with pytest.raises(ValueError, match=r"short\.npy' are truncated: the header claims shape \(1000, 3\) of float32 "
                                         r"\(12000 bytes\) but the file holds 12 bytes of data"):
        load_inputs(tmp_path / "short.npy", None, (3,))
    (tmp_path / "junk.npy").write_bytes(b"\x93NUMPY\x01\x00\x10\x00{'descr': <f4}  \n")
    with pytest.raises(ValueError, match=r"junk\.npy' cannot be read as a \.npy array"):
        load_inputs(tmp_path / "junk.npy", None, (3,))


def test_npy_uint8_is_scaled_as_pixels_and_other_dtypes_are_values(tmp_path):
    np.save(tmp_path / "u8.npy", np.array([[0, 128, 255]], dtype=np.uint8))
    x, names = load_inputs(tmp_path / "u8.npy", None, (3,))
    torch.testing.assert_close(x, torch.tensor([[0.0, 128 / 255, 1.0]]))
    assert x[0, 1].item() == pytest.approx(0.50196, abs=1e-5) and names == ["u8.npy[0]"]
    np.save(tmp_path / "i16.npy", np.array([[0, 128, 255]], dtype=np.int16))
    assert load_inputs(tmp_path / "i16.npy", None, (3,))[0].tolist() == [[0.0, 128.0, 255.0]]
    np.save(tmp_path / "b.npy", np.array([True, False, True]))
    assert load_inputs(tmp_path / "b.npy", None, (3,))[0].tolist() == [[1.0, 0.0, 1.0]]
    np.save(tmp_path / "big.npy", np.array([[1e300, 0, 0]]))
    with pytest.raises(ValueError, match=r"hold NaN or infinite values \(or values beyond float32's range\)"):
        load_inputs(tmp_path / "big.npy", None, (3,))


# --------------------------------------------------------------------------- 4. tuple and dict inputs, labels


class _Two(nn.Module):
    """``model(x1, x2)``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 6), nn.Linear(2, 6), nn.Linear(6, 3)

    def forward(self, x1, x2):
        return self.head(torch.tanh(self.a(x1) + self.b(x2)))


class _Named(_Two):
    """Takes named tensors as keyword arguments (``model(**d)``, how bayeswrap calls a model on a dict) or as one
    mapping (``model(d)``)."""

    def forward(self, inputs=None, **named):
        d = named if inputs is None else inputs
        return super().forward(d["a"], d["b"])


class _Keywords(_Two):
    """``model(**d)`` only, as a Hugging Face model."""

    def forward(self, a, b):
        return super().forward(a, b)


def _structured(kind, n=24, label_dtype=torch.int32):
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)
    y = torch.randint(0, 3, (n,), generator=g).to(label_dtype)
    make = (lambda s: (x1[s], x2[s])) if kind == "tuple" else (lambda s: {"a": x1[s], "b": x2[s]})
    return [(make(slice(i, i + 8)), y[i:i + 8]) for i in range(0, n, 8)], (x1, x2, y)


@pytest.mark.parametrize("kind, model", [("tuple", _Two), ("dict", _Named)])
@pytest.mark.parametrize("method, options", [("map", {}), ("vi", {}), ("laplace", {}),
                                             ("laplace", {"curvature_backend": "vmap"}),
                                             ("laplace", {"hessian_structure": "kron"}),
                                             ("laplace", {"hessian_structure": "full"}),
                                             ("swag", {"swa_start": 0.5}), ("ensemble", {"num_members": 2}),
                                             ("ensemble", {"num_members": 2, "parallel": "sequential"})])
def test_tuple_and_dict_batches_with_int32_labels_work_everywhere(kind, model, method, options):
    loader, (x1, x2, y) = _structured(kind)
    torch.manual_seed(0)
    bnn = bw.wrap(model(), method, num_data=24, **options)
    history = bw.fit(bnn, loader, epochs=2, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.05),
                     val_loader=loader, progress=False)
    assert len(history) == 2 and all(np.isfinite(r["val_nll"]) for r in history)
    if method == "laplace":
        assert bool(bnn.curvature_fitted) and bnn.fit_curvature(loader) is bnn
    out = bnn.loss(loader[0][0], loader[0][1])
    assert out.logits.shape == (8, 3) and torch.isfinite(out.loss)
    probs, targets = predict_loader(bnn, loader, 0)
    assert targets.dtype == torch.int64 and torch.equal(targets, y.long())
    whole = (x1, x2) if kind == "tuple" else {"a": x1, "b": x2}
    torch.testing.assert_close(probs, bnn.predict(whole, num_samples=0))
    scores = evaluate(bnn, loader, 2)
    assert 0 <= scores["error"] <= 1 and np.isfinite(scores["nll"])
    samples, targets = sample_probs_loader(bnn, loader, 2, generator=torch.Generator().manual_seed(0))
    assert samples.shape == (2, 24, 3) and targets.dtype == torch.int64
    torch.testing.assert_close(samples.sum(-1), torch.ones(2, 24))


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int8])
def test_narrow_integer_labels_are_accepted(dtype):
    loader, (_, _, y) = _structured("tuple", label_dtype=dtype)
    bnn = bw.wrap(_Two(), "map", num_data=24)
    bw.fit(bnn, loader, epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.05), progress=False)
    reference = bnn.loss(loader[0][0], loader[0][1].long())
    torch.testing.assert_close(bnn.loss(loader[0][0], loader[0][1]).nll, reference.nll)
    assert torch.equal(predict_loader(bnn, loader, 0)[1], y.long())


def test_dict_inputs_are_passed_as_keyword_arguments():
    loader, _ = _structured("dict")
    bnn = bw.wrap(_Keywords(), "map", num_data=24)
    assert bnn.loss(*loader[0]).logits.shape == (8, 3)
    bw.fit(bnn, loader, epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.05), progress=False)
    x = loader[0][0]
    theta = {n: t.detach() for n, t in bnn.theta.items()}
    # model(**x) equals the positional call model(a, b)
    torch.testing.assert_close(bnn.forward_with(theta, x), bnn.forward_with(theta, (x["a"], x["b"])), rtol=0, atol=0)


def test_the_device_move_helper_keeps_nested_structures():
    Pair = namedtuple("Pair", "left right")
    x = {"ids": torch.ones(4, 2), "parts": (torch.zeros(4), [torch.ones(4, 1), "flag"]), "pair": Pair(torch.ones(4), 3)}
    moved = to_device(x, "meta")
    assert moved["ids"].is_meta and moved["parts"][0].is_meta and moved["parts"][1][0].is_meta
    assert isinstance(moved["parts"], tuple) and isinstance(moved["parts"][1], list) and moved["parts"][1][1] == "flag"
    assert isinstance(moved["pair"], Pair) and moved["pair"].left.is_meta and moved["pair"].right == 3
    assert batch_size(x) == 4 and take(x, slice(1, 3))["parts"][1][0].shape == (2, 1)
    bad = {"ids": torch.ones(4, 2), "parts": (torch.zeros(4), [torch.tensor([1.0, float("inf")])])}
    with pytest.raises(NonFiniteInputError, match=r"x\['parts'\]\[1\]\[0\] \(shape \(2,\)\) contains 1 non-finite"):
        check_inputs_finite(bad)
    with pytest.raises(ValueError, match=r"hold no tensor with a batch dimension"):
        batch_size(("text",))


@pytest.fixture(scope="module")
def map_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hardening")
    assert cli.main(["fit", "--method", "map", "--epochs", "1", "--out-dir", str(out), *FAST]) == 0
    return out / "digits-mlp-map"


def test_loaded_run_sample_probs_accepts_numpy_integers_and_float64(map_run):
    run = bw.load_run(map_run)
    x = np.random.default_rng(0).integers(0, 2, (5, 64))
    reference = run.sample_probs(torch.as_tensor(x, dtype=torch.float32), 0)
    torch.testing.assert_close(run.sample_probs(x, np.int64(0)), reference)  # int64 array, numpy integer S
    torch.testing.assert_close(run.sample_probs(x.astype(np.float64), 0, batch_size=np.int32(2)), reference)
    torch.testing.assert_close(run.sample_probs(x.astype(np.int32)[::-1].copy()[::-1], 0), reference)  # strided
    assert run.sample_probs(x, np.int64(3), seed=1).shape == (3, 5, 8)
    with pytest.raises(ValueError, match=r"num_samples=.*-1\)? must be an integer >= 0"):
        run.sample_probs(x, np.int64(-1))
    with pytest.raises(ValueError, match=r"inputs of type ndarray cannot be read as numbers"):
        run.sample_probs(np.array([[object()] * 64]), 0)


def test_predict_reads_a_16bit_png_with_a_non_utf8_name_into_the_csv(map_run, tmp_path):
    name = os.fsdecode(b"d\xefgit.png")
    _png16(tmp_path / name, np.full((8, 8), 32768))
    out = tmp_path / "p.csv"
    assert cli.main(["predict", str(map_run), str(tmp_path / name), "--num-samples", "0", "--out", str(out)]) == 0
    (row,) = list(csv.DictReader(open(out, encoding="utf-8")))
    assert row["input"] == str(tmp_path / "d\\xefgit.png")
    run = bw.load_run(map_run)
    expected = run.sample_probs(torch.full((1, 64), 128 / 255), 0).mean(0)[0]
    assert [float(row[f"prob_{c}"]) for c in run.class_names] == pytest.approx(expected.tolist(), abs=1e-6)


# --------------------------------------------------------------------------- 5. NaN inputs at the loss


@pytest.mark.parametrize("method", ["map", "vi", "laplace", "mc_dropout"])
def test_loss_refuses_non_finite_inputs(method):
    loader, _ = _structured("tuple")
    bnn = bw.wrap(_Two(), method, num_data=24)
    (x1, x2), y = loader[0]
    x2 = x2.clone()
    x2[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"loss: x\[1\] \(shape \(8, 2\)\) contains 1 non-finite values \(NaN or inf\); "
                                         r"accepted: finite inputs"):
        bnn.loss((x1, x2), y)
    plain = bw.wrap(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)), method, num_data=8)
    with pytest.raises(ValueError, match=r"loss: x \(shape \(2, 3\)\) contains 2 non-finite values"):
        plain.loss(torch.tensor([[0.0, float("inf"), 1.0], [float("-inf"), 0.0, 0.0]]), torch.tensor([0, 1]))
    assert torch.isfinite(bnn.loss((x1, loader[0][0][1]), y).loss)


@pytest.mark.parametrize("parallel", ["vmap", "sequential"])
def test_an_ensembles_loss_reads_narrow_labels_and_names_nan_inputs(parallel):
    loader, _ = _structured("tuple", label_dtype=torch.int32)
    bnn = bw.wrap(_Two(), "ensemble", num_data=24, num_members=3, parallel=parallel)
    (x1, x2), y = loader[0]
    torch.testing.assert_close(bnn.loss((x1, x2), y).loss, bnn.loss((x1, x2), y.long()).loss)
    x1 = x1.clone()
    x1[2, 1] = float("nan")
    with pytest.raises(NonFiniteInputError, match=r"loss: .*x\[0\] \(shape \(8, 3\)\) contains 1 non-finite"):
        bnn.loss((x1, x2), y)
