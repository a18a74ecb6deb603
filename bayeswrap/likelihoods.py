"""Likelihoods p(y | x, θ) (BayesDLL eq. 2): categorical and Gaussian.

Each likelihood turns model outputs into a batch-mean negative log-likelihood
(the per-datum data term of every objective) and into predictive quantities.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LIKELIHOODS = ("categorical", "gaussian")


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Upcasts half-precision outputs (e.g. under bf16 autocast); float64 stays float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class Categorical:
    """Categorical likelihood on logits: −log p(y|x,θ) = cross-entropy(logits, y)."""

    name = "categorical"

    def check_targets(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        """Raises ValueError if class labels are not integers in [0, K).

        Args:
            outputs: logits, shape (B, K).
            y: labels, shape (B,), integer dtype.
        """
        if outputs.dim() != 2:
            raise ValueError(f"categorical likelihood expects logits of shape (B, K), got {tuple(outputs.shape)}")
        if y.dtype.is_floating_point or y.dtype == torch.bool:
            raise ValueError(f"class labels must be an integer tensor, got dtype {y.dtype}")
        if y.shape != outputs.shape[:1]:
            raise ValueError(f"labels have shape {tuple(y.shape)}, expected ({outputs.shape[0]},)")
        k = outputs.shape[1]
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= k):
            bad = y[(y < 0) | (y >= k)][0].item()
            raise ValueError(f"class label {bad} is out of range; accepted: integers in [0, {k - 1}]")

    def nll(self, outputs: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy: mean (or per-example, ``reduction="none"``) −log softmax(outputs)[y]."""
        return F.cross_entropy(at_least_float32(outputs), y, reduction=reduction)

    def sample_targets(self, outputs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """y ~ p(y|x,θ): one label per row of ``outputs`` (B, K) → (B,)."""
        probs = at_least_float32(outputs.detach()).softmax(-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class Gaussian:
    """Gaussian likelihood y ~ N(f(x;θ), noise_std² I) for regression.

    −log p(y|x,θ) = Σ_d [(y_d − f_d)² / (2 noise_std²) + log(noise_std) + log(2π)/2].

    Args:
        noise_std: output noise standard deviation (> 0), in the units of y.
    """

    name = "gaussian"

    def __init__(self, noise_std: float = 1.0):
        try:
            value = float(noise_std)
        except (TypeError, ValueError):
            raise ValueError(f"noise_std={noise_std!r} is not a number; accepted: a positive float") from None
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"noise_std={noise_std!r} must be > 0 and finite")
        self.noise_std = value

    def check_targets(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        """Raises ValueError unless ``y`` is floating with the shape of ``outputs`` (B, D)."""
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
        """y ~ N(outputs, noise_std²)."""
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
