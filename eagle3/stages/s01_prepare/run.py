"""Stage 01: chats -> token ids, assistant-only loss mask, token frequencies.

Reads chat records (local JSON/JSONL or a `datasets` id), renders each with the
target tokenizer's chat template, builds the loss mask (eagle3/target/loss_mask.py),
truncates to `max_length`, splits off a held-out eval set by conversation, and
writes (see eagle3/artifacts/workdir.py):

    01_dataset/train/, eval/     datasets Arrow (memory-mapped): sample_id, input_ids, loss_mask, num_tokens
    01_dataset/token_freq_{train,eval}.npy   int64 [target_vocab], assistant tokens only
    01_dataset/manifest.json

Run: `python 01_prepare_dataset.py --config configs/tiny-llama.yaml`.

`--data generated` reads stage 00's regenerated chats (WORK/00_generate/) instead:
each regenerated assistant turn is the exact token ids the target generated, spliced
into the rendered template (`spliced_samples`), never its decoded text re-tokenized;
the chat template switches stage 00 used (`chat_template_kwargs`) are used here too.
The manifest counts how many of those turns re-tokenizing the decoded text would
have changed (`generated_turns_reencode_differs`).

Every turn is trained in the context the chat template gives it (eagle3/target/loss_mask.py):
a conversation is one sample while the template renders its earlier turns as they
were; a later turn whose history the template rewrites (a thinking template dropping
the reasoning of earlier turns) is a sample of its own, `<sample id>#turn<k>` (k counts
from 1), whose context is the served history (for stage 00's chats: exactly the prompt
the target answered it after, checked against the chunk line). The held-out split
keeps all samples of a conversation on one side. The manifest counts those samples
and the history tokens they repeat (`samples_in_served_context`,
`served_history_tokens`).

Records that give no sample are counted by reason; so is each exact duplicate of an earlier
record (`duplicate`: the same messages after reading, `conversation_of`), dropped before the
split so that no conversation is on both sides of it. No training sample at all stops the
stage with one line (the input, the counts by reason, the likely fix: prompts without
answers, for one, go through stage 00 first); more than half of the records dropped is
a warning with the same counts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing as mp
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eagle3.artifacts.dataset import save_split, save_token_freq
from eagle3.artifacts.manifest import (Manifest, already_complete, check_same, manifest_fingerprint, read_manifest,
                                       record_of, sha256_file, write_manifest)
from eagle3.artifacts.records import GenerateRecord, PrepareRecord
from eagle3.artifacts.workdir import SPLITS, WorkDir
from eagle3.core.config import identity_params
from eagle3.core.errors import PipelineError
from eagle3.core.logs import quiet_tokenizers
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.target.chats import (BadRecord, RawRecord, check_local_files, iter_records, likely_fix, mark_duplicates,
                                 normalize, reasons_text, sample_id)
from eagle3.target.info import chat_template_fingerprint, load_tokenizer, read_target_info, tokenizer_fingerprint
from eagle3.target.loss_mask import Answer, Sample, assistant_suffix, build_samples, reencode_differs, spliced_samples
from eagle3.target.tokenizer_check import check_tokenizer

log = logging.getLogger(__name__)

GENERATED = "generated"  # `--data generated`: stage 00's output in this work directory

# Stage 01's own reasons for a record that yields no sample (chats.FIXES has the rest).
FIXES = {
    "no_messages": "give each record `messages` (OpenAI) or `conversations` (ShareGPT) with assistant turns; a "
                   "file of prompts goes through `python 00_generate_responses.py --data FILE` first (its "
                   "--prompt-field names the prompt's field), then this stage with --data generated",
    "no_assistant_tokens_within_max_length": "the assistant turns start past --max-length: raise --max-length",
    "template_not_prefix_stable": "the chat template renders an assistant turn differently from the prompt it "
                                  "is answered after, so its span cannot be located: check the template, or let the "
                                  "target answer the chats (`python 00_generate_responses.py`, then --data generated)",
    "prompt_too_long": "stage 00 could not answer these (see its summary line): raise its --max-model-len",
    "empty_answer": "stage 00's target answered with nothing (see its summary line): check its chat template "
                    "and --chat-template-kwargs",
}


@dataclass
class PreparedSample:
    sample_id: str
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] int8
    truncated: bool
    trimmed_user_turn: bool
    fuzzy_ends: int
    generated_turns: int = 0  # regenerated assistant turns (stage 00), their ids taken as generated
    reencode_differs: int = 0  # of those, turns whose decoded text re-tokenizes to other ids
    conversation_id: str = ""  # the record's sample id: the held-out split is by conversation
    first_turn: int = 0  # > 0: a later turn in a sample of its own, after the history the template serves it
    prompt_tokens: int = 0  # the tokens before that turn's answer
    samples_past_max_length: int = 0  # the record's samples dropped: no assistant token within max_length


def turn_sample_id(sid: str, first_turn: int) -> str:
    """A sample's id: the conversation's for its first sample, `<id>#turn<k>` (k from 1) for a
    later turn in a sample of its own."""
    return sid if first_turn == 0 else f"{sid}#turn{first_turn + 1}"


def is_eval(sid: str, seed: int, fraction: float) -> bool:
    """Hash-based split: stable under reordering, worker count and added data."""
    h = hashlib.sha256(f"{seed}:{sid}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


# -- tokenization workers --------------------------------------------------------
_W: dict = {}


def _init_worker(target_model: str, trust_remote_code: bool, max_length: int,
                 template_kwargs: dict | None = None) -> None:

    quiet_tokenizers()
    tok = load_tokenizer(target_model, trust_remote_code)
    _W.update(tok=tok, suffix=assistant_suffix(tok, template_kwargs), max_length=max_length,
              kw=template_kwargs)


def is_generated_line(record) -> bool:
    """A line of stage 00's chunks (an answered conversation, or a record it could not answer)."""
    return isinstance(record, dict) and "sample_id" in record and (
        "generated" in record or "bad" in record or "dropped" in record)


