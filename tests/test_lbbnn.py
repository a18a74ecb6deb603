"""Layer-level reparameterisation (LRT) and latent binary BNNs (LBBNN): moments, KL, MPM, fallbacks, training."""

import math

import pytest
import torch
from torch import nn

import bayeswrap as bw
import bayeswrap.app.cli as cli


def _set(bnn, mu=None, rho=None, logit=None):
    with torch.no_grad():
        for store, values in ((bnn.mean, mu), (bnn.rho, rho), (getattr(bnn, "logit", None), logit)):
            for n, v in (values or {}).items():
                store[n].copy_(v)


def _lbbnn_layer(module, local_reparam, seed=0):
    torch.manual_seed(seed)
    bnn = bw.wrap(module, "lbbnn", num_data=100, prior_mean="zero", local_reparam=local_reparam).double()
    w, b = bnn.mean.keys()
    _set(bnn, mu={w: torch.randn_like(bnn.mean[w]), b: torch.randn_like(bnn.mean[b]) * 0.3},
         rho={w: torch.randn_like(bnn.rho[w]) * 0.5 - 0.5, b: torch.full_like(bnn.rho[b], -1.0)},
         logit={w: torch.randn_like(bnn.logit[w]) * 2})
    return bnn.eval(), w, b


def _formula(bnn, w, b, x, conv):
    """E[h] = b + Σ x α μ and Var[h] = σ_b² + Σ x² α(σ² + (1 − α) μ²), through the layer's operation."""
    mu, sigma, alpha = bnn.mean.as_dict(), bnn._sigma(), bnn.inclusion_probs()
    m, v = alpha[w] * mu[w], alpha[w] * (sigma[w] ** 2 + (1 - alpha[w]) * mu[w] ** 2)
    op = (lambda inp, weight, bias: nn.functional.conv2d(inp, weight, bias, padding=1)) if conv else \
        nn.functional.linear
    return op(x, m, mu[b]), op(x * x, v, sigma[b] ** 2)


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv2d"])
def test_lrt_moments_match_monte_carlo_over_sampled_weights(conv):
    module = nn.Conv2d(2, 3, 3, padding=1) if conv else nn.Linear(6, 4)
    x = torch.randn(2, 2, 4, 4, dtype=torch.float64) if conv else torch.randn(3, 6, dtype=torch.float64)
    s = 6000
    for local_reparam in (True, False):  # LRT draws and whole-weight draws (exact Bernoulli γ) alike
        bnn, w, b = _lbbnn_layer(module, local_reparam)
        mean, var = _formula(bnn, w, b, x, conv)
        with torch.no_grad():
            h = bnn.sample_logits(x, s, generator=torch.Generator().manual_seed(1)) if not conv else \
                torch.stack([bnn.forward_with({k: t[0] for k, t in bnn.sample(1).items()}, x) for _ in range(s)])
        se_mean = h.std(0) / math.sqrt(s)
        assert ((h.mean(0) - mean).abs() <= 3 * se_mean + 1e-12).float().mean() >= 0.97, local_reparam
        dev = (h - h.mean(0)) ** 2
        se_var = dev.std(0) / math.sqrt(s)
        assert ((h.var(0) - var).abs() <= 3 * se_var + 1e-12).float().mean() >= 0.97, local_reparam


def test_lbbnn_kl_equals_a_monte_carlo_estimate_for_one_weight():
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Linear(1, 1, bias=False), "lbbnn", num_data=10, prior_std=0.7, prior_inclusion=0.2,
                  prior_mean="zero").double()
    _set(bnn, mu={"weight": torch.tensor([[0.4]])}, rho={"weight": torch.tensor([[-0.8]])},
         logit={"weight": torch.tensor([[0.9]])})
    kl = bnn.regularizer().item()
    mu, sigma, alpha = 0.4, torch.nn.functional.softplus(torch.tensor(-0.8, dtype=torch.float64)).item(), \
        torch.sigmoid(torch.tensor(0.9, dtype=torch.float64)).item()
    g = torch.Generator().manual_seed(3)
    n = 400_000
    gamma = torch.rand(n, generator=g, dtype=torch.float64) < alpha
    wts = mu + sigma * torch.randn(n, generator=g, dtype=torch.float64)
    log_ratio_in = math.log(alpha / 0.2) + torch.distributions.Normal(mu, sigma).log_prob(wts) \
        - torch.distributions.Normal(0.0, 0.7).log_prob(wts)
    log_ratio = torch.where(gamma, log_ratio_in, torch.full_like(wts, math.log((1 - alpha) / 0.8)))
    assert kl == pytest.approx(log_ratio.mean().item(), abs=3 * log_ratio.std().item() / math.sqrt(n))


