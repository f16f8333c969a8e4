"""Stage 01: chats -> token ids, assistant-only loss mask, token frequencies.

Reads chat records (local JSON/JSONL or a `datasets` id), renders each with the
target tokenizer's chat template, builds the loss mask (eagle3/loss_mask.py),
truncates to `max_length`, splits off a held-out eval set by conversation, and
writes (see eagle3/workdir.py):

    01_dataset/train/, eval/     datasets Arrow (memory-mapped): sample_id, input_ids, loss_mask, num_tokens
    01_dataset/token_freq_{train,eval}.npy   int64 [target_vocab], assistant tokens only
    01_dataset/manifest.json

Run: `python 01_prepare_dataset.py --config configs/tiny-llama.yaml`.
"""
from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .atomic import atomic_path, save_numpy
from .chats import BadRecord, RawRecord, iter_records, normalize, sample_id
from .config import identity_params, param
from .errors import PipelineError
from .loss_mask import assistant_suffix, build_sample
from .manifest import completed, sha256_file, write_manifest
from .target import (chat_template_fingerprint, load_tokenizer, read_target_info,
                     tokenizer_fingerprint)
from .workdir import SPLITS, WorkDir

log = logging.getLogger(__name__)


@dataclass
class PrepareConfig:
    work_dir: Path = param(help="work directory; each stage writes one folder in it")
    target_model: str = param(help="target model folder or hub id (its tokenizer and chat template are used)")
    data: list[str] = param(help="chat files (.json/.jsonl, ShareGPT or OpenAI messages) or datasets ids")
    data_split: str = param("train", help="split to read from datasets ids")
    max_length: int = param(4096, help="truncate samples to this many tokens")
    eval_fraction: float = param(0.02, help="share of conversations held out for evaluation")
    seed: int = param(0, help="seed of the train/eval split (by conversation)")
    trust_remote_code: bool = param(False, help="allow the tokenizer's custom code (Kimi needs it)")
    strict: bool = param(False, help="stop at the first bad record instead of counting it")
    num_workers: int = param(0, identity=False, help="tokenizer processes (0 = auto: CPUs - 1, max 16, "
                                                    "one per 5000 records)")
    force: bool = param(False, identity=False, help="redo the stage even if it is complete")

    def __post_init__(self):
        if isinstance(self.data, str):
            self.data = [self.data]
        if not self.data:
            raise PipelineError("prepare.data is empty; pass --data FILE.jsonl (or a datasets id).")
        if self.max_length < 8:
            raise PipelineError(f"max_length = {self.max_length} is too small; use e.g. --max-length 4096.")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise PipelineError(f"eval_fraction = {self.eval_fraction} must be in [0, 1); e.g. --eval-fraction 0.02.")


@dataclass
class PreparedSample:
    sample_id: str
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] int8
    truncated: bool
    trimmed_user_turn: bool
    fuzzy_ends: int


