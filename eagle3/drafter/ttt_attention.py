"""Train-time-test attention: step k's queries against the keys of steps 0..k.

A `TTTCache` carries each draft step's keys/values over one batch, so that step k at
position t attends to step 0's keys at positions <= t (the causal context) plus steps
1..k's keys at position t (one key each, a diagonal). Two implementations, chosen by
`Eagle3Drafter(attention=...)` (eagle3/drafter/model.py):

    sdpa       (default) `merged_attention`: step 0's keys through a fused causal
               kernel that returns its log-sum-exp (behind the seams of
               eagle3/drafter/attention_kernels.py), steps 1..k merged into that result
               by log-sum-exp (`MergedTTTAttention`); autograd keeps O(T) per step.
    reference  `reference_attention`: one [T, T + k] fp32 score block per step, kept by
               autograd for backward (O(T^2) per step). Tests compare against it.

Who may attend to whom comes in as an `AttnLayout`: the reference reads a [B, T, T]
mask (`allowed_mask`), sdpa reads the spans attended causally among themselves
(`attention_runs`; None = whole rows, the common case).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from eagle3.drafter.attention_kernels import context_kernel
from eagle3.drafter.cpu import bf16_fused_attention_ok


@dataclass
class TTTCache:
    """Keys/values of the draft steps run so far over one batch; step k is entry k.

    keys[0]/values[0] are step 0's over all T positions (the causal context);
    keys[j]/values[j] for j >= 1 are step j's, each only ever attended at its own
    position. Each entry is [B, n_kv, T, D]; nothing here is O(T^2).
    """

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.keys)


def reference_attention(q: Tensor, cache: TTTCache, allowed: Tensor, scale: float) -> Tensor:
    """Attention of the newest step's queries against the cache.

    q: [B, n_kv, G, T, D] (G query heads share one kv head); allowed: [B, T, T] bool,
    the context mask for step 0's keys (causal and not padding).
    Step k at position t sees step 0's keys at s <= t (one [T, T] score block) and
    steps 1..k's keys at t only (k scores per position, a diagonal): one softmax
    over the concatenation, without a [T, k*T] mask. Autograd keeps each step's
    [T, T] block for backward (K blocks per unroll); checkpoint steps or shorten T
    if that does not fit.
    """
    B, n_kv, G, T, D = q.shape
    k0, v0 = cache.keys[0], cache.values[0]
    # [B, n_kv, G*T, D] @ [B, n_kv, D, T] -> [B, n_kv, G*T, T]: all G heads of a group share k0.
    ctx = (q.reshape(B, n_kv, G * T, D) @ k0.transpose(-1, -2)) * scale
    acc = torch.promote_types(ctx.dtype, torch.float32)  # softmax in at least fp32
    ctx = ctx.view(B, n_kv, G, T, T).to(acc)  # [B, n_kv, G*T, T] -> [B, n_kv, G, T, T]
    ctx = ctx.masked_fill(~allowed[:, None, None], float("-inf"))  # mask [B, T, T] -> [B, 1, 1, T, T]
    n_diag = cache.num_steps - 1
    if n_diag == 0:
        probs = torch.softmax(ctx, dim=-1).to(v0.dtype)
        out = probs.reshape(B, n_kv, G * T, T) @ v0  # [B, n_kv, G*T, T] @ [B, n_kv, T, D] -> [B, n_kv, G*T, D]
        return out.view(B, n_kv, G, T, D)  # [B, n_kv, G*T, D] -> [B, n_kv, G, T, D]
    kd = torch.stack(cache.keys[1:], dim=3)  # k x [B, n_kv, T, D] -> [B, n_kv, T, k, D]
    vd = torch.stack(cache.values[1:], dim=3)  # k x [B, n_kv, T, D] -> [B, n_kv, T, k, D]
    diag = torch.einsum("bhgtd,bhtkd->bhgtk", q, kd).to(acc) * scale  # -> [B, n_kv, G, T, k]
    scores = torch.cat([ctx, diag], dim=-1)  # -> [B, n_kv, G, T, T + k]
    probs = torch.softmax(scores, dim=-1).to(v0.dtype)
    p_ctx = probs[..., :T].reshape(B, n_kv, G * T, T)  # [B, n_kv, G, T, T] -> [B, n_kv, G*T, T]
    out = (p_ctx @ v0).view(B, n_kv, G, T, D)  # [B, n_kv, G*T, T] @ [B, n_kv, T, D] -> [B, n_kv, G, T, D]
    out = out + torch.einsum("bhgtk,bhtkd->bhgtd", probs[..., T:], vd)  # diagonal values, [B, n_kv, G, T, D]
    return out


# -- linear-memory TTT attention (the default) ---------------------------------------
# Runs: (row, start, end) spans of a batch whose tokens attend causally among
# themselves only. None = every row is one run over all T positions (the common case,
# one kernel call for the whole batch).
Runs = list[tuple[int, int, int]] | None


def _diag_scores(q: Tensor, kd: Tensor, scale: float) -> Tensor:
    """Same-position scores q[t] . kd[t]: q [B, nh, T, D], kd [B, n_kv, T, D] -> [B, nh, T], at least fp32."""
    B, nh, T, D = q.shape
    nkv = kd.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    # A product and a sum, not einsum: autocast would run einsum's matmul in bf16.
    s = (q.view(B, nkv, nh // nkv, T, D).to(acc) * kd.to(acc)[:, :, None]).sum(-1)  # -> [B, n_kv, G, T]
    return s.reshape(B, nh, T) * scale


def _grouped(x: Tensor, nkv: int) -> Tensor:
    """[B, nh, T, ...] -> [B, n_kv, G, T, ...] (query head i*G + j uses kv head i)."""
    return x.view(x.shape[0], nkv, x.shape[1] // nkv, *x.shape[2:])


class MergedTTTAttention(torch.autograd.Function):
    """Step k's attention: causal context (step 0's keys) + k same-position keys, one softmax.

    forward(q [B, nh, T, D], k0, v0 [B, n_kv, T, D], scale, runs, k1..kk, v1..vk [B, n_kv, T, D])
    -> [B, nh, T, D]. Saves the inputs (the cache's own tensors, no copies), the
    merged output and its lse [B, nh, T]: O(T) per step.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, scale, runs, *diag):
        n = len(diag) // 2
        kd, vd = diag[:n], diag[n:]
        B, nh, T, D = q.shape
        nkv = k0.shape[1]
        acc_t = torch.promote_types(q.dtype, torch.float32)  # softmax bookkeeping in at least fp32
        kernel = context_kernel(q.device)  # the fused kernel pair (eagle3/drafter/attention_kernels.py)
        if runs is None:
            o0, lse0, saved = kernel.forward(q, k0, v0, scale)
            saves = [saved]
        else:
            # Packed rows: one kernel call per sample span; positions in no span (none
            # with the layouts `attention_runs` builds) would keep lse -inf and out 0.
            o0 = q.new_zeros(q.shape)
            lse0 = q.new_full((B, nh, T), float("-inf"), dtype=acc_t)
            saves = []
            for b, a, e in runs:
                o, lse, saved = kernel.forward(q[b:b + 1, :, a:e], k0[b:b + 1, :, a:e], v0[b:b + 1, :, a:e], scale)
                o0[b:b + 1, :, a:e] = o
                lse0[b:b + 1, :, a:e] = lse
                saves.append(saved)
        if n == 0:
            out, lse = o0, lse0.to(acc_t)
        else:
            s = torch.stack([_diag_scores(q, k, scale) for k in kd])  # n x [B, nh, T] -> [n, B, nh, T]
            lse = torch.logsumexp(torch.cat([lse0.to(acc_t)[None], s]), dim=0)  # [n+1, B, nh, T] -> [B, nh, T]
            acc = torch.exp(lse0.to(acc_t) - lse)[..., None] * o0.to(acc_t)  # context share, [B, nh, T, D]
            acc = _grouped(acc, nkv)  # -> [B, n_kv, G, T, D]
            for j in range(n):
                p = _grouped(torch.exp(s[j] - lse), nkv)  # [B, nh, T] -> [B, n_kv, G, T]
                acc = acc + p[..., None] * vd[j].to(acc_t)[:, :, None]  # [B, n_kv, 1, T, D] broadcast over G
            out = acc.reshape(B, nh, T, D).to(q.dtype)
        ctx.kernel, ctx.scale, ctx.runs, ctx.n, ctx.saves = kernel, scale, runs, n, saves
        ctx.save_for_backward(q, k0, v0, out, lse, *diag)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, out, lse, *diag = ctx.saved_tensors
        n, scale, runs = ctx.n, ctx.scale, ctx.runs
        kd, vd = diag[:n], diag[n:]
        B, nh, T, D = q.shape
        nkv = k0.shape[1]
        dout = dout.contiguous().to(q.dtype)
        acc_t = lse.dtype
        # The kernel's backward fed the merged out/lse returns the context keys' share
        # of the merged softmax's gradients (as ring attention does); each kernel's
        # seam hands out/lse over in the layout that kernel reads.
        if runs is None:
            dq, dk0, dv0 = ctx.kernel.backward(dout, q, k0, v0, out, lse, scale, ctx.saves[0])
        else:
            dq, dk0, dv0 = torch.zeros_like(q), torch.zeros_like(k0), torch.zeros_like(v0)
            for (b, a, e), saved in zip(runs, ctx.saves):
                sl = (slice(b, b + 1), slice(None), slice(a, e))
                g = ctx.kernel.backward(dout[sl].contiguous(), q[sl], k0[sl], v0[sl], out[sl],
                                        lse[sl].contiguous(), scale, saved)
                dq[sl], dk0[sl], dv0[sl] = g
        if n == 0:
            return dq, dk0, dv0, None, None
        # Diagonal keys: p_j = exp(s_j - lse); ds_j = p_j * (dout . v_j - rowsum(dout * out)).
        dout_f = _grouped(dout.to(acc_t), nkv)  # [B, n_kv, G, T, D]
        q_f = _grouped(q.to(acc_t), nkv)
        delta = (dout_f * _grouped(out.to(acc_t), nkv)).sum(-1)  # [B, n_kv, G, T]
        lse_g = _grouped(lse, nkv)
        dkd, dvd = [], []
        dq_g = _grouped(dq.to(acc_t), nkv)
        for j in range(n):
            kj, vj = kd[j].to(acc_t)[:, :, None], vd[j].to(acc_t)[:, :, None]  # [B, n_kv, 1, T, D]
            s = (q_f * kj).sum(-1) * scale  # [B, n_kv, G, T]
            p = torch.exp(s - lse_g)
            ds = p * ((dout_f * vj).sum(-1) - delta)  # [B, n_kv, G, T]
            dq_g = dq_g + scale * ds[..., None] * kj
            dkd.append((scale * ds[..., None] * q_f).sum(2).to(kd[j].dtype))  # sum over G -> [B, n_kv, T, D]
            dvd.append((p[..., None] * dout_f).sum(2).to(vd[j].dtype))
        dq = dq_g.reshape(B, nh, T, D).to(q.dtype)
        return (dq, dk0, dv0, None, None, *dkd, *dvd)


