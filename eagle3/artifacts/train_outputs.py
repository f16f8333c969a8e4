"""Stage 04's outputs as the stages and tools after it read them: its checkpoint
(`TrainCheckpoint`, written by eagle3/stages/s04_train/checkpoint.py `save_checkpoint`,
read by `read_checkpoint` for stage 04's resume and for stage 05), the checkpoints that
hold held-out metrics (`evaluated_checkpoints`, stage 06's candidates) and the metrics log
(`read_train_metrics`).

A checkpoint is a typed record like a manifest's (eagle3/artifacts/records.py): the fields of
`TrainCheckpoint` are its keys, named there and nowhere else. On disk it is a plain dict
(`to_file`) saved with `torch.save` and loaded with `torch.load(weights_only=True,
mmap=True)` (a dataclass would need pickled code). The reader takes all of them or
refuses: a file that lacks a field (older code) or holds one this code does not know,
or whose `format_version` is newer than `CHECKPOINT_FORMAT`, is refused naming the file
and the fix. Adding, renaming or removing a field changes the format: bump
`CHECKPOINT_FORMAT` (its resume check refuses older files, which `--force` discards).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError

log = logging.getLogger(__name__)

# 1: the fields of TrainCheckpoint below but `batch_geometry` and `rounds_trained`. Files
# written before the format had a version hold exactly those and no `format_version`: they
# are read as version 1. 2: + batch_geometry (the process count is part of what a step
# reads) and rounds_trained (over windows, the record of what is trained). A version 1 file
# is still read (weeks of training are not thrown away by an upgrade): its two fields come
# back as `{}` and None, "not recorded", which stage 04's resume fills in or refuses
# (eagle3/stages/s04_train/windows.py `RoundSchedule.fill_unrecorded`) and export never reads.
CHECKPOINT_FORMAT = 2
_ADDED_IN_2 = {"batch_geometry": {}, "rounds_trained": None}
_VERSION_KEY = "format_version"


@dataclass(frozen=True)
class TrainCheckpoint:
    """One stage 04 checkpoint: everything a resume needs, and what export reads."""

    model: dict  # the drafter's state dict under convention 6 names (what export saves): name -> tensor
    drafter_config: dict  # DrafterConfig.to_dict()
    aux_layers: list  # the store's aux layer ids the drafter reads (convention 1), checked at stage 04's start
    optimizer: dict  # torch.optim.AdamW.state_dict()
    scheduler: dict  # the LambdaLR's state_dict()
    step: int  # optimizer steps taken
    epoch: int  # the data position after `step`: the epoch (over windows: the round) of the last step taken
    batch_in_epoch: int  # and how many of its steps are done ((0, 0) at the start)
    # What decides which samples a step reads: {"processes", "grad_accum", "batch_tokens",
    # "max_seq_len", "packing"}. The process count is not part of the identity (a resume may
    # change it), so the same step number means other data under another count.
    batch_geometry: dict
    # Over windows (stage 02's --disk-budget): the rounds whose every step this checkpoint
    # holds, the record of what is trained (progress.json is derived from it, and no round
    # from this one on is ever deleted); 0 without windows. `{}` / None: a version 1 file,
    # which recorded neither.
    rounds_trained: int | None
    # One entry per rank, by rank: that process's torch CPU generator state and, on a GPU,
    # its own GPU's (never the other GPUs': each rank restores its own entry, so a
    # resumed run draws what each rank would have drawn).
    rng: list
    train_config: dict  # the TrainConfig's identity parameters
    identity: str  # the fingerprint of those parameters and the inputs: a resume needs the same
    best: dict  # the best held-out expected accept length so far and its step ("step" None before any)
    eval: dict  # the held-out metrics at this step; {} when it was not evaluated here

    def to_file(self) -> dict[str, Any]:
        """The dict `torch.save` writes: the fields by name and the format version."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, _VERSION_KEY: CHECKPOINT_FORMAT}

    @classmethod
    def from_file(cls, data: Any, path: Path) -> "TrainCheckpoint":
        """The record from a loaded checkpoint file, refused (naming `path`) unless it is exactly
        this format's fields."""
        fix = (f"pass a file from WORK/04_train/checkpoints/ written by this code, or rerun `python "
               f"{WorkDir.script('train')} --force` to train it again")
        if not isinstance(data, dict):
            raise PipelineError(f"{path} is not a stage 04 checkpoint: it holds a {type(data).__name__}, not a dict; "
                                f"{fix}.")
        version = data.get(_VERSION_KEY, 1)
        if version == 1 and not set(_ADDED_IN_2) & set(data):  # version 2 with its two fields not recorded
            data, version = {**data, **_ADDED_IN_2}, CHECKPOINT_FORMAT
        if version != CHECKPOINT_FORMAT:
            raise PipelineError(f"{path} has checkpoint format {version}, this code reads {CHECKPOINT_FORMAT} "
                                f"(eagle3/artifacts/train_outputs.py); use the code that wrote it, or {fix}.")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        unknown = sorted(set(data) - set(names) - {_VERSION_KEY})
        if missing or unknown:
            what = "; ".join(x for x in (f"lacks {missing}" if missing else "",
                                         f"holds unknown {unknown}" if unknown else "") if x)
            raise PipelineError(f"{path} is not a stage 04 checkpoint of this code: it {what}; {fix}.")
        return cls(**{n: data[n] for n in names})


