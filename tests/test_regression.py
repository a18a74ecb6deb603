"""Regression: a learned Gaussian noise std, the heteroscedastic likelihood, interval metrics and the CRPS.

Oracles: the closed-form maximum-likelihood σ of linear regression; the exact evidence of
Bayesian linear regression, y ~ N(Φ θ̄, σ² I + Φ Φᵀ / δ), maximised by scipy; laplace-torch's
``log_marginal_likelihood(prior_precision, sigma_noise)`` on the same weights; torch.distributions
log-densities; scipy quadrature of ∫ (F(t) − 1[t ≥ y])² dt; torchmetrics' sample CRPS; binomial
error bars for the coverage of a known Gaussian predictive.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import scipy.integrate
import scipy.optimize
import scipy.stats
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayeswrap as bw
from bayeswrap.core.likelihoods import Gaussian, Heteroscedastic
from bayeswrap.evaluation import regression
from bayeswrap.predictive import evaluate, predict_loader

DT = torch.float64
TRUE_W = torch.tensor([[1.0], [-2.0], [0.5]], dtype=DT)

pytestmark = pytest.mark.usefixtures("one_thread")


def _linear_data(n, noise=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=DT)
    return x, x @ TRUE_W + 0.7 + noise * torch.randn(n, 1, generator=g, dtype=DT)


def _design(x):
    return torch.cat([x, torch.ones(len(x), 1, dtype=DT)], 1)


# ------------------------------------------------------------------------------------------ likelihoods
def test_learned_gaussian_nll_gradient_and_state():
    lik = Gaussian("learn").to(DT)
    lik.noise_std = 0.4
    f, y = torch.randn(6, 2, dtype=DT), torch.randn(6, 2, dtype=DT)
    nll = lik.nll(f, y, reduction="none")
    ref = -torch.distributions.Normal(f, 0.4).log_prob(y).sum(1)
    torch.testing.assert_close(nll, ref, rtol=1e-12, atol=0)
    lik.nll(f, y).backward()  # d/d log σ of the batch mean: mean_n Σ_d [1 − r²/σ²]
    expected = (1 - (y - f).square() / 0.16).sum(1).mean()
    torch.testing.assert_close(lik.log_noise_std.grad, expected, rtol=1e-12, atol=0)
    fixed = Gaussian(0.4)
    torch.testing.assert_close(fixed.nll(f, y, reduction="none"), ref, rtol=1e-12, atol=0)
    assert list(fixed.state_dict()) == [] and list(lik.state_dict()) == ["log_noise_std"]


def test_heteroscedastic_nll_predictive_and_shapes():
    lik = Heteroscedastic()
    g = torch.Generator().manual_seed(1)
    out, y = torch.randn(5, 4, generator=g, dtype=DT), torch.randn(5, 2, generator=g, dtype=DT)
    ref = -torch.distributions.Normal(out[:, :2], out[:, 2:].mul(0.5).exp()).log_prob(y).sum(1)
    torch.testing.assert_close(lik.nll(out, y, reduction="none"), ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(lik.nll(out, y), ref.mean(), rtol=1e-12, atol=0)
    outs = torch.randn(7, 5, 4, generator=g, dtype=DT)  # S = 7 samples
    mean, var = lik.predictive(outs)
    mus, variances = outs[..., :2], outs[..., 2:].exp()  # the mixture's moments, sample by sample
    ref_mean = sum(mus[s] for s in range(7)) / 7
    ref_second = sum(variances[s] + mus[s] ** 2 for s in range(7)) / 7
    torch.testing.assert_close(mean, ref_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(var, ref_second - ref_mean**2, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"shape \(B, 2D\).*returned shape \(5, 3\)"):
        lik.check_targets(torch.randn(5, 3), torch.randn(5, 1))
    with pytest.raises(ValueError, match=r"accepted: targets of shape \(5, 2\)"):
        lik.check_targets(out, torch.randn(5, 4, dtype=DT))


@pytest.mark.parametrize("kwargs, match", [
    ({"likelihood": "categorical", "noise_std": "learn"}, r"noise_std='learn' is not accepted with likelihood="
                                                          r"'categorical'.*accepted: noise_std='learn' with"),
    ({"likelihood": "heteroscedastic", "noise_std": "learn"}, r"not accepted with likelihood='heteroscedastic'"),
    ({"likelihood": "gaussian", "noise_std": "lern"}, r"noise_std='lern' must be a number in .*or noise_std='learn'"),
    ({"likelihood": "poisson"}, r"accepted: \('categorical', 'gaussian', 'heteroscedastic', 'causal_lm', 'token_categorical'\)"),
])
def test_bad_likelihood_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.wrap(nn.Linear(3, 2), "map", num_data=10, **kwargs)


@pytest.mark.parametrize("method, kwargs, match", [
    ("ensemble", {"likelihood": "gaussian", "noise_std": "learn"}, r"not accepted by method 'ensemble'"),
    ("hmc", {"likelihood": "gaussian", "noise_std": "learn"}, r"not accepted by method 'hmc'"),
    ("laplace", {"likelihood": "heteroscedastic"}, r"not supported by method 'laplace'; accepted: \('categorical', "
                                                    r"'gaussian', 'causal_lm', 'token_categorical'\)"),
])
def test_unsupported_combinations_are_refused(method, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.wrap(nn.Linear(3, 2), method, num_data=10, **kwargs)


# ------------------------------------------------------------------------------------------ learned σ in the loss
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_map_learns_the_maximum_likelihood_noise_std(optimizer):
    """y = Xw + b + ε, ε ~ N(0, 0.3²): the loss's minimiser in σ is the ML σ̂ = sqrt(RSS_ols / N)."""
    torch.manual_seed(0)
    x, y = _linear_data(2000)
    bnn = bw.wrap(nn.Linear(3, 1).to(DT), "map", num_data=2000, prior_std=None, likelihood="gaussian",
                  noise_std="learn")
    groups = bnn.param_groups()
    assert [g["name"] for g in groups] == ["posterior", "likelihood"] and groups[1]["weight_decay"] == 0.0
    if optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=0.05)
    else:
        opt = torch.optim.SGD(groups, lr=0.02, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch < 7 else 0.05)
    bw.fit(bnn, DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True), epochs=10, optimizer=opt,
           scheduler=sched)
    beta = torch.linalg.lstsq(_design(x), y).solution
    sigma_ml = float((y - _design(x) @ beta).square().mean().sqrt())
    assert abs(sigma_ml - 0.3) < 3 * 0.3 / math.sqrt(2 * 2000)  # the truth, within sampling error
    assert bnn.noise_std == pytest.approx(sigma_ml, rel=0.02)  # (the ML σ̂ itself has a 1.6% sampling error)
    # saved and loaded with the model; the predictive uses it
    clone = bw.wrap(nn.Linear(3, 1).to(DT), "map", num_data=2000, prior_std=None, likelihood="gaussian",
                    noise_std="learn")
    clone.load_state_dict(bnn.state_dict())
    assert clone.noise_std == bnn.noise_std
    _, var = clone.predict(x[:4], num_samples=0)
    torch.testing.assert_close(var, torch.full((4, 1), bnn.noise_std**2, dtype=DT))
    # held-out data: the predictive N(f, σ̂²) covers its nominal fractions within binomial error
    xt, yt = _linear_data(4000, seed=1)
    scores = evaluate(bnn, DataLoader(TensorDataset(xt, yt), batch_size=500), num_samples=0)
    for level in (50, 90, 95):
        p = level / 100
        assert abs(scores[f"coverage_{level}"] - p) < 4 * math.sqrt(p * (1 - p) / 4000)
    assert scores["crps"] == pytest.approx(0.3 / math.sqrt(math.pi), rel=0.03)  # E CRPS = σ/√π when calibrated


