"""Assistant-only loss masks from any chat template, with no offsets mapping.

Method (template-agnostic, no per-model regexes): render the conversation with the
tokenizer's own template, then for each assistant turn i tokenize
  prompt_i = render(messages[:i], add_generation_prompt=True)
  upto_i   = render(messages[:i+1])
The assistant's tokens are `upto_i[len(prompt_i):]`. Templates append a suffix after
each assistant message (`<|eot_id|>`, `<|im_end|>\n`, ...); a one-time probe with
two different contents finds it, and the mask keeps its first token (the
end-of-turn the drafter must learn to predict) and drops the rest (e.g. the
newline after `<|im_end|>`). Each rendering must be a token prefix of the next;
templates that rewrite earlier turns (e.g. strip reasoning) break that and the
record is reported, never silently mis-masked.

Works for tokenizers without `return_offsets_mapping` (Kimi's tiktoken one).

Regenerated conversations (stage 00, eagle3/stages/s00_generate/) take another path,
`spliced_sample`: the assistant spans are the token ids the target generated, taken
as they are, and only the template's text around them is rendered and tokenized.
Re-tokenizing a decoded answer can give other ids than the ones generated (BPE
merges across the boundary with the template's header, a different split of the
same text); the drafter must learn the target's own ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eagle3.core.chats import BadRecord

_PROBE_CONTENTS = ("Alpha bravo charlie", "7")


def render_text(tok, messages: list[dict], add_generation_prompt: bool = False,
                template_kwargs: dict | None = None) -> str:
    """The chat template's text; `template_kwargs` are the template's switches (e.g. thinking)."""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   **(template_kwargs or {}))


def render(tok, messages: list[dict], add_generation_prompt: bool = False,
           template_kwargs: dict | None = None) -> list[int]:
    text = render_text(tok, messages, add_generation_prompt, template_kwargs)
    # The rendered text already holds the template's BOS; don't add another.
    return tok.encode(text, add_special_tokens=False)


def assistant_suffix(tok, template_kwargs: dict | None = None) -> list[int]:
    """Tokens the template appends after every assistant message's content."""
    seqs = [render(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": c}],
                   template_kwargs=template_kwargs)
            for c in _PROBE_CONTENTS]
    a, b = seqs
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n:] if n else []


def _is_prefix(short: list[int], long: list[int]) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short


