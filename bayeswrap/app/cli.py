"""The ``bayeswrap`` command line: ``fit``, ``compare`` and ``evaluate``.

A thin layer over the library: resolve the config (YAML + ``--key value``
overrides), load data and backbone, ``wrap`` it, ``fit`` it, score the posterior
predictive with :mod:`bayeswrap.evaluation.protocol` (in distribution, under
rotation and noise shift, against held-out classes), and write the run folder::

    out_dir/<run-name>/
        config.yaml        the fully resolved config
        metrics.json       per-epoch history and the final reports (calibration, selective, gamma, conformal, shift,
                           ood)
        best.pt            best-validation checkpoint (torch.load(..., weights_only=True))
        last.pt            last epoch's checkpoint (for --resume)
        reliability_T1.png, reliability_Topt.png, temperature_curve.png, training_curves.png,
        shift.png, risk_coverage.png, gamma.png
        train.log

Every file is written atomically.

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
import json
import logging
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from bayeswrap.app import runs
from bayeswrap.app.build import (
    EpochLoader,
    build,
    data_info,
    device_of,
    eval_loader,
    make_optimizer,
    make_scheduler,
    preflight,
)
from bayeswrap.app.config import (
    FIELDS,
    RESUME_ALLOWED,
    RunConfig,
    check_compare_record,
    check_method_list,
    check_sample_counts,
    coerce,
    load_run_config,
    load_yaml,
    needs_validation_data,
    read_json_file,
    read_yaml_file,
    resolve,
    resolve_values,
)
from bayeswrap.app.options import all_option_specs, option_specs, option_users
from bayeswrap.core import distributed
from bayeswrap.core.checks import MAX_PREDICTIVE_SAMPLES, check_device, check_seed
from bayeswrap.core.io import (
    CheckpointError,
    UnsafePathError,
    file_kind,
    load_checkpoint,
    open_append,
    remove_stale_tmp_of,
    save_checkpoint,
    write_json,
    write_text,
    write_yaml,
)
from bayeswrap.data.datasets import DataError
from bayeswrap.data.inputs import load_inputs
from bayeswrap.data.shift import CORRUPTION, shifted_dataset
from bayeswrap.evaluation import calibration, conformal, plots, protocol
from bayeswrap.evaluation.tuning import tune, tune_with_prior
from bayeswrap.evaluation.uncertainty import expected_entropy, mutual_information, predictive_entropy
from bayeswrap.methods import METHODS, Ensemble, tuning_bounds, tuning_option
from bayeswrap.predictive import evaluate as evaluate_loader
from bayeswrap.predictive import sample_probs_loader
from bayeswrap.training import fit

log = logging.getLogger("bayeswrap")


#: the method whose tuned prior std every other compared method starts from (stage 1 of ``tune_with_prior``)
PRIOR_SOURCE = "map"
#: a knob set post hoc on the fitted posterior, without retraining (Laplace's ``optimize_prior_precision``)
POST_HOC = "prior_precision"

#: kept for scripts and tests that reach these through the command-line module
_eval_loader = eval_loader
_device = device_of


def final_reports(bnn, splits, ood_test, cfg: RunConfig, num_samples: int, device) -> tuple[dict, dict]:
    """The evaluation protocol of the posterior predictive with S samples.

    In distribution on test (temperature fitted on val), under every shift of
    ``cfg`` (rotation, noise; each shifted test set scored at T = 1 and at the
    in-distribution T) and against the held-out classes. Sampling uses
    generators seeded by ``cfg.seed`` (a fresh one per shifted set), so
    ``evaluate`` recomputes exactly the same numbers from the saved checkpoint.

    Returns:
        ``(report, arrays)``: the report of
        :func:`bayeswrap.evaluation.protocol.prediction_report` with ``num_samples``,
        ``shift`` and ``ood`` added (and ``corruption``, the
        :func:`~bayeswrap.evaluation.protocol.corruption_report`, when ``cfg.shift_corruptions`` is set), and the predictive probabilities and labels used.
    """
    bnn.eval()

    def predict(dataset, seed_offset: int = 0):
        gen = torch.Generator(device=device).manual_seed(cfg.seed + seed_offset)
        return sample_probs_loader(bnn, _eval_loader(dataset, cfg), num_samples, generator=gen)

    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    test = sample_probs_loader(bnn, _eval_loader(splits.test, cfg), num_samples, generator=gen)
    val = sample_probs_loader(bnn, _eval_loader(splits.val, cfg), num_samples, generator=gen) if len(splits.val) \
        else None
    report = protocol.prediction_report(*test, val=val, n_bins=cfg.n_bins)
    report["num_samples"] = num_samples
    # split conformal sets of the predictive at T = 1 (a temperature fitted on val would reuse the calibration data)
    report["conformal"] = None if val is None else conformal.conformal_report(
        val[0].double().mean(0), val[1], test[0].double().mean(0), test[1], cfg.conformal_alpha,
        score=cfg.conformal_score)
    grids = {"rotation": cfg.rotation_angles(), "noise": cfg.noise_stds()}
    report["shift"] = protocol.shift_report(
        lambda kind, level: predict(shifted_dataset(splits.test, kind, level, image_shape=splits.image_shape,
                                                    seed=cfg.seed)),
        grids, temperature=report.get("temperature", 1.0), n_bins=cfg.n_bins)
    if cfg.corruptions():  # severity 0 is the clean test set, scored above with the same generator seed
        report["corruption"] = protocol.corruption_report(
            lambda name, severity: test if severity == 0 else predict(shifted_dataset(
                splits.test, CORRUPTION + name, severity, image_shape=splits.image_shape, seed=cfg.seed)),
            cfg.corruptions(), cfg.severities(), temperature=report.get("temperature", 1.0), n_bins=cfg.n_bins)
    report["ood"] = None
    if ood_test is not None:
        report["ood"] = {"classes": list(cfg.held_out_classes(splits.name)),
                         **protocol.ood_report(test[0], predict(ood_test, 1)[0])}
    arrays = {"test": (test[0].mean(0), test[1]), "val": None if val is None else (val[0].mean(0), val[1])}
    return report, arrays


def _write_plots(run_dir: Path, report: dict, arrays: dict, history: list[dict], cfg: RunConfig) -> None:
    probs, y = arrays["test"]
    s = report["num_samples"]
    plots.reliability_diagram(probs.double(), y, run_dir / "reliability_T1.png", n_bins=cfg.n_bins,
                              title=f"{cfg.method}, S = {s}, T = 1")
    temperature = report.get("temperature")
    if arrays["val"] is not None and temperature is not None:
        scaled = calibration.apply_temperature(probs.double().clamp_min(1e-300).log(), temperature)
        plots.reliability_diagram(scaled, y, run_dir / "reliability_Topt.png", n_bins=cfg.n_bins,
                                  title=f"{cfg.method}, S = {s}, T = {temperature:.3f}")
        fit_result = calibration.fit_temperature(arrays["val"][0].double().clamp_min(1e-300).log(), arrays["val"][1],
                                                 return_history=True)
        plots.temperature_curve(fit_result, run_dir / "temperature_curve.png")
    if history:  # samplers have no epochs
        plots.training_curves(history, run_dir / "training_curves.png")
    _write_uncertainty_plots(run_dir, {cfg.method: report}, temperature_scaled=cfg.method)


def _write_uncertainty_plots(folder: Path, reports: dict[str, dict], *, temperature_scaled: str | None) -> None:
    """shift.png, risk_coverage.png and gamma.png of one or several methods' final reports."""
    s = {m: r["num_samples"] for m, r in reports.items()}
    label = ", ".join(sorted({f"S = {v}" for v in s.values()}))
    corrupted = {m: r["corruption"] for m, r in reports.items() if r.get("corruption")}
    if corrupted or any(k in r["shift"] for r in reports.values() for k in ("rotation", "noise")):
        baseline = temperature_scaled if temperature_scaled in reports else None
        plots.shift_curves({m: r["shift"] for m, r in reports.items()}, folder / "shift.png",
                           temperature_scaled=baseline, corruption=corrupted,
                           title=f"Dataset shift ({label}; TS: temperature from in-distribution validation)")
    plots.risk_coverage_curves({m: r["selective"] for m, r in reports.items()}, folder / "risk_coverage.png",
                               title=f"Selective prediction ({label})")
    if any(r["gamma"] for r in reports.values()):
        plots.gamma_curves({m: r["gamma"] for m, r in reports.items()}, folder / "gamma.png",
                           title=f"γ(α) of the uncertainty measures ({label})")


