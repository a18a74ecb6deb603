"""The registry of inference methods, and everything derived from it.

A method is one class in one module of :mod:`bayeswrap.methods` (or of a subpackage of it), decorated with
:func:`register_method`. :func:`discover_methods` imports every module of the package, so that the decorators run;
no list of method modules is kept anywhere. Everything that lists methods reads :data:`METHODS`: :func:`wrap` and
its docstring, :func:`method_options`, ``bayeswrap.__all__``, the command line's flags and help
(:mod:`bayeswrap.app.options`), ``compare``'s tuning knobs (:data:`TUNING`), the README's method table
(:func:`method_table`) and the conformance tests.

:data:`METHODS` is ordered by each registration's ``order`` (then by registration), the order in which messages,
``--help``, the docs and the main job's table list the methods; a registration without ``order`` comes after all
ordered ones.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import math
import pkgutil
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from bayeswrap.methods.option_types import check_option_types

if TYPE_CHECKING:
    from bayeswrap.methods.base import BayesianModel

#: method name -> class, in listing order (see :func:`register_method`)
METHODS: dict[str, type[BayesianModel]] = {}

#: method name -> (order, registration number): the sort key of :data:`METHODS`
_ORDER: dict[str, tuple[float, int]] = {}
_REGISTRATIONS = itertools.count()
_UNORDERED = (math.inf, math.inf)
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def register_method(name: str, *, order: float | None = None):
    """Class decorator adding a method class to :data:`METHODS` under ``name``.

    Registering the class is the only step that adding a method takes: ``wrap``, ``bayeswrap.__all__``, the CLI
    flags, ``compare``'s tuning knob and the conformance tests follow from it.

    Args:
        name: the method's name in ``bw.wrap(model, name)`` and ``--method name``: lowercase letters, digits and
            ``_``, starting with a letter. Registering a name again replaces its class.
        order: where the method is listed (messages, ``--help``, the docs, the main job's table): the methods
            are sorted by it, ties and unordered ones (``None``, listed after every ordered one) by registration.
            The package's methods use 10, 20, ...; a new one picks a number between its neighbours.

    Returns:
        The decorator, which sets ``cls.method = name`` and returns the class unchanged.

    Raises:
        ValueError: if ``name`` is not such a string, or ``order`` is not a finite number or None.

    Example:
        >>> @register_method("my_method", order=55)
        ... class MyMethod(BayesianModel): ...
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"name={name!r} is not a method name; accepted: lowercase letters, digits and '_', "
                         f"starting with a letter (e.g. 'my_method')")
    if order is not None and (isinstance(order, bool) or not isinstance(order, (int, float))
                              or not math.isfinite(order)):
        raise ValueError(f"order={order!r} must be a finite number (e.g. 55, between the neighbours' 50 and 60) "
                         f"or None (listed last)")

    def deco(cls):
        cls.method = name
        _ORDER[name] = (_UNORDERED[0] if order is None else float(order), next(_REGISTRATIONS))
        METHODS[name] = cls
        ordered = sorted(METHODS.items(), key=lambda item: _ORDER.get(item[0], _UNORDERED))
        METHODS.clear()
        METHODS.update(ordered)
        _document_wrap()
        return cls

    return deco


def discover_methods(package: str = "bayeswrap.methods") -> None:
    """Imports every module of ``package`` and of its subpackages, in name order, so that each registers its classes.

    Modules that register nothing (``base``, ``persistence``, ``sparsity``, a method's helpers) are imported too;
    importing a module twice does nothing.

    Raises:
        ImportError: from a module that fails to import (never swallowed).
    """
    root = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(root.__path__), key=lambda m: m.name):
        name = f"{package}.{info.name}"
        importlib.import_module(name)
        if info.ispkg:
            discover_methods(name)


def method_option_defaults(method: str) -> dict:
    """``{option: library default}`` of a registered method's own keyword options (its constructors' along the MRO).

    Raises:
        KeyError: for an unregistered method.
    """
    from bayeswrap.methods.base import COMMON_OPTIONS, BayesianModel  # base imports this module

    defaults: dict = {}
    for klass in METHODS[method].__mro__:
        if klass is BayesianModel or "__init__" not in vars(klass):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY and p.name not in COMMON_OPTIONS and p.name not in defaults:
                defaults[p.name] = p.default
    return defaults


def method_options(method: str) -> tuple[str, ...]:
    """The method-specific keyword options of a registered method (e.g. ``init_std`` for ``"vi"``)."""
    return tuple(method_option_defaults(method))


