"""Tests for bayeswrap.app.backbones: backbones by name, head replacement, checkpoints, pretrained errors."""

from __future__ import annotations

import urllib.error

import pytest
import torch
from torch import nn

from bayeswrap.app.backbones import (
    DEFAULT_MLP_HIDDEN,
    MLP,
    CheckpointError,
    PretrainedWeightsError,
    available_models,
    create_model,
    data_config,
    find_head,
    head_parameter_names,
    load_checkpoint,
)

K = 5

# name, kwargs, input shape, expected head parameter names
CASES = [
    ("mlp", {"in_features": 64}, (64,), ["head.weight", "head.bias"]),
    ("resnet18", {}, (3, 32, 32), ["fc.weight", "fc.bias"]),
    ("vit_tiny_patch16_224", {"img_size": 32}, (3, 32, 32), ["head.weight", "head.bias"]),
    ("tv:resnet18", {}, (3, 32, 32), ["fc.weight", "fc.bias"]),
]


@pytest.fixture(scope="module")
def built():
    torch.manual_seed(0)
    return {name: create_model(name, K, **kw) for name, kw, _, _ in CASES}


@pytest.mark.parametrize("name,kw,shape,head_names", CASES, ids=[c[0] for c in CASES])
def test_head_replaced_and_named(built, name, kw, shape, head_names):
    model = built[name].eval()
    with torch.no_grad():
        out = model(torch.randn(2, *shape))
    assert out.shape == (2, K) and out.dtype == torch.float32
    assert head_parameter_names(model) == head_names
    params = dict(model.named_parameters())
    weight = params[head_names[0]]
    assert weight.shape[0] == K and params[head_names[1]].shape == (K,)
    path, head = find_head(model)
    assert isinstance(head, nn.Linear) and head.out_features == K and head.weight is weight
    assert path == head_names[0].rsplit(".", 1)[0]


def test_mlp_structure_and_options():
    m = create_model("mlp", 10, in_features=64)
    assert isinstance(m, MLP)
    linears = [mod for mod in m if isinstance(mod, nn.Linear)]
    assert [lin.out_features for lin in linears] == [*DEFAULT_MLP_HIDDEN, 10]
    assert m(torch.randn(3, 1, 8, 8)).shape == (3, 10)  # image-shaped input is flattened
    big = create_model("mlp", 10, in_features=64, hidden_sizes=(1000, 1000, 1000), dropout=0.1)
    assert sum(isinstance(mod, nn.Dropout) for mod in big) == 3
    assert [lin.out_features for lin in big if isinstance(lin, nn.Linear)] == [1000, 1000, 1000, 10]
    assert data_config(m) is None
    with pytest.raises(ValueError, match="in_features"):
        create_model("mlp", 10)
    with pytest.raises(ValueError, match="pretrained"):
        create_model("mlp", 10, in_features=64, pretrained=True)


def test_torchvision_head_lookup_through_attributes():
    from torchvision.models import VisionTransformer, mobilenet_v3_small

    vit = VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=8,
                            num_classes=7)
    assert find_head(vit)[0] == "heads.head" and head_parameter_names(vit) == ["heads.head.weight",
                                                                                "heads.head.bias"]
    mobile = mobilenet_v3_small()
    assert find_head(mobile)[0] == "classifier.3"  # last Linear of the classifier Sequential
    with pytest.raises(ValueError, match="head"):
        find_head(nn.Sequential(nn.Conv2d(3, 3, 1)))


def test_torchvision_mobilenet_head_replaced():
    model = create_model("tv:mobilenet_v3_small", K).eval()
    assert find_head(model)[0] == "classifier.3"
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, K)


def test_data_config(built):
    timm_cfg = data_config(built["vit_tiny_patch16_224"])
    assert timm_cfg["mean"] == (0.5, 0.5, 0.5) and len(timm_cfg["input_size"]) == 3
    tv_cfg = data_config(built["tv:resnet18"])  # from torchvision's ResNet18 weights transform
    assert tv_cfg["input_size"] == (3, 224, 224) and tv_cfg["interpolation"] == "bilinear"
    assert tv_cfg["crop_pct"] == pytest.approx(224 / 256) and tv_cfg["std"] == pytest.approx((0.229, 0.224, 0.225))


@pytest.mark.parametrize("bad,suggestion", [("resnet1800", "resnet18"), ("tv:resnet1800", "tv:resnet18"),
                                            ("vit_tiny_patch16", "vit_tiny_patch16_224")])
def test_unknown_model_suggests(bad, suggestion):
    with pytest.raises(ValueError, match="unknown") as err:
        create_model(bad, K)
    assert suggestion in str(err.value) and "tv:" in str(err.value)


