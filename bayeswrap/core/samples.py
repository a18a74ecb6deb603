"""Memory-bounded stores of posterior draws and running moments, shared by every sample-based method.

SGLD keeps its thinned iterates here, and a full-batch MCMC sampler (MH, HMC)
is meant to put its draws here too: the store knows nothing about how a draw
was made. It holds at most ``max_samples`` draws ``{name: tensor}`` of the
Bayesian parameters, on a chosen device (the CPU by default, so that a long
chain never takes accelerator memory) and in a chosen dtype, and it is a
``nn.Module`` whose draws are buffers, so ``state_dict()`` checkpoints keep them
and ``torch.load(..., weights_only=True)`` reads them back.

When the store is full it **thins itself by two**: every second stored draw is
dropped and the keep interval doubles. Draws are offered one at a time with
:meth:`SampleStore.offer`; with offers numbered 0, 1, 2, ... the store always
holds exactly the offers

    0, k, 2k, 3k, ...   (up to the latest offer),   k = ``stride`` = 2^(number of thinnings),

so the kept draws stay evenly spaced over the *whole* chain, from its first
offered draw to its last, and at least ``ceil(max_samples / 2)`` of them are
held once the store has filled. Memory stays below ``max_samples`` draws at all
times (a full ring buffer would instead forget the start of the chain, and a
reservoir would space the draws randomly). This is the "thinning by doubling"
used by MCMC packages for bounded traces.

Two more pieces serve methods that summarise a trajectory instead of (or
besides) keeping it: :func:`welford_update_` folds one iterate into running
first and second moments (SGLD's Gaussian predictive, SWAG's θ_SWA and
diagonal variance), and :class:`RingStore` keeps the last ``capacity`` of a
stream of tensors (SWAG's deviation matrix).

Example:
    >>> store = SampleStore({"w": torch.zeros(3)}, max_samples=5)
    >>> for i in range(9):
    ...     _ = store.offer({"w": torch.full((3,), float(i))})
    >>> store.positions().tolist(), store.stride      # offers kept, keep interval
    ([0, 2, 4, 6, 8], 2)
    >>> store.select(2)["w"][:, 0].tolist()           # evenly spaced over the chain
    [2.0, 6.0]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from bayeswrap.core.checks import check_int

__all__ = ["RingStore", "SampleStore", "spread_indices", "welford_update_", "welford_variance"]


def _mangle(name: str) -> str:
    # buffer names may not contain "."; "/" never occurs in module paths (as in bayeswrap.core.functional)
    return name.replace(".", "/")


def _resize_rows_for_load(store: nn.Module, state_dict, prefix: str, capacity: int, what: str, limit: str,
                          error_msgs: list[str]) -> bool:
    """Resizes a store's row buffers to the rows a checkpoint holds (before ``nn.Module`` copies them in).

    Args:
        store: a module with ``names``, ``shapes`` and one (rows, *shape) buffer per name.
        capacity: the most rows the store may hold.
        what, limit: words for the error message (e.g. ``"draws"``, ``"max_samples"``).
        error_msgs: ``_load_from_state_dict``'s error list.

    Returns:
        False (with a message appended) if the checkpoint holds more rows than ``capacity``.
    """
    for n in store.names:
        incoming = state_dict.get(prefix + _mangle(n))
        if isinstance(incoming, torch.Tensor) and incoming.ndim >= 1 and tuple(incoming.shape[1:]) == store.shapes[n]:
            if incoming.shape[0] > capacity:
                error_msgs.append(f"{prefix}{_mangle(n)} holds {incoming.shape[0]} {what}, more than "
                                  f"{limit}={capacity}")
                return False
            old = store._buffers[_mangle(n)]
            store._buffers[_mangle(n)] = torch.empty(incoming.shape, dtype=old.dtype, device=old.device)
    return True


def spread_indices(num_samples: int, count: int) -> torch.Tensor:
    """Which of ``count`` stored draws to use for ``num_samples`` posterior samples.

    * ``num_samples <= count``: evenly spaced, centred strata,
      ``i_s = floor((s + 1/2) · count / num_samples)`` for s = 0..S−1, so S = count
      gives every draw once and S = 1 gives the middle draw of the chain. The
      indices are distinct and increasing.
    * ``num_samples > count``: the draws are cycled, ``i_s = s mod count``. When S is
      a multiple of ``count`` every draw gets the same weight; otherwise the first
      ``S mod count`` draws are used once more than the others.

    Args:
        num_samples: S ≥ 1.
        count: number of stored draws (≥ 1).

    Returns:
        int64 tensor of shape (S,), on the CPU, with values in [0, count).

    Raises:
        ValueError: if ``num_samples`` or ``count`` is not an integer >= 1.
    """
    num_samples = check_int("num_samples", num_samples, minimum=1)
    count = check_int("count", count, minimum=1, note="stored draws")
    if num_samples > count:
        return torch.arange(num_samples) % count
    return (torch.arange(num_samples, dtype=torch.float64) * 2 + 1).mul_(count / (2 * num_samples)).floor_().long()


class SampleStore(nn.Module):
    """Up to ``max_samples`` posterior draws of a set of named tensors (thinned by 2 when full).

    The policy is described in the module docstring: the store holds the offers
    0, k, 2k, ... (k = :attr:`stride`) of the draws offered so far; when a draw
    on that grid arrives and the store is full, every second stored draw is
    dropped and k doubles first.

    Memory: the buffers grow by doubling up to ``max_samples`` rows, so at most
    ``max_samples · Σ numel · itemsize`` bytes (see :attr:`nbytes`). ``state_dict()``
    holds the ``num_stored`` valid rows of each buffer as (num_stored, *shape)
    views (``torch.save`` writes their allocated storage, at most
    ``max_samples`` rows), plus the counters in an ``_extra_state`` dict of ints;
    ``load_state_dict`` resizes the buffers to what it loads, so a freshly built
    store reads any checkpoint of the same parameter names and shapes.

    Device and dtype: with ``device`` (``dtype``) given, ``.to()``, ``.cuda()``,
    ``.double()`` ... of an enclosing module leave the store's device (dtype)
    alone, e.g. draws stay on the CPU while the model moves to the GPU; with
    ``None`` they follow the module like any buffer. :meth:`draws` converts the
    draws to the compute device and dtype on the way out.

    Args:
        template: ``{name: tensor}`` giving the names, shapes and (with
            ``dtype=None``) dtype of a draw, e.g. the Bayesian parameters.
        max_samples: most draws held at once (integer ≥ 1).
        dtype: storage dtype, e.g. ``torch.bfloat16`` or ``torch.float16`` to halve
            the memory of float32 draws (the draws are rounded when stored);
            ``None`` keeps the template's dtype and follows module casts.
        device: storage device (default ``"cpu"``); ``None`` follows the
            enclosing module's ``.to(device)``.

    Attributes:
        max_samples: the capacity.
        num_stored: draws held now (also ``len(store)``).
        num_offered: draws offered so far (kept or not).
        stride: keep interval k, in offers (1 until the first thinning).

    Raises:
        ValueError: for ``max_samples`` < 1 or not an integer, an empty template, or a
            non-floating ``dtype``.
    """

    def __init__(self, template: Mapping[str, torch.Tensor], max_samples: int = 100, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = "cpu"):
        super().__init__()
        max_samples = check_int("max_samples", max_samples, minimum=1)
        if not template:
            raise ValueError("a SampleStore needs at least one named tensor in its template")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype={dtype!r} must be a floating torch.dtype (e.g. torch.float32, torch.bfloat16) "
                             "or None")
        self.max_samples = max_samples
        self.fixed_dtype = dtype
        self.fixed_device = None if device is None else torch.device(device)
        self.names = list(template)
        self.shapes = {n: tuple(t.shape) for n, t in template.items()}
        self.num_stored = 0
        self.num_offered = 0
        self.stride = 1
        for n, t in template.items():
            self.register_buffer(_mangle(n), torch.empty((0, *t.shape), dtype=dtype or t.dtype,
                                                         device=self.fixed_device or t.device))

    # ------------------------------------------------------------------ adding draws
    def __len__(self) -> int:
        return self.num_stored

    def _buffer(self, name: str) -> torch.Tensor:
        return self._buffers[_mangle(name)]

    @torch.no_grad()
    def offer(self, draw: Mapping[str, torch.Tensor]) -> bool:
        """Offers the next draw of the chain; stores a copy if it is on the keep grid.

        Args:
            draw: ``{name: tensor}`` with every name of the template, each of the
                template's shape (any device and floating dtype; it is copied and
                converted, never referenced).

        Returns:
            Whether the draw was stored.

        Raises:
            KeyError: if a name of the template is missing.
            ValueError: if a tensor has the wrong shape.
        """
        for n in self.names:
            if tuple(draw[n].shape) != self.shapes[n]:
                raise ValueError(f"draw[{n!r}] has shape {tuple(draw[n].shape)}, the store expects {self.shapes[n]}")
        index = self.num_offered
        self.num_offered += 1
        if index % self.stride:
            return False
        if self.num_stored == self.max_samples:
            self._thin()
            if index % self.stride:
                return False
        row = self.num_stored
        self._reserve(row + 1)
        for n in self.names:
            self._buffer(n)[row].copy_(draw[n].detach())
        self.num_stored = row + 1
        return True

    def _reserve(self, rows: int) -> None:
        """Grows the buffers (capacity doubling, capped at ``max_samples``) to hold ``rows`` draws."""
        capacity = self._buffer(self.names[0]).shape[0]
        if rows <= capacity:
            return
        new = min(self.max_samples, max(rows, 2 * capacity, 1))
        for n in self.names:
            old = self._buffer(n)
            grown = torch.empty((new, *self.shapes[n]), dtype=old.dtype, device=old.device)
            grown[:self.num_stored].copy_(old[:self.num_stored])
            self._buffers[_mangle(n)] = grown

    def _thin(self) -> None:
        """Keeps stored draws 0, 2, 4, ... in place and doubles the keep interval."""
        kept = (self.num_stored + 1) // 2
        for n in self.names:
            buf = self._buffer(n)
            for i in range(1, kept):  # row 2i is read before it is overwritten (2i > i)
                buf[i].copy_(buf[2 * i])
        self.num_stored = kept
        self.stride *= 2

    def clear(self) -> None:
        """Forgets every draw and resets the counters (the allocated memory is kept)."""
        self.num_stored = self.num_offered = 0
        self.stride = 1

    # ------------------------------------------------------------------ reading draws
    def positions(self) -> torch.Tensor:
        """The offer number (0-based) of each stored draw, int64 of shape (num_stored,): ``arange · stride``."""
        return torch.arange(self.num_stored) * self.stride

    @property
    def nbytes(self) -> int:
        """Bytes allocated for draws now (≤ ``max_samples`` rows per tensor)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def indices(self, num_samples: int) -> torch.Tensor:
        """Stored-draw indices for S posterior samples: evenly spaced, cycled if S > num_stored.

        See :func:`spread_indices`. Returns int64 of shape (S,) on the CPU.

        Raises:
            ValueError: if the store is empty or ``num_samples`` < 1.
        """
        if self.num_stored == 0:
            raise ValueError("the sample store is empty: no draw has been stored yet")
        return spread_indices(num_samples, self.num_stored)

    def draws(self, indices: torch.Tensor | Sequence[int], device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The stored draws at ``indices``, stacked.

        Args:
            indices: S indices in [0, num_stored) (int tensor or sequence; repeats allowed).
            device: where to put the result (the compute device); ``None`` keeps the store's.
            dtype: result dtype (e.g. the model's float32); ``None`` keeps the storage dtype.

        Returns:
            ``{name: tensor of shape (S, *shape)}``, fresh tensors (not views of the store).

        Raises:
            IndexError: if an index is outside [0, num_stored).
        """
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_stored):
            raise IndexError(f"draw indices must lie in [0, {self.num_stored}), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        out = {}
        for n in self.names:
            buf = self._buffer(n)
            out[n] = buf.index_select(0, idx.to(buf.device)).to(device=device, dtype=dtype)
        return out

    def select(self, num_samples: int, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``draws(indices(num_samples), device, dtype)``: S draws spread over the chain, {name: (S, *shape)}."""
        return self.draws(self.indices(num_samples), device=device, dtype=dtype)

    def all(self, device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every stored draw in chain order, ``{name: (num_stored, *shape)}`` (copies)."""
        return self.draws(torch.arange(self.num_stored), device=device, dtype=dtype)

    # ------------------------------------------------------------------ devices, dtypes, checkpoints
    def _apply(self, fn, recurse: bool = True):
        """Applies module-wide conversions except those to a fixed device or dtype (see the class docstring)."""
        for key, buf in self._buffers.items():
            probe = fn(torch.empty(0, dtype=buf.dtype, device=buf.device))
            device = self.fixed_device or probe.device
            dtype = self.fixed_dtype or probe.dtype
            if (device, dtype) != (buf.device, buf.dtype):
                self._buffers[key] = buf.to(device=device, dtype=dtype)
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for n in self.names:
            buf = self._buffer(n)[:self.num_stored]
            destination[prefix + _mangle(n)] = buf if keep_vars else buf.detach()
        destination[prefix + "_extra_state"] = self.get_extra_state()

    def get_extra_state(self) -> dict:
        return {"num_stored": self.num_stored, "num_offered": self.num_offered, "stride": self.stride,
                "max_samples": self.max_samples}

    def set_extra_state(self, state) -> None:
        stored = int(state["num_stored"])
        if stored > self.max_samples:
            raise ValueError(f"checkpoint holds {stored} draws but this store's max_samples is {self.max_samples}")
        self.num_stored, self.num_offered, self.stride = stored, int(state["num_offered"]), int(state["stride"])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if _resize_rows_for_load(self, state_dict, prefix, self.max_samples, "draws", "max_samples", error_msgs):
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)

    def extra_repr(self) -> str:
        return (f"{len(self.names)} tensors, num_stored={self.num_stored}/{self.max_samples}, stride={self.stride}, "
                f"dtype={self.fixed_dtype}, device={self.fixed_device}")


# ---------------------------------------------------------------------------------------------- running moments
@torch.no_grad()
def welford_update_(mean: Sequence[torch.Tensor], m2: Sequence[torch.Tensor], value: Sequence[torch.Tensor],
                    count: int) -> list[torch.Tensor]:
    """Folds the ``count``-th value into running means and sums of squared deviations, in place (Welford 1962).

    With δ = x − μ_{n−1}: μ_n = μ_{n−1} + δ / n and M2_n = M2_{n−1} + δ · (x − μ_n), so
    M2_n / n is the population variance of the n values seen (numerically stable, one
    pass, ``torch._foreach`` ops over all tensors at once).

    Args:
        mean: running means μ_{n−1} (updated in place to μ_n).
        m2: running sums of squared deviations M2_{n−1} (updated in place to M2_n).
        value: the new values x, one per tensor of ``mean`` (same shapes, devices and dtypes).
        count: n, the number of values including this one (an integer ≥ 1).

    Returns:
        x − μ_n for every tensor: the deviation of the new value from the *updated* mean
        (SWAG's deviation column, Maddox et al. 2019, Algorithm 1), fresh tensors.
    """
    mean, m2, value = list(mean), list(m2), list(value)
    delta = torch._foreach_sub(value, mean)
    torch._foreach_add_(mean, torch._foreach_div(delta, float(count)))
    deviation = torch._foreach_sub(value, mean)
    torch._foreach_addcmul_(m2, delta, deviation)
    return deviation


def welford_variance(m2: Mapping[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """The population variances M2 / n of :func:`welford_update_`'s accumulators, ``{name: tensor}`` (≥ 0).

    Args:
        m2: ``{name: M2}``.
        count: n ≥ 1, the number of values folded in.
    """
    return {k: (v / float(count)).clamp_min_(0.0) for k, v in m2.items()}


# ---------------------------------------------------------------------------------------------- ring buffer
class RingStore(nn.Module):
    """The last ``capacity`` items of a stream of named tensors (a ring buffer), as checkpointed buffers.

    Item i of the stream (0-based) lives in row ``i mod capacity``; once the
    store is full each new item overwrites the oldest. Rows are allocated at the
    first :meth:`append` (``capacity`` rows per tensor, no memory before), and
    the buffers follow the enclosing module's ``.to()``. ``state_dict()`` holds
    the ``num_stored`` valid rows of each tensor, (num_stored, *shape), in
    storage order, plus the counters in an ``_extra_state`` dict of ints, so
    ``torch.load(..., weights_only=True)`` reads it back and a freshly built store
    loads it (and continues the stream exactly, overwriting the same rows).

    Args:
        template: ``{name: tensor}`` giving the names, shapes, dtypes and devices of an item.
        capacity: most items held (an integer ≥ 1).

    Attributes:
        num_written: items appended so far.
        num_stored: items held now, ``min(num_written, capacity)`` (also ``len(store)``).

    Raises:
        ValueError: for ``capacity`` < 1 or an empty template.
    """

    def __init__(self, template: Mapping[str, torch.Tensor], capacity: int):
        super().__init__()
        self.capacity = check_int("capacity", capacity, minimum=1)
        if not template:
            raise ValueError("a RingStore needs at least one named tensor in its template")
        self.names = list(template)
        self.shapes = {n: tuple(t.shape) for n, t in template.items()}
        self.num_written = 0
        for n, t in template.items():
            self.register_buffer(_mangle(n), torch.empty((0, *t.shape), dtype=t.dtype, device=t.device))

    def __len__(self) -> int:
        return self.num_stored

    @property
    def num_stored(self) -> int:
        return min(self.num_written, self.capacity)

    def _buffer(self, name: str) -> torch.Tensor:
        return self._buffers[_mangle(name)]

    @torch.no_grad()
    def append(self, item: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> None:
        """Writes the next item (a copy), overwriting the oldest one when full.

        Args:
            item: ``{name: tensor}``, or the tensors in template order, each of its template's shape.

        Raises:
            ValueError: if a tensor has the wrong shape.
        """
        tensors = [item[n] for n in self.names] if isinstance(item, Mapping) else list(item)
        for n, t in zip(self.names, tensors, strict=True):
            if tuple(t.shape) != self.shapes[n]:
                raise ValueError(f"item[{n!r}] has shape {tuple(t.shape)}, the store expects {self.shapes[n]}")
        if self._buffer(self.names[0]).shape[0] < self.capacity:
            self._grow()
        row = self.num_written % self.capacity
        for n, t in zip(self.names, tensors):
            self._buffer(n)[row].copy_(t.detach())
        self.num_written += 1

    def _grow(self) -> None:
        for n in self.names:
            old = self._buffer(n)
            grown = torch.zeros((self.capacity, *self.shapes[n]), dtype=old.dtype, device=old.device)
            grown[:old.shape[0]].copy_(old)
            self._buffers[_mangle(n)] = grown

    def stored(self) -> dict[str, torch.Tensor]:
        """The held items in storage order, ``{name: (num_stored, *shape)}`` (views; sums over items ignore order)."""
        return {n: self._buffer(n)[:self.num_stored] for n in self.names}

    def all(self) -> dict[str, torch.Tensor]:
        """The held items oldest first, ``{name: (num_stored, *shape)}`` (copies)."""
        start = self.num_written % self.capacity if self.num_written > self.capacity else 0
        order = (torch.arange(self.num_stored) + start) % max(self.num_stored, 1)
        return {n: t.index_select(0, order.to(t.device)) for n, t in self.stored().items()}

    def clear(self) -> None:
        """Forgets every item (the allocated memory is kept)."""
        self.num_written = 0

    # ------------------------------------------------------------------ checkpoints
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for n, t in self.stored().items():
            destination[prefix + _mangle(n)] = t if keep_vars else t.detach()
        destination[prefix + "_extra_state"] = self.get_extra_state()

    def get_extra_state(self) -> dict:
        return {"num_written": self.num_written, "capacity": self.capacity}

    def set_extra_state(self, state) -> None:
        self.num_written = int(state["num_written"])  # capacity was checked by _load_from_state_dict

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        extra = state_dict.get(prefix + "_extra_state")
        if isinstance(extra, Mapping) and int(extra.get("capacity", self.capacity)) != self.capacity:
            error_msgs.append(f"{prefix}_extra_state: the checkpoint's ring buffer holds the last "
                              f"{extra.get('capacity')} items, this store the last {self.capacity}")
            return
        if _resize_rows_for_load(self, state_dict, prefix, self.capacity, "items", "capacity", error_msgs):
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)

    def extra_repr(self) -> str:
        return f"{len(self.names)} tensors, num_stored={self.num_stored}/{self.capacity}"
