"""The functional forward equals the module's own forward, BatchNorm included."""

import copy

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.functional import is_bias, select_parameters


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 5))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_functional_call_equals_model_including_batchnorm(mode):
    model = _cnn()
    reference = copy.deepcopy(model)
    bnn = bw.wrap(model, "map", num_data=10)
    getattr(bnn, mode)()
    getattr(reference, mode)()
    for _ in range(3):  # several steps: running statistics must evolve identically
        x = torch.randn(6, 3, 8, 8)
        out = bnn.forward_with(bnn.posterior_mean(), x)
        torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    torch.testing.assert_close(bnn.model_buffers["1.running_mean"], reference[1].running_mean, rtol=0, atol=0)
    torch.testing.assert_close(bnn.model_buffers["1.running_var"], reference[1].running_var, rtol=0, atol=0)
    assert int(bnn.model_buffers["1.num_batches_tracked"]) == (3 if mode == "train" else 0)


def test_user_model_is_never_mutated():
    model = _cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bnn = bw.wrap(model, "vi", num_data=10)
    opt = torch.optim.SGD(bnn.parameters(), lr=0.5)
    bw.fit(bnn, [(torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,)))] * 3, epochs=2, optimizer=opt, progress=False)
    bnn.predict(torch.randn(2, 3, 8, 8), num_samples=3)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert model.training  # the wrapper works on its own copy of the structure
    assert not any(p.device.type == "meta" for p in model.parameters())


def test_parameter_selection_by_glob_and_callable():
    model = _cnn()
    assert select_parameters(model, None) == ["0.weight", "0.bias", "1.weight", "1.bias", "5.weight", "5.bias"]
    assert select_parameters(model, ["5.*"]) == ["5.weight", "5.bias"]
    assert select_parameters(model, ["*.weight"]) == ["0.weight", "1.weight", "5.weight"]
    assert select_parameters(model, lambda n, p: p.dim() > 1) == ["0.weight", "5.weight"]
    bnn = bw.wrap(model, "vi", num_data=10, params=["5.*"])
    # point estimates for the rest; parameters() yields exactly what the optimizer updates
    assert len(list(bnn.parameters())) == 2 * 2 + 4
    assert bnn.point.keys() == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert is_bias("layer.0.bias") and not is_bias("layer.bias_scale")


def test_frozen_parameters_are_constants():
    model = _cnn()
    model[0].weight.requires_grad_(False)
    bnn = bw.wrap(model, "map", num_data=10)
    assert "0.weight" not in bnn.bayesian_names and "0.weight" in bnn.frozen
    assert all(p is not bnn.frozen["0.weight"] for p in bnn.parameters())


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.embed.weight  # tied, as in language models

    def forward(self, x):
        return self.out(torch.tanh(self.embed(x)))


def test_tied_parameters_stay_tied():
    torch.manual_seed(0)
    model = _Tied()
    bnn = bw.wrap(model, "vi", num_data=10, init_std=0.01)
    assert bnn.bayesian_names == ["embed.weight"]
    x = torch.randn(3, 4)
    torch.testing.assert_close(bnn.forward_with(bnn.posterior_mean(), x), model(x))
    out = bnn.loss(x, torch.tensor([0, 1, 2]))
    out.loss.backward()  # gradients flow through both uses of the tied weight
    assert bnn.mean["embed.weight"].grad.abs().sum() > 0
    assert bnn.model.out.weight is bnn.model.embed.weight and bnn.model.out.weight.is_meta
