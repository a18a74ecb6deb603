"""Calibration of predictive distributions: ECE, MCE, NLL, Brier, temperature scaling.

One module that every method and every CLI run reports its uncertainty through.
All functions take ``probs`` of shape ``(N, K)`` (rows summing to 1) and integer
``labels`` of shape ``(N,)`` with values in ``[0, K)``, as torch tensors (any
device) or numpy arrays of any float dtype (float16 and bfloat16 are upcast;
their rows must sum to 1 within 4 machine epsilons of their dtype, see
:data:`HALF_ROW_SUM_ULPS`), compute in float64 (ECE and MCE of input of 32 bits or
fewer: in float32, as torchmetrics does) and return Python floats for scalar metrics.

ECE and MCE are computed by torchmetrics
(``torchmetrics.functional.classification.binary_calibration_error`` on the
(confidence, correctness) pairs, see :func:`ece`); NLL, Brier, accuracy and the
entropy, which torchmetrics does not compute for probabilities, and the per-bin
statistics of the reliability diagram (:func:`bin_stats`) are computed here.

Binning convention (shared by :func:`ece`, :func:`mce`, :func:`bin_stats` and the
reliability diagram) is the one of ``torchmetrics.classification.
MulticlassCalibrationError``: ``M`` equal-width bins with edges
``b_m = m / M`` (``torch.linspace(0, 1, M + 1)``, rounded to float32 when the
input is float32 or narrower, else float64). Bin ``m`` is half-open,
``[b_m, b_{m+1})``, so a confidence exactly on an edge goes to the bin on its
right, and a confidence exactly equal to ``1.0`` forms an extra degenerate bin
``{1.0}`` of its own (torchmetrics' ``bucketize(..., right=True) - 1``).
Empty bins are skipped.

Two ECE variants exist in the literature and both are here, named by ``kind``:

* ``"top_label"``: Guo et al. (2017) / Naeini et al. (2015); bins the top-class
  confidence against top-1 correctness. This is what papers usually call ECE.
* ``"all_class"``: BayesDLL (Kim & Hospedales, arXiv:2309.12928, eqs. 20-21);
  bins all ``N*K`` class probabilities against the indicators ``[y_i = j]``.
  It gives much smaller numbers; use it only to compare with BayesDLL's tables.

Temperature scaling (Guo et al. 2017; BayesDLL eqs. 22-23): :func:`fit_temperature`
minimises validation NLL over ``T > 0``; :func:`apply_temperature` rescales the
log of the (sample-averaged) predictive probabilities.

References:
    Guo, Pleiss, Sun, Weinberger. On Calibration of Modern Neural Networks. ICML 2017.
    Naeini, Cooper, Hauskrecht. Obtaining Well Calibrated Probabilities Using
    Bayesian Binning. AAAI 2015.
    Kim, Hospedales. BayesDLL: Bayesian Deep Learning Library. arXiv:2309.12928,
    §3, eqs. 20-24.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "ECE_KINDS",
    "NLL_EPS",
    "ROW_SUM_TOL",
    "TEMPERATURE_BOUNDS",
    "BinStats",
    "TemperatureFit",
    "accuracy",
    "apply_temperature",
    "bin_stats",
    "brier",
    "ece",
    "fit_temperature",
    "mce",
    "nll",
    "predictive_entropy",
    "report",
]

ECE_KINDS = ("top_label", "all_class")
"""Accepted values of ``kind`` for :func:`ece`, :func:`mce` and :func:`bin_stats`."""

ROW_SUM_TOL = 1e-4
"""Rows of ``probs`` must sum to 1 within this tolerance (wider for half precision, see :data:`HALF_ROW_SUM_ULPS`)."""

HALF_ROW_SUM_ULPS = 4
"""float16/bfloat16 probabilities must sum to 1 within this many machine epsilons of their dtype
(float16: 3.9e-3, bfloat16: 3.1e-2): rounding each of the K probabilities moves the sum by up to eps/2,
and a softmax computed in half precision adds a few more ulps. They are upcast to float64 and used as
they are, so the metrics agree with those of the float32 probabilities to about that precision."""

NLL_EPS = 1e-12
"""Probabilities are clamped to at least this before the log in :func:`nll` (max per-example NLL ≈ 27.6)."""

_LOG_TINY = math.log(np.finfo(np.float64).tiny)  # ≈ -708.4: stands in for log(0) = -inf

ArrayLike = Any  # torch.Tensor | np.ndarray | nested sequences


# --------------------------------------------------------------------------------------------------
# input checking
# --------------------------------------------------------------------------------------------------
def _is_narrow_float(x: Any) -> bool:
    """True if ``x`` is a floating array/tensor of at most 32 bits (edges are then rounded to float32)."""
    if isinstance(x, torch.Tensor):
        return x.dtype.is_floating_point and x.dtype != torch.float64
    dtype = getattr(x, "dtype", None)
    return dtype is not None and np.issubdtype(dtype, np.floating) and np.dtype(dtype).itemsize <= 4


def _row_sum_tol(x: Any) -> float:
    """Tolerance of the row sums of ``x``: :data:`ROW_SUM_TOL`, or a few ulps of a half-precision dtype."""
    if isinstance(x, torch.Tensor):
        eps = torch.finfo(x.dtype).eps if x.dtype in (torch.float16, torch.bfloat16) else 0.0
    else:
        dtype = getattr(x, "dtype", None)
        eps = float(np.finfo(np.float16).eps) if dtype is not None and np.dtype(dtype) == np.float16 else 0.0
    return max(ROW_SUM_TOL, HALF_ROW_SUM_ULPS * eps)


def _to_float64(x: ArrayLike, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_complex():
            raise ValueError(f"{name} must be real-valued; got dtype {x.dtype}")
        return x.detach().to("cpu", torch.float64).numpy()
    try:
        arr = np.asarray(x)
    except Exception as exc:  # ragged lists etc.
        raise ValueError(f"{name} must be a numeric array or tensor; got {type(x).__name__}") from exc
    if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_) or np.iscomplexobj(arr):
        raise ValueError(f"{name} must be a real numeric array or tensor; got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _check_matrix(x: ArrayLike, name: str) -> np.ndarray:
    arr = _to_float64(x, name)
    if arr.ndim != 2:
        raise ValueError(f"{name} must have shape (N, K); got shape {tuple(arr.shape)}")
    n, k = arr.shape
    if n == 0 or k == 0:
        raise ValueError(f"{name} is empty (shape {tuple(arr.shape)}); accepted: N >= 1 examples and K >= 1 classes")
    nan = np.isnan(arr)
    if nan.any():
        row, col = np.argwhere(nan)[0]
        raise ValueError(f"{name} contains NaN ({int(nan.sum())} entries, first at [{row}, {col}]); "
                         "accepted: finite values")
    return arr


def _check_probs(probs: ArrayLike, name: str = "probs") -> np.ndarray:
    p = _check_matrix(probs, name)
    tol = _row_sum_tol(probs)
    bad = (p < 0) | (p > 1 + tol) | ~np.isfinite(p)
    if bad.any():
        row, col = np.argwhere(bad)[0]
        raise ValueError(f"{name}[{row}, {col}] = {float(p[row, col])!r} is not a probability; accepted: values in [0, 1]")
    sums = p.sum(axis=1)
    off = np.abs(sums - 1.0) > tol
    if off.any():
        row = int(np.argmax(off))
        raise ValueError(f"rows of {name} must sum to 1 within {tol:g}; row {row} sums to {sums[row]:.6g} "
                         f"({int(off.sum())} of {len(p)} rows are off). Pass probabilities, not logits "
                         "(use softmax, or apply_temperature for log-probabilities)")
    return np.minimum(p, 1.0)


def _check_labels(labels: ArrayLike, n: int, k: int, name: str = "labels") -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor; got dtype {labels.dtype}")
        y = labels.detach().to("cpu", torch.int64).numpy()
    else:
        y = np.asarray(labels)
        if y.size == 0 and y.dtype == np.float64:  # np.asarray([]) is float64
            y = y.astype(np.int64)
        if not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"{name} must be an integer array; got dtype {y.dtype}")
        y = y.astype(np.int64, copy=False)
    if y.shape != (n,):
        raise ValueError(f"{name} must have shape (N,) = ({n},) to match probs of shape ({n}, {k}); "
                         f"got shape {tuple(y.shape)}")
    out = (y < 0) | (y >= k)
    if out.any():
        i = int(np.argmax(out))
        raise ValueError(f"{name}[{i}] = {int(y[i])} is out of range; accepted: integers in [0, {k}) "
                         f"(K = {k} classes)")
    return y


def _check_n_bins(n_bins: Any) -> int:
    if isinstance(n_bins, (bool, np.bool_)) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"n_bins must be an integer >= 1; got {n_bins!r}")
    return int(n_bins)


def _check_kind(kind: Any) -> str:
    if kind not in ECE_KINDS:
        raise ValueError(f"unknown kind {kind!r}; accepted kinds: {', '.join(repr(k) for k in ECE_KINDS)}")
    return kind


def _probs_and_labels(probs: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    p = _check_probs(probs)
    return p, _check_labels(labels, *p.shape)


# --------------------------------------------------------------------------------------------------
# binning
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BinStats:
    """Per-bin statistics of a confidence binning (see :func:`bin_stats`).

    All arrays have length ``n_bins + 1``: the ``n_bins`` half-open bins
    ``[lower[m], upper[m])`` followed by the degenerate bin ``{1.0}``
    (``lower[-1] == upper[-1] == 1.0``) that holds confidences exactly equal to 1,
    as in torchmetrics. Empty bins have ``count == 0`` and ``confidence ==
    accuracy == 0.0`` (never NaN); use :attr:`nonempty` to skip them.

    Attributes:
        lower: (n_bins + 1,) float64, lower bin edges.
        upper: (n_bins + 1,) float64, upper bin edges (exclusive, except the last).
        confidence: (n_bins + 1,) float64, mean confidence (predicted probability) in each bin.
        accuracy: (n_bins + 1,) float64, mean correctness (top-1 correct, or the
            indicator ``[y_i = j]`` for ``kind="all_class"``) in each bin.
        count: (n_bins + 1,) int64, number of binned items (N for top_label, N*K for all_class).
        kind: ``"top_label"`` or ``"all_class"``.
    """

    lower: np.ndarray
    upper: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray
    count: np.ndarray
    kind: str

    @property
    def n_bins(self) -> int:
        """Number of regular (equal-width) bins, excluding the degenerate ``{1.0}`` bin."""
        return len(self.count) - 1

    @property
    def nonempty(self) -> np.ndarray:
        """(n_bins + 1,) bool mask of bins holding at least one item."""
        return self.count > 0

    @property
    def gap(self) -> np.ndarray:
        """(n_bins + 1,) float64, ``accuracy - confidence`` (0 in empty bins)."""
        return self.accuracy - self.confidence

    @property
    def ece(self) -> float:
        """Count-weighted mean of ``|gap|`` over non-empty bins."""
        return float(np.sum(self.count * np.abs(self.gap)) / np.sum(self.count))

    @property
    def mce(self) -> float:
        """Maximum of ``|gap|`` over non-empty bins."""
        return float(np.max(np.abs(self.gap[self.nonempty])))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict of plain lists."""
        return {"kind": self.kind, "lower": self.lower.tolist(), "upper": self.upper.tolist(),
                "confidence": self.confidence.tolist(), "accuracy": self.accuracy.tolist(),
                "count": self.count.tolist()}


