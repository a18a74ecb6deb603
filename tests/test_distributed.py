"""Data-parallel training (torch.distributed, gloo on CPU): 2 processes = 1 process with the same global batch.

Two CPU processes are spawned once (module fixture); each trains MAP, VI, SGLD
(Langevin noise on), IVON and Laplace on 400 digits for 3 epochs with a
``DistributedSampler`` shard (32 examples per rank and step), SGD with momentum
(SGLD and IVON: their own optimizers). The reference is one process whose
batches are the union of the two ranks' batches of each step (64 examples), in
the same order. Parameters, histories, SGLD sample stores and the Laplace
curvature must agree within float tolerance, and the two ranks exactly.
The CLI test runs ``torchrun --nproc_per_node=2 -m bayeswrap fit`` and
compares its metrics.json with a one-process run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import bayeswrap as bw
from bayeswrap import optim as bw_optim
from bayeswrap.core import distributed

pytestmark = pytest.mark.filterwarnings("ignore:the Laplace posterior variance:RuntimeWarning")

N_TRAIN, PER_RANK, WORLD, EPOCHS = 400, 32, 2, 3
# map-fp16: float16 autocast + GradScaler; map-bn: an MLP with BatchNorm (per-rank batch statistics)
METHODS = ("map", "vi", "sgld", "ivon", "laplace", "map-fp16", "map-bn")
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:N_TRAIN + 200], y[N_TRAIN:N_TRAIN + 200])


def _mlp(bn: bool = False) -> torch.nn.Module:
    norm = [torch.nn.BatchNorm1d(32)] if bn else []
    return torch.nn.Sequential(torch.nn.Linear(64, 32), *norm, torch.nn.ReLU(), torch.nn.Linear(32, 10))


class UnionBatches:
    """One process's batches: step s is rank 0's s-th DistributedSampler batch followed by rank 1's."""

    def __init__(self, n: int, world: int, per_rank: int, seed: int = 0):
        self.samplers = [DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=seed)
                         for r in range(world)]
        self.per_rank = per_rank

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers:
            s.set_epoch(epoch)

    def __iter__(self):
        shards = [list(s) for s in self.samplers]
        for start in range(0, len(shards[0]), self.per_rank):
            yield [i for shard in shards for i in shard[start:start + self.per_rank]]

    def __len__(self) -> int:
        return -(-len(self.samplers[0]) // self.per_rank)


def _train(method: str, rank: int | None) -> dict:
    """Trains ``method``; ``rank=None``: one process with the union batches, else this rank's shard."""
    method, _, variant = method.partition("-")
    amp = variant if variant == "fp16" else None
    train, val = _data()
    if rank is None:
        loader = DataLoader(train, batch_sampler=UnionBatches(len(train), WORLD, PER_RANK))
    else:
        loader = DataLoader(train, batch_size=PER_RANK,
                            sampler=DistributedSampler(train, num_replicas=WORLD, rank=rank, shuffle=True, seed=0))
    torch.manual_seed(0)
    options = {"sgld": {"burn_in": 4, "thinning": 3}, "vi": {"init_std": 0.05}}.get(method, {})
    bnn = bw.wrap(_mlp(bn=variant == "bn"), method, num_data=len(train), prior_std=1.0, **options)
    if method == "sgld":
        optimizer = bw_optim.SGLD(bnn.param_groups(), lr=0.05, num_data=len(train), noise_scale=1.0)
    elif method == "ivon":
        optimizer = bw_optim.IVON(bnn.param_groups(), lr=0.2, beta2=0.999)
    else:
        optimizer = torch.optim.SGD(bnn.parameters(), lr=0.05, momentum=0.9)
    val_loader = DataLoader(val, batch_size=100) if method == "vi" else None
    history = bw.fit(bnn, loader, epochs=EPOCHS, optimizer=optimizer, val_loader=val_loader, val_num_samples=2,
                     autocast_dtype=amp, grad_clip_norm=1.0 if amp else None, progress=False)
    state = {k: v.detach().clone() for k, v in bnn.state_dict().items() if isinstance(v, torch.Tensor)}
    out = {"history": [{k: v for k, v in r.items() if k != "seconds"} for r in history], "state": state}
    if method == "sgld":
        out["stored"] = bnn.sample_store.select(len(bnn.sample_store), device="cpu", dtype=torch.float32)
    return out


def _shard_gradients(rank: int | None) -> dict:
    """VI gradients of one step on 8 examples, split 5 + 3 over the ranks, with a heavy KL term."""
    train, _ = _data()
    x, y = train.tensors[0][:8], train.tensors[1][:8]
    if rank is not None:
        x, y = (x[:5], y[:5]) if rank == 0 else (x[5:], y[5:])
    torch.manual_seed(1)
    bnn = bw.wrap(_mlp(), "vi", num_data=len(train), kl_weight=20.0, init_std=0.05)
    torch.manual_seed(2)  # the same weight draw everywhere
    bnn.loss(x, y).loss.backward()
    params = [p for p in bnn.parameters() if p.requires_grad]
    total, finite = distributed.all_reduce_gradients_(params, x.shape[0])
    grads = {n: p.grad.clone() for n, p in bnn.named_parameters() if p.grad is not None}
    if rank is None:  # what the step would be if the KL/prior term were counted once per rank (twice)
        bnn.zero_grad()
        torch.manual_seed(2)
        out = bnn.loss(x, y)
        (out.loss + bnn.kl_weight * out.kl / bnn.num_data).backward()
        grads_kl_twice = {n: p.grad.clone() for n, p in bnn.named_parameters() if p.grad is not None}
        return {"grads": grads, "kl_twice": grads_kl_twice, "total": total, "finite": finite}
    return {"grads": grads, "total": total, "finite": finite}


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = {m: _train(m, rank) for m in METHODS}
        results["shard_gradients"] = _shard_gradients(rank)
        results["shared"] = {"world": distributed.world_size(), "rank": distributed.rank(),
                             "seed": distributed.shared_seed(123 + rank)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two ranks' results (spawned once) and the one-process references."""
    out = tmp_path_factory.mktemp("ddp")
    torch.multiprocessing.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    single = {m: _train(m, None) for m in METHODS}
    single["shard_gradients"] = _shard_gradients(None)
    return ranks, single


def _assert_close_states(a: dict, b: dict, rtol=1e-5, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), k


def _assert_close_history(a: list[dict], b: list[dict], rel: float = 1e-5):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=rel, abs=1e-6), k


@pytest.mark.parametrize("method", ["map", "vi", "sgld", "ivon", "map-fp16"])
def test_two_processes_equal_one_process_with_the_global_batch(runs, method):
    ranks, single = runs
    for r in ranks:  # the replicas never drift apart: bit-identical parameters and histories
        _assert_close_states(r[method]["state"], ranks[0][method]["state"], rtol=0, atol=0)
        assert r[method]["history"] == ranks[0][method]["history"]
    tol = 1e-5 if method != "map-fp16" else 2e-3  # fp16 sums over a 32- and a 64-example batch round differently
    _assert_close_states(ranks[0][method]["state"], single[method]["state"], rtol=tol, atol=tol)
    _assert_close_history(ranks[0][method]["history"], single[method]["history"], rel=tol)
    if method == "vi":
        assert "val_nll" in single[method]["history"][0]
    if method == "map-fp16":
        assert ranks[0][method]["history"][-1]["grad_scale"] == 2.0 ** 16


def test_batchnorm_replicas_stay_identical(runs):
    """Per-rank batch statistics differ from the global batch's, but parameters and running stats stay in sync."""
    ranks, single = runs
    state0, state1 = ranks[0]["map-bn"]["state"], ranks[1]["map-bn"]["state"]
    _assert_close_states(state0, state1, rtol=0, atol=0)
    running = [k for k in state0 if k.endswith("running_mean")]
    assert running and not torch.equal(state0[running[0]], torch.zeros_like(state0[running[0]]))
    torch.testing.assert_close(state0[running[0]], single["map-bn"]["state"][running[0]], rtol=0.2, atol=0.05)


def test_sgld_noise_and_sample_stores_are_identical(runs):
    ranks, single = runs
    assert ranks[0]["sgld"]["stored"].keys() == single["sgld"]["stored"].keys()
    for k, v in single["sgld"]["stored"].items():
        assert v.shape[0] >= 2  # several kept iterates
        assert torch.equal(ranks[0]["sgld"]["stored"][k], ranks[1]["sgld"]["stored"][k])
        torch.testing.assert_close(ranks[0]["sgld"]["stored"][k], v, rtol=1e-5, atol=1e-5)


def test_laplace_curvature_is_summed_over_ranks(runs):
    ranks, single = runs
    state0, state1, ref = ranks[0]["laplace"]["state"], ranks[1]["laplace"]["state"], single["laplace"]["state"]
    _assert_close_states(state0, state1, rtol=0, atol=0)
    curvature = [k for k in ref if k.startswith("curvature_diag")]
    assert curvature and all(ref[k].abs().sum() > 0 for k in curvature)
    _assert_close_states(state0, ref, rtol=1e-4, atol=1e-5)  # a shard-sum would be half the reference


def test_gradients_are_the_global_batch_gradient_with_the_kl_term_once(runs):
    """5 + 3 examples on two ranks: the batch-size-weighted mean is the 8-example gradient, KL counted once."""
    ranks, single = runs
    ref = single["shard_gradients"]
    for r in ranks:
        assert r["shard_gradients"]["total"] == 8 and r["shard_gradients"]["finite"]
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["shard_gradients"]["grads"][name], g, rtol=1e-5, atol=1e-6)
    differs = [not torch.allclose(ref["grads"][n], ref["kl_twice"][n], rtol=1e-3, atol=1e-5) for n in ref["grads"]]
    assert any(differs)  # the test would notice a KL term counted per rank


