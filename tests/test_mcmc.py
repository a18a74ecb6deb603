"""Full-batch MCMC: HMC and MH against closed-form posteriors, dual averaging, diagnostics, bad input."""

import math

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.evaluation import convergence as diag


def _blr(n=50, d=3, noise=0.5, prior=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.linspace(-2, 1, d, dtype=torch.float64)
    y = x @ w + noise * torch.randn(n, generator=g, dtype=torch.float64)
    cov = torch.linalg.inv(x.T @ x / noise**2 + torch.eye(d, dtype=torch.float64) / prior**2)
    return x, y[:, None], cov @ x.T @ y / noise**2, cov


def _sampler(method, d, noise=0.5, prior=1.0, **kw):
    torch.manual_seed(0)
    return bw.wrap(nn.Linear(d, 1, bias=False).double(), method, num_data=50, prior_std=prior, prior_mean="zero",
                   likelihood="gaussian", noise_std=noise, **kw).double()


@pytest.mark.parametrize("method, d, kw", [("hmc", 3, {"num_leapfrog": 8}), ("mh", 2, {})])
def test_sampler_matches_the_closed_form_bayesian_linear_regression_posterior(method, d, kw):
    x, y, mean, cov = _blr(d=d)
    bnn = _sampler(method, d, **kw)
    bnn.run_chains(x, y, num_samples=1500 if method == "hmc" else 4000, num_warmup=500, num_chains=4,
                   generator=torch.Generator().manual_seed(1))
    draws = bnn.chain_draws()["weight"][..., 0, :]  # (chains, draws, d)
    ess = diag.ess_bulk(draws)  # per coordinate, from the run itself
    pooled = draws.reshape(-1, d)
    sd = cov.diagonal().sqrt()
    # the tolerance is Monte Carlo error from the measured ESS: |mean error| < 4 sd / sqrt(ESS)
    assert torch.all((pooled.mean(0) - mean).abs() < 4 * sd / ess.sqrt()), (pooled.mean(0), mean, ess)
    # variances: the sampling error of a variance is about sqrt(2 / ESS) relative
    rel = (pooled.var(0) / cov.diagonal() - 1).abs()
    assert torch.all(rel < 4 * torch.sqrt(2 / ess)), (rel, ess)
    # correlations as well
    emp = torch.cov(pooled.T)
    corr_err = (emp / torch.outer(emp.diagonal().sqrt(), emp.diagonal().sqrt())
                - cov / torch.outer(sd, sd)).abs().max()
    assert corr_err < 4 / math.sqrt(float(ess.min())) + 0.02
    assert diag.rhat(draws).max() < 1.05


def test_dual_averaging_reaches_the_target_acceptance_on_a_gaussian_target():
    x, y, _, _ = _blr()
    for target in (0.8, 0.65):
        bnn = _sampler("hmc", 3, num_leapfrog=5, adapt_mass=False, target_accept=target)
        stats = bnn.run_chains(x, y, num_samples=200, num_warmup=600, num_chains=4,
                               generator=torch.Generator().manual_seed(2))
        assert all(abs(a - target) < 0.05 for a in stats["warmup_acceptance"]), stats["warmup_acceptance"]
        # sampling uses the averaged step size ε̄ (the geometric mean): its acceptance is a little higher
        assert all(target - 0.05 < a < min(1.0, target + 0.2) for a in stats["acceptance_rate"]), stats


def test_mass_matrix_adaptation_learns_the_posterior_scales():
    x, y, _, cov = _blr(d=3)
    x = x * torch.tensor([1.0, 10.0, 0.1], dtype=torch.float64)  # badly scaled: posterior stds differ 100x
    cov = torch.linalg.inv(x.T @ x / 0.25 + torch.eye(3, dtype=torch.float64))
    bnn = _sampler("hmc", 3, num_leapfrog=8)
    stats = bnn.run_chains(x, y, num_samples=300, num_warmup=500, num_chains=2,
                           generator=torch.Generator().manual_seed(3))
    assert stats["divergences"] == [0, 0]
    draws = bnn.chain_draws()["weight"][..., 0, :].reshape(-1, 3)
    ratio = draws.var(0) / cov.diagonal()
    assert torch.all((ratio > 0.5) & (ratio < 2.0)), ratio


def test_chains_started_in_different_modes_are_flagged_by_rhat():
    # y = w² + noise: the posterior over w has modes near ±1.2; started there, MH chains stay put
    class Square(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1, dtype=torch.float64))

        def forward(self, x):
            return (self.w ** 2).expand(len(x), 1)

    y = torch.full((200, 1), 1.44, dtype=torch.float64) + 0.1 * torch.randn(200, 1, generator=torch.Generator()
                                                                          .manual_seed(0), dtype=torch.float64)
    x = torch.zeros(200, 1, dtype=torch.float64)
    bnn = bw.wrap(Square(), "mh", num_data=200, prior_mean="zero", likelihood="gaussian", noise_std=0.1).double()
    init = {"w": torch.tensor([[-1.2], [-1.2], [1.2], [1.2]], dtype=torch.float64)}
    bnn.run_chains(x, y, num_samples=400, num_warmup=200, num_chains=4, init=init,
                   generator=torch.Generator().manual_seed(1))
    report = bnn.diagnostics()
    assert report["parameters"]["w"]["rhat"] > 1.1 and report["summary"]["rhat"] > 1.1
    # the same chains all started in one mode converge
    bnn.run_chains(x, y, num_samples=400, num_warmup=200, num_chains=4, init={"w": init["w"].abs()},
                   generator=torch.Generator().manual_seed(1))
    assert bnn.diagnostics()["summary"]["rhat"] < 1.05


