"""Sparsity reports, pruning (rule and random) and deployment with ``to_deterministic``."""

import copy
import math

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.methods.sparsity import NotTrainedError, SparsityReport, check_rule


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()


def _loader(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    return [(x[i:i + 32], y[i:i + 32]) for i in range(0, n, 32)]


def _set_sparse_vd(bnn, log_alpha: dict[str, torch.Tensor]):
    """Sets log σ² so that log α (= log σ² − log θ²) takes the given values."""
    with torch.no_grad():
        for n, la in log_alpha.items():
            bnn.log_sigma2[n].copy_(la + torch.log(bnn.theta[n] ** 2))


def _known_sparse_vd():
    """A sparse-VD model whose log α are 0, 1, 2, ..., cycling through [0, 6) in every tensor."""
    bnn = bw.wrap(_mlp(), "sparse_vd", num_data=64)
    la = {n: (torch.arange(t.numel(), dtype=torch.float64) % 6).reshape(t.shape) for n, t in bnn.theta.items()}
    _set_sparse_vd(bnn, la)
    return bnn, la


def test_report_counts_per_tensor_and_overall():
    bnn, la = _known_sparse_vd()
    report = bnn.sparsity()  # default for sparse VD: log α > 3
    assert isinstance(report, SparsityReport) and (report.rule, report.threshold) == ("log_alpha", 3.0)
    expected = {n: int((v > 3).sum()) for n, v in la.items()}
    assert [(t.name, t.shape, t.pruned) for t in report.tensors] == [
        (n, tuple(v.shape), expected[n]) for n, v in la.items()]
    total = sum(v.numel() for v in la.values())
    assert report.total == total and report.pruned == sum(expected.values())
    assert report.sparsity == pytest.approx(report.pruned / total)
    assert report.compression == pytest.approx(total / (total - report.pruned))
    assert report.tensors[0].fraction == pytest.approx(expected["0.weight"] / 32)
    d = report.to_dict()
    assert d["pruned"] == report.pruned and d["tensors"][0]["shape"] == [8, 4]
    assert "| **total** |" in report.to_markdown() and "compression" in str(report)


def test_snr_rule_is_the_log_alpha_rule_at_the_matching_threshold():
    bnn, la = _known_sparse_vd()
    # |μ/σ| < t  ⇔  log α > −2 log t
    for t in (0.83, 0.3, 0.1):
        snr = bnn.sparsity(rule="snr", threshold=t)
        expected = sum(int((v > -2 * math.log(t) + 1e-9).sum()) for v in la.values())
        assert snr.pruned == expected
    assert bnn.sparsity(rule="snr").threshold == 0.83


def test_prune_zeroes_exactly_the_reported_count():
    bnn, _ = _known_sparse_vd()
    assert all((m != 0).all() for m in bnn.posterior_mean().values())
    report = bnn.prune()
    zeros = sum(int((m == 0).sum()) for m in bnn.posterior_mean().values())
    zero_std = sum(int(((m == 0) & (bnn.posterior_std()[n] == 0)).sum()) for n, m in bnn.posterior_mean().items())
    assert zeros == zero_std == report.pruned > 0
    for t, draws in zip(report.tensors, bnn.sample(5).values()):
        assert int((draws == 0).all(0).sum()) == t.pruned
    # the report after pruning counts the pruned weights under any rule
    assert bnn.sparsity().pruned == report.pruned
    assert bnn.sparsity(rule="snr", threshold=1e-6).pruned == report.pruned


def test_pruned_sparse_vd_stays_pruned_while_training():
    bnn, _ = _known_sparse_vd()
    report = bnn.prune()
    kl_before = bnn.regularizer().item()
    assert math.isfinite(kl_before)
    bw.fit(bnn, _loader(), epochs=2, optimizer=torch.optim.Adam(bnn.parameters(), 1e-2), progress=False)
    assert sum(int((m == 0).sum()) for m in bnn.posterior_mean().values()) >= report.pruned
    assert all(((m == 0) <= (bnn.posterior_std()[n] == 0)).all() for n, m in bnn.posterior_mean().items())


def test_vi_prunes_by_signal_to_noise_ratio():
    bnn = bw.wrap(_mlp(), "vi", num_data=64, init_std=0.1)
    mean = bnn.posterior_mean()
    expected = sum(int((m.abs() < 0.83 * 0.1).sum()) for m in mean.values())
    report = bnn.prune()  # default for VI: Graves' |μ/σ| < 0.83
    assert report.rule == "snr" and report.pruned == expected > 0
    assert sum(int((m == 0).sum()) for m in bnn.posterior_mean().values()) == expected
    assert sum(int((s == 0).sum()) for s in bnn.posterior_std().values()) == expected
    assert math.isinf(bnn.regularizer().item())  # a point mass at 0 against the Gaussian prior, documented


def test_prune_random_matches_the_rule_count_per_tensor_and_is_reproducible():
    bnn, la = _known_sparse_vd()
    rule_report = bnn.sparsity()
    a, b = copy.deepcopy(bnn), copy.deepcopy(bnn)
    ra = a.prune_random(generator=torch.Generator().manual_seed(3))
    rb = b.prune_random(generator=torch.Generator().manual_seed(3))
    assert [t.pruned for t in ra.tensors] == [t.pruned for t in rule_report.tensors] == [t.pruned for t in rb.tensors]
    assert ra.rule == "random"
    for n in la:
        torch.testing.assert_close(a.keep[n], b.keep[n])
    zeros = sum(int((m == 0).sum()) for m in a.posterior_mean().values())
    assert zeros == rule_report.pruned
    chosen_by_rule = torch.cat([(v > 3).flatten() for v in la.values()])
    chosen_random = torch.cat([(~k).flatten() for k in a.keep.values()])
    assert not torch.equal(chosen_by_rule, chosen_random)
    c = copy.deepcopy(bnn)
    rc = c.prune_random(count=7, generator=torch.Generator().manual_seed(0))
    assert rc.pruned == 7 == sum(int((m == 0).sum()) for m in c.posterior_mean().values())
    with pytest.raises(ValueError, match="count"):
        copy.deepcopy(bnn).prune_random(count=10**6)


class _WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 6, bias=False)
        self.bn = nn.BatchNorm1d(6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 4)

    def forward(self, x):
        return self.out(torch.relu(self.mid(self.bn(self.embed(x)))))


