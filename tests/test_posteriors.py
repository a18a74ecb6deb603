"""Methods against known posteriors: Bayesian linear regression and a naive Fisher loop."""

import copy

import pytest
import torch
from torch import nn

import bayeswrap as bw

NOISE_STD, PRIOR_STD = 0.5, 1.0


@pytest.fixture(scope="module")
def linreg():
    """y = X w + ε with a N(0, PRIOR_STD² I) prior: the exact Gaussian posterior."""
    g = torch.Generator().manual_seed(0)
    n, d = 40, 2
    x = torch.randn(n, d, generator=g)
    y = x @ torch.tensor([[1.0], [-0.5]]) + NOISE_STD * torch.randn(n, 1, generator=g)
    precision = x.T @ x / NOISE_STD**2 + torch.eye(d) / PRIOR_STD**2
    cov = torch.linalg.inv(precision)
    mean = cov @ x.T @ y / NOISE_STD**2
    return {"x": x, "y": y, "post_mean": mean.squeeze(1), "post_cov": cov, "precision": precision}


def _linear(d=2):
    torch.manual_seed(1)
    return nn.Linear(d, 1, bias=False)


def test_vi_matches_closed_form_mean_field(linreg):
    """Mean-field VI on a Gaussian posterior: m = exact mean, s = 1/sqrt(diag(precision))."""
    x, y = linreg["x"], linreg["y"]
    torch.manual_seed(0)
    bnn = bw.wrap(_linear(), "vi", num_data=len(x), prior_std=PRIOR_STD, prior_mean="zero",
                  likelihood="gaussian", noise_std=NOISE_STD, init_std=0.05, num_train_samples=8)
    opt = torch.optim.Adam(bnn.parameters(), lr=2e-2)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [1500, 2500], gamma=0.1)
    for _ in range(3500):
        opt.zero_grad()
        bnn.loss(x, y).loss.backward()
        opt.step()
        sched.step()
    m = bnn.posterior_mean()["weight"].squeeze(0)
    s = bnn.posterior_std()["weight"].squeeze(0)
    exact_std = linreg["precision"].diagonal().rsqrt()
    post_std = linreg["post_cov"].diagonal().sqrt()
    # tolerance: 10% of a posterior std for the mean, 5% relative for the std
    assert torch.all((m - linreg["post_mean"]).abs() < 0.1 * post_std), (m, linreg["post_mean"])
    assert torch.allclose(s, exact_std, rtol=0.05), (s, exact_std)


def test_sgld_running_moments_match_exact_marginals(linreg):
    x, y = linreg["x"], linreg["y"]
    torch.manual_seed(0)
    bnn = bw.wrap(_linear(), "sgld", num_data=len(x), prior_std=PRIOR_STD, prior_mean="zero",
                  likelihood="gaussian", noise_std=NOISE_STD, burn_in=500, thinning=5)
    opt = bw.optim.SGLD(bnn.parameters(), lr=1e-2, num_data=len(x), generator=torch.Generator().manual_seed(3))
    bw.fit(bnn, [(x, y)] * 20000, epochs=1, optimizer=opt, progress=False)
    assert int(bnn.num_kept) == (20000 - 500) // 5
    mean = bnn.posterior_mean()["weight"].squeeze(0)
    std = bnn.posterior_std()["weight"].squeeze(0)
    exact_std = linreg["post_cov"].diagonal().sqrt()
    # tolerance: Monte Carlo error of ~800 effective samples plus O(lr) discretisation bias
    assert torch.all((mean - linreg["post_mean"]).abs() < 0.15 * exact_std), (mean, linreg["post_mean"])
    assert torch.allclose(std, exact_std, rtol=0.1), (std, exact_std)


def _mlp_bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh(), nn.Linear(7, 3)).double()


def _naive_fisher(model, x, y):
    """Per-example backward passes in a Python loop, as BayesDLL does."""
    model = copy.deepcopy(model).eval()
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            total[n] += p.grad**2
    return total


@pytest.mark.parametrize("bias", ["informative", "uninformative"])
def test_laplace_diagonal_equals_naive_loop(bias):
    model = _mlp_bn()
    model.train()(torch.randn(64, 5, dtype=torch.float64))  # non-trivial running statistics
    g = torch.Generator().manual_seed(0)
    x = torch.randn(23, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (23,), generator=g)
    bnn = bw.wrap(model, "laplace", num_data=23, prior_std=0.7, bias=bias, curvature="empirical_fisher",
                  curvature_chunk_size=4)
    bnn.fit_curvature([(x[:10], y[:10]), (x[10:], y[10:])])
    fisher = _naive_fisher(model, x, y)
    for n, f in fisher.items():
        prior_prec = 0.0 if (bias == "uninformative" and n.endswith("bias")) else 1 / 0.7**2
        expected = 1.0 / (prior_prec + f)
        torch.testing.assert_close(bnn.posterior_var[n], expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(bnn.posterior_std()[n], expected.sqrt(), rtol=1e-6, atol=0)


def test_laplace_fisher_uses_labels_sampled_from_model():
    model = _mlp_bn().eval()
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    bnn = bw.wrap(model, "laplace", num_data=24, prior_std=1.0, curvature="fisher")
    bnn.fit_curvature([(x, torch.zeros(12, dtype=torch.long))], generator=torch.Generator().manual_seed(5))
    probs = model(x).softmax(-1)
    y = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(5)).squeeze(-1)
    fisher = _naive_fisher(model, x, y)
    for n, f in fisher.items():
        # num_data / examples seen = 2 scales the data term
        torch.testing.assert_close(bnn.posterior_var[n], 1.0 / (1.0 + 2 * f), rtol=1e-6, atol=0)
