"""SWAG (Maddox et al. 2019) against closed forms, naive reference loops and torch's own BatchNorm.

* the SWA mean of minibatch SGD on Bayesian linear regression is the closed-form posterior mean;
* θ_SWA, Σ_diag and the deviation matrix equal a naive loop over the collected iterates;
* samples have the covariance scale · (Σ_diag + D̂D̂ᵀ/(K − 1)) within Monte Carlo error;
* the BatchNorm update equals a plain ``model.train()`` pass (momentum=None) with the sampled weights loaded;
* checkpoints (the ring buffer after it wrapped around, the swa_lr schedule) resume exactly;
* the defaults (Maddox et al.'s ``run_swag.py`` recipe, issue 32): 4 collections per epoch, a collection lr of
  2 × each group's lr reached by the script's piecewise-linear schedule (checked against the script's formula
  step by step), the same for MultiSWAG's members and for a run of the command line's digits config.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.samples import RingStore

pytestmark = pytest.mark.usefixtures("one_thread")


def _flat(tensors: dict[str, torch.Tensor], names) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1) for n in names])


def _record_collected(bnn) -> list[torch.Tensor]:
    """Wraps ``bnn.after_step`` so that every collected iterate θ_i is recorded (flat, in name order)."""
    recorded, original = [], bnn.after_step

    def after_step():
        before = int(bnn.num_collected)
        original()
        if int(bnn.num_collected) > before:
            recorded.append(_flat(bnn.theta.as_dict(), bnn.bayesian_names).clone())

    bnn.after_step = after_step
    return recorded


def _regression(n=200, d=3, noise_std=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    y = x @ w.T + 0.3 + noise_std * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return x, y


class Batches:
    """Fixed-size minibatches, reshuffled per epoch from the epoch number only."""

    def __init__(self, x, y, batch_size, seed=0):
        self.x, self.y, self.batch_size, self.seed, self.epoch = x, y, batch_size, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return (len(self.x) + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        for i in range(0, len(order), self.batch_size):
            idx = order[i:i + self.batch_size]
            yield self.x[idx], self.y[idx]


# ---------------------------------------------------------------------------------------------- the SWA mean
def test_swa_mean_of_constant_lr_sgd_is_the_closed_form_posterior_mean_of_linear_regression():
    noise_std, prior_std = 0.5, 1.0
    x, y = _regression(noise_std=noise_std)
    n = len(x)
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    bnn = bw.wrap(model, "swag", num_data=n, prior_std=prior_std, prior_mean="zero", likelihood="gaussian",
                  noise_std=noise_std, swa_start=0.2, collect_every=1, swa_lr=None)
    opt = torch.optim.SGD(bnn.param_groups(), lr=0.01)
    bw.fit(bnn, Batches(x, y, 20), epochs=150, optimizer=opt, progress=False)
    # closed form: precision A = XᵀX/σ² + I/τ² over [w, b]; mean = A⁻¹ Xᵀy/σ²
    design = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)
    precision = design.T @ design / noise_std**2 + torch.eye(4, dtype=torch.float64) / prior_std**2
    exact = torch.linalg.solve(precision, design.T @ y[:, 0] / noise_std**2)
    swa = bnn.posterior_mean()
    got = torch.cat([swa["weight"].reshape(-1), swa["bias"]])
    # The loss is quadratic, so the mean of the SGD stationary distribution is exactly the minimiser (the
    # expected gradient is linear in θ), which is the posterior mean. What remains is the Monte Carlo error of
    # a time average over 1200 correlated iterates: per coordinate at most sd / sqrt(n_eff) with
    # sd = sqrt(Σ_diag) and n_eff >= 1200 / (2 τ_int), τ_int <= 1 / (lr · λ_min(A/N)) ~ 100 steps. That is
    # about 0.3 sd; 1.5 sd (checked below against the measured Σ_diag) is a 5-sigma bound.
    sd = torch.cat([bnn.diagonal_variance()["weight"].reshape(-1), bnn.diagonal_variance()["bias"]]).sqrt()
    assert int(bnn.num_collected) == 1200
    assert (sd < 0.02).all(), sd  # SGD noise at lr=0.01: iterates within a few 1e-3 of the mean
    assert ((got - exact).abs() <= 1.5 * sd + 1e-4).all(), (got, exact, sd)
    torch.testing.assert_close(got, exact, rtol=0, atol=5e-3)


# ---------------------------------------------------------------------------------------------- moments
def _trained_mlp(max_rank=5, covariance="lowrank", scale=0.5, epochs=4, swa_start=4, collect_every=2, swa_lr=None):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (48,), generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    bnn = bw.wrap(model, "swag", num_data=48, swa_start=swa_start, collect_every=collect_every,
                  max_rank=max_rank, covariance=covariance, scale=scale, swa_lr=swa_lr)
    recorded = _record_collected(bnn)
    opt = torch.optim.SGD(bnn.param_groups(), lr=0.3, momentum=0.9)
    bw.fit(bnn, Batches(x, y, 8), epochs=epochs, optimizer=opt, progress=False)
    return bnn, torch.stack(recorded)


def test_moments_and_deviations_equal_a_naive_loop_over_the_collected_iterates():
    bnn, iterates = _trained_mlp()  # 24 steps, collections at steps 6, 8, ..., 24: 10 > max_rank 5 (wrapped)
    names = bnn.bayesian_names
    n, k = len(iterates), 5
    assert n == 10 == int(bnn.num_collected) and len(bnn.deviations) == k and bnn.deviations.num_written == n
    mean = iterates.mean(0)
    var = ((iterates - mean) ** 2).mean(0)  # population variance, the paper's θ̄² − θ̄²
    deviations = torch.stack([iterates[i] - iterates[:i + 1].mean(0) for i in range(n)])[-k:]  # θ_i − θ̄_i
    torch.testing.assert_close(_flat(bnn.posterior_mean(), names), mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(_flat(bnn.diagonal_variance(), names), var, rtol=0, atol=1e-6)
    ring = bnn.deviations.all()
    got = torch.stack([_flat({m: ring[m][i] for m in names}, names) for i in range(k)])
    torch.testing.assert_close(got, deviations, rtol=0, atol=1e-6)
    cov = 0.5 * (torch.diag(var) + deviations.T @ deviations / (k - 1))
    torch.testing.assert_close(_flat(bnn.posterior_std(), names), cov.diagonal().sqrt(), rtol=0, atol=1e-6)


def test_diagonal_covariance_keeps_no_deviations():
    bnn, iterates = _trained_mlp(covariance="diagonal", scale=2.0)
    assert bnn.deviations is None and bnn.rank() == 0
    var = ((iterates - iterates.mean(0)) ** 2).mean(0)
    torch.testing.assert_close(_flat(bnn.posterior_std(), bnn.bayesian_names), (2.0 * var).sqrt(), rtol=0,
                               atol=1e-6)


@pytest.mark.parametrize("covariance, scale, max_rank, epochs",
                         [("lowrank", 0.5, 4, 4), ("lowrank", 2.0, 20, 4), ("diagonal", 0.5, 20, 4),
                          ("lowrank", 0.5, 20, 1)],
                         ids=["lowrank-wrapped", "lowrank-scale2", "diagonal", "one-deviation"])
def test_samples_have_the_swag_covariance_within_monte_carlo_error(covariance, scale, max_rank, epochs):
    # epochs=1: 6 steps, swa_start 4, collect_every 2 -> one collection (step 6): the diagonal part only
    bnn, iterates = _trained_mlp(max_rank=max_rank, covariance=covariance, scale=scale, epochs=epochs)
    names = bnn.bayesian_names
    n = len(iterates)
    mean = iterates.mean(0)
    var = ((iterates - mean) ** 2).mean(0)
    k = min(n, max_rank) if covariance == "lowrank" and n >= 2 else 0
    deviations = torch.stack([iterates[i] - iterates[:i + 1].mean(0) for i in range(n)])[-k:] if k else None
    expected = torch.diag(var) + (deviations.T @ deviations / (k - 1) if k else 0)
    expected = scale * expected
    assert bnn.rank() == k and (k == 0) == (epochs == 1 or covariance == "diagonal")
    s = 40_000
    draws = bnn.sample(s, generator=torch.Generator().manual_seed(0))
    flat = torch.cat([draws[m].reshape(s, -1) for m in names], 1)
    centred = flat - mean
    empirical = centred.T @ centred / s  # the mean is known: no Bessel correction
    # each entry's standard error is sqrt((Σ_ii Σ_jj + Σ_ij²) / S) for Gaussian draws; 5 of them over ~1600 entries
    se = ((expected.diagonal()[:, None] * expected.diagonal()[None, :] + expected**2) / s).sqrt()
    assert ((empirical - expected).abs() <= 5 * se + 1e-12).all(), ((empirical - expected).abs() / se).max()
    # and the sample mean is θ_SWA within 5 standard errors
    assert ((flat.mean(0) - mean).abs() <= 5 * (expected.diagonal() / s).sqrt() + 1e-12).all()


# ---------------------------------------------------------------------------------------------- BatchNorm
def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double()


def _bn_data():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 4, generator=g, dtype=torch.float64) * 2 + 1, torch.randint(0, 3, (64,), generator=g)
    return x, y, [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]


def _reference_outputs(model, theta, batches, x_test):
    """torch's own BatchNorm: the sampled weights loaded into a copy, momentum=None, train() over the batches."""
    net = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(theta[name])
    for m in net.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.momentum = None
            m.reset_running_stats()
    net.train()
    with torch.no_grad():
        for xb, _ in batches:
            net(xb)
        net.eval()
        return net, net(x_test)


