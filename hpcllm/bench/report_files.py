"""What ``hpcllm bench report`` writes: report.json, report.md with its plots, cluster.yaml.

Every file is written whole or not at all, after each part, from the results so far
(``report.json`` is the record; the rest is drawn from it). ``cluster.yaml`` is the cluster
format of :mod:`hpcllm.plan.hardware`: the measured ``gpu_spec``, link bandwidths and
latencies (measured inside the node where the collectives ran, else the data sheet's, each
marked), and the collective tables under ``comm_tables``.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

from hpcllm.errors import UserError
from hpcllm.files import atomic_write

FORMAT = "hpcllm-report"
FORMAT_VERSION = 1
# Link figures per GPU kind when nothing measured them: (intra-node GB/s, inter-node GB/s,
# intra-node latency us, inter-node latency us) of the cluster files in jobs/clusters
# (NCCL bus bandwidth over NVLink/NVSwitch inside a DGX node; one InfiniBand adapter per GPU).
DATA_SHEET_LINKS: dict[str, tuple[float, float, float, float]] = {
    "a100-40gb": (230.0, 23.0, 8.0, 12.0),
    "a100-80gb": (230.0, 23.0, 8.0, 12.0),
    "h100-sxm": (360.0, 45.0, 8.0, 12.0),
    "h200": (360.0, 45.0, 8.0, 12.0),
    # PCIe Gen5 x16 between cards, about 50 GB/s per direction; 400 Gb/s NDR per GPU.
    "h100-pcie": (40.0, 45.0, 10.0, 12.0),
}
# Anything else (the CPU of --cpu-smoke): jobs/clusters/cpu-local.yaml's gloo figures.
OTHER_LINKS = (1.0, 1.0, 100.0, 100.0)
COLLECTIVE_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def load(out: Path, smoke: bool) -> dict[str, Any]:
    """Return the report in ``out`` to add parts to, or a new one (also when the earlier one
    was measured the other way: smoke and real results never mix)."""
    path = out / "report.json"
    if path.is_file():
        try:
            report = json.loads(path.read_text())
        except json.JSONDecodeError:
            report = None
        if isinstance(report, dict) and report.get("smoke") == smoke and "parts" in report:
            report["commands"] = [*report.get("commands", []), _command()]
            return report
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "smoke": smoke,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "commands": [_command()],
        "parts": {},
    }


def _command() -> str:
    return " ".join(["hpcllm", *sys.argv[1:]]) if sys.argv else "hpcllm bench report"


def _part(report: dict[str, Any], name: str) -> dict[str, Any] | None:
    """Return a part's data if it is done, else None."""
    part = report["parts"].get(name)
    return part["data"] if part and part["status"] in ("done", "failed") and part["data"] else None


def write(out: Path, report: dict[str, Any]) -> None:
    """Write report.json, cluster.yaml, the plots and report.md from ``report``."""
    atomic_write(out / "report.json", json.dumps(report, indent=2, default=str) + "\n")
    cluster_text = cluster_yaml(report)
    atomic_write(out / "cluster.yaml", cluster_text)
    plots = _plots(out, report)
    atomic_write(out / "report.md", render(report, cluster_text, plots))


# -- cluster.yaml ---------------------------------------------------------------------------


def _table_of(result: dict[str, Any]) -> dict[str, dict[int, float]]:
    """Return ``{collective: {bytes: bus GB/s}}`` of a collectives result's torch.distributed
    rows (the transport the engines use)."""
    table: dict[str, dict[int, float]] = {}
    for row in result["rows"]:
        if row["transport"] == "torch":
            table.setdefault(row["collective"], {})[int(row["bytes"])] = round(row["busbw_gbps"], 4)
    return table


def _inter_node(report: dict[str, Any]) -> dict[str, Any] | None:
    """Return the collectives result measured between nodes (``--merge``), if any."""
    merged = report.get("inter_node")
    return merged["result"] if merged else None


