"""Fair tuning: the selection picks the lowest validation NLL, on grids extended until they bracket it.

Oracles: parabolas in log-value with a known minimum, whose winner on the extended
geometric grid is worked out by hand.
"""

import math

import pytest

from bayeswrap.evaluation.tuning import select_by_val_nll, tune, tune_with_prior
from bayeswrap.methods import METHODS, TUNING, tuning_bounds


def parabola(center: float):
    """Validation NLL stand-in: a parabola in log10(value), minimal at ``center``."""
    return lambda v: (math.log10(v) - math.log10(center)) ** 2


def test_selection_is_the_argmin_of_validation_nll():
    grid = [0.01, 0.1, 0.3, 1.0]
    nll = [0.41, 0.27, 0.33, 0.29]
    assert select_by_val_nll(grid, nll) == 1
    # naive reference: the smallest finite value, first on ties
    assert select_by_val_nll(grid, [0.5, 0.2, 0.2, 0.3]) == 1
    assert select_by_val_nll(grid, [math.nan, math.inf, 0.9, 0.8]) == 3


def test_an_interior_winner_scores_every_value_once_and_is_not_extended():
    calls = []

    def score(v):
        calls.append(v)
        return parabola(10 ** -1.2)(v)  # the grid's 0.1 is closest

    record = tune([0.01, 0.1, 0.3, 1.0], score, bounds=(1e-3, 1e3))
    assert calls == [0.01, 0.1, 0.3, 1.0]
    expected = [parabola(10 ** -1.2)(v) for v in calls]
    assert record == {"grid": [0.01, 0.1, 0.3, 1.0], "val_nll": pytest.approx(expected),
                      "chosen": 0.1, "chosen_index": 1, "extensions": [], "reused": [], "bound_hit": None,
                      "bounds": [1e-3, 1e3]}


def test_a_winner_at_the_edge_is_extended_by_the_edge_ratio_until_interior():
    calls = []

    def score(v):
        calls.append(v)
        return parabola(50.0)(v)

    # 10 wins on [0.1 .. 10]; ratio 10/3 above: 33.33 (|log 33.3/50| = 0.18, better), 111.1 (0.35, worse): stop
    record = tune([0.1, 0.3, 1.0, 3.0, 10.0], score, bounds=(1e-3, 1e3))
    assert record["extensions"] == pytest.approx([100 / 3, 1000 / 9])
    assert calls[5:] == record["extensions"]
    assert record["chosen"] == pytest.approx(100 / 3) and record["bound_hit"] is None
    assert record["grid"] == sorted(record["grid"]) and len(record["grid"]) == 7
    assert record["grid"][record["chosen_index"]] == record["chosen"]
    assert record["val_nll"] == pytest.approx([parabola(50.0)(v) for v in record["grid"]])
    # the same below: ratio 1/3 from the low edge, 0.1 -> 0.0333 -> 0.0111 (minimum 0.02: 0.0333 wins, interior)
    record = tune([0.1, 0.3, 1.0], parabola(0.02))
    assert record["extensions"] == pytest.approx([1 / 30, 1 / 90]) and record["chosen"] == pytest.approx(1 / 30)


def test_the_bound_stops_the_extension_and_is_recorded():
    # minimum 1e5 beyond the bound 1e3: 300 -> 3000 is clipped to 1000, which is the bound
    record = tune([3.0, 30.0, 300.0], parabola(1e5), bounds=(1e-3, 1e3))
    assert record["extensions"] == [1000.0] and record["chosen"] == 1000.0
    assert record["bound_hit"] == {"side": "high", "reason": "value_bound"}
    # a grid that already reaches its bound is not extended
    record = tune([0.01, 0.1, 0.5], parabola(0.9), bounds=(0.01, 0.5))
    assert record["extensions"] == [] and record["bound_hit"] == {"side": "high", "reason": "value_bound"}
    # at most max_extensions per side
    record = tune([1.0, 10.0], parabola(1e-9), bounds=(1e-12, 1.0), max_extensions=2)
    assert record["extensions"] == pytest.approx([0.1, 0.01]) and record["chosen"] == pytest.approx(0.01)
    assert record["bound_hit"] == {"side": "low", "reason": "max_extensions"}