def merged_attention(q: Tensor, cache: TTTCache, runs: Runs, scale: float) -> Tensor:
    """The default: q [B, nh, T, D] -> [B, nh, T, D], saved state O(T) per step."""
    dtype = q.dtype
    if q.device.type == "cpu" and dtype == torch.bfloat16 and not bf16_fused_attention_ok():
        dtype = torch.float32  # the fused CPU kernel refuses bf16 here (eagle3/drafter/cpu.py)
    ks = [k.to(dtype) for k in cache.keys]
    vs = [v.to(dtype) for v in cache.values]
    out = MergedTTTAttention.apply(q.to(dtype), ks[0], vs[0], scale, runs, *ks[1:], *vs[1:])
    return out.to(q.dtype)


def allowed_mask(B: int, T: int, attention_mask: Tensor | None, segment_ids: Tensor | None,
                  device: torch.device) -> Tensor:
    """The reference's context mask [B, T, T]: causal, within one sample, real keys."""
    allowed = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)  # causal, [T, T] -> [B, T, T]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])  # block-diagonal, [B, T, T]
    if attention_mask is not None:
        # Padding keys are hidden, but a query always keeps its own key so a
        # padded row's softmax never sees only -inf (no NaN to leak into grads).
        eye = torch.eye(T, dtype=torch.bool, device=device)
        allowed = allowed & (attention_mask.bool()[:, None, :] | eye)  # [B, T, T] & [B, 1, T] -> [B, T, T]
    return allowed


