"""Deterministic batches from the hidden-state store, sharded over processes.

The order of an epoch is a function of (seed, epoch) only, and batch b of an
epoch always holds the same samples, so a resumed run (which knows its step)
reads exactly what an unbroken run would have read. Two layouts:

    packed (default)  several samples per row, one row of at most `batch_tokens`
                      tokens filled greedily in shuffled order; positions restart at
                      0 per sample and `segment_ids` keep attention inside each
                      sample. No padding is computed. The partly filled last row is
                      folded into the other rows' free space when it fits.
    padded            samples grouped into batches of at most `batch_tokens` padded
                      tokens; within windows of 64 samples they are sorted by length
                      first so padding stays small.

Each epoch is shuffled and packed anew, so epochs can differ in their number of
batches (by a row or so). `EpochPlan` therefore takes each epoch's step count from
that epoch's own packing and maps a run's global step to (epoch, step in epoch):
no step ever reads past the end of its epoch's batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eagle3.core.batching import fold_leftover, group_by_padded_tokens, pack_greedy
from eagle3.core.errors import PipelineError
from eagle3.core.store import Sample, SplitView, collate

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
    if epoch is None or not batches:
        return batches
    # The grouping's last batch holds whatever was left over, often a small part of
    # batch_tokens. Packed rows take its samples into their free space when they fit;
    # otherwise it stays the epoch's last batch, where the steps that do not fill a
    # whole step over all processes are dropped first (EpochPlan).
    full, leftover = batches[:-1], batches[-1:]
    if cfg.packed:
        folded = fold_leftover(batches, cropped, cfg.batch_tokens)
        if folded is not batches:
            full, leftover = folded, []
    # Shuffle the batch order too, or long batches would cluster per window.
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + epoch + 1)
    return [full[i] for i in torch.randperm(len(full), generator=g).tolist()] + leftover


def nested_share(samples: list[int], fraction: float, seed: int) -> list[int]:
    """The first ceil(fraction * n) of `samples` in a seeded order, back in their own order.

    The order depends on `seed` only, so for one seed the share of a smaller fraction
    is a subset of the share of a larger one (a data forecast trains on nested data).
    """
    if fraction >= 1.0:
        return list(samples)
    n = max(1, math.ceil(fraction * len(samples)))
    g = torch.Generator().manual_seed(seed * 100_003 + 977)
    keep = sorted(torch.randperm(len(samples), generator=g)[:n].tolist())
    return [samples[i] for i in keep]


def noisy_aux(aux: torch.Tensor, share: float, num_aux: int) -> torch.Tensor:
    """aux [B, T, A*H] plus Gaussian noise whose std is `share` of each aux layer's
    per-token RMS (the layers' scales differ by orders of magnitude), in aux's dtype."""
    B, T, AH = aux.shape
    x = aux.float().view(B, T, num_aux, AH // num_aux)  # [B, T, A, H]
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, A, 1]
    return (x + share * rms * torch.randn_like(x)).view(B, T, AH).to(aux.dtype)


def rank_batches(batches: list[list[int]], rank: int, world: int) -> list[list[int]]:
    """This process's share, interleaved: step s of rank r reads batch s*world + r, so
    W processes with grad_accum 1 see exactly what one process with grad_accum W
    sees. Every rank gets the same count (the remainder is dropped)."""
    per_rank = len(batches) // world
    return batches[rank::world][:per_rank]


class EpochPlan:
    """Which micro-batches each optimizer step of a run reads, epoch after epoch.

    `samples` are the split indices trained (default: all; stage 04 leaves out the
    samples where no position carries loss, eagle3/stages/s04_train/loss_positions.py). Epoch e
    has `steps_in(e) = (len(epoch_batches(e)) // world) // grad_accum` steps, counted
    from its own packing; the few micro-batches that do not make a whole step on
    every process are skipped (the epoch's leftover batch first, as it comes last).
    Global step s is step `s - start(e)` of the epoch e whose steps contain it, so a
    run resumed at step s reads what the unbroken run read there. Counting an epoch
    packs it (a shuffle and a pass over the sample lengths); the counts are kept, the
    batches of one epoch at a time.
    """

    def __init__(self, lengths: list[int], batching: Batching, *, rank: int, world: int, grad_accum: int,
                 samples: list[int] | None = None):
        self.samples = list(range(len(lengths))) if samples is None else list(samples)
        self.lengths = [lengths[i] for i in self.samples]  # packed in the order of `samples`
        self.batching = batching
        self.rank, self.world, self.grad_accum = rank, world, grad_accum
        self._steps: list[int] = []  # steps of epochs 0, 1, ... as far as counted
        self._starts: list[int] = []  # global step at which each counted epoch begins
        self._cached: tuple[int, list[list[int]]] | None = None  # (epoch, this rank's micro-batches)

    def _rank_batches(self, epoch: int) -> list[list[int]]:
        if self._cached is None or self._cached[0] != epoch:
            batches = [[self.samples[i] for i in b] for b in epoch_batches(self.lengths, self.batching, epoch)]
            self._cached = (epoch, rank_batches(batches, self.rank, self.world))
        return self._cached[1]

    def steps_in(self, epoch: int) -> int:
        while len(self._steps) <= epoch:
            e = len(self._steps)
            n = len(self._rank_batches(e)) // self.grad_accum
            if n == 0:
                raise PipelineError(
                    f"the train split ({len(self.samples)} samples that carry loss) gives no full step of "
                    f"{self.grad_accum} micro-batch(es) on each of {self.world} process(es) in epoch {e}; lower "
                    f"--grad-accum or --batch-tokens.")
            self._starts.append(self._starts[-1] + self._steps[-1] if self._steps else 0)
            self._steps.append(n)
        return self._steps[epoch]

    def steps_for_epochs(self, epochs: int) -> int:
        """Steps in epochs 0 .. epochs-1."""
        return sum(self.steps_in(e) for e in range(epochs))

    def locate(self, step: int) -> tuple[int, int]:
        """(epoch, step within it) of global step `step` (0-based)."""
        assert step >= 0, step
        epoch = 0
        while True:
            n = self.steps_in(epoch)
            if step < self._starts[epoch] + n:
                return epoch, step - self._starts[epoch]
            epoch += 1

    def micro_batches(self, step: int) -> list[list[int]]:
        """This process's grad_accum micro-batches (sample indices) of global step `step`."""
        epoch, b = self.locate(step)
        A = self.grad_accum
        micro = self._rank_batches(epoch)[b * A:(b + 1) * A]
        assert len(micro) == A, (step, epoch, b, len(micro))
        return micro


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