def test_bn_update_equals_a_train_mode_pass_with_the_sampled_weights_and_predictions_use_it(tmp_path):
    model = _bn_model()
    x, y, batches = _bn_data()
    untouched = copy.deepcopy(model.state_dict())
    bnn = bw.wrap(model, "swag", num_data=64, swa_start=2, bn_update_batches=3)
    assert bnn.bn_layers == ["1"]
    opt = torch.optim.SGD(bnn.param_groups(), lr=0.1, momentum=0.9)
    bw.fit(bnn, batches, epochs=3, optimizer=opt, progress=False)
    theta = {n: t[0] for n, t in bnn.sample(1, generator=torch.Generator().manual_seed(4)).items()}
    ref_net, ref_out = _reference_outputs(model, theta, batches[:3], x[:10])
    stats = bnn.bn_statistics(theta)
    for name in ("1.running_mean", "1.running_var"):
        torch.testing.assert_close(stats[name], ref_net.state_dict()[name], rtol=0, atol=1e-6)
    assert int(stats["1.num_batches_tracked"]) == 3
    # the statistics of the last training iterate are different (so the test has something to detect)
    assert not torch.allclose(bnn.model_buffers["1.running_mean"], stats["1.running_mean"], atol=1e-3)
    bnn.eval()
    logits = bnn.sample_logits(x[:10], 1, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(logits[0], ref_out, rtol=0, atol=1e-6)
    torch.testing.assert_close(bnn.predict(x[:10], 1, generator=torch.Generator().manual_seed(4)),
                               ref_out.softmax(-1), rtol=0, atol=1e-6)
    # num_samples=0: θ_SWA with its own statistics
    _, ref_mean_out = _reference_outputs(model, bnn.posterior_mean(), batches[:3], x[:10])
    torch.testing.assert_close(bnn.predict(x[:10], 0), ref_mean_out.softmax(-1), rtol=0, atol=1e-6)
    # neither the wrapped model nor the stored statistics were written
    for k, v in model.state_dict().items():
        assert torch.equal(v, untouched[k]), k
    # a model loaded from a checkpoint must be told where the training batches are
    torch.save(bnn.state_dict(), tmp_path / "swag.pt")
    fresh = bw.wrap(_bn_model(), "swag", num_data=64, swa_start=2, bn_update_batches=3)
    fresh.load_state_dict(torch.load(tmp_path / "swag.pt", weights_only=True))
    fresh.eval()
    # θ_SWA's statistics are saved with the model; a draw's, which a Bayesian parameter feeds, need the batches
    torch.testing.assert_close(fresh.predict(x[:10], 0), bnn.predict(x[:10], 0), rtol=0, atol=0)
    with pytest.raises(bw.NotFittedError, match=r"feeds BatchNorm layers \['1'\].*bnn\.set_bn_update_loader"):
        fresh.predict(x[:10], 2)
    fresh.set_bn_update_loader(batches)
    torch.testing.assert_close(fresh.predict(x[:10], 3, generator=torch.Generator().manual_seed(5)),
                               bnn.predict(x[:10], 3, generator=torch.Generator().manual_seed(5)), rtol=0, atol=0)
    fresh.bn_update_batches = 0  # off: the stored statistics, by choice
    assert torch.isfinite(fresh.predict(x[:10], 2)).all()
    with pytest.raises(ValueError, match=r"loader=None is not accepted"):
        fresh.set_bn_update_loader(None)


# ---------------------------------------------------------------------------------------------- checkpoints
class Interrupted(Exception):
    pass


def _interrupted_then_resumed(start, batches, epochs, stop_after, tmp_path, at_stop=None, on_resume=None):
    """Trains ``start()``'s model and optimizer for ``stop_after`` epochs, checkpoints (``at_stop(model, optimizer)``
    first) and stops; then resumes a fresh ``start()`` from the checkpoint (``on_resume(model, optimizer)`` before
    the fit) to ``epochs``. Returns the resumed model and optimizer."""
    first, first_opt = start()

    def checkpoint_then_stop(epoch, record):
        if epoch + 1 == stop_after:
            if at_stop is not None:
                at_stop(first, first_opt)
            torch.save({"bnn": first.state_dict(), "optimizer": first_opt.state_dict()}, tmp_path / "last.pt")
            raise Interrupted

    with pytest.raises(Interrupted):
        bw.fit(first, batches, epochs=epochs, optimizer=first_opt, progress=False, on_epoch_end=checkpoint_then_stop)
    checkpoint = torch.load(tmp_path / "last.pt", weights_only=True)
    resumed, resumed_opt = start()
    resumed.load_state_dict(checkpoint["bnn"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    if on_resume is not None:
        on_resume(resumed, resumed_opt)
    bw.fit(resumed, batches, epochs=epochs, start_epoch=stop_after, optimizer=resumed_opt, progress=False)
    return resumed, resumed_opt


def _assert_same_state(a, b):
    a, b = a.state_dict(), b.state_dict()
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")
        else:
            assert a[key] == b[key], key


def test_resume_after_the_ring_buffer_wrapped_equals_uninterrupted_training(tmp_path):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)
    options = dict(swa_start=0.25, collect_every=1, max_rank=3, swa_lr=0.02, swa_schedule="cosine")  # start: step 4

    def start():
        torch.manual_seed(0)
        bnn = bw.wrap(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)), "swag", num_data=32, **options)
        return bnn, torch.optim.SGD(bnn.param_groups(), lr=0.2, momentum=0.9)

    straight, opt = start()
    lrs = []
    original = straight.after_step
    straight.after_step = lambda: (lrs.append(opt.param_groups[0]["lr"]), original())
    bw.fit(straight, Batches(x, y, 8), epochs=4, optimizer=opt, progress=False)
    # the swa_lr schedule: cosine from 0.2 to 0.02 over the first 4 steps, then 0.02; the lr is given back
    expected = [0.02 + 0.18 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)] + [0.02] * 12
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert opt.param_groups[0]["lr"] == 0.2 and "swag_base_lr" not in opt.param_groups[0]
    assert int(straight.num_collected) == 12 and straight.deviations.num_written == 12

    held = []  # after 12 steps (3 epochs): 8 collections, the ring of 3 has wrapped around twice
    resumed, resumed_opt = _interrupted_then_resumed(
        start, Batches(x, y, 8), 4, 3, tmp_path, at_stop=lambda bnn, _: held.append(bnn.deviations.num_written),
        on_resume=lambda bnn, _: held.append((bnn.deviations.num_written, len(bnn.deviations))))
    assert held == [8, (8, 3)]
    _assert_same_state(resumed, straight)
    assert resumed_opt.param_groups[0]["lr"] == 0.2
    probe = x[:5]
    torch.testing.assert_close(resumed.predict(probe, 4, generator=torch.Generator().manual_seed(1)),
                               straight.predict(probe, 4, generator=torch.Generator().manual_seed(1)),
                               rtol=1e-6, atol=1e-7)


