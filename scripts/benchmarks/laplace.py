"""Section 5 (``laplace``): bayeswrap's KFAC Laplace against laplace-torch (Daxberger et al. 2021).

In the same process, on the same weights, data, N and prior precision: the last-layer KFAC fit and GLM probit
predictive on timm models (and the predictive against one plain forward), and the all-weights KFAC fit on the
digits MLP and a small CNN. Both sides' probit predictives and functional variances are compared. Without
laplace-torch importable its columns are left out.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import json
import subprocess
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

import bayeswrap as bw
from scripts.benchmarks.curvature import prior_dominated_ok
from scripts.benchmarks.timing import interleaved, medians
from scripts.benchmarks.workloads import (
    LAPLACE_CLASSES,
    PRIOR_STD,
    digits_data,
    digits_mlp,
    image_data,
    small_cnn,
    timm_model,
)


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
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "bayeswrap"],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "modified": []}
    return {"commit": commit or "unknown", "modified": sorted(line[3:] for line in status.splitlines() if line)}


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


def laplace_section(args, device: torch.device, lt: SimpleNamespace | None) -> dict:
    """KFAC Laplace, bayeswrap against laplace-torch: last layer on timm models, all weights on small models.

    Last layer (``--laplace-models``): timm models with 10 classes (ViTs built for ``--laplace-img-size``),
    ``--laplace-train`` random images of 3 × size × size with random labels, the predictive on
    ``--laplace-test`` more. All weights (``--laplace-kron-models``): ``mlp`` (the digits MLP on the first
    ``--laplace-kron-train`` of sklearn's digits in a fixed shuffled order, the predictive on the next
    ``--laplace-test``) and ``cnn`` (:func:`small_cnn` on random 3×32×32 images). Untrained weights
    throughout: these are cost measurements, with the agreement of the two implementations as a check. ``lt`` is
    :func:`load_laplace_torch`'s result (``None``: bayeswrap's side only).
    """
    out = {"laplace_torch": {"version": lt.version} if lt else None, "source": source_state(),
           "repeats": args.laplace_repeats, "last_layer": {}, "all_weights": {}}
    size = args.laplace_img_size
    train = image_data(args.laplace_train, size, seed=0)
    test_x = image_data(args.laplace_test, size, seed=1).tensors[0]
    for name in [m for m in args.laplace_models.split(",") if m]:
        print(f"laplace last layer: {name}", flush=True)
        model = timm_model(name, LAPLACE_CLASSES, size).to(device).eval()
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

