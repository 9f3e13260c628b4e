"""The pipeline runtime against one process, under mpirun (see mpi_scripts/pp_equivalence.py)."""

import json

import pytest
from family_runs import SMALL, cli, train
from mpirun import python, run_mpi
from overflow_record import check_or_record

pytestmark = pytest.mark.mpi
SCHEDULES = {"gpipe", "1f1b", "interleaved", "zb-h1"}


def _cases(result, ranks: int) -> list[dict]:
    cases = []
    for rank in range(ranks):
        cases += [
            json.loads(line)
            for line in result.rank_stdout[rank].splitlines()
            if line.startswith("{")
        ]
    return cases


def _check(case: dict) -> None:
    where = (case["rank"], case["schedule"], case["m"], case["engine"], case["sg"])
    assert case["loss"] <= 1e-5, where
    assert case["grad"] <= 1e-5, (where, case["grad_worst"])
    # The global norm adds the stages' sums and counts the tied embedding once.
    assert case["norm"] <= 1e-5, where


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_equals_one_process(pp):
    result = run_mpi(
        pp, python("tests/mpi_scripts/pp_equivalence.py", f"pp={pp}"), timeout=300
    ).check()
    cases = _cases(result, pp)
    # 4 schedules x m in {4, 8}, on every rank; v = 2 for interleaved.
    assert len(cases) == 8 * pp
    assert {c["schedule"] for c in cases} == SCHEDULES and {c["m"] for c in cases} == {4, 8}
    for case in cases:
        _check(case)
        assert case["sent"] > 0


def test_t2_p2_d2_under_ddp_and_horovod_with_and_without_scatter_gather():
    result = run_mpi(
        8,
        python(
            "tests/mpi_scripts/pp_equivalence.py",
            "tp=2",
            "pp=2",
            "engines=ddp,horovod",
            "sg=0,1",
            "microbatches=4",
        ),
        env={"HOROVOD_CPU_OPERATIONS": "MPI"},
        timeout=400,
    ).check()
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
    result = run_mpi(
        4,
        python(
            "tests/mpi_scripts/pp_equivalence.py",
            "tp=2",
            "pp=2",
            "sp",
            "schedules=1f1b,interleaved,zb-h1",
            "microbatches=4",
        ),
        timeout=300,
    ).check()
    cases = _cases(result, 4)
    assert len(cases) == 4 * 3
    for case in cases:
        _check(case)


# The p = 1 runs the cases below compare with, by precision: trained once, under ddp and
# without recomputation, so each pipeline case also crosses its engine and recomputation
# (which change no loss beyond rounding: tests/test_data_parallel.py, tests/test_model.py).
_SERIAL: dict[str, tuple] = {}


