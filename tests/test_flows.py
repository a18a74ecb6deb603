"""Tests of bayeswrap.methods.lbbnn.flows: MADE masks, IAF log-determinants, q(z) and the auxiliary model r(z | W)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bayeswrap.methods.lbbnn.flows import GATE_BIAS_INIT, IAF, MADE, IAFStep, MultiplicativeFlow

HIDDEN = (8, 8)
LOG_2PI = math.log(2 * math.pi)


def _perturb(module: torch.nn.Module, scale: float = 0.5) -> None:
    """Adds N(0, scale²) noise to every parameter, so that Jacobians are far from the initial near-identity."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))


def _log_abs_det_jac(fn, z: torch.Tensor) -> torch.Tensor:
    return torch.log(torch.abs(torch.linalg.det(torch.func.jacrev(fn)(z))))


# ----------------------------------------------------------------------------------------------- MADE

@pytest.mark.parametrize("dim,hidden,seed", [(6, HIDDEN, 0), (7, HIDDEN, 3), (5, (), 1), (5, (8, 8, 8), 2)])
def test_made_autoregressive(dim, hidden, seed):
    torch.manual_seed(seed)
    made = MADE(dim, hidden, out_multiplier=2, seed=seed).double()
    _perturb(made)
    z = torch.randn(dim, dtype=torch.float64)
    jac = torch.func.jacrev(made)(z)                       # (2·dim, dim)
    assert jac.shape == (2 * dim, dim)
    strictly_lower = torch.tril(torch.ones(dim, dim, dtype=torch.bool), diagonal=-1)
    for half in (jac[:dim], jac[dim:]):
        assert torch.all(half[~strictly_lower] == 0), half
    # not vacuous: some outputs do depend on earlier inputs
    assert jac[:, :][torch.cat([strictly_lower, strictly_lower])].abs().max() > 0


def test_made_masks_deterministic_and_batched():
    a, b, c = MADE(6, HIDDEN, seed=5), MADE(6, HIDDEN, seed=5), MADE(6, HIDDEN, seed=6)
    masks = lambda m: [layer.mask for layer in m.layers]   # noqa: E731
    assert all(torch.equal(x, y) for x, y in zip(masks(a), masks(b)))
    assert not all(torch.equal(x, y) for x, y in zip(masks(a), masks(c)))
    assert "layers.0.mask" in dict(a.named_buffers())
    z = torch.randn(3, 4, 6)
    out = a(z)
    assert out.shape == (3, 4, 12)
    torch.testing.assert_close(out[1, 2], a(z[1, 2]))
    assert MADE(6, HIDDEN, out_multiplier=3)(z).shape == (3, 4, 18)


def test_made_dim_one_is_constant():
    made = MADE(1, HIDDEN)
    _perturb(made)
    out1, out2 = made(torch.tensor([0.3])), made(torch.tensor([-2.0]))
    torch.testing.assert_close(out1, out2)


@pytest.mark.parametrize("kwargs", [dict(dim=0), dict(dim=3, hidden_sizes=8), dict(dim=3, hidden_sizes=(8, 0)),
                                    dict(dim=3, out_multiplier=0), dict(dim=3, seed=-1)])
def test_made_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        MADE(**kwargs)


# ------------------------------------------------------------------------------------------------ IAF

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_iaf_step_log_det_matches_jacobian(seed):
    torch.manual_seed(seed)
    dim = 6
    step = IAFStep(dim, HIDDEN, seed=seed).double()
    _perturb(step)
    z = torch.randn(dim, dtype=torch.float64)
    z_new, log_det = step(z)
    assert z_new.shape == (dim,) and log_det.shape == ()
    expected = _log_abs_det_jac(lambda x: step(x)[0], z)
    torch.testing.assert_close(log_det, expected, atol=1e-5, rtol=0)


def test_iaf_step_batched():
    torch.manual_seed(0)
    step = IAFStep(5, HIDDEN).double()
    _perturb(step)
    z = torch.randn(4, 3, 5, dtype=torch.float64)
    z_new, log_det = step(z)
    assert z_new.shape == (4, 3, 5) and log_det.shape == (4, 3)
    z1, ld1 = step(z[2, 1])
    torch.testing.assert_close(z_new[2, 1], z1)
    torch.testing.assert_close(log_det[2, 1], ld1)


def test_iaf_step_initialisation_near_identity():
    torch.manual_seed(0)
    dim = 7
    step = IAFStep(dim, HIDDEN)
    z = torch.randn(dim)
    z_new, log_det = step(z)
    gate = torch.sigmoid(torch.tensor(GATE_BIAS_INIT))
    assert abs(log_det.item() / dim - F.logsigmoid(torch.tensor(GATE_BIAS_INIT)).item()) < 0.05
    torch.testing.assert_close(z_new, gate * z, atol=0.05, rtol=0)


