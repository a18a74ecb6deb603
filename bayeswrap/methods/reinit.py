"""Which weights an ensemble member starts afresh from, and re-initialising exactly those (``Ensemble(reinit=...)``).

A member is a copy of the wrapped model. ``reinit`` names the *parameters* that the copy re-draws from its
initialiser under the member's seed; every other tensor keeps the wrapped model's value bit for bit:

* ``"bayesian"`` (the default): the Bayesian parameters (``params``) that are trainable. For a pretrained
  backbone wrapped with ``params="last_layer"`` that is the head; for a peft model, the trainable adapters; for a
  from-scratch model with ``params=None`` it is every trainable parameter (the deep ensemble of
  Lakshminarayanan et al. 2017, §2.4).
* ``"all"``: every trainable parameter (Bayesian or not). ``"none"``: nothing.
* a glob pattern, or a list of them, over parameter names or the names of the modules that hold them, as for
  ``params``: ``"fc.*"``, ``["fc"]``, ``"*lora_A*"``.

Frozen parameters (``requires_grad=False``) are never re-initialised, nor written to (an initialiser that
would reset them writes into a stand-in copy, which is dropped). A parameter is re-drawn by its
*initialiser*: for a LoRA adapter of peft, the layer's own ``reset_lora_parameters(adapter, init)`` (A
kaiming-uniform with a = √5, or Gaussian for ``init_lora_weights="gaussian"``; B zero), so that the adapted model
starts at the pretrained function and members differ by their A; otherwise ``reset_parameters()`` of the nearest
module that has one (the module holding the parameter, else its closest ancestor). An initialiser also resets the
tensors next to the chosen ones (a ``Linear``'s bias, a BatchNorm's running statistics); those that are not chosen
are put back, except the buffers of a module whose own parameter is re-initialised (a BatchNorm's running
statistics restart with its affine parameters).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

#: the named forms of ``reinit`` (anything else is a glob pattern or a list of them)
REINIT_FORMS = ("bayesian", "all", "none")
REINIT_ACCEPTED = ("'bayesian' (the Bayesian trainable parameters), 'all' (every trainable parameter), 'none', or a glob "
             "pattern (or a non-empty list of them) over parameter or module names, e.g. 'fc.*', ['fc'] or "
             "'*lora_A*'")
#: peft's LoRA containers inside a ``LoraLayer``, each holding one entry per adapter
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def check_reinit(reinit) -> str | list[str]:
    """``reinit`` as stored: one of :data:`REINIT_FORMS`, or a list of glob patterns.

    Raises:
        ValueError: for anything but a string or a non-empty list/tuple of strings, naming the value and the
            accepted forms.
    """
    if isinstance(reinit, str) and reinit:
        return reinit if reinit in REINIT_FORMS else [reinit]
    if isinstance(reinit, (list, tuple)) and reinit and all(isinstance(p, str) and p for p in reinit):
        return list(reinit)
    raise ValueError(f"reinit={reinit!r} is not accepted; accepted: {REINIT_ACCEPTED}")


def _matches(name: str, pattern: str) -> bool:
    """Whether the parameter ``name`` or a module on its path (``a``, ``a.b``, ...) matches ``pattern``."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


def reinit_parameters(net: nn.Module, reinit: str | list[str], bayesian: list[str]) -> list[str]:
    """The trainable parameters of ``net`` that ``reinit`` chooses, in ``named_parameters()`` order.

    Args:
        net: the member's copy of the model.
        reinit: a value returned by :func:`check_reinit`.
        bayesian: the Bayesian parameter names (``bnn.bayesian_names``).

    Raises:
        ValueError: if a pattern matches no trainable parameter (naming the pattern, the accepted forms and some
            parameter names).
    """
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    if reinit == "none":
        return []
    if reinit == "all":
        return trainable
    if reinit == "bayesian":
        chosen = set(bayesian)
        return [n for n in trainable if n in chosen]
    for pattern in reinit:
        if not any(_matches(n, pattern) for n in trainable):
            frozen = [n for n, p in net.named_parameters() if not p.requires_grad and _matches(n, pattern)]
            why = (f"matches only frozen parameters (requires_grad=False, e.g. {frozen[:2]}), which are never "
                   "re-initialised" if frozen else "matches no trainable parameter or module holding one")
            hint = f" (did you mean '*{pattern}*'?)" if "*" not in pattern else ""
            some = trainable if len(trainable) <= 5 else trainable[:3] + ["..."] + trainable[-2:]
            raise ValueError(f"reinit pattern {pattern!r} {why}{hint}; accepted: {REINIT_ACCEPTED}; trainable "
                             f"parameters: {some}")
    return [n for n in trainable if any(_matches(n, p) for p in reinit)]


