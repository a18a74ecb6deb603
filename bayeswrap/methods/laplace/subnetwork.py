"""Subnetwork Laplace: a dense posterior over the n highest-scoring parameter entries, the rest at the MAP.

``subset_of_weights="subnetwork"`` (Daxberger, Nalisnick, Allingham, Antorán, Hernández-Lobato 2021, "Bayesian deep
learning via subnetwork inference", ICML) chooses n = ``n_params_subnet`` entries S of the flattened Bayesian
parameter vector θ (the tensors in :attr:`~bayeswrap.Laplace.bayesian_names` order, each row-major: with every
trainable parameter Bayesian, the order of ``torch.nn.utils.parameters_to_vector(model.parameters())``), and fits

    P_S = H_SS + δ I_n,      θ_S ~ N(θ*_S, P_S⁻¹),   θ_{∖S} = θ*_{∖S},

with H_SS = (N/n) Σ_n J_{n,S}ᵀ Λ_n J_{n,S} the curvature (``curvature``: GGN, Monte Carlo GGN or empirical Fisher)
restricted to the chosen entries: the columns S of the per-example Jacobians (``jacrev`` under ``vmap``,
``curvature_chunk_size`` examples at a time), taken only over the parameter tensors that hold a chosen entry (laplace-
torch takes them over all P and then picks the columns). Everything of :class:`~bayeswrap.methods.laplace.structures.FullPosterior`
applies to the n × n block (eigendecomposition, draws, the GLM variance J_S P_S⁻¹ J_Sᵀ); the evidence is
laplace-torch's ``SubnetLaplace`` one,

    log p(D | δ) ≈ log p(D | θ*) − ½ [Σ_{i ≤ n} log(1 + λ_i/δ) + δ |θ*_S − θ̄_S|²],

over the eigenvalues λ_i of H_SS and the prior scatter of the chosen entries only.

The entries are the top n of a score (``subnetwork_score``; ties broken as ``torch.argsort(descending=True)``, then
sorted ascending, as laplace-torch's ``ScoreBasedSubnetMask``):

* ``"largest_magnitude"``: |θ*_i| (laplace-torch's ``LargestMagnitudeSubnetMask``);
* ``"largest_variance"`` (default, the paper's Wasserstein-optimal choice under a diagonal posterior): the marginal
  variance 1/(h_i + δ) of the diagonal Laplace posterior of the same curvature and prior precision, h its diagonal
  (N/n)-scaled (one extra pass over the data; laplace-torch's ``LargestVarianceDiagLaplaceSubnetMask`` on a
  ``DiagLaplace`` with the same prior precision);
* any scores given with :meth:`~bayeswrap.Laplace.use_subnetwork_scores`, e.g. the diagonal SWAG variances of a fitted
  bayeswrap SWAG model, :func:`swag_variances` (laplace-torch's ``LargestVarianceSWAGSubnetMask`` runs its own SGD
  for those).

References:
    E. Daxberger, E. Nalisnick, J. U. Allingham, J. Antorán, J. M. Hernández-Lobato 2021, "Bayesian deep learning
    via subnetwork inference", ICML. Daxberger et al. 2021, "Laplace Redux", NeurIPS (laplace-torch's
    ``SubnetLaplace`` and ``utils.subnetmask``). W. Maddox et al. 2019, "A simple baseline for Bayesian
    uncertainty in deep learning" (SWAG).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from bayeswrap.core.batches import loader_pair
from bayeswrap.methods.laplace.fitting import data_units
from bayeswrap.methods.laplace.memory import plan_chunk
from bayeswrap.methods.laplace.structures import MAX_FULL_PARAMS, Delta, FullPosterior, _Structure, delta_of

SUBNETWORK_SCORES = ("largest_variance", "largest_magnitude")


def subnet_peak_bytes(num_params: int, n_params_subnet: int, *, outputs: int, chunk: int, dtype_bytes: int = 4) -> int:
    """The peak memory estimate of a :class:`SubnetPosterior`, in bytes: H_SS and its eigenvectors (2 n²), the
    per-example Jacobians of a chunk (chunk · K · P, at most: they cover the tensors holding a chosen entry) and the
    scores (P).
    """
    n = n_params_subnet
    return int(dtype_bytes * (2 * n * n + chunk * outputs * num_params + 2 * num_params))


def top_indices(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` largest entries of a flat score vector, as sorted int64 indices (laplace-torch's order)."""
    return torch.argsort(scores, descending=True)[:count].sort().values


