"""What a run reports: the final evaluation of a posterior, its figures, the comparison table and the prediction CSV.

:func:`final_reports` scores a fitted posterior with :mod:`bayeswrap.evaluation.protocol` (in distribution, under
shift, against held-out classes); :func:`write_plots` draws a run's figures; :func:`comparison_rows`,
:func:`markdown_table` and :func:`csv_table` make ``compare``'s table; :func:`predict_rows` makes ``predict``'s CSV.
Nothing here trains a model or opens a run folder (:mod:`bayeswrap.app.runner` does).
"""

from __future__ import annotations

import csv
import io as _stdio
import logging
from pathlib import Path

import torch

from bayeswrap.app.build import eval_loader
from bayeswrap.app.config import RunConfig
from bayeswrap.data.shift import CORRUPTION, shifted_dataset
from bayeswrap.evaluation import calibration, conformal, plots, protocol
from bayeswrap.evaluation.uncertainty import expected_entropy, mutual_information, predictive_entropy
from bayeswrap.methods.predictives import MedianModel, Mixture, PosteriorMean
from bayeswrap.predictive import predictive_loader

log = logging.getLogger("bayeswrap")


def final_reports(bnn, splits, ood_test, cfg: RunConfig, num_samples: int, device) -> tuple[dict, dict]:
    """The evaluation protocol of the model's posterior predictive with S samples.

    In distribution on test (temperature fitted on val), under every shift of
    ``cfg`` (rotation, noise; each shifted test set scored at T = 1 and at the
    in-distribution T) and against the held-out classes. Every point metric (error, NLL, ECE, temperature,
    conformal sets, shift and corruption scores, the entropy and confidence OOD scores) is of the predictive
    :meth:`~bayeswrap.BayesianModel.predict` computes with the model's default predictive (Laplace: its
    ``link_approx``, the closed-form probit link by default); the per-sample probabilities are used only by
    the sample-based measures (mutual information, variation ratio, predictive std), see
    :func:`bayeswrap.predictive.predictive_loader`. Sampling uses generators seeded by ``cfg.seed`` (a fresh
    one per shifted set), so ``evaluate`` recomputes exactly the same numbers from the saved checkpoint.

    Returns:
        ``(report, arrays)``: the report of
        :func:`bayeswrap.evaluation.protocol.prediction_report` with ``num_samples``, ``predictive`` (the
        ``repr`` of the model's default predictive, e.g. ``"GLM(link='probit')"`` or ``"Sampled()"``; at
        S = 0 every predictive evaluates the posterior mean), ``conformal``,
        ``shift`` and ``ood`` added (and ``corruption``, the
        :func:`~bayeswrap.evaluation.protocol.corruption_report`, when ``cfg.shift_corruptions`` is set), and the
        predictive probabilities (float64) and labels used.
    """
    bnn.eval()
    averaged = bnn.default_predictive().is_sample_average(bnn, num_samples)

    def predict(dataset, seed_offset: int = 0, samples: bool = False):
        gen = torch.Generator(device=device).manual_seed(cfg.seed + seed_offset)
        return predictive_loader(bnn, eval_loader(dataset, cfg), num_samples, generator=gen, samples=samples)

    def shifted(kind: str, level) -> tuple[torch.Tensor, torch.Tensor]:  # the predictive and labels under a shift
        probs, _, labels = predict(shifted_dataset(splits.test, kind, level, image_shape=splits.image_shape,
                                                   seed=cfg.seed))
        return probs, labels

    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    test = predictive_loader(bnn, eval_loader(splits.test, cfg), num_samples, generator=gen)
    val = predictive_loader(bnn, eval_loader(splits.val, cfg), num_samples, generator=gen, samples=False) \
        if len(splits.val) else None
    # a predictive that is the samples' mean is scored from the samples as before (the entropy of their
    # renormalised mean); any other by its own probabilities
    report = protocol.prediction_report(test[1], test[2], probs=None if averaged else test[0],
                                        val=None if val is None else (val[0], val[2]), n_bins=cfg.n_bins)
    report["num_samples"] = num_samples
    report["predictive"] = predictive_name(bnn, num_samples)
    # split conformal sets of the predictive at T = 1 (a temperature fitted on val would reuse the calibration data)
    report["conformal"] = None if val is None else conformal.conformal_report(
        val[0], val[2], test[0], test[2], cfg.conformal_alpha, score=cfg.conformal_score)
    grids = {"rotation": cfg.rotation_angles(), "noise": cfg.noise_stds()}
    report["shift"] = protocol.shift_report(shifted, grids, temperature=report.get("temperature", 1.0),
                                            n_bins=cfg.n_bins)
    if cfg.corruptions():  # severity 0 is the clean test set, scored above with the same generator seed
        report["corruption"] = protocol.corruption_report(
            lambda name, severity: (test[0], test[2]) if severity == 0 else shifted(CORRUPTION + name, severity),
            cfg.corruptions(), cfg.severities(), temperature=report.get("temperature", 1.0), n_bins=cfg.n_bins)
    report["ood"] = None
    if ood_test is not None:
        ood = predict(ood_test, 1, samples=True)
        report["ood"] = {"classes": list(cfg.held_out_classes(splits.name)),
                         **protocol.ood_report(test[1], ood[1], probs_in=None if averaged else test[0],
                                               probs_out=None if averaged else ood[0],
                                               temperature=report.get("temperature"))}
    arrays = {"test": (test[0], test[2]), "val": None if val is None else (val[0], val[2])}
    return report, arrays



