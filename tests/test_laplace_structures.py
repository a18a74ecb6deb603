"""Full and Kronecker-factored Laplace, over all weights or the last layer, against laplace-torch.

The reference is laplace-torch (Daxberger et al. 2021) with its default
``CurvlinopsGGN`` backend, in float64, on the same weights, data (all of it, in
two batches, so N/n = 1), prior mean and scalar prior precision:
``FullLLLaplace``/``KronLLLaplace`` for ``subset_of_weights="last_layer"`` and
``FullLaplace``/``KronLaplace`` for ``"all"``. Its Kron factors (as with its
BackPACK and ASDL backends) keep a layer's weight, G ⊗ A, and bias, G, as two
blocks, with A averaged over the N examples and G summed; so do ours.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from sklearn.datasets import load_iris
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayeswrap as bw
from bayeswrap.methods.laplace.structures import MAX_FULL_PARAMS, find_last_layer

DT = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def _net():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def _flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors.values()])


@pytest.fixture(scope="module")
def iris():
    x, y = load_iris(return_X_y=True)
    x = torch.as_tensor(x, dtype=DT)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.as_tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    tr, va = perm[:120], perm[120:]
    torch.manual_seed(0)
    init = _net().state_dict()
    net = _net()
    net.load_state_dict(init)
    bnn = bw.wrap(net, "map", num_data=120, prior_std=1.0)
    bw.fit(bnn, [(x[tr], y[tr])] * 300, epochs=1, optimizer=torch.optim.Adam(bnn.parameters(), lr=1e-2),
           progress=False)
    theta = {n: t.detach().clone() for n, t in bnn.theta.items()}
    return {"x": x[tr], "y": y[tr], "xv": x[va], "init": init, "theta": theta}


def _ours(iris, structure, subset, fit=True, **kw):
    net = _net()
    net.load_state_dict({**iris["init"], **iris["theta"]})  # θ* everywhere (the body of a last-layer model too)
    names = ["2.weight", "2.bias"] if subset == "last_layer" else list(iris["init"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn = bw.wrap(net, "laplace", num_data=120, prior_std=1.0, prior_mean={n: iris["init"][n] for n in names},
                      hessian_structure=structure, subset_of_weights=subset, **kw)
        if fit:
            x, y = iris["x"], iris["y"]
            bnn.fit_curvature([(x[:64], y[:64]), (x[64:], y[64:])])
    return bnn


def _theirs(iris, structure, subset, prior_precision=1.0):
    laplace = pytest.importorskip("laplace")
    from laplace.curvature import CurvlinopsGGN

    net = _net()
    net.load_state_dict({**iris["init"], **iris["theta"]})
    names = ["2.weight", "2.bias"] if subset == "last_layer" else list(iris["init"])
    prior_mean = torch.cat([iris["init"][n].flatten() for n in names])
    la = laplace.Laplace(net, "classification", subset_of_weights=subset, hessian_structure=structure,
                         prior_precision=prior_precision, prior_mean=prior_mean, backend=CurvlinopsGGN)
    la.fit(DataLoader(TensorDataset(iris["x"], iris["y"]), batch_size=64))
    return la


def _their_precision_times(la, v):
    """P v for laplace-torch's posterior precision (dense or KronDecomposed), v (M, P)."""
    prec = la.posterior_precision
    if torch.is_tensor(prec):
        return v @ prec.T
    return prec.bmm(v.unsqueeze(1), exponent=1).squeeze(1)


#: laplace-torch's dense GGN (Curvlinops ``linop @ torch.eye(P)``) multiplies by a float32 identity, so its
#: "full" reference carries float32 rounding (measured: 3e-8 relative on P, 2e-7 on the functional variance);
#: its Kron factors are float64 and agree with ours to ~1e-15
TOL = {"full": {"rtol": 1e-6, "atol": 1e-9}, "kron": {"rtol": 1e-10, "atol": 1e-12}}


@pytest.mark.parametrize("structure, subset", [("full", "last_layer"), ("kron", "last_layer"), ("kron", "all"),
                                               ("full", "all")])
