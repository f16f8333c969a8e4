"""The assistant-only loss mask, token by token, on four families' chat templates."""
import logging

import numpy as np
import pytest
from fixtures import KIMI_THINKING, TEMPLATES, make_tokenizer

from eagle3.core.chats import BadRecord
from eagle3.core.loss_mask import assistant_suffix, build_sample

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


def test_template_that_rewrites_earlier_turns_is_reported_not_mis_masked():
    spec = dict(TEMPLATES["chatml"])
    # Like reasoning templates that drop earlier turns' thoughts: a turn renders
    # differently once it is no longer the last one.
    spec["template"] = spec["template"].replace(
        "message['content'] + '<|im_end|>\n'",
        "(message['content'] if loop.last else message['content'][:3]) + '<|im_end|>\n'")
    assert spec["template"] != TEMPLATES["chatml"]["template"]
    tok = make_tokenizer(spec)
    with pytest.raises(BadRecord) as e:
        build_sample(tok, TURNS, assistant_suffix(tok))
    assert e.value.reason == "template_not_prefix_stable"


# -- regenerated answers (stage 00): the generated ids spliced into the template ------------------

from eagle3.core.loss_mask import Answer, reencode_differs, spliced_sample  # noqa: E402


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
    s_ids, s_mask = spliced_sample(tok, messages, answers, suffix)
    assert s_ids.tolist() == ids.tolist()
    assert s_mask.tolist() == mask.tolist()
    assert reencode_differs(tok, messages, answers, suffix) == [False, False]
    # the prompt of turn 1 is exactly the sequence up to that turn's first masked token
    prompt, pmask = spliced_sample(tok, messages, answers, suffix, upto=1)
    second = spans(mask)[1][0]
    assert prompt.tolist() == ids[:second].tolist() and pmask.tolist() == mask[:second].tolist()


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_spliced_keeps_generated_ids_that_reencoding_would_change(name):
    tok = make_tokenizer(TEMPLATES[name])
    suffix = assistant_suffix(tok)
    messages = [dict(m) for m in TURNS]
    # The target spelled "It is 4." one character per token: the same text, other ids.
    odd = [i for ch in "It is 4." for i in tok.encode(ch, add_special_tokens=False)] + suffix[:1]
    assert odd[:-1] != tok.encode("It is 4.", add_special_tokens=False)
    answers = [Answer(odd, True), _answers_as_reencoded(tok, messages, suffix)[1]]
    ids, mask = spliced_sample(tok, messages, answers, suffix)
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
    ids, mask = spliced_sample(tok, messages, [Answer(cut, False)], suffix)
    (a, b), = spans(mask)
    assert ids[a:b].tolist() == cut
    assert ids[b:].tolist() == suffix and not mask[b:].any()


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_template_mask_covers_the_reasoning_answer_and_end_of_turn(thinking):
    tok = make_tokenizer(KIMI_THINKING)
    kw = {"thinking": thinking}
    suffix = assistant_suffix(tok, kw)
    end, close = tok.convert_tokens_to_ids(["<|im_end|>", "</think>"])
    assert suffix == [end]
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    gens = []
    for reasoning, answer in (("Two plus two.", "It is 4."), ("A cat joke.", "Why did the cat sit?")):
        gens.append((enc(reasoning) + [close] if thinking else []) + enc(answer) + [end])
    messages = [dict(m) for m in TURNS]
    for k, g in enumerate(gens):  # what stage 00 stores: the decoded text, markup kept
        messages[2 * k + 1]["content"] = tok.decode(g[:-1], skip_special_tokens=False)
    ids, mask = spliced_sample(tok, messages, [Answer(g, True) for g in gens], suffix, kw)
    # token by token: the mask is 1 exactly on the generated ids, reasoning included
    opener = enc("<|im_assistant|>assistant<|im_middle|>") + (enc("<think>") if thinking else enc("<think></think>"))
    expected, pos = np.zeros(len(ids), dtype=np.int8), 0
    for g in gens:
        start = next(i for i in range(pos, len(ids)) if ids[i - len(opener):i].tolist() == opener)
        assert ids[start:start + len(g)].tolist() == g
        expected[start:start + len(g)] = 1
        pos = start + len(g)
    assert mask.tolist() == expected.tolist()
    assert ids[-1] == end and mask[-1] == 1
    if thinking:
        assert (ids[mask == 1] == close).sum() == 2  # both turns' </think> are learned
        # plain rendering cannot place a turn whose prompt opened <think>: stage 01's text path
        # would reject these conversations, the spliced path keeps them
        with pytest.raises(BadRecord):
            build_sample(tok, messages, suffix, kw)