def test_ring_store_keeps_the_last_items_and_round_trips():
    store = RingStore({"w": torch.zeros(2)}, capacity=3)
    assert len(store) == 0 and store.state_dict()["w"].shape == (0, 2)
    for i in range(7):
        store.append({"w": torch.full((2,), float(i))})
    assert store.all()["w"][:, 0].tolist() == [4.0, 5.0, 6.0] and store.num_written == 7
    fresh = RingStore({"w": torch.zeros(2)}, capacity=3)
    fresh.load_state_dict(store.state_dict())
    fresh.append({"w": torch.full((2,), 7.0)})
    store.append({"w": torch.full((2,), 7.0)})
    assert torch.equal(fresh.all()["w"], store.all()["w"]) and fresh.all()["w"][:, 0].tolist() == [5.0, 6.0, 7.0]
    with pytest.raises(RuntimeError, match=r"ring buffer holds the last 3 items, this store the last 4"):
        RingStore({"w": torch.zeros(2)}, capacity=4).load_state_dict(store.state_dict())


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("option, value, accepted", [
    ("swa_start", "soon", r"accepted: 'auto'"),
    ("swa_start", -1, r"accepted: 'auto'"),
    ("swa_start", 1.5, r"accepted: 'auto'"),
    ("swa_start", True, r"accepted: 'auto'"),
    ("collect_every", 0, r"must be an integer >= 1"),
    ("collect_every", "often", r"accepted: 'auto' \(4 collections per epoch\), 'epoch' or an integer"),
    ("max_rank", 1, r"must be an integer >= 2"),
    ("scale", -0.5, r"must be 0 or a number in"),
    ("scale", float("nan"), r"must be 0 or a number in"),
    ("covariance", "full", r"accepted: \('lowrank', 'diagonal'\)"),
    ("swa_lr", 0.0, r"must be None or a finite number > 0"),
    ("swa_lr", "fast", r"accepted: 'auto' \(2 x each parameter group's lr\), None or 'none'"),
    ("swa_lr", -0.1, r"must be None or a finite number > 0"),
    ("swa_schedule", "step", r"accepted: \('linear', 'cosine'\)"),
    ("bn_update_batches", -1, r"must be an integer >= 0"),
])
def test_bad_options_raise_a_value_error_naming_the_value(option, value, accepted):
    with pytest.raises(ValueError, match=rf"^{option}={re.escape(repr(value))}.*{accepted}"):
        bw.wrap(nn.Linear(2, 2), "swag", num_data=10, **{option: value})


