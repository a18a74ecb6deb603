"""Memory before work (issue 36): budgets, peak estimates against measured peaks, refusals before allocation.

"Peak" here is the largest number of bytes of tensor storage that an operation allocates and holds at the same
time, above what existed before it started: :class:`bayeswrap.core.memory.PeakTracker` counts every storage a
dispatched operation creates (autograd's backward and vmap's batched kernels included) until it is freed. It is
exact and deterministic on the CPU (no allocator caching, no resident-set noise), so the estimates of
:mod:`bayeswrap.methods.laplace.memory` are held to 25 % of it.
"""

import math
import time
import warnings

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.memory import MemoryBudgetError, PeakTracker, default_budget, format_bytes, parse_budget
from bayeswrap.methods.laplace import curvature
from bayeswrap.methods.laplace import memory as lm


# ---------------------------------------------------------------------- budgets
@pytest.mark.parametrize("value, expected", [
    (4096, 4096), ("4096", 4096), ("2GiB", 2 * 1024**3), ("500MB", 500 * 1000**2), ("1.5 GB", 1_500_000_000),
    ("3kib", 3072), ("10 B", 10), (None, None)])
def test_parse_budget_accepts_bytes_and_units(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize("value", [0, -5, True, 1.5, "2 parsecs", "GiB", "-1MB", "", [1]])
def test_parse_budget_refuses_naming_value_and_forms(value):
    with pytest.raises(ValueError) as err:
        parse_budget(value)
    assert repr(value) in str(err.value) and "'2GiB'" in str(err.value) and "None" in str(err.value)


def test_default_budget_is_the_free_memory():
    budget = default_budget("cpu")
    assert budget > 0
    try:
        import psutil
    except ImportError:
        return
    assert abs(budget - psutil.virtual_memory().available) < 0.2 * budget + 2**28


def test_laplace_refuses_a_bad_budget():
    with pytest.raises(ValueError, match="memory_budget='lots'"):
        bw.wrap(nn.Linear(3, 2), "laplace", num_data=10, memory_budget="lots")


def test_peak_tracker_counts_storage_exactly():
    with PeakTracker() as tracker:
        a = torch.zeros(1000)  # 4000 bytes
        b = torch.zeros(500)  # 2000
        view = a[:10]  # no new storage
        del b
        c = torch.zeros(250)  # 1000: the peak stays 6000
        del a  # the view keeps a's storage
    assert tracker.peak == 6000
    assert tracker.current == 5000 and view.numel() == 10 and c.numel() == 250


# ---------------------------------------------------------------------- estimates against measured peaks
class _Attention(nn.Module):
    """A one-block attention classifier over tokens (Linear layers on (B, T, d): the token rules)."""

    def __init__(self, d=12, vocab=40, k=10):
        super().__init__()
        self.emb, self.qkv, self.ln = nn.Embedding(vocab, d), nn.Linear(d, 3 * d), nn.LayerNorm(d)
        self.ff, self.head = nn.Linear(d, d), nn.Linear(d, k)

    def forward(self, x):
        h = self.emb(x)
        q, k, v = self.qkv(h).chunk(3, -1)
        h = self.ln(h + torch.softmax(q @ k.transpose(1, 2) / 3.5, -1) @ v)
        return self.head(torch.relu(self.ff(h)).mean(1))


ARCHITECTURES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(20, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 10)),
            lambda b: torch.randn(b, 20)),
    "cnn": (lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(8, 12, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                  nn.Linear(48, 10)),
            lambda b: torch.randn(b, 3, 16, 16)),
    "attention": (_Attention, lambda b: torch.randint(0, 40, (b, 12))),
}
BATCH = 64


def _expected_fit(est, fp, batch, chunk):
    """The fit's estimate less what exists before the fit (allocated at construction): the curvature and the
    variances, the dense H of "full", the Kronecker factors of "kron"."""
    before = 2 * fp.num_params * fp.itemsize
    if isinstance(est, lm.FullEstimate):
        before += fp.num_params**2 * fp.itemsize
    elif isinstance(est, lm.KronEstimate):
        before += sum(i * i + o * o for i, o in fp.kron.values()) * fp.itemsize
    return lm.total(est.fit(fp, batch, chunk)) - before


