"""Every bad input raises a clear error naming the value and the accepted ones.

Each numbered section (#1 ... #20) covers one case of the user-testing pass:
silent wrong results, obscure errors, and correct input that used to be refused.
"""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.evaluation import calibration, uncertainty

NAN, INF = float("nan"), float("inf")


def _mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=g)
    y = torch.randint(0, 2, (n,), generator=g)
    return x, y


def _batches():
    x, y = _data()
    return [(x[:4], y[:4]), (x[4:], y[4:])]


def _fit(bnn, batches=None, optimizer=None, **kwargs):
    kwargs = {"epochs": 1, "progress": False, **kwargs}
    optimizer = optimizer or torch.optim.SGD(bnn.parameters(), lr=0.1)
    return bw.fit(bnn, _batches() if batches is None else batches, optimizer=optimizer, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"method": "nuts"}, r"method='nuts' is not known; accepted: \('map', 'vi', 'ivon', 'mc_dropout', 'sgld', 'swag', 'laplace'"),
    ({"likelihood": "poisson"}, r"likelihood='poisson' is not known; accepted: \('categorical', 'gaussian', 'heteroscedastic', 'causal_lm', 'token_categorical'\)"),
    ({"bias": "gaussian"}, r"bias='gaussian' is not accepted by method 'vi'; accepted: \('informative', 'uninf"),
    ({"prior_std": 0.0}, r"prior_std=0.0 must be a number in \[1e-18, 1e\+18\]"),
    ({"prior_std": -1}, r"prior_std=-1 must be a number in \[1e-18, 1e\+18\]"),
    ({"prior_std": None}, r"prior_std=None \(no prior\) is only accepted by method 'map'"),
    ({"num_data": 0}, r"num_data=0 must be an integer >= 1"),
    ({"params": ["head.*"]}, r"params pattern 'head.\*' matches no trainable parameter"),
    ({"prior_mean": "pretrained"}, r"prior_mean='pretrained' is not accepted; accepted: \('init', 'zero'"),
    ({"prior_mean": {"0.weight": torch.zeros(4, 3)}}, r"prior_mean mapping .* missing \['0.bias'"),
    ({"init_std": -0.1}, r"init_std=-0.1 must be a number in \[1e-18, 1e\+18\]"),
    ({"p_drop": 0.1}, r"option\(s\) \['p_drop'\] are not accepted by method 'vi'; accepted: \('kl_weight'"),
])
def test_wrap_rejects(kwargs, match):
    args = {"method": "vi", "num_data": 10, **kwargs}
    method = args.pop("method")
    with pytest.raises(ValueError, match=match):
        bw.wrap(_mlp(), method, **args)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_p_drop_outside_unit_interval(p):
    with pytest.raises(ValueError, match=rf"p_drop={p} must be a number in \[0, 1\)"):
        bw.wrap(_mlp(), "mc_dropout", num_data=10, p_drop=p)


def test_mc_dropout_bias_options_listed():
    with pytest.raises(ValueError, match=r"accepted: \('informative', 'uninformative', 'gaussian', 'spikymix', 'ign"):
        bw.wrap(_mlp(), "mc_dropout", num_data=10, bias="penalty")


def test_laplace_predict_before_fit_curvature():
    bnn = bw.wrap(_mlp(), "laplace", num_data=10)
    with pytest.raises(bw.NotFittedError, match=r"call bnn.fit_curvature\(train_loader\) first"):
        bnn.predict(torch.randn(2, 3))
    with pytest.raises(bw.NotFittedError):
        bnn.predict(torch.randn(2, 3), num_samples=0)


def test_sgld_predict_before_any_sample():
    bnn = bw.wrap(_mlp(), "sgld", num_data=10, burn_in=100)
    with pytest.raises(bw.NotFittedError, match="no SGLD sample has been kept yet.*burn_in=100"):
        bnn.predict(torch.randn(2, 3))


@pytest.mark.parametrize("labels", [[0, 2], [-1, 0]])
def test_labels_out_of_range(labels):
    bnn = bw.wrap(_mlp(), "map", num_data=10)
    with pytest.raises(ValueError, match=rf"class label {labels[-1] if labels[-1] == 2 else -1} is out of range; "
                                         r"accepted: integers in \[0, 1\]"):
        bnn.loss(torch.randn(2, 3), torch.tensor(labels))


def test_bad_num_samples():
    bnn = bw.wrap(_mlp(), "vi", num_data=10)
    with pytest.raises(ValueError, match="num_samples=-1 must be an integer >= 0"):
        bnn.predict(torch.randn(2, 3), num_samples=-1)


def test_gaussian_targets_must_match_outputs():
    bnn = bw.wrap(_mlp(), "vi", num_data=10, likelihood="gaussian")
    with pytest.raises(ValueError, match=r"targets have shape \(2,\), outputs have shape \(2, 2\)"):
        bnn.loss(torch.randn(2, 3), torch.randn(2))
    with pytest.raises(ValueError, match=r"noise_std=0 must be a number in \[1e-18, 1e\+18\]"):
        bw.wrap(_mlp(), "vi", num_data=10, likelihood="gaussian", noise_std=0)


def test_unknown_curvature():
    with pytest.raises(ValueError,
                       match=r"curvature='kfac' is not known; accepted: \('ggn', 'fisher', 'empirical_fisher'\)"):
        bw.wrap(_mlp(), "laplace", num_data=10, curvature="kfac")


