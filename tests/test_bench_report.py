"""``hpcllm bench report``: every part at toy sizes on the CPU, the files it writes, the cluster
file the planner reads from it, and a machine without a GPU told so in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from mpirun import REPO

from hpcllm.bench import report_files
from hpcllm.bench.report import PARTS
from hpcllm.errors import UserError
from hpcllm.plan.hardware import cluster_from_dict, load_cluster

ENV = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}


def _hpcllm(*args: str, cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpcllm", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=ENV,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One smoke report, in an empty folder with no data anywhere, and how long it took."""
    cwd = tmp_path_factory.mktemp("empty")
    began = time.monotonic()
    done = _hpcllm("bench", "report", "--cpu-smoke", "--out", "X", cwd=cwd)
    return cwd, done, time.monotonic() - began


@pytest.mark.slow
def test_the_smoke_report_runs_every_part_and_writes_its_files(smoke):
    cwd, done, seconds = smoke
    assert done.returncode == 0, done.stderr[-3000:]
    assert seconds <= 180, seconds
    out = cwd / "X"
    for name in ("report.md", "report.json", "cluster.yaml", "step.png", "collectives.png"):
        assert (out / name).is_file(), name
    report = json.loads((out / "report.json").read_text())
    assert report["smoke"] is True and list(report["parts"]) == list(PARTS)
    assert {name: p["status"] for name, p in report["parts"].items()} == dict.fromkeys(
        PARTS, "done"
    )
    progress = [line for line in done.stderr.splitlines() if line.startswith("bench report: [")]
    assert len(progress) == 2 * len(PARTS)  # a line as each part starts, one as it ends
    parts = report["parts"]
    assert parts["tests"]["data"]["collected"] > 0  # the gpu marker selects tests
    step = parts["step"]["data"]["shapes"]["cpu-smoke"]
    assert {r["name"] for r in step["rows"]} >= {
        "plain gpt2 eager",
        "hpcllm step (as configured)",
        "hpcllm step, compile none",
        "hpcllm trainer loop",
    }
    # The Llama run: the plain Llama and hpcllm's, at the smoke size.
    llama = parts["step"]["data"]["shapes"]["llama-tiny at cpu-smoke"]["rows"]
    assert {"plain llama eager", "hpcllm step (as configured)"} <= {r["name"] for r in llama}
    assert parts["train"]["data"]["loop_vs_step"] > 0
    rows = parts["collectives"]["data"]["result"]["rows"]
    assert {r["collective"] for r in rows if r["transport"] == "torch"} == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "send_recv",
    }
    text = (out / "report.md").read_text()
    for heading in ("## Environment", "## Training step", "## Collectives", "## cluster.yaml"):
        assert heading in text
    assert not (cwd / "data").exists()


