"""Stochastic-gradient Langevin dynamics: an ensemble of kept iterates (BayesDLL §2.3).

Training runs :class:`bayeswrap.optim.SGLD` (Welling & Teh 2011, BayesDLL eq. 12)
on the MAP objective. After a burn-in, every ``thinning``-th iterate is *kept*:

* it goes into the shared, memory-bounded :class:`~bayeswrap.core.samples.SampleStore`
  (at most ``max_samples`` draws, thinned by two when full, so they stay evenly
  spaced over the whole chain);
* it is folded into a running mean and variance (Welford's algorithm,
  :func:`~bayeswrap.core.samples.welford_update_`, shared with SWAG).

The default posterior predictive (``predictive="ensemble"``) averages the model
over the stored iterates, p(y|x, D) ≈ (1/S) Σ_s p(y|x, θ_s), which keeps every
correlation between parameters that the chain explored. ``predictive="gaussian"``
is the older moment-matched predictive: samples from the diagonal Gaussian
N(running mean, running variance), which drops those correlations. In both modes
:meth:`SGLD.posterior_mean` / :meth:`SGLD.posterior_std` are the running moments,
and ``predict(x, num_samples=0)`` uses the running mean.

Burn-in defaults to ``"auto"``: the first half (:data:`BURN_IN_FRACTION`) of the
steps that :func:`bayeswrap.fit` runs, a common choice for SG-MCMC.

With ``cycles=M`` the model runs *cyclical* SGLD (Zhang et al. 2020, "Cyclical
Stochastic Gradient MCMC for Bayesian Deep Learning", ICLR, Algorithm 1): it
sets the optimizer's step size per step to the cosine schedule of eq. (1),
α_k = α_0/2 · [cos(π · mod(k − 1, ⌈K/M⌉)/⌈K/M⌉) + 1] (α_0 = each parameter
group's ``lr`` when the fit starts), switches the Langevin noise off in the
exploration stage (the first fraction β = ``exploration`` of each cycle: plain
SGD) and on in the sampling stage, where samples are collected. The exploration
stage replaces the burn-in.
"""

from __future__ import annotations

import logging
import math
import warnings

import torch

from bayeswrap import optim as bw_optim
from bayeswrap.core.functional import NamedTensors
from bayeswrap.core.samples import SampleStore, welford_update_, welford_variance
from bayeswrap.core.schedules import cycle_length, cyclical_step_size, exploration_steps, restore_param_groups
from bayeswrap.methods.base import NotFittedError, check_float, check_int, register_method
from bayeswrap.methods.map import MAP
from bayeswrap.methods.predictives import Predictive, StoredDraws

#: fraction of the fit's optimizer steps discarded as burn-in when ``burn_in="auto"``
BURN_IN_FRACTION = 0.5
#: accepted values of ``predictive``
PREDICTIVES = ("ensemble", "gaussian")
#: a store that may exceed this many bytes (max_samples × one draw) warns when the model is built
STORE_WARN_BYTES = 8 * 2**30
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
# keys this model adds to the optimizer's param groups while it drives a cyclical schedule
_BASE_LR, _BASE_NOISE = "sgld_base_lr", "sgld_base_noise_scale"


