"""Data-parallel training helpers (``torchrun``, ``torch.distributed``): one replica of the model per process.

:func:`bayeswrap.fit` uses these when a process group is initialised with more
than one process; every helper is a no-op (or returns the one-process answer)
otherwise, so the same code runs with and without ``torchrun``.

The semantics:

* **Global batch.** Each rank computes the loss of its own shard of the global
  batch, ``nll_mean_rank + kl_weight · KL / num_data``. After ``backward()`` the
  gradients are summed over ranks weighted by each rank's batch size and divided
  by the global batch size (:func:`all_reduce_gradients_`), so the update is the
  gradient of ``nll_mean_global + kl_weight · KL / num_data``: the KL/prior term
  is counted **once**, not once per rank, and ``num_data`` stays the size of
  the whole training set. With equal per-rank batch sizes (what
  ``DistributedSampler`` gives) this is the plain average of DDP.
* **Identical replicas.** :func:`bayeswrap.fit` broadcasts rank 0's parameters
  and buffers at the start (:func:`broadcast_module_`) and rank 0's random
  state (CPU, the model's CUDA device, and an SGLD optimizer's own generator;
  :func:`sync_random_state_`). Every rank then makes the same random draws in
  the same order: the same VI weight sample, the same Langevin noise (SGLD adds
  it to the parameters, so it *must* be the same on every rank), the same IVON
  perturbation. Per-example draws (dropout masks, local-reparameterisation
  noise) are therefore the same on every rank for the i-th example of each
  rank's shard; they are still independent across the examples of one rank.
* **Collectives per step.** One all-reduce per gradient bucket (about
  ``bucket_cap_mb`` MiB each), after ``backward()``; there is no overlap of
  communication with the backward pass (``DistributedDataParallel`` overlaps
  them, but needs every forward to go through its wrapper and every parameter
  to receive a gradient). The batch size and a "loss was not finite" flag ride
  in the first float32 bucket, so a non-finite loss on one rank stops every
  rank with an error instead of a hang.

* **Collected state.** With identical replicas, SGLD's kept iterates and SWAG's
  moments are the same on every rank. ``after_fit`` runs on every rank over its
  shard: Laplace's curvature sums (diagonal, Kronecker factors, full H, last
  layer), log-likelihood and example count are all-reduced at the end of
  ``fit_curvature`` (:func:`all_reduce_sum_`), so Laplace fitted on N ranks equals
  Laplace fitted on one; SWAG's BatchNorm statistics for θ_SWA are averaged
  (:func:`average_`).

The same pieces serve the other engines: :mod:`bayeswrap.lightning` (a DDP
``Trainer``), :mod:`bayeswrap.accelerate` (a loop of your own under
``accelerate``) and :mod:`bayeswrap.hf` (the Hugging Face Trainer).

Only :mod:`torch.distributed` is used; the process group is the caller's
(``bayeswrap fit`` under ``torchrun`` initialises it with :func:`init_from_env`).

**The rendezvous is bounded.** :func:`init_from_env` first checks ``WORLD_SIZE``,
``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (an error names a
missing or non-integer variable and its value), then logs what it waits for
(address, port, rank, world size, timeout) and waits at most
:data:`RENDEZVOUS_TIMEOUT_S` seconds (5 minutes; the environment variable
:data:`RENDEZVOUS_TIMEOUT_ENV`, ``BAYESWRAP_RENDEZVOUS_TIMEOUT``, sets another
number of seconds) for every process to join; a ``WORLD_SIZE=2`` with no
second process then fails with a ``TimeoutError`` saying what was missing,
instead of waiting for torch's 30-minute default.

**Every collective is bounded, and its failure is named.** A collective waits
at most :func:`collective_timeout` seconds for the other ranks (30 minutes, as
torch's default; ``BAYESWRAP_COLLECTIVE_TIMEOUT`` sets another number of
seconds). When one fails, because another process died (``torchrun`` then also
stops the others), hung past that timeout, or the connection broke, every
helper here raises :class:`CollectiveError`, which names this rank, the
collective and the timeout, instead of torch's backend message alone.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

#: MiB of gradients per all-reduce call (DistributedDataParallel's default bucket size is 25 MiB)
BUCKET_CAP_MB = 25.0

#: seconds :func:`init_from_env` waits for every process of ``WORLD_SIZE`` to join (5 minutes)
RENDEZVOUS_TIMEOUT_S = 300.0
#: environment variable that overrides :data:`RENDEZVOUS_TIMEOUT_S` (seconds, a number > 0)
RENDEZVOUS_TIMEOUT_ENV = "BAYESWRAP_RENDEZVOUS_TIMEOUT"
#: seconds a collective of a group made by :func:`init_from_env` waits for the other ranks (torch's default, 30 min)
COLLECTIVE_TIMEOUT_S = 1800.0
#: environment variable that overrides :data:`COLLECTIVE_TIMEOUT_S` (seconds, a number > 0)
COLLECTIVE_TIMEOUT_ENV = "BAYESWRAP_COLLECTIVE_TIMEOUT"

log = logging.getLogger("bayeswrap")


def is_initialized() -> bool:
    """Whether a ``torch.distributed`` process group is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Number of processes in the default group (1 without one)."""
    return dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if is_initialized() else 0


def is_distributed() -> bool:
    """Whether training here is data-parallel: a process group with more than one process."""
    return world_size() > 1


def is_main_process() -> bool:
    """True on rank 0 (and without a process group): the one process that writes files."""
    return rank() == 0


def _env_int(name: str, default: int | None, minimum: int, maximum: int | None = None, note: str = "") -> int:
    """An integer environment variable (``torchrun`` sets these), ``default`` if unset.

    Raises:
        ValueError: naming the variable and its value, if it is not an integer in range (or unset without a
            default).
    """
    text = os.environ.get(name)
    if text is None or (not text.strip() and default is not None):
        if default is None:
            raise ValueError(f"{name} is not set in the environment; accepted: an integer >= {minimum}"
                             f"{note} (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
        return default
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        accepted = f"an integer in [{minimum}, {maximum}]" if maximum is not None else f"an integer >= {minimum}"
        raise ValueError(f"{name}={text!r} in the environment is not valid; accepted: {accepted}{note} "
                         f"(torchrun sets it)")
    return value


def env_world_size() -> int:
    """``WORLD_SIZE`` from the environment (set by ``torchrun``), 1 if unset.

    Raises:
        ValueError: if ``WORLD_SIZE`` is set but is not an integer >= 1, naming its value.
    """
    return _env_int("WORLD_SIZE", 1, 1)


def env_rank() -> int:
    """``RANK`` from the environment (this process's rank, set by ``torchrun``), 0 if unset.

    Raises:
        ValueError: if ``RANK`` is set but is not an integer in [0, WORLD_SIZE), naming its value.
    """
    world = env_world_size()
    return _env_int("RANK", 0, 0, world - 1, note=f" (below WORLD_SIZE={world})")


def local_rank() -> int:
    """``LOCAL_RANK`` from the environment (the GPU index of this process on its node), 0 if unset.

    Raises:
        ValueError: if ``LOCAL_RANK`` is set but is not an integer >= 0, naming its value.
    """
    return _env_int("LOCAL_RANK", 0, 0)


def _env_seconds(name: str, default: float) -> float:
    """A number of seconds > 0 from the environment variable ``name``, ``default`` if unset or blank.

    Raises:
        ValueError: if the variable is set but is not a finite number > 0, naming its value.
    """
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={text!r} in the environment is not valid; accepted: a number of seconds > 0 "
                         f"(default {default:g})")
    return value


def rendezvous_timeout() -> float:
    """Seconds the rendezvous of :func:`init_from_env` waits: ``BAYESWRAP_RENDEZVOUS_TIMEOUT`` if set, else
    :data:`RENDEZVOUS_TIMEOUT_S`.

    Raises:
        ValueError: if the variable is set but is not a finite number > 0, naming its value.
    """
    return _env_seconds(RENDEZVOUS_TIMEOUT_ENV, RENDEZVOUS_TIMEOUT_S)


def collective_timeout() -> float:
    """Seconds a collective of :func:`init_from_env`'s group waits for the other ranks:
    ``BAYESWRAP_COLLECTIVE_TIMEOUT`` if set, else :data:`COLLECTIVE_TIMEOUT_S`.

    Raises:
        ValueError: if the variable is set but is not a finite number > 0, naming its value.
    """
    return _env_seconds(COLLECTIVE_TIMEOUT_ENV, COLLECTIVE_TIMEOUT_S)


class CollectiveError(RuntimeError):
    """A collective failed: another process died or was killed, hung past the collective timeout, or the
    connection between the processes broke. The message names this rank, the collective and the timeout.
    """


#: the timeout of the group :func:`init_from_env` made (seconds), for the messages; None for a caller's group
_timeout_s: float | None = None


@contextlib.contextmanager
def _collective(what: str):
    """Turns a backend's failure inside the block (a RuntimeError: gloo's "Connection reset by peer" or "Timed
    out waiting", NCCL's watchdog) into a :class:`CollectiveError` naming this rank, ``what`` and the timeout.
    """
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:
        text = str(err).strip()
        first = text.splitlines()[0] if text else type(err).__name__
        waited = (f"the collective timeout is {_timeout_s:g} s ({COLLECTIVE_TIMEOUT_ENV} sets it)"
                  if _timeout_s is not None else "the collective timeout is the process group's")
        raise CollectiveError(f"data-parallel: rank {rank()} of {world_size()} lost the other processes during "
                              f"{what} ({first}); another process died or was killed, hung for longer than the "
                              f"collective timeout, or the connection broke; {waited}") from err


def rendezvous_env() -> dict:
    """The ``torchrun`` environment of a multi-process run, checked before any waiting.

    Returns:
        ``{"world_size", "rank", "local_rank", "master_addr", "master_port"}``.

    Raises:
        ValueError: naming the variable and its value, for a missing or non-integer ``RANK``, ``WORLD_SIZE``
            or ``MASTER_PORT`` (an integer in [1, 65535]), a non-integer ``LOCAL_RANK``, or a missing
            ``MASTER_ADDR``.
    """
    world = env_world_size()
    out = {"world_size": world,
           "rank": _env_int("RANK", None, 0, world - 1, note=f" (below WORLD_SIZE={world})"),
           "local_rank": local_rank(),
           "master_addr": os.environ.get("MASTER_ADDR", "").strip(),
           "master_port": _env_int("MASTER_PORT", None, 1, 65535)}
    if not out["master_addr"]:
        raise ValueError("MASTER_ADDR is not set in the environment; accepted: the host name or address of rank 0 "
                         "(torchrun sets WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
    return out


def init_from_env(device: torch.device | str = "cpu", timeout_minutes: float | None = None,
                  rendezvous_seconds: float | None = None) -> bool:
    """Initialises the default process group from ``torchrun``'s environment when ``WORLD_SIZE`` > 1.

    The backend is ``nccl`` for a CUDA device (the process's CUDA device is set
    to ``cuda:LOCAL_RANK`` first) and ``gloo`` otherwise. ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` come from the environment
    (torch's ``env://`` rendezvous) and are checked first (:func:`rendezvous_env`).
    Before waiting, the address, port, rank, world size and timeout are logged
    (a warning of the ``bayeswrap`` logger, so that a terminal shows it).

    Args:
        device: the device the model trains on.
        timeout_minutes: how long a collective waits for the other ranks; default
            :func:`collective_timeout` (``BAYESWRAP_COLLECTIVE_TIMEOUT`` seconds, else 30 minutes). A
            collective that fails then raises :class:`CollectiveError`.
        rendezvous_seconds: how long to wait for every process to join; default
            :func:`rendezvous_timeout` (``BAYESWRAP_RENDEZVOUS_TIMEOUT``, else 300 s).

    Returns:
        True if this call initialised a group (the caller should
        :func:`destroy` it), False if ``WORLD_SIZE`` is 1 or a group already exists.

    Raises:
        ValueError: for a missing or bad ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
            ``MASTER_ADDR``, ``MASTER_PORT``, ``BAYESWRAP_RENDEZVOUS_TIMEOUT`` or
            ``BAYESWRAP_COLLECTIVE_TIMEOUT`` (naming it and its value), or a CUDA device while CUDA is unavailable.
        TimeoutError: if not every process joined within the rendezvous timeout
            (or rank 0's address cannot be reached or bound), naming what it waited for.
    """
    if env_world_size() == 1 or is_initialized():
        return False
    env = rendezvous_env()
    wait = rendezvous_timeout() if rendezvous_seconds is None else float(rendezvous_seconds)
    if not (math.isfinite(wait) and wait > 0):
        raise ValueError(f"rendezvous_seconds={rendezvous_seconds!r} is not valid; accepted: a number > 0")
    seconds = collective_timeout() if timeout_minutes is None else 60.0 * float(timeout_minutes)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout_minutes={timeout_minutes!r} is not valid; accepted: a number > 0")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} but CUDA is not available; accepted under torchrun: cpu "
                             "(gloo) or cuda (nccl) on a machine with GPUs")
        torch.cuda.set_device(env["local_rank"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    where = (f"rank {env['rank']} of WORLD_SIZE={env['world_size']} at MASTER_ADDR={env['master_addr']} "
             f"MASTER_PORT={env['master_port']}")
    log.warning("data-parallel: %s waiting up to %g s for all %d processes to join (%s sets the timeout in "
                "seconds)", where, wait, env["world_size"], RENDEZVOUS_TIMEOUT_ENV)
    try:
        store, rank_, size = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=wait)))
    except (RuntimeError, OSError) as err:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TimeoutError(f"data-parallel rendezvous failed after at most {wait:g} s: {where} did not find all "
                           f"{env['world_size']} processes ({first}); start every process (torchrun "
                           f"--nproc_per_node={env['world_size']} ...), unset WORLD_SIZE to run in one process, or "
                           f"raise {RENDEZVOUS_TIMEOUT_ENV} (seconds)") from None
    global _timeout_s
    collective = datetime.timedelta(seconds=seconds)
    store.set_timeout(collective)
    dist.init_process_group(backend, store=store, rank=rank_, world_size=size, timeout=collective)
    _timeout_s = seconds
    return True


def destroy() -> None:
    """Destroys the default process group if there is one."""
    global _timeout_s
    _timeout_s = None
    if is_initialized():
        dist.destroy_process_group()


def _collective_device(tensor_device: torch.device) -> torch.device:
    """Where a tensor must be for the default group's backend (NCCL: the current CUDA device)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor_device


def _buckets(tensors: Sequence[torch.Tensor], cap_bytes: float) -> list[list[int]]:
    """Indices of ``tensors`` grouped into buckets of one device and dtype, at most ``cap_bytes`` each."""
    groups: dict[tuple, list[list[int]]] = {}
    sizes: dict[tuple, int] = {}
    for i, t in enumerate(tensors):
        key = (t.device, t.dtype)
        nbytes = t.numel() * t.element_size()
        if key not in groups or (sizes[key] + nbytes > cap_bytes and groups[key][-1]):
            groups.setdefault(key, []).append([])
            sizes[key] = 0
        groups[key][-1].append(i)
        sizes[key] += nbytes
    return [bucket for buckets in groups.values() for bucket in buckets]


def all_reduce_gradients_(params: Iterable[torch.Tensor], batch_size: int, *, loss_finite: bool = True,
                          bucket_cap_mb: float = BUCKET_CAP_MB) -> tuple[int, bool]:
    """Replaces every ``p.grad`` by the batch-size-weighted mean over ranks: Σ_r b_r g_r / Σ_r b_r.

    With ``g_r = ∇(nll_mean_r + kl_weight · KL / num_data)`` on rank r's
    ``b_r`` examples, the result is ``∇(nll_mean_global + kl_weight · KL /
    num_data)``: the gradient of the global batch's loss, with the KL/prior
    term counted once. Equal ``b_r`` give the plain mean.

    Parameters whose ``grad`` is ``None`` are skipped; which parameters have
    gradients must be the same on every rank (it is for every bayeswrap method:
    the code path does not depend on the data). Without a process group (or
    with one process) nothing is communicated.

    Args:
        params: the parameters whose gradients to reduce, in the same order on every rank.
        batch_size: b_r, the examples of this rank's batch (an integer >= 1).
        loss_finite: whether this rank's loss was finite; any rank's False makes
            the returned flag False on every rank.
        bucket_cap_mb: MiB of gradients per all-reduce call.

    Returns:
        ``(global_batch_size, all_losses_finite)``.

    Raises:
        CollectiveError: if another rank died, hung past the collective timeout, or the connection broke.
    """
    if not is_distributed():
        return batch_size, loss_finite
    grads = [p.grad for p in params if p.grad is not None]
    meta = torch.tensor([float(batch_size), 0.0 if loss_finite else 1.0], dtype=torch.float32)
    buckets = _buckets(grads, bucket_cap_mb * 2 ** 20)
    host = next((i for i, b in enumerate(buckets) if grads[b[0]].dtype == torch.float32), None)
    flats = []
    for k, bucket in enumerate(buckets):
        flat = torch.cat([grads[i].reshape(-1) for i in bucket]).mul_(batch_size)
        if k == host:
            flat = torch.cat([flat, meta.to(flat.device)])
        flats.append(flat.to(_collective_device(flat.device)))
    if host is None:  # no float32 gradients: the batch size and flag travel on their own
        flats.append(meta.to(_collective_device(meta.device)))
    with _collective("the all-reduce of the gradients"):
        for flat in flats:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    reduced_meta = (flats[host][-2:] if host is not None else flats[-1]).cpu()
    total, bad = float(reduced_meta[0]), float(reduced_meta[1])
    for bucket, flat in zip(buckets, flats):
        offset = 0
        for i in bucket:
            g = grads[i]
            torch.div(flat[offset:offset + g.numel()].view_as(g).to(g.device), total, out=g)
            offset += g.numel()
    return int(round(total)), bad == 0.0


def all_reduce_sum_(tensors: Iterable[torch.Tensor]) -> None:
    """Sums each tensor over ranks, in place (a no-op without a process group or with one process).

    For accumulators such as Laplace's curvature sums, log-likelihood and
    example count: every rank passes its partial sums, in the same order, and
    gets the totals. Booleans and integers are summed exactly (integers as int64).

    Raises:
        CollectiveError: if another rank died, hung past the collective timeout, or the connection broke.
    """
    if not is_distributed():
        return
    for t in tensors:
        buf = t if t.dtype != torch.bool else t.to(torch.uint8)
        work = buf.to(_collective_device(buf.device))
        with _collective("an all-reduce of sums"):
            dist.all_reduce(work, op=dist.ReduceOp.SUM)
        if work is not t:
            t.copy_(work.to(t.device, t.dtype))


def average_(tensors: Iterable[torch.Tensor]) -> None:
    """Replaces each floating-point tensor by its mean over ranks, in place (others are left alone).

    Used for BatchNorm running statistics, which each rank updates from its own
    shard: the mean of the ranks' running means is the one-process running
    mean; the mean of their running variances lacks the spread between the
    ranks' batch means. Tensors that are already equal on every rank stay
    exactly equal.
    """
    if not is_distributed():
        return
    floats = [t for t in tensors if t.is_floating_point()]
    all_reduce_sum_(floats)
    for t in floats:
        t.div_(world_size())


def all_reduce_numbers(values: Sequence[float]) -> list[float]:
    """The sums over ranks of a few Python numbers (float64), e.g. an epoch's loss totals.

    Raises:
        CollectiveError: if another rank died, hung past the collective timeout, or the connection broke.
    """
    if not is_distributed():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    t = t.to(_collective_device(t.device))
    with _collective("the all-reduce of the epoch's totals"):
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu().tolist()


def broadcast_module_(module: torch.nn.Module, src: int = 0) -> None:
    """Copies rank ``src``'s parameters and buffers into every rank's ``module``, in place.

    One broadcast per (device, dtype) bucket. Boolean buffers travel as uint8.
    Tensors outside parameters and buffers (e.g. an SGLD sample store's draws)
    are not sent: use :func:`broadcast_state_dict_` for a whole state.

    Raises:
        CollectiveError: if another rank died, hung past the collective timeout, or the connection broke.
    """
    if not is_distributed():
        return
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.numel()]
    for bucket in _buckets(tensors, BUCKET_CAP_MB * 2 ** 20):
        parts = [tensors[i].detach() for i in bucket]
        flat = torch.cat([p.reshape(-1) for p in parts])
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)
        work = flat.to(_collective_device(flat.device))
        with _collective(f"the broadcast of rank {src}'s parameters and buffers"):
            dist.broadcast(work, src=src)
        offset = 0
        with torch.no_grad():
            for p in parts:
                p.copy_(work[offset:offset + p.numel()].view(p.shape).to(p.device, p.dtype))
                offset += p.numel()


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` (any picklable object) on every rank; ``obj`` itself without a group.

    Raises:
        CollectiveError: if another rank died, hung past the collective timeout, or the connection broke.
    """
    if not is_distributed():
        return obj
    box = [obj]
    with _collective(f"a broadcast from rank {src}"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (any picklable object), in rank order, on every rank; ``[obj]`` without a group.

    Tensors are pickled: move CUDA tensors to the CPU first (NCCL needs the current CUDA device set).

    Raises:
        CollectiveError: if another rank died, hung past the collective timeout, or the connection broke.
    """
    if not is_distributed():
        return [obj]
    out: list = [None] * world_size()
    with _collective("an all-gather of objects"):
        dist.all_gather_object(out, obj)
    return out


def broadcast_state_dict_(module: torch.nn.Module, src: int = 0) -> None:
    """Loads rank ``src``'s whole ``module.state_dict()`` (extra state included) on every rank.

    Pickles the state on rank ``src`` (tensors moved to CPU): meant for a
    one-off, e.g. the best checkpoint that only rank 0 read.
    """
    if not is_distributed():
        return
    state = None
    if rank() == src:
        state = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in module.state_dict().items()}
    state = broadcast_object(state, src)
    if rank() != src:
        module.load_state_dict(state)