def test_swa_start_forms_and_the_not_fitted_errors():
    bnn = bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_start="0.75")
    assert bnn.swa_start == 0.75
    assert bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_start="12").swa_start == 12
    # no step counted (a loop or Trainer without after_step): the cause and the way out, not "train longer"
    with pytest.raises(bw.NotFittedError, match=r"this model has counted no optimizer step\. SWAG collects its "
                                                r"iterates in bnn\.after_step\(\), which bayeswrap\.fit calls .*"
                                                r"BayesianCallback.*bnn\.after_step\(\) after every optimizer\.step"):
        bnn.predict(torch.zeros(1, 2))
    counted = bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_start=5, collect_every=1, swa_lr=None)
    counted.after_step()
    with pytest.raises(bw.NotFittedError, match=r"no SWAG iterate has been collected yet \(1 steps taken, "
                                                r"swa_start=5.*train for more steps or lower swa_start"):
        counted.predict(torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match=r"swa_start=0.75 is resolved when bayeswrap.fit starts"):
        bnn.after_step()  # a hand-written loop without before_fit
    with pytest.raises(ValueError, match=r"SWAG would collect no iterate: the fit runs optimizer steps 1..4 with "
                                         r"swa_start=0.75 \(= 3 steps\) and collect_every=5 \(= 5 steps\)"):
        bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_start=0.75, collect_every=5, swa_lr=None).before_fit(4)
    with pytest.warns(RuntimeWarning, match=r"SWAG would collect no iterate"):
        bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_start=4, swa_lr=None).before_fit(4, None,
                                                                                             steps_per_epoch=1)
    with pytest.raises(ValueError, match=r"collect_every='auto' needs the number of batches per epoch"):
        bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_start=2).before_fit(None)
    with pytest.raises(RuntimeError, match=r"collect_every='auto' is resolved when bayeswrap.fit starts"):
        bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_start=2).collect_every_steps()
    with pytest.raises(ValueError, match=r"train loader has no len\(\)"):
        bnn.before_fit(None)
    for swa_lr in (0.1, "auto"):
        with pytest.raises(ValueError, match=rf"swa_lr={swa_lr!r}: the model sets the optimizer's learning rate.*"
                                             r"pass swa_lr=None"):
            bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_lr=swa_lr).before_fit(10, None, steps_per_epoch=1)


