"""Corruption shift (Hendrycks & Dietterich 2019) in the protocol of Ovadia et al. (2019).

Oracles: closed forms of the corruptions (contrast, Gaussian-noise std, impulse-noise amount), the
library's own function where it still runs (fog with numpy 1's ``np.float_``; glass blur with
scikit-image's old ``gaussian(multichannel=True)`` written with scipy), invariants of the report (the
mean curve is the mean of the per-corruption curves) and a model trained on real MNIST digits.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import scipy.ndimage as ndi
import torch
import torch.nn.functional as F

from bayeswrap.app import build as app_build
from bayeswrap.app import cli
from bayeswrap.app.config import RunConfig
from bayeswrap.data import ArrayDataset, load_data
from bayeswrap.data import corruptions as C
from bayeswrap.data.shift import CORRUPTION, _generator, shifted_dataset
from bayeswrap.evaluation import calibration, protocol

pytest.importorskip("imagecorruptions")

#: corruptions that draw random numbers (the rest are deterministic functions of the image)
RANDOM = {"gaussian_noise", "shot_noise", "impulse_noise", "glass_blur", "motion_blur", "snow", "frost", "fog",
          "elastic_transform"}
#: distortion certainly grows from severity 1 to 5: monotone closed forms (contrast, brightness, Gaussian
#: noise with the same draws) or thousands of independent pixels (shot and impulse noise)
GROWING = ("gaussian_noise", "shot_noise", "impulse_noise", "brightness", "contrast")


def _rgb(size: int = 32) -> torch.Tensor:
    """A smooth colour image with an edge (a disc on gradients), (3, size, size) in [0, 1]."""
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    disc = (((xx - 0.6) ** 2 + (yy - 0.4) ** 2) < 0.08).float()
    image = torch.stack([0.2 + 0.6 * xx, 0.8 - 0.6 * yy, 0.3 + 0.5 * disc]).clamp(0, 1)
    return (image * 255).round() / 255  # on the 8-bit grid: no rounding ties when quantised


def _gray(size: int = 28) -> torch.Tensor:
    return (_rgb(size).mean(0, keepdim=True) * 255).round() / 255


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _uint8(image: torch.Tensor) -> np.ndarray:
    return (image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()


@pytest.mark.parametrize("name", C.CORRUPTIONS)
def test_every_corruption_keeps_shape_dtype_grid_and_is_reproducible(name):
    for clean in (_rgb(32)[None], _gray(28)[None].double()):
        for severity in (1, 5):
            out = C.corrupt(clean, name, severity, _gen(0))
            assert out.shape == clean.shape and out.dtype == clean.dtype
            assert torch.equal(out, C.corrupt(clean, name, severity, _gen(0)))  # same seed, same image
            assert 0 <= float(out.min()) and float(out.max()) <= 1
            assert torch.allclose(out * 255, (out * 255).round(), atol=1e-9)  # on the 8-bit grid
            other = C.corrupt(clean, name, severity, _gen(1))
            assert torch.equal(out, other) == (name not in RANDOM)  # the seed matters exactly when it should
        assert float((out - clean).abs().mean()) > 0.005  # severity 5 visibly changes the image


@pytest.mark.parametrize("name", GROWING)
def test_distortion_grows_with_severity(name):
    for clean in (_rgb(32), _gray(28)):
        d1, d5 = (float((C.corrupt(clean, name, s, _gen(0)) - clean).abs().mean()) for s in (1, 5))
        assert d5 > d1 + 0.005, (d1, d5)


def test_contrast_closed_form_and_channel_order():
    # Hendrycks & Dietterich: x' = (x - mean_c) * c + mean_c per channel on x = k / 255, c = 0.3 at severity 2,
    # times 255 and truncated to uint8; the tensor comes back in (C, H, W) order
    for clean in (_rgb(32), _gray(32)):
        x = _uint8(clean) / 255.0
        mean = x.mean(axis=(0, 1), keepdims=True)
        expected = np.uint8(np.clip((x - mean) * 0.3 + mean, 0, 1) * 255)
        out = C.corrupt(clean, "contrast", 2, _gen(0))
        assert np.array_equal(_uint8(out), expected)
        assert float((out - clean).abs().max()) > 0.1


def test_noise_statistics_match_the_severity_constants():
    flat = torch.full((3, 32, 32), 128 / 255)
    residual = C.corrupt(flat, "gaussian_noise", 1, _gen(0)) - flat  # std c = 0.08, no clipping at mid gray
    assert abs(float(residual.std()) - 0.08) < 0.08 * 0.06 and abs(float(residual.mean())) < 0.006
    for severity, amount in ((1, 0.03), (5, 0.27)):  # salt and pepper replace each value with probability c
        changed = float((C.corrupt(flat, "impulse_noise", severity, _gen(2)) != flat).float().mean())
        assert abs(changed - amount) < 4 * np.sqrt(amount * (1 - amount) / flat.numel())


def test_fog_equals_the_library_on_numpy_with_float_(monkeypatch):
    library = C.require_library()
    image = _uint8(_rgb(40))
    mine = {s: C.corrupt_array(image, "fog", s, seed=7) for s in (1, 5)}
    monkeypatch.setattr(np, "float_", np.float64, raising=False)  # what numpy 1 had
    for severity, out in mine.items():
        np.random.seed(7)
        assert np.array_equal(out, library.corrupt(image, severity, corruption_name="fog"))


def test_glass_blur_equals_the_library_with_the_old_multichannel_gaussian(monkeypatch):
    library = C.require_library()
    image = _uint8(_rgb(32))
    mine = {s: C.corrupt_array(image, "glass_blur", s, seed=3) for s in (1, 5)}

    def old_gaussian(x, sigma, multichannel):  # skimage < 0.19: per channel, mode nearest, truncate 4
        assert multichannel is True
        return ndi.gaussian_filter(x, sigma=(sigma, sigma, 0), mode="nearest", truncate=4.0)

    monkeypatch.setattr(library.corruptions, "gaussian", old_gaussian)
    for severity, out in mine.items():
        np.random.seed(3)
        assert np.array_equal(out, library.corrupt(image, severity, corruption_name="glass_blur"))


def test_global_state_is_restored():
    import skimage
    import skimage.filters

    library = C.require_library()
    np.random.seed(123)
    before = np.random.get_state()
    for name in ("fog", "glass_blur", "impulse_noise", "snow"):
        C.corrupt_array(_uint8(_rgb(32)), name, 3, seed=5)
    after = np.random.get_state()
    assert np.array_equal(before[1], after[1]) and before[2:] == after[2:]
    assert library.corruptions.np is np and library.corruptions.sk is skimage
    assert library.corruptions.gaussian is skimage.filters.gaussian
    assert not hasattr(np, "float_") or np.__version__ < "2"


def test_small_and_non_square_images_are_resized_around_the_corruption():
    for shape in ((1, 8, 8), (3, 20, 45)):
        clean = (torch.rand(shape, generator=_gen(0)) * 255).round() / 255  # texture for the blurs to erase
        for name in ("zoom_blur", "frost", "motion_blur", "pixelate"):
            out = C.corrupt(clean, name, 5, _gen(0))
            assert out.shape == clean.shape and float((out - clean).abs().mean()) > 0.01


def test_bad_input_is_refused_with_the_accepted_values():
    with pytest.raises(ValueError, match="unknown corruption 'smoke'; accepted: gaussian_noise, shot_noise"):
        C.corrupt(_rgb(), "smoke", 1)
    for severity in (6, 1.5, True, -1, float("nan")):
        with pytest.raises(ValueError, match="accepted: an integer in 0..5"):
            C.corrupt(_rgb(), "fog", severity)
    with pytest.raises(ValueError, match="C = 1 .gray. or 3 .RGB.; got shape .2, 32, 32."):
        C.corrupt(torch.rand(2, 32, 32), "fog", 1)
    with pytest.raises(ValueError, match=r"in \[0, 1\] \(corrupt before Normalize\); got values in \[-1.2, 1.2\]"):
        C.corrupt(_rgb() * 4 - 2, "fog", 1)
    with pytest.raises(ValueError, match="finite"):
        C.corrupt(torch.full((3, 32, 32), float("nan")), "fog", 1)
    with pytest.raises(ValueError, match="uint8"):
        C.corrupt_array(np.zeros((32, 32, 3)), "fog", 1)
    clean = _rgb()
    assert torch.equal(C.corrupt(clean, "fog", 0), clean)  # severity 0: the clean image, untouched
    assert C.corruption_names("all") == C.CORRUPTIONS and C.corruption_names("") == C.corruption_names("none") == ()
    assert C.corruption_names(" fog, contrast ") == ("fog", "contrast")
    with pytest.raises(ValueError, match="unknown corruption 'smoke'; accepted: all, none, or comma-separated"):
        C.corruption_names("fog,smoke")
    with pytest.raises(ValueError, match="names fog more than once"):
        C.corruption_names("fog,fog")


def test_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "imagecorruptions", None)
    with pytest.raises(ImportError, match=r'pip install "bayeswrap\[corruptions\]"'):
        C.corrupt(_rgb(), "fog", 1)
    with pytest.raises(ValueError, match=r'shift_corruptions=.fog.: .*pip install "bayeswrap\[corruptions\]"'):
        RunConfig(shift_corruptions="fog").validate()
    RunConfig().validate()  # corruptions off: the library is never needed


def test_nothing_imports_imagecorruptions_unless_asked():
    code = "import sys, bayeswrap.app.cli; print('imagecorruptions' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_shifted_dataset_seeds_each_item_by_index():
    x = torch.stack([_gray(28).flatten(), 1 - _gray(28).flatten(), _gray(28).flatten()])
    data = ArrayDataset(x, np.array([0, 1, 0]))
    shifted = shifted_dataset(data, CORRUPTION + "snow", 3, image_shape=(1, 28, 28), seed=4)
    later = [shifted[i][0] for i in (2, 1, 0)][::-1]  # order of access does not matter
    for i in range(3):
        expected = C.corrupt(x[i].reshape(1, 28, 28), "snow", 3, _generator(4, i)).flatten()
        assert torch.equal(shifted[i][0], expected) and torch.equal(later[i], expected)
    assert not torch.equal(shifted[0][0], shifted[2][0])  # same pixels, different index: independent snow
    with pytest.raises(ValueError, match="unknown shift kind 'corruption:smoke'; choose one of: rotation, noise"):
        shifted_dataset(data, CORRUPTION + "smoke", 3, image_shape=(1, 28, 28))


def test_transform_path_corrupts_before_normalize(fake_imagefolder_root):
    splits = load_data("imagefolder", root=fake_imagefolder_root, img_size=32)
    clean = splits.test[0][0]
    out = shifted_dataset(splits.test, CORRUPTION + "contrast", 5, image_shape=None, seed=0)[0][0]
    mean, std = torch.tensor([0.485, 0.456, 0.406])[:, None, None], torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    pixels = clean * std + mean  # the [0, 1] image the corruption saw
    assert torch.allclose(out, (C.corrupt(pixels.clamp(0, 1), "contrast", 5) - mean) / std, atol=1e-5)


def test_corruption_report_mean_is_the_average_of_the_curves():
    torch.manual_seed(0)
    labels = torch.randint(0, 4, (300,))
    logits = 3 * F.one_hot(labels, 4).double() + torch.randn(300, 4, dtype=torch.float64)
    strength = {"fog": 0.6, "contrast": 1.1, "snow": 0.3}

    def predict(name, severity):  # a made-up model whose logits get noisier with severity
        noise = torch.randn(2, 300, 4, generator=_gen(severity), dtype=torch.float64)
        return (logits + strength[name] * severity * noise).softmax(-1), labels

    rep = protocol.corruption_report(predict, list(strength), [1, 3, 5], temperature=1.5, n_bins=10)
    assert rep["severity"] == [0, 1, 3, 5] and list(rep["corruptions"]) == list(strength)
    clean = calibration.report(predict("fog", 0)[0].mean(0), labels, n_bins=10)["T1"]
    for tag in ("T1", "Topt"):
        for metric in protocol.SHIFT_METRICS:
            curves = np.array([rep["corruptions"][c][tag][metric] for c in strength])
            np.testing.assert_allclose(rep["mean"][tag][metric], curves.mean(0), rtol=1e-12)
            key = metric if tag == "T1" else f"{metric}_Topt"
            assert rep["summary"][key] == pytest.approx(np.mean(rep["mean"][tag][metric][1:]), rel=1e-12)
            for c in strength:
                assert rep["summary_by_corruption"][c][key] == pytest.approx(
                    np.mean(rep["corruptions"][c][tag][metric][1:]), rel=1e-12)
    for c in strength:
        assert rep["corruptions"][c]["T1"]["nll"][0] == pytest.approx(clean["nll"])  # severity 0 = clean test set
    assert rep["corruptions"]["contrast"]["T1"]["nll"][-1] > rep["corruptions"]["snow"]["T1"]["nll"][-1]
    for bad in ([0, 1], [1, 1], [6], [], [True]):
        with pytest.raises(ValueError, match="accepted: distinct integers in 1..5"):
            protocol.corruption_report(predict, ["fog"], bad)


def test_cli_writes_per_corruption_and_mean_curves(tmp_path, fake_imagefolder_root):
    args = ["fit", "--dataset", "imagefolder", "--data-root", str(fake_imagefolder_root), "--img-size", "32",
            "--model", "mlp", "--method", "map", "--epochs", "2", "--batch-size", "4", "--num-samples", "0",
            "--optimizer", "adamw", "--lr", "0.01", "--shift-rotations", "", "--shift-noise", "0,0.5",
            "--shift-corruptions", "gaussian_noise,contrast", "--shift-severities", "1,5",
            "--out-dir", str(tmp_path), "--progress", "false"]
    assert cli.main(args) == 0
    run = tmp_path / "imagefolder-mlp-map"
    report = json.loads((run / "metrics.json").read_text())["final"]["0"]
    rep = report["corruption"]
    assert rep["severity"] == [0, 1, 5] and list(rep["corruptions"]) == ["gaussian_noise", "contrast"]
    for tag in ("T1", "Topt"):
        for metric in ("error", "nll", "ece"):
            per = np.array([rep["corruptions"][c][tag][metric] for c in ("gaussian_noise", "contrast")])
            np.testing.assert_allclose(rep["mean"][tag][metric], per.mean(0), rtol=1e-12)
            assert per[0, 0] == per[1, 0]  # both start from the clean test set
    assert rep["corruptions"]["contrast"]["T1"]["nll"][0] == pytest.approx(report["T1"]["nll"])
    assert set(rep["summary"]) == {"error", "nll", "ece", "error_Topt", "nll_Topt", "ece_Topt"}
    assert list(report["shift"]) == ["noise", "summary", "summary_by_kind"]  # rotation/noise report unchanged
    assert (run / "shift.png").stat().st_size > 10_000


@pytest.mark.parametrize("option, value, message", [
    ("--shift-corruptions", "fog,smoke", "unknown corruption 'smoke'; accepted: all, none, or comma-separated names"),
    ("--shift-severities", "0,6", "shift_severities='0,6': '0' is not valid; accepted: comma-separated distinct"),
])
def test_cli_refuses_bad_corruption_options_before_loading_data(tmp_path, capsys, monkeypatch, option, value,
                                                                 message):
    monkeypatch.setattr(app_build, "load_data", lambda *a, **k: pytest.fail("data loaded before validation"))
    assert cli.main(["fit", "--out-dir", str(tmp_path), "--shift-corruptions", "fog", option, value]) == 2
    assert message in capsys.readouterr().err


def test_cli_refuses_non_image_data_before_loading_weights(tmp_path, capsys, monkeypatch):
    real = app_build.load_data
    monkeypatch.setattr(app_build, "load_data", lambda *a, **k: dataclasses.replace(real(*a, **k), image_shape=None))
    monkeypatch.setattr(app_build, "build_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    assert cli.main(["fit", "--out-dir", str(tmp_path), "--shift-corruptions", "fog"]) == 2
    assert "image corruptions need gray or RGB images (C, H, W) with C = 1 or 3, but dataset 'digits' has inputs " \
           "of image shape None" in capsys.readouterr().err


def test_mnist_model_degrades_under_corruption(one_thread):
    """A MAP model trained on real MNIST digits upsampled to 32x32 RGB loses accuracy as severity grows."""
    import bayeswrap as bw

    splits = load_data("mnist5k", flatten=False, img_size=32, val_fraction=0.0)

    def rgb(dataset, n):
        idx = torch.arange(n) * (len(dataset) // n)
        x = dataset.inputs[idx].expand(-1, 3, -1, -1).contiguous()
        return ArrayDataset(x, np.asarray(dataset.targets)[idx.numpy()])

    train, test = rgb(splits.train, 600), rgb(splits.test, 200)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 5, stride=2), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 14 * 14, 10))
    bnn = bw.wrap(model, "map", num_data=len(train), prior_std=1.0)
    loader = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True, generator=_gen(0))
    bw.fit(bnn, loader, epochs=4, optimizer=torch.optim.AdamW(bnn.parameters(), lr=3e-3), progress=False)
    bnn.eval()

    def predict(name, severity):
        data = test if severity == 0 else shifted_dataset(test, CORRUPTION + name, severity, image_shape=None, seed=0)
        x = torch.stack([data[i][0] for i in range(len(data))])
        with torch.no_grad():
            return bnn.predict(x, num_samples=0)[None], torch.as_tensor(test.targets)

    rep = protocol.corruption_report(predict, ["gaussian_noise", "contrast"], [1, 5])
    for name in ("gaussian_noise", "contrast"):
        error = rep["corruptions"][name]["T1"]["error"]
        assert error[0] < 0.2 and error[2] > error[0] + 0.05, (name, error)
    assert torch.equal(predict("contrast", 5)[0], predict("contrast", 5)[0])  # the corrupted test set is fixed
