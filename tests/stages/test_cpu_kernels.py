"""eagle3/drafter/cpu.py: when the fused CPU attention takes bf16, against torch 2.13's kernel.

The contract, read in PyTorch's source: the CPU flash attention packs bf16 operands only
when oneDNN can (`at::native::cpublas::could_pack(kBFloat16)`: oneDNN's effective ISA at
least avx512_core_amx), and its packing routine `pack_vnni2` exists only in ATen's AVX512
kernel build. So bf16 fails exactly on AMX CPUs with ATen below AVX512; AVX512-BF16
without AMX (AMD EPYC) never packs. The real-kernel test runs in subprocesses because
ATEN_CPU_CAPABILITY is read once per process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.drafter import cpu

ROOT = Path(__file__).resolve().parents[2]


def _machine(monkeypatch, *, capability: str, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


@pytest.mark.parametrize("capability,amx,avx512_bf16,fused_ok,pays", [
    ("AVX512", True, True, True, True),      # Intel with AMX, ATen's default level
    ("AVX2", True, True, False, False),      # the same CPU under ATEN_CPU_CAPABILITY=avx2: pack_vnni2 raises
    ("DEFAULT", True, True, False, False),   # ... or =default
    ("AVX2", False, True, True, False),      # AVX512-BF16 without AMX (AMD EPYC), lowered: nothing is packed
    ("AVX512", False, True, True, True),     # the same at its default level
    ("AVX2", False, False, True, False),     # no bf16 in hardware
    ("SVE256", False, False, True, False),   # an ARM server (e.g. a GH200 box's Grace CPU)
])
def test_bf16_fused_attention_and_autocast_by_machine(monkeypatch, capability, amx, avx512_bf16, fused_ok, pays):
    _machine(monkeypatch, capability=capability, amx=amx, avx512_bf16=avx512_bf16)
    assert cpu.bf16_fused_attention_ok() is fused_ok
    assert cpu.bf16_pays() is pays


PROBE = r"""
import json, torch
from eagle3.drafter.cpu import bf16_fused_attention_ok
q = torch.randn(1, 8, 256, 64, dtype=torch.bfloat16)  # large enough for the kernel to pack on AMX
try:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.0, True, scale=0.125)
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(out, q, q, q, out, lse, 0.0, True, scale=0.125)
    ran = True
except RuntimeError as e:
    if "pack_vnni2" not in str(e):
        raise  # another failure: the test shows it
    ran = False
print(json.dumps({"ok": bf16_fused_attention_ok(), "ran": ran}))
"""


@pytest.mark.parametrize("capability", ["", "default"])
def test_where_the_answer_is_yes_the_real_kernel_runs_bf16(capability):
    """On this machine, whatever its CPU: where `bf16_fused_attention_ok()` says yes, torch's
    bf16 kernel runs forward and backward; where the kernel raises, it says no."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    p = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    if r["ok"]:
        assert r["ran"], f"ATEN_CPU_CAPABILITY={capability or '(unset)'}: said yes, kernel raised"
    if not r["ran"]:
        assert not r["ok"]


def test_hf_backend_keeps_the_fused_kernel_on_cuda(monkeypatch):
    """The math-kernel fallback is the CPU's alone; on CUDA transformers keeps its own choice."""
    import contextlib

    from eagle3.stages.s02_extract.hf_backend import _attention_kernels

    _machine(monkeypatch, capability="DEFAULT", amx=True, avx512_bf16=True)
    assert isinstance(_attention_kernels("cuda:0", torch.bfloat16), contextlib.nullcontext)
    assert not isinstance(_attention_kernels("cpu", torch.bfloat16), contextlib.nullcontext)
    assert isinstance(_attention_kernels("cpu", torch.float32), contextlib.nullcontext)
