"""The fused hot path gives the same loss and gradients as the plain autograd reference."""

import pytest
import torch
from torch import nn

import bayeswrap as bw


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def _loss_and_grads(bnn, seed):
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.arange(8) % 5
    torch.manual_seed(seed)
    out = bnn.loss(x, y)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in bnn.named_parameters()}


@pytest.mark.parametrize("kwargs", [{}, {"bias": "uninformative"}, {"params": ["4.*"]},
                                    {"prior_mean": "zero", "prior_std": 0.3, "kl_weight": 0.2}])
def test_vi_fused_equals_reference(kwargs):
    model = _model().double()
    ref = bw.wrap(model, "vi", num_data=50, init_std=0.05, fused=False, **kwargs)
    fast = bw.wrap(model, "vi", num_data=50, init_std=0.05, fused=True, **kwargs)
    with torch.no_grad():  # move means off the prior mean so every KL term is non-trivial
        for (_, a), (_, b) in zip(ref.named_parameters(), fast.named_parameters()):
            a.add_(0.01 * torch.randn(a.shape, generator=torch.Generator().manual_seed(a.numel()), dtype=a.dtype))
            b.copy_(a)
    (o1, g1), (o2, g2) = _loss_and_grads(ref, 7), _loss_and_grads(fast, 7)
    torch.testing.assert_close(o2.loss, o1.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o2.kl, o1.kl, rtol=1e-12, atol=1e-10)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("method, kwargs", [("map", {}), ("map", {"bias": "uninformative"}),
                                            ("mc_dropout", {"p_drop": 0.3, "bias": "gaussian"}),
                                            ("mc_dropout", {"p_drop": 0.3, "bias": "ignore"})])
def test_fused_gaussian_penalty_equals_reference(method, kwargs):
    model = _model().double()
    bnn = bw.wrap(model, method, num_data=50, prior_std=0.4, prior_mean="zero", **kwargs)
    theta = bnn.theta.as_dict()
    scale = {n: 1 - p for n, p in bnn.drop_prob.items()} if method == "mc_dropout" else None
    values, grads = [], []
    for fused in (True, False):
        for p in bnn.parameters():
            p.grad = None
        value = bnn.prior.penalty(theta, scale=scale, fused=fused)
        (3.0 * value).backward()
        values.append(value.detach())
        grads.append({n: torch.zeros_like(t) if t.grad is None else t.grad.clone() for n, t in theta.items()})
    torch.testing.assert_close(values[0], values[1], rtol=1e-12, atol=0)
    for n in theta:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-12, atol=0, msg=n)


@pytest.mark.parametrize("kwargs", [{}, {"bias": "gaussian"}, {"bias": "uninformative"}, {"bias": "ignore"},
                                    {"params": ["4.*"], "p_drop": 0.5}])
def test_mc_dropout_fused_equals_reference(kwargs):
    model = _model().double()
    kwargs = {"p_drop": 0.3, **kwargs}
    ref = bw.wrap(model, "mc_dropout", num_data=50, prior_std=0.4, fused=False, **kwargs)
    fast = bw.wrap(model, "mc_dropout", num_data=50, prior_std=0.4, fused=True, **kwargs)
    with torch.no_grad():  # move m off θ̄ so that dropping a weight changes it and the penalty is non-trivial
        for (_, a), (_, b) in zip(ref.named_parameters(), fast.named_parameters()):
            a.add_(0.05 * torch.randn(a.shape, generator=torch.Generator().manual_seed(a.numel()), dtype=a.dtype))
            b.copy_(a)
    (o1, g1), (o2, g2) = _loss_and_grads(ref, 7), _loss_and_grads(fast, 7)
    assert o1.kl.item() > 0
    torch.testing.assert_close(o2.loss, o1.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o2.kl, o1.kl, rtol=1e-12, atol=1e-12)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-10, atol=1e-12, msg=n)


def _big_mlp():
    torch.manual_seed(0)  # 2 x 600 x 600 weights: > RNG_CHUNK elements, several buckets and RNG streams
    return nn.Sequential(nn.Linear(20, 600), nn.ReLU(), nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 600),
                         nn.ReLU(), nn.Linear(600, 5))


@pytest.mark.parametrize("method", ["vi", "mc_dropout"])
def test_fused_equals_reference_across_buckets_and_rng_streams(method):
    from bayeswrap import fused

    model = _big_mlp().double()
    count = sum(p.numel() for p in model.parameters())
    assert count > 2 * fused.RNG_CHUNK and len(fused.buckets(list(model.parameters()))) > 2
    opts = {"init_std": 0.05} if method == "vi" else {"p_drop": 0.2}
    ref = bw.wrap(model, method, num_data=50, prior_std=0.5, fused=False, **opts)
    fast = bw.wrap(model, method, num_data=50, prior_std=0.5, fused=True, **opts)
    x = torch.randn(6, 20, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.arange(6) % 5
    grads = []
    for bnn in (ref, fast):
        torch.manual_seed(11)
        out = bnn.loss(x, y)
        out.loss.backward()
        grads.append((out.loss.detach(), {n: p.grad.clone() for n, p in bnn.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-12, atol=1e-12)
    for n in grads[0][1]:
        torch.testing.assert_close(grads[1][1][n], grads[0][1][n], rtol=1e-10, atol=1e-12, msg=n)


def test_random_buckets_are_iid_and_independent_of_the_thread_count():
    from scipy import stats

    from bayeswrap import fused

    refs = [torch.empty(700, 900), torch.empty(300), torch.empty(500, 600)]  # 930,300 elements, 4 RNG streams
    groups = fused.buckets(refs)
    draws = {}
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for kind in ("normal", "uniform"):
                torch.manual_seed(5)
                draws[t, kind] = torch.cat(fused.random_buckets(refs, groups, kind))
    finally:
        torch.set_num_threads(threads)
    for kind in ("normal", "uniform"):
        assert torch.equal(draws[1, kind], draws[2, kind])
    z, u = draws[1, "normal"].double(), draws[1, "uniform"].double()
    assert z.numel() == u.numel() == 930_300
    # moments within 5 standard errors, and the whole sample against the exact CDF
    assert abs(z.mean()) < 5 / z.numel() ** 0.5 and abs(z.var() - 1) < 5 * (2 / z.numel()) ** 0.5
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-4
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-4
    # neighbouring streams are not copies or shifts of each other
    chunk = fused.RNG_CHUNK
    corr = torch.corrcoef(torch.stack([z[:chunk], z[chunk:2 * chunk]]))[0, 1]
    assert abs(corr) < 5 / chunk**0.5
    torch.manual_seed(5)
    again = torch.cat(fused.random_buckets(refs, groups, "normal"))
    assert torch.equal(again, draws[1, "normal"])
    with pytest.raises(ValueError, match="kind='gamma'.*accepted"):
        fused.random_buckets(refs, groups, "gamma")
