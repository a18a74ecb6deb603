"""TFB: Training-Free Bayesianization of a trained LoRA by a post hoc search of its posterior variance.

Shi, Wang, Han, Zhang & Wang 2024, "Training-Free Bayesianization for Low-Rank Adapters of Large Language
Models" (arXiv:2412.05723; the structure and the search as in the authors' code, Wang-ML-Lab/bayesian-peft,
``modelwrappers/tfblora.py`` and ``tfblora_acc.py``, which were read for this module). A LoRA layer adds ΔW = B A (B: out × r, A: r × in) to a frozen
weight. TFB keeps B a point estimate and puts a Gaussian on A whose spread is fixed by one scalar σ. With the
thin SVD B = U diag(d) Vᵀ, TFB rewrites the pair as B' = U diag(d), A' = Vᵀ A (B'A' = BA) and takes
A'_ij ~ N(A'_ij, σ² / d_i²). Then B'A'_s = BA + σ U E with E_ij ~ N(0, 1): the update's noise is the
*low-rank isotropic* Gaussian vec(ΔW) ~ N(vec(BA), σ² I_in ⊗ U Uᵀ), isotropic inside B's column space.

bayeswrap keeps the user's (B, A) as they are and draws the same distribution of BA on the original A:
A_s = A + σ V diag(1/d) E, whose image under B is exactly BA + σ U E (B V diag(1/d) = U). The posterior mean is the
trained A, so ``predict(x, num_samples=0)`` and σ → 0 are the MAP LoRA. The marginal std of A_ij is
σ (Σ_k V_ik² / d_k²)^½ (:meth:`TFB.posterior_std`); the draws (:meth:`TFB._draw`) carry the correlation across
the rank. A direction with d_k ≤ 1e-6 · max(d) (B rank-deficient, e.g. an adapter that was never trained: peft
initialises B = 0) gets no noise: B maps it to zero, so it changes nothing in BA. B is read when a draw is made,
so a LoRA trained further (or loaded) is always drawn with its current SVD.

σ is found without training: on an *anchor* set (the training loader that :func:`bayeswrap.fit`
hands :meth:`TFB.after_fit`, its first ``anchor_batches`` batches), the largest σ in ``sigma_range`` whose
predictive stays within a tolerance ε of the point estimate's,

    metric="nll":       NLL(σ) − NLL(0) ≤ ε · |NLL(0)|      (a relative increase, as the authors' code),
    metric="accuracy":  acc(0) − acc(σ) ≤ ε                  (a drop in accuracy, a fraction),

with NLL(σ) and acc(σ) those of the S-sample predictive (S = ``search_samples``) on the anchor's labels
(``labels="data"``) or on the trained LoRA's predicted classes (``labels="predicted"``, the authors' code: an
anchor set needs no labels; its accuracy is then the share of predictions that the noise leaves unchanged), every σ
scored with the same noise (a generator re-seeded with ``search_seed``), so that the metric is a deterministic
function of σ. The search evaluates both ends of the range, then halves it ``search_steps`` times at the geometric
midpoint √(lo · hi) (the range spans decades; the authors' code halves arithmetically) and keeps lo, the largest σ
seen within tolerance (their code keeps the last σ found outside it). Their code also divides the relative NLL
change by the anchor size, which this module does not, and draws its noise with flipout per example, where a
draw here is one A for the whole batch (the same distribution). The paper relates the chosen σ to a
KL-regularised variational problem. Under data-parallel training the anchor metric is summed over the ranks, so every rank chooses the same σ.

A model without LoRA factors (or a Bayesian parameter that is not a LoRA A) is TFB's degenerate full-rank case
B = I: the isotropic Gaussian N(θ, σ² I) around the trained weights, with σ found by the same search. LoRA's B
factors are never Bayesian here: ``params="adapters"`` (A and B) is refused; use ``params="adapters_A"``.

Training before the search is MAP's (the Bayesian parameters a point estimate under the Gaussian prior term),
so TFB also serves a LoRA trained elsewhere: wrap it, then call :meth:`TFB.search_sigma` (or give ``sigma``).
"""

