"""The report: the table beside BayesDLL's Table 2, the settings of both sides, and where they differ and why."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import numpy as np

from bayeswrap.app import experiments as ex
from bayeswrap.core.fused import LOG_STD_MAX_SLOPE
from bayeswrap.core.io import write_json, write_text
from bayeswrap.methods.vi import LOG_STD_CURVATURE, LOG_STD_KNEE
from scripts.bayesdll_side_by_side.ours import our_options
from scripts.bayesdll_side_by_side.settings import (
    ECE_BINS,
    METHODS,
    MNIST_MEAN,
    MNIST_STD,
    NST,
    REFERENCE,
    STEM,
    THEIR_FILES,
)
from scripts.bayesdll_side_by_side.theirs import their_hparams

SIDES = ("ours", "theirs")
METRICS = ("error", "ece_all", "ece_top", "mce_all", "mce_top", "nll")
#: (method, side, predictive) rows of the table, in order; side "ours" or "theirs"
ROWS = (("vi", "ours", "sampled"), ("vi", "theirs", "sampled"),
        ("mc_dropout", "ours", "sampled"), ("mc_dropout", "theirs", "sampled"),
        ("sgld", "ours", "ensemble"), ("sgld", "ours", "gaussian"), ("sgld", "theirs", "sampled"),
        ("laplace", "ours", "nn"), ("laplace", "ours", "glm"), ("laplace", "theirs", "sampled"))
PREDICTIVE_LABELS = {
    ("vi", "sampled"): "mean / q samples", ("mc_dropout", "sampled"): "mean / dropout samples",
    ("sgld", "ensemble"): "running mean / kept iterates", ("sgld", "gaussian"): "running mean / Gaussian of moments",
    ("sgld", "sampled"): "running mean / Gaussian of moments", ("laplace", "nn"): "MAP / sampled nn",
    ("laplace", "glm"): "MAP / linearised (GLM)", ("laplace", "sampled"): "MAP / sampled nn",
}


def aggregate(runs: dict) -> dict:
    """Mean and std over seeds of every metric: ``{method: {side: {predictive: {nst: {metric: [mean, std]}}}}}``."""
    table: dict = {}
    for method, by_seed in runs.items():
        for side in SIDES:
            done = [r[side] for r in by_seed.values() if side in r and "predictives" in r[side]]
            if not done:
                continue
            for pred in done[0]["predictives"]:
                for nst in done[0]["predictives"][pred]:
                    for metric in METRICS:
                        vals = np.array([d["predictives"][pred][nst][metric] for d in done])
                        table.setdefault(method, {}).setdefault(side, {}).setdefault(pred, {}).setdefault(
                            nst, {})[metric] = [float(vals.mean()), float(vals.std(ddof=1)) if len(vals) > 1 else 0.0]
    return table


def _cell(ms, digits: int = 2) -> str:
    return "–" if ms is None else f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}"


def results_table(summary: dict, runs: dict | None = None) -> str:
    """The Markdown table: every row at nst 0 and nst 5, BayesDLL's Table 2 beside it; a failed side as one row."""
    head = ("| method | code | predictive (nst 0 / nst 5) | nst | error % | ECE all-class % | ECE top-label % "
            "| MCE all-class % | MCE top-label % | NLL | Table 2 error % | Table 2 ECE % |")
    lines = [head, "|" + "---|" * 12]
    for method, side, pred in ROWS:
        row = summary.get(method, {}).get(side, {}).get(pred)
        failed = sorted({r[side]["failed_at"] for r in (runs or {}).get(method, {}).values()
                         if "failed_at" in r.get(side, {})})
        if row is None and failed and pred == "sampled":
            lines.append(f"| {method} | BayesDLL | failed on every seed, at {' / '.join(failed)} (see Discussion) "
                         "| – | – | – | – | – | – | – | " + f"{REFERENCE[method]['error'][0]:.2f} → "
                         f"{REFERENCE[method]['error'][1]:.2f} | {REFERENCE[method]['ece'][0]:.2f} → "
                         f"{REFERENCE[method]['ece'][1]:.2f} |")
        if row is None:
            continue
        code = "bayeswrap" if side == "ours" else "BayesDLL"
        for i, nst in enumerate(NST):
            m = row[str(nst)]
            ref = REFERENCE[method]
            lines.append(f"| {method} | {code} | {PREDICTIVE_LABELS[(method, pred)]} | {nst} "
                         f"| {_cell(m['error'])} | {_cell(m['ece_all'], 3)} | {_cell(m['ece_top'])} "
                         f"| {_cell(m['mce_all'])} | {_cell(m['mce_top'])} | {_cell(m['nll'], 3)} "
                         f"| {ref['error'][i]:.2f} | {ref['ece'][i]:.2f} |")
    return "\n".join(lines)


