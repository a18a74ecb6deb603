"""Part 3, predictive entropy on three 2-D Gaussian clusters: LBBNN-LRT, MC-dropout and MAP."""

from __future__ import annotations

import math
import time

import numpy as np
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.app import experiments as ex
from bayeswrap.app.backbones import create_model
from scripts.lbbnn_experiments.settings import CLUSTER_METHODS, LBBNN_COMMON

CLUSTER_CENTRES = np.array([[-2.0, -1.5], [2.0, -1.5], [0.0, 2.0]])


def cluster_data(per_cluster: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three isotropic Gaussian clusters (std 0.6) around :data:`CLUSTER_CENTRES`, labels 0, 1, 2."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([c + 0.6 * rng.standard_normal((per_cluster, 2)) for c in CLUSTER_CENTRES])
    y = np.repeat(np.arange(len(CLUSTER_CENTRES)), per_cluster)
    return torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y)


def build_small_mlp(seed: int, k: int = 3) -> nn.Module:
    """MLP 2-50-50-``k`` (ReLU; :class:`~bayeswrap.app.backbones.MLP`), PyTorch's initialisation from ``seed``."""
    torch.manual_seed(seed)
    return create_model("mlp", k, in_features=2, hidden_sizes=(50, 50))


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row of ``probs`` (N, K), in float64 with probabilities clamped to 1e-12."""
    p = probs.double().clamp_min(1e-12)
    return -(p * p.log()).sum(1)


def run_clusters(cfg: dict, log=print) -> dict:
    """Fits LBBNN-LRT, MC-dropout and MAP on the clusters; predictive entropy on a grid, per method."""
    x, y = cluster_data(cfg["per_cluster"])
    h = cfg["half_width"]
    axis = torch.linspace(-h, h, cfg["grid"])
    gx, gy = torch.meshgrid(axis, axis, indexing="xy")
    grid = torch.stack([gx.reshape(-1), gy.reshape(-1)], 1)
    dist = torch.cdist(grid, x).min(1).values
    far = dist > 2.0
    out = {"grid_axis": [float(a) for a in axis], "entropy": {}, "summary": {}}
    for name in CLUSTER_METHODS:
        model = build_small_mlp(0)
        if name == "LBBNN-LRT":
            bnn = bw.wrap(model, "lbbnn", num_data=len(y), prior_std=1.0, prior_mean="zero", **LBBNN_COMMON)
            samples = cfg["num_samples"]
        elif name == "MC-dropout":
            bnn = bw.wrap(model, "mc_dropout", num_data=len(y), prior_std=1.0, prior_mean="zero",
                          p_drop=cfg["p_drop"])
            samples = cfg["num_samples"]
        else:
            bnn = bw.wrap(model, "map", num_data=len(y), prior_std=1.0, prior_mean="zero")
            samples = 0
        torch.manual_seed(1)
        tic = time.perf_counter()
        bw.fit(bnn, ex.shuffled_loader((x, y), cfg["batch_size"], 0), epochs=cfg["epochs"],
               optimizer=ex.make_optimizer(bnn, cfg)[0], progress=False)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(7)
            ent = entropy(bnn.predict(grid, num_samples=samples, generator=gen))
            train_probs = bnn.predict(x, num_samples=samples, generator=gen)
        summary = {"train_accuracy": ex.top1_accuracy(train_probs, y),
                   "mean_entropy_train": float(entropy(train_probs).mean()),
                   "mean_entropy_far": float(ent[far].mean()),
                   "mean_entropy_grid": float(ent.mean()),
                   "num_samples": samples, "seconds": time.perf_counter() - tic}
        if name == "LBBNN-LRT":
            summary["density"] = bnn.density()
        out["entropy"][name] = ent.reshape(cfg["grid"], cfg["grid"]).float().numpy()
        out["summary"][name] = summary
        log(f"[clusters] {name:10s}: training accuracy {summary['train_accuracy']:.3f}, mean entropy on the "
            f"training points {summary['mean_entropy_train']:.3f}, > 2 away from the data "
            f"{summary['mean_entropy_far']:.3f} (max log 3 = {math.log(3):.3f})")
    out["far_fraction"] = float(far.double().mean())
    out["train"] = (x.numpy(), y.numpy())
    return out

