"""Compiled training steps: ``bw.fit(bnn, ..., compile=True)`` and ``BayesianModule(..., compile=True)``.

**What is compiled.** A method's training loss, ``bnn.loss(x, y)``: the training draw (VI's θ = m + s ⊙ ε,
MC-dropout's masks, IVON's perturbation), the functional call of the network on the storage-free copy, the
likelihood and the KL/prior term, captured by ``torch.compile`` as one graph (``fullgraph=True`` by default: a
graph break is an error, not a silent slow path). AOTAutograd compiles the backward with it, so
``loss.backward()`` runs a compiled backward. The optimizer step, gradient clipping and scaling, the data-parallel
gradient average and the method's ``after_step`` stay eager.

**A graph-friendly loss.** The fused kernels of :mod:`bayeswrap.core.fused` are ``torch.autograd.Function`` s whose
backward reads the incoming gradient as a Python number (a graph break); while ``torch.compile`` traces,
:func:`bayeswrap.core.fused.available` is False and every method takes its reference expressions (``fused=False``),
which inductor fuses into a few kernels itself. The training draws are one ``normal_``/``uniform_`` call over all
the parameters, split per tensor: eager's stream for models under
:data:`bayeswrap.core.fused.RNG_PARALLEL_MIN` elements on the CPU. With inductor (unless a ``mode`` is given, which
torch.compile does not combine with ``options``) bayeswrap sets inductor's ``fallback_random`` option, so that the
compiled graph calls the same random kernels as eager: a compiled fit makes eager's draws exactly, and on the CPU
it is faster than inductor's in-kernel Philox numbers (ResNet-50 VI, 1 thread: compiled / eager step 0.91 with it,
1.19 without). ``{"options": {"fallback_random": False}}`` gives inductor's own numbers (the same distribution,
other draws).

**Steps that run eagerly.** The first step of each fit, which checks the data with eager's messages (a bad label
is named, not an index assertion of a generated kernel) and settles lazy state (an ensemble's choice of vmap);
and, with ``dynamic=None`` (the default), every batch whose tensors' shapes or dtypes differ from those the step
was compiled for, typically an epoch's last, smaller batch, so that an epoch compiles once (a warning says when
batches of several other shapes ran eagerly: pass ``{"dynamic": True}`` for inputs of varying shapes, e.g.
variable-length sequences, one graph with a symbolic batch and length). fit's history counts the epoch's
``compiled_steps``.

**Recompilations.** A KL schedule changes ``kl_weight``, a Python float that dynamo specialises on first and
then makes a symbolic input (one recompilation); the train/eval mode, autocast and the grad mode are guarded.
Every :class:`CompiledLoss` compiles its own copy of the traced function (its own dynamo cache), so that the
models of many methods compiled in one process (``bayeswrap compare``) do not share the
``torch._dynamo.config.recompile_limit`` entries of one function, and a fit's graphs are freed with it.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Mapping

import torch

from bayeswrap.core.batches import class_labels, tensor_leaves
from bayeswrap.methods.base import BayesianModel, LossOutput

#: the keys of a ``compile`` mapping: the keyword arguments of ``torch.compile`` it accepts
COMPILE_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")
#: ``torch.compile``'s modes
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_options(value) -> dict | None:
    """``fit``'s ``compile`` argument as ``torch.compile`` keyword arguments, or None (not compiled).

    Args:
        value: ``False``/``None`` (eager), ``True`` (``{"fullgraph": True}``: inductor, the default mode, with
            its ``fallback_random`` option unless ``options`` says otherwise; see the module docstring) or a
            mapping with keys among :data:`COMPILE_KEYS`: ``backend`` (a registered backend's name, e.g.
            ``"inductor"``, ``"aot_eager"``, or a callable), ``mode`` (one of :data:`COMPILE_MODES` or None),
            ``fullgraph`` (bool, default True), ``dynamic`` (None, True or False; see the module docstring),
            ``options`` (a mapping of backend options; not with ``mode``).

    Returns:
        The keyword arguments (``fullgraph`` filled in), or None.

    Raises:
        ValueError: for any other value, an unknown key or a bad value of a key, naming it and the accepted ones.
    """
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"compile={value!r} is not accepted; accepted: False, True, or a mapping of torch.compile "
                         f"keyword arguments with keys among {COMPILE_KEYS} (e.g. {{'backend': 'aot_eager'}})")
    unknown = [k for k in value if k not in COMPILE_KEYS]
    if unknown:
        raise ValueError(f"compile has the key(s) {unknown}, which are not accepted; accepted keys: {COMPILE_KEYS}")
    options = {"fullgraph": True, **value}
    backend = options.get("backend", "inductor")
    if not callable(backend):
        known = torch._dynamo.list_backends(exclude_tags=())
        if not isinstance(backend, str) or backend not in known:
            raise ValueError(f"compile backend={backend!r} is not accepted; accepted: a callable or one of "
                             f"torch.compile's backends {known}")
    mode = options.get("mode")
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"compile mode={mode!r} is not accepted; accepted: None or one of {COMPILE_MODES}")
    for key, accepted in (("fullgraph", (True, False)), ("dynamic", (None, True, False))):
        if not any(options.get(key) is a for a in accepted):
            raise ValueError(f"compile {key}={options.get(key)!r} is not accepted; accepted: "
                             f"{' or '.join(map(repr, accepted))}")
    extra = options.get("options")
    if extra is not None and not (isinstance(extra, Mapping) and all(isinstance(k, str) for k in extra)):
        raise ValueError(f"compile options={extra!r} is not accepted; accepted: None or a mapping of backend "
                         "options, e.g. {'max_autotune': True}")
    if extra is not None and mode is not None:
        raise ValueError(f"compile mode={mode!r} and options are both given; accepted: one of them (torch.compile "
                         "takes either)")
    if options.get("backend", "inductor") == "inductor" and mode is None:  # eager's random numbers (see above)
        options["options"] = {"fallback_random": True, **(extra or {})}
    return options


def _traced_loss(bnn: BayesianModel, x, y) -> LossOutput:
    """What is compiled: the method's loss without its data checks."""
    return bnn._unchecked_loss(x, y)


