"""Part 1, Table 1 on mnist5k: LBBNN, LBBNN-LRT, LBBNN-FLOW and mean-field VI, trained and scored per seed.

Also the BNN baseline's choice of learning rate and local reparameterisation on validation (:func:`choose_vi`),
where the final density comes from (:func:`density_sources`), the density-against-accuracy path over the training
budget (:func:`budget_curves`) and the time per epoch against VI (:func:`timing`, part 4).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.app import experiments as ex
from bayeswrap.app.backbones import create_model
from bayeswrap.core.functional import is_bias
from bayeswrap.data.datasets import load_data
from scripts.lbbnn_experiments.settings import LBBNN_COMMON, PAPER, TABLE_METHODS


def build_mlp(seed: int) -> nn.Module:
    """MLP 784-400-600-10 (ReLU; :class:`~bayeswrap.app.backbones.MLP`), every weight and bias U(−0.2, 0.2) from
    the seeded global generator.
    """
    torch.manual_seed(seed)
    net = create_model("mlp", 10, in_features=784, hidden_sizes=(400, 600))
    with torch.no_grad():
        for p in net.parameters():
            p.uniform_(-0.2, 0.2)
    return net


def mnist5k(cfg: dict) -> dict:
    """mnist5k train / validation / test tensors (flat 784-vectors in [0, 1], int64 labels)."""
    splits = load_data("mnist5k", flatten=True, val_fraction=cfg["val_fraction"], seed=0)
    out = {}
    for name, ds, limit in (("train", splits.train, cfg["train_subset"]), ("val", splits.val, cfg["test_subset"]),
                            ("test", splits.test, cfg["test_subset"])):
        out[name] = ex.split_tensors(ds, limit)
    return out


def wrap_table_method(name: str, model: nn.Module, num_data: int, options: dict | None = None
                      ) -> bw.BayesianModel:
    """``bw.wrap`` for one of :data:`TABLE_METHODS` (zero-mean N(0, 1) prior); ``options`` override the row's."""
    method, row = TABLE_METHODS[name]
    extra = {**LBBNN_COMMON, **row} if method == "lbbnn" else dict(row)
    return bw.wrap(model, method, num_data=num_data, prior_std=1.0, prior_mean="zero", **extra, **(options or {}))


def train_table_method(name: str, data: dict, lr: float, epochs: int, cfg: dict, seed: int,
                       options: dict | None = None):
    """Wraps a fresh seeded MLP with ``name`` and trains it; returns ``(bnn, history, initial λ, curve)``.

    Adam at a constant ``lr``; the batch order depends on the seed only, so every method of a seed sees the same
    batches. For an LBBNN, ``curve`` holds every ``cfg["curve_every"]`` epochs (and after the last) the density,
    Σ lr so far and the validation accuracies of the MPM and of full averaging (S = ``cfg["curve_num_samples"]``):
    the path of density against accuracy over the training budget. Recording it draws from its own generator
    only, so the training itself is the same with or without it.
    """
    x, y = data["train"]
    bnn = wrap_table_method(name, build_mlp(seed), len(y), options)
    torch.manual_seed(1000 + seed)  # posterior noise during training
    init_logit = ({n: t.detach().clone() for n, t in bnn.logit.items()} if hasattr(bnn, "logit") else {})
    optimizer, _ = ex.make_optimizer(bnn, {"lr": lr})  # Adam
    steps = math.ceil(len(y) / cfg["batch_size"])
    xv, yv = data["val"]
    curve: list[dict] = []

    def record(epoch: int, rec: dict) -> None:
        if not hasattr(bnn, "logit") or ((epoch + 1) % cfg["curve_every"] and epoch + 1 != epochs):
            return
        point = {"epoch": epoch + 1, "adam_budget": lr * steps * (epoch + 1), "density": bnn.density()}
        for model in ("mpm", "full"):
            probs = predict_probs(bnn, xv, cfg["curve_num_samples"], model, cfg["predict_batch_size"], seed)
            point[f"val_{model}_accuracy"] = ex.top1_accuracy(probs, yv)
        curve.append(point)

    history = bw.fit(bnn, ex.shuffled_loader((x, y), cfg["batch_size"], seed), epochs=epochs, optimizer=optimizer,
                     progress=False, on_epoch_end=record)
    return bnn, history, init_logit, curve


