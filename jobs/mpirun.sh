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
# job the way SIGUSR1 does (every rank saves), and the script returns after the save. After
# hpcllm's own ends, a user error said in one line (exit 2) or a clean stop (75), Open MPI's
# notices that a process "returned a non-zero exit code" are left out; every other notice (a
# rank killed by a signal, a crash, a failed launch) is passed on.
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

# The tensor-, expert- and context-parallel sizes, if the arguments give them: a tensor-parallel
# group must not span nodes, and neither should an expert-parallel group's all-to-all (t·ep
# consecutive ranks) nor a context-parallel group's key/value gathers (t·cp consecutive ranks).
tp=1
ep=1
cp=1
words=("$@")
for i in "${!words[@]}"; do
  case "${words[$i]}" in
    --tp) tp=${words[$((i + 1))]:-1} ;;
    --tp=*) tp=${words[$i]#--tp=} ;;
    parallel.tp=*) tp=${words[$i]#parallel.tp=} ;;
    --ep) ep=${words[$((i + 1))]:-1} ;;
    --ep=*) ep=${words[$i]#--ep=} ;;
    parallel.ep=*) ep=${words[$i]#parallel.ep=} ;;
    --cp) cp=${words[$((i + 1))]:-1} ;;
    --cp=*) cp=${words[$i]#--cp=} ;;
    parallel.cp=*) cp=${words[$i]#parallel.cp=} ;;
  esac
done
if [[ "$tp" =~ ^[1-9][0-9]*$ ]] && ((GPUS_PER_NODE % tp)); then
  echo "hpcllm: warning: GPUS_PER_NODE=$GPUS_PER_NODE is not a multiple of tp=$tp: tensor-parallel groups will span nodes" >&2
fi
if [[ "$tp" =~ ^[1-9][0-9]*$ && "$ep" =~ ^[1-9][0-9]*$ ]] && ((tp * ep > GPUS_PER_NODE)); then
  echo "hpcllm: warning: tp*ep = $((tp * ep)) exceeds GPUS_PER_NODE=$GPUS_PER_NODE: expert-parallel all-to-alls will cross nodes" >&2
fi
if [[ "$tp" =~ ^[1-9][0-9]*$ && "$cp" =~ ^[1-9][0-9]*$ ]] && ((tp * cp > GPUS_PER_NODE)); then
  echo "hpcllm: warning: tp*cp = $((tp * cp)) exceeds GPUS_PER_NODE=$GPUS_PER_NODE: context-parallel key/value gathers will cross nodes" >&2
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

# Open MPI ends a job one of whose processes exits non-zero with boxed notices: "Primary job
# terminated normally, but 1 process returned a non-zero exit code ...", often "mpirun
# detected that one or more processes exited with non-zero status ... Exit code: N", or, for
# a rank that aborted the job, "MPI_ABORT was invoked on rank R ... with errorcode N" (and a
# count of the other ranks that did). mpirun exits with that code. After 2 (hpcllm said the
# user error in one line) or 75 (a clean stop, said too) they point the wrong way, so this
# filter of mpirun's stderr holds them back (in $held_notices) and the script shows them only
# after another exit code. Every other notice (a rank ended by a signal is named, with the
# signal; a failed launch) and every line of the ranks pass at once. mpirun's -q
# (orte_execute_quiet) would hide those too: Open MPI 4.1 has no setting for these notices
# alone. The filter ignores INT and TERM, and ends when mpirun's stderr closes.
notice_rule='^-{60,}$'
abort_count='^\[[^]]*\] [0-9]+ more process.* help message help-mpi-api\.txt / mpi-abort$'
hold_exit_notices() {
  trap '' INT TERM
  set +u # an empty array is unbound to bash before 4.4
  local line held=() notice=()
  while IFS= read -r line || [ -n "$line" ]; do
    if ((${#notice[@]} == 0)); then
      if [[ "$line" =~ $notice_rule ]]; then
        notice=("$line") # perhaps the top of a notice: the next line says
      elif [[ "$line" =~ $abort_count ]] || { ((${#held[@]})) &&
        [[ "${held[${#held[@]} - 1]}" =~ $abort_count && "$line" == *"orte_base_help_aggregate"* ]]; }; then
        held+=("$line")
      else
        printf '%s\n' "$line" # a rank's line may come between the notices
      fi
      continue
    fi
    notice+=("$line")
    if ((${#notice[@]} == 2)); then
      case "$line" in
        "Primary job "* | "mpirun detected that one or more processes exited with non-zero status"* | \
          "MPI_ABORT was invoked on rank "*) continue ;;
      esac
      # Another notice (what was held goes before it) or a rank's line of dashes.
      ((${#held[@]} == 0)) || printf '%s\n' "${held[@]}"
      held=()
      if [[ "$line" =~ $notice_rule ]]; then
        printf '%s\n' "${notice[0]}"
        notice=("$line") # this one may open the next notice
      else
        printf '%s\n' "${notice[@]}"
        notice=()
      fi
      continue
    fi
    if [[ "$line" =~ $notice_rule ]]; then
      held+=("${notice[@]}")
      notice=()
    fi
  done
  ((${#held[@]} == 0)) || printf '%s\n' "${held[@]}" >"$held_notices"
  ((${#notice[@]} == 0)) || printf '%s\n' "${notice[@]}"
}

# A TERM or INT to this script (kill, a scheduler, Ctrl-C) becomes SIGUSR1 to mpirun, which
# forwards it to every rank: they save a checkpoint and exit 75 (stopped, resume me). mpirun
# itself would forward a TERM and kill the ranks 2 s later, in the middle of a large save.
# The script returns only when mpirun has, so after the save.
held_notices=$(mktemp "${TMPDIR:-/tmp}/hpcllm-mpirun.XXXXXX")
trap 'rm -f "$held_notices"' EXIT
exec 4> >(hold_exit_notices >&2)
notices=$!
mpirun "${args[@]}" "$HPCLLM" "$@" 2>&4 4>&- &
launcher=$!
exec 4>&-
trap 'echo "hpcllm: stopping: SIGUSR1 to the ranks, which save a checkpoint" >&2; kill -USR1 "$launcher" 2>/dev/null' TERM INT
status=0
while true; do
  wait "$launcher" && status=0 || status=$?
  kill -0 "$launcher" 2>/dev/null || break # wait returns early when a trapped signal comes
done
wait "$notices" 2>/dev/null || true # mpirun's last lines, through the filter (bash >= 4.4)
[ "$status" = 2 ] || [ "$status" = 75 ] || cat "$held_notices" >&2
exit "$status"
