#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md in one run, each part under its own time limit
# and all of them under one deadline, so that a short loan of a GPU node measures as much as
# it can and says what it left out. Each part writes its log (and JSON) under OUT_DIR; a
# part that fails or runs out of time is named in OUT_DIR/summary.txt, and the others go on.
#
#   scripts/gpu_check.sh OUT_DIR [SECONDS] [PARTS]
#
# SECONDS: the deadline (default 480). PARTS: comma-separated, in the order to run (default:
# env,levers124,llama,train,generate,tests,kernels). Parts:
#   env         GPU, driver, CUDA, torch, Triton (and installs this checkout without deps)
#   levers124   scripts/step_levers.py at gpt2-124m: as configured, CUDA graphs, the eager
#               steps; profiles of the configured, plain and eager steps
#   levers1p3   scripts/step_levers.py at gpt2-1.3b, as configured
#   llama       hpcllm bench step --model llama3.2-1b --shapes gpt2-1.3b
#   llamalevers scripts/step_levers.py for llama3.2-1b at the gpt2-1.3b shape (configured,
#               kernels off)
#   tests       pytest -m gpu tests/test_kernels.py (every test marked gpu is there)
#   testsfrom   the same tests from the TESTS_FROM-th on (1-based, in collection order), to
#               finish what a cut-off tests part left, without -x
#   graphs      CUDA graphs: gpt2 tiny trained 8 fp32 steps of one micro-batch under compile
#               full with and without compile_mode reduce-overhead (the same losses and norms);
#               on a GPU, reduce-overhead at 4 micro-batches a step refused in one line
#   train       llama-tiny, 50 steps, fused_kernels on and off (bf16 losses compared)
#   generate    hpcllm bench generate --device cuda (the KV cache's speed-up)
#   kernels     hpcllm bench kernels (each op against inductor, and eager training steps)
set -u
OUT_DIR=${1:?usage: scripts/gpu_check.sh OUT_DIR [SECONDS] [PARTS]}
SECONDS_ALL=${2:-480}
PARTS=${3:-env,levers124,llama,train,generate,tests,kernels}
PY=${PY:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
START=$(date +%s)
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

left() { echo $((START + SECONDS_ALL - $(date +%s))); }

# part NAME LIMIT COMMAND...: run COMMAND for at most min(LIMIT, time left) seconds.
part() {
    local name=$1 limit=$2
    shift 2
    local budget
    budget=$(left)
    if [ "$budget" -lt 20 ]; then
        echo "$name: not run (deadline)" | tee -a "$SUMMARY"
        return
    fi
    [ "$limit" -lt "$budget" ] && budget=$limit
    echo "== $name (at most ${budget} s): $*" | tee -a "$OUT_DIR/$name.log"
    local began=$(date +%s) rc
    timeout -k 10 "$budget" "$@" >>"$OUT_DIR/$name.log" 2>&1
    rc=$?
    echo "$name: rc $rc in $(($(date +%s) - began)) s" | tee -a "$SUMMARY" "$OUT_DIR/$name.log"
}

env_part() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    $PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
    $PY - <<'EOF'
import platform, torch, triton
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version(), "triton", triton.__version__)
print("device", torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, "SMs")
EOF
    git log -1 --format='commit %H' 2>/dev/null || true
}

train_part() {
    # llama-tiny, 50 steps of bf16 with the Triton kernels on (eager, so they run) and off.
    local common=(--no-progress --set model.arch=llama --set model.preset=llama-tiny
        --set data.synthetic=true --set train.steps=${TRAIN_STEPS:-50} --set train.precision=${TRAIN_PRECISION:-bf16}
        --set train.log_interval=5 --set train.save_interval=0 --set model.compile=none
        --set train.eval_interval=0 --set run.tensorboard=false)
    for k in ${TRAIN_KERNELS:-on off}; do
        $PY -m hpcllm train "${common[@]}" --set model.fused_kernels=$k \
            --set run.dir="$OUT_DIR/train-$k" || return 1
    done
    $PY - "$OUT_DIR" <<'EOF'
import sys
from pathlib import Path
from hpcllm.observe import read_metrics
out = Path(sys.argv[1])
on, off = (read_metrics(out / f"train-{k}") for k in ("on", "off"))
assert len(on) == len(off) > 0, (len(on), len(off))
worst = 0.0
for a, b in zip(on, off):
    if "loss" in a and "loss" in b:
        rel = abs(a["loss"] - b["loss"]) / abs(b["loss"])
        worst = max(worst, rel)
        print(f"step {a['step']}: loss on {a['loss']:.4f} off {b['loss']:.4f} rel {rel:.4f}")
print(f"largest relative difference {worst:.4f} (goal within 0.02)")
sys.exit(0 if worst <= 0.02 else 1)
EOF
    local rc=$?
    rm -rf "$OUT_DIR"/train-*/checkpoints
    return $rc
}

