import os
import sys
from pathlib import Path

import pytest
import torch
from family_runs import SMALL, sets, train, train_together
from mpirun import python, run_mpi

sys.path.insert(0, str(Path(__file__).parent / "mpi_scripts"))
from dp_equivalence import (  # noqa: E402
    MICRO,
    STEPS,
    VOCAB,
    global_batch,
    make_optimizer,
    model_config,
    train_config,
)

from hpcllm.model.gpt import GPT  # noqa: E402
from hpcllm.train.optim import autocast, build_scaler  # noqa: E402

pytestmark = pytest.mark.mpi
ENGINES = ["ddp", "horovod", "ps"]
# The distributed optimizer shards AdamW's state: with each engine that can run it.
ZERO = ["ddp+zero", "horovod+zero"]
# - fp32 + SGD: every weight within rtol 1e-5 of the single process (largest |difference| over
#   the tensor's largest value). SGD is linear in the gradient, so this also catches a sum
#   taken for a mean.
# - AdamW divides each gradient element by its own running magnitude: for weights whose
#   gradient is nearly zero, summation-order noise becomes a visible update. Its bar is the
#   distance to the single process relative to how far the 3 steps moved the weights
#   (||w - w_ref|| / ||w_ref - w_0||): measured 2e-5..3e-5 in fp32 and 3e-2..4e-2 in bf16
#   (8 mantissa bits, and a micro-batch of 2 samples instead of 4..8 changes the rounding).
#   With SGD the three engines also agree with each other to 1e-6.
TOLERANCE = {("fp32", "sgd"): 1e-5, ("fp32", "adamw"): 2e-4, ("bf16", "adamw"): 0.1}


def reference(global_size: int, precision: str, kind: str) -> dict[str, torch.Tensor]:
    """One process, the whole global batch each step."""
    train = train_config(precision)
    model = GPT(model_config(), VOCAB, seed=7)
    optimizer = make_optimizer(kind, model, precision)
    scaler = build_scaler(precision, torch.device("cpu"))
    for step in range(STEPS):
        ids, labels = global_batch(step, global_size)
        with autocast(precision, torch.device("cpu")):
            loss = model(ids, labels)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def _relative_error(got, expected):
    return max((got[n] - v).abs().max().item() / v.abs().max().item() for n, v in expected.items())


def _distance(a, b):
    return sum(((a[n] - b[n]).double() ** 2).sum() for n in b).sqrt().item()


@pytest.mark.parametrize(
    "dp, precision, kind",
    [
        (2, "fp32", "sgd"),
        (4, "fp32", "sgd"),
        (2, "fp32", "adamw"),
        (4, "fp32", "adamw"),
        (2, "bf16", "adamw"),
    ],
)
def test_every_engine_equals_one_process_on_the_global_batch(tmp_path, dp, precision, kind):
    engines = ENGINES + (ZERO if kind == "adamw" else [])
    run_mpi(
        dp,
        python(
            "tests/mpi_scripts/dp_equivalence.py", str(tmp_path), precision, kind, ",".join(engines)
        ),
        env={"HOROVOD_CPU_OPERATIONS": "MPI"},
        timeout=300,
    ).check()
    start = GPT(model_config(), VOCAB, seed=7).state_dict()
    for accumulation in (1, 2):
        expected = reference(MICRO * accumulation * dp, precision, kind)
        assert _relative_error(start, expected) > 1e-3, "training did not move the weights"
        ddp = torch.load(tmp_path / f"ddp-a{accumulation}-rank0.pt")
        for engine in engines:
            for rank in range(dp):
                got = torch.load(tmp_path / f"{engine}-a{accumulation}-rank{rank}.pt")
                if kind == "sgd":
                    error = _relative_error(got, expected)
                else:
                    error = _distance(got, expected) / _distance(expected, start)
                assert error <= TOLERANCE[(precision, kind)], (engine, rank, accumulation, error)
                if kind == "sgd":  # engines agree with each other closer still
                    assert _relative_error(got, ddp) <= 1e-6, (engine, rank, accumulation)