def test_lrt_vi_and_weight_sampling_vi_give_the_same_predictive_moments():
    torch.manual_seed(0)
    net = nn.Linear(5, 3)
    x = torch.randn(4, 5, dtype=torch.float64)
    outs = {}
    for local_reparam in (True, False):
        torch.manual_seed(1)
        vi = bw.wrap(net, "vi", num_data=20, local_reparam=local_reparam, init_std=0.3).double().eval()
        outs[local_reparam] = vi.sample_logits(x, 8000, generator=torch.Generator().manual_seed(2))
    for a, b in ((outs[True], outs[False]),):
        se = torch.sqrt(a.var(0) / len(a) + b.var(0) / len(b))
        assert ((a.mean(0) - b.mean(0)).abs() <= 3 * se).float().mean() >= 0.9
        assert torch.allclose(a.var(0), b.var(0), rtol=0.1)
    # LBBNN at α̃ = 1 is VI with LRT: its one-sample pre-activations have VI's moments
    lb = bw.wrap(net, "lbbnn", num_data=20, prior_mean="zero").double().eval()
    vi = bw.wrap(net, "vi", num_data=20, local_reparam=True, init_std=0.3).double().eval()
    with torch.no_grad():
        for n in lb.mean.keys():
            lb.mean[n].copy_(vi.mean[n])
            lb.rho[n].copy_(torch.log(torch.expm1(vi.posterior_std()[n])))  # softplus(ρ) = s
        lb.logit["weight"].fill_(50.0)
    theta_lb, theta_vi = lb.sample(1), vi.sample(1)
    for k in theta_vi:
        assert torch.allclose(theta_lb[k], theta_vi[k], rtol=1e-9, atol=1e-12), k


def test_density_pruning_and_to_deterministic_follow_the_mpm():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    bnn = bw.wrap(net, "lbbnn", num_data=50, prior_mean="zero")
    logits = {n: torch.randn_like(t) * 3 for n, t in bnn.logit.items()}
    _set(bnn, logit=logits)
    kept = sum(int((torch.sigmoid(t) > 0.5).sum()) for t in logits.values())
    total = sum(t.numel() for t in logits.values())
    assert bnn.density() == kept / total
    assert bnn.density(0.9) == sum(int((torch.sigmoid(t) > 0.9).sum()) for t in logits.values()) / total
    x = torch.randn(7, 4)
    bnn._optimizer_steps = 1  # a trained state (to_deterministic refuses untrained posteriors)
    mpm = bnn.predict(x, 0, model="mpm")
    net_det = bnn.to_deterministic()
    assert torch.allclose(net_det(x).softmax(-1), mpm, atol=1e-6)
    report = bnn.prune()
    assert report.pruned == total - kept and report.rule == "inclusion"
    assert bnn.density() == kept / total
    probs = bnn.inclusion_probs()
    assert all(bool(((p == 0) | (p == 1)).all()) for p in probs.values())
    # after pruning the full model is the MPM
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.allclose(bnn.predict(x, 4, generator=g1), bnn.predict(x, 4, generator=g2, model="mpm"))
    assert torch.allclose(bnn.to_deterministic()(x).softmax(-1), mpm, atol=1e-6)


def test_layers_without_lrt_support_fall_back_to_weight_sampling():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(9, 4), nn.LayerNorm(4))
    bnn = bw.wrap(net, "lbbnn", num_data=30, prior_mean="zero")
    assert [layer.path for layer in bnn.lrt_layers] == ["2"]
    draw = bnn.sample(2)
    assert "2.weight_var" in draw and "0.weight_var" not in draw and "3.weight_var" not in draw
    assert draw["0.weight"].shape == (2, 3, 2, 3)  # the Conv1d weight is sampled whole, with its γ
    x, y = torch.randn(8, 2, 5), torch.randint(0, 4, (8,))
    out = bnn.loss(x, y)
    out.loss.backward()
    assert torch.isfinite(out.loss) and bnn.logit["0.weight"].grad is not None