def test_helpers_report_the_group(runs):
    ranks, _ = runs
    assert [r["shared"]["rank"] for r in ranks] == [0, 1]
    assert all(r["shared"]["world"] == 2 for r in ranks)
    assert [r["shared"]["seed"] for r in ranks] == [123, 123]  # rank 0's seed everywhere
    assert distributed.world_size() == 1 and distributed.is_main_process()  # no group in this process


CLI_ARGS = ["fit", "--method", "laplace", "--epochs", "2", "--batch-size", "64", "--device", "cpu",
            "--shift-rotations", "", "--shift-noise", "", "--num-samples", "2", "--progress", "false",
            "--val-fraction", "0.3"]


def test_torchrun_cli_writes_one_run_from_rank_0_equal_to_one_process(tmp_path):
    from bayeswrap.app import cli

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "bayeswrap", *CLI_ARGS, "--out-dir", str(tmp_path / "ddp"),
           "--run-name", "run"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("test error=") == 1  # only rank 0 reports
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == ["run"]
    run = tmp_path / "ddp" / "run"
    assert not (run / ".lock").exists()
    log = (run / "train.log").read_text()
    assert log.count("epoch 1:") == 1 and "data-parallel: 2 processes, global batch 64 (32 per process)" in log
    assert cli.main([*CLI_ARGS, "--out-dir", str(tmp_path / "one"), "--run-name", "run"]) == 0
    ddp = json.loads((run / "metrics.json").read_text())
    one = json.loads((tmp_path / "one" / "run" / "metrics.json").read_text())
    _assert_close_history([{k: v for k, v in r.items() if k != "seconds"} for r in ddp["history"]],
                          [{k: v for k, v in r.items() if k != "seconds"} for r in one["history"]])
    for key in ("error", "nll", "ece", "brier"):
        assert ddp["final"]["2"]["T1"][key] == pytest.approx(one["final"]["2"]["T1"][key], rel=1e-4, abs=1e-6)


