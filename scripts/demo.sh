#!/usr/bin/env bash
# The README's first command: the whole pipeline (01..06) on the embedded default (a
# tiny Llama target built and briefly trained locally, the chat set shipped in data/),
# on CPU, then a one-screen summary. About 7 minutes on 2 idle cores, after setup.
# Usage: bash scripts/demo.sh [--skip-setup]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONFIG=configs/tiny-llama.yaml
TARGET=work/targets/tiny-llama            # = target_model in $CONFIG
WORK=work/tiny-llama                      # = work_dir in $CONFIG
# The demo target is trained on the shipped chats (loss ~0.5): a random target's greedy
# output is noise that no drafter can predict. 150 steps take ~2 min on 2 cores.
TINY_TRAIN_STEPS=150
[ "${1:-}" = "--skip-setup" ] || bash scripts/setup_cpu.sh

start=$(date +%s)
before=$(cat "$TARGET/TINY_TARGET.json" 2>/dev/null || true)
$PY -m eagle3.tiny --kind llama --out "$TARGET" --train-steps "$TINY_TRAIN_STEPS"
if [ -d "$WORK" ] && [ "$before" != "$(cat "$TARGET/TINY_TARGET.json")" ]; then
    # Stages fingerprint the target's config and tokenizer, not its weights: results
    # computed from the previous target's weights must not be reused.
    echo "demo: the tiny target was rebuilt; removing $WORK, which was computed from the previous one" >&2
    rm -rf "$WORK"
fi
$PY 01_prepare_dataset.py --config $CONFIG
$PY 02_extract_hidden_states.py --config $CONFIG
$PY 03_build_vocab_mapping.py --config $CONFIG
$PY 04_train_drafter.py --config $CONFIG
$PY 05_export_drafter.py --config $CONFIG
$PY 06_evaluate_drafter.py --config $CONFIG
$PY -m eagle3.demo --config $CONFIG --elapsed-s $(( $(date +%s) - start ))
