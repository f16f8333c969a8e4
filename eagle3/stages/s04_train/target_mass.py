"""The draft vocabulary's share of the target's probability at each held-out position.

Stage 04's labels are the target's softmax over the draft rows of its lm_head, renormalised
(docs/CONVENTIONS.md §4): that is all training needs, and only those rows are loaded. The
held-out acceptance under sampling must count the target's mass outside the draft
vocabulary as lost (the drafter never proposes those tokens), so it needs, per position,

    m = sum_{i in draft} softmax(final @ W.T)_i = exp(lse(final @ W[draft].T) - lse(final @ W.T))

over the target's whole lm_head W [V_t, H]. Stage 02 stores the normed final state, not m
(it runs before stage 03 picks the draft vocabulary). `HeldOutMass` reads W on the first
held-out evaluation (eagle3/target/head.py `load_lm_head`: the checkpoint's lm_head only,
2.3 GB in bf16 for Kimi-K2.5), computes m for every held-out batch this rank evaluates
(one [rows, V_t] matmul per chunk of positions, as stage 02's argmax), keeps the results
(4 bytes a token, on the host) and lets W go: later evaluations, which read the same
batches (eagle3/stages/s04_train/evaluation.py), reuse them. A resumed run computes them
once more. Writes nothing.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import Tensor

log = logging.getLogger(__name__)

LOGITS_CHUNK_BYTES = 256 << 20  # [positions, V_t] float32 logits per matmul chunk


@torch.no_grad()
def draft_vocab_mass(final: Tensor, lm_head: Tensor, draft_ids: Tensor) -> Tensor:
    """[..., H] normed final states -> [...] float32: the share of each position's target
    distribution softmax(final @ lm_head.T) [V_t] that lies on the rows `draft_ids` [V_d].
    Computed where `lm_head` lives, in its dtype, each chunk's logits upcast to float32."""
    lead, H = final.shape[:-1], final.shape[-1]
    flat = final.reshape(-1, H)
    out = torch.empty(flat.shape[0], dtype=torch.float32)
    chunk = max(1, LOGITS_CHUNK_BYTES // (4 * lm_head.shape[0]))
    ids = draft_ids.to(lm_head.device)
    for a in range(0, flat.shape[0], chunk):
        logits = (flat[a:a + chunk].to(lm_head.device, lm_head.dtype) @ lm_head.T).float()  # [c, H] -> [c, V_t]
        share = torch.logsumexp(logits[:, ids], dim=-1) - torch.logsumexp(logits, dim=-1)  # [c, V_t] -> [c]
        out[a:a + chunk] = share.exp().clamp_(max=1.0).cpu()  # rounding can put the draft part a hair above all
    return out.view(lead)


def head_dtype(device: torch.device) -> torch.dtype:
    """The lm_head's dtype for the mass on `device`: bf16 on a GPU (as stage 02's argmax: the
    Kimi-K2.5 head is 2.3 GB in bf16, twice that in float32), float32 on a CPU (whose bf16
    matmul gains nothing here and rounds more)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class HeldOutMass:
    """`draft_vocab_mass` of each held-out batch, computed once per batch and run.

    `load_lm_head()` returns the target's whole lm_head [V_t, H] (called on the first batch
    not yet seen); `draft_ids` [V_d] are the target ids of the draft rows. The head goes to
    `device` in bf16 on a GPU (as stage 02's argmax; float32 on a CPU) and is released by
    `release`, which the evaluation calls after each pass.
    """

    def __init__(self, load_lm_head: Callable[[], Tensor], draft_ids: Tensor, device: torch.device):
        self.load_lm_head = load_lm_head
        self.draft_ids = draft_ids.cpu()
        self.device = device
        self.lm_head: Tensor | None = None
        self.masses: dict[tuple[int, ...], Tensor] = {}

    def __call__(self, indices: list[int], final: Tensor) -> Tensor:
        """The mass [B, T] (host, float32) of the held-out batch of samples `indices` whose
        normed final states are `final` [B, T, H]."""
        key = tuple(indices)
        if key not in self.masses:
            if self.lm_head is None:
                self.lm_head = self.load_lm_head().to(self.device, head_dtype(self.device))
                log.info("held-out acceptance under sampling: the target's lm_head [%d, %d] is on %s while the "
                         "draft vocabulary's share of each position's mass is computed", *self.lm_head.shape,
                         self.device)
            self.masses[key] = draft_vocab_mass(final, self.lm_head, self.draft_ids)
        return self.masses[key]

    def release(self) -> None:
        """Drop the lm_head (the masses stay)."""
        if self.lm_head is not None:
            self.lm_head = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