def build_sample(tok, messages: list[dict], suffix: list[int],
                 template_kwargs: dict | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """Token ids, loss mask (1 = assistant content or its end-of-turn token), and the
    number of assistant turns whose end did not match the probed suffix (masked to
    the end of their rendering instead)."""
    kw = template_kwargs
    ids = render(tok, messages, template_kwargs=kw)
    mask = np.zeros(len(ids), dtype=np.int8)
    fuzzy_ends = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(tok, messages[:i], add_generation_prompt=True, template_kwargs=kw)
        upto = render(tok, messages[: i + 1], template_kwargs=kw)
        if not (_is_prefix(prompt, upto) and _is_prefix(upto, ids)):
            raise BadRecord(
                "template_not_prefix_stable",
                f"rendering up to turn {i + 1} is not a token prefix of the next; the chat "
                f"template rewrites earlier turns, so an assistant span cannot be located")
        end = len(upto)
        if suffix and upto[-len(suffix):] == suffix:
            end -= len(suffix) - 1  # keep the end-of-turn token, drop what follows it
        elif suffix:
            fuzzy_ends += 1
        mask[len(prompt):end] = 1
    return np.asarray(ids, dtype=np.int32), mask, fuzzy_ends


# -- regenerated answers: the target's own ids, spliced into the rendered template ------------


@dataclass
class Answer:
    """One assistant turn as the target generated it."""

    ids: list[int]  # generated token ids, with the stop token when generation stopped on one
    finished: bool  # False: cut by max_new_tokens (or the context length)


class Splicer:
    """Builds a regenerated conversation's ids turn by turn (see `spliced_sample`).

    Stage 00 keeps one per conversation: `head` gives turn j's prompt, `answer` appends
    the target's answer; each turn renders the template twice, however long the
    conversation already is.
    """

    def __init__(self, tok, suffix: list[int], template_kwargs: dict | None = None):
        self.tok, self.suffix, self.kw = tok, suffix, template_kwargs
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.prev = ""  # the rendered text `ids` stand for
        self.turns = 0

    def head(self, messages: list[dict], i: int) -> list[int]:
        """Append the template's text up to assistant message `i`'s content; return the ids so far
        (turn `self.turns`'s prompt). `messages[:i]` hold the earlier answers' decoded text."""
        head = render_text(self.tok, messages[:i], add_generation_prompt=True, template_kwargs=self.kw)
        if not head.startswith(self.prev):
            raise BadRecord(
                "template_not_prefix_stable",
                f"the rendering up to assistant turn {self.turns + 1} does not extend the rendering of the turn "
                f"before; the chat template rewrites earlier turns, so the generated ids cannot be placed")
        piece = self.tok.encode(head[len(self.prev):], add_special_tokens=False)
        self.ids += piece
        self.mask += [0] * len(piece)
        self.prev = head
        return self.ids

    def answer(self, messages: list[dict], i: int, ans: Answer) -> None:
        """Append assistant message `i`'s generated ids (masked) and the template's suffix after it."""
        self.ids += list(ans.ids)
        self.mask += [1] * len(ans.ids)
        if self.suffix:
            ends_turn = ans.finished and list(ans.ids[-1:]) == self.suffix[:1]
            tail = self.suffix[1:] if ends_turn else self.suffix
            self.ids += tail
            self.mask += [0] * len(tail)
        self.prev = render_text(self.tok, messages[: i + 1], template_kwargs=self.kw)
        self.turns += 1


def spliced_sample(tok, messages: list[dict], answers: list[Answer], suffix: list[int],
                   template_kwargs: dict | None = None, upto: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask of a conversation whose assistant turns are `answers`.

    `messages` hold each assistant turn's decoded text; it is only used to render the
    template around the turns. Assistant turn j (0-based) contributes exactly
    `answers[j].ids`, all masked. After a finished answer that ends with the template's
    end-of-turn token (`suffix[0]`), the rest of the suffix follows unmasked (as in
    `build_sample`); after a cut answer the whole suffix follows, unmasked, since the
    target did not end the turn there. Between turns, the text the template puts after
    turn j's end and before turn j+1's content (user turn, headers) is tokenized on its
    own: special tokens bound both sides, so this is how the full rendering tokenizes it.

    With `upto=j`, returns the prompt of assistant turn j: everything before its content,
    which is exactly what stage 00 fed the target for that turn.
    """
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if upto is None and len(answers) != len(turns):
        raise BadRecord("answers_mismatch", f"{len(turns)} assistant turns but {len(answers)} generated answers")
    sp = Splicer(tok, suffix, template_kwargs)
    for j, i in enumerate(turns):
        sp.head(messages, i)
        if j == upto:
            break
        sp.answer(messages, i, answers[j])
    return np.asarray(sp.ids, dtype=np.int32), np.asarray(sp.mask, dtype=np.int8)


def reencode_differs(tok, messages: list[dict], answers: list[Answer], suffix: list[int],
                     template_kwargs: dict | None = None) -> list[bool]:
    """Per assistant turn: would rendering the decoded text (the stage-01 path for plain
    chats) have given other ids than the generated ones? Compares each turn's masked span
    of `build_sample` with the generated ids (cut answers: the content part only)."""
    ref_ids, ref_mask, _ = build_sample(tok, messages, suffix, template_kwargs)
    spans = _runs(ref_mask)
    out = []
    for j, ans in enumerate(answers):
        if j >= len(spans):
            out.append(True)
            continue
        a, b = spans[j]
        got = ref_ids[a:b].tolist()
        want = list(ans.ids)
        if not ans.finished and suffix and got[-1:] == suffix[:1]:
            got = got[:-1]  # the template closed a cut turn; the target did not
        out.append(got != want)
    return out


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    m = np.concatenate([[0], mask.astype(np.int8), [0]])
    d = np.diff(m)
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))
