"""The report of scripts/pretrained_prior_digits.py: its tables, discussion, figure and files.

The three settings compared and the metrics scored are defined here; the experiment itself (pretraining,
the few-label splits, fine-tuning and scoring) is in :mod:`scripts.pretrained_prior_digits`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from bayeswrap.core.io import write_json, write_text
from bayeswrap.evaluation.plots import save_figure
from scripts.common import new_figure

STEM = "pretrained_prior_digits"
SETTINGS = ("init", "zero", "random")
SETTING_LABELS = {
    "init": "(a) pretrained init, prior mean = pretrained",
    "zero": "(b) pretrained init, prior mean = 0",
    "random": "(c) random init, prior mean = 0",
}
METRICS = ("error", "nll", "ece")

TABLE_HEADER = "| method | setting | test error | test NLL | test ECE | S |"


def _cell(stat: dict) -> str:
    if not math.isfinite(stat["mean"]):
        return "failed"
    return f"{stat['mean']:.3f} ± {stat['std']:.3f}"


def table(by_method: dict) -> str:
    """The Markdown table of one (σ, label count): mean ± std over seeds per method and setting."""
    rows = [TABLE_HEADER, "|---|---|---|---|---|---|"]
    for method, by_setting in by_method.items():
        for setting, r in by_setting.items():
            rows.append(f"| {method} | {SETTING_LABELS[setting]} | {_cell(r['error'])} | {_cell(r['nll'])} "
                        f"| {_cell(r['ece'])} | {r['per_seed'][0]['num_samples']} |")
    return "\n".join(rows)


def grid_table(grid: dict, label_counts) -> str:
    """MAP validation NLL (error) for each σ of the grid, per label count and setting."""
    head = "| σ | " + " | ".join(f"{n}/class {s}" for n in label_counts for s in SETTINGS) + " | mean NLL |"
    rows = [head, "|" + "---|" * (2 + len(label_counts) * len(SETTINGS))]
    for sigma, entry in grid.items():
        cells = [f"{entry[str(n)][s]['nll']:.3f} ({entry[str(n)][s]['error']:.3f})"
                 for n in label_counts for s in SETTINGS]
        rows.append(f"| {sigma} | " + " | ".join(cells) + f" | {entry['mean_nll']:.3f} |")
    return "\n".join(rows)


def spread_table(results: dict) -> str:
    """Mean posterior std and RMS distance of the posterior mean from the pretrained weights (seed mean)."""
    rows = ["| σ | labels/class | method | " + " | ".join(f"{s}: std / from pretrained" for s in SETTINGS) + " |",
            "|" + "---|" * (3 + len(SETTINGS))]
    for sigma, by_n in results.items():
        for n, by_method in by_n.items():
            for method, by_setting in by_method.items():
                cells = []
                for s in SETTINGS:
                    ok = [r for r in by_setting[s]["per_seed"] if r["status"] == "ok"]
                    cells.append("failed" if not ok else
                                 f"{np.mean([r['mean_posterior_std'] for r in ok]):.3g} / "
                                 f"{np.mean([r['rms_from_pretrained'] for r in ok]):.3g}")
                rows.append(f"| {sigma} | {n} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _order(res: dict, metric: str) -> str:
    """Settings sorted from best to worst by the mean of ``metric`` (e.g. "init < zero < random")."""
    finite = {s: r[metric]["mean"] for s, r in res.items() if math.isfinite(r[metric]["mean"])}
    return " < ".join(sorted(finite, key=finite.get)) if finite else "all failed"


def _separated(a: dict, b: dict, metric: str) -> bool:
    """Whether mean(a) + std(a) < mean(b) − std(b): a is lower than b by more than a std on each side."""
    return a[metric]["mean"] + a[metric]["std"] < b[metric]["mean"] - b[metric]["std"]


def _pairs(by_method: dict, a: str, b: str) -> dict[str, list[str]]:
    """Methods where a ≫ b ("wins"), b ≫ a ("losses") and neither ("ties"), by test NLL."""
    out: dict[str, list[str]] = {"wins": [], "losses": [], "ties": []}
    for method, res in by_method.items():
        if any(r["failed_seeds"] for r in res.values()):
            continue
        key = ("wins" if _separated(res[a], res[b], "nll") else
               "losses" if _separated(res[b], res[a], "nll") else "ties")
        out[key].append(method)
    return out


def _gap(by_method: dict, worse: str, better: str) -> float:
    """Mean over methods of the test-NLL gap mean(worse) − mean(better)."""
    gaps = [res[worse]["nll"]["mean"] - res[better]["nll"]["mean"] for res in by_method.values()]
    return float(np.nanmean(gaps)) if gaps else float("nan")


def _seed_mean(res: dict, key: str) -> float:
    vals = [r[key] for r in res["per_seed"] if r["status"] == "ok" and key in r]
    return float(np.mean(vals)) if vals else float("nan")


def _who(pairs: dict[str, list[str]], a: str, b: str, total: int) -> str:
    text = f"{a} ≫ {b} for {len(pairs['wins'])}/{total}"
    if pairs["wins"] and len(pairs["wins"]) < total:
        text += f" ({', '.join(pairs['wins'])})"
    if pairs["losses"]:
        text += f", {b} ≫ {a} for {', '.join(pairs['losses'])}"
    return text


def summary(data: dict) -> str:
    """The answer in a few bullets, computed from the numbers: per σ, does init beat zero beat random?"""
    names = {v: k for k, v in data["prior_stds"].items()}
    results = data["results"]
    lines = []
    for sigma, by_n in results.items():
        parts, gaps = [], {}
        for n, by_method in by_n.items():
            total = len(by_method)
            gaps[n] = _gap(by_method, "zero", "init")
            parts.append(f"{n} labels (mean NLL gap zero − init {gaps[n]:+.3f} nats): "
                         f"{_who(_pairs(by_method, 'init', 'zero'), 'init', 'zero', total)}, "
                         f"{_who(_pairs(by_method, 'zero', 'random'), 'zero', 'random', total)}")
        few, many = min(gaps, key=int), max(gaps, key=int)
        trend = "larger" if gaps[few] > gaps[many] else "not larger"
        how = "tuned for MAP" if names[float(sigma)] == "tuned" else "fixed"
        lines.append(f"* **σ = {sigma} ({how}).** By test NLL, " + "; ".join(parts)
                     + f". The benefit of the pretrained prior mean is {trend} with fewer labels.")
    split = [f"{m} (σ = {s}, {n} labels: {res['init']['error']['mean']:.3f} vs {res['zero']['error']['mean']:.3f})"
             for s, by_n in results.items() for n, by_m in by_n.items() for m, res in by_m.items()
             if res["init"]["nll"]["mean"] < res["zero"]["nll"]["mean"]
             and res["zero"]["error"]["mean"] < res["init"]["error"]["mean"] - 0.005]
    if split:
        lines.append("* **NLL and error disagree** (init has the lower NLL, zero the lower test error) for "
                     f"{'; '.join(split)}: a tight zero-mean prior shrinks the weights, which makes the network "
                     "under-confident (high NLL and ECE) without always costing accuracy.")
    collapsed: dict[str, list[str]] = {}
    for s, by_n in results.items():
        for n, by_m in by_n.items():
            for m, res in by_m.items():
                for st, r in res.items():
                    if r["error"]["mean"] > 0.8:
                        collapsed.setdefault(f"σ = {s}", []).append(f"{m} {st} ({n})")
    if collapsed:
        lines.append("* **Runs that learned nothing** (test error > 0.8, near chance; labels per class in "
                     "brackets): " + "; ".join(f"{k}: {', '.join(v)}" for k, v in collapsed.items())
                     + ". A tight zero-mean prior pulls every weight to 0; from a random start, SGLD (no momentum, "
                     "Langevin noise) and IVON (posterior std ≈ 1/sqrt(N h₀) at the start) may not get out of "
                     "the noise within the step budget.")
    for method, what in (("laplace", "Laplace"), ("vi", "VI")):
        stds = [f"{_seed_mean(by_m[method]['init'], 'mean_posterior_std'):.3g} (σ = {s}, {n} labels)"
                for s, by_n in results.items() for n, by_m in by_n.items() if method in by_m]
        if not stds:
            continue
        if method == "laplace":
            lines.append(f"* **{what}'s mean posterior std** in (a) is {', '.join(stds)}: close to σ, i.e. the "
                         "diagonal curvature of 100-500 examples is small against the prior precision for most "
                         "weights and the linearised predictive is prior-dominated; that costs accuracy where σ "
                         "is large. Tuning its prior precision (e.g. by the marginal likelihood) would help but "
                         "would break the one-σ-for-all design.")
        else:
            lines.append(f"* **{what}'s mean posterior std** in (a) is {', '.join(stds)}, grown from init_std "
                         "1e-3 but far below σ (towards which the KL pulls the stds of weights the data do not "
                         "constrain): in this step budget VI behaves almost like MAP.")
    return "\n".join(lines)


def verdicts(data: dict, fast: bool) -> str:
    """Per σ, label count and method: the settings ordered by test NLL and error, and which gaps exceed a std."""
    lines = []
    if fast:
        lines.append("FAST MODE: a smoke test on tiny subsets with one seed and a few steps; the numbers say "
                     "nothing about the effect.\n")
    for sigma, by_n in data["results"].items():
        for n, by_method in by_n.items():
            lines.append(f"**σ = {sigma}, {n} labels per class** (settings from lowest to highest; "
                         "\"≫\" = lower by more than the two stds together):")
            for method, res in by_method.items():
                if any(r["failed_seeds"] for r in res.values()):
                    bad = [f"{s} ({r['failed_seeds']} seed(s))" for s, r in res.items() if r["failed_seeds"]]
                    lines.append(f"* {method}: runs failed: {', '.join(bad)}; the JSON holds the messages.")
                    continue
                pairs = []
                for a, b in (("init", "zero"), ("zero", "random"), ("init", "random")):
                    if _separated(res[a], res[b], "nll"):
                        pairs.append(f"{a} ≫ {b}")
                    elif _separated(res[b], res[a], "nll"):
                        pairs.append(f"{b} ≫ {a}")
                    else:
                        pairs.append(f"{a} ≈ {b}")
                lines.append(f"* {method}: NLL {_order(res, 'nll')} ({', '.join(pairs)}); "
                             f"error {_order(res, 'error')}.")
            lines.append("")
    return "\n".join(lines)


def effect(results: dict) -> dict:
    """Test NLL gaps (b) − (a) and (c) − (a), ``effect[σ][method][n]``; positive: setting (a) has the lower NLL."""
    out: dict = {}
    for sigma, by_n in results.items():
        for n, by_method in by_n.items():
            for method, res in by_method.items():
                out.setdefault(sigma, {}).setdefault(method, {})[n] = {
                    "zero_minus_init_nll": res["zero"]["nll"]["mean"] - res["init"]["nll"]["mean"],
                    "random_minus_init_nll": res["random"]["nll"]["mean"] - res["init"]["nll"]["mean"]}
    return out


def plot(data: dict, path: Path) -> None:
    """Test NLL per method, bars grouped by setting (mean ± std over seeds): one row per σ, one column per
    label count.
    """
    results = data["results"]
    sigmas = list(results)
    counts = list(results[sigmas[0]])
    fig = new_figure(figsize=(6.0 * len(counts), 3.6 * len(sigmas)), layout="constrained")
    axes = np.asarray(fig.subplots(len(sigmas), len(counts), squeeze=False))
    names = {v: k for k, v in data["prior_stds"].items()}
    width = 0.8 / len(SETTINGS)
    for row, sigma in enumerate(sigmas):
        for col, n in enumerate(counts):
            ax = axes[row, col]
            methods = list(results[sigma][n])
            xs = np.arange(len(methods))
            for i, setting in enumerate(SETTINGS):
                means = [results[sigma][n][m][setting]["nll"]["mean"] for m in methods]
                stds = [results[sigma][n][m][setting]["nll"]["std"] for m in methods]
                ax.bar(xs + (i - 1) * width, np.nan_to_num(means, nan=0.0), width, yerr=np.nan_to_num(stds),
                       capsize=2, color=f"C{i}", label=SETTING_LABELS[setting])
            ax.axhline(math.log(10), color="0.5", lw=0.8, ls=":")  # uniform prediction over 10 classes
            ax.set_xticks(xs)
            ax.set_xticklabels(methods)
            ax.set_ylabel("test NLL (nats)")
            ax.set_title(f"σ = {sigma} ({names.get(float(sigma), '')}), {n} labels per class", fontsize="medium")
            ax.set_ylim(0, 2.6)
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(SETTINGS), fontsize="small")
    fig.suptitle("Test NLL after Bayesian fine-tuning on 28×28 digits (dotted: uniform prediction, log 10)",
                 fontsize="medium")
    save_figure(fig, path)


DISCUSSION_TEXT = """\
### How to read this

