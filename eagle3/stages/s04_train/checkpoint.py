"""Training checkpoints: everything a resume needs, written atomically.

A checkpoint is a `TrainCheckpoint` (eagle3/artifacts/train_outputs.py: its fields are the
file's keys, each with what it holds; `read_checkpoint` is the one reader, for the resume
here and for stage 05). File names come from WorkDir: one per saved step, the best one,
and a JSON pointer to the latest (what a resume reads).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from eagle3.artifacts.atomic import save_torch, write_json
from eagle3.artifacts.train_outputs import TrainCheckpoint, read_checkpoint
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


def save_checkpoint(wd: WorkDir, ckpt: TrainCheckpoint, *, keep: int, is_best: bool) -> Path:
    path = wd.checkpoint(ckpt.step)
    save_torch(path, ckpt.to_file())
    if is_best:
        save_torch(wd.best_checkpoint(), ckpt.to_file())
    write_json(wd.latest_checkpoint(), {"step": ckpt.step, "file": path.name, "identity": ckpt.identity})
    steps = sorted(s for s in map(wd.checkpoint_step, wd.checkpoints().iterdir()) if s is not None)
    for s in steps[:-keep] if keep > 0 else []:
        wd.checkpoint(s).unlink(missing_ok=True)
    return path


def latest_checkpoint(wd: WorkDir, identity: str) -> TrainCheckpoint | None:
    """The checkpoint to resume from, or None. Refuses one from another run setup."""
    pointer = wd.latest_checkpoint()
    if not pointer.is_file():
        return None
    info = json.loads(pointer.read_text())
    if info["identity"] != identity:
        raise PipelineError(
            f"{pointer} belongs to a run with other parameters or inputs (identity {info['identity'][:12]}, "
            f"this run {identity[:12]}); pass --force to discard its checkpoints and start over, or use "
            f"another --work-dir.")
    path = wd.checkpoint(info["step"])
    if not path.is_file():
        raise PipelineError(f"{pointer} names {path}, which is missing; pass --force to start over.")
    return read_checkpoint(path)  # memory-mapped (its docstring says why)
