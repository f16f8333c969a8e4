"""What this CPU's torch kernels can do with bf16, asked once in one place.

Two questions, answered differently on the machines we run on (Intel with AMX, AMD
EPYC, and a forced `ATEN_CPU_CAPABILITY`):

- Does bf16 pay? Only with bf16 matmuls in hardware (AMX or AVX512-BF16) *and* ATen
  dispatching to its AVX512 kernels; elsewhere bf16 is emulated and slower than fp32.
- Does bf16 attention run? torch 2.13's fused CPU attention (`cpu_flash_attention`,
  aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) packs bf16 keys and values with
  `at::vec::pack_vnni2` when oneDNN can pack bf16 (`cpublas::could_pack`: oneDNN's
  effective ISA at least avx512_core_amx, i.e. AMX) and both lengths reach 64. That
  routine (aten/src/ATen/cpu/vec/vec_half.h) exists only in ATen's AVX512 kernel build:
  on an AMX CPU with ATen told to use a lower level (`ATEN_CPU_CAPABILITY=default` or
  `avx2`) it raises "pack_vnni2 is only supported when avx512 is supported". Without AMX
  (AVX512-BF16 alone, e.g. AMD EPYC) nothing is packed and bf16 runs at any level.
  Callers fall back to the math kernel (transformers) or to fp32 operands (the drafter's
  attention) where it would raise.
"""
from __future__ import annotations

import torch


def aten_avx512() -> bool:
    """ATen dispatches its CPU kernels at AVX512 level (or above)."""
    return torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")


def amx() -> bool:
    """The CPU has AMX tiles (what makes oneDNN pack bf16 operands for the fused attention)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # private helper; absent in some torch builds
        return False


def hardware_bf16() -> bool:
    """bf16 matmuls in hardware: AMX or AVX512-BF16."""
    try:
        return amx() or bool(torch.cpu._is_avx512_bf16_supported())
    except AttributeError:  # private helper; absent in some torch builds
        return False


def bf16_pays() -> bool:
    """bf16 autocast is faster than fp32 on this CPU (bf16 matmuls in hardware; docs/results.md)."""
    return hardware_bf16() and aten_avx512()


def bf16_fused_attention_ok() -> bool:
    """The fused CPU attention kernels accept bf16 operands here (see the module docstring)."""
    return aten_avx512() or not amx()
