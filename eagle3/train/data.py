"""Deterministic batches from the hidden-state store, sharded over processes.

The order of an epoch is a function of (seed, epoch) only, and batch b of an
epoch always holds the same samples, so a resumed run (which knows its step)
reads exactly what an unbroken run would have read. Samples are grouped into
batches of at most `batch_tokens` padded tokens; within windows of 64 samples
they are sorted by length first so padding stays small.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batching import group_by_padded_tokens
from ..store import SplitView, collate

SORT_WINDOW = 64


@dataclass(frozen=True)
class Batching:
    batch_tokens: int
    max_seq_len: int
    seed: int


def epoch_batches(lengths: list[int], cfg: Batching, epoch: int | None) -> list[list[int]]:
    """Lists of sample indices; `epoch=None` keeps dataset order (evaluation)."""
    n = len(lengths)
    if epoch is None:
        order = list(range(n))
    else:
        g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
        order = torch.randperm(n, generator=g).tolist()
        order = [i for w in range(0, n, SORT_WINDOW)
                 for i in sorted(order[w:w + SORT_WINDOW], key=lambda i: lengths[i])]
    cropped = [min(t, cfg.max_seq_len) for t in lengths]
    batches = group_by_padded_tokens(order, cropped, cfg.batch_tokens)
    if epoch is not None:  # shuffle batch order too, or long batches would cluster per window
        g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch + 1)
        batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
    return batches


def rank_batches(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """This process's share, interleaved: step s of rank r reads batch s*world + r, so
    W processes with grad_accum 1 see exactly what one process with grad_accum W
    sees. Every rank gets the same count (the remainder is dropped)."""
    per_rank = len(batches) // world
    return batches[rank::world][:per_rank]


def load_batch(split: SplitView, indices: list[int], max_seq_len: int) -> dict[str, torch.Tensor]:
    samples = [split[i] for i in indices]
    T = min(max(s.num_tokens for s in samples), max_seq_len)
    return collate(samples, pad_to=T)
