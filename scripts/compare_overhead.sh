#!/usr/bin/env bash
# Compare `hpcllm bench overhead` of an earlier commit with the working tree, in one run.
#
#   scripts/compare_overhead.sh REV [PAIRS] [-- bench overhead options]
#
# Runs the benchmark PAIRS times (default 4) for each side, alternating earlier and current,
# so that a drifting machine hits both alike. Each run already times hpcllm's step against a
# plain PyTorch loop in alternating blocks inside one process; its ratio hpcllm/plain is the
# number compared, since it cancels the machine's speed of the moment. Prints every run's
# ratio, then each side's median and spread (max - min): a difference smaller than the spread
# is no difference. The earlier commit is checked out in a temporary folder and imported from
# there with the project's venv; nothing in the working tree changes.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
rev=${1:?usage: scripts/compare_overhead.sh REV [PAIRS] [-- bench overhead options]}
shift
pairs=4
if [ $# -gt 0 ] && [ "$1" != "--" ]; then pairs=$1; shift; fi
[ "${1:-}" = "--" ] && shift
options=("$@")
# Default: the tiny config on the built-in corpus (prepared by `make demo`, or by
# `hpcllm prepare --corpus python-stdlib --out data/stdlib`). Paths must be absolute: the runs
# start in a scratch folder, so that neither side imports the other's code from the cwd.
[ ${#options[@]} -gt 0 ] || options=(--config "$ROOT/jobs/configs/tiny-cpu.yaml"
                                     --set "data.path=$ROOT/data/stdlib")

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git -C "$ROOT" archive "$rev" | tar -x -C "$scratch"
# The earlier tree as an importable package: kernels/ and datasets/ become hpcllm.kernels and
# hpcllm.datasets, as the install maps them.
mkdir "$scratch/pkg"
mv "$scratch/hpcllm" "$scratch/pkg/hpcllm"
ln -s "$scratch/kernels" "$scratch/pkg/hpcllm/kernels"
ln -s "$scratch/datasets" "$scratch/pkg/hpcllm/datasets"

run() {  # $1: earlier|current
  local path=""
  [ "$1" = earlier ] && path=$scratch/pkg
  (cd "$scratch" && PYTHONPATH=$path "$PY" -m hpcllm bench overhead --json "${options[@]}") \
    | tail -n 1
}

results=$scratch/results.jsonl
for i in $(seq "$pairs"); do
  for side in earlier current; do
    result=$(run "$side")
    [ -n "$result" ] || { echo "bench overhead failed ($side)" >&2; exit 1; }
    printf '{"side": "%s", "run": %d, "result": %s}\n' "$side" "$i" "$result" >> "$results"
    tail -n 1 "$results"
  done
done
"$PY" - "$results" "$rev" <<'EOF'
import json, statistics, sys

rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"bench overhead ratio hpcllm/plain, {len(rows) // 2} runs each, alternating")
medians = {}
for side in ("earlier", "current"):
    ratios = [r["result"]["ratio"] for r in rows if r["side"] == side]
    steps = [r["result"]["median_step_s"]["hpcllm"] * 1e3 for r in rows if r["side"] == side]
    medians[side] = statistics.median(ratios)
    print(f"  {side:8s} ({sys.argv[2] if side == 'earlier' else 'working tree'}): ratios "
          + " ".join(f"{x:.3f}" for x in ratios)
          + f"  median {medians[side]:.3f}  spread {max(ratios) - min(ratios):.3f}"
          + f"  (hpcllm step median {statistics.median(steps):.1f} ms)")
print(f"  current / earlier: {medians['current'] / medians['earlier']:.3f}")
EOF