* (a) vs (b) isolates the prior mean: both start from the pretrained weights and
  differ only in where the prior N(θ̄, σ² I) is centred. (b) vs (c) isolates the
  initialisation. The prior pulls with strength 1/(N σ²) per datum (N = 100 or
  500 here), so the prior mean can matter only where that pull is not
  negligible against the likelihood: with few labels and a small σ.
* "≫" means the two means differ by more than the sum of their standard
  deviations over the seeds; with three seeds that is a rough, not a formal,
  test. NLL 2.303 = log 10 with error ≈ 0.9 is a network that predicts the
  uniform distribution: the prior has pulled every weight to zero.
* How the prior mean enters each method: MAP, SGLD and Laplace have the
  Gaussian prior term (Laplace also puts its posterior variance, from σ where
  the data do not constrain a weight, around the MAP); VI's KL term pulls its
  means to θ̄ and its stds to σ; IVON's weight decay pulls its mean to θ̄;
  MC-dropout (BayesDLL's parameterisation) drops parameters *to the prior
  mean*, i.e. to the pretrained value in (a) and to zero in (b) and (c), so its
  samples differ between (a) and (b) even where the prior term is negligible.
* The posterior-spread table shows how broad each posterior ended up and how
  far its mean moved from the pretrained weights.

### What differs from BayesDLL

BayesDLL fine-tunes ImageNet-pretrained ResNet-101 / ViT-L-32 on Pets and
Flowers-102 for 100 epochs on a GPU, with tempered posteriors (``num_data``
inflated, small KL weights, SGLD noise 0.01). Here: a 27.5k-parameter CNN
pretrained on 5,000 MNIST digits, fine-tuned on 8×8 digits upsampled to 28×28
with 10 or 50 labels per class, 150 optimizer steps on a CPU, the untempered
posterior (``kl_weight = 1``, SGLD noise scale 1), and two σ values shared by
every method (σ* tuned for MAP on validation, and 0.1). Each method uses the
library's defaults otherwise (VI init_std 1e-3, MC-dropout p = 0.1, Laplace
diagonal GGN with the GLM predictive, IVON h₀ = 1, SGLD burn-in = the first
half of the steps).
"""


def write_outputs(data: dict, cfg: dict, out: Path, *, fast: bool, runtime: float, argv: list[str],
                  num_parameters: int) -> tuple[Path, Path, Path]:
    """Writes the Markdown report, the JSON and the figure, each atomically; returns their paths.

    ``num_parameters`` is the CNN's parameter count, recorded in the JSON.
    """
    md_path, json_path, png_path = out / f"{STEM}.md", out / f"{STEM}.json", out / f"{STEM}.png"
    plot(data, png_path)
    up = data["upstream"]
    counts = [str(n) for n in cfg["label_counts"]]
    names = {v: k for k, v in data["prior_stds"].items()}
    sections = []
    for sigma, by_n in data["results"].items():
        for n in counts:
            sz = data["sizes"][n]
            sections += [f"## σ = {sigma} ({names[float(sigma)]}), {n} labels per class "
                         f"({sz['train']} training, {sz['test']} test images per seed)", "",
                         table(by_n[n]), ""]
    text = "\n".join([
        "# Pretrained prior mean for Bayesian fine-tuning with few labels (BayesDLL Table 4's effect)",
        "",
        ("**FAST MODE: smoke test, not a result.**\n" if fast else "")
        + f"Produced by `{' '.join([f'scripts/{STEM}.py', *argv])}` in {runtime:.0f} s on the CPU "
        f"({torch.get_num_threads()} threads). Upstream: the CNN (27.5k parameters) trained on {up['train']} "
        f"mnist5k images ({up['epochs']} epochs, Adam, no prior), mnist5k test error {up['test_error']:.3f}. "
        f"Downstream: sklearn digits upsampled to 28×28; the pretrained network's error on them before any "
        f"fine-tuning is {data['zero_shot_error']:.3f}. Every run: {cfg['steps']} optimizer steps of "
        f"{cfg['batch_size']} images; Adam lr {cfg['lr']} (SGLD: bw.optim.SGLD lr {cfg['sgld_lr']}, noise scale "
        f"1; IVON: bw.optim.IVON lr {cfg['ivon_lr']}, β₂ {cfg['ivon_beta2']}); prior σ = σ* = "
        f"{data['prior_stds']['tuned']} (tuned for MAP on validation, below)"
        + (f" and σ = {data['prior_stds']['fixed']} (fixed, modest)" if "fixed" in data["prior_stds"] else "")
        + f". Test error, NLL and ECE (15 bins) of the posterior predictive with S = {cfg['num_samples']} "
        f"samples (S = 0, the point estimate, for MAP), mean ± std over {len(cfg['seeds'])} seed(s). The head "
        "(last linear layer) is kept from upstream in (a) and (b): both tasks have the same 10 classes.",
        "",
        *sections,
        "## Prior std, tuned once",
        "",
        f"MAP validation NLL (error in brackets) on the seed-{cfg['seeds'][0]} splits "
        f"({cfg['val_per_class']} validation images per class); σ* = {data['prior_stds']['tuned']} has the "
        f"lowest mean NLL over the {len(counts) * len(SETTINGS)} runs.",
        "",
        grid_table(data["prior_std_grid"], counts),
        "",
        "## Discussion",
        "",
        summary(data),
        "",
        "Per method:",
        "",
        verdicts(data, fast),
        DISCUSSION_TEXT,
        "### Posterior spread",
        "",
        "Mean posterior std over all parameters / RMS distance of the posterior mean from the pretrained "
        "weights (mean over seeds; the pretrained weights' own RMS is "
        f"{data['pretrained_rms']:.3g}):",
        "",
        spread_table(data["results"]),
        "",
        f"![test NLL per method and setting]({STEM}.png)",
        "",
    ])
    write_text(md_path, text)
    write_json(json_path, {
        "description": "Pretrained prior mean vs zero prior mean vs random initialisation for Bayesian fine-tuning "
                       "on sklearn digits (28x28) with few labels, after pretraining on mnist5k (BayesDLL, "
                       "arXiv:2309.12928, Table 4's effect). results[prior std][label count][method][setting] "
                       "holds the mean/std over seeds of the test error, NLL and ECE and the per-seed runs.",
        "fast": fast,
        "argv": argv,
        "runtime_seconds": runtime,
        "torch_threads": torch.get_num_threads(),
        "methods": list(next(iter(next(iter(data["results"].values())).values()))),
        "settings": SETTING_LABELS,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
        "model": "conv 8@3x3 - ReLU - maxpool 2 - conv 16@3x3 - ReLU - maxpool 2 - dense 64 - ReLU - dense 10",
        "num_parameters": num_parameters,
        "effect": effect(data["results"]),
        **data,
    })
    return md_path, json_path, png_path
