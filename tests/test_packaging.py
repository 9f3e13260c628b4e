"""The wheel holds the whole library: build it from a clean copy of the repository, install it
into a fresh venv that cannot see the editable install, then import every module, run
`hpcllm --help` and train two steps from the installed copy, outside the repository.

`pip install -e .` hides packaging mistakes (the editable finder serves any module under the
source folders); only a built wheel shows a package missing from the package list.
"""

import json
import math
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Import name of each package root -> its folder in the repository (as setup.py maps them).
ROOTS = {"hpcllm": "hpcllm", "hpcllm.kernels": "kernels", "hpcllm.datasets": "datasets"}

# Modules the import walk must find: one per package that a hand-written list once left out.
MUST_IMPORT = [
    "hpcllm.model.gpt",
    "hpcllm.parallel.data.engine",
    "hpcllm.train.trainer",
    "hpcllm.parallel.pipeline.schedule",
    "hpcllm.kernels",
    "hpcllm.datasets.reader",
]

_CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    and not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_"))
}


def _run(cmd, cwd, env=None, timeout=300):
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env or _CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _check(run):
    assert run.returncode == 0, f"{run.args}\nstdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    return run


def _clean_copy(dest: Path) -> None:
    """The files git tracks plus untracked ones it does not ignore: no build/, no egg-info.

    Outside a git checkout (an unpacked source archive), the tree less what .gitignore names.
    """
    if shutil.which("git") is None or not (REPO / ".git").exists():
        ignored = [line.strip().rstrip("/") for line in (REPO / ".gitignore").read_text().split()]
        shutil.copytree(
            REPO, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", *ignored)
        )
        return
    listed = _check(
        _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], REPO)
    ).stdout
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if not src.is_file():  # deleted in the working tree but still in the index
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _corpus(folder: Path) -> None:
    """About 300 KB of deterministic text in 12 documents, so prepare gives a validation split."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(500)]
    folder.mkdir()
    for i in range(12):
        lines = (" ".join(rng.choices(words, k=12)) for _ in range(350))
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")


class Installed:
    """A fresh venv with the wheel installed; `work` is an empty folder outside the repository."""

    def __init__(self, root: Path, wheel: Path, venv: Path, work: Path) -> None:
        self.root, self.wheel, self.venv, self.work = root, wheel, venv, work
        self.python = venv / "bin" / "python"
        self.hpcllm = venv / "bin" / "hpcllm"
        self.env = {**_CLEAN_ENV, "PATH": f"{venv / 'bin'}{os.pathsep}{_CLEAN_ENV.get('PATH', '')}"}

    def python_json(self, code: str) -> dict:
        run = _check(_run([self.python, "-c", code], self.work, self.env))
        return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("packaging")
    src, dist, venv, work = root / "src", root / "dist", root / "venv", root / "work"
    work.mkdir()
    _clean_copy(src)

    _check(
        _run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
            + ["--no-cache-dir", "-q", "-w", dist, src],
            root,
        )
    )
    (wheel,) = dist.glob("hpcllm-*.whl")

    # A venv without pip of its own: the project's site-packages (torch, pip, setuptools...)
    # through a .pth holding its path. A plain path line adds the folder but does not process
    # the .pth files inside it, so the project's editable finder for hpcllm is not installed.
    _check(_run([sys.executable, "-m", "venv", "--without-pip", venv], root))
    installed = Installed(root, wheel, venv, work)
    site = installed.python_json("import json, sysconfig; print(json.dumps(sysconfig.get_paths()))")
    project_sites = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    Path(site["purelib"], "_hpcllm_project_site.pth").write_text("\n".join(project_sites) + "\n")

    seen = installed.python_json(
        "import importlib.util as u, json; "
        "print(json.dumps({m: u.find_spec(m) is not None for m in ('hpcllm', 'torch', 'pip')}))"
    )
    assert seen == {"hpcllm": False, "torch": True, "pip": True}, (
        f"before installing the wheel the new venv must see the project's packages but not its "
        f"editable hpcllm: {seen}"
    )
    # --ignore-installed: never touch (uninstall) anything outside the new venv.
    _check(
        _run(
            [installed.python, "-m", "pip", "install", "--no-deps", "--ignore-installed"]
            + ["--no-cache-dir", "-q", wheel],
            work,
            installed.env,
        )
    )
    return installed


@pytest.mark.slow
def test_wheel_holds_every_module_of_the_tree(installed):
    with zipfile.ZipFile(installed.wheel) as whl:
        in_wheel = {n for n in whl.namelist() if n.endswith(".py")}
    src = installed.root / "src"
    expected = set()
    for name, folder in ROOTS.items():
        for path in (src / folder).rglob("*.py"):
            rel = path.relative_to(src / folder)
            # only modules inside packages (every folder on the way has an __init__.py)
            if all((src / folder / p / "__init__.py").exists() for p in rel.parents):
                expected.add("/".join([*name.split("."), *rel.parts]))
    missing = sorted(expected - in_wheel)
    assert not missing, f"modules of the source tree missing from {installed.wheel.name}: {missing}"
    assert not [n for n in in_wheel if n.split("/")[0] in ("kernels", "datasets")], (
        "kernels/ and datasets/ must install as hpcllm.kernels and hpcllm.datasets only"
    )


@pytest.mark.slow
def test_every_installed_module_imports_from_the_venv(installed):
    report = installed.python_json(
        """
