"""Layer-level reparameterisation: pre-activation sampling for ``nn.Linear`` and ``nn.Conv2d``.

The local reparameterisation trick (Kingma, Salimans & Welling 2015, "Variational
Dropout and the Local Reparameterization Trick", §2.3) samples a layer's
pre-activations instead of its weights. With independent weights of mean M and
variance V (and a bias of mean b and variance v), a pre-activation
h = b + Σ_i x_i w_i is Gaussian given x, with

    E[h] = b + x·M,    Var[h] = v + x²·V            (eq. 6 of the paper; for Conv2d the same
                                                    sums run through the convolution)

so h = E[h] + sqrt(Var[h]) ⊙ ε, ε ~ N(0, 1), one ε per example and unit. The
moments M, V come from the method: mean-field VI gives (m, s²); LBBNN gives
(α μ, α(σ² + (1 − α) μ²)) (Skaaret-Lund et al. 2023, eqs. 5–6).

bayeswrap never touches the user's model: the Bayesian model keeps a second
storage-free copy of it in which each supported layer is replaced by an
:class:`LRTLinear` / :class:`LRTConv2d` that takes its mean from the usual
parameter name (``"fc.weight"``) and its variance from a sibling buffer name
(``"fc.weight_var"``), both passed through ``torch.func.functional_call``.

Only layers whose type is exactly ``nn.Linear`` or ``nn.Conv2d`` (with
``padding_mode="zeros"``) are supported, because a subclass or a parent module
may use the weight without calling the layer's ``forward`` (e.g. the output
projection of ``nn.MultiheadAttention``). Every other Bayesian parameter falls
back to the method's whole-parameter sampling.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: the suffix of the variance entry that goes with a parameter name under local reparameterisation
VAR_SUFFIX = "_var"

#: keeps sqrt(Var[h]) differentiable where Var[h] is exactly 0 (a dead input row and a point-estimate bias)
_TINY = 1e-16


@dataclass(frozen=True)
class LRTLayer:
    """A layer whose pre-activations are sampled.

    Attributes:
        path: the module's name in the model, e.g. ``"fc0"``.
        kind: ``"linear"`` or ``"conv2d"``.
        weight: the weight's parameter name (``"fc0.weight"``).
        bias: the bias's parameter name, or None for a layer without bias.
        bias_bayesian: whether the bias is a Bayesian parameter (else a point estimate, variance 0).
        weight_shape: the weight's shape.
    """

    path: str
    kind: str
    weight: str
    bias: str | None
    bias_bayesian: bool
    weight_shape: tuple[int, ...]

    @property
    def weight_var(self) -> str:
        return self.weight + VAR_SUFFIX

    @property
    def bias_var(self) -> str | None:
        return self.bias + VAR_SUFFIX if self.bias is not None and self.bias_bayesian else None


def supports_lrt(module: nn.Module) -> bool:
    """Whether ``module`` gets a local-reparameterisation forward (exactly Linear, or Conv2d with zero padding)."""
    if type(module) is nn.Linear:
        return True
    return type(module) is nn.Conv2d and module.padding_mode == "zeros"


def find_lrt_layers(model: nn.Module, bayesian: list[str]) -> list[LRTLayer]:
    """The supported layers of ``model`` whose weight is a Bayesian parameter.

    Args:
        model: the user's model.
        bayesian: names of the Bayesian parameters.

    Returns:
        One :class:`LRTLayer` per supported layer, in module order.
    """
    chosen = set(bayesian)
    layers = []
    for path, module in model.named_modules():
        if not supports_lrt(module):
            continue
        prefix = f"{path}." if path else ""
        weight = prefix + "weight"
        if weight not in chosen:
            continue
        bias = prefix + "bias" if module.bias is not None else None
        layers.append(LRTLayer(path=path, kind="linear" if isinstance(module, nn.Linear) else "conv2d",
                               weight=weight, bias=bias, bias_bayesian=bias is not None and bias in chosen,
                               weight_shape=tuple(module.weight.shape)))
    return layers


class _LRTBase(nn.Module):
    """Holds meta placeholders for the mean (``weight``, ``bias``) and variance (``weight_var``, ``bias_var``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bias_bayesian: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(torch.empty_like(bias, device="meta"),
                                                           requires_grad=False)
        self.register_buffer("weight_var", torch.empty_like(weight, device="meta"))
        self.register_buffer("bias_var", torch.empty_like(bias, device="meta") if bias_bayesian else None)

    def _sample(self, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        return mean + torch.sqrt(var + _TINY) * torch.randn_like(mean)


class LRTLinear(_LRTBase):
    """``nn.Linear`` with sampled pre-activations: h = x Mᵀ + b + sqrt(x² Vᵀ + v) ⊙ ε.

    Input (..., in_features) float; output (..., out_features), a fresh ε per call.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = F.linear(x, self.weight, self.bias)
        var = F.linear(x * x, self.weight_var, self.bias_var)
        return self._sample(mean, var)


class LRTConv2d(_LRTBase):
    """``nn.Conv2d`` with sampled pre-activations: the same moments through the convolution.

    E[h] = conv(x, M) + b and Var[h] = conv(x², V) + v, with the layer's stride,
    padding, dilation and groups. Input (B, C_in, H, W); output (B, C_out, H', W').
    """

    def __init__(self, conv: nn.Conv2d, bias_bayesian: bool):
        super().__init__(conv.weight, conv.bias, bias_bayesian)
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (self.stride, self.padding, self.dilation, self.groups)
        mean = F.conv2d(x, self.weight, self.bias, *args)
        var = F.conv2d(x * x, self.weight_var, self.bias_var, *args)
        return self._sample(mean, var)


def lrt_copy(skeleton: nn.Module, layers: list[LRTLayer]) -> nn.Module:
    """A deep copy of the storage-free model with the given layers replaced by their LRT versions."""
    net = copy.deepcopy(skeleton)
    for layer in layers:
        old = net.get_submodule(layer.path)
        if layer.kind == "linear":
            new: nn.Module = LRTLinear(old.weight, old.bias, layer.bias_bayesian)
        else:
            new = LRTConv2d(old, layer.bias_bayesian)
        if layer.path:
            parent, _, leaf = layer.path.rpartition(".")
            setattr(net.get_submodule(parent) if parent else net, leaf, new)
        else:
            net = new
    return net


def lrt_theta(layers: list[LRTLayer], mean: dict[str, torch.Tensor], var: dict[str, torch.Tensor],
              sampled: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``theta`` of a local-reparameterised forward.

    Args:
        layers: the LRT layers.
        mean, var: weight (and Bayesian bias) moments of those layers, ``{name: tensor}``.
        sampled: values for every other Bayesian parameter (whole-parameter samples).

    Returns:
        ``{name: mean, name + "_var": var}`` for the LRT layers' weights and Bayesian
        biases, and ``sampled`` for the rest.
    """
    theta = dict(sampled)
    for layer in layers:
        for name, var_name in ((layer.weight, layer.weight_var), (layer.bias, layer.bias_var)):
            if var_name is not None:
                theta[name], theta[var_name] = mean[name], var[name]
    return theta


def lrt_names(layers: list[LRTLayer]) -> set[str]:
    """The Bayesian parameters whose moments an LRT forward takes (weights and Bayesian biases)."""
    return {n for layer in layers for n in (layer.weight, layer.bias if layer.bias_bayesian else None) if n}
