"""Cost of bayeswrap's methods against plain PyTorch training (and optionally BayesDLL), in one process run.

Sections (each method is compared with a baseline measured in the same run, in
interleaved rounds to cancel drift; medians are reported):

1. ``step``: training-step time of plain training (the model itself, SGD with
   momentum) and of MAP, VI, VI with local reparameterisation (``vi_lrt``),
   IVON, MC-dropout and SGLD through bayeswrap, with ratios to plain training.
   Peak memory: CUDA max-allocated on GPU; on CPU the maximum resident set size
   of a fresh process per configuration. With ``--bayesdll-src`` BayesDLL's own
   VI, MC-dropout and SGLD steps on the same model and batch join the rounds.
2. ``curvature``: diagonal Laplace curvature throughput (examples/s) on several
   models: bayeswrap's empirical Fisher (every curvature backend the installed
   ``Laplace`` offers) against a naive per-example backward loop and BayesDLL's
   ``la`` ``Runner.estimate_variance``; bayeswrap's GGN is reported separately.
3. ``mlp_epoch``: one epoch over sklearn's digits with a 64-100-100-10 MLP:
   ``bw.fit`` (MAP, VI) against BayesDLL's ``vanilla`` and ``vi``
   ``Runner.train_one_epoch`` on the same loader.
4. ``predict``: ``predict(x, num_samples=S)`` of VI and the Laplace GLM
   predictive (``link_approx="mc"`` and ``"probit"``) against S plain forwards.
5. ``laplace`` (not in the default ``--sections``): bayeswrap's KFAC Laplace
   against laplace-torch (Daxberger et al. 2021) in the same process, on the
   same weights, data, N and prior precision: the last-layer KFAC fit and GLM
   probit predictive on timm models (and the predictive against one plain
   forward), and the all-weights KFAC fit on the digits MLP and a small CNN.
   Both sides' probit predictives and functional variances are compared.
   Without laplace-torch importable its columns are left out, with a note.
6. ``lora`` (not in the default ``--sections``): a training step of every method on the LoRA adapters
   (``params="adapters"``, ``likelihood="causal_lm"``; VI, BLoB's ``adapters_A``, IVON, MC dropout through the
   model's dropout layers, SGLD, SWAG, a 5-member ensemble; on request Laplace's KFAC fit, where it accepts the causal LM)
   against a plain peft LoRA step (AdamW, the model's own loss) of a GPT-2-small-sized model (random init,
   batch 8 × 128 tokens, CPU, one thread): interleaved medians with their spread, and the peak RSS of a fresh
   process per method (:mod:`scripts.benchmarks.lora`). ``--lora-fast`` is a tiny GPT-2 (the test's).
7. ``compile`` (not in the default ``--sections``): plain training, MAP, VI, MC-dropout and SGLD steps with the
   loss and its backward compiled (``torch.compile``; bayeswrap's ``bw.fit(..., compile=True)`` step) against
   the same steps eager, on the digits MLP, ResNet-50 and ViT-S, in interleaved rounds, with the compilation
   timed apart (:mod:`scripts.benchmarks.compile`).

The Markdown has one table per section, with a target column and ``met``/``gap``
where a target is set. Writes ``<out>.json``, ``<out>.md`` and ``<out>.png``.

BayesDLL (Kim & Hospedales 2023) is never copied into this repository: its
``methods/*.py`` are imported at run time from the checkout given by
``--bayesdll-src``.

Each section is a module of :mod:`scripts.benchmarks`; this file parses the
command line, runs the selected sections and writes the report.

Example::

    python scripts/benchmark.py --models resnet50 --img-size 224 --batch-sizes 16 \\
        --bayesdll-src ../BayesDLL --out figures/benchmark_cpu_r50
    OMP_NUM_THREADS=1 python scripts/benchmark.py --sections laplace --out figures/benchmark_cpu_laplace
    OMP_NUM_THREADS=1 python scripts/benchmark.py --sections lora --out figures/benchmark_cpu_lora
    OMP_NUM_THREADS=1 python scripts/benchmark.py --sections compile --out figures/benchmark_cpu_compile
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on a shared 2-core box

if __package__ in (None, ""):  # run as a file: ``scripts`` is a package of the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bayeswrap.core.io import write_json, write_text
from scripts.benchmarks.bayesdll import load_bayesdll
from scripts.benchmarks.compile import COMPILE_METHODS, compile_section
from scripts.benchmarks.curvature import curvature_backends, curvature_section
from scripts.benchmarks.epoch import mlp_epoch
from scripts.benchmarks.laplace import laplace_section, load_laplace_torch, probit_agreement
from scripts.benchmarks.lora import DEFAULT_LORA_METHODS, LORA_METHODS, lora_child_memory, lora_section
from scripts.benchmarks.predict import predictive
from scripts.benchmarks.report import figure, markdown
from scripts.benchmarks.step import METHODS, child_memory, step_section
from scripts.benchmarks.targets import LAPLACE_TARGETS, check, evaluate_targets
from scripts.benchmarks.workloads import LAPLACE_CLASSES, digits_data, small_cnn

__all__ = ["LAPLACE_CLASSES", "LAPLACE_TARGETS", "check", "digits_data", "load_laplace_torch", "main", "parse_args",
           "probit_agreement", "regenerate_command", "small_cnn"]


def parse_args(argv=None):
    """The benchmark's options, checked: ``--methods`` (``plain`` first), curvature kinds, GLM links, S values."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet18,resnet50,resnet101,vit_small_patch16_224,vit_base_patch16_224,"
                                       "vit_large_patch32_224")
    p.add_argument("--methods", default=",".join(METHODS), help=f"step methods, a subset of {','.join(METHODS)}")
    p.add_argument("--batch-size", type=int, default=16, help="batch size of the predict section")
    p.add_argument("--batch-sizes", default="16", help="comma-separated batch sizes of the step section")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--memory-models", default="", help="comma-separated models whose peak memory is measured "
                                                           "(default: every model of the step section)")
    p.add_argument("--sections", default="step,curvature,mlp_epoch,predict")
    p.add_argument("--bayesdll-src", default=None, metavar="PATH",
                   help="a BayesDLL checkout (github.com/SamsungLabs/BayesDLL) to compare with, imported at run time")
    p.add_argument("--curvature-models", "--curvature-model", dest="curvature_models",
                   default="mlp,resnet18,vit_small_patch16_224")
    p.add_argument("--curvature-img-size", type=int, default=64)
    p.add_argument("--curvature-examples", type=int, default=32)
    p.add_argument("--curvature-chunk", type=int, default=32)
    p.add_argument("--curvature-repeats", type=int, default=3)
    p.add_argument("--curvature-kinds", default="ef,ggn",
                   help="bayeswrap curvatures to time: ef (empirical Fisher, has the target), ggn")
    p.add_argument("--curvature-ggn-models", default="",
                   help="the --curvature-models that also time the GGN (default: all); K = 100 vectors per example")
    p.add_argument("--epoch-train-size", type=int, default=1200, help="digits examples of the small-MLP epoch")
    p.add_argument("--epoch-batch-size", type=int, default=64)
    p.add_argument("--epoch-lr", type=float, default=1e-2)
    p.add_argument("--epoch-repeats", type=int, default=5)
    p.add_argument("--predict-model", default="resnet50", help="a timm model name or mlp")
    p.add_argument("--glm-links", default="mc,probit",
                   help="Laplace GLM links to time (probit costs K vector-Jacobian products per example)")
    p.add_argument("--num-samples", default="1,5,20", help="S values of the predict section (1 is always included)")
    p.add_argument("--laplace-models", default="resnet18,vit_small_patch16_224",
                   help="timm models of the laplace section's last-layer comparison")
    p.add_argument("--laplace-img-size", type=int, default=64)
    p.add_argument("--laplace-train", type=int, default=64, help="training images of the last-layer fit")
    p.add_argument("--laplace-batch-size", type=int, default=32, help="batch size of the last-layer fit")
    p.add_argument("--laplace-test", type=int, default=32, help="inputs of the GLM probit predictive")
    p.add_argument("--laplace-kron-models", default="mlp,cnn",
                   help="models of the all-weights KFAC comparison: mlp (digits MLP), cnn (small CNN, 3x32x32)")
    p.add_argument("--laplace-kron-train", type=int, default=512, help="training examples of the all-weights fit")
    p.add_argument("--laplace-kron-batch-size", type=int, default=64)
    p.add_argument("--laplace-repeats", type=int, default=3)
    p.add_argument("--lora-methods", default=",".join(DEFAULT_LORA_METHODS),
                   help=f"lora section: methods, a subset of {','.join(LORA_METHODS)} (plain is always measured)")
    p.add_argument("--lora-memory-methods", default="",
                   help="lora section: methods whose peak memory is measured (default: every measured method)")
    p.add_argument("--lora-memory-jobs", type=int, default=2,
                   help="lora section: memory child processes at a time (each reads its own peak; after the timing)")
    p.add_argument("--lora-batch-size", type=int, default=None, help="lora section: sequences per batch (8; fast: 2)")
    p.add_argument("--lora-seq-len", type=int, default=None, help="lora section: tokens per sequence (128; fast: 16)")
    p.add_argument("--lora-repeats", type=int, default=3, help="lora section: interleaved rounds")
    p.add_argument("--lora-warmup", type=int, default=1, help="lora section: untimed rounds first")
    p.add_argument("--lora-threads", type=int, default=1, help="lora section: torch's CPU threads")
    p.add_argument("--lora-fast", action="store_true",
                   help="lora section: a tiny GPT-2 (2 layers, width 32) instead of GPT-2-small's sizes (tests)")
    p.add_argument("--compile-models", default="mlp,resnet50,vit_small_patch16_224",
                   help="compile section: models (mlp or timm names)")
    p.add_argument("--compile-methods", default=",".join(COMPILE_METHODS),
                   help=f"compile section: methods, a subset of {','.join(COMPILE_METHODS)} (plain is always measured)")
    p.add_argument("--compile-backend", default="inductor", help="compile section: torch.compile's backend")
    p.add_argument("--compile-batch-size", type=int, default=16, help="compile section: batch size")
    p.add_argument("--compile-img-size", type=int, default=160, help="compile section: image side of the CNNs")
    p.add_argument("--compile-vit-img-size", type=int, default=112, help="compile section: image side of the ViTs")
    p.add_argument("--compile-repeats", type=int, default=3, help="compile section: interleaved rounds")
    p.add_argument("--compile-warmup", type=int, default=1, help="compile section: untimed rounds first")
    p.add_argument("--compile-threads", type=int, default=1, help="compile section: torch's CPU threads")
    p.add_argument("--out", default="figures/benchmark")
    p.add_argument("--child-memory", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; accepted: {','.join(METHODS)}")
    args.methods = ["plain"] + [m for m in args.methods if m != "plain"]
    for flag, values, accepted in (("--lora-methods", args.lora_methods, LORA_METHODS),
                                   ("--lora-memory-methods", args.lora_memory_methods, LORA_METHODS)):
        chosen = [m for m in values.split(",") if m]
        if set(chosen) - set(accepted):
            p.error(f"{flag}: unknown {sorted(set(chosen) - set(accepted))}; accepted: {','.join(accepted)}")
        setattr(args, flag[2:].replace("-", "_"), chosen)
    args.lora_methods = ["plain"] + [m for m in args.lora_methods if m != "plain"]
    chosen = [m for m in args.compile_methods.split(",") if m]
    if set(chosen) - set(COMPILE_METHODS):
        p.error(f"--compile-methods: unknown {sorted(set(chosen) - set(COMPILE_METHODS))}; accepted: "
                f"{','.join(COMPILE_METHODS)}")
    args.compile_methods = ["plain"] + [m for m in chosen if m != "plain"]
    args.lora_batch_size = args.lora_batch_size or (2 if args.lora_fast else 8)
    args.lora_seq_len = args.lora_seq_len or (16 if args.lora_fast else 128)
    args.curvature_kinds = [k for k in args.curvature_kinds.split(",") if k]
    args.glm_links = [k for k in args.glm_links.split(",") if k]
    for flag, values, accepted in (("--curvature-kinds", args.curvature_kinds, ("ef", "ggn")),
                                   ("--glm-links", args.glm_links, ("mc", "probit"))):
        if set(values) - set(accepted):
            p.error(f"{flag}: unknown {sorted(set(values) - set(accepted))}; accepted: {','.join(accepted)}")
    args.num_samples = sorted({1, *(int(s) for s in args.num_samples.split(",") if s)})
    return args


def regenerate_command(argv: list[str]) -> str:
    """The command line that reruns this script with ``argv``: the interpreter relative to the repository when it
    is inside it, and ``OMP_NUM_THREADS`` when it is set (it sets the CPU threads, which the timings depend on).
    """
    root = Path(__file__).resolve().parent.parent
    try:
        python = Path(sys.executable).absolute().relative_to(root).as_posix()
    except ValueError:
        python = "python"
    threads = os.environ.get("OMP_NUM_THREADS")
    prefix = f"OMP_NUM_THREADS={threads} " if threads else ""
    return f"{prefix}{python} scripts/benchmark.py {shlex.join(argv)}".rstrip()


def main(argv=None) -> dict | None:
    """Runs the selected sections and writes ``<out>.json``, ``<out>.md`` (and ``<out>.png``).

    Returns:
        The result dict that was written as JSON (``None`` in the memory child process).
    """
    args = parse_args(argv)
    if args.child_memory:
        return lora_child_memory(args) if args.child_memory[0] == "lora" else child_memory(args)
    bdl = load_bayesdll(args.bayesdll_src)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    sections = set(args.sections.split(","))
    result = {"device": device_name, "torch": torch.__version__,
              "command": regenerate_command(sys.argv[1:] if argv is None else list(argv)),
              "config": {k: v for k, v in vars(args).items() if k != "child_memory"},
              "bayesdll": {"path": bdl.path, "commit": bdl.commit} if bdl else None, "step": {}}
    if "step" in sections:
        result["step"] = step_section(args, device, bdl)
    if "curvature" in sections:
        result["curvature"] = curvature_section(args, device, bdl)
        result["curvature_backends"] = curvature_backends()
    if "mlp_epoch" in sections:
        print("mlp_epoch", flush=True)
        result["mlp_epoch"] = mlp_epoch(args, device, bdl)
        print(json.dumps(result["mlp_epoch"]["seconds"]), flush=True)
    if "predict" in sections:
        print(f"predict: {args.predict_model}", flush=True)
        result["predict"] = {args.predict_model: predictive(args, args.predict_model, device)}
        print(json.dumps({s: r["ratio"] for s, r in result["predict"][args.predict_model].items()}), flush=True)
    if "laplace" in sections:
        result["laplace"] = laplace_section(args, device, load_laplace_torch())
    if "lora" in sections:
        result["lora"] = lora_section(args)
    if "compile" in sections:
        def partial(section):  # a long section: its report so far after each model
            write_json(args.out + ".json", {**result, "compile": section})
            write_text(args.out + ".md", markdown({**result, "compile": section}))

        result["compile"] = compile_section(args, device, partial)
    result["targets"] = evaluate_targets(result)
    report = markdown(result)
    write_json(args.out + ".json", result)
    write_text(args.out + ".md", report)
    if result["step"]:
        figure(result, args.out + ".png")
    print(report)
    return result


if __name__ == "__main__":
    main()
