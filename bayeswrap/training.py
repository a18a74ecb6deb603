"""One training loop for every inference method."""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable, Mapping

import torch
from tqdm import tqdm

from bayeswrap.compiled import CompiledLoss, compile_options
from bayeswrap.core import distributed
from bayeswrap.core.batches import NonFiniteInputError, batch_size, check_reiterable, loader_pair, tensor_leaves
from bayeswrap.core.checks import check_float, check_int
from bayeswrap.core.functional import nonfinite_names, state_snapshot
from bayeswrap.core.modules import unwrap_compiled
from bayeswrap.core.schedules import check_factor
from bayeswrap.core.token_likelihoods import target_count
from bayeswrap.methods.base import BayesianModel
from bayeswrap.predictive import evaluate, model_device


def fit(bnn: BayesianModel, train_loader, *, epochs: int, optimizer: torch.optim.Optimizer, val_loader=None,
        scheduler=None, early_stopping_patience: int | None = None, val_num_samples: int = 0,
        autocast_dtype: torch.dtype | None = None, grad_clip_norm: float | None = None, start_epoch: int = 0,
        on_epoch_end: Callable[[int, dict], None] | None = None, progress: bool | Mapping = True,
        finalize: bool = True, kl_schedule: Callable[[int], float] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None, compile: bool | Mapping = False) -> list[dict]:
    """Trains any :class:`BayesianModel`: the same loop for MAP, VI, MC-dropout, SGLD and Laplace.

    Each step minimises ``bnn.loss(x, y).loss`` with ``optimizer`` and then
    calls ``bnn.after_step()`` (SGLD collects its moments there). After the last
    epoch it calls ``bnn.after_fit(train_loader)`` (Laplace fits its curvature
    there).

    **Mixed precision.** ``autocast_dtype=torch.bfloat16`` runs the forward
    passes under autocast and needs nothing else. ``torch.float16`` also uses a
    gradient scaler (``grad_scaler``, by default a new
    ``torch.amp.GradScaler(device.type)``): the loss is scaled before
    ``backward()``, the gradients are unscaled before clipping (so
    ``grad_clip_norm`` applies to the true gradients), and a step whose
    gradients hold inf or NaN (fp16 overflow) is skipped and the scale lowered,
    instead of raising; ``bnn.after_step()`` is not called for a skipped step
    (SGLD neither counts it nor keeps its unchanged iterate). A non-finite
    *loss* is still an error. A step counts as skipped when the scaler lowered
    its scale (the default ``backoff_factor=0.5``).

    **Data-parallel training** (``torchrun``; see :mod:`bayeswrap.core.distributed`):
    when a ``torch.distributed`` process group with more than one process is
    initialised, every rank runs this function on its own shard of each global
    batch (e.g. a ``DataLoader`` with a ``DistributedSampler``; its
    ``set_epoch`` is called before each epoch). At the start rank 0's
    parameters, buffers and random state are broadcast, so the replicas start
    equal and make the same random draws (the same SGLD noise, VI sample, IVON
    perturbation). After each ``backward()`` the gradients are averaged over
    ranks, weighted by each rank's batch size, so a step is the step of the
    global batch: ``nll_mean_global + kl_weight · KL / num_data``, with the
    KL/prior term counted once (``num_data`` stays the whole training-set size).
    The history's training metrics are summed over ranks (global means). The
    validation loader is evaluated on every rank and rank 0's scores are used by
    all (pass the whole validation set to every rank). ``on_epoch_end`` runs on
    every rank (write files only where :func:`bayeswrap.core.distributed.is_main_process`).
    BatchNorm normalises with each rank's own batch statistics (for global
    ones the model needs ``torch.nn.SyncBatchNorm``, not tested with bayeswrap);
    its running statistics start as rank 0's and are averaged over the ranks at
    the end of every epoch (the running mean is then the one-process one, the
    running variance lacks the spread between the ranks' batch means).

    Args:
        bnn: the Bayesian model; batches are moved to its device. ``torch.compile(bnn)`` is accepted and
            the BayesianModel it wraps is trained (the same object): the loop calls ``bnn.loss`` and the
            method's hooks (a functional call on a storage-free copy), so compiling the module changes nothing
            in training (its ``forward``, the predictive, stays compiled); ``compile=True`` compiles the step.
        train_loader: any iterable of ``(inputs, targets)`` pairs (a DataLoader, a list); a one-shot
            iterator (a generator) only where it is read once: one epoch, and a method whose ``after_fit`` does
            not read it again (not Laplace or SWAG, unless ``finalize=False``);
            if it has ``set_epoch(epoch)``, that is called before each epoch. Inputs are a
            tensor, a tuple of tensors (the model is called as ``model(x1, x2)``) or a dict
            of named tensors, nested structures included (:mod:`bayeswrap.core.batches`);
            every tensor is moved to bnn's device. Class
            labels of any integer dtype (int32, int16, uint8, ...) are read as int64.
        epochs: total number of epochs, an integer ≥ 1.
        optimizer: a ``torch.optim`` optimizer over ``bnn.parameters()`` (or
            ``bnn.param_groups()``); must be :class:`bayeswrap.optim.SGLD` for an
            SGLD model and :class:`bayeswrap.optim.IVON` for an IVON model. It must
            hold some of bnn's trainable parameters and nothing else (checked by
            identity once, at the start).
        val_loader: optional validation batches; enables validation NLL/error in
            the history and early stopping. The validation runs inside
            :func:`rng_preserved`: it leaves torch's global random state (the training's
            draws) as it found it, so the trained network does not depend on it.
        scheduler: optional LR scheduler (anything with ``step()``), stepped once per epoch.
            Reshuffling: ``train_loader.set_epoch(epoch)`` is called before each epoch if it
            exists, else that of its ``batch_sampler`` or ``sampler`` (a ``DistributedSampler``).
        early_stopping_patience: ``None`` or an integer ≥ 0: stop after more than this
            many epochs without a lower validation NLL and restore the best state
            (BayesDLL §5 keeps the best validation model; 0 stops at the first
            epoch that does not improve). ``None`` trains all epochs.
        val_num_samples: S used for validation predictions, an integer ≥ 0 (0 = posterior mean).
        autocast_dtype: ``None`` (no autocast), ``torch.bfloat16`` or ``torch.float16``
            (or the string aliases ``"bf16"``/``"bfloat16"``, ``"fp16"``/``"float16"``/``"half"``)
            to run forward passes under autocast; float16 adds a gradient scaler (see above).
        grad_clip_norm: ``None`` (no clipping) or the max gradient norm, a finite number > 0.
        start_epoch: first epoch index (for resuming), an integer in [0, epochs).
        on_epoch_end: ``None`` or a callback ``(epoch, record)`` after each epoch (e.g. checkpointing).
        progress: show a tqdm progress bar (only when stderr is a terminal): one bar for the whole fit, over
            every step of every epoch (its ETA is the fit's), described ``epoch k/epochs``, with the running
            training loss and, after each epoch, that epoch's training and validation NLL and error (or RMSE)
            in its postfix; it stays on the terminal when the fit ends. A mapping also shows it, with these
            ``tqdm`` keyword arguments applied over the defaults (e.g. ``{"leave": False}`` to clear it at the
            end, ``{"desc": "vi"}``: a prefix of ``epoch k/epochs``, ``{"disable": False}`` to draw it on a
            stream that is not a terminal). False shows nothing.
        finalize: call ``bnn.after_fit(train_loader)`` at the end (Laplace fits
            its curvature). Pass False to finalise later, e.g. on a reloaded
            best checkpoint.
        kl_schedule: optional KL annealing, a callable ``epoch -> factor`` (0-based
            epoch, factor ≥ 0), e.g. :class:`bayeswrap.core.schedules.KLSchedule`. During
            an epoch the loss uses ``factor · bnn.kl_weight``; ``bnn.kl_weight``
            itself is left unchanged. Works for every method (it scales the
            KL/prior term).
        grad_scaler: ``None`` or a ``torch.amp.GradScaler`` for ``autocast_dtype=float16``
            (pass your own to save and restore its ``state_dict()`` in checkpoints; by
            default fit makes one). Refused with any other ``autocast_dtype``.
        compile: ``False`` (eager steps), ``True`` or a mapping of ``torch.compile`` keyword arguments
            (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``; e.g. ``{"backend": "aot_eager"}``,
            ``{"mode": "max-autotune"}``): the step's loss and its backward run as one compiled graph, the
            method's reference expressions instead of the fused kernels, with no graph break
            (``fullgraph=True`` unless given). The first step and batches of other shapes than the compiled
            one (the last, smaller batch) run eagerly, so an epoch compiles once; the losses and parameters are
            eager's to float rounding (with inductor, eager's random draws too: its ``fallback_random``
            option is set unless a ``mode`` or ``options`` say otherwise). Each fit compiles anew; compilation takes seconds to
            minutes, so it pays on long fits of large models. See :mod:`bayeswrap.compiled`.

    Returns:
        History: a list with one dict per epoch: ``epoch``, ``train_loss``,
        ``train_nll``, ``train_kl``, ``train_error`` (classification), ``lr`` (the
        first parameter group's learning rate during the epoch, before the
        scheduler steps), ``seconds``, ``kl_factor`` (the schedule's factor, 1.0 without one), and
        ``val_nll``/``val_error`` (or ``val_rmse``) with a val loader. With a gradient scaler
        (float16) also ``skipped_steps`` (steps skipped for inf/NaN gradients in the epoch)
        and ``grad_scale`` (the scale at the end of the epoch). With ``compile``, ``compiled_steps``: the
        epoch's steps computed by the compiled graph.

    Raises:
        ValueError: before any step, for an option out of range (each message
            names the value and the accepted ones: ``epochs``, ``start_epoch``,
            ``early_stopping_patience``, ``val_num_samples``, ``grad_clip_norm``,
            ``autocast_dtype``, ``grad_scaler``, ``compile``, non-callable ``kl_schedule``/``on_epoch_end``); for
            an optimizer of the wrong class (SGLD and IVON need their own), or one
            that holds none of bnn's trainable parameters or tensors that are not
            bnn's; a one-shot iterator (a generator) as ``train_loader`` or ``val_loader``
            that this fit would read more than once (naming its type); during training, for a
            batch that is not an ``(inputs, targets)`` pair (the message says what it was), a batch
            of 0 examples (naming the batch and its shapes), an empty loader, or targets that
            do not fit the likelihood; data-parallel: a loader whose number of batches
            differs between ranks.
        FloatingPointError: if the loss becomes NaN or infinite (data-parallel: on any
            rank; every rank raises), with the cause:
            a non-finite input (or target) batch, finite regression targets too large for
            float32's squared error (|y| ≥ 1.8e19: standardise them), parameters that became non-finite
            in the last update (or were before the first), or a non-finite loss
            before any update (initialisation or prior under/overflow: a lower
            learning rate would not help) or after divergence; and if a trainable
            parameter is NaN or infinite at the end of an epoch (checked once per
            epoch, so a NaN from the last step is caught), naming the parameter
            and the epoch. With early stopping the best state so far is restored.
    """
    bnn = check_trainable(unwrap_compiled(bnn))
    epochs = check_int("epochs", epochs, minimum=1)
    start_epoch = check_int("start_epoch", start_epoch, minimum=0, maximum=epochs - 1,
                            note=f"the first epoch to train, < epochs={epochs}")
    early_stopping_patience = check_int("early_stopping_patience", early_stopping_patience, minimum=0,
                                        allow_none=True, note="epochs without a lower validation NLL")
    val_num_samples = check_int("val_num_samples", val_num_samples, minimum=0)
    grad_clip_norm = check_float("grad_clip_norm", grad_clip_norm, low=0.0, low_open=True, allow_none=True,
                                 note="the max gradient norm; None: no clipping")
    autocast_dtype = _autocast_dtype(autocast_dtype)
    scaler = _check_grad_scaler(grad_scaler, autocast_dtype)
    compile_kwargs = compile_options(compile)
    for name, fn in (("kl_schedule", kl_schedule), ("on_epoch_end", on_epoch_end)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name}={fn!r} is not accepted; accepted: None or a callable")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise ValueError(f"scheduler={scheduler!r} has no step() method; accepted: None or a torch.optim.lr_scheduler")
    check_optimizer(bnn, optimizer)
    _check_loaders_reiterable(bnn, train_loader, val_loader, epochs - start_epoch, finalize)
    bar_options = _progress_options(progress)
    try:
        num_steps = (epochs - start_epoch) * len(train_loader)
    except TypeError:  # an iterable without a length
        num_steps = None
    device = model_device(bnn)
    parallel = distributed.is_distributed()
    if parallel:
        if num_steps is not None:
            distributed.check_same_across_ranks("len(train_loader)", len(train_loader))
        _warn_if_not_sharded(train_loader)
        distributed.broadcast_module_(bnn)  # identical replicas: rank 0's parameters and buffers
        distributed.sync_random_state_(device, [getattr(optimizer, "generator", None)])  # identical draws
    if scaler is None and autocast_dtype == torch.float16:
        scaler = torch.amp.GradScaler(device.type)
    bnn.before_fit(num_steps, optimizer, steps_per_epoch=None if num_steps is None else len(train_loader))
    loss_fn = None if compile_kwargs is None else CompiledLoss(bnn, compile_kwargs)
    classification = bnn.likelihood.name == "categorical"
    if autocast_dtype is None:  # no autocast context per step at all (its enter/exit costs ~10 µs)
        autocast = contextlib.nullcontext
    else:
        autocast = functools.partial(torch.autocast, device.type, dtype=autocast_dtype)
    host_totals = device.type == "cpu"  # CPU: Python numbers (.item() is cheap); GPU: device tensors, no sync
    trainable = [(n, p) for n, p in bnn.named_parameters() if p.requires_grad]
    trainable_params = [p for _, p in trainable]
    history: list[dict] = []
    best_nll, best_state, bad_epochs, updates = math.inf, None, 0, 0
    prefix = f"{bar_options['desc']} " if bar_options and bar_options.get("desc") else ""
    bar = _progress_bar(bar_options, num_steps, f"{prefix}epoch {start_epoch + 1}/{epochs}")
    shown = ""  # the last finished epoch's metrics, shown after the running loss
    with bar:  # closed (and left on the terminal) also when training raises
        for epoch in range(start_epoch, epochs):
            bnn.train()
            tic = time.perf_counter()
            totals = {"loss": 0.0, "nll": 0.0, "kl": 0.0, "errors": 0.0, "n": 0}
            skipped = 0
            compiled_before = 0 if loss_fn is None else loss_fn.compiled_steps
            kl_factor = 1.0 if kl_schedule is None else check_factor(kl_schedule(epoch), "kl_schedule")
            _set_epoch(train_loader, epoch)
            bar.set_description(f"{prefix}epoch {epoch + 1}/{epochs}", refresh=False)
            for step, batch in enumerate(train_loader):
                x, y = loader_pair(batch, f"train_loader batch {step} of epoch {epoch + 1}", bnn.label_key, device,
                                   classification)
                optimizer.zero_grad(set_to_none=True)
                with autocast():
                    out = step_loss(bnn, x, y, kl_factor, loss_fn)
                loss_value = out.loss.item()
                finite = math.isfinite(loss_value)
                if not finite and not parallel:
                    message = diagnose_nonfinite_loss(bnn, out, x, y, epoch, step, updates)
                    if best_state is not None:
                        bnn.load_state_dict(best_state)
                    raise FloatingPointError(message)
                (out.loss if scaler is None else scaler.scale(out.loss)).backward()
                if parallel:  # the global batch's gradient; a non-finite loss anywhere stops every rank
                    _, all_finite = distributed.all_reduce_gradients_(trainable_params, batch_size(x),
                                                                        loss_finite=finite)
                    if not all_finite:
                        message = diagnose_nonfinite_loss(bnn, out, x, y, epoch, step, updates) if not finite else (
                            f"non-finite loss on another rank at epoch {epoch + 1}, step {step + 1} (this rank's "
                            f"loss was {loss_value}); that rank's error names the cause")
                        if best_state is not None:
                            bnn.load_state_dict(best_state)
                        raise FloatingPointError(message)
                if scaler is not None:
                    scaler.unscale_(optimizer)  # clip (and step) the true gradients
                if grad_clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(bnn.parameters(), grad_clip_norm)
                if scaler is None:
                    optimizer.step()
                else:
                    scale = scaler.get_scale()
                    scaler.step(optimizer)  # skips optimizer.step() if a gradient is inf or NaN
                    scaler.update()
                    if scaler.get_scale() < scale:  # the step was skipped: no update, nothing to record
                        skipped += 1
                        optimizer.zero_grad(set_to_none=True)
                        _add_totals(totals, out, loss_value, y, classification, host_totals, bnn.likelihood)
                        bar.update()
                        continue
                updates += 1
                bnn.after_step()
                _add_totals(totals, out, loss_value, y, classification, host_totals, bnn.likelihood)
                if not bar.disable:
                    bar.set_postfix_str(f"loss {totals['loss'] / totals['n']:.3g}{shown}", refresh=False)
                    bar.update()
            totals = _totals_as_floats(totals)
            if parallel:  # global means over every rank's examples
                sums = distributed.all_reduce_numbers([totals[k] for k in ("loss", "nll", "kl", "errors", "n")])
                totals = dict(zip(("loss", "nll", "kl", "errors", "n"), sums))
                totals["n"] = int(round(totals["n"]))
                distributed.average_(bnn.model_buffers.values())  # e.g. BatchNorm statistics of each rank's shards
            if totals["n"] == 0:
                raise ValueError(f"train_loader ({type(train_loader).__name__}) yielded no batches in epoch "
                                 f"{epoch + 1}; accepted: a loader with at least one (inputs, targets) batch")
            bad = nonfinite_names(trainable)  # one reduction per tensor, one sync: catches a NaN from the last step
            if bad:
                if best_state is not None:
                    bnn.load_state_dict(best_state)
                raise FloatingPointError(
                    f"parameter {parameter_label(bad[0])} contains NaN or inf after epoch {epoch + 1} (the last of its "
                    f"{updates} updates in this fit diverged although every loss was finite); lower the learning "
                    "rate, set grad_clip_norm, or check the optimizer's hyper-parameters"
                    + ("; the best validation state was restored" if best_state is not None else ""))
            lr = optimizer.param_groups[0]["lr"]  # the learning rate this epoch trained with
            if scheduler is not None:
                scheduler.step()
            record = {"epoch": epoch + 1, "train_loss": totals["loss"] / totals["n"],
                      "train_nll": totals["nll"] / totals["n"], "train_kl": totals["kl"] / totals["n"],
                      "lr": lr, "seconds": time.perf_counter() - tic, "kl_factor": kl_factor}
            if classification:
                record["train_error"] = totals["errors"] / totals["n"]
            if loss_fn is not None:
                record["compiled_steps"] = loss_fn.compiled_steps - compiled_before
            if scaler is not None:
                record["skipped_steps"] = skipped
                record["grad_scale"] = scaler.get_scale()
            if val_loader is not None:
                bnn.eval()
                with rng_preserved(device):  # validation draws nothing from the training's random stream
                    scores = evaluate(bnn, val_loader, val_num_samples, allow_point_estimate=True)
                scores = distributed.broadcast_object(scores)  # rank 0's: the same early-stopping decision everywhere
                record.update({f"val_{k}": v for k, v in scores.items()})
                if early_stopping_patience is not None:
                    if scores["nll"] < best_nll:
                        best_nll, bad_epochs = scores["nll"], 0
                        best_state = state_snapshot(bnn)  # the frozen base by reference, never copied
                    else:
                        bad_epochs += 1
            history.append(record)
            shown = " | " + epoch_summary(record)
            bar.set_postfix_str(epoch_summary(record))  # the bar's final state shows the last epoch's
            if on_epoch_end is not None:
                on_epoch_end(epoch, record)
            if early_stopping_patience is not None and bad_epochs > early_stopping_patience:
                bar.set_description(f"{prefix}epoch {epoch + 1}/{epochs}, stopped early", refresh=False)
                break
    if best_state is not None:
        bnn.load_state_dict(best_state)
    if finalize:
        bnn.after_fit(train_loader)
    bnn.eval()
    return history


