"""Per-layer diagonal curvature (bayeswrap.methods.laplace.curvature) against the vmap reference and a per-example loop.

Every model runs in float64 so that the three computations agree to ~1e-10;
the assertions use 1e-6 relative to each tensor's largest entry. The models
cover every rule of :mod:`bayeswrap.methods.laplace.curvature` and every fallback: Linear on
(B, in) and on tokens, Conv1d/Conv2d with stride, padding (also "same" and
non-zero padding modes), dilation, groups and no bias, eval-mode BatchNorm
(followed by an in-place ReLU), LayerNorm, GroupNorm, a class token and a
position embedding used by the parent's forward, a module called twice, tied
weights, a parameter read outside its module, and a custom layer.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayeswrap as bw
import bayeswrap.methods.laplace.curvature as curvature_module
from bayeswrap.methods.laplace.curvature import LayerCurvature
from bayeswrap.methods.laplace.fitting import ggn_vectors, nll_gradient_vectors

DT = torch.float64
CURVATURES = ("empirical_fisher", "fisher", "ggn")

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------- models
class SmallCNN(nn.Module):
    def __init__(self, k=3):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.act = nn.ReLU(inplace=True)  # overwrites bn1's output: the engine must notice
        self.conv2 = nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2, bias=False)
        self.conv3 = nn.Conv2d(6, 6, 3, padding="same", padding_mode="circular", groups=3)
        self.gn = nn.GroupNorm(2, 6)
        self.conv1d = nn.Conv1d(6, 4, 2, stride=2, padding=1, padding_mode="reflect")
        self.bn1d = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4 * 9, k)

    def forward(self, x):
        x = self.act(self.bn1(self.conv1(x)))  # (B, 4, 4, 4)
        x = F.relu(self.conv2(x))
        x = self.gn(self.conv3(x)).tanh()
        x = self.bn1d(self.conv1d(x.flatten(2)))  # (B, 4, 9)
        return self.fc(x.flatten(1))


class TinyViT(nn.Module):
    """Tokens → Linear embedding, class token and position embedding (parent's forward), attention, MLP."""

    def __init__(self, d_in=5, d=8, tokens=3, k=3):
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, d) * 0.5)
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, k)

    def forward(self, x):
        x = self.embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        x = x + self.mlp(self.norm2(x))
        return self.head(x[:, 0])


class Scale(nn.Module):
    """A custom layer with its own parameter: only the per-module vmap rule knows it."""

    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return torch.tanh(x * self.gain) + x


class Shared(nn.Module):
    """A layer called twice, two tied layers, a weight read by the parent, and a custom layer."""

    def __init__(self, d=6, k=3):
        super().__init__()
        self.block = nn.Linear(d, d)
        self.enc = nn.Linear(d, d)
        self.dec = nn.Linear(d, d, bias=False)
        self.dec.weight = self.enc.weight
        self.scale = Scale(d)
        self.side = nn.Linear(d, d)
        self.head = nn.Linear(d, k)

    def forward(self, x):
        x = self.block(torch.relu(self.block(x)))
        x = self.dec(torch.tanh(self.enc(x)))
        x = self.scale(x) + F.linear(x, self.side.weight) * 0.1 + self.side(x)  # side.weight used outside
        return self.head(x)


def mlp(k=3):
    return nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, k))


def _randomise_bn(model):
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.3)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    return model


def _data(model_name, n=5, k=3, gaussian=False):
    g = torch.Generator().manual_seed(1)
    shape = {"mlp": (6,), "cnn": (3, 8, 8), "vit": (3, 5), "shared": (6,)}[model_name]
    x = torch.randn((n, *shape), generator=g, dtype=DT)
    y = torch.randn((n, k), generator=g, dtype=DT) if gaussian else torch.randint(0, k, (n,), generator=g)
    return x, y


