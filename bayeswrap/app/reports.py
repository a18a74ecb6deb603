"""What a run reports: the final evaluation of a posterior, its figures, the comparison table and the prediction CSV.

:func:`final_reports` scores a fitted posterior with :mod:`bayeswrap.evaluation.protocol` (in distribution, under
shift, against held-out classes); :func:`write_plots` draws a run's figures; :func:`comparison_rows`,
:func:`markdown_table` and :func:`csv_table` make ``compare``'s tables (the compact one a person reads, and every
column), :func:`report_notes` the warnings they carry; :func:`predict_rows` makes ``predict``'s CSV.
Nothing here trains a model or opens a run folder (:mod:`bayeswrap.app.runner` does).
"""

from __future__ import annotations

import csv
import io as _stdio
import logging
import math
import re
import textwrap
from pathlib import Path

import torch

from bayeswrap.app.build import eval_loader
from bayeswrap.app.config import RunConfig
from bayeswrap.app.markdown import markdown_text
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
                   "ood_auroc_entropy", "ood_auroc_mi", "coverage", "set_size", "note")
"""Columns of comparison.csv and comparison_full.md: the options chosen by tuning (``prior_std=0.3, kl_weight=0.01``; empty
with ``--no-tune``); the final run's training time (its epochs', those before a resume included) as a multiple of
MAP's in the same comparison (empty without MAP; tuning runs not counted); S; the predictive the row was scored with (the method's default, e.g.
``GLM(link='probit')`` for Laplace, ``Sampled()``; empty for a run from before it was recorded); in distribution at T = 1 and at the fitted T; the mean over every
non-zero shift intensity (rotation and noise) at T = 1 and at the in-distribution T; OOD AUROC of
held-out classes scored by predictive entropy and by mutual information (empty for S < 2); the test coverage and
mean size of the split conformal sets (``conformal_alpha``, ``conformal_score``; empty without validation data);
the row's warnings (:func:`report_notes`, joined by ``"; "``; empty without one)."""

#: the compact table (comparison.md and the terminal): ``(header, row key)``; a row per method and operating point,
#: with rows at another S only where their numbers differ (:func:`markdown_table`)
SUMMARY_COLUMNS = (("method", "method"), ("S", "num_samples"), ("predictive", "predictive"), ("error", "error"),
                   ("NLL", "nll"), ("ECE", "ece"), ("shift err", "shift_error"), ("shift NLL", "shift_nll"),
                   ("OOD AUROC", "ood_auroc_entropy"), ("cost", "cost"), ("note", "note"))

#: a table's text width: its legend and footnotes are wrapped to it
TABLE_WIDTH = 120

#: the chance-level rule's test: an error within CHANCE_Z standard errors of random guessing's, 1 − 1/K
CHANCE_Z = 2.0
#: the chance-level rule for the NLL: a predictive whose NLL is at least (1 − CHANCE_NLL_FRACTION) · log K, i.e.
#: within this fraction of the uniform predictive's log K, has learned next to nothing
CHANCE_NLL_FRACTION = 0.05


def temperature_bounds() -> tuple[float, float]:
    """The range ``(T_min, T_max)`` a fitted temperature is searched in: the default ``bounds`` of
    :func:`bayeswrap.evaluation.calibration.fit_temperature`, which the reports use.
    """
    low, high = calibration.TEMPERATURE_BOUNDS
    return float(low), float(high)