def test_a_yaml_number_for_swa_start_is_read_as_the_command_line_reads_it():
    # an unquoted YAML float or int reaches the string option as the text the command line passes
    from bayeswrap.app.options import coerce_option
    assert coerce_option("swa_start", 0.33) == "0.33"
    assert coerce_option("swa_start", 12) == "12"
    assert bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_start=coerce_option("swa_start", 0.33)).swa_start == 0.33
    assert bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_start=coerce_option("swa_start", 12)).swa_start == 12
    with pytest.raises(ValueError, match=r"covariance='3' is not accepted; accepted: \('lowrank', 'diagonal'\)"):
        bw.wrap(nn.Linear(2, 2), "swag", num_data=10, covariance=coerce_option("covariance", 3))
    with pytest.raises(ValueError, match=r"swa_start=True is not a string"):
        coerce_option("swa_start", True)


# ---------------------------------------------------------------------------------------------- the defaults
def _run_swag_lr(epoch: int, swa_start: int, lr_init: float, swa_lr: float) -> float:
    """Maddox et al.'s ``run_swag.py`` ``schedule(epoch)`` as the script states it (read, not copied: factor form),
    with its epoch as our 0-based step."""
    t = epoch / swa_start
    ratio = swa_lr / lr_init
    factor = 1.0 if t <= 0.5 else 1.0 - (1.0 - ratio) * (t - 0.5) / 0.4 if t <= 0.9 else ratio
    return lr_init * factor


