"""``hpcllm plan``: the cost model against the SC21 paper's measurements and against hpcllm's
own schedules, the search, and the command as a user types it."""

import itertools
import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import yaml
from family_runs import cli, train
from mpirun import REPO

from hpcllm.parallel.pipeline.schedule import build, peak_in_flight
from hpcllm.parallel.pipeline.simulate import simulate
from hpcllm.plan.costs import Layout, Model, Software, _in_flight, estimate
from hpcllm.plan.hardware import cluster_from_dict, gemm_efficiency, load_cluster
from hpcllm.plan.search import Fixed, layouts, search

DGX_A100 = REPO / "jobs" / "clusters" / "dgx-a100.yaml"
DGX_H100 = REPO / "jobs" / "clusters" / "dgx-h100.yaml"
CPU = REPO / "jobs" / "clusters" / "cpu-local.yaml"

# Narayanan et al. (SC21), Table 1, all ten rows: heads, hidden, layers, t, p, GPUs, batch,
# TFLOP/s per GPU measured on Selene (vocabulary 51,200, sequence 2,048, full recomputation).
TABLE_1 = [
    (24, 2304, 24, 1, 1, 32, 512, 137),
    (32, 3072, 30, 2, 1, 64, 512, 138),
    (32, 4096, 36, 4, 1, 128, 512, 142),
    (48, 6144, 40, 8, 1, 256, 1024, 135),
    (64, 8192, 48, 8, 2, 512, 1536, 138),
    (80, 10240, 60, 8, 4, 1024, 1792, 140),
    (96, 12288, 80, 8, 8, 1536, 2304, 148),
    (128, 16384, 96, 8, 16, 1920, 2160, 155),
    (128, 20480, 105, 8, 35, 2520, 2520, 163),
    (160, 25600, 128, 8, 64, 3072, 3072, 163),
]
# How each row ran, from the authors' own script (Megatron-LM, examples/sc21/run_table_1.sh):
# micro-batch, schedule and v (its --num-layers-per-virtual-pipeline-stage turned into chunks
# per stage); the data-parallel engine follows from p in the megatron-2021 profile.
TABLE_1_RUN = [
    (16, "1f1b", 1),
    (16, "1f1b", 1),
    (16, "1f1b", 1),
    (8, "1f1b", 1),
    (4, "1f1b", 1),
    (2, "interleaved", 3),
    (2, "interleaved", 2),
    (1, "interleaved", 2),
    (1, "interleaved", 3),
    (1, "1f1b", 1),
]
# What the model reaches today, row by row (docs/plan.md: +2% to +11%, nine rows within the
# 10% the planner aims at, 76.1B at 11%), and its mean error.
TABLE_1_TOLERANCE = 0.12
TABLE_1_MEAN_ERROR = 0.07


def _plan(*args: str) -> subprocess.CompletedProcess:
    return cli("plan", *args, timeout=120)


def table_1_predictions() -> list[tuple[int, float, float]]:
    """Return (hidden, predicted, measured TFLOP/s per GPU) for each row of TABLE_1."""
    cluster = load_cluster(DGX_A100)
    rows = []
    for row, (micro_batch, schedule, v) in zip(TABLE_1, TABLE_1_RUN, strict=True):
        heads, hidden, layers, t, p, gpus, batch, measured = row
        plan = search(
            Model.of("gpt2", layers, hidden, heads, 2048, 51200),
            gpus,
            batch,
            cluster,
            Software.megatron_2021(),
            Fixed(t, p, v, micro_batch, schedule, "full", sequence_parallel=False),
        )
        rows.append((hidden, plan.ranked[0].tflops_per_gpu, measured))
    return rows


def test_table_1_of_the_paper_is_predicted_row_by_row():
    for hidden, predicted, measured in table_1_predictions():
        assert predicted == pytest.approx(measured, rel=TABLE_1_TOLERANCE), hidden


def test_the_table_1_predictions_are_all_high_and_within_the_tolerance():
    # The model leaves out only costs (launches, congestion, stragglers): it errs high.
    errors = [predicted / measured - 1 for _, predicted, measured in table_1_predictions()]
    assert all(0 < e < TABLE_1_TOLERANCE for e in errors), errors
    assert sum(errors) / len(errors) < TABLE_1_MEAN_ERROR, errors
    assert sum(e < 0.10 for e in errors) >= 9, errors


# Held out: The Llama 3 Herd of Models (Llama Team, 2024), Table 4, the two rows at sequence
# 8,192: 405B on H100s at TP 8, CP 1, PP 16, a 16M-token batch; GPUs and BF16 MFU.
LLAMA3_ROWS = [(8192, 0.43), (16384, 0.41)]
LLAMA3_COMMAND = [
    "--model", "llama3.1-405b", "--seq", "8192", "--gpus", "GPUS", "--global-batch", "2048",
    "--tp", "8", "--pp", "16", "--cp", "1", "--precision", "bf16", "--distributed-optimizer",
    "--software", "megatron-core", "--cluster", "jobs/clusters/dgx-h100.yaml",
]  # fmt: skip


@pytest.mark.slow
def test_llama3_405b_is_predicted_within_10_percent_of_table_4_as_docs_plan_md_shows():
    section = PLAN_MD.read_text().split("### Held out: Llama 3 405B")[1].split("\n### ")[0]
    block = section.split("```bash\n")[1].split("\n```")[0]
    command = block.split("#")[0].replace("\\\n", " ").split()
    assert command == ["hpcllm", "plan", *LLAMA3_COMMAND], command
    for gpus, published in LLAMA3_ROWS:
        args = [str(gpus) if a == "GPUS" else a for a in LLAMA3_COMMAND]
        done = _plan(*args[:-1], str(DGX_H100), "--json")
        assert done.returncode == 0, done.stderr
        best = json.loads(done.stdout)["layouts"][0]
        error = best["mfu"] / published - 1
        assert abs(error) < 0.10, (gpus, best["mfu"])
        row = f"| {gpus:,} | {published:.0%} | {best['mfu']:.1%} | {error:+.1%} |"
        assert row in section, row


# This project's H100 steps of the plain model under torch.compile (docs/benchmarks.md):
# the model's planner arguments and the measured milliseconds a step.
SINGLE_GPU = [
    ("gpt2-124m", ["--micro-batch", "16", "--vocab", "50257"], 36.66),
    ("gpt2-1.3b", ["--micro-batch", "4", "--vocab", "50257"], 150.85),
    ("llama3.2-1b", ["--micro-batch", "4", "--seq", "2048"], 140.4),
]


@pytest.mark.slow
def test_one_gpu_steps_are_predicted_within_10_percent_as_docs_plan_md_shows():
    section = PLAN_MD.read_text().split("### One GPU")[1].split("\n### ")[0]
    measured_in = (REPO / "docs" / "benchmarks.md").read_text()
    for model, args, measured_ms in SINGLE_GPU:
        assert f" {measured_ms} " in measured_in or f"{measured_ms} ms" in measured_in, model
        done = _plan("--model", model, *args, "--gpus", "1", "--global-batch", args[1],
                     "--recompute", "none", "--cluster", str(DGX_H100), "--json")  # fmt: skip
        assert done.returncode == 0, done.stderr
        predicted_ms = json.loads(done.stdout)["layouts"][0]["step_time_s"] * 1e3
        error = measured_ms / predicted_ms - 1
        assert abs(error) < 0.10, (model, predicted_ms)
        row = next(line for line in section.splitlines() if line.startswith(f"| {model},"))
        assert f"| {predicted_ms:.1f} ms | {error:+.1%} |" in row, row


