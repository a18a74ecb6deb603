"""Data-parallel training of a :class:`~bayeswrap.BayesianModel` in a loop of your own, under Hugging Face
``accelerate`` (or any ``DistributedDataParallel`` loop): :class:`TrainingStep` and :class:`FitHooks`.

Two things stand between ``accelerator.prepare(bnn, ...)`` and a correct posterior:

* **The loss must go through the DDP wrapper.** ``accelerator.prepare`` wraps the model in
  ``torch.nn.parallel.DistributedDataParallel``, which averages the ranks' gradients only for a backward of
  an output of *its* ``forward``; a wrapped model's ``forward`` is the posterior predictive, and
  ``bnn.loss(x, y)`` called on the unwrapped model bypasses DDP: every rank would step with its own shard's
  gradient and the replicas would drift apart. :class:`TrainingStep` ``(bnn)`` is a module whose ``forward(x, y)``
  is ``bnn.loss(x, y)`` (:func:`bayeswrap.training.step_loss`, the loss of :func:`bayeswrap.fit`); prepare *it*,
  and DDP averages the gradients of ``nll_mean_rank + kl_weight · KL / num_data`` over the ranks: the gradient of
  the global batch's loss with the KL/prior term counted **once** (``num_data`` stays the whole training set's
  size), as :mod:`bayeswrap.core.distributed` does for :func:`bayeswrap.fit` under ``torchrun``.
* **The method's hooks and random state.** :class:`FitHooks` ``(bnn, optimizer, ...)`` does what
  :func:`bayeswrap.fit` does around its loop, with the same pieces (:mod:`bayeswrap.core.distributed`): when made,
  rank 0's parameters, buffers and random state (CPU, the model's CUDA device, an SGLD optimizer's generator)
  on every rank, so that all ranks make rank 0's draws (VI's weight sample; the Langevin noise, which SGLD adds to
  the parameters and so must be equal on every rank), then ``bnn.before_fit(num_steps, optimizer,
  steps_per_epoch)``; ``bnn.after_step()`` after every optimizer step taken (a step post-hook of the optimizer:
  SGLD keeps its iterates, SWAG its moments, which are therefore equal on every rank; accelerate's skipped steps,
  under gradient accumulation or an fp16 overflow, are not counted); :meth:`FitHooks.end_epoch`: the mean over
  the ranks of the model's buffers (BatchNorm statistics, which each rank updates from its own shard) and a check
  that no parameter is NaN or inf; :meth:`FitHooks.finish` ``(train_loader)``: ``bnn.after_fit`` with autograd on
  (Laplace's curvature: each rank sums over its shard of the prepared loader and the sums are all-reduced, so
  it is the curvature of the whole set; SWAG's BatchNorm statistics for θ_SWA, averaged over the ranks).

With the same seed, the posterior then equals that of one process trained on the union of the ranks' batches
(``tests/test_accelerate_ddp.py``: MAP, VI, SGLD, SWAG, a deep ensemble and Laplace on 2 gloo CPU processes, to
float32 summation order). Without a process group (one process) every collective is a no-op and the same loop
trains as :func:`bayeswrap.fit` does.

Notes:
    * DDP's ``broadcast_buffers=True`` (its default) sends rank 0's buffers at every forward, which for bayeswrap
      include the posterior's state (SWAG's moments, prior means): equal on every rank anyway, so
      ``DistributedDataParallelKwargs(broadcast_buffers=False)`` saves that traffic (BatchNorm statistics are then
      averaged only by :meth:`FitHooks.end_epoch`).
    * Accelerate shards a prepared loader by whole batches (rank r gets batches r, r + W, ...; with
      ``even_batches=True``, its default, the last ones are completed with examples from the start), so a set whose
      size is not a multiple of W × batch size counts some examples twice, also in Laplace's curvature.
    * ``curvature="fisher"`` samples labels per rank: its Monte Carlo draws differ from one process's.
    * SWAG's sampled draws whose BatchNorm statistics are recomputed at prediction time (a Bayesian parameter that
      feeds a BatchNorm layer) use the predicting rank's shard of the loader.

Example:
    >>> from accelerate import Accelerator
    >>> from bayeswrap.accelerate import FitHooks, TrainingStep
    >>> accelerator = Accelerator()
    >>> bnn = bw.wrap(model, "vi", num_data=len(train_set))
    >>> optimizer = torch.optim.AdamW(bnn.param_groups(), lr=1e-3)
    >>> step, optimizer, loader = accelerator.prepare(TrainingStep(bnn), optimizer, train_loader)
    >>> hooks = FitHooks(bnn, optimizer, num_steps=epochs * len(loader), steps_per_epoch=len(loader))
    >>> for epoch in range(epochs):
    ...     for x, y in loader:
    ...         optimizer.zero_grad()
    ...         out = step(x, y)                      # bnn.loss(x, y) through DDP: gradients averaged, KL once
    ...         accelerator.backward(out.loss)
    ...         optimizer.step()                      # then bnn.after_step()
    ...     hooks.end_epoch()
    >>> hooks.finish(loader)                          # bnn.after_fit(loader): Laplace's curvature, SWAG's BN
"""

from __future__ import annotations

import torch
from torch import nn

