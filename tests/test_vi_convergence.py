"""VI's variances converge under the optimizers people use (issue 10).

Bayesian linear regression has a closed-form mean-field optimum: for the
Gaussian posterior N(μ, P⁻¹) the best factorised Gaussian has means μ and stds
1/sqrt(P_ii) (Bishop 2006, §10.1.2, eq. 10.13). These tests train ``"vi"`` the way a
user would — minibatches of 32 from a shuffled DataLoader, ``bw.fit``, a cosine
learning-rate schedule, 100 epochs — with SGD + momentum 0.9 and with AdamW at
the learning rate that trains the means, starting from the default
``init_std=1e-3`` (30× below the optimum), and require every std within 10% of
1/sqrt(P_ii) and every mean within 0.1 posterior std of μ.

Eight Monte Carlo samples per step keep the reparameterisation gradient's noise
below the 10% tolerance: over 4–6 seeds the largest deviation of s/s* was 6.6%
(SGD, std 3.0%) and 7.6% (AdamW, std 4.0%); with one sample the final-iterate
std is ~9%.
"""

import math

import pytest
import torch
from torch import nn

import bayeswrap as bw

NOISE_STD, PRIOR_STD, N, D = 1.0, 1.0, 1024, 5


@pytest.fixture(scope="module")
def linreg():
    """Correlated features on different scales; the exact posterior N(μ, P⁻¹) in float64."""
    g = torch.Generator().manual_seed(0)
    mix = (torch.eye(D) + 0.3 * torch.ones(D, D)) / 1.3
    x = (torch.randn(N, D, generator=g, dtype=torch.float64) @ mix.double()) * torch.linspace(0.5, 2.0, D).double()
    y = x @ torch.randn(D, 1, generator=g, dtype=torch.float64) + NOISE_STD * torch.randn(N, 1, generator=g,
                                                                                          dtype=torch.float64)
    precision = x.T @ x / NOISE_STD**2 + torch.eye(D, dtype=torch.float64) / PRIOR_STD**2
    cov = torch.linalg.inv(precision)
    return {"x": x, "y": y, "mean": (cov @ x.T @ y).squeeze(1) / NOISE_STD**2,
            "post_std": cov.diagonal().sqrt(), "mean_field_std": precision.diagonal().rsqrt()}


def _train(linreg, make_optimizer, epochs=100):
    torch.manual_seed(0)
    model = nn.Linear(D, 1, bias=False).double()
    bnn = bw.wrap(model, "vi", num_data=N, prior_std=PRIOR_STD, prior_mean="zero", likelihood="gaussian",
                  noise_std=NOISE_STD, num_train_samples=8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(linreg["x"], linreg["y"]),
                                         batch_size=32, shuffle=True)
    optimizer = make_optimizer(bnn.param_groups())
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs)
    bw.fit(bnn, loader, epochs=epochs, optimizer=optimizer, scheduler=scheduler, progress=False)
    return bnn.posterior_mean()["weight"].detach().squeeze(0), bnn.posterior_std()["weight"].detach().squeeze(0)


@pytest.mark.parametrize("make_optimizer", [
    lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9),
    lambda groups: torch.optim.AdamW(groups, lr=5e-3),
], ids=["sgd_momentum", "adamw"])
def test_vi_reaches_the_mean_field_optimum(linreg, make_optimizer):
    m, s = _train(linreg, make_optimizer)
    ratio = s / linreg["mean_field_std"]
    assert torch.all((ratio - 1).abs() < 0.10), ratio
    assert torch.all((m - linreg["mean"]).abs() < 0.1 * linreg["post_std"]), (m - linreg["mean"]) / linreg["post_std"]


def test_softplus_parameterisation_would_not_move(linreg):
    """The failure this parameterisation fixes: with s = softplus(ρ) from 1e-3, SGD leaves s at 1e-3.

    The same ELBO and data, ρ trained by the same SGD for 10 epochs: s has not moved by 5%,
    while bayeswrap's VI (under a 10-epoch cosine schedule) has more than doubled every s.
    """
    x, y = linreg["x"], linreg["y"]
    rho = torch.full((D,), float(torch.log(torch.expm1(torch.tensor(1e-3, dtype=torch.float64)))),
                     dtype=torch.float64, requires_grad=True)
    m = torch.zeros(D, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([m, rho], lr=1e-2, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        for idx in torch.randperm(N, generator=g).split(32):
            s = torch.nn.functional.softplus(rho)
            theta = m + s * torch.randn(D, generator=g, dtype=torch.float64)
            nll = 0.5 * ((y[idx].squeeze(1) - x[idx] @ theta) ** 2).mean() / NOISE_STD**2
            kl = (torch.log(PRIOR_STD / s) + (s**2 + m**2) / (2 * PRIOR_STD**2) - 0.5).sum()
            opt.zero_grad()
            (nll + kl / N).backward()
            opt.step()
    assert torch.allclose(torch.nn.functional.softplus(rho), torch.full_like(rho, 1e-3), rtol=0.05)
    _, s_ours = _train(linreg, lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9), epochs=10)
    assert torch.all(s_ours > 2e-3), s_ours


def test_vi_reaches_the_mean_field_optimum_from_a_small_init_under_sgd(linreg):
    """BayesDLL's Table 2 optimizer (SGD lr 1e-2, momentum 0.5) from s₀ = 1e-6 (issue 32): every s within 10% of
    1/sqrt(P_ii) after 64 epochs of 32 steps (2,048 steps, constant lr), 9.6–11.0 nats above s₀.

    With log s = κρ log s moves by at most c · lr / 2 / (1 − momentum) = 1e-3 nats per step below the optimum
    (~10⁴ steps for these 10 nats); the sinh map (slope growing with the distance below log σ) moves it ~25× faster
    far below. Reference: the same run with the linear map, whose stds have not left 1e-5.
    """
    from bayeswrap.methods import vi as vi_module

    def run(knee):
        torch.manual_seed(0)
        bnn = bw.wrap(nn.Linear(D, 1, bias=False).double(), "vi", num_data=N, prior_std=PRIOR_STD, prior_mean="zero",
                      likelihood="gaussian", noise_std=NOISE_STD, num_train_samples=8, init_std=1e-6)
        bnn.log_std_knee = knee  # the map is read at every step; ρ₀ of the linear map is re-set for s₀
        with torch.no_grad():
            bnn.rho["weight"].fill_(bnn._rho_of(torch.log(torch.tensor(1e-6)).item()))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(linreg["x"], linreg["y"]),
                                             batch_size=32, shuffle=True)
        bw.fit(bnn, loader, epochs=64, optimizer=torch.optim.SGD(bnn.param_groups(), lr=1e-2, momentum=0.5),
               progress=False)
        return bnn.posterior_std()["weight"].detach().squeeze(0)

    ratio = run(vi_module.LOG_STD_KNEE) / linreg["mean_field_std"]
    assert torch.all((ratio - 1).abs() < 0.10), ratio
    assert torch.all(run(None) < 1e-5)