def _bin_edges(n_bins: int, narrow: bool) -> np.ndarray:
    dtype = torch.float32 if narrow else torch.float64
    return torch.linspace(0, 1, n_bins + 1, dtype=dtype).to(torch.float64).numpy()


def _binned(conf: np.ndarray, correct: np.ndarray, edges: np.ndarray, kind: str) -> BinStats:
    n_bins = len(edges) - 1
    # torchmetrics: torch.bucketize(conf, edges, right=True) - 1, i.e. bin m = [b_m, b_{m+1}), 1.0 -> bin n_bins
    idx = np.searchsorted(edges, conf, side="right") - 1
    count = np.bincount(idx, minlength=n_bins + 1)
    sum_conf = np.bincount(idx, weights=conf, minlength=n_bins + 1)
    sum_acc = np.bincount(idx, weights=correct, minlength=n_bins + 1)
    safe = np.maximum(count, 1)
    lower = np.append(edges[:-1], 1.0)
    upper = np.append(edges[1:], 1.0)
    return BinStats(lower=lower, upper=upper, confidence=sum_conf / safe, accuracy=sum_acc / safe,
                    count=count.astype(np.int64), kind=kind)


def _pairs(p: np.ndarray, y: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The binned items of ``kind``: (confidence, correctness) float64 arrays of length N (top_label) or N*K."""
    if kind == "top_label":
        pred = p.argmax(axis=1)
        return p[np.arange(len(p)), pred], (pred == y).astype(np.float64)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(p)), y] = 1.0
    return p.reshape(-1), onehot.reshape(-1)


def _torchmetrics_ce(conf: np.ndarray, correct: np.ndarray, n_bins: int, norm: str, narrow: bool) -> float:
    """The binned calibration error (torchmetrics') of (confidence, correctness) pairs.

    ``binary_calibration_error`` bins ``preds`` against ``target`` as they are (``[b_m, b_{m+1})`` by
    ``torch.bucketize(..., right=True) - 1``, edges ``torch.linspace(0, 1, M + 1)`` in the dtype of ``preds``), so
    it computes the top-label and the all-class calibration error from their items. Narrow input (32 bits or
    fewer) is binned in float32, as ``MulticlassCalibrationError`` does (a float32 0.7 sits on the edge 0.7);
    float64 input in float64 (``MulticlassCalibrationError`` would cast it to float32).
    """
    from torchmetrics.functional.classification import binary_calibration_error  # ~2.5 s: imported when first used

    dtype = torch.float32 if narrow else torch.float64
    value = binary_calibration_error(torch.from_numpy(conf).to(dtype), torch.from_numpy(correct).to(dtype),
                                     n_bins=n_bins, norm=norm, validate_args=False)
    return float(value)


def _calibration_error(probs: ArrayLike, labels: ArrayLike, n_bins: int, kind: str, norm: str) -> float:
    kind = _check_kind(kind)
    n_bins = _check_n_bins(n_bins)
    p, y = _probs_and_labels(probs, labels)
    return _torchmetrics_ce(*_pairs(p, y, kind), n_bins, norm, _is_narrow_float(probs))


def bin_stats(probs: ArrayLike, labels: ArrayLike, n_bins: int = 15, kind: str = "top_label") -> BinStats:
    r"""Bins predictions by confidence and returns per-bin confidence, accuracy and count.

    The binning of :func:`ece` and :func:`mce` (which torchmetrics computes), kept here for the per-bin
    statistics of the reliability diagram, which torchmetrics does not return.

    * ``kind="top_label"`` (Guo et al. 2017; Naeini et al. 2015): item ``i`` has
      confidence :math:`\hat p_i = \max_j p_{ij}` and correctness
      :math:`[\arg\max_j p_{ij} = y_i]`; ``N`` items.
    * ``kind="all_class"`` (BayesDLL eq. 20): item ``(i, j)`` has confidence
      :math:`p_{ij}` and correctness :math:`[y_i = j]`; ``N*K`` items.

    Bins are :math:`B_m = \{\text{items with confidence in } [m/M, (m+1)/M)\}` for
    ``m = 0..M-1`` plus :math:`B_M = \{\text{confidence} = 1\}` (torchmetrics'
    convention, see the module docstring); per bin
    :math:`\mathrm{conf}(B_m) = \frac{1}{|B_m|}\sum_{B_m} \hat p` and
    :math:`\mathrm{acc}(B_m) = \frac{1}{|B_m|}\sum_{B_m} \text{correct}`. Ties in
    the argmax go to the lowest class index.

    Args:
        probs: (N, K) predictive probabilities, torch tensor or numpy array, any
            float dtype; rows must sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        labels: (N,) integer class labels in ``[0, K)``.
        n_bins: number M >= 1 of equal-width bins over [0, 1].
        kind: ``"top_label"`` or ``"all_class"``.

    Returns:
        BinStats with arrays of length ``n_bins + 1`` (float64; ``count`` int64).

    Raises:
        ValueError: on bad shapes, rows not summing to 1, NaN, labels out of
            range, empty input, ``n_bins < 1`` or an unknown ``kind``.

    Example:
        >>> probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]])
        >>> s = bin_stats(probs, torch.tensor([0, 1, 1]), n_bins=2)
        >>> s.count.tolist(), s.accuracy.tolist()
        ([0, 3, 0], [0.0, 0.6666666666666666, 0.0])

    Source:
        Guo et al. 2017, §2 (reliability diagrams); BayesDLL arXiv:2309.12928, eq. 20.
    """
    kind = _check_kind(kind)
    n_bins = _check_n_bins(n_bins)
    p, y = _probs_and_labels(probs, labels)
    return _binned(*_pairs(p, y, kind), _bin_edges(n_bins, _is_narrow_float(probs)), kind)


# --------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------
def ece(probs: ArrayLike, labels: ArrayLike, n_bins: int = 15, kind: str = "top_label") -> float:
    r"""Expected calibration error (binned, L1).

    .. math::

        \mathrm{ECE} = \sum_{m} \frac{|B_m|}{n}\,\bigl|\mathrm{acc}(B_m) - \mathrm{conf}(B_m)\bigr|

    over the non-empty bins of :func:`bin_stats`, with ``n = N`` items for
    ``kind="top_label"`` and ``n = N*K`` items for ``kind="all_class"``.

    ``kind="top_label"`` is the usual ECE of Guo et al. (2017) (Naeini et al.
    2015): the top-class confidence :math:`\max_j p_{ij}` is binned against
    top-1 correctness. It is computed by torchmetrics'
    ``binary_calibration_error(confidence, correct, norm="l1")`` on the top-label
    (confidence, correctness) pairs, the quantity of ``MulticlassCalibrationError(norm="l1")``:
    for input of 32 bits or fewer the same number (float32); for float64 input
    it is binned and summed in float64 (``MulticlassCalibrationError`` casts to float32;
    they agree to about 1e-6). ``kind="all_class"`` is torchmetrics'
    ``binary_calibration_error`` of the ``N*K`` (probability, indicator) pairs.

    ``kind="all_class"`` is BayesDLL's variant (arXiv:2309.12928, eqs. 20-21):
    all ``N*K`` class probabilities :math:`p(y=j|x_i)` are binned against the
    indicators :math:`[y_i = j]`. It gives much smaller numbers than
    ``top_label`` for the same predictions, and the gap grows with K: of the
    ``N*K`` items, ``N*(K-1)`` are non-target classes whose probabilities are
    mostly near zero and whose indicator is 0. They pile up in the first bin
    ``[0, 1/M)``, where mean confidence (≈0) and mean indicator (≈0) nearly
    agree, so that bin has a near-zero gap yet carries most of the weight
    ``|B_m|/(N*K)``; the average is diluted by roughly a factor of K. Use it only
    to compare with BayesDLL's tables, never with papers that report the
    top-label ECE.

    Args:
        probs: (N, K) predictive probabilities (torch or numpy, any float dtype);
            rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        labels: (N,) integer labels in ``[0, K)``.
        n_bins: number M >= 1 of equal-width bins over [0, 1] (default 15).
        kind: ``"top_label"`` (default) or ``"all_class"``.

    Returns:
        ECE as a Python float in [0, 1].

    Raises:
        ValueError: on bad input (see :func:`bin_stats`).

    Example:
        >>> probs = torch.tensor([[0.25, 0.20, 0.55], [0.55, 0.05, 0.40],
        ...                       [0.10, 0.30, 0.60], [0.90, 0.05, 0.05]])
        >>> labels = torch.tensor([0, 1, 2, 0])
        >>> round(ece(probs, labels, n_bins=3), 6)
        0.2
        >>> round(ece(probs, labels, n_bins=3, kind="all_class"), 6)   # 2.2 / 12
        0.183333

    Source:
        Naeini et al. 2015 (AAAI); Guo et al. 2017, eq. 3; BayesDLL
        arXiv:2309.12928, eqs. 20-21 (``all_class``).
    """
    return _calibration_error(probs, labels, n_bins, kind, "l1")


def mce(probs: ArrayLike, labels: ArrayLike, n_bins: int = 15, kind: str = "top_label") -> float:
    r"""Maximum calibration error: the worst bin's gap.

    .. math::

        \mathrm{MCE} = \max_{m:\,|B_m|>0} \bigl|\mathrm{acc}(B_m) - \mathrm{conf}(B_m)\bigr|

    over the non-empty bins of :func:`bin_stats`, computed by torchmetrics as :func:`ece`
    (``norm="max"``). ``kind="top_label"`` is torchmetrics'
    ``MulticlassCalibrationError(norm="max")``; ``kind="all_class"``
    is BayesDLL's variant (see :func:`ece` for why it is smaller, though for the
    max the dilution only acts through the bins' averages).

    Args:
        probs: (N, K) predictive probabilities; rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        labels: (N,) integer labels in ``[0, K)``.
        n_bins: number M >= 1 of equal-width bins (default 15).
        kind: ``"top_label"`` (default) or ``"all_class"``.

    Returns:
        MCE as a Python float in [0, 1].

    Raises:
        ValueError: on bad input (see :func:`bin_stats`).

    Example:
        >>> probs = torch.tensor([[0.25, 0.20, 0.55], [0.55, 0.05, 0.40],
        ...                       [0.10, 0.30, 0.60], [0.90, 0.05, 0.05]])
        >>> round(mce(probs, torch.tensor([0, 1, 2, 0]), n_bins=3), 6)
        0.233333

    Source:
        Naeini et al. 2015 (AAAI); Guo et al. 2017, eq. 5; BayesDLL
        arXiv:2309.12928, eq. 21.
    """
    return _calibration_error(probs, labels, n_bins, kind, "max")


def nll(probs: ArrayLike, labels: ArrayLike, eps: float = NLL_EPS) -> float:
    r"""Mean negative log-likelihood of the labels under the predictive.

    .. math::

        \mathrm{NLL} = -\frac{1}{N}\sum_{i=1}^{N} \log \max(p_{i, y_i}, \varepsilon)

    The clamp at ``eps`` keeps the result finite when a label gets probability 0.

    Args:
        probs: (N, K) predictive probabilities; rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        labels: (N,) integer labels in ``[0, K)``.
        eps: smallest probability used inside the log (default 1e-12).

    Returns:
        NLL in nats as a Python float.

    Raises:
        ValueError: on bad input (see :func:`bin_stats`) or ``eps`` not in (0, 1).

    Example:
        >>> round(nll(torch.tensor([[0.5, 0.5], [0.9, 0.1]]), torch.tensor([0, 0])), 4)
        0.3993

    Source:
        Guo et al. 2017, §2; BayesDLL arXiv:2309.12928, eq. 22.
    """
    if not (0 < eps < 1):
        raise ValueError(f"eps must be in (0, 1); got {eps!r}")
    p, y = _probs_and_labels(probs, labels)
    return float(-np.mean(np.log(np.maximum(p[np.arange(len(p)), y], eps))))


def brier(probs: ArrayLike, labels: ArrayLike) -> float:
    r"""Multi-class Brier score: mean squared distance to the one-hot label.

    .. math::

        \mathrm{Brier} = \frac{1}{N}\sum_{i=1}^{N}\sum_{j=1}^{K} \bigl(p_{ij} - [y_i = j]\bigr)^2

    Summed (not averaged) over classes, so it lies in [0, 2].

    Args:
        probs: (N, K) predictive probabilities; rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        labels: (N,) integer labels in ``[0, K)``.

    Returns:
        Brier score as a Python float in [0, 2].

    Raises:
        ValueError: on bad input (see :func:`bin_stats`).

    Example:
        >>> round(brier(torch.tensor([[0.5, 0.5], [0.9, 0.1]]), torch.tensor([0, 0])), 4)
        0.26

    Source:
        Brier 1950, "Verification of forecasts expressed in terms of probability".
    """
    p, y = _probs_and_labels(probs, labels)
    sq = np.sum(p * p, axis=1) - 2.0 * p[np.arange(len(p)), y] + 1.0
    return float(np.mean(sq))


def accuracy(probs: ArrayLike, labels: ArrayLike) -> float:
    r"""Top-1 accuracy: :math:`\frac{1}{N}\sum_i [\arg\max_j p_{ij} = y_i]` (ties go to the lowest index).

    Args:
        probs: (N, K) predictive probabilities; rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        labels: (N,) integer labels in ``[0, K)``.

    Returns:
        Accuracy as a Python float in [0, 1].

    Raises:
        ValueError: on bad input (see :func:`bin_stats`).

    Example:
        >>> accuracy(torch.tensor([[0.5, 0.5], [0.1, 0.9]]), torch.tensor([0, 0]))
        0.5
    """
    p, y = _probs_and_labels(probs, labels)
    return float(np.mean(p.argmax(axis=1) == y))


def predictive_entropy(probs: ArrayLike, reduction: str = "mean") -> float | np.ndarray:
    r"""Entropy of the predictive distribution, in nats.

    .. math::

        H_i = -\sum_{j=1}^{K} p_{ij} \log p_{ij}, \qquad 0 \log 0 = 0

    For a Bayesian predictive (probabilities averaged over posterior samples)
    this is the total uncertainty (BayesDLL arXiv:2309.12928, §3).

    Args:
        probs: (N, K) predictive probabilities; rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        reduction: ``"mean"`` (default, returns a float), ``"sum"`` (float) or
            ``"none"`` (returns the per-example entropies).

    Returns:
        A Python float, or for ``reduction="none"`` a float64 numpy array of shape (N,).

    Raises:
        ValueError: on bad probabilities or an unknown ``reduction``.

    Example:
        >>> round(predictive_entropy(torch.tensor([[0.5, 0.5], [1.0, 0.0]])), 4)   # (log 2 + 0) / 2
        0.3466
    """
    reductions = ("mean", "sum", "none")
    if reduction not in reductions:
        raise ValueError(f"unknown reduction {reduction!r}; accepted: {', '.join(map(repr, reductions))}")
    p = _check_probs(probs)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.sum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    if reduction == "none":
        return h
    return float(h.mean() if reduction == "mean" else h.sum())


# --------------------------------------------------------------------------------------------------
# temperature scaling
# --------------------------------------------------------------------------------------------------
@dataclass
class TemperatureFit:
    """Result of :func:`fit_temperature` with ``return_history=True``.

    Attributes:
        temperature: the returned temperature T (1.0 if fitting did not lower the NLL).
        nll_before: validation NLL at T = 1.
        nll_after: validation NLL at ``temperature`` (never above ``nll_before``).
        temperatures: T after each LBFGS iteration; entry 0 is the start (T = 1).
        nlls: validation NLL after each iteration, aligned with ``temperatures``.
        converged: whether the optimiser stopped before ``max_iter``.
        fell_back: True if the optimum found was not better than T = 1 and 1.0 was returned.
    """

    temperature: float
    nll_before: float
    nll_after: float
    temperatures: list[float] = field(default_factory=list)
    nlls: list[float] = field(default_factory=list)
    converged: bool = True
    fell_back: bool = False

    @property
    def iterations(self) -> list[int]:
        """Iteration indices 0..len(temperatures)-1 (0 is the starting point)."""
        return list(range(len(self.temperatures)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict of the fields."""
        return asdict(self)


