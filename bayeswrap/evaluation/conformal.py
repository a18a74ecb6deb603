r"""Split conformal prediction sets on a classifier's (posterior-)predictive probabilities.

Given a conformity score :math:`s(x, y)` (large = the label fits badly) and
:math:`n` labelled calibration examples exchangeable with the test data, split
conformal prediction takes

.. math::

    k = \lceil (n + 1)(1 - \alpha) \rceil, \qquad
    \hat q = s_{(k)} \ \text{(the k-th smallest calibration score)}, \qquad
    C(x) = \{\, y : s(x, y) \le \hat q \,\}

and guarantees marginal coverage :math:`P(Y_{n+1} \in C(X_{n+1})) \ge 1 - \alpha`
for any score and any model; when the scores have no ties the coverage is exactly
:math:`k / (n + 1) \le 1 - \alpha + 1/(n+1)` (Vovk et al. 2005; Lei et al. 2018,
§2; Angelopoulos & Bates 2023, §1 and Appendix D). Given the calibration set,
the coverage is Beta(k, n + 1 − k)-distributed (Vovk 2012; Angelopoulos & Bates
2023, §3). If :math:`k > n` (:math:`n < 1/\alpha - 1`) the quantile is +∞ and
every set holds all K classes: :func:`calibrate` then returns ``inf`` and warns,
rather than refusing, so that a run with a small validation set still finishes
and says so (``full_sets`` in :func:`conformal_report`).

The scores, computed for every label at once as an (N, K) matrix. With
:math:`\pi` the predictive probabilities of one example, labels ranked by
decreasing probability (ties by class index), :math:`o(y)` the 1-based rank of
label y, :math:`\rho(y) = \sum_{j : o(j) < o(y)} \pi_j` the mass ranked above y
and :math:`u \sim U(0, 1)` one uniform draw per example:

* ``"lac"`` (least ambiguous set-valued classifier, also called THR):
  :math:`s = 1 - \pi_y`; sets :math:`\{y : \pi_y \ge 1 - \hat q\}` (Sadinle, Lei,
  Wasserman 2019, §2). The smallest sets on average, least adaptive.
* ``"aps"`` (adaptive prediction sets): :math:`s = \rho(y) + u\,\pi_y`, with
  :math:`u = 1` when not randomized, i.e. the mass of the labels ranked up to and
  including y: the generalised inverse quantile score of Romano, Sesia, Candès
  (2020), §2. The sets are the top-ranked labels until their mass reaches
  :math:`\hat q`.
* ``"raps"`` (regularised APS): the APS score plus
  :math:`\lambda\,(o(y) - k_{reg})^+`, which stops long tails of tiny
  probabilities from entering the sets (Angelopoulos, Bates, Malik, Jordan 2021,
  §2, Algorithms 1-2). ``k_reg`` and ``lam`` are taken as given (the paper picks
  them on a separate split of the calibration data).

Every set is :math:`\{y : s(x, y) \le \hat q\}` with the same score as in
calibration, so the guarantee above holds for each variant, randomized or not.
The randomized variants (one :math:`u` per example, drawn from ``generator``) are
the ones with exact coverage. The non-randomized ones are deterministic and
over-cover a little only where scores tie. Both can return empty sets: the APS
and RAPS score of the top label is its probability (non-randomized), so an example
whose top probability exceeds :math:`\hat q` gets an empty set (on a confident
model with :math:`\hat q \approx 0.98`, about 9 % of the digits test set);
LAC sets are empty only where every probability is below :math:`1 - \hat q`. Without randomization, labels of
probability exactly 0 share the APS score of the last positive label, so a
one-hot predictive gives full APS sets; RAPS with ``lam > 0`` and LAC do not.

Scores use float64; pass probabilities (rows summing to 1), such as the mean of
the posterior samples' softmax. The quantile index uses α read as the shortest
decimal that prints as it (``0.45`` is 45/100), so that ``(n + 1)(1 − α)`` is
exact: with floats, ``100 * (1 - 0.45)`` is 55.00000000000001 and would take
the 56th score instead of the 55th.

References:
    Vovk, Gammerman, Shafer. Algorithmic Learning in a Random World. Springer 2005.
    Vovk. Conditional Validity of Inductive Conformal Predictors. ACML 2012.
    Lei, G'Sell, Rinaldo, Tibshirani, Wasserman. Distribution-Free Predictive
    Inference for Regression. JASA 2018, §2.
    Sadinle, Lei, Wasserman. Least Ambiguous Set-Valued Classifiers with Bounded
    Error Levels. JASA 2019.
    Romano, Sesia, Candès. Classification with Valid and Adaptive Coverage.
    NeurIPS 2020.
    Angelopoulos, Bates, Malik, Jordan. Uncertainty Sets for Image Classifiers
    using Conformal Prediction. ICLR 2021.
    Angelopoulos, Bates. Conformal Prediction: A Gentle Introduction. Foundations
    and Trends in Machine Learning 2023.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from bayeswrap.core.checks import check_bool, check_float, check_int
from bayeswrap.evaluation.calibration import ArrayLike, _check_labels, _check_probs

__all__ = ["SCORES", "calibrate", "conformity_scores", "conformal_report", "coverage_report", "prediction_sets",
           "quantile_index"]

SCORES = ("lac", "aps", "raps")
"""Accepted values of ``score``: ``"lac"`` (1 − π_y), ``"aps"`` (Romano et al. 2020), ``"raps"`` (Angelopoulos
et al. 2021)."""

SIZE_PERCENTILES = (50, 90, 99)
"""Percentiles of the set size in :func:`coverage_report`."""


# --------------------------------------------------------------------------------------------------
# input checking
# --------------------------------------------------------------------------------------------------
def _check_options(score: Any, randomized: Any, k_reg: Any, lam: Any) -> tuple[str, bool, int, float]:
    if not isinstance(score, str) or score not in SCORES:
        raise ValueError(f"score={score!r} is not known; accepted: {', '.join(SCORES)}")
    randomized = check_bool("randomized", randomized)
    if randomized and score == "lac":
        raise ValueError("randomized=True applies to the aps and raps scores; accepted with score='lac': "
                         "randomized=False")
    k_reg = check_int("k_reg", k_reg, minimum=0, note="labels ranked up to k_reg carry no RAPS penalty")
    lam = check_float("lam", lam, low=0.0, note="RAPS penalty per rank beyond k_reg")
    return score, randomized, k_reg, lam


def _check_alpha(alpha: Any) -> float:
    return check_float("alpha", alpha, low=0.0, high=1.0, low_open=True, high_open=True,
                       note="miscoverage level; the sets cover with probability >= 1 - alpha")


def _check_threshold(threshold: Any) -> float:
    return check_float("threshold", threshold, allow_inf=True, note="the quantile returned by calibrate")


def _tensor(probs: ArrayLike, name: str) -> torch.Tensor:
    return torch.from_numpy(_check_probs(probs, name))


# --------------------------------------------------------------------------------------------------
# scores, threshold, sets
# --------------------------------------------------------------------------------------------------
def conformity_scores(probs: ArrayLike, *, score: str = "aps", randomized: bool = False, k_reg: int = 1,
                      lam: float = 0.01, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""The conformity score :math:`s(x_i, y)` of every example and every label (large = fits badly).

    See the module docstring for the three scores; with :math:`\rho(y)` the mass
    ranked above y, :math:`o(y)` y's rank and :math:`u_i \sim U(0, 1)` (1 if not
    randomized): ``lac`` :math:`1 - \pi_y`; ``aps`` :math:`\rho(y) + u_i \pi_y`;
    ``raps`` :math:`\rho(y) + u_i \pi_y + \lambda (o(y) - k_{reg})^+`. Ties in
    probability are ranked by class index (a stable sort).

    Args:
        probs: (N, K) class probabilities, rows summing to 1 (any float dtype; tensor or array).
        score: one of :data:`SCORES`.
        randomized: draw one :math:`u_i` per example (aps and raps only).
        k_reg: RAPS: labels ranked 1..k_reg carry no penalty (an integer >= 0).
        lam: RAPS: penalty λ >= 0 per rank beyond ``k_reg``.
        generator: the source of the uniforms when ``randomized`` (CPU generator).

    Returns:
        (N, K) float64 CPU tensor of scores.

    Raises:
        ValueError: for probabilities that are not (N, K) rows on the simplex, an
            unknown ``score``, ``randomized`` with ``lac``, ``k_reg < 0`` or ``lam < 0``.

    Source:
        Sadinle et al. 2019 (LAC); Romano et al. 2020, §2 (APS); Angelopoulos et al.
        2021, §2 (RAPS).
    """
    score, randomized, k_reg, lam = _check_options(score, randomized, k_reg, lam)
    p = _tensor(probs, "probs")
    if score == "lac":
        return 1.0 - p
    sorted_p, order = torch.sort(p, dim=1, descending=True, stable=True)
    ranked = sorted_p.cumsum(1)  # mass of the labels ranked up to and including each one: ρ(y) + π_y
    if randomized:
        u = torch.rand(p.shape[0], 1, dtype=torch.float64, generator=generator)
        ranked = ranked - (1.0 - u) * sorted_p
    if score == "raps":
        rank = torch.arange(1, p.shape[1] + 1, dtype=torch.float64)
        ranked = ranked + lam * (rank - k_reg).clamp_min(0.0)
    return torch.empty_like(p).scatter_(1, order, ranked)


