"""The MoE layer split over t ranks equals the layer in one process."""

from __future__ import annotations

import json

import pytest
from mpirun import python, run_mpi

pytestmark = pytest.mark.mpi


def test_the_moe_layer_at_t2_with_and_without_sequence_parallelism_equals_one_process():
    result = run_mpi(2, python("tests/mpi_scripts/moe_tp.py", "2"), timeout=300).check()
    for rank in range(2):
        cases = json.loads(result.rank_stdout[rank].splitlines()[-1])
        assert len(cases) == 8
        for name, out in cases.items():
            for what in ("out", "input_grad", "router_grad"):
                assert out[what] <= 1e-5, (rank, name, what, out[what])
            for param, worst in out["experts"].items():
                assert worst <= 1e-5, (rank, name, param, worst)
            # The logged losses and counts cover the whole micro-batch, whatever t splits.
            assert out["balance"][0] == pytest.approx(out["balance"][1], rel=1e-5), name
            assert out["z"][0] == pytest.approx(out["z"][1], rel=1e-5), name
            assert out["counts"][0] == out["counts"][1], name
