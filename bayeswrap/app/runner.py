"""One run of ``bayeswrap fit``: its folder, lock, resume, checkpoints and logs.

:func:`run_fit` trains one configuration end to end and writes its run folder::

    out_dir/<run-name>/
        config.yaml        the fully resolved config
        data.json          what a saved run needs to know about its data (bayeswrap.app.build.DataInfo)
        metrics.json       per-epoch history and the final reports (calibration, selective, gamma, conformal, shift,
                           ood)
        best.pt            best-validation checkpoint (torch.load(..., weights_only=True))
        last.pt            last epoch's checkpoint (for --resume)
        history.csv        the per-epoch history
        reliability_T1.png, reliability_Topt.png, temperature_curve.png, training_curves.png,
        shift.png, risk_coverage.png, gamma.png
        train.log

Every file is written atomically, while the run holds the folder's lock (:class:`bayeswrap.app.runs.RunLock`).
``best.pt`` and ``last.pt`` carry the SHA-256 of each tensor and value in an extra zip record that
``torch.load`` ignores (``best.pt`` stays a bare ``state_dict``); ``--resume``, ``evaluate``, ``predict`` and
``load_run`` refuse a file that differs from it (:mod:`bayeswrap.core.digest`).
:func:`evaluate_run` scores a saved run again with another number of samples.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bayeswrap.app import runs
from bayeswrap.app.build import (
    AMP_DTYPES,
    EpochLoader,
    build,
    data_info,
    eval_loader,
    make_optimizer,
    make_scheduler,
    preflight,
)
from bayeswrap.app.config import FIELDS, RESUME_ALLOWED, RunConfig, coerce, load_run_config
from bayeswrap.app.outputs import naming_failures, save_checkpoint, write_json, write_text, write_yaml
from bayeswrap.app.reports import final_reports, history_csv, operating_point_reports, write_plots
from bayeswrap.core import distributed
from bayeswrap.core.io import CheckpointError, UnsafePathError, file_kind, load_checkpoint, open_append
from bayeswrap.data.datasets import DataSplits
from bayeswrap.evaluation import plots
from bayeswrap.methods import BayesianModel
from bayeswrap.predictive import evaluate as evaluate_loader
from bayeswrap.training import fit, rng_preserved

log = logging.getLogger("bayeswrap")


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
    runs.refuse_symlink(run_dir, f"--resume {run_dir}: the run folder")
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
            post_hoc: Callable[[BayesianModel, DataSplits, dict], dict] | None = None) -> tuple[Path, dict]:
    """Trains one configuration end to end and writes its run folder.

    Everything is checked (config, data, model, checkpoint) before a file is
    written. The run holds the folder's lock (:class:`bayeswrap.app.runs.RunLock`)
    until it ends.

    Args:
        cfg: a validated config.
        sample_counts: the S values of the final reports (default ``[cfg.num_samples]``).
        tuning: the tuning record to store in ``metrics.json`` (``compare``).
        post_hoc: with ``tuning``, ``post_hoc(bnn, splits, tuning)`` tunes a knob set post hoc on the
            fitted posterior (``compare``'s prior precision: bracketed grid, scored on validation, best value
            set) after ``after_fit`` and before ``best.pt`` is saved, and returns the record with that
            stage added; the run's reports are at that operating point (``metrics.json["operating_point"]``
            is ``"val"``).
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
    launcher = f"torchrun --nproc_per_node={world} -m " if world > 1 else ""
    command = resume_command or f"{launcher}bayeswrap fit --resume {run_dir}"
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
                                    ckpt, changes, post_hoc if tuning is not None else None)
        return run_dir, metrics
    except KeyboardInterrupt:
        raise RunInterrupted(run_dir, command) from None
    except distributed.CollectiveError as err:  # another rank died or hung: say what the folder keeps
        kept = ("last.pt keeps its last complete epoch" if (run_dir / "last.pt").is_file() else
                "no epoch was complete (no last.pt), so a resume starts it again")
        raise distributed.CollectiveError(f"{err}. The run in {run_dir} did not finish (no metrics.json); {kept}. "
                                          f"Resume with: {command}") from err
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


