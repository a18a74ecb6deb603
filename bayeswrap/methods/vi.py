"""Mean-field Gaussian variational inference, Bayes-by-backprop (BayesDLL §2.1).

q(θ) = N(m, diag(s²)). The loss is the negative ELBO per datum (eq. 6):

    L(m, ρ) = (1/S) Σ_s NLL(y | x, m + s ⊙ ε_s) + kl_weight · KL(q || p) / N,

with ε_s ~ N(0, I) (the reparameterisation trick) and the analytic Gaussian KL
(eq. 7).

**The std parameterisation** log s = log σ + κρ, or, from a start far below the
prior std (``std_knee``, :data:`AUTO_KNEE_NATS`), log s = log σ + b sinh(κρ/b) (σ = prior_std, b =
:data:`LOG_STD_KNEE` = 2 nats, continued linearly with slope κ M, M =
:data:`bayeswrap.core.fused.LOG_STD_MAX_SLOPE` = 5, beyond b sinh(acosh M) ≈ 9.8
nats from log σ), with κ = sqrt(c · N / (2 · kl_weight)), c = :data:`LOG_STD_CURVATURE`
= 0.1, is chosen so that the variances train at the learning rate that trains the
means, under SGD (with momentum) and Adam/AdamW alike, from any start:

* With the usual s = softplus(ρ) started at s₀ = 1e-3, ∂L/∂ρ ≈ s ∂L/∂s, and the
  entropy term's pull −kl_weight/(N s) makes ∂L/∂ρ ≈ −kl_weight/N: under SGD at
  lr 1e-2 and N = 10³, ρ moves by 1e-5 per step, so every s stays at s₀; Adam
  moves log s by about lr per step, so s grows by e^{lr · steps}. Either way the
  "posterior" is the initial jitter.
* In u = log s the per-datum objective is L = E[NLL] + (w/N)[s²/(2σ²) − log s + …]
  (w = kl_weight), whose curvature at the mean-field optimum s*² = w / P_ii
  (P_ii = N E_q[∂²NLL/∂θ_i²] + w/σ²) is ∂²L/∂u² = 2w/N, and whose slope below
  the optimum is ∂L/∂u = (w/N)(s²/s*² − 1). With κ² = c N/(2w) and slope du/dρ = κ
  cosh(κρ/b) = κ sqrt(1 + (D/b)²) at D = log σ − u nats below σ, SGD moves log s by
  c · lr · (1 + (D/b)²) · (1 − s²/s*²)/2 per step (÷ (1 − momentum) with momentum):
  a step of the (natural-gradient) kind that does not vanish as s → 0, and
  independent of N and w. Near σ (D ≪ b) this is the map log s = log σ + κρ with
  curvature c at the optimum; c = 1 would match the unit curvature of well-scaled
  means, and c = 0.1 keeps the velocity that momentum 0.9 builds up while s grows
  small enough not to overshoot s* (at c = 1 and lr 0.05 the digits MLP's stds
  overshot ~10× and diverged).
* **The start.** With the linear map (b = ∞) log s moved by at most c · lr/2 per
  step below s*: from BayesDLL's s₀ = 1e-6 (Table 2: SGD lr 1e-2, momentum 0.5) the
  ~10 nats to s* took ~10⁴ steps, and their 480 steps moved s from 1e-6 to 1.6e-6.
  The slope's growth with D makes the climb ~(D/b)² times faster (up to M² = 25
  times, beyond ~10 nats), so the time to reach s* is bounded by about
  π b / (c · lr) steps (÷ (1 − momentum)) whatever s₀: on Bayesian linear
  regression every s reaches s* within 10% from s₀ = 1e-6 in ~1,100–2,000 such
  steps (``tests/test_vi_convergence.py``). The price is a larger curvature c (1 +
  (D*/b)²) at optima D* far below σ (c · 5 at D* = 4), i.e. a noisier s at a
  constant learning rate; the slope's cap M bounds the step far below. At a large
  κ (small kl_weight) and step the faster climb also destabilises: the digits MLP
  (N = 504) at kl_weight 1e-3 (κ ≈ 160), prior_std 1.05, SGD lr 0.05 with momentum
  0.9 ends at chance (validation NLL 2.08) where the linear map ends at 0.49 (itself
  unstable: 1.24 after 90 epochs); caps M = 2 or 3, or a linear map down to 3 nats
  below σ, did not prevent it. ``bayeswrap compare``'s tuning scores such a
  candidate as it trains and picks another kl_weight. Adam moves ρ by about lr per
  step, so log s by κ cosh(κρ/b) · lr.
* Fixed points are unchanged (a reparameterisation only, du/dρ > 0), and the KL
  term is Σ(log σ − u(ρ) + …) with no log of a vanishing softplus.
* After every optimizer step s is projected onto s ≤ σ (ρ ≤ 0) for parameters with
  a prior: the mean-field optimum always satisfies s*² = w/P_ii = w/(N h + w/σ²)
  ≤ σ² (h ≥ 0), so the projection never excludes it, and it stops a too-large
  step from blowing the network up. (Until issue 32 the bound was sqrt(w) σ,
  which for w < 1 excluded the optimum of every parameter with N h < (1 − w)/σ²,
  e.g. one the data do not constrain, whose optimum is σ.)

Checkpoints record the map (``std_parameterisation`` 2 in the extra state); a
state without it (log s = κρ) is converted on loading.

This is a reparameterisation rather than a separate optimizer or learning rate,
so any ``torch.optim`` optimizer over ``bnn.parameters()`` (or
``bnn.param_groups()``) trains both parts. ``tests/test_vi_convergence.py``
checks that every s reaches 1/sqrt(P_ii) within 10% on Bayesian linear
regression with minibatch SGD (momentum 0.9) and with AdamW in 100 epochs.

Reference: Blundell et al. 2015, "Weight Uncertainty in Neural Networks";
the log-std curvature argument follows the natural-gradient view of Khan et al.
2018, "Fast and Scalable Bayesian Deep Learning by Weight-Perturbation in Adam".
"""

