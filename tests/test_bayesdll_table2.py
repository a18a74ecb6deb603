"""scripts/bayesdll_table2.py (BayesDLL's Table 2 on mnist5k beside BayesDLL's own code, issue 25).

BayesDLL's side is a fake checkout written into ``tmp_path``: the entry points the script uses
(``methods/{vi,mc_dropout,sgld,la}.py`` with a ``Runner``, ``networks/small_nets.py`` with ``MLP``), whose Runner
fingerprints the weights it is built with and every batch its ``train_one_epoch`` consumes, in its own code.
"""

import hashlib
import json
import math
import os
import textwrap

import pytest
import torch

from bayeswrap.app import experiments as ex
from scripts import bayesdll_table2 as t2

pytest.importorskip("mlxtend")

SMALL_NETS = textwrap.dedent('''
    import torch.nn as nn

    class MLP(nn.Module):
        def __init__(self, input_dim, output_dim, width=1200, depth=2, activation="relu"):
            super().__init__()
            self.input_dim = input_dim
            layers, hin = [], input_dim
            for _ in range(depth):
                layers += [nn.Linear(hin, width), nn.ReLU()]
                hin = width
            self.layers = nn.Sequential(*layers)
            self.classifier = nn.Linear(width, output_dim)

        def forward(self, x):
            return self.classifier(self.layers(x.view(-1, self.input_dim)))
''')

FAKE_RUNNER = textwrap.dedent('''
    import hashlib, json, os, types
    from pathlib import Path
    import numpy as np
    import torch
    import torch.nn.functional as F

    METHOD = {method!r}
    LOG = Path(__file__).resolve().parents[1] / "records.jsonl"

    def _record(**kw):
        with open(LOG, "a") as f:
            f.write(json.dumps({{"method": METHOD, **kw}}) + "\\n")

    class Runner:
        def __init__(self, net, net0, args, logger):
            if os.environ.get("FAKE_BAYESDLL_PERTURB"):
                with torch.no_grad():
                    next(net.parameters())[0, 0] += 1e-3
            self.net, self.args, self.nst = net, args, int(args.hparams["nst"])
            self.model = types.SimpleNamespace(m=net)
            h = hashlib.sha1()
            for p in net.parameters():
                h.update(p.detach().numpy().tobytes())
            _record(event="init", digest=h.hexdigest(), ND=args.ND, hparams=args.hparams, lr=args.lr,
                    momentum=args.momentum)
            self.epoch = 0

        def train_one_epoch(self, train_loader, collect=False, bi=0):
            if os.environ.get("FAKE_BAYESDLL_FAIL_EPOCH") == str(self.epoch):
                raise RuntimeError("CUDA is not available")
            h = hashlib.sha1()
            for i, (x, y) in enumerate(train_loader):
                if os.environ.get("FAKE_BAYESDLL_STOP_EARLY") and self.epoch == 0 and i == 1:
                    break
                h.update(x.numpy().tobytes())
                h.update(y.numpy().tobytes())
                bi += 1
            _record(event="epoch", epoch=self.epoch, digest=h.hexdigest())
            self.epoch += 1
            return 0.0, 0.0, bi

        def estimate_variance(self, train_loader):
            _record(event="variance")

        def evaluate(self, test_loader):
            targets, logits = [], []
            with torch.no_grad():
                for x, y in test_loader:
                    targets.append(y.numpy())
                    logits.append(F.log_softmax(self.net(x), -1).numpy())
            targets, logits = np.concatenate(targets), np.concatenate(logits)
            return 0.0, 0.0, targets, logits, logits[..., None]
''')


def write_fake_bayesdll(root):
    (root / "methods").mkdir(parents=True)
    (root / "networks").mkdir()
    (root / "networks" / "__init__.py").write_text("")
    (root / "networks" / "small_nets.py").write_text(SMALL_NETS)
    for method, name in t2.THEIR_FILES.items():
        (root / "methods" / f"{name}.py").write_text(FAKE_RUNNER.format(method=method))
    return root


