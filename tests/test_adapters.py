"""``params="adapters"``: the peft adapter tensors as the Bayesian parameters (issue 35, deliverable 1).

A tiny BERT sequence classifier with peft LoRA (r=4 on query/value, a new head in ``modules_to_save``):
the selection is exactly peft's LoRA tensors (the head stays a point estimate, the base frozen); MAP with no prior
equals a plain peft AdamW loop step for step; map, vi, laplace and swag fit and predict while the frozen base stays
bit-identical; a bf16 base keeps its dtype while the posterior state is fp32; bad inputs are refused by name.
"""

import pytest
import torch

import bayeswrap as bw

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 40, 6


def make_model(dtype=torch.float32, seed=0, lora=True, **lora_kwargs):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    base = transformers.BertForSequenceClassification(cfg).to(dtype)
    if not lora:
        return base
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
    return peft.get_peft_model(base, config, **lora_kwargs)


def make_batches(n=3, size=8):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, VOCAB, (size, LENGTH), generator=g),
             "attention_mask": torch.ones(size, LENGTH, dtype=torch.long),
             "labels": torch.randint(0, 2, (size,), generator=g)} for _ in range(n)]


def lora_names(model):
    return [n for n, p in model.named_parameters() if p.requires_grad and (".lora_A." in n or ".lora_B." in n)]


def test_adapters_select_exactly_the_lora_tensors_and_leave_the_head_a_point_estimate():
    model = make_model()
    bnn = bw.wrap(model, "vi", params="adapters", num_data=24)
    expected = lora_names(model)
    assert len(expected) == 4 and bnn.bayesian_names == expected
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(bnn.point.keys()) == sorted(set(trainable) - set(expected))  # the modules_to_save head
    assert all(".modules_to_save." in n for n in bnn.point.keys())
    assert sorted(bnn.frozen.keys()) == sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    a_only = bw.wrap(model, "vi", params="adapters_A", num_data=24)  # BLoB: A Bayesian, B a point estimate
    assert a_only.bayesian_names == [n for n in expected if ".lora_A." in n]
    assert [n for n in a_only.point.keys() if ".lora_B." in n] == [n for n in expected if ".lora_B." in n]
    # prior_mean="init": B's prior mean is its zero init, A's its random (kaiming-uniform) init
    for n in expected:
        value = model.get_parameter(n)
        assert torch.equal(bnn.prior.mean[n], value) and torch.equal(bnn.posterior_mean()[n], value)
        assert (torch.count_nonzero(value) == 0) == (".lora_B." in n)


