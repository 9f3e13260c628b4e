"""The settings each data-parallel engine runs with: keys, HOROVOD_* variables and defaults."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from family_runs import SMALL, train

from hpcllm.config import ParallelConfig, load_config
from hpcllm.errors import UserError
from hpcllm.parallel.data.horovod import (
    HOROVOD_KEYS,
    HorovodEngine,
    describe_horovod,
    horovod_settings,
)

VARIABLES = [variable for variable, _ in HOROVOD_KEYS.values()]


@pytest.mark.parametrize(
    ("keys", "environ", "device", "expected"),
    [
        # Nothing set: hpcllm's CPU default for the cycle, Horovod's for the rest.
        (
            {},
            {},
            "cpu",
            {
                "HOROVOD_FUSION_THRESHOLD": ("134217728", "Horovod default"),
                "HOROVOD_CYCLE_TIME": ("5", "hpcllm default"),
                "HOROVOD_CACHE_CAPACITY": ("1024", "Horovod default"),
                "HOROVOD_AUTOTUNE": ("0", "Horovod default"),
            },
        ),
        # GPUs keep Horovod's cycle.
        ({}, {}, "cuda", {"HOROVOD_CYCLE_TIME": ("1", "Horovod default")}),
        # The variable beats hpcllm's default; the key beats the variable.
        ({}, {"HOROVOD_CYCLE_TIME": "2.5"}, "cpu", {"HOROVOD_CYCLE_TIME": ("2.5", "environment")}),
        (
            {"horovod_cycle_ms": 0.5, "horovod_fusion_mb": 16.0},
            {"HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_FUSION_THRESHOLD": "1"},
            "cpu",
            {
                "HOROVOD_CYCLE_TIME": ("0.5", "config"),
                "HOROVOD_FUSION_THRESHOLD": (str(16 * 2**20), "config"),
            },
        ),
        (
            {"horovod_response_cache": 0},
            {"HOROVOD_CACHE_CAPACITY": "64"},
            "cpu",
            {"HOROVOD_CACHE_CAPACITY": ("0", "config")},
        ),
        # Autotune: hpcllm's defaults step aside, what is given stays fixed.
        (
            {"horovod_autotune": True, "horovod_fusion_mb": 8.0},
            {},
            "cpu",
            {
                "HOROVOD_AUTOTUNE": ("1", "config"),
                "HOROVOD_CYCLE_TIME": ("1", "tuned by Horovod"),
                "HOROVOD_FUSION_THRESHOLD": (str(8 * 2**20), "config"),
            },
        ),
        (
            {},
            {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "tune.csv"},
            "cpu",
            {
                "HOROVOD_AUTOTUNE": ("1", "environment"),
                "HOROVOD_AUTOTUNE_LOG": ("tune.csv", "environment"),
                "HOROVOD_CACHE_CAPACITY": ("1024", "tuned by Horovod"),
            },
        ),
        # autotune: false in the config turns off what the environment asked for.
        (
            {"horovod_autotune": False},
            {"HOROVOD_AUTOTUNE": "1"},
            "cpu",
            {"HOROVOD_AUTOTUNE": ("0", "config"), "HOROVOD_CYCLE_TIME": ("5", "hpcllm default")},
        ),
    ],
)
def test_horovod_settings_precedence(keys, environ, device, expected):
    settings = horovod_settings(ParallelConfig(**keys), environ, device)
    assert list(settings) == VARIABLES
    for variable, value in expected.items():
        assert settings[variable] == value, variable


def test_describe_horovod_reads_as_a_user_writes_the_keys():
    text = describe_horovod(horovod_settings(ParallelConfig(horovod_response_cache=0), {}, "cpu"))
    assert text == (
        "fusion 128 MiB (Horovod default), cycle 5 ms (hpcllm default), "
        "response cache off (config), autotune off (Horovod default)"
    )
    tuned = describe_horovod(horovod_settings(ParallelConfig(horovod_autotune=True), {}, "cpu"))
    assert "cycle tuned by Horovod from 1 ms" in tuned and "autotune on (config)" in tuned


def test_keys_on_the_command_line_and_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "parallel:\n  horovod_autotune: true\n  horovod_response_cache: 0\n"
        "  horovod_autotune_log: runs/tune.csv\n"
    )
    parallel = load_config(path).parallel
    assert (parallel.horovod_autotune, parallel.horovod_response_cache) == (True, 0)
    assert parallel.horovod_autotune_log == "runs/tune.csv"
    parallel = load_config(
        None, ["parallel.horovod_autotune=false", "parallel.horovod_response_cache=2048"]
    ).parallel
    assert (parallel.horovod_autotune, parallel.horovod_response_cache) == (False, 2048)
    with pytest.raises(UserError, match="parallel.horovod_response_cache must be >= 0"):
        load_config(None, ["parallel.horovod_response_cache=-1"])
    with pytest.raises(UserError, match="parallel.horovod_autotune must be bool or null"):
        load_config(None, ["parallel.horovod_autotune=3"])


def test_the_engine_hands_horovod_its_settings_before_init(monkeypatch):
    for name in [*VARIABLES, "HOROVOD_CPU_OPERATIONS"]:
        # Set, then deleted: monkeypatch restores only what it saw, and the engine sets these.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOROVOD_CACHE_CAPACITY", "7")  # the user's, passed on by mpirun.sh
    seen = {}
    fake = SimpleNamespace(
        init=lambda comm: seen.update({n: os.environ.get(n) for n in VARIABLES}),
        size=lambda: 2,
        nccl_built=lambda: 0,
        Compression=SimpleNamespace(none="none", fp16="fp16"),
    )
    monkeypatch.setitem(sys.modules, "horovod.torch", fake)
    if "horovod" in sys.modules:  # `import horovod.torch` takes the package's attribute first
        monkeypatch.setattr(sys.modules["horovod"], "torch", fake, raising=False)
    grid = SimpleNamespace(
        groups=SimpleNamespace(dp_comm=object()),
        dp=2,
        ep=1,
        timeout_s=None,
        device=torch.device("cpu"),
    )
    engine = HorovodEngine(grid, ParallelConfig(horovod_fusion_mb=1.0))
    assert seen == {
        "HOROVOD_FUSION_THRESHOLD": str(2**20),  # the key
        "HOROVOD_CYCLE_TIME": "5",  # hpcllm's CPU default
        "HOROVOD_CACHE_CAPACITY": "7",  # the environment's, left as it was
        "HOROVOD_AUTOTUNE": None,  # Horovod's default: not set at all
        "HOROVOD_AUTOTUNE_LOG": None,
    }
    assert engine.describe().startswith("MPI, fusion 1 MiB (config), cycle 5 ms (hpcllm default)")


@pytest.mark.mpi
def test_autotune_and_response_cache_reach_horovod_in_training(stdlib, tmp_path, monkeypatch):
    """Two ranks train with Horovod's autotune logging and its response cache off: the banner
    reports both, and Horovod writes the autotune log it was given."""
    log = tmp_path / "autotune.csv"
    for name in VARIABLES:  # the ranks inherit this environment: none of Horovod's set
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    horovod = ["parallel.dp_engine=horovod", "parallel.horovod_autotune=true"]
    horovod += [f"parallel.horovod_autotune_log={log}", "parallel.horovod_response_cache=0"]
    run = train(2, stdlib, tmp_path / "run", *SMALL, *horovod, "train.steps=4")
    run.check()
    banner = next(line for line in run.stdout.splitlines() if "data parallel horovod:" in line)
    assert "response cache off (config)" in banner and "autotune on (config)" in banner
    assert "cycle tuned by Horovod from 1 ms" in banner
    assert "Open MPI mpi_yield_when_idle 1 (hpcllm default on CPU)" in banner
    assert log.exists()


def test_bench_dp_replaces_its_own_scratch_runs_and_nothing_else(tmp_path):
    from hpcllm.bench.runs import MARK, fresh_run_dir

    run = fresh_run_dir(tmp_path / "ddp-d2-fp32")
    (run / "checkpoints").mkdir()  # what the run left: a second bench dp starts it afresh
    assert fresh_run_dir(run) == run and sorted(p.name for p in run.iterdir()) == [MARK]
    mine = tmp_path / "my-run"
    (mine / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match="is not a run of hpcllm bench dp; give another --out"):
        fresh_run_dir(mine)
    assert (mine / "checkpoints").is_dir()


@pytest.mark.parametrize(
    ("gpus", "dps", "message"),
    [
        (1, None, "this node has one GPU, so there is nothing to compare"),
        (2, [4], "runs d = 4 ranks on this node, one GPU each, and it has 2; give --dp up to 2"),
    ],
)
def test_bench_dp_on_too_few_gpus_says_why_instead_of_failing(monkeypatch, gpus, dps, message):
    from argparse import Namespace

    from hpcllm.commands.bench import dp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = Namespace(dp=dps, config=None, overrides=[], engines=["ddp"], precisions=None)
    with pytest.raises(UserError, match=message):
        dp.run(args)
