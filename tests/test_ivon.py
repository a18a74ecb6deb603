"""IVON (Shen et al. 2024): closed-form fixed points, a hand-written step, the official package, errors."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayeswrap as bw
import bayeswrap.methods.ivon as ivon_module


# ----------------------------------------------------------------------------- fixed point (known answer)
def _regression_data(seed=0, n=500, d=5, prior_std=0.1, residual_std=0.2):
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(d, dtype=torch.float64) + 0.2 * torch.randn(d, d, generator=g, dtype=torch.float64)
    scale = torch.linspace(0.7, 1.5, d, dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ mix * scale
    w = prior_std * torch.randn(d, generator=g, dtype=torch.float64)
    y = x @ w + residual_std * torch.randn(n, generator=g, dtype=torch.float64)
    return x, y[:, None]


@pytest.mark.parametrize("kl_weight", [1.0, 0.5])
def test_linear_regression_reaches_the_mean_field_optimum(kl_weight):
    """Bayesian linear regression, minibatches of 32: IVON's fixed point is the mean-field optimum.

    With loss = NLL_mean + kl_weight·KL/N the target is the tempered posterior
    ∝ exp(−NLL_sum/kl_weight)·N(θ; 0, p²): with P = XᵀX/s² + (kl_weight/p²) I its covariance is
    kl_weight·P⁻¹ and its mean P⁻¹Xᵀy/s².
    IVON's h converges to diag of the per-datum Hessian (E[ĥ] = E[ĝ(θ−m)]/σ² = diag H for a quadratic),
    so σ = 1/sqrt(λ(h + δ)) = sqrt(kl_weight / diag P), the mean-field optimum, and m to the exact mean.

    Choices that keep a 100-epoch run's last iterate close to the fixed point: the likelihood's
    noise_std (1) is 5× the data's residual std, which leaves the posterior as it is but shrinks
    the minibatch-gradient term of ĥ; β₂ = 0.997 averages ĥ over ~330 steps (the paper's 0.99999 is
    for 10⁵-step runs); lr ∝ 1/epoch (with the Newton-like step this makes m a running average;
    a cosine schedule freezes m at lr ~ 5e-3 and leaves ~0.08 σ of SGD noise in it).
    Over 12 seeds the largest errors were 7% (σ) and 0.07 posterior std (mean).
    """
    noise_std, prior_std, n = 1.0, 0.1, 500
    x, y = _regression_data(n=n, prior_std=prior_std)
    precision = x.T @ x / noise_std**2 + kl_weight / prior_std**2 * torch.eye(x.shape[1], dtype=torch.float64)
    exact_mean = torch.linalg.solve(precision, x.T @ y[:, 0] / noise_std**2)
    exact_std = (kl_weight * torch.linalg.inv(precision).diagonal()).sqrt()
    mean_field_std = (kl_weight / precision.diagonal()).sqrt()

    torch.manual_seed(0)
    bnn = bw.wrap(nn.Linear(x.shape[1], 1, bias=False).double(), "ivon", num_data=n, prior_std=prior_std,
                  prior_mean="zero", likelihood="gaussian", noise_std=noise_std, kl_weight=kl_weight, hess_init=0.5)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    opt = bw.optim.IVON(bnn.param_groups(), lr=0.3, beta2=0.997)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1 / (1 + epoch))
    bw.fit(bnn, loader, epochs=100, optimizer=opt, scheduler=sched, progress=False)

    h_star = (x**2).mean(0) / noise_std**2
    std = bnn.posterior_std()["weight"][0]
    mean = bnn.posterior_mean()["weight"][0]
    assert torch.allclose(bnn.hess["weight"][0], h_star, rtol=0.3)
    assert torch.allclose(std, mean_field_std, rtol=0.10), (std / mean_field_std).tolist()
    assert torch.all((mean - exact_mean).abs() < 0.1 * exact_std), ((mean - exact_mean) / exact_std).tolist()
    # the mean-field σ is smaller than the exact marginal std, as it should be for correlated features
    assert torch.all(mean_field_std < exact_std)




def test_classification_mlp_matches_adam_map_accuracy(one_thread):
    """sklearn digits, a small MLP, 8 epochs: IVON's predictive is about as accurate as Adam-trained MAP."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1400], perm[1400:]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[train], y[train]), batch_size=32,
                                         shuffle=True, generator=torch.Generator().manual_seed(0))

    def error(bnn, **kw):
        return (bnn.predict(x[test], **kw).argmax(1) != y[test]).float().mean().item()

    errors = {}
    for method in ("map", "ivon"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        bnn = bw.wrap(model, method, num_data=len(train), prior_std=1.0, prior_mean="zero")
        opt = (torch.optim.Adam(bnn.parameters(), lr=3e-3) if method == "map"
               else bw.optim.IVON(bnn.param_groups(), lr=0.2, beta2=0.999, clip_radius=1.0))
        bw.fit(bnn, loader, epochs=8, optimizer=opt, progress=False)
        errors[method] = error(bnn, num_samples=0) if method == "map" else error(bnn, num_samples=8,
                                                                                    generator=torch.Generator())
    assert errors["map"] < 0.08
    assert errors["ivon"] <= errors["map"] + 0.03, errors


# ----------------------------------------------------------------------------- one step against a naive reference
def _fixed_draws(monkeypatch, draws):
    """Makes the model's ε the given tensors, one list per training draw."""
    it = iter(draws)
    monkeypatch.setattr(ivon_module, "standard_normal_like", lambda tensors: [e.clone() for e in next(it)])


def test_two_steps_equal_a_hand_written_algorithm_1(monkeypatch):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2)).double()
    num_data, kl_weight, prior_std, hess_init = 20, 0.7, 0.5, 0.3
    lr, beta1, beta2, radius = 0.05, 0.8, 0.9, 0.02
    # the last bias is a point estimate: heavy-ball SGD
    bnn = bw.wrap(model, "ivon", num_data=num_data, prior_std=prior_std, kl_weight=kl_weight, hess_init=hess_init,
                  params=["0.*", "2.weight"])
    prior = {n: t.clone() for n, t in bnn.prior.mean.items()}  # "init": the model's weights
    for t in bnn.mean.values():  # move m away from θ̄ so that the pull towards θ̄ matters
        t.data.add_(0.1 * torch.randn_like(t))
    opt = bw.optim.IVON(bnn.param_groups(), lr=lr, beta1=beta1, beta2=beta2, clip_radius=radius)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (5,), generator=g))
               for _ in range(2)]
    draws = [[torch.randn(t.shape, generator=g, dtype=torch.float64) for t in bnn.mean.values()] for _ in range(2)]

    # naive Algorithm 1 on plain tensors
    ess, delta = num_data / kl_weight, kl_weight / (num_data * prior_std**2)
    names = bnn.mean.keys()
    m = {n: t.detach().clone() for n, t in bnn.mean.items()}
    h = {n: torch.full_like(t, hess_init) for n, t in m.items()}
    mom = {n: torch.zeros_like(t) for n, t in m.items()}
    bias = bnn.point["2.bias"].detach().clone()
    bias_mom = torch.zeros_like(bias)
    clipped = []
    for t, ((x, y), eps) in enumerate(zip(batches, draws), start=1):
        sigma = {n: 1 / (ess * (h[n] + delta)).sqrt() for n in names}
        theta = {n: (m[n] + sigma[n] * e).requires_grad_() for n, e in zip(names, eps)}
        b = bias.clone().requires_grad_()
        out = torch.func.functional_call(model, {**theta, "2.bias": b}, (x,))
        grads = torch.autograd.grad(F.cross_entropy(out, y), [*theta.values(), b])
        for n, g_hat in zip(names, grads):
            h_hat = g_hat * (theta[n].detach() - m[n]) / sigma[n] ** 2
            mom[n] = beta1 * mom[n] + (1 - beta1) * g_hat
            h[n] = beta2 * h[n] + (1 - beta2) * h_hat + 0.5 * (1 - beta2) ** 2 * (h[n] - h_hat) ** 2 / (h[n] + delta)
            step = (mom[n] / (1 - beta1**t) + delta * (m[n] - prior[n])) / (h[n] + delta)
            clipped.append((step.abs() > radius).flatten())
            m[n] = m[n] - lr * (hess_init + delta) * step.clamp(-radius, radius)
        bias_mom = beta1 * bias_mom + (1 - beta1) * grads[-1]
        bias = bias - lr * bias_mom / (1 - beta1**t)

    _fixed_draws(monkeypatch, draws)
    bw.fit(bnn, batches, epochs=1, optimizer=opt, progress=False)
    clipped = torch.cat(clipped)
    assert clipped.any() and not clipped.all()  # both sides of clip_radius are exercised
    for n in names:
        torch.testing.assert_close(bnn.mean[n], m[n], rtol=0, atol=1e-12)
        torch.testing.assert_close(bnn.hess[n], h[n], rtol=0, atol=1e-12)
    torch.testing.assert_close(bnn.point["2.bias"], bias, rtol=0, atol=1e-12)
    assert all(opt.state[p]["step"] == 2 for p in bnn.parameters())


