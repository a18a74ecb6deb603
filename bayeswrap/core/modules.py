"""Storage-free copies of a module: the structure bayeswrap evaluates as a function, and its real-valued copies.

bayeswrap never writes to the wrapped model. It keeps a deep copy of its structure whose parameters and buffers
live on the ``meta`` device (:func:`storage_free_copy`, no memory), calls it with
``torch.func.functional_call`` and the posterior's tensors (with the wrapped model's own frozen tensors, which are
referenced rather than copied: changing them in place changes the wrapped Bayesian model too), and materialises a
plain module again only on request
(:func:`materialised_copy`, e.g. ``BayesianModel.to_deterministic``). A ``torch.compile`` wrapper is unwrapped
first (:func:`unwrap_compiled`), and a model whose weights cannot become a posterior is refused at wrap time
(:func:`check_model_tensors`).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import sys
from collections.abc import Mapping

import torch
from torch import nn

from bayeswrap.core.functional import nonfinite_names

#: ids of tensors already checked by an enclosing :func:`checked_once` (None outside one)
_CHECKED: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar("bayeswrap_checked", default=None)


@contextlib.contextmanager
def checked_once(model: nn.Module):
    """Within the block, :func:`check_model_tensors` skips the tensors of ``model`` (which the caller has checked):
    an ensemble's members share the wrapped model's frozen base, which is read once, not once per member.
    """
    ids = frozenset(id(t) for t in [*model.parameters(), *model.buffers()])
    token = _CHECKED.set(ids | (_CHECKED.get() or frozenset()))
    try:
        yield
    finally:
        _CHECKED.reset(token)


def check_model_tensors(model: nn.Module) -> None:
    """Refuses models whose weights cannot become the initial posterior and prior mean (once, at wrap time).

    Tensors checked by an enclosing :func:`checked_once` are not read again.

    Raises:
        ValueError: for uninitialised (lazy) tensors, tensors on the ``meta`` device, NaN or inf in a
            parameter, or NaN in a buffer; naming the first such tensor.
    """
    checked = _CHECKED.get() or frozenset()
    named = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if id(t) not in checked]
    lazy = [n for n, t in named if nn.parameter.is_lazy(t)]
    if lazy:
        raise ValueError(f"the model has uninitialised (lazy) tensors, e.g. {lazy[:3]}; run one forward pass "
                         "before wrapping it so that their shapes are known")
    meta = [n for n, t in named if t.is_meta]
    if meta:
        raise ValueError(f"the model's tensors are on the 'meta' device (e.g. {meta[:3]}), which holds no values: "
                         "they cannot become the prior mean and the initial posterior; accepted: a model with "
                         "real weights (materialise it first, e.g. model.to_empty(device='cpu') and then "
                         "model.load_state_dict(weights))")
    bad = nonfinite_names((n, t) for n, t in model.named_parameters() if id(t) not in checked)
    if bad:
        t = dict(model.named_parameters())[bad[0]]
        raise ValueError(f"the model's parameter {bad[0]!r} contains {int((~torch.isfinite(t)).sum())} non-finite "
                         f"values (NaN or inf){f'; so do {bad[1:4]}' if len(bad) > 1 else ''}; bayeswrap copies "
                         "the weights as the initial posterior and the prior mean, so they must be finite")
    bad = nonfinite_names(((n, t) for n, t in model.named_buffers() if id(t) not in checked), nan_only=lambda n: True)
    if bad:
        raise ValueError(f"the model's buffer {bad[0]!r} contains NaN; accepted: buffers without NaN "
                         "(e.g. reset BatchNorm statistics with module.reset_running_stats())")


def materialised_copy(skeleton: nn.Module, params: Mapping[str, torch.Tensor],
                       buffers: Mapping[str, torch.Tensor]) -> nn.Module:
    """A deep copy of the storage-free ``skeleton`` whose meta tensors are replaced by copies of ``params``/``buffers``.

    Tied tensors (one tensor under several names) stay tied: one copy, found under any of the names.

    Raises:
        ValueError: naming a parameter or buffer of the skeleton that has no value.
    """
    net = copy.deepcopy(skeleton)
    for values, parameter in ((params, True), (buffers, False)):
        groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
        named = net.named_parameters(remove_duplicate=False) if parameter else net.named_buffers(remove_duplicate=False)
        for name, t in named:
            groups.setdefault(id(t), []).append((name, t))
        for aliases in groups.values():
            canonical = next((n for n, _ in aliases if n in values), None)
            if canonical is None:
                raise ValueError(f"no value for {aliases[0][0]!r} of the wrapped model")
            value = values[canonical].detach().clone()
            new = nn.Parameter(value, requires_grad=aliases[0][1].requires_grad) if parameter else value
            for name, _ in aliases:
                prefix, _, leaf = name.rpartition(".")
                owner = net.get_submodule(prefix) if prefix else net
                (owner._parameters if parameter else owner._buffers)[leaf] = new
    return net


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile(module)`` wrapped (its ``_orig_mod``), or ``model`` itself.

    bayeswrap evaluates the model with ``torch.func.functional_call`` on a storage-free copy of its
    structure, which calls the modules' ``forward`` eagerly: a compiled wrapper's graph would never run.
    Wrapping the original keeps the parameter names (no ``_orig_mod.`` prefix), so ``params`` patterns,
    checkpoints and :func:`bayeswrap.save` files match the plain model.

    Args:
        model: any ``nn.Module``; a ``torch._dynamo`` ``OptimizedModule`` (possibly nested) is unwrapped.

    Returns:
        The innermost original module (the same object, never a copy).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return model


def storage_free_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers live on the ``meta`` device (no memory).

    The copy is made with a ``deepcopy`` memo that maps every tensor to a meta
    tensor of the same shape, so tied parameters stay tied and no real
    parameter memory is duplicated, even transiently.
    """
    memo = {}
    for t in model.parameters():
        memo[id(t)] = nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # modules that cannot be deep-copied are used as-is (still never written to)
        return model
