"""Stage 00 (the target answers the inputs: assistant turns regenerated, prompts answered),
eagle3/stages/s00_generate/.

The first tests drive the turn logic and the empty-result refusals with a scripted
engine (no vLLM, milliseconds to seconds).
The rest run the stage on vLLM's CPU build with the tiny Llama target and one engine
shared by the whole module (one start, ~30 s); each run resets its prefix cache, so a
run sees the engine as a fresh one would. float32 keeps greedy decoding exactly
reproducible between runs of the same chunk. Cost: about 1 min 50 s on 2 cores (the
data-parallel test starts two more engines: ~1 min of it).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from fixtures import ROOT

from eagle3.artifacts.manifest import record_of
from eagle3.artifacts.workdir import WorkDir
from eagle3.stages.s00_generate.config import GenerateConfig
from eagle3.stages.s00_generate.conversation import (EMPTY_ANSWER, PROMPT_TOO_LONG, Conversation, Generation, Turns,
                                                     from_raw, regenerate, request_seed)
from eagle3.target.chats import RawRecord
from eagle3.target.loss_mask import assistant_suffix

SYSTEM = {"role": "system", "content": "You are a concise assistant."}
N_CHATS = 20  # 17 multi-turn among the first 20 demo chats (2 or 3 assistant turns)
MAX_NEW = 10
CHUNK = 8


def demo_records(n: int) -> list[dict]:
    lines = (ROOT / "data" / "demo_chats.jsonl").read_text().splitlines()[:n]
    return [json.loads(x) for x in lines]


# --------------------------------------------------------------------------- turn logic, scripted engine

@pytest.fixture(scope="module")
def tok():
    from eagle3.demo.tiny import build_tokenizer

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


def _prompt_of(c: Conversation, turns: Turns, j: int) -> list[int]:
    from eagle3.target.loss_mask import turn_prompt

    return turn_prompt(turns.tok, c.messages[: c.turns[j] + 1], c.answers, turns.suffix, turns.template_kwargs, turn=j)


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
        "sample_id": empty_first, "source": "chats.jsonl:1", "dropped": EMPTY_ANSWER, "turns_planned": len(first.turns)}
    assert second.stopped == EMPTY_ANSWER and len(second.record()["generated"]) == 1  # kept up to turn 0
    assert second.record()["messages"][-1]["role"] == "assistant"
    assert long_.stopped == PROMPT_TOO_LONG and long_.record()["dropped"] == PROMPT_TOO_LONG


def test_prompts_get_one_answer_per_user_turn_each_conditioned_on_the_answers_before(tok):
    from eagle3.stages.s00_generate.run import chunk_counts
    from eagle3.target.loss_mask import render

    t = turns_of(tok)
    eot = t.suffix[0]
    eng = Scripted(lambda p: Generation(tok.encode(f"Answer {len(p)}.", add_special_tokens=False) + [eot], "stop"))
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    records = [{"messages": [user("Hi, how are you doing?")]},                   # one user turn
               {"messages": [SYSTEM, user("Name a color."), user("Another one?")]},  # system first, two turns
               {"turns": ["Write a poem.", "Shorter.", "In French."]},          # MT-Bench
               {"question": "Why is the sky blue?"},
               {"messages": [user("a"), {"role": "assistant", "content": "x"}, user("b")]}]  # ends on a user turn
    convs = convs_of(records)
    regenerate(convs, eng, t, max_new_tokens=MAX_NEW, seed=0)
    assert [len(c.answers) for c in convs] == [1, 2, 3, 1, 2]
    assert [len(call) for call in eng.calls] == [5, 3, 1]  # round r: turn r of every conversation that has one
    # Turn 0's prompt is the record's turns up to its first user turn, system kept.
    assert eng.calls[0][1] == render(tok, [SYSTEM, user("Name a color.")], add_generation_prompt=True)
    for c in convs:
        for j in range(1, len(c.turns)):
            before, now = _prompt_of(c, t, j - 1), _prompt_of(c, t, j)
            assert now in eng.calls[j] and now[:len(before)] == before
            assert now[len(before):len(before) + len(c.answers[j - 1].ids)] == c.answers[j - 1].ids
    lines = [c.record() for c in convs]
    assert [m["role"] for m in lines[1]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in lines[2]["messages"][::2]] == ["Write a poem.", "Shorter.", "In French."]
    assert all(m["content"].startswith("Answer ") for ln in lines for m in ln["messages"]
               if m["role"] == "assistant" and m["content"] != "x") and lines[4]["messages"][1]["content"] != "x"
    c = chunk_counts(lines)
    assert c["conversations"] == 5 and c["turns_regenerated"] == 9 and c["new_turns"] == 8  # 1 regenerated


def test_prompt_field_and_bad_records_in_from_raw():
    (named,) = convs_of([{"text": "Hello?", "prompt": "ignored"}])
    assert named.messages[0]["content"] == "ignored"  # `prompt` is a default field
    named = from_raw(RawRecord("p.jsonl", 1, {"text": "Hello?", "prompt": "ignored"}), prompt_field="text")
    assert named.messages == [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": ""}]
    bad = from_raw(RawRecord("p.jsonl", 2, {"body": "x"}), prompt_field="text")
    assert bad["bad"] == "no_prompt_field" and bad["sample_id"] == "p.jsonl:2"


def _gen(tmp_path, target, data, **kw) -> GenerateConfig:
    return GenerateConfig(work_dir=tmp_path / "w", target_model=str(target), data=[str(data)],
                          max_new_tokens=MAX_NEW, chunk_size=CHUNK, **kw)


def test_no_conversation_to_answer_stops_before_an_engine_starts(tmp_path, tiny_llama):
    from eagle3.core.errors import PipelineError
    from eagle3.stages.s00_generate.run import generate_responses

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"text": f"opener {i}"}) + "\n" for i in range(5)) + "{oops\n")
    eng = Scripted(lambda p: Generation([1], "stop"))
    with pytest.raises(PipelineError) as e:
        generate_responses(_gen(tmp_path, tiny_llama, data), engine=eng)
    msg = str(e.value)
    assert "\n" not in msg and str(data) in msg and "6 records" in msg
    assert "no_messages 5, malformed_json 1" in msg and "--prompt-field" in msg
    assert eng.calls == [] and not (tmp_path / "w" / "00_generate").exists()
    # The same file with its field named: every record answered.
    m = generate_responses(_gen(tmp_path, tiny_llama, data, prompt_field="text"),
                           engine=Scripted(lambda p: Generation([5, 6, 7], "length")))
    assert record_of(m).conversations == record_of(m).new_turns == 5
    assert m.counts["bad_records"] == {"malformed_json": 1}


def test_nothing_left_after_generation_is_an_error_and_most_dropped_a_warning(tmp_path, tiny_llama, tok, caplog):
    from eagle3.core.errors import PipelineError
    from eagle3.stages.s00_generate.run import generate_responses

    eot = turns_of(tok).suffix[0]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"opener {i}"}) + "\n" for i in range(4)))
    with pytest.raises(PipelineError) as e:  # the target answers nothing but its stop token
        generate_responses(_gen(tmp_path, tiny_llama, data), engine=Scripted(lambda p: Generation([eot], "stop")))
    msg = str(e.value)
    assert "no conversation left" in msg and "4 records" in msg and "empty_answer 4" in msg
    assert "--chat-template-kwargs" in msg and "\n" not in msg
    assert not WorkDir(tmp_path / "w").manifest("generate").exists()  # stage 01 cannot take it for a result
    # One answer of four: a manifest, and a warning with the same counts.
    first = {}

    def one(p):
        first.setdefault("prompt", list(p))
        return Generation(tok.encode("Fine.", add_special_tokens=False) + [eot] if list(p) == first["prompt"]
                          else [eot], "stop")

    m = generate_responses(_gen(tmp_path, tiny_llama, data, force=True), engine=Scripted(one))
    assert record_of(m).conversations == 1 and m.counts["dropped_conversations"] == {"empty_answer": 3}
    assert any("only 1 of 4 records became conversations" in r.getMessage() and "empty_answer 3" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")


def test_request_seed_depends_on_seed_sample_and_turn_only():
    a = request_seed(0, "chats.jsonl:3", 1)
    assert a == request_seed(0, "chats.jsonl:3", 1)
    assert len({a, request_seed(1, "chats.jsonl:3", 1), request_seed(0, "chats.jsonl:4", 1),
                request_seed(0, "chats.jsonl:3", 2)}) == 4
    assert 0 <= a < 2**31


def test_bad_chat_template_kwargs_are_refused_naming_the_flag(tmp_path):
    from eagle3.core.errors import PipelineError

    with pytest.raises(PipelineError, match="--chat-template-kwargs"):
        GenerateConfig(work_dir=tmp_path, target_model="x", data=["a.jsonl"], chat_template_kwargs="{thinking")
    cfg = GenerateConfig(work_dir=tmp_path, target_model="x", data=["a.jsonl"],
                         chat_template_kwargs='{"thinking": false}')
    assert cfg.template_kwargs == {"thinking": False}


# --------------------------------------------------------------------------- the stage on vLLM's CPU build

class Counting:
    """Wraps the shared engine: counts requests, optionally dies after `fail_after` calls
    (a kill mid-chunk), and resets the prefix cache first (a fresh engine's state)."""

    def __init__(self, engine, fail_after: int | None = None):
        self.engine, self.fail_after, self.calls, self.requests = engine, fail_after, 0, 0
        self.max_model_len = engine.max_model_len
        engine.reset_prefix_cache()

    def set_sampling(self, *a):
        self.engine.set_sampling(*a)

    def generate(self, requests):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls += 1
        self.requests += len(requests)
        return self.engine.generate(requests)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from eagle3.engines.config import EngineConfig
    from eagle3.stages.s00_generate.vllm_runner import VllmEngine

    eng = VllmEngine(EngineConfig(model=str(tiny_llama), dtype="float32", max_model_len=256, max_num_seqs=64,
                                  gpu_memory_utilization=0.3, kv_cache_gib=0.5, enforce_eager=True))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """The first N_CHATS demo chats, then bad records and a prompt longer than the context."""
    path = tmp_path_factory.mktemp("gen-data") / "chats.jsonl"
    lines = [json.dumps(r) for r in demo_records(N_CHATS)]
    lines += ['{"messages": [', json.dumps({"messages": [{"role": "robot", "content": "beep"}]}),
              json.dumps({"messages": [SYSTEM, {"role": "user", "content": "Hi"},  # a prompt of two user turns
                                       {"role": "user", "content": "How are you?"}]}),
              json.dumps({"messages": [{"role": "user", "content": "tell me " * 200},
                                       {"role": "assistant", "content": "ok"}]})]
    path.write_text("\n".join(lines) + "\n")
    return path


def gen_cfg(workdir: Path, target: Path, chats: Path, **kw) -> GenerateConfig:
    base = dict(work_dir=workdir, target_model=str(target), data=[str(chats)], max_new_tokens=MAX_NEW,
                chunk_size=CHUNK, dtype="float32")
    base.update(kw)
    return GenerateConfig(**base)


def chunk_bytes(workdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(WorkDir(workdir).generate_chunks().glob("chunk-*.jsonl"))}


def lines_of(workdir: Path) -> list[dict]:
    return [json.loads(x) for b in chunk_bytes(workdir).values() for x in b.decode().splitlines()]


@pytest.fixture(scope="module")
def unbroken(engine, tiny_llama, chats, tmp_path_factory) -> Path:
    from eagle3.stages.s00_generate.run import generate_responses

    workdir = tmp_path_factory.mktemp("gen-unbroken")
    generate_responses(gen_cfg(workdir, tiny_llama, chats), engine=Counting(engine))
    return workdir


def test_bad_inputs_and_long_prompts_are_counted_not_dropped(unbroken):
    m = json.loads(WorkDir(unbroken).manifest("generate").read_text())
    c = {**m["counts"], **m["record"]}  # figures only reported, and those later stages read
    assert c["records"] == N_CHATS + 4 and c["conversations"] == N_CHATS + 1
    assert c["bad_records"] == {"malformed_json": 1, "unknown_role": 1}
    assert c["dropped_conversations"] == {"prompt_too_long": 1}
    n_turns = sum(len(c.turns) for c in convs_of(demo_records(N_CHATS)))
    assert c["stopped_early"] == {}
    # every assistant turn of every good chat, and one answer after each user turn of the prompt
    assert c["turns_regenerated"] == n_turns + 2 and c["new_turns"] == 2
    # the long prompt's one turn is the only input turn not generated
    assert c["input_turns"] == n_turns + 3 and c["turns_not_generated"] == {"prompt_too_long": 1}
    lines = lines_of(unbroken)
    assert len(lines) == N_CHATS + 4  # one line per input record, in input order
    assert [ln["sample_id"].split(":")[1] for ln in lines] == [str(i) for i in range(1, N_CHATS + 5)]
    assert c["generated_tokens"] == sum(len(g["ids"]) for ln in lines for g in ln.get("generated", []))
    assert c["cut_answers"] == sum(g["finish_reason"] == "length" for ln in lines for g in ln.get("generated", []))
    assert m["record"]["complete"] and m["record"]["num_chunks"] == 3


def test_stage01_uses_the_generated_ids_exactly_and_each_turn_saw_the_ones_before(unbroken, engine, tiny_llama):
    from eagle3.artifacts.dataset import load_split
    from eagle3.stages.s00_generate.conversation import Request as Req
    from eagle3.stages.s01_prepare.config import PrepareConfig
    from eagle3.stages.s01_prepare.run import prepare_dataset

    m = prepare_dataset(PrepareConfig(work_dir=unbroken, target_model=str(tiny_llama), data=["generated"],
                                      max_length=512, eval_fraction=0.0, num_workers=1))
    assert m.extra["data_from"] == "00_generate"
    assert record_of(m).bad_records == {"malformed_json": 1, "prompt_too_long": 1, "unknown_role": 1}
    ds = load_split(WorkDir(unbroken).dataset("train"))
    rows = {r["sample_id"]: r for r in ds}
    lines = [ln for ln in lines_of(unbroken) if "generated" in ln]
    assert m.counts["generated_turns"] == sum(len(ln["generated"]) for ln in lines)
    gen_manifest = json.loads(WorkDir(unbroken).manifest("generate").read_text())
    eng = Counting(engine)
    eng.set_sampling(0.0, 1.0, gen_manifest["record"]["stop_token_ids"])
    multi = 0
    for ln in lines:
        # the conversation's samples (one, unless the template rewrote a history: the untrained
        # target's answers often start with a space, which this template trims away)
        sids = [ln["sample_id"] if x["first_turn"] == 0 else f"{ln['sample_id']}#turn{x['first_turn'] + 1}"
                for x in ln["samples"]]
        spans = []  # (sample ids, start, end) of each masked run, in turn order
        for sid in sids:
            ids, mask = np.asarray(rows[sid]["input_ids"]), np.asarray(rows[sid]["loss_mask"])
            edges = np.diff(np.concatenate([[0], mask, [0]]))
            spans += [(ids, a, b) for a, b in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1))]
        assert len(spans) == len(ln["generated"])
        for (ids, a, b), g in zip(spans, ln["generated"]):
            assert ids[a:b].tolist() == g["ids"]  # token-exact: the ids the target generated, all masked
        if len(ln["generated"]) > 1 and multi < 4:
            # replaying the last turn's context, as stage 01 stored it, gives the same answer:
            # that turn was generated in exactly that context
            multi += 1
            ids, a, _ = spans[-1]
            (out,) = eng.generate([Req(ids[:a].tolist(), MAX_NEW, 0)])
            assert out.ids == ln["generated"][-1]["ids"]
    assert multi == 4


