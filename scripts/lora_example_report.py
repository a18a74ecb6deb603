"""The report of scripts/lora_example.py: its tables, the discussion written from the numbers, the figure, the files.

The experiment (pretraining, LoRA fine-tuning, scoring) is in :mod:`scripts.lora_example`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from bayeswrap.app import experiments as ex
from bayeswrap.core.io import write_json, write_text
from bayeswrap.evaluation.plots import save_figure
from scripts.common import new_figure

STEM = "lora_example"
METRICS = ("error", "nll", "ece")
#: the reference every Bayesian adapter is compared with
REFERENCE = "map + TS"
LABELS = {"map": "MAP-LoRA", REFERENCE: "MAP-LoRA + TS", "vi": "VI", "blob": "BLoB (VI on A)", "ivon": "IVON",
          "laplace": "Laplace-LoRA (KFAC)", "ensemble": "LoRA ensemble (5)", "swag": "SWAG",
          "mc_dropout": "MC dropout (LoRA's dropout)", "tfb": "TFB (post hoc σ on A)"}
SET_LABELS = {"test": "test", "rotation": "rotated", "noise": "noisy"}


def cell(stat: dict) -> str:
    """``mean ± std`` to 3 decimals, or ``failed``."""
    return ex.fmt_or_failed(stat["mean"]) + ("" if not math.isfinite(stat["mean"]) else f" ± {stat['std']:.3f}")


def table_rows(data: dict, scale_of=lambda row: "T1") -> list[tuple[str, str, dict]]:
    """``(row name, scale, {set: {metric: stat}})`` in table order; ``map + TS`` follows ``map``."""
    out = []
    for row, r in data["results"].items():
        out.append((row, scale_of(row), {s: r[s][scale_of(row)] for s in data["sets"]}))
        if row == "map" and scale_of(row) == "T1":
            out.append((REFERENCE, "TS", {s: r[s]["TS"] for s in data["sets"]}))
    return out


def table(data: dict, scale_of=lambda row: "T1") -> str:
    """The Markdown table: error, NLL and ECE on every test set, mean ± std over seeds."""
    head = "| method | S | " + " | ".join(f"{SET_LABELS.get(s, s)} {m}" for s in data["sets"] for m in METRICS) + " |"
    lines = [head, "|---|---|" + "---|" * (len(data["sets"]) * len(METRICS))]
    for row, _scale, by_set in table_rows(data, scale_of):
        base = "map" if row == REFERENCE else row
        s = data["results"][base]["per_seed"][0].get("num_samples", "")
        name = row if row == REFERENCE or scale_of(row) == "T1" else f"{row} + TS"
        lines.append(f"| {name} | {s} | " + " | ".join(cell(by_set[st][m]) for st in data["sets"] for m in METRICS)
                     + " |")
    return "\n".join(lines)


def comparisons(data: dict) -> dict:
    """For each Bayesian row at T = 1: the scores (NLL and ECE on every set) where it beats MAP-LoRA + TS.

    Each entry holds the two means over seeds and whether the difference is *resolved*: the seeds share their splits,
    so the per-seed differences d are paired, and a difference counts as resolved when |mean d| > 2 · sd(d) / √n
    (n ≥ 2 seeds where both ran).
    """
    ref = data["results"]["map"]
    ref_runs = {x["seed"]: x for x in ref["per_seed"] if x["status"] == "ok"}
    out = {}
    for row, r in data["results"].items():
        if row == "map":
            continue
        pairs = [(x, ref_runs[x["seed"]]) for x in r["per_seed"] if x["status"] == "ok" and x["seed"] in ref_runs]
        better, worse = [], []
        for s in data["sets"]:
            for m in ("nll", "ece"):
                d = np.array([a["scores"][s]["T1"][m] - b["scores"][s]["TS"][m] for a, b in pairs])
                entry = {"score": f"{SET_LABELS.get(s, s)} {m.upper()}", "value": r[s]["T1"][m]["mean"],
                         "reference": ref[s]["TS"][m]["mean"],
                         "resolved": bool(len(d) > 1 and abs(d.mean()) > 2 * d.std(ddof=1) / math.sqrt(len(d)))}
                (better if entry["value"] < entry["reference"] else worse).append(entry)
        out[row] = {"better": better, "not_better": worse}
    return out


def discussion(data: dict) -> str:
    """Sentences written from the numbers: where each Bayesian adapter beats MAP-LoRA + TS, and where not."""
    comp = comparisons(data)
    lines = []
    for row, c in comp.items():
        def fmt(items):
            return ", ".join(f"{e['score']} ({e['value']:.3f} against {e['reference']:.3f}"
                             + ("" if e["resolved"] else ", not resolved") + ")" for e in items)
        if not math.isfinite(data["results"][row]["test"]["T1"]["nll"]["mean"]):
            lines.append(f"- {LABELS.get(row, row)}: failed (see the JSON for the message).")
            continue
        beats = f"beats MAP-LoRA + TS on {fmt(c['better'])}" if c["better"] else "beats MAP-LoRA + TS on no score"
        loses = f"; does not on {fmt(c['not_better'])}" if c["not_better"] else ", that is on every score"
        lines.append(f"- {LABELS.get(row, row)} {beats}{loses}.")
    total = 2 * len(data["sets"])

    def resolved(c, key):
        return [e["score"] for e in c[key] if e["resolved"]]

    everywhere = [f"{LABELS.get(r, r)} ({len(resolved(c, 'better'))} of them resolved)" for r, c in comp.items()
                  if len(c["better"]) == total]
    nowhere = [LABELS.get(r, r) for r, c in comp.items() if not c["better"]]
    head = (f"Against MAP-LoRA + temperature scaling (mean over seeds, NLL and ECE on the {len(data['sets'])} test "
            f"sets, {total} scores): "
            + (f"{', '.join(everywhere)} beat{'s' if len(everywhere) == 1 else ''} it on all {total}"
               if everywhere else f"no Bayesian adapter beats it on all {total}")
            + (f"; {', '.join(nowhere)} beat{'s' if len(nowhere) == 1 else ''} it on none." if nowhere else ".")
            + " A difference is marked *not resolved* where the paired per-seed differences d (the seeds share their "
            "splits) give |mean d| ≤ 2 · sd(d) / √n, or where there is one seed. Resolved:")
    for row, c in comp.items():
        won, lost = resolved(c, "better"), resolved(c, "not_better")
        head += (f" {LABELS.get(row, row)} better on {', '.join(won) or 'nothing'}"
                 f" and worse on {', '.join(lost) or 'nothing'};")
    head = head[:-1] + "."
    narrow = [f"{LABELS.get(row, row)} ({ratio:.1%})" for row, ratio in width_ratios(data).items()
              if 0 < ratio < 0.10]  # 0: a point estimate (MAP) or randomness not in the weights' std (dropout)
    if narrow:
        lines += ["", f"Posteriors narrower than 10 % of the adapters' RMS, whose samples stay close to their mean: "
                  f"{', '.join(narrow)} (mean posterior std / RMS of the posterior mean, below)."]
    return "\n".join([head, "", *lines])


def width_ratios(data: dict) -> dict[str, float]:
    """Mean posterior std over the adapters divided by the RMS of their posterior mean, mean over seeds, per row."""
    out = {}
    for row, r in data["results"].items():
        ok = [s for s in r["per_seed"] if s["status"] == "ok"]
        if ok:
            out[row] = float(np.mean([s["mean_posterior_std"] / max(s["posterior_mean_rms"], 1e-30) for s in ok]))
    return out


def cost_table(data: dict) -> str:
    """The posterior's mean std over the adapters and the seconds to fine-tune and to score every set, mean over
    seeds, per row.
    """
    ratios = width_ratios(data)
    lines = ["| method | optimizer | Bayesian parameters | mean posterior std | std / RMS of the mean | fit s | "
             "predict s |", "|---|---|---|---|---|---|---|"]
    for row, r in data["results"].items():
        ok = [s for s in r["per_seed"] if s["status"] == "ok"]
        if not ok:
            lines.append(f"| {row} | failed | | | | | |")
            continue
        lines.append(f"| {row} | {ok[0]['optimizer']} | {ok[0]['bayesian_parameters']} | "
                     f"{np.mean([s['mean_posterior_std'] for s in ok]):.2e} | {ratios[row]:.1%} | "
                     f"{np.mean([s['fit_seconds'] for s in ok]):.1f} | "
                     f"{np.mean([s['predict_seconds'] for s in ok]):.1f} |")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """NLL and ECE of every row (and MAP-LoRA + TS) on every test set, grouped bars with ± std."""
    rows = table_rows(data)
    fig = new_figure(figsize=(10, 3.9), layout="constrained")
    axes = fig.subplots(1, 2)
    width = 0.8 / len(data["sets"])
    for ax, metric in zip(axes, ("nll", "ece")):
        for k, s in enumerate(data["sets"]):
            means = [by_set[s][metric]["mean"] for _, _, by_set in rows]
            stds = [by_set[s][metric]["std"] for _, _, by_set in rows]
            ax.bar(np.arange(len(rows)) + (k - (len(data["sets"]) - 1) / 2) * width, means, width, yerr=stds,
                   label=SET_LABELS.get(s, s), capsize=2)
        ax.set_xticks(np.arange(len(rows)), [name for name, _, _ in rows], rotation=35, ha="right")
        ax.set_ylabel(metric.upper())
        ax.set_title(f"{metric.upper()} (lower is better)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=len(labels), fontsize=8)
    save_figure(fig, path, dpi=110)


def write_outputs(data: dict, cfg: dict, out: Path, *, fast: bool, runtime: float, argv: list[str],
                  rows: dict) -> tuple[Path, Path, Path]:
    """Writes the Markdown report, the JSON and the figure, each atomically; returns their paths."""
    md_path, json_path, png_path = out / f"{STEM}.md", out / f"{STEM}.json", out / f"{STEM}.png"
    command = " ".join([f"OMP_NUM_THREADS={torch.get_num_threads()}", ".venv/bin/python", f"scripts/{STEM}.py", *argv])
    plot(data, png_path)
    up, sz = data["upstream"], data["sizes"]
    text = "\n".join([
        "# Bayesian LoRA on a tiny GPT-2 pretrained by the script (digits as token sequences)",
        "",
        ("**FAST MODE: smoke test, not a result.**\n\n" if fast else "")
        + f"Produced by `{command}` in {runtime:.0f} s on the CPU ({torch.get_num_threads()} thread(s)). "
        f"Pretraining: a GPT-2 classifier ({cfg['model']['n_layer']} layers, width {cfg['model']['n_embd']}, "
        f"{up['num_parameters']:,} parameters, random init) trained on {up['train']} mnist5k digits at 8×8 "
        f"({cfg['pretrain']['epochs']} epochs, AdamW lr {cfg['pretrain']['lr']}); held-out error "
        f"{up['held_out_error']:.3f}, and {up['zero_shot_digits_error']:.3f} on sklearn's digits before fine-tuning. "
        f"LoRA fine-tuning on sklearn's digits: r = {cfg['lora']['r']}, α = {cfg['lora']['lora_alpha']} on "
        f"{', '.join(cfg['lora']['target_modules'])}; per seed {sz['train']} training, {sz['val']} validation and "
        f"{sz['test']} test images (class-balanced), {cfg['epochs']} epochs of batches of {cfg['batch_size']}, Adam lr "
        f"{cfg['lr']} (IVON: bw.optim.IVON lr {cfg['ivon_lr']}, β₂ {cfg['ivon_beta2']}), prior N(init, "
        f"{cfg['prior_std']}²) on the adapters, S = {cfg['num_samples']} samples (MAP: its point estimate; "
        "Laplace: the probit GLM). Shifts: the test images rotated by "
        f"{cfg['shifts']['rotation']:g}° and with Gaussian noise of std {cfg['shifts']['noise']:g} before tokenising. "
        f"Mean ± std over {len(cfg['seeds'])} seed(s) ({', '.join(map(str, cfg['seeds']))}); ECE top-label, 15 bins "
        "(`bayeswrap.evaluation.calibration.report`). The script's docstring has every detail.",
        "",
        "## Every method at temperature 1, and MAP-LoRA + temperature scaling",
        "",
        table(data),
        "",
        "## Discussion (written by the script from the numbers above)",
        "",
        discussion(data),
        "",
        "## Every method with temperature scaling (T fitted on the clean validation set)",
        "",
        table(data, scale_of=lambda row: "TS"),
        "",
        "## Posterior width and cost (mean over seeds)",
        "",
        cost_table(data),
        "",
        f"![NLL and ECE per method]({STEM}.png)",
        "",
    ])
    payload = {"fast": fast, "command": command, "argv": argv, "runtime_seconds": runtime,
               "threads": torch.get_num_threads(), "settings": cfg,
               "rows": {r: {"method": m, "options": o} for r, (m, o) in rows.items()},
               "comparisons": comparisons(data), **data}
    write_json(json_path, ex.jsonable(payload))
    write_text(md_path, text)
    return md_path, json_path, png_path
