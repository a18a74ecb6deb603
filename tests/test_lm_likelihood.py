"""Token likelihoods of language models (issue 35, deliverable 2): ``likelihood="causal_lm"`` /
``"token_categorical"`` against ``transformers``' own loss and naive loops, the (B, T, V) predictive and its
per-token calibration metrics, sequence classification from a causal LM's last token, and bad input."""

import math

import pytest
import torch

import bayeswrap as bw
from bayeswrap.core.likelihoods import make_likelihood
from bayeswrap.core.token_likelihoods import count_target_tokens
from bayeswrap.evaluation import calibration
from bayeswrap.evaluation.tokens import token_report, valid_tokens

transformers = pytest.importorskip("transformers")
V, T, B = 50, 10, 6


def _config(**extra):
    return transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **extra)


def _lm(seed=0):
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(_config()).eval()


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0  # right padding
    mask[3, 8:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :4] = -100  # an ignored prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def test_causal_lm_nll_equals_transformers_loss():
    model, batch = _lm(), _batch()
    with torch.no_grad():
        reference = model(**batch).loss
    bnn = bw.wrap(model, "map", num_data=100, prior_std=None, likelihood="causal_lm")
    out = bnn.loss(_inputs(batch), batch["labels"])
    assert out.nll.item() == pytest.approx(reference.item(), abs=1e-6)
    assert out.logits.shape == (B, T, V)


def test_token_categorical_nll_equals_transformers_token_classification_loss():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=5,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForTokenClassification(config).eval()
    batch = _batch()
    batch["labels"] = batch["labels"].remainder(5).masked_fill(batch["labels"] == -100, -100)
    with torch.no_grad():
        reference = model(**batch).loss
    bnn = bw.wrap(model, "map", num_data=100, prior_std=None, likelihood="token_categorical")
    assert bnn.loss(_inputs(batch), batch["labels"]).nll.item() == pytest.approx(reference.item(), abs=1e-6)


def test_token_nll_naive_loop_and_reduction_none():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, 2] = labels[2, 0] = labels[2, 4] = -100
    for name, shift in (("causal_lm", 1), ("token_categorical", 0)):
        lik = make_likelihood(name)
        per_seq = [0.0] * 3
        count = 0
        for b in range(3):
            for t in range(shift, 5):
                if labels[b, t] != -100:
                    per_seq[b] -= logits[b, t - shift].log_softmax(-1)[labels[b, t]].item()
                    count += 1
        assert lik.nll(logits, labels.int()).item() == pytest.approx(sum(per_seq) / count, rel=1e-12)
        assert lik.nll(logits, labels, reduction="none").tolist() == pytest.approx([v * 3 / count for v in per_seq],
                                                                                   rel=1e-12)
        loader = [{"labels": labels[:2]}, {"labels": labels[2:]}]
        assert count_target_tokens(loader, shift=bool(shift)) == count


@pytest.mark.parametrize("method", ["map", "vi"])
def test_fit_and_predict_on_token_batches(method):
    batch = _batch()
    data = [batch] * 8
    num_data = count_target_tokens(data)
    options = {"prior_std": None} if method == "map" else {}
    bnn = bw.wrap(_lm(), method, num_data=num_data, likelihood="causal_lm", **options)
    torch.manual_seed(0)
    before = bnn.loss(_inputs(batch), batch["labels"]).nll.item()
    bw.fit(bnn, data, epochs=2, optimizer=torch.optim.Adam(bnn.parameters(), 1e-2), progress=False)
    torch.manual_seed(0)
    after = bnn.loss(_inputs(batch), batch["labels"]).nll.item()
    assert after < before - 0.5  # 16 steps on one repeated batch memorise some of it (ln 50 = 3.91 at chance)
    gen = torch.Generator().manual_seed(3)
    probs = bnn.predict(_inputs(batch), num_samples=3, generator=gen)
    assert probs.shape == (B, T, V)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, T))
    logits = bnn.sample_logits(_inputs(batch), 3, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(probs, logits.softmax(-1).mean(0))
    report = token_report(probs, batch["labels"])
    rows, targets = valid_tokens(probs, batch["labels"])
    assert report["tokens"] == len(targets) == count_target_tokens([batch])
    assert report["nll"] == pytest.approx(-rows[torch.arange(len(targets)), targets].log().mean().item(), rel=1e-6)


def test_valid_tokens_against_naive_loop_and_torchmetrics():
    torchmetrics = pytest.importorskip("torchmetrics")
    g = torch.Generator().manual_seed(5)
    probs = torch.randn(4, 6, 9, generator=g, dtype=torch.float64).mul(2).softmax(-1)
    labels = torch.randint(0, 9, (4, 6), generator=g)
    labels[1, 3:] = -100
    labels[2, 1] = -100
    for shift in (1, 0):
        rows, targets = valid_tokens(probs, labels, shift=bool(shift))
        naive = [(probs[b, t - shift], labels[b, t]) for b in range(4) for t in range(shift, 6) if labels[b, t] != -100]
        torch.testing.assert_close(rows, torch.stack([p for p, _ in naive]))
        assert targets.tolist() == [int(y) for _, y in naive]
        report = token_report(probs, labels, shift=bool(shift), n_bins=10)
        ece = torchmetrics.functional.classification.multiclass_calibration_error(
            rows.float(), targets, num_classes=9, n_bins=10, norm="l1")
        assert report["ece"] == pytest.approx(ece.item(), abs=1e-6)
        brier = sum(((p - torch.nn.functional.one_hot(y, 9)) ** 2).sum().item() for p, y in naive) / len(naive)
        assert report["brier"] == pytest.approx(brier, rel=1e-9)
        assert report["nll"] == pytest.approx(calibration.nll(rows, targets), rel=1e-12)
        assert report["error"] == pytest.approx(sum(int(p.argmax() != y) for p, y in naive) / len(naive))


def test_sequence_classification_from_last_token():
    """GPT2ForSequenceClassification picks the last non-padding token itself (laplace-torch's pick_last): its
    (B, K) logits go through the categorical likelihood and predictive unchanged."""
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(_config(num_labels=3, pad_token_id=49)).eval()
    batch = _batch()
    ids = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 49)
    x = {"input_ids": ids, "attention_mask": batch["attention_mask"]}
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    with torch.no_grad():
        reference = model(**x, labels=y)
    # the pick-last reduction by hand: the hidden state at each sequence's last non-padding position
    hidden = model.transformer(**x).last_hidden_state
    last = batch["attention_mask"].sum(1) - 1
    torch.testing.assert_close(reference.logits, model.score(hidden[torch.arange(B), last]))
    bnn = bw.wrap(model, "map", num_data=6, prior_std=None)
    assert bnn.loss(x, y).nll.item() == pytest.approx(reference.loss.item(), abs=1e-6)
    torch.testing.assert_close(bnn.predict(x, num_samples=0), reference.logits.softmax(-1))