def test_trajectory_equals_the_official_ivon_package():
    """Same data, same ε (same RNG stream), prior mean 0: bayeswrap and ``ivon-opt`` take identical steps."""
    ivon = pytest.importorskip("ivon")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    reference = copy.deepcopy(model)
    # hess_init exact in float32: ivon-opt fills its float64 h from torch.as_tensor(hess_init), a float32
    num_data, prior_std, kl_weight, hess_init = 40, 0.8, 0.5, 0.25
    bnn = bw.wrap(model, "ivon", num_data=num_data, prior_std=prior_std, prior_mean="zero", kl_weight=kl_weight,
                  hess_init=hess_init)
    kw = dict(lr=0.05, beta1=0.8, beta2=0.9, clip_radius=0.5)
    ours = bw.optim.IVON(bnn.param_groups(), **kw)
    theirs = ivon.IVON(reference.parameters(), ess=num_data / kl_weight, hess_init=hess_init,
                       weight_decay=kl_weight / (num_data * prior_std**2), **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        x = torch.randn(8, 3, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        torch.manual_seed(100 + step)
        ours.zero_grad()
        bnn.loss(x, y).loss.backward()
        ours.step()
        torch.manual_seed(100 + step)
        theirs.zero_grad()
        with theirs.sampled_params(train=True):
            F.cross_entropy(reference(x), y).backward()
        theirs.step()
    for (name, p), mean in zip(reference.named_parameters(), bnn.mean.values()):
        torch.testing.assert_close(mean, p, rtol=1e-10, atol=1e-12, msg=name)
    their_hess = theirs.param_groups[0]["hess"]
    torch.testing.assert_close(torch.cat([h.flatten() for h in bnn.hess.values()]), their_hess,
                               rtol=1e-10, atol=1e-12)
    assert not torch.allclose(their_hess, torch.full_like(their_hess, hess_init))  # h did move


# ----------------------------------------------------------------------------- contract and errors
def _tiny(**kw):
    torch.manual_seed(0)
    return bw.wrap(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), "ivon", num_data=64, **kw)


def _batches():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return [(x[:16], torch.randint(0, 3, (16,), generator=g)), (x[16:], torch.randint(0, 3, (16,), generator=g))]


def test_posterior_before_training_and_detached_kl():
    bnn = _tiny(prior_std=0.5, kl_weight=2.0, hess_init=0.4)
    expected = 1 / math.sqrt(64 * 0.4 / 2.0 + 1 / 0.5**2)
    for n, s in bnn.posterior_std().items():
        torch.testing.assert_close(s, torch.full_like(s, expected))
    probs = bnn.predict(torch.randn(5, 4), num_samples=3)
    assert probs.shape == (5, 3) and torch.allclose(probs.sum(1), torch.ones(5))
    out = bnn.loss(*_batches()[0])
    assert not out.kl.requires_grad and out.kl > 0
    out.loss.backward()  # the KL adds no gradient: m.grad is the NLL gradient only
    assert all(p.grad is not None for p in bnn.mean.values())


def test_state_dict_round_trip_keeps_hess_and_copies_are_independent():
    bnn = _tiny()
    opt = bw.optim.IVON(bnn.param_groups(), lr=0.1, beta2=0.9)
    bw.fit(bnn, _batches(), epochs=2, optimizer=opt, progress=False)
    assert any(not torch.allclose(h, torch.ones_like(h)) for h in bnn.hess.values())
    other = _tiny()
    other.load_state_dict(bnn.state_dict())
    for n in bnn.hess.keys():
        assert torch.equal(other.hess[n], bnn.hess[n]) and torch.equal(other.mean[n], bnn.mean[n])
    # a deep copy links its own means: training it leaves the original's h alone
    twin = copy.deepcopy(bnn)
    before = {n: h.clone() for n, h in bnn.hess.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the copy's means are IVON means already, before any draw
        twin_opt = bw.optim.IVON(twin.param_groups(), lr=0.1, beta2=0.9)
    bw.fit(twin, _batches(), epochs=1, optimizer=twin_opt, progress=False)
    assert all(torch.equal(bnn.hess[n], before[n]) for n in before)
    assert any(not torch.equal(twin.hess[n], before[n]) for n in before)


def test_plain_parameters_warn_and_get_heavy_ball_sgd():
    layer = nn.Linear(2, 1)
    with pytest.warns(UserWarning, match="heavy-ball SGD"):
        opt = bw.optim.IVON(layer.parameters(), lr=0.5, beta1=0.5)
    before = layer.weight.detach().clone()
    layer(torch.ones(1, 2)).sum().backward()  # d/dw = 1
    opt.step()  # ḡ = g / (1 − β₁) = 1 at the first step
    torch.testing.assert_close(layer.weight.detach(), before - 0.5)


def test_fit_refuses_other_optimizers_and_step_needs_a_draw():
    bnn = _tiny()
    with pytest.raises(ValueError, match="bayeswrap.optim.IVON"):
        bw.fit(bnn, _batches(), epochs=1, optimizer=torch.optim.Adam(bnn.parameters()), progress=False)
    opt = bw.optim.IVON(bnn.param_groups(), lr=0.1)
    x, y = _batches()[0]
    bnn.forward_with(bnn.posterior_mean(), x).sum().backward()  # a gradient without a training draw
    with pytest.raises(RuntimeError, match="no training draw"):
        opt.step()


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=0.0), r"lr=0\.0 .*> 0"),
    (dict(lr=float("nan")), r"lr=nan"),
    (dict(lr=0.1, beta1=1.0), r"beta1=1\.0 .*\[0, 1\)"),
    (dict(lr=0.1, beta2=-0.1), r"beta2=-0\.1 .*\[0, 1\]"),
    (dict(lr=0.1, clip_radius=0), r"clip_radius=0 .*> 0"),
    (dict(lr="fast"), r"lr='fast'"),
])
def test_bad_optimizer_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.optim.IVON(_tiny().param_groups(), **kwargs)


