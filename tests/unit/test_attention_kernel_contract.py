"""The CUDA branch of `attention: sdpa`, run on CPU against its kernel's real contract.

eagle3/drafter/attention_kernels.py hands PyTorch's CUDA memory-efficient attention kernel
its inputs through two calls (`mem_efficient_forward`, `mem_efficient_backward`).
Here `MemEfficientEmulator` stands in for those two calls with the kernel's
documented behaviour, read in PyTorch's source (module doc of
eagle3/drafter/attention_kernels.py cites the files):

- forward: out [B, nh, T, D] as a view of [B, T, nh, D] memory; lse [B, nh,
  ceil(T/32)*32], the tail +inf;
- backward: q, k, v with equal head counts; delta = rowsum(dO * O) computed from O
  read at the kernel's own strides: row stride fixed at nh * D, batch and head
  strides from the tensor (`o_strideM()` in kernel_backward.h); lse read in whole
  32-query blocks with its batch and head strides from the tensor, aligned to 8
  (`check_supported`).

The CUDA branch (`CONTEXT_KERNELS["cuda"]`) is routed to CPU tensors by patching
the table, the drafter runs in float64 (the emulator computes in float64 where the
kernel accumulates in float32), and every gradient is compared with the reference
attention's. A read the real kernel would make outside O's storage, or an O whose
fixed-stride read differs from its values, is recorded as a contract violation and
fails the test (never a crash). About 10 s on 2 cores.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from attention_helpers import TOL64, assert_same, batch, loss_and_grads, pair

from eagle3.core.errors import PipelineError
from eagle3.drafter import attention_kernels

LSE_BLOCK = 32  # kAlignLSE in mem_eff_attention/kernel_forward.h


def _causal_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Top-left causal scores in float64: [B, H, M, D] x [B, H, N, D] -> [B, H, M, N]."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    M, N = s.shape[-2:]
    return s.masked_fill(torch.ones(M, N, dtype=torch.bool).triu(1), float("-inf"))


def _storage_numel(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // t.element_size()


def _in_kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, M, D] copied into [B, M, H, D] memory and viewed as [B, H, M, D] (what the kernel allocates)."""
    B, H, M, D = x.shape
    return torch.empty(B, M, H, D, dtype=x.dtype).transpose(1, 2).copy_(x)


