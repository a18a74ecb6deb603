"""MCMC with bayeswrap on the experiments of a PyMC3 dissertation: logistic regression and a BNN on digits.

The dissertation (PyMC3) sampled (a) a 3-parameter logistic regression with
random-walk Metropolis–Hastings (10,000 steps, 500 burn-in) and showed posterior
predictive heatmaps, and (b) Bayesian neural networks on MNIST with ADVI. This
script repeats both with ``bw.wrap(model, "mh" | "hmc")`` and the library's
approximate methods, on data that ship with the dependencies:

1. **Logistic regression** (``mcmc_logistic.md``, ``.json``, ``.png``;
   :mod:`scripts.mcmc_logistic`). ``n``
   points with two covariates x ~ N(0, I₂), y ~ Bernoulli(sigmoid(β₀ + β₁x₁ +
   β₂x₂)) for fixed true β. Model: logits ``[0, z]`` with
   ``z = nn.Linear(2, 1)(x)`` (the categorical likelihood on two logits is
   exactly the logistic likelihood), prior N(0, σ² I) on (β₀, β₁, β₂), float64.
   * MAP by Newton–Raphson (written here: gradient Xᵀ(p − y) + β/σ², Hessian
     Xᵀ diag(p(1 − p)) X + I/σ²), with the Laplace std sqrt(diag H⁻¹).
   * MH: ``bw.wrap(model, "mh")``, 4 chains of 10,000 kept steps after 500
     adaptation steps (proposal scale adapted towards acceptance 0.234).
   * HMC: ``bw.wrap(model, "hmc")``, 4 chains of 1,000 draws after 500
     warm-up iterations, 16 leapfrog steps.
   Chains start from independent prior draws. Table: posterior mean and std
   of each parameter, acceptance rates, rank-normalised split R-hat, bulk and
   tail ESS (:mod:`bayeswrap.evaluation.convergence`), seconds; the same HMC run repeated
   with other numbers of leapfrog steps (``leapfrog_sweep``), each with a fixed
   and with the default jittered trajectory length, since the ESS of a
   fixed-length trajectory depends strongly on it. Figure: posterior
   predictive P(y = 1 | x) over a grid for HMC, its posterior std, MH, and the
   MAP plug-in, with the data.
2. **A small BNN on digits** (``mcmc_digits.md``, ``.json``). scikit-learn's
   8×8 digits through :func:`bayeswrap.data.load_data` (grey levels / 16; its
   fixed stratified 30 % test split; all other images for training), MLP
   64-``hidden``-10 with tanh, prior N(0, 1) on every parameter. HMC (full
   batch, 4 chains) against mean-field VI (``"vi"``, the ADVI analogue), SGLD
   and MAP trained on mini-batches: test accuracy, NLL, seconds; max R-hat and
   min / median bulk and tail ESS of the HMC parameters, and the R-hat of its
   per-chain predictive probabilities. The dissertation's ADVI timings on MNIST
   are quoted as context only (other data size, model and hardware).

Every number in the Markdown is measured by the run that writes it.

Usage::

    .venv/bin/python scripts/mcmc_dissertation.py                       # a few minutes on 2 CPU cores
    .venv/bin/python scripts/mcmc_dissertation.py --fast --out /tmp/x   # smoke test, not a result
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on a shared 2-core box
if not __package__:  # run as `python scripts/<name>.py`: the sibling modules import as `scripts.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bayeswrap as bw  # noqa: E402
from bayeswrap.app import experiments as ex  # noqa: E402
from bayeswrap.core.io import write_json, write_text  # noqa: E402
from bayeswrap.data.datasets import load_data  # noqa: E402
from bayeswrap.evaluation import convergence as diag  # noqa: E402
from scripts.mcmc_logistic import (  # noqa: E402
    LOGISTIC,
    logistic_figure,
    logistic_json,
    logistic_markdown,
    run_logistic,
)

ROOT = Path(__file__).resolve().parents[1]
DIGITS = "mcmc_digits"
DIGITS_METHODS = ("hmc", "vi", "sgld", "map")

#: The dissertation's ADVI results on MNIST, quoted as context (not reproduced here).
DISSERTATION = [
    {"model": "BNN, 2 hidden layers of 600 units", "method": "ADVI (PyMC3)", "data": "MNIST",
     "accuracy": 0.9514, "time": "1 h 15 min"},
    {"model": "Bayesian CNN", "method": "ADVI (PyMC3)", "data": "MNIST", "accuracy": 0.9818, "time": "1 h 34 min"},
]

FULL = {
    "seed": 0,
    "logistic": {
        "n": 100, "true_beta": (-0.5, 1.5, -1.0), "prior_std": 2.0,
        "mh": {"chains": 4, "warmup": 500, "draws": 10_000, "init_scale": 0.1},
        "hmc": {"chains": 4, "warmup": 500, "draws": 1000, "leapfrog": 16},
        "leapfrog_sweep": (4, 8, 12),      # extra HMC runs, identical but for the number of leapfrog steps
        "grid": 80, "predict_draws": 4000,
    },
    "digits": {
        "hidden": 16, "prior_std": 1.0, "train_subset": None,
        "hmc": {"chains": 4, "warmup": 300, "draws": 700, "leapfrog": 32},
        "epochs": 150, "batch_size": 64, "lr": 3e-3,
        "sgld_lr": 0.2, "sgld_thinning": 10,  # SGLD lr: configs/digits.yaml's per-method value
        "num_samples": 100, "rhat_draws": 250,
    },
}
FAST = {
    "seed": 0,
    "logistic": {
        **FULL["logistic"],
        "mh": {"chains": 4, "warmup": 200, "draws": 1000, "init_scale": 0.1},
        "hmc": {"chains": 4, "warmup": 100, "draws": 100, "leapfrog": 8},
        "leapfrog_sweep": (4,),
        "grid": 30, "predict_draws": 400,
    },
    "digits": {
        **FULL["digits"], "train_subset": 300,
        "hmc": {"chains": 4, "warmup": 50, "draws": 50, "leapfrog": 8},
        "epochs": 5, "num_samples": 10, "sgld_thinning": 2,
    },
}


# =========================================================================== part 2: BNN on digits

build_mlp = ex.tanh_mlp  # MLP 64-hidden-10 with tanh


def digits_data(subset: int | None, seed: int):
    """``(x, y, (x_test, y_test))``: a seeded ``subset`` of the digits training split, and the whole test split."""
    splits = load_data("digits", val_fraction=0.0, seed=seed)
    return (*ex.split_tensors(splits.train, subset, seed), ex.split_tensors(splits.test))


_scores = ex.accuracy_nll


def digits_hmc(x, y, x_test, y_test, dc: dict, seed: int) -> dict:
    """Full-batch HMC chains from independent initialisations: test scores, acceptance, R-hat and ESS."""
    h = dc["hmc"]
    inits = []
    for c in range(h["chains"]):
        torch.manual_seed(seed * 1000 + c)
        inits.append(dict(build_mlp(dc["hidden"]).named_parameters()))
    torch.manual_seed(seed)
    bnn = bw.wrap(build_mlp(dc["hidden"]), "hmc", num_data=len(y), prior_std=dc["prior_std"], prior_mean="zero",
                  num_leapfrog=h["leapfrog"], num_chains=h["chains"], max_samples=h["draws"])
    init = {n: torch.stack([m[n].detach() for m in inits]) for n in bnn.theta.keys()}
    tic = time.perf_counter()
    stats = bnn.run_chains(x, y, num_samples=h["draws"], num_warmup=h["warmup"], num_chains=h["chains"], init=init,
                           generator=torch.Generator().manual_seed(seed))
    draws = bnn.chain_draws()
    kept = next(iter(draws.values())).shape[1]
    probs = bnn.predict(x_test, num_samples=h["chains"] * kept)
    seconds = time.perf_counter() - tic
    rh = torch.cat([diag.rhat(t.double()).flatten() for t in draws.values()])
    eb = torch.cat([diag.ess_bulk(t.double()).flatten() for t in draws.values()])
    et = torch.cat([diag.ess_tail(t.double()).flatten() for t in draws.values()])
    step = max(1, math.ceil(kept / dc["rhat_draws"]))
    with torch.no_grad():
        per_draw = torch.stack([torch.stack([bnn.forward_with({n: t[c, i] for n, t in draws.items()}, x_test)
                                             .softmax(-1) for i in range(0, kept, step)])
                                for c in range(h["chains"])])
    pr = diag.rhat(per_draw.double()).flatten()
    pr = pr[~torch.isnan(pr)]
    return {"status": "ok", **_scores(probs, y_test), "seconds": seconds, "num_samples": h["chains"] * kept,
            "settings": h, "acceptance_rate": stats["acceptance_rate"], "step_size": stats["step_size"],
            "divergences": stats["divergences"],
            "rhat_max": float(rh.max()), "rhat_median": float(rh.median()),
            "ess_bulk_min": float(eb.min()), "ess_bulk_median": float(eb.median()),
            "ess_tail_min": float(et.min()), "ess_tail_median": float(et.median()),
            "frac_params_rhat_below_1.05": float((rh < 1.05).double().mean()),
            "predictive_rhat_max": float(pr.max()), "predictive_rhat_median": float(pr.median()),
            "predictive_rhat_draws_per_chain": int(per_draw.shape[1])}


def digits_trained(method: str, x, y, x_test, y_test, dc: dict, seed: int) -> dict:
    """One mini-batch method (VI, SGLD, MAP) trained and scored; a failure is recorded, not raised."""
    tic = time.perf_counter()
    torch.manual_seed(seed)
    opts = {"thinning": dc["sgld_thinning"], "max_samples": 1000} if method == "sgld" else {}
    try:
        bnn = bw.wrap(build_mlp(dc["hidden"]), method, num_data=len(y), prior_std=dc["prior_std"],
                      prior_mean="zero", **opts)
        opt, opt_name = ex.make_optimizer(bnn, dc)  # SGLD for sgld, else Adam
        loader = ex.shuffled_loader((x, y), dc["batch_size"], seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            bw.fit(bnn, loader, epochs=dc["epochs"], optimizer=opt, progress=False)
        bnn.eval()
        samples = {"map": 0, "sgld": len(bnn.sample_store) if method == "sgld" else 0}.get(method, dc["num_samples"])
        probs = bnn.predict(x_test, num_samples=samples, generator=torch.Generator().manual_seed(seed + 1))
    except (FloatingPointError, RuntimeError, ValueError) as err:
        return {"status": "failed", "message": f"{type(err).__name__}: {err}", "accuracy": math.nan,
                "nll": math.nan, "seconds": time.perf_counter() - tic}
    return {"status": "ok", **_scores(probs, y_test), "seconds": time.perf_counter() - tic, "num_samples": samples,
            "optimizer": opt_name, "steps": dc["epochs"] * len(loader)}


def run_digits(cfg: dict, seed: int, log=print) -> dict:
    """Part 2: every method of :data:`DIGITS_METHODS` on the digits split."""
    dc = cfg["digits"]
    x, y, (x_test, y_test) = digits_data(dc["train_subset"], seed)
    rows = {}
    for method in DIGITS_METHODS:
        if method == "hmc":
            rows[method] = digits_hmc(x, y, x_test, y_test, dc, seed)
        else:
            rows[method] = digits_trained(method, x, y, x_test, y_test, dc, seed)
        r = rows[method]
        log(f"[digits] {method}: accuracy {r['accuracy']:.4f}, NLL {r['nll']:.4f}, {r['seconds']:.1f} s")
    return {"sizes": {"train": len(y), "test": len(y_test)},
            "num_parameters": sum(p.numel() for p in build_mlp(dc["hidden"]).parameters()), "rows": rows}


def _f(v, fmt=".4f") -> str:
    return ex.fmt_or_failed(v, fmt)


def digits_markdown(res: dict, cfg: dict, header: list[str]) -> str:
    """The Markdown report of part 2, below the ``header`` lines."""
    dc, rows = cfg["digits"], res["rows"]
    h = rows["hmc"]
    labels = {"hmc": "HMC (full batch)", "vi": "mean-field VI (`vi`, the ADVI analogue)", "sgld": "SGLD",
              "map": "MAP"}
    table = ["| method | test accuracy | test NLL | S | seconds |", "|---|---|---|---|---|"]
    for m in DIGITS_METHODS:
        r = rows[m]
        table.append(f"| {labels[m]} | {_f(r['accuracy'])} | {_f(r['nll'])} | {r.get('num_samples', '–')} | "
                     f"{r['seconds']:.1f} |")
    failed = [f"{m}: {r['message']}" for m, r in rows.items() if r["status"] != "ok"]
    acc = h["acceptance_rate"]
    diss = ["| model | method | data | test accuracy | time |", "|---|---|---|---|---|"]
    diss += [f"| {d['model']} | {d['method']} | {d['data']} | {100 * d['accuracy']:.2f} % | {d['time']} |"
             for d in DISSERTATION]
    pr_ok = h["predictive_rhat_max"] < 1.05
    return "\n".join([
        "# A small BNN on digits: HMC against ADVI-like VI, SGLD and MAP",
        "",
        *header,
        "",
        f"Data: scikit-learn digits (8×8, grey levels / 16), {res['sizes']['train']} training and "
        f"{res['sizes']['test']} test images (the library's fixed stratified test split). Model: MLP "
        f"64-{dc['hidden']}-10, tanh, {res['num_parameters']:,} parameters, all Bayesian, prior "
        f"N(0, {dc['prior_std']:g}²), untempered. HMC: {h['settings']['chains']} chains from independent PyTorch "
        f"initialisations, {h['settings']['warmup']} warm-up iterations, {h['settings']['draws']} kept draws, "
        f"{h['settings']['leapfrog']} leapfrog steps, full batch; its predictive averages all kept draws. "
        f"VI, SGLD and MAP: {dc['epochs']} epochs of mini-batches of {dc['batch_size']} (Adam lr {dc['lr']} for "
        f"VI and MAP; bw.optim.SGLD lr {dc['sgld_lr']}, first half burn-in, then one iterate in every "
        f"{dc['sgld_thinning']} kept), same initialisation; S = predictive samples (MAP: point estimate). "
        "Seconds include training (or sampling) and prediction.",
        "",
        *table,
        *([""] + ["Failed: " + "; ".join(failed)] if failed else []),
        "",
        "## HMC diagnostics",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| acceptance rate (mean; min–max over chains) | {np.mean(acc):.3f}; {min(acc):.3f}–{max(acc):.3f} |",
        f"| step size per chain | {', '.join(f'{s:.4f}' for s in h['step_size'])} |",
        f"| divergences | {sum(h['divergences'])} |",
        f"| parameter R-hat, max / median | {h['rhat_max']:.3f} / {h['rhat_median']:.3f} |",
        f"| fraction of parameters with R-hat < 1.05 | {h['frac_params_rhat_below_1.05']:.3f} |",
        f"| parameter bulk ESS, min / median | {h['ess_bulk_min']:.0f} / {h['ess_bulk_median']:.0f} |",
        f"| parameter tail ESS, min / median | {h['ess_tail_min']:.0f} / {h['ess_tail_median']:.0f} |",
        f"| predictive R-hat (test-point × class probabilities), max / median | {h['predictive_rhat_max']:.3f} / "
        f"{h['predictive_rhat_median']:.3f} |",
        "",
        "The parameter R-hat of a neural network is inflated by its symmetries (hidden units can be permuted "
        "and, with tanh, sign-flipped without changing the function), so chains in equivalent modes disagree on "
        "the parameters while predicting alike; the R-hat of the per-chain predictive probabilities "
        f"({h['predictive_rhat_draws_per_chain']} evenly spaced draws per chain) is the check that matters for "
        f"predictions. It is {h['predictive_rhat_max']:.3f} at most here: the chains "
        + ("agree on the predictive (below 1.05)." if pr_ok else
           "have **not** converged on the predictive by the 1.05 criterion; longer chains would be needed for "
           "the HMC row to be a converged reference."),
        "",
        "## Context: the dissertation's ADVI runs (quoted, not reproduced)",
        "",
        *diss,
        "",
        "Those numbers come from the PyMC3 dissertation: MNIST (28×28 images), much larger networks and its own "
        "hardware. The runs above use 8×8 digits, a "
        f"{res['num_parameters']:,}-parameter MLP and this machine's CPU (torch threads: "
        f"{torch.get_num_threads()}), so neither the accuracies nor the times are comparable; they show the "
        "scale at which each was run.",
        "",
    ])


# =========================================================================== CLI

def parse_args(argv: list[str] | None):
    """The command line: ``--fast``, ``--out`` and ``--parts``."""
    p = ex.experiment_parser(__doc__.split("\n\n")[0], out_default=ROOT / "figures",
                             fast_help="smoke test: short chains, a digits subset, a few epochs")
    p.add_argument("--parts", default="logistic,digits", help="comma-separated subset of logistic,digits")
    return p.parse_args(argv)


def _header(argv: list[str], fast: bool, seconds: float, what: str) -> list[str]:
    lines = ["**FAST MODE: smoke test, not a result.**", ""] if fast else []
    return lines + [f"Produced by `{' '.join(['scripts/mcmc_dissertation.py', *argv])}` ({what}: {seconds:.0f} s "
                    f"wall time) on the CPU (torch threads: {torch.get_num_threads()})."]


def main(argv: list[str] | None = None) -> dict:
    """Runs the requested parts; returns ``{"paths": [...], "runtime": s, part: json data}``."""
    argv = ex.script_argv(argv)
    args = parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in ("logistic", "digits")]
    if bad or not parts:
        raise SystemExit(f"--parts {bad or parts} not known; accepted: logistic, digits")
    cfg = FAST if args.fast else FULL
    torch.set_num_threads(min(2, torch.get_num_threads()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tic_all = time.perf_counter()
    result: dict = {"paths": []}
    if "logistic" in parts:
        tic = time.perf_counter()
        res = run_logistic(cfg, cfg["seed"])
        data = logistic_json(res, cfg["logistic"])
        logistic_figure(res, out / f"{LOGISTIC}.png")
        seconds = time.perf_counter() - tic
        text = logistic_markdown(res, data, cfg, _header(argv, args.fast, seconds, "logistic part"))
        write_text(out / f"{LOGISTIC}.md", text)
        write_json(out / f"{LOGISTIC}.json", {"fast": args.fast, "argv": argv, "runtime_seconds": seconds,
                                              "torch_threads": torch.get_num_threads(), "seed": cfg["seed"],
                                              "config": cfg["logistic"], **data})
        result["logistic"] = data
        result["paths"] += [out / f"{LOGISTIC}.{e}" for e in ("md", "json", "png")]
        print(text)
    if "digits" in parts:
        tic = time.perf_counter()
        res = run_digits(cfg, cfg["seed"])
        seconds = time.perf_counter() - tic
        text = digits_markdown(res, cfg, _header(argv, args.fast, seconds, "digits part"))
        write_text(out / f"{DIGITS}.md", text)
        write_json(out / f"{DIGITS}.json", {"fast": args.fast, "argv": argv, "runtime_seconds": seconds,
                                            "torch_threads": torch.get_num_threads(), "seed": cfg["seed"],
                                            "config": cfg["digits"], "dissertation": DISSERTATION, **res})
        result["digits"] = res
        result["paths"] += [out / f"{DIGITS}.{e}" for e in ("md", "json")]
        print(text)
    result["runtime"] = time.perf_counter() - tic_all
    print(f"wrote {', '.join(str(p) for p in result['paths'])} ({result['runtime']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