def test_heteroscedastic_map_recovers_the_noise_model():
    """y = 2x − 1 + ε, log Var ε = −2 + 1.5 x: nn.Linear(1, 2) holds the exact mean and log-variance, and
    minibatch AdamW reaches the maximum-likelihood estimate (found by scipy on the same NLL)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4000, 1, generator=g, dtype=DT)
    y = 2 * x - 1 + torch.exp(0.5 * (-2 + 1.5 * x)) * torch.randn(4000, 1, generator=g, dtype=DT)
    bnn = bw.wrap(nn.Linear(1, 2).to(DT), "map", num_data=4000, prior_std=None, likelihood="heteroscedastic")
    assert bnn.noise_std is None
    opt = torch.optim.AdamW(bnn.param_groups(), lr=0.1, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch < 9 else 0.05)
    bw.fit(bnn, DataLoader(TensorDataset(x, y), batch_size=100, shuffle=True), epochs=12, optimizer=opt,
           scheduler=sched)
    xs, ys = x.numpy().ravel(), y.numpy().ravel()

    def nll(p):  # [mean slope, mean intercept, log-variance slope, log-variance intercept]
        s = p[2] * xs + p[3]
        return 0.5 * np.sum((ys - p[0] * xs - p[1]) ** 2 * np.exp(-s) + s)

    mle = torch.tensor(scipy.optimize.minimize(nll, np.zeros(4), method="BFGS").x, dtype=DT)
    torch.testing.assert_close(mle, torch.tensor([2.0, -1.0, 1.5, -2.0], dtype=DT), atol=0.07, rtol=0)  # 3 s.e.
    w, b = bnn.posterior_mean()["weight"].flatten(), bnn.posterior_mean()["bias"]
    torch.testing.assert_close(torch.stack([w[0], b[0], w[1], b[1]]), mle, atol=0.05, rtol=0)
    mean, var = bnn.predict(torch.tensor([[0.0], [1.0]], dtype=DT), num_samples=0)
    torch.testing.assert_close(var.log().flatten(), b[1] + w[1] * torch.tensor([0.0, 1.0], dtype=DT))
    torch.testing.assert_close(mean.flatten(), b[0] + w[0] * torch.tensor([0.0, 1.0], dtype=DT))


def test_ensemble_heteroscedastic_predictive_is_the_members_mixture():
    torch.manual_seed(0)
    ens = bw.wrap(nn.Linear(3, 2).to(DT), "ensemble", num_data=10, num_members=3, likelihood="heteroscedastic")
    x = torch.randn(4, 3, dtype=DT)
    y = torch.randn(4, 1, dtype=DT)
    ref = sum(m.likelihood.nll(m.forward_with(m.posterior_mean(), x), y) for m in ens.members) / 3
    torch.testing.assert_close(ens.loss(x, y).nll, ref)
    mean, var = ens.predict(x, num_samples=0)
    outs = torch.stack([m.forward_with(m.posterior_mean(), x) for m in ens.members])
    mu, v = outs[..., :1], outs[..., 1:].exp()
    torch.testing.assert_close(mean, mu.mean(0))
    torch.testing.assert_close(var, (v + mu**2).mean(0) - mu.mean(0) ** 2)


# ------------------------------------------------------------------------------------------ Laplace: σ by evidence
def _exact_evidence_maximiser(x, y):
    """(σ*, δ*, log Z*) of Bayesian linear regression, prior N(0, I/δ) on [w, b], by scipy on the exact evidence."""
    phi, target = _design(x).numpy(), y.numpy().ravel()

    def neg_log_evidence(z):
        s, d = np.exp(z)
        cov = s**2 * np.eye(len(target)) + phi @ phi.T / d
        return -scipy.stats.multivariate_normal(np.zeros(len(target)), cov).logpdf(target)

    res = scipy.optimize.minimize(neg_log_evidence, [0.0, 0.0], method="Nelder-Mead",
                                  options={"xatol": 1e-10, "fatol": 1e-12, "maxiter": 4000})
    sigma, delta = np.exp(res.x)
    return float(sigma), float(delta), -float(res.fun)


def test_laplace_marglik_noise_is_the_exact_evidence_maximiser():
    """Linear-Gaussian model: the full Laplace evidence is exact, so at θ* = the posterior mean at the exact
    maximiser (σ*, δ*), its joint maximiser over (σ, δ) is (σ*, δ*) and its value the exact log evidence."""
    x, y = _linear_data(120)
    sigma, delta, log_z = _exact_evidence_maximiser(x, y)
    phi = _design(x)
    precision = phi.T @ phi / sigma**2 + delta * torch.eye(4, dtype=DT)
    mean = torch.linalg.solve(precision, phi.T @ y / sigma**2).flatten()
    bnn = bw.wrap(nn.Linear(3, 1).to(DT), "laplace", num_data=120, prior_mean="zero", likelihood="gaussian",
                  noise_std="learn", hessian_structure="full")
    bnn.theta["weight"], bnn.theta["bias"] = mean[:3].reshape(1, 3), mean[3:]
    bnn.fit_curvature(DataLoader(TensorDataset(x, y), batch_size=32))  # at σ = 1: rescaled by the search
    assert bnn.noise_std == 1.0
    found = bnn.optimize_prior_precision("marglik")
    assert found == pytest.approx(delta, rel=1e-6)
    assert bnn.noise_std == pytest.approx(sigma, rel=1e-7)
    torch.testing.assert_close(bnn.log_marginal_likelihood(), torch.tensor(log_z, dtype=DT), rtol=1e-9, atol=0)
    # the posterior moved to σ*: P = ΦᵀΦ/σ*² + δ* I exactly
    torch.testing.assert_close(bnn.posterior_precision(), precision, rtol=1e-6, atol=0)
    # setting σ moves the fitted posterior with it: the evidence at (δ*, 0.5) and P = ΦᵀΦ/0.25 + δ* I
    expected = bnn.log_marginal_likelihood(found, noise_std=0.5)
    bnn.noise_std = 0.5
    torch.testing.assert_close(bnn.log_marginal_likelihood(), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(bnn.posterior_precision(), phi.T @ phi / 0.25 + found * torch.eye(4, dtype=DT),
                               rtol=1e-10, atol=0)
    with pytest.raises(ValueError, match=r"noise_std=0.5 is accepted only with a learned noise std"):
        fixed = bw.wrap(nn.Linear(3, 1).to(DT), "laplace", num_data=120, likelihood="gaussian")
        fixed.fit_curvature(DataLoader(TensorDataset(x, y), batch_size=32))
        fixed.log_marginal_likelihood(1.0, noise_std=0.5)


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_laplace_marglik_noise_matches_laplace_torch(structure):
    """Trained by fit (minibatch SGD with momentum, σ learned in the loss), then σ and δ by evidence: the same
    evidence and maximiser as laplace-torch's log_marginal_likelihood(prior_precision, sigma_noise)."""
    laplace = pytest.importorskip("laplace")
    torch.manual_seed(0)
    x, y = _linear_data(300)
    bnn = bw.wrap(nn.Linear(3, 1).to(DT), "laplace", num_data=300, prior_mean="zero", prior_std=3.0,
                  likelihood="gaussian", noise_std="learn", hessian_structure=structure)
    opt = torch.optim.SGD(bnn.param_groups(), lr=0.01, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=50)
    bw.fit(bnn, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True), epochs=15, optimizer=opt)
    bnn.fit_curvature(loader)
    net = nn.Linear(3, 1).to(DT)
    net.load_state_dict({"weight": bnn.theta["weight"].detach(), "bias": bnn.theta["bias"].detach()})
    la = laplace.Laplace(copy.deepcopy(net), "regression", subset_of_weights="all", hessian_structure=structure)
    la.fit(loader)
    for d, s in [(0.5, 0.4), (3.0, 0.25)]:
        torch.testing.assert_close(bnn.log_marginal_likelihood(d, noise_std=s),
                                   la.log_marginal_likelihood(torch.tensor(d, dtype=DT),
                                                              torch.tensor(s, dtype=DT)).reshape(()),
                                   rtol=1e-9, atol=0)

    def neg(z):  # laplace-torch's evidence, maximised by scipy with its autograd gradient
        t = torch.tensor(z, dtype=DT, requires_grad=True)
        value = -la.log_marginal_likelihood(t[0].exp(), t[1].exp()).sum()
        value.backward()
        return float(value.detach()), t.grad.numpy()

    res = scipy.optimize.minimize(neg, [0.0, 0.0], jac=True, method="BFGS", options={"gtol": 1e-10})
    delta = bnn.optimize_prior_precision("marglik")
    assert delta == pytest.approx(math.exp(res.x[0]), rel=1e-5)
    assert bnn.noise_std == pytest.approx(math.exp(res.x[1]), rel=1e-6)
    # the GLM predictive uses the new σ: var = J P⁻¹ Jᵀ + σ²
    (mean, var), _ = predict_loader(bnn, loader)
    f_mu, f_var = la(x, pred_type="glm")
    la_var = f_var.reshape(-1, 1) + math.exp(res.x[1]) ** 2
    torch.testing.assert_close(var, la_var.detach(), rtol=1e-4, atol=0)


