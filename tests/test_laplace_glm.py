"""Diagonal Laplace: exact GGN, GLM predictive, marginal likelihood and prior-precision tuning.

The deterministic quantities are compared with laplace-torch (Daxberger et al.
2021) on the same weights, data, prior mean and prior precision, in float64:
``Laplace(net, "classification", subset_of_weights="all", hessian_structure="diag")``
with its default ``CurvlinopsGGN`` backend, whose diagonal is the exact
diag(Σ_n J_nᵀ Λ_n J_n) from ``torch.func`` Jacobians. laplace-torch's conventions
that matter here: its losses are summed (CrossEntropyLoss/MSELoss with
``reduction="sum"``, the latter times ½), its ``H`` for regression leaves out the
1/σ² that its posterior precision and ours include, it uses all of
``len(train_loader.dataset)`` as N (so our loader covers the whole set: N/n = 1),
temperature 1, and a scalar prior precision.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from sklearn.datasets import load_diabetes, load_digits, load_iris
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayeswrap as bw

DT = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")



def _standardised(x):
    x = torch.as_tensor(x, dtype=DT)
    std = x.std(0)
    return (x - x.mean(0)) / torch.where(std > 0, std, torch.ones_like(std))


def _split(n, n_train, seed=0):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[:n_train], perm[n_train:]


def _train_map(model, x, y, steps, lr=1e-2, **wrap_kw):
    """MAP weights of ``model`` (trained in place of a copy) with bayeswrap's objective."""
    bnn = bw.wrap(model, "map", num_data=len(x), **wrap_kw)
    bw.fit(bnn, [(x, y)] * steps, epochs=1, optimizer=torch.optim.Adam(bnn.parameters(), lr=lr), progress=False)
    return {n: t.detach().clone() for n, t in bnn.theta.items()}


def _flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors.values()])


def _laplace_torch():
    return pytest.importorskip("laplace")


# --------------------------------------------------------------------------------------------------
# iris, 4 → 8 → 3 tanh, prior N(θ_init, 1): the reference comparisons
# --------------------------------------------------------------------------------------------------
def _iris_net():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


@pytest.fixture(scope="module")
def iris():
    x, y = load_iris(return_X_y=True)
    x, y = _standardised(x), torch.as_tensor(y)
    tr, va = _split(len(x), 120)
    torch.manual_seed(0)
    init = _iris_net().state_dict()
    net = _iris_net()
    net.load_state_dict(init)
    theta = _train_map(net, x[tr], y[tr], steps=400, prior_std=1.0, prior_mean="init")
    return {"x": x[tr], "y": y[tr], "xv": x[va], "yv": y[va], "init": init, "theta": theta}


