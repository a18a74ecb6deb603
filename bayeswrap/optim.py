"""Optimizers that are part of an inference method: SGLD and IVON.

References: Welling & Teh 2011, "Bayesian Learning via Stochastic Gradient
Langevin Dynamics" (BayesDLL eq. 12); Shen et al. 2024, "Variational Learning
is Effective for Large Deep Networks" (ICML), Algorithm 1.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from bayeswrap.core import fused
from bayeswrap.core.checks import check_bool, check_float, check_int


class SGLD(torch.optim.Optimizer):
    """Stochastic-gradient Langevin dynamics for a per-datum loss.

    For the per-datum objective L(θ) = U(θ)/N (U the negative log posterior),
    each step is

        θ ← θ − lr · ∇L(θ) + noise_scale · sqrt(2 · lr / N) · ε,    ε ~ N(0, I),

    i.e. Langevin dynamics on U with step size h = lr/N. There is no momentum:
    the Langevin noise must never pass through a momentum buffer.

    ``noise_scale`` s is BayesDLL's ``nd``. With drift h·∇U and noise
    s·sqrt(2h)·ε, a step is the Euler–Maruyama discretisation of
    dθ = −∇U(θ) dt + sqrt(2T) dW with T = s², whose stationary density is

        π_T(θ) ∝ exp(−U(θ) / T) = p(θ | D)^(1/T),    T = noise_scale².

    So ``noise_scale=1`` targets the posterior, ``noise_scale < 1`` a tempered
    ("cold", T < 1) posterior in the sense of Wenzel et al. 2020, "How Good is
    the Bayes Posterior in Deep Neural Networks Really?" (ICML) — the
    likelihood *and* the prior are tempered (e.g. ``noise_scale=0.1`` is
    T = 0.01) — and ``noise_scale=0`` is plain SGD on the MAP objective. Like
    every SGLD, the chain is only approximately stationary at π_T: the
    finite step size and the minibatch gradient noise bias it by O(lr).

    Cyclical SGLD (``bw.wrap(model, "sgld", cycles=M)``) sets each group's
    ``lr`` and ``noise_scale`` before every step of :func:`bayeswrap.fit`.

    Args:
        params: parameters or parameter groups; a group may set its own
            ``lr``, ``num_data`` or ``noise_scale`` (``BayesianModel.param_groups()``
            gives point estimates ``noise_scale=0``).
        lr: learning rate, a finite number > 0.
        num_data: N, an integer ≥ 1, the same N as the model's ``num_data``.
        noise_scale: multiplier of the injected noise, a finite number ≥ 0.
        generator: optional ``torch.Generator`` for the noise (default: the global one).
            A data-parallel :func:`bayeswrap.fit` gives every rank rank 0's state of
            this generator and of the global one at the start, so every replica adds
            the same noise and the replicas stay identical.

    Raises:
        ValueError: if ``lr`` is not a finite number > 0, ``num_data`` not an
            integer ≥ 1 or ``noise_scale`` not a finite number ≥ 0, here or in a
            parameter group (the message names the value and the accepted range).
    """

    def __init__(self, params, lr: float, num_data: int, noise_scale: float = 1.0,
                 generator: torch.Generator | None = None):
        defaults = _check_sgld_hyper(lr=lr, num_data=num_data, noise_scale=noise_scale)
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            group.update(_check_sgld_hyper(**{k: group[k] for k in defaults}, where=f" (param group {i})"))
        self.generator = generator

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one Langevin step; returns the closure's loss if one is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])
            scale = group["noise_scale"] * math.sqrt(2.0 * group["lr"] / group["num_data"])
            if scale > 0:
                torch._foreach_add_(params, self._noise_like(params, index), alpha=scale)
        return loss

    def _noise_like(self, params: list[torch.Tensor], group: int) -> list[torch.Tensor]:
        """ε ~ N(0, I) shaped like each parameter of param group ``group``: one flat draw per device and dtype from
        :func:`bayeswrap.core.fused.random_buckets` (on the CPU, a large model's draws come from parallel streams,
        one per ``torch.get_num_threads()`` thread), split into views. On the CPU the flat buffer (one per param
        group, device and dtype) is kept between steps, outside the optimizer's state: a model-sized buffer
        allocated afresh costs its page faults on every step, about half the cost of the draws themselves.
        """
        out: list[torch.Tensor | None] = [None] * len(params)
        kinds: dict = {}
        for i, p in enumerate(params):
            kinds.setdefault((p.device, p.dtype), []).append(i)
        buffers = self.__dict__.setdefault("_noise_buffers", {})
        for (device, dtype), idx in kinds.items():
            tensors = [params[i] for i in idx]
            size = sum(p.numel() for p in tensors)
            keep = None
            if device.type == "cpu":
                keep = buffers.get((group, device, dtype))
                if keep is None or keep.numel() != size:
                    keep = buffers[(group, device, dtype)] = torch.empty(size, device=device, dtype=dtype)
            flat = fused.random_buckets(tensors, [list(range(len(tensors)))], "normal", self.generator,
                                        out=None if keep is None else [keep])[0]
            for i, chunk in zip(idx, flat.split([p.numel() for p in tensors])):
                out[i] = chunk.view(params[i].shape)
        return out


class IVONTerms(NamedTuple):
    """The model-side companions of one IVON mean parameter m, for one optimizer step.

    Attributes:
        hess: h, the Hessian estimate, same shape as m; updated in place by the step.
        prior_mean: θ̄, the prior mean, same shape as m.
        perturbation: θ − m of the training draw whose gradient is in ``m.grad``.
        ess: λ = num_data / kl_weight, the effective sample size.
        weight_decay: δ = kl_weight / (num_data · prior_std²), so that λδ = 1/prior_std².
        hess_init: h₀, the initial value of ``hess`` (sets the ``rescale_lr`` factor).
    """

    hess: torch.Tensor
    prior_mean: torch.Tensor
    perturbation: torch.Tensor
    ess: float
    weight_decay: float
    hess_init: float


#: mean Parameter -> (weak reference to the model that owns it, its parameter name). Keyed by
#: identity and held weakly on both sides, so neither the parameter nor the model is kept alive.
_IVON_LINKS = WeakIdKeyDictionary()


def link_ivon_parameter(param: torch.Tensor, model, name: str) -> None:
    """Tells :class:`IVON` that ``param`` is the mean of IVON parameter ``name`` of ``model``.

    ``model`` must have a method ``ivon_terms(name) -> IVONTerms``
    (:class:`bayeswrap.methods.IVON` links its means when it is built, copied or
    unpickled, and again at every training draw).
    """
    _IVON_LINKS[param] = (weakref.ref(model), name)


def _ivon_terms(param: torch.Tensor) -> IVONTerms | None:
    link = _IVON_LINKS.get(param)
    if link is None:
        return None
    model = link[0]()
    if model is None:
        raise RuntimeError("this parameter belonged to an IVON model that no longer exists; "
                           "build the optimizer from a live model's param_groups()")
    return model.ivon_terms(link[1])


class IVON(torch.optim.Optimizer):
    """Improved Variational Online Newton for a :class:`bayeswrap.methods.IVON` model.

    Mean-field Gaussian variational learning q(θ) = N(m, σ²) at Adam's cost
    (Shen et al. 2024, Algorithm 1). The model draws θ = m + σ ⊙ ε with
    σ = 1/sqrt(λ(h + δ)) in its training forward and keeps θ − m; the loss's
    backward leaves ĝ = ∇ℓ̄(θ) in ``m.grad``. Each step then does, elementwise
    (t counts this parameter's steps), the updates of Algorithm 1:

        ĥ = ĝ ⊙ (θ − m) / σ²                                       (reparameterised Hessian estimate)
        g ← β₁ g + (1 − β₁) ĝ                                       (gradient momentum)
        h ← β₂ h + (1 − β₂) ĥ + ½ (1 − β₂)² (h − ĥ)² / (h + δ)        (keeps h + δ > 0)
        ḡ = g / (1 − β₁ᵗ)                                           (debiased momentum)
        m ← m − α · clip((ḡ + δ (m − θ̄)) / (h + δ), ±clip_radius)     (preconditioned step)

    with α = lr · (h₀ + δ) if ``rescale_lr`` (Algorithm 1's optional learning-rate
    rescaling, on by default in the official ``ivon-opt`` package: at the start the
    step is lr times the gradient) else α = lr. The
    model supplies λ = num_data / kl_weight, δ = kl_weight / (num_data ·
    prior_std²) (so the posterior precision λ(h + δ) has the prior precision
    1/prior_std² built in), the prior mean θ̄ (weight decay pulls towards it,
    not towards 0), h₀ and h; h lives in the model's ``hess`` buffer and is
    updated in place, the momentum g and the step count live in this
    optimizer's state.

    Parameters that are not IVON means (the ``"point"`` groups of
    ``bnn.param_groups()``: the non-Bayesian parameters when ``params=`` selects
    part of the model) get heavy-ball SGD with the group's ``lr`` and ``beta1``:
    g ← β₁ g + (1 − β₁) ĝ, p ← p − lr · g / (1 − β₁ᵗ), no weight decay, no clipping.

    One training draw per step: call ``bnn.loss(x, y)``, ``backward()`` and
    ``step()`` in turn (as :func:`bayeswrap.fit` does). Gradient accumulation
    over several draws is not supported: ĥ pairs the accumulated gradient with
    the last draw only. Gradient clipping before ``step()`` clips ĝ.

    Args:
        params: ``bnn.param_groups()`` (or ``bnn.parameters()``) of an IVON model;
            a group may override ``lr``, ``beta1``, ``beta2``, ``clip_radius``.
        lr: learning rate α, a finite number > 0; schedulers change the groups' ``lr`` as usual.
        beta1: momentum of the gradient, in [0, 1).
        beta2: momentum of the Hessian estimate, in [0, 1]; 1 keeps h = h₀.
            The default 0.99999 (the paper's) averages ĥ over ~10⁵ steps;
            short runs need a smaller value.
        clip_radius: elementwise bound of the preconditioned step
            (ḡ + δ(m − θ̄))/(h + δ), in parameter units per unit lr (> 0; ``inf``
            = no clipping). The paper uses 1e-3 for ImageNet-scale runs.
        rescale_lr: scale lr by (h₀ + δ) (official package default) so that
            ``lr`` means the same as for SGD at the start of training.

    Raises:
        ValueError: if ``lr`` is not a finite number > 0, ``beta1`` ∉ [0, 1), ``beta2`` ∉ [0, 1]
            or ``clip_radius`` is not > 0 (``inf`` allowed, NaN not), here or in a
            parameter group (the message names the value and the accepted range).
        RuntimeError: in ``step()``, if an IVON mean has a gradient but its model
            drew no training sample since the last step.
    """

    def __init__(self, params, lr: float, beta1: float = 0.9, beta2: float = 0.99999,
                 clip_radius: float = float("inf"), rescale_lr: bool = True):
        defaults = _check_ivon_hyper(lr=lr, beta1=beta1, beta2=beta2, clip_radius=clip_radius)
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            group.update(_check_ivon_hyper(**{k: group[k] for k in defaults}, where=f" (param group {i})"))
        self.rescale_lr = check_bool("rescale_lr", rescale_lr)
        if not any(p in _IVON_LINKS for group in self.param_groups for p in group["params"]):
            warnings.warn("none of the parameters given to bayeswrap.optim.IVON is the mean of a bayeswrap IVON "
                          "model, so all of them get plain heavy-ball SGD; pass bnn.param_groups() of "
                          "bw.wrap(model, 'ivon', ...)", UserWarning, stacklevel=2)

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one IVON step (heavy-ball for non-IVON parameters); returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta1, beta2, radius = group["lr"], group["beta1"], group["beta2"], group["clip_radius"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, terms = p.grad, _ivon_terms(p)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["momentum"] = torch.zeros_like(p)
                state["step"] += 1
                momentum = state["momentum"].mul_(beta1).add_(grad, alpha=1 - beta1)
                g_bar = momentum / (1 - beta1 ** state["step"])
                if terms is None:  # a point estimate: heavy-ball SGD
                    p.sub_(g_bar, alpha=lr)
                    continue
                h, delta = terms.hess, terms.weight_decay
                h_hat = grad * terms.perturbation * (terms.ess * (h + delta))  # ĝ (θ − m) / σ²
                correction = (h - h_hat).square_().div_(h + delta).mul_(0.5 * (1 - beta2) ** 2)
                h.mul_(beta2).add_(h_hat, alpha=1 - beta2).add_(correction)
                direction = (g_bar + delta * (p - terms.prior_mean)).div_(h + delta)
                if math.isfinite(radius):
                    direction.clamp_(-radius, radius)
                p.sub_(direction, alpha=lr * (terms.hess_init + delta) if self.rescale_lr else lr)
        return loss


def _check_sgld_hyper(lr, num_data, noise_scale, where: str = "") -> dict:
    """The SGLD hyper-parameters as numbers, or a ValueError naming the first one out of its range."""
    note = f"bayeswrap.optim.SGLD{where}"
    return {"lr": check_float("lr", lr, low=0.0, low_open=True, note=note),
            "num_data": check_int("num_data", num_data, minimum=1, note=note),
            "noise_scale": check_float("noise_scale", noise_scale, low=0.0, note=note)}


def _check_ivon_hyper(lr, beta1, beta2, clip_radius, where: str = "") -> dict:
    """The IVON hyper-parameters as numbers, or a ValueError naming the first one out of its range."""
    note = f"bayeswrap.optim.IVON{where}"
    return {"lr": check_float("lr", lr, low=0.0, low_open=True, note=note),
            "beta1": check_float("beta1", beta1, low=0.0, high=1.0, high_open=True, note=note),
            "beta2": check_float("beta2", beta2, low=0.0, high=1.0, note=note),
            "clip_radius": check_float("clip_radius", clip_radius, low=0.0, low_open=True, allow_inf=True,
                                       note=f"inf for no clipping; {note}")}
