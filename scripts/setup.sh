#!/usr/bin/env bash
# Installs everything hpcllm needs, idempotently: Open MPI from Debian when mpirun is missing,
# a .venv with pinned torch and the Python dependencies, and Horovod built from its sdist with
# the C++17 fix. The Horovod wheel is cached outside the clone so fresh clones reuse it.
#
# On a machine whose `nvidia-smi` reports a driver, torch is the CUDA build the driver can run
# and Horovod is built with NCCL for the GPUs' compute capability (MPI stays its controller).
# Settings, all optional:
#   HPCLLM_DEVICE=auto|cpu|cuda   auto (default) takes CUDA where nvidia-smi reports a driver
#   HPCLLM_TORCH_CUDA=12.8        the torch CUDA build to install (default: the newest the
#                                 driver runs, from TORCH_CUDA_BUILDS below)
#   HPCLLM_TORCH_INDEX=URL        where torch CUDA builds are found (a mirror, say)
#   HOROVOD_BUILD_CUDA_CC_LIST    compute capabilities to build for (default: this node's GPUs)
#   HOROVOD_CUDA_HOME / CUDA_HOME a CUDA toolkit of torch's CUDA major version (default: nvcc
#                                 on the PATH when its major version matches, else NVIDIA's pip
#                                 packages of torch's exact CUDA version, in the cache)
#   HPCLLM_SETUP_DRY_RUN=1        print what would be installed and built, change nothing
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPCLLM_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
# The CUDA builds PyTorch publishes for TORCH_VERSION, newest first.
TORCH_CUDA_BUILDS="13.0 12.8 12.6"
HOROVOD_VERSION=0.28.1
CACHE=${HPCLLM_CACHE:-$HOME/.cache/hpcllm}
DRY=${HPCLLM_SETUP_DRY_RUN:-0}

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# Every command that changes the machine goes through `run`: the dry run prints it instead.
run() {
  if [ "$DRY" = 1 ]; then printf '[setup] would run:'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

# pip, quieter: the machine's pip.conf lists find-links folders that may not exist, and pip
# warns about each one for every package.
pip_q() {
  if [ "$DRY" = 1 ]; then run "$VPY" -m pip "$@"; return; fi
  "$VPY" -m pip "$@" -q 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

as_root() {
  if [ "$(id -u)" = 0 ]; then run "$@"; elif command -v sudo >/dev/null; then run sudo "$@"; else
    die "need root to run: $*"; fi
}

apt_install() {
  # apt-get update is slow; run it once per set-up, and only when something is missing.
  if [ -z "${APT_UPDATED:-}" ]; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    APT_UPDATED=1
  fi
  if [ "$DRY" = 1 ]; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
  else
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  fi
}

# True when version $1 <= version $2 (dotted numbers).
version_le() { [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1)" = "$1" ]; }

# 0. CPU or CUDA. TORCH_CUDA is empty for the CPU build, else the CUDA version of the torch
#    build ("12.8"); CC_LIST holds the compute capabilities Horovod's kernels are built for.
DEVICE=${HPCLLM_DEVICE:-auto}
case "$DEVICE" in auto | cpu | cuda) ;; *) die "HPCLLM_DEVICE must be auto, cpu or cuda, not '$DEVICE'" ;; esac
TORCH_CUDA=""
CC_LIST=""
if [ "$DEVICE" != cpu ]; then
  smi_out=""
  driver_cuda=""
  if command -v nvidia-smi >/dev/null; then
    if smi_out=$(nvidia-smi 2>&1); then
      driver_cuda=$(sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' <<<"$smi_out" | head -n 1)
    fi
  fi
  if [ -n "$driver_cuda" ]; then
    if [ -n "${HPCLLM_TORCH_CUDA:-}" ]; then
      TORCH_CUDA=$HPCLLM_TORCH_CUDA
      version_le "$TORCH_CUDA" "$driver_cuda" \
        || die "HPCLLM_TORCH_CUDA=$TORCH_CUDA is newer than the driver's CUDA $driver_cuda"
    else
      for build in $TORCH_CUDA_BUILDS; do
        if version_le "$build" "$driver_cuda"; then TORCH_CUDA=$build; break; fi
      done
      [ -n "$TORCH_CUDA" ] || die "the driver runs CUDA $driver_cuda; torch $TORCH_VERSION is built for CUDA ${TORCH_CUDA_BUILDS// /, }: update the driver, or set HPCLLM_DEVICE=cpu"
    fi
    CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | grep -E '^[0-9]+$' | sort -un | paste -sd, || true)}
    [ -n "$CC_LIST" ] || die "nvidia-smi does not report the GPUs' compute capability: set HOROVOD_BUILD_CUDA_CC_LIST (e.g. 90 for an H100, 80 for an A100)"
    gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c | sed 's/^ *//' | paste -sd, || true)
    say "CUDA: driver runs CUDA $driver_cuda (${gpus:-GPUs}); torch $TORCH_VERSION for CUDA $TORCH_CUDA, Horovod with NCCL for compute capability $CC_LIST"
  elif [ "$DEVICE" = cuda ]; then
    die "HPCLLM_DEVICE=cuda, but nvidia-smi $( [ -n "$smi_out" ] && echo "reports no driver: $(head -n 1 <<<"$smi_out")" || echo "is not on the PATH")"
  elif [ -n "$smi_out" ]; then
    say "nvidia-smi reports no driver ($(head -n 1 <<<"$smi_out")): setting up for the CPU"
  fi
