"""Mixed precision in fit: float16 autocast with a gradient scaler (on CPU, no GPU needed) and the --amp option."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

import bayeswrap as bw
from bayeswrap import optim as bw_optim
from bayeswrap.app import cli
from bayeswrap.app.config import RunConfig, amp_value, load_run_config, resolve
from bayeswrap.core.io import load_checkpoint

CLI_FAST = ["--progress", "false", "--batch-size", "64", "--shift-rotations", "", "--shift-noise", "",
            "--num-samples", "0", "--device", "cpu"]


def _data(n=128):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x[:n], dtype=torch.float32) / 16.0, torch.tensor(y[:n]))


def _bnn(method="map", **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    return bw.wrap(model, method, num_data=128, prior_std=1.0, **kwargs)


def _params(bnn):
    return {n: p.detach().clone() for n, p in bnn.named_parameters()}


class InfGradient:
    """A gradient hook that turns the gradient into inf at the chosen backward calls (1-based)."""

    def __init__(self, at):
        self.at, self.calls = set(at), 0

    def __call__(self, grad):
        self.calls += 1
        return torch.full_like(grad, math.inf) if self.calls in self.at else grad


def test_fp16_with_scaler_matches_fp32_over_a_few_steps():
    loader = DataLoader(_data(), batch_size=32)
    results = {}
    for dtype in (None, torch.float16):
        bnn = _bnn()
        opt = torch.optim.SGD(bnn.parameters(), lr=0.1, momentum=0.9)
        history = bw.fit(bnn, loader, epochs=2, optimizer=opt, autocast_dtype=dtype, progress=False)
        results[dtype] = (_params(bnn), history)
    (p32, h32), (p16, h16) = results[None], results[torch.float16]
    assert [r["skipped_steps"] for r in h16] == [0, 0] and h16[-1]["grad_scale"] == 2.0 ** 16
    assert "skipped_steps" not in h32[0] and "grad_scale" not in h32[0]
    moved = max((p32[n] - _bnn().state_dict()[n]).abs().max().item() for n in p32)
    assert moved > 0.01  # the runs trained
    for n in p32:
        torch.testing.assert_close(p16[n], p32[n], rtol=0.02, atol=2e-3)  # fp16 forward: ~1e-3 relative
    assert h16[-1]["train_loss"] == pytest.approx(h32[-1]["train_loss"], rel=1e-2)


@pytest.mark.parametrize("method", ["map", "sgld"])
def test_a_step_with_inf_gradients_is_skipped_and_the_scale_halves(method):
    loader = DataLoader(_data(), batch_size=32)  # 4 steps
    bnn = _bnn(method, **({"burn_in": 0, "thinning": 1} if method == "sgld" else {}))
    opt = bw_optim.SGLD(bnn.param_groups(), lr=0.01, num_data=128) if method == "sgld" else \
        torch.optim.SGD(bnn.parameters(), lr=0.1, momentum=0.9)
    hook = InfGradient(at={2})
    first = next(p for p in bnn.parameters() if p.requires_grad)
    first.register_hook(hook)
    seen = []
    original_step = opt.step

    def step(*args, **kwargs):  # records which steps really ran
        seen.append(hook.calls)
        return original_step(*args, **kwargs)

    opt.step = step
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    history = bw.fit(bnn, loader, epochs=1, optimizer=opt, autocast_dtype="fp16", grad_scaler=scaler,
                     progress=False)
    assert seen == [1, 3, 4]  # optimizer.step ran for every step but the one with inf gradients
    assert history[0]["skipped_steps"] == 1 and history[0]["grad_scale"] == 512.0 == scaler.get_scale()
    assert all(torch.isfinite(p).all() for p in bnn.parameters())
    if method == "sgld":  # after_step did not run for the skipped step: 3 steps counted, 3 iterates kept
        assert int(bnn.num_steps) == 3 and int(bnn.num_kept) == 3 and len(bnn.sample_store) == 3


def test_skipped_step_leaves_parameters_unchanged():
    loader = DataLoader(_data(32), batch_size=32)  # one step
    bnn = _bnn()
    before = _params(bnn)
    next(p for p in bnn.parameters() if p.requires_grad).register_hook(InfGradient(at={1}))
    opt = torch.optim.SGD(bnn.parameters(), lr=0.1, momentum=0.9)
    history = bw.fit(bnn, loader, epochs=1, optimizer=opt, autocast_dtype=torch.float16, progress=False)
    assert history[0]["skipped_steps"] == 1 and history[0]["grad_scale"] == 2.0 ** 15
    for n, p in _params(bnn).items():
        assert torch.equal(p, before[n]), n
    assert not opt.state  # no momentum buffer: the step never ran


def test_gradients_are_clipped_after_unscaling():
    """fit's fp16 step = a manual step: unscaled fp16-autocast gradients clipped to the norm, then SGD."""
    data = _data(32)
    loader = DataLoader(data, batch_size=32)
    clip = 0.01
    bnn = _bnn()
    opt = torch.optim.SGD(bnn.parameters(), lr=1.0)
    bw.fit(bnn, loader, epochs=1, optimizer=opt, autocast_dtype=torch.float16, grad_clip_norm=clip,
           progress=False, finalize=False)
    ref = _bnn()
    before = _params(ref)
    x, y = data.tensors
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ref.loss(x, y).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    assert norm > 10 * clip  # clipping binds: a norm of the *scaled* gradients would have given a 65536x smaller step
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    after = _params(bnn)
    step = math.sqrt(sum((after[n] - before[n]).square().sum().item() for n in after))
    assert step == pytest.approx(clip, rel=1e-3)
    for n, p in _params(ref).items():
        torch.testing.assert_close(after[n], p, rtol=1e-4, atol=1e-6)


