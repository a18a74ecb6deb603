"""Low-rank and subnetwork Laplace: bayeswrap against laplace-torch's ``LowRankLaplace`` and ``SubnetLaplace``.

In one process, on the same untrained digits MLP (64-100-100-10 ReLU, 17,610 parameters), the same first
``--train`` digits (unshuffled batches of ``--batch-size``), N and prior precision 1, interleaved rounds (one
warm-up) and medians of ``--repeats``:

* low rank, k = ``--rank``: ours (``hessian_structure="lowrank"``, the GGN's top-k by randomised subspace
  iteration, 2 + q passes) against ``laplace.LowRankLaplace`` (the exact Hessian's top-k by asdfghjkl's deflated
  power iteration). laplace-torch 0.3 needs the *old* ``asdfghjkl`` 0.1a2 for it (it pins 0.1a4, which ships only
  ``asdl``): pass ``--asdfghjkl-path DIR`` with that package (e.g. its PyPI wheel unzipped into DIR); otherwise only
  our side is timed. The two approximate different matrices (GGN against Hessian), so only times and the top
  eigenvalues are reported;
* subnetwork, n = ``--subnet``: ours (``subset_of_weights="subnetwork"``, selection included) against laplace-torch's
  mask ``select`` plus ``SubnetLaplace.fit`` (its default backend), for ``largest_magnitude`` and
  ``largest_variance`` (laplace-torch: ``LargestVarianceDiagLaplaceSubnetMask`` over a fitted ``DiagLaplace``); the
  chosen indices and the probit GLM predictive on ``--test`` further digits are compared.

Run::

    OMP_NUM_THREADS=1 python -m scripts.benchmarks.lowrank --asdfghjkl-path /tmp/asdf/site \\
        --out figures/benchmark_cpu_lowrank.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads must not spin on a shared 2-core box
import torch  # noqa: E402

import bayeswrap as bw
from scripts.benchmarks.laplace import laplace_quiet, load_laplace_torch, source_state
from scripts.benchmarks.timing import interleaved, medians
from scripts.benchmarks.workloads import PRIOR_STD, digits_data, digits_mlp


def _lowrank_part(model, loader, num, args, lt) -> dict:
    """Times the two low-rank fits; with laplace-torch's, its and our top eigenvalues."""
    ours = bw.wrap(copy.deepcopy(model), "laplace", num_data=num, prior_std=PRIOR_STD, prior_mean="zero",
                   hessian_structure="lowrank", low_rank=args.rank)
    fits = {"bayeswrap": lambda: ours.fit_curvature(loader, generator=torch.Generator().manual_seed(0))}
    theirs = None
    if lt is not None and args.asdfghjkl_path:
        from laplace import LowRankLaplace

        theirs = LowRankLaplace(copy.deepcopy(model), "classification", prior_precision=1.0,
                                backend_kwargs={"low_rank": args.rank})
        fits["laplace_torch"] = lambda: theirs.fit(loader)
    with laplace_quiet():
        wall, cpu = interleaved(fits, args.repeats, 1, torch.device("cpu"))
    med = medians(wall)
    out = {"rank": args.rank, "power_iterations": ours.low_rank_power_iterations,
           "seconds": med, "cpu_seconds": medians(cpu),
           "eigenvalues_bayeswrap_ggn": [round(float(v), 6) for v in ours._structure.lam]}
    if theirs is not None:
        out["ratio_fit_vs_laplace_torch"] = med["bayeswrap"] / med["laplace_torch"]
        out["eigenvalues_laplace_torch_hessian"] = [round(float(v), 6) for v in theirs.H[1]]
    return out


