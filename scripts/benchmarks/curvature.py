"""Section 2 (``curvature``): diagonal Laplace curvature throughput (examples/s) on several models.

bayeswrap's empirical Fisher (every curvature backend the installed ``Laplace`` offers) against a naive
per-example backward loop and BayesDLL's ``la`` ``Runner.estimate_variance``; bayeswrap's GGN is reported
separately (a different quantity).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import warnings

import torch
import torch.nn.functional as F

import bayeswrap as bw
from scripts.benchmarks.bayesdll import bayesdll_runner, quiet_stderr
from scripts.benchmarks.timing import interleaved, medians
from scripts.benchmarks.workloads import LR, NUM_DATA, PRIOR_STD, batch, make_model


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

