"""Modules compiled with ``torch.compile``: ``bw.wrap`` unwraps a compiled model, ``bw.fit`` a compiled BayesianModel.

bayeswrap calls the model functionally on a storage-free copy of its structure, so the compiled graph never
runs; what matters is that a compiled module behaves exactly as the plain one: the same parameter names (no
``_orig_mod.`` prefix, so ``params`` patterns, ``reinit`` patterns and saved files match), the same training
trajectory and the same predictions. ``torch.compile`` is lazy: nothing here triggers a compilation.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bayeswrap as bw

N = 48


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return [(x[i:i + 12], y[i:i + 12]) for i in range(0, N, 12)], x


def _fit(bnn, batches):
    torch.manual_seed(1)
    bw.fit(bnn, batches, epochs=2, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1, momentum=0.9),
           progress=False)
    return bnn.eval()


@pytest.mark.parametrize(("method", "options"), [
    ("vi", {"params": ["2.*"]}),
    ("mc_dropout", {}),
    ("ensemble", {"num_members": 2, "reinit": ["2"], "init_seed": 3}),
], ids=["vi-patterns", "mc_dropout", "ensemble-reinit-patterns"])
def test_a_compiled_model_wraps_and_trains_exactly_as_the_plain_one(method, options):
    batches, x = _data()
    plain = bw.wrap(_mlp(), method, num_data=N, **options)
    compiled_model = torch.compile(_mlp())
    compiled = bw.wrap(compiled_model, method, num_data=N, **options)
    assert list(compiled.state_dict()) == list(plain.state_dict())
    assert not any("_orig_mod" in k for k in compiled.state_dict())
    if method == "vi":
        assert compiled.bayesian_names == plain.bayesian_names == ["2.weight", "2.bias"]
    _fit(plain, batches), _fit(compiled, batches)
    for key, value in plain.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(compiled.state_dict()[key], value), key
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    assert torch.equal(compiled.predict(x, 4, generator=gen()), plain.predict(x, 4, generator=gen()))
    # the compiled wrapper and the model in it are untouched (wrap never modifies the model)
    assert torch.equal(compiled_model._orig_mod[0].weight, _mlp()[0].weight)


def test_fit_trains_the_bayesian_model_inside_a_compiled_one():
    batches, x = _data()
    direct = _fit(bw.wrap(_mlp(), "vi", num_data=N), batches)
    bnn = bw.wrap(_mlp(), "vi", num_data=N)
    compiled = torch.compile(bnn)
    torch.manual_seed(1)
    bw.fit(compiled, batches, epochs=2, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1, momentum=0.9),
           progress=False)
    assert compiled._orig_mod is bnn
    for key, value in direct.state_dict().items():
        if torch.is_tensor(value):
            assert torch.equal(bnn.state_dict()[key], value), key
    with pytest.raises(ValueError, match="bnn must be a bayeswrap BayesianModel.*got Sequential"):
        bw.fit(torch.compile(_mlp()), batches, epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1))


def test_save_and_load_through_compiled_modules(tmp_path):
    batches, x = _data()
    bnn = _fit(bw.wrap(torch.compile(_mlp()), "swag", num_data=N, swa_start=1, collect_every=1), batches)
    bw.save(torch.compile(bnn), tmp_path / "bnn.pt")
    loaded = bw.load(tmp_path / "bnn.pt", torch.compile(_mlp(7)))  # a plain _mlp(7) loads the same file
    gen = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    assert torch.equal(loaded.predict(x, 4, generator=gen()), bnn.predict(x, 4, generator=gen()))
    assert torch.equal(bw.load(tmp_path / "bnn.pt", _mlp(8)).predict(x, 0), bnn.predict(x, 0))