@pytest.mark.parametrize("option, value, match", [
    ("shift_rotations", "0,abc", r"shift_rotations='0,abc': 'abc' is not valid; accepted: comma-separated finite"),
    ("shift_rotations", "0,inf", r"shift_rotations='0,inf': 'inf' is not valid"),
    ("shift_noise", "0,-0.1", r"shift_noise='0,-0.1': '-0.1' is not valid; accepted: comma-separated finite numbers >= 0"),
    ("shift_noise", "nan", r"shift_noise='nan': 'nan' is not valid"),
    ("ood_classes", "8,1.5", r"ood_classes='8,1.5': '1.5' is not valid; accepted: comma-separated integers >= 0, or auto"),
    ("ood_classes", "-1", r"ood_classes='-1': '-1' is not valid"),
])
def test_evaluation_options_rejected_before_anything_runs(option, value, match):
    from bayeswrap.app.config import resolve

    with pytest.raises(ValueError, match=match):
        resolve(None, {option: value})


def test_held_out_classes_out_of_range_or_all(tmp_path):
    import bayeswrap.app.cli as cli

    assert cli.main(["fit", "--ood-classes", "3,12", "--epochs", "1", "--out-dir", str(tmp_path)]) == 2
    assert not (tmp_path / "digits-mlp-vi").exists()  # refused before the run folder is made
    from bayeswrap.data.datasets import load_data
    from bayeswrap.data.shift import hold_out_classes

    with pytest.raises(ValueError, match=r"12"):
        hold_out_classes(load_data("digits"), [3, 12])
    with pytest.raises(ValueError, match=r"at least one class kept"):
        hold_out_classes(load_data("digits"), list(range(10)))


def test_yaml_lists_for_list_options(tmp_path):
    from bayeswrap.app.config import resolve

    path = tmp_path / "c.yaml"
    path.write_text("shift_rotations: [0, 90]\nshift_noise: []\nood_classes: [1, 2]\n")
    cfg = resolve(str(path), {})
    assert cfg.rotation_angles() == (0.0, 90.0) and cfg.noise_stds() == () and cfg.held_out_classes() == (1, 2)


# ---------------------------------------------------------------------- #1 grad_clip_norm
@pytest.mark.parametrize("value, shown", [(-1, "-1"), (0, "0"), (-0.5, "-0.5"), (NAN, "nan"), (INF, "inf"),
                                          ("1.0", "'1.0'")])
def test_grad_clip_norm_must_be_positive_and_finite(value, shown):
    bnn = bw.wrap(_mlp(), "map", num_data=8)
    before = [p.detach().clone() for p in bnn.parameters()]
    with pytest.raises(ValueError, match=rf"grad_clip_norm={shown} must be None or a finite number > 0"):
        _fit(bnn, grad_clip_norm=value)
    assert all(torch.equal(a, b) for a, b in zip(before, bnn.parameters()))  # refused before any step


def test_grad_clip_norm_none_or_positive_trains():
    for value in (None, 1.0, np.float32(2.0)):
        assert len(_fit(bw.wrap(_mlp(), "map", num_data=8), grad_clip_norm=value)) == 1


# ---------------------------------------------------------------------- #2 NaN from the last step
@pytest.mark.parametrize("lr", [NAN, INF])
def test_non_finite_parameters_after_the_last_step_raise(lr):
    bnn = bw.wrap(_mlp(), "map", num_data=8)
    with pytest.raises(FloatingPointError, match=r"parameter '0\.weight' \(theta\) contains NaN or inf after epoch 1"):
        _fit(bnn, batches=_batches()[:1], optimizer=torch.optim.SGD(bnn.parameters(), lr=lr))


def test_non_finite_parameters_mid_epoch_are_diagnosed_as_a_diverged_update():
    bnn = bw.wrap(_mlp(), "vi", num_data=8)
    with pytest.raises(FloatingPointError, match=r"epoch 1, step 2: parameter '0\.weight' \(mean\) became non-finite "
                                                 r"in the last update \(optimizer step 1 of this fit\)"):
        _fit(bnn, optimizer=torch.optim.SGD(bnn.parameters(), lr=NAN))


def test_non_finite_parameters_in_a_later_epoch_name_that_epoch():
    bnn = bw.wrap(_mlp(), "map", num_data=8)
    opt = torch.optim.SGD(bnn.parameters(), lr=0.1)

    def poison(epoch, record):
        opt.param_groups[0]["lr"] = NAN

    with pytest.raises(FloatingPointError, match=r"'0\.weight' \(theta\) contains NaN or inf after epoch 2"):
        _fit(bnn, batches=_batches()[:1], optimizer=opt, epochs=2, on_epoch_end=poison)


# ---------------------------------------------------------------------- #3 NaN example in Laplace's curvature
@pytest.mark.parametrize("curvature", ["ggn", "fisher", "empirical_fisher"])
def test_laplace_curvature_refuses_a_nan_example(curvature):
    bnn = bw.wrap(_mlp(), "laplace", num_data=8, curvature=curvature)
    x, y = _data()
    x[6, 1] = NAN
    with pytest.raises(ValueError, match=r"the log-likelihood of batch 1 is non-finite: its input x \(shape \(4, 3\)\) "
                                         r"contains 1 non-finite values"):
        bnn.fit_curvature([(x[:4], y[:4]), (x[4:], y[4:])])
    assert not bnn.is_ready()  # nothing half-fitted: no variance silently set to 0


def test_laplace_curvature_with_non_finite_map_parameters():
    bnn = bw.wrap(_mlp(), "laplace", num_data=8)
    with torch.no_grad():
        bnn.theta["2.weight"][0, 0] = INF
    with pytest.raises(FloatingPointError, match=r"batch 0 is non-finite: the MAP parameter '2\.weight' contains NaN"):
        bnn.fit_curvature(_batches())
    assert not bnn.is_ready()


def test_laplace_curvature_refuses_non_finite_regression_targets():
    bnn = bw.wrap(_mlp(), "laplace", num_data=8, likelihood="gaussian")
    x, _ = _data()
    y = torch.randn(8, 2)
    y[2, 0] = NAN
    with pytest.raises(ValueError, match=r"batch 0 is non-finite: its targets contain 1 non-finite values"):
        bnn.fit_curvature([(x, y)])