def test_precision_evidence_and_probit_match_laplace_torch(iris, structure, subset):
    bnn, la = _ours(iris, structure, subset), _theirs(iris, structure, subset)
    tol = TOL[structure]
    xv = iris["xv"]
    # first: laplace-torch's log_marginal_likelihood(δ) sets its prior precision to δ
    torch.testing.assert_close(bnn.predict(xv), la(xv, pred_type="glm", link_approx="probit"), **tol)
    ours = bnn.posterior_precision()
    num = ours.shape[0]
    assert num == (27 if subset == "last_layer" else 67) == la.n_params
    v = torch.randn(7, num, dtype=DT, generator=torch.Generator().manual_seed(0))
    theirs = _their_precision_times(la, v)
    assert float(theirs.abs().max()) > 1.0
    torch.testing.assert_close(v @ ours.T, theirs, rtol=tol["rtol"], atol=tol["rtol"] * float(theirs.abs().max()))
    torch.testing.assert_close(bnn.train_log_likelihood, la.log_likelihood.reshape(()), rtol=1e-10, atol=0)
    for delta in (1.0, 0.3, 20.0):
        torch.testing.assert_close(bnn.log_marginal_likelihood(delta),
                                   la.log_marginal_likelihood(torch.tensor(delta, dtype=DT)).reshape(()),
                                   rtol=tol["rtol"], atol=0)
    # the marginal variances are diag(P^{-1})
    torch.testing.assert_close(_flat(bnn.posterior_var.as_dict()), torch.linalg.inv(ours).diagonal(), rtol=1e-9,
                               atol=0)


