"""Section 4 (``predict``): ``predict(x, num_samples=S)`` of VI and of the Laplace GLM against S plain forwards."""

from __future__ import annotations

import torch

import bayeswrap as bw
from scripts.benchmarks.curvature import prior_dominated_ok
from scripts.benchmarks.timing import interleaved, medians
from scripts.benchmarks.workloads import NUM_DATA, PRIOR_STD, batch, make_model


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