def test_prompt_shapes_go_through_stages_00_and_01_every_conversation_answered(engine, tiny_llama, tmp_path):
    """Prompts without answers, from a `datasets` folder (save_to_disk, `instruction`) and from
    a JSONL file whose field --prompt-field names: each gets the target's answer in stage 00,
    and each answer is one training sample of stage 01, masked token for token."""
    import datasets

    from eagle3.artifacts.dataset import load_split
    from eagle3.stages.s00_generate.run import generate_responses
    from eagle3.stages.s01_prepare.config import PrepareConfig
    from eagle3.stages.s01_prepare.run import prepare_dataset

    openers = [f"Hi, how is your day {i}?" for i in range(6)]
    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"instruction": o, "input": ""} for o in openers]).save_to_disk(str(folder))
    jsonl = tmp_path / "openers.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "opener": o}) + "\n" for i, o in enumerate(openers)))
    for name, data, field in (("saved", folder, None), ("field", jsonl, "opener")):
        workdir = tmp_path / f"work-{name}"
        m0 = generate_responses(gen_cfg(workdir, tiny_llama, data, prompt_field=field), engine=Counting(engine))
        c = {**m0.counts, **asdict(record_of(m0))}
        assert c["records"] == c["conversations"] == c["new_turns"] == c["turns_regenerated"] == len(openers)
        assert c["bad_records"] == c["dropped_conversations"] == {}
        m1 = prepare_dataset(PrepareConfig(work_dir=workdir, target_model=str(tiny_llama), data=["generated"],
                                           max_length=512, eval_fraction=0.0, num_workers=1))
        assert record_of(m1).samples["train"] == len(openers) and record_of(m1).bad_records == {}
        generated = {ln["sample_id"]: ln["generated"][0]["ids"] for ln in lines_of(workdir)}
        for row in load_split(WorkDir(workdir).dataset("train")):
            ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
            assert ids[mask.astype(bool)].tolist() == generated[row["sample_id"]]


