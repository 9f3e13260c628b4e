"""``hpcllm inspect RUN_DIR``: whether each checkpoint of a run folder verifies.

A run folder (one with checkpoints/, metrics.jsonl or config.yaml and no data manifest.json)
is checked against each checkpoint's manifest (:func:`hpcllm.train.checkpoint.verify`), one
row per checkpoint; a data folder goes to :mod:`hpcllm.datasets.inspection`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpcllm.datasets.blend import BLEND_PART, normalised
from hpcllm.datasets.shards import MANIFEST
from hpcllm.errors import UserError
from hpcllm.train import checkpoint
from hpcllm.train import run_dir as run_folder
from hpcllm.train.checkpoint.format import layout_of, parts_of


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
    # Saves a killed job did not finish (hidden .step_N.partial folders): (name, step, bytes).
    unfinished: tuple[tuple[str, int, int], ...] = ()
    lock: str | None = None  # who holds (or left) the run's lock file, None if there is none
    blend: tuple[str, ...] = ()  # a blended run's sources, and what the newest save drew

    @property
    def newest_unfinished(self) -> bool:
        """Return whether the newest save is one that did not finish."""
        finished = max((v.step for v in self.verdicts), default=-1)
        return any(step > finished for _, step, _ in self.unfinished)

    @property
    def ok(self) -> bool:
        """Return whether every checkpoint verifies (or predates manifests), `latest` reads and
        the newest save finished."""
        return (
            self.latest_problem is None
            and all(v.status != "bad" for v in self.verdicts)
            and not self.newest_unfinished
        )


def verify_run(run_dir: Path) -> RunCheck:
    """Return the verdict on every checkpoint of a run folder, reading all their files."""
    verdicts = [checkpoint.verify(folder) for folder in checkpoint.checkpoints(run_dir)]
    good = next((v.folder for v in verdicts if v.status == "ok"), None)
    newest = describe_checkpoint(good) if good is not None else None
    unfinished = tuple(
        (folder.name, _partial_step(folder), _bytes(folder))
        for folder in run_folder.unfinished_checkpoints(Path(run_dir))
    )
    others = {
        "unfinished": unfinished,
        "lock": run_folder.lock_holder(Path(run_dir)),
        "blend": describe_blend(Path(run_dir), good),
    }
    try:
        pointed = checkpoint.latest(run_dir)
    except UserError as err:
        return RunCheck(Path(run_dir), verdicts, None, str(err).split(";")[0], newest, **others)
    name = pointed.name if pointed else None
    return RunCheck(Path(run_dir), verdicts, name, None, newest, **others)


def _partial_step(folder: Path) -> int:
    """Return the step of an unfinished checkpoint folder (``.step_00000002.partial`` -> 2)."""
    return checkpoint.step_of(folder.name[1 : -len(".partial")])


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def describe_checkpoint(folder: Path) -> str:
    """Return one line: a verified checkpoint's step, format, layout and named parts."""
    manifest = checkpoint.read_manifest(folder) or {}
    meta = checkpoint.read_meta(folder)
    layout = layout_of(manifest, meta)
    sizes = " x ".join(f"{axis} {size}" for axis, size in layout.sizes.items())
    files = "; ".join(f"{kind} by {', '.join(axes)}" for kind, axes in layout.files.items())
    return (
        f"step {meta['step']}: format {manifest.get('format_version', 1)}, {sizes} "
        f"({files}), parts: {', '.join(parts_of(manifest))}"
    )


def describe_blend(run_dir: Path, newest: Path | None) -> tuple[str, ...]:
    """Return a blended run's lines: each source of its config.yaml (name, weight, folder) and
    the samples it had given at the ``newest`` good checkpoint; none for another run."""
    try:
        raw = yaml.safe_load((run_dir / "config.yaml").read_text())
        entries = raw["data"]["blend"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return ()
    try:
        return _blend_lines(entries, newest)
    except (TypeError, ValueError, IndexError, AttributeError):  # a config.yaml edited by hand
        return ()


def _blend_lines(entries: Any, newest: Path | None) -> tuple[str, ...]:
    if not isinstance(entries, list) or not entries:
        return ()
    position: dict[str, Any] = {}
    if newest is not None:
        position = checkpoint.read_meta(newest).get(BLEND_PART, {})
    drawn = position.get("samples", {})
    step = f" (at {newest.name})" if newest is not None else ""
    began = (
        f"; its order begun at sample {position['phase_start']}"
        if position.get("phase_start")
        else ""
    )
    lines = [
        f"blend of {len(entries)} (data.blend): name, weight, samples drawn{step}, folder{began}"
    ]
    width = max(len(str(e[2])) for e in entries)
    weights = normalised([float(e[1]) for e in entries])
    for (path, _, name), weight in zip(entries, weights, strict=True):
        count = str(drawn.get(name, "-"))
        lines.append(f"  {name:<{width}}  {weight:.4f}  {count:>9}  {path}")
    return tuple(lines)


def render_run(check: RunCheck) -> str:
    """Return :func:`verify_run`'s answer as a table, one row per checkpoint (and a blended
    run's sources)."""
    lines = [
        f"unfinished: {name} ({size / 1e6:.3g} MB), a save of step {step} that did not finish "
        "(the next run here removes it)"
        for name, step, size in check.unfinished
    ]
    if check.lock is not None:
        lines.append(f"lock: {check.lock}")
    lines += check.blend
    if not check.verdicts and check.latest_problem is None:
        return "\n".join([f"{check.run_dir}: no checkpoints", *lines])
    cells = [("step", "files", "bytes", "status")]
    cells += [(str(v.step), str(v.files), str(v.bytes), v.status) for v in check.verdicts]
    reasons = ["reason"] + [v.reason for v in check.verdicts]
    widths = [max(len(row[i]) for row in cells) for i in range(4)]
    rows = []
    for row, reason in zip(cells, reasons, strict=True):
        numbers = "  ".join(cell.rjust(w) for cell, w in zip(row[:3], widths, strict=False))
        rows.append(f"{numbers}  {row[3].ljust(widths[3])}  {reason}".rstrip())
    lines.append(f"latest: {check.latest_problem or check.latest}")
    if check.newest is not None:
        lines.append(f"newest that verifies: {check.newest}")
    return "\n".join([*rows, *lines])
