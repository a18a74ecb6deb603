"""Sequence outputs read at one token: ``output_reduction="pick_last"`` (and ``"pick_first"``).

A language model (a causal LM's head, or a per-token classifier on a transformer body) returns outputs of shape
(B, T, K): one K-vector per position. A sequence classifier built on it reads the vector of one position: for a
causal LM the last token of each sequence, the only one that has attended to the whole input (GPT-2, Llama and
their ``*ForSequenceClassification`` heads; Yang et al. 2024's Laplace-LoRA reads the next-token logits at the
last prompt token). ``bw.wrap(model, method, output_reduction="pick_last", ...)`` makes every method read
(B, K) outputs that way, so that a classification target y of shape (B,) can be used with any likelihood, in
``fit``, ``predict``, ``evaluate`` and Laplace's curvature and GLM predictive:

    f(x)_b = out(x)_{b, t_b, :},   t_b = max{t : m_{b,t} ≠ 0}  ("pick_last"),   min{...}  ("pick_first"),

with m the batch's ``attention_mask`` (B, T) when the inputs are a mapping that holds one (a Hugging Face
tokenizer's or collator's batch), so that right padding (``[w w w 0 0]``) and left padding (``[0 0 w w w]``)
both read the last real token; without a mask (tensor inputs, or a mapping without ``"attention_mask"``),
t_b = T − 1 ("pick_last") or 0 ("pick_first"). The selection is an index (``torch.gather``): differentiable in
the outputs, exact under ``torch.func.vmap`` (over examples or over posterior draws), and its gradient is zero at
every other position. It is applied where a Bayesian model reads its network's outputs
(:meth:`bayeswrap.BayesianModel.forward_with`, and SWAG's calls with recomputed BatchNorm statistics);
:meth:`~bayeswrap.BayesianModel.to_deterministic` returns the network itself, whose outputs stay (B, T, K).
Checking that no row is all padding reads the mask once per call (one device synchronisation on a GPU).

laplace-torch's ``feature_reduction="pick_last"`` (``laplace.utils.feature_extractor``) reduces the *features* of
a last-layer Laplace, (B, T, D) → (B, D), at position T − 1 regardless of padding; with left padding or without
padding both choose the same token. :class:`~bayeswrap.Laplace` with ``subset_of_weights="last_layer"`` reads
its head's input features at the token chosen here (:func:`gather_tokens`), for its Jacobians as laplace-torch
does, and also for the Kronecker factor A = (1/n) Σ_n a_n a_nᵀ of ``hessian_structure="kron"``, so that the
posterior is the same whether the head runs before the pooling (a network that picks the features, then applies
the head) or after it (a per-token head whose outputs are picked). laplace-torch's last-layer KFAC instead
computes A over all T positions of the head's input (Curvlinops' KFAC "expand", padding included) even with
``feature_reduction``; on a tiny GPT-2 body its log evidence at δ = 1 is −31.70 against −27.58 for laplace-torch on
the pooled network, which this module's reduction gives (``tests/test_pick_last.py``; the dense last layer agrees
with both). Over all the Bayesian parameters (``subset_of_weights="all"``, e.g. LoRA adapters) every Kron layer,
a per-token head included, keeps KFAC "expand" over the positions, as laplace-torch's ``KronLaplace`` does
(``tests/test_laplace_lora.py``: a causal LM read at its last token).

References:
    Daxberger et al. 2021, "Laplace Redux — effortless Bayesian deep learning" (laplace-torch, its
    ``FeatureReduction``); Yang, Robeyns, Wang, Aitchison 2024, "Bayesian low-rank adaptation for large language
    models", ICLR (the last token's logits of a causal LM as the classifier); Hugging Face ``transformers``
    ``GPT2ForSequenceClassification`` (pooling at the last non-padding token).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: the accepted values of ``output_reduction`` besides ``None`` (the outputs as the model returns them)
OUTPUT_REDUCTIONS = ("pick_last", "pick_first")
#: the key of the padding mask in a mapping input (Hugging Face's name)
MASK_KEY = "attention_mask"


def check_output_reduction(value):
    """``None`` or one of :data:`OUTPUT_REDUCTIONS`, checked.

    Raises:
        ValueError: naming the value and the accepted ones.
    """
    if value is not None and value not in OUTPUT_REDUCTIONS:
        raise ValueError(f"output_reduction={value!r} is not known; accepted: None (the outputs as the model returns "
                         f"them) or one of {OUTPUT_REDUCTIONS}")
    return value


def _is_batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor being vmapped (its values may not be read into Python there)."""
    return bool(torch._C._functorch.is_batchedtensor(t))


