"""What this CPU's torch kernels can do with bf16, asked once in one place.

Two questions, answered differently on the machines we run on (Intel with AMX, AMD
EPYC, and a forced `ATEN_CPU_CAPABILITY`):

- Does bf16 pay? Only with bf16 matmuls in hardware (AMX or AVX512-BF16) *and* ATen
  dispatching to its AVX512 kernels; elsewhere bf16 is emulated and slower than fp32.
- Does bf16 attention run? torch 2.13's fused CPU attention packs bf16 operands with
  AVX512 instructions when the CPU has AMX/AVX512-BF16, and raises ("pack_vnni2 is only
  supported when avx512 is supported") when ATen was told to use a lower kernel level
  (`ATEN_CPU_CAPABILITY=default` or `avx2`) on such a CPU. Callers then fall back to the
  math kernel (transformers) or to fp32 operands (the drafter's attention).
"""
from __future__ import annotations

import torch


def aten_avx512() -> bool:
    """ATen dispatches its CPU kernels at AVX512 level (or above)."""
    return torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")


def hardware_bf16() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    except AttributeError:  # private helpers; absent in some torch builds
        return False


def bf16_pays() -> bool:
    """bf16 autocast is faster than fp32 on this CPU (measured ~1.4x with AMX)."""
    return hardware_bf16() and aten_avx512()


def bf16_fused_attention_ok() -> bool:
    """The fused CPU attention kernels accept bf16 operands here (see the module docstring)."""
    return aten_avx512() or not hardware_bf16()
