"""Functional view of an ``nn.Module``: named tensors, parameter selection and calls.

bayeswrap never mutates the user's model. Instead it keeps its own copies of the
trainable parameters and buffers, references (never copies, casts or writes) the frozen
ones (``requires_grad=False``, e.g. a peft model's base: :class:`NamedTensors` with
``referenced=True``), and evaluates the model with
:func:`torch.func.functional_call`, so any tensor (a posterior sample, a
posterior mean, a batch of samples under ``vmap``) can be plugged in.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Union

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from bayeswrap.core.adapters import ADAPTER_SELECTORS, PARAMS_ACCEPTED, select_adapters
from bayeswrap.core.batches import dict_call_style, map_tensors

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

    With ``referenced=True`` (buffers only) the tensors are not copied: each buffer is the given tensor itself
    (detached, the same storage), so a frozen base that bayeswrap only reads costs no memory. Such a buffer is never
    written to: :meth:`__setitem__` and ``load_state_dict`` give it a new tensor of the value instead (the reference
    is dropped), and a checkpoint whose value equals the referenced one leaves the reference in place.

    Args:
        tensors: mapping from parameter name to tensor. The tensors are cloned unless ``referenced``.
        trainable: register as ``nn.Parameter`` (True) or as buffers (False).
        referenced: register the tensors themselves, not copies (buffers only; an inference-mode tensor is
            still copied, since autograd cannot save it for backward).

    Raises:
        ValueError: for ``referenced=True`` with ``trainable=True``.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], trainable: bool, referenced: bool = False):
        super().__init__()
        if referenced and trainable:
            raise ValueError("NamedTensors(referenced=True) holds buffers only; accepted: trainable=False")
        self._names = list(tensors)
        self._referenced: set[str] = set()
        for name, t in tensors.items():
            if referenced and not t.is_inference():
                t = t.detach()
                self._referenced.add(_mangle(name))
            else:
                t = t.detach().clone()
            if trainable:
                self.register_parameter(_mangle(name), nn.Parameter(t))
            else:
                self.register_buffer(_mangle(name), t)

    def __getitem__(self, name: str) -> torch.Tensor:
        return getattr(self, _mangle(name))

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        # an in-place copy of the tensor itself (not of .data), so its version counter moves and a cache keyed
        # by it (VI's posterior_std) sees the change
        key = _mangle(name)
        with torch.no_grad():
            if key in self._referenced:  # never written to: the referenced tensor belongs to the wrapped model
                current = self._buffers[key]
                self._buffers[key] = value.detach().to(device=current.device, dtype=current.dtype, copy=True)
                self._referenced.discard(key)
            else:
                getattr(self, key).copy_(value)

    def is_referenced(self, name: str) -> bool:
        """Whether the tensor ``name`` is the wrapped model's own (referenced, not copied)."""
        return _mangle(name) in self._referenced

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """``nn.Module``'s loading, except that a referenced tensor is never written to: a checkpoint value equal to
        it keeps the reference, another value replaces it by a copy of that value.
        """
        held = {k: self._buffers[k] for k in self._referenced if k in self._buffers}
        if not held:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        order = list(self._buffers)
        for k in held:
            del self._buffers[k]
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        finally:
            loaded = dict(self._buffers)
            self._buffers.clear()
            self._buffers.update({k: held[k] if k in held else loaded[k] for k in order})
        assign = bool(local_metadata.get("assign_to_params_buffers", False))
        for k, current in held.items():
            key = prefix + k
            if key in unexpected_keys:
                unexpected_keys.remove(key)
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or value.shape != current.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {shape} from checkpoint, "
                                  f"the shape in current model is {tuple(current.shape)}.")
                continue
            value = value.detach()
            if (value.device, value.dtype, value.data_ptr(), value.stride()) == (
                    current.device, current.dtype, current.data_ptr(), current.stride()):
                continue  # the referenced tensor itself
            moved = value.to(device=current.device, dtype=current.dtype)
            if torch.equal(moved, current):
                continue
            self._buffers[k] = value if assign else (moved.clone() if moved is value else moved)
            self._referenced.discard(k)

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