class _TuningView(Mapping):
    """``{method: (option, grid)}`` read live from each registered class's ``tuning`` attribute."""

    def __getitem__(self, method: str) -> tuple[str, tuple[float, ...]]:
        knob = METHODS[method].tuning
        if knob is None:
            raise KeyError(method)
        return knob

    def __iter__(self) -> Iterator[str]:
        return (m for m, cls in METHODS.items() if cls.tuning is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


#: method -> (option, grid) that ``bayeswrap compare`` tunes by validation NLL (from the classes' ``tuning``)
TUNING: Mapping[str, tuple[str, tuple[float, ...]]] = _TuningView()


def tuning_option(method: str) -> tuple[str, tuple[float, ...]] | None:
    """``(option, grid)`` tuned for ``method`` (its class's ``tuning``), or None if it has no tuned option."""
    return METHODS[method].tuning


def tuning_bounds(method: str, option: str) -> tuple[float, float]:
    """``(low, high)`` that a tuning grid of ``option`` may be extended to for ``method``.

    Read from the class's ``tuning_bounds``; ``(0, inf)`` for an option it does not bound.
    """
    low, high = METHODS[method].tuning_bounds.get(option, (0.0, math.inf))
    return float(low), float(high)


def wrap(model, method: str, *, num_data: int, prior_std: float | None = 1.0, prior_mean="init",
         bias: str = "informative", params=None, likelihood: str = "categorical", noise_std: float | str = 1.0,
         output_key: str = "logits", label_key: str = "labels", **method_options_) -> BayesianModel:
    """Makes any ``nn.Module`` Bayesian in one line.

    ``bw.wrap(model, "vi", num_data=len(train_set), prior_std=1.0)`` puts the prior
    N(θ̄, prior_std² I) with θ̄ = the model's current (pretrained) weights on
    every trainable parameter and returns a :class:`BayesianModel` whose
    ``parameters()`` are what an optimizer should update. The model itself is
    never modified.

    Args:
        model: any ``torch.nn.Module``.
        method: the name of a registered method (:data:`METHODS`), one of:

            {methods}

        num_data: N, the training-set size that scales the prior/KL term (integer ≥ 1).
        prior_std: prior σ in [1e-18, 1e18]; ``None`` (only with ``"map"``) for no prior.
        prior_mean: ``"init"``, ``"zero"`` or ``{name: tensor}``.
        bias: ``"informative"`` or ``"uninformative"`` (MC-dropout also
            ``"gaussian"``, ``"spikymix"``, ``"ignore"``).
        params: Bayesian parameters: ``None`` (all), a non-empty list of glob patterns, or a callable.
        likelihood: ``"categorical"``, ``"gaussian"`` (y ~ N(f(x), noise_std²)) or ``"heteroscedastic"``
            (the model returns (B, 2D): D means, then D log-variances; not with ``"laplace"``), or for
            language models' (B, T, V) logits with (B, T) labels (-100 ignored) ``"causal_lm"`` (the causal
            shift) or ``"token_categorical"`` (no shift); for these, count ``num_data`` in target tokens
            (:func:`bayeswrap.core.token_likelihoods.count_target_tokens`).
        noise_std: Gaussian likelihood noise std: a number, or ``"learn"`` for a learned point estimate
            (log σ, starting at σ = 1; ``bnn.noise_std`` reads and sets it) that ``bnn.parameters()`` exposes
            and the training loss learns jointly with the weights; Laplace learns it by marginal likelihood in
            ``optimize_prior_precision("marglik")``. Not with ensembles or the full-batch samplers.
        output_key: the key of the outputs of a model that returns a mapping or a Hugging Face
            ``ModelOutput`` (``"logits"``); a tuple output is read at its first element.
        label_key: the key of the targets in loaders that yield mappings (a Hugging Face data
            collator's ``"labels"``); the other keys are passed to the model as keyword inputs.
        **method_options_: ``kl_weight``, ``chunk_size``, ``dict_inputs`` (how dict inputs reach the model:
            ``"auto"``, ``"kwargs"`` for ``model(**inputs)``, ``"positional"`` for ``model(inputs)``; see
            :mod:`bayeswrap.core.batches`) and ``output_reduction`` (``None``, or ``"pick_last"`` / ``"pick_first"``:
            (B, T, K) outputs read at each sequence's last / first non-padding token by the inputs'
            ``"attention_mask"``, a causal LM as a sequence classifier; :mod:`bayeswrap.core.reductions`) for every
            method, plus
            the method's own options (:func:`method_options`; the class's docstring describes them):

            {method_options}


    Returns:
        The :class:`BayesianModel` of the chosen method.

    Raises:
        ValueError: for an unknown method or option, a method option of the wrong kind for its constructor's
            annotation (:mod:`bayeswrap.methods.option_types`: e.g. ``flow_hidden=10`` for a tuple of widths,
            naming the method, the option, the value, its type and the accepted kind), or any invalid value (the
            message names the value and lists the accepted ones): integer options
            (``num_data``, ``chunk_size``, ``num_train_samples``, ``thinning``, ...)
            that are not integers in range (bools, NaN, inf, strings and
            non-integral floats are refused; numpy integers, 0-d integer tensors
            and integral floats such as 3.0 are accepted); scales (``prior_std``,
            ``init_std``, ``noise_std``, ``kl_weight`` > 0) outside [1e-18, 1e18],
            so that float32 holds σ², 1/σ² and log σ; ``noise_std="learn"`` with a likelihood other than
            ``"gaussian"`` or with an ensemble or sampler; ``likelihood="heteroscedastic"`` with Laplace; ``params=[]``; a model on the
            ``meta`` device, or with NaN/inf weights or ``prior_mean`` tensors.

    Example:
        >>> bnn = bw.wrap(timm.create_model("resnet18", num_classes=10), "vi", num_data=50_000)
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not known; accepted: {tuple(METHODS)}")
    accepted = ("kl_weight", "chunk_size", "dict_inputs", "output_reduction") + method_options(method)
    unknown = [k for k in method_options_ if k not in accepted]
    if unknown:
        raise ValueError(f"option(s) {unknown} are not accepted by method {method!r}; accepted: {accepted}")
    arguments = dict(num_data=num_data, prior_std=prior_std, prior_mean=prior_mean, bias=bias, params=params,
                     likelihood=likelihood, noise_std=noise_std, output_key=output_key, label_key=label_key,
                     **method_options_)
    check_option_types(METHODS[method], method_options_, build=lambda: METHODS[method](model, **arguments))
    bnn = METHODS[method](model, **arguments)
    bnn.wrap_arguments = {"method": method, **arguments}  # what bayeswrap.save stores to rebuild it
    return bnn


#: wrap's docstring as written, with the {methods} and {method_options} places that the registry fills
_WRAP_TEMPLATE = wrap.__doc__


def summary(cls: type) -> str:
    """The first paragraph of a class's docstring, on one line (what the method is, with its reference)."""
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _document_wrap() -> None:
    """Writes the registered methods and their options into :func:`wrap`'s docstring."""
    indent = "\n" + " " * 12
    methods = indent.join(f'* ``"{name}"`` (:class:`~bayeswrap.{cls.__name__}`): {summary(cls)}'
                          for name, cls in METHODS.items())
    options = indent.join(f"* {name}: " + (", ".join(f"``{o}``" for o in method_options(name)) or "none")
                          for name in METHODS)
    wrap.__doc__ = _WRAP_TEMPLATE.replace("{methods}", methods or "(none registered)").replace(
        "{method_options}", options or "(none registered)")


def _markdown(text: str) -> str:
    """The reStructuredText roles and literals of ``text`` as Markdown code spans (``:class:`~a.B``` -> ```B```)."""
    text = re.sub(r":\w+:`(~?)([^`]+)`", lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`",
                  text)
    return text.replace("``", "`").replace("|", "\\|")


def method_table() -> str:
    """The README's method table, rendered from :data:`METHODS` (a test checks that README.md holds it).

    One row per registered method, in listing order: its name, its class, what it is (the first paragraph of
    the class docstring) and its own options (:func:`method_options`). A subclass of a method listed before it
    that takes all of that method's options says so (``those of "laplace"``) and names only the others.
    """
    rows = ["| name | class | what it is | own options |", "| --- | --- | --- | --- |"]
    listed: dict[str, tuple[type, list[str]]] = {}
    for name, cls in METHODS.items():
        own = method_options(name)
        parent = next((p for p, (base, opts) in listed.items()
                       if opts and base in cls.__mro__[1:] and set(opts) <= set(own)), None)
        shown = [o for o in own if parent is None or o not in listed[parent][1]]
        options = ", ".join(f"`{o}`" for o in shown)
        if parent is not None:
            options = f'those of `"{parent}"`' + (f", {options}" if options else "")
        rows.append(f'| `"{name}"` | `{cls.__name__}` | {_markdown(summary(cls))} | {options or "the common ones only"} |')
        listed[name] = (cls, own)
    return "\n".join(rows) + "\n"