def read_checkpoint(path: Path | str) -> TrainCheckpoint:
    """A stage 04 checkpoint, memory-mapped: its tensors are pages of the file, read when touched.

    Every rank of a torchrun resume loads the same file at once. Read whole, each process
    holds its own copy of everything in it: for Kimi-K2.5's drafter (~0.96B parameters)
    fp32 weights and two AdamW moments are ~11.6 GB, ~93 GB of host memory on 8 ranks,
    before a single tensor reaches a GPU. Mapped, the ranks share the page cache's one
    copy of the file, and a GPU rank's copies go to the device; export reads only the
    weights, not the optimizer state beside them.

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
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"checkpoint {path} does not exist; pass --checkpoint with a file from "
                            f"WORK/04_train/checkpoints/ or run `python {WorkDir.script('train')}` first.")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - unpickling raises many types
        raise PipelineError(f"cannot read checkpoint {path} with torch.load(weights_only=True, mmap=True) "
                            f"({type(e).__name__}: {e}); delete it, or pass --force to stage 04 to train from "
                            f"scratch.") from e
    return TrainCheckpoint.from_file(data, path)


def read_train_metrics(workdir: WorkDir) -> list[dict]:
    """04_train/metrics.jsonl's rows in order (eagle3/stages/s04_train/metrics.py writes them:
    one per log window, "split" "train", and one per held-out evaluation, "split" "eval");
    empty before stage 04 logged anything."""
    path = workdir.train_metrics()
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def evaluated_checkpoints(workdir: WorkDir, up_to: int | None = None) -> list[tuple[Path, TrainCheckpoint]]:
    """The step files of 04_train/checkpoints/ that hold held-out metrics (`eval`), by step,
    memory-mapped (the weights are read only when touched), at or below step `up_to` when
    given: what stage 04's --keep-evaluated keeps and stage 06's --select-checkpoint serves.
    An unreadable file is left out, logged with the reason."""
    folder = workdir.checkpoints()
    steps = sorted(s for s in map(workdir.checkpoint_step, folder.iterdir()) if s is not None) if folder.is_dir() else []
    found = []
    for s in steps:
        if up_to is not None and s > up_to:
            continue
        try:
            ckpt = read_checkpoint(workdir.checkpoint(s))
        except PipelineError as e:
            log.warning("%s is left out of the evaluated checkpoints: %s", workdir.checkpoint(s), e)
            continue
        if ckpt.eval:
            found.append((workdir.checkpoint(s), ckpt))
    return found
