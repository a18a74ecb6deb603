"""Posterior predictives as objects: how S posterior outputs are made and averaged.

:meth:`BayesianModel.predict(x, S, predictive=p) <bayeswrap.methods.base.BayesianModel.predict>` validates its
arguments once and hands them to ``p``; without ``p`` the method's :meth:`default_predictive` chooses one (the old
keyword arguments such as ``model="mpm"`` or Laplace's ``pred_type``/``link_approx`` build one there). A predictive
holds no state of the model: the same object serves any model it applies to, and choosing one mutates nothing.

* :class:`Sampled`: S draws of the method's :meth:`_draw`, ``chunk_size`` at a time, each chunk one ``vmap``
  (BayesDLL eqs. 5 and 9): p(y | x, D) ≈ (1/S) Σ_s p(y | x, θ_s);
* :class:`PosteriorMean`: the outputs at the posterior mean, whatever S (BayesDLL's ``nst=0``);
* :class:`StoredDraws`: S kept draws (SGLD iterates, MCMC draws) spread evenly over the chain;
* :class:`Mixture`: an ensemble's members' predictives mixed, S split over the members;
* :class:`MedianModel`: the median probability model of a method with inclusion variables (Barbieri & Berger 2004);
* Laplace's linearised predictive is :class:`bayeswrap.methods.laplace.glm.GLM`.

Every ``outputs`` returns the model's outputs of shape (S, B, ...) (one row per draw); ``predict`` returns what
:meth:`BayesianModel.predict` returns (categorical: probabilities (B, K); Gaussian and heteroscedastic:
``(mean, variance)``, each (B, D)). Both are called with arguments the template methods already checked.
"""

from __future__ import annotations

import contextlib
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.func import vmap

from bayeswrap.core.batches import x_device
from bayeswrap.core.likelihoods import PROBABILITY_LIKELIHOODS

if TYPE_CHECKING:
    from bayeswrap.methods.base import BayesianModel

#: ``draw(bnn, num_samples, generator) -> {name: (S, *shape)}``
Draw = Callable[["BayesianModel", int, "torch.Generator | None"], dict]
#: ``forward(bnn, theta, x) -> outputs (B, ...)`` for one draw ``theta``
Forward = Callable[["BayesianModel", dict, object], torch.Tensor]
#: ``context(bnn, x, generator) -> context manager`` around the evaluation of all draws
Context = Callable[["BayesianModel", object, "torch.Generator | None"], contextlib.AbstractContextManager]


