"""Issue 23, option validation before work: every bad value below is refused before any sampling, training or
file write, with an error naming the option (or file and field), the value and what is accepted."""

import json
import socket
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import bayeswrap as bw
import bayeswrap.app.cli as cli
from bayeswrap.app import compare, config, options, runner
from bayeswrap.core import distributed
from bayeswrap.core.checks import MAX_PREDICTIVE_SAMPLES, check_bool, check_device, check_seed
from bayeswrap.core.io import CheckpointError, load_checkpoint, save_checkpoint
from bayeswrap.methods import mcmc

FAST = ["--batch-size", "64", "--shift-rotations", "0", "--shift-noise", "0", "--progress", "false"]


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _data(n=20, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=gen)
    return x, (x[:, 0] > 0).long()


# --------------------------------------------------------------------------- 1. booleans


@pytest.mark.parametrize("option, value", [("jitter", "false"), ("adapt_mass", "no"), ("jitter", 1),
                                           ("adapt_mass", None), ("jitter", torch.tensor([True]))])
def test_hmc_boolean_options_refuse_non_booleans_from_python(option, value):
    with pytest.raises(ValueError, match=rf"{option}=.* must be True or False, not \w+"):
        bw.wrap(nn.Linear(2, 2), "hmc", num_data=4, **{option: value})
    with pytest.raises(ValueError, match=rf"{option}=.* must be True or False"):  # a RunConfig built in Python
        config.RunConfig(method="hmc", method_options={option: value}).validate()


def test_hmc_boolean_options_are_parsed_from_the_command_line_and_yaml(tmp_path):
    bnn = bw.wrap(nn.Linear(2, 2), "hmc", num_data=4, jitter=False, adapt_mass=torch.tensor(False))
    assert bnn.jitter is False and bnn.adapt_mass is False
    cfg = config.resolve(None, {"method": "hmc", "jitter": "false", "adapt_mass": "no"})
    assert cfg.method_options == {"jitter": False, "adapt_mass": False}
    path = tmp_path / "hmc.yaml"
    path.write_text('method: hmc\njitter: "false"\nadapt_mass: no\n')
    cfg = config.resolve(str(path), {})
    assert cfg.method_options == {"jitter": False, "adapt_mass": False}
    built = bw.wrap(nn.Linear(2, 2), "hmc", num_data=4, **cfg.method_arguments("init"))
    assert built.jitter is False and built.adapt_mass is False
    assert check_bool("x", True) is True and check_bool("x", torch.tensor(False)) is False


@pytest.mark.parametrize("value", ["maybe", "2", 2, 0.5, None, [True]])
def test_parse_bool_refuses_what_is_not_a_boolean(value):
    with pytest.raises(ValueError, match=r"jitter=.* is not a boolean; accepted: true, false"):
        options.parse_bool("jitter", value)


def test_cli_boolean_flag_refuses_a_word_before_any_folder(tmp_path, capsys):
    out = tmp_path / "runs"
    assert cli.main(["fit", "--method", "hmc", "--jitter", "maybe", "--out-dir", str(out), *FAST]) == 2
    assert "jitter='maybe' is not a boolean; accepted: true, false" in capsys.readouterr().err
    assert not out.exists()


# --------------------------------------------------------------------------- 2. chains that do not move


@pytest.mark.parametrize("method, kwargs, start", [
    ("hmc", {"init_step_size": 1e30, "num_leapfrog": 2}, r"init_step_size=1e\+30"),
    ("mh", {"init_scale": 1e30}, r"init_scale=1e\+30"),
])
def test_stuck_chains_warn_with_the_starting_value_and_the_acceptance(method, kwargs, start):
    torch.manual_seed(0)
    x, y = _data()
    bnn = bw.wrap(nn.Linear(2, 2), method, num_data=len(x), **kwargs)
    with pytest.warns(RuntimeWarning, match=rf"{method}: chain\(s\) \[0, 1\] hardly moved after warm-up: "
                                            rf"acceptance rate 0, 0 .*started from {start}"):
        stats = bnn.run_chains(x, y, num_samples=10, num_warmup=10, num_chains=2,
                               generator=torch.Generator().manual_seed(0))
    assert stats["acceptance_rate"] == [0.0, 0.0]
    if method == "hmc":  # every transition divergent, and the warning says so
        assert stats["divergences"] == [10, 10]


