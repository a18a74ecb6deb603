"""Compiled steps with inductor (C++ code generated and built with gcc) and in the Lightning module.

Oracle: the eager fit from the same seed on the same minibatches. Inductor draws its own random numbers unless
its ``fallback_random`` option is set, which ``compile=True`` sets (so that the draws are eager's); then VI's
losses and parameters after 3 epochs (AdamW; 3 batches of 16 and one of 8, the first step and the smaller batch
eager) agree with eager's to 1e-5 (absolute and relative), the rounding of generated kernels and of the reference
KL against the fused one. The Lightning module (``aot_eager``) matches ``bw.fit`` eagerly to the same 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch._dynamo.utils import counters

import bayeswrap as bw

N, EPOCHS, TOL = 56, 3, 1e-5


def _data():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, generator=gen)
    y = (x.sum(1) > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _vi(seed: int = 0):
    torch.manual_seed(seed)
    return bw.wrap(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)), "vi", num_data=N)


def _trained(compile, make_optimizer=lambda p: torch.optim.AdamW(p, lr=0.02)):
    bnn = _vi()
    torch.manual_seed(1)
    counters.clear()
    history = bw.fit(bnn, _data(), epochs=EPOCHS, optimizer=make_optimizer(bnn.parameters()), progress=False,
                     compile=compile)
    return bnn, history


def _close(a: nn.Module, b: nn.Module) -> None:
    state = b.state_dict()
    for key, value in a.state_dict().items():
        if torch.is_tensor(value):
            torch.testing.assert_close(value, state[key], rtol=TOL, atol=TOL, msg=key)


def test_inductor_with_eager_draws_equals_the_eager_fit():
    eager, eager_history = _trained(False)
    assert not inductor_config.fallback_random  # compile=True sets it for its own graph, not globally
    compiled, history = _trained(True)
    assert counters["stats"]["unique_graphs"] == 1
    assert [h["compiled_steps"] for h in history] == [2, 3, 3]
    torch.testing.assert_close([h["train_loss"] for h in history], [h["train_loss"] for h in eager_history],
                               rtol=TOL, atol=TOL)
    _close(compiled, eager)


def test_lightning_module_compiles_its_training_step():
    lightning = pytest.importorskip("lightning.pytorch")
    from bayeswrap.lightning import BayesianModule

    sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    reference, _ = _trained(False, sgd)
    bnn = _vi()
    module = BayesianModule(bnn, sgd, compile={"backend": "aot_eager"})
    assert module.hparams["compile"] == {"backend": "aot_eager"}
    trainer = lightning.Trainer(max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    torch.manual_seed(1)
    trainer.fit(module, _data())
    assert (module._compiled_loss.eager_steps, module._compiled_loss.compiled_steps) == (1 + EPOCHS, 8)
    _close(bnn, reference)
    with pytest.raises(ValueError, match="compile='always' is not accepted"):
        BayesianModule(bnn, compile="always")
