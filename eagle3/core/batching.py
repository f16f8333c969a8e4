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


def fold_leftover(rows: list[list[int]], lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Packed rows without their partly filled last row when its samples fit elsewhere.

    Greedy packing leaves a last row of whatever is left over, often a small share of
    `batch_tokens`; trained as a step of its own it weighs as much as a full step while
    averaging over few positions. Its samples go, longest first, into the earlier row
    with the least free space that still holds them (the first such row on ties);
    when any of them fits nowhere, the rows are returned unchanged (moving only some
    would leave an even smaller last row). Rows keep their order; every sample stays
    in exactly one row and every row within `batch_tokens`.
    """
    if len(rows) < 2:
        return rows
    free = [batch_tokens - sum(lengths[i] for i in row) for row in rows[:-1]]
    placed: list[tuple[int, int]] = []  # (sample, row)
    for i in sorted(rows[-1], key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
        fits = [r for r, f in enumerate(free) if f >= lengths[i]]
        if not fits:
            return rows
        r = min(fits, key=lambda r: free[r])
        free[r] -= lengths[i]
        placed.append((i, r))
    out = [list(row) for row in rows[:-1]]
    for i, r in placed:
        out[r].append(i)
    return out


def padding_share(batches: Sequence[Sequence[int]], lengths: Sequence[int], packed: bool) -> float:
    """Share of computed positions that are padding: padded batches compute
    len(batch) x longest positions, packed rows exactly the samples' tokens."""
    real = sum(lengths[i] for b in batches for i in b)
    computed = real if packed else sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1.0 - real / computed if computed else 0.0
