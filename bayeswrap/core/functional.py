"""Functional view of an ``nn.Module``: named tensors, parameter selection and calls.

bayeswrap never mutates the user's model. Instead it keeps its own copies of the
parameters and buffers and evaluates the model with
:func:`torch.func.functional_call`, so any tensor (a posterior sample, a
posterior mean, a batch of samples under ``vmap``) can be plugged in.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Union

import torch
from torch import nn
from torch.func import functional_call

ParamSelector = Union[None, str, Sequence[str], Callable[[str, torch.Tensor], bool]]


def _mangle(name: str) -> str:
    # nn.Module attribute names may not contain "."; "/" never occurs in module paths.
    return name.replace(".", "/")


class NamedTensors(nn.Module):
    """An ordered mapping from dotted parameter names to tensors, as a module.

    ``nn.ParameterDict`` rejects dotted keys such as ``"layer1.0.conv1.weight"``;
    this container accepts them and registers each tensor either as an
    ``nn.Parameter`` (trainable) or as a buffer, so ``.to()``, ``state_dict()``
    and optimizers see them.

    Args:
        tensors: mapping from parameter name to tensor. The tensors are cloned.
        trainable: register as ``nn.Parameter`` (True) or as buffers (False).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], trainable: bool):
        super().__init__()
        self._names = list(tensors)
        for name, t in tensors.items():
            t = t.detach().clone()
            if trainable:
                self.register_parameter(_mangle(name), nn.Parameter(t))
            else:
                self.register_buffer(_mangle(name), t)

    def __getitem__(self, name: str) -> torch.Tensor:
        return getattr(self, _mangle(name))

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        getattr(self, _mangle(name)).data.copy_(value)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self):
        return iter(self._names)

    def keys(self) -> list[str]:
        return list(self._names)

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, self[n]) for n in self._names]

    def values(self) -> list[torch.Tensor]:
        return [self[n] for n in self._names]

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Returns ``{name: tensor}`` (the live tensors, not copies)."""
        return {n: self[n] for n in self._names}


def is_bias(name: str) -> bool:
    """Whether a parameter is a bias, by the PyTorch naming convention ``*.bias``.

    Args:
        name: dotted parameter name, e.g. ``"fc.bias"``.
    """
    return name.rsplit(".", 1)[-1] == "bias"


def select_parameters(model: nn.Module, params: ParamSelector) -> list[str]:
    """Names of the trainable parameters of ``model`` that are to be Bayesian.

    Args:
        model: the user's module.
        params: ``None`` for every trainable parameter; a glob pattern or a list
            of glob patterns over parameter names (``fnmatch`` syntax, e.g.
            ``["head.*"]`` or ``["blocks.*.mlp.*"]``); or a callable
            ``(name, tensor) -> bool``.

    Returns:
        The selected names, in ``model.named_parameters()`` order.

    Raises:
        ValueError: if a pattern matches no trainable parameter, if nothing is
            selected (an empty list selects nothing), or if ``params`` has an unsupported type.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters (requires_grad=True); nothing to make Bayesian")
    if params is None:
        return [n for n, _ in named]
    if callable(params):
        chosen = [n for n, p in named if params(n, p)]
        if not chosen:
            raise ValueError("the `params` callable selected no parameter; "
                             f"trainable parameters are e.g. {[n for n, _ in named][:8]}")
        return chosen
    if isinstance(params, str):
        params = [params]
    if not isinstance(params, Iterable):
        raise ValueError(f"params={params!r} is not supported; accepted: None, a list of glob patterns "
                         "over parameter names, or a callable (name, tensor) -> bool")
    patterns = list(params)
    if not patterns:
        raise ValueError(f"params={params!r} is an empty list, which selects no parameter; accepted: None (every "
                         "trainable parameter), a non-empty list of glob patterns over parameter names (e.g. "
                         "['head.*']), or a callable (name, tensor) -> bool")
    for pat in patterns:
        if not isinstance(pat, str):
            raise ValueError(f"params pattern {pat!r} is not a string; accepted: glob patterns such as 'head.*'")
        if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named):
            raise ValueError(f"params pattern {pat!r} matches no trainable parameter; "
                             f"parameter names look like {[n for n, _ in named][:8]}")
    return [n for n, _ in named if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]


def split_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Detached copies of a module's parameters and buffers, keyed by name.

    Args:
        model: any ``nn.Module``.

    Returns:
        ``(params, buffers)``; tied parameters appear once, as in
        ``named_parameters()``.
    """
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return params, buffers


def call(model: nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
         x: torch.Tensor | tuple) -> torch.Tensor:
    """Evaluates ``model`` at the given tensors without touching its own state.

    ``torch.func.functional_call(model, (params, buffers), x)``. In train mode
    BatchNorm updates the running statistics held in ``buffers`` in place, exactly
    as ``model(x)`` updates its own.

    Args:
        model: the user's module (used only as a function).
        params: every parameter of ``model`` by name.
        buffers: every buffer of ``model`` by name.
        x: the input, a tuple of positional inputs (``model(*x)``), or a mapping of keyword inputs
            (``model(**x)``, as a Hugging Face batch without its labels).

    Returns:
        Whatever ``model.forward`` returns.
    """
    args, kwargs = call_arguments(x)
    return functional_call(model, (dict(params), dict(buffers)), args, kwargs, tie_weights=_has_tied_tensors(model),
                           strict=False)


def call_arguments(x) -> tuple[tuple, dict | None]:
    """``(args, kwargs)`` of a forward call on inputs ``x``: a tensor ``model(x)``, a tuple ``model(*x)``, a
    mapping ``model(**x)``.
    """
    if isinstance(x, Mapping):
        return (), dict(x)
    return (x if isinstance(x, tuple) else (x,)), None


_TIED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def _has_tied_tensors(model: nn.Module) -> bool:
    """Whether a tensor of ``model`` is registered under several names (cached per module).

    ``functional_call(tie_weights=True)`` then gives every alias the tensor
    passed for one of them; for a module without aliases the tie bookkeeping
    (a walk over all its names on every call) is skipped.
    """
    tied = _TIED.get(model)
    if tied is None:
        tied = (len(list(model.named_parameters(remove_duplicate=False))) != len(list(model.named_parameters()))
                or len(list(model.named_buffers(remove_duplicate=False))) != len(list(model.named_buffers())))
        _TIED[model] = tied
    return tied


def nonfinite_names(tensors: Iterable[tuple[str, torch.Tensor]], nan_only: Callable[[str], bool] | None = None
                    ) -> list[str]:
    """Names of the floating tensors that hold a NaN or an infinity, in the given order.

    One ``isfinite(t).all()`` reduction per tensor and one device sync per device,
    so it is cheap enough to run once per epoch over every parameter.

    Args:
        tensors: ``(name, tensor)`` pairs; non-floating, empty and ``meta`` tensors are skipped.
        nan_only: optional predicate on the name: for those tensors only NaN counts
            (e.g. model buffers, where ``-inf`` is a legitimate attention mask).

    Returns:
        The names of the offending tensors (empty if all are finite).
    """
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    order = []
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not t.is_meta:
            by_device.setdefault(t.device, []).append((name, t))
            order.append(name)
    bad = set()
    for items in by_device.values():
        flags = torch.stack([(~torch.isnan(t) if nan_only is not None and nan_only(n) else torch.isfinite(t)).all()
                             for n, t in items]).logical_not().tolist()
        bad.update(n for (n, _), f in zip(items, flags) if f)
    return [n for n in order if n in bad]