def _iris_bnn(iris, prior_std=1.0, fit=True, **kw):
    """bayeswrap's Laplace at θ* with the prior N(θ_init, prior_std²), curvature fitted on two batches."""
    net = _iris_net()
    net.load_state_dict(iris["init"])
    bnn = bw.wrap(net, "laplace", num_data=len(iris["x"]), prior_std=prior_std, prior_mean="init", **kw)
    for n, t in iris["theta"].items():
        bnn.theta[n] = t
    if fit:
        x, y = iris["x"], iris["y"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            bnn.fit_curvature([(x[:64], y[:64]), (x[64:], y[64:])])
    return bnn


def _iris_reference(iris, prior_precision=1.0):
    """laplace-torch's diagonal Laplace on the same weights, data, prior mean and precision."""
    laplace = _laplace_torch()
    from laplace.curvature import CurvlinopsGGN

    net = _iris_net()
    net.load_state_dict(iris["theta"])
    la = laplace.Laplace(net, "classification", subset_of_weights="all", hessian_structure="diag",
                         prior_precision=prior_precision, prior_mean=_flat(iris["init"]), backend=CurvlinopsGGN)
    la.fit(DataLoader(TensorDataset(iris["x"], iris["y"]), batch_size=64))
    return la


def test_ggn_curvature_posterior_and_evidence_match_laplace_torch(iris):
    bnn, la = _iris_bnn(iris), _iris_reference(iris)
    h = _flat(bnn.curvature_diag.as_dict())
    assert h.shape == la.H.shape and h.abs().max() > 1.0
    torch.testing.assert_close(h, la.H, rtol=1e-6, atol=1e-12 * float(la.H.abs().max()))
    torch.testing.assert_close(_flat(bnn.posterior_var.as_dict()), la.posterior_variance, rtol=1e-6, atol=0)
    torch.testing.assert_close(bnn.train_log_likelihood, la.log_likelihood.reshape(()), rtol=1e-10, atol=0)
    lml = bnn.log_marginal_likelihood()
    assert lml.shape == () and lml.dtype == DT
    torch.testing.assert_close(lml, la.log_marginal_likelihood().reshape(()), rtol=1e-8, atol=0)
    for delta in (0.3, 20.0):  # a float here, a tensor there; our model is not changed by the call
        ours = bnn.log_marginal_likelihood(delta)
        theirs = la.log_marginal_likelihood(torch.tensor(delta, dtype=DT)).reshape(())
        torch.testing.assert_close(ours, theirs, rtol=1e-8, atol=0)
    assert bnn.prior_precision == 1.0
    # differentiable in a tensor prior precision: d/dδ = −½ Σ_i [1/(δ + h_i) − 1/δ + (θ*_i − θ̄_i)²]
    delta = torch.tensor(2.0, dtype=DT, requires_grad=True)
    bnn.log_marginal_likelihood(delta).backward()
    d2 = (_flat(iris["theta"]) - _flat(iris["init"])).square().sum()
    expected = -0.5 * ((1 / (2.0 + h)).sum() - h.numel() / 2.0 + d2)
    torch.testing.assert_close(delta.grad, expected, rtol=1e-10, atol=0)


def test_ggn_is_the_expected_fisher_and_fisher_samples_average(iris):
    """diag GGN = E_{ỹ ~ p(y|x,θ*)}[g_ỹ²], enumerated over all labels; chunking does not matter."""
    x = iris["x"][:20]
    bnn = _iris_bnn(iris, fit=False, curvature_chunk_size=1000)
    ggn = bnn.ggn_diagonal(x)
    with torch.no_grad():
        probs = bnn.forward_with(bnn.theta.as_dict(), x).softmax(-1)
    expected = {n: torch.zeros_like(t) for n, t in ggn.items()}
    for label in range(3):
        g = bnn.per_example_grads(x, torch.full((20,), label))
        for n in expected:
            expected[n] += (probs[:, label].reshape(-1, *[1] * (g[n].dim() - 1)) * g[n].square()).sum(0)
    for n in ggn:
        torch.testing.assert_close(ggn[n], expected[n], rtol=1e-10, atol=1e-14)
    # fewer Jacobian rows per chunk than classes: the classes of one example are split into chunks
    small = _iris_bnn(iris, fit=False, curvature_chunk_size=2).ggn_diagonal(x)
    for n in ggn:
        torch.testing.assert_close(small[n], ggn[n], rtol=1e-12, atol=1e-15)
    # curvature="fisher" with M samples = the mean of M empirical-Fisher fits at labels drawn in turn
    y = iris["y"][:20]
    fisher = _iris_bnn(iris, fit=False, curvature="fisher", curvature_samples=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        fisher.fit_curvature([(x, y)], generator=torch.Generator().manual_seed(3))
        gen, mean = torch.Generator().manual_seed(3), {n: torch.zeros_like(t) for n, t in ggn.items()}
        for _ in range(3):
            labels = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            ef = _iris_bnn(iris, fit=False, curvature="empirical_fisher")
            ef.fit_curvature([(x, labels)])
            for n in mean:
                mean[n] += ef.curvature_diag[n] / 3
    for n in mean:  # both carry the factor N/n = 120/20
        torch.testing.assert_close(fisher.curvature_diag[n], mean[n], rtol=1e-10, atol=1e-14)


def test_glm_probit_matches_laplace_torch(iris):
    bnn, la = _iris_bnn(iris), _iris_reference(iris)
    xv = iris["xv"]
    f_mu, f_var = bnn.functional_moments(xv)
    js, f_ref = la.backend.jacobians(xv)
    var_ref = la.functional_variance(js).diagonal(dim1=1, dim2=2)
    torch.testing.assert_close(f_mu, f_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f_var, var_ref, rtol=1e-8, atol=0)
    probs = bnn.predict(xv)  # default: pred_type="glm", link_approx="probit"
    torch.testing.assert_close(probs, la(xv, pred_type="glm", link_approx="probit"), rtol=1e-10, atol=1e-12)
    assert torch.equal(bnn.predict(xv, num_samples=3), probs)  # deterministic: S is not used
    torch.testing.assert_close(bnn.predict(xv, 0), bnn.forward_with(bnn.theta.as_dict(), xv).softmax(-1).detach())


def test_glm_samples_are_the_exact_linearisation_and_mc_matches_laplace_torch(iris):
    bnn, la = _iris_bnn(iris, chunk_size=3), _iris_reference(iris)
    xv = iris["xv"]
    js, f = la.backend.jacobians(xv)  # (B, K, P)
    # the same generator state gives the same θ_s for "glm" and "nn": bnn.sample draws of chunk_size = 3
    gen = torch.Generator().manual_seed(0)
    chunks = [bnn.sample(k, generator=gen) for k in (3, 3, 1)]
    thetas = {n: torch.cat([c[n] for c in chunks]) for n in chunks[0]}
    outs = bnn.sample_logits(xv, 7, generator=torch.Generator().manual_seed(0))  # 3 vmap chunks
    delta = torch.cat([(t - bnn.theta[n].detach()).reshape(7, -1) for n, t in thetas.items()], 1)  # (S, P)
    torch.testing.assert_close(outs, f + torch.einsum("bkp,sp->sbk", js, delta), rtol=1e-10, atol=1e-12)
    nn_outs = bnn.sample_logits(xv, 7, generator=torch.Generator().manual_seed(0), pred_type="nn")
    torch.testing.assert_close(nn_outs[3], bnn.forward_with({n: t[3] for n, t in thetas.items()}, xv))
    # link "mc" averages exactly these samples
    mc = bnn.predict(xv, 7, generator=torch.Generator().manual_seed(0), link_approx="mc")
    torch.testing.assert_close(mc, outs.softmax(-1).mean(0), rtol=1e-12, atol=1e-14)
    # many samples: laplace-torch draws from N(f, J Σ Jᵀ) in output space, we push θ_s through jvp
    bnn.chunk_size = 5000
    ours = bnn.predict(xv, 20_000, generator=torch.Generator().manual_seed(1), link_approx="mc")
    theirs = la(xv, pred_type="glm", link_approx="mc", n_samples=20_000, generator=torch.Generator().manual_seed(2))
    # Monte Carlo std of a probability ≤ 0.5/sqrt(20000) = 0.0035 each; 30 × 3 values
    assert (ours - theirs).abs().max() < 0.02
    assert (ours - theirs).abs().mean() < 0.004


def test_marglik_optimum_is_the_grid_argmax(iris):
    bnn = _iris_bnn(iris)
    best = bnn.optimize_prior_precision()
    assert isinstance(best, float) and bnn.prior_precision == best
    grid = torch.logspace(-3, 3, 1201, dtype=DT).tolist()  # steps of 10^0.005 (1.2 %)
    values = [float(bnn.log_marginal_likelihood(d)) for d in grid]
    i = max(range(len(grid)), key=values.__getitem__)
    assert 0 < i < len(grid) - 1
    assert grid[i - 1] <= best <= grid[i + 1]
    assert float(bnn.log_marginal_likelihood()) >= values[i] - 1e-12
    # MacKay's fixed point: δ = γ / |θ* − θ̄|², γ = Σ_i h_i / (δ + h_i) the effective number of parameters
    h = _flat(bnn.curvature_diag.as_dict())
    gamma = (h / (best + h)).sum()
    d2 = (_flat(iris["theta"]) - _flat(iris["init"])).square().sum()
    assert math.isclose(best, float(gamma / d2), rel_tol=1e-9)
    # the posterior follows δ
    torch.testing.assert_close(_flat(bnn.posterior_var.as_dict()), 1 / (best + h), rtol=1e-12, atol=0)
    # laplace-torch's gradient ascent on log δ lands at the same value
    la = _iris_reference(iris)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.optimize_prior_precision(pred_type="glm", method="marglik", n_steps=1000, lr=0.1)
    assert math.isclose(float(la.prior_precision), best, rel_tol=1e-3)


def test_val_optimum_is_the_grid_point_with_lowest_nll(iris):
    bnn, la = _iris_bnn(iris), _iris_reference(iris)
    # three wrong labels: the MAP is confidently wrong there, so a wider predictive (smaller δ) helps, up to a point
    xv, yv = iris["xv"], iris["yv"].clone()
    yv[:3] = (yv[:3] + 1) % 3
    grid = [1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3]
    nlls = []  # computed independently, with laplace-torch's probit predictive
    for delta in grid:
        la.prior_precision = delta
        p = la(xv, pred_type="glm", link_approx="probit")
        nlls.append(float(-p[torch.arange(len(yv)), yv].log().mean()))
    expected = grid[min(range(len(grid)), key=nlls.__getitem__)]
    assert expected not in (grid[0], grid[-1])  # an interior optimum makes the check meaningful
    best = bnn.optimize_prior_precision("val", val_loader=[(xv[:12], yv[:12]), (xv[12:], yv[12:])], grid=grid)
    assert best == expected and bnn.prior_precision == expected
    assert bnn.val_search["grid"] == grid
    torch.testing.assert_close(torch.tensor(bnn.val_search["nll"]), torch.tensor(nlls), rtol=1e-9, atol=0)
    h = _flat(bnn.curvature_diag.as_dict())
    torch.testing.assert_close(_flat(bnn.posterior_var.as_dict()), 1 / (expected + h), rtol=1e-12, atol=0)
    # a sampled predictive uses the same noise for every grid value: repeatable
    first = bnn.optimize_prior_precision("val", val_loader=[(xv, yv)], grid=grid, pred_type="nn", num_samples=20)
    nll_first = list(bnn.val_search["nll"])
    assert bnn.optimize_prior_precision("val", val_loader=[(xv, yv)], grid=grid, pred_type="nn",
                                        num_samples=20) == first
    assert bnn.val_search["nll"] == nll_first


def _state(bnn):
    return {k: v.clone() for k, v in bnn.state_dict().items() if torch.is_tensor(v)}


def test_validation_search_mutates_nothing_and_scores_as_the_legacy_keywords(iris):
    """The search sets δ only while it scores, and each score is the legacy per-call predictive's NLL."""
    from bayeswrap.evaluation.calibration import nll
    from bayeswrap.methods.laplace import GLM, validation_search
    from bayeswrap.methods.predictives import Sampled

    bnn, ref = _iris_bnn(iris), _iris_bnn(iris)
    xv, yv = iris["xv"], iris["yv"].clone()
    yv[:3] = (yv[:3] + 1) % 3
    loader = [(xv[:12], yv[:12]), (xv[12:], yv[12:])]
    grid = [1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e3]
    before = _state(bnn)
    for predictive, legacy in [(GLM("probit"), {}), (GLM("mc"), {"link_approx": "mc"}), (Sampled(), {"pred_type": "nn"}),
                               (None, {})]:
        record = validation_search(bnn, loader, grid, predictive=predictive, num_samples=20, seed=3)
        assert (bnn.pred_type, bnn.link_approx, bnn.prior_precision) == ("glm", "probit", 1.0)
        assert not hasattr(bnn, "val_search")
        after = _state(bnn)
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        expected = []  # the search as it ran before: δ set on the model, the legacy keywords, one generator per δ
        for delta in grid:
            ref.prior_precision = delta
            g = torch.Generator().manual_seed(3)
            expected.append(nll(torch.cat([ref.predict(x, 20, g, **legacy) for x, _ in loader]), yv))
        assert record["grid"] == grid and record["val_nll"] == expected
        assert record["chosen"] == grid[record["chosen_index"]] == grid[min(range(len(grid)), key=expected.__getitem__)]
        # optimize_prior_precision("val") sets what the search chose, and only δ and its record
        fresh = _iris_bnn(iris)
        assert fresh.optimize_prior_precision("val", val_loader=loader, grid=grid, num_samples=20, seed=3,
                                              **legacy) == record["chosen"]
        assert fresh.val_search == {"grid": grid, "nll": expected}
        assert (fresh.pred_type, fresh.link_approx) == ("glm", "probit")


def test_validation_search_brackets_as_compare_did(iris):
    """With bounds, the search is evaluation.tuning.tune over optimize_prior_precision("val") one value at a time."""
    from bayeswrap.evaluation.tuning import tune
    from bayeswrap.methods.laplace import GLM, validation_search

    bnn, old = _iris_bnn(iris), _iris_bnn(iris, link_approx="mc")
    loader = [(iris["xv"], iris["yv"])]
    grid, bounds = [1e-4, 1e-3], (1e-6, 1e6)  # the optimum lies above the grid: the search extends it

    def val_nll_of(value):  # what compare ran before: one optimize_prior_precision("val") per value
        old.optimize_prior_precision("val", val_loader=loader, grid=[value], num_samples=8, seed=1)
        return old.val_search["nll"][0]

    expected = tune(grid, val_nll_of, bounds=bounds)
    record = validation_search(bnn, loader, grid, predictive=GLM("mc"), num_samples=8, seed=1, bounds=bounds)
    assert record["extensions"] and record == expected
    assert bnn.prior_precision == 1.0 and bnn.link_approx == "probit"


def test_default_predictive_maps_the_legacy_keywords(iris):
    from bayeswrap.methods.laplace import GLM, validation_search
    from bayeswrap.methods.predictives import Sampled

    bnn = _iris_bnn(iris)
    assert repr(bnn.default_predictive()) == "GLM(link='probit')"
    assert repr(bnn.default_predictive(link_approx="mc")) == "GLM(link='mc')"
    assert isinstance(bnn.default_predictive(pred_type="nn"), Sampled)
    assert repr(_iris_bnn(iris, pred_type="nn", link_approx="mc").default_predictive()) == "Sampled()"
    x, g = iris["xv"], lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert torch.equal(bnn.predict(x, 4, g(), predictive=GLM("mc")), bnn.predict(x, 4, g(), link_approx="mc"))
    assert torch.equal(bnn.predict(x, 4, g(), predictive=Sampled()), bnn.predict(x, 4, g(), pred_type="nn"))
    assert torch.equal(bnn.sample_logits(x, 4, g(), predictive=GLM()), bnn.sample_logits(x, 4, g()))
    with pytest.raises(TypeError, match=r"\['temperature'\] are not accepted by method 'laplace'; accepted: model, "
                                        r"pred_type, link_approx"):
        bnn.predict(x, 4, temperature=2.0)
    with pytest.raises(ValueError, match=r"model='mpm' is not accepted by method 'laplace'"):
        bnn.predict(x, 4, model="mpm")
    with pytest.raises(ValueError, match=r"link='bridge' is not known; accepted: \('mc', 'probit'\)"):
        GLM("bridge")
    vi = bw.wrap(_iris_net(), "vi", num_data=8)
    with pytest.raises(TypeError, match=r"GLM\(...\) is the linearised predictive of method 'laplace', not of "
                                        r"method 'vi'"):
        vi.predict(x, 2, predictive=GLM())
    with pytest.raises(TypeError, match=r"searches the prior precision of a Laplace model; got 'vi'"):
        validation_search(vi, [(x, iris["yv"])])


def test_flat_bias_prior_is_left_out_of_the_evidence(iris):
    bnn = _iris_bnn(iris, bias="uninformative", prior_std=0.5)
    h, d2, logdet = bnn.curvature_diag.as_dict(), 0.0, 0.0
    delta = 3.0
    for n, hn in h.items():
        if n.endswith("weight"):
            logdet += float(torch.log1p(hn / delta).sum())
            d2 += float((iris["theta"][n] - iris["init"][n]).square().sum())
        else:  # a flat prior: v = 1 / h, and no term in the evidence
            torch.testing.assert_close(bnn.posterior_var[n], 1 / hn, rtol=1e-12, atol=0)
    expected = float(bnn.train_log_likelihood) - 0.5 * (logdet + delta * d2)
    assert math.isclose(float(bnn.log_marginal_likelihood(delta)), expected, rel_tol=1e-12)
    assert bnn.prior_precision == 4.0  # 1 / 0.5²


def test_prior_precision_and_options_survive_a_checkpoint(iris, tmp_path):
    bnn = _iris_bnn(iris)
    bnn.prior_precision = 7.5
    assert bnn.predict(iris["xv"]).max() > _iris_bnn(iris).predict(iris["xv"]).max()  # more confident than at δ = 1
    torch.save(bnn.state_dict(), tmp_path / "laplace.pt")
    fresh = _iris_bnn(iris, fit=False)
    fresh.load_state_dict(torch.load(tmp_path / "laplace.pt", weights_only=True))
    assert fresh.prior_precision == 7.5 and fresh.is_ready()
    assert torch.equal(fresh.predict(iris["xv"]), bnn.predict(iris["xv"]))
    assert torch.equal(fresh.log_marginal_likelihood(), bnn.log_marginal_likelihood())
    # the model-level defaults pick the predictive; calls override them
    nn_model = _iris_bnn(iris, pred_type="nn", link_approx="mc")
    nn_model.prior_precision = 7.5
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert torch.equal(nn_model.predict(iris["xv"], 4, g()), bnn.predict(iris["xv"], 4, g(), pred_type="nn"))
    assert torch.equal(nn_model.predict(iris["xv"], 4, g(), pred_type="glm"),
                       bnn.predict(iris["xv"], 4, g(), link_approx="mc"))
    assert torch.equal(nn_model.sample_logits(iris["xv"], 4, g()),
                       bnn.sample_logits(iris["xv"], 4, g(), pred_type="nn"))


def test_checkpoint_from_before_the_stored_curvature_still_loads(iris):
    bnn = _iris_bnn(iris)
    old = {k: v for k, v in bnn.state_dict().items()
           if not k.startswith(("curvature_diag.", "_prior_precision", "train_log_likelihood"))}
    fresh = _iris_bnn(iris, fit=False)
    fresh.load_state_dict(old)  # strict: the missing buffers are reconstructed
    for n, h in bnn.curvature_diag.items():
        torch.testing.assert_close(fresh.curvature_diag[n], h, rtol=1e-9, atol=1e-12)
    assert fresh.prior_precision == 1.0
    torch.testing.assert_close(fresh.predict(iris["xv"]), bnn.predict(iris["xv"]), rtol=1e-9, atol=1e-12)
    with pytest.raises(bw.NotFittedError, match="training log-likelihood is unknown.*fit_curvature"):
        fresh.log_marginal_likelihood()


def test_ggn_with_batchnorm_uses_the_running_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Tanh(), nn.Linear(7, 3)).to(DT)
    model.train()(torch.randn(64, 5, dtype=DT))  # non-trivial running statistics
    x = torch.randn(9, 5, dtype=DT, generator=torch.Generator().manual_seed(1))
    bnn = bw.wrap(model, "laplace", num_data=9, curvature_chunk_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn.fit_curvature([(x, torch.zeros(9, dtype=torch.long))])  # the GGN does not use the labels
    model.eval()
    probs = model(x).softmax(-1).detach()
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(9):  # per example and label, by plain backward passes
        for label in range(3):
            model.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 1]), torch.tensor([label])).backward()
            for n, p in model.named_parameters():
                expected[n] += probs[i, label] * p.grad.square()
    for n in expected:
        torch.testing.assert_close(bnn.curvature_diag[n], expected[n], rtol=1e-10, atol=1e-14)


