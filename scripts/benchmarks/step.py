"""Section 1 (``step``): one training step of each method against plain training, in time and peak memory.

Plain training is the model itself with fused SGD (momentum 0.9); MAP, VI, VI with local reparameterisation
(``vi_lrt``), IVON, MC-dropout and SGLD run through bayeswrap, each with the optimizer the method owns
(:func:`bayeswrap.app.experiments.own_optimizer`) or that SGD. With ``--bayesdll-src`` BayesDLL's own VI,
MC-dropout and SGLD steps on the same model and batch join the rounds.
"""

from __future__ import annotations

import copy
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import bayeswrap as bw
from bayeswrap.app import experiments as ex
from scripts.benchmarks.bayesdll import bayesdll_runner, bayesdll_step, load_bayesdll, quiet_stderr
from scripts.benchmarks.timing import interleaved, medians, sync
from scripts.benchmarks.workloads import LR, NUM_DATA, PRIOR_STD, batch, make_model, sgd

#: The step section's methods: ``plain`` and bayeswrap's.
METHODS = ("plain", "map", "vi", "vi_lrt", "ivon", "mc_dropout", "sgld")
#: The methods whose BayesDLL counterpart joins the rounds with ``--bayesdll-src``.
BAYESDLL_STEP_METHODS = ("vi", "mc_dropout", "sgld")
#: The script whose ``--child-memory`` mode measures one configuration's peak memory in a fresh process.
SCRIPT = Path(__file__).resolve().parents[1] / "benchmark.py"


def make_step(model: torch.nn.Module, method: str, device: torch.device, amp: bool, bdl=None):
    """A closure ``step(x, y)`` running one training step of ``method`` on a copy of ``model``.

    Args:
        model: the model (not modified).
        method: ``"plain"`` (the model itself), a bayeswrap method of :data:`METHODS`,
            or ``"bayesdll_<vi|mc_dropout|sgld>"``.
        device: where to train.
        amp: bf16 autocast around the forward and loss.
        bdl: the loaded BayesDLL (needed for ``bayesdll_*``).
    """
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)
    if method.startswith("bayesdll_"):
        their = method.removeprefix("bayesdll_")
        one_step = bayesdll_step(bayesdll_runner(bdl, their, model, device, NUM_DATA, LR), their)

        def step(x, y):
            with autocast:
                one_step(x, y)
        return step
    if method == "plain":
        net = copy.deepcopy(model).to(device).train()
        opt = sgd(list(net.parameters()))

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
        return step
    kind, options = method, {}
    if method == "sgld":
        options = {"burn_in": 0, "thinning": 10}  # the default thinning, past burn-in: a draw every 10th step
    elif method == "vi_lrt":
        kind, options = "vi", {"local_reparam": True}
    bnn = bw.wrap(model, kind, num_data=NUM_DATA, prior_std=PRIOR_STD, **options).to(device).train()
    opt = ex.own_optimizer(bnn, LR)  # SGLD (with num_data = NUM_DATA), IVON
    if opt is None:
        opt = sgd(list(bnn.parameters()))

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = bnn.loss(x, y).loss
        loss.backward()
        opt.step()
        bnn.after_step()
    return step


def step_methods(args) -> list[str]:
    """Our methods, then BayesDLL's counterparts of those of them BayesDLL has (with ``--bayesdll-src``)."""
    theirs = [f"bayesdll_{m}" for m in BAYESDLL_STEP_METHODS if m in args.methods] if args.bayesdll_src else []
    return list(args.methods) + theirs


