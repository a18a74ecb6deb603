"""``bayeswrap compare``: every method on the same data and split, each tuned by validation NLL, and one table.

:func:`run_compare` resolves one config per method, tunes each method's knob and prior std
(:func:`~bayeswrap.evaluation.tuning.tune_with_prior`, every candidate trained by :func:`tuning_score`), runs each
method with :func:`bayeswrap.app.runner.run_fit` in its own run folder inside the comparison folder, and writes
``comparison.md`` (the compact table, with its notes), ``comparison_full.md``/``.csv`` (every column;
:mod:`bayeswrap.app.reports`) and the comparison figures. Which option a method tunes, and on which grid, is its
class's ``tuning``; what a method's run implies is its class's ``run_options``. While it works it shows method k of
n, the tuning candidate and an overall ETA, and sums up each method's warnings in one line per warning site
(:mod:`bayeswrap.app.progress`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from bayeswrap.app import runs
from bayeswrap.app.build import AMP_DTYPES, EpochLoader, build, eval_loader, make_optimizer, preflight
from bayeswrap.app.config import (
    RESUME_ALLOWED,
    RunConfig,
    check_compare_record,
    check_method_list,
    check_sample_counts,
    coerce,
    load_yaml,
    needs_validation_data,
    read_json_file,
    read_yaml_file,
    resolve_values,
)
from bayeswrap.app.markdown import check_metrics_names
from bayeswrap.app.options import option_users
from bayeswrap.app.outputs import naming_failures, write_json, write_text, write_yaml
from bayeswrap.app.progress import SILENT, CompareProgress, counted_warnings, warning_details, warning_summary
from bayeswrap.app.reports import (
    comparison_rows,
    csv_table,
    markdown_table,
    operating_points,
    row_warnings,
    tuned_options,
    write_uncertainty_plots,
)
from bayeswrap.app.runner import RunInterrupted, run_fit
from bayeswrap.evaluation import plots
from bayeswrap.evaluation.tuning import tune_with_prior
from bayeswrap.methods import METHODS, tuning_bounds, tuning_option
from bayeswrap.predictive import evaluate as evaluate_loader
from bayeswrap.training import fit

log = logging.getLogger("bayeswrap")


#: the comparison's reference method: its tuned prior std is every other compared method's start (stage 1 of
#: ``tune_with_prior``), the ``cost`` column is training time as a multiple of its own, and the shift figure's
#: temperature-scaled baseline is its predictive (Ovadia et al. 2019)
PRIOR_SOURCE = "map"
#: a knob set post hoc on the fitted posterior, without retraining (by the posterior's ``optimize_prior_precision``)
POST_HOC = "prior_precision"


def compare_methods() -> tuple[str, ...]:
    """The methods ``bayeswrap compare`` runs by default: those whose class sets ``in_default_comparison``."""
    return tuple(m for m, cls in METHODS.items() if cls.in_default_comparison)


def run_compare(config_path: str | None, overrides: dict, methods: list[str],
                sample_counts: list[int], tune_options: bool = True, *, resume: str | None = None,
                ) -> tuple[Path, list[dict]]:
    """Every method on the same data and split; writes the tables and the comparison figures.

    Tables: ``comparison.md``, the compact table (:func:`~bayeswrap.app.reports.markdown_table`: a row per method
    and operating point, S = 0 only where it differs, notes on chance-level predictives and temperatures at
    their bound, also written to stderr), ``comparison_full.md`` and ``comparison.csv`` (every row and column).

    Progress (stderr, :class:`~bayeswrap.app.progress.CompareProgress`): a line as each method starts (``vi 2/9``)
    and after its tuning; with ``progress`` on a terminal, one bar over every fit of the comparison (tuning
    candidates and final runs) naming the candidate being trained, with the comparison's ETA, and each final run's
    own bar; elsewhere a line per later tuning stage and final run, with the fit count and ETA. The warnings raised
    while a method is tuned and run are shown once it ends, one line per warning site with its count.

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
    A knob set post hoc (:data:`POST_HOC`, on the fitted posterior) is tuned on each candidate's
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
        runs.refuse_symlink(base, f"--resume {base}: the comparison folder")
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
    blind = [m for m in needs_validation_data(methods, tune_options, knob_of) if configs[m].val_fraction == 0]
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
        # the reference first (the others inherit its σ); ensembles after their members (they inherit the
        # member's options)
        members = {m: member_method(configs[m]) for m in methods}
        order = sorted(methods, key=lambda m: (m != PRIOR_SOURCE, members[m] is not None))
        finished = tuple(m for m in order if resume is not None and (base / m / "metrics.json").is_file())
        plan = {m: planned_fits(m, configs[m], tune_options, methods, resumed_tuning=resume is not None and (
            base / f"tuning_{m}.json").is_file()) for m in order}
        with CompareProgress(plan, done=finished, bar=None if cfg.progress else False) as progress:
            for method in order:
                member = members[method]
                with counted_warnings() as caught:
                    try:
                        results[method] = _compare_one(
                            base, method, configs[method], sample_counts, tune_options, resume is not None, changes,
                            command, prior_std=inherited, progress=progress,
                            member_tuning=results.get(member, {}).get("tuning") if member else None)
                    finally:  # also when interrupted: what the method warned so far
                        _report_warnings(progress, caught, base / method)
                progress.end_method()
                if method == PRIOR_SOURCE and tune_options:
                    inherited = tuned_options(results[method]).get("prior_std")
            results = {m: results[m] for m in methods}
            rows = comparison_rows(results, PRIOR_SOURCE)
            for line in row_warnings(rows):
                progress.write(f"compare: warning: {line}")
        write_text(base / "comparison.md", markdown_table(rows))
        write_text(base / "comparison_full.md", markdown_table(rows, full=True))
        write_text(base / "comparison.csv", csv_table(rows))
        # one panel and one curve per row of the table: each operating point of a posterior (laplace (val),
        # laplace (marglik)) is drawn on its own
        last = {label: point["final"][str(sample_counts[-1])] for m, r in results.items()
                for label, point in operating_points(m, r).items()}
        with naming_failures(base, "writing the figures"):
            plots.reliability_grid({m: r["bins"] for m, r in last.items()}, base / "reliability.png",
                                   num_samples=sample_counts[-1], title="Reliability on the test set, T = 1")
            write_uncertainty_plots(base, last, temperature_scaled=PRIOR_SOURCE)
        return base, rows
    except KeyboardInterrupt:
        raise RunInterrupted(base, command) from None
    finally:
        lock.release()


