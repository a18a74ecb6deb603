"""BayesDLL's steps, curvature and epochs in the benchmark's rounds: its own ``Runner`` code, driven as it drives it.

BayesDLL (Kim & Hospedales 2023) is never copied into this repository: its ``methods/*.py`` are imported at run
time from the checkout given by ``--bayesdll-src`` (:mod:`scripts.bayesdll_checkout`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from scripts.bayesdll_checkout import commit_of, load_file
from scripts.benchmarks.workloads import PRIOR_STD, classifier_name


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
    modules = {name: load_file(f"bayesdll_{name}", root / "methods" / f"{name}.py")
               for name in ("vi", "mc_dropout", "sgld", "la", "vanilla")}
    return SimpleNamespace(path=str(root), commit=commit_of(root), modules=modules)


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

