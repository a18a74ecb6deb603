"""Shared infrastructure of the experiment scripts in ``scripts/``.

The scripts reproduce published tables (each keeps its own protocol, tables and
discussion); what they have in common lives here: the command-line skeleton,
method selection, the optimizer each method needs, seeded data subsets and
loaders, a small tanh MLP, and the float64 accuracy / NLL / agreement scores
their reports are written with. Everything is deterministic given its seeds, so
a script's output does not depend on whether a helper lives here or in the
script.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import bayeswrap as bw

__all__ = [
    "experiment_parser", "test_mode_parser", "script_argv", "registered_methods", "select_methods",
    "own_optimizer", "make_optimizer", "tanh_mlp",
    "seeded_subset", "split_tensors", "shuffled_loader", "top1_accuracy", "mean_nll", "accuracy_nll",
    "prediction_scores", "fmt_or_failed", "jsonable",
]

#: Probabilities are clamped to at least this before the log of the NLL.
PROB_FLOOR = 1e-12


# --------------------------------------------------------------------------- command line

def experiment_parser(description: str, *, fast_help: str, out_default: Path | str) -> argparse.ArgumentParser:
    """The argument parser every experiment script starts from: ``--out`` and ``--fast``.

    Args:
        description: The parser's description (a script passes the first paragraph of its docstring).
        fast_help: Help text of ``--fast`` (what the smoke-test configuration shrinks).
        out_default: Default output folder of ``--out``.

    Returns:
        A parser with defaults shown in ``--help``; a script adds its own options to it.
    """
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=out_default, help="output folder")
    p.add_argument("--fast", action="store_true", help=fast_help)
    return p


def test_mode_parser(description: str, *, test_help: str, out_default: Path | str) -> argparse.ArgumentParser:
    """The argument parser of the demo scripts: ``--test-mode``, ``--out-dir``, ``--seed`` and ``--threads``.

    Args:
        description: The parser's description.
        test_help: Help text of ``--test-mode`` (the tiny configuration the tests run).
        out_default: Default of ``--out-dir`` (a string).

    Returns:
        A parser; ``--seed`` defaults to 0 and ``--threads`` (torch CPU threads) to 1.
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--test-mode", action="store_true", help=test_help)
    p.add_argument("--out-dir", default=str(out_default))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return p


def script_argv(argv: Sequence[str] | None) -> list[str]:
    """The arguments a script's ``main`` parses: ``argv`` as a list, or ``sys.argv[1:]`` when ``None``."""
    return list(sys.argv[1:] if argv is None else argv)


def registered_methods(candidates: Iterable[str]) -> list[str]:
    """The names of ``candidates`` that ``bw.METHODS`` holds now, in the order of ``candidates``."""
    return [m for m in candidates if m in bw.METHODS]


def select_methods(requested: str | None, available: Sequence[str]) -> list[str]:
    """Parses a comma-separated ``--methods`` value against the methods a script can run.

    Args:
        requested: e.g. ``"map,vi"``; ``None`` or empty selects every method of ``available``.
        available: The methods the script can run, in its order.

    Returns:
        The requested methods in the order given (or ``available`` as a list).

    Raises:
        SystemExit: if a requested method is not in ``available``.
    """
    if not requested:
        return list(available)
    wanted = [m.strip() for m in requested.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in available]
    if unknown:
        raise SystemExit(f"method(s) {unknown} not available; choose from {', '.join(available)}")
    return wanted


# --------------------------------------------------------------------------- training

def own_optimizer(bnn: bw.BayesianModel, lr: float, **options: Any) -> torch.optim.Optimizer | None:
    """The optimizer the method owns (``bnn.required_optimizer``: SGLD, IVON) over ``bnn.param_groups()``.

    Args:
        bnn: A wrapped model.
        lr: Its learning rate.
        **options: More keyword arguments of that optimizer (e.g. SGLD's ``noise_scale``, IVON's ``beta2``).
            An optimizer whose constructor takes ``num_data`` (:class:`bw.optim.SGLD`) gets ``bnn.num_data`` unless
            ``options`` sets it (as :func:`bayeswrap.app.build.make_optimizer` does).

    Returns:
        The optimizer, or ``None`` when the method trains with any optimizer (the script chooses one).
    """
    required = bnn.required_optimizer
    if required is None:
        return None
    if "num_data" in inspect.signature(required).parameters:
        options = {"num_data": bnn.num_data, **options}
    return required(bnn.param_groups(), lr=lr, **options)


def make_optimizer(bnn: bw.BayesianModel, cfg: Mapping[str, Any]) -> tuple[torch.optim.Optimizer, str]:
    """The method's own optimizer if it needs one (:func:`own_optimizer`), else Adam.

    Args:
        bnn: A wrapped model; its ``param_groups()`` are optimised.
        cfg: Learning rates: ``"lr"`` (Adam), and, read only when the method needs them, ``"sgld_lr"``
            (:class:`bw.optim.SGLD`, with ``num_data = bnn.num_data``) or ``"ivon_lr"`` and
            ``"ivon_beta2"`` (:class:`bw.optim.IVON`).

    Returns:
        ``(optimizer, description)``, e.g. ``(Adam, "Adam(lr=0.001)")``.

    Raises:
        ValueError: if the method needs another optimizer.
    """
    required = bnn.required_optimizer
    if required is None:
        return torch.optim.Adam(bnn.param_groups(), lr=cfg["lr"]), f"Adam(lr={cfg['lr']})"
    if required is getattr(bw.optim, "SGLD", None):
        return own_optimizer(bnn, cfg["sgld_lr"]), f"bw.optim.SGLD(lr={cfg['sgld_lr']})"
    if required is getattr(bw.optim, "IVON", None):
        return (own_optimizer(bnn, cfg["ivon_lr"], beta2=cfg["ivon_beta2"]),
                f"bw.optim.IVON(lr={cfg['ivon_lr']}, beta2={cfg['ivon_beta2']})")
    raise ValueError(f"method {bnn.method!r} needs optimizer {required.__name__}, which this script cannot build")