def quantile_index(n: int, alpha: float) -> int:
    r"""The rank :math:`k = \lceil (n + 1)(1 - \alpha) \rceil` of the split-conformal quantile among n scores.

    Computed exactly, with α read as the shortest decimal that prints as it
    (``Fraction(repr(alpha))``), so ``quantile_index(99, 0.45) == 55`` although
    ``100 * (1 - 0.45)`` rounds to 55.00000000000001 in floating point.

    Args:
        n: number of calibration examples (>= 1).
        alpha: miscoverage level in (0, 1).

    Returns:
        k, an integer in [1, n + 1]; k = n + 1 means the quantile is +∞ (n < 1/α − 1).

    Raises:
        ValueError: if ``n < 1`` or ``alpha`` is not in (0, 1).

    Source:
        Angelopoulos & Bates 2023, §1; Lei et al. 2018, §2.
    """
    n = check_int("n", n, minimum=1, note="calibration examples")
    alpha = _check_alpha(alpha)
    return math.ceil((n + 1) * (1 - _exact(alpha)))


def _exact(alpha: float) -> Fraction:
    """α as the shortest decimal that prints as it (0.45 is 45/100)."""
    return Fraction(repr(float(alpha)))


def calibrate(probs_val: ArrayLike, labels_val: ArrayLike, alpha: float = 0.1, *, score: str = "aps",
              randomized: bool = False, k_reg: int = 1, lam: float = 0.01,
              generator: torch.Generator | None = None) -> float:
    r"""The split-conformal threshold :math:`\hat q = s_{(k)}`, :math:`k = \lceil (n+1)(1-\alpha) \rceil`.

    Pass the same ``score``, ``randomized``, ``k_reg`` and ``lam`` to
    :func:`prediction_sets`. The calibration data must not have been used to fit
    the model or anything the score depends on (a temperature fitted on the same
    examples would break exchangeability).

    Args:
        probs_val: (N, K) calibration probabilities (rows summing to 1).
        labels_val: (N,) integer labels in [0, K).
        alpha: miscoverage level in (0, 1); the sets cover with probability >= 1 − α.
        score, randomized, k_reg, lam, generator: see :func:`conformity_scores`.

    Returns:
        :math:`\hat q` as a Python float; ``math.inf`` (with a ``UserWarning``) if
        :math:`k > n`, i.e. fewer than :math:`1/\alpha - 1` calibration examples,
        when every set is all K classes.

    Raises:
        ValueError: for ``alpha`` outside (0, 1), bad probabilities or labels, or
            bad score options (see :func:`conformity_scores`).

    Example:
        >>> p = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1], [0.6, 0.3, 0.1], [0.2, 0.7, 0.1]], dtype=torch.float64)
        >>> calibrate(p, torch.tensor([0, 1, 0, 0]), alpha=0.4, score="lac")  # 3rd smallest of 0.3, 0.6, 0.4, 0.8
        0.6

    Source:
        Vovk et al. 2005; Lei et al. 2018, §2; Angelopoulos & Bates 2023, §1.
    """
    alpha = _check_alpha(alpha)
    scores = conformity_scores(probs_val, score=score, randomized=randomized, k_reg=k_reg, lam=lam,
                               generator=generator)
    n, k_classes = scores.shape
    y = torch.from_numpy(_check_labels(labels_val, n, k_classes, "labels_val"))
    k = quantile_index(n, alpha)
    if k > n:
        least = math.ceil((1 - _exact(alpha)) / _exact(alpha))  # k <= n  <=>  n >= (1 - alpha) / alpha
        warnings.warn(f"split conformal with alpha={alpha:g} needs at least {least} calibration examples, got "
                      f"n={n}: the threshold is +inf and every prediction set holds all "
                      f"{k_classes} classes", UserWarning, stacklevel=2)
        return math.inf
    true_scores = scores.gather(1, y[:, None]).squeeze(1)
    return float(torch.kthvalue(true_scores, k).values)


