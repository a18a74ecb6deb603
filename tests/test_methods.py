"""Every method: predictive invariants, equivalences, checkpoints and backbones."""

import pytest
import timm
import torch
import torchvision
from torch import nn

import bayeswrap as bw
from bayeswrap.methods.predictives import forward_many

METHODS = ["map", "vi", "mc_dropout", "sgld", "laplace", "lbbnn"]


def _mlp(out=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, out))


def _data(n=32, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, k, (n,), generator=g)


def _trained(method, model=None, steps=5, **kw):
    """A model after a few steps of training (with its posterior made available)."""
    model = model or _mlp()
    x, y = _data()
    bnn = bw.wrap(model, method, num_data=len(x), **kw)
    if method == "sgld":
        bnn.burn_in, bnn.thinning = 0, 1
        opt = bw.optim.SGLD(bnn.parameters(), lr=1e-2, num_data=len(x))
    else:
        opt = torch.optim.SGD(bnn.parameters(), lr=0.05)
    bw.fit(bnn, [(x, y)] * steps, epochs=1, optimizer=opt, progress=False)
    return bnn


@pytest.mark.parametrize("method", METHODS)
def test_predictive_probabilities_sum_to_one(method):
    bnn = _trained(method)
    x, _ = _data(10, seed=1)
    for s in (0, 1, 3, 11):  # 11 > chunk_size: several vmap chunks
        probs = bnn.predict(x, num_samples=s)
        assert probs.shape == (10, 4)
        torch.testing.assert_close(probs.sum(1), torch.ones(10), rtol=0, atol=1e-6)
        assert torch.all(probs >= 0)
    assert bnn.sample_logits(x, 11).shape == (11, 10, 4)
    samples = bnn.sample(7, generator=torch.Generator().manual_seed(0))
    assert samples["0.weight"].shape == (7, 16, 6)
    assert bnn.posterior_std()["2.bias"].shape == (4,)


@pytest.mark.parametrize("method", METHODS)
def test_zero_samples_is_forward_at_posterior_mean(method):
    bnn = _trained(method)
    x, _ = _data(10, seed=2)
    mean = {n: t.detach().clone() for n, t in bnn.posterior_mean().items()}
    reference = _mlp()
    reference.load_state_dict(mean)
    torch.testing.assert_close(bnn.predict(x, num_samples=0), reference(x).softmax(-1), rtol=1e-6, atol=1e-7)


def test_vmapped_samples_equal_one_by_one_forwards():
    bnn = _trained("vi", init_std=0.1)
    x, _ = _data(5, seed=3)
    thetas = bnn.sample(6, generator=torch.Generator().manual_seed(0))
    batched = forward_many(bnn, thetas, x)
    for i in range(6):
        torch.testing.assert_close(batched[i], bnn.forward_with({n: t[i] for n, t in thetas.items()}, x))


def test_mc_dropout_with_p_zero_equals_map():
    x, y = _data()
    outs = {}
    for method, kw in (("map", {}), ("mc_dropout", {"p_drop": 0.0, "bias": "spikymix"})):
        bnn = bw.wrap(_mlp(), method, num_data=100, prior_std=0.3, prior_mean="zero", **kw)
        out = bnn.loss(x, y)
        out.loss.backward()
        outs[method] = (out, [p.grad.clone() for p in bnn.parameters()], bnn.predict(x, num_samples=3))
    (a, ga, pa), (b, gb, pb) = outs["map"], outs["mc_dropout"]
    assert a.loss.item() == b.loss.item() and a.kl.item() == b.kl.item()
    for u, v in zip(ga, gb):
        assert torch.equal(u, v)
    assert torch.equal(pa, pb)


def test_mc_dropout_samples_mix_kept_and_prior_values():
    bnn = bw.wrap(_mlp(), "mc_dropout", num_data=10, p_drop=0.3, prior_mean="zero", bias="gaussian")
    s = bnn.sample(200, generator=torch.Generator().manual_seed(0))
    w = bnn.theta["0.weight"]
    dropped = (s["0.weight"] == 0)
    assert torch.all(dropped | (s["0.weight"] == w))
    assert abs(dropped.float().mean().item() - 0.3) < 0.01  # 19,200 Bernoulli draws
    assert torch.all(s["0.bias"] == bnn.theta["0.bias"])  # "gaussian": no dropout on biases
    torch.testing.assert_close(bnn.posterior_mean()["0.weight"], 0.7 * w)
    torch.testing.assert_close(bnn.posterior_std()["0.weight"], (0.21 ** 0.5) * w.abs())