def settings_table(cfg: dict, num_train: int, num_test: int) -> str:
    """Per-method settings of both sides."""
    steps = math.ceil(num_train / cfg["batch_size"])
    rows = ["| method | BayesDLL hparams (both sides) | bayeswrap | BayesDLL |", "|---|---|---|---|"]
    common_t = f"SGD lr {cfg['lr']:g}, momentum {cfg['momentum']:g}"
    for method in METHODS:
        hp = ", ".join(f"{k}={v}" for k, v in their_hparams(method, cfg).items())
        o = our_options(method, num_train, cfg)
        if method == "sgld":
            ours = (f"`bw.optim.SGLD` lr {cfg['lr'] / (1 - cfg['momentum']):g} (no momentum), num_data {o['num_data']}, "
                    f"burn_in {o['burn_in']} steps, thinning {o['thinning']}")
        else:
            extra = {"vi": f"kl_weight {o.get('kl_weight')}, init_std {cfg['vi_init_std']:g}",
                     "mc_dropout": f"kl_weight {o.get('kl_weight')}, p_drop {o.get('p_drop')}, mode params",
                     "laplace": f"num_data {o['num_data']}, empirical Fisher, diagonal, all weights; GLM by "
                                f"{max(NST)} linearised samples"}[method]
            ours = f"{common_t}; prior N(0, {o['prior_std']:g}²), bias {o['bias']}; {extra}"
        theirs = f"{common_t}; `methods/{THEIR_FILES[method]}.py` Runner" + (
            "; variances from `estimate_variance` (one backward per training image)" if method == "laplace" else "")
        rows.append(f"| {method} | {hp} | {ours} | {theirs} |")
    return "\n".join([
        f"Data: mnist5k, {num_train} training and {num_test} test images (fixed stratified split, "
        f"test fraction {cfg['test_fraction']}), inputs (pixel/255 − {MNIST_MEAN}) / {MNIST_STD}. "
        f"Model: MLP 784-{'-'.join([str(cfg['width'])] * cfg['depth'])}-10 with ReLU, PyTorch's default "
        f"initialisation from the seed, prior mean 0 (BayesDLL's from-scratch setting). Training: {cfg['epochs']} "
        f"epochs of {steps} steps (batch {cfg['batch_size']}, reshuffled each epoch by a seeded generator), "
        f"the last iterate is scored (no early stopping, no temperature scaling). Seeds {list(cfg['seeds'])}. "
        f"Metrics with {ECE_BINS} bins.", "", *rows])


