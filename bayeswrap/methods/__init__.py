"""Inference methods and the registry from method name to class.

``bayeswrap.wrap(model, method, ...)`` looks the class up in :data:`METHODS`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from bayeswrap.methods.base import (
    METHODS,
    BayesianModel,
    LossOutput,
    NotFittedError,
    method_option_defaults,
    register_method,
)

# registration order = the order methods are listed in messages and docs
from bayeswrap.methods.map import MAP  # isort: skip
from bayeswrap.methods.vi import VI  # isort: skip
from bayeswrap.methods.ivon import IVON  # isort: skip
from bayeswrap.methods.mc_dropout import MCDropout  # isort: skip
from bayeswrap.methods.sgld import SGLD  # isort: skip
from bayeswrap.methods.swag import SWAG  # isort: skip
from bayeswrap.methods.laplace import Laplace  # isort: skip
from bayeswrap.methods.sparse_vd import KingmaVD, SparseVD  # isort: skip
from bayeswrap.methods.lbbnn import LBBNN  # isort: skip
from bayeswrap.methods.mcmc import HMC, MetropolisHastings  # isort: skip
from bayeswrap.methods.ensemble import Ensemble, MultiSWAG  # isort: skip

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


def method_options(method: str) -> tuple[str, ...]:
    """The method-specific keyword options of a registered method (e.g. ``init_std`` for ``"vi"``)."""
    return tuple(method_option_defaults(method))


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
        method: one of ``"map"``, ``"vi"``, ``"mc_dropout"``, ``"sgld"``, ``"swag"`` (Maddox et al. 2019;
            any optimizer), ``"laplace"``, ``"ivon"`` (Shen et al. 2024; train with ``bw.optim.IVON``), or the
            sparsifying variational-dropout methods ``"sparse_vd"`` (Molchanov et al. 2017) and
            ``"kingma_vd"`` (Kingma et al. 2015).
        num_data: N, the training-set size that scales the prior/KL term (integer ≥ 1).
        prior_std: prior σ in [1e-18, 1e18]; ``None`` (only with ``"map"``) for no prior.
        prior_mean: ``"init"``, ``"zero"`` or ``{name: tensor}``.
        bias: ``"informative"`` or ``"uninformative"`` (MC-dropout also
            ``"gaussian"``, ``"spikymix"``, ``"ignore"``).
        params: Bayesian parameters: ``None`` (all), a non-empty list of glob patterns, or a callable.
        likelihood: ``"categorical"``, ``"gaussian"`` (y ~ N(f(x), noise_std²)) or ``"heteroscedastic"``
            (the model returns (B, 2D): D means, then D log-variances; not with ``"laplace"``).
        noise_std: Gaussian likelihood noise std: a number, or ``"learn"`` for a learned point estimate
            (log σ, starting at σ = 1; ``bnn.noise_std`` reads and sets it) that ``bnn.parameters()`` exposes
            and the training loss learns jointly with the weights; Laplace learns it by marginal likelihood in
            ``optimize_prior_precision("marglik")``. Not with ensembles or the full-batch samplers.
        output_key: the key of the outputs of a model that returns a mapping or a Hugging Face
            ``ModelOutput`` (``"logits"``); a tuple output is read at its first element.
        label_key: the key of the targets in loaders that yield mappings (a Hugging Face data
            collator's ``"labels"``); the other keys are passed to the model as keyword inputs.
        **method_options_: ``kl_weight`` and ``chunk_size`` for every method, plus
            the method's own options (see :func:`method_options`):
            vi: ``init_std``, ``num_train_samples``; mc_dropout: ``p_drop``,
            ``num_train_samples``, ``mode`` (``"layers"``: the model's own dropout), ``layer_p``; sgld: ``burn_in``, ``thinning``; swag: ``swa_start``, ``collect_every``,
            ``max_rank``, ``scale``, ``covariance``, ``swa_lr``, ``bn_update_batches``; laplace:
            ``curvature``, ``curvature_chunk_size``; ivon: ``hess_init``; sparse_vd: ``init_log_var``;
            kingma_vd: ``init_log_alpha`` (``method_options(name)`` lists them all).

    Returns:
        The :class:`BayesianModel` of the chosen method.

    Raises:
        ValueError: for an unknown method or option, or any invalid value (the
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
    accepted = ("kl_weight", "chunk_size") + method_options(method)
    unknown = [k for k in method_options_ if k not in accepted]
    if unknown:
        raise ValueError(f"option(s) {unknown} are not accepted by method {method!r}; accepted: {accepted}")
    arguments = dict(num_data=num_data, prior_std=prior_std, prior_mean=prior_mean, bias=bias, params=params,
                     likelihood=likelihood, noise_std=noise_std, output_key=output_key, label_key=label_key,
                     **method_options_)
    bnn = METHODS[method](model, **arguments)
    bnn.wrap_arguments = {"method": method, **arguments}  # what bayeswrap.save stores to rebuild it
    return bnn


__all__ = ["METHODS", "BayesianModel", "LossOutput", "NotFittedError", "register_method", "wrap", "method_options",
           "method_option_defaults", "TUNING", "tuning_option", "tuning_bounds",
           *(cls.__name__ for cls in dict.fromkeys(METHODS.values()))]
