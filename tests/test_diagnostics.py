"""bw.diagnostics against ArviZ (rank R-hat, bulk/tail/basic ESS, split R-hat) and on known cases."""

from __future__ import annotations

import math
import warnings
import zlib

import numpy as np
import pytest
import torch

from bayeswrap.evaluation import convergence as diag

az = pytest.importorskip("arviz")

RTOL = 1e-6
FUNCS = ("rhat", "split_rhat", "ess", "ess_bulk", "ess_tail")


def arviz(x: np.ndarray, func: str) -> np.ndarray:
    """ArviZ's value of ``func`` for draws x (chain, draw, *shape), as an array of shape x.shape[2:]."""
    ds = az.convert_to_dataset(np.asarray(x, dtype=np.float64))   # one variable "x", dims (chain, draw, x_dim_*)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        if func == "rhat":
            out = az.rhat(ds, method="rank")
        elif func == "split_rhat":
            out = az.rhat(ds, method="split")
        else:
            out = az.ess(ds, method={"ess": "mean", "ess_bulk": "bulk", "ess_tail": "tail"}[func])
    return np.asarray(out["x"].values, dtype=np.float64)


def ar1(rng: np.random.Generator, phi: float, chains: int, draws: int, shape=()) -> np.ndarray:
    """Stationary AR(1) draws x_t = φ x_{t−1} + ε_t, (chains, draws, *shape)."""
    eps = rng.standard_normal((chains, draws, *shape))
    x = np.empty_like(eps)
    x[:, 0] = eps[:, 0] / math.sqrt(1.0 - phi ** 2)
    for t in range(1, draws):
        x[:, t] = phi * x[:, t - 1] + eps[:, t]
    return x