def test_bad_group_argument_and_model_options():
    bnn = _tiny()
    with pytest.raises(ValueError, match=r"beta2=2"):
        bw.optim.IVON([{"params": list(bnn.parameters()), "beta2": 2}], lr=0.1)
    with pytest.raises(ValueError, match=r"hess_init=0"):
        _tiny(hess_init=0)
    with pytest.raises(ValueError, match=r"kl_weight=0"):
        _tiny(kl_weight=0)
    with pytest.raises(ValueError, match=r"bias='uninformative'"):
        _tiny(bias="uninformative")
    with pytest.raises(ValueError, match="prior_std=None"):
        _tiny(prior_std=None)
    assert bw.method_options("ivon") == ("hess_init",)


def test_ivon_kl_schedule_zero_factor_is_refused_naming_the_cause():
    """A KLSchedule warm-up (factor 0) makes λ = num_data / kl_weight infinite: a ValueError naming it, not ZeroDivisionError."""
    from bayeswrap.core.schedules import KLSchedule

    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    bnn = bw.wrap(torch.nn.Linear(3, 2), "ivon", num_data=8)
    opt = bw.optim.IVON(bnn.param_groups(), lr=0.1)
    with pytest.raises(ValueError, match="IVON needs kl_weight > 0"):
        bw.fit(bnn, [(x, y)], epochs=1, optimizer=opt, kl_schedule=KLSchedule(warmup_epochs=1))
