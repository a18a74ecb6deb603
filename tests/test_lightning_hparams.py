"""Lightning conventions of bayeswrap.lightning.BayesianModule: hyper-parameters, checkpoints, loggers, notices.

Oracles: the module before and after ``BayesianModule.load_from_checkpoint(path)`` predicts the same
(bit-equal, with the same generator); the checkpoint is read by ``torch.load(weights_only=True)``; the
hyper-parameters a ``CSVLogger`` writes (``hparams.yaml``) are the arguments the module was made with.
"""

from __future__ import annotations

import functools
import logging
import warnings

import pytest
import torch
import yaml
from torch import nn

import bayeswrap as bw

pl = pytest.importorskip("lightning.pytorch")
from bayeswrap.lightning import BayesianModule, class_path_spec  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

N, BATCH = 64, 16
MODEL = {"class_path": "torch.nn.Linear", "init_args": {"in_features": 64, "out_features": 10}}
SGD = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.9}}
OPTIMIZERS = {"sgld": {"class_path": "bayeswrap.optim.SGLD", "init_args": {"lr": 0.05, "num_data": N}},
              "ivon": {"class_path": "bayeswrap.optim.IVON", "init_args": {"lr": 0.1, "beta2": 0.999}}}
OPTIONS = {"sgld": {"burn_in": 2, "thinning": 1}, "swag": {"max_rank": 2, "swa_start": 1},
           "ensemble": {"num_members": 2}, "multiswag": {"num_members": 2}}
#: every method that a Trainer trains (MH and HMC sample with run_chains)
FIT_METHODS = [m for m in bw.METHODS if bw.wrap(nn.Linear(2, 2), m, num_data=1).not_trained_by_fit() is None]


@functools.cache
def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x[:N], dtype=torch.float32) / 16.0, torch.tensor(y[:N])


def _loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_digits()), batch_size=BATCH)


def _trainer(tmp_path, **kwargs):
    options = dict(max_epochs=2, accelerator="cpu", default_root_dir=tmp_path, logger=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(**{**options, **kwargs})


def _predictions(module):
    x = _digits()[0]
    return [module.bnn.predict(x, num_samples=s, generator=torch.Generator().manual_seed(3)) for s in (0, 4)]


def _assert_same(a, b):
    for pa, pb in zip(_predictions(a), _predictions(b)):
        assert torch.equal(pa, pb), (pa - pb).abs().max()


@pytest.mark.parametrize("method", FIT_METHODS)
def test_load_from_checkpoint_without_arguments(tmp_path, method):
    """A module made from class paths reloads from its checkpoint alone, with weights_only=True."""
    module = BayesianModule(model=MODEL, method=method, wrap_options={"num_data": N, "prior_std": 0.5,
                                                                      **OPTIONS.get(method, {})},
                            optimizer=OPTIMIZERS.get(method, SGD), kl_schedule=bw.KLSchedule(0, 2),
                            predict_num_samples=3)
    torch.manual_seed(0)
    trainer = _trainer(tmp_path)
    trainer.fit(module, _loader())
    # ModelCheckpoint writes at the last epoch's end, before after_fit (Laplace's curvature, SWAG's BatchNorm
    # statistics); the finished posterior is saved after fit
    path = tmp_path / "final.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)  # plain data only: no pickled module or callable
    assert checkpoint["hyper_parameters"]["model"] == MODEL
    for weights_only in (None, True):  # None: Lightning passes torch.load's default (True since torch 2.6)
        reloaded = BayesianModule.load_from_checkpoint(path, weights_only=weights_only)
        assert reloaded.bnn.method == method and reloaded.bnn is not module.bnn
        assert reloaded.predict_num_samples == 3 and reloaded.kl_schedule(0) == module.kl_schedule(0) == 0.5
        _assert_same(module.eval(), reloaded.eval())  # Lightning's convention: eval() after loading
    # and it trains on: the optimizer came back from its class path too
    resumed = _trainer(tmp_path, max_epochs=3)
    resumed.fit(reloaded, _loader(), ckpt_path=path)
    assert resumed.global_step == 3 * N // BATCH


def test_checkpoint_of_a_module_instance_needs_model_and_says_so(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    bnn = bw.wrap(net, "vi", num_data=N, prior_std=0.3)
    module = BayesianModule(bnn, lambda params: torch.optim.SGD(params, lr=0.1))
    trainer = _trainer(tmp_path)
    trainer.fit(module, _loader())
    path = trainer.checkpoint_callback.best_model_path
    assert module.hparams["model"] is None and module.hparams["optimizer"] is None  # neither can be stored
    assert module.hparams["wrap_options"]["prior_std"] == 0.3
    with pytest.raises(ValueError, match=r"needs load_from_checkpoint\(path, model=MyNet\(\)\)"):
        BayesianModule.load_from_checkpoint(path, weights_only=True)
    fresh = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))  # other weights: replaced
    reloaded = BayesianModule.load_from_checkpoint(path, model=fresh, weights_only=True)
    assert reloaded.bnn.wrap_arguments["prior_std"] == 0.3
    _assert_same(module.eval(), reloaded.eval())
    # bnn= works as well; a bnn wrapped otherwise than the checkpoint's is refused
    other = BayesianModule.load_from_checkpoint(path, bnn=bw.wrap(fresh, "vi", num_data=N, prior_std=0.3))
    _assert_same(module, other.eval())
    with pytest.raises(ValueError, match=r"prior_std=0.3 \(bnn: 1.0\)"):
        BayesianModule.load_from_checkpoint(path, bnn=bw.wrap(fresh, "vi", num_data=N))
    with pytest.raises(ValueError, match=r"optimizer=None: this BayesianModule cannot train"):
        _trainer(tmp_path, max_epochs=3).fit(reloaded, _loader())


