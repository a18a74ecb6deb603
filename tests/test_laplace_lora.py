"""Laplace-LoRA: KFAC Laplace over a peft model's adapters against laplace-torch's LoRA path (issue 35, item 3).

``bw.wrap(peft_model, "laplace", params="adapters", hessian_structure="kron")`` puts Kronecker factors on LoRA's
A and B ``Linear`` modules (Yang et al., ICLR 2024). laplace-torch's ``KronLaplace`` restricts its curvature to the
parameters that require grad, which on a peft model are the adapters and the ``modules_to_save`` head; freezing
the head gives it the adapters alone. Both are compared, in float64, on

* a tiny GPT-2 sequence classifier (LoRA on the fused ``c_attn`` ``Conv1D``, head in ``modules_to_save``) with
  Hugging Face dict batches (``input_ids``, a right-padding ``attention_mask``, ``labels``);
* a tiny causal LM read at the last non-padding token (``output_reduction="pick_last"``): classification over
  the next-token logits, the setting of Yang et al.;
* a tiny MLP with LoRA on both layers, classification and regression.

Compared to 1e-6 (relative): the posterior precision (G ⊗ A + δ I, as matrix-vector products against
laplace-torch's ``KronDecomposed``), the log marginal likelihood at several δ, the GLM predictive (probit
probabilities; regression: mean and variance), and the evidence-tuned δ of ``optimize_prior_precision("marglik")``
(a stationary point of laplace-torch's evidence). After ``bw.fit`` (MAP on the adapters, then the curvature in
``after_fit``) the same holds for laplace-torch fitted on the trained network. Token likelihoods: KFAC over a LoRA
MLP's adapters with ``"token_categorical"`` equals laplace-torch on the unrolled tokens, and a causal LM's dense
curvature, training log-likelihood and probit predictive equal per-sequence Jacobians summed by hand. A bf16 causal
LM keeps an fp32 posterior within bf16's precision of the float64 one.
"""

import warnings

import pytest
import torch
from torch import nn

import bayeswrap as bw

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
laplace = pytest.importorskip("laplace")
from laplace.curvature import CurvlinopsGGN  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

DT = torch.float64
VOCAB, LENGTH, CLASSES = 24, 6, 3
TOL = {"rtol": 1e-6, "atol": 1e-9}


def _perturbed(model, scale=0.3):
    """Moves the trainable tensors off their init (B = 0 would make A's curvature vanish)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _gpt2_config(**kw):
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=8, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                                   **kw)


def gpt2_classifier(freeze_head=False):
    torch.manual_seed(0)
    base = transformers.GPT2ForSequenceClassification(_gpt2_config(num_labels=CLASSES)).to(DT)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                      task_type="SEQ_CLS"))
    _perturbed(model)
    if freeze_head:  # laplace-torch's curvature then covers exactly the adapters
        for n, p in model.named_parameters():
            if ".modules_to_save." in n:
                p.requires_grad_(False)
    return model


def causal_lm():
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(_gpt2_config()).to(DT)
    return _perturbed(peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                                task_type="CAUSAL_LM")))


def lora_mlp(outputs=CLASSES):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, outputs)).to(DT)
    return _perturbed(peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"])))


def token_batches(labels=CLASSES):
    """Two dict batches of 8 with right padding (pad id 0 after the last token, mask 0 there)."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(1, VOCAB, (8, LENGTH), generator=g)
        mask = torch.ones(8, LENGTH, dtype=torch.long)
        for i in range(8):
            mask[i, LENGTH - i % 3:] = 0 if i % 3 else 1
        batches.append({"input_ids": ids * mask, "attention_mask": mask,
                        "labels": torch.randint(0, labels, (8,), generator=g)})
    return batches


def tensor_batches(regression=False):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g, dtype=DT)
    y = torch.randn(16, 1, generator=g, dtype=DT) if regression else torch.randint(0, CLASSES, (16,), generator=g)
    return [(x[:8], y[:8]), (x[8:], y[8:])]


class DictCall(nn.Module):
    """laplace-torch's calling convention for dict batches, ``model(batch)`` → (B, K) logits."""

    def __init__(self, model, last_token=False):
        super().__init__()
        self.model, self.last_token = model, last_token

    def forward(self, batch):
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if not self.last_token:
            return logits
        last = [max(t for t in range(LENGTH) if batch["attention_mask"][b, t]) for b in range(logits.shape[0])]
        return torch.stack([logits[b, t] for b, t in enumerate(last)])


