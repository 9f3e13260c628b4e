"""``hpcllm bench moe``: its cases, its refusals, and a smoke run in an empty folder that fills
every column (Horovod's here; the docs walk runs DDP's, tests/docs_examples.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from family_runs import cli

from hpcllm.errors import UserError


def test_the_all_to_all_timer_adds_up_each_exchange_and_starts_again_when_taken():
    from hpcllm.parallel.data.experts import TimedAllToAll

    def slow(x, send, recv):
        time.sleep(0.02)
        return x.clone()

    timer = TimedAllToAll(slow, torch.device("cpu"))
    x = torch.ones(3, 2)
    assert torch.equal(timer(x, [3], [3]), x)
    timer(x, [3], [3])
    assert 0.04 <= timer.take() < 1.0
    assert timer.take() == 0.0
    with timer.paused():  # validation's exchanges are not the step's
        timer(x, [3], [3])
    assert timer.take() == 0.0


def test_cases_default_eps_and_refusals():
    from hpcllm.bench import moe

    sets = moe.model_overrides(None, [])
    assert sets[:2] == moe.DEFAULT_MODEL  # no experts named: mixtral-tiny's 4
    assert moe.choose_eps(None, sets, 4, None) == [1, 2, 4]
    assert moe.choose_eps(None, sets, 6, None) == [1, 2]  # 3 and 6 do not divide 4 experts
    with pytest.raises(UserError, match="--ep 3 must divide the data-parallel size 4"):
        moe.choose_eps(None, sets, 4, [1, 3])
    with pytest.raises(UserError, match="--top-k 5: model.moe_top_k 5 is above"):
        moe.check_top_ks(None, sets, [2, 5])
    with pytest.raises(UserError, match="model.moe_experts is 0"):
        moe.model_overrides(None, ["model.preset=llama-tiny", "model.arch=llama"])
    assert moe.cases(["ddp"], [1, 2], [1, 2]) == [
        ("ddp", 1, 1), ("ddp", 2, 1), ("ddp", 1, 2), ("ddp", 2, 2)
    ]  # fmt: skip


@pytest.mark.mpi
def test_the_cpu_smoke_fills_every_column_in_an_empty_folder(tmp_path):
    done = cli("bench", "moe", "--cpu-smoke", "--engines", "horovod", "--top-k", "1",
               cwd=tmp_path, check=True)  # fmt: skip
    out = tmp_path / "runs" / "bench-moe"
    result = json.loads((out / "bench_moe.json").read_text())
    rows = {row["ep"]: row for row in result["rows"]}
    assert set(rows) == {1, 2} and all(r["engine"] == "horovod" for r in rows.values())
    assert rows[1]["all_to_all_s"] == 0.0 and rows[2]["all_to_all_s"] > 0
    assert 0 < rows[2]["all_to_all_share"] < 1 and rows[1]["vs_ep1"] == 1.0
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert (out / "bench_moe.png").stat().st_size > 0
    assert "a2a ms/step" in done.stdout and "hvd.alltoall" in done.stdout
    # Run again: the runs it made are its own to replace (one case: ep 2 alone).
    cli("bench", "moe", "--cpu-smoke", "--engines", "horovod", "--top-k", "1", "--ep", "2",
        "--steps", "2", cwd=tmp_path, check=True)  # fmt: skip
    again = json.loads((out / "bench_moe.json").read_text())
    assert [r["ep"] for r in again["rows"]] == [2] and again["rows"][0]["vs_ep1"] is None


def test_a_benchmark_run_past_its_time_is_one_line(monkeypatch):
    import subprocess

    from hpcllm.bench import runs

    def slow(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(runs.subprocess, "run", slow)
    with pytest.raises(UserError, match="took more than 30 s and was stopped: hpcllm train"):
        runs.launch_ranks(1, ["train"], timeout=30)