# ---------------------------------------------------------------------- #4 categorical outputs must be (B, K)
class _Shaped(nn.Module):
    """A linear model whose output is reshaped to a wrong (or right) shape."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(3, 1 if kind == "b1" else 2)

    def forward(self, x):
        out = self.lin(x)
        return {"bk1": out.unsqueeze(-1), "b": out[:, 0], "b1": out, "bk": out, "b1k": out.unsqueeze(1)}[self.kind]


_SHAPES = [("bk1", r"\(4, 2, 1\); squeeze the trailing dimension"), ("b", r"\(4,\); for binary classification"),
           ("b1", r"\(4, 1\); a single class has probability 1"), ("b1k", r"\(4, 1, 2\); flatten the extra")]


@pytest.mark.parametrize("kind, match", _SHAPES)
@pytest.mark.parametrize("call", ["predict", "predict_mean", "sample_probs_loader", "loss"])
def test_categorical_outputs_must_be_logits_of_shape_b_k(kind, match, call):
    bnn = bw.wrap(_Shaped(kind), "vi", num_data=8)
    x, y = _data(4)
    calls = {"predict": lambda: bnn.predict(x, num_samples=3), "predict_mean": lambda: bnn.predict(x, num_samples=0),
             "sample_probs_loader": lambda: bw.sample_probs_loader(bnn, [(x, y)], 2),
             "loss": lambda: bnn.loss(x, y)}
    with pytest.raises(ValueError, match=r"the categorical likelihood needs logits of shape \(B, K\) with K >= 2 "
                                         r"classes, but the model returned shape " + match):
        calls[call]()


def test_laplace_probit_predictive_checks_the_output_shape():
    bnn = bw.wrap(_Shaped("bk"), "laplace", num_data=8)
    x, y = _data(4)
    bnn.fit_curvature([(x, y)])
    bnn.model.kind = "bk1"  # the storage-free copy is what runs
    with pytest.raises(ValueError, match=r"model returned shape \(4, 2, 1\)"):
        bnn.predict(x)


def test_model_that_returns_a_dict_without_the_output_key_is_a_type_error():
    class Dict(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            return {"scores": self.lin(x)}

    x = _data(4)[0]
    with pytest.raises(TypeError, match=r"the model returned a dict with keys \['scores'\] and no tensor under "
                                        r"output_key='logits'; accepted: set output_key="):
        bw.wrap(Dict(), "map", num_data=8).predict(x)
    model = Dict()
    bnn = bw.wrap(model, "map", num_data=8, output_key="scores")
    torch.testing.assert_close(bnn.predict(x, num_samples=0), model(x)["scores"].softmax(-1))


def test_gaussian_likelihood_keeps_one_dimensional_outputs():
    bnn = bw.wrap(_Shaped("b"), "vi", num_data=8, likelihood="gaussian")
    x, _ = _data(4)
    mean, var = bnn.predict(x, num_samples=3)
    assert mean.shape == (4,) and var.shape == (4,) and bool(torch.all(var >= 1.0))
    assert torch.isfinite(bnn.loss(x, torch.randn(4)).loss)


# ---------------------------------------------------------------------- #5 early_stopping_patience
@pytest.mark.parametrize("value, shown", [(-1, "-1"), (1.5, "1.5"), (NAN, "nan"), ("2", "'2'"), (True, "True")])
def test_early_stopping_patience_must_be_none_or_a_non_negative_integer(value, shown):
    bnn = bw.wrap(_mlp(), "map", num_data=8)
    with pytest.raises(ValueError, match=rf"early_stopping_patience={shown} must be None or an integer >= 0"):
        _fit(bnn, val_loader=_batches(), early_stopping_patience=value, epochs=3)


def test_early_stopping_patience_zero_is_accepted():
    history = _fit(bw.wrap(_mlp(), "map", num_data=8), val_loader=_batches(), early_stopping_patience=0, epochs=3)
    assert 1 <= len(history) <= 3


# ---------------------------------------------------------------------- #6 start_epoch
@pytest.mark.parametrize("value, shown", [(2, "2"), (3, "3"), (-1, "-1"), (0.5, "0.5"), (NAN, "nan")])
def test_start_epoch_must_lie_in_0_to_epochs(value, shown):
    bnn = bw.wrap(_mlp(), "map", num_data=8)
    with pytest.raises(ValueError, match=rf"start_epoch={shown} must be an integer in \[0, 1\] .*epochs=2"):
        _fit(bnn, epochs=2, start_epoch=value)


def test_start_epoch_resumes_the_last_epoch():
    assert [h["epoch"] for h in _fit(bw.wrap(_mlp(), "map", num_data=8), epochs=2, start_epoch=1)] == [2]


# ---------------------------------------------------------------------- #7 optimizers over other parameters
def test_optimizer_over_the_wrapped_model_trains_nothing_and_is_refused():
    model = _mlp()
    bnn = bw.wrap(model, "map", num_data=8)
    with pytest.raises(ValueError, match=r"the optimizer holds none of bnn's trainable parameters \(4 other tensors"):
        _fit(bnn, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_optimizer_with_extra_parameters_is_refused():
    bnn = bw.wrap(_mlp(), "vi", num_data=8)
    extra = nn.Parameter(torch.zeros(5))
    with pytest.raises(ValueError, match=r"the optimizer holds 1 tensor\(s\) that are not parameters of bnn "
                                         r"\(shapes \[\(5,\)\]\)"):
        _fit(bnn, optimizer=torch.optim.Adam([*bnn.parameters(), extra]))


def test_ivon_optimizer_of_another_model_is_refused_and_its_own_accepted():
    bnn, other = bw.wrap(_mlp(), "ivon", num_data=8), bw.wrap(_mlp(), "ivon", num_data=8)
    with pytest.raises(ValueError, match=r"the optimizer holds none of bnn's trainable parameters"):
        _fit(bnn, optimizer=bw.optim.IVON(other.param_groups(), lr=0.1))
    before = bnn.mean["0.weight"].detach().clone()
    _fit(bnn, optimizer=bw.optim.IVON(bnn.param_groups(), lr=0.1))
    assert not torch.equal(before, bnn.mean["0.weight"])


def test_optimizer_after_load_state_dict_assign_is_refused():
    bnn = bw.wrap(_mlp(), "map", num_data=8)
    opt = torch.optim.SGD(bnn.parameters(), lr=0.1)
    bnn.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in bnn.state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match=r"the optimizer holds none of bnn's trainable parameters"):
        _fit(bnn, optimizer=opt)


@pytest.mark.parametrize("optimizer, shown", [(None, "NoneType"), ("sgd", "str")])
def test_optimizer_must_be_a_torch_optimizer(optimizer, shown):
    bnn = bw.wrap(_mlp(), "map", num_data=8)
    with pytest.raises(ValueError, match=rf"optimizer must be a torch.optim.Optimizer .*got {shown}"):
        bw.fit(bnn, _batches(), epochs=1, optimizer=optimizer, progress=False)


def test_sgld_optimizer_num_data_must_match_the_model():
    bnn = bw.wrap(_mlp(), "sgld", num_data=8, burn_in=0, thinning=1)
    with pytest.raises(ValueError, match=r"SGLD optimizer's num_data=80 \(param group 0\) differs from the model's "
                                         r"num_data=8"):
        _fit(bnn, optimizer=bw.optim.SGLD(bnn.parameters(), lr=0.01, num_data=80))


# ---------------------------------------------------------------------- #8 optimizer hyper-parameters
@pytest.mark.parametrize("kwargs, match", [
    ({"lr": INF}, r"lr=inf must be a finite number > 0 \(bayeswrap.optim.SGLD\)"),
    ({"lr": NAN}, r"lr=nan must be a finite number > 0"),
    ({"lr": 0}, r"lr=0 must be a finite number > 0"),
    ({"lr": "0.1"}, r"lr='0.1' must be a finite number > 0 .*not str"),
    ({"noise_scale": NAN}, r"noise_scale=nan must be a finite number >= 0"),
    ({"noise_scale": INF}, r"noise_scale=inf must be a finite number >= 0"),
    ({"noise_scale": -1}, r"noise_scale=-1 must be a finite number >= 0"),
    ({"num_data": 2.5}, r"num_data=2.5 must be an integer >= 1"),
    ({"num_data": NAN}, r"num_data=nan must be an integer >= 1"),
    ({"num_data": 0}, r"num_data=0 must be an integer >= 1"),
])
def test_sgld_optimizer_hyper_parameters(kwargs, match):
    params = list(bw.wrap(_mlp(), "sgld", num_data=8).parameters())
    with pytest.raises(ValueError, match=match):
        bw.optim.SGLD(params, **{"lr": 0.01, "num_data": 8, **kwargs})


def test_sgld_optimizer_checks_group_overrides():
    params = list(bw.wrap(_mlp(), "sgld", num_data=8).parameters())
    with pytest.raises(ValueError, match=r"lr=inf must be a finite number > 0 \(bayeswrap.optim.SGLD \(param group 1\)"):
        bw.optim.SGLD([{"params": params[:2]}, {"params": params[2:], "lr": INF}], lr=0.01, num_data=8)
    opt = bw.optim.SGLD(params, lr=np.float32(0.01), num_data=np.int64(8))
    assert opt.param_groups[0]["num_data"] == 8 and type(opt.param_groups[0]["num_data"]) is int


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": INF}, r"lr=inf must be a finite number > 0 \(bayeswrap.optim.IVON\)"),
    ({"beta1": NAN}, r"beta1=nan must be a number in \[0, 1\)"),
    ({"beta2": INF}, r"beta2=inf must be a number in \[0, 1\]"),
    ({"clip_radius": NAN}, r"clip_radius=nan must be a number > 0"),
    ({"clip_radius": -INF}, r"clip_radius=-inf must be a number > 0"),
])
def test_ivon_optimizer_hyper_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.optim.IVON(bw.wrap(_mlp(), "ivon", num_data=8).param_groups(), **{"lr": 0.1, **kwargs})


# ---------------------------------------------------------------------- #9 NaN weights, prior means, checkpoints, inputs
@pytest.mark.parametrize("value", [NAN, INF])
def test_wrap_refuses_non_finite_weights(value):
    model = _mlp()
    with torch.no_grad():
        model[2].bias[1] = value
    with pytest.raises(ValueError, match=r"the model's parameter '2\.bias' contains 1 non-finite values"):
        bw.wrap(model, "vi", num_data=8)


def test_wrap_refuses_a_nan_buffer_but_keeps_minus_inf_masks():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[1].running_mean[0] = NAN
    with pytest.raises(ValueError, match=r"the model's buffer '1\.running_mean' contains NaN"):
        bw.wrap(model, "map", num_data=8)
    model[1].running_mean.zero_()
    model.register_buffer("mask", torch.tensor([0.0, -INF]))
    assert bw.wrap(model, "map", num_data=8).predict(_data(4)[0]).shape == (4, 2)


def test_wrap_refuses_a_nan_prior_mean():
    mean = {"2.weight": torch.zeros(2, 4), "2.bias": torch.tensor([0.0, NAN])}
    with pytest.raises(ValueError, match=r"prior_mean\['2\.bias'\] contains 1 non-finite values"):
        bw.wrap(_mlp(), "vi", num_data=8, params=["2.*"], prior_mean=mean)


@pytest.mark.parametrize("method", ["map", "vi", "laplace", "sgld"])
def test_load_state_dict_refuses_non_finite_values(method):
    bnn = bw.wrap(_mlp(), method, num_data=8)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in bnn.state_dict().items()}
    key = next(k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and v.numel() > 1)
    state[key].view(-1)[0] = NAN
    with pytest.raises(ValueError, match=rf"state_dict\['{key}'\] contains 1 non-finite values"):
        bnn.load_state_dict(state)


def test_load_state_dict_accepts_laplace_unknown_log_likelihood():
    bnn = bw.wrap(_mlp(), "laplace", num_data=8)
    state = bnn.state_dict()
    state["train_log_likelihood"] = torch.tensor(NAN, dtype=torch.float64)
    bnn.load_state_dict(state)
    assert math.isnan(float(bnn.train_log_likelihood))


def _ready(method):
    bnn = bw.wrap(_mlp(), method, num_data=8, **({"burn_in": 0, "thinning": 1} if method == "sgld" else {}))
    opt = (bw.optim.SGLD(bnn.parameters(), lr=1e-3, num_data=8) if method == "sgld"
           else bw.optim.IVON(bnn.param_groups(), lr=0.01) if method == "ivon"
           else torch.optim.SGD(bnn.parameters(), lr=0.01))
    _fit(bnn, optimizer=opt)
    return bnn.eval()


@pytest.mark.parametrize("value, shown", [(NAN, "1 non-finite"), (INF, "1 non-finite")])
@pytest.mark.parametrize("method", ["map", "vi", "mc_dropout", "laplace", "sgld", "ivon"])
def test_predict_refuses_non_finite_inputs(method, value, shown):
    bnn = _ready(method)
    x = _data(4)[0]
    x[3, 2] = value
    with pytest.raises(ValueError, match=rf"x \(shape \(4, 3\)\) contains {shown} values \(NaN or inf\)"):
        bnn.predict(x)


@pytest.mark.parametrize("method", ["vi", "laplace", "sgld"])
def test_sample_logits_refuses_non_finite_inputs(method):
    bnn = _ready(method)
    with pytest.raises(ValueError, match=r"x \(shape \(2, 3\)\) contains 6 non-finite values"):
        bnn.sample_logits(torch.full((2, 3), -INF), 2)


def test_fit_says_the_input_batch_is_non_finite():
    bnn = bw.wrap(_mlp(), "vi", num_data=8)
    x, y = _data()
    x[0, 0] = NAN
    with pytest.raises(FloatingPointError, match=r"non-finite loss nan .* at epoch 1, step 1: the input batch contains "
                                                 r"1 non-finite values"):
        _fit(bnn, batches=[(x, y)])


def test_fit_says_the_parameters_were_non_finite_before_any_update():
    bnn = bw.wrap(_mlp(), "map", num_data=8)
    with torch.no_grad():
        bnn.theta["0.weight"][0, 0] = NAN
    with pytest.raises(FloatingPointError, match=r"parameter '0\.weight' \(theta\) was already non-finite before the "
                                                 r"first update"):
        _fit(bnn)


# ---------------------------------------------------------------------- #10 scales whose derived values overflow float32
@pytest.mark.parametrize("method, kwargs, match", [
    ("vi", {"prior_std": 1e-300}, r"prior_std=1e-300 must be a number in \[1e-18, 1e\+18\]"),
    ("map", {"prior_std": 1e300}, r"prior_std=1e\+300 must be a number in \[1e-18, 1e\+18\]"),
    ("vi", {"init_std": 1e-300}, r"init_std=1e-300 must be a number in \[1e-18, 1e\+18\]"),
    ("vi", {"kl_weight": 1e-300}, r"kl_weight=1e-300 must be 0 or a number in \[1e-18, 1e\+18\]"),
    ("vi", {"likelihood": "gaussian", "noise_std": 1e-300}, r"noise_std=1e-300 must be a number in \[1e-18"),
    ("sparse_vd", {"init_log_var": 200}, r"init_log_var=200 must be a number in \[-80, 80\]"),
    ("sparse_vd", {"init_log_var": -200}, r"init_log_var=-200 must be a number in \[-80, 80\]"),
    ("kingma_vd", {"init_log_alpha": -200}, r"init_log_alpha=-200 must be a number in \[-80, 0\]"),
    ("kingma_vd", {"init_log_alpha": 1}, r"init_log_alpha=1 must be a number in \[-80, 0\]"),
    ("ivon", {"hess_init": 1e300}, r"hess_init=1e\+300 must be a number in \(0, 3.40282e\+38\]"),
    ("ivon", {"hess_init": 1e38}, r"hess_init=1e\+38 gives an initial posterior precision λ\(h₀ \+ δ\) = 8e\+38 "
                                  r"\(num_data=8, kl_weight=1\) that float32 cannot hold; accepted: hess_init in \(0, "),
    ("ivon", {"hess_init": NAN}, r"hess_init=nan must be a number in \(0, 3.40282e\+38\]"),
    ("mc_dropout", {"p_drop": NAN}, r"p_drop=nan must be a number in \[0, 1\)"),
    ("sgld", {"exploration": INF, "cycles": 2}, r"exploration=inf must be a number in \[0, 1\)"),
])
def test_scales_whose_derived_quantities_overflow_are_refused(method, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.wrap(_mlp(), method, num_data=8, **kwargs)


def test_scales_at_the_ends_of_the_range_give_a_finite_first_loss():
    x, y = _data()
    for kwargs in ({"prior_std": 1e-18}, {"prior_std": 1e18}, {"init_std": 1e-18}, {"init_std": 1e18}):
        assert torch.isfinite(bw.wrap(_mlp(), "vi", num_data=8, **kwargs).loss(x, y).loss), kwargs
    for v in (-80, 80):
        assert torch.isfinite(bw.wrap(_mlp(), "sparse_vd", num_data=8, init_log_var=v).loss(x, y).loss), v


# ---------------------------------------------------------------------- #11 integer options are not truncated
@pytest.mark.parametrize("value, shown", [(2.7, "2.7"), (True, "True"), (NAN, "nan"), (INF, "inf"), ("3", "'3'"),
                                          (0, "0")])
@pytest.mark.parametrize("option", ["chunk_size", "num_train_samples"])
def test_integer_options_are_not_truncated(option, value, shown):
    with pytest.raises(ValueError, match=rf"{option}={shown} must be an integer >= 1"):
        bw.wrap(_mlp(), "vi", num_data=8, **{option: value})


@pytest.mark.parametrize("value", [3.0, np.int64(3), np.int32(3), torch.tensor(3)])
def test_integral_floats_and_numpy_integers_are_accepted(value):
    bnn = bw.wrap(_mlp(), "vi", num_data=8, chunk_size=value, num_train_samples=value)
    assert (bnn.chunk_size, bnn.num_train_samples) == (3, 3) and type(bnn.chunk_size) is int


# ---------------------------------------------------------------------- #12 NaN, inf and strings in integer options
_SGLD = {"burn_in": 0, "thinning": 1}


@pytest.mark.parametrize("method, kwargs, match", [
    ("vi", {"num_data": NAN}, r"num_data=nan must be an integer >= 1 \(the training-set size N\)"),
    ("vi", {"num_data": INF}, r"num_data=inf must be an integer >= 1"),
    ("vi", {"num_data": "10"}, r"num_data='10' must be an integer >= 1 .*not str"),
    ("mc_dropout", {"num_train_samples": NAN}, r"num_train_samples=nan must be an integer >= 1"),
    ("sparse_vd", {"num_train_samples": "2"}, r"num_train_samples='2' must be an integer >= 1"),
    ("sgld", {"thinning": NAN}, r"thinning=nan must be an integer >= 1"),
    ("sgld", {"burn_in": INF}, r"burn_in=inf is not accepted; accepted: 'auto' .* or an integer >= 0"),
    ("sgld", {"max_samples": "5"}, r"max_samples='5' must be an integer >= 0"),
    ("sgld", {"cycles": 1.5}, r"cycles=1.5 must be None or an integer >= 1"),
    ("laplace", {"curvature_chunk_size": NAN}, r"curvature_chunk_size=nan must be an integer >= 1"),
    ("laplace", {"curvature_samples": "2"}, r"curvature_samples='2' must be an integer >= 1"),
])
def test_integer_options_of_every_method_name_nan_inf_and_strings(method, kwargs, match):
    with pytest.raises(ValueError, match=match):
        bw.wrap(_mlp(), method, num_data=kwargs.pop("num_data", 8), **kwargs)


@pytest.mark.parametrize("option, value, shown, accepted", [
    ("epochs", NAN, "nan", "an integer >= 1"),
    ("epochs", "3", "'3'", "an integer >= 1"),
    ("epochs", 0, "0", "an integer >= 1"),
    ("val_num_samples", INF, "inf", "an integer >= 0"),
    ("val_num_samples", -1, "-1", "an integer >= 0"),
])
def test_fit_integer_options(option, value, shown, accepted):
    with pytest.raises(ValueError, match=rf"{option}={shown} must be {accepted}"):
        _fit(bw.wrap(_mlp(), "map", num_data=8), **{option: value})


@pytest.mark.parametrize("call, match", [
    (lambda b, x: b.predict(x, num_samples=NAN), r"num_samples=nan must be an integer >= 0"),
    (lambda b, x: b.predict(x, num_samples=INF), r"num_samples=inf must be an integer >= 0"),
    (lambda b, x: b.predict(x, num_samples="5"), r"num_samples='5' must be an integer >= 0, not str"),
    (lambda b, x: b.sample_logits(x, 2.5), r"num_samples=2.5 must be an integer >= 1"),
    (lambda b, x: b.sample_logits(x, 0), r"num_samples=0 must be an integer >= 1"),
    (lambda b, x: b.sample(NAN), r"num_samples=nan must be an integer >= 1"),
    (lambda b, x: bw.evaluate(b, [(x, torch.zeros(4, dtype=torch.long))], NAN), r"num_samples=nan must be an integer"),
    (lambda b, x: bw.sample_probs_loader(b, [(x, torch.zeros(4, dtype=torch.long))], "3"),
     r"num_samples='3' must be an integer >= 0"),
    (lambda b, x: bw.predict_loader(b, [(x, torch.zeros(4, dtype=torch.long))], -2),
     r"num_samples=-2 must be an integer >= 0"),
])
def test_predictive_integer_options(call, match):
    with pytest.raises(ValueError, match=match):
        call(bw.wrap(_mlp(), "vi", num_data=8), _data(4)[0])


def test_laplace_tuning_integer_options():
    bnn = bw.wrap(_mlp(), "laplace", num_data=8)
    bnn.fit_curvature(_batches())
    with pytest.raises(ValueError, match=r"num_samples=nan must be an integer >= 1"):
        bnn.optimize_prior_precision("val", val_loader=_batches(), num_samples=NAN)
    with pytest.raises(ValueError, match=r"seed='0' must be an integer"):
        bnn.optimize_prior_precision("val", val_loader=_batches(), seed="0")
    with pytest.raises(ValueError, match=r"grid\[0\]=nan must be a number in \[1e-36, 1e\+36\]"):
        bnn.optimize_prior_precision("val", val_loader=_batches(), grid=[NAN])


def test_prune_random_count():
    bnn = bw.wrap(_mlp(), "vi", num_data=8)
    with pytest.raises(ValueError, match=r"count=nan must be an integer >= 0"):
        bnn.prune_random(NAN)
    with pytest.raises(ValueError, match=r"count=2.5 must be an integer >= 0"):
        bnn.prune_random(2.5)


# ---------------------------------------------------------------------- #13 params=[]
@pytest.mark.parametrize("params, shown", [([], r"\[\]"), ((), r"\(\)")])
def test_empty_params_list_selects_nothing(params, shown):
    with pytest.raises(ValueError, match=rf"params={shown} is an empty list, which selects no parameter; accepted: "
                                         r"None \(every trainable parameter\), a non-empty list of glob patterns"):
        bw.wrap(_mlp(), "vi", num_data=8, params=params)


# ---------------------------------------------------------------------- #14 meta device
def test_meta_model_is_refused_at_wrap():
    with torch.device("meta"):
        model = _mlp()
    with pytest.raises(ValueError, match=r"the model's tensors are on the 'meta' device \(e\.g\. \['0\.weight'"):
        bw.wrap(model, "vi", num_data=8)


def test_lazy_model_is_refused_at_wrap():
    model = nn.Sequential(nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"uninitialised \(lazy\) tensors, e\.g\. \['0\.weight'"):
        bw.wrap(model, "map", num_data=8)


# ---------------------------------------------------------------------- #15 batches that are not pairs
@pytest.mark.parametrize("batch, got", [
    (lambda x, y: (x, y, y), r"a tuple of length 3; accepted: \(inputs, targets\) pairs"),
    (lambda x, y: [x], r"a list of length 1; accepted: \(inputs, targets\) pairs"),
    (lambda x, y: {"image": x, "label": y}, r"a dict with keys \['image', 'label'\] and no key 'labels' \(the "
                                            r"targets\); accepted: a mapping with the targets under "
                                            r"label_key='labels'.*or \(inputs, targets\) pairs"),
    (lambda x, y: x, r"a single tensor of shape \(8, 3\); accepted: \(inputs, targets\) pairs"),
])
def test_fit_needs_input_target_pairs(batch, got):
    bnn = bw.wrap(_mlp(), "map", num_data=8)
    with pytest.raises(ValueError, match=rf"train_loader batch 0 of epoch 1 yielded {got}"):
        _fit(bnn, batches=[batch(*_data())])


def test_predict_loader_and_fit_curvature_need_pairs():
    x, y = _data()
    bnn = bw.wrap(_mlp(), "laplace", num_data=8)
    with pytest.raises(ValueError, match=r"fit_curvature's loader batch 0 yielded a dict with keys \['x', 'y'\]"):
        bnn.fit_curvature([{"x": x, "y": y}])
    vi = bw.wrap(_mlp(), "vi", num_data=8)
    with pytest.raises(ValueError, match=r"the loader's batch 1 yielded a tuple of length 3"):
        bw.evaluate(vi, [(x, y), (x, y, y)])


# ---------------------------------------------------------------------- #16 autocast_dtype
@pytest.mark.parametrize("value", ["bf16", "bfloat16", "BF16", torch.bfloat16])
def test_autocast_dtype_accepts_bfloat16_and_its_aliases(value):
    assert len(_fit(bw.wrap(_mlp(), "map", num_data=8), autocast_dtype=value)) == 1


@pytest.mark.parametrize("value, shown", [("fp8", "'fp8'"), (torch.float32, "torch.float32"), ("float32", "'float32'"),
                                          (16, "16")])
def test_autocast_dtype_lists_the_accepted_values(value, shown):
    with pytest.raises(ValueError, match=rf"autocast_dtype={shown} is not accepted; accepted: None, torch.bfloat16, "
                                         r"torch.float16, or the aliases 'bf16'/'bfloat16' and 'fp16'/'float16'"):
        _fit(bw.wrap(_mlp(), "map", num_data=8), autocast_dtype=value)


# ---------------------------------------------------------------------- #17 the diagnosis of a non-finite first loss
def test_initial_overflow_is_not_blamed_on_the_learning_rate():
    bnn = bw.wrap(_mlp(), "vi", num_data=8, prior_mean="zero", prior_std=1e-18, kl_weight=1e18)
    with pytest.raises(FloatingPointError) as info:
        _fit(bnn)
    message = str(info.value)
    assert "at epoch 1, step 1: before any update, with finite inputs and parameters" in message
    assert "kl_weight · KL / num_data overflows" in message and "prior_std=1e-18" in message
    assert "lower the learning rate" not in message


def test_initial_nan_output_is_diagnosed_as_the_initial_state():
    class Log(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            with torch.no_grad():  # negative pre-activations for every input, whatever the RNG state
                self.lin.weight.zero_()
                self.lin.bias.fill_(-1.0)

        def forward(self, x):
            return self.lin(x).log()  # NaN for negative pre-activations, before any update

    with pytest.raises(FloatingPointError, match=r"before any update, with finite inputs and parameters, so the "
                                                 r"initial state itself .*the NLL is non-finite"):
        _fit(bw.wrap(Log(), "map", num_data=8))


# ---------------------------------------------------------------------- #18 vmap is not switched off by a user error
class _NoVmap(nn.Module):
    """A model with data-dependent Python control flow, which vmap cannot batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x) if self.lin.weight.sum().item() < 1e9 else x


