"""Stage 04's held-out evaluation: the same figures whatever the number of processes.

Reads the store's held-out split (the train split when that is empty) through the
trainer's forward; writes nothing (the trainer logs the figures and keeps the best).
Called by `Trainer.evaluate` (eagle3/stages/s04_train/run.py) on every rank at once.

Which rank evaluates what. Every rank packs the split the same way (dataset order,
`epoch_batches(..., epoch=None)`), `--eval-batches` keeps the first batches of that one
list, and rank r of W evaluates batches r, r + W, r + 2W, ...: each batch once, none
dropped. The counts per rank then differ by one when W does not divide the number of
batches, and a rank has none when there are fewer batches than ranks (a held-out split
of 3 packed rows on 8 GPUs). The per-rank sums (`MetricSum`: losses and accuracies
weighted by valid positions, and the position count) are summed over the ranks, so
every rank holds the sums of one process evaluating every batch: the counts exactly,
the float sums up to the order of additions. The best checkpoint follows those sums,
so it does not depend on the number of ranks either. (The trainer's own batches are
dealt differently, `rank_batches` in data.py: a step needs a whole micro-batch on every
rank, so training drops the remainder; evaluation needs no step.)

Why unequal counts are safe. Between the forwards each rank runs on its own; the one
collective is the sum at the end, which every rank reaches once. A forward must
therefore never be a collective: DistributedDataParallel's default broadcasts the
module's buffers (the drafter's d2t/t2d) from rank 0 at the start of a forward, and a
rank with one batch fewer would then be left waiting in that broadcast, or pair it with
another rank's sum. `wrap_ddp` (eagle3/stages/s04_train/distributed.py) turns that
broadcast off; under `no_grad` DDP's forward then runs no collective (torch 2.13,
torch/nn/parallel/distributed.py, `_pre_forward`/`_post_forward`: the reducer is
prepared only when grad is enabled, and buffers are synced only when
`will_sync_module_buffers()`).
"""
from __future__ import annotations

import logging

import torch

from eagle3.artifacts.store import HiddenStateStore, SplitView
from eagle3.stages.s04_train.data import Batching, epoch_batches
from eagle3.stages.s04_train.distributed import Dist
from eagle3.stages.s04_train.metrics import MetricSum
from eagle3.stages.s04_train.target_mass import HeldOutMass

log = logging.getLogger(__name__)


def held_out_split(store: HiddenStateStore) -> SplitView:
    """The held-out split, or the train split (with a warning) when it is empty."""
    split = store.split("eval")
    if len(split) == 0:
        split = store.split("train")
        log.warning("the held-out split is empty; evaluating on train batches (rerun stage 01 with a "
                    "larger --eval-fraction for an honest figure)")
    return split


def held_out_batches(lengths: list[int], batching: Batching, eval_batches: int | None, rank: int,
                     world: int) -> list[list[int]]:
    """Rank `rank`'s share of the held-out batches (lists of sample indices): every batch of
    the split (the first `eval_batches` when set) goes to exactly one rank, none is dropped."""
    batches = epoch_batches(lengths, batching, None)
    if eval_batches:
        batches = batches[:eval_batches]
    return batches[rank::world]


@torch.no_grad()
def evaluate_held_out(model: torch.nn.Module, forward, load, store: HiddenStateStore, batching: Batching,
                      eval_batches: int | None, dist: Dist, ttt_steps: int,
                      mass: HeldOutMass | None = None) -> dict:
    """The held-out metrics summed over every rank (`MetricSum.result()`), the same on each.

    `model`: what `forward` runs (its train/eval mode is switched here); `forward(batch)`
    returns a TTTOutput; `load(split, indices)` collates a batch. With `mass`
    (eagle3/stages/s04_train/target_mass.py) each batch also carries its draft-vocabulary
    share of the target's mass, `batch["target_mass"]` [B, T], and the figures under
    sampling are summed (the same on every rank: the trainer always passes one). A
    collective: every rank calls it at the same step, whatever its number of batches
    (module doc).
    """
    split = held_out_split(store)
    batches = held_out_batches(split.lengths(), batching, eval_batches, dist.rank, dist.world)
    model.eval()
    acc = MetricSum(ttt_steps, sampling=mass is not None)
    for idx in batches:
        batch = load(split, idx)
        if mass is not None:
            batch["target_mass"] = mass(idx, batch["final"])
        acc.add(forward(batch).metrics)
    if mass is not None:
        mass.release()
    acc.all_reduce(dist.world)
    model.train()
    return acc.result()
