"""bayeswrap.lightning under a 2-process DDP ``lightning.Trainer`` on the CPU (gloo) equals one process.

``tests/lightning_ddp_worker.py`` runs ``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` in a
subprocess (Lightning's launcher starts rank 1 by running the script again; one launch for every run), for the
runs of its ``RUNS``: MAP, VI, SGLD (Langevin noise on), SWAG, a deep ensemble of two MAP members and Laplace
with diagonal, Kronecker-factored and full curvature and the last layer's full curvature (summed over the
ranks' shards), 8 examples per rank and
step, 2 epochs, validating on the training set; and MAP and SWAG of a network with BatchNorm. The ranks seed
their random state differently.

Oracle: ``bw.fit`` in this process on the union of the two ranks' batches of each step (16 examples: rank 0's
shuffled ``DistributedSampler`` shard, then rank 1's), from rank 0's seed. DDP averages the ranks' gradients of
``nll_mean_rank + KL / num_data``, which is the gradient of ``nll_mean_union + KL / num_data``: the KL term
counted once. With the ranks' random states synced to rank 0's (by ``BayesianCallback`` at the start of
training), both ranks draw what the one process draws (VI's weight sample, SGLD's noise); the replicas being
identical, SWAG collects the same moments on every rank, and Laplace's curvature sums (diagonal, Kronecker
factors, full H) are all-reduced at the end of ``fit_curvature``. So the posterior equals the one-process
posterior to float32 summation order (rtol 1e-5, atol 1e-6 after 8 steps; measured at most 2.4e-7 on the
parameters (VI's rho, |value| up to 3.8), 6e-8 on SWAG's moments and the ensemble's members, 9.5e-7 on the
diagonal and full curvature and 2.4e-6 on the Kronecker one, whose entries reach 11), and the two ranks are
bit-identical. The logged training means are synced over the ranks and the validation scores are those of the
union of the ranks' predictions (``bw.predict_loader`` on the whole set).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import bayeswrap as bw
from bayeswrap.evaluation import calibration

pytest.importorskip("lightning.pytorch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import lightning_ddp_worker as worker  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:the Laplace posterior variance:RuntimeWarning")

RUNS = tuple(worker.RUNS)
TRAINED = tuple(name for name, (_, _, batchnorm) in worker.RUNS.items() if not batchnorm)


class UnionBatches:
    """One process's batches: step s is rank 0's s-th batch of its ``DistributedSampler`` shard, then rank 1's.

    Under DDP Lightning gives a training loader a ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED or 0)``
    and calls its ``set_epoch`` before each epoch; ``bw.fit`` calls this batch sampler's.
    """

    def __init__(self):
        self.samplers = [torch.utils.data.DistributedSampler(range(worker.N), num_replicas=worker.WORLD, rank=r,
                                                             shuffle=True, seed=0) for r in range(worker.WORLD)]

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers:
            s.set_epoch(epoch)

    def __iter__(self):
        shards = [list(s) for s in self.samplers]
        for start in range(0, len(shards[0]), worker.PER_RANK):
            yield [i for shard in shards for i in shard[start:start + worker.PER_RANK]]

    def __len__(self):
        return -(-len(self.samplers[0]) // worker.PER_RANK)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    # Lightning picks a free port and starts rank 1 as a child of rank 0; the samplers' seed is 0
    return worker.launch([sys.executable, str(HERE / "lightning_ddp_worker.py"), str(out), *RUNS], out, RUNS,
                         drop_env=("MASTER_PORT", "PL_GLOBAL_SEED"))


def _reference(name: str):
    x, y = worker.data()
    bnn = worker.wrap(name)
    optimizer = worker.build_optimizer(bnn)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_sampler=UnionBatches())
    torch.manual_seed(100)  # rank 0's seed
    history = bw.fit(bnn, loader, epochs=worker.EPOCHS, optimizer=optimizer, progress=False)
    return bnn, history


@pytest.mark.parametrize("name", TRAINED)
def test_ddp_two_ranks_equal_one_process_on_the_union_batches(ddp_runs, name):
    rank0, rank1 = ddp_runs[name, 0], ddp_runs[name, 1]
    assert rank0["world_size"] == 2 and rank0["global_step"] == worker.EPOCHS * len(UnionBatches()) == 8
    reference, history = _reference(name)
    expected = reference.state_dict()
    worker.check_equal_to_one_process(name, rank0["state"], rank1["state"], expected)
    # the logged epoch means are synced over the ranks: the union's means, as fit's history
    for key in ("loss", "nll", "kl", "error"):
        assert rank0["metrics"][f"train_{key}"] == pytest.approx(history[-1][f"train_{key}"], rel=1e-5, abs=1e-7)
        assert rank1["metrics"][f"train_{key}"] == rank0["metrics"][f"train_{key}"]
    # validation scores the union of the ranks' predictions: those of the whole set, on every rank
    x, y = worker.data()
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    probs, targets = bw.predict_loader(reference, val, 0)
    expected = {"nll": calibration.nll(probs, targets), "error": float((probs.argmax(1) != targets).float().mean()),
                "ece": calibration.ece(probs, targets, n_bins=15)}
    for key, value in expected.items():
        assert rank0["metrics"][f"val_{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        assert rank1["metrics"][f"val_{key}"] == rank0["metrics"][f"val_{key}"]


def test_ddp_ranks_keep_identical_batchnorm_statistics(ddp_runs):
    """Each rank updates BatchNorm's running statistics with its own shard; at each epoch's end they are averaged
    over the ranks (as bw.fit does under torchrun), so the replicas end identical (not equal to one process: the
    batch statistics of 8 examples per rank are not those of the 16-example union); so do SWAG's statistics for
    θ_SWA, which each rank recomputes from its own shard when training ends.
    """
    worker.check_batchnorm_replicas(ddp_runs)