def test_predict_ensembles_the_draws_like_sgld_and_diagnostics_report_everything():
    from sklearn.datasets import load_iris

    data = load_iris()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), "hmc", num_data=len(x),
                  prior_std=1.0, prior_mean="zero", num_leapfrog=10)
    with pytest.raises(bw.NotFittedError, match=r"call bnn.run_chains"):
        bnn.predict(x, 2)
    stats = bnn.run_chains(x, y, num_samples=60, num_warmup=100, num_chains=3, thinning=2,
                           generator=torch.Generator().manual_seed(0))
    assert len(bnn.sample_store) == 30 and stats["num_chains"] == 3
    probs = bnn.predict(x, 90)  # every kept draw of every chain once
    pooled = {n: t.reshape(-1, *t.shape[2:]) for n, t in bnn.chain_draws().items()}
    manual = torch.stack([bnn.forward_with({n: t[i] for n, t in pooled.items()}, x).softmax(-1)
                          for i in range(90)]).mean(0)
    assert torch.allclose(probs, manual, atol=1e-5)
    assert (probs.argmax(1) == y).float().mean() > 0.9
    report = bnn.diagnostics()
    assert set(report["parameters"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for key in ("rhat", "ess_bulk", "ess_tail"):
        assert math.isfinite(report["summary"][key])
    assert len(report["acceptance_rate"]) == 3 and len(report["step_size"]) == 3 and len(report["divergences"]) == 3
    # the draws survive a checkpoint
    again = bw.wrap(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), "hmc", num_data=len(x),
                    prior_mean="zero", num_chains=1)
    again.load_state_dict(bnn.state_dict())
    assert torch.allclose(again.predict(x, 90), probs, atol=1e-6)


@pytest.mark.parametrize("method", ["hmc", "mh"])
@pytest.mark.parametrize("kwargs, match", [
    ({"num_chains": 0}, r"num_chains=0 must be an integer >= 1"),
    ({"num_samples": -1}, r"num_samples=-1 must be an integer >= 0"),
    ({"num_warmup": -5}, r"num_warmup=-5 must be an integer >= 0"),
    ({"thinning": 0}, r"thinning=0 must be an integer >= 1"),
])
def test_run_chains_bad_options(method, kwargs, match):
    bnn = bw.wrap(nn.Linear(2, 2), method, num_data=4)
    with pytest.raises(ValueError, match=match):
        bnn.run_chains(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]), **kwargs)


def test_mcmc_bad_input():
    with pytest.raises(ValueError, match=r"inputs \(4 examples\) and targets \(3\) must have the same"):
        bw.wrap(nn.Linear(2, 2), "hmc", num_data=4).run_chains(torch.randn(4, 2), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match=r"has 1,101 Bayesian parameters, above max_parameters=1,000; use 'sgld'"):
        bw.wrap(nn.Sequential(nn.Linear(20, 50), nn.Linear(50, 1)), "hmc", num_data=4, max_parameters=1000)
    bnn = bw.wrap(nn.Linear(2, 2), "hmc", num_data=4)
    with pytest.raises(ValueError, match=r"initial potential U\(θ\) is not finite for chain\(s\) \[1\]"):
        bnn.run_chains(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]), num_chains=2, init={
            "weight": torch.tensor([[[0.0, 0.0], [0.0, 0.0]], [[1e30, 0.0], [0.0, 0.0]]]),
            "bias": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"not trained with bw.fit: sample it with bnn.run_chains"):
        bw.fit(bnn, [(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]))], epochs=1,
               optimizer=torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))