def prediction_sets(probs: ArrayLike, threshold: float, *, score: str = "aps", randomized: bool = False,
                    k_reg: int = 1, lam: float = 0.01, generator: torch.Generator | None = None) -> torch.Tensor:
    r"""The conformal prediction sets :math:`C(x_i) = \{y : s(x_i, y) \le \hat q\}` as a boolean mask.

    Args:
        probs: (N, K) test probabilities (rows summing to 1).
        threshold: :math:`\hat q` from :func:`calibrate` (``inf`` gives full sets).
        score, randomized, k_reg, lam, generator: as given to :func:`calibrate`.

    Returns:
        (N, K) bool CPU tensor, True where label y is in example i's set. Sets are
        nested in the threshold (a smaller α gives a larger :math:`\hat q` and
        larger sets), and may be empty (see the module docstring).

    Raises:
        ValueError: for bad probabilities, a NaN threshold or bad score options.

    Source:
        Vovk et al. 2005; Romano et al. 2020, §2; Angelopoulos et al. 2021, §2.
    """
    threshold = _check_threshold(threshold)
    scores = conformity_scores(probs, score=score, randomized=randomized, k_reg=k_reg, lam=lam, generator=generator)
    return scores <= threshold


def coverage_report(sets: ArrayLike, labels: ArrayLike) -> dict[str, Any]:
    r"""Empirical coverage and set sizes of prediction sets.

    Args:
        sets: (N, K) boolean mask (or 0/1), e.g. from :func:`prediction_sets`.
        labels: (N,) integer labels in [0, K).

    Returns:
        ``{"n_examples", "coverage", "coverage_se", "mean_set_size", "empty_fraction",
        "set_size_percentiles", "by_size"}``: coverage
        :math:`\frac1N \sum_i [y_i \in C(x_i)]` with its binomial standard error
        :math:`\sqrt{c(1-c)/N}`; the mean set size; the share of empty sets; the
        50th/90th/99th percentiles of the size (``{"50": ..., ...}``, empirical
        quantiles, so whole numbers); and ``by_size``, ``{"size": {"count", "coverage"}}``
        for each set size that occurs (coverage among the sets of that size, the size-stratified
        coverage Angelopoulos et al. 2021 use to judge adaptiveness).

    Raises:
        ValueError: if ``sets`` is not an (N, K) 0/1 mask or the labels do not match it.
    """
    mask = sets if isinstance(sets, torch.Tensor) else torch.as_tensor(np.asarray(sets))
    if mask.dim() != 2 or 0 in mask.shape:
        raise ValueError(f"sets must be a non-empty (N, K) boolean mask; got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"sets must be a boolean (or 0/1) mask of shape (N, K); got dtype {mask.dtype} with "
                             "other values")
        mask = mask != 0
    mask = mask.cpu()
    n, k_classes = mask.shape
    y = torch.from_numpy(_check_labels(labels, n, k_classes))
    covered = mask.gather(1, y[:, None]).squeeze(1)
    sizes = mask.sum(1)
    counts = torch.bincount(sizes, minlength=k_classes + 1)
    hits = torch.bincount(sizes, weights=covered.double(), minlength=k_classes + 1)
    c = float(covered.double().mean())
    percentiles = np.percentile(sizes.numpy(), SIZE_PERCENTILES, method="inverted_cdf")
    return {
        "n_examples": n,
        "coverage": c,
        "coverage_se": math.sqrt(c * (1 - c) / n),
        "mean_set_size": float(sizes.double().mean()),
        "empty_fraction": float((sizes == 0).double().mean()),
        "set_size_percentiles": {str(q): int(v) for q, v in zip(SIZE_PERCENTILES, percentiles)},
        "by_size": {str(s): {"count": int(counts[s]), "coverage": float(hits[s] / counts[s])}
                    for s in torch.nonzero(counts).flatten().tolist()},
    }