def tanh_mlp(hidden: int, in_features: int = 64, num_classes: int = 10) -> nn.Module:
    """``Linear(in_features, hidden) -> Tanh -> Linear(hidden, num_classes)``, PyTorch's default initialisation.

    The weights come from the global generator (seed it with ``torch.manual_seed`` first). Inputs are
    float32 ``(B, in_features)``; outputs are logits ``(B, num_classes)``. Parameter names are
    ``0.weight``, ``0.bias``, ``2.weight``, ``2.bias``.
    """
    return nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))


# --------------------------------------------------------------------------- data

def seeded_subset(x: torch.Tensor, y: torch.Tensor, limit: int | None,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``limit`` items of a seeded random permutation, or all items in their order.

    Args:
        x: Inputs, ``(N, ...)``.
        y: Labels, ``(N,)``.
        limit: How many items to keep; ``None`` or ``>= N`` keeps ``x`` and ``y`` unchanged.
        seed: Seeds the permutation (a fresh ``torch.Generator``).

    Returns:
        ``(x, y)`` restricted to the subset: ``(limit, ...)`` and ``(limit,)``.
    """
    if limit is None or limit >= len(y):
        return x, y
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:limit]
    return x[idx], y[idx]


def split_tensors(split: Any, limit: int | None = None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors of one :class:`~bayeswrap.data.ArrayDataset` split, optionally a seeded subset.

    Args:
        split: A split of :func:`bayeswrap.data.load_data` (``.inputs``, ``.targets``), e.g. ``splits.train``.
        limit: Keep the first ``limit`` items of a seeded permutation (see :func:`seeded_subset`).
        seed: Seeds that permutation.

    Returns:
        ``(x, y)``: float32 inputs ``(N, ...)`` and int64 labels ``(N,)``.
    """
    x = torch.as_tensor(split.inputs, dtype=torch.float32)
    y = torch.as_tensor(np.asarray(split.targets), dtype=torch.long)
    return seeded_subset(x, y, limit, seed)


def shuffled_loader(data: Dataset | tuple[torch.Tensor, ...], batch_size: int, seed: int) -> DataLoader:
    """A shuffling DataLoader whose batch order depends on ``seed`` only.

    Args:
        data: A dataset, or tensors ``(x, y, ...)`` sharing their first dimension.
        batch_size: Items per batch (the last batch may be smaller).
        seed: Seeds the loader's own ``torch.Generator``.
    """
    dataset = TensorDataset(*data) if isinstance(data, tuple) else data
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- scores

def top1_accuracy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of rows whose most probable class is the label.

    Args:
        probs: Predictive probabilities (or logits) ``(N, K)``, any float dtype.
        labels: Integer labels ``(N,)``.
    """
    return float((probs.argmax(1) == labels).double().mean())


def mean_nll(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean negative log-likelihood of the labels, in float64, probabilities clamped to :data:`PROB_FLOOR`.

    The quantity of :func:`bayeswrap.evaluation.calibration.nll`, summed in torch's order, which the
    scripts' committed reports were computed with (numpy's pairwise sum can differ in the last bits).

    Args:
        probs: Predictive probabilities ``(N, K)``, any float dtype.
        labels: Integer labels ``(N,)``.
    """
    return float(-probs[torch.arange(len(labels)), labels].double().clamp_min(PROB_FLOOR).log().mean())


def accuracy_nll(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """:func:`top1_accuracy` and :func:`mean_nll` of ``probs`` ``(N, K)`` and ``labels`` ``(N,)``.

    Returns:
        ``{"accuracy": float, "nll": float}``.
    """
    return {"accuracy": top1_accuracy(probs, labels), "nll": mean_nll(probs, labels)}


def prediction_scores(probs: torch.Tensor, labels: torch.Tensor, ref: torch.Tensor | None = None) -> dict[str, float]:
    """:func:`accuracy_nll`, plus agreement with a reference predictive ``ref`` when given.

    Args:
        probs: Predictive probabilities ``(N, K)``.
        labels: Integer labels ``(N,)``.
        ref: A reference predictive ``(N, K)`` (e.g. HMC's), or ``None``.

    Returns:
        ``accuracy`` and ``nll``; with ``ref`` also ``agreement`` (fraction of equal top-1 classes) and ``tv``
        (mean total variation distance, ½ Σ_k |p_k − ref_k|, between 0 and 1).
    """
    out = accuracy_nll(probs, labels)
    if ref is not None:
        probs, ref = probs.double(), ref.double()
        out["agreement"] = float((probs.argmax(1) == ref.argmax(1)).double().mean())
        out["tv"] = float(0.5 * (probs - ref).abs().sum(1).mean())
    return out


def fmt_or_failed(value: float | None, fmt: str = ".3f") -> str:
    """``format(value, fmt)`` for a finite number, ``"failed"`` for ``None``, NaN or ±inf (a failed run's cell)."""
    return "failed" if value is None or not math.isfinite(value) else format(value, fmt)


def jsonable(obj: Any) -> Any:
    """``obj`` with every tuple turned into a list, recursively through dicts and lists (as JSON stores it)."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return [jsonable(v) for v in obj]
    return obj
