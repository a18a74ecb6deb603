"""Sums of squared per-example gradients, layer by layer (the fast diagonal Laplace curvature).

The diagonal curvatures of :class:`~bayeswrap.Laplace` are all of one form: for
some vectors v_{n,m} in the output space of example n (m = 1..M),

    c_i = Σ_n Σ_m (∂(v_{n,m}ᵀ f(x_n; θ)) / ∂θ_i)²,

* empirical Fisher: M = 1, v_n = ∂ −log p(y_n | f_n) / ∂f_n (the per-example
  NLL gradient in output space);
* Fisher (Monte Carlo GGN): the same at labels sampled from the model;
* exact GGN: M = K, v_{n,k} the K columns of a factor of the output Hessian
  Λ_n = Σ_k v_{n,k} v_{n,k}ᵀ. Softmax: v_{n,k} = sqrt(p_{n,k}) (e_k − p_n)
  (Σ_k p_k (e_k − p)(e_k − p)ᵀ = diag(p) − ppᵀ); Gaussian: v_{n,k} = e_k / σ.
  This is BackPACK's ``DiagGGNExact`` (Dangel et al. 2020, §2 and appendix A);
  a Monte Carlo GGN is ``curvature="fisher"``.

Instead of one vector-Jacobian product per example over the whole network
(``torch.func.vmap``), :class:`LayerCurvature` runs the batch forward once with
hooks that keep each layer's input a and output z, backpropagates all vectors
v_{·,m} with one batched backward pass to get δ = ∂(vᵀf)/∂z for every layer,
and contracts a and δ in closed form per layer (Goodfellow 2015, "Efficient
per-example gradient computations"; Dangel et al. 2020; Rochette et al. 2019,
"Efficient per-example gradient computations in convolutional neural
networks", for the unfolded convolution):

* ``nn.Linear`` on (B, in): g_n = δ_n a_nᵀ, so Σ_n Σ_m g² = (Σ_m δ²)ᵀ (a²), one
  matmul; bias Σ δ².
* ``nn.Linear`` on (B, T, in) (tokens): g_n = Σ_t δ_{n,t} a_{n,t}ᵀ by ``bmm``,
  squared and summed in chunks of examples.
* ``nn.Conv1d`` / ``nn.Conv2d`` (any stride, padding, padding mode, dilation,
  groups): g_n = δ_n U_nᵀ with U_n (C·kk, L) the unfolded input patches
  (``torch.nn.functional.unfold``) at the L output positions, per group. For the
  sums (the curvature), by whichever is cheaper:

  - few positions (L² ≤ M (:data:`GRAM_ROW_COST` + L), M the vectors): the Gram
    form Σ_{m,n} g² = Σ_n Σ_{l ≤ l'} c_{ll'} (Σ_m δ_{m,n,·,l} δ_{m,n,·,l'})ᵀ
    (U_{n,·,l} U_{n,·,l'}) (c = 1 on the diagonal, 2 off it), one matmul with
    inner dimension B·L(L+1)/2 and no per-example gradient; the factor of δ
    sums over all vectors first, so the GGN's K vectors share one contraction;
  - else per-example gradients, formed and squared in cache-sized blocks of
    output channels (bmm of δ and U), or, for many positions and input channels,
    by the convolution's own weight-gradient kernel with the examples as groups;
  - one output position: the Linear rule on the input patch.
* ``nn.LayerNorm``, ``nn.GroupNorm`` and eval-mode ``nn.BatchNorm1d/2d/3d``
  (running statistics): weight g_n = Σ_positions δ ⊙ x̂ with x̂ the normalised
  input recomputed from a; bias Σ_positions δ.
* any other module that owns a Bayesian parameter directly (a custom layer, a
  model whose own forward uses a parameter such as ViT's ``cls_token``): a
  per-module fallback, ``vmap`` over examples of the vector-Jacobian product of
  that module's functional forward (at its recorded inputs) with respect to its
  own parameters. It reruns only that module (the whole network for a
  parameter of the root module).

A parameter that is used while no module owning it is running (a parent that
reads ``child.weight``), owned by a module whose output or inputs are not
batched tensors, or whose module runs several times per forward is still
exact: per-example gradients of all calls of a module (and of all modules
sharing a tied parameter) are summed before squaring, and parameters used
outside their modules fall back to ``vmap`` over examples of the whole
network restricted to those parameters. Uses are detected with a
``TorchFunctionMode`` during the forward pass, call counts with the hooks.

:meth:`LayerCurvature.forward` runs the recorded forward pass for a caller that needs f
anyway (``fit_curvature``'s log-likelihood), and the next curvature call on the same
batch reuses it: one forward per batch.

Requirements: examples must be independent (eval mode; no batch statistics),
which :class:`LayerCurvature` checks for BatchNorm; :attr:`LayerCurvature.usable`
is False otherwise and :class:`~bayeswrap.Laplace` then uses its ``vmap``
reference. Outputs that a later in-place operation overwrites (``ReLU(inplace=True)``
after BatchNorm in ResNets) are detected by their version counters and the
forward is rerun once with those outputs copied.

References:
    F. Dangel, F. Kunstner, P. Hennig 2020, "BackPACK: Packing more into
    backprop", ICLR (§2, appendix A: diagonal GGN by backpropagating a
    symmetric factorisation of the output Hessian).
    I. Goodfellow 2015, "Efficient per-example gradient computations", arXiv:1510.01799.
    G. Rochette, A. Manoel, E. W. Tramel 2019, "Efficient per-example gradient
    computations in convolutional neural networks", arXiv:1912.06015.
    A. Yousefpour et al. 2021, "Opacus: user-friendly differential privacy
    library in PyTorch" (the same per-layer rules).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from bayeswrap.core.functional import vmap_over_examples

#: routes a Bayesian parameter can take (see :attr:`LayerCurvature.routes`)
ROUTES = ("linear", "conv", "layernorm", "groupnorm", "batchnorm", "module", "network", "unused")

_STANDARD_FORWARD = {
    "linear": (nn.Linear.forward,),
    "conv": (nn.Conv1d.forward, nn.Conv2d.forward),
    "layernorm": (nn.LayerNorm.forward,),
    "groupnorm": (nn.GroupNorm.forward,),
    "batchnorm": (_BatchNorm.forward,),
}
#: tensor methods that read metadata only (a parameter passed to them is not "used")
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.__len__,
             torch.Tensor.is_contiguous, torch.Tensor.data_ptr, torch.Tensor.element_size, torch.Tensor.__hash__,
             torch.Tensor.detach, torch.Tensor.requires_grad_}


def _layer_kind(module: nn.Module) -> str:
    """The closed-form rule for a module's own parameters, or ``"module"`` (per-module vmap)."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and not isinstance(module, nn.modules.conv._ConvTransposeNd):
        return "conv"
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if isinstance(module, nn.GroupNorm):
        return "groupnorm"
    if isinstance(module, _BatchNorm) and module.track_running_stats:
        return "batchnorm"
    return "module"