@register_method("sgld", order=50)
class SGLD(MAP):
    """SGLD sampler over the Bayesian parameters (Welling & Teh 2011; cyclical schedule: Zhang et al. 2020); train
    it with ``bw.optim.SGLD``.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        burn_in: optimizer steps discarded before samples are kept: ``"auto"``
            (default) = ⌊:data:`BURN_IN_FRACTION` · K⌋ = the first half of the K
            steps that :func:`bayeswrap.fit` will have run in total (the steps this
            model has already taken, e.g. before a resume, plus the steps of the
            fit; fixed when the fit starts), or an integer ≥ 0. BayesDLL counts
            burn-in in epochs; multiply by steps per epoch. Ignored with ``cycles``.
        thinning: keep every ``thinning``-th iterate after burn-in (≥ 1, optimizer
            steps; BayesDLL default 10). With ``cycles``: every ``thinning``-th step
            of each sampling stage, counted from the stage's start.
        predictive: ``"ensemble"`` (default): :meth:`sample` returns stored
            iterates; ``"gaussian"``: draws from the diagonal Gaussian of the
            running moments. May be changed after training (both are collected).
        max_samples: most iterates held by the sample store (integer ≥ 0; 0 keeps
            none and allows only ``predictive="gaussian"``). When full the store
            drops every second iterate and keeps every second one after that, so
            it holds between ⌈max_samples/2⌉ and max_samples iterates spread
            over the whole chain (see :class:`~bayeswrap.core.samples.SampleStore`).
        sample_dtype: storage dtype of the iterates: ``None`` (the parameters'
            dtype), or ``torch.bfloat16`` / ``torch.float16`` (or their names) to
            halve the memory of float32 iterates; draws are cast back to the
            parameters' dtype for prediction.
        sample_device: where the iterates are stored: ``"cpu"`` (default; the
            draws are copied to the model's device chunk by chunk when
            predicting), a device, or ``None`` to follow the model's ``.to()``.
        cycles: M, the number of cycles of cyclical SGLD, or ``None`` (default)
            for plain SGLD with a constant step size. Needs a train loader with a
            ``len()`` (K must be known) and replaces ``burn_in``.
        exploration: β ∈ [0, 1), the proportion of each cycle spent in the
            noise-free exploration stage (Zhang et al.'s β; steps with
            r(k) = mod(k − 1, ⌈K/M⌉)/⌈K/M⌉ < β explore, the others sample).

    Attributes:
        theta: the current Langevin iterate.
        sample_store: the :class:`~bayeswrap.core.samples.SampleStore` of kept iterates
            (``None`` with ``max_samples=0``).
        moment_mean, moment_m2: Welford accumulators of the kept iterates.
        num_steps, num_kept: step and kept-sample counters (0-d int64 buffers).

    Raises:
        ValueError: on an invalid option (the message names the value and the
            accepted ones), ``max_samples=0`` with ``predictive="ensemble"``, or
            an integer ``burn_in`` > 0 together with ``cycles``.

    Example:
        >>> bnn = bw.wrap(model, "sgld", num_data=len(train_set), cycles=4)
        >>> opt = bw.optim.SGLD(bnn.param_groups(), lr=0.1, num_data=len(train_set))
        >>> bw.fit(bnn, train_loader, epochs=40, optimizer=opt)
        >>> probs = bnn.predict(x, num_samples=len(bnn.sample_store))   # every stored iterate once
    """

    required_optimizer = bw_optim.SGLD
    select_best_epoch = False  # the posterior is the chain's kept iterates, not one epoch's state
    tuning = ("noise_scale", (0.1, 0.3, 1.0))  # the temperature T = noise_scale² of the sampled posterior
    recommended = {"lr": 0.2}  # no momentum; chosen on digits' validation NLL
    in_default_comparison = True
    loss_free_state = ("sample_store.", "moment_mean.", "moment_m2.")
    run_fields = ("burn_in_epochs", "noise_scale")  # burn-in epochs -> burn_in steps; the optimizer's noise

    @classmethod
    def run_options(cls, run) -> dict:
        """A run's ``cycles=0`` (the command line's "no cycles") as None, and its burn-in in optimizer steps.

        ``burn_in`` (unless the run gives it): ``run.burn_in_epochs`` (None: :data:`BURN_IN_FRACTION` of the
        epochs) times the steps per epoch, at most half of training and one thinning interval before its end
        (shortened with a warning), so that a short run still keeps samples; ``"auto"`` with ``cycles``.

        Raises:
            ValueError: for ``cycles`` with a learning-rate schedule or warm-up: cyclical SGLD sets its own step
                size.
        """
        out = {"cycles": None} if run.options.get("cycles") == 0 else {}
        cycles = out.get("cycles", run.options.get("cycles"))
        if cycles and (run.scheduler != "constant" or run.warmup_epochs):
            raise ValueError(f"scheduler={run.scheduler!r}, warmup_epochs={run.warmup_epochs}: cyclical SGLD "
                             f"(cycles={cycles}) sets its own step size; accepted: scheduler=constant, "
                             f"warmup_epochs=0")
        if "burn_in" in run.options or run.steps_per_epoch is None:
            return out
        if cycles:
            return {**out, "burn_in": "auto"}
        steps, epochs = run.steps_per_epoch, run.epochs
        burn_in = round((epochs * BURN_IN_FRACTION if run.burn_in_epochs is None else run.burn_in_epochs) * steps)
        thinning = run.options.get("thinning", cls.__init__.__kwdefaults__["thinning"])
        longest = max(0, min(epochs * steps // 2, epochs * steps - thinning))
        if burn_in > longest:
            burn_in = longest
            shown = "auto" if run.burn_in_epochs is None else f"{run.burn_in_epochs:g}"
            logging.getLogger("bayeswrap").warning(
                "sgld: burn_in_epochs=%s leaves too few samples in %d epochs; burn-in shortened to %d steps", shown,
                epochs, burn_in)
        return {**out, "burn_in": burn_in}

    def __init__(self, model, *, burn_in: int | str = "auto", thinning: int = 10, predictive: str = "ensemble",
                 max_samples: int = 100, sample_dtype: torch.dtype | str | None = None,
                 sample_device: torch.device | str | None = "cpu", cycles: int | None = None,
                 exploration: float = 0.5, **kwargs):
        self.burn_in = _check_burn_in(burn_in)
        self.thinning = check_int("thinning", thinning, minimum=1, note="optimizer steps")
        self.max_samples = check_int("max_samples", max_samples, minimum=0, note="0: store no iterates")
        self.predictive = predictive
        if isinstance(sample_dtype, str):
            if sample_dtype not in _DTYPES:
                raise ValueError(f"sample_dtype={sample_dtype!r} is not accepted; accepted: None, {tuple(_DTYPES)}")
            sample_dtype = _DTYPES[sample_dtype]
        if sample_dtype is not None and sample_dtype not in _DTYPES.values():
            raise ValueError(f"sample_dtype={sample_dtype!r} is not accepted; accepted: None, {tuple(_DTYPES)}")
        self.sample_dtype = sample_dtype
        try:
            self.sample_device = None if sample_device is None else torch.device(sample_device)
        except (RuntimeError, TypeError):
            raise ValueError(f"sample_device={sample_device!r} is not accepted; accepted: None (follow the model), "
                             "'cpu', 'cuda', a torch.device") from None
        cycles = check_int("cycles", cycles, minimum=1, allow_none=True, note="None: plain SGLD")
        exploration = check_float("exploration", exploration, low=0.0, high=1.0, high_open=True,
                                  note="fraction of each cycle")
        if cycles is not None and self.burn_in not in ("auto", 0):
            raise ValueError(f"burn_in={burn_in!r} cannot be combined with cycles={cycles}: the exploration stage "
                             "of each cycle replaces the burn-in; leave burn_in='auto'")
        self.cycles, self.exploration = cycles, float(exploration)
        self._auto_burn_in: int | None = None  # burn_in="auto" resolved by before_fit
        self._cycle_plan: tuple[int, int, int] | None = None  # (K, cycle length, exploration steps per cycle)
        self._optimizer: torch.optim.Optimizer | None = None  # driven by the cyclical schedule during a fit
        super().__init__(model, **kwargs)
        if self.sample_store is None and self.predictive == "ensemble":
            raise ValueError("max_samples=0 stores no iterates, so predictive='ensemble' has nothing to average; "
                             "use max_samples >= 1 or predictive='gaussian'")
        if self.sample_store is not None:
            per_draw = sum(t.numel() * (self.sample_dtype or t.dtype).itemsize for t in self.theta.values())
            if per_draw * self.max_samples > STORE_WARN_BYTES:
                warnings.warn(f"the SGLD sample store may grow to {per_draw * self.max_samples / 2**30:.1f} GiB "
                              f"({self.max_samples} draws of {per_draw / 2**20:.0f} MiB, on "
                              f"{self.sample_device or 'the model device'}; checkpoints hold them too); lower "
                              "max_samples, use sample_dtype=torch.bfloat16, or predictive='gaussian' with "
                              "max_samples=0", RuntimeWarning, stacklevel=2)

    @property
    def predictive(self) -> str:
        """``"ensemble"`` or ``"gaussian"``, see the class docstring (settable)."""
        return self._predictive_kind

    @predictive.setter
    def predictive(self, value: str) -> None:
        if value not in PREDICTIVES:
            raise ValueError(f"predictive={value!r} is not accepted; accepted: {PREDICTIVES}")
        if value == "ensemble" and getattr(self, "sample_store", "unset") is None:
            raise ValueError("predictive='ensemble' needs stored iterates, but this model has max_samples=0")
        self._predictive_kind = value

    def _init_posterior(self, init):
        super()._init_posterior(init)
        zeros = {n: torch.zeros_like(t) for n, t in init.items()}
        self.moment_mean = NamedTensors(zeros, trainable=False)
        self.moment_m2 = NamedTensors(zeros, trainable=False)
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("num_kept", torch.zeros((), dtype=torch.long))
        self.sample_store = SampleStore(init, self.max_samples, dtype=self.sample_dtype,
                                        device=self.sample_device) if self.max_samples else None

    # ------------------------------------------------------------------ schedule
    def burn_in_steps(self) -> int:
        """The burn-in in optimizer steps (``burn_in`` itself, or what ``"auto"`` resolved to).

        Raises:
            RuntimeError: for ``burn_in="auto"`` before :meth:`before_fit` has run
                (i.e. when training with a hand-written loop: pass an int then).
        """
        if self.burn_in != "auto":
            return self.burn_in
        if self._auto_burn_in is None:
            raise RuntimeError("burn_in='auto' is resolved when bayeswrap.fit starts (before_fit(num_steps)); "
                               "with a hand-written training loop pass burn_in as an integer number of steps, "
                               "or call bnn.before_fit(num_steps, optimizer) first")
        return self._auto_burn_in

    def _kept_upto(self, step: int) -> int:
        """How many of the steps 1..``step`` keep a sample under the current plan."""
        if self.cycles is None:
            return max(0, step - self.burn_in_steps()) // self.thinning
        _, length, explore = self._cycle_plan
        per_cycle = (length - explore) // self.thinning
        return step // length * per_cycle + max(0, step % length - explore) // self.thinning

    def _keeps(self, step: int) -> bool:
        """Whether the iterate after 1-based optimizer step ``step`` is kept."""
        return self._kept_upto(step) > self._kept_upto(step - 1)

    def before_fit(self, num_steps: int | None, optimizer: torch.optim.Optimizer | None = None,
                   steps_per_epoch: int | None = None) -> None:
        """Resolves ``burn_in="auto"`` and, with ``cycles``, takes over the optimizer's step size and noise.

        The plan covers K = (steps already taken by this model) + ``num_steps``
        steps, so a fit resumed from a checkpoint (its ``num_steps`` counter
        restored) burns in and cycles exactly as the uninterrupted fit. With
        ``cycles`` the base step size α_0 and noise scale of each parameter group
        are recorded in the group (keys ``sgld_base_lr``/``sgld_base_noise_scale``,
        so they survive ``optimizer.state_dict()`` and a resume) and restored by
        :meth:`after_fit`; an epoch LR scheduler's changes are overwritten.

        Args:
            num_steps: optimizer steps of this fit, or ``None`` if unknown.
            optimizer: the :class:`bayeswrap.optim.SGLD` optimizer of the fit.
            steps_per_epoch: unused (the schedule is in optimizer steps).

        Raises:
            ValueError: if the optimizer's ``num_data`` differs from the model's;
                if ``burn_in="auto"`` or ``cycles`` is set but ``num_steps``
                is ``None``, ``cycles`` is set without an optimizer or with more
                cycles than steps, or ``burn_in="auto"``/``cycles`` with this
                ``thinning`` would keep no sample at all. (An integer burn-in
                that leaves no sample only warns: the fit may be a burn-in stage
                followed by another fit.)
        """
        if optimizer is not None:
            for i, group in enumerate(optimizer.param_groups):
                if group.get("num_data", self.num_data) != self.num_data:
                    raise ValueError(f"the SGLD optimizer's num_data={group['num_data']!r} (param group {i}) differs "
                                     f"from the model's num_data={self.num_data}; accepted: the same N, which sets "
                                     "both the prior's weight and the Langevin noise sqrt(2 lr / N)")
        taken = int(self.num_steps)
        total = None if num_steps is None else taken + int(num_steps)
        if self.cycles is not None:
            if total is None:
                raise ValueError(f"cycles={self.cycles} needs the number of optimizer steps K, but the train loader "
                                 "has no len(); use a loader with a length, or cycles=None")
            if optimizer is None:
                raise ValueError(f"cycles={self.cycles}: the model sets the optimizer's lr and noise per step, "
                                 "so before_fit needs the optimizer")
            length = cycle_length(total, self.cycles)
            self._cycle_plan = (total, length, exploration_steps(total, self.cycles, self.exploration))
            where = f"cycles={self.cycles} with exploration={self.exploration}"
        elif self.burn_in == "auto":
            if total is None:
                raise ValueError("burn_in='auto' discards the first half of the fit's optimizer steps, but the train "
                                 "loader has no len(); pass burn_in as an integer number of optimizer steps")
            self._auto_burn_in = math.floor(BURN_IN_FRACTION * total)
            where = f"burn_in='auto' (= {self._auto_burn_in} steps)"
        else:
            where = f"burn_in={self.burn_in}"
        if total is not None and int(self.num_kept) == 0 and self._kept_upto(total) == self._kept_upto(taken):
            message = (f"SGLD would keep no sample: the fit runs optimizer steps {taken + 1}..{total} with {where} "
                       f"and thinning={self.thinning}; train longer, lower thinning"
                       f"{'' if self.cycles else ' or burn_in'}")
            if self.cycles is None and self.burn_in != "auto":
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            else:
                raise ValueError(message)
        if self.cycles is not None:  # only now, so that an error above leaves the optimizer untouched
            self._optimizer = optimizer
            for group in optimizer.param_groups:
                group.setdefault(_BASE_LR, group["lr"])
                group.setdefault(_BASE_NOISE, group.get("noise_scale", 1.0))
            self._set_step_size(taken + 1)

    def _set_step_size(self, step: int) -> None:
        """Sets each group's lr (eq. 1) and noise (off while exploring) for 1-based ``step``."""
        total, length, explore = self._cycle_plan
        if step > total:
            return
        exploring = (step - 1) % length < explore
        for group in self._optimizer.param_groups:
            group["lr"] = cyclical_step_size(step, total, self.cycles, group[_BASE_LR])
            group["noise_scale"] = 0.0 if exploring else group[_BASE_NOISE]

    @torch.no_grad()
    def after_step(self) -> None:
        """Counts the step; keeps the iterate if it is on the sampling grid; sets the next cyclical step size.

        Raises:
            RuntimeError: for ``burn_in="auto"`` or ``cycles`` when
                :meth:`before_fit` has not run (a hand-written loop).
        """
        self.num_steps += 1
        step = int(self.num_steps)
        if self.cycles is not None and self._cycle_plan is None:
            raise RuntimeError(f"cycles={self.cycles}: the cyclical schedule is set by before_fit(num_steps, "
                               "optimizer), which bayeswrap.fit calls; call it before a hand-written loop")
        if self._keeps(step):
            self.num_kept += 1
            welford_update_(self.moment_mean.values(), self.moment_m2.values(), self.theta.values(),
                            int(self.num_kept))
            if self.sample_store is not None:
                self.sample_store.offer(self.theta.as_dict())
        if self._optimizer is not None:
            self._set_step_size(step + 1)

    def after_fit(self, train_loader) -> None:
        """Gives the optimizer back its base step sizes and noise scales (after a cyclical fit)."""
        super().after_fit(train_loader)
        if self._optimizer is not None:
            restore_param_groups(self._optimizer, {_BASE_LR: "lr", _BASE_NOISE: "noise_scale"})
            self._optimizer = None

    # ------------------------------------------------------------------ posterior
    def is_ready(self) -> bool:
        return int(self.num_kept) > 0

    def _not_ready_message(self):
        burn_in = repr(self.burn_in) + (f" (= {self._auto_burn_in} steps)" if self._auto_burn_in is not None
                                        and self.burn_in == "auto" else "")
        head = (f"no SGLD sample has been kept yet ({int(self.num_steps)} steps taken, burn_in={burn_in}, "
                f"thinning={self.thinning})")
        if int(self.num_steps) == 0:  # not too short a run: no step was ever counted
            return (f"{head}: bnn.after_step(), which counts the optimizer steps and keeps the iterates, was never "
                    "called; bw.fit calls it after every step, and so do bayeswrap.lightning.BayesianModule and "
                    "BayesianCallback in a lightning.Trainer; a hand-written loop must call "
                    "bnn.before_fit(num_steps, optimizer) once and bnn.after_step() after each optimizer.step()")
        return f"{head}; train for more steps or lower burn_in"

    def _point_estimate(self):
        return self.theta.as_dict()

    def posterior_mean(self):
        """Running mean of the kept iterates, ``{name: tensor}`` (both predictives).

        Raises:
            NotFittedError: if no iterate has been kept yet.
        """
        self._check_ready()
        return self.moment_mean.as_dict()

    def posterior_std(self):
        """Running std sqrt(M2 / n) of the kept iterates, ``{name: tensor}`` (both predictives).

        Raises:
            NotFittedError: if no iterate has been kept yet.
        """
        self._check_ready()
        return {k: v.sqrt_() for k, v in welford_variance(self.moment_m2.as_dict(), int(self.num_kept)).items()}

    def _compute_placement(self) -> tuple[torch.device, torch.dtype]:
        first = self.theta.values()[0]
        return first.device, first.dtype

    def _ensemble_store(self) -> SampleStore:
        """The sample store, checked to hold draws (``predictive="ensemble"``)."""
        self._check_ready()
        if len(self.sample_store) == 0:  # moments without draws: a state saved before the store existed
            raise NotFittedError(f"this SGLD model has {int(self.num_kept)} kept iterates in its running moments "
                                 "but none in its sample store (e.g. a state_dict loaded with strict=False from "
                                 "before the store existed); set bnn.predictive = 'gaussian' to use the moments")
        return self.sample_store

    def _draw(self, num_samples: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """S posterior samples, ``{name: (S, *param_shape)}`` on the parameters' device and dtype.

        ``predictive="ensemble"``: stored iterates, deterministic (``generator``
        is unused): S ≤ stored count takes evenly spaced iterates over the chain
        (all of them for S = count), S > count cycles through them in chain
        order (see :func:`bayeswrap.core.samples.spread_indices`); pass
        ``num_samples=len(bnn.sample_store)`` for the exact ensemble.
        ``predictive="gaussian"``: N(running mean, running variance) draws.

        Raises:
            NotFittedError: if no iterate has been kept yet (or, for the
                ensemble, none is in the store).
        """
        if self.predictive == "gaussian":
            return super()._draw(num_samples, generator)
        device, dtype = self._compute_placement()
        return self._ensemble_store().select(num_samples, device=device, dtype=dtype)

    def default_predictive(self, model: str = "full", **options) -> Predictive:
        """:attr:`predictive` as an object: ``"ensemble"``: :class:`StoredDraws` over the sample store (S stored
        iterates chosen once, evaluated ``chunk_size`` at a time, only one chunk on the model's device at once);
        ``"gaussian"``: :class:`Sampled` N(running mean, running variance) draws.

        Raises:
            ValueError: on a ``model`` other than ``"full"``.
            TypeError: on any other option.
        """
        default = super().default_predictive(model=model, **options)
        return default if self.predictive == "gaussian" else StoredDraws(SGLD._ensemble_store,
                                                                         placement=SGLD._compute_placement)


def _check_burn_in(burn_in):
    if isinstance(burn_in, str) and burn_in == "auto":
        return "auto"
    try:
        return check_int("burn_in", burn_in, minimum=0)
    except ValueError:
        raise ValueError(f"burn_in={burn_in!r} is not accepted; accepted: 'auto' (the first "
                         f"{BURN_IN_FRACTION:.0%} of the fit's optimizer steps) or an integer >= 0 "
                         "(optimizer steps)") from None