@torch.no_grad()
def predict_probs(bnn: bw.BayesianModel, x: torch.Tensor, num_samples: int, model: str, batch_size: int,
                  seed: int) -> torch.Tensor:
    """The posterior predictive in batches (S = ``num_samples``), ``model`` "full" or "mpm"."""
    gen = torch.Generator().manual_seed(20_000 + seed)
    parts = [bnn.predict(x[i:i + batch_size], num_samples=num_samples, generator=gen, model=model)
             for i in range(0, len(x), batch_size)]
    return torch.cat(parts)



def adam_budget(history: list[dict], steps_per_epoch: int) -> float:
    """Σ_t lr_t over the training steps: roughly the farthest Adam can move one parameter (each step ≲ lr)."""
    return float(sum(r["lr"] * steps_per_epoch for r in history))


def choose_vi(data: dict, cfg: dict, log=print) -> tuple[dict, dict]:
    """The BNN baseline's settings: mean-field VI (seed 0) at every (Adam lr, local_reparam) of ``cfg["vi_grid"]``.

    Each is trained for the Table-1 budget and scored on the validation images (S = ``val_num_samples``) by
    accuracy, ties to the lower NLL. Returns ``(chosen, grid)``: ``chosen = {"lr": ..., "local_reparam": ...}``.
    """
    xv, yv = data["val"]
    grid = {}
    for lr, lrt in cfg["vi_grid"]:
        tic = time.perf_counter()
        bnn, history, _, _ = train_table_method("BNN", data, lr, cfg["epochs"], cfg, seed=0,
                                                options={"local_reparam": lrt})
        probs = predict_probs(bnn, xv, cfg["val_num_samples"], "full", cfg["predict_batch_size"], 0)
        entry = {"lr": lr, "local_reparam": lrt, "val_accuracy": ex.top1_accuracy(probs, yv),
                 "val_nll": ex.mean_nll(probs, yv),
                 "final_train_error": history[-1]["train_error"], "seconds": time.perf_counter() - tic}
        grid[f"lr={lr:g}, local_reparam={lrt}"] = entry
        log(f"[vi] lr {lr:g}, local_reparam {lrt}: validation accuracy {entry['val_accuracy']:.4f}, "
            f"NLL {entry['val_nll']:.3f} ({entry['seconds']:.0f} s)")
    best = max(grid.values(), key=lambda e: (e["val_accuracy"], -e["val_nll"]))
    return {"lr": best["lr"], "local_reparam": best["local_reparam"]}, grid


def weight_std_median(bnn: bw.BayesianModel) -> float:
    """Median posterior std of the weights (not biases): σ̃ = softplus(ρ) of the included weights (α̃ > 0.5) for
    an LBBNN (the slab's std), the marginal posterior std for VI.
    """
    with torch.no_grad():
        if hasattr(bnn, "logit"):
            alpha = bnn.inclusion_probs()
            vals = [torch.nn.functional.softplus(bnn.rho[n])[alpha[n] > 0.5] for n in alpha]
        else:
            vals = [t for n, t in bnn.posterior_std().items() if not is_bias(n)]
        flat = torch.cat([v.reshape(-1) for v in vals])
    return float(flat.median()) if flat.numel() else float("nan")


