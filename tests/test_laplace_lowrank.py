"""Low-rank Laplace (``hessian_structure="lowrank"``) against the exact GGN, the full structure and laplace-torch.

Model and data: a 4-6-3 tanh MLP in float64 (51 parameters) on 12 examples in two batches (N/n = 1), prior mean 0.
The GGN of 12 examples and 3 classes has rank ≤ 12 · 2 = 24 (softmax's Λ_n has rank K − 1), so the randomised
range finder with l = k + 10 ≥ 24 columns holds the whole range of H, and low_rank=24 is exact up to rounding.

Tolerances (stated per test): the exact cases agree to float64 rounding (1e-10 relative); the top-5 eigenvalues
with k = 5 < rank(H) after 2 subspace iterations to 1e-6 relative (the error falls like (λ_6/λ_16)^5 ≈ 1e-8 here).

laplace-torch 0.3's ``LowRankLaplace.fit`` needs the *old* ``asdfghjkl`` package (0.1a2, installed from git; laplace-
torch 0.3 itself pins asdfghjkl 0.1a4, which ships only ``asdl``), and it eigendecomposes the exact Hessian by
deflated power iteration (tolerance 1e-3). So the reference here is its posterior given the same eigenpairs: a
``LowRankLaplace`` constructed with the import check bypassed and ``H = (U, λ)`` set, whose
``log_marginal_likelihood`` (matrix determinant lemma) and GLM probit predictive (``functional_variance``, Woodbury)
are compared with ours; the eigenpairs are compared with the eigendecomposition of laplace-torch's dense
``FullLaplace`` GGN.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayeswrap as bw

DT = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(0)
    x = torch.randn(12, 4, dtype=DT)
    y = torch.randint(0, 3, (12,))
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    return {"x": x, "y": y, "net": net, "loader": DataLoader(TensorDataset(x, y), batch_size=6)}


def _ours(data, structure="lowrank", prior_std=1.0, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the noise-to-signal warning of a weak prior
        bnn = bw.wrap(copy.deepcopy(data["net"]), "laplace", num_data=12, prior_std=prior_std, prior_mean="zero",
                      hessian_structure=structure, **kw)
        bnn.fit_curvature(data["loader"], generator=torch.Generator().manual_seed(0))
    return bnn


def _their_full(data):
    laplace = pytest.importorskip("laplace")
    from laplace.curvature import CurvlinopsGGN

    la = laplace.Laplace(copy.deepcopy(data["net"]), "classification", subset_of_weights="all",
                         hessian_structure="full", prior_precision=1.0, backend=CurvlinopsGGN)
    la.fit(data["loader"])
    return la


def _their_lowrank(data, bnn, delta):
    """laplace-torch's LowRankLaplace with our eigenpairs (its fit needs the old asdfghjkl, see the module doc)."""
    laplace = pytest.importorskip("laplace")
    import laplace.baselaplace as base

    spec = base.find_spec
    base.find_spec = lambda name: object() if name == "asdfghjkl" else spec(name)
    try:
        la = laplace.LowRankLaplace(copy.deepcopy(data["net"]), "classification", prior_precision=delta)
    finally:
        base.find_spec = spec
    la.H = (bnn._structure.U.clone(), bnn._structure.lam.clone())
    la.mean = torch.nn.utils.parameters_to_vector(la.model.parameters()).detach()
    la.n_data, la.n_outputs = 12, 3
    la.loss = -bnn.train_log_likelihood.clone()  # Σ_n CE_n: laplace-torch's log_likelihood is −loss
    return la


def test_eigenpairs_equal_the_exact_ggn_of_laplace_torch(data):
    """k = 24 ≥ rank(H): λ equal the top-24 eigenvalues of laplace-torch's dense GGN and U Λ Uᵀ equals its H, to
    1e-8 · λ_max absolute (its Curvlinops product with a float32 identity leaves ~2e-9 · λ_max rounding); the rest of
    its spectrum is 0 to that rounding."""
    bnn, la = _ours(data, low_rank=24), _their_full(data)
    exact = torch.linalg.eigvalsh(la.H).flip(0)
    tol = 1e-8 * float(exact[0])
    assert float(exact[24:].abs().max()) < tol  # rank 24
    torch.testing.assert_close(bnn._structure.lam, exact[:24], rtol=0, atol=tol)
    s = bnn._structure
    torch.testing.assert_close((s.U * s.lam) @ s.U.t(), la.H, rtol=0, atol=tol)
    torch.testing.assert_close(s.U.t() @ s.U, torch.eye(24, dtype=DT), rtol=0, atol=1e-12)