# --------------------------------------------------------------------------------------------------
# regression: diabetes, 4 features → 16 → 1 tanh, Gaussian likelihood
# --------------------------------------------------------------------------------------------------
def test_regression_glm_predictive_matches_laplace_torch():
    laplace = _laplace_torch()
    from laplace.curvature import CurvlinopsGGN

    x, y = load_diabetes(return_X_y=True)
    x, y = _standardised(x[:, [2, 3, 8, 9]]), _standardised(y[:, None])
    tr, te = _split(len(x), 300)
    noise, n = 0.7, len(tr)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(DT)
    theta = _train_map(net, x[tr], y[tr], steps=300, prior_std=1.0, prior_mean="zero", likelihood="gaussian",
                       noise_std=noise)
    net.load_state_dict(theta)
    bnn = bw.wrap(net, "laplace", num_data=n, prior_std=1.0, prior_mean="zero", likelihood="gaussian",
                  noise_std=noise)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn.fit_curvature([(x[tr][:150], y[tr][:150]), (x[tr][150:], y[tr][150:])])
    la = laplace.Laplace(net, "regression", subset_of_weights="all", hessian_structure="diag", sigma_noise=noise,
                         prior_precision=1.0, prior_mean=0.0, backend=CurvlinopsGGN)
    la.fit(DataLoader(TensorDataset(x[tr], y[tr]), batch_size=150))
    # laplace-torch's H is Σ JᵀJ; the 1/σ² enters its posterior precision (and ours, in the curvature)
    h = _flat(bnn.curvature_diag.as_dict())
    torch.testing.assert_close(h, la.H / noise**2, rtol=1e-6, atol=1e-12 * float(h.abs().max()))
    torch.testing.assert_close(_flat(bnn.posterior_var.as_dict()), la.posterior_variance, rtol=1e-6, atol=0)
    torch.testing.assert_close(bnn.log_marginal_likelihood(), la.log_marginal_likelihood().reshape(()),
                               rtol=1e-8, atol=0)
    mean, var = bnn.predict(x[te])  # the exact linearised predictive; var includes the noise
    f_mu, f_var = la(x[te], pred_type="glm")
    torch.testing.assert_close(mean, f_mu, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var - noise**2, f_var[:, :, 0], rtol=1e-8, atol=0)
    assert (var - noise**2).min() > 1e-4
    # sampled: moments of linearised samples plus the noise
    bnn.chunk_size = 4000
    m_mc, v_mc = bnn.predict(x[te], 4000, generator=torch.Generator().manual_seed(0), link_approx="mc")
    torch.testing.assert_close(v_mc, var, rtol=0.1, atol=0)
    assert (m_mc - mean).abs().max() < 0.1 * var.sqrt().max()