def test_loss_terms_follow_the_equations():
    x, y = _data()
    model = _mlp()
    bnn = bw.wrap(model, "vi", num_data=50, prior_std=0.5, kl_weight=0.1, init_std=0.2, prior_mean="zero")
    torch.manual_seed(0)
    out = bnn.loss(x, y)
    # analytic KL between N(m, 0.2²) and N(0, 0.5²), summed
    kl = 0.0
    for p in model.parameters():
        kl += (torch.log(torch.tensor(0.5 / 0.2)) + (0.2**2 + p.detach() ** 2) / (2 * 0.5**2) - 0.5).sum()
    torch.testing.assert_close(out.kl, kl)
    torch.testing.assert_close(out.loss, out.nll + 0.1 * kl / 50)
    # uninformative biases contribute no KL
    bnn_u = bw.wrap(model, "vi", num_data=50, prior_std=0.5, init_std=0.2, prior_mean="zero", bias="uninformative")
    kl_w = sum((torch.log(torch.tensor(2.5)) + (0.04 + p.detach() ** 2) / 0.5 - 0.5).sum()
               for n, p in model.named_parameters() if n.endswith("weight"))
    torch.testing.assert_close(bnn_u.regularizer(), kl_w)
    # MAP without a prior: plain maximum likelihood
    ml = bw.wrap(model, "map", num_data=50, prior_std=None)
    assert ml.regularizer().item() == 0.0
    torch.testing.assert_close(ml.loss(x, y).loss, nn.functional.cross_entropy(model(x), y))


def test_gaussian_predictive_includes_noise_and_parameter_variance():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    bnn = bw.wrap(model, "vi", num_data=10, likelihood="gaussian", noise_std=0.3, init_std=0.5)
    x = torch.randn(4, 3)
    mean, var = bnn.predict(x, num_samples=4000, generator=torch.Generator().manual_seed(0))
    assert mean.shape == var.shape == (4, 2)
    # Var[w·x + b] = s² (|x|² + 1) for independent N(·, s²) weights
    expected = 0.3**2 + 0.5**2 * (x.pow(2).sum(1, keepdim=True) + 1)
    torch.testing.assert_close(var, expected.expand(4, 2), rtol=0.08, atol=0)
    torch.testing.assert_close(mean, model(x).detach(), rtol=0, atol=0.1)
    m0, v0 = bnn.predict(x, num_samples=0)
    torch.testing.assert_close(v0, torch.full((4, 2), 0.09))


@pytest.mark.parametrize("method", METHODS)
def test_state_dict_round_trip(method, tmp_path):
    bnn = _trained(method)
    x, _ = _data(8, seed=4)
    torch.save(bnn.state_dict(), tmp_path / "ckpt.pt")
    fresh = bw.wrap(_mlp(), method, num_data=32)
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True))
    fresh.eval()
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    torch.testing.assert_close(fresh.predict(x, 4, generator=g1), bnn.predict(x, 4, generator=g2), rtol=0, atol=0)


def test_load_into_mismatched_model_raises():
    bnn = _trained("vi")
    with pytest.raises(ValueError, match="method 'vi'.*method 'map'"):
        bw.wrap(_mlp(), "map", num_data=32).load_state_dict(bnn.state_dict())
    with pytest.raises(RuntimeError, match="size mismatch"):
        bw.wrap(_mlp(out=5), "vi", num_data=32).load_state_dict(bnn.state_dict())
    with pytest.raises(ValueError, match="Bayesian parameters do not match"):
        bw.wrap(_mlp(), "vi", num_data=32, params=["2.*"]).load_state_dict(bnn.state_dict(), strict=False)


def _backbones():
    torch.manual_seed(0)
    return {
        "timm_resnet": (timm.create_model("resnet18", pretrained=False, num_classes=3), (2, 3, 32, 32)),
        "timm_vit": (timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=32),
                     (2, 3, 32, 32)),
        "tv_resnet": (torchvision.models.resnet18(num_classes=3), (2, 3, 32, 32)),
    }


@pytest.fixture(scope="module")
def backbones():
    return _backbones()


@pytest.mark.parametrize("name", ["timm_resnet", "timm_vit", "tv_resnet"])
@pytest.mark.parametrize("method", METHODS)
def test_one_step_and_prediction_on_real_backbones(backbones, name, method):
    model, shape = backbones[name]
    x = torch.randn(*shape)
    y = torch.tensor([0, 2])
    bnn = bw.wrap(model, method, num_data=100, **({"burn_in": 0, "thinning": 1} if method == "sgld" else {}))
    opt = (bw.optim.SGLD(bnn.parameters(), lr=1e-4, num_data=100) if method == "sgld"
           else torch.optim.SGD(bnn.parameters(), lr=1e-4, momentum=0.9))
    history = bw.fit(bnn, [(x, y)], epochs=1, optimizer=opt, progress=False)
    assert len(history) == 1 and history[0]["train_loss"] > 0
    probs = bnn.predict(x, num_samples=2)
    assert probs.shape == (2, 3)
    torch.testing.assert_close(probs.sum(1), torch.ones(2), rtol=0, atol=1e-5)
    assert bnn.sample_logits(x, 3).shape == (3, 2, 3)
