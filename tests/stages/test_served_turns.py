"""Later turns generated (stage 00) and trained (stage 01) in the context the server shows.

A thinking template that renders every earlier assistant turn as `<think></think>` + its
answer (the rule of Kimi-K2.5's template, docs/KIMI_K25.md "Chat template and turns") on
the tiny Llama's tokenizer, 40 two-turn chats, a scripted target that reasons, then
answers: turn 2 must be generated after the served history (no reasoning), and stage 01
must give it a sample of its own (the served history + its generated ids). Templates that
keep history as generated keep one sample per conversation, bitwise as before (the plain
rendering of the same answers is the reference). No engine: the target is scripted
(stage 00's `Engine` protocol); seconds.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from eagle3.artifacts.dataset import load_split
from eagle3.artifacts.manifest import record_of
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s00_generate.config import GenerateConfig
from eagle3.stages.s00_generate.conversation import Generation
from eagle3.stages.s00_generate.run import generate_responses
from eagle3.stages.s01_prepare import run as prepare_run
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.stages.s01_prepare.run import is_eval, prepare_dataset
from eagle3.target.loss_mask import assistant_suffix

ROOT = Path(__file__).resolve().parents[2]

# The tiny Llama's template (eagle3/demo/tiny.py) with a thinking history rule: an earlier
# assistant turn is `<think></think>` + its answer and the generation prompt opens `<think>`.
# `final_keeps`: the conversation's final message, when an assistant turn, keeps its reasoning
# (the template the issue tried; Qwen3's keeps it after the last user turn); `kimi`: every
# rendered assistant turn drops it, as Kimi-K2.5's does for turns without tool calls. The
# reasoning comes from `reasoning_content` or, in a decoded answer, the text before `</think>`.
def thinking_llama(rule: str) -> str:
    keep = {"final_keeps": "loop.last", "kimi": "false"}[rule]
    return (
        "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{% if message['role'] == 'assistant' %}{% set c = message['content'] %}"
        "{% set r = message.get('reasoning_content') or '' %}"
        "{% if '</think>' in c %}{% set r = c.split('</think>')[0] %}{% set c = c.split('</think>')[-1] %}{% endif %}"
        "{% if " + keep + " %}<think>{{ r }}</think>{% else %}<think></think>{% endif %}{{ c | trim }}"
        "{% else %}{{ message['content'] | trim }}{% endif %}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n<think>{% endif %}")


N_CHATS = 40


class Scripted:
    """A target whose answer is a function of its prompt; records every call's prompts."""

    def __init__(self, answer, max_model_len: int = 4096):
        self.answer, self.max_model_len, self.calls = answer, max_model_len, []

    def set_sampling(self, temperature, top_p, stop_ids):
        pass

    def generate(self, requests):
        self.calls.append([list(r.prompt_ids) for r in requests])
        return [self.answer(list(r.prompt_ids)) for r in requests]


def make_target(path: Path, template: str | None = None, thinking_tokens: bool = False):
    """The tiny Llama's tokenizer (optionally with another template and <think> tokens) and a
    config, in a folder stages 00 and 01 load as the target (no weights: the engine is scripted)."""
    from transformers import LlamaConfig

    from eagle3.demo.tiny import build_tokenizer, padded_vocab

    tok = build_tokenizer()
    if thinking_tokens:
        tok.add_tokens(["<think>", "</think>"], special_tokens=True)
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(path)
    LlamaConfig(vocab_size=padded_vocab(len(tok)), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=1, num_key_value_heads=1, head_dim=64).save_pretrained(path)
    return tok


def two_turn_chats(path: Path, n: int = N_CHATS) -> Path:
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Hello there, I am visitor {i}."}, {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "No."}]}) + "\n"
        for i in range(n)))
    return path


def rows_of(workdir: Path) -> dict[str, dict]:
    rows = {}
    for split in ("train", "eval"):
        for r in load_split(WorkDir(workdir).dataset(split)):
            rows[r["sample_id"]] = {**r, "split": split}
    return rows


