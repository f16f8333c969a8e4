"""Stage 00: the target answers the inputs itself (vLLM): every assistant turn of a chat
is regenerated, and every user turn without an answer (a prompt) gets one.

Reads chats or prompts (local JSON/JSONL or a `datasets` id, in the shapes of
eagle3/target/chats.py: OpenAI `messages`, ShareGPT `conversations`, a `prompt` / `instruction`
/ `question` field, MT-Bench `turns`, or the field --prompt-field names) and writes
(names from eagle3/artifacts/workdir.py):

    00_generate/generate.json                 the run's identity (params, inputs); resumes must match it
    00_generate/chunks/chunk-NNNNN.jsonl      one line per input record, in input order:
        {"sample_id", "source", "messages", "generated": [{"ids", "finish_reason"}, ...],
         "samples": [{"first_turn", "prompt_tokens"}, ...], "stopped", "assistant_turns_in_source",
         "turns_planned"}   an answered conversation, or
        {"sample_id", "source", "dropped": reason, "turns_planned"} / {"sample_id", "source", "bad": reason, "detail"}
    00_generate/chunks/chunk-NNNNN.json       the chunk's identity, counts and checksum, written after
                                              the JSONL: its presence marks the chunk complete
    00_generate/manifest.json

A record whose turns equal an earlier record's, role for role and text for text (an exact
duplicate, eagle3/target/chats.py `mark_duplicates`), is not answered again: its line is
`"bad": "duplicate"`, its detail naming the first copy, and stage 01 counts it so too.

Each message list holds the answers' decoded text (thinking markup included) for
reading; stage 01 takes the `generated` ids as they are (eagle3/target/loss_mask.py,
`spliced_samples`). `samples` lists the conversation's training samples: one, unless the
chat template rewrites earlier turns in later prompts (a thinking template dropping their
reasoning), when each such later turn was generated after the served history and is a
sample of its own (eagle3/stages/s00_generate/conversation.py). Run:
`python 00_generate_responses.py --config configs/tiny-llama.yaml`.

No silent empty result: when no record can become a conversation the stage stops before
starting an engine, and when none is left after generation (every prompt too long, every
answer empty) it stops without a manifest; both say so in one line with the counts by
reason and the likely fix. Dropping more than half of the records is a warning, and so
is any assistant turn of the input left ungenerated (a conversation ended early): the
share of input turns not generated, by reason, and the fix.

Work plan (as stage 02's, eagle3/stages/s02_extract/plan.py): the input records are cut into chunks
of `chunk_size`; box `shard_index` of `num_shards` takes every `num_shards`-th chunk,
and its `data_parallel_size` engines split those. A chunk's turns are generated in
rounds (eagle3/stages/s00_generate/conversation.py) and the chunk is written atomically once all
its conversations are done, so the result of a chunk depends only on the chunk: a
killed run, rerun, skips complete chunks and ends with the files an unbroken run writes;
boxes run separately write disjoint chunks whose union is the whole output. Copy all
boxes' chunks into one folder and rerun once without shard flags to write the manifest.
"""
from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from eagle3.artifacts.atomic import atomic_path, write_json
from eagle3.artifacts.manifest import Manifest, already_complete, record_of, sha256_file, sha256_json, write_manifest
from eagle3.artifacts.records import GenerateRecord
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import identity_params
from eagle3.core.errors import PipelineError
from eagle3.engines.parallel import Reporter, run_data_parallel, use_gpu_group
from eagle3.stages.s00_generate.config import GenerateConfig
from eagle3.stages.s00_generate.conversation import (EMPTY_ANSWER, PROMPT_TOO_LONG, Conversation, Engine, Turns,
                                                     from_raw, regenerate)
from eagle3.stages.s00_generate.vllm_runner import VllmEngine
from eagle3.target.chats import (RawRecord, check_local_files, iter_records, likely_fix, mark_duplicates, reasons_text,
                                 record_turns)
from eagle3.target.info import chat_template_fingerprint, load_tokenizer, tokenizer_fingerprint, weights_fingerprint
from eagle3.target.loss_mask import assistant_suffix
from eagle3.target.tokenizer_check import check_tokenizer

log = logging.getLogger(__name__)

# Of the chunk files; bump when a line's fields change meaning. 2: later turns in the served
# context (a line's `samples`), `turns_planned`.
FORMAT = 2
# Figures later stages and tools read: the manifest's record holds them, not its counts.
RECORDED_COUNTS = ("conversations", "turns_regenerated", "new_turns", "generated_tokens")