# ------------------------------------------------------------------------------------------ interval metrics, CRPS
def test_interval_coverage_and_width_of_a_known_gaussian():
    g = torch.Generator().manual_seed(0)
    n = 20000
    mean = torch.randn(n, 2, generator=g, dtype=DT)
    std = 0.5 + torch.rand(n, 2, generator=g, dtype=DT)
    y = mean + std * torch.randn(n, 2, generator=g, dtype=DT)
    got = regression.interval_metrics(mean, std**2, y, levels=(0.5, 0.9, 0.95))
    for level, key in [(0.5, "50"), (0.9, "90"), (0.95, "95")]:
        z = scipy.stats.norm.ppf((1 + level) / 2)
        assert abs(got[f"coverage_{key}"] - level) < 4 * math.sqrt(level * (1 - level) / (2 * n))
        assert got[f"width_{key}"] == pytest.approx(float((2 * z * std).mean()), rel=1e-12)
    # an overconfident predictive (σ halved) covers P(|Z| ≤ z/2) = 2Φ(z/2) − 1
    half = regression.interval_metrics(mean, (std / 2) ** 2, y, levels=[0.9])
    expected = 2 * scipy.stats.norm.cdf(scipy.stats.norm.ppf(0.95) / 2) - 1
    assert abs(half["coverage_90"] - expected) < 4 * math.sqrt(expected * (1 - expected) / (2 * n))