def test_healthy_chains_do_not_warn():
    torch.manual_seed(0)
    x, y = _data()
    bnn = bw.wrap(nn.Linear(2, 2), "hmc", num_data=len(x), num_leapfrog=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        stats = bnn.run_chains(x, y, num_samples=30, num_warmup=60, num_chains=2,
                               generator=torch.Generator().manual_seed(0))
    assert min(stats["acceptance_rate"]) > mcmc.LOW_ACCEPTANCE


# --------------------------------------------------------------------------- 3. too few kept draws


@pytest.mark.parametrize("method", ["hmc", "mh"])
def test_too_few_kept_draws_are_refused_before_sampling(method, tmp_path, capsys, monkeypatch):
    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled")

    monkeypatch.setattr(bw.METHODS[method], "_kernel", no_sampling)  # the kernel of a run: built only to sample
    out = tmp_path / "runs"
    assert cli.main(["fit", "--method", method, "--chain-samples", "6", "--thinning", "2", "--out-dir", str(out),
                     *FAST]) == 2
    err = capsys.readouterr().err
    assert (f"method={method!r}: chain_samples=6 with thinning=2 and max_samples=1000 keeps 3 draw(s) per chain; "
            "the diagnostics (split R-hat, ESS) need at least 4 per chain; accepted: chain_samples >= 7 at "
            "thinning=2") in err
    assert not out.exists()
    assert cli.main(["fit", "--method", method, "--max-samples", "5", "--out-dir", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert "keeps 3 draw(s) per chain" in err and "accepted: max_samples >= 7" in err
    assert not out.exists()


def test_check_run_options_counts_the_kept_draws():
    bnn = bw.wrap(nn.Linear(2, 2), "mh", num_data=4, max_samples=5)
    assert mcmc.kept_draws(7, 2, 1000) == 4 and mcmc.kept_draws(6, 2, 1000) == 3
    assert mcmc.kept_draws(100, 1, 5) == 3 and mcmc.kept_draws(100, 1, 7) == 4
    with pytest.raises(ValueError, match=r"keeps 3 draw\(s\) per chain; .* accepted: max_samples >= 7"):
        bnn.check_run_options(num_samples=100)
    assert bnn.check_run_options(num_samples=5)["num_samples"] == 5
    with pytest.raises(ValueError, match=r"num_warmup=10000000 \+ num_samples=1000 iterations is above the bound"):
        bnn.check_run_options(num_warmup=mcmc.MAX_ITERATIONS)
    with pytest.raises(ValueError, match=r"generator is not an option of run_chains"):
        bnn.check_run_options(generator=None)
    # the library itself still samples a short run (only the diagnostics need four draws per chain)
    x, y = _data()
    bnn.run_chains(x, y, num_samples=2, num_warmup=2, num_chains=2)
    with pytest.raises(ValueError, match="at least 4 kept draws per chain"):
        bnn.diagnostics()


# --------------------------------------------------------------------------- 4. compare's method list


@pytest.mark.parametrize("args, message", [
    (["--methods", "map,map"], "--methods map,map lists map more than once; accepted: each method once"),
    (["--methods", "map,vi,map,vi"], "lists map, vi more than once"),
    (["--methods", "map,laplace", "--val-fraction", "0"],
     "val_fraction=0 leaves no validation data, which tuning needs for map, laplace"),
    (["--methods", "map", "--num-samples", "5,5"], "--num-samples 5,5 lists 5 more than once"),
    (["--methods", "map", "--num-samples", "0,1000000000000"], "1000000000000 is not valid; accepted: integers in "
                                                              "[0, 100,000]"),
])
def test_compare_refuses_before_its_folder(tmp_path, capsys, args, message):
    out = tmp_path / "runs"
    assert cli.main(["compare", *args, "--epochs", "1", "--out-dir", str(out), *FAST]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_compare_without_tuning_needs_no_validation_data():
    assert config.needs_validation_data(["map", "laplace"], False, compare.knob_of) == []
    assert config.needs_validation_data(["map", "laplace", "mc_dropout"], True, compare.knob_of) == [
        "map", "laplace", "mc_dropout"]


# --------------------------------------------------------------------------- 5. the distributed rendezvous


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rendezvous_without_the_other_process_times_out_and_says_what_it_waited_for(monkeypatch, caplog):
    port = _free_port()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv(distributed.RENDEZVOUS_TIMEOUT_ENV, "0.5")
    tic = time.monotonic()
    with caplog.at_level("WARNING", logger="bayeswrap"), pytest.raises(
            TimeoutError, match=rf"rendezvous failed after at most 0.5 s: rank 0 of WORLD_SIZE=2 at "
                                rf"MASTER_ADDR=127.0.0.1 MASTER_PORT={port} did not find all 2 processes"):
        distributed.init_from_env("cpu")
    assert time.monotonic() - tic < 30
    assert not distributed.is_initialized()
    assert (f"rank 0 of WORLD_SIZE=2 at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} waiting up to 0.5 s for all 2 "
            f"processes") in caplog.text
    assert distributed.RENDEZVOUS_TIMEOUT_S == 300.0


@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' in the environment is not valid; accepted: an integer >= 1"),
    ({"LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' in the environment is not valid; accepted: an integer >= 0"),
    ({"RANK": "1.5"}, r"RANK='1.5' in the environment is not valid; accepted: an integer in \[0, 1\]"),
    ({"RANK": "2"}, r"RANK='2' in the environment is not valid; accepted: an integer in \[0, 1\] \(below WORLD_SI"),
    ({"RANK": None}, "RANK is not set in the environment"),
    ({"MASTER_PORT": "http"}, r"MASTER_PORT='http' in the environment is not valid; accepted: an integer in "
                              r"\[1, 65535\]"),
    ({"MASTER_ADDR": None}, "MASTER_ADDR is not set in the environment"),
    ({distributed.RENDEZVOUS_TIMEOUT_ENV: "-1"}, "BAYESWRAP_RENDEZVOUS_TIMEOUT='-1' in the environment is not valid"),
])
def test_bad_torchrun_environment_is_named_before_any_waiting(monkeypatch, env, message):
    base = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for key, value in {**base, **env}.items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        distributed.init_from_env("cpu")


def test_cli_names_a_non_integer_local_rank_before_the_run_folder(monkeypatch, tmp_path, capsys):
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "zero", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "runs"
    assert cli.main(["fit", "--method", "map", "--epochs", "1", "--out-dir", str(out), *FAST]) == 2
    assert "LOCAL_RANK='zero' in the environment is not valid" in capsys.readouterr().err
    assert not out.exists()


# --------------------------------------------------------------------------- 6. the predictive's sample count


def test_num_samples_has_an_upper_bound(tmp_path, capsys):
    out = tmp_path / "runs"
    assert cli.main(["fit", "--num-samples", "1000000000000", "--out-dir", str(out), *FAST]) == 2
    assert (f"num_samples='1000000000000' is out of range; accepted: an integer >= 0 and <= "
            f"{MAX_PREDICTIVE_SAMPLES} (posterior samples of the predictive)" in capsys.readouterr().err)
    assert not out.exists()
    path = tmp_path / "big.yaml"
    path.write_text("num_samples: 200000\n")
    with pytest.raises(ValueError, match=rf"config file '{path}': num_samples=200000 is out of range"):
        config.load_yaml(path)
    with pytest.raises(ValueError, match=r"num_samples=100001 is out of range"):
        config.RunConfig(num_samples=MAX_PREDICTIVE_SAMPLES + 1).validate()
    assert config.RunConfig(num_samples=MAX_PREDICTIVE_SAMPLES).validate().num_samples == MAX_PREDICTIVE_SAMPLES


# --------------------------------------------------------------------------- 7. YAML anchors, aliases and sizes


def _alias_bomb() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_config_fails_fast_naming_the_file(tmp_path, capsys):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb())
    assert bomb.stat().st_size < 1600
    tic = time.monotonic()
    assert cli.main(["fit", "-c", str(bomb), "--out-dir", str(tmp_path / "runs"), *FAST]) == 2
    assert time.monotonic() - tic < 10
    err = capsys.readouterr().err
    assert f"config file '{bomb}' is not valid YAML at line 1, column 4: YAML anchor &a is not accepted" in err
    assert not (tmp_path / "runs").exists()


def test_anchors_and_aliases_are_refused_in_run_files_and_values(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("method: &m map\nmodel: mlp\n")
    with pytest.raises(ValueError, match=rf"run config '{run / 'config.yaml'}' is not valid YAML .*anchor &m"):
        config.load_run_config(run / "config.yaml")
    (run / "compare.yaml").write_text("config_file: {}\noverrides: {}\nmethods: &m [map]\nnum_samples: [0]\n"
                                      "tune: false\n")
    with pytest.raises(ValueError, match=rf"comparison record '{run / 'compare.yaml'}' is not valid YAML"):
        cli.run_compare(None, {}, [], [], resume=str(run))
    with pytest.raises(ValueError, match=r"YAML alias \*a is not accepted"):
        config.coerce("per_method", "{map: {prior_std: 1.0}, vi: *a}")
    with pytest.raises(ValueError, match=r"YAML anchor &a is not accepted"):
        options.coerce_option("flow_hidden", "&a [4, 4]")
    assert options.coerce_option("flow_hidden", "[4, 4]") == (4, 4)


def test_yaml_and_json_files_read_back_have_size_bounds(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (config.MAX_YAML_BYTES // 10 + 1))
    with pytest.raises(ValueError, match=rf"config file '{big}' is larger than 1,048,576 bytes"):
        config.read_yaml_file(big)
    with pytest.raises(ValueError, match=r"config file '/dev/zero' is not a regular file"):
        config.read_yaml_file("/dev/zero")
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"a": 1}) + " " * 100)
    with pytest.raises(ValueError, match=rf"run file '{data}' is larger than 50 bytes"):
        config.read_json_file(data, max_bytes=50)
    data.write_text('{"a": 1, "a": 2}')
    with pytest.raises(ValueError, match=rf"run file '{data}' is not valid: duplicate key 'a'"):
        config.read_json_file(data)


# --------------------------------------------------------------------------- 8. files read back from a run folder


@pytest.fixture(scope="module")
def map_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert cli.main(["fit", "--method", "map", "--epochs", "1", "--out-dir", str(out), *FAST]) == 0
    return out / "digits-mlp-map"


@pytest.mark.parametrize("rng, shown", [
    (torch.zeros(10, dtype=torch.uint8), r"rng=tensor\(dtype=torch.uint8, shape=\(10,\)\) is not valid; accepted: "
                                         r"the uint8 vector of torch.get_rng_state\(\) \(shape \(5056,\)\); torch "
                                         r"refuses it"),
    (torch.zeros(5056), r"rng=tensor\(dtype=torch.float32, shape=\(5056,\)\) is not valid"),
    (torch.zeros(2, 5056, dtype=torch.uint8), r"rng=tensor\(dtype=torch.uint8, shape=\(2, 5056\)\) is not valid"),
])
def test_a_damaged_rng_in_last_pt_names_the_file_and_field_and_rewrites_nothing(map_run, tmp_path, rng, shown):
    run = tmp_path / "run"
    run.mkdir()
    for p in map_run.iterdir():
        if p.is_file():
            (run / p.name).write_bytes(p.read_bytes())
    good = load_checkpoint(run / "last.pt")
    save_checkpoint(run / "last.pt", {**good, "rng": rng})
    before = _snapshot(run)
    cfg, _ = cli.resume_config(run, {"epochs": 2})
    with pytest.raises(CheckpointError, match=rf"checkpoint {run / 'last.pt'}: {shown}"):
        cli.run_fit(cfg, resume=True)
    assert _snapshot(run) == before
    state = torch.get_rng_state()  # the check tries the state on a spare generator, never on the process's own
    with pytest.raises(CheckpointError, match=shown):
        runner.check_last_checkpoint({**good, "rng": rng}, run / "last.pt")
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("field, value, message", [
    ("epoch", -1, r"epoch=-1 is not valid; accepted: an integer >= 0"),
    ("best_epoch", 7, r"best_epoch=7 is not valid; accepted: an integer in \[0, epoch=1\]"),
    ("history", [1], r"history=a list of 1 entries is not valid"),
])
def test_last_pt_fields_are_checked(map_run, field, value, message):
    good = load_checkpoint(map_run / "last.pt")
    with pytest.raises(CheckpointError, match=rf"checkpoint x/last.pt: {message}"):
        runner.check_last_checkpoint({**good, field: value}, Path("x/last.pt"))
    assert runner.check_last_checkpoint(good, Path("x/last.pt")) is good


@pytest.mark.parametrize("input_shape", [["8", "8"], [0], [-3], "64", [], [True], [1.5], None])
def test_a_bad_data_json_input_shape_names_the_file_and_field(map_run, tmp_path, input_shape):
    values = config.read_json_file(map_run / "data.json")
    assert config.check_data_json(values, map_run / "data.json") is values  # what fit writes passes
    path = tmp_path / "data.json"
    path.write_text(json.dumps({**values, "input_shape": input_shape}))
    with pytest.raises(ValueError, match=rf"'{path}': input_shape=.* is not valid; accepted: a list of 1 to 8 "
                                         r"positive integers"):
        config.check_data_json(config.read_json_file(path), path)
    with pytest.raises(ValueError, match=r"unknown field\(s\) 'extra'"):
        config.check_data_json({**values, "extra": 1}, path)


def test_a_tuning_record_may_set_only_the_methods_tuned_options(tmp_path):
    path = tmp_path / "tuning_map.json"
    path.write_text(json.dumps({"options": {"out_dir": "elsewhere"}}))
    with pytest.raises(ValueError, match=rf"{path}: out_dir is not a tuned option of method 'map'; accepted: "
                                         r"prior_std"):
        compare.read_tuning_file(path, "map")
    path.write_text(json.dumps({"options": {"prior_std": "1"}}))
    with pytest.raises(ValueError, match=r"prior_std='1' is not a finite number"):
        compare.read_tuning_file(path, "map")


@pytest.mark.parametrize("change, message", [
    ({"bogus": 1}, r"'bogus' is not a run option; accepted: dataset"),
    ({"epochs": "many"}, r"epochs='many' is not an integer"),
    ({"progress": "perhaps"}, r"progress='perhaps' is not a boolean"),
    ({"device": "meta"}, r"device='meta' is not valid; accepted: auto, cpu, cuda, cuda:N, mps"),
    ({"num_samples": 10**12}, r"num_samples=1000000000000 is out of range"),
])
def test_config_yaml_unknown_or_ill_typed_fields_name_the_file(map_run, tmp_path, change, message):
    path = tmp_path / "config.yaml"
    saved = yaml.safe_load((map_run / "config.yaml").read_text())
    path.write_text(yaml.safe_dump({**saved, **change}))
    with pytest.raises(ValueError, match=rf"'{path}' is not a valid run config: {message}"):
        config.load_run_config(path)


def test_compare_yaml_fields_are_checked(tmp_path):
    path = tmp_path / "compare.yaml"
    good = {"config_file": {}, "overrides": {"epochs": 1}, "methods": ["map"], "num_samples": [0], "tune": False}
    assert config.check_compare_record(good, path)["tune"] is False
    for change, message in [({"tune": "false"}, r"tune='false' is not valid; accepted: true or false"),
                            ({"methods": "map"}, r"methods='map' is not valid"),
                            ({"num_samples": [10**12]}, r"num_samples=\[1000000000000\] is not valid"),
                            ({"extra": 1}, r"unknown field\(s\) 'extra'")]:
        with pytest.raises(ValueError, match=rf"'{path}'.*{message}"):
            config.check_compare_record({**good, **change}, path)


# --------------------------------------------------------------------------- 9. predict --seed and --device


@pytest.mark.parametrize("args, message", [
    (["--seed", "12345678901234567890"], "--seed '12345678901234567890' is not valid; accepted: an integer in "
                                         "[0, 9223372036854775807] (2^63 - 1)"),
    (["--seed", "-1"], "--seed '-1' is not valid; accepted: an integer in [0, 9223372036854775807]"),
    (["--seed", "x"], "--seed 'x' is not valid; accepted: an integer in [0, 9223372036854775807]"),
    (["--device", "meta"], "--device='meta' is not valid; accepted: auto, cpu, cuda, cuda:N, mps (meta and other "
                           "device types are not devices bayeswrap runs on)"),
    (["--device", "tpu"], "--device='tpu' is not valid; accepted: auto, cpu, cuda, cuda:N, mps"),
    (["--device", "cuda:99"], "--device='cuda:99' is not available on this machine"),
])
def test_predict_refuses_a_bad_seed_or_device_before_any_work(tmp_path, capsys, args, message):
    out = tmp_path / "p.csv"
    assert cli.main(["predict", str(tmp_path / "no-run"), str(tmp_path / "x.npy"), "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_seed_and_device_checks():
    assert check_seed("--seed", "9223372036854775807") == 2**63 - 1
    assert check_seed("--seed", "1e3") == 1000 and check_seed("--seed", 7) == 7
    assert check_device("--device", "cpu", available=True) == "cpu"
    assert check_device("device", "cuda:1") == "cuda:1"  # the form only: a config from another machine
    for bad in ("cpu:0", "CUDA", "cuda:-1", "", None, 3):
        with pytest.raises(ValueError, match="is not valid; accepted: auto, cpu, cuda, cuda:N, mps"):
            check_device("device", bad)
    with pytest.raises(ValueError, match=r"device='meta' is not valid; accepted: auto, cpu, cuda, cuda:N, mps"):
        config.RunConfig(device="meta").validate()