class MemEfficientEmulator:
    """`mem_efficient_forward` / `mem_efficient_backward` as the CUDA kernel behaves (module doc).

    Same signatures as the seam's two calls. Contract breaches the real kernel
    raises for (TORCH_CHECK) raise RuntimeError here too; breaches it silently
    computes wrong numbers for are appended to `violations`.
    """

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.calls = {"forward": 0, "backward": 0}

    @staticmethod
    def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # _efficient_attention_backward: TORCH_CHECK(query.size(2) == key.size(2)) in its [B, M, H, K] view
        if not (q.shape[1] == k.shape[1] == v.shape[1]):
            raise RuntimeError(f"mem-efficient attention needs equal head counts, got q {q.shape[1]}, "
                               f"k {k.shape[1]}, v {v.shape[1]}")
        for name, t in (("query", q), ("key", k), ("value", v)):
            if t.stride(-1) != 1:  # CHECK_NOSPARSE_LASTCONTIGUOUS_CUDA
                raise RuntimeError(f"{name} must have a contiguous last dimension, stride {t.stride()}")

    def forward(self, q, k, v, scale):
        self.calls["forward"] += 1
        self._check_heads(q, k, v)
        B, H, M, _ = q.shape
        s = _causal_scores(q, k, scale)  # [B, H, M, N]
        lse = torch.logsumexp(s, dim=-1)  # [B, H, M]
        out = torch.softmax(s, dim=-1) @ v.double()  # [B, H, M, Dv]
        padded = math.ceil(M / LSE_BLOCK) * LSE_BLOCK
        # float64 lse stands in for the kernel's float32 when the inputs are float64
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse_out = torch.full((B, H, padded), float("inf"), dtype=lse_dtype)  # the forward pads with +inf
        lse_out[..., :M] = lse
        seed, offset = torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)
        return _in_kernel_layout(out.to(q.dtype)), lse_out, seed, offset

    def _read_out(self, out: torch.Tensor) -> torch.Tensor:
        """O [B, H, M, Dv] as `computeDelta` reads it: row stride H * Dv, batch/head strides from the tensor."""
        B, H, M, Dv = out.shape
        ot = out.transpose(1, 2)  # the kernel's [B, M, H, Dv] view
        strides = (ot.stride(0), H * Dv, ot.stride(2), 1)
        if out.stride(-1) != 1:
            self.violations.append(f"out's last dimension has stride {out.stride(-1)}; the kernel reads it as 1")
        last = out.storage_offset() + sum((n - 1) * st for n, st in zip((B, M, H, Dv), strides))
        flat = torch.as_strided(out, (_storage_numel(out),), (1,), 0)  # the whole storage
        if last >= flat.numel():
            self.violations.append(f"O read past the end of its storage: element {last} of {flat.numel()} "
                                   f"(out {tuple(out.shape)}, strides {out.stride()})")
            flat = torch.cat([flat, flat.new_zeros(last + 1 - flat.numel())])
        read = torch.as_strided(flat, (B, M, H, Dv), strides, out.storage_offset()).transpose(1, 2)
        if not torch.equal(read, out):
            self.violations.append(f"O read at the kernel's fixed row stride {H * Dv} differs from out's values: "
                                   f"out (strides {out.stride()}) is not in the forward's [B, T, nh, D] memory")
        return read

    def _read_lse(self, lse: torch.Tensor, M: int) -> torch.Tensor:
        """lse [B, H, >= M] read in whole 32-query blocks with the tensor's batch/head strides."""
        B, H = lse.shape[:2]
        padded = math.ceil(M / LSE_BLOCK) * LSE_BLOCK
        sB, sH = lse.stride(0), lse.stride(1)
        # check_supported: TORCH_CHECKs on the lse strides
        if H > 1 and sH % 8:
            raise RuntimeError(f"LSE is not correctly aligned (strideH {sH})")
        if B > 1 and sB % 8:
            raise RuntimeError(f"LSE is not correctly aligned (strideB {sB})")
        if lse.stride(-1) != 1:
            self.violations.append(f"lse's last dimension has stride {lse.stride(-1)}; the kernel reads it as 1")
        last = lse.storage_offset() + (B - 1) * sB + (H - 1) * sH + padded - 1
        flat = torch.as_strided(lse, (_storage_numel(lse),), (1,), 0)
        if last >= flat.numel():
            self.violations.append(f"lse read past the end of its storage: element {last} of {flat.numel()} "
                                   f"(lse {tuple(lse.shape)} needs {padded} per row, the forward's padding)")
            flat = torch.cat([flat, flat.new_full((last + 1 - flat.numel(),), float("nan"))])
        read = torch.as_strided(flat, (B, H, padded), (sB, sH, 1), lse.storage_offset())
        if padded > M and not bool((read[..., M:] == float("inf")).all()):
            self.violations.append("lse's padding past the last query is not +inf, which the forward writes "
                                   "and the backward relies on instead of bound checks")
        return read

    def backward(self, dout, q, k, v, out, lse, seed, offset, scale):
        self.calls["backward"] += 1
        self._check_heads(q, k, v)
        B, H, M, D = q.shape
        o = self._read_out(out)  # [B, H, M, Dv]
        lse_read = self._read_lse(lse, M)[..., :M].double()  # [B, H, M]
        do = dout.double()
        delta = (do * o.double()).sum(-1)  # [B, H, M]: rowsum(dO * O), computed by the kernel
        p = torch.exp(_causal_scores(q, k, scale) - lse_read[..., None])  # [B, H, M, N]
        dv = p.transpose(-1, -2) @ do  # [B, H, N, Dv]
        ds = p * (do @ v.double().transpose(-1, -2) - delta[..., None])  # [B, H, M, N]
        dq = (ds @ k.double()) * scale  # [B, H, M, D]
        dk = (ds.transpose(-1, -2) @ q.double()) * scale  # [B, H, N, D]
        grads = [_in_kernel_layout(g.to(t.dtype)) for g, t in ((dq, q), (dk, k), (dv, v))]
        return (*grads, torch.empty(0, dtype=q.dtype))


@pytest.fixture
def emulated_cuda(monkeypatch) -> MemEfficientEmulator:
    """CPU tensors take the CUDA branch, with the emulator in place of the kernel."""
    emu = MemEfficientEmulator()
    monkeypatch.setitem(attention_kernels.CONTEXT_KERNELS, "cpu", attention_kernels.CONTEXT_KERNELS["cuda"])
    monkeypatch.setattr(attention_kernels, "mem_efficient_forward", emu.forward)
    monkeypatch.setattr(attention_kernels, "mem_efficient_backward", emu.backward)
    return emu


def _qkv(B=2, H=4, M=37, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, M, D, generator=g, dtype=torch.double) for _ in range(3)]


def test_emulator_is_attention_when_fed_its_own_layout():
    """The emulator's forward/backward, fed what its forward returned, equal autograd through plain attention."""
    emu = MemEfficientEmulator()
    q, k, v = _qkv()
    scale = 0.3
    out, lse, seed, offset = emu.forward(q, k, v, scale)
    assert out.transpose(1, 2).is_contiguous()  # [B, T, nh, D] memory
    assert lse.shape == (2, 4, 64) and bool((lse[..., 37:] == float("inf")).all())
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.softmax(_causal_scores(qr, kr, scale), -1) @ vr
    torch.testing.assert_close(out, ref.detach(), **TOL64)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    dq, dk, dv, _ = emu.backward(dout, q, k, v, out, lse, seed, offset, scale)
    assert emu.violations == []
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        torch.testing.assert_close(got, want, **TOL64)


