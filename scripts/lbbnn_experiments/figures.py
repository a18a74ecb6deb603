"""The report's figures: predictive entropy on the clusters, density and accuracy over the training budget."""

from __future__ import annotations

import math
from pathlib import Path

from bayeswrap.evaluation.plots import new_figure, save_figure
from scripts.lbbnn_experiments.settings import CLUSTER_METHODS


def plot_clusters(res: dict, path: Path, cfg: dict) -> None:
    """Three panels (one per method) of the predictive entropy, same colour scale, training points on top."""
    h = cfg["half_width"]
    fig = new_figure(figsize=(13.5, 4.4), layout="constrained")
    axes = fig.subplots(1, len(CLUSTER_METHODS))
    x, y = res["train"]
    image = None
    for ax, name in zip(axes, CLUSTER_METHODS):
        image = ax.imshow(res["entropy"][name], origin="lower", extent=(-h, h, -h, h), vmin=0.0, vmax=math.log(3),
                          cmap="viridis", interpolation="nearest", aspect="equal")
        for k, marker in zip(range(3), ("o", "s", "^")):
            ax.scatter(x[y == k, 0], x[y == k, 1], s=9, marker=marker, c="white", edgecolors="black",
                       linewidths=0.4)
        s = res["summary"][name]
        ax.set_title(f"{name} (S = {s['num_samples']}): mean entropy > 2 from data {s['mean_entropy_far']:.2f}",
                     fontsize="small")
        ax.set_xlabel("x₁")
        ax.set_ylabel("x₂")
    fig.colorbar(image, ax=list(axes), label="predictive entropy (nats; max log 3)", shrink=0.9)
    fig.suptitle("Predictive entropy on three 2-D Gaussian clusters, MLP 2-50-50-3", fontsize="medium")
    save_figure(fig, path)


def plot_budget(data: dict, path: Path) -> None:
    """Density against Σ lr, and validation MPM accuracy against density, along training (every seed)."""
    fig = new_figure(figsize=(11.5, 4.2), layout="constrained")
    ax_d, ax_a = fig.subplots(1, 2)
    colours = {"LBBNN": "tab:blue", "LBBNN-LRT": "tab:orange", "LBBNN-FLOW": "tab:green"}
    for name, r in data["table1"].items():
        for k, run in enumerate(r["per_seed"]):
            curve = run.get("curve") or []
            if not curve:
                continue
            label = name if k == 0 else None
            ax_d.plot([p["adam_budget"] for p in curve], [p["density"] for p in curve], "-o", ms=3,
                      color=colours[name], label=label, alpha=0.8)
            ax_a.plot([p["density"] for p in curve], [100 * p["val_mpm_accuracy"] for p in curve], "-o", ms=3,
                      color=colours[name], label=label, alpha=0.8)
    vi = data["vi"]
    best = max(data["vi_grid"].values(), key=lambda e: (e["val_accuracy"], -e["val_nll"]))
    ax_a.axhline(100 * best["val_accuracy"], color="grey", ls="--",
                 label=f"BNN (VI, lr {vi['lr']:g}), seed 0, end of training")
    ax_d.axhline(0.15, color="grey", ls=":", label="density 0.15")
    ax_d.set_xlabel("Σ lr (Adam's budget so far)")
    ax_d.set_ylabel("density (fraction with α̃ > 0.5)")
    ax_d.set_title("density over the budget", fontsize="small")
    ax_a.set_xlabel("density")
    ax_a.set_ylabel("validation accuracy of the MPM, %")
    ax_a.invert_xaxis()
    ax_a.set_title("accuracy along the path (right: later in training)", fontsize="small")
    for ax in (ax_d, ax_a):
        ax.legend(fontsize="x-small")
        ax.grid(alpha=0.3)
    fig.suptitle("LBBNN on mnist5k: density and MPM accuracy over the training budget (one line per seed)",
                 fontsize="medium")
    save_figure(fig, path)