def state_snapshot(module: nn.Module) -> dict:
    """A copy of ``module.state_dict()`` that keeps the referenced frozen tensors (:class:`NamedTensors` with
    ``referenced=True``) by reference: a snapshot to restore later (early stopping's best epoch) costs no copy of a
    frozen base, which bayeswrap never writes to.

    Args:
        module: any ``nn.Module`` (a ``BayesianModel``).

    Returns:
        ``{key: value}`` in ``state_dict()`` order; every other value deep-copied (storage shared between values
        stays shared).
    """
    state = module.state_dict()
    kept = {f"{name}.{k}" if name else k for name, mod in module.named_modules() if isinstance(mod, NamedTensors)
            for k in mod._referenced}
    copied = copy.deepcopy({k: v for k, v in state.items() if k not in kept})
    return {k: state[k] if k in kept else copied[k] for k in state}


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
        params: ``None`` for every trainable parameter; ``"last_layer"`` for the
            weight and bias of the classifier (:func:`find_last_layer`: timm's
            ``get_classifier()``, torchvision's and Hugging Face's head names, else the
            last ``nn.Linear``); ``"adapters"`` for the trainable tensors of a peft model's
            adapters (LoRA's A and B; :func:`bayeswrap.core.adapters.select_adapters`), ``"adapters_A"``
            for LoRA's A factors only (BLoB); a glob pattern or a list of glob patterns over parameter
            names (``fnmatch`` syntax, e.g. ``["fc.*"]`` or ``["blocks.*.mlp.*"]``); or a
            callable ``(name, tensor) -> bool``. For a peft model, ``None`` selects its adapters and
            its ``modules_to_save`` (a new head), never the frozen base.

    Returns:
        The selected names, in ``model.named_parameters()`` order.

    Raises:
        ValueError: if a pattern matches no trainable parameter (the message names the
            classifier's parameters, which ``"last_layer"`` selects), if nothing is
            selected (an empty list selects nothing), or if ``params`` has an unsupported type;
            for ``"adapters"``/``"adapters_A"``, a model without peft adapters or with an unfrozen base
            (:func:`bayeswrap.core.adapters.select_adapters`).
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
    if isinstance(params, str) and params == "last_layer":
        return last_layer_params(model, find_last_layer(model))
    if isinstance(params, str) and params in ADAPTER_SELECTORS:
        return select_adapters(model, params)
    if isinstance(params, str):
        params = [params]
    if not isinstance(params, Iterable):
        raise ValueError(f"params={params!r} is not supported; accepted: {PARAMS_ACCEPTED}")
    patterns = list(params)
    if not patterns:
        raise ValueError(f"params={params!r} is an empty list, which selects no parameter; accepted: None (every "
                         "trainable parameter), a non-empty list of glob patterns over parameter names (e.g. "
                         "['head.*']), or a callable (name, tensor) -> bool")
    for pat in patterns:
        if not isinstance(pat, str):
            raise ValueError(f"params pattern {pat!r} is not a string; accepted: glob patterns such as 'head.*'")
        if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named):
            raise ValueError(f"params pattern {pat!r} matches no trainable parameter; parameter names look like "
                             f"{[n for n, _ in named][:4]}{_classifier_hint(model)}")
    return [n for n, _ in named if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]


#: attribute paths of classification heads, tried in this order: torchvision's (``fc``, ``classifier``, ``head``,
#: ``heads.head``) and Hugging Face's (``classifier``, ``score``)
CLASSIFIER_HEADS = ("fc", "classifier", "head", "heads.head", "score")


def find_last_layer(model: nn.Module) -> str:
    """The name of the model's classifier, the layer ``params="last_layer"`` (Laplace: ``subset_of_weights``) selects.

    Tried in order: timm's ``model.get_classifier()`` (the module it returns),
    torchvision's and Hugging Face's head attributes (:data:`CLASSIFIER_HEADS`; in an
    ``nn.Sequential`` head, its last ``nn.Linear``), else the last ``nn.Linear``
    in ``model.modules()`` order.

    Args:
        model: the user's module.

    Returns:
        A dotted module name ("" for a model that is itself an ``nn.Linear``).

    Raises:
        ValueError: if the model has no ``nn.Linear`` layer with trainable parameters.
    """
    names = {id(m): n for n, m in model.named_modules()}

    def usable(m) -> bool:
        return isinstance(m, nn.Linear) and m.weight.requires_grad

    def last_linear(m) -> nn.Module | None:
        found = None
        for sub in m.modules():
            if usable(sub):
                found = sub
        return found

    candidates = []
    get_classifier = getattr(model, "get_classifier", None)
    if callable(get_classifier):
        try:
            candidates.append(get_classifier())
        except Exception:  # a model's own method with another meaning
            pass
    for path in CLASSIFIER_HEADS:
        try:
            candidates.append(model.get_submodule(path))
        except AttributeError:
            continue
    for m in candidates:
        if isinstance(m, nn.Module) and id(m) in names:
            found = last_linear(m)
            if found is not None:
                return names[id(found)]
    found = last_linear(model)
    if found is None:
        raise ValueError("the last layer ('last_layer') was not found: no nn.Linear layer with trainable parameters in "
                         f"{type(model).__name__}; accepted: a model with a linear classifier, or "
                         "params=[...] patterns over parameter names")
    return names[id(found)]


def last_layer_params(model: nn.Module, name: str) -> list[str]:
    """The trainable parameter names of the layer ``name`` (weight, then bias)."""
    module = model.get_submodule(name)
    prefix = f"{name}." if name else ""
    return [prefix + a for a, p in module.named_parameters(recurse=False) if p.requires_grad]


def _classifier_hint(model: nn.Module) -> str:
    """``"; the classifier is ['fc.weight', 'fc.bias'] ..."`` for a no-match message, or "" if none is found."""
    try:
        names = last_layer_params(model, find_last_layer(model))
    except ValueError:
        return ""
    prefix = names[0].rsplit(".", 1)[0] + ".*" if "." in names[0] else "*"
    return f"; the classifier is {names} (params='last_layer' or [{prefix!r}] selects it)"


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
         x: torch.Tensor | tuple, output_key: str = "logits", dict_inputs: str = "auto") -> torch.Tensor:
    """Evaluates ``model`` at the given tensors without touching its own state.

    ``torch.func.functional_call(model, (params, buffers), x)``. In train mode
    BatchNorm updates the running statistics held in ``buffers`` in place, exactly
    as ``model(x)`` updates its own.

    Args:
        model: the user's module (used only as a function).
        params: every parameter of ``model`` by name.
        buffers: every buffer of ``model`` by name.
        x: the input, a tuple of positional inputs (``model(*x)``), or a mapping: keyword inputs
            (``model(**x)``, as a Hugging Face batch without its labels) or one positional dict (``model(x)``), as
            ``dict_inputs`` says.
        output_key: which output to use when the model returns a mapping (see :func:`model_output`).
        dict_inputs: how a mapping ``x`` is passed (:func:`bayeswrap.core.batches.dict_call_style`): ``"auto"``
            (from ``model.forward``'s signature), ``"kwargs"`` or ``"positional"``.

    Returns:
        The model's output tensor: what ``model.forward`` returns, read by :func:`model_output`.

    Raises:
        ValueError: for a mapping ``x`` that fits both or neither convention of ``dict_inputs="auto"``.
    """
    args, kwargs = call_arguments(x, model, dict_inputs)
    out = functional_call(model, (dict(params), dict(buffers)), args, kwargs, tie_weights=_has_tied_tensors(model),
                          strict=False)
    return out if isinstance(out, torch.Tensor) else model_output(out, output_key)


