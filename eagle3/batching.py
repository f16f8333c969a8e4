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