def test_lbbnn_trains_on_digits_with_adamw_and_sgd_in_minibatches():
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.data / 16, dtype=torch.float32), torch.tensor(d.target)
    train = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 1400, 64)]
    results = {}
    for name, make_opt in (("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2)),
                           ("sgd", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))):
        torch.manual_seed(0)
        bnn = bw.wrap(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), "lbbnn", num_data=1400,
                      prior_mean="zero")
        start = bnn.density()
        bw.fit(bnn, train, epochs=15, optimizer=make_opt(bnn.param_groups()), progress=False)
        acc = (bnn.predict(x[1400:], 10).argmax(1) == y[1400:]).float().mean().item()
        acc_mpm = (bnn.predict(x[1400:], 10, model="mpm").argmax(1) == y[1400:]).float().mean().item()
        results[name] = (acc, acc_mpm, start, bnn.density())
    for name, (acc, acc_mpm, start, end) in results.items():
        assert acc > 0.85 and acc_mpm > 0.8, (name, results)
    assert results["adamw"][3] < results["adamw"][2]  # the slab's KL sparsifies


def test_the_data_move_the_density_from_the_default_initialisation():
    """Regression (issue 25): λ ~ U(−10, 15) starts 60 % of the weights in; a short Adam run must move the density
    below 0.5 and below the fraction of λ₀ that lie beyond Σ lr (the distance Adam's nominal steps can cover), so
    the data, not the initialisation, set it, while the MPM keeps the full model's accuracy.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.data / 16, dtype=torch.float32), torch.tensor(d.target)
    train = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 1200, 64)]
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), "lbbnn", num_data=1200)
    lam0 = torch.cat([t.detach().reshape(-1) for t in bnn.logit.values()])
    # U(−10, 15): P(λ₀ > 0) = 0.6; 4,736 weights give a binomial std of 0.007
    assert bnn.density() == pytest.approx(0.6, abs=0.03)
    lr, epochs = 1e-2, 20
    bw.fit(bnn, train, epochs=epochs, optimizer=torch.optim.Adam(bnn.param_groups(), lr=lr), progress=False)
    budget = lr * len(train) * epochs  # Σ lr = 3.8
    out_of_reach = float((lam0 > budget).float().mean())  # (15 − 3.8) / 25 ≈ 0.45
    assert bnn.density() < 0.5 and bnn.density() < out_of_reach - 0.02, (bnn.density(), out_of_reach)
    g = torch.Generator().manual_seed(0)
    acc = (bnn.predict(x[1200:], 10, generator=g).argmax(1) == y[1200:]).float().mean().item()
    acc_mpm = (bnn.predict(x[1200:], 10, generator=g, model="mpm").argmax(1) == y[1200:]).float().mean().item()
    assert acc > 0.85 and acc_mpm > acc - 0.03, (acc, acc_mpm)


@pytest.mark.parametrize("kwargs, match", [
    ({"prior_inclusion": 0.0}, r"prior_inclusion=0.0 must be a number in \(0, 1\)"),
    ({"prior_inclusion": 1.0}, r"prior_inclusion=1.0 must be a number in \(0, 1\)"),
    ({"prior_inclusion": 1.5}, r"prior_inclusion=1.5"),
    ({"prior_inclusion": float("nan")}, r"prior_inclusion=nan"),
    ({"flow_length": -1}, r"flow_length=-1 must be an integer >= 0"),
    ({"flow_length": 1.5}, r"flow_length=1.5 must be an integer >= 0"),
    ({"flow_length": 2, "local_reparam": False}, r"flow_length=2 needs local_reparam=True"),
    ({"local_reparam": "yes"}, r"local_reparam='yes' is not accepted; accepted: True, False"),
    ({"temperature": 0}, r"temperature=0"),
    ({"init_inclusion_logit": (3, 1)}, r"init_inclusion_logit\[1\]=1"),
])
def test_lbbnn_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.wrap(nn.Linear(3, 2), "lbbnn", num_data=10, **kwargs)


@pytest.mark.parametrize("method", ["vi", "lbbnn"])
def test_local_reparam_without_linear_or_conv2d_is_refused(method):
    with pytest.raises(ValueError, match=r"local_reparam=True needs an nn.Linear or nn.Conv2d"):
        bw.wrap(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)), method, num_data=10, params=["1.*"],
                local_reparam=True)


@pytest.mark.parametrize("method", ["vi", "map", "sgld"])
def test_mpm_needs_inclusion_variables(method):
    bnn = bw.wrap(nn.Linear(3, 2), method, num_data=10)
    with pytest.raises(ValueError, match=rf"model='mpm' is not accepted by method '{method}'; accepted: 'full'"):
        bnn.predict(torch.randn(2, 3), 2, model="mpm")
    lb = bw.wrap(nn.Linear(3, 2), "lbbnn", num_data=10)
    with pytest.raises(ValueError, match=r"model='median' is not accepted by method 'lbbnn'; accepted: 'full', 'mpm'"):
        lb.predict(torch.randn(2, 3), 2, model="median")


def test_cli_fits_lbbnn_and_reports(tmp_path):
    import json

    args = ["fit", "--method", "lbbnn", "--epochs", "2", "--batch-size", "64", "--shift-rotations", "0,90",
            "--shift-noise", "0", "--num-samples", "3", "--out-dir", str(tmp_path), "--progress", "false"]
    assert cli.main(args) == 0
    metrics = json.loads((tmp_path / "digits-mlp-lbbnn" / "metrics.json").read_text())
    rep = metrics["final"]["3"]
    assert 0 <= rep["T1"]["error"] < 0.5 and rep["ood"]["mutual_information"]["auroc"] > 0.5
    run = bw.load_run(tmp_path / "digits-mlp-lbbnn")
    assert run.model.local_reparam and run.model.method == "lbbnn"


def test_flow_variant_trains_a_cnn_and_its_kl_carries_the_flow_terms():
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.data / 16, dtype=torch.float32).reshape(-1, 1, 8, 8), torch.tensor(d.target)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 10))
    bnn = bw.wrap(net, "lbbnn", num_data=1200, prior_mean="zero", flow_length=2, flow_hidden=(16, 16))
    assert set(bnn.flows.keys()) == {"0", "3"}
    assert bnn.flows["0"].mu0.shape == (8,) and bnn.flows["3"].mu0.shape == (512,)  # out channels / in features
    # the KL has log q(z) − log r(z | W): it changes with the flow's parameters
    torch.manual_seed(1)
    kl0 = bnn.regularizer()
    with torch.no_grad():
        bnn.flows["3"].b1.add_(1.0)
    torch.manual_seed(1)
    assert not torch.isclose(bnn.regularizer(), kl0)
    out = bnn.loss(x[:32], y[:32])
    out.loss.backward()
    assert all(p.grad is not None for p in bnn.flows.parameters())
    train = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 1200, 64)]
    bw.fit(bnn, train, epochs=6, optimizer=torch.optim.Adam(bnn.parameters(), lr=1e-2), progress=False)
    acc = (bnn.predict(x[1200:], 8).argmax(1) == y[1200:]).float().mean().item()
    acc_mpm = (bnn.predict(x[1200:], 8, model="mpm").argmax(1) == y[1200:]).float().mean().item()
    assert acc > 0.85 and acc_mpm > 0.8, (acc, acc_mpm)


def _flow_mlp(flow_length=2, **kwargs):
    torch.manual_seed(0)
    return bw.wrap(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), "lbbnn", num_data=10,
                   flow_length=flow_length, flow_hidden=(8,), **kwargs)


def test_flow_parameters_get_their_own_group_at_flow_lr():
    """Issue 32: the flows' parameters form ``"posterior/flow"`` (default lr 1e-3, no weight decay), right after
    ``"posterior"``; every parameter is in exactly one group; without flows the groups are the base's.
    """
    bnn = _flow_mlp()
    assert bnn.flow_lr == 1e-3
    groups = bnn.param_groups()
    assert [g["name"] for g in groups] == ["posterior", "posterior/flow"]
    flow_ids = {id(p) for p in bnn.flows.parameters()}
    assert {id(p) for p in groups[1]["params"]} == flow_ids and len(groups[1]["params"]) == len(flow_ids)
    assert not flow_ids & {id(p) for p in groups[0]["params"]}
    assert sorted(id(p) for g in groups for p in g["params"]) == sorted(id(p) for p in bnn.parameters())
    assert groups[1]["lr"] == 1e-3 and groups[1]["weight_decay"] == 0.0 and "lr" not in groups[0]
    # the optimizer keeps the group's lr and gives the rest its own
    opt = torch.optim.Adam(groups, lr=1e-2)
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-3]
    # a head keeps its own group and lr; flow_lr=None: the optimizer's lr
    named = [g["name"] for g in _flow_mlp(flow_lr=None).param_groups(head=["2.weight"], lr_head=0.5)]
    assert named == ["posterior", "posterior/flow", "posterior/head"]
    heads = _flow_mlp(flow_lr=None).param_groups(head=["2.weight"], lr_head=0.5)
    assert "lr" not in heads[1] and heads[2]["lr"] == 0.5
    assert [g["name"] for g in _flow_mlp(flow_length=0).param_groups()] == ["posterior"]


def test_adam_moves_the_flow_parameters_by_flow_lr_per_step():
    """Adam's first step moves every parameter by its group's lr (m̂/√v̂ = sign(g) at step 1, up to eps)."""
    bnn = _flow_mlp(flow_lr=2e-4).double()  # float64: a step of 2e-4 on log σ₀² = −9 is exact to 1e-12
    opt = torch.optim.Adam(bnn.param_groups(), lr=1e-2)
    before = {n: p.detach().clone() for n, p in bnn.named_parameters()}
    torch.manual_seed(1)
    bnn.loss(torch.randn(4, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0])).loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in bnn.named_parameters()}
    opt.step()
    for flows, lr in ((True, 2e-4), (False, 1e-2)):
        names = [n for n in before if n.startswith("flows.") == flows]
        steps = torch.cat([(bnn.get_parameter(n).detach() - before[n]).abs().reshape(-1) for n in names])
        big = torch.cat([grads[n].abs().reshape(-1) > 1e-4 for n in names])  # Adam's eps shortens tinier ones
        assert big.sum() > 10 and steps.max() <= lr * (1 + 1e-6)
        torch.testing.assert_close(steps[big], torch.full_like(steps[big], lr), rtol=1e-4, atol=0)


@pytest.mark.parametrize("flow_lr", [0, -1e-3, float("nan"), float("inf"), "1e-3"])
def test_bad_flow_lr_is_refused(flow_lr):
    with pytest.raises(ValueError, match=r"flow_lr=.* must be None or a finite number > 0"):
        _flow_mlp(flow_lr=flow_lr)


def test_flow_trains_at_its_defaults_on_digits():
    """Issue 32: LBBNN-FLOW at its defaults (2 IAF steps, 250-250 MADEs, Adam 1e-2 on ``param_groups()``) stays
    finite and learns on sklearn's digits: test accuracy above 0.85 for the full model and the MPM (LBBNN-LRT
    reaches 0.87-0.92 on this split), and the density falls from its initial 0.6.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.data / 16, dtype=torch.float32), torch.tensor(d.target)
    train = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 1200, 64)]
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), "lbbnn", num_data=1200,
                  flow_length=2)
    history = bw.fit(bnn, train, epochs=8, optimizer=torch.optim.Adam(bnn.param_groups(), lr=1e-2),
                     progress=False)
    assert all(math.isfinite(r["train_nll"]) and math.isfinite(r["train_kl"]) for r in history)
    assert all(torch.isfinite(p).all() for p in bnn.parameters())
    g = torch.Generator().manual_seed(0)
    acc = (bnn.predict(x[1200:], 10, generator=g).argmax(1) == y[1200:]).float().mean().item()
    acc_mpm = (bnn.predict(x[1200:], 10, generator=g, model="mpm").argmax(1) == y[1200:]).float().mean().item()
    assert acc > 0.85 and acc_mpm > 0.85, (acc, acc_mpm)
    assert bnn.density() < 0.58