def test_cli_refuses_under_torchrun_what_does_not_run_data_parallel(tmp_path, monkeypatch, capsys):
    from bayeswrap.app import cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["evaluate", str(tmp_path)]) == 2
    assert "does not run under torchrun" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a multiple of the world size 2"):
        bw_experiment_loader = __import__("bayeswrap.app.build", fromlist=["EpochLoader"]).EpochLoader
        bw_experiment_loader(_data()[0], 33, 0, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="does not run data-parallel"):
        distributed.refuse("method='hmc'", "its chains run on the whole training set")
    torch.manual_seed(0)
    hmc = bw.wrap(torch.nn.Linear(4, 2), "hmc", num_data=10)
    with pytest.raises(ValueError, match="run_chains does not run data-parallel"):
        hmc.run_chains(torch.randn(10, 4), torch.arange(10) % 2, num_samples=5, num_warmup=5)


def test_helpers_are_no_ops_without_a_process_group():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    assert distributed.all_reduce_gradients_([p], 7) == (7, True)
    assert torch.equal(p.grad, torch.full((3,), 2.0))
    t = torch.ones(2)
    distributed.all_reduce_sum_([t])
    assert torch.equal(t, torch.ones(2))
    assert distributed.all_reduce_numbers([1, 2.5]) == [1.0, 2.5]
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    assert list(distributed.ShardSampler(7, num_replicas=3, rank_=1)) == [1, 4]
