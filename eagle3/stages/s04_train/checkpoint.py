"""Training checkpoints: everything a resume needs, written atomically.

One file per checkpoint, a dict saved with `torch.save` and read with
`torch.load(weights_only=True)`:

    model            drafter state_dict (convention 6 names; what export saves)
    drafter_config   DrafterConfig.to_dict()
    aux_layers       the target layers the drafter reads (convention 1)
    optimizer, scheduler, step, epoch
    rng              one entry per rank, by rank: that process's torch CPU generator state
                     and, on a GPU, its own GPU's (never the other GPUs': each rank restores
                     its own entry, so a resumed run draws what each rank would have drawn)
    train_config     the TrainConfig's identity parameters; identity (its fingerprint)
    eval             the held-out metrics at this step (when evaluated)
    best             the best held-out expected accept length so far and its step

Later stages read a checkpoint through eagle3/core/train_outputs.py, the one reader of
this format outside stage 04. File names come from WorkDir: one per saved step, the best one, and a JSON pointer
to the latest (what a resume reads).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from eagle3.core.atomic import save_torch, write_json
from eagle3.core.errors import PipelineError
from eagle3.core.workdir import WorkDir
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


def set_rng_state(states: list[dict] | dict, rank: int, world: int, device: torch.device) -> None:
    """Restore this rank's own entry of a checkpoint's `rng`.

    A checkpoint of another process count gives rank r the entry r mod its count (a
    resume stays possible; draws after it are not those of an unbroken run). A dict is
    the format before per-rank entries: one CPU state and a list of every GPU's state,
    of which this rank takes its own GPU's.
    """
    if isinstance(states, dict):
        gpus = states.get("cuda") or []
        index = device.index or 0
        state = {"torch": states["torch"], **({"cuda": gpus[index]} if index < len(gpus) else {})}
    else:
        if len(states) != world:
            log.warning("the checkpoint holds the RNG states of %d process(es), this run has %d: rank %d restores "
                        "entry %d", len(states), world, rank, rank % len(states))
        state = states[rank % len(states)]
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(wd: WorkDir, ckpt: dict, *, keep: int, is_best: bool) -> Path:
    path = wd.checkpoint(ckpt["step"])
    save_torch(path, ckpt)
    if is_best:
        save_torch(wd.best_checkpoint(), ckpt)
    write_json(wd.latest_checkpoint(), {"step": ckpt["step"], "file": path.name, "identity": ckpt["identity"]})
    steps = sorted(s for s in map(wd.checkpoint_step, wd.checkpoints().iterdir()) if s is not None)
    for s in steps[:-keep] if keep > 0 else []:
        wd.checkpoint(s).unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict:
    """A checkpoint memory-mapped: its tensors are pages of the file, read when touched.

    Every rank of a torchrun resume loads the same file at once. Read whole, each process
    holds its own copy of everything in it: for Kimi-K2.5's drafter (~0.96B parameters)
    fp32 weights and two AdamW moments are ~11.6 GB, ~93 GB of host memory on 8 ranks,
    before a single tensor reaches a GPU. Mapped, the ranks share the page cache's one
    copy of the file, and a GPU rank's copies go to the device.

    What torch 2.13 requires and does (torch/serialization.py, `load`): `mmap=True` needs
    a path (not a buffer) and the zipfile format, which `torch.save` writes by default
    (a file saved with `_use_new_zipfile_serialization=False` is refused: "mmap can only
    be used with files saved with ..."); each storage is a slice of one
    `UntypedStorage.from_file` of the whole file, mapped MAP_PRIVATE
    (`get_default_mmap_options`). So writes to the loaded tensors never reach the file:
    a CPU run's optimizer keeps its moments as loaded (`Optimizer.load_state_dict` returns
    a tensor already of the parameter's dtype and device as it is) and updates them in
    place, on private copies of the pages it writes. The mapping holds the file's inode,
    so the file being replaced (atomic writes) or deleted (`keep_checkpoints`) later
    changes nothing the run reads.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - unpickling raises many types
        raise PipelineError(f"cannot read checkpoint {path} ({type(e).__name__}: {e}); delete it or pass --force "
                            f"to train from scratch.") from e


def latest_checkpoint(wd: WorkDir, identity: str) -> dict | None:
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
    return load_checkpoint(path)
