"""The posterior predictive over whole data loaders, and its evaluation.

Per-batch prediction lives on the model (:meth:`BayesianModel.predict`, which
draws S samples and evaluates them with ``vmap``); this module runs it over a
loader and scores it.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch

from bayeswrap.core.batches import batch_pair, check_inputs_finite, class_labels, to_device
from bayeswrap.core.checks import check_int
from bayeswrap.core.likelihoods import at_least_float32
from bayeswrap.core.memory import check_budget, parse_budget, resolve_budget
from bayeswrap.core.token_likelihoods import TOKEN_LIKELIHOODS
from bayeswrap.evaluation import calibration, regression
from bayeswrap.evaluation.tokens import valid_tokens

if TYPE_CHECKING:  # a type only: any object with the BayesianModel.predict interface works
    from bayeswrap.methods.base import BayesianModel
    from bayeswrap.methods.predictives import Predictive


def _shared_draws(bnn):
    """The model's ``shared_draws()`` context where it has one (SWAG, ensembles: the draws of one evaluation and
    their BatchNorm statistics made once for all its batches), else a null context.
    """
    scope = getattr(bnn, "shared_draws", None)
    return scope() if callable(scope) else contextlib.nullcontext()


def model_device(bnn: BayesianModel) -> torch.device:
    """The device the Bayesian model's tensors live on."""
    for t in bnn.parameters():
        return t.device
    for t in bnn.buffers():
        return t.device
    return torch.device("cpu")


@torch.no_grad()
def predict_loader(bnn: BayesianModel, loader, num_samples: int = 5, *, generator: torch.Generator | None = None,
                   allow_point_estimate: bool = False, predictive: Predictive | None = None):
    """Posterior predictive for every example of a loader.

    Args:
        bnn: a Bayesian model (its train/eval mode is used as it is).
        loader: iterable of ``(inputs, targets)`` batches; inputs are a tensor, a tuple of
            tensors (``model(x1, x2)``) or a dict of named tensors, nested structures
            included, moved to bnn's device (:func:`bayeswrap.core.batches.to_device`).
        num_samples: S (0 = posterior mean), see :meth:`BayesianModel.predict`.
        generator: optional ``torch.Generator``.
        allow_point_estimate: if the posterior does not exist yet (Laplace before
            its curvature, SGLD before its first kept sample), predict with the
            current training iterate instead of raising. Used for validation
            during training.
        predictive: optional :class:`~bayeswrap.methods.predictives.Predictive` handed to every
            :meth:`BayesianModel.predict` call (default: the model's :meth:`~BayesianModel.default_predictive`).

    Returns:
        ``(predictive, targets)``: for a categorical likelihood ``probs`` (N, K)
        float32 and labels (N,) int64 (labels of a narrower integer dtype are cast);
        for a Gaussian one ``(mean, var)`` each (N, D) and targets (N, D); for a token likelihood
        (``"causal_lm"``, ``"token_categorical"``) the target tokens of every sequence as rows
        (:func:`bayeswrap.evaluation.tokens.valid_tokens`: labels other than -100, after the causal shift),
        ``probs`` (N, V) and token ids (N,) int64, N the number of target tokens. All on the CPU.

    Raises:
        ValueError: if ``num_samples`` is not an integer >= 0, the loader yields
            no batches or something other than ``(inputs, targets)`` pairs (or targets
            that are not a tensor), or as :meth:`BayesianModel.predict` (non-finite
            inputs, mis-shaped outputs).
        NotFittedError: if the posterior does not exist yet and ``allow_point_estimate`` is False.
    """
    num_samples = check_int("num_samples", num_samples, minimum=0)
    device = model_device(bnn)
    chosen = {} if predictive is None else {"predictive": predictive}
    preds, targets = [], []
    with _shared_draws(bnn):
        for index, batch in enumerate(loader):
            x, y = batch_pair(batch, f"the loader's batch {index}", bnn.label_key)
            x = to_device(x, device)
            if bnn.is_ready() or not allow_point_estimate:
                p = bnn.predict(x, num_samples=num_samples, generator=generator, **chosen)
            else:
                check_inputs_finite(x)
                p = bnn._point_predictive(x)
            if bnn.likelihood.name in TOKEN_LIKELIHOODS:  # (B, T, V) → the (n, V) rows of the target tokens
                p, y = valid_tokens(p, _checked_tensor(y), shift=bnn.likelihood.name == "causal_lm")
            preds.append(tuple(t.cpu() for t in p) if isinstance(p, tuple) else p.cpu())
            targets.append(_targets_on_cpu(bnn, y))
    if not preds:
        raise ValueError("the loader yielded no batches")
    y = torch.cat(targets)
    if isinstance(preds[0], tuple):
        return (torch.cat([p[0] for p in preds]), torch.cat([p[1] for p in preds])), y
    return torch.cat(preds), y


