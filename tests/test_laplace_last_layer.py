"""``laplace_ll_kfac``: laplace-torch's recommended setting, against laplace-torch itself.

``laplace.Laplace(model, "classification")`` (its defaults: last layer, KFAC, the exact GGN of its
``CurvlinopsGGN`` backend, prior mean 0), ``optimize_prior_precision(method="marglik")`` and the probit GLM
predictive, on the same MAP weights of a small float64 MLP trained on sklearn's digits, against
``bw.wrap(model, "laplace_ll_kfac", prior_mean="zero")`` after ``bw.fit`` (whose ``after_fit`` fits the curvature
and sets the marginal likelihood's δ). laplace-torch maximises the evidence by Adam steps on log δ; ours by Newton
steps to machine precision, so δ is compared through the derivative of laplace-torch's own evidence at our δ
(zero at its maximum) and against its Adam result run to convergence.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bayeswrap as bw
from bayeswrap.methods.laplace.last_layer import LastLayerLaplace

pytestmark = pytest.mark.usefixtures("one_thread")

DT = torch.float64
N = 300


@pytest.fixture(scope="module")
def fitted():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=DT) / 16.0, torch.tensor(y)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(DT)
    bnn = bw.wrap(net, "laplace_ll_kfac", num_data=N, prior_std=1.0, prior_mean="zero")
    batches = [(x[i:i + 100], y[i:i + 100]) for i in range(0, N, 100)]
    bw.fit(bnn, batches * 10, epochs=10, optimizer=torch.optim.Adam(bnn.parameters(), lr=1e-2), progress=False)
    return bnn, x, y


def _theirs(bnn, x, y):
    laplace = pytest.importorskip("laplace")
    from laplace.curvature import CurvlinopsGGN

    net = bnn.to_deterministic()  # the network at θ*, body and head
    la = laplace.Laplace(net, "classification", backend=CurvlinopsGGN)
    la.fit(DataLoader(TensorDataset(x[:N], y[:N]), batch_size=100))
    return la


def test_defaults_are_last_layer_kron_probit_and_delta_is_the_marginal_likelihoods(fitted):
    bnn, _, _ = fitted
    assert isinstance(bnn, LastLayerLaplace) and bnn.method == "laplace_ll_kfac"
    assert (bnn.subset_of_weights, bnn.hessian_structure, bnn.link_approx, bnn.pred_type) == (
        "last_layer", "kron", "probit", "glm")
    assert list(bnn.theta.keys()) == ["2.weight", "2.bias"]
    delta = bnn.prior_precision
    assert delta != 1.0  # moved from the training prior's 1/σ²
    values = [float(bnn.log_marginal_likelihood(delta * f)) for f in (0.99, 1.0, 1.01)]
    assert values[1] > values[0] and values[1] > values[2]


def test_prior_precision_and_predictive_equal_laplace_torchs(fitted):
    bnn, x, y = fitted
    la = _theirs(bnn, x, y)
    delta = bnn.prior_precision
    # their evidence is stationary at our δ (d/d log δ, by autograd on their log_marginal_likelihood)
    log_delta = torch.tensor(delta, dtype=DT).log().requires_grad_(True)
    (slope,) = torch.autograd.grad(la.log_marginal_likelihood(log_delta.exp()), log_delta)
    assert abs(float(slope)) < 1e-9 * la.n_params  # measured: 1.4e-13
    torch.testing.assert_close(bnn.log_marginal_likelihood(),
                               la.log_marginal_likelihood(torch.tensor(delta, dtype=DT)).reshape(()),
                               rtol=1e-10, atol=0)
    # their own search (Adam on log δ) run to convergence lands on the same δ
    la.optimize_prior_precision(method="marglik", pred_type="glm", n_steps=1000, lr=0.1)
    assert float(la.prior_precision) == pytest.approx(delta, rel=1e-8)  # measured: 6e-15
    # the probit predictive at the same δ
    la.prior_precision = torch.tensor(delta, dtype=DT)
    xt = x[1500:1600]
    torch.testing.assert_close(bnn.predict(xt), la(xt, pred_type="glm", link_approx="probit"), rtol=1e-9,
                               atol=1e-12)
