"""Lightning integration: train, validate and predict a :class:`~bayeswrap.BayesianModel` with ``lightning.Trainer``.

Two ways in, for the two ways people use Lightning:

* :class:`BayesianModule` ``(bnn, optimizer)`` is a ``LightningModule`` around a
  wrapped model. Its ``training_step`` is :func:`bayeswrap.fit`'s step (the same
  loss ``bnn.loss(x, y).loss``, KL annealing, non-finite checks); validation logs
  NLL, error, ECE and the uncertainty measures; ``predict_step`` returns the
  posterior predictive.
* :class:`BayesianCallback` ``(bnn)`` is for a ``LightningModule`` of your own that
  holds ``bnn`` and returns ``bnn.loss(x, y).loss`` from its ``training_step``.

Both call the method's hooks where :func:`bayeswrap.fit` calls them:
``bnn.before_fit(num_steps, optimizer, steps_per_epoch)`` when training starts
(``on_train_start``; num_steps is ``trainer.estimated_stepping_batches`` less the
steps already taken, so a resumed fit plans like ``fit(start_epoch=...)``),
``bnn.after_step()`` after every optimizer step (SGLD keeps its iterates, SWAG
its moments, cyclical SGLD sets the next step size) and
``bnn.after_fit(trainer.train_dataloader)`` when training ends (Laplace fits its
curvature, SWAG its BatchNorm statistics). ``after_fit`` runs with autograd on
(``torch.inference_mode(False)``, ``torch.enable_grad()``) whatever the hook's
context. With the same seed, batches and optimizer, the posterior and the
predictions equal those of ``bw.fit(bnn, loader, epochs=max_epochs, optimizer=...)``
(tested for every method trained by ``fit``; Lightning's sanity check validates
before training and, with sampled predictions or a DataLoader, draws from the
global random state: ``Trainer(num_sanity_val_steps=0)`` keeps fit's random
stream). Lightning's own ``gradient_clip_val`` (norm clipping) stands for fit's
``grad_clip_norm``.

Predictions work under ``torch.inference_mode``, which ``Trainer.validate``,
``test`` and ``predict`` use by default: Laplace leaves it where it needs
autograd (:func:`bayeswrap.core.functional.outside_inference_mode`).

**Hyper-parameters and checkpoints.** :class:`BayesianModule` calls
``save_hyperparameters`` with plain data only: the model and the optimizer,
scheduler and KL schedule as class paths (``{"class_path": ..., "init_args":
{...}}``, the form ``LightningCLI``/jsonargparse write) where they were given so,
the method and ``bw.wrap``'s keyword arguments (``wrap_options``: ``num_data``,
``prior_std``, ...) and the module's options. Loggers receive them (a
``CSVLogger``'s ``hparams.yaml``, TensorBoard's hparams), and a checkpoint holds
no pickled object, so ``BayesianModule.load_from_checkpoint(path)`` loads it with
``torch.load(weights_only=True)`` (Lightning passes torch's default, True since
torch 2.6; ``weights_only=True`` may be given) and rebuilds the module without
arguments when the model was given as a class path. A module made from an
``nn.Module`` instance (or from ``bnn``) cannot be rebuilt from plain data:
``load_from_checkpoint(path, model=MyNet())`` with a fresh instance of the
architecture (the method and wrap options come from the checkpoint), as
Lightning's own convention for modules passed to ``__init__``. A callable
optimizer (a lambda) is not stored either: the reloaded module predicts,
validates and tests, and refuses to train until given ``optimizer=``.
``ModelCheckpoint`` writes at the end of an epoch, before ``after_fit`` (Laplace's
curvature, SWAG's BatchNorm statistics): save the finished posterior with
``trainer.save_checkpoint(path)`` after ``fit``.

**Data-parallel** (``Trainer(strategy="ddp", ...)``, tested with 2 CPU processes
and gloo): DDP averages the ranks' gradients of ``nll_mean_rank + KL /
num_data``, which is the gradient of the global batch's loss with the KL term
counted once (as :mod:`bayeswrap.core.distributed` does for ``bw.fit`` under
``torchrun``). When training starts every rank takes rank 0's random state (CPU,
the model's CUDA device, an SGLD optimizer's generator), so all ranks make the
same draws (VI's weight sample, the Langevin noise, which SGLD adds to the
parameters and must be equal on every rank); the posterior then equals one
process's trained on the union of the ranks' batches (tested for MAP, VI, SGLD,
SWAG, a deep ensemble and Laplace with diagonal, Kronecker and full curvature).
The replicas being identical, SGLD's iterates and SWAG's moments are collected
identically on every rank; ``after_fit`` runs on every rank over its shard of
``trainer.train_dataloader``: Laplace's curvature sums (diagonal, Kronecker factors,
full H, last layer) are all-reduced at the end of ``fit_curvature``, so the
curvature is that of the whole set (a ``DistributedSampler`` that pads the last
shard counts the repeated examples twice), and SWAG's BatchNorm statistics for
θ_SWA are averaged over the ranks. Training metrics are
synced means over the ranks; validation and test metrics score the union of all
ranks' predictions (Lightning's ``DistributedSampler`` pads a set whose size the
world size does not divide with repeated examples, which are then counted twice).
Lightning shuffles the training set under DDP (``DistributedSampler(shuffle=True)``).

Lightning is an optional dependency: ``pip install "bayeswrap[lightning]"``.

Example:
    >>> bnn = bw.wrap(model, "vi", num_data=len(train_set))
    >>> module = BayesianModule(bnn, lambda params: torch.optim.AdamW(params, lr=1e-3), val_num_samples=8)
    >>> trainer = lightning.Trainer(max_epochs=10)
    >>> trainer.fit(module, train_loader, val_loader)
    >>> probs = torch.cat(trainer.predict(module, test_loader))   # (N, K)

    Built from class paths, so that a checkpoint rebuilds it by itself:

    >>> module = BayesianModule(
    ...     model={"class_path": "torchvision.models.resnet18", "init_args": {"num_classes": 10}},
    ...     method="vi", wrap_options={"num_data": 50_000, "prior_std": 0.1},
    ...     optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}})
    >>> trainer.fit(module, train_loader); trainer.save_checkpoint("vi.ckpt")
    >>> module = BayesianModule.load_from_checkpoint("vi.ckpt").eval()
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import typing
from collections.abc import Callable, Mapping

import torch
from torch import nn

try:
    import lightning.pytorch as pl
except ImportError as err:  # an optional extra
    raise ImportError('bayeswrap.lightning needs Lightning (the "lightning" package, >= 2.2): '
                      'pip install "bayeswrap[lightning]"') from err

from bayeswrap.compiled import CompiledLoss, compile_options
from bayeswrap.core import distributed
from bayeswrap.core.batches import batch_pair, check_inputs_finite, loader_pair, to_device
from bayeswrap.core.checks import check_bool, check_int
from bayeswrap.core.functional import nonfinite_names
from bayeswrap.core.likelihoods import PROBABILITY_LIKELIHOODS, at_least_float32
from bayeswrap.core.schedules import KLSchedule, check_factor
from bayeswrap.core.token_likelihoods import TOKEN_LIKELIHOODS
from bayeswrap.evaluation import calibration, uncertainty
from bayeswrap.evaluation.tokens import valid_tokens
from bayeswrap.methods.base import BayesianModel
from bayeswrap.methods.persistence import _storable, storable_wrap_arguments
from bayeswrap.methods.registry import wrap
from bayeswrap.predictive import model_device, score
from bayeswrap.training import (
    check_optimizer,
    check_trainable,
    diagnose_nonfinite_loss,
    parameter_label,
    step_loss,
)

__all__ = ["BayesianCallback", "BayesianModule", "class_path_spec"]


#: what each class-path argument of BayesianModule must resolve to, and how it is described in errors
_CLASS_PATH_KINDS = {
    "model": (nn.Module, "an nn.Module subclass, or a function annotated to return one (e.g. "
                         "'torchvision.models.resnet18', 'timm.create_model')"),
    "optimizer": (torch.optim.Optimizer, "a torch.optim.Optimizer subclass (e.g. 'torch.optim.AdamW', "
                                         "'bayeswrap.optim.SGLD')"),
    "scheduler": (torch.optim.lr_scheduler.LRScheduler, "a torch.optim.lr_scheduler.LRScheduler subclass "
                                                        "(e.g. 'torch.optim.lr_scheduler.StepLR')"),
    "kl_schedule": (KLSchedule, "bayeswrap.KLSchedule or a subclass"),
}


def _is_class_path(value) -> bool:
    """Whether ``value`` is a class-path spec: a dotted string or a mapping with a ``class_path``."""
    return isinstance(value, str) or (isinstance(value, Mapping) and "class_path" in value)


def class_path_spec(name: str, value) -> dict:
    """``value`` (``"pkg.Class"`` or ``{"class_path": ..., "init_args": {...}}``) as a checked plain-data spec.

    The spec is what Lightning's configuration (``LightningCLI``, jsonargparse) writes for a class and its
    constructor arguments; :class:`BayesianModule` stores it in its hyper-parameters, so that
    ``BayesianModule.load_from_checkpoint(path)`` rebuilds the object.

    Args:
        name: the argument: ``"model"``, ``"optimizer"``, ``"scheduler"`` or ``"kl_schedule"``.
        value: a dotted path (``"torch.optim.AdamW"``) or a mapping with the keys ``class_path`` (a dotted
            path) and optionally ``init_args`` (a string-keyed mapping of plain data).

    Returns:
        ``{"class_path": str, "init_args": dict}``, ``init_args`` as plain data that
        ``torch.load(weights_only=True)`` reads back.

    Raises:
        ValueError: for other keys, a class path that does not import or does not resolve to what ``name``
            accepts (:data:`_CLASS_PATH_KINDS`: the object is checked before anything is called, so a checkpoint
            cannot make this call an arbitrary function), or ``init_args`` that are not plain data.
    """
    spec = {"class_path": value} if isinstance(value, str) else dict(value)
    extra = sorted(set(spec) - {"class_path", "init_args"})
    if extra:
        raise ValueError(f"{name}={value!r} has the key(s) {extra}; accepted: class_path and init_args")
    init_args = spec.get("init_args") or {}
    if not isinstance(init_args, Mapping) or not all(isinstance(k, str) for k in init_args):
        raise ValueError(f"{name}'s init_args={init_args!r} is not accepted; accepted: a mapping from argument names "
                         "to plain data")
    _resolve_class_path(name, spec["class_path"])
    return {"class_path": spec["class_path"], "init_args": {k: _storable(f"{name}.init_args", v)
                                                            for k, v in init_args.items()}}


def _resolve_class_path(name: str, path) -> Callable:
    """The class (or model-building function) that the dotted ``path`` names, checked against ``name``'s kind."""
    base, accepted = _CLASS_PATH_KINDS[name]
    if not isinstance(path, str) or "." not in path.strip("."):
        raise ValueError(f"{name}'s class_path={path!r} is not accepted; accepted: the dotted path of {accepted}")
    module_name, _, attribute = path.rpartition(".")
    obj = None
    while module_name:  # "torch.optim.lr_scheduler.StepLR", or a nested attribute such as "pkg.mod.Outer.Inner"
        try:
            obj = importlib.import_module(module_name)
            break
        except ImportError:
            module_name, _, head = module_name.rpartition(".")
            attribute = f"{head}.{attribute}"
    try:
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        obj = None
    if obj is None or not module_name:
        raise ValueError(f"{name}'s class_path={path!r} does not import; accepted: the dotted path of {accepted}")
    if inspect.isclass(obj) and issubclass(obj, base):
        return obj
    if base is nn.Module and inspect.isfunction(obj):
        try:
            returns = typing.get_type_hints(obj).get("return")
        except Exception:  # unresolvable annotations: treated as unannotated
            returns = None
        if inspect.isclass(returns) and issubclass(returns, nn.Module):
            return obj
    raise ValueError(f"{name}'s class_path={path!r} resolves to {obj!r}, which is not accepted; accepted: "
                     f"{accepted}")


