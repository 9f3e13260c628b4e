#!/usr/bin/env bash
# Measure the collectives between nodes, one rank per GPU on every GPU of NODES nodes, and add
# the tables to a GPU report's cluster.yaml (hpcllm bench report --merge), so that hpcllm plan
# prices communication across nodes from this cluster's own figures.
#
#   make gpu-report                                                  # first, on one node
#   NODES=2 GPUS_PER_NODE=8 HOSTFILE=hosts jobs/collectives.sh gpu-report     # mpirun
#   LAUNCHER=srun NODES=2 GPUS_PER_NODE=8 jobs/collectives.sh gpu-report      # in an allocation
#
# Extra words go to the benchmark (e.g. --max-bytes 256M). DRY_RUN=1 prints the launch (and,
# with mpirun, the rank -> host -> GPU table) and the merge, and starts nothing.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HPCLLM=${HPCLLM:-$ROOT/.venv/bin/hpcllm}
REPORT=${1:?usage: jobs/collectives.sh REPORT_DIR [benchmark options]}
shift
NODES=${NODES:-2}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
LAUNCHER=${LAUNCHER:-mpirun}

fail() { echo "hpcllm: error: $*" >&2; exit 2; }
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] && ((NODES >= 2)) || fail "NODES must be 2 or more, got '$NODES'"
[[ "$GPUS_PER_NODE" =~ ^[1-9][0-9]*$ ]] || fail "GPUS_PER_NODE must be a positive integer"
[ -f "$REPORT/report.json" ] || [ "${DRY_RUN:-0}" = 1 ] ||
  fail "$REPORT has no report.json: run make gpu-report (REPORT_DIR=$REPORT) on one node first"

RESULT="$REPORT/raw/collectives-${NODES}-nodes.json"
bench=(bench collectives --json "$RESULT" --no-progress "$@")
merge=("$HPCLLM" bench report --out "$REPORT" --merge "$RESULT")

case "$LAUNCHER" in
  mpirun)
    NP=$((NODES * GPUS_PER_NODE)) GPUS_PER_NODE=$GPUS_PER_NODE HPCLLM=$HPCLLM \
      "$ROOT/jobs/mpirun.sh" "${bench[@]}" ;;
  srun)
    launch=(srun --mpi=pmix --nodes="$NODES" --ntasks-per-node="$GPUS_PER_NODE" "$HPCLLM" "${bench[@]}")
    if [ "${DRY_RUN:-0}" = 1 ]; then
      printf '%q ' "${launch[@]}"; printf '\n'
    else
      "${launch[@]}"
    fi ;;
  *) fail "LAUNCHER must be mpirun or srun, got '$LAUNCHER'" ;;
esac

if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '\nthen: '; printf '%q ' "${merge[@]}"; printf '\n'
  exit 0
fi
"${merge[@]}"