@pytest.mark.parametrize("flow_length", [1, 2, 3])
def test_iaf_log_det_matches_jacobian(flow_length):
    torch.manual_seed(10 + flow_length)
    dim = 6
    flow = IAF(dim, flow_length, HIDDEN, seed=4).double()
    _perturb(flow)
    for _ in range(3):
        z = torch.randn(dim, dtype=torch.float64)
        z_k, log_det = flow(z)
        assert z_k.shape == (dim,)
        expected = _log_abs_det_jac(lambda x: flow(x)[0], z)
        torch.testing.assert_close(log_det, expected, atol=1e-5, rtol=0)
        step_sum = 0.0
        x = z
        for k, step in enumerate(flow.steps):      # the documented composition, reversal included
            x = x.flip(-1) if k > 0 else x
            x, ld = step(x)
            step_sum = step_sum + ld
        x = x.flip(-1) if (flow_length - 1) % 2 == 1 else x
        torch.testing.assert_close(z_k, x)
        torch.testing.assert_close(log_det, step_sum)


def test_iaf_mixes_all_dimensions():
    """With the reversal, two steps make every output depend on every input."""
    torch.manual_seed(0)
    flow = IAF(5, 2, (16, 16), seed=0).double()
    _perturb(flow)
    jac = torch.func.jacrev(lambda x: flow(x)[0])(torch.randn(5, dtype=torch.float64))
    assert (jac.abs() > 0).sum() > 5 * 5 // 2 + 5    # more than a triangle


def test_iaf_steps_have_distinct_masks():
    flow = IAF(6, 2, HIDDEN, seed=0)
    m0 = [layer.mask for layer in flow.steps[0].made.layers]
    m1 = [layer.mask for layer in flow.steps[1].made.layers]
    assert not all(torch.equal(a, b) for a, b in zip(m0, m1))


def test_iaf_length_zero_is_identity():
    flow = IAF(5, 0, HIDDEN)
    assert len(list(flow.parameters())) == 0
    z = torch.randn(3, 5, dtype=torch.float64)
    z_k, log_det = flow(z)
    assert torch.equal(z_k, z)
    assert log_det.shape == (3,) and log_det.dtype == torch.float64 and torch.all(log_det == 0)


@pytest.mark.parametrize("bad", [-1, -3, 1.5, "2", True])
def test_iaf_bad_flow_length(bad):
    with pytest.raises(ValueError, match="flow_length=" + repr(bad).replace(".", r"\.")):
        IAF(5, bad, HIDDEN)
    with pytest.raises(ValueError, match="flow_length"):
        MultiplicativeFlow(5, bad, HIDDEN)


def test_iaf_integral_float_flow_length_accepted():
    assert len(IAF(5, 2.0, HIDDEN).steps) == 2


# ------------------------------------------------------------------------------------- q(z): sample

@pytest.mark.parametrize("flow_length", [0, 1, 2])
def test_sample_log_q_matches_independent_computation(flow_length):
    torch.manual_seed(0)
    dim = 5
    mf = MultiplicativeFlow(dim, flow_length, HIDDEN, init_log_var=-1.0).double()
    _perturb(mf)
    torch.manual_seed(123)
    z_k, log_q = mf.sample()
    assert z_k.shape == (dim,) and log_q.shape == ()
    torch.manual_seed(123)
    eps = torch.randn(dim, dtype=torch.float64)
    with torch.no_grad():
        std0 = torch.exp(0.5 * mf.log_var0)
        z0 = mf.mu0 + std0 * eps
        log_q0 = torch.distributions.Normal(mf.mu0, std0).log_prob(z0).sum()
        log_det = _log_abs_det_jac(lambda x: mf.q_flow(x)[0], z0) if flow_length else torch.zeros(())
        torch.testing.assert_close(z_k.detach(), mf.q_flow(z0)[0])
    torch.testing.assert_close(log_q.detach(), log_q0 - log_det, atol=1e-6, rtol=0)


def test_sample_monte_carlo_moments_flow_length_zero():
    torch.manual_seed(0)
    dim, n = 5, 20000
    mf = MultiplicativeFlow(dim, 0, HIDDEN).double()
    with torch.no_grad():
        mf.mu0.copy_(torch.tensor([1.0, -0.5, 0.0, 2.0, 0.3]))
        mf.log_var0.copy_(torch.tensor([-2.0, 0.0, 0.5, -1.0, 1.0]))
        samples = torch.stack([mf.sample()[0] for _ in range(n)])
        var = mf.log_var0.exp()
    mean_se = (var / n).sqrt()
    assert torch.all((samples.mean(0) - mf.mu0.detach()).abs() < 4 * mean_se)
    var_se = var * math.sqrt(2 / (n - 1))
    assert torch.all((samples.var(0) - var).abs() < 4 * var_se)


