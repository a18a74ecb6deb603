"""Full-batch MCMC for small models: random-walk Metropolis–Hastings (``"mh"``) and HMC (``"hmc"``).

Both sample the Bayesian parameters θ of a wrapped model from the posterior with
potential energy (in nats)

    U(θ) = N · NLL(θ) − log p(θ) = N · (1/n) Σ_i −log p(y_i | x_i, θ) + kl_weight · Σ (θ − θ̄)²/(2σ²) + const,

evaluated on the whole training set (``inputs``, ``targets``; n examples, N =
``num_data``) through the same functional call as every other method. Chains run
in lockstep, as one ``torch.func.vmap`` over a chain axis where the model allows
it (else one after another). Kept draws go into a
:class:`~bayeswrap.core.samples.SampleStore` (memory-bounded, thinned by two when
full) and :meth:`~bayeswrap.BayesianModel.predict` averages over them, the same
ensemble predictive as SGLD's.

* ``"mh"``: θ' = θ + s ε, ε ~ N(0, diag(d)), accepted with probability
  min(1, exp(U(θ) − U(θ'))). During warm-up the scale s of each chain follows a
  Robbins–Monro recursion towards acceptance 0.234 (0.44 in one dimension;
  Roberts, Gelman & Gilks 1997), and d is set to the variance of the warm-up's
  second half.
* ``"hmc"``: leapfrog trajectories of ``num_leapfrog`` steps with a diagonal mass
  matrix (Neal 2011). During warm-up the step size follows dual averaging
  (Hoffman & Gelman 2014, Algorithm 5, target acceptance ``target_accept`` = 0.8,
  γ = 0.05, t₀ = 10, κ = 0.75: the mean acceptance probability of the adapting
  step sizes converges to the target; the averaged step size ε̄ kept for
  sampling is their geometric mean, whose acceptance is a little higher, as in
  Stan) and the inverse mass matrix is the regularised
  variance of the draws in Stan's doubling windows (initial buffer 75, base window
  25, terminal buffer 50; 15 % / 75 % / 10 % for short warm-ups). A transition
  whose energy error exceeds 1000 nats is a divergence.

:meth:`FullBatchMCMC.diagnostics` reports rank-normalised split R-hat, bulk and
tail ESS per parameter tensor (:mod:`bayeswrap.evaluation.convergence`), the acceptance
rate, the step size and the divergences. They need at least :data:`MIN_KEPT_DRAWS` kept draws per
chain (split chains of two draws each); :meth:`FullBatchMCMC.check_run_options` checks a budget
against that before any sampling (``bayeswrap fit`` calls it while validating the config). A run
whose chains hardly move (acceptance below :data:`LOW_ACCEPTANCE` in some chain, e.g. from
``init_step_size=1e30``, or every transition divergent) ends with a ``RuntimeWarning`` that names
the starting step size or scale and the acceptance rates.
"""

from __future__ import annotations

import inspect
import math
import time
import warnings
from abc import abstractmethod

import torch
from torch.func import grad_and_value, vmap

from bayeswrap.core import distributed
from bayeswrap.core.checks import check_bool, check_float, check_int
from bayeswrap.core.functional import NamedTensors
from bayeswrap.core.samples import SampleStore, spread_indices
from bayeswrap.evaluation import convergence as diag
from bayeswrap.methods.base import BayesianModel, NotFittedError, register_method
from bayeswrap.methods.predictives import forward_many

#: the most Bayesian parameters a full-batch sampler accepts by default (larger models: use "sgld")
MAX_PARAMETERS = 100_000

#: energy error (nats) beyond which an HMC transition counts as divergent (Stan's threshold)
DIVERGENCE = 1000.0

#: the fewest kept draws per chain the diagnostics accept: split R-hat and the ESS split each chain in two
#: halves of at least 2 draws
MIN_KEPT_DRAWS = 4

#: the most iterations (``num_warmup + num_samples``) one call of ``run_chains`` runs
MAX_ITERATIONS = 10_000_000

#: post-warm-up acceptance rate below which a chain is reported as stuck (a ``RuntimeWarning``)
LOW_ACCEPTANCE = 0.01

#: ``run_chains`` arguments that are data or random state, not options (:meth:`FullBatchMCMC.check_run_options`)
_RUN_DATA = ("inputs", "targets", "generator", "init")


