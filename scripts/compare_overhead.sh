#!/usr/bin/env bash
# Compare hpcllm's step against plain PyTorch, an earlier commit against the working tree.
#
#   scripts/compare_overhead.sh REV [PAIRS] [-- options of both benchmarks]
#
# Runs the benchmark PAIRS times (default 4) for each side, alternating earlier and current,
# so that a drifting machine hits both alike. A tree with `hpcllm bench step` runs
# `bench step --cpu-smoke` and gives its kernels-off hpcllm step / plain eager step; an
# older tree runs `bench overhead`, whose plain loop trains hpcllm's own GPT. Either ratio
# (of step times) cancels the machine's speed of the moment; bench step also gives the whole
# trainer loop's step (reader, metrics, stop agreement) / plain eager step. Prints every run's
# ratio, then each side's median and spread (max - min): a difference smaller than the spread is no
# difference. The options (--config, --set, --steps, --rounds) go to both. The earlier
# commit is checked out in a temporary folder and imported from there with the project's
# venv; nothing in the working tree changes.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
rev=${1:?usage: scripts/compare_overhead.sh REV [PAIRS] [-- benchmark options]}
shift
pairs=4
if [ $# -gt 0 ] && [ "$1" != "--" ]; then pairs=$1; shift; fi
[ "${1:-}" = "--" ] && shift
options=("$@")
# Default: bench step's cpu-smoke shape, spelled out so that bench overhead trains it too, on
# the built-in corpus (prepared by `make demo`, or by `hpcllm prepare --corpus python-stdlib
# --out data/stdlib`). Paths must be absolute: the runs start in a scratch folder, so that
# neither side imports the other's code from the cwd.
[ ${#options[@]} -gt 0 ] || options=(--set "data.path=$ROOT/data/stdlib" --set model.preset=null
  --set model.n_layer=4 --set model.n_head=4 --set model.d_model=256 --set model.seq_len=128
  --set train.micro_batch_size=4)

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git -C "$ROOT" archive "$rev" | tar -x -C "$scratch"
# The earlier tree as an importable package: kernels/ and datasets/ become hpcllm.kernels and
# hpcllm.datasets, as the install maps them.
mkdir "$scratch/pkg"
mv "$scratch/hpcllm" "$scratch/pkg/hpcllm"
ln -s "$scratch/kernels" "$scratch/pkg/hpcllm/kernels"
ln -s "$scratch/datasets" "$scratch/pkg/hpcllm/datasets"

run() {  # $1: earlier|current; prints the run's result as one JSON line
  local path="" tree=$ROOT
  [ "$1" = earlier ] && path=$scratch/pkg && tree=$scratch/pkg
  if [ -e "$tree/hpcllm/bench/step.py" ]; then
    (cd "$scratch" && PYTHONPATH=$path "$PY" -m hpcllm bench step --cpu-smoke \
       --json-out "$scratch/step.json" "${options[@]}" >&2) &&
      "$PY" -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))))' \
        "$scratch/step.json"
  else
    (cd "$scratch" && PYTHONPATH=$path "$PY" -m hpcllm bench overhead --json "${options[@]}") \
      | tail -n 1
  fi
}

results=$scratch/results.jsonl
for i in $(seq "$pairs"); do
  for side in earlier current; do
    result=$(run "$side")
    [ -n "$result" ] || { echo "the benchmark failed ($side)" >&2; exit 1; }
    printf '{"side": "%s", "run": %d, "result": %s}\n' "$side" "$i" "$result" >> "$results"
    tail -n 1 "$results"
  done
done
"$PY" - "$results" "$rev" <<'EOF'
import json, statistics, sys

rows = [json.loads(line) for line in open(sys.argv[1])]


def ratio_and_ms(result):
    """(hpcllm step / plain step, hpcllm ms) of a bench step or a bench overhead result."""
    if "shapes" in result:
        ms = {r["key"]: r["step_ms"] for r in result["shapes"][0]["rows"]}
        return ms["hpcllm_kernels_off"] / ms["plain_eager"], ms["hpcllm_kernels_off"]
    return result["ratio"], result["median_step_s"]["hpcllm"] * 1e3


def loop_ratio(result):
    """The trainer loop's step / plain step of a bench step result (None without one)."""
    if "shapes" not in result:
        return None
    ms = {r["key"]: r["step_ms"] for r in result["shapes"][0]["rows"]}
    return ms["hpcllm_loop"] / ms["plain_eager"] if "hpcllm_loop" in ms else None


def summary(label, ratios):
    return (f"  {label}: ratios " + " ".join(f"{x:.3f}" for x in ratios)
            + f"  median {statistics.median(ratios):.3f}  spread {max(ratios) - min(ratios):.3f}")


print(f"hpcllm step / plain step, {len(rows) // 2} runs each, alternating")
medians, loops = {}, {}
for side in ("earlier", "current"):
    runs = [r["result"] for r in rows if r["side"] == side]
    ratios, steps = zip(*map(ratio_and_ms, runs))
    bench = "bench step" if "shapes" in runs[0] else "bench overhead"
    medians[side] = statistics.median(ratios)
    name = f"{side:8s} ({sys.argv[2] if side == 'earlier' else 'working tree'}, {bench})"
    print(summary(name, ratios) + f"  (hpcllm step median {statistics.median(steps):.1f} ms)")
    loop = [x for x in map(loop_ratio, runs) if x is not None]
    if len(loop) == len(runs):
        loops[side] = loop
print(f"  current / earlier: {medians['current'] / medians['earlier']:.3f}")
if len(loops) == 2:
    print("hpcllm trainer loop step / plain step")
    for side, ratios in loops.items():
        print(summary(f"{side:8s}", ratios))
    current, earlier = (statistics.median(loops[s]) for s in ("current", "earlier"))
    print(f"  current / earlier: {current / earlier:.3f}")
EOF