#: where ours and theirs differ, method by method, and why (from reading both codes; the numbers are in the table)
DIFFERENCES = """\
* **Protocol, both sides.** Table 2 trains 100 epochs on 30,000 MNIST images
  (23,500 steps) and reports the epoch with the lowest validation loss; here
  both codes train {epochs} epochs on {num_train} mnist5k images ({total_steps}
  steps) and are scored at the last epoch, on {num_test} test images. With
  ~{data_ratio:.1f}× less data and ~{step_ratio:.0f}× fewer steps the errors are higher than
  Table 2's for both codes; the comparison that this file makes exact is ours
  against theirs, on the same batches from the same weights.
* **vi.** Same objective (mean-field Gaussian, analytic KL to N(0, 1) scaled by
  kld/N, one sample per step) and same nst 0 predictive (the means). The std
  parameterisations differ. BayesDLL trains s itself and clamps it at 1e-8
  only where it reads it: a step can take the raw parameter below 1e-8, and
  its gradient there holds the entropy term −kld/(N·1e-8), −{kick:.0f} at
  N = {num_train} (−3.3 at Table 2's N = 30,000), which throws that std to
  ~{kick_step:.2f} in one step (about twice that with momentum 0.5), where
  PyTorch initialises the first layer's weights within ±1/√784 = ±0.036.
  Ours trains ρ with log s = log σ + b sinh(κρ/b) (:mod:`bayeswrap.methods.vi`),
  so s stays positive; far below its optimum log s rises by about
  c·lr/2·(1 + (D/b)²) per SGD step at D nats below the prior std (c = {vi_c},
  b = {vi_knee:g}; at most {vi_rate_max:.0e} per step, {vi_rate_m:.0e} with momentum
  {momentum}), where the earlier map log s = κρ rose by at most c·lr/2 = {vi_rate:.0e}
  (×{vi_growth:.2f} in {total_steps} steps, so that s stayed near s₀ = {s0:.0e} and the
  samples were the means). {vi_note}
* **mc_dropout.** Same q (each weight kept with probability 0.9 or reset to
  the prior mean 0; biases Gaussian, never dropped) and same loss. At nst 0
  BayesDLL predicts with the kept values m themselves; ours predicts with the
  mean of q, 0.9·m for every weight, a smaller-scale network whose softmax is
  less confident. At nst 5 both average 5 dropout draws.
* **sgld.** BayesDLL writes the Langevin noise into `.grad` and steps with SGD
  momentum 0.5, so the noise passes through the momentum buffer (effective
  step lr/(1 − 0.5), temperature 1/(1 − 0.5) = 2 at that step); ours has no
  momentum and takes the Langevin step 2·lr at temperature 1. With N inflated
  to {sgld_n} the noise is ~{sgld_noise:.0e} per step either way, so both chains
  are close to SGD. nst 0 is the running mean of the kept iterates on both
  sides. At nst 5 BayesDLL samples a Gaussian fitted to the iterates' first two
  moments; ours by default evaluates 5 evenly spaced kept iterates (the
  "gaussian" row is ours with BayesDLL's predictive).
* **laplace.** Both train the MAP with σ = 0.01 and N inflated by 1e3, and
  both use the diagonal empirical Fisher. BayesDLL's variances are
  1/(1/σ² + Σ_n g_n²), the sum over the {num_train} training images without
  the inflation; ours are 1/(1/σ² + (N/n) Σ_n g_n²) with N = {laplace_n} the
  inflated size (:mod:`bayeswrap.methods.laplace`), so our data term is 1e3×
  larger and our posterior narrower wherever the data curvature is not
  negligible against the prior precision 1e4. Both nst 0 rows are the MAP. At
  nst 5 the sampled `nn` predictive perturbs every weight by up to σ = 0.01;
  the GLM predictive linearises the network around the MAP, so the same
  posterior moves the predictions less.
* **Metrics.** Error, all-class ECE and MCE are computed by the same code for
  both sides ({cross_check}); the all-class ECE divides by N·K items, 90 % of
  which are near-certain zeros, so it is smaller than the top-label ECE (here
  by {ece_ratio} over the table's rows).
"""


def _ece_ratio(summary: dict) -> str:
    """The median over the table's rows of top-label ECE / all-class ECE, as a phrase."""
    ratios = [nst["ece_top"][0] / nst["ece_all"][0] for sides in summary.values() for preds in sides.values()
              for by_nst in preds.values() for nst in by_nst.values() if nst["ece_all"][0] > 0]
    return f"a median factor of {float(np.median(ratios)):.1f}" if ratios else "an unmeasured factor"


def _laplace_map_note(runs: dict) -> str:
    """How far the two codes' Laplace MAPs (the same SGD on the same loss, batches and weights) ended apart."""
    gaps = [(r["ours"]["predictives"]["nn"]["0"], r["theirs"]["predictives"]["sampled"]["0"])
            for r in runs.get("laplace", {}).values() if "predictives" in r.get("theirs", {})]
    if not gaps:
        return ""
    err = max(abs(a["error"] - b["error"]) for a, b in gaps)
    nll = max(abs(a["nll"] - b["nll"]) for a, b in gaps)
    return (f" Both codes train the same MAP (plain SGD on the same loss, batches and initial weights): at nst 0 "
            f"their test error differs by at most {err:.2f} points and their NLL by at most {nll:.1e} over the "
            "seeds, the drift of floating-point rounding between the two loss codes over the steps.")


def _their_vi_note(runs: dict) -> str:
    """What BayesDLL's raw VI stds and training loss did in this run, per seed."""
    notes = []
    for seed, r in runs.get("vi", {}).items():
        theirs = r.get("theirs", {})
        trace, losses = theirs.get("vi_std_trace", []), theirs.get("train_loss", [])
        if not trace:
            continue
        below = next((i for i, t in enumerate(trace) if t["below_clamp"]), None)
        bad = next((i for i, v in enumerate(losses) if not math.isfinite(v) or v > 1e3), None)
        text = f"seed {seed}: " + (f"raw stds below the clamp after epoch {below} ({trace[below]['below_clamp']})"
                                   if below is not None else "no raw std below the clamp")
        text += f", largest std {max(t['max'] for t in trace[:bad]) if bad else trace[-1]['max']:.2g}"
        text += (f", training loss {losses[bad]:.3g} in epoch {bad}" if bad is not None else
                 f", final training loss {losses[-1]:.3g}")
        notes.append(text)
    return ("Measured on BayesDLL's side (epochs counted from 0): " + "; ".join(notes) + ".") if notes else ""