def _check_loaders_reiterable(bnn: BayesianModel, train_loader, val_loader, epochs: int, finalize: bool) -> None:
    """Refuses one-shot iterators (generators) as loaders that this fit reads more than once.

    ``train_loader`` is read once per epoch, and once more by ``bnn.after_fit`` when the method reads it there
    (:attr:`~bayeswrap.methods.base.BayesianModel.reads_train_loader_after_fit`: Laplace, SWAG); ``val_loader``
    once per epoch. A generator is thus accepted for a one-epoch fit of the other methods.
    """
    after = finalize and bnn.reads_train_loader_after_fit
    why = f"fit iterates it once per epoch ({epochs} epoch{'s' if epochs > 1 else ''} to train)"
    if after:
        why += f" and the {bnn.method!r} model's after_fit reads it again (finalize=True)"
    check_reiterable(train_loader, "train_loader", epochs + after, why)
    check_reiterable(val_loader, "val_loader", epochs, f"fit evaluates it after each of the {epochs} epochs")


def _progress_options(progress) -> dict | None:
    """``fit``'s ``progress`` as tqdm keyword arguments (None: no bar), or a ValueError naming it."""
    if isinstance(progress, bool):
        return {} if progress else None
    if isinstance(progress, Mapping) and all(isinstance(k, str) for k in progress):
        return dict(progress)
    raise ValueError(f"progress={progress!r} is not accepted; accepted: True, False, or a mapping of tqdm keyword "
                     "arguments (e.g. {'leave': False})")


