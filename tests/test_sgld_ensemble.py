"""SGLD's ensemble predictive, the shared sample store, burn_in="auto" and cyclical SGLD.

The accuracy tests run SGLD on Bayesian linear regression, whose posterior is
Gaussian and known exactly. A bias-free ``nn.Linear(D, C)`` with a Gaussian
likelihood summed over its C outputs has C independent posteriors (one per
output column, all with the same covariance A⁻¹), so one chain of the model is
C independent chains of the same D-dimensional problem: averaging over the
columns shrinks the Monte Carlo error by √C at the cost of one run.
"""

import io
import math
import warnings

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.samples import SampleStore, spread_indices
from bayeswrap.core.schedules import cycle_length, cyclical_position, cyclical_step_size, exploration_steps

N, D, C, NOISE_STD, PRIOR_STD, RHO = 300, 3, 64, 1.0, 1.0, 0.5


pytestmark = pytest.mark.usefixtures("one_thread")



class Batches:
    """Minibatches of (x, y), reshuffled every epoch by ``set_epoch`` (cheaper than a DataLoader)."""

    def __init__(self, x, y, batch_size, seed):
        self.x, self.y, self.batch_size = x, y, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.arange(len(x))

    def __len__(self):
        return len(self.x) // self.batch_size

    def set_epoch(self, epoch):
        self.order = torch.randperm(len(self.x), generator=self.generator)

    def __iter__(self):
        for i in range(len(self)):
            j = self.order[i * self.batch_size:(i + 1) * self.batch_size]
            yield self.x[j], self.y[j]


def _regression(noise_scale=1.0, rho=RHO, columns=C, seed=0):
    """Data y = X W + ε with correlated features, and the exact posterior N(M, A⁻¹) of every column."""
    g = torch.Generator().manual_seed(seed)
    cov_x = torch.tensor([[1.0, rho, 0.0], [rho, 1.0, 0.0], [0.0, 0.0, 1.0]])
    x = torch.randn(N, D, generator=g) @ torch.linalg.cholesky(cov_x).T
    y = x @ torch.randn(D, columns, generator=g) + NOISE_STD * torch.randn(N, columns, generator=g)
    precision = x.T @ x / NOISE_STD**2 + torch.eye(D) / PRIOR_STD**2
    cov = torch.linalg.inv(precision)
    return {"x": x, "y": y, "cov": cov, "mean": cov @ x.T @ y / NOISE_STD**2, "precision": precision}


