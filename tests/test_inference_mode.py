"""Every prediction path of every method under ``torch.inference_mode()`` (Lightning's default for predict/validate).

Oracle: the same call under ``torch.no_grad()`` with the same generator state.
Before the fix Laplace raised "Inference tensors do not track version counter"
(diagonal curvature and GLM predictive) or, worse, silently returned other
numbers (Kronecker: the backward found no graph and gave zero gradients).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.functional import outside_inference_mode

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

N, BATCH = 96, 32
#: options that fit the tiny budget (6 optimizer steps); every method of the registry gets a case below
OPTIONS = {"sgld": {"burn_in": 2, "thinning": 1}, "swag": {"swa_start": 0, "collect_every": 1},
           "ensemble": {"num_members": 2}, "multiswag": {"num_members": 2}}
VARIANTS = [("vi", {"local_reparam": True}), ("sgld", {"burn_in": 2, "thinning": 1, "predictive": "gaussian"}),
            ("lbbnn", {"flow_length": 1, "flow_hidden": (8,)}), ("laplace", {"pred_type": "nn"}),
            ("ensemble", {"num_members": 2, "member": "laplace"}),
            *[("laplace", {"hessian_structure": h, "subset_of_weights": s, "link_approx": link})
              for h in ("diag", "kron", "full") for s in ("all", "last_layer") for link in ("probit", "mc")]]
CASES = [(m, OPTIONS.get(m, {})) for m in bw.METHODS] + VARIANTS


@functools.cache
def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x[:N], dtype=torch.float32) / 16.0, torch.tensor(y[:N])


def _loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_digits()), batch_size=BATCH)


def _optimizer(bnn):
    if bnn.required_optimizer is bw.optim.SGLD:
        return bw.optim.SGLD(bnn.param_groups(), lr=0.1, num_data=N)
    if bnn.required_optimizer is bw.optim.IVON:
        return bw.optim.IVON(bnn.param_groups(), lr=0.1, beta2=0.999)
    return torch.optim.SGD(bnn.param_groups(), lr=0.1, momentum=0.9)


def _trained(method: str, options: dict):
    """(bnn finalised normally, a copy of it from before ``after_fit`` or None for the samplers)."""
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10)), method, num_data=N, **options)
    if bnn.not_trained_by_fit():
        x, y = _digits()
        bnn.run_chains(x, y, num_samples=8, num_warmup=8, num_chains=2, generator=torch.Generator().manual_seed(0))
        return bnn.eval(), None
    bw.fit(bnn, _loader(), epochs=2, optimizer=_optimizer(bnn), progress=False, finalize=False)
    pending = copy.deepcopy(bnn)
    bnn.after_fit(_loader())
    return bnn.eval(), pending


def _gen():
    return torch.Generator().manual_seed(1)


@pytest.mark.parametrize("method,options", CASES, ids=[f"{m}-{'-'.join(map(str, o.values()))}" for m, o in CASES])
def test_predictions_under_inference_mode_equal_no_grad(method, options):
    bnn, pending = _trained(method, options)
    x, _ = _digits()
    for s in (0, 3):
        ref = bnn.predict(x, num_samples=s, generator=_gen())
        ref_loader = bw.predict_loader(bnn, _loader(), s, generator=_gen())[0]
        ref_samples = bw.sample_probs_loader(bnn, _loader(), s, generator=_gen())[0]
        ref_scores = bw.evaluate(bnn, _loader(), s, generator=_gen())
        with torch.inference_mode():
            got = bnn.predict(x, num_samples=s, generator=_gen())
            got_loader = bw.predict_loader(bnn, _loader(), s, generator=_gen())[0]
            got_samples = bw.sample_probs_loader(bnn, _loader(), s, generator=_gen())[0]
            got_scores = bw.evaluate(bnn, _loader(), s, generator=_gen())
        assert torch.equal(got, ref), (s, (got - ref).abs().max())
        assert torch.equal(got_loader, ref_loader) and torch.equal(got_samples, ref_samples)
        assert got_scores == ref_scores
        assert torch.allclose(ref.sum(1), torch.ones(len(x)), atol=1e-5)
    if pending is None:
        return
    # after_fit (Laplace's curvature, SWAG's BatchNorm pass, ...) called inside inference mode: the same posterior
    with torch.inference_mode():
        pending.after_fit(_loader())
    assert not any(t.is_inference() for t in pending.state_dict().values() if isinstance(t, torch.Tensor))
    torch.testing.assert_close(pending.predict(x, num_samples=3, generator=_gen()),
                               bnn.predict(x, num_samples=3, generator=_gen()), rtol=1e-6, atol=1e-7)
    # and the model trains on afterwards (no inference tensor was left in its state)
    bw.fit(pending, _loader(), epochs=1, optimizer=_optimizer(pending), progress=False)


def test_laplace_regression_glm_under_inference_mode():
    """The Gaussian GLM predictive (mean, variance): the variance is the closed form J diag(v) Jᵀ + σ², not σ² alone."""
    torch.manual_seed(0)
    x = torch.randn(40, 3)
    y = x[:, :1].sin()
    bnn = bw.wrap(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)), "laplace", num_data=40,
                  likelihood="gaussian", noise_std=0.3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    bw.fit(bnn, loader, epochs=2, optimizer=torch.optim.AdamW(bnn.parameters(), lr=1e-2), progress=False)
    with torch.inference_mode():
        mean, var = bnn.predict(x, num_samples=1)
    jac = torch.func.jacrev(lambda th: bnn.forward_with(th, x))(bnn.posterior_mean())  # naive full Jacobian
    v = bnn.posterior_std()
    expected = sum((jac[n].flatten(2) ** 2 * v[n].flatten() ** 2).sum(-1) for n in v) + 0.3**2
    torch.testing.assert_close(var, expected, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(mean, bnn.forward_with(bnn.posterior_mean(), x))


def test_outside_inference_mode_differentiates():
    """d/dx Σ x³ = 3x², computed inside inference mode on an inference tensor; outside it, the function runs as is."""
    @outside_inference_mode
    def grad_of_cube(x):
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            return torch.autograd.grad(x.pow(3).sum(), x)[0], torch.is_inference_mode_enabled()

    x = torch.linspace(-2, 2, 5)
    with torch.inference_mode():
        xi = x.clone()
        g, inside = grad_of_cube(xi)
        assert xi.is_inference() and torch.is_inference_mode_enabled()
    assert not inside
    torch.testing.assert_close(g, 3 * x**2)
    assert grad_of_cube(x)[1] is False


def test_sgld_message_names_after_step_not_training_length():
    torch.manual_seed(0)
    x, y = _digits()
    bnn = bw.wrap(nn.Sequential(nn.Linear(64, 10)), "sgld", num_data=N, burn_in=4, thinning=1)
    optimizer = bw.optim.SGLD(bnn.param_groups(), lr=0.1, num_data=N)
    for _ in range(3):  # a hand-written loop (or a LightningModule) that never calls after_step
        optimizer.zero_grad()
        bnn.loss(x, y).loss.backward()
        optimizer.step()
    with torch.inference_mode(), pytest.raises(bw.NotFittedError, match=r"0 steps taken.*after_step\(\).*never called"):
        bnn.predict(x)
    for _ in range(3):
        bnn.after_step()
    with pytest.raises(bw.NotFittedError, match=r"3 steps taken, burn_in=4.*train for more steps") as err:
        bnn.predict(x)
    assert "after_step" not in str(err.value)
    bnn.after_step()
    bnn.after_step()
    with torch.inference_mode():
        assert bnn.predict(x, num_samples=0).shape == (N, 10)
