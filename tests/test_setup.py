"""`make setup` on a CUDA machine, checked without one: a fake `nvidia-smi` (and `nvcc`) on
the PATH and the set-up's dry run, which prints every command it would run and runs none."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"

SMI_FAILS = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _fake_smi(bin_dir: Path, cuda: str | None, caps: tuple[str, ...] = ("9.0",)) -> None:
    """An nvidia-smi reporting a driver for CUDA `cuda` and GPUs of compute capability `caps`
    (None: one that fails as it does where the driver is missing)."""
    if cuda is None:
        _script(bin_dir / "nvidia-smi", f'echo "{SMI_FAILS}"\nexit 9\n')
        return
    cap_lines = "\\n".join(caps)
    _script(
        bin_dir / "nvidia-smi",
        f"""case "$*" in
  *compute_cap*) printf '{cap_lines}\\n';;
  *name*) for c in {" ".join(caps)}; do echo "NVIDIA GPU sm$c"; done;;
  *) echo "| NVIDIA-SMI 580.00   Driver Version: 580.00   CUDA Version: {cuda}     |";;
esac
""",
    )


def _fake_nvcc(bin_dir: Path, home: Path, release: str) -> None:
    """A CUDA toolkit at `home` whose nvcc says `release`, first on the PATH."""
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    _script(
        home / "bin" / "nvcc", f'echo "Cuda compilation tools, release {release}, V{release}.1"\n'
    )
    (bin_dir / "nvcc").symlink_to(home / "bin" / "nvcc")


def _dry_run(tmp_path: Path, bin_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # The machine's Python, not a venv the caller activated (its Horovod would skip the build).
    active = os.environ.get("VIRTUAL_ENV")
    path = [p for p in os.environ["PATH"].split(os.pathsep) if not active or p != f"{active}/bin"]
    full = {
        **{k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
        "PATH": os.pathsep.join([str(bin_dir), *path]),
        "HPCLLM_SETUP_DRY_RUN": "1",
        "HPCLLM_VENV": str(tmp_path / "venv"),
        "HPCLLM_CACHE": str(tmp_path / "cache"),
        **env,
    }
    for name in ("HPCLLM_DEVICE", "HPCLLM_TORCH_CUDA", "HOROVOD_BUILD_CUDA_CC_LIST", "CUDA_HOME"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run(
        ["bash", str(SETUP)], env=full, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    path = tmp_path / "bin"
    path.mkdir()
    return path


def _would_run(out: str) -> list[str]:
    """The commands a dry run printed, unquoted as the shell would read them."""
    prefix = "[setup] would run:"
    return [
        " ".join(shlex.split(line[len(prefix) :]))
        for line in out.splitlines()
        if line.startswith(prefix)
    ]


@pytest.mark.slow
def test_cuda_machine_installs_cuda_torch_and_builds_horovod_with_nccl(tmp_path, bin_dir):
    _fake_smi(bin_dir, "12.8", caps=("9.0", "9.0"))
    _fake_nvcc(bin_dir, tmp_path / "cuda-13", "13.0")  # another major version than torch's
    result = _dry_run(tmp_path, bin_dir)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    commands = "\n".join(_would_run(out))
    assert "torch 2.13.0 for CUDA 12.8" in out and "compute capability 90" in out
    venv_py = str(tmp_path / "venv" / "bin" / "python")
    assert (
        f"{venv_py} -m pip install torch==2.13.0+cu128 --index-url "
        "https://download.pytorch.org/whl/cu128" in commands
    )
    # nvcc 13 cannot build for torch's CUDA 12.8: NVIDIA's pip packages of 12.8 are used.
    assert "nvcc on the PATH is CUDA 13.0" in out
    assert "nvidia-cuda-nvcc-cu12==12.8.*" in commands
    build = next(line for line in _would_run(out) if " pip wheel " in line)
    for setting in (
        "HOROVOD_WITH_MPI=1",
        "HOROVOD_GPU=CUDA",
        "HOROVOD_GPU_OPERATIONS=NCCL",
        "HOROVOD_CPU_OPERATIONS=MPI",
        "HOROVOD_NCCL_LINK=SHARED",
        "HOROVOD_BUILD_CUDA_CC_LIST=90 ",
        f"HOROVOD_CUDA_HOME={tmp_path}/cache/cuda-12.8-pip/cuda-home",
    ):
        assert setting in build, setting
    wheels = f"{tmp_path}/cache/horovod-0.28.1-torch-2.13.0-cu128-nccl-sm90-"
    assert f"--force-reinstall {wheels}" in commands
    assert "h.nccl_built()" in commands and "h.mpi_built()" in commands
    assert "nothing was changed" in out
    # A dry run changes nothing.
    assert not (tmp_path / "venv").exists() and not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_matching_nvcc_and_newest_torch_build_the_driver_runs(tmp_path, bin_dir):
    _fake_smi(bin_dir, "13.1", caps=("8.0", "9.0", "8.0"))
    _fake_nvcc(bin_dir, tmp_path / "cuda", "13.0")
    result = _dry_run(tmp_path, bin_dir)
    assert result.returncode == 0, result.stderr
    commands = "\n".join(_would_run(result.stdout))
    assert "torch==2.13.0+cu130 --index-url https://download.pytorch.org/whl/cu130" in commands
    assert f"HOROVOD_CUDA_HOME={tmp_path}/cuda " in commands
    assert "nvidia-cuda-nvcc" not in commands
    assert "HOROVOD_BUILD_CUDA_CC_LIST=80,90 " in commands
    assert "-cu130-nccl-sm80-sm90-" in commands


@pytest.mark.slow
def test_settings_choose_the_torch_build_and_capabilities(tmp_path, bin_dir):
    _fake_smi(bin_dir, "13.1")
    result = _dry_run(
        tmp_path,
        bin_dir,
        HPCLLM_TORCH_CUDA="12.6",
        HOROVOD_BUILD_CUDA_CC_LIST="80,90",
        CUDA_HOME=str(tmp_path / "toolkit"),
        HPCLLM_TORCH_INDEX="https://mirror.example/torch",
    )
    assert result.returncode == 0, result.stderr
    commands = "\n".join(_would_run(result.stdout))
    assert "torch==2.13.0+cu126 --index-url https://mirror.example/torch/cu126" in commands
    assert f"HOROVOD_CUDA_HOME={tmp_path}/toolkit " in commands
    assert "HOROVOD_BUILD_CUDA_CC_LIST=80,90 " in commands


@pytest.mark.slow
@pytest.mark.parametrize("smi", ["fails", "absent", "forced-cpu"])
def test_cpu_set_up_where_there_is_no_driver(tmp_path, bin_dir, smi):
    env = {}
    if smi == "fails":
        _fake_smi(bin_dir, None)
    elif smi == "forced-cpu":
        _fake_smi(bin_dir, "12.8")
        env["HPCLLM_DEVICE"] = "cpu"
    result = _dry_run(tmp_path, bin_dir, **env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    commands = "\n".join(_would_run(out))
    assert " -m pip install torch==2.13.0\n" in commands + "\n"
    assert "download.pytorch.org" not in commands
    assert "NCCL" not in commands and "nvcc" not in commands
    assert f"{tmp_path}/cache/horovod-0.28.1-torch-2.13.0-cp" in commands
    assert ("reports no driver" in out) == (smi == "fails")


@pytest.mark.parametrize(
    ("cuda", "env", "message"),
    [
        ("11.8", {}, "the driver runs CUDA 11.8; torch 2.13.0 is built for CUDA 13.0, 12.8, 12.6"),
        ("12.6", {"HPCLLM_TORCH_CUDA": "12.8"}, "HPCLLM_TORCH_CUDA=12.8 is newer than"),
        (None, {"HPCLLM_DEVICE": "cuda"}, "HPCLLM_DEVICE=cuda, but nvidia-smi reports no driver"),
        ("12.8", {"HPCLLM_DEVICE": "gpu"}, "HPCLLM_DEVICE must be auto, cpu or cuda, not 'gpu'"),
    ],
)
def test_a_set_up_that_cannot_work_stops_with_one_line(tmp_path, bin_dir, cuda, env, message):
    _fake_smi(bin_dir, cuda)
    result = _dry_run(tmp_path, bin_dir, **env)
    assert result.returncode == 1
    assert message in result.stderr
    assert "would run" not in result.stdout


def test_gpus_without_a_reported_compute_capability_ask_for_the_list(tmp_path, bin_dir):
    _script(
        bin_dir / "nvidia-smi",
        'case "$*" in *--query*) echo "Field \\"compute_cap\\" is not a valid field"; exit 2;; '
        '*) echo "CUDA Version: 12.8";; esac\n',
    )
    result = _dry_run(tmp_path, bin_dir)
    assert result.returncode == 1
    assert "set HOROVOD_BUILD_CUDA_CC_LIST" in result.stderr