def _signature(x, y) -> tuple:
    """The shapes, dtypes and devices of a batch's tensors (what a static graph is specialised to)."""
    leaves = [t for _, t in tensor_leaves(x)] + ([y] if isinstance(y, torch.Tensor) else [])
    return tuple((tuple(t.shape), t.dtype, t.device) for t in leaves)


class CompiledLoss:
    """``bnn.loss(x, y)`` computed by a compiled graph: the same :class:`LossOutput` (to float rounding), with
    loss's checks around it. See the module docstring for what runs compiled and what eagerly.

    Args:
        bnn: the model whose loss is compiled (the object itself: its parameters are the graph's inputs).
        options: ``fit``'s ``compile`` argument (True or a mapping, :func:`compile_options`).

    Attributes:
        compiled_steps: calls computed by the compiled graph so far.
        eager_steps: calls computed eagerly (the first one, batches of other shapes).

    Raises:
        ValueError: for bad ``options`` (:func:`compile_options`).
    """

    def __init__(self, bnn: BayesianModel, options=True):
        self.bnn = bnn
        self.options = compile_options(options)
        if self.options is None:
            raise ValueError(f"compile={options!r}: CompiledLoss needs True or a mapping of torch.compile options")
        self.dynamic = self.options.get("dynamic")
        # a function object of its own with a code object of its own: dynamo keeps its cache on the code object
        fn = types.FunctionType(_traced_loss.__code__.replace(), _traced_loss.__globals__, "compiled_loss")
        self._compiled = torch.compile(fn, **self.options)
        self._signature: tuple | None = None
        self._other_shapes: set[tuple] = set()
        self._warned = False
        self.compiled_steps = 0
        self.eager_steps = 0

    def __call__(self, x, y) -> LossOutput:
        bnn = self.bnn
        if self.compiled_steps == 0 and self.eager_steps == 0:  # the first step: eager checks and lazy state
            return self._eager(x, y)
        if self.dynamic is None:
            signature = _signature(x, y)
            if self._signature is None:
                self._signature = signature
            elif signature != self._signature:
                self._note_other_shape(signature)
                return self._eager(x, y)
        labels = class_labels(y) if bnn.likelihood.name == "categorical" else y
        try:
            out = self._compiled(bnn, x, labels)
        except Exception as err:
            if isinstance(err, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):  # a graph break
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise RuntimeError(
                    f"compile: torch.compile could not capture the training loss of this {bnn.method!r} model in "
                    f"one graph ({first}); accepted: compile={{'fullgraph': False}} (the loss compiled in parts "
                    "between graph breaks) or compile=False") from err
            bnn.loss(x, y)  # eagerly: its error names a bad input or target (raised here, chained to err)
            raise
        self.compiled_steps += 1
        bnn.likelihood.check_targets(out.logits, labels)
        return bnn._checked_loss(out, x, labels)

    def _eager(self, x, y) -> LossOutput:
        self.eager_steps += 1
        return self.bnn.loss(x, y)

    def _note_other_shape(self, signature: tuple) -> None:
        """Warns once when batches of two or more shapes other than the compiled one ran eagerly."""
        self._other_shapes.add(signature)
        if len(self._other_shapes) >= 2 and not self._warned:
            self._warned = True
            shapes = [[s[0] for s in sig] for sig in [self._signature, *sorted(self._other_shapes, key=str)[:3]]]
            warnings.warn(f"compile: batches of {len(self._other_shapes)} shapes other than the compiled one run "
                          f"eagerly (shapes {shapes}); for inputs of varying shapes pass compile={{'dynamic': True}} "
                          "(one graph with symbolic sizes)", RuntimeWarning, stacklevel=3)