from __future__ import annotations

import math

import torch

from bayeswrap.core import fused
from bayeswrap.core.checks import check_bool
from bayeswrap.core.functional import NamedTensors, _mangle
from bayeswrap.core.fused import mean_field_sample, standard_normal_like
from bayeswrap.core.layers import lrt_names, lrt_theta
from bayeswrap.methods.base import BayesianModel, check_int, check_scale, register_method
from bayeswrap.methods.lrt import LocalReparamMixin
from bayeswrap.methods.sparsity import SparsityMixin

#: c, the curvature of the per-datum ELBO in ρ at the mean-field optimum near the reference (module docstring)
LOG_STD_CURVATURE = 0.1
#: b, the knee of the map log s = log σ + b sinh(κρ/b) in nats (see the module docstring)
LOG_STD_KNEE = 2.0
#: ``std_knee="auto"`` uses the knee only for a start this many nats or more below the prior std (s₀ ≤ σ e⁻⁹ ≈
#: 1.2e-4 σ, e.g. BayesDLL's s₀ = 1e-6): from nearer starts (the default s₀ = 1e-3 at σ = 1 is 6.9 nats below) the
#: linear map log s = log σ + κρ reaches the optimum in the budget, and the knee's faster climb made mean-field VI
#: at kl_weight 1 unstable under SGD (lr 0.1, momentum 0.9) and AdamW (lr 1e-2) on the digits MLP
AUTO_KNEE_NATS = 9.0
#: the version of the std parameterisation in VI's checkpoints: 1 (no entry) is log s = κρ, 2 the sinh map
STD_PARAMETERISATION = 2


def log_std_scale(num_data: int, kl_weight: float) -> float:
    """κ = sqrt(c N / (2 w)) of VI's std parameterisation s = exp(κ ρ) (w = kl_weight; w = 0 counts as 1)."""
    return math.sqrt(LOG_STD_CURVATURE * num_data / (2.0 * (kl_weight if kl_weight > 0 else 1.0)))


