"""Fair tuning: every method picks its key options by validation NLL, on a grid that brackets the optimum.

A Bayesian method earns its place only if it beats a *tuned* plain network,
so ``bayeswrap compare`` gives every method, MAP included, the same treatment:
the same training budget per candidate, and the value with the lowest
validation NLL of the posterior predictive wins. Each method class names its
knob and starting grid in its ``tuning`` attribute (e.g.
``MAP.tuning = ("prior_std", (0.1, 0.3, 1.0, 3.0, 10.0))``; the live view over
the registry is :data:`bayeswrap.methods.TUNING`) and the values a grid may be
extended to in its ``tuning_bounds`` attribute: the options that set how much
the prior or the posterior noise matters (MAP's ``prior_std``, Laplace's post
hoc ``prior_precision``, VI's and IVON's ``kl_weight``, MC-dropout's
``p_drop``, SGLD's ``noise_scale``).

**Bracketing** (:func:`tune`). A winner at the edge of its grid says only that
the optimum lies at or beyond that edge. The grid is therefore extended past
that edge by one geometric step at a time, the ratio r = g₁/g₀ of the two grid
points at that edge (g₀ → g₀/r below, g_last → g_last·r above, i.e. the same
step in log-value), clipped to the option's bounds, until the winner is an
interior point. The search stops without bracketing, and says why in the
record's ``bound_hit``, when the edge is a bound of the option, after
``max_extensions`` steps on that side, or when the new point's score is not
finite (a diverged run). An extension wins only if it is strictly better.

**The prior scale** (:func:`tune_with_prior`). Every method with a prior also
gets its prior std σ tuned: stage 1 keeps σ (MAP's tuned σ, inherited) and
tunes the method's own knob; stage 2 keeps that knob and scores σ/3 and 3σ
(bracketed like any grid; σ's stage-1 score is reused), so that the
"inherit" candidate (σ) and the "joint" ones are compared on validation NLL.

**A knob that tempers the whole posterior** (``tempered=True``; a method class
declares it with ``knob_tempers_posterior``: VI's and IVON's ``kl_weight``). The
per-datum loss NLL + w · KL(q ‖ N(θ̄, prior_std²)) / N with w < 1 at a fixed prior
std also weakens the prior's pull on the means, (w / prior_std²) (m − θ̄) / N,
so the means of a tuned run grow past MAP's. Scored at prior_std = σ √w instead,
the pull stays MAP's (m − θ̄)/(N σ²) and only the entropy term is weighted by w:
the objective is the ELBO of the tempered posterior p(θ | D)^{1/w} with prior
N(θ̄, σ²) (Wenzel et al. 2020, "How Good is the Bayes Posterior in Deep Neural
Networks Really?", eq. 4, temperature T = w). Both stages then search in (σ, w):
stage 1 tunes w at σ, stage 2 scores σ/3 and 3σ at the chosen w, and every
candidate is trained at ``{"prior_std": σ √w, knob: w}``. The record's
``options`` are those trained values (what a final run is given, so that it
reproduces); its ``reference_prior_std`` is σ.

This module holds the selection rules only: it knows scores, never a run.

Reference: the tuning protocol of Ovadia et al. 2019 ("Can You Trust Your
Model's Uncertainty? Evaluating Predictive Uncertainty Under Dataset Shift",
§4: hyper-parameters chosen on in-distribution validation NLL), applied to
every method alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

__all__ = ["MAX_EXTENSIONS", "PRIOR_STEP", "UNBOUNDED", "select_by_val_nll", "tune", "tune_with_prior"]

#: at most this many extensions past each edge of a grid
MAX_EXTENSIONS = 3
#: stage 2 of :func:`tune_with_prior` scores the prior std at σ / PRIOR_STEP and σ · PRIOR_STEP
PRIOR_STEP = 3.0
#: the bounds of an option that declares none: any positive value
UNBOUNDED = (0.0, math.inf)


def select_by_val_nll(grid: Sequence[float], val_nll: Sequence[float]) -> int:
    """Index of the grid point with the lowest validation NLL (the first one on ties).

    Args:
        grid: the candidate values, length G ≥ 1.
        val_nll: validation NLL (nats per example) of each candidate, length G.
            Non-finite values (a diverged run) never win.

    Returns:
        The index in ``grid`` of the chosen value.

    Raises:
        ValueError: if the lengths differ, the grid is empty, or every NLL is non-finite.
    """
    if len(grid) != len(val_nll) or not len(grid):
        raise ValueError(f"grid (length {len(grid)}) and val_nll (length {len(val_nll)}) must have the same "
                         "length >= 1")
    finite = [(v, i) for i, v in enumerate(val_nll) if math.isfinite(v)]
    if not finite:
        raise ValueError(f"every grid point {list(grid)} gave a non-finite validation NLL {list(val_nll)}")
    return min(finite)[1]


def tune(grid: Sequence[float], val_nll_of: Callable[[float], float], *,
         bounds: tuple[float, float] = UNBOUNDED, max_extensions: int = MAX_EXTENSIONS,
         scored: Mapping[float, float] | None = None,
         on_score: Callable[[float, int, int], None] | None = None) -> dict:
    """Scores a grid, extending it past an edge that wins until the winner is interior (see the module docstring).

    Args:
        grid: candidate values of the option, positive and distinct (any order).
        val_nll_of: ``value -> validation NLL`` (trains and evaluates one candidate;
            may return ``inf`` or NaN for a run that diverged).
        bounds: ``(low, high)``, the values an extension may reach (0 < low < high ≤ inf);
            they limit extensions only, the given grid is scored as it is.
        max_extensions: extensions allowed past each edge (integer ≥ 0).
        scored: ``{value: validation NLL}`` already known (e.g. from an earlier
            stage); these grid values are not scored again.
        on_score: optional progress callback ``(value, index, total)``, called just before ``val_nll_of(value)``
            (not for a reused value): ``index`` is the point's 1-based position among this search's points so
            far, reused ones included, and ``total`` the number of points known at that moment (the grid, plus
            the extensions added so far: it grows by one with each extension).

    Returns:
        The record ``{"grid": [...], "val_nll": [...], "chosen": value,
        "chosen_index": i, "extensions": [...], "reused": [...], "bound_hit": ...,
        "bounds": [low, high]}``: the grid sorted ascending with every scored
        value (the extensions included) and its NLLs (non-finite ones as
        ``inf``); ``extensions`` lists the added values in the order they were
        scored and ``reused`` the values taken from ``scored``. ``bound_hit`` is
        None when the winner is interior, else ``{"side": "low" | "high" | "both",
        "reason": ...}`` with reason ``"value_bound"`` (the edge is a bound),
        ``"max_extensions"``, ``"non_finite"`` (the next point beyond diverged)
        or ``"single_point"`` (a one-point grid has no step to extend by). Ties
        go to the value scored first (the given grid in its order, then the
        extensions), so an extension wins only by being strictly better.

    Raises:
        ValueError: for an empty grid, a non-positive, non-finite or repeated
            value, bad bounds, or when every score is non-finite.
    """
    values = [float(v) for v in grid]
    low, high = float(bounds[0]), float(bounds[1])
    if not values or any(not (math.isfinite(v) and v > 0) for v in values) or len(set(values)) != len(values):
        raise ValueError(f"grid={list(grid)} must be distinct finite numbers > 0, at least one")
    if not (0 <= low < high) or math.isnan(high):
        raise ValueError(f"bounds={bounds!r} must be (low, high) with 0 <= low < high")
    if not (isinstance(max_extensions, int) and max_extensions >= 0):
        raise ValueError(f"max_extensions={max_extensions!r} must be an integer >= 0")
    known = dict(scored or {})
    order: list[float] = []  # values in scoring order (decides ties)
    nll: dict[float, float] = {}
    reused: list[float] = []
    extensions: list[float] = []

    def score(v: float) -> float:
        if v in known:
            reused.append(v)
            s = known[v]
        else:
            if on_score is not None:
                on_score(v, len(order) + 1, len(values) + len(extensions))
            s = val_nll_of(v)
        s = float(s)
        nll[v] = s if math.isfinite(s) else math.inf
        order.append(v)
        return nll[v]

    for v in values:
        score(v)
    done = {"low": 0, "high": 0}
    bound_hit = None
    while True:
        best = order[select_by_val_nll(order, [nll[v] for v in order])]
        ordered = sorted(nll)
        if len(ordered) == 1:
            bound_hit = {"side": "both", "reason": "single_point"}
            break
        if best not in (ordered[0], ordered[-1]):
            break
        side = "low" if best == ordered[0] else "high"
        edge, inner = (ordered[0], ordered[1]) if side == "low" else (ordered[-1], ordered[-2])
        if (side == "low" and edge <= low) or (side == "high" and edge >= high):
            bound_hit = {"side": side, "reason": "value_bound"}
            break
        if done[side] >= max_extensions:
            bound_hit = {"side": side, "reason": "max_extensions"}
            break
        step = edge / inner  # the edge pair's ratio: < 1 below, > 1 above
        new = max(_tidy(edge * step), low) if side == "low" else min(_tidy(edge * step), high)
        if new in nll or not (math.isfinite(new) and new > 0):  # the step underflowed or overflowed
            bound_hit = {"side": side, "reason": "value_bound"}
            break
        done[side] += 1
        extensions.append(new)
        if not math.isfinite(score(new)):
            bound_hit = {"side": side, "reason": "non_finite"}
            break
    ordered = sorted(nll)
    best = order[select_by_val_nll(order, [nll[v] for v in order])]
    return {"grid": ordered, "val_nll": [nll[v] for v in ordered], "chosen": best,
            "chosen_index": ordered.index(best), "extensions": extensions, "reused": reused,
            "bound_hit": bound_hit, "bounds": [low, high]}


def tune_with_prior(score: Callable[[dict], float], *, knob: str | None, grid: Sequence[float] = (),
                    bounds: tuple[float, float] = UNBOUNDED, prior_std: float | None,
                    prior_bounds: tuple[float, float] = UNBOUNDED, max_extensions: int = MAX_EXTENSIONS,
                    tempered: bool = False, on_score: Callable[[dict], None] | None = None) -> dict:
    """A method's knob and its prior std σ, in the two stages of the module docstring.

    * ``knob == "prior_std"`` (MAP): one stage, ``grid`` bracketed within ``bounds``.
    * another knob: stage ``"knob"`` tunes it over ``grid`` at σ = ``prior_std``;
      stage ``"prior_std"`` keeps the chosen knob and scores σ/3 and 3σ (clipped
      to ``prior_bounds``, bracketed), reusing σ's stage-1 score. The σ with the
      lowest validation NLL is kept: ``"inherit"`` if it is σ, else ``"joint"``.
    * ``knob=None`` (no knob scored here, e.g. one set post hoc inside ``score``):
      only the prior std stage, σ scored too.
    * ``prior_std=None`` (no prior): only the knob stage.

    Args:
        score: ``{option: value} -> validation NLL`` of one candidate (trains and
            evaluates it; ``inf`` for a diverged run). It receives ``prior_std``
            (unless ``prior_std`` is None) and the knob.
        knob: the method's own option, ``"prior_std"``, or None.
        grid: the knob's starting grid.
        bounds: the values the knob's grid may be extended to.
        prior_std: σ of stage 1 (MAP's tuned value, or the configured one); None for no prior.
        prior_bounds: the values the prior std grid may be extended to.
        max_extensions: extensions per side and stage, see :func:`tune`.
        tempered: the knob w tempers the whole posterior (see the module docstring):
            each candidate (σ, w) is scored, and the chosen one returned, as
            ``{"prior_std": σ √w, knob: w}``. Needs a knob other than ``"prior_std"``
            and a prior std.
        on_score: optional progress callback, called with ``{"stage", "option", "value", "index", "total",
            "fixed"}`` just before each candidate is scored (``index``/``total`` as in :func:`tune`'s
            ``on_score``, within the stage; ``value`` and ``fixed`` in the stage's own terms, before tempering).

    Returns:
        ``{"options": {option: chosen value}, "val_nll": the winner's validation
        NLL, "choice": "inherit" | "joint" | None, "stages": [...]}``: each stage
        is a :func:`tune` record with ``"stage"`` (``"knob"`` or ``"prior_std"``),
        ``"option"`` and ``"fixed"`` (the options held fixed) added. ``choice`` is
        None where the prior std had no stage of its own after a knob. With
        ``tempered`` the stages' grids, ``fixed`` and ``chosen`` are in (σ, w), each
        stage adds ``"trained"`` (the options each grid point was trained with, in
        grid order), ``options`` holds the trained values and ``"reference_prior_std"``
        the chosen σ.

    Raises:
        ValueError: when neither a knob nor a prior std is given, for ``tempered``
            without a knob or prior std to couple, or as :func:`tune`.
    """
    if knob is None and prior_std is None:
        raise ValueError("nothing to tune: knob=None and prior_std=None")
    if tempered and (knob in (None, "prior_std") or prior_std is None):
        raise ValueError(f"tempered=True couples the prior std with a knob that tempers the posterior; got "
                         f"knob={knob!r}, prior_std={prior_std!r}; accepted: a knob such as 'kl_weight' and a "
                         "prior std > 0")
    stages: list[dict] = []
    options: dict = {}

    def trained(candidate: dict) -> dict:
        """The options a candidate is trained with: σ √w for the prior std when the knob tempers."""
        if not tempered:
            return candidate
        return {**candidate, "prior_std": _tidy(candidate["prior_std"] * math.sqrt(candidate[knob]))}

    def stage(name: str, option: str, fixed: dict, values, limits, scored=None) -> dict:
        def announce(value: float, index: int, total: int) -> None:
            on_score({"stage": name, "option": option, "value": value, "index": index, "total": total,
                      "fixed": dict(fixed)})

        record = tune(values, lambda v: score(trained({**fixed, option: v})), bounds=limits,
                      max_extensions=max_extensions, scored=scored, on_score=None if on_score is None else announce)
        extra = {"trained": [trained({**fixed, option: v}) for v in record["grid"]]} if tempered else {}
        stages.append({"stage": name, "option": option, "fixed": dict(fixed), **record, **extra})
        options[option] = record["chosen"]
        return record

    def best_nll(record: dict) -> float:
        return record["val_nll"][record["chosen_index"]]

    if knob == "prior_std" or (knob is not None and prior_std is None):
        record = stage("knob", knob, {}, grid, bounds)
        return {"options": options, "val_nll": best_nll(record), "choice": None, "stages": stages}
    sigma = float(prior_std)
    scored = None
    fixed: dict = {}
    if knob is not None:
        first = stage("knob", knob, {"prior_std": sigma}, grid, bounds)
        scored = {sigma: best_nll(first)}
        fixed = {knob: first["chosen"]}
    lo, hi = prior_bounds
    candidates = sorted({sigma, min(max(_tidy(sigma / PRIOR_STEP), lo), hi), min(max(_tidy(sigma * PRIOR_STEP), lo), hi)})
    record = stage("prior_std", "prior_std", fixed, candidates, prior_bounds, scored)
    options = {"prior_std": options.pop("prior_std"), **options}
    extra = {}
    if tempered:
        extra = {"reference_prior_std": options["prior_std"]}
        options = trained(options)
    return {"options": options, "val_nll": best_nll(record),
            "choice": "inherit" if record["chosen"] == sigma else "joint", "stages": stages, **extra}


def _tidy(value: float) -> float:
    """``value`` to 12 significant digits, so that steps of 0.3 by 3 give 0.1, not 0.09999999999999999."""
    return float(f"{value:.12g}")
