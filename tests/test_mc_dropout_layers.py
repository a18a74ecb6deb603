"""Standard MC dropout, ``bw.wrap(model, "mc_dropout", mode="layers")`` (Gal & Ghahramani 2016).

Oracles: a naive loop over the user's own network with only its dropout modules in
train mode (the same masks from the same seed), the closed-form mean and variance of
the logits of a network whose last layer follows the dropout, MAP's loss (training
is MAP with the model's dropout active), and MAP and the dropout-off network on
rotated digits.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayeswrap as bw
from bayeswrap.app.config import RunConfig
from bayeswrap.app.options import coerce_option
from bayeswrap.data.shift import rotate
from bayeswrap.methods.mc_dropout import DROPOUT_LAYERS

pytestmark = pytest.mark.usefixtures("one_thread")


def _net(p: float = 0.3, seed: int = 0) -> nn.Module:
    """Linear → BatchNorm (non-trivial running statistics) → ReLU → Dropout(p) → Linear, in train mode."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 3))
    net[1].running_mean.uniform_(-0.5, 0.5)
    net[1].running_var.uniform_(0.5, 2.0)
    return net


def _reference(model: nn.Module) -> nn.Module:
    """A copy of the user's network in eval mode with only its dropout modules in train mode."""
    ref = copy.deepcopy(model).eval()
    for m in ref.modules():
        if isinstance(m, DROPOUT_LAYERS):
            m.train()
    return ref


def _logit_moments(model: nn.Module, x: torch.Tensor, p: float):
    """Closed form of the logits f = W₂ (z ⊙ h / (1 − p)) + b₂, z ~ Bernoulli(1 − p): E f = W₂ h + b₂ and
    Var f_k = Σ_j W₂[k, j]² h_j² p / (1 − p), with h the (eval-mode BatchNorm) activations before the dropout.
    """
    with torch.no_grad():
        h = model[2](model[1].eval()(model[0](x)))
        w, b = model[4].weight, model[4].bias
        return h @ w.T + b, (h.square() @ w.square().T) * p / (1 - p)


def test_samples_equal_a_naive_loop_with_the_same_seed():
    model = _net(0.3)
    x = torch.randn(6, 4)
    bnn = bw.wrap(model, "mc_dropout", num_data=10, mode="layers", chunk_size=1).eval()
    outs = bnn.sample_logits(x, 5, generator=torch.Generator().manual_seed(3))
    # the documented seeding: the global RNG is seeded from the generator's first 62-bit draw
    seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(3)))
    ref = _reference(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        expected = torch.stack([ref(x) for _ in range(5)])
    torch.testing.assert_close(outs, expected, rtol=0, atol=1e-6)
    probs = bnn.predict(x, 5, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(probs, expected.softmax(-1).mean(0), rtol=0, atol=1e-6)
    # the user's model and bayeswrap's copy are left in their modes; the global RNG is not advanced
    assert model.training and all(m.training for m in model.modules())
    assert not any(m.training for m in bnn.model.modules())
    state = torch.get_rng_state()
    bnn.predict(x, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("layer_p", [None, 0.5])
def test_vmapped_masks_are_independent_and_match_the_closed_form_moments(layer_p):
    model, x = _net(0.2), torch.randn(8, 4)
    bnn = bw.wrap(model, "mc_dropout", num_data=10, mode="layers", layer_p=layer_p, chunk_size=500).eval()
    p = 0.2 if layer_p is None else layer_p
    assert bnn.model[3].p == p and model[3].p == 0.2  # layer_p is set on bayeswrap's copy only
    num = 4000
    with torch.no_grad():
        outs = bnn.sample_logits(x, num, generator=torch.Generator().manual_seed(0))  # 8 vmapped chunks of 500
    assert torch.unique(outs.flatten(1), dim=0).shape[0] == num  # a mask per sample
    mean, var = _logit_moments(model, x, p)
    z = (outs.mean(0) - mean) / (var / num).sqrt()
    assert z.abs().max() < 4.5, z  # 24 logits, each within 4.5 Monte Carlo standard errors
    torch.testing.assert_close(outs.var(0), var, rtol=0.15, atol=0)
    # independent masks across samples: consecutive samples (mostly in one vmapped chunk) are uncorrelated
    centred = (outs - mean) / var.sqrt()
    corr = (centred[1:] * centred[:-1]).mean(0)
    assert corr.abs().max() < 4.5 / num**0.5, corr
    # dropout off: the deterministic path is the network at the weights, in eval mode
    torch.testing.assert_close(bnn.predict(x, 0), mean.softmax(-1), rtol=0, atol=1e-6)


def test_training_is_map_with_the_models_dropout_active():
    model = _net(0.3)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    outs = {}
    for method, kw in (("map", {}), ("mc_dropout", {"mode": "layers", "bias": "gaussian"})):
        bnn = bw.wrap(model, method, num_data=100, prior_std=0.3, prior_mean="zero", **kw).train()
        torch.manual_seed(5)
        out = bnn.loss(x, y)
        out.loss.backward()
        outs[method] = (out, [p.grad.clone() for p in bnn.parameters()], bnn)
    (a, ga, _), (b, gb, bnn) = outs["map"], outs["mc_dropout"]
    assert a.loss.item() == b.loss.item() and a.kl.item() == b.kl.item()
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))
    torch.manual_seed(5)
    assert not torch.equal(bnn.loss(x, y).logits, bnn.loss(x, y).logits)  # the dropout was active
    assert all(torch.equal(m, t) for m, t in zip(bnn.posterior_mean().values(), bnn.theta.values()))
    assert all(not s.any() for s in bnn.posterior_std().values())
    assert all(torch.equal(s[i], bnn.theta[n]) for n, s in bnn.sample(3).items() for i in range(3))


@pytest.mark.parametrize("model, match", [
    (nn.Sequential(nn.Linear(4, 3)), r"mode='layers'.*Sequential has none; accepted: a model with nn.Dropout, "
                                     r"nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, "
                                     r"nn.FeatureAlphaDropout modules, or mode='params'"),
    (nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.0)), r"every dropout module of the model has p=0 \(\['1'\]\).*"
                                                      r"accepted: layer_p in \(0, 1\)"),
])
def test_models_without_active_dropout_are_refused(model, match):
    with pytest.raises(ValueError, match=match):
        bw.wrap(model, "mc_dropout", num_data=10, mode="layers")