# --------------------------------------------------------------------------------------------------
# digits: the collapse of the sampled predictive, and the GLM predictive that keeps the MAP's error
# --------------------------------------------------------------------------------------------------
def test_glm_keeps_map_error_where_sampled_predictive_collapses():
    x, y = load_digits(return_X_y=True)
    x, y = _standardised(x), torch.as_tensor(y)
    tr, te = _split(len(x), 1200)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).to(DT)
    net.load_state_dict(_train_map(net, x[tr], y[tr], steps=600, prior_std=1.0, prior_mean="zero"))

    def error(probs):
        return float((probs.argmax(1) != y[te]).double().mean())

    # BayesDLL's setting: the empirical Fisher at a well-fitted MAP, prior N(0, 1)
    bnn = bw.wrap(net, "laplace", num_data=1200, prior_std=1.0, prior_mean="zero", curvature="empirical_fisher",
                  curvature_chunk_size=1200, chunk_size=100)
    with pytest.warns(RuntimeWarning, match=r"pred_type='nn'.*mostly noise.*optimize_prior_precision"):
        bnn.fit_curvature([(x[tr], y[tr])])
    assert bnn.noise_to_signal()[0] > 10
    map_error = error(bnn.predict(x[te], 0))
    assert map_error < 0.06
    nn_error = error(bnn.predict(x[te], 100, generator=torch.Generator().manual_seed(0), pred_type="nn"))
    assert nn_error > map_error + 0.15  # the collapse
    for delta in (1e-4, 1.0, 1e4):
        bnn.prior_precision = delta
        assert error(bnn.predict(x[te])) <= map_error + 0.01, delta  # GLM, probit
    # a strong prior (variance 1e-4) makes the sampled weights harmless: no warning then
    strong = bw.wrap(net, "laplace", num_data=1200, prior_std=0.01, prior_mean="zero", curvature="empirical_fisher",
                     curvature_chunk_size=1200)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        strong.fit_curvature([(x[tr], y[tr])])
    assert strong.noise_to_signal()[1] > 0.5  # although most parameters sit at that prior