def _standard_forward(module: nn.Module, kind: str) -> bool:
    return "forward" not in vars(module) and type(module).forward in _STANDARD_FORWARD.get(kind, ())


@dataclass
class _Call:
    """One run of a hooked module during the captured forward pass."""

    module: nn.Module
    kind: str
    attrs: dict[str, str]  # the module's own Bayesian parameters: attribute -> theta name
    args: tuple
    kwargs: dict
    output: object
    state: dict[str, torch.Tensor] = field(default_factory=dict)  # the module's tensors (detached), by local name
    patches: torch.Tensor | None = None  # a conv's unfolded input (B, C·kk, L), kept from a run's second pass on
    versions: list = field(default_factory=list)

    @property
    def input(self) -> torch.Tensor:
        return self.args[0] if self.args else next(iter(self.kwargs.values()))


class _UseTracker(TorchFunctionMode):
    """Records Bayesian parameters that a torch function receives while no module owning them is running."""

    def __init__(self, by_id: dict[int, str], owners: dict[str, set[int]], stack: list[nn.Module]):
        super().__init__()
        self.by_id, self.owners, self.stack, self.outside = by_id, owners, stack, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _METADATA and getattr(func, "__name__", "") != "__get__":
            for t in tree_flatten((args, kwargs))[0]:
                name = self.by_id.get(id(t)) if isinstance(t, torch.Tensor) else None
                if name is not None and name not in self.outside:
                    active = {id(m) for m in self.stack}
                    if not self.owners[name] & active:
                        self.outside.add(name)
        return func(*args, **kwargs)