def _from_spec(name: str, spec: dict, *args):
    """Calls the class (function) of a checked spec with ``args`` and its ``init_args``."""
    return _resolve_class_path(name, spec["class_path"])(*args, **spec["init_args"])


def _callable_or_spec(name: str, value, allow_none: bool = True):
    """``(make, spec)``: the callable to use and the plain-data spec to store (None for a callable given as such)."""
    if value is None and allow_none:
        return None, None
    as_spec = _class_as_spec(value)
    if as_spec is not None:
        value = as_spec
    if _is_class_path(value):
        spec = class_path_spec(name, value)
        if name == "kl_schedule":
            return _from_spec(name, spec), spec
        return functools.partial(_from_spec, name, spec), spec
    if callable(value) and not isinstance(value, nn.Module):
        return value, None
    accepted = _CLASS_PATH_KINDS[name][1]
    raise ValueError(f"{name}={value!r} is not accepted; accepted: {'None, ' if allow_none else ''}a callable, or a "
                     f"class path ('pkg.Class' or {{'class_path': 'pkg.Class', 'init_args': {{...}}}}) of {accepted}")


def _class_as_spec(value) -> dict | None:
    """A class (``torch.optim.AdamW``) or a ``functools.partial`` of one with plain-data keywords
    (``partial(torch.optim.AdamW, lr=1e-3)``) as a class-path spec; None for anything else.
    """
    func, keywords = value, {}
    if isinstance(value, functools.partial) and not value.args:
        func, keywords = value.func, dict(value.keywords)
    if not inspect.isclass(func):
        return None
    try:
        return {"class_path": f"{func.__module__}.{func.__qualname__}",
                "init_args": {k: _storable(k, v) for k, v in keywords.items()}}
    except ValueError:  # keywords that are not plain data: kept as a callable
        return None


