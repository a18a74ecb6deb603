"""``bw.fit(..., compile=...)``: the training step of every method fit trains compiled in one graph.

Oracle: the same fit run eagerly, from the same seed, on the same minibatches (4 batches of 12, 12, 12 and 8
examples: the last, smaller one runs eagerly, as does the first step). ``fullgraph=True`` (the default) makes a
graph break in the loss an error, so each passing case is a loss captured in one graph; dynamo's
``unique_graphs`` counter shows one graph per fit (no recompilation within or across the epochs).

Tolerances (float32): with the ``eager`` and ``aot_eager`` backends the compiled step runs eager's random draws and
the methods' reference expressions instead of the fused kernels (the same formulas, other rounding): training
losses and every parameter and buffer after 3 epochs agree to 1e-5 (absolute and relative; VI's fused and plain
KL differ by ~1e-6). With inductor (``fallback_random=True``, so that its draws are eager's) the same 1e-5.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import bayeswrap as bw
from bayeswrap.compiled import COMPILE_KEYS, CompiledLoss, compile_options
from bayeswrap.methods.mcmc.posterior import FullBatchMCMC

N, EPOCHS, TOL = 44, 3, 1e-5


def _mlp(seed: int = 0, dropout: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 10), nn.ReLU(), nn.Dropout(0.2) if dropout else nn.Identity(), nn.Linear(10, 3)]
    return nn.Sequential(*layers)


def _batches():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return [(x[i:i + 12].clone(), y[i:i + 12].clone()) for i in range(0, N, 12)]  # a DataLoader's own tensors


def _optimizer(bnn, name: str):
    if bnn.method == "sgld" or getattr(bnn, "member", None) == "sgld":
        return bw.optim.SGLD(bnn.parameters(), lr=1e-3, num_data=N)
    if bnn.method == "ivon":
        return bw.optim.IVON(bnn.parameters(), lr=0.05)
    if name == "adamw":
        return torch.optim.AdamW(bnn.param_groups(), lr=0.01)
    return torch.optim.SGD(bnn.param_groups(), lr=0.05, momentum=0.9)


def _fit(method, options, compile, optimizer="sgd", **fit_kwargs):
    bnn = bw.wrap(_mlp(dropout=method == "mc_dropout" and options.get("mode") == "layers"), method, num_data=N,
                  **options)
    torch.manual_seed(1)
    counters.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # e.g. SWAG's few collected moments
        history = bw.fit(bnn, _batches(), epochs=EPOCHS, optimizer=_optimizer(bnn, optimizer), progress=False,
                         compile=compile, **fit_kwargs)
    return bnn, history, counters["stats"]["unique_graphs"]


def _assert_same_fit(eager, compiled):
    (b0, h0, _), (b1, h1, _) = eager, compiled
    torch.testing.assert_close([h["train_loss"] for h in h1], [h["train_loss"] for h in h0], rtol=TOL, atol=TOL)
    s0, s1 = b0.state_dict(), b1.state_dict()
    assert list(s1) == list(s0)
    for key, value in s0.items():
        if torch.is_tensor(value):
            torch.testing.assert_close(s1[key], value, rtol=TOL, atol=TOL, msg=key)


#: every method fit trains (full-batch samplers excluded), with options that make a short fit meaningful
CASES = {
    "map": ("map", {}, "adamw"),
    "vi": ("vi", {}, "sgd"),
    "vi-adamw": ("vi", {}, "adamw"),
    "vi-local_reparam": ("vi", {"local_reparam": True}, "sgd"),
    "ivon": ("ivon", {}, "sgd"),
    "mc_dropout": ("mc_dropout", {}, "adamw"),
    "sgld": ("sgld", {"burn_in": 0, "thinning": 1}, "sgd"),
    "swag": ("swag", {"swa_start": 1}, "sgd"),
    "laplace": ("laplace", {}, "sgd"),
    "laplace_ll_kfac": ("laplace_ll_kfac", {}, "sgd"),
    "tfb": ("tfb", {}, "sgd"),
    "sparse_vd": ("sparse_vd", {}, "adamw"),
    "kingma_vd": ("kingma_vd", {}, "sgd"),
    "lbbnn": ("lbbnn", {}, "adamw"),
    "ensemble": ("ensemble", {"num_members": 2}, "sgd"),
    "ensemble-vi-sequential": ("ensemble", {"num_members": 2, "member": "vi", "parallel": "sequential"}, "adamw"),
    "multiswag": ("multiswag", {"num_members": 2, "member_kwargs": {"swa_start": 1}}, "sgd"),
}


def test_the_cases_cover_every_method_fit_trains():
    trained = {name for name, cls in bw.METHODS.items() if not issubclass(cls, FullBatchMCMC)}
    assert trained == {method for method, _, _ in CASES.values()}


@pytest.mark.parametrize("case", list(CASES))
def test_a_compiled_fit_equals_the_eager_fit(case):
    method, options, optimizer = CASES[case]
    backend = "aot_eager" if case in ("vi", "ensemble") else "eager"
    eager = _fit(method, options, False, optimizer)
    compiled = _fit(method, options, {"backend": backend}, optimizer)
    _assert_same_fit(eager, compiled)
    # the first step and the last, smaller batch of each epoch ran eagerly; one graph for the whole fit (SWAG's
    # growing deviation buffers, which MultiSWAG's vmapped template holds, make a second, dynamic one)
    assert [h["compiled_steps"] for h in compiled[1]] == [2, 3, 3]
    assert "compiled_steps" not in eager[1][0]
    assert compiled[2] == (2 if method == "multiswag" else 1)


def test_kl_schedule_and_dynamic_shapes_recompile_at_most_once():
    schedule = bw.KLSchedule(warmup_epochs=0, ramp_epochs=EPOCHS)  # factors 1/3, 2/3, 1
    eager = _fit("vi", {}, False, kl_schedule=schedule)
    compiled = _fit("vi", {}, {"backend": "eager"}, kl_schedule=schedule)
    _assert_same_fit(eager, compiled)
    # the float kl_weight: specialised, then symbolic (dynamo remembers a float it saw change, by the function's
    # file and line, so a fit after another compiled fit may start symbolic: 1 graph)
    assert compiled[2] in (1, 2)
    dynamic = _fit("vi", {}, {"backend": "eager", "dynamic": True})
    _assert_same_fit(_fit("vi", {}, False), dynamic)
    assert [h["compiled_steps"] for h in dynamic[1]] == [3, 4, 4] and dynamic[2] == 1


def test_bad_targets_and_graph_breaks_are_reported_by_name():
    bnn = bw.wrap(_mlp(), "map", num_data=N)
    loss = CompiledLoss(bnn, {"backend": "aot_eager"})
    (x, y), _ = _batches()[:2]
    loss(x, y), loss(x, y)  # eager, then compiled
    assert (loss.eager_steps, loss.compiled_steps) == (1, 1)
    bad = y.clone()
    bad[3] = 7
    with pytest.raises(ValueError, match=r"class label 7 is out of range; accepted: integers in \[0, 2\]"):
        loss(x, bad)

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            out = self.fc(x)
            return out if float(out.sum()) > 0 else -out  # data-dependent: a graph break

    batches = _batches()
    with pytest.raises(RuntimeError, match=r"could not capture the training loss of this 'map' model in one "
                                           r"graph.*accepted: compile=\{'fullgraph': False\}"):
        bnn = bw.wrap(Branchy(), "map", num_data=N)
        bw.fit(bnn, batches, epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1), progress=False,
               compile={"backend": "eager"})
    torch.manual_seed(0)
    plain = bw.wrap(Branchy(), "map", num_data=N)
    torch.manual_seed(0)
    broken = bw.wrap(Branchy(), "map", num_data=N)
    bw.fit(plain, batches, epochs=1, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1), progress=False)
    history = bw.fit(broken, batches, epochs=1, optimizer=torch.optim.SGD(broken.parameters(), lr=0.1),
                     progress=False, compile={"backend": "eager", "fullgraph": False})
    assert history[0]["compiled_steps"] == 2
    torch.testing.assert_close(dict(broken.named_parameters()), dict(plain.named_parameters()), rtol=TOL, atol=TOL)


def test_batches_of_several_other_shapes_warn():
    bnn = bw.wrap(_mlp(), "map", num_data=N)
    loss = CompiledLoss(bnn, {"backend": "eager"})
    x, y = _batches()[0]
    loss(x, y), loss(x, y)
    loss(x[:5], y[:5])  # one other shape (a last batch): no warning
    with pytest.warns(RuntimeWarning, match=r"batches of 2 shapes other than the compiled one run eagerly.*"
                                            r"compile=\{'dynamic': True\}"):
        loss(x[:4], y[:4])
    assert (loss.eager_steps, loss.compiled_steps) == (3, 1)


@pytest.mark.parametrize(("value", "message"), [
    ("yes", r"compile='yes' is not accepted; accepted: False, True, or a mapping"),
    ({"backnd": "eager"}, r"compile has the key\(s\) \['backnd'\].*accepted keys: \('backend', 'mode', "),
    ({"backend": "nope"}, r"compile backend='nope' is not accepted; accepted: a callable or one of .*'inductor'"),
    ({"mode": "fast"}, r"compile mode='fast' is not accepted; accepted: None or one of \('default', "),
    ({"fullgraph": 1}, r"compile fullgraph=1 is not accepted; accepted: True or False"),
    ({"dynamic": "yes"}, r"compile dynamic='yes' is not accepted; accepted: None or True or False"),
    ({"options": 3}, r"compile options=3 is not accepted; accepted: None or a mapping of backend options"),
    ({"mode": "max-autotune", "options": {}}, r"mode='max-autotune' and options are both given"),
])
def test_bad_compile_options_are_refused_before_training(value, message):
    bnn = bw.wrap(_mlp(), "map", num_data=N)
    with pytest.raises(ValueError, match=message):
        bw.fit(bnn, _batches(), epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1), progress=False,
               compile=value)
    assert set(COMPILE_KEYS) == {"backend", "mode", "fullgraph", "dynamic", "options"}
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options(True) == {"fullgraph": True, "options": {"fallback_random": True}}  # eager's draws
    assert compile_options({"options": {"fallback_random": False}})["options"] == {"fallback_random": False}
    assert "options" not in compile_options({"mode": "max-autotune"})
    assert compile_options({"backend": "aot_eager", "fullgraph": False}) == {"backend": "aot_eager",
                                                                             "fullgraph": False}
