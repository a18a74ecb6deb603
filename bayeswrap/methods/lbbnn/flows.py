"""Multiplicative normalizing flows (MNF) for LBBNN-FLOW.

LBBNN-FLOW (Skaaret-Lund, Storvik & Hubin 2023, "Sparsifying Bayesian neural
networks with latent binary variables and normalizing flows", arXiv 2305.03395)
multiplies the weight means of a layer by a latent vector ``z`` whose
variational posterior is a normalizing flow, as in MNF (Louizos & Welling 2017,
"Multiplicative Normalizing Flows for Variational Bayesian Neural Networks",
ICML). ``z`` has one entry per input feature of a linear layer (``D =
in_features``) or per output channel of a convolution (``D = out_channels``).

Variational posterior of ``z`` (MNF eqs. 4–5)::

    z_0 ~ q_0 = N(mu0, diag exp(log_var0)),      z_K = f_K ∘ … ∘ f_1(z_0),
    log q(z_K) = log q_0(z_0) − Σ_k log|det ∂f_k/∂z_{k-1}|.

Each ``f_k`` is a gated inverse autoregressive flow step (Kingma et al. 2016,
"Improved Variational Inference with Inverse Autoregressive Flow", NeurIPS,
eqs. 11–14; :class:`IAFStep`) whose autoregressive network is a MADE (Germain
et al. 2015, "MADE: Masked Autoencoder for Distribution Estimation", ICML;
:class:`MADE`).

Because ``q(W) = ∫ q(W | z) q(z) dz`` has no closed form, MNF bounds the KL with
an auxiliary inverse model ``r(z | W)`` (MNF eqs. 7–10); the KL of a layer gains
``log q(z_K) − log r(z_K | W)``. With the layer's weight posterior moments as
(D, O) matrices — mean ``M`` and variance ``V`` — and learnable vectors ``c``,
``b1``, ``b2`` of size D, LBBNN-FLOW evaluates it with a local-reparameterisation
sample (:meth:`MultiplicativeFlow.log_r`)::

    a_pre ~ N(cᵀM, (c²)ᵀV),  a = hardtanh(a_pre)                  (shape (O,))
    mean_r = b1 · mean(a),   log_var_r = b2 · mean(a)              (shape (D,))
    z_b, log_det_r = r_flow(z_K)       (a second IAF of the same length)
    log r(z_K | W) = log N(z_b; mean_r, diag exp(log_var_r)) + log_det_r.

Both Gaussian log densities include the constant −½ log(2π).

Initialisation (chosen so that the flows start close to the identity):

* MADE hidden layers: PyTorch's default ``nn.Linear`` initialisation.
* IAF output layer: weights ~ N(0, ``OUTPUT_WEIGHT_STD``² = 0.01²), shift bias
  ``shift_init`` (0 for r(z | W); ``init_mean`` for q(z)), gate bias
  ``GATE_BIAS_INIT`` = 2, so that at the start every gate is sigmoid(2) ≈ 0.88
  and ``z' ≈ 0.88 z + 0.12 shift_init`` (log|det| ≈ −0.127 per dimension and
  step). A gate of exactly 1 (the exact identity) would give zero gradient to
  the shift; 0.88 keeps the flow trainable from the first step. q's shift bias
  ``init_mean`` makes ``q_flow(mu0) ≈ mu0`` (each step maps the constant vector
  ``init_mean`` to itself up to the small output weights, issue 32): the
  multiplicative z starts at 1, as without flows, instead of 0.88² ≈ 0.78 after
  two steps with a zero shift bias.
* ``mu0`` = ``init_mean`` exactly (default 1: ``z`` starts as a multiplicative
  factor ≈ 1, as in MNF); the weight means of the layer and the MADE weights
  already break the symmetry between units. ``log_var0`` = ``init_log_var``
  (default −9, a near-deterministic start).
* ``c``, ``b1``, ``b2`` ~ N(0, 1) as in MNF's reference code.

All random initialisation uses the global torch RNG; the MADE masks are a
deterministic function of ``seed`` (numpy ``RandomState``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bayeswrap.core.checks import check_float, check_int

__all__ = ["MADE", "IAFStep", "IAF", "MultiplicativeFlow", "GATE_BIAS_INIT", "OUTPUT_WEIGHT_STD"]

#: initial bias of the gate pre-activation ``s`` of every IAF step: sigmoid(2) ≈ 0.88
GATE_BIAS_INIT = 2.0
#: standard deviation of the initial weights of each IAF step's MADE output layer
OUTPUT_WEIGHT_STD = 0.01

_LOG_2PI = math.log(2.0 * math.pi)
_MAX_SEED = 2 ** 32 - 1


def _check_hidden_sizes(hidden_sizes) -> tuple[int, ...]:
    """``hidden_sizes`` as a tuple of positive ints (an empty sequence means no hidden layer)."""
    if isinstance(hidden_sizes, (str, bytes)) or not isinstance(hidden_sizes, Sequence):
        raise ValueError(f"hidden_sizes={hidden_sizes!r} must be a sequence of integers >= 1")
    return tuple(check_int(f"hidden_sizes[{i}]", h, minimum=1) for i, h in enumerate(hidden_sizes))


class _MaskedLinear(nn.Linear):
    """``nn.Linear`` whose weight is multiplied by a fixed 0/1 mask (a buffer) in every forward."""

    def __init__(self, in_features: int, out_features: int, mask: np.ndarray):
        super().__init__(in_features, out_features)
        self.register_buffer("mask", torch.as_tensor(mask, dtype=self.weight.dtype))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight * self.mask.to(self.weight.dtype), self.bias)


class MADE(nn.Module):
    """Masked autoencoder for distribution estimation (Germain et al. 2015).

    A masked MLP ``dim → hidden_sizes → out_multiplier·dim`` with LeakyReLU
    between layers. With the natural ordering, output ``i`` of every block
    depends only on inputs ``j < i`` (0-based), so each block of outputs is
    autoregressive and its Jacobian w.r.t. the input is strictly lower
    triangular.

    Degrees (Germain et al. 2015, §4): input ``j`` has degree ``j + 1``; the
    units of each hidden layer draw degrees uniformly from
    ``[min degree of the previous layer, dim − 1]`` with
    ``numpy.random.RandomState(seed)``; output ``i`` of each block has degree
    ``i + 1``. A hidden unit of degree ``m`` sees the previous-layer units of
    degree ``≤ m``; an output of degree ``d`` sees the last hidden units of
    degree ``< d`` (MADE eqs. 12–13). For ``dim == 1`` the hidden degrees are 1
    and the outputs are constants (their biases).

    Args:
        dim: D, the number of inputs.
        hidden_sizes: widths of the hidden layers (``()``: a single masked linear layer).
        out_multiplier: number of output blocks of size D.
        seed: seed of the degree assignment (masks are deterministic given it).

    Shapes:
        ``forward``: ``z`` (..., D) → (..., out_multiplier·D); block ``k`` is
        ``out[..., k·D:(k+1)·D]``.
    """

    def __init__(self, dim: int, hidden_sizes: Sequence[int] = (250, 250), out_multiplier: int = 2,
                 seed: int = 0):
        super().__init__()
        self.dim = check_int("dim", dim, minimum=1)
        self.hidden_sizes = _check_hidden_sizes(hidden_sizes)
        self.out_multiplier = check_int("out_multiplier", out_multiplier, minimum=1)
        self.seed = check_int("seed", seed, minimum=0, maximum=_MAX_SEED)
        D = self.dim
        rng = np.random.RandomState(self.seed)
        degrees = [np.arange(1, D + 1)]
        for h in self.hidden_sizes:
            if D == 1:
                degrees.append(np.ones(h, dtype=np.int64))
            else:
                low = min(int(degrees[-1].min()), D - 1)
                degrees.append(rng.randint(low, D, size=h))  # uniform on [low, D − 1]
        out_degrees = np.tile(np.arange(1, D + 1), self.out_multiplier)
        layers = []
        for prev, nxt in zip(degrees[:-1], degrees[1:]):
            mask = (nxt[:, None] >= prev[None, :]).astype(np.float32)  # (out, in)
            layers.append(_MaskedLinear(len(prev), len(nxt), mask))
        mask = (out_degrees[:, None] > degrees[-1][None, :]).astype(np.float32)
        layers.append(_MaskedLinear(len(degrees[-1]), len(out_degrees), mask))
        self.layers = nn.ModuleList(layers)
        self.activation = nn.LeakyReLU()

    def forward(self, z: Tensor) -> Tensor:
        """Applies the masked MLP.

        Args:
            z: (..., D).

        Returns:
            (..., out_multiplier·D); output ``k·D + i`` depends only on ``z[..., :i]``.
        """
        h = z
        for layer in self.layers[:-1]:
            h = self.activation(layer(h))
        return self.layers[-1](h)


class IAFStep(nn.Module):
    """One gated inverse autoregressive flow step (Kingma et al. 2016, eqs. 11–14).

    ``(shift, s) = MADE(z)``, ``gate = sigmoid(s)``,
    ``z' = gate ⊙ z + (1 − gate) ⊙ shift``. Since ``shift_i`` and ``s_i`` depend
    only on ``z_{<i}``, the Jacobian ``∂z'/∂z`` is lower triangular with diagonal
    ``gate``, so ``log|det ∂z'/∂z| = Σ_i log sigmoid(s_i)`` (computed with
    ``logsigmoid`` for stability).

    Initialisation: output-layer weights ~ N(0, 0.01²), shift bias ``shift_init``,
    gate bias ``GATE_BIAS_INIT`` = 2 (gate ≈ 0.88, a near-identity start; with zero
    output weights the step maps the constant vector ``shift_init`` to itself exactly).

    Args:
        dim: D.
        hidden_sizes: MADE hidden widths.
        seed: MADE mask seed.
        shift_init: initial bias of the shift outputs (a finite number; default 0).

    Shapes:
        ``forward``: ``z`` (..., D) → ``z'`` (..., D), ``log_det`` (...).
    """

    def __init__(self, dim: int, hidden_sizes: Sequence[int] = (250, 250), seed: int = 0, shift_init: float = 0.0):
        super().__init__()
        shift_init = check_float("shift_init", shift_init)
        self.made = MADE(dim, hidden_sizes, out_multiplier=2, seed=seed)
        self.dim = self.made.dim
        out = self.made.layers[-1]
        with torch.no_grad():
            nn.init.normal_(out.weight, mean=0.0, std=OUTPUT_WEIGHT_STD)
            out.bias[:self.dim] = shift_init
            out.bias[self.dim:] = GATE_BIAS_INIT

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Applies the step.

        Args:
            z: (..., D).

        Returns:
            ``(z_new, log_det)``: (..., D) and (...), ``log_det = log|det ∂z_new/∂z|``.
        """
        out = self.made(z)
        shift, s = out[..., :self.dim], out[..., self.dim:]
        gate = torch.sigmoid(s)
        z_new = gate * z + (1.0 - gate) * shift
        return z_new, F.logsigmoid(s).sum(-1)


