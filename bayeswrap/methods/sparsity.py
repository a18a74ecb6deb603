"""Sparsity reports, pruning and deployment of variational posteriors.

Every Gaussian-type posterior q(w_i) = N(μ_i, σ_i²) gives each weight a
signal-to-noise ratio and a dropout rate, two views of the same number:

    α_i = σ_i² / μ_i²,    log α_i = log σ_i² − log μ_i²,    SNR_i = |μ_i| / σ_i = exp(−log α_i / 2).

A weight is *pruned* (set to exactly 0, with zero variance) when its posterior
is mostly noise. Two rules:

* ``"log_alpha"``: log α_i > threshold, default 3 (Molchanov et al. 2017,
  "Variational Dropout Sparsifies Deep Neural Networks", §4.4: α > e³ ≈ 20,
  i.e. SNR < 0.22; the default for ``"sparse_vd"`` and ``"kingma_vd"``);
* ``"snr"``: |μ_i / σ_i| < threshold, default 0.83 (Graves 2011, "Practical
  Variational Inference for Neural Networks", §6 pruning by signal-to-noise
  ratio; the default for ``"vi"``). SNR < 0.83 is log α > 0.373.

The report counts every Bayesian parameter (biases too, when they are
Bayesian); the compression ratio is |W| / |W ≠ 0| = total / kept.

Public functions take any :class:`~bayeswrap.BayesianModel`; the methods that
can be pruned (``"vi"``, ``"sparse_vd"``, ``"kingma_vd"``) also have them as
methods through :class:`SparsityMixin`::

    report = bnn.sparsity()                 # rule and threshold of the method by default
    print(report.to_markdown())
    bnn.prune()                             # pruned weights: mean 0, std 0
    net = bnn.to_deterministic()            # a plain nn.Module with the pruned posterior means
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from bayeswrap.core.checks import check_float, check_int
from bayeswrap.methods.base import BayesianModel, NotFittedError

RULES = ("log_alpha", "snr", "inclusion")
DEFAULT_THRESHOLDS = {"log_alpha": 3.0, "snr": 0.83, "inclusion": 0.5}
PRUNED_RHO = -1.0e4  # exp(κ · -1e4) == 0 exactly for κ ≥ 0.7 (N ≥ 1): a VI std of exactly zero

__all__ = ["RULES", "DEFAULT_THRESHOLDS", "NotTrainedError", "TensorSparsity", "SparsityReport", "SparsityMixin",
           "check_rule", "pruning_masks", "sparsity", "prune", "prune_random", "to_deterministic"]


class NotTrainedError(NotFittedError, ValueError):
    """Raised by :func:`to_deterministic` on a posterior that has not taken an optimizer step yet.

    It is both a :class:`~bayeswrap.NotFittedError` (a ``RuntimeError``) and a ``ValueError``.
    """


@dataclass
class TensorSparsity:
    """The pruned count of one parameter tensor.

    Attributes:
        name: parameter name in the wrapped model, e.g. ``"fc0.weight"``.
        shape: the tensor's shape.
        numel: number of entries.
        pruned: number of entries the rule prunes (or that are pruned already).
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    pruned: int

    @property
    def fraction(self) -> float:
        """Pruned fraction in [0, 1]."""
        return self.pruned / self.numel if self.numel else 0.0


