#!/usr/bin/env bash
# Stage 04 on one GPU at the reference size: checks the CUDA attention kernels against
# the reference attention, then runs a few training steps at Kimi-K2.5's drafter widths
# (hidden 7168, 56 x 128 heads, MLP 18432, vocab 32000/163840, K = 7) on one packed row
# of configs/kimi-k2.5.yaml's batch_tokens in 4096-token samples, bf16 autocast, and
# prints peak torch.cuda.max_memory_allocated next to eagle3/train/memory.py's prediction.
# Needs one GPU with ~70 GB free; takes a minute or two. Called by scripts/gpu_check.sh.
#
#   bash scripts/gpu_check_train.sh            # on the GPU box
#   bash scripts/gpu_check_train.sh --dry-run  # the same code path at tiny widths on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
exec python bench/bench_memory.py --cuda --steps "${STEPS:-3}" "$@"
