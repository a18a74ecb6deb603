"""Section ``compile`` (not in the default ``--sections``): training steps compiled with ``torch.compile`` against
the same steps run eagerly.

For each model (the digits MLP, ResNet-50, ViT-S; :func:`scripts.benchmarks.workloads.make_model`) and method:

* eager: plain training (the model itself, fused SGD with momentum 0.9, ``F.cross_entropy``) or bayeswrap's step
  (``bnn.loss(x, y).loss``, backward, the optimizer the method owns or that SGD, ``bnn.after_step()``): the step
  section's closures (:func:`scripts.benchmarks.step.make_step`);
* compiled: the same step with the loss compiled: plain training's ``F.cross_entropy(net(x), y)`` under
  ``torch.compile(fullgraph=True)``, bayeswrap's ``bnn.loss`` through :class:`bayeswrap.compiled.CompiledLoss`
  (what ``bw.fit(..., compile=True)`` runs): forward and backward compiled by the same backend (inductor by
  default), the optimizer step eager in both.

Each method's eager and compiled steps run in interleaved rounds with eager plain training
(:func:`scripts.benchmarks.timing.interleaved`; on the MLP each timed call is :data:`MLP_STEPS_PER_CALL` steps,
reported per step), after the
compilation, which is timed apart (the first two calls of a compiled step, less two compiled steps: for bayeswrap
the first call is eager and the second compiles). Reported: medians of wall and process CPU time per step, the
ratios compiled / eager per method, and each step against eager plain training.
"""

from __future__ import annotations

import copy
import gc
import time

import torch
import torch.nn.functional as F

import bayeswrap as bw
from bayeswrap.app import experiments as ex
from bayeswrap.compiled import CompiledLoss
from scripts.benchmarks.step import make_step
from scripts.benchmarks.timing import interleaved, medians, sync
from scripts.benchmarks.workloads import LR, NUM_DATA, PRIOR_STD, batch, make_model, sgd

#: the methods of the compile section: plain training and bayeswrap's
COMPILE_METHODS = ("plain", "map", "vi", "mc_dropout", "sgld")
#: steps per timed call on the digits MLP (a step takes about a millisecond: one would time the timer)
MLP_STEPS_PER_CALL = 50


def make_compiled_step(model: torch.nn.Module, method: str, device: torch.device, options: dict):
    """A closure ``step(x, y)``: one training step of ``method`` on a copy of ``model`` with its loss compiled.

    Args:
        model: the model (not modified).
        method: ``"plain"`` or a bayeswrap method of :data:`COMPILE_METHODS`.
        device: where to train.
        options: ``torch.compile`` keyword arguments (for bayeswrap: ``fit``'s ``compile`` mapping).
    """
    if method == "plain":
        net = copy.deepcopy(model).to(device).train()
        opt = sgd(list(net.parameters()))
        loss_fn = torch.compile(lambda x, y: F.cross_entropy(net(x), y), **{"fullgraph": True, **options})

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            loss_fn(x, y).backward()
            opt.step()
        return step
    kwargs = {"burn_in": 0, "thinning": 10} if method == "sgld" else {}
    bnn = bw.wrap(model, method, num_data=NUM_DATA, prior_std=PRIOR_STD, **kwargs).to(device).train()
    opt = ex.own_optimizer(bnn, LR) or sgd(list(bnn.parameters()))
    loss_fn = CompiledLoss(bnn, options)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss_fn(x, y).loss.backward()
        opt.step()
        bnn.after_step()
    step.loss = loss_fn
    return step