def _model(name, k=3):
    torch.manual_seed(0)
    model = {"mlp": lambda: mlp(k), "cnn": lambda: SmallCNN(k), "vit": lambda: TinyViT(k=k),
             "shared": lambda: Shared(k=k)}[name]()
    return _randomise_bn(model).to(DT).eval()


def _wrap(model, backend, curvature, **kw):
    return bw.wrap(model, "laplace", num_data=1, curvature=curvature, curvature_backend=backend,
                   curvature_chunk_size=kw.pop("chunk", 4), **kw)


def _fit(model, x, y, backend, curvature, **kw):
    bnn = _wrap(model, backend, curvature, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the noise-to-signal warning of a random model
        bnn.fit_curvature([(x, y)], generator=torch.Generator().manual_seed(7))
    return bnn, {n: t / (1 / x.shape[0]) for n, t in bnn.curvature_diag.items()}  # undo the N/n = 1/B scale


def _loop_reference(bnn, x, y, curvature):
    """Σ_n of the squared per-example gradients by one autograd call per example (and per output vector)."""
    bnn.eval()  # as fit_curvature: BatchNorm with its running statistics
    theta = {n: t.detach().clone().requires_grad_(True) for n, t in bnn.theta.items()}
    total = {n: torch.zeros_like(t) for n, t in theta.items()}
    for i in range(x.shape[0]):
        f = bnn.forward_with(theta, x[i:i + 1])
        if curvature == "ggn":
            vecs = next(ggn_vectors(bnn.likelihood)(f.detach(), 10**6))[:, 0]  # (K, K)
        else:
            vecs = next(nll_gradient_vectors(bnn.likelihood, [y[i:i + 1]])(f.detach(), 1))[:, 0]
        for v in vecs:
            grads = torch.autograd.grad(f[0], list(theta.values()), v, retain_graph=True, allow_unused=True)
            for n, g in zip(theta, grads):
                if g is not None:
                    total[n] += g.square()
    return total


def _assert_close(a, b, what, rtol=1e-6):
    assert set(a) == set(b)
    for n in a:
        scale = float(b[n].abs().max()) or 1.0
        err = float((a[n] - b[n]).abs().max())
        assert err <= rtol * scale, f"{what}: {n} differs by {err:.3g} (scale {scale:.3g})"


# ---------------------------------------------------------------------- equality with the references
@pytest.mark.parametrize("name", ["mlp", "cnn", "vit", "shared"])
@pytest.mark.parametrize("curvature", CURVATURES)
def test_layers_equal_vmap_and_loop(name, curvature):
    model = _model(name)
    x, y = _data(name)
    fast_bnn, fast = _fit(model, x, y, "layers", curvature)
    _, ref = _fit(model, x, y, "vmap", curvature)
    _assert_close(fast, ref, f"{name}/{curvature} layers vs vmap")
    assert all(float(t.abs().max()) > 0 for t in ref.values())  # every parameter has curvature to compare
    if curvature != "fisher":  # the loop has no sampled labels
        _assert_close(fast, _loop_reference(fast_bnn, x, y, curvature), f"{name}/{curvature} layers vs loop")


def test_routes_use_the_closed_forms():
    """Each parameter takes the rule it should; the fallbacks only where needed."""
    routes = {}
    for name in ("cnn", "vit", "shared"):
        model = _model(name)
        x, y = _data(name)
        bnn, _ = _fit(model, x, y, "layers", "empirical_fisher")
        routes.update({f"{name}:{n}": r for n, r in bnn._layer_curvature.routes.items()})
    expected = {
        "cnn:conv1.weight": "conv", "cnn:conv2.weight": "conv", "cnn:conv3.bias": "conv",
        "cnn:conv1d.weight": "conv", "cnn:bn1.weight": "batchnorm", "cnn:bn1d.bias": "batchnorm",
        "cnn:gn.weight": "groupnorm", "cnn:fc.weight": "linear",
        "vit:embed.weight": "linear", "vit:qkv.weight": "linear", "vit:norm1.weight": "layernorm",
        "vit:cls_token": "module", "vit:pos_embed": "module",  # the root module's own forward
        "shared:block.weight": "linear", "shared:enc.weight": "linear", "shared:scale.gain": "module",
        "shared:side.weight": "network", "shared:side.bias": "linear",
    }
    assert {k: routes[k] for k in expected} == expected


def test_gaussian_likelihood():
    for name in ("mlp", "cnn"):
        model = _model(name, k=2)
        x, y = _data(name, k=2, gaussian=True)
        for curvature in CURVATURES:
            kw = dict(likelihood="gaussian", noise_std=0.7)
            fast_bnn, fast = _fit(model, x, y, "layers", curvature, **kw)
            _, ref = _fit(model, x, y, "vmap", curvature, **kw)
            _assert_close(fast, ref, f"gaussian {name}/{curvature}")
            if curvature == "ggn":
                _assert_close(fast, _loop_reference(fast_bnn, x, y, curvature), f"gaussian {name} loop")


@pytest.mark.parametrize("curvature", CURVATURES)
def test_some_parameters_bayesian(curvature):
    """params= leaves point estimates between Bayesian layers; only the selected ones get curvature."""
    model = _model("cnn")
    x, y = _data("cnn")
    kw = dict(params=["conv2.*", "bn1d.*", "fc.bias"])
    fast_bnn, fast = _fit(model, x, y, "layers", curvature, **kw)
    _, ref = _fit(model, x, y, "vmap", curvature, **kw)
    assert set(fast) == {"conv2.weight", "bn1d.weight", "bn1d.bias", "fc.bias"}
    _assert_close(fast, ref, f"params= {curvature}")
    vit = _model("vit")
    xv, yv = _data("vit")
    kw = dict(params=["pos_embed", "qkv.*", "head.weight"])
    _, fast = _fit(vit, xv, yv, "layers", curvature, **kw)
    _, ref = _fit(vit, xv, yv, "vmap", curvature, **kw)
    _assert_close(fast, ref, f"vit params= {curvature}")


def test_chunking_and_several_vectors_per_backward():
    """Chunks of 1 row and of several output vectors per batched backward give the same sums."""
    model = _model("vit")
    x, y = _data("vit", n=4)
    _, ref = _fit(model, x, y, "vmap", "ggn")
    for chunk in (1, 8, 64):  # 64 // 4 = 16 ≥ K: all vectors in one is_grads_batched backward
        _, fast = _fit(model, x, y, "layers", "ggn", chunk=chunk)
        _assert_close(fast, ref, f"chunk {chunk}")
    _, fast = _fit(model, x, y, "layers", "fisher", curvature_samples=3, chunk=16)
    _, ref = _fit(model, x, y, "vmap", "fisher", curvature_samples=3)
    _assert_close(fast, ref, "fisher with 3 samples")


def test_engine_directly_and_batch_statistics():
    """The engine's own API; BatchNorm with batch statistics couples the examples: Laplace uses the vmap reference."""
    model = _model("cnn")
    x, y = _data("cnn")
    bnn = _wrap(model, "layers", "ggn").eval()
    theta = bnn.theta.as_dict()
    engine = LayerCurvature(bnn.model, list(theta), chunk_size=3)
    sums = engine.squared_grad_sums(bnn.forward_with, theta, x, nll_gradient_vectors(bnn.likelihood, [y]))
    _assert_close(sums, _loop_reference(bnn, x, y, "empirical_fisher"), "engine")
    assert engine.copy_outputs  # the in-place ReLU after bn1 was detected
    bnn.train()
    assert not engine.usable and bnn._layer_engine() is None
    with pytest.raises(ValueError, match="couples the examples"):
        engine.squared_grad_sums(bnn.forward_with, theta, x, nll_gradient_vectors(bnn.likelihood, [y]))
    model.bn1 = nn.BatchNorm2d(4, track_running_stats=False).to(DT)  # batch statistics even in eval mode
    _, fast = _fit(model, x, y, "layers", "ggn")
    _, ref = _fit(model, x, y, "vmap", "ggn")
    _assert_close(fast, ref, "batch statistics")


@pytest.mark.parametrize("name", ["cnn", "vit", "shared"])
def test_glm_functional_variance(name):
    """The per-layer diag(J diag(v) Jᵀ) of the GLM predictive equals the vmap one (categorical and Gaussian)."""
    model = _model(name, k=3)
    for gaussian in (False, True):
        x, y = _data(name, k=3, gaussian=gaussian)
        kw = dict(likelihood="gaussian", noise_std=0.5) if gaussian else {}
        fast_bnn, _ = _fit(model, x, y, "layers", "ggn", chunk=6, **kw)
        ref_bnn = _wrap(model, "vmap", "ggn", **kw)
        ref_bnn.load_state_dict(fast_bnn.state_dict())
        (mu, var), (mu_ref, var_ref) = fast_bnn.functional_moments(x), ref_bnn.functional_moments(x)
        assert mu.shape == var.shape == (x.shape[0], 3)
        _assert_close({"mu": mu, "var": var}, {"mu": mu_ref, "var": var_ref}, f"{name} glm gaussian={gaussian}")
        out, ref = fast_bnn.predict(x), ref_bnn.predict(x)
        _assert_close({"p": out[0] if gaussian else out}, {"p": ref[0] if gaussian else ref}, "predict")


def test_convolutions_with_one_output_position_take_the_linear_closed_form():
    """A conv whose output is 1×1 (a ResNet's last stage on small images) is a Linear on its input patch: the
    curvature and the GLM variance equal the vmap reference, and no per-example gradient is formed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 4, stride=2, padding=1),
                          nn.Tanh(), nn.Conv2d(5, 3, 2), nn.Flatten()).to(DT).eval()  # 4×4 → 2×2 → 1×1
    x = torch.randn(5, 3, 4, 4, dtype=DT, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1, 1, 0])
    calls = []
    original = curvature_module._conv_weight_grads
    try:
        curvature_module._conv_weight_grads = lambda mod, a, d, u=None: (calls.append(mod), original(mod, a, d, u))[1]
        for curvature in ("ggn", "empirical_fisher"):
            fast_bnn, fast = _fit(model, x, y, "layers", curvature)
            _, ref = _fit(model, x, y, "vmap", curvature)
            _assert_close(fast, ref, f"one-position conv/{curvature}")
            assert all(float(t.abs().max()) > 0 for t in ref.values())
        ref_bnn = _wrap(model, "vmap", "ggn")
        ref_bnn.load_state_dict(fast_bnn.state_dict())
        (mu, var), (mu_ref, var_ref) = fast_bnn.functional_moments(x), ref_bnn.functional_moments(x)
        _assert_close({"mu": mu, "var": var}, {"mu": mu_ref, "var": var_ref}, "one-position conv glm")
    finally:
        curvature_module._conv_weight_grads = original
    assert calls and all(mod is not model[4] for mod in calls)  # only the convs with several positions


def test_bad_backend_is_refused():
    with pytest.raises(ValueError, match=r"curvature_backend='jax'.*accepted: \('layers', 'vmap'\)"):
        bw.wrap(mlp(), "laplace", num_data=1, curvature_backend="jax")


# ---------------------------------------------------------------------- real timm models
@pytest.mark.parametrize("arch,kw,curvatures", [
    ("resnet18", {}, ("empirical_fisher", "ggn")),
    ("vit_small_patch16_224", {"img_size": 32}, ("empirical_fisher",)),
])
def test_timm_models(arch, kw, curvatures):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = _randomise_bn(timm.create_model(arch, pretrained=False, num_classes=3, **kw)).to(DT).eval()
    x = torch.randn(2, 3, 32, 32, dtype=DT, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 2])
    for curvature in curvatures:
        fast_bnn, fast = _fit(model, x, y, "layers", curvature, chunk=8)
        _, ref = _fit(model, x, y, "vmap", curvature, chunk=8)
        _assert_close(fast, ref, f"{arch}/{curvature}")
    routes = set(fast_bnn._layer_curvature.routes.values())
    assert "network" not in routes and routes <= {"conv", "batchnorm", "linear", "layernorm", "module"}


# ---------------------------------------------------------------------- the two conv weight rules
class ConvZoo(nn.Module):
    """Every convolution the closed forms take: Conv1d/Conv2d, grouped and depthwise, stride, dilation, padding
    (zeros, "same", reflect, circular), with and without bias, and a Conv3d (the per-module rule)."""

    def __init__(self, k=3):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, stride=2, padding=1)  # 8×8 → 4×4 (L = 16)
        self.dw = nn.Conv2d(6, 6, 3, padding="same", padding_mode="reflect", groups=6, bias=False)  # depthwise
        self.grp = nn.Conv2d(6, 4, 2, dilation=2, groups=2)  # 4×4 → 2×2 (L = 4)
        self.c3d = nn.Conv3d(1, 2, (1, 2, 2))  # on (4, 2, 2) as a volume: (2, 4, 1, 1)
        self.c1d = nn.Conv1d(2, 3, 2, stride=2, padding=1, padding_mode="circular")  # 4 → 3 (L = 3)
        self.fc = nn.Linear(9, k)

    def forward(self, x):
        x = torch.tanh(self.c1(x))
        x = torch.relu(self.dw(x)) + x
        x = torch.tanh(self.grp(x))  # (B, 4, 2, 2)
        x = torch.tanh(self.c3d(x.unsqueeze(1))).reshape(x.shape[0], 2, 4)
        return self.fc(torch.tanh(self.c1d(x)).flatten(1))


@pytest.mark.parametrize("rule", ["gram", "direct", "mixed", "kernel"])
def test_conv_weight_rules_equal_the_loop(monkeypatch, rule):
    """Both conv weight rules (the Gram form of few positions, per-example gradients by bmm) on every kind of
    convolution equal the per-example loop, for the empirical Fisher, the GGN and several vectors per pass;
    "mixed": the 16-position layers switch to the Gram form at the GGN's second pass (256 ≤ 2 (150 + 16));
    "kernel": the ungrouped ones (c1, c1d) by the library's weight-gradient kernel, the batch as groups."""
    cost = {"gram": 10**9, "direct": -10**9, "mixed": 150, "kernel": -10**9}[rule]
    monkeypatch.setattr(curvature_module, "GRAM_ROW_COST", cost)
    monkeypatch.setattr(curvature_module, "GRAM_MEMORY_FACTOR", 10**9)
    if rule == "kernel":
        monkeypatch.setattr(curvature_module, "KERNEL_MIN_POSITIONS", 1)
        monkeypatch.setattr(curvature_module, "KERNEL_MIN_CHANNELS", 1)
    kernel = []
    by_kernel = curvature_module._conv_weight_grads_by_kernel
    monkeypatch.setattr(curvature_module, "_conv_weight_grads_by_kernel",
                        lambda mod, a, d: (kernel.append(mod), by_kernel(mod, a, d))[1])
    grams = []
    original = curvature_module._Sums.gram
    monkeypatch.setattr(curvature_module._Sums, "gram",
                        lambda self, name, call, d: (grams.append(name), original(self, name, call, d))[1])
    torch.manual_seed(0)
    model = ConvZoo().to(DT).eval()
    x = torch.randn(5, 3, 8, 8, dtype=DT, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 2, 1, 1, 0])
    for curvature, chunk in (("empirical_fisher", 4), ("ggn", 4), ("ggn", 15)):  # 15 // 5: 3 vectors per pass
        bnn, fast = _fit(model, x, y, "layers", curvature, chunk=chunk)
        _assert_close(fast, _loop_reference(bnn, x, y, curvature), f"{rule}/{curvature}/chunk {chunk}")
        assert all(float(t.abs().max()) > 0 for t in fast.values())
        routes = bnn._layer_curvature.routes
        assert routes["c3d.weight"] == "module" and routes["c1d.weight"] == routes["dw.weight"] == "conv"
    expected = set() if rule in ("direct", "kernel") else {"c1.weight", "dw.weight", "grp.weight", "c1d.weight"}
    assert set(grams) == expected
    seen = {(type(m).__name__, m.in_channels, m.out_channels) for m in kernel}  # the wrapped model's copies
    assert seen == ({("Conv2d", 3, 6), ("Conv1d", 2, 3)} if rule == "kernel" else set())


