"""Saving a Bayesian model with the arguments that rebuild it: ``bw.save(bnn, path)`` and ``bw.load(path, model)``.

A ``bnn.state_dict()`` alone cannot be loaded without first repeating the exact ``bw.wrap(model, method, ...)``
call that made the model (method, Bayesian parameters, method options: the state's structure depends on all of
them). :func:`save` stores that call next to the state, so :func:`load` needs only the architecture::

    bw.save(bnn, "bnn.pt")
    ...
    bnn = bw.load("bnn.pt", MyNet())      # a fresh instance: its weights are replaced by the saved state

The file is one ``torch.save`` of plain data, read back with ``torch.load(..., weights_only=True)``
(:func:`bayeswrap.core.io.load_checkpoint`: never unrestricted pickle), written atomically
(:func:`bayeswrap.core.io.atomic_write`: a reader never sees a half-written file, and a symbolic link, device,
pipe or folder at the destination is refused), with the SHA-256 of every tensor and container of it in an extra
record of the zip archive that ``torch.load`` ignores (:mod:`bayeswrap.core.digest`): :func:`load` refuses a
file whose contents changed since (:class:`bayeswrap.core.io.IntegrityError`) and warns for one without a
digest (:class:`bayeswrap.core.io.NoDigestWarning`, a file of an older bayeswrap)::

    {"format": "bayeswrap.save", "format_version": 1, "bayeswrap": "<version that wrote it>",
     "method": "vi", "arguments": {wrap's keyword arguments}, "training": bool,
     "architecture": [[kind, name, shape, dtype, requires_grad], ...],   # the wrapped model's tensors
     "state": bnn.state_dict()}                                         # with each method's extra state

The state holds everything a fitted posterior has beyond its parameters: SWAG's moments and deviations, SGLD's
and the samplers' stored draws, Laplace's curvature and prior precision, an ensemble's members, the prior mean
(so a ``prior_mean`` mapping is restored from the state, not from the arguments).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping

import torch
from torch import nn

from bayeswrap._version import __version__
from bayeswrap.core.io import CheckpointError, load_checkpoint, remove_stale_tmp_of, save_checkpoint
from bayeswrap.core.modules import unwrap_compiled
from bayeswrap.methods import METHODS, BayesianModel, wrap

#: the ``format`` entry of a file written by :func:`save`
FORMAT = "bayeswrap.save"
#: the layout version of that file; :func:`load` reads this version only
FORMAT_VERSION = 1
#: entries a saved file holds, and their types
FILE_KEYS = {"format": str, "format_version": int, "bayeswrap": str, "method": str, "arguments": dict,
             "training": bool, "architecture": list, "state": dict}


def save(bnn: BayesianModel, path: str | os.PathLike) -> None:
    """Writes a Bayesian model and the ``bw.wrap`` arguments that rebuild it to one file.

    Args:
        bnn: a model made by :func:`bayeswrap.wrap` (fitted or not; ``torch.compile(bnn)`` is unwrapped).
        path: the file to write (conventionally ``*.pt``); parent folders are created. Written atomically: a
            reader sees the old file or the whole new one, never a part; the temporary file of an earlier save to
            ``path`` whose process was killed is removed first.

    Raises:
        TypeError: if ``bnn`` is not a BayesianModel.
        ValueError: if ``bnn`` was not made by ``bw.wrap`` (its arguments are unknown), was wrapped with a
            ``params`` callable (a function cannot be stored: give glob patterns over parameter names, e.g.
            ``params=["fc.*"]``), or has an argument that is not plain data (numbers, strings, booleans,
            None, lists, tuples and string-keyed dicts of these, ``torch.dtype``, ``torch.device``).
        bayeswrap.core.io.UnsafePathError: if ``path`` is a symbolic link, a folder, a device or a pipe.
    """
    bnn = unwrap_compiled(bnn)
    if not isinstance(bnn, BayesianModel):
        raise TypeError(f"bnn must be a bayeswrap BayesianModel (from bw.wrap(model, method, ...)), got "
                        f"{type(bnn).__name__}")
    method, arguments = storable_wrap_arguments(bnn)
    contents = {"format": FORMAT, "format_version": FORMAT_VERSION, "bayeswrap": __version__, "method": method,
                "arguments": arguments, "training": bool(bnn.training), "architecture": architecture(bnn.model),
                "state": bnn.state_dict()}
    remove_stale_tmp_of(path)  # what a killed save to this path left (a file as large as the model)
    save_checkpoint(path, contents)  # atomic, with the digest of every tensor and container


def storable_wrap_arguments(bnn: BayesianModel) -> tuple[str, dict]:
    """The method and the ``bw.wrap`` keyword arguments that rebuild ``bnn``, as plain data (what :func:`save`
    stores; ``bayeswrap.lightning`` saves them as hyper-parameters).

    A ``prior_mean`` mapping is stored as ``"init"``: its tensors are the state's ``prior.mean`` entries.

    Raises:
        ValueError: if ``bnn`` was not made by ``bw.wrap``, was wrapped with a ``params`` callable, or has an
            argument that is not plain data (see :func:`save`).
    """
    recorded = getattr(bnn, "wrap_arguments", None)
    if not isinstance(recorded, Mapping):
        raise ValueError(f"this {type(bnn).__name__} was not made by bw.wrap(model, method, ...), so the arguments "
                         "that rebuild it are unknown; accepted: a model from bw.wrap (e.g. "
                         f"bw.wrap(model, {bnn.method!r}, num_data=...) instead of the class itself)")
    arguments = dict(recorded)
    method = arguments.pop("method")
    if callable(arguments.get("params")):
        raise ValueError("params is a callable, which cannot be stored in a file; accepted: None (all trainable "
                         "parameters), 'last_layer', or glob patterns over parameter names, e.g. params=['fc.*'] "
                         f"(this model's Bayesian parameters: {list(bnn.bayesian_names)[:8]})")
    if isinstance(arguments.get("prior_mean"), Mapping):
        arguments["prior_mean"] = "init"  # the mapping's tensors are the state's prior.mean entries
    return method, {name: _storable(name, value) for name, value in arguments.items()}


def load(path: str | os.PathLike, model: nn.Module, *,
         map_location: str | torch.device | None = None) -> BayesianModel:
    """Rebuilds a model written by :func:`save` on ``model``'s architecture.

    Calls ``bw.wrap(model, method, **saved arguments)`` and loads the saved state into the result. ``model``
    itself is not modified (as with ``wrap``, the returned model holds its own copies of the trainable tensors, and
    references a frozen tensor of ``model`` only where it equals the saved value); its weights do not matter, only
    its parameter and buffer names, shapes, dtypes and ``requires_grad`` flags, which must equal the saved model's.

    Args:
        path: a file written by :func:`save`.
        model: a fresh instance of the saved model's architecture (any ``nn.Module``; one compiled with
            ``torch.compile`` is unwrapped).
        map_location: the device of the returned model (``"cpu"``, ``"cuda:0"``, a ``torch.device``); None
            keeps ``model``'s device, as ``wrap`` does.

    Returns:
        The BayesianModel, in the train/eval mode it was saved in; its predictions equal the saved model's
        (with the same ``generator``).

    Raises:
        bayeswrap.core.io.CheckpointError: naming the file, if it is missing, empty, truncated, damaged, not a
            torch file, holds Python objects beyond plain data, or was not written by :func:`save` (or by a
            newer layout); :class:`bayeswrap.core.io.IntegrityError` (a subclass) if a tensor or value differs
            from the digest recorded at save time, naming it and both SHA-256 digests.
        ValueError: if ``model``'s architecture differs from the saved one (the message names the first
            parameter or buffer that differs, and how), or ``map_location`` is not a device.
        TypeError: if ``model`` is not an ``nn.Module``.

    Warns:
        bayeswrap.core.io.NoDigestWarning: for a file without a digest (written by an older bayeswrap).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a fresh instance of the saved architecture), got "
                        f"{type(model).__name__}")
    device = _device(map_location)
    contents = load_checkpoint(path, required={"format": str})
    if contents["format"] != FORMAT:
        raise CheckpointError(f"{path} is not a file written by bayeswrap.save (format {contents['format']!r}); "
                              f"accepted: a file from bw.save(bnn, path)")
    contents = _check_entries(path, contents)
    model = unwrap_compiled(model)
    _check_architecture(contents["architecture"], architecture(model), path, contents["bayeswrap"])
    bnn = wrap(model, contents["method"], **contents["arguments"])
    try:
        bnn.load_state_dict(contents["state"])
    except (RuntimeError, ValueError) as err:
        raise CheckpointError(f"{path}: the saved state (bayeswrap {contents['bayeswrap']}) does not load into the "
                              f"rebuilt {contents['method']!r} model: {err}") from None
    bnn.train(contents["training"])
    return bnn if device is None else bnn.to(device)


