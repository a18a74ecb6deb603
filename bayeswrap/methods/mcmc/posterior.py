"""Full-batch MCMC for small models: the registered posteriors over kept draws, ``"mh"`` and ``"hmc"``.

Both sample the Bayesian parameters θ of a wrapped model from the posterior with potential energy (in nats)

    U(θ) = N · NLL(θ) − log p(θ) = N · (1/n) Σ_i −log p(y_i | x_i, θ) + kl_weight · Σ (θ − θ̄)²/(2σ²) + const,

evaluated on the whole training set (``inputs``, ``targets``; n examples, N = ``num_data``) through the same
functional call as every other method. :meth:`FullBatchMCMC.run_chains` hands U to the one chain runner
(:mod:`bayeswrap.methods.mcmc.runner`), which steps a transition kernel (:mod:`bayeswrap.methods.mcmc.kernel`)
over every chain at once and keeps the draws in a :class:`~bayeswrap.core.samples.SampleStore`
(memory-bounded, thinned by two when full); :meth:`~bayeswrap.BayesianModel.predict` averages over them with the
:class:`~bayeswrap.methods.predictives.StoredDraws` predictive, the ensemble predictive of SGLD's iterates.
U is the training objective as a function of θ, N · ``loss(x, y)``: the hooks ``_train_sample`` (θ₀, the
model's weights) and ``regularizer`` (−log p(θ₀)) are the potential's terms at θ₀, and ``bw.fit`` refuses these
methods because a sampler, not an optimiser, explores U. The kernels:

* ``"mh"``: random-walk Metropolis–Hastings with an adaptive scale and shape (:mod:`bayeswrap.methods.mcmc.mh`);
* ``"hmc"``: HMC with dual-averaging step size and windowed diagonal mass adaptation, or pyro-ppl's NUTS
  (``kernel="nuts"``) (:mod:`bayeswrap.methods.mcmc.hmc`).

:meth:`FullBatchMCMC.diagnostics` reports rank-normalised split R-hat, bulk and tail ESS per parameter tensor,
the acceptance rate, the step size and the divergences (:func:`~bayeswrap.methods.mcmc.runner.chain_diagnostics`);
:meth:`FullBatchMCMC.check_run_options` checks a budget against what they need before any sampling
(``bayeswrap fit`` calls it while validating the config).
"""

from __future__ import annotations

import inspect
from abc import abstractmethod

import torch

from bayeswrap.core import distributed
from bayeswrap.core.checks import check_bool, check_float, check_int
from bayeswrap.core.functional import NamedTensors
from bayeswrap.core.samples import SampleStore
from bayeswrap.methods.base import BayesianModel, NotFittedError, register_method
from bayeswrap.methods.mcmc import runner
from bayeswrap.methods.mcmc.hmc import HMCKernel, NUTSKernel
from bayeswrap.methods.mcmc.kernel import MCMCKernel
from bayeswrap.methods.mcmc.mh import RandomWalkKernel
from bayeswrap.methods.mcmc.potential import FlatLayout, Potential
from bayeswrap.methods.predictives import Predictive, StoredDraws

#: the most Bayesian parameters a full-batch sampler accepts by default (larger models: use "sgld")
MAX_PARAMETERS = 100_000

#: ``run_chains`` arguments that are data or random state, not options (:meth:`FullBatchMCMC.check_run_options`)
_RUN_DATA = ("inputs", "targets", "generator", "init")