# Stage 00's own reasons for a record that yields no conversation (chats.FIXES has the rest).
FIXES = {
    PROMPT_TOO_LONG: "the prompts leave no room to answer in the context: raise --max-model-len (up to the "
                     "target's) or shorten the prompts",
    EMPTY_ANSWER: "the target answered with nothing but its stop token: check the chat template, "
                  "--chat-template-kwargs and --max-new-tokens",
}


@dataclass
class Plan:
    workdir: WorkDir
    records: list[RawRecord]
    params: dict
    inputs: dict
    identity: dict
    identity_hash: str
    turns: Turns
    prompt_field: str | None = None

    @property
    def num_chunks(self) -> int:
        return max(1, -(-len(self.records) // self.params["chunk_size"]))

    def chunk(self, k: int) -> list[RawRecord]:
        n = self.params["chunk_size"]
        return self.records[k * n:(k + 1) * n]


def stop_ids(tok, suffix: list[int]) -> set[int]:
    """Ids that end an answer: the template's end-of-turn token (when it is a special token,
    e.g. <|eot_id|>, <|im_end|>) and the tokenizer's eos. Kimi's `<|im_end|>` is an added
    special token but not one of the named ones (`all_special_ids` holds bos, eos, unk, pad
    and the listed extras), so added tokens marked special count too."""
    ids = set()
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    if suffix and suffix[0] in special:
        ids.add(suffix[0])
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return ids


def plan(cfg: GenerateConfig) -> Plan:
    """Everything checked and read before an engine starts."""
    workdir = WorkDir(cfg.work_dir)
    tok = load_tokenizer(cfg.target_model, cfg.trust_remote_code)
    kw = cfg.template_kwargs
    try:
        suffix = assistant_suffix(tok, kw)
    except TypeError as e:
        raise PipelineError(f"the chat template of {cfg.target_model} failed with --chat-template-kwargs "
                            f"{json.dumps(kw)} ({e}).") from e
    check_tokenizer(cfg.target_model, tok, trust_remote_code=cfg.trust_remote_code, suffix=suffix)
    check_local_files(cfg.data)
    records = [r for src in cfg.data for r in iter_records(src, cfg.data_split)]
    # An exact copy of an earlier record is not answered again: a bad line, `duplicate`.
    records = mark_duplicates(records, functools.partial(record_turns, prompt_field=cfg.prompt_field))
    if not records:
        raise PipelineError(f"no records in {cfg.data}; check --data.")
    inputs = {"tokenizer": tokenizer_fingerprint(tok), "target_weights": weights_fingerprint(cfg.target_model)}
    for src in cfg.data:
        p = Path(src)
        inputs[f"data:{src}"] = sha256_file(p) if p.is_file() else f"datasets:{src}:{cfg.data_split}"
    params = identity_params(cfg)
    # What the chunks depend on; not the work directory, so boxes' chunks combine.
    identity = {"format": FORMAT, "params": {k: v for k, v in params.items() if k != "work_dir"},
                "inputs": inputs, "num_records": len(records)}
    return Plan(workdir, records, params, inputs, identity, sha256_json(identity),
                Turns(tok, suffix, kw, stop_ids(tok, suffix)), cfg.prompt_field)


def check_identity(plan: Plan, force: bool) -> None:
    """Refuse to mix chunks of two different runs in one folder."""
    d, path = plan.workdir.stage_dir("generate"), plan.workdir.generate_identity()
    if force and d.exists():
        # Every box's chunks are in it (days of a large target's GPU time), and this box owns
        # only its shard's: moved aside whole, for a person to delete, never deleted here.
        aside = d.with_name(f"{d.name}.previous-{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S.%fZ}")
        os.rename(d, aside)
        log.warning("--force: moved %s (every box's chunks in it) to %s; delete it once you no longer need it",
                    d, aside)
    if path.is_file():
        old = json.loads(path.read_text())
        if old != json.loads(json.dumps(plan.identity)):
            a, b = old.get("params", {}), plan.identity["params"]
            diff = sorted(k for k in set(a) | set(b) if k not in a or k not in b or a[k] != b[k])
            what = "; ".join(f"{k}: {a.get(k, '(absent)')!r} (in {path}) vs {b.get(k, '(absent)')!r} (this run)"
                             for k in diff) or \
                "the inputs (data, tokenizer or weights) changed"
            raise PipelineError(f"{d} holds chunks generated with other settings: {what}. Pass --force to "
                                f"move them aside and start over, or rerun with their settings.")
    else:
        write_json(path, plan.identity)


def chunk_complete(plan: Plan, k: int) -> dict | None:
    """The chunk's meta when its JSONL is complete and belongs to this run, else None."""
    meta_path, data = plan.workdir.generate_chunk_meta(k), plan.workdir.generate_chunk(k)
    if not meta_path.is_file() or not data.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("identity") != plan.identity_hash:
        log.warning("%s belongs to another run; redoing chunk %d", meta_path, k)
        return None
    if data.stat().st_size != meta["bytes"] or sha256_file(data) != meta["sha256"]:
        log.warning("%s does not match its checksum; redoing chunk %d", data, k)
        return None
    return meta


def chunk_counts(lines: list[dict]) -> dict:
    c: Counter = Counter()
    bad, dropped, stopped, finish, not_generated = Counter(), Counter(), Counter(), Counter(), Counter()
    for ln in lines:
        c["records"] += 1
        if "bad" in ln:
            bad[ln["bad"]] += 1
            continue
        c["input_turns"] += ln["turns_planned"]
        if "dropped" in ln:
            dropped[ln["dropped"]] += 1
            not_generated[ln["dropped"]] += ln["turns_planned"]
            continue
        c["conversations"] += 1
        c["turns_regenerated"] += len(ln["generated"])
        c["new_turns"] += max(0, len(ln["generated"]) - ln["assistant_turns_in_source"])
        c["generated_tokens"] += sum(len(g["ids"]) for g in ln["generated"])
        finish.update(g["finish_reason"] for g in ln["generated"])
        # the later turns the template's rewritten history made samples of their own
        c["samples"] += len(ln["samples"])
        c["turns_in_own_sample"] += len(ln["samples"]) - 1
        c["served_history_tokens"] += sum(s["prompt_tokens"] for s in ln["samples"] if s["first_turn"] > 0)
        if ln["stopped"]:
            stopped[ln["stopped"]] += 1
            not_generated[ln["stopped"]] += ln["turns_planned"] - len(ln["generated"])
    return {**c, "cut_answers": finish.get("length", 0), "bad_records": dict(bad),
            "dropped_conversations": dict(dropped), "stopped_early": dict(stopped),
            "turns_not_generated": dict(not_generated)}


def run_chunk(plan: Plan, k: int, engine: Engine, cfg: GenerateConfig,
              on_round: Callable[[int, int], None]) -> dict:
    items = [from_raw(r, plan.prompt_field) for r in plan.chunk(k)]
    convs = [x for x in items if isinstance(x, Conversation)]
    regenerate(convs, engine, plan.turns, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, on_round=on_round)
    lines = [x.record() if isinstance(x, Conversation) else x for x in items]
    data = plan.workdir.generate_chunk(k)
    with atomic_path(data) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for ln in lines:
                f.write(json.dumps(ln, ensure_ascii=False) + "\n")
    meta = {"chunk": k, "identity": plan.identity_hash, "bytes": data.stat().st_size, "sha256": sha256_file(data),
            "counts": chunk_counts(lines)}
    write_json(plan.workdir.generate_chunk_meta(k), meta)  # last: the completion mark
    return meta


def make_engine(cfg: GenerateConfig, plan: Plan) -> Engine:
    return VllmEngine(cfg.engine_config())


def _turns_in(plan: Plan, chunks: list[int]) -> int:
    n = 0
    for k in chunks:
        for r in plan.chunk(k):
            c = from_raw(r, plan.prompt_field)
            n += len(c.turns) if isinstance(c, Conversation) else 0
    return n


def refuse_if_nothing_to_answer(cfg: GenerateConfig, plan: Plan) -> None:
    """Before any engine starts: stop when not one record can become a conversation."""
    bad: Counter = Counter()
    for r in plan.records:
        c = from_raw(r, plan.prompt_field)
        if isinstance(c, Conversation):
            return
        bad[c["bad"]] += 1
    raise PipelineError(f"stage 00: no conversation to answer in {', '.join(cfg.data)}: {len(plan.records)} records, "
                        f"bad records: {reasons_text(bad)}; {likely_fix(bad, FIXES)}.")


def empty_or_mostly_dropped(cfg: GenerateConfig, counts: dict) -> str | None:
    """The counts' one-line problem when no conversation is left (an error) or more than half of
    the records are (a warning); None when most records became conversations."""
    lost = {**counts["bad_records"], **counts["dropped_conversations"]}
    n, kept = counts["records"], counts["conversations"]
    if kept and kept * 2 >= n:
        return None
    head = ("no conversation left" if not kept else f"only {kept} of {n} records became conversations")
    return (f"stage 00: {head} from {', '.join(cfg.data)}: {n} records, bad records: "
            f"{reasons_text(counts['bad_records'])}, dropped conversations: "
            f"{reasons_text(counts['dropped_conversations'])}; {likely_fix(lost, FIXES)}")


class _Progress:
    """The bar counts assistant turns (its ETA); the postfix shows generated tokens/s."""

    def __init__(self, total_turns: int):
        self.bar = tqdm(total=total_turns, unit="turn", desc="generate", smoothing=0.05)
        self.tokens, self.t0 = 0, time.perf_counter()

    def start(self) -> None:  # rates from the first engine up, not from the start
        self.tokens, self.t0 = 0, time.perf_counter()
        self.bar.reset(self.bar.total)

    def __call__(self, turns: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.update(turns)
        self.bar.set_postfix_str(f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.0f} gen tok/s",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()


def run_chunks(cfg: GenerateConfig, plan: Plan, chunks: list[int], engine: Engine,
               on_round: Callable[[int, int], None]) -> None:
    """Generate `chunks` with one engine. Turns a conversation never reached (it stopped
    early) are reported as done at the end of its chunk, so the bar's total is met."""
    engine.set_sampling(cfg.temperature, cfg.top_p, sorted(plan.turns.stop_ids))
    for k in chunks:
        seen = [0]

        def count(turns: int, tokens: int) -> None:
            seen[0] += turns
            on_round(turns, tokens)

        run_chunk(plan, k, engine, cfg, count)
        on_round(max(0, _turns_in(plan, [k]) - seen[0]), 0)


# --------------------------------------------------------------------------- data parallel

def _dp_worker(cfg: GenerateConfig, chunks: list[int], rank: int, report: Reporter) -> None:
    """One engine of `run_data_parallel`, in its own process: its tensor-parallel GPUs, its chunks."""
    use_gpu_group(rank, cfg.tensor_parallel_size, cfg.data_parallel_size)
    p = plan(cfg)
    engine = make_engine(cfg, p)
    report.ready()
    try:
        run_chunks(cfg, p, chunks, engine, report.progress)
    finally:
        engine.close()


# --------------------------------------------------------------------------- the stage

def write_results(cfg: GenerateConfig, plan: Plan) -> Manifest:
    metas, missing = {}, []
    for k in range(plan.num_chunks):
        meta = chunk_complete(plan, k)
        if meta is None:
            missing.append(k)
        else:
            metas[k] = meta
    counts: Counter = Counter()
    reasons: dict[str, Counter] = {"bad_records": Counter(), "dropped_conversations": Counter(),
                                   "stopped_early": Counter(), "turns_not_generated": Counter()}
    for meta in metas.values():
        for key, v in meta["counts"].items():
            if key in reasons:
                reasons[key].update(v)
            else:
                counts[key] += v
    out_counts = {**{k: counts.get(k, 0) for k in ("records", "conversations", "input_turns", "turns_regenerated",
                                                    "new_turns", "generated_tokens", "cut_answers", "samples",
                                                    "turns_in_own_sample", "served_history_tokens")},
                  **{k: dict(sorted(v.items())) for k, v in reasons.items()},
                  "chunks_expected": plan.num_chunks, "chunks_present": len(metas)}
    t = plan.turns
    shard_indices = sorted({k % cfg.num_shards for k in missing})
    record = GenerateRecord(
        target_model=cfg.target_model, tokenizer_fingerprint=plan.inputs["tokenizer"],
        chat_template_kwargs=t.template_kwargs, stop_token_ids=sorted(t.stop_ids), complete=not missing,
        num_chunks=plan.num_chunks, missing_chunks=len(missing), missing_shard_indices=shard_indices,
        **{k: out_counts[k] for k in RECORDED_COUNTS})
    extra = {
        "missing_chunks_first_100": missing[:100],
        "chunk_format": FORMAT,
        "identity_hash": plan.identity_hash,
        "chat_template_fingerprint": chat_template_fingerprint(t.tok),
        "assistant_suffix": t.suffix,
    }
    problem = empty_or_mostly_dropped(cfg, out_counts)
    if problem and not out_counts["conversations"] and not missing:
        # No manifest: stage 01 must not read an empty set as a finished one. The chunks stay,
        # so a rerun after fixing nothing says the same without generating again.
        raise PipelineError(f"{problem}.")
    outputs = [plan.workdir.generate_identity()] + [x for k in metas for x in (plan.workdir.generate_chunk(k),
                                                                       plan.workdir.generate_chunk_meta(k))]
    reported = {k: v for k, v in out_counts.items() if k not in RECORDED_COUNTS}  # one home each
    m = write_manifest(plan.workdir, "generate", params=plan.params, inputs=plan.inputs, counts=reported, outputs=outputs,
                       record=record, extra=extra, hash_outputs=False)  # each chunk's meta holds its sha256
    log.info("stage 00: %d/%d chunks; %d records -> %d conversations, %d of %d assistant turns generated (%d of "
             "them new answers to prompts; %d tokens, %d cut at max_new_tokens); %s; bad records %s, dropped %s, "
             "stopped early %s -> %s",
             len(metas), plan.num_chunks, out_counts["records"], out_counts["conversations"],
             out_counts["turns_regenerated"], out_counts["input_turns"], out_counts["new_turns"],
             out_counts["generated_tokens"], out_counts["cut_answers"], _samples_text(out_counts),
             out_counts["bad_records"] or "none", out_counts["dropped_conversations"] or "none",
             out_counts["stopped_early"] or "none", plan.workdir.stage_dir("generate"))
    lost = sum(out_counts["turns_not_generated"].values())
    if lost:
        log.warning("stage 00: %d of %d input assistant turns (%.1f%%) were not generated (their conversations "
                    "ended early or were dropped): %s; %s", lost, out_counts["input_turns"],
                    100.0 * lost / out_counts["input_turns"], reasons_text(out_counts["turns_not_generated"]),
                    likely_fix(out_counts["turns_not_generated"], FIXES))
    if problem:
        log.warning("%s", problem)
    if missing:
        log.warning("%d chunk(s) missing (%s...): run the other boxes (--num-shards %d --shard-index %s), copy "
                    "their chunks into %s, then rerun this command once to complete the manifest", len(missing),
                    missing[0], cfg.num_shards, shard_indices, plan.workdir.generate_chunks())
    return m


def _samples_text(c: dict) -> str:
    """The summary's words on the samples the conversations make (eagle3/target/loss_mask.py)."""
    if not c["turns_in_own_sample"]:
        return f"{c['samples']} samples, one per conversation (the chat template keeps history as generated)"
    return (f"{c['samples']} samples: {c['turns_in_own_sample']} later turns start a sample of their own, after the "
            f"history the chat template serves them (it rewrites earlier turns; {c['served_history_tokens']} tokens "
            f"of served history prefilled again)")


def generate_responses(cfg: GenerateConfig, engine: Engine | None = None) -> Manifest:
    """Run stage 00. `engine`: an engine already started (tests and the benchmark share one);
    by default this starts its own (one per data-parallel rank) and closes it."""
    p = plan(cfg)
    done = already_complete(p.workdir, "generate", p.params, p.inputs, force=cfg.force,
                            intact=lambda m: record_of(m).complete)  # every box's chunks are in
    if done:
        return done
    refuse_if_nothing_to_answer(cfg, p)
    check_identity(p, cfg.force)
    mine = list(range(p.num_chunks))[cfg.shard_index::cfg.num_shards]
    todo = [k for k in mine if chunk_complete(p, k) is None]
    log.info("stage 00: %d records in %d chunks, %d for this box (shard %d/%d), %d to do", len(p.records),
             p.num_chunks, len(mine), cfg.shard_index, cfg.num_shards, len(todo))
    if todo:
        progress = _Progress(_turns_in(p, todo))
        try:
            if cfg.data_parallel_size > 1 and engine is None:
                run_data_parallel(_dp_worker, (cfg,), todo, cfg.data_parallel_size, on_ready=progress.start,
                                  on_progress=progress, what="stage 00")
            else:
                own = engine is None
                eng = make_engine(cfg, p) if own else engine
                progress.start()
                try:
                    run_chunks(cfg, p, todo, eng, progress)
                finally:
                    if own:
                        eng.close()
        finally:
            progress.close()
    return write_results(cfg, p)