def _generated_samples(rec: dict, where: str) -> tuple[str, list[Sample], int, int]:
    """A stage-00 line: (sample id, its samples, regenerated turns, turns that re-tokenize differently)."""
    if "bad" in rec or "dropped" in rec:
        raise BadRecord(rec.get("bad") or rec["dropped"], rec.get("detail", "counted by stage 00"))
    answers = [Answer(g["ids"], g["finish_reason"] != "length") for g in rec["generated"]]
    samples = spliced_samples(_W["tok"], rec["messages"], answers, _W["suffix"], _W["kw"])
    got = [{"first_turn": x.first_turn, "prompt_tokens": x.prompt_tokens} for x in samples]
    if "samples" not in rec:
        if len(samples) > 1:  # an older stage 00 generated the later turns after the spliced history
            raise PipelineError(
                f"{where}: written by an older stage 00 that generated turns after history this chat template "
                f"rewrites ({len(samples)} served contexts, one recorded); rerun `python "
                f"{WorkDir.script('generate')} --force` to generate them in the served context.")
    elif rec["samples"] != got:
        raise PipelineError(
            f"{where}: stage 00 recorded the samples {rec['samples']} but this tokenizer and chat template give "
            f"{got}; the target's chat template changed since stage 00 ran: rerun `python "
            f"{WorkDir.script('generate')} --force`.")
    try:
        differs = sum(reencode_differs(_W["tok"], rec["messages"], answers, _W["suffix"], _W["kw"]))
    except BadRecord:  # the decoded text cannot even be placed by plain rendering
        differs = len(answers)
    return rec["sample_id"], samples, len(answers), differs


def _process(raw: RawRecord) -> list[PreparedSample] | BadRecord:
    """A record's samples, each truncated to max_length; a sample with no assistant token left
    is dropped (counted), a record with none is a bad record."""
    try:
        gen_turns = differs = fuzzy = 0
        trimmed = False
        if is_generated_line(raw.record):
            sid, samples, gen_turns, differs = _generated_samples(raw.record, raw.where)
        else:
            sid = sample_id(raw)
            messages, trimmed = normalize(raw.record)
            samples, fuzzy = build_samples(_W["tok"], messages, _W["suffix"])
        out = []
        for x in samples:
            ids, mask = x.arrays()
            truncated = len(ids) > _W["max_length"]
            ids, mask = ids[: _W["max_length"]], mask[: _W["max_length"]]
            if mask.any():
                out.append(PreparedSample(turn_sample_id(sid, x.first_turn), ids, mask, truncated, False, 0,
                                          conversation_id=sid, first_turn=x.first_turn,
                                          prompt_tokens=x.prompt_tokens))
        if not out:
            raise BadRecord("no_assistant_tokens_within_max_length",
                            f"first assistant token is past max_length={_W['max_length']}")
        # the record's own counts go with its first sample
        first = out[0]
        first.trimmed_user_turn, first.fuzzy_ends = trimmed, fuzzy
        first.generated_turns, first.reencode_differs = gen_turns, differs
        first.samples_past_max_length = len(samples) - len(out)
        return out
    except BadRecord as e:
        return e


