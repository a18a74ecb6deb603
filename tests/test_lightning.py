"""bayeswrap.lightning: a lightning.Trainer trains every method exactly as bw.fit does.

Oracle: ``bw.fit`` on the same model copy, seed, batches (a non-shuffled
DataLoader) and optimizer: the state dicts and the predictions must be equal
(bit for bit: the same operations run in the same order), and the logged
metrics equal fit's history, :func:`bw.evaluate`, ``calibration.ece`` (checked
against torchmetrics) and the uncertainty measures of ``sample_probs_loader``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import sys

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.evaluation import calibration, uncertainty

pl = pytest.importorskip("lightning.pytorch")
from bayeswrap.lightning import BayesianCallback, BayesianModule  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

N, BATCH, EPOCHS = 96, 32, 2
#: options that fit the tiny budget (6 optimizer steps)
OPTIONS = {"sgld": {"burn_in": 2, "thinning": 1}, "ensemble": {"num_members": 2}, "multiswag": {"num_members": 2}}
FIT_METHODS = [m for m in bw.METHODS if bw.wrap(nn.Linear(2, 2), m, num_data=1).not_trained_by_fit() is None]
CASES = [(m, OPTIONS.get(m, {})) for m in FIT_METHODS] + [
    ("sgld", {"cycles": 2, "thinning": 1}), ("vi", {"local_reparam": True}),
    ("laplace", {"hessian_structure": "kron", "subset_of_weights": "last_layer"})]


@functools.cache
def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x[:N], dtype=torch.float32) / 16.0, torch.tensor(y[:N])


def _loader(start: int = 0):
    x, y = _digits()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[start:], y[start:]), batch_size=BATCH)


def _net(batchnorm: bool = False):
    torch.manual_seed(0)
    if batchnorm:
        return nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 10))
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


def _make_optimizer(bnn):
    """params -> optimizer: the method's own (SGLD, IVON) or SGD with momentum."""
    if bnn.required_optimizer is bw.optim.SGLD:
        return lambda params: bw.optim.SGLD(params, lr=0.1, num_data=N)
    if bnn.required_optimizer is bw.optim.IVON:
        return lambda params: bw.optim.IVON(params, lr=0.1, beta2=0.999)
    return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _trainer(**kwargs):
    options = dict(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(**{**options, **kwargs})


def _fit_and_lightning(method: str, options: dict, batchnorm: bool = False, **fit_kwargs):
    """Two copies of one wrapped model, trained by bw.fit and by BayesianModule from the same seed."""
    a = bw.wrap(_net(batchnorm), method, num_data=N, **options)
    b = copy.deepcopy(a)
    torch.manual_seed(1)
    history = bw.fit(a, _loader(), epochs=EPOCHS, optimizer=_make_optimizer(a)(a.param_groups()), progress=False,
                     **fit_kwargs)
    return a, b, history


def _assert_same_posterior(a, b, x):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k
    for s in (0, 3):
        pa = a.predict(x, num_samples=s, generator=torch.Generator().manual_seed(5))
        pb = b.predict(x, num_samples=s, generator=torch.Generator().manual_seed(5))
        assert torch.equal(pa, pb), (s, (pa - pb).abs().max())


@pytest.mark.parametrize("method,options", CASES, ids=[f"{m}-{'-'.join(map(str, o.values()))}" for m, o in CASES])
def test_trainer_equals_fit(method, options):
    a, b, history = _fit_and_lightning(method, options)
    untrained = copy.deepcopy(b)
    torch.manual_seed(1)
    trainer = _trainer()
    trainer.fit(BayesianModule(b, _make_optimizer(b)), _loader())
    x, _ = _digits()
    _assert_same_posterior(a, b, x)
    assert not b.training and trainer.global_step == EPOCHS * 3
    moved = [k for k, v in untrained.state_dict().items()
             if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.equal(v, b.state_dict()[k])]
    assert moved  # training changed the posterior (the equality above is not that of two untouched copies)
    for key in ("loss", "nll", "kl", "error"):  # epoch means weighted by batch size, as fit's history
        assert float(trainer.callback_metrics[f"train_{key}"]) == pytest.approx(history[-1][f"train_{key}"],
                                                                                rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("method", ["map", "vi", "laplace", "sgld"])
def test_callback_in_own_module_equals_fit(method):
    class Own(pl.LightningModule):
        def __init__(self, bnn, make_optimizer):
            super().__init__()
            self.bnn, self.make_optimizer = bnn, make_optimizer

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.bnn.loss(x, y).loss

        def configure_optimizers(self):
            return self.make_optimizer(self.bnn.param_groups())

    a, b, _ = _fit_and_lightning(method, OPTIONS.get(method, {}))
    torch.manual_seed(1)
    _trainer(callbacks=[BayesianCallback(b)]).fit(Own(b, _make_optimizer(b)), _loader())
    _assert_same_posterior(a, b, _digits()[0])


def test_validation_metrics_with_batchnorm_scheduler_and_kl_schedule():
    """VI with BatchNorm and dropout, AdamW, an epoch scheduler, KL annealing and validation every epoch.

    Lightning resets the modules' training flags after validation without calling train(); the posterior still
    equals fit's, and the logged validation scores equal fit's history, torchmetrics' ECE and the uncertainty
    measures of sample_probs_loader with the module's seed.
    """
    from torchmetrics.functional.classification import multiclass_calibration_error

    opt = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # noqa: E731
    kl = bw.KLSchedule(1, 2)
    a = bw.wrap(_net(batchnorm=True), "vi", num_data=N)
    b = copy.deepcopy(a)
    val = _loader(start=N - 40)
    torch.manual_seed(1)
    optimizer = opt(a.param_groups())
    history = bw.fit(a, _loader(), epochs=EPOCHS, optimizer=optimizer, val_loader=val, val_num_samples=4,
                     scheduler=sched(optimizer), kl_schedule=kl, progress=False)
    torch.manual_seed(1)
    trainer = _trainer()
    module = BayesianModule(b, opt, scheduler=sched, kl_schedule=kl, val_num_samples=4, seed=7)
    trainer.fit(module, _loader(), val)
    _assert_same_posterior(a, b, _digits()[0])
    m = trainer.callback_metrics
    assert float(m["val_nll"]) == pytest.approx(history[-1]["val_nll"], rel=1e-6)
    assert float(m["val_error"]) == pytest.approx(history[-1]["val_error"], abs=1e-7)
    assert float(m["train_kl"]) == pytest.approx(history[-1]["train_kl"], rel=1e-6)

    # the last validation's uncertainty draws: the module's generator, seeded with `seed` at the epoch's start
    samples, y = bw.sample_probs_loader(b, val, 4, generator=torch.Generator().manual_seed(7))
    assert float(m["val_mutual_information"]) == pytest.approx(float(uncertainty.mutual_information(samples).mean()),
                                                               rel=1e-5)
    assert float(m["val_variation_ratio"]) == pytest.approx(float(uncertainty.variation_ratio(samples).mean()),
                                                            rel=1e-5)
    # trainer.validate runs under inference mode; with S = 0 the predictive is deterministic: compare it exactly
    module.val_num_samples = 0
    trainer.validate(module, val, verbose=False)
    probs, y = bw.predict_loader(b, val, 0)
    assert float(trainer.callback_metrics["val_nll"]) == pytest.approx(calibration.nll(probs, y), rel=1e-6)
    ece = float(multiclass_calibration_error(probs, y, num_classes=10, n_bins=15, norm="l1"))
    assert float(trainer.callback_metrics["val_ece"]) == pytest.approx(ece, abs=1e-6)
    assert float(trainer.callback_metrics["val_entropy"]) == pytest.approx(calibration.predictive_entropy(probs),
                                                                           rel=1e-6)
    assert "val_mutual_information" not in trainer.callback_metrics  # needs S >= 2


@pytest.mark.parametrize("options", [{}, {"hessian_structure": "kron"}])
def test_laplace_predict_and_validate_under_inference_mode(options):
    """Trainer.predict / validate run under torch.inference_mode: the GLM predictive equals bnn.predict's."""
    _, b, _ = _fit_and_lightning("laplace", options)
    module = BayesianModule(b, _make_optimizer(b), predict_num_samples=1)
    torch.manual_seed(1)
    trainer = _trainer()
    trainer.fit(module, _loader())
    x, y = _digits()
    batches = trainer.predict(module, _loader())
    assert trainer.predict_loop.inference_mode
    expected = b.predict(x, num_samples=1)  # probit: deterministic
    torch.testing.assert_close(torch.cat(batches), expected, rtol=0, atol=0)
    trainer.validate(module, _loader(), verbose=False)
    assert float(trainer.callback_metrics["val_nll"]) == pytest.approx(bw.evaluate(b, _loader(), 0)["nll"], rel=1e-6)


def test_gradient_accumulation_counts_optimizer_steps():
    bnn = bw.wrap(_net(), "sgld", num_data=N, burn_in=1, thinning=1)
    trainer = _trainer(accumulate_grad_batches=2)
    trainer.fit(BayesianModule(bnn, _make_optimizer(bnn)), _loader())
    assert trainer.global_step == 4  # 3 batches per epoch: steps after batches 2 and 3, twice
    assert int(bnn.num_steps) == 4 and int(bnn.num_kept) == 3


def test_checkpoint_round_trip_through_bnn_load_state_dict():
    _, b, _ = _fit_and_lightning("sgld", OPTIONS["sgld"])
    module = BayesianModule(b, _make_optimizer(b))
    torch.manual_seed(1)
    _trainer().fit(module, _loader())
    fresh = BayesianModule(bw.wrap(_net(), "sgld", num_data=N, **OPTIONS["sgld"]), _make_optimizer(b))
    fresh.load_state_dict(copy.deepcopy(module.state_dict()))
    x = _digits()[0]
    assert torch.equal(fresh.bnn.predict(x, num_samples=4), b.predict(x, num_samples=4))
    bad = {k: torch.full_like(v, float("nan")) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
           for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match="NaN"):
        fresh.load_state_dict(bad)


def test_bad_arguments():
    bnn = bw.wrap(_net(), "sgld", num_data=N)
    with pytest.raises(ValueError, match=r"optimizer=3 is not accepted; accepted: None, a callable, or a class path"):
        BayesianModule(bnn, 3)
    with pytest.raises(ValueError, match=r"optimizer=None: this BayesianModule cannot train"):  # it can predict
        _trainer().fit(BayesianModule(bnn), _loader())
    with pytest.raises(ValueError, match="val_num_samples"):
        BayesianModule(bnn, _make_optimizer(bnn), val_num_samples=-1)
    with pytest.raises(ValueError, match="run_chains"):
        BayesianModule(bw.wrap(_net(), "hmc", num_data=N), _make_optimizer(bnn))
    with pytest.raises(ValueError, match="must be a bayeswrap BayesianModel"):
        BayesianCallback(_net())
    wrong = BayesianModule(bnn, lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="must be trained with bayeswrap.optim.SGLD"):
        _trainer().fit(wrong, _loader())

    class NotHolding(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(64, 10)

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="not a submodule"):
        _trainer(callbacks=[BayesianCallback(bw.wrap(_net(), "map", num_data=N))]).fit(NotHolding(), _loader())


def test_nonfinite_input_is_diagnosed():
    x, y = _digits()
    x = x.clone()
    x[40, 3] = float("nan")
    bnn = bw.wrap(_net(), "map", num_data=N)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    with pytest.raises(FloatingPointError, match=r"at epoch 1, step 2: the input batch contains 1 non-finite"):
        _trainer().fit(BayesianModule(bnn, _make_optimizer(bnn)), loader)


def test_missing_lightning_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "bayeswrap.lightning")
    with pytest.raises(ImportError, match=r'pip install "bayeswrap\[lightning\]"'):
        importlib.import_module("bayeswrap.lightning")
