"""Section 6 (``lora``, not in the default ``--sections``): every method on LoRA adapters against plain peft LoRA.

The workload is a GPT-2-small-sized causal language model built from ``transformers.GPT2Config()``'s default sizes
(12 layers, width 768, 12 heads, vocabulary 50,257, about 124 M parameters; random init, nothing is downloaded),
with peft LoRA adapters (r = 8, alpha = 16, dropout 0.05) on ``c_attn`` (about 0.3 M trainable parameters), one batch
of random token ids (``--lora-batch-size`` 8 × ``--lora-seq-len`` 128) that are their own labels.

* ``plain``: plain peft LoRA fine-tuning, a hand-written torch step: ``AdamW`` over the peft model's trainable
  parameters, ``model(input_ids=..., attention_mask=..., labels=...).loss`` (the model's own causal-LM
  cross-entropy), ``backward``, ``step``.
* bayeswrap: ``bw.wrap(peft_model, method, num_data=N, params="adapters", likelihood="causal_lm")``, then
  ``bnn.loss(x, y).loss``, ``backward``, ``optimizer.step()``, ``bnn.after_step()``; ``AdamW`` with the same lr
  unless the method owns its optimizer (IVON: :class:`bw.optim.IVON`; SGLD: :class:`bw.optim.SGLD`).
  ``vi_blob`` is VI with ``params="adapters_A"`` (BLoB: a Gaussian on LoRA's A, B a point estimate);
  ``mc_dropout`` is ``mode="layers"`` (the model's own dropout, LoRA's included); ``sgld`` is past burn-in and
  keeps a draw every 10th step (its default thinning); ``swag`` collects every step (its most expensive setting);
  ``ensemble`` is 5 MAP members of the adapters (``bw.wrap(..., "ensemble", num_members=5)``), one step of all
  five (vmapped, the default: its step holds the five members' activations; the members share the frozen base);
  ``ensemble_checkpoint`` is that ensemble with ``parallel="checkpoint"`` (one member at a time under activation
  checkpointing: one member's activations live, a second forward per member); ``laplace`` (only when asked for, :data:`DEFAULT_LORA_METHODS`) is not a training
  step: the time is one KFAC fit over one batch (``fit_curvature``), reported only where the method accepts the
  causal-LM likelihood (otherwise a row says why not).

Time: wall-clock and process CPU time (robust to other load on a shared machine) of one step, in interleaved rounds
in one process (every method once per round, so drift of the machine's speed cancels in the ratios), one
thread; medians and the spread (min-max) over the rounds.

Peak memory: a fresh child process per method (so one method's freed-but-retained heap does not count against the
next, which a single process cannot separate) builds the same model and batch, runs one step (gradients and the
optimizer's state are allocated), resets the kernel's resident-set high-water mark (``/proc/self/clear_refs``),
runs a second step and reads ``VmHWM``: the peak resident set of a training step, including the Python and torch
runtime, the model's weights and everything the method adds. The resident set before the second step is reported
too, so the step's own transient memory (peak minus that) can be read off. RSS counts memory the allocator has
touched, not only what live tensors hold; the children fix glibc's mmap threshold at 128 KiB
(``MALLOC_MMAP_THRESHOLD_``), so freed tensors are returned to the system rather than kept in the heap and the
resident set follows the tensors closely. It is what the machine pays, the same way for every method.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import bayeswrap as bw
from bayeswrap.app import experiments as ex
from scripts.benchmarks.timing import interleaved

#: every method of the section, ``plain`` first
LORA_METHODS = ("plain", "map", "vi", "vi_blob", "ivon", "mc_dropout", "sgld", "swag", "ensemble",
                "ensemble_checkpoint", "laplace")
#: the methods ``--lora-methods`` measures by default: not ``laplace``, whose KFAC fit over a causal LM's
#: vocabulary-sized outputs is not cheap (``--lora-methods ...,laplace`` asks for it; on main it is refused)
DEFAULT_LORA_METHODS = tuple(m for m in LORA_METHODS if m != "laplace")
#: the members of the ensemble row
LORA_ENSEMBLE_MEMBERS = 5
#: the learning rate of every step (AdamW, IVON, SGLD)
LORA_LR = 1e-4
#: N, the sequences in the (notional) training set: the prior's data count
LORA_NUM_DATA = 10_000
#: LoRA's settings: rank, alpha, dropout, the adapted modules (GPT-2's fused q/k/v projection, a Conv1D)
LORA_CONFIG = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": ["c_attn"]}
#: the tiny configuration of ``--lora-fast`` (the test's)
FAST_SIZES = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 101, "n_positions": 32}
#: bytes: the memory children's glibc mmap threshold (its default start, fixed: see :func:`lora_peak_memory`)
MMAP_THRESHOLD = 128 * 1024
#: the script whose ``--child-memory lora METHOD`` mode measures one method's peak memory in a fresh process
SCRIPT = Path(__file__).resolve().parents[1] / "benchmark.py"


def lora_model(fast: bool) -> torch.nn.Module:
    """GPT-2 (``GPT2Config()``'s default sizes, or :data:`FAST_SIZES` when ``fast``), seeded, with peft LoRA.

    Returns:
        A ``peft.PeftModel`` of a ``GPT2LMHeadModel`` with :data:`LORA_CONFIG` adapters; the base is frozen.
    """
    import peft
    import transformers

    sizes = FAST_SIZES if fast else {}
    torch.manual_seed(0)
    config = transformers.GPT2Config(**sizes, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.GPT2LMHeadModel(config)
        return peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", fan_in_fan_out=True, **LORA_CONFIG))


def lora_batch(model: torch.nn.Module, batch_size: int, seq_len: int) -> tuple[dict, torch.Tensor]:
    """Random token ids ``(batch_size, seq_len)`` (seeded) as inputs (with an all-ones attention mask) and labels."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids.clone()


#: each row's registered method and its own ``bw.wrap`` options
ROWS = {"map": ("map", {}),
        "vi": ("vi", {}),
        "vi_blob": ("vi", {"params": "adapters_A"}),
        "ivon": ("ivon", {}),
        "mc_dropout": ("mc_dropout", {"mode": "layers"}),
        "sgld": ("sgld", {"burn_in": 0, "thinning": 10}),
        "swag": ("swag", {"swa_start": 0, "collect_every": 1, "swa_lr": None}),
        "ensemble": ("ensemble", {"num_members": LORA_ENSEMBLE_MEMBERS}),
        "ensemble_checkpoint": ("ensemble", {"num_members": LORA_ENSEMBLE_MEMBERS, "parallel": "checkpoint"}),
        "laplace": ("laplace", {"hessian_structure": "kron"})}


def wrap_options(method: str) -> tuple[str, dict]:
    """The registered method and the ``bw.wrap`` options of one row of the section."""
    kind, own = ROWS[method]
    return kind, {"num_data": LORA_NUM_DATA, "params": "adapters", "likelihood": "causal_lm", **own}


def make_lora_step(model: torch.nn.Module, method: str, x: dict, y: torch.Tensor):
    """A closure running one step of ``method`` on a copy of ``model`` (see the module docstring).

    Raises:
        ValueError: from ``bw.wrap`` when the method does not accept this model or likelihood.
    """
    if method == "plain":
        net = copy.deepcopy(model).train()
        opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=LORA_LR)

        def step():
            opt.zero_grad(set_to_none=True)
            net(**x, labels=y).loss.backward()
            opt.step()
        return step
    kind, options = wrap_options(method)
    bnn = bw.wrap(model, kind, **options).train()
    if method == "laplace":
        loader = [(x, y)]

        def fit():
            bnn.fit_curvature(loader)
        return fit
    opt = ex.own_optimizer(bnn, LORA_LR) or torch.optim.AdamW(bnn.param_groups(), lr=LORA_LR)

    def step():
        opt.zero_grad(set_to_none=True)
        bnn.loss(x, y).loss.backward()
        opt.step()
        bnn.after_step()
    return step