class Predictive(ABC):
    """A posterior predictive strategy: S outputs of a model, and their average under its likelihood."""

    @abstractmethod
    def outputs(self, bnn: BayesianModel, x, num_samples: int, generator: torch.Generator | None) -> torch.Tensor:
        """The model's outputs under S posterior draws.

        Args:
            bnn: the model (ready, see :meth:`~bayeswrap.BayesianModel.is_ready`).
            x: model input with batch size B (finite).
            num_samples: S ≥ 1.
            generator: optional ``torch.Generator`` for reproducible draws.

        Returns:
            Tensor of shape (S, B, K) (or (S, B, D) for regression).
        """

    def predict(self, bnn: BayesianModel, x, num_samples: int, generator: torch.Generator | None):
        """The likelihood's predictive over :meth:`outputs`; ``num_samples=0``: at the posterior mean.

        Returns:
            Categorical: probabilities (B, K). Gaussian and heteroscedastic: ``(mean, variance)``, each (B, D).
        """
        if num_samples == 0:
            return bnn._predictive(bnn._mean_outputs(x))
        return bnn._predictive(self.outputs(bnn, x, num_samples, generator))

    def is_sample_average(self, bnn: BayesianModel, num_samples: int) -> bool:
        """Whether :meth:`predict` is the likelihood's average of the per-sample outputs, for this model and S.

        True (the default) when ``predict(bnn, x, S, g)`` averages the likelihood over :meth:`outputs`
        ``(bnn, x, S, g)`` for the same generator state (S ≥ 1), or is the likelihood at ``bnn._mean_outputs(x)``
        (S = 0): then the per-sample probabilities of :func:`~bayeswrap.predictive.sample_probs_loader`, averaged
        over S, are the predictive, and :func:`~bayeswrap.predictive.predictive_loader` needs one pass. A predictive
        whose :meth:`predict` is computed otherwise (Laplace's probit link, a closed form; the median probability
        model at S = 0) returns False, and its predictive is computed by :meth:`predict` itself.

        Args:
            bnn: the model the predictive is used with.
            num_samples: S ≥ 0.
        """
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Sampled(Predictive):
    """S draws of the posterior, evaluated ``bnn.chunk_size`` at a time (one ``vmap`` per chunk).

    Draws come from ``draw`` (default: the method's :meth:`~bayeswrap.BayesianModel._draw`). Under local
    reparameterisation the pre-activation noise comes from the global RNG; with a ``generator`` it is seeded
    from it once per chunk (after the chunk's draws), so a seeded generator reproduces the outputs.

    The callables take the model first, so that one object serves every model (e.g. an unbound method of the
    method's class: ``Sampled(forward=SWAG._forward_bn)``).

    Args:
        draw: optional ``draw(bnn, num_samples, generator) -> {name: (S, *shape)}`` replacing the method's draws.
        forward: optional per-draw ``forward(bnn, theta, x) -> (B, ...)``: the draws are then evaluated one
            after another with it (SWAG's BatchNorm refresh, Maddox et al. 2019, §4) instead of under ``vmap``.
        context: optional ``context(bnn, x, generator) -> context manager`` entered once, before the first draw,
            around the evaluation of all draws (MC-dropout's layer mode: the dropout modules active and the
            global RNG seeded from ``generator``).
    """

    def __init__(self, draw: Draw | None = None, forward: Forward | None = None, context: Context | None = None):
        self.draw, self.forward, self.context = draw, forward, context

    def outputs(self, bnn, x, num_samples, generator):
        draw = self.draw or type(bnn)._draw
        with self.context(bnn, x, generator) if self.context is not None else contextlib.nullcontext():
            return chunked_outputs(bnn, x, num_samples, generator, draw, self.forward)

    def __repr__(self) -> str:
        given = [f"{k}={getattr(v, '__qualname__', v)!s}" for k, v in vars(self).items() if v is not None]
        return f"Sampled({', '.join(given)})"


class PosteriorMean(Predictive):
    """The outputs at the posterior mean (BayesDLL's ``nst=0``), (1, B, ...) whatever S (ensembles: (M, B, ...))."""

    def outputs(self, bnn, x, num_samples, generator):
        return bnn._mean_outputs(x)


class StoredDraws(Predictive):
    """S kept draws, chosen once and spread evenly over the chain, evaluated ``chunk_size`` at a time.

    S ≤ stored count takes evenly spaced draws (all of them for S = count), S > count cycles through them in
    chain order (:func:`bayeswrap.core.samples.spread_indices`); the draws are deterministic (the generator is
    unused), and only one chunk of them is on the model's device at once.

    Args:
        store: ``store(bnn)``: the model's store of kept draws, an object with ``indices(S)`` (int64 (S,)) and
            ``draws(indices, device, dtype) -> {name: (len(indices), *shape)}``
            (:class:`~bayeswrap.core.samples.SampleStore`); it raises ``NotFittedError`` when there is none.
        placement: optional ``placement(bnn) -> (device, dtype)`` the draws are evaluated at; default: those of
            the first tensor of ``bnn.posterior_mean()``.
    """

    def __init__(self, store: Callable, placement: Callable | None = None):
        self.store, self.placement = store, placement

    def outputs(self, bnn, x, num_samples, generator):
        store = self.store(bnn)
        if self.placement is not None:
            device, dtype = self.placement(bnn)
        else:
            first = next(iter(bnn.posterior_mean().values()))
            device, dtype = first.device, first.dtype
        indices = store.indices(num_samples)
        chunk = bnn.chunk_size
        return torch.cat([forward_many(bnn, store.draws(indices[i:i + chunk], device, dtype), x)
                          for i in range(0, num_samples, chunk)], 0)