@pytest.mark.parametrize("structure, subset", [("kron", "last_layer"), ("full", "all"), ("kron", "all")])
def test_functional_variance_is_j_p_inverse_jt(iris, structure, subset):
    """diag(J P^{-1} Jᵀ) with J from torch.func and P as a dense matrix (the Kron variance avoids J)."""
    bnn = _ours(iris, structure, subset)
    xv = iris["xv"][:10]
    theta = {n: t.detach() for n, t in bnn.theta.items()}
    jac = torch.func.jacrev(lambda th: bnn.forward_with(th, xv))(theta)
    jac = torch.cat([jac[n].reshape(10, 3, -1) for n in theta], -1)
    expected = torch.einsum("bkp,pq,bkq->bk", jac, torch.linalg.inv(bnn.posterior_precision()), jac)
    f_mu, f_var = bnn.functional_moments(xv)
    torch.testing.assert_close(f_var, expected, rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(f_mu, bnn.forward_with(theta, xv).detach())


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_samples_have_the_posterior_covariance(iris, structure):
    bnn = _ours(iris, structure, "last_layer", chunk_size=4)
    bnn.prior_precision = 5.0
    cov = torch.linalg.inv(bnn.posterior_precision())
    draws = bnn.sample(40_000, generator=torch.Generator().manual_seed(0))
    flat = torch.cat([(draws[n] - bnn.theta[n].detach()).reshape(40_000, -1) for n in bnn.theta.keys()], 1)
    mean_z = flat.mean(0) / (cov.diagonal() / 40_000).sqrt()
    assert mean_z.abs().max() < 5
    emp = flat.T @ flat / 40_000
    se = ((cov.diagonal()[:, None] * cov.diagonal()[None, :] + cov.square()) / 40_000).sqrt()
    assert ((emp - cov) / se).abs().max() < 5.5  # 378 distinct entries
    # linearised samples are f + J (θ_s − θ*) for the same draws; "mc" averages them
    xv = iris["xv"]
    theta = {n: t.detach() for n, t in bnn.theta.items()}
    thetas = bnn.sample(4, generator=torch.Generator().manual_seed(1))
    outs = bnn.sample_logits(xv, 4, generator=torch.Generator().manual_seed(1))
    for s in range(4):
        d = {n: thetas[n][s] - theta[n] for n in theta}
        expected = torch.func.jvp(lambda th: bnn.forward_with(th, xv), (theta,), (d,))
        torch.testing.assert_close(outs[s], expected[0] + expected[1], rtol=1e-10, atol=1e-12)
    mc = bnn.predict(xv, 4, generator=torch.Generator().manual_seed(1), link_approx="mc")
    torch.testing.assert_close(mc, outs.softmax(-1).mean(0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("structure, subset", [("full", "last_layer"), ("kron", "all")])
def test_marglik_optimum_is_the_grid_argmax(iris, structure, subset):
    bnn = _ours(iris, structure, subset)
    best = bnn.optimize_prior_precision("marglik")
    assert bnn.prior_precision == best
    grid = torch.logspace(-3, 3, 1201, dtype=DT).tolist()
    values = [float(bnn.log_marginal_likelihood(d)) for d in grid]
    i = max(range(len(grid)), key=values.__getitem__)
    assert 0 < i < len(grid) - 1
    assert grid[i - 1] <= best <= grid[i + 1]
    assert float(bnn.log_marginal_likelihood()) >= values[i] - 1e-12
    # the posterior follows δ
    torch.testing.assert_close(_flat(bnn.posterior_var.as_dict()),
                               torch.linalg.inv(bnn.posterior_precision()).diagonal(), rtol=1e-9, atol=0)


@pytest.mark.parametrize("structure", ["full", "kron"])
def test_empirical_fisher_structures_are_sums_of_gradient_outer_products(iris, structure):
    bnn = _ours(iris, structure, "last_layer", curvature="empirical_fisher")
    x, y = iris["x"], iris["y"]
    theta = {n: t.detach() for n, t in bnn.theta.items()}
    grads = bnn.per_example_grads(x, y, theta)  # (N, *shape) each
    g = torch.cat([grads[n].reshape(120, -1) for n in theta], 1)
    h = bnn.posterior_precision() - torch.eye(27, dtype=DT)
    if structure == "full":
        torch.testing.assert_close(h, g.T @ g, rtol=1e-9, atol=1e-12)
    else:  # G = Σ δδᵀ (δ = the bias gradient), A = (1/N) Σ φφᵀ
        phi = torch.tanh(x @ iris["theta"]["0.weight"].T + iris["theta"]["0.bias"])
        gb = grads["2.bias"]
        G, A = gb.T @ gb, phi.T @ phi / 120
        torch.testing.assert_close(h[24:, 24:], G, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(h[:24, :24], torch.kron(G, A), rtol=1e-9, atol=1e-12)
        assert float(h[:24, 24:].abs().max()) == 0.0


def test_last_layer_is_found_by_timm_torchvision_or_module_order():
    class Timm(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(3, 4)
            self.proj = nn.Linear(4, 2)
            self.extra = nn.Linear(2, 2)

        def get_classifier(self):
            return self.proj

        def forward(self, x):
            return self.proj(self.body(x))

    class Vision(nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = nn.Sequential(nn.Dropout(), nn.Linear(4, 3))
            self.later = nn.Linear(3, 3)

    assert find_last_layer(Timm()) == "proj"
    assert find_last_layer(Vision()) == "classifier.1"
    assert find_last_layer(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2), nn.Softmax(-1))) == "2"
    bnn = bw.wrap(Timm(), "laplace", num_data=10, subset_of_weights="last_layer")
    assert bnn.bayesian_names == ["proj.weight", "proj.bias"] and bnn.last_layer_name == "proj"
    with pytest.raises(ValueError, match="no nn.Linear"):
        find_last_layer(nn.Sequential(nn.Conv2d(1, 2, 3)))


@pytest.mark.parametrize("kwargs, match", [
    ({"hessian_structure": "block"}, r"hessian_structure='block'.*accepted: \('diag', 'kron', 'full', 'lowrank'\)"),
    ({"subset_of_weights": "random"},
     r"subset_of_weights='random'.*accepted: \('all', 'last_layer', 'subnetwork', 'auto'\)"),
    ({"subset_of_weights": "last_layer", "params": ["0.*"]}, "one of them"),
    ({"hessian_structure": "full", "bias": "uninformative"}, "flat one"),
])
def test_bad_options_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.wrap(_net(), "laplace", num_data=10, **kwargs)


def test_full_refuses_too_many_parameters():
    big = nn.Linear(200, 101)  # 20,301 parameters
    assert sum(p.numel() for p in big.parameters()) > MAX_FULL_PARAMS
    with pytest.raises(ValueError, match=f"at most {MAX_FULL_PARAMS}.*P = 20301"):
        bw.wrap(big, "laplace", num_data=10, hessian_structure="full")


def test_kron_keeps_a_diagonal_for_other_layers(iris):
    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)).to(DT)
    with pytest.warns(RuntimeWarning, match="keep a diagonal"):
        bnn = bw.wrap(net, "laplace", num_data=120, hessian_structure="kron")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn.fit_curvature([(iris["x"], iris["y"])])
        diag = bw.wrap(net, "laplace", num_data=120).fit_curvature([(iris["x"], iris["y"])])
    for n in ("1.weight", "1.bias"):
        torch.testing.assert_close(bnn.curvature_diag[n], diag.curvature_diag[n])
    xv = iris["xv"][:5]
    theta = {n: t.detach() for n, t in bnn.theta.items()}
    jac = torch.func.jacrev(lambda th: bnn.forward_with(th, xv))(theta)
    jac = torch.cat([jac[n].reshape(5, 3, -1) for n in theta], -1)
    expected = torch.einsum("bkp,pq,bkq->bk", jac, torch.linalg.inv(bnn.posterior_precision()), jac)
    torch.testing.assert_close(bnn.functional_moments(xv)[1], expected, rtol=1e-9, atol=1e-14)
    assert math.isfinite(float(bnn.log_marginal_likelihood()))


@pytest.mark.parametrize("structure, subset", [("full", "last_layer"), ("kron", "all")])
def test_structured_posterior_survives_a_checkpoint(iris, structure, subset, tmp_path):
    bnn = _ours(iris, structure, subset)
    bnn.optimize_prior_precision()
    torch.save(bnn.state_dict(), tmp_path / "ckpt.pt")
    fresh = _ours(iris, structure, subset, fit=False)
    assert not fresh.is_ready()
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    assert fresh.is_ready() and fresh.prior_precision == bnn.prior_precision
    xv = iris["xv"]
    torch.testing.assert_close(fresh.predict(xv), bnn.predict(xv), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(fresh.log_marginal_likelihood(), bnn.log_marginal_likelihood(), rtol=1e-12, atol=0)


def test_conv_kron_matches_laplace_torch():
    """KFAC for Conv2d from unfolded patches (Grosse & Martens 2016): A averages over examples and positions."""
    laplace = pytest.importorskip("laplace")
    from laplace.curvature import CurvlinopsGGN

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(27, 4)).to(DT)
    x, y = torch.randn(40, 2, 6, 6, dtype=DT), torch.randint(0, 4, (40,))
    bnn = bw.wrap(net, "laplace", num_data=40, prior_mean="zero", hessian_structure="kron")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn.fit_curvature([(x[:25], y[:25]), (x[25:], y[25:])])
    la = laplace.Laplace(net, "classification", subset_of_weights="all", hessian_structure="kron",
                         backend=CurvlinopsGGN)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=25))
    xv = x[:10]
    torch.testing.assert_close(bnn.predict(xv), la(xv, pred_type="glm", link_approx="probit"), rtol=1e-10,
                               atol=1e-12)
    ours = bnn.posterior_precision()
    v = torch.randn(5, ours.shape[0], dtype=DT, generator=torch.Generator().manual_seed(0))
    theirs = _their_precision_times(la, v)
    torch.testing.assert_close(v @ ours.T, theirs, rtol=1e-10, atol=1e-10 * float(theirs.abs().max()))
    torch.testing.assert_close(bnn.log_marginal_likelihood(), la.log_marginal_likelihood().reshape(()), rtol=1e-10,
                               atol=0)
    theta = {n: t.detach() for n, t in bnn.theta.items()}
    jac = torch.func.jacrev(lambda th: bnn.forward_with(th, xv))(theta)
    jac = torch.cat([jac[n].reshape(10, 4, -1) for n in theta], -1)
    expected = torch.einsum("bkp,pq,bkq->bk", jac, torch.linalg.inv(ours), jac)
    torch.testing.assert_close(bnn.functional_moments(xv)[1], expected, rtol=1e-9, atol=1e-14)
    draws = bnn.sample(3, generator=torch.Generator().manual_seed(0))
    assert draws["0.weight"].shape == (3, 3, 2, 3, 3)


