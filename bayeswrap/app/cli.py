"""The ``bayeswrap`` command line: ``fit``, ``compare``, ``evaluate`` and ``predict``, parsed and dispatched.

A thin layer over the application: resolve the config (YAML + ``--key value`` overrides,
:mod:`bayeswrap.app.config`), then ``fit`` runs one configuration and writes its run folder
(:mod:`bayeswrap.app.runner`), ``compare`` runs several methods on the same data and split and writes a table
(:mod:`bayeswrap.app.compare`), ``evaluate`` scores a saved run again with another number of samples, and
``predict`` writes a saved run's predictions of new inputs as CSV (:mod:`bayeswrap.app.reports`).

Under ``torchrun --nproc_per_node=N`` (``WORLD_SIZE`` > 1), ``fit`` trains data-parallel
(:mod:`bayeswrap.core.distributed`): it initialises the process group itself (gloo on CPU,
nccl on CUDA), ``--batch-size`` is the global batch (a multiple of N, split equally
over the ranks), and only rank 0 creates, locks and writes the run folder. Every rank
trains and evaluates (identical replicas); the final reports are computed on rank 0.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from pathlib import Path

from bayeswrap.app.cli_parser import check_args, int_list, make_parser, method_hint, parse

__all__ = ["main", "make_parser"]  # and, imported on first use, those of _LAZY

log = logging.getLogger("bayeswrap")

#: names this module has re-exported from the application (imported on first use: ``--help`` imports no torch)
_LAZY = {"run_fit": "bayeswrap.app.runner", "evaluate_run": "bayeswrap.app.runner",
         "resume_config": "bayeswrap.app.runner", "RunInterrupted": "bayeswrap.app.runner",
         "run_compare": "bayeswrap.app.compare"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bayeswrap.app.cli' has no attribute {name!r}")


def _predict_command(args) -> int:
    import csv
    import io as _stdio

    from bayeswrap.app import runs
    from bayeswrap.app.input_range import InputRangeWarning
    from bayeswrap.app.reports import predict_rows
    from bayeswrap.core.checks import MAX_PREDICTIVE_SAMPLES, check_device, check_seed
    from bayeswrap.core.io import remove_stale_tmp_of, write_text
    from bayeswrap.data.inputs import load_inputs

    s = None if args.num_samples is None else _count("num_samples", args.num_samples, 0, MAX_PREDICTIVE_SAMPLES)
    batch_size = _count("batch_size", args.batch_size, 1)
    seed = check_seed("--seed", args.seed)
    if args.device is not None:
        check_device("--device", args.device, available=True)
    out = runs.check_user_output(args.out, overwrite=args.overwrite)
    run = runs.load_run(args.run_dir, device=args.device)
    inputs, names = load_inputs(args.inputs, run.transform, run.input_shape)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", InputRangeWarning)
        probs, samples = run.predictive(inputs, s, batch_size=batch_size, seed=seed,  # as metrics.json scored it
                                        allow_out_of_range=args.allow_out_of_range, source=repr(str(args.inputs)))
    for warning in caught:
        if issubclass(warning.category, InputRangeWarning):
            print(f"bayeswrap: warning: {warning.message}", file=sys.stderr)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    rows = predict_rows(probs, names, run.class_names, samples)
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    remove_stale_tmp_of(out)  # what a killed predict left beside this file
    runs.check_user_output(out, overwrite=args.overwrite)  # unchanged while the model predicted
    write_text(out, buf.getvalue())
    print(f"{len(rows)} predictions (S={run.config.num_samples if s is None else s}) written to {out}")
    return 0


def _count(name: str, text, minimum: int, maximum: float = math.inf) -> int:
    """A command-line count: an integer in [minimum, maximum], or a ValueError naming it."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value.is_integer() and minimum <= value <= maximum):
        bound = f">= {minimum}" if maximum == math.inf else f"in [{minimum}, {maximum:g}]"
        raise ValueError(f"--{name.replace('_', '-')} {text!r} is not valid; accepted: an integer {bound}")
    return int(value)