def test_bad_token_inputs_are_refused():
    bnn = bw.wrap(_lm(), "map", num_data=10, prior_std=None, likelihood="causal_lm")
    batch = _batch()
    x, labels = _inputs(batch), batch["labels"]
    with pytest.raises(ValueError, match=r"labels have shape \(6, 9\).*accepted: labels of shape \(6, 10\)"):
        bnn.loss(x, labels[:, :9])
    for bad in (50, -5):
        wrong = labels.clone()
        wrong[2, 3] = bad
        with pytest.raises(ValueError, match=rf"token label {bad} is out of range; accepted: token ids in \[0, 49\] "
                                             r"or -100"):
            bnn.loss(x, wrong)
    only_first = torch.full_like(labels, -100)
    only_first[:, 0] = 1  # the causal shift drops position 0: nothing left to score
    with pytest.raises(ValueError, match="every label of the batch after the causal shift.*is -100"):
        bnn.loss(x, only_first)
    with pytest.raises(ValueError, match="integer tensor, got dtype torch.float32"):
        bnn.loss(x, labels.float())
    sequence_level = make_likelihood("causal_lm")
    with pytest.raises(ValueError, match=r"\(B, T, V\).*shape \(6, 50\).*likelihood='categorical'"):
        sequence_level.check_outputs(torch.zeros(6, 50))
    with pytest.raises(ValueError, match="'causal_lm', 'token_categorical'"):
        make_likelihood("causal-lm")
    for method in ("laplace", "laplace_ll_kfac"):  # token curvature: the per-layer engine only
        with pytest.raises(ValueError, match="likelihood='causal_lm' with curvature_backend='vmap'.*accepted: "
                                             "curvature_backend='layers'"):
            bw.wrap(_lm(), method, num_data=10, likelihood="causal_lm", curvature_backend="vmap")
    with pytest.raises(ValueError, match="every label is -100"):
        valid_tokens(torch.full((2, 3, 4), 0.25), torch.full((2, 3), -100))
    with pytest.raises(ValueError, match="token label 4 is out of range"):
        valid_tokens(torch.full((2, 3, 4), 0.25), torch.full((2, 3), 4), shift=False)
    with pytest.raises(ValueError, match=r"labels must be integer token ids of shape \(2, 3\)"):
        valid_tokens(torch.full((2, 3, 4), 0.25), torch.zeros(2, 4, dtype=torch.long))
    assert math.isfinite(bnn.loss(x, labels).loss.item())


