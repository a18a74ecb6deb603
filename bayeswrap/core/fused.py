"""Fused hot-path kernels with analytic gradients (``torch.autograd.Function`` + foreach ops).

Every training step of a Bayesian method does a few passes over all
parameters besides the network itself: drawing a sample, the KL or prior term,
and their gradients. Written as plain per-tensor autograd expressions these
are ~15–20 elementwise passes and ~10 small ops per parameter tensor. The
functions here compute the same values with multi-tensor (``torch._foreach_*``)
kernels and write the gradients in closed form, so no intermediate is kept for
backward beyond the tensors autograd keeps anyway.

The plain autograd versions are kept as the reference implementations
(``VI(..., fused=False)``, ``GaussianPrior.penalty(..., fused=False)``); the
tests check that both give the same loss and gradients.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

#: elements per bucket of the per-parameter passes: small enough that a bucket's temporaries stay in a
#: CPU's L2/L3 cache and add little to peak memory, large enough to amortise the per-call overhead
BUCKET_NUMEL = 1 << 18


def buckets(tensors: Sequence[torch.Tensor], max_numel: int | None = None) -> list[list[int]]:
    """Consecutive groups of tensor indices holding at most ``max_numel`` elements each.

    A tensor larger than ``max_numel`` forms a bucket of its own. The hot-path
    kernels below process one bucket at a time, so their temporaries are
    bucket-sized instead of model-sized (peak memory), and they stay in cache
    between passes (speed).

    Args:
        tensors: the tensors to group, in order.
        max_numel: the bucket size in elements, an integer ≥ 1 (default :data:`BUCKET_NUMEL`).

    Returns:
        A list of lists of indices into ``tensors``, covering each index once, in order.
    """
    max_numel = BUCKET_NUMEL if max_numel is None else max_numel
    groups: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if not groups or size + n > max_numel:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


#: elements per independently seeded stream of :func:`random_buckets` on the CPU
RNG_CHUNK = 1 << 18
#: :func:`random_buckets` draws at least this many elements on the CPU from parallel streams (below it, one
#: call of the generator: the same stream as before the streams existed, so small models reproduce earlier runs)
RNG_PARALLEL_MIN = 1 << 21
_MASK64 = (1 << 64) - 1
_pool_state: dict = {}


def _stream_seed(base: int, index: int) -> int:
    """SplitMix64 of ``base + index``: decorrelated 63-bit seeds for consecutive streams (Steele et al. 2014)."""
    z = (base + 0x9E3779B97F4A7C15 * (index + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _thread_pool(workers: int):
    """A process-local thread pool (re-created after a fork or a change of thread count)."""
    from concurrent.futures import ThreadPoolExecutor

    key = (os.getpid(), workers)
    if _pool_state.get("key") != key:
        _pool_state["pool"] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bayeswrap-rng")
        _pool_state["key"] = key
    return _pool_state["pool"]


def random_buckets(tensors: Sequence[torch.Tensor], groups: list[list[int]], kind: str = "normal",
                   generator: torch.Generator | None = None, *,
                   out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One flat buffer of i.i.d. N(0, 1) (``kind="normal"``) or U[0, 1) (``"uniform"``) draws per bucket.

    On a GPU, and for fewer than :data:`RNG_PARALLEL_MIN` elements in all, the
    draws are one ``normal_``/``uniform_`` call of ``generator`` split into the
    buckets (the stream of a single ``torch.randn``/``torch.rand`` over all the
    tensors). Otherwise on the CPU, where PyTorch's Mersenne Twister draws one element at a time
    (about 4–5 ns per element, often the largest per-parameter cost of a
    training step), the buffers are cut into streams of :data:`RNG_CHUNK`
    elements, each with its own generator seeded from one 63-bit draw of
    ``generator`` (SplitMix64-decorrelated seeds), and the streams are filled
    by ``torch.get_num_threads()`` threads. The draws are exact i.i.d. N(0, 1)
    or U[0, 1) and depend only on the state of ``generator`` (or the global
    RNG), not on the number of threads.

    Args:
        tensors: reference tensors (same dtype and device), e.g. the means.
        groups: buckets of indices into ``tensors`` (:func:`buckets`).
        kind: ``"normal"`` or ``"uniform"``.
        generator: optional ``torch.Generator``; the global RNG by default.
        out: optional buffers to fill instead of new ones: one contiguous 1-D tensor per bucket, of the
            bucket's size, dtype and device (e.g. a buffer kept across steps: a large tensor allocated afresh
            costs its page faults on every step). The same draws either way.

    Returns:
        A list with one 1-D tensor per bucket, holding as many elements as the bucket's tensors (``out``'s
        tensors when given).

    Raises:
        ValueError: for an unknown ``kind``, or ``out`` not matching the buckets.
    """
    if kind not in ("normal", "uniform"):
        raise ValueError(f"kind={kind!r} is not accepted; accepted: 'normal', 'uniform'")
    ref = tensors[0]
    sizes = [sum(tensors[i].numel() for i in idx) for idx in groups]
    if out is not None and [(b.shape, b.dtype, b.device) for b in out] != \
            [(torch.Size([n]), ref.dtype, ref.device) for n in sizes]:
        raise ValueError(f"out={[(tuple(b.shape), b.dtype, str(b.device)) for b in out]} does not match the buckets; "
                         f"accepted: 1-D tensors of sizes {sizes}, dtype {ref.dtype}, device {ref.device}")
    if ref.device.type != "cpu" or sum(sizes) < RNG_PARALLEL_MIN or torch.compiler.is_compiling():
        # one call of the generator, split per bucket (traced by torch.compile: inductor draws its own numbers)
        if out is not None and len(out) != 1:  # one call over the buckets laid end to end
            flat = torch.empty(sum(sizes), device=ref.device, dtype=ref.dtype)
            (flat.normal_ if kind == "normal" else flat.uniform_)(generator=generator)
            for b, chunk in zip(out, flat.split(sizes)):
                b.copy_(chunk)
            return list(out)
        flat = out[0] if out is not None else torch.empty(sum(sizes), device=ref.device, dtype=ref.dtype)
        (flat.normal_ if kind == "normal" else flat.uniform_)(generator=generator)
        return list(flat.split(sizes)) if out is None else list(out)
    flats = list(out) if out is not None else [torch.empty(n, device=ref.device, dtype=ref.dtype) for n in sizes]
    base = int(torch.randint(0, 2**62, (1,), generator=generator))
    pieces = [piece for flat in flats for piece in flat.split(RNG_CHUNK)]

    def fill(index: int) -> None:
        stream = torch.Generator().manual_seed(_stream_seed(base, index))
        piece = pieces[index]
        (piece.normal_ if kind == "normal" else piece.uniform_)(generator=stream)

    workers = min(torch.get_num_threads(), len(pieces))
    if workers > 1:
        list(_thread_pool(workers).map(fill, range(len(pieces))))
    else:
        for index in range(len(pieces)):
            fill(index)
    return flats