def predictive_name(bnn, num_samples: int) -> str:
    """The predictive a report at S = ``num_samples`` used, e.g. ``"GLM(link='probit')"``; at S = 0 the posterior
    mean (``"PosteriorMean()"``) except where the predictive has its own S = 0 (an ensemble's mixture of its
    members' means, the median probability model).
    """
    predictive = bnn.default_predictive()
    if num_samples == 0 and not isinstance(predictive, (Mixture, MedianModel)):
        return repr(PosteriorMean())
    return repr(predictive)


def write_plots(run_dir: Path, report: dict, arrays: dict, history: list[dict], cfg: RunConfig) -> None:
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
    write_uncertainty_plots(run_dir, {cfg.method: report}, temperature_scaled=cfg.method)



def write_uncertainty_plots(folder: Path, reports: dict[str, dict], *, temperature_scaled: str | None) -> None:
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


def operating_point_reports(bnn, splits, ood_test, cfg: RunConfig, sample_counts, device) -> dict:
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


def history_csv(history: list[dict]) -> str:
    """The per-epoch history as CSV (one row per epoch, the union of keys as columns, in first-seen order)."""
    columns = list(dict.fromkeys(k for record in history for k in record))
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns)
    writer.writeheader()
    writer.writerows(history)
    return buf.getvalue()


COMPARE_COLUMNS = ("method", "tuned", "cost", "num_samples", "predictive", "error", "ece", "nll", "ece_Topt", "nll_Topt",
                   "temperature", "shift_error", "shift_ece", "shift_nll", "shift_ece_Topt", "shift_nll_Topt",
                   "ood_auroc_entropy", "ood_auroc_mi", "coverage", "set_size")
"""Columns of comparison.md/.csv: the options chosen by tuning (``prior_std=0.3, kl_weight=0.01``; empty
with ``--no-tune``); the final run's training time as a multiple of MAP's in the same comparison (empty
without MAP; tuning runs not counted); S; the predictive the row was scored with (the method's default, e.g.
``GLM(link='probit')`` for Laplace, ``Sampled()``; empty for a run from before it was recorded); in distribution at T = 1 and at the fitted T; the mean over every
non-zero shift intensity (rotation and noise) at T = 1 and at the in-distribution T; OOD AUROC of
held-out classes scored by predictive entropy and by mutual information (empty for S < 2); the test coverage and
mean size of the split conformal sets (``conformal_alpha``, ``conformal_score``; empty without validation data)."""