def test_engine_returns_the_stop_token_with_the_answer(engine, tiny_llama):
    from eagle3.stages.s00_generate.conversation import Request as Req

    eng = Counting(engine)
    eng.set_sampling(0.0, 1.0, [])
    prompt = [1] + list(range(100, 120))
    (free,) = eng.generate([Req(prompt, 4, 0)])
    assert len(free.ids) == 4 and free.finish_reason == "length"
    eng.set_sampling(0.0, 1.0, [free.ids[1]])  # greedy: the second token is now a stop token
    (stopped,) = eng.generate([Req(prompt, 4, 0)])
    first = free.ids.index(free.ids[1])
    assert stopped.finish_reason == "stop" and stopped.ids == free.ids[:first + 1]


def test_kill_and_resume_equals_the_unbroken_run(unbroken, engine, tiny_llama, chats, tmp_path):
    from eagle3.stages.s00_generate.run import generate_responses

    cfg = gen_cfg(tmp_path, tiny_llama, chats)
    with pytest.raises(KeyboardInterrupt):  # killed in the middle of chunk 1 (after 3 rounds)
        generate_responses(cfg, engine=Counting(engine, fail_after=3))
    done = chunk_bytes(tmp_path)
    assert set(done) == {"chunk-00000.jsonl"}
    assert not WorkDir(tmp_path).manifest("generate").exists()
    again = Counting(engine)
    generate_responses(cfg, engine=again)
    assert chunk_bytes(tmp_path) == chunk_bytes(unbroken)  # bitwise: the same computation replayed
    # chunk 0 was complete: only chunks 1 and 2 were generated again
    assert again.requests == sum(len(ln["generated"]) for ln in lines_of(unbroken)[CHUNK:] if "generated" in ln)
    # a rerun of a complete stage does nothing
    idle = Counting(engine)
    generate_responses(cfg, engine=idle)
    assert idle.calls == 0


