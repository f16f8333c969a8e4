"""The assistant-only loss mask, token by token, on four families' chat templates."""
import logging

import numpy as np
import pytest

from chat_templates import TEMPLATES, make_tokenizer
from eagle3.chats import BadRecord
from eagle3.loss_mask import assistant_suffix, build_sample

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
    from eagle3.logs import quiet_tokenizers

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