def test_a_non_finite_score_at_the_extension_stops_it():
    def score(v):  # diverges below 0.05, minimum at 0.01
        return math.nan if v < 0.05 else parabola(0.01)(v)

    record = tune([0.1, 0.3, 1.0], score)
    assert record["extensions"] == pytest.approx([1 / 30]) and record["chosen"] == 0.1
    assert record["val_nll"][0] == math.inf  # NaN recorded as inf, never chosen
    assert record["bound_hit"] == {"side": "low", "reason": "non_finite"}


def test_ties_do_not_extend_and_known_scores_are_reused():
    calls = []

    def flat(v):
        calls.append(v)
        return 1.0

    record = tune([0.1, 1.0], flat)  # 0.1 wins the tie at the low edge; its extension ties: not strictly better
    assert record["extensions"] == pytest.approx([0.01]) and record["chosen"] == 0.1 and record["bound_hit"] is None
    calls.clear()
    record = tune([0.1, 0.3, 0.9], parabola(0.3), scored={0.3: -1.0})
    assert record["reused"] == [0.3] and record["chosen"] == 0.3 and record["val_nll"][1] == -1.0
    assert tune([1.0], flat)["bound_hit"] == {"side": "both", "reason": "single_point"}


@pytest.mark.parametrize("grid, nll, message", [
    ([], [], "same length >= 1"),
    ([1.0, 2.0], [0.1], "same length"),
    ([1.0, 2.0], [math.nan, math.inf], "non-finite validation NLL"),
])
def test_bad_input(grid, nll, message):
    with pytest.raises(ValueError, match=message):
        select_by_val_nll(grid, nll)
    if grid:
        with pytest.raises(ValueError, match="non-finite validation NLL"):
            tune([1.0, 2.0], lambda v: math.inf)
    for bad in ([], [0.0, 1.0], [1.0, 1.0], [math.inf]):
        with pytest.raises(ValueError, match="distinct finite numbers > 0"):
            tune(bad, lambda v: 0.0)


def _separable(sigma_star: float, knob_star: float, calls: list):
    """A stub scorer whose optimum is (σ*, knob*): a parabola in log σ plus one in log knob."""
    def score(options):
        calls.append(dict(options))
        return parabola(sigma_star)(options["prior_std"]) + parabola(knob_star)(options.get("kl_weight", knob_star))
    return score


def test_two_stage_prior_std_keeps_the_better_of_inherit_and_joint():
    calls = []
    record = tune_with_prior(_separable(0.1, 1e-2, calls), knob="kl_weight", grid=[1e-3, 1e-2, 1e-1],
                             bounds=(1e-5, 10.0), prior_std=0.3, prior_bounds=(1e-3, 1e3))
    # stage 1 at the inherited σ = 0.3; stage 2 at the chosen kl_weight: 0.1 and 0.9 scored, 0.3 reused;
    # 0.1 wins at the edge, so 0.0333 is scored too (worse): joint
    assert calls == [{"prior_std": 0.3, "kl_weight": v} for v in (1e-3, 1e-2, 1e-1)] + [
        {"kl_weight": 1e-2, "prior_std": v} for v in (0.1, 0.9, 0.0333333333333)]  # 12 significant digits
    assert record["options"] == {"prior_std": 0.1, "kl_weight": 0.01}
    assert list(record["options"]) == ["prior_std", "kl_weight"] and record["choice"] == "joint"
    knob, prior = record["stages"]
    assert knob["stage"] == "knob" and knob["option"] == "kl_weight" and knob["fixed"] == {"prior_std": 0.3}
    assert knob["chosen"] == 0.01 and knob["extensions"] == [] and knob["bound_hit"] is None
    assert prior["stage"] == "prior_std" and prior["fixed"] == {"kl_weight": 0.01}
    assert prior["grid"] == pytest.approx([1 / 30, 0.1, 0.3, 0.9]) and prior["reused"] == [0.3]
    assert prior["val_nll"][2] == pytest.approx(knob["val_nll"][1])  # σ's stage-1 score
    assert record["val_nll"] == pytest.approx(0.0, abs=1e-24)
    # the inherited σ is the optimum: nothing beyond σ/3 and 3σ is trained, and σ is kept
    calls.clear()
    record = tune_with_prior(_separable(0.3, 1e-2, calls), knob="kl_weight", grid=[1e-3, 1e-2, 1e-1],
                             prior_std=0.3)
    assert len(calls) == 5 and record["choice"] == "inherit" and record["options"]["prior_std"] == 0.3