graphs_part() {
    # CUDA graphs: gpt2 tiny trained 8 fp32 steps of one micro-batch under compile full with and
    # without compile_mode reduce-overhead (the same losses and norms); then, on a GPU, four
    # micro-batches a step with CUDA graphs must be refused at start-up in one line (their
    # replays overwrite outputs an earlier micro-batch's backward reads).
    local common=(--no-progress --set model.preset=tiny --set data.synthetic=true
        --set train.steps=8 --set train.precision=fp32 --set train.micro_batch_size=2
        --set train.log_interval=1 --set train.save_interval=0
        --set model.compile=full --set train.eval_interval=0 --set run.tensorboard=false)
    for mode in default reduce-overhead; do
        $PY -m hpcllm train "${common[@]}" --set train.global_batch_size=2 \
            --set model.compile_mode=$mode --set run.dir="$OUT_DIR/graphs-$mode" || return 1
    done
    $PY - "$OUT_DIR" <<'EOF' || return 1
import sys
from pathlib import Path
from hpcllm.observe import read_metrics
out = Path(sys.argv[1])
plain, graphs = (read_metrics(out / f"graphs-{m}") for m in ("default", "reduce-overhead"))
pairs = [(a, b) for a, b in zip(plain, graphs) if "loss" in a and "loss" in b]
assert len(pairs) >= 8, len(pairs)
worst = 0.0
for a, b in pairs:
    for key in ("loss", "grad_norm"):
        rel = abs(a[key] - b[key]) / max(abs(a[key]), 1e-12)
        worst = max(worst, rel)
    print(f"step {a['step']}: loss {a['loss']:.6f} / {b['loss']:.6f}, "
          f"norm {a['grad_norm']:.6f} / {b['grad_norm']:.6f}")
print(f"largest relative difference {worst:.2e} (goal within 1e-5)")
sys.exit(0 if worst <= 1e-5 else 1)
EOF
    rm -rf "$OUT_DIR"/graphs-*/checkpoints
    $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || return 0
    local said
    said=$($PY -m hpcllm train "${common[@]}" --set train.global_batch_size=8 \
        --set model.compile_mode=reduce-overhead --set run.dir="$OUT_DIR/graphs-refused" 2>&1)
    local rc=$?
    echo "$said" | tail -3
    rm -rf "$OUT_DIR/graphs-refused"
    [ $rc -ne 0 ] && echo "$said" | grep -q "reduce-overhead cannot train 4 micro-batches"
}

testsfrom_part() {
    # The gpu tests from the TESTS_FROM-th on, in collection order (their ids hold spaces).
    set -o pipefail
    local list="$OUT_DIR/testsfrom.txt"
    $PY -m pytest -m gpu --collect-only -q -p no:cacheprovider tests/test_kernels.py |
        grep :: | tail -n +"${TESTS_FROM:-1}" >"$list" || return 1
    if [ ! -s "$list" ]; then
        echo "no gpu test from the ${TESTS_FROM:-1}-th on"
        return 1
    fi
    local ids
    mapfile -t ids <"$list"
    $PY -m pytest -q -p no:cacheprovider "${ids[@]}"
}

export OUT_DIR PY TESTS_FROM
export -f env_part train_part graphs_part testsfrom_part

IFS=, read -r -a WANT <<<"$PARTS"
for p in "${WANT[@]}"; do
    case $p in
    env) part env 60 bash -c env_part ;;
    levers124) part levers124 200 $PY scripts/step_levers.py --shape gpt2-124m \
        --levers configured,full-cudagraphs,eager,eager-kernels-off,eager-kernels-on \
        --profile configured,plain_compile,eager,eager-kernels-off,eager-kernels-on \
        --out "$OUT_DIR/levers124" ;;
    levers1p3) part levers1p3 170 $PY scripts/step_levers.py --shape gpt2-1.3b --rounds 2 \
        --levers configured --out "$OUT_DIR/levers1p3" ;;
    # Under compile: full a fresh machine compiles llama3.2-1b's whole chunk for minutes (a
    # warm-up still compiling after 118 s on an H100): its parts get 300 s.
    llama) part llama 300 $PY -m hpcllm bench step --model llama3.2-1b --shapes gpt2-1.3b \
        --rounds 2 --loop-steps 4 --json-out "$OUT_DIR/llama-step.json" ;;
    llamalevers) part llamalevers 300 $PY scripts/step_levers.py --shape gpt2-1.3b \
        --model llama3.2-1b --rounds 2 --levers configured,kernels-off \
        --out "$OUT_DIR/llamalevers" ;;
    tests) part tests 100 $PY -m pytest -m gpu -q -x -p no:cacheprovider tests/test_kernels.py ;;
    testsfrom) part testsfrom 150 bash -c testsfrom_part ;;
    graphs) part graphs 90 bash -c graphs_part ;;
    train) part train 60 bash -c train_part ;;
    generate) part generate 40 $PY -m hpcllm bench generate --device cuda \
        --models tiny llama-tiny --tokens 100 --repeats 3 --json-out "$OUT_DIR/generate.json" ;;
    kernels) part kernels 120 $PY -m hpcllm bench kernels --iters 10 --steps 5 \
        --json "$OUT_DIR/kernels.json" ;;
    *) echo "$p: no such part" | tee -a "$SUMMARY" ;;
    esac
done
echo "done in $(($(date +%s) - START)) s" | tee -a "$SUMMARY"
