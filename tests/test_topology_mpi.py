import json
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_order import (
    LAYOUTS_8,
    LAYOUTS_8_CP,
    LAYOUTS_8_EP,
    group_of,
    megatron_context_groups,
    megatron_expert_groups,
    megatron_groups,
)
from mpirun import REPO, mpi_env, python, run_mpi

from hpcllm.topology import Layout

pytestmark = pytest.mark.mpi


def _json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_grid_groups_under_mpirun_8_ranks():
    specs = [",".join(map(str, sizes)) for sizes in [*LAYOUTS_8, *LAYOUTS_8_EP, *LAYOUTS_8_CP]]
    result = run_mpi(8, python("tests/mpi_scripts/check_grid.py", *specs), timeout=240).check()
    assert sorted(result.rank_stdout) == list(range(8))
    for rank in range(8):
        reports = _json_lines(result.rank_stdout[rank])
        assert [tuple(r["layout"]) for r in reports] == [*LAYOUTS_8, *LAYOUTS_8_EP, *LAYOUTS_8_CP]
        for report in reports:
            tp, pp, dp, *ep = report["layout"]
            cp = ep[1] if len(ep) > 1 else 1
            oracle = megatron_groups(tp, pp, dp)
            if cp > 1:
                # Context parallelism next to tp: every group as Megatron-Core's order forms it.
                oracle = megatron_context_groups(tp, pp, dp, cp)
                for axis in ("cp", "dp_cp"):
                    members = group_of(oracle[axis], rank)
                    assert report["torch"][axis] == members, (axis, report)
                    assert report["mpi"][axis] == members, (axis, report)
                    assert report["sum"][axis] == sum(m + 1 for m in members), (axis, report)
                assert report["cp_rank"] == (rank // tp) % cp
            elif ep:
                # Expert parallelism moves no rank: the groups above, and two more.
                oracle |= megatron_expert_groups(tp, pp, dp, ep[0])
                for axis in ("ep", "expert_dp"):
                    members = group_of(oracle[axis], rank)
                    assert report["torch"][axis] == members, (axis, report)
                    assert report["mpi"][axis] == members, (axis, report)
                    assert report["sum"][axis] == sum(m + 1 for m in members), (axis, report)
            else:
                assert "ep" not in report["torch"], report
            assert report["rank"] == rank
            # Megatron: tp fastest, then cp, then dp, then pp.
            assert report["coords"] == [rank % tp, rank // (tp * cp * dp), (rank // (tp * cp)) % dp]
            for axis in ("tp", "pp", "dp", "mp"):
                members = group_of(oracle[axis], rank)
                assert report["torch"][axis] == members, (axis, report)
                assert report["mpi"][axis] == members, (axis, report)
                assert report["sum"][axis] == sum(m + 1 for m in members), (axis, report)
            tied = [g for g in oracle["embedding"] if rank in g]
            if tied:
                (members,) = tied
                assert report["torch"]["embedding"] == members, report
                assert report["mpi"]["embedding"] == members, report
                assert report["sum"]["embedding"] == sum(m + 1 for m in members), report
            else:
                assert "embedding" not in report["torch"], report
            pipeline = group_of(oracle["pp"], rank)
            stage = pipeline.index(rank)
            assert report["pp_prev"] == pipeline[stage - 1]
            assert report["pp_next"] == pipeline[(stage + 1) % pp]


def test_topo_json_under_mpirun():
    result = run_mpi(
        4, python("-m", "hpcllm", "topo", "--tp", "2", "--pp", "2", "--json"), timeout=120
    ).check()
    assert set(result.rank_stdout) == {0}, "only rank 0 prints"
    report = json.loads(result.rank_stdout[0])
    layout = Layout(2, 2, 1)
    assert (report["world_size"], report["tp"], report["pp"], report["dp"]) == (4, 2, 2, 1)
    assert report["launcher"] == "openmpi"
    for rank, row in enumerate(report["ranks"]):
        assert row["rank"] == rank
        assert [row["tp_rank"], row["pp_rank"], row["dp_rank"]] == list(layout.coords(rank))
        assert row["tp_group"] == layout.tp_group(rank)
        assert row["pp_group"] == layout.pp_group(rank)
        assert row["dp_group"] == layout.dp_group(rank)
        pipeline = layout.pp_group(rank)
        assert row["embedding_group"] == [pipeline[0], pipeline[-1]]
        assert row["cp_rank"] == 0 and row["cp_group"] == [rank]
        assert row["dp_cp_group"] == row["dp_group"]
        assert row["ep_group"] == [rank] and row["expert_dp_group"] == row["dp_group"]
        assert row["local_rank"] == rank and row["device"] == "cpu" and row["host"]


def test_topo_table_under_mpirun_with_experts_split_over_d():
    command = python("-m", "hpcllm", "topo", "--tp", "2", "--ep", "2")
    text = run_mpi(4, command, timeout=120).check().rank_stdout[0]
    assert "world 4 = tp 2 x pp 1 x dp 2, ep 2 inside dp" in text
    assert "stage 0:  dp 0: [0 1]   dp 1: [2 3]" in text
    assert "cp and dp_cp" in text
    # Rank 1 (tp 1, dp 0) splits the experts with rank 3 (tp 1, dp 1) and holds its own.
    row = next(line.split() for line in text.splitlines() if line.startswith("1 "))
    assert row[-3:] == ["0", "[1", "3]"] or row[-4:] == ["0", "[1", "3]", "[1]"], row


def test_topo_table_under_mpirun_with_sequences_split_next_to_t():
    command = python("-m", "hpcllm", "topo", "--tp", "2", "--cp", "2")
    text = run_mpi(4, command, timeout=120).check().rank_stdout[0]
    assert "world 4 = tp 2 x cp 2 x pp 1 x dp 1" in text
    # Rank 1 (tp 1, cp 0) splits its sequences with rank 3 (tp 1, cp 1).
    row = next(line.split() for line in text.splitlines() if line.startswith("1 "))
    assert row[-5:] == ["0", "[1", "3]", "[1", "3]"], row


@pytest.mark.parametrize(
    "np, args, words",
    [
        (6, ["--tp", "4"], "world size 6 is not divisible by tp*pp = 4*1 = 4"),
        (4, ["--tp", "2", "--dp", "3"], "tp*pp*dp = 2*1*3 = 6 does not equal the world size 4"),
        (4, ["--pp", "1", "--vpp", "2"], "needs parallel.pp >= 2"),
        (2, ["--dp", "0"], "argument --dp: must be a positive integer, got '0'"),
        (2, ["--tp", "abc"], "argument --tp: must be a positive integer, got 'abc'"),
    ],
)
def test_bad_grid_is_one_line_and_exit_2_on_every_rank(np, args, words):
    result = run_mpi(np, python("-m", "hpcllm", "topo", *args), timeout=60)
    assert result.returncode == 2
    ours = [line for text in result.rank_stderr.values() for line in text.splitlines()]
    assert len(ours) == 1, ours
    assert ours[0].startswith("hpcllm: error: ") and words in ours[0]
    assert "Traceback" not in result.stderr


def test_error_seen_by_one_rank_aborts_instead_of_hanging():
    result = run_mpi(3, python("tests/mpi_scripts/rank_local_error.py"), timeout=60)
    assert result.returncode != 0
    assert "hpcllm: error (rank 1): shard data/train-0001.h5 is missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_mpirun_job_script_launches_a_verb():
    env = mpi_env({"NP": "4", "HPCLLM": str(Path(sys.executable).parent / "hpcllm")})
    run = subprocess.run(
        [str(REPO / "jobs" / "mpirun.sh"), "topo", "--tp", "2", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        start_new_session=True,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert (report["world_size"], report["tp"], report["dp"]) == (4, 2, 2)


@pytest.mark.parametrize(("preset", "expected"), [(None, "1"), ("0", "0")])
def test_cpu_ranks_yield_their_core_while_waiting_in_mpi(preset, expected):
    # Set before MPI_Init reads it, unless the user set it (mpirun passes OMPI_MCA_* on).
    code = (
        "import os; from hpcllm import topology; topology.init(); "
        "print('yield', os.environ.get('OMPI_MCA_mpi_yield_when_idle'))"
    )
    env = {} if preset is None else {"OMPI_MCA_mpi_yield_when_idle": preset}
    result = run_mpi(2, python("-c", code), env=env, timeout=120).check()
    for rank in range(2):
        assert f"yield {expected}" in result.rank_stdout[rank]
