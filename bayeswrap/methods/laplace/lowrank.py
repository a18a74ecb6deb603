"""Low-rank Laplace: the top-k eigenpairs of the curvature by randomised subspace iteration, matrix-free.

``hessian_structure="lowrank"`` approximates the data term of the posterior precision by its k leading eigenpairs,

    H ≈ U diag(λ) Uᵀ (+ D),      P = U diag(λ) Uᵀ + D + δ I,

with U (P, k) orthonormal, λ ≥ 0 (k = ``low_rank``) and the optional diagonal remainder
D = max(0, diag(H) − diag(U diag(λ) Uᵀ)) (``low_rank_diagonal=True``), which keeps the exact diagonal of H where
the k directions miss it. H is the curvature of the ``curvature`` option (the GGN (N/n) Σ_n J_nᵀ Λ_n J_n, or the
empirical Fisher Σ_n g_n g_nᵀ); it is never formed. Its products with a block of vectors V (P, l),

    H V = (N/n) Σ_n J_nᵀ (Σ_m s_{n,m} s_{n,m}ᵀ) J_n V,

take one pass over the training data: J_n V by forward mode (``torch.func.jvp``, vmapped over the l columns), its
projection on the output-space vectors s_{n,m} of :func:`~bayeswrap.methods.laplace.fitting.ggn_vectors` (the
columns of a factor of Λ_n; the observed-label gradient for the empirical Fisher), and J_nᵀ (·) by reverse mode
(``torch.func.vjp``, vmapped). Memory: l tangents of the activations and l copies of the parameters per
``curvature_chunk_size`` columns, never P × P (:func:`lowrank_peak_bytes`).

The eigenpairs come from randomised subspace iteration with a Rayleigh–Ritz step (Halko, Martinsson & Tropp 2011,
Algorithms 4.4 and 5.3): with l = min(k + p, P) columns (p = :data:`OVERSAMPLING`), Ω (P, l) Gaussian,

    Y = H Ω;   q times: Q = orth(Y), Y = H Q;   Q = orth(Y), B = Qᵀ H Q = W diag(μ) Wᵀ,   U = Q W[:, :k], λ = μ[:k],

q = ``low_rank_power_iterations`` (2 + q passes over the data in all, the first shared with the log-likelihood).
When rank(H) ≤ l the subspace holds the whole range of H and the top-k eigenpairs are exact to rounding (e.g. a
model with fewer training examples × classes than l); otherwise the error of the k-th eigenvalue falls like
(μ_{l+1}/μ_k)^{2q+1} (Halko et al. 2011, §10). In a data-parallel fit every rank sums its shard's products and the sums are
all-reduced after each pass; Ω must then be drawn alike on every rank (the same ``generator`` seed). laplace-torch's ``LowRankLaplace`` finds the eigenpairs of the
exact Hessian by deflated power iteration (10·k passes, tolerance 1e-3) through the old ``asdfghjkl`` backend;
here the eigenpairs are those of the GGN (or empirical Fisher), the curvature the GLM predictive linearises.

With a = D + δ (P,) and W = diag(1/a) U diag(λ)^{1/2} (P, k), the Woodbury identity and the matrix determinant lemma
give, at the cost of a k × k Cholesky factor M = I_k + diag(λ)^{1/2} Uᵀ diag(1/a) U diag(λ)^{1/2} = L Lᵀ,

    P⁻¹ = diag(1/a) − C Cᵀ,   C = W L⁻ᵀ,
    log det P = Σ_i log a_i + log det M,

so the marginal variances are 1/a − rowsum(C²), the functional variance of the GLM predictive is
Σ_i J_{k,i}² / a_i − Σ_j (J c_j)_k² (the first term by the diagonal machinery, the second by k forward-mode
products), and a draw θ − θ* = A^{-1/2} (I − E Eᵀ)^{1/2} ε with E = A^{1/2} C = V s Zᵀ (thin SVD) and
(I − E Eᵀ)^{1/2} = I − V diag(1 − (1 − s²)^{1/2}) Vᵀ. Without D and with a scalar δ these are laplace-torch's
``LowRankLaplace`` formulas (its ``functional_variance``, ``log_det_posterior_precision``); the evidence is
log p(D | θ*) − ½ [log det P − Σ_i log δ_i + δ |θ* − θ̄|²].

References:
    N. Halko, P.-G. Martinsson, J. A. Tropp 2011, "Finding structure with randomness: probabilistic algorithms for
    constructing approximate matrix decompositions", SIAM Review 53(2) (Algorithms 4.4, 5.3).
    C. Lanczos 1950 (the Krylov alternative; subspace iteration is used here because a block of l products costs
    one pass over the data, where Lanczos needs one pass per vector).
    E. Daxberger et al. 2021, "Laplace Redux", NeurIPS (laplace-torch's ``LowRankLaplace``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.func import jvp, vjp, vmap

from bayeswrap.core.batches import loader_pair
from bayeswrap.core.distributed import all_reduce_sum_
from bayeswrap.methods.laplace.structures import Delta, _Structure

#: extra columns of the randomised range finder (Halko et al. 2011, §4.2: p = 5 or 10)
OVERSAMPLING = 10


def lowrank_peak_bytes(num_params: int, rank: int, *, batch_outputs: int, chunk: int, activation_bytes: int = 0,
                       dtype_bytes: int = 4, oversampling: int = OVERSAMPLING) -> int:
    """The peak memory estimate of fitting and using a :class:`LowRankPosterior`, in bytes.

    Counts the stored U (P, k), λ and D, the range finder's Y, Q and Ω (3 × (P, l), l = min(k + p, P)), and per
    column chunk of the curvature products ``chunk`` copies of the parameters (the vmapped pullbacks) and of the
    activations (the vmapped tangents), plus the (chunk, B·K) output-space products.

    Args:
        num_params: P, the number of Bayesian parameters.
        rank: k, ``low_rank``.
        batch_outputs: B·K, the outputs of one batch.
        chunk: the columns per vmapped product (``curvature_chunk_size``).
        activation_bytes: the activations of one forward pass of a batch, in bytes (0 if unknown).
        dtype_bytes: bytes per element of the parameters.
        oversampling: p.

    Returns:
        The estimate, an int.
    """
    cols = min(rank + oversampling, num_params)
    chunk = min(chunk, cols)
    stored = num_params * (rank + 1) + rank
    finder = 3 * num_params * cols
    products = chunk * (num_params + 2 * batch_outputs)
    return int(dtype_bytes * (stored + finder + products) + chunk * activation_bytes)


class LowRankPosterior(_Structure):
    """P = U diag(λ) Uᵀ + D + δ I over the flattened Bayesian parameters (in ``shapes`` order).

    Args:
        shapes: ``{name: shape}`` of the Bayesian parameters, in order.
        rank: k, the number of eigenpairs kept, 1 ≤ k ≤ P.
        diagonal: whether D = max(0, diag(H) − diag(U diag(λ) Uᵀ)) is kept (else D = 0).
        power_iterations: q ≥ 0, the subspace iterations after the first product.
        dtype, device: of U, λ, D.

    Attributes:
        U: (P, k) buffer, orthonormal columns, the eigenvectors.
        lam: (k,) buffer, the eigenvalues λ ≥ 0 (descending).
        D: (P,) buffer, the diagonal remainder (zeros without ``diagonal``).

    Raises:
        ValueError: for k outside [1, P] or q < 0 (the message names the value and the accepted range).
    """

    #: the posterior is not block-diagonal over the tensors; the evidence uses :meth:`log_det_ratio`
    matrix_free = True

    def __init__(self, shapes: Mapping[str, torch.Size], rank: int, diagonal: bool, power_iterations: int,
                 dtype, device):
        super().__init__()
        self.shapes = dict(shapes)
        self.sizes = [int(torch.Size(s).numel()) for s in self.shapes.values()]
        self.num_params = sum(self.sizes)
        if not 1 <= rank <= self.num_params:
            raise ValueError(f"low_rank={rank}: the number of eigenpairs of hessian_structure='lowrank' must lie in "
                             f"[1, P] with P = {self.num_params} Bayesian parameters; accepted: an integer in "
                             f"[1, {self.num_params}]")
        if power_iterations < 0:
            raise ValueError(f"low_rank_power_iterations={power_iterations}; accepted: an integer >= 0")
        self.rank = int(rank)
        self.diagonal = bool(diagonal)
        self.wants_diagonal = self.diagonal  # fit_curvature computes the exact diag(H) in its pass
        self.power_iterations = int(power_iterations)
        self.columns = min(self.rank + OVERSAMPLING, self.num_params)
        self.register_buffer("U", torch.zeros(self.num_params, self.rank, dtype=dtype, device=device))
        self.register_buffer("lam", torch.zeros(self.rank, dtype=dtype, device=device))
        self.register_buffer("D", torch.zeros(self.num_params, dtype=dtype, device=device))
        self._basis = None  # the current Q of the range finder while fitting
        self._product = None  # its running H Q

    # ------------------------------------------------------------------ fitting
    def reset(self):
        for t in self.buffers():
            if t.is_floating_point():
                t.zero_()
        self._cache = None
        self._basis = self._product = None

    def prepare(self, bnn, train_loader, generator) -> None:
        """Keeps ``generator``: the first :meth:`accumulate` draws Ω (P, l) from it as the first basis (after the
        first batch's memory check, so a refused fit allocates no P × l) and adds H Ω over the data.
        """
        if bnn.curvature == "fisher":
            raise ValueError("hessian_structure='lowrank' with curvature='fisher': the sampled labels would differ "
                             "between the passes over the data of the subspace iteration; accepted: "
                             "curvature='ggn' or 'empirical_fisher'")
        self._basis = self._product = None
        self._generator = generator

    def accumulate(self, bnn, x, y, theta, sampled=None) -> None:
        """Adds one batch's H_batch Q (unscaled) to the running product (the first draws Ω, see :meth:`prepare`)."""
        self._start()
        self._product += curvature_product(bnn, x, y, theta, self._basis, self._split)

    def _start(self) -> None:
        """Draws Ω (P, l) and its orthonormal basis, and a zero running product, unless drawn already."""
        if self._basis is None:
            omega = torch.randn(self.num_params, self.columns, generator=getattr(self, "_generator", None),
                                dtype=self.U.dtype, device=self.U.device)
            self._basis = torch.linalg.qr(omega).Q
            self._product = torch.zeros_like(self._basis)
            self._generator = None

    def complete(self, bnn, train_loader, scale: float, diag: Mapping[str, torch.Tensor] | None
                 ) -> dict[str, torch.Tensor]:
        """Runs the remaining passes, sets U, λ (and D), and returns diag(H) ``{name: tensor}`` ((N/n)-scaled).

        Args:
            bnn: the Laplace model.
            train_loader: the training batches (iterated ``low_rank_power_iterations + 1`` more times).
            scale: N/n.
            diag: the exact (N/n)-scaled diagonal of H (with ``diagonal``), else None.
        """
        theta = {n: t.detach() for n, t in bnn.theta.items()}
        self._start()  # a data-parallel rank whose shard was empty draws Ω too (a zero product)
        all_reduce_sum_([self._product])  # data-parallel fits: every rank summed its own shard
        y_mat = self._product * scale
        for _ in range(self.power_iterations + 1):
            self._basis = torch.linalg.qr(y_mat).Q
            y_mat = self._pass(bnn, train_loader, theta) * scale
        q = self._basis
        b = q.t() @ y_mat
        mu, w = torch.linalg.eigh((0.5 * (b + b.t())).double())
        order = torch.argsort(mu, descending=True)[: self.rank]
        self.lam.copy_(mu[order].clamp_min(0).to(self.lam.dtype))
        self.U.copy_(q @ w[:, order].to(q.dtype))
        self._basis = self._product = None
        low_diag = (self.U.square() * self.lam).sum(1)
        if self.diagonal:
            exact = torch.cat([diag[n].reshape(-1).to(self.D.dtype) for n in self.shapes])
            self.D.copy_((exact - low_diag).clamp_min(0))
            self._cache = None
            return dict(diag)
        self._cache = None
        return self._split(low_diag)

    def _pass(self, bnn, train_loader, theta) -> torch.Tensor:
        """Σ over the loader's batches of H_batch Q (unscaled), (P, l)."""
        total = torch.zeros_like(self._basis)
        device = self.U.device
        for index, batch in enumerate(train_loader):
            x, y = loader_pair(batch, f"fit_curvature's loader batch {index}", bnn.label_key, device,
                               bnn.likelihood.name == "categorical")
            total += curvature_product(bnn, x, y, theta, self._basis, self._split)
        all_reduce_sum_([total])
        return total

    # ------------------------------------------------------------------ posterior
    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """(..., P) → ``{name: (..., *shape)}``."""
        parts = torch.split(flat, self.sizes, dim=-1)
        return {n: p.reshape(*flat.shape[:-1], *s) for (n, s), p in zip(self.shapes.items(), parts)}

    def prior_diagonal(self, delta: Delta) -> torch.Tensor:
        """δ over the flattened parameters, (P,)."""
        if not isinstance(delta, Mapping):
            return torch.full((self.num_params,), float(delta), dtype=self.U.dtype, device=self.U.device)
        return torch.cat([torch.full((size,), float(delta[n]), dtype=self.U.dtype, device=self.U.device)
                          for n, size in zip(self.shapes, self.sizes)])

    def eigenvalues(self) -> torch.Tensor:
        """λ, float64 (k,): the nonzero eigenvalues of U diag(λ) Uᵀ (all of H's when D = 0)."""
        return self.lam.double()

    def precision(self, delta: Delta) -> torch.Tensor:
        """The dense P = U diag(λ) Uᵀ + D + δ I, (P, P) (tests and small models only)."""
        return (self.U * self.lam) @ self.U.t() + torch.diag(self.D + self.prior_diagonal(delta))

    def factor(self, delta: Delta) -> tuple[torch.Tensor, torch.Tensor]:
        """``(a, C)`` with P⁻¹ = diag(1/a) − C Cᵀ: a = D + δ (P,), C (P, k) (cached for the last δ)."""
        key = (tuple(sorted(delta.items())) if isinstance(delta, Mapping) else float(delta),
               self._decomposition_key())
        cached = getattr(self, "_factor_cache", None)
        if cached is None or cached[0] != key:
            a = self.D + self.prior_diagonal(delta)
            w = self.U * self.lam.sqrt() / a[:, None]
            m = torch.eye(self.rank, dtype=a.dtype, device=a.device) + (self.U * self.lam.sqrt()).t() @ w
            chol = torch.linalg.cholesky(m.double()).to(a.dtype)
            c = torch.linalg.solve_triangular(chol, w.t(), upper=False).t()  # W L⁻ᵀ
            self._factor_cache = (key, a, c)
        return self._factor_cache[1], self._factor_cache[2]

    def _decomposition_key(self) -> int:
        self.decomposition()
        return self.num_decompositions

    def _decompose(self):
        self._factor_cache = None
        return True

    def log_det_ratio(self, delta: Mapping[str, torch.Tensor], scale=1.0) -> torch.Tensor:
        """The log-determinant ratio log det P − Σ_i log δ_i for H scaled by ``scale``, differentiable in ``delta`` ({name: 0-d δ}).

        Matrix determinant lemma: Σ_i log(a_i/δ_i) + log det(I_k + Λ^{1/2} Uᵀ diag(1/a) U Λ^{1/2}),
        a = scale·D + δ. float64.
        """
        prior = torch.cat([delta[n].double().reshape(1).expand(size) for n, size in zip(self.shapes, self.sizes)])
        u, lam = self.U.double(), self.lam.double() * scale
        a = self.D.double() * scale + prior
        root = u * lam.sqrt()
        m = torch.eye(self.rank, dtype=torch.float64, device=u.device) + root.t() @ (root / a[:, None])
        chol = torch.linalg.cholesky(m)
        return torch.log(a / prior).sum() + 2 * chol.diagonal().log().sum()

    def scale_(self, factor: float) -> None:
        """H ← factor · H (a learned noise std moved)."""
        self.lam.mul_(factor)
        self.D.mul_(factor)
        self._cache = None

    def marginal_variances(self, delta: Delta) -> dict[str, torch.Tensor]:
        """diag(P⁻¹) = 1/a − rowsum(C²), ``{name: tensor}``."""
        a, c = self.factor(delta)
        return self._split((1.0 / a - c.square().sum(1)).clamp_min(0))

    def sample_deltas(self, count: int, generator, delta: Delta) -> dict[str, torch.Tensor]:
        """``count`` draws of θ − θ* with covariance P⁻¹, ``{name: (count, *shape)}`` (O(P k) each)."""
        a, c = self.factor(delta)
        root = a.rsqrt()
        v, s, _ = torch.linalg.svd(c / root[:, None], full_matrices=False)  # E = A^{1/2} C
        shrink = 1.0 - (1.0 - s.square()).clamp_min(0).sqrt()
        eps = torch.randn(count, self.num_params, generator=generator, dtype=a.dtype, device=a.device)
        z = eps - ((eps @ v) * shrink) @ v.t()
        return self._split(z * root)

    def functional_moments(self, bnn, x, delta: Delta) -> tuple[torch.Tensor, torch.Tensor]:
        """f(x; θ*) and diag(J P⁻¹ Jᵀ) = Σ_i J_i²/a_i − Σ_j (J c_j)², each (B, *out)."""
        a, c = self.factor(delta)
        f, prior_var = bnn._diag_moments(x, self._split(1.0 / a))
        theta = {n: t.detach() for n, t in bnn.theta.items()}
        gain = torch.zeros_like(prior_var)
        step = max(1, bnn.curvature_chunk_size)
        with torch.enable_grad():
            for start in range(0, self.rank, step):
                tangents = self._split(c[:, start:start + step].t().to(f.dtype))
                jc = vmap(lambda t: jvp(lambda th: bnn.forward_with(th, x), (theta,), (t,))[1])(tangents)
                gain += jc.detach().square().sum(0)
        return f, (prior_var - gain).clamp_min(0)


def curvature_product(bnn, x, y, theta, basis: torch.Tensor, split) -> torch.Tensor:
    """Σ_n J_nᵀ (Σ_m s_{n,m} s_{n,m}ᵀ) J_n V over one batch, (P, l), for V = ``basis`` (P, l).

    J_n V by ``jvp`` and J_nᵀ by ``vjp``, both vmapped over ``curvature_chunk_size`` columns at a time; s_{n,m} are
    the curvature's output-space vectors (:meth:`~bayeswrap.methods.laplace.fitting.CurvatureFitting._curvature_vectors`).
    """
    with torch.enable_grad():
        f, pullback = vjp(lambda th: bnn.forward_with(th, x), theta)
    s = bnn._curvature_vectors(f.detach(), y, None).to(f.dtype)  # (M, B, *out)
    flat_s = s.reshape(s.shape[0], s.shape[1], -1)
    out = []
    step = max(1, bnn.curvature_chunk_size)
    for start in range(0, basis.shape[1], step):
        tangents = split(basis[:, start:start + step].t().to(f.dtype))
        with torch.enable_grad():
            jv = vmap(lambda t: jvp(lambda th: bnn.forward_with(th, x), (theta,), (t,))[1])(tangents)
        coef = torch.einsum("mbk,cbk->cmb", flat_s, jv.detach().reshape(jv.shape[0], jv.shape[1], -1))
        cot = torch.einsum("cmb,mbk->cbk", coef, flat_s).reshape(jv.shape)
        (grads,) = vmap(pullback)(cot)
        out.append(torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], 1).t())
    return torch.cat(out, 1).to(basis.dtype)