class _RunLogHandler(logging.FileHandler):
    """``train.log``, appended through :func:`~bayeswrap.core.io.open_append`: never through a symbolic link."""

    def _open(self):
        return open_append(self.baseFilename)


def _setup_logging(run_dir: Path) -> logging.Handler:
    handler = _RunLogHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


class RunInterrupted(Exception):
    """Ctrl-C during a run: carries the command that resumes it."""

    def __init__(self, run_dir: Path, command: str):
        super().__init__(f"interrupted; the last finished epoch is kept in {run_dir}. Resume with: {command}")
        self.run_dir, self.command = run_dir, command


#: the autocast dtype of each ``amp`` value (fp16 also gets a gradient scaler)
AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}

#: what ``last.pt`` must hold (it also holds ``"scaler"``, the GradScaler state, when trained with amp=fp16)
LAST_CHECKPOINT_KEYS = {"model": dict, "optimizer": dict, "epoch": int, "rng": torch.Tensor, "history": list,
                        "best_val_nll": float, "best_epoch": int}


def resume_config(run_dir: str | Path, overrides: dict) -> tuple[RunConfig, dict]:
    """The saved config of ``run_dir`` with the allowed ``overrides`` applied.

    Args:
        run_dir: a run folder written by ``fit`` (it holds ``config.yaml``).
        overrides: command-line options; those equal to the saved values are
            ignored, those in :data:`bayeswrap.app.config.RESUME_ALLOWED` are applied.

    Returns:
        ``(cfg, changes)`` with ``changes = {option: [saved, new]}``. ``out_dir``
        and ``run_name`` point at ``run_dir`` wherever it now lies.

    Raises:
        ValueError: naming the option, if an override would change the data,
            split, model or method, or a value is bad; or if ``run_dir`` has no
            config.yaml.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"--resume {run_dir}: no config.yaml there; accepted: a run folder written by bayeswrap fit")
    saved = load_run_config(run_dir / "config.yaml")
    changes, values = {}, saved.to_dict()
    for key, value in overrides.items():
        if key in ("out_dir", "run_name", "overwrite"):
            raise ValueError(f"--resume {run_dir}: {key} cannot be given with --resume (the run folder is "
                             f"{run_dir})")
        new = coerce(key, value)
        if key not in FIELDS:  # a method option: the saved value, else the method's default
            values[key] = saved.option(key)
        if new == values[key]:
            continue
        if key not in RESUME_ALLOWED:
            raise ValueError(f"--resume {run_dir}: {key}={new!r} differs from the run's {key}={values[key]!r}; a "
                             f"resumed run keeps its data, split, model and method. Accepted changes: "
                             f"{', '.join(RESUME_ALLOWED)}")
        changes[key] = [values[key], new]
        values[key] = new
    values.update(out_dir=str(run_dir.parent), run_name=run_dir.name, overwrite=False)
    return RunConfig(**{k: v for k, v in values.items() if k in FIELDS}).validate(), changes


def run_fit(cfg: RunConfig, sample_counts: list[int] | None = None, tuning: dict | None = None, *,
            resume: bool = False, changes: dict | None = None, resume_command: str | None = None,
            ) -> tuple[Path, dict]:
    """Trains one configuration end to end and writes its run folder.

    Everything is checked (config, data, model, checkpoint) before a file is
    written. The run holds the folder's lock (:class:`bayeswrap.app.runs.RunLock`)
    until it ends.

    Args:
        cfg: a validated config.
        sample_counts: the S values of the final reports (default ``[cfg.num_samples]``).
        tuning: the tuning record to store in ``metrics.json`` (``compare``). For a
            method whose knob is set post hoc (Laplace's ``prior_precision``) that
            knob is tuned here, after the curvature is fitted (bracketed grid,
            scored on validation, best value set), and added to the record.
        resume: continue ``out_dir/run_name`` from its ``last.pt``; a folder
            without one restarts from scratch.
        changes: the options a resume changed (``{option: [old, new]}``), recorded
            in ``metrics.json["resumes"]`` and the log.
        resume_command: the command printed on Ctrl-C.

    Returns:
        ``(run_dir, metrics)``.

    Data-parallel (a process group with several processes, see the module
    docstring): only rank 0 opens, locks and writes the folder; the other ranks
    train and return ``(run_dir, None)``.

    Raises:
        RunInterrupted: on Ctrl-C (the last finished epoch stays in ``last.pt``).
        bayeswrap.app.runs.RunFolderError: if the folder exists (without resume or
            overwrite), is not a run folder, or another run holds it (on every rank).
        bayeswrap.core.io.CheckpointError: naming the file, for a damaged ``last.pt``.
        ValueError: data-parallel, for a full-batch sampler (hmc, mh) or a
            ``batch_size`` that is not a multiple of the world size.
    """
    sample_counts = sample_counts or [cfg.num_samples]
    preflight(cfg)  # the checks that need no data or weights, before the minutes of loading them
    world = distributed.world_size()
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size} is not a multiple of the world size {world}; accepted: a "
                         f"multiple of {world} (--batch-size is the global batch, split equally over the processes)")
    if distributed.is_main_process():
        if resume:
            runs.RunLock(Path(cfg.out_dir) / cfg.name).check_free()
        else:
            runs.check_new(cfg.out_dir, cfg.name, overwrite=cfg.overwrite)
    splits, ood_test, bnn, head, device = build(cfg)  # all input is checked before anything is written
    sampler = bnn.not_trained_by_fit() is not None  # full-batch MCMC: run_chains instead of fit
    if sampler:
        distributed.refuse(f"method={cfg.method!r}", "its chains run on the whole training set in one process "
                           "(run_chains), with no minibatches to shard")
    optimizer = None if sampler else make_optimizer(cfg, bnn, head)
    run_dir = Path(cfg.out_dir) / cfg.name
    main = distributed.is_main_process()
    lock, failure = None, None
    if main:
        try:
            lock = runs.open_existing(run_dir) if resume else runs.open_new(cfg.out_dir, cfg.name,
                                                                            overwrite=cfg.overwrite)
        except runs.RunFolderError as err:
            failure = err
    failed = distributed.broadcast_object(None if failure is None else str(failure))  # every rank stops alike
    if failure is not None:
        raise failure
    if failed is not None:
        raise runs.RunFolderError(failed)
    command = resume_command or f"bayeswrap fit --resume {run_dir}"
    handler = None
    try:
        ckpt = None
        if resume and (run_dir / "last.pt").is_file() and not sampler:
            ckpt = _restore(run_dir / "last.pt", bnn, optimizer, cfg)  # every rank reads it (one node)
        elif resume and main:  # killed before its first checkpoint: start again in the same folder
            runs.clear(run_dir)
            runs._write_marker(run_dir, "run")
        if main:
            handler = _setup_logging(run_dir)
            if changes:
                log.info("resumed with changes %s", changes)
            write_yaml(run_dir / "config.yaml", cfg.to_dict())
            write_json(run_dir / "data.json", data_info(splits, cfg).to_dict())
        metrics = _train_and_report(cfg, run_dir, splits, ood_test, bnn, optimizer, device, sample_counts, tuning,
                                    ckpt, changes)
        return run_dir, metrics
    except KeyboardInterrupt:
        raise RunInterrupted(run_dir, command) from None
    finally:
        if handler is not None:
            log.removeHandler(handler)
            handler.close()
        if lock is not None:
            lock.release()


def _restore(path: Path, bnn, optimizer, cfg: RunConfig) -> dict:
    """Loads ``last.pt`` into the model and optimizer; the config's lr (and momentum, weight decay) win.

    Every field is checked (:func:`check_last_checkpoint`) before anything is loaded.
    """
    ckpt = check_last_checkpoint(load_checkpoint(path, required=LAST_CHECKPOINT_KEYS, inside=path.parent), path)
    if ckpt["epoch"] > cfg.epochs:
        raise ValueError(f"--resume: epochs={cfg.epochs} is below the {ckpt['epoch']} epochs the run in "
                         f"{path.parent} has already trained; accepted: epochs >= {ckpt['epoch']}")
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        bnn.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {path} does not match the run's model or optimizer: {err}") from None
    for group, new in zip(optimizer.param_groups, fresh):
        for key in ("lr", "momentum", "weight_decay"):
            if key in new:
                group[key] = new[key]
        group["initial_lr"] = new["lr"]
    return ckpt


def check_last_checkpoint(ckpt: dict, path: Path) -> dict:
    """The fields of ``last.pt`` beyond their types (:data:`LAST_CHECKPOINT_KEYS`), checked before any is used.

    ``rng`` must be a CPU random state that ``torch.set_rng_state`` takes (tried on a spare generator, so the
    process's own state is untouched); ``epoch`` >= 0; ``best_epoch`` in [0, epoch]; ``history`` a list of
    ``epoch`` records (mappings); ``best_val_nll`` a number; ``scaler``, if present, a mapping.

    Raises:
        CheckpointError: naming the file, the field and the value, and what is accepted.
    """
    def bad(field: str, value, accepted: str):
        return CheckpointError(f"checkpoint {path}: {field}={value} is not valid; accepted: {accepted}")

    rng = ckpt["rng"]
    shown = f"tensor(dtype={rng.dtype}, shape={tuple(rng.shape)})"
    expected = torch.get_rng_state()
    if rng.dtype != torch.uint8 or rng.dim() != 1 or rng.layout != torch.strided or rng.is_meta:
        raise bad("rng", shown, f"the uint8 vector of torch.get_rng_state() (shape {tuple(expected.shape)})")
    try:
        torch.Generator().set_state(rng.clone())
    except (RuntimeError, ValueError, TypeError) as err:
        raise bad("rng", shown, f"the uint8 vector of torch.get_rng_state() (shape {tuple(expected.shape)}); "
                                f"torch refuses it: {str(err).splitlines()[0]}") from None
    epoch = ckpt["epoch"]
    if isinstance(epoch, bool) or epoch < 0:
        raise bad("epoch", repr(epoch), "an integer >= 0")
    best = ckpt["best_epoch"]
    if isinstance(best, bool) or not 0 <= best <= epoch:
        raise bad("best_epoch", repr(best), f"an integer in [0, epoch={epoch}]")
    history = ckpt["history"]
    if len(history) != epoch or not all(isinstance(r, dict) for r in history):
        raise bad("history", f"a list of {len(history)} entries", f"one record (a mapping) per trained epoch, "
                                                                    f"{epoch}")
    if "scaler" in ckpt and not isinstance(ckpt["scaler"], dict):
        raise bad("scaler", type(ckpt["scaler"]).__name__, "a mapping (the GradScaler state)")
    if "resumes" in ckpt and not isinstance(ckpt["resumes"], list):
        raise bad("resumes", type(ckpt["resumes"]).__name__, "a list")
    return ckpt


def tuning_score(cfg: RunConfig, num_samples: int) -> float:
    """Validation NLL of one tuning candidate: trained exactly as ``fit`` trains, nothing written.

    The model is trained for ``cfg.epochs`` epochs, the best-validation epoch is
    kept (as ``best.pt`` is in a run), the method is finalised (Laplace fits its
    curvature) and the posterior predictive with ``num_samples`` samples is
    scored on the validation set. A method whose knob is set post hoc
    (Laplace's prior precision) scores its best value of that knob
    (:func:`_post_hoc_tune`). A run whose loss diverges, or that ends without a
    posterior (SGLD keeping no sample), scores ``inf``.
    """
    splits, _, bnn, head, device = build(cfg)
    if not len(splits.val):
        raise ValueError("tuning needs validation data: set val_fraction > 0, or pass --no-tune")
    optimizer = make_optimizer(cfg, bnn, head)
    val_loader = _eval_loader(splits.val, cfg)
    try:
        fit(bnn, EpochLoader(splits.train, cfg.batch_size, cfg.seed, cfg.num_workers), epochs=cfg.epochs,
            optimizer=optimizer, val_loader=val_loader,
            early_stopping_patience=cfg.epochs if bnn.select_best_epoch else None,
            autocast_dtype=AMP_DTYPES[cfg.amp], progress=False, finalize=False)
    except FloatingPointError:
        return float("inf")
    bnn.after_fit(_eval_loader(splits.train, cfg))
    if not bnn.is_ready():  # e.g. SGLD kept no sample: the candidate has no posterior and cannot win
        return float("inf")
    if _knob(cfg.method) == POST_HOC:
        record = _post_hoc_tune(bnn, val_loader, cfg, num_samples)
        return record["val_nll"][record["chosen_index"]]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    return evaluate_loader(bnn, val_loader, num_samples, generator=gen)["nll"]


def _knob(method: str) -> str | None:
    """The option ``compare`` tunes for ``method`` besides its prior std (its class's ``tuning``), or None."""
    knob = tuning_option(method)
    return None if knob is None else knob[0]


def _post_hoc_tune(bnn, val_loader, cfg: RunConfig, num_samples: int) -> dict:
    """Laplace's post hoc prior precision on the fitted curvature: bracketed grid, best value set on ``bnn``.

    Every value is scored by ``optimize_prior_precision("val")`` (the same seed for
    each, so all see the same noise); returns the :func:`~bayeswrap.evaluation.tuning.tune` record.
    """
    option, grid = tuning_option(cfg.method)

    def val_nll_of(value: float) -> float:
        bnn.optimize_prior_precision("val", val_loader=val_loader, grid=[value], num_samples=num_samples,
                                     seed=cfg.seed)
        return bnn.val_search["nll"][0]

    record = tune(grid, val_nll_of, bounds=tuning_bounds(cfg.method, option))
    bnn.prior_precision = record["chosen"]
    bnn.val_search = {"grid": record["grid"], "nll": record["val_nll"]}
    return record


def _tune_prior_precision(bnn, splits, cfg: RunConfig, tuning: dict, num_samples: int, device) -> dict:
    """The final run's post hoc knob (Laplace's prior precision), appended to the tuning record as a stage."""
    record = _post_hoc_tune(bnn, _eval_loader(splits.val, cfg), cfg, num_samples)
    log.info("%s: %s %g chosen by validation NLL over %s (bound hit: %s)", cfg.method, POST_HOC, record["chosen"],
             record["grid"], record["bound_hit"])
    stage = {"stage": "post_hoc", "option": POST_HOC, "fixed": {"prior_std": cfg.prior_std}, **record}
    return {**tuning, "options": {**tuning.get("options", {}), POST_HOC: record["chosen"]},
            "val_nll": record["val_nll"][record["chosen_index"]], "stages": [*tuning.get("stages", []), stage]}


def _sample_and_report(cfg, run_dir, splits, ood_test, bnn, device, sample_counts) -> dict:
    """A full-batch sampler's run: chains on the whole training set, then the same reports as a fitted run."""
    loader = _eval_loader(splits.train, cfg)
    x = torch.cat([b[0] for b in loader])
    y = torch.cat([b[1] for b in loader])
    log.info("config: %s", cfg.to_dict())
    stats = bnn.run_chains(x, y, **cfg.method_arguments("run"),
                           generator=torch.Generator(device=device).manual_seed(cfg.seed))
    save_checkpoint(run_dir / "best.pt", bnn.state_dict())
    diagnostics = bnn.diagnostics()
    log.info("%s: %s", cfg.method, diagnostics["summary"])
    draws = bnn.chain_draws()
    plots.trace_plot(draws, run_dir / "trace.png", title=f"{cfg.method}: trace of the kept draws")
    plots.rank_plot(draws, run_dir / "rank.png", title=f"{cfg.method}: rank plots (flat = well mixed)")
    reports = {}
    for s in sample_counts:
        report, arrays = final_reports(bnn, splits, ood_test, cfg, s, device)
        reports[str(s)] = report
        if s == sample_counts[-1]:
            _write_plots(run_dir, report, arrays, [], cfg)
    metrics = {"history": [], "best_epoch": None, "final": reports, "mcmc": {**stats, "diagnostics": diagnostics}}
    write_json(run_dir / "metrics.json", metrics)
    return metrics


def _train_and_report(cfg, run_dir, splits, ood_test, bnn, optimizer, device, sample_counts, tuning=None,
                      ckpt=None, changes=None):
    """Trains, finalises on the best state and writes the reports; data-parallel, only rank 0 writes (else None)."""
    if optimizer is None:
        return _sample_and_report(cfg, run_dir, splits, ood_test, bnn, device, sample_counts)
    main = distributed.is_main_process()
    train_loader = EpochLoader(splits.train, cfg.batch_size, cfg.seed, cfg.num_workers,
                               num_replicas=distributed.world_size(), rank=distributed.rank())
    scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None
    val_loader = _eval_loader(splits.val, cfg) if len(splits.val) else None
    test_loader = _eval_loader(splits.test, cfg)
    state = {"history": [], "best_val_nll": float("inf"), "best_epoch": 0, "resumes": []}
    start_epoch = 0
    if ckpt is not None:
        torch.set_rng_state(ckpt["rng"])
        if scaler is not None and ckpt.get("scaler"):  # a run resumed with amp=fp16 after another amp starts afresh
            scaler.load_state_dict(ckpt["scaler"])
        state.update({k: ckpt[k] for k in state if k in ckpt})
        start_epoch = ckpt["epoch"]
        log.info("resumed from %s at epoch %d", run_dir / "last.pt", start_epoch)
        if changes:
            state["resumes"] = [*state["resumes"], {"epoch": start_epoch, "changes": changes}]
    scheduler = make_scheduler(cfg, optimizer, start_epoch)
    if main:
        log.info("config: %s", cfg.to_dict())
        log.info("data: %s, %d classes; Bayesian parameters: %d tensors, num_data=%d", splits.sizes(),
                 splits.num_classes, len(bnn.bayesian_names), bnn.num_data)
        if distributed.is_distributed():
            log.info("data-parallel: %d processes, global batch %d (%d per process)", distributed.world_size(),
                     cfg.batch_size, cfg.batch_size // distributed.world_size())
    board = _tensorboard(run_dir, start_epoch) if main else None

    def on_epoch_end(epoch, record):
        bnn.eval()
        # every rank evaluates (identical replicas, and the random streams stay in step); rank 0 writes
        record.update({f"test_{k}": v for k, v in
                       evaluate_loader(bnn, test_loader, 0, allow_point_estimate=True).items()})
        state["history"].append(record)
        if not main:
            return
        # without validation data, or for a sampler (its posterior is the whole chain), the last epoch is best
        val_nll = record.get("val_nll", -float(epoch)) if bnn.select_best_epoch else -float(epoch)
        if val_nll < state["best_val_nll"]:
            state["best_val_nll"], state["best_epoch"] = val_nll, epoch + 1
            save_checkpoint(run_dir / "best.pt", bnn.state_dict())
        save_checkpoint(run_dir / "last.pt", {"model": bnn.state_dict(), "optimizer": optimizer.state_dict(),
                                              "epoch": epoch + 1, "rng": torch.get_rng_state(), **state,
                                              **({"scaler": scaler.state_dict()} if scaler is not None else {})})
        write_text(run_dir / "history.csv", _history_csv(state["history"]))
        if board is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "epoch" and math.isfinite(value):
                    board.add_scalar(key, value, epoch + 1)
            board.flush()
        log.info("epoch %d: %s", epoch + 1, {k: round(v, 5) if isinstance(v, float) else v
                                              for k, v in record.items()})

    try:
        if start_epoch < cfg.epochs:
            fit(bnn, train_loader, epochs=cfg.epochs, optimizer=optimizer, val_loader=val_loader,
                scheduler=scheduler, autocast_dtype=AMP_DTYPES[cfg.amp], grad_scaler=scaler,
                start_epoch=start_epoch, grad_clip_norm=cfg.grad_clip_norm or None, on_epoch_end=on_epoch_end,
                progress=cfg.progress and sys.stderr.isatty(), finalize=False)
    except FloatingPointError as err:
        raise FloatingPointError(f"{err}; the last good checkpoint is kept in {run_dir / 'last.pt'}") from None
    finally:
        if board is not None:
            board.close()
    # finalise on the best-validation state (Laplace fits its curvature there) and save it
    if main:
        bnn.load_state_dict(load_checkpoint(run_dir / "best.pt", inside=run_dir))
    distributed.broadcast_state_dict_(bnn)  # data-parallel: rank 0 read the best state; every rank finalises
    bnn.after_fit(_finalize_loader(splits.train, cfg))
    if not main:
        return None
    if tuning is not None and _knob(cfg.method) == POST_HOC:
        tuning = _tune_prior_precision(bnn, splits, cfg, tuning, sample_counts[-1], device)
    save_checkpoint(run_dir / "best.pt", bnn.state_dict())
    reports = {}
    for s in sample_counts:
        report, arrays = final_reports(bnn, splits, ood_test, cfg, s, device)
        reports[str(s)] = report
        if s == sample_counts[-1]:
            _write_plots(run_dir, report, arrays, state["history"], cfg)
    metrics = {"history": state["history"], "best_epoch": state["best_epoch"], "final": reports}
    if tuning is not None:
        metrics["tuning"] = tuning
        if _knob(cfg.method) == POST_HOC:
            metrics["operating_point"] = "val"
    if state["resumes"]:
        metrics["resumes"] = state["resumes"]
    points = _operating_point_reports(bnn, splits, ood_test, cfg, sample_counts, device)
    if points:
        metrics["operating_points"] = points
    write_json(run_dir / "metrics.json", metrics)
    log.info("final: %s", {s: {k: r["T1"][k] for k in ("error", "ece", "nll")} for s, r in reports.items()})
    return metrics


def _operating_point_reports(bnn, splits, ood_test, cfg: RunConfig, sample_counts, device) -> dict:
    """The final reports at each further operating point of the fitted posterior (``bnn.operating_points``).

    Returns ``{name: {"options": {option: value}, "final": {S: report}}}``; the model is left at the last point
    (``best.pt`` keeps the run's own). A point the posterior cannot reach is logged and left out.
    """
    out = {}
    for name in bnn.operating_points:
        try:
            options = bnn.use_operating_point(name)
        except ValueError as err:
            log.warning("%s: operating point %r left out: %s", cfg.method, name, err)
            continue
        log.info("%s: operating point %r: %s", cfg.method, name, options)
        out[name] = {"options": options,
                     "final": {str(s): final_reports(bnn, splits, ood_test, cfg, s, device)[0] for s in sample_counts}}
    return out


def _finalize_loader(dataset, cfg: RunConfig):
    """The in-order training loader of ``after_fit``; data-parallel, this rank's shard (each example on one rank).

    Laplace sums its curvature over the shards (an all-reduce inside ``fit_curvature``).
    """
    if not distributed.is_distributed():
        return _eval_loader(dataset, cfg)
    return torch.utils.data.DataLoader(dataset, batch_size=max(cfg.batch_size, 128), num_workers=cfg.num_workers,
                                       sampler=distributed.ShardSampler(len(dataset)))


def _history_csv(history: list[dict]) -> str:
    """The per-epoch history as CSV (one row per epoch, the union of keys as columns, in first-seen order)."""
    columns = list(dict.fromkeys(k for record in history for k in record))
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(history)
    return buf.getvalue()


def _tensorboard(run_dir: Path, start_epoch: int):
    """A TensorBoard ``SummaryWriter`` into ``run_dir/tensorboard`` when the ``tensorboard`` package is installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's writer needs the tensorboard package
        return None
    folder = run_dir / "tensorboard"
    kind = file_kind(folder)
    if kind is not None and kind != "a folder":  # never write events through a planted link
        raise UnsafePathError(f"refusing to write TensorBoard events into {folder}: it is {kind}; accepted: a "
                              "folder of the run")
    return SummaryWriter(str(folder), purge_step=start_epoch + 1 if start_epoch else None)


def evaluate_run(run_dir: str | Path, num_samples: int | None = None) -> dict:
    """Re-evaluates a saved run's best checkpoint with S samples, without training.

    Writes ``eval_S<S>.json`` into the run folder and returns the report.

    Raises:
        ValueError: if the folder has no ``config.yaml`` or the checkpoint does not match.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "best.pt").is_file():
        raise ValueError(f"{run_dir} is not a finished run folder (needs config.yaml and best.pt)")
    cfg = load_run_config(run_dir / "config.yaml")
    splits, ood_test, bnn, _, device = build(cfg, for_evaluation=True)
    state = load_checkpoint(run_dir / "best.pt", inside=run_dir)
    try:
        bnn.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint {run_dir / 'best.pt'} does not match the run's config: {err}") from None
    s = cfg.num_samples if num_samples is None else num_samples
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
        raise ValueError(f"num_samples={s!r} is not valid; accepted: an integer >= 0")
    with runs.open_existing(run_dir):
        report, _ = final_reports(bnn, splits, ood_test, cfg, s, device)
        write_json(run_dir / f"eval_S{s}.json", report)
    return report


def compare_methods() -> tuple[str, ...]:
    """The methods ``bayeswrap compare`` runs by default: those whose class sets ``in_default_comparison``."""
    return tuple(m for m, cls in METHODS.items() if cls.in_default_comparison)

COMPARE_COLUMNS = ("method", "tuned", "cost", "num_samples", "error", "ece", "nll", "ece_Topt", "nll_Topt", "temperature",
                   "shift_error", "shift_ece", "shift_nll", "shift_ece_Topt", "shift_nll_Topt",
                   "ood_auroc_entropy", "ood_auroc_mi", "coverage", "set_size")
"""Columns of comparison.md/.csv: the options chosen by tuning (``prior_std=0.3, kl_weight=0.01``; empty
with ``--no-tune``); the final run's training time as a multiple of MAP's in the same comparison (empty
without MAP; tuning runs not counted); in distribution at T = 1 and at the fitted T; the mean over every
non-zero shift intensity (rotation and noise) at T = 1 and at the in-distribution T; OOD AUROC of
held-out classes scored by predictive entropy and by mutual information (empty for S < 2); the test coverage and
mean size of the split conformal sets (``conformal_alpha``, ``conformal_score``; empty without validation data)."""


def operating_points(method: str, metrics: dict) -> dict[str, dict]:
    """A run's rows: ``{label: metrics}``, the run itself and each further operating point of its posterior.

    The run's label is ``method``, or ``"method (val)"`` when compare tuned its post hoc knob by validation NLL;
    a further point (``metrics["operating_points"]``, e.g. Laplace's ``"marglik"``) is ``"method (name)"``, with
    that point's final reports and its options in place of the post hoc knob's tuned value.
    """
    own = metrics.get("operating_point")
    rows = {f"{method} ({own})" if own else method: metrics}
    for name, point in (metrics.get("operating_points") or {}).items():
        tuning = dict(metrics.get("tuning") or {})
        tuning["options"] = {**{k: v for k, v in tuned_options(metrics).items() if k not in point["options"]},
                             **point["options"]}
        rows[f"{method} ({name})"] = {**metrics, "final": point["final"], "tuning": tuning}
    return rows


def comparison_rows(results: dict[str, dict]) -> list[dict]:
    """One row per (method or operating point, S) from each run's final reports (BayesDLL Table 2 layout, plus
    shift and OOD); see :func:`operating_points` for the labels.
    """
    rows = []
    seconds = {m: sum(h.get("seconds", 0.0) for h in r.get("history", [])) for m, r in results.items()}
    labelled = {label: (method, metrics) for method, run in results.items()
                for label, metrics in operating_points(method, run).items()}
    for label, (method, metrics) in labelled.items():
        cost = seconds[method] / seconds["map"] if seconds.get("map") else None
        for s, rep in metrics["final"].items():
            topt = rep.get("Topt") or {}
            shift = (rep.get("shift") or {}).get("summary", {})
            ood = rep.get("ood") or {}
            rows.append({"method": label, "tuned": tuned_text(metrics), "cost": cost, "num_samples": int(s), "error": rep["T1"]["error"],
                         "ece": rep["T1"]["ece"], "nll": rep["T1"]["nll"],
                         "ece_Topt": topt.get("ece"), "nll_Topt": topt.get("nll"),
                         "temperature": rep.get("temperature"),
                         **{f"shift_{k}": shift.get(k) for k in ("error", "ece", "nll", "ece_Topt", "nll_Topt")},
                         "ood_auroc_entropy": (ood.get("entropy") or {}).get("auroc"),
                         "ood_auroc_mi": (ood.get("mutual_information") or {}).get("auroc"),
                         "coverage": (rep.get("conformal") or {}).get("coverage"),
                         "set_size": (rep.get("conformal") or {}).get("mean_set_size")})
    return rows


def tuned_options(metrics: dict) -> dict:
    """``{option: chosen value}`` of a run's tuning record (``metrics.json["tuning"]``); empty without one."""
    tuning = metrics.get("tuning") or {}
    if "options" in tuning:
        return dict(tuning["options"])
    return {tuning["option"]: tuning["chosen"]} if "option" in tuning else {}  # a record of one knob


def tuned_text(metrics: dict) -> str:
    """The tuned options as ``prior_std=0.3, kl_weight=0.01`` (empty without tuning)."""
    return ", ".join(f"{k}={v:g}" for k, v in tuned_options(metrics).items())


def _markdown(rows: list[dict]) -> str:
    def fmt(v):
        return "" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))

    lines = ["| " + " | ".join(COMPARE_COLUMNS) + " |", "|" + "---|" * len(COMPARE_COLUMNS)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in COMPARE_COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _csv(rows: list[dict]) -> str:
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COMPARE_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def run_compare(config_path: str | None, overrides: dict, methods: list[str],
                sample_counts: list[int], tune_options: bool = True, *, resume: str | None = None,
                ) -> tuple[Path, list[dict]]:
    """Every method on the same data and split; writes comparison.md/.csv and the comparison figures.

    Figures (in the comparison folder, all at the last S of ``sample_counts``):
    ``reliability.png`` (one panel per method, with bin counts), ``shift.png``
    (error/NLL/ECE against shift intensity, with MAP + temperature scaling),
    ``risk_coverage.png`` and ``gamma.png``.

    Each method's options are resolved as for ``fit`` with ``--method`` set
    (so ``per_method`` entries apply), and each method gets its own run folder.

    With ``tune_options`` (the default; ``--no-tune`` turns it off) every method
    with a knob (:data:`bayeswrap.methods.TUNING`) first selects it and its prior
    std by the validation NLL of the posterior predictive at the last S of
    ``sample_counts``, each candidate trained on the same budget, on grids that
    bracket the optimum (:mod:`bayeswrap.evaluation.tuning`; Ovadia et al. 2019,
    §4): MAP (:data:`PRIOR_SOURCE`, run first) tunes its prior std; every other
    method starts from MAP's tuned prior std (the configured one without MAP),
    tunes its knob, then scores the prior std at a third and three times that
    value and keeps the best (:func:`~bayeswrap.evaluation.tuning.tune_with_prior`).
    A knob set post hoc (Laplace's prior precision) is tuned on each candidate's
    fitted posterior, so only the training prior std goes through the stages.
    The final run uses the chosen values; each ``metrics.json`` records every
    stage under ``"tuning"`` (see :func:`_compare_one`), and the table's
    ``tuned`` column names the chosen values.

    The comparison folder keeps its own invocation in ``compare.yaml``. With
    ``resume`` (a comparison folder), that invocation is read back: finished
    methods are kept, an interrupted one continues from its checkpoint, and
    ``overrides`` may change only :data:`bayeswrap.app.config.RESUME_ALLOWED`
    options; ``config_path``, ``methods``, ``sample_counts`` and
    ``tune_options`` are then taken from ``compare.yaml``.

    Raises:
        ValueError: for a bad option (before anything is written), or an
            override a resume may not change.
        RunInterrupted: on Ctrl-C.
    """
    changes: dict = {}
    if resume is not None:
        base = Path(resume)
        saved_path = base / "compare.yaml"
        if not saved_path.is_file():
            raise ValueError(f"--resume {base}: no compare.yaml there; accepted: a folder written by bayeswrap "
                             f"compare")

        saved = check_compare_record(read_yaml_file(saved_path, what="comparison record"), saved_path)
        file_values, saved_overrides = saved["config_file"], saved["overrides"]
        methods, sample_counts, tune_options = saved["methods"], saved["num_samples"], saved["tune"]
        check_method_list(methods, flag=f"{saved_path}: methods")
        first = resolve_values(file_values, {**saved_overrides, "method": methods[0]}, foreign_flags="drop")
        before = {**first.to_dict(), **first.method_options}
        for key, value in overrides.items():
            new = coerce(key, value)
            if new == before.get(key):
                continue
            if key not in RESUME_ALLOWED:
                raise ValueError(f"--resume {base}: {key}={new!r} differs from the comparison's {key}="
                                 f"{before.get(key)!r}; a resumed comparison keeps its data, split, models and "
                                 f"methods. Accepted changes: {', '.join(RESUME_ALLOWED)}")
            changes[key] = [before.get(key), new]
        overrides = {**saved_overrides, **{k: v[1] for k, v in changes.items()},
                     "out_dir": str(base.parent), "run_name": base.name}
    else:
        file_values = load_yaml(config_path) if config_path else {}
    check_method_list(methods)
    check_sample_counts(sample_counts)
    users = option_users()
    foreign = [k for k in overrides if k in users and not set(users[k]) & set(methods)]
    if foreign:
        raise ValueError(f"{', '.join(foreign)}: not an option of any compared method ({', '.join(methods)}); "
                         f"{foreign[0]} is an option of {', '.join(users[foreign[0]])}")
    # validate every method first (each method's options are checked by its constructor)
    configs = {m: resolve_values(file_values, {**overrides, "method": m}, foreign_flags="drop") for m in methods}
    for method_cfg in configs.values():
        preflight(method_cfg)  # model, files, device, classes: before any data or weights are loaded
    blind = [m for m in needs_validation_data(methods, tune_options, _knob) if configs[m].val_fraction == 0]
    if blind:
        raise ValueError(f"val_fraction=0 leaves no validation data, which tuning needs for {', '.join(blind)} "
                         f"(each candidate, and Laplace's post hoc prior precision, is scored by validation NLL); "
                         f"accepted: val_fraction in (0, 1), or --no-tune to keep the configured values")
    cfg = configs[methods[0]]
    base = Path(cfg.out_dir) / (cfg.run_name or f"compare-{cfg.dataset}-{cfg.model.replace(':', '_')}")
    command = f"bayeswrap compare --resume {base}"
    if resume is not None:
        lock = runs.open_existing(base)
    else:
        lock = runs.open_new(cfg.out_dir, base.name, overwrite=cfg.overwrite, kind="compare")
        write_yaml(base / "compare.yaml", {"config_file": file_values, "overrides": overrides, "methods": methods,
                                           "num_samples": sample_counts, "tune": tune_options})
    try:
        results, inherited = {}, None
        # MAP first (the others inherit its σ); ensembles after their members (they inherit the member's options)
        for method in sorted(methods, key=lambda m: (m != PRIOR_SOURCE, issubclass(METHODS[m], Ensemble))):
            member = _ensemble_member(configs[method])
            results[method] = _compare_one(base, method, configs[method], sample_counts, tune_options,
                                           resume is not None, changes, command, prior_std=inherited,
                                           member_tuning=results.get(member, {}).get("tuning") if member else None)
            if method == PRIOR_SOURCE and tune_options:
                inherited = tuned_options(results[method]).get("prior_std")
        results = {m: results[m] for m in methods}
        rows = comparison_rows(results)
        write_text(base / "comparison.md", _markdown(rows))
        write_text(base / "comparison.csv", _csv(rows))
        last = {m: r["final"][str(sample_counts[-1])] for m, r in results.items()}
        plots.reliability_grid({m: r["bins"] for m, r in last.items()}, base / "reliability.png",
                               num_samples=sample_counts[-1], title="Reliability on the test set, T = 1")
        _write_uncertainty_plots(base, last, temperature_scaled="map")
        return base, rows
    except KeyboardInterrupt:
        raise RunInterrupted(base, command) from None
    finally:
        lock.release()


def _ensemble_member(cfg: RunConfig) -> str | None:
    """The member method of an ensemble run (its ``member`` option, else the class's default), else None."""
    cls = METHODS[cfg.method]
    if not issubclass(cls, Ensemble):
        return None
    return cfg.option("member") or cls.default_member


def _inherit_member_tuning(cfg: RunConfig, member: str, member_tuning: dict) -> tuple[RunConfig, dict]:
    """An ensemble run with its member method's tuned options: ``prior_std`` for every member, the knob through
    ``member_kwargs`` (a deep ensemble of M tuned networks, as practitioners build one); and its tuning record.

    A post hoc knob (Laplace's prior precision) is fitted per member and is not inherited.
    """
    options = {k: v for k, v in member_tuning.get("options", {}).items() if k in tuned_option_names(member)}
    prior = options.pop("prior_std", None)
    values = {} if prior is None else {"prior_std": prior}
    if options:
        values["member_kwargs"] = {**(cfg.option("member_kwargs") or {}), **options}
    record = {"options": {**({} if prior is None else {"prior_std": prior}), **options}, "inherited_from": member,
              "val_nll": member_tuning.get("val_nll"), "stages": []}
    return cfg.with_options(**values), record


def _compare_one(base: Path, method: str, cfg: RunConfig, sample_counts, tune_options: bool, resume: bool,
                 changes: dict, command: str, *, prior_std: float | None = None,
                 member_tuning: dict | None = None) -> dict:
    """One method of a comparison: reuse a finished run, continue an interrupted one, or tune and run it.

    Tuning (``tune_options``, methods with a knob) follows
    :func:`~bayeswrap.evaluation.tuning.tune_with_prior`, starting from ``prior_std``
    (MAP's tuned value; None: the configured one). Every candidate is scored by
    :func:`tuning_score`. The record is written to ``tuning_<method>.json`` before
    the final run, which a resumed comparison reads back instead of tuning again
    (:func:`read_tuning_file`). An ensemble whose member method ran earlier in the
    comparison (``member_tuning``, that run's record) is not tuned again: it takes
    the member's tuned options (:func:`_inherit_member_tuning`). The record is stored in
    ``metrics.json["tuning"]`` as
    ``{"options": {option: value}, "val_nll", "choice", "prior_std_from": "map" |
    "config", "stages": [{"stage", "option", "fixed", "grid", "val_nll",
    "chosen", "chosen_index", "extensions", "reused", "bound_hit", "bounds"}]}``;
    the post hoc knob of the final run is its last stage (``"post_hoc"``).
    """
    run_dir = base / method
    run_cfg = replace(cfg, out_dir=str(base), run_name=method, overwrite=False)
    if resume and (run_dir / "metrics.json").is_file():
        log.warning("compare: %s is finished; keeping %s", method, run_dir / "metrics.json")
        return json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    tuning_path = base / f"tuning_{method}.json"
    tuning = None
    knob = _knob(method) if tune_options else None
    member = _ensemble_member(cfg)
    if tune_options and member is not None and member_tuning:  # an ensemble: its member method's tuned options
        run_cfg, tuning = _inherit_member_tuning(run_cfg, member, member_tuning)
        resume_run = resume and runs.is_run_folder(run_dir)
        return run_fit(run_cfg.validate(), sample_counts, tuning, resume=resume_run, changes=changes or None,
                       resume_command=command)[1]
    if knob is not None and resume and tuning_path.is_file():
        tuning = read_tuning_file(tuning_path, method)
    elif knob is not None:
        tuning = _tune_one(run_cfg, method, knob, sample_counts[-1], prior_std)
        write_json(tuning_path, tuning)
    if tuning is not None:
        run_cfg = run_cfg.with_options(**tuning["options"])
    resume_run = resume and runs.is_run_folder(run_dir)
    return run_fit(run_cfg.validate(), sample_counts, tuning, resume=resume_run, changes=changes or None,
                   resume_command=command)[1]


def _tune_one(run_cfg: RunConfig, method: str, knob: str, num_samples: int, prior_std: float | None) -> dict:
    """The tuning record of one method (see :func:`_compare_one`): each candidate trained by :func:`tuning_score`."""
    source = "config" if prior_std is None or knob == "prior_std" else PRIOR_SOURCE
    start = run_cfg.prior_std if source == "config" else prior_std
    scored_knob = None if knob == POST_HOC else knob  # a post hoc knob is tuned inside each candidate's score
    grid = tuning_option(method)[1] if scored_knob else ()
    if knob == "prior_std":
        log.warning("compare: tuning %s by validation NLL: prior_std over %s", method, list(grid))
    else:
        log.warning("compare: tuning %s by validation NLL: %s over %s, then prior_std around %s's %g", method,
                    scored_knob or "(post hoc knob only)", list(grid), source, start)

    def score(options: dict) -> float:
        return tuning_score(run_cfg.with_options(**options).validate(), num_samples)

    record = tune_with_prior(score, knob=scored_knob, grid=grid,
                             bounds=tuning_bounds(method, scored_knob) if scored_knob else (0.0, math.inf),
                             prior_std=start, prior_bounds=tuning_bounds(method, "prior_std"))
    for stage in record["stages"]:
        if stage["bound_hit"] is not None:
            log.warning("compare: %s's %s not bracketed: %s", method, stage["option"], stage["bound_hit"])
    return {**record, "prior_std_from": source}


def tuned_option_names(method: str) -> tuple[str, ...]:
    """The options a tuning record may set before training ``method``: its prior std and its knob (not a post hoc one)."""
    knob = _knob(method)
    return ("prior_std",) + ((knob,) if knob not in (None, "prior_std", POST_HOC) else ())


def read_tuning_file(path: Path, method: str) -> dict:
    """A ``tuning_<method>.json`` of a resumed comparison, checked before any of it is applied.

    Only the method's tuned options (:func:`tuned_option_names`) may be set, each a
    finite number: the file must not change anything else of the run (its folder,
    data or model).

    Raises:
        ValueError: naming the file, for a file that is not a tuning record, an
            option that is not one of the method's tuned options, or a value that
            is not a finite number.
    """
    try:
        record = read_json_file(path, what="tuning record")
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable tuning record ({err}); delete it to tune {method} again") \
            from None
    options = record.get("options") if isinstance(record, dict) else None
    if not isinstance(options, dict) or not options:
        raise ValueError(f"{path} is not a tuning record (no {{'options': {{option: value}}}}); delete it to tune "
                         f"{method} again")
    allowed = tuned_option_names(method)
    bad = [k for k in options if k not in allowed]
    if bad:
        raise ValueError(f"{path}: {', '.join(map(str, bad))} is not a tuned option of method {method!r}; "
                         f"accepted: {', '.join(allowed)}")
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{path}: {key}={value!r} is not a finite number")
    return record


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


def predict_rows(probs: torch.Tensor, names: list[str], class_names: list[str]) -> list[dict]:
    """One CSV row per input from (S, N, K) sample probabilities.

    Columns: ``input``, ``predicted_class`` (index), ``predicted_label``,
    ``confidence`` (the predictive probability of that class), ``prob_<class>``
    for each class, ``entropy`` (of the posterior predictive, nats),
    ``expected_entropy`` and ``mutual_information`` (nats; empty for S < 2).
    """
    mean = probs.mean(0)
    entropy = predictive_entropy(probs).tolist()
    epistemic = mutual_information(probs).tolist() if probs.shape[0] >= 2 else [None] * len(names)
    aleatoric = expected_entropy(probs).tolist() if probs.shape[0] >= 2 else [None] * len(names)
    conf, pred = mean.max(-1)
    rows = []
    class_names = [csv_text(c) for c in class_names]
    for i, name in enumerate(names):
        row = {"input": csv_text(name), "predicted_class": int(pred[i]), "predicted_label": class_names[int(pred[i])],
               "confidence": float(conf[i])}
        row.update({f"prob_{c}": float(p) for c, p in zip(class_names, mean[i].tolist())})
        row.update(entropy=entropy[i], expected_entropy=aleatoric[i], mutual_information=epistemic[i])
        rows.append(row)
    return rows


#: first characters a spreadsheet reads as a formula (OWASP's CSV injection list)
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value: str) -> str:
    """A file or class name for the CSV: prefixed with ``'`` when a spreadsheet would run it as a formula."""
    value = str(value)
    return "'" + value if value.startswith(FORMULA_STARTS) else value


def _predict_command(args) -> int:

    s = None if args.num_samples is None else _count("num_samples", args.num_samples, 0, MAX_PREDICTIVE_SAMPLES)
    batch_size = _count("batch_size", args.batch_size, 1)
    seed = check_seed("--seed", args.seed)
    if args.device is not None:
        check_device("--device", args.device, available=True)
    out = runs.check_user_output(args.out, overwrite=args.overwrite)
    run = runs.load_run(args.run_dir, device=args.device)
    inputs, names = load_inputs(args.inputs, run.transform, run.input_shape)
    probs = run.sample_probs(inputs, s, batch_size=batch_size, seed=seed)
    rows = predict_rows(probs, names, run.class_names)
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    remove_stale_tmp_of(out)  # what a killed predict left beside this file
    runs.check_user_output(out, overwrite=args.overwrite)  # unchanged while the model predicted
    write_text(out, buf.getvalue())
    print(f"{len(rows)} predictions (S={probs.shape[0] if (s or run.config.num_samples) else 0}) written to {out}")
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
        print(_markdown(rows))
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
