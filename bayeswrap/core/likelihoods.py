"""Likelihoods p(y | x, θ) (BayesDLL eq. 2): categorical, Gaussian and heteroscedastic Gaussian.

(The token likelihoods of language models, ``"causal_lm"`` and ``"token_categorical"``, are in
:mod:`bayeswrap.core.token_likelihoods`.)

Each likelihood turns model outputs into a batch-mean negative log-likelihood
(the per-datum data term of every objective) and into predictive quantities.
Likelihoods are ``nn.Module``s: a Gaussian with a learned noise std
(``noise_std="learn"``) holds its log σ as a parameter, which the Bayesian model
exposes through ``parameters()`` and saves in its ``state_dict``.

* ``"gaussian"``: y ~ N(f(x; θ), σ² I), σ fixed or learned (a point estimate: jointly
  with θ in the training loss, or by the Laplace marginal likelihood, MacKay 1992;
  Immer et al. 2021).
* ``"heteroscedastic"``: the model returns (B, 2D), a mean μ(x) and a log-variance
  s(x) = log σ²(x) per output (Nix & Weigend 1994; Kendall & Gal 2017, eq. 8), and
  y ~ N(μ(x), diag(exp s(x))). Over posterior samples the predictive is the
  mixture (1/S) Σ_s N(μ_s, exp s_s), summarised by its mean and its total variance
  = mean of the variances (aleatoric) + variance of the means (epistemic)
  (Kendall & Gal 2017, eq. 9; Lakshminarayanan et al. 2017, §2.4).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bayeswrap.core.checks import check_scale

LIKELIHOODS = ("categorical", "gaussian", "heteroscedastic", "causal_lm", "token_categorical")
#: the likelihoods whose predictive is class (token) probabilities, mixed linearly over members and samples
PROBABILITY_LIKELIHOODS = ("categorical", "causal_lm", "token_categorical")
#: the ``noise_std`` value that makes the Gaussian noise std a learned parameter
LEARN = "learn"


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Upcasts half-precision outputs (e.g. under bf16 autocast); float64 stays float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _check_tensor(outputs) -> None:
    if not isinstance(outputs, torch.Tensor):
        hint = (" (a model that returns a ModelOutput/dict is read at bw.wrap's output_key, a tuple at its first "
                "element)" if isinstance(outputs, (dict, tuple, list)) or hasattr(outputs, "logits") else "")
        raise TypeError(f"the model returned a {type(outputs).__name__}; accepted: a tensor of outputs{hint}")


class Categorical(nn.Module):
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

    def predictive(self, outs: torch.Tensor) -> torch.Tensor:
        """(1/S) Σ_s softmax(outs_s): (S, B, K) logits → (B, K) probabilities (float32, or float64)."""
        return at_least_float32(outs).softmax(-1).mean(0)


class Gaussian(nn.Module):
    """Gaussian likelihood y ~ N(f(x;θ), noise_std² I) for regression, with a fixed or learned noise std.

    −log p(y|x,θ) = Σ_d [(y_d − f_d)² / (2 noise_std²) + log(noise_std) + log(2π)/2].

    Args:
        noise_std: output noise standard deviation, in the units of y: a number in
            [1e-18, 1e18] (float32 must hold 1/noise_std²), or ``"learn"``: a point
            estimate of log σ held as the 0-d parameter ``log_noise_std``, starting at
            σ = 1 (the scale of standardised targets; set :attr:`noise_std` before
            training for another start). It is trained jointly with θ in the loss (the
            loss's minimiser in σ is the maximum-likelihood σ² = mean squared residual),
            or by the marginal likelihood for Laplace
            (:meth:`bayeswrap.Laplace.optimize_prior_precision`).

    Attributes:
        learned: whether σ is a parameter.
        noise_std: σ as a float (settable: a number in [1e-18, 1e18]).

    Raises:
        ValueError: for any other ``noise_std``, naming it and listing the accepted values.
    """

    name = "gaussian"

    def __init__(self, noise_std: float | str = 1.0):
        super().__init__()
        self.learned = isinstance(noise_std, str) and noise_std == LEARN
        if self.learned:
            self.log_noise_std = nn.Parameter(torch.zeros(()))
        else:
            self._noise_std = check_noise_std(noise_std)

    @property
    def noise_std(self) -> float:
        """σ, the noise std (float); for a learned σ, exp(log_noise_std) now."""
        return float(self.log_noise_std.detach().exp()) if self.learned else self._noise_std

    @noise_std.setter
    def noise_std(self, value: float) -> None:
        value = check_scale("noise_std", value)
        if self.learned:
            with torch.no_grad():
                self.log_noise_std.fill_(math.log(value))
        else:
            self._noise_std = value

    def extra_repr(self) -> str:
        return "noise_std='learn'" if self.learned else f"noise_std={self._noise_std:g}"

    def check_outputs(self, outputs: torch.Tensor) -> None:
        """Raises TypeError if the model did not return a tensor (any shape (B, ...) is accepted)."""
        _check_tensor(outputs)

    def check_targets(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        """Raises ValueError unless ``y`` is floating with the shape of ``outputs`` (B, D)."""
        self.check_outputs(outputs)
        _check_float_targets(y, self.name)
        if y.shape != outputs.shape:
            raise ValueError(f"targets have shape {tuple(y.shape)}, outputs have shape {tuple(outputs.shape)}; "
                             "they must match, e.g. (B, D)")

    def nll(self, outputs: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Gaussian NLL summed over output dims; batch mean or per example (``"none"``).

        Differentiable in ``log_noise_std`` when σ is learned.
        """
        if self.learned:
            log_std = self.log_noise_std
            per = 0.5 * (y - outputs).pow(2) * torch.exp(-2 * log_std) + log_std + 0.5 * math.log(2 * math.pi)
        else:
            var = self._noise_std**2
            per = (0.5 / var) * (y - outputs).pow(2) + 0.5 * math.log(2 * math.pi * var)
        per = per.reshape(per.shape[0], -1).sum(-1)
        return per.mean() if reduction == "mean" else per

    def sample_targets(self, outputs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Y ~ N(outputs, noise_std²)."""
        noise = torch.randn(outputs.shape, generator=generator, device=outputs.device, dtype=outputs.dtype)
        return outputs.detach() + self.noise_std * noise

    def predictive(self, outs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Moments of (1/S) Σ_s N(outs_s, σ²): (S, B, D) → ``(mean, variance)``, each (B, D).

        The variance is σ² plus the (population) variance of the S sampled means.
        """
        return outs.mean(0), outs.var(0, unbiased=False) + self.noise_std**2


class Heteroscedastic(nn.Module):
    """Heteroscedastic Gaussian likelihood y ~ N(μ(x), diag(exp s(x))) (Kendall & Gal 2017, eq. 8).

    The model returns (B, 2D): the mean μ in ``outputs[:, :D]`` and the log-variance
    s = log σ² in ``outputs[:, D:]``, so the variance is positive for any output
    (Nix & Weigend 1994). Per example

        −log p(y|x,θ) = Σ_d ½ [(y_d − μ_d)² exp(−s_d) + s_d + log 2π].

    The predictive over S posterior samples is the mixture (1/S) Σ_s N(μ_s, exp s_s),
    returned as its moments (:meth:`predictive`). Laplace does not support it (its GGN
    would need the natural parameterisation of Immer et al. 2023).
    """

    name = "heteroscedastic"

    def check_outputs(self, outputs: torch.Tensor) -> None:
        """Raises unless the outputs are (B, 2D) with D ≥ 1 (a shape check, no sync).

        Raises:
            TypeError: if the model did not return a tensor.
            ValueError: naming the shape, if it is not (B, 2D).
        """
        _check_tensor(outputs)
        if outputs.dim() != 2 or outputs.shape[1] % 2 or outputs.shape[1] == 0:
            raise ValueError(f"the heteroscedastic likelihood needs outputs of shape (B, 2D): D means followed by D "
                             f"log-variances, but the model returned shape {tuple(outputs.shape)}; accepted: an "
                             "even number of outputs per example (e.g. nn.Linear(h, 2) for one target), or "
                             "likelihood='gaussian' for a mean-only model")

    def check_targets(self, outputs: torch.Tensor, y: torch.Tensor) -> None:
        """Raises ValueError unless ``y`` is floating of shape (B, D) for outputs (B, 2D)."""
        self.check_outputs(outputs)
        _check_float_targets(y, self.name)
        expected = (outputs.shape[0], outputs.shape[1] // 2)
        if tuple(y.shape) != expected:
            raise ValueError(f"targets have shape {tuple(y.shape)}, outputs have shape {tuple(outputs.shape)} "
                             f"(means and log-variances); accepted: targets of shape {expected}")

    @staticmethod
    def mean_and_variance(outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Splits (..., 2D) outputs into the mean μ (..., D) and the variance exp(s) (..., D)."""
        mean, log_var = outputs.chunk(2, dim=-1)
        return mean, log_var.exp()

    def nll(self, outputs: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Heteroscedastic Gaussian NLL summed over output dims; batch mean or per example (``"none"``)."""
        mean, log_var = outputs.chunk(2, dim=-1)
        per = 0.5 * ((y - mean).pow(2) * torch.exp(-log_var) + log_var + math.log(2 * math.pi))
        per = per.sum(-1)
        return per.mean() if reduction == "mean" else per

    def sample_targets(self, outputs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Y ~ N(μ, exp s): (B, 2D) outputs → (B, D) targets."""
        mean, var = self.mean_and_variance(outputs.detach())
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return mean + var.sqrt() * noise

    def predictive(self, outs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Moments of the mixture (1/S) Σ_s N(μ_s, exp s_s): (S, B, 2D) → ``(mean, variance)``, each (B, D).

        variance = (1/S) Σ_s exp(s_s) (aleatoric) + (1/S) Σ_s (μ_s − mean)² (epistemic).
        """
        mean, var = self.mean_and_variance(outs)
        return mean.mean(0), var.mean(0) + mean.var(0, unbiased=False)


def check_noise_std(noise_std) -> float:
    """A fixed noise std in [1e-18, 1e18] as a float.

    Raises:
        ValueError: naming the value; the accepted values are a number in that range or ``"learn"``.
    """
    try:
        return check_scale("noise_std", noise_std)
    except ValueError as err:
        raise ValueError(f"{err}; or noise_std={LEARN!r} (a learned noise std, likelihood='gaussian' only)") from None


def _check_float_targets(y, name: str) -> None:
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"regression targets must be a tensor, got {type(y).__name__}")
    if not y.dtype.is_floating_point:
        raise ValueError(f"{name} likelihood expects floating-point targets, got dtype {y.dtype}")


def make_likelihood(likelihood: str, noise_std: float | str = 1.0) -> nn.Module:
    """The likelihood module for a name in ``LIKELIHOODS``.

    Args:
        likelihood: ``"categorical"``, ``"gaussian"``, ``"heteroscedastic"``, or a token likelihood for
            (B, T, V) language-model logits with (B, T) labels, ``-100`` ignored
            (:mod:`bayeswrap.core.token_likelihoods`): ``"causal_lm"`` (the causal shift, as
            ``transformers``' causal-LM loss) or ``"token_categorical"`` (no shift: masked LMs, token
            classification).
        noise_std: the Gaussian noise std (a number in [1e-18, 1e18] or ``"learn"``); the
            other likelihoods ignore a number and refuse ``"learn"``.

    Raises:
        ValueError: on an unknown name, an invalid ``noise_std``, or ``"learn"`` with a
            likelihood other than ``"gaussian"``.
    """
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood={likelihood!r} is not known; accepted: {LIKELIHOODS}")
    if likelihood == "gaussian":
        return Gaussian(noise_std)
    if isinstance(noise_std, str):
        raise ValueError(f"noise_std={noise_std!r} is not accepted with likelihood={likelihood!r}, which has no "
                         f"noise std to learn (the heteroscedastic model predicts its own variance); accepted: "
                         f"noise_std={LEARN!r} with likelihood='gaussian'")
    if likelihood in ("causal_lm", "token_categorical"):
        from bayeswrap.core.token_likelihoods import TokenCategorical  # it builds on this module's helpers

        return TokenCategorical(shift=likelihood == "causal_lm")
    return Categorical() if likelihood == "categorical" else Heteroscedastic()
