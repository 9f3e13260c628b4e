"""Draw what ran on each pipeline rank: a PNG like the Megatron paper's figures, a Chrome trace.

Both take one list of intervals per rank, as ``simulate`` returns them and the runtime records
them: ``Interval`` objects or dicts with the keys kind, microbatch, chunk, start, end (seconds;
kind one of F, B, W, SEND_F, RECV_F, SEND_B, RECV_B). Files are written atomically.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcllm.files import atomic_write
from hpcllm.parallel.pipeline.schedule import Interval, Kind

COLOURS = {Kind.F: "#1f5fa8", Kind.B: "#2e8b3e", Kind.W: "#7b3fa0"}
IDLE = "#d0d0d0"
_NAMES = {Kind.F: "forward F", Kind.B: "backward B", Kind.W: "weight grad W"}

IntervalLike = Interval | Mapping[str, Any]


def as_intervals(intervals_per_rank: Sequence[Sequence[IntervalLike]]) -> list[list[Interval]]:
    """Return the intervals as ``Interval`` objects (dicts, e.g. read back from JSON, converted)."""
    return [[_as_interval(i) for i in rank] for rank in intervals_per_rank]


def draw(
    intervals_per_rank: Sequence[Sequence[IntervalLike]],
    path_png: str | os.PathLike,
    title: str = "",
    time_unit: str = "s",
) -> Path:
    """Draw one row per rank (rank 0 on top) into ``path_png`` and return its path.

    Forward blue, backward green, W purple, idle grey; the micro-batch number sits in each box
    and later chunks of an interleaved schedule are lighter shades. Communication intervals
    are not boxes: a rank waiting on one shows as idle.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    ranks = as_intervals(intervals_per_rank)
    compute = [[i for i in rank if i.kind.is_compute] for rank in ranks]
    everything = [i for rank in ranks for i in rank]
    if not everything:
        raise ValueError("no intervals to draw")
    t0 = min(i.start for i in everything)
    t1 = max(i.end for i in everything)
    span = (t1 - t0) or 1.0
    chunks = 1 + max((i.chunk for rank in compute for i in rank), default=0)
    boxes = max((len(rank) for rank in compute), default=1)

    width_in = min(28.0, max(9.0, 0.28 * boxes + 2.5))
    height_in = 1.2 + 0.55 * len(ranks)
    fig = Figure(figsize=(width_in, height_in), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((1.0 / width_in, 0.18, 1 - 1.4 / width_in, 0.7))
    points_per_unit = (ax.get_position().width * width_in * 72) / span
    for rank, intervals in enumerate(compute):
        y = len(ranks) - 1 - rank
        ax.add_patch(Rectangle((t0, y - 0.4), t1 - t0, 0.8, facecolor=IDLE, edgecolor="none"))
        for i in intervals:
            colour = _shade(COLOURS[i.kind], i.chunk, chunks)
            ax.add_patch(
                Rectangle(
                    (i.start, y - 0.4),
                    i.end - i.start,
                    0.8,
                    facecolor=colour,
                    edgecolor="white",
                    linewidth=0.6,
                )
            )
            size = min(9.0, 0.55 * (i.end - i.start) * points_per_unit)
            if size >= 4:
                ax.text(
                    (i.start + i.end) / 2,
                    y,
                    str(i.microbatch),
                    ha="center",
                    va="center",
                    fontsize=size,
                    color="white" if i.chunk < (chunks + 1) // 2 or chunks == 1 else "black",
                )
    ax.set_xlim(t0, t1)
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(range(len(ranks)))])
    ax.set_xlabel(f"time ({time_unit})")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    kinds = [k for k in (Kind.F, Kind.B, Kind.W) if any(i.kind is k for r in compute for i in r)]
    handles = [Patch(facecolor=COLOURS[k], label=_NAMES[k]) for k in kinds]
    handles += [
        Patch(facecolor=_shade(COLOURS[Kind.F], c, chunks), label=f"chunk {c} (lighter)")
        for c in range(1, chunks)
    ]
    handles.append(Patch(facecolor=IDLE, label="idle (bubble)"))
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.5 / (0.7 * height_in)),
        ncol=len(handles),
        frameon=False,
        fontsize=8,
    )
    if title:
        ax.set_title(title, fontsize=10)
    png = io.BytesIO()
    fig.savefig(png, format="png", bbox_inches="tight")
    path = Path(path_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, png.getvalue())
    return path


def chrome_trace(
    intervals_per_rank: Sequence[Sequence[IntervalLike]], path_json: str | os.PathLike
) -> Path:
    """Write a Chrome trace (chrome://tracing, Perfetto) with one process per rank; return its path.

    Each interval is one complete event (``ph: "X"``, ``pid = tid = rank``, ``ts``/``dur`` in
    µs, named like ``F3`` or ``F3c1``); one ``process_name`` metadata event names each rank.
    """
    events: list[dict[str, Any]] = []
    for rank, intervals in enumerate(as_intervals(intervals_per_rank)):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for i in intervals:
            events.append(
                {
                    "name": str(i.action),
                    "cat": i.kind.value,
                    "ph": "X",
                    "pid": rank,
                    "tid": rank,
                    "ts": i.start * 1e6,
                    "dur": (i.end - i.start) * 1e6,
                    "args": {"microbatch": i.microbatch, "chunk": i.chunk},
                }
            )
    path = Path(path_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


def _as_interval(item: IntervalLike) -> Interval:
    """Return ``item`` as an Interval; a dict needs kind, microbatch, start, end (chunk: 0)."""
    if isinstance(item, Interval):
        return item
    try:
        return Interval(
            Kind(item["kind"]),
            int(item["microbatch"]),
            int(item.get("chunk", 0)),
            float(item["start"]),
            float(item["end"]),
        )
    except (KeyError, ValueError, TypeError) as err:
        raise ValueError(f"not an interval: {item!r} ({err})") from err


def _shade(colour: str, chunk: int, chunks: int) -> str:
    """Return ``colour`` mixed with white: chunk 0 as is, the last chunk lightest."""
    if chunks == 1:
        return colour
    mix = 0.6 * chunk / (chunks - 1)
    rgb = [int(colour[k : k + 2], 16) for k in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02x}" for c in rgb)
