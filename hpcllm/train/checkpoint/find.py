"""Finding a run's checkpoints and verifying each against its manifest; choosing the one to
resume from (never by trusting ``latest``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcllm.errors import UserError
from hpcllm.train.checkpoint.format import (
    LATEST,
    MANIFEST,
    STEP_FOLDER,
    Warn,
    checked_meta,
    file_problem,
    gather,
    layout_of,
    read_json,
    read_manifest,
)


def step_of(folder: Path) -> int:
    """Return the step a checkpoint folder's name gives (``step_00000200`` -> 200)."""
    match = STEP_FOLDER.fullmatch(Path(folder).name)
    if not match:
        raise ValueError(f"{folder} is not a checkpoint folder")
    return int(match.group(1))


def checkpoints(run_dir: Path) -> list[Path]:
    """Return the run's checkpoint folders, newest step first (partial folders left out)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := STEP_FOLDER.fullmatch(path.name)) and path.is_dir()
    ]
    return [path for _, path in sorted(found, reverse=True)]


@dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found in one checkpoint folder.

    ``status`` is "ok", "bad", or "unverified" (format 1: no manifest to check against).
    """

    folder: Path
    step: int
    files: int
    bytes: int
    status: str
    reason: str = ""


def verify(folder: Path) -> Verdict:
    """Return whether every file of a checkpoint folder matches its manifest, and if not why."""
    folder = Path(folder)
    match = STEP_FOLDER.fullmatch(folder.name)
    step = int(match.group(1)) if match else -1

    def bad(reason: str, files: int = 0, size: int = 0) -> Verdict:
        return Verdict(folder, step, files, size, "bad", reason)

    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as err:
        return bad(str(err))
    if manifest is None:
        on_disk = [p for p in folder.iterdir() if p.is_file()]
        size = sum(p.stat().st_size for p in on_disk)
        try:
            meta = read_json(folder / "meta.json")
        except (OSError, ValueError) as err:
            return bad(f"{MANIFEST} is missing and meta.json is unreadable ({err})", len(on_disk))
        if isinstance(meta, dict) and "format_version" not in meta:
            return Verdict(
                folder,
                step,
                len(on_disk),
                size,
                "unverified",
                "format 1 (before manifests): files not checked",
            )
        return bad(f"{MANIFEST} is missing", len(on_disk), size)
    files = manifest["files"]
    size = sum(e.get("bytes", 0) for e in files.values() if isinstance(e, dict))
    problems = [p for name, e in files.items() if (p := file_problem(folder / name, e))]
    if not problems:
        try:
            meta = checked_meta(folder / "meta.json", read_json(folder / "meta.json"))
        except (OSError, ValueError, UserError) as err:
            return bad(str(err), len(files), size)
        expected = {"meta.json", "config.yaml"} | layout_of(manifest, meta).names()
        problems = [f"{name} is not in {MANIFEST}" for name in sorted(expected - set(files))]
        if meta["step"] != step or manifest.get("step") != step:
            problems.append(f"meta.json says step {meta['step']}, the folder step {step}")
    if problems:
        return bad("; ".join(problems), len(files), size)
    return Verdict(folder, step, len(files), size, "ok")


def _latest_name(root: Path) -> str | None:
    """Return the name `latest` holds, None if there is no `latest`; ValueError if garbage."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode().strip()
    except UnicodeDecodeError:
        name = ""
    if not STEP_FOLDER.fullmatch(name):
        raise ValueError(f"{pointer} holds no checkpoint name")
    return name


def refuse_unverified(folder: Path, opt_in: str) -> UserError:
    """Return the refusal of a checkpoint without a manifest, naming how to load it anyway."""
    return UserError(
        f"checkpoint {folder} has no manifest.json, so hpcllm cannot check it: it was saved "
        "before manifests (format 1) or its manifest was lost with whatever else; to load it "
        f"unchecked, {opt_in}"
    )


def resumable(
    run_dir: Path,
    warn: Warn,
    allow_unverified: bool = False,
    opt_in: str = "set run.allow_unverified=true",
    acting: str = "resuming from",
) -> Path | None:
    """Return the newest checkpoint folder that verifies, None if the run has no checkpoint.

    ``acting`` says what the caller does with it in the warnings ("resuming from"; "reading"
    for the commands that only read a run).

    The newest checkpoint without a manifest is refused (:func:`refuse_unverified`, naming
    ``opt_in``) unless ``allow_unverified``; then it is taken, with a warning.

    Every checkpoint passed over is reported through ``warn`` with the file and the reason.
    Reads every file of the checkpoints it checks; run it on one rank and share the answer
    (:func:`agreed_resumable`). Raises :class:`UserError` if there are checkpoints and none
    verifies: starting again from step 0 would throw the run away without a word.
    """
    folders = checkpoints(run_dir)
    root = Path(run_dir) / "checkpoints"
    verdicts = []
    for folder in folders:
        verdict = verify(folder)
        verdicts.append(verdict)
        if verdict.status == "bad":
            warn(f"checkpoint {folder} is damaged, skipping it: {verdict.reason}")
            continue
        if verdict.status == "unverified":
            if not allow_unverified:
                raise refuse_unverified(folder, opt_in)
            warn(f"checkpoint {folder} has no manifest; {acting} it unchecked, as asked")
        try:
            pointed = _latest_name(root)
        except ValueError as err:
            warn(f"{err}; {acting} the newest checkpoint that verifies, {folder.name}")
        else:
            if pointed not in (None, folder.name):
                warn(f"{root / LATEST} names {pointed}; {acting} {folder.name}")
        return folder
    if folders:
        raise UserError(
            f"none of the {len(folders)} checkpoints in {root} verifies (newest, "
            f"{folders[0].name}: {verdicts[0].reason}); hpcllm inspect --verify {run_dir} "
            "lists them, run.resume=none starts over"
        )
    return None


def agreed_resumable(
    run_dir: Path, grid: Any, warn: Warn, allow_unverified: bool = False
) -> Path | None:
    """Return :func:`resumable`'s answer on rank 0 to every rank (a collective).

    Rank 0 alone reads and warns; a :class:`UserError` there is raised on every rank.
    """
    answer = None
    if grid.rank == 0:
        try:
            answer = (resumable(run_dir, warn, allow_unverified), None)
        except UserError as err:
            answer = (None, str(err))
    folder, error = gather(grid, answer)[0]
    if error is not None:
        raise UserError(error)
    return folder


def latest(run_dir: Path) -> Path | None:
    """Return the checkpoint folder `latest` names, or None if the run has none."""
    root = Path(run_dir) / "checkpoints"
    try:
        name = _latest_name(root)
    except ValueError as err:
        raise UserError(f"{err}; hpcllm inspect --verify {run_dir} lists the checkpoints") from None
    if name is None:
        return None
    folder = root / name
    if not (folder / "meta.json").is_file():
        raise UserError(f"{root / LATEST} names {folder.name}, which is missing or incomplete")
    return folder