class IAF(nn.Module):
    """A stack of ``flow_length`` :class:`IAFStep` s with the order reversed between steps.

    Before every step but the first the vector is reversed (``flip``), so that
    across steps every dimension can depend on every other; after the last
    step the original order is restored (if the number of reversals is odd),
    so that ``z_K[i]`` belongs to the same unit as ``z_0[i]``. Reversals are
    permutations (|det| = 1), so the log-determinant is the sum over the steps.
    Step ``k`` uses MADE seed ``(seed + k) mod 2³²``.

    Args:
        dim: D.
        flow_length: K ≥ 0; K = 0 is the identity with log_det 0.
        hidden_sizes: MADE hidden widths.
        seed: base MADE mask seed.
        shift_init: every step's initial shift bias (:class:`IAFStep`).

    Raises:
        ValueError: if ``flow_length`` is negative or not an integer (naming the value).

    Shapes:
        ``forward``: ``z`` (..., D) → ``z_K`` (..., D), ``log_det`` (...).
    """

    def __init__(self, dim: int, flow_length: int, hidden_sizes: Sequence[int] = (250, 250), seed: int = 0,
                 shift_init: float = 0.0):
        super().__init__()
        self.dim = check_int("dim", dim, minimum=1)
        self.flow_length = check_int("flow_length", flow_length, minimum=0)
        seed = check_int("seed", seed, minimum=0, maximum=_MAX_SEED)
        self.steps = nn.ModuleList(
            IAFStep(self.dim, hidden_sizes, seed=(seed + k) % (_MAX_SEED + 1), shift_init=shift_init)
            for k in range(self.flow_length))

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Applies the K steps.

        Args:
            z: (..., D).

        Returns:
            ``(z_K, log_det)``: (..., D) and (...), the total ``Σ_k log|det ∂f_k|``.
        """
        log_det = z.new_zeros(z.shape[:-1])
        for k, step in enumerate(self.steps):
            if k > 0:
                z = z.flip(-1)
            z, ld = step(z)
            log_det = log_det + ld
        if self.flow_length > 1 and (self.flow_length - 1) % 2 == 1:
            z = z.flip(-1)
        return z, log_det


class MultiplicativeFlow(nn.Module):
    """q(z): z_0 ~ N(mu0, diag exp(log_var0)), z_K = IAF(z_0); and the auxiliary inverse model r(z_K | W).

    MNF (Louizos & Welling 2017) eqs. 4–5 for q and eqs. 9–10 for r, with the
    local-reparameterisation and hardtanh form of LBBNN-FLOW (Skaaret-Lund et
    al. 2023). The layer's KL gains ``log_q − log_r`` (MNF eq. 8).

    Parameters: ``mu0`` (D,) initialised to ``init_mean`` exactly; ``log_var0``
    (D,) to ``init_log_var``; ``q_flow`` (:class:`IAF`, mask seed ``seed``, shift bias ``init_mean``, so that
    ``q_flow(mu0) ≈ mu0`` at the start);
    ``c``, ``b1``, ``b2`` (D,) ~ N(0, 1) as in MNF; ``r_flow`` (:class:`IAF` of the
    same length, mask seed ``seed + flow_length``, so its masks differ from
    ``q_flow``'s).

    Args:
        dim: D, the size of z (``in_features`` of a linear layer, ``out_channels`` of a convolution).
        flow_length: K ≥ 0, the number of IAF steps of each flow.
        hidden_sizes: MADE hidden widths (the reference code uses (250, 250)).
        init_mean: initial ``mu0``.
        init_log_var: initial ``log_var0``.
        seed: MADE mask seed.
    """

    def __init__(self, dim: int, flow_length: int, hidden_sizes: Sequence[int] = (250, 250),
                 init_mean: float = 1.0, init_log_var: float = -9.0, seed: int = 0):
        super().__init__()
        self.dim = check_int("dim", dim, minimum=1)
        self.flow_length = check_int("flow_length", flow_length, minimum=0)
        seed = check_int("seed", seed, minimum=0, maximum=_MAX_SEED)
        init_mean = check_float("init_mean", init_mean)
        init_log_var = check_float("init_log_var", init_log_var)
        D = self.dim
        self.mu0 = nn.Parameter(torch.full((D,), init_mean))
        self.log_var0 = nn.Parameter(torch.full((D,), init_log_var))
        self.q_flow = IAF(D, self.flow_length, hidden_sizes, seed=seed, shift_init=init_mean)
        self.c = nn.Parameter(torch.randn(D))
        self.b1 = nn.Parameter(torch.randn(D))
        self.b2 = nn.Parameter(torch.randn(D))
        self.r_flow = IAF(D, self.flow_length, hidden_sizes, seed=(seed + self.flow_length) % (_MAX_SEED + 1))

    def sample(self, num_samples: int | None = None, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Draws z_K ~ q(z) with the reparameterisation trick (``generator``, by default the global torch RNG).

        With ``num_samples`` = S the S draws go through the flow as one batch:
        ``z_K`` has shape (S, D) and ``log_q`` shape (S,).

        ``z_0 = mu0 + exp(log_var0 / 2) ⊙ ε`` with ``ε = torch.randn(D)``,
        ``z_K, log_det = q_flow(z_0)`` and
        ``log q(z_K) = Σ_i [−½ log(2π) − ½ log_var0_i − ½ ε_i²] − log_det``
        (``log q_0(z_0)`` written with ε, which is the same value).

        Returns:
            ``(z_K, log_q)``: (D,) and a scalar, both differentiable w.r.t. all q parameters.
        """
        shape = (self.dim,) if num_samples is None else (num_samples, self.dim)
        eps = torch.randn(shape, generator=generator, dtype=self.mu0.dtype, device=self.mu0.device)
        z0 = self.mu0 + torch.exp(0.5 * self.log_var0) * eps
        z, log_det = self.q_flow(z0)
        log_q0 = -0.5 * (_LOG_2PI + self.log_var0 + eps * eps).sum(-1)
        return z, log_q0 - log_det

    def log_r(self, z: Tensor, m_mean: Tensor, m_var: Tensor) -> Tensor:
        """Log r(z | W), the auxiliary inverse model (MNF eqs. 9–10, LBBNN-FLOW form).

        ``a_pre = cᵀM + sqrt((c²)ᵀV) ⊙ ε`` with ``ε = torch.randn(O)`` (a fresh
        local-reparameterisation sample), ``a = hardtanh(a_pre)``,
        ``mean_r = b1 · mean(a)``, ``log_var_r = b2 · mean(a)``,
        ``z_b, log_det_r = r_flow(z)`` and
        ``log r = Σ_i log N(z_b,i; mean_r,i, exp(log_var_r,i)) + log_det_r``.

        Args:
            z: (D,), typically ``z_K`` from :meth:`sample`.
            m_mean: (D, O), the weight posterior means arranged with z's dimension first
                (Linear: ``W_mean.T``; Conv2d: ``W_mean.reshape(out, -1)``).
            m_var: (D, O), the matching weight posterior variances (≥ 0).

        Returns:
            A scalar, differentiable w.r.t. ``c``, ``b1``, ``b2``, ``r_flow``, ``z``, ``m_mean`` and ``m_var``.

        Raises:
            ValueError: on shapes other than the above.
        """
        D = self.dim
        if z.shape != (D,):
            raise ValueError(f"z must have shape ({D},), got {tuple(z.shape)}")
        if m_mean.dim() != 2 or m_mean.shape[0] != D or m_mean.shape[1] < 1:
            raise ValueError(f"m_mean must have shape ({D}, O) with O >= 1, got {tuple(m_mean.shape)}")
        if m_var.shape != m_mean.shape:
            raise ValueError(f"m_var must have the shape of m_mean {tuple(m_mean.shape)}, got {tuple(m_var.shape)}")
        a_mean = self.c @ m_mean                      # (O,)
        a_var = (self.c * self.c) @ m_var             # (O,)
        eps = torch.randn(m_mean.shape[1], dtype=a_mean.dtype, device=a_mean.device)
        a_std = torch.sqrt(a_var.clamp_min(torch.finfo(a_var.dtype).tiny))  # finite gradient where c²ᵀV = 0
        a = F.hardtanh(a_mean + a_std * eps).mean()   # scalar: the mean over the O outputs
        mean_r = self.b1 * a                          # (D,)
        log_var_r = self.b2 * a                       # (D,)
        z_b, log_det_r = self.r_flow(z)
        log_n = -0.5 * (_LOG_2PI + log_var_r + (z_b - mean_r) ** 2 * torch.exp(-log_var_r)).sum()
        return log_n + log_det_r