def test_loader_evaluation_over_target_tokens():
    """predict_loader / evaluate pool the target tokens of batches of different lengths, and fit validates on
    them."""
    from bayeswrap.predictive import evaluate, predict_loader

    first, second = _batch(1), _batch(2)
    second = {k: v[:4, :7] for k, v in second.items()}  # another batch size and length
    loader = [first, second]
    bnn = bw.wrap(_lm(), "vi", num_data=count_target_tokens(loader), likelihood="causal_lm")
    probs, targets = predict_loader(bnn, loader, num_samples=2, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(0)
    rows = [valid_tokens(bnn.predict(_inputs(b), num_samples=2, generator=gen), b["labels"]) for b in loader]
    torch.testing.assert_close(probs, torch.cat([r for r, _ in rows]))
    assert targets.tolist() == torch.cat([y for _, y in rows]).tolist()
    assert len(targets) == count_target_tokens(loader)
    scores = evaluate(bnn, loader, num_samples=2, generator=torch.Generator().manual_seed(0))
    naive_nll = -torch.cat([r[torch.arange(len(y)), y] for r, y in rows]).log().mean().item()
    assert scores["nll"] == pytest.approx(naive_nll, rel=1e-6)
    history = bw.fit(bnn, loader, epochs=1, optimizer=torch.optim.Adam(bnn.parameters(), 1e-3), val_loader=loader,
                     progress=False)
    assert math.isfinite(history[0]["val_nll"]) and 0 <= history[0]["val_error"] <= 1


def test_ensemble_token_loss_and_mixture():
    """The vmapped ensemble loss is the mean of its members' token-mean NLLs, and its predictive the mixture of
    their (B, T, V) probabilities."""
    batch = _batch()
    x, labels = _inputs(batch), batch["labels"]
    torch.manual_seed(0)
    bnn = bw.wrap(_lm(), "ensemble", num_data=100, likelihood="causal_lm", num_members=2)
    with torch.no_grad():
        members = [transformers.GPT2LMHeadModel(_config()).eval() for _ in bnn.members]
        for member, model in zip(bnn.members, members):
            model.load_state_dict({**model.state_dict(), **member.to_deterministic().state_dict()})
        hf = [model(**batch).loss.item() for model in members]
    assert bnn.loss(x, labels).nll.item() == pytest.approx(sum(hf) / 2, abs=1e-5)
    probs = bnn.predict(x, num_samples=0)
    with torch.no_grad():
        expected = sum(model(**x).logits.softmax(-1) for model in members) / 2
    torch.testing.assert_close(probs, expected)


def test_lightning_validation_scores_target_tokens():
    pl = pytest.importorskip("lightning.pytorch")
    from bayeswrap.lightning import BayesianModule
    from bayeswrap.predictive import evaluate

    loader = [_batch(1), {k: v[:4, :7] for k, v in _batch(2).items()}]
    bnn = bw.wrap(_lm(), "map", num_data=count_target_tokens(loader), prior_std=None, likelihood="causal_lm")
    module = BayesianModule(bnn, lambda params: torch.optim.SGD(params, lr=0.0))  # lr 0: the model stays put
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    batches = torch.utils.data.DataLoader(loader, batch_size=None)  # the ready-made batches, one per step
    trainer.fit(module, batches, batches)
    expected = evaluate(bnn, loader, num_samples=0)
    rows = [valid_tokens(bnn.predict(_inputs(b), 0), b["labels"]) for b in loader]
    probs, targets = torch.cat([r for r, _ in rows]), torch.cat([y for _, y in rows])
    logged = trainer.callback_metrics
    assert float(logged["val_nll"]) == pytest.approx(expected["nll"], rel=1e-5)
    assert float(logged["val_ece"]) == pytest.approx(calibration.ece(probs, targets), abs=1e-6)


def test_fit_train_nll_is_the_mean_per_target_token():
    """``train_nll`` of an epoch weighs each batch by its target tokens: with lr 0 it equals the loader's summed
    token NLL over its token count (a naive loop), not the mean of the batches' means."""
    full = _batch()
    short = {k: v[:2].clone() for k, v in _batch(seed=5).items()}
    short["labels"][:, :7] = -100  # 2 sequences with 2 target tokens each: batch means differ in weight
    data = [full, short]

    def sharp_lm():  # larger (tied) embeddings: confident logits, so the two batches' mean NLLs differ
        model = _lm()
        with torch.no_grad():
            model.transformer.wte.weight.mul_(40.0)
        return model

    bnn = bw.wrap(sharp_lm(), "map", num_data=count_target_tokens(data), likelihood="causal_lm", prior_std=None)
    history = bw.fit(bnn, data, epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.0), progress=False)
    model, total, count = sharp_lm(), 0.0, 0
    for batch in data:
        logits = model(**_inputs(batch)).logits
        target = batch["labels"][:, 1:]
        per = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), target, reduction="none")
        total += per[target != -100].sum().item()
        count += int((target != -100).sum())
    assert count == count_target_tokens(data)
    assert history[-1]["train_nll"] == pytest.approx(total / count, rel=1e-5)
    means = [bnn.loss(_inputs(b), b["labels"]).nll.item() for b in data]
    by_sequences = (len(full["labels"]) * means[0] + len(short["labels"]) * means[1]) / 8
    assert abs(by_sequences - total / count) > 0.01  # what weighing by sequences gave: the weightings differ here