def theirs(model, batches, likelihood="classification", prior_mean=0.0, noise=1.0):
    if isinstance(batches[0], dict):
        model = DictCall(model, last_token=model.__class__.__name__ == "PeftModelForCausalLM")
        data = [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["labels"]))]
    else:
        data = torch.utils.data.TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    la = laplace.Laplace(model, likelihood, subset_of_weights="all", hessian_structure="kron", prior_precision=1.0,
                         prior_mean=prior_mean, sigma_noise=noise, backend=CurvlinopsGGN)
    la.fit(torch.utils.data.DataLoader(data, batch_size=8))
    return la


def ours(model, batches, params="adapters", num_data=16, **kw):
    bnn = bw.wrap(model, "laplace", params=params, hessian_structure="kron", num_data=num_data, prior_std=1.0,
                  prior_mean="zero", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return bnn.fit_curvature(batches)


def inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"} if isinstance(batch, dict) else batch[0]


def assert_equal_posteriors(bnn, la, x, regression=False):
    """Predictive first (laplace-torch's log_marginal_likelihood(δ) sets its δ), precision, evidence, tuned δ."""
    assert la.n_params == sum(t.numel() for t in bnn.theta.values())
    if regression:
        mean, var = bnn.predict(x)
        f_mu, f_var = la(x, pred_type="glm")
        torch.testing.assert_close(mean, f_mu, **TOL)
        torch.testing.assert_close(var - bnn.noise_std**2, f_var[:, :, 0], **TOL)
    else:
        torch.testing.assert_close(bnn.predict(x), la(x, pred_type="glm", link_approx="probit"), **TOL)
    ours_p = bnn.posterior_precision()
    v = torch.randn(6, ours_p.shape[0], dtype=DT, generator=torch.Generator().manual_seed(0))
    their_pv = la.posterior_precision.bmm(v.unsqueeze(1), exponent=1).squeeze(1)
    torch.testing.assert_close(v @ ours_p.T, their_pv, rtol=1e-6, atol=1e-6 * float(their_pv.abs().max()))
    for delta in (1.0, 0.2, 7.0):
        torch.testing.assert_close(bnn.log_marginal_likelihood(delta),
                                   la.log_marginal_likelihood(torch.tensor(delta, dtype=DT)).reshape(()),
                                   rtol=1e-6, atol=0)
    bnn.optimize_prior_precision("marglik")  # the evidence-tuned δ: a stationary point of laplace-torch's evidence
    best = bnn.prior_precision
    assert isinstance(best, float) and best != 1.0
    lml = [float(la.log_marginal_likelihood(torch.tensor(best * f, dtype=DT))) for f in (1 - 1e-4, 1.0, 1 + 1e-4)]
    assert lml[1] >= max(lml[0], lml[2]) - 1e-9
    torch.testing.assert_close(torch.tensor(lml[1], dtype=DT), bnn.log_marginal_likelihood(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("params, freeze_head", [("adapters", True), (None, False)])
def test_gpt2_classifier_adapters_equal_laplace_torch_kron(params, freeze_head):
    """params='adapters': A and B of c_attn (head a point estimate); None: the modules_to_save head too."""
    batches = token_batches()
    bnn = ours(gpt2_classifier(), batches, params=params)
    expected = 2 if params == "adapters" else 4  # lora_A, lora_B (and the head's weight and bias, if any)
    assert len(bnn.bayesian_names) in (expected, expected - 1)
    assert sorted(w for w, _ in bnn._structure.layers.values()) == sorted(
        n for n in bnn.bayesian_names if n.endswith("weight"))
    assert not bnn._structure.diag_names  # every Bayesian tensor has Kronecker factors
    la = theirs(gpt2_classifier(freeze_head=freeze_head), batches)
    assert_equal_posteriors(bnn, la, inputs(batches[1]))


def test_causal_lm_last_token_laplace_lora_equals_laplace_torch():
    """Yang et al.'s setting: the next-token logits at the last prompt token as a (B, V) classifier."""
    batches = token_batches(labels=VOCAB)
    bnn = ours(causal_lm(), batches, output_reduction="pick_last")
    assert [n.split(".")[-3] for n in bnn.bayesian_names] == ["lora_A", "lora_B"]
    la = theirs(causal_lm(), batches)
    assert_equal_posteriors(bnn, la, inputs(batches[0]))


@pytest.mark.parametrize("regression", [False, True])
def test_lora_mlp_equals_laplace_torch(regression):
    batches = tensor_batches(regression)
    kw = {"likelihood": "gaussian", "noise_std": 0.7} if regression else {}
    bnn = ours(lora_mlp(1 if regression else CLASSES), batches, **kw)
    assert len(bnn._structure.layers) == 4  # A and B of both layers
    la = theirs(lora_mlp(1 if regression else CLASSES), batches, "regression" if regression else "classification",
                noise=0.7 if regression else 1.0)
    assert_equal_posteriors(bnn, la, batches[1][0], regression)


def test_after_bw_fit_the_posterior_equals_laplace_torch_on_the_trained_adapters():
    """MAP on the adapters by bw.fit, the curvature in after_fit; laplace-torch on the trained network with the
    same prior mean (the adapters' init: B = 0, A its random init)."""
    batches = token_batches()
    model = gpt2_classifier()
    init = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    bnn = bw.wrap(model, "laplace", params="adapters", hessian_structure="kron", num_data=16, prior_std=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bw.fit(bnn, batches, epochs=3, optimizer=torch.optim.Adam(bnn.parameters(), lr=0.05), progress=False)
    assert bnn.is_ready()
    trained = bnn.to_deterministic()
    moved = [n for n in bnn.bayesian_names if not torch.equal(trained.get_parameter(n), init[n])]
    assert moved == bnn.bayesian_names
    for n, p in trained.named_parameters():
        p.requires_grad_(n in bnn.bayesian_names)
    prior_mean = torch.cat([init[n].flatten() for n in bnn.bayesian_names])
    la = theirs(trained, batches, prior_mean=prior_mean)
    assert_equal_posteriors(bnn, la, inputs(batches[0]))


# --------------------------------------------------------------------------------------------------
# token likelihoods: the GGN of a sequence is the sum over its target tokens
# --------------------------------------------------------------------------------------------------
def test_token_categorical_laplace_lora_equals_laplace_torch_on_the_unrolled_tokens():
    """A per-token LoRA MLP on (B, T, 4) inputs, every position a target: the token likelihood's sequences are
    the categorical likelihood's B·T examples, so the KFAC ("expand": A averaged over the positions) posterior
    equals laplace-torch's over the unrolled (B·T, 4) data, num_data counted in tokens."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, 4, generator=g, dtype=DT), torch.randint(0, CLASSES, (16, 5), generator=g)
    tokens = [(x[:8], y[:8]), (x[8:], y[8:])]
    bnn = ours(lora_mlp(), tokens, likelihood="token_categorical", num_data=80)
    la = theirs(lora_mlp(), [(a.reshape(-1, 4), b.reshape(-1)) for a, b in tokens])
    torch.testing.assert_close(bnn.predict(x[:4]), la(x[:4].reshape(-1, 4), pred_type="glm").reshape(4, 5, CLASSES),
                               **TOL)
    v = torch.randn(6, la.n_params, dtype=DT, generator=torch.Generator().manual_seed(0))
    their_pv = la.posterior_precision.bmm(v.unsqueeze(1), exponent=1).squeeze(1)
    torch.testing.assert_close(v @ bnn.posterior_precision().T, their_pv, rtol=1e-6,
                               atol=1e-6 * float(their_pv.abs().max()))
    for delta in (1.0, 0.2):
        torch.testing.assert_close(bnn.log_marginal_likelihood(delta),
                                   la.log_marginal_likelihood(torch.tensor(delta, dtype=DT)).reshape(()),
                                   rtol=1e-6, atol=0)


def test_causal_lm_token_laplace_is_the_ggn_summed_over_target_tokens():
    """causal_lm with the shift and -100 labels (a prompt and padding), dense over the adapters: H, the training
    log-likelihood and the probit predictive against per-sequence Jacobians (torch.func) summed by hand."""
    from bayeswrap.core.token_likelihoods import count_target_tokens

    batches = token_batches()
    for b in batches:
        b["labels"] = torch.where(b["attention_mask"].bool(), b["input_ids"], -100)
        b["labels"][:, :2] = -100  # the prompt
    n_tokens = count_target_tokens(batches)
    num_data = 3 * n_tokens  # a training set three times the batches seen: every term scaled by N/n
    model = causal_lm()
    bnn = ours(model, batches, likelihood="causal_lm", num_data=num_data)
    bnn_full = bw.wrap(model, "laplace", params="adapters", hessian_structure="full", num_data=num_data,
                       prior_std=1.0, prior_mean="zero", likelihood="causal_lm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        bnn_full.fit_curvature(batches)
    names = bnn.bayesian_names
    params = {n: p.detach() for n, p in model.named_parameters()}

    def logits(th, ids, mask):
        return torch.func.functional_call(model, {**params, **th}, (), {"input_ids": ids[None],
                                                                         "attention_mask": mask[None]}).logits[0]

    theta = {n: params[n] for n in names}
    h = torch.zeros(bnn_full.posterior_precision().shape, dtype=DT)
    log_lik = 0.0
    for b in batches:
        # transformers' ForCausalLMLoss (the mean over target tokens, computed in float32) × the count
        log_lik -= float(model(**b).loss) * int((b["labels"][:, 1:] != -100).sum())
        for ids, mask, labels in zip(b["input_ids"], b["attention_mask"], b["labels"]):
            jac = torch.func.jacrev(logits)(theta, ids, mask)
            j = torch.cat([jac[n].reshape(LENGTH, VOCAB, -1) for n in names], -1)  # (T, V, P)
            p = logits(theta, ids, mask).softmax(-1)
            for t in range(LENGTH - 1):
                if labels[t + 1] != -100:
                    lam = torch.diag(p[t]) - torch.outer(p[t], p[t])
                    h += j[t].T @ lam @ j[t]
    scale = num_data / n_tokens
    torch.testing.assert_close(bnn_full.posterior_precision(), scale * h + torch.eye(len(h), dtype=DT), rtol=1e-8,
                               atol=1e-10 * float(h.abs().max()))
    torch.testing.assert_close(float(bnn_full.train_log_likelihood), scale * log_lik, rtol=1e-6, atol=0)
    torch.testing.assert_close(bnn.train_log_likelihood, bnn_full.train_log_likelihood, rtol=1e-12, atol=0)
    # the probit GLM predictive of the Kron posterior: softmax(f / sqrt(1 + π/8 diag(J P⁻¹ Jᵀ))) per position
    x = inputs(batches[0])
    ids, mask = x["input_ids"][:3], x["attention_mask"][:3]
    bnn.prior_precision = 1e-3  # a weak prior: variances large enough to move the probabilities
    p_inv = torch.linalg.inv(bnn.posterior_precision())
    expected = []
    for i in range(3):
        jac = torch.func.jacrev(logits)(theta, ids[i], mask[i])
        j = torch.cat([jac[n].reshape(LENGTH, VOCAB, -1) for n in names], -1)
        var = torch.einsum("tvp,pq,tvq->tv", j, p_inv, j)
        expected.append((logits(theta, ids[i], mask[i]) / torch.sqrt(1 + torch.pi / 8 * var)).softmax(-1))
    probs = bnn.predict({"input_ids": ids, "attention_mask": mask})
    assert probs.shape == (3, LENGTH, VOCAB)
    torch.testing.assert_close(probs, torch.stack(expected), rtol=1e-8, atol=1e-12)
    assert float((probs - bnn.predict({"input_ids": ids, "attention_mask": mask}, 0)).abs().max()) > 5e-4


def test_a_bf16_causal_lm_keeps_an_fp32_posterior_close_to_the_float64_one():
    """bf16 base and adapters (peft's autocast_adapter_dtype=False), read at the last token: the adapters' θ* and
    the Kronecker factors are fp32; precision, evidence and predictive agree with the float64 network of the same
    (bf16-rounded) weights to bf16's precision (its activations are bf16)."""
    batches = token_batches(labels=VOCAB)
    wide = causal_lm()
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(_gpt2_config()).to(torch.bfloat16)
    narrow = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                       task_type="CAUSAL_LM"), autocast_adapter_dtype=False)
    narrow.load_state_dict({n: t.to(torch.bfloat16) for n, t in wide.state_dict().items()})
    wide.load_state_dict({n: t.to(DT) for n, t in narrow.state_dict().items()})  # the same rounded weights
    assert {p.dtype for p in narrow.parameters()} == {torch.bfloat16}
    bnn16 = ours(narrow, batches, output_reduction="pick_last")
    bnn64 = ours(wide, batches, output_reduction="pick_last")
    kron = bnn16._structure
    assert {t.dtype for t in [*bnn16.theta.values(), *kron.A.values(), *kron.G.values()]} == {torch.float32}
    assert {p.dtype for p in narrow.parameters()} == {torch.bfloat16}  # the wrapped model is untouched
    # measured: precision 1e-4 (relative to its largest entry), evidence 3e-5, functional variances 3e-2
    p16, p64 = bnn16.posterior_precision().double(), bnn64.posterior_precision()
    torch.testing.assert_close(p16, p64, rtol=0, atol=1e-3 * float(p64.abs().max()))
    torch.testing.assert_close(bnn16.log_marginal_likelihood(0.5).double(), bnn64.log_marginal_likelihood(0.5),
                               rtol=1e-3, atol=0)
    x = inputs(batches[0])
    torch.testing.assert_close(bnn16.functional_moments(x)[1].double(), bnn64.functional_moments(x)[1], rtol=0.1,
                               atol=0)
    torch.testing.assert_close(bnn16.predict(x).double(), bnn64.predict(x), rtol=0, atol=1e-3)