def _check_entries(path, contents: dict) -> dict:
    """Checks the entries of a file written by :func:`save` (see :data:`FILE_KEYS`).

    Raises:
        CheckpointError: naming the file and the missing or mistyped entry, or a layout newer than
            :data:`FORMAT_VERSION`.
    """
    missing = [k for k in FILE_KEYS if k not in contents]
    if missing:
        raise CheckpointError(f"{path} lacks {', '.join(missing)}; expected keys {', '.join(FILE_KEYS)}")
    wrong = [f"{k} ({type(contents[k]).__name__}, expected {t.__name__})" for k, t in FILE_KEYS.items()
             if not isinstance(contents[k], t) or (t is int and isinstance(contents[k], bool))]
    if wrong:
        raise CheckpointError(f"{path} has entries of the wrong type: {', '.join(wrong)}")
    if contents["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path} has layout version {contents['format_version']} (written by bayeswrap "
                              f"{contents['bayeswrap']}); this bayeswrap {__version__} reads version "
                              f"{FORMAT_VERSION}")
    if contents["method"] not in METHODS:
        raise CheckpointError(f"{path} holds a model of method {contents['method']!r}, which this bayeswrap "
                              f"{__version__} does not know; accepted: {', '.join(METHODS)}")
    return contents


def architecture(model: nn.Module) -> list[list]:
    """The fingerprint :func:`load` compares: ``[kind, name, shape, dtype, requires_grad]`` per tensor.

    Args:
        model: any ``nn.Module`` (tensors may be on the ``meta`` device: only their metadata is read).

    Returns:
        One entry per parameter (``kind="parameter"``) and buffer (``"buffer"``), in ``named_parameters()``
        then ``named_buffers()`` order; shapes are lists of ints and dtypes strings such as ``"torch.float32"``.
    """
    return ([["parameter", n, list(p.shape), str(p.dtype), bool(p.requires_grad)]
             for n, p in model.named_parameters()] +
            [["buffer", n, list(b.shape), str(b.dtype), False] for n, b in model.named_buffers()])


