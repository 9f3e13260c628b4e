#!/usr/bin/env bash
# Installs everything hpcllm needs, idempotently: Open MPI from Debian when mpirun is missing,
# a .venv with pinned torch and the Python dependencies, and Horovod built from its sdist with
# the C++17 fix. The Horovod wheel is cached outside the clone so fresh clones reuse it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPCLLM_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
HOROVOD_VERSION=0.28.1
CACHE=${HPCLLM_CACHE:-$HOME/.cache/hpcllm}

say() { printf '[setup] %s\n' "$*"; }

# pip, quieter: the machine's pip.conf lists find-links folders that may not exist, and pip
# warns about each one for every package.
pip_q() { "$VPY" -m pip "$@" -q 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root to run: $*"; exit 1; fi
}

apt_install() {
  # apt-get update is slow; run it once per set-up, and only when something is missing.
  if [ -z "${APT_UPDATED:-}" ]; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    APT_UPDATED=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

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

# 2. The virtual environment. A stamp holding the hash of the requirements skips pip on a
#    ready machine, which keeps a second set-up to a few seconds.
REQS="$ROOT/scripts/requirements.txt"
STAMP="$VENV/.hpcllm-setup"
want=$( { cat "$REQS" "$ROOT/pyproject.toml" "$ROOT/setup.py"; echo "torch==$TORCH_VERSION horovod==$HOROVOD_VERSION"; } | sha256sum | cut -c1-16)
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  say "installing Python packages"
  pip_q install --upgrade pip setuptools wheel
  pip_q install "torch==$TORCH_VERSION"
  pip_q install -r "$REQS"
  pip_q install --no-deps -e "$ROOT" >/dev/null
fi

# 3. Horovod. 0.28.1 sets CMAKE_CXX_STANDARD 14 in two CMakeLists, which torch >= 2.1 headers
#    reject; building the sdist with 17 works. The wheel is tied to the torch and Python it was
#    built against, so those name the cache folder.
pyver=$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEELS="$CACHE/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-$pyver"
if ! "$VPY" -c 'import horovod.torch as h; assert h.mpi_built()' 2>/dev/null; then
  wheel=$(ls "$WHEELS"/horovod-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    say "building Horovod $HOROVOD_VERSION with MPI and PyTorch (about 3 minutes)"
    command -v cmake >/dev/null || apt_install cmake
    command -v g++ >/dev/null || apt_install g++
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    pip_q download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$build"
    tar -xzf "$build"/horovod-*.tar.gz -C "$build"
    src=$(ls -d "$build"/horovod-*/)
    grep -rl --include=CMakeLists.txt 'CMAKE_CXX_STANDARD 14' "$src" \
      | xargs sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/'
    mkdir -p "$WHEELS"
    (cd "$src" && HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
      HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$VPY" -m pip wheel -q --no-deps --no-build-isolation -w "$build/out" .)
    # Move into the cache only when complete, so an interrupted build leaves nothing behind.
    built=$(ls "$build"/out/horovod-*.whl)
    cp "$built" "$WHEELS/.partial.whl"
    mv "$WHEELS/.partial.whl" "$WHEELS/$(basename "$built")"
    wheel="$WHEELS/$(basename "$built")"
  fi
  say "installing $(basename "$wheel")"
  pip_q install --no-deps "$wheel"
  "$VPY" -c 'import horovod.torch as h; assert h.mpi_built(), "Horovod built without MPI"'
fi

echo "$want" > "$STAMP"
say "ready: $VENV"
