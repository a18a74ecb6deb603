"""Ensemble members keep pretrained weights by default (``reinit="bayesian"``; ``bayeswrap.methods.reinit``).

Known answers: the weights a member does not re-draw are bit-identical to the wrapped model's after ``wrap`` and,
when no optimizer moves them (frozen, or left out of the optimizer), after ``fit`` with SGD momentum on
minibatches; a re-drawn head equals the layer's own ``reset_parameters()`` under ``init_seed + m``; with
``params=None`` on a model trained from scratch, the default equals the old ``reinit="all"`` (``reset_parameters()``
of every module, in module order, under the member's seed); a peft LoRA member's A equals peft's
kaiming-uniform (a = √5) draw in module order and its B stays 0, so every member starts at the pretrained function.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import bayeswrap as bw

pytestmark = pytest.mark.usefixtures("one_thread")

N = 96


def _pretrained(frozen: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                          nn.Linear(8, 3))
    with torch.no_grad():
        model[0].weight.fill_(0.123)  # a "pretrained" body: values no initialiser draws
        model[0].bias.copy_(torch.linspace(-1, 1, 8))
        model[1].weight.fill_(1.7)
        model[1].bias.fill_(0.5)
        model[1].running_mean.fill_(0.3)
        model[3].weight.copy_(torch.randn(8, 8) * 3.0)
    for p in model[:5].parameters():
        p.requires_grad_(not frozen)
    return model


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 6, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0)),
                                       batch_size=16, shuffle=True, generator=g)


def _weights(member) -> dict[str, torch.Tensor]:
    return {**member.theta.as_dict(), **member.point.as_dict(), **member.frozen.as_dict()}


def _body(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items() if not n.startswith("5.")}


def _assert_body_kept(ens, body):
    for member in ens.members:
        weights = {**_weights(member), **member.model_buffers.as_dict()}
        for name, value in body.items():
            if name.endswith("num_batches_tracked"):
                continue
            assert torch.equal(weights[name], value), name


def _fit(ens, groups):
    bw.fit(ens, _data(), epochs=2, optimizer=torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-3),
           progress=False)


@pytest.mark.parametrize("method", ["ensemble", "multiswag"])
def test_last_layer_ensemble_keeps_the_pretrained_body_and_redraws_the_head(method):
    model = _pretrained()
    body = _body(model)
    ens = bw.wrap(model, method, num_data=N, num_members=3, params="last_layer", init_seed=11)
    assert ens.reinit == "bayesian"
    _assert_body_kept(ens, body)
    heads = [member.theta["5.weight"].clone() for member in ens.members]
    for m, head in enumerate(heads):  # the head's own initialiser under init_seed + m
        ref = nn.Linear(8, 3)
        torch.manual_seed(11 + m)
        ref.reset_parameters()
        assert torch.equal(head, ref.weight.detach()) and torch.equal(ens.members[m].theta["5.bias"], ref.bias)
    assert not torch.equal(heads[0], heads[1])
    if method == "ensemble":  # the body left out of the optimizer: SGD with momentum moves only the heads
        _fit(ens, [g for g in ens.param_groups() if g["name"].startswith("posterior")])
        for member in ens.members:
            for name in ("0.weight", "0.bias", "1.weight", "3.weight"):
                assert torch.equal(member.point[name], body[name]), name
        assert all(not torch.equal(member.theta["5.weight"], head) for member, head in zip(ens.members, heads))


def test_frozen_body_is_bit_identical_after_wrap_and_fit():
    model = _pretrained(frozen=True)
    body = _body(model)
    for reinit in ("bayesian", "all"):
        ens = bw.wrap(model, "ensemble", num_data=N, num_members=2, reinit=reinit, init_seed=3)
        _assert_body_kept(ens, body)
        before = [member.theta["5.weight"].clone() for member in ens.members]
        assert not torch.equal(before[0], before[1])
        _fit(ens, ens.param_groups())
        for member, b in zip(ens.members, before):
            for name in ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"):
                assert torch.equal(member.frozen[name], body[name]), name
            assert not torch.equal(member.theta["5.weight"], b)  # the head trained
    assert torch.equal(model[0].weight, torch.full((8, 6), 0.123))  # the user's model untouched


def test_params_none_from_scratch_equals_the_old_reinit_all():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh(), nn.Linear(7, 2))
    ens = bw.wrap(model, "ensemble", num_data=N, num_members=2, init_seed=20)
    for m, member in enumerate(ens.members):
        ref = copy.deepcopy(model)
        torch.manual_seed(20 + m)
        for mod in ref.modules():  # the old reinit="all": every module's reset_parameters, in module order
            if hasattr(mod, "reset_parameters"):
                mod.reset_parameters()
        for name, value in ref.named_parameters():
            assert torch.equal(member.theta[name], value.detach()), name
    assert not torch.equal(ens.members[0].theta["0.weight"], ens.members[1].theta["0.weight"])


@pytest.mark.parametrize("reinit, redrawn", [
    ("5.weight", {"5.weight"}),
    (["5"], {"5.weight", "5.bias"}),
    ("5.*", {"5.weight", "5.bias"}),
    (["3.*", "5.bias"], {"3.weight", "3.bias", "5.bias"}),
    ("all", {"0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}),
    pytest.param("none", set(), marks=pytest.mark.filterwarnings("ignore:reinit='none'")),
])
def test_reinit_globs_over_parameter_and_module_names(reinit, redrawn):
    model = _pretrained()
    state = {n: t.detach() for n, t in model.named_parameters()}
    ens = bw.wrap(model, "ensemble", num_data=N, num_members=2, reinit=reinit, init_seed=5)
    changed = {n for n, t in _weights(ens.members[0]).items() if not torch.equal(t, state[n])}
    assert changed == redrawn
    assert ens.reinitialised[0] == ens.reinitialised[1] == [n for n in state if n in redrawn]


def test_reinit_refuses_frozen_only_patterns_and_bad_values():
    with pytest.raises(ValueError, match=r"reinit pattern '0\.\*' matches only frozen parameters"):
        bw.wrap(_pretrained(frozen=True), "ensemble", num_data=N, reinit="0.*")
    with pytest.raises(ValueError, match=r"reinit=\{'fc'\} is not accepted; accepted: 'bayesian'.*'\*lora_A\*'"):
        bw.wrap(_pretrained(), "ensemble", num_data=N, reinit={"fc"})
    with pytest.raises(ValueError, match=r"reinit pattern 'lora_B' matches no trainable .*did you mean '\*lora_B\*'"):
        bw.wrap(_pretrained(), "ensemble", num_data=N, reinit="lora_B")


def test_nothing_redrawn_warns_for_map_members():
    with pytest.warns(RuntimeWarning, match="reinit='none' re-initialises nothing with MAP members"):
        bw.wrap(_pretrained(), "ensemble", num_data=N, num_members=2, reinit="none")


def test_peft_lora_members_redraw_a_and_keep_b_zero_and_the_base():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))
    frozen = {n: t.detach().clone() for n, t in model.named_parameters() if not t.requires_grad}
    x = torch.randn(5, 6)
    with torch.no_grad():
        out = model(x)
    ens = bw.wrap(model, "ensemble", num_data=N, num_members=2, init_seed=9)
    lora_a = sorted(n for n, t in model.named_parameters() if "lora_A" in n)
    assert len(lora_a) == 2 and all(ens.members[0].theta[n].shape[0] == 2 for n in lora_a)
    for m, member in enumerate(ens.members):
        torch.manual_seed(9 + m)  # peft's init_lora_weights=True, layer by layer in module order
        for n in lora_a:
            ref = torch.empty_like(member.theta[n])
            nn.init.kaiming_uniform_(ref, a=math.sqrt(5))
            assert torch.equal(member.theta[n], ref), n
        assert all(not member.theta[n].any() for n in member.theta.keys() if "lora_B" in n)
        assert all(torch.equal(member.frozen[n], t) for n, t in frozen.items())
        torch.testing.assert_close(member.to_deterministic()(x), out)  # B = 0: the pretrained function
    assert not torch.equal(ens.members[0].theta[lora_a[0]], ens.members[1].theta[lora_a[0]])
    _fit(ens, ens.param_groups())
    assert all(torch.equal(member.frozen[n], t) for member in ens.members for n, t in frozen.items())
    assert any(member.theta[n].any() for member in ens.members for n in member.theta.keys() if "lora_B" in n)
