"""scripts/gpu_check_train.sh on a machine without CUDA (CI): one FAIL line and exit code 2,
never a traceback; `--dry-run` runs the same judged checks at tiny widths on the CPU.

The script is for a GPU box that may hold only torch, transformers, safetensors, numpy,
tqdm (and pyarrow, xxhash, tensorboard), without network: every run here is in a
subprocess to which the packages such a box lacks (`GPU_BOX_LACKS`) look uninstalled,
so an import of one of them on the script's path fails here first.

The dry run takes K = 2 and one training step to stay near 20 s on 2 busy cores.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check_train.sh"
# In requirements*.txt or beside them, and not on such a box. (transformers itself imports
# yaml, through huggingface_hub, so the script's path must not import transformers either.)
GPU_BOX_LACKS = ("vllm", "datasets", "yaml", "matplotlib", "pandas", "gguf", "accelerate", "transformers",
                 "huggingface_hub")


@pytest.fixture(scope="module")
def gpu_box_path(tmp_path_factory) -> str:
    """A PYTHONPATH whose sitecustomize makes GPU_BOX_LACKS look uninstalled: `import yaml`
    raises ModuleNotFoundError and importlib's find_spec answers None (None in sys.modules),
    as for a package that is not there."""
    d = tmp_path_factory.mktemp("gpu-box")
    (d / "sitecustomize.py").write_text(f"import sys\nfor _name in {GPU_BOX_LACKS!r}:\n    sys.modules[_name] = None\n")
    return str(d)


def run_script(*args: str, path: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": path, **env})


def bench_memory():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "bench" / "bench_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_box_path_hides_what_such_a_box_lacks(gpu_box_path):
    env = {**os.environ, "PYTHONPATH": gpu_box_path}
    r = subprocess.run([sys.executable, "-c", "import yaml"], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "ModuleNotFoundError: import of yaml halted" in r.stderr
    r = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('vllm'), "
                        "u.find_spec('datasets'), u.find_spec('torch') is None)"], capture_output=True, text=True, env=env)
    assert r.stdout.split() == ["None", "None", "False"], r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the script would run the checks")
def test_without_cuda_one_fail_line_and_exit_2(gpu_box_path):
    r = run_script(path=gpu_box_path)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("FAIL cuda: "), out
    assert ("CPU build" in lines[0]) == (torch.version.cuda is None), lines[0]


def test_without_the_interpreter_one_fail_line_and_exit_2(gpu_box_path):
    r = run_script(path=gpu_box_path, PYTHON="no-such-python-3")
    assert r.returncode == 2 and r.stderr == ""
    assert r.stdout.splitlines() == ["FAIL python: 'no-such-python-3' is not on PATH; set PYTHON=/path/to/python"]


def test_dry_run_judges_each_check_on_the_cpu(gpu_box_path):
    r = run_script("--dry-run", "--ttt-steps", "2", path=gpu_box_path, STEPS="1")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Traceback" not in out
    lines = r.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "PASS attention on cpu, whole rows", "PASS attention on cpu, packed rows", "PASS training", "SKIP memory"], out
    assert all("tolerance 3e-02" in line for line in lines[:2])
    assert "1 step(s) on cpu" in lines[2] and "K=2" in lines[2]


def test_the_config_reads_the_same_without_pyyaml():
    """The GPU check reads configs/kimi-k2.5.yaml's train section without pyyaml; here it must
    read what pyyaml reads (a section written otherwise than as flat `key: value` lines fails)."""
    import yaml

    bench = bench_memory()
    text = (ROOT / "configs" / "kimi-k2.5.yaml").read_text()
    assert bench.flat_section(text, "train") == yaml.safe_load(text)["train"] == bench.kimi_train_section()
    sample = "a:\n  x: 1  # one\n  y: 1.5e-4\n  z: true\n  w: null\n  s: 'q'\nb:\n  x: 2\n"
    assert bench.flat_section(sample, "a") == yaml.safe_load(sample)["a"]


def test_memory_is_judged_allocated_and_reserved():
    """The memory check's verdicts (what a GPU run prints), on made-up peaks: allocated within
    10% of the prediction, reserved at most 1/0.85 times it (stage 04's warning level)."""
    bench = bench_memory()

    class Pred:
        total = 100 * 2**30

        def summary(self):
            return "100 GiB"

    def verdicts(allocated_gib, reserved_gib):
        lines = bench.judge_memory(int(allocated_gib * 2**30), int(reserved_gib * 2**30), Pred(), "expandable_segments:True")
        return [(ok, line.split(":")[0]) for ok, line in lines]

    assert verdicts(95, 110) == [(True, "PASS memory allocated"), (True, "PASS memory reserved")]
    assert verdicts(95, 118) == [(True, "PASS memory allocated"), (False, "FAIL memory reserved")]
    assert verdicts(111, 112) == [(False, "FAIL memory allocated"), (True, "PASS memory reserved")]
    line = bench.judge_memory(95 * 2**30, 110 * 2**30, Pred(), None)[1][1]
    assert "1.100 x the prediction" in line and "15.00 GiB above the allocated peak" in line
    assert "PYTORCH_CUDA_ALLOC_CONF=(unset)" in line