def _views(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` split into views shaped like ``tensors``."""
    return [chunk.view(t.shape) for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def _draws_like(tensors: Sequence[torch.Tensor], kind: str, generator: torch.Generator | None) -> list[torch.Tensor]:
    """Draws of :func:`random_buckets` split into tensors shaped like ``tensors``.

    Under a ``torch.func`` transform (see :func:`available`) each draw is an
    out-of-place ``randn_like``/``rand_like`` instead, which ``vmap`` batches
    (different draws per vmapped member with ``randomness="different"``).
    """
    tensors = list(tensors)
    if _under_transform() and generator is None:
        draw = torch.randn_like if kind == "normal" else torch.rand_like
        return [draw(t) for t in tensors]
    groups = buckets(tensors)
    out: list[torch.Tensor] = []
    for idx, flat in zip(groups, random_buckets(tensors, groups, kind, generator)):
        out.extend(_views(flat, [tensors[i] for i in idx]))
    return out


def standard_normal_like(tensors: Sequence[torch.Tensor], generator: torch.Generator | None = None,
                         ) -> list[torch.Tensor]:
    """ε ~ N(0, I) shaped like each tensor, drawn by :func:`random_buckets`.

    The draws are exactly those of :func:`mean_field_sample` under the same RNG
    state, so the fused and reference VI paths see the same ε.

    Args:
        tensors: reference tensors (same dtype and device).
        generator: optional ``torch.Generator``.

    Returns:
        A list of tensors of the reference shapes.
    """
    return _draws_like(tensors, "normal", generator)


def _sum_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(tensors)).pow(2).sum()


#: the largest factor by which :func:`log_std`'s slope exceeds κ: beyond |κρ/b| = acosh(LOG_STD_MAX_SLOPE) the map
#: continues linearly, so that a step far below (or above) the reference moves log s by a bounded amount
LOG_STD_MAX_SLOPE = 5.0


def log_std(rho: torch.Tensor, scale: float, ref: float = 0.0, knee: float | None = None) -> torch.Tensor:
    """U = log s of the std parameterisation of :class:`bayeswrap.VI`, elementwise.

    u = ref + κ ρ without a knee. With a knee b > 0 and x = κ ρ / b,
    u = ref + b [sinh(x̂) + M (x − x̂)] with x̂ = clamp(x, −X, X), X = acosh(M) and
    M = :data:`LOG_STD_MAX_SLOPE`: the slope du/dρ = κ cosh(x̂) is κ at the reference,
    grows with the distance from it, and is κ M beyond b sinh(X) nats (see the
    :mod:`bayeswrap.methods.vi` docstring).

    Args:
        rho: ρ, any shape.
        scale: κ > 0.
        ref: the reference log-std (nats), where ρ = 0.
        knee: b > 0 in nats, or None for the linear map.

    Returns:
        u, the shape of ``rho``.
    """
    if knee is None:
        return rho * scale + ref if ref else rho * scale
    edge = math.acosh(LOG_STD_MAX_SLOPE)
    x = rho * (scale / knee)
    inner = x.clamp(-edge, edge)
    return (torch.sinh(inner) + (x - inner) * LOG_STD_MAX_SLOPE) * knee + ref


def log_std_slope(rho: torch.Tensor, scale: float, knee: float | None = None) -> torch.Tensor:
    """du/dρ of :func:`log_std`: κ, or κ cosh(clamp(κ ρ / b, −X, X)), the shape of ``rho``."""
    if knee is None:
        return torch.full_like(rho, scale)
    edge = math.acosh(LOG_STD_MAX_SLOPE)
    return torch.cosh((rho * (scale / knee)).clamp(-edge, edge)) * scale


def log_std_inverse(u, scale: float, ref: float = 0.0, knee: float | None = None):
    """ρ with :func:`log_std` (ρ) = u, for a Python float or elementwise for a tensor (same type back)."""
    if knee is None:
        return (u - ref) / scale
    edge = math.acosh(LOG_STD_MAX_SLOPE)
    y = (u - ref) / knee
    if torch.is_tensor(y):
        side = torch.sign(y)
        outer = side * edge + (y - side * math.sinh(edge)) / LOG_STD_MAX_SLOPE
        return torch.where(y.abs() <= math.sinh(edge), torch.asinh(y), outer) * (knee / scale)
    if abs(y) <= math.sinh(edge):
        return knee * math.asinh(y) / scale
    side = math.copysign(1.0, y)
    return knee * (side * edge + (y - side * math.sinh(edge)) / LOG_STD_MAX_SLOPE) / scale


class _MeanFieldBucket(torch.autograd.Function):
    """θ = m + exp(u(ρ)) ⊙ ε and the bucket's KL(N(m, s²) || N(θ̄, σ²)) terms, gradients in closed form.

    u(ρ) is :func:`log_std` (κρ, or the reference plus b sinh(κρ/b) with a knee b).

    Inputs: ``(info, *m, *rho)`` for one bucket (``info``'s last entry: the bucket's flat N(0, 1)
    draws from :func:`random_buckets`, which θ overwrites: θ are views of that buffer, so the
    sample allocates nothing model-sized besides the draws); outputs ``(*theta, kl)``.
    Saved for backward: m and ρ (the parameters themselves) and θ (which the
    network keeps for its own backward anyway); s = exp(κρ) is recomputed
    there rather than kept (and u's slope), and θ − m = s ⊙ ε gives ε's contribution without
    storing ε. One node per bucket: when it has run, the bucket's θ and its
    incoming gradient are freed while its parameter gradients are created, so
    peak memory holds θ and ∂L/∂θ once, plus one bucket of temporaries.
    """

    @staticmethod
    def forward(ctx, info, *tensors):
        n, prior_pos, prior_means, var0, log_std0, kappa, ref, knee, eps = info
        info[-1] = None  # the draws become θ (below); the node does not keep a reference of its own
        m, rho = list(tensors[:n]), list(tensors[n:])
        if knee is None and not ref:
            u = torch._foreach_mul(rho, kappa)
        else:
            u = [log_std(r, kappa, ref, knee) for r in rho]
        log_s = torch.stack([u[i].sum() for i in prior_pos]).sum() if prior_pos else None  # Σ log s
        torch._foreach_exp_(u)
        s = u
        # θ = m + s ⊙ ε written over ε (the bucket's own draws): θ needs no buffer of its own. Not when ε is a
        # slice of draws shared with other buckets (random_buckets' one-call path): writing there would modify
        # the base of the other buckets' θ in place, which autograd refuses for a Function's view outputs
        shared = eps._base is not None and eps._base.numel() != eps.numel()
        theta = [torch.addcmul(mi, si, ei) if shared else torch.addcmul(mi, si, ei, out=ei)
                 for mi, si, ei in zip(m, s, _views(eps, m))]
        kl = m[0].new_zeros(())
        if prior_pos:
            mp, sp = [m[i] for i in prior_pos], [s[i] for i in prior_pos]
            diff = torch._foreach_sub(mp, prior_means)
            count = sum(t.numel() for t in mp)
            kl = (_sum_squares(diff) + _sum_squares(sp)) / (2 * var0) - log_s + count * (log_std0 - 0.5)
        ctx.info = (n, prior_pos, prior_means, var0, kappa, ref, knee)
        ctx.save_for_backward(*m, *rho, *theta)
        return (*theta, kl)

    @staticmethod
    def backward(ctx, *grads):
        n, prior_pos, prior_means, var0, kappa, ref, knee = ctx.info
        saved = ctx.saved_tensors
        m, rho, theta = (list(saved[i * n:(i + 1) * n]) for i in range(3))
        g = [torch.zeros_like(t) if gi is None else gi for gi, t in zip(grads[:n], theta)]
        k = 0.0 if grads[n] is None or not prior_pos else float(grads[n])  # d loss / d KL
        # ∂L/∂s = g ⊙ ε + k (s/σ² − 1/s) and ∂s/∂ρ = s du/dρ, so with s ε = θ − m
        # ∂L/∂ρ = du/dρ [g ⊙ (θ − m) + k (s²/σ² − 1)]  (no division by s)
        if knee is None:  # du/dρ = κ: two multiply-adds per element, the gradient written once
            return (None, *_mean_field_grad_m(g, m, prior_pos, prior_means, k / var0 if k else 0.0),
                    *_linear_map_grad_rho(g, m, rho, theta, prior_pos if k else [], kappa, ref, k / var0, k))
        grad_rho = torch._foreach_sub(theta, m)
        torch._foreach_mul_(grad_rho, g)
        grad_m = list(g)  # ∂L/∂m = g + k (m − θ̄)/σ²
        if k:
            gp = [grad_rho[i] for i in prior_pos]
            rp = [rho[i] for i in prior_pos]  # s recomputed (the same operations as the forward's)
            sp = torch._foreach_mul(rp, kappa) if knee is None and not ref else [log_std(r, kappa, ref, knee)
                                                                                 for r in rp]
            torch._foreach_exp_(sp)
            torch._foreach_addcmul_(gp, sp, sp, value=k / var0)
            torch._foreach_add_(gp, -k)
            diff = torch._foreach_sub([m[i] for i in prior_pos], prior_means)
            for i, t in zip(prior_pos, torch._foreach_add([g[i] for i in prior_pos], diff, alpha=k / var0)):
                grad_m[i] = t
        if knee is None:
            torch._foreach_mul_(grad_rho, kappa)
        else:
            torch._foreach_mul_(grad_rho, [log_std_slope(r, kappa, knee) for r in rho])
        return (None, *grad_m, *grad_rho)


def _mean_field_grad_m(g, m, prior_pos, prior_means, c: float) -> list[torch.Tensor]:
    """∂L/∂m = g + c (m − θ̄) for the tensors with a prior (c = k/σ²), g itself for the others (or c = 0)."""
    grad_m = list(g)
    if c and prior_pos:
        diff = torch._foreach_sub([m[i] for i in prior_pos], prior_means)
        for i, t in zip(prior_pos, torch._foreach_add([g[i] for i in prior_pos], diff, alpha=c)):
            grad_m[i] = t
    return grad_m


def _linear_map_grad_rho(g, m, rho, theta, prior_pos, kappa: float, ref: float, c: float,
                         k: float) -> list[torch.Tensor]:
    """∂L/∂ρ = κ g ⊙ (θ − m) + κ k (s²/σ² − 1) under u = κρ + ref (c = k/σ²; the KL term only at ``prior_pos``).

    Written as addcmul(−κk, s, s, κc) then addcmul(·, θ − m, g, κ) (and addcmul(0, θ − m, g, κ) without a
    prior term): the gradient is written once and s is recomputed from ρ by the forward's operations.
    """
    diffs = torch._foreach_sub(theta, m)  # s ⊙ ε, one bucket of temporaries
    out: list[torch.Tensor | None] = [None] * len(m)
    if prior_pos:
        sp = torch._foreach_mul([rho[i] for i in prior_pos], kappa)
        if ref:
            torch._foreach_add_(sp, ref)
        torch._foreach_exp_(sp)
        offset = sp[0].new_full((), -kappa * k)
        for i, s in zip(prior_pos, sp):
            out[i] = torch.addcmul(offset, s, s, value=kappa * c).addcmul_(diffs[i], g[i], value=kappa)
    zero = m[0].new_zeros(())
    for i, t in enumerate(out):
        if t is None:
            out[i] = torch.addcmul(zero, diffs[i], g[i], value=kappa)
    return out


def mean_field_sample(m: list[torch.Tensor], rho: list[torch.Tensor], prior_idx: list[int],
                      prior_means: list[torch.Tensor], prior_std: float, log_std_scale: float = 1.0,
                      generator: torch.Generator | None = None, *, log_std_ref: float = 0.0,
                      log_std_knee: float | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Reparameterised sample of a mean-field Gaussian and its analytic KL to N(θ̄, σ² I).

    θ_i = m_i + s_i ε_i with s_i = exp(u(ρ_i)), u = :func:`log_std` (κρ, or
    ref + b sinh(κρ/b) with a knee b) and ε ~ N(0, I) (Blundell et al.
    2015; the std parameterisation of :class:`bayeswrap.VI`), and
    KL = Σ_{i ∈ prior_idx} [log(σ/s_i) + (s_i² + (m_i − θ̄_i)²)/(2σ²) − 1/2]
    (BayesDLL eq. 7). Gradients w.r.t. m and ρ are written in closed form.
    The tensors are processed in buckets of about :data:`BUCKET_NUMEL`
    elements (one autograd node each), so the temporaries are bucket-sized;
    ε comes from :func:`random_buckets`, exactly as :func:`standard_normal_like` draws it.

    Args:
        m: variational means, one tensor per parameter.
        rho: the std parameters ρ (u(ρ) = log s), same shapes.
        prior_idx: indices of the tensors that have a prior (the others get no KL term).
        prior_means: θ̄ for the tensors in ``prior_idx``, in that order.
        prior_std: σ > 0.
        log_std_scale: κ > 0.
        generator: optional ``torch.Generator`` for ε.
        log_std_ref: the reference log-std of :func:`log_std` (nats).
        log_std_knee: its knee b > 0 (nats), or None for u = ref + κρ.

    Returns:
        ``(theta, kl)``: the sampled tensors (shapes of ``m``) and the scalar KL in nats.
    """
    var0, log_std0, kappa = float(prior_std) ** 2, math.log(prior_std), float(log_std_scale)
    prior_mean_of = dict(zip(prior_idx, prior_means))
    theta: list[torch.Tensor] = []
    kl = None
    groups = buckets(m)
    noise = random_buckets(m, groups, "normal", generator)
    for b, idx in enumerate(groups):
        prior_pos = [j for j, i in enumerate(idx) if i in prior_mean_of]
        info = [len(idx), prior_pos, [prior_mean_of[idx[j]] for j in prior_pos], var0, log_std0, kappa,
                float(log_std_ref), None if log_std_knee is None else float(log_std_knee), noise[b]]
        noise[b] = None  # the bucket's draws are overwritten by its θ
        out = _MeanFieldBucket.apply(info, *[m[i] for i in idx], *[rho[i] for i in idx])
        theta.extend(out[:-1])
        kl = out[-1] if kl is None else kl + out[-1]
    return theta, kl


class _DropoutBucket(torch.autograd.Function):
    """θ = z ⊙ m + (1 − z) ⊙ θ̄ with z_i = [u_i ≥ p_i], and the bucket's Σ_i c_i ‖m_i − θ̄_i‖², gradients in closed form.

    Inputs: ``(info, u, *m)`` for one bucket (``u``: the bucket's flat U[0, 1) draws
    from :func:`random_buckets`); outputs ``(*theta, penalty)``. Saved for
    backward: m and the keep masks z (one byte per element).
    ∂L/∂m_i = z_i ⊙ g_i + 2 k c_i (m_i − θ̄_i), with g = ∂L/∂θ and k = ∂L/∂penalty.
    """

    @staticmethod
    def forward(ctx, info, u, *m):
        probs, means, scales = info
        keep = [v >= p for v, p in zip(_views(u, m), probs)]
        theta = [torch.where(z, mi, mean) for z, mi, mean in zip(keep, m, means)]
        penalty = _scaled_sum_squares(m, means, scales)
        ctx.info = info
        ctx.save_for_backward(*m, *keep)
        return (*theta, penalty)

    @staticmethod
    def backward(ctx, *grads):
        probs, means, scales = ctx.info
        n = len(probs)
        saved = ctx.saved_tensors
        m, keep = saved[:n], saved[n:]
        k = 0.0 if grads[n] is None else float(grads[n])
        out = []
        for g, z, mi, mean, c in zip(grads[:n], keep, m, means, scales):
            gm = torch.zeros_like(mi) if g is None else torch.where(z, g, 0.0)
            if k and c:  # the operations of the unfused reference (where's and the penalty's gradients, summed)
                gm.add_((mi - mean).mul_(2.0 * c * k))
            out.append(gm)
        return (None, None, *out)


#: :func:`dropout_sample` draws the positions of the dropped elements (geometric gaps) instead of one uniform per
#: element for drop probabilities up to this value: ~p draws per element instead of 1, and θ a copy of m with the
#: dropped elements overwritten instead of a masked select
SPARSE_DROP_MAX_P = 0.25


def _sparse_drops(tensors: Sequence[torch.Tensor], probs: Sequence[float]) -> bool:
    """Whether :func:`drop_positions` draws the drops of ``tensors``: on the CPU, outside ``torch.func`` transforms
    and ``torch.compile`` (its data-dependent sizes would break the graph), for at least :data:`RNG_PARALLEL_MIN`
    elements in all (smaller models keep the one-uniform-per-element stream of earlier versions) and every
    p ≤ :data:`SPARSE_DROP_MAX_P`.
    """
    return (bool(tensors) and tensors[0].device.type == "cpu" and available()
            and not torch.compiler.is_compiling()
            and all(0.0 < p <= SPARSE_DROP_MAX_P for p in probs)
            and sum(t.numel() for t in tensors) >= RNG_PARALLEL_MIN)


def _bernoulli_positions(length: int, p: float, generator: torch.Generator | None,
                         device: torch.device) -> torch.Tensor:
    """Sorted positions in [0, ``length``) of the successes of ``length`` i.i.d. Bernoulli(p) trials (int64).

    The gaps between successes are i.i.d. Geometric(p) on {1, 2, ...}, drawn by inversion from float64
    uniforms (G = 1 + ⌊log(1 − u) / log(1 − p)⌋, u ~ U[0, 1): P(G = k) = (1 − p)^(k−1) p), so the positions are
    their cumulative sums minus one; about ``length · p`` draws instead of ``length``.
    """
    mean = length * p
    chunk = int(mean + 6.0 * math.sqrt(mean * (1.0 - p))) + 16
    log_q = math.log1p(-p)
    parts: list[torch.Tensor] = []
    end = -1  # the last position drawn so far
    while end < length - 1:
        u = torch.empty(chunk, dtype=torch.float64, device=device).uniform_(generator=generator)
        gaps = torch.rsub(u, 1.0).log_().div_(log_q).floor_().add_(1.0).to(torch.int64)
        pos = gaps.cumsum_(0).add_(end)
        parts.append(pos)
        end = int(pos[-1])
        chunk = max(16, chunk // 8)
    pos = parts[0] if len(parts) == 1 else torch.cat(parts)
    return pos[:int(torch.searchsorted(pos, length))]


def drop_positions(tensors: Sequence[torch.Tensor], probs: Sequence[float],
                   generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """The flat indices of the dropped elements of each tensor: i.i.d. Bernoulli(p_i) per element.

    The tensors of one drop probability are laid end to end and the positions of the drops in that sequence
    are drawn by :func:`_bernoulli_positions` (geometric gaps), then cut per tensor.

    Args:
        tensors: reference tensors (same device).
        probs: drop probabilities p_i in (0, 1), one per tensor.
        generator: optional ``torch.Generator`` (the global RNG by default).

    Returns:
        One sorted 1-D int64 tensor per tensor, of indices into ``tensor.reshape(-1)``.
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for p in dict.fromkeys(probs):
        idx = [i for i, q in enumerate(probs) if q == p]
        starts = [0]
        for i in idx:
            starts.append(starts[-1] + tensors[i].numel())
        pos = _bernoulli_positions(starts[-1], float(p), generator, tensors[idx[0]].device)
        cuts = torch.searchsorted(pos, torch.tensor(starts, dtype=torch.int64, device=pos.device)).tolist()
        for j, i in enumerate(idx):
            out[i] = pos[cuts[j]:cuts[j + 1]] - starts[j]
    return out


def dropout_keep_masks(tensors: Sequence[torch.Tensor], probs: Sequence[float],
                       generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Keep masks z_i = [element kept], exactly the draws :func:`dropout_sample` makes under the same RNG state.

    Args:
        tensors: reference tensors (same dtype and device).
        probs: drop probabilities p_i in (0, 1), one per tensor.
        generator: optional ``torch.Generator``.

    Returns:
        One bool tensor per tensor, of its shape: True where the element is kept (probability 1 − p_i).
    """
    if _sparse_drops(tensors, probs):
        masks = []
        for t, pos in zip(tensors, drop_positions(tensors, probs, generator)):
            keep = torch.ones(t.shape, dtype=torch.bool, device=t.device)
            keep.view(-1).index_fill_(0, pos, False)
            masks.append(keep)
        return masks
    return [u >= p for u, p in zip(uniform_like(tensors, generator), probs)]


class _SparseDropoutBucket(torch.autograd.Function):
    """:class:`_DropoutBucket` from the positions of the dropped elements (:func:`drop_positions`).

    θ_i is a copy of m_i with the dropped elements set to θ̄_i; the backward writes
    z_i ⊙ g_i + 2 k c_i (m_i − θ̄_i) as (2 k c_i (m_i − θ̄_i)) + g_i with the dropped elements kept at their first
    term, the same floating-point operations as the reference's sum of the two gradients. Saved for backward: m
    and the positions (8 bytes per dropped element).
    """

    @staticmethod
    def forward(ctx, info, *m):
        positions, means, scales = info
        theta = []
        for mi, pos, mean in zip(m, positions, means):
            t = mi.clone(memory_format=torch.contiguous_format)
            t.view(-1).index_copy_(0, pos, mean.reshape(-1).index_select(0, pos))
            theta.append(t)
        penalty = _scaled_sum_squares(m, means, scales)
        ctx.info = info
        ctx.save_for_backward(*m)
        return (*theta, penalty)

    @staticmethod
    def backward(ctx, *grads):
        positions, means, scales = ctx.info
        n = len(positions)
        k = 0.0 if grads[n] is None else float(grads[n])
        out = []
        for g, mi, pos, mean, c in zip(grads[:n], ctx.saved_tensors, positions, means, scales):
            if k and c:
                gm = (mi - mean).mul_(2.0 * c * k)
                if g is not None:
                    dropped = gm.view(-1).index_select(0, pos)
                    gm.add_(g)
                    gm.view(-1).index_copy_(0, pos, dropped)
            else:
                gm = torch.zeros_like(mi) if g is None else g.clone(memory_format=torch.contiguous_format)
                gm.view(-1).index_fill_(0, pos, 0.0)
            out.append(gm)
        return (None, *out)


def _scaled_sum_squares(m, means, scales) -> torch.Tensor:
    """Σ_i c_i ‖m_i − θ̄_i‖² over the terms with c_i ≠ 0 (a zero scalar without any)."""
    pen = [(mi, mean, c) for mi, mean, c in zip(m, means, scales) if c]
    if not pen:
        return m[0].new_zeros(())
    diff = torch._foreach_sub([t[0] for t in pen], [t[1] for t in pen])
    norms = torch.stack(torch._foreach_norm(diff))
    return (norms.square() * norms.new_tensor([t[2] for t in pen])).sum()


def dropout_sample(m: list[torch.Tensor], probs: list[float], means: list[torch.Tensor], scales: list[float],
                   generator: torch.Generator | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A parameter-dropout sample towards θ̄ and its Gaussian penalty, bucket by bucket.

    θ_i = z_i ⊙ m_i + (1 − z_i) ⊙ θ̄_i with z_i ~ Bernoulli(1 − p_i) elementwise, and the penalty
    Σ_i c_i ‖m_i − θ̄_i‖² (BayesDLL eq. 10 with c_i = (1 − p_i)/(2σ²)). Gradients
    w.r.t. m are written in closed form; temporaries are bucket-sized.

    The drops come from :func:`drop_positions` (geometric gaps between the dropped elements, about p draws
    per element) on the CPU for large models with every p ≤ :data:`SPARSE_DROP_MAX_P`, else from
    z_i = [u_i ≥ p_i] with u ~ U[0, 1) from :func:`random_buckets`; :func:`dropout_keep_masks` gives the same
    masks under the same RNG state.

    Args:
        m: the kept values, one tensor per parameter, each with p_i > 0.
        probs: drop probabilities p_i in (0, 1).
        means: prior means θ̄_i (the dropped value), same shapes as ``m``.
        scales: penalty factors c_i ≥ 0 (0: no penalty term).
        generator: optional ``torch.Generator`` for the draws.

    Returns:
        ``(theta, penalty)``: the sampled tensors and the scalar penalty in nats.
    """
    groups = buckets(m)
    sparse = _sparse_drops(m, probs)
    noise = drop_positions(m, probs, generator) if sparse else random_buckets(m, groups, "uniform", generator)
    theta: list[torch.Tensor] = []
    total = None
    for b, idx in enumerate(groups):
        if sparse:
            info = ([noise[i] for i in idx], [means[i] for i in idx], [scales[i] for i in idx])
            out = _SparseDropoutBucket.apply(info, *[m[i] for i in idx])
        else:
            info = ([probs[i] for i in idx], [means[i] for i in idx], [scales[i] for i in idx])
            u, noise[b] = noise[b], None
            out = _DropoutBucket.apply(info, u, *[m[i] for i in idx])
            del u
        theta.extend(out[:-1])
        total = out[-1] if total is None else total + out[-1]
    return theta, total


def uniform_like(tensors: Sequence[torch.Tensor], generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """U ~ U[0, 1) shaped like each tensor, drawn by :func:`random_buckets` (the draws of :func:`dropout_sample`'s
    dense path under the same RNG state; :func:`dropout_keep_masks` gives its masks on either path).

    Args:
        tensors: reference tensors (same dtype and device).
        generator: optional ``torch.Generator``.

    Returns:
        A list of tensors of the reference shapes.
    """
    return _draws_like(tensors, "uniform", generator)


def available() -> bool:
    """Whether the fused kernels may run here: not inside a ``torch.func`` transform (``vmap``, ``grad``), and
    not while ``torch.compile`` traces.

    Their ``autograd.Function`` classes have no functorch rules, so a caller
    under a transform (e.g. an ensemble's members evaluated under ``vmap``) takes
    the plain-tensor path, which computes the same values. Under ``torch.compile``
    (``bw.fit(..., compile=True)``, :mod:`bayeswrap.compiled`) their backward reads the incoming gradient as a
    Python number, a graph break; the plain expressions trace into one graph, which inductor fuses itself.
    """
    return not _under_transform() and not torch.compiler.is_compiling()


def _under_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``) is active here."""
    return torch._C._are_functorch_transforms_active()


class _GaussianPenalty(torch.autograd.Function):
    """Σ_i c_i ‖θ_i − θ̄_i‖² with gradient 2 c_i (θ_i − θ̄_i), via foreach kernels."""

    @staticmethod
    def forward(ctx, info, *theta):
        means, scales = info
        norms = []  # bucket by bucket: the differences are bucket-sized temporaries, not a model-sized one
        for idx in buckets(theta):
            diff = torch._foreach_sub([theta[i] for i in idx], [means[i] for i in idx])
            norms.extend(torch._foreach_norm(diff))
            del diff
        norms = torch.stack(norms)
        ctx.info = info
        ctx.save_for_backward(*theta)
        return (norms.pow(2) * norms.new_tensor(scales)).sum()

    @staticmethod
    def backward(ctx, grad):
        means, scales = ctx.info
        diff = torch._foreach_sub(list(ctx.saved_tensors), means)
        torch._foreach_mul_(diff, [2.0 * c * float(grad) for c in scales])
        return (None, *diff)


class _PenalisedBucket(torch.autograd.Function):
    """θ passed through (as views) with the bucket's Σ_i c_i ‖θ_i − θ̄_i‖²; backward g_i + 2 k c_i (θ_i − θ̄_i).

    One node carries both the network's and the prior's gradient of θ, so the prior's gradient is added to
    the network's as it passes (bucket-sized temporaries, the same floating-point operations as the
    reference) instead of being a second, model-sized gradient that autograd then sums into the first.
    Saved for backward: θ (the parameters themselves).
    """

    @staticmethod
    def forward(ctx, info, *theta):
        means, scales = info
        ctx.info = info
        ctx.save_for_backward(*theta)
        return (*[t.view_as(t) for t in theta], _scaled_sum_squares(theta, means, scales))

    @staticmethod
    def backward(ctx, *grads):
        means, scales = ctx.info
        n = len(means)
        k = 0.0 if grads[n] is None else float(grads[n])
        out = []
        for g, t, mean, c in zip(grads[:n], ctx.saved_tensors, means, scales):
            if k and c:  # the reference's operations: its prior gradient (θ − θ̄) · 2ck, summed with g
                diff = (t - mean).mul_(2.0 * c * k)
                g = diff if g is None else diff.add_(g)
            out.append(g)
        return (None, *out)


def penalised(theta: list[torch.Tensor], means: list[torch.Tensor], scales: list[float],
              ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """θ as they are (views) together with Σ_i c_i ‖θ_i − θ̄_i‖², bucket by bucket, gradients in closed form.

    The values equal ``theta`` and :func:`gaussian_penalty` (θ, θ̄, c); a loss using both gets the same
    gradient, g_i + 2 k c_i (θ_i − θ̄_i), with the prior's part added to the network's in one pass instead of
    a second model-sized gradient summed by autograd.

    Args:
        theta: parameter tensors.
        means: prior means θ̄_i, same shapes.
        scales: per-tensor factors c_i (e.g. 1/(2σ²)).

    Returns:
        ``(theta_views, penalty)``: views of ``theta`` to use in the forward pass, and the scalar penalty.
    """
    theta = list(theta)
    if not available() or torch.compiler.is_compiling():  # plain ops under vmap/grad and torch.compile
        return theta, gaussian_penalty(theta, means, scales)
    out: list[torch.Tensor] = []
    total = None
    for idx in buckets(theta):
        res = _PenalisedBucket.apply(([means[i] for i in idx], [scales[i] for i in idx]), *[theta[i] for i in idx])
        out.extend(res[:-1])
        total = res[-1] if total is None else total + res[-1]
    return out, total


def gaussian_penalty(theta: list[torch.Tensor], means: list[torch.Tensor], scales: list[float]) -> torch.Tensor:
    """Σ_i c_i ‖θ_i − θ̄_i‖² (a Gaussian negative log prior up to a constant), fused.

    Args:
        theta: parameter tensors.
        means: prior means θ̄_i, same shapes.
        scales: per-tensor factors c_i (e.g. (1 − p)/(2σ²)).

    Returns:
        A scalar tensor.
    """
    if not available():  # under vmap/grad: the same sum with plain ops
        return sum(c * (t - m).pow(2).sum() for t, m, c in zip(theta, means, scales))
    return _GaussianPenalty.apply((list(means), list(scales)), *theta)
