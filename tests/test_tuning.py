"""Fair tuning: the selection picks the grid point with the lowest validation NLL."""

import math

import pytest

from bayeswrap.evaluation.tuning import select_by_val_nll, tune
from bayeswrap.methods import TUNING


def test_selection_is_the_argmin_of_validation_nll():
    grid = [0.01, 0.1, 0.3, 1.0]
    nll = [0.41, 0.27, 0.33, 0.29]
    assert select_by_val_nll(grid, nll) == 1
    # naive reference: the smallest finite value, first on ties
    assert select_by_val_nll(grid, [0.5, 0.2, 0.2, 0.3]) == 1
    assert select_by_val_nll(grid, [math.nan, math.inf, 0.9, 0.8]) == 3


def test_tune_scores_every_value_once_and_records_them():
    calls = []

    def score(v):
        calls.append(v)
        return (math.log10(v) + 1.2) ** 2  # minimum near 10**-1.2: the grid's 0.1 is closest

    record = tune([0.01, 0.1, 0.3, 1.0], score)
    assert calls == [0.01, 0.1, 0.3, 1.0]
    assert record["chosen"] == 0.1 and record["chosen_index"] == 1
    assert record["val_nll"] == pytest.approx([score(v) for v in (0.01, 0.1, 0.3, 1.0)])


@pytest.mark.parametrize("grid, nll, message", [
    ([], [], "same length >= 1"),
    ([1.0, 2.0], [0.1], "same length"),
    ([1.0, 2.0], [math.nan, math.inf], "non-finite validation NLL"),
])
def test_bad_input(grid, nll, message):
    with pytest.raises(ValueError, match=message):
        select_by_val_nll(grid, nll)


def test_every_compared_method_has_one_knob():
    assert {m: o for m, (o, _) in TUNING.items()} == {
        "map": "prior_std", "laplace": "prior_precision", "vi": "kl_weight", "ivon": "kl_weight",
        "mc_dropout": "p_drop", "sgld": "noise_scale"}
    assert all(len(grid) >= 3 and min(grid) > 0 for _, grid in TUNING.values())
