"""Stage 04's outputs as the stages and tools after it read them: a checkpoint's drafter and
metadata (`read_training_checkpoint`) and the metrics log (`read_train_metrics`).

A checkpoint is a dict saved with `torch.save` (eagle3/stages/s04_train/checkpoint.py
writes it and lists every key) and read with `torch.load(weights_only=True)`. Outside
stage 04 only "model" (the drafter's state dict, convention 6 names), "drafter_config"
(`DrafterConfig.to_dict()`) and the metadata ("step", "aux_layers", "eval": the held-out
metrics at that step when evaluated, "best") are read, through `read_training_checkpoint`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3.core.errors import PipelineError
from eagle3.core.workdir import WorkDir

# Read as metadata: everything but the weights and the resume state.
_NOT_METADATA = ("model", "drafter_config", "optimizer", "scheduler", "rng", "rng_state", "scaler",
                 "data_state", "sampler")


def read_training_checkpoint(path: Path | str) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(DrafterConfig dict, state dict under convention 6 names, metadata) of a stage 04 checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"checkpoint {path} does not exist; pass --checkpoint with a file from "
                            f"WORK/04_train/checkpoints/ or run `python {WorkDir.script('train')}` first.")
    try:
        # mmap: only the tensors used here are read, not the optimizer state beside them.
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - unpickling raises many types
        raise PipelineError(f"cannot read checkpoint {path} with torch.load(weights_only=True) "
                            f"({type(e).__name__}: {e}); is it a stage 04 checkpoint?") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt or "drafter_config" not in ckpt:
        keys = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise PipelineError(f"{path} is not a stage 04 checkpoint: expected a dict with 'model' and "
                            f"'drafter_config', got {keys}.")
    state = {}
    for k, v in ckpt["model"].items():
        for prefix in ("module.", "_orig_mod."):  # DDP / torch.compile wrappers
            if k.startswith(prefix):
                k = k[len(prefix):]
        state[k] = v
    meta = {k: v for k, v in ckpt.items() if k not in _NOT_METADATA}
    return dict(ckpt["drafter_config"]), state, meta


def read_train_metrics(wd: WorkDir) -> list[dict]:
    """04_train/metrics.jsonl's rows in order (eagle3/stages/s04_train/metrics.py writes them:
    one per log window, "split" "train", and one per held-out evaluation, "split" "eval");
    empty before stage 04 logged anything."""
    path = wd.train_metrics()
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
