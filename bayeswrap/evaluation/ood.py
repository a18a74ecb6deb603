r"""Out-of-distribution (OOD) detection metrics: AUROC, AUPR-in, AUPR-out, FPR95.

A detector assigns each example a score where **higher means more likely
out-of-distribution** (e.g. :func:`~bayeswrap.evaluation.uncertainty.predictive_entropy`
or :func:`~bayeswrap.evaluation.uncertainty.mutual_information`; for a
confidence such as the max probability, pass its negative). The in- and
out-of-distribution examples are pooled into one binary problem with label 1 =
OOD, and the threshold-free metrics are computed with scikit-learn.

References:
    Hendrycks, Gimpel. A Baseline for Detecting Misclassified and
    Out-of-Distribution Examples in Neural Networks. ICLR 2017, §3.
    Liang, Li, Srikant. Enhancing the Reliability of Out-of-distribution Image
    Detection in Neural Networks (ODIN). ICLR 2018, §4 (FPR at 95% TPR).
"""

from __future__ import annotations

import numpy as np
import torch

from bayeswrap.evaluation.calibration import ArrayLike
from bayeswrap.evaluation.uncertainty import _check_vector

__all__ = ["FPR_AT_TPR", "ood_metrics"]

FPR_AT_TPR = 0.95
"""The true-positive rate (share of OOD examples detected) at which ``fpr95`` is read off the ROC curve."""


def ood_metrics(score_in: ArrayLike, score_out: ArrayLike) -> dict[str, float]:
    r"""Threshold-free OOD-detection metrics of a score (higher = more likely OOD).

    With labels :math:`t = 0` for the ``N_in`` in-distribution and :math:`t = 1`
    for the ``N_out`` OOD examples and the pooled scores :math:`s`:

    * ``auroc``: ``binary_auroc(s, t)`` (= scikit-learn's ``roc_auc_score(t, s)``), the
      probability that a random OOD example scores higher than a random in-distribution
      one (ties count 1/2).
    * ``aupr_out``: ``binary_average_precision(s, t)`` (= ``average_precision_score(t, s)``),
      OOD as the positive class.
    * ``aupr_in``: ``binary_average_precision(-s, 1 - t)``, in-distribution as
      the positive class, ranked by the negated score.
    * ``fpr95``: on the exact ROC curve ``binary_roc(s, t)`` (= ``roc_curve(t, s,
      drop_intermediate=False)``), the false-positive
      rate (share of in-distribution examples flagged as OOD) at the first point
      (highest threshold) whose true-positive rate (share of OOD examples
      detected) is at least 0.95: :math:`\min\{\mathrm{FPR}(\tau) : \mathrm{TPR}(\tau) \ge 0.95\}`
      over thresholds τ = the distinct scores. No interpolation between points
      (the convention of torch-uncertainty's ``FPR95``).

    The average precision is the step-wise sum
    :math:`\sum_n (R_n - R_{n-1}) P_n`, not the trapezoidal area; rounding
    error outside [0, 1] is clipped. torchmetrics computes the curves in float32
    counts and rates, so each value agrees with scikit-learn's float64 one to about 1e-6. Swapping
    ``score_in`` and ``score_out`` turns ``auroc`` into ``1 - auroc`` and
    exchanges the two AUPRs.

    Args:
        score_in: (N_in,) scores of in-distribution examples (torch or numpy), finite.
        score_out: (N_out,) scores of out-of-distribution examples, finite.

    Returns:
        ``{"auroc", "aupr_in", "aupr_out", "fpr95"}``, each a Python float in [0, 1].

    Raises:
        ValueError: if either score array is not 1-D, is empty, or contains NaN/inf.

    Example:
        >>> m = ood_metrics(np.array([0.1, 0.2, 0.3, 0.6]), np.array([0.5, 0.7, 0.8]))
        >>> round(m["auroc"], 4)   # 11 of the 12 (out, in) pairs are ordered right (0.5 < 0.6)
        0.9167
        >>> m["fpr95"]             # all 3 OOD detected only at threshold 0.5, which flags 0.6: 1/4
        0.25

    Source:
        Hendrycks & Gimpel 2017 (ICLR), §3; Liang et al. 2018 (ICLR), §4 (FPR at 95% TPR).
    """
    s_in = _check_vector(score_in, "score_in", what="in-distribution example")
    s_out = _check_vector(score_out, "score_out", what="out-of-distribution example")
    from torchmetrics.functional.classification import (  # ~2.5 s: imported when first used
        binary_auroc,
        binary_average_precision,
        binary_roc,
    )

    target = torch.cat([torch.zeros(len(s_in), dtype=torch.long), torch.ones(len(s_out), dtype=torch.long)])
    rank, top = _dense_ranks(np.concatenate([s_in, s_out]))
    up, down = rank / top, (top - rank) / top  # the order of s and of -s, in [0, 1]
    fpr, tpr, _ = binary_roc(up, target, validate_args=False)
    metrics = {
        "auroc": binary_auroc(up, target, validate_args=False),
        "aupr_in": binary_average_precision(down, 1 - target, validate_args=False),
        "aupr_out": binary_average_precision(up, target, validate_args=False),
        "fpr95": fpr[int(torch.argmax((tpr >= FPR_AT_TPR).to(torch.uint8)))],
    }
    return {name: float(np.clip(float(value), 0.0, 1.0)) for name, value in metrics.items()}


def _dense_ranks(scores: np.ndarray) -> tuple[torch.Tensor, float]:
    """Dense ranks of ``scores`` (equal scores share a rank) as float64, and the largest rank (at least 1).

    Any function of the scores that depends only on their order (ROC, PR curve) is the same for the ranks.
    """
    distinct, rank = np.unique(scores, return_inverse=True)
    return torch.from_numpy(rank.astype(np.float64)), float(max(len(distinct) - 1, 1))
