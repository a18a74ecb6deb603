"""The fused hot path gives the same loss and gradients as the plain autograd reference."""

import pytest
import torch
from torch import nn

import bayeswrap as bw


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def _loss_and_grads(bnn, seed):
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.arange(8) % 5
    torch.manual_seed(seed)
    out = bnn.loss(x, y)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in bnn.named_parameters()}


@pytest.mark.parametrize("kwargs", [{}, {"bias": "uninformative"}, {"params": ["4.*"]},
                                    {"prior_mean": "zero", "prior_std": 0.3, "kl_weight": 0.2}])
def test_vi_fused_equals_reference(kwargs):
    model = _model().double()
    ref = bw.wrap(model, "vi", num_data=50, init_std=0.05, fused=False, **kwargs)
    fast = bw.wrap(model, "vi", num_data=50, init_std=0.05, fused=True, **kwargs)
    with torch.no_grad():  # move means off the prior mean so every KL term is non-trivial
        for (_, a), (_, b) in zip(ref.named_parameters(), fast.named_parameters()):
            a.add_(0.01 * torch.randn(a.shape, generator=torch.Generator().manual_seed(a.numel()), dtype=a.dtype))
            b.copy_(a)
    (o1, g1), (o2, g2) = _loss_and_grads(ref, 7), _loss_and_grads(fast, 7)
    torch.testing.assert_close(o2.loss, o1.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o2.kl, o1.kl, rtol=1e-12, atol=1e-10)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("method, kwargs", [("map", {}), ("map", {"bias": "uninformative"}),
                                            ("mc_dropout", {"p_drop": 0.3, "bias": "gaussian"}),
                                            ("mc_dropout", {"p_drop": 0.3, "bias": "ignore"})])
def test_fused_gaussian_penalty_equals_reference(method, kwargs):
    model = _model().double()
    bnn = bw.wrap(model, method, num_data=50, prior_std=0.4, prior_mean="zero", **kwargs)
    theta = bnn.theta.as_dict()
    scale = {n: 1 - p for n, p in bnn.drop_prob.items()} if method == "mc_dropout" else None
    values, grads = [], []
    for fused in (True, False):
        for p in bnn.parameters():
            p.grad = None
        value = bnn.prior.penalty(theta, scale=scale, fused=fused)
        (3.0 * value).backward()
        values.append(value.detach())
        grads.append({n: torch.zeros_like(t) if t.grad is None else t.grad.clone() for n, t in theta.items()})
    torch.testing.assert_close(values[0], values[1], rtol=1e-12, atol=0)
    for n in theta:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-12, atol=0, msg=n)