@register_method("vi", order=20)
class VI(SparsityMixin, LocalReparamMixin, BayesianModel):  # + sparsity/prune/prune_random/to_deterministic (bayeswrap.methods.sparsity)
    """Mean-field Gaussian VI over the Bayesian parameters (Bayes-by-backprop, Blundell et al. 2015), analytic KL.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        init_std: initial posterior std s₀ in [1e-18, 1e18], in parameter units. The
            means m start at the model's weights (= θ̄ for ``prior_mean="init"``).
            BayesDLL starts at s = 1e-6 with a clamped direct parameterisation;
            from such a start (``std_knee="auto"``: 9 nats or more below the prior std)
            log s climbs at a rate that grows with its distance below the prior std
            (see the module docstring), so that s reaches the optimum from 1e-6 in a
            few thousand SGD steps at lr 1e-2 (momentum 0.5), where the linear map
            needed ~10⁴; the start still costs those steps, so an s₀ near the optimum
            trains fastest.
        num_train_samples: Monte Carlo samples of θ per training step (integer ≥ 1).
        fused: draw the sample and the KL with the fused multi-tensor kernel
            and closed-form gradients (:func:`bayeswrap.core.fused.mean_field_sample`);
            False uses the plain autograd reference. Same values and gradients.
        local_reparam: sample the pre-activations of every ``nn.Linear`` / ``nn.Conv2d``
            whose weight is Bayesian instead of its weights (the local
            reparameterisation trick, Kingma, Salimans & Welling 2015, §2.3; see
            :mod:`bayeswrap.core.layers`): the same predictive distribution per example,
            with lower-variance gradients. Other Bayesian parameters (and layer
            types without LRT support) keep weight sampling.
        std_knee: b of the std map log s = log σ + b sinh(κρ/b) in nats (a number > 0),
            None for the linear map log s = log σ + κρ, or ``"auto"`` (default):
            :data:`LOG_STD_KNEE` when ``init_std`` is :data:`AUTO_KNEE_NATS` = 9 nats or
            more below the prior std, else linear. The knee's faster climb made VI at
            kl_weight 1 unstable on the digits MLP (SGD lr 0.1 with momentum 0.9, AdamW
            lr 1e-2) from the default s₀ = 1e-3, so it is kept for far starts only.

    Raises:
        ValueError: for ``init_std`` outside [1e-18, 1e18] (float32 must hold s₀², 1/s₀² and
            log s₀), ``num_train_samples`` not an integer ≥ 1, or ``local_reparam=True``
            with no Bayesian ``nn.Linear``/``nn.Conv2d`` weight, besides the errors of
            :class:`~bayeswrap.BayesianModel`.

    Attributes:
        mean: variational means m, ``{name: Parameter}``.
        rho: the std parameters ρ, log s = log σ + b sinh(κρ/b) (ρ = 0 at s = σ), ``{name: Parameter}``.
        log_std_scale: κ = sqrt(c num_data / (2 kl_weight)), fixed at construction.
        log_std_ref: log σ (the prior std at construction), fixed at construction.
        log_std_knee: b = :data:`LOG_STD_KNEE` nats.
    """

    tuning = ("kl_weight", (1e-4, 1e-3, 1e-2, 0.1, 1.0))  # the tempering of the KL term (BayesDLL's kld)
    #: kl_weight w is tuned at prior_std = σ √w: the pull on the means (w/prior_std²)(m − θ̄)/N stays MAP's
    knob_tempers_posterior = True
    in_default_comparison = True

    def __init__(self, model, *, init_std: float = 1e-3, num_train_samples: int = 1, fused: bool = True,
                 local_reparam: bool = False, std_knee: float | str | None = "auto", **kwargs):
        self.init_std = check_scale("init_std", init_std)
        if not (std_knee in ("auto", None) or (isinstance(std_knee, (int, float)) and not isinstance(std_knee, bool)
                                                and math.isfinite(std_knee) and std_knee > 0)):
            raise ValueError(f"std_knee={std_knee!r} is not accepted; accepted: 'auto', None (the linear map "
                             "log s = log σ + κρ) or a number of nats > 0")
        self.std_knee = std_knee
        self.fused = check_bool("fused", fused)
        self.num_train_samples = check_int("num_train_samples", num_train_samples, minimum=1)
        if not isinstance(local_reparam, bool):
            raise ValueError(f"local_reparam={local_reparam!r} is not accepted; accepted: True, False")
        super().__init__(model, **kwargs)
        self.local_reparam = local_reparam
        if local_reparam:
            self.enable_local_reparam()
            self._lrt_set = lrt_names(self._lrt)

    def _init_posterior(self, init):
        self.log_std_scale = log_std_scale(self.num_data, self.kl_weight)
        self.log_std_ref = math.log(self.prior_std)
        if self.std_knee == "auto":  # the knee only for a start far below the prior std (AUTO_KNEE_NATS)
            far = self.prior_std is not None and math.log(self.prior_std / self.init_std) >= AUTO_KNEE_NATS
            self.log_std_knee = LOG_STD_KNEE if far else None
        else:
            self.log_std_knee = None if self.std_knee is None else float(self.std_knee)
        self.mean = NamedTensors(init, trainable=True)
        rho0 = self._rho_of(math.log(self.init_std))
        self.rho = NamedTensors({n: torch.full_like(t, rho0) for n, t in init.items()}, trainable=True)

    def _rho_of(self, log_s):
        """ρ whose std is exp(``log_s``) (a float, or a tensor elementwise)."""
        return fused.log_std_inverse(log_s, self.log_std_scale, self.log_std_ref, self.log_std_knee)

    def _std_of(self, rho: torch.Tensor) -> torch.Tensor:
        """S = exp(log σ + b sinh(κρ/b)) (see the module docstring)."""
        return torch.exp(fused.log_std(rho, self.log_std_scale, self.log_std_ref, self.log_std_knee))

    def _lrt_theta(self, num_samples: int | None = None, generator=None) -> dict[str, torch.Tensor]:
        """Moments (m, s²) of the LRT layers and weight samples of every other Bayesian parameter.

        With ``num_samples`` the moments are expanded (no copy) to a leading S axis
        and the other parameters get S draws.
        """
        mean, std = self.posterior_mean(), self.posterior_std()
        var = {n: std[n].square() for n in self._lrt_set}
        others = {n: m for n, m in mean.items() if n not in self._lrt_set}
        if num_samples is None:
            sampled = {n: m + std[n] * torch.randn_like(m) for n, m in others.items()}
            return lrt_theta(self._lrt, mean, var, sampled)
        sampled = {n: m + std[n] * torch.randn((num_samples, *m.shape), generator=generator, device=m.device,
                                               dtype=m.dtype) for n, m in others.items()}
        expand = {n: t.expand(num_samples, *t.shape) for n, t in mean.items() if n in self._lrt_set}
        return lrt_theta(self._lrt, expand, {n: t.expand(num_samples, *t.shape) for n, t in var.items()}, sampled)

    def _draw(self, num_samples: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """S draws of θ; under local reparameterisation, the LRT layers' moments instead of their weights."""
        if not self.local_reparam:
            return super()._draw(num_samples, generator)
        return self._lrt_theta(num_samples, generator)

    def _train_sample(self):
        if self.local_reparam:
            return self._lrt_theta()
        means = self.mean.values()
        eps = standard_normal_like(means)
        std = self.posterior_std()
        return {n: m + std[n] * e for n, m, e in zip(self.mean.keys(), means, eps)}

    def _sample_and_regularizer(self):
        if not self.fused or self.local_reparam or not fused.available():
            return super()._sample_and_regularizer()
        names = self.mean.keys()
        prior_idx = [i for i, n in enumerate(names) if self.prior.applies_to(n)]
        theta, kl = mean_field_sample(self.mean.values(), self.rho.values(), prior_idx,
                                      [self.prior.mean[names[i]] for i in prior_idx], self.prior_std,
                                      self.log_std_scale, log_std_ref=self.log_std_ref,
                                      log_std_knee=self.log_std_knee)
        return dict(zip(names, theta)), kl

    @torch.no_grad()
    def after_step(self) -> None:
        """Projects s ≤ prior_std for parameters with a prior (see the module docstring)."""
        super().after_step()
        if self.prior_std is None or self.kl_weight <= 0:
            return
        cap = self._rho_of(math.log(self.prior_std))
        capped = [r for n, r in self.rho.items() if self.prior.applies_to(n)]
        if capped:
            torch._foreach_clamp_max_(capped, cap)

    def regularizer(self) -> torch.Tensor:
        """Analytic KL(N(m, s²) || N(θ̄, σ²)) in nats (BayesDLL eq. 7)."""
        return self.prior.kl(self.mean.as_dict(), self.posterior_std())

    def posterior_mean(self):
        """m, ``{name: tensor}``."""
        return self.mean.as_dict()

    def posterior_std(self):
        """S = exp(log σ + b sinh(κρ/b)), ``{name: tensor}``.

        In eval mode without autograd (predictions) the result is cached until ρ
        changes (tracked by the tensors' version counters), so repeated
        ``predict`` calls skip one pass over the parameters; ``train()`` drops
        the cache.
        """
        if self.training or torch.is_grad_enabled():
            return {n: self._std_of(r) for n, r in self.rho.items()}
        key = (self.log_std_scale, self.log_std_ref, self.log_std_knee,
               tuple((r.data_ptr(), r._version) for r in self.rho.values()))
        cached = self.__dict__.get("_std_cache")
        if cached is None or cached[0] != key:
            cached = (key, {n: self._std_of(r) for n, r in self.rho.items()})
            self.__dict__["_std_cache"] = cached
        return cached[1]

    def train(self, mode: bool = True):
        self.__dict__.pop("_std_cache", None)
        return super().train(mode)

    def get_extra_state(self):
        return {**super().get_extra_state(), "std_parameterisation": STD_PARAMETERISATION}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Loads checkpoints of the earlier parameterisation log s = κρ (no ``std_parameterisation`` entry).

        Their ρ is converted to this map's ρ for the same stds (κ is the same: it depends on
        ``num_data`` and ``kl_weight`` only). ``load_state_dict`` works on its own copy of the mapping.

        Raises:
            ValueError: for a ``std_parameterisation`` this version does not know (a newer checkpoint).
        """
        extra = state_dict.get(f"{prefix}_extra_state")
        version = extra.get("std_parameterisation", 1) if isinstance(extra, dict) else STD_PARAMETERISATION
        if version not in (1, STD_PARAMETERISATION):
            raise ValueError(f"checkpoint has VI std_parameterisation={version!r}, which this bayeswrap does not "
                             f"know; accepted: 1 (log s = κρ) or {STD_PARAMETERISATION} (the sinh map)")
        if version == 1:
            for name in self.rho.keys():
                key = f"{prefix}rho.{_mangle(name)}"
                if torch.is_tensor(state_dict.get(key)):
                    log_s = state_dict[key].to(torch.float64) * self.log_std_scale
                    state_dict[key] = self._rho_of(log_s).to(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
