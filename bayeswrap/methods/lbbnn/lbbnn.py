"""Latent binary Bayesian neural networks (LBBNN), with local reparameterisation and normalizing flows.

Skaaret-Lund, Storvik & Hubin 2023, "Sparsifying Bayesian neural networks with
latent binary variables and normalizing flows" (arXiv 2305.03395); Hubin &
Storvik 2019 for the weight-sampling LBBNN.

Every Bayesian weight w (every Bayesian parameter that is not a ``*.bias``) has
an inclusion variable γ:

* prior: p(w | γ) = γ N(θ̄, σ_p²) + (1 − γ) δ₀, γ ~ Bernoulli(α_p) (``prior_std`` σ_p,
  ``prior_inclusion`` α_p, the prior mean θ̄ of :class:`~bayeswrap.BayesianModel`,
  zero in the paper);
* posterior: q(w | γ) = γ N(μ̃, σ̃²), q(γ) = Bernoulli(α̃), α̃ = sigmoid(λ), σ̃ = softplus(ρ).

Biases are Gaussian, q = N(μ̃, σ̃²) against N(θ̄, σ_p²) (no inclusion variable).

**Training forward.** For ``nn.Linear`` / ``nn.Conv2d`` layers whose weight is
Bayesian (:mod:`bayeswrap.core.layers`), pre-activations are sampled from their
moments (eqs. 5–6 of the paper): E[h] = b + Σ x α̃ μ̃ and
Var[h] = σ_b² + Σ x² α̃(σ̃² + (1 − α̃) μ̃²) ("LBBNN-LRT"). Every other Bayesian
weight is sampled whole, w = γ (μ̃ + σ̃ ε), with γ a relaxed Bernoulli sample
(Maddison et al. 2017; ``temperature``) in training and an exact Bernoulli draw
for predictions; ``local_reparam=False`` does this for every layer (the
weight-sampling "LBBNN" of Table 1).

**Flows** (``flow_length > 0``, "LBBNN-FLOW", MNF of Louizos & Welling 2017): each
LRT layer has a multiplicative z (one per input neuron of a Linear layer, one per
output channel of a Conv2d layer) from an IAF of ``flow_length`` MADE steps
(:class:`bayeswrap.methods.lbbnn.flows.MultiplicativeFlow`); μ̃ becomes μ̃ z in both moments and
in the KL, which gains log q(z) − log r(z | W) with MNF's auxiliary inverse model
(eqs. 9–10, hardtanh). The same z serves the forward pass and the KL of a step
(the paper's script draws a fresh z for the KL).

**KL per weight, closed form** (eq. 8):
α̃ (log σ_p/σ̃ + log α̃/α_p − ½ + (σ̃² + (μ̃ − θ̄)²)/(2σ_p²)) + (1 − α̃) log((1 − α̃)/(1 − α_p)).

**Prediction.** ``predict(x, S, model="full")`` averages over structures and
weights (LRT sampling, or Bernoulli γ draws for weight-sampled layers);
``model="mpm"`` is the median probability model: weights with α̃ > 0.5 only,
w ~ N(μ̃ z, σ̃²). :meth:`LBBNN.density` is the fraction of weights with α̃ > 0.5,
and :meth:`~LBBNN.prune` / :meth:`~LBBNN.to_deterministic` (from
:mod:`bayeswrap.methods.sparsity`) follow the MPM.

σ̃ = softplus(ρ) as in the paper, whose models train with Adam; under plain SGD
a small initial σ̃ moves slowly.

**Defaults, and why they differ from the paper's code.** Adam moves λ and ρ by
about its learning rate per step, so Σ lr over the steps (the *budget*) bounds how
far any λ can travel: with the paper's λ ~ U(−10, 15) at lr 3e-3 for 20 epochs
of mnist5k (Σ lr ≈ 1) the density stayed at the fraction of λ₀ out of reach (0.557),
and the paper's own densities (0.07–0.10 after Σ lr ≈ 8.25 from U(−15, 10)) sit
near that bound too. With a budget large enough for λ to converge, the paper's
slab (ρ₀ = −9, σ̃ ≈ 1e-4, α_p = 0.1) costs ≈ log(σ_p/σ̃) − log α_p ≈ 11 nats per
included weight, which small data sets cannot pay: digits (MLP 64-200-10, Adam
1e-2, 40 epochs) ended at density 0.011 and MPM accuracy 0.91 against MAP's 0.97.
The defaults ρ₀ = −5 (σ̃ ≈ 6.7e-3) and α_p = 0.5 (no prior preference between
in and out) lower that cost while ρ catches up: on the same digits run the MPM is
within 1.3 pp of MAP at density ≈ 0.12 (3 seeds), and on mnist5k
(``scripts/lbbnn_mnist5k.py``, Adam 1e-2, 30 epochs) LBBNN-LRT ends at density
0.118 with the MPM within 0.5 pp of full averaging (``figures/lbbnn_mnist5k.md``).
λ keeps the paper's U(−10, 15): 60 % of the weights start in, and the data move
the density once Σ lr is a few units (a learning rate of 1e-2 and a few hundred
steps). With α_p = 0.5, weights the data do not constrain drift towards α̃ = 0.5,
where the MPM's α̃ > 0.5 keeps about half of them.

**The flows' own step** (``flow_lr``, issue 32). With one Adam learning rate of 1e-2 for every parameter,
LBBNN-FLOW (250-250 MADEs) diverged on mnist5k in 2 of 3 seeds. Per-step traces (seed 1) show where: after
about 230 steps the IAF of the auxiliary model r(z | W) of the output layer (D = 600, O = 10) jumped, its
output z_b going from about 1 to 6–20 within a few steps while z stayed near 1.3 and its gradient norm rising
from 0.03 to 24–63; r's Gaussian term, (z_b − mean_r)² exp(−log σ_r²) with exp(−log σ_r²) up to e⁵, then sent
gradients of 1e8–1e10 into both flows, the KL reached 1e13 nats and z 1e3–1e4. Adam moves every weight of a
dense layer by about its learning rate per step, so a MADE's outputs can move by up to lr times its fan-in (250)
per step, while each λ, ρ and μ̃ moves by lr; the flows therefore get a group of their own in
:meth:`LBBNN.param_groups` at ``flow_lr`` = 1e-3 (the paper trains everything at 1e-4). With it all three
seeds train at Adam 1e-2 (``scripts/lbbnn_mnist5k.py``'s protocol, 30 epochs, S = 100; seeds 0, 1, 2): MPM
accuracy 93.27 / 93.07 / 92.33 %, density 0.128 / 0.128 / 0.138. q(z) also starts at its base mean (its IAF's
shift bias is ``init_mean``, :mod:`~bayeswrap.methods.lbbnn.flows`), so that z starts at 1 as without flows,
not at sigmoid(2)² ≈ 0.78; with both, MPM 93.60 / 93.47 / 93.47 %, full averaging 93.47 / 94.27 / 94.07 %,
density 0.130 / 0.130 / 0.137, against LBBNN-LRT's 93.40 / 93.47 / 92.80 %, 93.87 / 93.53 / 93.00 % and
0.118 / 0.117 / 0.121: FLOW is at least as accurate as LRT in its MPM on every seed, but about 0.012 denser (the
paper's FLOW is the sparsest, on 60,000 images). ``flow_lr`` = 1e-4 (seed 2, zero shift bias) ended at 92.40 %
and 0.132.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bayeswrap.core.checks import check_bool, check_float, check_int
from bayeswrap.core.functional import NamedTensors, is_bias
from bayeswrap.core.layers import lrt_names, lrt_theta
from bayeswrap.methods.base import BayesianModel, register_method
from bayeswrap.methods.lbbnn.flows import MultiplicativeFlow
from bayeswrap.methods.lrt import LocalReparamMixin
from bayeswrap.methods.predictives import MedianModel, Predictive
from bayeswrap.methods.sparsity import PRUNED_RHO, SparsityMixin

#: λ of a weight the MPM keeps / drops after :meth:`LBBNN.prune` (sigmoid(±1e4) is exactly 1 / 0 in float32)
INCLUDED_LOGIT = 1.0e4


@register_method("lbbnn", order=100)
class LBBNN(SparsityMixin, LocalReparamMixin, BayesianModel):
    """A latent binary Bayesian neural network over the Bayesian parameters: spike-and-slab inclusion, optional
    normalizing flows, median-probability-model predictions and pruning (Skaaret-Lund, Storvik & Hubin 2023).

    Takes the arguments of :class:`~bayeswrap.BayesianModel` (``prior_std`` is σ_p)
    plus:

    Args:
        prior_inclusion: α_p, the prior inclusion probability, in (0, 1). Default 0.5 (see the
            module docstring); the paper's two code bases use 0.05–0.10.
        flow_length: IAF steps of the multiplicative flow per LRT layer (integer ≥ 0);
            0 is "LBBNN-LRT", 2 the paper's "LBBNN-FLOW". Needs ``local_reparam=True``.
        local_reparam: sample pre-activations of the Bayesian ``nn.Linear`` /
            ``nn.Conv2d`` layers (True, default) or sample every weight (False).
        init_inclusion_logit: (low, high): λ starts uniform in this range (the
            issue's U(−10, 15)); α̃ = sigmoid(λ).
        init_rho: ρ of σ̃ = softplus(ρ) at the start. Default −5 (σ̃ ≈ 6.7e-3; see the module
            docstring); the paper's code uses −9 (σ̃ ≈ 1.2e-4).
        temperature: τ of the relaxed Bernoulli γ of weight-sampled layers in
            training (Maddison et al. 2017), > 0.
        num_train_samples: Monte Carlo samples per training step (integer ≥ 1).
        flow_hidden: hidden widths of each MADE (default (250, 250), as the paper's code).
        flow_lr: learning rate of the flows' parameters (q(z) and r(z | W)), which :meth:`param_groups` puts
            in a group of their own, ``"posterior/flow"``; a finite number > 0, or ``None`` for the optimizer's
            learning rate. Default 1e-3: at Adam 1e-2 the 250-wide MADEs of r(z | W) diverge (see the module
            docstring). Only optimizers built from :meth:`param_groups` see it.

    Raises:
        ValueError: ``prior_inclusion`` outside (0, 1), a negative or non-integer
            ``flow_length``, ``flow_length > 0`` without ``local_reparam``,
            ``local_reparam=True`` with no Bayesian Linear/Conv2d weight, or a bad
            ``init_inclusion_logit``/``init_rho``/``temperature``/``flow_lr``; besides the errors of
            :class:`~bayeswrap.BayesianModel`.

    Attributes:
        mean, rho: μ̃ and ρ of every Bayesian parameter, ``{name: Parameter}``.
        logit: λ of every weight with an inclusion variable, ``{name: Parameter}``.
        flows: ``{layer path: MultiplicativeFlow}`` (flows only).
    """

    #: AdamW at 0.01, as the LBBNN papers train (Hubin & Storvik 2019; Skaaret-Lund et al. 2023)
    recommended = {"optimizer": "adamw", "lr": 0.01}
    default_sparsity_rule = "inclusion"

    def __init__(self, model, *, prior_inclusion: float = 0.5, flow_length: int = 0, local_reparam: bool = True,
                 init_inclusion_logit: tuple[float, float] = (-10.0, 15.0), init_rho: float = -5.0,
                 temperature: float = 0.5, num_train_samples: int = 1, flow_hidden: tuple[int, ...] = (250, 250),
                 flow_lr: float | None = 1e-3, **kwargs):
        self.prior_inclusion = check_float("prior_inclusion", prior_inclusion, low=0.0, high=1.0, low_open=True,
                                           high_open=True, note="α_p, the prior inclusion probability")
        self.flow_length = check_int("flow_length", flow_length, minimum=0, note="IAF steps per layer")
        if not isinstance(local_reparam, bool):
            raise ValueError(f"local_reparam={local_reparam!r} is not accepted; accepted: True, False")
        if self.flow_length and not local_reparam:
            raise ValueError(f"flow_length={flow_length} needs local_reparam=True (the flow multiplies the "
                             f"pre-activation moments); accepted: flow_length=0 with local_reparam=False")
        if not (isinstance(init_inclusion_logit, (tuple, list)) and len(init_inclusion_logit) == 2):
            raise ValueError(f"init_inclusion_logit={init_inclusion_logit!r} is not accepted; accepted: a pair "
                             f"(low, high) of finite numbers, low <= high")
        low = check_float("init_inclusion_logit[0]", init_inclusion_logit[0])
        high = check_float("init_inclusion_logit[1]", init_inclusion_logit[1], low=low)
        self.init_inclusion_logit = (low, high)
        self.init_rho = check_float("init_rho", init_rho, low=-80.0, high=80.0)
        self.temperature = check_float("temperature", temperature, low=0.0, low_open=True)
        self.num_train_samples = check_int("num_train_samples", num_train_samples, minimum=1)
        self.flow_hidden = tuple(check_int("flow_hidden", h, minimum=1) for h in flow_hidden)
        self.flow_lr = check_float("flow_lr", flow_lr, low=0.0, low_open=True, allow_none=True,
                                   note="the learning rate of the flows' parameter group")
        self.local_reparam = check_bool("local_reparam", local_reparam)
        super().__init__(model, **kwargs)
        self._lrt_set: set[str] = set()
        if local_reparam:
            self.enable_local_reparam()
            self._lrt_set = lrt_names(self._lrt)
        self.flows = torch.nn.ModuleDict()
        if self.flow_length:

            for i, layer in enumerate(self._lrt):
                dim = layer.weight_shape[1] if layer.kind == "linear" else layer.weight_shape[0]
                self.flows[layer.path.replace(".", "/")] = MultiplicativeFlow(
                    dim, self.flow_length, hidden_sizes=self.flow_hidden, seed=2 * self.flow_length * i)

    # ------------------------------------------------------------------ optimizer groups
    def param_groups(self, head=(), lr_head=None) -> list[dict]:
        """The groups of :meth:`BayesianModel.param_groups`, with the flows' parameters in a group of their own.

        With flows (``flow_length > 0``) every parameter of ``flows`` (μ₀, log σ₀², the MADEs of q(z) and of
        r(z | W), c, b₁, b₂) moves from ``"posterior"`` to a group ``"posterior/flow"`` placed right after it,
        with ``weight_decay=0.0`` (the flows have no prior) and ``lr=flow_lr`` (no ``"lr"`` key where
        ``flow_lr`` is ``None``: the optimizer's). Without flows the groups are the base's.

        Raises:
            ValueError: as :func:`bayeswrap.methods.param_groups.param_groups` (a bad ``head`` or ``lr_head``).
        """
        groups = super().param_groups(head, lr_head)
        flow_params = list(self.flows.parameters())
        if not flow_params:
            return groups
        ids = {id(p) for p in flow_params}
        flow = {"params": flow_params, "name": "posterior/flow", "weight_decay": 0.0}
        if self.flow_lr is not None:
            flow["lr"] = self.flow_lr
        out = []
        for group in groups:
            kept = [p for p in group["params"] if id(p) not in ids]
            if kept:
                out.append({**group, "params": kept})
            if flow is not None and len(kept) < len(group["params"]):  # the group the flows were in
                out.append(flow)
                flow = None
        return out

    # ------------------------------------------------------------------ posterior parameters
    def _init_posterior(self, init):
        self.mean = NamedTensors(init, trainable=True)
        self.rho = NamedTensors({n: torch.full_like(t, self.init_rho) for n, t in init.items()}, trainable=True)
        low, high = self.init_inclusion_logit
        self.logit = NamedTensors({n: torch.empty_like(t).uniform_(low, high) for n, t in init.items()
                                   if not is_bias(n)}, trainable=True)

    def inclusion_probs(self) -> dict[str, torch.Tensor]:
        """α̃ = sigmoid(λ) of every weight with an inclusion variable, ``{name: tensor of its shape}``."""
        return {n: torch.sigmoid(t) for n, t in self.logit.items()}

    def density(self, threshold: float = 0.5) -> float:
        """The fraction of weights (with an inclusion variable) whose α̃ exceeds ``threshold`` (the MPM's density).

        Raises:
            ValueError: for a threshold outside [0, 1).
        """
        t = check_float("threshold", threshold, low=0.0, high=1.0, high_open=True)
        with torch.no_grad():
            kept = sum(int((torch.sigmoid(lam) > t).sum()) for lam in self.logit.values())
            total = sum(lam.numel() for lam in self.logit.values())
        return kept / total if total else 1.0

    def _sigma(self) -> dict[str, torch.Tensor]:
        return {n: F.softplus(r) for n, r in self.rho.items()}

    # ------------------------------------------------------------------ flows
    def _z(self, sample: bool, num_samples: int | None = None, generator: torch.Generator | None = None
           ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``{layer path: z}`` (a flow sample, S stacked samples, or the flow at the base mean) and Σ log q(z)."""
        zs, log_q = {}, None
        for layer in self._lrt if self.flow_length else ():
            flow = self.flows[layer.path.replace(".", "/")]
            if sample:
                z, lq = flow.sample(num_samples, generator)
                log_q = lq if log_q is None else log_q + lq
            else:
                z = flow.q_flow(flow.mu0)[0]
            zs[layer.path] = z
        return zs, log_q

    def _scaled_means(self, zs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """μ̃, with μ̃ z for the weights of flow layers (z per input neuron / output channel; z may be (S, D))."""
        means = self.mean.as_dict()
        for layer in self._lrt if zs else ():
            z = zs[layer.path]
            shape = (1, -1) if layer.kind == "linear" else (-1, 1, 1, 1)
            means[layer.weight] = means[layer.weight] * z.reshape(*z.shape[:-1], *shape)
        return means

    # ------------------------------------------------------------------ training
    def _moments(self, means, sigma, alpha) -> tuple[dict, dict]:
        """Mean and variance of the LRT layers' weights (α μ, α(σ² + (1 − α) μ²)) and Bayesian biases."""
        mean, var = {}, {}
        for n in self._lrt_set:
            if n in alpha:
                a = alpha[n]
                mean[n] = a * means[n]
                var[n] = a * (sigma[n].square() + (1 - a) * means[n].square())
            else:
                mean[n], var[n] = means[n], sigma[n].square()
        return mean, var

    def _whole(self, means, sigma, gamma) -> dict[str, torch.Tensor]:
        """Weight samples γ (μ + σ ε) of the parameters outside the LRT layers (γ = 1 for biases)."""
        out = {}
        for n, m in means.items():
            if n in self._lrt_set:
                continue
            w = m + sigma[n] * torch.randn_like(m)
            out[n] = w * gamma[n] if n in gamma else w
        return out

    def _relaxed_gamma(self) -> dict[str, torch.Tensor]:
        """Relaxed Bernoulli γ = sigmoid((λ + log u − log(1 − u))/τ) of the weight-sampled weights."""
        out = {}
        for n, lam in self.logit.items():
            if n in self._lrt_set:
                continue
            u = torch.rand_like(lam).clamp(1e-6, 1 - 1e-6)
            out[n] = torch.sigmoid((lam + torch.log(u) - torch.log1p(-u)) / self.temperature)
        return out

    def _train_theta(self):
        zs, log_q = self._z(sample=True)
        means, sigma, alpha = self._scaled_means(zs), self._sigma(), self.inclusion_probs()
        mean, var = self._moments(means, sigma, alpha)
        theta = lrt_theta(self._lrt, mean, var, self._whole(means, sigma, self._relaxed_gamma()))
        return theta, zs, log_q, means, sigma, alpha, mean, var

    def _train_sample(self):
        return self._train_theta()[0]

    def _sample_and_regularizer(self):
        theta, zs, log_q, means, sigma, alpha, mean, var = self._train_theta()
        kl = self._kl(means, sigma, alpha)
        if zs:
            log_r = sum(self.flows[layer.path.replace(".", "/")].log_r(zs[layer.path], *self._r_inputs(layer, mean, var))
                        for layer in self._lrt)
            kl = kl + log_q - log_r
        return theta, kl

    @staticmethod
    def _r_inputs(layer, mean, var):
        """The layer's weight moments as (z_dim, O) matrices for r(z | W)."""
        m, v = mean[layer.weight], var[layer.weight]
        if layer.kind == "linear":
            return m.t(), v.t()
        return m.reshape(m.shape[0], -1), v.reshape(v.shape[0], -1)

    def _kl(self, means, sigma, alpha) -> torch.Tensor:
        """Σ of the closed-form KL per weight (eq. 8) and the Gaussian KL of the biases, in nats."""
        total = None
        sp, ap = self.prior_std, self.prior_inclusion
        for n, m in means.items():
            if not self.prior.applies_to(n):
                continue
            s = sigma[n]
            gauss = math.log(sp) - torch.log(s) - 0.5 + (s.square() + (m - self.prior.mean[n]).square()) / (2 * sp**2)
            if n in alpha:
                a = alpha[n]
                lam = self.logit[n]
                log_a, log_1ma = F.logsigmoid(lam), F.logsigmoid(-lam)
                included = a * (gauss + log_a - math.log(ap))
                term = torch.where(a > 0, included, torch.zeros_like(included)) \
                    + (1 - a) * (log_1ma - math.log1p(-ap))  # a pruned weight (α̃ = 0, σ̃ = 0) adds no slab term
            else:
                term = gauss
            term = term.sum()
            total = term if total is None else total + term
        return total if total is not None else torch.zeros((), device=self.mean.values()[0].device)

    def regularizer(self) -> torch.Tensor:
        """KL(q || p) in nats: eq. 8 per weight, Gaussian for biases, and log q(z) − log r(z | W) with flows
        (a one-sample estimate with a fresh z).
        """
        return self._sample_and_regularizer()[1]

    # ------------------------------------------------------------------ posterior summaries
    def posterior_mean(self) -> dict[str, torch.Tensor]:
        """E_q[w] = α̃ μ̃ z̄ (z̄: the flow at its base mean; 1 without flows), μ̃ for biases."""
        zs, _ = self._z(sample=False)
        means, alpha = self._scaled_means(zs), self.inclusion_probs()
        return {n: alpha[n] * m if n in alpha else m for n, m in means.items()}

    def mpm_mean(self) -> dict[str, torch.Tensor]:
        """The median probability model's weights: μ̃ z̄ where α̃ > 0.5, else 0; μ̃ for biases."""
        zs, _ = self._z(sample=False)
        means, alpha = self._scaled_means(zs), self.inclusion_probs()
        return {n: (alpha[n] > 0.5).to(m.dtype) * m if n in alpha else m for n, m in means.items()}

    def _deterministic_mean(self) -> dict[str, torch.Tensor]:
        return self.mpm_mean()

    def posterior_std(self) -> dict[str, torch.Tensor]:
        """Marginal std of q(w): sqrt(α̃(σ̃² + (1 − α̃) μ̃² z̄²)), σ̃ for biases."""
        zs, _ = self._z(sample=False)
        means, sigma, alpha = self._scaled_means(zs), self._sigma(), self.inclusion_probs()
        return {n: torch.sqrt(alpha[n] * (sigma[n].square() + (1 - alpha[n]) * m.square())) if n in alpha
                else sigma[n] for n, m in means.items()}

    # ------------------------------------------------------------------ predictive samples
    def _draw(self, num_samples: int, generator, mpm: bool = False) -> dict[str, torch.Tensor]:
        """S stacked draws: LRT-layer moments (with a z per draw) and whole-weight samples of the rest.

        The full model: moments of the LRT layers, γ (μ̃ + σ̃ ε) with γ ~ Bernoulli(α̃) elsewhere; ``mpm=True``:
        the median probability model's (γ = 1 where α̃ > 0.5, else 0; :class:`MedianModel`).
        """
        sigma, alpha = self._sigma(), self.inclusion_probs()
        if mpm:
            alpha = {n: (a > 0.5).to(a.dtype) for n, a in alpha.items()}
        zs, _ = self._z(sample=True, num_samples=num_samples, generator=generator)  # the S flow draws, one batch
        mean, var = self._moments(self._scaled_means(zs), sigma, alpha)
        mean = {n: t.expand(num_samples, *self.mean[n].shape) for n, t in mean.items()}  # shared moments: no copy
        var = {n: t.expand(num_samples, *self.mean[n].shape) for n, t in var.items()}
        whole = {}
        for n, m in self.mean.items():
            if n in self._lrt_set:
                continue
            eps = torch.randn((num_samples, *m.shape), generator=generator, device=m.device, dtype=m.dtype)
            w = m + sigma[n] * eps
            if n in alpha:
                p = alpha[n].expand(num_samples, *m.shape)
                w = w * (p if mpm else torch.bernoulli(p, generator=generator))
            whole[n] = w
        return lrt_theta(self._lrt, mean, var, whole)

    def default_predictive(self, model: str = "full", **options) -> Predictive:
        """:class:`Sampled` for the full model; ``model="mpm"``: :class:`MedianModel`, the median probability model.

        Raises:
            ValueError: on a ``model`` other than ``"full"`` and ``"mpm"``.
            TypeError: on any other option.
        """
        if model not in ("full", "mpm"):
            raise ValueError(f"model={model!r} is not accepted by method {self.method!r}; accepted: 'full', 'mpm'")
        default = super().default_predictive(model="full", **options)  # refuses other options
        return MedianModel() if model == "mpm" else default

    # ------------------------------------------------------------------ pruning (the MPM)
    def _apply_prune(self, masks: dict[str, torch.Tensor]) -> None:
        """Pruned weights: μ̃ = 0, σ̃ = 0, α̃ = 0; every other weight with an inclusion variable gets α̃ = 1,
        so that the full model becomes the MPM.
        """
        for n, m in masks.items():
            self.mean[n].data.masked_fill_(m, 0.0)
            self.rho[n].data.masked_fill_(m, PRUNED_RHO)
            if n in self.logit:
                lam = self.logit[n].data
                lam.copy_(torch.where(m, torch.full_like(lam, -INCLUDED_LOGIT), torch.full_like(lam, INCLUDED_LOGIT)))