def _tokenize_all(cfg: PrepareConfig, records: list[RawRecord], template_kwargs: dict | None = None):
    # A spawned worker pays a start-up of its own (imports, tokenizer load), and the main
    # process keeps one core busy feeding it: on a machine with few cores one process is
    # faster (bench/bench_prepare.py), so the default leaves a core to the main process
    # and only goes parallel for large sets.
    workers = cfg.num_workers or max(1, min(16, (os.cpu_count() or 1) - 1, len(records) // 5000))
    init = (cfg.target_model, cfg.trust_remote_code, cfg.max_length, template_kwargs)
    bar = dict(total=len(records), unit="conv", desc="tokenize", smoothing=0.1)
    if workers <= 1:
        _init_worker(*init)
        yield from tqdm(map(_process, records), **bar)
        return
    # spawn, not fork: forking after torch/tokenizers threads started can deadlock.
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init) as pool:
        yield from tqdm(pool.imap(_process, records, chunksize=64), **bar)


# -- the stage -------------------------------------------------------------------
def uses_generated(cfg: PrepareConfig) -> bool:
    if GENERATED in cfg.data and len(cfg.data) > 1:
        raise PipelineError(f"prepare.data = {cfg.data}: `{GENERATED}` (stage 00's output) cannot be mixed with "
                            f"other sources; pass those to 00_generate_responses.py --data instead.")
    return cfg.data == [GENERATED]


def generated_manifest(cfg: PrepareConfig, tok) -> Manifest:
    """Stage 00's manifest, checked: complete, and from this target's tokenizer."""
    workdir = WorkDir(cfg.work_dir)
    m = read_manifest(workdir, "generate", needed_by=f"{workdir.script('prepare')} --data {GENERATED}")
    gen: GenerateRecord = record_of(m)
    if not gen.complete:
        raise PipelineError(
            f"{m.path}: stage 00 is incomplete ({gen.missing_chunks} chunk(s) missing, shard indices "
            f"{gen.missing_shard_indices}); run the missing boxes, copy their chunks into "
            f"{workdir.generate_chunks()}, and rerun `python {workdir.script('generate')}` once without shard flags.")
    check_same("tokenizer fingerprint", gen.tokenizer_fingerprint, tokenizer_fingerprint(tok),
               ours_from=f"{m.path} (stage 00, target {gen.target_model})",
               theirs_from=f"tokenizer of {cfg.target_model}",
               fix="stage 01 must use the target that generated the answers (--target-model)")
    return m


def generated_records(workdir: WorkDir, manifest: Manifest):
    """Stage 00's lines in input order, as records `_process` recognises."""
    for k in range(record_of(manifest).num_chunks):
        path = workdir.generate_chunk(k)
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                yield RawRecord(str(path), n, json.loads(line))


def _input_fingerprints(cfg: PrepareConfig, tok, gen: Manifest | None = None) -> dict:
    inputs = {"tokenizer": tokenizer_fingerprint(tok)}
    if gen is not None:
        inputs["generate"] = manifest_fingerprint(gen)
        return inputs
    for src in cfg.data:
        p = Path(src)
        inputs[f"data:{src}"] = sha256_file(p) if p.is_file() else f"datasets:{src}:{cfg.data_split}"
    return inputs


def token_frequencies(samples: list[PreparedSample], vocab_size: int) -> np.ndarray:
    """int64 [vocab_size]: how often each id appears as an assistant (loss) token."""
    freq = np.zeros(vocab_size, dtype=np.int64)
    for s in samples:
        freq += np.bincount(s.input_ids[s.loss_mask.astype(bool)], minlength=vocab_size)
    return freq


def conversation_of(record) -> list[dict]:
    """The messages an exact duplicate repeats (docs/STAGES.md, stage 01): a chat record's after
    `normalize` (roles, text, a trailing user turn trimmed), a stage-00 line's as generated. A
    record that gives none raises BadRecord (it is counted by its own reason)."""
    if is_generated_line(record):
        if "generated" not in record:
            raise BadRecord(record.get("bad") or record["dropped"])
        return record["messages"]
    return normalize(record)[0]


def read_records(cfg: PrepareConfig, workdir: WorkDir, gen: Manifest | None) -> list[RawRecord]:
    """Every input record: stage 00's regenerated chats, or the chat files / datasets ids; each
    exact duplicate of an earlier one is a bad record, `duplicate`, before any split."""
    check_local_files(cfg.data)
    if gen is not None:
        records = list(generated_records(workdir, gen))
        log.info("read %d regenerated records from %s", len(records), workdir.generate_chunks())
    else:
        records = [r for src in cfg.data for r in iter_records(src, cfg.data_split)]
        log.info("read %d records from %s", len(records), ", ".join(cfg.data))
    records = mark_duplicates(records, conversation_of)
    copies = sum(isinstance(r.record, BadRecord) and r.record.reason == "duplicate" for r in records)
    if copies:
        log.info("stage 01: %d records repeat an earlier record's conversation exactly; only the first copy of each "
                 "is kept (counted as `duplicate`)", copies)
    return records


@dataclass
class Tally:
    """What tokenizing the records counted (the manifest's counts)."""

    bad: Counter = field(default_factory=Counter)  # reason -> records skipped
    usable: int = 0  # records that gave at least one sample
    truncated: int = 0  # samples cut at max_length
    trimmed: int = 0  # trailing user turns trimmed
    fuzzy: int = 0  # assistant turns without the template's suffix
    generated_turns: int = 0
    reencode_differs: int = 0
    served_samples: int = 0  # later turns in a sample of their own (the template rewrote their history)
    served_history_tokens: int = 0  # the context tokens of those samples: history the rewrite repeats
    past_max_length: int = 0  # samples dropped: no assistant token within max_length
    tokens: int = 0

    def add(self, s: PreparedSample) -> None:
        self.truncated += s.truncated
        self.trimmed += s.trimmed_user_turn
        self.fuzzy += s.fuzzy_ends
        self.generated_turns += s.generated_turns
        self.reencode_differs += s.reencode_differs
        self.past_max_length += s.samples_past_max_length
        self.tokens += len(s.input_ids)
        if s.first_turn > 0:
            self.served_samples += 1
            self.served_history_tokens += s.prompt_tokens


def tokenize_and_split(cfg: PrepareConfig, records: list[RawRecord], vocab_size: int,
                       template_kwargs: dict | None) -> tuple[dict[str, list[PreparedSample]], Tally]:
    """Tokenize every record and assign its samples to train or eval by its conversation's hash."""
    tally = Tally()
    split: dict[str, list[PreparedSample]] = {s: [] for s in SPLITS}
    for raw, out in zip(records, _tokenize_all(cfg, records, template_kwargs)):
        if isinstance(out, BadRecord):
            if cfg.strict:
                raise PipelineError(
                    f"{raw.where}: bad record ({out}); fix or remove it, or drop --strict to count "
                    f"and skip such records.")
            tally.bad[out.reason] += 1
            continue
        tally.usable += 1
        for x in out:
            if int(x.input_ids.max()) >= vocab_size:
                raise PipelineError(f"{raw.where}: token id {int(x.input_ids.max())} >= vocab_size {vocab_size}.")
            tally.add(x)
            split["eval" if is_eval(x.conversation_id, cfg.seed, cfg.eval_fraction) else "train"].append(x)
    refuse_or_warn_dropped(cfg, len(records), split, tally)
    return split, tally


def refuse_or_warn_dropped(cfg: PrepareConfig, n: int, split: dict[str, list[PreparedSample]], t: Tally) -> None:
    """No training sample is an error, more than half of the records dropped a warning: one
    line naming the input, the counts by reason and the likely fix."""
    source = f"stage 00's output ({WorkDir(cfg.work_dir).generate_chunks()})" if cfg.data == [GENERATED] \
        else ", ".join(cfg.data)
    counts = f"{n} records, {t.usable} usable, bad records: {reasons_text(t.bad)}"
    if not split["train"]:
        if not n:
            fix = "the input holds no record: check --data"
        elif t.usable:
            fix = (f"every usable sample fell in the held-out split (--eval-fraction {cfg.eval_fraction}): lower "
                   f"--eval-fraction or add records")
        else:
            fix = likely_fix(t.bad, FIXES)
        raise PipelineError(f"stage 01: no training sample from {source}: {counts}; {fix}.")
    if t.usable * 2 < n:
        log.warning("stage 01: only %d of %d records from %s are usable (%s); %s", t.usable, n, source, counts,
                    likely_fix(t.bad, FIXES))


def write_splits(workdir: WorkDir, split: dict[str, list[PreparedSample]],
                 vocab_size: int) -> tuple[list[Path], dict[str, dict[str, int]]]:
    """Each split's dataset and token frequencies: the paths, and their sizes as the record's
    `samples`, `tokens` and `assistant_tokens` (split -> count)."""
    outputs, sizes = [], {"samples": {}, "tokens": {}, "assistant_tokens": {}}
    for name, samples in split.items():
        freq = token_frequencies(samples, vocab_size)
        sizes["samples"][name] = len(samples)
        sizes["tokens"][name] = int(sum(len(s.input_ids) for s in samples))
        sizes["assistant_tokens"][name] = int(freq.sum())
        save_split(workdir.dataset(name), [s.sample_id for s in samples], [s.input_ids for s in samples],
                   [s.loss_mask for s in samples])
        outputs += [workdir.dataset(name), save_token_freq(workdir, name, freq)]
    return outputs, sizes


def prepare_dataset(cfg: PrepareConfig):
    workdir = WorkDir(cfg.work_dir)
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    tok = load_tokenizer(cfg.target_model, cfg.trust_remote_code)
    gen = generated_manifest(cfg, tok) if uses_generated(cfg) else None
    template_kwargs = record_of(gen).chat_template_kwargs if gen else None
    check_tokenizer(cfg.target_model, tok, trust_remote_code=cfg.trust_remote_code,
                    suffix=assistant_suffix(tok, template_kwargs))
    params, inputs = identity_params(cfg), _input_fingerprints(cfg, tok, gen)
    done = already_complete(workdir, "prepare", params, inputs, force=cfg.force)
    if done:
        return done
    if len(tok) > info.vocab_size:
        raise PipelineError(
            f"tokenizer of {cfg.target_model} has {len(tok)} tokens but the model's vocab_size is "
            f"{info.vocab_size}; tokenizer and model do not belong together.")

    records = read_records(cfg, workdir, gen)
    split, t = tokenize_and_split(cfg, records, info.vocab_size, template_kwargs)
    outputs, sizes = write_splits(workdir, split, info.vocab_size)
    record = PrepareRecord(
        target_model=cfg.target_model, tokenizer_fingerprint=inputs["tokenizer"], vocab_size=info.vocab_size,
        chat_template_kwargs=template_kwargs or {}, assistant_suffix=assistant_suffix(tok, template_kwargs),
        records=len(records), bad_records=dict(sorted(t.bad.items())), **sizes)
    counts: dict = {"truncated": t.truncated, "trailing_user_turns_trimmed": t.trimmed,
                    "assistant_turns_without_template_suffix": t.fuzzy,
                    "samples_in_served_context": t.served_samples, "served_history_tokens": t.served_history_tokens,
                    "samples_past_max_length": t.past_max_length}
    if gen is not None:
        counts.update(generated_turns=t.generated_turns, generated_turns_reencode_differs=t.reencode_differs)
    m = write_manifest(workdir, "prepare", params=params, inputs=inputs, counts=counts, outputs=outputs, record=record,
                       extra={"chat_template_fingerprint": chat_template_fingerprint(tok), "tokenizer_size": len(tok),
                              "data_from": "00_generate" if gen is not None else "chat files"})
    _log_summary(workdir, record, t, generated=gen is not None)
    return m


def _log_summary(workdir: WorkDir, r: PrepareRecord, t: Tally, *, generated: bool) -> None:
    bad_txt = ", ".join(f"{k}={v}" for k, v in sorted(t.bad.items())) or "none"
    log.info("stage 01: %d train / %d eval samples, %d / %d tokens (%d / %d assistant); truncated %d; "
             "bad records skipped: %s -> %s", r.samples["train"], r.samples["eval"], r.tokens["train"],
             r.tokens["eval"], r.assistant_tokens["train"], r.assistant_tokens["eval"], t.truncated, bad_txt,
             workdir.stage_dir("prepare"))
    if t.served_samples:
        log.info("stage 01: %d later turns in a sample of their own: the chat template rewrites the history before "
                 "them (e.g. drops earlier reasoning), so each is trained after the history it is served; that "
                 "history adds %d context tokens (%.1f%% of all tokens)%s", t.served_samples, t.served_history_tokens,
                 100.0 * t.served_history_tokens / max(t.tokens, 1),
                 f"; {t.past_max_length} such samples start past --max-length and are dropped"
                 if t.past_max_length else "")
    if generated:
        log.info("stage 01: %d regenerated assistant turns taken as the target's own ids; re-tokenizing their "
                 "decoded text would have changed %d of them (%.1f%%)", t.generated_turns, t.reencode_differs,
                 100.0 * t.reencode_differs / max(t.generated_turns, 1))
    if t.fuzzy:
        log.warning("%d assistant turns did not end with the template's probed suffix %s; they are masked "
                    "to the end of their rendering", t.fuzzy, r.assistant_suffix)
