"""The evaluation protocol of a trained classifier: in distribution, under shift, out of distribution.

What every ``bayeswrap fit``/``compare``/``evaluate`` run reports, built from the
metric modules beside this one and independent of any model: the functions
take sampled class probabilities ``sample_probs`` of shape (S, N, K) (S = 1 for
a point estimate) or a callable that produces them, and optionally the
predictive ``probs`` (N, K) when it is not their mean over S (Laplace's probit
link, a closed form). Every point metric (error, NLL, ECE, temperature,
selective prediction, entropy, shift scores) is of the predictive; only the
sample-based measures (mutual information, variation ratio, predictive std)
read the samples.

* :func:`prediction_report`: calibration at T = 1 and at the validation-fitted T
  (:func:`bayeswrap.evaluation.calibration.report`), the reliability bins,
  selective prediction (risk-coverage, AURC) and γ(α) curves of the per-example
  uncertainty measures.
* :func:`shift_report`: error, NLL and ECE against shift intensity (rotation,
  Gaussian noise), at T = 1 and at the in-distribution T (Ovadia et al. 2019).
* :func:`corruption_report`: the same curves against the severity of each image
  corruption of Hendrycks & Dietterich (2019), and their mean over corruptions.
* :func:`ood_report`: pooled AUROC/AUPR/FPR95 of held-out classes against the
  in-distribution test set, scored by predictive entropy, mutual information and
  1 − max probability.

All results are JSON-serialisable dicts of Python floats and lists.

References:
    Ovadia et al. Can You Trust Your Model's Uncertainty? Evaluating Predictive
    Uncertainty Under Dataset Shift. NeurIPS 2019, §4.
    Hendrycks, Dietterich. Benchmarking Neural Network Robustness to Common
    Corruptions and Perturbations. ICLR 2019.
    Hendrycks, Gimpel. A Baseline for Detecting Misclassified and
    Out-of-Distribution Examples in Neural Networks. ICLR 2017.
    Geifman, Uziel, El-Yaniv. Bias-Reduced Uncertainty Estimation for Deep Neural
    Classifiers. ICLR 2019 (AURC).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from bayeswrap.evaluation import calibration
from bayeswrap.evaluation.ood import ood_metrics
from bayeswrap.evaluation.selective import aurc, risk_coverage
from bayeswrap.evaluation.uncertainty import (
    gamma_curve,
    mutual_information,
    predictive_entropy,
    predictive_std,
    variation_ratio,
)

__all__ = ["GAMMA_ALPHAS", "SHIFT_METRICS", "corruption_report", "distinct_samples", "measures", "ood_report",
           "prediction_report", "shift_report"]

GAMMA_ALPHAS: tuple[float, ...] = tuple(round(a, 2) for a in np.linspace(0.05, 0.95, 19))
"""Default α grid of the γ(α) curves."""

SHIFT_METRICS = ("error", "nll", "ece")
"""Metrics recorded per shift intensity."""

_MAX_CURVE_POINTS = 200


def distinct_samples(sample_probs: torch.Tensor) -> torch.Tensor:
    """``sample_probs`` itself, or its first sample alone if every sample is identical.

    A point-estimate posterior (MAP, or a zero posterior std) evaluated with S > 1
    gives S identical copies; their mutual information is floating-point rounding
    (≈ 1e-16), and ranking examples by it would be noise. Such input is scored as S = 1.

    Args:
        sample_probs: (S, N, K) class probabilities.

    Returns:
        (S, N, K), or (1, N, K) when all S samples are equal.
    """
    return sample_probs[:1] if torch.equal(sample_probs, sample_probs[:1].expand_as(sample_probs)) else sample_probs


def measures(sample_probs: torch.Tensor | None, probs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-example uncertainty scores (higher = more uncertain) available for S samples.

    Args:
        sample_probs: (S, N, K) class probabilities under S posterior samples, or None (``probs`` only).
        probs: optional (N, K) predictive when it is not the mean of ``sample_probs`` over S; the entropy is
            then its entropy.

    Returns:
        ``{"entropy": (N,)}`` (of the predictive), plus ``"mutual_information"``, ``"variation_ratio"`` and
        ``"predictive_std"`` (each (N,) float64) when there are S ≥ 2 distinct samples
        (see :func:`distinct_samples`).

    Raises:
        ValueError: if both are None.
    """
    if sample_probs is None and probs is None:
        raise ValueError("measures needs sample_probs (S, N, K) or probs (N, K); both are None")
    if sample_probs is not None:
        sample_probs = distinct_samples(sample_probs)
    out = {"entropy": predictive_entropy(sample_probs if probs is None else probs[None])}
    if sample_probs is not None and sample_probs.shape[0] >= 2:
        out.update(mutual_information=mutual_information(sample_probs),
                   variation_ratio=variation_ratio(sample_probs), predictive_std=predictive_std(sample_probs))
    return out