def test_two_stage_special_cases():
    calls = []
    # MAP: its knob is the prior std, one stage
    record = tune_with_prior(_separable(0.3, 1.0, calls), knob="prior_std", grid=[0.1, 0.3, 1.0], prior_std=1.0)
    assert [s["stage"] for s in record["stages"]] == ["knob"] and record["options"] == {"prior_std": 0.3}
    assert record["choice"] is None and calls == [{"prior_std": v} for v in (0.1, 0.3, 1.0)]
    # a knob tuned post hoc inside the score (Laplace): only the prior std stage, σ scored too
    calls.clear()
    record = tune_with_prior(_separable(0.3, 1.0, calls), knob=None, prior_std=0.3)
    assert [s["stage"] for s in record["stages"]] == ["prior_std"] and record["options"] == {"prior_std": 0.3}
    assert calls == [{"prior_std": v} for v in (0.1, 0.3, 0.9)] and record["choice"] == "inherit"
    # σ/3 and 3σ are clipped to the prior std's bounds
    record = tune_with_prior(_separable(1e-4, 1.0, []), knob=None, prior_std=2e-3, prior_bounds=(1e-3, 1e3))
    assert record["stages"][0]["grid"] == [1e-3, 2e-3, 6e-3]
    assert record["stages"][0]["bound_hit"] == {"side": "low", "reason": "value_bound"}
    with pytest.raises(ValueError, match="nothing to tune"):
        tune_with_prior(lambda o: 0.0, knob=None, prior_std=None)


def test_every_compared_method_has_one_knob_with_bounds_around_its_grid():
    knobs = {m: o for m, (o, _) in TUNING.items()}
    assert {m: knobs[m] for m in ("map", "laplace", "vi", "ivon", "mc_dropout", "sgld")} == {
        "map": "prior_std", "laplace": "prior_precision", "vi": "kl_weight", "ivon": "kl_weight",
        "mc_dropout": "p_drop", "sgld": "noise_scale"}
    assert all(len(grid) >= 3 and min(grid) > 0 for _, grid in TUNING.values())
    for method, (option, grid) in TUNING.items():
        low, high = tuning_bounds(method, option)
        assert low <= min(grid) and max(grid) <= high, method
        assert METHODS[method].tuning_bounds.get("prior_std") == (1e-3, 1e3)
        if option != "prior_precision":  # a trained grid costs a training run per point: at most 5
            assert len(grid) <= 5, method
    assert tuning_bounds("mc_dropout", "p_drop") == (0.01, 0.5) and tuning_bounds("sgld", "noise_scale")[1] == 1.0
    assert tuning_bounds("map", "not_an_option") == (0.0, math.inf)


