"""The draft vocabulary's arithmetic, shared by every stage that reads `d2t` (docs/CONVENTIONS.md §2).

Stage 03 writes `d2t` as offsets: draft position i predicts target id `i + d2t[i]`.
Training, export, evaluation and the engines' rules all read it back through
`target_ids`, so the convention has one spelling. Its files (03_vocab/d2t.pt, t2d.pt) are
written by `save_mapping` and read by `load_mapping`, nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from eagle3.artifacts.atomic import save_torch
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError


def coverage(freq: np.ndarray, t2d: np.ndarray) -> float:
    """Share of (assistant) token occurrences whose id is in the draft vocabulary."""
    total = int(np.asarray(freq).sum())
    return float(np.asarray(freq)[t2d].sum() / total) if total else float("nan")


def target_ids(d2t):
    """The target id of each draft position: i + d2t[i] (numpy or torch, int64)."""
    try:
        import torch
        if isinstance(d2t, torch.Tensor):
            return torch.arange(d2t.numel(), dtype=torch.int64, device=d2t.device) + d2t.reshape(-1).to(torch.int64)
    except ImportError:  # numpy-only callers
        pass
    d2t = np.asarray(d2t)
    return np.arange(d2t.size, dtype=np.int64) + d2t.reshape(-1).astype(np.int64)


def d2t_from_ids(ids):
    """The offsets d2t[i] = ids[i] - i for sorted target ids (the inverse of `target_ids`)."""
    try:
        import torch
        if isinstance(ids, torch.Tensor):
            return ids.to(torch.int64) - torch.arange(ids.numel(), dtype=torch.int64, device=ids.device)
    except ImportError:
        pass
    ids = np.asarray(ids, dtype=np.int64)
    return ids - np.arange(len(ids), dtype=np.int64)


@dataclass
class VocabMapping:
    """A draft vocabulary: target id of each draft position (convention 2 order)."""

    source: str
    target_ids: np.ndarray  # int64 [draft_vocab]
    vocab_size: int | None

    @property
    def draft_vocab_size(self) -> int:
        return len(self.target_ids)


def compare_mappings(a: VocabMapping, b: VocabMapping) -> dict[str, Any]:
    """Positions differing (i: a's id != b's id), tokens shared, tokens only in a or b."""
    n = min(a.draft_vocab_size, b.draft_vocab_size)
    differing = int((a.target_ids[:n] != b.target_ids[:n]).sum()) + abs(a.draft_vocab_size - b.draft_vocab_size)
    sa, sb = set(a.target_ids.tolist()), set(b.target_ids.tolist())
    return {
        "a": {"source": a.source, "draft_vocab_size": a.draft_vocab_size, "vocab_size": a.vocab_size},
        "b": {"source": b.source, "draft_vocab_size": b.draft_vocab_size, "vocab_size": b.vocab_size},
        "positions_compared": max(a.draft_vocab_size, b.draft_vocab_size),
        "positions_differing": differing,
        "tokens_shared": len(sa & sb),
        "only_in_a": len(sa - sb),
        "only_in_b": len(sb - sa),
    }


def save_mapping(workdir: WorkDir, d2t: np.ndarray, t2d: np.ndarray) -> list:
    """Write stage 03's mapping (03_vocab/d2t.pt, t2d.pt, torch tensors). Returns the files.

    One copy: every reader goes through `load_mapping`, and the engines never read these
    files (stage 05 writes d2t and t2d into the drafter's safetensors)."""
    import torch

    save_torch(workdir.d2t(), torch.from_numpy(np.asarray(d2t)))
    save_torch(workdir.t2d(), torch.from_numpy(np.asarray(t2d)))
    return [workdir.d2t(), workdir.t2d()]


def load_mapping(workdir: WorkDir):
    """(d2t int64 [draft_vocab], t2d bool [target_vocab]) as torch tensors, as stage 03 wrote them
    (stages 04 and 05, tools/forecast.py, and tools/diagnose's compare-vocab on a work dir)."""
    import torch

    for f in (workdir.d2t(), workdir.t2d()):
        if not f.is_file():
            raise PipelineError(f"{f} does not exist; run `python {WorkDir.script('vocab')}` first.")
    return torch.load(workdir.d2t(), weights_only=True), torch.load(workdir.t2d(), weights_only=True)