def _thin(values: torch.Tensor, max_points: int = _MAX_CURVE_POINTS) -> list[float]:
    """At most ``max_points`` evenly spaced entries, always keeping the first and the last."""
    n = len(values)
    idx = np.unique(np.linspace(0, n - 1, min(n, max_points)).round().astype(int))
    return [float(v) for v in values[idx]]


def prediction_report(sample_probs: torch.Tensor | None, labels: torch.Tensor, *,
                      val: tuple[torch.Tensor, torch.Tensor] | None = None, n_bins: int = 15,
                      alphas: Sequence[float] = GAMMA_ALPHAS, probs: torch.Tensor | None = None) -> dict[str, Any]:
    """In-distribution report of a posterior predictive.

    Args:
        sample_probs: (S, N, K) test class probabilities under S ≥ 1 samples; the
            predictive is their mean over S unless ``probs`` is given. None, or the predictive (N, K)
            itself: no sample-based measure.
        labels: (N,) int64 test labels.
        val: optional ``(probs_val, labels_val)`` with the validation predictive (N_val, K), or
            per-sample probabilities (S, N_val, K) whose mean over S it is; the temperature is fitted on it.
        n_bins: bins of ECE/MCE and the reliability bins.
        alphas: α grid of the γ curves, each in (0, 1).
        probs: optional (N, K) test predictive when it is not the mean of ``sample_probs`` (Laplace's probit
            link): every point metric and the entropy are of it.

    Returns:
        :func:`bayeswrap.evaluation.calibration.report` of the predictive
        (keys ``T1``, and with ``val`` also ``temperature``, ``Topt``, ``val``), plus
        ``bins`` (the top-label reliability bins at T = 1, ``BinStats.to_dict()``),
        ``selective`` (``aurc`` and at most 200 points of the risk-coverage curve,
        confidence = max predictive probability) and ``gamma`` (``alphas`` and one
        γ(α) list per measure of :func:`measures`; ``None`` if the test set has no
        misclassified or no correct example).

    Raises:
        ValueError: on bad shapes or probabilities (see the metric modules), or when ``sample_probs`` and
            ``probs`` are both None.
    """
    if sample_probs is not None and sample_probs.dim() == 2 and probs is None:  # a predictive without samples
        sample_probs, probs = None, sample_probs
    given = probs
    probs = _predictive(sample_probs, probs)
    val_pair = None if val is None else (_predictive(val[0]), val[1])
    out = calibration.report(probs, labels, val=val_pair, n_bins=n_bins)
    out["bins"] = calibration.bin_stats(probs, labels, n_bins).to_dict()
    confidence, predicted = probs.max(1)
    correct = predicted == labels
    coverage, risk = risk_coverage(confidence, correct)
    out["selective"] = {"aurc": aurc(confidence, correct), "coverage": _thin(coverage), "risk": _thin(risk)}
    if 0 < int(correct.sum()) < len(correct):
        out["gamma"] = {"alphas": [float(a) for a in alphas],
                        **{name: gamma_curve(u, correct, alphas).tolist()
                           for name, u in measures(sample_probs, given).items()}}
    else:
        out["gamma"] = None
    return out


def _predictive(sample_probs: torch.Tensor | None, probs: torch.Tensor | None = None) -> torch.Tensor:
    """The predictive (N, K) float64: ``probs`` if given, else ``sample_probs`` itself when it is (N, K), else its
    mean over S of (S, N, K).
    """
    if probs is not None:
        return probs.double()
    if sample_probs is None:
        raise ValueError("no probabilities given: accepted: sample_probs (S, N, K) or probs (N, K)")
    return sample_probs.double() if sample_probs.dim() == 2 else sample_probs.double().mean(0)


def _scores(probs: torch.Tensor, labels: torch.Tensor, n_bins: int) -> dict[str, float]:
    t1 = calibration.report(probs, labels, n_bins=n_bins)["T1"]
    return {k: t1[k] for k in SHIFT_METRICS}


