"""Ensembles of any method (``"ensemble"``, ``"multiswag"``): training, the mixture predictive, checkpoints.

Known answers: M members trained one after another (copies of the ensemble's
initial members, the same batches and optimizer) give the vmapped ensemble's
parameters and predictions; the mixture predictive equals a naive loop over
members with S split evenly; the mixture's moments are the closed-form ones.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import bayeswrap as bw

pytestmark = pytest.mark.usefixtures("one_thread")

N = 256


def _mlp(bn: bool = False) -> nn.Module:
    # no bias before BatchNorm: its exact gradient is 0, and AdamW would turn round-off there into full steps
    layers = [nn.Linear(64, 32, bias=not bn)] + ([nn.BatchNorm1d(32)] if bn else []) + [nn.ReLU(), nn.Linear(32, 10)]
    return nn.Sequential(*layers)


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data[:N + 100] / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target[:N + 100])
    return x[:N], y[:N], x[N:], y[N:]


def _batches(x, y, epochs: int, batch: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=g)
        out += [(x[perm[i:i + batch]], y[perm[i:i + batch]]) for i in range(0, len(x), batch)]
    return out


def _train(bnn, batches, make_opt):
    opt = make_opt(bnn.param_groups())
    bnn.train()
    for xb, yb in batches:
        opt.zero_grad()
        bnn.loss(xb, yb).loss.backward()
        opt.step()
        bnn.after_step()
    bnn.eval()
    return bnn


OPTIMIZERS = {
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=3e-3),
}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("bn", [False, True], ids=["mlp", "batchnorm"])
def test_vmapped_ensemble_equals_members_trained_one_after_another(digits, opt, bn):
    x, y, xt, _ = digits
    torch.manual_seed(0)
    ens = bw.wrap(_mlp(bn), "ensemble", num_data=N, num_members=4, prior_std=0.5, parallel="vmap")
    references = [copy.deepcopy(m) for m in ens.members]  # the same initial members, trained alone below
    batches = _batches(x, y, epochs=3)
    _train(ens, batches, OPTIMIZERS[opt])
    assert ens._vmap_state == "on"
    for ref in references:
        _train(ref, batches, OPTIMIZERS[opt])
    for member, ref in zip(ens.members, references):
        for (name, a), (_, b) in zip(member.state_dict().items(), ref.state_dict().items()):
            if torch.is_tensor(a) and a.is_floating_point():
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    # the predictive is the equal-weight mixture of the members' (point-estimate) predictives
    expected = torch.stack([ref.predict(xt, num_samples=0) for ref in references]).mean(0)
    torch.testing.assert_close(ens.predict(xt, num_samples=4), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ens.predict(xt, num_samples=0), expected, atol=1e-5, rtol=1e-5)
    # members were initialised differently and stay different
    w = [m.theta["0.weight"] for m in ens.members]
    assert min((w[i] - w[j]).abs().max().item() for i in range(4) for j in range(i)) > 1e-2


def test_vmap_and_sequential_paths_agree_with_fit_and_sgd(digits):
    x, y, xt, yt = digits
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    results = {}
    for parallel in ("vmap", "sequential"):
        torch.manual_seed(0)
        ens = bw.wrap(_mlp(), "ensemble", num_data=N, num_members=3, parallel=parallel)
        loader.generator.manual_seed(1)
        bw.fit(ens, loader, epochs=10, optimizer=torch.optim.SGD(ens.param_groups(), lr=0.1, momentum=0.9))
        results[parallel] = ens.predict(xt, num_samples=3)
    torch.testing.assert_close(results["vmap"], results["sequential"], atol=1e-5, rtol=1e-5)
    assert (results["vmap"].argmax(1) == yt).float().mean() > 0.8


def test_mixture_predictive_splits_draws_evenly_and_matches_a_naive_loop(digits):
    x, y, xt, _ = digits
    torch.manual_seed(0)
    ens = bw.wrap(_mlp(), "ensemble", num_data=N, num_members=3, member="vi", member_kwargs={"init_std": 0.05})
    assert ens.draws_per_member(7) == [3, 2, 2] and ens.draws_per_member(2) == [1, 1, 0]
    ens.eval()
    for s in (7, 2):
        counts = ens.draws_per_member(s)
        gen = torch.Generator().manual_seed(3)
        got = ens.predict(xt, num_samples=s, generator=gen)
        gen = torch.Generator().manual_seed(3)
        naive = torch.zeros_like(got)
        for member, c in zip(ens.members, counts):
            if c:
                naive += member.sample_logits(xt, c, gen).softmax(-1).sum(0)
        torch.testing.assert_close(got, naive / s, atol=1e-6, rtol=1e-6)
        gen = torch.Generator().manual_seed(3)
        assert ens.sample_logits(xt, s, gen).shape == (s, len(xt), 10)
        draws = ens.sample(s, torch.Generator().manual_seed(0))
        assert draws["0.weight"].shape == (s, 32, 64)
    torch.testing.assert_close(got.sum(1), torch.ones(len(xt)))


def test_mixture_moments_closed_form_and_gaussian_predictive():
    torch.manual_seed(0)
    ens = bw.wrap(nn.Linear(3, 2), "ensemble", num_data=10, num_members=3, member="vi", likelihood="gaussian",
                  noise_std=0.5)
    means = torch.stack([m.posterior_mean()["weight"] for m in ens.members])
    stds = torch.stack([m.posterior_std()["weight"] for m in ens.members])
    torch.testing.assert_close(ens.posterior_mean()["weight"], means.mean(0))
    var = (stds.pow(2) + means.pow(2)).mean(0) - means.mean(0).pow(2)
    torch.testing.assert_close(ens.posterior_std()["weight"], var.sqrt())
    x = torch.randn(5, 3)
    mean, var = ens.predict(x, num_samples=0)
    outs = torch.stack([m.predict(x, num_samples=0)[0] for m in ens.members])
    torch.testing.assert_close(mean, outs.mean(0))
    torch.testing.assert_close(var, 0.25 + outs.var(0, unbiased=False), atol=1e-6, rtol=1e-6)


def test_pretrained_body_with_reinitialised_head():
    torch.manual_seed(0)
    model = _mlp()
    ens = bw.wrap(model, "ensemble", num_data=N, num_members=3, reinit=["2"], init_seed=7)
    for member in ens.members:
        torch.testing.assert_close(member.theta["0.weight"], model[0].weight.detach())  # pretrained body
        torch.testing.assert_close(member.prior.mean["0.weight"], model[0].weight.detach())  # its prior mean
    heads = [m.theta["2.weight"] for m in ens.members]
    assert (heads[0] - heads[1]).abs().max() > 1e-2 and (heads[0] - model[2].weight).abs().max() > 1e-2
    again = bw.wrap(model, "ensemble", num_data=N, num_members=3, reinit=["2"], init_seed=7)
    torch.testing.assert_close(again.members[2].theta["2.weight"], heads[2])  # init_seed + m: reproducible
    torch.manual_seed(1)
    drawn = bw.wrap(model, "ensemble", num_data=N, num_members=2, reinit=["2"])
    torch.manual_seed(1)
    redrawn = bw.wrap(model, "ensemble", num_data=N, num_members=2, reinit=["2"])
    assert drawn.init_seed == redrawn.init_seed  # init_seed=None follows torch.manual_seed
    assert model[2].weight.requires_grad and not any(p.is_meta for p in model.parameters())  # user's model untouched


def test_checkpoint_round_trip_and_resume_equality(digits):
    x, y, xt, _ = digits
    batches = _batches(x, y, epochs=2)

    def build():
        torch.manual_seed(0)
        return bw.wrap(_mlp(), "ensemble", num_data=N, num_members=3, member="sgld", member_kwargs={"burn_in": 4})

    full = build()
    opt = bw.optim.SGLD(full.param_groups(), lr=0.05, num_data=N)
    torch.manual_seed(5)
    for xb, yb in batches:
        opt.zero_grad()
        full.loss(xb, yb).loss.backward()
        opt.step()
        full.after_step()

    half = build()
    opt = bw.optim.SGLD(half.param_groups(), lr=0.05, num_data=N)
    torch.manual_seed(5)
    for xb, yb in batches[:len(batches) // 2]:
        opt.zero_grad()
        half.loss(xb, yb).loss.backward()
        opt.step()
        half.after_step()
    buf = io.BytesIO()
    torch.save({"bnn": half.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = build()
    resumed.load_state_dict(ckpt["bnn"])
    opt = bw.optim.SGLD(resumed.param_groups(), lr=0.05, num_data=N)
    opt.load_state_dict(ckpt["opt"])
    torch.set_rng_state(ckpt["rng"])
    for xb, yb in batches[len(batches) // 2:]:
        opt.zero_grad()
        resumed.loss(xb, yb).loss.backward()
        opt.step()
        resumed.after_step()
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        if torch.is_tensor(a):
            torch.testing.assert_close(a, b, msg=k)
    full.eval()
    resumed.eval()
    torch.testing.assert_close(full.predict(xt, 6), resumed.predict(xt, 6))
    other = bw.wrap(_mlp(), "ensemble", num_data=N, num_members=2, member="sgld")
    with pytest.raises((ValueError, RuntimeError), match="members|size mismatch|Missing|Unexpected"):
        other.load_state_dict(full.state_dict())


def test_members_that_cannot_be_vmapped_fall_back_with_a_warning(digits):
    x, y, _, _ = digits
    ens = bw.wrap(_mlp(), "ensemble", num_data=N, num_members=2, member="ivon")  # IVON's foreach ops: no vmap rule
    with pytest.warns(RuntimeWarning, match="one after another"):
        out = ens.loss(x[:8], y[:8])
    assert ens._vmap_state == "off" and torch.isfinite(out.loss)
    strict = bw.wrap(_mlp(), "ensemble", num_data=N, num_members=2, member="ivon", parallel="vmap")
    with pytest.raises(ValueError, match="parallel='vmap'"):
        strict.loss(x[:8], y[:8])


def test_bad_labels_are_the_members_error_not_a_fallback(digits):
    x, y, _, _ = digits
    ens = bw.wrap(_mlp(), "ensemble", num_data=N, num_members=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="class label 10 is out of range"):
            ens.loss(x[:4], torch.tensor([0, 1, 2, 10]))


@pytest.mark.parametrize("kwargs, match", [
    ({"num_members": 0}, "num_members"),
    ({"member": "hmc"}, "member='hmc'"),
    ({"member": "ensemble"}, "member='ensemble'"),
    ({"member": "vi", "member_kwargs": {"p_drop": 0.1}}, "p_drop"),
    ({"reinit": "head"}, "reinit pattern 'head' matches no trainable parameter .*did you mean '\\*head\\*'"),
    ({"reinit": 3}, "reinit=3 is not accepted; accepted: 'bayesian'"),
    ({"reinit": []}, r"reinit=\[\] is not accepted"),
    ({"reinit": ["nothing*"]}, "reinit pattern .nothing\\*. matches no trainable parameter"),
    ({"parallel": "threads"}, "parallel='threads'"),
    ({"init_seed": -1}, "init_seed"),
])
def test_bad_options_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.wrap(_mlp(), "ensemble", num_data=N, **kwargs)