def test_layer_p_activates_zero_rate_dropout_and_other_modules_are_kept():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Dropout2d(0.0), nn.Flatten(), nn.AlphaDropout(0.0), nn.Linear(8, 3))
    bnn = bw.wrap(model, "mc_dropout", num_data=10, mode="layers", layer_p=0.4).eval()
    assert bnn.dropout_layers == ["1", "3"] and [bnn.model[1].p, bnn.model[3].p] == [0.4, 0.4]
    assert model[1].p == 0.0 and model[3].p == 0.0
    outs = bnn.sample_logits(torch.randn(2, 1, 4, 4), 6)
    assert torch.unique(outs.flatten(1), dim=0).shape[0] == 6


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "layer"}, r"mode='layer' is not known; accepted: 'params' .* or 'layers'"),
    ({"mode": None}, r"mode=None is not known; accepted: 'params'"),
    ({"mode": "layers", "layer_p": 0.0}, r"layer_p=0.0? must be None or a number in \(0, 1\)"),
    ({"mode": "layers", "layer_p": 1.0}, r"layer_p=1.0? must be None or a number in \(0, 1\)"),
    ({"mode": "layers", "layer_p": float("nan")}, r"layer_p=nan must be None or a number in \(0, 1\)"),
    ({"mode": "layers", "layer_p": "0.2"}, r"layer_p='0.2'"),
    ({"layer_p": 0.2}, r"layer_p=0.2 is only used with mode='layers'; accepted: layer_p=None with mode='params'"),
])
def test_bad_mode_and_layer_p_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.wrap(_net(), "mc_dropout", num_data=10, **kwargs)


def test_state_dict_round_trips_the_mode():
    x = torch.randn(5, 4)
    bnn = bw.wrap(_net(0.3, seed=1), "mc_dropout", num_data=10, mode="layers", layer_p=0.25).eval()
    with torch.no_grad():
        bnn.theta["4.weight"].add_(0.5)
    fresh = bw.wrap(_net(0.3, seed=2), "mc_dropout", num_data=10, mode="layers", layer_p=0.25).eval()
    fresh.load_state_dict(bnn.state_dict())
    expected = bnn.sample_logits(x, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fresh.sample_logits(x, 4, generator=torch.Generator().manual_seed(0)), expected)
    with pytest.raises(ValueError, match=r"checkpoint is for mode='layers', layer_p=0.25, but this model has "
                                         r"mode='params', layer_p=None"):
        bw.wrap(_net(), "mc_dropout", num_data=10).load_state_dict(bnn.state_dict())
    with pytest.raises(ValueError, match=r"layer_p=0.25, but this model has mode='layers', layer_p=None"):
        bw.wrap(_net(), "mc_dropout", num_data=10, mode="layers").load_state_dict(bnn.state_dict())


