"""Token-level categorical likelihoods for language models: ``"causal_lm"`` and ``"token_categorical"``.

A language model returns logits of shape (B, T, V) (batch, positions, vocabulary) and its labels are
(B, T) token ids, with ``-100`` marking the positions that carry no target (padding, the prompt), as in
Hugging Face ``transformers`` (``torch.nn.CrossEntropyLoss(ignore_index=-100)``).

* ``"causal_lm"``: the causal shift of ``transformers``' ``ForCausalLMLoss``: the logits at position t predict
  the label at position t + 1, so ``logits[:, :-1]`` are scored against ``labels[:, 1:]`` and the labels may
  simply be the ``input_ids`` (with padding set to -100). Equal to ``GPT2LMHeadModel(..., labels=labels).loss``.
* ``"token_categorical"``: no shift, position t's logits score position t's label (masked language
  models, token classification: ``BertForMaskedLM``, ``BertForTokenClassification``).

**num_data and the KL scaling.** The batch loss is the mean NLL over the batch's target tokens (the
non-ignored labels, after the shift), as ``transformers`` computes it, so the per-datum objective
``nll + kl_weight · KL / num_data`` is the negative ELBO divided by the number of target tokens when
``num_data`` is the number of target tokens in the training set (:func:`count_target_tokens`): the
log-likelihood of a sequence is the sum of its tokens' log-probabilities, and the data term is
Σ_tokens −log p = N_tokens · mean NLL. Passing ``num_data`` = the number of sequences instead weighs the
KL (prior) term by (tokens per sequence) more, a prior that is that many times stronger (a valid choice, the
"sequences" convention, but not the Bayes posterior of the token likelihood). With ``reduction="none"``
:meth:`TokenCategorical.nll` returns one value per sequence whose mean over the batch is the ``"mean"``
reduction (as for every likelihood, which ensembles rely on): each sequence's summed NLL times
B / (the batch's number of target tokens).

Sources: Hugging Face ``transformers`` ``loss/loss_utils.py`` (``ForCausalLMLoss``: labels padded with -100
and shifted by one, ``cross_entropy(ignore_index=-100)``, mean over non-ignored tokens); Yang et al.,
"Bayesian low-rank adaptation for large language models" (ICLR 2024), whose Laplace-LoRA counts the data
in target tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bayeswrap.core.likelihoods import _check_tensor, at_least_float32

#: the label value that marks a position with no target (``transformers``' and PyTorch's ``ignore_index``)
IGNORE_INDEX = -100
#: the token likelihood names: with the causal shift, and without it
TOKEN_LIKELIHOODS = ("causal_lm", "token_categorical")


class TokenCategorical(nn.Module):
    """Categorical likelihood over the tokens of (B, T, V) logits with (B, T) labels, ``-100`` ignored.

    −log p(y | x, θ) = Σ_{t: y_t ≠ −100} −log softmax(logits_t)[y_t] (causal: logits_{t−1} for label y_t),
    and the batch loss is that sum over the batch divided by its number of target tokens (``transformers``'
    convention). See the module docstring for ``num_data`` (count target tokens, :func:`count_target_tokens`).

    Args:
        shift: True (``"causal_lm"``): ``logits[:, :-1]`` predict ``labels[:, 1:]``; False
            (``"token_categorical"``): logits and labels aligned.

    Raises:
        ValueError: (in :meth:`check_targets`) on logits that are not (B, T, V) with V ≥ 2 (and T ≥ 2 when
            shifted), labels that are not an integer (B, T) tensor, a label outside [0, V) other than -100,
            or a batch whose every target is ignored.
    """

    def __init__(self, shift: bool = True):
        super().__init__()
        self.shift = bool(shift)
        self.name = TOKEN_LIKELIHOODS[0] if self.shift else TOKEN_LIKELIHOODS[1]

    def extra_repr(self) -> str:
        return f"shift={self.shift}"

    def check_outputs(self, outputs: torch.Tensor) -> None:
        """Raises unless the outputs are logits of shape (B, T, V), V ≥ 2 (and T ≥ 2 with the shift).

        Raises:
            TypeError: if the model did not return a tensor.
            ValueError: naming the shape.
        """
        _check_tensor(outputs)
        shape = tuple(outputs.shape)
        if outputs.dim() != 3 or shape[-1] < 2 or (self.shift and shape[1] < 2):
            need = "T >= 2 positions (the causal shift drops one) and " if self.shift else ""
            raise ValueError(f"likelihood={self.name!r} needs logits of shape (B, T, V) with {need}V >= 2 "
                             f"tokens, but the model returned shape {shape}; for (B, K) sequence-level logits "
                             "use likelihood='categorical'")

    def _aligned(self, outputs: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, T', V) logits and (B, T') labels that score each other (T' = T − 1 with the shift)."""
        return (outputs[:, :-1], y[:, 1:]) if self.shift else (outputs, y)

    def check_targets(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        """Raises ValueError unless ``y`` is an integer (B, T) tensor of token ids in [0, V) or -100, with at
        least one target left (after the shift).

        Args:
            outputs: logits, shape (B, T, V).
            y: labels, shape (B, T), integer dtype; -100 marks an ignored position.
        """
        self.check_outputs(outputs)
        if not isinstance(y, torch.Tensor):
            raise ValueError(f"token labels must be a tensor, got {type(y).__name__}")
        if y.dtype.is_floating_point or y.dtype == torch.bool or y.is_complex():
            raise ValueError(f"token labels must be an integer tensor, got dtype {y.dtype}")
        if tuple(y.shape) != tuple(outputs.shape[:2]):
            raise ValueError(f"labels have shape {tuple(y.shape)} but the logits have shape "
                             f"{tuple(outputs.shape)}; accepted: labels of shape {tuple(outputs.shape[:2])} "
                             "(B, T), the logits' first two dimensions")
        v = outputs.shape[-1]
        bad = (y != IGNORE_INDEX) & ((y < 0) | (y >= v))
        if bool(bad.any()):
            raise ValueError(f"token label {y[bad][0].item()} is out of range; accepted: token ids in "
                             f"[0, {v - 1}] or {IGNORE_INDEX} (ignored)")
        target = self._aligned(outputs, y)[1]
        if not bool((target != IGNORE_INDEX).any()):
            where = "after the causal shift (labels[:, 1:]) " if self.shift else ""
            raise ValueError(f"every label of the batch {where}is {IGNORE_INDEX} (ignored), so it has no token "
                             "to score; accepted: batches with at least one label in [0, "
                             f"{v - 1}]{' at positions 1..T-1' if self.shift else ''}")

    def num_targets(self, y: torch.Tensor) -> int:
        """The number of target tokens of a batch's (B, T) labels (not -100; after the shift), the count its
        ``"mean"`` NLL divides by.
        """
        return int((y[:, 1:] if self.shift else y).ne(IGNORE_INDEX).sum())

    def nll(self, outputs: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Token cross-entropy, ``-100`` ignored.

        Args:
            outputs: logits (B, T, V).
            y: labels (B, T), any integer dtype.
            reduction: ``"mean"``: the mean over the batch's target tokens (``transformers``' loss);
                ``"none"``: (B,), each sequence's summed NLL times B / (the batch's number of target tokens),
                so that their mean is the ``"mean"`` reduction (0 for a sequence with no target).

        Returns:
            A scalar, or (B,).
        """
        logits, target = at_least_float32(outputs), y.long()
        if self.shift:  # shift the labels, not the logits: (B·T, V) stays a view (transformers' ForCausalLMLoss)
            target = F.pad(target[:, 1:], (0, 1), value=IGNORE_INDEX)
        per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX,
                              reduction="none").reshape(target.shape)
        count = (target != IGNORE_INDEX).sum()
        if reduction == "mean":
            return per.sum() / count
        return per.sum(1) * per.shape[0] / count

    def sample_targets(self, outputs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Y ~ p(y|x,θ): one token per position, (B, T, V) → (B, T) (with the shift, position 0 is -100 and
        position t is drawn from logits t − 1).
        """
        probs = at_least_float32(outputs.detach()).softmax(-1)
        flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
        tokens = flat.reshape(probs.shape[:2])
        if self.shift:
            tokens = torch.cat([torch.full_like(tokens[:, :1], IGNORE_INDEX), tokens[:, :-1]], 1)
        return tokens

    def predictive(self, outs: torch.Tensor) -> torch.Tensor:
        """(1/S) Σ_s softmax(outs_s): (S, B, T, V) logits → (B, T, V) probabilities (float32, or float64).

        Unshifted: with the causal shift, position t's probabilities are the predictive of token t + 1.
        """
        return at_least_float32(outs).softmax(-1).mean(0)