def _crps_by_quadrature(cdf, y, lo, hi):
    left = scipy.integrate.quad(lambda t: cdf(t) ** 2, lo, y, epsabs=1e-13, epsrel=1e-12, limit=200)[0]
    right = scipy.integrate.quad(lambda t: (1 - cdf(t)) ** 2, y, hi, epsabs=1e-13, epsrel=1e-12, limit=200)[0]
    return left + right


def test_crps_closed_forms_against_quadrature():
    mean, std, y = np.array([0.0, 1.5, -2.0]), np.array([1.0, 0.3, 2.5]), np.array([0.4, -0.2, -2.0])
    ours = regression.crps_gaussian(mean, std**2, y, reduction="none")
    for i in range(3):
        ref = _crps_by_quadrature(lambda t: scipy.stats.norm.cdf(t, mean[i], std[i]), y[i], -40, 40)
        assert float(ours[i]) == pytest.approx(ref, rel=1e-9)
    assert regression.crps_gaussian(np.array([1.0]), np.array([0.0]), np.array([3.0])) == 2.0  # σ → 0: |y − μ|
    mus, sds = np.array([[-1.0], [0.5], [2.0]]), np.array([[0.4], [1.0], [0.2]])  # a 3-component mixture
    ours = regression.crps_gaussian_mixture(mus, sds**2, np.array([0.7]))
    ref = _crps_by_quadrature(lambda t: scipy.stats.norm.cdf(t, mus[:, 0], sds[:, 0]).mean(), 0.7, -40, 40)
    assert ours == pytest.approx(ref, rel=1e-9)
    # one component: the Gaussian closed form
    assert regression.crps_gaussian_mixture(mus[:1], sds[:1] ** 2, np.array([0.7])) == pytest.approx(
        regression.crps_gaussian(mus[0], sds[0] ** 2, np.array([0.7])), rel=1e-12)