# --------------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------------
def _tiny(fit=True, **kw):
    torch.manual_seed(0)
    bnn = bw.wrap(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), "laplace", num_data=8, **kw)
    if fit:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            bnn.fit_curvature([(torch.randn(8, 3), torch.randint(0, 2, (8,)))])
    return bnn


@pytest.mark.parametrize("kwargs, match", [
    ({"pred_type": "mean"}, r"pred_type='mean' is not known; accepted: \('glm', 'nn'\)"),
    ({"link_approx": "bridge"}, r"link_approx='bridge' is not known; accepted: \('mc', 'probit'\)"),
    ({"curvature_samples": 0}, r"curvature_samples=0 must be an integer >= 1"),
    ({"curvature_chunk_size": 2.5}, r"curvature_chunk_size=2.5 must be an integer >= 1"),
])
def test_wrap_rejects_laplace_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _tiny(fit=False, **kwargs)


@pytest.mark.parametrize("call, match", [
    (lambda b: b.predict(torch.randn(2, 3), pred_type="nn", link_approx="probit"),
     r"link_approx='probit' needs pred_type='glm'"),
    (lambda b: b.predict(torch.randn(2, 3), pred_type="linear"), r"pred_type='linear' is not known"),
    (lambda b: b.sample_logits(torch.randn(2, 3), 2, pred_type="laplace"), r"pred_type='laplace' is not known"),
    (lambda b: b.optimize_prior_precision("gridsearch"),
     r"method='gridsearch' is not known; accepted: \('marglik', 'val'\)"),
    (lambda b: b.optimize_prior_precision("val"), r"method='val' needs val_loader"),
    (lambda b: b.optimize_prior_precision("val", val_loader=[], grid=[1.0, 0.0]),
     r"grid\[1\]=0.0 must be a number in \[1e-36, 1e\+36\]"),
    (lambda b: b.optimize_prior_precision("val", val_loader=[], grid=[]), r"grid is empty"),
    (lambda b: b.optimize_prior_precision("val", val_loader=[], grid=[1.0]), r"val_loader yielded no batches"),
    (lambda b: b.optimize_prior_precision(val_loader=[(torch.randn(2, 3), torch.zeros(2, dtype=torch.long))]),
     r"val_loader and grid are used only by method='val'"),
    (lambda b: setattr(b, "prior_precision", -1), r"prior_precision=-1 must be a number in \[1e-36, 1e\+36\]"),
    (lambda b: b.log_marginal_likelihood(0.0), r"prior_precision=0.0 must be a number in \[1e-36, 1e\+36\]"),
    (lambda b: b.log_marginal_likelihood(torch.ones(17)),
     r"prior_precision has 17 values; accepted: one number, or one per Bayesian parameter tensor"),
    (lambda b: b.optimize_prior_precision("val", prior_structure="layerwise"),
     r"prior_structure='layerwise' is not accepted with method='val'"),
    (lambda b: b.optimize_prior_precision(prior_structure="diag"), r"prior_structure='diag' is not known"),
])
def test_bad_calls_name_the_value(call, match):
    bnn = _tiny()
    with pytest.raises(ValueError, match=match):
        call(bnn)
    assert bnn.prior_precision == 1.0  # a failed search leaves δ as it was


def test_evidence_and_tuning_need_the_curvature():
    bnn = _tiny(fit=False)
    for call in (bnn.log_marginal_likelihood, bnn.optimize_prior_precision, bnn.noise_to_signal,
                 lambda: bnn.functional_moments(torch.randn(2, 3))):
        with pytest.raises(bw.NotFittedError, match=r"call bnn.fit_curvature\(train_loader\) first"):
            call()


def test_marglik_at_the_prior_mean_runs_to_the_bound():
    bnn = _tiny(prior_mean="init")  # untrained: θ* = θ̄, so the evidence grows without bound in δ
    with pytest.warns(RuntimeWarning, match=r"maximal at the bound 1e\+10"):
        assert bnn.optimize_prior_precision() == 1e10
    assert bnn.prior_precision == 1e10
