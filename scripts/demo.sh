#!/usr/bin/env bash
# The README's first command: the whole pipeline on the embedded default (a tiny
# Llama target built locally, the chat set shipped in data/), on CPU.
# Usage: bash scripts/demo.sh [--skip-setup]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CONFIG=configs/tiny-llama.yaml
[ "${1:-}" = "--skip-setup" ] || bash scripts/setup_cpu.sh

$PY -m eagle3.tiny --kind llama --out work/targets/tiny-llama
$PY 01_prepare_dataset.py --config $CONFIG
$PY 03_build_vocab_mapping.py --config $CONFIG
