"""Peak-memory estimates of the Laplace curvature fit and predictives, checked against ``memory_budget``.

Before :meth:`~bayeswrap.Laplace.fit_curvature` (or the GLM predictive, or sampled draws) allocates its large
tensors, it estimates its peak from sizes it can know without running the batch: the number of Bayesian parameters
P, their element size s (bytes), the outputs per example K, the batch size B, ``curvature_chunk_size`` c, and what
one example costs in a forward pass, measured once on one and on two examples (:func:`probe`; forwards with
autograd whose saved tensors are counted by :class:`~bayeswrap.core.memory.PeakTracker`, kept on the model for
inputs of the same shapes). All estimates are in bytes, and each is the largest sum of what is alive at once (of
phases that run one after the other, the larger):

* per-example gradients / Jacobian rows (``curvature_backend="vmap"``, ``"full"`` over all weights): c × P × s per
  chunk of rows (c × K × P × s for the ``jacrev`` Jacobians of ``"full"``, plus their product with the curvature
  vectors);
* the per-layer engine (``"layers"``, the default): the batch's autograd graph B × a₁ (a₁ the probe's saved bytes
  per example), the m·B rows of output vectors pulled back to every layer (m = min(M, max(1, c // B)) vectors per
  backward pass, M = K for the GGN), per-example weight gradients of token layers, c × |W| × s, and the
  convolutions' work by the route :func:`~bayeswrap.methods.laplace.curvature.conv_weight_route` gives each weight
  in each pass (:func:`_conv_work`): every layer's unfolded patches B × C·kk × L × s kept from the second pass on,
  per-example gradients in blocks of output channels, the weight-gradient kernel's c × m × |W| (its internal
  scratch is not counted), or the Gram form's B × out × L² factors and, after the last pass, their contraction
  with the patches' pairs, 2 × B × C·kk × L(L+1)/2;
* Kronecker factors: Σ_l (in_l² + out_l²) × s stored, and their eigendecompositions;
* the dense matrix of ``"full"``: P² × s stored, and its eigendecomposition in float64 (a float64 copy and the
  eigenvectors: 2 × 8 P² more; :func:`~bayeswrap.methods.laplace.structures.psd_eigh`);
* the diagonal: P × s for the curvature, its accumulator and the variances;
* low rank (``"lowrank"``, :class:`LowRankEstimate`): U (P × k) stored, the range finder's 4 × P × l (l = k + 10),
  and per chunk of c ≤ l columns the vmapped forward-mode products and pullbacks of the curvature products, whose
  bytes per column and example the probe measures (:meth:`StructureEstimate.measure`: on 2 and 4 examples with 2
  and 4 columns);
* subnetwork (``subset_of_weights="subnetwork"``, :class:`SubnetEstimate`): n² × s stored, its eigendecomposition,
  and the per-example Jacobians over the P_J entries of the tensors holding a chosen entry (P, an upper bound,
  until the entries are chosen), measured by the probe on 2 and 4 examples;
* the GLM predictive's Jacobians: c × K × P × s per chunk (full), K unit vectors × B × the layers' outputs (Kron,
  diagonal);
* draws of ``pred_type="nn"``, of the GLM's Monte Carlo link and of :meth:`~bayeswrap.BayesianModel.sample`:
  3–4 × S_c × P × s per chunk of S_c draws (ε, its rotation and scaling, θ* + δ; low rank: 3 × S_c × P × s and the
  thin SVD of its P × k factor; subnetwork: 2 × S_c × P × s, the deltas scattered into the parameters). The forward passes of those draws
  are not estimated (``chunk_size`` bounds them); the (S, N, K) probabilities of
  :func:`~bayeswrap.predictive.sample_probs_loader` are checked there.

Not measured against a peak in the tests: the ``"vmap"`` backend (within 25 % on the MLP and CNN, +29 % / +44 % on
the attention model, fit / GLM), the Monte Carlo GLM link (forward-mode tangents escape the tracker).

A structure registers its estimates in :data:`STRUCTURE_ESTIMATES` (a name → :class:`StructureEstimate`), so that a
new one (``"lowrank"``) plugs in with :func:`register_structure_estimate` and is listed among the alternatives of a
refusal. The tests (``tests/test_memory_budget.py``) hold each estimate (the fit and the probit GLM predictive, every
structure, all weights and the last layer; low rank with and without its diagonal and the subnetwork by both scores,
with their draws) within 25 % of the measured peak of tensor storage on an MLP, a CNN and an attention model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from bayeswrap.core.batches import batch_size, take, tensor_leaves
from bayeswrap.core.memory import PeakTracker, check_budget, halvings, largest_fitting, resolve_budget
from bayeswrap.methods.laplace.curvature import conv_block_channels, conv_weight_route

#: bytes of float64, the dtype of the eigendecompositions (psd_eigh)
_F64 = 8
#: ``Laplace``'s default ``curvature_chunk_size``; at this value the chunk is sized to the budget (halved until it fits)
DEFAULT_CHUNK = 32


@dataclass
class LayerSize:
    """A module owning Bayesian parameters, seen by :func:`probe` on one example.

    Attributes:
        kind: ``"linear"``, ``"conv"`` or ``"other"``.
        params: its Bayesian entries (weight and bias).
        weight: entries of its weight (0 if not Bayesian).
        inputs: features per position (a Conv's C·kh·kw patch, a Linear's in).
        outputs: output channels / features per position.
        positions: output positions per example (tokens, a Conv's L; 1 for a Linear on (B, in)).
        output_bytes: bytes of its output per example.
        input_bytes: bytes of its input per example.
        groups: a Conv's groups (1 otherwise).
        in_channels: a Conv's input channels C (0 otherwise).
    """

    kind: str
    params: int
    weight: int
    inputs: int
    outputs: int
    positions: int
    output_bytes: int
    input_bytes: int = 0
    groups: int = 1
    in_channels: int = 0


@dataclass
class Footprint:
    """Sizes the estimates read (bytes per example where it says so).

    Attributes:
        num_params: P, the Bayesian parameters.
        itemsize: s, bytes per parameter entry.
        outputs: K, outputs per example.
        vectors: M, curvature vectors per example (``"ggn"``: K; ``"fisher"``: ``curvature_samples``; else 1).
        graph: bytes a forward with autograd keeps per example (saved tensors and outputs).
        largest: bytes of the largest single tensor of that forward, per example.
        constant: bytes a forward keeps whatever the batch size (temporaries of the parameters' size).
        forward_peak: bytes per example at the peak of that forward (what a forward without a graph through the
            body, the last layer's, holds at most).
        largest_tensor: entries of the largest Bayesian parameter tensor.
        layers: ``{module name: LayerSize}`` for the modules owning Bayesian parameters.
        kron: ``{layer: (in, out)}`` of the Kronecker factors (``"kron"``).
        diag_rest: Bayesian entries outside the Kron layers.
        backend: ``curvature_backend``.
        last_layer: whether only the last layer is Bayesian (then ``head`` is (D̃, K), D̃ = D + 1 with a bias).
        head: the last layer's (input features incl. the bias column, outputs).
        options: the structures' own options, ``{attribute: value}`` (:attr:`StructureEstimate.options`).
        measured: what the model's own structure measured on one and two examples
            (:meth:`StructureEstimate.measure`; empty for a :func:`static_footprint`), ``{term: bytes}``.
    """

    num_params: int
    itemsize: int
    outputs: int
    vectors: int
    graph: int
    largest: int
    constant: int = 0
    forward_peak: int = 0
    largest_tensor: int = 0
    layers: dict[str, LayerSize] = field(default_factory=dict)
    kron: dict[str, tuple[int, int]] = field(default_factory=dict)
    diag_rest: int = 0
    backend: str = "layers"
    last_layer: bool = False
    head: tuple[int, int] = (0, 0)
    options: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)


# ---------------------------------------------------------------------- the registry
class StructureEstimate:
    """Peak-memory estimates of one ``hessian_structure``, bytes; subclass and register with
    :func:`register_structure_estimate`. Each method returns ``{term: bytes}``, whose sum is the peak.

    A structure with options of its own names them in :attr:`options` (attributes of the Laplace model); their
    values reach the estimates as ``fp.options``. A low-rank structure, for instance::

        @register_structure_estimate("lowrank")
        class LowRankEstimate(StructureEstimate):
            options = ("lowrank_rank",)

            def stored(self, fp):  # k eigenpairs (and the optional diagonal remainder)
                k = fp.options["lowrank_rank"]
                return {"eigenvectors (k × P)": k * fp.num_params * fp.itemsize,
                        "diagonal (curvature, variances)": 3 * fp.num_params * fp.itemsize}

    and its constructor calls :func:`check_stored` before allocating; :meth:`fit`, :meth:`glm` and :meth:`draws`
    default to the diagonal's (override them with the structure's own work).
    """

    #: attributes of the Laplace model this structure's estimates read (``fp.options``)
    options: tuple[str, ...] = ()
    #: how a refusal names this structure among the alternatives (``{name}``: its registered name)
    label: str = "hessian_structure={name!r}"
    #: whether it is also an alternative over the last layer only
    last_layer_alternative: bool = True

    def read_options(self, bnn) -> dict:
        """``{option: value}`` of this structure's :attr:`options` on a Laplace model (None where unset); a structure
        may add values derived from the model (the subnetwork: the tensors its Jacobians cover).
        """
        return {a: getattr(bnn, a, None) for a in self.options}

    def measure(self, bnn, x, fp: Footprint) -> dict[str, float]:
        """Peaks (bytes) of this structure's own batched work measured on a few examples of ``x`` under a
        :class:`~bayeswrap.core.memory.PeakTracker`, called by :func:`probe` (``fp``: its footprint so far) for the
        model's structure only. The estimates fall back on the forward's sizes without them (a refusal's
        alternatives, or where the measurement itself would take over a quarter of the budget: then nothing is
        measured).
        """
        return {}

    def stored(self, fp: Footprint) -> dict[str, int]:
        """What the fitted posterior keeps (allocated at construction or by the fit)."""
        return {"diagonal (curvature, variances)": 3 * fp.num_params * fp.itemsize}

    def fit(self, fp: Footprint, batch: int, chunk: int) -> dict[str, int]:
        """The peak of :meth:`~bayeswrap.Laplace.fit_curvature` on batches of ``batch`` examples."""
        return {**self.stored(fp), **_diagonal_work(fp, batch, chunk, fp.vectors)}

    def glm(self, fp: Footprint, batch: int, chunk: int) -> dict[str, int]:
        """The peak of the probit / Gaussian GLM predictive (the functional variances) on ``batch`` examples."""
        return _diagonal_work(fp, batch, chunk, fp.outputs, sums=False)

    def draws(self, fp: Footprint, count: int) -> dict[str, int]:
        """``count`` draws θ_s = θ* + P^{-1/2} ε at once (a chunk of ``pred_type="nn"`` or of ``sample``)."""
        return {"draws (ε, scaled, θ* + δ)": 3 * count * fp.num_params * fp.itemsize}


#: ``{hessian_structure: StructureEstimate}``; a structure registers itself with :func:`register_structure_estimate`
STRUCTURE_ESTIMATES: dict[str, StructureEstimate] = {}


def register_structure_estimate(name: str) -> Callable[[type], type]:
    """Class decorator: registers a :class:`StructureEstimate` subclass under a ``hessian_structure`` name."""

    def decorate(cls: type) -> type:
        STRUCTURE_ESTIMATES[name] = cls()
        return cls

    return decorate


register_structure_estimate("diag")(StructureEstimate)


@register_structure_estimate("kron")
class KronEstimate(StructureEstimate):
    """KFAC: the factors Σ_l (in_l² + out_l²) s, the pulled-back vectors M × B × outputs, and the rest diagonal."""

    def stored(self, fp):
        factors = sum(i * i + o * o for i, o in fp.kron.values()) * fp.itemsize
        return {"Kronecker factors": factors, "diagonal (curvature, variances)": 3 * fp.num_params * fp.itemsize}

    def _decomposition(self, fp):
        """psd_eigh of the largest factor: its float64 copy and eigenvectors, and their cast back."""
        largest = max((max(i, o) for i, o in fp.kron.values()), default=0)
        return {"eigendecomposition (float64)": largest * largest * (2 * _F64 + fp.itemsize)}

    def fit(self, fp, batch, chunk):
        s = fp.itemsize
        if fp.last_layer:
            d, k = fp.head
            work = _larger({"forward (no graph through the body)": batch * fp.forward_peak},
                           {"pulled-back vectors": 2 * fp.vectors * batch * k * s + batch * d * s})
        else:
            rows = fp.vectors * batch
            pulled = sum(ly.positions * ly.outputs for n, ly in fp.layers.items() if n in fp.kron) * s
            inputs = sum(ly.positions * ly.inputs for n, ly in fp.layers.items() if n in fp.kron) * s
            # a convolution's δ arrives transposed, (M, B, L, out): flattening it for G copies one layer's at a time
            conv = max((ly.positions * ly.outputs for n, ly in fp.layers.items() if n in fp.kron and ly.kind == "conv"),
                       default=0)
            work = {"autograd graph": batch * fp.graph + fp.constant,
                    "pulled-back vectors": rows * (pulled + 3 * fp.largest // 2),
                    "layer inputs": batch * inputs, "a convolution's δ rows for G": rows * conv * s}
        rest = {}
        if fp.diag_rest:
            rest = _diagonal_work(fp, batch, chunk, fp.vectors)
        return {**self.stored(fp), **_larger(_larger(work, rest), self._decomposition(fp))}

    def glm(self, fp, batch, chunk):
        s = fp.itemsize
        k = fp.outputs
        if fp.last_layer:
            d, _ = fp.head
            return _larger({"forward (no graph through the body)": batch * fp.forward_peak},
                           {"unit vectors pulled back": 3 * k * batch * k * s + batch * d * s})
        pulled = sum(ly.positions * ly.outputs for n, ly in fp.layers.items() if n in fp.kron) * s
        # per layer, one at a time: token layers' per-example gradients (K, B, out, in) and their rotation; a layer
        # on (B, in): the rotated, squared δ (K, B, out) twice and einsum's (K, B, in) intermediate
        per_layer = max((k * batch * (2 * ly.weight if ly.positions > 1 else 2 * ly.outputs + ly.inputs) * s
                         for n, ly in fp.layers.items() if n in fp.kron), default=0)
        parts = {"autograd graph": batch * fp.graph + fp.constant,
                 "unit vectors pulled back": k * batch * (pulled + 3 * fp.largest // 2),
                 "per-layer variances": per_layer}
        if fp.diag_rest:  # after the Kron blocks: the diagonal blocks' variances
            return _larger(parts, _diagonal_work(fp, batch, chunk, k, sums=False))
        return parts

    def draws(self, fp, count):
        return {"draws (ε, rotated, scaled)": 4 * count * fp.num_params * fp.itemsize}


@register_structure_estimate("full")
class FullEstimate(StructureEstimate):
    """Dense H: P² s stored, its float64 eigendecomposition, and c × K × P Jacobian chunks."""

    def stored(self, fp):
        p = fp.num_params
        return {"dense matrix P²": p * p * fp.itemsize, "diagonal (curvature, variances)": 3 * p * fp.itemsize}

    def _decomposition(self, fp):
        """psd_eigh(H): H's float64 copy and LAPACK's float64 eigenvectors (their cast back comes after the copy
        is freed); a float64 H is not copied.
        """
        p = fp.num_params
        copy = 0 if fp.itemsize == _F64 else p * p * _F64  # .double() of a float64 matrix is the matrix itself
        return {"eigendecomposition (float64 copy, eigenvectors)": copy + p * p * _F64}

    def fit(self, fp, batch, chunk):
        p, s, k = fp.num_params, fp.itemsize, fp.outputs
        if fp.last_layer:
            d, _ = fp.head
            step = max(1, min(batch, (1 << 22) // max(1, k * k * d)))
            work = _larger({"forward (no graph through the body)": batch * fp.forward_peak},
                           {"head terms": batch * (k * k + d) * s, "feature chunk": step * k * k * d * s,
                            "outer products": 2 * p * p * s})
        else:
            c = min(chunk, batch)
            work = {"Jacobians (c × K × P)": 2 * c * k * p * s, "Jacobian rows (M·c × P)": fp.vectors * c * p * s,
                    "vmapped backward": c * k * fp.graph}
        return {**self.stored(fp), **_larger(work, self._decomposition(fp))}

    def glm(self, fp, batch, chunk):
        p, s, k = fp.num_params, fp.itemsize, fp.outputs
        if fp.last_layer:
            return _larger({"forward (no graph through the body)": batch * fp.forward_peak},
                           {"eigenvectors (reordered, and permuted by einsum)": 2 * p * p * s,
                            "J Q (B × K × P), squared, scaled": 4 * batch * k * p * s})
        c = min(chunk, batch)
        return {"Jacobians (c × K × P), J Q and its square": 3 * c * k * p * s, "vmapped backward": c * k * fp.graph}

    def draws(self, fp, count):
        return {"draws (ε, ε Q, scaled, rotated back)": 4 * count * fp.num_params * fp.itemsize}


@register_structure_estimate("lowrank")
class LowRankEstimate(StructureEstimate):
    """Low rank (:mod:`bayeswrap.methods.laplace.lowrank`), bytes; l = min(k + 10, P) columns, c = min(chunk, l).

    * stored: U (P × k) and D, the curvature and the variances;
    * the fit: the range finder's basis, running product, pass sum and its scaled copy (4 × P × l), and one
      :func:`~bayeswrap.methods.laplace.lowrank.curvature_product` at a time: the batch's autograd graph (its
      ``vjp``), then per chunk of c columns the larger of the vmapped forward-mode products (``jvp``) and the
      vmapped pullbacks (with their c × P gradients), and the earlier chunks' columns (l − c) × P; with
      ``low_rank_diagonal`` the diagonal's work (:func:`_diagonal_work`) in the same pass, after the product;
    * the GLM: 1/a (P), the diagonal variances' work, then per chunk of c ≤ k columns of C their tangents
      (c × P) and the vmapped ``jvp``; the factor C (P × k) is computed by the fit and cached, so it is not
      counted (a prior precision changed since adds about 3 × P × k);
    * draws: ε, its projection and the scaled draw (3 × S × P) and the thin SVD of C (2 × P × k).

    The ``jvp`` and pullback per column and example are measured by :meth:`measure` (:attr:`Footprint.measured`);
    without them (a refusal's alternatives, or a measurement over a quarter of the budget), the forward's graph per
    example stands for each (then 0.68–0.88 of the measured fit's peak and 0.70–1.10 of the GLM's on the tests'
    three architectures: an estimate, not a bound).
    """

    options = ("low_rank", "low_rank_diagonal")

    def measure(self, bnn, x, fp):
        """The vmapped ``jvp`` and pullback of c columns on B examples at (c, B) = (2, 2), (2, 4), (4, 4) (fewer
        examples when ``x`` has fewer), each fitted as κ + B·α + c·B·β (bytes; the pullback's c × P gradients
        apart): at one column or one example other kernels run, so those are not measured.
        """
        from torch.func import jvp, vjp, vmap

        small, large = (2, 4) if batch_size(x) >= 4 else (1, min(2, batch_size(x)))
        if max(self._jvp(fp, large, 4), self._pullback(fp, large, 4)) + large * fp.graph > budget_of(bnn) / 4:
            return {}
        theta = {n: t.detach() for n, t in bnn.theta.items()}
        grads = sum(t.numel() * t.element_size() for t in theta.values())
        peaks = {}
        for c, count in ((2, small), (2, large), (4, large)):
            xb = take(x, slice(0, count))
            forward = lambda th, xb=xb: bnn.forward_with(th, xb)  # noqa: E731
            tangents = {n: torch.ones(c, *t.shape, dtype=t.dtype, device=t.device) for n, t in theta.items()}
            with torch.enable_grad():
                with PeakTracker() as tracker:
                    vmap(lambda t: jvp(forward, (theta,), (t,))[1])(tangents)
                peaks["jvp", c, count] = tracker.peak
                f, pullback = vjp(forward, theta)
                cot = torch.ones(c, *f.shape, dtype=f.dtype, device=f.device)
                with PeakTracker() as tracker:
                    vmap(pullback)(cot)
                peaks["pullback", c, count] = tracker.peak - c * grads  # the gradients are counted apart
            del f, pullback
        out = {}
        for what in ("jvp", "pullback"):
            p1, p2, p3 = peaks[what, 2, small], peaks[what, 2, large], peaks[what, 4, large]
            per = max(0.0, (p3 - p2) / (2 * large))  # β: per column and example
            base = 0.0 if large == small else (p2 - p1) / (large - small) - 2 * per  # α: per example
            out[f"{what} per column and example"] = per
            out[f"{what} per example"] = base
            out[f"{what} fixed"] = p1 - small * (base + 2 * per)  # κ
        return out

    def _columns(self, fp) -> int:
        from bayeswrap.methods.laplace.lowrank import OVERSAMPLING

        return min(int(fp.options["low_rank"]) + OVERSAMPLING, fp.num_params)

    def _rank(self, fp) -> int:
        return min(int(fp.options["low_rank"]), fp.num_params)

    @staticmethod
    def _jvp(fp, batch, c) -> int:
        """The peak of c vmapped forward-mode products on a batch, bytes."""
        m = fp.measured
        if "jvp per column and example" not in m:
            return batch * (fp.forward_peak + c * fp.graph)
        return max(0, int(m["jvp fixed"] + batch * (m["jvp per example"] + c * m["jvp per column and example"])))

    @staticmethod
    def _pullback(fp, batch, c) -> int:
        """The peak of c vmapped pullbacks through a batch's graph, with their c × P gradients, bytes."""
        m = fp.measured
        grads = c * fp.num_params * fp.itemsize
        if "pullback per column and example" not in m:
            return grads + c * batch * fp.graph
        return grads + max(0, int(m["pullback fixed"] + batch * (m["pullback per example"]
                                                                  + c * m["pullback per column and example"])))

    def stored(self, fp):
        p, k, s = fp.num_params, self._rank(fp), fp.itemsize
        return {"eigenvectors U (P × k) and D": (k + 1) * p * s, "diagonal (curvature, variances)": 3 * p * s}

    def fit(self, fp, batch, chunk):
        p, s, cols = fp.num_params, fp.itemsize, self._columns(fp)
        c = min(max(1, chunk), cols)
        vectors = max(1, fp.vectors)
        # jv (c, B, K) stays alive: with the coefficients (c, M, B) and cotangents (c, B, K) beside the pullbacks
        per_chunk = max(self._jvp(fp, batch, c),
                        self._pullback(fp, batch, c) + c * batch * (vectors + 2 * fp.outputs) * s)
        work = {"range finder: basis, product, pass sum, scaled (4 × P × l)": 4 * p * cols * s,
                "autograd graph (vjp)": batch * fp.graph + fp.constant,
                "output-space vectors": vectors * batch * fp.outputs * s,
                "earlier chunks' columns ((l − c) × P)": (cols - c) * p * s,
                "vmapped jvp or pullbacks (c columns)": per_chunk}
        if fp.options.get("low_rank_diagonal"):  # the exact diagonal, after the first pass's product
            work = _larger(work, {"basis and product (2 × P × l)": 2 * p * cols * s,
                                  **_diagonal_work(fp, batch, chunk, fp.vectors)})
        return {**self.stored(fp), **work}

    def glm(self, fp, batch, chunk):
        p, s, k = fp.num_params, fp.itemsize, self._rank(fp)
        c = min(max(1, chunk), k)
        products = {"tangents of c columns of C (c × P)": c * p * s,
                    "vmapped jvp (c columns)": self._jvp(fp, batch, c),
                    "(J c_j)² and their sum": 2 * c * batch * fp.outputs * s}
        return {"1/a (P)": p * s, **_larger(_diagonal_work(fp, batch, chunk, fp.outputs, sums=False), products)}

    def draws(self, fp, count):
        p, s, k = fp.num_params, fp.itemsize, self._rank(fp)
        return {"draws (ε, projected, scaled)": 3 * count * p * s, "thin SVD of C (P × k)": 2 * p * k * s}


@register_structure_estimate("subnetwork")
class SubnetEstimate(FullEstimate):
    """Subnetwork (:mod:`bayeswrap.methods.laplace.subnetwork`), bytes: a dense n × n matrix over the
    ``n_params_subnet`` chosen entries (and its float64 eigendecomposition), and per chunk of c examples the
    per-example Jacobians (c × K × P_J) over the P_J entries of the tensors holding a chosen entry
    (:meth:`~bayeswrap.methods.laplace.subnetwork.SubnetPosterior.jacobian_names`), while the previous chunk's are
    still alive (batches larger than c); then their products with the curvature vectors (M·c × P_J) or the
    GLM's J_S Q. Choosing by ``"largest_variance"`` first runs the diagonal's fit.

    P_J is known once the entries are chosen (after :meth:`~bayeswrap.methods.laplace.subnetwork.SubnetPosterior.prepare`,
    so for the fit's batches and the GLM; for ``"largest_magnitude"`` from θ* even before the fit); until then
    (e.g. at construction, or a refusal's alternatives) it is P, an upper bound. The Jacobians' cost per example is
    measured by :meth:`measure` over those tensors on two and four examples; without it (entries not chosen yet,
    or the measurement over a quarter of the budget), 2 × K × P_J plus the vmapped backward K × the forward's graph
    per example (with P_J known: +1 % of the measured peak on the MLP and CNN, +21 % on the attention model, whose
    backward allocates less than its graph).
    """

    options = ("n_params_subnet", "subnetwork_score")
    label = "subset_of_weights='subnetwork', hessian_structure='full', n_params_subnet={n}"
    last_layer_alternative = False

    def read_options(self, bnn):
        out = super().read_options(bnn)
        out["subnetwork_jacobian"] = out["subnetwork_jacobian_params"] = None
        if getattr(bnn, "subset_of_weights", None) != "subnetwork" or not hasattr(bnn, "theta"):
            return out
        structure = getattr(bnn, "_structure", None)
        names = structure.touched() if hasattr(structure, "touched") else None
        given = getattr(structure, "scores", None) is not None
        if names is None and bnn.subnetwork_score == "largest_magnitude" and not given and bnn.n_params_subnet:
            from bayeswrap.methods.laplace.subnetwork import top_indices

            theta = bnn.theta
            flat = torch.cat([t.detach().reshape(-1).abs() for t in theta.values()])
            chosen = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
            chosen[top_indices(flat, min(int(bnn.n_params_subnet), flat.numel()))] = True
            parts = torch.split(chosen, [t.numel() for t in theta.values()])
            names = tuple(n for n, m in zip(theta.keys(), parts) if bool(m.any()))
        out["subnetwork_jacobian"] = names
        if names is not None:
            out["subnetwork_jacobian_params"] = sum(bnn.theta[n].numel() for n in names)
        return out

    def measure(self, bnn, x, fp):
        """``network_jacobian`` over the :meth:`read_options` tensors on 2 and 4 examples (1 and 2 for smaller
        batches), fitted as fixed + c × per example, bytes; nothing before the entries are chosen (the bound over
        all P is then the forward's sizes: e.g. the scoring pass of ``"largest_variance"`` computes no Jacobian).
        """
        from bayeswrap.methods.laplace.structures import network_jacobian

        names = self.read_options(bnn)["subnetwork_jacobian"]
        if names is None:
            return {}
        theta = {n: t.detach() for n, t in bnn.theta.items()}
        wrt = {n: theta[n] for n in names}
        forward = lambda th, inp: bnn.forward_with({**theta, **th}, inp)  # noqa: E731
        counts = (2, 4) if batch_size(x) >= 4 else (1, 2) if batch_size(x) >= 2 else (1,)
        if self._jacobians(fp, counts[-1]) > budget_of(bnn) / 4:
            return {}
        peaks = []
        for count in counts:  # one chunk of ``count`` examples (one example runs other kernels: avoided)
            with torch.enable_grad(), PeakTracker() as tracker:
                network_jacobian(forward, wrt, take(x, slice(0, count)), count)
            peaks.append(tracker.peak)
        if len(peaks) == 1:
            return {"Jacobians": 0, "Jacobians per example": peaks[0]}
        per = max(0, (peaks[1] - peaks[0]) // (counts[1] - counts[0]))
        return {"Jacobians": peaks[0] - counts[0] * per, "Jacobians per example": per}

    def _sub(self, fp) -> Footprint:
        n = fp.options.get("n_params_subnet")
        if n is None:
            raise ValueError("n_params_subnet is not set")
        return Footprint(**{**fp.__dict__, "num_params": int(n)})

    def _jacobian_params(self, fp) -> int:
        """P_J: the entries of the tensors the Jacobians cover (P while the entries are not chosen)."""
        return int(fp.options.get("subnetwork_jacobian_params") or fp.num_params)

    def _jacobians(self, fp, c) -> int:
        """``network_jacobian`` on c examples: its (c, K, P_J) result, the per-tensor pieces it concatenates and the
        vmapped backward, bytes.
        """
        m = fp.measured
        if "Jacobians per example" in m:
            return max(0, m["Jacobians"] + c * m["Jacobians per example"])
        return 2 * c * fp.outputs * self._jacobian_params(fp) * fp.itemsize + c * fp.outputs * fp.graph

    def stored(self, fp):
        sub = self._sub(fp)
        return {"dense matrix n²": sub.num_params ** 2 * fp.itemsize,
                "diagonal (curvature, variances)": 3 * fp.num_params * fp.itemsize}

    def _decomposition(self, fp):
        return super()._decomposition(self._sub(fp))

    def _chunks(self, fp, batch, chunk) -> tuple[int, int]:
        """``(c, bytes of one chunk's Jacobians)``."""
        c = min(max(1, chunk), batch)
        return c, c * fp.outputs * self._jacobian_params(fp) * fp.itemsize

    def fit(self, fp, batch, chunk):
        n, s = self._sub(fp).num_params, fp.itemsize
        c, jac = self._chunks(fp, batch, chunk)
        previous = jac if batch > c else 0
        rows = max(1, fp.vectors) * c
        work = _larger({"Jacobians of c examples (network_jacobian)": self._jacobians(fp, c),
                        "the previous chunk's Jacobians": previous},
                       {"Jacobians (c × K × P_J)": jac,
                        "Jacobian rows (M·c × P_J) and their n chosen columns":
                            rows * (jac // max(1, c * fp.outputs)) + rows * n * s})
        if fp.options.get("subnetwork_score") == "largest_variance":
            work = _larger(work, self.score(fp, batch, chunk))
        return {**self.stored(fp), **_larger(work, self._decomposition(fp))}

    def score(self, fp, batch, chunk):
        """The scoring pass of ``"largest_variance"`` (:func:`~bayeswrap.methods.laplace.subnetwork.diagonal_curvature`,
        checked on its first batch before its work): the diagonal's work and the P scores.
        """
        return {"scores (P)": fp.num_params * fp.itemsize, **_diagonal_work(fp, batch, chunk, fp.vectors)}

    def glm(self, fp, batch, chunk):
        n, s = self._sub(fp).num_params, fp.itemsize
        c, jac = self._chunks(fp, batch, chunk)
        previous = jac if batch > c else 0
        return _larger({"Jacobians of c examples (network_jacobian)": self._jacobians(fp, c),
                        "the previous chunk's Jacobians": previous},
                       {"Jacobians (c × K × P_J)": jac, "J_S, J_S Q and its square (3 × c × K × n)":
                        3 * c * fp.outputs * n * s})

    def draws(self, fp, count):
        n, p, s = self._sub(fp).num_params, fp.num_params, fp.itemsize
        return _larger({"ε, ε Q, scaled, rotated back (4 × S × n)": 4 * count * n * s},
                       {"deltas scattered into the parameters and θ* + δ (2 × S × P)": 2 * count * p * s})


def structure_key(bnn) -> str:
    """The :data:`STRUCTURE_ESTIMATES` name of a Laplace model's posterior: ``"subnetwork"`` for
    ``subset_of_weights="subnetwork"``, else its ``hessian_structure``.
    """
    return "subnetwork" if getattr(bnn, "subset_of_weights", None) == "subnetwork" else bnn.hessian_structure


def _label(name: str, est: StructureEstimate, fp: Footprint) -> str:
    return est.label.format(name=name, n=fp.options.get("n_params_subnet"))


def _larger(first: dict[str, int], second: dict[str, int]) -> dict[str, int]:
    """Whichever of two phases that run one after the other has the larger peak (their terms)."""
    return first if sum(first.values()) >= sum(second.values()) else second


def _diagonal_work(fp: Footprint, batch: int, chunk: int, vectors: int, sums: bool = True) -> dict[str, int]:
    """The diagonal curvature's (or the diagonal GLM variances') work on a batch: the per-layer engine's graph,
    pulled-back vectors and per-example convolution / token gradients, or ``vmap``'s per-example gradients.
    """
    s, p = fp.itemsize, fp.num_params
    if fp.backend == "vmap":
        per_example = max(1, chunk // max(1, vectors))  # examples per vmap chunk
        rows = min(vectors, chunk) * per_example  # their Jacobian rows (or per-example gradients)
        return {"accumulators": 2 * p * s,
                "per-example gradients (rows × P, and a mean per example)": (rows + per_example) * p * s,
                "per-tensor temporaries": 2 * rows * fp.largest_tensor * s,  # (r − mean)², then × p
                "vmapped graph and backward": per_example * fp.graph + rows * 2 * fp.largest}
    m = min(vectors, max(1, chunk // batch))  # vectors per backward pass
    pulled = sum(ly.positions * ly.outputs for ly in fp.layers.values()) * s
    convs = [ly for ly in fp.layers.values() if ly.kind == "conv" and ly.weight and ly.positions > 1]
    chunked = [ly for ly in fp.layers.values() if ly.kind in ("linear", "other") and ly.positions > 1]
    rows = max(1, chunk // m)  # examples per chunk of per-example gradients
    per_example = max((m * min(rows, batch) * (2 * ly.weight + ly.outputs * ly.positions)
                       + min(rows, batch) * ly.inputs * ly.positions) * s for ly in chunked) if chunked else 0
    kept, work = _conv_work(convs, batch, chunk, vectors, sums, s)
    # accumulators: the curvature, the engine's per-parameter sums and one parameter-sized product per layer
    return {"accumulators": 3 * p * s, "autograd graph": batch * fp.graph + fp.constant,
            "pulled-back vectors": m * batch * (pulled + 2 * fp.largest),
            "kept conv patches and Gram factors": kept * s,
            "per-example layer gradients": max(per_example, work * s)}


def _conv_work(convs: list[LayerSize], batch: int, chunk: int, vectors: int, sums: bool,
               itemsize: int) -> tuple[int, int]:
    """Elements of the per-layer engine's convolution work (weights with several output positions) at its largest
    backward pass: what is kept across passes (every layer's unfolded patches from the second pass on, the Gram
    factors), and the largest that one layer allocates at a time in that pass, by the route
    :func:`~bayeswrap.methods.laplace.curvature.conv_weight_route` gives it in that pass (``sums``: the curvature;
    else the GLM variances' weighted row norms), or at the Gram form's contraction after the last pass.
    """
    m = min(vectors, max(1, chunk // batch))
    passes = -(-vectors // m)
    rows = min(batch, max(1, chunk // m))
    patched, grams = set(), set()
    best = (0, 0)
    for p in range(1, passes + 2):
        work = 0
        for i, ly in enumerate(convs):
            patch, length = ly.inputs * ly.groups, ly.positions
            unfold = length * patch + ly.input_bytes // itemsize  # the patches, and the (padded) input's copy
            if p > passes:  # after the last pass: the Gram form's one contraction (the patches, their pairs and
                if i in grams:  # a copy, the δ factor's pairs)
                    pairs = length * (length + 1) // 2
                    work = max(work, batch * (length * patch + pairs * max(2 * patch, patch + 2 * ly.outputs)))
                continue
            route = conv_weight_route(length, batch, ly.outputs, patch, ly.groups, ly.in_channels, ly.weight,
                                      min(p * m, vectors), chunk, sums)
            if route == "gram":  # Σ_m δδᵀ (B·out, L, L): a new one each pass, added to the kept one
                work = max(work, batch * ly.outputs * length * length)
                grams.add(i)
                continue
            if route == "linear":
                work = max(work, 2 * batch * patch)
                continue
            # unfolded per chunk of examples in a single pass (not by the kernel), for the whole batch once from
            # the second pass on and kept on the call
            own = 0 if route == "kernel" or p > 1 else rows * unfold
            if p > 1 and i not in patched:  # (the padded input's copy is gone before the gradients)
                work = max(work, batch * (unfold - length * patch))
                patched.add(i)
            if route == "kernel":  # δ in the kernel's layout (m > 1), its weight argument, the per-example gradients
                own += rows * m * ((m > 1) * ly.outputs * length + 2 * ly.weight)
            elif route == "blocks":  # a block of δ copied and its per-example gradients
                block = min(ly.outputs, conv_block_channels(rows, m, patch))
                own += rows * m * block * (length + patch)
            else:  # per-row gradients (and δ, them permuted for m > 1), squared in place (× the weights: a copy)
                own += rows * m * ((m > 1) * (ly.outputs * length + ly.weight) + (1 + (not sums)) * ly.weight)
            work = max(work, own)
        kept = sum(batch * ly.inputs * ly.groups * ly.positions for i, ly in enumerate(convs) if i in patched) + \
            sum(batch * ly.outputs * ly.positions**2 for i, ly in enumerate(convs) if i in grams)
        if kept + work > sum(best):
            best = (kept, work)
    return best


# ---------------------------------------------------------------------- the probe
def probe(bnn, x, structure_layers=()) -> Footprint:
    """The :class:`Footprint` of a Laplace model on inputs like ``x``, from a forward pass of one example.

    Runs ``bnn.forward_with(θ*, x[:1])`` with autograd on, under a :class:`~bayeswrap.core.memory.PeakTracker`
    (what one example's graph keeps) and with hooks on the modules owning Bayesian parameters (their input and
    output sizes). Allocates one (and two) examples' activations only; then the model's own structure measures its
    batched work on up to four examples (:meth:`StructureEstimate.measure`: low rank's vmapped products, the
    subnetwork's Jacobians), unless that would take over a quarter of the budget.

    Args:
        bnn: a :class:`~bayeswrap.Laplace`.
        x: a batch of inputs (its first examples are evaluated).
        structure_layers: ``{layer: (weight, bias)}`` of the Kron layers (their factor sizes).
    """
    theta = {n: t.detach().requires_grad_(not bnn.last_layer_name) for n, t in bnn.theta.items()}
    canonical = {id(p): n for n, p in bnn.model.named_parameters()}
    wanted = set(theta)
    owners = {name: m for name, m in bnn.model.named_modules()
              if any(canonical.get(id(p)) in wanted for p in m._parameters.values() if p is not None)}
    sizes: dict[str, LayerSize] = {}
    counts = {}  # the Bayesian entries of each owner and of its weight (read before forward_with swaps them)
    for name, m in owners.items():
        own = {a: p for a, p in m._parameters.items() if p is not None and canonical.get(id(p)) in wanted}
        counts[name] = (sum(p.numel() for p in own.values()), own["weight"].numel() if "weight" in own else 0)

    def hook(name):
        def record(module, args, output):
            if name in sizes or not args or not isinstance(args[0], torch.Tensor) or \
                    not isinstance(output, torch.Tensor):
                return
            params, weight = counts[name]
            a = args[0]
            if isinstance(module, nn.Linear):
                kind, inputs, outputs = "linear", module.in_features, module.out_features
                positions = max(1, a[0].numel() // module.in_features)
            elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
                kind, outputs = "conv", module.out_channels
                inputs = module.weight[0].numel()
                positions = output[0, 0].numel()
            else:
                kind, inputs, outputs, positions = "other", 0, 1, output[0].numel()
            conv = kind == "conv"
            sizes[name] = LayerSize(kind, params, weight, inputs, outputs, positions,
                                    output[0].numel() * output.element_size(), a[0].numel() * a.element_size(),
                                    module.groups if conv else 1, module.in_channels if conv else 0)
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in owners.items()]
    graphs, peaks = [], []

    try:
        for count in (1, 2) if batch_size(x) > 1 else (1,):
            tracker = PeakTracker()
            with torch.enable_grad(), tracker:
                out = bnn.forward_with(theta, take(x, slice(0, count)))
                graphs.append(tracker.current)
                peaks.append(tracker.peak)
                del out
    finally:
        for h in handles:
            h.remove()
    # what a forward keeps: a constant (parameter-sized temporaries) and a part per example
    graph = graphs[-1] - graphs[0] if len(graphs) == 2 else graphs[0]
    constant = max(0, graphs[0] - graph)
    forward_peak = peaks[-1] - peaks[0] if len(peaks) == 2 else peaks[0]
    ref = next(iter(bnn.theta.values()))
    largest = max((max(ly.output_bytes, ly.input_bytes) for ly in sizes.values()), default=0)
    outputs = _outputs_per_example(bnn, x)
    curvature = getattr(bnn, "curvature", "ggn")
    vectors = outputs if curvature == "ggn" else (bnn.curvature_samples if curvature == "fisher" else 1)
    kron, rest = {}, 0
    for layer, (w, b) in dict(structure_layers).items():
        shape = bnn.theta[w].shape
        kron[layer] = (shape[1:].numel(), shape[0])
    if structure_layers:
        covered = {n for pair in dict(structure_layers).values() for n in pair if n}
        rest = sum(t.numel() for n, t in bnn.theta.items() if n not in covered)
    head = (0, 0)
    if bnn.last_layer_name is not None:
        w = bnn.theta[f"{bnn.last_layer_name}.weight" if bnn.last_layer_name else "weight"]
        head = (w.shape[1] + (len(bnn.theta) == 2), w.shape[0])
    fp = Footprint(num_params=sum(t.numel() for t in bnn.theta.values()), itemsize=ref.element_size(),
                     outputs=outputs, vectors=vectors, graph=graph, constant=constant, forward_peak=forward_peak, largest=largest,
                     largest_tensor=max(t.numel() for t in bnn.theta.values()), layers=sizes, kron=kron,
                     diag_rest=rest, backend=bnn.curvature_backend, last_layer=bnn.last_layer_name is not None,
                     head=head, options=structure_options(bnn))
    own = STRUCTURE_ESTIMATES.get(structure_key(bnn))
    if own is not None:
        fp.measured = own.measure(bnn, x, fp)
    return fp


def _outputs_per_example(bnn, x) -> int:
    with torch.no_grad():
        return int(bnn.forward_with({n: t.detach() for n, t in bnn.theta.items()}, take(x, slice(0, 1))).numel())


def total(parts: dict[str, int]) -> int:
    """The sum of an estimate's terms, bytes."""
    return int(sum(parts.values()))


# ---------------------------------------------------------------------- checks used by Laplace
def structure_options(bnn) -> dict:
    """``{attribute: value}`` of the options every registered structure's estimates read (None where unset)."""
    out = {}
    for est in STRUCTURE_ESTIMATES.values():
        out.update(est.read_options(bnn))
    return out


def budget_of(bnn) -> float:
    """``bnn.memory_budget`` in bytes (``None``: the free memory of the parameters' device now)."""
    return resolve_budget(getattr(bnn, "memory_budget", None), next(iter(bnn.theta.values())).device)


def static_footprint(bnn, kron: dict[str, tuple[int, int]] | None = None, rest: int = 0) -> Footprint:
    """A :class:`Footprint` from the parameters alone (no probe): enough for what a posterior stores and for draws."""
    ref = next(iter(bnn.theta.values()))
    return Footprint(num_params=sum(t.numel() for t in bnn.theta.values()), itemsize=ref.element_size(), outputs=0,
                     vectors=0, graph=0, largest=0, kron=dict(kron or {}), diag_rest=rest,
                     backend=getattr(bnn, "curvature_backend", "layers"), options=structure_options(bnn))


def kron_sizes(bnn, layers: dict[str, tuple[str, str | None]]) -> tuple[dict[str, tuple[int, int]], int]:
    """``({layer: (in, out)}, entries outside them)`` of Kron layers ``{layer: (weight, bias)}``."""
    kron = {layer: (bnn.theta[w].shape[1:].numel(), bnn.theta[w].shape[0]) for layer, (w, _) in layers.items()}
    covered = {n for pair in layers.values() for n in pair if n}
    return kron, sum(t.numel() for n, t in bnn.theta.items() if n not in covered)


def head_footprint(fp: Footprint, bnn) -> Footprint | None:
    """The footprint of the same model with only its last layer Bayesian (``subset_of_weights="last_layer"``):
    no graph through the body, P = K·D̃; ``None`` if the model has no last ``nn.Linear``.
    """
    from bayeswrap.core.functional import find_last_layer

    try:
        name = find_last_layer(bnn.model)
    except ValueError:
        return None
    layer = bnn.model.get_submodule(name)
    d, k = layer.in_features + (layer.bias is not None), layer.out_features
    size = fp.layers.get(name, LayerSize("linear", d * k, d * k - k, d, k, 1, k * fp.itemsize))
    # no graph through the body: its forward holds at most the forward's peak per example
    return Footprint(num_params=d * k, itemsize=fp.itemsize, outputs=fp.outputs, vectors=fp.vectors,
                     graph=fp.forward_peak, forward_peak=fp.forward_peak, largest=0, layers={name: size}, kron={name: (d - (layer.bias is not None), k)},
                     backend=fp.backend, last_layer=True, head=(d, k), options=fp.options)


def alternatives(bnn, fp: Footprint, batch: int, phase: str = "fit") -> dict[str, int]:
    """Estimated peaks (bytes) of the other settings on the same batches, at ``curvature_chunk_size=1``:
    every registered ``hessian_structure`` over the current parameters and over the last layer only.
    """
    out = {}
    head = None if bnn.last_layer_name is not None else head_footprint(fp, bnn)
    for name, est in STRUCTURE_ESTIMATES.items():
        for label, f in ((_label(name, est, fp), fp),
                         (f"subset_of_weights='last_layer', hessian_structure={name!r}",
                          head if est.last_layer_alternative else None)):
            if f is None or (name == "kron" and not f.kron):
                continue
            try:
                out[label] = total(getattr(est, phase)(f, batch, 1))
            except Exception:  # an estimate that needs what this footprint lacks: not listed
                continue
    return out


def size_chunk(bnn, what: str, estimate: Callable[[int], dict[str, int]], batch: int, fp: Footprint,
               phase: str = "fit") -> int:
    """The ``curvature_chunk_size`` to use on batches of ``batch`` examples within the budget.

    The user's chunk if it fits; a default chunk (:data:`DEFAULT_CHUNK`) is halved until it fits. Raises
    :class:`~bayeswrap.core.memory.MemoryBudgetError` (before any allocation) when even the smallest does not,
    naming the estimate, the budget and the settings that fit.
    """
    budget = budget_of(bnn)
    chunk = bnn.curvature_chunk_size
    candidates = halvings(chunk) if chunk == DEFAULT_CHUNK else [chunk]
    chosen = largest_fitting(candidates, lambda c: total(estimate(c)), budget)
    if chosen is None:
        smallest = candidates[-1]
        check_budget(f"{what} ({_label(structure_key(bnn), STRUCTURE_ESTIMATES[structure_key(bnn)], fp)}, "
                     f"{fp.num_params} "
                     f"Bayesian parameters, batches of {batch}, curvature_chunk_size={smallest})",
                     total(estimate(smallest)), budget, alternatives(bnn, fp, batch, phase), estimate(smallest))
    return chosen


def check_stored(bnn, structure: str, layers: dict[str, tuple[str, str | None]]) -> None:
    """Refuses, before allocation, a posterior whose storage and eigendecomposition exceed the budget.

    Args:
        bnn: the :class:`~bayeswrap.Laplace` being built (its ``theta`` and ``memory_budget`` are set).
        structure: ``"full"`` or ``"kron"`` (any registered name).
        layers: the Kron layers ``{layer: (weight, bias)}`` (empty otherwise).

    Raises:
        MemoryBudgetError: naming the estimate, the budget and the structures whose storage fits.
    """
    kron, rest = kron_sizes(bnn, layers)
    fp = static_footprint(bnn, kron, rest)
    est = STRUCTURE_ESTIMATES[structure]
    parts = {**est.stored(fp), **getattr(est, "_decomposition", lambda f: {})(fp)}
    budget = budget_of(bnn)
    if total(parts) <= budget:
        return
    fits = {}
    for name, other in STRUCTURE_ESTIMATES.items():
        if name != structure and (name != "kron" or kron):
            try:
                fits[_label(name, other, fp)] = total({**other.stored(fp),
                                                       **getattr(other, "_decomposition", lambda f: {})(fp)})
            except Exception:  # an estimate that needs what this footprint lacks: not listed
                continue
    check_budget(f"{_label(structure, est, fp)} over {fp.num_params} Bayesian parameters (its storage and "
                 "eigendecomposition)", total(parts), budget, fits, parts)


def check_draws(bnn, count: int) -> None:
    """Refuses ``count`` posterior draws at once (θ_s for ``pred_type="nn"``, ``sample``) above the budget.

    Raises:
        MemoryBudgetError: naming the estimate, the budget and the largest number of draws that fits.
    """
    est = STRUCTURE_ESTIMATES.get(structure_key(bnn))
    if est is None:  # a structure that registered no estimate: nothing is checked
        return
    fp = static_footprint(bnn)
    parts = est.draws(fp, count)
    budget = budget_of(bnn)
    if total(parts) > budget:
        per = max(1, total(est.draws(fp, 1)))
        fits = {f"{int(budget // per)} draws at a time (chunk_size / num_samples)": int(budget // per) * per} \
            if budget >= per else {}
        check_budget(f"{count} posterior draws at once over {fp.num_params} Bayesian parameters", total(parts),
                     budget, fits, parts)


def cached_probe(bnn, x) -> Footprint:
    """:func:`probe`, kept on the model for inputs of the same per-example shapes and dtypes (and the same
    structure, subset, curvature, backend and structure options, e.g. the tensors a subnetwork's Jacobians cover),
    so that predicting batch after batch probes once.
    """
    key = (tuple((name, tuple(t.shape[1:]), t.dtype, t.device) for name, t in tensor_leaves(x)),
           structure_key(bnn), bnn.last_layer_name, bnn.curvature, bnn.curvature_samples, bnn.curvature_backend,
           tuple((n, tuple(t.shape), t.dtype) for n, t in bnn.theta.items()),
           tuple(sorted(structure_options(bnn).items())))  # e.g. the tensors a subnetwork's Jacobians cover
    cached = bnn.__dict__.get("_memory_footprint")
    if cached is None or cached[0] != key:
        cached = (key, probe(bnn, x, getattr(bnn._structure, "layers", {}) or {}))
        bnn.__dict__["_memory_footprint"] = cached
    return cached[1]


def plan_chunk(bnn, x, phase: str, cache: dict) -> int:
    """The ``curvature_chunk_size`` for a batch ``x`` of :meth:`~bayeswrap.Laplace.fit_curvature` (``phase="fit"``),
    of the GLM predictive's variances (``"glm"``) or of a subnetwork's scoring pass (``"score"``), within the budget; probes the model once per ``cache``
    (a dict the caller keeps for one fit or one call) and re-plans when the batch grows.

    Raises:
        MemoryBudgetError: when even a chunk of 1 does not fit (before the batch's work allocates anything).
    """
    batch = batch_size(x)
    est = STRUCTURE_ESTIMATES.get(structure_key(bnn))
    if est is None:  # a structure that registered no estimate: nothing is checked
        return bnn.curvature_chunk_size
    if cache.get("batch", 0) >= batch:
        return cache["chunk"]
    if "footprint" not in cache:
        cache["footprint"] = cached_probe(bnn, x)
    fp = cache["footprint"]
    what = {"fit": "fit_curvature", "glm": "the GLM predictive's functional variances",
            "score": "fit_curvature's scoring pass (subnetwork_score='largest_variance')"}[phase]
    chunk = size_chunk(bnn, what, lambda c: getattr(est, phase)(fp, batch, c), batch, fp,
                       "glm" if phase == "glm" else "fit")
    cache.update(batch=batch, chunk=chunk)
    return chunk
