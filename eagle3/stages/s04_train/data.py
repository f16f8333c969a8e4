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

`Prefetcher` loads the micro-batches of the steps to come in a background thread, in
the order the steps read them, into pinned memory when CUDA is there; an fp8 store's
states then travel as e4m3 codes and are decoded on the GPU (`to_device`). The values,
and so the weights, are those of loading in the training thread (docs/STAGES.md, stage 04).
"""
from __future__ import annotations

import math
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from eagle3.artifacts.store import Sample, SplitView, collate, decode_states
from eagle3.core.batching import fold_leftover, group_by_padded_tokens, pack_greedy
from eagle3.core.errors import PipelineError

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

    def copy(self) -> "EpochPlan":
        """The same plan with its own caches, for another thread (the prefetcher's)."""
        plan = EpochPlan([], self.batching, rank=self.rank, world=self.world, grad_accum=self.grad_accum, samples=[])
        plan.samples, plan.lengths = self.samples, self.lengths  # read only
        return plan

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


def load_batch(split: SplitView, indices: list[int], max_seq_len: int, packed: bool = False,
               decode: bool = True) -> dict[str, torch.Tensor]:
    """The batch of samples `indices`; `decode=False` leaves an fp8 store's states encoded
    (with `scale_log2`), for `to_device` to decode where the batch is going."""
    samples = [split[i] if decode else split.encoded(i) for i in indices]
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
        "aux": _cat([s.aux[:n] for s, n in zip(samples, ns)]),
        "final": _cat([s.final[:n] for s, n in zip(samples, ns)]),
        "target_argmax": torch.cat([s.target_argmax[:n].long() for s, n in zip(samples, ns)]),
        "position_ids": torch.cat([torch.arange(n) for n in ns]),
        "segment_ids": torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(ns)]),
    }
    if samples[0].scale_log2 is not None:  # encoded fp8 states: their scales travel with them
        out["scale_log2"] = torch.cat([s.scale_log2[:n] for s, n in zip(samples, ns)])
    out["attention_mask"] = torch.ones(sum(ns), dtype=torch.bool)
    return {k: v[None] for k, v in out.items()}  # [T, ...] -> [1, T, ...]


def _cat(states: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of bf16 or e4m3 states, by their bits: the CPU's cat of float8 is an
    elementwise loop, a few times slower than the byte copy of uint8."""
    bits = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}.get(states[0].dtype)
    if bits is None:
        return torch.cat(states)
    return torch.cat([x.view(bits) for x in states]).view(states[0].dtype)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The batch on `device` (asynchronous from pinned memory), fp8 states decoded there."""
    return decode_states({k: v.to(device, non_blocking=True) for k, v in batch.items()})


@dataclass
class _Failed:
    """What the loader thread hands on instead of a batch it could not load."""

    error: BaseException
    files: list[str]


class Prefetcher:
    """Loads the micro-batches of steps `start`..`total`-1 in a background thread, at most
    `depth` ahead of the training thread, in the order `get` takes them.

    The thread runs `load(indices)` (the store's reads, the fp8 decode when `load` does it,
    the collate) and, with `pin`, copies each batch into pinned memory, so the copy to the
    GPU is asynchronous. It computes no random numbers (the --aux-noise draws stay in the
    training thread) and reads the same micro-batches through its own copy of the plan, so
    the batches are those the training thread would load itself. An error in the thread is
    raised by the `get` that wanted that batch, naming the step and the store files; `close`
    (also on KeyboardInterrupt) stops the thread.
    """

    def __init__(self, load: Callable[[list[int]], dict], plan: EpochPlan, *, start: int, total: int,
                 depth: int, pin: bool, files: Callable[[list[int]], list[str]]):
        assert depth >= 1, depth
        self._load, self._plan, self._pin, self._files = load, plan.copy(), pin, files
        self._range = (start, total)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.loaded = 0  # micro-batches loaded and queued so far (the training thread may have taken fewer)
        self._thread = threading.Thread(target=self._run, name="stage04-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for step in range(*self._range):
            micro = self._plan.micro_batches(step)
            for i, indices in enumerate(micro):
                try:
                    batch = self._load(indices)
                    if self._pin:
                        batch = {k: v.pin_memory() for k, v in batch.items()}
                except BaseException as e:  # handed to the training thread, which raises it
                    self._put((step, i), _Failed(e, self._files(indices)))
                    return
                if not self._put((step, i), batch):
                    return
                self.loaded += 1

    def _put(self, key: tuple[int, int], item) -> bool:
        """Wait for room in the queue; False once `close` was called."""
        while not self._stop.is_set():
            try:
                self._queue.put((key, item), timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, step: int, i: int) -> dict[str, torch.Tensor]:
        """Micro-batch `i` of `step`: the next one, in the plan's order."""
        while True:
            try:
                key, item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():  # it put an error or returned after close
                    raise PipelineError(f"stage 04's loader thread has stopped before step {step}") from None
        assert key == (step, i), f"prefetched micro-batch {key}, the training step wants {(step, i)}"
        if isinstance(item, _Failed):
            e = item.error
            raise PipelineError(
                f"stage 04's loader (a background thread) failed loading micro-batch {i} of step {step} from "
                f"{', '.join(item.files)} in the store: {type(e).__name__}: {e}") from e
        return item

    def close(self) -> None:
        """Stop the thread and drop what it loaded ahead; safe to call twice."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=60)