def _sgld_linreg(data, *, lr, steps, burn_in, thinning, noise_scale=1.0, batch_size=60, max_samples=500, seed=1):
    torch.manual_seed(0)
    columns = data["y"].shape[1]
    bnn = bw.wrap(nn.Linear(D, columns, bias=False), "sgld", num_data=N, prior_std=PRIOR_STD, prior_mean="zero",
                  likelihood="gaussian", noise_std=NOISE_STD, burn_in=burn_in, thinning=thinning,
                  max_samples=max_samples, chunk_size=512)
    opt = bw.optim.SGLD(bnn.parameters(), lr=lr, num_data=N, noise_scale=noise_scale,
                        generator=torch.Generator().manual_seed(seed))
    loader = Batches(data["x"], data["y"], batch_size, seed + 10)
    bw.fit(bnn, loader, epochs=steps // len(loader), optimizer=opt, progress=False)
    return bnn


# test points: along the correlated direction (1, 1, 0), against it (1, -1, 0), the independent axis, a mix
X_TEST = torch.tensor([[1.0, 1.0, 0.0], [1.0, -1.0, 0.0], [0.0, 0.0, 1.0], [0.5, -1.0, 1.0]])


@pytest.fixture(scope="module")
def chain():
    """One SGLD run: 9,000 minibatch steps (batch 60 of N = 300), 1,000 burn-in, every 10th iterate kept.

    lr = 0.03 is a Langevin step h = lr/N = 1e-4 on U, so h·λ ∈ [0.014, 0.048] over the
    precision's eigenvalues λ: the Euler discretisation inflates the variance along an
    eigenvector by 1/(1 − hλ/2) − 1 ≤ 2.5%, and the chain is ≥ 60 autocorrelation times
    (2/(hλ_min) ≈ 140 steps) long, so its own-mean variance is < 2% low. With C = 64
    columns the Monte Carlo error of a column-averaged variance is ≈ 2%.
    """
    data = _regression()
    bnn = _sgld_linreg(data, lr=0.03, steps=9000, burn_in=1000, thinning=10)
    return data, bnn


def _epistemic(x, cov):
    """x_i^T Σ x_i for each row of x."""
    return ((x @ cov) * x).sum(1)


def test_ensemble_predictive_matches_exact_posterior_predictive(chain):
    data, bnn = chain
    assert int(bnn.num_kept) == 800 and len(bnn.sample_store) == 400 and bnn.sample_store.stride == 2
    mean, var = bnn.predict(X_TEST, num_samples=len(bnn.sample_store))
    exact_mean = X_TEST @ data["mean"]  # (4, C)
    exact_epistemic = _epistemic(X_TEST, data["cov"])  # (4,), the same for every column
    exact_var = NOISE_STD**2 + exact_epistemic
    # mean: within 10% of the exact predictive mean, and within a third of a posterior std on average
    assert torch.all((mean - exact_mean).abs() <= 0.1 * exact_mean.abs() + 0.05), (mean - exact_mean).abs().max()
    rms = ((mean - exact_mean) / exact_epistemic.sqrt()[:, None]).pow(2).mean(1).sqrt()
    assert torch.all(rms < 0.35), rms
    # variance: the total (noise² + epistemic) and the epistemic part alone, column-averaged, within 10%
    assert torch.allclose(var, exact_var[:, None].expand_as(var), rtol=0.1)
    ratio = (var - NOISE_STD**2).mean(1) / exact_epistemic
    assert torch.all((ratio - 1).abs() < 0.1), ratio
    # the stiffest direction (1, 1, 0) carries the largest discretisation bias, still a few %
    assert abs(ratio[0] - 1) < 0.08, ratio


def test_stored_draws_have_the_exact_posterior_covariance(chain):
    data, bnn = chain
    draws = bnn.sample_store.all()["weight"]  # (S, C, D): one chain per output column
    centred = draws - draws.mean(0)
    cov = torch.einsum("scd,sce->de", centred, centred) / (draws.shape[0] * C)
    exact = data["cov"]
    assert torch.allclose(cov.diagonal(), exact.diagonal(), rtol=0.1), (cov.diagonal(), exact.diagonal())
    corr = cov[0, 1] / (cov[0, 0] * cov[1, 1]).sqrt()
    exact_corr = exact[0, 1] / (exact[0, 0] * exact[1, 1]).sqrt()
    assert exact_corr < -0.5 and abs(corr - exact_corr) < 0.05, (corr, exact_corr)
    # the Welford moments (both predictives' posterior_mean/std) agree with the exact marginals too
    std = bnn.posterior_std()["weight"]  # (C, D)
    assert torch.allclose(std.pow(2).mean(0), exact.diagonal(), rtol=0.1)
    err = (bnn.posterior_mean()["weight"] - data["mean"].T) / exact.diagonal().sqrt()
    assert err.pow(2).mean().sqrt() < 0.35


def test_gaussian_predictive_misses_the_correlation_the_ensemble_keeps(chain):
    data, bnn = chain
    exact = _epistemic(X_TEST, data["cov"])
    _, var_ens = bnn.predict(X_TEST, num_samples=len(bnn.sample_store))
    bnn.predictive = "gaussian"
    try:
        _, var_gauss = bnn.predict(X_TEST, num_samples=4000, generator=torch.Generator().manual_seed(0))
        diag_var = bnn.posterior_std()["weight"].pow(2)  # (C, D)
    finally:
        bnn.predictive = "ensemble"
    ens, gauss = (var_ens - NOISE_STD**2).mean(1), (var_gauss - NOISE_STD**2).mean(1)
    # the diagonal Gaussian predicts Σ_i x_i² var_i, dropping the −0.54 correlation of w1 and w2
    diag_formula = (X_TEST.pow(2) @ diag_var.T).mean(1)
    assert torch.allclose(gauss, diag_formula, rtol=0.05)
    assert abs(ens[0] / exact[0] - 1) < 0.1 and gauss[0] / exact[0] > 1.8  # along (1, 1, 0): ~2.1x too wide
    assert abs(ens[1] / exact[1] - 1) < 0.1 and gauss[1] / exact[1] < 0.75  # against it: ~0.65x too narrow
    assert abs(gauss[2] / exact[2] - 1) < 0.1  # the uncorrelated axis is right either way


def test_noise_scale_is_a_tempered_posterior_with_temperature_noise_scale_squared():
    """noise_scale s: stationary ∝ p(θ|D)^(1/T), T = s²: covariance T · A⁻¹ for a Gaussian posterior."""
    data = _regression(rho=0.0, columns=128, seed=3)
    bnn = _sgld_linreg(data, lr=0.03, steps=3000, burn_in=300, thinning=5, noise_scale=0.5, max_samples=1000)
    draws = bnn.sample_store.all()["weight"]
    var = (draws - draws.mean(0)).pow(2).mean((0, 1))
    expected = 0.25 * data["cov"].diagonal()
    assert torch.allclose(var, expected, rtol=0.1), (var / expected)


# ---------------------------------------------------------------------- the ensemble predictive
def _small_sgld(**kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    bnn = bw.wrap(model, "sgld", num_data=64, **kw)
    return bnn, [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)], x


def test_ensemble_sample_and_predict_use_stored_iterates():
    bnn, batches, x = _small_sgld(burn_in=0, thinning=1, max_samples=10, chunk_size=4)
    opt = bw.optim.SGLD(bnn.parameters(), lr=1e-2, num_data=64)
    iterates, real_step = [], opt.step

    def recording_step(*a, **kw):
        out = real_step(*a, **kw)
        iterates.append(bnn.theta["0.weight"].clone())  # the iterate after this step
        return out

    opt.step = recording_step
    bw.fit(bnn, batches, epochs=3, optimizer=opt, progress=False)
    store = bnn.sample_store
    # 12 kept iterates (offers 0..11) into 10 slots: one thinning, so offers 0, 2, ..., 10 are stored
    assert int(bnn.num_kept) == 12 and len(store) == 6 and store.positions().tolist() == [0, 2, 4, 6, 8, 10]
    everything = bnn.sample(6)
    for i, offer in enumerate(range(0, 12, 2)):
        assert torch.equal(everything["0.weight"][i], iterates[offer])
    assert all(torch.equal(a, b) for a, b in zip(everything["0.weight"], store.all()["0.weight"]))
    # S > stored cycles in chain order; S < stored takes evenly spaced draws
    assert torch.equal(bnn.sample(9)["2.bias"], store.all()["2.bias"][[0, 1, 2, 3, 4, 5, 0, 1, 2]])
    assert torch.equal(bnn.sample(3)["2.bias"], store.all()["2.bias"][[1, 3, 5]])
    # the chunked sample_logits (chunk_size=4) evaluates the chosen draws once each, not chunk-wise repeats
    logits = bnn.sample_logits(x, 6)
    manual = torch.stack([bnn.forward_with({n: t[i] for n, t in everything.items()}, x) for i in range(6)])
    torch.testing.assert_close(logits, manual)
    torch.testing.assert_close(bnn.predict(x, num_samples=6), manual.softmax(-1).mean(0))
    # S = 0 predicts at the running mean in both modes
    mean_pred = bnn.forward_with(bnn.posterior_mean(), x).softmax(-1)
    torch.testing.assert_close(bnn.predict(x, num_samples=0), mean_pred)
    bnn.predictive = "gaussian"
    torch.testing.assert_close(bnn.predict(x, num_samples=0), mean_pred)
    with pytest.raises(ValueError, match=r"predictive=.mixture. is not accepted; accepted: \(.ensemble., .gaussian.\)"):
        bnn.predictive = "mixture"


def test_sgld_checkpoint_keeps_the_draws_and_loads_weights_only():
    bnn, batches, x = _small_sgld(burn_in=2, thinning=1, max_samples=5, sample_dtype="bfloat16")
    bw.fit(bnn, batches, epochs=3, optimizer=bw.optim.SGLD(bnn.parameters(), lr=1e-2, num_data=64), progress=False)
    buffer = io.BytesIO()
    torch.save(bnn.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["sample_store.0/weight"].shape == (len(bnn.sample_store), 8, 4)
    assert state["sample_store.0/weight"].dtype == torch.bfloat16
    fresh, _, _ = _small_sgld(burn_in=2, thinning=1, max_samples=5, sample_dtype="bfloat16")
    fresh.load_state_dict(state)
    assert len(fresh.sample_store) == len(bnn.sample_store) and fresh.sample_store.stride == bnn.sample_store.stride
    torch.testing.assert_close(fresh.predict(x, num_samples=7), bnn.predict(x, num_samples=7), rtol=0, atol=0)
    # a state without draws (strict=False, e.g. saved before the store existed) says how to use the moments
    old, _, _ = _small_sgld(burn_in=2, thinning=1, max_samples=5)
    old.load_state_dict({k: v for k, v in state.items() if not k.startswith("sample_store.")}, strict=False)
    with pytest.raises(bw.NotFittedError, match="none in its sample store.*predictive = 'gaussian'"):
        old.predict(x, num_samples=3)
    old.predictive = "gaussian"
    assert old.predict(x, num_samples=3).shape == (64, 3)


def test_max_samples_zero_keeps_only_moments():
    with pytest.raises(ValueError, match="max_samples=0 stores no iterates"):
        _small_sgld(max_samples=0)
    bnn, batches, x = _small_sgld(max_samples=0, predictive="gaussian", burn_in=0, thinning=1)
    bw.fit(bnn, batches, epochs=1, optimizer=bw.optim.SGLD(bnn.parameters(), lr=1e-2, num_data=64), progress=False)
    assert bnn.sample_store is None and bnn.predict(x, num_samples=3).shape == (64, 3)
    with pytest.raises(ValueError, match="max_samples=0"):
        bnn.predictive = "ensemble"


def test_a_store_that_may_grow_large_warns(monkeypatch):
    import bayeswrap.methods.sgld as sgld_module

    monkeypatch.setattr(sgld_module, "STORE_WARN_BYTES", 10_000)  # the MLP's 67 parameters: 268 B a draw
    with pytest.warns(RuntimeWarning, match=r"sample store may grow to .* \(100 draws of 0 MiB, on cpu"):
        _small_sgld()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _small_sgld(max_samples=30)  # 8 kB
        _small_sgld(sample_dtype=torch.bfloat16, max_samples=70)  # 9.4 kB


@pytest.mark.parametrize("option, value, match", [
    ("max_samples", -1, r"max_samples=-1 must be an integer >= 0"),
    ("sample_dtype", "int8", r"sample_dtype='int8' is not accepted; accepted: None, \('float32'"),
    ("predictive", "laplace", r"predictive='laplace' is not accepted; accepted: \('ensemble', 'gaussian'\)"),
    ("sample_device", "gpu0", r"sample_device='gpu0' is not accepted; accepted: None \(follow the model\)"),
    ("cycles", 0, r"cycles=0 must be None or an integer >= 1 \(None: plain SGLD\)"),
    ("exploration", 1.0, r"exploration=1.0 must be a number in \[0, 1\)"),
])
def test_bad_options_name_the_value(option, value, match):
    with pytest.raises(ValueError, match=match):
        _small_sgld(**{option: value})


# ---------------------------------------------------------------------- the sample store
def _offer_range(store, start, stop):
    for i in range(start, stop):
        store.offer({"w": torch.full((2, 3), float(i)), "b": torch.full((2,), -float(i))})


@pytest.mark.parametrize("max_samples", [1, 2, 5, 8])
def test_store_thins_by_two_when_full_and_stays_spread_over_the_chain(max_samples):
    for offered in range(1, 70):
        store = SampleStore({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, max_samples=max_samples)
        _offer_range(store, 0, offered)
        # naive reference: the smallest power-of-two stride k with ceil(offered / k) <= max_samples
        k = 1
        while math.ceil(offered / k) > max_samples:
            k *= 2
        assert store.stride == k and store.num_offered == offered
        assert store.positions().tolist() == list(range(0, offered, k))
        assert store.all()["w"][:, 0, 0].tolist() == [float(i) for i in range(0, offered, k)]
        assert store.all()["b"][:, 1].tolist() == [-float(i) for i in range(0, offered, k)]
        assert len(store) <= max_samples
        if offered >= max_samples:  # once filled, at least half full
            assert len(store) >= math.ceil(max_samples / 2)
        assert store.nbytes <= max_samples * 8 * 4  # capacity grows by doubling, capped at max_samples


def test_spread_indices():
    assert spread_indices(5, 5).tolist() == [0, 1, 2, 3, 4]
    assert spread_indices(1, 9).tolist() == [4]  # the middle of the chain
    assert spread_indices(3, 9).tolist() == [1, 4, 7]
    assert spread_indices(4, 10).tolist() == [1, 3, 6, 8]
    assert spread_indices(7, 3).tolist() == [0, 1, 2, 0, 1, 2, 0]
    for s, n in [(2, 7), (6, 7), (10, 100), (33, 34)]:
        idx = spread_indices(s, n)
        assert len(set(idx.tolist())) == s and torch.all(idx[1:] > idx[:-1]) and int(idx.max()) < n
    with pytest.raises(ValueError):
        spread_indices(0, 3)


def test_store_dtype_device_and_conversions():
    template = {"w": torch.zeros(4)}
    half = SampleStore(template, max_samples=4, dtype=torch.bfloat16)
    full = SampleStore(template, max_samples=4)
    x = torch.tensor([1.0, 1 / 3, 1e-3, 300.123])
    for s in (half, full):
        s.offer({"w": x})
    assert half.nbytes * 2 == full.nbytes
    assert torch.equal(half.draws([0])["w"][0], x.to(torch.bfloat16))
    out = half.draws([0, 0], dtype=torch.float32)["w"]
    assert out.dtype == torch.float32 and out.shape == (2, 4)
    torch.testing.assert_close(out[0], x, rtol=2**-7, atol=0)  # bfloat16: 8 significant bits
    # fixed device/dtype ignore an enclosing module's moves and casts; None follows them
    holder = nn.Module()
    holder.fixed, holder.follow = half, SampleStore(template, max_samples=4, device=None)
    holder.follow.offer({"w": x})
    holder.double()
    assert half.draws([0])["w"].dtype == torch.bfloat16 and holder.follow.draws([0])["w"].dtype == torch.float64
    holder.to("meta")
    assert half.draws([0])["w"].device.type == "cpu" and holder.follow.all()["w"].device.type == "meta"


def test_store_state_dict_round_trip_with_weights_only():
    store = SampleStore({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, max_samples=6)
    _offer_range(store, 0, 17)
    buffer = io.BytesIO()
    torch.save(store.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    assert state["w"].shape == (len(store), 2, 3)
    fresh = SampleStore({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, max_samples=6)
    fresh.load_state_dict(state)
    assert (fresh.num_stored, fresh.num_offered, fresh.stride) == (store.num_stored, store.num_offered, store.stride)
    assert all(torch.equal(fresh.all()[n], store.all()[n]) for n in ("w", "b"))
    _offer_range(store, 17, 40)
    _offer_range(fresh, 17, 40)  # the reloaded store continues exactly like the original
    assert fresh.positions().tolist() == store.positions().tolist()
    assert all(torch.equal(fresh.all()[n], store.all()[n]) for n in ("w", "b"))
    with pytest.raises(RuntimeError, match="more than max_samples=2"):
        SampleStore({"w": torch.zeros(2, 3), "b": torch.zeros(2)}, max_samples=2).load_state_dict(state)


def test_store_errors():
    with pytest.raises(ValueError, match="max_samples=0 must be an integer >= 1"):
        SampleStore({"w": torch.zeros(1)}, max_samples=0)
    with pytest.raises(ValueError, match="must be a floating torch.dtype"):
        SampleStore({"w": torch.zeros(1)}, dtype=torch.int32)
    store = SampleStore({"w": torch.zeros(2)}, max_samples=3)
    with pytest.raises(ValueError, match="the sample store is empty"):
        store.select(2)
    with pytest.raises(ValueError, match=r"draw\['w'\] has shape \(3,\), the store expects \(2,\)"):
        store.offer({"w": torch.zeros(3)})
    store.clear()
    store.offer({"w": torch.zeros(2)})
    with pytest.raises(IndexError, match=r"draw indices must lie in \[0, 1\)"):
        store.draws([1])


# ---------------------------------------------------------------------- burn_in="auto"
def test_auto_burn_in_is_half_of_the_fit_steps():
    bnn, batches, _ = _small_sgld(thinning=2)  # burn_in="auto" is the default
    batches = batches[:3] + batches[:3] + batches[:1]  # 7 batches per epoch
    bw.fit(bnn, batches, epochs=3, optimizer=bw.optim.SGLD(bnn.parameters(), lr=1e-2, num_data=64), progress=False)
    assert bnn.burn_in == "auto" and bnn.burn_in_steps() == math.floor(0.5 * 7 * 3) == 10
    assert int(bnn.num_steps) == 21 and int(bnn.num_kept) == (21 - 10) // 2 == 5
    # a fit resumed at epoch 2 (its step counter restored) burns in exactly like the whole fit
    resumed, _, _ = _small_sgld(thinning=2)
    resumed.num_steps.fill_(14)
    resumed.before_fit(7, None)
    assert resumed.burn_in_steps() == 10


def test_int_burn_in_still_counts_steps():
    bnn, batches, _ = _small_sgld(burn_in=5, thinning=3)
    bw.fit(bnn, batches, epochs=5, optimizer=bw.optim.SGLD(bnn.parameters(), lr=1e-2, num_data=64), progress=False)
    assert bnn.burn_in_steps() == 5 and int(bnn.num_kept) == (20 - 5) // 3


@pytest.mark.parametrize("value", ["half", -1, 2.5, True, None])
def test_bad_burn_in_names_value_and_accepted_ones(value):
    with pytest.raises(ValueError, match=rf"burn_in={value!r} is not accepted; accepted: 'auto' .*integer >= 0"):
        _small_sgld(burn_in=value)


def test_auto_burn_in_errors():
    bnn, batches, _ = _small_sgld()
    opt = bw.optim.SGLD(bnn.parameters(), lr=1e-2, num_data=64)
    with pytest.raises(ValueError, match="train loader has no len\\(\\); pass burn_in as an integer"):
        bw.fit(bnn, iter(batches), epochs=1, optimizer=opt, progress=False)
    # 8 steps: burn-in 4, then thinning=10 leaves no sample
    with pytest.raises(ValueError, match=r"would keep no sample.*burn_in='auto' \(= 4 steps\) and thinning=10"):
        bw.fit(bnn, batches, epochs=2, optimizer=opt, progress=False)
    # an explicit integer burn-in that leaves none only warns (a fit may be a pure burn-in stage)
    fixed, batches, _ = _small_sgld(burn_in=100)
    with pytest.warns(RuntimeWarning, match="would keep no sample"):
        bw.fit(fixed, batches, epochs=1, optimizer=bw.optim.SGLD(fixed.parameters(), lr=1e-2, num_data=64),
               progress=False)
    # a hand-written loop cannot resolve "auto"
    loose, batches, _ = _small_sgld()
    with pytest.raises(RuntimeError, match="pass burn_in as an integer"):
        loose.after_step()


# ---------------------------------------------------------------------- cyclical SGLD
def _naive_alpha(k, total, cycles, lr0):
    length = math.ceil(total / cycles)
    return lr0 / 2 * (math.cos(math.pi * ((k - 1) % length) / length) + 1)


@pytest.mark.parametrize("total, cycles", [(100, 4), (10, 3), (7, 7), (50, 1), (1000, 6)])
def test_cyclical_step_size_follows_zhang_eq_1(total, cycles):
    for k in sorted({1, 2, total // 3, total // 2, total - 1, total} - {0}):
        assert cyclical_step_size(k, total, cycles, 0.3) == pytest.approx(_naive_alpha(k, total, cycles, 0.3),
                                                                         rel=1e-12, abs=1e-15)
    length = cycle_length(total, cycles)
    starts = [k for k in range(1, total + 1) if cyclical_position(k, total, cycles) == 0]
    assert starts == list(range(1, total + 1, length))  # each cycle restarts at α0
    assert all(cyclical_step_size(k, total, cycles, 0.3) == 0.3 for k in starts)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 0.7, 0.99])
def test_exploration_steps_matches_the_papers_r_below_beta(beta):
    for total, cycles in [(100, 4), (10, 3), (30, 3), (1000, 7)]:
        length = cycle_length(total, cycles)
        naive = sum(1 for p in range(length) if p / length < beta)
        assert exploration_steps(total, cycles, beta) == naive


def test_cyclical_schedule_errors():
    with pytest.raises(ValueError, match="cycles=5 must be <= num_steps=4"):
        cycle_length(4, 5)
    with pytest.raises(ValueError, match="step=11 must be <= num_steps=10"):
        cyclical_step_size(11, 10, 2, 0.1)
    with pytest.raises(ValueError, match="lr0=0 must be a finite number > 0"):
        cyclical_step_size(1, 10, 2, 0)


def test_cyclical_sgld_drives_lr_and_noise_and_samples_only_in_sampling_stages():
    # 2 of 4 layers Bayesian: the point-estimate group has noise_scale 0 throughout
    bnn, batches, _ = _small_sgld(cycles=3, exploration=0.6, thinning=2, params=["2.*"])
    opt = bw.optim.SGLD(bnn.param_groups(lr_head=None), lr=0.05, num_data=64, noise_scale=0.8)
    groups = {g["name"]: g for g in opt.param_groups}
    log, real_step = [], opt.step

    def logging_step(*a, **kw):
        log.append({n: (g["lr"], g["noise_scale"]) for n, g in groups.items()} | {"kept": int(bnn.num_kept)})
        return real_step(*a, **kw)

    opt.step = logging_step
    total, cycles, length = 10 * 4, 3, 14  # 10 epochs of 4 batches in cycles of ⌈40/3⌉ = 14 (14, 14, 12)
    bw.fit(bnn, batches, epochs=10, optimizer=opt, progress=False)
    explore = exploration_steps(total, cycles, 0.6)
    assert explore == 9  # p/14 < 0.6 for p = 0..8
    kept_after = [int(e["kept"]) for e in log[1:]] + [int(bnn.num_kept)]
    for k, entry in enumerate(log, start=1):
        p = (k - 1) % length
        exploring = p < explore
        assert entry["posterior"][0] == pytest.approx(_naive_alpha(k, total, cycles, 0.05), rel=1e-12)
        assert entry["posterior"][1] == (0.0 if exploring else 0.8)
        assert entry["point"] == (entry["posterior"][0], 0.0)
        kept = kept_after[k - 1] - entry["kept"]
        assert kept == (not exploring and (p - explore + 1) % 2 == 0), (k, p)
    # 5 sampling steps per full cycle (p = 9..13 → kept at p = 10, 12) and 3 in the last (p = 9..11 → 10)
    assert int(bnn.num_kept) == 2 + 2 + 1
    # the optimizer gets its own settings back
    assert groups["posterior"]["lr"] == 0.05 and groups["posterior"]["noise_scale"] == 0.8
    assert groups["point"]["noise_scale"] == 0.0 and "sgld_base_lr" not in groups["posterior"]


def test_cyclical_base_step_size_survives_an_optimizer_checkpoint():
    """A resumed fit (model and optimizer state restored) continues the schedule of the original α0."""
    bnn, batches, _ = _small_sgld(cycles=2, thinning=1)
    opt = bw.optim.SGLD(bnn.parameters(), lr=0.05, num_data=64)
    bnn.before_fit(12, opt)  # a 12-step fit, interrupted after 5 steps
    for x, y in (batches * 2)[:5]:
        opt.zero_grad()
        bnn.loss(x, y).loss.backward()
        opt.step()
        bnn.after_step()
    model_state, opt_state = bnn.state_dict(), opt.state_dict()
    resumed, _, _ = _small_sgld(cycles=2, thinning=1)
    resumed.load_state_dict(model_state)
    opt2 = bw.optim.SGLD(resumed.parameters(), lr=0.05, num_data=64)
    opt2.load_state_dict(opt_state)  # its groups hold the cyclical lr of step 6 and the saved base lr
    resumed.before_fit(7, opt2)
    assert opt2.param_groups[0]["lr"] == pytest.approx(_naive_alpha(6, 12, 2, 0.05), rel=1e-12)
    resumed.after_fit(None)
    assert opt2.param_groups[0]["lr"] == 0.05


def test_cyclical_sgld_errors():
    with pytest.raises(ValueError, match="burn_in=10 cannot be combined with cycles=2"):
        _small_sgld(cycles=2, burn_in=10)
    bnn, batches, _ = _small_sgld(cycles=2)
    opt = bw.optim.SGLD(bnn.parameters(), lr=1e-2, num_data=64)
    with pytest.raises(ValueError, match="cycles=2 needs the number of optimizer steps K"):
        bw.fit(bnn, iter(batches), epochs=1, optimizer=opt, progress=False)
    with pytest.raises(ValueError, match="would keep no sample.*cycles=2"):  # 2 cycles of 2 steps, thinning 10
        bw.fit(bnn, batches, epochs=1, optimizer=opt, progress=False)
    with pytest.raises(RuntimeError, match="cyclical schedule is set by before_fit"):
        _small_sgld(cycles=2)[0].after_step()
