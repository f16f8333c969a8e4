"""Deterministic batches from the hidden-state store, sharded over processes.

The order of an epoch is a function of (seed, epoch) only, and batch b of an
epoch always holds the same samples, so a resumed run (which knows its step)
reads exactly what an unbroken run would have read. Two layouts:

    packed (default)  several samples per row, one row of at most `batch_tokens`
                      tokens filled greedily in shuffled order; positions restart at
                      0 per sample and `segment_ids` keep attention inside each
                      sample. No padding is computed.
    padded            samples grouped into batches of at most `batch_tokens` padded
                      tokens; within windows of 64 samples they are sorted by length
                      first so padding stays small.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batching import group_by_padded_tokens, pack_greedy
from ..store import Sample, SplitView, collate

SORT_WINDOW = 64


@dataclass(frozen=True)
class Batching:
    batch_tokens: int
    max_seq_len: int
    seed: int
    packed: bool = True


def epoch_batches(lengths: list[int], cfg: Batching, epoch: int | None) -> list[list[int]]:
    """Lists of sample indices; `epoch=None` keeps dataset order (evaluation)."""
    n = len(lengths)
    if epoch is None:
        order = list(range(n))
    else:
        g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch)
        order = torch.randperm(n, generator=g).tolist()
        if not cfg.packed:  # sorting only helps padded batches
            order = [i for w in range(0, n, SORT_WINDOW)
                     for i in sorted(order[w:w + SORT_WINDOW], key=lambda i: lengths[i])]
    cropped = [min(t, cfg.max_seq_len) for t in lengths]
    group = pack_greedy if cfg.packed else group_by_padded_tokens
    batches = group(order, cropped, cfg.batch_tokens)
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


def load_batch(split: SplitView, indices: list[int], max_seq_len: int, packed: bool = False) -> dict[str, torch.Tensor]:
    samples = [split[i] for i in indices]
    if packed:
        return collate_packed(samples, max_seq_len)
    T = min(max(s.num_tokens for s in samples), max_seq_len)
    return collate(samples, pad_to=T)


def collate_packed(samples: list[Sample], max_seq_len: int) -> dict[str, torch.Tensor]:
    """One row holding the samples back to back, each cropped to `max_seq_len`.

    -> the keys of `store.collate` with B = 1 and T = the summed lengths (all real:
    attention_mask all true), plus position_ids [1, T] restarting at 0 per sample
    and segment_ids [1, T] (sample i of the row has id i).
    """
    ns = [min(s.num_tokens, max_seq_len) for s in samples]
    out = {
        "input_ids": torch.cat([s.input_ids[:n].long() for s, n in zip(samples, ns)]),
        "loss_mask": torch.cat([s.loss_mask[:n].to(torch.int8) for s, n in zip(samples, ns)]),
        "aux": torch.cat([s.aux[:n] for s, n in zip(samples, ns)]),
        "final": torch.cat([s.final[:n] for s, n in zip(samples, ns)]),
        "target_argmax": torch.cat([s.target_argmax[:n].long() for s, n in zip(samples, ns)]),
        "position_ids": torch.cat([torch.arange(n) for n in ns]),
        "segment_ids": torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(ns)]),
    }
    out["attention_mask"] = torch.ones(sum(ns), dtype=torch.bool)
    return {k: v[None] for k, v in out.items()}  # [T, ...] -> [1, T, ...]