def _classification(n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _record_lrs(bnn, opt) -> list[list[float]]:
    """Wraps ``bnn.after_step`` so that every group's learning rate of each step is recorded."""
    lrs, original = [], bnn.after_step
    bnn.after_step = lambda: (lrs.append([g["lr"] for g in opt.param_groups]), original())
    return lrs


def test_the_defaults_are_the_recipe_of_run_swag():
    bnn = bw.wrap(nn.Linear(2, 2), "swag", num_data=10)
    assert (bnn.collect_every, bnn.max_rank, bnn.swa_lr, bnn.swa_schedule, bnn.swa_start, bnn.scale) == (
        "auto", 20, "auto", "linear", "auto", 0.5)
    # strings as the command line passes them
    bnn = bw.wrap(nn.Linear(2, 2), "swag", num_data=10, collect_every="7", swa_lr="0.1")
    assert (bnn.collect_every, bnn.swa_lr) == (7, 0.1)
    assert bw.wrap(nn.Linear(2, 2), "swag", num_data=10, swa_lr="none").swa_lr is None
    assert bw.wrap(nn.Linear(2, 2), "swag", num_data=10, collect_every=" epoch").collect_every == "epoch"


@pytest.mark.parametrize("batch_size, epochs, every, collections", [
    (4, 6, 3, 12),   # 12 steps per epoch: every 3rd step, 4 per epoch over the last 3 epochs (steps 39, ..., 72)
    (5, 4, 2, 10),   # 10 steps per epoch: every ⌊10/4⌋ = 2nd step, 5 per epoch over the last 2 (steps 22, ..., 40)
    (16, 8, 1, 12),  # 3 steps per epoch: every step (max(1, ⌊3/4⌋)), steps 13, ..., 24
])
def test_auto_collects_four_times_per_epoch(batch_size, epochs, every, collections):
    x, y = _classification()
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), "swag", num_data=48)
    steps = []
    original = bnn.after_step

    def after_step():
        before = int(bnn.num_collected)
        original()
        if int(bnn.num_collected) > before:
            steps.append(int(bnn.num_steps))

    bnn.after_step = after_step
    opt = torch.optim.SGD(bnn.param_groups(), lr=0.05, momentum=0.9)
    bw.fit(bnn, Batches(x, y, batch_size), epochs=epochs, optimizer=opt, progress=False)
    per_epoch = -(-48 // batch_size)  # the last batch may be short
    total = per_epoch * epochs
    assert bnn.collect_every_steps() == every and bnn.swa_start_steps() == total // 2
    assert steps == list(range(total // 2 + every, total + 1, every)) and len(steps) == collections
    assert int(bnn.num_collected) == collections and bnn.rank() == min(collections, 20)
    # once per epoch ("epoch", the paper's) collects at the epoch ends of the second half only
    torch.manual_seed(0)
    once = bw.wrap(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), "swag", num_data=48,
                   collect_every="epoch")
    bw.fit(once, Batches(x, y, batch_size), epochs=epochs, optimizer=torch.optim.SGD(once.param_groups(), lr=0.05),
           progress=False)
    assert int(once.num_collected) == epochs - epochs // 2 and once.collect_every_steps() == per_epoch


@pytest.mark.parametrize("swa_lr, schedule", [("auto", "linear"), (0.03, "linear"), ("auto", "cosine")])
def test_each_steps_lr_is_the_schedule_of_run_swag_for_every_group(swa_lr, schedule):
    x, y = _classification()
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), "swag", num_data=48, swa_lr=swa_lr,
                  swa_schedule=schedule)
    # two groups with their own lr (as the command line's lr_head makes them)
    opt = torch.optim.SGD([{"params": [bnn.theta["0.weight"], bnn.theta["0.bias"]], "lr": 0.05},
                           {"params": [bnn.theta["2.weight"], bnn.theta["2.bias"]], "lr": 0.2}], momentum=0.9)
    lrs = _record_lrs(bnn, opt)
    bw.fit(bnn, Batches(x, y, 4), epochs=10, optimizer=opt, progress=False)  # 120 steps, swa_start 60
    assert len(lrs) == 120 and bnn.swa_start_steps() == 60
    for g, base in enumerate((0.05, 0.2)):
        target = 2 * base if swa_lr == "auto" else swa_lr
        if schedule == "linear":
            expected = [_run_swag_lr(k, 60, base, target) for k in range(60)] + [target] * 60
        else:
            expected = [target + (base - target) * 0.5 * (1 + math.cos(math.pi * k / 60)) for k in range(60)]
            expected += [target] * 60
        assert [step[g] for step in lrs] == pytest.approx(expected, rel=1e-12, abs=0)
        if schedule == "linear":  # the script's shape: lr for the first half of swa_start, swa_lr from 0.9 of it
            assert [step[g] for step in lrs[:31]] == [base] * 31 and lrs[54][g] == pytest.approx(target, rel=1e-12)
            assert base < lrs[40][g] < target or target < lrs[40][g] < base
    # given back at the end
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.2] and all("swag_base_lr" not in g for g in opt.param_groups)


