"""Grouping samples into batches by padded size, shared by extraction and training."""
from __future__ import annotations

from typing import Sequence


def group_by_padded_tokens(indices: Sequence[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive runs of `indices` (in the given order) whose padded size,
    batch size x longest length, stays within `batch_tokens` (a longer sample gets a
    batch of its own)."""
    batches, cur, longest = [], [], 0
    for i in indices:
        n = lengths[i]
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def pack_greedy(indices: Sequence[int], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive runs of `indices` (in the given order) whose summed length stays
    within `batch_tokens`: the samples of one packed row, no padding at all (a longer
    sample gets a row of its own)."""
    batches, cur, total = [], [], 0
    for i in indices:
        n = lengths[i]
        if cur and total + n > batch_tokens:
            batches.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        batches.append(cur)
    return batches


def padding_share(batches: Sequence[Sequence[int]], lengths: Sequence[int], packed: bool) -> float:
    """Share of computed positions that are padding: padded batches compute
    len(batch) x longest positions, packed rows exactly the samples' tokens."""
    real = sum(lengths[i] for b in batches for i in b)
    computed = real if packed else sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1.0 - real / computed if computed else 0.0
