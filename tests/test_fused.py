"""The fused hot path gives the same loss and gradients as the plain autograd reference."""

import math

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


def test_vi_fused_with_several_buckets_drawn_in_one_call_equals_reference(monkeypatch):
    """A model below RNG_PARALLEL_MIN whose tensors span several buckets: the draws are one generator call split
    per bucket (views of one buffer), so θ must not be written over them (an in-place write to a base shared with
    another bucket's θ, which autograd refuses; the lbbnn and issue-9 scripts' MNIST MLPs failed so before)."""
    from bayeswrap.core import fused

    monkeypatch.setattr(fused, "BUCKET_NUMEL", 64)
    model = _model().double()
    assert len(fused.buckets(list(model.parameters()))) > 2
    ref = bw.wrap(model, "vi", num_data=50, init_std=0.05, fused=False)
    fast = bw.wrap(model, "vi", num_data=50, init_std=0.05, fused=True)
    (o1, g1), (o2, g2) = _loss_and_grads(ref, 7), _loss_and_grads(fast, 7)
    torch.testing.assert_close(o2.loss, o1.loss, rtol=1e-12, atol=1e-12)
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
def test_fused_equals_reference_across_buckets_and_rng_streams(method, monkeypatch):
    from bayeswrap.core import fused

    monkeypatch.setattr(fused, "RNG_PARALLEL_MIN", 1 << 19)  # parallel noise streams for this 750k-element model
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


def test_random_buckets_are_iid_and_independent_of_the_thread_count(monkeypatch):
    from scipy import stats

    from bayeswrap.core import fused

    refs = [torch.empty(1700, 900), torch.empty(300), torch.empty(500, 600)]  # 1,830,300 elements
    groups = fused.buckets(refs)
    monkeypatch.setattr(fused, "RNG_PARALLEL_MIN", 1 << 20)  # parallel streams (7 of them) from 2^20 elements
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
    assert z.numel() == u.numel() == 1_830_300
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


def test_small_requests_keep_the_single_call_stream():
    """Below RNG_PARALLEL_MIN the draws are those of one torch.randn / torch.rand over all the tensors."""
    from bayeswrap.core import fused

    refs = [torch.empty(300, 500), torch.empty(7), torch.empty(400, 600)]
    groups = fused.buckets(refs)
    assert len(groups) > 1
    for kind, draw in (("normal", torch.randn), ("uniform", torch.rand)):
        torch.manual_seed(3)
        ours = torch.cat(fused.random_buckets(refs, groups, kind))
        torch.manual_seed(3)
        torch.testing.assert_close(ours, draw(sum(t.numel() for t in refs)), rtol=0, atol=0)


def test_sample_from_parallel_streams_has_the_posterior_moments(monkeypatch):
    """bnn.sample on the CPU path of large models: exact N(m, s²) draws, reproducible with a generator."""
    from bayeswrap.core import fused

    monkeypatch.setattr(fused, "RNG_PARALLEL_MIN", 1 << 10)
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 3)), "vi", num_data=100, init_std=0.1)
    with torch.no_grad():
        for r in bnn.rho.values():
            r.mul_(1 + 0.3 * torch.rand_like(r))  # unequal stds
    draws = bnn.sample(2000, generator=torch.Generator().manual_seed(4))
    again = bnn.sample(2000, generator=torch.Generator().manual_seed(4))
    mean, std = bnn.posterior_mean(), bnn.posterior_std()
    for n, d in draws.items():
        assert d.shape == (2000, *mean[n].shape) and torch.equal(d, again[n])
        z = (d - mean[n]) / std[n]  # standardised: N(0, 1) elementwise
        assert abs(z.mean()) < 5 / z.numel() ** 0.5
        assert abs(z.std(0).mean() - 1) < 5 / (2 * 2000 * z[0].numel()) ** 0.5
        assert (z.mean(0).abs() < 5 / 2000**0.5).all()


def _vi_std(bnn, name):
    """VI's s = exp(log σ + b sinh(κρ/b)), written out."""
    b, kappa = bnn.log_std_knee, bnn.log_std_scale
    return torch.exp(math.log(bnn.prior_std) + b * torch.sinh(kappa * bnn.rho[name] / b))


def test_vi_posterior_std_cache_follows_rho():
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(4, 3)), "vi", num_data=10, init_std=0.1, std_knee=2.0).eval()
    with torch.no_grad():
        first = bnn.posterior_std()
        assert bnn.posterior_std() is first  # cached in eval mode
        bnn.rho["0.weight"].add_(0.5)  # an in-place update (as an optimizer step) invalidates it
        second = bnn.posterior_std()
        assert second is not first
        torch.testing.assert_close(second["0.weight"], _vi_std(bnn, "0.weight"))
        bnn.load_state_dict({k: v + 0.1 if "rho" in k else v for k, v in bnn.state_dict().items()})
        torch.testing.assert_close(bnn.posterior_std()["0.bias"], _vi_std(bnn, "0.bias"))
    assert bnn.posterior_std()["0.weight"].requires_grad  # with autograd: never cached
    bnn.train()
    assert "_std_cache" not in bnn.__dict__


