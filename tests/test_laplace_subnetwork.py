"""Subnetwork Laplace (``subset_of_weights="subnetwork"``) against laplace-torch 0.3's ``SubnetLaplace`` and masks.

Model and data: a 4-6-3 tanh MLP in float64 (51 parameters), 24 examples in batches of 8 (N/n = 1), prior mean 0;
laplace-torch with its default ``CurvlinopsGGN`` backend (``FullSubnetLaplace``). The entries are indices into the
flattened parameters in ``model.parameters()`` order for both.

Tolerances: the chosen indices are equal; H_SS, the log marginal likelihood, the marglik prior precision and the
probit GLM probabilities to 1e-6 relative (laplace-torch's Curvlinops GGN multiplies by a float32 identity, ~1e-7
relative rounding, as in ``tests/test_laplace_structures.py``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayeswrap as bw
from bayeswrap.methods.laplace.subnetwork import swag_variances

DT = torch.float64
TOL = {"rtol": 1e-6, "atol": 1e-9}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(1)
    x = torch.randn(24, 4, dtype=DT)
    y = torch.randint(0, 3, (24,))
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    return {"x": x, "y": y, "net": net, "loader": DataLoader(TensorDataset(x, y), batch_size=8)}


def _ours(data, n=12, score="largest_variance", delta=1.0, fit=True, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn = bw.wrap(copy.deepcopy(data["net"]), "laplace", num_data=24, prior_std=delta ** -0.5,
                      prior_mean="zero", hessian_structure="full", subset_of_weights="subnetwork",
                      n_params_subnet=n, subnetwork_score=score, **kw)
        if fit:
            bnn.fit_curvature(data["loader"])
    return bnn


def _their_mask(data, score, n, delta=1.0):
    laplace = pytest.importorskip("laplace")
    from laplace.curvature import CurvlinopsGGN
    from laplace.utils import LargestMagnitudeSubnetMask, LargestVarianceDiagLaplaceSubnetMask

    net = copy.deepcopy(data["net"])
    if score == "largest_magnitude":
        mask = LargestMagnitudeSubnetMask(net, n_params_subnet=n)
    else:
        diag = laplace.Laplace(net, "classification", subset_of_weights="all", hessian_structure="diag",
                               prior_precision=delta, backend=CurvlinopsGGN)
        mask = LargestVarianceDiagLaplaceSubnetMask(net, n_params_subnet=n, diag_laplace_model=diag)
    return mask.select(data["loader"])


def _theirs(data, indices, delta=1.0):
    laplace = pytest.importorskip("laplace")
    from laplace.curvature import CurvlinopsGGN

    la = laplace.Laplace(copy.deepcopy(data["net"]), "classification", subset_of_weights="subnetwork",
                         hessian_structure="full", subnetwork_indices=indices.clone(), prior_precision=delta,
                         backend=CurvlinopsGGN)
    la.fit(data["loader"])
    return la


@pytest.mark.parametrize("score", ["largest_magnitude", "largest_variance"])
def test_indices_equal_laplace_torch_masks(data, score):
    """The top-12 entries by |θ*| and by the diagonal Laplace variance 1/(h + δ) (δ = 2) equal laplace-torch's
    ``LargestMagnitudeSubnetMask`` / ``LargestVarianceDiagLaplaceSubnetMask`` (on a DiagLaplace, δ = 2) exactly."""
    bnn = _ours(data, 12, score, delta=2.0)
    assert torch.equal(bnn._structure.indices, _their_mask(data, score, 12, delta=2.0))


def test_swag_scores_equal_laplace_torch_swag_mask(data):
    """Given SWAG variances (``use_subnetwork_scores``), the subnetwork is their top n, as laplace-torch's
    ``LargestVarianceSWAGSubnetMask`` with the same SGD snapshots (its ``fit_diagonal_swag_var``, deterministic on an
    unshuffled loader); and :func:`swag_variances` reads a bayeswrap SWAG model's diagonal variances."""
    pytest.importorskip("laplace")
    from laplace.utils import LargestVarianceSWAGSubnetMask
    from laplace.utils.swag import fit_diagonal_swag_var

    net = copy.deepcopy(data["net"])
    theirs = LargestVarianceSWAGSubnetMask(net, n_params_subnet=10, swag_n_snapshots=4).select(data["loader"])
    var = fit_diagonal_swag_var(net, data["loader"], nn.CrossEntropyLoss(), n_snapshots_total=4)
    bnn = _ours(data, 10, fit=False)
    names = list(bnn.theta.keys())
    parts = torch.split(var, [bnn.theta[n].numel() for n in names])
    bnn.use_subnetwork_scores({n: p.reshape(bnn.theta[n].shape) for n, p in zip(names, parts)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn.fit_curvature(data["loader"])
    assert torch.equal(bnn._structure.indices, theirs)
    swag = bw.wrap(copy.deepcopy(data["net"]), "swag", num_data=24)
    bw.fit(swag, [(data["x"], data["y"])] * 3, epochs=4, optimizer=torch.optim.SGD(swag.parameters(), lr=0.05),
           progress=False)
    scores = swag_variances(swag)
    assert all(torch.equal(scores[n], swag.posterior_std()[n].square()) for n in scores)


@pytest.mark.parametrize("delta", [0.5, 2.0])
def test_precision_evidence_and_probit_equal_laplace_torch(data, delta):
    """Same indices (largest magnitude, n = 15): H_SS, log p(D | δ), the marglik δ and the probit GLM predictive
    equal laplace-torch's FullSubnetLaplace to 1e-6 relative; parameters outside S have zero variance."""
    bnn = _ours(data, 15, "largest_magnitude", delta=delta)
    la = _theirs(data, bnn._structure.indices, delta)
    torch.testing.assert_close(bnn._structure.H, la.H, **TOL)
    torch.testing.assert_close(bnn.log_marginal_likelihood(), la.log_marginal_likelihood(), **TOL)
    x = data["x"][:10]
    torch.testing.assert_close(bnn.predict(x), la(x, pred_type="glm", link_approx="probit"), **TOL)
    var = torch.cat([v.flatten() for v in bnn.posterior_var.values()])
    outside = torch.ones(51, dtype=torch.bool)
    outside[bnn._structure.indices] = False
    assert bool((var[outside] == 0).all()) and bool((var[~outside] > 0).all())
    la.optimize_prior_precision(method="marglik", n_steps=400, lr=0.1)
    ours = bnn.optimize_prior_precision("marglik")
    assert ours == pytest.approx(float(la.prior_precision), rel=1e-3)  # theirs: Adam on log δ, 400 steps
    assert float(bnn.log_marginal_likelihood()) >= float(bnn.log_marginal_likelihood(float(la.prior_precision)))


def test_draws_mc_link_and_state_dict(data, tmp_path):
    """Draws move only the chosen entries, with covariance P_S⁻¹ (20,000 draws, 5e-2 absolute); the MC link runs;
    a state dict and ``bw.save``/``bw.load`` restore the indices and H exactly."""
    bnn = _ours(data, 6, "largest_magnitude")
    idx = bnn._structure.indices
    draws = bnn.sample(20_000, generator=torch.Generator().manual_seed(0))
    theta = torch.cat([t.detach().flatten() for t in bnn.theta.values()])
    flat = torch.cat([draws[n].reshape(20_000, -1) for n in bnn.theta.keys()], 1) - theta
    outside = torch.ones(51, dtype=torch.bool)
    outside[idx] = False
    assert bool((flat[:, outside] == 0).all())
    sub = flat[:, idx]
    torch.testing.assert_close(sub.t() @ sub / 20_000, torch.linalg.inv(bnn.posterior_precision()), rtol=0, atol=5e-2)
    probs = bnn.predict(data["x"][:3], 32, generator=torch.Generator().manual_seed(0), link_approx="mc")
    assert torch.allclose(probs.sum(-1), torch.ones(3, dtype=DT))
    fresh = _ours(data, 6, "largest_magnitude", fit=False)
    fresh.load_state_dict(bnn.state_dict())
    assert torch.equal(fresh._structure.indices, idx)
    torch.testing.assert_close(fresh.predict(data["x"][:3]), bnn.predict(data["x"][:3]), rtol=0, atol=0)
    bw.save(bnn, tmp_path / "subnet.pt")
    loaded = bw.load(tmp_path / "subnet.pt", copy.deepcopy(data["net"]))
    assert torch.equal(loaded._structure.indices, idx) and loaded.n_params_subnet == 6
    torch.testing.assert_close(loaded.log_marginal_likelihood(), bnn.log_marginal_likelihood(), rtol=0, atol=0)


def test_bad_values_are_refused(data):
    net = copy.deepcopy(data["net"])
    with pytest.raises(ValueError, match=r"n_params_subnet=52.*\[1, 51\]"):
        bw.wrap(net, "laplace", num_data=24, hessian_structure="full", subset_of_weights="subnetwork",
                n_params_subnet=52)
    with pytest.raises(ValueError, match="needs n_params_subnet"):
        bw.wrap(net, "laplace", num_data=24, hessian_structure="full", subset_of_weights="subnetwork")
    with pytest.raises(ValueError, match="accepted: hessian_structure='full'"):
        bw.wrap(net, "laplace", num_data=24, subset_of_weights="subnetwork", n_params_subnet=5)
    with pytest.raises(ValueError, match="subnetwork_score"):
        bw.wrap(net, "laplace", num_data=24, hessian_structure="full", subset_of_weights="subnetwork",
                n_params_subnet=5, subnetwork_score="random")
    bnn = _ours(data, 5, fit=False)
    with pytest.raises(ValueError, match="missing or not of shape"):
        bnn.use_subnetwork_scores({"0.weight": torch.ones(6, 4)})


def test_jacobians_only_over_touched_tensors(data):
    """Scores that pick entries of ``2.weight`` and ``2.bias`` only: the Jacobians are taken over those two tensors,
    and H_SS is the full structure's H at the chosen rows and columns (1e-12 relative, both float64)."""
    bnn = _ours(data, 8, fit=False)
    scores = {n: torch.zeros_like(t) for n, t in bnn.theta.items()}
    scores["2.weight"][0, :5] = 1.0
    scores["2.bias"][:] = 2.0
    bnn.use_subnetwork_scores(scores)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn.fit_curvature(data["loader"])
        full = bw.wrap(copy.deepcopy(data["net"]), "laplace", num_data=24, prior_mean="zero", hessian_structure="full")
        full.fit_curvature(data["loader"])
    assert bnn._structure.jacobian_names() == ["2.weight", "2.bias"]
    idx = bnn._structure.indices
    assert idx.tolist() == [30, 31, 32, 33, 34, 48, 49, 50]
    torch.testing.assert_close(bnn._structure.H, full._structure.H[idx][:, idx], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(bnn.functional_moments(data["x"][:4])[1],
                               _restricted_variance(full, idx, data["x"][:4]), rtol=1e-10, atol=1e-14)


def _restricted_variance(full, idx, x):
    """diag(J_S (H_SS + I)⁻¹ J_Sᵀ) from the full model's Jacobian (δ = 1)."""
    theta = {n: t.detach() for n, t in full.theta.items()}
    jac = torch.func.jacrev(lambda th: full.forward_with(th, x))(theta)
    j = torch.cat([jac[n].reshape(x.shape[0], 3, -1) for n in theta], -1)[..., idx]
    cov = torch.linalg.inv(full._structure.H[idx][:, idx] + torch.eye(len(idx), dtype=DT))
    return torch.einsum("bkp,pq,bkq->bk", j, cov, j)
