"""The ``bayeswrap`` command line: ``fit``, ``compare`` and ``evaluate``.

A thin layer over the library: resolve the config (YAML + ``--key value``
overrides), load data and backbone, ``wrap`` it, ``fit`` it, score the posterior
predictive with :mod:`bayeswrap.evaluation.protocol` (in distribution, under
rotation and noise shift, against held-out classes), and write the run folder::

    out_dir/<run-name>/
        config.yaml        the fully resolved config
        metrics.json       per-epoch history and the final reports (calibration, selective, gamma, shift, ood)
        best.pt            best-validation checkpoint (torch.load(..., weights_only=True))
        last.pt            last epoch's checkpoint (for --resume)
        reliability_T1.png, reliability_Topt.png, temperature_curve.png, training_curves.png,
        shift.png, risk_coverage.png, gamma.png
        train.log

Every file is written atomically.
"""

from __future__ import annotations

import argparse
import copy
import csv
import io as _stdio
import logging
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from . import plots
from .evaluation import calibration, protocol
from .evaluation.shift import hold_out_classes, shifted_dataset
from .config import FIELDS, RunConfig, coerce, load_yaml, resolve
from .data import DataError, load_data
from .functional import select_parameters
from .io import load_checkpoint, save_checkpoint, write_json, write_text, write_yaml
from .methods import METHODS, method_options, wrap
from .methods.sgld import BURN_IN_FRACTION
from .models import create_model, data_config, head_parameter_names
from . import optim as bw_optim
from .predictive import evaluate as evaluate_loader
from .predictive import sample_probs_loader
from .training import fit
from .tuning import tune, tuning_option

log = logging.getLogger("bayeswrap")


class EpochLoader:
    """A shuffling loader whose order depends only on (seed, epoch), so resumed runs repeat it exactly.

    :func:`bayeswrap.fit` calls :meth:`set_epoch` before each epoch.
    """

    def __init__(self, dataset, batch_size: int, seed: int, num_workers: int = 0):
        self.dataset, self.batch_size, self.seed, self.num_workers = dataset, batch_size, seed, num_workers
        self.epoch = 0

    def __len__(self) -> int:
        return (len(self.dataset) + self.batch_size - 1) // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, generator=g,
                               num_workers=self.num_workers))


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ValueError(f"device={name!r} is not valid; accepted: auto, cpu, cuda, cuda:N") from None


