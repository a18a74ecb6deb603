r"""Selective prediction: the risk-coverage curve, AURC and E-AURC.

A selective classifier predicts only on the examples it is most confident
about and abstains on the rest. Accepting examples in order of decreasing
``confidence`` (e.g. the max predictive probability, or minus an uncertainty
such as :func:`~bayeswrap.evaluation.uncertainty.predictive_entropy`) traces
the risk-coverage curve: coverage is the accepted share, risk the error rate
among the accepted. Lower curves (and lower AURC) mean a better ranking.

Ties: examples with equal confidence are accepted together, so the curve has
one point per distinct confidence value (like ``sklearn.metrics.roc_curve``).

References:
    Geifman, Uziel, El-Yaniv. Bias-Reduced Uncertainty Estimation for Deep
    Neural Classifiers. ICLR 2019, §3 (AURC, E-AURC).
    El-Yaniv, Wiener. On the Foundations of Noise-free Selective Classification.
    JMLR 2010 (risk-coverage curve).
"""

from __future__ import annotations

import numpy as np
import torch

from bayeswrap.evaluation.calibration import ArrayLike
from bayeswrap.evaluation.uncertainty import _check_correct, _check_vector

__all__ = ["aurc", "aurc_optimal", "excess_aurc", "risk_coverage"]