def sync_random_state_(device: torch.device | None = None, generators: Iterable[torch.Generator] = (),
                       src: int = 0) -> None:
    """Gives every rank rank ``src``'s random state: the CPU generator, ``device``'s CUDA generator, ``generators``.

    Afterwards every rank makes the same draws in the same order (the SGLD
    noise, VI weight samples, ...). Nothing happens without a process group.
    """
    if not is_distributed():
        return
    gens = [g for g in generators if g is not None]
    cuda = device is not None and torch.device(device).type == "cuda"
    states = {"cpu": torch.get_rng_state(), "generators": [g.get_state() for g in gens],
              "cuda": torch.cuda.get_rng_state(torch.device(device)) if cuda else None}
    states = broadcast_object(states, src)
    torch.set_rng_state(states["cpu"])
    for g, s in zip(gens, states["generators"]):
        g.set_state(s)
    if cuda and states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"], torch.device(device))


def shared_seed(seed: int | None = None, src: int = 0) -> int:
    """A seed that is the same on every rank: rank ``src``'s ``seed`` (a fresh random one if None)."""
    if seed is None and rank() == src:
        seed = int(torch.randint(0, 2 ** 31 - 1, ()).item())
    return int(broadcast_object(seed, src))


def check_same_across_ranks(name: str, value: int) -> None:
    """Raises on every rank if the integer ``value`` differs between ranks (e.g. the number of batches).

    Raises:
        ValueError: naming ``name`` and each rank's value.
        CollectiveError: if another rank died, hung past the collective timeout, or the connection broke.
    """
    if not is_distributed():
        return
    values = [None] * world_size()
    with _collective(f"the comparison of {name} between ranks"):
        dist.all_gather_object(values, int(value))
    if len(set(values)) > 1:
        raise ValueError(f"{name} differs between ranks ({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))}); "
                         "every rank must run the same number of steps (use a DistributedSampler, which pads "
                         "the shards to equal size)")


class ShardSampler(torch.utils.data.Sampler):
    """In-order indices ``rank, rank + W, rank + 2W, ...`` of ``range(n)``: each example once, on one rank.

    Unlike ``DistributedSampler`` there is no padding, so shards differ in size
    by at most one and sums over all ranks count every example exactly once
    (for a pass such as Laplace's curvature, whose sums are all-reduced once at
    the end). Not for training steps: ranks may get different numbers of batches.
    """

    def __init__(self, n: int, num_replicas: int | None = None, rank_: int | None = None):
        self.n = n
        self.num_replicas = world_size() if num_replicas is None else num_replicas
        self.rank = rank() if rank_ is None else rank_

    def __iter__(self):
        return iter(range(self.rank, self.n, self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.num_replicas))


def refuse(what: str, why: str) -> None:
    """Raises a ValueError if data-parallel training is on: ``what`` does not support it, because ``why``."""
    if is_distributed() or env_world_size() > 1:
        raise ValueError(f"{what} does not run data-parallel (world size {max(world_size(), env_world_size())}): "
                         f"{why}; run it in a single process (without torchrun)")
