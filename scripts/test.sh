#!/usr/bin/env bash
# The README's test command: set up a fresh CPU machine, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_cpu.sh
exec ${PYTHON:-python3} -m pytest tests -q "$@"
