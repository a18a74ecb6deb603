"""Fair tuning: every method picks its one key option by validation NLL from a small grid.

A Bayesian method earns its place only if it beats a *tuned* plain network,
so ``bayeswrap compare`` gives every method, MAP included, the same treatment:
one knob, a small grid, the same training budget per grid point, and the value
with the lowest validation NLL of the posterior predictive wins (ties go to the
first grid point). Each method class names its knob and grid in its ``tuning``
attribute (e.g. ``MAP.tuning = ("prior_std", (0.1, 0.3, 1.0, 3.0))``; the live
view over the registry is :data:`bayeswrap.methods.TUNING`): the options that
set how much the prior or the posterior noise matters (MAP's ``prior_std``,
Laplace's post hoc ``prior_precision``, VI's and IVON's ``kl_weight``,
MC-dropout's ``p_drop``, SGLD's ``noise_scale``).

This module holds the selection rule only.

Reference: the tuning protocol of Ovadia et al. 2019 ("Can You Trust Your
Model's Uncertainty?", §4: hyper-parameters chosen on in-distribution
validation NLL), applied to every method alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["select_by_val_nll", "tune"]


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


def tune(grid: Sequence[float], val_nll_of: Callable[[float], float]) -> dict:
    """Scores every grid value and picks the best.

    Args:
        grid: candidate values of the option.
        val_nll_of: ``value -> validation NLL`` (trains and evaluates one candidate;
            may return ``inf`` for a run that diverged).

    Returns:
        ``{"grid": [...], "val_nll": [...], "chosen": value, "chosen_index": i}``.
    """
    scores = [float(val_nll_of(v)) for v in grid]
    i = select_by_val_nll(grid, scores)
    return {"grid": [float(v) for v in grid], "val_nll": scores, "chosen": float(grid[i]), "chosen_index": i}