def _report_warnings(progress: CompareProgress, caught: list, folder: Path) -> None:
    """One terminal line per warning site of a method (its last message cut to 200 characters), and every
    message whole in the method's ``warnings.log``.
    """
    if not caught:
        return
    logged = folder.is_dir()
    if logged:
        write_text(folder / "warnings.log", warning_details(caught))
    for line in warning_summary(caught, max_chars=200):
        progress.say(f"warning: {line}" + (f" (every message: {folder.name}/warnings.log)" if logged else ""))


def planned_fits(method: str, cfg: RunConfig, tune_options: bool, methods, *, resumed_tuning: bool = False,
                 ) -> tuple[int, int]:
    """``(tuning fits, final fits)`` a comparison expects ``method`` to train, for its progress bar and ETA.

    A fit is one network trained (an ensemble's run counts its ``num_members``). Tuning: the knob's grid, then
    σ/3 and 3σ (σ's score is reused) for a knob other than the prior std; the prior std at σ/3, σ and 3σ for a
    post hoc knob; nothing for ``--no-tune``, a method without a knob, a tuning record read back on resume, or
    an ensemble that inherits its member method's tuning. A grid extension adds fits as tuning goes
    (:class:`~bayeswrap.app.progress.CompareProgress`).
    """
    member = member_method(cfg)
    weight = int(cfg.option("num_members")) if member is not None else 1
    knob = knob_of(method) if tune_options else None
    if knob is None or resumed_tuning or (member is not None and member in methods):
        return 0, weight
    if knob == POST_HOC:
        return 3 * weight, weight
    grid = len(tuning_option(method)[1])
    with_prior = knob != "prior_std" and (cfg.prior_std is not None or PRIOR_SOURCE in methods)
    return (grid + 2 * with_prior) * weight, weight


