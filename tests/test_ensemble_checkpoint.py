"""``Ensemble(parallel="checkpoint")``: members one at a time under activation checkpointing (issue 35: a LoRA
ensemble's step memory). Known answers: training equals ``parallel="sequential"`` exactly (the checkpoint keeps
the random state, so VI's draws and LoRA's dropout masks are redrawn identically in the recomputation), and the
tensors a step saves for backward outside the checkpoints are a small fraction of the sequential step's (one
member's activations live at a time instead of M); BatchNorm models are refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bayeswrap as bw

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")
M = 3


def lora_mlp() -> nn.Module:
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.2, target_modules=["0", "2"])
    return peft.get_peft_model(body, config)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, 6, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return [(x[i:i + 15], y[i:i + 15]) for i in range(0, 60, 15)]


def trained(parallel: str, member: str) -> bw.BayesianModel:
    torch.manual_seed(5)
    bnn = bw.wrap(lora_mlp(), "ensemble", member=member, num_members=M, num_data=60, params="adapters",
                  parallel=parallel, init_seed=0)
    torch.manual_seed(6)
    bw.fit(bnn, data(), epochs=2, optimizer=torch.optim.AdamW(bnn.parameters(), lr=1e-2), progress=False)
    return bnn


@pytest.mark.parametrize("member", ["vi", "map"])
def test_checkpointed_members_train_exactly_as_sequential_ones(member):
    ref, ckpt = trained("sequential", member), trained("checkpoint", member)
    state_ref, state_ckpt = ref.state_dict(), ckpt.state_dict()
    floats = [k for k, v in state_ref.items() if torch.is_tensor(v) and v.is_floating_point()]
    assert any("lora_A" in k for k in floats)
    for k in floats:
        torch.testing.assert_close(state_ckpt[k], state_ref[k], rtol=0, atol=0, msg=k)
    x = data()[0][0]
    torch.testing.assert_close(ckpt.predict(x, 6, generator=torch.Generator().manual_seed(2)),
                               ref.predict(x, 6, generator=torch.Generator().manual_seed(2)), rtol=0, atol=0)


def _saved_bytes(bnn, x, y) -> int:
    """Bytes of the tensors autograd saves for backward during one loss, outside any checkpoint."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = bnn.loss(x, y)
    out.loss.backward()
    return total


def test_a_checkpointed_step_keeps_one_members_activations():
    x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
    sizes = {}
    for parallel in ("sequential", "checkpoint"):
        torch.manual_seed(5)
        bnn = bw.wrap(lora_mlp(), "ensemble", member="vi", num_members=M, num_data=256, params="adapters",
                      parallel=parallel, init_seed=0)
        bnn.train()
        sizes[parallel] = _saved_bytes(bnn, x, y)
    # sequential: every member's (256, 64) activations; checkpoint: the members' inputs/outputs only
    assert sizes["sequential"] > M * 256 * 64 * 4
    assert sizes["checkpoint"] < sizes["sequential"] / (2 * M)


def test_checkpoint_refuses_batchnorm_and_names_the_alternatives():
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"parallel='checkpoint'.*BatchNorm.*\['1'\].*'auto', 'vmap' or 'sequential'"):
        bw.wrap(copy.deepcopy(net), "ensemble", num_members=2, num_data=10, parallel="checkpoint")
    with pytest.raises(ValueError, match=r"parallel='bogus' is not accepted.*'checkpoint'"):
        bw.wrap(copy.deepcopy(net), "ensemble", num_members=2, num_data=10, parallel="bogus")


def test_checkpointed_loss_output_equals_the_sequential_one():
    """The scalars exactly, the combined outputs (log mean softmax, kept detached) to float rounding."""
    x, y = data()[0]
    outs = {}
    for parallel in ("sequential", "checkpoint"):
        torch.manual_seed(5)
        bnn = bw.wrap(lora_mlp(), "ensemble", member="map", num_members=M, num_data=60, params="adapters",
                      parallel=parallel, init_seed=0)
        bnn.eval()  # no dropout: the same outputs
        outs[parallel] = bnn.loss(x, y)
    ref, got = outs["sequential"], outs["checkpoint"]
    for a, b in zip(ref[:3], got[:3]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch.testing.assert_close(got.logits, ref.logits.detach(), rtol=1e-6, atol=1e-6)
    assert not got.logits.requires_grad
