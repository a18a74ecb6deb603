"""bayeswrap.hf's BayesianTrainer (issue 35, item 4): a ``transformers.Trainer`` that trains a wrapped model as
``bw.fit`` does.

Oracles: ``bw.fit`` itself on the same batches in the same order (sequential sampling, the same seed, optimizer
and learning rate, the Trainer's scheduler constant), for map, vi, ivon, sgld, swag, laplace (after_fit) and a
deep ensemble over the LoRA adapters of a tiny BERT classifier built from a config, and for a tiny GPT-2 causal
LM with ``likelihood="causal_lm"``; the plain ``transformers.Trainer`` on the peft model itself (MAP without a
prior is its loss); :func:`bayeswrap.evaluation.tokens.token_report` and :mod:`bayeswrap.evaluation.calibration`
for ``evaluate``; an uninterrupted run for a resumed one.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import bayeswrap as bw
from bayeswrap.evaluation import calibration
from bayeswrap.evaluation.tokens import token_report

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")
hf = pytest.importorskip("bayeswrap.hf")
transformers.logging.set_verbosity_error()

V = 15  # vocabulary: 0 pad, 2 [CLS], 3 [SEP], 5..14 words
N = 24  # training sequences


def _bert(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.2)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], task_type="SEQ_CLS")
    return peft.get_peft_model(transformers.BertForSequenceClassification(cfg), lora)


def _gpt2(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True, task_type="CAUSAL_LM")
    return peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), lora)


def _rows(n: int = N, seed: int = 0, lm: bool = False) -> list[dict]:
    """Variable-length sentences; a string column ("text") that the Trainer must drop, as no forward names it."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(3, 8, (1,), generator=g))
        ids = [2] + torch.randint(5, V, (length,), generator=g).tolist() + [3]
        row = {"input_ids": ids, "attention_mask": [1] * len(ids), "text": f"sentence {i}"}
        if lm:
            row["labels"] = list(ids)
        else:
            row.update(token_type_ids=[0] * len(ids), labels=i % 2)
        rows.append(row)
    return rows


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pads every list column (labels of a causal LM with -100), and fails on a string column."""
    longest = max(len(r["input_ids"]) for r in rows)
    batch = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        if isinstance(values[0], list):
            pad = -100 if key == "labels" else 0
            values = [v + [pad] * (longest - len(v)) for v in values]
        batch[key] = torch.tensor(values)  # a str column raises here: it must have been dropped
    return batch


def _inputs(rows) -> dict[str, torch.Tensor]:
    """The model inputs of a batch of rows."""
    return {k: v for k, v in collate(_without_text(rows)).items() if k != "labels"}


def _without_text(rows) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "text"} for r in rows]


def _loader(rows, batch_size: int = 8):
    return torch.utils.data.DataLoader(rows, batch_size=batch_size, collate_fn=collate)


def _args(tmp_path, **overrides):
    options = dict(num_train_epochs=3, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                   learning_rate=1e-2, lr_scheduler_type="constant", train_sampling_strategy="sequential", seed=5,
                   report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, weight_decay=0.0,
                   max_grad_norm=1.0, disable_tqdm=True, dataloader_pin_memory=False)
    return transformers.TrainingArguments(str(tmp_path), **{**options, **overrides})


def _optimizer(bnn, lr):
    own = bnn.required_optimizer
    if own is bw.optim.SGLD:
        return own(bnn.param_groups(), lr=lr, num_data=bnn.num_data)
    if own is not None:
        return own(bnn.param_groups(), lr=lr)
    return torch.optim.AdamW(bnn.param_groups(), lr=lr, weight_decay=0.0)


def _assert_same_model(a, b, x, atol=1e-6):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=0, atol=atol, msg=name)
    for key, value in a.posterior_std().items():  # variances: an ensemble's std is sqrt of a difference
        torch.testing.assert_close(value.pow(2), b.posterior_std()[key].pow(2), rtol=0, atol=atol, msg=key)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    torch.testing.assert_close(a.predict(x, num_samples=4, generator=g1), b.predict(x, num_samples=4, generator=g2),
                               rtol=0, atol=atol)


METHODS = {"map": ({}, 1e-2), "vi": ({}, 1e-2), "ivon": ({}, 1e-2), "sgld": ({"burn_in": 2, "thinning": 2}, 1e-4),
           "swag": ({}, 1e-2), "laplace": ({}, 1e-2), "ensemble": ({"num_members": 2}, 1e-2)}


@pytest.mark.parametrize("method", list(METHODS))
def test_trainer_equals_fit_on_lora_adapters(method, tmp_path):
    """Same seed, batches, optimizer and lr: the Trainer's posterior and predictions are bw.fit's (1e-6), with an
    evaluation after each epoch (sampled, or at the current iterate before Laplace's and SGLD's posterior exists)."""
    options, lr = METHODS[method]
    rows = _rows()
    model = _bert()
    torch.manual_seed(1)
    reference = bw.wrap(copy.deepcopy(model), method, num_data=N, params="adapters", **options)
    torch.manual_seed(5)  # the Trainer seeds the global generator with args.seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bw.fit(reference, _loader(_without_text(rows)), epochs=3,
               optimizer=_optimizer(reference, lr), progress=False, grad_clip_norm=1.0)
        torch.manual_seed(1)
        bnn = bw.wrap(copy.deepcopy(model), method, num_data=N, params="adapters", **options)
        args = _args(tmp_path, learning_rate=lr, eval_strategy="epoch")  # mid-training evaluation changes nothing
        trainer = hf.BayesianTrainer(model=bnn, args=args, train_dataset=rows, data_collator=collate,
                                     eval_dataset=rows[:8], eval_num_samples=2)
        trainer.train()
    assert [sorted(k for k in log if k.startswith("eval_")) for log in trainer.state.log_history[:3]] == [
        ["eval_ece", "eval_error", "eval_nll"]] * 3
    assert isinstance(trainer.optimizer.optimizer, bnn.required_optimizer or torch.optim.AdamW)
    assert not bnn.training
    x = _inputs(rows[:8])
    _assert_same_model(reference, bnn, x)


def test_causal_lm_trainer_equals_fit_and_evaluates_per_token(tmp_path):
    """A tiny GPT-2 + LoRA under VI with likelihood="causal_lm": fit's posterior; evaluate() = token_report."""
    rows = _rows(lm=True)
    model = _gpt2()
    num_tokens = sum(len(r["labels"]) - 1 for r in rows)  # targets after the causal shift, num_data in tokens
    torch.manual_seed(1)
    reference = bw.wrap(copy.deepcopy(model), "vi", num_data=num_tokens, params="adapters", likelihood="causal_lm")
    torch.manual_seed(5)
    bw.fit(reference, _loader(_without_text(rows)), epochs=3, optimizer=_optimizer(reference, 1e-2), progress=False,
           grad_clip_norm=1.0)
    torch.manual_seed(1)
    bnn = bw.wrap(copy.deepcopy(model), "vi", num_data=num_tokens, params="adapters", likelihood="causal_lm")
    trainer = hf.BayesianTrainer(model=bnn, args=_args(tmp_path, per_device_eval_batch_size=5), train_dataset=rows,
                                 eval_dataset=rows[:10], data_collator=collate, eval_num_samples=0)
    trainer.train()
    x = _inputs(rows[:8])
    _assert_same_model(reference, bnn, x)
    metrics = trainer.evaluate()
    batch = collate(_without_text(rows[:10]))
    expected = token_report(bnn.predict(x | _inputs(rows[:10]), num_samples=0), batch["labels"])
    for key in ("nll", "error", "ece"):
        assert metrics[f"eval_{key}"] == pytest.approx(expected[key], rel=1e-5, abs=1e-7)
    assert metrics["epoch"] == 3.0  # the Trainer's own log entries still come with it