def build_steps(args, model, x, y) -> tuple[dict, dict]:
    """The steps of ``args.lora_methods`` that can be built, and the reason for each that cannot."""
    steps, skipped = {}, {}
    for m in args.lora_methods:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                steps[m] = make_lora_step(model, m, x, y)
        except (ValueError, NotImplementedError, TypeError) as err:
            skipped[m] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    return steps, skipped


def spread(values: list[float]) -> dict:
    """Median, min and max of a list of seconds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def lora_section(args) -> dict:
    """Times every method's step in interleaved rounds (and measures peak memory per method in child processes).

    Returns:
        ``config`` (sizes, batch, LoRA settings), ``methods`` (measured), ``skipped`` (method -> reason),
        ``seconds``/``cpu_seconds`` (medians), ``spread``/``cpu_spread`` (median, min, max),
        ``ratio``/``cpu_ratio`` (median over plain's median), ``all_seconds``/``all_cpu_seconds``, and unless
        ``--no-memory``: ``peak_mib``, ``before_step_mib`` and ``memory_ratio`` (peak over plain's peak).
    """
    torch.set_num_threads(args.lora_threads)
    model = lora_model(args.lora_fast)
    x, y = lora_batch(model, args.lora_batch_size, args.lora_seq_len)
    steps, skipped = build_steps(args, model, x, y)
    print(f"lora: {list(steps)} (skipped: {list(skipped)})", flush=True)
    wall, cpu = interleaved(steps, args.lora_repeats, args.lora_warmup, torch.device("cpu"))
    med = {m: statistics.median(v) for m, v in wall.items()}
    cpu_med = {m: statistics.median(v) for m, v in cpu.items()}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out = {"config": {"model": "GPT2LMHeadModel", **{k: getattr(model.config, k) for k in
                                                     ("n_layer", "n_embd", "n_head", "vocab_size")},
                      "params": sum(p.numel() for p in model.parameters()), "adapter_params": trainable,
                      "lora": LORA_CONFIG, "batch_size": args.lora_batch_size, "seq_len": args.lora_seq_len,
                      "num_data": LORA_NUM_DATA, "lr": LORA_LR, "threads": torch.get_num_threads(),
                      "repeats": args.lora_repeats, "warmup": args.lora_warmup, "fast": args.lora_fast},
           "methods": list(steps), "skipped": skipped,
           "seconds": med, "cpu_seconds": cpu_med,
           "spread": {m: spread(v) for m, v in wall.items()}, "cpu_spread": {m: spread(v) for m, v in cpu.items()},
           "ratio": {m: med[m] / med["plain"] for m in med}, "cpu_ratio": {m: cpu_med[m] / cpu_med["plain"]
                                                                           for m in cpu_med},
           "all_seconds": wall, "all_cpu_seconds": cpu}
    print(json.dumps({"ratio": out["ratio"], "cpu_ratio": out["cpu_ratio"]}), flush=True)
    del steps
    if not args.no_memory:
        wanted = [m for m in (args.lora_memory_methods or out["methods"]) if m in out["methods"] and m != "laplace"]
        if "plain" not in wanted:
            wanted.insert(0, "plain")
        with ThreadPoolExecutor(max_workers=max(1, args.lora_memory_jobs)) as pool:  # separate processes:
            mem = dict(zip(wanted, pool.map(lambda m: lora_peak_memory(args, m), wanted)))  # VmHWM is each one's
        failed = {m: v["error"] for m, v in mem.items() if "error" in v}
        mem = {m: v for m, v in mem.items() if "error" not in v}
        out["peak_mib"] = {m: v["peak_mib"] for m, v in mem.items()}
        out["before_step_mib"] = {m: v["before_step_mib"] for m, v in mem.items()}
        if "plain" in mem:
            out["memory_ratio"] = {m: v / out["peak_mib"]["plain"] for m, v in out["peak_mib"].items()}
        if failed:
            out["memory_errors"] = failed
        print(json.dumps({"peak_mib": out["peak_mib"], "memory_errors": failed}), flush=True)
    return out


def lora_peak_memory(args, method: str) -> dict:
    """Runs :func:`lora_child_memory` for ``method`` in a fresh process.

    Returns:
        Its ``peak_mib`` and ``before_step_mib``, or ``{"error": ...}`` when the child failed.
    """
    cmd = [sys.executable, str(SCRIPT), "--child-memory", "lora", method,
           "--lora-batch-size", str(args.lora_batch_size), "--lora-seq-len", str(args.lora_seq_len),
           "--lora-threads", str(args.lora_threads)] + (["--lora-fast"] if args.lora_fast else [])
    # a fixed mmap threshold turns off glibc's dynamic one, which after the first step keeps freed tensors of up to
    # 32 MiB in the heap: every tensor over 128 KiB is then mapped on allocation and returned on free, so the
    # resident set follows what the tensors hold rather than what the allocator kept
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:  # e.g. killed for memory: reported, and the other methods are still measured
        tail = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        return {"error": f"the memory child failed (exit status {out.returncode}): {tail[:300]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _status_kib(field: str) -> int | None:
    with open("/proc/self/status") as fh:
        return next((int(line.split()[1]) for line in fh if line.startswith(f"{field}:")), None)


def lora_child_memory(args) -> None:
    """Body of ``--child-memory lora METHOD``: prints JSON ``{"peak_mib", "before_step_mib"}`` of a second step."""
    import resource

    method = args.child_memory[1]
    torch.set_num_threads(args.lora_threads)
    model = lora_model(args.lora_fast)
    x, y = lora_batch(model, args.lora_batch_size, args.lora_seq_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = make_lora_step(model, method, x, y)
    del model  # plain trains its own copy, and bw.wrap clones the tensors it keeps (as step.py's child)
    gc.collect()
    step()  # the first step allocates gradients and the optimizer's state
    before = _status_kib("VmRSS")
    try:  # reset the resident-set high-water mark (Linux): building the model peaks higher than some steps
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    step()
    hwm = _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mib": hwm / 1024, "before_step_mib": (before or 0) / 1024}))
