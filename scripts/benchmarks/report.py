"""The benchmark's Markdown report (one table per section, with target and status columns) and its figure."""

from __future__ import annotations

from bayeswrap.evaluation.plots import new_figure, save_figure
from scripts.benchmarks.compile import compile_markdown
from scripts.benchmarks.epoch import ENSEMBLE_MEMBERS
from scripts.benchmarks.targets import status
from scripts.benchmarks.workloads import LR


def markdown(result: dict) -> str:
    """The Markdown report: one table per section, with target and status columns."""
    cfg = result["config"]
    checks = result.get("targets", [])

    def find(section, key, prefix):
        return [c for c in checks if c["section"] == section and c["key"] == key and c["item"].startswith(prefix)]

    device_is_cpu = result["device"].startswith("CPU")
    lines = [f"Regenerate: `{result['command']}`", ""] if result.get("command") else []
    lines.append(f"# bayeswrap benchmark ({result['device']})")
    if any(result.get(k) for k in ("step", "curvature", "mlp_epoch", "predict")):  # their shared settings
        lines += ["", f"input {cfg['img_size']}x{cfg['img_size']}, amp={cfg['amp']}, medians of {cfg['repeats']} "
                  f"interleaved rounds; torch {result['torch']}; optimizer: SGD with momentum 0.9, lr {LR:g} (fused "
                  "kernel where supported) for plain training and every SGD-trained method (SGLD: bw.optim.SGLD, "
                  "IVON: bw.optim.IVON).",
                  "Time ratios are wall-clock; on CPU the ratio of process CPU time is given too (robust to other "
                  "load), and the step targets are checked on it. Peak memory: CUDA max allocated, or on CPU the max RSS of a fresh process per "
                  "configuration.", ""]
    if result.get("bayesdll"):
        b = result["bayesdll"]
        lines += ([""] if lines[-1] else []) + [
                  f"BayesDLL: `{b['path']}` (commit {b['commit']}), imported at run time. Its step is the body of "
                  "its own `Runner.train_one_epoch` loop: `runner.model(...)` (their `Model.forward`: sampling into "
                  "the workhorse net, forward, backward, prior/KL gradients) then `runner.optimizer.step()` (their "
                  "torch SGD, momentum 0.9, the same lr), on the same model weights and batch, in the same rounds; "
                  "per-batch bookkeeping (train error, tqdm) excluded; SGLD: burn-in steps (bayeswrap's SGLD is "
                  "past burn-in and keeps a draw every 10th step, its default thinning).", ""]
    if result.get("step"):
        lines += ["## Training step: time and peak memory (ratios to plain)", "",
                  "| model | params (M) | method | step | ratio | " + ("CPU-time ratio | " if device_is_cpu else "")
                  + "peak memory | target | status |",
                  "|---|---|---|---|---|" + ("---|" if device_is_cpu else "") + "---|---|---|"]
        for key, r in result["step"].items():
            for m in r["methods"]:
                mem = r.get("peak_mib", {}).get(m)
                mem_txt = f"{mem:.0f} MiB ({mem / r['peak_mib']['plain']:.2f}x)" if mem else "—"
                cpu_txt = f"{r['cpu_ratio'][m]:.2f}x | " if device_is_cpu else ""
                target, stat = status(find("step", key, f"{m} "))
                lines.append(f"| {key} | {r['params'] / 1e6:.2f} | {m} | {r['seconds'][m] * 1e3:.1f} ms | "
                             f"{r['ratio'][m]:.2f}x | {cpu_txt}{mem_txt} | {target} | {stat} |")
        rows = [(key, m, v, r["cpu_ours_over_theirs"][m]) for key, r in result["step"].items()
                for m, v in r.get("ours_over_theirs", {}).items()]
        if rows:
            lines += ["", "### bayeswrap / BayesDLL step time", "",
                      "| model | comparison | wall ratio | CPU-time ratio | target | status |",
                      "|---|---|---|---|---|---|"]
            names = {"vi": "VI", "mc_dropout": "MC-dropout", "sgld": "SGLD"}
            for key, m, v, c in rows:
                target, stat = status(find("step", key, f"{m} time / bayesdll"))
                lines.append(f"| {key} | bayeswrap {names[m]} / BayesDLL {names[m]} | {v:.2f}x | {c:.2f}x | "
                             f"{target} | {stat} |")
    if result.get("curvature"):
        theirs = result.get("bayesdll") is not None
        loops = "the naive loop and BayesDLL's `la` `Runner.estimate_variance` (its own code, driven with a " \
                "one-batch loader)" if theirs else "the naive loop"
        backends = ", ".join(b or "default" for b in result["curvature_backends"])
        lt_version = next((c.get("laplace_torch") for c in result["curvature"].values() if c.get("laplace_torch")),
                          None)
        lines += ["", "## Laplace curvature (examples/s, eval mode, one batch, all weights)", "",
                  "Like with like: bayeswrap's empirical Fisher (`curvature=\"empirical_fisher\"`) against loops of "
                  f"one backward pass per example ({loops}) and laplace-torch's empirical Fisher; bayeswrap's exact "
                  "diagonal GGN (`curvature=\"ggn\"`, K vectors per example) against laplace-torch's GGN, with its "
                  "ratio to the naive loop (a different quantity) for scale. Every fit is `fit_curvature` (or "
                  "laplace-torch's `fit`) on a one-batch loader, over all weights (`subset_of_weights=\"all\"`); "
                  "its fixed costs (the posterior variances, the log-likelihood forward, the checks) are included. "
                  + (f"laplace-torch {lt_version}: `Laplace(model, \"classification\", subset_of_weights=\"all\", "
                     "hessian_structure=\"diag\", backend=...)` on a deep copy, `la.fit(loader)`; `CurvlinopsGGN` is "
                     "its default backend; `laplace_torch_<ef|ggn>_<curvlinops|backpack>`. " if lt_version else "")
                  + f"bayeswrap curvature backends: {backends} (`bayeswrap_<ef|ggn>_<backend>`). Speed-ups are "
                  "ratios of examples/s by wall clock and, in brackets, by process CPU time (robust to other load).",
                  "", "| model | params (M) | examples | curvature | examples/s | speed-up vs naive loop | "
                  "speed-up vs laplace-torch (same curvature) | " + ("speed-up vs BayesDLL la | " if theirs else "")
                  + "target | status |",
                  "|---|---|---|---|---|---|---|" + ("---|" if theirs else "") + "---|---|"]

        def ratio(c, key):
            wall, cpu = c["speedup"].get(key), c.get("speedup_cpu", {}).get(key)
            return "—" if wall is None else f"{wall:.2f}x" + ("" if cpu is None else f" ({cpu:.2f}x)")

        for name, c in result["curvature"].items():
            eps = c["examples_per_s"]
            shape = "×".join(str(v) for v in c.get("input", []))
            label = name if c["img_size"] is None else f"{name} ({c['img_size']}²)"
            label += f" [{shape}]" if shape and name != "mlp" else ""
            for k, v in eps.items():
                vs_lt = "; ".join(f"{t.rsplit('_', 1)[1]} {ratio(c, f'{k}/{t}')}" for t in eps
                                  if t.startswith("laplace_torch_") and f"{k}/{t}" in c["speedup"]) or "—"
                target, stat = status(find("curvature", name, f"speed-up {k}/"))
                theirs_txt = f"{ratio(c, f'{k}/bayesdll_la')} | " if theirs else ""
                lines.append(f"| {label} | {c['params'] / 1e6:.2f} | {c['examples']} | {k} | {v:.1f} | "
                             f"{ratio(c, f'{k}/naive_loop')} | {vs_lt} | {theirs_txt}{target} | {stat} |")
            for k, error in c.get("errors", {}).items():
                lines.append(f"| {label} | {c['params'] / 1e6:.2f} | {c['examples']} | {k} | "
                             f"{'' if error.startswith('skipped') else 'failed: '}{error.splitlines()[0][:140]} | "
                             "— | — | " + ("— | " if theirs else "") + "— | — |")
        agreements = [(name, k, v) for name, c in result["curvature"].items()
                      for k, v in c.get("agreement", {}).items()]
        if agreements:
            lines += ["", "Same curvature as laplace-torch (largest absolute difference of the one-batch diagonal "
                      "over laplace-torch's largest entry, float32):", "",
                      "| model | ours / theirs | max rel. diff |", "|---|---|---|"]
            lines += [f"| {name} | {k} | {v:.1e} |" for name, k, v in agreements]
    if result.get("mlp_epoch"):
        e = result["mlp_epoch"]
        ours_theirs = e.get("ours_over_theirs", {})
        lines += ["", f"## Small-MLP epoch (digits, {e['train_examples']} examples, batch {e['batch_size']}, "
                      f"{e['batches']} steps; 64-100-100-10 MLP)", "",
                  "bayeswrap: `bw.fit(bnn, loader, epochs=1, optimizer=SGD(momentum=0.9), progress=False)`."
                  + (" BayesDLL: its `Runner.train_one_epoch(loader)` as shipped (always draws a tqdm bar, here into "
                     "a discarded buffer); `*_no_bar`: its step body looped over the same loader, for reference."
                     if ours_theirs else " The target (ours ≤ BayesDLL's) needs `--bayesdll-src`."), ""]
        if ours_theirs:
            lines += ["| configuration | epoch | CPU time | ours / theirs (wall) | ours / theirs (CPU time) | target | "
                      "status |", "|---|---|---|---|---|---|---|"]
        else:
            lines += ["| configuration | epoch | CPU time |", "|---|---|---|"]
        for k, v in e["seconds"].items():
            row = f"| {k} | {v * 1e3:.1f} ms | {e['cpu_seconds'][k] * 1e3:.1f} ms |"
            if ours_theirs:
                ratio, cpu_ratio, target, stat = "—", "—", "—", "—"
                for pair, r in ours_theirs.items():
                    if pair.endswith("/" + k):
                        ratio = f"{r:.2f}x ({pair})"
                        cpu_ratio = f"{e['cpu_ours_over_theirs'][pair]:.2f}x"
                        target, stat = status(find("mlp_epoch", "digits MLP", f"epoch time {pair}"))
                row += f" {ratio} | {cpu_ratio} | {target} | {stat} |"
            lines.append(row)
        if "ensemble_over_map" in e:
            r = e["ensemble_over_map"]
            target, stat = status(find("mlp_epoch", "digits MLP", f"ensemble{ENSEMBLE_MEMBERS} (vmap)"))
            lines += ["", f"A {ENSEMBLE_MEMBERS}-member deep ensemble (`bw.wrap(model, \"ensemble\")`, the same `bw.fit` "
                      f"call) costs {r['vmap']:.2f}x one MAP epoch with its members vmapped and {r['sequential']:.2f}x "
                      f"with them one after another (target {target}: {stat})."]
    if result.get("predict"):
        lines += ["", "## Posterior predictive: predict(x, S) vs S plain forwards", "",
                  "VI: `predict(x, num_samples=S)`; Laplace GLM: `predict(x, num_samples=S, pred_type=\"glm\", "
                  "link_approx=\"mc\" | \"probit\")` after `fit_curvature` on the batch (probit does not depend "
                  "on S).", "",
                  "| model | S | predictive | time | S forwards | ratio | target | status |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, per_s in result["predict"].items():
            for s, r in per_s.items():
                for k, ratio in r["ratio"].items():
                    item = {"vi": "vi predict /", "glm_mc": "glm_mc /", "glm_probit": "glm_probit /"}[k]
                    target, stat = status(find("predict", f"{name} S={s}", item))
                    lines.append(f"| {name} | {s} | {k} | {r['seconds'][k] * 1e3:.1f} ms | "
                                 f"{r['seconds']['plain_forwards'] * 1e3:.1f} ms | {ratio:.2f}x | {target} | {stat} |")
    if result.get("laplace"):
        lines += laplace_markdown(result["laplace"], result["torch"], find)
    if result.get("lora"):
        lines += lora_markdown(result["lora"], find)
    if result.get("compile"):
        lines += compile_markdown(result["compile"])
    if checks:
        met = sum(c["met"] for c in checks)
        lines += ["", f"Targets: {met} of {len(checks)} met."]
    return "\n".join(lines) + "\n"


def laplace_markdown(lap: dict, torch_version: str, find) -> list[str]:
    """The laplace section's tables: times with ratios and targets, then the agreement of the two predictives."""
    lt = lap["laplace_torch"]
    src = lap["source"]
    modified = (f" with uncommitted changes in {', '.join(f'`{m}`' for m in src['modified'])}"
                if src["modified"] else "")
    lines = ["", "## Laplace: bayeswrap against laplace-torch (KFAC, eval mode, prior precision 1)", "",
             f"torch {torch_version}; bayeswrap at commit {src['commit']}{modified}. "
             + (f"laplace-torch {lt['version']} in the same process, its default backend ({lt['backend']}; exact "
                "GGN KFAC), on a deep copy of the same weights, the same unshuffled loader and N. "
                if lt else "laplace-torch is not importable here: its columns are left out and the targets against "
                           "it are not evaluated. ")
             + "Ours: `bw.wrap(model, \"laplace\", num_data=N, prior_std=1.0, hessian_structure=\"kron\", "
               "subset_of_weights=...)`, `bnn.fit_curvature(loader)`, `bnn.predict(x, pred_type=\"glm\", "
               "link_approx=\"probit\")`. Theirs: `Laplace(model, \"classification\", subset_of_weights=..., "
               "hessian_structure=\"kron\")`, `la.fit(loader)`, `la(x, pred_type=\"glm\", "
               "link_approx=\"probit\")`. The forward is `model(x).softmax(-1)` under `torch.no_grad()`. "
               "Untrained weights and random images with random labels (the MLP: sklearn's digits); medians of "
               f"{lap['repeats']} interleaved rounds after one warm-up; ratios are bayeswrap's time over the "
               "reference's (wall-clock, and process CPU time, which other load on the machine affects less).", "",
             "| model | Bayesian params | data | operation | bayeswrap | reference | ratio | CPU-time ratio | target "
             "| status |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = (("last_layer", "last-layer KFAC fit", "fit", "laplace_torch", "fit_vs_laplace_torch",
             "last-layer KFAC fit / laplace-torch"),
            ("last_layer", "GLM probit predictive", "predict", "laplace_torch", "predict_vs_laplace_torch",
             "GLM probit / laplace-torch"),
            ("last_layer", "GLM probit predictive", "predict", "forward", "predict_vs_forward",
             "GLM probit / 1 forward"),
            ("all_weights", "all-weights KFAC fit", "fit", "laplace_torch", "fit_vs_laplace_torch",
             "all-weights KFAC fit / laplace-torch"),
            ("all_weights", "all-weights GLM probit predictive", "predict", "laplace_torch",
             "predict_vs_laplace_torch", None))
    names = {"laplace_torch": "laplace-torch", "forward": "1 forward"}
    for part in ("last_layer", "all_weights"):
        for name, r in lap[part].items():
            label = f"{name} ({r['img_size']}²)" if part == "last_layer" else name
            for row_part, op_text, op, ref, key, item in rows:
                if row_part != part:
                    continue
                data = (f"{r['train_examples']} train (batch {r['batch_size']})" if op == "fit"
                        else f"{r['test_examples']} test")
                ours = r["seconds"][f"{op}_bayeswrap"]
                if key in r["ratio"]:
                    theirs = r["seconds"][f"{op}_{ref}"]
                    cpu_ratio = r["cpu_seconds"][f"{op}_bayeswrap"] / r["cpu_seconds"][f"{op}_{ref}"]
                    target, stat = status(find("laplace", name, item)) if item else ("—", "—")
                    lines.append(f"| {label} | {r['bayesian_params']:,} | {data} | {op_text} | {ours * 1e3:.1f} ms | "
                                 f"{names[ref]} {theirs * 1e3:.1f} ms | {r['ratio'][key]:.2f}x | {cpu_ratio:.2f}x | "
                                 f"{target} | {stat} |")
                else:
                    lines.append(f"| {label} | {r['bayesian_params']:,} | {data} | {op_text} | {ours * 1e3:.1f} ms | "
                                 f"{names[ref]}: not measured | — | — | — | — |")
    agreeing = [(part, name, r["agreement"]) for part in ("last_layer", "all_weights")
                for name, r in lap[part].items() if "agreement" in r]
    if agreeing:
        lines += ["", "### Do both compute the same predictive?", "",
                  "On the test inputs, at the same weights and prior precision: the largest difference between "
                  "the two probit predictives' probabilities, next to the largest difference between the probit "
                  "predictive and the MAP's softmax (the size of the effect compared), and the largest difference "
                  "of the functional variances diag(J P⁻¹ Jᵀ), relative to laplace-torch's largest.", "",
                  "| model | subset | max abs diff, probit ours vs theirs | max abs diff, probit vs MAP | "
                  "max rel. diff of the functional variance | median functional variance |",
                  "|---|---|---|---|---|---|"]
        for part, name, a in agreeing:
            lines.append(f"| {name} | {part.replace('_', ' ')} | {a['probit_max_abs_diff']:.2e} | "
                         f"{a['probit_vs_map_max_abs_diff']:.2e} | {a['f_var_max_rel_diff']:.2e} | "
                         f"{a['f_var_median']:.3g} |")
    return lines


