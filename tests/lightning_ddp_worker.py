"""Worker of tests/test_lightning_ddp.py: trains with ``lightning.Trainer(strategy="ddp", devices=2)`` on the CPU.

Run as ``python tests/lightning_ddp_worker.py OUT_DIR METHOD [METHOD ...]`` (``map-bn``: with BatchNorm); Lightning's DDP launcher starts
rank 1 by running this file again. Each rank seeds its global random state differently (so only
BayesianCallback's sync of rank 0's state makes their draws equal) and writes, per method,
``OUT_DIR/<METHOD>-rank<r>.pt``: the posterior's state dict, the logged training and validation metrics and
the number of optimizer steps. Not a test module (pytest does not collect it).
"""

from __future__ import annotations

import os
import sys

import torch

N, FEATURES, CLASSES, PER_RANK, EPOCHS, WORLD = 64, 6, 3, 8, 2, 2
OPTIONS = {"sgld": {"burn_in": 2, "thinning": 1}}


def data():
    """N examples of FEATURES inputs and CLASSES classes (a fixed linear rule), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return x, y


def net(batchnorm: bool = False):
    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(16)] if batchnorm else []
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), *norm, torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))


def optimizer(method: str):
    """The optimizer as a class path (SGLD: its own optimizer with its Langevin noise on)."""
    if method == "sgld":
        return {"class_path": "bayeswrap.optim.SGLD", "init_args": {"lr": 0.05, "num_data": N}}
    return {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.9}}


def main(out: str, methods: list[str]) -> None:
    import lightning.pytorch as pl

    import bayeswrap as bw
    from bayeswrap.lightning import BayesianModule

    torch.set_num_threads(1)
    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=PER_RANK)
    for name in methods:  # "map-bn": MAP of a network with BatchNorm
        method = name.split("-")[0]
        bnn = bw.wrap(net(batchnorm=name.endswith("-bn")), method, num_data=N, **OPTIONS.get(method, {}))
        module = BayesianModule(bnn, optimizer(method))
        trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=WORLD, max_epochs=EPOCHS, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0)
        torch.manual_seed(100 + int(os.environ.get("LOCAL_RANK", "0")))  # different on each rank
        # validated on the training set, 32 examples per rank (not with BatchNorm: a validation forward through
        # DDP would send rank 0's statistics to every rank and hide what the epoch's end does)
        trainer.fit(module, loader, None if name.endswith("-bn") else loader)
        rank = trainer.global_rank
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        torch.save({"state": bnn.state_dict(), "metrics": metrics, "global_step": trainer.global_step,
                    "world_size": trainer.world_size}, os.path.join(out, f"{name}-rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