def test_vi_loads_a_checkpoint_of_the_linear_log_std_map():
    """A state saved before the sinh map (no ``std_parameterisation``; log s = κρ) loads to the same stds."""
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Linear(3, 2), "vi", num_data=50, prior_std=0.5, kl_weight=0.1, init_std=1e-2)
    target = {n: torch.exp(torch.randn_like(r) * 3 - 4) for n, r in bnn.rho.items()}  # s from e^-13 to ~0.1
    target["weight"][0, 0] = 0.0  # a pruned std (exp(κ · -1e4))
    state = bnn.state_dict()
    old = {**state, "_extra_state": {k: v for k, v in state["_extra_state"].items() if k != "std_parameterisation"}}
    for n, s in target.items():
        old[f"rho.{n}"] = torch.log(s) / bnn.log_std_scale if n != "weight" else \
            torch.where(s > 0, torch.log(s.clamp_min(1e-30)) / bnn.log_std_scale, torch.tensor(-1.0e4))
    fresh = bw.wrap(nn.Linear(3, 2), "vi", num_data=50, prior_std=0.5, kl_weight=0.1)
    fresh.load_state_dict(old)
    for n, s in fresh.posterior_std().items():
        torch.testing.assert_close(s.detach(), target[n], rtol=1e-5, atol=0.0)
    assert fresh.state_dict()["_extra_state"]["std_parameterisation"] == 2
    newer = {**state, "_extra_state": {**state["_extra_state"], "std_parameterisation": 3}}
    with pytest.raises(ValueError, match="std_parameterisation=3"):
        fresh.load_state_dict(newer)


def test_the_projection_keeps_the_optimum_of_a_tempered_posterior():
    """kl_weight w < 1: s*² = w/(N h + w/σ²) ≤ σ², which is σ² for a weight the data do not reach (h = 0).

    The projection is s ≤ σ; the earlier bound sqrt(w) σ (0.32 σ here) excluded that optimum. A linear model whose
    second feature is 0, started at s₀ = 0.4 σ: the first std reaches its closed form within 10%, the second σ.
    """
    g = torch.Generator().manual_seed(1)
    n, w, sigma = 256, 0.1, 0.5
    x = torch.cat([torch.randn(n, 1, generator=g, dtype=torch.float64), torch.zeros(n, 1, dtype=torch.float64)], 1)
    y = 0.7 * x[:, :1] + torch.randn(n, 1, generator=g, dtype=torch.float64)
    optimum = (w / ((x**2).sum(0) + w / sigma**2)).sqrt()
    assert optimum[1] == pytest.approx(sigma) and optimum[1] > w**0.5 * sigma
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Linear(2, 1, bias=False).double(), "vi", num_data=n, prior_std=sigma, prior_mean="zero",
                  likelihood="gaussian", kl_weight=w, num_train_samples=8, init_std=0.4 * sigma)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    optimizer = torch.optim.SGD(bnn.param_groups(), lr=5e-2, momentum=0.9)
    bw.fit(bnn, loader, epochs=60, optimizer=optimizer, scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, 60), progress=False)
    s = bnn.posterior_std()["weight"].detach().squeeze(0)
    assert torch.all((s / optimum - 1).abs() < 0.10), s / optimum
    # the projection itself: s above σ is set to σ, s between sqrt(w) σ and σ is kept
    with torch.no_grad():
        bnn.rho["weight"].copy_(torch.tensor([[bnn._rho_of(math.log(0.8 * sigma)), bnn._rho_of(math.log(2 * sigma))]]))
    bnn.after_step()
    torch.testing.assert_close(bnn.posterior_std()["weight"].detach(), torch.tensor([[0.8 * sigma, sigma]],
                                                                                   dtype=torch.float64))
