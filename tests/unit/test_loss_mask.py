"""The assistant-only loss mask, token by token, on four families' chat templates, and each
turn's context on the reasoning templates that rewrite history (Kimi-K2.5's, Qwen3's,
DeepSeek-R1's): a turn after a rewritten history is a sample of its own, in the served
rendering."""
import logging

import numpy as np
import pytest
from fixtures import DEEPSEEK_R1, QWEN3_THINKING, TEMPLATES, kimi_k25_tokenizer, make_tokenizer

from eagle3.target.chats import BadRecord
from eagle3.target.loss_mask import assistant_suffix, build_samples


def build_sample(tok, messages, suffix, template_kwargs=None):
    """The one sample of a conversation whose template keeps history as rendered."""
    (sample,), fuzzy = build_samples(tok, messages, suffix, template_kwargs)
    ids, mask = sample.arrays()
    return ids, mask, fuzzy

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
TURNS = [
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "Tell me a joke about cats."},
    {"role": "assistant", "content": "Why did the cat sit on the computer? To keep an eye on the mouse."},
]


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of ones."""
    edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("system", [False, True])
@pytest.mark.parametrize("n_turns", [2, 4])
def test_mask_covers_exactly_assistant_content_and_end_of_turn(name, system, n_turns):
    spec = TEMPLATES[name]
    tok = make_tokenizer(spec)
    messages = ([SYSTEM] if system else []) + TURNS[:n_turns]
    ids, mask, fuzzy = build_sample(tok, messages, assistant_suffix(tok))
    assert fuzzy == 0
    assert ids.tolist() == tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    got = spans(mask)
    assert len(got) == len(answers)
    eot_id = tok.convert_tokens_to_ids(spec["eot"])
    for (start, end), answer in zip(got, answers):
        # in: the content and its end-of-turn token, nothing more
        assert tok.decode(ids[start:end].tolist()) == answer + spec["eot"]
        assert ids[end - 1] == eot_id
        # out: the token before is the template's assistant header, not content
        assert tok.decode(ids[start - 1:start].tolist()) not in answer
        if spec["after_eot"] and end < len(ids):
            assert tok.decode(ids[end:end + 1].tolist()) == spec["after_eot"]
    # everything outside the spans decodes to template, system and user text only
    outside = tok.decode(ids[mask == 0].tolist())
    for answer in answers:
        assert answer not in outside
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in outside


def test_chatml_newline_after_end_of_turn_is_outside_the_mask():
    tok = make_tokenizer(TEMPLATES["chatml"])
    suffix = assistant_suffix(tok)
    assert tok.convert_ids_to_tokens(suffix)[0] == "<|im_end|>" and len(suffix) == 2
    ids, mask, _ = build_sample(tok, TURNS[:2], suffix)
    assert ids[-1] == suffix[-1] and mask[-1] == 0 and mask[-2] == 1


class NoOffsetsChattyTokenizer:
    """Stands in for Kimi's tiktoken tokenizer: no offsets mapping, logs on every encode."""

    def __init__(self, inner):
        self.inner = inner
        self.log = logging.getLogger("transformers_modules.kimi.tokenization_kimi")
        self.calls = 0

    def apply_chat_template(self, *a, **kw):
        return self.inner.apply_chat_template(*a, **kw)

    def encode(self, text, add_special_tokens=True, **kw):
        if kw.get("return_offsets_mapping"):
            raise NotImplementedError("no offsets mapping")
        self.calls += 1
        self.log.info("encoding %d chars", len(text))
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def __call__(self, *a, **kw):
        raise NotImplementedError("offsets are not available")


def test_works_without_offsets_mapping_and_quiets_tokenizer_logging(caplog):
    from eagle3.core.logs import quiet_tokenizers

    inner = make_tokenizer(TEMPLATES["kimi_k2"])
    tok = NoOffsetsChattyTokenizer(inner)
    quiet_tokenizers()
    with caplog.at_level(logging.INFO):
        ids, mask, _ = build_sample(tok, TURNS, assistant_suffix(tok))
    ref_ids, ref_mask, _ = build_sample(inner, TURNS, assistant_suffix(inner))
    assert tok.calls > 0
    assert ids.tolist() == ref_ids.tolist() and mask.tolist() == ref_mask.tolist()
    assert not [r for r in caplog.records if r.name.startswith("transformers_modules")]


