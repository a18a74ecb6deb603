"""Part 5: ``bw.wrap`` at the library's defaults on sklearn's digits, MAP against LBBNN-LRT."""

from __future__ import annotations

import numpy as np
import torch

import bayeswrap as bw
from bayeswrap.app import experiments as ex
from bayeswrap.app.backbones import create_model
from bayeswrap.data.datasets import load_data
from scripts.lbbnn_experiments.settings import DIGITS_METHODS


def run_digits(cfg: dict, log=print) -> dict:
    """``bw.wrap`` with the library's defaults on sklearn's digits: MLP 64-H-10, Adam on ``param_groups()``.

    The split is :func:`bayeswrap.data.load_data`'s (30 % test, 10 % of the rest for validation, unused); every
    row of a seed starts from the same PyTorch-default initialisation and sees the same batches.
    """
    splits = load_data("digits", flatten=True, val_fraction=0.1, seed=0)
    (x, y), (xt, yt) = ex.split_tensors(splits.train, None), ex.split_tensors(splits.test, None)
    out: dict = {"sizes": {"train": len(y), "test": len(yt)}, "per_seed": []}
    for seed in cfg["seeds"]:
        entry = {"seed": seed}
        for name, (method, options) in DIGITS_METHODS.items():
            torch.manual_seed(seed)
            net = create_model("mlp", 10, in_features=64, hidden_sizes=(cfg["hidden"],))
            bnn = bw.wrap(net, method, num_data=len(y), **options)
            bw.fit(bnn, ex.shuffled_loader((x, y), cfg["batch_size"], seed), epochs=cfg["epochs"],
                   optimizer=ex.make_optimizer(bnn, cfg)[0], progress=False)
            gen = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                row = {"full_accuracy": ex.top1_accuracy(bnn.predict(xt, cfg["num_samples"] if method != "map" else 0,
                                                              generator=gen), yt)}
                if method == "lbbnn":
                    row["mpm_accuracy"] = ex.top1_accuracy(bnn.predict(xt, cfg["num_samples"], generator=gen,
                                                                model="mpm"), yt)
                    row["density"] = bnn.density()
            entry[name] = row
            log(f"[digits] seed {seed} {name:18s}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
        out["per_seed"].append(entry)
    out["summary"] = {name: {k: float(np.median([e[name][k] for e in out["per_seed"]])) for k in out["per_seed"][0][name]}
                      for name in DIGITS_METHODS}
    gaps = [e["MAP"]["full_accuracy"] - e["LBBNN-LRT"]["mpm_accuracy"] for e in out["per_seed"]]
    out["max_mpm_gap_to_map"] = float(max(gaps))
    return out

