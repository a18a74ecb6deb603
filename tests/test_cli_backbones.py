"""The command-line paths that crashed: ``--params last_layer``, ``--dropout`` on torchvision models, ``--img-size``
with a timm ViT. Each works, or is refused with one line before any data are loaded. Tiny models, no weights.
"""

from __future__ import annotations

import pytest
import torch

from bayeswrap.app import cli
from bayeswrap.app.backbones import DROPOUT_FAMILIES, create_model
from bayeswrap.app.build import DataInfo, build_model, params_selector
from bayeswrap.app.config import resolve

FAST = ["--epochs", "1", "--batch-size", "128", "--num-samples", "0", "--shift-rotations", "0", "--shift-noise", "0",
        "--progress", "false"]


def _digits(num_classes: int = 8, shape=(1, 32, 32)) -> DataInfo:
    return DataInfo(dataset="digits", class_names=[str(i) for i in range(num_classes)], input_shape=list(shape),
                    image_shape=list(shape), num_train=100, steps_per_epoch=1)


def test_params_last_layer_selects_the_classifier_as_the_api_does(tmp_path, capsys):
    assert params_selector("last_layer") == " last_layer ".strip() == "last_layer"
    assert params_selector("fc.*, head.*") == ["fc.*", "head.*"] and params_selector(" ") is None
    cfg = resolve(None, {"params": "last_layer", "method": "vi"})
    bnn, head, _, model = build_model(cfg, _digits(shape=(64,)))
    assert bnn.bayesian_names == head == ["head.weight", "head.bias"]
    out = tmp_path / "runs"
    assert cli.main(["fit", "--method", "laplace", "--params", "last_layer", "--out-dir", str(out), *FAST]) == 0, \
        capsys.readouterr().err


def test_dropout_sets_every_dropout_layer_of_a_torchvision_model():
    model = create_model("tv:mobilenet_v3_small", 3, dropout=0.35)
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert layers and all(m.p == 0.35 for m in layers)
    assert all(m.p == 0.2 for m in create_model("tv:mobilenet_v3_small", 3).modules()
               if isinstance(m, torch.nn.Dropout))  # the builder's default
    with pytest.raises(ValueError, match=r"dropout=0.2: model 'tv:resnet18' has no dropout layer to set; accepted: "
                                         r"dropout 0 with this model, or a backbone with dropout: mlp"):
        create_model("tv:resnet18", 3, dropout=0.2)


def test_dropout_on_a_torchvision_model_without_dropout_is_refused_before_loading(data_loads, tmp_path, capsys):
    rc = cli.main(["fit", "--model", "tv:resnet18", "--method", "mc_dropout", "--mode", "layers", "--dropout", "0.2",
                   "--out-dir", str(tmp_path / "runs"), *FAST])
    err = capsys.readouterr().err
    assert (rc, data_loads) == (2, []), err
    assert err.startswith("bayeswrap: error: dropout=0.2: model 'tv:resnet18' has no dropout layer to set")
    assert all(family in err for family in DROPOUT_FAMILIES) and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_img_size_builds_a_timm_vit_for_that_side():
    cfg = resolve(None, {"model": "vit_tiny_patch16_224", "img_size": 32, "method": "map"})
    bnn, _, _, model = build_model(cfg, _digits())
    assert model.patch_embed.img_size == (32, 32) and model.pos_embed.shape[1] == (32 // 16) ** 2 + 1
    assert bnn(torch.rand(2, 1, 32, 32)).shape == (2, 8)
    # without --img-size the digits are 32 px (load_splits) and so is the model
    _, _, _, default = build_model(resolve(None, {"model": "vit_tiny_patch16_224", "method": "map"}), _digits())
    assert default.patch_embed.img_size == (32, 32)
    # a CNN takes any side: img_size is not passed to it
    _, _, _, cnn = build_model(resolve(None, {"model": "resnet10t", "img_size": 40, "method": "map"}),
                               _digits(shape=(1, 40, 40)))
    assert cnn(torch.rand(2, 1, 40, 40)).shape == (2, 8)


def test_img_size_reaches_the_loader_with_a_timm_vit(data_loads, tmp_path, capsys):
    rc = cli.main(["fit", "--model", "vit_tiny_patch16_224", "--img-size", "32", "--out-dir", str(tmp_path), *FAST])
    assert data_loads == ["load_data"] and rc == 1, capsys.readouterr().err


def test_img_size_builds_a_torchvision_vit_for_that_side_and_refuses_weights_of_another():
    with torch.device("meta"):  # ViT-B/16's 86M parameters, without their memory
        vit = create_model("tv:vit_b_16", 3, img_size=32)
        resnet = create_model("tv:resnet18", 3, img_size=32)  # a CNN: any side
    assert vit.image_size == 32 and vit.encoder.pos_embedding.shape[1] == (32 // 16) ** 2 + 1
    assert resnet.fc.out_features == 3
    with pytest.raises(ValueError, match=r"img_size=32: the pretrained weights of tv:vit_b_16 are for 224 px images"):
        create_model("tv:vit_b_16", 3, img_size=32, pretrained=True)  # refused before any download


def test_pretrained_torchvision_vit_at_another_side_is_refused_before_loading(data_loads, tmp_path, capsys):
    rc = cli.main(["fit", "--model", "tv:vit_b_16", "--pretrained", "--img-size", "32", "--out-dir", str(tmp_path),
                   *FAST])
    err = capsys.readouterr().err
    assert (rc, data_loads) == (2, []) and "the pretrained weights of tv:vit_b_16 are for 224 px" in err, err


def test_a_torchvision_model_takes_gray_images_with_its_first_conv_summed_over_rgb():
    """The digits are gray: torchvision's first 3-channel conv becomes 1-channel, as timm's in_chans=1 does."""
    torch.manual_seed(0)
    rgb = create_model("tv:resnet18", 3)
    torch.manual_seed(0)
    gray = create_model("tv:resnet18", 3, in_chans=1)
    assert gray.conv1.in_channels == 1 and gray.conv1.weight.shape == (64, 1, 7, 7)
    torch.testing.assert_close(gray.conv1.weight, rgb.conv1.weight.sum(dim=1, keepdim=True))
    gray.load_state_dict({k: v for k, v in rgb.state_dict().items() if not k.startswith("conv1.")}, strict=False)
    x = torch.rand(2, 1, 32, 32)
    torch.testing.assert_close(gray.eval()(x), rgb.eval()(x.expand(2, 3, 32, 32)))  # a gray image as RGB
    bnn, _, _, _ = build_model(resolve(None, {"model": "tv:resnet18", "method": "map"}), _digits())
    assert bnn(x).shape == (2, 8)
