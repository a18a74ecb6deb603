"""Our side: bayeswrap's method trained on the shared batches from the shared weights, scored at nst 0 and 5."""

from __future__ import annotations

import math
import time
import warnings

import torch

import bayeswrap as bw
from bayeswrap.app import experiments as ex
from bayeswrap.app.config import BAYESDLL_PER_METHOD
from bayeswrap.predictive import predict_loader
from scripts.bayesdll_side_by_side.settings import NST
from scripts.bayesdll_side_by_side.shared import build_mlp, digest, plain_loader, scores, std_stats, train_loader


def our_options(method: str, num_train: int, cfg: dict) -> dict:
    """``bw.wrap`` keyword arguments for ``method`` from BayesDLL's MNIST settings (``BAYESDLL_PER_METHOD``)."""
    s = BAYESDLL_PER_METHOD[method]
    opts = {"num_data": max(1, round(num_train * s.get("num_data_inflate", 1.0))), "prior_std": s["prior_std"],
            "prior_mean": "zero", "bias": s["bias"]}
    if method == "vi":
        opts.update(kl_weight=s["kl_weight"], init_std=cfg["vi_init_std"])
    elif method == "mc_dropout":
        opts.update(kl_weight=s["kl_weight"], p_drop=s["p_drop"])
    elif method == "sgld":
        steps = math.ceil(num_train / cfg["batch_size"])
        opts.update(burn_in=cfg["sgld_burn_in_epochs"] * steps, thinning=cfg["sgld_thinning"])
    elif method == "laplace":
        opts.update(curvature="empirical_fisher", hessian_structure="diag", subset_of_weights="all",
                    link_approx="mc")
    return opts


def _our_start(bnn) -> list[torch.Tensor]:
    """The tensors our method starts training from: VI's means, else the kept / MAP parameters θ."""
    return list((bnn.mean if hasattr(bnn, "mean") else bnn.theta).values())


def run_ours(method: str, data: dict, cfg: dict, seed: int) -> dict:
    """Trains bayeswrap's ``method`` on ``data["train"]`` and scores it on ``data["test"]`` at nst 0 and 5.

    Returns:
        ``{"predictives": {name: {"0": scores, "5": scores}}, "init": [tensors], "init_digest", "batches",
        "batch_digest", "seconds", "train_loss" (per epoch), "warnings"}``; Laplace has the predictives ``nn``
        and ``glm``, SGLD
        ``ensemble`` and ``gaussian``, the others ``sampled``.
    """
    tic = time.perf_counter()
    model = build_mlp(cfg["width"], cfg["depth"], seed)
    x, y = data["train"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bnn = bw.wrap(model, method, **our_options(method, len(y), cfg))
        init = [t.detach().clone() for t in _our_start(bnn)]
        if method == "sgld":
            # SGLD has no momentum (the noise must not pass through a momentum buffer): BayesDLL's heavy-ball
            # step lr / (1 − momentum) as the Langevin step, so the drift moves as fast as theirs
            optimizer = ex.own_optimizer(bnn, cfg["lr"] / (1.0 - cfg["momentum"]),
                                         noise_scale=BAYESDLL_PER_METHOD["sgld"]["noise_scale"])
        else:
            optimizer = torch.optim.SGD(bnn.param_groups(), lr=cfg["lr"], momentum=cfg["momentum"])
        loader = train_loader(data["train"], cfg, seed)
        torch.manual_seed(seed + 100)
        history = bw.fit(bnn, loader, epochs=cfg["epochs"], optimizer=optimizer, progress=False, finalize=False)
        if method == "laplace":
            bnn.after_fit(plain_loader(data["train"], cfg["batch_size"]))
        bnn.eval()
        posterior_std = std_stats(bnn.posterior_std().values()) if method in ("vi", "laplace") else None
        test = plain_loader(data["test"], 500)
        variants = {"laplace": ("nn", "glm"), "sgld": ("ensemble", "gaussian")}.get(method, ("sampled",))
        out = {}
        for variant in variants:
            predictive = None
            if method == "laplace":  # the linearised or the sampled predictive, chosen per call
                predictive = bnn.default_predictive(pred_type=variant)
            elif method == "sgld":  # SGLD's public switch between its stored iterates and their Gaussian
                bnn.predictive = variant
            out[variant] = {}
            for nst in NST:
                probs, labels = predict_loader(bnn, test, nst, generator=torch.Generator().manual_seed(seed + 1000),
                                               predictive=predictive)
                out[variant][str(nst)] = scores(probs, labels)
    return {"predictives": out, "init": init, "init_digest": digest(init), "batches": loader.batches,
            "batch_digest": loader.digest, "seconds": time.perf_counter() - tic,
            "train_loss": [h["train_loss"] for h in history], "posterior_std": posterior_std,
            "warnings": sorted({str(w.message).split("\n")[0][:200] for w in caught})}

