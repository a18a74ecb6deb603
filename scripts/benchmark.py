"""Cost of bayeswrap's methods against plain PyTorch training, measured in one process run.

Sections (each method is compared with a baseline measured in the same run):

1. ``step``: training-step time of plain training (the model itself, SGD with
   momentum) and of MAP, VI, MC-dropout and SGLD through bayeswrap. Rounds are
   interleaved over the configurations to cancel drift; medians are reported,
   with ratios to plain training. Peak memory: CUDA max-allocated on GPU; on
   CPU the maximum resident set size of a fresh process per configuration.
2. ``curvature``: Laplace ``fit_curvature`` throughput (examples/s) against a
   naive per-example backward loop (what BayesDLL does) on the same model and data.
3. ``predict``: ``predict(x, num_samples=S)`` against S plain forward passes.

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (ratios against model size).

Example::

    python scripts/benchmark.py --models resnet50 --img-size 224 --batch-size 16 --out figures/benchmark_cpu_r50
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

import bayeswrap as bw
from bayeswrap.io import write_json, write_text

METHODS = ("plain", "map", "vi", "mc_dropout", "sgld")
NUM_DATA = 10_000
NUM_CLASSES = 100


def make_model(name: str, img_size: int) -> torch.nn.Module:
    kwargs = {"img_size": img_size} if "vit" in name else {}
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, **kwargs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def sgd(params, device: torch.device):
    """The optimizer of plain training and of every SGD-trained method: fused SGD with momentum where supported."""
    try:
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True)


def make_step(name: str, model: torch.nn.Module, method: str, device: torch.device, amp: bool):
    """A closure running one training step of ``method`` (``"plain"`` = the model itself)."""
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)
    if method == "plain":
        net = copy.deepcopy(model).to(device).train()
        opt = sgd(list(net.parameters()), device)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
        return step
    options = {"burn_in": 0, "thinning": 1} if method == "sgld" else {}
    bnn = bw.wrap(model, method, num_data=NUM_DATA, prior_std=1.0, **options).to(device).train()
    if method == "sgld":
        opt = bw.optim.SGLD(bnn.param_groups(), lr=1e-4, num_data=NUM_DATA)
    else:
        opt = sgd(list(bnn.parameters()), device)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = bnn.loss(x, y).loss
        loss.backward()
        opt.step()
        bnn.after_step()
    return step


def batch(batch_size: int, img_size: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch_size, 3, img_size, img_size, generator=g).to(device)
    y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=g).to(device)
    return x, y


def time_steps(args, name: str, device: torch.device) -> dict:
    """Interleaved medians of one training step per method."""
    model = make_model(name, args.img_size)
    x, y = batch(args.batch_size, args.img_size, device)
    steps = {m: make_step(name, model, m, device, args.amp) for m in args.methods}
    for step in steps.values():  # warm-up (allocator, lazy init, cudnn autotune)
        for _ in range(args.warmup):
            step(x, y)
    times = {m: [] for m in steps}
    cpu_times = {m: [] for m in steps}
    for _ in range(args.repeats):
        for m, step in steps.items():
            sync(device)
            tic, cpu_tic = time.perf_counter(), time.process_time()
            step(x, y)
            sync(device)
            times[m].append(time.perf_counter() - tic)
            cpu_times[m].append(time.process_time() - cpu_tic)
    med = {m: statistics.median(t) for m, t in times.items()}
    cpu = {m: statistics.median(t) for m, t in cpu_times.items()}
    return {"params": sum(p.numel() for p in model.parameters()),
            "seconds": med, "ratio": {m: med[m] / med["plain"] for m in med},
            "cpu_seconds": cpu, "cpu_ratio": {m: cpu[m] / cpu["plain"] for m in cpu},
            "all_seconds": times}


def peak_memory(args, name: str, method: str, device: torch.device) -> float:
    """Peak memory in MiB of a training step: CUDA max-allocated, or on CPU the resident-set high-water
    mark of a fresh child process during its second step (after resetting it; it includes the model,
    gradients, optimizer state and the ~torch runtime)."""
    if device.type == "cuda":
        model = make_model(name, args.img_size)
        x, y = batch(args.batch_size, args.img_size, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step = make_step(name, model.to(device), method, device, args.amp)
        for _ in range(2):
            step(x, y)
        sync(device)
        peak = torch.cuda.max_memory_allocated() / 2**20
        del step, model
        return peak
    cmd = [sys.executable, __file__, "--child-memory", name, method, "--img-size", str(args.img_size),
           "--batch-size", str(args.batch_size)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def child_memory(args) -> None:
    name, method = args.child_memory
    torch.set_num_threads(torch.get_num_threads())
    model = make_model(name, args.img_size)
    x, y = batch(args.batch_size, args.img_size, torch.device("cpu"))
    step = make_step(name, model, method, torch.device("cpu"), False)
    del model  # the plain step holds its own copy; bayeswrap holds a storage-free skeleton
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


def naive_fisher(model, x, y):
    """BayesDLL-style diagonal empirical Fisher: one backward pass per example."""
    sq = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for s, p in zip(sq, model.parameters()):
            s += p.grad**2
    return sq


def curvature(args, name: str, device: torch.device) -> dict:
    model = make_model(name, args.curvature_img_size).to(device).eval()
    x, y = batch(args.curvature_examples, args.curvature_img_size, device)
    bnn = bw.wrap(model, "laplace", num_data=NUM_DATA, curvature_chunk_size=args.curvature_chunk).to(device)
    loader = [(x, y)]
    naive_fisher(model, x[:2], y[:2])
    bnn.fit_curvature([(x[:2], y[:2])])  # warm-up
    t_fast, t_naive = [], []
    for _ in range(args.curvature_repeats):
        sync(device)
        tic = time.perf_counter()
        bnn.fit_curvature(loader)
        sync(device)
        t_fast.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        naive_fisher(model, x, y)
        sync(device)
        t_naive.append(time.perf_counter() - tic)
    n = x.shape[0]
    fast, naive = n / statistics.median(t_fast), n / statistics.median(t_naive)
    return {"model": name, "img_size": args.curvature_img_size, "examples": n, "chunk": args.curvature_chunk,
            "examples_per_s": {"bayeswrap_vmap": fast, "naive_loop": naive}, "speedup": fast / naive}


def predictive(args, name: str, device: torch.device) -> dict:
    model = make_model(name, args.img_size).to(device).eval()
    x, _ = batch(args.batch_size, args.img_size, device)
    bnn = bw.wrap(model, "vi", num_data=NUM_DATA, init_std=1e-3).to(device).eval()
    out = {}
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
        for s in args.num_samples:
            bnn.predict(x, num_samples=s)
            model(x)
            t_b, t_p = [], []
            for _ in range(args.repeats):
                sync(device)
                tic = time.perf_counter()
                bnn.predict(x, num_samples=s)
                sync(device)
                t_b.append(time.perf_counter() - tic)
                tic = time.perf_counter()
                for _ in range(s):
                    model(x).softmax(-1)
                sync(device)
                t_p.append(time.perf_counter() - tic)
            out[str(s)] = {"bayeswrap_s": statistics.median(t_b), "plain_forwards_s": statistics.median(t_p),
                           "ratio": statistics.median(t_b) / statistics.median(t_p)}
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    device_is_cpu = result["device"].startswith("CPU")
    lines = [f"# bayeswrap benchmark ({result['device']})", "",
             f"input {cfg['img_size']}x{cfg['img_size']}, amp={cfg['amp']}, "
             f"medians of {cfg['repeats']} interleaved steps; torch {result['torch']}; optimizer: SGD with momentum "
             "(fused kernel where supported) for plain training and every method (SGLD: bw.optim.SGLD)",
             "Time ratios are wall-clock; on CPU the ratio of process CPU time is given too (robust to other load). "
             "Peak memory: CUDA max allocated, or on CPU the max RSS of a fresh process per configuration.", "",
             "## Training step: time (ratio to plain) and peak memory (ratio to plain)", "",
             "| model | params (M) | " + " | ".join(result["config"]["methods"]) + " |",
             "|---|---|" + "---|" * len(cfg["methods"])]
    for name, r in result["step"].items():
        cells = []
        for m in cfg["methods"]:
            mem = r.get("peak_mib", {}).get(m)
            mem_txt = f", {mem:.0f} MiB ({mem / r['peak_mib']['plain']:.2f}x)" if mem else ""
            cpu_txt = f", CPU time {r['cpu_ratio'][m]:.2f}x" if device_is_cpu else ""
            cells.append(f"{r['seconds'][m] * 1e3:.0f} ms ({r['ratio'][m]:.2f}x{cpu_txt}){mem_txt}")
        lines.append(f"| {name} | {r['params'] / 1e6:.1f} | " + " | ".join(cells) + " |")
    if result.get("curvature"):
        c = result["curvature"]
        lines += ["", "## Laplace curvature (examples/s)", "",
                  "| model | input | bayeswrap (vmap) | naive loop | speed-up |", "|---|---|---|---|---|",
                  f"| {c['model']} | {c['img_size']} | {c['examples_per_s']['bayeswrap_vmap']:.1f} | "
                  f"{c['examples_per_s']['naive_loop']:.1f} | {c['speedup']:.2f}x |"]
    if result.get("predict"):
        lines += ["", "## Posterior predictive: predict(x, S) vs S plain forwards", "",
                  "| model | S | bayeswrap | S forwards | ratio |", "|---|---|---|---|---|"]
        for name, per_s in result["predict"].items():
            for s, r in per_s.items():
                lines.append(f"| {name} | {s} | {r['bayeswrap_s'] * 1e3:.0f} ms | {r['plain_forwards_s'] * 1e3:.0f} ms"
                             f" | {r['ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def figure(result: dict, path: str) -> None:
    from bayeswrap.plots import _new_figure, save_figure

    fig = _new_figure(figsize=(6, 4))
    ax = fig.subplots()
    for bs in sorted({r["batch_size"] for r in result["step"].values()}):
        names = sorted((n for n, r in result["step"].items() if r["batch_size"] == bs),
                       key=lambda n: result["step"][n]["params"])
        sizes = [result["step"][n]["params"] / 1e6 for n in names]
        for m in result["config"]["methods"]:
            if m != "plain":
                ax.plot(sizes, [result["step"][n]["ratio"][m] for n in names], marker="o",
                        label=f"{m}, batch {bs}")
        for size, n in zip(sizes, names):
            ax.annotate(n.split(" ")[0], (size, 1.0), fontsize=6, rotation=45)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("step time / plain step time")
    ax.set_title(f"bayeswrap step-time overhead, {result['device']}", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet18,resnet50,resnet101,vit_small_patch16_224,vit_base_patch16_224,"
                                       "vit_large_patch32_224")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--batch-size", type=int, default=16, help="batch size of the curvature/predict sections")
    p.add_argument("--batch-sizes", default="16", help="comma-separated batch sizes of the step section")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--sections", default="step,curvature,predict")
    p.add_argument("--curvature-model", default="resnet18")
    p.add_argument("--curvature-img-size", type=int, default=64)
    p.add_argument("--curvature-examples", type=int, default=32)
    p.add_argument("--curvature-chunk", type=int, default=32)
    p.add_argument("--curvature-repeats", type=int, default=3)
    p.add_argument("--predict-model", default="resnet50")
    p.add_argument("--num-samples", default="1,5,20")
    p.add_argument("--out", default="figures/benchmark")
    p.add_argument("--child-memory", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_memory:
        return child_memory(args)
    args.methods = [m for m in args.methods.split(",") if m]
    if args.methods[0] != "plain":
        args.methods = ["plain"] + [m for m in args.methods if m != "plain"]
    args.num_samples = [int(s) for s in args.num_samples.split(",")]
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    sections = set(args.sections.split(","))
    result = {"device": device_name, "torch": torch.__version__, "config": {
        k: v for k, v in vars(args).items() if k != "child_memory"}, "step": {}}
    if "step" in sections:
        default_bs = args.batch_size
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            args.batch_size = bs
            for name in [m for m in args.models.split(",") if m]:
                key = f"{name} (batch {bs})"
                print(f"step: {key}", flush=True)
                r = time_steps(args, name, device)
                r["batch_size"] = bs
                if not args.no_memory:
                    r["peak_mib"] = {m: peak_memory(args, name, m, device) for m in args.methods}
                result["step"][key] = r
                print(json.dumps({k: r[k] for k in ("ratio", "cpu_ratio", "peak_mib") if k in r}), flush=True)
        args.batch_size = default_bs
    if "curvature" in sections:
        result["curvature"] = curvature(args, args.curvature_model, device)
        print(json.dumps(result["curvature"]), flush=True)
    if "predict" in sections:
        result["predict"] = {args.predict_model: predictive(args, args.predict_model, device)}
        print(json.dumps(result["predict"]), flush=True)
    write_json(args.out + ".json", result)
    write_text(args.out + ".md", markdown(result))
    if result["step"]:
        figure(result, args.out + ".png")
    print(markdown(result))


if __name__ == "__main__":
    main()
