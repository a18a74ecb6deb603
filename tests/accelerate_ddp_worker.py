"""Worker of tests/test_accelerate_ddp.py: trains with ``accelerate`` under ``torch.distributed.run`` (2 CPU processes).

Run as ``python -m torch.distributed.run --nproc_per_node=2 tests/accelerate_ddp_worker.py OUT_DIR RUN [RUN ...]``
(a key of ``lightning_ddp_worker.RUNS``: the same data, networks, methods and optimizers as the Lightning test).
Each rank seeds its global random state differently (so only ``FitHooks``' sync of rank 0's state makes their
draws equal), prepares ``TrainingStep(bnn)``, the optimizer and a ``DataLoader(batch_size=PER_RANK)`` (not
shuffled: accelerate gives rank r the batches r, r + 2, ...) with one ``Accelerator(cpu=True)``, trains
``EPOCHS`` epochs with ``accelerator.backward`` and writes ``OUT_DIR/<RUN>-rank<r>.pt``: the posterior's state
dict and the optimizer steps counted. A run ``hf-<RUN>`` trains the same model with ``bayeswrap.hf.BayesianTrainer``
instead (rows ``{"input", "labels"}``, ``train_sampling_strategy="sequential"``, ``max_grad_norm=1``, the run's
optimizer, seed ``5 + rank``) and also writes ``trainer.evaluate()`` on the first :data:`EVAL_ROWS` rows. Not a
test module (pytest does not collect it).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_ddp_worker import EPOCHS, PER_RANK, build_optimizer, data, wrap  # noqa: E402

#: rows evaluated by the Trainer runs: not a multiple of the 16 examples of an evaluation step of both ranks
EVAL_ROWS = 60


def rows(x, y) -> list[dict]:
    """The examples as the Trainer's rows: the wrapped network's forward argument ``input`` and ``labels``."""
    return [{"input": xi, "labels": int(yi)} for xi, yi in zip(x, y)]


def train_with_hf(name: str, out: str, rank: int) -> None:
    """Trains run ``name`` with ``BayesianTrainer`` and writes its state and its evaluation's metrics."""
    import transformers

    from bayeswrap.hf import BayesianTrainer

    x, y = data()
    bnn = wrap(name)
    args = transformers.TrainingArguments(
        os.path.join(out, name), num_train_epochs=EPOCHS, per_device_train_batch_size=PER_RANK,
        per_device_eval_batch_size=PER_RANK, lr_scheduler_type="constant", train_sampling_strategy="sequential",
        seed=5 + rank, report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, max_grad_norm=1.0,
        disable_tqdm=True, dataloader_pin_memory=False)
    trainer = BayesianTrainer(model=bnn, args=args, train_dataset=rows(x, y), eval_dataset=rows(x, y)[:EVAL_ROWS],
                              optimizers=(build_optimizer(bnn), None), eval_num_samples=0)
    trainer.train()
    metrics = trainer.evaluate()
    torch.save({"state": bnn.state_dict(), "steps": trainer.hooks.updates, "world_size": args.world_size,
                "metrics": metrics}, os.path.join(out, f"hf-{name}-rank{rank}.pt"))


def main(out: str, runs: list[str]) -> None:
    from accelerate import Accelerator

    from bayeswrap.accelerate import FitHooks, TrainingStep

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    x, y = data()
    for name in runs:
        if name.startswith("hf-"):
            train_with_hf(name[3:], out, accelerator.process_index)
            continue
        bnn = wrap(name)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=PER_RANK)
        step, opt, loader = accelerator.prepare(TrainingStep(bnn), build_optimizer(bnn), loader)
        torch.manual_seed(100 + accelerator.process_index)  # different on each rank
        hooks = FitHooks(bnn, opt, num_steps=EPOCHS * len(loader), steps_per_epoch=len(loader))
        for _ in range(EPOCHS):
            for xb, yb in loader:
                opt.zero_grad()
                accelerator.backward(step(xb, yb).loss)
                opt.step()
            hooks.end_epoch()
        hooks.finish(loader)
        torch.save({"state": bnn.state_dict(), "steps": hooks.steps, "world_size": accelerator.num_processes},
                   os.path.join(out, f"{name}-rank{accelerator.process_index}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
