"""Stage 03: the draft vocabulary, as `d2t` / `t2d` (docs/CONVENTIONS.md §2).

Reads stage 01's assistant-token frequencies and writes

    03_vocab/d2t.pt, d2t.npy   int64 [draft_vocab]: offsets, target_id = i + d2t[i]
    03_vocab/t2d.pt, t2d.npy   bool  [target_vocab]: True for chosen ids
    03_vocab/manifest.json     with coverage on the train AND the held-out split

Run: `python 03_build_vocab_mapping.py --config configs/tiny-llama.yaml`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .atomic import save_numpy, save_torch
from .config import StageConfig, identity_params, param
from .errors import PipelineError
from .manifest import already_complete, manifest_fingerprint, read_manifest, write_manifest
from .target import load_tokenizer, tokenizer_fingerprint
from .workdir import WorkDir

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class VocabConfig(StageConfig):
    work_dir: Path = param(help="work directory (stage 01 must have run in it)")
    target_model: str | None = param(None, help="target model; when given, its tokenizer must be stage 01's")
    draft_vocab_size: int = param(32000, min=1, help="number of target tokens the drafter predicts")


# -- pure core -------------------------------------------------------------------
def select_draft_ids(freq: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """The `draft_vocab_size` most frequent ids (ties: lower id first), padded with the
    lowest unused ids when fewer distinct ids were seen, sorted ascending."""
    freq = np.asarray(freq)
    assert draft_vocab_size <= len(freq)
    ids = np.arange(len(freq))
    order = np.lexsort((ids, -freq))  # primary key: -freq; secondary: id
    seen = order[freq[order] > 0][:draft_vocab_size]
    if len(seen) < draft_vocab_size:
        unused = np.setdiff1d(ids, seen, assume_unique=True)  # ascending
        seen = np.concatenate([seen, unused[: draft_vocab_size - len(seen)]])
    return np.sort(seen).astype(np.int64)


def mapping_from_ids(draft_ids: np.ndarray, target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [draft], t2d bool [target]) for sorted, unique `draft_ids`."""
    draft_ids = np.asarray(draft_ids, dtype=np.int64)
    assert np.all(np.diff(draft_ids) > 0), "draft ids must be strictly ascending"
    d2t = d2t_from_ids(draft_ids)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[draft_ids] = True
    return d2t, t2d


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


# -- the stage -------------------------------------------------------------------
def build_vocab_mapping(cfg: VocabConfig):
    wd = WorkDir(cfg.work_dir)
    prep = read_manifest(wd, "prepare", needed_by="stage 03 (vocab mapping)")
    vocab_size = int(prep.extra["vocab_size"])
    if cfg.target_model is not None:
        fp = tokenizer_fingerprint(load_tokenizer(cfg.target_model, cfg.trust_remote_code))
        if fp != prep.extra["tokenizer_fingerprint"]:
            raise PipelineError(
                f"{prep.path} was built with another tokenizer (fingerprint "
                f"{prep.extra['tokenizer_fingerprint'][:12]}) than {cfg.target_model}'s ({fp[:12]}); "
                f"rerun `python 01_prepare_dataset.py --target-model {cfg.target_model} --force`.")
    if cfg.draft_vocab_size > vocab_size:
        raise PipelineError(
            f"draft_vocab_size = {cfg.draft_vocab_size} is larger than the target vocab ({vocab_size}, "
            f"{prep.path}); pass --draft-vocab-size {min(32000, vocab_size)} or less.")

    freqs = {}
    for split in ("train", "eval"):
        freq = np.load(wd.token_freq(split))
        if freq.shape != (vocab_size,):
            raise PipelineError(
                f"{wd.token_freq(split)} has shape {freq.shape}, the target vocab is {vocab_size} "
                f"({prep.path}); rerun `python 01_prepare_dataset.py --force`.")
        freqs[split] = freq

    params = identity_params(cfg)
    params.pop("target_model")  # checked above; the identity is stage 01's manifest
    inputs = {"prepare": manifest_fingerprint(prep)}
    done = already_complete(wd, "vocab", params, inputs, force=cfg.force)
    if done:
        return done

    draft_ids = select_draft_ids(freqs["train"], cfg.draft_vocab_size)
    d2t, t2d = mapping_from_ids(draft_ids, vocab_size)
    distinct = int((freqs["train"] > 0).sum())
    cov = {split: coverage(f, t2d) for split, f in freqs.items()}

    import torch

    save_numpy(wd.d2t("npy"), d2t)
    save_numpy(wd.t2d("npy"), t2d)
    save_torch(wd.d2t("pt"), torch.from_numpy(d2t))
    save_torch(wd.t2d("pt"), torch.from_numpy(t2d))
    counts = {
        "draft_vocab_size": cfg.draft_vocab_size, "target_vocab_size": vocab_size,
        "distinct_train_tokens": distinct, "padded_ids": max(0, cfg.draft_vocab_size - distinct),
        "coverage_train": cov["train"], "coverage_eval": cov["eval"],
        "train_assistant_tokens": int(freqs["train"].sum()), "eval_assistant_tokens": int(freqs["eval"].sum()),
    }
    m = write_manifest(wd, "vocab", params=params, inputs=inputs, counts=counts,
                       outputs=[wd.d2t("pt"), wd.d2t("npy"), wd.t2d("pt"), wd.t2d("npy")],
                       extra={"tokenizer_fingerprint": prep.extra["tokenizer_fingerprint"]})
    log.info("stage 03: draft vocab %d of %d target ids (%d distinct assistant ids seen, %d padded); "
             "coverage of assistant tokens: train %.2f%% (%d tokens, the data that chose the vocab), "
             "held-out %.2f%% (%d tokens)", cfg.draft_vocab_size, vocab_size, distinct, counts["padded_ids"],
             100 * cov["train"], counts["train_assistant_tokens"], 100 * cov["eval"],
             counts["eval_assistant_tokens"])
    if counts["eval_assistant_tokens"] < 10_000:
        log.warning("held-out coverage is measured on only %d assistant tokens; treat it as rough "
                    "(raise --eval-fraction in stage 01 for a firmer figure)", counts["eval_assistant_tokens"])
    return m
