"""Likelihoods p(y | x, θ) (BayesDLL eq. 2): categorical and Gaussian.

Each likelihood turns model outputs into a batch-mean negative log-likelihood
(the per-datum data term of every objective) and into predictive quantities.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bayeswrap.core.checks import check_scale

LIKELIHOODS = ("categorical", "gaussian")


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Upcasts half-precision outputs (e.g. under bf16 autocast); float64 stays float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _check_tensor(outputs) -> None:
    if not isinstance(outputs, torch.Tensor):
        hint = (" (for a model that returns a ModelOutput/dict, wrap it in a module whose forward returns the logits)"
                if isinstance(outputs, (dict, tuple, list)) or hasattr(outputs, "logits") else "")
        raise TypeError(f"the model returned a {type(outputs).__name__}; accepted: a tensor of outputs{hint}")


class Categorical:
    """Categorical likelihood on logits: −log p(y|x,θ) = cross-entropy(logits, y)."""

    name = "categorical"

    def check_outputs(self, outputs: torch.Tensor) -> None:
        """Raises unless the model's outputs are logits of shape (B, K) with K ≥ 2 (a shape check, no sync).

        A (B, K, 1) output would give every class probability 1 after a softmax
        over the last dimension, and a (B,) output would be normalised across the
        batch, so both are refused rather than silently mis-read.

        Args:
            outputs: the outputs of one forward pass.

        Raises:
            TypeError: if the model did not return a tensor.
            ValueError: naming the shape, if it is not (B, K) with K ≥ 2.
        """
        _check_tensor(outputs)
        shape = tuple(outputs.shape)
        if outputs.dim() != 2 or shape[1] < 2:
            if outputs.dim() == 3 and shape[-1] == 1:
                hint = "; squeeze the trailing dimension of size 1 in the model"
            elif outputs.dim() <= 1:
                hint = ("; for binary classification return 2 logits per example, for regression use "
                        "likelihood='gaussian'")
            elif outputs.dim() == 2:
                hint = "; a single class has probability 1 whatever the input: return 2 logits for 2 classes"
            else:
                hint = "; flatten the extra dimensions in the model (e.g. per-pixel outputs are not supported)"
            raise ValueError(f"the categorical likelihood needs logits of shape (B, K) with K >= 2 classes, but the "
                             f"model returned shape {shape}{hint}")

    def check_targets(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        """Raises ValueError if the outputs are not (B, K) logits or class labels are not integers in [0, K).

        Args:
            outputs: logits, shape (B, K).
            y: labels, shape (B,), integer dtype.
        """
        self.check_outputs(outputs)
        if not isinstance(y, torch.Tensor):
            raise ValueError(f"class labels must be a tensor, got {type(y).__name__}")
        if y.dtype.is_floating_point or y.dtype == torch.bool:
            raise ValueError(f"class labels must be an integer tensor, got dtype {y.dtype}")
        if y.shape != outputs.shape[:1]:
            raise ValueError(f"labels have shape {tuple(y.shape)}, expected ({outputs.shape[0]},)")
        k = outputs.shape[1]
        if y.numel() and not (0 <= (bounds := torch.stack(torch.aminmax(y)).tolist())[0] and bounds[1] < k):
            # one device sync per call (min and max read together)
            bad = y[(y < 0) | (y >= k)][0].item()
            raise ValueError(f"class label {bad} is out of range; accepted: integers in [0, {k - 1}]")

    def nll(self, outputs: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy: mean (or per-example, ``reduction="none"``) −log softmax(outputs)[y]."""
        return F.cross_entropy(at_least_float32(outputs), y, reduction=reduction)

    def sample_targets(self, outputs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Y ~ p(y|x,θ): one label per row of ``outputs`` (B, K) → (B,)."""
        probs = at_least_float32(outputs.detach()).softmax(-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class Gaussian:
    """Gaussian likelihood y ~ N(f(x;θ), noise_std² I) for regression.

    −log p(y|x,θ) = Σ_d [(y_d − f_d)² / (2 noise_std²) + log(noise_std) + log(2π)/2].

    Args:
        noise_std: output noise standard deviation, in the units of y; a number in
            [1e-18, 1e18] (float32 must hold 1/noise_std²).

    Raises:
        ValueError: for any other ``noise_std``.
    """

    name = "gaussian"

    def __init__(self, noise_std: float = 1.0):
        self.noise_std = check_scale("noise_std", noise_std)

    def check_outputs(self, outputs: torch.Tensor) -> None:
        """Raises TypeError if the model did not return a tensor (any shape (B, ...) is accepted)."""
        _check_tensor(outputs)

    def check_targets(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        """Raises ValueError unless ``y`` is floating with the shape of ``outputs`` (B, D)."""
        self.check_outputs(outputs)
        if not isinstance(y, torch.Tensor):
            raise ValueError(f"regression targets must be a tensor, got {type(y).__name__}")
        if not y.dtype.is_floating_point:
            raise ValueError(f"gaussian likelihood expects floating-point targets, got dtype {y.dtype}")
        if y.shape != outputs.shape:
            raise ValueError(f"targets have shape {tuple(y.shape)}, outputs have shape {tuple(outputs.shape)}; "
                             "they must match, e.g. (B, D)")

    def nll(self, outputs: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Gaussian NLL summed over output dims; batch mean or per example (``"none"``)."""
        var = self.noise_std**2
        per = (0.5 / var) * (y - outputs).pow(2) + 0.5 * math.log(2 * math.pi * var)
        per = per.reshape(per.shape[0], -1).sum(-1)
        return per.mean() if reduction == "mean" else per

    def sample_targets(self, outputs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Y ~ N(outputs, noise_std²)."""
        noise = torch.randn(outputs.shape, generator=generator, device=outputs.device, dtype=outputs.dtype)
        return outputs.detach() + self.noise_std * noise


def make_likelihood(likelihood: str, noise_std: float = 1.0):
    """The likelihood object for a name in ``LIKELIHOODS``.

    Raises:
        ValueError: on an unknown name.
    """
    if likelihood == "categorical":
        return Categorical()
    if likelihood == "gaussian":
        return Gaussian(noise_std)
    raise ValueError(f"likelihood={likelihood!r} is not known; accepted: {LIKELIHOODS}")