fi
CUDA_TAG=""
[ -z "$TORCH_CUDA" ] || CUDA_TAG=cu${TORCH_CUDA//./}

# 1. Debian packages: Open MPI (mpi4py and Horovod compile against its headers), and Slurm with
#    munge, which the test suite starts as a one-node cluster to check `srun --mpi=pmix`.
missing=()
command -v mpirun >/dev/null && command -v mpicc >/dev/null || missing+=(openmpi-bin libopenmpi-dev)
if [ -z "${HPCLLM_NO_SLURM:-}" ]; then
  for tool in slurmctld slurmd srun; do
    PATH="$PATH:/usr/sbin" command -v "$tool" >/dev/null || { missing+=(slurm-wlm); break; }
  done
  PATH="$PATH:/usr/sbin" command -v munged >/dev/null || missing+=(munge)
fi
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing from Debian: ${missing[*]}"
  apt_install "${missing[@]}"
fi

# 2. The virtual environment. A stamp holding the hash of the requirements and of the device
#    choice skips pip on a ready machine, which keeps a second set-up to a few seconds.
REQS="$ROOT/scripts/requirements.txt"
STAMP="$VENV/.hpcllm-setup"
TORCH_PIN="torch==$TORCH_VERSION"
[ -z "$CUDA_TAG" ] || TORCH_PIN="torch==$TORCH_VERSION+$CUDA_TAG"
want=$( { cat "$REQS" "$ROOT/pyproject.toml" "$ROOT/setup.py"; echo "$TORCH_PIN horovod==$HOROVOD_VERSION cc=$CC_LIST"; } | sha256sum | cut -c1-16)
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  run "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# What asks the venv's Python a question; the machine's in a dry run that has no venv yet.
ASK=$VPY
[ -x "$VPY" ] || ASK=$PY
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  say "installing Python packages"
  pip_q install --upgrade pip setuptools wheel
  # torch of the other kind (CPU vs CUDA) satisfies the same version pin: remove it first.
  have_cuda=$("$ASK" -c 'import torch; print(torch.version.cuda or "")' 2>/dev/null || echo none)
  if [ "$have_cuda" != none ] && [ "$have_cuda" != "$TORCH_CUDA" ]; then
    pip_q uninstall -y torch
  fi
  if [ -n "$CUDA_TAG" ]; then
    pip_q install "$TORCH_PIN" --index-url "${HPCLLM_TORCH_INDEX:-https://download.pytorch.org/whl}/$CUDA_TAG" \
      --extra-index-url https://pypi.org/simple
  else
    pip_q install "$TORCH_PIN"
  fi
  pip_q install -r "$REQS"
  if [ "$DRY" = 1 ]; then pip_q install --no-deps -e "$ROOT"; else pip_q install --no-deps -e "$ROOT" >/dev/null; fi
  if [ -n "$CUDA_TAG" ] && [ "$DRY" != 1 ]; then
    "$VPY" -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"; print("[setup] torch", torch.__version__, "sees", torch.cuda.device_count(), "GPU(s)")'
  fi
fi

# 3. Horovod. 0.28.1 sets CMAKE_CXX_STANDARD 14 in two CMakeLists, which torch >= 2.1 headers
#    reject; building the sdist with 17 works. The wheel is tied to the torch (and its CUDA),
#    the GPUs' compute capability and the Python it was built against, so those name the cache
#    folder; the CPU and CUDA wheels lie side by side.
pyver=$("$ASK" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if [ -n "$CUDA_TAG" ]; then
  WHEELS="$CACHE/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-$CUDA_TAG-nccl-sm${CC_LIST//,/-sm}-$pyver"
  CHECK='import horovod.torch as h; assert h.mpi_built(), "Horovod built without MPI"; assert h.nccl_built(), "Horovod built without NCCL"'
else
  WHEELS="$CACHE/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-$pyver"
  CHECK='import horovod.torch as h; assert h.mpi_built(), "Horovod built without MPI"'
fi

# The NCCL that torch ships (nvidia-nccl-cu1x in the venv), as the include/lib pair Horovod's
# CMake looks for: a lib folder with libnccl.so pointing at the package's libnccl.so.2.
nccl_for_build() {
  local out=$1 found
  found=$("$ASK" - <<'PY' 2>/dev/null || true
import pathlib, site
for root in site.getsitepackages():
    base = pathlib.Path(root, "nvidia")
    headers = sorted(base.glob("**/include/nccl.h"))
    libs = sorted(base.glob("**/lib/libnccl.so*"))
    if headers and libs:
        print(headers[0].parent, libs[0], sep="\n")
        break
PY
)
  if [ -z "$found" ]; then
    [ "$DRY" = 1 ] || die "no NCCL in $VENV: the CUDA build of torch brings nvidia-nccl; is torch $TORCH_PIN installed?"
    NCCL_INCLUDE="<nvidia-nccl of torch $TORCH_PIN>/include"
    NCCL_LIB="$out/lib"
    run mkdir -p "$NCCL_LIB"
    run ln -s "<nvidia-nccl of torch $TORCH_PIN>/lib/libnccl.so.2" "$NCCL_LIB/libnccl.so"
    return
  fi
  NCCL_INCLUDE=$(sed -n 1p <<<"$found")
  NCCL_LIB="$out/lib"
  run mkdir -p "$NCCL_LIB"
  run ln -sf "$(sed -n 2p <<<"$found")" "$NCCL_LIB/libnccl.so"
}

# A CUDA toolkit of torch's CUDA major version, for nvcc and the runtime headers: the one asked
# for, else nvcc on the PATH when it matches, else NVIDIA's pip packages of torch's CUDA
# version installed into the cache (their nvcc folder completed with the runtime's headers and
# libcudart, so it reads as one CUDA home).
cuda_home_for_build() {
  local major=${TORCH_CUDA%%.*} nvcc home release target suffix
  for home in "${HOROVOD_CUDA_HOME:-}" "${CUDA_HOME:-}"; do
    if [ -n "$home" ]; then CUDA_HOME_BUILD=$home; return; fi
  done
  nvcc=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; } || true)
  if [ -n "$nvcc" ]; then
    release=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1)
    home=$(cd "$(dirname "$(readlink -f "$nvcc")")/.." && pwd)
    if [ "${release%%.*}" = "$major" ] && [ -f "$home/include/cuda_runtime.h" ]; then
      say "CUDA toolkit: $home (nvcc $release)"
      CUDA_HOME_BUILD=$home
      return
    fi
    say "nvcc on the PATH is CUDA ${release:-unknown} at $home; torch is built for CUDA $TORCH_CUDA: using NVIDIA's pip packages instead"
  fi
  target="$CACHE/cuda-$TORCH_CUDA-pip"
  if [ "$major" -ge 13 ]; then suffix=""; else suffix="-cu$major"; fi
  if [ ! -f "$target/.complete" ]; then
    run rm -rf "$target.partial"
    pip_q install --target "$target.partial" --no-deps "nvidia-cuda-nvcc$suffix==$TORCH_CUDA.*" \
      "nvidia-cuda-runtime$suffix==$TORCH_CUDA.*" "nvidia-cuda-cccl$suffix==$TORCH_CUDA.*"
    run "$VPY" - "$target.partial" <<'PY'