def comm_tables(report: dict[str, Any]) -> dict[str, dict[str, dict[int, float]]]:
    """Return ``{link kind: {collective: {bytes: bus GB/s}}}``: inside this node from the
    collectives part, between nodes from a merged multi-node run."""
    tables = {}
    data = _part(report, "collectives")
    inside = _table_of(data["result"]) if data else {}
    if inside:
        tables["intra_node"] = inside
    across = _table_of(_inter_node(report)) if _inter_node(report) else {}
    if across:
        tables["inter_node"] = across
    return tables


def _largest_and_smallest(result: dict[str, Any] | None) -> tuple[dict, dict] | None:
    """Return the all-reduce rows of torch.distributed at the largest and smallest size."""
    rows = [r for r in (result or {}).get("rows", []) if r["transport"] == "torch"]
    reduce = sorted((r for r in rows if r["collective"] == "all_reduce"), key=lambda r: r["bytes"])
    return (reduce[-1], reduce[0]) if reduce else None


def _links(report: dict[str, Any], kind: str) -> tuple[list[float], list[bool]]:
    """Return intra/inter bandwidth and latency, and whether each was measured here.

    Between nodes the all-reduce ran on every GPU of each node, each with its adapter: the
    per-adapter bandwidth (the constant's meaning) is its bus bandwidth / ranks per node.
    """
    values = list(DATA_SHEET_LINKS.get(kind, OTHER_LINKS))
    measured = [False] * 4
    data = _part(report, "collectives")
    inside = _largest_and_smallest(data["result"] if data else None)
    if inside:
        values[0], measured[0] = inside[0]["busbw_gbps"], True
        values[2], measured[2] = inside[1]["time_us"], True
    result = _inter_node(report)
    across = _largest_and_smallest(result)
    if across and result:
        values[1], measured[1] = across[0]["busbw_gbps"] / result["ranks_per_node"], True
        values[3], measured[3] = across[1]["time_us"], True
    return values, measured


def gpus_per_node(report: dict[str, Any]) -> int:
    """Return the GPUs of the node the report measured (the smoke report's 2 CPU ranks)."""
    if report["smoke"]:
        return 2
    return max(1, len((_part(report, "environment") or {}).get("gpus") or []))