@pytest.mark.parametrize("make", [_mlp, _NoVmap])
def test_wrongly_shaped_input_raises_and_keeps_vmap(make):
    bnn = bw.wrap(make(), "vi", num_data=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no misleading "vmap failed" warning
        with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(2x5 and 3x"):
            bnn.predict(torch.randn(2, 5))
    assert bnn._vmap_ok


def test_genuine_vmap_limitation_falls_back_once():
    bnn = bw.wrap(_NoVmap(), "vi", num_data=8)
    x = _data(4)[0]
    with pytest.warns(RuntimeWarning, match=r"vmap over posterior samples failed .*one at a time from now on"):
        probs = bnn.predict(x, num_samples=3)
    assert probs.shape == (4, 2) and not bnn._vmap_ok
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(bnn.predict(x, num_samples=3).sum(-1), torch.ones(4))


def test_laplace_glm_wrong_shape_keeps_vmap():
    bnn = bw.wrap(_mlp(), "laplace", num_data=8, link_approx="mc")
    bnn.fit_curvature(_batches())
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied"):
        bnn.predict(torch.randn(2, 5), num_samples=3)
    assert bnn._vmap_ok and bnn.predict(_data(4)[0], num_samples=3).shape == (4, 2)


# ---------------------------------------------------------------------- #19 numpy integers and 0-d tensors
@pytest.mark.parametrize("num_data", [np.int64(100), np.int32(100), np.uint16(100), torch.tensor(100), 100.0])
def test_num_data_accepts_numpy_integers_and_0d_tensors(num_data):
    bnn = bw.wrap(_mlp(), "vi", num_data=num_data, kl_weight=0.5)
    reference = bw.wrap(_mlp(), "vi", num_data=100, kl_weight=0.5)
    assert bnn.num_data == 100 and type(bnn.num_data) is int
    assert bnn.log_std_scale == pytest.approx(reference.log_std_scale, rel=0, abs=0)


@pytest.mark.parametrize("num_samples", [np.int64(3), torch.tensor(3), 3.0])
def test_num_samples_accepts_numpy_integers(num_samples):
    bnn = bw.wrap(_mlp(), "vi", num_data=8)
    x = _data(4)[0]
    gen = torch.Generator().manual_seed(0)
    expected = bnn.predict(x, num_samples=3, generator=gen)
    torch.testing.assert_close(bnn.predict(x, num_samples=num_samples, generator=gen.manual_seed(0)), expected)
    assert bnn.sample_logits(x, num_samples).shape == (3, 4, 2)


# ---------------------------------------------------------------------- #20 half-precision probabilities
def _probs(seed=0, n=2000, k=10):
    g = torch.Generator().manual_seed(seed)
    probs = (3 * torch.randn(n, k, generator=g)).softmax(-1)
    return probs, torch.randint(0, k, (n,), generator=g)


@pytest.mark.parametrize("metric", [
    lambda p, y: calibration.ece(p, y),
    lambda p, y: calibration.ece(p, y, kind="all_class"),
    lambda p, y: calibration.mce(p, y, n_bins=10),
    lambda p, y: calibration.nll(p, y),
    lambda p, y: calibration.brier(p, y),
    lambda p, y: calibration.accuracy(p, y),
    lambda p, y: calibration.predictive_entropy(p),
    lambda p, y: calibration.report(p, y)["T1"]["ece"],
    lambda p, y: calibration.report(p, y, val=(p, y))["temperature"],
], ids=["ece", "ece_all_class", "mce", "nll", "brier", "accuracy", "entropy", "report", "temperature"])
def test_float16_probabilities_give_the_float32_numbers(metric):
    probs, labels = _probs()
    reference = metric(probs, labels)
    for half in (probs.half(), probs.numpy().astype(np.float16)):
        assert metric(half, labels) == pytest.approx(reference, abs=1e-3)


@pytest.mark.parametrize("metric, tol", [(calibration.ece, 1e-2), (calibration.nll, 1e-2), (calibration.brier, 1e-2)])
def test_bfloat16_probabilities_are_accepted(metric, tol):
    probs, labels = _probs()
    assert metric(probs.bfloat16(), labels) == pytest.approx(metric(probs, labels), abs=tol)


def test_float16_reliability_bins_match_float32():
    probs, labels = _probs()
    ref, half = calibration.bin_stats(probs, labels, n_bins=10), calibration.bin_stats(probs.half(), labels, n_bins=10)
    assert np.abs(half.count - ref.count).sum() <= 10  # a few of the 2000 confidences round across an edge
    np.testing.assert_allclose(half.accuracy, ref.accuracy, atol=2e-2)
    np.testing.assert_allclose(half.confidence, ref.confidence, atol=2e-3)


@pytest.mark.parametrize("measure", [uncertainty.predictive_entropy, uncertainty.mutual_information,
                                     uncertainty.expected_entropy])
def test_float16_sample_probabilities_in_uncertainty_measures(measure):
    g = torch.Generator().manual_seed(1)
    sample_probs = (2 * torch.randn(4, 50, 6, generator=g)).softmax(-1)
    torch.testing.assert_close(measure(sample_probs.half()), measure(sample_probs), atol=5e-3, rtol=0)


def test_float16_rows_far_from_one_are_still_refused():
    probs, labels = _probs(n=10)
    with pytest.raises(ValueError, match=r"rows of probs must sum to 1 within 0.00390625; row 0 sums to 0.98"):
        calibration.ece((probs * 0.98).half(), labels)


def test_param_groups_head_names_and_lr_head():
    bnn = bw.wrap(_mlp(), "vi", num_data=8, params=["0.*"])
    with pytest.raises(ValueError, match=r"head names \['fc\.weight'\] are not parameters of the wrapped model"):
        bnn.param_groups(head=["fc.weight"], lr_head=0.1)
    with pytest.raises(ValueError, match=r"lr_head=nan must be None or a finite number > 0"):
        bnn.param_groups(head=["2.weight"], lr_head=NAN)
    groups = bnn.param_groups(head="2.weight", lr_head=np.float64(0.5))
    assert [(g["name"], g.get("lr")) for g in groups] == [("posterior", None), ("point", None), ("point/head", 0.5)]


@pytest.mark.parametrize("method", ["map", "vi", "ensemble"])
def test_loss_refuses_non_finite_regression_targets_naming_them(method):
    """bnn.loss with an infinite regression target returned inf without a word (fit diagnosed it, loss did not)."""
    bnn = bw.wrap(_mlp(), method, num_data=8, likelihood="gaussian")
    x, _ = _data()
    y = torch.randn(8, 2)
    assert math.isfinite(bnn.loss(x, y).loss.item())
    y[3, 1] = INF
    with pytest.raises(ValueError, match=r"loss: the targets \(shape \(8, 2\)\) contain 1 non-finite values \(NaN or "
                                         r"inf\); accepted: finite regression targets"):
        bnn.loss(x, y)