def test_map_on_adapters_equals_a_plain_peft_adamw_loop():
    batches = make_batches()
    reference = make_model()
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    for _ in range(2):
        for batch in batches:
            opt.zero_grad()
            reference(**batch).loss.backward()
            opt.step()
    model = make_model()
    bnn = bw.wrap(model, "map", params="adapters", prior_std=None, num_data=24)
    bw.fit(bnn, batches, optimizer=torch.optim.AdamW(bnn.parameters(), lr=1e-2, weight_decay=0.0), epochs=2,
           progress=False)
    trained = {**bnn.posterior_mean(), **bnn.point.as_dict()}
    for n, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(trained[n], p.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(trained[lora_names(model)[1]], model.get_parameter(lora_names(model)[1]))


@pytest.mark.parametrize("method", ["map", "vi", "laplace", "swag"])
def test_every_method_fits_adapters_and_keeps_the_base_bit_identical(method):
    model = make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = make_batches()
    bnn = bw.wrap(model, method, params="adapters", num_data=24)
    bw.fit(bnn, batches, optimizer=torch.optim.AdamW(bnn.parameters(), lr=1e-2), epochs=2, progress=False)
    for n, t in bnn.frozen.items():
        assert torch.equal(t, before[n]), n
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the user's model is untouched
    x = {k: v for k, v in batches[0].items() if k != "labels"}
    probs = bnn.predict(x, num_samples=4)
    assert probs.shape == (8, 2) and torch.allclose(probs.sum(-1), torch.ones(8))
    assert set(bnn.posterior_std()) == set(lora_names(model))


@pytest.mark.parametrize("autocast_adapter", [True, False])
@pytest.mark.parametrize("method", ["vi", "laplace", "swag"])
def test_a_bf16_base_stays_bf16_while_the_posterior_state_is_fp32(method, autocast_adapter):
    # peft's autocast_adapter_dtype=True (its default) keeps LoRA in fp32; False leaves it bf16, and bayeswrap
    # keeps the posterior state in fp32 all the same, casting to bf16 where the model is called
    model = make_model(torch.bfloat16, autocast_adapter_dtype=autocast_adapter)
    dtype = {p.dtype for n, p in model.named_parameters() if ".lora_" in n}
    assert dtype == {torch.float32 if autocast_adapter else torch.bfloat16}
    bnn = bw.wrap(model, method, params="adapters", num_data=24)
    batches = make_batches()
    bw.fit(bnn, batches, optimizer=torch.optim.AdamW(bnn.parameters(), lr=1e-2), epochs=1, progress=False)
    assert {t.dtype for t in bnn.frozen.values()} == {torch.bfloat16}
    state = {k.split(".")[0]: v.dtype for k, v in bnn.state_dict().items()
             if torch.is_tensor(v) and v.is_floating_point()}
    posterior = {k: d for k, d in state.items() if k not in ("frozen", "point", "model_buffers")}
    assert posterior and all(d in (torch.float32, torch.float64) for d in posterior.values()), state
    assert {t.dtype for t in bnn.posterior_mean().values()} == {torch.float32}
    assert {t.dtype for t in bnn.posterior_std().values()} == {torch.float32}
    probs = bnn.predict({k: v for k, v in batches[0].items() if k != "labels"}, num_samples=3)
    assert probs.shape == (8, 2) and torch.isfinite(probs).all()
    if method == "vi":  # AdamW's small steps on the fp32 means are not rounded away to bf16's 8 bits
        means = torch.cat([t.flatten() for t in bnn.posterior_mean().values()])
        assert not torch.equal(means, means.bfloat16().float())
        deployed = bnn.to_deterministic()
        assert {p.dtype for n, p in deployed.named_parameters() if ".lora_" in n} == dtype


def test_adapters_on_a_model_without_adapters_names_what_it_found():
    with pytest.raises(ValueError, match=r"no peft adapter parameter was found in the BertForSequenceClassification"
                                         r".*'last_layer'.*glob pattern"):
        bw.wrap(make_model(lora=False), "vi", params="adapters", num_data=24)


def test_adapters_refuse_an_unfrozen_base():
    model = make_model()
    model.get_parameter("base_model.model.bert.embeddings.word_embeddings.weight").requires_grad_(True)
    with pytest.raises(ValueError, match=r"1 trainable parameters .* neither peft adapters nor modules_to_save .*"
                                         r"word_embeddings.*accepted: a frozen base"):
        bw.wrap(model, "vi", params="adapters", num_data=24)


def test_biases_that_peft_made_trainable_stay_point_estimates():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(cfg),
                                peft.LoraConfig(r=4, target_modules=["query"], bias="lora_only", task_type="SEQ_CLS"))
    bnn = bw.wrap(model, "vi", params="adapters", num_data=24)
    assert bnn.bayesian_names == lora_names(model)
    assert "base_model.model.bert.encoder.layer.0.attention.self.query.base_layer.bias" in bnn.point.keys()