def member_method(cfg: RunConfig) -> str | None:
    """The method whose networks a run's members are: its ``member`` option, else its class's ``default_member``
    (a method of several members declares one); None for a method without members.
    """
    default = getattr(METHODS[cfg.method], "default_member", None)
    return None if default is None else cfg.option("member") or default


def _inherit_member_tuning(cfg: RunConfig, member: str, member_tuning: dict) -> tuple[RunConfig, dict]:
    """An ensemble run with its member method's tuned options: ``prior_std`` for every member, the knob through
    ``member_kwargs`` (a deep ensemble of M tuned networks, as practitioners build one); and its tuning record.

    A post hoc knob (a prior precision) is fitted per member and is not inherited.
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
                 member_tuning: dict | None = None, progress: CompareProgress | None = None) -> dict:
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
    ``{"options": {option: value}, "val_nll", "choice", "prior_std_from": PRIOR_SOURCE |
    "config", "stages": [{"stage", "option", "fixed", "grid", "val_nll",
    "chosen", "chosen_index", "extensions", "reused", "bound_hit", "bounds"}]}``;
    the post hoc knob of the final run is its last stage (``"post_hoc"``). ``options`` are the values the final
    run is trained with; for a knob that tempers the whole posterior (the class's ``knob_tempers_posterior``) the
    stages search (σ, knob), each stage lists what each point was ``"trained"`` with (prior_std σ·sqrt(knob)),
    and ``"reference_prior_std"`` is the chosen σ.

    ``progress`` (None: nothing shown) hears of the method's start, each tuning candidate, and the final run.
    """
    progress = progress or SILENT
    run_dir = base / method
    runs.refuse_symlink(run_dir, f"the method folder {run_dir} of the comparison", advice=(
        f"Replace the link by the folder itself (move {os.path.realpath(run_dir)} to {run_dir}), or remove the "
        f"link to run {method} again, then resume: {command}"))
    run_cfg = replace(cfg, out_dir=str(base), run_name=method, overwrite=False)
    if resume and (run_dir / "metrics.json").is_file():
        progress.start_method(method, f"finished; keeping {run_dir / 'metrics.json'}")
        return check_metrics_names(read_json_file(run_dir / "metrics.json", what="run metrics"),
                                   run_dir / "metrics.json")
    tuning_path = base / f"tuning_{method}.json"
    tuning = None
    knob = knob_of(method) if tune_options else None
    member = member_method(cfg)
    weight = int(cfg.option("num_members")) if member is not None else 1
    if tune_options and member is not None and member_tuning:  # an ensemble: its member method's tuned options
        run_cfg, tuning = _inherit_member_tuning(run_cfg, member, member_tuning)
        progress.start_method(method, f"{weight} {member} members with {member}'s tuned options "
                                      f"({', '.join(f'{k}={v:g}' for k, v in tuning['options'].items())})")
        return _final_run(run_cfg, sample_counts, tuning, resume and runs.is_run_folder(run_dir), changes, command,
                          progress, weight)
    if knob is not None and resume and tuning_path.is_file():
        tuning = read_tuning_file(tuning_path, method)
        progress.start_method(method, f"tuned options read back from {tuning_path}")
    elif knob is not None:
        tuning = _tune_one(run_cfg, method, knob, sample_counts[-1], prior_std, progress=progress, weight=weight)
        write_json(tuning_path, tuning)
    else:
        progress.start_method(method, "configured options" + (" (--no-tune)" if not tune_options else
                                                             " (no tuned option)"))
    if tuning is not None:
        run_cfg = run_cfg.with_options(**tuning["options"])
    post_hoc = functools.partial(tune_post_hoc, cfg=run_cfg, num_samples=sample_counts[-1]) \
        if knob_of(method) == POST_HOC else None
    return _final_run(run_cfg, sample_counts, tuning, resume and runs.is_run_folder(run_dir), changes, command,
                      progress, weight, post_hoc=post_hoc)


def _final_run(run_cfg: RunConfig, sample_counts, tuning, resume_run: bool, changes: dict, command: str,
               progress: CompareProgress, weight: int, post_hoc=None) -> dict:
    """A method's final run (:func:`run_fit`), counted as ``weight`` fits."""
    progress.final_run()
    metrics = run_fit(run_cfg.validate(), sample_counts, tuning, resume=resume_run, changes=changes or None,
                      resume_command=command, post_hoc=post_hoc)[1]
    progress.fit_done(weight)
    return metrics