def test_top_k_below_the_rank_to_1e_6(data):
    """k = 5 < rank(H) = 24 with 2 subspace iterations: the top-5 eigenvalues to 1e-6 relative, and the eigenvectors'
    subspace (|U_ours U_oursᵀ − U U ᵀ| ≤ 1e-4)."""
    bnn = _ours(data, low_rank=5, low_rank_power_iterations=2)
    h = _ours(data, structure="full")._structure.H
    lam, vecs = torch.linalg.eigh(h)
    torch.testing.assert_close(bnn._structure.lam, lam.flip(0)[:5], rtol=1e-6, atol=0)
    top = vecs[:, -5:]
    u = bnn._structure.U
    torch.testing.assert_close(u @ u.t(), top @ top.t(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("delta", [0.3, 1.0, 7.0])
def test_full_rank_equals_hessian_structure_full(data, delta):
    """Closed form: with k = rank(H) the low-rank posterior is the full one (P, evidence, marginal variances and the
    probit GLM predictive to 1e-10 relative)."""
    low, full = _ours(data, low_rank=24), _ours(data, structure="full")
    for bnn in (low, full):
        bnn.prior_precision = delta
    torch.testing.assert_close(low.posterior_precision(), full.posterior_precision(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(low.log_marginal_likelihood(), full.log_marginal_likelihood(), rtol=1e-10, atol=0)
    for n in low.theta.keys():
        torch.testing.assert_close(low.posterior_var[n], full.posterior_var[n], rtol=1e-10, atol=1e-13)
    x = data["x"][:5]
    torch.testing.assert_close(low.functional_moments(x)[1], full.functional_moments(x)[1], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(low.predict(x), full.predict(x), rtol=1e-10, atol=1e-13)
    assert low.optimize_prior_precision("marglik") == pytest.approx(full.optimize_prior_precision("marglik"),
                                                                    rel=1e-10)


@pytest.mark.parametrize("delta", [0.5, 3.0])
def test_evidence_and_probit_equal_laplace_torch_lowrank(data, delta):
    """laplace-torch's LowRankLaplace given the same (U, λ), k = 8: log marginal likelihood and probit GLM
    probabilities to 1e-10 relative (both float64; its functional variance forms the Jacobians, ours does not)."""
    bnn = _ours(data, low_rank=8)
    bnn.prior_precision = delta
    la = _their_lowrank(data, bnn, delta)
    torch.testing.assert_close(bnn.log_marginal_likelihood(),
                               la.log_marginal_likelihood(torch.tensor(delta, dtype=DT)), rtol=1e-10, atol=0)
    x = data["x"]
    torch.testing.assert_close(bnn.predict(x), la(x, pred_type="glm", link_approx="probit"), rtol=1e-10, atol=1e-12)


def test_diagonal_remainder_against_the_dense_posterior(data):
    """``low_rank_diagonal``: D = max(0, diag(H) − diag(UΛUᵀ)) with diag(H) exact; evidence, marginal variances and
    functional variances equal those of the dense P = UΛUᵀ + D + δI to 1e-10, the marglik δ is its argmax, and draws
    have covariance P⁻¹ (40,000 draws: 5e-2 absolute on entries of size ≤ 1)."""
    bnn = _ours(data, low_rank=5, low_rank_diagonal=True)
    h = _ours(data, structure="full")._structure.H
    s = bnn._structure
    low = (s.U * s.lam) @ s.U.t()
    torch.testing.assert_close(s.D, (h.diagonal() - low.diagonal()).clamp_min(0), rtol=1e-10, atol=1e-13)
    assert bool((s.D > 0).any())
    delta = 0.8
    bnn.prior_precision = delta
    prec = low + torch.diag(s.D + delta)
    cov = torch.linalg.inv(prec)
    theta = torch.cat([t.detach().flatten() for t in bnn.theta.values()])
    expected = (bnn.train_log_likelihood - 0.5 * (torch.logdet(prec) - 51 * torch.log(torch.tensor(delta, dtype=DT))
                                                  + delta * theta.square().sum()))
    torch.testing.assert_close(bnn.log_marginal_likelihood(), expected, rtol=1e-10, atol=0)
    var = torch.cat([v.flatten() for v in bnn.posterior_var.values()])
    torch.testing.assert_close(var, cov.diagonal(), rtol=1e-10, atol=1e-13)
    x = data["x"][:4]
    jac = torch.func.jacrev(lambda th: bnn.forward_with(th, x))({n: t.detach() for n, t in bnn.theta.items()})
    j = torch.cat([jac[n].reshape(4, 3, -1) for n in bnn.theta.keys()], -1)
    torch.testing.assert_close(bnn.functional_moments(x)[1], torch.einsum("bkp,pq,bkq->bk", j, cov, j),
                               rtol=1e-10, atol=1e-13)
    draws = bnn.sample(40_000, generator=torch.Generator().manual_seed(0))
    flat = torch.cat([draws[n].reshape(40_000, -1) for n in bnn.theta.keys()], 1) - theta
    torch.testing.assert_close(flat.t() @ flat / 40_000, cov, rtol=0, atol=5e-2)
    best = bnn.optimize_prior_precision("marglik")
    grid = [best * f for f in (0.9, 1.1)]
    assert all(float(bnn.log_marginal_likelihood(best)) > float(bnn.log_marginal_likelihood(g)) for g in grid)


def test_mc_link_and_state_dict_round_trip(data, tmp_path):
    """The linearised MC predictive runs on the low-rank draws; a state dict and ``bw.save``/``bw.load`` restore the
    posterior (options included) exactly."""
    bnn = _ours(data, low_rank=6, low_rank_diagonal=True)
    x = data["x"][:3]
    probs = bnn.predict(x, 64, generator=torch.Generator().manual_seed(0), link_approx="mc")
    assert probs.shape == (3, 3) and torch.allclose(probs.sum(-1), torch.ones(3, dtype=DT))
    fresh = bw.wrap(copy.deepcopy(data["net"]), "laplace", num_data=12, prior_std=1.0, prior_mean="zero",
                    hessian_structure="lowrank", low_rank=6, low_rank_diagonal=True)
    fresh.load_state_dict(bnn.state_dict())
    torch.testing.assert_close(fresh.log_marginal_likelihood(), bnn.log_marginal_likelihood(), rtol=0, atol=0)
    torch.testing.assert_close(fresh.predict(x), bnn.predict(x), rtol=0, atol=0)
    bw.save(bnn, tmp_path / "lowrank.pt")
    loaded = bw.load(tmp_path / "lowrank.pt", copy.deepcopy(data["net"]))
    assert (loaded.low_rank, loaded.low_rank_diagonal) == (6, True)
    torch.testing.assert_close(loaded.log_marginal_likelihood(), bnn.log_marginal_likelihood(), rtol=0, atol=0)
    torch.testing.assert_close(loaded.predict(x), bnn.predict(x), rtol=0, atol=0)


def test_bad_values_are_refused(data):
    net = copy.deepcopy(data["net"])
    with pytest.raises(ValueError, match=r"low_rank=60.*\[1, 51\]"):
        bw.wrap(net, "laplace", num_data=12, hessian_structure="lowrank", low_rank=60)
    with pytest.raises(ValueError, match="low_rank"):
        bw.wrap(net, "laplace", num_data=12, hessian_structure="lowrank", low_rank=0)
    with pytest.raises(ValueError, match="low_rank_power_iterations"):
        bw.wrap(net, "laplace", num_data=12, hessian_structure="lowrank", low_rank_power_iterations=-1)
    bnn = bw.wrap(net, "laplace", num_data=12, hessian_structure="lowrank", curvature="fisher")
    with pytest.raises(ValueError, match="curvature='ggn' or 'empirical_fisher'"):
        bnn.fit_curvature(data["loader"])


def test_empirical_fisher_matches_full(data):
    """``curvature="empirical_fisher"``: the same matrix-free products with the observed-label gradients; equal to
    the full structure's empirical Fisher at k = 12 ≥ its rank (N = 12) to 1e-10."""
    low = _ours(data, low_rank=12, curvature="empirical_fisher")
    full = _ours(data, structure="full", curvature="empirical_fisher")
    torch.testing.assert_close(low.posterior_precision(), full.posterior_precision(), rtol=1e-10, atol=1e-12)


def test_learned_noise_and_layerwise_prior_equal_full():
    """Gaussian likelihood with ``noise_std="learn"`` (10 examples, one output: rank(H) ≤ 10 = k): the joint (δ, σ)
    marglik search, scalar and layerwise, gives the full structure's δ, σ, evidence and predictive to 1e-8 relative
    (both Newton searches stop at gradient 1e-10)."""
    torch.manual_seed(0)
    x, y = torch.randn(10, 3, dtype=DT), torch.randn(10, 1, dtype=DT)
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).to(DT)
    results = []
    for kw in ({"hessian_structure": "full"}, {"hessian_structure": "lowrank", "low_rank": 10}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            bnn = bw.wrap(copy.deepcopy(net), "laplace", num_data=10, prior_mean="zero", likelihood="gaussian",
                          noise_std="learn", **kw)
            bnn.fit_curvature([(x, y)])
            scalar = (bnn.optimize_prior_precision("marglik"), bnn.noise_std, bnn.log_marginal_likelihood(),
                      bnn.predict(x[:3]))
            layerwise = (bnn.optimize_prior_precision("marglik", prior_structure="layerwise"), bnn.noise_std)
        results.append((scalar, layerwise))
    (full_s, full_l), (low_s, low_l) = results
    assert low_s[0] == pytest.approx(full_s[0], rel=1e-8) and low_s[1] == pytest.approx(full_s[1], rel=1e-8)
    torch.testing.assert_close(low_s[2], full_s[2], rtol=1e-8, atol=0)
    torch.testing.assert_close(low_s[3], full_s[3], rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(low_l[0], full_l[0], rtol=1e-6, atol=0)
    assert low_l[1] == pytest.approx(full_l[1], rel=1e-8)
