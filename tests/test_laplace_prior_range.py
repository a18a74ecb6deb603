"""Laplace at any prior precision: finite predictives for every structure and link, PSD factors kept PSD.

Issue 32: last-layer KFAC with the probit link returned NaN probabilities at δ = 1e-4 and 1e-3 on a ReLU MLP,
because ``torch.linalg.eigh`` of a singular Kronecker factor (dead units) returns eigenvalues down to −ε·λ_max,
so λ_G λ_A + δ < 0 and the functional variance turned negative. The factors are PSD by construction and their
eigenvalues are clamped at 0 (:func:`bayeswrap.methods.laplace.structures.psd_eigh`, as laplace-torch's
``symeig``).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.methods.laplace.structures import KronPosterior, psd_eigh

pytestmark = pytest.mark.usefixtures("one_thread")

DELTAS = (1e-6, 1e-4, 1e-3, 1e-2, 1.0, 1e2, 1e4, 1e6, 1e8)
#: (hessian_structure, subset_of_weights); "full" over all 1,210 weights of the small MLP too
CASES = [(h, s) for h in ("diag", "kron", "full") for s in ("all", "last_layer")]


@functools.cache
def _trained():
    """A 64-16-16-10 ReLU MLP trained by MAP on 600 sklearn digits (its weights), and the data."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10))
    bnn = bw.wrap(net, "map", num_data=600, prior_std=3.0)
    batches = [(x[i:i + 100], y[i:i + 100]) for i in range(0, 600, 100)]
    bw.fit(bnn, batches, epochs=40, optimizer=torch.optim.Adam(bnn.parameters(), lr=1e-2), progress=False)
    return {n: t.detach().clone() for n, t in net.state_dict().items()}, batches, x[1500:1600]


def _laplace(structure: str, subset: str):
    state, batches, _ = _trained()
    net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10))
    net.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the fit's "sampled weights are mostly noise" advice
        bnn = bw.wrap(net, "laplace", num_data=600, prior_std=3.0, hessian_structure=structure,
                      subset_of_weights=subset)
        bnn.fit_curvature(batches)
    return bnn


@pytest.mark.parametrize("structure, subset", CASES)
def test_predictive_is_a_distribution_at_every_prior_precision(structure, subset):
    bnn = _laplace(structure, subset)
    x = _trained()[2]
    for link in ("probit", "mc"):
        for delta in DELTAS:
            bnn.prior_precision = delta
            for name, v in bnn.posterior_var.items():
                assert bool((v >= 0).all()) and bool(torch.isfinite(v).all()), (link, delta, name)
            p = bnn.predict(x, 4, generator=torch.Generator().manual_seed(0), link_approx=link)
            assert bool(torch.isfinite(p).all()), (link, delta)
            assert bool((p >= 0).all()), (link, delta)
            torch.testing.assert_close(p.sum(-1), torch.ones(len(x)), rtol=0, atol=1e-5)
            assert torch.isfinite(bnn.log_marginal_likelihood()), (link, delta)
    # the two ends: a vanishing posterior variance gives the MAP, a huge one a much flatter predictive
    bnn.prior_precision = 1e8
    torch.testing.assert_close(bnn.predict(x, 4), bnn.predict(x, 0), rtol=0, atol=1e-4)
    bnn.prior_precision = 1e-6
    flat = bnn.predict(x, 4, link_approx="probit")
    assert float(flat.max(-1).values.mean()) < float(bnn.predict(x, 0).max(-1).values.mean())


def test_the_validation_search_runs_over_tiny_prior_precisions():
    """What crashed ``compare``: the last-layer KFAC probit search over δ = 1e-4, 1e-3, ..."""
    bnn = _laplace("kron", "last_layer")
    state, batches, _ = _trained()
    record = bnn.validation_search(batches[:2], [1e-6, 1e-4, 1e-3, 1e-2, 1.0, 1e2], num_samples=2)
    assert all(v < float("inf") for v in record["val_nll"]), record


def test_psd_eigh_clamps_rounding_below_zero_and_keeps_the_variances_of_float64():
    """A singular float32 factor (dead units): eigenvalues ≥ 0, and Kron marginal variances at δ = 1e-6 that agree
    with a float64 eigendecomposition of the same factors (which float32's −ε·λ_max eigenvalues made negative).
    """
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(500, 12, generator=g).relu() * 30
    feats[:, 3:7] = 0  # dead units: A has a 4-dimensional null space
    a = feats.T @ feats / 500
    d = torch.randn(500, 5, generator=g)
    gmat = d.T @ d * 10 + 1e-3 * torch.eye(5)
    lam, vecs = torch.linalg.eigh(a)
    assert float(lam.min()) < 0  # float32 rounding: the failure this guards against
    clamped, q = psd_eigh(a)
    assert clamped.dtype == q.dtype == torch.float32 and bool((clamped >= 0).all())
    torch.testing.assert_close(q @ torch.diag(clamped) @ q.T, a, rtol=0, atol=1e-5 * float(lam.max()))
    torch.testing.assert_close(clamped[:4], torch.zeros(4), rtol=0, atol=1e-12 * float(lam.max()))  # the null space
    post = KronPosterior({"l": ("l.weight", "l.bias")}, [], {"l.weight": torch.Size([5, 12]), "l.bias": torch.Size([5])},
                         torch.float32, "cpu")
    post.A["l"].copy_(a)
    post.G["l"].copy_(gmat)
    ref = KronPosterior({"l": ("l.weight", "l.bias")}, [], {"l.weight": torch.Size([5, 12]), "l.bias": torch.Size([5])},
                        torch.float64, "cpu")
    ref.A["l"].copy_(a.double())
    ref.G["l"].copy_(gmat.double())
    for delta in (1e-6, 1e-3, 1.0):
        ours, theirs = post.marginal_variances(delta), ref.marginal_variances(delta)
        for n in ours:
            assert bool((ours[n] > 0).all()), (delta, n)
            torch.testing.assert_close(ours[n].double(), theirs[n], rtol=1e-3, atol=0)