def model_output(out, output_key: str = "logits") -> torch.Tensor:
    """The output tensor of a model's return value: a tensor, a mapping, a ``ModelOutput`` or a tuple.

    A tensor is returned as it is; a mapping (a ``dict``, or a Hugging Face
    ``ModelOutput``, which is an ordered mapping) gives ``out[output_key]``; a tuple or
    list gives its first element (Hugging Face's ``return_dict=False`` output when no
    labels are passed starts with the logits); any other object its attribute
    ``output_key``.

    Args:
        out: what ``model.forward`` returned.
        output_key: the key of the outputs in a mapping (Hugging Face's ``"logits"`` by default).

    Returns:
        The tensor of outputs, e.g. logits of shape (B, K).

    Raises:
        TypeError: if no tensor is found that way; the message names the keys (or the type) that were returned.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        value = out.get(output_key)
        if isinstance(value, torch.Tensor):
            return value
        raise TypeError(f"the model returned a {type(out).__name__} with keys {list(out)[:8]} and no tensor under "
                        f"output_key={output_key!r}; accepted: set output_key= in bw.wrap to the key of the "
                        "outputs (e.g. 'logits')")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    value = getattr(out, output_key, None)
    if isinstance(value, torch.Tensor):
        return value
    raise TypeError(f"the model returned a {type(out).__name__}; accepted: a tensor of outputs, a tuple whose first "
                    f"element is one, or a mapping / ModelOutput with the outputs under output_key={output_key!r}")


def call_arguments(x, model=None, dict_inputs: str = "auto") -> tuple[tuple, dict | None]:
    """``(args, kwargs)`` of a forward call on inputs ``x``: a tensor ``model(x)``, a tuple ``model(*x)``, a
    mapping ``model(**x)`` or ``model(x)`` (:func:`bayeswrap.core.batches.dict_call_style`; ``model(**x)`` when no
    model is given).
    """
    if isinstance(x, Mapping):
        if model is not None and dict_call_style(model, x.keys(), dict_inputs) == "positional":
            return (x,), None
        return (), dict(x)
    return (x if isinstance(x, tuple) else (x,)), None


def vmap_over_examples(fn: Callable, in_dims=0) -> Callable:
    """``torch.func.vmap(fn, in_dims)`` that falls back to a loop where vmap cannot run the model.

    Some models cannot run under ``vmap``: Hugging Face's attention masks branch
    in Python on ``mask.all()`` ("data-dependent control flow"), ``nn.GRU``/``nn.RNN``
    add in place into a hidden state they create unbatched, and ``nn.LSTM``'s
    backward kernel has no batching rule ("workspace"). When ``vmap`` raises a
    RuntimeError, ``fn`` is called once per slice (each slice taken as ``vmap``
    would pass it) and the results are stacked along dimension 0: the values vmap
    would return, at the cost of a Python loop, with a RuntimeWarning. If the loop
    fails too, its error is raised (so errors of the model itself surface as they are).

    Args:
        fn: a function of per-example (or per-row) arguments, as for ``vmap``.
        in_dims: ``vmap``'s ``in_dims``: an int, or a tuple with an int or None per argument.

    Returns:
        A function of batched arguments returning ``fn``'s outputs stacked along dimension 0.
    """

    def run(*args):
        try:
            return vmap(fn, in_dims=in_dims)(*args)
        except RuntimeError as e:
            reason = str(e).splitlines()[0][:160]
        dims = in_dims if isinstance(in_dims, tuple) else (in_dims,) * len(args)
        count = next(t.shape[d] for a, d in zip(args, dims) if d is not None
                     for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor))
        outs = []
        for i in range(count):
            one = [a if d is None else tree_map(lambda t, d=d: t.select(d, i) if isinstance(t, torch.Tensor) else t, a)
                   for a, d in zip(args, dims)]
            outs.append(fn(*one))
        warnings.warn(f"vmap cannot run this model ({reason}); bayeswrap loops instead (the same values, slower)",
                      RuntimeWarning, stacklevel=2)
        flat = [tree_flatten(o)[0] for o in outs]
        return tree_unflatten([torch.stack(ts) for ts in zip(*flat)], tree_flatten(outs[0])[1])

    return run


_TIED: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


@torch.compiler.assume_constant_result
def _has_tied_tensors(model: nn.Module) -> bool:
    """Whether a tensor of ``model`` is registered under several names (cached per module).

    ``functional_call(tie_weights=True)`` then gives every alias the tensor
    passed for one of them; for a module without aliases the tie bookkeeping
    (a walk over all its names on every call) is skipped. ``torch.compile`` takes the answer as a constant
    (no guard on the cache, whose entries come and go with other modules).
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