@pytest.mark.parametrize("method", ["vi", "sparse_vd", "kingma_vd"])
def test_to_deterministic_reproduces_the_posterior_mean_predictions(method):
    torch.manual_seed(0)
    model = _WithBatchNorm().double()
    x = torch.randn(32, 4, dtype=torch.float64)
    y = torch.randint(0, 4, (32,))
    bnn = bw.wrap(model, method, num_data=32, params=["embed.*", "mid.weight"])
    bw.fit(bnn, [(x, y)], epochs=3, optimizer=torch.optim.Adam(bnn.parameters(), 1e-2), progress=False)
    bnn.prune_random(count=5, generator=torch.Generator().manual_seed(0))
    net = bnn.to_deterministic()
    assert type(net) is _WithBatchNorm and not net.training
    assert not any(t.is_meta for t in list(net.parameters()) + list(net.buffers()))
    assert int((net.embed.weight == 0).sum() + (net.mid.weight == 0).sum()) == 5
    bnn.eval()
    with torch.no_grad():
        expected = bnn.forward_with(bnn.posterior_mean(), x)
        torch.testing.assert_close(net(x), expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(net(x).softmax(-1), bnn.predict(x, num_samples=0), rtol=0, atol=1e-6)
    # real copies: changing the net does not touch the Bayesian model
    with torch.no_grad():
        net.mid.bias.add_(1.0)
        net.bn.running_mean.add_(1.0)
    torch.testing.assert_close(bnn.forward_with(bnn.posterior_mean(), x), expected)


def test_to_deterministic_in_float32_matches_to_1e_6():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 300), nn.ReLU(), nn.Linear(300, 100), nn.ReLU(), nn.Linear(100, 10))
    bnn = bw.wrap(model, "sparse_vd", num_data=100)
    x, y = torch.rand(50, 64), torch.randint(0, 10, (50,))
    bw.fit(bnn, [(x, y)], epochs=2, optimizer=torch.optim.Adam(bnn.parameters(), 1e-3), progress=False)
    bnn.prune(threshold=0.0)
    with torch.no_grad():
        torch.testing.assert_close(bnn.to_deterministic()(x), bnn.forward_with(bnn.posterior_mean(), x),
                                   rtol=0, atol=1e-6)


def test_to_deterministic_before_training_raises_and_after_loading_works():
    bnn = bw.wrap(_mlp(), "sparse_vd", num_data=64)
    with pytest.raises(NotTrainedError, match="no optimizer step.*bw.fit"):
        bnn.to_deterministic()
    with pytest.raises(ValueError):  # NotTrainedError is a ValueError (and a NotFittedError)
        bw.sparsity.to_deterministic(bnn)
    bw.fit(bnn, _loader(), epochs=1, optimizer=torch.optim.Adam(bnn.parameters(), 1e-3), progress=False)
    bnn.to_deterministic()
    fresh = bw.wrap(_mlp(), "sparse_vd", num_data=64)
    fresh.load_state_dict(bnn.state_dict())
    fresh.to_deterministic()
    laplace = bw.wrap(_mlp(), "laplace", num_data=64)
    with pytest.raises(bw.NotFittedError, match="fit_curvature"):
        bw.sparsity.to_deterministic(laplace)


def test_bad_rules_thresholds_and_methods_raise():
    bnn, _ = _known_sparse_vd()
    with pytest.raises(ValueError, match="rule='magnitude' is not known.*log_alpha.*snr"):
        bnn.sparsity(rule="magnitude")
    with pytest.raises(ValueError, match="wrong sign.*log_alpha"):
        bnn.prune(rule="log_alpha", threshold=-3)
    with pytest.raises(ValueError, match="wrong sign.*snr"):
        bnn.sparsity(rule="snr", threshold=-0.83)
    with pytest.raises(ValueError, match="wrong sign"):
        check_rule("snr", 0.0)
    with pytest.raises(ValueError, match="finite"):
        check_rule("log_alpha", math.inf)
    assert check_rule(None, None, "log_alpha") == ("log_alpha", 3.0)
    mapm = bw.wrap(_mlp(), "map", num_data=64)
    for fn in (bw.sparsity.prune, bw.sparsity.sparsity, bw.sparsity.prune_random):
        with pytest.raises(ValueError, match="'map' has no posterior variances"):
            fn(mapm)
    laplace = bw.wrap(_mlp(), "laplace", num_data=64)
    laplace.fit_curvature(_loader())
    assert bw.sparsity.sparsity(laplace).total == sum(p.numel() for p in _mlp().parameters())  # read-only report
    with pytest.raises(ValueError, match="pruning is implemented for the variational methods"):
        bw.sparsity.prune(laplace)


def test_kingma_vd_never_reaches_the_pruning_thresholds():
    """α ≤ 1 means SNR ≥ 1: neither rule prunes a Kingma-VD weight (why Molchanov lifted the bound)."""
    bnn = bw.wrap(_mlp(), "kingma_vd", num_data=64, init_log_alpha=0.0)
    assert bnn.sparsity().pruned == 0 and bnn.sparsity(rule="snr").pruned == 0