def test_a_template_that_rewrites_earlier_turns_gives_the_later_turn_a_sample_of_its_own():
    spec = dict(TEMPLATES["chatml"])
    # Like reasoning templates that drop earlier turns' thoughts: an assistant turn renders
    # differently once it is no longer the last message.
    spec["template"] = spec["template"].replace(
        "message['content'] + '<|im_end|>\n'",
        "(message['content'] if loop.last or message['role'] != 'assistant' else message['content'][:3])"
        " + '<|im_end|>\n'")
    assert spec["template"] != TEMPLATES["chatml"]["template"]
    tok = make_tokenizer(spec)
    samples, fuzzy = build_samples(tok, TURNS, assistant_suffix(tok))
    assert fuzzy == 0 and [s.first_turn for s in samples] == [0, 1]
    first, second = (s.arrays() for s in samples)
    # each turn in the rendering the template gives it: turn 2 after the shortened turn 1
    assert first[0].tolist() == tok.encode(tok.apply_chat_template(TURNS[:2], tokenize=False), add_special_tokens=False)
    assert second[0].tolist() == tok.encode(tok.apply_chat_template(TURNS, tokenize=False), add_special_tokens=False)
    assert tok.decode(first[0][first[1] == 1].tolist()) == TURNS[1]["content"] + "<|im_end|>"
    assert tok.decode(second[0][second[1] == 1].tolist()) == TURNS[3]["content"] + "<|im_end|>"
    assert "It <|im_end|>" in tok.decode(second[0].tolist())
    assert samples[1].prompt_tokens == int(np.flatnonzero(second[1])[0])


def test_a_turn_rendered_unlike_its_own_prompt_is_reported_not_mis_masked():
    spec = dict(TEMPLATES["chatml"])
    spec["template"] = spec["template"].replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\nSure: '")
    tok = make_tokenizer(spec)
    with pytest.raises(BadRecord) as e:
        build_samples(tok, TURNS, assistant_suffix(tok))
    assert e.value.reason == "template_not_prefix_stable"


def test_a_turn_whose_end_differs_from_the_probed_suffix_is_counted_and_masked_to_its_end():
    """A template that closes the conversation's last answer with an extra EOS (unlike the
    probe's two-message render): that turn's end is fuzzy, counted once, and masked to the
    end of its rendering; the earlier turn keeps the probed end."""
    spec = dict(TEMPLATES["chatml"])
    spec["template"] = spec["template"].replace(
        "message['content'] + '<|im_end|>\n'",
        "message['content'] + '<|im_end|>' + ('<|endoftext|>' if loop.last and loop.length > 2 "
        "and message['role'] == 'assistant' else '\n')")
    assert spec["template"] != TEMPLATES["chatml"]["template"]
    tok = make_tokenizer(spec)
    suffix = assistant_suffix(tok)
    assert tok.decode(suffix) == "<|im_end|>\n" and len(suffix) == 2
    ids, mask, fuzzy = build_sample(tok, TURNS, suffix)
    assert fuzzy == 1
    (a0, b0), (a1, b1) = spans(mask)
    assert tok.decode(ids[a0:b0].tolist()) == TURNS[1]["content"] + "<|im_end|>"
    assert tok.decode(ids[a1:b1].tolist()) == TURNS[3]["content"] + "<|im_end|><|endoftext|>" and b1 == len(ids)
    _, _, fuzzy = build_sample(tok, TURNS[:2], suffix)  # the probe's own shape: no fuzzy end
    assert fuzzy == 0


# -- regenerated answers (stage 00): the generated ids spliced into the template ------------------

from eagle3.target.loss_mask import (Answer, reencode_differs, served_answer, spliced_samples,  # noqa: E402
                                   turn_prompt)