import importlib, json, os, pkgutil, sys, traceback
import hpcllm
names = ["hpcllm"]
def failed_walk(name):
    names.append(name)
for info in pkgutil.walk_packages(hpcllm.__path__, "hpcllm.", onerror=failed_walk):
    names.append(info.name)
errors = {}
for name in sorted(set(names)):
    try:
        importlib.import_module(name)
    except BaseException:
        errors[name] = traceback.format_exc(limit=-3)
files = {n: os.path.realpath(m.__file__) for n, m in sys.modules.items()
         if (n == "hpcllm" or n.startswith("hpcllm.")) and getattr(m, "__file__", None)}
print(json.dumps({"names": sorted(set(names)), "errors": errors, "files": files}))
"""
    )
    venv = str(installed.venv.resolve())
    assert not report["errors"], (
        "modules of the installed wheel that fail to import:\n"
        + "\n".join(f"--- {name}\n{tb}" for name, tb in report["errors"].items())
    )
    assert report["files"]["hpcllm"].startswith(venv), report["files"]["hpcllm"]
    outside = {n: f for n, f in report["files"].items() if not f.startswith(venv)}
    assert not outside, f"hpcllm modules imported from outside the new venv: {outside}"
    missing = [m for m in MUST_IMPORT if m not in report["names"]]
    assert not missing, f"not in the installed package: {missing}; found {report['names']}"


def test_installed_command_help(installed):
    run = _check(_run([installed.hpcllm, "--help"], installed.work, installed.env))
    for verb in ("prepare", "train", "topo", "bench"):
        assert verb in run.stdout


@pytest.mark.slow
def test_installed_command_prepares_and_trains_two_steps(installed):
    work = installed.work
    _corpus(work / "corpus")
    _check(
        _run(
            [installed.hpcllm, "prepare", "--input", work / "corpus", "--tokenizer", "byte"]
            + ["--val-fraction", "0.1", "--out", work / "data", "--quiet"],
            work,
            installed.env,
        )
    )
    overrides = {
        "data.path": work / "data",
        "run.dir": work / "run",
        "run.resume": "none",
        "run.tensorboard": "false",
        "train.steps": 2,
        "train.global_batch_size": 8,
        "train.eval_interval": 0,
        "train.save_interval": 0,
        "train.log_interval": 1,
    }
    sets = [arg for k, v in overrides.items() for arg in ("--set", f"{k}={v}")]
    config = installed.root / "src" / "jobs" / "configs" / "tiny-cpu.yaml"
    _check(
        _run(
            [installed.hpcllm, "train", "--config", config, *sets, "--no-progress"],
            work,
            {**installed.env, "OMP_NUM_THREADS": "1"},
        )
    )
    lines = (work / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records), records


def test_git_ignores_no_source_of_the_packages():
    # A .gitignore pattern meant for the prepared data ("data/") once matched
    # hpcllm/parallel/data/ too: the package worked here and was missing from every clone.
    # Every folder of the three package trees, checked for a new source file in it.
    folders = [
        folder
        for top in ("hpcllm", "kernels", "datasets")
        for folder in [REPO / top, *(REPO / top).rglob("*")]
        if folder.is_dir() and folder.name != "__pycache__"
    ]
    probes = [str((folder / "new_module.py").relative_to(REPO)) for folder in folders]
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        input="\n".join(probes),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: nothing ignored
    assert done.stdout == "", f"git would ignore sources in:\n{done.stdout}"
