"""Batch structure and input checks shared by training, prediction and every method.

A loader batch is an ``(inputs, targets)`` pair, or a mapping with the targets under
a label key (a Hugging Face batch, :func:`batch_pair`). Inputs are a tensor, a tuple of
positional tensors (the model is called as ``model(x1, x2)``), or a mapping of
named tensors (e.g. a Hugging Face ``BatchEncoding``; how the model receives it is
:func:`bayeswrap.core.functional.call`'s convention); lists and nested structures
are moved and sliced like tuples, and leaves that are not tensors (a flag, a
string) are passed through unchanged. These helpers take a
batch apart, move and slice nested inputs, check that floating inputs are finite,
find the device and the batch size of inputs, and cast narrow integer class labels.

**Dict inputs** (:func:`dict_call_style`) reach the model in one of two ways: as keyword arguments,
``model(**inputs)`` (a Hugging Face model, ``forward(self, input_ids, attention_mask=None, ...)``), or as one
positional dict, ``model(inputs)`` (``forward(self, batch)``). ``bw.wrap(..., dict_inputs="auto")`` reads which from
the signature of the model's ``forward``, in this order:

1. keyword arguments when every key names a parameter of ``forward`` and every parameter without a default is
   among the keys (``forward(self, a, b)`` for keys a, b; a Hugging Face forward);
2. keyword arguments when ``forward`` takes ``**kwargs``, every parameter without a default is among the keys,
   and ``forward`` names a positional parameter (which then keeps its default: ``forward(self, inputs=None,
   **named)``);
3. one positional dict when ``forward`` can be called with exactly one positional argument, named by a parameter
   that is not among the keys (``forward(self, batch)``, ``forward(self, batch, **options)``);
4. otherwise the call is refused, naming both conventions and the switch: when neither fits (``forward(self, x,
   mask)`` for keys a, b), or when both fit and the signature tells nothing (``forward(self, *args, **kwargs)``).
   ``dict_inputs="kwargs"`` or ``"positional"`` then selects one (and skips the reading).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping

import torch

__all__ = ["DICT_INPUTS", "NonFiniteInputError", "batch_pair", "batch_size", "check_dict_inputs",
           "check_inputs_finite", "check_nonempty", "check_reiterable", "class_labels", "dict_call_style",
           "map_tensors", "loader_pair", "take", "tensor_leaves", "to_device", "unsqueeze", "without_key", "x_device"]

#: how a dict input is passed to the model (``bw.wrap``'s ``dict_inputs``): read from ``forward``'s signature,
#: ``model(**inputs)``, or ``model(inputs)``
DICT_INPUTS = ("auto", "kwargs", "positional")

#: integer label dtypes cast to int64 by :func:`class_labels` (what ``cross_entropy`` needs)
_NARROW_LABELS = frozenset(getattr(torch, name) for name in ("int8", "int16", "int32", "uint8", "uint16", "uint32",
                                                             "uint64") if hasattr(torch, name))


class NonFiniteInputError(ValueError):
    """A floating model input holds NaN or inf (raised by :func:`check_inputs_finite`).

    Attributes:
        output: the loss output computed on the input, when :meth:`BayesianModel.loss`
            raised it (so :func:`bayeswrap.fit` can report the loss with the epoch and
            step); ``None`` otherwise.
    """

    def __init__(self, message: str, output=None):
        super().__init__(message)
        self.output = output


def batch_pair(batch, where: str = "the loader", label_key: str = "labels"):
    """``(inputs, targets)`` of one loader batch, or a ValueError saying what the batch was.

    Accepted batches are ``(inputs, targets)`` pairs (a tuple or list of length 2)
    and mappings that hold the targets under ``label_key``: a Hugging Face batch
    ``{"input_ids": ..., "attention_mask": ..., "labels": ...}`` from a data collator
    gives the inputs ``{"input_ids": ..., "attention_mask": ...}`` (every other key, in
    order; the model is then called as ``model(**inputs)``) and the targets
    ``batch["labels"]`` (laplace-torch's ``dict_key_x``/``dict_key_y`` convention).

    Args:
        batch: one item yielded by a loader.
        where: how to name the loader and batch in the message, e.g. ``"train_loader batch 3"``.
        label_key: the key of the targets in a mapping batch (Hugging Face's ``"labels"`` by default).

    Raises:
        ValueError: unless ``batch`` is a pair, or a mapping that holds ``label_key`` and at least one other key.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        keys = list(batch)
        if label_key in batch and len(keys) > 1:
            return {k: v for k, v in batch.items() if k != label_key}, batch[label_key]
        missing = (f"no key {label_key!r} (the targets)" if label_key not in batch
                   else f"only the targets {label_key!r}")
        raise ValueError(f"{where} yielded a {type(batch).__name__} with keys {keys[:8]} and {missing}; accepted: "
                         f"a mapping with the targets under label_key={label_key!r} and the model's keyword inputs "
                         "under the other keys (set label_key= in bw.wrap to the key of your targets), or "
                         "(inputs, targets) pairs")
    if isinstance(batch, (tuple, list)):
        got = f"a {type(batch).__name__} of length {len(batch)}"
    elif isinstance(batch, torch.Tensor):
        got = f"a single tensor of shape {tuple(batch.shape)}"
    else:
        got = f"a {type(batch).__name__}"
    raise ValueError(f"{where} yielded {got}; accepted: (inputs, targets) pairs, e.g. a DataLoader over a "
                     "TensorDataset(x, y) or a list of (x, y) tuples, or mappings with the targets under "
                     f"label_key={label_key!r} (a Hugging Face batch); wrap other loaders so they yield one of these")


def loader_pair(batch, where: str, label_key: str, device: torch.device | str, classification: bool):
    """A training batch ready for the loss: :func:`batch_pair`, both parts moved to ``device``, and class
    labels of a narrow integer dtype read as int64 (:func:`class_labels`) when ``classification``.

    Raises:
        ValueError: as :func:`batch_pair`, and for a batch of 0 examples (:func:`check_nonempty`).
    """
    x, y = batch_pair(batch, where, label_key)
    check_nonempty(x, y, where)
    x, y = to_device(x, device), to_device(y, device)
    return x, (class_labels(y) if classification else y)


def check_nonempty(x, y, where: str) -> None:
    """Refuses a batch of 0 examples: targets, or the inputs' first tensor (as :func:`batch_size` reads it), whose
    batch dimension is 0.

    Its mean loss is 0/0 = NaN, which training would otherwise report as a non-finite loss of the model. Reads
    shapes only (no device sync); inputs and targets without a batch dimension are left to the other checks, and
    so are further input tensors (a mapping may hold an empty tensor that is not per example).

    Args:
        x: the batch's inputs (a tensor or a nested structure of them).
        y: the batch's targets.
        where: how to name the loader and batch, e.g. ``"train_loader batch 3 of epoch 1"``.

    Raises:
        ValueError: naming the batch and the shapes, e.g. ``train_loader batch 3 of epoch 1 holds 0 examples
            (inputs of shape (0, 4), targets of shape (0,))``.
    """
    shapes = [(label, tuple(t.shape)) for label, t in tensor_leaves(x, "inputs") if t.dim()]
    target = tuple(y.shape) if isinstance(y, torch.Tensor) and y.dim() else None
    if not (shapes and shapes[0][1][0] == 0) and not (target is not None and target[0] == 0):
        return
    parts = [f"{label} of shape {shape}" for label, shape in shapes[:3]]
    if target is not None:
        parts.append(f"targets of shape {target}")
    raise ValueError(f"{where} holds 0 examples ({', '.join(parts)}): its mean loss would be 0/0 = NaN; accepted: "
                     "batches of at least one example (a DataLoader never yields an empty batch from a non-empty "
                     "dataset: check a custom sampler, collate_fn or generator, or leave the empty batches out)")


def check_reiterable(loader, name: str, passes: int, why: str) -> None:
    """Refuses a one-shot iterator (a generator, ``iter(loader)``, a ``map`` object) that is read more than once.

    Such an iterator is exhausted after its first pass, so the second pass would see no batches. A loader is
    one-shot when it is an :class:`~collections.abc.Iterator` (``iter(loader) is loader``); a ``DataLoader``, a
    list or any other re-iterable is not. ``iter`` is never called (a DataLoader would start its workers).

    Args:
        loader: what the user passed.
        name: the argument's name, e.g. ``"train_loader"``.
        passes: how many times it will be iterated.
        why: what iterates it, e.g. ``"fit iterates it once per epoch (epochs=3)"``.

    Raises:
        ValueError: naming the argument, its type and why it is read several times, when ``passes > 1``.
    """
    if passes > 1 and isinstance(loader, Iterator):
        raise ValueError(f"{name} is a {type(loader).__name__}, a one-shot iterator that is exhausted after one pass, "
                         f"but {why}, so every pass after the first would get no batches; accepted: a re-iterable "
                         "such as a torch DataLoader or a list of (inputs, targets) batches (e.g. list(generator) "
                         "for a small data set)")


def without_key(x, key: str):
    """A mapping input without ``key`` (e.g. the labels of a whole Hugging Face batch passed to ``predict``).

    Other inputs, and mappings without ``key``, are returned as they are.
    """
    if isinstance(x, Mapping) and key in x:
        return {k: v for k, v in x.items() if k != key}
    return x


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], x):
    """``fn`` applied to every tensor of a nested input (tensor / tuple / list / mapping), structure kept.

    Tuples (named tuples too) and lists keep their type; a mapping becomes a
    ``dict`` unless its type can be rebuilt from one (a ``dict`` subclass such as
    ``OrderedDict``); leaves that are not tensors are returned as they are.
    """
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        items = {k: map_tensors(fn, v) for k, v in x.items()}
        if type(x) is dict:
            return items
        try:
            return type(x)(items)
        except Exception:  # a mapping type that cannot be built from a dict: a plain dict of the same items
            return items
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
        return type(x)(*(map_tensors(fn, v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(map_tensors(fn, v) for v in x)
    return x


def tensor_leaves(x, name: str = "x") -> Iterator[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` for every tensor of a nested input, labelled like ``x``, ``x[0]`` or ``x['ids']``."""
    if isinstance(x, torch.Tensor):
        yield name, x
    elif isinstance(x, Mapping):
        for k, v in x.items():
            yield from tensor_leaves(v, f"{name}[{k!r}]")
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from tensor_leaves(v, f"{name}[{i}]")


def to_device(x, device: torch.device | str, non_blocking: bool = False):
    """A nested input (tensor / tuple / list / mapping) with every tensor moved to ``device``.

    Tensors already there are returned as they are (``Tensor.to`` is a no-op); the
    structure is kept (see :func:`map_tensors`), so the model is called as it would be
    on the original inputs.
    """
    if isinstance(x, torch.Tensor):  # the common case, without the walk (it runs once per training step)
        return x.to(device, non_blocking=non_blocking)
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), x)


def take(x, index):
    """Rows ``index`` (a slice, an integer tensor, ...) of every tensor of a nested input: ``x[index]`` per tensor."""
    return map_tensors(lambda t: t[index], x)


def unsqueeze(x):
    """A batch dimension of 1 added in front of every tensor of a nested input (one example as a batch)."""
    return map_tensors(lambda t: t.unsqueeze(0), x)


def batch_size(x) -> int:
    """The batch size B of a nested input: dimension 0 of its first tensor.

    Raises:
        ValueError: if the input holds no tensor, or only 0-d ones.
    """
    for _, t in tensor_leaves(x):
        if t.dim():
            return int(t.shape[0])
    raise ValueError(f"the inputs ({type(x).__name__}) hold no tensor with a batch dimension; accepted: a tensor, "
                     "a tuple or list of tensors, or a dict of tensors, each of shape (B, ...)")


def check_inputs_finite(x, name: str = "x") -> None:
    """Raises :class:`NonFiniteInputError` (a ValueError) if a floating tensor of the input holds a NaN or an infinity.

    One ``torch.isfinite(t).all()`` per floating tensor (one device sync each);
    nested inputs (tuples, lists, mappings) are walked, and non-tensor leaves are not inspected.

    Args:
        x: a model input: a tensor, or a tuple/list/mapping of them.
        name: how the message names the input (a part of it is named like ``x[0]`` or ``x['ids']``).

    Raises:
        NonFiniteInputError: naming the input (or its part), its shape and the number of non-finite values.
    """
    for label, t in tensor_leaves(x, name):
        if t.is_floating_point() and not t.is_meta and t.numel() and not bool(torch.isfinite(t).all()):
            count = int((~torch.isfinite(t)).sum())
            raise NonFiniteInputError(f"{label} (shape {tuple(t.shape)}) contains {count} non-finite values (NaN or "
                                      "inf); accepted: finite inputs")


def x_device(x) -> torch.device:
    """The device of a model input (a tensor, or the first tensor of a nested tuple/list/mapping of inputs).

    Raises:
        ValueError: if the input holds no tensor.
    """
    for _, t in tensor_leaves(x):
        return t.device
    raise ValueError(f"the inputs ({type(x).__name__}) hold no tensor; accepted: a tensor, a tuple or list of "
                     "tensors, or a dict of tensors")


def class_labels(y):
    """Integer class labels as int64, which ``cross_entropy`` needs: int8/16/32 and unsigned labels are cast.

    Anything else (int64, floating or bool tensors, non-tensors) is returned as it
    is, for the likelihood's target check to accept or refuse.
    """
    if isinstance(y, torch.Tensor) and y.dtype in _NARROW_LABELS:
        return y.long()
    return y


def check_dict_inputs(value) -> str:
    """``dict_inputs`` (one of :data:`DICT_INPUTS`), or a ValueError naming the value and the accepted ones."""
    if not isinstance(value, str) or value not in DICT_INPUTS:
        raise ValueError(f"dict_inputs={value!r} is not accepted; accepted: {DICT_INPUTS} ('auto': from the model's "
                         "forward signature; 'kwargs': model(**inputs); 'positional': model(inputs))")
    return value


def dict_call_style(model: Callable, keys, dict_inputs: str = "auto") -> str:
    """How a dict input with ``keys`` is passed to ``model``: ``"kwargs"`` (``model(**x)``) or ``"positional"``
    (``model(x)``), by the rule of this module's docstring (cached per ``forward`` function and keys).

    Args:
        model: the module (its ``forward`` is inspected) or any callable.
        keys: the dict's keys, in order.
        dict_inputs: ``"auto"`` reads the signature; ``"kwargs"`` and ``"positional"`` are returned as they are.

    Raises:
        ValueError: with ``"auto"``, when both conventions or neither fit ``forward``'s signature; the message names
            the keys, the signature, both conventions and the ``dict_inputs`` switch of ``bw.wrap``.
    """
    if dict_inputs != "auto":
        return dict_inputs
    forward = getattr(model, "forward", model)
    function = getattr(forward, "__func__", forward)
    bound = hasattr(forward, "__func__")
    try:
        return _dict_style(function, bound, tuple(keys))
    except TypeError:  # an unhashable callable: no cache
        return _dict_style.__wrapped__(function, bound, tuple(keys))


@functools.lru_cache(maxsize=256)
def _dict_style(function, bound: bool, keys: tuple) -> str:
    """:func:`dict_call_style`'s reading of ``function``'s signature (without its first parameter if ``bound``)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: the keyword convention, as before
        return "kwargs"
    params = list(signature.parameters.values())[1 if bound else 0:]
    kinds = inspect.Parameter
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in params)
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    by_keyword = {p.name for p in params if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    required = [p for p in params if p.default is p.empty and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    complete = all(p.name in keys for p in required)
    if complete and all(k in by_keyword for k in keys):
        return "kwargs"  # rule 1: the keys are forward's parameters
    as_kwargs = complete and var_keyword
    first = positional[0] if positional else None
    as_positional = ((first is not None and first.name not in keys) or (first is None and var_positional)) and \
        all(p is first for p in required)
    if as_kwargs and (first is not None or not as_positional):
        return "kwargs"  # rule 2
    if as_positional and not as_kwargs:
        return "positional"  # rule 3
    shown = signature.replace(parameters=params)
    name = getattr(function, "__qualname__", type(function).__name__)
    fit = "both fit" if as_kwargs else "neither fits"
    raise ValueError(f"the inputs are a dict with keys {list(keys)[:8]} and the model's forward is {name}{shown}: "
                     f"{fit} of the two conventions, model(**inputs) (each key a keyword argument of forward, e.g. "
                     "forward(self, input_ids, attention_mask=None) for a Hugging Face model) and model(inputs) (the "
                     "dict as the one positional argument, e.g. forward(self, batch)); accepted: bw.wrap(..., "
                     "dict_inputs='kwargs') or bw.wrap(..., dict_inputs='positional') to choose one, or a forward "
                     "whose parameters fit one of them")