def test_log_std_map_its_slope_and_inverse():
    """VI's log s = ref + b sinh(κρ/b), linear beyond slope κM: autograd's slope, the closed form, the inverse."""
    from bayeswrap.core import fused

    kappa, ref, knee, cap = 7.0, -1.0, 2.0, fused.LOG_STD_MAX_SLOPE
    rho = torch.linspace(-3, 3, 2001, dtype=torch.float64, requires_grad=True)
    u = fused.log_std(rho, kappa, ref, knee)
    u.sum().backward()
    torch.testing.assert_close(rho.grad, fused.log_std_slope(rho.detach(), kappa, knee))
    x = kappa * rho.detach() / knee
    inner = x.abs() <= math.acosh(cap)
    torch.testing.assert_close(u.detach()[inner], ref + knee * torch.sinh(x[inner]))
    assert torch.allclose(rho.grad[~inner], torch.tensor(kappa * cap, dtype=torch.float64))
    assert rho.grad.min() == pytest.approx(kappa, rel=1e-5) and rho.grad.max() == pytest.approx(kappa * cap)
    torch.testing.assert_close(fused.log_std_inverse(u.detach(), kappa, ref, knee), rho.detach())
    assert fused.log_std_inverse(float(u[7]), kappa, ref, knee) == pytest.approx(float(rho[7]), abs=1e-12)
    assert fused.log_std(torch.tensor([-1.0e4]), 50.0, 0.0, knee).exp().item() == 0.0  # a pruned std


def test_vi_std_knee_auto_is_used_only_for_a_start_far_below_the_prior_std():
    """``std_knee="auto"``: the sinh map from s₀ ≤ σ e⁻⁹ (BayesDLL's 1e-6), the linear map log s = log σ + κρ from
    nearer starts (the default 1e-3 at σ = 1); the initial std is s₀ either way."""
    from bayeswrap.methods.vi import AUTO_KNEE_NATS, LOG_STD_KNEE

    def make(**kw):
        return bw.wrap(nn.Linear(4, 3), "vi", num_data=10, prior_std=1.0, **kw)

    assert make().log_std_knee is None and make(init_std=1e-6).log_std_knee == LOG_STD_KNEE
    edge = math.exp(-AUTO_KNEE_NATS)
    assert make(init_std=edge * 1.01).log_std_knee is None and make(init_std=edge * 0.99).log_std_knee == LOG_STD_KNEE
    assert make(std_knee=None, init_std=1e-6).log_std_knee is None and make(std_knee=3.0).log_std_knee == 3.0
    for bnn in (make(), make(init_std=1e-6)):
        s0 = bnn.init_std
        torch.testing.assert_close(bnn.posterior_std()["weight"], torch.full((3, 4), s0), rtol=1e-5, atol=0)
    linear = make()
    torch.testing.assert_close(linear.posterior_std()["bias"],
                               torch.exp(linear.log_std_scale * linear.rho["bias"].detach()), rtol=1e-6, atol=0)
    for bad in ("sinh", 0.0, -1.0, float("inf"), True):
        with pytest.raises(ValueError, match="std_knee="):
            make(std_knee=bad)


