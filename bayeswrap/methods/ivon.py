"""IVON: mean-field Gaussian variational learning at Adam's cost (Shen et al. 2024).

q(θ) = N(m, σ²) with σ = 1/sqrt(λ (h + δ)), where h is an online estimate of the
diagonal of the per-datum Hessian of the NLL. Training draws θ = m + σ ⊙ ε
(ε ~ N(0, I)) for each forward; :class:`bayeswrap.optim.IVON` then updates m and h
from the gradient at θ (Algorithm 1). Unlike VI there is no σ parameter and no
KL gradient: the prior acts through δ in the optimizer.

bayeswrap's loss is per datum, NLL_mean + kl_weight · KL / N, so with the prior
N(θ̄, prior_std²) the paper's effective sample size and weight decay are

    λ = N / kl_weight,    δ = kl_weight / (N · prior_std²)    (λδ = 1/prior_std²),

and weight decay pulls m towards θ̄ (the pretrained weights by default), not 0.
For a quadratic NLL the fixed point is h = diag of the per-datum Hessian, i.e.
σ² = 1 / diag(posterior precision) (the mean-field optimum) and m = the exact
posterior mean.

Reference: Shen et al. 2024, "Variational Learning is Effective for Large Deep
Networks" (ICML), Algorithm 1; official implementation: the ``ivon-opt`` package.
"""

from __future__ import annotations

import torch

from bayeswrap import optim as bw_optim
from bayeswrap.core.functional import NamedTensors
from bayeswrap.core.fused import standard_normal_like
from bayeswrap.methods.base import BayesianModel, check_float, register_method

FLOAT32_MAX = torch.finfo(torch.float32).max