#: the fit bar's layout with a known number of steps: no rate, so that the epoch's metrics fit on 120 columns
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def _progress_bar(options: dict | None, num_steps: int | None, desc: str) -> tqdm:
    """The fit's bar: off for ``options=None`` and on data-parallel ranks other than 0; else tqdm's own check
    (``disable=None``: off when stderr is not a terminal) unless ``options`` say otherwise.
    """
    if options is None or not distributed.is_main_process():
        return tqdm(disable=True)
    defaults = {"total": num_steps, "disable": None, "leave": True, "unit": "step", "dynamic_ncols": True,
                "desc": desc}
    if num_steps is not None:
        defaults["bar_format"] = BAR_FORMAT
    return tqdm(**{**defaults, **{k: v for k, v in options.items() if k != "desc"}})


def epoch_summary(record: dict) -> str:
    """One epoch of a fit's history in a few words, e.g. ``"train nll 0.312 err 0.0941 | val nll 0.351 err 0.102"``.

    The training and validation NLL and error (or RMSE, for regression) that the record holds, 3 significant
    digits; the progress bar's postfix.
    """
    parts = []
    for split in ("train", "val"):
        values = [f"{name} {record[f'{split}_{key}']:.3g}" for key, name in (("nll", "nll"), ("error", "err"),
                                                                              ("rmse", "rmse"))
                  if isinstance(record.get(f"{split}_{key}"), (int, float))]
        if values:
            parts.append(f"{split} " + " ".join(values))
    return " | ".join(parts)


