"""Stage 00 (regenerate assistant turns with the target), eagle3/generate/.

The first tests drive the turn logic with a scripted engine (no vLLM, milliseconds).
The rest run the stage on vLLM's CPU build with the tiny Llama target and one engine
shared by the whole module (one start, ~30 s); each run resets its prefix cache, so a
run sees the engine as a fresh one would. float32 keeps greedy decoding exactly
reproducible between runs of the same chunk. Cost: about 1.5 min on 2 cores.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from eagle3.chats import RawRecord
from eagle3.generate.config import GenerateConfig
from eagle3.generate.conversation import (EMPTY_ANSWER, PROMPT_TOO_LONG, Conversation, Generation, Turns,
                                          from_raw, regenerate, request_seed)
from eagle3.loss_mask import assistant_suffix
from eagle3.workdir import WorkDir

ROOT = Path(__file__).resolve().parent.parent
N_CHATS = 20  # 17 multi-turn among the first 20 demo chats (2 or 3 assistant turns)
MAX_NEW = 10
CHUNK = 8


def demo_records(n: int) -> list[dict]:
    lines = (ROOT / "data" / "demo_chats.jsonl").read_text().splitlines()[:n]
    return [json.loads(x) for x in lines]


# --------------------------------------------------------------------------- turn logic, scripted engine

@pytest.fixture(scope="module")
def tok():
    from eagle3.tiny import build_tokenizer

    return build_tokenizer()


class Scripted:
    """An engine whose answer is a function of (prompt); it records every call's prompts."""

    def __init__(self, answer, max_model_len: int = 4096):
        self.answer, self.max_model_len, self.calls = answer, max_model_len, []

    def set_sampling(self, temperature, top_p, stop_ids):
        pass

    def generate(self, requests):
        self.calls.append([list(r.prompt_ids) for r in requests])
        return [self.answer(r.prompt_ids) for r in requests]


def turns_of(tok) -> Turns:
    suffix = assistant_suffix(tok)
    return Turns(tok, suffix, {}, {suffix[0]})


def convs_of(records) -> list[Conversation]:
    return [from_raw(RawRecord("chats.jsonl", i + 1, r)) for i, r in enumerate(records)]


def test_turns_go_in_rounds_each_conditioned_on_the_regenerated_turns_before(tok):
    t = turns_of(tok)
    eot = t.suffix[0]
    # the answer names the prompt's length, so every turn's ids differ from the dataset's
    eng = Scripted(lambda p: Generation(tok.encode(f"Answer {len(p)}.", add_special_tokens=False) + [eot], "stop"))
    convs = convs_of(demo_records(6))
    n_turns = [len(c.turns) for c in convs]
    regenerate(convs, eng, t, max_new_tokens=MAX_NEW, seed=0)
    # round r holds turn r of every conversation that has one: all of them together
    assert [len(c) for c in eng.calls] == [sum(n > r for n in n_turns) for r in range(max(n_turns))]
    for c in convs:
        assert c.done and c.stopped is None and len(c.answers) == len(c.turns)
        assert _prompt_of(c, t, 0) in eng.calls[0]
        for j in range(1, len(c.turns)):
            # turn j's prompt = turn j-1's prompt + its generated ids + the template + user turn j
            before, now = _prompt_of(c, t, j - 1), _prompt_of(c, t, j)
            assert now in eng.calls[j]
            assert now[:len(before)] == before
            assert now[len(before):len(before) + len(c.answers[j - 1].ids)] == c.answers[j - 1].ids
            user = c.messages[c.turns[j] - 1]["content"]
            assert user in tok.decode(now[len(before):])  # the user turn stays as it was
        # the stored messages hold the decoded answers, system and user turns untouched
        for j, i in enumerate(c.turns):
            assert c.messages[i]["content"] == tok.decode(c.answers[j].ids[:-1])
            assert c.messages[i]["content"].startswith("Answer ")


def _prompt_of(c: Conversation, t: Turns, j: int) -> list[int]:
    from eagle3.loss_mask import spliced_sample

    ids, _ = spliced_sample(t.tok, c.messages[: c.turns[j] + 1], c.answers, t.suffix, t.template_kwargs, upto=j)
    return ids.tolist()


def test_empty_answers_and_long_prompts_are_counted_by_reason(tok):
    t = turns_of(tok)
    eot = t.suffix[0]
    records = demo_records(6)
    long_user = {"messages": [{"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "x"}]}
    convs = convs_of(records + [long_user])
    empty_first, empty_second = convs[0].sample_id, next(c.sample_id for c in convs if len(c.turns) >= 2)

    def answer(p):  # empty on the first conversation's turn 0 and a multi-turn one's turn 1
        for c in convs:
            if c.sample_id in (empty_first, empty_second) and len(c.answers) == (0 if c.sample_id == empty_first
                                                                                  else 1):
                if _prompt_of(c, t, len(c.answers)) == list(p):
                    return Generation([eot], "stop")
        return Generation(tok.encode("Fine.", add_special_tokens=False) + [eot], "stop")

    regenerate(convs, Scripted(answer, max_model_len=300), t, max_new_tokens=MAX_NEW, seed=0)
    by_id = {c.sample_id: c for c in convs}
    first, second, long_ = by_id[empty_first], by_id[empty_second], convs[-1]
    assert first.stopped == EMPTY_ANSWER and first.record() == {
        "sample_id": empty_first, "source": "chats.jsonl:1", "dropped": EMPTY_ANSWER}
    assert second.stopped == EMPTY_ANSWER and len(second.record()["generated"]) == 1  # kept up to turn 0
    assert second.record()["messages"][-1]["role"] == "assistant"
    assert long_.stopped == PROMPT_TOO_LONG and long_.record()["dropped"] == PROMPT_TOO_LONG


def test_request_seed_depends_on_seed_sample_and_turn_only():
    a = request_seed(0, "chats.jsonl:3", 1)
    assert a == request_seed(0, "chats.jsonl:3", 1)
    assert len({a, request_seed(1, "chats.jsonl:3", 1), request_seed(0, "chats.jsonl:4", 1),
                request_seed(0, "chats.jsonl:3", 2)}) == 4
    assert 0 <= a < 2**31


def test_bad_chat_template_kwargs_are_refused_naming_the_flag(tmp_path):
    from eagle3.errors import PipelineError

    with pytest.raises(PipelineError, match="--chat-template-kwargs"):
        GenerateConfig(work_dir=tmp_path, target_model="x", data=["a.jsonl"], chat_template_kwargs="{thinking")
    cfg = GenerateConfig(work_dir=tmp_path, target_model="x", data=["a.jsonl"],
                         chat_template_kwargs='{"thinking": false}')
    assert cfg.template_kwargs == {"thinking": False}