def _tune_one(run_cfg: RunConfig, method: str, knob: str, num_samples: int, prior_std: float | None, *,
              progress: CompareProgress | None = None, weight: int = 1) -> dict:
    """The tuning record of one method (see :func:`_compare_one`): each candidate trained by :func:`tuning_score`.

    ``progress`` hears of the method's start and of each candidate (counted as ``weight`` fits).
    """
    progress = progress or SILENT
    source = "config" if prior_std is None or knob == "prior_std" else PRIOR_SOURCE
    start = run_cfg.prior_std if source == "config" else prior_std
    scored_knob = None if knob == POST_HOC else knob  # a post hoc knob is tuned inside each candidate's score
    grid = tuning_option(method)[1] if scored_knob else ()
    tempered = bool(scored_knob not in (None, "prior_std") and start is not None
                    and METHODS[method].knob_tempers_posterior)  # candidates at prior_std = σ·sqrt(knob)
    values = ", ".join(f"{v:g}" for v in grid)
    if knob == "prior_std":
        progress.start_method(method, f"tuning prior_std by validation NLL over {values}")
    elif scored_knob is None:
        progress.start_method(method, f"tuning prior_std by validation NLL around {source}'s {start:g} (and "
                                      f"{knob} post hoc on each candidate)")
    else:
        progress.start_method(method, f"tuning {scored_knob} by validation NLL over {values}, then prior_std around "
                                      f"{source}'s {start:g}"
                                      + (f" (each candidate at prior_std = σ·sqrt({scored_knob}))" if tempered else ""))

    def score(options: dict) -> float:
        try:
            return tuning_score(run_cfg.with_options(**options).validate(), num_samples)
        finally:
            progress.fit_done(weight, tuning=True)

    record = tune_with_prior(score, knob=scored_knob, grid=grid,
                             bounds=tuning_bounds(method, scored_knob) if scored_knob else (0.0, math.inf),
                             prior_std=start, prior_bounds=tuning_bounds(method, "prior_std"), tempered=tempered,
                             on_score=progress.candidate)
    for stage in record["stages"]:
        text = bracket_text(stage)
        if text:
            progress.say(text)
    chosen = ", ".join(f"{k}={v:g}" for k, v in record["options"].items())
    progress.say(f"chose {chosen} (validation NLL {record['val_nll']:.4f})")
    return {**record, "prior_std_from": source}


def bracket_text(stage: dict) -> str | None:
    """A sentence on a tuning stage whose winner is not bracketed (its ``bound_hit``); None when it is.

    E.g. ``"prior_std 81 is the highest value scored (after 3 extensions of the grid, the most allowed): the best
    value may lie above it"``.
    """
    hit = stage.get("bound_hit")
    if not hit:
        return None
    option, chosen = stage["option"], stage["chosen"]
    side = hit.get("side")
    edge = {"low": "lowest", "high": "highest"}.get(side, "only")
    beyond = {"low": "below", "high": "above"}.get(side, "beyond")
    reason = hit.get("reason")
    low, high = stage.get("bounds", (0.0, math.inf))
    if reason == "value_bound":
        why = f"the {'lower' if side == 'low' else 'upper'} end of its range [{low:g}, {high:g}]"
    elif reason == "max_extensions":
        added = stage.get("extensions", [])
        start = [v for v in stage["grid"] if v not in added] or [chosen]
        count = sum(1 for v in added if (v < min(start) if side == "low" else v > max(start)))
        why = f"after {count} extension{'s' if count != 1 else ''} of the grid, the most allowed"
    elif reason == "non_finite":
        why = "the next value beyond it diverged (non-finite validation NLL)"
    elif reason == "single_point":
        return f"{option} had a single candidate, {chosen:g}: nothing to compare it with"
    else:
        why = str(reason)
    return f"{option} {chosen:g} is the {edge} value scored ({why}): the best value may lie {beyond} it"


