"""``output_reduction="pick_last"``: a per-token (B, T, K) model as a sequence classifier (issue 35, deliverable 2).

The oracle is the same network pooled by hand: the head applied to the body's features at each row's last
non-padding token, found by a Python loop over the mask (right and left padding in the same data). The per-token
model with ``output_reduction="pick_last"`` must give that model's losses, training trajectory, predictions and
scores under ``bw.fit``/``bw.predict``/``bw.evaluate`` (map, vi, swag), and, for last-layer Laplace, laplace-torch's
result on the pooled network (KFAC: Kronecker factors, evidence and GLM predictive) and laplace-torch's own
``feature_reduction="pick_last"`` (dense last layer, left padding: its position T − 1 is the last real token).
"""

import warnings

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.reductions import reduce_output, token_index

transformers = pytest.importorskip("transformers")

V, T, K, N, D = 30, 5, 3, 16, 8
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
DT = torch.float64


class TokenClassifier(nn.Module):
    """A tiny GPT-2 body and a Linear head applied at every position: (B, T, K) logits."""

    def __init__(self, pooled=False):
        super().__init__()
        cfg = transformers.GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=2, n_positions=8, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.body = transformers.GPT2Model(cfg)
        self.score = nn.Linear(D, K)
        self.pooled = pooled

    def forward(self, input_ids, attention_mask=None):
        h = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.pooled:  # the oracle: features at the last mask-1 position, found by a loop
            rows = [max(t for t in range(T) if attention_mask[b, t]) for b in range(h.shape[0])]
            h = torch.stack([h[b, t] for b, t in enumerate(rows)])
        return self.score(h)


class Batched(nn.Module):
    """laplace-torch's calling convention: ``model(batch_dict)``."""

    def __init__(self, net, last=False):
        super().__init__()
        self.net, self.last = net, last

    def forward(self, d):
        out = self.net(d["input_ids"], d["attention_mask"])
        return out[:, -1] if self.last else out


def make_nets():
    torch.manual_seed(0)
    token = TokenClassifier().to(DT)
    pooled = TokenClassifier(pooled=True).to(DT)
    pooled.load_state_dict(token.state_dict())
    return token, pooled


def make_batches(left_only=False):
    g = torch.Generator().manual_seed(1)
    batches = []
    for start in (0, 8):
        mask = torch.ones(8, T, dtype=torch.long)
        for i in range(8):
            pad = (start + i) % 3
            if pad and (left_only or start == 0):
                mask[i, :pad] = 0  # left padding
            elif pad:
                mask[i, T - pad:] = 0  # right padding
        batches.append({"input_ids": torch.randint(0, V, (8, T), generator=g), "attention_mask": mask,
                        "labels": torch.randint(0, K, (8,), generator=g)})
    return batches


def inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def test_token_index_reads_the_last_and_first_non_padding_token():
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    x = {"input_ids": torch.zeros(4, 5, dtype=torch.long), "attention_mask": mask}
    assert token_index(x, (4, 5), "pick_last").tolist() == [2, 4, 2, 4]
    assert token_index(x, (4, 5), "pick_first").tolist() == [0, 2, 1, 0]
    assert token_index(torch.zeros(4, 5), (4, 5), "pick_last").tolist() == [4] * 4  # no mask: the last position
    out = torch.arange(4 * 5 * 2.0).reshape(4, 5, 2)
    torch.testing.assert_close(reduce_output(out, x, "pick_last"), out[torch.arange(4), torch.tensor([2, 4, 2, 4])])
    # under vmap over examples (the per-example curvature backends) the index is the same
    per_example = torch.func.vmap(lambda o, m: reduce_output(o[None], {"attention_mask": m[None]}, "pick_last"))(
        out, mask)
    torch.testing.assert_close(per_example[:, 0], reduce_output(out, x, "pick_last"))