def _storable_or_none(name: str, value):
    """``value`` as plain data for the hyper-parameters, or None where it is not (e.g. a callable)."""
    try:
        return _storable(name, value)
    except ValueError:
        return None


def _short(value) -> str:
    """``repr(value)`` cut to 80 characters (a module's repr spans its whole architecture)."""
    text = f"{type(value).__name__}(...)" if isinstance(value, nn.Module) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: the error of a BayesianModule without bnn or model: typically load_from_checkpoint on a checkpoint whose
#: model was an nn.Module instance (its constructor arguments are unknown, so the checkpoint cannot rebuild it)
_MISSING_MODEL = (
    "BayesianModule needs bnn (a model from bw.wrap) or model (with method and wrap_options); none was given. "
    "BayesianModule.load_from_checkpoint(path) rebuilds the model by itself only if the module was made with "
    "model= as a class path (e.g. model={'class_path': 'torchvision.models.resnet18', 'init_args': "
    "{'num_classes': 10}}); a checkpoint of a module made from an nn.Module instance or from bnn needs "
    "load_from_checkpoint(path, model=MyNet()): a fresh instance of the architecture, whose weights the "
    "checkpoint replaces (the method and wrap options come from the checkpoint)")


def _check_same_wrap(bnn: BayesianModel, method, wrap_options) -> None:
    """Refuses a ``method`` or ``wrap_options`` given with ``bnn`` that differ from those bnn was wrapped with."""
    if method is not None and method != bnn.method:
        raise ValueError(f"method={method!r} differs from bnn's method {bnn.method!r}; accepted: bnn alone, or "
                         "model= with method and wrap_options")
    if wrap_options is None:
        return
    recorded = _wrap_options(bnn)
    if recorded is None:
        raise ValueError("wrap_options are given with a bnn whose wrap arguments are unknown (not made by bw.wrap, "
                         "or params is a callable); accepted: bnn alone, or model= with method and wrap_options")
    mine = {k: _storable(k, v) for k, v in wrap_options.items()}
    differ = sorted(k for k in mine if recorded.get(k, mine[k]) != mine[k] or k not in recorded)
    if differ:
        raise ValueError("wrap_options differ from those bnn was wrapped with: "
                         + ", ".join(f"{k}={mine[k]!r} (bnn: {recorded.get(k, 'not an option')!r})" for k in differ)
                         + "; accepted: bnn alone, or model= with method and wrap_options")


