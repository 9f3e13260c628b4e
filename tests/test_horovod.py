import json
import sys
from pathlib import Path

import pytest
import torch
from mpirun import python, run_mpi

pytestmark = pytest.mark.mpi

sys.path.insert(0, str(Path(__file__).parent / "mpi_scripts"))
from horovod_step import batch_for  # noqa: E402

HVD_ENV = {"HOROVOD_CPU_OPERATIONS": "MPI"}


def _reports(result):
    return {rank: json.loads(text.splitlines()[-1]) for rank, text in result.rank_stdout.items()}


def _reference_step(initial, dp_size):
    """One SGD step of a single process on the mean of every replica's gradient."""
    model = torch.nn.Linear(4, 3)
    model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
    grads = []
    for dp_rank in range(dp_size):
        model.zero_grad()
        x, y = batch_for(dp_rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p -= 0.1 * sum(g[i] for g in grads) / dp_size
    return {k: v for k, v in model.state_dict().items()}


def _check_step(reports, dp_size, tp):
    for report in reports.values():
        # broadcast_parameters gave every replica the weights of its Horovod rank 0, which is
        # world rank tp_rank and seeded its model with that number.
        torch.manual_seed(report["rank"] % tp)
        root_init = {k: v.tolist() for k, v in torch.nn.Linear(4, 3).state_dict().items()}
        assert report["initial"] == root_init
        expected = _reference_step(report["initial"], dp_size)
        for name, value in report["after"].items():
            torch.testing.assert_close(torch.tensor(value), expected[name], rtol=1e-6, atol=1e-7)


def test_horovod_allreduce_and_optimizer_step_two_ranks():
    result = run_mpi(
        2, python("tests/mpi_scripts/horovod_step.py", "1"), env=HVD_ENV, timeout=180
    ).check()
    reports = _reports(result)
    assert sorted(reports) == [0, 1]
    for report in reports.values():
        assert report["mpi_built"] and report["mpi_enabled"]
        assert report["hvd_size"] == 2
        assert report["sum"] == 1 + 2
        assert report["average"] == 1.5
    _check_step(reports, dp_size=2, tp=1)


def test_horovod_on_the_dp_communicator_beside_gloo_tp_groups():
    # t=2, d=2: ranks {0,2} and {1,3} are the two Horovod worlds; {0,1} and {2,3} gloo tp groups.
    result = run_mpi(
        4, python("tests/mpi_scripts/horovod_step.py", "2"), env=HVD_ENV, timeout=180
    ).check()
    reports = _reports(result)
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, report in reports.items():
        dp_peers = [rank % 2, rank % 2 + 2]
        tp_peers = [rank - rank % 2, rank - rank % 2 + 1]
        assert report["hvd_size"] == 2 and report["hvd_rank"] == rank // 2
        assert report["sum"] == sum(r + 1 for r in dp_peers)
        assert report["tp_sum"] == sum(r + 1 for r in tp_peers)
    _check_step(reports, dp_size=2, tp=2)