@pytest.mark.parametrize("method", ["map", "vi", "swag"])
def test_fit_predict_evaluate_equal_the_pooled_network(method, tmp_path):
    token, pooled = make_nets()
    batches = make_batches()
    models = []
    for net, reduction in ((token, "pick_last"), (pooled, None)):
        torch.manual_seed(5)
        options = {"output_reduction": reduction} if reduction else {}
        if method == "swag":
            options.update(swa_start=1)
        bnn = bw.wrap(net, method, num_data=N, prior_std=1.0, **options)
        torch.manual_seed(6)
        bw.fit(bnn, batches, epochs=2, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1), progress=False)
        models.append(bnn)
    ours, ref = models
    state = ours.state_dict()
    for n, t in ref.state_dict().items():
        if torch.is_tensor(t):
            torch.testing.assert_close(state[n], t, rtol=1e-10, atol=1e-12, msg=n)
    x = inputs(batches[1])
    for s in (0, 3):
        torch.testing.assert_close(ours.predict(x, s, generator=torch.Generator().manual_seed(2)),
                                   ref.predict(x, s, generator=torch.Generator().manual_seed(2)), rtol=1e-10,
                                   atol=1e-12)
    if method == "map":  # bw.save stores the option: the loaded model reads the same token
        bw.save(ours, tmp_path / "m.pt")
        loaded = bw.load(tmp_path / "m.pt", TokenClassifier().to(DT))
        assert loaded.output_reduction == "pick_last"
        torch.testing.assert_close(loaded.predict(x, 0), ref.predict(x, 0), rtol=1e-10, atol=1e-12)
    scores = [bw.evaluate(m, batches, num_samples=2, generator=torch.Generator().manual_seed(3)) for m in models]
    assert scores[0].keys() == scores[1].keys() and scores[0]["nll"] > 0
    for k, v in scores[1].items():
        assert scores[0][k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def _laplace_torch(net, structure, feature_reduction=None, last=False):
    laplace = pytest.importorskip("laplace")
    from laplace.curvature import CurvlinopsGGN

    batches = make_batches(left_only=feature_reduction is not None)
    data = [{k: v[i] for k, v in b.items()} for b in batches for i in range(8)]
    la = laplace.Laplace(Batched(net, last), "classification", subset_of_weights="last_layer",
                         hessian_structure=structure, feature_reduction=feature_reduction,
                         last_layer_name="net.score", backend=CurvlinopsGGN)
    la.fit(torch.utils.data.DataLoader(data, batch_size=8))
    return la, batches


def _ours(token, batches, structure):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn = bw.wrap(token, "laplace", subset_of_weights="last_layer", hessian_structure=structure, num_data=N,
                      prior_mean="zero", output_reduction="pick_last")
        return bnn.fit_curvature(batches)


@pytest.mark.parametrize("structure", ["kron", "full"])
def test_last_layer_laplace_equals_laplace_torch_on_the_pooled_network(structure):
    token, pooled = make_nets()
    la, batches = _laplace_torch(pooled, structure)  # right and left padding: pooled by the mask
    bnn = _ours(token, batches, structure)
    x = inputs(batches[0])
    torch.testing.assert_close(bnn.predict(x), la(x, pred_type="glm", link_approx="probit"), rtol=1e-6, atol=1e-9)
    ours = bnn.posterior_precision()
    assert ours.shape == (D * K + K, D * K + K) and la.n_params == D * K + K
    v = torch.randn(5, ours.shape[0], dtype=DT, generator=torch.Generator().manual_seed(0))
    prec = la.posterior_precision
    theirs = v @ prec.T if torch.is_tensor(prec) else prec.bmm(v.unsqueeze(1), exponent=1).squeeze(1)
    torch.testing.assert_close(v @ ours.T, theirs, rtol=1e-6, atol=1e-6 * float(theirs.abs().max()))
    for delta in (1.0, 0.3):  # (laplace-torch's log_marginal_likelihood(δ) sets its δ: after the predictive)
        torch.testing.assert_close(bnn.log_marginal_likelihood(delta),
                                   la.log_marginal_likelihood(torch.tensor(delta, dtype=DT)).reshape(()),
                                   rtol=1e-6, atol=0)


def test_dense_last_layer_laplace_equals_laplace_torch_feature_reduction_pick_last():
    """laplace-torch's own pick_last reads position T − 1: the last real token with left padding."""
    token, _ = make_nets()
    la, batches = _laplace_torch(token, "full", feature_reduction="pick_last", last=True)
    bnn = _ours(token, batches, "full")
    x = inputs(batches[1])
    torch.testing.assert_close(bnn.predict(x), la(x, pred_type="glm", link_approx="probit"), rtol=1e-6, atol=1e-9)
    for delta in (1.0, 0.3):
        torch.testing.assert_close(bnn.log_marginal_likelihood(delta),
                                   la.log_marginal_likelihood(torch.tensor(delta, dtype=DT)).reshape(()),
                                   rtol=1e-6, atol=0)


def test_kron_last_layer_glm_variance_is_j_p_inverse_jt():
    """diag(J P⁻¹ Jᵀ) with J of the per-token model (torch.func, through the reduction) and P as a dense matrix."""
    token, _ = make_nets()
    batches = make_batches()
    bnn = _ours(token, batches, "kron")
    x = inputs(batches[1])
    theta = {n: t.detach() for n, t in bnn.theta.items()}
    jac = torch.func.jacrev(lambda th: bnn.forward_with(th, x))(theta)
    j = torch.cat([jac[n].reshape(8, K, -1) for n in theta], -1)
    expected = torch.einsum("bkp,pq,bkq->bk", j, torch.linalg.inv(bnn.posterior_precision()), j)
    _, var = bnn.functional_moments(x)
    torch.testing.assert_close(var, expected, rtol=1e-8, atol=1e-12)


def test_bad_inputs_are_refused_by_name():
    token, pooled = make_nets()
    x = inputs(make_batches()[0])
    with pytest.raises(ValueError, match=r"output_reduction='mean' is not known; accepted: None .*'pick_last'"):
        bw.wrap(token, "map", num_data=N, output_reduction="mean")
    flat = bw.wrap(pooled, "map", num_data=N, output_reduction="pick_last")  # (B, K) outputs: no token dim
    with pytest.raises(ValueError, match=r"outputs have shape \(8, 3\); accepted: a model whose outputs have a "
                                         r"token dim"):
        flat.predict(x)
    bnn = bw.wrap(token, "map", num_data=N, output_reduction="pick_last")
    padded = {**x, "attention_mask": x["attention_mask"].clone()}
    padded["attention_mask"][[2, 5]] = 0
    with pytest.raises(ValueError, match=r"rows \[2, 5\] of the inputs' 'attention_mask' are all padding"):
        bnn.predict(padded)
    with pytest.raises(ValueError, match=r"'attention_mask' has shape \(8, 4\) but the model's outputs are "
                                         r"\(B, T, \.\.\.\) = \(8, 5, \.\.\.\)"):
        bnn.forward_with(bnn.theta.as_dict(), {"input_ids": x["input_ids"], "attention_mask":
                                               x["attention_mask"][:, :4]})