from __future__ import annotations

import itertools
import math
import warnings

import torch

from bayeswrap.core import distributed
from bayeswrap.core.batches import check_reiterable
from bayeswrap.core.checks import check_choice, check_float, check_int
from bayeswrap.core.functional import outside_inference_mode
from bayeswrap.core.likelihoods import PROBABILITY_LIKELIHOODS
from bayeswrap.core.token_likelihoods import target_count
from bayeswrap.methods.base import register_method
from bayeswrap.methods.map import MAP
from bayeswrap.predictive import model_device, predict_loader, score

#: accepted values of ``metric``
METRICS = ("nll", "accuracy")
#: accepted values of ``labels``: the anchor's targets, or the trained LoRA's predicted classes
LABELS = ("data", "predicted")
#: LoRA's A factor and its B partner, as peft names them (``...lora_A.<adapter>.weight``, ``...lora_embedding_A.<adapter>``)
LORA_PAIRS = {"lora_A": "lora_B", "lora_embedding_A": "lora_embedding_B"}
#: singular values of B at most this fraction of the largest get no noise (directions B maps to zero)
RANK_TOL = 1e-6


@register_method("tfb", order=77)
class TFB(MAP):
    """Training-free Bayesianization of a trained LoRA (Shi et al. 2024): σ of a Gaussian on A searched post hoc.

    The scale σ is the largest that keeps the anchor set's NLL (or accuracy) within ε of the trained LoRA's.

    Takes the arguments of :class:`~bayeswrap.BayesianModel` plus:

    Args:
        epsilon: the tolerance ε > 0: with ``metric="nll"`` the relative increase of the anchor NLL
            (0.01: 1 %), with ``metric="accuracy"`` the drop in anchor accuracy (a fraction).
        metric: ``"nll"`` or ``"accuracy"`` (a categorical or token likelihood only), the anchor performance
            the search holds.
        labels: ``"data"`` (the anchor loader's targets) or ``"predicted"`` (the trained LoRA's predicted
            classes, as the authors' code; a categorical or token likelihood only).
        sigma: a fixed σ ≥ 0 (no search; the authors' ``iter=0``), or None: :meth:`after_fit` searches it.
        sigma_range: ``(low, high)``, 0 < low < high, the bracket of the search (default (1e-4, 1.0)).
        search_steps: halvings of the bracket after its ends are scored (integer ≥ 1; the ratio high/low
            shrinks to (high/low)^(1/2^steps), 10 steps: 0.9 % over four decades).
        search_samples: S ≥ 1, posterior draws per anchor prediction in the search.
        anchor_batches: the number of the loader's first batches the search scores (integer ≥ 1), or None:
            all of them.
        search_seed: seed of the generator re-seeded for every σ scored (integer).

    Raises:
        ValueError: on an ``epsilon`` that is not a number in (0, 1e6], an unknown ``metric`` or ``labels``,
            ``metric="accuracy"`` or ``labels="predicted"`` with a Gaussian likelihood, a ``sigma`` < 0 or not finite, a ``sigma_range`` that is not
            two numbers with 0 < low < high < inf, ``search_steps``/``search_samples``/``anchor_batches`` not
            an integer ≥ 1, a Bayesian LoRA B factor (``params="adapters"``), a LoRA A whose B partner is
            missing or of another rank; as :class:`~bayeswrap.BayesianModel` otherwise.

    Attributes:
        theta: the Bayesian parameters (the posterior mean: the trained values).
        sigma: σ now (a float; 0 before the search).
        search_record: after :meth:`search_sigma`, ``{"sigma": [...], "metric": [...], "baseline": v,
            "chosen": σ, "within": [...], "bound_hit": "low"/"high"/None}``: every σ scored in order, its
            anchor metric (NLL or accuracy), the point estimate's, the σ chosen, and whether the range's low
            end was outside tolerance or its high end inside it (then σ is that end and a warning says so).
    """

    tuning = ("epsilon", (0.003, 0.01, 0.03, 0.1, 0.3))  # the tolerance sets the posterior's spread
    tuning_bounds = {**MAP.tuning_bounds, "epsilon": (1e-4, 1.0)}
    reads_train_loader_after_fit = True  # the search scores the anchor (training) loader once per σ
    in_default_comparison = False

    def __init__(self, model, *, epsilon: float = 0.01, metric: str = "nll", labels: str = "data",
                 sigma: float | None = None, sigma_range: tuple[float, float] = (1e-4, 1.0), search_steps: int = 10,
                 search_samples: int = 10, anchor_batches: int | None = None, search_seed: int = 0, **kwargs):
        self.epsilon = check_float("epsilon", epsilon, low=0.0, high=1e6, low_open=True,
                                   note="the tolerance of the anchor metric")
        self.metric = check_choice("metric", metric, METRICS)
        self.labels = check_choice("labels", labels, LABELS)
        self.fixed_sigma = check_float("sigma", sigma, low=0.0, allow_none=True, note="the posterior scale")
        self.sigma_range = _check_range(sigma_range)
        self.search_steps = check_int("search_steps", search_steps, minimum=1)
        self.search_samples = check_int("search_samples", search_samples, minimum=1)
        self.anchor_batches = check_int("anchor_batches", anchor_batches, minimum=1, allow_none=True)
        self.search_seed = check_int("search_seed", search_seed)
        super().__init__(model, **kwargs)
        for name, value, other in (("metric", "accuracy", "nll"), ("labels", "predicted", "data")):
            if getattr(self, name) == value and self.likelihood.name not in PROBABILITY_LIKELIHOODS:
                raise ValueError(f"{name}={value!r} needs class or token probabilities, but likelihood="
                                 f"{self.likelihood.name!r}; accepted: {name}={other!r}, or a categorical or token "
                                 "likelihood")
        self._pairs = self._lora_pairs()
        self.register_buffer("tfb_sigma", torch.tensor(self.fixed_sigma or 0.0, dtype=torch.float64))
        self.register_buffer("tfb_ready", torch.tensor(self.fixed_sigma is not None))
        self._searching = False
        self._cache: tuple[tuple, dict[str, torch.Tensor]] | None = None
        self.search_record: dict | None = None

    def _lora_pairs(self) -> dict[str, str]:
        """``{A name: B name}`` for the Bayesian LoRA A factors (B a point estimate or frozen), checked."""
        names = set(self.bayesian_names)
        b_factors = [n for n in self.bayesian_names if any(part in LORA_PAIRS.values() for part in n.split("."))]
        if b_factors:
            raise ValueError(f"params selects LoRA's B factors ({b_factors[:3]}), but TFB keeps B a point estimate and "
                             "puts its Gaussian on A (Shi et al. 2024, §3); accepted: params='adapters_A' (LoRA's "
                             "A factors), or parameters without a B factor (an isotropic Gaussian)")
        pairs = {}
        for name in self.bayesian_names:
            parts = name.split(".")
            found = [i for i, part in enumerate(parts) if part in LORA_PAIRS]
            if not found:
                continue
            i = found[-1]
            b_name = ".".join([*parts[:i], LORA_PAIRS[parts[i]], *parts[i + 1:]])
            b = self._tensor(b_name)
            if b_name in names or b is None or b.dim() < 2 or b[0].numel() != self.theta[name].shape[0]:
                shape = None if b is None else tuple(b.shape)
                raise ValueError(f"the LoRA A factor {name!r} (rank {self.theta[name].shape[0]}) has no B partner "
                                 f"{b_name!r} of that rank among the point estimates or frozen tensors (found shape "
                                 f"{shape}); accepted: a peft LoRA whose B factors are not Bayesian (params='adapters_A')")
            pairs[name] = b_name
        return pairs

    def _tensor(self, name: str) -> torch.Tensor | None:
        for store in (self.point, self.frozen):
            if name in store.keys():
                return store[name]
        return None

    # ------------------------------------------------------------------ hooks (MAP's training; the posterior's spread)
    def posterior_std(self):
        """σ (Σ_k V_ik² / d_k²)^½ for the rows i of each LoRA A (the same for all its columns), σ elsewhere,
        ``{name: tensor}`` (zeros before the search).
        """
        sigma = self.sigma
        mixes = self._mixes()
        out = {}
        for n, m in self.theta.items():
            if n in mixes:
                row = mixes[n].square().sum(1).sqrt().to(m.dtype) * sigma
                out[n] = row.reshape(-1, *([1] * (m.dim() - 1))).expand_as(m).clone()
            else:
                out[n] = torch.full_like(m, sigma)
        return out

    def _draw(self, num_samples, generator):
        """S draws ``{name: (S, *shape)}``: A_s = A + σ V diag(1/d) E for a LoRA A, θ + σ E elsewhere, E ~ N(0, I)."""
        sigma = self.sigma
        mixes = self._mixes()
        out = {}
        for n, m in self.theta.items():
            m = m.detach()
            eps = torch.randn((num_samples, *m.shape), generator=generator, device=m.device, dtype=m.dtype)
            if n in mixes:
                flat = eps.reshape(num_samples, m.shape[0], -1)
                eps = torch.einsum("ik,skj->sij", mixes[n].to(m.dtype), flat).reshape(eps.shape)
            out[n] = m + sigma * eps
        return out

    def is_ready(self) -> bool:
        """Whether σ exists: given as ``sigma``, or found by :meth:`search_sigma` (also while it scores a σ)."""
        return self._searching or bool(self.tfb_ready)

    def _not_ready_message(self) -> str:
        return ("the TFB posterior has no σ yet: call bnn.search_sigma(anchor_loader) first (bayeswrap.fit does "
                "this after training), or wrap with sigma=<a fixed value>")

    def after_fit(self, train_loader) -> None:
        """Searches σ on ``train_loader`` (the anchor set), unless a fixed ``sigma`` was given."""
        if self.fixed_sigma is None:
            self.search_sigma(train_loader)

    # ------------------------------------------------------------------ the search
    @property
    def sigma(self) -> float:
        """σ now (0 before the search)."""
        return float(self.tfb_sigma)

    @outside_inference_mode
    @torch.no_grad()
    def search_sigma(self, anchor_loader) -> float:
        """Algorithm 1: the largest σ in ``sigma_range`` whose anchor metric stays within ε of the point estimate's.

        Sets σ (and :attr:`search_record`), leaves the model's train/eval mode as it was (scores in eval mode).

        Args:
            anchor_loader: a re-iterable of ``(inputs, targets)`` batches (a DataLoader, a list), read once per σ
                (its first ``anchor_batches`` batches).

        Returns:
            σ, a float.

        Raises:
            ValueError: for a one-shot iterator or a loader that yields no batches; if every LoRA B factor is zero
                and there is no other Bayesian parameter (an untrained adapter has no direction to spread A in).
        """
        check_reiterable(anchor_loader, "anchor_loader", self.search_steps + 3,
                         "the TFB search scores it once per σ")
        mixes = self._mixes()
        if self._pairs and len(self._pairs) == len(self.bayesian_names) and \
                all(not bool(mx.any()) for mx in mixes.values()):
            raise ValueError("every LoRA B factor is zero (peft initialises B = 0: the adapters were not trained), so "
                             "TFB has no direction to spread A in; accepted: a trained LoRA (bw.fit first, or load "
                             "trained adapters)")
        was_training = self.training
        self.eval()
        self._searching = True
        tried, values, within = [], [], []
        try:
            targets = self._predicted_classes(anchor_loader) if self.labels == "predicted" else None
            baseline = self._anchor_metric(anchor_loader, 0.0, 0, targets)

            def ok(sigma: float) -> bool:
                value = self._anchor_metric(anchor_loader, sigma, self.search_samples, targets)
                good = self._within(value, baseline)
                tried.append(sigma), values.append(value), within.append(good)
                return good

            low, high = self.sigma_range
            bound_hit = None
            if ok(high):
                chosen, bound_hit = high, "high"
            elif not ok(low):
                chosen, bound_hit = low, "low"
            else:
                for _ in range(self.search_steps):
                    mid = math.sqrt(low * high)
                    low, high = (mid, high) if ok(mid) else (low, mid)
                chosen = low
        finally:
            self._searching = False
            self.train(was_training)
        if bound_hit is not None:
            where = "even its high end is within" if bound_hit == "high" else "even its low end is outside"
            warnings.warn(f"TFB: {where} the tolerance (metric={self.metric!r}, epsilon={self.epsilon:g}) of "
                          f"sigma_range={self.sigma_range}, so sigma={chosen:g} is the range's end; widen sigma_range "
                          "or change epsilon", RuntimeWarning, stacklevel=4)
        self.tfb_sigma.fill_(chosen)
        self.tfb_ready.fill_(True)
        self.search_record = {"sigma": tried, "metric": values, "baseline": baseline, "chosen": chosen,
                              "within": within, "bound_hit": bound_hit}
        return chosen

    def _within(self, value: float, baseline: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.metric == "nll":
            return value - baseline <= self.epsilon * abs(baseline)
        return baseline - value <= self.epsilon

    def _anchor_metric(self, loader, sigma: float, num_samples: int, targets: list | None = None) -> float:
        """The anchor NLL or accuracy of the S-sample predictive at σ (S = 0: the posterior mean), on the loader's
        targets or on ``targets`` (one tensor per batch), summed over ranks under data parallelism.
        """
        self.tfb_sigma.fill_(sigma)
        generator = torch.Generator(device=model_device(self)).manual_seed(self.search_seed)
        nll = correct = count = 0.0
        for index, batch in enumerate(itertools.islice(loader, self.anchor_batches)):
            pred, y = predict_loader(self, [batch], num_samples, generator=generator)
            y = y if targets is None else targets[index]
            scores, n = score(self, pred, y), target_count(self.likelihood, y)
            nll += scores["nll"] * n
            correct += (1.0 - scores.get("error", 0.0)) * n
            count += n
        nll, correct, count = distributed.all_reduce_numbers([nll, correct, count])
        if count == 0:
            raise ValueError("anchor_loader yielded no batches (or no target tokens); accepted: a loader of "
                             "(inputs, targets) batches, e.g. the training loader")
        return nll / count if self.metric == "nll" else correct / count

    def _predicted_classes(self, loader) -> list[torch.Tensor]:
        """The trained LoRA's predicted class of every anchor example (or target token), one tensor per batch."""
        self.tfb_sigma.fill_(0.0)
        return [predict_loader(self, [batch], 0)[0].argmax(-1)
                for batch in itertools.islice(loader, self.anchor_batches)]

    def _mixes(self) -> dict[str, torch.Tensor]:
        """``{A name: V diag(1/d) (r × r)}`` from the thin SVD of each LoRA B now (cached while B is unchanged)."""
        if not self._pairs:
            return {}
        tensors = {a: self._tensor(b) for a, b in self._pairs.items()}
        key = tuple((t._version, t.data_ptr()) for t in tensors.values())
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        mixes = {}
        for a, b in tensors.items():
            b2 = b.detach().reshape(b.shape[0], -1).to(self.theta[a].device, torch.float64)
            _, d, vh = torch.linalg.svd(b2, full_matrices=False)
            inv = torch.where(d > RANK_TOL * d.max(), 1.0 / d.clamp_min(torch.finfo(d.dtype).tiny),
                              torch.zeros_like(d))
            mixes[a] = (vh.T * inv).to(self.theta[a].dtype)
        self._cache = (key, mixes)
        return mixes


def _check_range(value) -> tuple[float, float]:
    """``sigma_range`` as two floats with 0 < low < high < inf, or a ValueError naming it."""
    try:
        low, high = (float(v) for v in value)
        good = 0 < low < high < math.inf
    except (TypeError, ValueError):
        good = False
    if not good:
        raise ValueError(f"sigma_range={value!r} is not accepted; accepted: (low, high), two numbers with "
                         "0 < low < high < inf, e.g. (1e-4, 1.0)")
    return low, high
