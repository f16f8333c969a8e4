"""Training checkpoints: everything a resume needs, written atomically.

A checkpoint is a `TrainCheckpoint` (eagle3/artifacts/train_outputs.py: its fields are the
file's keys, each with what it holds; `read_checkpoint` is the one reader, for the resume
here and for stage 05). File names come from WorkDir: one per saved step, the best one,
and a JSON pointer to the latest (what a resume reads).

Every file is written atomically and fsynced with its folder (eagle3/artifacts/atomic.py)
before `save_checkpoint` returns: what stage 04 deletes after it (a trained window, older
checkpoints) is only deleted once the checkpoint that replaces it is on disk.

A resume (`latest_checkpoint`) takes the file latest.json names. When latest.json is torn
or missing, or the file it names is missing or unreadable (a power loss, a full disk, a
truncated copy), it takes the newest readable step file instead and logs each file it
skipped and why; only when none can be read does it stop, naming them all. A checkpoint
of another run's identity is refused, never skipped: the folder is another run's.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from eagle3.artifacts.atomic import save_torch, write_json
from eagle3.artifacts.train_outputs import TrainCheckpoint, evaluated_checkpoints, read_checkpoint
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train.distributed import all_gather_object

log = logging.getLogger(__name__)


def rng_state(device: torch.device) -> dict:
    """This process's generator states: torch's CPU generator and, training on a GPU, that
    GPU's only. (`torch.cuda.get_rng_state_all` would touch, and create a context on,
    every visible GPU from every rank.)"""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def rng_states_of_all_ranks(device: torch.device) -> list[dict]:
    """Every rank's `rng_state`, by rank, for rank 0 to write. A collective: every rank calls it."""
    return all_gather_object(rng_state(device))


def set_rng_state(states: list[dict], rank: int, world: int, device: torch.device) -> None:
    """Restore this rank's own entry of a checkpoint's `rng`.

    A checkpoint of another process count gives rank r the entry r mod its count (a
    resume stays possible; draws after it are not those of an unbroken run).
    """
    if len(states) != world:
        log.warning("the checkpoint holds the RNG states of %d process(es), this run has %d: rank %d restores "
                    "entry %d", len(states), world, rank, rank % len(states))
    state = states[rank % len(states)]
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def checkpoints_to_prune(steps: list[int], current: int, *, keep: int, evaluated: set[int],
                         keep_evaluated: int) -> list[int]:
    """The step files `save_checkpoint` deletes after writing step `current`, of the `steps`
    in the folder: of those below it, all but the newest `keep - 1`, and every one above it
    (written before a resume that renumbered the steps, eagle3/stages/s04_train/windows.py
    `resume_step`, or skipped by it as unreadable: this one supersedes them); keep <= 0:
    none. `current` itself, the resume point latest.json names, is never deleted.

    `keep_evaluated` > 1 (--keep-evaluated) also spares the newest `keep_evaluated` of the
    `evaluated` steps (files that hold held-out metrics) at or below `current`: the
    candidates stage 06's --select-checkpoint serves. 1 spares nothing more: today's rule."""
    if keep <= 0:
        return []
    older = sorted(s for s in steps if s < current)
    doomed = older[:max(0, len(older) - (keep - 1))]
    spared = set(sorted(s for s in evaluated if s <= current)[-keep_evaluated:]) if keep_evaluated > 1 else set()
    return [s for s in doomed if s not in spared] + sorted(s for s in steps if s > current)


def save_checkpoint(workdir: WorkDir, ckpt: TrainCheckpoint, *, keep: int, is_best: bool, keep_evaluated: int = 1) -> Path:
    """Write `ckpt` (and best.pt when `is_best`), point latest.json at it, then prune the step
    files `checkpoints_to_prune` names (best.pt is never pruned)."""
    path = workdir.checkpoint(ckpt.step)
    save_torch(path, ckpt.to_file())
    if is_best:
        save_torch(workdir.best_checkpoint(), ckpt.to_file())
    write_json(workdir.latest_checkpoint(), {"step": ckpt.step, "file": path.name, "identity": ckpt.identity})
    steps = sorted(s for s in map(workdir.checkpoint_step, workdir.checkpoints().iterdir()) if s is not None)
    evaluated = ({workdir.checkpoint_step(p) for p, _ in evaluated_checkpoints(workdir, up_to=ckpt.step)}
                 if keep_evaluated > 1 else set())
    for s in checkpoints_to_prune(steps, ckpt.step, keep=keep, evaluated=evaluated, keep_evaluated=keep_evaluated):
        workdir.checkpoint(s).unlink(missing_ok=True)
    return path


def latest_checkpoint(workdir: WorkDir, identity: str) -> TrainCheckpoint | None:
    """The checkpoint to resume from (see the module docstring), or None when there is none."""
    pointer, folder = workdir.latest_checkpoint(), workdir.checkpoints()
    steps = sorted((s for s in map(workdir.checkpoint_step, folder.iterdir()) if s is not None),
                   reverse=True) if folder.is_dir() else []
    candidates = [workdir.checkpoint(s) for s in steps]
    skipped: list[str] = []
    if not pointer.is_file():
        if not steps:
            return None
        skipped.append(f"{pointer} (missing)")
    else:
        try:
            named = folder / json.loads(pointer.read_text())["file"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            skipped.append(f"{pointer} (unreadable: {type(e).__name__}: {e})")
        else:
            candidates = [named] + [c for c in candidates if c != named]
    for path in candidates:
        if not path.is_file():
            skipped.append(f"{path} (missing)")
            continue
        try:
            ckpt = read_checkpoint(path)  # memory-mapped (its docstring says why)
        except PipelineError as e:
            skipped.append(f"{path} ({e})")
            continue
        if ckpt.identity != identity:
            raise PipelineError(
                f"{path} belongs to a run with other parameters or inputs (identity {ckpt.identity[:12]}, "
                f"this run {identity[:12]}); pass --force to discard its checkpoints and start over, or use "
                f"another --work-dir.")
        if skipped:
            log.warning("resuming from %s, the newest readable checkpoint; skipped: %s", path, "; ".join(skipped))
        return ckpt
    raise PipelineError(f"no checkpoint in {folder} can be read: {'; '.join(skipped)}. Restore one from a copy, or "
                        f"pass --force to train from scratch.")