@pytest.mark.parametrize(
    "schedule, vpp, engine, common, rel",
    [
        ("1f1b", 1, "ddp", [], 1e-5),
        ("interleaved", 2, "horovod", [], 1e-5),
        # zb-h1 recomputes each checkpointed block in both its backward passes (B, then W).
        ("zb-h1", 1, "ps", ["model.recompute=full"], 1e-5),
        # fp16: stages that compute no loss still unscale, and all skip an overflow together.
        ("gpipe", 1, "ddp", ["train.precision=fp16"], 1e-3),
    ],
)
def test_trainer_with_a_pipeline_logs_the_losses_of_p1(
    stdlib, tmp_path, schedule, vpp, engine, common, rel
):
    from hpcllm.observe import read_metrics

    def trained(run, *extra, engine=engine, common=common):
        sets = [*SMALL, "model.n_layer=4", "train.steps=4", "train.global_batch_size=32"]
        sets += ["train.eval_interval=2", f"parallel.dp_engine={engine}", *common, *extra]
        result = train(4 if extra else 2, stdlib, run, *sets).check()
        summary = [line for line in result.rank_stdout[0].splitlines() if "parameters" in line]
        return read_metrics(run), summary[0].split(", ")[1]

    precision = [c for c in common if c.startswith("train.precision=")]
    key = precision[0] if precision else "fp32"
    if key not in _SERIAL:
        _SERIAL[key] = trained(tmp_path / "p1", engine="ddp", common=precision)
    serial, serial_size = _SERIAL[key]
    piped, piped_size = trained(
        tmp_path / "p2", "parallel.pp=2", f"parallel.vpp={vpp}", f"parallel.schedule={schedule}"
    )
    assert piped_size == serial_size  # the whole model's count, not one stage's
    assert [r["step"] for r in piped] == [1, 2, 3, 4]
    for a, b in zip(serial, piped, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel)
        assert b["skipped"] == a["skipped"]
        if "val_loss" in a:
            assert b["val_loss"] == pytest.approx(a["val_loss"], rel=rel)
    # Every rank recorded its last step; `hpcllm timeline` draws one pipeline of them.
    assert len(list((tmp_path / "p2" / "timeline").glob("rank*.json"))) == 4
    cli("timeline", str(tmp_path / "p2"), timeout=120, check=True)
    assert (tmp_path / "p2" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((tmp_path / "p2" / "timeline.json").read_text())
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"][0] in "FBW"]
    per_stage = 4 * vpp * (3 if schedule == "zb-h1" else 2)  # m = 32 / (4 x d = 2) = 4
    assert len(compute) == 2 * per_stage


@pytest.mark.parametrize(
    "extra, message",
    [
        (["parallel.schedule=interleaved", "parallel.vpp=4"], "fewer than the 8 pipeline stages"),
        (["parallel.vpp=2"], "parallel.schedule: interleaved"),
        (["parallel.pipeline_layers=[1,2]"], "pipeline_layers"),
    ],
)
def test_a_pipeline_the_schedule_cannot_run_is_refused_on_every_rank(
    stdlib, tmp_path, extra, message
):
    sets = [*SMALL, "model.n_layer=4", "parallel.pp=2", *extra]
    result = train(2, stdlib, tmp_path / "r", *sets, timeout=120)
    assert result.returncode == 2
    printed = result.stdout + result.stderr + "".join(result.rank_stderr.values())
    assert message in printed


def test_bench_pipeline_reports_every_schedule(tmp_path):
    result = run_mpi(
        2,
        python(
            "-m",
            "hpcllm",
            "bench",
            "pipeline",
            "--forward-ms",
            "2",
            "--microbatches",
            "4",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--json-out",
            str(tmp_path / "b.json"),
            "--timeline-dir",
            str(tmp_path / "tl"),
        ),
        timeout=120,
    ).check()
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [r["schedule"] for r in rows] == ["gpipe", "1f1b", "interleaved", "zb-h1"]
    for row in rows:
        assert row["p"] == 2 and row["m"] == 4 and row["bubble"] > 0
        # gpipe keeps every micro-batch's activations; 1f1b at most p on the first stage.
        expected = {"gpipe": [4, 4], "1f1b": [2, 1]}.get(row["schedule"])
        if expected:
            assert row["peak_activations"] == expected
    assert "| interleaved | 2 | 4 | 2 |" in result.rank_stdout[0]
    assert len(list((tmp_path / "tl").glob("*.png"))) == 4


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(stdlib, tmp_path):
    data = stdlib  # the session's prepared corpus (read only)
    result = run_mpi(
        2,
        python(
            "tests/mpi_scripts/fp16_overflow.py",
            "pp",
            str(data),
            str(tmp_path / "run"),
            json.dumps(SMALL),
        ),
        timeout=300,
    ).check()
    outs = [json.loads(result.rank_stdout[r].splitlines()[-1]) for r in range(2)]
    for out in outs:
        # The first stage's gradients were finite, but the global norm was not: it skips too.
        assert out["skipped_steps"] == 1 and out["step2_unchanged"] and out["moved_after"]
    assert outs[0]["scale"] == outs[1]["scale"], "the stages' loss scales drifted apart"
    # Each step's gradient norm and skip, as logged before the optimizer took the step over.
    check_or_record("pp", tmp_path / "run")


@pytest.mark.parametrize("ranks, engines", [(1, "none"), (2, "ddp,horovod")])
def test_with_one_stage_the_runtime_is_gradient_accumulation(ranks, engines):
    # p = 1: no communication, the schedule's m micro-batches accumulate into one step; with
    # d = 2 the engines reduce after the last backward.
    result = run_mpi(
        ranks,
        python(
            "tests/mpi_scripts/pp_equivalence.py",
            "pp=1",
            f"engines={engines}",
            "schedules=gpipe,1f1b,zb-h1",
        ),
        env={"HOROVOD_CPU_OPERATIONS": "MPI"},
        timeout=300,
    ).check()
    cases = _cases(result, ranks)
    assert len(cases) == ranks * 3 * 2 * len(engines.split(","))
    for case in cases:
        _check(case)
        assert case["sent"] == 0