@contextlib.contextmanager
def rng_preserved(device: torch.device | str | None = None):
    """A context after which torch's global random state (CPU, and ``device``'s if a GPU) is as it was before.

    Evaluation inside a training run goes through it, so the training's random stream (a VI or SGLD draw,
    a dropout mask) does not depend on what is evaluated between epochs: a ``DataLoader`` draws its base seed
    from the global generator at every iteration (unless it has its own ``generator``), and a sampled
    predictive without a ``generator`` draws from it too. Without it a run that also scores the test set
    every epoch (``bayeswrap fit``) would train another network than the same run without (a ``compare``
    tuning candidate).
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    with torch.random.fork_rng(devices=[] if device.type != "cuda" else [device]):
        yield


#: accepted ``autocast_dtype`` values besides None: the dtypes and their common string aliases
AUTOCAST_DTYPES = {torch.bfloat16: torch.bfloat16, torch.float16: torch.float16, "bf16": torch.bfloat16,
                   "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}


def _autocast_dtype(value) -> torch.dtype | None:
    """``autocast_dtype`` as a torch dtype (None, bfloat16 or float16), or a ValueError listing the accepted ones."""
    if value is None:
        return None
    key = value.lower() if isinstance(value, str) else value
    if isinstance(key, (str, torch.dtype)) and key in AUTOCAST_DTYPES:
        return AUTOCAST_DTYPES[key]
    raise ValueError(f"autocast_dtype={value!r} is not accepted; accepted: None, torch.bfloat16, torch.float16, "
                     "or the aliases 'bf16'/'bfloat16' and 'fp16'/'float16'/'half'")


def check_trainable(bnn, argument: str = "bnn", how: str = "from bw.wrap(model, method, ...)",
                    hint: str = "") -> BayesianModel:
    """``bnn`` if it is a :class:`BayesianModel` that :func:`fit` trains (what ``fit``, ``bayeswrap.lightning`` and
    ``bayeswrap.hf`` accept).

    Raises:
        ValueError: naming ``argument`` and the type given, or the method's reason it is not trained by ``fit``
            (full-batch samplers).
    """
    if not isinstance(bnn, BayesianModel):
        raise ValueError(f"{argument} must be a bayeswrap BayesianModel ({how}), got {type(bnn).__name__}{hint}")
    reason = bnn.not_trained_by_fit()
    if reason:
        raise ValueError(reason)
    return bnn


def _add_totals(totals: dict, out, loss_value: float, y, classification: bool, host: bool,
                likelihood=None) -> None:
    """Adds one batch's loss, NLL, KL, errors and size to the epoch totals.

    The batch counts by its number of examples, or for a token likelihood (whose NLL is a mean over the
    batch's target tokens, :mod:`bayeswrap.core.token_likelihoods`) by its number of target tokens, so that
    ``train_nll`` is the epoch's mean NLL per target token, not a mean of batch means.

    ``host=False`` (an accelerator): the NLL, KL and error sums stay float64
    tensors on the device (no sync per step; the same double-precision
    arithmetic as Python floats), and :func:`_totals_as_floats` reads them once
    per epoch. ``host=True`` (CPU): Python numbers, cheaper than tensor ops there.
    """
    b = target_count(likelihood, y)
    totals["loss"] += loss_value * b
    if host:
        totals["nll"] += out.nll.item() * b
        totals["kl"] += out.kl.item() * b
        if classification:
            totals["errors"] += (out.logits.argmax(1) != y).sum().item()
    else:
        totals["nll"] += out.nll.detach().double() * b
        totals["kl"] += out.kl.detach().double() * b
        if classification:
            totals["errors"] += (out.logits.argmax(1) != y).sum()
    totals["n"] += b


def _totals_as_floats(totals: dict) -> dict:
    """The epoch totals as Python numbers (one device sync per total)."""
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in totals.items()}


def _check_grad_scaler(grad_scaler, autocast_dtype):
    """``grad_scaler`` if it fits ``autocast_dtype`` (a GradScaler with float16), else a ValueError."""
    if grad_scaler is None:
        return None
    if not isinstance(grad_scaler, torch.amp.GradScaler):
        raise ValueError(f"grad_scaler={grad_scaler!r} is not accepted; accepted: None or a torch.amp.GradScaler")
    if autocast_dtype != torch.float16:
        raise ValueError(f"grad_scaler is only used with autocast_dtype=torch.float16, got autocast_dtype="
                         f"{autocast_dtype}; accepted: grad_scaler=None for float32 and bfloat16 (whose range "
                         "needs no loss scaling)")
    return grad_scaler


def _set_epoch(loader, epoch: int) -> None:
    """Calls ``set_epoch(epoch)`` of the loader, else of its batch sampler, else of its sampler (the first found)."""
    for obj in (loader, getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if obj is not None and callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)
            return


def _warn_if_not_sharded(loader) -> None:
    """Warns (on rank 0) when a data-parallel fit gets a DataLoader that does not shard its data by rank."""
    sampler = getattr(loader, "sampler", None)
    if sampler is None or hasattr(loader, "set_epoch") or hasattr(getattr(loader, "batch_sampler", None),
                                                                    "set_epoch"):
        return
    if not isinstance(sampler, torch.utils.data.DistributedSampler) and distributed.is_main_process():
        warnings.warn(f"data-parallel fit (world size {distributed.world_size()}) with a DataLoader whose sampler "
                      f"is a {type(sampler).__name__}, not a DistributedSampler: every rank may train on the same "
                      "batches; use DataLoader(dataset, batch_size=global_batch // world_size, "
                      "sampler=DistributedSampler(dataset))", RuntimeWarning, stacklevel=3)


def check_optimizer(bnn: BayesianModel, optimizer) -> None:
    """Refuses an optimizer that cannot train ``bnn``: the wrong class, or parameters that are not bnn's.

    Parameters are compared by identity, once per fit. IVON's optimizer finds its
    model through its mean Parameters (``bayeswrap.optim.link_ivon_parameter``), so
    an IVON optimizer that holds bnn's own Parameters also steps bnn's Hessian.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer over bnn.parameters() (or "
                         f"bnn.param_groups()), got {type(optimizer).__name__}")
    required = bnn.required_optimizer
    if required is not None and not isinstance(optimizer, required):
        raise ValueError(f"a {bnn.method!r} model must be trained with bayeswrap.optim.{required.__name__}, "
                         f"got {type(optimizer).__name__}; the method's update lives in that optimizer")
    ours = {id(p) for p in bnn.parameters() if p.requires_grad}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in held if id(p) not in ours]
    if len(foreign) == len(held):
        raise ValueError(f"the optimizer holds none of bnn's trainable parameters ({len(held)} other tensors, e.g. "
                         "those of the wrapped nn.Module, which bayeswrap copies and never trains), so fit would "
                         "train nothing; accepted: an optimizer built from bnn.parameters() or bnn.param_groups()")
    if foreign:
        shapes = [tuple(p.shape) for p in foreign[:4]]
        raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of bnn (shapes "
                         f"{shapes}{', ...' if len(foreign) > 4 else ''}), e.g. from another model or from before a "
                         "load_state_dict(assign=True); accepted: an optimizer built from bnn.parameters() or "
                         "bnn.param_groups()")