def masked_runs(mask) -> list[tuple[int, int]]:
    edges = np.diff(np.concatenate([[0], np.asarray(mask, dtype=np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


@pytest.mark.parametrize("rule", ["final_keeps", "kimi"])
def test_later_turns_are_generated_and_trained_after_the_served_history(rule, tmp_path, caplog):
    target = tmp_path / "thinking-llama"
    tok = make_target(target, thinking_llama(rule), thinking_tokens=True)
    eot, close = tok.convert_tokens_to_ids(["<|eot_id|>", "</think>"])
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731

    def answer(p):  # reasons, then answers; both name the prompt's length
        return Generation(enc(f"Thinking about {len(p)} tokens.") + [close] + enc(f"Answer {len(p)}.") + [eot], "stop")

    eng = Scripted(answer)
    workdir = tmp_path / "wd"
    caplog.set_level(logging.INFO)
    m0 = generate_responses(GenerateConfig(work_dir=workdir, target_model=str(target),
                                           data=[str(two_turn_chats(tmp_path / "chats.jsonl"))]), engine=eng)
    g = record_of(m0)
    assert g.conversations == N_CHATS and g.turns_regenerated == 2 * N_CHATS  # every second turn generated
    assert [len(c) for c in eng.calls] == [N_CHATS, N_CHATS]
    # Turn 2's prompt is the served rendering: turn 1 as `<think></think>` + its answer, no reasoning.
    lines = [json.loads(x) for x in WorkDir(workdir).generate_chunk(0).read_text().splitlines()]
    second_prompts = {tuple(p) for p in eng.calls[1]}
    served_prompt = {}
    for ln in lines:
        first = ln["messages"][1]["content"]
        reasoning, _, ans = first.partition("</think>")
        served = ln["messages"][:1] + [{"role": "assistant", "content": ans, "reasoning_content": reasoning},
                                       ln["messages"][2]]
        want = tok.encode(tok.apply_chat_template(served, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
        assert tuple(want) in second_prompts
        assert "Thinking about" not in tok.decode(want) and f"<think></think>{ans}<|eot_id|>" in tok.decode(want)
        served_prompt[ln["sample_id"]] = want
    assert m0.counts["stopped_early"] == {} and m0.counts["turns_not_generated"] == {}
    first_prompt_len = {len(p) for p in eng.calls[0]}
    for ln in lines:
        (s0, s1) = ln["samples"]
        assert s0["first_turn"] == 0 and s0["prompt_tokens"] in first_prompt_len
        assert s1 == {"first_turn": 1, "prompt_tokens": len(served_prompt[ln["sample_id"]])}
    assert m0.counts["samples"] == 2 * N_CHATS and m0.counts["turns_in_own_sample"] == N_CHATS
    assert m0.counts["served_history_tokens"] == sum(len(p) for p in eng.calls[1])
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("stage 00: 1/1 chunks"))
    assert f"{2 * N_CHATS} of {2 * N_CHATS} assistant turns generated" in summary
    assert f"{N_CHATS} later turns start a sample of their own" in summary

    m1 = prepare_dataset(PrepareConfig(work_dir=workdir, target_model=str(target), data=["generated"], max_length=512,
                                       eval_fraction=0.25, num_workers=1))
    rows = rows_of(workdir)
    assert len(rows) == 2 * N_CHATS and m1.counts["samples_in_served_context"] == N_CHATS
    assert m1.counts["served_history_tokens"] == m0.counts["served_history_tokens"]
    gens = {ln["sample_id"]: ln["generated"] for ln in lines}
    for sid, generated in gens.items():
        first, second = rows[sid], rows[f"{sid}#turn2"]
        # each conversation's samples stay on one side of the held-out split
        assert first["split"] == second["split"] == ("eval" if is_eval(sid, 0, 0.25) else "train")
        for row, g_turn, prompts in ((first, generated[0], eng.calls[0]), (second, generated[1], eng.calls[1])):
            ((a, b),) = masked_runs(row["loss_mask"])
            assert row["input_ids"][:a] in prompts  # exactly the context the target answered in
            assert row["input_ids"][a:b] == g_turn["ids"] and b == len(row["input_ids"])
    # Stage 01's summary names the samples and the history it adds.
    assert any(f"{N_CHATS} later turns in a sample of their own" in r.getMessage() for r in caplog.records)
    # Stage 01 checks each line's samples: a line an older stage 00 wrote (no `samples`) whose
    # second turn it generated after the spliced history is refused, and so is a mismatch.
    prepare_run._init_worker(str(target), False, 512, {})
    old = {k: v for k, v in lines[0].items() if k != "samples"}
    with pytest.raises(PipelineError, match="older stage 00"):
        prepare_run._generated_samples(old, "chunk-00000.jsonl:1")
    off = dict(lines[0], samples=[dict(x, prompt_tokens=x["prompt_tokens"] + 1) for x in lines[0]["samples"]])
    with pytest.raises(PipelineError, match="recorded the samples"):
        prepare_run._generated_samples(off, "chunk-00000.jsonl:1")


def test_a_template_that_keeps_history_gives_one_sample_per_conversation_bitwise_as_the_plain_rendering(tmp_path):
    """The tiny Llama's own template keeps history as generated: every conversation is one
    sample, equal token for token to the plain rendering of its answers (what stage 01 built
    before per-turn samples existed), and the chunk lines say so."""
    from eagle3.target.loss_mask import build_samples  # the reference (imported here: new with this test)

    target = tmp_path / "llama"
    tok = make_target(target)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    eng = Scripted(lambda p: Generation(tok.encode(f"Answer {len(p)}.", add_special_tokens=False) + [eot], "stop"))
    chats = tmp_path / "demo.jsonl"
    chats.write_text("\n".join((ROOT / "data" / "demo_chats.jsonl").read_text().splitlines()[:12]
                                + [json.dumps({"prompt": "A single question?"})]) + "\n")
    workdir = tmp_path / "wd"
    m0 = generate_responses(GenerateConfig(work_dir=workdir, target_model=str(target), data=[str(chats)]), engine=eng)
    assert m0.counts["turns_in_own_sample"] == 0 and m0.counts["samples"] == record_of(m0).conversations
    prepare_dataset(PrepareConfig(work_dir=workdir, target_model=str(target), data=["generated"], max_length=2048,
                                  eval_fraction=0.0, num_workers=1))
    rows = rows_of(workdir)
    suffix = assistant_suffix(tok)
    lines = [json.loads(x) for x in WorkDir(workdir).generate_chunk(0).read_text().splitlines()]
    assert len(rows) == len(lines) and any(len(ln["generated"]) > 1 for ln in lines)
    assert len(lines[-1]["generated"]) == 1  # the single prompt
    for ln in lines:
        (plain,), fuzzy = build_samples(tok, ln["messages"], suffix)
        assert fuzzy == 0 and plain.first_turn == 0
        assert rows[ln["sample_id"]]["input_ids"] == plain.ids
        assert rows[ln["sample_id"]]["loss_mask"] == plain.mask
        assert [s["first_turn"] for s in ln["samples"]] == [0]
    # a line an older stage 00 wrote (no `samples`) is read as before: its history was served as generated
    prepare_run._init_worker(str(target), False, 2048, {})
    multi = next(ln for ln in lines if len(ln["generated"]) > 1)
    _, (only,), _, _ = prepare_run._generated_samples({k: v for k, v in multi.items() if k != "samples"}, "x:1")
    assert only.ids == rows[multi["sample_id"]]["input_ids"]


def test_turns_a_conversation_never_reached_are_a_warning_with_their_share_and_reason(tmp_path, caplog):
    target = tmp_path / "llama"
    tok = make_target(target)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    # 300 tokens of context: the second turn of the chats with a long first answer does not fit
    eng = Scripted(lambda p: Generation(tok.encode("word " * (60 if len(p) < 40 else 1), add_special_tokens=False)
                                        + [eot], "stop"), max_model_len=100)
    workdir = tmp_path / "wd"
    with caplog.at_level(logging.INFO):
        m0 = generate_responses(GenerateConfig(work_dir=workdir, target_model=str(target), max_model_len=100,
                                               data=[str(two_turn_chats(tmp_path / "chats.jsonl", 8))]), engine=eng)
    assert record_of(m0).turns_regenerated == 8 and m0.counts["turns_not_generated"] == {"prompt_too_long": 8}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("8 of 16 input assistant turns (50.0%) were not generated" in w and "prompt_too_long 8" in w
               and "--max-model-len" in w for w in warnings), warnings


@pytest.mark.parametrize("thinking", [True, False])
def test_stages_00_and_01_on_kimi_k25s_template_and_ids(thinking, tmp_path):
    """Kimi-K2.5's rules and special-token ids (eagle3/demo/kimi_k25_tokenizer.py): the
    switch reaches every prompt, `<|im_end|>` and `[EOS]` stop the target, and each turn is
    masked token by token after the history the server gives it: thinking, the second turn
    is a sample of its own after `<think></think>` + the first answer; instant, the history
    is served as generated and each conversation is one sample."""
    from fixtures import kimi_k25_tokenizer, save_kimi_k25_target

    target = save_kimi_k25_target(tmp_path / "kimi-k25")
    tok = kimi_k25_tokenizer()
    end, close = tok.convert_tokens_to_ids(["<|im_end|>", "</think>"])
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731

    def answer(p):
        think = enc(f"Thinking about {len(p)} tokens.") + [close] if thinking else []
        return Generation(think + enc(f"Answer {len(p)}.") + [end], "stop")

    eng = Scripted(answer)
    workdir = tmp_path / "wd"
    m0 = generate_responses(GenerateConfig(work_dir=workdir, target_model=str(target), chat_template_kwargs={
        "thinking": thinking}, data=[str(two_turn_chats(tmp_path / "chats.jsonl", 6))]), engine=eng)
    g = record_of(m0)
    assert g.turns_regenerated == 12 and g.stop_token_ids == [163585, 163586]
    opener = enc("<|im_assistant|>assistant<|im_middle|>" + ("<think>" if thinking else "<think></think>"))
    assert all(p[-len(opener):] == opener for call in eng.calls for p in call)  # the switch reached the prompt
    m1 = prepare_dataset(PrepareConfig(work_dir=workdir, target_model=str(target), data=["generated"], eval_fraction=0.0,
                                       num_workers=1))
    assert record_of(m1).chat_template_kwargs == {"thinking": thinking}
    assert m1.counts["samples_in_served_context"] == (6 if thinking else 0)
    rows = rows_of(workdir)
    lines = [json.loads(x) for x in WorkDir(workdir).generate_chunk(0).read_text().splitlines()]
    assert len(rows) == (12 if thinking else 6)
    for ln in lines:
        sid, (g0, g1) = ln["sample_id"], ln["generated"]
        first_answer = ln["messages"][1]["content"].split("</think>")[-1]
        if thinking:
            pieces = [(rows[sid], [g0]), (rows[f"{sid}#turn2"], [g1])]
            history = f"<|im_assistant|>assistant<|im_middle|><think></think>{first_answer}<|im_end|>"
            assert history in tok.decode(rows[f"{sid}#turn2"]["input_ids"])
            assert "Thinking" not in tok.decode(rows[f"{sid}#turn2"]["input_ids"][:ln["samples"][1]["prompt_tokens"]])
        else:
            pieces = [(rows[sid], [g0, g1])]
        for row, gens in pieces:
            runs = masked_runs(row["loss_mask"])
            assert [row["input_ids"][a:b] for a, b in runs] == [x["ids"] for x in gens]  # token by token
            for (a, _), x in zip(runs, gens):
                assert row["input_ids"][:a][-len(opener):] == opener
        # every prompt the target answered is the context its turn is trained in
        assert all(row["input_ids"][:masked_runs(row["loss_mask"])[0][0]] in eng.calls[0] + eng.calls[1]
                   for row, _ in pieces)
