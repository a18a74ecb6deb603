"""Section 3 (``mlp_epoch``): one epoch over sklearn's digits with the 64-100-100-10 MLP.

``bw.fit`` (MAP, VI and a deep ensemble, its members vmapped and one after another) against BayesDLL's
``vanilla`` and ``vi`` ``Runner.train_one_epoch`` on the same loader.
"""

from __future__ import annotations

import torch

import bayeswrap as bw
from scripts.benchmarks.bayesdll import bayesdll_runner, bayesdll_step, quiet_stderr
from scripts.benchmarks.timing import interleaved, medians
from scripts.benchmarks.workloads import PRIOR_STD, digits_loader, digits_mlp, sgd

#: Members of the deep ensemble whose epoch is timed against one MAP epoch.
ENSEMBLE_MEMBERS = 5


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