def _sample_and_report(cfg, run_dir, splits, ood_test, bnn, device, sample_counts) -> dict:
    """A full-batch sampler's run: chains on the whole training set, then the same reports as a fitted run."""
    loader = eval_loader(splits.train, cfg)
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
            with naming_failures(run_dir, "writing the figures"):
                write_plots(run_dir, report, arrays, [], cfg)
    metrics = {"history": [], "best_epoch": None, "final": reports, "mcmc": {**stats, "diagnostics": diagnostics}}
    write_json(run_dir / "metrics.json", metrics)
    return metrics


def _train_and_report(cfg, run_dir, splits, ood_test, bnn, optimizer, device, sample_counts, tuning=None,
                      ckpt=None, changes=None, post_hoc=None):
    """Trains, finalises on the best state and writes the reports; data-parallel, only rank 0 writes (else None)."""
    if optimizer is None:
        return _sample_and_report(cfg, run_dir, splits, ood_test, bnn, device, sample_counts)
    main = distributed.is_main_process()
    train_loader = EpochLoader(splits.train, cfg.batch_size, cfg.seed, cfg.num_workers,
                               num_replicas=distributed.world_size(), rank=distributed.rank())
    scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None
    val_loader = eval_loader(splits.val, cfg) if len(splits.val) else None
    test_loader = eval_loader(splits.test, cfg)
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
    if main:  # a resumed run is unfinished again until it ends: its epochs may replace best.pt
        (run_dir / "metrics.json").unlink(missing_ok=True)

    def on_epoch_end(epoch, record):
        bnn.eval()
        # every rank evaluates (identical replicas, and the random streams stay in step); rank 0 writes
        with rng_preserved(device):  # the test score draws nothing from the training's random stream
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
        write_text(run_dir / "history.csv", history_csv(state["history"]))
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
                progress={"desc": cfg.method} if cfg.progress and sys.stderr.isatty() else False, finalize=False)
    except FloatingPointError as err:
        raise FloatingPointError(f"{err}; the last good checkpoint is kept in {run_dir / 'last.pt'}") from None
    finally:
        if board is not None:
            board.close()
    # finalise on the best-validation state (after_fit: a curvature, a sample store) and save it
    if main:
        bnn.load_state_dict(load_checkpoint(run_dir / "best.pt", inside=run_dir))
    distributed.broadcast_state_dict_(bnn)  # data-parallel: rank 0 read the best state; every rank finalises
    bnn.after_fit(_finalize_loader(splits.train, cfg))
    if not main:
        return None
    if post_hoc is not None:
        tuning = post_hoc(bnn, splits, tuning)
    save_checkpoint(run_dir / "best.pt", bnn.state_dict())
    reports = {}
    for s in sample_counts:
        report, arrays = final_reports(bnn, splits, ood_test, cfg, s, device)
        reports[str(s)] = report
        if s == sample_counts[-1]:
            with naming_failures(run_dir, "writing the figures"):
                write_plots(run_dir, report, arrays, state["history"], cfg)
    metrics = {"history": state["history"], "best_epoch": state["best_epoch"], "final": reports}
    if tuning is not None:
        metrics["tuning"] = tuning
        if post_hoc is not None:
            metrics["operating_point"] = "val"
    if state["resumes"]:
        metrics["resumes"] = state["resumes"]
    points = operating_point_reports(bnn, splits, ood_test, cfg, sample_counts, device)
    if points:
        metrics["operating_points"] = points
    write_json(run_dir / "metrics.json", metrics)
    log.info("final: %s", {s: {k: r["T1"][k] for k in ("error", "ece", "nll")} for s, r in reports.items()})
    return metrics


def _finalize_loader(dataset, cfg: RunConfig):
    """The in-order training loader of ``after_fit``; data-parallel, this rank's shard (each example on one rank).

    A curvature fit sums over the shards (an all-reduce inside ``fit_curvature``).
    """
    if not distributed.is_distributed():
        return eval_loader(dataset, cfg)
    return torch.utils.data.DataLoader(dataset, batch_size=max(cfg.batch_size, 128), num_workers=cfg.num_workers,
                                       sampler=distributed.ShardSampler(len(dataset)))


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
    runs.refuse_symlink(run_dir, f"evaluate {run_dir}: the run folder")
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
    with runs.open_existing(run_dir, what="evaluate"):
        report, _ = final_reports(bnn, splits, ood_test, cfg, s, device)
        write_json(run_dir / f"eval_S{s}.json", report)
    return report
