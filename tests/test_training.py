"""The single training loop and the SGLD optimizer."""

import math

import pytest
import torch
from torch import nn

import bayeswrap as bw


def _setup(method="vi", **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    return bw.wrap(model, method, num_data=64, **kw), batches


def test_fit_reduces_loss_and_reports_history():
    bnn, batches = _setup("map")
    history = bw.fit(bnn, batches, epochs=15, optimizer=torch.optim.Adam(bnn.parameters(), lr=1e-2),
                     val_loader=batches[:2], progress=False)
    assert [h["epoch"] for h in history] == list(range(1, 16))
    assert history[-1]["train_loss"] < 0.7 * history[0]["train_loss"]
    assert {"train_nll", "train_kl", "train_error", "val_nll", "val_error", "lr", "seconds"} <= set(history[0])
    # the reported train loss is the sample-weighted batch mean of nll + kl/N
    h = history[-1]
    assert math.isclose(h["train_loss"], h["train_nll"] + h["train_kl"] / 64, rel_tol=1e-5)


def test_early_stopping_restores_best_validation_state():
    bnn, batches = _setup("map")
    seen = []

    def snapshot(epoch, record):
        seen.append((record["val_nll"], {k: v.clone() for k, v in bnn.state_dict().items() if torch.is_tensor(v)}))

    # a huge learning rate makes validation NLL get worse after the first epochs
    bw.fit(bnn, batches, epochs=8, optimizer=torch.optim.SGD(bnn.parameters(), lr=3.0), val_loader=batches,
           early_stopping_patience=2, on_epoch_end=snapshot, progress=False)
    best_nll, best_state = min(seen, key=lambda s: s[0])
    for k, v in best_state.items():
        assert torch.equal(bnn.state_dict()[k], v), k
    assert len(seen) <= 8


def test_laplace_fit_runs_curvature_and_sgld_collects_moments():
    bnn, batches = _setup("laplace")
    assert not bnn.is_ready()
    bw.fit(bnn, batches, epochs=2, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1), progress=False)
    assert bnn.is_ready() and all(torch.all(v > 0) for v in bnn.posterior_var.values())
    sg, batches = _setup("sgld", burn_in=3, thinning=2)
    bw.fit(sg, batches, epochs=3, optimizer=bw.optim.SGLD(sg.parameters(), lr=1e-2, num_data=64), progress=False)
    assert int(sg.num_steps) == 12 and int(sg.num_kept) == (12 - 3) // 2


def test_sgld_refuses_other_optimizers():
    bnn, batches = _setup("sgld")
    with pytest.raises(ValueError, match="bayeswrap.optim.SGLD, got SGD"):
        bw.fit(bnn, batches, epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1, momentum=0.9))


def test_nan_loss_raises():
    bnn, batches = _setup("vi")
    bad = [(torch.full((4, 4), float("nan")), torch.zeros(4, dtype=torch.long))]
    with pytest.raises(FloatingPointError, match="non-finite loss nan.*epoch 1, step 1"):
        bw.fit(bnn, bad, epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1), progress=False)


def test_sgld_step_is_the_langevin_update():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    start, grad = p.detach().clone(), p.grad.clone()
    opt = bw.optim.SGLD([p], lr=0.01, num_data=50, noise_scale=0.5, generator=torch.Generator().manual_seed(7))
    opt.step()
    eps = torch.randn(5, generator=torch.Generator().manual_seed(7))
    expected = start - 0.01 * grad + 0.5 * math.sqrt(2 * 0.01 / 50) * eps
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7)


def test_sgld_noise_is_one_flat_draw_per_step_over_all_tensors():
    """Several tensors: the noise of each step is one flat N(0, 1) draw of the generator split over them (the
    CPU buffer kept between steps holds each step's fresh draw)."""
    ps = [nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(2, 2))]
    opt = bw.optim.SGLD(ps, lr=0.02, num_data=10, generator=torch.Generator().manual_seed(9))
    ref = torch.Generator().manual_seed(9)
    scale = math.sqrt(2 * 0.02 / 10)
    for _ in range(2):
        before = torch.cat([p.detach().reshape(-1) for p in ps])
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        expected = before - 0.02 + scale * torch.randn(21, generator=ref)
        torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in ps]), expected, rtol=0, atol=1e-7)


def test_point_estimates_get_no_langevin_noise():
    bnn, _ = _setup("sgld", params=["2.*"])
    groups = bnn.param_groups()
    assert [g["name"] for g in groups] == ["posterior", "point"] and groups[1]["noise_scale"] == 0.0
    opt = bw.optim.SGLD(groups, lr=0.1, num_data=64)
    for p in bnn.parameters():
        p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in bnn.named_parameters()}
    opt.step()
    for n, p in bnn.named_parameters():
        assert torch.equal(p, before[n]) == n.startswith("point."), n