def report_notes(report: dict) -> list[str]:
    """The warnings a final report (one row of the table) deserves, each ``"<label>: <why, with the numbers>"``.

    * ``chance level``: the predictive is no better than guessing. Its test error is at least
      1 − 1/K − z·SE, the expected error of guessing uniformly among K classes less z = :data:`CHANCE_Z`
      standard errors SE = sqrt((1/K)(1 − 1/K)/n) of a guesser's error on the n test examples (a one-sided test
      at about 2 %: an error below that is unlikely from guessing); or its NLL is at least
      (1 − :data:`CHANCE_NLL_FRACTION`) · log K, within 5 % of the NLL of the uniform predictive (log K nats,
      whatever the labels).
    * ``T at bound``: the temperature fitted on validation sits at a bound of its search range
      (:func:`temperature_bounds`, (0.01, 100)): at the upper one the fit flattens the predictive as far as it may
      (the scores carry almost no information; the T-scaled columns are of a nearly uniform predictive), at the
      lower one it sharpens it as far as it may.

    Args:
        report: a final report (:func:`final_reports`): ``T1`` (``error``, ``nll``), ``n_classes``,
            ``n_examples`` and, with validation data, ``temperature``.

    Returns:
        The notes, in that order; empty for a report that needs none. No note holds a ``";"``.
    """
    notes = []
    k, n = report.get("n_classes"), report.get("n_examples")
    t1 = report.get("T1") or {}
    if k and k > 1 and n and "error" in t1 and "nll" in t1:
        guess = 1.0 - 1.0 / k
        limit = guess - CHANCE_Z * math.sqrt(guess * (1.0 - guess) / n)
        uniform = math.log(k)
        reasons = []
        if t1["error"] >= limit:
            reasons.append(f"test error {t1['error']:.3f} >= {limit:.3f} (guessing among K = {k} classes errs "
                           f"1-1/K = {guess:.3f}, less {CHANCE_Z:g} standard errors at n = {n})")
        if t1["nll"] >= (1.0 - CHANCE_NLL_FRACTION) * uniform:
            reasons.append(f"NLL {t1['nll']:.3f} >= {1.0 - CHANCE_NLL_FRACTION:g} log K = "
                           f"{(1.0 - CHANCE_NLL_FRACTION) * uniform:.3f} (the uniform predictive's NLL is "
                           f"log K = {uniform:.3f})")
        if reasons:
            notes.append("chance level: " + " and ".join(reasons) + ", no better than guessing")
    temperature = report.get("temperature")
    if temperature is not None:
        low, high = temperature_bounds()
        if temperature >= high * (1 - 1e-9):
            notes.append(f"T at bound: the temperature fitted on validation is {temperature:g}, the upper end of its "
                         f"range [{low:g}, {high:g}], which flattens the predictive towards uniform: its "
                         "confidence carries almost no information")
        elif temperature <= low * (1 + 1e-9):
            notes.append(f"T at bound: the temperature fitted on validation is {temperature:g}, the lower end of its "
                         f"range [{low:g}, {high:g}]: the fit sharpens the predictive as far as it may")
    return notes


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

    ``cost`` is a run's training time as a multiple of the ``baseline`` method's (None without that method): the
    sum of its epochs' ``seconds``, which ``last.pt`` keeps, so a resumed run counts its epochs before the resume.
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
                         "set_size": (rep.get("conformal") or {}).get("mean_set_size"),
                         "note": "; ".join(report_notes(rep))})
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


def markdown_table(rows: list[dict], *, full: bool = False, baseline: str = "map") -> str:
    """``compare``'s table as Markdown: compact (comparison.md, the terminal) or with every column
    (``full``: comparison_full.md, :data:`COMPARE_COLUMNS`, one line per row).

    The compact table (:data:`SUMMARY_COLUMNS`, aligned, about :data:`TABLE_WIDTH` characters wide) has one row per
    method and operating point and S; a row whose cells are those of another row of the same method at a higher S
    (MAP's S = 0 and S = 5: the same network) is left out, and the row kept lists both S (``0, 5``). The
    predictive is named without its brackets (``GLM probit`` for ``GLM(link='probit')``), the scores with 3 decimals,
    the cost (2 decimals) as a multiple of ``baseline``'s. Under it: a legend, the tuned options of each row, and the
    rows' notes (:func:`report_notes`) as numbered footnotes, one per distinct note naming the rows it is about, their
    numbers in the ``note`` column.
    Both tables take the rows of :func:`comparison_rows`. Every cell, and every name under the table, is
    escaped (:func:`bayeswrap.app.markdown.markdown_text`): a name holding ``|``, a backtick, ``*``, ``<`` or a line
    break reads as those characters and stays in its cell.
    """
    if full:
        lines = ["| " + " | ".join(COMPARE_COLUMNS) + " |", "|" + "---|" * len(COMPARE_COLUMNS)]
        lines += ["| " + " | ".join(markdown_text(_cell(r.get(c))) for c in COMPARE_COLUMNS) + " |" for r in rows]
        return "\n".join(lines) + "\n"
    footnotes: dict[str, list[str]] = {}  # note -> the rows it is about; numbered in order of appearance
    shown = []
    for row in compact_rows(rows):
        cells = {key: markdown_text(_cell(row.get(key), digits=2 if key == "cost" else 3))
                 for _, key in SUMMARY_COLUMNS}
        cells["num_samples"] = ", ".join(str(s) for s in row["num_samples"])
        cells["predictive"] = markdown_text(short_predictive(row.get("predictive")))
        numbers = []
        for note in filter(None, (row.get("note") or "").split("; ")):
            footnotes.setdefault(note, []).append(f"{cells['method']} (S = {cells['num_samples']})")
            numbers.append(list(footnotes).index(note) + 1)
        cells["note"] = f"[{', '.join(map(str, numbers))}]" if numbers else ""
        shown.append([cells[key] for _, key in SUMMARY_COLUMNS])
    headers = [h for h, _ in SUMMARY_COLUMNS]
    widths = [max([len(h)] + [len(r[i]) for r in shown]) for i, h in enumerate(headers)]
    numeric = [key not in ("method", "num_samples", "predictive", "note") for _, key in SUMMARY_COLUMNS]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)) + " |"

    lines = [line(headers), "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2))
                                           for w, num in zip(widths, numeric)) + "|"]
    lines += [line(r) for r in shown]
    legend = ("S: posterior samples (a row lists each S whose numbers are the same); error, NLL, ECE: test set at "
              "T = 1; shift: mean over the shifted test sets; OOD AUROC: held-out classes by predictive entropy; "
              f"cost: training time as a multiple of {baseline}'s. Every column and row: comparison.csv.")
    tuned = "; ".join(dict.fromkeys(f"{markdown_text(r['method'])} {markdown_text(r['tuned'])}"
                                    for r in rows if r.get("tuned")))
    text = [""] + textwrap.wrap(legend, TABLE_WIDTH)
    if tuned:
        text += textwrap.wrap(f"Tuned by validation NLL: {tuned}.", TABLE_WIDTH)
    if footnotes:
        text += [""] + [wrapped for number, (note, about) in enumerate(footnotes.items(), 1)
                        for wrapped in textwrap.wrap(f"[{number}] {', '.join(about)}: {note}.", TABLE_WIDTH,
                                                     subsequent_indent="    ")]
    return "\n".join(lines + text) + "\n"