class MedianModel(Predictive):
    """The median probability model (Barbieri & Berger 2004): the weights whose inclusion probability is > 0.5.

    For a method with inclusion variables (LBBNN): ``outputs`` samples it (``bnn._draw(S, generator, mpm=True)``:
    the Gaussian weights of the included ones), ``num_samples=0`` evaluates its mean ``bnn.mpm_mean()``.
    """

    def outputs(self, bnn, x, num_samples, generator):
        return chunked_outputs(bnn, x, num_samples, generator, _median_draw)

    def predict(self, bnn, x, num_samples, generator):
        if num_samples == 0:
            return bnn._predictive(bnn.forward_with(bnn.mpm_mean(), x).unsqueeze(0))
        return super().predict(bnn, x, num_samples, generator)

    def is_sample_average(self, bnn, num_samples):
        """False at S = 0 (the median model's mean, not the posterior mean); True for S ≥ 1."""
        return num_samples > 0


class Mixture(Predictive):
    """An ensemble's predictive: the members' predictives mixed, (1/S) Σ_m S_m p̂_m(y | x).

    S is split over the M members by ``bnn.draws_per_member``; each member uses its own default predictive
    (a MAP member its point prediction, once). ``num_samples=0`` mixes the members' posterior-mean predictions equally.
    """

    def outputs(self, bnn, x, num_samples, generator):
        return torch.cat([member.sample_logits(x, s, generator)
                          for member, s in zip(bnn.members, bnn.draws_per_member(num_samples)) if s])

    def predict(self, bnn, x, num_samples, generator):
        from bayeswrap.methods.map import MAP  # a point estimate: its S draws would all be θ*

        counts = bnn.draws_per_member(num_samples) if num_samples else [1] * len(bnn.members)
        total = float(sum(counts))
        preds, weights = [], []
        for member, s in zip(bnn.members, counts):
            if s:
                draws = 0 if (num_samples == 0 or type(member) is MAP) else s
                preds.append(member.predict(x, num_samples=draws, generator=generator))
                weights.append(s / total)
        return mixture(bnn.likelihood.name, preds, weights)

    def is_sample_average(self, bnn, num_samples):
        """True when every member's own predictive is its sample average (the mixture weights are the members'
        shares of S, as in :meth:`outputs`).
        """
        counts = bnn.draws_per_member(num_samples) if num_samples else [0] * len(bnn.members)
        return all(m.default_predictive().is_sample_average(m, s) for m, s in zip(bnn.members, counts))


def mixture(likelihood: str, preds: list, weights: list[float]):
    """Σ_m w_m p_m of members' predictives: probabilities (``likelihood="categorical"``), or the mixture's mean and
    variance Σ w (v + μ²) − (Σ w μ)² of their ``(mean, variance)`` pairs (Gaussian, heteroscedastic).
    """
    if likelihood in PROBABILITY_LIKELIHOODS:  # class or token probabilities
        return sum(w * p for w, p in zip(weights, preds))
    mean = sum(w * p[0] for w, p in zip(weights, preds))
    second = sum(w * (p[1] + p[0].pow(2)) for w, p in zip(weights, preds))
    return mean, (second - mean.pow(2)).clamp_min(0)