def records(root):
    return [json.loads(line) for line in (root / "records.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    root = write_fake_bayesdll(tmp_path_factory.mktemp("fake_bayesdll"))
    out = tmp_path_factory.mktemp("t2")
    result = t2.main(["--fast", "--out", str(out), "--bayesdll-src", str(root)])
    return {"root": root, "out": out, "result": result}


def test_fast_report(fake_run):
    out = fake_run["out"]
    md, js = out / f"{t2.STEM}.md", out / f"{t2.STEM}.json"
    assert md.exists() and js.exists() and not list(out.glob(".*.tmp"))
    text = md.read_text()
    assert "FAST MODE" in text
    assert "Regenerate: `OMP_NUM_THREADS=1 .venv/bin/python scripts/bayesdll_table2.py --fast --bayesdll-src " \
           "$BAYESDLL_SRC --out /tmp/t2`" in text
    assert "Epochs are scaled down from 100 to 2" in text and "Where ours and theirs differ" in text
    data = json.loads(js.read_text())
    cfg = data["settings"]
    # one table row per (method, side, predictive) and nst, the reference beside it
    for method, side, pred in t2.ROWS:
        for nst in ("0", "5"):
            s = data["summary"][method][side][pred][nst]
            assert 0.0 <= s["error"][0] <= 100.0 and math.isfinite(s["nll"][0])
            assert 0.0 <= s["ece_all"][0] <= s["mce_all"][0] <= 100.0
    assert "| laplace | BayesDLL | MAP / sampled nn | 5 |" in text and "| 1.51 | 0.12 |" in text
    # BayesDLL's side got its README's MNIST hparams and the run's optimiser settings
    init = {r["method"]: r for r in records(fake_run["root"]) if r["event"] == "init"}
    assert init["vi"]["hparams"] == {"prior_sig": "1.0", "bias": "informative", "nst": "5", "kld": "0.001"}
    assert init["laplace"]["hparams"]["prior_sig"] == "0.01" and init["laplace"]["hparams"]["Ninflate"] == "1000.0"
    assert init["sgld"]["hparams"]["burnin"] == str(cfg["sgld_burn_in_epochs"])
    assert {r["ND"] for r in init.values()} == {data["sizes"]["train"]} == {256}
    assert {(r["lr"], r["momentum"]) for r in init.values()} == {(0.01, 0.5)}


def _digest(tensors):
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()


def test_both_sides_get_the_same_initial_weights_and_batches(fake_run):
    """What the fake Runner saw, fingerprinted by its own code, is what our side trained from and on."""
    data = json.loads((fake_run["out"] / f"{t2.STEM}.json").read_text())
    cfg, seed = data["settings"], 0
    recs = records(fake_run["root"])
    train = t2.load_mnist5k(t2.FAST)["train"]
    # the batches, independently: the seeded shuffling loader, epoch after epoch
    loader = ex.shuffled_loader(train, cfg["batch_size"], seed)
    expected_epochs = [_digest([t for batch in loader for t in batch]) for _ in range(cfg["epochs"])]
    loader = ex.shuffled_loader(train, cfg["batch_size"], seed)
    whole = _digest([t for _ in range(cfg["epochs"]) for batch in loader for t in batch])
    model = t2.build_mlp(cfg["width"], cfg["depth"], seed)
    for method in t2.METHODS:
        mine = [r for r in recs if r["method"] == method]
        assert [r["digest"] for r in mine if r["event"] == "init"] == [_digest(model.parameters())]
        assert [r["digest"] for r in mine if r["event"] == "epoch"] == expected_epochs
        run = data["runs"][method][str(seed)]
        assert run["ours"]["init_digest"] == run["theirs"]["init_digest"] == _digest(model.parameters())
        assert run["ours"]["batch_digest"] == run["theirs"]["batch_digest"] == whole
        assert run["ours"]["batches"] == run["theirs"]["batches"] == cfg["epochs"] * math.ceil(256 / 64)
    assert [r["method"] for r in recs if r["event"] == "variance"] == ["laplace"]


@pytest.mark.parametrize("env, match", [("FAKE_BAYESDLL_PERTURB", "starts from other weights"),
                                        ("FAKE_BAYESDLL_STOP_EARLY", "consumed other batches")])
def test_a_mismatch_stops_the_run(tmp_path, monkeypatch, env, match):
    root = write_fake_bayesdll(tmp_path / "fake")
    monkeypatch.setenv(env, "1")
    with pytest.raises(t2.SideBySideMismatch, match=match):
        t2.main(["--fast", "--methods", "vi", "--out", str(tmp_path / "out"), "--bayesdll-src", str(root)])


def test_their_failure_is_reported_with_how_far_it_got(tmp_path, monkeypatch):
    root = write_fake_bayesdll(tmp_path / "fake")
    monkeypatch.setenv("FAKE_BAYESDLL_FAIL_EPOCH", "1")
    result = t2.main(["--fast", "--methods", "mc_dropout", "--out", str(tmp_path), "--bayesdll-src", str(root)])
    theirs = result["runs"]["mc_dropout"]["0"]["theirs"]
    assert theirs["failed_at"] == "train epoch 1" and "CUDA is not available" in theirs["error"]
    assert "theirs" not in result["summary"]["mc_dropout"] and "ours" in result["summary"]["mc_dropout"]
    text = (tmp_path / f"{t2.STEM}.md").read_text()
    assert "BayesDLL's code failed: seed 0: train epoch 1 (RuntimeError: CUDA is not available)" in text
    assert "| mc_dropout | BayesDLL | failed on every seed, at train epoch 1 (see Discussion) |" in text


def test_a_missing_checkout_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkout of github.com/SamsungLabs/BayesDLL"):
        t2.main(["--fast", "--out", str(tmp_path), "--bayesdll-src", str(tmp_path / "nowhere")])


def test_scores_match_torchmetrics_and_bayesdll_binning():
    """All-class ECE/MCE = binary calibration error of the N·K flattened probabilities; top-label = multiclass."""
    tm = pytest.importorskip("torchmetrics.classification")
    gen = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(400, 10, generator=gen, dtype=torch.float64)
    probs, labels = logits.softmax(-1), torch.randint(0, 10, (400,), generator=gen)
    s = t2.scores(probs, labels)
    onehot = torch.nn.functional.one_hot(labels, 10)
    p32 = probs.float()
    assert s["ece_all"] == pytest.approx(100 * float(tm.BinaryCalibrationError(n_bins=15)(p32.flatten(), onehot.flatten())),
                                         abs=1e-4)
    assert s["mce_all"] == pytest.approx(100 * float(tm.BinaryCalibrationError(n_bins=15, norm="max")(
        p32.flatten(), onehot.flatten())), abs=1e-4)
    assert s["ece_top"] == pytest.approx(100 * float(tm.MulticlassCalibrationError(10, n_bins=15)(p32, labels)),
                                         abs=1e-4)
    assert s["mce_top"] == pytest.approx(100 * float(tm.MulticlassCalibrationError(10, n_bins=15, norm="max")(
        p32, labels)), abs=1e-4)
    assert s["error"] == pytest.approx(100 * float((probs.argmax(1) != labels).double().mean()))
    assert s["nll"] == pytest.approx(float(-probs[torch.arange(400), labels].log().mean()))
    # BayesDLL's calc_bins: bins [k/15, (k+1)/15) over every (i, j), weighted by bin size (a naive loop)
    p, z = probs.flatten().numpy(), onehot.flatten().numpy()
    ece = sum(abs(z[m].mean() - p[m].mean()) * m.sum() / p.size
              for k in range(15) if (m := (p >= k / 15) & (p < (k + 1) / 15)).any())
    assert s["ece_all"] == pytest.approx(100 * ece, abs=1e-9)


@pytest.mark.skipif(not os.environ.get("BAYESDLL_SRC"), reason="set BAYESDLL_SRC to a SamsungLabs/BayesDLL checkout")
def test_real_bayesdll_trains_the_same_laplace_map(tmp_path):
    """Both codes train Laplace's MAP by plain SGD on the same loss: same batches and weights, the same MAP."""
    result = t2.main(["--fast", "--methods", "laplace", "--out", str(tmp_path),
                      "--bayesdll-src", os.environ["BAYESDLL_SRC"]])
    run = result["runs"]["laplace"]["0"]
    ours, theirs = run["ours"]["predictives"]["nn"]["0"], run["theirs"]["predictives"]["sampled"]["0"]
    assert theirs["error"] == ours["error"] and theirs["nll"] == pytest.approx(ours["nll"], rel=1e-4)
    assert max(abs(a - b) for a, b in zip(run["theirs"]["ece_all_their_code"].values(),
                                          [theirs["ece_all"], run["theirs"]["predictives"]["sampled"]["5"]["ece_all"]])
               ) < 1e-6


def test_the_json_holds_no_nan():
    """A diverged run's NaN losses are written as null (strict JSON has no NaN)."""
    assert t2.finite_or_null({"a": [1.0, float("nan")], "b": float("-inf"), "c": "nan", "d": 2}) == \
        {"a": [1.0, None], "b": None, "c": "nan", "d": 2}
