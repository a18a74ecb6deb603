"""SWAG's BatchNorm update: recomputed per draw only where a Bayesian parameter feeds a BatchNorm layer, once per
draw in an evaluation, and saved with the model for θ_SWA.

Known answers: torch's own BatchNorm (the draw's weights loaded into a copy of the network, ``momentum=None``,
a train-mode pass over the first ``bn_update_batches`` training batches, then eval) per draw, a naive loop; the
predictions of the per-draw recomputation (``Sampled(forward=SWAG._forward_bn)``, the behaviour before the skip)
where no Bayesian parameter feeds a BatchNorm layer (the same statistics for every draw, so the same values);
a model written by ``bw.save`` and read by ``bw.load``, which must predict the same without the training data.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.methods.predictives import Sampled
from bayeswrap.methods.swag import SWAG

pytestmark = pytest.mark.usefixtures("one_thread")

UPDATE = 3  # bn_update_batches


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(),
                         nn.Linear(6, 3)).double()


class _Shifted(nn.Module):
    """A raw parameter added in the parent's forward, outside any submodule, before the BatchNorm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 6).double()
        self.shift = nn.Parameter(torch.zeros(6, dtype=torch.float64))
        self.bn = nn.BatchNorm1d(6).double()
        self.head = nn.Linear(6, 3).double()

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.body(x) + self.shift)))


def _data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(96, 4, generator=g, dtype=torch.float64) * 2 + 1
    y = torch.randint(0, 3, (96,), generator=g)
    return x, y, [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)], [(x[i:i + 8], y[i:i + 8])
                                                                          for i in range(64, 96, 8)]


def _fitted(model, params):
    x, y, train, _ = _data()
    bnn = bw.wrap(model, "swag", num_data=64, params=params, swa_start=2, collect_every=1, bn_update_batches=UPDATE)
    bw.fit(bnn, train, epochs=3, optimizer=torch.optim.SGD(bnn.param_groups(), lr=0.1, momentum=0.9), progress=False)
    return bnn.eval()


def _torch_reference(bnn, model, theta, x):
    """Softmax outputs of torch's own network with ``theta`` and its BatchNorm statistics recomputed."""
    net = copy.deepcopy(model)
    weights = {**bnn.point.as_dict(), **bnn.frozen.as_dict(), **theta}
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(weights[name])
        for m in net.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.momentum = None
                m.reset_running_stats()
        net.train()
        for xb, _ in _data()[2][:UPDATE]:
            net(xb)
        net.eval()
        return net(x).softmax(-1)


@pytest.mark.parametrize("model, params, fed", [
    (_net, "last_layer", []),
    (_net, ["1.weight", "1.bias"], ["4"]),  # a BatchNorm's own affine parameters feed only the later one
    (_net, None, ["1", "4"]),
    (_Shifted, ["shift"], ["bn"]),  # seen through autograd although no submodule owns it
])
def test_the_batchnorm_layers_a_bayesian_parameter_feeds(model, params, fed):
    assert _fitted(model(), params).bn_fed == fed


def test_no_bayesian_parameter_before_batchnorm_skips_the_per_draw_update_with_the_same_predictions():
    x = _data()[0][64:80]
    bnn = _fitted(_net(), "last_layer")
    calls = []
    recompute = bnn.bn_statistics
    bnn.bn_statistics = lambda theta: calls.append(1) or recompute(theta)
    fast = bnn.predict(x, num_samples=5, generator=torch.Generator().manual_seed(3))
    assert calls == []  # θ_SWA's statistics, computed when the fit ended, serve every draw
    naive = bnn.predict(x, num_samples=5, generator=torch.Generator().manual_seed(3),
                        predictive=Sampled(forward=SWAG._forward_bn))  # recomputed per draw: the old path
    assert len(calls) == 5
    torch.testing.assert_close(fast, naive, rtol=0, atol=0)
    draws = bnn.sample(5, generator=torch.Generator().manual_seed(3))
    model = _net()
    expected = torch.stack([_torch_reference(bnn, model, {n: t[s] for n, t in draws.items()}, x)
                            for s in range(5)]).mean(0)
    torch.testing.assert_close(fast, expected, rtol=0, atol=1e-12)