def test_cli_samples_with_mh_and_writes_diagnostics_and_plots(tmp_path):
    import json

    import bayeswrap.app.cli as cli

    args = ["fit", "--method", "mh", "--num-warmup", "40", "--chain-samples", "40", "--num-chains", "3",
            "--thinning", "2", "--num-samples", "10", "--shift-rotations", "0", "--shift-noise", "0",
            "--out-dir", str(tmp_path), "--progress", "false"]
    assert cli.main(args) == 0
    run = tmp_path / "digits-mlp-mh"
    metrics = json.loads((run / "metrics.json").read_text())
    mcmc = metrics["mcmc"]
    assert mcmc["num_chains"] == 3 and len(mcmc["acceptance_rate"]) == 3
    assert math.isfinite(mcmc["diagnostics"]["summary"]["rhat"])
    for name in ("trace.png", "rank.png", "reliability_T1.png", "best.pt"):
        assert (run / name).stat().st_size > 1000, name
    # the saved run predicts from its draws
    loaded = bw.load_run(run)
    assert len(loaded.model.sample_store) == 20
    assert cli.main(["fit", "--method", "hmc", "--num-chains", "0", "--out-dir", str(tmp_path)]) == 2


def test_hmc_and_pyro_nuts_agree_on_logistic_regression():
    pytest.importorskip("pyro", reason="pyro-ppl is not installed: the NUTS comparison is skipped")

    class Logistic(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1)

        def forward(self, x):
            z = self.lin(x)
            return torch.cat([torch.zeros_like(z), z], 1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 2, generator=g, dtype=torch.float64)
    y = (torch.rand(80, generator=g, dtype=torch.float64) < torch.sigmoid(x @ torch.tensor([1.5, -1.0],
                                                                                          dtype=torch.float64) + 0.3)).long()
    runs = {}
    for kernel in ("hmc", "nuts"):
        torch.manual_seed(0)
        bnn = bw.wrap(Logistic().double(), "hmc", num_data=80, prior_mean="zero", kernel=kernel,
                      num_leapfrog=8).double()
        bnn.run_chains(x, y, num_samples=600, num_warmup=300, num_chains=2, generator=torch.Generator().manual_seed(1))
        d = torch.cat([t.reshape(*t.shape[:2], -1) for t in bnn.chain_draws().values()], -1)  # (chains, draws, 3)
        runs[kernel] = (d.reshape(-1, 3), diag.ess_bulk(d))
    (a, ess_a), (b, ess_b) = runs["hmc"], runs["nuts"]
    se = torch.sqrt(a.var(0) / ess_a + b.var(0) / ess_b)
    assert torch.all((a.mean(0) - b.mean(0)).abs() < 4 * se), (a.mean(0), b.mean(0), se)
    ess = torch.minimum(ess_a, ess_b)
    assert torch.all((a.std(0) / b.std(0) - 1).abs() < 4 * torch.sqrt(1 / ess) + 0.05)


def test_nuts_without_pyro_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyro(name, *args, **kwargs):
        if name == "pyro" or name.startswith("pyro."):
            raise ImportError("No module named 'pyro'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyro)
    with pytest.raises(ValueError, match=r"kernel='nuts' needs the pyro-ppl package"):
        bw.wrap(nn.Linear(2, 2), "hmc", num_data=4, kernel="nuts")
    with pytest.raises(ValueError, match=r"kernel='slice' is not known; accepted: 'hmc'"):
        bw.wrap(nn.Linear(2, 2), "hmc", num_data=4, kernel="slice")


def test_the_potential_is_n_times_the_training_loss_and_predictions_use_the_stored_draws():
    from bayeswrap.methods.mcmc import FlatLayout
    from bayeswrap.methods.predictives import StoredDraws

    x, y, _, _ = _blr(d=2)
    bnn = _sampler("mh", 2, prior=2.0)
    # the hooks are the potential's terms at θ₀: U(θ₀) = N · loss(x, y), regularizer = −log p(θ₀) + const
    theta0 = bnn.theta.as_dict()
    layout = FlatLayout(theta0)
    u0 = bnn._energy(x, y, layout)(layout.flatten({n: t[None] for n, t in theta0.items()})[0])
    out = bnn.loss(x, y)
    assert torch.allclose(50 * out.loss, u0)
    assert torch.allclose(bnn.regularizer(), theta0["weight"].square().sum() / (2 * 2.0**2))
    bnn.run_chains(x, y, num_samples=40, num_warmup=20, num_chains=2, generator=torch.Generator().manual_seed(0))
    assert isinstance(bnn.default_predictive(), StoredDraws)
    pooled = bnn.chain_draws()["weight"].reshape(80, 1, 2)  # chain 0's draws, then chain 1's
    assert torch.equal(bnn.sample(80)["weight"], pooled)  # S = count: every kept draw once, in chain order
    assert torch.equal(bnn.sample(2)["weight"], pooled[[20, 60]])  # evenly spread over both chains
    manual = torch.stack([bnn.forward_with({"weight": w}, x) for w in pooled])
    assert torch.allclose(bnn.sample_logits(x, 80), manual)
    with pytest.raises(ValueError, match=r"model='mpm' is not accepted by method 'mh'"):
        bnn.predict(x, 3, model="mpm")
    with pytest.raises(TypeError, match=r"predictive option\(s\) \['pred_type'\] are not accepted by method 'mh'"):
        bnn.predict(x, 3, pred_type="glm")
