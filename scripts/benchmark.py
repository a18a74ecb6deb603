"""Cost of bayeswrap's methods against plain PyTorch training (and optionally BayesDLL), in one process run.

Sections (each method is compared with a baseline measured in the same run, in
interleaved rounds to cancel drift; medians are reported):

1. ``step``: training-step time of plain training (the model itself, SGD with
   momentum) and of MAP, VI, VI with local reparameterisation (``vi_lrt``),
   IVON, MC-dropout and SGLD through bayeswrap, with ratios to plain training.
   Peak memory: CUDA max-allocated on GPU; on CPU the maximum resident set size
   of a fresh process per configuration. With ``--bayesdll-src`` BayesDLL's own
   VI, MC-dropout and SGLD steps on the same model and batch join the rounds.
2. ``curvature``: diagonal Laplace curvature throughput (examples/s) on several
   models: bayeswrap's empirical Fisher (every curvature backend the installed
   ``Laplace`` offers) against a naive per-example backward loop and BayesDLL's
   ``la`` ``Runner.estimate_variance``; bayeswrap's GGN is reported separately.
3. ``mlp_epoch``: one epoch over sklearn's digits with a 64-100-100-10 MLP:
   ``bw.fit`` (MAP, VI) against BayesDLL's ``vanilla`` and ``vi``
   ``Runner.train_one_epoch`` on the same loader.
4. ``predict``: ``predict(x, num_samples=S)`` of VI and the Laplace GLM
   predictive (``link_approx="mc"`` and ``"probit"``) against S plain forwards.
5. ``laplace`` (not in the default ``--sections``): bayeswrap's KFAC Laplace
   against laplace-torch (Daxberger et al. 2021) in the same process, on the
   same weights, data, N and prior precision: the last-layer KFAC fit and GLM
   probit predictive on timm models (and the predictive against one plain
   forward), and the all-weights KFAC fit on the digits MLP and a small CNN.
   Both sides' probit predictives and functional variances are compared.
   Without laplace-torch importable its columns are left out, with a note.

The Markdown has one table per section, with a target column and ``met``/``gap``
where a target is set. Writes ``<out>.json``, ``<out>.md`` and ``<out>.png``.

BayesDLL (Kim & Hospedales 2023) is never copied into this repository: its
``methods/*.py`` are imported at run time from the checkout given by
``--bayesdll-src``.

Example::

    python scripts/benchmark.py --models resnet50 --img-size 224 --batch-sizes 16 \\
        --bayesdll-src ../BayesDLL --out figures/benchmark_cpu_r50
    OMP_NUM_THREADS=1 python scripts/benchmark.py --sections laplace --out figures/benchmark_cpu_laplace
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import importlib.util
import inspect
import io
import json
import logging
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import timm
import torch
import torch.nn.functional as F

import bayeswrap as bw
from bayeswrap.app import experiments as ex
from bayeswrap.core.io import write_json, write_text

METHODS = ("plain", "map", "vi", "vi_lrt", "ivon", "mc_dropout", "sgld")
BAYESDLL_STEP_METHODS = ("vi", "mc_dropout", "sgld")
NUM_DATA = 10_000
NUM_CLASSES = 100
LR = 1e-4
PRIOR_STD = 1.0
DIGITS_CLASSES = 10

#: The targets of the issue: (section, item) -> (operator, bound, text).
STEP_TIME_TARGETS = {"map": 1.05, "vi": 1.10, "mc_dropout": 1.05, "sgld": 1.05}
VI_MEMORY_TARGET = 1.6  # on ViT-B/16
CURVATURE_TARGET = 3.0
GLM_TARGET = 3.0
PREDICT_S1_TARGET = 1.1
#: a 5-member ensemble epoch (members vmapped) over one MAP epoch on the digits MLP; a loop of 5 members is ~5x
ENSEMBLE_EPOCH_TARGET = 3.0
ENSEMBLE_MEMBERS = 5
#: laplace section: item -> (operator, bound) of bayeswrap's time over the reference's (laplace-torch, or a forward)
LAPLACE_TARGETS = {
    "last-layer KFAC fit / laplace-torch": ("<=", 2.0),
    "GLM probit / laplace-torch": ("<=", 2.0),
    "GLM probit / 1 forward": ("<=", 1.5),
    "all-weights KFAC fit / laplace-torch": ("<", 1.0),
}
LAPLACE_CLASSES = 10


# ---------------------------------------------------------------------------------------------- models and data
def digits_mlp() -> torch.nn.Module:
    """The 64-100-100-10 MLP for flattened 8×8 digits (classifier named ``head``)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict([
        ("fc1", torch.nn.Linear(64, 100)), ("act1", torch.nn.ReLU()),
        ("fc2", torch.nn.Linear(100, 100)), ("act2", torch.nn.ReLU()),
        ("head", torch.nn.Linear(100, DIGITS_CLASSES))]))


def make_model(name: str, img_size: int) -> torch.nn.Module:
    """A freshly initialised model: ``"mlp"`` (digits MLP) or a timm model with 100 classes.

    Args:
        name: ``"mlp"`` or a timm model name.
        img_size: input side (ViTs are built for it; ignored by the MLP).
    """
    if name == "mlp":
        return digits_mlp()
    kwargs = {"img_size": img_size} if "vit" in name else {}
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, **kwargs)


def classifier_name(model: torch.nn.Module) -> str:
    """The name of the classifier module (``"fc"`` for ResNets, ``"head"`` for ViTs and the MLP)."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    return cfg.get("classifier", "head")


def batch(name: str, batch_size: int, img_size: int, device: torch.device):
    """A fixed random batch: images (B, 3, H, W) with 100 classes, or digits-shaped (B, 64) with 10."""
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        x = torch.randn(batch_size, 64, generator=g)
        y = torch.randint(0, DIGITS_CLASSES, (batch_size,), generator=g)
    else:
        x = torch.randn(batch_size, 3, img_size, img_size, generator=g)
        y = torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)
    return x.to(device), y.to(device)


def digits_loader(num_train: int, batch_size: int):
    """A shuffling DataLoader over the first ``num_train`` of sklearn's 1,797 digits (pixels / 16)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:num_train]
    data = torch.utils.data.TensorDataset(torch.as_tensor(x, dtype=torch.float32)[perm] / 16.0,
                                          torch.as_tensor(y)[perm])
    return ex.shuffled_loader(data, batch_size, seed=0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def sgd(params, lr: float = LR):
    """The optimizer of plain training and of every SGD-trained method: fused SGD with momentum where supported."""
    try:
        return torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)


