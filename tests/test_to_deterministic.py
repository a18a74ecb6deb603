"""``BayesianModel.to_deterministic()``: the posterior mean as a plain ``nn.Module``, for every registered method.

Oracle: the method's own deterministic predictive, ``predict(x, num_samples=0)`` and its
outputs before the softmax (``_mean_outputs``; LBBNN: the median probability model's,
``predict(x, 0, model="mpm")``). Invariants: the returned network shares no tensor with
the Bayesian model (changing either leaves the other as it was), and the user's model
is untouched. Ensembles have no single mean network and refuse.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.methods.ensemble import Ensemble

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:the Laplace posterior variance:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:mh.*hardly moved after warm-up:RuntimeWarning")]

N, BATCH = 64, 16
#: methods whose options are not the defaults here (small budgets; MC dropout in both modes; VI with LRT)
CASES = {
    "sgld": {"burn_in": 0, "thinning": 1},
    "swag": {"swa_start": 0, "collect_every": 1},
    "mc_dropout/layers": {"mode": "layers"},
    "vi/local_reparam": {"local_reparam": True},
}
ALL = tuple(bw.METHODS) + tuple(k for k in CASES if "/" in k)


def _model() -> nn.Module:
    """Linear → BatchNorm (non-trivial statistics) → ReLU → Dropout → Linear, in train mode."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
    net[1].running_mean.uniform_(-0.5, 0.5)
    net[1].running_var.uniform_(0.5, 2.0)
    return net


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)


def _trained(case: str) -> bw.BayesianModel:
    """The method brought to a usable posterior: a few minibatch epochs, or short chains for the samplers."""
    method = case.split("/")[0]
    x, y = _data()
    bnn = bw.wrap(_model(), method, num_data=N, prior_std=1.0, **CASES.get(case, {}))
    torch.manual_seed(2)
    if bnn.not_trained_by_fit() is not None:
        bnn.run_chains(x, y, num_samples=8, num_warmup=8, num_chains=2, generator=torch.Generator().manual_seed(0))
        return bnn.eval()
    required = type(bnn).required_optimizer
    if required is bw.optim.SGLD:
        optimizer = bw.optim.SGLD(bnn.param_groups(), lr=0.05, num_data=N)
    elif required is bw.optim.IVON:
        optimizer = bw.optim.IVON(bnn.param_groups(), lr=0.1)
    else:
        optimizer = torch.optim.SGD(bnn.param_groups(), lr=0.05, momentum=0.9)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, N, BATCH)]
    bw.fit(bnn, batches, epochs=3, optimizer=optimizer, progress=False)
    return bnn.eval()


