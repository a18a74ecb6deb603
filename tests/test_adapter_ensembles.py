"""One frozen base, never copied: wrapping, ensembles and SWAG of peft LoRA adapters (issue 35, items 1 and 3).

Known answers: the frozen tensors of a wrapped model are the model's own storage (``data_ptr``) and are never
written to (their version counters do not move through wrap, fit, predict, save and load); every ensemble member
shares them; the unique storage of a 5-member LoRA ensemble on a model whose base dominates is at most 1.5 times a
single LoRA model's; an ensemble trains and predicts exactly as M independently wrapped full copies of the model
(the per-member-copy implementation it replaces: member m re-initialised by peft under ``init_seed + m`` and trained
alone on the same batches); SWAG's moments, deviations and draws cover the adapters only.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bayeswrap as bw
import bayeswrap.core.modules as bw_modules
from bayeswrap.core.functional import NamedTensors, state_snapshot
from bayeswrap.methods.reinit import reinit_parameters, reinitialise

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, N, M = 96, 48, 5


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH if i else 4, WIDTH) for i in range(3))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def lora_model(seed: int = 0) -> nn.Module:
    """A pretrained-like body with LoRA (r=2) on its three hidden layers: the base is ~99% of the weights."""
    torch.manual_seed(seed)
    body = Body()
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["layers.0", "layers.1", "layers.2"])
    model = peft.get_peft_model(body, config)
    with torch.no_grad():  # a trained-looking adapter, so that predictions depend on it
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    return model


def batches():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=12)


def frozen(model):
    return {n: p for n, p in model.named_parameters() if not p.requires_grad}


def versions(model):
    return {n: p._version for n, p in frozen(model).items()}


def storages(*modules) -> int:
    """Bytes of the unique storages of every parameter and buffer of ``modules``."""
    seen = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def own(ens) -> int:
    """Bytes of the ensemble's own tensors, outside its members."""
    members = {t.untyped_storage().data_ptr() for t in [*ens.members.parameters(), *ens.members.buffers()]}
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*ens.parameters(), *ens.buffers()]}
    return sum(v for k, v in seen.items() if k not in members)


@pytest.mark.parametrize("method", ["map", "vi", "swag"])
def test_the_frozen_base_is_referenced_never_copied_nor_written(method, tmp_path):
    model = lora_model()
    before, values = versions(model), {n: p.detach().clone() for n, p in frozen(model).items()}
    options = {"swa_start": 1, "collect_every": 1} if method == "swag" else {}
    bnn = bw.wrap(model, method, num_data=N, params="adapters", **options)
    assert sorted(bnn.frozen.keys()) == sorted(frozen(model))
    for n, p in frozen(model).items():
        assert bnn.frozen[n].data_ptr() == p.data_ptr() and bnn.frozen.is_referenced(n)
    for n, t in [*bnn.point.items(), *bnn.model_buffers.items()]:  # trainable tensors and buffers are copies
        assert t.data_ptr() != model.get_parameter(n).data_ptr() if n in dict(model.named_parameters()) else True
    bw.fit(bnn, batches(), epochs=2, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1), progress=False)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(9))
    probs = bnn.predict(x, num_samples=3, generator=torch.Generator().manual_seed(1))
    bw.save(bnn, tmp_path / "bnn.pt")
    loaded = bw.load(tmp_path / "bnn.pt", model)  # the same base: the reference stays
    assert all(loaded.frozen[n].data_ptr() == p.data_ptr() for n, p in frozen(model).items())
    torch.testing.assert_close(loaded.predict(x, num_samples=3, generator=torch.Generator().manual_seed(1)), probs)
    assert versions(model) == before  # no in-place write, not even of the same values
    assert all(torch.equal(p, values[n]) for n, p in frozen(model).items())


def test_a_checkpoint_with_another_base_is_copied_in_and_the_wrapped_model_is_left_alone():
    model, other = lora_model(seed=0), lora_model(seed=1)  # different bases
    before, values = versions(model), {n: p.detach().clone() for n, p in frozen(model).items()}
    bnn = bw.wrap(model, "map", num_data=N, params="adapters")
    source = bw.wrap(other, "map", num_data=N, params="adapters")
    bnn.load_state_dict(source.state_dict())
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(bnn.predict(x, num_samples=0), source.predict(x, num_samples=0), rtol=0, atol=0)
    for n, p in frozen(model).items():  # the checkpoint's base, in tensors of bnn's own
        assert not bnn.frozen.is_referenced(n) and bnn.frozen[n].data_ptr() != p.data_ptr()
        assert torch.equal(bnn.frozen[n], frozen(other)[n])
    assert versions(model) == before and all(torch.equal(p, values[n]) for n, p in frozen(model).items())
    with pytest.raises(RuntimeError, match="size mismatch"):
        state = source.state_dict()
        key = next(k for k in state if k.startswith("frozen."))
        bw.wrap(lora_model(), "map", num_data=N, params="adapters").load_state_dict({**state, key: state[key][:1]})