def outside_inference_mode(fn: Callable) -> Callable:
    """Decorator: runs ``fn`` outside ``torch.inference_mode`` when it is called inside it.

    Functions that differentiate internally (Laplace's curvature, its linearised
    predictive) need autograd, which ``torch.inference_mode`` switches off for
    every tensor made inside it (``torch.enable_grad()`` does not bring it back):
    the gradients would be missing or wrong. Lightning's ``Trainer`` predicts,
    validates and tests under inference mode by default. The wrapper leaves it
    (``torch.inference_mode(False)``) and clones the tensor arguments that are
    inference tensors (``Tensor.is_inference()``), nested inputs included
    (:func:`bayeswrap.core.batches.map_tensors`), so that autograd may save them;
    the ``torch.no_grad`` state is kept. Outside inference mode ``fn`` is called
    as it is.
    """
    def normal(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if t.is_inference() else t

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            args = tuple(map_tensors(normal, a) for a in args)
            kwargs = {k: map_tensors(normal, v) for k, v in kwargs.items()}
            return fn(*args, **kwargs)

    return wrapper


def check_finite_state(state_dict, skip: Iterable[str] = (), nan_only: Callable[[str], bool] | None = None) -> None:
    """Refuses a state dict (a checkpoint about to be loaded) that holds NaN or inf, one check per tensor.

    Args:
        state_dict: ``{key: tensor}``.
        skip: keys whose values may legitimately be non-finite (e.g. Laplace's unknown log-likelihood).
        nan_only: optional predicate on the key: for those tensors only NaN counts (see :func:`nonfinite_names`).

    Raises:
        ValueError: if ``state_dict`` is not a mapping, or naming the first key whose tensor holds NaN or inf.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"state_dict must be a mapping from names to tensors (bnn.state_dict()), got "
                         f"{type(state_dict).__name__}")
    skip = set(skip)
    bad = nonfinite_names(((k, v) for k, v in state_dict.items() if k not in skip), nan_only=nan_only)
    if bad:
        count = int((~torch.isfinite(state_dict[bad[0]])).sum())
        raise ValueError(f"state_dict[{bad[0]!r}] contains {count} non-finite values (NaN or inf)"
                         f"{f'; so do {bad[1:4]}' if len(bad) > 1 else ''}; accepted: a checkpoint with finite "
                         "values (was it saved after training diverged?)")