def conformal_report(probs_val: ArrayLike, labels_val: ArrayLike, probs_test: ArrayLike, labels_test: ArrayLike,
                     alpha: float = 0.1, *, score: str = "aps", randomized: bool = False, k_reg: int = 1,
                     lam: float = 0.01, generator: torch.Generator | None = None) -> dict[str, Any]:
    r"""Split conformal end to end: the threshold from the validation set, sets and coverage on the test set.

    Args:
        probs_val, labels_val: (N_val, K) calibration probabilities and (N_val,) labels.
        probs_test, labels_test: (N_test, K) test probabilities and (N_test,) labels.
        alpha, score, randomized, k_reg, lam, generator: see :func:`calibrate`.

    Returns:
        A JSON-serialisable dict: ``alpha``, ``score``, ``randomized`` (and ``k_reg``,
        ``lam`` for RAPS), ``n_calibration``, ``threshold`` (``None`` when +∞),
        ``full_sets`` (True when the validation set is too small for α and every set
        is all K classes), ``target_coverage`` (:math:`k/(n+1)`, the exact expected
        coverage without ties, in :math:`[1-\alpha, 1-\alpha+1/(n+1)]`), then the
        keys of :func:`coverage_report` on the test set.

    Raises:
        ValueError: on bad input (see :func:`calibrate` and :func:`coverage_report`),
            or if validation and test have different numbers of classes.

    Source:
        Angelopoulos & Bates 2023, §1; Romano et al. 2020; Angelopoulos et al. 2021.
    """
    options = dict(score=score, randomized=randomized, k_reg=k_reg, lam=lam, generator=generator)
    threshold = calibrate(probs_val, labels_val, alpha, **options)
    sets = prediction_sets(probs_test, threshold, **options)
    n, k_val = np.shape(probs_val)  # both checked to be (N, K) by now
    if sets.shape[1] != k_val:
        raise ValueError(f"probs_val has K = {k_val} classes and probs_test K = {sets.shape[1]}; accepted: the same K")
    full = math.isinf(threshold)
    out: dict[str, Any] = {"alpha": float(alpha), "score": score, "randomized": bool(randomized)}
    if score == "raps":
        out.update(k_reg=int(k_reg), lam=float(lam))
    out.update(n_calibration=n, threshold=None if full else threshold, full_sets=full,
               target_coverage=1.0 if full else quantile_index(n, alpha) / (n + 1))
    return {**out, **coverage_report(sets, labels_test)}
