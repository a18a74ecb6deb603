"""BayesDLL's side: its own ``Runner`` on the shared batches from the shared weights, imported at run time."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from bayeswrap.app.config import BAYESDLL_PER_METHOD
from scripts.bayesdll_checkout import commit_of, load_file
from scripts.bayesdll_side_by_side.settings import ECE_BINS, NST, THEIR_FILES
from scripts.bayesdll_side_by_side.shared import (
    SideBySideMismatch,
    build_mlp,
    digest,
    plain_loader,
    scores,
    std_stats,
    train_loader,
)


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
        modules = {m: load_file(f"bayesdll_{f}", root / "methods" / f"{f}.py") for m, f in THEIR_FILES.items()}
        small_nets = load_file("bayesdll_small_nets", root / "networks" / "small_nets.py")
        calibration = load_file("bayesdll_calibration", root / "calibration.py") \
            if (root / "calibration.py").exists() else None
    finally:
        sys.path.remove(str(root))
    return SimpleNamespace(path=str(root), commit=commit_of(root), modules=modules, small_nets=small_nets,
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