def test_available_models():
    names = available_models("resnet18*")
    assert "resnet18" in names and "tv:resnet18" in names and "mlp" not in names
    assert "mlp" in available_models()


# --------------------------------------------------------------------------- checkpoints


def _assert_same_state(a: nn.Module, b: nn.Module, skip: tuple[str, ...] = ()) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert any(not k.startswith(skip) for k in sa)
    for k in sa:
        if not k.startswith(skip):
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("name,kw", [("resnet18", {}), ("mlp", {"in_features": 64})])
def test_init_checkpoint_loads_exact_weights(tmp_path, fmt, name, kw):
    torch.manual_seed(1)
    source = create_model(name, K, **kw)
    with torch.no_grad():  # make buffers (BN stats) non-default too
        for buf in source.buffers():
            if buf.is_floating_point():
                buf.uniform_()
    path = tmp_path / f"w.{fmt}"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in source.state_dict().items()}, str(path))
    else:
        torch.save({"state_dict": source.state_dict(), "epoch": 3}, path)  # a wrapped state dict
    torch.manual_seed(2)
    model = create_model(name, K, init_checkpoint=path, **kw)
    _assert_same_state(source, model)


def test_init_checkpoint_with_other_num_classes_keeps_new_head(tmp_path):
    torch.manual_seed(0)
    imagenet = create_model("tv:resnet18", 1000)
    path = tmp_path / "resnet18_imagenet.pth"
    torch.save(imagenet.state_dict(), path)
    model = create_model("tv:resnet18", K)
    fresh_head = model.fc.weight.detach().clone()
    info = load_checkpoint(model, path)
    assert not info.head_loaded and "fc.weight" not in info.loaded
    _assert_same_state(imagenet, model, skip=("fc.",))
    assert model.fc.weight.shape == (K, 512) and torch.equal(model.fc.weight, fresh_head)
    # pretrained=True with a checkpoint downloads nothing: the checkpoint supplies the weights
    again = create_model("tv:resnet18", K, pretrained=True, init_checkpoint=path)
    assert torch.equal(again.conv1.weight, imagenet.conv1.weight)


def test_same_shape_checkpoint_loads_head(tmp_path):
    src = create_model("mlp", 3, in_features=4)
    torch.save(src.state_dict(), tmp_path / "m.pt")
    info = load_checkpoint(create_model("mlp", 3, in_features=4), tmp_path / "m.pt")
    assert info.head_loaded and "head.weight" in info.loaded


def test_mismatched_checkpoint_names_file(tmp_path):
    path = tmp_path / "mlp.pt"
    torch.save(create_model("mlp", K, in_features=64).state_dict(), path)
    with pytest.raises(CheckpointError) as err:
        create_model("mlp", K, in_features=32, init_checkpoint=path)  # fc0 shape differs
    assert str(path) in str(err.value) and "fc0.weight" in str(err.value)
    with pytest.raises(CheckpointError, match="missing|unexpected"):
        create_model("mlp", K, in_features=64, hidden_sizes=(256, 256, 256), init_checkpoint=path)


def test_unreadable_checkpoints(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="garbage.safetensors"):
        create_model("mlp", K, in_features=64, init_checkpoint=garbage)
    with pytest.raises(CheckpointError, match="does not exist"):
        create_model("mlp", K, in_features=64, init_checkpoint=tmp_path / "absent.pt")
    pickled = tmp_path / "whole_model.pt"
    torch.save(nn.Linear(2, 2), pickled)  # a pickled module, refused by weights_only=True
    with pytest.raises(CheckpointError, match="weights_only"):
        create_model("mlp", K, in_features=64, init_checkpoint=pickled)
    not_tensors = tmp_path / "numbers.pt"
    torch.save({"a": 1}, not_tensors)
    with pytest.raises(CheckpointError, match="state dict"):
        create_model("mlp", K, in_features=64, init_checkpoint=not_tensors)


# --------------------------------------------------------------------------- pretrained offline


def test_torchvision_pretrained_download_failure_is_clear(monkeypatch):
    import torchvision.models._api as tv_api

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(tv_api, "load_state_dict_from_url", offline)
    with pytest.raises(PretrainedWeightsError, match="--init-checkpoint") as err:
        create_model("tv:resnet18", K, pretrained=True)
    assert "tv:resnet18" in str(err.value)


def test_timm_pretrained_download_failure_is_clear(monkeypatch):
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache("timm/resnet18.a1_in1k", "model.safetensors"), str):
        pytest.skip("resnet18 weights are cached locally")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying
    with pytest.raises(PretrainedWeightsError, match="--init-checkpoint"):
        create_model("resnet18", K, pretrained=True)