@register_method("ivon", order=30)
class IVON(BayesianModel):
    """IVON, variational online Newton at Adam's cost (Shen et al. 2024); train it with ``bw.optim.IVON``.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` (``kl_weight > 0``,
    ``bias="informative"`` only) plus:

    Args:
        hess_init: h₀ > 0, the initial Hessian estimate (per datum, in
            loss units per parameter unit²; the official package's default 1.0).
            Before any step the posterior already exists, with
            σ = 1/sqrt(N h₀ / kl_weight + 1/prior_std²).

    Attributes:
        mean: variational means m, ``{name: Parameter}``, initialised at the model's weights.
        hess: Hessian estimates h, ``{name: buffer}`` (saved by ``state_dict``).

    Example:
        >>> bnn = bw.wrap(model, "ivon", num_data=len(train_set), prior_std=1.0)
        >>> opt = bw.optim.IVON(bnn.param_groups(), lr=0.1, beta2=0.9999)
        >>> bw.fit(bnn, train_loader, epochs=10, optimizer=opt)

    Raises:
        ValueError: if ``hess_init`` is not a finite number > 0 (or so large that the
            initial precision λ(h₀ + δ) overflows float32), ``kl_weight`` is 0 or
            ``bias`` is not ``"informative"``.

    Notes:
        One Monte Carlo sample per step (Algorithm 1 with one sample). λ and δ
        are read from ``kl_weight`` at every draw and step, so a
        :func:`bayeswrap.fit` ``kl_schedule`` (which changes ``kl_weight``
        during the loss only) would temper the draw but not the step: do not
        use one with IVON.
    """

    required_optimizer = bw_optim.IVON
    bias_options = ("informative",)
    tuning = ("kl_weight", (1e-4, 1e-3, 1e-2, 0.1, 1.0))
    #: kl_weight w is tuned at prior_std = σ √w: δ = w/(N prior_std²) = 1/(N σ²) is MAP's pull at every w
    knob_tempers_posterior = True
    #: IVON's lr scales an averaged gradient with no momentum sum; chosen on digits' validation NLL
    recommended = {"lr": 0.5}
    in_default_comparison = True

    def __init__(self, model, *, hess_init: float = 1.0, **kwargs):
        self.hess_init = check_float("hess_init", hess_init, low=0.0, high=FLOAT32_MAX, low_open=True,
                                     note="float32 must hold h₀")
        super().__init__(model, **kwargs)
        if self.kl_weight == 0:
            raise ValueError("kl_weight=0 is not accepted by method 'ivon' (λ = num_data / kl_weight); "
                             "accepted: kl_weight > 0")
        precision = self.ess * (self.hess_init + self.weight_decay)  # λ(h₀ + δ) = 1/σ₀², held in float32
        if not precision <= FLOAT32_MAX:
            largest = FLOAT32_MAX / self.ess - self.weight_decay
            raise ValueError(f"hess_init={hess_init!r} gives an initial posterior precision λ(h₀ + δ) = "
                             f"{precision:.3g} (num_data={self.num_data}, kl_weight={self.kl_weight:g}) that float32 "
                             f"cannot hold; accepted: hess_init in (0, {largest:.3g}]")
        self._perturbation: dict[str, torch.Tensor] = {}

    def _init_posterior(self, init):
        self.mean = NamedTensors(init, trainable=True)
        self.hess = NamedTensors({n: torch.full_like(t, self.hess_init) for n, t in init.items()}, trainable=False)
        self._link()

    def _link(self) -> None:
        """Lets :class:`bayeswrap.optim.IVON` find this model from each mean Parameter."""
        for name, p in self.mean.items():
            bw_optim.link_ivon_parameter(p, self, name)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._link()  # a deep copy or an unpickled model has new mean Parameters

    @property
    def ess(self) -> float:
        """λ = num_data / kl_weight, the effective sample size.

        Raises:
            ValueError: ``kl_weight <= 0`` (e.g. a ``kl_schedule`` factor of 0): λ would be infinite.
        """
        if self.kl_weight <= 0:
            raise ValueError(f"kl_weight={self.kl_weight!r}: IVON needs kl_weight > 0 (λ = num_data / kl_weight "
                             "is infinite at 0); accepted: a kl_schedule whose factor stays > 0 (no warm-up at 0, "
                             "e.g. KLSchedule(warmup_epochs=0, ramp_epochs=T)), or no kl_schedule")
        return self.num_data / self.kl_weight

    @property
    def weight_decay(self) -> float:
        """δ = kl_weight / (num_data · prior_std²), so that λδ = 1/prior_std²."""
        return self.kl_weight / (self.num_data * self.prior_std**2)

    def _train_sample(self, std: dict[str, torch.Tensor] | None = None):
        """θ = m + σ ⊙ ε with σ detached (∂θ/∂m = I); keeps θ − m for the optimizer."""
        if self.kl_weight <= 0:
            raise ValueError(f"kl_weight={self.kl_weight!r}: IVON needs kl_weight > 0 at every draw "
                             "(a kl_schedule factor of 0 is not supported)")
        names, means = self.mean.keys(), self.mean.values()
        with torch.no_grad():
            std = self.posterior_std() if std is None else std
            perturbation = torch._foreach_mul(standard_normal_like(means), [std[n] for n in names])
        if torch.is_grad_enabled():  # a draw that can produce the gradient of the next step
            self._perturbation = dict(zip(names, perturbation))
            if not torch.compiler.is_compiling():  # a compiled step links in before_fit (a dict write breaks graphs)
                self._link()  # again, in case the Parameters were replaced (e.g. load_state_dict(assign=True))
        return {n: m + z for n, m, z in zip(names, means, perturbation)}

    def ivon_terms(self, name: str) -> bw_optim.IVONTerms:
        """What :class:`bayeswrap.optim.IVON` needs to step the mean of ``name``; consumes its draw.

        Raises:
            RuntimeError: if no training draw was made since the last step.
        """
        perturbation = self._perturbation.pop(name, None)
        if perturbation is None:
            raise RuntimeError(f"IVON parameter {name!r} has a gradient but no training draw since the last "
                               "optimizer step; compute the loss with bnn.loss(x, y) (one draw) before each step")
        return bw_optim.IVONTerms(self.hess[name], self.prior.mean[name], perturbation, self.ess,
                                  self.weight_decay, self.hess_init)

    def _sample_and_regularizer(self):
        with torch.no_grad():
            std = self.posterior_std()
        return self._train_sample(std), self.regularizer(std)

    def regularizer(self, std: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """KL(q || p) in nats, detached: reported only, the prior acts through δ in the optimizer.

        Args:
            std: σ if already computed (``posterior_std()`` otherwise).
        """
        with torch.no_grad():
            return self.prior.kl(self.mean.as_dict(), self.posterior_std() if std is None else std)

    def posterior_mean(self):
        """m, ``{name: tensor}``."""
        return self.mean.as_dict()

    def posterior_std(self):
        """σ = 1/sqrt(λ (h + δ)), ``{name: tensor}``."""
        ess, delta = self.ess, self.weight_decay
        return {n: (ess * (h + delta)).rsqrt() for n, h in self.hess.items()}

    def before_fit(self, num_steps, optimizer=None, steps_per_epoch=None) -> None:
        """Links the mean Parameters to this model for the optimizer (a compiled step's draws do not link them)."""
        super().before_fit(num_steps, optimizer, steps_per_epoch)
        self._link()