def test_a_knob_that_tempers_the_posterior_is_trained_at_prior_std_sigma_sqrt_knob():
    """``tempered``: the search is over (σ, w), every candidate is trained at (σ √w, w), and the record's options
    are the trained values (so a final run at them reproduces the winner)."""
    calls = []

    def score(options):  # optimum at σ = 0.1 (the reference scale σ = prior_std / √w), w = 1e-2
        calls.append(dict(options))
        return parabola(0.1)(options["prior_std"] / math.sqrt(options["kl_weight"])) + \
            parabola(1e-2)(options["kl_weight"])

    record = tune_with_prior(score, knob="kl_weight", grid=[1e-3, 1e-2, 1e-1], bounds=(1e-5, 10.0),
                             prior_std=0.3, prior_bounds=(1e-3, 1e3), tempered=True)
    root = [math.sqrt(w) for w in (1e-3, 1e-2, 1e-1)]
    assert calls[:3] == [{"prior_std": pytest.approx(0.3 * r, rel=1e-11), "kl_weight": w}
                         for r, w in zip(root, (1e-3, 1e-2, 1e-1))]
    # stage 2 at w = 1e-2: σ = 0.1 and 0.9 trained at 0.1 σ; σ = 0.3 reused; 0.1 wins at the edge, 1/30 is tried
    assert calls[3:] == [{"kl_weight": 1e-2, "prior_std": pytest.approx(v / 10, rel=1e-11)}
                         for v in (0.1, 0.9, 1 / 30)]
    assert record["options"] == {"prior_std": pytest.approx(0.01, rel=1e-11), "kl_weight": 0.01}
    assert list(record["options"]) == ["prior_std", "kl_weight"]
    assert record["reference_prior_std"] == 0.1 and record["choice"] == "joint"
    knob, prior = record["stages"]
    assert knob["fixed"] == {"prior_std": 0.3} and knob["chosen"] == 0.01
    assert knob["trained"] == [{"prior_std": pytest.approx(0.3 * r, rel=1e-11), "kl_weight": w}
                               for r, w in zip(root, knob["grid"])]
    assert prior["grid"] == pytest.approx([1 / 30, 0.1, 0.3, 0.9])
    assert [t["prior_std"] for t in prior["trained"]] == pytest.approx([v / 10 for v in prior["grid"]], rel=1e-11)
    # w / prior_std² of every candidate is 1/σ²: the pull on the means is the reference prior's
    for options in calls:
        sigma = options["prior_std"] / math.sqrt(options["kl_weight"])
        assert options["kl_weight"] / options["prior_std"] ** 2 == pytest.approx(1 / sigma**2, rel=1e-10)
    # untempered: the knob is scored at the prior std as it is (the first call)
    plain = []
    tune_with_prior(lambda o: plain.append(dict(o)) or 0.0, knob="kl_weight", grid=[1e-3, 1e-2], prior_std=0.3)
    assert plain[0] == {"prior_std": 0.3, "kl_weight": 1e-3}
    for knob_, prior_std in (("prior_std", 0.3), (None, 0.3), ("kl_weight", None)):
        with pytest.raises(ValueError, match="tempered=True couples"):
            tune_with_prior(score, knob=knob_, grid=[0.1, 1.0], prior_std=prior_std, tempered=True)


def test_compare_tunes_vi_and_ivon_with_a_tempered_knob(monkeypatch):
    """``compare`` reads ``knob_tempers_posterior`` from the class (no method names in the app): VI and IVON train
    each kl_weight candidate at σ √kl_weight, other methods their knob at σ."""
    from bayeswrap.app import compare
    from bayeswrap.app.config import resolve

    assert METHODS["vi"].knob_tempers_posterior and METHODS["ivon"].knob_tempers_posterior
    assert not any(METHODS[m].knob_tempers_posterior for m in ("map", "mc_dropout", "sgld", "laplace", "swag"))
    for method in ("vi", "ivon", "mc_dropout"):
        seen = []
        monkeypatch.setattr(compare, "tuning_score", lambda cfg, s: seen.append(cfg) or 1.0)
        cfg = resolve("configs/digits.yaml", {"method": method, "epochs": 1})
        record = compare._tune_one(cfg, method, compare.knob_of(method), 2, 0.5)
        knob = compare.knob_of(method)
        first = seen[0]
        grid0 = TUNING[method][1][0]
        if method == "mc_dropout":
            assert first.prior_std == 0.5 and "reference_prior_std" not in record
        else:
            assert first.prior_std == pytest.approx(0.5 * math.sqrt(grid0), rel=1e-11)
            chosen, reference = record["options"][knob], record["reference_prior_std"]
            assert record["options"] == {"prior_std": pytest.approx(reference * math.sqrt(chosen), rel=1e-11),
                                         knob: chosen}
            assert reference in record["stages"][1]["grid"]
        assert (first.kl_weight if knob == "kl_weight" else first.option(knob)) == grid0