def time_compiled(args, name: str, device: torch.device) -> dict:
    """Eager and compiled steps of every method on one model and batch, in interleaved rounds.

    Each method is timed in rounds of its own with eager plain training (the reference), its eager step and its
    compiled step, so that three copies of the model are held at a time (not two per method).
    """
    img = args.compile_vit_img_size if "vit" in name else args.compile_img_size
    model = make_model(name, img)
    x, y = batch(name, args.compile_batch_size, img, device)
    options = {"backend": args.compile_backend}
    per_call = MLP_STEPS_PER_CALL if name == "mlp" else 1
    med, cpu, wall_all, compile_calls = {}, {}, {}, {}
    for m in args.compile_methods:
        compiled = make_compiled_step(model, m, device, options)
        sync(device)
        tic = time.perf_counter()
        compiled(x, y)
        compiled(x, y)
        sync(device)
        compile_calls[m] = time.perf_counter() - tic
        print(f"  {name} {m}: compiled in {compile_calls[m]:.1f} s", flush=True)
        steps = {"plain": make_step(model, "plain", device, False)}
        steps[m] = steps["plain"] if m == "plain" else make_step(model, m, device, False)
        steps[f"{m} (compiled)"] = compiled

        def run(step):
            for _ in range(per_call):
                step(x, y)

        wall, cpu_times = interleaved({k: (lambda s=s: run(s)) for k, s in steps.items()}, args.compile_repeats,
                                      args.compile_warmup, device)
        loss = getattr(compiled, "loss", None)
        if loss is not None and loss.eager_steps != 1:  # only the first call may run eagerly
            raise RuntimeError(f"{name} {m}: {loss.eager_steps} eager steps; the compiled step fell back")
        wall = {k: [t / per_call for t in v] for k, v in wall.items()}
        plain_wall, plain_cpu = medians(wall)["plain"], medians(cpu_times)["plain"] / per_call
        for k in (m, f"{m} (compiled)"):
            med[k] = medians(wall)[k]
            cpu[k] = medians(cpu_times)[k] / per_call
            wall_all[k] = wall[k]
        med[f"{m} (plain in its rounds)"], cpu[f"{m} (plain in its rounds)"] = plain_wall, plain_cpu
        del steps, compiled, loss
        gc.collect()
    methods = list(args.compile_methods)
    return {"model": name, "img_size": img, "batch_size": args.compile_batch_size,
            "params": sum(p.numel() for p in model.parameters()), "methods": methods,
            "seconds": med, "cpu_seconds": cpu, "all_seconds": wall_all,
            "compiled_over_eager": {m: med[f"{m} (compiled)"] / med[m] for m in methods},
            "cpu_compiled_over_eager": {m: cpu[f"{m} (compiled)"] / cpu[m] for m in methods},
            "over_plain": {k: med[k] / med[f"{m} (plain in its rounds)"] for m in methods
                           for k in (m, f"{m} (compiled)")},
            "cpu_over_plain": {k: cpu[k] / cpu[f"{m} (plain in its rounds)"] for m in methods
                               for k in (m, f"{m} (compiled)")},
            "compile_seconds": {m: max(compile_calls[m] - 2 * med[f"{m} (compiled)"], 0.0) for m in methods}}


def compile_section(args, device: torch.device, on_model=None) -> dict:
    """Runs :func:`time_compiled` for every model of ``--compile-models`` at ``--compile-threads`` threads,
    calling ``on_model(section so far)`` after each model (the script writes its report there).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(args.compile_threads)
    try:
        results = {}
        for name in [m for m in args.compile_models.split(",") if m]:
            print(f"compile: {name}", flush=True)
            r = time_compiled(args, name, device)
            results[name] = r
            print({m: round(v, 3) for m, v in r["compiled_over_eager"].items()}, flush=True)
            if on_model is not None:
                on_model(_section(args, results))
    finally:
        torch.set_num_threads(threads)
    return _section(args, results)


def _section(args, results: dict) -> dict:
    return {"config": {"backend": args.compile_backend, "threads": args.compile_threads,
                       "repeats": args.compile_repeats, "warmup": args.compile_warmup}, "models": dict(results)}


def compile_markdown(section: dict) -> list[str]:
    """The compile section's tables: per model, each method eager and compiled, with the ratios."""
    c = section["config"]
    lines = ["", f"## Compiled training steps (`torch.compile`, backend {c['backend']}) against eager steps "
             f"({c['threads']} thread{'s' if c['threads'] > 1 else ''})", "",
             "Eager: plain training (fused SGD, momentum 0.9) or bayeswrap's step (`bnn.loss(x, y).loss`, backward, "
             "SGD or the method's own optimizer, `after_step`). Compiled: the same step with the loss and its "
             "backward compiled: `torch.compile(fullgraph=True)` of plain training's loss, "
             "`bayeswrap.compiled.CompiledLoss` (what `bw.fit(..., compile=True)` runs) for bayeswrap; the optimizer "
             "step is eager in both. SGLD: past burn-in, a draw kept every 10th step.",
             f"Time: medians of {c['repeats']} interleaved rounds after {c['warmup']} warm-up round(s); each "
             "method's rounds hold eager plain training, its eager step and its compiled step; compilation is excluded from the rounds and given apart (the first two "
             "calls of the compiled step less two compiled steps; MLP: 50 steps per timed call). CPU-time ratios (process CPU time; robust to "
             "other load on a shared machine) beside the wall-clock ones.", ""]
    for name, r in section["models"].items():
        lines += [f"### {name} ({r['params'] / 1e6:.2f} M parameters, batch {r['batch_size']}"
                  + ("" if name == "mlp" else f", {r['img_size']}x{r['img_size']}") + ")", "",
                  "| method | eager step | compiled step | compiled / eager | CPU-time compiled / eager | "
                  "eager / plain eager | compiled / plain eager | compile time |",
                  "|---|---|---|---|---|---|---|---|"]
        for m in r["methods"]:
            k = f"{m} (compiled)"
            lines.append(f"| {m} | {r['seconds'][m] * 1e3:.1f} ms | {r['seconds'][k] * 1e3:.1f} ms | "
                         f"{r['compiled_over_eager'][m]:.3f}x | {r['cpu_compiled_over_eager'][m]:.3f}x | "
                         f"{r['over_plain'][m]:.3f}x | {r['over_plain'][k]:.3f}x | {r['compile_seconds'][m]:.1f} s |")
        lines.append("")
    return lines