@pytest.mark.parametrize("case", ALL)
def test_to_deterministic_is_the_deterministic_predictive_and_independent(case):
    user = _model()
    before = {k: v.clone() for k, v in user.state_dict().items()}
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        user_out = user.eval()(x)
    user.train()
    x_train, y_train = _data()
    if isinstance(bw.METHODS[case.split("/")[0]], type) and issubclass(bw.METHODS[case.split("/")[0]], Ensemble):
        bnn = bw.wrap(user, case, num_data=N, num_members=2)
        with pytest.raises(ValueError, match=r"ensemble of 2 .* members has no single set of deterministic "
                                             r"weights.*bnn.members\[m\].to_deterministic\(\)"):
            bnn.to_deterministic()
        if bnn.member == "map":  # a member deploys as its method does (MultiSWAG's need collected iterates)
            assert isinstance(bnn.members[0].to_deterministic(), nn.Sequential)
        return
    method = case.split("/")[0]
    bnn = bw.wrap(user, method, num_data=N, prior_std=1.0, **CASES.get(case, {}))  # the user's own model
    trained = _trained(case)
    bnn.load_state_dict(trained.state_dict())
    if method == "swag":
        bnn.set_bn_update_loader([(x_train[i:i + BATCH], y_train[i:i + BATCH]) for i in range(0, N, BATCH)])
    bnn.eval()
    net = bnn.to_deterministic()
    assert type(net) is nn.Sequential and not net.training
    assert not any(t.is_meta for t in [*net.parameters(), *net.buffers()])
    with torch.no_grad():
        mpm = hasattr(bnn, "mpm_mean")  # inclusion variables (LBBNN): the median probability model
        model = {"model": "mpm"} if mpm else {}
        expected = bnn.forward_with(bnn.mpm_mean(), x) if mpm else bnn._mean_outputs(x)[0]
        out = net(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(out.softmax(-1), bnn.predict(x, num_samples=0, **model), rtol=0, atol=1e-6)
        # the net is a separate copy: changing it leaves the Bayesian model as it was, and the other way round
        for t in [*net.parameters(), *net.buffers()]:
            if t.is_floating_point():
                t.add_(1.0)
        torch.testing.assert_close(bnn.predict(x, num_samples=0, **model), out.softmax(-1), rtol=0, atol=1e-6)
        changed = net(x)
        for t in bnn.state_dict().values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.add_(0.5)
        torch.testing.assert_close(net(x), changed, rtol=0, atol=0)
    # the user's model: same tensors, same mode, same outputs
    assert user.training and all(m.training for m in user.modules()) and user[3].p == 0.2
    assert all(torch.equal(before[k], v) for k, v in user.state_dict().items())
    with torch.no_grad():
        torch.testing.assert_close(user.eval()(x), user_out, rtol=0, atol=0)


def test_swag_deploys_the_batchnorm_statistics_of_its_mean():
    bnn = _trained("swag")
    net = bnn.to_deterministic()
    stats = bnn.bn_statistics(bnn.posterior_mean())
    assert not torch.equal(stats["1.running_mean"], bnn.model_buffers["1.running_mean"])
    torch.testing.assert_close(net[1].running_mean, stats["1.running_mean"], rtol=0, atol=0)
    torch.testing.assert_close(net[1].running_var, stats["1.running_var"], rtol=0, atol=0)
    bnn.bn_update_batches = 0  # the statistics of the last iterate, as predict(x, 0) then uses
    torch.testing.assert_close(bnn.to_deterministic()[1].running_mean, bnn.model_buffers["1.running_mean"])


def test_mc_dropout_means():
    """mode="params": the mixture mean (1 − p) m + p θ̄ (the weight-scaling rule); mode="layers": the weights."""
    user = _model()
    params = bw.wrap(user, "mc_dropout", num_data=N, p_drop=0.3, prior_mean="zero", bias="gaussian")
    torch.testing.assert_close(params.to_deterministic()[4].weight, 0.7 * user[4].weight, rtol=0, atol=0)
    torch.testing.assert_close(params.to_deterministic()[4].bias, user[4].bias, rtol=0, atol=0)  # no bias dropout
    layers = bw.wrap(user, "mc_dropout", num_data=N, mode="layers", layer_p=0.4)
    net = layers.to_deterministic()
    torch.testing.assert_close(net[4].weight, user[4].weight, rtol=0, atol=0)
    assert net[3].p == 0.4 and user[3].p == 0.2  # the copy carries the p it was trained with


def test_tied_weights_stay_tied_and_unready_posteriors_are_refused():
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    bnn = bw.wrap(nn.Sequential(shared, nn.Tanh(), shared), "map", num_data=N)
    net = bnn.to_deterministic()
    assert net[0].weight is net[2].weight
    x = torch.randn(5, 3)
    with torch.no_grad():
        torch.testing.assert_close(net(x), bnn.forward_with(bnn.posterior_mean(), x), rtol=0, atol=1e-6)
    for method in ("laplace", "sgld", "swag", "mh"):
        with pytest.raises(bw.NotFittedError):
            bw.wrap(_model(), method, num_data=N).to_deterministic()