def test_two_shards_combined_equal_one_run(unbroken, engine, tiny_llama, chats, tmp_path):
    from eagle3.core.errors import PipelineError
    from eagle3.stages.s00_generate.run import generate_responses
    from eagle3.stages.s01_prepare.config import PrepareConfig
    from eagle3.stages.s01_prepare.run import prepare_dataset

    boxes = [tmp_path / f"box{i}" for i in range(2)]
    for i, workdir in enumerate(boxes):
        m = generate_responses(gen_cfg(workdir, tiny_llama, chats, num_shards=2, shard_index=i), engine=Counting(engine))
        assert not record_of(m).complete and record_of(m).missing_shard_indices == [1 - i]
    with pytest.raises(PipelineError, match="incomplete"):
        prepare_dataset(PrepareConfig(work_dir=boxes[0], target_model=str(tiny_llama), data=["generated"],
                                      num_workers=1))
    d0 = WorkDir(boxes[0]).generate_chunks()
    for f in WorkDir(boxes[1]).generate_chunks().glob("chunk-*"):
        shutil.copy(f, d0 / f.name)
    idle = Counting(engine)
    m = generate_responses(gen_cfg(boxes[0], tiny_llama, chats), engine=idle)
    assert idle.calls == 0 and record_of(m).complete
    assert chunk_bytes(boxes[0]) == chunk_bytes(unbroken)
    assert m.counts == json.loads(WorkDir(unbroken).manifest("generate").read_text())["counts"]


