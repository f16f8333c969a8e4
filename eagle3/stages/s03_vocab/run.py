"""Stage 03: the draft vocabulary, as `d2t` / `t2d` (docs/CONVENTIONS.md §2).

Reads stage 01's assistant-token frequencies and writes

    03_vocab/d2t.pt          int64 [draft_vocab]: offsets, target_id = i + d2t[i]
    03_vocab/t2d.pt          bool  [target_vocab]: True for chosen ids
    03_vocab/manifest.json   with coverage on the train AND the held-out split

Run: `python 03_build_vocab_mapping.py --config configs/tiny-llama.yaml`.
"""
from __future__ import annotations

import logging

import numpy as np

from eagle3.artifacts.dataset import load_token_freq
from eagle3.artifacts.manifest import already_complete, manifest_fingerprint, read_manifest, record_of, write_manifest
from eagle3.artifacts.records import PrepareRecord, VocabRecord
from eagle3.artifacts.vocab_map import coverage, d2t_from_ids, save_mapping
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import identity_params
from eagle3.core.errors import PipelineError
from eagle3.stages.s03_vocab.config import VocabConfig
from eagle3.target.info import load_tokenizer, tokenizer_fingerprint

log = logging.getLogger(__name__)


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


# -- the stage -------------------------------------------------------------------
def build_vocab_mapping(cfg: VocabConfig):
    workdir = WorkDir(cfg.work_dir)
    prep = read_manifest(workdir, "prepare", needed_by="stage 03 (vocab mapping)")
    pr: PrepareRecord = record_of(prep)
    vocab_size = pr.vocab_size
    if cfg.target_model is not None:
        fp = tokenizer_fingerprint(load_tokenizer(cfg.target_model, cfg.trust_remote_code))
        if fp != pr.tokenizer_fingerprint:
            raise PipelineError(
                f"{prep.path} was built with another tokenizer (fingerprint "
                f"{pr.tokenizer_fingerprint[:12]}) than {cfg.target_model}'s ({fp[:12]}); "
                f"rerun `python 01_prepare_dataset.py --target-model {cfg.target_model} --force`.")
    if cfg.draft_vocab_size > vocab_size:
        raise PipelineError(
            f"draft_vocab_size = {cfg.draft_vocab_size} is larger than the target vocab ({vocab_size}, "
            f"{prep.path}); pass --draft-vocab-size {min(32000, vocab_size)} or less.")

    freqs = {}
    for split in ("train", "eval"):
        freq = load_token_freq(workdir, split)
        if freq.shape != (vocab_size,):
            raise PipelineError(
                f"{workdir.token_freq(split)} has shape {freq.shape}, the target vocab is {vocab_size} "
                f"({prep.path}); rerun `python 01_prepare_dataset.py --force`.")
        freqs[split] = freq

    params = identity_params(cfg)
    params.pop("target_model")  # checked above; the identity is stage 01's manifest
    inputs = {"prepare": manifest_fingerprint(prep)}
    done = already_complete(workdir, "vocab", params, inputs, force=cfg.force)
    if done:
        return done

    draft_ids = select_draft_ids(freqs["train"], cfg.draft_vocab_size)
    d2t, t2d = mapping_from_ids(draft_ids, vocab_size)
    distinct = int((freqs["train"] > 0).sum())
    cov = {split: coverage(f, t2d) for split, f in freqs.items()}

    outputs = save_mapping(workdir, d2t, t2d)
    record = VocabRecord(tokenizer_fingerprint=pr.tokenizer_fingerprint, target_vocab_size=vocab_size,
                         draft_vocab_size=cfg.draft_vocab_size, coverage_train=cov["train"], coverage_eval=cov["eval"])
    counts = {
        "distinct_train_tokens": distinct, "padded_ids": max(0, cfg.draft_vocab_size - distinct),
        "train_assistant_tokens": int(freqs["train"].sum()), "eval_assistant_tokens": int(freqs["eval"].sum()),
    }
    m = write_manifest(workdir, "vocab", params=params, inputs=inputs, counts=counts,
                       outputs=outputs, record=record)
    log.info("stage 03: draft vocab %d of %d target ids (%d distinct assistant ids seen, %d padded); "
             "coverage of assistant tokens: train %.2f%% (%d tokens, the data that chose the vocab), "
             "held-out %.2f%% (%d tokens)", cfg.draft_vocab_size, vocab_size, distinct, counts["padded_ids"],
             100 * cov["train"], counts["train_assistant_tokens"], 100 * cov["eval"],
             counts["eval_assistant_tokens"])
    if counts["eval_assistant_tokens"] < 10_000:
        log.warning("held-out coverage is measured on only %d assistant tokens; treat it as rough "
                    "(raise --eval-fraction in stage 01 for a firmer figure)", counts["eval_assistant_tokens"])
    return m