def _fitted(arch, structure, **kwargs):
    make, data = ARCHITECTURES[arch]
    torch.manual_seed(0)
    x, y = data(BATCH), torch.randint(0, 10, (BATCH,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn = bw.wrap(make(), "laplace", num_data=1000, hessian_structure=structure, subset_of_weights="all",
                      **kwargs)
    return bnn, x, y


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_estimates_within_25_percent_of_the_measured_peak(arch, structure):
    bnn, x, y = _fitted(arch, structure)
    fp = lm.probe(bnn, x, getattr(bnn._structure, "layers", {}) or {})
    est = lm.STRUCTURE_ESTIMATES[structure]
    chunk = bnn.curvature_chunk_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with PeakTracker() as fit:
            bnn.fit_curvature([(x, y)])
    expected_fit = _expected_fit(est, fp, BATCH, chunk)
    with PeakTracker() as glm:
        bnn.predict(x, 1)
    expected_glm = lm.total(est.glm(fp, BATCH, chunk))
    print(f"{arch} {structure}: fit {expected_fit} / {fit.peak} = {expected_fit / fit.peak:.2f}; "
          f"GLM {expected_glm} / {glm.peak} = {expected_glm / glm.peak:.2f}")
    assert fit.peak > 0 and glm.peak > 0
    assert abs(expected_fit / fit.peak - 1) <= 0.25
    assert abs(expected_glm / glm.peak - 1) <= 0.25


# ---------------------------------------------------------------------- refusals before allocation
def test_full_100x_over_budget_is_refused_before_allocation():
    """A dense 11,887² matrix (565 MB float32, 2.8 GB with its float64 eigendecomposition) at 1/100 of that."""
    model = nn.Sequential(nn.Linear(100, 110), nn.ReLU(), nn.Linear(110, 7))  # P = 11,117 + ... ≈ 11.9k
    p = sum(t.numel() for t in model.parameters())
    need = p * p * (4 + 8 + 8) + 3 * p * 4  # H, its float64 copy and eigenvectors; the diagonals
    bw.wrap(model, "laplace", num_data=100)  # warm-up: the first wrap imports and compiles what every wrap uses
    start = time.perf_counter()
    with pytest.raises(MemoryBudgetError) as err:
        bw.wrap(model, "laplace", num_data=100, hessian_structure="full", memory_budget=need // 100)
    assert time.perf_counter() - start < 1.0  # the requirement: refused in under a second
    with PeakTracker() as tracker, pytest.raises(MemoryBudgetError):  # the same, counting what it allocates
        bw.wrap(model, "laplace", num_data=100, hessian_structure="full", memory_budget=need // 100)
    assert tracker.peak < 10 * p * 4  # nothing P²-sized: at most a few parameter-sized copies
    message = str(err.value)
    assert format_bytes(need) in message and format_bytes(need // 100) in message
    assert "hessian_structure='diag'" in message and "hessian_structure='kron'" in message
    assert isinstance(err.value, MemoryError) and err.value.estimate == need


def test_fit_100x_over_budget_is_refused_before_the_batch_work():
    """The diagonal GGN of a CNN on one batch, at 1/100 of its estimate: refused after a one-example probe."""
    bnn, x, y = _fitted("cnn", "diag")
    x, y = x.repeat(4, 1, 1, 1), y.repeat(4)  # 256 examples: the batch's work dwarfs the one-example probe
    fp = lm.probe(bnn, x)
    need = lm.total(lm.STRUCTURE_ESTIMATES["diag"].fit(fp, 4 * BATCH, 1))
    bnn.memory_budget = need // 100
    start = time.perf_counter()
    with pytest.raises(MemoryBudgetError) as err:
        bnn.fit_curvature([(x, y)])
    assert time.perf_counter() - start < 1.0
    with PeakTracker() as tracker, pytest.raises(MemoryBudgetError):
        bnn.fit_curvature([(x, y)])
    assert tracker.peak < need // 10  # the probe (one and two examples' forward), not the batch
    message = str(err.value)
    assert "fit_curvature" in message and "batches of 256" in message
    assert format_bytes(need // 100) in message and format_bytes(need) in message
    # nothing fits 1/100: not even the last layer, whose forward alone holds the batch's activations
    assert "no alternative fits" in message
    assert not bool(bnn.curvature_fitted)


def test_default_chunk_is_sized_to_the_budget_with_the_same_curvature():
    bnn, x, y = _fitted("cnn", "diag")
    fp = lm.probe(bnn, x)
    est = lm.STRUCTURE_ESTIMATES["diag"]
    full_chunk, small = lm.total(est.fit(fp, BATCH, 32)), lm.total(est.fit(fp, BATCH, 1))
    assert small < full_chunk
    bnn.fit_curvature([(x, y)])
    reference = {n: t.clone() for n, t in bnn.curvature_diag.items()}
    bnn.memory_budget = (small + full_chunk) // 2  # fits a smaller chunk only
    with PeakTracker() as tracker:
        bnn.fit_curvature([(x, y)])
    assert tracker.peak <= bnn.memory_budget * 1.25
    assert bnn.curvature_chunk_size == 32  # restored after the fit
    for n, t in bnn.curvature_diag.items():
        torch.testing.assert_close(t, reference[n], rtol=1e-5, atol=1e-7)
    bnn.curvature_chunk_size = 31  # the user's own chunk is not changed: refused instead
    bnn.memory_budget = small // 2
    with pytest.raises(MemoryBudgetError, match="curvature_chunk_size=31"):
        bnn.fit_curvature([(x, y)])


def test_draws_over_budget_are_refused():
    bnn, x, y = _fitted("mlp", "diag")
    bnn.fit_curvature([(x, y)])
    p = sum(t.numel() for t in bnn.theta.values())
    bnn.memory_budget = 10 * 3 * p * 4  # ten draws at once
    assert next(iter(bnn.sample(10).values())).shape[0] == 10
    with pytest.raises(MemoryBudgetError, match="1000 posterior draws") as err:
        bnn.sample(1000)
    assert "10 draws at a time" in str(err.value)
    assert not math.isinf(err.value.budget)


@pytest.mark.parametrize("arch", ["cnn", "attention"])
@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_last_layer_estimates_within_25_percent(arch, structure):
    """subset_of_weights="last_layer": no graph through the body; the head's features, Kron factors or dense H."""
    make, data = ARCHITECTURES[arch]
    torch.manual_seed(0)
    x, y = data(BATCH), torch.randint(0, 10, (BATCH,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn = bw.wrap(make(), "laplace", num_data=1000, hessian_structure=structure, subset_of_weights="last_layer")
        fp = lm.probe(bnn, x, getattr(bnn._structure, "layers", {}) or {})
        with PeakTracker() as fit:
            bnn.fit_curvature([(x, y)])
    with PeakTracker() as glm:
        bnn.predict(x, 1)
    est = lm.STRUCTURE_ESTIMATES[structure]
    expected_fit, expected_glm = _expected_fit(est, fp, BATCH, 32), lm.total(est.glm(fp, BATCH, 32))
    print(f"last layer {arch} {structure}: fit {expected_fit / fit.peak:.2f}; GLM {expected_glm / glm.peak:.2f}")
    assert abs(expected_fit / fit.peak - 1) <= 0.25
    assert abs(expected_glm / glm.peak - 1) <= 0.25


@pytest.mark.parametrize("batch", [64, 16])
def test_diagonal_estimate_follows_each_convolution_route(batch):
    """A CNN whose conv weights take the per-layer engine's three routes (per-example gradients in blocks of
    output channels, the weight-gradient kernel with examples as groups, the Gram form over 2×2 positions), with
    one and two vectors per backward pass: the diagonal GGN's fit and GLM estimates within 25 %."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(4), nn.Conv2d(16, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(32, 10))
    x, y = torch.randn(batch, 3, 16, 16), torch.randint(0, 10, (batch,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn = bw.wrap(model, "laplace", num_data=1000, hessian_structure="diag", subset_of_weights="all")
        fp = lm.probe(bnn, x)
        with PeakTracker() as fit:
            bnn.fit_curvature([(x, y)])
    with PeakTracker() as glm:
        bnn.predict(x, 1)
    convs = [ly for ly in fp.layers.values() if ly.kind == "conv"]
    routes = [curvature.conv_weight_route(ly.positions, batch, ly.outputs, ly.inputs, 1, ly.in_channels, ly.weight,
                                          1, 32) for ly in convs]
    assert routes == ["blocks", "kernel", "gram"]
    est = lm.STRUCTURE_ESTIMATES["diag"]
    expected_fit, expected_glm = _expected_fit(est, fp, batch, 32), lm.total(est.glm(fp, batch, 32))
    print(f"conv routes, batch {batch}: fit {expected_fit / fit.peak:.2f}; GLM {expected_glm / glm.peak:.2f}")
    assert abs(expected_fit / fit.peak - 1) <= 0.25
    assert abs(expected_glm / glm.peak - 1) <= 0.25


def test_predicting_batch_after_batch_probes_once():
    bnn, x, y = _fitted("mlp", "diag")
    bnn.fit_curvature([(x, y)])
    first = bnn.__dict__["_memory_footprint"]
    bnn.predict(x, 1)
    bnn.predict(x[:7], 1)
    assert bnn.__dict__["_memory_footprint"] is first  # same per-example shapes: the fit's probe is reused


def test_sample_probs_loader_refuses_what_does_not_fit_after_one_batch():
    """(S, N, K) = (100, 2048, 10) float32 kept and concatenated: 16.4 MB, against a 1 MB budget."""
    bnn, x, y = _fitted("mlp", "diag")
    bnn.fit_curvature([(x, y)])
    data = torch.utils.data.TensorDataset(torch.randn(2048, 20), torch.randint(0, 10, (2048,)))
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    calls = []
    original = bnn.sample_logits
    bnn.sample_logits = lambda *a, **k: calls.append(1) or original(*a, **k)
    with pytest.raises(MemoryBudgetError) as err:
        bw.sample_probs_loader(bnn, loader, 100, memory_budget="1MB")
    assert len(calls) == 1  # refused after the first batch, from len(loader.dataset)
    need = 2 * 100 * 2048 * 10 * 4
    assert err.value.estimate == need and format_bytes(need) in str(err.value)
    assert "num_samples=6" in str(err.value)  # 2 × 6 × 2048 × 10 × 4 = 983,040 bytes ≤ 10⁶
    probs, _ = bw.sample_probs_loader(bnn, loader, 6, memory_budget="1MB")
    assert probs.shape == (6, 2048, 10)


def test_peak_tracker_does_not_count_views_of_older_tensors():
    weight = torch.randn(100, 100)
    with PeakTracker() as tracker:
        transposed = weight.t()  # a view of a storage allocated before the block
        out = torch.randn(3, 100) @ transposed  # 1200 + 1200 bytes
    assert tracker.peak == 2400 and out.shape == (3, 100)


def test_a_registered_structure_estimate_is_listed_among_the_alternatives():
    """A structure plugs in by registering its estimate (as hessian_structure="lowrank" will): refusals list it."""

    @lm.register_structure_estimate("toy")
    class _Toy(lm.StructureEstimate):
        options = ("toy_rank",)

        def stored(self, fp):
            return {"k × P": fp.options["toy_rank"] * fp.num_params * fp.itemsize}

    try:
        model = nn.Sequential(nn.Linear(100, 110), nn.ReLU(), nn.Linear(110, 7))
        bw.methods.laplace.laplace.Laplace.toy_rank = 5
        with pytest.raises(MemoryBudgetError, match=r"hessian_structure='toy' \(232\.17 KiB\)"):
            bw.wrap(model, "laplace", num_data=100, hessian_structure="full", memory_budget="10MB")
    finally:
        del lm.STRUCTURE_ESTIMATES["toy"]
        del bw.methods.laplace.laplace.Laplace.toy_rank


# ---------------------------------------------------------------------- low-rank and subnetwork Laplace
LOWRANK_AND_SUBNETWORK = {
    "lowrank": dict(hessian_structure="lowrank", low_rank=5, low_rank_power_iterations=0),
    "lowrank+diagonal": dict(hessian_structure="lowrank", low_rank=5, low_rank_power_iterations=0,
                             low_rank_diagonal=True),
    "subnetwork/largest_variance": dict(hessian_structure="full", subset_of_weights="subnetwork",
                                        n_params_subnet=300),
    "subnetwork/largest_magnitude": dict(hessian_structure="full", subset_of_weights="subnetwork",
                                         n_params_subnet=300, subnetwork_score="largest_magnitude"),
}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("config", list(LOWRANK_AND_SUBNETWORK))
def test_lowrank_and_subnetwork_estimates_within_25_percent(arch, config):
    """The fit (less what construction allocated), the probit GLM predictive and 50 draws at once, each against
    the measured peak: l = k + 10 columns of curvature products (jvp, vmapped pullbacks) for "lowrank"; chunks of
    per-example Jacobians over the tensors holding a chosen entry for "subnetwork" (all of P_J, not P)."""
    make, data = ARCHITECTURES[arch]
    torch.manual_seed(0)
    x, y = data(BATCH), torch.randint(0, 10, (BATCH,))
    kwargs = {"subset_of_weights": "all", **LOWRANK_AND_SUBNETWORK[config]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn = bw.wrap(make(), "laplace", num_data=1000, **kwargs)
        with PeakTracker() as fit:
            bnn.fit_curvature([(x, y)])
    key = lm.structure_key(bnn)
    assert key == config.split("/")[0].split("+")[0]
    est = lm.STRUCTURE_ESTIMATES[key]
    fp = lm.cached_probe(bnn, x)  # the fit's own probe (after the subnetwork's entries were chosen)
    p, s = fp.num_params, fp.itemsize
    if key == "lowrank":  # constructed: U (P × k), λ, D; the curvature and the variances
        before = (5 + 1) * p * s + 5 * s + 2 * p * s
    else:  # constructed: H (n × n), the int64 indices; the curvature and the variances
        before = 300 * 300 * s + 300 * 8 + 2 * p * s
        touched = sum(bnn.theta[n].numel() for n in bnn._structure.jacobian_names())
        assert fp.options["subnetwork_jacobian_params"] == touched < p or arch == "mlp"
    expected_fit = lm.total(est.fit(fp, BATCH, bnn.curvature_chunk_size)) - before
    with PeakTracker() as glm:
        bnn.predict(x, 1)
    expected_glm = lm.total(est.glm(fp, BATCH, bnn.curvature_chunk_size))
    with PeakTracker() as draws:
        bnn.sample(50)
    expected_draws = lm.total(est.draws(lm.static_footprint(bnn), 50))
    ratios = expected_fit / fit.peak, expected_glm / glm.peak, expected_draws / draws.peak
    print(f"{arch} {config}: fit {ratios[0]:.2f}, GLM {ratios[1]:.2f}, draws {ratios[2]:.2f}")
    for ratio in ratios:
        assert abs(ratio - 1) <= 0.25


def test_subnetwork_estimate_covers_the_touched_tensors_only_once_chosen():
    """Before the entries are chosen the Jacobians are bounded over all P; largest_magnitude knows them from θ*."""
    make, _ = ARCHITECTURES["attention"]
    torch.manual_seed(0)
    model = make()
    kwargs = dict(num_data=100, hessian_structure="full", subset_of_weights="subnetwork", n_params_subnet=300)
    variance = bw.wrap(model, "laplace", **kwargs)
    magnitude = bw.wrap(model, "laplace", **kwargs, subnetwork_score="largest_magnitude")
    assert lm.static_footprint(variance).options["subnetwork_jacobian_params"] is None  # unknown: P
    flat = torch.cat([t.detach().reshape(-1).abs() for t in magnitude.theta.values()])
    top = set(torch.argsort(flat, descending=True)[:300].tolist())
    sizes, start, touched = [t.numel() for t in magnitude.theta.values()], 0, 0
    for size in sizes:  # the naive count: tensors holding one of the 300 largest |θ*|
        touched += size if any(start <= i < start + size for i in top) else 0
        start += size
    assert lm.static_footprint(magnitude).options["subnetwork_jacobian_params"] == touched < sum(sizes)


def test_lowrank_and_subnetwork_100x_over_budget_are_refused_before_allocation():
    """At 1/100 of the smallest chunk's estimate, refused after the probe (a forward of a few examples): k = 10
    low-rank products over a batch of 1024 through the CNN (whose activations nothing else fits either); k = 300
    (the range finder's 4 × P × 310) on a 23.7k-parameter MLP, and a subnetwork's per-example Jacobians (one
    example, K = 500 outputs, over the tensors holding its 50 largest |θ*|: the head's 32.5k entries of 49k),
    where the diagonal fits and is named."""
    torch.manual_seed(0)
    make, data = ARCHITECTURES["cnn"]
    wide = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 500))  # the largest |θ*|: in the head
    configs = [(make(), data(1024), torch.randint(0, 10, (1024,)),
                dict(hessian_structure="lowrank", low_rank=10, subset_of_weights="all")),
               (nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 300)), torch.randn(64, 64),
                torch.randint(0, 300, (64,)), dict(hessian_structure="lowrank", low_rank=300)),
               (wide, torch.randn(64, 256), torch.randint(0, 500, (64,)),
                dict(hessian_structure="full", subset_of_weights="subnetwork", n_params_subnet=50,
                     subnetwork_score="largest_magnitude"))]
    bw.wrap(make(), "laplace", num_data=100)  # warm-up (imports)
    for model, x, y, kwargs in configs:
        bnn = bw.wrap(model, "laplace", num_data=1000, **kwargs)
        est = lm.STRUCTURE_ESTIMATES[lm.structure_key(bnn)]
        bnn.memory_budget = 10**5  # a small budget: the probe measures no products, the forward's sizes stand in
        fp = lm.probe(bnn, x)
        assert not fp.measured
        need = lm.total(est.fit(fp, len(x), 1))  # the smallest chunk
        bnn.memory_budget = need // 100
        start = time.perf_counter()
        with pytest.raises(MemoryBudgetError) as err:
            bnn.fit_curvature([(x, y)])
        assert time.perf_counter() - start < 1.0
        bnn.__dict__.pop("_memory_footprint", None)  # probe again, counting what the refusal allocates
        with PeakTracker() as tracker, pytest.raises(MemoryBudgetError):
            bnn.fit_curvature([(x, y)])
        assert tracker.peak < need // 10
        message = str(err.value)
        assert abs(err.value.estimate / need - 1) < 0.01 and format_bytes(need // 100) in message  # eval-mode probe
        assert "curvature_chunk_size=1" in message and f"batches of {len(x)}" in message
        if len(x) == 1024:
            assert "no alternative fits" in message and "use smaller batches" in message
        else:
            assert "these fit: hessian_structure='diag'" in message
        assert not bool(bnn.curvature_fitted)


def test_lowrank_and_subnetwork_storage_100x_over_budget_name_the_structures_that_fit():
    """At construction: U (P × k) of low_rank=2000, or the dense 5000² of n_params_subnet=5000 with its float64
    eigendecomposition, against 1/100 of it; the diagonal and Kron posteriors fit and are named."""
    model = nn.Sequential(nn.Linear(100, 110), nn.ReLU(), nn.Linear(110, 7))
    p = sum(t.numel() for t in model.parameters())
    for kwargs, need in [(dict(hessian_structure="lowrank", low_rank=2000), (2000 + 1) * p * 4 + 3 * p * 4),
                         (dict(hessian_structure="full", subset_of_weights="subnetwork", n_params_subnet=5000),
                          5000**2 * (4 + 8 + 8) + 3 * p * 4)]:
        start = time.perf_counter()
        with PeakTracker() as tracker, pytest.raises(MemoryBudgetError) as err:
            bw.wrap(model, "laplace", num_data=100, memory_budget=need // 100, **kwargs)
        assert time.perf_counter() - start < 1.0 and tracker.peak < need // 100
        assert err.value.estimate == need
        assert "hessian_structure='diag'" in str(err.value) and "hessian_structure='kron'" in str(err.value)