def shift_report(predict_shifted: Callable[[str, float], tuple[torch.Tensor, torch.Tensor]], grids: dict[str, Sequence[float]],
                 *, temperature: float = 1.0, n_bins: int = 15) -> dict[str, Any]:
    """Error, NLL and ECE against shift intensity, at T = 1 and at a fixed temperature.

    Ovadia et al. (2019) score every method on the same shifted test sets at a
    grid of intensities; temperature scaling uses the T fitted on the
    *in-distribution* validation set, as a deployed model would.

    Args:
        predict_shifted: ``(kind, intensity) -> (probs, labels (N,))`` on the test set under that shift
            (see :mod:`bayeswrap.data.shift`), with ``probs`` the predictive (N, K) or per-sample
            probabilities (S, N, K) whose mean over S it is.
        grids: ``{kind: intensities}``, e.g. ``{"rotation": (0, 15, ..., 180),
            "noise": (0.0, 0.1, ...)}`` (degrees; pixel std on [0, 1] images). Empty
            grids are skipped.
        temperature: T > 0 applied for the ``Topt`` curves.
        n_bins: ECE bins.

    Returns:
        ``{kind: {"intensity": [...], "T1": {metric: [...]}, "Topt": {metric: [...]}},
        "summary": {metric: mean, metric + "_Topt": mean}, "summary_by_kind": {kind: {...}}}``
        with metrics ``error``, ``nll``, ``ece`` (top-label, ``n_bins`` bins); the
        summary averages every non-zero intensity of every kind (the unshifted
        test set is reported in distribution), or is ``{}`` if there is none;
        ``summary_by_kind`` does the same per kind.

    Raises:
        ValueError: on a non-positive temperature or bad probabilities.
    """
    out: dict[str, Any] = {}
    pooled: dict[str, list[float]] = {}
    by_kind: dict[str, dict[str, list[float]]] = {}
    for kind, grid in grids.items():
        if not len(grid):
            continue
        curves: dict[str, Any] = {"intensity": [float(v) for v in grid],
                                  "T1": {m: [] for m in SHIFT_METRICS}, "Topt": {m: [] for m in SHIFT_METRICS}}
        for level in grid:
            sample_probs, labels = predict_shifted(kind, float(level))
            probs = _predictive(sample_probs)
            scaled = calibration.apply_temperature(probs.clamp_min(1e-300).log(), temperature)
            for tag, p in (("T1", probs), ("Topt", scaled)):
                for metric, value in _scores(p, labels, n_bins).items():
                    curves[tag][metric].append(value)
                    if level != 0:
                        key = metric if tag == "T1" else f"{metric}_Topt"
                        pooled.setdefault(key, []).append(value)
                        by_kind.setdefault(kind, {}).setdefault(key, []).append(value)
        out[kind] = curves
    out["summary"] = {k: float(np.mean(v)) for k, v in pooled.items()}
    out["summary_by_kind"] = {kind: {k: float(np.mean(v)) for k, v in d.items()} for kind, d in by_kind.items()}
    return out


def corruption_report(predict_corrupted: Callable[[str, int], tuple[torch.Tensor, torch.Tensor]],
                      corruptions: Sequence[str], severities: Sequence[int], *, temperature: float = 1.0,
                      n_bins: int = 15) -> dict[str, Any]:
    """Error, NLL and ECE against corruption severity: per corruption and the mean over corruptions.

    The protocol of Ovadia et al. (2019, §4.2, Fig. 3) on the corruptions of Hendrycks
    & Dietterich (2019): every corruption is scored at severity 0 (the clean test set)
    and at ``severities`` by :func:`shift_report`, at T = 1 and at the in-distribution T.

    Args:
        predict_corrupted: ``(corruption, severity) -> (probs, labels (N,))`` on the test set under that
            corruption, ``probs`` as in :func:`shift_report`; severity 0 is the clean test set (see
            :mod:`bayeswrap.data.corruptions`).
        corruptions: corruption names, at least one, no repeats.
        severities: distinct ints in 1..5 (at least one).
        temperature: T > 0 applied for the ``Topt`` curves.
        n_bins: ECE bins.

    Returns:
        ``{"severity": [0, *severities], "corruptions": {name: {"T1": {metric: [...]},
        "Topt": {metric: [...]}}}, "mean": {"T1": ..., "Topt": ...}, "summary": {metric:
        mean, metric + "_Topt": mean}, "summary_by_corruption": {name: {...}}}`` with
        metrics ``error``, ``nll``, ``ece``. ``mean`` is, at each severity, the average of
        the per-corruption values; ``summary`` averages every corrupted (severity >= 1)
        value of every corruption (the mean curve's average over severities >= 1), and
        ``summary_by_corruption`` does the same per corruption.

    Raises:
        ValueError: no or repeated corruptions, severities outside 1..5 or repeated
            (naming the values and the accepted ones), a non-positive temperature or bad
            probabilities.
    """
    names = [str(c) for c in corruptions]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"corruptions={list(corruptions)!r} is not valid; accepted: at least one name, no repeats")
    levels = list(severities)
    if not levels or len(set(levels)) != len(levels) or any(
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= 5 for v in levels):
        raise ValueError(f"severities={levels!r} is not valid; accepted: distinct integers in 1..5, at least one")
    grid = [0, *(int(v) for v in levels)]
    rep = shift_report(lambda name, level: predict_corrupted(name, int(level)), {c: grid for c in names},
                       temperature=temperature, n_bins=n_bins)
    curves = {c: {tag: rep[c][tag] for tag in ("T1", "Topt")} for c in names}
    mean = {tag: {m: np.mean([curves[c][tag][m] for c in names], axis=0).tolist() for m in SHIFT_METRICS}
            for tag in ("T1", "Topt")}
    return {"severity": grid, "corruptions": curves, "mean": mean, "summary": rep["summary"],
            "summary_by_corruption": rep["summary_by_kind"]}


