"""Stage 04 over windows of the store: one schedule, one optimizer, one step counter.

When stage 02 ran with `--disk-budget` (its plan `02_hidden_states/windows.json`, format
in eagle3/artifacts/windows.py), the train split arrives round by round, each round a store
folder of its own, and is deleted once trained. This module maps the run's global step
to (round, step in round) and opens, checks and deletes the rounds' folders;
`RoundsOfWindows` (data_source.py) calls it for `Trainer` (run.py). It reads stage 01's train split (lengths and loss masks: the schedule
is known before any window is extracted) and the rounds' folders; writes
`windows/progress.json` and deletes rounds.

The schedule: round r trains `--epochs` epochs over its window's samples, packed and
shuffled as data.py packs a split (`EpochPlan`), with a seed of its own (the run's seed and
r). Its steps are counted from stage 01's lengths, so the run's length, and with it the one
learning-rate schedule, is known at step 0. Samples whose stage-01 mask gives no position
a loss inside --max-seq-len stay out (as `loss_positions` leaves samples out of a whole
store; a sample whose every masked position falls outside the draft vocabulary stays in
and adds nothing). A sample stage 02 rejected for NaN/Inf is dropped from its micro-batch.

Deletion. At the last step of round r the trainer saves a checkpoint whatever
--save-every says; only then `covered` writes `progress.json` (rounds trained, the
checkpoint) and deletes the round's folder (renamed first, then removed), never with
--keep-windows. The checkpoint, latest.json and their folder are fsynced by then
(eagle3/artifacts/atomic.py): on a network filesystem a deletion is committed at once,
a write only when flushed. Every rank first lets go of the round's files (`close`: the
store and its split reference each other, so their mappings go at a garbage collection,
forced there) and the ranks meet before rank 0 deletes: a file still mapped stays on NFS
as a `.nfsXXXX` file and keeps its folder (`windows.delete_round` retries, then leaves it
for a later start and says so).

The checkpoint is the record of what is trained: it holds the rounds it covers
(`rounds_trained`) and the process count that took its steps. At every start `resumed`
rewrites progress.json to the resumed checkpoint's rounds, down too (the newest
checkpoint was unreadable, a power loss lost it), before anything is deleted or the run
stops, so stage 02 extracts the rounds still needed again; then it deletes the folders of
the rounds the checkpoint covers (a run killed between its checkpoint and the deletion
left them), never a round from the checkpoint's coverage on.

Another process count. A round's steps scale with the count (`EpochPlan` deals each step's
micro-batches to the processes), and the count is not part of the run's identity, so
`resume_step` maps by rounds: a checkpoint at a round's end continues at the start of the
next round of this run's schedule; one in the middle of a round is refused with the
command that finishes the round under the count that wrote it.

Verification. A round's checksums are read once before it is trained, split over the
ranks (file i by rank i mod the count): the collective in `ensure` then waits for the
slowest rank's share, not for one rank reading all of a window (~1.8 TB for Kimi-K2.5)
while the others sit in it (see --dist-timeout-s, docs/OPERATIONS.md).
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

from eagle3.artifacts import store, windows
from eagle3.artifacts.dataset import load_split
from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.train_outputs import TrainCheckpoint
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train.data import Batching, EpochPlan
from eagle3.stages.s04_train.distributed import all_reduce_sum, barrier

log = logging.getLogger(__name__)

# Tests kill the run with SIGKILL at a named point (eagle3/stages/s04_train/windows.py's
# `_kill_point`): "covered:R" right after the checkpoint covering round R is on disk.
KILL_ENV = "EAGLE3_KILL_AT"
_ROUND_KEYS = ("num_samples", "round", "window")


def _kill_point(name: str) -> None:
    if os.environ.get(KILL_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def trainable_samples(workdir: WorkDir, max_seq_len: int, assistant_only: bool) -> tuple[list[int], np.ndarray]:
    """Stage 01's train split: (lengths, whether each sample has a position that can carry loss)."""
    ds = load_split(workdir.dataset("train")).with_format("numpy")
    lengths = [int(n) for n in ds["num_tokens"]]
    if not assistant_only:
        return lengths, np.array([min(n, max_seq_len) > 2 for n in lengths], dtype=bool)
    ok = np.array([bool(np.asarray(m[2:max_seq_len]).any()) for m in ds["loss_mask"]], dtype=bool)
    return lengths, ok