#: busy-wait spins of an idle OpenMP thread before it sleeps, when the user sets neither ``OMP_WAIT_POLICY`` nor
#: ``GOMP_SPINCOUNT`` (libgomp's own defaults: 300,000 spins, or 0 under ``PASSIVE``). Measured on digits with
#: ``scripts/thread_contention.py`` on 2 cores (figures/thread_contention.md): alone 22.7 s, as fast as spinning
#: (``ACTIVE`` 23.5 s) where sleeping at once (``PASSIVE``) took 29.8 s; beside another 2-thread torch process
#: 1.70x its time alone (``ACTIVE`` 3.03x, ``PASSIVE`` 1.37x). The other process keeps less of its speed than
#: under ``PASSIVE`` (22 % against 37 %): set ``OMP_WAIT_POLICY=PASSIVE`` to leave it more.
OPENMP_SPIN_COUNT = 1000


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bayeswrap`` console script; returns the exit status.

    0 on success, 2 for bad input (options, config files, data, run folders,
    checkpoints), 1 for a failure during the run (a diverging loss, a full
    disk, unreachable pretrained weights) and 130 on Ctrl-C, with one line
    naming the command that resumes the run.

    Unless the environment sets ``OMP_WAIT_POLICY``, it is set to ``PASSIVE`` with ``GOMP_SPINCOUNT`` =
    :data:`OPENMP_SPIN_COUNT` (unless set) before torch is imported: an idle OpenMP thread spins that many times
    (about 10 µs) and then sleeps, so a run sharing its cores with other processes (another training job, a test
    suite) does not slow itself and them by busy-waiting, while a run alone keeps the speed of spinning
    (``scripts/thread_contention.py``). libgomp reads the variables once, when torch loads it, so they have no
    effect when ``main`` is called from a process that imported torch already.
    """
    if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN_COUNT))
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(make_parser(method_hint(argv)), argv)  # --help and unknown flags end here, before any torch import
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for handler in logging.getLogger().handlers:  # the terminal gets warnings; train.log gets everything
        handler.setLevel(logging.WARNING)
    prefix = "bayeswrap"
    try:
        check_args(args)  # a value's type or choice, the method's name: before the library is imported
        return _run(args)
    except (ValueError, FileNotFoundError, PermissionError) as err:
        print(f"{prefix}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted before a run folder was written; nothing to resume", file=sys.stderr)
        return 130


def _run(args) -> int:
    """Runs a parsed, checked command (imports the library); returns the exit status."""
    from bayeswrap.app.build import device_of
    from bayeswrap.app.compare import run_compare
    from bayeswrap.app.config import FIELDS, resolve
    from bayeswrap.app.options import option_users
    from bayeswrap.app.reports import markdown_table
    from bayeswrap.app.runner import RunInterrupted, evaluate_run, resume_config, run_fit
    from bayeswrap.core import distributed
    from bayeswrap.core.checks import MAX_PREDICTIVE_SAMPLES
    from bayeswrap.data.datasets import DataError

    prefix = "bayeswrap"
    try:
        world = distributed.env_world_size()
        if world > 1:
            prefix = f"bayeswrap (rank {os.environ.get('RANK', '?')})"
            if args.command != "fit":
                raise ValueError(f"bayeswrap {args.command} does not run under torchrun (WORLD_SIZE={world}); "
                                 "accepted: bayeswrap fit (data-parallel), or run this command in one process")
            if os.environ.get("RANK", "0") != "0":  # one copy of the warnings on the terminal
                for handler in logging.getLogger().handlers:
                    handler.setLevel(logging.ERROR)
        if args.command == "evaluate":
            s = None if args.num_samples is None else _count("num_samples", args.num_samples, 0, MAX_PREDICTIVE_SAMPLES)
            report = evaluate_run(args.run_dir, s)
            print(f"S={report['num_samples']}: " + ", ".join(f"{k}={report['T1'][k]:.4f}"
                                                               for k in ("error", "ece", "mce", "nll")))
            if report["shift"]["summary"]:
                print("under shift (mean over intensities): " + ", ".join(
                    f"{k}={v:.4f}" for k, v in report["shift"]["summary"].items()))
            if report.get("corruption"):
                print("under corruption (mean over corruptions and severities): " + ", ".join(
                    f"{k}={v:.4f}" for k, v in report["corruption"]["summary"].items()))
            if report.get("conformal"):
                c = report["conformal"]
                print(f"conformal {c['score']} sets at alpha={c['alpha']:g}: coverage={c['coverage']:.4f}, "
                      f"mean size={c['mean_set_size']:.3f}")
            if report["ood"]:
                print(f"held-out classes {report['ood']['classes']}: AUROC entropy="
                      f"{report['ood']['entropy']['auroc']:.4f}" + (
                          f", mutual information={report['ood']['mutual_information']['auroc']:.4f}"
                          if report["ood"]["mutual_information"] else ""))
            return 0
        if args.command == "predict":
            return _predict_command(args)
        overrides = {k: v for k, v in vars(args).items()
                     if (k in FIELDS or k in option_users()) and k not in ("command", "config", "tune")}
        if args.command == "fit":
            if args.resume is not None:
                if args.config:
                    raise ValueError(f"-c {args.config} cannot be given with --resume: the run's own "
                                     f"{Path(args.resume) / 'config.yaml'} is used")
                cfg, changes = resume_config(args.resume, overrides)
            else:
                cfg, changes = resolve(args.config, overrides), None
            started = distributed.init_from_env(device_of(cfg.device))  # torchrun: WORLD_SIZE > 1
            try:
                run_dir, metrics = run_fit(cfg, resume=args.resume is not None, changes=changes)
            finally:
                if started:
                    distributed.destroy()
            if metrics is None:  # a data-parallel rank other than 0: rank 0 prints
                return 0
            rep = metrics["final"][str(cfg.num_samples)]
            print(f"{run_dir}: test error={rep['T1']['error']:.4f} ECE={rep['T1']['ece']:.4f} "
                  f"NLL={rep['T1']['nll']:.4f}")
            return 0
        if args.resume is not None and args.config:
            raise ValueError(f"-c {args.config} cannot be given with --resume: the comparison's own "
                             f"{Path(args.resume) / 'compare.yaml'} is used")
        base, rows = run_compare(args.config, overrides, [m.strip() for m in args.methods.split(",") if m.strip()],
                                 int_list(args.num_samples_list), tune_options=args.tune, resume=args.resume)
        print(markdown_table(rows))
        print(f"written: {base / 'comparison.md'} (every row and column: comparison_full.md, comparison.csv) "
              f"and figures in {base}")
        return 0
    except RunInterrupted as err:
        print(f"{prefix}: {err}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted before a run folder was written; nothing to resume", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, DataError, PermissionError) as err:
        print(f"{prefix}: error: {err}", file=sys.stderr)
        return 2
    except (RuntimeError, FloatingPointError, OSError) as err:
        print(f"{prefix}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

