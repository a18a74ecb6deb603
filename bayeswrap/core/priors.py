"""The isotropic Gaussian prior p(θ) = N(θ̄, prior_std² I) (BayesDLL eq. 1).

θ̄ (``prior_mean``) is the model's current, usually pretrained, weights
(``"init"``), zero (``"zero"``), or a user mapping. Biases either share the
weights' prior (``bias="informative"``) or get the flat prior p(θ_b) ∝ 1
(``"uninformative"``), which contributes no prior or KL term.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from bayeswrap.core.functional import NamedTensors, is_bias, nonfinite_names
from bayeswrap.core.fused import gaussian_penalty

PRIOR_MEANS = ("init", "zero", "a mapping from parameter name to tensor")
BIAS_OPTIONS = ("informative", "uninformative")


class GaussianPrior(nn.Module):
    """p(θ) = Π_i N(θ_i; θ̄_i, σ²) over the Bayesian parameters (BayesDLL eq. 1).

    Args:
        init: the model's current values of the Bayesian parameters, ``{name: tensor}``.
        prior_std: σ > 0, or ``None`` for no prior at all (maximum likelihood).
        prior_mean: ``"init"`` (θ̄ = ``init``), ``"zero"`` (θ̄ = 0), or a mapping
            ``{name: tensor}`` that must cover every Bayesian parameter with the
            right shape.
        bias: ``"informative"`` or ``"uninformative"`` (see module docstring).

    Raises:
        ValueError: on an unknown ``prior_mean`` or ``bias`` option, or a mapping with
            missing, unknown, mis-shaped or non-finite entries. (``prior_std`` is
            validated by :class:`~bayeswrap.BayesianModel`.)
    """

    def __init__(self, init: Mapping[str, torch.Tensor], prior_std: float | None,
                 prior_mean="init", bias: str = "informative"):
        super().__init__()
        if bias not in BIAS_OPTIONS:
            raise ValueError(f"bias={bias!r} is not a prior option; accepted: {BIAS_OPTIONS}")
        self.prior_std = prior_std
        self.bias = bias
        if isinstance(prior_mean, str):
            if prior_mean == "init":
                means = dict(init)
            elif prior_mean == "zero":
                means = {n: torch.zeros_like(t) for n, t in init.items()}
            else:
                raise ValueError(f"prior_mean={prior_mean!r} is not accepted; accepted: {PRIOR_MEANS}")
        elif isinstance(prior_mean, Mapping):
            missing = [n for n in init if n not in prior_mean]
            unknown = [n for n in prior_mean if n not in init]
            if missing or unknown:
                raise ValueError(f"prior_mean mapping does not match the Bayesian parameters: "
                                 f"missing {missing[:8]}, unknown {unknown[:8]}")
            means = {}
            for n, t in init.items():
                try:
                    m = torch.as_tensor(prior_mean[n], dtype=t.dtype, device=t.device)
                except (TypeError, ValueError, RuntimeError):
                    raise ValueError(f"prior_mean[{n!r}] is a {type(prior_mean[n]).__name__}; accepted: a tensor "
                                     f"of shape {tuple(t.shape)}") from None
                if m.shape != t.shape:
                    raise ValueError(f"prior_mean[{n!r}] has shape {tuple(m.shape)}, expected {tuple(t.shape)}")
                means[n] = m
            bad = nonfinite_names(means.items())
            if bad:
                count = int((~torch.isfinite(means[bad[0]])).sum())
                raise ValueError(f"prior_mean[{bad[0]!r}] contains {count} non-finite values (NaN or inf)"
                                 f"{f' (so do {bad[1:4]})' if len(bad) > 1 else ''}; accepted: finite tensors")
        else:
            raise ValueError(f"prior_mean={prior_mean!r} is not accepted; accepted: {PRIOR_MEANS}")
        self.mean = NamedTensors(means, trainable=False)

    def applies_to(self, name: str) -> bool:
        """Whether parameter ``name`` has a (non-flat) prior term."""
        return self.prior_std is not None and not (self.bias == "uninformative" and is_bias(name))

    def precision(self, name: str) -> float:
        """Prior precision 1/σ² of parameter ``name`` (0 for a flat prior)."""
        return 1.0 / self.prior_std**2 if self.applies_to(name) else 0.0

    def penalty(self, params: Mapping[str, torch.Tensor], scale: Mapping[str, float] | None = None,
                fused: bool = True) -> torch.Tensor:
        """Negative log prior up to a constant: Σ_i s_i (θ_i − θ̄_i)² / (2σ²).

        Args:
            params: ``{name: tensor}`` of the Bayesian parameters.
            scale: optional per-parameter factor s_i (MC-dropout's 1 − p, eq. 10);
                1 by default.
            fused: use the multi-tensor kernel with an analytic gradient
                (:func:`bayeswrap.core.fused.gaussian_penalty`); False uses the plain
                autograd reference. Both give the same value and gradient.

        Returns:
            A scalar tensor (nats).
        """
        if fused:
            names = [n for n in params if self.applies_to(n) and (scale is None or scale[n] != 0)]
            if not names:
                return _zero(params)
            factors = [(1.0 if scale is None else scale[n]) * 0.5 / self.prior_std**2 for n in names]
            return gaussian_penalty([params[n] for n in names], [self.mean[n] for n in names], factors)
        total = None
        for n, p in params.items():
            if not self.applies_to(n):
                continue
            s = 1.0 if scale is None else scale[n]
            if s == 0:
                continue
            term = (s * 0.5 / self.prior_std**2) * (p - self.mean[n]).pow(2).sum()
            total = term if total is None else total + term
        return total if total is not None else _zero(params)

    def kl(self, mean: Mapping[str, torch.Tensor], std: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Analytic KL(N(m, s²) || N(θ̄, σ²)) summed over parameters (BayesDLL eq. 7).

        KL = Σ_i [ log(σ/s_i) + (s_i² + (m_i − θ̄_i)²) / (2σ²) − 1/2 ].
        Parameters with a flat prior contribute nothing.

        Args:
            mean: ``{name: m}``.
            std: ``{name: s}``, same shapes, s > 0.

        Returns:
            A scalar tensor (nats).
        """
        total = None
        for n, m in mean.items():
            if not self.applies_to(n):
                continue
            s = std[n]
            var0 = self.prior_std**2
            term = (0.5 / var0) * ((m - self.mean[n]).pow(2) + s.pow(2)).sum() - s.log().sum() \
                + m.numel() * (math.log(self.prior_std) - 0.5)
            total = term if total is None else total + term
        return total if total is not None else _zero(mean)


def _zero(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    ref = next(iter(tensors.values()))
    return ref.new_zeros(())
