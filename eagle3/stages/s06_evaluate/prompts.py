"""Stage 06's prompt sets: what the target is asked, as token ids, with an optional category.

Two sources:

- stage 01's eval split (the default): each assistant turn's context, already
  tokenized by stage 01 (`held_out_prompts`). The dataset's answer comes along, for
  the teacher check (how often the target's greedy answer is the dataset's).
- a prompt file or a `datasets` id (`file_prompts`): JSON / JSONL records in the shapes
  stage 00 reads (eagle3/target/chats.py, `record_turns`): OpenAI `messages`, ShareGPT
  `conversations`, a `prompt` / `instruction` / `question` field, MT-Bench `turns`, or
  the field `--prompt-field` names (then only that one). A conversation is the prompt
  up to its last user turn; trailing assistant turns (a reference answer) are dropped.
  User turns with no answer between them (MT-Bench's `turns`, stage 00's prompt files)
  give their first turn: later turns need the target's own earlier answers. Each
  prompt is rendered with the target's chat template, generation prompt included.
  `--category-field` names a column whose value groups the prompts (MT-Bench's
  `category`); acceptance is then reported per group.

Reads nothing but the source; the stage (eagle3/stages/s06_evaluate/run.py) decides which to use.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.artifacts.dataset import load_split
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.target.chats import BadRecord, iter_records, record_turns
from eagle3.target.loss_mask import render


@dataclass
class Prompt:
    sample_id: str
    turn: int  # 0 = the conversation's first assistant turn
    prompt_ids: list[int]  # everything before the assistant's answer, generation prompt included
    reference_ids: list[int] | None  # the dataset's answer (content + end-of-turn), for the teacher check
    category: str | None = None


# --------------------------------------------------------------------------- stage 01's eval split

def assistant_turns(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a loss mask: one per assistant turn."""
    m = np.asarray(loss_mask, dtype=np.int8)
    edges = np.diff(np.concatenate([[0], m, [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def held_out_prompts(workdir: WorkDir, num_prompts: int | None, max_prompt_len: int) -> tuple[list[Prompt], dict]:
    """Prompts from stage 01's eval split: each assistant turn's context, as token ids.

    Order: every conversation's first turn, then every second turn, ..., so a small
    `num_prompts` still spreads over conversations. Turns whose context exceeds
    `max_prompt_len` are skipped (and counted).
    """
    path = workdir.dataset("eval")
    ds = load_split(path)  # an empty split (--eval-fraction 0) reads as no rows: the error below names the fix
    by_turn: dict[int, list[Prompt]] = {}
    too_long = 0
    for sid, ids, mask in zip(ds["sample_id"], ds["input_ids"], ds["loss_mask"]):
        ids = [int(t) for t in ids]
        for turn, (start, end) in enumerate(assistant_turns(mask)):
            if start == 0:
                continue  # no context to condition on
            if start > max_prompt_len:
                too_long += 1
                continue
            by_turn.setdefault(turn, []).append(Prompt(sid, turn, ids[:start], ids[start:end]))
    ordered = [p for turn in sorted(by_turn) for p in by_turn[turn]]
    if not ordered:
        raise PipelineError(
            f"{path} holds no assistant turn to prompt with ({len(ds)} conversations, {too_long} turns longer "
            f"than {max_prompt_len} tokens); rerun `python {WorkDir.script('prepare')}` with a larger "
            f"--eval-fraction, or raise --max-model-len.")
    chosen = ordered if num_prompts is None else ordered[:num_prompts]
    info = {"source": str(path), "conversations": len(ds), "available": len(ordered), "count": len(chosen),
            "skipped_too_long": too_long, "category_field": None,
            "prompt_tokens_mean": float(np.mean([len(p.prompt_ids) for p in chosen]))}
    return chosen, info


# --------------------------------------------------------------------------- a prompt file or a datasets id

def record_messages(record: Any, prompt_field: str | None) -> list[dict]:
    """The messages a record asks the target, ending with a user turn.

    Raises BadRecord (with the reason) for a record that holds no prompt.
    """
    messages = record_turns(record, prompt_field)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()  # a reference answer: the target writes its own
    system = 1 if messages and messages[0]["role"] == "system" else 0
    body = messages[system:]
    if not body or body[-1]["role"] != "user":
        raise BadRecord("no_user_turn", "the record has no user turn to answer")
    if len(body) > 1 and all(m["role"] == "user" for m in body):
        return messages[:system + 1]  # unanswered turns: later ones need the target's first answer
    return messages


def file_prompts(source: str, split: str, tok, prompt_field: str | None, category_field: str | None,
                 num_prompts: int | None, max_prompt_len: int,
                 template_kwargs: dict | None = None) -> tuple[list[Prompt], dict]:
    """Prompts from a local JSON/JSONL file or a `datasets` id, rendered with `tok`'s chat template
    (with the template switches stage 00/01 used, `template_kwargs`, so the drafter sees the
    prompts in the shape it was trained on).

    A bad record stops the stage naming file and line: a benchmark set is small and
    every prompt of it is meant to count. Prompts longer than `max_prompt_len` are
    skipped (and counted).
    """

    local = Path(source).suffix in (".json", ".jsonl")
    if local and not Path(source).is_file():
        raise PipelineError(f"prompt file {source} does not exist; pass a .json/.jsonl file or a datasets id "
                            f"with --prompts.")
    if getattr(tok, "chat_template", None) is None:
        raise PipelineError(f"the target's tokenizer has no chat template, so the prompts of {source} cannot be "
                            f"rendered as chats; evaluate on stage 01's eval split (drop --prompts).")
    try:
        records = list(iter_records(source, split))
    except Exception as e:  # noqa: BLE001 - a missing file, an unknown id or split, no network: one fix
        raise PipelineError(f"cannot read prompts from {source!r} (split {split!r}): {e}; pass a local "
                            f".json/.jsonl file or a datasets id and --prompts-split.") from e
    prompts: list[Prompt] = []
    too_long = 0
    for raw in records:
        try:
            messages = record_messages(raw.record, prompt_field)
        except BadRecord as e:
            raise PipelineError(f"{raw.where}: {e}; fix the record, or name the field holding the prompt with "
                                f"--prompt-field.") from e
        category = None
        if category_field:
            value = raw.record.get(category_field)
            if value is None or str(value).strip() == "":
                raise PipelineError(f"{raw.where}: no `{category_field}` value (--category-field); give every "
                                    f"record one, or drop --category-field.")
            category = str(value)
        ids = render(tok, messages, add_generation_prompt=True, template_kwargs=template_kwargs)
        if len(ids) > max_prompt_len:
            too_long += 1
            continue
        prompts.append(Prompt(raw.where, sum(m["role"] == "assistant" for m in messages), ids, None, category))
    if not prompts:
        raise PipelineError(f"{source} holds no prompt to serve ({len(records)} records, {too_long} longer than "
                            f"{max_prompt_len} tokens); raise --max-model-len or pass another --prompts.")
    available = len(prompts)
    chosen = prompts if num_prompts is None else prompts[:num_prompts]
    info = {"source": source, "split": None if local else split, "records": len(records), "available": available,
            "count": len(chosen), "skipped_too_long": too_long, "category_field": category_field,
            "chat_template_kwargs": template_kwargs or {},
            "prompt_tokens_mean": float(np.mean([len(p.prompt_ids) for p in chosen]))}
    return chosen, info


# --------------------------------------------------------------------------- groups and the timing subset

def categories(prompts: list[Prompt]) -> list[str]:
    """Distinct categories in first-seen order ([] when the prompts carry none)."""
    seen: dict[str, None] = {}
    for p in prompts:
        if p.category is not None:
            seen.setdefault(p.category, None)
    return list(seen)


def timing_subset(prompts: list[Prompt], n: int) -> list[int]:
    """Indices of the `n` prompts timed single-stream: round-robin over categories, each in
    prompt order, so a small subset still covers every category (first prompts when none)."""
    if n <= 0:
        return []
    by_cat: dict[str | None, list[int]] = {}
    for i, p in enumerate(prompts):
        by_cat.setdefault(p.category, []).append(i)
    queues = list(by_cat.values())
    out: list[int] = []
    depth = 0
    while len(out) < min(n, len(prompts)):
        for q in queues:
            if depth < len(q) and len(out) < n:
                out.append(q[depth])
        depth += 1
    return sorted(out)
