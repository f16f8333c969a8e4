"""The fused attention kernels behind `attention: sdpa`: one seam per device type.

`MergedTTTAttention` (eagle3/drafter/ttt_attention.py) streams step 0's causal context through a
fused kernel that returns its log-sum-exp, and hands that kernel's backward the
*merged* output and log-sum-exp (context plus same-position keys). Each device
type's forward/backward pair lives here, picked by `context_kernel(device)` from the
table `CONTEXT_KERNELS`; nothing here reads or writes files.

    cpu   aten._scaled_dot_product_flash_attention_for_cpu and its backward: grouped
          kv heads go in as they are, `out` in any memory layout.
    cuda  aten._scaled_dot_product_efficient_attention and its backward (PyTorch's
          cutlass memory-efficient kernel), through `mem_efficient_forward` and
          `mem_efficient_backward`, the only two calls into it.

The CUDA kernel's contract, read in PyTorch's source (aten/src/ATen/native/
transformers/cuda/attention.cu, attention_backward.cu, mem_eff_attention/
kernel_forward.h and kernel_backward.h) and in torch 2.13's meta functions
(torch/_meta_registrations.py, `meta__scaled_dot_product_efficient_attention` and
`..._backward`):

- q, k and v have the same head count (`TORCH_CHECK(query.size(2) == key.size(2))`
  in `_efficient_attention_backward`): grouped kv heads are repeated to nh here and
  their gradients summed back over each group.
- The forward returns `out` [B, nh, T, D] as a transposed view of [B, T, nh, D]
  memory, and `lse` [B, nh, ceil(T/32)*32] float32 whose tail is +inf
  (`kAlignLSE = 32`; "we pad logsumexp with `inf`" so that the backward can skip
  bound checks).
- The backward, for fp16/bf16 (`kKernelComputesDelta = kIsHalf && (kOutputInRF ||
  arch != sm70)`: every GPU that trains in bf16), computes delta = rowsum(dO * O)
  itself (`computeDelta`) and reads O at a row stride fixed
  at `o_strideM() = head_dim_value * num_heads`; only O's batch and head strides
  come from the tensor (`p.o_strideB = out.stride(0)`, `p.o_strideH = out.stride(2)`
  in its [B, T, nh, D] view). So O must lie in the forward's [B, T, nh, D] memory:
  any other layout gives wrong gradients and no error. fp32 and the CPU kernel
  compute delta with stride-aware tensor ops, which is why no CPU or fp32 run shows it.
- The backward reads lse in whole blocks of 32 queries (`accumApplyLSEToSmem`) with
  batch and head strides from the tensor (each a multiple of 8, `check_supported`):
  hand it the forward's own length (ROCm builds do not pad, per the meta function),
  padded as the forward pads (+inf).

tests/unit/test_attention_kernel_contract.py patches this table and the two call
functions to run the CUDA branch on CPU against an emulator of that contract.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3.core.errors import PipelineError

# What a kernel's forward keeps for its own backward besides q/k/v/out/lse.
Saved = tuple


def mem_efficient_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The one call into the CUDA memory-efficient forward: causal, no bias, no dropout, with lse.

    q/k/v [B, nh, T, D] (equal head counts) -> out [B, nh, T, D] in [B, T, nh, D] memory,
    lse [B, nh, ceil(T/32)*32] float32, philox seed and offset (unused without dropout).
    """
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True, scale=scale)


def mem_efficient_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           seed: Tensor, offset: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The one call into the CUDA memory-efficient backward (module doc: what `out` and `lse` must be).

    -> dq, dk, dv [B, nh, T, D] and an undefined bias gradient.
    """
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True, scale=scale)


def _flash_cpu_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Saved]:
    # Grouped kv heads as they are: query head i reads kv head i // G.
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _flash_cpu_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                        saved: Saved) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, True, scale=scale)


def _repeat_kv(k: Tensor, v: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """[B, n_kv, T, D] -> [B, nh, T, D]: query head i reads kv head i // G, as in `_grouped`."""
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _mem_efficient_context_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Saved]:
    ke, ve = _repeat_kv(k, v, q.shape[1] // k.shape[1])  # [B, n_kv, T, D] -> [B, nh, T, D]
    out, lse, seed, offset = mem_efficient_forward(q, ke, ve, scale)
    T = q.shape[2]
    return out, lse[..., :T], (seed, offset, lse.shape[-1])  # lse [B, nh, ceil(T/32)*32] -> [B, nh, T]


def _mem_efficient_context_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                    scale: float, saved: Saved) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset, lse_len = saved  # lse_len: the forward's own lse length (ROCm builds do not pad)
    B, nkv, T, D = k.shape
    G = q.shape[1] // nkv
    ke, ve = _repeat_kv(k, v, G)  # [B, n_kv, T, D] -> [B, nh, T, D]
    # The kernel reads O's rows at a stride fixed at nh*D (module doc): the forward's
    # [B, T, nh, D] memory. A merged `out` (steps >= 1) or a packed row's span lies in
    # [B, nh, T, D] memory; the kernel's own step-0 output is in place and not copied.
    out_k = out.transpose(1, 2).contiguous().transpose(1, 2)  # [B, nh, T, D] viewing [B, T, nh, D] memory
    lse_k = F.pad(lse, (0, lse_len - T), value=math.inf)  # [B, nh, T] -> [B, nh, ceil(T/32)*32], as the forward pads
    dq, dk, dv, _ = mem_efficient_backward(dout, q, ke, ve, out_k, lse_k, seed, offset, scale)
    # [B, nh, T, D] -> [B, n_kv, G, T, D] -> sum over the G query heads that read each kv head
    return dq, dk.reshape(B, nkv, G, T, D).sum(2), dv.reshape(B, nkv, G, T, D).sum(2)


@dataclass(frozen=True)
class ContextKernel:
    """One device type's fused causal attention over step 0's keys.

    forward(q [B, nh, T, D], k, v [B, n_kv, T, D], scale) -> out [B, nh, T, D],
        lse [B, nh, T] (natural log of the scaled scores' exp-sum), what backward needs.
    backward(dout, q, k, v, out, lse, scale, saved) -> dq [B, nh, T, D], dk, dv
        [B, n_kv, T, D]. Probabilities are rebuilt as exp(score - lse) and delta is
        rowsum(dout * out), so fed the merged out/lse it returns the context keys'
        share of the merged softmax's gradients.
    """

    forward: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor, Saved]]
    backward: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float, Saved], tuple[Tensor, Tensor, Tensor]]


CONTEXT_KERNELS: dict[str, ContextKernel] = {
    "cpu": ContextKernel(_flash_cpu_forward, _flash_cpu_backward),
    "cuda": ContextKernel(_mem_efficient_context_forward, _mem_efficient_context_backward),
}


def context_kernel(device: torch.device) -> ContextKernel:
    """The fused kernel pair for tensors on `device`; refuses device types without one."""
    kernel = CONTEXT_KERNELS.get(device.type)
    if kernel is None:
        raise PipelineError(f"attention 'sdpa' runs on {sorted(CONTEXT_KERNELS)}, not {device.type}; "
                            f"pass --attention reference on this device.")
    return kernel