class SubnetPosterior(FullPosterior):
    """P_S = H_SS + δ I over ``n_params_subnet`` entries of the flattened Bayesian parameters.

    Args:
        shapes: ``{name: shape}`` of all Bayesian parameters, in order.
        n_params_subnet: n, 1 ≤ n ≤ min(P, :data:`MAX_FULL_PARAMS`).
        score: ``"largest_variance"`` or ``"largest_magnitude"`` (see the module docstring).
        dtype, device: of H.

    Attributes:
        H: the (n, n) buffer.
        indices: (n,) int64 buffer, the chosen entries (ascending), set by :meth:`prepare`.

    Raises:
        ValueError: for n outside [1, min(P, 20,000)] (the message names the value and the range).
    """

    matrix_free = False

    def __init__(self, shapes: Mapping[str, torch.Size], n_params_subnet: int, score: str, dtype, device):
        _Structure.__init__(self)
        self.shapes = dict(shapes)
        self.sizes = [int(torch.Size(s).numel()) for s in self.shapes.values()]
        self.total = sum(self.sizes)
        high = min(self.total, MAX_FULL_PARAMS)
        if not 1 <= n_params_subnet <= high:
            raise ValueError(f"n_params_subnet={n_params_subnet}: subset_of_weights='subnetwork' keeps a dense "
                             f"n × n precision over n of the P = {self.total} Bayesian parameters; accepted: an "
                             f"integer in [1, {high}]")
        self.num_params = int(n_params_subnet)
        self.score = score
        self.scores: dict[str, torch.Tensor] | None = None  # given scores (use_subnetwork_scores)
        self.chosen = False  # whether :attr:`indices` hold this fit's choice (set by prepare)
        self.register_buffer("H", torch.zeros(self.num_params, self.num_params, dtype=dtype, device=device))
        self.register_buffer("indices", torch.zeros(self.num_params, dtype=torch.long, device=device))

    def prepare(self, bnn, train_loader, generator) -> None:
        """Chooses the entries from the score (one pass over the data for ``"largest_variance"``)."""
        theta = {n: t.detach() for n, t in bnn.theta.items()}
        if self.scores is not None:
            flat = torch.cat([self.scores[n].reshape(-1).to(self.H.device, torch.float64) for n in self.shapes])
        elif self.score == "largest_magnitude":
            flat = torch.cat([theta[n].reshape(-1).abs() for n in self.shapes])
        else:
            h = diagonal_curvature(bnn, train_loader, theta, generator)
            delta = bnn._delta()
            flat = torch.cat([1.0 / (h[n].reshape(-1) + delta_of(delta, n)) for n in self.shapes])
        self.indices.copy_(top_indices(flat, self.num_params))
        self.chosen = True

    def reset(self):
        super().reset()
        self.chosen = False

    def mask(self) -> dict[str, torch.Tensor]:
        """``{name: bool tensor of the parameter's shape}``, True at the chosen entries."""
        flat = torch.zeros(self.total, dtype=torch.bool, device=self.indices.device)
        flat[self.indices] = True
        return self._split_full(flat)

    def _split_full(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = torch.split(flat, self.sizes, dim=-1)
        return {n: p.reshape(*flat.shape[:-1], *s) for (n, s), p in zip(self.shapes.items(), parts)}

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """(..., n) values of the chosen entries → ``{name: (..., *shape)}``, zeros elsewhere (the MAP entries)."""
        full = flat.new_zeros(*flat.shape[:-1], self.total)
        full[..., self.indices] = flat
        return self._split_full(full)

    def jacobian_names(self) -> list[str]:
        """The Bayesian tensors holding a chosen entry, in order: the per-example Jacobians are taken over these
        only (chunk · K · Σ their sizes, not chunk · K · P).
        """
        return [n for n, m in self.mask().items() if bool(m.any())]

    def touched(self) -> tuple[str, ...] | None:
        """:meth:`jacobian_names` once the entries are chosen (by :meth:`prepare`, or a fitted or loaded posterior),
        else None (the memory estimates then bound the Jacobians over all P).
        """
        if not (self.chosen or bool(self.fitted)):
            return None
        return tuple(self.jacobian_names())

    def _local_indices(self) -> torch.Tensor:
        """The chosen entries' positions in the concatenation of the :meth:`jacobian_names` tensors, (n,)."""
        parts = [m.reshape(-1) for m in self.mask().values() if bool(m.any())]
        return torch.cat(parts).nonzero().squeeze(1)

    def add_rows(self, rows: torch.Tensor) -> None:
        """H_SS += R_Sᵀ R_S for per-(vector, example) gradient rows R (R, Σ sizes of :meth:`jacobian_names`)."""
        picked = rows[:, self._local_indices()]
        self.H.addmm_(picked.t(), picked)

    def prior_diagonal(self, delta: Delta) -> torch.Tensor:
        """δ of each chosen entry, (n,)."""
        if not isinstance(delta, Mapping):
            return torch.full((self.num_params,), float(delta), dtype=self.H.dtype, device=self.H.device)
        full = torch.cat([torch.full((size,), float(delta[n]), dtype=self.H.dtype, device=self.H.device)
                          for n, size in zip(self.shapes, self.sizes)])
        return full[self.indices]

    def functional_variance(self, jac: torch.Tensor, delta: Delta) -> torch.Tensor:
        """diag(J_S P_S⁻¹ J_Sᵀ): J (B, K, Σ sizes of :meth:`jacobian_names`) → (B, K)."""
        return super().functional_variance(jac[..., self._local_indices()], delta)

    def log_det_ratio(self, delta: Mapping[str, torch.Tensor], scale=1.0) -> torch.Tensor:
        """The log-determinant ratio log det(scale·H_SS + diag(δ_S)) − Σ_{i∈S} log δ_i, differentiable in ``delta`` ({name: 0-d δ})."""
        full = torch.cat([delta[n].double().reshape(1).expand(size) for n, size in zip(self.shapes, self.sizes)])
        prior = full[self.indices]
        chol = torch.linalg.cholesky(scale * self.H.double() + torch.diag(prior))
        return 2 * chol.diagonal().log().sum() - prior.log().sum()


def diagonal_curvature(bnn, train_loader, theta, generator=None) -> dict[str, torch.Tensor]:
    """The (N/n)-scaled diagonal of the ``curvature`` option over one pass of ``train_loader``, ``{name: tensor}``.

    Raises:
        ValueError: on an empty loader.
    """
    device = next(iter(theta.values())).device
    curv = {n: torch.zeros_like(t) for n, t in theta.items()}
    units = 0
    chunk_given, plan = bnn.curvature_chunk_size, {}
    try:
        for index, batch in enumerate(train_loader):
            x, y = loader_pair(batch, f"fit_curvature's loader batch {index}", bnn.label_key, device,
                               bnn.likelihood.name == "categorical")
            # memory_budget: the chunk sized (or the pass refused) before the batch's work
            bnn.curvature_chunk_size = plan_chunk(bnn, x, "score", plan)
            _add_diagonal(bnn, curv, x, y, theta, generator)
            units += data_units(bnn.likelihood, x, y)
    finally:
        bnn.curvature_chunk_size = chunk_given
    if units == 0:
        raise ValueError("fit_curvature got an empty loader; it needs at least one (inputs, targets) batch")
    scale = bnn.num_data / units
    return {n: c * scale for n, c in curv.items()}


def _add_diagonal(bnn, curv, x, y, theta, generator) -> None:
    """Adds one batch's (unscaled) diagonal of the ``curvature`` option to ``curv``."""
    with torch.enable_grad():
        if bnn.curvature == "ggn":
            torch._foreach_add_(list(curv.values()), list(bnn.ggn_diagonal(x, theta, y).values()))
        elif bnn.curvature == "fisher":
            out = bnn.forward_with(theta, x)
            sampled = [bnn.likelihood.sample_targets(out, generator=generator)
                       for _ in range(bnn.curvature_samples)]
            bnn._add_squared_grads(curv, x, sampled, theta, 1.0 / bnn.curvature_samples)
        else:
            bnn._add_squared_grads(curv, x, y, theta, 1.0)


def swag_variances(swag_bnn) -> dict[str, torch.Tensor]:
    """The diagonal marginal variances of a fitted SWAG model, ``{name: tensor}``: scores for
    :meth:`~bayeswrap.Laplace.use_subnetwork_scores` (the largest-variance subnetwork of Daxberger et al. 2021, §4,
    with SWAG's variance, laplace-torch's ``LargestVarianceSWAGSubnetMask``).

    Raises:
        NotFittedError: if the SWAG model has no moments yet (its ``posterior_std``).
    """
    return {n: s.detach().square() for n, s in swag_bnn.posterior_std().items()}
