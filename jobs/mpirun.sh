#!/usr/bin/env bash
# Launch any hpcllm verb with Open MPI's mpirun, one rank per GPU.
#
#   NP=8 jobs/mpirun.sh topo --tp 2 --pp 2
#   NP=16 GPUS_PER_NODE=8 HOSTFILE=hosts jobs/mpirun.sh topo --tp 8 --pp 2
#
# NP ranks are placed GPUS_PER_NODE to a node (consecutive ranks share a node, so Megatron's
# order keeps each tensor-parallel group inside one node). Without a GPU, ranks may outnumber
# cores: the script oversubscribes and gives each rank one thread.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HPCLLM=${HPCLLM:-$ROOT/.venv/bin/hpcllm}
NP=${NP:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-$NP}

args=(-np "$NP" --map-by "ppr:${GPUS_PER_NODE}:node" --bind-to none -x PATH)
[ -n "${HOSTFILE:-}" ] && args+=(--hostfile "$HOSTFILE")
# Rendezvous and Horovod settings, when the user set them, reach every rank.
for var in LD_LIBRARY_PATH MASTER_ADDR MASTER_PORT HOROVOD_TIMELINE HOROVOD_FUSION_THRESHOLD \
           HOROVOD_CYCLE_TIME NCCL_DEBUG NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME; do
  [ -n "${!var:-}" ] && args+=(-x "$var")
done
if ! command -v nvidia-smi >/dev/null; then
  args+=(--oversubscribe)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
args+=(-x OMP_NUM_THREADS)
# Horovod's CPU collectives go through MPI under mpirun (its gloo path crashes there).
export HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-MPI}
args+=(-x HOROVOD_CPU_OPERATIONS)
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

exec mpirun "${args[@]}" "$HPCLLM" "$@"