def compact_rows(rows: list[dict]) -> list[dict]:
    """The rows of the compact table: per method label, a row at S only where its compact cells differ from those
    of every row at a higher S; a kept row's ``num_samples`` is the list of the S it stands for, ascending.

    The cells compared are those shown (:data:`SUMMARY_COLUMNS` but S and the predictive, at the shown precision,
    notes included): two rows the table would print alike are one row.
    """
    keys = [key for _, key in SUMMARY_COLUMNS if key not in ("method", "num_samples", "predictive")]
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["method"], []).append(row)
    out = []
    for group in groups.values():
        kept: list[tuple[tuple, dict]] = []
        for row in sorted(group, key=lambda r: -r["num_samples"]):  # the highest S first: it is the row kept
            shown = tuple(_cell(row.get(k), digits=2 if k == "cost" else 3) for k in keys)
            same = next((r for cells, r in kept if cells == shown), None)
            if same is None:
                kept.append((shown, {**row, "num_samples": [row["num_samples"]]}))
            else:
                same["num_samples"].insert(0, row["num_samples"])
        out += sorted((r for _, r in kept), key=lambda r: r["num_samples"][0])
    return out


def short_predictive(name: str | None) -> str:
    """A predictive's ``repr`` without its brackets: ``"GLM(link='probit')"`` → ``"GLM probit"``,
    ``"Sampled()"`` → ``"Sampled"``; empty for None.
    """
    if not name:
        return ""
    match = re.fullmatch(r"(\w+)\((.*)\)", name)
    if not match:
        return name
    values = [part.split("=", 1)[-1].strip().strip("'\"") for part in match.group(2).split(",") if part.strip()]
    return " ".join([match.group(1), *values])


def row_warnings(rows: list[dict]) -> list[str]:
    """The rows' notes as terminal lines, one per distinct note with the rows it is about:
    ``"map (S = 0, 5), vi (S = 5): chance level: ..."``.
    """
    seen: dict[str, dict[str, list[int]]] = {}
    for row in rows:
        for note in filter(None, (row.get("note") or "").split("; ")):
            seen.setdefault(note, {}).setdefault(row["method"], []).append(row["num_samples"])
    return [", ".join(f"{method} (S = {', '.join(map(str, s))})" for method, s in about.items()) + f": {note}"
            for note, about in seen.items()]


def _cell(value, digits: int = 4) -> str:
    """A table cell: empty for None, a float with ``digits`` decimals, anything else as text."""
    return "" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))


def csv_table(rows: list[dict]) -> str:
    """``compare``'s table as CSV: every row and every column of :data:`COMPARE_COLUMNS`."""
    buf = _stdio.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COMPARE_COLUMNS, extrasaction="ignore")
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