from bayeswrap.core import distributed
from bayeswrap.core.checks import check_int
from bayeswrap.core.functional import nonfinite_names
from bayeswrap.methods.base import BayesianModel, LossOutput
from bayeswrap.predictive import model_device
from bayeswrap.training import check_optimizer, check_trainable, parameter_label, step_loss

__all__ = ["FitHooks", "TrainingStep"]


def _raw_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


class TrainingStep(nn.Module):
    """``forward(x, y)`` = ``bnn.loss(x, y)``: the module to hand to ``accelerator.prepare`` (or to
    ``DistributedDataParallel``), so that the Bayesian loss runs inside the data-parallel wrapper.

    Its parameters and buffers are ``bnn``'s (``bnn`` is its one submodule): an optimizer over
    ``bnn.param_groups()`` trains it, and ``bnn`` itself predicts, saves and loads as usual.

    Args:
        bnn: the wrapped model (any method trained by :func:`bayeswrap.fit`).

    Raises:
        ValueError: if ``bnn`` is not a BayesianModel that :func:`bayeswrap.fit` trains (naming its type).
    """

    def __init__(self, bnn: BayesianModel):
        super().__init__()
        self.bnn = check_trainable(bnn)

    def forward(self, x, y, kl_factor: float = 1.0) -> LossOutput:
        """``bnn.loss(x, y)`` with the KL weight scaled by ``kl_factor`` (e.g. a :class:`bayeswrap.KLSchedule`'s).

        Returns:
            The :class:`~bayeswrap.methods.base.LossOutput` (``loss``: ``nll_mean + kl_factor · kl_weight · KL /
            num_data``, a scalar; ``nll``, ``kl``, ``logits``).
        """
        return step_loss(self.bnn, x, y, kl_factor)


class FitHooks:
    """The method's training hooks and the ranks' shared state around a training loop of your own.

    See the module docstring for what runs where. Make it after ``accelerator.prepare`` (the DDP wrapper has then
    broadcast rank 0's weights) and before the first step, on every rank.

    Args:
        bnn: the wrapped model being trained.
        optimizer: the optimizer over ``bnn.param_groups()`` (accelerate's ``AcceleratedOptimizer`` or the torch
            optimizer); SGLD and IVON need :class:`bayeswrap.optim.SGLD` / :class:`bayeswrap.optim.IVON`.
        num_steps: the optimizer steps this loop will take (``epochs * len(loader)`` without gradient
            accumulation), or None if unknown (SWAG's ``swa_start="auto"`` needs it).
        steps_per_epoch: optimizer steps per epoch, or None if unknown (SWAG's ``collect_every="auto"`` needs it).

    Attributes:
        steps: the optimizer steps taken since this object was made.

    Raises:
        ValueError: for a ``bnn`` that fit does not train, an optimizer of the wrong class or over other tensors
            than bnn's (:func:`bayeswrap.training.check_optimizer`), a negative ``num_steps`` or a
            ``steps_per_epoch`` < 1, or what the method's ``before_fit`` refuses.
        CollectiveError: (:class:`bayeswrap.core.distributed.CollectiveError`) if another rank died or hung.
    """

    def __init__(self, bnn: BayesianModel, optimizer, *, num_steps: int | None = None,
                 steps_per_epoch: int | None = None):
        self.bnn = check_trainable(bnn)
        self.optimizer = _raw_optimizer(optimizer)
        check_optimizer(self.bnn, self.optimizer)
        if num_steps is not None:
            num_steps = check_int("num_steps", num_steps, minimum=0)
        if steps_per_epoch is not None:
            steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        if distributed.is_distributed():  # identical replicas and draws, as bw.fit under torchrun
            distributed.broadcast_module_(self.bnn)
            distributed.sync_random_state_(model_device(self.bnn), [getattr(self.optimizer, "generator", None)])
        self.bnn.before_fit(num_steps, self.optimizer, steps_per_epoch=steps_per_epoch)
        self.bnn.train()
        self.steps = 0
        self._hook = self.optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        self.bnn.after_step()

    def end_epoch(self) -> None:
        """Averages the model's buffers over the ranks (BatchNorm statistics) and checks the parameters.

        Raises:
            FloatingPointError: naming the first trainable parameter of bnn that holds NaN or inf.
        """
        distributed.average_(self.bnn.model_buffers.values())
        bad = nonfinite_names((n, p) for n, p in self.bnn.named_parameters() if p.requires_grad)
        if bad:
            raise FloatingPointError(f"parameter {parameter_label(bad[0])} contains NaN or inf after {self.steps} "
                                     "optimizer steps; lower the learning rate, clip the gradients, or check the "
                                     "optimizer's hyper-parameters")

    def finish(self, train_loader, finalize: bool = True) -> BayesianModel:
        """Ends training: stops counting steps, runs ``bnn.after_fit(train_loader)`` (with autograd on, outside
        ``torch.inference_mode``; skipped with ``finalize=False``) and puts bnn in eval mode.

        Args:
            train_loader: the training loader (the prepared one: each rank passes over its shard, and Laplace's
                curvature sums are all-reduced).
            finalize: whether to call ``bnn.after_fit``.

        Returns:
            bnn.
        """
        self._hook.remove()
        if finalize:
            with torch.inference_mode(False), torch.enable_grad():  # Laplace's curvature needs autograd
                self.bnn.after_fit(train_loader)
        return self.bnn.eval()
