"""SWAG: a Gaussian fitted to the SGD trajectory (Maddox et al. 2019, "A Simple Baseline for Bayesian
Uncertainty in Deep Learning", NeurIPS; Algorithm 1 and §3–4).

Training is plain MAP training (the NLL plus the Gaussian prior's L2 pull, see
:class:`~bayeswrap.MAP`) with any optimizer. After ``swa_start`` optimizer steps,
every ``collect_every``-th iterate θ_i is *collected* (Algorithm 1; by default
:data:`COLLECTIONS_PER_EPOCH` = 4 times per epoch, see ``collect_every``):

* it is folded into running first and second moments (Welford's algorithm,
  :func:`~bayeswrap.core.samples.welford_update_`, shared with SGLD):
  θ_SWA = θ̄ = (1/n) Σ_i θ_i and Σ_diag = diag((1/n) Σ_i θ_i² − θ̄²) (§3.2; the
  population variance, as the paper's θ̄² − θ̄²);
* with ``covariance="lowrank"`` its deviation D_i = θ_i − θ̄_i from the running
  mean *after* the update (the paper's "θ_i − θ̄_i") is appended to the
  deviation matrix D̂, a ring buffer of the last K = ``max_rank`` deviations
  (:class:`~bayeswrap.core.samples.RingStore`, §3.3).

The approximate posterior is N(θ_SWA, Σ) with (§3.4)

    Σ = scale · (Σ_diag + D̂ D̂ᵀ / (K − 1)),

sampled without forming Σ as

    θ̃ = θ_SWA + √scale · (Σ_diag^½ z₁ + D̂ z₂ / √(K − 1)),   z₁ ~ N(0, I_d), z₂ ~ N(0, I_K).

At the default ``scale=0.5`` this is exactly the paper's §3.4 sampling equation
θ̃ = θ_SWA + (1/√2) Σ_diag^½ z₁ + (1/√(2(K − 1))) D̂ z₂, i.e. Σ = ½ (Σ_diag + D̂D̂ᵀ/(K − 1)):
the paper's ½ *is* its scale 0.5 (the authors' code, ``SWAG.sample(scale)``, draws
``mean + √scale · (var_sample + cov_sample)`` and the paper's experiments use 0.5).
K is the number of deviations held (``min(n, max_rank)``). With fewer than two
deviations, or ``covariance="diagonal"`` (SWAG-Diag, §3.2), only the diagonal part
is used: Σ = scale · Σ_diag.

**BatchNorm** (§4, the paper's ``bn_update``): the running statistics of a network
with BatchNorm layers belong to the weights they were computed with. They are
recomputed from scratch by a train-mode pass over the first ``bn_update_batches``
batches of the training loader: a cumulative average over batches, as torch's
``momentum=None`` (and ``torch.optim.swa_utils.update_bn``) computes it. The pass is a
functional call with a fresh copy of the buffers: neither the wrapped model nor the
stored statistics are written. What is recomputed, and how often:

* for θ_SWA (``predict(num_samples=0)``, ``to_deterministic()``): once, when ``bayeswrap.fit``
  ends (:meth:`SWAG.after_fit`), kept while the posterior does not change;
* for a sampled θ̃: only where a Bayesian parameter feeds a BatchNorm layer
  (:attr:`SWAG.bn_fed`, traced once by autograd, :mod:`bayeswrap.methods.bn_dependence`).
  Otherwise (e.g. ``params="last_layer"`` on a convolutional network) every draw has
  θ_SWA's statistics, computed once; where one does, each draw gets its own, and inside :meth:`SWAG.shared_draws` (which
  :func:`bayeswrap.predict_loader` enters) the S draws and their statistics are made
  once and reused for every batch of the evaluation, the paper's protocol (each sample
  updated once and then evaluated on the whole test set).

θ_SWA's statistics and the traced dependence are saved with the model
(``state_dict()``'s extra state, so ``bw.save``/``bw.load`` keep them): a loaded model
predicts at θ_SWA, and samples when no Bayesian parameter feeds a BatchNorm layer,
without the training data. The loader is not saved; a loaded model whose draws need
their own statistics needs :meth:`SWAG.set_bn_update_loader` before it samples (it
raises :class:`~bayeswrap.NotFittedError` otherwise, never silently using the
statistics of the last training iterate).

**Learning rate** (§4; Izmailov et al. 2018). By default (``swa_lr="auto"``) the
model drives the optimizer's learning rate per step as the authors' reference
script does (Maddox et al.'s ``experiments/train/run_swag.py``, repository
wjmaddox/swa_gaussian): every parameter group collects at
:data:`SWA_LR_RATIO` = 2 × its own training lr, the ratio of that script's
defaults (``--lr_init 0.01``, ``--swa_lr 0.02``), and reaches it by the script's
``schedule(epoch)`` (``swa_schedule="linear"``): with t = (step − 1)/``swa_start``
(0-based steps; the script uses epochs),

    lr(t) = lr₀                                             for t ≤ 0.5,
    lr(t) = lr₀ + (swa_lr − lr₀) · (t − 0.5)/0.4            for 0.5 < t ≤ 0.9,
    lr(t) = swa_lr                                          for t > 0.9 and while collecting.

``swa_schedule="cosine"`` moves from lr₀ to ``swa_lr`` by a half cosine over the
first ``swa_start`` steps instead. A number ``swa_lr`` is the collection lr of
every group. The paper's CIFAR commands (the same repository's
``experiments/train/README.md``) decay a large lr instead (lr_init 0.05–0.1 to
swa_lr 0.01–0.05 over 300 epochs). For the short runs at a constant moderate lr
that bayeswrap's comparison uses, collecting above the training lr widens the
collected trajectory: on mnist5k (15 epochs, SGD lr 0.05 with momentum 0.9, prior
std 0.3, seeds 0–2; issue 32) these defaults moved SWAG's rotation NLL from 3.34
to 3.02, its noise NLL from 0.82 to 0.63 and its OOD AUROC from 0.868 to 0.882 at
the same error and NLL (ECE rose from 0.034 to 0.045); four collections per epoch
at the training lr alone (seed 0) left rotation NLL at 3.32. On digits (30 epochs)
the test NLL fell from 0.063 to 0.053 with shift and OOD unchanged within a seed's
spread. The linear and cosine schedules agreed within that spread on both.

``swa_lr=None`` leaves the optimizer's learning rate (and any schedule the caller
runs) alone: SWAG then collects at whatever step the optimizer takes, the
constant step size of the paper's analysis (§3, SGD as approximate posterior
sampling) if no schedule is run. A command-line run
with a learning-rate ``scheduler`` or warm-up keeps that schedule (it implies
``swa_lr=None``, :meth:`SWAG.run_options`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from bayeswrap.core import distributed
from bayeswrap.core.batches import batch_pair, check_reiterable, to_device, without_key
from bayeswrap.core.checks import check_choice, check_float, check_int, check_scale
from bayeswrap.core.functional import NamedTensors, call
from bayeswrap.core.reductions import reduce_output
from bayeswrap.core.samples import RingStore, welford_update_, welford_variance
from bayeswrap.core.schedules import restore_param_groups
from bayeswrap.methods.base import NotFittedError, register_method
from bayeswrap.methods.bn_dependence import batchnorm_fed_by
from bayeswrap.methods.map import MAP
from bayeswrap.methods.predictives import Predictive, Sampled
from bayeswrap.predictive import model_device

#: fraction of the fit's optimizer steps before the first collection when ``swa_start="auto"``
SWA_START_FRACTION = 0.5
#: accepted values of ``covariance``
COVARIANCES = ("lowrank", "diagonal")
#: collections per epoch when ``collect_every="auto"``: the paper collects once per epoch over ~140 epochs
#: (CIFAR); the short runs of a comparison (15-30 epochs, half of them collecting) need several per epoch
#: for a rank-20 deviation matrix (issue 32)
COLLECTIONS_PER_EPOCH = 4
#: collection lr / training lr when ``swa_lr="auto"``: ``--swa_lr 0.02`` over ``--lr_init 0.01``, the
#: defaults of Maddox et al.'s reference script ``experiments/train/run_swag.py`` (wjmaddox/swa_gaussian)
SWA_LR_RATIO = 2.0
#: accepted values of ``swa_schedule``, the learning rate before collecting starts (with ``swa_lr``)
SWA_SCHEDULES = ("linear", "cosine")
# key this model adds to the optimizer's param groups while it drives the learning rate (swa_lr)
_BASE_LR = "swag_base_lr"


@register_method("swag", order=60)
class SWAG(MAP):
    """SWA-Gaussian over the Bayesian parameters: moments and a rank-K deviation matrix of the SGD trajectory
    (Maddox et al. 2019); train it with any optimizer (SGD + momentum in the paper).

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        swa_start: optimizer steps before collecting starts: ``"auto"`` (default) =
            ⌊:data:`SWA_START_FRACTION` · T⌋, the first half of the T steps that
            :func:`bayeswrap.fit` will have run in total (steps this model has already
            taken, e.g. before a resume, plus the fit's; fixed when the fit starts); a
            float in (0, 1), that fraction of T; or an integer ≥ 0 (steps). A string
            spelling a number (as the command line passes it) is read as that number.
            The paper starts at roughly half of training (161 of 300 epochs on CIFAR).
        collect_every: optimizer steps between collections: ``"auto"`` (default;
            max(1, ⌊steps_per_epoch / :data:`COLLECTIONS_PER_EPOCH`⌋), i.e. four
            collections per epoch), ``"epoch"`` (once per epoch, the paper's) or an
            integer ≥ 1. ``"auto"`` and ``"epoch"`` are resolved from the
            ``steps_per_epoch`` that :func:`bayeswrap.fit` passes to :meth:`before_fit`.
        max_rank: K, the most deviations held in the low-rank part D̂ (integer ≥ 2;
            the paper's default 20). Memory: K copies of the Bayesian parameters.
        scale: multiplies the sampled covariance, Σ = scale · (Σ_diag + D̂D̂ᵀ/(K − 1));
            a number in [0, 1e18] (0 samples θ_SWA itself). The default 0.5 is the
            paper's covariance Σ_diag/2 + D̂D̂ᵀ/(2(K − 1)). May be changed after training.
        covariance: ``"lowrank"`` (SWAG: diagonal plus low rank) or ``"diagonal"``
            (SWAG-Diag: no deviation matrix is kept).
        swa_lr: the learning rate while collecting: ``"auto"`` (default;
            :data:`SWA_LR_RATIO` = 2 × each parameter group's own lr, the ratio of the
            defaults of Maddox et al.'s ``run_swag.py``), a number > 0 (every group's),
            or ``None`` (also ``"none"``: the optimizer's learning rate is not touched).
            Unless ``None`` the model sets each step's learning rate: ``swa_schedule``
            until ``swa_start``, then ``swa_lr``.
        swa_schedule: the learning rate before collecting starts (with ``swa_lr``):
            ``"linear"`` (default; ``run_swag.py``'s: each group's lr for the first half of
            ``swa_start``, then linear to ``swa_lr`` at 0.9 · ``swa_start``, then ``swa_lr``) or
            ``"cosine"`` (a half cosine from each group's lr to ``swa_lr`` over ``swa_start``).
        bn_update_batches: training batches over which the BatchNorm running statistics
            are recomputed, for θ_SWA and for each draw that a Bayesian parameter feeds
            (integer ≥ 0; default 10; 0 = off, predictions use the statistics of the last
            training iterate). Ignored for networks without BatchNorm. May be changed after
            training (a loaded model then needs :meth:`set_bn_update_loader`).

    Attributes:
        theta: the current SGD iterate (trainable).
        moment_mean, moment_m2: Welford accumulators of the collected iterates (θ_SWA and n · Σ_diag).
        deviations: the :class:`~bayeswrap.core.samples.RingStore` of the last K deviations
            (``None`` with ``covariance="diagonal"``).
        num_steps, num_collected: step and collection counters (0-d int64 buffers).
        bn_fed: the BatchNorm layers that a Bayesian parameter feeds (their statistics are recomputed per draw),
            ``None`` until traced (at the end of ``bayeswrap.fit`` or at the first prediction).

    Raises:
        ValueError: on an invalid option; the message names the value and lists the accepted ones.

    Example:
        >>> bnn = bw.wrap(model, "swag", num_data=len(train_set))  # collects 4 times per epoch at 2 × lr
        >>> opt = torch.optim.SGD(bnn.param_groups(), lr=0.05, momentum=0.9)
        >>> bw.fit(bnn, train_loader, epochs=40, optimizer=opt)    # lr 0.05, then up to 0.1 from epoch 10 to 18
        >>> probs = bnn.predict(x, num_samples=30)
    """

    #: MAP's knob and grid: the prior (the weight decay 1/(N σ²) of the SGD that SWAG follows) changes the
    #: trajectory; the posterior's width is set by the SGD noise
    tuning = MAP.tuning
    #: the paper's recipe, SGD with momentum (these are also the command line's defaults); the collection lr is
    #: swa_lr's (2 × lr by default)
    recommended = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
    reads_train_loader_after_fit = True  # kept for the BatchNorm updates, which iterate it again
    select_best_epoch = False  # the posterior is the moments of the whole collection phase, not one epoch's state
    in_default_comparison = True
    loss_free_state = ("deviations.", "moment_mean.", "moment_m2.")

    @classmethod
    def run_options(cls, run) -> dict:
        """A run with a learning-rate schedule or warm-up keeps it: ``swa_lr=None`` unless the run gives ``swa_lr``
        (the model's own lr schedule and an epoch scheduler would both set the learning rate).

        Raises:
            ValueError: for a run that gives ``swa_lr`` other than None together with a schedule or warm-up.
        """
        if run.scheduler == "constant" and not run.warmup_epochs:
            return {}
        if "swa_lr" not in run.options:
            return {"swa_lr": None}
        if _check_swa_lr(run.options["swa_lr"]) is not None:
            raise ValueError(f"scheduler={run.scheduler!r}, warmup_epochs={run.warmup_epochs}: SWAG with swa_lr="
                             f"{run.options['swa_lr']!r} sets its own step size; accepted: scheduler=constant and "
                             "warmup_epochs=0, or swa_lr=none (the schedule then sets the lr SWAG collects at)")
        return {}

    def __init__(self, model, *, swa_start: int | float | str = "auto", collect_every: int | str = "auto",
                 max_rank: int = 20, scale: float = 0.5, covariance: str = "lowrank",
                 swa_lr: float | str | None = "auto", swa_schedule: str = "linear", bn_update_batches: int = 10,
                 **kwargs):
        self.swa_start = _check_swa_start(swa_start)
        self.collect_every = _check_collect_every(collect_every)
        self._steps_per_epoch: int | None = None  # resolves collect_every="auto"/"epoch" (before_fit)
        self.max_rank = check_int("max_rank", max_rank, minimum=2, note="deviations kept, K")
        self.scale = scale
        if covariance not in COVARIANCES:
            raise ValueError(f"covariance={covariance!r} is not accepted; accepted: {COVARIANCES}")
        self.covariance = covariance
        self.swa_lr = _check_swa_lr(swa_lr)
        self.swa_schedule = check_choice("swa_schedule", swa_schedule, SWA_SCHEDULES)
        self.bn_update_batches = bn_update_batches
        self._auto_swa_start: int | None = None  # swa_start "auto" or a fraction, resolved by before_fit
        self._optimizer: torch.optim.Optimizer | None = None  # driven by swa_lr and swa_schedule during a fit
        self._bn_loader = None  # training batches for the BatchNorm update (after_fit); never serialised
        self._fitting = False  # between before_fit and after_fit
        self.bn_fed: list[str] | None = None  # BatchNorm layers a Bayesian parameter feeds (traced once)
        self._bn_mean: tuple | None = None  # (key, buffers): the statistics recomputed for θ_SWA (saved)
        self._shared: dict | None = None  # inside shared_draws(): the draws and their statistics
        super().__init__(model, **kwargs)
        self._bn_layers = [name for name, m in self.model.named_modules()
                           if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]

    # ------------------------------------------------------------------ settable options
    @property
    def scale(self) -> float:
        """The covariance scale (settable), see the class docstring."""
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = check_scale("scale", value, allow_zero=True)

    @property
    def bn_update_batches(self) -> int:
        """Training batches per sample of the BatchNorm update (settable; 0 = off)."""
        return self._bn_update_batches

    @bn_update_batches.setter
    def bn_update_batches(self, value: int) -> None:
        self._bn_update_batches = check_int("bn_update_batches", value, minimum=0, note="0: no BatchNorm update")

    def _init_posterior(self, init):
        super()._init_posterior(init)
        zeros = {n: torch.zeros_like(t) for n, t in init.items()}
        self.moment_mean = NamedTensors(zeros, trainable=False)
        self.moment_m2 = NamedTensors(zeros, trainable=False)
        self.register_buffer("num_steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("num_collected", torch.zeros((), dtype=torch.long))
        self.deviations = RingStore(init, self.max_rank) if self.covariance == "lowrank" else None

    # ------------------------------------------------------------------ schedule
    def swa_start_steps(self) -> int:
        """``swa_start`` in optimizer steps (an integer itself, or what ``"auto"``/a fraction resolved to).

        Raises:
            RuntimeError: for ``"auto"`` or a fraction before :meth:`before_fit` has run
                (a hand-written training loop: pass an integer, or call ``before_fit`` first).
        """
        if isinstance(self.swa_start, int):
            return self.swa_start
        if self._auto_swa_start is None:
            raise RuntimeError(f"swa_start={self.swa_start!r} is resolved when bayeswrap.fit starts "
                               "(before_fit(num_steps)); with a hand-written training loop pass swa_start as an "
                               "integer number of steps, or call bnn.before_fit(num_steps, optimizer) first")
        return self._auto_swa_start

    def collect_every_steps(self) -> int:
        """``collect_every`` in optimizer steps (``"epoch"``: the steps per epoch P of the fit; ``"auto"``:
        max(1, ⌊P / :data:`COLLECTIONS_PER_EPOCH`⌋)).

        Raises:
            RuntimeError: for ``"auto"`` or ``"epoch"`` before :meth:`before_fit` has learnt the epoch length.
        """
        if isinstance(self.collect_every, int):
            return self.collect_every
        if self._steps_per_epoch is None:
            raise RuntimeError(f"collect_every={self.collect_every!r} is resolved when bayeswrap.fit starts "
                               "(before_fit(num_steps, optimizer, steps_per_epoch)); with a hand-written training "
                               "loop pass collect_every as an integer number of steps, or call before_fit with "
                               "steps_per_epoch first")
        if self.collect_every == "epoch":
            return self._steps_per_epoch
        return max(1, self._steps_per_epoch // COLLECTIONS_PER_EPOCH)

    def _collected_upto(self, step: int) -> int:
        """How many of the steps 1..``step`` collect the iterate: the multiples of ``collect_every`` after ``swa_start``.

        Collections fall on multiples of the interval (with ``"epoch"``: at the end of an epoch, as the paper's
        once-per-epoch collection; with ``"auto"`` at every ⌊P/4⌋-th step), counting only those after the first
        ``swa_start`` steps.
        """
        every = self.collect_every_steps()
        return max(0, step // every - self.swa_start_steps() // every)

    def before_fit(self, num_steps: int | None, optimizer: torch.optim.Optimizer | None = None,
                   steps_per_epoch: int | None = None) -> None:
        """Resolves ``swa_start`` and ``collect_every`` and, unless ``swa_lr`` is None, takes over the optimizer's
        learning rate.

        The plan covers T = (steps already taken by this model) + ``num_steps`` steps,
        so a fit resumed from a checkpoint (its ``num_steps`` counter restored)
        collects exactly as the uninterrupted fit. Unless ``swa_lr`` is None each parameter
        group's base learning rate is recorded in the group (key ``swag_base_lr``, so
        it survives ``optimizer.state_dict()`` and a resume; ``swa_lr="auto"`` is 2 × it)
        and restored by :meth:`after_fit`; an epoch LR scheduler's changes are overwritten
        (pass ``swa_lr=None`` to train under a scheduler).

        Args:
            num_steps: optimizer steps of this fit, or ``None`` if unknown.
            optimizer: the optimizer of the fit.
            steps_per_epoch: batches per epoch (resolves ``collect_every="auto"`` and ``"epoch"``), or ``None``
                if unknown.

        Raises:
            ValueError: if ``swa_start`` is ``"auto"`` or a fraction and ``num_steps``
                is ``None``; if ``collect_every`` is ``"auto"`` or ``"epoch"`` and ``steps_per_epoch``
                is ``None``; if ``swa_lr`` is not None and there is no optimizer; if ``"auto"`` or
                a fraction would collect nothing in this fit (an integer ``swa_start``
                that collects nothing only warns: the fit may be a first stage).
        """
        taken = int(self.num_steps)
        total = None if num_steps is None else taken + int(num_steps)
        if not isinstance(self.collect_every, int):
            if steps_per_epoch is None:
                raise ValueError(f"collect_every={self.collect_every!r} needs the number of batches per epoch, but "
                                 "the train loader has no len(); pass collect_every as an integer number of "
                                 "optimizer steps")
            self._steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
        if not isinstance(self.swa_start, int):
            if total is None:
                raise ValueError(f"swa_start={self.swa_start!r} is a fraction of the fit's optimizer steps, but the "
                                 "train loader has no len(); pass swa_start as an integer number of steps")
            fraction = SWA_START_FRACTION if self.swa_start == "auto" else self.swa_start
            self._auto_swa_start = math.floor(fraction * total)
        if self.swa_lr is not None and optimizer is None:
            raise ValueError(f"swa_lr={self.swa_lr!r}: the model sets the optimizer's learning rate per step, so "
                             "before_fit needs the optimizer; pass swa_lr=None to leave the learning rate alone")
        if total is not None and int(self.num_collected) == 0 and self._collected_upto(total) == 0:
            message = (f"SWAG would collect no iterate: the fit runs optimizer steps {taken + 1}..{total} with "
                       f"swa_start={self.swa_start!r} (= {self.swa_start_steps()} steps) and collect_every="
                       f"{self.collect_every!r} (= {self.collect_every_steps()} steps); train longer, or lower "
                       "swa_start or collect_every")
            if isinstance(self.swa_start, int):
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            else:
                raise ValueError(message)
        self._fitting = True
        if self.swa_lr is not None:  # only now, so that an error above leaves the optimizer untouched
            self._optimizer = optimizer
            for group in optimizer.param_groups:
                group.setdefault(_BASE_LR, group["lr"])
            self._set_lr(taken + 1)

    def lr_at(self, step: int, base_lr: float) -> float:
        """The learning rate this model gives 1-based optimizer ``step`` of a group whose training lr is ``base_lr``.

        With t = (step − 1)/``swa_start`` and s = the group's collection lr (``swa_lr``, or
        :data:`SWA_LR_RATIO` · ``base_lr`` for ``"auto"``): s from step ``swa_start`` + 1 on; before,
        ``"linear"``: ``base_lr`` for t ≤ 0.5, ``base_lr`` + (s − ``base_lr``) · (t − 0.5)/0.4 for
        0.5 < t ≤ 0.9, then s (Maddox et al.'s ``run_swag.py``, ``schedule(epoch)``, per step);
        ``"cosine"``: s + (``base_lr`` − s) · (1 + cos(π t))/2.

        Raises:
            ValueError: if ``swa_lr`` is None (the model does not set the learning rate).
            RuntimeError: for ``swa_start="auto"`` or a fraction before :meth:`before_fit`.
        """
        if self.swa_lr is None:
            raise ValueError("swa_lr=None: the model leaves the optimizer's learning rate alone")
        target = SWA_LR_RATIO * base_lr if self.swa_lr == "auto" else self.swa_lr
        start = self.swa_start_steps()
        if step > start:
            return target
        t = (step - 1) / start
        if self.swa_schedule == "cosine":
            return target + (base_lr - target) * 0.5 * (1.0 + math.cos(math.pi * t))
        if t <= 0.5:
            return base_lr
        if t <= 0.9:
            return base_lr + (target - base_lr) * (t - 0.5) / 0.4
        return target

    def _set_lr(self, step: int) -> None:
        """Sets each group's learning rate for 1-based ``step`` (:meth:`lr_at` of its recorded base lr)."""
        for group in self._optimizer.param_groups:
            group["lr"] = self.lr_at(step, group[_BASE_LR])

    @torch.no_grad()
    def after_step(self) -> None:
        """Counts the step; collects the iterate on the collection grid (Algorithm 1); sets the next learning rate.

        Raises:
            RuntimeError: for ``swa_start="auto"`` or a fraction when :meth:`before_fit` has not run.
        """
        self.swa_start_steps()  # raises before anything changes if swa_start is unresolved
        self.num_steps += 1
        step = int(self.num_steps)
        if self._collected_upto(step) > self._collected_upto(step - 1):
            self.num_collected += 1
            deviation = welford_update_(self.moment_mean.values(), self.moment_m2.values(), self.theta.values(),
                                        int(self.num_collected))
            if self.deviations is not None:
                self.deviations.append(deviation)
        if self._optimizer is not None:
            self._set_lr(step + 1)

    def after_fit(self, train_loader) -> None:
        """Keeps ``train_loader`` for the BatchNorm update and gives the optimizer back its learning rates.

        With BatchNorm layers it recomputes θ_SWA's statistics from the loader; data-parallel (every rank runs
        ``after_fit`` over its own shard), they are then averaged over the ranks, so the replicas stay identical.
        """
        super().after_fit(train_loader)
        if self._optimizer is not None:
            restore_param_groups(self._optimizer, {_BASE_LR: "lr"})
            self._optimizer = None
        self._fitting = False
        self._bn_loader = train_loader
        if self._bn_update_active() and self.is_ready():  # θ_SWA's statistics, saved with the model
            with torch.no_grad():
                # data-parallel: each rank recomputed them from its own shard; their mean over the ranks keeps the
                # replicas identical (the running means are the union's; the variances lack the between-rank spread)
                distributed.average_(self._mean_statistics().values())
            batch = next(iter(train_loader), None) if self.bn_fed is None else None
            if batch is not None:
                x, _ = batch_pair(batch, "the BatchNorm update loader (batch 0)", self.label_key)
                self._trace_bn(to_device(x, model_device(self)))

    def set_bn_update_loader(self, loader) -> None:
        """Sets the training batches of the BatchNorm update (needed after loading a checkpoint).

        Args:
            loader: an iterable of ``(inputs, targets)`` pairs from the training data (e.g.
                the training ``DataLoader``); its first ``bn_update_batches`` batches are
                used for each recomputation (θ_SWA's statistics are recomputed from them too).
                Not saved in ``state_dict()``.

        Raises:
            ValueError: if ``loader`` is not iterable.
        """
        if loader is None or not hasattr(loader, "__iter__"):
            raise ValueError(f"loader={loader!r} is not accepted; accepted: an iterable of (inputs, targets) "
                             "training batches, e.g. a torch DataLoader")
        check_reiterable(loader, "loader", 2, "the BatchNorm update iterates it for every recomputation")
        self._bn_loader = loader
        self._bn_mean = None  # recomputed from these batches

    # ------------------------------------------------------------------ posterior
    def is_ready(self) -> bool:
        return int(self.num_collected) > 0

    def _not_ready_message(self):
        if int(self.num_steps) == 0:
            return ("no SWAG iterate has been collected: this model has counted no optimizer step. SWAG collects "
                    "its iterates in bnn.after_step(), which bayeswrap.fit calls after every step, as does "
                    "bayeswrap.lightning's BayesianCallback (BayesianModule adds it); a hand-written loop must call "
                    "bnn.before_fit(num_steps, optimizer, steps_per_epoch) once and bnn.after_step() after every "
                    "optimizer.step(), and bnn.after_fit(train_loader) at the end")
        start = repr(self.swa_start) + (f" (= {self._auto_swa_start} steps)" if self._auto_swa_start is not None
                                        and not isinstance(self.swa_start, int) else "")
        return (f"no SWAG iterate has been collected yet ({int(self.num_steps)} steps taken, swa_start={start}, "
                f"collect_every={self.collect_every!r}); train for more steps or lower swa_start")

    def _point_estimate(self):
        return self.theta.as_dict()

    def rank(self) -> int:
        """K: the number of deviations the sampled covariance uses (0 with fewer than 2, or SWAG-Diag)."""
        held = 0 if self.deviations is None else len(self.deviations)
        return held if held >= 2 else 0

    def posterior_mean(self):
        """θ_SWA, the running mean of the collected iterates, ``{name: tensor}``.

        Raises:
            NotFittedError: if no iterate has been collected yet.
        """
        self._check_ready()
        return self.moment_mean.as_dict()

    def diagonal_variance(self) -> dict[str, torch.Tensor]:
        """Σ_diag, the population variance of the collected iterates (before ``scale``), ``{name: tensor}``.

        Raises:
            NotFittedError: if no iterate has been collected yet.
        """
        self._check_ready()
        return welford_variance(self.moment_m2.as_dict(), int(self.num_collected))

    def posterior_std(self):
        """Marginal stds of the sampled covariance, sqrt(scale · (Σ_diag + Σ_k D̂_k² / (K − 1))), ``{name: tensor}``.

        Raises:
            NotFittedError: if no iterate has been collected yet.
        """
        var = self.diagonal_variance()
        k = self.rank()
        if k:
            for n, d in self.deviations.stored().items():
                var[n] = var[n] + d.square().sum(0) / (k - 1)
        return {n: (v * self.scale).sqrt_() for n, v in var.items()}

    def _draw(self, num_samples: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """θ̃_s = θ_SWA + √scale · (Σ_diag^½ z₁ + D̂ z₂ / √(K − 1)), s = 1..S (§3.4; see the module docstring).

        z₂ ~ N(0, I_K) is drawn first, shape (S, K) and shared by all parameters; then
        z₁ ~ N(0, I) per parameter in name order, all from ``generator`` (or the
        global RNG), on the parameters' device and dtype.

        Args:
            num_samples: S ≥ 1.
            generator: optional ``torch.Generator`` for reproducible draws.

        Returns:
            ``{name: tensor of shape (S, *param_shape)}``.

        Raises:
            NotFittedError: if no iterate has been collected yet.
        """
        mean, var = self.posterior_mean(), self.diagonal_variance()
        ref = next(iter(mean.values()))
        root, k = math.sqrt(self.scale), self.rank()
        z2 = torch.randn((num_samples, k), generator=generator, device=ref.device, dtype=ref.dtype) if k else None
        stored = self.deviations.stored() if k else {}
        out = {}
        for n, m in mean.items():
            z1 = torch.randn((num_samples, *m.shape), generator=generator, device=m.device, dtype=m.dtype)
            noise = z1.mul_(var[n].sqrt())
            if k:
                noise.add_((z2 @ stored[n].reshape(k, -1)).reshape(noise.shape), alpha=1.0 / math.sqrt(k - 1))
            out[n] = noise.mul_(root).add_(m)
        return out

    # ------------------------------------------------------------------ BatchNorm update
    @property
    def bn_layers(self) -> list[str]:
        """Names of the BatchNorm modules (with running statistics) of the wrapped network."""
        return list(self._bn_layers)

    def _bn_update_active(self) -> bool:
        return bool(self._bn_layers) and self.bn_update_batches > 0 and not self._fitting

    @torch.no_grad()
    def bn_statistics(self, theta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's buffers with every BatchNorm's running statistics recomputed for parameters ``theta``.

        The statistics are reset (mean 0, variance 1, count 0) and re-estimated by a
        train-mode functional forward over the first ``bn_update_batches`` batches of
        the BatchNorm update loader, with ``momentum=None`` (cumulative average over
        batches, each batch weighted equally: torch's ``update_bn``; the paper's
        ``bn_update`` weights by batch size, the same for equal batches). Other
        buffers are copied as they are; nothing stored is changed.

        Args:
            theta: ``{name: tensor}`` for every Bayesian parameter (e.g. one sample).

        Returns:
            ``{buffer name: tensor}`` for every buffer of the wrapped model.

        Raises:
            NotFittedError: if no loader is known (a model loaded from a checkpoint: call
                :meth:`set_bn_update_loader`).
            ValueError: if the loader yields no batch, or a batch that is not an (inputs, targets) pair.
        """
        loader = self._bn_update_loader()
        buffers = {n: b.clone() for n, b in self.model_buffers.items()}
        modules = [self.model.get_submodule(name) for name in self._bn_layers]
        for name in self._bn_layers:
            prefix = f"{name}." if name else ""
            buffers[prefix + "running_mean"].zero_()
            buffers[prefix + "running_var"].fill_(1.0)
            if prefix + "num_batches_tracked" in buffers:
                buffers[prefix + "num_batches_tracked"].zero_()
        tensors = self._call_tensors(theta)
        device = next(iter(theta.values())).device
        momenta, was_training = [m.momentum for m in modules], self.model.training
        seen = 0
        try:
            for m in modules:  # the storage-free copy is this model's own: the wrapped model is never touched
                m.momentum = None
            self.model.train()
            for batch in loader:
                if seen >= self.bn_update_batches:
                    break
                x, _ = batch_pair(batch, f"the BatchNorm update loader (batch {seen})", self.label_key)
                x = to_device(x, device)
                call(self.model, tensors, buffers, x, self.output_key, self.dict_inputs)
                seen += 1
        finally:
            for m, momentum in zip(modules, momenta):
                m.momentum = momentum
            self.model.train(was_training)
        if seen == 0:
            raise ValueError("the BatchNorm update loader yielded no batches; accepted: training batches "
                             "(bnn.set_bn_update_loader(train_loader))")
        return buffers

    def _bn_update_loader(self):
        if self._bn_loader is None:
            fed = (f"a Bayesian parameter feeds BatchNorm layers {self.bn_fed[:3]}, so each sampled θ needs its own "
                   "running statistics" if self.bn_fed else
                   f"the BatchNorm layers' ({self._bn_layers[:3]}) running statistics for θ_SWA")
            raise NotFittedError(
                f"this SWAG model needs BatchNorm statistics recomputed from training batches (Maddox et al. 2019, "
                f"§4): {fed}, but no training loader is known (the model was loaded from a file or checkpoint, or "
                "trained without bayeswrap.fit's after_fit, or bn_update_batches was changed since); call "
                "bnn.set_bn_update_loader(train_loader) first, or set bnn.bn_update_batches = 0 to predict with "
                "the statistics of the last training iterate")
        return self._bn_loader

    def _bn_key(self) -> tuple[int, int, int]:
        """What θ_SWA's statistics depend on besides the loader: (steps, collections, bn_update_batches)."""
        return int(self.num_steps), int(self.num_collected), self.bn_update_batches

    def _mean_statistics(self) -> dict[str, torch.Tensor]:
        """The buffers with BatchNorm statistics recomputed for θ_SWA (:meth:`bn_statistics`), computed once
        while the posterior and ``bn_update_batches`` stay as they are.

        Raises:
            NotFittedError: as :meth:`bn_statistics`, when they must be recomputed and no loader is known.
        """
        if self._bn_mean is None or self._bn_mean[0] != self._bn_key():
            self._bn_mean = (self._bn_key(), self.bn_statistics(self.posterior_mean()))
        return self._bn_mean[1]

    def _trace_bn(self, x) -> list[str]:
        """:attr:`bn_fed`, traced on input ``x`` the first time (see :mod:`bayeswrap.methods.bn_dependence`)."""
        if self.bn_fed is None:
            tensors = self._call_tensors(self.theta.as_dict())
            self.bn_fed = batchnorm_fed_by(self.model, tensors, self.model_buffers.as_dict(),
                                           without_key(x, self.label_key), self.bayesian_names, self._bn_layers,
                                           self.output_key, self.dict_inputs)
        return self.bn_fed

    def _outputs_with(self, theta: Mapping[str, torch.Tensor], x, buffers: Mapping[str, torch.Tensor]):
        """Outputs under Bayesian parameters ``theta`` with ``buffers`` (recomputed BatchNorm statistics)."""
        tensors = self._call_tensors(theta)
        out = call(self.model, tensors, buffers, without_key(x, self.label_key), self.output_key, self.dict_inputs)
        return reduce_output(out, x, self.output_reduction)

    def _forward_bn(self, theta: Mapping[str, torch.Tensor], x) -> torch.Tensor:
        """Outputs under one draw ``theta`` with BatchNorm statistics recomputed for it (Maddox et al. 2019, §4)."""
        return self._outputs_with(theta, x, self.bn_statistics(theta))

    def _forward_mean_statistics(self, theta: Mapping[str, torch.Tensor], x) -> torch.Tensor:
        """Outputs under ``theta`` with θ_SWA's recomputed statistics (those of every draw when no Bayesian
        parameter feeds a BatchNorm layer).
        """
        return self._outputs_with(theta, x, self._mean_statistics())

    @contextlib.contextmanager
    def shared_draws(self):
        """A context in which the S draws of a prediction are reused by every later prediction with at most S
        draws, with their BatchNorm statistics, where a Bayesian parameter feeds a BatchNorm layer.

        :func:`bayeswrap.predict_loader` and :func:`bayeswrap.sample_probs_loader` enter it, so that an
        evaluation over many batches recomputes each draw's statistics once (Maddox et al.'s protocol: each
        sample is updated once and evaluated on the whole test set); the draws come from the ``generator`` of
        the first prediction. Where no Bayesian parameter feeds a BatchNorm layer, or without BatchNorm, it
        changes nothing (each prediction draws afresh). Nested uses share the outer one's draws.

        Example:
            >>> with bnn.shared_draws():
            ...     probs = [bnn.predict(x, num_samples=30) for x, _ in test_loader]
        """
        if self._shared is not None:
            yield self
            return
        self._shared = {"key": None, "draws": [], "statistics": []}
        try:
            yield self
        finally:
            self._shared = None

    def _shared_predictive(self) -> Sampled:
        """The :class:`Sampled` predictive of one prediction inside :meth:`shared_draws`."""
        shared = self._shared
        key = (self._bn_key(), self.scale, self.rank())
        if shared["key"] != key:  # the posterior changed inside the context: draw afresh
            shared.update(key=key, draws=[], statistics=[])
        position = {"drawn": 0, "evaluated": 0}

        def draw(bnn, count, generator):
            start = position["drawn"]
            position["drawn"] += count
            if bnn.bn_fed is not None and not bnn.bn_fed:
                return SWAG._draw(bnn, count, generator)
            missing = start + count - len(shared["draws"])
            if missing > 0:
                new = SWAG._draw(bnn, missing, generator)
                shared["draws"].extend({n: t[i] for n, t in new.items()} for i in range(missing))
                shared["statistics"].extend([None] * missing)
            chosen = shared["draws"][start:start + count]
            return {n: torch.stack([d[n] for d in chosen]) for n in chosen[0]}

        def forward(bnn, theta, x):
            index = position["evaluated"]
            position["evaluated"] += 1
            if not bnn._trace_bn(x):
                return bnn._forward_mean_statistics(theta, x)
            if shared["statistics"][index] is None:
                shared["statistics"][index] = bnn.bn_statistics(theta)
            return bnn._outputs_with(theta, x, shared["statistics"][index])

        return Sampled(draw=draw, forward=forward)

    def default_predictive(self, model: str = "full", **options) -> Predictive:
        """:class:`Sampled`; with BatchNorm (``bn_update_batches`` > 0, outside a fit): where a Bayesian parameter
        feeds a BatchNorm layer each draw is evaluated under its own recomputed statistics (one draw after another;
        Maddox et al. 2019, §4; inside :meth:`shared_draws` made once per draw), else all draws under θ_SWA's.

        Raises:
            ValueError: on a ``model`` other than ``"full"``.
            TypeError: on any other option.
        """
        default = super().default_predictive(model=model, **options)
        if not self._bn_update_active():
            return default
        if self._shared is not None:
            return self._shared_predictive()
        return Sampled(forward=SWAG._forward_draw)

    def _forward_draw(self, theta: Mapping[str, torch.Tensor], x) -> torch.Tensor:
        """One draw's outputs: under its own recomputed statistics where a Bayesian parameter feeds a BatchNorm
        layer, else under θ_SWA's.
        """
        if self._trace_bn(x):
            return self._forward_bn(theta, x)
        return self._forward_mean_statistics(theta, x)

    def _mean_outputs(self, x) -> torch.Tensor:
        """Outputs at θ_SWA, (1, B, ·); with BatchNorm (``bn_update_batches`` > 0, outside a fit) under its own
        recomputed statistics (the paper's ``bn_update`` for the SWA solution; computed once, see
        :meth:`_mean_statistics`).

        Raises:
            NotFittedError: if the network has BatchNorm, the statistics must be recomputed and no update loader
                is known (call :meth:`set_bn_update_loader`).
        """
        if not self._bn_update_active():
            return super()._mean_outputs(x)
        return self._forward_mean_statistics(self.posterior_mean(), x).unsqueeze(0)

    def _deterministic_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers of :meth:`to_deterministic`: with BatchNorm (as in :meth:`_mean_outputs`), the statistics
        recomputed for θ_SWA.
        """
        if not self._bn_update_active():
            return super()._deterministic_buffers()
        return {n: t.clone() for n, t in self._mean_statistics().items()}

    def _apply(self, fn, *args, **kwargs):  # .to(), .double(), ...: the cached statistics follow the buffers
        if self._bn_mean is not None:
            self._bn_mean = (self._bn_mean[0], {n: fn(t) for n, t in self._bn_mean[1].items()})
        if self._shared is not None:
            self._shared.update(key=None, draws=[], statistics=[])
        return super()._apply(fn, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def get_extra_state(self):
        """The base class's, plus :attr:`bn_fed` and θ_SWA's recomputed BatchNorm statistics (with their key)."""
        state = super().get_extra_state()
        if self._bn_layers:
            mean = None if self._bn_mean is None else {"key": list(self._bn_mean[0]), "buffers": self._bn_mean[1]}
            state["batchnorm"] = {"fed": self.bn_fed, "mean_statistics": mean}
        return state

    def set_extra_state(self, state):
        super().set_extra_state(state)
        saved = state.get("batchnorm") or {}
        self.bn_fed = None if saved.get("fed") is None else list(saved["fed"])
        mean = saved.get("mean_statistics")
        if mean is None:
            self._bn_mean = None
        else:
            ours = self.model_buffers.as_dict()
            self._bn_mean = (tuple(int(k) for k in mean["key"]),
                             {n: t.to(ours[n].device) if n in ours else t for n, t in mean["buffers"].items()})


def _check_collect_every(value):
    """``"auto"``, ``"epoch"`` or an integer ≥ 1 (a string spelling one is read as it)."""
    accepted = (f"accepted: 'auto' ({COLLECTIONS_PER_EPOCH} collections per epoch), 'epoch' or an integer >= 1 "
                "(optimizer steps)")
    if isinstance(value, str):
        text = value.strip()
        if text in ("auto", "epoch"):
            return text
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"collect_every={value!r} is not accepted; {accepted}") from None
    return check_int("collect_every", value, minimum=1, note=accepted)


def _check_swa_lr(value):
    """``"auto"``, ``None`` (or ``"none"``) or a number > 0 (a string spelling one is read as it)."""
    accepted = (f"accepted: 'auto' ({SWA_LR_RATIO:g} x each parameter group's lr), None or 'none' (the optimizer's "
                "lr is left alone) or a number > 0")
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        if text == "none":
            return None
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"swa_lr={value!r} is not accepted; {accepted}") from None
    return check_float("swa_lr", value, low=0.0, low_open=True, allow_none=True, note=accepted)


def _check_swa_start(value):
    """``"auto"``, a fraction in (0, 1) or an integer ≥ 0 (a string spelling one is read as it)."""
    accepted = (f"accepted: 'auto' (the first {SWA_START_FRACTION:.0%} of the fit's optimizer steps), a float in "
                "(0, 1) (that fraction of the fit's steps) or an integer >= 0 (optimizer steps)")
    given = value
    if isinstance(value, str):
        text = value.strip()
        if text == "auto":
            return "auto"
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"swa_start={given!r} is not accepted; {accepted}") from None
    if isinstance(value, float) and 0.0 < value < 1.0:
        return float(value)
    try:
        return check_int("swa_start", value, minimum=0)
    except ValueError:
        raise ValueError(f"swa_start={given!r} is not accepted; {accepted}") from None