def operating_points(method: str, metrics: dict) -> dict[str, dict]:
    """A run's rows: ``{label: metrics}``, the run itself and each further operating point of its posterior.

    The run's label is ``method``, or ``"method (val)"`` when compare tuned its post hoc knob by validation NLL;
    a further point (``metrics["operating_points"]``, e.g. ``"marglik"``, the evidence's prior precision) is
    ``"method (name)"``, with that point's final reports and its options in place of the post hoc knob's tuned value.
    """
    own = metrics.get("operating_point")
    rows = {f"{method} ({own})" if own else method: metrics}
    for name, point in (metrics.get("operating_points") or {}).items():
        tuning = dict(metrics.get("tuning") or {})
        tuning["options"] = {**{k: v for k, v in tuned_options(metrics).items() if k not in point["options"]},
                             **point["options"]}
        rows[f"{method} ({name})"] = {**metrics, "final": point["final"], "tuning": tuning}
    return rows


def comparison_rows(results: dict[str, dict], baseline: str) -> list[dict]:
    """One row per (method or operating point, S) from each run's final reports (BayesDLL Table 2 layout, plus
    shift and OOD); see :func:`operating_points` for the labels.

    ``cost`` is a run's training time as a multiple of the ``baseline`` method's (None without that method).
    """
    rows = []
    seconds = {m: sum(h.get("seconds", 0.0) for h in r.get("history", [])) for m, r in results.items()}
    labelled = {label: (method, metrics) for method, run in results.items()
                for label, metrics in operating_points(method, run).items()}
    for label, (method, metrics) in labelled.items():
        cost = seconds[method] / seconds[baseline] if seconds.get(baseline) else None
        for s, rep in metrics["final"].items():
            topt = rep.get("Topt") or {}
            shift = (rep.get("shift") or {}).get("summary", {})
            ood = rep.get("ood") or {}
            rows.append({"method": label, "tuned": tuned_text(metrics), "cost": cost, "num_samples": int(s),
                         "predictive": rep.get("predictive"),
                         "error": rep["T1"]["error"], "ece": rep["T1"]["ece"], "nll": rep["T1"]["nll"],
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


def markdown_table(rows: list[dict]) -> str:
    def fmt(v):
        return "" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))

    lines = ["| " + " | ".join(COMPARE_COLUMNS) + " |", "|" + "---|" * len(COMPARE_COLUMNS)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in COMPARE_COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def csv_table(rows: list[dict]) -> str:
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COMPARE_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def predict_rows(probs: torch.Tensor, names: list[str], class_names: list[str],
                 sample_probs: torch.Tensor | None = None) -> list[dict]:
    """One CSV row per input, from the posterior predictive and the per-sample probabilities.

    Args:
        probs: (S, N, K) per-sample probabilities (the predictive is their mean), or the (N, K) predictive
            itself (e.g. Laplace's probit GLM, :meth:`bayeswrap.app.runs.LoadedRun.predictive`).
        names: the N input names.
        class_names: the K class names.
        sample_probs: with an (N, K) ``probs``, the (S, N, K) per-sample probabilities behind the sample-based
            columns (None: those columns are empty).

    Columns: ``input``, ``predicted_class`` (index), ``predicted_label``,
    ``confidence`` (the predictive probability of that class), ``prob_<class>``
    for each class, ``entropy`` (of the posterior predictive, nats),
    ``expected_entropy`` and ``mutual_information`` (nats, from the samples; empty for S < 2).
    """
    if probs.ndim == 3:
        probs, sample_probs = probs.mean(0), probs
    mean = probs
    entropy = predictive_entropy(probs[None]).tolist()
    sampled = sample_probs is not None and sample_probs.shape[0] >= 2
    epistemic = mutual_information(sample_probs).tolist() if sampled else [None] * len(names)
    aleatoric = expected_entropy(sample_probs).tolist() if sampled else [None] * len(names)
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