import os, pathlib, sys
root = pathlib.Path(sys.argv[1])
nvcc = next(root.glob("nvidia/**/bin/nvcc"))
home = nvcc.parent.parent
for header in root.glob("nvidia/**/include/*"):
    link = home / "include" / header.name
    if header.parent != home / "include" and not link.exists():
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(header)
lib64 = home / "lib64"
lib64.mkdir(exist_ok=True)
for lib in root.glob("nvidia/**/lib/libcudart.so*"):
    if not (lib64 / lib.name).exists():
        (lib64 / lib.name).symlink_to(lib)
if not (lib64 / "libcudart.so").exists():
    (lib64 / "libcudart.so").symlink_to(next(lib64.glob("libcudart.so.*")))
(root / "cuda-home").symlink_to(home.relative_to(root))
PY
    run touch "$target.partial/.complete"
    run mv "$target.partial" "$target"
  fi
  CUDA_HOME_BUILD="$target/cuda-home"
}

if ! "$ASK" -c "$CHECK" 2>/dev/null; then
  wheel=$(ls "$WHEELS"/horovod-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    say "building Horovod $HOROVOD_VERSION with MPI${CUDA_TAG:+ and NCCL} and PyTorch (about 3 minutes)"
    command -v cmake >/dev/null || apt_install cmake
    command -v g++ >/dev/null || apt_install g++
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    gpu_env=()
    if [ -n "$CUDA_TAG" ]; then
      nccl_for_build "$build/nccl"
      cuda_home_for_build
      gpu_env=(HOROVOD_GPU=CUDA HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CPU_OPERATIONS=MPI
        HOROVOD_NCCL_INCLUDE="$NCCL_INCLUDE" HOROVOD_NCCL_LIB="$NCCL_LIB" HOROVOD_NCCL_LINK=SHARED
        HOROVOD_CUDA_HOME="$CUDA_HOME_BUILD" HOROVOD_BUILD_CUDA_CC_LIST="$CC_LIST")
    fi
    pip_q download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
    if [ "$DRY" = 1 ]; then
      src="$build/horovod-$HOROVOD_VERSION"
      run tar -xzf "$build/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
      run sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$src/<each CMakeLists.txt that sets 14>"
    else
      tar -xzf "$build"/horovod-*.tar.gz -C "$build"
      src=$(ls -d "$build"/horovod-*/)
      grep -rl --include=CMakeLists.txt 'CMAKE_CXX_STANDARD 14' "$src" \
        | xargs sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/'
    fi
    run mkdir -p "$WHEELS"
    (run cd "$src" && run env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
      HOROVOD_WITHOUT_MXNET=1 ${gpu_env[@]+"${gpu_env[@]}"} MAKEFLAGS="-j$(nproc)" \
      "$VPY" -m pip wheel -q --no-deps --no-build-isolation -w "$build/out" .)
    # Move into the cache only when complete, so an interrupted build leaves nothing behind.
    if [ "$DRY" = 1 ]; then
      wheel="$WHEELS/horovod-$HOROVOD_VERSION-$pyver-linux.whl"
      run mv "$build/out/horovod-$HOROVOD_VERSION-$pyver-linux.whl" "$wheel"
    else
      built=$(ls "$build"/out/horovod-*.whl)
      cp "$built" "$WHEELS/.partial.whl"
      mv "$WHEELS/.partial.whl" "$WHEELS/$(basename "$built")"
      wheel="$WHEELS/$(basename "$built")"
    fi
  fi
  say "installing $(basename "$wheel")"
  pip_q install --no-deps --force-reinstall "$wheel"
  run "$VPY" -c "$CHECK"
fi

if [ "$DRY" = 1 ]; then
  say "dry run: nothing was changed"
  exit 0
fi
echo "$want" > "$STAMP"
say "ready: $VENV${CUDA_TAG:+ (torch $TORCH_PIN, Horovod with NCCL)}"
