"""MCMC convergence diagnostics: rank-normalised split R-hat, bulk and tail ESS.

Implements the diagnostics of Vehtari, Gelman, Simpson, Carpenter & Bürkner
(2021), "Rank-normalization, folding, and localization: An improved R-hat for
assessing convergence of MCMC", *Bayesian Analysis* 16(2) (section numbers
below refer to that paper), with the numerical conventions of ArviZ
(``az.rhat(..., method="rank")``, ``az.ess(..., method="bulk" | "tail" |
"mean")``), so that the numbers agree with ArviZ to rounding error.

Layout: ``draws`` has shape ``(chains, draws, *shape)`` (the ArviZ layout, as
:meth:`~bayeswrap.methods.mcmc.FullBatchMCMC.chain_draws` returns it); every
element of ``shape`` is an independent scalar quantity, and each function
returns a ``torch.float64`` tensor of shape ``shape`` (0-d for scalar draws).
Torch tensors (any real dtype, CPU or CUDA; computed on their device, MPS
inputs on the CPU) and numpy arrays are accepted; everything is computed in
float64 and vectorised over ``shape`` (processed in column blocks of bounded
memory).

Building blocks, with C chains of N draws:

* **Split chains** (Sect. 3.1): each chain is cut into its first and last
  ``N // 2`` draws (the middle draw is dropped when N is odd), giving
  M = 2C chains of n = N // 2 draws: ``cat([x[:, :n], x[:, N-n:]], dim=0)``.
* **Split R-hat** (Sect. 3.1) of M chains of n draws θ_mi:
  B = n/(M−1) Σ_m (θ̄_m − θ̄)², W = (1/M) Σ_m s_m² with
  s_m² = 1/(n−1) Σ_i (θ_mi − θ̄_m)², var⁺ = (n−1)/n · W + B/n and
  R̂ = sqrt(var⁺ / W).
* **Rank normalisation** (Sect. 4.1): the S = M·n pooled draws are ranked
  (average ranks for ties, r = 1..S) and mapped to normal scores
  z = Φ⁻¹((r − 3/8) / (S + 1/4)) (Blom's fractional offset).
* **Folding** (Sect. 4.2): ζ = |θ − median(θ)| with the median of the pooled
  split draws (the mean of the two middle values).
* **ESS** (Sect. 3.2): with the autocovariances of each chain (via FFT, biased
  estimator divided by n), ρ̂_t = 1 − (W − mean_m ĉ_m,t) / var⁺ (using
  W = mean_m ĉ_m,0 · n/(n−1)), summed with Geyer's initial positive sequence
  (pairs P_k = ρ̂_2k + ρ̂_2k+1 kept while positive), made monotone (each pair
  no larger than the one before), τ̂ = −1 + 2 Σ_k P_k + ρ̂_(last even lag),
  τ̂ ≥ 1/log10(S) (so ESS ≤ S·log10 S for antithetic chains) and ESS = S / τ̂.
* **Localisation** (Sect. 4.3): the ESS of the indicator I(θ ≤ q̂_α) of a
  quantile estimate q̂_α of the pooled (unsplit) draws (type 7 quantile).

Conventions for degenerate draws (those of ArviZ 0.23, except where noted):

* constant draws (every draw of an element equal): :func:`rhat` and
  :func:`split_rhat` give NaN (W = B = 0; R-hat is undefined, as in ArviZ,
  whose rank normalisation maps constant draws to normal scores that are all 0).
  The ESS functions give S, the number of split draws ``2 · chains · (N // 2)``
  (ArviZ returns ``ary.size`` when max − min < 1e-15, ``np.finfo(float).resolution``).
* chains that are each constant but at different values: R-hat is +inf
  (W = 0 < B). Here ArviZ's results carry its rounding: its within-chain
  variances come out tiny but not 0 (rounding), so ``az.rhat`` gives a huge
  finite value (~1e16) instead of +inf; likewise its classic split R-hat of
  a constant whose float mean is inexact (0.1, say) is sqrt((n−1)/n) instead
  of NaN. The within-chain variances here are computed after shifting each
  element by one of its draws, which makes them exactly 0 for constant chains.
* a single chain: :func:`rhat` and :func:`split_rhat` return NaN (ArviZ needs
  two chains before splitting); the ESS functions work with one chain.
* non-finite draws raise ``ValueError`` (ArviZ logs a warning and returns NaN),
  as do fewer than 4 draws per chain (ArviZ: NaN) and fewer than 2 dimensions.

Example:
    >>> import torch
    >>> from bayeswrap import diagnostics
    >>> draws = torch.randn(4, 1000, 3)        # (chains, draws, parameters)
    >>> diagnostics.rhat(draws).shape
    torch.Size([3])
    >>> diagnostics.summary({"w": draws})["summary"]   # doctest: +SKIP
    {'rhat': 1.002, 'ess_bulk': 3871.4, 'ess_tail': 3702.9}
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["rhat", "split_rhat", "ess", "ess_bulk", "ess_tail", "summary"]

#: ``np.finfo(float).resolution``: ArviZ treats draws whose max − min is below this as constant
_RESOLUTION = 1e-15
#: Blom's fractional offset c of the normal scores Φ⁻¹((r − c) / (S − 2c + 1))
_BLOM = 3.0 / 8.0
#: the quantiles whose indicator ESS make the tail ESS
_TAIL_PROBS = (0.05, 0.95)
#: most elements (chains · draws · columns) processed at once; larger inputs go column block by column block
_BLOCK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------------------------------- input checks
def _as_draws(draws, name: str = "draws") -> torch.Tensor:
    """``draws`` as a float64 tensor of shape (chains, draws, *shape), validated.

    Raises:
        TypeError: for something that is not an array of numbers.
        ValueError: for fewer than 2 dimensions, no chain, fewer than 4 draws per
            chain (2 per split chain), complex values or a non-finite draw.
    """
    if isinstance(draws, torch.Tensor):
        x = draws.detach()
        if x.is_complex():
            raise ValueError(f"{name} must be real numbers, not complex ({x.dtype}); shape {tuple(x.shape)}")
        if x.device.type not in ("cpu", "cuda"):  # e.g. MPS has no float64
            x = x.cpu()
    else:
        try:
            arr = np.asarray(draws)
        except Exception as exc:  # ragged lists etc.
            raise TypeError(f"{name} must be an array of numbers (torch tensor or numpy array): {exc}") from None
        if arr.dtype.kind == "c":
            raise ValueError(f"{name} must be real numbers, not complex ({arr.dtype}); shape {arr.shape}")
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"{name} must be an array of numbers (torch tensor or numpy array), "
                            f"got dtype {arr.dtype} from {type(draws).__name__}")
        x = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float64))
    shape = tuple(x.shape)
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape (chains, draws, ...) with at least 2 dimensions, got shape {shape}"
                         f"{' (one chain: use draws[None])' if x.dim() == 1 else ''}")
    if shape[0] < 1:
        raise ValueError(f"{name} has no chain: shape {shape}; expected (chains, draws, ...) with chains >= 1")
    if shape[1] < 4:
        raise ValueError(f"{name} has {shape[1]} draw(s) per chain (shape {shape}): split chains need at least "
                         f"2 draws each, so at least 4 draws per chain")
    x = x.to(torch.float64)
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int((~finite).sum())
        raise ValueError(f"{name} contains {bad} non-finite value(s) (NaN or ±inf) in shape {shape}")
    return x


def _blockwise(fn, x: torch.Tensor, lead: tuple[int, ...] = ()) -> torch.Tensor:
    """``fn`` applied to ``x`` (C, N, *shape) seen as (C, N, K) columns, in memory-bounded column blocks.

    ``fn`` maps (C, N, k) to (*lead, k); the result is reshaped to (*lead, *shape).
    """
    chains, length = x.shape[:2]
    shape = tuple(x.shape[2:])
    cols = math.prod(shape)
    if cols == 0:
        return torch.empty(lead + shape, dtype=torch.float64, device=x.device)
    flat = x.reshape(chains, length, cols)
    block = max(1, _BLOCK_ELEMENTS // (chains * length))
    out = torch.cat([fn(flat[:, :, i:i + block]) for i in range(0, cols, block)], dim=-1)
    return out.reshape(lead + shape)


# ---------------------------------------------------------------------------------------------- building blocks
def _split_chains(x: torch.Tensor) -> torch.Tensor:
    """(C, N, K) -> (2C, N // 2, K): first halves of every chain, then last halves (middle draw dropped if N odd)."""
    half = x.shape[1] // 2
    return torch.cat([x[:, :half], x[:, x.shape[1] - half:]], dim=0)


def _average_ranks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks 1..S of the S = C·N pooled draws of each column of ``x`` (C, N, K); ties get their average rank.

    Returns:
        (ranks (C, N, K) float64, the pooled draws sorted (S, K)).
    """
    chains, length, cols = x.shape
    size = chains * length
    flat = x.reshape(size, cols)
    values, order = torch.sort(flat, dim=0)
    pos = torch.arange(size, device=x.device).unsqueeze(1).expand(size, cols)
    starts = torch.ones_like(values, dtype=torch.bool)
    starts[1:] = values[1:] != values[:-1]          # first position of each run of equal values
    ends = torch.ones_like(values, dtype=torch.bool)
    ends[:-1] = starts[1:]                          # last position of each run
    first = torch.cummax(torch.where(starts, pos, torch.zeros_like(pos)), dim=0).values
    marked = torch.flip(torch.where(ends, pos, torch.full_like(pos, size - 1)), [0])
    last = torch.flip(torch.cummin(marked, dim=0).values, [0])
    avg = (first + last).to(torch.float64) / 2.0 + 1.0
    ranks = torch.empty_like(flat).scatter_(0, order, avg)
    return ranks.reshape(chains, length, cols), values


def _rank_normalise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normal scores z = Φ⁻¹((r − 3/8) / (S + 1/4)) of the pooled average ranks r (Sect. 4.1).

    Returns:
        (z, shape of ``x``; the pooled draws sorted, (S, K)).
    """
    size = x.shape[0] * x.shape[1]
    ranks, values = _average_ranks(x)
    return torch.special.ndtri((ranks - _BLOM) / (size - 2.0 * _BLOM + 1.0)), values


def _fold(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """|x − median| with the median of the pooled draws of each column (Sect. 4.2); for an even count the mean
    of the two middle values (``np.median``'s convention, not ``torch.median``'s lower one).

    Args:
        x: (C, N, K) draws.
        values: the same draws pooled and sorted, (C·N, K).
    """
    size = values.shape[0]
    if size % 2:
        median = values[size // 2]
    else:
        median = (values[size // 2 - 1] + values[size // 2]) / 2.0
    return (x - median).abs()


def _quantile(x: torch.Tensor, prob: float) -> torch.Tensor:
    """Type 7 (linear) quantile of the pooled draws of each column of ``x`` (C, N, K) -> (K,).

    With the S sorted values x₍₁₎ ≤ ... ≤ x₍S₎: a = S·p + (1 − p), k = ⌊clip(a, 1, S−1)⌋,
    γ = clip(a − k, 0, 1), q = (1 − γ)·x₍k₎ + γ·x₍k+1₎, evaluated in this order so that the
    indicator x ≤ q matches ArviZ's (``scipy.stats.mstats.mquantiles`` with α = β = 1) bit for bit.
    """
    size = x.shape[0] * x.shape[1]
    values = torch.sort(x.reshape(size, -1), dim=0).values
    m = 1.0 + prob * (1.0 - 1.0 - 1.0)             # = 1 − p, as alphap + p·(1 − alphap − betap)
    aleph = size * prob + m
    k = math.floor(min(max(aleph, 1.0), size - 1.0))
    gamma = min(max(aleph - k, 0.0), 1.0)
    return (1.0 - gamma) * values[k - 1] + gamma * values[k]


def _next_fast_len(target: int) -> int:
    """The smallest 5-smooth number (2^a 3^b 5^c) >= target: the FFT length ArviZ pads to."""
    best = 1 << max(0, (target - 1).bit_length())   # smallest power of two >= target
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            quotient = -(-target // p35)              # ceil(target / p35)
            cand = p35 * (1 << max(0, (quotient - 1).bit_length()))
            best = min(best, cand)
            p35 *= 3
        p5 *= 5
    return best


def _autocov(x: torch.Tensor) -> torch.Tensor:
    """Autocovariances ĉ_m,t = (1/n) Σ_{i=1}^{n−t} (x_m,i − x̄_m)(x_m,i+t − x̄_m), t = 0..n−1, per chain.

    Args:
        x: (M, n, K) float64.

    Returns:
        (M, n, K) float64, via a zero-padded real FFT (length: next 5-smooth number >= 2n).
    """
    n = x.shape[1]
    size = _next_fast_len(2 * n)
    centred = x - x.mean(dim=1, keepdim=True)
    spec = torch.fft.rfft(centred, n=size, dim=1)
    return torch.fft.irfft(spec * spec.conj(), n=size, dim=1)[:, :n] / n


def _rhat_chains(x: torch.Tensor) -> torch.Tensor:
    """Classic (Gelman–Rubin) R-hat of the given chains, no splitting (Sect. 3.1).

    Args:
        x: (M, n, K) float64, M >= 2 chains of n >= 2 draws.

    Returns:
        (K,) float64: sqrt((B/W + n − 1) / n), with B = n · Var_m(θ̄_m) and W = mean_m s_m²
        (both with the n−1, M−1 denominators). W = 0 gives NaN (B = 0) or +inf (B > 0).
    """
    n = x.shape[1]
    # shifting every column by one of its own draws leaves B and W unchanged but makes constant chains exactly 0
    x = x - x[:1, :1]
    between = n * x.mean(dim=1).var(dim=0, correction=1)
    within = x.var(dim=1, correction=1).mean(dim=0)
    return torch.sqrt((between / within + n - 1) / n)


def _ess_chains(x: torch.Tensor) -> torch.Tensor:
    """ESS of the given chains, no splitting (Sect. 3.2), with Geyer's initial monotone sequence.

    Args:
        x: (M, n, K) float64, M >= 2 chains of n >= 2 draws.

    Returns:
        (K,) float64. With S = M·n and ĉ_m,t the autocovariances of :func:`_autocov`:

        * W = mean_m ĉ_m,0 · n/(n−1), var⁺ = W·(n−1)/n + Var_m(θ̄_m),
          ρ̂_0 = 1, ρ̂_t = 1 − (W − mean_m ĉ_m,t) / var⁺;
        * pairs P_k = ρ̂_2k + ρ̂_2k+1 for k = 0..J, J = max(0, ⌊(n−3)/2⌋) (the lags ArviZ's loop
          reaches); I = number of leading P_k > 0, capped at J (P_k for k < I are the initial
          positive sequence);
        * the monotone sequence P'_k = min(P_0, ..., P_k) (Geyer's initial monotone estimator);
        * τ̂ = −1 + 2 Σ_{k<I} P'_k + ρ̂_2I, where ρ̂_2I counts if P_I >= 0 or ρ̂_2I > 0 and is
          0 otherwise (for I = 0: ρ̂_0 = 1, so τ̂ = 0);
        * ESS = S / max(τ̂, 1/log10 S): the floor 1/log10 S bounds the ESS of antithetic
          (negatively autocorrelated) chains, which can exceed S, by S·log10 S.

        Columns with max − min < 1e-15 are constant: ESS = S. A NaN ρ̂_1 gives NaN.
    """
    chains, n, cols = x.shape
    size = chains * n
    constant = (x.amax(dim=(0, 1)) - x.amin(dim=(0, 1))) < _RESOLUTION
    last_pair = max(0, (n - 3) // 2)
    lags = 2 * last_pair + 2                                    # ρ̂_0 .. ρ̂_{2J+1}, all <= n−1
    acov = _autocov(x)[:, :lags].mean(dim=0)                    # (lags, K), mean over chains
    mean_var = acov[0] * n / (n - 1.0)
    var_plus = mean_var * (n - 1.0) / n + x.mean(dim=1).var(dim=0, correction=1)
    rho = 1.0 - (mean_var - acov) / var_plus                    # (lags, K)
    rho[0] = 1.0
    pairs = rho[0::2] + rho[1::2]                               # (J+1, K): P_0..P_J
    leading = torch.cumprod((pairs > 0).to(torch.int64), dim=0).sum(dim=0)
    stop = leading.clamp(max=last_pair)                         # I
    monotone = torch.cummin(pairs, dim=0).values
    k = torch.arange(last_pair + 1, device=x.device).unsqueeze(1)
    tau = -1.0 + 2.0 * torch.where(k < stop, monotone, torch.zeros_like(monotone)).sum(dim=0)
    rho_even = rho.gather(0, (2 * stop).unsqueeze(0)).squeeze(0)
    pair_stop = pairs.gather(0, stop.unsqueeze(0)).squeeze(0)
    tau = tau + torch.where((pair_stop >= 0) | (rho_even > 0), rho_even, torch.zeros_like(rho_even))
    floor = 1.0 / math.log10(size)
    tau = torch.where(floor > tau, torch.full_like(tau, floor), tau)
    out = size / tau
    # ArviZ gives NaN when a kept ρ̂ is NaN; of those only ρ̂_1 can be (the others are kept only if >= 0 or > 0)
    out = torch.where(torch.isnan(rho[1]), torch.full_like(out, math.nan), out)
    return torch.where(constant, torch.full_like(out, float(size)), out)


def _rank_rhat(split: torch.Tensor, z: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """max(R̂_bulk, R̂_tail) from the split chains, their normal scores and their sorted pooled values."""
    bulk = _rhat_chains(z)
    tail = _rhat_chains(_rank_normalise(_fold(split, values))[0])
    return torch.where(tail > bulk, tail, bulk)  # max(bulk, tail) as Python's max: a NaN bulk stays NaN


def _rhat_rank_block(x: torch.Tensor) -> torch.Tensor:
    split = _split_chains(x)
    return _rank_rhat(split, *_rank_normalise(split))


def _summary_block(x: torch.Tensor) -> torch.Tensor:
    """(3, K): rank R-hat (NaN for one chain), bulk ESS and tail ESS, sharing the rank normalisation."""
    split = _split_chains(x)
    z, values = _rank_normalise(split)
    if x.shape[0] < 2:
        r = torch.full(x.shape[2:], math.nan, dtype=torch.float64, device=x.device)
    else:
        r = _rank_rhat(split, z, values)
    return torch.stack([r, _ess_chains(z), _ess_tail_block(x)])


def _ess_tail_block(x: torch.Tensor) -> torch.Tensor:
    low, high = (_ess_chains(_split_chains((x <= _quantile(x, p)).to(torch.float64))) for p in _TAIL_PROBS)
    return torch.where(high < low, high, low)   # min(low, high) as Python's min


def _single_chain_nan(x: torch.Tensor) -> torch.Tensor:
    return torch.full(x.shape[2:], math.nan, dtype=torch.float64, device=x.device)


# ---------------------------------------------------------------------------------------------- public API
def split_rhat(draws) -> torch.Tensor:
    """Classic split R-hat (no ranks), as ``az.rhat(..., method="split")`` (Sect. 3.1).

    Each chain is split into halves (first and last ``N // 2`` draws; the middle
    draw of an odd N is dropped), and with the resulting M = 2C chains of n draws

        B = n/(M−1) Σ_m (θ̄_m − θ̄)²,   W = (1/M) Σ_m s_m²,   R̂ = sqrt(((n−1)/n · W + B/n) / W).

    Args:
        draws: (chains, draws, *shape) tensor or array of real numbers.

    Returns:
        torch.float64 tensor of shape ``shape``. NaN for a single chain (as ArviZ)
        and for constant draws (0/0); +inf when each chain is constant but they differ.

    Raises:
        ValueError: fewer than 2 dimensions, fewer than 4 draws per chain, or a
            non-finite draw.
    """
    x = _as_draws(draws)
    if x.shape[0] < 2:
        return _single_chain_nan(x)
    return _blockwise(lambda b: _rhat_chains(_split_chains(b)), x)


def rhat(draws) -> torch.Tensor:
    """Rank-normalised split R-hat (Sect. 4), as ``az.rhat(..., method="rank")``.

    R̂ = max(R̂_bulk, R̂_tail) where, on the split chains (see :func:`split_rhat`),

    * R̂_bulk is the split R-hat of the rank-normalised draws
      z = Φ⁻¹((r − 3/8) / (S + 1/4)) (r: average rank among all S split draws, Sect. 4.1);
    * R̂_tail is the split R-hat of the rank-normalised folded draws
      ζ = |θ − median θ| (Sect. 4.2), sensitive to differences in scale.

    Values above 1.01 indicate that the chains have not mixed (the paper's
    recommended threshold); well-mixed chains give values close to 1.

    Args:
        draws: (chains, draws, *shape) tensor or array of real numbers, chains >= 2.

    Returns:
        torch.float64 tensor of shape ``shape``. NaN for a single chain (as ArviZ:
        it needs 2 chains before splitting) and for constant draws (all normal
        scores are 0, so W = B = 0); +inf when each chain is constant at a
        different value. When R̂_bulk is NaN the result is NaN; when only R̂_tail
        is NaN (e.g. draws taking two values symmetric about the median), R̂_bulk.

    Raises:
        ValueError: fewer than 2 dimensions, fewer than 4 draws per chain, or a
            non-finite draw.
    """
    x = _as_draws(draws)
    if x.shape[0] < 2:
        return _single_chain_nan(x)
    return _blockwise(_rhat_rank_block, x)


def ess(draws) -> torch.Tensor:
    """Basic ESS of the split chains, as ``az.ess(..., method="mean")`` (Sect. 3.2).

    With the M = 2C split chains of n draws (S = M·n), the autocorrelations
    ρ̂_t = 1 − (W − mean_m ĉ_m,t) / var⁺ from the FFT autocovariances ĉ_m,t,
    Geyer's initial positive sequence of pair sums ρ̂_2k + ρ̂_2k+1, made
    monotone, give τ̂ = −1 + 2 Σ_k (ρ̂_2k + ρ̂_2k+1) + ρ̂_(next even lag), and
    ESS = S / max(τ̂, 1/log10 S) (details: ``_ess_chains``). For antithetic
    chains the ESS can exceed S (at most S·log10 S); it is not rounded.

    Args:
        draws: (chains, draws, *shape) tensor or array of real numbers.

    Returns:
        torch.float64 tensor of shape ``shape``; S = 2·chains·(draws // 2) for
        constant draws (max − min < 1e-15).

    Raises:
        ValueError: fewer than 2 dimensions, fewer than 4 draws per chain, or a
            non-finite draw.
    """
    x = _as_draws(draws)
    return _blockwise(lambda b: _ess_chains(_split_chains(b)), x)


def ess_bulk(draws) -> torch.Tensor:
    """Bulk ESS (Sect. 4.1), as ``az.ess(..., method="bulk")``: the ESS of the rank-normalised split chains.

    The split draws are replaced by their normal scores z = Φ⁻¹((r − 3/8) / (S + 1/4))
    (average ranks r among all S split draws) and :func:`ess`'s estimator is
    applied; well defined without finite moments. Guideline: >= 100 per chain.

    Args:
        draws: (chains, draws, *shape) tensor or array of real numbers.

    Returns:
        torch.float64 tensor of shape ``shape``; S for constant draws.

    Raises:
        ValueError: fewer than 2 dimensions, fewer than 4 draws per chain, or a
            non-finite draw.
    """
    x = _as_draws(draws)
    return _blockwise(lambda b: _ess_chains(_rank_normalise(_split_chains(b))[0]), x)


def ess_tail(draws) -> torch.Tensor:
    """Tail ESS (Sect. 4.3), as ``az.ess(..., method="tail")``: min of the 5 % and 95 % quantile ESS.

    For α ∈ {0.05, 0.95}, q̂_α is the type 7 quantile of all chains · draws
    (unsplit) draws, and the quantile ESS is :func:`ess` of the indicator draws
    I(θ ≤ q̂_α) (split chains). Guideline: >= 100 per chain.

    Args:
        draws: (chains, draws, *shape) tensor or array of real numbers.

    Returns:
        torch.float64 tensor of shape ``shape``; S for constant draws (the
        indicators are all 1).

    Raises:
        ValueError: fewer than 2 dimensions, fewer than 4 draws per chain, or a
            non-finite draw.
    """
    x = _as_draws(draws)
    return _blockwise(_ess_tail_block, x)


def _nan_reduce(t: torch.Tensor, largest: bool) -> float:
    t = t[~torch.isnan(t)]
    if not t.numel():
        return math.nan
    return float(t.max() if largest else t.min())


def summary(draws: Mapping[str, object]) -> dict:
    """Worst-case diagnostics per named tensor of draws, and over all of them.

    Args:
        draws: ``{name: (chains, draws, *shape)}`` tensors or arrays (e.g.
            ``bnn.chain_draws()`` of a full-batch MCMC model); each entry is
            checked as in :func:`rhat`.

    Returns:
        ``{"parameters": {name: {"rhat": max R-hat, "ess_bulk": min bulk ESS,
        "ess_tail": min tail ESS}}, "summary": {the same three over every
        name}}`` as Python floats (the layout of
        :meth:`~bayeswrap.methods.mcmc.FullBatchMCMC.diagnostics`). NaN entries
        (constant elements, or R-hat of a single chain) are ignored; a value is
        NaN only when every element is NaN (or the tensor is empty).

    Raises:
        TypeError: ``draws`` is not a mapping of names.
        ValueError: ``draws`` is empty, or an entry fails the checks of
            :func:`rhat` (the message names the entry).
    """
    if not isinstance(draws, Mapping):
        raise TypeError(f"draws must be a mapping {{name: (chains, draws, ...) tensor}}, not {type(draws).__name__}")
    if not draws:
        raise ValueError("draws is empty: give at least one {name: (chains, draws, ...) tensor}")
    per = {}
    for name, value in draws.items():
        label = f"draws[{name!r}]"
        r, eb, et = _blockwise(_summary_block, _as_draws(value, name=label), lead=(3,))
        per[name] = {"rhat": _nan_reduce(r, True), "ess_bulk": _nan_reduce(eb, False),
                     "ess_tail": _nan_reduce(et, False)}

    def worst(key: str, largest: bool) -> float:
        vals = [p[key] for p in per.values() if not math.isnan(p[key])]
        if not vals:
            return math.nan
        return max(vals) if largest else min(vals)

    return {"parameters": per,
            "summary": {"rhat": worst("rhat", True), "ess_bulk": worst("ess_bulk", False),
                        "ess_tail": worst("ess_tail", False)}}