def _median_draw(bnn, num_samples: int, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    return bnn._draw(num_samples, generator, mpm=True)


def chunked_outputs(bnn: BayesianModel, x, num_samples: int, generator: torch.Generator | None, draw: Draw,
                    forward: Forward | None = None) -> torch.Tensor:
    """(S, B, ...) outputs of S draws made ``bnn.chunk_size`` at a time by ``draw``, see :class:`Sampled`."""
    outs = []
    for start in range(0, num_samples, bnn.chunk_size):
        thetas = draw(bnn, min(bnn.chunk_size, num_samples - start), generator)
        if forward is not None:
            count = next(iter(thetas.values())).shape[0]
            outs.extend(forward(bnn, {n: t[i] for n, t in thetas.items()}, x).unsqueeze(0) for i in range(count))
        elif bnn._lrt and generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
            with torch.random.fork_rng(devices=[] if x_device(x).type == "cpu" else [x_device(x)]):
                torch.manual_seed(seed)
                outs.append(forward_many(bnn, thetas, x))
        else:
            outs.append(forward_many(bnn, thetas, x))
    if forward is not None:
        bnn.likelihood.check_outputs(outs[0][0])
    return torch.cat(outs, 0)


def forward_many(bnn: BayesianModel, thetas: dict[str, torch.Tensor], x) -> torch.Tensor:
    """``bnn``'s outputs under each of the stacked samples ``thetas`` ({name: (S, *shape)}), (S, B, ...).

    One ``vmap`` over the samples where possible. If ``vmap`` fails, the samples
    are evaluated one at a time: if that fails too, the error is the model's
    own (e.g. an input of the wrong shape) and is raised as it is, with vmap
    left on; only if it succeeds is the model taken to lack a batching rule,
    and vmap is switched off for this model (with one warning).
    """
    count = next(iter(thetas.values())).shape[0]
    sequential = count == 1 or not bnn._vmap_ok or (bnn.training and len(bnn.model_buffers) > 0)
    vmap_error = None
    if not sequential:
        try:
            out = vmap(lambda th: bnn.forward_with(th, x), randomness="different")(thetas)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # maybe an op without a batching rule: decided below
            vmap_error = err
        else:
            bnn.likelihood.check_outputs(out[0] if isinstance(out, torch.Tensor) else out)
            return out
    outs = [bnn.forward_with({n: t[i] for n, t in thetas.items()}, x) for i in range(count)]
    bnn.likelihood.check_outputs(outs[0])
    out = torch.stack(outs)
    if vmap_error is not None:  # the samples run one at a time but not under vmap: a genuine vmap limitation
        bnn._vmap_ok = False
        warnings.warn(f"vmap over posterior samples failed ({type(vmap_error).__name__}: {vmap_error}); "
                      "this model's samples are evaluated one at a time from now on", RuntimeWarning,
                      stacklevel=5)
    return out


def given_predictive(predictive, model: str, options: dict) -> Predictive:
    """``predictive=`` of a template method, checked to be a :class:`Predictive` given without the legacy options.

    Raises:
        TypeError: if ``predictive`` is not a :class:`Predictive`.
        ValueError: if ``model`` (other than ``"full"``) or other options were given with it.
    """
    if not isinstance(predictive, Predictive):
        raise TypeError(f"predictive={predictive!r} is not accepted; accepted: a bayeswrap.methods.predictives."
                        "Predictive, e.g. Sampled() or PosteriorMean()")
    if model != "full" or options:
        given = {**({"model": model} if model != "full" else {}), **options}
        raise ValueError(f"predictive={predictive!r} and {given} were both given; accepted: one of them (the "
                         "options only choose the default predictive)")
    return predictive


def refuse_options(bnn: BayesianModel, options: dict, accepted: tuple[str, ...]) -> None:
    """For ``default_predictive``: a TypeError naming the predictive options (if any) that ``bnn``'s method does not
    take.

    Raises:
        TypeError: if ``options`` is not empty, naming them and listing ``accepted``.
    """
    if options:
        raise TypeError(f"predictive option(s) {sorted(options)} are not accepted by method {bnn.method!r}; "
                        f"accepted: {', '.join(accepted)} (or predictive=)")