def run_table(data: dict, cfg: dict, vi: dict, log=print) -> dict:
    """Every Table-1 method and seed: accuracies (MPM, full), density, seconds per epoch and the budget curve.

    The LBBNNs train with Adam at ``cfg["lr"]``; the BNN with the settings ``vi`` chosen by :func:`choose_vi`.
    """
    xt, yt = data["test"]
    steps = math.ceil(len(data["train"][1]) / cfg["batch_size"])
    results: dict = {}
    for name in TABLE_METHODS:
        runs = []
        for seed in cfg["seeds"]:
            if TABLE_METHODS[name][0] == "lbbnn":
                bnn, history, init_logit, curve = train_table_method(name, data, cfg["lr"], cfg["epochs"], cfg, seed)
            else:
                bnn, history, init_logit, curve = train_table_method(
                    name, data, vi["lr"], cfg["epochs"], cfg, seed, options={"local_reparam": vi["local_reparam"]})
            tic = time.perf_counter()
            full = predict_probs(bnn, xt, cfg["num_samples"], "full", cfg["predict_batch_size"], seed)
            is_lbbnn = TABLE_METHODS[name][0] == "lbbnn"
            mpm = predict_probs(bnn, xt, cfg["num_samples"], "mpm", cfg["predict_batch_size"], seed) if is_lbbnn \
                else None
            run = {"seed": seed, "full_accuracy": ex.top1_accuracy(full, yt), "full_nll": ex.mean_nll(full, yt),
                   "mpm_accuracy": ex.top1_accuracy(mpm, yt) if mpm is not None else None,
                   "mpm_nll": ex.mean_nll(mpm, yt) if mpm is not None else None,
                   "density": bnn.density() if is_lbbnn else 1.0,
                   "epoch_seconds": [r["seconds"] for r in history],
                   "seconds_per_epoch": float(np.median([r["seconds"] for r in history])),
                   "predict_seconds": time.perf_counter() - tic,
                   "final_train_error": history[-1]["train_error"], "final_train_nll": history[-1]["train_nll"],
                   "final_train_kl": history[-1]["train_kl"],
                   "final_train_kl_per_datum": history[-1]["train_kl"] / len(data["train"][1]),
                   "weight_std_median": weight_std_median(bnn), "curve": curve}
            if is_lbbnn:
                budget = adam_budget(history, steps)
                lam0 = torch.cat([t.reshape(-1) for t in init_logit.values()])
                run["adam_budget"] = budget
                run["init_density"] = float((lam0 > 0).double().mean())
                run["unreachable_fraction"] = float((lam0 > budget).double().mean())
                lam1 = torch.cat([t.detach().reshape(-1) for t in bnn.logit.values()])
                run["max_logit_decrease"] = float((lam0 - lam1).max())
                run.update(density_sources(lam0, lam1, budget))
            runs.append(run)
            log(f"[table] {name:10s} seed {seed}: full {run['full_accuracy']:.4f}"
                + (f", MPM {run['mpm_accuracy']:.4f}" if run["mpm_accuracy"] is not None else "")
                + f", density {run['density']:.3f}, {run['seconds_per_epoch']:.2f} s/epoch")
        results[name] = {"per_seed": runs, **summarise_runs(runs)}
    return results


def density_sources(lam0: torch.Tensor, lam1: torch.Tensor, budget: float) -> dict:
    """Where the final density comes from, given the initial and final λ of every weight and Σ lr.

    ``kept_within_reach``: of the weights that started included (λ₀ > 0) but low enough for Adam to reach 0
    (λ₀ ≤ Σ lr), the fraction still included; ``reincluded``: of the weights that started excluded (λ₀ ≤ 0),
    the fraction included at the end. ``None`` where the group is empty.
    """
    started_in, reach, now_in = lam0 > 0, lam0 <= budget, lam1 > 0
    group = started_in & reach

    def frac(mask):
        return float(now_in[mask].double().mean()) if bool(mask.any()) else None

    return {"kept_within_reach": frac(group), "reachable_included_fraction": float(group.double().mean()),
            "reincluded": frac(~started_in)}


def min_median_max(values) -> dict | None:
    """``{"min", "median", "max"}`` of the values that are not ``None``; ``None`` if there are none."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"min": float(np.min(vals)), "median": float(np.median(vals)), "max": float(np.max(vals))}


def summarise_runs(runs: list[dict]) -> dict:
    """Min / median / max over seeds of the accuracies; medians of the density and of the seconds per epoch."""
    return {"mpm_accuracy": min_median_max(r["mpm_accuracy"] for r in runs),
            "full_accuracy": min_median_max(r["full_accuracy"] for r in runs),
            "density": {"median": float(np.median([r["density"] for r in runs]))},
            "seconds_per_epoch": {"median": float(np.median([r["seconds_per_epoch"] for r in runs]))}}


def budget_curves(results: dict) -> dict:
    """Per LBBNN variant, the median over seeds at each recorded epoch of Σ lr, density and validation accuracies."""
    out = {}
    for name, r in results.items():
        runs = [run["curve"] for run in r["per_seed"] if run.get("curve")]
        if not runs:
            continue
        points = []
        for i, first in enumerate(runs[0]):
            at = [c[i] for c in runs if len(c) > i]
            points.append({"epoch": first["epoch"], "adam_budget": first["adam_budget"],
                           **{k: float(np.median([p[k] for p in at]))
                              for k in ("density", "val_mpm_accuracy", "val_full_accuracy")}})
        out[name] = points
    return out


def timing(results: dict) -> dict:
    """Part 4: per Table-1 method, the median seconds per epoch, its ratio to the BNN's and the paper's."""
    vi = results["BNN"]["seconds_per_epoch"]["median"]
    return {name: {"seconds_per_epoch": r["seconds_per_epoch"]["median"],
                   "ratio_to_vi": r["seconds_per_epoch"]["median"] / vi if vi > 0 else float("nan"),
                   "paper_seconds_per_epoch": PAPER["table1"][name]["seconds_per_epoch"]}
            for name, r in results.items()}
