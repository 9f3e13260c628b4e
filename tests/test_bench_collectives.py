"""bench collectives: nccl-tests' factors, the size list, the checks' arithmetic, one
two-rank CPU run read back from its JSON (torch over gloo, MPI, Horovod where installed), and
the all-reduce alone, which replaced ``bench allreduce`` (now a one-line refusal naming it)."""

import json
import os

import numpy as np
import pytest
from family_runs import cli
from mpirun import REPO, python, run_mpi

from hpcllm.bench import collectives
from hpcllm.bench.collectives import (
    COLLECTIVES,
    TRANSPORTS,
    bus_factor,
    iterations,
    parse_size,
    parse_sizes,
    size_range,
)
from hpcllm.errors import UserError

SIZES = [8 << 10, 64 << 10]
HVD_ENV = {"HOROVOD_CPU_OPERATIONS": "MPI"}


# -- pure: no mpirun ------------------------------------------------------------------------


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    for collective in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(collective, 2) == 0.5
        assert bus_factor(collective, 8) == 7 / 8
    assert bus_factor("send_recv", 2) == bus_factor("send_recv", 64) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcast", 2)


def test_sizes_take_k_m_g_suffixes_in_powers_of_1024():
    assert parse_size("8192") == 8192
    assert parse_size("8K") == parse_size("8k") == 8 << 10
    assert parse_size("64M") == 64 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_sizes("1M,8K,64K,8K") == [8 << 10, 64 << 10, 1 << 20]  # ascending, once each
    for bad in ("", "0", "8KB", "-8K", "1.5M", "8T"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_size_range_and_iterations_that_shrink_as_sizes_grow():
    assert size_range(8 << 10, 1 << 30, 2) == [8 << (10 + i) for i in range(18)]
    assert size_range(8 << 10, 1 << 20, 4) == [8 << 10, 32 << 10, 128 << 10, 512 << 10]
    with pytest.raises(ValueError):
        size_range(1 << 20, 8 << 10, 2)
    assert iterations(8 << 10, 20) == 20
    assert iterations(256 << 20, 20) == 4  # the budget, 1 GiB, over the size
    assert iterations(1 << 30, 20) == 3  # never fewer than 3 ...
    assert iterations(1 << 30, 2) == 2  # ... unless asked for fewer


def test_collectives_it_does_not_have_are_refused_before_it_starts_torch():
    with pytest.raises(
        UserError, match=r"need collectives among all_reduce, .*\(got all_reduce, broadcast\)"
    ):
        collectives.run_collectives([8 << 10], 1, 0, collectives=["all_reduce", "broadcast"])


def test_bench_allreduce_is_refused_naming_the_command_that_replaced_it():
    run = cli("bench", "allreduce", "--bytes", "4096", "--iters", "3", timeout=60)
    assert run.returncode == 2
    (line,) = run.stderr.splitlines()
    assert "hpcllm bench collectives --collectives all_reduce --sizes BYTES" in line


def _simulate(collective: str, inputs: list[np.ndarray], mixup: bool = False) -> list[np.ndarray]:
    """Return each rank's output of ``collective`` on ``inputs``, computed in one process;
    with ``mixup``, a plausible mistake instead (an average, parts or peers mixed up)."""
    n = len(inputs)
    if collective == "all_reduce":
        return [sum(inputs) / (n if mixup else 1)] * n
    if collective == "send_recv":  # ring: from the previous rank; the mistake: its own buffer
        return [inputs[r if mixup else (r - 1) % n] for r in range(n)]
    order = list(range(n))[::-1] if mixup else list(range(n))
    if collective == "all_gather":
        return [np.concatenate([inputs[s] for s in order])] * n
    parts = [np.split(x, n) for x in inputs]
    if collective == "reduce_scatter":  # the mistake: the next rank's part
        return [sum(p[(r + mixup) % n] for p in parts) for r in range(n)]
    return [np.concatenate([parts[s][r] for s in order]) for r in range(n)]  # all_to_all


@pytest.mark.parametrize("n", [2, 3, 8])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_the_expected_values_are_what_the_collective_gives_and_a_mixup_is_not(collective, n):
    nbytes = 8 << 10
    in_len, out_len = collectives._lengths(collective, n, nbytes)
    inputs = [collectives._inputs(collective, r, n, in_len) for r in range(n)]
    expected = [collectives._expected(collective, r, n, out_len) for r in range(n)]
    for r, output in enumerate(_simulate(collective, inputs)):
        assert np.array_equal(output, expected[r])
    wrong = _simulate(collective, inputs, mixup=True)
    assert any(not np.array_equal(wrong[r], expected[r]) for r in range(n))


# -- under mpirun: one two-rank run shared by the cases below -------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives") / "result.json"
    args = ["--sizes", "8K,64K", "--iters", "3", "--warmup", "1", "--json", str(out)]
    result = run_mpi(
        2, python("-m", "hpcllm", "bench", "collectives", *args), env=HVD_ENV, timeout=120
    ).check()
    return json.loads(out.read_text()), result


@pytest.mark.mpi
def test_every_collective_has_rows_or_a_reason_for_each_transport(two_ranks):
    report, _ = two_ranks
    assert report["world_size"] == 2
    assert (report["nodes"], report["ranks_per_node"]) == (1, 2)  # one host: intra-node tables
    assert (report["device"], report["backend"]) == ("cpu", "gloo")
    assert {"torch", "mpi"} <= set(report["transports"])
    for skip in report["skipped"]:
        assert skip["collective"] in COLLECTIVES and skip["transport"] in TRANSPORTS
        assert skip["reason"].strip() and "\n" not in skip["reason"]
    skipped = {(s["collective"], s["transport"]) for s in report["skipped"]}
    for collective in COLLECTIVES:
        for transport in TRANSPORTS:  # Horovod included: rows if installed, else skipped
            sizes = sorted(
                r["bytes"]
                for r in report["rows"]
                if (r["collective"], r["transport"]) == (collective, transport)
            )
            assert (sizes == SIZES) != ((collective, transport) in skipped), (
                collective,
                transport,
            )
            if transport in report["transports"] and (collective, transport) in skipped:
                assert transport == "horovod" and collective == "send_recv"
    assert ("send_recv", "horovod") in skipped  # no point-to-point in Horovod


@pytest.mark.mpi
def test_busbw_is_algbw_times_the_factor_and_times_are_positive(two_ranks):
    report, _ = two_ranks
    assert report["rows"]
    for row in report["rows"]:
        assert row["time_us"] > 0 and row["iters"] == 3
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        assert row["busbw_gbps"] / row["algbw_gbps"] == pytest.approx(
            {"all_reduce": 1.0, "send_recv": 1.0}.get(row["collective"], 0.5)
        )


@pytest.mark.mpi
def test_rank_0_prints_the_table_and_the_others_nothing(two_ranks):
    report, result = two_ranks
    table = result.rank_stdout[0]
    assert table.startswith("collectives on 2 ranks (cpu, torch backend gloo)")
    assert sum(line.startswith("  all_to_all ") for line in table.splitlines()) == sum(
        r["collective"] == "all_to_all" for r in report["rows"]
    )
    assert not result.rank_stdout.get(1, "").strip()


@pytest.mark.mpi
def test_all_reduce_alone_through_every_transport_what_bench_allreduce_measured(tmp_path):
    out = tmp_path / "result.json"
    args = ["--collectives", "all_reduce", "--sizes", "64K", "--iters", "3", "--json", str(out)]
    run_mpi(
        2, python("-m", "hpcllm", "bench", "collectives", *args), env=HVD_ENV, timeout=120
    ).check()
    report = json.loads(out.read_text())
    rows = {(r["collective"], r["transport"]): r for r in report["rows"]}
    assert set(rows) == {("all_reduce", t) for t in TRANSPORTS} and report["skipped"] == []
    for row in rows.values():
        assert row["bytes"] == 64 << 10 and row["time_us"] > 0
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2(n-1)/n = 1 at n = 2


@pytest.mark.mpi
def test_one_rank_is_refused_with_a_user_error():
    result = run_mpi(1, python("-m", "hpcllm.bench.collectives", "--sizes", "8K"), timeout=60)
    assert result.returncode == 2
    assert "needs 2 or more ranks" in result.rank_stderr.get(0, "") + result.stderr


@pytest.mark.mpi
def test_without_horovod_each_collective_is_skipped_with_the_reason(tmp_path):
    fake = tmp_path / "site" / "horovod"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no Horovod on this machine')\n")
    out = tmp_path / "result.json"
    args = ["--sizes", "8K", "--iters", "1", "--warmup", "0", "--json", str(out)]
    run_mpi(
        2,
        python("-m", "hpcllm.bench.collectives", "--transports", "horovod,mpi", *args),
        env={**HVD_ENV, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)])},
        timeout=60,
    ).check()
    report = json.loads(out.read_text())
    assert report["transports"] == ["mpi"] and "horovod" not in report
    assert {r["transport"] for r in report["rows"]} == {"mpi"}
    assert [s["collective"] for s in report["skipped"]] == list(COLLECTIVES)
    for skip in report["skipped"]:
        assert skip["transport"] == "horovod"
        assert skip["reason"].startswith("Horovod is not available")
        assert "no Horovod on this machine" in skip["reason"]