def test_bf16_autocast_equals_fit(tmp_path):
    """TrainingArguments(bf16=True) = fit(autocast_dtype="bf16") (VI on the adapters, CPU autocast)."""
    rows = _rows()
    model = _bert()
    torch.manual_seed(1)
    reference = bw.wrap(copy.deepcopy(model), "vi", num_data=N, params="adapters")
    torch.manual_seed(5)
    bw.fit(reference, _loader(_without_text(rows)), epochs=3, optimizer=_optimizer(reference, 1e-2), progress=False,
           grad_clip_norm=1.0, autocast_dtype="bf16")
    torch.manual_seed(1)
    bnn = bw.wrap(copy.deepcopy(model), "vi", num_data=N, params="adapters")
    hf.BayesianTrainer(model=bnn, args=_args(tmp_path, bf16=True), train_dataset=rows, data_collator=collate).train()
    _assert_same_model(reference, bnn, _inputs(rows[:8]))


def test_gradient_accumulation_counts_the_prior_once(tmp_path):
    """Batches of 4 with 2 accumulation steps = fit on batches of 8: mean NLL + KL/N once per step (MAP, prior on,
    SGD), and evaluate() = calibration's NLL, error and ECE of the posterior predictive."""
    rows = _rows()
    model = _bert()
    reference = bw.wrap(copy.deepcopy(model), "map", num_data=N, params="adapters", prior_std=0.1)
    bw.fit(reference, _loader(_without_text(rows)), epochs=2, progress=False, grad_clip_norm=1.0,
           optimizer=torch.optim.SGD(reference.param_groups(), lr=0.5))
    bnn = bw.wrap(copy.deepcopy(model), "map", num_data=N, params="adapters", prior_std=0.1)
    args = _args(tmp_path, num_train_epochs=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                 learning_rate=0.5, optim="sgd")
    trainer = hf.BayesianTrainer(model=bnn, args=args, train_dataset=rows, eval_dataset=rows, data_collator=collate)
    trainer.train()
    assert trainer.state.global_step == 6
    assert isinstance(trainer.optimizer.optimizer, torch.optim.SGD)
    _assert_same_model(reference, bnn, _inputs(rows[:8]), atol=1e-6)
    probs = bnn.predict(_inputs(rows), num_samples=0)
    labels = collate(_without_text(rows))["labels"]
    metrics = trainer.evaluate()
    assert metrics["eval_nll"] == pytest.approx(calibration.nll(probs, labels), rel=1e-5)
    assert metrics["eval_error"] == pytest.approx(1 - calibration.accuracy(probs, labels))
    assert metrics["eval_ece"] == pytest.approx(calibration.ece(probs, labels), rel=1e-5, abs=1e-7)
    predicted = trainer.predict(rows)
    torch.testing.assert_close(torch.as_tensor(predicted.predictions), probs, rtol=0, atol=1e-6)
    assert predicted.label_ids.tolist() == labels.tolist()
    assert predicted.metrics["test_nll"] == pytest.approx(metrics["eval_nll"])


