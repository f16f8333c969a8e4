"""The loss of each train-time-test step, chosen by stage 04's `--loss`, and the held-out
acceptance under sampling. Pure tensors: reads and writes nothing.

`ttt_loss` (eagle3/drafter/ttt.py) calls `step_loss` once per draft step with the step's
logits at its N loss-carrying positions and the rows of the label table those positions
predict; the loss it returns is a mean over the N positions, which `ttt_loss` weights by
step_decay ** k. At one position p is the label (the target's softmax over the draft rows,
renormalised: docs/CONVENTIONS.md §4), q = softmax(z) the drafter's distribution over the
same rows, and alpha = sum_i min(p_i, q_i) their overlap, the probability that speculative
sampling accepts a token drawn from q (docs/LEVERS.md, "The loss").

    kl         cross-entropy H(p, q) = KL(p || q) + H(p), computed by `soft_cross_entropy`
               exactly as before this module existed (the default: bitwise the same runs).
               H(p) does not depend on the drafter: the gradient is KL's, the value is CE's
    tv         total variation 1 - alpha (= |p - q|_1 / 2): the rejection probability
    lk_alpha   LK^alpha of the LK losses paper (arXiv 2602.23881): the mean over positions of
               -log alpha, with alpha floored at ALPHA_FLOOR (a position whose overlap
               underflows to 0 then carries no gradient instead of an infinite loss)
    lk_lambda  LK^lambda: lam * kl + (1 - lam) * tv with lam = exp(-eta * sg(mean alpha)): one
               weight per step and micro-batch, from the mean overlap of its positions,
               without gradient (KL while the drafter is far from the target, TV once close)
    a mix      "kl:0.1,tv:0.9": the weighted sum of those terms (weights as given, not
               normalised; a term without a weight weighs 1)

Plain `kl` is `soft_cross_entropy`; every other choice goes through `row_statistics`: one pass over blocks of rows gives
each position's cross-entropy and overlap, and one pass in backward their gradient
(d alpha / dz_j = q_j (s_j - sum_i s_i q_i), s_i = 1 where q_i < p_i), without keeping any
[N, V] tensor between the passes, as `soft_cross_entropy` does.

`sampling_acceptance` is the held-out metric: the same overlap against the target's
unrenormalised probabilities, m * p with m the draft vocabulary's share of the target's
full-vocabulary mass, so the mass the drafter can never propose counts as rejected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from eagle3.core.config import closest
from eagle3.core.errors import PipelineError

LOSSES = ("kl", "tv", "lk_alpha", "lk_lambda")
ALPHA_FLOOR = 1e-6  # lk_alpha's -log alpha is at most 13.8 per position
BLOCK_ROWS = 128  # CPU: rows of the [rows, V] fp32 blocks, which then stay in cache (1-2 MB for V of 2K-4K)
GPU_BLOCK_ELEMENTS = 1 << 26  # GPU: blocks of up to 256 MB in fp32 (fewer, larger kernels)
SYNTAX = "a loss name (kl, tv, lk_alpha, lk_lambda) or a weighted mix of them such as kl:0.1,tv:0.9"


def block_rows(logits: Tensor) -> int:
    if logits.device.type == "cpu":
        return BLOCK_ROWS
    return max(BLOCK_ROWS, GPU_BLOCK_ELEMENTS // max(1, logits.shape[-1]))


class _SoftCrossEntropy(torch.autograd.Function):
    """sum_i CE(p_i, softmax(z_i)) over rows i, as a scalar: the `kl` loss of a draft step.

    logits z [N, V] (bf16 under autocast) and the target rows p_i = table[rows[i]] of
    `table` [M, V]. Equal to `-(p * log_softmax(z.float())).sum()`, written as
    sum_i (|p_i| lse(z_i) - p_i . z_i) with |p_i| = sum_j p_ij, whose gradient is
    |p_i| softmax(z_i) - p_i. Computed in blocks of rows (`block_rows`), each upcast
    to at least fp32 in cache: stage 04 on CPU is bound by memory traffic, and the
    composed form makes and rereads about ten [N, V] fp32 tensors per step (upcast
    logits, gathered targets, log-softmax, product and their gradients). This reads
    logits and target rows once each way and writes one gradient in the logits' dtype
    (what the upcast's backward would have cast it to).
    """

    @staticmethod
    def forward(ctx, logits: Tensor, table: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(logits.dtype, torch.float32)
        N = logits.shape[0]
        lse = torch.empty(N, dtype=acc, device=logits.device)
        mass = torch.empty(N, dtype=acc, device=logits.device)
        argmax = torch.empty(N, dtype=torch.long, device=logits.device)
        total = logits.new_zeros((), dtype=acc)
        step = block_rows(logits)
        for s in range(0, N, step):
            e = s + step
            z = logits[s:e].to(acc)  # [c, V]
            p = table[rows[s:e]]  # [c, V]
            lse[s:e] = torch.logsumexp(z, dim=-1)
            mass[s:e] = p.sum(dim=-1)  # 1 up to rounding
            argmax[s:e] = z.argmax(dim=-1)  # the upcast is exact: the argmax of the logits as given
            total = total + (mass[s:e] * lse[s:e]).sum() - (p * z).sum()
        ctx.save_for_backward(logits, table, rows, lse, mass)
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx, grad: Tensor, _argmax_grad: None):
        logits, table, rows, lse, mass = ctx.saved_tensors
        out = torch.empty_like(logits)
        step = block_rows(logits)
        for s in range(0, logits.shape[0], step):
            e = s + step
            g = torch.exp(logits[s:e].to(lse.dtype) - lse[s:e, None])  # softmax(z), [c, V]
            g.mul_(mass[s:e, None]).sub_(table[rows[s:e]]).mul_(grad)
            out[s:e] = g
        return out, None, None


def soft_cross_entropy(logits: Tensor, table: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy of the target distributions `table[rows]` [N, V] under `logits`
    [N, V], in at least fp32 (no gradient to the targets), and the logits' argmax [N]
    (the metrics' draft tokens, taken while each block is in cache)."""
    return _SoftCrossEntropy.apply(logits, table, rows)


@dataclass(frozen=True)
class LossSpec:
    """The loss of every draft step: weighted terms from LOSSES, and lk_lambda's eta."""

    terms: tuple[tuple[str, float], ...] = (("kl", 1.0),)
    lk_eta: float = 3.0

    @classmethod
    def parse(cls, text: str, lk_eta: float = 3.0, source: str = "--loss") -> "LossSpec":
        """`kl`, `lk_lambda`, `kl:0.1,tv:0.9`, ... -> LossSpec; a clear error otherwise."""
        given = str(text)
        if not math.isfinite(float(lk_eta)) or float(lk_eta) < 0:
            raise PipelineError(f"--lk-eta = {lk_eta!r}: lk_lambda's eta must be a finite number >= 0 (the "
                                f"paper's and the peers' default is 3.0; 0 makes lk_lambda plain kl).")
        terms: list[tuple[str, float]] = []
        for item in given.replace(" ", "").split(","):
            name, sep, weight_text = item.partition(":")
            if not name:
                raise PipelineError(f"{source} {given!r}: an empty term; pass {SYNTAX}.")
            if name not in LOSSES:
                raise PipelineError(f"{source} {given!r}: unknown loss {name!r}{closest(name, LOSSES)}; pass "
                                    f"{SYNTAX}.")
            try:
                weight = float(weight_text) if sep else 1.0
            except ValueError:
                raise PipelineError(f"{source} {given!r}: the weight of {name} is {weight_text!r}, not a number; "
                                    f"pass {SYNTAX}.") from None
            if not (math.isfinite(weight) and weight > 0):
                raise PipelineError(f"{source} {given!r}: the weight of {name} is {weight_text}; weights must be "
                                    f"finite and > 0 (leave a term out instead of weighting it 0).")
            if name in dict(terms):
                raise PipelineError(f"{source} {given!r}: {name} is named twice; give each loss once with its "
                                    f"summed weight.")
            terms.append((name, weight))
        return cls(tuple(terms), float(lk_eta))

    def __str__(self) -> str:
        """The canonical text (what the manifest records): `kl`, `kl:0.1,tv:0.9`."""
        if len(self.terms) == 1 and self.terms[0][1] == 1.0:
            return self.terms[0][0]
        return ",".join(f"{name}:{weight:g}" for name, weight in self.terms)

    @property
    def plain_kl(self) -> bool:
        """Today's loss alone: computed by `soft_cross_entropy`, bitwise as before."""
        return self.terms == (("kl", 1.0),)


class _RowStatistics(torch.autograd.Function):
    """Per row i: the cross-entropy |p_i| lse(z_i) - p_i . z_i and the overlap
    sum_j min(p_ij, softmax(z_i)_j), with p_i = table[rows[i]]; and the logits' argmax.

    logits z [N, V] (bf16 under autocast), the target rows of `table` [M, V]. Blocks of rows
    are upcast to at least fp32 in cache (`block_rows`); the gradient is written once, in the
    logits' dtype, as `soft_cross_entropy` does. Ties q_ij == p_ij count as min = p_ij.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, table: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # a loss without a cross-entropy (or overlap) term skips its part
        acc = torch.promote_types(logits.dtype, torch.float32)
        N = logits.shape[0]
        lse = torch.empty(N, dtype=acc, device=logits.device)
        mass = torch.empty(N, dtype=acc, device=logits.device)
        cross = torch.empty(N, dtype=acc, device=logits.device)
        overlap = torch.empty(N, dtype=acc, device=logits.device)
        argmax = torch.empty(N, dtype=torch.long, device=logits.device)
        step = block_rows(logits)
        for s in range(0, N, step):
            e = s + step
            z = logits[s:e].to(acc)  # [c, V]; may be the logits themselves (fp32): never written
            p = table[rows[s:e]]  # [c, V]
            top, argmax[s:e] = z.max(dim=-1)  # the upcast is exact: the argmax of the logits as given
            q = (z - top[:, None]).exp_()  # [c, V], softmax(z) once scaled
            total = q.sum(dim=-1)
            lse[s:e] = top + total.log()
            q.div_(total[:, None])
            mass[s:e] = p.sum(dim=-1)  # 1 up to rounding
            cross[s:e] = mass[s:e] * lse[s:e] - (p * z).sum(dim=-1)
            overlap[s:e] = torch.minimum(q, p, out=q).sum(dim=-1)
        ctx.save_for_backward(logits, table, rows, lse, mass)
        ctx.mark_non_differentiable(argmax)
        return cross, overlap, argmax

    @staticmethod
    def backward(ctx, grad_cross: Tensor | None, grad_overlap: Tensor | None, _argmax_grad: None):
        logits, table, rows, lse, mass = ctx.saved_tensors
        out = torch.empty_like(logits)
        step = block_rows(logits)
        in_place = out.dtype == lse.dtype  # fp32 logits: the gradient is built in `out` itself, no copy
        for s in range(0, logits.shape[0], step):
            e = s + step
            q = torch.sub(logits[s:e].to(lse.dtype), lse[s:e, None], out=out[s:e] if in_place else None)
            q.exp_()  # softmax(z), [c, V]
            p = table[rows[s:e]]  # [c, V]
            # d cross / dz = |p| q - p;  d overlap / dz = s q - q (s . q), s_j = [q_j < p_j]
            coef = torch.zeros_like(lse[s:e, None])  # [c, 1]: what multiplies q
            if grad_overlap is not None:
                go = grad_overlap[s:e, None]
                # s q, s = [q < p]: where min(p, q) is q. sign(relu(p - q)) is that mask as a float, made
                # by four cheap passes: torch.where on a bool mask is ten times slower on CPU (torch 2.13)
                below = (p - q).clamp_(min=0).sign_().mul_(q)
                coef -= go * below.sum(dim=-1, keepdim=True)
            if grad_cross is not None:
                gc = grad_cross[s:e, None]
                coef += gc * mass[s:e, None]
            g = q.mul_(coef)
            if grad_overlap is not None:
                g.addcmul_(below, go)
            if grad_cross is not None:
                g.addcmul_(p, gc, value=-1.0)
            if not in_place:
                out[s:e] = g
        return out, None, None


def row_statistics(logits: Tensor, table: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row cross-entropy [N] and overlap [N] of the target rows `table[rows]` [N, V] under
    `logits` [N, V], in at least fp32, differentiable in the logits; and the argmax [N]."""
    return _RowStatistics.apply(logits, table, rows)


def step_loss(spec: LossSpec, logits: Tensor, table: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One draft step's loss over its N positions (logits [N, V_d], labels `table[rows]`).

    Returns (loss: the mean over the N positions, differentiable; the mean cross-entropy,
    detached, which every loss reports; the draft argmax [N]). No position: all zero.
    """
    count = max(rows.numel(), 1)
    if spec.plain_kl:
        ce_sum, pred = soft_cross_entropy(logits, table, rows)
        loss = ce_sum / count  # the same operations as before `--loss` existed: bitwise the same runs
        return loss, loss.detach(), pred
    cross, overlap, pred = row_statistics(logits, table, rows)
    ce = cross.sum() / count
    tv = (1.0 - overlap).sum() / count
    loss = ce.new_zeros(())
    for name, weight in spec.terms:
        if name == "kl":
            term = ce
        elif name == "tv":
            term = tv
        elif name == "lk_alpha":
            term = -overlap.clamp_min(ALPHA_FLOOR).log().sum() / count
        else:  # lk_lambda: one weight from the step's mean overlap, without gradient
            lam = torch.exp(-spec.lk_eta * overlap.detach().sum() / count)
            term = lam * ce + (1.0 - lam) * tv
        loss = loss + weight * term
    return loss, ce.detach(), pred


@torch.no_grad()
def sampling_acceptance(logits: Tensor, table: Tensor, rows: Tensor, draft_mass: Tensor) -> Tensor:
    """alpha_i = sum_j min(m_i p_ij, softmax(z_i)_j) per row [N]: the probability that speculative
    sampling accepts the drafter's token, with p_i = table[rows[i]] renormalised over the
    draft vocabulary and m_i = draft_mass [N] the share of the target's full-vocabulary mass
    on those rows (the rest the drafter can never propose: it counts as rejected)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    out = torch.empty(logits.shape[0], dtype=acc, device=logits.device)
    step = block_rows(logits)
    for s in range(0, logits.shape[0], step):
        e = s + step
        q = torch.softmax(logits[s:e].to(acc), dim=-1)  # [c, V]
        p = table[rows[s:e]].to(acc) * draft_mass[s:e, None].to(acc)  # [c, V]
        out[s:e] = torch.minimum(p, q).sum(dim=-1)
    return out