def make_case(name: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name == "iid":
        return rng.standard_normal((4, 500))
    if name == "iid_3x2":
        return rng.standard_normal((4, 500, 3, 2))
    if name == "ar1_0.9":
        return ar1(rng, 0.9, 4, 500, (3,))
    if name == "ar1_-0.3":
        return ar1(rng, -0.3, 4, 500, (3,))
    if name == "student_t3":
        return rng.standard_t(3, (4, 500, 3))
    if name == "odd_draws":
        return rng.standard_normal((3, 501, 2))
    if name == "odd_small":
        return rng.standard_normal((2, 7, 10))
    if name == "four_draws":
        return rng.standard_normal((2, 4, 10))
    if name == "ties":
        return rng.integers(0, 3, (4, 100, 4)).astype(np.float64)
    if name == "random_walk":
        return np.cumsum(rng.standard_normal((4, 300, 3)), axis=1)
    if name == "bimodal":
        return np.concatenate([rng.normal(-3.0, 1.0, (2, 500, 2)), rng.normal(3.0, 1.0, (2, 500, 2))])
    raise KeyError(name)


CASES = ("iid", "iid_3x2", "ar1_0.9", "ar1_-0.3", "student_t3", "odd_draws", "odd_small", "four_draws", "ties",
         "random_walk", "bimodal")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("func", FUNCS)
def test_matches_arviz(case, func):
    x = make_case(case)
    ours = getattr(diag, func)(torch.from_numpy(x))
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float64
    assert tuple(ours.shape) == x.shape[2:]
    ref = arviz(x, func)
    assert np.isfinite(ref).all()
    np.testing.assert_allclose(ours.numpy(), ref, rtol=RTOL, atol=0)


def test_numpy_and_low_precision_inputs():
    x = make_case("ar1_0.9").astype(np.float32)
    for func in FUNCS:
        ref = arviz(x.astype(np.float64), func)
        for given in (x, torch.from_numpy(x), torch.from_numpy(x).requires_grad_()):
            out = getattr(diag, func)(given)
            assert out.dtype == torch.float64 and not out.requires_grad
            np.testing.assert_allclose(out.numpy(), ref, rtol=RTOL, atol=0)


def test_scalar_draws_give_0d_tensors_and_empty_trailing_shapes():
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for func in FUNCS:
        out = getattr(diag, func)(x)
        assert out.shape == () and out.dtype == torch.float64
        assert getattr(diag, func)(torch.zeros(4, 50, 3, 0)).shape == (3, 0)


def test_blocks_match_one_pass(monkeypatch):
    x = torch.from_numpy(make_case("ar1_0.9").repeat(7, axis=2))     # 21 columns
    full = {f: getattr(diag, f)(x) for f in FUNCS}
    monkeypatch.setattr(diag, "_BLOCK_ELEMENTS", 4 * 500 * 4)           # blocks of 4 columns
    for f in FUNCS:
        torch.testing.assert_close(getattr(diag, f)(x), full[f], rtol=1e-12, atol=0)


def test_rhat_separates_stuck_from_mixed_chains():
    stuck = make_case("bimodal")                       # 2 chains in the mode at −3, 2 in the mode at +3
    assert (diag.rhat(stuck) > 1.1).all()
    rng = np.random.default_rng(1)
    modes = np.where(rng.random((4, 500, 2)) < 0.5, -3.0, 3.0)
    mixed = modes + rng.standard_normal((4, 500, 2))  # every chain visits both modes
    assert (diag.rhat(mixed) < 1.01).all()
    assert (diag.rhat(make_case("iid_3x2")) < 1.01).all()
    # scale differences only: the bulk R-hat misses them, the folded (tail) R-hat catches them
    scale = np.concatenate([rng.standard_normal((2, 500)), 5.0 * rng.standard_normal((2, 500))])
    assert float(diag.rhat(scale)) > 1.1 > float(diag.split_rhat(scale))


def test_antithetic_ess_exceeds_draws_up_to_the_cap():
    x = make_case("ar1_-0.3")
    total = x.shape[0] * x.shape[1]
    for func in ("ess", "ess_bulk"):
        out = getattr(diag, func)(x)
        assert (out > total).all() and (out <= total * math.log10(total)).all()


def test_constant_draws_as_arviz():
    const = np.full((4, 100, 2), 2.5)
    for func in FUNCS:
        ref, ours = arviz(const, func), getattr(diag, func)(const).numpy()
        np.testing.assert_array_equal(ours, ref)
    assert np.isnan(diag.rhat(const).numpy()).all() and np.isnan(diag.split_rhat(const).numpy()).all()
    assert (diag.ess_bulk(const) == 400).all() and (diag.ess_tail(const) == 400).all()
    odd = np.full((3, 11), -1.0)                        # S = 2 · 3 · 5 split draws
    assert float(diag.ess(odd)) == float(arviz(odd, "ess")) == 30.0
    # one constant element next to a varying one: only that element is NaN / S
    mixed = np.stack([np.full((4, 100), 7.0), make_case("iid")[:, :100]], axis=-1)
    for func in FUNCS:
        np.testing.assert_allclose(getattr(diag, func)(mixed).numpy(), arviz(mixed, func), rtol=RTOL, atol=0)


def test_chains_constant_at_different_values():
    x = np.repeat(np.arange(4.0)[:, None], 100, axis=1)
    assert math.isinf(float(diag.rhat(x))) and math.isinf(float(diag.split_rhat(x)))
    assert float(arviz(x, "rhat")) > 1e10               # ArviZ: huge but finite (rounding), documented
    for func in ("ess", "ess_bulk", "ess_tail"):
        np.testing.assert_allclose(getattr(diag, func)(x).numpy(), arviz(x, func), rtol=RTOL, atol=0)


def test_single_chain():
    x = make_case("iid_3x2")[:1]
    assert torch.isnan(diag.rhat(x)).all() and torch.isnan(diag.split_rhat(x)).all()
    assert np.isnan(arviz(x, "rhat")).all()
    for func in ("ess", "ess_bulk", "ess_tail"):
        np.testing.assert_allclose(getattr(diag, func)(x).numpy(), arviz(x, func), rtol=RTOL, atol=0)


@pytest.mark.parametrize("func", FUNCS)
def test_bad_input(func):
    fn = getattr(diag, func)
    with pytest.raises(ValueError, match=r"\(chains, draws, \.\.\.\).*shape \(10,\)"):
        fn(torch.zeros(10))
    with pytest.raises(ValueError, match=r"\(chains, draws, \.\.\.\)"):
        fn(np.float64(1.0))
    with pytest.raises(ValueError, match=r"3 draw\(s\) per chain \(shape \(4, 3, 2\)\).*at least 4"):
        fn(torch.randn(4, 3, 2))
    with pytest.raises(ValueError, match=r"no chain: shape \(0, 10\)"):
        fn(torch.zeros(0, 10))
    x = torch.randn(4, 20, 3)
    x[1, 5, 2] = float("nan")
    with pytest.raises(ValueError, match=r"1 non-finite value.*shape \(4, 20, 3\)"):
        fn(x)
    x[1, 5, 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        fn(x.numpy())
    with pytest.raises(ValueError, match="complex"):
        fn(torch.randn(4, 20, dtype=torch.complex64))
    with pytest.raises(TypeError, match="array of numbers"):
        fn(np.array([["a"] * 5] * 2))


def test_summary():
    draws = {"w": torch.from_numpy(make_case("ar1_0.9")), "b": make_case("iid"),
             "c": np.concatenate([np.full((4, 500, 1), 1.0), make_case("iid")[..., None]], axis=-1)}
    out = diag.summary(draws)
    assert set(out) == {"parameters", "summary"} and list(out["parameters"]) == ["w", "b", "c"]
    for name, x in draws.items():
        got = out["parameters"][name]
        assert set(got) == {"rhat", "ess_bulk", "ess_tail"} and all(isinstance(v, float) for v in got.values())
        r = diag.rhat(x)
        assert got["rhat"] == pytest.approx(float(r[~torch.isnan(r)].max()), rel=1e-12)   # NaN (constant) ignored
        assert got["ess_bulk"] == pytest.approx(float(diag.ess_bulk(x).min()), rel=1e-12)
        assert got["ess_tail"] == pytest.approx(float(diag.ess_tail(x).min()), rel=1e-12)
    per = out["parameters"].values()
    assert out["summary"] == {"rhat": max(p["rhat"] for p in per), "ess_bulk": min(p["ess_bulk"] for p in per),
                              "ess_tail": min(p["ess_tail"] for p in per)}
    one = diag.summary({"a": np.random.default_rng(0).standard_normal((1, 40, 2))})
    assert math.isnan(one["parameters"]["a"]["rhat"]) and math.isnan(one["summary"]["rhat"])
    assert one["summary"]["ess_bulk"] > 0


def test_summary_bad_input():
    with pytest.raises(ValueError, match="empty"):
        diag.summary({})
    with pytest.raises(TypeError, match="mapping"):
        diag.summary([torch.randn(4, 20)])
    with pytest.raises(ValueError, match=r"draws\['bias'\] has 2 draw\(s\) per chain"):
        diag.summary({"w": torch.randn(4, 20), "bias": torch.randn(4, 2)})
