#!/usr/bin/env bash
# Profile any hpcllm launch with Nsight Systems: one report per rank, named by its rank.
#
#   HPCLLM=jobs/nsys.sh NP=8 jobs/mpirun.sh train --config F          # steps 5-7 by default
#   HPCLLM=jobs/nsys.sh PROFILE_STEPS=20:22 NP=8 jobs/mpirun.sh train --config F
#   HPCLLM=$PWD/jobs/nsys.sh sbatch jobs/slurm.sbatch train --config F
#
# It runs as each rank's program: `nsys profile ... hpcllm ARGS`, writing
# $NSYS_DIR/hpcllm-rank<R>.nsys-rep (NSYS_DIR: nsys-reports). For `train` the capture is the
# steps of train.profile_steps (--profile-steps A:B), which the trainer brackets with
# cudaProfilerStart/Stop; PROFILE_STEPS (default 5:8, after the first steps' warm-up) is
# passed as --profile-steps unless the arguments already give profile steps. Traced: CUDA,
# NVTX (hpcllm's ranges), and MPI under Open MPI or MPICH, else OS runtime calls; NSYS_TRACE
# replaces the list and NSYS_ARGS adds options.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HPCLLM_BIN=${HPCLLM_BIN:-$ROOT/.venv/bin/hpcllm}
NSYS_DIR=${NSYS_DIR:-nsys-reports}
rank=${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${SLURM_PROCID:-${PMI_RANK:-0}}}}

if [ -n "${OMPI_COMM_WORLD_RANK:-}" ]; then
  trace=cuda,nvtx,mpi mpi=(--mpi-impl=openmpi)
elif [ -n "${PMI_RANK:-}" ]; then
  trace=cuda,nvtx,mpi mpi=(--mpi-impl=mpich)
else
  trace=cuda,nvtx,osrt mpi=()
fi
trace=${NSYS_TRACE:-$trace}

args=("$@")
capture=()
if [ "${1:-}" = train ]; then
  given=""
  for word in "$@"; do
    case "$word" in --profile-steps | --profile-steps=* | train.profile_steps=*) given=1 ;; esac
  done
  [ -z "$given" ] && args+=(--profile-steps "${PROFILE_STEPS:-5:8}")
  capture=(--capture-range=cudaProfilerApi --capture-range-end=stop)
fi

mkdir -p "$NSYS_DIR"
# shellcheck disable=SC2086 # NSYS_ARGS is a list of options
exec nsys profile "--trace=$trace" "${mpi[@]}" "${capture[@]}" --force-overwrite=true \
  "--output=$NSYS_DIR/hpcllm-rank$rank" ${NSYS_ARGS:-} "$HPCLLM_BIN" "${args[@]}"