# Slow: it shares the smoke report (about 85 s), which the edit-test loop would build for it.
@pytest.mark.slow
def test_the_planner_plans_with_the_reports_cluster_file(smoke):
    cwd, done, _ = smoke
    assert done.returncode == 0
    cluster = load_cluster(cwd / "X" / "cluster.yaml")
    assert cluster.gpus_per_node == 2
    table = cluster.comm_tables["intra_node"]["all_reduce"]
    assert sorted(table) == [8192, 65536, 1 << 20] and all(v > 0 for v in table.values())
    raw = (cwd / "X" / "cluster.yaml").read_text()
    assert "intra_node_gbps" in raw and "# measured here" in raw and "# data sheet" in raw
    plan = _hpcllm(
        "plan", "--cluster", "X/cluster.yaml", "--model", "tiny", "--gpus", "2",
        "--global-batch", "8", cwd=cwd, timeout=300,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert "#1 memory per GPU" in plan.stdout


@pytest.mark.slow
def test_parts_run_again_keep_the_other_parts_results(smoke):
    cwd, done, _ = smoke
    assert done.returncode == 0
    before = json.loads((cwd / "X" / "report.json").read_text())
    again = _hpcllm("bench", "report", "--cpu-smoke", "--out", "X", "--parts", "environment",
                    cwd=cwd)  # fmt: skip
    assert again.returncode == 0, again.stderr
    after = json.loads((cwd / "X" / "report.json").read_text())
    assert len(after["commands"]) == 2 and list(after["parts"]) == list(PARTS)
    assert after["parts"]["step"] == before["parts"]["step"]
    assert after["parts"]["environment"]["at"] >= before["parts"]["environment"]["at"]


@pytest.mark.slow
def test_out_and_parts_mistakes_are_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    cases = {
        ("--out", "file"): "is a file",
        ("--out", "other"): "not a report",
        ("--out", "Y", "--parts", "step,nope"): "unknown part 'nope'",
    }
    for args, words in cases.items():
        done = _hpcllm("bench", "report", "--cpu-smoke", *args, cwd=tmp_path)
        assert done.returncode == 2 and words in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_make_gpu_report_without_a_gpu_says_so_in_one_line(tmp_path):
    done = subprocess.run(
        ["make", "-s", "gpu-report", f"REPORT_DIR={tmp_path / 'r'}"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=300,
    )
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("hpcllm:")]
    assert len(ours) == 1 and "no GPU" in ours[0], done.stderr
    assert "--cpu-smoke" in ours[0]
    assert not (tmp_path / "r").exists()


def _gpu_report(collectives: bool) -> dict:
    """A report as one H200 would leave it (the numbers invented), with or without the
    collective part."""
    parts = {
        "environment": {
            "status": "done",
            "data": {"host": "node1", "gpus": [{"name": "NVIDIA H200", "memory_mib": 143771}]},
        },
        "device": {
            "status": "done",
            "data": {
                "fragment": {
                    "gpu": "h200",
                    "gpu_spec": {
                        "gemm_ceiling": 0.78,
                        "flash_efficiency": 0.25,
                        "shape_factor": {"64": 0.3, "2048": 1.0},
                    },
                }
            },
        },
    }
    if collectives:
        rows = [
            {"collective": c, "transport": t, "bytes": b, "time_us": us, "busbw_gbps": bw}
            for c in ("all_reduce", "all_gather")
            for t, scale in (("torch", 1.0), ("mpi", 0.5))
            for b, us, bw in ((8192, 20.0, 0.4 * scale), (1 << 30, 4000.0, 300.0 * scale))
        ]
        parts["collectives"] = {"status": "done", "data": {"result": {"rows": rows}}}
    return {"smoke": False, "created": "2026-11-26T00:00:00", "commands": ["x"], "parts": parts}


def test_the_cluster_file_marks_what_one_gpu_cannot_measure():
    text = report_files.cluster_yaml(_gpu_report(collectives=False))
    cluster = cluster_from_dict(yaml.safe_load(text))
    assert cluster.gpu.name == "h200" and cluster.gpus_per_node == 1
    assert cluster.gpu.gemm_ceiling == 0.78 and cluster.gpu.peak_bf16 == 989.4  # data sheet
    assert dict(cluster.gpu.shape_factor) == {64: 0.3, 2048: 1.0}
    assert (cluster.intra_node_gbps, cluster.inter_node_gbps) == (360.0, 45.0)
    lines = {line.split(":")[0]: line for line in text.splitlines()}
    assert "data sheet, not measured: one GPU here" in lines["intra_node_gbps"]
    assert "one node measures no link between nodes" in lines["inter_node_gbps"]
    assert cluster.comm_tables == {}


def test_the_cluster_file_takes_torch_distributeds_measured_tables():
    text = report_files.cluster_yaml(_gpu_report(collectives=True))
    cluster = cluster_from_dict(yaml.safe_load(text))
    assert cluster.intra_node_gbps == 300.0 and cluster.intra_node_latency_us == 20.0
    assert cluster.inter_node_gbps == 45.0  # still the data sheet's
    assert cluster.comm_tables == {
        "intra_node": {
            "all_reduce": {8192: 0.4, 1 << 30: 300.0},
            "all_gather": {8192: 0.4, 1 << 30: 300.0},
        }
    }


@pytest.mark.parametrize(
    ("tables", "words"),
    [
        ([1], "must map link kinds"),
        ({"pcie": {"all_reduce": {8: 1.0}}}, "unknown link kind 'pcie'"),
        ({"intra_node": {"broadcast": {8: 1.0}}}, "unknown collective"),
        ({"intra_node": {"all_reduce": {}}}, "must map message bytes"),
        ({"intra_node": {"all_reduce": {"8K": 1.0}}}, "'8K' is not a message size"),
        ({"intra_node": {"all_reduce": {8: -1.0}}}, "must be above 0"),
        ({"intra_node": {"all_reduce": {8: "fast"}}}, "must be a number"),
    ],
)
def test_comm_tables_are_checked_in_one_line(tables, words):
    raw = yaml.safe_load(report_files.cluster_yaml(_gpu_report(collectives=False)))
    raw["comm_tables"] = tables
    with pytest.raises(UserError, match=words) as err:
        cluster_from_dict(raw, "c.yaml")
    assert "\n" not in str(err.value)


def _between_nodes(nodes: int = 2, per_node: int = 2) -> dict:
    """A collectives result as jobs/collectives.sh leaves it across nodes (numbers invented)."""
    rows = [
        {"collective": c, "transport": "torch", "bytes": b, "time_us": us, "busbw_gbps": bw}
        for c in ("all_reduce", "send_recv")
        for b, us, bw in ((8192, 30.0, 0.3), (1 << 30, 30000.0, 40.0))
    ]
    return {"world_size": nodes * per_node, "nodes": nodes, "ranks_per_node": per_node,
            "rows": rows}  # fmt: skip


@pytest.mark.slow
def test_merge_adds_the_tables_measured_between_nodes(smoke, tmp_path):
    import shutil

    out = tmp_path / "report"
    shutil.copytree(smoke[0] / "X", out)  # a whole one-node report (2 CPU ranks a node)
    (tmp_path / "inter.json").write_text(json.dumps(_between_nodes()))
    done = _hpcllm("bench", "report", "--out", str(out), "--merge", str(tmp_path / "inter.json"),
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    cluster = load_cluster(out / "cluster.yaml")
    assert cluster.comm_tables["inter_node"] == {
        "all_reduce": {8192: 0.3, 1 << 30: 40.0},
        "send_recv": {8192: 0.3, 1 << 30: 40.0},
    }
    assert cluster.comm_tables["intra_node"]["all_reduce"]  # the node's own, kept
    # The per-adapter constants: the bus bandwidth over the ranks per node, the smallest time.
    assert (cluster.inter_node_gbps, cluster.inter_node_latency_us) == (20.0, 30.0)
    text = (out / "cluster.yaml").read_text()
    assert "measured between 2 nodes" in text
    assert json.loads((out / "report.json").read_text())["inter_node"]["result"]["nodes"] == 2
    # What cannot be merged is one line, exit 2, and the files stay as they were.
    for result, words in [
        (_between_nodes(nodes=1), "ran on one node"),
        (_between_nodes(per_node=4), "ran 4 ranks per node on nodes of 2 GPUs"),
        ({"rows": []}, "is not the JSON of hpcllm bench collectives"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps(result))
        bad = _hpcllm("bench", "report", "--out", str(out), "--merge", str(tmp_path / "bad.json"),
                      cwd=tmp_path)  # fmt: skip
        assert bad.returncode == 2 and words in bad.stderr, bad.stderr
        assert (out / "cluster.yaml").read_text() == text
    empty = _hpcllm("bench", "report", "--out", str(tmp_path / "none"), "--merge",
                    str(tmp_path / "inter.json"), cwd=tmp_path)  # fmt: skip
    assert empty.returncode == 2 and "has no report.json" in empty.stderr