def test_run_config_accepts_the_options():
    cfg = RunConfig(method="mc_dropout", method_options={"mode": coerce_option("mode", "layers"),
                                                         "layer_p": coerce_option("layer_p", "0.3")})
    assert cfg.validate().method_options == {"mode": "layers", "layer_p": 0.3}
    with pytest.raises(ValueError, match="mode='layer' is not known"):
        RunConfig(method="mc_dropout", method_options={"mode": "layer"}).validate()
    with pytest.raises(ValueError, match="layer_p=0.3 is only used with mode='layers'"):
        RunConfig(method="mc_dropout", method_options={"layer_p": 0.3}).validate()


@functools.cache
def _digits():
    """512 training and 300 test digits (pixels in [0, 1]); the test digits also rotated by 30 and 60 degrees."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    test = x[-300:]
    rotated = {a: rotate(test.view(-1, 1, 8, 8), a).reshape(-1, 64) for a in (30, 60)}
    return x[:512], y[:512], test, y[-300:], rotated


def _fit_digits(method: str, p: float, **kwargs) -> bw.BayesianModel:
    xtr, ytr, *_ = _digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(p), nn.Linear(64, 10))
    bnn = bw.wrap(model, method, num_data=512, prior_std=10.0, **kwargs)
    batches = [(xtr[i:i + 64], ytr[i:i + 64]) for i in range(0, 512, 64)]
    bw.fit(bnn, batches, epochs=15, optimizer=torch.optim.SGD(bnn.param_groups(), lr=0.1, momentum=0.9),
           progress=False)
    return bnn.eval()


def test_mc_dropout_on_digits_beats_the_dropout_off_network_and_map_under_rotation():
    _, _, x_test, y_test, rotated = _digits()
    mc = _fit_digits("mc_dropout", 0.5, mode="layers")
    plain = _fit_digits("map", 0.0)

    def nll(probs):
        return F.nll_loss(probs.clamp_min(1e-12).log(), y_test).item()

    generator = torch.Generator().manual_seed(0)
    clean = mc.predict(x_test, 32, generator=generator)
    assert (clean.argmax(-1) == y_test).float().mean() > 0.9
    for angle, x in rotated.items():
        sampled, dropout_off, map_nll = nll(mc.predict(x, 32, generator=generator)), nll(mc.predict(x, 0)), \
            nll(plain.predict(x, 0))
        # 4 seeds: 30°: 1.49-1.68 against 1.62-1.95 (dropout off) and 1.96-2.16 (MAP); 60°: 3.6-3.9, 4.9-5.4, 6.1-6.4
        assert sampled < dropout_off < map_nll, (angle, sampled, dropout_off, map_nll)


def test_cli_mode_layers_samples_the_backbones_dropout(tmp_path):
    """--dropout gives the CLI's backbone dropout layers, which mc_dropout --mode layers samples."""
    import json

    from bayeswrap.app import cli
    from bayeswrap.app.runs import load_run

    args = ["fit", "--method", "mc_dropout", "--mode", "layers", "--dropout", "0.3", "--epochs", "2",
            "--num-samples", "4", "--shift-rotations", "0", "--shift-noise", "0", "--ood-classes", "",
            "--out-dir", str(tmp_path), "--run-name", "layers"]
    assert cli.main(args) == 0
    run = load_run(tmp_path / "layers")
    drops = [m for m in run.model.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == pytest.approx(0.3) for m in drops)
    assert run.model.mode == "layers" and run.config.dropout == pytest.approx(0.3)
    final = json.loads((tmp_path / "layers" / "metrics.json").read_text())["final"]["4"]
    assert final["T1"]["error"] <= 0.3  # two epochs on digits with dropout 0.3
    assert cli.main([*args[:6], "0", *args[7:], "--run-name", "none"]) == 2  # --dropout 0: no layer to sample