def target_count(likelihood, y) -> int:
    """The number of scored targets of a batch: its target tokens for a token likelihood (what its mean NLL
    divides by, :meth:`TokenCategorical.num_targets`), else its examples (``y.shape[0]``).
    """
    count = getattr(likelihood, "num_targets", None)
    return count(y) if count is not None else y.shape[0]


def count_target_tokens(loader, label_key: str = "labels", shift: bool = True) -> int:
    """The number of target tokens in a loader, the ``num_data`` of a token likelihood.

    Args:
        loader: iterable of Hugging Face-style mapping batches holding ``(B, T)`` labels under ``label_key``,
            or of ``(inputs, labels)`` pairs.
        label_key: the key of the labels in a mapping batch.
        shift: whether the causal shift drops each sequence's first label (``"causal_lm"``).

    Returns:
        The count of labels other than -100 (positions 1..T−1 with the shift).

    Raises:
        ValueError: if the loader holds no target token.
    """
    total = 0
    for batch in loader:
        y = batch[label_key] if isinstance(batch, dict) else batch[1]
        total += int((torch.as_tensor(y)[:, 1:] if shift else torch.as_tensor(y)).ne(IGNORE_INDEX).sum())
    if total == 0:
        raise ValueError(f"the loader holds no target token (every label is {IGNORE_INDEX} or there are no "
                         "batches); accepted: a loader with at least one label in [0, V)")
    return total