def parameter_label(full_name: str) -> str:
    """``"mean.0/weight"`` (a BayesianModel parameter) → ``"'0.weight' (mean)"``."""
    container, _, mangled = full_name.partition(".")
    return f"{mangled.replace('/', '.')!r} ({container})" if mangled else repr(container)


def diagnose_nonfinite_loss(bnn: BayesianModel, out, x, y, epoch: int, step: int, updates: int) -> str:
    """Why the loss of a step is NaN or inf: its inputs, the parameters, the initial state, or divergence.

    Runs only after a non-finite loss (a few reductions), never on the hot path.
    """
    head = (f"non-finite loss {out.loss.item()} (nll={out.nll.item()}, kl={out.kl.item()}) at epoch {epoch + 1}, "
            f"step {step + 1}")
    for _, t in tensor_leaves(x):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return (f"{head}: the input batch contains {int((~torch.isfinite(t)).sum())} non-finite values "
                    "(NaN or inf); check the data (the parameters are unchanged by this step)")
    if isinstance(y, torch.Tensor) and y.is_floating_point() and not bool(torch.isfinite(y).all()):
        return (f"{head}: the target batch contains {int((~torch.isfinite(y)).sum())} non-finite values "
                "(NaN or inf); check the data")
    bad = nonfinite_names(bnn.named_parameters())
    if bad:
        if updates == 0:
            return (f"{head}: parameter {parameter_label(bad[0])} was already non-finite before the first update of this "
                    "fit (loaded from a bad checkpoint with strict=False, or set by hand?)")
        return (f"{head}: parameter {parameter_label(bad[0])} became non-finite in the last update (optimizer step "
                f"{updates} of this fit): the update diverged; lower the learning rate, set grad_clip_norm, or "
                "check the optimizer's hyper-parameters")
    buffers = nonfinite_names(bnn.model_buffers.items(), nan_only=lambda n: True)
    if buffers:
        return (f"{head}: the model's buffer {buffers[0]!r} contains NaN (e.g. BatchNorm statistics of an earlier "
                "diverged step)")
    scale = _target_scale_overflow(out, y) if not math.isfinite(out.nll.item()) else None
    if scale:
        return f"{head}: {scale}"
    if not math.isfinite(out.kl.item()):
        term = "the KL/prior term is non-finite"
    elif not math.isfinite(out.nll.item()):
        term = "the NLL is non-finite: the model's outputs overflow"
    else:
        term = "kl_weight · KL / num_data overflows"
    if updates == 0:
        return (f"{head}: before any update, with finite inputs and parameters, so the initial state itself "
                f"overflows or underflows ({term}): check the initialisation and the prior scale "
                f"(prior_std={bnn.prior_std}, kl_weight={bnn.kl_weight}, method options such as init_std or "
                "init_log_var) and the scale of the inputs; a lower learning rate would not help")
    return (f"{head}: after {updates} updates, with finite inputs and parameters ({term}): training diverged; "
            "lower the learning rate or set grad_clip_norm")