class FullBatchMCMC(BayesianModel):
    """The posterior over the kept draws of full-batch chains (use ``bw.wrap(model, "mh" | "hmc", ...)``).

    A registered subclass chooses its transition kernel (:meth:`_kernel`); sampling is :meth:`run_chains`.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        num_chains: default number of chains of :meth:`run_chains` (integer ≥ 1).
        max_samples: most kept draws (each holds every chain's state), integer ≥ 1.
        max_parameters: the size limit of full-batch MCMC: a model with more
            Bayesian parameters is refused (integer ≥ 1, default 100,000).

    Raises:
        ValueError: for a bad option, or more Bayesian parameters than
            ``max_parameters`` (the message points to ``"sgld"``).
    """

    select_best_epoch = False
    supports_learned_noise = False  # the chains sample θ only; a learned σ would never be trained

    def __init__(self, model, *, num_chains: int = 4, max_samples: int = 1000,
                 max_parameters: int = MAX_PARAMETERS, **kwargs):
        self.num_chains = check_int("num_chains", num_chains, minimum=1)
        self.max_samples = check_int("max_samples", max_samples, minimum=1)
        self.max_parameters = check_int("max_parameters", max_parameters, minimum=1)
        super().__init__(model, **kwargs)
        size = sum(t.numel() for t in self.theta.values())
        if size > self.max_parameters:
            raise ValueError(f"method {self.method!r} samples the full batch and is meant for small models: this "
                             f"model has {size:,} Bayesian parameters, above max_parameters="
                             f"{self.max_parameters:,}; use 'sgld' (minibatch Langevin dynamics), select fewer "
                             f"parameters with params=, or raise max_parameters")
        self.stats: dict = {}

    @abstractmethod
    def _kernel(self) -> MCMCKernel:
        """The transition kernel of one run, built from the method's options."""

    # ------------------------------------------------------------------ hooks
    def _init_posterior(self, init):
        """θ₀ (the model's weights: the chains' default start and the point of the hooks below), an empty store."""
        self.theta = NamedTensors(init, trainable=False)
        self._make_store(self.num_chains)

    def _make_store(self, chains: int) -> None:
        template = {n: t.unsqueeze(0).expand(chains, *t.shape) for n, t in self.theta.items()}
        self.sample_store = SampleStore(template, self.max_samples, device=None)
        self.num_chains = chains

    def _train_sample(self):
        """θ₀. The potential is the training objective as a function of θ: ``loss(x, y)`` on the whole
        training set is U(θ₀)/N, and :meth:`run_chains` samples exp(−N · loss) with the same functional call
        and the same prior term (:meth:`_energy`). Being a sampler's and not an optimiser's, it is not minimised
        (``bw.fit`` refuses these methods, see :meth:`not_trained_by_fit`).
        """
        return self.theta.as_dict()

    def regularizer(self) -> torch.Tensor:
        """−log p(θ₀) up to a constant, in nats: the prior term of U (:meth:`_neg_log_prior` at θ₀)."""
        return self._neg_log_prior(self.theta.as_dict())

    def posterior_mean(self):
        """The mean of the kept draws over every chain (θ₀ before any draw)."""
        if not self.is_ready():
            return self.theta.as_dict()
        return {n: t.mean(0) for n, t in self._pooled().items()}

    def posterior_std(self):
        """The std of the kept draws over every chain (0 before any draw)."""
        if not self.is_ready():
            return {n: torch.zeros_like(t) for n, t in self.theta.items()}
        return {n: t.std(0, unbiased=False) for n, t in self._pooled().items()}

    def _draw(self, num_samples: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """S kept draws spread evenly over all chains' draws (deterministic; ``generator`` unused)."""
        kept = self._kept()
        return kept.draws(kept.indices(num_samples), *self._placement())

    def default_predictive(self, model: str = "full", **options) -> Predictive:
        """:class:`~bayeswrap.methods.predictives.StoredDraws` over the kept draws of every chain (the ensemble
        predictive of SGLD's iterates): S draws chosen once, evenly spread, evaluated ``chunk_size`` at a time.

        Raises:
            ValueError: on a ``model`` other than ``"full"``.
            TypeError: on any other option.
        """
        super().default_predictive(model=model, **options)  # refuses model="mpm" and unknown options
        return StoredDraws(FullBatchMCMC._kept, placement=FullBatchMCMC._placement)

    def not_trained_by_fit(self) -> str | None:
        return (f"method {self.method!r} is not trained with bw.fit: sample it with "
                f"bnn.run_chains(inputs, targets, num_samples=..., num_warmup=..., num_chains=...)")

    def is_ready(self) -> bool:
        return len(self.sample_store) > 0

    def _not_ready_message(self) -> str:
        return f"no {self.method!r} draw has been kept yet: call bnn.run_chains(inputs, targets, ...) first"

    # ------------------------------------------------------------------ kept draws
    def _kept(self) -> runner.KeptDraws:
        if not self.is_ready():
            raise NotFittedError(self._not_ready_message())
        return runner.KeptDraws(self.sample_store)

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        """Where the draws are evaluated: θ₀'s device and dtype."""
        ref = self.theta.values()[0]
        return ref.device, ref.dtype

    def chain_draws(self) -> dict[str, torch.Tensor]:
        """Every kept draw per chain, ``{name: (chains, draws, *shape)}`` (the arviz layout).

        Raises:
            NotFittedError: before :meth:`run_chains`.
        """
        return self._kept().by_chain(*self._placement())

    def _pooled(self) -> dict[str, torch.Tensor]:
        return {n: t.reshape(-1, *t.shape[2:]) for n, t in self.chain_draws().items()}

    def get_extra_state(self):
        return {**super().get_extra_state(), "num_chains": int(self.num_chains), "stats": dict(self.stats)}

    def set_extra_state(self, state):
        super().set_extra_state(state)
        chains = int(state.get("num_chains", self.num_chains))
        if chains != self.num_chains:
            self._make_store(chains)
        self.stats = dict(state.get("stats", {}))

    # ------------------------------------------------------------------ the potential
    def _neg_log_prior(self, theta: dict[str, torch.Tensor]) -> torch.Tensor:
        """−log p(θ) up to a constant (nats), the term :meth:`regularizer` gives at θ₀."""
        return self.prior.penalty(theta, fused=False)

    def _energy(self, x, y, layout: FlatLayout):
        """U(θ) = N · mean NLL + kl_weight · (−log p(θ)) = N · ``loss(x, y)`` at θ, of one flat vector θ (P,):
        the likelihood through the functional call of the training forward, the prior term of :meth:`regularizer`.
        """
        n_data = self.num_data

        def energy(vec):
            theta = layout.unflatten(vec)
            nll = self.likelihood.nll(self.forward_with(theta, x), y)
            return n_data * nll + self.kl_weight * self._neg_log_prior(theta)

        return energy

    # ------------------------------------------------------------------ running chains
    @torch.no_grad()
    def run_chains(self, inputs, targets, *, num_samples: int = 1000, num_warmup: int = 1000,
                   num_chains: int | None = None, thinning: int = 1, generator: torch.Generator | None = None,
                   init: dict[str, torch.Tensor] | None = None, init_jitter: float = 0.1) -> dict:
        """Runs ``num_chains`` chains on the full batch and keeps their draws.

        Args:
            inputs: the training inputs, (n, ...) (a tensor).
            targets: the training targets, (n,) class labels or (n, D) regression targets.
            num_samples: iterations kept after warm-up (integer ≥ 0), before ``thinning``; the diagnostics
                need at least 4 kept draws per chain (see :meth:`check_run_options`).
            num_warmup: adaptation iterations, not kept (integer ≥ 0); ``num_warmup + num_samples`` is
                at most 10,000,000.
            num_chains: chains (integer ≥ 1; default the model's ``num_chains``).
            thinning: keep every n-th post-warm-up iteration (integer ≥ 1).
            generator: optional ``torch.Generator`` (on the model's device) for every random draw.
            init: optional starting states ``{name: (chains, *shape)}``; default: the
                model's current weights plus N(0, ``init_jitter``²) noise per chain.
            init_jitter: the std of that noise (≥ 0), in parameter units.

        Returns:
            The run's statistics (also ``bnn.stats``): acceptance rate per chain,
            step size or proposal scale per chain, divergences per chain, seconds.

        Raises:
            ValueError: for a bad option, inputs and targets of different lengths,
                an ``init`` of the wrong shape, or a non-finite initial potential; under
                ``torchrun`` (a world size > 1), where every rank would run the same chains.

        Warns:
            RuntimeWarning: if a chain's acceptance rate after warm-up is below 0.01, or every one of its
                post-warm-up transitions is divergent (e.g. ``init_step_size=1e30``): the message names the
                starting step size or scale and the acceptance rates.
        """
        distributed.refuse("run_chains", "the chains run on the whole training set in one process, with no "
                           "minibatches to shard (under torchrun every rank would run the same chains)")
        checked = self.check_run_options(num_samples=num_samples, num_warmup=num_warmup, num_chains=num_chains,
                                         thinning=thinning, init_jitter=init_jitter, for_diagnostics=False)
        chains = checked["num_chains"]
        if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
            raise ValueError("inputs and targets must be tensors (the whole training set)")
        if len(inputs) != len(targets) or len(inputs) == 0:
            raise ValueError(f"inputs ({len(inputs)} examples) and targets ({len(targets)}) must have the same, "
                             f"non-zero length")
        ref = self.theta.values()[0]
        x, y = inputs.to(ref.device), targets.to(ref.device)
        self.eval()
        self.likelihood.check_targets(self.forward_with(self.theta.as_dict(), x), y)
        if chains != self.num_chains or len(self.sample_store):
            self._make_store(chains)
        start = runner.starting_points(self.theta.as_dict(), chains, init, checked["init_jitter"], generator)
        layout = FlatLayout(self.theta.as_dict())
        potential = Potential(self._energy(x, y, layout), vmap_ok=self._vmap_ok)
        try:
            self.stats = runner.sample_chains(self._kernel(), potential, layout, start, self.sample_store,
                                              num_warmup=checked["num_warmup"], num_samples=checked["num_samples"],
                                              thinning=checked["thinning"], generator=generator, label=self.method)
        finally:
            self._vmap_ok = potential.vmap_ok  # a model without a batching rule evaluates its draws one by one too
        return self.stats

    def check_run_options(self, *, for_diagnostics: bool = True, **options) -> dict:
        """Checks options of :meth:`run_chains` (not its data) before any work, as ``run_chains`` checks them.

        Args:
            for_diagnostics: also require every chain to keep at least
                :data:`~bayeswrap.methods.mcmc.runner.MIN_KEPT_DRAWS` draws
                (:func:`~bayeswrap.methods.mcmc.runner.kept_draws` of ``num_samples``, ``thinning`` and
                ``max_samples``), which :meth:`diagnostics` needs. ``bayeswrap fit`` reports the diagnostics of
                every run, so its config is checked with this on; ``run_chains`` itself accepts fewer draws.
            **options: any of ``run_chains``'s keyword options (``num_samples``, ``num_warmup``,
                ``num_chains``, ``thinning``, ``init_jitter``); the others take its defaults.

        Returns:
            Every option, checked, ``{name: value}`` (``num_chains`` resolved to the model's default if None).

        Raises:
            ValueError: naming the option, its value and what is accepted, for a bad value, an unknown option,
                more than :data:`~bayeswrap.methods.mcmc.runner.MAX_ITERATIONS` iterations, or
                (``for_diagnostics``) too few kept draws.
        """
        params = {n: p for n, p in inspect.signature(type(self).run_chains).parameters.items()
                  if p.kind is p.KEYWORD_ONLY and n not in _RUN_DATA}
        unknown = [k for k in options if k not in params]
        if unknown:
            raise ValueError(f"{', '.join(unknown)} is not an option of run_chains; accepted: {', '.join(params)}")
        return runner.check_budget({**{n: p.default for n, p in params.items()}, **options},
                                   default_chains=self.num_chains, max_samples=self.max_samples,
                                   for_diagnostics=for_diagnostics)

    def diagnostics(self) -> dict:
        """Convergence diagnostics of the kept draws (:func:`~bayeswrap.methods.mcmc.runner.chain_diagnostics`).

        Returns:
            ``{"parameters": {name: {"rhat": max R-hat, "ess_bulk": min bulk ESS,
            "ess_tail": min tail ESS}}, "summary": {...the same over every tensor...},
            "acceptance_rate", "step_size" (HMC) or "proposal_scale" (MH),
            "divergences"}`` (per chain lists, and totals). R-hat is rank-normalised
            split R-hat and the ESS are bulk and tail ESS (Vehtari et al. 2021), via
            :mod:`bayeswrap.evaluation.convergence`.

        Raises:
            NotFittedError: before :meth:`run_chains`.
            ValueError: with fewer than 4 kept draws per chain (split chains need 2 each).
        """
        return runner.chain_diagnostics(self.chain_draws(), self.stats)


@register_method("mh", order=110)
class MetropolisHastings(FullBatchMCMC):
    """Full-batch random-walk Metropolis–Hastings with adaptive proposal scale (Roberts, Gelman & Gilks 1997).

    Takes the arguments of :class:`FullBatchMCMC` plus:

    Args:
        target_accept: acceptance rate the warm-up adapts the scale to (in (0, 1));
            default 0.234 (0.44 for a single parameter).
        init_scale: the starting proposal std, in parameter units (> 0).
    """

    def __init__(self, model, *, target_accept: float | None = None, init_scale: float = 0.1, **kwargs):
        self.target_accept = None if target_accept is None else check_float(
            "target_accept", target_accept, low=0.0, high=1.0, low_open=True, high_open=True)
        self.init_scale = check_float("init_scale", init_scale, low=0.0, low_open=True)
        super().__init__(model, **kwargs)

    def _kernel(self) -> MCMCKernel:
        return RandomWalkKernel(self.init_scale, self.target_accept)


@register_method("hmc", order=120)
class HMC(FullBatchMCMC):
    """Full-batch Hamiltonian Monte Carlo with dual-averaging step size and diagonal mass adaptation, or pyro's NUTS
    (Neal 2011; Hoffman & Gelman 2014).

    Takes the arguments of :class:`FullBatchMCMC` plus:

    Args:
        num_leapfrog: leapfrog steps per trajectory (integer ≥ 1).
        target_accept: the dual-averaging target δ (in (0, 1), default 0.8).
        init_step_size: the first step size (> 0); refined by Hoffman & Gelman's
            Algorithm 4 heuristic before warm-up.
        adapt_mass: adapt the diagonal inverse mass matrix in warm-up windows (True or False).
        jitter: draw each trajectory's number of leapfrog steps uniformly from
            {⌈L/2⌉, ..., ⌊3L/2⌋} (L = ``num_leapfrog``; Neal 2011, §5.4.2.2), so that
            no fixed trajectory length can be close to a period of the dynamics
            (a fixed L made the ESS swing by two orders of magnitude with L). True or False.
        kernel: ``"hmc"`` (this module's sampler) or ``"nuts"``: the No-U-Turn
            sampler of the optional ``pyro-ppl`` package (Hoffman & Gelman 2014,
            Algorithm 6, through its ``potential_fn`` interface), one chain after another,
            with its own step-size and diagonal mass adaptation.
    """

    def __init__(self, model, *, num_leapfrog: int = 16, target_accept: float = 0.8, init_step_size: float = 0.1,
                 adapt_mass: bool = True, kernel: str = "hmc", jitter: bool = True, **kwargs):
        if kernel not in ("hmc", "nuts"):
            raise ValueError(f"kernel={kernel!r} is not known; accepted: 'hmc' (bayeswrap's), 'nuts' (pyro-ppl's "
                             f"NUTS, pip install pyro-ppl)")
        if kernel == "nuts":
            try:
                import pyro  # noqa: F401
            except ImportError:
                raise ValueError("kernel='nuts' needs the pyro-ppl package (pip install 'bayeswrap[nuts]'); "
                                 "accepted without it: kernel='hmc'") from None
        self.kernel = kernel
        self.jitter = check_bool("jitter", jitter)
        self.num_leapfrog = check_int("num_leapfrog", num_leapfrog, minimum=1)
        self.target_accept = check_float("target_accept", target_accept, low=0.0, high=1.0, low_open=True,
                                         high_open=True)
        self.init_step_size = check_float("init_step_size", init_step_size, low=0.0, low_open=True)
        self.adapt_mass = check_bool("adapt_mass", adapt_mass)
        super().__init__(model, **kwargs)

    def _kernel(self) -> MCMCKernel:
        if self.kernel == "nuts":
            return NUTSKernel(self.target_accept, self.adapt_mass)
        return HMCKernel(self.num_leapfrog, self.target_accept, self.init_step_size, self.adapt_mass, self.jitter)
