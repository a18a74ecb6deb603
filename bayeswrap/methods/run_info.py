"""What a training run knows before it builds its method: the argument of ``BayesianModel.run_options``.

The application (``bayeswrap fit``/``compare``) describes the run it is about to start with a :class:`RunInfo`,
and each method class says what that run implies for it (:meth:`bayeswrap.BayesianModel.run_options`): the
burn-in of a sampler in optimizer steps from the run's epochs, a fresh head per member of a fine-tuned ensemble,
the predictive a run scores with. So the application names no method.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RunInfo:
    """One training run, as a method class sees it before it is built.

    Attributes:
        epochs: the training epochs of the run (>= 1).
        steps_per_epoch: optimizer steps per epoch, or None while the data are not loaded yet (a config is
            checked before its data are read).
        options: the method's constructor arguments that the run gives, ``{argument: value}`` (only those
            given: every other argument keeps the constructor's default).
        pretrained: whether the backbone starts from pretrained weights with a new head.
        head: the parameter names of the backbone's classifier head (e.g. ``("fc.weight", "fc.bias")``).
        burn_in_epochs: the run's burn-in in epochs for a method that discards the start of its chain, or None
            for the method's own default (``burn_in_epochs: auto``).
        scheduler: the run's learning-rate schedule over epochs (``"constant"`` or ``"cosine"``).
        warmup_epochs: epochs of linear learning-rate warm-up.
    """

    epochs: int
    steps_per_epoch: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    pretrained: bool = False
    head: tuple[str, ...] = ()
    burn_in_epochs: float | None = None
    scheduler: str = "constant"
    warmup_epochs: int = 0