def _check_log_probs(log_probs: ArrayLike, name: str) -> np.ndarray:
    z = _check_matrix(log_probs, name)
    if np.isposinf(z).any():
        row, col = np.argwhere(np.isposinf(z))[0]
        raise ValueError(f"{name}[{row}, {col}] is +inf; accepted: finite log-probabilities or logits "
                         "(-inf, i.e. log 0, is allowed)")
    # log(0) = -inf is legitimate for log-probabilities; use log(tiny) so gradients stay finite
    return np.maximum(z, _LOG_TINY)


def _check_temperature(T: Any) -> float:
    try:
        t = float(T)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"temperature must be a positive finite number; got {T!r}") from exc
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a positive finite number; got {T!r}")
    return t


#: the default search range of :func:`fit_temperature`; a fitted T at either end is a warning sign
TEMPERATURE_BOUNDS = (1e-2, 1e2)


def fit_temperature(log_probs_val: ArrayLike, labels_val: ArrayLike, *, max_iter: int = 100,
                    bounds: tuple[float, float] = TEMPERATURE_BOUNDS,
                    return_history: bool = False) -> float | TemperatureFit:
    r"""Fits the temperature T > 0 that minimises validation NLL (temperature scaling).

    .. math::

        T^\star = \arg\min_{T>0} -\frac{1}{N}\sum_{i=1}^{N}
            \log \operatorname{softmax}\!\bigl(z_i / T\bigr)_{y_i}

    where :math:`z_i` are the validation logits or log-probabilities (softmax is
    shift-invariant, so both give the same T). For a Bayesian predictive pass
    :math:`z_i = \log \frac{1}{S}\sum_s p(y|x_i,\theta_s)`, the log of the
    sample-averaged predictive, as BayesDLL does.

    The objective is minimised over :math:`u = \log T` (starting at T = 1) with
    ``torch.optim.LBFGS`` (strong-Wolfe line search) in float64, one LBFGS
    iteration per step so that T and the NLL are recorded after every
    iteration. T is kept inside ``bounds`` by clamping ``u``. The result never
    increases validation NLL: if the best T found is not strictly better than
    T = 1, 1.0 is returned (``fell_back=True`` in the history).

    Args:
        log_probs_val: (N, K) validation logits or log-probabilities (torch or
            numpy); ``-inf`` (log 0) entries are allowed and treated as log(1e-308).
        labels_val: (N,) integer validation labels in ``[0, K)``.
        max_iter: maximum number of LBFGS iterations (>= 0).
        bounds: (T_min, T_max) with 0 < T_min <= T_max; the search range for T.
        return_history: if True, return a :class:`TemperatureFit` holding T, the
            NLL before/after and the per-iteration ``temperatures`` and ``nlls``
            (the input of :func:`bayeswrap.evaluation.plots.temperature_curve`); if False, return T only.

    Returns:
        T as a Python float, or a :class:`TemperatureFit` if ``return_history``.

    Raises:
        ValueError: on bad shapes, NaN or +inf, labels out of range, empty
            input, ``max_iter < 0`` or invalid ``bounds``.

    Example:
        >>> logits = 3 * torch.randn(2000, 5, generator=torch.Generator().manual_seed(0))
        >>> labels = torch.multinomial(torch.softmax(logits / 2, 1), 1).squeeze(1)  # true T = 2
        >>> fit = fit_temperature(torch.log_softmax(logits, 1), labels, return_history=True)
        >>> 1.7 < fit.temperature < 2.3, fit.nll_after < fit.nll_before, fit.nlls[0] == fit.nll_before
        (True, True, True)
        >>> probs_calibrated = apply_temperature(torch.log_softmax(logits, 1), fit.temperature)

    Source:
        Guo et al. 2017, §4.2 (temperature scaling); BayesDLL arXiv:2309.12928, eqs. 22-23.
    """
    if isinstance(max_iter, bool) or not isinstance(max_iter, (int, np.integer)) or max_iter < 0:
        raise ValueError(f"max_iter must be an integer >= 0; got {max_iter!r}")
    try:
        t_lo, t_hi = (float(b) for b in bounds)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bounds must be a pair (T_min, T_max) with 0 < T_min <= T_max; got {bounds!r}") from exc
    if not (0 < t_lo <= t_hi < math.inf):
        raise ValueError(f"bounds must be a pair (T_min, T_max) with 0 < T_min <= T_max < inf; got {bounds!r}")
    z_np = _check_log_probs(log_probs_val, "log_probs_val")
    y_np = _check_labels(labels_val, *z_np.shape, name="labels_val")
    z = torch.from_numpy(z_np)
    y = torch.from_numpy(y_np)
    u_lo, u_hi = math.log(t_lo), math.log(t_hi)

    def objective(u: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z / torch.exp(u.clamp(u_lo, u_hi)), y)

    u = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([u], lr=1.0, max_iter=1, max_eval=25, tolerance_grad=1e-12,
                                  tolerance_change=1e-14, history_size=10, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = objective(u)
        loss.backward()
        return loss

    def current() -> tuple[float, float]:
        with torch.no_grad():
            return math.exp(min(max(u.item(), u_lo), u_hi)), objective(u).item()

    with torch.no_grad():
        nll_before = F.cross_entropy(z, y).item()
    t0, l0 = current()
    temperatures, nlls = [t0], [l0]
    converged = max_iter == 0
    for _ in range(max_iter):
        u_prev = u.item()
        optimizer.step(closure)
        t, loss = current()
        if not (math.isfinite(loss) and math.isfinite(u.item())):
            break
        temperatures.append(t)
        nlls.append(loss)
        if abs(u.item() - u_prev) <= 1e-12 or abs(nlls[-1] - nlls[-2]) <= 1e-15:
            converged = True
            break
    best = int(np.argmin(nlls))
    t_best, nll_best = temperatures[best], nlls[best]
    fell_back = not (nll_best < nll_before)
    if fell_back:
        t_best, nll_best = 1.0, nll_before
    if not return_history:
        return float(t_best)
    return TemperatureFit(temperature=float(t_best), nll_before=float(nll_before), nll_after=float(nll_best),
                          temperatures=[float(t) for t in temperatures], nlls=[float(v) for v in nlls],
                          converged=converged, fell_back=fell_back)


def apply_temperature(log_probs: ArrayLike, T: float) -> np.ndarray | torch.Tensor:
    r"""Temperature-scaled probabilities :math:`\operatorname{softmax}(z / T)`.

    For a Bayesian predictive, :math:`z = \log \frac{1}{S}\sum_s p(y|x,\theta_s)`
    is the log of the sample-averaged predictive probabilities (BayesDLL eq. 23),
    so T rescales the averaged predictive, not each sample. For a deterministic
    model, :math:`z` may be the logits.

    Args:
        log_probs: (N, K) log-probabilities or logits; ``-inf`` (log 0) allowed.
        T: temperature, a positive finite number (T > 1 softens, T < 1 sharpens).

    Returns:
        (N, K) float64 probabilities whose rows sum to 1: a torch tensor on the
        input's device if ``log_probs`` is a tensor, else a numpy array.

    Raises:
        ValueError: on bad shapes, NaN or +inf, empty input, or T not positive and finite.

    Example:
        >>> apply_temperature(torch.log(torch.tensor([[0.8, 0.2]])), 2.0)   # sqrt-odds: 2:1
        tensor([[0.6667, 0.3333]], dtype=torch.float64)

    Source:
        Guo et al. 2017, §4.2; BayesDLL arXiv:2309.12928, eq. 23.
    """
    t = _check_temperature(T)
    z = torch.from_numpy(_check_log_probs(log_probs, "log_probs"))
    out = torch.softmax(z / t, dim=1)
    if isinstance(log_probs, torch.Tensor):
        return out.to(log_probs.device)
    return out.numpy()


def _log(p: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(p)


# --------------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------------
def _metrics(p: np.ndarray, y: np.ndarray, n_bins: int, narrow: bool) -> dict[str, float]:
    top = _pairs(p, y, "top_label")
    allc = _pairs(p, y, "all_class")
    acc = float(np.mean(top[1]))
    target = p[np.arange(len(p)), y]
    return {
        "accuracy": acc,
        "error": 1.0 - acc,
        "ece": _torchmetrics_ce(*top, n_bins, "l1", narrow),
        "ece_all_class": _torchmetrics_ce(*allc, n_bins, "l1", narrow),
        "mce": _torchmetrics_ce(*top, n_bins, "max", narrow),
        "nll": float(-np.mean(np.log(np.maximum(target, NLL_EPS)))),
        "brier": float(np.mean(np.sum(p * p, axis=1) - 2.0 * target + 1.0)),
    }


def report(probs: ArrayLike, labels: ArrayLike, *, val: Sequence[ArrayLike] | None = None,
           n_bins: int = 15) -> dict[str, Any]:
    """Calibration report: all metrics at T = 1 and, given validation data, at the fitted T.

    The result is a plain, JSON-serialisable dict (``json.dumps(report(...))`` works)::

        {
          "n_examples": N, "n_classes": K, "n_bins": n_bins,
          "T1":   {"accuracy", "error", "ece", "ece_all_class", "mce", "nll", "brier"},
          # only when val is given:
          "temperature": T,                  # fitted on val (1.0 if fitting did not help)
          "Topt": {same keys as "T1"},       # test metrics after apply_temperature(log probs, T)
          "val":  {"n_examples": N_val, "nll_T1": ..., "nll_Topt": ...},
        }

    ``ece`` and ``mce`` are top-label (Guo et al. 2017; comparable with
    torchmetrics); ``ece_all_class`` is BayesDLL's variant (see :func:`ece`).
    ``error = 1 - accuracy``. Temperature scaling leaves the argmax unchanged, so
    accuracy is the same at both temperatures.

    Args:
        probs: (N, K) test predictive probabilities; rows sum to 1 within 1e-4 (float16/bfloat16: 4 eps).
        labels: (N,) integer test labels in ``[0, K)``.
        val: optional ``(probs_val, labels_val)`` validation predictive (same K);
            T is fitted on ``log(probs_val)`` and applied to ``log(probs)``.
        n_bins: number of equal-width bins for ECE/MCE (>= 1).

    Returns:
        The dict above, with Python floats and ints only.

    Raises:
        ValueError: on bad test or validation input (see :func:`bin_stats`), or if
            ``val`` is not a pair or its K differs from the test K.

    Example:
        >>> probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
        >>> r = report(probs, torch.tensor([0, 1, 1, 0]), val=(probs, torch.tensor([0, 0, 1, 1])))
        >>> sorted(r)
        ['T1', 'Topt', 'n_bins', 'n_classes', 'n_examples', 'temperature', 'val']
        >>> sorted(r["T1"])
        ['accuracy', 'brier', 'ece', 'ece_all_class', 'error', 'mce', 'nll']
        >>> import json; json.dumps(r)[:40]
        '{"n_examples": 4, "n_classes": 2, "n_bin'

    Source:
        Guo et al. 2017; BayesDLL arXiv:2309.12928, eqs. 20-24.
    """
    n_bins = _check_n_bins(n_bins)
    p, y = _probs_and_labels(probs, labels)
    narrow = _is_narrow_float(probs)
    out: dict[str, Any] = {"n_examples": int(p.shape[0]), "n_classes": int(p.shape[1]), "n_bins": n_bins,
                           "T1": _metrics(p, y, n_bins, narrow)}
    if val is None:
        return out
    if not isinstance(val, (tuple, list)) or len(val) != 2:
        raise ValueError(f"val must be a pair (probs_val, labels_val) or None; got {type(val).__name__}"
                         + (f" of length {len(val)}" if isinstance(val, (tuple, list)) else ""))
    p_val = _check_probs(val[0], "probs_val")
    if p_val.shape[1] != p.shape[1]:
        raise ValueError(f"probs_val has K = {p_val.shape[1]} classes but probs has K = {p.shape[1]}; "
                         "accepted: the same number of classes")
    y_val = _check_labels(val[1], *p_val.shape, name="labels_val")
    fit = fit_temperature(_log(p_val), y_val, return_history=True)
    p_cal = apply_temperature(_log(p), fit.temperature)
    out["temperature"] = fit.temperature
    out["Topt"] = _metrics(p_cal, y, n_bins, narrow)
    out["val"] = {"n_examples": int(p_val.shape[0]), "nll_T1": fit.nll_before, "nll_Topt": fit.nll_after}
    return out