def time_steps(args, name: str, device: torch.device, bdl=None) -> dict:
    """Interleaved medians of one training step per method on one model and batch.

    Returns:
        ``params``, ``seconds``/``cpu_seconds`` (medians per method), ``ratio``/``cpu_ratio``
        (to plain), ``all_seconds`` and, where both ran, ``ours_over_theirs``
        (bayeswrap time / BayesDLL time per method).
    """
    model = make_model(name, args.img_size)
    x, y = batch(name, args.batch_size, args.img_size, device)
    steps = {m: make_step(model, m, device, args.amp, bdl) for m in step_methods(args)}
    wall, cpu_times = interleaved({m: (lambda s=s: s(x, y)) for m, s in steps.items()},
                                  args.repeats, args.warmup, device)
    med, cpu = medians(wall), medians(cpu_times)
    out = {"params": sum(p.numel() for p in model.parameters()), "methods": list(steps),
           "seconds": med, "ratio": {m: med[m] / med["plain"] for m in med},
           "cpu_seconds": cpu, "cpu_ratio": {m: cpu[m] / cpu["plain"] for m in cpu},
           "all_seconds": wall}
    pairs = {m: f"bayesdll_{m}" for m in BAYESDLL_STEP_METHODS if f"bayesdll_{m}" in med}
    if pairs:
        out["ours_over_theirs"] = {m: med[m] / med[t] for m, t in pairs.items()}
        out["cpu_ours_over_theirs"] = {m: cpu[m] / cpu[t] for m, t in pairs.items()}
    return out


def peak_memory(args, name: str, method: str, device: torch.device, bdl=None) -> float:
    """Peak memory in MiB of a training step: CUDA max-allocated, or on CPU the resident-set high-water
    mark of a fresh child process during its second step (after resetting it; it includes the model,
    gradients, optimizer state and the ~torch runtime).
    """
    if device.type == "cuda":
        model = make_model(name, args.img_size)
        x, y = batch(name, args.batch_size, args.img_size, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step = make_step(model.to(device), method, device, args.amp, bdl)
        for _ in range(2):
            step(x, y)
        sync(device)
        peak = torch.cuda.max_memory_allocated() / 2**20
        del step, model
        return peak
    cmd = [sys.executable, str(SCRIPT), "--child-memory", name, method, "--img-size", str(args.img_size),
           "--batch-size", str(args.batch_size)]
    if args.bayesdll_src:
        cmd += ["--bayesdll-src", args.bayesdll_src]
    if args.amp:
        cmd.append("--amp")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def child_memory(args) -> None:
    """Body of the ``--child-memory MODEL METHOD`` child process: prints its peak RSS (MiB) of a second step."""
    name, method = args.child_memory
    bdl = load_bayesdll(args.bayesdll_src) if method.startswith("bayesdll_") else None
    model = make_model(name, args.img_size)
    x, y = batch(name, args.batch_size, args.img_size, torch.device("cpu"))
    with quiet_stderr():
        step = make_step(model, method, torch.device("cpu"), args.amp, bdl)
    del model  # every step holds its own copy (bayeswrap: plus a storage-free skeleton)
    step(x, y)  # first step allocates gradients and optimizer state
    # reset the resident-set high-water mark (Linux): importing torch peaks higher than a small model's step
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    step(x, y)
    with open("/proc/self/status") as fh:
        hwm = next((int(line.split()[1]) for line in fh if line.startswith("VmHWM:")), None)
    print((hwm or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024)


def step_section(args, device: torch.device, bdl=None) -> dict:
    """Runs :func:`time_steps` (and :func:`peak_memory`) for every batch size and model."""
    results = {}
    for bs in [int(b) for b in args.batch_sizes.split(",") if b]:
        sub = copy.copy(args)
        sub.batch_size = bs
        for name in [m for m in args.models.split(",") if m]:
            key = f"{name} (batch {bs})"
            print(f"step: {key}", flush=True)
            r = time_steps(sub, name, device, bdl)
            r.update(model=name, batch_size=bs)
            if not args.no_memory and (not args.memory_models or name in args.memory_models.split(",")):
                r["peak_mib"] = {m: peak_memory(sub, name, m, device, bdl) for m in r["methods"]}
            results[key] = r
            print(json.dumps({k: r[k] for k in ("ratio", "ours_over_theirs", "peak_mib") if k in r}), flush=True)
    return results

