"""Dense and Kronecker-factored Laplace posteriors, and the last-layer selection (Daxberger et al. 2021).

:class:`~bayeswrap.Laplace` takes laplace-torch's two names for what is
approximated:

* ``subset_of_weights``: ``"all"`` (every parameter that ``params`` selects) or
  ``"last_layer"``: the weight and bias of the classifier, found by
  :func:`find_last_layer`. The last layer's input φ (B, D) is recorded by a
  forward hook, so that its per-example Jacobian is the closed form
  J_n = [I_K ⊗ φ_nᵀ, I_K] (weight row-major, then bias) and nothing before the
  head is differentiated.
* ``hessian_structure``: ``"diag"`` (:mod:`bayeswrap.methods.laplace.laplace`),
  ``"full"`` (:class:`FullPosterior`) or ``"kron"`` (:class:`KronPosterior`).

All structures have the posterior precision P = H + δ I, with H the data term
(GGN, Monte Carlo GGN or empirical Fisher, as the ``curvature`` option says)
and δ the scalar prior precision. Both H's here are kept eigendecomposed,
H = Q diag(λ) Qᵀ, so that for any δ

    log det P = Σ_i log(λ_i + δ),
    P^{-1} = Q diag(1/(λ + δ)) Qᵀ,     P^{-1/2} ε = Q diag((λ + δ)^{-1/2}) Qᵀ ε,

and changing δ (:meth:`~bayeswrap.Laplace.optimize_prior_precision`) costs no
new factorisation: the marginal likelihood only needs λ (Immer et al. 2021,
eq. 6; MacKay 1992). An eigendecomposition is used instead of a Cholesky factor
for that reason (one O(P³) factorisation for all δ, against one per δ).

Full (Daxberger et al. 2021, §3.2 "full"): H = (N/n) Σ_n J_nᵀ Λ_n J_n (exact
GGN, Λ_n = diag(p_n) − p_n p_nᵀ for the categorical likelihood, I/σ² for the
Gaussian), or Σ_n g_n g_nᵀ (empirical Fisher, g_n the gradient at the observed
label; ``"fisher"``: at sampled labels). Limited to :data:`MAX_FULL_PARAMS`
Bayesian parameters (a P × P matrix).

Kron (KFAC; Martens & Grosse 2015, eqs. 1–3; Ritter et al. 2018, eq. 6): for
each ``nn.Linear`` layer with input a and output z, as laplace-torch's
backends (Curvlinops, BackPACK, ASDL) all do, the weight and the bias are two
blocks,

    H_W ≈ G ⊗ A,   H_b ≈ G,    A = (1/n) Σ_n a_n a_nᵀ,   G = (N/n) Σ_n Σ_m δ_{n,m} δ_{n,m}ᵀ,

with δ_{n,m} = ∂(s_{n,m}ᵀ f_n)/∂z_n the backpropagated output vectors: the K
columns s of a factor of Λ_n for the GGN (so G sums over classes), the NLL
gradient at the observed (or sampled) label for the (empirical) Fisher. The
weight's index is (output, input), row-major as in ``weight.flatten()``. With
A = Q_A diag(a) Q_Aᵀ and G = Q_G diag(g) Q_Gᵀ, the weight block's precision is
(Q_G ⊗ Q_A) diag(g ⊗ a + δ) (Q_G ⊗ Q_A)ᵀ: laplace-torch's ``KronDecomposed``
without damping. Inputs with extra dims (tokens) are flattened into examples
(KFAC "expand": A averages over the examples and the T shared positions,
A = (1/(nT)) Σ_{n,t} a aᵀ, while G sums over them). ``nn.Conv2d`` (groups 1,
numeric zero padding) is the same with a_{n,t} the unfolded input patch of
output position t (C·kh·kw values, ``torch.nn.functional.unfold``) and δ_{n,t}
the output gradient at t (Grosse & Martens 2016, eqs. 9–11, KFC with the
"expand" convention of laplace-torch's Curvlinops backend). A Bayesian
parameter outside these layers keeps a diagonal block (the diagonal curvature
of the ``curvature`` option), with a warning.

A Linear applied more than once per forward (a shared layer) is refused for
``"kron"`` with a ValueError; use ``"diag"`` there.

GLM predictive (Immer et al. 2021, eq. 7): f_lin ~ N(f(x; θ*), J P^{-1} Jᵀ). The
probit link uses its diagonal; for Kron it is Σ over blocks of
Σ_{ij} (Q_Gᵀ δ_k)_i² (Q_Aᵀ a)_j² / (g_i a_j + δ) for examples without token
dims, computed from the backpropagated unit vectors δ_k without forming J.

References:
    E. Daxberger, A. Kristiadi, A. Immer, R. Eschenhagen, M. Bauer, P. Hennig
    2021, "Laplace Redux — effortless Bayesian deep learning", NeurIPS.
    J. Martens, R. Grosse 2015, "Optimizing neural networks with Kronecker-factored
    approximate curvature", ICML. R. Grosse, J. Martens 2016, "A Kronecker-factored
    approximate Fisher matrix for convolution layers", ICML.
    H. Ritter, A. Botev, D. Barber 2018, "A scalable Laplace approximation for
    neural networks", ICLR.
    A. Immer, M. Korzepa, M. Bauer 2021, "Improving predictions of Bayesian neural
    nets via local linearization", AISTATS.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.func import jacrev

from bayeswrap.core.batches import batch_size, take, unsqueeze
from bayeswrap.core.functional import find_last_layer, last_layer_params, vmap_over_examples  # noqa: F401 (re-exported)
from bayeswrap.methods.laplace.curvature import _backward

HESSIAN_STRUCTURES = ("diag", "kron", "full", "lowrank")  # "lowrank": methods/laplace/lowrank.py
#: a prior precision: one δ for every parameter, or ``{name: δ}`` per Bayesian parameter tensor ("layerwise")
Delta = float | Mapping[str, float]
SUBSETS_OF_WEIGHTS = ("all", "last_layer", "subnetwork")  # "subnetwork": methods/laplace/subnetwork.py
#: ``hessian_structure="full"`` stores a P × P matrix: at most this many Bayesian parameters (3.2 GB in float64)
MAX_FULL_PARAMS = 20_000
# ---------------------------------------------------------------------- capture of layer inputs and output gradients
class LinearCapture:
    """Records the inputs a and outputs z of chosen ``nn.Linear`` / ``nn.Conv2d`` modules of the storage-free model.

    A Conv2d's input is stored as its unfolded patches, (B, L, C·kh·kw), and
    :meth:`pullback` returns its output gradients as (M, B, L, out), so that
    both are handled as a Linear layer over L tokens.

    Args:
        modules: ``{layer name: module}`` (modules of the model that
            ``forward`` evaluates).
        detach_input: when True (the last layer), the body is not differentiated:
            the layer's output is recomputed from its detached input.
    """

    def __init__(self, modules: Mapping[str, nn.Module], detach_input: bool = False):
        self.modules = dict(modules)
        self.detach_input = detach_input

    def run(self, forward, x) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """``f = forward(x)`` with grad enabled, and ``{layer: (a, z)}`` (z requires grad; a detached)."""
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        handles = []

        def make_hook(name):
            def hook(module, args, output):
                if name in seen:
                    raise ValueError(f"layer {name!r} runs more than once per forward; hessian_structure='kron' "
                                     "and the last-layer features need one call per layer; accepted: "
                                     "hessian_structure='diag'")
                a = args[0].detach()
                if isinstance(module, nn.Conv2d):  # patches as tokens: (B, L, C·kh·kw)
                    a = nn.functional.unfold(a, module.kernel_size, module.dilation, module.padding,
                                             module.stride).transpose(1, 2)
                if self.detach_input:
                    with torch.enable_grad():
                        z = nn.functional.linear(a, module.weight.detach(),
                                                 None if module.bias is None else module.bias.detach())
                        z.requires_grad_(True)
                    seen[name] = (a, z)
                    return z
                if not output.requires_grad:
                    output.requires_grad_(True)
                seen[name] = (a, output)
                return None
            return hook

        try:
            for name, m in self.modules.items():
                handles.append(m.register_forward_hook(make_hook(name)))
            with torch.enable_grad():
                f = forward(x)
        finally:
            for h in handles:
                h.remove()
        missing = [n for n in self.modules if n not in seen]
        if missing:
            raise ValueError(f"layers {missing} did not run in the forward pass; hessian_structure='kron' and "
                             "subset_of_weights='last_layer' need every Bayesian layer to be used")
        return f, seen

    @staticmethod
    def pullback(f: torch.Tensor, seen, vectors: torch.Tensor) -> dict[str, torch.Tensor]:
        """δ = ∂(vᵀ f)/∂z for every recorded layer, ``{layer: (M, *z.shape)}`` (zeros where z does not reach f)."""
        names = list(seen)
        grads = _backward(f, [seen[n][1] for n in names], vectors)
        out = {}
        for n, g in zip(names, grads):
            z = seen[n][1]
            g = g if g is not None else torch.zeros(vectors.shape[0], *z.shape, dtype=z.dtype, device=z.device)
            if z.dim() == 4 and seen[n][0].dim() == 3:  # Conv2d: (M, B, out, H, W) → (M, B, L, out)
                g = g.flatten(3).transpose(2, 3)
            out[n] = g
        return out


def kron_layer(module: nn.Module) -> bool:
    """Whether ``hessian_structure="kron"`` has Kronecker factors for a module: ``nn.Linear``, and ``nn.Conv2d``
    with groups=1, zero padding given as numbers (Grosse & Martens 2016, unfolded patches).
    """
    if isinstance(module, nn.Linear):
        return True
    return (type(module) is nn.Conv2d and module.groups == 1 and module.padding_mode == "zeros"
            and not isinstance(module.padding, str))


def _flat_rows(a: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattens token dims into examples (KFAC "expand"): a (B, ..., in) → (B·T, in), δ (M, B, ..., out) → (M, B·T, out)."""
    return a.reshape(-1, a.shape[-1]), d.reshape(d.shape[0], -1, d.shape[-1])


