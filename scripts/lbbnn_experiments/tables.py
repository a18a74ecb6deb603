"""The report's Markdown tables, our numbers beside the paper's."""

from __future__ import annotations

import numpy as np

from scripts.lbbnn_experiments.settings import DIGITS_METHODS, PAPER


def digits_table(dg: dict) -> str:
    """Part 5: per method and its options, the full and MPM accuracies and the density of every seed."""
    rows = ["| method | options | full acc. % (per seed) | MPM acc. % (per seed) | density (per seed) |",
            "|---|---|---|---|---|"]
    for name, (method, options) in DIGITS_METHODS.items():
        def cells(key, fmt):
            vals = [e[name].get(key) for e in dg["per_seed"]]
            return " / ".join("–" if v is None else fmt(v) for v in vals)
        opts = ", ".join(f"{k}={v:g}" for k, v in options.items()) or "defaults"
        rows.append(f"| {name} | {opts} | {cells('full_accuracy', pct)} | {cells('mpm_accuracy', pct)} "
                    f"| {cells('density', lambda v: f'{v:.3f}')} |")
    return "\n".join(rows)


def pct(v: float | None) -> str:
    """A fraction as a percentage with two decimals, ``"–"`` for ``None``."""
    return "–" if v is None else f"{100 * v:.2f}"


def _mmm_cell(stat: dict | None) -> str:
    if stat is None:
        return "–"
    return f"{pct(stat['min'])} / **{pct(stat['median'])}** / {pct(stat['max'])}"


def _paper(v, fmt="{:.2f}") -> str:
    return "–" if v is None else fmt.format(v)


TABLE1_HEADER = ("| method | MPM acc. % (min / median / max) | paper MPM median | full acc. % (min / median / max) "
                 "| paper full median | density (median) | paper density | s / epoch (median) |")


def table1(results: dict) -> str:
    """Part 1: Table 1, min / median / max over seeds of our accuracies beside the paper's medians."""
    rows = [TABLE1_HEADER, "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        p = PAPER["table1"][name]
        rows.append(f"| {name} | {_mmm_cell(r['mpm_accuracy'])} | {_paper(p['mpm_median'])} "
                    f"| {_mmm_cell(r['full_accuracy'])} | {_paper(p['full_median'])} "
                    f"| {r['density']['median']:.3f} | {_paper(p['density'], '{:.3f}')} "
                    f"| {r['seconds_per_epoch']['median']:.2f} |")
    return "\n".join(rows)


def vi_table(grid: dict, chosen: dict) -> str:
    """The BNN's validation grid (Adam lr, local reparameterisation), the chosen row marked."""
    rows = ["| Adam lr | local reparameterisation | val. acc. % | val. NLL | training error % (last epoch) | |",
            "|---|---|---|---|---|---|"]
    for e in grid.values():
        pick = e["lr"] == chosen["lr"] and e["local_reparam"] == chosen["local_reparam"]
        rows.append(f"| {e['lr']:g} | {'yes' if e['local_reparam'] else 'no'} | {pct(e['val_accuracy'])} "
                    f"| {e['val_nll']:.3f} | {pct(e['final_train_error'])} | {'**chosen**' if pick else ''} |")
    return "\n".join(rows)


def curve_table(curves: dict, name: str) -> str:
    """The density and validation accuracies of ``name`` along its training budget (medians over seeds)."""
    rows = ["| epoch | Σ lr | density | val. acc. MPM % | val. acc. full % |", "|---|---|---|---|---|"]
    for p in curves.get(name, []):
        rows.append(f"| {p['epoch']} | {p['adam_budget']:.2f} | {p['density']:.3f} | {pct(p['val_mpm_accuracy'])} "
                    f"| {pct(p['val_full_accuracy'])} |")
    return "\n".join(rows)


VARSEL_HEADER = "| method | TPR (mean ± std) | paper TPR | FPR (mean ± std) | paper FPR |"


def varsel_table(vs: dict) -> str:
    """Part 2: TPR and FPR (mean ± std over data sets) beside the paper's."""
    rows = [VARSEL_HEADER, "|---|---|---|---|---|"]
    for name, s in vs["summary"].items():
        p = PAPER["variable_selection"][name]
        rows.append(f"| {name} | {s['tpr']:.3f} ± {s['tpr_std']:.3f} | {p['tpr']:.3f} | {s['fpr']:.3f} ± "
                    f"{s['fpr_std']:.3f} | {p['fpr']:.3f} |")
    return "\n".join(rows)


def frequency_table(vs: dict) -> str:
    """Part 2: per covariate, its true β and the fraction of data sets in which each method selected it."""
    names = list(vs["summary"])
    rows = ["| covariate | true β | " + " | ".join(f"{n}: selected" for n in names) + " |",
            "|---|---|" + "---|" * len(names)]
    for j, b in enumerate(vs["beta"]):
        cells = " | ".join(f"{vs['summary'][n]['selection_frequency'][j]:.2f}" for n in names)
        rows.append(f"| X{j + 1} | {b:g} | {cells} |")
    return "\n".join(rows)


TIMING_HEADER = ("| method | s / epoch (median over epochs and seeds) | ratio to BNN (VI) "
                 "| paper s / epoch (A10, full MNIST) |")


def timing_table(tm: dict) -> str:
    """Part 4: seconds per epoch and the ratio to the BNN's, beside the paper's seconds."""
    rows = [TIMING_HEADER, "|---|---|---|---|"]
    for name, t in tm.items():
        rows.append(f"| {name} | {t['seconds_per_epoch']:.2f} | {t['ratio_to_vi']:.2f} "
                    f"| {_paper(t['paper_seconds_per_epoch'], '{:.0f}')} |")
    return "\n".join(rows)


def cluster_table(summary: dict) -> str:
    """Part 3: per method, S, the training accuracy and the mean entropies on and away from the data."""
    rows = ["| method | S | training accuracy | mean entropy on training points | mean entropy > 2 from data |",
            "|---|---|---|---|---|"]
    for name, s in summary.items():
        rows.append(f"| {name} | {s['num_samples']} | {s['train_accuracy']:.3f} | {s['mean_entropy_train']:.3f} "
                    f"| {s['mean_entropy_far']:.3f} |")
    return "\n".join(rows)


def median_of(runs: list[dict], key: str) -> float | None:
    """The median over ``runs`` of ``run[key]`` where it is not ``None``; ``None`` if none has it."""
    vals = [r[key] for r in runs if r.get(key) is not None]
    return float(np.median(vals)) if vals else None


def fmt_or_dash(v: float | None) -> str:
    """``v`` with three decimals, ``"–"`` for ``None``."""
    return "–" if v is None else f"{v:.3f}"


def density_table(results: dict) -> str:
    """Medians over seeds of where each LBBNN variant's density comes from (see :func:`density_sources`)."""
    rows = ["| method | started included (λ₀ > 0) | out of Adam's reach (λ₀ > Σ lr) | Σ lr "
            "| kept, of the included within reach | re-included, of the excluded | final density |",
            "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        runs = r["per_seed"]
        if "adam_budget" not in runs[0]:
            continue
        rows.append(f"| {name} | {fmt_or_dash(median_of(runs, 'init_density'))} "
                    f"| {fmt_or_dash(median_of(runs, 'unreachable_fraction'))} | {median_of(runs, 'adam_budget'):.2f} "
                    f"| {fmt_or_dash(median_of(runs, 'kept_within_reach'))} | {fmt_or_dash(median_of(runs, 'reincluded'))} "
                    f"| {r['density']['median']:.3f} |")
    return "\n".join(rows)

