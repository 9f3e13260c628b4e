"""``hpcllm inspect RUN_DIR``: whether each checkpoint of a run folder verifies.

A run folder (one with checkpoints/, metrics.jsonl or config.yaml and no data manifest.json)
is checked against each checkpoint's manifest (:func:`hpcllm.train.checkpoint.verify`), one
row per checkpoint; a data folder goes to :mod:`hpcllm.datasets.inspection`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcllm.datasets.shards import MANIFEST
from hpcllm.errors import UserError
from hpcllm.train import checkpoint


def is_run_folder(path: Path) -> bool:
    """Return whether ``path`` is a training run's folder rather than a prepared data folder."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return False
    return any((path / name).exists() for name in ("checkpoints", "metrics.jsonl", "config.yaml"))


@dataclass(frozen=True)
class RunCheck:
    """The verdict on each of a run's checkpoints (newest first) and on its `latest` file."""

    run_dir: Path
    verdicts: list[Any]  # hpcllm.train.checkpoint.Verdict
    latest: str | None  # the folder `latest` names, None if there is no `latest`
    latest_problem: str | None = None
    newest: str | None = None  # the newest good checkpoint's format, layout and parts

    @property
    def ok(self) -> bool:
        """Return whether every checkpoint verifies (or predates manifests) and `latest` reads."""
        return self.latest_problem is None and all(v.status != "bad" for v in self.verdicts)


def verify_run(run_dir: Path) -> RunCheck:
    """Return the verdict on every checkpoint of a run folder, reading all their files."""
    verdicts = [checkpoint.verify(folder) for folder in checkpoint.checkpoints(run_dir)]
    good = next((v.folder for v in verdicts if v.status == "ok"), None)
    newest = describe_checkpoint(good) if good is not None else None
    try:
        pointed = checkpoint.latest(run_dir)
    except UserError as err:
        return RunCheck(Path(run_dir), verdicts, None, str(err).split(";")[0], newest)
    return RunCheck(Path(run_dir), verdicts, pointed.name if pointed else None, None, newest)


def describe_checkpoint(folder: Path) -> str:
    """Return one line: a verified checkpoint's step, format, layout and named parts."""
    from hpcllm.train.checkpoint.format import layout_of, parts_of

    manifest = checkpoint.read_manifest(folder) or {}
    meta = checkpoint.read_meta(folder)
    layout = layout_of(manifest, meta)
    sizes = " x ".join(f"{axis} {size}" for axis, size in layout.sizes.items())
    files = "; ".join(f"{kind} by {', '.join(axes)}" for kind, axes in layout.files.items())
    return (
        f"step {meta['step']}: format {manifest.get('format_version', 1)}, {sizes} "
        f"({files}), parts: {', '.join(parts_of(manifest))}"
    )


def render_run(check: RunCheck) -> str:
    """Return :func:`verify_run`'s answer as a table, one row per checkpoint."""
    if not check.verdicts and check.latest_problem is None:
        return f"{check.run_dir}: no checkpoints"
    cells = [("step", "files", "bytes", "status")]
    cells += [(str(v.step), str(v.files), str(v.bytes), v.status) for v in check.verdicts]
    reasons = ["reason"] + [v.reason for v in check.verdicts]
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    lines = []
    for row, reason in zip(cells, reasons, strict=True):
        numbers = "  ".join(cell.rjust(w) for cell, w in zip(row[:3], widths, strict=False))
        lines.append(f"{numbers}  {row[3].ljust(widths[3])}  {reason}".rstrip())
    lines.append(f"latest: {check.latest_problem or check.latest}")
    if check.newest is not None:
        lines.append(f"newest that verifies: {check.newest}")
    return "\n".join(lines)