def tuned_option_names(method: str) -> tuple[str, ...]:
    """The options a tuning record may set before training ``method``: its prior std and its knob (not a post hoc
    one).
    """
    knob = knob_of(method)
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


def tuning_score(cfg: RunConfig, num_samples: int) -> float:
    """Validation NLL of one tuning candidate: trained exactly as ``fit`` trains, nothing written.

    With ``cfg.progress`` on a terminal its training shows a bar that is cleared when it ends.

    The model is trained for ``cfg.epochs`` epochs, the best-validation epoch is
    kept (as ``best.pt`` is in a run), the method is finalised (``after_fit``: e.g. a
    curvature is fitted) and the posterior predictive with ``num_samples`` samples is
    scored on the validation set. A method whose knob is set post hoc
    (:data:`POST_HOC`) scores its best value of that knob
    (:func:`_post_hoc_tune`). A run whose loss diverges, or that ends without a
    posterior (a sampler that kept no draw), scores ``inf``.
    """
    splits, _, bnn, head, device = build(cfg)
    if not len(splits.val):
        raise ValueError("tuning needs validation data: set val_fraction > 0, or pass --no-tune")
    optimizer = make_optimizer(cfg, bnn, head)
    val_loader = eval_loader(splits.val, cfg)
    try:
        fit(bnn, EpochLoader(splits.train, cfg.batch_size, cfg.seed, cfg.num_workers), epochs=cfg.epochs,
            optimizer=optimizer, val_loader=val_loader,
            early_stopping_patience=cfg.epochs if bnn.select_best_epoch else None,
            autocast_dtype=AMP_DTYPES[cfg.amp], finalize=False,
            progress={"desc": "candidate", "leave": False} if cfg.progress and sys.stderr.isatty() else False)
    except FloatingPointError:
        return float("inf")
    bnn.after_fit(eval_loader(splits.train, cfg))
    if not bnn.is_ready():  # e.g. a sampler kept no draw: the candidate has no posterior and cannot win
        return float("inf")
    if knob_of(cfg.method) == POST_HOC:
        record = _post_hoc_tune(bnn, val_loader, cfg, num_samples)
        return record["val_nll"][record["chosen_index"]]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    return evaluate_loader(bnn, val_loader, num_samples, generator=gen)["nll"]


def knob_of(method: str) -> str | None:
    """The option ``compare`` tunes for ``method`` besides its prior std (its class's ``tuning``), or None."""
    knob = tuning_option(method)
    return None if knob is None else knob[0]


def _post_hoc_tune(bnn, val_loader, cfg: RunConfig, num_samples: int) -> dict:
    """The post hoc prior precision of a fitted posterior: bracketed grid, best value set on ``bnn``.

    The model's ``validation_search`` scores every value (the same seed for each, so all see the same noise)
    and changes nothing; the chosen value is then set. Returns the :func:`~bayeswrap.evaluation.tuning.tune`
    record.
    """
    option, grid = tuning_option(cfg.method)
    record = bnn.validation_search(val_loader, grid, num_samples=num_samples, seed=cfg.seed,
                                   bounds=tuning_bounds(cfg.method, option))
    bnn.prior_precision = record["chosen"]
    bnn.val_search = {"grid": record["grid"], "nll": record["val_nll"]}
    return record


def tune_post_hoc(bnn, splits, tuning: dict, *, cfg: RunConfig, num_samples: int) -> dict:
    """The final run's post hoc knob (:data:`POST_HOC`), appended to the tuning record as a stage (``run_fit``'s
    ``post_hoc``).
    """
    record = _post_hoc_tune(bnn, eval_loader(splits.val, cfg), cfg, num_samples)
    log.info("%s: %s %g chosen by validation NLL over %s%s", cfg.method, POST_HOC, record["chosen"],
             record["grid"], f"; {bracket_text(record | {'option': POST_HOC})}" if record.get("bound_hit") else "")
    stage = {"stage": "post_hoc", "option": POST_HOC, "fixed": {"prior_std": cfg.prior_std}, **record}
    return {**tuning, "options": {**tuning.get("options", {}), POST_HOC: record["chosen"]},
            "val_nll": record["val_nll"][record["chosen_index"]], "stages": [*tuning.get("stages", []), stage]}