def is_eval(sid: str, seed: int, fraction: float) -> bool:
    """Hash-based split: stable under reordering, worker count and added data."""
    h = hashlib.sha256(f"{seed}:{sid}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


# -- tokenization workers --------------------------------------------------------
_W: dict = {}


def _init_worker(target_model: str, trust_remote_code: bool, max_length: int) -> None:
    from .logs import quiet_tokenizers

    quiet_tokenizers()
    tok = load_tokenizer(target_model, trust_remote_code)
    _W.update(tok=tok, suffix=assistant_suffix(tok), max_length=max_length)


def _process(raw: RawRecord) -> PreparedSample | BadRecord:
    try:
        messages, trimmed = normalize(raw.record)
        ids, mask, fuzzy = build_sample(_W["tok"], messages, _W["suffix"])
        truncated = len(ids) > _W["max_length"]
        ids, mask = ids[: _W["max_length"]], mask[: _W["max_length"]]
        if not mask.any():
            raise BadRecord("no_assistant_tokens_within_max_length",
                            f"first assistant token is past max_length={_W['max_length']}")
        return PreparedSample(sample_id(raw), ids, mask, truncated, trimmed, fuzzy)
    except BadRecord as e:
        return e


def _tokenize_all(cfg: PrepareConfig, records: list[RawRecord]):
    # A spawned worker costs ~5 s to start (imports, tokenizer load), and the main
    # process keeps one core busy feeding it: on 2 cores one process is faster
    # (bench/bench_prepare.py), so the default leaves a core to the main process
    # and only goes parallel for large sets.
    workers = cfg.num_workers or max(1, min(16, (os.cpu_count() or 1) - 1, len(records) // 5000))
    init = (cfg.target_model, cfg.trust_remote_code, cfg.max_length)
    bar = dict(total=len(records), unit="conv", desc="tokenize", smoothing=0.1)
    if workers <= 1:
        _init_worker(*init)
        yield from tqdm(map(_process, records), **bar)
        return
    # spawn, not fork: forking after torch/tokenizers threads started can deadlock.
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init) as pool:
        yield from tqdm(pool.imap(_process, records, chunksize=64), **bar)


# -- the stage -------------------------------------------------------------------
def _input_fingerprints(cfg: PrepareConfig, tok) -> dict:
    inputs = {"tokenizer": tokenizer_fingerprint(tok)}
    for src in cfg.data:
        p = Path(src)
        inputs[f"data:{src}"] = sha256_file(p) if p.is_file() else f"datasets:{src}:{cfg.data_split}"
    return inputs


def split_features():
    import datasets

    return datasets.Features({
        "sample_id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "num_tokens": datasets.Value("int32"),
    })


def load_split(path: Path):
    """A split written by this stage. `datasets` cannot read back a saved split with
    zero rows (e.g. --eval-fraction 0), so an empty one is rebuilt in memory."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except IndexError:
        return datasets.Dataset.from_dict({k: [] for k in split_features()}, features=split_features())


def _save_split(path: Path, samples: list[PreparedSample]) -> None:
    import datasets

    features = split_features()
    ds = datasets.Dataset.from_dict({
        "sample_id": [s.sample_id for s in samples],
        "input_ids": [s.input_ids for s in samples],
        "loss_mask": [s.loss_mask for s in samples],
        "num_tokens": [len(s.input_ids) for s in samples],
    }, features=features)
    with atomic_path(path) as tmp:
        ds.save_to_disk(str(tmp))


def token_frequencies(samples: list[PreparedSample], vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each id appears as an assistant (loss) token."""
    freq = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        freq += np.bincount(s.input_ids[s.loss_mask.astype(bool)], minlength=vocab_size)
    return freq


def prepare_dataset(cfg: PrepareConfig):
    wd = WorkDir(cfg.work_dir)
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    tok = load_tokenizer(cfg.target_model, cfg.trust_remote_code)
    params, inputs = identity_params(cfg), _input_fingerprints(cfg, tok)
    done = completed(wd, "prepare", params, inputs)
    if done and not cfg.force:
        log.info("stage 01 already complete with these inputs (%s); nothing to do. Pass --force to redo it.",
                 done.path)
        return done
    if len(tok) > info.vocab_size:
        raise PipelineError(
            f"tokenizer of {cfg.target_model} has {len(tok)} tokens but the model's vocab_size is "
            f"{info.vocab_size}; tokenizer and model do not belong together.")

    for src in cfg.data:
        if Path(src).suffix in (".json", ".jsonl") and not Path(src).is_file():
            raise PipelineError(f"data file {src} does not exist; check --data.")
    records = [r for src in cfg.data for r in iter_records(src, cfg.data_split)]
    log.info("read %d records from %s", len(records), ", ".join(cfg.data))

    bad: Counter[str] = Counter()
    split: dict[str, list[PreparedSample]] = {s: [] for s in SPLITS}
    truncated = trimmed = fuzzy = 0
    for raw, out in zip(records, _tokenize_all(cfg, records)):
        if isinstance(out, BadRecord):
            if cfg.strict:
                raise PipelineError(
                    f"{raw.where}: bad record ({out}); fix or remove it, or drop --strict to count "
                    f"and skip such records.")
            bad[out.reason] += 1
            continue
        if int(out.input_ids.max()) >= info.vocab_size:
            raise PipelineError(f"{raw.where}: token id {int(out.input_ids.max())} >= vocab_size {info.vocab_size}.")
        truncated += out.truncated
        trimmed += out.trimmed_user_turn
        fuzzy += out.fuzzy_ends
        split["eval" if is_eval(out.sample_id, cfg.seed, cfg.eval_fraction) else "train"].append(out)
    if not split["train"]:
        raise PipelineError(
            f"no usable training sample in {cfg.data} (bad records: {dict(bad) or 'none'}); "
            f"check the data format (ShareGPT `conversations` or OpenAI `messages`).")

    counts: dict = {"records": len(records), "bad_records": dict(sorted(bad.items())),
                    "truncated": truncated, "trailing_user_turns_trimmed": trimmed,
                    "assistant_turns_without_template_suffix": fuzzy}
    outputs = []
    for name, samples in split.items():
        freq = token_frequencies(samples, info.vocab_size)
        counts[f"{name}_samples"] = len(samples)
        counts[f"{name}_tokens"] = int(sum(len(s.input_ids) for s in samples))
        counts[f"{name}_assistant_tokens"] = int(freq.sum())
        _save_split(wd.dataset(name), samples)
        save_numpy(wd.token_freq(name), freq)
        outputs += [wd.dataset(name), wd.token_freq(name)]

    m = write_manifest(wd, "prepare", params=params, inputs=inputs, counts=counts, outputs=outputs, extra={
        "tokenizer_fingerprint": inputs["tokenizer"],
        "chat_template_fingerprint": chat_template_fingerprint(tok),
        "vocab_size": info.vocab_size,
        "tokenizer_size": len(tok),
        "assistant_suffix": assistant_suffix(tok),
    })
    bad_txt = ", ".join(f"{k}={v}" for k, v in sorted(bad.items())) or "none"
    log.info("stage 01: %d train / %d eval samples, %d / %d tokens (%d / %d assistant); truncated %d; "
             "bad records skipped: %s -> %s", counts["train_samples"], counts["eval_samples"],
             counts["train_tokens"], counts["eval_tokens"], counts["train_assistant_tokens"],
             counts["eval_assistant_tokens"], truncated, bad_txt, wd.stage_dir("prepare"))
    if fuzzy:
        log.warning("%d assistant turns did not end with the template's probed suffix %s; they are masked "
                    "to the end of their rendering", fuzzy, m.extra["assistant_suffix"])
    return m