def ood_report(sample_probs_in: torch.Tensor | None, sample_probs_out: torch.Tensor | None, *,
               probs_in: torch.Tensor | None = None, probs_out: torch.Tensor | None = None,
               temperature: float | None = None) -> dict[str, Any]:
    """Out-of-distribution detection from the predictive's uncertainty.

    Args:
        sample_probs_in: (S, N_in, K) probabilities on in-distribution test inputs, or None (``probs_in`` only).
        sample_probs_out: (S, N_out, K) probabilities on out-of-distribution inputs, or None.
        probs_in, probs_out: optional predictives (N_in, K) and (N_out, K) when they are not the means of the
            samples over S (Laplace's probit link): the entropy and confidence scores are of them. Give both or
            neither.
        temperature: optional T > 0 fitted on in-distribution validation: adds ``"entropy_Topt"``, the entropy
            of the temperature-scaled predictive softmax(log p̄ / T) (Guo et al. 2017, eq. 9), which can rank
            inputs differently from the entropy at T = 1.

    Returns:
        ``{"n_in", "n_out", "entropy", "mutual_information", "confidence"}`` (and ``"entropy_Topt"``): each
        score's :func:`bayeswrap.evaluation.ood.ood_metrics` (AUROC, AUPR-in,
        AUPR-out, FPR95; OOD is the positive class), pooled over both sets.
        ``confidence`` scores by 1 − max probability (Hendrycks & Gimpel 2017);
        ``mutual_information`` is ``None`` unless both sets have S ≥ 2 distinct
        samples (see :func:`distinct_samples`).

    Raises:
        ValueError: if either set is empty or the class counts differ, or only one of ``probs_in`` and
            ``probs_out`` is given, or a set has neither samples nor a predictive.
    """
    if (probs_in is None) != (probs_out is None):
        raise ValueError("ood_report scores both sets by the same predictive; accepted: probs_in and probs_out "
                         "both given, or both None")
    p_in, p_out = _predictive(sample_probs_in, probs_in), _predictive(sample_probs_out, probs_out)
    if p_in.shape[-1] != p_out.shape[-1]:
        raise ValueError(f"in- and out-of-distribution probabilities have K = {p_in.shape[-1]} and "
                         f"{p_out.shape[-1]} classes; accepted: the same K")
    if probs_in is None:  # the predictive is the samples' mean: its entropy from the samples (checked, renormalised)
        entropy_in, entropy_out = predictive_entropy(sample_probs_in), predictive_entropy(sample_probs_out)
    else:
        entropy_in, entropy_out = predictive_entropy(probs_in[None]), predictive_entropy(probs_out[None])
    out: dict[str, Any] = {
        "n_in": int(p_in.shape[0]), "n_out": int(p_out.shape[0]),
        "entropy": ood_metrics(entropy_in, entropy_out),
        "mutual_information": None,
        "confidence": ood_metrics(1 - p_in.max(1).values, 1 - p_out.max(1).values),
    }
    if temperature is not None:
        scaled = [calibration.apply_temperature(p.double().clamp_min(1e-300).log(), temperature)[None]
                  for p in (p_in, p_out)]
        out["entropy_Topt"] = ood_metrics(predictive_entropy(scaled[0]), predictive_entropy(scaled[1]))
    if sample_probs_in is None or sample_probs_out is None:
        return out
    if min(len(distinct_samples(sample_probs_in)), len(distinct_samples(sample_probs_out))) >= 2:
        out["mutual_information"] = ood_metrics(mutual_information(sample_probs_in),
                                                mutual_information(sample_probs_out))
    return out