def _lora_initialisers(net: nn.Module) -> list[tuple[str, nn.Module, str, list[str], object]]:
    """``(layer name, layer, adapter, the adapter's parameter names, peft's configs)`` of every peft LoRA layer."""
    configs = getattr(net, "peft_config", None)
    out = []
    for name, mod in net.named_modules():
        if not (callable(getattr(mod, "reset_lora_parameters", None))
                and isinstance(getattr(mod, "lora_A", None), nn.ModuleDict)):
            continue
        prefix = f"{name}." if name else ""
        adapters = {a for part in _LORA_PARTS for a in (getattr(mod, part, None) or {})}
        for adapter in sorted(adapters):
            owned = [f"{prefix}{n}" for n, _ in mod.named_parameters()
                     if any(n == f"{part}.{adapter}" or n.startswith(f"{part}.{adapter}.") for part in _LORA_PARTS)]
            out.append((name, mod, adapter, owned, configs))
    return out


def _lora_init(configs, adapter: str):
    """The ``init_lora_weights`` of peft for ``adapter``: ``"gaussian"`` if so configured, else ``True`` (the default
    kaiming-uniform A and zero B; initialisations that also change the base weights, e.g. PiSSA, are not re-run).
    """
    config = configs.get(adapter) if isinstance(configs, dict) else None
    return "gaussian" if getattr(config, "init_lora_weights", True) == "gaussian" else True


def reinitialise(net: nn.Module, names: list[str], seed: int) -> list[str]:
    """Re-draws the parameters ``names`` of ``net`` in place from their initialisers under ``torch.manual_seed(seed)``
    (see the module docstring); every other parameter and buffer keeps its value bit for bit.

    Args:
        net: the member's copy of the model (changed in place).
        names: parameter names, from :func:`reinit_parameters`.
        seed: the member's seed (``init_seed + m``); torch's global generator state is restored afterwards.

    Returns:
        The names that were re-initialised (those of ``names`` that have an initialiser), in the order given.
    """
    if not names:
        return []
    chosen = set(names)
    jobs: dict[int, tuple[nn.Module, object, set[str]]] = {}  # initialiser module id -> (module, call, its names)
    covered: set[str] = set()
    for _, mod, adapter, owned, configs in _lora_initialisers(net):
        covered.update(owned)
        if chosen.intersection(owned):
            def call(mod=mod, adapter=adapter, configs=configs):
                mod.reset_lora_parameters(adapter, _lora_init(configs, adapter))
            jobs[id(mod), adapter] = (mod, call, chosen.intersection(owned))
    modules = dict(net.named_modules())
    for name in names:
        if name in covered:
            continue
        path = name.split(".")[:-1]
        for depth in range(len(path), -1, -1):  # the holder of the parameter first, then its ancestors
            mod = modules[".".join(path[:depth])]
            if callable(getattr(mod, "reset_parameters", None)):
                jobs.setdefault(id(mod), (mod, mod.reset_parameters, set()))[2].add(name)
                break
    order = {id(m): i for i, m in enumerate(net.modules())}
    done: set[str] = set()
    devices = sorted({t.device for t in net.parameters() if t.device.type != "cpu"}, key=str)
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(seed)
        names_of = {id(t): n for n, t in net.named_parameters()}
        for key in sorted(jobs, key=lambda k: (order[id(jobs[k][0])], str(k))):
            mod, call, mine = jobs[key]
            own = {id(t) for t in mod.parameters(recurse=False)}
            keep_params = [(t, t.clone()) for t in mod.parameters()
                           if names_of.get(id(t)) not in chosen and t.requires_grad]
            fresh_buffers = own and any(names_of.get(i) in chosen for i in own)
            keep_buffers = [(b, b.clone()) for b in mod.buffers()
                            if not (fresh_buffers and any(b is o for o in mod.buffers(recurse=False)))]
            # frozen parameters may be the wrapped model's own (an ensemble member shares its frozen base): the
            # initialiser writes into a stand-in copy (drawing the same random numbers), never into them
            frozen = [(sub, leaf, t) for sub in mod.modules() for leaf, t in sub._parameters.items()
                      if t is not None and not t.requires_grad]
            for sub, leaf, t in frozen:
                sub._parameters[leaf] = nn.Parameter(t.clone(), requires_grad=False)
            try:
                call()
            finally:
                for sub, leaf, t in frozen:
                    sub._parameters[leaf] = t
            for t, saved in keep_params + keep_buffers:
                t.copy_(saved)
            done |= mine
    return [n for n in names if n in done]