def discussion(summary: dict, runs: dict, cfg: dict, num_train: int, num_test: int, bdl_info: dict) -> str:
    """The per-method comparison with this run's numbers filled in."""
    steps = math.ceil(num_train / cfg["batch_size"])
    total = cfg["epochs"] * steps
    checks = bdl_info.get("ece_cross_check_max_abs_diff")
    cross = ("BayesDLL's own `calibration.calc_bins` gives the same all-class ECE for its predictions within "
             f"{checks:.1e} percentage points" if checks is not None else
             "BayesDLL's `calibration.calc_bins` was not available to cross-check the all-class ECE")
    sgld_n = our_options("sgld", num_train, cfg)["num_data"]
    vi_rate = LOG_STD_CURVATURE * cfg["lr"] / 2
    vi_rate_max = vi_rate * LOG_STD_MAX_SLOPE**2
    text = DIFFERENCES.format(vi_note=_their_vi_note(runs), vi_rate=vi_rate, vi_c=LOG_STD_CURVATURE,
                              vi_knee=LOG_STD_KNEE, vi_rate_max=vi_rate_max,
                              vi_rate_m=vi_rate_max / (1 - cfg["momentum"]), momentum=cfg["momentum"],
                              vi_growth=math.exp(vi_rate / (1 - cfg["momentum"]) * total), s0=cfg["vi_init_std"], kick=1e-3 / (num_train * 1e-8),
                              kick_step=cfg["lr"] * 1e-3 / (num_train * 1e-8), epochs=cfg["epochs"],
                              num_train=num_train, num_test=num_test, total_steps=total,
                              step_ratio=23500 / total, data_ratio=30000 / num_train, sgld_n=sgld_n,
                              ece_ratio=_ece_ratio(summary),
                              sgld_noise=math.sqrt(2 * cfg["lr"] / sgld_n),
                              laplace_n=our_options("laplace", num_train, cfg)["num_data"], cross_check=cross)
    lines = []
    for method in METHODS:
        s = summary.get(method, {})
        ours_pred = {"sgld": "ensemble", "laplace": "nn"}.get(method, "sampled")
        parts = []
        for side, pred in (("ours", ours_pred), ("theirs", "sampled")):
            r = s.get(side, {}).get(pred)
            if r:
                parts.append(f"{'ours' if side == 'ours' else 'BayesDLL'} error {r['0']['error'][0]:.2f} → "
                             f"{r['5']['error'][0]:.2f} %, all-class ECE {r['0']['ece_all'][0]:.3f} → "
                             f"{r['5']['ece_all'][0]:.3f} %, NLL {r['0']['nll'][0]:.3f} → {r['5']['nll'][0]:.3f}")
        failed = [f"seed {seed}: {r['theirs']['failed_at']} ({r['theirs']['error']})"
                  for seed, r in runs.get(method, {}).items() if "failed_at" in r.get("theirs", {})]
        if failed:
            parts.append("BayesDLL's code failed: " + "; ".join(failed))
        stds = {side: [r[side]["posterior_std"] for r in runs.get(method, {}).values()
                       if (r.get(side) or {}).get("posterior_std")] for side in SIDES}
        for side in SIDES:
            if stds[side]:
                parts.append(f"{'our' if side == 'ours' else 'BayesDLL'} posterior std after training: mean "
                             f"{np.mean([d['mean'] for d in stds[side]]):.3g}, median "
                             f"{np.mean([d['median'] for d in stds[side]]):.3g}, max "
                             f"{np.mean([d['max'] for d in stds[side]]):.3g}")
        secs = {side: [r[side]["seconds"] for r in runs.get(method, {}).values() if side in r] for side in SIDES}
        if secs["ours"]:
            parts.append("wall time per seed (training and evaluation, shared CPU) ours "
                         f"{np.mean(secs['ours']):.0f} s" + (f", BayesDLL {np.mean(secs['theirs']):.0f} s"
                                                            if secs["theirs"] else ""))
        ref = REFERENCE[method]
        parts.append(f"Table 2 error {ref['error'][0]:.2f} → {ref['error'][1]:.2f} %, ECE {ref['ece'][0]:.2f} → "
                     f"{ref['ece'][1]:.2f} %")
        lines.append(f"* **{method}** (nst 0 → 5): " + "; ".join(parts) + "."
                     + (_laplace_map_note(runs) if method == "laplace" else ""))
    return "\n".join(["Measured, mean over seeds (nst 0 → nst 5):", "", *lines, "",
                      "Where ours and theirs differ, and why:", "", text])


