#!/usr/bin/env bash
# Launch any hpcllm verb with Open MPI's mpirun, one rank per GPU.
#
#   NP=8 jobs/mpirun.sh topo --tp 2 --pp 2
#   NP=16 GPUS_PER_NODE=8 HOSTFILE=hosts jobs/mpirun.sh topo --tp 8 --pp 2
#   DRY_RUN=1 NP=16 GPUS_PER_NODE=8 HOSTFILE=hosts jobs/mpirun.sh train --set parallel.tp=8
#
# NP ranks are placed GPUS_PER_NODE to a node, in the hostfile's order (consecutive ranks share
# a node, so Megatron's rank order keeps each tensor-parallel group inside one node); rank r
# uses GPU r mod GPUS_PER_NODE of its node. Without a GPU, ranks may outnumber cores: the
# script oversubscribes and gives each rank one thread. DRY_RUN=1 prints the mpirun command
# and the rank -> host -> GPU table, and starts nothing. A TERM or INT to this script stops the
# job the way SIGUSR1 does (every rank saves), and the script returns after the save.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HPCLLM=${HPCLLM:-$ROOT/.venv/bin/hpcllm}
NP=${NP:-4}
GPUS_PER_NODE=${GPUS_PER_NODE:-$NP}

fail() { echo "hpcllm: error: $*" >&2; exit 2; }
[[ "$NP" =~ ^[1-9][0-9]*$ ]] || fail "NP must be a positive integer, got '$NP'"
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || fail "GPUS_PER_NODE must be a positive integer, got '$GPUS_PER_NODE'"

if ! command -v nvidia-smi >/dev/null; then
  OVERSUBSCRIBE=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# Horovod's CPU collectives go through MPI under mpirun (its gloo path crashes there).
export HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-MPI}
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

args=(-np "$NP" --map-by "ppr:${GPUS_PER_NODE}:node" --bind-to none)
[ -n "${HOSTFILE:-}" ] && args+=(--hostfile "$HOSTFILE")
[ -n "${OVERSUBSCRIBE:-}" ] && args+=(--oversubscribe)
# Every setting a rank reads reaches every rank, on every host: hpcllm's, torch's, NCCL's,
# Horovod's, gloo's, UCX's, Triton's and CUDA's, the rendezvous, the threads and the paths.
for var in $(compgen -e | sort); do
  case "$var" in
    HPCLLM_* | NCCL_* | HOROVOD_* | TORCH_* | PYTORCH_* | GLOO_* | UCX_* | TRITON_* | CUDA_* | \
      MASTER_ADDR | MASTER_PORT | OMP_NUM_THREADS | PATH | LD_LIBRARY_PATH | PYTHONPATH)
      args+=(-x "$var") ;;
  esac
done

# The tensor-parallel size, if the arguments give it: its groups must not span nodes.
tp=1
words=("$@")
for i in "${!words[@]}"; do
  case "${words[$i]}" in
    --tp) tp=${words[$((i + 1))]:-1} ;;
    --tp=*) tp=${words[$i]#--tp=} ;;
    parallel.tp=*) tp=${words[$i]#parallel.tp=} ;;
  esac
done
if [[ "$tp" =~ ^[1-9][0-9]*$ ]] && ((GPUS_PER_NODE % tp)); then
  echo "hpcllm: warning: GPUS_PER_NODE=$GPUS_PER_NODE is not a multiple of tp=$tp: tensor-parallel groups will span nodes" >&2
fi

if [ "${DRY_RUN:-0}" = 1 ]; then
  hosts=()
  if [ -n "${HOSTFILE:-}" ]; then
    [ -r "$HOSTFILE" ] || fail "HOSTFILE $HOSTFILE cannot be read"
    # One entry per host, in order (Open MPI merges a host listed twice); a last line without
    # a newline counts too.
    while read -r host _ || [ -n "${host:-}" ]; do
      [ -n "$host" ] && [ "${host:0:1}" != "#" ] || continue
      [[ " ${hosts[*]:-} " == *" $host "* ]] || hosts+=("$host")
    done <"$HOSTFILE"
  else
    hosts=("$(hostname)")
  fi
  needed=$(((NP + GPUS_PER_NODE - 1) / GPUS_PER_NODE))
  ((needed <= ${#hosts[@]})) ||
    fail "NP=$NP at GPUS_PER_NODE=$GPUS_PER_NODE needs $needed hosts; the hostfile lists ${#hosts[@]}"
  printf 'mpirun'
  printf ' %q' "${args[@]}" "$HPCLLM" "$@"
  printf '\n\nrank  host  local_rank  gpu\n'
  for ((rank = 0; rank < NP; rank++)); do
    printf '%s  %s  %s  %s\n' "$rank" "${hosts[$((rank / GPUS_PER_NODE))]}" \
      "$((rank % GPUS_PER_NODE))" "$((rank % GPUS_PER_NODE))"
  done
  exit 0
fi

# A TERM or INT to this script (kill, a scheduler, Ctrl-C) becomes SIGUSR1 to mpirun, which
# forwards it to every rank: they save a checkpoint and exit 75 (stopped, resume me). mpirun
# itself would forward a TERM and kill the ranks 2 s later, in the middle of a large save.
# The script returns only when mpirun has, so after the save.
mpirun "${args[@]}" "$HPCLLM" "$@" &
launcher=$!
trap 'echo "hpcllm: stopping: SIGUSR1 to the ranks, which save a checkpoint" >&2; kill -USR1 "$launcher" 2>/dev/null' TERM INT
status=0
while true; do
  wait "$launcher" && status=0 || status=$?
  kill -0 "$launcher" 2>/dev/null || break # wait returns early when a trapped signal comes
done
exit "$status"
