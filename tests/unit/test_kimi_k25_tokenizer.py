"""The Kimi-K2.5 stand-in (eagle3/demo/kimi_k25_tokenizer.py): the real tokenizer's special-token
ids, and its chat template's rules, each rendered as text and compared in full. Built once
(a few seconds)."""
from __future__ import annotations

import pytest
from fixtures import kimi_k25_tokenizer

from eagle3.demo.kimi_k25_tokenizer import EOS_ID, FIRST_SPECIAL_ID, SPECIAL_IDS, VOCAB_SIZE

U, A, S, M, E = "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return kimi_k25_tokenizer()


def render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def test_special_tokens_have_the_real_ids_and_encode_to_one_token(tok):
    real = {"[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
            "<|im_assistant|>": 163588, "<|im_system|>": 163594, "<|im_middle|>": 163601,
            "<|tool_calls_section_begin|>": 163595, "<|tool_call_end|>": 163599, "<think>": 163606,
            "</think>": 163607, "[UNK]": 163838, "[PAD]": 163839}
    assert {k: SPECIAL_IDS[k] for k in real} == real
    for text, i in real.items():
        assert tok.encode(text, add_special_tokens=False) == [i]
    assert len(tok) == VOCAB_SIZE == 163840 and tok.eos_token_id == EOS_ID == 163585
    assert tok.convert_ids_to_tokens(163589) == "<|reserved_token_163589|>"
    # ordinary text never reaches the special range
    ids = tok.encode("The capital of France is Paris. Grüße ☕", add_special_tokens=False)
    assert max(ids) < FIRST_SPECIAL_ID and tok.decode(ids) == "The capital of France is Paris. Grüße ☕"
    # </think> survives decoding without special tokens (the reasoning parser reads it in text)
    assert tok.decode([163606, 163607], skip_special_tokens=True) == "<think></think>"


def test_history_turns_drop_their_reasoning_and_no_system_prompt_is_added(tok):
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
            {"role": "user", "content": "2+2?"}]
    head = f"{U}user{M}Hi{E}{A}assistant{M}<think></think>Hello!{E}{U}user{M}2+2?{E}"
    assert render(tok, msgs, add_generation_prompt=True) == head + f"{A}assistant{M}<think>"
    assert render(tok, msgs, add_generation_prompt=True, thinking=False) == head + f"{A}assistant{M}<think></think>"
    # the last assistant turn without tool calls is history too: its reasoning is dropped
    assert render(tok, msgs[:2]) == f"{U}user{M}Hi{E}{A}assistant{M}<think></think>Hello!{E}"
    # a system turn and a named message render with their role / name
    assert render(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ann"}]) \
        == f"{S}system{M}Be brief.{E}{U}ann{M}Hi{E}"


def test_tool_call_chain_after_the_last_plain_answer_keeps_its_reasoning(tok):
    call = {"id": "functions.weather:0", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "r0"},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "reasoning_content": "need the tool",
             "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "functions.weather:0", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    calls = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    body = (f"{U}user{M}Hi{E}{A}assistant{M}<think></think>Hello!{E}{U}user{M}Weather in Paris?{E}"
            f"{A}assistant{M}<think>need the tool</think>Let me look.{calls}{E}"
            f"{S}tool{M}## Return of functions.weather:0\nsunny{E}")
    declare = f'{S}tool_declare{M}[{{"type":"function","function":{{"name":"weather","parameters":{{}}}}}}]{E}'
    assert render(tok, msgs, tools=tools, add_generation_prompt=True) == declare + body + f"{A}assistant{M}<think>"
    assert render(tok, msgs, tools=tools, tools_ts_str="namespace functions {}").startswith(
        f"{S}tool_declare{M}namespace functions {{}}{E}{U}")
    # instant mode drops the chain's reasoning too
    assert f"{A}assistant{M}<think></think>Let me look." in render(tok, msgs, thinking=False)
    # once a plain answer follows, the whole chain is history
    done = msgs + [{"role": "assistant", "content": "It is sunny.", "reasoning_content": "read it"}]
    out = render(tok, done)
    assert "need the tool" not in out and out.endswith(f"{A}assistant{M}<think></think>It is sunny.{E}")
