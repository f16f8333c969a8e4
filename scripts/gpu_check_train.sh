#!/usr/bin/env bash
# Stage 04 on one GPU at the reference size, judged: bench/bench_memory.py --cuda checks
# the CUDA attention kernels against the reference attention (the loss and every
# gradient, bf16 autocast, whole and packed rows), runs a few training steps at
# Kimi-K2.5's drafter widths (hidden 7168, 56 x 128 heads, MLP 18432, vocab
# 32000/163840, K = 7) on one packed row of configs/kimi-k2.5.yaml's batch_tokens in
# 4096-token samples, and holds the peak torch.cuda.max_memory_allocated to within 10%
# of eagle3/stages/s04_train/memory.py's prediction. One PASS/FAIL line per check; exit 1 if one
# fails, 2 (one FAIL line) without a CUDA device or torch. Needs one GPU with ~70 GB
# free; takes a minute or two. Called by scripts/gpu_check.sh.
#
#   bash scripts/gpu_check_train.sh            # on the GPU box
#   bash scripts/gpu_check_train.sh --dry-run  # the same checks at tiny widths on the CPU (no memory check)
#   PYTHON=/path/to/python bash scripts/gpu_check_train.sh   # another interpreter (default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v "$PY" > /dev/null 2>&1; then
    echo "FAIL python: '$PY' is not on PATH; set PYTHON=/path/to/python"
    exit 2
fi
# bench/bench_memory.py itself refuses a machine without a CUDA device in one FAIL line.
if ! "$PY" -c "import torch" > /dev/null 2>&1; then
    echo "FAIL torch: '$PY' cannot import torch; install the CUDA build and requirements.txt (README 'GPU box install')"
    exit 2
fi
exec "$PY" bench/bench_memory.py --cuda --steps "${STEPS:-3}" "$@"