def lora_markdown(lora: dict, find) -> list[str]:
    """The lora section's table: each method's step time and peak memory, with ratios to plain peft LoRA."""
    c = lora["config"]
    size = (f"GPT-2 ({c['n_layer']} layers, width {c['n_embd']}, {c['n_head']} heads, vocabulary {c['vocab_size']}; "
            f"{c['params'] / 1e6:.1f} M parameters, {c['adapter_params'] / 1e3:.1f} k in the LoRA adapters)")
    lines = ["", f"## LoRA fine-tuning: each method against plain peft LoRA ({'tiny, --lora-fast' if c['fast'] else ''}"
             f"{'' if c['fast'] else 'GPT-2-small sizes'}, CPU, {c['threads']} thread)", "",
             f"{size}, random init; peft LoRA r={c['lora']['r']}, alpha={c['lora']['lora_alpha']}, dropout "
             f"{c['lora']['lora_dropout']} on {', '.join(c['lora']['target_modules'])}; one batch of "
             f"{c['batch_size']} × {c['seq_len']} random tokens (their own labels), causal-LM loss. Plain: AdamW "
             f"(lr {c['lr']:g}) over the peft model's trainable parameters, `model(**x, labels=y).loss`. bayeswrap: "
             f"`bw.wrap(peft_model, method, num_data={c['num_data']}, params=\"adapters\", "
             "likelihood=\"causal_lm\")`, `bnn.loss(x, y).loss`, the same AdamW unless the method owns its "
             "optimizer (IVON, SGLD), `bnn.after_step()`. vi_blob: `params=\"adapters_A\"` (BLoB); "
             "mc_dropout: `mode=\"layers\"`; sgld: past burn-in, a draw kept every 10th step; swag: collects every "
             "step; ensemble: 5 MAP members, one step of all; laplace: one KFAC `fit_curvature` over the batch (not "
             "a training step, no target). Rows not asked for (`--lora-methods`) are absent.",
             f"Time: medians of {c['repeats']} interleaved rounds after {c['warmup']} warm-up round(s), in one "
             "process, with the spread (min-max over the rounds) beside each. The targets are read on the ratio of "
             "process CPU time (one thread: the work done, less affected by other load on a shared machine than "
             "the wall clock, whose ratio is shown too); a ratio within the rounds' spread of 1 is no measured "
             "difference.",
             "Peak memory: a fresh process per method builds the same model and batch, runs one step, resets the "
             "resident-set high-water mark and reads it (VmHWM) over a second step: the whole process (runtime, "
             "weights, the method's state, the step's transient tensors), with glibc's mmap threshold fixed at "
             "128 KiB so that freed tensors leave the resident set. 'before step' is the resident set just before "
             "that second step (weights, gradients, optimizer and posterior state).", "",
             "| method | step (wall) | wall spread | CPU time | CPU spread | wall ratio | CPU-time ratio | peak memory "
             "| before step | memory ratio | target | status |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in lora["methods"]:
        sp = lora["spread"][m]
        peak, before = lora.get("peak_mib", {}).get(m), lora.get("before_step_mib", {}).get(m)
        ratio = lora.get("memory_ratio", {}).get(m)
        mem = (f"{peak:.0f} MiB | {before:.0f} MiB | " + (f"{ratio:.3f}x" if ratio else "—")) if peak else "— | — | —"
        target, stat = status(find("lora", "GPT-2 LoRA", f"{m} "))
        cs = lora["cpu_spread"][m]
        lines.append(f"| {m} | {sp['median'] * 1e3:.1f} ms | {sp['min'] * 1e3:.1f}–{sp['max'] * 1e3:.1f} ms | "
                     f"{cs['median'] * 1e3:.1f} ms | {cs['min'] * 1e3:.1f}–{cs['max'] * 1e3:.1f} ms | "
                     f"{lora['ratio'][m]:.3f}x | {lora['cpu_ratio'][m]:.3f}x | {mem} | {target} | {stat} |")
    for m, why in lora.get("memory_errors", {}).items():
        lines.append(f"| {m} | peak memory not measured: {why} |" + " — |" * 10)
    for m, why in lora.get("skipped", {}).items():
        lines.append(f"| {m} | not measured: {why} |" + " — |" * 10)
    return lines


def figure(result: dict, path: str) -> None:
    """Step-time ratios to plain against model size, one line per method and batch size."""
    fig = new_figure(figsize=(6, 4))
    ax = fig.subplots()
    for bs in sorted({r["batch_size"] for r in result["step"].values()}):
        names = sorted((n for n, r in result["step"].items() if r["batch_size"] == bs),
                       key=lambda n: result["step"][n]["params"])
        sizes = [result["step"][n]["params"] / 1e6 for n in names]
        for m in result["step"][names[0]]["methods"]:
            if m != "plain":
                ax.plot(sizes, [result["step"][n]["ratio"][m] for n in names], marker="o",
                        ls="--" if m.startswith("bayesdll_") else "-", label=f"{m}, batch {bs}")
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