def test_megatron_2021_runs_only_the_layouts_megatron_ran():
    # 1F1B and interleaved only, interleaved at p > 2 with v dividing the layers per stage,
    # and p dividing the layers: Megatron-LM refuses the rest.
    model = Model.of("gpt2", 60, 4096, 32, 2048, 51200)
    seen = set()
    for layout in layouts(model, 64, 512, Fixed(tp=8), Software.megatron_2021()):
        seen.add((layout.pp, layout.schedule, layout.vpp))
        assert layout.schedule in ("1f1b", "interleaved")
        assert 60 % layout.pp == 0
        if layout.schedule == "interleaved":
            assert layout.pp > 2 and (60 // layout.pp) % layout.vpp == 0
    assert (4, "interleaved", 3) in seen and (4, "interleaved", 5) in seen
    assert not any(p == 2 and s == "interleaved" for p, s, _ in seen)
    hpcllm = {(lay.schedule, lay.pp) for lay in layouts(model, 64, 512, Fixed(tp=8))}
    assert ("zb-h1", 2) in hpcllm and ("interleaved", 2) in hpcllm and ("gpipe", 8) in hpcllm


def test_the_tied_embeddings_gradient_crosses_the_pipeline():
    cluster = load_cluster(DGX_A100)
    layout = Layout(8, 2, 4, 1, 1, "1f1b", "full")
    small, large = (
        estimate(
            Model.of("gpt2", 8, 4096, 32, 2048, v), layout, cluster, Software.megatron_2021(), 64
        )
        for v in (1024, 204800)
    )
    # 203,776 more rows of 4,096 / 8 fp16 values: an all-reduce between two nodes.
    extra = large.time_parts_s["pp"] - small.time_parts_s["pp"]
    nbytes = (204800 - 1024) * 4096 / 8 * 2
    assert extra == pytest.approx(nbytes / (cluster.inter_node_gbps * 1e9), rel=0.05)


def test_the_model_imports_without_torch():
    code = "import sys, hpcllm.plan.search; assert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _gpt3(batch: int, schedule: str, v: int, scatter_gather: bool = True) -> float:
    # The paper's figures 12 and 15: GPT-3 175B (96 layers, h 12288) on 96 A100s, t 8, p 12.
    model = Model.of("gpt2", 96, 12288, 96, 2048, 51200)
    layout = Layout(8, 12, 1, v, 1, schedule, "full", False, scatter_gather)
    e = estimate(model, layout, load_cluster(DGX_A100), Software.megatron_2021(), batch)
    return e.tflops_per_gpu


def test_interleaving_pays_at_small_batches_and_less_at_large_ones():
    gains = [_gpt3(b, "interleaved", 2) / _gpt3(b, "1f1b", 1) - 1 for b in (12, 24, 48, 96)]
    assert all(g > 0 for g in gains), gains
    assert gains == sorted(gains, reverse=True), gains  # the bubble shrinks as m grows
    assert 0.05 < gains[0] < 0.35, gains  # the paper: about 10% and more at small batches


def test_scatter_gather_pays_between_nodes():
    gain = _gpt3(24, "interleaved", 2, True) / _gpt3(24, "interleaved", 2, False) - 1
    assert 0.0 < gain < 0.25, gain  # the paper: up to 11%


@pytest.mark.parametrize(
    "schedule,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4)])
def test_in_flight_activations_are_those_of_hpcllms_schedules(schedule, v, p, m):
    real = peak_in_flight(build(schedule, p, m, v)[0]) / v
    assert _in_flight(Layout(1, p, 1, v, 1, schedule), m) == pytest.approx(real)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_the_bubble_is_the_simulated_one(schedule, v):
    # Fast links: the bubble is the schedule's; the simulator replays hpcllm's real lists
    # (how a stage splits into forward and backward does not change these schedules' bubble).
    cluster = load_cluster(DGX_A100, ["intra_node_gbps=1e9", "inter_node_gbps=1e9"])
    model = Model.of("gpt2", 16, 1024, 16, 1024, 51200)
    p, m = 4, 8
    e = estimate(model, Layout(1, p, 1, v, 1, schedule), cluster, Software(), m)
    predicted = e.time_parts_s["bubble"] / (e.time_parts_s["compute"] + e.time_parts_s["tp"])
    sim = simulate(build(schedule, p, m, v), 1 / v, 2 / v, rendezvous=True, wait="use")
    assert predicted == pytest.approx(sim.bubble_over_ideal, rel=0.05)


def test_zb_h1_cuts_the_bubble_and_keeps_1f1bs_memory():
    model = Model.of("gpt2", 24, 2048, 16, 2048, 51200)
    cluster = load_cluster(DGX_A100)
    one, zero = (
        estimate(model, Layout(1, 4, 2, 1, 1, s), cluster, Software(), 64)
        for s in ("1f1b", "zb-h1")
    )
    assert zero.time_parts_s["bubble"] < 0.7 * one.time_parts_s["bubble"]
    assert zero.memory_parts_gb == one.memory_parts_gb


@pytest.mark.parametrize("row", [6, 9])
def test_search_keeps_tp_in_a_node_and_picks_a_layout_that_fits(row):
    heads, hidden, layers, _, _, gpus, batch, _ = TABLE_1[row]
    plan = search(
        Model.of("gpt2", layers, hidden, heads, 2048, 51200),
        gpus,
        batch,
        load_cluster(DGX_A100),
        Software.megatron_2021(),
        Fixed(recompute="full"),
    )
    best = plan.ranked[0]
    assert best.fits and best.layout.tp <= 8
    assert any("does not fit" in why for _, why in plan.losers)


@pytest.mark.slow
def test_the_command_ranks_gpt2_1_3b_on_64_gpus_in_seconds(tmp_path):
    started = time.monotonic()
    done = _plan(
        "--model", "gpt2-1.3b", "--gpus", "64", "--cluster", str(DGX_A100),
        "--global-batch", "512", "--png", str(tmp_path / "time.png"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 10
    assert "why the others lost" in done.stdout and (tmp_path / "time.png").stat().st_size > 0
    as_json = _plan(
        "--model", "gpt2-1.3b", "--gpus", "64", "--cluster", str(DGX_A100),
        "--global-batch", "512", "--json", "--top", "3",
    )  # fmt: skip
    layouts = json.loads(as_json.stdout)["layouts"]
    assert len(layouts) == 3
    assert layouts[0]["step_time_s"] <= layouts[1]["step_time_s"] <= layouts[2]["step_time_s"]
    for key in (
        "tp", "pp", "dp", "vpp", "micro_batch", "schedule", "recompute", "step_time_s",
        "tflops_per_gpu", "mfu", "memory_gb", "memory_parts_gb", "bubble", "fits",
    ):  # fmt: skip
        assert key in layouts[0], key
    assert layouts[0]["tp"] * layouts[0]["pp"] * layouts[0]["dp"] == 64


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "4", "--gpus", "6"], "--gpus 6 is not divisible by tp x pp = 4"),
        (["--tp", "3", "--gpus", "6"], "--heads 16 is not divisible by --tp 3"),
        (["--gpus", "8", "--cluster-set", "gpu=a100-13gb"], "unknown gpu 'a100-13gb'"),
        (["--gpus", "8", "--cluster-set", "gpus_per_node=0"], "gpus_per_node must be a positive"),
        (["--gpus", "8", "--model", "gpt5"], "unknown --model gpt5"),
        (["--gpus", "8", "--cluster-set", "gpus_per_node=[1"], "not a YAML value"),
        (["--gpus", "8", "--pp", "1", "--vpp", "2"], "--vpp 2 needs a pipeline"),
        (
            ["--gpus", "8", "--pp", "4", "--schedule", "zb-h1", "--software", "megatron-2021"],
            "--schedule zb-h1: this software runs 1f1b, interleaved",
        ),
        (
            ["--gpus", "10", "--pp", "5", "--software", "megatron-2021"],
            "--pp 5: this software needs the 24 layers divisible by p",
        ),
        (
            [
                "--gpus",
                "8",
                "--pp",
                "2",
                "--schedule",
                "interleaved",
                "--software",
                "megatron-2021",
            ],
            "--pp 2: this software runs the interleaved schedule at p >= 3 only",
        ),  # fmt: skip
        (
            ["--gpus", "8", "--pp", "4", "--vpp", "4", "--software", "megatron-2021"],
            "--vpp 4: this software needs v to divide the 6 layers of a stage",
        ),
        (["--gpus", "8", "--png", "/nonexistent/x.png"], "cannot write /nonexistent/x.png"),
        # What Megatron-LM of 2021 did not have is refused, not silently modelled.
        (
            ["--gpus", "8", "--tp", "2", "--software", "megatron-2021", "--sequence-parallel"],
            "--sequence-parallel: this software has no sequence parallelism",
        ),
        (
            ["--gpus", "8", "--software", "megatron-2021", "--recompute", "selective"],
            "--recompute selective: this software recomputes none or full only",
        ),
        (
            ["--gpus", "8", "--software", "megatron-2021", "--precision", "bf16"],
            "--precision bf16: megatron-2021 ran fp16",
        ),
        (
            ["--gpus", "8", "--software", "megatron-2021", "--distributed-optimizer"],
            "--distributed-optimizer: megatron-2021 had none",
        ),
        # Expert parallelism splits the experts of MoE blocks, whole experts on each rank.
        (
            ["--gpus", "8", "--set", "model.moe_experts=4", "--ep", "3"],
            "--ep 3 does not divide the model's 4 experts",
        ),
        (["--gpus", "8", "--ep", "2"], "--ep 2 splits the experts of MoE blocks, but this model"),
        (
            ["--gpus", "8", "--set", "model.moe_experts=4", "--ep", "4", "--tp", "4"],
            "--gpus 8 is not divisible by tp x pp x ep = 16",
        ),
        (["--gpus", "8", "--set", "train.lr=1"], "--set train.lr=1: hpcllm plan takes model.*"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    base = ["--global-batch", "64", "--cluster", str(DGX_A100)]
    if "--model" not in args:
        base += ["--model", "gpt2-1.3b"]
    done = _plan(*base, *args)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_cluster_file_with_a_missing_field_is_one_line(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("gpu: h100-sxm\ngpus_per_node: 8\nintra_node_gbps: 300\n")
    done = _plan(
        "--model", "gpt2-1.3b", "--gpus", "8", "--global-batch", "8", "--cluster", str(broken)
    )
    assert done.returncode == 2
    assert "missing field inter_node_gbps" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.mpi
def test_the_written_config_trains_under_mpirun_with_its_layout(stdlib, tmp_path):
    config = tmp_path / "planned.yaml"
    done = _plan(
        "--model", "tiny", "--tp", "2", "--pp", "2", "--gpus", "4", "--global-batch", "8",
        "--cluster", str(CPU), "--precision", "fp32", "--write-config", str(config),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    result = train(4, stdlib, run, "train.steps=2", "run.tensorboard=false", config=config).check()
    assert "grid t=2 p=2 d=1" in result.stdout + result.stderr
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert (meta["tp"], meta["pp"], meta["dp"]) == (2, 2, 1)


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (2, 2)])
def test_weights_per_rank_are_those_hpcllm_builds(pp, vpp):
    from hpcllm.config import ModelConfig
    from hpcllm.model.stages import build_chunks
    from hpcllm.plan.costs import rank_parameters

    cfg = ModelConfig(preset=None, n_layer=4, n_head=4, d_model=64, seq_len=32)
    chunks = build_chunks(
        cfg, 300, p=pp, rank=0, v=vpp, tp_group=None, seed=1, sequence_parallel=False
    )
    built = sum(p.numel() for p in chunks.parameters())
    layout = Layout(1, pp, 1, vpp, 1, "interleaved" if vpp > 1 else "1f1b")
    assert rank_parameters(Model.of("gpt2", 4, 64, 4, 32, 300), layout) == built


def test_interleaving_holds_more_activations_not_fewer():
    model = Model.of("gpt2", 24, 2048, 16, 2048, 51200)
    cluster = load_cluster(DGX_A100)
    one, two = (
        estimate(model, Layout(1, 4, 2, v, 1, s), cluster, Software(), 64)
        for s, v in (("1f1b", 1), ("interleaved", 2))
    )
    # p + (p - 1)/v whole stages in flight against p: 5.5 / 4 of 1f1b's.
    ratio = two.memory_parts_gb["activations"] / one.memory_parts_gb["activations"]
    assert ratio == pytest.approx((4 + 3 / 2) / 4, rel=1e-6)


def test_fixed_choices_are_held_and_the_config_is_the_planned_model(tmp_path):
    cluster = load_cluster(DGX_A100)
    model = Model.of("gpt2", 24, 2048, 16, 2048, 51200)
    plan = search(model, 64, 512, cluster, Software(), Fixed(schedule="zb-h1"))
    assert {e.layout.schedule for e in plan.ranked} == {"zb-h1"}
    assert all(e.layout.pp > 1 for e in plan.ranked)
    config = tmp_path / "planned.yaml"
    done = _plan(
        "--model", "gpt2-1.3b", "--layers", "48", "--gpus", "64", "--global-batch", "512",
        "--cluster", str(DGX_A100), "--write-config", str(config),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    from hpcllm.config import load_config

    written = load_config(config).model
    assert (written.n_layer, written.d_model, written.vocab_size) == (48, 2048, None)


@pytest.mark.parametrize(
    "preset,sizes",
    [
        ("gpt2-1.3b", []),
        ("gpt2-1.3b", ["--layers", "48"]),
        ("llama3.2-1b", []),
        ("llama3-8b", ["--layers", "16", "--vocab", "32000"]),
    ],
)
def test_the_written_config_loads_back_as_the_planned_shape(tmp_path, preset, sizes):
    # Written through the family: its own keys give the rest of the shape where no preset
    # is named (the planned sizes are not the preset's).
    from hpcllm import families
    from hpcllm.config import load_config

    config = tmp_path / "planned.yaml"
    done = _plan(
        "--model", preset, *sizes, "--gpus", "64", "--global-batch", "512",
        "--cluster", str(DGX_A100), "--json", "--top", "1", "--write-config", str(config),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    planned = json.loads(done.stdout)["model"]
    arch = planned.pop("arch")
    written = load_config(config).model
    assert (written.arch, written.preset) == (arch, None if sizes else preset)
    assert families.shape(written, planned["vocab"]) == families.Shape(**planned)


def test_when_nothing_fits_the_closest_layout_comes_first():
    cluster = load_cluster(DGX_A100, ["usable_memory_fraction=0.0001"])
    plan = search(Model.of("gpt2", 24, 2048, 16, 2048, 51200), 64, 512, cluster, Software())
    assert not plan.ranked
    sizes = [e.memory_gb for e, _ in plan.losers]
    assert sizes[0] == min(sizes) and "does not fit" in plan.losers[0][1]


@pytest.mark.slow
def test_bench_device_writes_a_gpu_spec_the_planner_takes(tmp_path):
    fragment = tmp_path / "gpu.yaml"
    done = cli("bench", "device", "--cpu-smoke", "--out", str(fragment), check=True)
    assert "| smallest GEMM dimension |" in done.stdout
    network = (
        "gpus_per_node: 4\nintra_node_gbps: 1\ninter_node_gbps: 1\n"
        "intra_node_latency_us: 100\ninter_node_latency_us: 100\n"
    )
    cluster_file = tmp_path / "measured.yaml"
    cluster_file.write_text(fragment.read_text() + network)
    cluster = load_cluster(cluster_file)
    assert [d for d, _ in cluster.gpu.shape_factor] == [16, 32, 64, 128]
    assert max(share for _, share in cluster.gpu.shape_factor) == 1.0
    assert cluster.gpu.gemm_ceiling == 1.0
    assert cluster.gpu.peak_fp32 == pytest.approx(cluster.gpu.peak_bf16 / 2, rel=1e-3)
    assert "hpcllm bench device --cpu-smoke --out" in fragment.read_text()  # how, in a comment
    planned = _plan(
        "--model", "tiny", "--gpus", "2", "--global-batch", "4",
        "--cluster", str(cluster_file),
    )  # fmt: skip
    assert planned.returncode == 0, planned.stderr


def test_bench_devices_fragment_for_a_known_kind_gives_only_what_it_measured():
    from hpcllm.bench.device import gpu_spec

    measured = {
        "size": 8192,
        "square_tflops": 700.0,
        "best_gemm_tflops": 760.0,
        "by_dim_tflops": {64: 228.0, 1024: 722.0, 4096: 760.0},
        "attention_tflops": 400.0,
        "copy_gbps": 3000.0,
    }
    spec = gpu_spec(measured, "h100-sxm", 85.0)
    assert set(spec) == {"gemm_ceiling", "flash_efficiency", "memory_efficiency", "shape_factor"}
    assert spec["gemm_ceiling"] == pytest.approx(760 / 989.4, rel=1e-3)
    assert spec["flash_efficiency"] == pytest.approx(400 / 989.4, rel=1e-3)
    assert spec["memory_efficiency"] == pytest.approx(3000 / 3350, rel=1e-3)
    shares = {64: 0.3, 1024: 0.95, 4096: 1.0, 8192: pytest.approx(0.921, rel=1e-3)}
    assert spec["shape_factor"] == shares
    network = {"gpus_per_node": 8, "intra_node_gbps": 360, "inter_node_gbps": 45,
               "intra_node_latency_us": 8, "inter_node_latency_us": 12}  # fmt: skip
    gpu = cluster_from_dict({"gpu": "h100-sxm", "gpu_spec": spec, **network}).gpu
    assert (gpu.peak_bf16, gpu.memory_gb, gpu.hbm_gbps) == (989.4, 80.0, 3350.0)  # data sheet
    # The planner prices a GEMM of smallest dimension 64 at the measured 228 TFLOP/s.
    assert gemm_efficiency(gpu, (64, 8192, 8192)) * gpu.peak_bf16 == pytest.approx(228, rel=1e-2)


def test_a_measured_shape_table_and_partial_spec_override_a_known_kind(tmp_path):
    base = load_cluster(DGX_A100)
    measured = load_cluster(
        DGX_A100, ["gpu_spec.gemm_ceiling=0.7", "gpu_spec.shape_factor={64: 0.2, 2048: 0.9}"]
    )
    assert measured.gpu.peak_bf16 == base.gpu.peak_bf16 == 312.0  # kept from the kind
    assert measured.gpu.hbm_gbps == base.gpu.hbm_gbps
    assert gemm_efficiency(measured.gpu, (8192, 8192, 8192)) == pytest.approx(0.7 * 0.9)
    assert gemm_efficiency(measured.gpu, (64, 8192, 8192)) == pytest.approx(0.7 * 0.2)
    between = gemm_efficiency(measured.gpu, (362, 8192, 8192)) / 0.7  # log2 362 ~ halfway
    assert 0.2 < between < 0.9 and between == pytest.approx(0.55, abs=0.01)
    model, layout = Model.of("gpt2", 24, 2048, 16, 2048, 51200), Layout(1, 1, 8)
    slow, fast = (estimate(model, layout, c, Software(), 64) for c in (measured, base))
    assert slow.step_time_s > fast.step_time_s


@pytest.mark.parametrize(
    "override,message",
    [
        ("gpu_spec.shape_factor=0.5", "gpu_spec.shape_factor must map two or more"),
        ("gpu_spec.shape_factor={64: 0.2, x: 0.9}", "'x' is not a dimension"),
        ("gpu_spec.shape_factor={64: 0.2, 128: 7}", "is not a fraction"),
        ("gpu_spec.tensor_cores=4", "gpu_spec has unknown field tensor_cores"),
    ],
)
def test_a_bad_measured_table_is_one_line_and_exit_2(override, message):
    done = _plan(
        "--model", "gpt2-1.3b", "--gpus", "8", "--global-batch", "8",
        "--cluster", str(DGX_A100), "--cluster-set", override,
    )  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(
    "name,kind",
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", None),  # another bandwidth than the SXM part
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA H100 NVL", None),
        ("Tesla V100-SXM2-32GB", None),
    ],
)
def test_bench_device_knows_the_planners_kinds_by_name(name, kind):
    from hpcllm.bench.device import kind_of

    assert kind_of(name) == kind


# -- Table 1 through the command line, as docs/plan.md shows it --------------------------------

PLAN_MD = REPO / "docs" / "plan.md"
TABLE_1_COMMON = [
    "--software", "megatron-2021", "--recompute", "full", "--seq", "2048", "--vocab", "51200",
    "--cluster", str(DGX_A100), "--json",
]  # fmt: skip


def _docs_table_1() -> list[dict]:
    """Return the rows of docs/plan.md's Table 1: params, the row's own options, published and
    predicted TFLOP/s, the error, the planner's own pick."""
    rows = []
    for line in PLAN_MD.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1].startswith("`--layers"):
            rows.append(
                {
                    "params": cells[0],
                    "args": cells[1].strip("`").split(),
                    "published": float(cells[2]),
                    "predicted": cells[3],
                    "error": cells[4].strip("*"),
                    "own": cells[5],
                }
            )
    return rows


@pytest.mark.slow
def test_table_1_through_the_cli_is_what_docs_plan_md_shows_and_what_the_library_gives():
    rows = _docs_table_1()
    assert [r["published"] for r in rows] == [row[-1] for row in TABLE_1]
    statement = PLAN_MD.read_text().split("### Row by row")[1].split("\n## ")[0]
    library = table_1_predictions()
    for row, (_, expected, _), run in zip(rows, library, TABLE_1_RUN, strict=True):
        done = _plan(*TABLE_1_COMMON, *row["args"])
        assert done.returncode == 0, done.stderr
        best = json.loads(done.stdout)["layouts"][0]
        assert best["sequence_parallel"] is False  # megatron-2021 had none
        assert (best["micro_batch"], best["schedule"], best["vpp"]) == run, row["params"]
        # The last column: the same command without the run's micro-batch, schedule and v.
        own_args = row["args"][: row["args"].index("--micro-batch")]
        own = json.loads(_plan(*TABLE_1_COMMON, *own_args).stdout)["layouts"][0]
        kind = own["schedule"] + (f" v {own['vpp']}" if own["schedule"] == "interleaved" else "")
        own_error = own["tflops_per_gpu"] / row["published"] - 1
        assert row["own"] == (
            f"{kind}, b {own['micro_batch']}: {own['tflops_per_gpu']:.1f} ({own_error:+.1%})"
        ), row["params"]
        predicted = best["tflops_per_gpu"]
        assert predicted == expected  # the CLI and the library: one number
        assert f"{predicted:.1f}" == row["predicted"], row["params"]
        error = predicted / row["published"] - 1
        assert f"{error:+.1%}" == row["error"], row["params"]
        if abs(error) > 0.10:  # outside the goal: the docs say which cost term is missing
            assert f"**{row['params']}**" in statement, row["params"]
        assert abs(error) < TABLE_1_TOLERANCE, row["params"]


def test_sequence_parallelism_is_the_users_choice_for_hpcllm():
    args = ["--model", "gpt2-1.3b", "--gpus", "8", "--tp", "2", "--global-batch", "64",
            "--cluster", str(DGX_A100), "--json", "--top", "1"]  # fmt: skip
    on, off = (json.loads(_plan(*args, *extra).stdout)["layouts"][0]
               for extra in ([], ["--no-sequence-parallel"]))  # fmt: skip
    assert on["sequence_parallel"] is True and off["sequence_parallel"] is False
    assert on["memory_parts_gb"]["activations"] < off["memory_parts_gb"]["activations"]


# -- measured communication tables ------------------------------------------------------------


def _with_tables(path, scale: float = 1.0, intra: float = 4.0):
    """Write dgx-a100.yaml with measured tables: between nodes (scaled), and inside a node
    (scaled; 4 x: faster than any ring between nodes here, which is then the bound)."""
    import yaml

    raw = yaml.safe_load(DGX_A100.read_text())
    sizes = {1 << 16: 2.0, 1 << 20: 20.0, 1 << 26: 150.0, 1 << 30: 185.0}
    raw["comm_tables"] = {
        "inter_node": {
            "all_reduce": {size: bw * scale for size, bw in sizes.items()},
            "send_recv": {size: bw / 8 * scale for size, bw in sizes.items()},
        },
        "intra_node": {"all_reduce": {size: bw * intra for size, bw in sizes.items()}},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_measured_tables_between_nodes_price_a_data_parallel_layout_across_nodes(tmp_path):
    # 1.7B on 32 GPUs, t = 1, p = 2: the all-reduce's ring spans nodes. Megatron 2021 does
    # not overlap it under a pipeline (its local DDP), so the whole of it is in the step.
    args = ["--layers", "24", "--hidden", "2304", "--heads", "24", "--seq", "2048",
            "--gpus", "32", "--global-batch", "512", "--tp", "1", "--pp", "2",
            "--micro-batch", "16", "--schedule", "1f1b", "--software", "megatron-2021",
            "--recompute", "full",
            "--json", "--top", "1"]  # fmt: skip

    def best(cluster):
        done = _plan(*args, "--cluster", str(cluster))
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["layouts"][0]

    base = best(_with_tables(tmp_path / "base.yaml"))
    half = best(_with_tables(tmp_path / "half.yaml", 0.5))
    double = best(_with_tables(tmp_path / "double.yaml", 2.0))
    assert half["step_time_s"] > base["step_time_s"] > double["step_time_s"]
    # At 1.8 GB the tables' largest size holds: the exposed all-reduce scales with 1/bandwidth.
    assert half["time_parts_s"]["dp"] == pytest.approx(2 * base["time_parts_s"]["dp"], rel=0.01)
    assert double["time_parts_s"]["dp"] == pytest.approx(base["time_parts_s"]["dp"] / 2, rel=0.01)
    constants = best(DGX_A100)
    assert constants["time_parts_s"]["dp"] != base["time_parts_s"]["dp"]  # the tables were used
    # Inside one node (8 GPUs) the tables between nodes change nothing.
    inside = ["--gpus", "8", "--global-batch", "128"]
    one_node = [(_plan(*args, *inside, "--cluster", str(c)).stdout) for c in
                (tmp_path / "half.yaml", tmp_path / "double.yaml")]  # fmt: skip
    assert json.loads(one_node[0])["layouts"][0] == json.loads(one_node[1])["layouts"][0]


def test_tables_are_interpolated_by_message_size():
    from hpcllm.plan.costs import collective_s

    cluster = cluster_from_dict(
        {**_dgx_raw(), "comm_tables": {"intra_node": {"all_reduce": {1000: 1.0, 1_000_000: 100.0}}}}
    )
    bus = cluster.bus_time_s
    assert bus("intra_node", "all_reduce", 1000) == pytest.approx(1e-6)
    assert bus("intra_node", "all_reduce", 10) == pytest.approx(1e-6)  # latency-bound below
    assert bus("intra_node", "all_reduce", 1_000_000) == pytest.approx(1e-5)
    assert bus("intra_node", "all_reduce", 2_000_000) == pytest.approx(2e-5)  # the largest's bw
    assert bus("intra_node", "all_reduce", 500_500) == pytest.approx(5.5e-6)  # linear between
    assert bus("intra_node", "all_gather", 1000) is None  # no table: the constants
    # A collective's time is the bus factor's share: 2(n-1)/n for an all-reduce of n ranks.
    assert collective_s(cluster, "intra_node", "all_reduce", 1_000_000, 8) == pytest.approx(
        2 * 7 / 8 * 1e-5
    )
    constant = collective_s(cluster, "intra_node", "all_gather", 1e9, 8)
    expected = 7 / 8 * 1e9 / (cluster.intra_node_gbps * 1e9) + 7 * 8e-6
    assert constant == pytest.approx(expected)


def _dgx_raw() -> dict:
    import yaml

    return yaml.safe_load(DGX_A100.read_text())


# -- the Llama family ---------------------------------------------------------------------------


def _meta_rank_parameters(preset: str, vocab: int, t: int, p: int, v: int) -> float:
    """Return the parameters the first pipeline rank holds at (t, p, v), counted from the
    model built on the meta device: its stage's tensors, each cut over t as the family's rule
    says (the vocabulary padded to 128·t; a key/value head kept whole where t exceeds them)."""
    import torch

    from hpcllm import families
    from hpcllm.config import load_config, padded_vocab
    from hpcllm.model import build
    from hpcllm.model.stages import split_layers

    cfg = load_config(None, ["model.arch=llama", f"model.preset={preset}"]).model
    family = families.get("llama")
    kv = cfg.n_kv_heads
    stages = split_layers(cfg.n_layer, p * v)
    total = 0.0
    for chunk in range(v):  # the first rank's chunks: stages 0, p, 2p, ...
        stage = chunk * p
        with torch.device("meta"):
            model = build(cfg, vocab, layers=stages[stage], pre=stage == 0,
                          post=stage == p * v - 1)  # fmt: skip
        for name, param in model.named_parameters():
            rule = family.rule(name)
            n = param.numel()
            if rule.padded:
                n = padded_vocab(vocab, t) * param.shape[1]
            if rule.split is None:
                total += n
            elif rule.grad == "kv-replicas" and kv % t:
                total += n / kv  # one whole head on each rank
            else:
                total += n / t
    return total


@pytest.mark.slow
def test_plan_llama3_8b_counts_the_weights_the_model_has_at_its_layout():
    done = _plan("--model", "llama3-8b", "--gpus", "64", "--global-batch", "512",
                 "--cluster", str(REPO / "jobs" / "clusters" / "dgx-h100.yaml"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    header = "llama: 32 layers, hidden 4096, 32 heads (8 key/value), MLP 14336"
    assert done.stdout.startswith(header)
    assert "vocab 128256 (8.03 B parameters)" in done.stdout  # the preset's vocabulary
    as_json = _plan("--model", "llama3-8b", "--gpus", "64", "--global-batch", "512",
                    "--cluster", str(REPO / "jobs" / "clusters" / "dgx-h100.yaml"), "--json",
                    "--top", "3")  # fmt: skip
    for best in json.loads(as_json.stdout)["layouts"]:
        t, p, v = best["tp"], best["pp"], best["vpp"]
        built = _meta_rank_parameters("llama3-8b", 128256, t, p, v)
        parts = best["memory_parts_gb"]  # hpcllm: fp32 weights and gradients, Adam's 2 moments
        for part, nbytes in (("weights", 4), ("gradients", 4), ("optimizer", 8)):
            assert parts[part] * 1e9 / nbytes == pytest.approx(built, rel=0.02), (part, t, p, v)
    # --vocab overrides the preset's; a gpt2 preset still plans with 51,200.
    other = _plan("--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--vocab",
                  "32000", "--cluster", str(DGX_A100), "--top", "1")  # fmt: skip
    assert "vocab 32000" in other.stdout
    gpt = _plan("--model", "gpt2-1.3b", "--gpus", "8", "--global-batch", "64", "--cluster",
                str(DGX_A100), "--top", "1")  # fmt: skip
    assert gpt.stdout.startswith("gpt2: 24 layers") and "vocab 51200" in gpt.stdout


def test_the_llama_spec_prices_gqa_swiglu_and_an_untied_head():
    cluster = load_cluster(DGX_A100)
    layout = Layout(tp=2, pp=2, dp=2, micro_batch=1, recompute="none", sequence_parallel=True)
    gqa, mha, tied = (
        estimate(
            Model.of("llama", 8, 2048, 16, 2048, 32000, kv_heads=kv, ffn=5632, tied=tie),
            layout,
            cluster,
            Software(),
            64,
        )
        for kv, tie in ((4, False), (16, False), (4, True))
    )
    # Fewer key/value heads: fewer weights and activations, less time.
    assert gqa.memory_parts_gb["weights"] < mha.memory_parts_gb["weights"]
    assert gqa.memory_parts_gb["activations"] < mha.memory_parts_gb["activations"]
    assert gqa.step_time_s < mha.step_time_s
    # Untied: no embedding gradient crosses the pipeline; tied: it does.
    assert tied.time_parts_s["pp"] > gqa.time_parts_s["pp"]


# -- mixtures of experts and expert parallelism -------------------------------------------------


def _moe_config(arch: str) -> object:
    """Return the tiny model config of family ``arch`` with the MoE training tests' experts."""
    from family_runs import TINY
    from test_moe_training import MOE

    from hpcllm.config import load_config

    return load_config(None, [f"model.arch={arch}", *TINY[arch], *MOE[arch]]).model


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("ep", [1, 2])
def test_moe_parameters_are_those_hpcllm_builds(arch, ep):
    # GPT-2's GeLU experts with biases in every block; Llama's SwiGLU ones in every other
    # block, narrower than its MLP, with a gated shared expert. The whole model at ep = 1, a
    # rank's share at ep = 2 (its experts, the rest whole), against the modules built.
    from hpcllm import families
    from hpcllm.model import build
    from hpcllm.model.moe import ExpertParallel
    from hpcllm.plan.costs import rank_parameters_by_kind

    cfg = _moe_config(arch)
    built = build(cfg, 256, ep=ExpertParallel(ep, 0))
    family = families.get(arch)
    routed = sum(p.numel() for n, p in built.named_parameters() if family.rule(n).experts)
    total = sum(p.numel() for p in built.parameters())
    model = Model.from_config(cfg, 256)
    assert rank_parameters_by_kind(model, Layout(1, 1, 2, ep=ep)) == (total - routed, routed)
    if ep == 1:
        assert model.parameters() == total


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_moe_flops_are_the_trainers(arch):
    from hpcllm.flops import model_step_flops

    cfg = _moe_config(arch)
    model = Model.from_config(cfg, 256)
    for recompute in ("none", "full"):
        assert model.step_flops(8, recompute) == model_step_flops(cfg, 8, 256, recompute)
    dense = Model(model.arch, model.shape)
    assert model.step_flops(8, "none") != dense.step_flops(8, "none")


def _moe_model(experts: int = 8) -> Model:
    from hpcllm.config import load_config

    sets = ["model.arch=gpt2", "model.preset=gpt2-1.3b", f"model.moe_experts={experts}"]
    return Model.from_config(load_config(None, sets).model, 51200)


def test_expert_memory_halves_from_ep_1_to_ep_2_and_the_rest_stays():
    model, cluster = _moe_model(), load_cluster(DGX_A100)
    one, two = (
        estimate(model, Layout(1, 1, 8, ep=ep), cluster, Software(), 64).memory_parts_gb
        for ep in (1, 2)
    )
    assert two["experts"] == pytest.approx(one["experts"] / 2, rel=1e-12)
    assert (two["weights"], two["activations"]) == (one["weights"], one["activations"])
    # ZeRO-1 shards the routed experts' Adam state (8 bytes a parameter, beside 4 + 4 of fp32
    # weights and gradients) over their d/ep replicas, the rest's over d: at ep = 2 a rank
    # holds half the experts and 2/d of their state.
    zero1 = Software(distributed_optimizer=True)
    one, two = (
        estimate(model, Layout(1, 1, 8, ep=ep), cluster, zero1, 64).memory_parts_gb for ep in (1, 2)
    )
    held = one["experts"] / (4 + 4 + 8 / 8)  # the routed experts' parameters at ep = 1, in G
    assert two["experts"] == pytest.approx(held / 2 * (4 + 4 + 8 / 4), rel=1e-9)
    assert two["optimizer"] == pytest.approx(two["weights"] * 8 / 4 / 8, rel=1e-9)


def test_the_all_to_all_is_free_at_ep_1_and_costs_at_ep_2():
    model, cluster = _moe_model(), load_cluster(DGX_A100)
    one, two = (estimate(model, Layout(1, 1, 8, ep=ep), cluster, Software(), 64) for ep in (1, 2))
    assert one.time_parts_s["ep"] == 0.0 and two.time_parts_s["ep"] > 0.0
    assert "no intra_node all_to_all table" in two.all_to_all_pricing
    # A dense model's estimate has no ep part and no pricing.
    dense = estimate(Model(model.arch, model.shape), Layout(1, 1, 8), cluster, Software(), 64)
    assert "ep" not in dense.time_parts_s and dense.all_to_all_pricing is None


def test_the_all_to_all_is_priced_from_a_table_and_crosses_nodes_past_one():
    from hpcllm.plan.costs import all_to_all_s

    raw = _dgx_raw()
    constant = cluster_from_dict(raw)
    measured = cluster_from_dict(
        {**raw, "comm_tables": {"intra_node": {"all_to_all": {1 << 20: 50.0, 1 << 30: 100.0}}}}
    )
    nbytes = 1 << 30
    inside, how = all_to_all_s(constant, nbytes, 2, 4)  # t·ep = 8: one node
    assert inside == pytest.approx(3 / 4 * nbytes / (constant.intra_node_gbps * 1e9) + 3 * 8e-6)
    assert "priced as an all-gather at intra_node_gbps" in how
    table, how = all_to_all_s(measured, nbytes, 2, 4)
    assert table == pytest.approx(3 / 4 * nbytes / 100e9) and "all_to_all table" in how
    across, how = all_to_all_s(constant, nbytes, 4, 4)  # t·ep = 16: over each GPU's adapter
    assert across == pytest.approx(3 / 4 * nbytes / (constant.inter_node_gbps * 1e9) + 3 * 12e-6)
    assert "inter_node" in how
    assert all_to_all_s(constant, nbytes, 1, 1)[0] == 0.0


def test_a_dense_model_is_planned_at_ep_1_only_and_an_moe_one_searches_ep():
    dense = Model.of("gpt2", 24, 2048, 16, 2048, 51200)
    assert {lay.ep for lay in layouts(dense, 64, 512, Fixed())} == {1}
    assert {lay.ep for lay in layouts(dense, 64, 512, Fixed(ep=1))} == {1}
    moe = _moe_model(8)
    seen = {(lay.dp, lay.ep) for lay in layouts(moe, 64, 512, Fixed(tp=2, pp=2))}
    assert seen == {(16, 1), (16, 2), (16, 4), (16, 8)}  # the divisors of d that divide E
    plan = search(moe, 16, 128, load_cluster(DGX_A100), Software(), Fixed(recompute="none"))
    assert {e.layout.ep for e in plan.ranked} > {1}
    held = search(moe, 16, 128, load_cluster(DGX_A100), Software(), Fixed(tp=1, ep=4))
    assert {e.layout.ep for e in held.ranked} == {4}


def test_the_written_config_of_an_moe_plan_loads_back_as_the_planned_model(tmp_path):
    from hpcllm.config import load_config
    from hpcllm.plan.search import write_config

    model = Model.from_config(_moe_config("llama"), 256)
    plan = search(model, 4, 8, load_cluster(CPU), Software.named("hpcllm", "fp32"), Fixed(ep=2))
    cfg = load_config(write_config(plan, tmp_path / "planned.yaml", None))
    assert Model.from_config(cfg.model, 256) == model
    assert (cfg.parallel.ep, cfg.parallel.dp % 2) == (2, 0)


@pytest.mark.slow
def test_the_moe_example_prints_what_docs_plan_md_shows_with_ep_and_the_all_to_all():
    section = PLAN_MD.read_text().split("## Mixtures of experts")[1]
    command = section.split("```bash\n")[1].split("\n```")[0].replace("\\\n", " ").split()
    shown = section.split("prints\n\n```\n")[1].split("\n```")[0]
    assert command[:2] == ["hpcllm", "plan"]
    text = _plan(*command[2:])
    assert text.returncode == 0, text.stderr
    assert text.stdout.rstrip("\n") == shown
    assert "8 experts (top 2, MLP 8192) in 12 of 24 blocks" in shown
    assert " ep " in shown.splitlines()[2] and "a2a s" in shown.splitlines()[2]
    assert "#1 expert all-to-all:" in shown and "priced as an all-gather" in shown
    best = json.loads(_plan(*command[2:], "--json", "--top", "1").stdout)["layouts"][0]
    assert best["ep"] > 1 and best["time_parts_s"]["ep"] > 0
    assert best["memory_parts_gb"]["experts"] > 0 and "all_to_all_pricing" in best
    dense = [word for word in command[2:] if not word.startswith(("--set", "model.moe"))]
    record = json.loads(_plan(*dense, "--json", "--top", "1").stdout)["layouts"][0]
    assert "ep" not in record and "ep" not in record["time_parts_s"]


@pytest.mark.slow
def test_mixtral_8x7b_plans_at_its_published_size_with_ep_and_the_all_to_all():
    text = _plan("--model", "mixtral-8x7b", "--gpus", "64", "--global-batch", "512",
                 "--cluster", str(REPO / "jobs" / "clusters" / "dgx-h100.yaml"))  # fmt: skip
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    # 46.7B parameters, 8 experts of 14336 in every block (Jiang et al., 2024).
    assert "8 experts (top 2, MLP 14336) in 32 of 32 blocks" in lines[0]
    assert "(46.70 B parameters)" in lines[0]
    assert " ep " in lines[2] and "a2a s" in lines[2]
    assert any(line.startswith("#1 expert all-to-all:") for line in lines)
    # What docs/moe.md says of it: one expert per GPU of each block, 22.5 GB of experts.
    assert lines[4].split()[4] == "8"  # the best layout's ep
    assert "experts 22.5," in next(line for line in lines if line.startswith("#1 memory"))


@pytest.mark.slow
def test_qwen3_30b_a3b_plans_with_its_free_head_dim_and_q_k_norms(tmp_path):
    command = ["--model", "qwen3-30b-a3b", "--gpus", "64", "--global-batch", "512",
               "--cluster", str(REPO / "jobs" / "clusters" / "dgx-h100.yaml")]  # fmt: skip
    text = _plan(*command)
    assert text.returncode == 0, text.stderr
    header = text.stdout.splitlines()[0]
    # 30.5B parameters (Qwen3 Technical Report), 32 heads of 128 over a hidden size of 2048.
    assert "32 heads (4 key/value) of 128 with q/k norms" in header
    assert "128 experts (top 8, MLP 768) in 48 of 48 blocks" in header
    assert "(30.53 B parameters)" in header
    # The plan written as a config keeps the attention's variants.
    out = tmp_path / "plan.yaml"
    assert _plan(*command, "--write-config", str(out)).returncode == 0
    written = yaml.safe_load(out.read_text())["model"]
    kept = (written["head_dim"], written["qk_norm"], written["moe_renormalize"])
    assert kept == (128, True, True)


def test_context_parallelism_is_planned_for_long_sequences_and_priced():
    """cp is searched from 8K tokens on (or where fixed): the gpus are t·cp·p·d, activations
    and logits per rank fall by about cp, the attention core's time does not (s/cp queries
    over all s keys), the gathers cost something, and the optimizer shards over d·cp."""
    from hpcllm.plan.costs import memory_parts

    cluster = load_cluster(DGX_H100)
    software = Software.hpcllm()
    short = Model.of("llama", 4, 512, 8, 2048, 32000, kv_heads=2, ffn=1536, tied=False)
    assert {lay.cp for lay in layouts(short, 16, 16, Fixed(), software)} == {1}
    assert {lay.cp for lay in layouts(short, 16, 16, Fixed(cp=2), software)} == {2}
    long = Model.of("llama", 4, 512, 8, 16384, 32000, kv_heads=2, ffn=1536, tied=False)
    found = {lay.cp for lay in layouts(long, 16, 16, Fixed(), software)}
    assert {1, 2, 4, 8, 16} <= found
    one, two = Layout(1, 1, 8), Layout(1, 1, 4, cp=2)
    assert (one.gpus, two.gpus, two.replicas) == (8, 8, 8)
    a, b = (estimate(long, lay, cluster, software, 8) for lay in (one, two))
    ratio = b.memory_parts_gb["activations"] / a.memory_parts_gb["activations"]
    assert 0.5 <= ratio <= 0.6, ratio  # half, plus the whole sequence's keys and values
    assert b.memory_parts_gb["logits"] == pytest.approx(a.memory_parts_gb["logits"] / 2)
    assert b.time_parts_s["cp"] > 0 and "cp" not in a.time_parts_s
    # The same FLOPs on the same GPUs: per GPU the same TFLOP/s count, cp only adds the
    # gathers (and changes d's all-reduce).
    assert b.tokens_per_s == pytest.approx(8 * 16384 / b.step_time_s)
    zero = Software.named("hpcllm", "bf16", True)
    parts = memory_parts(long, two, cluster, zero, 8)
    whole = memory_parts(long, Layout(1, 1, 8), cluster, zero, 8)
    assert parts["optimizer"] == pytest.approx(whole["optimizer"])  # 1/8 either way


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--cp", "3"], "--cp 3 cuts --seq 2048 into 2 x cp chunks; it does not"),
        (["--cp", "16", "--tp", "2"], "--gpus 16 is not divisible by tp x pp x cp = 32"),
    ],
)
def test_a_context_size_the_request_cannot_take_is_one_line(args, says):
    done = cli("plan", "--model", "llama-tiny", "--seq", "2048", "--gpus", "16",
               "--global-batch", "16", "--cluster", str(DGX_H100), *args)  # fmt: skip
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_long_sequence_keeps_cp1_and_a_mixture_of_experts_plans_at_cp1_only():
    # 8200 tokens: no cp > 1 cuts them into 2·cp·8 parts, and cp = 1 still plans.
    odd = Model.of("llama", 4, 512, 8, 8200, 32000, kv_heads=2, ffn=1536, tied=False)
    assert {lay.cp for lay in layouts(odd, 16, 16, Fixed(tp=8), Software.hpcllm())} == {1}
    done = cli("plan", "--model", "mixtral-tiny", "--seq", "8192", "--gpus", "8",
               "--global-batch", "8", "--cluster", str(DGX_H100), "--cp", "2")  # fmt: skip
    assert done.returncode == 2 and "mixtures of experts at cp = 1 only" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_megatron_cores_overlaps_hide_what_they_can_and_the_parts_add_up():
    # Llama 3 8B's shape at sequence 1,024 on four DGX H100 nodes: t 2, p 2, d 16 and one
    # micro-batch each, so that the data-parallel reduction outlasts a backward.
    model = Model.of("llama", 32, 4096, 32, 1024, 128256, kv_heads=8, ffn=14336, tied=False)
    cluster, core = load_cluster(DGX_H100), Software.megatron_core()
    plain = replace(core, tp_overlap=False, p2p_overlap=False, param_gather_overlap=False)
    layout = Layout(2, 2, 16, 2, 1, "interleaved", "full", sequence_parallel=True)
    for software, lay in itertools.product((core, plain), (layout, replace(layout, vpp=1,
                                           schedule="1f1b"))):  # fmt: skip
        e = estimate(model, lay, cluster, software, 16)
        assert sum(e.time_parts_s.values()) == pytest.approx(e.step_time_s), (software, lay)
    over, under = (estimate(model, layout, cluster, s, 16) for s in (core, plain))
    for axis in ("tp", "pp", "dp"):  # what is hidden is taken off what was exposed, no more
        total = under.time_parts_s[axis] + under.hidden_comm_s.get(axis, 0.0)
        assert over.time_parts_s[axis] + over.hidden_comm_s[axis] == pytest.approx(total), axis
        assert over.hidden_comm_s[axis] > under.hidden_comm_s.get(axis, 0.0), axis
        assert 0 <= over.hidden_comm_s[axis] <= total, axis
    assert over.time_parts_s["pp"] == 0.0 and over.hidden_comm_s["pp"] > 0
    # 1F1B's sends stay exposed; without sequence parallelism nothing tp hides (Transformer
    # Engine overlaps its all-gathers and reduce-scatters only).
    one = estimate(model, replace(layout, vpp=1, schedule="1f1b"), cluster, core, 16)
    assert one.hidden_comm_s["pp"] == 0.0 and one.time_parts_s["pp"] > 0
    no_sp = estimate(model, replace(layout, sequence_parallel=False), cluster, core, 16)
    assert no_sp.hidden_comm_s["tp"] == 0.0 and no_sp.time_parts_s["tp"] > 0


def test_megatron_2021_overlaps_the_data_parallel_reduction_only_without_a_pipeline():
    # Its PyTorch DDP (p = 1) reduces under the last backward; its local DDP (p > 1) after it.
    model = Model.of("gpt2", 24, 2304, 24, 2048, 51200)
    cluster, old = load_cluster(DGX_A100), Software.megatron_2021()
    for p, hidden in ((1, True), (2, False)):
        layout = Layout(1, p, 32, 1, 4, "1f1b", "full", sequence_parallel=False)
        both = estimate(model, layout, cluster, old, 512)
        never = estimate(model, layout, cluster, replace(old, dp_overlap=False), 512)
        total = never.time_parts_s["dp"]
        assert total > 0
        assert both.time_parts_s["dp"] + both.hidden_comm_s["dp"] == pytest.approx(total)
        assert (both.hidden_comm_s["dp"] > 0) is hidden, p
        assert (both.step_time_s < never.step_time_s) is hidden, p