def test_other_settings_are_refused_without_force(unbroken, engine, tiny_llama, chats):
    from eagle3.core.errors import PipelineError
    from eagle3.stages.s00_generate.run import generate_responses

    with pytest.raises(PipelineError, match="temperature"):
        generate_responses(gen_cfg(unbroken, tiny_llama, chats, temperature=0.7), engine=Counting(engine))


def test_data_parallel_engines_write_the_same_chunks(unbroken, tiny_llama, chats, tmp_path):
    """Two engines in spawned processes split the chunks; each chunk is the one engine's. Their
    engine cores run inside those processes (`engine_in_process`, as the SmolLM2 config runs
    stage 00): the same chunks as the test session's separately spawned engine core."""
    from eagle3.stages.s00_generate.run import generate_responses

    m = generate_responses(gen_cfg(tmp_path, tiny_llama, chats, data_parallel_size=2, max_model_len=256,
                                   kv_cache_gib=0.5, enforce_eager=True, engine_in_process=True))
    assert record_of(m).complete
    assert chunk_bytes(tmp_path) == chunk_bytes(unbroken)


def test_force_moves_every_boxs_chunks_aside_whole(tmp_path, tiny_llama):
    """--force starts over without deleting: 00_generate holds every box's chunks (a large
    target's days), so it is moved aside whole, chunk bytes unchanged."""
    from eagle3.stages.s00_generate.run import generate_responses

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"opener {i}"}) + "\n" for i in range(4)))
    generate_responses(_gen(tmp_path, tiny_llama, data), engine=Scripted(lambda p: Generation([5, 6, 7], "length")))
    before = chunk_bytes(tmp_path / "w")
    assert before
    generate_responses(_gen(tmp_path, tiny_llama, data, temperature=0.7, force=True),
                       engine=Scripted(lambda p: Generation([8, 9], "length")))
    (aside,) = (tmp_path / "w").glob("00_generate.previous-*")
    assert {p.name: p.read_bytes() for p in sorted((aside / "chunks").glob("chunk-*.jsonl"))} == before
    assert chunk_bytes(tmp_path / "w") != before  # the new run's answers in their place
