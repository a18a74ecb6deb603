"""``bw.save`` / ``bw.load``: a fitted model of every method reloads from its file and the architecture alone.

Oracles: the reloaded model's state equals the saved model's tensor for tensor, and its predictive equals the
saved model's exactly under the same generator; the model handed to ``load`` is left as it was; a different
architecture, a damaged file or an unstorable argument is refused with a message naming the cause.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch import nn

import bayeswrap as bw
from bayeswrap.core.io import CheckpointError, UnsafePathError

K = 10
N_TRAIN = 64
#: options that give each method a posterior after a few steps (SGLD keeps samples, SWAG collects moments)
OPTIONS = {
    "sgld": {"burn_in": 2, "thinning": 1},
    "swag": {"swa_start": 2, "collect_every": 1},
    "ensemble": {"num_members": 2},
    "multiswag": {"num_members": 2, "member_kwargs": {"swa_start": 2, "collect_every": 1}},
    "mh": {"num_chains": 2},
    "hmc": {"num_chains": 2, "num_leapfrog": 4},
}
CASES = [pytest.param(m, OPTIONS.get(m, {}), id=m) for m in bw.METHODS] + [
    pytest.param("laplace", {"hessian_structure": "kron"}, id="laplace-kron"),
    pytest.param("vi", {"params": ["2.*"], "prior_mean": "zero", "init_std": 0.01}, id="vi-patterns-zero-mean"),
]


@functools.cache
def _digits():
    """64 training and 32 test digits, pixels in [0, 1]."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    return x[:N_TRAIN], y[:N_TRAIN], x[-32:], y[-32:]


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, K))


def _batches(x, y, batch_size=16):
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=gen)
    return [(x[order[i:i + batch_size]], y[order[i:i + batch_size]]) for i in range(0, len(x), batch_size)]


def _fitted(method: str, options: dict, model: nn.Module | None = None) -> bw.BayesianModel:
    """The method wrapped on a tiny MLP and trained for a few minibatch steps (or short chains)."""
    x, y, _, _ = _digits()
    options = dict(options)
    bnn = bw.wrap(_mlp(0) if model is None else model, method, num_data=N_TRAIN, prior_std=1.0,
                  params=options.pop("params", None), prior_mean=options.pop("prior_mean", "init"), **options)
    torch.manual_seed(1)
    if bnn.not_trained_by_fit():
        bnn.run_chains(x, y, num_samples=8, num_warmup=4, generator=torch.Generator().manual_seed(0))
    else:
        groups = bnn.param_groups()
        if bnn.required_optimizer is bw.optim.SGLD:
            optimizer = bw.optim.SGLD(groups, lr=0.05, num_data=N_TRAIN)
        elif bnn.required_optimizer is not None:
            optimizer = bnn.required_optimizer(groups, lr=0.05)
        else:
            optimizer = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
        bw.fit(bnn, _batches(x, y), epochs=3, optimizer=optimizer, progress=False)
    assert bnn.is_ready(), f"{method}: the posterior should exist after fitting"
    return bnn.eval()


def _predictions(bnn, x):
    with torch.no_grad():
        return (bnn.predict(x, num_samples=4, generator=torch.Generator().manual_seed(7)),
                bnn.predict(x, num_samples=0))


@pytest.mark.filterwarnings("ignore:the Laplace posterior variance")  # a tiny, briefly trained model
@pytest.mark.parametrize(("method", "options"), CASES)
def test_a_fitted_model_reloads_on_a_fresh_instance_and_predicts_identically(method, options, tmp_path):
    bnn = _fitted(method, options)
    path = tmp_path / "bnn.pt"
    bw.save(bnn, path)
    fresh = _mlp(123)  # the same architecture, other weights
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    loaded = bw.load(path, fresh)

    assert type(loaded) is type(bnn) and not loaded.training
    saved_state, loaded_state = bnn.state_dict(), loaded.state_dict()
    assert list(loaded_state) == list(saved_state)
    for key, value in saved_state.items():
        if torch.is_tensor(value):
            assert torch.equal(loaded_state[key], value), key
        else:
            assert loaded_state[key] == value, key
    _, _, x_test, _ = _digits()
    for ours, theirs in zip(_predictions(loaded, x_test), _predictions(bnn, x_test), strict=True):
        assert torch.equal(ours, theirs)
    # the fresh model's weights differ from the trained ones, and load leaves them (and it) as they were
    assert not torch.equal(before["0.weight"], _mlp(0).state_dict()["0.weight"])
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_the_file_holds_the_wrap_arguments_and_plain_data_only(tmp_path):
    bnn = bw.wrap(_mlp(0), "swag", num_data=N_TRAIN, prior_std=0.5, params=["2.*"], bias="uninformative",
                  max_rank=3, kl_weight=0.5)
    bw.save(bnn, tmp_path / "bnn.pt")
    contents = torch.load(tmp_path / "bnn.pt", weights_only=True)  # no pickled Python objects
    assert contents["method"] == "swag" and contents["bayeswrap"] == bw.__version__
    assert contents["arguments"] == {"num_data": N_TRAIN, "prior_std": 0.5, "prior_mean": "init",
                                     "bias": "uninformative", "params": ["2.*"], "likelihood": "categorical",
                                     "noise_std": 1.0, "output_key": "logits", "label_key": "labels",
                                     "max_rank": 3, "kl_weight": 0.5}
    assert contents["architecture"][:2] == [["parameter", "0.weight", [16, 64], "torch.float32", True],
                                            ["parameter", "0.bias", [16], "torch.float32", True]]
    loaded = bw.load(tmp_path / "bnn.pt", _mlp(5))
    assert loaded.bayesian_names == ["2.weight", "2.bias"] and loaded.max_rank == 3
    assert loaded.kl_weight == 0.5 and loaded.prior_std == 0.5 and loaded.training