def regenerate_command(argv: list[str], fast: bool) -> str:
    """The command line that regenerates the committed file (the checkout path as ``$BAYESDLL_SRC``)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--out", "--bayesdll-src"):
            skip = True
            continue
        if a.startswith(("--out=", "--bayesdll-src=")):
            continue
        kept.append(a)
    src = ["--bayesdll-src", "$BAYESDLL_SRC"] if any(a.startswith("--bayesdll-src") for a in argv) else []
    out = ["--out", "/tmp/t2"] if fast else ["--out", "figures"]
    return " ".join(["OMP_NUM_THREADS=1", ".venv/bin/python", f"scripts/{STEM.removesuffix('_mnist5k')}.py",
                     *map(shlex.quote, kept), *src, *out])


def finite_or_null(obj):
    """``obj`` with every NaN or infinite float replaced by ``None`` (JSON has no NaN), recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite_or_null(v) for v in obj]
    return obj


def write_outputs(result: dict, out: Path) -> tuple[Path, Path]:
    """Writes the Markdown report and the JSON (every number), atomically."""
    cfg, sizes, bdl_info = result["settings"], result["sizes"], result["bayesdll"]
    md_path, json_path = out / f"{STEM}.md", out / f"{STEM}.json"
    if bdl_info.get("commit"):
        src = (f"BayesDLL's side ran its own code from a checkout of github.com/SamsungLabs/BayesDLL at commit "
               f"`{bdl_info['commit']}` (`BAYESDLL_SRC`: `git clone https://github.com/SamsungLabs/BayesDLL "
               f"\"$BAYESDLL_SRC\" && git -C \"$BAYESDLL_SRC\" checkout {bdl_info['commit']}`); on every method and "
               "seed its initial weights equalled ours (tensor equality) and it consumed the same batches in the "
               "same order (SHA-1 of every batch; digests in the JSON).")
    else:
        src = f"BayesDLL's own code was not run ({bdl_info.get('status', 'no --bayesdll-src')})."
    text = "\n".join([
        "# BayesDLL's Table 2 on mnist5k, beside BayesDLL's own code",
        "",
        ("**FAST MODE: smoke test, not a result.**\n" if cfg["fast"] else "")
        + f"Regenerate: `{result['command']}` ({result['runtime_seconds'] / 60:.1f} minutes on this 2-core CPU, "
        f"{result['torch_threads']} torch thread(s)).",
        "",
        "BayesDLL (Kim & Hospedales 2023, arXiv:2309.12928) Table 2: MNIST, MLP 784-1000-1000-1000-10, 100 epochs, "
        "SGD lr 1e-2, momentum 0.5, batch 128; test error and all-class ECE in percent at nst 0 (posterior mean) "
        f"and nst 5 (5 samples). **Epochs are scaled down from 100 to {cfg['epochs']}** and the training set is "
        f"mnist5k's {sizes['train']} images, to fit the CPU budget. {src}",
        "",
        "## Table 2, ours and BayesDLL's code on the same split, batches and initial weights",
        "",
        f"Mean ± std over {len(cfg['seeds'])} seed(s). nst 0 is the posterior mean (Laplace: the MAP), nst 5 "
        "averages 5 posterior samples. ECE and MCE in percent, 15 bins; all-class is BayesDLL's "
        "(`calibration.calc_bins`), top-label is Guo et al.'s.",
        "",
        results_table(result["summary"], result["runs"]),
        "",
        "## Settings",
        "",
        settings_table(cfg, sizes["train"], sizes["test"]),
        "",
        "## Discussion",
        "",
        discussion(result["summary"], result["runs"], cfg, sizes["train"], sizes["test"], bdl_info),
    ])
    write_text(md_path, text + "\n")
    write_json(json_path, finite_or_null(ex.jsonable(result)))
    return md_path, json_path