def _subnet_part(model, loader, num, test_x, score, args, lt) -> dict:
    """Times ours against laplace-torch's mask selection and SubnetLaplace fit for one score; compares them."""
    ours = bw.wrap(copy.deepcopy(model), "laplace", num_data=num, prior_std=PRIOR_STD, prior_mean="zero",
                   hessian_structure="full", subset_of_weights="subnetwork", n_params_subnet=args.subnet,
                   subnetwork_score=score)
    fits = {"bayeswrap": lambda: ours.fit_curvature(loader)}
    holder = {}
    if lt is not None:
        import laplace
        from laplace.utils import LargestMagnitudeSubnetMask, LargestVarianceDiagLaplaceSubnetMask

        def theirs_fit():
            net = copy.deepcopy(model)
            if score == "largest_magnitude":
                mask = LargestMagnitudeSubnetMask(net, n_params_subnet=args.subnet)
            else:
                diag = laplace.Laplace(net, "classification", subset_of_weights="all", hessian_structure="diag",
                                       prior_precision=1.0)
                mask = LargestVarianceDiagLaplaceSubnetMask(net, n_params_subnet=args.subnet, diag_laplace_model=diag)
            indices = mask.select(loader)
            la = laplace.Laplace(net, "classification", subset_of_weights="subnetwork", hessian_structure="full",
                                 subnetwork_indices=indices, prior_precision=1.0)
            la.fit(loader)
            holder["la"] = la

        fits["laplace_torch"] = theirs_fit
    with laplace_quiet():
        wall, cpu = interleaved(fits, args.repeats, 1, torch.device("cpu"))
    med = medians(wall)
    out = {"n_params_subnet": args.subnet, "seconds": med, "cpu_seconds": medians(cpu)}
    if "la" in holder:
        la = holder["la"]
        with laplace_quiet():
            p_ours = ours.predict(test_x)
            p_theirs = la(test_x, pred_type="glm", link_approx="probit")
        out["ratio_fit_vs_laplace_torch"] = med["bayeswrap"] / med["laplace_torch"]
        out["indices_equal"] = bool(torch.equal(ours._structure.indices.cpu(), la.backend.subnetwork_indices.cpu()))
        out["probit_max_abs_diff"] = float((p_ours.double() - p_theirs.double()).abs().max())
        out["probit_vs_map_max_abs_diff"] = float((p_ours.double() - ours.predict(test_x, 0).double()).abs().max())
        out["lml_bayeswrap"] = float(ours.log_marginal_likelihood())
        out["lml_laplace_torch"] = float(la.log_marginal_likelihood())
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", type=int, default=300)
    p.add_argument("--test", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--rank", type=int, default=10)
    p.add_argument("--subnet", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--asdfghjkl-path", default="", help="a directory holding the old asdfghjkl 0.1a2 package")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.asdfghjkl_path:
        sys.path.insert(0, args.asdfghjkl_path)
    lt = load_laplace_torch()
    model = digits_mlp().eval()
    data = digits_data(0, args.train)
    test_x = digits_data(args.train, args.test).tensors[0]
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=False)
    result = {"laplace_torch": lt.version if lt else None, "source": source_state(), "threads": torch.get_num_threads(),
              "model": "digits MLP 64-100-100-10, untrained", "params": sum(t.numel() for t in model.parameters()),
              "train": args.train, "batch_size": args.batch_size, "repeats": args.repeats}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result["lowrank"] = _lowrank_part(model, loader, args.train, args, lt)
        print(json.dumps(result["lowrank"]), flush=True)
        for score in ("largest_magnitude", "largest_variance"):
            result[f"subnet_{score}"] = _subnet_part(model, loader, args.train, test_x, score, args, lt)
            print(json.dumps(result[f"subnet_{score}"]), flush=True)
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        command = "OMP_NUM_THREADS=1 .venv/bin/python -m scripts.benchmarks.lowrank " + " ".join(
            a for a in (argv if argv is not None else sys.argv[1:]))
        out.with_suffix(".md").write_text(markdown(result, command), encoding="utf-8")
    return result


def markdown(result: dict, command: str) -> str:
    """The results as a Markdown page: the regenerate command, the setting, one row per fit."""
    lines = [f"Regenerate: `{command}` (``--asdfghjkl-path``: a directory holding asdfghjkl 0.1a2, its PyPI wheel "
             "unzipped, which laplace-torch 0.3's `LowRankLaplace` imports; without it only bayeswrap's low-rank fit is "
             "timed)", "",
             "# Low-rank and subnetwork Laplace against laplace-torch (CPU)", "",
             f"{result['model']} ({result['params']:,} parameters), {result['train']} digits in batches of "
             f"{result['batch_size']}, {result['threads']} thread(s), medians of {result['repeats']} interleaved "
             f"rounds; laplace-torch {result['laplace_torch']}; bayeswrap at {result['source']['commit']}. "
             "Times include the choice of the subnetwork on both sides.", "",
             "| fit | bayeswrap (s, CPU s) | laplace-torch (s, CPU s) | CPU-time ratio | agreement |",
             "|---|---|---|---|---|"]
    for key, label in (("lowrank", "low rank"), ("subnet_largest_magnitude", "subnetwork, largest magnitude"),
                       ("subnet_largest_variance", "subnetwork, largest variance")):
        row = result.get(key)
        if not row:
            continue
        ours, theirs = row["seconds"], row["cpu_seconds"]
        t_lt = ("—" if ours.get("laplace_torch") is None
                else f"{ours['laplace_torch']:.2f}, {theirs['laplace_torch']:.2f}")
        ratio = ("—" if theirs.get("laplace_torch") is None
                 else f"{theirs['bayeswrap'] / theirs['laplace_torch']:.2f}x")
        if key == "lowrank":
            label = f"low rank, k = {row['rank']} ({row['power_iterations']} power iterations)"
            agree = ("different matrices (bayeswrap: the GGN; laplace-torch: the Hessian by asdfghjkl): "
                     f"top eigenvalues {row['eigenvalues_bayeswrap_ggn'][:3]} against "
                     f"{row.get('eigenvalues_laplace_torch_hessian', [])[:3]}")
        else:
            label = f"{label}, n = {row['n_params_subnet']}"
            agree = (f"indices equal: {row['indices_equal']}; probit max abs diff {row['probit_max_abs_diff']:.1e} "
                     f"(vs MAP {row['probit_vs_map_max_abs_diff']:.1e}); log evidence {row['lml_bayeswrap']:.5f} "
                     f"vs {row['lml_laplace_torch']:.5f}")
        lines.append(f"| {label} | {ours['bayeswrap']:.2f}, {theirs['bayeswrap']:.2f} | {t_lt} | {ratio} | {agree} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
