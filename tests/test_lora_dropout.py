"""MC dropout through LoRA's own dropout: ``bw.wrap(peft_model, "mc_dropout", mode="layers", params="adapters")``.

Oracles: a naive loop over the user's peft model with only its ``lora_dropout`` modules in train mode (the same
masks from the same seed), the closed-form mean and variance of a LoRA-adapted linear layer's outputs under
inverted dropout of its input to A, and the modes and probabilities of the base's own dropout module.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bayeswrap as bw

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

LORA_P, BASE_P = 0.3, 0.2


def _lora_mlp(lora_dropout: float = LORA_P, seed: int = 0) -> nn.Module:
    """Linear(6, 8) → ReLU → Dropout(0.2) → Linear(8, 3), LoRA (r=2) on both Linear layers with random A and B."""
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(BASE_P), nn.Linear(8, 3))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0", "3"], lora_dropout=lora_dropout,
                             init_lora_weights=False)  # B ≠ 0, so that the adapters' dropout changes the outputs
    return peft.get_peft_model(base, config)


def _reference(model: nn.Module, layer_p: float | None = None) -> nn.Module:
    """A copy of the user's peft model in eval mode with only LoRA's dropout in train mode (p = layer_p if given)."""
    ref = copy.deepcopy(model).eval()
    for mod in ref.modules():
        holder = getattr(mod, "lora_dropout", None)
        if isinstance(holder, nn.ModuleDict):
            for key in holder:
                if layer_p is not None:
                    holder[key] = nn.Dropout(layer_p)
                holder[key].train()
    return ref


def _naive(model, x, num_samples, generator_seed, layer_p=None):
    """S forward passes of the reference, the global RNG seeded as the predictive documents it."""
    seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(generator_seed)))
    ref = _reference(model, layer_p)
    torch.manual_seed(seed)
    with torch.no_grad():
        return torch.stack([ref(x) for _ in range(num_samples)])


def test_samples_equal_a_naive_peft_loop_and_the_base_dropout_stays_off():
    model = _lora_mlp()
    x = torch.randn(5, 6)
    bnn = bw.wrap(model, "mc_dropout", num_data=10, mode="layers", params="adapters", chunk_size=1).eval()
    assert bnn.dropout_layers == ["base_model.model.0.lora_dropout.default", "base_model.model.3.lora_dropout.default"]
    outs = bnn.sample_logits(x, 4, generator=torch.Generator().manual_seed(3))
    expected = _naive(model, x, 4, 3)
    torch.testing.assert_close(outs, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(outs[0], outs[1])  # the masks differ between samples
    probs = bnn.predict(x, 4, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(probs, expected.softmax(-1).mean(0), rtol=0, atol=1e-6)
    # num_samples=0: every dropout off, the plain peft model in eval mode
    with torch.no_grad():
        torch.testing.assert_close(bnn.predict(x, 0), copy.deepcopy(model).eval()(x).softmax(-1), rtol=0, atol=1e-6)
    # the base's dropout: not kept active in the predictive, left in the model's mode with the user's p
    base_dropout = bnn.model.get_submodule("base_model.model.2")
    assert base_dropout.p == BASE_P and not base_dropout.training
    bnn.train()  # while bw.fit trains, every dropout is active, the base's too (as in peft's own fine-tuning)
    assert base_dropout.training and all(bnn.model.get_submodule(n).training for n in bnn.dropout_layers)
    # Bayesian parameters beyond the adapters (here a trainable base bias, params=None): every dropout module is
    # a unit of the posterior, the base's too (the documented rule)
    model.base_model.model[3].base_layer.bias.requires_grad_(True)
    every = bw.wrap(model, "mc_dropout", num_data=10, mode="layers")
    assert every.dropout_layers == ["base_model.model.0.lora_dropout.default", "base_model.model.2",
                                    "base_model.model.3.lora_dropout.default"]


def test_vmapped_lora_dropout_matches_the_closed_form_moments():
    """y = W x + b + s B A (z ⊙ x) / (1 − p): E y = W x + b + s B A x, Var y_k = s² Σ_j (BA)_kj² x_j² p / (1 − p)."""
    torch.manual_seed(1)
    base = nn.Sequential(nn.Linear(6, 3))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["0"], lora_dropout=0.4, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    layer = model.base_model.model[0]
    delta = 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight  # scaling α / r = 2
    x = torch.randn(4, 6)
    bnn = bw.wrap(model, "mc_dropout", num_data=10, mode="layers", params="adapters", chunk_size=1000).eval()
    outs = bnn.sample_logits(x, 20000, generator=torch.Generator().manual_seed(0)).detach()
    with torch.no_grad():
        mean = layer.base_layer(x) + x @ delta.T
        var = x.square() @ delta.square().T * 0.4 / 0.6
    se = (var / 20000).sqrt()
    assert ((outs.mean(0) - mean).abs() <= 5 * se + 1e-6).all(), (outs.mean(0) - mean) / se
    torch.testing.assert_close(outs.var(0), var, rtol=0.05, atol=1e-6)


def test_layer_p_sets_the_lora_dropout_of_the_copy_only():
    model = _lora_mlp()
    x = torch.randn(5, 6)
    bnn = bw.wrap(model, "mc_dropout", num_data=10, mode="layers", params="adapters", layer_p=0.5,
                  chunk_size=1).eval()
    assert [bnn.model.get_submodule(n).p for n in bnn.dropout_layers] == [0.5, 0.5]
    assert bnn.model.get_submodule("base_model.model.2").p == BASE_P  # the base's dropout untouched
    assert [m.p for n, m in model.named_modules() if n.endswith("lora_dropout.default")] == [LORA_P, LORA_P]
    outs = bnn.sample_logits(x, 3, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(outs, _naive(model, x, 3, 4, layer_p=0.5), rtol=0, atol=1e-6)


def test_a_lora_without_dropout_is_refused_unless_layer_p_gives_one():
    model = _lora_mlp(lora_dropout=0.0)
    assert all(isinstance(m, nn.Identity) for n, m in model.named_modules() if n.endswith("lora_dropout.default"))
    with pytest.raises(ValueError, match=r"every LoRA layer of the PeftModel has lora_dropout=0 .*accepted: adapters "
                                         r"built with peft.LoraConfig\(lora_dropout=0.1\), or layer_p in \(0, 1\)"):
        bw.wrap(model, "mc_dropout", num_data=10, mode="layers", params="adapters")
    x = torch.randn(5, 6)
    bnn = bw.wrap(model, "mc_dropout", num_data=10, mode="layers", params="adapters", layer_p=0.25,
                  chunk_size=1).eval()
    assert len(bnn.dropout_layers) == 2 and all(bnn.model.get_submodule(n).p == 0.25 for n in bnn.dropout_layers)
    # the user's model keeps its nn.Identity
    assert all(isinstance(m, nn.Identity) for n, m in model.named_modules() if n.endswith("lora_dropout.default"))
    outs = bnn.sample_logits(x, 3, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(outs, _naive(model, x, 3, 5, layer_p=0.25), rtol=0, atol=1e-6)


def test_training_keeps_lora_dropout_on_and_a_checkpoint_reloads():
    model = _lora_mlp()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)
    bnn = bw.wrap(model, "mc_dropout", num_data=32, mode="layers", params="adapters")
    history = bw.fit(bnn, [(x[:16], y[:16]), (x[16:], y[16:])], epochs=3,
                     optimizer=torch.optim.AdamW(bnn.param_groups(), lr=1e-2), progress=False)
    assert len(history) == 3 and all(torch.isfinite(torch.tensor(h["train_nll"])) for h in history)
    fresh = bw.wrap(model, "mc_dropout", num_data=32, mode="layers", params="adapters")
    fresh.load_state_dict(bnn.state_dict())
    bnn.eval(), fresh.eval()
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    torch.testing.assert_close(fresh.predict(x, 3, generator=g1), bnn.predict(x, 3, generator=g2), rtol=0, atol=0)


def test_a_tiny_bert_keeps_only_loras_dropout_active_and_matches_the_peft_loop():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.2,
                             task_type="SEQ_CLS", init_lora_weights=False)
    model = peft.get_peft_model(transformers.BertForSequenceClassification(cfg), config)
    g = torch.Generator().manual_seed(1)
    x = {"input_ids": torch.randint(0, 40, (3, 6), generator=g), "attention_mask": torch.ones(3, 6, dtype=torch.long)}
    bnn = bw.wrap(model, "mc_dropout", num_data=10, mode="layers", params="adapters", chunk_size=1).eval()
    assert len(bnn.dropout_layers) == 2 and all(".lora_dropout." in n for n in bnn.dropout_layers)
    outs = bnn.sample_logits(x, 3, generator=torch.Generator().manual_seed(2))
    seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(2)))
    ref = _reference(model)  # the base's attention and hidden dropout (p = 0.1) stay off, as in eval mode
    torch.manual_seed(seed)
    with torch.no_grad():
        expected = torch.stack([ref(**x).logits for _ in range(3)])
    torch.testing.assert_close(outs, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(outs[0], outs[1])
