"""Fair tuning: every method picks its one key option by validation NLL from a small grid.

A Bayesian method earns its place only if it beats a *tuned* plain network,
so ``bayeswrap compare`` gives every method, MAP included, the same treatment:
one knob, a small grid, the same training budget per grid point, and the value
with the lowest validation NLL of the posterior predictive wins (ties go to the
first grid point). The knobs are those that set how much the prior or the
posterior noise matters:

==============  =====================  =========================================
method          option                 why this one
==============  =====================  =========================================
map             ``prior_std``          the weight decay 1/(N σ²) of the plain network
laplace         ``prior_precision``    post hoc, on the fitted curvature (no retraining;
                                       :meth:`bayeswrap.Laplace.optimize_prior_precision`)
vi, ivon        ``kl_weight``          the tempering of the KL term (BayesDLL's ``kld``)
mc_dropout      ``p_drop``             the dropout rate sets the posterior spread
sgld            ``noise_scale``        the temperature T = noise_scale² of the sampled posterior
==============  =====================  =========================================

Reference: the tuning protocol of Ovadia et al. 2019 ("Can You Trust Your
Model's Uncertainty?", §4: hyper-parameters chosen on in-distribution
validation NLL), applied to every method alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["TUNING", "tuning_option", "select_by_val_nll", "tune"]

#: method → (option, grid). Grids are log-spaced around the library defaults.
TUNING: dict[str, tuple[str, tuple[float, ...]]] = {
    "map": ("prior_std", (0.1, 0.3, 1.0, 3.0)),
    "laplace": ("prior_precision", tuple(10.0 ** k for k in range(-4, 5))),
    "vi": ("kl_weight", (0.001, 0.01, 0.1, 1.0)),
    "ivon": ("kl_weight", (0.001, 0.01, 0.1, 1.0)),
    "mc_dropout": ("p_drop", (0.05, 0.1, 0.2, 0.3)),
    "sgld": ("noise_scale", (0.1, 0.3, 1.0)),
}


def tuning_option(method: str) -> tuple[str, tuple[float, ...]] | None:
    """``(option, grid)`` tuned for ``method``, or None if the method has no tuned option."""
    return TUNING.get(method)


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