def _answers_as_reencoded(tok, messages, suffix):
    return [Answer(tok.encode(m["content"], add_special_tokens=False) + suffix[:1], True)
            for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_spliced_equals_plain_rendering_when_ids_are_the_reencoded_text(name):
    tok = make_tokenizer(TEMPLATES[name])
    suffix = assistant_suffix(tok)
    messages = [SYSTEM] + TURNS
    ids, mask, _ = build_sample(tok, messages, suffix)
    answers = _answers_as_reencoded(tok, messages, suffix)
    (sample,) = spliced_samples(tok, messages, answers, suffix)
    s_ids, s_mask = sample.arrays()
    assert s_ids.tolist() == ids.tolist()
    assert s_mask.tolist() == mask.tolist()
    assert reencode_differs(tok, messages, answers, suffix) == [False, False]
    # the prompt of turn 1 is exactly the sequence up to that turn's first masked token
    second = spans(mask)[1][0]
    assert turn_prompt(tok, messages, answers, suffix, turn=1) == ids[:second].tolist()
    assert sample.first_turn == 0 and sample.prompt_tokens == spans(mask)[0][0]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_spliced_keeps_generated_ids_that_reencoding_would_change(name):
    tok = make_tokenizer(TEMPLATES[name])
    suffix = assistant_suffix(tok)
    messages = [dict(m) for m in TURNS]
    # The target spelled "It is 4." one character per token: the same text, other ids.
    odd = [i for ch in "It is 4." for i in tok.encode(ch, add_special_tokens=False)] + suffix[:1]
    assert odd[:-1] != tok.encode("It is 4.", add_special_tokens=False)
    answers = [Answer(odd, True), _answers_as_reencoded(tok, messages, suffix)[1]]
    (sample,) = spliced_samples(tok, messages, answers, suffix)
    ids, mask = sample.arrays()
    (a0, b0), (a1, b1) = spans(mask)
    assert ids[a0:b0].tolist() == odd  # the generated ids, untouched, end-of-turn included
    assert ids[a1:b1].tolist() == answers[1].ids
    assert reencode_differs(tok, messages, answers, suffix) == [True, False]
    # everything outside the two answers is the template's own rendering
    ref, ref_mask, _ = build_sample(tok, messages, suffix)
    (r0, e0), _ = spans(ref_mask)
    assert ids[:a0].tolist() == ref[:r0].tolist()
    assert ids[b0:].tolist() == ref[e0:].tolist()


def test_cut_answer_is_masked_and_closed_by_the_template_outside_the_mask():
    tok = make_tokenizer(TEMPLATES["chatml"])
    suffix = assistant_suffix(tok)  # <|im_end|> \n
    messages = [dict(m) for m in TURNS[:2]]
    cut = tok.encode("It is", add_special_tokens=False)  # stopped by max_new_tokens: no end-of-turn
    messages[1]["content"] = "It is"
    (sample,) = spliced_samples(tok, messages, [Answer(cut, False)], suffix)
    ids, mask = sample.arrays()
    (a, b), = spans(mask)
    assert ids[a:b].tolist() == cut
    assert ids[b:].tolist() == suffix and not mask[b:].any()


def test_served_answer_splits_the_reasoning_as_a_reasoning_parser_does():
    assert served_answer("Two plus two.</think>It is 4.") == {
        "role": "assistant", "content": "It is 4.", "reasoning_content": "Two plus two."}
    assert served_answer("<think>\nplan\n</think>\n\nHi") == {
        "role": "assistant", "content": "\n\nHi", "reasoning_content": "\nplan\n"}
    assert served_answer("No reasoning here.") == {"role": "assistant", "content": "No reasoning here."}


def _thinking_turns(tok, reasonings, answers, end, close):
    """Two turns as a thinking target generates them: reasoning, the close marker, the answer,
    end of turn. Returns the messages (decoded text, markup kept, as stage 00 stores it)
    and the Answers."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    gens = [enc(r) + [close] + enc(a) + [end] for r, a in zip(reasonings, answers)]
    messages = [dict(m) for m in TURNS]
    for k, g in enumerate(gens):
        messages[2 * k + 1]["content"] = tok.decode(g[:-1], skip_special_tokens=False)
    return messages, [Answer(g, True) for g in gens]


@pytest.mark.parametrize("thinking", [True, False])
def test_kimi_k25_turns_after_dropped_reasoning_are_samples_of_their_own(thinking):
    """Kimi-K2.5's rules (eagle3/demo/kimi_k25_tokenizer.py): an earlier turn is served as
    `<think></think>` + its answer. Thinking, turn 2 is trained after that history, token
    by token, in a sample of its own; instant (`thinking=false`), the history is served as
    generated and the conversation stays one sample."""
    tok = kimi_k25_tokenizer()
    kw = {"thinking": thinking}
    suffix = assistant_suffix(tok, kw)
    end, close = tok.convert_tokens_to_ids(["<|im_end|>", "</think>"])
    assert suffix == [end] == [163586] and close == 163607
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    if thinking:
        messages, answers = _thinking_turns(tok, ["Two plus two.", "A cat joke."],
                                            ["It is 4.", "Why did the cat sit?"], end, close)
    else:
        messages = [dict(m) for m in TURNS]
        answers = [Answer(enc(m["content"]) + [end], True) for m in messages if m["role"] == "assistant"]
    samples = spliced_samples(tok, messages, answers, suffix, kw)
    assert [s.first_turn for s in samples] == ([0, 1] if thinking else [0])
    opener = enc("<|im_assistant|>assistant<|im_middle|>") + enc("<think>" if thinking else "<think></think>")
    user = lambda m: enc(f"<|im_user|>user<|im_middle|>{m['content']}<|im_end|>")  # noqa: E731
    first = samples[0].arrays()
    p0 = len(user(messages[0])) + len(opener)
    if not thinking:  # one sample: the whole conversation, each answer after the one before, as generated
        want = user(messages[0]) + opener + answers[0].ids + user(messages[2]) + opener + answers[1].ids
        assert first[0].tolist() == want
        assert spans(first[1]) == [(p0, p0 + len(answers[0].ids)), (len(want) - len(answers[1].ids), len(want))]
        return
    # turn 1: its prompt, then exactly the generated ids (reasoning and </think> included), masked
    assert first[0].tolist() == user(messages[0]) + opener + answers[0].ids
    assert spans(first[1]) == [(p0, len(first[0]))]
    # turn 2: the served history (turn 1 without its reasoning), then its generated ids
    second = samples[1].arrays()
    history = user(messages[0]) + enc("<|im_assistant|>assistant<|im_middle|><think></think>It is 4.<|im_end|>")
    prompt = history + user(messages[2]) + opener
    assert second[0].tolist() == prompt + answers[1].ids
    assert spans(second[1]) == [(len(prompt), len(second[0]))] and samples[1].prompt_tokens == len(prompt)
    assert turn_prompt(tok, messages, answers, suffix, kw, turn=1) == prompt
    assert (second[0][second[1] == 1] == close).sum() == 1  # turn 2's own </think> is learned
    assert "Two plus two." not in tok.decode(second[0].tolist())


@pytest.mark.parametrize("spec, kw", [(QWEN3_THINKING, {}), (DEEPSEEK_R1, {})], ids=["qwen3", "deepseek_r1"])
def test_qwen3_and_deepseek_r1_history_rewrites_give_served_samples(spec, kw):
    """Qwen3 keeps reasoning only after the last user turn (its rendering of turn 1 changes once
    turn 2 follows); DeepSeek-R1 never renders reasoning (turn 1 renders unlike it was
    generated). Both: turn 2 in a sample of its own, after the history without reasoning."""
    tok = make_tokenizer(spec)
    suffix = assistant_suffix(tok, kw)
    end, close = tok.convert_tokens_to_ids([spec["eot"], "</think>"])
    lead = "<think>\n" if spec is QWEN3_THINKING else ""  # R1's generation prompt opens <think> itself
    messages, answers = _thinking_turns(tok, [lead + "Two plus two.\n", lead + "A cat joke.\n"],
                                        ["\n\nIt is 4.", "\n\nWhy did the cat sit?"], end, close)
    samples = spliced_samples(tok, messages, answers, suffix, kw)
    assert [s.first_turn for s in samples] == [0, 1]
    first, second = (s.arrays() for s in samples)
    head0 = tok.encode(tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
                       add_special_tokens=False)
    assert first[0].tolist()[:len(head0)] == head0 and first[0][first[1] == 1].tolist() == answers[0].ids
    served = [messages[0], served_answer(messages[1]["content"]), messages[2]]
    prompt = tok.encode(tok.apply_chat_template(served, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    assert second[0].tolist() == prompt + answers[1].ids + suffix[1:]
    assert spans(second[1])[0] == (len(prompt), len(prompt) + len(answers[1].ids))
    assert "Two plus two." not in tok.decode(prompt) and "It is 4." in tok.decode(prompt)