def test_gram_form_in_float32():
    """The Gram form's float32 sums (cancelling products of positions) stay within 1e-6 of the float64 loop on a
    layer shaped like a ResNet's last stage (4 positions, 64 → 64 channels)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(256, 10)).eval()
    x = torch.randn(8, 16, 2, 2, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    bnn, fast = _fit(model, x, y, "layers", "empirical_fisher", chunk=8)
    assert bnn._layer_curvature.routes["2.weight"] == "conv"
    ref_bnn = _wrap(copy.deepcopy(model).to(DT), "layers", "empirical_fisher")
    ref = _loop_reference(ref_bnn, x.to(DT), y, "empirical_fisher")
    _assert_close({n: t.double() for n, t in fast.items()}, ref, "float32 Gram")


@pytest.mark.parametrize("curvature", CURVATURES)
def test_fit_runs_one_forward_per_batch(curvature):
    """fit_curvature's log-likelihood reuses the engine's recorded forward: one forward per batch, the same
    log-likelihood and curvature as the vmap reference."""
    model = _model("cnn")
    x, y = _data("cnn")
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        fast_bnn = _wrap(model, "layers", curvature)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            fast_bnn.fit_curvature([(x, y)], generator=torch.Generator().manual_seed(7))  # finds the in-place ReLU
            calls.clear()
            fast_bnn.fit_curvature([(x, y)], generator=torch.Generator().manual_seed(7))
        assert len(calls) == 1
        fast = {n: t * x.shape[0] for n, t in fast_bnn.curvature_diag.items()}
        ref_bnn, ref = _fit(model, x, y, "vmap", curvature)
    finally:
        handle.remove()
    _assert_close(fast, ref, f"one forward/{curvature}")
    assert torch.allclose(fast_bnn.train_log_likelihood, ref_bnn.train_log_likelihood, rtol=1e-12)
    engine = fast_bnn._layer_curvature
    assert engine._captured is None  # consumed by the curvature pass


@pytest.mark.parametrize("kernel,dilation,padding,stride", [
    ((3, 3), (1, 1), (1, 1), (1, 1)), ((7, 7), (1, 1), (3, 3), (2, 2)), ((2, 3), (2, 1), (0, 2), (1, 3)),
    ((1, 1), (1, 1), (0, 0), (2, 2))])
def test_unfold_equals_torch(kernel, dilation, padding, stride):
    a = torch.randn(2, 3, 9, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(curvature_module._unfold(a, kernel, dilation, padding, stride),
                       F.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride))


def test_gram_form_memory_bound():
    """The Gram form is refused where its factors (B·L(L+1)/2·(out + C·kk)) exceed GRAM_MEMORY_FACTOR times the
    per-example rows of a pass, however many vectors would pay for it (a GGN with many outputs)."""
    conv = nn.Conv2d(64, 64, 3, padding=1)
    call = curvature_module._Call(conv, "conv", {"weight": "w"}, (torch.zeros(1),), {}, None)
    few, many = torch.zeros(1, 32, 64, 2, 2), torch.zeros(1, 32, 64, 32, 32)  # L = 4 and L = 1024
    assert curvature_module._gram_cheaper(call, few, 1, 32)
    assert not curvature_module._gram_cheaper(call, many, 10**6, 32)  # cheaper, but 32·524,800·640 elements
    assert not curvature_module._gram_cheaper(call, many, 1, 32)  # 1024² > 64 + 1024
