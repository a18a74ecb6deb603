"""One training loop for every inference method."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from .methods.base import BayesianModel
from .predictive import evaluate, model_device
from .schedules import check_factor


def fit(bnn: BayesianModel, train_loader, *, epochs: int, optimizer: torch.optim.Optimizer, val_loader=None,
        scheduler=None, early_stopping_patience: int | None = None, val_num_samples: int = 0,
        autocast_dtype: torch.dtype | None = None, grad_clip_norm: float | None = None, start_epoch: int = 0,
        on_epoch_end: Callable[[int, dict], None] | None = None, progress: bool = True,
        finalize: bool = True, kl_schedule: Callable[[int], float] | None = None) -> list[dict]:
    """Trains any :class:`BayesianModel`: the same loop for MAP, VI, MC-dropout, SGLD and Laplace.

    Each step minimises ``bnn.loss(x, y).loss`` with ``optimizer`` and then
    calls ``bnn.after_step()`` (SGLD collects its moments there). After the last
    epoch it calls ``bnn.after_fit(train_loader)`` (Laplace fits its curvature
    there).

    Args:
        bnn: the Bayesian model; batches are moved to its device.
        train_loader: any iterable of ``(inputs, targets)`` batches (a DataLoader, a list);
            if it has ``set_epoch(epoch)``, that is called before each epoch.
        epochs: total number of epochs (≥ 1).
        optimizer: any ``torch.optim`` optimizer over ``bnn.parameters()``;
            must be :class:`bayeswrap.optim.SGLD` for an SGLD model.
        val_loader: optional validation batches; enables validation NLL/error in
            the history and early stopping.
        scheduler: optional LR scheduler, stepped once per epoch.
        early_stopping_patience: stop after this many epochs without a lower
            validation NLL and restore the best state (BayesDLL §5 keeps the best
            validation model). ``None`` trains all epochs but still restores the
            best state if ``val_loader`` is given and this is set to 0 or more.
        val_num_samples: S used for validation predictions (0 = posterior mean).
        autocast_dtype: e.g. ``torch.bfloat16`` to run forward passes under autocast.
        grad_clip_norm: optional max gradient norm.
        start_epoch: first epoch index (for resuming).
        on_epoch_end: callback ``(epoch, record)`` after each epoch (e.g. checkpointing).
        progress: show a tqdm progress bar.
        finalize: call ``bnn.after_fit(train_loader)`` at the end (Laplace fits
            its curvature). Pass False to finalise later, e.g. on a reloaded
            best checkpoint.
        kl_schedule: optional KL annealing, a callable ``epoch -> factor`` (0-based
            epoch, factor ≥ 0), e.g. :class:`bayeswrap.schedules.KLSchedule`. During
            an epoch the loss uses ``factor · bnn.kl_weight``; ``bnn.kl_weight``
            itself is left unchanged. Works for every method (it scales the
            KL/prior term).

    Returns:
        History: a list with one dict per epoch: ``epoch``, ``train_loss``,
        ``train_nll``, ``train_kl``, ``train_error`` (classification), ``lr``,
        ``seconds``, ``kl_factor`` (the schedule's factor, 1.0 without one), and
        ``val_nll``/``val_error`` (or ``val_rmse``) with a val loader.

    Raises:
        ValueError: if a model is paired with an optimizer other than its
            ``required_optimizer`` (SGLD needs :class:`bayeswrap.optim.SGLD`), or
            ``epochs`` < 1.
        FloatingPointError: if the loss becomes NaN or infinite (the message says
            where; with early stopping the best state so far is kept).
    """
    required = bnn.required_optimizer
    if required is not None and not isinstance(optimizer, required):
        raise ValueError(f"a {bnn.method!r} model must be trained with bayeswrap.optim.{required.__name__}, "
                         f"got {type(optimizer).__name__}; the method's update lives in that optimizer")
    if int(epochs) != epochs or epochs < 1:
        raise ValueError(f"epochs={epochs!r} must be an integer >= 1")
    try:
        num_steps = (epochs - start_epoch) * len(train_loader)
    except TypeError:  # an iterable without a length
        num_steps = None
    bnn.before_fit(num_steps, optimizer)
    device = model_device(bnn)
    classification = bnn.likelihood.name == "categorical"
    history: list[dict] = []
    best_nll, best_state, bad_epochs = math.inf, None, 0
    for epoch in range(start_epoch, epochs):
        bnn.train()
        tic = time.perf_counter()
        totals = {"loss": 0.0, "nll": 0.0, "kl": 0.0, "errors": 0.0, "n": 0}
        kl_factor = 1.0 if kl_schedule is None else check_factor(kl_schedule(epoch), "kl_schedule")
        if hasattr(train_loader, "set_epoch"):  # e.g. DistributedSampler-style reshuffling per epoch
            train_loader.set_epoch(epoch)
        bar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{epochs}", disable=not progress, leave=False)
        for step, (x, y) in enumerate(bar):
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16,
                                enabled=autocast_dtype is not None):
                out = _loss(bnn, x, y, kl_factor)
            loss_value = out.loss.item()
            if not math.isfinite(loss_value):
                if best_state is not None:
                    bnn.load_state_dict(best_state)
                raise FloatingPointError(
                    f"non-finite loss {loss_value} (nll={out.nll.item()}, kl={out.kl.item()}) at epoch {epoch + 1}, "
                    f"step {step + 1}; lower the learning rate or check the inputs")
            out.loss.backward()
            if grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(bnn.parameters(), grad_clip_norm)
            optimizer.step()
            bnn.after_step()
            b = x.shape[0]
            totals["loss"] += loss_value * b
            totals["nll"] += out.nll.item() * b
            totals["kl"] += out.kl.item() * b
            if classification:
                totals["errors"] += (out.logits.argmax(1) != y).sum().item()
            totals["n"] += b
            bar.set_postfix(loss=totals["loss"] / totals["n"])
        if totals["n"] == 0:
            raise ValueError("train_loader yielded no batches")
        if scheduler is not None:
            scheduler.step()
        record = {"epoch": epoch + 1, "train_loss": totals["loss"] / totals["n"],
                  "train_nll": totals["nll"] / totals["n"], "train_kl": totals["kl"] / totals["n"],
                  "lr": optimizer.param_groups[0]["lr"], "seconds": time.perf_counter() - tic, "kl_factor": kl_factor}
        if classification:
            record["train_error"] = totals["errors"] / totals["n"]
        if val_loader is not None:
            bnn.eval()
            scores = evaluate(bnn, val_loader, val_num_samples, allow_point_estimate=True)
            record.update({f"val_{k}": v for k, v in scores.items()})
            if early_stopping_patience is not None:
                if scores["nll"] < best_nll:
                    best_nll, bad_epochs = scores["nll"], 0
                    best_state = copy.deepcopy(bnn.state_dict())
                else:
                    bad_epochs += 1
        history.append(record)
        if on_epoch_end is not None:
            on_epoch_end(epoch, record)
        if early_stopping_patience is not None and bad_epochs > early_stopping_patience:
            break
    if best_state is not None:
        bnn.load_state_dict(best_state)
    if finalize:
        bnn.after_fit(train_loader)
    bnn.eval()
    return history


def _loss(bnn: BayesianModel, x, y, kl_factor: float):
    """``bnn.loss(x, y)`` with the KL weight scaled by ``kl_factor`` for this call only."""
    if kl_factor == 1.0:
        return bnn.loss(x, y)
    full = bnn.kl_weight
    bnn.kl_weight = full * kl_factor
    try:
        return bnn.loss(x, y)
    finally:
        bnn.kl_weight = full