def test_swa_lr_none_leaves_the_optimizer_alone():
    x, y = _classification()
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), "swag", num_data=48, swa_lr="none")
    opt = torch.optim.SGD(bnn.param_groups(), lr=0.05, momentum=0.9)
    lrs = _record_lrs(bnn, opt)
    bw.fit(bnn, Batches(x, y, 4), epochs=4, optimizer=opt, progress=False)
    assert lrs == [[0.05]] * 48 and int(bnn.num_collected) == 8
    with pytest.raises(ValueError, match=r"swa_lr=None: the model leaves the optimizer's learning rate alone"):
        bnn.lr_at(1, 0.05)


def test_resume_at_the_defaults_collects_as_the_uninterrupted_fit(tmp_path):
    # 8 steps per epoch, 6 epochs: swa_start 24, the lr ramps over steps 14..22, collections every 2nd step from 26
    x, y = _classification(n=32, seed=3)

    def start():
        torch.manual_seed(0)
        bnn = bw.wrap(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)), "swag", num_data=32, max_rank=4)
        return bnn, torch.optim.SGD(bnn.param_groups(), lr=0.1, momentum=0.9)

    straight, opt = start()
    lrs = _record_lrs(straight, opt)
    bw.fit(straight, Batches(x, y, 4), epochs=6, optimizer=opt, progress=False)
    assert [lr[0] for lr in lrs] == pytest.approx([_run_swag_lr(k, 24, 0.1, 0.2) for k in range(24)] + [0.2] * 24,
                                                  rel=1e-12, abs=0)
    assert int(straight.num_collected) == 12 and straight.deviations.num_written == 12

    # stopped after 16 steps (2 epochs): in the middle of the ramp (lr 0.1 -> 0.2), nothing collected yet
    at_stop, resumed_lrs = [], []
    resumed, resumed_opt = _interrupted_then_resumed(
        start, Batches(x, y, 4), 6, 2, tmp_path,
        at_stop=lambda bnn, o: at_stop.append((o.param_groups[0]["lr"], int(bnn.num_collected))),
        on_resume=lambda bnn, o: resumed_lrs.append(_record_lrs(bnn, o)))
    assert at_stop[0][0] == pytest.approx(_run_swag_lr(16, 24, 0.1, 0.2), rel=1e-12) and at_stop[0][1] == 0
    assert resumed_lrs[0] == lrs[16:]
    assert int(resumed.num_collected) == 12 and resumed_opt.param_groups[0]["lr"] == 0.1
    _assert_same_state(resumed, straight)