def test_adapters_a_needs_lora_a_factors():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = peft.get_peft_model(base, peft.IA3Config(target_modules=["0", "2"], feedforward_modules=["2"]))
    bnn = bw.wrap(model, "vi", params="adapters", num_data=4)
    assert bnn.bayesian_names == [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(".ia3_l." in n for n in bnn.bayesian_names)
    with pytest.raises(ValueError, match=r"params='adapters_A' .* have none .*ia3_l"):
        bw.wrap(model, "vi", params="adapters_A", num_data=4)


def test_adapters_save_and_load_on_a_fresh_peft_model(tmp_path):
    batches = make_batches()
    bnn = bw.wrap(make_model(), "vi", params="adapters_A", num_data=24)
    bw.fit(bnn, batches, optimizer=torch.optim.AdamW(bnn.parameters(), lr=1e-2), epochs=1, progress=False)
    bw.save(bnn, tmp_path / "vi.pt")
    loaded = bw.load(tmp_path / "vi.pt", make_model(seed=5))  # other weights, same names and flags
    assert loaded.bayesian_names == bnn.bayesian_names
    for n, t in {**bnn.posterior_mean(), **bnn.posterior_std(), **bnn.point.as_dict(), **bnn.frozen.as_dict()}.items():
        got = {**loaded.posterior_mean(), **loaded.posterior_std(), **loaded.point.as_dict(),
               **loaded.frozen.as_dict()}[n]
        assert torch.equal(got, t), n


@pytest.mark.parametrize("autocast_adapter", [True, False])
def test_kfac_laplace_over_the_adapter_linears_of_a_bf16_base(autocast_adapter):
    model = make_model(torch.bfloat16, autocast_adapter_dtype=autocast_adapter)
    bnn = bw.wrap(model, "laplace", params="adapters", hessian_structure="kron", num_data=24)
    batches = make_batches()
    bw.fit(bnn, batches, optimizer=torch.optim.AdamW(bnn.parameters(), lr=1e-2), epochs=1, progress=False)
    kron = bnn._structure
    assert sorted(w for w, _ in kron.layers.values()) == sorted(lora_names(model))  # one A and one B per layer
    assert all(t.dtype == torch.float32 for t in [*kron.A.values(), *kron.G.values()])
    assert all(torch.isfinite(t).all() and t.abs().sum() > 0 for t in [*kron.A.values(), *kron.G.values()])
    probs = bnn.predict({k: v for k, v in batches[0].items() if k != "labels"})  # the GLM predictive
    assert probs.shape == (8, 2) and torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(8))


def test_the_default_params_on_a_peft_model_are_its_adapters_and_head_never_the_base():
    model = make_model()
    bnn = bw.wrap(model, "vi", num_data=24)
    assert bnn.bayesian_names == [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(bnn.bayesian_names) == sorted([*lora_names(model), *(n for n in bnn.bayesian_names
                                                                         if ".modules_to_save." in n)])
    assert len(bnn.bayesian_names) == 6 and len(bnn.point.keys()) == 0


@pytest.mark.parametrize("method", ["vi", "sparse_vd", "lbbnn", "mh"])
def test_a_bf16_model_gets_an_fp32_posterior_under_methods_with_their_own_calls(method):
    # local reparameterisation's variances (sparse_vd, lbbnn) and a sampler's stored draws (mh) are cast at the call
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).bfloat16()
    x, y = torch.randn(16, 3).bfloat16(), torch.randint(0, 2, (16,))
    bnn = bw.wrap(net, method, num_data=16)
    if method == "mh":
        bnn.run_chains(x, y, num_samples=4, num_warmup=4, num_chains=2)
        assert {t.dtype for t in bnn.chain_draws().values()} == {torch.float32}
    else:
        bw.fit(bnn, [(x[:8], y[:8]), (x[8:], y[8:])], optimizer=torch.optim.AdamW(bnn.parameters(), lr=1e-2),
               epochs=2, progress=False)
    assert {t.dtype for t in bnn.posterior_mean().values()} == {torch.float32}
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}
    probs = bnn.predict(x, num_samples=2)
    assert probs.shape == (16, 2) and torch.isfinite(probs).all()