def test_crps_samples_matches_torchmetrics_and_the_mixture():
    torchmetrics = pytest.importorskip("torchmetrics.functional.regression")
    g = torch.Generator().manual_seed(0)
    samples, y = torch.randn(9, 30, generator=g, dtype=DT), torch.randn(30, generator=g, dtype=DT)
    ref = torchmetrics.continuous_ranked_probability_score(samples.T, y)
    assert regression.crps_samples(samples, y) == pytest.approx(float(ref), rel=1e-12)
    # many draws of a mixture: the sample CRPS estimates the closed form
    mus, variances = torch.tensor([[-1.0], [0.5], [2.0]], dtype=DT), torch.tensor([[0.16], [1.0], [0.04]], dtype=DT)
    comp = torch.randint(0, 3, (60000,), generator=g)
    draws = mus[comp, 0] + variances[comp, 0].sqrt() * torch.randn(60000, generator=g, dtype=DT)
    exact = regression.crps_gaussian_mixture(mus, variances, torch.tensor([0.7], dtype=DT))
    assert regression.crps_samples(draws.reshape(-1, 1), torch.tensor([0.7], dtype=DT)) == pytest.approx(exact,
                                                                                                         rel=0.01)


@pytest.mark.parametrize("call, match", [
    (lambda: regression.interval_metrics(torch.zeros(3), -torch.ones(3), torch.zeros(3)), r"var must be >= 0"),
    (lambda: regression.interval_metrics(torch.zeros(3), torch.ones(3), torch.zeros(3), levels=[1.0]),
     r"levels=\[1.0\] is not accepted; accepted: a non-empty sequence of numbers in \(0, 1\)"),
    (lambda: regression.crps_gaussian(torch.zeros(3), torch.ones(3), torch.tensor([0.0, math.nan, 0.0])),
     r"targets contains 1 non-finite values"),
    (lambda: regression.crps_samples(torch.zeros(4, 3), torch.zeros(2)), r"samples \(4, 3\) must have shape"),
    (lambda: regression.crps_gaussian(torch.zeros(3), torch.ones(3), torch.zeros(3), reduction="sum"),
     r"reduction='sum' is not accepted; accepted: \('mean', 'none'\)"),
])
def test_metric_inputs_are_checked(call, match):
    with pytest.raises(ValueError, match=match):
        call()