def merge(out: Path, result_path: Path) -> dict[str, Any]:
    """Add a collectives result measured between nodes (``hpcllm bench collectives --json``
    across two or more nodes, one rank per GPU) to the report in ``out`` and rewrite its
    files; return the report. A UserError for a result that cannot be merged."""
    if not (out / "report.json").is_file():
        raise UserError(
            f"--merge adds to a report: {out} has no report.json; run hpcllm bench report "
            f"--out {out} on one node first"
        )
    try:
        result = json.loads(Path(result_path).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"--merge {result_path}: cannot read it ({err})") from None
    if not isinstance(result, dict) or not {"rows", "nodes", "ranks_per_node"} <= set(result):
        raise UserError(
            f"--merge {result_path} is not the JSON of hpcllm bench collectives --json (of this "
            "version, which records its nodes)"
        )
    if result["nodes"] < 2:
        raise UserError(
            f"--merge {result_path} ran on one node; --merge takes tables measured between "
            "nodes (jobs/collectives.sh runs them across NODES nodes)"
        )
    report = json.loads((out / "report.json").read_text())
    report["commands"] = [*report.get("commands", []), _command()]
    per_node = gpus_per_node(report)
    if result["ranks_per_node"] != per_node:
        raise UserError(
            f"--merge {result_path} ran {result['ranks_per_node']} ranks per node on nodes of "
            f"{per_node} GPUs; run one rank per GPU on every GPU of each node"
        )
    report["inter_node"] = {
        "result": result,
        "from": str(result_path),
        "at": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    write(out, report)
    return report


def cluster_yaml(report: dict[str, Any]) -> str:
    """Return cluster.yaml: a cluster file with what this report measured."""
    import yaml

    device = _part(report, "device")
    env = _part(report, "environment") or {}
    fragment = (device or {}).get("fragment") or {}
    kind = fragment.get("gpu") or "h100-sxm"
    gpus = env.get("gpus") or []
    per_node = gpus_per_node(report)
    name = gpus[0]["name"] if gpus else "cpu (smoke)"
    (intra, inter, intra_us, inter_us), measured = _links(report, str(kind))

    def mark(i: int, what: str) -> str:
        if measured[i] and i in (1, 3):
            nodes = report["inter_node"]["result"]["nodes"]
            return f"  # measured between {nodes} nodes (bench report --merge): " + what
        if measured[i]:
            return "  # measured here: " + what
        return "  # data sheet, not measured: " + (
            "one node measures no link between nodes" if i in (1, 3) else "one GPU here"
        )

    host = env.get("host", "this node")
    lines = [
        f"# Written by `{report['commands'][-1]}` on {report['created'][:10]}.",
        "# hpcllm plan --cluster THIS_FILE reads it; the measured values come from report.json.",
        f"name: {json.dumps(f'{name} x{per_node} ({host})')}",
        f"gpu: {kind}",
    ]
    if device:
        spec = dict(fragment.get("gpu_spec", {}))
        if "shape_factor" in spec:  # JSON made its dimensions strings
            spec["shape_factor"] = {int(d): f for d, f in spec["shape_factor"].items()}
        spec = yaml.safe_dump({"gpu_spec": spec}, sort_keys=False)
        lines += ["# measured by hpcllm bench device", *spec.rstrip().splitlines()]
    else:
        lines.append("# gpu_spec: not measured (the device part did not run); the kind's own")
    lines += [
        f"gpus_per_node: {per_node}",
        f"intra_node_gbps: {intra:.4g}" + mark(0, "all-reduce bus bandwidth, largest message"),
        f"inter_node_gbps: {inter:.4g}"
        + mark(1, "all-reduce bus bandwidth per GPU's adapter, largest message"),
        f"intra_node_latency_us: {intra_us:.4g}" + mark(2, "all-reduce time, smallest message"),
        f"inter_node_latency_us: {inter_us:.4g}" + mark(3, "all-reduce time, smallest message"),
    ]
    tables = comm_tables(report)
    if tables:
        lines.append(
            "# bus bandwidth in GB/s by message bytes, torch.distributed (nccl-tests' busbw)"
        )
        lines += yaml.safe_dump({"comm_tables": tables}, sort_keys=False).rstrip().splitlines()
    return "\n".join(lines) + "\n"


# -- plots ----------------------------------------------------------------------------------


def _plots(out: Path, report: dict[str, Any]) -> dict[str, str]:
    """Draw step.png and collectives.png where their parts have data; return the names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = {}
    step = _part(report, "step")
    if step and step.get("shapes"):
        shapes = step["shapes"]
        fig, axes = plt.subplots(len(shapes), 1, figsize=(8, 2.2 + 1.9 * len(shapes)))
        for ax, (shape, entry) in zip(
            [axes] if len(shapes) == 1 else axes, shapes.items(), strict=True
        ):
            rows = entry["rows"]
            ax.barh([r["name"] for r in rows], [r["step_ms"] for r in rows], color="tab:blue")
            ax.invert_yaxis()
            ax.set_title(f"{shape}: ms per step (shorter is faster)", fontsize=10)
            ax.tick_params(labelsize=8)
        fig.tight_layout()
        _save(fig, out / "step.png")
        plt.close(fig)
        drawn["step"] = "step.png"
    coll = _part(report, "collectives")
    if coll:
        rows = coll["result"]["rows"]
        names = [c for c in COLLECTIVE_NAMES if any(r["collective"] == c for r in rows)]
        fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3), squeeze=False)
        for ax, name in zip(axes[0], names, strict=True):
            for transport in sorted({r["transport"] for r in rows if r["collective"] == name}):
                pts = sorted(
                    (r["bytes"], r["busbw_gbps"])
                    for r in rows
                    if r["collective"] == name and r["transport"] == transport
                )
                ax.plot(*zip(*pts, strict=True), marker="o", label=transport)
            ax.set_xscale("log", base=2)
            ax.set_title(name, fontsize=10)
            ax.set_xlabel("bytes")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("bus bandwidth, GB/s")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        _save(fig, out / "collectives.png")
        plt.close(fig)
        drawn["collectives"] = "collectives.png"
    return drawn


def _save(fig: Any, path: Path) -> None:
    partial = path.with_name(f".{path.name}.partial.png")
    fig.savefig(partial, dpi=110)
    partial.replace(path)


# -- report.md ------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render(report: dict[str, Any], cluster_text: str, plots: dict[str, str]) -> str:
    """Return report.md: the parts' status, then each part's tables."""
    env = _part(report, "environment") or {}
    gpus = env.get("gpus") or []
    title = gpus[0]["name"] + (f" x{len(gpus)}" if len(gpus) > 1 else "") if gpus else "CPU"
    lines = [
        f"# hpcllm report: {title}{' (cpu smoke: the numbers mean nothing)' * report['smoke']}",
        "",
        f"Started {report['created']}. Commands: "
        + "; ".join(f"`{c}`" for c in report["commands"]),
        "",
        "| part | status | seconds | note |",
        "|---|---|---:|---|",
    ]
    for name, part in report["parts"].items():
        lines.append(f"| {name} | {part['status']} | {part['seconds']:.0f} | {part['reason']} |")
    for section in (_env_md, _tests_md, _device_md, _kernels_md, _step_md, _train_md, _coll_md):
        lines += ["", *section(report, plots)]
    lines += ["", "## cluster.yaml", "", "```yaml", cluster_text.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _env_md(report: dict[str, Any], plots: dict[str, str]) -> list[str]:
    env = _part(report, "environment")
    if not env:
        return []
    gpus = env.get("gpus") or []
    hvd = env.get("horovod")
    mpi = env.get("mpi")
    rows = [
        ("host", f"{env['host']} ({env['cpu_cores']} CPU cores), {env['platform']}"),
        (
            "GPUs",
            ", ".join(f"{g['name']} ({g['memory_mib']} MiB, {g['sms']} SMs)" for g in gpus)
            or "none",
        ),
        ("driver", env.get("driver") or "-"),
        (
            "CUDA / cuDNN / NCCL",
            f"{env['cuda'] or '-'} / {env['cudnn'] or '-'} / {env['nccl'] or '-'}",
        ),
        ("Python / torch / Triton", f"{env['python']} / {env['torch']} / {env['triton'] or '-'}"),
        ("hpcllm", f"{env['hpcllm']} ({(env.get('commit') or 'no git commit')[:12]})"),
        ("MPI", (mpi or {}).get("library") or "mpi4py cannot load an MPI library"),
        ("mpirun", env.get("mpirun") or "not found"),
        (
            "Horovod",
            "not installed"
            if not hvd
            else f"{hvd['version']}: NCCL {hvd['nccl_built']}, MPI {hvd['mpi_built']}, "
            f"Gloo {hvd['gloo_built']}",
        ),
    ]
    return ["## Environment", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def _tests_md(report: dict[str, Any], plots: dict[str, str]) -> list[str]:
    data = _part(report, "tests")
    if not data:
        return []
    if not data.get("ran"):
        return ["## GPU tests", "", f"{data['collected']} tests marked gpu collected, not run."]
    return [
        "## GPU tests",
        "",
        f"`pytest -m gpu`: {data['passed']} passed, {data['failed']} failed, "
        f"{data['errors']} errors, {data['skipped']} skipped (raw/tests.log).",
    ]


def _device_md(report: dict[str, Any], plots: dict[str, str]) -> list[str]:
    data = _part(report, "device")
    return ["## Device (`hpcllm bench device`)", "", data["tables"]] if data else []


def _kernels_md(report: dict[str, Any], plots: dict[str, str]) -> list[str]:
    data = _part(report, "kernels")
    return ["## Fused kernels (`hpcllm bench kernels`)", "", data["tables"]] if data else []


def _step_md(report: dict[str, Any], plots: dict[str, str]) -> list[str]:
    data = _part(report, "step")
    if not data or not data.get("shapes"):
        return []
    lines = ["## Training step (`hpcllm bench step`)"]
    for shape, entry in data["shapes"].items():
        any_run = next(iter(entry["variants"].values()))
        lines += [
            "",
            f"**{shape}**: {any_run['n_layer']} layers, d {any_run['d_model']}, seq "
            f"{any_run['seq_len']} x mb {any_run['micro_batch_size']}, "
            f"{any_run['flops_per_step'] / 1e12:.3g} TFLOP per step. Each variant is its own "
            f"run, timed against the plain {any_run['arch']} model in that run.",
            "",
            "| side | ms/step | tokens/s | TFLOP/s | MFU | x plain eager | x plain compiled "
            "| peak MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in entry["rows"]:
            mfu = None if r["mfu"] is None else 100 * r["mfu"]
            lines.append(
                f"| {r['name']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} "
                f"| {_fmt(r['tflops'], '.3g')} | {_fmt(mfu, '.1f')} "
                f"| {_fmt(r.get('vs_plain_eager'), '.3f')} "
                f"| {_fmt(r.get('vs_plain_compile'), '.3f')} "
                f"| {_fmt(r.get('peak_mem_mb'), '.0f')} |"
            )
        goal = entry.get("goal")
        ours = next((r for r in entry["rows"] if r["key"] == "hpcllm"), None)
        if goal and ours and ours.get("vs_plain_compile"):
            met = "met" if ours["vs_plain_compile"] >= goal else "missed"
            lines += [
                "",
                f"Goal: hpcllm as configured >= {goal}x plain + torch.compile: {met} "
                f"({ours['vs_plain_compile']:.3f}x).",
            ]
    if "step" in plots:
        lines += ["", f"![ms per step]({plots['step']})"]
    return lines


def _train_md(report: dict[str, Any], plots: dict[str, str]) -> list[str]:
    data = _part(report, "train")
    if not data:
        return []
    lines = [
        "## The training loop (`hpcllm train`)",
        "",
        f"{data['steps']} steps at {data['shape']} on synthetic data, logging every step: "
        f"median {data['median_step_ms']:.1f} ms/step, {data['median_tokens_per_s']:.0f} "
        f"tokens/s over the second half of the run, final loss {data['final_loss']:.3f}.",
    ]
    if data.get("loop_vs_step"):
        lines.append(
            f"Against bench step's step as configured ({data['step_tokens_per_s']:.0f} tokens/s): "
            f"{data['loop_vs_step']:.3f}."
        )
    return lines


def _coll_md(report: dict[str, Any], plots: dict[str, str]) -> list[str]:
    data = _part(report, "collectives")
    if not data:
        return []
    result = data["result"]
    lines = [
        "## Collectives",
        "",
        f"{result['world_size']} ranks on {result['device']}, torch.distributed over "
        f"{result['backend']}; algbw = bytes / time, busbw as nccl-tests defines it.",
        "",
        "| collective | transport | bytes | time us | algbw GB/s | busbw GB/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['collective']} | {r['transport']} | {r['bytes']} | {r['time_us']:.1f} "
            f"| {r['algbw_gbps']:.3g} | {r['busbw_gbps']:.3g} |"
        )
    for s in result.get("skipped", []):
        lines.append(f"\nNot measured: {s['collective']} over {s['transport']}: {s['reason']}.")
    if "collectives" in plots:
        lines += ["", f"![bus bandwidth]({plots['collectives']})"]
    return lines
