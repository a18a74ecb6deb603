"""Full-network Laplace on a recurrent classifier (embedding -> nn.LSTM -> Linear on the last hidden state).

``predict`` runs under ``torch.no_grad``, where PyTorch's CPU (oneDNN) LSTM keeps no backward workspace, and the
oneDNN/cuDNN LSTM kernels have no forward-mode derivative (cuDNN's no backward in eval mode either): the GLM
predictive's Jacobians failed ("workspace"). Laplace now differentiates recurrent networks on PyTorch's own kernels
(:mod:`bayeswrap.methods.laplace.kernels`), which are restored afterwards.
Known answers, float32 as the kernels run: the probit predictive equals softmax(f / sqrt(1 + π/8 · diag(J Σ Jᵀ)))
with J from ``torch.autograd.functional.jacobian`` (plain reverse mode, grad on, one example at a time) and Σ the
inverse of ``posterior_precision()``; the linearised samples (``link_approx="mc"``) equal f + J (θ_s − θ*) for the
draws θ_s that ``bnn.sample`` makes from the same generator state.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import bayeswrap as bw

pytestmark = pytest.mark.usefixtures("one_thread")

N, T, V = 48, 5, 11


class _Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 4)
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.fc = nn.Linear(5, 3)

    def forward(self, tokens):
        _, (h, _) = self.lstm(self.emb(tokens))
        return self.fc(h[-1])


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (N, T), generator=g)
    y = (x[:, -1] % 3).long()
    return x, y


def _fitted(data, structure):
    x, y = data
    torch.manual_seed(1)
    bnn = bw.wrap(_Tagger(), "laplace", num_data=N, params=None, hessian_structure=structure, prior_std=1.0)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    bw.fit(bnn, loader, epochs=2, optimizer=torch.optim.Adam(bnn.param_groups(), lr=0.02), progress=False)
    return bnn


def _jacobian(bnn, x):
    """f (B, K) and J (B, K, P) over the flattened Bayesian parameters, in parameter order."""
    theta = {n: t.detach() for n, t in bnn.theta.items()}
    names, shapes = list(theta), [t.shape for t in theta.values()]
    flat = torch.cat([t.flatten() for t in theta.values()])

    def f(v, x1):
        parts = dict(zip(names, (p.reshape(s) for p, s in zip(v.split([s.numel() for s in shapes]), shapes))))
        return bnn.forward_with(parts, x1.unsqueeze(0))[0]

    with torch.enable_grad():
        jac = torch.stack([torch.autograd.functional.jacobian(lambda v, x1=x1: f(v, x1), flat) for x1 in x])
    return bnn.forward_with(theta, x).detach(), jac, names


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_lstm_probit_predictive_equals_the_jacobian_reference(data, structure):
    bnn = _fitted(data, structure)
    x = data[0][:6]
    f, jac, _ = _jacobian(bnn, x)
    cov = torch.linalg.inv(bnn.posterior_precision()).float()
    var = torch.einsum("bkp,pq,bkq->bk", jac, cov, jac)
    expected = (f / torch.sqrt(1 + math.pi / 8 * var)).softmax(-1)
    torch.testing.assert_close(bnn.predict(x, num_samples=8), expected, atol=2e-5, rtol=1e-4)
    assert var.min() > 1e-4  # the LSTM's parameters contribute: not the MAP's softmax
    torch.testing.assert_close(bnn.predict(x, num_samples=0), f.softmax(-1))


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
@pytest.mark.filterwarnings("ignore:hessian_structure=.kron. covers")
def test_lstm_linearised_samples_equal_f_plus_j_delta(data, structure):
    bnn = _fitted(data, structure)
    x = data[0][:4]
    f, jac, names = _jacobian(bnn, x)
    draws = bnn.sample(3, generator=torch.Generator().manual_seed(5))
    delta = torch.cat([(draws[n] - bnn.theta[n].detach()).flatten(1) for n in names], 1)  # (S, P)
    expected = f + torch.einsum("bkp,sp->sbk", jac, delta)
    outs = bnn.sample_logits(x, 3, generator=torch.Generator().manual_seed(5), link_approx="mc")
    torch.testing.assert_close(outs, expected, atol=2e-5, rtol=1e-4)
    probs = bnn.predict(x, num_samples=3, generator=torch.Generator().manual_seed(5), link_approx="mc")
    torch.testing.assert_close(probs, expected.softmax(-1).mean(0), atol=1e-5, rtol=1e-4)
    assert torch.backends.mkldnn.enabled and torch.backends.cudnn.enabled  # switched back on
