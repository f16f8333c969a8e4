#!/usr/bin/env bash
# Stage 04 on one GPU at the reference size, judged: bench/bench_memory.py --cuda checks
# the CUDA attention kernels against the reference attention run in float64 (the loss and
# every gradient, bf16 autocast, whole and packed rows), runs a few training steps at
# Kimi-K2.5's drafter widths (hidden 7168, 56 x 128 heads, MLP 18432, vocab
# 32000/163840, configs/kimi-k2.5.yaml's K) on one packed row of that config's
# batch_tokens in samples of its max_seq_len, and holds the peak
# torch.cuda.max_memory_allocated to within 10% of eagle3/stages/s04_train/memory.py's
# prediction and the peak torch.cuda.max_memory_reserved to at most 1/0.85 of it, with
# the allocator set as stage 04 sets it (expandable segments unless PYTORCH_CUDA_ALLOC_CONF
# or PYTORCH_ALLOC_CONF is set). One PASS/FAIL line per check; exit 1 if one fails, 2
# (one FAIL line) without a CUDA device or torch. docs/DEVICE_BRANCHES.md says what each
# check catches. Called by scripts/gpu_check.sh.
#
# One command, a minute or two on one GPU with ~70 GB free, no network. It needs only a
# CUDA torch and this checkout: its path imports nothing else (no vLLM, datasets, pyyaml
# or transformers; tests/stages/test_gpu_check_train.py runs it with those hidden), so a
# box with just torch, transformers, safetensors, numpy and tqdm runs it.
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
    echo "FAIL torch: '$PY' cannot import torch; install a CUDA build of torch (README 'GPU box install')"
    exit 2
fi
exec "$PY" bench/bench_memory.py --cuda --steps "${STEPS:-3}" "$@"
