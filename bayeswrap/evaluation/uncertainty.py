r"""Per-example uncertainty measures over posterior samples, and the γ-metric.

Classification measures take ``sample_probs`` of shape ``(S, B, K)``: the class
probabilities :math:`p_s = p(y \mid x_b, \theta_s)` of ``B`` examples under
``S`` posterior samples, e.g. ``bnn.sample_logits(x, S).softmax(-1)``. Inputs
may be torch tensors (any device, any float dtype) or numpy arrays; every row
(over K) must lie in [0, 1] and sum to 1 within 1e-4 (within 4 machine
epsilons for float16/bfloat16 input, which is upcast; it is then divided by
its sum, so the measures see exactly normalised rows). Everything is computed
in float64 and per-example results are returned as float64 CPU tensors of
shape ``(B,)``.

Entropies are in nats with :math:`0 \log 0 = 0`. With
:math:`\bar p = \frac{1}{S}\sum_s p_s` (the posterior predictive):

* :func:`predictive_entropy`: :math:`H[\bar p]`, total uncertainty.
* :func:`expected_entropy`: :math:`\frac{1}{S}\sum_s H[p_s]`, aleatoric part.
* :func:`mutual_information`: their difference (BALD), epistemic part;
  :math:`0 \le \mathrm{MI} \le H[\bar p] \le \log K`.
* :func:`variation_ratio`: :math:`1 - C/S`, the share of samples that do not
  vote for the modal class.
* :func:`predictive_std`: standard deviation over samples of the predicted
  class's probability.
* :func:`ga_uncertainty` and :func:`ga_cutoff`: the Gaussian-approximation
  uncertainty of a PyMC3 BNN dissertation (MNIST, §7.2), and the choice of its
  cutoff on held-out data by the γ-metric (:func:`gamma_curve`).

Regression: :func:`regression_uncertainty` splits the Gaussian predictive
variance into aleatoric (noise) and epistemic (spread of the sampled means)
parts, consistently with :meth:`bayeswrap.BayesianModel.predict`.

Note: :func:`bayeswrap.evaluation.calibration.predictive_entropy` is a
different function: it takes an already averaged ``(N, K)`` predictive and by
default returns the mean entropy as a float.

References:
    Gal. Uncertainty in Deep Learning. PhD thesis, Cambridge 2016, §3.3.1.
    Houlsby, Huszár, Ghahramani, Lengyel. Bayesian Active Learning for
    Classification and Preference Learning. arXiv:1112.5745, 2011 (BALD).
    Depeweg, Hernández-Lobato, Doshi-Velez, Udluft. Decomposition of Uncertainty
    in Bayesian Deep Learning for Efficient and Risk-sensitive Learning. ICML 2018.
    Kendall, Gal. What Uncertainties Do We Need in Bayesian Deep Learning for
    Computer Vision? NeurIPS 2017, eq. 9.
    Freeman. Elementary Applied Statistics. Wiley 1965 (variation ratio).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from bayeswrap.evaluation.calibration import ArrayLike, _row_sum_tol, _to_float64

__all__ = [
    "PREDICTIVE_STD_REDUCTIONS",
    "RegressionUncertainty",
    "expected_entropy",
    "ga_cutoff",
    "ga_uncertainty",
    "gamma_curve",
    "mutual_information",
    "predictive_entropy",
    "predictive_std",
    "regression_uncertainty",
    "variation_ratio",
]

PREDICTIVE_STD_REDUCTIONS = ("predicted", "none")
"""Accepted values of ``reduction`` for :func:`predictive_std`."""


# --------------------------------------------------------------------------------------------------
# input checking (shared with ood.py and selective.py)
# --------------------------------------------------------------------------------------------------
def _at(index: Any) -> str:
    """``[i, j, k]`` for an index tuple from ``np.argwhere``."""
    return "[" + ", ".join(str(int(i)) for i in np.atleast_1d(index)) + "]"


def _check_finite(arr: np.ndarray, name: str) -> None:
    nan = np.isnan(arr)
    if nan.any():
        raise ValueError(f"{name} contains NaN ({int(nan.sum())} entries, first at {_at(np.argwhere(nan)[0])}); "
                         "accepted: finite values")
    inf = np.isinf(arr)
    if inf.any():
        where = np.argwhere(inf)[0]
        raise ValueError(f"{name}{_at(where)} = {float(arr[tuple(where)])!r} is not finite; accepted: finite values")


def _check_sample_probs(sample_probs: ArrayLike, *, min_samples: int = 1, caller: str = "",
                        name: str = "sample_probs") -> torch.Tensor:
    """Checks (S, B, K) per-sample probabilities; returns them float64 on the CPU with rows renormalised."""
    p = _to_float64(sample_probs, name)
    shape = tuple(p.shape)
    if p.ndim != 3:
        hint = (" (a (B, K) array has no sample axis: pass per-sample probabilities such as "
                "bnn.sample_logits(x, S).softmax(-1), or probs[None] for a single sample)") if p.ndim == 2 else ""
        raise ValueError(f"{name} must have shape (S, B, K) = (samples, examples, classes); got shape {shape}{hint}")
    if 0 in shape:
        raise ValueError(f"{name} is empty (shape {shape}); accepted: S >= 1 samples, B >= 1 examples, K >= 1 classes")
    if shape[0] < min_samples:
        raise ValueError(f"{caller} needs at least {min_samples} posterior samples, got S = {shape[0]} "
                         f"({name} of shape {shape}); accepted: S >= {min_samples}")
    _check_finite(p, name)
    tol = _row_sum_tol(sample_probs)
    bad = (p < 0) | (p > 1 + tol)
    if bad.any():
        where = np.argwhere(bad)[0]
        raise ValueError(f"{name}{_at(where)} = {float(p[tuple(where)])!r} is not a probability; "
                         "accepted: values in [0, 1]")
    sums = p.sum(axis=-1)
    off = np.abs(sums - 1.0) > tol
    if off.any():
        where = np.argwhere(off)[0]
        raise ValueError(f"rows of {name} (over the last axis, K) must sum to 1 within {tol:g}; row "
                         f"{_at(where)} sums to {float(sums[tuple(where)]):.6g} ({int(off.sum())} of "
                         f"{off.size} rows are off). Pass probabilities, not logits: apply softmax over the last axis")
    t = torch.from_numpy(p)
    return t / t.sum(-1, keepdim=True)


def _check_vector(x: ArrayLike, name: str, what: str = "example") -> np.ndarray:
    """Checks a non-empty, finite, one-dimensional array; returns it as float64 numpy."""
    arr = _to_float64(x, name)
    if arr.ndim != 1:
        raise ValueError(f"{name} must have shape (N,), one value per {what}; got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty (shape (0,)); accepted: at least one {what}")
    _check_finite(arr, name)
    return arr


def _check_correct(correct: ArrayLike, n: int | None = None, *, against: str = "", name: str = "correct") -> np.ndarray:
    """Checks a boolean / 0-1 vector (of length ``n`` if given); returns it as a numpy bool array."""
    arr = _to_float64(correct, name)
    if arr.ndim != 1:
        raise ValueError(f"{name} must have shape (N,), one bool per example; got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty (shape (0,)); accepted: at least one example")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has length {arr.shape[0]} but {against} has length {n}; "
                         "accepted: one entry per example (the same length)")
    bad = (arr != 0) & (arr != 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {float(arr[i])!r} is not boolean ({int(bad.sum())} such entries); "
                         "accepted: bool or 0/1 values (True = correctly classified)")
    return arr == 1


def _check_alphas(alphas: Any, name: str = "alphas") -> np.ndarray:
    """Checks quantile levels in (0, 1): a scalar or a non-empty 1-D sequence; returns a 1-D float64 array."""
    arr = _to_float64(alphas, name)
    if arr.ndim > 1 or arr.size == 0:
        raise ValueError(f"{name} must be a number or a non-empty 1-D sequence of numbers in (0, 1); "
                         f"got shape {tuple(arr.shape)}")
    arr = arr.reshape(-1)
    bad = ~((arr > 0) & (arr < 1))
    if bad.any():
        i = int(np.argmax(bad))
        label = f"{name}[{i}]" if np.ndim(alphas) else name
        raise ValueError(f"{label} = {float(arr[i])!r} is outside (0, 1); accepted: levels strictly between 0 and 1")
    return arr


def _check_cutoff(cutoff: Any) -> float:
    try:
        c = float(cutoff)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cutoff must be a finite number; got {cutoff!r}") from exc
    if isinstance(cutoff, (bool, np.bool_)) or not math.isfinite(c):
        raise ValueError(f"cutoff must be a finite number; got {cutoff!r}")
    return c


def _check_both_outcomes(correct: np.ndarray) -> None:
    n_ok = int(correct.sum())
    n_err = len(correct) - n_ok
    if n_ok == 0 or n_err == 0:
        raise ValueError(f"the γ-metric needs at least one correctly classified and one misclassified example; "
                         f"got {n_ok} correct and {n_err} misclassified of {len(correct)}")


# --------------------------------------------------------------------------------------------------
# entropy-based measures
# --------------------------------------------------------------------------------------------------
def _entropy(p: torch.Tensor) -> torch.Tensor:
    """Entropy over the last axis in nats, with 0 log 0 = 0."""
    return -torch.special.xlogy(p, p).sum(-1)


def predictive_entropy(sample_probs: ArrayLike) -> torch.Tensor:
    r"""Entropy of the posterior predictive (total uncertainty), per example.

    .. math::

        H_b = H\Bigl[\frac{1}{S}\sum_{s=1}^{S} p_{sb}\Bigr]
            = -\sum_{k=1}^{K} \bar p_{bk} \log \bar p_{bk}, \qquad 0 \log 0 = 0

    Args:
        sample_probs: (S, B, K) class probabilities under S posterior samples
            (torch or numpy, any float dtype); rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).

    Returns:
        (B,) float64 CPU tensor, in nats, in [0, log K].

    Raises:
        ValueError: if ``sample_probs`` is not 3-D, is empty, contains NaN/inf or
            values outside [0, 1], or has rows not summing to 1.

    Example:
        >>> sp = torch.tensor([[[1.0, 0.0], [0.5, 0.5]],
        ...                    [[0.0, 1.0], [0.5, 0.5]]])   # S = 2, B = 2, K = 2
        >>> predictive_entropy(sp)   # both predictives are (0.5, 0.5): log 2
        tensor([0.6931, 0.6931], dtype=torch.float64)

    Source:
        Gal 2016, PhD thesis, §3.3.1 (predictive entropy).
    """
    return _entropy(_check_sample_probs(sample_probs).mean(0))


def expected_entropy(sample_probs: ArrayLike) -> torch.Tensor:
    r"""Expected entropy of the per-sample predictives (aleatoric uncertainty), per example.

    .. math::

        \mathbb{E}_{\theta}\,H[p(y \mid x_b, \theta)] \approx \frac{1}{S}\sum_{s=1}^{S} H[p_{sb}]

    Args:
        sample_probs: (S, B, K) class probabilities under S posterior samples;
            rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).

    Returns:
        (B,) float64 CPU tensor, in nats, in [0, log K].

    Raises:
        ValueError: on bad ``sample_probs`` (see :func:`predictive_entropy`).

    Example:
        >>> sp = torch.tensor([[[1.0, 0.0], [0.5, 0.5]],
        ...                    [[0.0, 1.0], [0.5, 0.5]]])
        >>> expected_entropy(sp)     # (0 + 0) / 2 and (log 2 + log 2) / 2
        tensor([0.0000, 0.6931], dtype=torch.float64)

    Source:
        Depeweg et al. 2018, ICML, §3 (aleatoric term of the entropy decomposition).
    """
    return _entropy(_check_sample_probs(sample_probs)).mean(0)


def mutual_information(sample_probs: ArrayLike) -> torch.Tensor:
    r"""Mutual information between the label and the weights (epistemic uncertainty; BALD), per example.

    .. math::

        \mathrm{MI}_b = I[y, \theta \mid x_b, \mathcal D]
            \approx H\Bigl[\frac{1}{S}\sum_s p_{sb}\Bigr] - \frac{1}{S}\sum_s H[p_{sb}]

    i.e. :func:`predictive_entropy` minus :func:`expected_entropy`. It is 0 when
    all samples agree and large when confident samples disagree. Negative
    values from floating-point error are clamped to 0, so
    ``0 <= MI <= predictive_entropy`` holds exactly.

    Args:
        sample_probs: (S, B, K) class probabilities under S posterior samples;
            rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).

    Returns:
        (B,) float64 CPU tensor, in nats, in [0, log K].

    Raises:
        ValueError: on bad ``sample_probs`` (see :func:`predictive_entropy`).

    Example:
        >>> sp = torch.tensor([[[1.0, 0.0], [0.5, 0.5]],
        ...                    [[0.0, 1.0], [0.5, 0.5]]])
        >>> mutual_information(sp)   # log 2 - 0 (samples disagree), log 2 - log 2 (they agree)
        tensor([0.6931, 0.0000], dtype=torch.float64)

    Source:
        Houlsby et al. 2011, arXiv:1112.5745 (BALD); Gal 2016, PhD thesis, §3.3.1.
    """
    p = _check_sample_probs(sample_probs)
    return (_entropy(p.mean(0)) - _entropy(p).mean(0)).clamp_min(0.0)


# --------------------------------------------------------------------------------------------------
# vote- and spread-based measures
# --------------------------------------------------------------------------------------------------
def _modal_count(p: torch.Tensor) -> torch.Tensor:
    """(B,) float64: C, the number of samples voting (by argmax, ties -> lowest index) for the modal class."""
    votes = F.one_hot(p.argmax(-1), p.shape[-1]).sum(0)  # (B, K)
    return votes.max(-1).values.to(torch.float64)


def variation_ratio(sample_probs: ArrayLike) -> torch.Tensor:
    r"""Variation ratio ("model inconsistency"): the share of samples not voting for the modal class.

    .. math::

        \mathrm{VR}_b = 1 - \frac{C_b}{S}, \qquad
        C_b = \max_k \sum_{s=1}^{S} \bigl[\arg\max_j p_{sbj} = k\bigr]

    Each sample votes for its argmax class (ties go to the lowest index);
    ``C_b`` is the size of the largest group of samples voting for the same
    class. ``VR = 0`` when all samples agree (always, for S = 1) and at most
    ``1 - 1/K``.

    Args:
        sample_probs: (S, B, K) class probabilities under S posterior samples;
            rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).

    Returns:
        (B,) float64 CPU tensor in [0, 1 - 1/K].

    Raises:
        ValueError: on bad ``sample_probs`` (see :func:`predictive_entropy`).

    Example:
        >>> sp = torch.tensor([[[1.0, 0.0], [0.5, 0.5]],
        ...                    [[0.0, 1.0], [0.5, 0.5]]])
        >>> variation_ratio(sp)      # votes (0, 1): 1 - 1/2; votes (0, 0) (tie -> 0): 1 - 2/2
        tensor([0.5000, 0.0000], dtype=torch.float64)

    Source:
        Freeman 1965; Gal 2016, PhD thesis, §3.3.1 (variation ratios).
    """
    p = _check_sample_probs(sample_probs)
    return 1.0 - _modal_count(p) / p.shape[0]


def predictive_std(sample_probs: ArrayLike, reduction: str = "predicted") -> torch.Tensor:
    r"""Standard deviation over posterior samples of the class probabilities.

    .. math::

        \sigma_{bk} = \sqrt{\frac{1}{S-1}\sum_{s=1}^{S} (p_{sbk} - \bar p_{bk})^2}

    With ``reduction="predicted"`` (default) the result is
    :math:`\sigma_{b\hat k_b}` for the predicted class
    :math:`\hat k_b = \arg\max_k \bar p_{bk}` (ties go to the lowest index);
    with ``reduction="none"`` it is the full (B, K) matrix.

    Args:
        sample_probs: (S, B, K) class probabilities under S >= 2 posterior
            samples; rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        reduction: ``"predicted"`` or ``"none"``.

    Returns:
        (B,) float64 CPU tensor, or (B, K) for ``reduction="none"``.

    Raises:
        ValueError: on bad ``sample_probs`` (see :func:`predictive_entropy`),
            S = 1, or an unknown ``reduction``.

    Example:
        >>> sp = torch.tensor([[[1.0, 0.0], [0.5, 0.5]],
        ...                    [[0.0, 1.0], [0.5, 0.5]]])
        >>> predictive_std(sp)       # class 0: std(1, 0) = sqrt(0.5^2 + 0.5^2); std(0.5, 0.5) = 0
        tensor([0.7071, 0.0000], dtype=torch.float64)

    Source:
        The spread of MC-dropout predictions used by Leibig et al., Leveraging
        uncertainty information from deep neural networks for disease
        detection, Sci. Rep. 7:17816, 2017, and by Kendall, Badrinarayanan,
        Cipolla, Bayesian SegNet, BMVC 2017.
    """
    if reduction not in PREDICTIVE_STD_REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; accepted: "
                         f"{', '.join(map(repr, PREDICTIVE_STD_REDUCTIONS))}")
    p = _check_sample_probs(sample_probs, min_samples=2, caller="predictive_std")
    std = p.std(0, correction=1)
    if reduction == "none":
        return std
    return std.gather(-1, p.mean(0).argmax(-1, keepdim=True)).squeeze(-1)


# --------------------------------------------------------------------------------------------------
# Gaussian-approximation uncertainty and the γ-metric
# --------------------------------------------------------------------------------------------------
def _ga(count: torch.Tensor, s: int, cutoffs: torch.Tensor) -> torch.Tensor:
    """U for modal counts ``count`` (B,) and cutoffs (M, 1) -> (M, B)."""
    n = s - 1
    g = count - 1
    var = g * (n - g) / n
    z = (cutoffs - g) / var.clamp_min(torch.finfo(torch.float64).tiny).sqrt()
    # Φ(z) = erfc(-z/√2)/2 keeps its relative accuracy in the lower tail; torch.special.ndtr (1 + erf)/2
    # cancels to exactly 0 below z ≈ -8.3, which would tie every confident example at U = 0
    phi = 0.5 * torch.special.erfc(-z / math.sqrt(2.0))
    return torch.where(var > 0, phi, (g < cutoffs).to(torch.float64))


def ga_uncertainty(sample_probs: ArrayLike, cutoff: float) -> torch.Tensor:
    r"""Gaussian-approximation (GA) uncertainty of the sample votes.

    With :math:`C_b` the modal vote count of :func:`variation_ratio`, the number
    of *other* samples agreeing with the modal class is
    :math:`G_b = C_b - 1`, modelled as :math:`G \sim \mathrm{Bin}(S-1, \hat p)`
    with :math:`\hat p_b = G_b / (S-1)`. The uncertainty is the probability
    that G falls below ``cutoff`` under the normal approximation
    :math:`\mathcal N\bigl((S-1)\hat p, (S-1)\hat p(1-\hat p)\bigr)`:

    .. math::

        U_b = P(G < c) = \Phi\!\left(\frac{c - (S-1)\hat p_b}
                                        {\sqrt{(S-1)\hat p_b (1 - \hat p_b)}}\right)

    When :math:`\hat p_b \in \{0, 1\}` the variance is 0 and the normal is a
    point mass at :math:`(S-1)\hat p_b`, so :math:`U_b = 1` if
    :math:`(S-1)\hat p_b < c` and :math:`U_b = 0` otherwise. High U means
    "few samples agree": flag the example as uncertain. Choose ``c`` with
    :func:`ga_cutoff`.

    Args:
        sample_probs: (S, B, K) class probabilities under S >= 2 posterior
            samples; rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        cutoff: the threshold c on G, a finite number (natural choices are
            half-integers 0.5, 1.5, ..., S - 0.5).

    Returns:
        (B,) float64 CPU tensor in [0, 1].

    Raises:
        ValueError: on bad ``sample_probs`` (see :func:`predictive_entropy`),
            S = 1, or a ``cutoff`` that is not a finite number.

    Example:
        >>> votes = torch.tensor([0, 0, 0, 1, 1])        # S = 5 sample argmaxes of one example
        >>> sp = F.one_hot(votes, 2).double()[:, None]   # (5, 1, 2); C = 3, G = 2, p = 2/4
        >>> ga_uncertainty(sp, 2.5)                      # Phi((2.5 - 2) / sqrt(4 * 0.5 * 0.5))
        tensor([0.6915], dtype=torch.float64)
        >>> ga_uncertainty(sp[:3], 1.5)                  # all 3 agree: point mass at G = 2 >= 1.5
        tensor([0.], dtype=torch.float64)

    Source:
        The PyMC3 Bayesian-neural-network dissertation this project follows,
        MNIST experiments, §7.2 (Gaussian approximation of the vote count).
    """
    c = _check_cutoff(cutoff)
    p = _check_sample_probs(sample_probs, min_samples=2, caller="ga_uncertainty")
    return _ga(_modal_count(p), p.shape[0], torch.tensor([[c]], dtype=torch.float64))[0]


def _gamma(u: np.ndarray, correct: np.ndarray, alphas: np.ndarray) -> np.ndarray:
    """γ for M uncertainty vectors ``u`` (M, B) and A levels -> (M, A)."""
    k_alpha = np.quantile(u[:, ~correct], alphas, axis=1)  # (A, M), linear interpolation
    below = u[:, None, correct] < k_alpha.T[:, :, None]  # (M, A, B_correct)
    return below.mean(-1)


def gamma_curve(uncertainty: ArrayLike, correct: ArrayLike, alphas: Any) -> torch.Tensor:
    r"""The γ-metric: how many correct predictions are less uncertain than the misclassified ones.

    For each level α, :math:`K_\alpha` is the α-quantile of the uncertainties of
    the misclassified examples (numpy's default ``"linear"`` quantile, i.e.
    linear interpolation between order statistics), and

    .. math::

        \gamma(\alpha) = \frac{\#\{b \text{ correct} : u_b < K_\alpha\}}{\#\{b \text{ correct}\}}

    the fraction of correctly classified examples whose uncertainty is strictly
    below :math:`K_\alpha`. Flagging everything at or above :math:`K_\alpha`
    as uncertain catches a share ``1 - α`` of the errors while keeping a
    share γ(α) of the correct predictions; higher is better, and a perfect
    separator (every correct example below every error) gives γ = 1.

    Args:
        uncertainty: (B,) finite uncertainty per example (higher = more uncertain).
        correct: (B,) bool or 0/1, True where the prediction was correct.
        alphas: a level or a sequence of levels, each in (0, 1).

    Returns:
        float64 CPU tensor of shape ``(len(alphas),)`` (shape ``(1,)`` for a scalar ``alphas``).

    Raises:
        ValueError: if ``uncertainty`` is not 1-D, empty or non-finite,
            ``correct`` is not boolean/0-1 or has a different length, a level is
            outside (0, 1), or there is no correct or no misclassified example.

    Example:
        >>> u = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.25, 0.35])
        >>> correct = torch.tensor([True, True, True, True, False, False])
        >>> gamma_curve(u, correct, [0.1, 0.9])   # K = 0.26: 0.1, 0.2 below; K = 0.34: 0.1, 0.2, 0.3 below
        tensor([0.5000, 0.7500], dtype=torch.float64)

    Source:
        The PyMC3 Bayesian-neural-network dissertation this project follows, §7.2 (γ-metric).
    """
    u = _check_vector(uncertainty, "uncertainty")
    ok = _check_correct(correct, len(u), against="uncertainty")
    a = _check_alphas(alphas)
    _check_both_outcomes(ok)
    return torch.from_numpy(_gamma(u[None], ok, a)[0])


def ga_cutoff(sample_probs: ArrayLike, correct: ArrayLike, alpha: float = 0.1) -> float:
    r"""Chooses the :func:`ga_uncertainty` cutoff that maximises γ(α) on held-out data.

    Our reading of the dissertation (its text is not available to us): the
    candidates are the half-integers :math:`c \in \{0.5, 1.5, \dots, S - 0.5\}`,
    which lie between the possible values :math:`G \in \{0, \dots, S-1\}`;
    for each, :func:`ga_uncertainty` is computed on the held-out examples and
    scored with :func:`gamma_curve` at level ``alpha``. The candidate with the
    highest γ(α) is returned; ties go to the smallest c.

    Args:
        sample_probs: (S, B, K) held-out class probabilities under S >= 2
            posterior samples; rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        correct: (B,) bool or 0/1, True where the (posterior-predictive)
            prediction was correct; needs both outcomes.
        alpha: the γ level, in (0, 1).

    Returns:
        The chosen cutoff as a Python float.

    Raises:
        ValueError: on bad ``sample_probs`` (see :func:`predictive_entropy`),
            S = 1, bad ``correct`` (see :func:`gamma_curve`), ``alpha`` outside
            (0, 1), or no correct / no misclassified example.

    Example:
        >>> votes = torch.tensor([[0, 1, 0, 0, 1, 0],   # argmax of S = 5 samples (rows) for B = 6
        ...                       [0, 1, 0, 0, 1, 0],   # examples (columns); G = C - 1 per column:
        ...                       [0, 1, 0, 0, 1, 0],   # 4, 4, 2 (misclassified), 3, 3, 4 (correct)
        ...                       [0, 1, 1, 0, 1, 0],
        ...                       [0, 1, 1, 1, 0, 0]])
        >>> correct = torch.tensor([False, False, False, True, True, True])
        >>> ga_cutoff(F.one_hot(votes, 2).double(), correct, alpha=0.5)
        4.5

        For c <= 3.5 two errors have G = 4 >= c, so U = 0 and K_0.5 = 0: γ = 0.
        For c = 4.5 the errors get U = (1, 1, 0.994), K_0.5 = 1 and the correct
        examples U = (0.958, 0.958, 1): γ = 2/3.

    Source:
        The PyMC3 Bayesian-neural-network dissertation this project follows, §7.2.
    """
    p = _check_sample_probs(sample_probs, min_samples=2, caller="ga_cutoff")
    ok = _check_correct(correct, p.shape[1], against=f"the example axis B of sample_probs (shape {tuple(p.shape)})")
    a = _check_alphas(alpha, "alpha")
    _check_both_outcomes(ok)
    s = p.shape[0]
    cutoffs = torch.arange(s, dtype=torch.float64) + 0.5
    u = _ga(_modal_count(p), s, cutoffs[:, None]).numpy()  # (S, B)
    return float(cutoffs[int(np.argmax(_gamma(u, ok, a)[:, 0]))])


# --------------------------------------------------------------------------------------------------
# regression
# --------------------------------------------------------------------------------------------------
class RegressionUncertainty(NamedTuple):
    """Decomposition of a Gaussian predictive variance (see :func:`regression_uncertainty`).

    Attributes:
        aleatoric: (B, D) float64, the noise variance broadcast to (B, D).
        epistemic: (B, D) float64, the variance of the sampled means over samples (ddof = 0).
        total: (B, D) float64, ``aleatoric + epistemic``.
    """

    aleatoric: torch.Tensor
    epistemic: torch.Tensor
    total: torch.Tensor


def regression_uncertainty(sample_means: ArrayLike, noise_var: Any) -> RegressionUncertainty:
    r"""Aleatoric / epistemic split of the predictive variance of a Gaussian-likelihood BNN.

    By the law of total variance, for :math:`y = f_\theta(x) + \varepsilon`,
    :math:`\varepsilon \sim \mathcal N(0, \sigma^2)`:

    .. math::

        \operatorname{Var}[y \mid x] = \underbrace{\sigma^2}_{\text{aleatoric}}
            + \underbrace{\frac{1}{S}\sum_{s=1}^{S} \bigl(f_{\theta_s}(x) - \bar f(x)\bigr)^2}_{\text{epistemic}},
        \qquad \bar f = \frac{1}{S}\sum_s f_{\theta_s}

    (the epistemic variance uses ddof = 0). ``total`` equals the variance
    returned by :meth:`bayeswrap.BayesianModel.predict` for
    ``likelihood="gaussian"`` with ``noise_var = noise_std ** 2``.

    Args:
        sample_means: (S, B, D) sampled means, e.g. ``bnn.sample_logits(x, S)``;
            finite; S >= 1.
        noise_var: the noise variance :math:`\sigma^2 \ge 0`: a number or a
            tensor/array broadcastable to (B, D) (e.g. per-output variances).

    Returns:
        :class:`RegressionUncertainty` ``(aleatoric, epistemic, total)``, each a
        (B, D) float64 CPU tensor.

    Raises:
        ValueError: if ``sample_means`` is not 3-D, empty or non-finite, or
            ``noise_var`` is negative, non-finite or not broadcastable to (B, D).

    Example:
        >>> means = torch.tensor([[[1.0]], [[3.0]]])       # S = 2, B = 1, D = 1
        >>> regression_uncertainty(means, 0.25).total      # 0.25 + ((1-2)^2 + (3-2)^2) / 2
        tensor([[1.2500]], dtype=torch.float64)

    Source:
        Kendall & Gal 2017, eq. 9; Depeweg et al. 2018, §3 (variance decomposition).
    """
    m = _to_float64(sample_means, "sample_means")
    if m.ndim != 3:
        hint = " (for one output dimension pass sample_means[..., None])" if m.ndim == 2 else ""
        raise ValueError(f"sample_means must have shape (S, B, D) = (samples, examples, outputs); "
                         f"got shape {tuple(m.shape)}{hint}")
    if 0 in m.shape:
        raise ValueError(f"sample_means is empty (shape {tuple(m.shape)}); accepted: S, B, D >= 1")
    _check_finite(m, "sample_means")
    aleatoric = torch.from_numpy(_check_noise_var(noise_var, m.shape[1:]))
    epistemic = torch.from_numpy(m).var(0, correction=0)
    return RegressionUncertainty(aleatoric, epistemic, aleatoric + epistemic)


def _check_noise_var(noise_var: Any, shape: tuple[int, ...]) -> np.ndarray:
    v = _to_float64(noise_var, "noise_var")
    _check_finite(v, "noise_var")
    if (v < 0).any():
        raise ValueError(f"noise_var must be >= 0 (a variance, noise_std ** 2); got minimum {float(v.min())!r}")
    try:
        return np.array(np.broadcast_to(v, shape))
    except ValueError as exc:
        raise ValueError(f"noise_var of shape {tuple(v.shape)} is not broadcastable to (B, D) = {tuple(shape)}; "
                         "accepted: a number or an array broadcastable to (B, D)") from exc