@dataclass
class SparsityReport:
    """What :func:`sparsity` returns: per-tensor and overall pruned counts.

    Attributes:
        rule: ``"log_alpha"`` or ``"snr"`` (``"random"`` for :func:`prune_random`).
        threshold: the rule's threshold.
        tensors: one :class:`TensorSparsity` per Bayesian parameter tensor, in model order.
    """

    rule: str
    threshold: float
    tensors: list[TensorSparsity] = field(default_factory=list)

    @property
    def total(self) -> int:
        """|W|: the number of Bayesian weights."""
        return sum(t.numel for t in self.tensors)

    @property
    def pruned(self) -> int:
        """Number of pruned weights (summed over tensors)."""
        return sum(t.pruned for t in self.tensors)

    @property
    def sparsity(self) -> float:
        """Overall pruned fraction, pruned / |W|."""
        return self.pruned / self.total if self.total else 0.0

    @property
    def compression(self) -> float:
        """Compression ratio |W| / |W ≠ 0| (``inf`` if every weight is pruned)."""
        kept = self.total - self.pruned
        return self.total / kept if kept else math.inf

    def to_dict(self) -> dict:
        """A JSON-serialisable dict (``compression`` is ``None`` when infinite)."""
        comp = self.compression
        return {"rule": self.rule, "threshold": self.threshold, "total": self.total, "pruned": self.pruned,
                "sparsity": self.sparsity, "compression": comp if math.isfinite(comp) else None,
                "tensors": [{"name": t.name, "shape": list(t.shape), "numel": t.numel, "pruned": t.pruned,
                             "fraction": t.fraction} for t in self.tensors]}

    def to_markdown(self) -> str:
        """A Markdown table: one row per tensor plus a total row."""
        lines = ["| tensor | shape | weights | pruned | sparsity |", "|---|---|---|---|---|"]
        for t in self.tensors:
            lines.append(f"| {t.name} | {'×'.join(map(str, t.shape)) or 'scalar'} | {t.numel} | {t.pruned} "
                         f"| {100 * t.fraction:.2f}% |")
        lines.append(f"| **total** | | {self.total} | {self.pruned} | {100 * self.sparsity:.2f}% "
                     f"(compression {self.compression:.1f}×) |")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return (f"{self.rule} (threshold {self.threshold:g}): {self.pruned}/{self.total} weights pruned "
                f"({100 * self.sparsity:.2f}%), compression {self.compression:.1f}×")


def check_rule(rule: str | None, threshold: float | None, default_rule: str = "snr") -> tuple[str, float]:
    """Validates a pruning rule and threshold, filling in the defaults.

    Args:
        rule: ``"log_alpha"``, ``"snr"`` or ``None`` (``default_rule``).
        threshold: ``None`` for the rule's default (3 for log α, 0.83 for SNR);
            log α thresholds must be ≥ 0 (α ≥ 1: the noise at least as large as
            the mean), SNR thresholds > 0.

    Returns:
        ``(rule, threshold)``.

    Raises:
        ValueError: on an unknown rule, a non-finite threshold or one of the wrong sign.
    """
    rule = default_rule if rule is None else rule
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is not known; accepted: {RULES}")
    if threshold is None:
        return rule, DEFAULT_THRESHOLDS[rule]
    t = check_float("threshold", threshold)
    if rule == "log_alpha" and t < 0:
        raise ValueError(f"threshold={threshold!r} has the wrong sign for rule 'log_alpha': it must be >= 0 "
                         "(log α > threshold prunes; a negative threshold would prune weights whose mean "
                         "dominates their noise). Molchanov et al. use 3")
    if rule == "inclusion" and not 0 <= t < 1:
        raise ValueError(f"threshold={threshold!r} is out of range for rule 'inclusion'; accepted: a number in "
                         "[0, 1) (α̃ <= threshold prunes; 0.5 gives the median probability model)")
    if rule == "snr" and t <= 0:
        raise ValueError(f"threshold={threshold!r} has the wrong sign for rule 'snr': it must be > 0 "
                         "(|μ/σ| < threshold prunes). Graves uses 0.83")
    return rule, t


def _default_rule(bnn: BayesianModel) -> str:
    return getattr(bnn, "default_sparsity_rule", "snr")


