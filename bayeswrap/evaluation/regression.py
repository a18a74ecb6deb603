"""Regression metrics of predictive distributions: central-interval coverage and width, and the CRPS.

All functions take torch tensors (any device) or numpy arrays of floats, compute
in float64 on the CPU and return Python floats (or a dict of them). Means,
variances and targets share one shape, e.g. (N, D); every scalar target counts
once (averages run over all N·D entries).

* Central intervals of a Gaussian predictive N(μ, σ²) at level ℓ:
  μ ± z σ with z = Φ⁻¹((1 + ℓ)/2). Coverage is the fraction of targets inside
  (a calibrated predictive covers a fraction ℓ), width the mean of 2 z σ
  (Gneiting et al. 2007, "sharpness subject to calibration").
* CRPS(F, y) = ∫ (F(t) − 1[t ≥ y])² dt = E|X − y| − ½ E|X − X'|, X, X' ~ F independent
  (Gneiting & Raftery 2007, eqs. 20–21), in the units of y; lower is better.

  - Gaussian, closed form (Gneiting et al. 2005, eq. 5): with z = (y − μ)/σ,
    CRPS = σ [z (2Φ(z) − 1) + 2 φ(z) − 1/√π] (→ |y − μ| as σ → 0).
  - Mixture of Gaussians (1/S) Σ_s N(μ_s, σ_s²), the predictive of S posterior
    samples, closed form (Grimit et al. 2006, eq. 5): with
    A(m, v) = E|N(m, v)| = 2√v φ(m/√v) + m (2Φ(m/√v) − 1),
    CRPS = (1/S) Σ_s A(y − μ_s, σ_s²) − (1/2S²) Σ_{s,t} A(μ_s − μ_t, σ_s² + σ_t²).
  - Samples x_1..x_S of F, the energy form with the empirical distribution
    (torchmetrics' ``continuous_ranked_probability_score``):
    (1/S) Σ_s |x_s − y| − (1/2S²) Σ_{s,t} |x_s − x_t|, the pair sum from the sorted
    samples, Σ_{s,t} |x_s − x_t| = 2 Σ_i (2i − S − 1) x_(i).

References:
    Gneiting, Raftery, Westveld, Goldman. Calibrated probabilistic forecasting using
    ensemble model output statistics and minimum CRPS estimation. Mon. Wea. Rev. 2005.
    Gneiting, Raftery. Strictly proper scoring rules, prediction, and estimation. JASA 2007.
    Gneiting, Balabdaoui, Raftery. Probabilistic forecasts, calibration and sharpness. JRSS-B 2007.
    Grimit, Gneiting, Berrocal, Johnson. The continuous ranked probability score for circular
    variables and its application to mesoscale forecast ensemble verification. QJRMS 2006.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["DEFAULT_LEVELS", "crps_gaussian", "crps_gaussian_mixture", "crps_samples", "interval_metrics",
           "regression_report"]

#: central-interval levels reported by default
DEFAULT_LEVELS = (0.5, 0.9, 0.95)

_NORMAL = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))


def _as_float64(name: str, value) -> torch.Tensor:
    """A finite float64 CPU tensor, or a ValueError naming ``name``."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor or a numpy array, got {type(value).__name__}")
    if not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)):
        raise ValueError(f"{name} must hold real numbers, got dtype {value.dtype}")
    value = value.detach().cpu().double()
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"{name} contains {int((~torch.isfinite(value)).sum())} non-finite values (NaN or inf); "
                         "accepted: finite values")
    return value


def _moments(mean, var, targets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mean, var, targets = _as_float64("mean", mean), _as_float64("var", var), _as_float64("targets", targets)
    if not mean.shape == var.shape == targets.shape or mean.numel() == 0:
        raise ValueError(f"mean {tuple(mean.shape)}, var {tuple(var.shape)} and targets {tuple(targets.shape)} "
                         "must have one non-empty shape, e.g. (N, D)")
    if bool((var < 0).any()):
        raise ValueError(f"var must be >= 0 (variances); got minimum {float(var.min())!r}")
    return mean, var, targets


def _check_levels(levels) -> tuple[float, ...]:
    values = tuple(levels) if isinstance(levels, Sequence) and not isinstance(levels, str) else None
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1
                             for v in values):
        raise ValueError(f"levels={levels!r} is not accepted; accepted: a non-empty sequence of numbers in (0, 1), "
                         f"e.g. {DEFAULT_LEVELS}")
    return tuple(float(v) for v in values)


def _level_key(level: float) -> str:
    """0.9 → "90", 0.975 → "97.5"."""
    return f"{100 * level:.10g}"


def interval_metrics(mean, var, targets, levels: Sequence[float] = DEFAULT_LEVELS) -> dict[str, float]:
    """Coverage and mean width of the central intervals μ ± Φ⁻¹((1+ℓ)/2) σ of a Gaussian predictive.

    Args:
        mean: predictive means μ, e.g. (N, D).
        var: predictive variances σ² ≥ 0, same shape.
        targets: observed y, same shape.
        levels: central-interval levels ℓ in (0, 1).

    Returns:
        ``{"coverage_<100ℓ>": fraction of targets with |y − μ| ≤ z σ, "width_<100ℓ>": mean of 2 z σ}``
        for every level, e.g. ``"coverage_90"``; averages over all entries.

    Raises:
        ValueError: on mismatched or empty shapes, non-finite values, a negative variance, or a level
            outside (0, 1).
        TypeError: if an input is not a tensor or numpy array.
    """
    mean, var, targets = _moments(mean, var, targets)
    std = var.sqrt()
    out = {}
    for level in _check_levels(levels):
        z = float(_NORMAL.icdf(torch.tensor((1 + level) / 2, dtype=torch.float64)))
        out[f"coverage_{_level_key(level)}"] = float(((targets - mean).abs() <= z * std).double().mean())
        out[f"width_{_level_key(level)}"] = float((2 * z * std).mean())
    return out


