"""bayeswrap.app.experiments: the optimizer a script builds for a method (its own, or the script's choice)."""

import pytest
import torch

import bayeswrap as bw
from bayeswrap.app import experiments as ex


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_own_optimizer_is_none_for_a_method_that_trains_with_any(model):
    assert ex.own_optimizer(bw.wrap(model, "vi", num_data=7), 0.1) is None


def test_own_optimizer_sgld_gets_num_data_and_options(model):
    bnn = bw.wrap(model, "sgld", num_data=7)
    opt = ex.own_optimizer(bnn, 0.01, noise_scale=0.5)
    assert isinstance(opt, bw.optim.SGLD)
    assert [g["params"] for g in opt.param_groups] == [g["params"] for g in bnn.param_groups()]
    assert opt.defaults["lr"] == 0.01 and opt.defaults["num_data"] == 7 and opt.defaults["noise_scale"] == 0.5
    assert ex.own_optimizer(bnn, 0.01, num_data=3).defaults["num_data"] == 3


def test_own_optimizer_ivon_passes_its_options(model):
    opt = ex.own_optimizer(bw.wrap(model, "ivon", num_data=7), 0.2, beta2=0.9)
    assert isinstance(opt, bw.optim.IVON) and opt.defaults["lr"] == 0.2 and opt.defaults["beta2"] == 0.9


@pytest.mark.parametrize("method, kind, text", [("map", torch.optim.Adam, "Adam(lr=0.001)"),
                                                ("sgld", bw.optim.SGLD, "bw.optim.SGLD(lr=0.002)"),
                                                ("ivon", bw.optim.IVON, "bw.optim.IVON(lr=0.1, beta2=0.99)")])
def test_make_optimizer_builds_the_methods_own_else_adam(model, method, kind, text):
    cfg = {"lr": 1e-3, "sgld_lr": 2e-3, "ivon_lr": 0.1, "ivon_beta2": 0.99}
    opt, description = ex.make_optimizer(bw.wrap(model, method, num_data=7), cfg)
    assert type(opt) is kind and description == text