def test_a_prior_mean_mapping_is_restored_from_the_state(tmp_path):
    means = {n: torch.full_like(p, 0.25) for n, p in _mlp(0).named_parameters()}
    bnn = bw.wrap(_mlp(0), "map", num_data=N_TRAIN, prior_mean=means)
    bw.save(bnn, tmp_path / "bnn.pt")
    loaded = bw.load(tmp_path / "bnn.pt", _mlp(3))
    for name, value in means.items():
        assert torch.equal(loaded.prior.mean[name], value), name
    theta = {n: t.detach() for n, t in loaded.posterior_mean().items()}
    assert torch.equal(theta["0.weight"], _mlp(0).state_dict()["0.weight"])


@pytest.mark.parametrize(("other", "message"), [
    (lambda: nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4)),
     "parameter '2.weight' has shape (4, 16) here but (10, 16) in the saved model"),
    (lambda: nn.Sequential(nn.Linear(64, 16), nn.ReLU()), "parameter '2.weight' (shape (10, 16)) is missing here"),
    (lambda: nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, K), nn.Linear(K, K)),
     "it has parameter '3.weight', which the saved model lacks"),
    (lambda: nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, K)).double(),
     "parameter '0.weight' has dtype torch.float64 here but torch.float32"),
    (lambda: nn.Sequential(nn.Linear(64, 16).requires_grad_(False), nn.ReLU(), nn.Linear(16, K)),
     "parameter '0.weight' has requires_grad False here but True"),
    (lambda: nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, K)),
     "parameter '1.weight', which the saved model lacks"),
], ids=["head-shape", "missing-layer", "extra-layer", "dtype", "frozen", "other-layer"])
def test_a_different_architecture_is_refused_naming_the_first_difference(other, message, tmp_path):
    bw.save(bw.wrap(_mlp(0), "vi", num_data=N_TRAIN), tmp_path / "bnn.pt")
    with pytest.raises(ValueError, match="differs from the saved one") as err:
        bw.load(tmp_path / "bnn.pt", other())
    assert message in str(err.value)


@pytest.mark.parametrize("damage", ["truncated", "empty", "random", "state_dict_only", "python_object",
                                    "newer_layout", "missing"])