def _abs_normal_mean(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A(m, v) = E|N(m, v)| = 2√v φ(m/√v) + m (2Φ(m/√v) − 1), elementwise (|m| where v = 0)."""
    s = v.sqrt()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    z = m / safe
    value = 2 * s * _NORMAL.log_prob(z).exp() + m * (2 * _NORMAL.cdf(z) - 1)
    return torch.where(s > 0, value, m.abs())


def crps_gaussian(mean, var, targets, reduction: str = "mean"):
    """CRPS of Gaussian predictives N(μ, σ²) in closed form (Gneiting et al. 2005, eq. 5).

    CRPS = σ [z (2Φ(z) − 1) + 2 φ(z) − 1/√π], z = (y − μ)/σ; |y − μ| where σ = 0.

    Args:
        mean: μ, e.g. (N, D).
        var: σ² ≥ 0, same shape.
        targets: y, same shape.
        reduction: ``"mean"`` (a float, the mean over all entries) or ``"none"`` (a float64 tensor of the
            input's shape).

    Raises:
        ValueError: as :func:`interval_metrics`, or an unknown ``reduction``.
    """
    mean, var, targets = _moments(mean, var, targets)
    per = _abs_normal_mean(targets - mean, var) - var.sqrt() / math.sqrt(math.pi)
    return _reduce(per, reduction)


def crps_gaussian_mixture(means, variances, targets, reduction: str = "mean"):
    """CRPS of the equal-weight mixtures (1/S) Σ_s N(μ_s, σ_s²) in closed form (Grimit et al. 2006, eq. 5).

    The exact CRPS of the predictive of S posterior samples with Gaussian likelihoods (each sample's mean and
    noise or predicted variance), without moment matching. Costs S² evaluations per target.

    Args:
        means: μ_s, shape (S, *shape), e.g. (S, N, D).
        variances: σ_s² ≥ 0, same shape.
        targets: y, shape ``shape``.
        reduction: ``"mean"`` (a float) or ``"none"`` (a float64 tensor of shape ``shape``).

    Raises:
        ValueError: on mismatched or empty shapes, non-finite values, negative variances, or an unknown
            ``reduction``.
        TypeError: if an input is not a tensor or numpy array.
    """
    means, variances = _as_float64("means", means), _as_float64("variances", variances)
    targets = _as_float64("targets", targets)
    if means.shape != variances.shape or means.dim() < 1 or means.shape[1:] != targets.shape or not means.numel():
        raise ValueError(f"means {tuple(means.shape)} and variances {tuple(variances.shape)} must have shape "
                         f"(S, *targets.shape) with targets {tuple(targets.shape)}, non-empty")
    if bool((variances < 0).any()):
        raise ValueError(f"variances must be >= 0; got minimum {float(variances.min())!r}")
    first = _abs_normal_mean(targets - means, variances).mean(0)
    pairs = _abs_normal_mean(means.unsqueeze(0) - means.unsqueeze(1), variances.unsqueeze(0) + variances.unsqueeze(1))
    return _reduce(first - 0.5 * pairs.mean((0, 1)), reduction)


def crps_samples(samples, targets, reduction: str = "mean"):
    """CRPS of the empirical distributions of S samples, E|X − y| − ½ E|X − X'| (Gneiting & Raftery 2007, eq. 21).

    Agrees with ``torchmetrics.functional.regression.continuous_ranked_probability_score``; the pair term
    comes from the sorted samples in O(S log S) instead of O(S²) memory.

    Args:
        samples: draws x_s of each predictive, shape (S, *shape) with S ≥ 1.
        targets: y, shape ``shape``.
        reduction: ``"mean"`` (a float) or ``"none"`` (a float64 tensor of shape ``shape``).

    Raises:
        ValueError: on mismatched or empty shapes, non-finite values or an unknown ``reduction``.
        TypeError: if an input is not a tensor or numpy array.
    """
    samples, targets = _as_float64("samples", samples), _as_float64("targets", targets)
    if samples.dim() < 1 or samples.shape[1:] != targets.shape or not samples.numel():
        raise ValueError(f"samples {tuple(samples.shape)} must have shape (S, *targets.shape) with targets "
                         f"{tuple(targets.shape)}, non-empty")
    count = samples.shape[0]
    first = (samples - targets).abs().mean(0)
    ranks = torch.arange(1, count + 1, dtype=torch.float64).reshape(-1, *([1] * targets.dim()))
    half_pairs = ((2 * ranks - count - 1) * samples.sort(0).values).sum(0) / count**2
    return _reduce(first - half_pairs, reduction)


def regression_report(mean, var, targets, levels: Sequence[float] = DEFAULT_LEVELS) -> dict[str, float]:
    """The CRPS of the Gaussian predictive N(mean, var) and its interval metrics, one dict.

    Returns:
        ``{"crps": ..., "coverage_<100ℓ>": ..., "width_<100ℓ>": ...}`` (:func:`crps_gaussian`,
        :func:`interval_metrics`).

    Raises:
        ValueError: as :func:`interval_metrics`.
    """
    return {"crps": crps_gaussian(mean, var, targets), **interval_metrics(mean, var, targets, levels)}


def _reduce(per: torch.Tensor, reduction: str):
    if reduction == "mean":
        return float(per.mean())
    if reduction == "none":
        return per
    raise ValueError(f"reduction={reduction!r} is not accepted; accepted: ('mean', 'none')")