def test_trainer_with_each_engine_logs_the_same_losses(stdlib, tmp_path):
    common = [*SMALL, "train.steps=4", "train.global_batch_size=16", "train.eval_interval=0"]
    runs = {engine: [*common, f"parallel.dp_engine={engine}"] for engine in ENGINES}
    # A dialled straggler: rank 1's compute takes 3 times as long.
    runs["straggler"] = [*common, "train.straggler_rank=1", "train.straggler_factor=3"]
    # The four runs share one launch.
    ran = train_together(2, stdlib, tmp_path, runs, timeout=300)
    metrics = {name: run["records"] for name, run in ran.items()}
    losses = {}
    for engine in ENGINES:
        records = metrics[engine]
        losses[engine] = [r["loss"] for r in records]
        last = records[-1]
        assert last["dp_engine"] == engine
        assert len(last["rank_compute_s"]) == 2 and len(last["rank_comm_wait_s"]) == 2
        assert last["slowest_rank"] in (0, 1)
        assert all(0 < share <= 1.01 for share in last["rank_busy_share"])
    for engine in ENGINES:
        torch.testing.assert_close(
            torch.tensor(losses[engine]), torch.tensor(losses["ddp"]), rtol=1e-5, atol=1e-6
        )
    # The straggler is the slowest rank of every step, and the arithmetic is the same.
    records = metrics["straggler"]
    assert [r["slowest_rank"] for r in records] == [1] * 4
    assert all(r["rank_compute_s"][1] > 2 * r["rank_compute_s"][0] for r in records)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in records]), torch.tensor(losses["ddp"]), rtol=1e-5, atol=0
    )
    # A straggler rank the job does not have: one line, as the user types it.
    bad = train(2, stdlib, tmp_path / "bad", *common, "train.straggler_rank=2", timeout=120)
    assert bad.returncode != 0
    assert "train.straggler_rank 2 is not a rank of this job (world size 2)" in bad.stderr


def test_missing_horovod_names_make_setup(monkeypatch):
    from types import SimpleNamespace

    from hpcllm.errors import UserError
    from hpcllm.parallel.data.horovod import HorovodEngine

    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # import now fails
    grid = SimpleNamespace(groups=SimpleNamespace(dp_comm=object()), dp=2)
    with pytest.raises(UserError, match="make setup"):
        HorovodEngine(grid)


def test_bench_dp_writes_its_table_chart_and_json(stdlib, tmp_path):
    import json
    import subprocess

    data = stdlib  # the session's prepared corpus (read only)
    cmd = [
        sys.executable,
        "-m",
        "hpcllm",
        "bench",
        "dp",
        "--dp",
        "2",
        "--engines",
        "ps",
        "horovod-zero",
        "--precisions",
        "fp32",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--out",
        str(tmp_path / "b"),
        *sets(*SMALL, f"data.path={data}", "parallel.horovod_cycle_ms=2"),
    ]
    env = {**os.environ, "HOROVOD_FUSION_THRESHOLD": str(16 * 2**20)}
    env.pop("HOROVOD_CACHE_CAPACITY", None)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    result = json.loads((tmp_path / "b" / "bench_dp.json").read_text())
    assert [(r["engine"], r["dp"]) for r in result["rows"]] == [
        ("single", 1),
        ("ps", 2),
        ("horovod-zero", 2),
    ]
    # The settings each engine ran with, and where each came from.
    horovod = result["settings"]["horovod-zero"]
    assert horovod.startswith("distributed optimizer, buckets of up to 25 MB")
    assert "fusion 16 MiB (environment), cycle 2 ms (config)" in horovod
    assert "response cache 1024 (Horovod default)" in horovod
    assert f"  horovod-zero: {horovod}" in run.stdout
    # The distributed optimizer holds half of what the parameter server's root holds.
    ps, zero = result["rows"][1]["optimizer_mb"], result["rows"][2]["optimizer_mb"]
    assert zero == pytest.approx(ps / 2, rel=0.01)
    assert result["rows"][0]["speedup"] == 1.0
    assert len(result["rows"][1]["busy_share"]) == 2
    # bench collectives at the gradient's size: what the engines move, through each transport.
    measured = {(r["collective"], r["transport"]) for r in result["collectives"]["rows"]}
    assert measured == {
        (collective, transport)
        for collective in ("all_reduce", "reduce_scatter", "all_gather")
        for transport in ("torch", "mpi", "horovod")
    }
    assert (tmp_path / "b" / "bench_dp.png").stat().st_size > 0
    assert "scaling" in run.stdout or "effic." in run.stdout