def test_multiswag_members_take_swags_defaults_and_share_the_schedule():
    x, y = _classification()
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)), "multiswag", num_data=48,
                  num_members=2, init_seed=0)
    defaults = bw.wrap(nn.Linear(2, 2), "swag", num_data=10)
    for member in bnn.members:
        assert (member.collect_every, member.max_rank, member.swa_lr, member.swa_schedule) == (
            defaults.collect_every, defaults.max_rank, defaults.swa_lr, defaults.swa_schedule) == (
            "auto", 20, "auto", "linear")
    opt = torch.optim.SGD(bnn.param_groups(), lr=0.05, momentum=0.9)
    lrs = _record_lrs(bnn, opt)
    bw.fit(bnn, Batches(x, y, 4), epochs=6, optimizer=opt, progress=False)  # 72 steps: as the single model above
    assert [lr[0] for lr in lrs] == pytest.approx([_run_swag_lr(k, 36, 0.05, 0.1) for k in range(36)] + [0.1] * 36,
                                                  rel=1e-12, abs=0)
    assert [int(m.num_collected) for m in bnn.members] == [12, 12] and opt.param_groups[0]["lr"] == 0.05


def test_a_run_with_an_lr_schedule_keeps_it_and_the_digits_config_gets_the_recipe():
    from bayeswrap.app.config import resolve
    from bayeswrap.methods.run_info import RunInfo
    from bayeswrap.methods.swag import SWAG

    swag, multiswag = bw.METHODS["swag"], bw.METHODS["multiswag"]
    assert swag.run_options(RunInfo(epochs=4)) == {}
    assert swag.run_options(RunInfo(epochs=4, scheduler="cosine")) == {"swa_lr": None}
    assert swag.run_options(RunInfo(epochs=4, warmup_epochs=1, options={"swa_lr": "none"})) == {}
    with pytest.raises(ValueError, match=r"scheduler='cosine', warmup_epochs=0: SWAG with swa_lr='0.1' sets its own "
                                         r"step size; accepted: scheduler=constant"):
        swag.run_options(RunInfo(epochs=4, scheduler="cosine", options={"swa_lr": "0.1"}))
    assert multiswag.run_options(RunInfo(epochs=4, scheduler="cosine", options={"member_kwargs": {"max_rank": 5}})
                                 ) == {"member_kwargs": {"max_rank": 5, "swa_lr": None}}
    assert multiswag.run_options(RunInfo(epochs=4)) == {}
    # bayeswrap compare -c configs/digits.yaml: SGD lr 0.05 with momentum 0.9, and no SWAG option given, so the
    # constructor's defaults (the recipe above) apply
    for method in ("swag", "multiswag"):
        cfg = resolve("configs/digits.yaml", {"method": method})
        assert (cfg.optimizer, cfg.lr, cfg.momentum, cfg.scheduler, cfg.warmup_epochs) == ("sgd", 0.05, 0.9,
                                                                                           "constant", 0)
        arguments = cfg.init_arguments(cfg.run_info(steps_per_epoch=30))
        assert not {"collect_every", "swa_lr", "swa_schedule", "max_rank"} & set(arguments)
        assert not {"collect_every", "swa_lr", "swa_schedule", "max_rank"} & set(arguments.get("member_kwargs", {}))
    assert SWAG.__init__.__kwdefaults__["swa_lr"] == "auto"