@pytest.mark.parametrize("structure, subset", [("full", "last_layer"), ("kron", "all")])
def test_gaussian_likelihood_matches_laplace_torch(structure, subset):
    """Regression: Λ = I/σ² (laplace-torch keeps the 1/σ² outside H; the posterior precisions agree)."""
    laplace = pytest.importorskip("laplace")
    from laplace.curvature import CurvlinopsGGN

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(DT)
    x, y = torch.randn(60, 3, dtype=DT), torch.randn(60, 2, dtype=DT)
    bnn = bw.wrap(net, "laplace", num_data=60, prior_mean="zero", hessian_structure=structure,
                  subset_of_weights=subset, likelihood="gaussian", noise_std=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn.fit_curvature([(x, y)])
    la = laplace.Laplace(net, "regression", subset_of_weights=subset, hessian_structure=structure, sigma_noise=0.5,
                         backend=CurvlinopsGGN)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=60))
    tol = TOL[structure]
    mean, var = bnn.predict(x[:5])
    their_mean, their_var = la(x[:5], pred_type="glm")
    torch.testing.assert_close(mean, their_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, their_var.diagonal(dim1=1, dim2=2) + 0.25, **tol)
    ours = bnn.posterior_precision()
    v = torch.randn(5, ours.shape[0], dtype=DT, generator=torch.Generator().manual_seed(0))
    theirs = _their_precision_times(la, v)
    torch.testing.assert_close(v @ ours.T, theirs, rtol=tol["rtol"], atol=tol["rtol"] * float(theirs.abs().max()))
    torch.testing.assert_close(bnn.log_marginal_likelihood(), la.log_marginal_likelihood().reshape(()),
                               rtol=tol["rtol"], atol=0)


