"""Where SGLang's environment lies: `.venv-sglang/` in the repository (scripts/setup_cpu.sh makes it).

SGLang pins another torch than vLLM's CPU build and CUDA-only packages, so it never shares the
global environment: scripts/setup_cpu.sh makes a venv over the global one
(`--system-site-packages`) and installs requirements-sglang.txt into it with `--no-deps`. It
stays off the user's PATH; the parity check runs its python in a subprocess. Another python
with SGLang can be named with `--sglang-python` or `EAGLE3_SGLANG_PYTHON`.
"""
from __future__ import annotations

import os
from pathlib import Path

from eagle3.core.errors import PipelineError
from eagle3.serving.installed import SGLANG_VENV as VENV

PINS = VENV.parent / "requirements-sglang.txt"
ENV_VAR = "EAGLE3_SGLANG_PYTHON"


def sglang_python(explicit: str | None = None) -> str:
    """The python that imports SGLang: `explicit`, else $EAGLE3_SGLANG_PYTHON, else .venv-sglang's."""
    python = explicit or os.environ.get(ENV_VAR) or str(VENV / "bin" / "python")
    if not Path(python).is_file():
        raise PipelineError(f"SGLang's python {python} does not exist: run `bash scripts/setup_cpu.sh` (it makes "
                            f"{VENV.name}/ with {PINS.name}), or name a python with SGLang in --sglang-python or "
                            f"${ENV_VAR}.")
    return python


def pinned_version(package: str = "sglang") -> str | None:
    """The version requirements-sglang.txt pins for `package`."""
    for line in PINS.read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name.strip().lower() == package:
            return version.strip()
    return None