def _wrap_options(bnn: BayesianModel) -> dict | None:
    """``bw.wrap``'s keyword arguments that made ``bnn``, as plain data (None if unknown or not storable)."""
    try:
        return storable_wrap_arguments(bnn)[1]
    except ValueError:
        return None


class BayesianCallback(pl.Callback):
    """Drives a wrapped model's training hooks inside any ``LightningModule``.

    For a ``LightningModule`` of your own that holds ``bnn`` (as an attribute, so
    that it is a submodule) and returns ``bnn.loss(x, y).loss`` from its
    ``training_step``, with an optimizer built from ``bnn.param_groups()`` (plus
    any other parameters of your module):

    * ``on_train_start``: ``bnn.before_fit(num_steps, optimizer, steps_per_epoch)``
      with the optimizer that holds bnn's parameters, num_steps =
      ``trainer.estimated_stepping_batches`` − ``trainer.global_step`` (``None`` if
      unbounded) and steps_per_epoch = ⌈``num_training_batches`` /
      ``accumulate_grad_batches``⌉ (Lightning steps after an epoch's last batch);
      under a data-parallel strategy every rank first takes rank 0's random state
      (:func:`bayeswrap.core.distributed.sync_random_state_`, with an SGLD optimizer's
      generator), so that the ranks draw the same weights and noise;
    * ``on_train_batch_start``: puts the model's structure back in bnn's train/eval
      mode (Lightning restores ``module.training`` flags after validation without
      calling ``train()``, which bayeswrap's storage-free copy needs);
    * ``on_train_batch_end``: ``bnn.after_step()`` once per optimizer step taken
      (``trainer.global_step`` advanced), so gradient accumulation counts steps,
      not batches;
    * ``on_train_epoch_end``: under a data-parallel strategy, the mean over the ranks
      of the model's buffers (BatchNorm statistics, as :func:`bayeswrap.fit` takes),
      so that the replicas stay identical; then a ``FloatingPointError`` naming the
      first trainable parameter of bnn that holds NaN or inf (as :func:`bayeswrap.fit`
      checks);
    * ``on_train_end``: ``bnn.after_fit(trainer.train_dataloader)`` with autograd
      on (leaving ``torch.inference_mode``), then ``bnn.eval()``.

    Args:
        bnn: the wrapped model (any method trained by :func:`bayeswrap.fit`).
        finalize: call ``bnn.after_fit`` when training ends (False: call it
            yourself later, e.g. on a reloaded best checkpoint).

    Raises:
        ValueError: here, if ``bnn`` is not a BayesianModel trained by ``fit`` (MH and
            HMC sample with ``run_chains``) or ``finalize`` is not a bool; when
            training starts, if ``bnn`` is not a submodule of the trained
            ``LightningModule``, no optimizer or more than one holds its parameters,
            or the optimizer is of the wrong class (SGLD and IVON need
            :class:`bayeswrap.optim.SGLD` / :class:`bayeswrap.optim.IVON`).
        FloatingPointError: at the end of an epoch, if a trainable parameter of
            ``bnn`` is NaN or infinite.
    """

    def __init__(self, bnn: BayesianModel, *, finalize: bool = True):
        super().__init__()
        self.bnn = check_trainable(bnn)
        self.finalize = check_bool("finalize", finalize)
        self.start_step = 0  # trainer.global_step when this fit started
        self._stepped = 0  # trainer.global_step at the last after_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bnn = self.bnn
        if not any(m is bnn for m in pl_module.modules()):
            raise ValueError(f"BayesianCallback's bnn is not a submodule of the trained {type(pl_module).__name__}; "
                             "accepted: the LightningModule holds bnn as an attribute (self.bnn = bnn) and "
                             "returns bnn.loss(x, y).loss from its training_step")
        optimizer = self._optimizer(trainer)
        required = bnn.required_optimizer
        if required is not None and not isinstance(optimizer, required):
            raise ValueError(f"a {bnn.method!r} model must be trained with bayeswrap.optim.{required.__name__}, "
                             f"got {type(optimizer).__name__}; the method's update lives in that optimizer")
        total = trainer.estimated_stepping_batches
        num_steps = None if math.isinf(total) else max(0, int(total) - trainer.global_step)
        batches = trainer.num_training_batches
        steps_per_epoch = None if math.isinf(batches) else max(1, math.ceil(batches / trainer.accumulate_grad_batches))
        if distributed.is_distributed():  # every rank makes rank 0's draws (VI weights, Langevin noise), as fit
            distributed.sync_random_state_(model_device(bnn), [getattr(optimizer, "generator", None)])
        bnn.before_fit(num_steps, optimizer, steps_per_epoch=steps_per_epoch)
        self.start_step = self._stepped = trainer.global_step

    def _optimizer(self, trainer: pl.Trainer) -> torch.optim.Optimizer:
        """The one optimizer of the trainer that holds parameters of bnn."""
        ours = {id(p) for p in self.bnn.parameters()}
        holding = [opt for opt in trainer.optimizers
                   if any(id(p) in ours for group in opt.param_groups for p in group["params"])]
        if len(holding) != 1:
            raise ValueError(f"{len(holding)} of the trainer's {len(trainer.optimizers)} optimizers hold parameters "
                             "of bnn; accepted: exactly one, built from bnn.param_groups() (or bnn.parameters()) in "
                             "configure_optimizers")
        return holding[0]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.bnn.model.training != self.bnn.training:  # after Lightning restored the flags of a validation
            self.bnn.train(self.bnn.training)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for _ in range(trainer.global_step - self._stepped):  # 0 while gradients accumulate
            self.bnn.after_step()
        self._stepped = trainer.global_step

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # under a data-parallel strategy: the mean of the ranks' BatchNorm statistics, as fit takes (DDP sends rank
        # 0's buffers at each forward, and each rank then updates them with its own shard)
        distributed.average_(self.bnn.model_buffers.values())
        bad = nonfinite_names((n, p) for n, p in self.bnn.named_parameters() if p.requires_grad)
        if bad:
            raise FloatingPointError(
                f"parameter {parameter_label(bad[0])} contains NaN or inf after epoch {trainer.current_epoch + 1} (after "
                f"{trainer.global_step - self.start_step} optimizer steps of this fit); lower the learning rate, set "
                "the Trainer's gradient_clip_val, or check the optimizer's hyper-parameters")

    def on_train_end(self, trainer, pl_module) -> None:
        if self.finalize:
            with torch.inference_mode(False), torch.enable_grad():  # Laplace's curvature needs autograd
                self.bnn.after_fit(trainer.train_dataloader)
        self.bnn.eval()