def test_map_without_prior_is_the_plain_peft_trainer(tmp_path):
    """transformers.Trainer on the peft model itself (its own cross-entropy, AdamW) = MAP with prior_std=None."""
    rows = _rows()
    model = _bert()
    plain = copy.deepcopy(model)
    transformers.Trainer(model=plain, args=_args(tmp_path / "plain"), train_dataset=rows,
                         data_collator=collate).train()
    bnn = bw.wrap(copy.deepcopy(model), "map", num_data=N, params="adapters", prior_std=None)
    hf.BayesianTrainer(model=bnn, args=_args(tmp_path / "bayes"), train_dataset=rows, data_collator=collate).train()
    ours = dict(bnn.to_deterministic().named_parameters())
    trained = {n: p for n, p in plain.named_parameters() if p.requires_grad}  # LoRA's A, B and the classifier
    assert set(bnn.posterior_mean()) < set(trained) and len(trained) == 6
    for name, p in plain.named_parameters():
        torch.testing.assert_close(ours[name], p.detach(), rtol=0, atol=1e-6, msg=name)
    x = _inputs(rows[:8])
    with torch.no_grad():
        torch.testing.assert_close(bnn.predict(x, num_samples=0), plain.eval()(**x).logits.softmax(-1), rtol=0,
                                   atol=1e-6)