def kept_draws(num_samples: int, thinning: int, max_samples: int) -> int:
    """The fewest draws per chain a run keeps: one per ``thinning`` of the ``num_samples`` iterations,
    ⌈num_samples / thinning⌉, or, when that exceeds the store's ``max_samples``, the ⌈max_samples / 2⌉ the
    store keeps at least after thinning itself by two.
    """
    offered = -(-num_samples // thinning)
    return offered if offered <= max_samples else (max_samples + 1) // 2


class FullBatchMCMC(BayesianModel):
    """Shared machinery of the full-batch samplers (use ``bw.wrap(model, "mh" | "hmc", ...)``).

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

    # ------------------------------------------------------------------ posterior bookkeeping
    def _init_posterior(self, init):
        self.theta = NamedTensors(init, trainable=False)  # the chains' starting point
        self._make_store(self.num_chains)

    def _make_store(self, chains: int) -> None:
        template = {n: t.unsqueeze(0).expand(chains, *t.shape) for n, t in self.theta.items()}
        self.sample_store = SampleStore(template, self.max_samples, device=None)
        self.num_chains = chains

    def _train_sample(self):
        return self.theta.as_dict()

    def regularizer(self) -> torch.Tensor:
        return self.prior.penalty(self.theta.as_dict(), fused=False)

    def not_trained_by_fit(self) -> str | None:
        return (f"method {self.method!r} is not trained with bw.fit: sample it with "
                f"bnn.run_chains(inputs, targets, num_samples=..., num_warmup=..., num_chains=...)")

    def is_ready(self) -> bool:
        return len(self.sample_store) > 0

    def _not_ready_message(self) -> str:
        return f"no {self.method!r} draw has been kept yet: call bnn.run_chains(inputs, targets, ...) first"

    def chain_draws(self) -> dict[str, torch.Tensor]:
        """Every kept draw per chain, ``{name: (chains, draws, *shape)}`` (the arviz layout)."""
        if not self.is_ready():
            raise NotFittedError(self._not_ready_message())
        ref = self.theta.values()[0]
        return {n: t.transpose(0, 1) for n, t in self.sample_store.all(device=ref.device, dtype=ref.dtype).items()}

    def _pooled(self) -> dict[str, torch.Tensor]:
        return {n: t.reshape(-1, *t.shape[2:]) for n, t in self.chain_draws().items()}

    def posterior_mean(self):
        """The mean of the kept draws over every chain (the starting point before any draw)."""
        if not self.is_ready():
            return self.theta.as_dict()
        return {n: t.mean(0) for n, t in self._pooled().items()}

    def posterior_std(self):
        """The std of the kept draws over every chain (0 before any draw)."""
        if not self.is_ready():
            return {n: torch.zeros_like(t) for n, t in self.theta.items()}
        return {n: t.std(0, unbiased=False) for n, t in self._pooled().items()}

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """S kept draws spread evenly over all chains' draws (deterministic; ``generator`` unused).

        Raises:
            NotFittedError: before :meth:`run_chains`.
        """
        num_samples = check_int("num_samples", num_samples, minimum=1)
        self._check_ready()
        pooled = self._pooled()
        count = next(iter(pooled.values())).shape[0]
        idx = spread_indices(num_samples, count)
        return {n: t.index_select(0, idx.to(t.device)) for n, t in pooled.items()}

    def _sample_logits(self, x, num_samples: int, generator: torch.Generator | None) -> torch.Tensor:
        """Outputs under S kept draws chosen once (evenly spread over every chain), evaluated in chunks."""
        pooled = self._pooled()
        count = next(iter(pooled.values())).shape[0]
        idx = spread_indices(num_samples, count)
        outs = []
        for i in range(0, num_samples, self.chunk_size):
            part = idx[i:i + self.chunk_size]
            outs.append(forward_many(self, {n: t.index_select(0, part.to(t.device)) for n, t in pooled.items()}, x))
        return torch.cat(outs, 0)

    def get_extra_state(self):
        return {**super().get_extra_state(), "num_chains": int(self.num_chains), "stats": dict(self.stats)}

    def set_extra_state(self, state):
        super().set_extra_state(state)
        chains = int(state.get("num_chains", self.num_chains))
        if chains != self.num_chains:
            self._make_store(chains)
        self.stats = dict(state.get("stats", {}))

    # ------------------------------------------------------------------ the potential
    def _flatten(self, theta: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([theta[n].reshape(*theta[n].shape[:1], -1) for n in self.theta.keys()], 1)

    def _unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for n, t in self.theta.items():
            out[n] = vec[start:start + t.numel()].reshape(t.shape)
            start += t.numel()
        return out

    def _potential(self, x, y):
        """U(θ) = N · mean NLL + kl_weight · (−log p(θ)), as a function of the flat vector θ (P,)."""
        n_data = self.num_data

        def energy(vec):
            theta = self._unflatten(vec)
            nll = self.likelihood.nll(self.forward_with(theta, x), y)
            return n_data * nll + self.kl_weight * self.prior.penalty(theta, fused=False)

        return energy

    def _grad_and_value(self, energy):
        """``Θ (C, P) -> (∇U (C, P), U (C,))`` over every chain."""
        return self._chainwise(grad_and_value(energy))

    def _values(self, energy):
        """``Θ (C, P) -> U (C,)`` over every chain."""
        return self._chainwise(energy)

    def _chainwise(self, single):
        """``single`` over the chain axis: one vmap, or a loop over chains if the model has no batching rule."""
        batched = vmap(single)

        def fn(states):
            if self._vmap_ok:
                try:
                    return batched(states)
                except torch.OutOfMemoryError:
                    raise
                except Exception:  # an op without a batching rule: chains one by one from now on
                    self._vmap_ok = False
            outs = [single(s) for s in states]
            if isinstance(outs[0], tuple):
                return tuple(torch.stack(parts) for parts in zip(*outs))
            return torch.stack(outs)

        return fn

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
        num_samples, num_warmup, thinning, init_jitter = (checked[k] for k in ("num_samples", "num_warmup",
                                                                                 "thinning", "init_jitter"))
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
        if init is None:
            start = {n: t.unsqueeze(0) + init_jitter * torch.randn((chains, *t.shape), generator=generator,
                                                                    device=t.device, dtype=t.dtype)
                     for n, t in self.theta.items()}
        else:
            start = {}
            for n, t in self.theta.items():
                if n not in init or tuple(init[n].shape) != (chains, *t.shape):
                    raise ValueError(f"init[{n!r}] must have shape {(chains, *t.shape)} (chains, *parameter shape)")
                start[n] = init[n].to(ref)
        energy = self._potential(x, y)
        states = self._flatten(start)
        with torch.enable_grad():
            grads, values = self._grad_and_value(energy)(states)
        if not bool(torch.isfinite(values).all()):
            bad = [i for i, v in enumerate(values.tolist()) if not math.isfinite(v)]
            raise ValueError(f"the initial potential U(θ) is not finite for chain(s) {bad} (U = "
                             f"{values.tolist()}): check the inputs, prior_std and the starting weights")
        tic = time.perf_counter()
        stats = self._run(energy, states, grads, values, num_warmup, num_samples, thinning, generator)
        stats["seconds"] = time.perf_counter() - tic
        stats.update(num_chains=chains, num_warmup=num_warmup, num_samples=num_samples, thinning=thinning)
        self.stats = stats
        self._warn_if_stuck(stats, num_samples)
        return stats

    def check_run_options(self, *, for_diagnostics: bool = True, **options) -> dict:
        """Checks options of :meth:`run_chains` (not its data) before any work, as ``run_chains`` checks them.

        Args:
            for_diagnostics: also require every chain to keep at least :data:`MIN_KEPT_DRAWS` draws
                (:func:`kept_draws` of ``num_samples``, ``thinning`` and ``max_samples``), which
                :meth:`diagnostics` needs. ``bayeswrap fit`` reports the diagnostics of every run, so its
                config is checked with this on; ``run_chains`` itself accepts fewer draws.
            **options: any of ``run_chains``'s keyword options (``num_samples``, ``num_warmup``,
                ``num_chains``, ``thinning``, ``init_jitter``); the others take its defaults.

        Returns:
            Every option, checked, ``{name: value}`` (``num_chains`` resolved to the model's default if None).

        Raises:
            ValueError: naming the option, its value and what is accepted, for a bad value, an unknown option,
                more than :data:`MAX_ITERATIONS` iterations, or (``for_diagnostics``) too few kept draws.
        """
        params = {n: p for n, p in inspect.signature(type(self).run_chains).parameters.items()
                  if p.kind is p.KEYWORD_ONLY and n not in _RUN_DATA}
        unknown = [k for k in options if k not in params]
        if unknown:
            raise ValueError(f"{', '.join(unknown)} is not an option of run_chains; accepted: {', '.join(params)}")
        values = {**{n: p.default for n, p in params.items()}, **options}
        out = {"num_samples": check_int("num_samples", values["num_samples"], minimum=0),
               "num_warmup": check_int("num_warmup", values["num_warmup"], minimum=0),
               "num_chains": self.num_chains if values["num_chains"] is None else check_int(
                   "num_chains", values["num_chains"], minimum=1),
               "thinning": check_int("thinning", values["thinning"], minimum=1),
               "init_jitter": check_float("init_jitter", values["init_jitter"], low=0.0)}
        if out["num_warmup"] + out["num_samples"] > MAX_ITERATIONS:
            raise ValueError(f"num_warmup={out['num_warmup']} + num_samples={out['num_samples']} iterations is "
                             f"above the bound of {MAX_ITERATIONS:,} per run_chains call; accepted: at most "
                             f"{MAX_ITERATIONS:,} in all")
        kept = kept_draws(out["num_samples"], out["thinning"], self.max_samples)
        if for_diagnostics and kept < MIN_KEPT_DRAWS:
            need = (MIN_KEPT_DRAWS - 1) * out["thinning"] + 1
            fix = (f"max_samples >= {2 * MIN_KEPT_DRAWS - 1}" if self.max_samples < 2 * MIN_KEPT_DRAWS - 1
                   and -(-out["num_samples"] // out["thinning"]) > self.max_samples else
                   f"num_samples >= {need} at thinning={out['thinning']}")
            raise ValueError(f"num_samples={out['num_samples']} with thinning={out['thinning']} and max_samples="
                             f"{self.max_samples} keeps {kept} draw(s) per chain; the diagnostics (split R-hat, "
                             f"ESS) need at least {MIN_KEPT_DRAWS} per chain; accepted: {fix}")
        return out

    def _start_option(self) -> str:
        """The option that set the first step size or proposal scale, as ``name=value``."""
        return "the method's starting values"

    def _warn_if_stuck(self, stats: dict, num_samples: int) -> None:
        """A ``RuntimeWarning`` if some chain barely moved after warm-up (acceptance < :data:`LOW_ACCEPTANCE`)
        or every post-warm-up transition of a chain was divergent.
        """
        if num_samples == 0:
            return
        rates = [float(r) for r in stats.get("acceptance_rate", [])]
        divergences = [int(d) for d in stats.get("divergences", [])]
        stuck = [i for i, r in enumerate(rates) if not r >= LOW_ACCEPTANCE]
        divergent = [i for i, d in enumerate(divergences) if d >= num_samples]
        if not stuck and not divergent:
            return
        chains = sorted(set(stuck) | set(divergent))
        setting = {k: stats[k] for k in ("step_size", "proposal_scale") if k in stats}
        final = "; ".join(f"final {k} {', '.join(f'{v:.3g}' for v in vals)}" for k, vals in setting.items())
        warnings.warn(f"{self.method}: chain(s) {chains} hardly moved after warm-up: acceptance rate "
                      f"{', '.join(f'{r:.3g}' for r in rates)} (below {LOW_ACCEPTANCE:g} in chain(s) {stuck}), "
                      f"{', '.join(map(str, divergences))} divergent of {num_samples} transitions per chain; "
                      f"started from {self._start_option()}" + (f"; {final}" if final else "") +
                      ". The draws are not a posterior sample: lower the starting value, run a longer warm-up, or "
                      "check the prior and the data", RuntimeWarning, stacklevel=4)

    def _keep(self, states: torch.Tensor) -> None:
        self.sample_store.offer({n: t for n, t in zip(self.theta.keys(), self._split(states))})

    def _split(self, states):
        out, start = [], 0
        for t in self.theta.values():
            out.append(states[:, start:start + t.numel()].reshape(states.shape[0], *t.shape))
            start += t.numel()
        return out

    @abstractmethod
    def _run(self, energy, states, grads, values, num_warmup, num_samples, thinning, generator) -> dict:
        """The sampler's loop from the checked starting ``states`` (C, P); keeps draws, returns statistics."""

    # ------------------------------------------------------------------ diagnostics
    def diagnostics(self) -> dict:
        """Convergence diagnostics of the kept draws.

        Returns:
            ``{"parameters": {name: {"rhat": max R-hat, "ess_bulk": min bulk ESS,
            "ess_tail": min tail ESS}}, "summary": {...the same over every tensor...},
            "acceptance_rate", "step_size" (HMC) or "proposal_scale" (MH),
            "divergences"}`` (per chain lists, and totals). R-hat is rank-normalised
            split R-hat and the ESS are bulk and tail ESS (Vehtari et al. 2021), via
            :mod:`bayeswrap.evaluation.convergence`.

        Raises:
            NotFittedError: before :meth:`run_chains`.
            ValueError: with fewer than :data:`MIN_KEPT_DRAWS` (4) kept draws per chain (split chains need 2
                each).
        """
        draws = self.chain_draws()
        if next(iter(draws.values())).shape[1] < MIN_KEPT_DRAWS:
            raise ValueError(f"diagnostics need at least {MIN_KEPT_DRAWS} kept draws per chain")
        per = {}
        for n, d in draws.items():
            d = d.detach().double().cpu()
            r, eb, et = diag.rhat(d), diag.ess_bulk(d), diag.ess_tail(d)
            per[n] = {"rhat": _nanmax(r), "ess_bulk": _nanmin(eb), "ess_tail": _nanmin(et)}
        summary = {"rhat": max((p["rhat"] for p in per.values()), default=math.nan),
                   "ess_bulk": min((p["ess_bulk"] for p in per.values()), default=math.nan),
                   "ess_tail": min((p["ess_tail"] for p in per.values()), default=math.nan)}
        extra = {k: v for k, v in self.stats.items() if k in ("acceptance_rate", "step_size", "proposal_scale",
                                                               "divergences", "seconds")}
        return {"parameters": per, "summary": summary, **extra}


def _nanmax(t: torch.Tensor) -> float:
    t = t[~torch.isnan(t)]
    return float(t.max()) if t.numel() else math.nan


def _nanmin(t: torch.Tensor) -> float:
    t = t[~torch.isnan(t)]
    return float(t.min()) if t.numel() else math.nan


@register_method("mh")
class MetropolisHastings(FullBatchMCMC):
    """Random-walk Metropolis–Hastings with adaptive proposal scale (see the module docstring).

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

    def _start_option(self) -> str:
        return f"init_scale={self.init_scale:g}"

    def _run(self, energy, states, grads, values, num_warmup, num_samples, thinning, generator):
        chains, dim = states.shape
        target = self.target_accept or (0.44 if dim == 1 else 0.234)
        values_fn = self._values(energy)
        log_scale = torch.full((chains,), math.log(self.init_scale), dtype=states.dtype, device=states.device)
        diag_std = torch.ones_like(states)
        accepted = torch.zeros(chains, dtype=states.dtype, device=states.device)
        second_half = []
        for it in range(num_warmup + num_samples):
            eps = torch.randn(states.shape, generator=generator, device=states.device, dtype=states.dtype)
            proposal = states + log_scale.exp()[:, None] * diag_std * eps
            new_values = values_fn(proposal)
            log_ratio = torch.nan_to_num(values - new_values, nan=-math.inf)
            u = torch.rand(chains, generator=generator, device=states.device, dtype=states.dtype)
            accept = torch.log(u) < log_ratio
            states = torch.where(accept[:, None], proposal, states)
            values = torch.where(accept, new_values, values)
            prob = log_ratio.clamp(max=0).exp()
            if it < num_warmup:
                log_scale = log_scale + (prob - target) / (it + 1) ** 0.6
                if it >= num_warmup // 2:
                    second_half.append(states)
                if it == num_warmup - 1 and len(second_half) > 10:
                    var = torch.stack(second_half).var(0)  # (C, P)
                    scale = var.mean(1, keepdim=True).clamp_min(1e-30)
                    diag_std = (var / scale).clamp(1e-3, 1e3).sqrt()  # the shape of the posterior per chain
            else:
                accepted += accept.to(states.dtype)
                if (it - num_warmup) % thinning == 0:
                    self._keep(states)
        return {"acceptance_rate": (accepted / max(num_samples, 1)).tolist(),
                "proposal_scale": log_scale.exp().tolist(), "divergences": [0] * chains}


@register_method("hmc")
class HMC(FullBatchMCMC):
    """Hamiltonian Monte Carlo with dual-averaging step size and diagonal mass adaptation (module docstring).

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

    def _start_option(self) -> str:
        return f"init_step_size={self.init_step_size:g}"

    def _trajectory(self, gv, states, grads, values, step, inv_mass, generator, num_steps: int | None = None):
        """One leapfrog trajectory per chain; returns the proposal, its gradient/potential and the energy error."""
        num_steps = self.num_leapfrog if num_steps is None else num_steps
        momentum = torch.randn(states.shape, generator=generator, device=states.device,
                               dtype=states.dtype) / inv_mass.sqrt()
        h0 = values + 0.5 * (inv_mass * momentum.square()).sum(1)
        q, p, g = states, momentum - 0.5 * step[:, None] * grads, grads
        u = values
        for i in range(num_steps):
            q = q + step[:, None] * inv_mass * p
            with torch.enable_grad():
                g, u = gv(q)
            if i < num_steps - 1:
                p = p - step[:, None] * g
        p = p - 0.5 * step[:, None] * g
        h1 = u + 0.5 * (inv_mass * p.square()).sum(1)
        return q, g, u, torch.nan_to_num(h1 - h0, nan=math.inf)

    def _accept(self, generator, error, states, grads, values, q, g, u):
        chains = states.shape[0]
        prob = torch.exp(-error.clamp(min=0))  # min(1, exp(H0 − H1))
        rand = torch.rand(chains, generator=generator, device=states.device, dtype=states.dtype)
        accept = rand < prob
        keep = accept[:, None]
        return (torch.where(keep, q, states), torch.where(keep, g, grads), torch.where(accept, u, values),
                prob, accept)

    def _reasonable_step(self, gv, states, grads, values, inv_mass, generator):
        """Hoffman & Gelman 2014, Algorithm 4, per chain: double or halve ε until the acceptance crosses ½."""
        step = torch.full((states.shape[0],), self.init_step_size, dtype=states.dtype, device=states.device)
        saved, self.num_leapfrog = self.num_leapfrog, 1
        try:
            _, _, _, error = self._trajectory(gv, states, grads, values, step, inv_mass, generator)
            direction = torch.where(-error > math.log(0.5), 1.0, -1.0).to(states.dtype)
            for _ in range(60):
                _, _, _, error = self._trajectory(gv, states, grads, values, step, inv_mass, generator)
                crossing = direction * (-error) <= direction * math.log(0.5)
                if bool(crossing.all()):
                    break
                step = torch.where(crossing, step, step * 2.0 ** direction)
        finally:
            self.num_leapfrog = saved
        return step

    def _run_nuts(self, energy, states, num_warmup, num_samples, thinning, generator):
        from pyro.infer import MCMC, NUTS

        draws, accept, steps, divergences = [], [], [], []
        for chain in states:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device)) \
                if generator is not None else int(torch.randint(0, 2**62, (1,)))
            with torch.random.fork_rng(devices=[]), torch.enable_grad():
                torch.manual_seed(seed)
                nuts = NUTS(potential_fn=lambda params: energy(params["theta"]), target_accept_prob=self.target_accept,
                            adapt_step_size=True, adapt_mass_matrix=self.adapt_mass, full_mass=False)
                run = MCMC(nuts, num_samples=num_samples, warmup_steps=num_warmup,
                           initial_params={"theta": chain.detach().clone()}, disable_progbar=True)
                run.run()
            draws.append(run.get_samples()["theta"].detach().to(states))
            info = run.diagnostics()
            accept.append(float(next(iter(info["acceptance rate"].values()))))
            divergences.append(len(next(iter(info["divergences"].values()))))
            steps.append(float(nuts.step_size))
        stacked = torch.stack(draws, 1)  # (num_samples, chains, P)
        for i in range(0, num_samples, thinning):
            self._keep(stacked[i])
        return {"acceptance_rate": accept, "step_size": steps, "divergences": divergences, "kernel": "nuts"}

    def _run(self, energy, states, grads, values, num_warmup, num_samples, thinning, generator):
        if self.kernel == "nuts":
            return self._run_nuts(energy, states, num_warmup, num_samples, thinning, generator)
        chains, dim = states.shape
        gv = self._grad_and_value(energy)
        inv_mass = torch.ones_like(states)
        step = self._reasonable_step(gv, states, grads, values, inv_mass, generator)
        windows = _adaptation_windows(num_warmup) if self.adapt_mass else []
        da = _DualAveraging(step, self.target_accept)
        window_draws: list[torch.Tensor] = []
        accepted = torch.zeros(chains, dtype=states.dtype, device=states.device)
        divergences = torch.zeros(chains, dtype=torch.long, device=states.device)
        adapt_probs: list[torch.Tensor] = []  # acceptance probabilities since the last step-size restart
        for it in range(num_warmup + num_samples):
            warm = it < num_warmup
            current = da.step if warm else da.final
            num_steps = self.num_leapfrog
            if self.jitter:  # L ~ U{⌈L/2⌉, ..., ⌊3L/2⌋}, the same for every chain
                low, high = (self.num_leapfrog + 1) // 2, self.num_leapfrog + self.num_leapfrog // 2
                num_steps = int(torch.randint(low, high + 1, (1,), generator=generator, device=states.device))
            q, g, u, error = self._trajectory(gv, states, grads, values, current, inv_mass, generator, num_steps)
            states, grads, values, prob, accept = self._accept(generator, error, states, grads, values, q, g, u)
            divergent = error > DIVERGENCE
            if warm:
                da.update(prob)
                adapt_probs.append(prob)
                if any(start <= it < end for start, end in windows):
                    window_draws.append(states)
                if any(it == end - 1 for _, end in windows) and len(window_draws) > 2:
                    n = len(window_draws)
                    var = torch.stack(window_draws).var(0)
                    inv_mass = (n / (n + 5.0)) * var + 1e-3 * (5.0 / (n + 5.0))  # Stan's regularisation
                    window_draws = []
                    da = _DualAveraging(self._reasonable_step(gv, states, grads, values, inv_mass, generator),
                                        self.target_accept)
                    adapt_probs = []
            else:
                accepted += accept.to(states.dtype)
                divergences += divergent.long()
                if (it - num_warmup) % thinning == 0:
                    self._keep(states)
        late = adapt_probs[len(adapt_probs) // 2:]
        warmup_accept = torch.stack(late).mean(0).tolist() if late else [math.nan] * chains
        return {"acceptance_rate": (accepted / max(num_samples, 1)).tolist(), "step_size": da.final.tolist(),
                "warmup_acceptance": warmup_accept,
                "divergences": divergences.tolist(), "num_leapfrog": self.num_leapfrog,
                "inverse_mass_mean": inv_mass.mean(1).tolist()}


class _DualAveraging:
    """Hoffman & Gelman 2014, Algorithm 5 (eqs. 5–6), per chain: log ε_t = μ − √t/γ · H̄_t, averaged with t^−κ."""

    def __init__(self, step: torch.Tensor, target: float, gamma: float = 0.05, t0: float = 10.0,
                 kappa: float = 0.75):
        self.mu = torch.log(10 * step)
        self.target, self.gamma, self.t0, self.kappa = target, gamma, t0, kappa
        self.h_bar = torch.zeros_like(step)
        self.log_bar = torch.log(step)
        self.step = step
        self.t = 0

    def update(self, accept_prob: torch.Tensor) -> None:
        self.t += 1
        t = self.t
        w = 1.0 / (t + self.t0)
        self.h_bar = (1 - w) * self.h_bar + w * (self.target - accept_prob)
        log_step = self.mu - math.sqrt(t) / self.gamma * self.h_bar
        eta = t ** -self.kappa
        self.log_bar = eta * log_step + (1 - eta) * self.log_bar
        self.step = log_step.exp()

    @property
    def final(self) -> torch.Tensor:
        return self.log_bar.exp()


def _adaptation_windows(num_warmup: int) -> list[tuple[int, int]]:
    """Stan's slow adaptation windows ``[(start, end)]`` for the inverse mass matrix (doubling sizes)."""
    if num_warmup < 20:
        return []
    init, term, base = 75, 50, 25
    if init + term + base > num_warmup:
        init, term = int(0.15 * num_warmup), int(0.1 * num_warmup)
        base = num_warmup - init - term
    windows, start, size = [], init, base
    end_slow = num_warmup - term
    while start < end_slow:
        end = start + size
        if end + 2 * size > end_slow:  # the next window would not fit: stretch this one to the end
            end = end_slow
        windows.append((start, end))
        start, size = end, 2 * size
    return windows
