"""bayeswrap.accelerate under 2 ``accelerate`` processes on the CPU (gloo) equals one process on the union batches.

``tests/accelerate_ddp_worker.py`` runs under ``python -m torch.distributed.run --nproc_per_node=2`` (one launch
for every run), with ``Accelerator(cpu=True)``: ``accelerator.prepare(TrainingStep(bnn), optimizer, loader)``,
``accelerator.backward(step(x, y).loss)``, and :class:`bayeswrap.accelerate.FitHooks` around the loop, for the
runs of ``lightning_ddp_worker.RUNS`` (the data, networks and optimizers of the Lightning DDP test): MAP, VI,
SGLD (Langevin noise on), SWAG, a deep ensemble of two MAP members and Laplace with diagonal, Kronecker and full
curvature, 8 examples per rank and step, 2 epochs; and MAP of a network with BatchNorm. The ranks seed their
random state differently.

Oracle: ``bw.fit`` in this process on the union of the two ranks' batches of each step, from rank 0's seed.
Accelerate gives rank r the batches r, r + 2, ... of the unshuffled 8-example loader, so step s's union is
examples 16 s ... 16 s + 15: a 16-example loader. DDP averages the ranks' gradients of ``nll_mean_rank + KL /
num_data`` (the loss runs inside the DDP wrapper through ``TrainingStep``): the union's gradient with the KL term
counted once; ``FitHooks`` gives every rank rank 0's random state (the same VI draws and Langevin noise), and
Laplace's curvature sums over the ranks' shards are all-reduced. So the posteriors equal one process's to
float32 summation order: rtol 1e-5, atol 1e-6 (measured after 8 steps, largest differences: parameters 2.4e-7
(VI's rho, |value| up to 3.8), SWAG's moments 6e-8, Laplace's curvature 2.4e-6 for Kron and 1.4e-6 for the full
H, whose entries reach 11), and the two ranks are bit-identical.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch

import bayeswrap as bw

pytest.importorskip("accelerate")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import lightning_ddp_worker as runs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:the Laplace posterior variance:RuntimeWarning")

RUNS = tuple(runs.RUNS)
TRAINED = tuple(name for name, (_, _, batchnorm) in runs.RUNS.items() if not batchnorm)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={_free_port()}", str(HERE / "accelerate_ddp_worker.py"), str(out), *RUNS]
    return runs.launch(command, out, RUNS, drop_env=("MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"))


def _reference(name: str):
    x, y = runs.data()
    bnn = runs.wrap(name)
    optimizer = runs.build_optimizer(bnn)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=runs.WORLD * runs.PER_RANK)
    torch.manual_seed(100)  # rank 0's seed
    bw.fit(bnn, loader, epochs=runs.EPOCHS, optimizer=optimizer, progress=False)
    return bnn


@pytest.mark.parametrize("name", TRAINED)
def test_accelerate_two_ranks_equal_one_process_on_the_union_batches(accelerate_runs, name):
    rank0, rank1 = accelerate_runs[name, 0], accelerate_runs[name, 1]
    assert rank0["world_size"] == 2 and rank0["steps"] == rank1["steps"] == runs.EPOCHS * 4
    expected = _reference(name).state_dict()
    runs.check_equal_to_one_process(name, rank0["state"], rank1["state"], expected)


def test_accelerate_ranks_keep_identical_batchnorm_statistics(accelerate_runs):
    """FitHooks.end_epoch averages the ranks' BatchNorm statistics (each updates them from its own shard), and SWAG's
    after_fit its statistics for θ_SWA."""
    runs.check_batchnorm_replicas(accelerate_runs)