class RoundSchedule:
    """Global step -> (round, step in round); each round's micro-batches as window positions."""

    def __init__(self, plan: windows.WindowPlan, lengths: list[int], trainable: np.ndarray, batching: Batching, *,
                 rank: int, world: int, grad_accum: int, epochs: int):
        self.plan, self.epochs = plan, epochs
        self._inputs = (plan, lengths, trainable, batching, grad_accum, epochs)  # for `for_world`
        self.plans: list[EpochPlan] = []
        self.starts: list[int] = []
        self.steps: list[int] = []
        start = 0
        for r in range(plan.rounds):
            samples = plan.window_of(r)["samples"]
            b = Batching(batching.batch_tokens, batching.max_seq_len, batching.seed + 1_000_003 * (r + 1),
                         packed=batching.packed)
            keep = [k for k, i in enumerate(samples) if trainable[i]]
            ep = EpochPlan([lengths[i] for i in samples], b, rank=rank, world=world, grad_accum=grad_accum,
                           samples=keep)
            n = ep.steps_for_epochs(epochs)
            self.plans.append(ep)
            self.starts.append(start)
            self.steps.append(n)
            start += n
        self.total = start

    def locate(self, step: int) -> tuple[int, int]:
        for r in range(len(self.steps)):
            if step < self.starts[r] + self.steps[r]:
                return r, step - self.starts[r]
        raise AssertionError((step, self.total))

    def end(self, round_index: int) -> int:
        """The global step count once round r is trained."""
        return self.starts[round_index] + self.steps[round_index]

    def rounds_done(self, step: int) -> int:
        return sum(1 for r in range(len(self.steps)) if self.end(r) <= step)

    def micro_batches(self, step: int) -> tuple[int, list[list[int]]]:
        r, s = self.locate(step)
        return r, self.plans[r].micro_batches(s)

    def position(self, step: int) -> dict:
        """A checkpoint's data position: the round of the last step and its steps done."""
        if step == 0:
            return {"epoch": 0, "batch_in_epoch": 0}
        r, s = self.locate(step - 1)
        return {"epoch": r, "batch_in_epoch": s + 1}

    def for_world(self, world: int) -> "RoundSchedule":
        """The same rounds dealt to `world` processes (rank 0's view: the step counts are every rank's)."""
        plan, lengths, trainable, batching, grad_accum, epochs = self._inputs
        return RoundSchedule(plan, lengths, trainable, batching, rank=0, world=world, grad_accum=grad_accum,
                             epochs=epochs)

    def fill_unrecorded(self, ckpt: TrainCheckpoint, path: Path, world: int) -> TrainCheckpoint:
        """A version 1 checkpoint (eagle3/artifacts/train_outputs.py) records neither its process
        count nor its rounds. Taken as written by this run's count when this schedule puts its
        step where the checkpoint says its data stood (a round and the steps done in it: the
        round does not depend on the count); then its rounds are this schedule's. Otherwise
        refused: rounds counted under another count could delete a round never trained."""
        if ckpt.rounds_trained is not None:
            return ckpt
        recorded = {"epoch": ckpt.epoch, "batch_in_epoch": ckpt.batch_in_epoch}
        if ckpt.step > self.total or self.position(ckpt.step) != recorded:
            raise PipelineError(
                f"{path} was written by older code that did not record its process count, and under this run's "
                f"{world} process(es) step {ckpt.step} does not stand where it says its data stood (round "
                f"{ckpt.epoch}, {ckpt.batch_in_epoch} of its steps done): rerun with the process count that wrote it "
                f"(`torchrun --nproc-per-node N {WorkDir.script('train')} ARGS`), or pass --force to train from "
                f"scratch.")
        trained = self.rounds_done(ckpt.step)
        log.warning("%s records no process count (older code): taken as this run's %d, which puts its step %d "
                    "where its data stood; it covers %d round(s)", path, world, ckpt.step, trained)
        return dataclasses.replace(ckpt, batch_geometry={"processes": world}, rounds_trained=trained)

    def resume_step(self, ckpt: TrainCheckpoint, path: Path, world: int) -> int:
        """The step of this schedule (`world` processes) at which the training `ckpt` holds
        goes on (the module docstring says why another count maps by rounds)."""
        processes = ckpt.batch_geometry["processes"]
        if processes == world:
            return ckpt.step
        trained = ckpt.rounds_trained
        # `position` of a round's last step is (that round, its step count): a checkpoint
        # at the end of round trained - 1; otherwise its last step lies inside round `trained`.
        if ckpt.step == 0 or ckpt.epoch == trained - 1:
            return self.starts[trained] if trained < len(self.starts) else self.total
        theirs = self.for_world(processes)
        raise PipelineError(
            f"{path} was written by {processes} process(es) in the middle of round {ckpt.epoch} "
            f"({ckpt.batch_in_epoch} of its {theirs.steps[ckpt.epoch]} steps done); this run has {world}, which "
            f"deals that round's samples into other steps, so no step of it continues where the checkpoint "
            f"stopped. Finish the round with the count that wrote it: `torchrun --nproc-per-node {processes} "
            f"{WorkDir.script('train')} ARGS --stop-after {theirs.end(ckpt.epoch)}` (your arguments; `python` "
            f"for 1 process) saves at the round's end, from which any count resumes. Or pass --force to train "
            f"from scratch.")