def test_a_damaged_or_foreign_file_is_refused_naming_it(damage, tmp_path):
    path = tmp_path / "bnn.pt"
    bw.save(bw.wrap(_mlp(0), "laplace", num_data=N_TRAIN), path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "random":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "state_dict_only":
        torch.save(bw.wrap(_mlp(0), "laplace", num_data=N_TRAIN).state_dict(), path)
    elif damage == "python_object":
        torch.save({"format": "bayeswrap.save", "arguments": functools.partial(print)}, path)
    elif damage == "newer_layout":
        contents = torch.load(path, weights_only=True)
        torch.save({**contents, "format_version": 99}, path)
    else:
        path.unlink()
    expected = {"truncated": "cannot be read", "empty": "is empty", "random": "cannot be (read|loaded)",
                "state_dict_only": "lacks format", "python_object": "weights_only=True",
                "newer_layout": "layout version 99", "missing": "does not exist"}[damage]
    with pytest.raises(CheckpointError, match=expected) as err:
        bw.load(path, _mlp(1))
    assert str(path) in str(err.value)


def test_a_params_callable_is_refused_suggesting_patterns(tmp_path):
    bnn = bw.wrap(_mlp(0), "vi", num_data=N_TRAIN, params=lambda name, p: name.startswith("2."))
    with pytest.raises(ValueError, match=r"params is a callable.*params=\['fc\.\*'\].*'2\.weight', '2\.bias'"):
        bw.save(bnn, tmp_path / "bnn.pt")
    assert not (tmp_path / "bnn.pt").exists()


def test_a_model_not_made_by_wrap_or_an_unstorable_argument_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"not made by bw\.wrap.*bw\.wrap\(model, 'vi'"):
        bw.save(bw.VI(_mlp(0), num_data=N_TRAIN), tmp_path / "a.pt")
    bnn = bw.wrap(_mlp(0), "vi", num_data=N_TRAIN)
    bnn.wrap_arguments = {**bnn.wrap_arguments, "init_std": object()}
    with pytest.raises(ValueError, match="wrap argument init_std=<object"):
        bw.save(bnn, tmp_path / "b.pt")
    with pytest.raises(TypeError, match="got Linear"):
        bw.save(nn.Linear(2, 2), tmp_path / "c.pt")
    bw.save(bw.wrap(_mlp(0), "vi", num_data=N_TRAIN), tmp_path / "d.pt")
    with pytest.raises(TypeError, match="got OrderedDict"):
        bw.load(tmp_path / "d.pt", _mlp(0).state_dict())
    with pytest.raises(ValueError, match="map_location='gpu0' is not a device"):
        bw.load(tmp_path / "d.pt", _mlp(0), map_location="gpu0")


def test_numpy_and_tensor_arguments_are_stored_as_python_numbers(tmp_path):
    import numpy as np

    bnn = bw.wrap(_mlp(0), "vi", num_data=np.int64(N_TRAIN), prior_std=np.float32(0.5),
                  init_std=torch.tensor(0.01), num_train_samples=torch.tensor(2))
    bw.save(bnn, tmp_path / "bnn.pt")
    arguments = torch.load(tmp_path / "bnn.pt", weights_only=True)["arguments"]
    assert arguments["num_data"] == N_TRAIN and type(arguments["num_data"]) is int
    assert arguments["prior_std"] == 0.5 and type(arguments["prior_std"]) is float
    assert type(arguments["init_std"]) is float and arguments["num_train_samples"] == 2
    assert bw.load(tmp_path / "bnn.pt", _mlp(1)).num_train_samples == 2


def test_writes_are_atomic_and_never_through_a_link(tmp_path, monkeypatch):
    path = tmp_path / "bnn.pt"
    first = bw.wrap(_mlp(0), "map", num_data=N_TRAIN)
    bw.save(first, path)
    good = path.read_bytes()

    def dies_halfway(obj, f):
        with open(f, "wb") as fh:
            fh.write(good[:100])
        raise OSError("killed mid-write")

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(OSError, match="killed mid-write"):
        bw.save(bw.wrap(_mlp(1), "map", num_data=N_TRAIN), path)
    monkeypatch.undo()
    assert path.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["bnn.pt"]
    assert torch.equal(bw.load(path, _mlp(2)).theta["0.weight"], first.theta["0.weight"])

    target = tmp_path / "elsewhere.pt"
    target.write_bytes(b"keep")
    link = tmp_path / "link.pt"
    link.symlink_to(target)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        bw.save(first, link)
    assert target.read_bytes() == b"keep"


def test_the_temporary_file_of_a_killed_save_is_removed_by_the_next_save(tmp_path):
    """A SIGKILL during bw.save leaves its temporary file (as large as the model); the next save to the path removes
    it, and leaves a live writer's temporary file alone."""
    import subprocess
    import sys

    path = tmp_path / "bnn.pt"
    killed = ("import os, signal, sys\nfrom bayeswrap.core.io import atomic_write\n"
              "def write(tmp):\n    open(tmp, 'wb').write(b'x' * 100_000)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
              "atomic_write(sys.argv[1], write)\n")
    result = subprocess.run([sys.executable, "-c", killed, str(path)], capture_output=True, timeout=300)
    assert result.returncode == -9, result.stderr[-2000:]
    stale = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert len(stale) == 1 and stale[0].stat().st_size == 100_000 and not path.exists()
    live = tmp_path / f".bnn.pt.{os.getpid()}.inprogress.tmp"  # this process is alive: its file is kept
    live.write_bytes(b"y")
    bw.save(bw.wrap(_mlp(0), "map", num_data=N_TRAIN), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["bnn.pt", live.name])
    assert bw.load(path, _mlp(1)).method == "map"
