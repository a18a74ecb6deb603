"""Every bad input raises a clear error naming the value and the accepted ones."""

import pytest
import torch
from torch import nn

import bayeswrap as bw


def _mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("kwargs, match", [
    ({"method": "hmc"}, r"method='hmc' is not known; accepted: \('map', 'vi', 'mc_dropout', 'sgld', 'laplace'"),
    ({"likelihood": "poisson"}, r"likelihood='poisson' is not known; accepted: \('categorical', 'gaussian'\)"),
    ({"bias": "gaussian"}, r"bias='gaussian' is not accepted by method 'vi'; accepted: \('informative', 'uninf"),
    ({"prior_std": 0.0}, r"prior_std=0.0 must be > 0"),
    ({"prior_std": -1}, r"prior_std=-1 must be > 0"),
    ({"prior_std": None}, r"prior_std=None \(no prior\) is only accepted by method 'map'"),
    ({"num_data": 0}, r"num_data=0 must be an integer >= 1"),
    ({"params": ["head.*"]}, r"params pattern 'head.\*' matches no trainable parameter"),
    ({"prior_mean": "pretrained"}, r"prior_mean='pretrained' is not accepted; accepted: \('init', 'zero'"),
    ({"prior_mean": {"0.weight": torch.zeros(4, 3)}}, r"prior_mean mapping .* missing \['0.bias'"),
    ({"init_std": -0.1}, r"init_std=-0.1 must be > 0"),
    ({"p_drop": 0.1}, r"option\(s\) \['p_drop'\] are not accepted by method 'vi'; accepted: \('kl_weight'"),
])
def test_wrap_rejects(kwargs, match):
    args = {"method": "vi", "num_data": 10, **kwargs}
    method = args.pop("method")
    with pytest.raises(ValueError, match=match):
        bw.wrap(_mlp(), method, **args)


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_p_drop_outside_unit_interval(p):
    with pytest.raises(ValueError, match=rf"p_drop={p} is outside \[0, 1\)"):
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
    with pytest.raises(ValueError, match="noise_std=0 must be > 0"):
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
    from bayeswrap.config import resolve

    with pytest.raises(ValueError, match=match):
        resolve(None, {option: value})


def test_held_out_classes_out_of_range_or_all(tmp_path):
    import bayeswrap.cli as cli

    assert cli.main(["fit", "--ood-classes", "3,12", "--epochs", "1", "--out-dir", str(tmp_path)]) == 2
    assert not (tmp_path / "digits-mlp-vi").exists()  # refused before the run folder is made
    from bayeswrap.data import load_data
    from bayeswrap.evaluation.shift import hold_out_classes

    with pytest.raises(ValueError, match=r"12"):
        hold_out_classes(load_data("digits"), [3, 12])
    with pytest.raises(ValueError, match=r"at least one class kept"):
        hold_out_classes(load_data("digits"), list(range(10)))


def test_yaml_lists_for_list_options(tmp_path):
    from bayeswrap.config import resolve

    path = tmp_path / "c.yaml"
    path.write_text("shift_rotations: [0, 90]\nshift_noise: []\nood_classes: [1, 2]\n")
    cfg = resolve(str(path), {})
    assert cfg.rotation_angles() == (0.0, 90.0) and cfg.noise_stds() == () and cfg.held_out_classes() == (1, 2)