def _check_architecture(saved: list, ours: list[list], path, version: str) -> None:
    """Refuses a model whose tensors differ from the saved model's, naming the first difference."""
    theirs = {entry[1]: entry for entry in saved if isinstance(entry, list) and len(entry) == 5}
    if len(theirs) != len(saved):
        raise CheckpointError(f"{path}: its architecture entry is damaged; expected [kind, name, shape, dtype, "
                              "requires_grad] per tensor")
    mine = {entry[1]: entry for entry in ours}
    fields = ("kind", "name", "shape", "dtype", "requires_grad")
    for name, entry in theirs.items():
        kind = entry[0]
        if name not in mine:
            raise ValueError(f"this model differs from the saved one ({path}, bayeswrap {version}): the saved "
                             f"model's {kind} {name!r} (shape {tuple(entry[2])}) is missing here; accepted: a fresh "
                             f"instance of the saved architecture (its {len(theirs)} tensors begin "
                             f"{list(theirs)[:4]})")
        for i, field in enumerate(fields):
            if field != "name" and mine[name][i] != entry[i]:
                saved_value, our_value = entry[i], mine[name][i]
                if field == "shape":
                    saved_value, our_value = tuple(saved_value), tuple(our_value)
                raise ValueError(f"this model differs from the saved one ({path}, bayeswrap {version}): {kind} "
                                 f"{name!r} has {field} {our_value} here but {saved_value} in the saved model; "
                                 "accepted: a fresh instance of the saved architecture"
                                 + (" with the same parameters frozen (requires_grad=False) as when it was wrapped"
                                    if field == "requires_grad" else ""))
    extra = [name for name in mine if name not in theirs]
    if extra:
        raise ValueError(f"this model differs from the saved one ({path}, bayeswrap {version}): it has "
                         f"{mine[extra[0]][0]} {extra[0]!r}, which the saved model lacks; accepted: a fresh "
                         "instance of the saved architecture")


def _storable(name: str, value):
    """``value`` as plain data that ``torch.load(weights_only=True)`` reads back (numpy and 0-d tensor numbers
    become Python numbers), or a ValueError naming the argument.
    """
    if value is None or type(value) in (str, bool, int, float) or isinstance(value, (torch.dtype, torch.device)):
        return value
    if isinstance(value, str):  # a str subclass (an enum member)
        return str(value)
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_complex():
        return value.item()
    if isinstance(value, numbers.Integral):  # numpy integers (numpy bools are not Integral)
        return int(value)
    if isinstance(value, numbers.Real):  # numpy floats
        return float(value)
    if isinstance(value, (list, tuple)):
        items = [_storable(name, v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _storable(f"{name}[{k!r}]", v) for k, v in value.items()}
    raise ValueError(f"the wrap argument {name}={value!r} ({type(value).__name__}) cannot be stored in a file; "
                     "accepted: numbers, strings, booleans, None, lists, tuples and string-keyed dicts of these, "
                     "torch.dtype and torch.device")


def _device(map_location) -> torch.device | None:
    """``map_location`` as a device, or None."""
    if map_location is None or isinstance(map_location, torch.device):
        return map_location
    try:
        return torch.device(map_location)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"map_location={map_location!r} is not a device; accepted: None (model's device), "
                         "'cpu', 'cuda', 'cuda:N', 'mps' or a torch.device") from None


__all__ = ["FORMAT", "FORMAT_VERSION", "architecture", "load", "save", "storable_wrap_arguments"]