def test_sparse_dropout_masks_are_iid_bernoulli_and_the_fused_sample_uses_them(monkeypatch):
    """Drop positions from geometric gaps: each element dropped with probability p, independently of its
    neighbours; θ and its gradient from the sparse kernel equal the masked reference's exactly."""
    from bayeswrap.core import fused

    monkeypatch.setattr(fused, "RNG_PARALLEL_MIN", 1 << 16)
    g = torch.Generator().manual_seed(0)
    m = [torch.randn(600, 700, generator=g), torch.randn(333, generator=g), torch.randn(400, 500, generator=g)]
    means = [torch.randn(t.shape, generator=g) for t in m]
    probs = [0.1, 0.1, 0.2]
    assert fused._sparse_drops(m, probs)
    torch.manual_seed(4)
    keep = fused.dropout_keep_masks(m, probs)
    torch.manual_seed(4)
    assert all(torch.equal(a, b) for a, b in zip(keep, fused.dropout_keep_masks(m, probs)))
    for p, ks in ((0.1, keep[:2]), (0.2, keep[2:])):
        dropped = ~torch.cat([k.reshape(-1) for k in ks])
        n = dropped.numel()
        assert abs(dropped.double().mean() - p) < 5 * (p * (1 - p) / n) ** 0.5
        both = (dropped[1:] & dropped[:-1]).double().mean()  # neighbours: P(both dropped) = p²
        assert abs(both - p * p) < 5 * (p * p * (1 - p * p) / n) ** 0.5
        blocks = dropped[: n // 1000 * 1000].view(-1, 1000).double().sum(1)  # counts per 1000: Binomial(1000, p)
        assert abs(blocks.var() / (1000 * p * (1 - p)) - 1) < 5 * (2 / blocks.numel()) ** 0.5
    leaves = [t.clone().requires_grad_() for t in m]
    scales = [0.3, 0.0, 0.7]
    torch.manual_seed(4)
    theta, penalty = fused.dropout_sample(leaves, probs, means, scales)
    upstream = [torch.randn(t.shape, generator=g) for t in m]
    torch.autograd.backward([*theta, penalty], [*upstream, torch.tensor(0.25)])
    for i, (t, k) in enumerate(zip(theta, keep)):
        assert torch.equal(t, torch.where(k, m[i], means[i]))
        expected = torch.where(k, upstream[i], 0.0) + (m[i] - means[i]) * (2.0 * scales[i] * 0.25)
        torch.testing.assert_close(leaves[i].grad, expected, rtol=1e-6, atol=1e-7)
    expected_penalty = sum(c * (a - b).pow(2).sum() for a, b, c in zip(m, means, scales))
    torch.testing.assert_close(penalty, expected_penalty, rtol=1e-5, atol=0)


def test_dense_dropout_masks_above_the_sparse_bound_are_uniform_thresholds(monkeypatch):
    from bayeswrap.core import fused

    monkeypatch.setattr(fused, "RNG_PARALLEL_MIN", 1 << 16)
    m = [torch.empty(300, 400)]
    assert not fused._sparse_drops(m, [0.3]) and fused._sparse_drops(m, [0.25])
    torch.manual_seed(2)
    keep = fused.dropout_keep_masks(m, [0.3])
    torch.manual_seed(2)
    assert torch.equal(keep[0], fused.uniform_like(m)[0] >= 0.3)


def test_random_buckets_fill_given_buffers_with_the_same_draws(monkeypatch):
    from bayeswrap.core import fused

    refs = [torch.empty(300, 500), torch.empty(7), torch.empty(400, 600)]
    groups = fused.buckets(refs)
    for parallel_min in (fused.RNG_PARALLEL_MIN, 1 << 10):  # the single-call and the parallel-stream paths
        monkeypatch.setattr(fused, "RNG_PARALLEL_MIN", parallel_min)
        torch.manual_seed(6)
        fresh = fused.random_buckets(refs, groups, "normal")
        out = [torch.full((b.numel(),), float("nan")) for b in fresh]
        torch.manual_seed(6)
        filled = fused.random_buckets(refs, groups, "normal", out=out)
        assert all(a is b for a, b in zip(filled, out))
        assert all(torch.equal(a, b) for a, b in zip(filled, fresh))
    with pytest.raises(ValueError, match="does not match the buckets; accepted: 1-D tensors of sizes"):
        fused.random_buckets(refs, groups, "normal", out=[torch.empty(3)])


@pytest.mark.parametrize("method, kwargs", [("map", {}), ("map", {"bias": "uninformative", "prior_std": 0.3}),
                                            ("sgld", {"burn_in": 0}), ("map", {"params": ["4.*"]})])
def test_map_fused_prior_node_equals_reference(method, kwargs, monkeypatch):
    """MAP's θ and prior term from one node per bucket: the loss and gradients of the autograd reference
    (the network's gradient plus that of prior.penalty(..., fused=False))."""
    from bayeswrap.core import fused

    monkeypatch.setattr(fused, "BUCKET_NUMEL", 64)  # several buckets on this small model
    model = _model().double()
    bnn = bw.wrap(model, method, num_data=50, **kwargs)
    with torch.no_grad():
        for p in bnn.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    theta, _ = bnn._sample_and_regularizer()
    assert any(t._base is not None for t in theta.values())  # the fused node's views
    out, grads = _loss_and_grads(bnn, 3)
    for p in bnn.parameters():
        p.grad = None
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.arange(8) % 5
    plain = bnn.theta.as_dict()
    nll = bnn.likelihood.nll(bnn.forward_with(plain, x), y)
    kl = bnn.prior.penalty(plain, fused=False)
    (nll + bnn.kl_weight / bnn.num_data * kl).backward()
    torch.testing.assert_close(out.kl, kl, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out.loss, nll + bnn.kl_weight / bnn.num_data * kl, rtol=1e-12, atol=1e-14)
    for n, p in bnn.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-10, atol=1e-14, msg=n)
