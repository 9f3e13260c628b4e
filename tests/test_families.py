"""The model-family seam: the registry, every family's rules and spec against its modules, and
a family defined only in the tests (tests/probe_family.py), which shares nothing with GPT-2 or
Llama but the decoder, planned, trained at t=2 × p=2 to its one-process losses, re-cut, loaded
with ``hpcllm.load_model`` and printed with its own key.

The test family is registered only in subprocesses, through ``HPCLLM_FAMILIES`` (:data:`PROBE`):
registered in the pytest process it would add its preset to every later test's messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from family_checks import check_rules, check_spec
from family_runs import cli, losses, sets, train
from mpirun import REPO

import hpcllm
from hpcllm import families
from hpcllm.config import load_config
from hpcllm.errors import UserError

TESTS = REPO / "tests"
# What a process needs to register the test family: its module's name and where it is.
PROBE = {
    "HPCLLM_FAMILIES": "probe_family",
    "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]),
}
BUILT_IN = {"gpt2": "tiny", "llama": "llama-tiny"}


def _probe(*args: str) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` (a script, or ``-c``) with the test family registered."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **PROBE},
        cwd=REPO,
        timeout=300,
    )


@pytest.mark.parametrize("arch", sorted(BUILT_IN))
def test_every_built_in_family_rules_its_tensors_and_counts_its_parameters(arch):
    check_rules(arch, BUILT_IN[arch])
    check_spec(arch, BUILT_IN[arch])


@pytest.mark.slow
def test_the_test_family_rules_its_tensors_and_counts_its_parameters():
    done = _probe(str(TESTS / "family_checks.py"), "probe", "probe-tiny")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok probe"
    assert "probe" not in families.names()  # this process never registered it


def test_an_unknown_family_is_one_line_naming_the_known_ones():
    with pytest.raises(UserError, match="must be a model family"):
        load_config(None, ["model.arch=mamba"])
    with pytest.raises(UserError, match="known: gpt2, llama"):
        families.get("mamba")


@pytest.mark.slow
def test_import_hpcllm_imports_no_torch_and_load_model_resolves_on_first_use():
    code = (
        "import sys, hpcllm\n"
        "assert 'torch' not in sys.modules and 'hpcllm.generate' not in sys.modules\n"
        "f = hpcllm.load_model\n"
        "from hpcllm.generate import load_model\n"
        "assert f is load_model and 'torch' in sys.modules\n"
        "import hpcllm.plan.search, hpcllm.families\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    plan_only = "import sys, hpcllm.plan.search; assert 'torch' not in sys.modules"
    run = subprocess.run([sys.executable, "-c", plan_only], cwd=REPO, capture_output=True)
    assert run.returncode == 0, run.stderr
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = hpcllm.nothing


@pytest.mark.slow
def test_the_test_family_prints_its_own_key_and_refuses_a_bad_one():
    items = sets("model.arch=probe", "model.preset=probe-tiny")
    done = cli("train", "--print-config", *items, env=PROBE, check=True)
    line = next(x for x in done.stdout.splitlines() if x.strip().startswith("mlp_ratio:"))
    assert line.split("#")[0].split() == ["mlp_ratio:", "3"]  # the preset's, not the default
    assert "squared-ReLU MLP's width" in line
    bad = cli("train", "--print-config", *items, *sets("model.mlp_ratio=0"), env=PROBE)
    assert bad.returncode == 2
    assert bad.stderr.strip().endswith("model.mlp_ratio must be positive, got 0")
    # Its key belongs to it alone: another family refuses it in one line.
    other = cli("train", "--print-config", *sets("model.mlp_ratio=3"), env=PROBE)
    assert other.returncode == 2 and "model.mlp_ratio is not a gpt2 setting" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1


def _train(np: int, config: Path, data: Path, run: Path, *items: str) -> list[float]:
    """Train the test family from ``config`` on ``np`` ranks; return the logged losses."""
    common = ["train.steps=4", "train.log_interval=1", "train.eval_interval=0"]
    done = train(np, data, run, *common, "run.tensorboard=false", *items, config=config, env=PROBE)
    done.check()
    return losses(run)


@pytest.mark.mpi
def test_the_test_family_plans_trains_at_t2_p2_as_on_one_process_recuts_and_loads(stdlib, tmp_path):
    # Planned by `hpcllm plan` from its preset, written as a config through the family.
    config = tmp_path / "planned.yaml"
    cluster = REPO / "jobs" / "clusters" / "cpu-local.yaml"
    plan = cli(
        "plan", "--model", "probe-tiny", "--tp", "2", "--pp", "2", "--gpus", "4",
        "--global-batch", "8", "--cluster", str(cluster), "--precision", "fp32",
        "--write-config", str(config), env=PROBE, check=True,
    )  # fmt: skip
    assert "probe: 4 layers" in plan.stdout
    assert "mlp_ratio: 3" in config.read_text()
    # The same model and batches on one process, and at t=2 x p=2 with sequence parallelism.
    one_process = ["parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"]
    one = _train(1, config, stdlib, tmp_path / "t1", *one_process, "parallel.pipeline_layers=null")
    grid = _train(4, config, stdlib, tmp_path / "t2p2", "parallel.sequence_parallel=true")
    assert len(one) == 4 and grid == pytest.approx(one, rel=1e-5)
    # Re-cut to one process and to p = 4; the run, the re-cuts and the one-process run give
    # one model, its persistent buffer (split over t) included, loaded on the meta device.
    for name, layout in (("one", ["--pp", "1"]), ("p4", ["--pp", "4", "--vpp", "1"])):
        cli(
            "convert", "--checkpoint", str(tmp_path / "t2p2"), "--out", str(tmp_path / name),
            "--tp", "1", *layout, env=PROBE, check=True,
        )  # fmt: skip
    code = (
        "import sys, torch, hpcllm\n"
        "from probe_family import Probe\n"
        "ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))\n"
        "names = ('t1', 't2p2', 'one', 'p4')\n"
        "models = {n: hpcllm.load_model(sys.argv[1] + '/' + n) for n in names}\n"
        "assert all(isinstance(m, Probe) for m in models.values())\n"
        "logits = {n: m(ids) for n, m in models.items()}\n"
        "assert logits['t1'].shape == (2, 32, 257)\n"
        "torch.testing.assert_close(logits['t2p2'], logits['one'], rtol=0, atol=0)\n"
        "torch.testing.assert_close(logits['t2p2'], logits['p4'], rtol=0, atol=0)\n"
        "torch.testing.assert_close(logits['t2p2'], logits['t1'], rtol=1e-4, atol=1e-4)\n"
        "stack = lambda m: torch.stack([b.mlp.usage for b in m.blocks.values()])\n"
        "usage = {n: stack(m) for n, m in models.items()}\n"
        "assert usage['t1'].shape == (4, 192) and usage['t2p2'].min() > 0\n"
        "for n in ('one', 'p4'):\n"
        "    torch.testing.assert_close(usage['t2p2'], usage[n], rtol=0, atol=0)\n"
        "torch.testing.assert_close(usage['t2p2'], usage['t1'], rtol=1e-4, atol=1e-6)\n"
        "print('same model')\n"
    )
    loaded = _probe("-c", code, str(tmp_path))
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "same model"


@pytest.mark.slow
def test_bench_step_measures_the_test_family_against_the_baseline_it_registers(tmp_path):
    out = tmp_path / "step.json"
    sizes = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=16"]
    done = cli(
        "bench", "step", "--cpu-smoke", "--model", "probe-tiny",
        *sets(*sizes, "train.micro_batch_size=2"), "--steps", "1", "--rounds", "2",
        "--warmup", "1", "--loop-steps", "3", "--json-out", str(out), env=PROBE, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (shape,) = json.loads(out.read_text())["shapes"]
    assert (shape["arch"], shape["baseline"]) == ("probe", "probe_family:PlainProbe")
    rows = {r["key"]: r for r in shape["rows"]}
    assert rows["plain_eager"]["step_ms"] > 0 and rows["hpcllm"]["step_ms"] > 0
    assert "| plain probe eager |" in done.stdout