def test_sample_gradients_and_initialisation():
    torch.manual_seed(0)
    mf = MultiplicativeFlow(5, 2, HIDDEN, init_mean=1.0, init_log_var=-9.0)
    assert torch.all(mf.mu0 == 1.0) and torch.all(mf.log_var0 == -9.0)
    z, log_q = mf.sample()
    (z.sum() + log_q).backward()
    for name, p in [("mu0", mf.mu0), ("log_var0", mf.log_var0)] + [
            (n, p) for n, p in mf.q_flow.named_parameters()]:
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    for p in list(mf.r_flow.parameters()) + [mf.c, mf.b1, mf.b2]:
        assert p.grad is None
    # start at the base mean (issue 32): q's shift bias is init_mean, so z_K ≈ mu0 = 1, not sigmoid(2)^K ≈ 0.78
    torch.testing.assert_close(z.detach(), torch.ones(5), atol=0.05, rtol=0)  # z_0 has std e^(−4.5) ≈ 0.011


@pytest.mark.parametrize("shift_init", [1.0, -0.75, 0.0])  # exact in float32 (the flow is built in it)
def test_iaf_with_zero_output_weights_maps_the_constant_shift_init_to_itself(shift_init):
    """z' = g z + (1 − g) shift with shift ≡ shift_init: the constant vector shift_init is a fixed point of
    every step for any gate, so the whole IAF (reversals included) maps it to itself to float tolerance.
    """
    torch.manual_seed(0)
    flow = IAF(6, 3, HIDDEN, seed=2, shift_init=shift_init).double()
    with torch.no_grad():
        for step in flow.steps:
            step.made.layers[-1].weight[:6].zero_()  # the shift outputs' weights; the gates keep theirs
    z = torch.full((6,), shift_init, dtype=torch.float64)
    z_k, log_det = flow(z)
    torch.testing.assert_close(z_k, z, atol=1e-15, rtol=0)
    assert log_det < 0  # the gates (≈ sigmoid(2)) still contract deviations from it
    torch.testing.assert_close(flow.steps[0].made.layers[-1].bias[:6], z)


def test_multiplicative_flow_starts_at_its_base_mean():
    """q_flow(mu0) ≈ mu0 at the start (the small N(0, 0.01²) output weights move it by < 0.01); r's IAF keeps
    a zero shift bias.
    """
    torch.manual_seed(0)
    for init_mean in (1.0, 0.5):
        mf = MultiplicativeFlow(600, 2, (250, 250), init_mean=init_mean)
        z_bar = mf.q_flow(mf.mu0)[0].detach()
        assert (z_bar - init_mean).abs().max() < 0.01 and abs(z_bar.mean() - init_mean) < 1e-3
        for step in mf.q_flow.steps:
            assert torch.all(step.made.layers[-1].bias[:600] == init_mean)
        for step in mf.r_flow.steps:
            assert torch.all(step.made.layers[-1].bias[:600] == 0.0)


def test_iaf_bad_shift_init():
    with pytest.raises(ValueError, match="shift_init=nan"):
        IAFStep(3, HIDDEN, shift_init=float("nan"))
    with pytest.raises(ValueError, match="shift_init='1'"):
        IAF(3, 2, HIDDEN, shift_init="1")


def test_sample_uses_global_rng():
    mf = MultiplicativeFlow(5, 1, HIDDEN, init_log_var=0.0)
    torch.manual_seed(7)
    z1, lq1 = mf.sample()
    torch.manual_seed(7)
    z2, lq2 = mf.sample()
    z3, _ = mf.sample()
    assert torch.equal(z1, z2) and torch.equal(lq1, lq2) and not torch.equal(z1, z3)


# ------------------------------------------------------------------------------------------ log r(z|W)

def _reference_log_r(mf: MultiplicativeFlow, z, m_mean, m_var, seed):
    """log r(z | W) written out from the formulas (MNF eqs. 9–10, LBBNN-FLOW local reparameterisation)."""
    torch.manual_seed(seed)
    eps = torch.randn(m_mean.shape[1], dtype=m_mean.dtype)
    a_pre = mf.c @ m_mean + torch.sqrt(mf.c ** 2 @ m_var) * eps
    a = torch.clamp(a_pre, -1.0, 1.0)
    mean_r = (mf.b1[:, None] * a[None, :]).mean(-1)
    log_var_r = (mf.b2[:, None] * a[None, :]).mean(-1)
    # the r flow, step by step (each step: gated IAF on the MADE outputs), reversing between steps
    x, log_det = z, torch.zeros((), dtype=z.dtype)
    for k, step in enumerate(mf.r_flow.steps):
        if k > 0:
            x = torch.flip(x, [0])
        out = step.made(x)
        shift, s = out[:mf.dim], out[mf.dim:]
        gate = 1 / (1 + torch.exp(-s))
        x = gate * x + (1 - gate) * shift
        log_det = log_det + torch.log(gate).sum()
    if len(mf.r_flow.steps) % 2 == 0 and len(mf.r_flow.steps) > 0:
        x = torch.flip(x, [0])
    var_r = torch.exp(log_var_r)
    log_n = torch.sum(-0.5 * math.log(2 * math.pi) - 0.5 * torch.log(var_r) - (x - mean_r) ** 2 / (2 * var_r))
    return log_n + log_det


