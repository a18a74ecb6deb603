"""The one chain runner of the full-batch samplers: chains, warm-up, thinning, the draw store and diagnostics.

:func:`sample_chains` starts C chains (:func:`starting_points`: the model's weights plus N(0, ``init_jitter``²)
noise, or given states), checks that U(θ) is finite there, sets the kernel up
(:class:`~bayeswrap.methods.mcmc.kernel.MCMCKernel`) and steps it ``num_warmup + num_samples`` times. The warm-up
transitions are only for the kernel's adaptation; of the others it counts acceptances and divergences and offers
every ``thinning``-th state to a :class:`~bayeswrap.core.samples.SampleStore` (memory-bounded, thinned by two when
full), the same store SGLD keeps its iterates in. A kernel knows nothing of this. :class:`KeptDraws` reads the
store back per chain (the arviz layout) or pooled over the chains (what the ``StoredDraws`` predictive evaluates).

:func:`chain_diagnostics` reports rank-normalised split R-hat, bulk and tail ESS per parameter tensor
(:mod:`bayeswrap.evaluation.convergence`) with the run's acceptance rates, step sizes or proposal scales and
divergences. They need at least :data:`MIN_KEPT_DRAWS` kept draws per chain (split chains of two draws each);
:func:`check_budget` checks a budget against that before any sampling. A run whose chains hardly move
(acceptance below :data:`LOW_ACCEPTANCE` in some chain, e.g. from ``init_step_size=1e30``, or every transition
divergent) ends with a ``RuntimeWarning`` that names the starting step size or scale and the acceptance rates.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping

import torch

from bayeswrap.core.checks import check_float, check_int
from bayeswrap.core.samples import SampleStore, spread_indices
from bayeswrap.evaluation import convergence as diag
from bayeswrap.methods.mcmc.kernel import ChainState, MCMCKernel
from bayeswrap.methods.mcmc.potential import FlatLayout, Potential

#: the fewest kept draws per chain the diagnostics accept: split R-hat and the ESS split each chain in two
#: halves of at least 2 draws
MIN_KEPT_DRAWS = 4

#: the most iterations (``num_warmup + num_samples``) one run runs
MAX_ITERATIONS = 10_000_000

#: post-warm-up acceptance rate below which a chain is reported as stuck (a ``RuntimeWarning``)
LOW_ACCEPTANCE = 0.01


def kept_draws(num_samples: int, thinning: int, max_samples: int) -> int:
    """The fewest draws per chain a run keeps: one per ``thinning`` of the ``num_samples`` iterations,
    ⌈num_samples / thinning⌉, or, when that exceeds the store's ``max_samples``, the ⌈max_samples / 2⌉ the
    store keeps at least after thinning itself by two.
    """
    offered = -(-num_samples // thinning)
    return offered if offered <= max_samples else (max_samples + 1) // 2


def check_budget(options: Mapping, *, default_chains: int, max_samples: int, for_diagnostics: bool) -> dict:
    """Checks a run's budget before any work.

    Args:
        options: ``num_samples``, ``num_warmup``, ``num_chains`` (None: ``default_chains``), ``thinning`` and
            ``init_jitter``.
        default_chains: the chains of a run that gives none.
        max_samples: the store's capacity (kept draws of every chain).
        for_diagnostics: also require every chain to keep at least :data:`MIN_KEPT_DRAWS` draws
            (:func:`kept_draws`), which :func:`chain_diagnostics` needs.

    Returns:
        The options, checked, ``{name: value}``.

    Raises:
        ValueError: naming the option, its value and what is accepted, for a bad value, more than
            :data:`MAX_ITERATIONS` iterations, or (``for_diagnostics``) too few kept draws.
    """
    out = {name: check_int(name, options[name], minimum=0) for name in ("num_samples", "num_warmup")}  # iterations
    chains = options["num_chains"]
    out["num_chains"] = default_chains if chains is None else check_int("num_chains", chains, minimum=1)
    out["thinning"] = check_int("thinning", options["thinning"], minimum=1)
    out["init_jitter"] = check_float("init_jitter", options["init_jitter"], low=0.0)
    if out["num_warmup"] + out["num_samples"] > MAX_ITERATIONS:
        raise ValueError(f"num_warmup={out['num_warmup']} + num_samples={out['num_samples']} iterations is "
                         f"above the bound of {MAX_ITERATIONS:,} per run_chains call; accepted: at most "
                         f"{MAX_ITERATIONS:,} in all")
    kept = kept_draws(out["num_samples"], out["thinning"], max_samples)
    if for_diagnostics and kept < MIN_KEPT_DRAWS:
        need = (MIN_KEPT_DRAWS - 1) * out["thinning"] + 1
        fix = (f"max_samples >= {2 * MIN_KEPT_DRAWS - 1}" if max_samples < 2 * MIN_KEPT_DRAWS - 1
               and -(-out["num_samples"] // out["thinning"]) > max_samples else
               f"num_samples >= {need} at thinning={out['thinning']}")
        raise ValueError(f"num_samples={out['num_samples']} with thinning={out['thinning']} and max_samples="
                         f"{max_samples} keeps {kept} draw(s) per chain; the diagnostics (split R-hat, "
                         f"ESS) need at least {MIN_KEPT_DRAWS} per chain; accepted: {fix}")
    return out


class KeptDraws:
    """The kept draws of C chains, read from a :class:`~bayeswrap.core.samples.SampleStore` whose rows are states
    ``{name: (C, *shape)}`` (D rows), per chain or pooled over the chains.

    Pooled draw i, in chain order (chain 0's D draws, then chain 1's, ...), is row i mod D of chain i // D.
    :meth:`indices` and :meth:`draws` are the store API of the
    :class:`~bayeswrap.methods.predictives.StoredDraws` predictive, over the C·D pooled draws.

    Args:
        store: the store the runner offered the states to (non-empty).
    """

    def __init__(self, store: SampleStore):
        self.store = store
        self.num_chains = store.shapes[store.names[0]][0]

    def by_chain(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every kept draw per chain, ``{name: (C, D, *shape)}`` (the arviz layout)."""
        return {n: t.transpose(0, 1) for n, t in self.store.all(device=device, dtype=dtype).items()}

    def indices(self, num_samples: int) -> torch.Tensor:
        """S pooled-draw indices spread evenly over the C·D draws (:func:`~bayeswrap.core.samples.spread_indices`)."""
        return spread_indices(num_samples, len(self.store) * self.num_chains)

    def draws(self, indices: torch.Tensor, device: torch.device | None = None,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The pooled draws at ``indices`` (int64 (S,)), ``{name: (S, *shape)}`` on ``device`` in ``dtype``."""
        rows = len(self.store)
        chain, row = indices.div(rows, rounding_mode="floor"), indices.remainder(rows)
        states = self.store.draws(row, device=device, dtype=dtype)  # (S, C, *shape)
        pick = torch.arange(len(indices))
        return {n: t[pick.to(t.device), chain.to(t.device)] for n, t in states.items()}


def starting_points(theta: Mapping[str, torch.Tensor], chains: int, init: Mapping[str, torch.Tensor] | None,
                    init_jitter: float, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """The chains' starting states ``{name: (chains, *shape)}``.

    Args:
        theta: the model's current Bayesian parameters ``{name: (*shape)}``.
        chains: C.
        init: given starting states ``{name: (C, *shape)}`` (moved to ``theta``'s device and dtype), or None:
            ``theta`` plus N(0, ``init_jitter``²) noise per chain, drawn from ``generator``.
        init_jitter: that noise's std (≥ 0).
        generator: optional ``torch.Generator``.

    Raises:
        ValueError: for an ``init`` that lacks a parameter or has the wrong shape.
    """
    if init is None:
        return {n: t.unsqueeze(0) + init_jitter * torch.randn((chains, *t.shape), generator=generator,
                                                               device=t.device, dtype=t.dtype)
                for n, t in theta.items()}
    start = {}
    for n, t in theta.items():
        if n not in init or tuple(init[n].shape) != (chains, *t.shape):
            raise ValueError(f"init[{n!r}] must have shape {(chains, *t.shape)} (chains, *parameter shape)")
        start[n] = init[n].to(t)
    return start


def sample_chains(kernel: MCMCKernel, potential: Potential, layout: FlatLayout, start: Mapping[str, torch.Tensor],
                  store: SampleStore, *, num_warmup: int, num_samples: int, thinning: int,
                  generator: torch.Generator | None, label: str) -> dict:
    """Runs the chains from ``start`` with ``kernel`` and offers every ``thinning``-th post-warm-up state to ``store``.

    Args:
        kernel: the transition kernel (set up here).
        potential: U over the chains' flat vectors.
        layout: the named parameters ↔ flat vectors.
        start: the starting states ``{name: (C, *shape)}`` (:func:`starting_points`).
        store: where the kept draws ``{name: (C, *shape)}`` go (cleared by the caller).
        num_warmup, num_samples, thinning: the checked budget (:func:`check_budget`).
        generator: optional ``torch.Generator`` for every random draw.
        label: the method's name, for the warning about stuck chains.

    Returns:
        The run's statistics: ``acceptance_rate`` and ``divergences`` per chain after warm-up, the kernel's own
        (:meth:`~bayeswrap.methods.mcmc.kernel.MCMCKernel.diagnostics`), ``seconds``, ``num_chains``,
        ``num_warmup``, ``num_samples`` and ``thinning``.

    Raises:
        ValueError: if U(θ) is not finite at some chain's start.

    Warns:
        RuntimeWarning: if a chain's acceptance rate after warm-up is below :data:`LOW_ACCEPTANCE`, or every one of
            its post-warm-up transitions is divergent.
    """
    states = layout.flatten(start)
    grads, values = potential.grad_and_values(states)
    if not bool(torch.isfinite(values).all()):
        bad = [i for i, v in enumerate(values.tolist()) if not math.isfinite(v)]
        raise ValueError(f"the initial potential U(θ) is not finite for chain(s) {bad} (U = "
                         f"{values.tolist()}): check the inputs, prior_std and the starting weights")
    chains = states.shape[0]
    tic = time.perf_counter()
    state = ChainState.start(states, values, grads)
    kernel.setup(potential, num_warmup, generator, state)
    accepted = torch.zeros(chains, dtype=states.dtype, device=states.device)
    divergences = torch.zeros(chains, dtype=torch.long, device=states.device)
    for it in range(num_warmup + num_samples):
        state = kernel.step(state, generator)
        if it >= num_warmup:
            accepted += state.accepted.to(states.dtype)
            divergences += state.divergent.long()
            if (it - num_warmup) % thinning == 0:
                store.offer(layout.split(state.position))
    stats = {"acceptance_rate": (accepted / max(num_samples, 1)).tolist(), **kernel.diagnostics(),
             "divergences": divergences.tolist(), "seconds": time.perf_counter() - tic, "num_chains": chains,
             "num_warmup": num_warmup, "num_samples": num_samples, "thinning": thinning}
    _warn_if_stuck(label, stats, num_samples, kernel.start_option())
    return stats


def _warn_if_stuck(label: str, stats: dict, num_samples: int, start: str) -> None:
    """A ``RuntimeWarning`` if some chain barely moved after warm-up (acceptance < :data:`LOW_ACCEPTANCE`)
    or every post-warm-up transition of a chain was divergent.
    """
    if num_samples == 0:
        return
    rates = [float(r) for r in stats["acceptance_rate"]]
    divergences = [int(d) for d in stats["divergences"]]
    stuck = [i for i, r in enumerate(rates) if not r >= LOW_ACCEPTANCE]
    divergent = [i for i, d in enumerate(divergences) if d >= num_samples]
    if not stuck and not divergent:
        return
    chains = sorted(set(stuck) | set(divergent))
    setting = {k: stats[k] for k in ("step_size", "proposal_scale") if k in stats}
    final = "; ".join(f"final {k} {', '.join(f'{v:.3g}' for v in vals)}" for k, vals in setting.items())
    # the user's frame: above this function, sample_chains, run_chains and run_chains's no_grad wrapper
    warnings.warn(f"{label}: chain(s) {chains} hardly moved after warm-up: acceptance rate "
                  f"{', '.join(f'{r:.3g}' for r in rates)} (below {LOW_ACCEPTANCE:g} in chain(s) {stuck}), "
                  f"{', '.join(map(str, divergences))} divergent of {num_samples} transitions per chain; "
                  f"started from {start}" + (f"; {final}" if final else "") +
                  ". The draws are not a posterior sample: lower the starting value, run a longer warm-up, or "
                  "check the prior and the data", RuntimeWarning, stacklevel=5)


def chain_diagnostics(draws: Mapping[str, torch.Tensor], stats: Mapping) -> dict:
    """Convergence diagnostics of kept draws.

    Args:
        draws: ``{name: (chains, draws, *shape)}`` (the arviz layout, :meth:`KeptDraws.by_chain`).
        stats: the run's statistics (:func:`sample_chains`); their acceptance rates, step sizes or proposal
            scales, divergences and seconds are reported with the diagnostics.

    Returns:
        ``{"parameters": {name: {"rhat": max R-hat, "ess_bulk": min bulk ESS, "ess_tail": min tail ESS}},
        "summary": {...the same over every tensor...}, "acceptance_rate", "step_size" (HMC) or "proposal_scale"
        (MH), "divergences", "seconds"}``. R-hat is rank-normalised split R-hat and the ESS are bulk and tail ESS
        (Vehtari et al. 2021), via :mod:`bayeswrap.evaluation.convergence`.

    Raises:
        ValueError: with fewer than :data:`MIN_KEPT_DRAWS` (4) kept draws per chain (split chains need 2 each).
    """
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
    extra = {k: v for k, v in stats.items() if k in ("acceptance_rate", "step_size", "proposal_scale",
                                                      "divergences", "seconds")}
    return {"parameters": per, "summary": summary, **extra}


def _nanmax(t: torch.Tensor) -> float:
    t = t[~torch.isnan(t)]
    return float(t.max()) if t.numel() else math.nan


def _nanmin(t: torch.Tensor) -> float:
    t = t[~torch.isnan(t)]
    return float(t.min()) if t.numel() else math.nan
