"""Issue 34, deliverable 3 (training side): every diagnosis names its cause.

Empty batches, regression targets whose scale overflows float32, one-shot iterators read more than once, and
method options of the wrong type (checked from the constructors' annotations) each get an error that names them,
instead of "the initial state itself overflows", "yielded no batches" or a bare ``TypeError``.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.methods.option_types import describe, matches, option_annotations
from bayeswrap.methods.registry import METHODS, method_option_defaults, method_options


def _data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)


def _batches():
    x, y = _data()
    return [(x[:4], y[:4]), (x[4:], y[4:])]


def _wrap(method="map", seed=0, **kwargs):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, kwargs.pop("out", 2)))
    return bw.wrap(net, method, num_data=8, **kwargs)


def _fit(bnn, loader, **kwargs):
    kwargs = {"epochs": 1, "progress": False, **kwargs}
    return bw.fit(bnn, loader, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1), **kwargs)


# ---------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("position", [0, 1])
def test_an_empty_batch_is_refused_naming_the_batch_and_its_shapes(position):
    x, y = _data()
    batches = _batches()
    batches.insert(position, (x[:0], y[:0]))
    bnn = _wrap()
    before = {n: p.detach().clone() for n, p in bnn.named_parameters()}
    with pytest.raises(ValueError, match=rf"train_loader batch {position} of epoch 1 holds 0 examples \(inputs of "
                                         r"shape \(0, 3\), targets of shape \(0,\)\).*0/0 = NaN"):
        _fit(bnn, batches)
    if position == 0:  # refused before the step: no update happened
        assert all(torch.equal(p, before[n]) for n, p in bnn.named_parameters())


def test_an_empty_dict_batch_names_the_input_key():
    x, y = _data()

    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, a):
            return self.lin(a)

    bnn = bw.wrap(Named(), "map", num_data=8)
    with pytest.raises(ValueError, match=r"batch 0 of epoch 1 holds 0 examples \(inputs\['a'\] of shape \(0, 3\)"):
        _fit(bnn, [{"a": x[:0], "labels": y[:0]}])


def test_an_empty_batch_is_refused_by_laplace_curvature_fit():
    x, y = _data()
    bnn = _wrap("laplace")
    with pytest.raises(ValueError, match=r"fit_curvature's loader batch 1 holds 0 examples"):
        bnn.fit_curvature([(x, y), (x[:0], y[:0])])


# ---------------------------------------------------------------------- targets whose scale overflows float32
@pytest.mark.parametrize("scale", [1e30, 2e19])
def test_huge_finite_regression_targets_are_diagnosed_as_their_scale(scale):
    x, _ = _data()
    y = torch.full((8, 1), scale)
    y[0] = 0.5  # max |y| is still ``scale``
    bnn = _wrap(likelihood="gaussian", out=1)
    with pytest.raises(FloatingPointError) as err:
        _fit(bnn, [(x, y)])
    message = str(err.value)
    assert "initial state" not in message
    assert f"max |y| = {scale:.3g}" in message and "targets of shape (8, 1)" in message
    assert f"exceeds float32's largest number {torch.finfo(torch.float32).max:.3g}" in message
    assert "standardise the targets" in message


def test_large_targets_below_the_float32_limit_train():
    """|y| = 1e18 < sqrt(3.4e38) ≈ 1.84e19: the squared error is finite and the loss is the closed form."""
    x, _ = _data()
    y = torch.full((8, 1), 1e18)
    bnn = _wrap(likelihood="gaussian", out=1, prior_std=None)
    with torch.no_grad():
        expected = 0.5 * ((y.double() - bnn.predict(x)[0].double()) ** 2).mean() + 0.5 * math.log(2 * math.pi)
    history = bw.fit(bnn, [(x, y)], epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.0), progress=False)
    assert history[0]["train_nll"] == pytest.approx(float(expected), rel=1e-5)


# ---------------------------------------------------------------------- one-shot iterators
def _generator(batches):
    yield from batches


def test_a_generator_for_several_epochs_is_refused_naming_it():
    bnn = _wrap()
    with pytest.raises(ValueError, match=r"train_loader is a generator, a one-shot iterator .* once per epoch "
                                         r"\(2 epochs to train\).*a torch DataLoader or a list"):
        _fit(bnn, _generator(_batches()), epochs=2)
    with pytest.raises(ValueError, match=r"train_loader is a list_iterator, a one-shot iterator"):
        _fit(bnn, iter(_batches()), epochs=3, start_epoch=1)


def test_a_generator_for_one_epoch_trains_like_a_list():
    trained = []
    for loader in (_batches(), _generator(_batches())):
        bnn = _wrap("map")
        _fit(bnn, loader, epochs=1)
        trained.append(torch.cat([p.detach().flatten() for p in bnn.parameters()]))
    assert torch.equal(trained[0], trained[1])
    bnn = _wrap("map")  # the last epoch of a resumed fit is one pass too
    _fit(bnn, _generator(_batches()), epochs=2, start_epoch=1)


@pytest.mark.parametrize("method", ["laplace", "swag"])
def test_a_generator_is_refused_when_after_fit_reads_it_again(method):
    bnn = _wrap(method, **({"collect_every": 1, "swa_start": 0} if method == "swag" else {}))  # no len() needed
    with pytest.raises(ValueError, match=rf"train_loader is a generator.*1 epoch to train\) and the '{method}' "
                                         r"model's after_fit reads it again"):
        _fit(bnn, _generator(_batches()), epochs=1)
    _fit(bnn, _generator(_batches()), epochs=1, finalize=False)  # one pass: accepted


def test_a_generator_as_val_loader_is_refused_for_several_epochs():
    bnn = _wrap()
    with pytest.raises(ValueError, match=r"val_loader is a generator.*after each of the 2 epochs"):
        _fit(bnn, _batches(), epochs=2, val_loader=_generator(_batches()))
    history = _fit(bnn, _batches(), epochs=1, val_loader=_generator(_batches()))
    assert math.isfinite(history[0]["val_nll"])


def test_laplace_validation_search_and_swag_bn_loader_refuse_generators():
    bnn = _wrap("laplace")
    _fit(bnn, _batches())
    with pytest.raises(ValueError, match=r"val_loader is a generator.*once per prior precision \(3 in the grid\)"):
        bnn.optimize_prior_precision("val", val_loader=_generator(_batches()), grid=[0.1, 1.0, 10.0])
    bnn.optimize_prior_precision("val", val_loader=_generator(_batches()), grid=[1.0])  # one pass: accepted
    assert float(bnn.prior_precision) == 1.0
    swag = _wrap("swag")
    with pytest.raises(ValueError, match=r"loader is a generator.*BatchNorm update iterates it"):
        swag.set_bn_update_loader(_generator(_batches()))


# ---------------------------------------------------------------------- options of the wrong type
#: realistic wrong values, tried in order: the first that an option's annotation refuses is passed to bw.wrap
_WRONG = (True, "x", 3, 2.5, None, (1, 2), [object()], {"a": 1})


def _all_options():
    for method, cls in METHODS.items():
        for name, annotation in option_annotations(cls).items():
            yield method, name, annotation


def test_every_method_option_has_a_checked_annotation():
    for method, cls in METHODS.items():
        annotated = option_annotations(cls)
        assert set(annotated) == set(method_options(method)), method  # every own option is annotated and resolved
        for name, annotation in annotated.items():
            assert any(matches(v, annotation) is False for v in _WRONG), (method, name, annotation)


def test_every_default_passes_its_own_annotation():
    for method in METHODS:
        annotations = option_annotations(METHODS[method])
        for name, default in method_option_defaults(method).items():
            assert matches(default, annotations[name]) is not False, (method, name, default)


@pytest.mark.parametrize("method, name, annotation", list(_all_options()),
                         ids=[f"{m}-{n}" for m, n, _ in _all_options()])
def test_every_option_of_every_method_refuses_a_wrong_type(method, name, annotation):
    value = next(v for v in _WRONG if matches(v, annotation) is False)
    shown = f"{name}={value!r} (of type {type(value).__name__}) is not accepted by method {method!r}; accepted: "
    with pytest.raises(ValueError) as err:
        _wrap(method, **{name: value})
    assert str(err.value).startswith(shown), str(err.value)
    assert describe(annotation) in str(err.value)


@pytest.mark.parametrize("method, kwargs, accepted", [
    ("lbbnn", {"flow_hidden": 10}, r"a tuple \(or list\) of integers \(annotated tuple\[int, \.\.\.\]\)"),
    ("lbbnn", {"init_inclusion_logit": (1.0,)}, r"a tuple \(or list\) of 2: \(a number, a number\)"),
    ("lbbnn", {"flow_hidden": (8, "8")}, r"a tuple \(or list\) of integers"),
    ("vi", {"fused": 1}, r"True or False \(annotated bool\)"),
    ("vi", {"num_train_samples": True}, r"an integer \(annotated int\)"),
    ("mc_dropout", {"layer_p": "0.1"}, r"None or a number"),
    ("sgld", {"sample_device": 0}, r"None or a torch.device or a string|a torch.device or a string or None"),
    ("ensemble", {"member_kwargs": [("init_std", 0.1)]}, r"None or a mapping"),
])
def test_wrong_types_name_the_method_option_value_type_and_kind(method, kwargs, accepted):
    (name, value), = kwargs.items()
    prefix = f"{name}={value!r} (of type {type(value).__name__}) is not accepted by method '{method}'; accepted: "
    with pytest.raises(ValueError, match="^" + re.escape(prefix) + accepted):
        _wrap(method, **kwargs)


def test_a_refusal_quotes_the_options_own_check_with_its_accepted_values():
    with pytest.raises(ValueError, match=r"^burn_in=None \(of type NoneType\) is not accepted by method 'sgld'; "
                                         r"accepted: an integer or a string \(annotated int \| str\); the option's "
                                         r"own check: burn_in=None is not accepted; accepted: 'auto' .* or an "
                                         r"integer >= 0"):
        _wrap("sgld", burn_in=None)
    net = nn.Linear(3, 2)
    state = torch.random.get_rng_state()
    with pytest.raises(ValueError, match=r"^parallel=3 \(of type int\) is not accepted by method 'ensemble'; accepted: "
                                         r"a string \(annotated str\); the option's own check: parallel=3 is not "
                                         r"accepted; accepted: \("):
        bw.wrap(net, "ensemble", num_data=8, parallel=3)  # the build draws init_seed before it checks parallel
    assert torch.equal(torch.random.get_rng_state(), state)  # ... and the refusal leaves the random state as it was


def test_an_ensembles_member_options_are_type_checked():
    with pytest.raises(ValueError, match=r"^fused='yes' \(of type str\) is not accepted by method 'vi'; accepted: "
                                         r"True or False"):
        _wrap("ensemble", member="vi", member_kwargs={"fused": "yes"}, num_members=2)


@pytest.mark.parametrize("method, kwargs, stored", [
    ("vi", {"init_std": np.float32(0.01), "num_train_samples": np.int64(2), "fused": np.bool_(False)},
     {"num_train_samples": 2}),
    ("vi", {"init_std": 1, "num_train_samples": 2.0}, {"num_train_samples": 2}),
    ("lbbnn", {"flow_hidden": [8, np.int64(8)], "init_inclusion_logit": [-1, 2.5], "flow_length": 1},
     {"flow_hidden": (8, 8)}),
    ("sgld", {"sample_device": torch.device("cpu"), "sample_dtype": torch.float64, "burn_in": 0, "thinning": 1},
     {"thinning": 1}),
    ("ensemble", {"reinit": ("*",), "num_members": np.int32(2), "member_kwargs": {"init_std": 0.1}, "member": "vi"},
     {"num_members": 2}),
])
def test_ints_for_floats_numpy_scalars_and_lists_for_tuples_are_accepted(method, kwargs, stored):
    bnn = _wrap(method, **kwargs)
    for name, value in stored.items():
        assert getattr(bnn, name) == value and type(getattr(bnn, name)) is type(value), name