# ---------------------------------------------------------------------- full
class _Structure(nn.Module):
    """Buffers of a structured curvature (saved in the state dict) and its cached eigendecomposition.

    Attributes:
        fitted: 0-d bool buffer, set once :class:`~bayeswrap.Laplace` has fitted the curvature.
    """

    def __init__(self):
        super().__init__()
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))
        self._cache = None
        self.num_decompositions = 0

    def _apply(self, fn, *args, **kwargs):  # .to(), .double(), ...: the decomposition is recomputed
        self._cache = None
        return super()._apply(fn, *args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._cache = None
        super()._load_from_state_dict(*args, **kwargs)

    def decomposition(self):
        if self._cache is None:
            self._cache = self._decompose()
            self.num_decompositions += 1  # keys caches derived from this decomposition
        return self._cache


class FullPosterior(_Structure):
    """P = H + δ I with a dense H over the flattened Bayesian parameters (in ``shapes`` order).

    Args:
        shapes: ``{name: shape}`` of the Bayesian parameters, in order.
        dtype, device: of H.

    Attributes:
        H: the (P, P) buffer (the sum of outer products while fitting, then scaled by N/n).

    Raises:
        ValueError: if there are more than :data:`MAX_FULL_PARAMS` parameters.
    """

    def __init__(self, shapes: Mapping[str, torch.Size], dtype, device):
        super().__init__()
        self.shapes = dict(shapes)
        self.sizes = [int(torch.Size(s).numel()) for s in self.shapes.values()]
        total = sum(self.sizes)
        if total > MAX_FULL_PARAMS:
            raise ValueError(f"hessian_structure='full' stores a P × P matrix and accepts at most {MAX_FULL_PARAMS} "
                             f"Bayesian parameters; this model has P = {total}; accepted: hessian_structure='kron' or "
                             "'diag', or fewer parameters (subset_of_weights='last_layer' or params=[...])")
        self.num_params = total
        self.register_buffer("H", torch.zeros(total, total, dtype=dtype, device=device))

    def reset(self):
        self.H.zero_()
        self._cache = None

    def add_rows(self, rows: torch.Tensor) -> None:
        """H += Rᵀ R for per-(vector, example) gradient rows R (R, P)."""
        self.H.addmm_(rows.t(), rows)

    def add_features(self, a: torch.Tensor, d: torch.Tensor, bias: bool, rows_per_chunk: int = 1 << 22) -> None:
        """Last layer: H += Σ_n C_n ⊗ ã_n ã_nᵀ with ã = [a, 1] and C_n = Σ_m δ_{m,n} δ_{m,n}ᵀ.

        The per-(vector, example) gradient of a linear head is δ ⊗ ã, so
        Σ_{m,n} (δ ⊗ ã)(δ ⊗ ã)ᵀ = Σ_n C_n ⊗ ã_n ã_nᵀ: K²·D̃²·B operations instead
        of the M·B·P² of the Jacobian rows. Accumulated in (output, input)
        order; :meth:`finish` permutes to the parameters' order (weight
        row-major, then bias).

        Args:
            a: the head's inputs, (B, D).
            d: the curvature vectors pulled back to the head's output, (M, B, K).
            bias: whether the head's bias is Bayesian (ã has the appended 1).
            rows_per_chunk: bounds the (chunk, K², D̃) temporary.
        """
        a = _with_ones(a) if bias else a
        batch, dim = a.shape
        k = d.shape[-1]
        c = torch.einsum("mbo,mbp->bop", d, d).reshape(batch, k * k)
        step = max(1, rows_per_chunk // max(1, k * k * dim))
        for s in range(0, batch, step):
            x = (c[s:s + step, :, None] * a[s:s + step, None, :]).reshape(-1, k * k * dim)
            part = (x.t() @ a[s:s + step]).reshape(k, k, dim, dim).permute(0, 2, 1, 3).reshape(k * dim, k * dim)
            self.H.add_(part)
        self._feature_order = _feature_order(k, dim, bias, a.device)

    def feature_variance(self, a: torch.Tensor, d: torch.Tensor, bias: bool, delta: Delta) -> torch.Tensor:
        """Last layer: diag(J P^{-1} Jᵀ) with J_n = δ_n ⊗ ã_n, (K', B) for unit vectors pulled back, d (K', B, K)."""
        a = _with_ones(a) if bias else a
        dim, k = a.shape[1], d.shape[-1]
        order = _feature_order(k, dim, bias, a.device)
        vecs, lam = self.factor(delta)
        q = torch.empty_like(vecs)
        q[order] = vecs  # rows in (output, input) order
        t = torch.einsum("bi,kip->bkp", a, q.reshape(k, dim, -1))  # (B, K, P)
        jq = torch.einsum("jbk,bkp->jbp", d, t)
        return (jq.square() / lam).sum(-1)

    def finish(self, scale: float) -> None:
        """H ← (N/n) H, symmetrised (and permuted to the parameters' order after :meth:`add_features`)."""
        order = getattr(self, "_feature_order", None)
        if order is not None:
            self.H.copy_(self.H[order][:, order])
            self._feature_order = None
        self.H.mul_(scale)
        self.H.copy_(0.5 * (self.H + self.H.t()))
        self._cache = None

    def _decompose(self):
        return psd_eigh(self.H)

    @property
    def eigvals(self) -> torch.Tensor:
        return self.decomposition()[0]

    @property
    def eigvecs(self) -> torch.Tensor:
        return self.decomposition()[1]

    def eigenvalues(self) -> torch.Tensor:
        """The eigenvalues λ of H, float64 (P,)."""
        return self.eigvals.double()

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """(..., P) → ``{name: (..., *shape)}``."""
        parts = torch.split(flat, self.sizes, dim=-1)
        return {n: p.reshape(*flat.shape[:-1], *s) for (n, s), p in zip(self.shapes.items(), parts)}

    def _decomposition_key(self) -> int:
        self.decomposition()
        return self.num_decompositions

    def prior_diagonal(self, delta: Delta) -> torch.Tensor:
        """δ over the flattened parameters, (P,): each parameter's entry of δ (a scalar, or one per tensor)."""
        if not isinstance(delta, Mapping):
            return torch.full((self.num_params,), float(delta), dtype=self.H.dtype, device=self.H.device)
        return torch.cat([torch.full((size,), float(delta[n]), dtype=self.H.dtype, device=self.H.device)
                          for n, size in zip(self.shapes, self.sizes)])

    def precision(self, delta: Delta) -> torch.Tensor:
        """P = H + diag(δ), (P, P)."""
        return self.H + torch.diag(self.prior_diagonal(delta))

    def factor(self, delta: Delta) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q, μ) with P = Q diag(μ) Qᵀ: H's eigenvectors and λ + δ for a scalar δ (no new factorisation);
        for one δ per tensor, the eigendecomposition of H + diag(δ), cached for the last δ.
        """
        if not isinstance(delta, Mapping) or len(set(delta.values())) == 1:
            value = next(iter(delta.values())) if isinstance(delta, Mapping) else delta
            return self.eigvecs, self.eigvals + value
        key = (tuple(float(delta[n]) for n in self.shapes), self._decomposition_key())
        cached = getattr(self, "_factor_cache", None)
        if cached is None or cached[0] != key:  # H + diag(δ) ⪰ min δ · I: as psd_eigh, clamped to that bound
            lam, vecs = psd_eigh(self.precision(delta))
            self._factor_cache = (key, vecs, lam.clamp_min(min(float(v) for v in delta.values())))
        return self._factor_cache[1], self._factor_cache[2]

    def marginal_variances(self, delta: Delta) -> dict[str, torch.Tensor]:
        """diag(P^{-1}) = (Q ⊙ Q) (1/μ), ``{name: tensor}``."""
        vecs, lam = self.factor(delta)
        return self._split(vecs.square() @ (1.0 / lam))

    def sample_deltas(self, count: int, generator, delta: Delta) -> dict[str, torch.Tensor]:
        """``count`` draws of θ − θ* = P^{-1/2} ε, ``{name: (count, *shape)}``."""
        eps = torch.randn(count, self.num_params, generator=generator, dtype=self.H.dtype, device=self.H.device)
        q, lam = self.factor(delta)
        return self._split(((eps @ q) * lam.rsqrt()) @ q.t())

    def functional_variance(self, jac: torch.Tensor, delta: Delta) -> torch.Tensor:
        """diag(J P^{-1} Jᵀ) per example and output: J (B, K, P) → (B, K)."""
        q, lam = self.factor(delta)
        return ((jac @ q).square() / lam).sum(-1)


# ---------------------------------------------------------------------- kron
class KronPosterior(_Structure):
    """Per Kron layer (:func:`kron_layer`), H_W ≈ G ⊗ A and H_b ≈ G; other parameters keep a diagonal h.

    Args:
        layers: ``{layer name: (weight name, bias name or None)}``.
        diag_names: the Bayesian parameters outside those layers.
        shapes: ``{name: shape}`` of every Bayesian parameter (in order).
        dtype, device: of the factors.

    Attributes:
        A, G: ``{layer name: factor}``, (in, in) and (out, out) buffers
            (saved as ``A_i``/``G_i``, i the layer's position).
        h: ``{name: diagonal curvature}`` of the parameters outside the Kron layers.
    """

    def __init__(self, layers: Mapping[str, tuple[str, str | None]], diag_names: Iterable[str],
                 shapes: Mapping[str, torch.Size], dtype, device):
        super().__init__()
        self.layers = dict(layers)
        self.diag_names = list(diag_names)
        self.shapes = dict(shapes)
        for i, w in enumerate(w for w, _ in self.layers.values()):
            out, inp = self.shapes[w][0], torch.Size(self.shapes[w][1:]).numel()
            self.register_buffer(f"A_{i}", torch.zeros(inp, inp, dtype=dtype, device=device))
            self.register_buffer(f"G_{i}", torch.zeros(out, out, dtype=dtype, device=device))
        for i, n in enumerate(self.diag_names):
            self.register_buffer(f"h_{i}", torch.zeros(self.shapes[n], dtype=dtype, device=device))

    @property
    def A(self) -> dict[str, torch.Tensor]:
        return {layer: getattr(self, f"A_{i}") for i, layer in enumerate(self.layers)}

    @property
    def G(self) -> dict[str, torch.Tensor]:
        return {layer: getattr(self, f"G_{i}") for i, layer in enumerate(self.layers)}

    @property
    def h(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, f"h_{i}") for i, n in enumerate(self.diag_names)}

    @property
    def decomposed(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``{layer: (g, Q_G, a, Q_A)}``, the eigendecompositions of the factors."""
        return self.decomposition()

    def reset(self):
        for t in self.buffers():
            t.zero_()
        self._cache = None

    def add(self, seen, deltas, inputs: bool = True) -> None:
        """Adds Σ a aᵀ and Σ δ δᵀ of one batch (``seen``: {layer: (a, z)}, ``deltas``: {layer: (M, *z.shape)}).

        ``inputs=False`` adds the δ δᵀ only: a further chunk of the same batch's output vectors.
        """
        for layer in self.layers:
            tokens = seen[layer][0].shape[1:-1].numel()  # KFAC "expand": A averages over the shared positions
            a, d = _flat_rows(seen[layer][0], deltas[layer])
            a, d = a.to(self.A[layer].dtype), d.to(self.G[layer].dtype)  # a bf16 layer's rows into the fp32 factors
            if inputs:
                self.A[layer].addmm_(a.t(), a, alpha=1.0 / tokens)
            d = d.reshape(-1, d.shape[-1])
            self.G[layer].addmm_(d.t(), d)

    def finish(self, num_seen: int, scale: float, h: Mapping[str, torch.Tensor]) -> None:
        """A /= n, G *= N/n (so that G ⊗ A = (N/n) Σ ..., laplace-torch's convention), h set."""
        for a, g in zip(self.A.values(), self.G.values()):
            a.copy_(0.5 * (a + a.t()) / num_seen)
            g.copy_(0.5 * (g + g.t()) * scale)
        for n, t in self.h.items():
            t.copy_(h[n])
        self._cache = None

    def _decompose(self):
        out = {}
        for layer, a, g in zip(self.layers, self.A.values(), self.G.values()):
            la, qa = psd_eigh(a)
            lg, qg = psd_eigh(g)
            out[layer] = (lg, qg, la, qa)
        return out

    def eigenvalues(self) -> torch.Tensor:
        """The eigenvalues of H, all blocks, as one float64 vector."""
        return torch.cat(list(self.block_eigenvalues().values()))

    def block_eigenvalues(self) -> dict[str, torch.Tensor]:
        """``{name: the eigenvalues of H's block of that parameter}``, float64 vectors (H is block-diagonal over
        the parameters: weight G ⊗ A, bias G, the rest diagonal).
        """
        out = {}
        for layer, (w, b) in self.layers.items():
            lg, _, la, _ = self.decomposed[layer]
            out[w] = torch.outer(lg, la).flatten().double()
            if b is not None:
                out[b] = lg.double()
        out.update({n: self.h[n].flatten().double() for n in self.diag_names})
        return {n: out[n] for n in self.shapes}

    def marginal_variances(self, delta: Delta) -> dict[str, torch.Tensor]:
        """diag(P^{-1}) per parameter: (Q_G ⊙ Q_G) [1/(g aᵀ + δ)] (Q_A ⊙ Q_A)ᵀ for a weight."""
        out = {}
        for layer, (w, b) in self.layers.items():
            lg, qg, la, qa = self.decomposed[layer]
            inv = 1.0 / (torch.outer(lg, la) + delta_of(delta, w))
            out[w] = (qg.square() @ inv @ qa.square().t()).reshape(self.shapes[w])
            if b is not None:
                out[b] = qg.square() @ (1.0 / (lg + delta_of(delta, b)))
        for n in self.diag_names:
            out[n] = 1.0 / (self.h[n] + delta_of(delta, n))
        return out

    def sample_deltas(self, count: int, generator, delta: Delta) -> dict[str, torch.Tensor]:
        """``count`` draws of θ − θ* = P^{-1/2} ε per block (laplace-torch's ``bmm(·, exponent=-0.5)``)."""
        out = {}
        for layer, (w, b) in self.layers.items():
            lg, qg, la, qa = self.decomposed[layer]
            eps = torch.randn(count, *self.shapes[w], generator=generator, dtype=qg.dtype, device=qg.device)
            rot = qg.t() @ eps.reshape(count, len(lg), len(la)) @ qa
            out[w] = (qg @ (rot * (torch.outer(lg, la) + delta_of(delta, w)).rsqrt()) @ qa.t()).reshape(eps.shape)
            if b is not None:
                eps = torch.randn(count, *self.shapes[b], generator=generator, dtype=qg.dtype, device=qg.device)
                out[b] = ((eps @ qg) * (lg + delta_of(delta, b)).rsqrt()) @ qg.t()
        for n in self.diag_names:
            h = self.h[n]
            eps = torch.randn(count, *self.shapes[n], generator=generator, dtype=h.dtype, device=h.device)
            out[n] = eps * (h + delta_of(delta, n)).rsqrt()
        return {n: out[n] for n in self.shapes}

    def functional_variance(self, seen, deltas, delta: Delta) -> torch.Tensor:
        """Σ over the Kron blocks of diag(J_l P_l^{-1} J_lᵀ), (K, B) for the K unit vectors' δ (K, B, ..., out)."""
        total = None
        for layer, (w, b) in self.layers.items():
            lg, qg, la, qa = self.decomposed[layer]
            a, d = seen[layer][0].to(qa.dtype), deltas[layer].to(qg.dtype)  # a bf16 layer's rows, fp32 factors
            inv = 1.0 / (torch.outer(lg, la) + delta_of(delta, w))
            if a.dim() == 2:  # J_k = δ_k aᵀ: the rotation separates
                dt, at = (d @ qg).square(), (a @ qa).square()  # (K, B, out), (B, in)
                var = torch.einsum("kbo,oi,bi->kb", dt, inv, at)
            else:  # tokens: per-example gradient Σ_t δ_t a_tᵀ, rotated
                g = torch.einsum("kbto,bti->kboi", d.reshape(d.shape[0], d.shape[1], -1, d.shape[-1]),
                                 a.reshape(a.shape[0], -1, a.shape[-1]))
                var = ((qg.t() @ g @ qa).square() * inv).sum((-2, -1))
            if b is not None:
                db = d.reshape(d.shape[0], d.shape[1], -1, d.shape[-1]).sum(2)
                var = var + ((db @ qg).square() / (lg + delta_of(delta, b))).sum(-1)
            total = var if total is None else total + var
        return total


def psd_eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition ``(λ, Q)`` of a symmetric positive semi-definite matrix, in float64, eigenvalues ≥ 0.

    The curvatures here (H of ``"full"``, the Kronecker factors A and G) are sums of outer products, so every
    eigenvalue is ≥ 0; ``torch.linalg.eigh`` returns those of a (near) null space as ±ε·λ_max, in float32 down
    to about −1e-7 · λ_max. At a small prior precision δ that breaks the posterior twice: a negative λ makes
    λ + δ ≤ 0, hence negative posterior and functional variances (NaN from the probit link's square root and
    from the draws' rsqrt: last-layer Kron at δ = 1e-4 on a ReLU network, whose dead units leave A singular),
    and a positive rounding error of 1e-7 · λ_max in place of 0 changes 1/(λ + δ) by orders of magnitude for
    δ ≲ 1e-5 · λ_max. So the decomposition is computed in float64 (rounding ~1e-16 · λ_max) and the eigenvalues
    are clamped at 0, as laplace-torch's ``symeig`` clamps them; both are returned in ``matrix``'s dtype (the
    eigenvectors' float32 rounding mixes a null direction into the others by ~1e-7, whose square is
    negligible against 1/δ).

    Args:
        matrix: (P, P), symmetric positive semi-definite up to rounding.

    Returns:
        ``(λ (P,) ≥ 0, Q (P, P))`` in ``matrix``'s dtype, ascending as ``torch.linalg.eigh``.
    """
    lam, vecs = torch.linalg.eigh(matrix.double())
    return lam.clamp_min(0).to(matrix.dtype), vecs.to(matrix.dtype)


def delta_of(delta: Delta, name: str) -> float:
    """The prior precision of parameter ``name``: δ itself, or its entry of a per-tensor ``{name: δ}``."""
    return float(delta[name]) if isinstance(delta, Mapping) else delta


def _with_ones(a: torch.Tensor) -> torch.Tensor:
    """[a, 1], (B, D + 1)."""
    return torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype, device=a.device)], 1)


def _feature_order(k: int, dim: int, bias: bool, device) -> torch.Tensor:
    """For each parameter of a head (weight (K, D) row-major, then bias (K,)), its (output, input) position."""
    pos = torch.arange(k * dim, device=device).reshape(k, dim)
    if not bias:
        return pos.flatten()
    return torch.cat([pos[:, :-1].flatten(), pos[:, -1]])


# ---------------------------------------------------------------------- Jacobians for the full structure

def network_jacobian(forward, theta: Mapping[str, torch.Tensor], x, chunk: int) -> torch.Tensor:
    """Per-example Jacobians of the flattened outputs with respect to ``theta``: (B, K, P), in ``theta`` order.

    ``torch.func.jacrev`` under ``vmap`` over examples, ``chunk`` examples at a
    time (used by ``hessian_structure="full"`` over more than the last layer,
    where P ≤ :data:`MAX_FULL_PARAMS`).
    """
    theta = {n: t.detach() for n, t in theta.items()}

    def one(x1):
        def f(th):
            return forward(th, unsqueeze(x1)).reshape(-1)
        jac = jacrev(f)(theta)
        return torch.cat([jac[n].reshape(jac[n].shape[0], -1) for n in theta], dim=-1)

    count = batch_size(x)  # inputs may be a tensor, or a tuple or mapping of tensors
    return torch.cat([vmap_over_examples(one)(take(x, slice(s, s + chunk))) for s in range(0, count, chunk)])