def build(cfg: RunConfig, *, for_evaluation: bool = False):
    """Data, backbone and Bayesian model for a config (nothing is written).

    With ``for_evaluation`` no pretrained weights are fetched: the checkpoint
    about to be loaded holds every tensor.

    With held-out classes (``cfg.ood_classes``) the splits hold only the kept
    classes, relabelled 0..K'-1, and the model has K' outputs.

    Returns:
        ``(splits, ood_test, bnn, head_names, device)``; ``ood_test`` is the dataset
        of held-out-class test examples, or None.
    """
    torch.manual_seed(cfg.seed)
    is_mlp = cfg.model == "mlp"
    pretrained = cfg.pretrained and not for_evaluation
    init_checkpoint = None if for_evaluation else (cfg.init_checkpoint or None)
    # the model decides the transforms when pretrained; build it once the class count is known
    splits = load_data(cfg.dataset, root=cfg.data_root, download=cfg.download, val_fraction=cfg.val_fraction,
                       seed=cfg.seed, img_size=cfg.img_size or (None if cfg.dataset != "digits" or is_mlp else 32),
                       flatten=is_mlp)
    extra = {}
    if is_mlp:
        extra["in_features"] = int(torch.Size(splits.input_shape).numel())
    elif cfg.dataset in ("digits", "mnist5k") and not cfg.model.startswith("tv:"):
        extra["in_chans"] = 1
    held_out = cfg.held_out_classes(splits.name)
    ood_test = None
    if held_out:
        splits, ood_test = hold_out_classes(splits, held_out)
    model = create_model(cfg.model, splits.num_classes, pretrained=pretrained, init_checkpoint=init_checkpoint,
                         **extra)
    if cfg.pretrained and not is_mlp:
        splits = load_data(cfg.dataset, root=cfg.data_root, download=cfg.download, val_fraction=cfg.val_fraction,
                           seed=cfg.seed, data_config=data_config(model))
        if held_out:
            splits, ood_test = hold_out_classes(splits, held_out)
    head = head_parameter_names(model)
    patterns = [p.strip() for p in cfg.params.split(",") if p.strip()] or None
    bayesian = select_parameters(model, patterns)
    if cfg.prior_mean == "auto" and cfg.pretrained and not cfg.init_checkpoint:
        # BayesDLL: the pretrained body is the prior mean, the new head's prior mean is zero
        params = dict(model.named_parameters())
        prior_mean = {n: torch.zeros_like(params[n]) if n in head else params[n].detach() for n in bayesian}
    elif cfg.prior_mean == "auto":
        prior_mean = "init" if cfg.init_checkpoint else "zero"
    else:
        prior_mean = cfg.prior_mean
    num_data = max(1, round(len(splits.train) * cfg.num_data_inflate))
    options = {k: getattr(cfg, k) for k in method_options(cfg.method) if k in FIELDS}
    if cfg.method == "laplace":
        # the reports score every method by the same S-sample protocol, so the GLM predictive is sampled too
        options["link_approx"] = "mc"
    if cfg.method == "sgld":
        options["cycles"] = cfg.cycles or None
        options["burn_in"] = "auto"
        if not cfg.cycles:
            steps = (len(splits.train) + cfg.batch_size - 1) // cfg.batch_size
            epochs = cfg.epochs * BURN_IN_FRACTION if cfg.burn_in() is None else cfg.burn_in()
            options["burn_in"] = round(epochs * steps)
            # keep samples even in short runs: burn-in at most half of training, and one thinning interval
            # before the end
            longest = max(0, min(cfg.epochs * steps // 2, cfg.epochs * steps - cfg.thinning))
            if options["burn_in"] > longest:
                options["burn_in"] = longest
                log.warning("sgld: burn_in_epochs=%s leaves too few samples in %d epochs; burn-in shortened to %d "
                            "steps", cfg.burn_in_epochs, cfg.epochs, options["burn_in"])
    bnn = wrap(model, cfg.method, num_data=num_data, prior_std=cfg.prior_std, prior_mean=prior_mean,
               bias=cfg.bias, params=patterns, kl_weight=cfg.kl_weight, **options)
    device = _device(cfg.device)
    return splits, ood_test, bnn.to(device), head, device


def _eval_loader(dataset, cfg: RunConfig):
    return DataLoader(dataset, batch_size=max(cfg.batch_size, 128), shuffle=False, num_workers=cfg.num_workers)


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
        ``shift`` and ``ood`` added, and the predictive probabilities and labels used.
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
    grids = {"rotation": cfg.rotation_angles(), "noise": cfg.noise_stds()}
    report["shift"] = protocol.shift_report(
        lambda kind, level: predict(shifted_dataset(splits.test, kind, level, image_shape=splits.image_shape,
                                                    seed=cfg.seed)),
        grids, temperature=report.get("temperature", 1.0), n_bins=cfg.n_bins)
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
    plots.training_curves(history, run_dir / "training_curves.png")
    _write_uncertainty_plots(run_dir, {cfg.method: report}, temperature_scaled=cfg.method)


def _write_uncertainty_plots(folder: Path, reports: dict[str, dict], *, temperature_scaled: str | None) -> None:
    """shift.png, risk_coverage.png and gamma.png of one or several methods' final reports."""
    s = {m: r["num_samples"] for m, r in reports.items()}
    label = ", ".join(sorted({f"S = {v}" for v in s.values()}))
    if any(k in r["shift"] for r in reports.values() for k in ("rotation", "noise")):
        baseline = temperature_scaled if temperature_scaled in reports else None
        plots.shift_curves({m: r["shift"] for m, r in reports.items()}, folder / "shift.png",
                           temperature_scaled=baseline, title=f"Dataset shift ({label}; TS: temperature from "
                                                               "in-distribution validation)")
    plots.risk_coverage_curves({m: r["selective"] for m, r in reports.items()}, folder / "risk_coverage.png",
                               title=f"Selective prediction ({label})")
    if any(r["gamma"] for r in reports.values()):
        plots.gamma_curves({m: r["gamma"] for m, r in reports.items()}, folder / "gamma.png",
                           title=f"γ(α) of the uncertainty measures ({label})")


def _setup_logging(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


def prepare_run_dir(cfg: RunConfig) -> Path:
    """The run folder; refuses to clobber an existing one without ``--resume``/``--overwrite``."""
    run_dir = Path(cfg.out_dir) / cfg.name
    if cfg.resume:
        if not (run_dir / "last.pt").is_file():
            raise ValueError(f"--resume: no checkpoint {run_dir / 'last.pt'} to resume from")
    elif run_dir.exists():
        if not cfg.overwrite:
            raise ValueError(f"run folder {run_dir} exists; pass --resume to continue it or --overwrite to replace it")
        shutil.rmtree(run_dir)
    return run_dir


def run_fit(cfg: RunConfig, sample_counts: list[int] | None = None, tuning: dict | None = None,
            ) -> tuple[Path, dict]:
    """Trains one configuration end to end and writes its run folder.

    Args:
        cfg: a validated config.
        sample_counts: the S values of the final reports (default ``[cfg.num_samples]``).
        tuning: the tuning record to store in ``metrics.json`` (``compare``). A
            record for ``"prior_precision"`` (Laplace) is carried out here, after
            the curvature is fitted: its ``grid`` is scored on validation and the
            best value set.

    Returns:
        ``(run_dir, metrics)``.
    """
    sample_counts = sample_counts or [cfg.num_samples]
    splits, ood_test, bnn, head, device = build(cfg)  # all input is checked before anything is written
    run_dir = prepare_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = _setup_logging(run_dir)
    try:
        write_yaml(run_dir / "config.yaml", cfg.to_dict())
        return run_dir, _train_and_report(cfg, run_dir, splits, ood_test, bnn, head, device, sample_counts, tuning)
    finally:
        log.removeHandler(handler)
        handler.close()


def make_optimizer(cfg: RunConfig, bnn, head) -> torch.optim.Optimizer:
    """The optimizer of a run: the method's own (SGLD, IVON) if it has one, else SGD with momentum."""
    groups = bnn.param_groups(head, cfg.lr_head or None)
    if bnn.required_optimizer is bw_optim.SGLD:
        return bw_optim.SGLD(groups, lr=cfg.lr, num_data=bnn.num_data, noise_scale=cfg.noise_scale)
    if bnn.required_optimizer is not None:
        return bnn.required_optimizer(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def tuning_score(cfg: RunConfig, num_samples: int) -> float:
    """Validation NLL of one tuning candidate: trained exactly as ``fit`` trains, nothing written.

    The model is trained for ``cfg.epochs`` epochs, the best-validation epoch is
    kept (as ``best.pt`` is in a run), the method is finalised (Laplace fits its
    curvature) and the posterior predictive with ``num_samples`` samples is
    scored on the validation set. A run whose loss diverges, or that ends
    without a posterior (SGLD keeping no sample), scores ``inf``.
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
            autocast_dtype=torch.bfloat16 if cfg.amp else None, progress=False, finalize=False)
    except FloatingPointError:
        return float("inf")
    bnn.after_fit(_eval_loader(splits.train, cfg))
    if not bnn.is_ready():  # e.g. SGLD kept no sample: the candidate has no posterior and cannot win
        return float("inf")
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    return evaluate_loader(bnn, val_loader, num_samples, generator=gen)["nll"]


def _tune_prior_precision(bnn, splits, cfg: RunConfig, tuning: dict, num_samples: int, device) -> dict:
    """Laplace's post-hoc prior precision: the grid value with the lowest validation NLL, set on ``bnn``."""
    chosen = bnn.optimize_prior_precision("val", val_loader=_eval_loader(splits.val, cfg), grid=tuning["grid"],
                                          num_samples=num_samples, seed=cfg.seed)
    grid = bnn.val_search["grid"]
    log.info("laplace: prior precision %g chosen by validation NLL over %s", chosen, grid)
    return {"option": "prior_precision", "grid": grid, "val_nll": bnn.val_search["nll"], "chosen": chosen,
            "chosen_index": grid.index(chosen)}


def _train_and_report(cfg, run_dir, splits, ood_test, bnn, head, device, sample_counts, tuning=None):
    optimizer = make_optimizer(cfg, bnn, head)
    train_loader = EpochLoader(splits.train, cfg.batch_size, cfg.seed, cfg.num_workers)
    val_loader = _eval_loader(splits.val, cfg) if len(splits.val) else None
    test_loader = _eval_loader(splits.test, cfg)
    state = {"history": [], "best_val_nll": float("inf"), "best_epoch": 0}
    start_epoch = 0
    if cfg.resume:
        ckpt = load_checkpoint(run_dir / "last.pt")
        bnn.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        state = {k: ckpt[k] for k in state}
        start_epoch = ckpt["epoch"]
        log.info("resumed from %s at epoch %d", run_dir / "last.pt", start_epoch)
    log.info("config: %s", cfg.to_dict())
    log.info("data: %s, %d classes; Bayesian parameters: %d tensors, num_data=%d", splits.sizes(),
             splits.num_classes, len(bnn.bayesian_names), bnn.num_data)

    def on_epoch_end(epoch, record):
        bnn.eval()
        record.update({f"test_{k}": v for k, v in
                       evaluate_loader(bnn, test_loader, 0, allow_point_estimate=True).items()})
        state["history"].append(record)
        # without validation data, or for a sampler (its posterior is the whole chain), the last epoch is best
        val_nll = record.get("val_nll", -float(epoch)) if bnn.select_best_epoch else -float(epoch)
        if val_nll < state["best_val_nll"]:
            state["best_val_nll"], state["best_epoch"] = val_nll, epoch + 1
            save_checkpoint(run_dir / "best.pt", bnn.state_dict())
        save_checkpoint(run_dir / "last.pt", {"model": bnn.state_dict(), "optimizer": optimizer.state_dict(),
                                              "epoch": epoch + 1, "rng": torch.get_rng_state(), **state})
        log.info("epoch %d: %s", epoch + 1, {k: round(v, 5) if isinstance(v, float) else v
                                              for k, v in record.items()})

    try:
        fit(bnn, train_loader, epochs=cfg.epochs, optimizer=optimizer, val_loader=val_loader,
            autocast_dtype=torch.bfloat16 if cfg.amp else None, start_epoch=start_epoch,
            on_epoch_end=on_epoch_end, progress=cfg.progress, finalize=False)
    except FloatingPointError as err:
        raise FloatingPointError(f"{err}; the last good checkpoint is kept in {run_dir / 'last.pt'}") from None
    # finalise on the best-validation state (Laplace fits its curvature there) and save it
    bnn.load_state_dict(load_checkpoint(run_dir / "best.pt"))
    bnn.after_fit(_eval_loader(splits.train, cfg))
    if tuning is not None and tuning.get("option") == "prior_precision":
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
    write_json(run_dir / "metrics.json", metrics)
    log.info("final: %s", {s: {k: r["T1"][k] for k in ("error", "ece", "nll")} for s, r in reports.items()})
    return metrics


def evaluate_run(run_dir: str | Path, num_samples: int | None = None) -> dict:
    """Re-evaluates a saved run's best checkpoint with S samples, without training.

    Writes ``eval_S<S>.json`` into the run folder and returns the report.

    Raises:
        ValueError: if the folder has no ``config.yaml`` or the checkpoint does not match.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "best.pt").is_file():
        raise ValueError(f"{run_dir} is not a finished run folder (needs config.yaml and best.pt)")
    cfg = RunConfig(**load_yaml(run_dir / "config.yaml")).validate()
    splits, ood_test, bnn, _, device = build(cfg, for_evaluation=True)
    try:
        bnn.load_state_dict(load_checkpoint(run_dir / "best.pt"))
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"checkpoint {run_dir / 'best.pt'} does not match the run's config: {err}") from None
    s = cfg.num_samples if num_samples is None else num_samples
    report, _ = final_reports(bnn, splits, ood_test, cfg, s, device)
    write_json(run_dir / f"eval_S{s}.json", report)
    return report


COMPARE_METHODS = ("map", "vi", "ivon", "mc_dropout", "sgld", "laplace")
COMPARE_COLUMNS = ("method", "num_samples", "error", "ece", "nll", "ece_Topt", "nll_Topt", "temperature",
                   "shift_error", "shift_ece", "shift_nll", "shift_ece_Topt", "shift_nll_Topt",
                   "ood_auroc_entropy", "ood_auroc_mi")
"""Columns of comparison.md/.csv: in distribution at T = 1 and at the fitted T; the mean over every
non-zero shift intensity (rotation and noise) at T = 1 and at the in-distribution T; OOD AUROC of
held-out classes scored by predictive entropy and by mutual information (empty for S < 2)."""


def comparison_rows(results: dict[str, dict]) -> list[dict]:
    """One row per (method, S) from each run's final reports (BayesDLL Table 2 layout, plus shift and OOD)."""
    rows = []
    for method, metrics in results.items():
        for s, rep in metrics["final"].items():
            topt = rep.get("Topt") or {}
            shift = (rep.get("shift") or {}).get("summary", {})
            ood = rep.get("ood") or {}
            rows.append({"method": method, "num_samples": int(s), "error": rep["T1"]["error"],
                         "ece": rep["T1"]["ece"], "nll": rep["T1"]["nll"],
                         "ece_Topt": topt.get("ece"), "nll_Topt": topt.get("nll"),
                         "temperature": rep.get("temperature"),
                         **{f"shift_{k}": shift.get(k) for k in ("error", "ece", "nll", "ece_Topt", "nll_Topt")},
                         "ood_auroc_entropy": (ood.get("entropy") or {}).get("auroc"),
                         "ood_auroc_mi": (ood.get("mutual_information") or {}).get("auroc")})
    return rows


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
                sample_counts: list[int], tune_options: bool = True) -> tuple[Path, list[dict]]:
    """Every method on the same data and split; writes comparison.md/.csv and the comparison figures.

    Figures (in the comparison folder, all at the last S of ``sample_counts``):
    ``reliability.png`` (one panel per method, with bin counts), ``shift.png``
    (error/NLL/ECE against shift intensity, with MAP + temperature scaling),
    ``risk_coverage.png`` and ``gamma.png``.

    Each method's options are resolved as for ``fit`` with ``--method`` set
    (so ``per_method`` entries apply), and each method gets its own run folder.

    With ``tune_options`` (the default; ``--no-tune`` turns it off) every method
    first selects its key option (:data:`bayeswrap.tuning.TUNING`) by the
    validation NLL of the posterior predictive at the last S of
    ``sample_counts``, each grid point trained on the same budget; the final run
    uses the chosen value, and each ``metrics.json`` records the grid, the
    validation NLLs and the choice under ``"tuning"``.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"--methods {unknown or methods} not known; accepted: {', '.join(METHODS)}")
    configs = {m: resolve(config_path, {**overrides, "method": m}) for m in methods}  # validate all first
    cfg = configs[methods[0]]
    base = Path(cfg.out_dir) / (cfg.run_name or f"compare-{cfg.dataset}-{cfg.model.replace(':', '_')}")
    if base.exists() and not (cfg.overwrite or cfg.resume):
        raise ValueError(f"comparison folder {base} exists; pass --resume or --overwrite")
    if base.exists() and cfg.overwrite:
        shutil.rmtree(base)
    results = {}
    for method in methods:
        run_cfg = replace(configs[method], out_dir=str(base), run_name=method, overwrite=False,
                          resume=cfg.resume and (base / method / "last.pt").is_file())
        tuning = None
        knob = tuning_option(method) if tune_options else None
        if knob is not None and knob[0] == "prior_precision":
            tuning = {"option": knob[0], "grid": list(knob[1])}  # post hoc, inside run_fit
        elif knob is not None:
            option, grid = knob
            log.warning("compare: tuning %s's %s over %s by validation NLL", method, option, list(grid))
            tuning = {"option": option, **tune(grid, lambda v: tuning_score(
                replace(run_cfg, **{option: v}).validate(), sample_counts[-1]))}
            run_cfg = replace(run_cfg, **{option: tuning["chosen"]})
        _, results[method] = run_fit(run_cfg.validate(), sample_counts, tuning)
    rows = comparison_rows(results)
    write_text(base / "comparison.md", _markdown(rows))
    write_text(base / "comparison.csv", _csv(rows))
    last = {m: r["final"][str(sample_counts[-1])] for m, r in results.items()}
    plots.reliability_grid({m: r["bins"] for m, r in last.items()}, base / "reliability.png",
                           num_samples=sample_counts[-1], title="Reliability on the test set, T = 1")
    _write_uncertainty_plots(base, last, temperature_scaled="map")
    return base, rows


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
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{f.metadata['help']} (default: {f.default!r})"
        if isinstance(f.default, bool):
            parser.add_argument(flag, nargs="?", const="true", default=argparse.SUPPRESS, dest=name,
                                metavar="BOOL", help=help_text)
        else:
            parser.add_argument(flag, default=argparse.SUPPRESS, dest=name, metavar=type(f.default).__name__.upper(),
                                help=help_text)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bayeswrap", description="Bayesian fine-tuning of any PyTorch model.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_fit = sub.add_parser("fit", help="train one method and write a run folder",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_config_options(p_fit)
    p_cmp = sub.add_parser("compare", help="run several methods on the same data and split; write a table")
    _add_config_options(p_cmp, skip=("method", "num_samples"))
    p_cmp.add_argument("--methods", default=",".join(COMPARE_METHODS),
                       help=f"comma-separated methods (default: {','.join(COMPARE_METHODS)}; also: "
                            f"{','.join(m for m in METHODS if m not in COMPARE_METHODS)})")
    p_cmp.add_argument("--num-samples", default="0,5", dest="num_samples_list",
                       help="comma-separated posterior sample counts S (default: 0,5)")
    p_cmp.add_argument("--no-tune", action="store_false", dest="tune",
                       help="skip the tuning of each method's key option by validation NLL "
                            "(bayeswrap.tuning.TUNING); use the configured values")
    p_ev = sub.add_parser("evaluate", help="re-evaluate a saved run (calibration, shift, OOD) with another number "
                                           "of samples")
    p_ev.add_argument("run_dir", help="a run folder written by fit/compare")
    p_ev.add_argument("--num-samples", type=int, default=None, help="S (default: the run's num_samples)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``bayeswrap`` console script; returns the exit status."""
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        if args.command == "evaluate":
            report = evaluate_run(args.run_dir, args.num_samples)
            print(f"S={report['num_samples']}: " + ", ".join(f"{k}={report['T1'][k]:.4f}"
                                                               for k in ("error", "ece", "mce", "nll")))
            if report["shift"]["summary"]:
                print("under shift (mean over intensities): " + ", ".join(
                    f"{k}={v:.4f}" for k, v in report["shift"]["summary"].items()))
            if report["ood"]:
                print(f"held-out classes {report['ood']['classes']}: AUROC entropy="
                      f"{report['ood']['entropy']['auroc']:.4f}" + (
                          f", mutual information={report['ood']['mutual_information']['auroc']:.4f}"
                          if report["ood"]["mutual_information"] else ""))
            return 0
        overrides = {k: v for k, v in vars(args).items()
                     if k in FIELDS and k not in ("command", "config", "tune")}
        if args.command == "fit":
            cfg = resolve(args.config, overrides)
            run_dir, metrics = run_fit(cfg)
            rep = metrics["final"][str(cfg.num_samples)]
            print(f"{run_dir}: test error={rep['T1']['error']:.4f} ECE={rep['T1']['ece']:.4f} "
                  f"NLL={rep['T1']['nll']:.4f}")
            return 0
        base, rows = run_compare(args.config, overrides, [m.strip() for m in args.methods.split(",") if m.strip()],
                                 _int_list(args.num_samples_list), tune_options=args.tune)
        print(_markdown(rows))
        print(f"written: {base / 'comparison.md'}, {base / 'comparison.csv'} and figures in {base}")
        return 0
    except (ValueError, FileNotFoundError, DataError, RuntimeError, FloatingPointError) as err:
        print(f"bayeswrap: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, (ValueError, FileNotFoundError, DataError)) else 1


if __name__ == "__main__":
    sys.exit(main())
