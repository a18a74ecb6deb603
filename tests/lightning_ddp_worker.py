"""Worker of tests/test_lightning_ddp.py: trains with ``lightning.Trainer(strategy="ddp", devices=2)`` on the CPU.

Its runs (:data:`RUNS`: data, networks, methods, optimizers) and checks are also those of
tests/test_accelerate_ddp.py, which trains them under ``accelerate`` (tests/accelerate_ddp_worker.py).

Run as ``python tests/lightning_ddp_worker.py OUT_DIR RUN [RUN ...]`` (a key of :data:`RUNS`); Lightning's DDP
launcher starts rank 1 by running this file again. Each rank seeds its global random state differently (so only
BayesianCallback's sync of rank 0's state makes their draws equal) and writes, per method,
``OUT_DIR/<RUN>-rank<r>.pt``: the posterior's state dict, the logged training and validation metrics and
the number of optimizer steps. Not a test module (pytest does not collect it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

N, FEATURES, CLASSES, PER_RANK, EPOCHS, WORLD = 64, 6, 3, 8, 2, 2
#: run name: (method, bw.wrap options, with BatchNorm); 8 optimizer steps per run
RUNS = {
    "map": ("map", {}, False),
    "vi": ("vi", {}, False),
    "sgld": ("sgld", {"burn_in": 2, "thinning": 1}, False),
    "laplace": ("laplace", {}, False),
    "laplace-kron": ("laplace", {"hessian_structure": "kron"}, False),
    "laplace-full": ("laplace", {"hessian_structure": "full"}, False),
    "laplace-last-layer": ("laplace", {"hessian_structure": "full", "subset_of_weights": "last_layer"}, False),
    "swag": ("swag", {"swa_start": 3, "collect_every": 1, "max_rank": 4}, False),
    "ensemble": ("ensemble", {"num_members": 2}, False),
    "map-bn": ("map", {}, True),
    "swag-bn": ("swag", {"swa_start": 3, "collect_every": 1, "max_rank": 4}, True),
}


def wrap(name: str):
    """The untrained model of run ``name``."""
    import bayeswrap as bw

    method, options, batchnorm = RUNS[name]
    return bw.wrap(net(batchnorm=batchnorm), method, num_data=N, **options)


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


def build_optimizer(bnn):
    """The run's optimizer (:func:`optimizer`'s class path) over ``bnn.param_groups()``."""
    import bayeswrap as bw

    cls = bw.optim.SGLD if bnn.method == "sgld" else torch.optim.SGD
    return cls(bnn.param_groups(), **optimizer(bnn.method)["init_args"])


def launch(command: list[str], out: Path, runs, drop_env=()) -> dict:
    """Runs a 2-process ``command`` (in a session of its own, so that a timeout ends every process it started) that
    writes ``out/<RUN>-rank<r>.pt`` for each of ``runs``, and loads them: ``{(run, rank): contents}``.
    """
    import pytest

    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(here.parent), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", *drop_env):
        env.pop(name, None)
    proc = subprocess.Popen(command, env=env, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the 2-process run did not finish in 600 s: {stderr[-4000:]}")
    assert proc.returncode == 0, stderr[-4000:]
    return {(m, r): torch.load(out / f"{m}-rank{r}.pt", weights_only=True) for m in runs for r in range(WORLD)}


def check_equal_to_one_process(name: str, rank0: dict, rank1: dict, expected: dict) -> None:
    """The two ranks' trained states of run ``name`` are bit-identical and equal the one-process ``expected`` to
    float32 summation order (rtol 1e-5, atol 1e-6); training moved them; the method's state is there.
    """
    untrained = wrap(name).state_dict()
    assert rank0.keys() == expected.keys()
    moved = 0
    for key, value in expected.items():
        if not isinstance(value, torch.Tensor):
            continue
        assert torch.equal(rank0[key], rank1[key]), key  # identical replicas
        torch.testing.assert_close(rank0[key], value, rtol=1e-5, atol=1e-6, msg=key)
        moved += value.is_floating_point() and not torch.equal(value, untrained[key])
    assert moved  # training moved the posterior
    check_method_state(name, rank0)


def check_batchnorm_replicas(results: dict) -> None:
    """The BatchNorm runs' replicas are identical, their running statistics trained, and SWAG's statistics for
    θ_SWA (recomputed by each rank from its own shard by ``after_fit``) averaged over the ranks.
    """
    for name in (n for n, (_, _, batchnorm) in RUNS.items() if batchnorm):
        rank0, rank1 = results[name, 0]["state"], results[name, 1]["state"]
        stats = [k for k in rank0 if k.startswith("model_buffers.") and "running_" in k]
        assert len(stats) == 2
        untrained = wrap(name).state_dict()
        for k, value in rank0.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, rank1[k]), (name, k)
        assert all(not torch.equal(rank0[k], untrained[k]) for k in stats)
        check_method_state(name, rank0)
    mean0, mean1 = (results["swag-bn", r]["state"]["_extra_state"]["batchnorm"]["mean_statistics"]["buffers"]
                    for r in range(WORLD))
    assert mean0.keys() == mean1.keys() and all(torch.equal(mean0[k], mean1[k]) for k in mean0)


def check_method_state(name: str, state: dict) -> None:
    """Asserts that what run ``name``'s method collects is in its trained ``state`` (the tests compare the values
    with one process's)."""
    if name.startswith("swag"):  # collected at steps 4..8 of 8 (swa_start=3, collect_every=1); the last 4 deviations kept
        assert int(state["num_collected"]) == 5 and state["deviations.0/weight"].shape[0] == 4
        assert all(state[k].abs().sum() > 0 for k in state if k.startswith("moment_m2."))
    elif name == "swag-bn":  # θ_SWA's BatchNorm statistics, recomputed by after_fit
        assert state["_extra_state"]["batchnorm"]["mean_statistics"] is not None
    elif name == "ensemble":  # two members, initialised and trained apart
        assert not torch.allclose(state["members.0.theta.0/weight"], state["members.1.theta.0/weight"])
    elif name.startswith("laplace"):
        assert bool(state["curvature_fitted"])
        structure = [k for k in state if k.startswith("_structure.") and k != "_structure.fitted"]
        assert len(structure) == {"laplace": 0, "laplace-kron": 4, "laplace-full": 1, "laplace-last-layer": 1}[name]
        assert all(state[k].abs().sum() > 0 for k in structure)


def main(out: str, runs: list[str]) -> None:
    import lightning.pytorch as pl

    from bayeswrap.lightning import BayesianModule

    torch.set_num_threads(1)
    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=PER_RANK)
    for name in runs:
        bnn = wrap(name)
        module = BayesianModule(bnn, optimizer(bnn.method))
        trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=WORLD, max_epochs=EPOCHS, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0)
        torch.manual_seed(100 + int(os.environ.get("LOCAL_RANK", "0")))  # different on each rank
        # validated on the training set, 32 examples per rank (not with BatchNorm: a validation forward through
        # DDP would send rank 0's statistics to every rank and hide what the epoch's end does)
        trainer.fit(module, loader, None if RUNS[name][2] else loader)
        rank = trainer.global_rank
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        torch.save({"state": bnn.state_dict(), "metrics": metrics, "global_step": trainer.global_step,
                    "world_size": trainer.world_size}, os.path.join(out, f"{name}-rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