def interleaved(fns: dict, repeats: int, warmup: int, device: torch.device) -> tuple[dict, dict]:
    """Times each callable in ``fns`` once per round, for ``repeats`` rounds after ``warmup`` rounds.

    Returns:
        ``(wall, cpu)``: per name, the list of wall-clock and of process-CPU seconds.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync(device)
            tic, cpu_tic = time.perf_counter(), time.process_time()
            fn()
            sync(device)
            wall[k].append(time.perf_counter() - tic)
            cpu[k].append(time.process_time() - cpu_tic)
    return wall, cpu


def medians(times: dict) -> dict:
    return {k: statistics.median(v) for k, v in times.items()}


# ---------------------------------------------------------------------------------------------- BayesDLL
def load_bayesdll(path: str | None) -> SimpleNamespace | None:
    """Imports BayesDLL's ``methods/{vi,mc_dropout,sgld,la,vanilla}.py`` from a checkout at ``path``.

    The checkout goes on ``sys.path`` (the modules ``import calibration`` at top
    level); each method file is loaded under the name ``bayesdll_<method>``.

    Returns:
        ``None`` without a path, else a namespace with ``path``, ``commit``
        (``git rev-parse HEAD``, or ``"unknown"``) and ``modules`` (name -> module).

    Raises:
        FileNotFoundError: if ``path/methods`` does not exist.
    """
    if not path:
        return None
    root = Path(path).expanduser().resolve()
    if not (root / "methods").is_dir():
        raise FileNotFoundError(f"--bayesdll-src={path!r}: {root / 'methods'} does not exist; expected a "
                                "checkout of github.com/SamsungLabs/BayesDLL")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    modules = {}
    for name in ("vi", "mc_dropout", "sgld", "la", "vanilla"):
        spec = importlib.util.spec_from_file_location(f"bayesdll_{name}", root / "methods" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        with warnings.catch_warnings():  # their docstrings have invalid escape sequences ("\\p", "\\s")
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", SyntaxWarning)
            spec.loader.exec_module(module)
        modules[name] = module
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return SimpleNamespace(path=str(root), commit=commit or "unknown", modules=modules)


def bayesdll_args(method: str, device: torch.device, num_data: int, lr: float) -> SimpleNamespace:
    """The ``args`` fields BayesDLL's ``Runner`` reads, with our settings (prior std 1, SGD momentum 0.9, one lr).

    ``pretrained=None`` makes the prior mean zero (BayesDLL's from-scratch setting).
    """
    hparams = {"prior_sig": PRIOR_STD, "nst": 5, "kld": 1.0, "Ninflate": 1.0}
    hparams.update({
        "vi": {"bias": "informative"},
        "mc_dropout": {"bias": "gaussian", "p_drop": 0.1},
        "sgld": {"bias": "informative", "nd": 1.0, "burnin": 0, "thin": 1},
        "la": {"bias": "informative"},
        "vanilla": {"bias": "penalty", "wd": 1.0 / (num_data * PRIOR_STD**2)},  # = the N(0, 1) prior per datum
    }[method])
    return SimpleNamespace(ND=num_data, hparams=hparams, lr=lr, lr_head=lr, momentum=0.9, device=device,
                           pretrained=None)


def bayesdll_runner(bdl: SimpleNamespace, method: str, model: torch.nn.Module, device: torch.device,
                    num_data: int, lr: float):
    """BayesDLL's ``Runner`` of ``method`` around a copy of ``model`` (``readout_name`` set to its classifier)."""
    net = copy.deepcopy(model)
    net.readout_name = classifier_name(model)
    return bdl.modules[method].Runner(net, None, bayesdll_args(method, device, num_data, lr),
                                      logging.getLogger("bayesdll"))


def bayesdll_step(runner, method: str):
    """One step of BayesDLL's ``Runner.train_one_epoch`` loop body, calling their own code.

    The body is ``runner.model(...)`` (their ``Model.forward``: sampling θ into
    the workhorse net, forward, backward, prior/KL gradients written into
    ``.grad``) followed by ``runner.optimizer.step()``. The per-batch
    bookkeeping (train error, tqdm postfix) is left out; SGLD steps are burn-in
    steps (no sample collection).
    """
    if method == "sgld":
        def step(x, y):
            lrs = [group["lr"] for group in runner.optimizer.param_groups]
            runner.model(x, y, runner.net, runner.net0, runner.criterion, lrs, runner.Ninflate, runner.nd)
            runner.optimizer.step()
    elif method == "vanilla":
        def step(x, y):
            runner.model.forward(x, y, runner.net, runner.net0, runner.criterion, eval_grad=1)
            runner.optimizer.step()
    else:
        def step(x, y):
            runner.model(x, y, runner.net, runner.net0, runner.criterion, runner.kld, eval_grad=1)
            runner.optimizer.step()
    return step


@contextlib.contextmanager
def quiet_stderr():
    """Discards stderr (BayesDLL's loops always draw a tqdm bar; it is still drawn, into a buffer)."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


# ---------------------------------------------------------------------------------------------- 1. step
def make_step(model: torch.nn.Module, method: str, device: torch.device, amp: bool, bdl=None):
    """A closure ``step(x, y)`` running one training step of ``method`` on a copy of ``model``.

    Args:
        model: the model (not modified).
        method: ``"plain"`` (the model itself), a bayeswrap method of :data:`METHODS`,
            or ``"bayesdll_<vi|mc_dropout|sgld>"``.
        device: where to train.
        amp: bf16 autocast around the forward and loss.
        bdl: the loaded BayesDLL (needed for ``bayesdll_*``).
    """
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)
    if method.startswith("bayesdll_"):
        their = method.removeprefix("bayesdll_")
        one_step = bayesdll_step(bayesdll_runner(bdl, their, model, device, NUM_DATA, LR), their)

        def step(x, y):
            with autocast:
                one_step(x, y)
        return step
    if method == "plain":
        net = copy.deepcopy(model).to(device).train()
        opt = sgd(list(net.parameters()))

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
        return step
    kind, options = method, {}
    if method == "sgld":
        options = {"burn_in": 0, "thinning": 10}  # the default thinning, past burn-in: a draw every 10th step
    elif method == "vi_lrt":
        kind, options = "vi", {"local_reparam": True}
    bnn = bw.wrap(model, kind, num_data=NUM_DATA, prior_std=PRIOR_STD, **options).to(device).train()
    if method == "sgld":
        opt = bw.optim.SGLD(bnn.param_groups(), lr=LR, num_data=NUM_DATA)
    elif method == "ivon":
        opt = bw.optim.IVON(bnn.param_groups(), lr=LR)
    else:
        opt = sgd(list(bnn.parameters()))

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = bnn.loss(x, y).loss
        loss.backward()
        opt.step()
        bnn.after_step()
    return step


def step_methods(args) -> list[str]:
    """Our methods, then BayesDLL's counterparts of those of them BayesDLL has (with ``--bayesdll-src``)."""
    theirs = [f"bayesdll_{m}" for m in BAYESDLL_STEP_METHODS if m in args.methods] if args.bayesdll_src else []
    return list(args.methods) + theirs


def time_steps(args, name: str, device: torch.device, bdl=None) -> dict:
    """Interleaved medians of one training step per method on one model and batch.

    Returns:
        ``params``, ``seconds``/``cpu_seconds`` (medians per method), ``ratio``/``cpu_ratio``
        (to plain), ``all_seconds`` and, where both ran, ``ours_over_theirs``
        (bayeswrap time / BayesDLL time per method).
    """
    model = make_model(name, args.img_size)
    x, y = batch(name, args.batch_size, args.img_size, device)
    steps = {m: make_step(model, m, device, args.amp, bdl) for m in step_methods(args)}
    wall, cpu_times = interleaved({m: (lambda s=s: s(x, y)) for m, s in steps.items()},
                                  args.repeats, args.warmup, device)
    med, cpu = medians(wall), medians(cpu_times)
    out = {"params": sum(p.numel() for p in model.parameters()), "methods": list(steps),
           "seconds": med, "ratio": {m: med[m] / med["plain"] for m in med},
           "cpu_seconds": cpu, "cpu_ratio": {m: cpu[m] / cpu["plain"] for m in cpu},
           "all_seconds": wall}
    pairs = {m: f"bayesdll_{m}" for m in BAYESDLL_STEP_METHODS if f"bayesdll_{m}" in med}
    if pairs:
        out["ours_over_theirs"] = {m: med[m] / med[t] for m, t in pairs.items()}
        out["cpu_ours_over_theirs"] = {m: cpu[m] / cpu[t] for m, t in pairs.items()}
    return out


def peak_memory(args, name: str, method: str, device: torch.device, bdl=None) -> float:
    """Peak memory in MiB of a training step: CUDA max-allocated, or on CPU the resident-set high-water
    mark of a fresh child process during its second step (after resetting it; it includes the model,
    gradients, optimizer state and the ~torch runtime).
    """
    if device.type == "cuda":
        model = make_model(name, args.img_size)
        x, y = batch(name, args.batch_size, args.img_size, device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        step = make_step(model.to(device), method, device, args.amp, bdl)
        for _ in range(2):
            step(x, y)
        sync(device)
        peak = torch.cuda.max_memory_allocated() / 2**20
        del step, model
        return peak
    cmd = [sys.executable, __file__, "--child-memory", name, method, "--img-size", str(args.img_size),
           "--batch-size", str(args.batch_size)]
    if args.bayesdll_src:
        cmd += ["--bayesdll-src", args.bayesdll_src]
    if args.amp:
        cmd.append("--amp")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def child_memory(args) -> None:
    """Body of the ``--child-memory MODEL METHOD`` child process: prints its peak RSS (MiB) of a second step."""
    name, method = args.child_memory
    bdl = load_bayesdll(args.bayesdll_src) if method.startswith("bayesdll_") else None
    model = make_model(name, args.img_size)
    x, y = batch(name, args.batch_size, args.img_size, torch.device("cpu"))
    with quiet_stderr():
        step = make_step(model, method, torch.device("cpu"), args.amp, bdl)
    del model  # every step holds its own copy (bayeswrap: plus a storage-free skeleton)
    step(x, y)  # first step allocates gradients and optimizer state
    # reset the resident-set high-water mark (Linux): importing torch peaks higher than a small model's step
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    step(x, y)
    with open("/proc/self/status") as fh:
        hwm = next((int(line.split()[1]) for line in fh if line.startswith("VmHWM:")), None)
    print((hwm or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024)


def step_section(args, device: torch.device, bdl=None) -> dict:
    """Runs :func:`time_steps` (and :func:`peak_memory`) for every batch size and model."""
    results = {}
    for bs in [int(b) for b in args.batch_sizes.split(",") if b]:
        sub = copy.copy(args)
        sub.batch_size = bs
        for name in [m for m in args.models.split(",") if m]:
            key = f"{name} (batch {bs})"
            print(f"step: {key}", flush=True)
            r = time_steps(sub, name, device, bdl)
            r.update(model=name, batch_size=bs)
            if not args.no_memory and (not args.memory_models or name in args.memory_models.split(",")):
                r["peak_mib"] = {m: peak_memory(sub, name, m, device, bdl) for m in r["methods"]}
            results[key] = r
            print(json.dumps({k: r[k] for k in ("ratio", "ours_over_theirs", "peak_mib") if k in r}), flush=True)
    return results


# ---------------------------------------------------------------------------------------------- 2. curvature
def naive_fisher(model, x, y):
    """Diagonal empirical Fisher by the textbook loop: one backward pass per example."""
    sq = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for s, p in zip(sq, model.parameters()):
            s += p.grad**2
    return sq


@contextlib.contextmanager
def prior_dominated_ok():
    """Silences ``fit_curvature``'s "posterior variance is mostly the prior's" warning (expected here:
    untrained models, random data, one batch); other warnings still show.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="the Laplace posterior variance", category=RuntimeWarning)
        yield


def curvature_backends() -> list[str | None]:
    """The ``curvature_backend`` values of the installed ``Laplace`` (``[None]`` if it has no such option)."""
    if "curvature_backend" in inspect.signature(bw.Laplace.__init__).parameters:
        return ["layers", "vmap"]
    return [None]


def curvature(args, name: str, device: torch.device, bdl=None) -> dict:
    """Curvature throughput on one model: ours (empirical Fisher and GGN per backend), naive loop, BayesDLL ``la``.

    All run on the same eval-mode model and batch, interleaved. Speed-ups compare
    like with like: our empirical Fisher against the per-example-gradient loops
    (naive, BayesDLL); the GGN (K backward passes' worth of Jacobian rows per
    example) has its own ratio to the naive loop.
    """
    img = args.curvature_img_size
    model = make_model(name, img).to(device).eval()
    x, y = batch(name, args.curvature_examples, img, device)
    loader = [(x, y)]
    fns = {"naive_loop": lambda: naive_fisher(model, x, y)}
    for backend in curvature_backends():
        extra = {} if backend is None else {"curvature_backend": backend}
        suffix = backend or "default"
        for kind, label in (("empirical_fisher", "ef"), ("ggn", "ggn")):
            if label not in args.curvature_kinds:
                continue
            bnn = bw.wrap(model, "laplace", num_data=NUM_DATA, prior_std=PRIOR_STD, curvature=kind,
                          curvature_chunk_size=args.curvature_chunk, **extra).to(device)
            fns[f"bayeswrap_{label}_{suffix}"] = lambda bnn=bnn: bnn.fit_curvature(loader)
    if bdl is not None:
        runner = bayesdll_runner(bdl, "la", model, device, NUM_DATA, LR)

        def theirs():
            with quiet_stderr():
                runner.estimate_variance(loader)
        fns["bayesdll_la"] = theirs
    errors = {}
    with prior_dominated_ok():
        for k in list(fns):  # warm-up; a configuration that fails is reported, not fatal
            try:
                fns[k]()
            except Exception as error:  # noqa: BLE001 (any failure of one backend must not lose the run)
                errors[k] = f"{type(error).__name__}: {error}"
                del fns[k]
        wall, _ = interleaved(fns, args.curvature_repeats, 0, device)
    n = x.shape[0]
    eps = {k: n / t for k, t in medians(wall).items()}
    speedup = {}
    for k in eps:
        if k.startswith("bayeswrap_ef_"):
            speedup[f"{k}/naive_loop"] = eps[k] / eps["naive_loop"]
            if "bayesdll_la" in eps:
                speedup[f"{k}/bayesdll_la"] = eps[k] / eps["bayesdll_la"]
        elif k.startswith("bayeswrap_ggn_"):
            speedup[f"{k}/naive_loop"] = eps[k] / eps["naive_loop"]
    return {"model": name, "img_size": None if name == "mlp" else img, "examples": n, "chunk": args.curvature_chunk,
            "params": sum(p.numel() for p in model.parameters()), "examples_per_s": eps, "speedup": speedup,
            "errors": errors}


def curvature_section(args, device: torch.device, bdl=None) -> dict:
    """Runs :func:`curvature` for every model of ``--curvature-models``."""
    out = {}
    for name in [m for m in args.curvature_models.split(",") if m]:
        print(f"curvature: {name}", flush=True)
        out[name] = curvature(args, name, device, bdl)
        print(json.dumps(out[name]["speedup"]), flush=True)
    return out


# ---------------------------------------------------------------------------------------------- 3. small-MLP epoch
def mlp_epoch(args, device: torch.device, bdl=None) -> dict:
    """One epoch over the digits with the digits MLP: ``bw.fit`` against BayesDLL's ``train_one_epoch``.

    Ours: ``bw.fit(bnn, loader, epochs=1, optimizer=SGD(momentum 0.9), progress=False)``
    for MAP and VI. Theirs (with BayesDLL): ``Runner.train_one_epoch(loader)`` of
    ``vanilla`` and ``vi`` as shipped (it always draws a tqdm bar, here into a
    discarded buffer) and, for reference, their step body looped over the same
    loader without the bar (``*_no_bar``). Every configuration trains its own
    copy of the same initial MLP with the same lr; rounds are interleaved.
    """
    loader = digits_loader(args.epoch_train_size, args.epoch_batch_size)
    n = len(loader.dataset)
    model = digits_mlp()
    fns = {}
    for method in ("map", "vi"):
        bnn = bw.wrap(model, method, num_data=n, prior_std=PRIOR_STD).to(device)
        opt = sgd(list(bnn.parameters()), lr=args.epoch_lr)
        fns[f"bayeswrap_{method}"] = lambda bnn=bnn, opt=opt: bw.fit(bnn, loader, epochs=1, optimizer=opt,
                                                                      progress=False)
    for parallel in ("vmap", "sequential"):  # a deep ensemble: its members vmapped, and one after another
        bnn = bw.wrap(model, "ensemble", num_data=n, prior_std=PRIOR_STD, num_members=ENSEMBLE_MEMBERS,
                      parallel=parallel).to(device)
        opt = sgd(list(bnn.parameters()), lr=args.epoch_lr)
        fns[f"bayeswrap_ensemble{ENSEMBLE_MEMBERS}_{parallel}"] = \
            lambda bnn=bnn, opt=opt: bw.fit(bnn, loader, epochs=1, optimizer=opt, progress=False)
    if bdl is not None:
        for method in ("vanilla", "vi"):
            runner = bayesdll_runner(bdl, method, model, device, n, args.epoch_lr)
            step = bayesdll_step(runner, method)

            def epoch(runner=runner):
                with quiet_stderr():
                    runner.train_one_epoch(loader)

            def no_bar(runner=runner, step=step):
                runner.net.train()
                if isinstance(runner.model, torch.nn.Module):
                    runner.model.train()
                for x, y in loader:
                    step(x.to(device), y.to(device))
            fns[f"bayesdll_{method}"] = epoch
            fns[f"bayesdll_{method}_no_bar"] = no_bar
    wall, cpu = interleaved(fns, args.epoch_repeats, 1, device)
    med, cpu_med = medians(wall), medians(cpu)
    out = {"train_examples": n, "batch_size": args.epoch_batch_size, "batches": len(loader), "lr": args.epoch_lr,
           "seconds": med, "cpu_seconds": cpu_med,
           "ensemble_over_map": {p: med[f"bayeswrap_ensemble{ENSEMBLE_MEMBERS}_{p}"] / med["bayeswrap_map"]
                                 for p in ("vmap", "sequential")}}
    if bdl is not None:
        pairs = {"map/bayesdll_vanilla": ("bayeswrap_map", "bayesdll_vanilla"),
                 "vi/bayesdll_vi": ("bayeswrap_vi", "bayesdll_vi"),
                 "map/bayesdll_vanilla_no_bar": ("bayeswrap_map", "bayesdll_vanilla_no_bar"),
                 "vi/bayesdll_vi_no_bar": ("bayeswrap_vi", "bayesdll_vi_no_bar")}
        out["ours_over_theirs"] = {k: med[a] / med[b] for k, (a, b) in pairs.items()}
        out["cpu_ours_over_theirs"] = {k: cpu_med[a] / cpu_med[b] for k, (a, b) in pairs.items()}
    return out


# ---------------------------------------------------------------------------------------------- 4. predict
def predictive(args, name: str, device: torch.device) -> dict:
    """``predict(x, S)`` of VI and of the Laplace GLM (MC and probit links) against S plain forwards.

    The Laplace curvature is fitted once on the batch (outside the timing). The
    probit GLM predictive does not depend on S; it is timed in every S round and
    compared with that round's S forwards.
    """
    model = make_model(name, args.img_size).to(device).eval()
    x, y = batch(name, args.batch_size, args.img_size, device)
    vi = bw.wrap(model, "vi", num_data=NUM_DATA, init_std=1e-3).to(device).eval()
    laplace = bw.wrap(model, "laplace", num_data=NUM_DATA, prior_std=PRIOR_STD).to(device).eval()
    with prior_dominated_ok():
        laplace.fit_curvature([(x, y)])
    out = {}
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
        for s in args.num_samples:
            def forwards(s=s):
                for _ in range(s):
                    model(x).softmax(-1)
            fns = {"vi": lambda s=s: vi.predict(x, num_samples=s)}
            for link in args.glm_links:
                fns[f"glm_{link}"] = lambda s=s, link=link: laplace.predict(x, num_samples=s, pred_type="glm",
                                                                            link_approx=link)
            fns["plain_forwards"] = forwards
            wall, _ = interleaved(fns, args.repeats, 1, device)
            med = medians(wall)
            out[str(s)] = {"seconds": med,
                           "ratio": {k: med[k] / med["plain_forwards"] for k in med if k != "plain_forwards"}}
    return out


# ---------------------------------------------------------------------------------------------- 5. laplace
def small_cnn() -> torch.nn.Module:
    """Two 3×3 convolutions (16 and 32 channels), each followed by ReLU and 2×2 max-pooling, and a Linear head:
    3×32×32 images to 10 classes (25,578 parameters).
    """
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict([
        ("conv1", torch.nn.Conv2d(3, 16, 3, padding=1)), ("act1", torch.nn.ReLU()), ("pool1", torch.nn.MaxPool2d(2)),
        ("conv2", torch.nn.Conv2d(16, 32, 3, padding=1)), ("act2", torch.nn.ReLU()), ("pool2", torch.nn.MaxPool2d(2)),
        ("flatten", torch.nn.Flatten()), ("head", torch.nn.Linear(32 * 8 * 8, LAPLACE_CLASSES))]))


def load_laplace_torch() -> SimpleNamespace | None:
    """laplace-torch's ``Laplace`` factory and installed version, or ``None`` when it is not importable."""
    try:
        with warnings.catch_warnings():  # its import trips torch's torch.jit.script deprecation warning
            warnings.simplefilter("ignore", FutureWarning)
            from laplace import Laplace as laplace_torch
    except ImportError:
        return None
    try:
        version = importlib.metadata.version("laplace-torch")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return SimpleNamespace(Laplace=laplace_torch, version=version)


def source_state() -> dict:
    """The repository's commit and the files under ``bayeswrap/`` with uncommitted changes (what was measured)."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "bayeswrap"],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "modified": []}
    return {"commit": commit or "unknown", "modified": sorted(line[3:] for line in status.splitlines() if line)}


def image_data(count: int, size: int, seed: int) -> torch.utils.data.TensorDataset:
    """``count`` random images (3, size, size) with random labels of :data:`LAPLACE_CLASSES` classes."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(count, 3, size, size, generator=g),
                                          torch.randint(0, LAPLACE_CLASSES, (count,), generator=g))


def digits_data(start: int, count: int) -> torch.utils.data.TensorDataset:
    """The digits ``start:start + count`` of sklearn's 1,797 in a fixed shuffled order (pixels / 16), for the MLP."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[start:start + count]
    if len(perm) < count:
        raise ValueError(f"digits has {len(x)} examples; {start} + {count} were asked for")
    return torch.utils.data.TensorDataset(torch.as_tensor(x, dtype=torch.float32)[perm] / 16.0,
                                          torch.as_tensor(y)[perm])


def probit_agreement(p_ours: torch.Tensor, p_theirs: torch.Tensor, p_map: torch.Tensor, var_ours: torch.Tensor,
                     var_theirs: torch.Tensor) -> dict:
    """How closely two GLM probit predictives agree, and how far they are from the MAP (the effect being compared).

    Args:
        p_ours, p_theirs: probit predictive probabilities (B, K) of the two implementations.
        p_map: the MAP's softmax (B, K) at the same weights.
        var_ours, var_theirs: the functional variances diag(J P⁻¹ Jᵀ), (B, K) each.

    Returns:
        ``probit_max_abs_diff`` (max |p_ours − p_theirs|), ``probit_vs_map_max_abs_diff``
        (max |p_ours − p_map|), ``f_var_max_rel_diff`` (max |var_ours − var_theirs| / max |var_theirs|)
        and ``f_var_median`` (median of var_theirs).
    """
    p_ours, p_theirs, p_map = (t.detach().double() for t in (p_ours, p_theirs, p_map))
    var_ours, var_theirs = var_ours.detach().double(), var_theirs.detach().double()
    scale = float(var_theirs.abs().max())
    return {"probit_max_abs_diff": float((p_ours - p_theirs).abs().max()),
            "probit_vs_map_max_abs_diff": float((p_ours - p_map).abs().max()),
            "f_var_max_rel_diff": float((var_ours - var_theirs).abs().max()) / scale if scale > 0 else 0.0,
            "f_var_median": float(var_theirs.median())}


@contextlib.contextmanager
def laplace_quiet():
    """Silences the expected warnings of the laplace section: bayeswrap's prior-dominated posterior (untrained
    models, random data) and laplace-torch's notices; other warnings still show.
    """
    with prior_dominated_ok(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"laplace(\.|$)")
        warnings.filterwarnings("ignore", module=r"curvlinops(\.|$)")
        yield


def laplace_compare(model: torch.nn.Module, train, test_x: torch.Tensor, subset: str, args, device: torch.device,
                    lt: SimpleNamespace | None, forward: bool) -> dict:
    """Times ours against laplace-torch's KFAC fit and GLM probit predictive on one model, and compares them.

    Ours: ``bw.wrap(model, "laplace", num_data=N, prior_std=1, hessian_structure="kron",
    subset_of_weights=subset)`` then ``fit_curvature(loader)`` and ``predict(x, pred_type="glm",
    link_approx="probit")``. Theirs: ``Laplace(copy, "classification", subset_of_weights=subset,
    hessian_structure="kron")`` (its default backend and prior precision 1) then ``fit(loader)`` and
    ``la(x, pred_type="glm", link_approx="probit")``. Both read the same unshuffled loader over ``train`` (N
    examples), on the same eval-mode weights; fits and predictives run in interleaved rounds (one warm-up).

    Args:
        model: the eval-mode model (not modified; laplace-torch gets a deep copy).
        train: the training dataset.
        test_x: the predictive's inputs.
        subset: ``"last_layer"`` or ``"all"``.
        args: the parsed arguments (``laplace_batch_size``, ``laplace_repeats``).
        device: where to run.
        lt: :func:`load_laplace_torch`'s result, or ``None`` (ours only).
        forward: also time one plain forward (``model(x).softmax(-1)`` under no_grad).

    Returns:
        ``params``, ``bayesian_params``, ``train_examples``, ``batch_size``, ``test_examples``, ``seconds`` and
        ``cpu_seconds`` (medians), ``ratio`` (``fit_vs_laplace_torch``, ``predict_vs_laplace_torch``,
        ``predict_vs_forward`` where measured) and, with laplace-torch, ``backend`` and ``agreement``
        (:func:`probit_agreement`).
    """
    loader = torch.utils.data.DataLoader(train, batch_size=args.laplace_batch_size, shuffle=False)
    x = test_x.to(device)
    ours = bw.wrap(model, "laplace", num_data=len(train), prior_std=PRIOR_STD, hessian_structure="kron",
                   subset_of_weights=subset).to(device)
    fits = {"bayeswrap": lambda: ours.fit_curvature(loader)}
    predicts = {"bayeswrap": lambda: ours.predict(x, pred_type="glm", link_approx="probit")}
    theirs = None
    if lt is not None:
        theirs = lt.Laplace(copy.deepcopy(model), "classification", subset_of_weights=subset,
                            hessian_structure="kron")
        fits["laplace_torch"] = lambda: theirs.fit(loader)
        predicts["laplace_torch"] = lambda: theirs(x, pred_type="glm", link_approx="probit")
    if forward:
        def plain():
            with torch.no_grad():
                model(x).softmax(-1)
        predicts["forward"] = plain
    with laplace_quiet():
        fit_wall, fit_cpu = interleaved(fits, args.laplace_repeats, 1, device)
        pred_wall, pred_cpu = interleaved(predicts, args.laplace_repeats, 1, device)
    fit_med, pred_med = medians(fit_wall), medians(pred_wall)
    seconds = {**{f"fit_{k}": v for k, v in fit_med.items()}, **{f"predict_{k}": v for k, v in pred_med.items()}}
    cpu = {**{f"fit_{k}": v for k, v in medians(fit_cpu).items()},
           **{f"predict_{k}": v for k, v in medians(pred_cpu).items()}}
    ratio = {}
    if theirs is not None:
        ratio["fit_vs_laplace_torch"] = fit_med["bayeswrap"] / fit_med["laplace_torch"]
        ratio["predict_vs_laplace_torch"] = pred_med["bayeswrap"] / pred_med["laplace_torch"]
    if forward:
        ratio["predict_vs_forward"] = pred_med["bayeswrap"] / pred_med["forward"]
    out = {"params": sum(p.numel() for p in model.parameters()),
           "bayesian_params": sum(t.numel() for t in ours.theta.values()),
           "train_examples": len(train), "batch_size": args.laplace_batch_size, "test_examples": x.shape[0],
           "seconds": seconds, "cpu_seconds": cpu, "ratio": ratio}
    if theirs is not None:
        with laplace_quiet():
            f_mu, var_ours = ours.functional_moments(x)
            _, var_theirs = theirs._glm_predictive_distribution(x)  # (B, K, K); the probit link uses its diagonal
            out["agreement"] = probit_agreement(
                ours.predict(x, pred_type="glm", link_approx="probit"),
                theirs(x, pred_type="glm", link_approx="probit"), f_mu.softmax(-1), var_ours,
                torch.diagonal(var_theirs, dim1=-2, dim2=-1))
        out["backend"] = theirs._backend_cls.__name__
    return out


def laplace_section(args, device: torch.device) -> dict:
    """KFAC Laplace, bayeswrap against laplace-torch: last layer on timm models, all weights on small models.

    Last layer (``--laplace-models``): timm models with 10 classes (ViTs built for ``--laplace-img-size``),
    ``--laplace-train`` random images of 3 × size × size with random labels, the predictive on
    ``--laplace-test`` more. All weights (``--laplace-kron-models``): ``mlp`` (the digits MLP on the first
    ``--laplace-kron-train`` of sklearn's digits in a fixed shuffled order, the predictive on the next
    ``--laplace-test``) and ``cnn`` (:func:`small_cnn` on random 3×32×32 images). Untrained weights
    throughout: these are cost measurements, with the agreement of the two implementations as a check.
    """
    lt = load_laplace_torch()
    out = {"laplace_torch": {"version": lt.version} if lt else None, "source": source_state(),
           "repeats": args.laplace_repeats, "last_layer": {}, "all_weights": {}}
    size = args.laplace_img_size
    train = image_data(args.laplace_train, size, seed=0)
    test_x = image_data(args.laplace_test, size, seed=1).tensors[0]
    for name in [m for m in args.laplace_models.split(",") if m]:
        print(f"laplace last layer: {name}", flush=True)
        torch.manual_seed(0)
        kwargs = {"img_size": size} if "vit" in name else {}
        model = timm.create_model(name, pretrained=False, num_classes=LAPLACE_CLASSES, **kwargs).to(device).eval()
        r = laplace_compare(model, train, test_x, "last_layer", args, device, lt, forward=True)
        r.update(model=name, img_size=size)
        out["last_layer"][name] = r
        print(json.dumps({k: r[k] for k in ("ratio", "agreement") if k in r}), flush=True)
    for name in [m for m in args.laplace_kron_models.split(",") if m]:
        print(f"laplace all weights: {name}", flush=True)
        if name == "mlp":
            model, data = digits_mlp(), digits_data(0, args.laplace_kron_train)
            test_x = digits_data(args.laplace_kron_train, args.laplace_test).tensors[0]
            inputs = "digits, 64 features"
        elif name == "cnn":
            model, data = small_cnn(), image_data(args.laplace_kron_train, 32, seed=0)
            test_x = image_data(args.laplace_test, 32, seed=1).tensors[0]
            inputs = "random 3x32x32 images"
        else:
            raise ValueError(f"--laplace-kron-models: unknown {name!r}; accepted: mlp, cnn")
        kron_args = copy.copy(args)
        kron_args.laplace_batch_size = args.laplace_kron_batch_size
        r = laplace_compare(model.to(device).eval(), data, test_x, "all", kron_args, device, lt, forward=False)
        r.update(model=name, inputs=inputs)
        out["all_weights"][name] = r
        print(json.dumps({k: r[k] for k in ("ratio", "agreement") if k in r}), flush=True)
    backends = {r["backend"] for part in ("last_layer", "all_weights") for r in out[part].values() if "backend" in r}
    if lt is not None:
        out["laplace_torch"]["backend"] = ", ".join(sorted(backends)) or "unknown"
    return out


# ---------------------------------------------------------------------------------------------- targets
def check(value: float, op: str, bound: float) -> dict:
    """One target: ``value op bound`` (``op`` is ``"<="``, ``">="`` or ``"<"``)."""
    met = {"<=": value <= bound, ">=": value >= bound, "<": value < bound}[op]
    sign = {"<=": "≤", ">=": "≥", "<": "<"}[op]
    return {"value": value, "op": op, "bound": bound, "target": f"{sign} {bound:g}x", "met": bool(met)}


def evaluate_targets(result: dict) -> list[dict]:
    """Checks every target the issue sets against the measured numbers.

    Returns:
        One dict per check: ``section``, ``key`` (model/row), ``item``, ``value``,
        ``op``, ``bound``, ``target`` (text) and ``met`` (bool).
    """
    checks = []

    def add(section, key, item, value, op, bound):
        checks.append({"section": section, "key": key, "item": item, **check(value, op, bound)})

    for key, r in result.get("step", {}).items():
        for m, bound in STEP_TIME_TARGETS.items():
            if m in r["ratio"]:
                add("step", key, f"{m} time / plain", r["ratio"][m], "<=", bound)
        if "vi" in r.get("ours_over_theirs", {}):
            add("step", key, "vi time / bayesdll_vi", r["ours_over_theirs"]["vi"], "<=", 1.0)
        if "vit_base_patch16" in r["model"] and "vi" in r.get("peak_mib", {}):
            add("step", key, "vi memory / plain", r["peak_mib"]["vi"] / r["peak_mib"]["plain"], "<=",
                VI_MEMORY_TARGET)
    for name, c in result.get("curvature", {}).items():
        for k, v in c["speedup"].items():
            if k.startswith("bayeswrap_ef_"):
                add("curvature", name, f"speed-up {k}", v, ">=", CURVATURE_TARGET)
    epoch = result.get("mlp_epoch", {})
    for k in ("map/bayesdll_vanilla", "vi/bayesdll_vi"):
        if k in epoch.get("ours_over_theirs", {}):
            add("mlp_epoch", "digits MLP", f"epoch time {k}", epoch["ours_over_theirs"][k], "<=", 1.0)
    if "ensemble_over_map" in epoch:
        add("mlp_epoch", "digits MLP", f"ensemble{ENSEMBLE_MEMBERS} (vmap) / map epoch",
            epoch["ensemble_over_map"]["vmap"], "<=", ENSEMBLE_EPOCH_TARGET)
    for name, per_s in result.get("predict", {}).items():
        for s, r in per_s.items():
            if s == "1":
                add("predict", f"{name} S=1", "vi predict / 1 forward", r["ratio"]["vi"], "<=", PREDICT_S1_TARGET)
            for link in [k for k in r["ratio"] if k.startswith("glm_")]:
                add("predict", f"{name} S={s}", f"{link} / {s} forwards", r["ratio"][link], "<=", GLM_TARGET)
    lap = result.get("laplace") or {}
    for part, items in (("last_layer", (("last-layer KFAC fit / laplace-torch", "fit_vs_laplace_torch"),
                                        ("GLM probit / laplace-torch", "predict_vs_laplace_torch"),
                                        ("GLM probit / 1 forward", "predict_vs_forward"))),
                        ("all_weights", (("all-weights KFAC fit / laplace-torch", "fit_vs_laplace_torch"),))):
        for name, r in lap.get(part, {}).items():
            for item, key in items:
                if key in r["ratio"]:
                    add("laplace", name, item, r["ratio"][key], *LAPLACE_TARGETS[item])
    return checks


def status(checks: list[dict]) -> tuple[str, str]:
    """The target and status cells for a list of checks (``met``/``gap`` each, joined by ``; ``)."""
    if not checks:
        return "—", "—"
    return ("; ".join(c["target"] for c in checks),
            "; ".join("met" if c["met"] else f"gap ({c['value']:.2f}x)" for c in checks))


# ---------------------------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    """The Markdown report: one table per section, with target and status columns."""
    cfg = result["config"]
    checks = result.get("targets", [])

    def find(section, key, prefix):
        return [c for c in checks if c["section"] == section and c["key"] == key and c["item"].startswith(prefix)]

    device_is_cpu = result["device"].startswith("CPU")
    lines = [f"Regenerate: `{result['command']}`", ""] if result.get("command") else []
    lines.append(f"# bayeswrap benchmark ({result['device']})")
    if any(result.get(k) for k in ("step", "curvature", "mlp_epoch", "predict")):  # their shared settings
        lines += ["", f"input {cfg['img_size']}x{cfg['img_size']}, amp={cfg['amp']}, medians of {cfg['repeats']} "
                  f"interleaved rounds; torch {result['torch']}; optimizer: SGD with momentum 0.9, lr {LR:g} (fused "
                  "kernel where supported) for plain training and every SGD-trained method (SGLD: bw.optim.SGLD, "
                  "IVON: bw.optim.IVON).",
                  "Time ratios are wall-clock; on CPU the ratio of process CPU time is given too (robust to other "
                  "load). Peak memory: CUDA max allocated, or on CPU the max RSS of a fresh process per "
                  "configuration.", ""]
    if result.get("bayesdll"):
        b = result["bayesdll"]
        lines += ([""] if lines[-1] else []) + [f"BayesDLL: `{b['path']}` (commit {b['commit']}), imported at run time. Its step is the body of "
                  "its own `Runner.train_one_epoch` loop: `runner.model(...)` (their `Model.forward`: sampling into "
                  "the workhorse net, forward, backward, prior/KL gradients) then `runner.optimizer.step()` (their "
                  "torch SGD, momentum 0.9, the same lr), on the same model weights and batch, in the same rounds; "
                  "per-batch bookkeeping (train error, tqdm) excluded; SGLD: burn-in steps (bayeswrap's SGLD is "
                  "past burn-in and keeps a draw every 10th step, its default thinning).", ""]
    if result.get("step"):
        lines += ["## Training step: time and peak memory (ratios to plain)", "",
                  "| model | params (M) | method | step | ratio | " + ("CPU-time ratio | " if device_is_cpu else "")
                  + "peak memory | target | status |",
                  "|---|---|---|---|---|" + ("---|" if device_is_cpu else "") + "---|---|---|"]
        for key, r in result["step"].items():
            for m in r["methods"]:
                mem = r.get("peak_mib", {}).get(m)
                mem_txt = f"{mem:.0f} MiB ({mem / r['peak_mib']['plain']:.2f}x)" if mem else "—"
                cpu_txt = f"{r['cpu_ratio'][m]:.2f}x | " if device_is_cpu else ""
                target, stat = status(find("step", key, f"{m} "))
                lines.append(f"| {key} | {r['params'] / 1e6:.2f} | {m} | {r['seconds'][m] * 1e3:.1f} ms | "
                             f"{r['ratio'][m]:.2f}x | {cpu_txt}{mem_txt} | {target} | {stat} |")
        rows = [(key, m, v, r["cpu_ours_over_theirs"][m]) for key, r in result["step"].items()
                for m, v in r.get("ours_over_theirs", {}).items()]
        if rows:
            lines += ["", "### bayeswrap / BayesDLL step time", "",
                      "| model | comparison | wall ratio | CPU-time ratio | target | status |",
                      "|---|---|---|---|---|---|"]
            names = {"vi": "VI", "mc_dropout": "MC-dropout", "sgld": "SGLD"}
            for key, m, v, c in rows:
                target, stat = status(find("step", key, f"{m} time / bayesdll"))
                lines.append(f"| {key} | bayeswrap {names[m]} / BayesDLL {names[m]} | {v:.2f}x | {c:.2f}x | "
                             f"{target} | {stat} |")
    if result.get("curvature"):
        theirs = result.get("bayesdll") is not None
        loops = "the naive loop and BayesDLL's `la` `Runner.estimate_variance` (its own code, driven with a " \
                "one-batch loader)" if theirs else "the naive loop"
        backends = ", ".join(b or "default" for b in result["curvature_backends"])
        lines += ["", "## Laplace curvature (examples/s, eval mode, one batch)", "",
                  "Like with like: bayeswrap's empirical Fisher (`curvature=\"empirical_fisher\"`) against loops of "
                  f"one backward pass per example ({loops}). bayeswrap's GGN (exact diagonal GGN, K Jacobian rows "
                  "per example) is a different quantity, shown with its ratio to the naive loop and no target. "
                  f"bayeswrap curvature backends: {backends} (`bayeswrap_<ef|ggn>_<backend>`).", "",
                  "| model | params (M) | examples | curvature | examples/s | speed-up vs naive loop | "
                  + ("speed-up vs BayesDLL la | " if theirs else "") + "target | status |",
                  "|---|---|---|---|---|---|" + ("---|" if theirs else "") + "---|---|"]
        for name, c in result["curvature"].items():
            eps = c["examples_per_s"]
            label = name if c["img_size"] is None else f"{name} ({c['img_size']}²)"
            for k, v in eps.items():
                vs_naive = c["speedup"].get(f"{k}/naive_loop")
                vs_theirs = c["speedup"].get(f"{k}/bayesdll_la")
                target, stat = status(find("curvature", name, f"speed-up {k}/"))
                theirs_txt = (f"{vs_theirs:.2f}x | " if vs_theirs else "— | ") if theirs else ""
                lines.append(f"| {label} | {c['params'] / 1e6:.2f} | {c['examples']} | {k} | {v:.1f} | "
                             f"{f'{vs_naive:.2f}x' if vs_naive else '—'} | {theirs_txt}{target} | {stat} |")
            for k, error in c.get("errors", {}).items():
                lines.append(f"| {label} | {c['params'] / 1e6:.2f} | {c['examples']} | {k} | failed: "
                             f"{error.splitlines()[0][:120]} | — | " + ("— | " if theirs else "") + "— | — |")
    if result.get("mlp_epoch"):
        e = result["mlp_epoch"]
        ours_theirs = e.get("ours_over_theirs", {})
        lines += ["", f"## Small-MLP epoch (digits, {e['train_examples']} examples, batch {e['batch_size']}, "
                      f"{e['batches']} steps; 64-100-100-10 MLP)", "",
                  "bayeswrap: `bw.fit(bnn, loader, epochs=1, optimizer=SGD(momentum=0.9), progress=False)`."
                  + (" BayesDLL: its `Runner.train_one_epoch(loader)` as shipped (always draws a tqdm bar, here into "
                     "a discarded buffer); `*_no_bar`: its step body looped over the same loader, for reference."
                     if ours_theirs else " The target (ours ≤ BayesDLL's) needs `--bayesdll-src`."), ""]
        if ours_theirs:
            lines += ["| configuration | epoch | CPU time | ours / theirs (wall) | ours / theirs (CPU time) | target | "
                      "status |", "|---|---|---|---|---|---|---|"]
        else:
            lines += ["| configuration | epoch | CPU time |", "|---|---|---|"]
        for k, v in e["seconds"].items():
            row = f"| {k} | {v * 1e3:.1f} ms | {e['cpu_seconds'][k] * 1e3:.1f} ms |"
            if ours_theirs:
                ratio, cpu_ratio, target, stat = "—", "—", "—", "—"
                for pair, r in ours_theirs.items():
                    if pair.endswith("/" + k):
                        ratio = f"{r:.2f}x ({pair})"
                        cpu_ratio = f"{e['cpu_ours_over_theirs'][pair]:.2f}x"
                        target, stat = status(find("mlp_epoch", "digits MLP", f"epoch time {pair}"))
                row += f" {ratio} | {cpu_ratio} | {target} | {stat} |"
            lines.append(row)
        if "ensemble_over_map" in e:
            r = e["ensemble_over_map"]
            target, stat = status(find("mlp_epoch", "digits MLP", f"ensemble{ENSEMBLE_MEMBERS} (vmap)"))
            lines += ["", f"A {ENSEMBLE_MEMBERS}-member deep ensemble (`bw.wrap(model, \"ensemble\")`, the same `bw.fit` "
                      f"call) costs {r['vmap']:.2f}x one MAP epoch with its members vmapped and {r['sequential']:.2f}x "
                      f"with them one after another (target {target}: {stat})."]
    if result.get("predict"):
        lines += ["", "## Posterior predictive: predict(x, S) vs S plain forwards", "",
                  "VI: `predict(x, num_samples=S)`; Laplace GLM: `predict(x, num_samples=S, pred_type=\"glm\", "
                  "link_approx=\"mc\" | \"probit\")` after `fit_curvature` on the batch (probit does not depend "
                  "on S).", "",
                  "| model | S | predictive | time | S forwards | ratio | target | status |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, per_s in result["predict"].items():
            for s, r in per_s.items():
                for k, ratio in r["ratio"].items():
                    item = {"vi": "vi predict /", "glm_mc": "glm_mc /", "glm_probit": "glm_probit /"}[k]
                    target, stat = status(find("predict", f"{name} S={s}", item))
                    lines.append(f"| {name} | {s} | {k} | {r['seconds'][k] * 1e3:.1f} ms | "
                                 f"{r['seconds']['plain_forwards'] * 1e3:.1f} ms | {ratio:.2f}x | {target} | {stat} |")
    if result.get("laplace"):
        lines += laplace_markdown(result["laplace"], result["torch"], find)
    if checks:
        met = sum(c["met"] for c in checks)
        lines += ["", f"Targets: {met} of {len(checks)} met."]
    return "\n".join(lines) + "\n"


def laplace_markdown(lap: dict, torch_version: str, find) -> list[str]:
    """The laplace section's tables: times with ratios and targets, then the agreement of the two predictives."""
    lt = lap["laplace_torch"]
    src = lap["source"]
    modified = (f" with uncommitted changes in {', '.join(f'`{m}`' for m in src['modified'])}"
                if src["modified"] else "")
    lines = ["", "## Laplace: bayeswrap against laplace-torch (KFAC, eval mode, prior precision 1)", "",
             f"torch {torch_version}; bayeswrap at commit {src['commit']}{modified}. "
             + (f"laplace-torch {lt['version']} in the same process, its default backend ({lt['backend']}; exact "
                "GGN KFAC), on a deep copy of the same weights, the same unshuffled loader and N. "
                if lt else "laplace-torch is not importable here: its columns are left out and the targets against "
                           "it are not evaluated. ")
             + "Ours: `bw.wrap(model, \"laplace\", num_data=N, prior_std=1.0, hessian_structure=\"kron\", "
               "subset_of_weights=...)`, `bnn.fit_curvature(loader)`, `bnn.predict(x, pred_type=\"glm\", "
               "link_approx=\"probit\")`. Theirs: `Laplace(model, \"classification\", subset_of_weights=..., "
               "hessian_structure=\"kron\")`, `la.fit(loader)`, `la(x, pred_type=\"glm\", "
               "link_approx=\"probit\")`. The forward is `model(x).softmax(-1)` under `torch.no_grad()`. "
               "Untrained weights and random images with random labels (the MLP: sklearn's digits); medians of "
               f"{lap['repeats']} interleaved rounds after one warm-up; ratios are bayeswrap's time over the "
               "reference's (wall-clock, and process CPU time, which other load on the machine affects less).", "",
             "| model | Bayesian params | data | operation | bayeswrap | reference | ratio | CPU-time ratio | target "
             "| status |", "|---|---|---|---|---|---|---|---|---|---|"]
    rows = (("last_layer", "last-layer KFAC fit", "fit", "laplace_torch", "fit_vs_laplace_torch",
             "last-layer KFAC fit / laplace-torch"),
            ("last_layer", "GLM probit predictive", "predict", "laplace_torch", "predict_vs_laplace_torch",
             "GLM probit / laplace-torch"),
            ("last_layer", "GLM probit predictive", "predict", "forward", "predict_vs_forward",
             "GLM probit / 1 forward"),
            ("all_weights", "all-weights KFAC fit", "fit", "laplace_torch", "fit_vs_laplace_torch",
             "all-weights KFAC fit / laplace-torch"),
            ("all_weights", "all-weights GLM probit predictive", "predict", "laplace_torch",
             "predict_vs_laplace_torch", None))
    names = {"laplace_torch": "laplace-torch", "forward": "1 forward"}
    for part in ("last_layer", "all_weights"):
        for name, r in lap[part].items():
            label = f"{name} ({r['img_size']}²)" if part == "last_layer" else name
            for row_part, op_text, op, ref, key, item in rows:
                if row_part != part:
                    continue
                data = (f"{r['train_examples']} train (batch {r['batch_size']})" if op == "fit"
                        else f"{r['test_examples']} test")
                ours = r["seconds"][f"{op}_bayeswrap"]
                if key in r["ratio"]:
                    theirs = r["seconds"][f"{op}_{ref}"]
                    cpu_ratio = r["cpu_seconds"][f"{op}_bayeswrap"] / r["cpu_seconds"][f"{op}_{ref}"]
                    target, stat = status(find("laplace", name, item)) if item else ("—", "—")
                    lines.append(f"| {label} | {r['bayesian_params']:,} | {data} | {op_text} | {ours * 1e3:.1f} ms | "
                                 f"{names[ref]} {theirs * 1e3:.1f} ms | {r['ratio'][key]:.2f}x | {cpu_ratio:.2f}x | "
                                 f"{target} | {stat} |")
                else:
                    lines.append(f"| {label} | {r['bayesian_params']:,} | {data} | {op_text} | {ours * 1e3:.1f} ms | "
                                 f"{names[ref]}: not measured | — | — | — | — |")
    agreeing = [(part, name, r["agreement"]) for part in ("last_layer", "all_weights")
                for name, r in lap[part].items() if "agreement" in r]
    if agreeing:
        lines += ["", "### Do both compute the same predictive?", "",
                  "On the test inputs, at the same weights and prior precision: the largest difference between "
                  "the two probit predictives' probabilities, next to the largest difference between the probit "
                  "predictive and the MAP's softmax (the size of the effect compared), and the largest difference "
                  "of the functional variances diag(J P⁻¹ Jᵀ), relative to laplace-torch's largest.", "",
                  "| model | subset | max abs diff, probit ours vs theirs | max abs diff, probit vs MAP | "
                  "max rel. diff of the functional variance | median functional variance |",
                  "|---|---|---|---|---|---|"]
        for part, name, a in agreeing:
            lines.append(f"| {name} | {part.replace('_', ' ')} | {a['probit_max_abs_diff']:.2e} | "
                         f"{a['probit_vs_map_max_abs_diff']:.2e} | {a['f_var_max_rel_diff']:.2e} | "
                         f"{a['f_var_median']:.3g} |")
    return lines


def figure(result: dict, path: str) -> None:
    """Step-time ratios to plain against model size, one line per method and batch size."""
    from bayeswrap.evaluation.plots import _new_figure, save_figure

    fig = _new_figure(figsize=(6, 4))
    ax = fig.subplots()
    for bs in sorted({r["batch_size"] for r in result["step"].values()}):
        names = sorted((n for n, r in result["step"].items() if r["batch_size"] == bs),
                       key=lambda n: result["step"][n]["params"])
        sizes = [result["step"][n]["params"] / 1e6 for n in names]
        for m in result["step"][names[0]]["methods"]:
            if m != "plain":
                ax.plot(sizes, [result["step"][n]["ratio"][m] for n in names], marker="o",
                        ls="--" if m.startswith("bayesdll_") else "-", label=f"{m}, batch {bs}")
        for size, n in zip(sizes, names):
            ax.annotate(n.split(" ")[0], (size, 1.0), fontsize=6, rotation=45)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("parameters (millions)")
    ax.set_ylabel("step time / plain step time")
    ax.set_title(f"bayeswrap step-time overhead, {result['device']}", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet18,resnet50,resnet101,vit_small_patch16_224,vit_base_patch16_224,"
                                       "vit_large_patch32_224")
    p.add_argument("--methods", default=",".join(METHODS), help=f"step methods, a subset of {','.join(METHODS)}")
    p.add_argument("--batch-size", type=int, default=16, help="batch size of the predict section")
    p.add_argument("--batch-sizes", default="16", help="comma-separated batch sizes of the step section")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--memory-models", default="", help="comma-separated models whose peak memory is measured "
                                                           "(default: every model of the step section)")
    p.add_argument("--sections", default="step,curvature,mlp_epoch,predict")
    p.add_argument("--bayesdll-src", default=None, metavar="PATH",
                   help="a BayesDLL checkout (github.com/SamsungLabs/BayesDLL) to compare with, imported at run time")
    p.add_argument("--curvature-models", "--curvature-model", dest="curvature_models",
                   default="mlp,resnet18,vit_small_patch16_224")
    p.add_argument("--curvature-img-size", type=int, default=64)
    p.add_argument("--curvature-examples", type=int, default=32)
    p.add_argument("--curvature-chunk", type=int, default=32)
    p.add_argument("--curvature-repeats", type=int, default=3)
    p.add_argument("--curvature-kinds", default="ef,ggn",
                   help="bayeswrap curvatures to time: ef (empirical Fisher, has the target), ggn")
    p.add_argument("--epoch-train-size", type=int, default=1200, help="digits examples of the small-MLP epoch")
    p.add_argument("--epoch-batch-size", type=int, default=64)
    p.add_argument("--epoch-lr", type=float, default=1e-2)
    p.add_argument("--epoch-repeats", type=int, default=5)
    p.add_argument("--predict-model", default="resnet50", help="a timm model name or mlp")
    p.add_argument("--glm-links", default="mc,probit",
                   help="Laplace GLM links to time (probit costs K vector-Jacobian products per example)")
    p.add_argument("--num-samples", default="1,5,20", help="S values of the predict section (1 is always included)")
    p.add_argument("--laplace-models", default="resnet18,vit_small_patch16_224",
                   help="timm models of the laplace section's last-layer comparison")
    p.add_argument("--laplace-img-size", type=int, default=64)
    p.add_argument("--laplace-train", type=int, default=64, help="training images of the last-layer fit")
    p.add_argument("--laplace-batch-size", type=int, default=32, help="batch size of the last-layer fit")
    p.add_argument("--laplace-test", type=int, default=32, help="inputs of the GLM probit predictive")
    p.add_argument("--laplace-kron-models", default="mlp,cnn",
                   help="models of the all-weights KFAC comparison: mlp (digits MLP), cnn (small CNN, 3x32x32)")
    p.add_argument("--laplace-kron-train", type=int, default=512, help="training examples of the all-weights fit")
    p.add_argument("--laplace-kron-batch-size", type=int, default=64)
    p.add_argument("--laplace-repeats", type=int, default=3)
    p.add_argument("--out", default="figures/benchmark")
    p.add_argument("--child-memory", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {unknown}; accepted: {','.join(METHODS)}")
    args.methods = ["plain"] + [m for m in args.methods if m != "plain"]
    args.curvature_kinds = [k for k in args.curvature_kinds.split(",") if k]
    args.glm_links = [k for k in args.glm_links.split(",") if k]
    for flag, values, accepted in (("--curvature-kinds", args.curvature_kinds, ("ef", "ggn")),
                                   ("--glm-links", args.glm_links, ("mc", "probit"))):
        if set(values) - set(accepted):
            p.error(f"{flag}: unknown {sorted(set(values) - set(accepted))}; accepted: {','.join(accepted)}")
    args.num_samples = sorted({1, *(int(s) for s in args.num_samples.split(",") if s)})
    return args


def regenerate_command(argv: list[str]) -> str:
    """The command line that reruns this script with ``argv``: the interpreter relative to the repository when it
    is inside it, and ``OMP_NUM_THREADS`` when it is set (it sets the CPU threads, which the timings depend on).
    """
    root = Path(__file__).resolve().parent.parent
    try:
        python = Path(sys.executable).absolute().relative_to(root).as_posix()
    except ValueError:
        python = "python"
    threads = os.environ.get("OMP_NUM_THREADS")
    prefix = f"OMP_NUM_THREADS={threads} " if threads else ""
    return f"{prefix}{python} scripts/benchmark.py {shlex.join(argv)}".rstrip()


def main(argv=None) -> dict | None:
    """Runs the selected sections and writes ``<out>.json``, ``<out>.md`` (and ``<out>.png``).

    Returns:
        The result dict that was written as JSON (``None`` in the memory child process).
    """
    args = parse_args(argv)
    if args.child_memory:
        return child_memory(args)
    bdl = load_bayesdll(args.bayesdll_src)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    sections = set(args.sections.split(","))
    result = {"device": device_name, "torch": torch.__version__,
              "command": regenerate_command(sys.argv[1:] if argv is None else list(argv)),
              "config": {k: v for k, v in vars(args).items() if k != "child_memory"},
              "bayesdll": {"path": bdl.path, "commit": bdl.commit} if bdl else None, "step": {}}
    if "step" in sections:
        result["step"] = step_section(args, device, bdl)
    if "curvature" in sections:
        result["curvature"] = curvature_section(args, device, bdl)
        result["curvature_backends"] = curvature_backends()
    if "mlp_epoch" in sections:
        print("mlp_epoch", flush=True)
        result["mlp_epoch"] = mlp_epoch(args, device, bdl)
        print(json.dumps(result["mlp_epoch"]["seconds"]), flush=True)
    if "predict" in sections:
        print(f"predict: {args.predict_model}", flush=True)
        result["predict"] = {args.predict_model: predictive(args, args.predict_model, device)}
        print(json.dumps({s: r["ratio"] for s, r in result["predict"][args.predict_model].items()}), flush=True)
    if "laplace" in sections:
        result["laplace"] = laplace_section(args, device)
    result["targets"] = evaluate_targets(result)
    report = markdown(result)
    write_json(args.out + ".json", result)
    write_text(args.out + ".md", report)
    if result["step"]:
        figure(result, args.out + ".png")
    print(report)
    return result


if __name__ == "__main__":
    main()
