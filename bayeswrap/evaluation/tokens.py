"""Calibration of language-model predictives: the target tokens of (B, T, V) probabilities as (N, V) rows.

:meth:`BayesianModel.predict` with a token likelihood (``"causal_lm"``, ``"token_categorical"``) returns
(B, T, V) probabilities. :func:`valid_tokens` keeps the positions that carry a target (label ≠ −100, after
the causal shift for ``"causal_lm"``) as rows, so every classification metric of
:mod:`bayeswrap.evaluation.calibration` (ECE, NLL, Brier, accuracy) applies per token, as in the
IVON-LoRA and Laplace-LoRA evaluations; :func:`token_report` computes them in one call.
"""

from __future__ import annotations

import torch

from bayeswrap.core.token_likelihoods import IGNORE_INDEX
from bayeswrap.evaluation import calibration


def valid_tokens(probs: torch.Tensor, labels: torch.Tensor, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The (N, V) predictive rows and (N,) labels of the target tokens of a batch.

    Args:
        probs: (B, T, V) per-position predictive probabilities (or logits: rows are only selected).
        labels: (B, T) integer token ids, -100 where there is no target.
        shift: the causal shift (``likelihood="causal_lm"``): position t's row predicts label t + 1,
            so ``probs[:, :-1]`` are paired with ``labels[:, 1:]``. False: aligned (``"token_categorical"``).

    Returns:
        ``(rows, targets)``: (N, V) and (N,) int64, N the number of labels other than -100 (after the
        shift), in row-major (sequence, then position) order.

    Raises:
        ValueError: naming the shapes, unless ``probs`` is (B, T, V) and ``labels`` (B, T) integers; naming
            the value, on a label outside [0, V) other than -100, or when no target is left.
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 3:
        raise ValueError(f"probs must be a (B, T, V) tensor, got "
                         f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}")
    labels = torch.as_tensor(labels)
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or tuple(labels.shape) != tuple(probs.shape[:2]):
        raise ValueError(f"labels must be integer token ids of shape {tuple(probs.shape[:2])} (B, T) for probs of "
                         f"shape {tuple(probs.shape)}, got shape {tuple(labels.shape)} and dtype {labels.dtype}")
    labels = labels.to(probs.device).long()
    if shift:
        probs, labels = probs[:, :-1], labels[:, 1:]
    v = probs.shape[-1]
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= v))
    if bool(bad.any()):
        raise ValueError(f"token label {labels[bad][0].item()} is out of range; accepted: token ids in [0, {v - 1}] "
                         f"or {IGNORE_INDEX} (ignored)")
    keep = labels != IGNORE_INDEX
    if not bool(keep.any()):
        raise ValueError(f"every label is {IGNORE_INDEX} (ignored){' after the causal shift' if shift else ''}, so "
                         "there is no token to evaluate; accepted: at least one label in [0, V)")
    return probs[keep], labels[keep]


def token_report(probs: torch.Tensor, labels: torch.Tensor, shift: bool = True, n_bins: int = 15) -> dict[str, float]:
    """Per-token NLL, error, Brier and top-label ECE of a (B, T, V) predictive over its target tokens.

    Args:
        probs: (B, T, V) predictive probabilities (rows sum to 1), e.g. ``bnn.predict(batch_inputs)``.
        labels: (B, T) token ids, -100 ignored.
        shift: as :func:`valid_tokens`.
        n_bins: the ECE's number of equal-width confidence bins.

    Returns:
        ``{"nll", "error", "brier", "ece", "tokens"}``: means over the N target tokens
        (:mod:`bayeswrap.evaluation.calibration`'s definitions), and N.

    Raises:
        ValueError: as :func:`valid_tokens` and the calibration metrics.
    """
    rows, targets = valid_tokens(probs, labels, shift)
    rows, targets = rows.detach().cpu(), targets.cpu()
    return {"nll": calibration.nll(rows, targets), "error": 1.0 - calibration.accuracy(rows, targets),
            "brier": calibration.brier(rows, targets), "ece": calibration.ece(rows, targets, n_bins=n_bins),
            "tokens": len(targets)}