class Rounds:
    """The rounds' folders as the trainer meets them: open in order, delete once covered."""

    def __init__(self, workdir: WorkDir, main: HiddenStateStore, schedule: RoundSchedule, *, windows_dir: str | None,
                 keep: bool, wait_s: float, rank: int = 0, world: int = 1):
        self.workdir, self.main, self.schedule = workdir, main, schedule
        self.dir = windows.windows_dir(workdir.store(), windows_dir)
        self.keep, self.wait_s = keep, wait_s
        self.rank, self.world, self.main_rank = rank, world, rank == 0
        self.current: int | None = None
        self.split = None
        self.index_of: list[int | None] = []  # window position -> index in the round's split (None: rejected)

    def _open(self, round_index: int) -> bool:
        d = self.dir / windows.round_name(round_index)
        if windows.read_complete(d) is None:
            return False  # not extracted yet, or still being written
        # Every rank checks the sizes, and reads its share of the files (file i: rank i mod
        # the count) to check their checksums: a round its writer called complete and whose
        # bytes differ is damaged, not late. The ranks read at once, so the collective in
        # `ensure` waits for the slowest share, not for one rank reading the whole window.
        problem = windows.window_problem(d, verify_checksums=False)
        for entry in [] if problem else windows.read_complete(d)["files"][self.rank::self.world]:
            problem = store.file_problem(d, entry, verify_checksum=True)
            if problem:
                break
        if problem:
            raise PipelineError(f"stage 04: round {round_index} is damaged ({problem}); rerun `python "
                                f"{WorkDir.script('extract')} --window {round_index}` with your --config and --disk-budget: it "
                                f"checks every file of the round and redoes the damaged ones.")
        # The round's identity is its store.json, which its index.json names by hash (eagle3/artifacts/store).
        need, script = "stage 04 (train)", f"{WorkDir.script('extract')} --window {round_index}"
        index = json.loads((d / store.INDEX_JSON).read_text())
        identity = store.read_identity(d, needed_by=need, fix=f"delete {d} and rerun `python {script}`")
        index = {**index, "identity": store.index_identity(index, identity, d, needed_by=need, script=script)}
        ours = {k: v for k, v in index["identity"].items() if k not in _ROUND_KEYS}
        theirs = {k: v for k, v in self.main.index["identity"].items() if k not in _ROUND_KEYS}
        if ours != theirs or index["identity"].get("round") != round_index:
            diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
            raise PipelineError(f"stage 04: {d} was extracted for another store or round (differs in {diff or 'round'} "
                                f"from {self.workdir.store() / store.INDEX_JSON}); delete it and rerun stage 02 with "
                                f"--window {round_index}.")
        # The checksums were verified just now (each rank its share): the reader checks sizes only.
        st = HiddenStateStore(d, index, None, verify="off", needed_by="stage 04 (train)")
        self.split = st.split("train")
        mapping, k = [], 0
        for e in self.split.files:
            rejected = set(e["rejected"])
            for j in range(e["num_samples"]):
                mapping.append(None if j in rejected else k)
                k += j not in rejected
        self.index_of, self.current = mapping, round_index
        log.info("stage 04: training on round %d (%s, %d samples, steps %d..%d)", round_index, d, len(mapping),
                 self.schedule.starts[round_index], self.schedule.end(round_index))
        return True

    def ensure(self, step: int) -> bool:
        """Open the round of `step`; False when it is not extracted (after --window-wait-s).

        Every rank gives the same answer: a round completed right at the deadline can be
        found by one rank and not by another, and a rank that trained on alone would wait
        forever in its first collective for the ones that stopped. So the ranks sum what
        they found (one pair of scalars, at a round's first step only): all go on only if
        all opened it, and a damaged round stops every rank."""
        r, _ = self.schedule.locate(step)
        if self.current == r:
            return True
        self.close()
        error = None
        try:
            opened = self._wait_open(r)
        except PipelineError as e:
            opened, error = False, e
        missing, damaged = all_reduce_sum(torch.tensor([float(not opened and error is None),
                                                        float(error is not None)], dtype=torch.float64)).tolist()
        if error is not None:
            raise error
        if damaged:
            raise PipelineError(f"stage 04: another rank found round {r} damaged (its log says how); stopping at "
                                f"step {step}.")
        if missing:
            d = self.dir / windows.round_name(r)
            self.split, self.current = None, None
            # The advice names the windows folder when it is not the default: without it the
            # round would be written into the work dir's own windows folder, never read here.
            shared = "" if self.dir == windows.windows_dir(self.workdir.store(), None) else f" --windows-dir {self.dir}"
            log.warning("stage 04: round %d is not extracted yet (%s has no complete %s on %s; the folder is %s): "
                        "stopping at step %d of %d. Run `python %s --window %d%s` (same --config and "
                        "--disk-budget), then rerun this command; `python -m eagle3.tools.window_loop` does both "
                        "in turn.", r, d, windows.COMPLETE_JSON,
                        "this rank" if not opened else f"{int(missing)} other rank(s)",
                        windows.round_state(d, windows.Watch()), step, self.schedule.total,
                        WorkDir.script("extract"), r, shared)
            return False
        return True

    def _wait_open(self, round_index: int) -> bool:
        """Open round r on this rank, waiting up to --window-wait-s for it to be complete; rank 0
        logs, at once and every `windows.WAIT_LOG_S` seconds, the round it waits for and its
        folder's state (missing, claimed by host:pid and the heartbeat's age, ...)."""
        started = time.monotonic()
        deadline, next_log, watch = started + self.wait_s, started, windows.Watch()
        while not self._open(round_index):
            now = time.monotonic()
            if now >= deadline:
                return False
            if self.main_rank and now >= next_log:
                d = self.dir / windows.round_name(round_index)
                log.info("stage 04: waiting for round %d (%s): %s; waited %.0f s of --window-wait-s %.0f", round_index, d,
                         windows.round_state(d, watch), now - started, self.wait_s)
                next_log = now + windows.WAIT_LOG_S
            time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        return True

    def micro_batches(self, step: int) -> list[list[int]]:
        r, micro = self.schedule.micro_batches(step)
        assert r == self.current, (r, self.current)
        out = []
        for idx in micro:
            kept = [self.index_of[i] for i in idx if self.index_of[i] is not None]
            if not kept:
                raise PipelineError(f"stage 04: every sample of a micro-batch of step {step} (round {r}) was rejected "
                                    f"by stage 02 for NaN/Inf; fix the target's dtype (stage 02 --dtype float32) "
                                    f"and re-extract.")
            out.append(kept)
        return out

    def is_end(self, step: int) -> bool:
        return self.schedule.rounds_done(step) > self.schedule.rounds_done(step - 1)

    def close(self) -> None:
        """Let go of the open round's files. Its store and split reference each other, so
        dropping them frees their mappings only at the next garbage collection: forced here.
        A file of the round still mapped after it (a tensor kept somewhere) is logged."""
        if self.current is None and self.split is None:
            return
        folder = self.dir / windows.round_name(self.current) if self.current is not None else None
        self.split, self.current, self.index_of = None, None, []
        gc.collect()
        held = mapped_files(folder) if folder is not None else []
        if held:
            log.warning("stage 04 (rank %d): %s still mapped after closing its round (a tensor of it is kept); on "
                        "NFS their deletion leaves .nfs files until this process exits", self.rank,
                        ", ".join(held[:3]))

    def covered(self, step: int, checkpoint: Path) -> None:
        """A checkpoint at `step` is on disk (rank 0 saved it, fsynced): record the rounds it
        covers, then delete them. A collective: every rank calls it at the same step, lets
        go of the covered round's files, and the ranks meet before rank 0 deletes them."""
        done = self.schedule.rounds_done(step)
        if self.current is not None and self.current < done:
            self.close()
        barrier()  # no rank maps a file rank 0 is about to delete
        if not self.main_rank:
            return
        pointer = self.workdir.latest_checkpoint()
        assert checkpoint.is_file() and json.loads(pointer.read_text())["file"] == checkpoint.name, (
            f"round(s) up to {done - 1} would be deleted, but {pointer} does not name {checkpoint}: the trainer must "
            f"save at every round's end before `covered`")
        _kill_point(f"covered:{done - 1}")
        windows.write_progress(self.dir, done, checkpoint.name, step)
        if self.keep:
            return
        for r in windows.sweep(self.dir, done):
            log.info("stage 04: round %d deleted (covered by %s)", r, checkpoint)

    def resumed(self, done: int, step: int, checkpoint: Path | None) -> None:
        """At the start, from `checkpoint` (None: from scratch), which covers `done` rounds at its
        `step`: progress.json says so, up or down, before anything is deleted or the run stops;
        then the folders of the rounds it covers go. Rank 0; the others return."""
        if not self.main_rank:
            return
        try:
            recorded = windows.read_progress(self.dir)["trained_rounds"]
        except PipelineError as e:
            log.warning("stage 04: %s Rewriting it from %s.", e, checkpoint or "the start (no checkpoint)")
            recorded = None
        if recorded != done:
            if recorded is not None and recorded > done:
                log.warning("stage 04: %s says %d round(s) trained, but the checkpoint this run resumes (%s) covers "
                            "%d: rewritten to %d. Rounds %d.. are trained again; stage 02 extracts those already "
                            "deleted again.", self.dir / windows.PROGRESS_JSON, recorded,
                            checkpoint or "none: from scratch", done, done, done)
            windows.write_progress(self.dir, done, checkpoint.name if checkpoint is not None else None, step)
        if self.keep:
            return
        for r in windows.sweep(self.dir, done):
            log.info("stage 04: round %d deleted (covered by %s)", r, checkpoint)


def mapped_files(folder: Path) -> list[str]:
    """The files under `folder` this process maps (Linux /proc/self/maps; [] elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    prefix = str(Path(folder).resolve()) + os.sep
    columns = [line.split(maxsplit=5) for line in lines]  # address perms offset dev inode [path]
    paths = {c[5].removesuffix(" (deleted)") for c in columns if len(c) == 6}
    return sorted(path for path in paths if path.startswith(prefix))
