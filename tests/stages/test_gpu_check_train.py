"""scripts/gpu_check_train.sh on a machine without CUDA (CI): one FAIL line and exit code 2,
never a traceback; `--dry-run` runs the same judged checks at tiny widths on the CPU.

The dry run takes K = 2 and one training step to stay near 20 s on 2 busy cores.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check_train.sh"


def run_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the script would run the checks")
def test_without_cuda_one_fail_line_and_exit_2():
    r = run_script()
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("FAIL cuda: "), out
    assert ("CPU build" in lines[0]) == (torch.version.cuda is None), lines[0]


def test_without_the_interpreter_one_fail_line_and_exit_2():
    r = run_script(PYTHON="no-such-python-3")
    assert r.returncode == 2 and r.stderr == ""
    assert r.stdout.splitlines() == ["FAIL python: 'no-such-python-3' is not on PATH; set PYTHON=/path/to/python"]


def test_dry_run_judges_each_check_on_the_cpu():
    r = run_script("--dry-run", "--ttt-steps", "2", STEPS="1")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Traceback" not in out
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "PASS attention on cpu, whole rows", "PASS attention on cpu, packed rows", "PASS training", "SKIP memory"], out
    assert all("tolerance 3e-02" in line for line in lines[:2])
    assert "1 step(s) on cpu" in lines[2] and "K=2" in lines[2]