def test_a_non_finite_loss_is_still_an_error_under_the_scaler():
    x, y = _data(32).tensors
    x = x.clone()
    x[0, 0] = math.nan
    bnn = _bnn()
    with pytest.raises(FloatingPointError, match="input batch contains 1 non-finite"):
        bw.fit(bnn, [(x, y)], epochs=1, optimizer=torch.optim.SGD(bnn.parameters(), lr=0.1),
               autocast_dtype=torch.float16, progress=False)


def test_grad_scaler_is_refused_without_float16():
    bnn = _bnn()
    opt = torch.optim.SGD(bnn.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="only used with autocast_dtype=torch.float16"):
        bw.fit(bnn, [], epochs=1, optimizer=opt, autocast_dtype="bf16", grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="accepted: None or a torch.amp.GradScaler"):
        bw.fit(bnn, [], epochs=1, optimizer=opt, autocast_dtype="fp16", grad_scaler="yes")


@pytest.mark.parametrize("given, expected", [
    (True, "bf16"), (False, "none"), ("true", "bf16"), ("no", "none"), ("bf16", "bf16"), ("BFloat16", "bf16"),
    ("fp16", "fp16"), ("half", "fp16"), ("none", "none")])
def test_amp_values(given, expected):
    assert amp_value(given) == expected
    assert RunConfig(amp=given).validate().amp == expected


def test_amp_option_on_the_command_line_and_in_configs(tmp_path, capsys):
    assert resolve(None, {"amp": "fp16"}).amp == "fp16"
    args = cli.make_parser().parse_args(["fit", "--amp"])  # the older bare flag
    assert args.amp == "bf16" and resolve(None, {"amp": args.amp}).amp == "bf16"
    old = tmp_path / "config.yaml"  # a run folder written when amp was a boolean
    old.write_text(yaml.safe_dump({**RunConfig().to_dict(), "amp": False}))
    assert load_run_config(old).amp == "none"
    assert cli.main(["fit", "--amp", "fp8", "--out-dir", str(tmp_path), *CLI_FAST]) == 2
    err = capsys.readouterr().err
    assert "amp='fp8' is not known; accepted: none, bf16, fp16" in err
    assert not (tmp_path / "digits-mlp-vi").exists()


def test_cli_fp16_checkpoint_saves_and_resume_restores_the_scaler(tmp_path):
    out = tmp_path / "runs"
    assert cli.main(["fit", "--method", "map", "--amp", "fp16", "--epochs", "1", "--out-dir", str(out),
                     "--run-name", "r", *CLI_FAST]) == 0
    run = out / "r"
    ckpt = load_checkpoint(run / "last.pt")
    assert ckpt["scaler"]["scale"] == 2.0 ** 16
    history = json.loads((run / "metrics.json").read_text())["history"]
    assert history[0]["skipped_steps"] == 0 and history[0]["grad_scale"] == 2.0 ** 16
    ckpt["scaler"]["scale"] = 256.0  # as if overflows had lowered it: a resume must continue from here
    torch.save(ckpt, run / "last.pt")
    assert cli.main(["fit", "--resume", str(run), "--epochs", "2"]) == 0
    history = json.loads((run / "metrics.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [1, 2] and history[1]["grad_scale"] == 256.0