def attention_runs(attention_mask: Tensor | None, segment_ids: Tensor | None, T: int) -> Runs:
    """Spans attended causally among themselves: a row splits where segment_ids or
    realness changes, except that right padding joins the run before it (its queries
    carry no loss and only ever read real keys before them, so any finite value does)."""
    if segment_ids is None and (attention_mask is None
                                or bool((attention_mask[:, 1:].int() <= attention_mask[:, :-1].int()).all())):
        return None  # one causal run per row; right padding needs nothing more
    shape = (segment_ids if segment_ids is not None else attention_mask).shape
    seg = segment_ids.cpu().long() if segment_ids is not None else torch.zeros(shape, dtype=torch.long)
    real = attention_mask.cpu().bool() if attention_mask is not None else torch.ones(shape, dtype=torch.bool)
    key = seg * 2 + (~real).long()  # [B, T]: a new run wherever this changes; odd = padding
    runs = []
    for b, row in enumerate(key):
        starts = [0] + ((row[1:] != row[:-1]).nonzero()[:, 0] + 1).tolist()
        ends = starts[1:] + [T]
        for a, e in zip(starts, ends):
            if e == T and a > 0 and int(row[a]) % 2 == 1:  # right padding joins the run before it
                runs[-1] = (b, runs[-1][1], T)
            else:
                runs.append((b, a, e))
    return runs


ATTENTION_IMPLS = ("sdpa", "reference")


@dataclass
class AttnLayout:
    """Who may attend to whom in one batch, in the form the chosen implementation reads.

    reference: `allowed [B, T, T]` bool (causal, same sample, real keys);
    sdpa: `runs`, the spans attended causally among themselves (None = whole rows).
    """

    allowed: Tensor | None = None
    runs: Runs = None
