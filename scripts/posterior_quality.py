"""Posterior quality: every method against MAP and MAP + temperature scaling, 3 seeds, digits and mnist5k.

For each dataset and seed this runs ``bayeswrap compare`` (fair tuning on: every
method picks its key option and its prior std by validation NLL on grids that
bracket the optimum, :mod:`bayeswrap.evaluation.tuning`) with
S = 20 posterior samples, classes 8 and 9 held out, and the shift protocol of
:mod:`bayeswrap.data.shift` (rotation 15°…180°, Gaussian pixel noise
0.1…1). It reports, as mean ± std over seeds:

* in distribution: test error, NLL and ECE at T = 1 (MAP + TS: MAP at the
  temperature fitted on validation);
* under rotation and under noise, averaged over the non-zero intensities:
  NLL and ECE (MAP + TS keeps its in-distribution temperature, as deployed);
* held-out classes 8/9: AUROC of the predictive entropy (and of the mutual
  information where the method has S ≥ 2 distinct samples);
* Laplace (GLM) test error at prior precisions 10⁻⁴…10⁴ (the issue's
  "error within 1 pp of MAP at every prior precision" check).

It writes ``posterior_quality.md`` (tables, each method's training cost as a
multiple of MAP's in the same run, and the targets, each marked met or not), ``posterior_quality.json`` (every number and setting) and
``posterior_quality.png`` (NLL and ECE in distribution and under shift, per
method, with MAP + TS as a line).

Usage (from the repository root; the full run takes ~25 minutes on 2 CPU cores)::

    .venv/bin/python scripts/posterior_quality.py [--out figures] [--seeds 0,1,2] [--datasets digits,mnist5k]
    .venv/bin/python scripts/posterior_quality.py --fast --out /tmp/pq   # smoke test, not a result
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on a shared 2-core box

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bayeswrap.app.build import build, eval_loader  # noqa: E402
from bayeswrap.app.compare import run_compare  # noqa: E402
from bayeswrap.app.config import resolve  # noqa: E402
from bayeswrap.app.reports import operating_points, tuned_options  # noqa: E402
from bayeswrap.core.io import load_checkpoint, write_json, write_text  # noqa: E402
from bayeswrap.methods import METHODS  # noqa: E402
from bayeswrap.predictive import evaluate  # noqa: E402

STEM = "posterior_quality"
METHOD_ORDER = ("map", "vi", "ivon", "mc_dropout", "sgld", "laplace", "laplace_ll_kfac", "swag", "ensemble",
                "multiswag")
NUM_SAMPLES = 20
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "digits.yaml"
PRIOR_PRECISIONS = tuple(10.0 ** k for k in range(-4, 5))
#: per-dataset overrides of configs/digits.yaml (full run)
DATASETS = {"digits": {}, "mnist5k": {"epochs": 15}}
FAST = {"epochs": 2, "shift_rotations": "0,90", "shift_noise": "0,0.5", "batch_size": 128, "thinning": 1}
#: the bar set by what practitioners pick instead, measured on this protocol (3 seeds, S = 20): the best peer
#: (a 5-member deep ensemble, SWAG, MultiSWAG x5) per column; (column, "<=" | ">=", bound)
PEER_BAR = {"mnist5k": (("error", "<=", 0.0478), ("nll", "<=", 0.184), ("rotation_nll", "<=", 3.19),
                        ("noise_nll", "<=", 0.722), ("auroc_entropy", ">=", 0.881)),
            "digits": (("nll", "<=", 0.053), ("auroc_entropy", ">=", 0.960))}
#: a method beating a peer number must keep its in-distribution NLL within this factor of MAP's
NLL_SLACK = 1.02
#: a single-model method costs at most this many MAP trainings
SINGLE_MODEL_COST = 2.0
#: the ECE a single-model row must reach: the deep ensemble's 0.015 and MAP + TS's 0.017 were measured on mnist5k
#: (issue 32); elsewhere MAP + TS's ECE in the same run
ECE_BAR = {"mnist5k": 0.017}


def _row(metrics: dict) -> dict:
    rep = metrics["final"][str(NUM_SAMPLES)]
    by_kind = rep["shift"].get("summary_by_kind", {})
    ood = rep.get("ood") or {}
    out = {"error": rep["T1"]["error"], "nll": rep["T1"]["nll"], "ece": rep["T1"]["ece"],
           "nll_Topt": (rep.get("Topt") or {}).get("nll"), "ece_Topt": (rep.get("Topt") or {}).get("ece"),
           "auroc_entropy": (ood.get("entropy") or {}).get("auroc"),
           "auroc_entropy_Topt": (ood.get("entropy_Topt") or {}).get("auroc"),
           "auroc_mi": (ood.get("mutual_information") or {}).get("auroc"),
           "tuned": tuned_options(metrics) or None,
           "train_seconds": sum(h.get("seconds", 0.0) for h in metrics["history"])}
    for kind in ("rotation", "noise"):
        summary = by_kind.get(kind, {})
        for metric in ("nll", "ece", "error"):
            out[f"{kind}_{metric}"] = summary.get(metric)
            out[f"{kind}_{metric}_Topt"] = summary.get(f"{metric}_Topt")
    return out


def laplace_precision_sweep(run_dir: Path) -> dict:
    """Test error of the Laplace GLM predictive at every prior precision, probit and sampled (S = 20) links."""
    cfg = resolve(str(run_dir / "config.yaml"), {})
    splits, _, bnn, _, device = build(cfg, for_evaluation=True)
    bnn.load_state_dict(load_checkpoint(run_dir / "best.pt"))
    bnn.eval()
    loader = eval_loader(splits.test, cfg)
    errors = {"probit": [], "mc": []}
    for value in PRIOR_PRECISIONS:
        bnn.prior_precision = value
        for link in errors:
            gen = torch.Generator(device=device).manual_seed(cfg.seed)
            glm = bnn.default_predictive(link_approx=link)  # the GLM predictive with this link; bnn is not changed
            errors[link].append(evaluate(bnn, loader, NUM_SAMPLES, generator=gen, predictive=glm)["error"])
    return {"prior_precision": list(PRIOR_PRECISIONS), "error": errors}


def run_one(dataset: str, seed: int, methods: list[str], fast: bool, tmp: Path) -> dict:
    overrides = {"dataset": dataset, "seed": seed, "out_dir": str(tmp), "run_name": f"{dataset}-{seed}",
                 "progress": False, **DATASETS[dataset], **(FAST if fast else {})}
    tic = time.perf_counter()
    base, _ = run_compare(str(CONFIG), overrides, methods, [NUM_SAMPLES])
    seconds = time.perf_counter() - tic
    rows = {}  # a method's run, then its further operating points ("laplace (val)", "laplace (marglik)")
    for m in methods:
        for label, metrics in operating_points(m, json.loads((base / m / "metrics.json").read_text())).items():
            rows[label] = _row(metrics)
    for row in rows.values():  # training time as a multiple of MAP's, in the same run
        row["cost"] = row["train_seconds"] / rows["map"]["train_seconds"] if "map" in rows else None
    sweep = laplace_precision_sweep(base / "laplace") if "laplace" in methods else None
    return {"rows": rows, "laplace_sweep": sweep, "seconds": seconds}


def _mean_std(values) -> tuple[float, float] | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return float(np.mean(vals)), float(np.std(vals))


def aggregate(runs: list[dict]) -> dict:
    """``{row: {metric: (mean, std)}}`` over seeds (a row is a method or an operating point), and its "+ts" twin.

    Every row ``m`` gets a row ``m+ts``: the same posterior predictive at the temperature fitted on in-distribution
    validation (kept under shift, as deployed); its error is the untempered one (a temperature does not change the
    predicted class) and its AUROC the entropy of the tempered predictive where the run recorded it.
    """
    methods = list(runs[0]["rows"])
    keys = [k for k in runs[0]["rows"][methods[0]] if k not in ("tuned", "train_seconds")]
    table = {m: {k: _mean_std([r["rows"][m][k] for r in runs]) for k in keys if not k.endswith("_Topt")}
             for m in methods}
    for m in methods:
        ts = {}
        for k in table[m]:
            src = f"{k}_Topt" if f"{k}_Topt" in keys and k != "error" else k
            ts[k] = _mean_std([r["rows"][m][src] for r in runs]) if src != "auroc_mi" else None
        table[f"{m}+ts"] = ts
    return table


def _fmt(ms, digits=3, pct=False) -> str:
    if ms is None:
        return "–"
    m, s = ms
    if pct:
        return f"{100 * m:.1f} ± {100 * s:.1f}"
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def markdown(result: dict, fast: bool) -> str:
    lines = ["Regenerate: `.venv/bin/python scripts/posterior_quality.py --out figures`", "",
             "# Posterior quality: every method against MAP and MAP + temperature scaling", ""]
    if fast:
        lines += ["**FAST MODE: smoke test, not a result.**", ""]
    lines += [f"Generated by `scripts/posterior_quality.py` in {result['seconds']:.0f} s. Mean ± std over seeds "
              f"{result['seeds']}; S = {NUM_SAMPLES} posterior samples (MAP: its point estimate); fair tuning on "
              "(each method's key option and prior std chosen by validation NLL, `bayeswrap.evaluation.tuning`; "
              "tuned options listed per seed where they differ); classes 8 and 9 held out "
              "of training and scored as out-of-distribution. Shift columns average the non-zero intensities "
              "(rotation 15°–180°, pixel noise 0.1–1). MAP + TS uses the temperature fitted on in-distribution "
              "validation everywhere, as deployed. Every method is scored by its own posterior predictive "
              "(the table's predictive column of `bayeswrap compare`): Laplace by its GLM with the probit link, "
              "its samples used only for the mutual information. Laplace (all weights, diagonal) is scored at two "
              "operating points of one fitted posterior: its prior precision chosen by validation NLL, "
              "\"laplace (val)\", and by marginal likelihood, \"laplace (marglik)\"; \"laplace_ll_kfac\" is "
              "laplace-torch's recommended setting (last-layer KFAC, marginal-likelihood prior precision, probit). "
              "Errors in %.", ""]
    cols = [("error", "error %", True), ("nll", "NLL", False), ("ece", "ECE", False),
            ("rotation_nll", "rot. NLL", False), ("rotation_ece", "rot. ECE", False),
            ("noise_nll", "noise NLL", False), ("noise_ece", "noise ECE", False),
            ("auroc_entropy", "AUROC (entropy)", False), ("auroc_mi", "AUROC (MI)", False),
            ("cost", "cost (× MAP)", False)]
    for dataset, res in result["datasets"].items():
        lines += [f"## {dataset}", ""]
        for title, ts in (("At T = 1 (the posterior predictive as it is):", False),
                          ("Temperature-scaled (+TS: each row's predictive at the temperature fitted on "
                           "in-distribution validation, kept under shift; error as at T = 1):", True)):
            lines += [title, "", "| method | " + " | ".join(c[1] for c in cols) + " | tuned options |",
                      "|" + "---|" * (len(cols) + 2)]
            for m, row in res["table"].items():
                if m.endswith("+ts") != ts:
                    continue
                tuned = ""
                base = m[:-3] if ts else m
                if base in res["tuned"]:  # every chosen option (the prior std and the method's knob), per seed
                    tuned = "; ".join(dict.fromkeys(", ".join(f"{k}={v:g}" for k, v in t.items())
                                                    for t in res["tuned"][base] if t))
                lines.append(f"| {m} | " + " | ".join(_fmt(row.get(k), pct=p) for k, _, p in cols) + f" | {tuned} |")
            lines.append("")
        if res.get("laplace_sweep"):
            sweep = res["laplace_sweep"]
            lines += ["", "Laplace (GLM) test error (%) against the prior precision, mean over seeds "
                      f"(MAP: {100 * res['table']['map']['error'][0]:.1f}); the probit link that the tables above use, "
                      f"and the sampled link (S = {NUM_SAMPLES}):", "",
                      "| prior precision | " + " | ".join(f"{p:g}" for p in sweep["prior_precision"]) + " |",
                      "|" + "---|" * (len(sweep["prior_precision"]) + 1)]
            lines += [f"| {link} | " + " | ".join(f"{100 * e:.1f}" for e in errs) + " |"
                      for link, errs in sweep["error"].items()]
        lines += ["", "### Targets", "", f"Against the best peer per column (deep ensemble ×5, SWAG, MultiSWAG ×5 on "
                  f"this protocol), at an in-distribution NLL within {NLL_SLACK:g} × MAP's; and a single-model "
                  f"method (cost ≤ {SINGLE_MODEL_COST:g} × MAP) against MAP + TS:", ""]
        lines += [f"- {t}" for t in res["targets"]] + [""]
    lines += [f"![NLL and ECE in distribution and under shift]({STEM}.png)", ""]
    return "\n".join(lines)


def targets(table: dict, sweep: dict | None, dataset: str = "digits") -> list[str]:
    """The targets, each as a line saying met or not with the numbers.

    * per column of :data:`PEER_BAR`: the best row in that column (its mean over
      seeds; a method, an operating point or its +TS twin, all at the defaults of
      ``compare``) among those whose in-distribution NLL is within :data:`NLL_SLACK` of
      MAP's, against the best peer's number;
    * VI and IVON no worse than MAP under rotation and under noise (NLL, T = 1);
    * a single-model row (cost ≤ :data:`SINGLE_MODEL_COST` × MAP, MAP itself and MAP + TS
      excluded) with ECE at or below :data:`ECE_BAR` (MAP + TS's ECE where none is set);
    * the best single-model row against MAP + TS on in-distribution, rotation and noise
      NLL, all three at once;
    * Laplace (GLM) error within 1 pp of MAP at every prior precision of the sweep.
    """
    out = []
    mp = table["map"]
    ts = table.get("map+ts")
    rows = [m for m in table if m != "map+ts"]
    allowed = [m for m in rows if table[m]["nll"][0] <= NLL_SLACK * mp["nll"][0]]
    for key, op, bound in PEER_BAR.get(dataset, ()):
        have = [m for m in allowed if table[m].get(key)]
        if not have:
            out.append(f"NOT met: {key}: no method within {NLL_SLACK:g} × MAP's in-distribution NLL")
            continue
        pick = (min if op == "<=" else max)(have, key=lambda m: table[m][key][0])
        v = table[pick][key][0]
        ok = v <= bound if op == "<=" else v >= bound
        scale, unit = (100, "%") if key == "error" else (1, "")
        out.append(f"{'met' if ok else 'NOT met'}: {key} {op} {scale * bound:g}{unit}: best {pick} "
                   f"{scale * v:.4g}{unit} (NLL {table[pick]['nll'][0]:.4f}, MAP {mp['nll'][0]:.4f})")
    for m in ("vi", "ivon"):
        if m in table and table[m].get("rotation_nll") and mp.get("rotation_nll"):
            worse = [k for k in ("rotation_nll", "noise_nll") if table[m][k][0] > mp[k][0]]
            got = ", ".join(f"{k} {table[m][k][0]:.3f} vs {mp[k][0]:.3f}" for k in ("rotation_nll", "noise_nll"))
            out.append(f"{'NOT met' if worse else 'met'}: {m} no worse than MAP under rotation and noise ({got})")
    single = [m for m in rows if m != "map" and table[m].get("cost") and table[m]["cost"][0] <= SINGLE_MODEL_COST]
    if ts is not None and single:
        bar = ECE_BAR.get(dataset, ts["ece"][0])
        best = min(single, key=lambda m: table[m]["ece"][0])
        ece = table[best]["ece"][0]
        out.append(f"{'met' if ece <= bar else 'NOT met'}: a single-model row (cost ≤ {SINGLE_MODEL_COST:g} × MAP) "
                   f"with ECE ≤ {bar:.3f}: best {best} {ece:.3f} (MAP + TS {ts['ece'][0]:.3f})")
    if ts is not None and ts.get("rotation_nll") and single:
        keys = ("nll", "rotation_nll", "noise_nll")
        wins = {m: sum(table[m][k][0] < ts[k][0] for k in keys) for m in single if table[m].get("rotation_nll")}
        if wins:
            best = max(wins, key=lambda m: (wins[m], -table[m]["nll"][0]))
            got = ", ".join(f"{k} {table[best][k][0]:.3f} vs {ts[k][0]:.3f}" for k in keys)
            out.append(f"{'met' if wins[best] == len(keys) else 'NOT met'}: a single-model method beats MAP + TS on "
                       f"in-distribution, rotation and noise NLL: best {best} (cost {table[best]['cost'][0]:.1f} × "
                       f"MAP) wins {wins[best]} of 3 ({got})")
    if sweep:
        for link, errs in sweep["error"].items():
            worst = max(errs)
            ok = worst <= mp["error"][0] + 0.01
            out.append(f"{'met' if ok else 'NOT met'}: Laplace (GLM, {link} link) error ≤ MAP + 1 pp at every prior "
                       f"precision 1e-4…1e4 (worst {100 * worst:.2f}% against MAP {100 * mp['error'][0]:.2f}%)")
    return out


def figure(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(result["datasets"])
    panels = [("nll", "NLL, in distribution"), ("rotation_nll", "NLL under rotation"),
              ("noise_nll", "NLL under noise"), ("ece", "ECE, in distribution"),
              ("rotation_ece", "ECE under rotation"), ("noise_ece", "ECE under noise")]
    fig, axes = plt.subplots(len(datasets), len(panels), figsize=(3.2 * len(panels), 3.0 * len(datasets)),
                             squeeze=False)
    for i, dataset in enumerate(datasets):
        table = result["datasets"][dataset]["table"]
        methods = [m for m in table if not m.endswith("+ts")]
        for j, (key, title) in enumerate(panels):
            ax = axes[i][j]
            means = [table[m][key][0] if table[m].get(key) else np.nan for m in methods]
            stds = [table[m][key][1] if table[m].get(key) else 0.0 for m in methods]
            ax.bar(range(len(methods)), means, yerr=stds, color="tab:blue", alpha=0.8, capsize=2)
            if table.get("map+ts", {}).get(key):
                ax.axhline(table["map+ts"][key][0], color="tab:red", ls="--", lw=1, label="MAP + TS")
            ax.set_xticks(range(len(methods)), methods, rotation=45, ha="right", fontsize=8)
            ax.set_title(f"{dataset}: {title}", fontsize=9)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="figures", help="folder for posterior_quality.md/.json/.png")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--datasets", default=",".join(DATASETS), help=f"comma-separated, from {list(DATASETS)}")
    p.add_argument("--fast", action="store_true", help="1 epoch, 1 seed, digits only, coarse shift grids")
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    bad = [d for d in datasets if d not in DATASETS]
    if bad or not seeds:
        raise SystemExit(f"--datasets {bad} not known (accepted: {list(DATASETS)}) or no --seeds given")
    if args.fast:
        seeds, datasets = seeds[:1], datasets[:1]
    methods = [m for m in METHOD_ORDER if m in METHODS]
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tic = time.perf_counter()
    result = {"seeds": seeds, "num_samples": NUM_SAMPLES, "fast": args.fast, "methods": methods, "datasets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for dataset in datasets:
            runs = []
            for seed in seeds:
                runs.append(run_one(dataset, seed, methods, args.fast, Path(tmp)))
                print(f"{dataset} seed {seed}: {runs[-1]['seconds']:.0f} s", file=sys.stderr)
            table = aggregate(runs)
            sweep = None
            if runs[0]["laplace_sweep"]:
                sweep = {"prior_precision": runs[0]["laplace_sweep"]["prior_precision"],
                         "error": {link: [float(np.mean(e)) for e in zip(*(r["laplace_sweep"]["error"][link]
                                                                        for r in runs))]
                                   for link in runs[0]["laplace_sweep"]["error"]}}
            result["datasets"][dataset] = {
                "table": table, "laplace_sweep": sweep, "per_seed": [r["rows"] for r in runs],
                "tuned": {m: [r["rows"][m]["tuned"] for r in runs] for m in runs[0]["rows"]},
                "seconds": [r["seconds"] for r in runs], "targets": targets(table, sweep, dataset)}
    result["seconds"] = time.perf_counter() - tic
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{STEM}.json", result)
    write_text(out / f"{STEM}.md", markdown(result, args.fast))
    figure(result, out / f"{STEM}.png")
    result["paths"] = [out / f"{STEM}.{ext}" for ext in ("md", "json", "png")]
    return result


if __name__ == "__main__":
    res = main()
    print(Path(res["paths"][0]).read_text())
