"""Section 2 (``curvature``): diagonal Laplace curvature throughput (examples/s) on several models.

bayeswrap's empirical Fisher and exact GGN over all weights (every curvature backend the installed ``Laplace``
offers) against a naive per-example backward loop, BayesDLL's ``la`` ``Runner.estimate_variance`` and laplace-torch's
diagonal Laplace (``Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")``, its fit on a
one-batch loader) with its curvlinops backends (``CurvlinopsGGN`` is its default) and its BackPACK ones, like with
like (empirical Fisher against empirical Fisher, GGN against GGN), with the largest difference of the curvatures.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import warnings

import torch
import torch.nn.functional as F

import bayeswrap as bw
from scripts.benchmarks.bayesdll import bayesdll_runner, quiet_stderr
from scripts.benchmarks.timing import interleaved, medians
from scripts.benchmarks.workloads import LR, NUM_DATA, PRIOR_STD, batch, make_model

#: laplace-torch configurations: name -> (curvature, backend class in ``laplace.curvature``); CurvlinopsGGN is its
#: default backend
LAPLACE_TORCH = {"laplace_torch_ef_curvlinops": ("ef", "CurvlinopsEF"), "laplace_torch_ef_backpack": ("ef", "BackPackEF"),
                 "laplace_torch_ggn_curvlinops": ("ggn", "CurvlinopsGGN"),
                 "laplace_torch_ggn_backpack": ("ggn", "BackPackGGN")}
#: laplace-torch's curvlinops diagonal builds per-example gradients (B, P) (EF) or full Jacobians (B, K, P) (GGN)
#: in one piece; above this many bytes the configuration is left out (reported, not run)
LAPLACE_TORCH_MAX_BYTES = 4 * 2**30


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


def laplace_torch_runs(lt, model, x, y, kinds) -> tuple[dict, dict]:
    """laplace-torch's diagonal Laplace fits over all weights, one per configuration of :data:`LAPLACE_TORCH`.

    Each runs on its own deep copy of ``model`` (BackPACK extends the modules it sees) with a one-batch
    ``DataLoader`` (laplace-torch reads N from ``loader.dataset``). Returns ``(fits, skipped)``: ``{name: (la,
    fit)}`` and ``{name: reason}`` for the curvlinops configurations whose one-piece per-example tensors would
    exceed :data:`LAPLACE_TORCH_MAX_BYTES`.
    """
    from laplace import curvature as backends

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=x.shape[0])
    params = sum(p.numel() for p in model.parameters())
    outputs = int(model(x[:1]).shape[-1])
    fits, skipped = {}, {}
    for name, (kind, backend) in LAPLACE_TORCH.items():
        if kind not in kinds:
            continue
        if "curvlinops" in name:
            rows = x.shape[0] * (outputs if kind == "ggn" else 1)
            size = rows * params * x.element_size()
            if size > LAPLACE_TORCH_MAX_BYTES:
                what = "(B, K, P) Jacobians" if kind == "ggn" else "(B, P) per-example gradients"
                skipped[name] = (f"skipped: its {what} would take {size / 2**30:.0f} GiB in one piece "
                                 f"(limit {LAPLACE_TORCH_MAX_BYTES / 2**30:.0f} GiB)")
                continue
        la = lt.Laplace(copy.deepcopy(model).eval(), "classification", subset_of_weights="all",
                        hessian_structure="diag", backend=getattr(backends, backend))
        fits[name] = (la, lambda la=la: la.fit(loader))
    return fits, skipped


def curvature_agreement(bnn, model, la, examples: int) -> float:
    """The largest |ours − laplace-torch's| over the flattened diagonal curvature of one batch, over their largest
    (ours unscaled by N/n; both in ``model.parameters()`` order).
    """
    ours = bnn.curvature_diag
    names = [n for n, _ in model.named_parameters()]
    flat = torch.cat([ours[n].flatten() for n in names]) * (examples / bnn.num_data)
    theirs = la.H.detach().flatten().to(flat)
    return float((flat - theirs).abs().max() / theirs.abs().max())


def curvature(args, name: str, device: torch.device, bdl=None) -> dict:
    """Curvature throughput on one model: ours (empirical Fisher and GGN per backend), naive loop, BayesDLL ``la``,
    laplace-torch's diagonal Laplace.

    All run on the same eval-mode model and batch, over all weights, interleaved. Speed-ups compare like with
    like: our empirical Fisher against the per-example-gradient loops (naive, BayesDLL) and laplace-torch's
    empirical Fisher; our GGN against laplace-torch's GGN (and, a different quantity, the naive loop).
    """
    img = args.curvature_img_size
    ggn_models = [m for m in getattr(args, "curvature_ggn_models", "").split(",") if m]
    kinds = [k for k in args.curvature_kinds if k != "ggn" or not ggn_models or name in ggn_models]
    model = make_model(name, img).to(device).eval()
    x, y = batch(name, args.curvature_examples, img, device)
    loader = [(x, y)]
    fns = {"naive_loop": lambda: naive_fisher(model, x, y)}
    ours = {}
    for backend in curvature_backends():
        extra = {} if backend is None else {"curvature_backend": backend}
        suffix = backend or "default"
        for kind, label in (("empirical_fisher", "ef"), ("ggn", "ggn")):
            if label not in kinds or (label == "ggn" and backend == "vmap"):  # the vmap GGN: tests' reference only
                continue
            bnn = bw.wrap(model, "laplace", num_data=NUM_DATA, prior_std=PRIOR_STD, curvature=kind,
                          subset_of_weights="all", curvature_chunk_size=args.curvature_chunk, **extra).to(device)
            ours[f"bayeswrap_{label}_{suffix}"] = bnn
            fns[f"bayeswrap_{label}_{suffix}"] = lambda bnn=bnn: bnn.fit_curvature(loader)
    if bdl is not None:
        runner = bayesdll_runner(bdl, "la", model, device, NUM_DATA, LR)

        def theirs():
            with quiet_stderr():
                runner.estimate_variance(loader)
        fns["bayesdll_la"] = theirs
    errors, lt_fits = {}, {}
    from scripts.benchmarks.laplace import load_laplace_torch  # it imports this module

    lt = load_laplace_torch()
    if lt is not None:
        lt_fits, errors = laplace_torch_runs(lt, model, x, y, kinds)
        fns.update({k: fit for k, (_, fit) in lt_fits.items()})
    with prior_dominated_ok(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # laplace-torch/BackPACK notes on the extended modules
        for k in list(fns):  # warm-up; a configuration that fails is reported, not fatal
            try:
                fns[k]()
            except Exception as error:  # noqa: BLE001 (any failure of one backend must not lose the run)
                errors[k] = f"{type(error).__name__}: {error}"
                del fns[k]
        agreement = {}
        for k, bnn in ours.items():
            label = k.split("_")[1]
            for t, (la, _) in lt_fits.items():
                if t in fns and LAPLACE_TORCH[t][0] == label:
                    agreement[f"{k}/{t}"] = curvature_agreement(bnn, model, la, x.shape[0])
        wall, cpu = interleaved(fns, args.curvature_repeats, 0, device)
    n = x.shape[0]
    eps = {k: n / t for k, t in medians(wall).items()}
    eps_cpu = {k: n / t for k, t in medians(cpu).items()}
    speedup, speedup_cpu = {}, {}
    for k in eps:
        if not k.startswith("bayeswrap_"):
            continue
        label = k.split("_")[1]
        refs = ["naive_loop"] + (["bayesdll_la"] if label == "ef" else [])
        refs += [t for t in eps if t.startswith(f"laplace_torch_{label}_")]
        for r in refs:
            if r in eps:
                speedup[f"{k}/{r}"] = eps[k] / eps[r]
                speedup_cpu[f"{k}/{r}"] = eps_cpu[k] / eps_cpu[r]
    return {"model": name, "img_size": None if name in ("mlp", "cnn") else img,
            "input": list(x.shape[1:]), "examples": n, "chunk": args.curvature_chunk,
            "params": sum(p.numel() for p in model.parameters()), "examples_per_s": eps,
            "examples_per_cpu_s": eps_cpu, "speedup": speedup, "speedup_cpu": speedup_cpu,
            "agreement": agreement, "errors": errors,
            "laplace_torch": None if lt is None else lt.version}


def curvature_section(args, device: torch.device, bdl=None) -> dict:
    """Runs :func:`curvature` for every model of ``--curvature-models``."""
    out = {}
    for name in [m for m in args.curvature_models.split(",") if m]:
        print(f"curvature: {name}", flush=True)
        out[name] = curvature(args, name, device, bdl)
        print(json.dumps(out[name]["speedup"]), flush=True)
    return out