@pytest.mark.parametrize("method", ["swag", "vi"])
def test_checkpoints_hold_a_bw_save_file_and_resume_as_uninterrupted(method, tmp_path):
    """save_strategy="epoch": each checkpoint folder has bayeswrap.pt (bw.load rebuilds it); resuming from epoch 1
    ends where the uninterrupted run ends (SWAG's moments and its learning-rate drive, VI's random stream)."""
    rows = _rows()
    model = _bert()

    def run(folder, resume=None, epochs=3):
        torch.manual_seed(1)
        bnn = bw.wrap(copy.deepcopy(model), method, num_data=N, params="adapters")
        trainer = hf.BayesianTrainer(model=bnn, args=_args(folder, save_strategy="epoch", num_train_epochs=epochs),
                                     train_dataset=rows, data_collator=collate)
        trainer.train(resume_from_checkpoint=resume)
        return bnn, trainer

    full, _ = run(tmp_path / "full")
    first = tmp_path / "full" / "checkpoint-3"
    assert (first / hf.BAYESWRAP_FILE).is_file() and (first / "optimizer.pt").is_file()
    loaded = bw.load(tmp_path / "full" / "checkpoint-9" / hf.BAYESWRAP_FILE, _bert())
    x = _inputs(rows[:8])
    if method == "vi":  # checkpoint-9 is written before after_fit; SWAG's after_fit changes its state
        _assert_same_model(full, loaded, x, atol=0)
    resumed, trainer = run(tmp_path / "again", resume=str(first))
    assert trainer.state.global_step == 9
    _assert_same_model(full, resumed, x)
    trainer.save_model(str(tmp_path / "final"))
    _assert_same_model(resumed, bw.load(tmp_path / "final" / hf.BAYESWRAP_FILE, _bert()), x, atol=0)


def test_resuming_from_a_folder_of_another_kind_is_refused(tmp_path):
    rows = _rows()
    bnn = bw.wrap(_bert(), "map", num_data=N, params="adapters")
    trainer = hf.BayesianTrainer(model=bnn, args=_args(tmp_path / "map", save_strategy="epoch", num_train_epochs=1),
                                 train_dataset=rows, data_collator=collate)
    trainer.train()
    other = hf.BayesianTrainer(model=bw.wrap(_bert(), "vi", num_data=N, params="adapters"),
                               args=_args(tmp_path / "vi"), train_dataset=rows, data_collator=collate)
    with pytest.raises(bw.core.io.CheckpointError, match="holds a 'map' model wrapped with other arguments"):
        other.train(resume_from_checkpoint=str(tmp_path / "map" / "checkpoint-3"))
    plain = tmp_path / "plain"
    transformers.Trainer(model=_bert(), args=_args(plain, save_strategy="epoch", num_train_epochs=1),
                         train_dataset=rows, data_collator=collate).train()
    with pytest.raises(ValueError, match=r"holds no bayeswrap.pt \(it holds \[.*adapter_model.safetensors"):
        other.train(resume_from_checkpoint=str(plain / "checkpoint-3"))


