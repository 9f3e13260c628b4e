"""The pipeline runtime against one process, under mpirun (see mpi_scripts/pp_equivalence.py)."""

import json

import pytest
from mpirun import python, run_mpi

pytestmark = pytest.mark.mpi
SCHEDULES = {"gpipe", "1f1b", "interleaved", "zb-h1"}


def _cases(result, ranks: int) -> list[dict]:
    cases = []
    for rank in range(ranks):
        cases += [json.loads(line) for line in result.rank_stdout[rank].splitlines()
                  if line.startswith("{")]
    return cases


def _check(case: dict) -> None:
    where = (case["rank"], case["schedule"], case["m"], case["engine"], case["sg"])
    assert case["loss"] <= 1e-5, where
    assert case["grad"] <= 1e-5, (where, case["grad_worst"])
    # The global norm adds the stages' sums and counts the tied embedding once.
    assert case["norm"] <= 1e-5, where


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_equals_one_process(pp):
    result = run_mpi(pp, python("tests/mpi_scripts/pp_equivalence.py", f"pp={pp}"),
                     timeout=300).check()
    cases = _cases(result, pp)
    # 4 schedules x m in {4, 8}, on every rank; v = 2 for interleaved.
    assert len(cases) == 8 * pp
    assert {c["schedule"] for c in cases} == SCHEDULES and {c["m"] for c in cases} == {4, 8}
    for case in cases:
        _check(case)
        assert case["sent"] > 0


def test_t2_p2_d2_under_ddp_and_horovod_with_and_without_scatter_gather():
    result = run_mpi(8, python("tests/mpi_scripts/pp_equivalence.py", "tp=2", "pp=2",
                               "engines=ddp,horovod", "sg=0,1", "microbatches=4"),
                     env={"HOROVOD_CPU_OPERATIONS": "MPI"}, timeout=400).check()
    cases = _cases(result, 8)
    assert len(cases) == 8 * 4 * 2 * 2
    sent = {}
    for case in cases:
        _check(case)
        sent[(case["rank"], case["schedule"], case["engine"], case["sg"])] = case["sent"]
    # Scatter/gather: each tp rank sends 1/t of the activation across the stage boundary.
    for (rank, schedule, engine, sg), nbytes in sent.items():
        if sg:
            assert nbytes * 2 == sent[(rank, schedule, engine, False)]


def test_sequence_parallel_pipeline_equals_one_process():
    result = run_mpi(4, python("tests/mpi_scripts/pp_equivalence.py", "tp=2", "pp=2", "sp",
                               "schedules=1f1b,interleaved,zb-h1", "microbatches=4"),
                     timeout=300).check()
    cases = _cases(result, 4)
    assert len(cases) == 4 * 3
    for case in cases:
        _check(case)
