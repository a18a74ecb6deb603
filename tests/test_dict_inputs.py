"""Issue 34, deliverable 4: dict inputs reach the model both ways.

A model whose ``forward`` takes the dict's keys as keyword arguments (``model(**x)``, a Hugging Face model) and
one whose ``forward`` takes one dict positionally (``model(x)``) both train and predict; the convention is read
from ``forward``'s signature (``dict_inputs="auto"``), an ambiguous signature is refused naming both conventions
and the ``dict_inputs`` switch, and the switch selects one. The reference: the same network on the concatenated
tensor input, trained from the same seed, must give the same parameters and predictions.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.batches import dict_call_style


class _Net(nn.Module):
    """The reference: one linear layer on the tensor input (B, 3)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


class _Keywords(_Net):
    def forward(self, a, b):  # model(**inputs)
        return self.lin(torch.cat([a, b], dim=1))


class _Positional(_Net):
    def forward(self, batch):  # model(inputs)
        return self.lin(torch.cat([batch["a"], batch["b"]], dim=1))


class _Anything(_Net):
    def forward(self, *args, **kwargs):  # both conventions fit: refused under "auto"
        batch = args[0] if args else kwargs
        return self.lin(torch.cat([batch["a"], batch["b"]], dim=1))


def _data(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    return x, torch.randint(0, 2, (n,), generator=g)


def _loader(style):
    x, y = _data()
    chunks = [(x[i:i + 8], y[i:i + 8]) for i in (0, 8)]
    if style == "tensor":
        return chunks
    if style == "mapping":  # Hugging Face style: the targets under "labels"
        return [{"a": xb[:, :2], "b": xb[:, 2:], "labels": yb} for xb, yb in chunks]
    return [({"a": xb[:, :2], "b": xb[:, 2:]}, yb) for xb, yb in chunks]


def _trained(cls, method, style="pair", **options):
    torch.manual_seed(0)
    net = cls()
    bnn = bw.wrap(net, method, num_data=16, **options)
    torch.manual_seed(1)
    bw.fit(bnn, _loader(style), epochs=2, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1), progress=False)
    x, _ = _data()
    inputs = x if cls is _Net else {"a": x[:, :2], "b": x[:, 2:]}
    torch.manual_seed(2)
    probs = bnn.predict(inputs, num_samples=4 if method == "vi" else 0)
    return bnn, probs


@pytest.mark.parametrize("method", ["map", "vi", "laplace"])
@pytest.mark.parametrize("cls, style", [(_Keywords, "pair"), (_Positional, "pair"), (_Keywords, "mapping"),
                                        (_Positional, "mapping")])
def test_both_model_styles_fit_and_predict_as_the_tensor_model(method, cls, style):
    reference, expected = _trained(_Net, method, "tensor")
    bnn, probs = _trained(cls, method, style)
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(bnn.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.allclose(probs.sum(1), torch.ones(16))


def test_kron_laplace_on_a_positional_dict_model_equals_the_tensor_model():
    reference, expected = _trained(_Net, "laplace", "tensor", hessian_structure="kron")
    bnn, probs = _trained(_Positional, "laplace", hessian_structure="kron")
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dict(bnn.posterior_var.items()), dict(reference.posterior_var.items()), rtol=1e-5,
                               atol=1e-7)


def test_the_convention_is_read_from_the_signature():
    assert dict_call_style(_Keywords(), ("a", "b")) == "kwargs"
    assert dict_call_style(_Positional(), ("a", "b")) == "positional"
    assert dict_call_style(_Net(), ("x",)) == "kwargs"  # the key names forward's one parameter: model(x=...)
    assert dict_call_style(_Net(), ("a", "b")) == "positional"  # forward(x) with other keys: model(inputs)

    class Defaults(nn.Module):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):  # a Hugging Face forward
            return input_ids

    assert dict_call_style(Defaults(), ("input_ids", "attention_mask")) == "kwargs"
    assert dict_call_style(Defaults(), ("attention_mask",)) == "kwargs"  # rule 1, though input_ids is not a key
    assert dict_call_style(Defaults(), ("attention_mask", "extra")) == "kwargs"  # rule 2: **kwargs, input_ids=None

    class Options(nn.Module):
        def forward(self, batch, **options):  # rule 3: batch is required and not a key
            return batch

    assert dict_call_style(Options(), ("a", "b")) == "positional"
    assert dict_call_style(_Anything(), ("a",), "positional") == "positional"
    assert dict_call_style(_Anything(), ("a",), "kwargs") == "kwargs"


def test_an_ambiguous_forward_is_refused_naming_both_conventions_and_the_switch():
    bnn = bw.wrap(_Anything(), "map", num_data=16)
    x, y = _data()
    with pytest.raises(ValueError, match=r"keys \['a', 'b'\] .*_Anything.forward\(\*args, \*\*kwargs\): both fit of "
                                         r"the two conventions, model\(\*\*inputs\) .* and model\(inputs\) .*"
                                         r"dict_inputs='kwargs'\) or bw.wrap\(\.\.\., dict_inputs='positional'\)"):
        bnn.predict({"a": x[:, :2], "b": x[:, 2:]})
    for choice in ("kwargs", "positional"):  # the switch selects one; both give the reference's predictions
        bnn, probs = _trained(_Anything, "map", dict_inputs=choice)
        torch.testing.assert_close(probs, _trained(_Net, "map", "tensor")[1], rtol=1e-5, atol=1e-6)


def test_a_forward_that_fits_neither_convention_is_refused():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, mask):
            return self.lin(x)

    bnn = bw.wrap(Two(), "map", num_data=16)
    x, y = _data()
    with pytest.raises(ValueError, match=r"keys \['a', 'b'\] and the model's forward is .*Two.forward\(x, mask\): "
                                         r"neither fits .*dict_inputs='kwargs'.*dict_inputs='positional'"):
        bw.fit(bnn, [({"a": x[:, :2], "b": x[:, 2:]}, y)], epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), 0.1),
               progress=False)


def test_dict_inputs_values_are_checked_and_saved(tmp_path):
    with pytest.raises(ValueError, match=r"dict_inputs='both' is not accepted; accepted: \('auto', 'kwargs', "
                                         r"'positional'\)"):
        bw.wrap(_Positional(), "map", num_data=16, dict_inputs="both")
    bnn, probs = _trained(_Anything, "map", dict_inputs="positional")
    bw.save(bnn, tmp_path / "m.pt")
    loaded = bw.load(tmp_path / "m.pt", _Anything())
    assert loaded.dict_inputs == "positional"
    x, _ = _data()
    torch.testing.assert_close(loaded.predict({"a": x[:, :2], "b": x[:, 2:]}), probs)
