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

import argparse
import csv
import dataclasses
import io as _stdio
import logging
import math
import os
import sys
from pathlib import Path

import yaml

from bayeswrap.app import runs
from bayeswrap.app.build import device_of
from bayeswrap.app.compare import compare_methods, run_compare
from bayeswrap.app.config import FIELDS, RESUME_ALLOWED, resolve
from bayeswrap.app.options import all_option_specs, option_specs, option_users
from bayeswrap.app.reports import markdown_table, predict_rows
from bayeswrap.app.runner import RunInterrupted, evaluate_run, resume_config, run_fit
from bayeswrap.core import distributed
from bayeswrap.core.checks import MAX_PREDICTIVE_SAMPLES, check_device, check_seed
from bayeswrap.core.io import remove_stale_tmp_of, write_text
from bayeswrap.data.datasets import DataError
from bayeswrap.data.inputs import load_inputs
from bayeswrap.methods import METHODS

__all__ = ["main", "make_parser", "run_fit", "run_compare", "evaluate_run", "resume_config", "RunInterrupted"]

log = logging.getLogger("bayeswrap")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--num-samples {text!r} must be comma-separated integers, e.g. 0,5") from None
    if not values or min(values) < 0:
        raise ValueError(f"--num-samples {text!r} must list integers >= 0")
    return values


def _add_config_options(parser: argparse.ArgumentParser, skip=()) -> None:
    parser.add_argument("-c", "--config", help="YAML file with option defaults (command-line flags override it)")
    for name, f in FIELDS.items():
        if name in skip or name == "method_options":
            continue
        flag = "--" + name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = yaml.safe_dump(default, default_flow_style=True).strip() if isinstance(default, dict) else \
            repr(default)
        help_text = f"{f.metadata['help']} (default: {shown})"
        if name == "amp":  # a bare --amp (the older boolean flag) is bf16
            parser.add_argument(flag, nargs="?", const="bf16", default=argparse.SUPPRESS, dest=name,
                                metavar="{none,bf16,fp16}", help=help_text)
        elif isinstance(default, bool):
            parser.add_argument(flag, nargs="?", const="true", default=argparse.SUPPRESS, dest=name,
                                metavar="BOOL", help=help_text)
        else:
            metavar = {dict: "YAML", int: "INT", float: "FLOAT", str: "STR"}[type(default)]
            parser.add_argument(flag, default=argparse.SUPPRESS, dest=name, metavar=metavar, help=help_text)
    group = parser.add_argument_group("method options", "read from the method classes: each flag is an argument of "
                                      "the methods named, and an unset flag keeps that method's default")
    users = option_users()
    for name, spec in all_option_specs().items():
        if name in FIELDS or name in skip:
            continue
        defaults = {m: option_specs(m)[name].default for m in users[name]}
        shown = ", ".join(f"{m}: {d!r}" for m, d in defaults.items()) if len(set(map(repr, defaults.values()))) > 1 \
            else repr(spec.default)
        kind = type(spec.default)
        metavar = {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR", tuple: "LIST"}.get(kind, "VALUE")
        help_text = f"({', '.join(users[name])}) {spec.help} (default: {shown})".replace("%", "%%")
        if kind is bool:
            group.add_argument("--" + name.replace("_", "-"), nargs="?", const="true", default=argparse.SUPPRESS,
                               dest=name, metavar=metavar, help=help_text)
        else:
            group.add_argument("--" + name.replace("_", "-"), default=argparse.SUPPRESS, dest=name, metavar=metavar,
                               help=help_text)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bayeswrap", description="Bayesian fine-tuning of any PyTorch model.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_fit = sub.add_parser("fit", help="train one method and write a run folder")
    _add_config_options(p_fit)
    p_fit.add_argument("--resume", metavar="RUN_DIR", default=None,
                       help="continue the run in RUN_DIR from its last checkpoint, with its own config.yaml; "
                            f"only these options may change: {', '.join(RESUME_ALLOWED)}")
    p_cmp = sub.add_parser("compare", help="run several methods on the same data and split; write a table")
    _add_config_options(p_cmp, skip=("method", "num_samples"))
    p_cmp.add_argument("--methods", default=",".join(compare_methods()),
                       help=f"comma-separated methods (default: {','.join(compare_methods())}; also: "
                            f"{','.join(m for m in METHODS if m not in compare_methods())})")
    p_cmp.add_argument("--num-samples", default="0,5", dest="num_samples_list",
                       help="comma-separated posterior sample counts S (default: 0,5)")
    p_cmp.add_argument("--no-tune", action="store_false", dest="tune",
                       help="skip the tuning of each method's key option and prior std by validation NLL "
                            "(bayeswrap.evaluation.tuning); use the configured values")
    p_cmp.add_argument("--resume", metavar="COMPARE_DIR", default=None,
                       help="continue an interrupted comparison in COMPARE_DIR with its own compare.yaml (finished "
                            "methods are kept)")
    p_ev = sub.add_parser("evaluate", help="re-evaluate a saved run (calibration, shift, OOD) with another number "
                                           "of samples")
    p_ev.add_argument("run_dir", help="a run folder written by fit/compare")
    p_ev.add_argument("--num-samples", default=None, help="S (default: the run's num_samples)")
    p_pr = sub.add_parser("predict", help="predict new inputs with a saved run: class, probabilities, entropy and "
                                          "mutual information per input, as CSV")
    p_pr.add_argument("run_dir", help="a finished run folder written by fit/compare")
    p_pr.add_argument("inputs", help="an image file, a folder of images (searched recursively) or a .npy array of "
                                     "model inputs (N, *input_shape)")
    p_pr.add_argument("--num-samples", default=None, help="posterior samples S (default: the run's num_samples)")
    p_pr.add_argument("--out", default="predictions.csv", help="CSV file to write (default: predictions.csv); "
                                                               "written atomically, never inside RUN_DIR's files")
    p_pr.add_argument("--batch-size", default="128", help="inputs per forward pass (default: 128)")
    p_pr.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p_pr.add_argument("--device", default=None, help="device: auto, cpu, cuda, cuda:N or mps, where available "
                                                     "(default: the run's)")
    p_pr.add_argument("--seed", default="0", help="seed of the posterior samples, an integer in [0, 2^63 - 1] "
                                                  "(default: 0)")
    return parser


def _predict_command(args) -> int:

    s = None if args.num_samples is None else _count("num_samples", args.num_samples, 0, MAX_PREDICTIVE_SAMPLES)
    batch_size = _count("batch_size", args.batch_size, 1)
    seed = check_seed("--seed", args.seed)
    if args.device is not None:
        check_device("--device", args.device, available=True)
    out = runs.check_user_output(args.out, overwrite=args.overwrite)
    run = runs.load_run(args.run_dir, device=args.device)
    inputs, names = load_inputs(args.inputs, run.transform, run.input_shape)
    probs, samples = run.predictive(inputs, s, batch_size=batch_size, seed=seed)  # as metrics.json scored it
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bayeswrap`` console script; returns the exit status.

    0 on success, 2 for bad input (options, config files, data, run folders,
    checkpoints), 1 for a failure during the run (a diverging loss, a full
    disk, unreachable pretrained weights) and 130 on Ctrl-C, with one line
    naming the command that resumes the run.
    """
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for handler in logging.getLogger().handlers:  # the terminal gets warnings; train.log gets everything
        handler.setLevel(logging.WARNING)
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
                                 _int_list(args.num_samples_list), tune_options=args.tune, resume=args.resume)
        print(markdown_table(rows))
        print(f"written: {base / 'comparison.md'}, {base / 'comparison.csv'} and figures in {base}")
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

