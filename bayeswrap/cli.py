"""The ``bayeswrap`` command line: ``fit``, ``compare`` and ``evaluate``.

A thin layer over the library: resolve the config (YAML + ``--key value``
overrides), load data and backbone, ``wrap`` it, ``fit`` it, score the posterior
predictive with :mod:`bayeswrap.calibration`, and write the run folder::

    out_dir/<run-name>/
        config.yaml        the fully resolved config
        metrics.json       per-epoch history and the final calibration reports
        best.pt            best-validation checkpoint (torch.load(..., weights_only=True))
        last.pt            last epoch's checkpoint (for --resume)
        reliability_T1.png, reliability_Topt.png, temperature_curve.png, training_curves.png
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

from . import calibration, plots
from .config import FIELDS, RunConfig, coerce, load_yaml, resolve
from .data import DataError, load_data
from .functional import select_parameters
from .io import load_checkpoint, save_checkpoint, write_json, write_text, write_yaml
from .methods import METHODS, method_options, wrap
from .models import create_model, data_config, head_parameter_names
from .optim import SGLD
from .predictive import evaluate as evaluate_loader
from .predictive import predict_loader
from .training import fit

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

    Returns:
        ``(splits, bnn, head_names, device)``.
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
    elif cfg.dataset == "digits" and not cfg.model.startswith("tv:"):
        extra["in_chans"] = 1
    model = create_model(cfg.model, splits.num_classes, pretrained=pretrained, init_checkpoint=init_checkpoint,
                         **extra)
    if cfg.pretrained and not is_mlp:
        splits = load_data(cfg.dataset, root=cfg.data_root, download=cfg.download, val_fraction=cfg.val_fraction,
                           seed=cfg.seed, data_config=data_config(model))
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
    if cfg.method == "sgld":
        steps = (len(splits.train) + cfg.batch_size - 1) // cfg.batch_size
        options["burn_in"] = round(cfg.burn_in_epochs * steps)
        if options["burn_in"] > cfg.epochs * steps // 2:  # keep samples even in short runs
            options["burn_in"] = cfg.epochs * steps // 2
            log.warning("sgld: burn_in_epochs=%s leaves no samples in %d epochs; burn-in shortened to %d steps "
                        "(half of training)", cfg.burn_in_epochs, cfg.epochs, options["burn_in"])
    bnn = wrap(model, cfg.method, num_data=num_data, prior_std=cfg.prior_std, prior_mean=prior_mean,
               bias=cfg.bias, params=patterns, kl_weight=cfg.kl_weight, **options)
    device = _device(cfg.device)
    return splits, bnn.to(device), head, device


def _eval_loader(dataset, cfg: RunConfig):
    return DataLoader(dataset, batch_size=max(cfg.batch_size, 128), shuffle=False, num_workers=cfg.num_workers)


def final_reports(bnn, splits, cfg: RunConfig, num_samples: int, device) -> tuple[dict, dict]:
    """Calibration report of the posterior predictive with S samples on test (T fitted on val).

    Sampling uses a generator seeded by ``cfg.seed``, so ``evaluate`` recomputes
    exactly the same numbers from the saved checkpoint.

    Returns:
        ``(report, arrays)`` with arrays holding the probabilities and labels used.
    """
    bnn.eval()
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    probs_test, y_test = predict_loader(bnn, _eval_loader(splits.test, cfg), num_samples, generator=gen)
    val = None
    if len(splits.val):
        val = predict_loader(bnn, _eval_loader(splits.val, cfg), num_samples, generator=gen)
    report = calibration.report(probs_test.double(), y_test, val=None if val is None else
                                (val[0].double(), val[1]), n_bins=cfg.n_bins)
    report["num_samples"] = num_samples
    return report, {"test": (probs_test, y_test), "val": val}


def _write_plots(run_dir: Path, report: dict, arrays: dict, history: list[dict], cfg: RunConfig) -> None:
    probs, y = arrays["test"]
    plots.reliability_diagram(probs.double(), y, run_dir / "reliability_T1.png", n_bins=cfg.n_bins,
                              title=f"{cfg.method}, T = 1")
    temperature = report.get("temperature")
    if arrays["val"] is not None and temperature is not None:
        scaled = calibration.apply_temperature(probs.double().clamp_min(1e-300).log(), temperature)
        plots.reliability_diagram(scaled, y, run_dir / "reliability_Topt.png", n_bins=cfg.n_bins,
                                  title=f"{cfg.method}, T = {temperature:.3f}")
        fit_result = calibration.fit_temperature(arrays["val"][0].double().clamp_min(1e-300).log(), arrays["val"][1],
                                                 return_history=True)
        plots.temperature_curve(fit_result, run_dir / "temperature_curve.png")
    plots.training_curves(history, run_dir / "training_curves.png")


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


def run_fit(cfg: RunConfig, sample_counts: list[int] | None = None) -> tuple[Path, dict]:
    """Trains one configuration end to end and writes its run folder.

    Args:
        cfg: a validated config.
        sample_counts: the S values of the final reports (default ``[cfg.num_samples]``).

    Returns:
        ``(run_dir, metrics)``.
    """
    sample_counts = sample_counts or [cfg.num_samples]
    splits, bnn, head, device = build(cfg)  # all input is checked before anything is written
    run_dir = prepare_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = _setup_logging(run_dir)
    try:
        write_yaml(run_dir / "config.yaml", cfg.to_dict())
        return run_dir, _train_and_report(cfg, run_dir, splits, bnn, head, device, sample_counts)
    finally:
        log.removeHandler(handler)
        handler.close()


def _train_and_report(cfg, run_dir, splits, bnn, head, device, sample_counts):
    lr_head = cfg.lr_head or None
    if cfg.method == "sgld":
        optimizer = SGLD(bnn.param_groups(head, lr_head), lr=cfg.lr, num_data=bnn.num_data,
                         noise_scale=cfg.noise_scale)
    else:
        optimizer = torch.optim.SGD(bnn.param_groups(head, lr_head), lr=cfg.lr, momentum=cfg.momentum)
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
        val_nll = record.get("val_nll", -float(epoch))  # without validation data the last epoch is best
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
    save_checkpoint(run_dir / "best.pt", bnn.state_dict())
    reports = {}
    for s in sample_counts:
        report, arrays = final_reports(bnn, splits, cfg, s, device)
        reports[str(s)] = report
        if s == sample_counts[-1]:
            _write_plots(run_dir, report, arrays, state["history"], cfg)
    metrics = {"history": state["history"], "best_epoch": state["best_epoch"], "final": reports}
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
    splits, bnn, _, device = build(cfg, for_evaluation=True)
    try:
        bnn.load_state_dict(load_checkpoint(run_dir / "best.pt"))
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"checkpoint {run_dir / 'best.pt'} does not match the run's config: {err}") from None
    s = cfg.num_samples if num_samples is None else num_samples
    report, _ = final_reports(bnn, splits, cfg, s, device)
    write_json(run_dir / f"eval_S{s}.json", report)
    return report


BAYESDLL_METHODS = ("map", "vi", "mc_dropout", "sgld", "laplace")
COMPARE_COLUMNS = ("method", "num_samples", "error", "ece", "mce", "nll", "ece_Topt", "nll_Topt", "temperature")


def comparison_rows(results: dict[str, dict]) -> list[dict]:
    """One row per (method, S) from each run's final reports (BayesDLL Table 2 layout)."""
    rows = []
    for method, metrics in results.items():
        for s, rep in metrics["final"].items():
            topt = rep.get("Topt") or {}
            rows.append({"method": method, "num_samples": int(s), "error": rep["T1"]["error"],
                         "ece": rep["T1"]["ece"], "mce": rep["T1"]["mce"], "nll": rep["T1"]["nll"],
                         "ece_Topt": topt.get("ece"), "nll_Topt": topt.get("nll"),
                         "temperature": rep.get("temperature")})
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
                sample_counts: list[int]) -> tuple[Path, list[dict]]:
    """Every method on the same data and split; writes comparison.md/.csv and reliability.png.

    Each method's options are resolved as for ``fit`` with ``--method`` set
    (so ``per_method`` entries apply), and each method gets its own run folder.
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
    results, diagrams = {}, []
    for method in methods:
        run_cfg = replace(configs[method], out_dir=str(base), run_name=method, overwrite=False,
                          resume=cfg.resume and (base / method / "last.pt").is_file())
        run_dir, metrics = run_fit(run_cfg.validate(), sample_counts)
        results[method] = metrics
        diagrams.append((method, run_dir))
    rows = comparison_rows(results)
    write_text(base / "comparison.md", _markdown(rows))
    write_text(base / "comparison.csv", _csv(rows))
    plots.image_grid([(m, d / "reliability_T1.png") for m, d in diagrams], base / "reliability.png",
                     title=f"Reliability, S = {sample_counts[-1]}", columns=3)
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
    p_cmp.add_argument("--methods", default=",".join(BAYESDLL_METHODS),
                       help=f"comma-separated methods (default: {','.join(BAYESDLL_METHODS)}; also: "
                            f"{','.join(m for m in METHODS if m not in BAYESDLL_METHODS)})")
    p_cmp.add_argument("--num-samples", default="0,5", dest="num_samples_list",
                       help="comma-separated posterior sample counts S (default: 0,5)")
    p_ev = sub.add_parser("evaluate", help="re-evaluate a saved run with another number of samples")
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
            return 0
        overrides = {k: v for k, v in vars(args).items()
                     if k in FIELDS and k not in ("command", "config")}
        if args.command == "fit":
            cfg = resolve(args.config, overrides)
            run_dir, metrics = run_fit(cfg)
            rep = metrics["final"][str(cfg.num_samples)]
            print(f"{run_dir}: test error={rep['T1']['error']:.4f} ECE={rep['T1']['ece']:.4f} "
                  f"NLL={rep['T1']['nll']:.4f}")
            return 0
        base, rows = run_compare(args.config, overrides, [m.strip() for m in args.methods.split(",") if m.strip()],
                                 _int_list(args.num_samples_list))
        print(_markdown(rows))
        print(f"written: {base / 'comparison.md'}, {base / 'comparison.csv'}, {base / 'reliability.png'}")
        return 0
    except (ValueError, FileNotFoundError, DataError, RuntimeError, FloatingPointError) as err:
        print(f"bayeswrap: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, (ValueError, FileNotFoundError, DataError)) else 1


if __name__ == "__main__":
    sys.exit(main())