class LayerCurvature:
    """Σ_n Σ_m g_{n,m}² for per-example, per-vector gradients g, from per-layer contractions.

    Args:
        model: the module evaluated by ``forward`` (bayeswrap's storage-free
            copy); hooks are added to it during :meth:`squared_grad_sums` only
            and always removed.
        names: the parameters to differentiate (dotted names as in
            ``model.named_parameters()``; tied parameters under their first name).
        chunk_size: bounds memory: at most ``chunk_size`` rows (example ×
            vector pairs) of per-example gradients of one layer at a time, and
            ``max(1, chunk_size // B)`` output vectors per backward pass.

    Attributes:
        routes: after a call, ``{name: route}`` with the route of
            :data:`ROUTES` that each parameter took (``"unused"``: the
            forward never used it, so its gradient is 0).
        usable: False if a module couples the examples of a batch (BatchNorm in
            training mode or without running statistics); :meth:`squared_grad_sums`
            then raises ``ValueError`` and callers use the ``vmap`` reference.
    """

    def __init__(self, model: nn.Module, names: Iterable[str], chunk_size: int = 32):
        self.model = model
        self.names = list(names)
        self.chunk_size = int(chunk_size)
        wanted = set(self.names)
        canonical = {id(p): n for n, p in model.named_parameters()}
        self.owned: dict[nn.Module, dict[str, str]] = {}
        self.owners: dict[str, set[int]] = {n: set() for n in self.names}
        for module in model.modules():
            attrs = {a: canonical[id(p)] for a, p in module._parameters.items()
                     if p is not None and canonical.get(id(p)) in wanted}
            if attrs:
                self.owned[module] = attrs
                for n in attrs.values():
                    self.owners[n].add(id(module))
        self.kinds = {m: _layer_kind(m) for m in self.owned}
        self.verified = {m for m, k in self.kinds.items() if k == "module" or _standard_forward(m, k)}
        self.copy_outputs = False
        self.routes: dict[str, str] = {}
        self._captured: tuple | None = None  # (x, theta, key, capture) of :meth:`forward`, until the next call

    @property
    def usable(self) -> bool:
        """False if a module couples the examples of a batch (BatchNorm in training mode or without running stats)."""
        return not any(isinstance(m, _BatchNorm) and (m.training or not m.track_running_stats)
                       for m in self.model.modules())

    # ------------------------------------------------------------------ capture
    def _capture(self, forward, theta: dict[str, torch.Tensor], x):
        calls: list[_Call] = []
        stack: list[nn.Module] = []
        tracker = _UseTracker({id(t): n for n, t in theta.items()}, self.owners, stack)
        copy = self.copy_outputs

        def pre_hook(module, args, kwargs):
            stack.append(module)

        def hook(module, args, kwargs, output):
            stack.pop()
            kind = self.kinds[module]
            keep = lambda t: (t.detach().clone() if copy else t.detach()) if isinstance(t, torch.Tensor) else t
            call = _Call(module, kind, self.owned[module], tree_map(keep, args), tree_map(keep, kwargs), output)
            if kind == "module" or module not in self.verified:
                call.state = {**{k: v.detach() for k, v in module.named_parameters(remove_duplicate=False)},
                              **{k: v.detach() for k, v in module.named_buffers(remove_duplicate=False)}}
            elif kind == "batchnorm":
                call.state = {"running_mean": module.running_mean.detach(), "running_var": module.running_var.detach()}
            for t in tree_flatten((args, kwargs, output))[0]:
                if isinstance(t, torch.Tensor):
                    call.versions.append((t, t._version))
            calls.append(call)
            if copy and isinstance(output, torch.Tensor):
                return output.clone()
            return None

        handles = []
        try:
            for module in self.owned:
                handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
            with tracker:
                f = forward(theta, x)
        finally:
            for h in handles:
                h.remove()
        changed = any(t._version != v for c in calls for t, v in c.versions)
        for c in calls:
            c.versions = []
        return f, calls, tracker.outside, changed

    def _verify(self, call: _Call) -> bool:
        """Whether a subclass of a known layer computes the standard function at its recorded input."""
        out = call.output
        if not isinstance(out, torch.Tensor) or len(call.args) != 1 or call.kwargs:
            return False
        m, a, p = call.module, call.args[0], call.state
        if not isinstance(a, torch.Tensor):
            return False
        with torch.no_grad():
            try:
                if call.kind == "linear":
                    ref = F.linear(a, p["weight"], p.get("bias"))
                elif call.kind == "conv":
                    ref = _conv_forward(m, a, p["weight"], p.get("bias"))
                elif call.kind == "layernorm":
                    ref = F.layer_norm(a, m.normalized_shape, p.get("weight"), p.get("bias"), m.eps)
                elif call.kind == "groupnorm":
                    ref = F.group_norm(a, m.num_groups, p.get("weight"), p.get("bias"), m.eps)
                else:
                    ref = F.batch_norm(a, p["running_mean"], p["running_var"], p.get("weight"), p.get("bias"), False,
                                       0.0, m.eps)
            except Exception:
                return False
            return ref.shape == out.shape and bool(torch.allclose(ref, out.detach(), rtol=1e-5, atol=1e-6))

    # ------------------------------------------------------------------ main entry
    def squared_grad_sums(self, forward: Callable, theta: Mapping[str, torch.Tensor], x,
                          vectors: Callable[[torch.Tensor, int], Iterable[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Σ_n Σ_m (∂(v_{n,m}ᵀ f(x_n; θ)) / ∂θ)² for every parameter in ``names``.

        Args:
            forward: ``forward(theta, x) -> f``, the batched model with the
                Bayesian parameters ``theta`` (e.g. ``Laplace.forward_with``);
                f has shape (B, *out).
            theta: ``{name: tensor}``, the point to differentiate at (detached here).
            x: the batch of inputs (a tensor, or a tuple of tensors with batch dim 0).
            vectors: ``vectors(f, m)`` yields the output-space vectors in chunks,
                each of shape (m_j, B, *out) with m_j ≤ m (f is detached).

        Returns:
            ``{name: tensor of the parameter's shape}``, summed over examples
            and vectors, in the parameters' dtype.

        Raises:
            ValueError: if :attr:`usable` is False.
        """
        acc = _Sums(theta)
        self._run(forward, theta, x, vectors, acc)
        return acc.total

    def weighted_row_norms(self, forward: Callable, theta: Mapping[str, torch.Tensor], x,
                           vectors: Callable[[torch.Tensor, int], Iterable[torch.Tensor]],
                           weights: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ_i w_i (∂(v_{n,m}ᵀ f(x_n; θ)) / ∂θ_i)² for every vector m and example n (no sum).

        With v = e_k and w the posterior variances this is the diagonal of the
        linearised model's functional covariance, var_{n,k} = Σ_i J_{n,k,i}² w_i.

        Args:
            forward, theta, x, vectors: as in :meth:`squared_grad_sums`.
            weights: ``{name: tensor of the parameter's shape}`` for every name.

        Returns:
            ``(f, norms)``: the detached outputs f (B, *out) and the norms
            (M, B), M the total number of vectors.

        Raises:
            ValueError: if :attr:`usable` is False.
        """
        acc = _RowNorms(weights)
        f = self._run(forward, theta, x, vectors, acc)
        return f, torch.cat(acc.rows, 0)

    def forward(self, forward: Callable, theta: Mapping[str, torch.Tensor], x) -> torch.Tensor:
        """The batched outputs, from the forward pass that the next :meth:`squared_grad_sums` (or
        :meth:`weighted_row_norms`) on the same ``x`` and ``theta`` then reuses instead of running its own.

        Lets a caller that needs f anyway (the log-likelihood of ``fit_curvature``) pay for one forward pass per
        batch. The recorded pass (its graph and layer inputs) is held until that next call, which consumes it;
        it is reused only for the same ``x`` object and the same parameter storage and versions.

        Returns:
            f (B, *out), detached.

        Raises:
            ValueError: if :attr:`usable` is False.
        """
        self._captured = None
        theta, capture = self._forward(forward, theta, x)
        self._captured = (x, theta, _theta_key(theta), capture)
        return capture[0].detach()

    def _forward(self, forward, theta, x):
        if not self.usable:
            raise ValueError("the model couples the examples of a batch (BatchNorm in training mode or without "
                             "running statistics): per-layer per-example gradients are undefined; use the vmap "
                             "reference")
        theta = {n: t.detach().requires_grad_(True) for n, t in theta.items()}
        with torch.enable_grad():
            f, calls, outside, changed = self._capture(forward, theta, x)
            if changed and not self.copy_outputs:  # an in-place op overwrote a recorded tensor: copy them
                self.copy_outputs = True
                f, calls, outside, changed = self._capture(forward, theta, x)
        return theta, (f, calls, outside)

    def _run(self, forward, theta, x, vectors, acc) -> torch.Tensor:
        captured, self._captured = self._captured, None
        if captured is not None and captured[0] is x and captured[2] == _theta_key(theta):
            theta, (f, calls, outside) = captured[1], captured[3]
        else:
            theta, (f, calls, outside) = self._forward(forward, theta, x)
        batch = f.shape[0]
        for call in calls:  # subclasses of known layers: their function must be the standard one
            if call.module not in self.verified:
                if not self._verify(call):
                    self.kinds[call.module] = call.kind = "module"
                self.verified.add(call.module)
            elif call.kind != self.kinds[call.module]:  # demoted at an earlier call of this forward
                call.kind = "module"
        network = set(outside)
        uses: dict[str, list[tuple[int, str]]] = {n: [] for n in self.names}
        for i, call in enumerate(calls):
            if not _rule_applies(call, batch):
                network.update(call.attrs.values())
            for attr, name in call.attrs.items():
                uses[name].append((i, attr))
        layer_names = [n for n in self.names if uses[n] and n not in network]
        self.routes = {n: ("network" if n in network else
                           ("unused" if not uses[n] else
                            ("module" if any(calls[i].kind == "module" for i, _ in uses[n]) else
                             calls[uses[n][0][0]].kind))) for n in self.names}
        needed = sorted({i for n in layer_names for i, _ in uses[n]})
        targets = [i for i in needed if isinstance(calls[i].output, torch.Tensor) and calls[i].output.requires_grad]
        per_call = max(1, self.chunk_size // batch)
        network_names = [n for n in self.names if n in network]
        seen = 0  # vectors so far, this pass's included
        for v in vectors(f.detach(), per_call):
            seen += v.shape[0]
            acc.start(v.shape[0], batch, f)
            deltas = dict(zip(targets, _backward(f, [calls[i].output for i in targets], v)))
            self._contract(calls, uses, layer_names, deltas, acc, v.shape[0], batch, seen)
            if network_names:
                _network_grads(forward, theta, network_names, x, v, max(1, self.chunk_size // v.shape[0]), acc)
        acc.finish()
        return f.detach()

    def _contract(self, calls, uses, layer_names, deltas, acc, m: int, batch: int, seen: int) -> None:
        """Adds the per-layer names' per-row gradients, from the recorded inputs and δ = deltas[call], to acc
        (``seen``: the vectors of this and the earlier passes, which the Gram form's one contraction serves).
        """
        chunked, patches = [], {}
        for name in layer_names:
            (i, attr), = uses[name][:1]
            call = calls[i]
            d = deltas.get(i)
            if len(uses[name]) == 1 and d is not None and attr == "weight" and hasattr(acc, "gram") and \
                    _gram_cheaper(call, d, seen, self.chunk_size):
                # few output positions: Σ_n g_n² from Gram matrices of δ and of the input patches, without
                # per-example gradients (accumulated over the vector chunks, contracted once in acc.finish)
                acc.gram(name, call, d)
                continue
            if len(uses[name]) == 1 and d is not None and attr == "weight" and hasattr(acc, "conv_blocks") and \
                    call.kind == "conv" and call.module.groups == 1 and d.dim() > 3:
                if call.patches is None and seen > m:  # kept for the later passes (the GGN's vector chunks)
                    call.patches = _conv_patches(call.module, call.input)
                acc.conv_blocks(name, call, d, max(1, self.chunk_size // m))
                continue
            if len(uses[name]) == 1 and d is not None and call.kind == "conv" and attr == "bias":
                acc.rows_of(name, d.flatten(3).sum(3), slice(None), True)  # (m, B, out): Σ over positions
                continue
            if len(uses[name]) == 1 and d is not None and _one_position_conv(call, d):
                # a convolution with one output position is a Linear on its input patch: the closed form, without
                # per-example gradients (e.g. the last stage of a ResNet on small images)
                if i not in patches:
                    patches[i] = _conv_patches(call.module, call.input)[..., 0]  # (B, C·kk)
                acc.linear(name, attr, patches[i], d.flatten(2))
                continue
            if len(uses[name]) == 1 and call.kind in ("linear", "layernorm", "groupnorm", "batchnorm") and (
                    call.kind != "linear" or call.input.dim() == 2):
                d = deltas.get(i)
                if d is None:
                    continue
                if call.kind == "linear":
                    acc.linear(name, attr, call.input, d)
                else:
                    acc.rows_of(name, _per_row_grads(call, d, slice(None), attrs=(attr,))[attr], slice(None))
            else:
                chunked.append(name)
        if not chunked:
            return
        rows = max(1, self.chunk_size // m)
        remaining = {}
        for name in chunked:
            for i, _ in uses[name]:
                remaining[i] = remaining.get(i, 0) + 1
        for start in range(0, batch, rows):
            sl = slice(start, min(start + rows, batch))
            cache: dict[int, dict[str, torch.Tensor]] = {}
            left = dict(remaining)
            for name in chunked:
                g, owned = None, False
                for i, attr in uses[name]:
                    if i not in cache:
                        d = deltas.get(i)
                        cache[i] = {} if d is None else _per_row_grads(calls[i], d, sl, keep_patches=seen > m)
                    part = cache[i].get(attr)
                    if part is not None:  # fresh buffers: sums of parts, and the bmm results of Linear and Conv
                        g, owned = (part, calls[i].kind in ("linear", "conv")) if g is None else (g + part, True)
                    left[i] -= 1
                    if left[i] == 0:
                        del cache[i]
                if g is not None:
                    acc.rows_of(name, g, sl, owned)


#: the Gram form replaces a per-example gradient row (one bmm output element, written, squared and summed: memory
#: bound) by L² multiply-adds of one large matmul run once for all vectors; measured on one CPU core, a row costs
#: about as much as 64 multiply-adds plus the L of its bmm, so the Gram form is used where
#: L² ≤ M · (GRAM_ROW_COST + L), M the vectors so far (the empirical Fisher: 1; the GGN: K over its passes)
GRAM_ROW_COST = 64
#: the Gram form's factors may take this many times the memory of the per-example gradient rows a pass holds
GRAM_MEMORY_FACTOR = 32
#: the per-example gradients of an ungrouped conv weight are formed this many elements at a time (8 MiB of
#: float32, the fastest of 0.5–32 MiB on ResNet-18's layers on one core: a block stays in cache while it is squared
#: and summed; the whole B × out × C·kk at once is memory bound)
BLOCK_ELEMENTS = 2**21
#: from this many output positions and input channels on, the per-example gradients of an ungrouped conv weight
#: come from the library's weight-gradient kernel (the batch as groups) instead of unfold and bmm: 2–3x faster on
#: one CPU core for 16–64 channels at 256 positions, slower for fewer positions or channels
KERNEL_MIN_POSITIONS = 256
KERNEL_MIN_CHANNELS = 16


def _gram_cheaper(call: _Call, d: torch.Tensor, seen: int, chunk_size: int) -> bool:
    """Whether a convolution's weight takes the Gram form in this pass: more than one output position (δ (m, B,
    out, *positions)), L² ≤ seen (GRAM_ROW_COST + L), ``seen`` the vectors of this and the earlier passes, and
    its factors (B·L(L+1)/2·(out + C·kk) elements) at most :data:`GRAM_MEMORY_FACTOR` times the
    max(chunk_size, B) rows of per-example gradients that a pass of the other rule may hold.

    Several passes (the K vectors of the GGN in chunks) switch a layer to the Gram form once the rows already
    formed would have paid for its one contraction, so the total is within 2x of the cheaper rule's.
    """
    if call.kind != "conv" or d.dim() < 4:
        return False
    weight = call.module.weight
    return _gram_fits(d[0, 0, 0].numel(), d.shape[1], weight.shape[0], weight[0].numel() * call.module.groups,
                      weight.numel(), seen, chunk_size)


def _gram_fits(positions: int, batch: int, out: int, patch: int, weight: int, seen: int, chunk_size: int) -> bool:
    """:func:`_gram_cheaper` on sizes: L positions, B examples, ``out`` channels, C·kk ``patch`` entries (all
    groups), ``weight`` entries.
    """
    if positions < 2 or positions * positions > seen * (GRAM_ROW_COST + positions):
        return False
    factors = batch * positions * (positions + 1) // 2 * (out + patch)
    return factors <= GRAM_MEMORY_FACTOR * max(chunk_size, batch) * weight


def _by_kernel(positions: int, in_channels: int) -> bool:
    """Whether an ungrouped conv weight's per-example gradients come from the weight-gradient kernel."""
    return positions >= KERNEL_MIN_POSITIONS and in_channels >= KERNEL_MIN_CHANNELS


def conv_weight_route(positions: int, batch: int, out: int, patch: int, groups: int, in_channels: int, weight: int,
                      seen: int, chunk_size: int, sums: bool = True) -> str:
    """The rule :class:`LayerCurvature` takes for a (once-called) conv weight in one backward pass, from sizes only
    (the memory estimates of :mod:`bayeswrap.methods.laplace.memory` read it; the same tests as ``_contract``).

    Args:
        positions: L, output positions per example.
        batch: B.
        out: output channels.
        patch: C·kk, the unfolded patch of all groups.
        groups: the conv's groups.
        in_channels: C.
        weight: the weight's entries.
        seen: the vectors of this and the earlier passes.
        chunk_size: ``LayerCurvature.chunk_size``.
        sums: :meth:`LayerCurvature.squared_grad_sums` (True) or :meth:`LayerCurvature.weighted_row_norms`.

    Returns:
        ``"gram"`` (Gram factors accumulated, contracted at the end), ``"kernel"`` (the weight-gradient kernel with
        the examples as groups), ``"blocks"`` (per-example gradients in blocks of :func:`conv_block_channels`
        output channels), ``"linear"`` (one position: the Linear rule on the patch) or ``"rows"`` (per-row
        gradients of ``chunk_size // m`` examples at a time).
    """
    if sums and _gram_fits(positions, batch, out, patch, weight, seen, chunk_size):
        return "gram"
    if sums and groups == 1:
        return "kernel" if _by_kernel(positions, in_channels) else "blocks"
    if groups == 1 and positions == 1:
        return "linear"
    return "rows"


def conv_block_channels(rows: int, vectors: int, patch: int) -> int:
    """Output channels per block of the ``"blocks"`` rule, for ``rows`` examples, ``vectors`` per pass and C·kk
    ``patch`` entries.
    """
    return max(1, BLOCK_ELEMENTS // (rows * vectors * patch))


def _theta_key(theta: Mapping[str, torch.Tensor]) -> tuple:
    """What identifies a parameter point without comparing values: names, storage, shape and version."""
    return tuple((n, t.data_ptr(), tuple(t.shape), t._version) for n, t in theta.items())


def _one_position_conv(call: _Call, d: torch.Tensor) -> bool:
    """Whether a call is an ungrouped convolution with one output position (δ (m, B, out, 1, ...))."""
    return call.kind == "conv" and call.module.groups == 1 and d.dim() > 3 and d[0, 0, 0].numel() == 1


def _squared(g: torch.Tensor, owned: bool) -> torch.Tensor:
    """g², in place when g is a contiguous temporary that nothing else refers to (a fresh buffer costs page
    faults on CPU); vjp results may alias other tensors and are squared out of place.
    """
    if not owned:
        return g.square()
    return g.square_() if g.is_contiguous() else g.square()


class _Sums:
    """Accumulates Σ over rows of g² per parameter."""

    def __init__(self, theta):
        self.total = {n: torch.zeros_like(t) for n, t in theta.items()}
        self.grams: dict[str, list] = {}  # name -> [module, input, Σ_m δδᵀ (B·out, L, L)]

    def start(self, m, batch, f):
        """Per-batch set-up of the accumulator protocol: the sums need none (:class:`_RowNorms` keeps rows)."""

    def gram(self, name, call, d):
        """Adds Σ_m δ_{m,n,o} δ_{m,n,o}ᵀ (L × L over the output positions) of a conv weight's vectors.

        With g_{m,n,o,i} = Σ_l δ_{m,n,o,l} U_{n,i,l} (U the unfolded input patches),
        Σ_{m,n} g² = Σ_n Σ_{l,l'} (Σ_m δ_{m,n,o,l} δ_{m,n,o,l'}) U_{n,i,l} U_{n,i,l'}: the sum over the vectors
        folds into the first factor, so the contraction with the patches runs once (:meth:`finish`).
        """
        m, b, o = d.shape[:3]
        x = d.reshape(m, b * o, -1).permute(1, 2, 0)  # (B·out, L, m)
        outer = torch.bmm(x, x.transpose(1, 2))  # (B·out, L, L)
        entry = self.grams.get(name)
        if entry is None:
            self.grams[name] = [call.module, call.input, outer]
        else:
            entry[2] += outer

    def conv_blocks(self, name, call, d, rows):
        """Adds Σ g² of an ungrouped conv weight from per-example gradients formed a block of output channels at a
        time, each block (B·m·out_block·C·kk ≤ :data:`BLOCK_ELEMENTS`) squared and summed while it is in cache,
        for ``rows`` examples at a time (δ (m, B, out, *positions)).
        """
        m, b, o = d.shape[:3]
        total = self.total[name].view(o, -1)  # (out, C·kk)
        if _by_kernel(d[0, 0, 0].numel(), call.input.shape[1]):
            for start in range(0, b, rows):
                sl = slice(start, min(start + rows, b))
                g = _conv_weight_grads_by_kernel(call.module, call.input[sl], d[:, sl])  # (c·m·out, C, *kernel)
                total += g.view(-1, *total.shape).square_().sum(0)
            return
        d = d.flatten(3).transpose(0, 1)  # (B, m, out, L)
        for start in range(0, b, rows):
            sl = slice(start, min(start + rows, b))
            u = _conv_patches(call.module, call.input[sl]) if call.patches is None else call.patches[sl]
            ut = u.transpose(1, 2)  # (c, L, C·kk)
            c = ut.shape[0]
            block = conv_block_channels(c, m, ut.shape[2])
            for o0 in range(0, o, block):
                dd = d[sl, :, o0:o0 + block]  # (c, m, ob, L)
                g = torch.bmm(dd.reshape(c, -1, dd.shape[-1]), ut)  # (c, m·ob, C·kk)
                total[o0:o0 + block] += g.square_().sum(0).view(m, -1, g.shape[-1]).sum(0)

    def finish(self):
        """Contracts the Gram factors of :meth:`gram` with the input patches' (one matmul per group)."""
        for name, (module, a, outer) in self.grams.items():
            total = self.total[name]
            u = _conv_patches(module, a)  # (B, C·kk, L)
            b, ck, length = u.shape
            g, o = module.groups, total.shape[0]
            # symmetric in (l, l'): the pairs l ≤ l' (row by row, by slices: no gather), the off-diagonal ones twice
            pairs = length * (length + 1) // 2
            y = u.reshape(b * ck, length)
            patches = torch.cat([y[:, i:i + 1] * y[:, i:] for i in range(length)], 1).reshape(b, g, ck // g, pairs)
            patches = patches.permute(1, 0, 3, 2).reshape(g, b * pairs, ck // g)
            outer = torch.cat([outer[:, i, i:] * torch.cat([outer.new_ones(1), outer.new_full((length - 1 - i,), 2.0)])
                               for i in range(length)], 1).reshape(b, g, o // g, pairs)
            outer = outer.permute(1, 0, 3, 2).reshape(g, b * pairs, o // g)
            total += torch.bmm(outer.transpose(1, 2), patches).reshape(total.shape)
        self.grams = {}

    def rows_of(self, name, g, sl, owned=False):  # g: (m, c, *shape)
        self.total[name] += _squared(g, owned).sum((0, 1))

    def linear(self, name, attr, a, d):  # Linear on (B, in): Σ_m Σ_n (δ a ᵀ)² = (Σ_m δ²)ᵀ a² (Goodfellow 2015)
        total = self.total[name]  # a one-position conv's weight is (out, in, *kernel): its patch is the input
        if attr == "bias":
            total += d.square().sum((0, 1))
        else:
            total += d.square().sum(0).transpose(0, 1).matmul(a.square()).reshape(total.shape)


class _RowNorms:
    """Accumulates Σ_i w_i g_i² per row (vector, example)."""

    def __init__(self, weights):
        self.weights, self.rows = weights, []

    def start(self, m, batch, f):
        self.rows.append(torch.zeros(m, batch, dtype=f.dtype, device=f.device))

    def finish(self):
        """Nothing to contract at the end: every row is complete after its pass."""

    def rows_of(self, name, g, sl, owned=False):
        self.rows[-1][:, sl] += (_squared(g, owned) * self.weights[name]).flatten(2).sum(2)

    def linear(self, name, attr, a, d):  # Σ_{o,i} δ_o² w_{oi} a_i² = ((δ²) w) · a²
        w = self.weights[name]
        if attr == "bias":
            self.rows[-1] += (d.square() * w).sum(-1)
        else:
            self.rows[-1] += (d.square().matmul(w.reshape(w.shape[0], -1)) * a.square()).sum(-1)


# ---------------------------------------------------------------------- backward
def _backward(f: torch.Tensor, outputs: list[torch.Tensor], v: torch.Tensor) -> list[torch.Tensor | None]:
    """δ = ∂(vᵀ f)/∂z for every recorded output z, each (m, *z.shape) (None where z does not reach f)."""
    if not outputs:
        return []
    v = v.to(f.dtype)
    if v.shape[0] == 1:
        grads = torch.autograd.grad(f, outputs, v[0], retain_graph=True, allow_unused=True)
        return [None if g is None else g.unsqueeze(0) for g in grads]
    try:
        return list(torch.autograd.grad(f, outputs, v, retain_graph=True, allow_unused=True, is_grads_batched=True))
    except RuntimeError:  # an operation without a batching rule for its backward: one vector at a time
        per = [torch.autograd.grad(f, outputs, v[j], retain_graph=True, allow_unused=True) for j in range(v.shape[0])]
        return [None if per[0][k] is None else torch.stack([p[k] for p in per]) for k in range(len(outputs))]


# ---------------------------------------------------------------------- per-layer rules
def _conv_forward(m, a, weight, bias):
    """The module's convolution with explicit tensors (used to verify subclasses)."""
    if m.padding_mode != "zeros":
        a = F.pad(a, m._reversed_padding_repeated_twice, mode=m.padding_mode)
        padding = 0
    else:
        padding = m.padding
    conv = F.conv1d if isinstance(m, nn.Conv1d) else F.conv2d
    return conv(a, weight, bias, m.stride, padding, m.dilation, m.groups)


def _normalised(call: _Call) -> tuple[torch.Tensor, tuple[int, ...]]:
    """x̂ (the input normalised without the affine part) and the dims to sum per example after (m, B)."""
    m, a = call.module, call.input.detach()
    if call.kind == "layernorm":
        xhat = F.layer_norm(a, m.normalized_shape, None, None, m.eps)
        k = len(m.normalized_shape)
        return xhat, tuple(range(2, 1 + a.dim() - k))  # δ is (m, B, ..., *normalized_shape)
    if call.kind == "groupnorm":
        xhat = F.group_norm(a, m.num_groups, None, None, m.eps)
    else:
        shape = (1, -1) + (1,) * (a.dim() - 2)
        mean, var = call.state["running_mean"], call.state["running_var"]
        xhat = (a - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + m.eps)
    return xhat, tuple(range(3, a.dim() + 1))  # δ is (m, B, C, ...)


def _per_row_grads(call: _Call, d: torch.Tensor, sl: slice, attrs=None,
                   keep_patches: bool = False) -> dict[str, torch.Tensor]:
    """Per-(vector, example) gradients of a call's own Bayesian parameters, ``{attr: (m, c, *shape)}``.

    Args:
        call: the recorded call.
        d: δ for all vectors and examples, (m, B, *output_shape).
        sl: the examples (a slice of the batch).
        attrs: the attributes wanted (default: all of the call's Bayesian ones).
        keep_patches: keep a conv's unfolded input on the call for the later passes (the GGN's vector chunks)
            instead of unfolding it again each pass.
    """
    attrs = tuple(call.attrs) if attrs is None else attrs
    d = d[:, sl]
    m, c = d.shape[:2]
    kind = call.kind
    if kind == "module":
        return _module_grads(call, d, sl, attrs)
    out = {}
    if kind == "linear":
        a = call.input[sl]
        if "weight" in attrs:
            a3 = a.reshape(c, -1, a.shape[-1])  # (c, T, in)
            d4 = d.reshape(m, c, -1, d.shape[-1])  # (m, c, T, out)
            lhs = d4.permute(1, 0, 3, 2).reshape(c, m * d4.shape[-1], d4.shape[2])  # (c, m·out, T)
            out["weight"] = torch.bmm(lhs, a3).reshape(c, m, d4.shape[-1], a3.shape[-1]).transpose(0, 1)
        if "bias" in attrs:
            out["bias"] = d.reshape(m, c, -1, d.shape[-1]).sum(2)
        return out
    if kind == "conv":
        mod = call.module
        if "weight" in attrs:
            if call.patches is None and keep_patches:
                call.patches = _conv_patches(mod, call.input)
            u = None if call.patches is None else call.patches[sl]
            out["weight"] = _conv_weight_grads(mod, call.input[sl], d, u)
        if "bias" in attrs:
            out["bias"] = d.flatten(3).sum(3)
        return out
    xhat, dims = _normalised(call)
    if "weight" in attrs:
        prod = d * xhat[sl].unsqueeze(0)
        out["weight"] = prod.sum(dims) if dims else prod
    if "bias" in attrs:
        out["bias"] = d.sum(dims) if dims else d.clone()  # callers square the result in place
    return out


def _padded_input(mod: nn.Module, a: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A conv's input with non-zero or string padding applied explicitly, and the padding left for the kernel."""
    if mod.padding_mode != "zeros" or isinstance(mod.padding, str):
        mode = "constant" if mod.padding_mode == "zeros" else mod.padding_mode
        return F.pad(a, mod._reversed_padding_repeated_twice, mode=mode), (0,) * len(mod.kernel_size)
    return a, mod.padding


def _conv_patches(mod: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """The unfolded input patches of a Conv1d/Conv2d, (c, C·kk, L) for inputs a (c, C, ...): L output positions."""
    one_d = isinstance(mod, nn.Conv1d)
    kernel, stride, dilation = mod.kernel_size, mod.stride, mod.dilation
    a, padding = _padded_input(mod, a)
    if one_d:
        a = a.unsqueeze(2)
        kernel, stride, dilation, padding = (1, *kernel), (1, *stride), (1, *dilation), (0, *padding)
    return _unfold(a, kernel, dilation, padding, stride)


def _unfold(a: torch.Tensor, kernel, dilation, padding, stride) -> torch.Tensor:
    """``F.unfold(a, kernel, dilation, padding, stride)`` (c, C·kh·kw, L) of a (c, C, H, W), by one strided copy per
    kernel offset (the same values, 3–7x faster than the im2col kernel on one CPU core).
    """
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel, dilation, padding, stride
    if ph or pw:
        a = F.pad(a, (pw, pw, ph, ph))
    c, channels, height, width = a.shape
    out_h = (height - dh * (kh - 1) - 1) // sh + 1
    out_w = (width - dw * (kw - 1) - 1) // sw + 1
    out = a.new_empty((c, channels, kh, kw, out_h, out_w))
    for i in range(kh):
        for j in range(kw):
            out[:, :, i, j] = a[:, :, i * dh:i * dh + sh * (out_h - 1) + 1:sh, j * dw:j * dw + sw * (out_w - 1) + 1:sw]
    return out.view(c, channels * kh * kw, out_h * out_w)


def _conv_weight_grads(mod: nn.Module, a: torch.Tensor, d: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row conv weight gradients (m, c, out, in/groups, *kernel) from inputs a (c, C, ...) (or their unfolded
    patches u (c, C·kk, L)) and δ (m, c, out, ...).
    """
    m, c, o = d.shape[:3]
    g = mod.groups
    u = _conv_patches(mod, a) if u is None else u  # (c, C·kk, L)
    length = u.shape[-1]
    u = u.reshape(c * g, -1, length)  # (c·g, C/g·kk, L)
    dd = d.reshape(m, c, g, o // g, length).permute(1, 2, 0, 3, 4).reshape(c * g, m * (o // g), length)
    w = torch.bmm(dd, u.transpose(1, 2))  # (c·g, m·o/g, C/g·kk)
    w = w.reshape(c, g, m, o // g, -1).permute(2, 0, 1, 3, 4).reshape(m, c, *mod.weight.shape)
    return w


def _conv_weight_grads_by_kernel(mod: nn.Module, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Per-row weight gradients of an ungrouped conv, (c·m·out, C, *kernel) in (example, vector, out) order, by one
    call of the convolution's weight-gradient kernel with the c examples as c groups of m·out outputs
    (inputs a (c, C, ...), δ (m, c, out, ...)).
    """
    m, c, o = d.shape[:3]
    kernel, stride, dilation = mod.kernel_size, mod.stride, mod.dilation
    a, padding = _padded_input(mod, a)
    x = a.reshape(1, -1, *a.shape[2:])  # (1, c·C, ...)
    grad_out = d.transpose(0, 1).reshape(1, c * m * o, *d.shape[3:])
    weight = a.new_empty((c * m * o, a.shape[1], *kernel))  # read for its shape only (no input gradient)
    return torch.ops.aten.convolution_backward(grad_out, x, weight, None, stride, padding, dilation, False,
                                               (0,) * len(kernel), c, (False, True, False))[1]


# ---------------------------------------------------------------------- fallbacks
def _rule_applies(call: _Call, batch: int) -> bool:
    """Whether a call's rule can run: a tensor output and inputs batched along dim 0 (else: whole network)."""
    out = call.output
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.shape[0] != batch:
        return False
    if call.kind == "module":
        leaves = [t for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, torch.Tensor)]
        return any(t.dim() > 0 and t.shape[0] == batch for t in leaves)
    a = call.input
    if not isinstance(a, torch.Tensor) or a.dim() < 2 or a.shape[0] != batch or a.is_complex():
        return False
    if call.kind == "conv":
        return a.dim() == call.module.weight.dim() and len(call.args) + len(call.kwargs) == 1
    if call.kind == "linear":
        return out.shape[:-1] == a.shape[:-1]
    return out.shape == a.shape


def _module_grads(call: _Call, d: torch.Tensor, sl: slice, attrs) -> dict[str, torch.Tensor]:
    """Per-row gradients of a module's own parameters by vmap over examples of its own vjp."""
    batch = call.output.shape[0]
    state = call.state
    params = {a: state[a] for a in call.attrs}
    leaves, spec = tree_flatten((call.args, call.kwargs))
    batched = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch]
    module = call.module

    def one(inputs, d1):
        full = list(leaves)
        for i, t in zip(batched, inputs):
            full[i] = t.unsqueeze(0)  # a batch of one, as the reference runs each example
        args, kwargs = tree_unflatten(full, spec)

        def fn(p):
            return functional_call(module, {**state, **p}, tuple(args), kwargs, tie_weights=True, strict=False)

        _, vjp_fn = vjp(fn, params)
        return vmap_over_examples(vjp_fn)(d1.unsqueeze(1))[0]

    with sdpa_kernel([SDPBackend.MATH]):  # the fused attention kernels have no batching rule
        grads = vmap_over_examples(one, in_dims=(0, 1))([leaves[i][sl] for i in batched], d)  # {attr: (c, m, ...)}
    return {a: grads[a].transpose(0, 1) for a in attrs}


def _network_grads(forward, theta, names, x, v, rows: int, acc) -> None:
    """Per-row gradients of ``names`` by vmap over examples of the whole network's vjp (the reference rule)."""
    fixed = {n: t.detach() for n, t in theta.items() if n not in names}
    params = {n: theta[n].detach() for n in names}
    batch = v.shape[1]

    def one(x1, v1):
        x1 = tree_map(lambda t: t.unsqueeze(0), x1)
        _, vjp_fn = vjp(lambda p: forward({**fixed, **p}, x1), params)
        return vmap_over_examples(vjp_fn)(v1.unsqueeze(1))[0]

    for start in range(0, batch, rows):
        sl = slice(start, min(start + rows, batch))
        xs = tree_map(lambda t: t[sl], x)
        with sdpa_kernel([SDPBackend.MATH]):  # the fused attention kernels have no batching rule
            g = vmap_over_examples(one, in_dims=(0, 1))(xs, v[:, sl].to(next(iter(params.values())).dtype))
        for n in names:
            acc.rows_of(n, g[n].transpose(0, 1), sl)