@pytest.mark.parametrize("flow_length,out_dim", [(0, 4), (1, 3), (2, 9), (3, 1)])
def test_log_r_matches_reference(flow_length, out_dim):
    torch.manual_seed(flow_length)
    dim = 6
    mf = MultiplicativeFlow(dim, flow_length, HIDDEN).double()
    _perturb(mf, 0.3)
    z = torch.randn(dim, dtype=torch.float64)
    m_mean = 0.5 * torch.randn(dim, out_dim, dtype=torch.float64)
    m_var = 0.2 * torch.rand(dim, out_dim, dtype=torch.float64) + 0.01
    torch.manual_seed(99)
    got = mf.log_r(z, m_mean, m_var)
    assert got.shape == ()
    with torch.no_grad():
        expected = _reference_log_r(mf, z, m_mean, m_var, seed=99)
    torch.testing.assert_close(got.detach(), expected, atol=1e-6, rtol=0)


def test_log_r_noise_is_fresh():
    torch.manual_seed(0)
    mf = MultiplicativeFlow(5, 1, HIDDEN).double()
    z, m_mean, m_var = (torch.randn(5, dtype=torch.float64), 0.3 * torch.randn(5, 8, dtype=torch.float64),
                        torch.rand(5, 8, dtype=torch.float64))
    assert mf.log_r(z, m_mean, m_var) != mf.log_r(z, m_mean, m_var)


def test_log_r_gradients():
    torch.manual_seed(0)
    dim, out_dim = 5, 7
    mf = MultiplicativeFlow(dim, 2, HIDDEN)
    m_mean = (0.3 * torch.randn(dim, out_dim)).requires_grad_()
    m_var = (0.1 * torch.rand(dim, out_dim) + 0.01).requires_grad_()
    z, _ = mf.sample()
    mf.log_r(z, m_mean, m_var).backward()
    for name in ("c", "b1", "b2"):
        grad = getattr(mf, name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    for name, p in mf.r_flow.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert m_mean.grad.abs().sum() > 0 and m_var.grad.abs().sum() > 0
    assert mf.mu0.grad.abs().sum() > 0          # through z


def test_log_r_bad_shapes():
    mf = MultiplicativeFlow(5, 1, HIDDEN)
    z, m = torch.randn(5), torch.rand(5, 3)
    with pytest.raises(ValueError, match="z must have shape"):
        mf.log_r(torch.randn(4), m, m)
    with pytest.raises(ValueError, match="m_mean"):
        mf.log_r(z, torch.rand(3, 5), torch.rand(3, 5))
    with pytest.raises(ValueError, match="m_var"):
        mf.log_r(z, m, torch.rand(5, 4))


def test_log_r_zero_variance_has_finite_gradient():
    mf = MultiplicativeFlow(4, 1, HIDDEN)
    m_mean, m_var = torch.randn(4, 3), torch.zeros(4, 3)
    mf.log_r(torch.randn(4), m_mean, m_var).backward()
    assert all(torch.isfinite(p.grad).all() for p in mf.parameters() if p.grad is not None)


# ----------------------------------------------------------------------------------- dtypes, devices

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtype_and_device(device, dtype):
    torch.manual_seed(0)
    mf = MultiplicativeFlow(5, 2, HIDDEN).to(device=device, dtype=dtype)
    assert all(b.dtype == dtype and b.device.type == device for b in mf.buffers())
    z, log_q = mf.sample()
    lr = mf.log_r(z, torch.randn(5, 3, device=device, dtype=dtype), torch.rand(5, 3, device=device, dtype=dtype))
    for t in (z, log_q, lr):
        assert t.dtype == dtype and t.device.type == device and torch.isfinite(t).all()
    (log_q - lr).backward()
    assert all(p.grad is not None for p in mf.parameters())


def test_multiplicative_flow_bad_arguments():
    with pytest.raises(ValueError, match="dim"):
        MultiplicativeFlow(0, 1, HIDDEN)
    with pytest.raises(ValueError, match="init_log_var"):
        MultiplicativeFlow(3, 1, HIDDEN, init_log_var=float("nan"))
    with pytest.raises(ValueError, match="init_mean"):
        MultiplicativeFlow(3, 1, HIDDEN, init_mean="1")