def test_emulator_reads_o_at_the_kernels_fixed_row_stride():
    """An out in [B, nh, T, D] memory: delta is read from the wrong rows (and past the
    end for the last batch and head), so dq/dk go wrong; dv does not read delta."""
    emu = MemEfficientEmulator()
    q, k, v = _qkv()
    out, lse, seed, offset = emu.forward(q, k, v, 0.3)
    dout = torch.randn_like(out)
    good = emu.backward(dout, q, k, v, out, lse, seed, offset, 0.3)
    bad = emu.backward(dout, q, k, v, out.contiguous(), lse, seed, offset, 0.3)
    assert any("differs from out's values" in m for m in emu.violations)
    assert any("past the end" in m for m in emu.violations)
    torch.testing.assert_close(bad[2], good[2], **TOL64)
    for i in (0, 1):
        rel = float((bad[i] - good[i]).norm() / good[i].norm())
        assert rel > 1e-3, rel


# (nkv, K, layout): MHA / GQA / MQA; step 0 alone (K = 1) and steps >= 1 (K = 3);
# whole rows, right-padded rows (one run per row) and packed rows (several runs per row).
CASES = {
    "mha-step0": (4, 1, "rows"),
    "mha-steps": (4, 3, "rows"),
    "gqa-steps": (2, 3, "rows"),
    "mqa-steps-right-padded": (1, 3, "right-padded"),
    "gqa-packed-step0": (2, 1, "packed"),
    "gqa-packed-steps": (2, 3, "packed"),
    "mha-packed-left-padded-steps": (4, 2, "left-padded"),
}


def _layout(kind: str, B: int, T: int) -> dict:
    if kind == "rows":
        return {}
    mask = torch.ones(B, T, dtype=torch.long)
    if kind == "right-padded":
        mask[1, T - 9:] = 0
        return dict(attention_mask=mask)
    if kind == "left-padded":
        mask[1, :6] = 0
        return dict(attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    # packed: several samples per row (one longer than a 32-query lse block), a padded tail on row 0
    lengths = [[15, 9, 6, 7], [34, 3]]
    seg = torch.cat([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])[None] for row in lengths])
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    mask[0, 30:] = 0
    return dict(attention_mask=mask, position_ids=pos, segment_ids=seg)


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_branch_gradients_equal_reference_under_the_kernel_contract(case, emulated_cuda):
    """Every gradient (all drafter weights and the aux input) of sdpa's CUDA branch equals the reference's."""
    nkv, K, kind = CASES[case]
    B, T = 2, 37  # T: two 32-query lse blocks, the second partly padding
    new, ref = pair(nkv, seed=nkv + K)
    b = batch(K + 10, B=B, T=T)
    kw = _layout(kind, B, T)
    got, want = loss_and_grads(new, b, K, **kw), loss_and_grads(ref, b, K, **kw)
    assert emulated_cuda.calls["forward"] > 0 and emulated_cuda.calls["backward"] > 0
    worst = sorted(((float((got[1][n] - g).norm() / g.norm()), n) for n, g in want[1].items()), reverse=True)[:3]
    assert emulated_cuda.violations == [], (f"kernel contract broken (largest relative gradient errors "
                                            f"{[f'{n} {e:.1e}' for e, n in worst]}): {emulated_cuda.violations[:3]}")
    assert_same(got, want, TOL64)


def test_context_kernel_refuses_a_device_without_one():
    with pytest.raises(PipelineError, match="--attention reference"):
        attention_kernels.context_kernel(torch.device("meta"))


def _defect1_backward(dout, q, k, v, out, lse, scale, saved):
    """The CUDA branch's backward as it was before the layout fix: `out` and lse handed over as they come."""
    seed, offset, lse_len = saved
    G = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    lse_pad = F.pad(lse, (0, lse_len - lse.shape[-1]))
    dq, dk, dv, _ = attention_kernels.mem_efficient_backward(dout, q, ke, ve, out, lse_pad, seed, offset, scale)
    B, nkv, T, D = k.shape
    return dq, dk.reshape(B, nkv, G, T, D).sum(2), dv.reshape(B, nkv, G, T, D).sum(2)


def _bench_memory():
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_memory.py"
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("packed", [False, True], ids=["whole-rows", "packed-rows"])
def test_gpu_check_tolerance_passes_the_cuda_branch_and_fails_defect_1(packed, emulated_cuda, monkeypatch):
    """bench/bench_memory.py --cuda's attention check, run on the emulated CUDA branch under
    bf16 autocast: PASS as the branch is, FAIL with defect 1's layout (K = 2 here for time;
    the bench runs K = 7, where the margins are alike: its module doc)."""
    bench, cpu = _bench_memory(), torch.device("cpu")
    ok, line = bench.judge_attention(bench.attention_grad_errors(cpu, packed, 2), "x", cpu)
    assert ok and line.startswith("PASS"), line
    assert emulated_cuda.violations == [], emulated_cuda.violations[:3]
    cuda = attention_kernels.CONTEXT_KERNELS["cuda"]
    monkeypatch.setitem(attention_kernels.CONTEXT_KERNELS, "cpu",
                        attention_kernels.ContextKernel(cuda.forward, _defect1_backward))
    ok, line = bench.judge_attention(bench.attention_grad_errors(cpu, packed, 2), "x", cpu)
    assert not ok and line.startswith("FAIL") and "_proj.weight" in line, line