def test_hyperparameters_reach_the_logger(tmp_path):
    loggers = [pl.loggers.CSVLogger(tmp_path, name="run"), pl.loggers.TensorBoardLogger(tmp_path, name="tb")]
    module = BayesianModule(model=MODEL, method="vi", wrap_options={"num_data": N, "prior_std": 0.25},
                            optimizer=SGD, val_num_samples=2)
    _trainer(tmp_path, logger=loggers, max_epochs=1, enable_checkpointing=False).fit(module, _loader())
    assert yaml.safe_load((tmp_path / "tb" / "version_0" / "hparams.yaml").read_text()) == dict(module.hparams)
    hparams = yaml.safe_load((tmp_path / "run" / "version_0" / "hparams.yaml").read_text())
    assert hparams["method"] == "vi" and hparams["model"] == MODEL and hparams["optimizer"] == SGD
    assert hparams["wrap_options"]["num_data"] == N and hparams["wrap_options"]["prior_std"] == 0.25
    assert hparams["wrap_options"]["likelihood"] == "categorical"  # wrap's defaults too
    assert hparams["val_num_samples"] == 2 and hparams["predict_num_samples"] == 5


def test_predict_prints_no_callback_notice(tmp_path, caplog, capsys):
    module = BayesianModule(model=MODEL, method="vi", wrap_options={"num_data": N}, optimizer=SGD)
    trainer = _trainer(tmp_path, max_epochs=1, enable_checkpointing=False)
    trainer.fit(module, _loader())
    capsys.readouterr()
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            batches = trainer.predict(module, _loader())
    said = caplog.text + "".join(capsys.readouterr()) + "".join(str(w.message) for w in caught)
    assert "callback" not in said.lower(), said
    assert torch.cat(batches).shape == (N, 10)
    assert not any(type(c).__name__ == "BayesianCallback" for c in trainer.callbacks)  # hooks run from the module


def test_classes_and_partials_are_stored_as_class_paths():
    bnn = bw.wrap(nn.Linear(64, 10), "vi", num_data=N)
    module = BayesianModule(bnn, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
                            scheduler=torch.optim.lr_scheduler.ConstantLR)
    assert module.hparams["optimizer"] == {"class_path": "torch.optim.sgd.SGD",
                                           "init_args": {"lr": 0.1, "momentum": 0.9}}
    assert module.hparams["scheduler"] == {"class_path": "torch.optim.lr_scheduler.ConstantLR", "init_args": {}}
    optimizer = module.configure_optimizers()["optimizer"]
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9
    kept = BayesianModule(bnn, functools.partial(torch.optim.SGD, lr=torch.ones(2)))  # not plain data: a callable
    assert kept.hparams["optimizer"] is None and kept.make_optimizer.keywords["lr"].shape == (2,)


def test_class_paths_are_checked_before_anything_is_called():
    assert class_path_spec("model", "torchvision.models.resnet18") == {
        "class_path": "torchvision.models.resnet18", "init_args": {}}  # a function annotated to return a module
    with pytest.raises(ValueError, match=r"class_path='os.system' resolves to .* accepted: an nn.Module subclass"):
        BayesianModule(model={"class_path": "os.system", "init_args": {"command": "false"}}, method="vi",
                       wrap_options={"num_data": N})
    with pytest.raises(ValueError, match=r"class_path='torch.nn.Linear' resolves to .* torch.optim.Optimizer"):
        BayesianModule(model=MODEL, method="vi", wrap_options={"num_data": N}, optimizer="torch.nn.Linear")
    with pytest.raises(ValueError, match=r"class_path='no_such_package.Net' does not import"):
        BayesianModule(model="no_such_package.Net", method="vi", wrap_options={"num_data": N})
    with pytest.raises(ValueError, match=r"has the key\(s\) \['init'\]; accepted: class_path and init_args"):
        BayesianModule(model={"class_path": "torch.nn.Linear", "init": {}}, method="vi")
    with pytest.raises(ValueError, match=r"method=None is not accepted with model="):
        BayesianModule(model=MODEL)
    with pytest.raises(ValueError, match=r"both bnn and model="):
        BayesianModule(bw.wrap(nn.Linear(64, 10), "vi", num_data=N), model=MODEL)
    with pytest.raises(ValueError, match=r"method='map' differs from bnn's method 'vi'"):
        BayesianModule(bw.wrap(nn.Linear(64, 10), "vi", num_data=N), method="map")
    with pytest.raises(ValueError, match=r"BayesianModule needs bnn .* or model"):
        BayesianModule()
    with pytest.raises(ValueError, match=r"wrap_options=None is not accepted with model=; .* at least num_data"):
        BayesianModule(model=MODEL, method="vi")
    callable_params = bw.wrap(nn.Linear(64, 10), "vi", num_data=N, params=lambda name, p: name == "bias")
    assert BayesianModule(callable_params).hparams["wrap_options"] is None  # a callable cannot be stored