def _curve(confidence: ArrayLike, correct: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    conf = _check_vector(confidence, "confidence")
    ok = _check_correct(correct, len(conf), against="confidence")
    order = np.argsort(-conf, kind="stable")
    errors = np.cumsum(~ok[order])
    last = np.append(np.flatnonzero(np.diff(conf[order])), len(conf) - 1)  # last index of each tie group
    accepted = last + 1
    return accepted / len(conf), errors[last] / accepted


def risk_coverage(confidence: ArrayLike, correct: ArrayLike) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The risk-coverage curve of accepting examples by decreasing confidence.

    For each distinct confidence value :math:`\tau_1 > \tau_2 > \dots > \tau_J`,
    all examples with :math:`\kappa_i \ge \tau_j` are accepted and

    .. math::

        \mathrm{coverage}_j = \frac{\#\{i : \kappa_i \ge \tau_j\}}{N}, \qquad
        \mathrm{risk}_j = \frac{\#\{i : \kappa_i \ge \tau_j,\ \text{wrong}_i\}}{\#\{i : \kappa_i \ge \tau_j\}}

    Coverage increases strictly to 1 (the last point accepts everything, with
    risk = the overall error rate).

    Args:
        confidence: (N,) finite confidence per example (higher = accept first).
        correct: (N,) bool or 0/1, True where the prediction is correct.

    Returns:
        ``(coverage, risk)``, two float64 CPU tensors of shape (J,), J = the
        number of distinct confidence values.

    Raises:
        ValueError: if ``confidence`` is not 1-D, empty or non-finite, or
            ``correct`` is not boolean/0-1 or has a different length.

    Example:
        >>> cov, risk = risk_coverage(torch.tensor([0.9, 0.8, 0.8, 0.3]), torch.tensor([1, 0, 1, 0]))
        >>> cov.tolist(), risk.tolist()   # accept {0.9}, then both 0.8s together, then 0.3
        ([0.25, 0.75, 1.0], [0.0, 0.3333333333333333, 0.5])

    Source:
        El-Yaniv & Wiener 2010 (JMLR); Geifman et al. 2019 (ICLR), §3.
    """
    coverage, risk = _curve(confidence, correct)
    return torch.from_numpy(coverage), torch.from_numpy(risk)


def aurc(confidence: ArrayLike, correct: ArrayLike) -> float:
    r"""Area under the risk-coverage curve (AURC), step-integrated.

    With the points :math:`(\mathrm{coverage}_j, \mathrm{risk}_j)` of
    :func:`risk_coverage` and :math:`\mathrm{coverage}_0 = 0`:

    .. math::

        \mathrm{AURC} = \sum_{j=1}^{J} \mathrm{risk}_j\,(\mathrm{coverage}_j - \mathrm{coverage}_{j-1})

    Without ties this is exactly Geifman et al.'s
    :math:`\frac{1}{N}\sum_{k=1}^{N} \mathrm{risk}(\text{top-}k)`, the mean risk
    of the k most confident examples over k = 1..N. A tie group of size g
    contributes ``g/N`` times the risk after the whole group is accepted
    (not an average over orders within the group). A random ranking gives
    AURC ≈ the error rate; the best possible value is :func:`aurc_optimal`.

    Args:
        confidence: (N,) finite confidence per example (higher = accept first).
        correct: (N,) bool or 0/1, True where the prediction is correct.

    Returns:
        AURC as a Python float in [0, 1].

    Raises:
        ValueError: on bad input (see :func:`risk_coverage`).

    Example:
        >>> aurc(torch.tensor([0.9, 0.8, 0.7, 0.3]), torch.tensor([1, 0, 1, 0]))   # (0 + 1/2 + 1/3 + 2/4) / 4
        0.3333333333333333

    Source:
        Geifman, Uziel, El-Yaniv 2019 (ICLR), §3.
    """
    coverage, risk = _curve(confidence, correct)
    return float(np.sum(risk * np.diff(coverage, prepend=0.0)))


def aurc_optimal(correct: ArrayLike) -> float:
    r"""The smallest AURC possible for these outcomes: a perfect ranking, all correct before all errors.

    With e errors among N examples (no ties), the top-k risk is 0 for
    :math:`k \le N - e` and :math:`(k - (N - e)) / k` above, so

    .. math::

        \mathrm{AURC}^\star = \frac{1}{N}\sum_{k=N-e+1}^{N} \frac{k - (N - e)}{k}
            \;\approx\; \hat r + (1 - \hat r)\ln(1 - \hat r), \qquad \hat r = e / N

    (the integral form of Geifman et al. 2019, for large N).

    Args:
        correct: (N,) bool or 0/1, True where the prediction is correct.

    Returns:
        AURC* as a Python float (0.0 when there is no error).

    Raises:
        ValueError: if ``correct`` is not 1-D, empty, or not boolean/0-1.

    Example:
        >>> aurc_optimal(torch.tensor([1, 0, 1, 0]))   # (1/3 + 2/4) / 4
        0.20833333333333331

    Source:
        Geifman, Uziel, El-Yaniv 2019 (ICLR), §3.
    """
    ok = _check_correct(correct)
    n, e = len(ok), int((~ok).sum())
    k = np.arange(n - e + 1, n + 1, dtype=np.float64)
    return float(np.sum((k - (n - e)) / k) / n)


def excess_aurc(confidence: ArrayLike, correct: ArrayLike) -> float:
    r"""Excess AURC (E-AURC): :func:`aurc` minus :func:`aurc_optimal`.

    .. math::

        \mathrm{E\text{-}AURC} = \mathrm{AURC} - \mathrm{AURC}^\star

    It removes the part of AURC that is due to the error rate alone, so it
    compares rankings across models of different accuracy; 0 for a perfect
    ranking without ties.

    Args:
        confidence: (N,) finite confidence per example (higher = accept first).
        correct: (N,) bool or 0/1, True where the prediction is correct.

    Returns:
        E-AURC as a Python float.

    Raises:
        ValueError: on bad input (see :func:`risk_coverage`).

    Example:
        >>> round(excess_aurc(torch.tensor([0.9, 0.8, 0.7, 0.3]), torch.tensor([1, 0, 1, 0])), 6)   # 1/3 - 5/24
        0.125

    Source:
        Geifman, Uziel, El-Yaniv 2019 (ICLR), §3.
    """
    return aurc(confidence, correct) - aurc_optimal(correct)