def test_bad_input_is_refused_with_the_value_and_what_is_accepted(tmp_path):
    rows = _rows()
    with pytest.raises(ValueError, match="model must be a bayeswrap BayesianModel .* got PeftModelForSequence"):
        hf.BayesianTrainer(model=_bert(), args=_args(tmp_path), train_dataset=rows, data_collator=collate)
    bnn = bw.wrap(_bert(), "sgld", num_data=N, params="adapters")
    with pytest.raises(ValueError, match="compute_metrics is not accepted by BayesianTrainer"):
        hf.BayesianTrainer(model=bnn, args=_args(tmp_path), compute_metrics=lambda p: {})
    with pytest.raises(ValueError, match="eval_num_samples"):
        hf.BayesianTrainer(model=bnn, args=_args(tmp_path), eval_num_samples=-1)
    with pytest.raises(ValueError, match="run_chains"):
        hf.BayesianTrainer(model=bw.wrap(torch.nn.Linear(2, 2), "mh", num_data=4), args=_args(tmp_path))
    adamw = torch.optim.AdamW(bnn.param_groups(), lr=1e-3)
    trainer = hf.BayesianTrainer(model=bnn, args=_args(tmp_path), train_dataset=rows, data_collator=collate,
                                 optimizers=(adamw, None))
    with pytest.raises(ValueError, match="must be trained with bayeswrap.optim.SGLD, got AdamW"):
        trainer.train()
    with pytest.raises(ValueError, match="evaluate\\(\\) needs an eval_dataset"):
        trainer.evaluate()
    peft_model = _bert()  # an optimizer over the wrapped module's own tensors (its frozen base and adapters)
    trainer = hf.BayesianTrainer(model=bw.wrap(peft_model, "vi", num_data=N, params="adapters"), args=_args(tmp_path),
                                 train_dataset=rows, data_collator=collate,
                                 optimizers=(torch.optim.AdamW(peft_model.parameters()), None))
    with pytest.raises(ValueError, match="the optimizer holds none of bnn's trainable parameters"):
        trainer.train()
    # columns that no forward argument names are dropped, leaving only the targets
    renamed = [{"tokens": r["input_ids"][:3], "labels": r["labels"]} for r in rows]
    trainer = hf.BayesianTrainer(model=bw.wrap(_bert(), "map", num_data=N, params="adapters"), args=_args(tmp_path),
                                 train_dataset=renamed,
                                 data_collator=lambda b: {k: torch.tensor([r[k] for r in b]) for k in b[0]})
    with pytest.raises(ValueError, match=r"nothing but the targets \(keys \['labels'\]\).*'input_ids', "
                                         r"'attention_mask'.*remove_unused_columns=False"):
        trainer.train()
    assert "input_ids" in trainer._signature_columns and "text" not in trainer._signature_columns


def test_load_best_model_at_end_is_fits_early_stopping_state(tmp_path):
    """load_best_model_at_end on eval_nll = fit's restored best validation state (patience never reached), and
    Laplace's curvature is fitted at it afterwards in both (SGD at a large lr, so the best epoch is not the last)."""
    rows = _rows()
    model = _bert()
    reference = bw.wrap(copy.deepcopy(model), "laplace", num_data=N, params="adapters")
    history = bw.fit(reference, _loader(_without_text(rows)), epochs=4, progress=False, grad_clip_norm=1.0,
                     optimizer=torch.optim.SGD(reference.param_groups(), lr=3.0),
                     val_loader=_loader(_without_text(rows[:12])), early_stopping_patience=10)
    best = min(range(4), key=lambda e: history[e]["val_nll"])
    assert best < 3
    bnn = bw.wrap(copy.deepcopy(model), "laplace", num_data=N, params="adapters")
    args = _args(tmp_path, num_train_epochs=4, optim="sgd", learning_rate=3.0, eval_strategy="epoch",
                 save_strategy="epoch", load_best_model_at_end=True, metric_for_best_model="nll",
                 greater_is_better=False)
    trainer = hf.BayesianTrainer(model=bnn, args=args, train_dataset=rows, eval_dataset=rows[:12],
                                 data_collator=collate, eval_num_samples=0)
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{3 * (best + 1)}")
    assert [log["eval_nll"] for log in trainer.state.log_history[:4]] == pytest.approx(
        [record["val_nll"] for record in history], rel=1e-6)
    _assert_same_model(reference, bnn, _inputs(rows[:8]))