def test_ensemble_members_share_one_frozen_base_and_cost_less_than_1_5_single_models():
    model = lora_model()
    before = versions(model)
    single = bw.wrap(model, "map", num_data=N, params="adapters")
    ens = bw.wrap(model, "ensemble", num_data=N, params="adapters", num_members=M, init_seed=4)
    for n, p in frozen(model).items():
        assert {member.frozen[n].data_ptr() for member in ens.members} == {p.data_ptr()}
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len({member.theta[adapters[0]].data_ptr() for member in ens.members}) == M  # adapters: one per member
    base = sum(p.numel() for p in frozen(model).values())
    assert base > 15 * sum(model.get_parameter(n).numel() for n in adapters)  # the base dominates
    assert storages(model, ens) <= 1.5 * storages(model, single)
    assert storages(model, ens) - storages(model) == M * (storages(model, single) - storages(model)) + own(ens)
    bw.fit(ens, batches(), epochs=1, optimizer=torch.optim.SGD(ens.parameters(), lr=0.1), progress=False)
    assert ens._vmap_state == "on" and all(f"member.frozen.{k}" in ens._member_state()[2]
                                           for k in ens.members[0].frozen._buffers)  # passed once, not stacked
    assert versions(model) == before
    ens.double()  # converted once: the members still share one (float64) base, now their own
    for n, p in frozen(model).items():
        ptrs = {member.frozen[n].data_ptr() for member in ens.members}
        assert len(ptrs) == 1 and p.data_ptr() not in ptrs and ens.members[0].frozen[n].dtype == torch.float64
    assert p.dtype == torch.float32


@pytest.mark.parametrize("parallel", ["auto", "sequential"])
def test_ensemble_trains_and_predicts_as_independent_full_copies(parallel):
    """The oracle is the per-member-copy ensemble: M full deep copies, re-initialised by peft and trained alone."""
    model = lora_model()
    ens = bw.wrap(model, "ensemble", num_data=N, params="adapters", num_members=3, init_seed=7, prior_std=0.5,
                  parallel=parallel)
    refs = []
    for m in range(3):
        net = copy.deepcopy(model)
        done = reinitialise(net, reinit_parameters(net, "bayesian", ens.bayesian_names), 7 + m)
        assert done == ens.reinitialised[m] and len(done) == 6
        refs.append(bw.wrap(net, "map", num_data=N, params="adapters", prior_std=0.5))
    for member, ref in zip(ens.members, refs):  # peft's init: A redrawn, B zero, base untouched
        for n, t in member.theta.items():
            torch.testing.assert_close(t, ref.theta[n], rtol=0, atol=0)
            assert (torch.count_nonzero(t) == 0) == (".lora_B." in n)
    assert not torch.equal(ens.members[0].theta[ens.bayesian_names[0]], ens.members[1].theta[ens.bayesian_names[0]])
    bw.fit(ens, batches(), epochs=3, optimizer=torch.optim.SGD(ens.parameters(), lr=0.2, momentum=0.9),
           progress=False)
    for ref in refs:
        bw.fit(ref, batches(), epochs=3, optimizer=torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9),
               progress=False)
    for member, ref in zip(ens.members, refs):
        for n, t in member.theta.items():
            torch.testing.assert_close(t, ref.theta[n], rtol=1e-5, atol=1e-6)
            assert not torch.equal(t, ens.members[0].prior.mean[n]) or ".lora_B." not in n  # B moved from zero
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(9))
    expected = torch.stack([ref.predict(x, num_samples=0) for ref in refs]).mean(0)
    torch.testing.assert_close(ens.predict(x, num_samples=3), expected, rtol=1e-5, atol=1e-6)


def test_multiswag_on_adapters_keeps_moments_deviations_and_draws_over_the_adapters_only():
    model = lora_model()
    before = versions(model)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    single = bw.wrap(model, "swag", num_data=N, params="adapters", swa_start=1, collect_every=1, max_rank=4)
    ens = bw.wrap(model, "multiswag", num_data=N, params="adapters", num_members=M, init_seed=2,
                  member_kwargs={"swa_start": 1, "collect_every": 1, "max_rank": 4})
    for bnn in (single, ens):
        bw.fit(bnn, batches(), epochs=2, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.05, momentum=0.9),
               progress=False)
    for swag in (single, *ens.members):
        assert swag.rank() == 4
        assert list(swag.moment_mean.keys()) == list(swag.moment_m2.keys()) == adapters
        assert sorted(swag.deviations.stored()) == sorted(adapters)
        for n in adapters:
            assert swag.deviations.stored()[n].shape == (4, *model.get_parameter(n).shape)
        draws = swag.sample(3, generator=torch.Generator().manual_seed(0))
        assert sorted(draws) == sorted(adapters)
    for n, p in frozen(model).items():
        assert {member.frozen[n].data_ptr() for member in ens.members} == {p.data_ptr()}
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(9))
    # a draw evaluated by the wrapped model equals the adapted model with the draw's adapters loaded
    theta = single.sample(1, generator=torch.Generator().manual_seed(5))
    net = copy.deepcopy(model)
    with torch.no_grad():
        for n, t in theta.items():
            net.get_parameter(n).copy_(t[0])
    torch.testing.assert_close(single.forward_with({n: t[0] for n, t in theta.items()}, x), net(x))
    ens.predict(x, num_samples=10, generator=torch.Generator().manual_seed(1))
    # memory: the model once, then M times one SWAG's own state (adapters, moments, K deviations), then the
    # ensemble's own prior mean of the adapters
    assert storages(model, ens) - storages(model) == M * (storages(model, single) - storages(model)) + own(ens)
    assert versions(model) == before


