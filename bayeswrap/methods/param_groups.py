"""Optimizer parameter groups of a :class:`~bayeswrap.BayesianModel` (``bnn.param_groups()``).

The groups tell an optimizer what each parameter is: the posterior's parameters (their prior is in the loss, so no
weight decay), the point estimates (no Langevin noise under SGLD), a learned noise std, each split into the body
and a head that may want its own learning rate (BayesDLL's ``lr_head``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from bayeswrap.core.checks import check_float

if TYPE_CHECKING:
    from bayeswrap.methods.base import BayesianModel


def param_groups(bnn: BayesianModel, head: Iterable[str] = (), lr_head: float | None = None) -> list[dict]:
    """Optimizer parameter groups: posterior parameters, then point estimates, then a learned noise std.

    Each group is split further into the model's body and the parameters
    whose model names are in ``head`` (e.g. a new classifier, which often
    wants a larger learning rate, as in BayesDLL's ``lr_head``). Point-estimate
    groups carry ``noise_scale=0.0`` so that :class:`bayeswrap.optim.SGLD`
    adds no Langevin noise to non-Bayesian parameters; other optimizers
    ignore the extra key. Posterior groups carry ``weight_decay=0.0``: their
    prior is already in the loss (the KL or −log prior term), so an
    optimizer's own weight decay (AdamW's default 0.01) would count it twice.
    A learned noise std (``noise_std="learn"``) is its own group ``"likelihood"``, with
    ``weight_decay=0.0`` (no prior on it) and ``noise_scale=0.0`` (a point estimate).
    Empty groups are omitted.

    Args:
        bnn: the model whose parameters are grouped.
        head: model parameter names (as in ``model.named_parameters()``); a single
            string is one name.
        lr_head: learning rate of the head groups (set as the group's ``lr``),
            ``None`` or a finite number > 0.

    Returns:
        ``[{"params": [...], "name": "posterior" | "posterior/head" | "point" | "point/head" | "likelihood",
        ...}]``.

    Raises:
        ValueError: if a ``head`` name is not a parameter of the wrapped model (it
            would silently get the body's learning rate), or ``lr_head`` is not
            ``None`` or a finite number > 0.
    """
    head = {head} if isinstance(head, str) else set(head)
    unknown = sorted(head - {n for n, _ in bnn.model.named_parameters(remove_duplicate=False)}, key=str)
    if unknown:
        raise ValueError(f"head names {unknown[:8]} are not parameters of the wrapped model; accepted: names "
                         f"from model.named_parameters(), e.g. {[*bnn.bayesian_names, *bnn.point][-4:]}")
    lr_head = check_float("lr_head", lr_head, low=0.0, low_open=True, allow_none=True)
    groups: dict[str, dict] = {}
    for full_name, p in bnn.named_parameters():
        container, mangled = full_name.split(".", 1)
        if container == "likelihood":  # a learned noise std: a point estimate without prior
            groups.setdefault("likelihood", {"params": [], "name": "likelihood", "noise_scale": 0.0,
                                             "weight_decay": 0.0})["params"].append(p)
            continue
        name = "point" if container == "point" else "posterior"
        if mangled.replace("/", ".") in head:
            name += "/head"
        group = groups.setdefault(name, {"params": [], "name": name})
        group["params"].append(p)
        if name.startswith("point"):
            group["noise_scale"] = 0.0
        else:
            group["weight_decay"] = 0.0
        if name.endswith("/head") and lr_head is not None:
            group["lr"] = lr_head
    order = ["posterior", "posterior/head", "point", "point/head", "likelihood"]
    return [groups[k] for k in order if k in groups]
