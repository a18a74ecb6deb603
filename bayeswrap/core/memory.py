"""Memory budgets: how many bytes an operation may allocate, and the error that refuses one before it starts.

An operation that can run out of memory (a Laplace curvature fit, its GLM predictive, sampled predictives)
estimates its peak before allocating and compares it with a budget (``memory_budget=``):

* ``None`` (the default): the device's free memory at the time of the check, :func:`default_budget`
  (CUDA: ``torch.cuda.mem_get_info``; CPU: ``psutil.virtual_memory().available`` when psutil is installed, else
  ``MemAvailable`` of ``/proc/meminfo``; unknown: no limit);
* a number of bytes (an ``int`` ≥ 1), or a string with a unit: ``"2GiB"``, ``"500MB"``, ``"1.5 GB"``, ``"4096"``
  (decimal units kB/KB, MB, GB, TB are powers of 1000; binary KiB, MiB, GiB, TiB powers of 1024; ``B`` or no unit:
  bytes), :func:`parse_budget`.

What does not fit is refused with a :class:`MemoryBudgetError` naming the estimate, the budget and the settings
that would fit. :class:`PeakTracker` measures what an operation allocates as tensor storage (exact, on any device,
unlike the process's resident size), for tests and benchmarks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
ACCEPTED_BUDGETS = ("None (the device's free memory)", "a number of bytes >= 1",
                    "a string such as '2GiB', '500MB', '1.5 GB' (units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")


class MemoryBudgetError(MemoryError):
    """An operation's estimated peak memory exceeds its budget; raised before anything large is allocated.

    A subclass of :class:`MemoryError` (as ``torch.OutOfMemoryError`` is a ``RuntimeError``, this one is not: it
    is raised by an estimate, not by an allocator), so ``except MemoryError`` catches both an estimate's refusal and
    Python's own out-of-memory error.

    Attributes:
        estimate: the estimated peak, bytes.
        budget: the budget, bytes.
        fits: the alternatives whose estimate fits, ``{setting: bytes}`` (may be empty).
    """

    def __init__(self, what: str, estimate: int, budget: int, fits: dict[str, int] | None = None,
                 parts: dict[str, int] | None = None):
        self.estimate, self.budget, self.fits = int(estimate), int(budget), dict(fits or {})
        detail = ""
        if parts:
            detail = " (" + ", ".join(f"{k}: {format_bytes(v)}" for k, v in parts.items() if v) + ")"
        if self.fits:
            alternatives = "; these fit: " + ", ".join(f"{k} ({format_bytes(v)})" for k, v in self.fits.items())
        else:
            alternatives = "; no alternative fits either: raise memory_budget, or use smaller batches or a subset " \
                           "of the parameters"
        super().__init__(f"{what} needs an estimated {format_bytes(self.estimate)}{detail}, over the memory budget "
                         f"of {format_bytes(self.budget)}; nothing was allocated{alternatives}")


def format_bytes(count: float) -> str:
    """``count`` bytes in binary units, e.g. ``"1.50 GiB"`` (``"inf"`` for an unlimited budget)."""
    if math.isinf(count):
        return "inf"
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"


def parse_budget(value) -> int | None:
    """Checks a ``memory_budget`` and returns it in bytes (``None`` stays ``None``: the device's free memory).

    Args:
        value: ``None``, an ``int`` ≥ 1 (bytes), or a string: a number and an optional unit (``"2GiB"``,
            ``"500MB"``, ``"1.5 GB"``, ``"4096"``; decimal kB/MB/GB/TB, binary KiB/MiB/GiB/TiB, case-insensitive).

    Returns:
        The budget in bytes, or ``None``.

    Raises:
        ValueError: on anything else (a bool, a float, a negative or zero size, an unknown unit, an unparsable
            string), naming the value and the accepted forms.
    """
    if value is None:
        return None
    bad = ValueError(f"memory_budget={value!r} is not a memory size; accepted: " + "; ".join(ACCEPTED_BUDGETS))
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int):
        if value < 1:
            raise bad
        return value
    if not isinstance(value, str):
        raise bad
    match = _BUDGET.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise bad
    count = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(count) or count < 1:
        raise bad
    return int(count)


def free_memory(device: torch.device | str | None = None) -> int | None:
    """The free memory of ``device`` in bytes, or ``None`` where unknown.

    CUDA: ``torch.cuda.mem_get_info`` (free bytes on the device, including what other processes leave); the CPU:
    ``psutil.virtual_memory().available`` if psutil is installed, else ``MemAvailable`` from ``/proc/meminfo``
    (Linux); other devices (MPS, XPU, meta): ``None``.
    """
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB (KiB)
    except OSError:
        return None
    return None


def default_budget(device: torch.device | str | None = None) -> float:
    """The budget of ``memory_budget=None``: the device's free memory (:func:`free_memory`), bytes; ``inf`` where
    unknown (nothing is refused).
    """
    free = free_memory(device)
    return math.inf if free is None else float(free)


def resolve_budget(budget: int | None, device: torch.device | str | None = None) -> float:
    """A parsed budget (:func:`parse_budget`) in bytes, ``None`` read as :func:`default_budget` now."""
    return default_budget(device) if budget is None else float(budget)


def check_budget(what: str, estimate: int, budget: float, fits: dict[str, int] | None = None,
                 parts: dict[str, int] | None = None) -> None:
    """Raises :class:`MemoryBudgetError` if ``estimate`` > ``budget`` (bytes); ``fits`` lists the alternatives
    (``{setting: estimate}``, only those within the budget are named), ``parts`` the estimate's terms.
    """
    if estimate > budget:
        raise MemoryBudgetError(what, estimate, budget, {k: v for k, v in (fits or {}).items() if v <= budget},
                                parts)


def largest_fitting(candidates: Iterable[int], estimate, budget: float) -> int | None:
    """The first of ``candidates`` (e.g. chunk sizes, largest first) whose ``estimate(c)`` ≤ ``budget``, or None."""
    for c in candidates:
        if estimate(c) <= budget:
            return c
    return None


def halvings(start: int) -> list[int]:
    """``start, start // 2, ..., 1``: the chunk sizes tried when a default chunk is sized to a budget."""
    out = [max(1, int(start))]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


class PeakTracker(TorchDispatchMode):
    """Measures the tensor storage allocated inside a ``with`` block: the bytes live now and at the peak.

    Every operation dispatched inside the block (autograd's backward, ``vmap``'s batched kernels and
    ``torch.func`` transforms included) is seen by this dispatch mode; each output whose storage is new (not alive
    before, and not the storage of one of the operation's inputs: views and in-place results are not counted) is
    counted with its ``nbytes`` until that storage is freed (checked through a weak reference to the
    storage, so views and autograd's saved tensors keep it counted). The peak is the largest sum of the storages
    allocated in the block and alive at the same time, in bytes: exact and deterministic (no allocator caching,
    no resident-set noise), excluding what existed before the block and a kernel's internal scratch space.
    Tensors without a storage of their own at this level (forward-mode AD's dual wrappers) are skipped: under
    ``torch.func.jvp`` the count misses the tangents.

    Attributes:
        peak: the peak, bytes.
        current: bytes allocated in the block and still alive (up to date after the block ends).
    """

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]

    def __exit__(self, *args):
        out = super().__exit__(*args)
        self._sweep()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()  # an output on an input's storage (a view, an in-place result) is no new allocation
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                try:
                    inputs.add(t.untyped_storage().data_ptr())
                except (RuntimeError, NotImplementedError):
                    pass
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                storage = t.untyped_storage()
                size = storage.nbytes()
                key = storage.data_ptr() if size else 0
            except (RuntimeError, NotImplementedError):  # a wrapper without its own storage (forward-mode duals)
                continue
            if size == 0 or (key in inputs and key not in self._live):
                continue
            old = self._live.get(key)
            if old is not None:
                if not old[0].expired() and old[0].cdata == storage._cdata:
                    continue  # a view of (or the same) storage as before
                self.current -= old[1]  # freed, and its address reused
                del self._live[key]
            if self.current + size > self.peak:  # frees only matter when they could lower a new peak
                self._sweep()
            self._live[key] = (StorageWeakRef(storage), size)
            self.current += size
            self.peak = max(self.peak, self.current)
        return out