def test_an_initialiser_that_would_reset_a_frozen_weight_writes_into_a_stand_in():
    """reinit='all' with a frozen weight beside a trainable bias: Linear.reset_parameters() draws both; the member's
    bias equals that draw under init_seed + m (the same random numbers as on a full copy), the weight stays shared.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].weight.requires_grad_(False)
    before = versions(model)
    ens = bw.wrap(model, "ensemble", num_data=N, num_members=2, reinit="all", init_seed=5)
    for m, member in enumerate(ens.members):
        ref = copy.deepcopy(model)
        torch.manual_seed(5 + m)
        ref[0].reset_parameters()
        ref[2].reset_parameters()
        assert torch.equal(member.theta["0.bias"], ref[0].bias) and torch.equal(member.theta["2.weight"], ref[2].weight)
        assert member.frozen["0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert versions(model) == before


def test_an_ensemble_loading_another_base_uses_it_and_shares_it_again():
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(9))
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    model, other = lora_model(seed=0), lora_model(seed=1)
    before = versions(model)
    ens = bw.wrap(model, "ensemble", num_data=N, params="adapters", num_members=3, init_seed=7)
    source = bw.wrap(other, "ensemble", num_data=N, params="adapters", num_members=3, init_seed=8)
    ens.loss(x, y)  # the vmapped loss caches its view of the members' state
    ens.load_state_dict(source.state_dict())
    torch.testing.assert_close(ens.loss(x, y).loss, source.loss(x, y).loss, rtol=0, atol=0)
    torch.testing.assert_close(ens.predict(x, 3), source.predict(x, 3), rtol=0, atol=0)
    for n, p in frozen(other).items():
        ptrs = {member.frozen[n].data_ptr() for member in ens.members}
        assert len(ptrs) == 1 and p.data_ptr() not in ptrs and model.get_parameter(n).data_ptr() not in ptrs
        assert torch.equal(ens.members[2].frozen[n], p)
    assert versions(model) == before


def test_referenced_named_tensors_are_never_written_to():
    source = torch.arange(6.0).reshape(2, 3)
    held = NamedTensors({"a.w": source}, trainable=False, referenced=True)
    assert held["a.w"].data_ptr() == source.data_ptr() and held.is_referenced("a.w")
    held["a.w"] = torch.ones(2, 3)  # a new tensor of the value, not a write into the source
    assert torch.equal(source, torch.arange(6.0).reshape(2, 3)) and torch.equal(held["a.w"], torch.ones(2, 3))
    assert not held.is_referenced("a.w") and held["a.w"].data_ptr() != source.data_ptr()
    with torch.inference_mode():
        frozen_in_inference = torch.ones(3)
    copied = NamedTensors({"b": frozen_in_inference}, trainable=False, referenced=True)
    assert not copied.is_referenced("b") and not copied["b"].is_inference()
    with pytest.raises(ValueError, match="trainable=False"):
        NamedTensors({"c": source}, trainable=True, referenced=True)


def test_early_stopping_snapshots_keep_the_frozen_base_by_reference():
    model = lora_model()
    before = versions(model)
    bnn = bw.wrap(model, "map", num_data=N, params="adapters")
    snap = state_snapshot(bnn)
    assert list(snap) == list(bnn.state_dict())
    for key, value in snap.items():
        if key.startswith("frozen."):
            assert value.data_ptr() == bnn.state_dict()[key].data_ptr()
        elif isinstance(value, torch.Tensor):
            assert value.data_ptr() != bnn.state_dict()[key].data_ptr() and torch.equal(value, bnn.state_dict()[key])
    history = bw.fit(bnn, batches(), epochs=3, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.5),
                     val_loader=batches(), early_stopping_patience=3, progress=False)
    assert len(history) == 3
    assert all(bnn.frozen[n].data_ptr() == p.data_ptr() for n, p in frozen(model).items())
    assert versions(model) == before


def test_the_shared_base_is_checked_once_and_still_refused_when_not_finite(monkeypatch):
    model = lora_model()
    read = []
    original = bw_modules.nonfinite_names

    def spy(named, **options):
        named = list(named)
        read.extend(n for n, _ in named)
        return original(named, **options)

    monkeypatch.setattr(bw_modules, "nonfinite_names", spy)
    bw.wrap(model, "ensemble", num_data=N, params="adapters", num_members=3, init_seed=1)
    base = [n for n in frozen(model)]
    assert all(read.count(n) == 1 for n in base)  # the ensemble's own check, not one per member
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(read.count(n) == 4 for n in adapters)  # each member's own copies are checked
    with torch.no_grad():
        model.get_parameter(base[0]).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        bw.wrap(model, "ensemble", num_data=N, params="adapters", num_members=3, init_seed=1)