def token_index(x, shape: tuple[int, int] | torch.Size, reduction: str, device=None) -> torch.Tensor:
    """The position t_b read for each sequence (see the module docstring), int64 (B,).

    Args:
        x: the model's inputs: a tensor, a tuple, or a mapping (its ``"attention_mask"``, (B, T), is read if present).
        shape: (B, T), the outputs' leading dims.
        reduction: ``"pick_last"`` or ``"pick_first"``.
        device: of the returned index when there is no mask (the outputs' device).

    Returns:
        (B,) positions in [0, T).

    Raises:
        ValueError: if the mask is not (B, T) for the outputs' (B, T), or a row of it is all padding (zeros): that
            sequence has no token to read.
    """
    batch, length = int(shape[0]), int(shape[1])
    mask = x.get(MASK_KEY) if isinstance(x, Mapping) else None
    if mask is None:
        position = length - 1 if reduction == "pick_last" else 0
        return torch.full((batch,), position, dtype=torch.long, device=device)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (batch, length):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"output_reduction={reduction!r}: the inputs' {MASK_KEY!r} has shape {got} but the model's "
                         f"outputs are (B, T, ...) = ({batch}, {length}, ...); accepted: a (B, T) padding mask with "
                         "the outputs' batch size and number of positions")
    present = mask.ne(0)
    if not _is_batched(present):  # under vmap the rows were checked when the batch was (a Python read is refused)
        empty = (~present.any(-1)).nonzero().flatten()
        if empty.numel():
            raise ValueError(f"output_reduction={reduction!r}: rows {empty[:8].tolist()} of the inputs' "
                             f"{MASK_KEY!r} are all padding (zeros), so they have no token to read; accepted: "
                             "every sequence with at least one non-padding token (mask value ≠ 0)")
    positions = torch.arange(length, device=mask.device)
    if reduction == "pick_last":  # the largest position whose mask is set
        return torch.where(present, positions, -1).amax(-1)
    return torch.where(present, positions, length).amin(-1)


def gather_tokens(t: torch.Tensor, index: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``t`` read at position ``index[b]`` of dim ``dim`` for each example b (dim 0 … dim−1 hold the batch last).

    Args:
        t: (..., B, T, *rest), with B at ``dim − 1`` and T at ``dim``.
        index: int64 (B,).
        dim: the token dim of ``t`` (1 for outputs (B, T, K); 2 for pulled-back vectors (M, B, T, K)).

    Returns:
        (..., B, *rest).
    """
    shape = [1] * t.dim()
    shape[dim - 1] = index.shape[0]
    idx = index.to(t.device).reshape(shape).expand(*t.shape[:dim], 1, *t.shape[dim + 1:])
    return t.gather(dim, idx).squeeze(dim)


def reduce_output(out: torch.Tensor, x, reduction: str | None) -> torch.Tensor:
    """The model's outputs (B, T, K, ...) read at one position per sequence, (B, K, ...); unchanged for ``None``.

    Args:
        out: the model's output tensor (read at ``output_key`` from a ``ModelOutput``).
        x: the model's inputs (a mapping's ``"attention_mask"`` chooses the position).
        reduction: ``None``, ``"pick_last"`` or ``"pick_first"``.

    Raises:
        ValueError: if ``out`` has no token dim (fewer than 3 dims), naming its shape; or as :func:`token_index`.
    """
    if reduction is None:
        return out
    if out.dim() < 3:
        raise ValueError(f"output_reduction={reduction!r} reads one position of (B, T, K) outputs, but the model's "
                         f"outputs have shape {tuple(out.shape)}; accepted: a model whose outputs have a token dim "
                         "(e.g. a causal LM's (B, T, V) logits or a per-token head), or output_reduction=None for "
                         "(B, K) outputs (e.g. GPT2ForSequenceClassification's, already pooled)")
    return gather_tokens(out, token_index(x, out.shape[:2], reduction, out.device))