class BayesianModule(pl.LightningModule):
    """A ``LightningModule`` that trains, validates and predicts with a wrapped model.

    ``trainer.fit(BayesianModule(bnn, optimizer), train_loader)`` trains ``bnn``
    as ``bw.fit(bnn, train_loader, epochs=max_epochs, optimizer=...)`` does,
    step for step (see the module docstring; the method's hooks are those of a
    :class:`BayesianCallback`, which this module calls from its own hooks rather
    than registering it, as Lightning would re-register it, with a notice, at
    every ``fit``, ``validate`` and ``predict``; a subclass that overrides
    ``on_train_start``, ``on_train_batch_start``, ``on_train_batch_end``,
    ``on_train_epoch_end`` or ``on_train_end`` calls ``super()``'s). Batches are
    ``(inputs, targets)`` pairs or mappings with the targets under
    ``bnn.label_key`` (:func:`bayeswrap.core.batches.batch_pair`).

    Logged (``self.log``, epoch means weighted by batch size):

    * training: ``train_loss``, ``train_nll``, ``train_kl`` and ``train_error``
      (classification), as in :func:`bayeswrap.fit`'s history;
    * validation (``val_``) and test (``test_``) over the whole epoch:
      ``nll`` and ``error`` of the posterior predictive with ``val_num_samples``
      samples (0: the posterior mean; before the posterior exists, e.g. Laplace
      before its curvature or in Lightning's sanity check, the current training
      state), equal to :func:`bayeswrap.evaluate`'s; classification also ``ece``
      (top-label, ``n_bins`` equal-width bins,
      :func:`bayeswrap.evaluation.calibration.ece`) and ``entropy`` (mean entropy of
      the predictive), and with ``val_num_samples`` ≥ 2 the means of
      ``mutual_information``, ``variation_ratio`` and ``predictive_std``
      (:mod:`bayeswrap.evaluation.uncertainty`) over ``val_num_samples`` draws made
      with their own generator (seeded with ``seed`` every epoch, the global
      random state restored after), so validation never changes the training
      draws; regression ``nll`` and ``rmse``.

    ``predict_step`` returns ``bnn.predict(x, num_samples=predict_num_samples)``:
    probabilities (B, K), or ``(mean, variance)`` each (B, D) for a Gaussian
    likelihood; ``trainer.predict`` gives one per batch. Its batches are inputs (a
    tensor, or a mapping without ``bnn.label_key``) or, as in training,
    ``(inputs, targets)`` pairs and labelled mappings, whose targets are ignored.

    The module is made from ``bnn`` (a model from ``bw.wrap``) or from ``model``,
    ``method`` and ``wrap_options`` (the module calls ``bw.wrap(model, method,
    **wrap_options)``). Its hyper-parameters (``self.hparams``, logged and stored in
    checkpoints; see the module docstring) are ``model`` (the class path, or None
    for an instance or ``bnn``), ``method``, ``wrap_options`` (all of wrap's keyword
    arguments, defaults included; None if they are not plain data, e.g. a
    ``params`` callable), ``optimizer``, ``scheduler`` and ``kl_schedule`` (class
    paths; a class such as ``torch.optim.AdamW``, a ``functools.partial`` of one with
    plain-data keywords and a :class:`bayeswrap.KLSchedule` are stored as theirs;
    None for other callables, e.g. a lambda) and the integer and boolean options
    below.

    A class path is a dotted string (``"torch.optim.AdamW"``) or a mapping
    ``{"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}}`` with
    ``init_args`` of plain data. The object it names is imported and checked
    before anything is called: a ``model`` must be an ``nn.Module`` subclass or a
    function annotated to return one (``"torchvision.models.resnet18"``,
    ``"timm.create_model"`` with ``init_args={"model_name": ...}``), an
    ``optimizer`` a ``torch.optim.Optimizer`` subclass (called with
    ``bnn.param_groups()`` and ``init_args``), a ``scheduler`` an ``LRScheduler``
    subclass (called with the optimizer) and a ``kl_schedule`` a
    :class:`bayeswrap.KLSchedule`. Load only checkpoints you trust: their class
    paths are imported.

    Args:
        bnn: the wrapped model (any method trained by :func:`bayeswrap.fit`), or None
            to build it from ``model``.
        optimizer: a callable from parameters to a torch optimizer, called with
            ``bnn.param_groups()``, e.g. ``lambda params: torch.optim.SGD(params, lr=0.1,
            momentum=0.9)``, or a class path (e.g. ``{"class_path": "torch.optim.SGD",
            "init_args": {"lr": 0.1, "momentum": 0.9}}``); SGLD needs
            ``bw.optim.SGLD(params, lr=..., num_data=N)`` and IVON ``bw.optim.IVON(params,
            lr=...)``. None: the module predicts, validates and tests but cannot train.
        model: with ``bnn=None``, the network to wrap: an ``nn.Module`` or a class path
            (which checkpoints store, so that ``load_from_checkpoint(path)`` rebuilds it).
        method: with ``model``, the method's name (:data:`bayeswrap.METHODS`); with ``bnn``
            None or bnn's method.
        wrap_options: with ``model``, ``bw.wrap``'s keyword arguments (``num_data`` is
            required); with ``bnn`` None or those bnn was wrapped with.
        scheduler: ``None``, a callable from the optimizer to a learning-rate
            scheduler or a class path, stepped once per epoch (as fit's ``scheduler``).
        kl_schedule: ``None``, a callable ``epoch -> factor ≥ 0`` scaling the KL term
            during an epoch (as fit's ``kl_schedule``, e.g. :class:`bayeswrap.KLSchedule`)
            or a class path of a KLSchedule.
        val_num_samples: S for validation and test predictions, an integer ≥ 0.
        predict_num_samples: S of ``predict_step`` and ``forward``, an integer ≥ 0.
        n_bins: bins of the validation ECE, an integer ≥ 1.
        seed: seed of the generator of the validation uncertainty draws.
        finalize: call ``bnn.after_fit`` when training ends (see :class:`BayesianCallback`).
        compile: ``False``, ``True`` or a mapping of ``torch.compile`` keyword arguments, as
            :func:`bayeswrap.fit`'s ``compile``: ``training_step``'s loss and its backward run as one compiled
            graph (compiled anew at each ``trainer.fit``; the first step and batches of other shapes run
            eagerly; :mod:`bayeswrap.compiled`). Stored in the hyper-parameters when it is plain data.

    Raises:
        ValueError: for a ``bnn`` that ``fit`` cannot train, neither or both of
            ``bnn`` and ``model``, a ``method`` or ``wrap_options`` that differ from
            bnn's, a ``model`` without ``method``, an ``optimizer``, ``scheduler`` or
            ``kl_schedule`` that is neither None, a callable nor a class path, a class
            path that does not import or names the wrong kind of object, an integer
            option out of range, or (in ``configure_optimizers``) no optimizer, an
            optimizer of the wrong class or over other tensors than bnn's; as
            ``bw.wrap`` for bad wrap options; during
            training as :func:`bayeswrap.fit` (a batch that is not a pair, targets
            that do not fit the likelihood, a bad ``kl_schedule`` factor).
        FloatingPointError: if the training loss is NaN or infinite, with its
            cause (non-finite inputs, parameters diverged in the last update, an
            overflowing initial state), as :func:`bayeswrap.fit` reports it.
    """

    def __init__(self, bnn: BayesianModel | None = None, optimizer: Callable | str | Mapping | None = None, *,
                 model: nn.Module | str | Mapping | None = None, method: str | None = None,
                 wrap_options: Mapping | None = None, scheduler: Callable | str | Mapping | None = None,
                 kl_schedule: Callable | str | Mapping | None = None, val_num_samples: int = 0,
                 predict_num_samples: int = 5, n_bins: int = 15, seed: int = 0, finalize: bool = True,
                 compile: bool | Mapping = False):
        super().__init__()
        self.compile = compile_options(compile)  # checked here; the step is compiled when training starts
        self._compiled_loss: CompiledLoss | None = None
        self.make_optimizer, optimizer_spec = _callable_or_spec("optimizer", optimizer)
        self.make_scheduler, scheduler_spec = _callable_or_spec("scheduler", scheduler)
        if type(kl_schedule) is KLSchedule:  # stored as the class path that rebuilds it
            kl_schedule = {"class_path": "bayeswrap.KLSchedule", "init_args": {
                "warmup_epochs": kl_schedule.warmup_epochs, "ramp_epochs": kl_schedule.ramp_epochs}}
        self.kl_schedule, kl_spec = _callable_or_spec("kl_schedule", kl_schedule)
        self.val_num_samples = check_int("val_num_samples", val_num_samples, minimum=0)
        self.predict_num_samples = check_int("predict_num_samples", predict_num_samples, minimum=0)
        self.n_bins = check_int("n_bins", n_bins, minimum=1)
        self.seed = check_int("seed", seed, minimum=0)
        finalize = check_bool("finalize", finalize)
        if wrap_options is not None and not (isinstance(wrap_options, Mapping)
                                             and all(isinstance(k, str) for k in wrap_options)):
            raise ValueError(f"wrap_options={wrap_options!r} is not accepted; accepted: None or a mapping of "
                             "bw.wrap's keyword arguments, e.g. {'num_data': 50000, 'prior_std': 0.1}")
        model_spec = None
        if bnn is not None:
            if model is not None:
                raise ValueError(f"both bnn and model={_short(model)} are given; accepted: bnn (a model from "
                                 "bw.wrap) or model with method and wrap_options (BayesianModule wraps it)")
            bnn = check_trainable(bnn)
            _check_same_wrap(bnn, method, wrap_options)
        else:
            if model is None:
                raise ValueError(_MISSING_MODEL)
            if not isinstance(method, str):
                raise ValueError(f"method={method!r} is not accepted with model=; accepted: the name of a method "
                                 "(bw.METHODS), e.g. method='vi'")
            if _is_class_path(model):
                model_spec = class_path_spec("model", model)
            elif not isinstance(model, nn.Module):
                raise ValueError(f"model={_short(model)} is not accepted; accepted: an nn.Module, or a class path "
                                 "('pkg.Class' or {'class_path': 'pkg.Class', 'init_args': {...}}) of "
                                 f"{_CLASS_PATH_KINDS['model'][1]}")
            if wrap_options is None:
                raise ValueError("wrap_options=None is not accepted with model=; accepted: bw.wrap's keyword "
                                 "arguments, at least num_data (e.g. {'num_data': 50000}). A checkpoint of a module "
                                 "whose bnn had arguments that cannot be stored (a params callable) stores none: "
                                 "load it with load_from_checkpoint(path, bnn=bw.wrap(MyNet(), method, ...))")
            if model_spec is not None:
                model = _from_spec("model", model_spec)
            bnn = check_trainable(wrap(model, method, **wrap_options))
        self.bnn = bnn
        self.callback = BayesianCallback(bnn, finalize=finalize)  # its hooks run from this module's hooks
        self._outputs: list[tuple] = []  # the evaluation epoch's (predictive, sample probs, targets) per batch
        self._generator: torch.Generator | None = None  # of the uncertainty draws, seeded at each evaluation epoch
        self.save_hyperparameters({
            "model": model_spec, "method": bnn.method, "wrap_options": _wrap_options(bnn),
            "optimizer": optimizer_spec, "scheduler": scheduler_spec, "kl_schedule": kl_spec,
            "val_num_samples": self.val_num_samples, "predict_num_samples": self.predict_num_samples,
            "n_bins": self.n_bins, "seed": self.seed, "finalize": finalize,
            "compile": _storable_or_none("compile", compile)})

    # ------------------------------------------------------------------ set-up
    def configure_optimizers(self):
        if self.make_optimizer is None:
            raise ValueError("optimizer=None: this BayesianModule cannot train (it predicts, validates and tests); "
                             "accepted: optimizer= a callable from parameters to a torch optimizer, or a class path "
                             "such as {'class_path': 'torch.optim.AdamW', 'init_args': {'lr': 1e-3}} (also as "
                             "BayesianModule.load_from_checkpoint(path, optimizer=...))")
        optimizer = self.make_optimizer(self.bnn.param_groups())
        check_optimizer(self.bnn, optimizer)
        if self.make_scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.make_scheduler(optimizer),
                                                         "interval": "epoch"}}

    # the training hooks of the method (BayesianCallback's, called here rather than registered as a callback:
    # a callback from configure_callbacks is re-registered, with a notice, at every trainer.fit/validate/predict)
    def on_train_start(self) -> None:
        self.callback.on_train_start(self.trainer, self)
        self._compiled_loss = None if self.compile is None else CompiledLoss(self.bnn, self.compile)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.callback.on_train_batch_start(self.trainer, self, batch, batch_idx)

    def on_train_epoch_end(self) -> None:
        self.callback.on_train_epoch_end(self.trainer, self)

    def on_train_end(self) -> None:
        self.callback.on_train_end(self.trainer, self)

    def forward(self, x):
        """``bnn.predict(x, num_samples=predict_num_samples)``."""
        return self.bnn.predict(x, num_samples=self.predict_num_samples)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Loads a checkpoint through ``bnn.load_state_dict`` (its checks of non-finite values and keys)."""
        prefix = "bnn."
        if all(k.startswith(prefix) for k in state_dict):
            return self.bnn.load_state_dict({k[len(prefix):]: v for k, v in state_dict.items()}, strict=strict,
                                            assign=assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # ------------------------------------------------------------------ steps
    def _pair(self, batch, where: str):
        return loader_pair(batch, where, self.bnn.label_key, model_device(self.bnn),
                           self.bnn.likelihood.name == "categorical")

    def training_step(self, batch, batch_idx):
        """:func:`bayeswrap.fit`'s step: ``bnn.loss(x, y)`` (KL scaled by ``kl_schedule``), checked, logged."""
        bnn, epoch = self.bnn, self.current_epoch
        x, y = self._pair(batch, f"train_loader batch {batch_idx} of epoch {epoch + 1}")
        factor = 1.0 if self.kl_schedule is None else check_factor(self.kl_schedule(epoch), "kl_schedule")
        out = step_loss(bnn, x, y, factor, self._compiled_loss)
        if not math.isfinite(out.loss.item()):
            raise FloatingPointError(diagnose_nonfinite_loss(bnn, out, x, y, epoch, batch_idx,
                                                              self.trainer.global_step - self.callback.start_step))
        b = y.shape[0]
        metrics = {"train_loss": out.loss.detach(), "train_nll": out.nll.detach(), "train_kl": out.kl.detach()}
        if bnn.likelihood.name == "categorical":
            metrics["train_error"] = (out.logits.detach().argmax(1) != y).double().mean()
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=b, sync_dist=True)
        return out.loss

    def validation_step(self, batch, batch_idx):
        self._evaluation_step(batch, f"the validation loader's batch {batch_idx}")

    def test_step(self, batch, batch_idx):
        self._evaluation_step(batch, f"the test loader's batch {batch_idx}")

    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("val")

    def on_test_epoch_end(self) -> None:
        self._log_evaluation("test")

    def predict_step(self, batch, batch_idx, dataloader_idx: int = 0):
        """The posterior predictive of a batch: ``bnn.predict(x, num_samples=predict_num_samples)``."""
        key = self.bnn.label_key
        if isinstance(batch, (tuple, list)) or (isinstance(batch, Mapping) and key in batch):
            x = batch_pair(batch, f"the predict loader's batch {batch_idx}", key)[0]
        else:
            x = batch
        return self.bnn.predict(to_device(x, model_device(self.bnn)), num_samples=self.predict_num_samples)

    # ------------------------------------------------------------------ evaluation
    def _evaluation_step(self, batch, where: str) -> None:
        """Keeps one batch's predictive (as :func:`bayeswrap.predict_loader`), sample probabilities and targets."""
        bnn = self.bnn
        x, y = self._pair(batch, where)
        if bnn.is_ready():
            pred = bnn.predict(x, num_samples=self.val_num_samples)
        else:  # before the posterior exists (Laplace before after_fit, SGLD before its first kept iterate)
            check_inputs_finite(x)
            pred = bnn._point_predictive(x)
        if bnn.likelihood.name in TOKEN_LIKELIHOODS:  # (B, T, V) → the (n, V) rows of the target tokens
            pred, y = valid_tokens(pred, y, shift=bnn.likelihood.name == "causal_lm")
        sample_probs = None
        if bnn.likelihood.name == "categorical" and self.val_num_samples >= 2 and bnn.is_ready():
            device = model_device(bnn)
            if self._generator is None:
                self._generator = torch.Generator(device).manual_seed(self.seed)
            with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
                logits = bnn.sample_logits(x, self.val_num_samples, generator=self._generator)
            sample_probs = at_least_float32(logits).softmax(-1).cpu()
        pred = tuple(t.cpu() for t in pred) if isinstance(pred, tuple) else pred.cpu()
        self._outputs.append((pred, sample_probs, y.cpu()))

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """Runs ``bnn.after_step()`` per optimizer step taken (:class:`BayesianCallback`), then keeps the global
        random state; :meth:`on_validation_end` puts it back (as :func:`bayeswrap.training.rng_preserved` does for
        :func:`bayeswrap.fit`), so that the validation loader's base seed and sampled predictions do not move the
        training's random stream.
        """
        self.callback.on_train_batch_end(self.trainer, self, outputs, batch, batch_idx)
        device = model_device(self.bnn)
        self._rng_saved = (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    def on_validation_end(self) -> None:
        saved, self._rng_saved = getattr(self, "_rng_saved", None), None
        if saved is not None:
            torch.set_rng_state(saved[0])
            if saved[1] is not None:
                torch.cuda.set_rng_state(saved[1], model_device(self.bnn))

    def on_validation_epoch_start(self) -> None:
        self._outputs, self._generator = [], None

    def on_test_epoch_start(self) -> None:
        self._outputs, self._generator = [], None

    def _log_evaluation(self, prefix: str) -> None:
        """Logs the epoch's NLL, error (RMSE), ECE and uncertainty measures under ``prefix``.

        Under a data-parallel strategy every rank scores the union of all ranks' predictions (gathered in rank
        order), so the logged values are those of the whole evaluation set, the same on every rank.
        """
        outputs, self._outputs = self._outputs, []
        if self.trainer.world_size > 1 and distributed.is_distributed():
            outputs = [o for part in distributed.gather_objects(outputs) for o in part]
        if not outputs:
            return
        y = torch.cat([o[2] for o in outputs])
        if isinstance(outputs[0][0], tuple):
            pred = (torch.cat([o[0][0] for o in outputs]), torch.cat([o[0][1] for o in outputs]))
        else:
            pred = torch.cat([o[0] for o in outputs])
        metrics = score(self.bnn, pred, y)
        if self.bnn.likelihood.name in PROBABILITY_LIKELIHOODS:  # classes, or target tokens
            metrics["ece"] = calibration.ece(pred, y, n_bins=self.n_bins)
            metrics["entropy"] = calibration.predictive_entropy(pred)
            if outputs[0][1] is not None:
                sample_probs = torch.cat([o[1] for o in outputs], 1)
                metrics["mutual_information"] = float(uncertainty.mutual_information(sample_probs).mean())
                metrics["variation_ratio"] = float(uncertainty.variation_ratio(sample_probs).mean())
                metrics["predictive_std"] = float(uncertainty.predictive_std(sample_probs).mean())
        self.log_dict({f"{prefix}_{k}": float(v) for k, v in metrics.items()}, batch_size=len(y),
                      sync_dist=True)  # equal on every rank: the mean changes nothing