def test_kron_fisher_is_a_monte_carlo_ggn(iris):
    """curvature="fisher" (sampled labels) averages to the GGN factor G: 4000 samples, about 1.6 % error."""
    ggn = _ours(iris, "kron", "all").posterior_precision()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fisher = _ours(iris, "kron", "all", fit=False, curvature="fisher", curvature_samples=4000)
        fisher.fit_curvature([(iris["x"], iris["y"])], generator=torch.Generator().manual_seed(0))
    h = ggn - torch.eye(67, dtype=DT)
    assert float((fisher.posterior_precision() - ggn).abs().max()) < 0.03 * float(h.abs().max())


def test_full_over_all_weights_does_not_depend_on_the_chunk_size(iris):
    small, big = _ours(iris, "full", "all", curvature_chunk_size=7), _ours(iris, "full", "all")
    torch.testing.assert_close(small.posterior_precision(), big.posterior_precision(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(small.predict(iris["xv"]), big.predict(iris["xv"]), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------- layerwise prior precision
def _dense_log_marginal_likelihood(bnn, deltas):
    """log p(D | θ*) − ½ [log det P − Σ_t n_t log δ_t + Σ_t δ_t |θ*_t − θ̄_t|²] from the dense P (the reference)."""
    names = list(bnn.theta.keys())
    bnn_delta = bnn.prior_precision
    bnn.prior_precision = deltas
    try:
        precision = bnn.posterior_precision()
    finally:
        bnn.prior_precision = bnn_delta
    occam = sum(bnn.theta[n].numel() * math.log(d) for n, d in zip(names, deltas))
    penalty = sum(d * float((bnn.theta[n].detach() - bnn.prior.mean[n]).square().sum()) for n, d in zip(names, deltas))
    return float(bnn.train_log_likelihood) - 0.5 * (float(torch.linalg.slogdet(precision)[1]) - occam + penalty)


@pytest.mark.parametrize("structure, subset", [("full", "last_layer"), ("kron", "last_layer"), ("kron", "all"),
                                               ("full", "all"), ("diag", "all")])
def test_layerwise_prior_precision_matches_the_dense_posterior_and_laplace_torch(iris, structure, subset):
    bnn = _ours(iris, structure, subset)
    count = len(bnn.theta)
    deltas = [0.5, 3.0, 0.2, 7.0][:count]
    bnn.prior_precision = deltas
    assert torch.equal(bnn.prior_precision, torch.tensor(deltas, dtype=DT))
    # the posterior: every diagonal block of P gets its own δ, and the variances are diag(P^{-1})
    precision = bnn.posterior_precision()
    h_only = _ours(iris, structure, subset)
    h_only.prior_precision = 1e-30
    added = (precision - h_only.posterior_precision()).diagonal()
    expected = torch.cat([torch.full((bnn.theta[n].numel(),), d, dtype=DT) for n, d in zip(bnn.theta.keys(), deltas)])
    torch.testing.assert_close(added, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(_flat(bnn.posterior_var.as_dict()), torch.linalg.inv(precision).diagonal(),
                               rtol=1e-9, atol=0)
    # the evidence: the structure's closed form equals the dense reference
    assert float(bnn.log_marginal_likelihood()) == pytest.approx(_dense_log_marginal_likelihood(bnn, deltas),
                                                                 rel=1e-10)
    assert float(bnn.log_marginal_likelihood(torch.tensor(deltas, dtype=DT))) == pytest.approx(
        float(bnn.log_marginal_likelihood()), rel=1e-12)
    if structure == "diag" or subset == "last_layer":  # laplace-torch's last-layer classes take a scalar or diagonal δ
        return
    # laplace-torch with the same per-layer prior precision (one per parameter tensor there too)
    la = _theirs(iris, structure, subset, prior_precision=torch.tensor(deltas, dtype=DT))
    tol = TOL[structure]
    torch.testing.assert_close(bnn.log_marginal_likelihood(),
                               la.log_marginal_likelihood(torch.tensor(deltas, dtype=DT)).reshape(()),
                               rtol=tol["rtol"], atol=0)
    xv = iris["xv"]
    torch.testing.assert_close(bnn.predict(xv), la(xv, pred_type="glm", link_approx="probit"), **tol)


@pytest.mark.parametrize("structure, subset", [("full", "last_layer"), ("kron", "all"), ("full", "all"),
                                               ("diag", "all")])
def test_layerwise_marglik_optimum_is_a_stationary_point_above_the_scalar_optimum(iris, structure, subset):
    bnn = _ours(iris, structure, subset)
    scalar_best = bnn.optimize_prior_precision("marglik")
    scalar_evidence = float(bnn.log_marginal_likelihood())
    best = bnn.optimize_prior_precision("marglik", prior_structure="layerwise")
    assert torch.is_tensor(best) and best.shape == (len(bnn.theta),)
    assert torch.equal(bnn.prior_precision, best)
    assert float(best.min()) < scalar_best < float(best.max())
    evidence = float(bnn.log_marginal_likelihood())
    assert evidence > scalar_evidence + 1e-3
    # zero gradient in log δ, by autograd through the closed form (a Cholesky factor for "full")
    log_delta = best.log().clone().requires_grad_(True)
    value = bnn.log_marginal_likelihood(log_delta.exp())
    (grad,) = torch.autograd.grad(value, log_delta)
    assert float(grad.abs().max()) < 1e-6 * max(1.0, abs(evidence))
    # and a maximum: any coordinate moved by ±1% lowers it
    for t in range(len(best)):
        for factor in (0.99, 1.01):
            moved = best.clone()
            moved[t] *= factor
            assert float(bnn.log_marginal_likelihood(moved)) < evidence
    # the posterior follows
    torch.testing.assert_close(_flat(bnn.posterior_var.as_dict()),
                               torch.linalg.inv(bnn.posterior_precision()).diagonal(), rtol=1e-9, atol=0)


def test_layerwise_prior_precision_survives_a_checkpoint_and_old_scalar_checkpoints_load(iris, tmp_path):
    bnn = _ours(iris, "kron", "all")
    bnn.optimize_prior_precision("marglik", prior_structure="layerwise")
    path = tmp_path / "ckpt.pt"
    torch.save(bnn.state_dict(), path)
    fresh = _ours(iris, "kron", "all", fit=False)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    torch.testing.assert_close(fresh.prior_precision, bnn.prior_precision, rtol=0, atol=0)
    xv = iris["xv"]
    torch.testing.assert_close(fresh.predict(xv), bnn.predict(xv), rtol=0, atol=0)
    old = {**bnn.state_dict(), "_prior_precision": torch.tensor(2.5, dtype=DT)}  # saved before layerwise δ
    fresh.load_state_dict(old)
    assert fresh.prior_precision == 2.5
    with pytest.raises(ValueError, match=r"prior_precision has 3 values; accepted: one number, or one per "
                                         r"Bayesian parameter tensor \(4: \['0.weight'"):
        fresh.prior_precision = [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"prior_precision\[1\]=-2.0 must be a number"):
        fresh.prior_precision = [1.0, -2.0, 3.0, 4.0]
