"""KL annealing: the warm-up + linear-ramp schedule and its use in ``bw.fit``."""

import math

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.schedules import KLSchedule, check_factor, constant


def test_warmup_is_zero_then_the_exact_linear_ramp():
    s = KLSchedule(warmup_epochs=3, ramp_epochs=4)
    assert [s(e) for e in range(10)] == [0.0, 0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    # KL(C) = (C / T) · KL_max for the C-th ramp epoch
    s = KLSchedule(warmup_epochs=5, ramp_epochs=7)
    for c in range(1, 8):
        assert s(5 + c - 1) == c / 7
    assert KLSchedule(2, 0)(1) == 0.0 and KLSchedule(2, 0)(2) == 1.0
    assert KLSchedule()(0) == 1.0
    assert "warmup_epochs=5" in repr(s)


def test_bad_schedule_arguments_raise():
    for kwargs in ({"warmup_epochs": -1}, {"ramp_epochs": 1.5}, {"warmup_epochs": True}):
        with pytest.raises(ValueError, match="integer >= 0"):
            KLSchedule(**kwargs)
    with pytest.raises(ValueError, match="finite and >= 0"):
        check_factor(-0.5)
    with pytest.raises(ValueError, match="not a number"):
        check_factor("x")
    assert constant(0.5)(10) == 0.5


def _data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (n,), generator=g)
    return [(x[i:i + 16], y[i:i + 16]) for i in range(0, n, 16)]


def test_fit_scales_the_kl_per_epoch_and_records_the_factor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    bnn = bw.wrap(model, "vi", num_data=48, prior_std=1.0, kl_weight=0.5, init_std=0.05)
    schedule = KLSchedule(warmup_epochs=2, ramp_epochs=3)
    history = bw.fit(bnn, _data(), epochs=7, optimizer=torch.optim.SGD(bnn.parameters(), lr=1e-3),
                     kl_schedule=schedule, progress=False)
    assert [h["kl_factor"] for h in history] == [0.0, 0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0]
    for h in history:  # loss = nll + factor · kl_weight · kl / N, batch by batch (equal batch sizes)
        assert h["train_loss"] == pytest.approx(h["train_nll"] + h["kl_factor"] * 0.5 * h["train_kl"] / 48,
                                                rel=1e-12, abs=1e-12)
    assert history[0]["train_loss"] == pytest.approx(history[0]["train_nll"], abs=0)
    assert bnn.kl_weight == 0.5  # the model's own weight is untouched
    assert "kl_factor" in bw.fit(bnn, _data(), epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=1e-3),
                                 progress=False)[0]


def test_noise_is_still_injected_during_warm_up():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2)).double()
    bnn = bw.wrap(model, "vi", num_data=48, init_std=0.5)
    data = _data()
    # lr = 0: the parameters stay put, so any difference to the posterior-mean NLL is the injected noise
    history = bw.fit(bnn, data, epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.0),
                     kl_schedule=KLSchedule(warmup_epochs=5), progress=False)
    assert history[0]["kl_factor"] == 0.0
    with torch.no_grad():
        mean_nll = sum(bnn.likelihood.nll(bnn.forward_with(bnn.posterior_mean(), x), y).item() * len(y)
                       for x, y in data) / 48
    assert abs(history[0]["train_nll"] - mean_nll) > 1e-3


def test_schedule_works_for_methods_with_a_prior_term_and_bad_factors_raise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2)).double()
    for method in ("map", "sparse_vd", "mc_dropout"):
        bnn = bw.wrap(model, method, num_data=48, prior_mean="zero")
        h = bw.fit(bnn, _data(), epochs=2, optimizer=torch.optim.SGD(bnn.parameters(), lr=1e-3),
                   kl_schedule=KLSchedule(1, 1), progress=False)
        assert h[0]["train_loss"] == pytest.approx(h[0]["train_nll"], abs=0)
        assert h[1]["train_loss"] > h[1]["train_nll"] and math.isfinite(h[1]["train_loss"])
    bnn = bw.wrap(model, "vi", num_data=48)
    with pytest.raises(ValueError, match="kl_schedule returned -1"):
        bw.fit(bnn, _data(), epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=1e-3),
               kl_schedule=lambda epoch: -1, progress=False)
    assert bnn.kl_weight == 1.0