def test_a_fed_batchnorm_is_recomputed_once_per_draw_across_the_batches_of_an_evaluation():
    _, _, _, test = _data()
    model = _net()
    bnn = _fitted(copy.deepcopy(model), None)
    calls = []
    recompute = bnn.bn_statistics
    bnn.bn_statistics = lambda theta: calls.append(1) or recompute(theta)
    probs, _ = bw.predict_loader(bnn, test, num_samples=4, generator=torch.Generator().manual_seed(6))
    assert len(calls) == 4  # 4 draws x 4 batches, each draw's statistics made once
    draws = bnn.sample(4, generator=torch.Generator().manual_seed(6))  # one chunk: the same draws
    x = torch.cat([xb for xb, _ in test])
    per_draw = torch.stack([_torch_reference(bnn, model, {n: t[s] for n, t in draws.items()}, x) for s in range(4)])
    torch.testing.assert_close(probs, per_draw.mean(0), rtol=0, atol=1e-12)
    # not recomputing (the statistics of θ_SWA for every draw) gives something else
    unrefreshed = bnn.predict(x, num_samples=4, generator=torch.Generator().manual_seed(6),
                              predictive=Sampled(forward=SWAG._forward_mean_statistics))
    assert (unrefreshed - per_draw.mean(0)).abs().max() > 1e-3
    # outside an evaluation each predict draws afresh and recomputes per draw, as before
    calls.clear()
    bnn.predict(x[:8], num_samples=2)
    bnn.predict(x[8:], num_samples=2)
    assert len(calls) == 4
    samples, _ = bw.sample_probs_loader(bnn, test, num_samples=3, generator=torch.Generator().manual_seed(6))
    assert samples.shape == (3, 32, 3) and len(calls) == 4 + 3


def test_save_and_load_predict_without_the_training_data(tmp_path):
    x = _data()[0][64:80]
    bnn = _fitted(_net(), "last_layer")
    bw.save(bnn, tmp_path / "swag.pt")
    loaded = bw.load(tmp_path / "swag.pt", _net()).eval()
    assert loaded.bn_fed == [] and loaded._bn_loader is None
    for s in (0, 4):
        torch.testing.assert_close(loaded.predict(x, s, generator=torch.Generator().manual_seed(1)),
                                   bnn.predict(x, s, generator=torch.Generator().manual_seed(1)), rtol=0, atol=0)
    net, ref = loaded.to_deterministic(), bnn.to_deterministic()
    torch.testing.assert_close(net(x), ref(x), rtol=0, atol=0)
    halved = copy.deepcopy(loaded).float()  # the saved statistics follow .to()/.float()
    assert halved._bn_mean[1]["1.running_mean"].dtype == torch.float32
    torch.testing.assert_close(halved.predict(x.float(), 0), bnn.predict(x, 0).float(), rtol=1e-4, atol=1e-5)
    loaded.bn_update_batches = UPDATE + 1  # other statistics are asked for: they need the batches
    with pytest.raises(bw.NotFittedError, match=r"running statistics for θ_SWA, but no training loader is known.*"
                                                r"bnn\.set_bn_update_loader\(train_loader\)"):
        loaded.predict(x, 0)


def test_multiswag_members_skip_the_update_too():
    _, _, train, test = _data()
    ens = bw.wrap(_net(), "multiswag", num_data=64, num_members=2, params="last_layer", init_seed=0,
                  member_kwargs={"swa_start": 2, "collect_every": 1, "bn_update_batches": UPDATE})
    bw.fit(ens, train, epochs=3, optimizer=torch.optim.SGD(ens.param_groups(), lr=0.1, momentum=0.9),
           progress=False)
    ens.eval()
    assert [m.bn_fed for m in ens.members] == [[], []]
    probs, _ = bw.predict_loader(ens, test, num_samples=4, generator=torch.Generator().manual_seed(2))
    naive = [m.predict(x, 2, generator=torch.Generator().manual_seed(9), predictive=Sampled(forward=SWAG._forward_bn))
             for m in ens.members for x, _ in test[:1]]
    fast = [m.predict(x, 2, generator=torch.Generator().manual_seed(9)) for m in ens.members for x, _ in test[:1]]
    for a, b in zip(fast, naive):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    g = torch.Generator().manual_seed(2)  # no statistics per draw: each batch draws afresh, as outside an evaluation
    torch.testing.assert_close(probs, torch.cat([ens.predict(xb, 4, generator=g) for xb, _ in test]), rtol=0, atol=0)
