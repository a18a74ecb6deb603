"""bayeswrap.accelerate under 2 ``accelerate`` processes on the CPU (gloo) equals one process on the union batches.

``tests/accelerate_ddp_worker.py`` runs under ``python -m torch.distributed.run --nproc_per_node=2`` (one launch
for every run), with ``Accelerator(cpu=True)``: ``accelerator.prepare(TrainingStep(bnn), optimizer, loader)``,
``accelerator.backward(step(x, y).loss)``, and :class:`bayeswrap.accelerate.FitHooks` around the loop, for the
runs of ``lightning_ddp_worker.RUNS`` (the data, networks and optimizers of the Lightning DDP test): MAP, VI,
SGLD (Langevin noise on), SWAG, a deep ensemble of two MAP members and Laplace with diagonal, Kronecker and full
curvature and the last layer's full curvature, 8 examples per rank and step, 2 epochs; and MAP and SWAG of a
network with BatchNorm. The ranks seed their
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

The same launch trains MAP, VI, SGLD, SWAG, the ensemble and Kron Laplace with ``bayeswrap.hf.BayesianTrainer``
(seeds 5 and 6 on the two ranks, gradient clipping at norm 1): equal to ``bw.fit(..., grad_clip_norm=1)`` on the
union batches from seed 5 to the same tolerances (measured: the same largest differences), and ``evaluate()``
returns on both ranks the one-process metrics of the whole evaluation set (measured within 1.5e-8).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch

import bayeswrap as bw
from bayeswrap.evaluation import calibration

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import lightning_ddp_worker as runs  # noqa: E402
from accelerate_ddp_worker import EVAL_ROWS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:the Laplace posterior variance:RuntimeWarning")

TRAINED = tuple(name for name, (_, _, batchnorm) in runs.RUNS.items() if not batchnorm)
HF = ("map", "vi", "sgld", "swag", "ensemble", "laplace-kron")  # trained by BayesianTrainer in the same launch
RUNS = (*runs.RUNS, *(f"hf-{name}" for name in HF))


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


def _reference(name: str, seed: int = 100, **options):
    x, y = runs.data()
    bnn = runs.wrap(name)
    optimizer = runs.build_optimizer(bnn)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=runs.WORLD * runs.PER_RANK)
    torch.manual_seed(seed)  # rank 0's seed
    bw.fit(bnn, loader, epochs=runs.EPOCHS, optimizer=optimizer, progress=False, **options)
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


@pytest.mark.parametrize("name", HF)
def test_hf_trainer_two_ranks_equal_one_process_on_the_union_batches(accelerate_runs, name):
    """BayesianTrainer averages the gradients over the ranks before clipping them (max_grad_norm=1, as fit's
    grad_clip_norm), syncs rank 0's random state (the ranks' seeds are 5 and 6), and evaluates the whole set on every
    rank (60 rows: the last evaluation step's 16 gathered examples, completed by accelerate, are cut to 12)."""
    rank0, rank1 = accelerate_runs[f"hf-{name}", 0], accelerate_runs[f"hf-{name}", 1]
    assert rank0["world_size"] == 2 and rank0["steps"] == rank1["steps"] == runs.EPOCHS * 4
    reference = _reference(name, seed=5, grad_clip_norm=1.0)
    runs.check_equal_to_one_process(name, rank0["state"], rank1["state"], reference.state_dict())
    x, y = runs.data()
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:EVAL_ROWS], y[:EVAL_ROWS]), batch_size=8)
    probs, targets = bw.predict_loader(reference.eval(), val, 0)
    expected = {"nll": calibration.nll(probs, targets), "error": float((probs.argmax(1) != targets).float().mean()),
                "ece": calibration.ece(probs, targets)}
    assert rank1["metrics"] == rank0["metrics"]
    for key, value in expected.items():
        assert rank0["metrics"][f"eval_{key}"] == pytest.approx(value, rel=1e-5, abs=1e-6), key