@torch.no_grad()
def sample_probs_loader(bnn: BayesianModel, loader, num_samples: int = 5, *,
                        generator: torch.Generator | None = None,
                        memory_budget: int | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Class probabilities under each posterior sample, for every example of a loader.

    The per-sample view behind the uncertainty measures of
    :mod:`bayeswrap.evaluation.uncertainty` (mutual information, variation
    ratio, ...). Averaging over the first dimension gives exactly what
    :func:`predict_loader` returns for the same ``generator`` state.

    Args:
        bnn: a Bayesian model with a categorical likelihood (its train/eval mode is used as it is).
        loader: iterable of ``(inputs, targets)`` batches, inputs as in :func:`predict_loader`.
        num_samples: S ≥ 0; ``0`` evaluates the posterior mean once (an ensemble: each member's mean).
        generator: optional ``torch.Generator`` for reproducible samples.
        memory_budget: bytes of CPU memory the (S, N, K) probabilities may take (kept per batch, then
            concatenated: twice their size at the peak); ``None``: the CPU's free memory; or a string such as
            ``"2GiB"`` (:func:`bayeswrap.core.memory.parse_budget`). Checked after the first batch, from
            ``len(loader.dataset)`` where the loader has a sized dataset, else before each batch is kept.

    Returns:
        ``(sample_probs, targets)``: ``sample_probs`` of shape (max(S, 1), N, K) (S = 0 for an
        ensemble of M members: (M, N, K)),
        float32 (float64 for a float64 model), each row summing to 1; ``targets``
        (N,) int64. Both on the CPU.

    Raises:
        ValueError: for a Gaussian likelihood, ``num_samples`` not an integer >= 0, a
            loader that yields no batches or something other than ``(inputs, targets)``
            pairs (or targets that are not a tensor), non-finite inputs, or outputs that
            are not (B, K) logits.
        NotFittedError: if the posterior does not exist yet.
        MemoryBudgetError: (a ``MemoryError``) if the (S, N, K) probabilities are estimated above
            ``memory_budget`` (naming the estimate, the budget and the largest S that fits), before more than one
            batch is evaluated where N is known.
    """
    if bnn.likelihood.name != "categorical":
        raise ValueError(f"sample_probs_loader needs a categorical likelihood; this model's is "
                         f"{bnn.likelihood.name!r}")
    num_samples = check_int("num_samples", num_samples, minimum=0)
    budget = resolve_budget(parse_budget(memory_budget), "cpu")
    total = _dataset_size(loader)
    device = model_device(bnn)
    probs, targets = [], []
    kept = 0
    with _shared_draws(bnn):
        for index, batch in enumerate(loader):
            x, y = batch_pair(batch, f"the loader's batch {index}", bnn.label_key)
            x = to_device(x, device)
            if num_samples == 0:
                bnn._check_ready()
                check_inputs_finite(x)
                outs = bnn._mean_outputs(x)
            else:
                outs = bnn.sample_logits(x, num_samples, generator=generator)
            bnn.likelihood.check_outputs(outs[0])
            p = at_least_float32(outs).softmax(-1).cpu()
            kept += p.nbytes
            _check_kept_probs(p, kept if total is None else p.nbytes * total / p.shape[1], budget, num_samples)
            probs.append(p)
            targets.append(_targets_on_cpu(bnn, y))
    if not probs:
        raise ValueError("the loader yielded no batches")
    return torch.cat(probs, 1), torch.cat(targets)


@torch.no_grad()
def predictive_loader(bnn: BayesianModel, loader, num_samples: int = 5, *, generator: torch.Generator | None = None,
                      samples: bool = True, memory_budget: int | str | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The model's posterior predictive for every example of a loader, and the per-sample probabilities.

    The predictive is what :meth:`BayesianModel.predict` computes with the model's
    :meth:`~BayesianModel.default_predictive` (Laplace: the GLM predictive with its ``link_approx``, probit by
    default); the per-sample probabilities are what the sample-based measures (mutual information, variation
    ratio) need. When the predictive is the average of its samples' probabilities
    (:meth:`~bayeswrap.methods.predictives.Predictive.is_sample_average`: sampled weights, stored draws,
    ensembles, the GLM's Monte Carlo link) one pass of :func:`sample_probs_loader` gives both, the predictive
    being its float64 mean over S, with the same ``generator`` use. Otherwise (Laplace's probit link) the
    predictive comes from :func:`predict_loader`, and the samples, when asked for and S ≥ 2, from a second pass
    of :func:`sample_probs_loader` with the same ``generator`` (the probit link draws nothing).

    Args:
        bnn: a Bayesian model with a categorical likelihood (its train/eval mode is used as it is).
        loader: iterable of ``(inputs, targets)`` batches, inputs as in :func:`predict_loader`.
        num_samples: S ≥ 0 (0: the posterior mean).
        generator: optional ``torch.Generator`` for reproducible samples.
        samples: whether the per-sample probabilities are wanted (False: returned as None, and a predictive
            that is not their average makes no second pass).
        memory_budget: the per-sample probabilities' budget, as in :func:`sample_probs_loader`.

    Returns:
        ``(probs, sample_probs, targets)``: the predictive (N, K) float64; the per-sample probabilities
        (max(S, 1), N, K) as :func:`sample_probs_loader` returns them, or None (``samples=False``, or a predictive
        that is not their average at S < 2, where no sample-based measure exists); labels (N,) int64. All on
        the CPU.

    Raises:
        ValueError: as :func:`sample_probs_loader` and :func:`predict_loader`.
        NotFittedError: if the posterior does not exist yet.
        MemoryBudgetError: as :func:`sample_probs_loader`.
    """
    if bnn.likelihood.name != "categorical":
        raise ValueError(f"predictive_loader needs a categorical likelihood; this model's is "
                         f"{bnn.likelihood.name!r}")
    num_samples = check_int("num_samples", num_samples, minimum=0)
    bnn._check_ready()
    if bnn.default_predictive().is_sample_average(bnn, num_samples):
        sample_probs, targets = sample_probs_loader(bnn, loader, num_samples, generator=generator,
                                                    memory_budget=memory_budget)
        return sample_probs.double().mean(0), sample_probs if samples else None, targets
    probs, targets = predict_loader(bnn, loader, num_samples, generator=generator)
    sample_probs = None
    if samples and num_samples >= 2:
        sample_probs = sample_probs_loader(bnn, loader, num_samples, generator=generator,
                                           memory_budget=memory_budget)[0]
    return probs.double(), sample_probs, targets


def _dataset_size(loader) -> int | None:
    """N, the number of examples of a loader with a sized dataset (a ``DataLoader``), else None."""
    dataset = getattr(loader, "dataset", None)
    try:
        return len(dataset) if dataset is not None else None
    except TypeError:  # an iterable dataset
        return None


def _check_kept_probs(batch_probs: torch.Tensor, kept: float, budget: float, num_samples: int) -> None:
    """Refuses per-sample probabilities whose (S, N, K) total ``kept`` (bytes) and their concatenation exceed the
    budget, naming the largest S that fits.
    """
    per_sample = kept / max(1, batch_probs.shape[0])
    fits = int(budget // (2 * per_sample)) if per_sample else 0
    check_budget(f"the per-sample probabilities {tuple(batch_probs.shape[:1])} × N × K (kept, then concatenated)",
                 int(2 * kept), budget, {f"num_samples={fits}": int(2 * per_sample * fits)} if fits >= 1 else {})


def _checked_tensor(y) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"the loader's targets are a {type(y).__name__}; accepted: a tensor of class labels (B,), "
                         "token labels (B, T) or regression targets (B, D)")
    return y


def _targets_on_cpu(bnn: BayesianModel, y) -> torch.Tensor:
    """One batch's targets on the CPU; class labels of any integer dtype as int64."""
    y = _checked_tensor(y).cpu()
    return class_labels(y) if bnn.likelihood.name == "categorical" else y


def score(bnn: BayesianModel, predictive, targets: torch.Tensor) -> dict[str, float]:
    """NLL and error (classification), or NLL, RMSE, CRPS and interval metrics (regression) of a predictive.

    Args:
        bnn: the model (for its likelihood).
        predictive: output of :func:`predict_loader`.
        targets: the matching targets.

    Returns:
        ``{"nll": ..., "error": ...}`` for classification (and per target token for a token likelihood,
        whose :func:`predict_loader` rows are tokens), with NLL the mean
        −log p(y|x) (probabilities clamped at 1e-12); for regression
        ``{"nll", "rmse", "crps", "coverage_50", "width_50", "coverage_90", ...}``, with NLL the
        Gaussian predictive NLL summed over output dims and averaged over examples, and the
        CRPS (closed form) and the coverage and mean width of the central 50/90/95% intervals of
        the Gaussian N(mean, var) (:func:`bayeswrap.evaluation.regression.regression_report`;
        for a sampled predictive that is the moment-matched Gaussian of the mixture, as for the NLL).
    """
    if bnn.likelihood.name == "categorical" or bnn.likelihood.name in TOKEN_LIKELIHOODS:
        return {"nll": calibration.nll(predictive, targets), "error": 1.0 - calibration.accuracy(predictive, targets)}
    mean, var = predictive
    nll = 0.5 * ((targets - mean).pow(2) / var + var.log() + math.log(2 * math.pi))
    return {"nll": float(nll.reshape(len(nll), -1).sum(1).mean()),
            "rmse": float((targets - mean).pow(2).mean().sqrt()),
            **regression.regression_report(mean, var, targets)}


def evaluate(bnn: BayesianModel, loader, num_samples: int = 5, **kwargs) -> dict[str, float]:
    """:func:`score` of :func:`predict_loader` in one call (keyword arguments go to the latter).

    Raises:
        ValueError: as :func:`predict_loader`.
        NotFittedError: as :func:`predict_loader`.
    """
    pred, y = predict_loader(bnn, loader, num_samples, **kwargs)
    return score(bnn, pred, y)