def _target_scale_overflow(out, y) -> str | None:
    """Why a non-finite NLL comes from finite regression targets too large for the outputs' dtype, else None.

    The Gaussian NLL holds the squared error (y − f)²; with |y| ≥ sqrt(max) of the outputs' dtype (about 1.8e19
    in float32) it overflows unless the model already predicts values of that size, so the cause is the targets'
    scale, not the initialisation or the prior.
    """
    if not (isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel()):
        return None
    dtype = out.logits.dtype if out.logits.is_floating_point() else y.dtype
    largest = float(y.detach().abs().max())
    limit = math.sqrt(torch.finfo(dtype).max)
    if not math.isfinite(largest) or largest < limit:
        return None
    return (f"the regression targets' scale overflows: max |y| = {largest:.3g} (targets of shape {tuple(y.shape)}), "
            f"whose square, the squared error of the Gaussian NLL, exceeds {str(dtype).removeprefix('torch.')}'s "
            f"largest number {torch.finfo(dtype).max:.3g} (|y| must stay below {limit:.3g}); standardise the "
            "targets, y' = (y - mean) / std on the training set, and map predictions back with mean + std * f")


def step_loss(bnn: BayesianModel, x, y, kl_factor: float, loss: Callable | None = None):
    """``bnn.loss(x, y)`` (or ``loss(x, y)``, e.g. a :class:`~bayeswrap.compiled.CompiledLoss` of bnn) with the KL
    weight scaled by ``kl_factor`` for this call only.

    A loss that the model's own check found non-finite because of the inputs (a
    :class:`~bayeswrap.core.batches.NonFiniteInputError` carrying the loss output) is
    returned, so that the caller diagnoses it with the epoch and step
    (:func:`diagnose_nonfinite_loss`); without an output the error is raised.
    """
    full = bnn.kl_weight
    if kl_factor != 1.0:
        bnn.kl_weight = full * kl_factor
    try:
        return (bnn.loss if loss is None else loss)(x, y)
    except NonFiniteInputError as err:
        if err.output is None:
            raise
        return err.output
    finally:
        if kl_factor != 1.0:
            bnn.kl_weight = full