def _moments(bnn: BayesianModel) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Detached posterior means and stds; ValueError for a posterior without variances."""
    with torch.no_grad():
        mean = {n: t.detach() for n, t in bnn.posterior_mean().items()}
        std = {n: t.detach() for n, t in bnn.posterior_std().items()}
    if all(not bool((s != 0).any()) for s in std.values()):
        raise ValueError(f"method {bnn.method!r} has no posterior variances (its posterior std is zero "
                         "everywhere), so no weight can be judged by its noise; sparsity and pruning need a "
                         "variational posterior: wrap with 'vi', 'sparse_vd' or 'kingma_vd'")
    return mean, std


def pruning_masks(bnn: BayesianModel, rule: str | None = None, threshold: float | None = None
                  ) -> dict[str, torch.Tensor]:
    """Which weights a rule prunes.

    A weight already pruned (mean 0 and std 0) counts as pruned under every rule.

    Args:
        bnn: a Bayesian model with posterior variances.
        rule: ``"log_alpha"`` (log σ² − log μ² > threshold), ``"inclusion"`` (LBBNN:
            α̃ <= threshold, default 0.5, the median probability model) or ``"snr"``
            (|μ| < threshold · σ); ``None`` for the method's default.
        threshold: see :func:`check_rule`.

    Returns:
        ``{name: bool tensor of the parameter's shape}``, True = pruned.

    Raises:
        ValueError: see :func:`check_rule`, or a method without variances (MAP).
    """
    rule, t = check_rule(rule, threshold, _default_rule(bnn))
    if rule == "inclusion":
        if not hasattr(bnn, "inclusion_probs"):  # no inclusion variables
            raise ValueError(f"rule='inclusion' needs inclusion variables; method {bnn.method!r} has none "
                             f"(accepted: 'log_alpha', 'snr', or method 'lbbnn')")
        with torch.no_grad():
            probs = bnn.inclusion_probs()
            return {n: (probs[n] <= t) if n in probs else torch.zeros_like(m, dtype=torch.bool)
                    for n, m in bnn.mean.items()}
    mean, std = _moments(bnn)
    masks = {}
    for n, m in mean.items():
        s = std[n]
        already = (m == 0) & (s == 0)
        if rule == "log_alpha":
            with torch.no_grad():
                log_alpha = torch.log(s.pow(2)) - torch.log(m.pow(2))  # +inf for μ = 0, −inf for σ = 0
            masks[n] = already | (log_alpha > t)
        else:
            masks[n] = already | (m.abs() < t * s)
    return masks


def _report(masks: dict[str, torch.Tensor], rule: str, threshold: float) -> SparsityReport:
    return SparsityReport(rule, threshold, [TensorSparsity(n, tuple(m.shape), m.numel(), int(m.sum()))
                                            for n, m in masks.items()])


def sparsity(bnn: BayesianModel, rule: str | None = None, threshold: float | None = None) -> SparsityReport:
    """Reports what a pruning rule would remove, per tensor and overall; changes nothing.

    Works for any method with posterior variances (VI, sparse/Kingma VD, and
    read-only also Laplace and SGLD).

    Args:
        bnn: the Bayesian model.
        rule: ``"log_alpha"`` or ``"snr"``; ``None`` = the method's default
            (``"log_alpha"`` for sparse/Kingma VD, ``"snr"`` otherwise).
        threshold: ``None`` = 3 for log α, 0.83 for SNR.

    Returns:
        A :class:`SparsityReport` (``.tensors`` with name/shape/pruned fraction,
        ``.sparsity``, ``.compression`` = |W| / |W ≠ 0|).

    Raises:
        ValueError: unknown rule, threshold of the wrong sign, or a method
            without variances (e.g. MAP).
    """
    rule, t = check_rule(rule, threshold, _default_rule(bnn))
    return _report(pruning_masks(bnn, rule, t), rule, t)


def _check_prunable(bnn: BayesianModel) -> None:
    if not isinstance(bnn, BayesianModel):
        raise ValueError(f"expected a bayeswrap BayesianModel, got {type(bnn).__name__}")
    if not isinstance(bnn, SparsityMixin):
        _moments(bnn)  # MAP and friends: the "no variances" message
        raise ValueError(f"pruning is implemented for the variational methods 'vi', 'lbbnn', 'sparse_vd' and "
                         f"'kingma_vd', not for {bnn.method!r}; bw.sparsity.sparsity(bnn) still reports "
                         "what a rule would prune")


def prune(bnn: BayesianModel, rule: str | None = None, threshold: float | None = None) -> SparsityReport:
    """Prunes the weights selected by a rule: their mean and std become exactly 0.

    The pruned weights stay zero in :meth:`~bayeswrap.BayesianModel.predict`,
    :meth:`~bayeswrap.BayesianModel.sample` and :func:`to_deterministic`.
    Sparse and Kingma VD keep a mask, so further training (fine-tuning) leaves
    them at zero and excludes them from the KL. For Graves VI a pruned weight is
    a point mass at 0 whose KL to the Gaussian prior is infinite, so its
    ``regularizer()`` is ``inf`` afterwards: prune Graves VI once training is done.

    Args:
        bnn: a ``"vi"``, ``"sparse_vd"`` or ``"kingma_vd"`` model.
        rule, threshold: see :func:`sparsity`.

    Returns:
        The :class:`SparsityReport` of the pruned weights (``report.pruned``
        entries of the posterior mean are now 0).

    Raises:
        ValueError: unknown rule, wrong-sign threshold, a method without
            variances (MAP) or another method that cannot be pruned.
    """
    _check_prunable(bnn)
    rule, t = check_rule(rule, threshold, _default_rule(bnn))
    masks = pruning_masks(bnn, rule, t)
    with torch.no_grad():
        bnn._apply_prune(masks)
    return _report(masks, rule, t)


def prune_random(bnn: BayesianModel, count: int | None = None, *, rule: str | None = None,
                 threshold: float | None = None, per_tensor: bool = True,
                 generator: torch.Generator | None = None) -> SparsityReport:
    """The baseline: prunes as many weights as a rule would, chosen uniformly at random.

    Args:
        bnn: a ``"vi"``, ``"sparse_vd"`` or ``"kingma_vd"`` model.
        count: total number of weights to prune; ``None`` = the number ``rule``
            would prune now (then, with ``per_tensor``, each tensor loses as many
            as the rule would take from it, so only *which* weights differ).
        rule, threshold: the rule whose counts are matched (see :func:`sparsity`).
        per_tensor: match the rule's count in every tensor (True) or draw the
            total over all weights at once (False; always so when ``count`` is given).
        generator: optional ``torch.Generator`` (CPU) for a reproducible draw.

    Returns:
        The :class:`SparsityReport` of the randomly pruned weights (rule ``"random"``).

    Raises:
        ValueError: as :func:`prune`, or a ``count`` outside [0, number of unpruned weights].
    """
    _check_prunable(bnn)
    rule, t = check_rule(rule, threshold, _default_rule(bnn))
    mean, std = _moments(bnn)
    already = {n: (m == 0) & (std[n] == 0) for n, m in mean.items()}
    if count is None:
        target = {n: int(m.sum()) - int(already[n].sum()) for n, m in pruning_masks(bnn, rule, t).items()}
        if not per_tensor:
            target = {"*": sum(target.values())}
    else:
        target = {"*": check_int("count", count, minimum=0, note="weights to prune")}
    masks = {n: a.clone() for n, a in already.items()}
    if "*" in target:
        free = torch.cat([(~a).flatten() for a in already.values()])
        k = target["*"]
        if not 0 <= k <= int(free.sum()):
            raise ValueError(f"count={k} must be between 0 and the {int(free.sum())} unpruned weights")
        chosen = _choose(free.cpu(), k, generator)
        offset = 0
        for n, a in already.items():
            sel = chosen[offset:offset + a.numel()].view(a.shape).to(a.device)
            masks[n] |= sel
            offset += a.numel()
    else:
        for n, a in already.items():
            masks[n] |= _choose((~a).flatten().cpu(), target[n], generator).view(a.shape).to(a.device)
    with torch.no_grad():
        bnn._apply_prune(masks)
    return _report(masks, "random", float("nan"))


def _choose(free: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """A bool mask with ``k`` True entries drawn uniformly among the True entries of ``free``."""
    idx = free.nonzero().flatten()
    out = torch.zeros_like(free)
    out[idx[torch.randperm(len(idx), generator=generator)[:k]]] = True
    return out


def to_deterministic(bnn: BayesianModel) -> nn.Module:
    """A plain ``nn.Module`` holding the (pruned) posterior means, for fast deployment.

    :meth:`bayeswrap.BayesianModel.to_deterministic` after checking that the model
    was trained: a deep copy of the wrapped model's structure with real storage on the
    Bayesian model's device: Bayesian parameters = posterior mean (pruned
    weights exactly 0), point estimates and buffers as trained; tied
    parameters stay tied. ``net(x)`` equals
    ``bnn.forward_with(bnn.posterior_mean(), x)``, i.e. ``predict(x, num_samples=0)``
    before the softmax. It is returned in eval mode and shares no tensor with ``bnn``.

    "Trained" means that the posterior exists (Laplace: curvature fitted;
    SGLD: a sample kept) and, for ``"vi"``, ``"sparse_vd"``, ``"kingma_vd"`` and ``"lbbnn"``,
    that at least one optimizer step was taken (:func:`bayeswrap.fit` calls
    ``after_step``) or a trained state was loaded with ``load_state_dict``.

    Args:
        bnn: a trained Bayesian model.

    Returns:
        An ``nn.Module`` of the wrapped model's class.

    Raises:
        NotTrainedError: (a ``ValueError`` and ``NotFittedError``) before training.
        ValueError: if the model could not be deep-copied when it was wrapped, or for an ensemble.
    """
    _check_trained(bnn)
    return bnn.to_deterministic()


def _check_trained(bnn: BayesianModel) -> None:
    """A :class:`NotTrainedError` for a pruneable posterior without an optimizer step, or one not ready."""
    if isinstance(bnn, SparsityMixin) and bnn.optimizer_steps == 0:
        raise NotTrainedError(f"to_deterministic() needs a trained posterior, but this {bnn.method!r} model has "
                              "taken no optimizer step: train it with bw.fit(...) (or load a trained state_dict) "
                              "first")
    if not bnn.is_ready():
        raise NotTrainedError(bnn._not_ready_message())


class SparsityMixin:
    """Adds ``sparsity``, ``prune``, ``prune_random`` and ``to_deterministic`` to a method.

    Put it before :class:`~bayeswrap.BayesianModel` in the bases. It counts
    optimizer steps in ``after_step`` (kept in the ``state_dict``'s extra state),
    which is how :meth:`to_deterministic` knows that the model was trained.

    A method states how its posterior is pruned in :meth:`_apply_prune`; the
    default here handles the ``mean`` / ``rho`` layout of Graves VI
    (s = exp(κρ): mean ← 0, ρ ← −10⁴ so that s is exactly 0).

    Attributes:
        default_sparsity_rule: ``"snr"`` here; ``"log_alpha"`` for sparse/Kingma VD.
    """

    default_sparsity_rule = "snr"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._optimizer_steps = 0

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (counted by ``after_step``; restored by ``load_state_dict``)."""
        return self._optimizer_steps

    def after_step(self) -> None:
        super().after_step()
        self._optimizer_steps += 1

    def get_extra_state(self):
        return {**super().get_extra_state(), "optimizer_steps": int(self._optimizer_steps)}

    def set_extra_state(self, state):
        super().set_extra_state(state)
        self._optimizer_steps = int(state.get("optimizer_steps", self._optimizer_steps))

    def _apply_prune(self, masks: dict[str, torch.Tensor]) -> None:
        """Makes the entries of ``masks`` (True = prune) exactly 0 with zero variance."""
        mean, rho = getattr(self, "mean", None), getattr(self, "rho", None)
        if mean is None or rho is None:
            raise ValueError(f"method {self.method!r} does not say how to prune its posterior "
                             "(override _apply_prune)")
        for n, m in masks.items():
            mean[n].data.masked_fill_(m, 0.0)
            rho[n].data.masked_fill_(m, PRUNED_RHO)

    def sparsity(self, rule: str | None = None, threshold: float | None = None) -> SparsityReport:
        """See :func:`bayeswrap.methods.sparsity.sparsity`."""
        return sparsity(self, rule, threshold)

    def prune(self, rule: str | None = None, threshold: float | None = None) -> SparsityReport:
        """See :func:`bayeswrap.methods.sparsity.prune`."""
        return prune(self, rule, threshold)

    def prune_random(self, count: int | None = None, *, rule: str | None = None, threshold: float | None = None,
                     per_tensor: bool = True, generator: torch.Generator | None = None) -> SparsityReport:
        """See :func:`bayeswrap.methods.sparsity.prune_random`."""
        return prune_random(self, count, rule=rule, threshold=threshold, per_tensor=per_tensor,
                            generator=generator)

    def to_deterministic(self) -> nn.Module:
        """See :func:`bayeswrap.methods.sparsity.to_deterministic`."""
        _check_trained(self)
        return super().to_deterministic()
