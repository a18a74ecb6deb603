"""Hugging Face ``transformers.Trainer`` integration: :class:`BayesianTrainer` trains, evaluates and saves a
:class:`~bayeswrap.BayesianModel` with the Trainer's own loop, arguments and callbacks.

``BayesianTrainer(model=bnn, args=TrainingArguments(...), train_dataset=..., data_collator=...)`` is a
``transformers.Trainer`` whose documented extension points are filled in with bayeswrap's pieces, so that one
``trainer.train()`` trains ``bnn`` as :func:`bayeswrap.fit` does:

* **Input columns.** The Trainer keeps the dataset columns that the model's ``forward`` names and drops the others
  (``remove_unused_columns=True``, its default). A wrapper's ``forward(x, num_samples)`` names none of
  ``input_ids``, ``attention_mask``, ... so the plain Trainer drops them all. Here the columns are those of the
  *wrapped* model's ``forward`` (a ``peft.PeftModel``'s base model, as the Trainer itself does for peft), plus
  ``bnn.label_key`` (``"labels"``) and the Trainer's ``label_names``.
* **Loss** (``compute_loss``): :func:`bayeswrap.training.step_loss`, i.e. ``bnn.loss(x, y).loss`` =
  ``NLL_mean + kl_weight · KL / num_data`` with the KL counted once per optimizer step. With
  ``gradient_accumulation_steps = k`` the Trainer divides each micro-batch's loss by k
  (``loss_is_scaled_for_ga = False``), so a step's gradient is that of the mean NLL over the k micro-batches plus
  ``KL / num_data`` once: the step of :func:`bayeswrap.fit` on the k micro-batches joined, when they are of equal
  size. A non-finite loss raises :class:`FloatingPointError` with fit's diagnosis (inputs, parameters,
  divergence) instead of the Trainer's silent ``logging_nan_inf_filter``.
* **Optimizer** (``create_optimizer``): the method's own optimizer where it has one (``bnn.required_optimizer``:
  :class:`bayeswrap.optim.SGLD` with ``num_data``, :class:`bayeswrap.optim.IVON`), else the one
  ``TrainingArguments.optim`` names (AdamW by default, with its ``adam_beta1/2``, ``adam_epsilon``), over
  ``bnn.param_groups()``: the Bayesian groups keep ``weight_decay=0`` (their prior is in the loss), the
  point-estimate groups get ``args.weight_decay``. An optimizer passed as ``optimizers=(optimizer, scheduler)``
  is checked as fit checks it (:func:`bayeswrap.training.check_optimizer`) when training starts.
* **Hooks** (a :class:`BayesianHooks` callback the trainer adds): ``bnn.before_fit(num_steps, optimizer,
  steps_per_epoch)`` when training starts (num_steps = ``state.max_steps`` less the steps already taken,
  steps_per_epoch the optimizer steps per epoch); ``bnn.after_step()`` after every optimizer step that was taken
  (``on_optimizer_step``, before the learning-rate scheduler steps, as in fit; an fp16 step skipped for inf/NaN
  gradients is not counted); a ``FloatingPointError`` naming a trainable parameter that became NaN or inf at the
  end of an epoch; and ``bnn.after_fit(train_dataloader)`` when training ends, with autograd on (Laplace fits its
  curvature, SWAG its BatchNorm statistics), then ``bnn.eval()``. A method that sets the learning rate of every
  step itself (SWAG's ``swa_lr``, cyclical SGLD) keeps it over the Trainer's scheduler (whose step would overwrite
  it; a warning says so unless ``lr_scheduler_type`` is constant).
* **Evaluation** (``evaluate``, also during training under ``eval_strategy``): the posterior predictive over the
  evaluation set with ``eval_num_samples`` draws (:func:`bayeswrap.predictive.predict_loader`), scored by
  :func:`bayeswrap.predictive.score` and :func:`bayeswrap.evaluation.calibration.ece`: ``eval_nll``,
  ``eval_error`` and ``eval_ece`` for classification and, per target token (labels ≠ −100, after the causal
  shift), for ``likelihood="causal_lm"`` / ``"token_categorical"``; NLL, RMSE and interval metrics for
  regression. Evaluation during training runs in :func:`bayeswrap.training.rng_preserved` and predicts with the
  current iterate where the posterior does not exist yet (Laplace, SGLD), as fit's validation, so it changes
  nothing in the training. ``predict`` returns the predictive probabilities (or ``(mean, var)``).
* **Checkpoints.** ``save_model`` and each checkpoint folder hold one :func:`bayeswrap.save` file,
  :data:`BAYESWRAP_FILE` (``bw.load(path, fresh_architecture)`` rebuilds the model from it;
  :func:`load_state` loads it into an existing model), beside the Trainer's optimizer, scheduler, RNG and
  trainer-state files. ``trainer.train(resume_from_checkpoint=...)`` loads the Bayesian state (SWAG's moments,
  SGLD's kept draws and counters included) and the Trainer restores the rest; a folder without that file, or
  one written for another method or other ``bw.wrap`` arguments, is refused naming what it holds.
  ``load_best_model_at_end`` loads the best checkpoint's file the same way.

With the same seed, batches in the same order (``TrainingArguments(train_sampling_strategy="sequential")``, or
the same sampler), the same optimizer and a constant learning rate (``lr_scheduler_type="constant"``), the
parameters and predictions equal those of ``bw.fit(bnn, loader, epochs=num_train_epochs, optimizer=...,
grad_clip_norm=max_grad_norm)`` (``tests/test_hf_trainer.py``). The Trainer's scheduler steps once per optimizer
step, fit's once per epoch.

``TrainingArguments(bf16=True)`` computes the loss under accelerate's autocast, as ``fit(autocast_dtype="bf16")``
(tested equal too).

Not supported (refused with a message): ``model_init`` (wrap the model yourself), ``compute_loss_func`` and
``compute_metrics`` (the loss is the Bayesian one, the metrics bayeswrap's), full-batch samplers (MH, HMC:
``run_chains``), an ``optim`` that builds its own parameter groups (GaLore, LOMO), and several GPUs in one process
(``torch.nn.DataParallel``: use one process per GPU).

**Data-parallel** (``torchrun``/``accelerate launch``, one process per device; tested with 2 CPU processes and
gloo): the Bayesian loss runs outside the ``DistributedDataParallel`` wrapper (whose ``forward`` is the
predictive), so :meth:`BayesianTrainer.training_step` averages the gradients over the ranks itself at the last
micro-batch of each optimizer step (:func:`bayeswrap.core.distributed.all_reduce_gradients_`, before the
Trainer clips them): the gradient of ``nll_mean + kl_weight · KL / num_data`` over the global batch, the KL term
counted once. When training starts every rank takes rank 0's parameters, buffers and random state (an SGLD
optimizer's generator too), so all ranks make the same draws; SGLD's iterates and SWAG's moments are then
collected identically on every rank, Laplace's curvature sums over the ranks' shards are all-reduced, and
BatchNorm statistics are averaged over the ranks at the end of each epoch. The posterior equals that of one
process trained on the union of the ranks' batches (accelerate gives rank r the batches r, r + W, ...; with
``train_sampling_strategy="sequential"`` the union of a step is W consecutive batches). ``evaluate`` and
``predict`` gather the ranks' shards of each evaluation step on every rank (in the dataset's order, cut at its
size) and score the whole set on every rank, so every rank returns the one-process metrics.

Transformers is an optional dependency: ``pip install "bayeswrap[hf]"`` (``transformers`` and ``accelerate``,
which the Trainer needs).

Example:
    >>> model = peft.get_peft_model(AutoModelForSequenceClassification.from_pretrained(name, num_labels=2),
    ...                             peft.LoraConfig(r=8, target_modules=["query", "value"], task_type="SEQ_CLS"))
    >>> bnn = bw.wrap(model, "vi", num_data=len(train_set), params="adapters")
    >>> trainer = BayesianTrainer(model=bnn, args=TrainingArguments("out", num_train_epochs=3, learning_rate=1e-3),
    ...                           train_dataset=train_set, eval_dataset=val_set,
    ...                           data_collator=DataCollatorWithPadding(tokenizer), eval_num_samples=8)
    >>> trainer.train()
    >>> trainer.evaluate()          # {"eval_nll": ..., "eval_error": ..., "eval_ece": ..., ...}
    >>> bnn = bw.load("out/checkpoint-300/bayeswrap.pt", fresh_peft_model)
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
from collections.abc import Mapping

import torch

try:
    import accelerate  # noqa: F401  (transformers.Trainer needs it; its own message is less clear)
    import transformers
    from transformers.trainer_utils import PredictionOutput
except ImportError as err:  # an optional extra
    raise ImportError('bayeswrap.hf needs Hugging Face transformers (>= 5) and accelerate: pip install '
                      '"bayeswrap[hf]"') from err
if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"bayeswrap.hf needs transformers >= 5 (its Trainer's extension points), found "
                      f"{transformers.__version__}; pip install -U transformers")

from bayeswrap.core import distributed
from bayeswrap.core.batches import batch_size, loader_pair, take, to_device
from bayeswrap.core.checks import check_bool, check_int
from bayeswrap.core.functional import nonfinite_names
from bayeswrap.core.io import CheckpointError, load_checkpoint
from bayeswrap.core.modules import unwrap_compiled
from bayeswrap.core.token_likelihoods import TOKEN_LIKELIHOODS
from bayeswrap.evaluation import calibration
from bayeswrap.methods.base import BayesianModel
from bayeswrap.methods.persistence import FORMAT, FORMAT_VERSION, save, storable_wrap_arguments
from bayeswrap.predictive import model_device, predict_loader, score
from bayeswrap.training import (
    check_optimizer,
    check_trainable,
    diagnose_nonfinite_loss,
    parameter_label,
    rng_preserved,
    step_loss,
)

__all__ = ["BAYESWRAP_FILE", "BayesianHooks", "BayesianTrainer", "forward_columns", "load_state"]

#: the file name of the :func:`bayeswrap.save` file in a checkpoint folder (and in ``save_model``'s folder)
BAYESWRAP_FILE = "bayeswrap.pt"

#: Trainer arguments this class refuses, and why
_REFUSED = {
    "model_init": "wrap the model yourself and pass model=bw.wrap(model, method, ...)",
    "compute_loss_func": "the loss is the Bayesian one, bnn.loss(x, y) (NLL + kl_weight · KL / num_data)",
    "compute_metrics": "evaluate() returns bayeswrap's NLL, error and ECE of the posterior predictive",
}


def _raw_optimizer(optimizer):
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def forward_columns(bnn: BayesianModel) -> list[str]:
    """The argument names of the wrapped model's ``forward`` (a ``peft.PeftModel``'s base model's).

    These are the dataset columns the Trainer keeps under ``remove_unused_columns=True``.
    """
    inner = bnn.model  # the storage-free copy of the wrapped module (an ensemble's: of its members' architecture)
    get_base = getattr(inner, "get_base_model", None)
    if callable(get_base):
        inner = get_base()
    return [name for name, p in inspect.signature(inner.forward).parameters.items()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def load_state(bnn: BayesianModel, path: str | os.PathLike) -> None:
    """Loads the state of a :func:`bayeswrap.save` file into ``bnn``, which must have been wrapped alike.

    :func:`bayeswrap.load` rebuilds a new model from a fresh architecture; this loads into an existing one (its
    Parameters stay the same objects, so an optimizer over them stays valid), as resuming a Trainer needs.

    Args:
        bnn: the model to load into.
        path: a file written by :func:`bayeswrap.save`.

    Raises:
        bayeswrap.core.io.CheckpointError: naming the file, if it is missing, damaged or changed since it was
            written (:func:`bayeswrap.core.io.load_checkpoint`), was not written by ``bw.save``, or holds another
            method, other ``bw.wrap`` arguments or a state that does not load into ``bnn`` (naming both).
    """
    contents = load_checkpoint(path, required={"format": str})
    if contents["format"] != FORMAT or contents.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a file written by bayeswrap.save (format {contents['format']!r}, "
                              f"version {contents.get('format_version')!r}); accepted: a file from bw.save(bnn, path) "
                              f"(format {FORMAT!r}, version {FORMAT_VERSION})")
    method, arguments = storable_wrap_arguments(bnn)
    if contents.get("method") != method or contents.get("arguments") != arguments:
        theirs = {k: v for k, v in (contents.get("arguments") or {}).items() if arguments.get(k) != v}
        ours = {k: arguments[k] for k in theirs if k in arguments}
        raise CheckpointError(f"{path} holds a {contents.get('method')!r} model wrapped with other arguments "
                              f"({theirs}) than this {method!r} model ({ours}); accepted: a file saved from a "
                              "model wrapped with the same bw.wrap(model, method, ...) call")
    try:
        bnn.load_state_dict(contents["state"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path}: the saved state does not load into this {method!r} model: {err}") from None
    bnn.train(bool(contents.get("training", bnn.training)))


class _WholeSet:
    """Data-parallel evaluation: the batches of every rank's shard of a prepared loader, gathered on every rank, in
    the dataset's order and cut at its size, so that every rank predicts the whole set.

    Accelerate gives rank r the batches r, r + W, ... and completes the last ones with examples from the start
    (``even_batches``); the batches of step k in rank order are the dataset's batches kW ... kW + W − 1.
    """

    def __init__(self, loader):
        try:
            self.size = len(loader.dataset)
        except TypeError:
            raise ValueError("data-parallel evaluation needs a dataset with a length (every rank predicts the whole "
                             "set, gathered from the ranks' shards); accepted: a map-style dataset, or evaluate in "
                             "one process") from None
        self.loader = loader

    def __iter__(self):
        seen = 0
        for batch in self.loader:
            for part in distributed.gather_objects(to_device(batch, "cpu")):
                if seen >= self.size:
                    break
                n = batch_size(part)
                yield part if seen + n <= self.size else take(part, slice(0, self.size - seen))
                seen += n


class BayesianHooks(transformers.TrainerCallback):
    """Calls a wrapped model's training hooks where :func:`bayeswrap.fit` calls them, inside a Trainer's loop.

    :class:`BayesianTrainer` adds one; see the module docstring for where each hook runs.

    Args:
        trainer: the trainer whose model is the BayesianModel.
        finalize: call ``bnn.after_fit`` when training ends (False: call it yourself later).
    """

    def __init__(self, trainer: BayesianTrainer, finalize: bool = True):
        self.trainer = trainer
        self.finalize = check_bool("finalize", finalize)
        self.updates = 0  # optimizer steps taken in this train() call
        self.optimizer = None  # the optimizer whose learning rate the method drives, if it does
        self.lrs: list[float] | None = None  # the learning rates the method set for the next step

    @property
    def bnn(self) -> BayesianModel:
        return self.trainer.bnn

    def on_train_begin(self, args, state, control, optimizer=None, train_dataloader=None, **kwargs):
        optimizer = _raw_optimizer(optimizer)
        check_optimizer(self.bnn, optimizer)
        num_steps = None if state.max_steps is None or state.max_steps <= 0 else state.max_steps - state.global_step
        try:
            steps_per_epoch = max(1, math.ceil(len(train_dataloader) / args.gradient_accumulation_steps))
        except TypeError:  # an iterable dataset without a length
            steps_per_epoch = None
        self.updates = 0
        if distributed.is_distributed():  # identical replicas and draws (VI weights, Langevin noise), as bw.fit
            distributed.broadcast_module_(self.bnn)
            distributed.sync_random_state_(model_device(self.bnn), [getattr(optimizer, "generator", None)])
        self.bnn.before_fit(num_steps, optimizer, steps_per_epoch=steps_per_epoch)
        # a method that drives the learning rate per step (SWAG's swa_lr, cyclical SGLD) records each group's base
        # value under a key of its own (bayeswrap.core.schedules.restore_param_groups); a resumed optimizer holds it
        known = {"params", "initial_lr"} | set(optimizer.defaults) | {k for g in self.bnn.param_groups() for k in g}
        self.optimizer = optimizer if any(set(g) - known for g in optimizer.param_groups) else None
        self.lrs = None
        if self.optimizer is not None and args.lr_scheduler_type not in ("constant", "constant_with_warmup"):
            warnings.warn(f"the {self.bnn.method!r} model sets the learning rate of every step itself, so the "
                          f"Trainer's lr_scheduler_type={str(args.lr_scheduler_type)!r} is not applied (for SWAG "
                          "pass swa_lr=None to train under the Trainer's schedule)", RuntimeWarning, stacklevel=2)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.trainer.accelerator.optimizer_step_was_skipped:  # fp16: inf/NaN gradients, no update
            return
        self.updates += 1
        self.bnn.after_step()
        if self.optimizer is not None:  # the method's learning rate of the next step, which the scheduler overwrites
            self.lrs = [group["lr"] for group in self.optimizer.param_groups]

    def on_step_end(self, args, state, control, **kwargs):
        if self.optimizer is not None and self.lrs is not None:  # after the Trainer's scheduler stepped
            for group, lr in zip(self.optimizer.param_groups, self.lrs):
                group["lr"] = lr

    def on_epoch_end(self, args, state, control, **kwargs):
        distributed.average_(self.bnn.model_buffers.values())  # data-parallel: the ranks' BatchNorm statistics
        bad = nonfinite_names((n, p) for n, p in self.bnn.named_parameters() if p.requires_grad)
        if bad:
            raise FloatingPointError(
                f"parameter {parameter_label(bad[0])} contains NaN or inf after epoch {math.ceil(state.epoch or 0)} "
                f"(after {self.updates} optimizer steps of this train()); lower the learning rate, set max_grad_norm, "
                "or check the optimizer's hyper-parameters")

    def on_train_end(self, args, state, control, train_dataloader=None, **kwargs):
        if self.finalize:
            with torch.inference_mode(False), torch.enable_grad():  # Laplace's curvature needs autograd
                self.bnn.after_fit(train_dataloader)
        self.bnn.eval()


class BayesianTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains a :class:`~bayeswrap.BayesianModel` as :func:`bayeswrap.fit` does.

    Takes every argument of ``transformers.Trainer`` (``args``, ``train_dataset``, ``eval_dataset``,
    ``data_collator``, ``optimizers``, ``callbacks``, ...) except those in the module docstring's "not supported",
    and these:

    Args:
        model: the Bayesian model, ``bw.wrap(model, method, num_data=..., ...)`` (any method trained by
            :func:`bayeswrap.fit`; a ``peft`` model with ``params="adapters"`` too).
        args: ``transformers.TrainingArguments``; ``label_names`` default to ``[bnn.label_key]``.
        eval_num_samples: posterior draws per prediction in ``evaluate``/``predict``, an integer ≥ 0 (0: the
            posterior mean; default 8).
        finalize: call ``bnn.after_fit`` when training ends (default True).
        **kwargs: the other ``transformers.Trainer`` arguments.

    Raises:
        ValueError: if ``model`` is not a BayesianModel that fit trains (naming its type), for
            ``model_init``/``compute_loss_func``/``compute_metrics``, ``eval_num_samples``/``finalize`` out of
            range, or several GPUs in one process (``n_gpu > 1``); during training, a batch without the targets
            ``bnn.label_key`` or with nothing but the targets
            (naming the keys it holds and the columns kept), and an optimizer that is not one of bnn's
            (:func:`bayeswrap.training.check_optimizer`).
        FloatingPointError: for a non-finite loss or parameter, with fit's diagnosis.
    """

    #: ``compute_loss`` returns the mean over one micro-batch; the Trainer divides it by the accumulation steps
    loss_is_scaled_for_ga = False

    def __init__(self, model=None, args=None, *, eval_num_samples: int = 8, finalize: bool = True, **kwargs):
        bnn = check_trainable(unwrap_compiled(model) if isinstance(model, torch.nn.Module) else model, "model",
                              "model=bw.wrap(model, method, num_data=...)",
                              "; a plain transformers model trains with transformers.Trainer")
        for name, why in _REFUSED.items():
            if kwargs.get(name) is not None:
                raise ValueError(f"{name} is not accepted by BayesianTrainer: {why}; accepted: {name}=None")
        self.eval_num_samples = check_int("eval_num_samples", eval_num_samples, minimum=0,
                                          note="posterior draws per prediction; 0: the posterior mean")
        self.bnn = bnn
        super().__init__(model=bnn, args=args, **kwargs)
        if self.args.n_gpu > 1:
            raise ValueError(f"BayesianTrainer trains on one device per process (got n_gpu={self.args.n_gpu}: "
                             "torch.nn.DataParallel over several GPUs of one process, whose replicas the Bayesian "
                             "loss would bypass); accepted: one device per process, e.g. torchrun --nproc_per_node="
                             f"{self.args.n_gpu} (data-parallel, one GPU each) or CUDA_VISIBLE_DEVICES=0")
        if self.args.label_names is None:
            self.label_names = [bnn.label_key]
        self.can_return_loss = True
        self.hooks = BayesianHooks(self, finalize)
        self.add_callback(self.hooks)
        self._nonfinite: str | None = None  # data-parallel: this rank's non-finite loss, raised after the all-reduce

    # ------------------------------------------------------------------ columns
    def _set_signature_columns_if_needed(self) -> None:
        """The columns to keep: the wrapped model's forward arguments, the targets and ``label_names``."""
        if self._signature_columns is None:
            self._signature_columns = list(dict.fromkeys(
                forward_columns(self.bnn) + [self.bnn.label_key, "label", "label_ids"] + list(self.label_names)))

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The method's own optimizer (SGLD, IVON) or ``args.optim``'s, over ``bnn.param_groups()``."""
        if self.optimizer is not None:
            return self.optimizer
        bnn = self.bnn
        groups = bnn.param_groups()
        own = bnn.required_optimizer
        if own is not None:
            accepted = inspect.signature(own).parameters
            extra = {"num_data": bnn.num_data} if "num_data" in accepted else {}
            self.optimizer = own(groups, lr=self.args.learning_rate, **extra)
            return self.optimizer
        if self.optimizer_cls_and_kwargs is not None:
            cls, options = self.optimizer_cls_and_kwargs
        else:
            cls, options = self.get_optimizer_cls_and_kwargs(self.args, bnn)
        special = sorted({"params", "model", "optimizer_dict"} & set(options))
        if special or not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"optim={str(self.args.optim)!r} ({getattr(cls, '__name__', cls)}) builds its own "
                             f"parameter groups{f' ({special})' if special else ''}, so it cannot take "
                             "bnn.param_groups(); accepted: an optimizer class over parameter groups (e.g. optim="
                             "'adamw_torch', 'sgd', 'adagrad', 'rmsprop'), or optimizers=(optimizer over "
                             "bnn.param_groups(), None)")
        options = dict(options)
        for group in groups:
            group.setdefault("weight_decay", self.args.weight_decay)  # posterior groups already carry 0
        self.optimizer = cls(groups, **options)
        return self.optimizer

    # ------------------------------------------------------------------ loss
    def _pair(self, inputs, where: str):
        """``(x, y)`` of a Trainer batch on bnn's device, or a ValueError naming the batch's keys."""
        bnn = self.bnn
        if isinstance(inputs, Mapping):
            keys = list(inputs)
            if bnn.label_key not in inputs or len(keys) < 2:
                self._set_signature_columns_if_needed()
                missing = (f"no targets under label_key={bnn.label_key!r}" if bnn.label_key not in inputs
                           else "nothing but the targets")
                raise ValueError(
                    f"{where} holds {missing} (keys {keys}); the Trainer keeps the columns the wrapped model's forward "
                    f"names plus the targets ({self._signature_columns}); accepted: dataset columns among these "
                    "(rename them), a data collator that makes them, TrainingArguments(remove_unused_columns=False) "
                    "to keep every column, or bw.wrap(..., label_key=...) for targets under another key")
        classification = bnn.likelihood.name == "categorical"
        return loader_pair(inputs, where, bnn.label_key, model_device(bnn), classification)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """``bnn.loss(x, y).loss`` of one micro-batch (the mean NLL + kl_weight · KL / num_data)."""
        bnn = self.bnn
        step = self.state.global_step
        x, y = self._pair(inputs, f"the training batch of step {step + 1}")
        with self.accelerator.autocast():
            out = step_loss(bnn, x, y, 1.0)
        if not bool(torch.isfinite(out.loss)):
            epoch = int(self.state.epoch or 0)
            message = diagnose_nonfinite_loss(bnn, out, x, y, epoch, step, self.hooks.updates)
            if not distributed.is_distributed():
                raise FloatingPointError(message)
            self._nonfinite = self._nonfinite or message  # every rank raises after the gradients' all-reduce
        return (out.loss, {"logits": out.logits}) if return_outputs else out.loss

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The Trainer's step (``compute_loss``, ``accelerator.backward``); data-parallel, at the last micro-batch of
        an optimizer step, the gradients are averaged over the ranks
        (:func:`bayeswrap.core.distributed.all_reduce_gradients_`): the loss runs outside the
        ``DistributedDataParallel`` wrapper (whose ``forward`` would be the predictive), so DDP's own averaging
        does not. A non-finite loss on any rank raises :class:`FloatingPointError` on every rank.
        """
        loss = super().training_step(model, inputs, num_items_in_batch)
        if distributed.is_distributed() and self.accelerator.sync_gradients:
            params = [p for p in self.bnn.parameters() if p.requires_grad]
            _, finite = distributed.all_reduce_gradients_(params, 1, loss_finite=self._nonfinite is None)
            message, self._nonfinite = self._nonfinite, None
            if not finite:
                raise FloatingPointError(message or f"non-finite loss on another rank at step "
                                         f"{self.state.global_step + 1}; that rank's error names the cause")
        return loss

    # ------------------------------------------------------------------ evaluation
    def _predictive(self, dataset, where: str):
        """The posterior predictive and targets over a dataset (the training's random state left as it was)."""
        bnn = self.bnn
        loader = self.get_eval_dataloader(dataset) if where == "eval" else self.get_test_dataloader(dataset)
        if distributed.is_distributed():
            loader = _WholeSet(loader)
        was_training = bnn.training
        bnn.eval()
        try:
            with rng_preserved(model_device(bnn)), torch.no_grad():
                return predict_loader(bnn, loader, self.eval_num_samples, allow_point_estimate=self.is_in_train)
        finally:
            bnn.train(was_training)

    def _metrics(self, predictive, targets, prefix: str) -> dict[str, float]:
        bnn = self.bnn
        metrics = score(bnn, predictive, targets)
        if bnn.likelihood.name == "categorical" or bnn.likelihood.name in TOKEN_LIKELIHOODS:
            metrics["ece"] = calibration.ece(predictive, targets)
        return {f"{prefix}_{k}": float(v) for k, v in metrics.items()}

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """NLL, error and ECE of the posterior predictive over the evaluation set (see the module docstring).

        Args:
            eval_dataset: a dataset (default: the trainer's ``eval_dataset``).
            ignore_keys: unused (the Trainer's signature).
            metric_key_prefix: the prefix of the metric names (``"eval"``).

        Returns:
            ``{f"{prefix}_nll", f"{prefix}_error", f"{prefix}_ece"}`` (classification, per token for a token
            likelihood) or the regression metrics of :func:`bayeswrap.predictive.score`; also logged.
        """
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (BayesianTrainer(eval_dataset=...) or "
                             "evaluate(eval_dataset)); accepted: a dataset of the training set's columns")
        predictive, targets = self._predictive(eval_dataset, "eval")
        metrics = self._metrics(predictive, targets, metric_key_prefix)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        """The posterior predictive over ``test_dataset``: ``PredictionOutput(predictions, label_ids, metrics)``.

        ``predictions`` are the class probabilities (N, K) (for a token likelihood, the rows of the N target
        tokens), or ``(mean, var)`` for regression, as numpy arrays; ``metrics`` as :meth:`evaluate`'s.
        """
        predictive, targets = self._predictive(test_dataset, "test")
        metrics = self._metrics(predictive, targets, metric_key_prefix)
        arrays = tuple(t.numpy() for t in predictive) if isinstance(predictive, tuple) else predictive.numpy()
        return PredictionOutput(predictions=arrays, label_ids=targets.numpy(), metrics=metrics)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Writes :data:`BAYESWRAP_FILE` (``bw.save``) and the training arguments to ``output_dir``."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        save(self.bnn, os.path.join(output_dir, BAYESWRAP_FILE))
        torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Loads the checkpoint folder's :data:`BAYESWRAP_FILE` into bnn (:func:`load_state`)."""
        path = os.path.join(resume_from_checkpoint, BAYESWRAP_FILE)
        if not os.path.isfile(path):
            held = sorted(os.listdir(resume_from_checkpoint)) if os.path.isdir(resume_from_checkpoint) else None
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r} holds no {BAYESWRAP_FILE} (it holds "
                             f"{held if held is not None else 'nothing: it is not a folder'}); accepted: a checkpoint "
                             "folder written by BayesianTrainer (checkpoint-<step>, with a bw.save file)")
        load_state(self.bnn, path)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's :data:`BAYESWRAP_FILE`."""
        self._load_from_checkpoint(self.state.best_model_checkpoint)
