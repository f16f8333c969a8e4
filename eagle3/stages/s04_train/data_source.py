"""Where stage 04's train batches come from: the store's whole train split, or rounds of windows.

`Trainer` (eagle3/stages/s04_train/run.py) asks one `DataSource` everything that differs
between the two, and never which one it holds:

    total              the run's optimizer steps (known at step 0: the schedule spans them all)
    micro_batches      this process's micro-batches (sample indices) of a step
    batch              one of them, loaded (from the prefetcher when it runs)
    ready              whether a step's data is on disk (a round may not be extracted yet)
    ends_part          whether a step ends a part of the data deleted once a checkpoint covers it
    covered            that checkpoint is on disk: record it, delete what it covers
    position           where the data stands after a step (what a checkpoint records)
    rounds_trained     the rounds a checkpoint at a step covers
    resumed            the checkpoint a run resumes, completed; progress.json follows it
    resume_step        the step at which a resumed checkpoint's training goes on
    counts             what the manifest records of the data
    start_prefetch     the background loader (--prefetch), from the resumed step on
    close              stop it

The two:

    WholeSplit        no --disk-budget: the store's train split in epochs (`EpochPlan`, data.py),
                      less the samples where no position carries loss (loss_positions.py);
                      loaded ahead in a background thread under --prefetch.
    RoundsOfWindows   stage 02's --disk-budget: its plan's rounds (`RoundSchedule` and `Rounds`,
                      windows.py), each round `--epochs` epochs over its window; the split
                      changes from round to round, so batches load in the training thread.

`open_data_source` picks one by whether stage 02 wrote a windows plan. Reads the store's train
split, or stage 01's train split and the rounds' folders; writes nothing itself (windows.py
writes progress.json and deletes rounds).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from eagle3.artifacts.store import HiddenStateStore, SplitView
from eagle3.artifacts.train_outputs import TrainCheckpoint
from eagle3.artifacts.windows import WindowPlan, read_plan
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.data import Batching, EpochPlan, Prefetcher, load_batch, nested_share
from eagle3.stages.s04_train.distributed import Dist
from eagle3.stages.s04_train.loss_positions import LossPositions, check_loss_positions, count_loss_positions
from eagle3.stages.s04_train.windows import Rounds, RoundSchedule, trainable_samples

log = logging.getLogger(__name__)


class DataSource:
    """What a run trains on, step by step; the base holds what both sources share."""

    total: int  # optimizer steps of the run
    plan: EpochPlan | RoundSchedule  # global step -> micro-batches
    loss_positions: LossPositions | None  # counted before training (the whole split only)

    def __init__(self, cfg: TrainConfig, dist: Dist):
        self.cfg, self.dist = cfg, dist

    @property
    def split(self) -> SplitView:
        """The split the indices of `micro_batches` point into (the open round's, over windows)."""
        raise NotImplementedError

    def micro_batches(self, step: int) -> list[list[int]]:
        """This process's micro-batches (sample indices into `split`) of optimizer step `step`.

        An epoch's order is a function of (seed, epoch) only and its step count that of
        its own packing, so a resumed run reads what an unbroken one would have, and
        no step is short of micro-batches (EpochPlan in data.py).
        """
        raise NotImplementedError

    def batch(self, step: int, i: int, indices: list[int]) -> dict:
        """Micro-batch i of `step` (sample `indices`), loaded in the training thread."""
        return load_batch(self.split, indices, self.cfg.max_seq_len, packed=self.cfg.packing)

    def position(self, step: int) -> dict:
        """Where the data stands after `step` steps (what a checkpoint records beside the
        step): the epoch (the round, over windows) of the last step taken and how many of
        its steps are done, so (0, 0) at the start and (e, its step count) when e has just
        ended. Only epochs already read are packed for it, never the next one."""
        if step == 0:
            return {"epoch": 0, "batch_in_epoch": 0}
        epoch, done = self.plan.locate(step - 1)
        return {"epoch": epoch, "batch_in_epoch": done + 1}

    def rounds_trained(self, step: int) -> int:
        return 0

    def ready(self, step: int) -> bool:
        return True

    def ends_part(self, step: int) -> bool:
        return False

    def covered(self, step: int, checkpoint: Path) -> None:
        """A checkpoint at `step`, the end of a part (`ends_part`), is on disk."""

    def resumed(self, ckpt: TrainCheckpoint | None, path: Path | None) -> TrainCheckpoint | None:
        """The checkpoint this run resumes (None: from scratch), before anything is loaded."""
        return ckpt

    def resume_step(self, ckpt: TrainCheckpoint, path: Path) -> int:
        """The step at which the training `ckpt` (at `path`) holds goes on."""
        ours = self.position(ckpt.step)
        theirs = {"epoch": ckpt.epoch, "batch_in_epoch": ckpt.batch_in_epoch}
        if theirs != ours:
            # Another process count packs other steps (the count is not part of the
            # identity): the same step number stands elsewhere in the data.
            log.warning("the checkpoint at step %d records data position %s, this code's schedule puts step %d at "
                        "%s: the rest of the run reads this schedule's batches, not the ones the interrupted run "
                        "would have read (pass --force to train from scratch instead)", ckpt.step, theirs,
                        ckpt.step, ours)
        return ckpt.step

    def counts(self, step: int) -> dict:
        """What stage 04's manifest records of the data, after `step` steps."""
        raise NotImplementedError

    def start_prefetch(self, step: int, device: torch.device) -> None:
        """Load the batches of steps `step`.. ahead in a background thread (--prefetch)."""

    def close(self) -> None:
        """Stop the background loader, if any; safe to call twice."""


class WholeSplit(DataSource):
    """The whole train split in one store (no --disk-budget), in epochs."""

    def __init__(self, cfg: TrainConfig, workdir: WorkDir, store: HiddenStateStore, batching: Batching, dist: Dist, *,
                 t2d: torch.Tensor, draft_vocab: int):
        super().__init__(cfg, dist)
        self.train_split = store.split("train")
        self.lengths = self.train_split.lengths()
        # Before any step: a split where no position carries loss is refused, and samples
        # without one stay out of the epochs (a row of them would step on no gradient).
        self.loss_positions = count_loss_positions(self.train_split, t2d, cfg.max_seq_len,
                                                   assistant_only=cfg.loss_on == "assistant")
        if dist.main:
            log.info("train split: %s", self.loss_positions.summary(cfg.max_seq_len, draft_vocab))
        warning = check_loss_positions(self.loss_positions, max_seq_len=cfg.max_seq_len, draft_vocab=draft_vocab,
                                       mapping_from=str(cfg.init_from or workdir.d2t()))
        if warning and dist.main:
            log.warning("%s", warning)
        # Each epoch's step count comes from its own packing (data.py); counting every
        # epoch the run reaches now stops an epoch too small for a step before training.
        trained = nested_share(self.loss_positions.trainable(), cfg.train_fraction, cfg.seed)
        if cfg.train_fraction < 1.0 and dist.main:
            log.info("--train-fraction %g: training on %d of the %d samples that carry loss", cfg.train_fraction,
                     len(trained), len(self.loss_positions.trainable()))
        self.plan = EpochPlan(self.lengths, batching, rank=dist.rank, world=dist.world, grad_accum=cfg.grad_accum,
                              samples=trained)
        if cfg.max_steps:
            self.total = cfg.max_steps
            self.plan.locate(self.total - 1)
        else:
            self.total = self.plan.steps_for_epochs(cfg.epochs)
        self.prefetch: Prefetcher | None = None

    @property
    def split(self) -> SplitView:
        return self.train_split

    def micro_batches(self, step: int) -> list[list[int]]:
        return self.plan.micro_batches(step)

    def batch(self, step: int, i: int, indices: list[int]) -> dict:
        return self.prefetch.get(step, i) if self.prefetch else super().batch(step, i, indices)

    def counts(self, step: int) -> dict:
        last_epoch = self.position(step)["epoch"]
        return {"steps_per_epoch": [self.plan.steps_in(e) for e in range(last_epoch + 1)],
                "loss_positions": self.loss_positions.to_json()}

    def start_prefetch(self, step: int, device: torch.device) -> None:
        """On a GPU an fp8 store's states cross as e4m3 codes and `Trainer.forward` decodes
        them there, except with --aux-noise, whose draws need the decoded states in the
        training thread."""
        cfg = self.cfg
        if not cfg.prefetch or step >= self.total:
            return
        cuda = device.type == "cuda"
        decode = not cuda or cfg.aux_noise > 0
        self.prefetch = Prefetcher(lambda idx: load_batch(self.train_split, idx, cfg.max_seq_len, packed=cfg.packing,
                                                          decode=decode),
                                   self.plan, start=step, total=self.total, depth=cfg.prefetch, pin=cuda,
                                   files=self.train_split.file_names)

    def close(self) -> None:
        if self.prefetch:  # also on KeyboardInterrupt: the loader thread stops
            self.prefetch.close()


class RoundsOfWindows(DataSource):
    """The train split in rounds of windows (stage 02's --disk-budget; windows.py)."""

    def __init__(self, cfg: TrainConfig, workdir: WorkDir, store: HiddenStateStore, batching: Batching, dist: Dist,
                 window_plan: WindowPlan):
        super().__init__(cfg, dist)
        if cfg.train_fraction < 1.0:
            raise PipelineError("--train-fraction applies to a whole store; with stage 02's --disk-budget use a "
                                "smaller stage 01 dataset instead.")
        lengths, trainable = trainable_samples(workdir, cfg.max_seq_len, assistant_only=cfg.loss_on == "assistant")
        planned = sum(len(w["samples"]) for w in window_plan.windows)
        if len(lengths) != planned:
            raise PipelineError(f"{workdir.store() / 'windows.json'} plans {planned} train samples, "
                                f"{workdir.dataset('train')} holds {len(lengths)}: rerun stage 02 with --force after "
                                f"stage 01 changed.")
        if not trainable.any():
            raise PipelineError(f"no sample of {workdir.dataset('train')} has a position that carries loss within "
                                f"--max-seq-len {cfg.max_seq_len}; check stage 01's loss mask.")
        self.plan = RoundSchedule(window_plan, lengths, trainable, batching, rank=dist.rank, world=dist.world,
                                  grad_accum=cfg.grad_accum, epochs=cfg.epochs)
        self.total = min(cfg.max_steps, self.plan.total) if cfg.max_steps else self.plan.total
        self.rounds = Rounds(workdir, store, self.plan, windows_dir=cfg.windows_dir, keep=cfg.keep_windows,
                             wait_s=cfg.window_wait_s, rank=dist.rank, world=dist.world)
        self.loss_positions = None
        if dist.main:
            log.info("stage 04 over windows: %s; %d steps (%s per round), --epochs %d within each round",
                     window_plan.summary(), self.total, self.plan.steps, cfg.epochs)

    @property
    def split(self) -> SplitView:
        return self.rounds.split

    def micro_batches(self, step: int) -> list[list[int]]:
        return self.rounds.micro_batches(step)

    def rounds_trained(self, step: int) -> int:
        return self.plan.rounds_done(step)

    def ready(self, step: int) -> bool:
        """Open the round of `step`; False when it is not extracted yet (after --window-wait-s)."""
        return self.rounds.ensure(step)

    def ends_part(self, step: int) -> bool:
        """The last step of a round, and the run's, is always saved: its folder is deleted only then."""
        return self.rounds.is_end(step) or step == self.total

    def covered(self, step: int, checkpoint: Path) -> None:
        self.rounds.covered(step, checkpoint)

    def resumed(self, ckpt: TrainCheckpoint | None, path: Path | None) -> TrainCheckpoint | None:
        if ckpt is not None:
            ckpt = self.plan.fill_unrecorded(ckpt, path, self.dist.world)
        # First: progress.json follows the checkpoint (the record of what is trained) before
        # anything is deleted, and before the run can stop (a refused resume, a missing round).
        self.rounds.resumed(ckpt.rounds_trained if ckpt else 0, ckpt.step if ckpt else 0, path)
        return ckpt

    def resume_step(self, ckpt: TrainCheckpoint, path: Path) -> int:
        """Another process count maps by rounds, or is refused (windows.py says why)."""
        step = self.plan.resume_step(ckpt, path, self.dist.world)
        if step == ckpt.step:
            return super().resume_step(ckpt, path)
        log.warning("the checkpoint at step %d was written by %d process(es), this run has %d: it covers "
                    "%d round(s), so training goes on at step %d of %d, the start of round %d under this "
                    "count (metrics.jsonl continues with this count's step numbers)", ckpt.step,
                    ckpt.batch_geometry["processes"], self.dist.world, ckpt.rounds_trained, step, self.total,
                    ckpt.rounds_trained)
        return step

    def counts(self, step: int) -> dict:
        return {"steps_per_round": self.plan.steps, "loss_positions": None}


def open_data_source(cfg: TrainConfig, workdir: WorkDir, store: HiddenStateStore, batching: Batching, dist: Dist, *,
                     t2d: torch.Tensor, draft_vocab: int) -> DataSource:
    """The rounds when stage 02 ran with --disk-budget (its windows plan), else the whole split.
    `t2d` [V_t] bool and `draft_vocab`: the drafter's mapping, which decides the positions
    that carry loss."""
    window_plan = read_plan(workdir.store())
    if window_plan is not None:
        return RoundsOfWindows(cfg, workdir, store, batching, dist, window_plan)
    return WholeSplit(cfg, workdir, store, batching, dist, t2d=t2d, draft_vocab=draft_vocab)
