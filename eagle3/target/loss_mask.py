"""Assistant-only loss masks from any chat template, with no offsets mapping.

Method (template-agnostic, no per-model regexes): render the conversation with the
tokenizer's own template, then for each assistant turn i tokenize
  prompt_i = render(messages[:i], add_generation_prompt=True)
  upto_i   = render(messages[:i+1])
The assistant's tokens are `upto_i[len(prompt_i):]`. Templates append a suffix after
each assistant message (`<|eot_id|>`, `<|im_end|>\n`, ...); a one-time probe with
two different contents finds it, and the mask keeps its first token (the
end-of-turn the drafter must learn to predict) and drops the rest (e.g. the
newline after `<|im_end|>`).

Each turn is trained in the context the template (so the server) gives it. When
prompt_i extends upto_{i-1}, turn i continues the same sample. When it does not, the
template rewrote an earlier turn once later turns followed (reasoning templates drop
the reasoning of history turns: Kimi-K2.5 renders every earlier assistant turn as
`<think></think>` + its answer, Qwen3 keeps reasoning only after the last user turn,
DeepSeek-R1 keeps only the text after `</think>`), and turn i starts a sample of its
own: the served history, then the turn (docs/STAGES.md, stages 00 and 01). A template
that keeps history as rendered gives one sample per conversation, as it always did.

Works for tokenizers without `return_offsets_mapping` (Kimi's tiktoken one).

Regenerated conversations (stage 00, eagle3/stages/s00_generate/) take another path,
`spliced_samples`: the assistant spans are the token ids the target generated, taken
as they are, and only the template's text around them is rendered and tokenized.
Re-tokenizing a decoded answer can give other ids than the ones generated (BPE
merges across the boundary with the template's header, a different split of the
same text); the drafter must learn the target's own ids. The history before a turn
is what a server shows: each earlier answer as the server returns it (`served_answer`:
the text after the reasoning end marker as `content`, the reasoning as
`reasoning_content`), rendered by the template. A later turn continues its
conversation's sample only when the template renders the turns before it exactly as
they were generated; otherwise it starts a sample of its own whose context is the
tokenized served history, which is exactly the prompt stage 00 gave the target.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eagle3.target.chats import BadRecord

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


@dataclass
class Sample:
    """One training sample of a conversation: the context of its first turn, then that turn
    and every later turn the template renders after it as they are."""

    ids: list[int]
    mask: list[int]  # 1 on assistant tokens (and each turn's end-of-turn token)
    first_turn: int  # the conversation's assistant turn (0-based) whose context opens the sample
    prompt_tokens: int = 0  # the tokens before that turn's answer: the context it was answered in

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Token ids int32 [T] and loss mask int8 [T]."""
        return np.asarray(self.ids, dtype=np.int32), np.asarray(self.mask, dtype=np.int8)


def build_samples(tok, messages: list[dict], suffix: list[int],
                  template_kwargs: dict | None = None) -> tuple[list[Sample], int]:
    """A finished conversation's samples, and the number of assistant turns whose end did
    not match the probed suffix (masked to the end of their rendering instead).

    Turn i continues the current sample when its prompt extends the rendering up to turn
    i-1; when the template rewrote an earlier turn, turn i opens a sample of its own
    (module docstring). A template that never does gives one sample: the whole rendering.
    """
    kw = template_kwargs
    samples: list[Sample] = []
    fuzzy_ends = 0
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for j, i in enumerate(turns):
        prompt = render(tok, messages[:i], add_generation_prompt=True, template_kwargs=kw)
        upto = render(tok, messages[: i + 1], template_kwargs=kw)
        if not _is_prefix(prompt, upto):
            raise BadRecord(
                "template_not_prefix_stable",
                f"the rendering of assistant turn {j + 1} does not start with its own generation prompt; the chat "
                f"template renders a turn differently from the prompt it is answered after, so its span cannot "
                f"be located")
        if not samples or not _is_prefix(samples[-1].ids, prompt):
            samples.append(Sample([], [], j, len(prompt)))  # the served history, then this turn
        s = samples[-1]
        end = len(upto)
        if suffix and upto[-len(suffix):] == suffix:
            end -= len(suffix) - 1  # keep the end-of-turn token, drop what follows it
        elif suffix:
            fuzzy_ends += 1
        s.mask = s.mask + [0] * (len(prompt) - len(s.mask)) + [1] * (end - len(prompt)) + [0] * (len(upto) - end)
        s.ids = upto
    return samples, fuzzy_ends


# -- regenerated answers: the target's own ids, spliced into the rendered template ------------

# The reasoning markers of the thinking templates this project meets (Kimi-K2.5, Qwen3,
# DeepSeek-R1): what a server's reasoning parser splits an answer at.
REASONING_START, REASONING_END = "<think>", "</think>"


def served_answer(content: str) -> dict:
    """An assistant answer as an OpenAI-compatible server with a reasoning parser returns it
    and a client sends it back in the next request: the text after the first reasoning end
    marker as `content`, the text before it (without an opening marker) as
    `reasoning_content` (vLLM's `<think>` parsers split there). An answer without the
    marker (no reasoning, or a reasoning cut by max_new_tokens) is its whole text."""
    reasoning, end, answer = content.partition(REASONING_END)
    if not end:
        return {"role": "assistant", "content": content}
    before, start, after = reasoning.partition(REASONING_START)
    return {"role": "assistant", "content": answer, "reasoning_content": after if start else before}


def served_messages(messages: list[dict]) -> list[dict]:
    """The conversation as a server renders it: assistant turns through `served_answer`."""
    return [served_answer(m["content"]) if m["role"] == "assistant" else m for m in messages]


@dataclass
class Answer:
    """One assistant turn as the target generated it."""

    ids: list[int]  # generated token ids, with the stop token when generation stopped on one
    finished: bool  # False: cut by max_new_tokens (or the context length)


class Splicer:
    """Builds a regenerated conversation's samples turn by turn (see `spliced_samples`).

    Stage 00 keeps one per conversation: `head` gives turn j's prompt, `answer` appends
    the target's answer; each turn renders the template twice, however long the
    conversation already is. `messages` hold the earlier answers' decoded text.
    """

    def __init__(self, tok, suffix: list[int], template_kwargs: dict | None = None):
        self.tok, self.suffix, self.kw = tok, suffix, template_kwargs
        self.samples: list[Sample] = []
        self.prev: str | None = None  # the text the last sample stands for, when a later turn may extend it
        self.head_text = ""  # the current turn's prompt, as text
        self.turns = 0

    def head(self, messages: list[dict], i: int) -> list[int]:
        """Turn `self.turns`'s prompt (assistant message `i`): the served history rendered up to
        its content, appended to the current sample or, when the template rewrote an earlier
        turn, opening a sample of its own. Returns the prompt's ids."""
        head = render_text(self.tok, served_messages(messages[:i]), add_generation_prompt=True,
                           template_kwargs=self.kw)
        if self.prev is None or not head.startswith(self.prev):
            self.samples.append(Sample([], [], self.turns))
            self.prev = ""
        s = self.samples[-1]
        # The text between the previous turn's end and this turn's content (user turn,
        # headers) is tokenized on its own: special tokens bound both sides.
        piece = self.tok.encode(head[len(self.prev):], add_special_tokens=False)
        s.ids += piece
        s.mask += [0] * len(piece)
        if s.first_turn == self.turns:
            s.prompt_tokens = len(s.ids)
        self.prev = self.head_text = head
        return s.ids

    def answer(self, messages: list[dict], i: int, ans: Answer) -> None:
        """Append assistant message `i`'s generated ids (masked) and the template's suffix after it."""
        s = self.samples[-1]
        s.ids += list(ans.ids)
        s.mask += [1] * len(ans.ids)
        if self.suffix:
            ends_turn = ans.finished and list(ans.ids[-1:]) == self.suffix[:1]
            tail = self.suffix[1:] if ends_turn else self.suffix
            s.ids += tail
            s.mask += [0] * len(tail)
        final = render_text(self.tok, served_messages(messages[: i + 1]), template_kwargs=self.kw)
        # A later turn may extend this sample only if the template renders this turn as it was
        # generated: its prompt, then the decoded answer. Otherwise (reasoning dropped, text
        # trimmed) the server shows the later turn another history: it opens its own sample.
        self.prev = final if final.startswith(self.head_text + messages[i]["content"]) else None
        self.turns += 1

    def answered(self) -> list[Sample]:
        """The samples whose first turn has an answer (a sample opened for a turn that then was
        not generated, e.g. its prompt was too long, holds nothing to train on)."""
        return [s for s in self.samples if s.first_turn < self.turns]


def spliced_samples(tok, messages: list[dict], answers: list[Answer], suffix: list[int],
                    template_kwargs: dict | None = None) -> list[Sample]:
    """The samples of a conversation whose assistant turns are `answers`.

    `messages` hold each assistant turn's decoded text; it is only used to render the
    template around the turns. Assistant turn j (0-based) contributes exactly
    `answers[j].ids`, all masked. After a finished answer that ends with the template's
    end-of-turn token (`suffix[0]`), the rest of the suffix follows unmasked (as in
    `build_samples`); after a cut answer the whole suffix follows, unmasked, since the
    target did not end the turn there. Each sample's context before its first turn is
    exactly the prompt stage 00 gave the target for that turn (`turn_prompt`).
    """
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(answers) != len(turns):
        raise BadRecord("answers_mismatch", f"{len(turns)} assistant turns but {len(answers)} generated answers")
    sp = Splicer(tok, suffix, template_kwargs)
    for j, i in enumerate(turns):
        sp.head(messages, i)
        sp.answer(messages, i, answers[j])
    return sp.samples


def turn_prompt(tok, messages: list[dict], answers: list[Answer], suffix: list[int],
                template_kwargs: dict | None = None, turn: int = 0) -> list[int]:
    """The prompt of assistant turn `turn` (0-based) given the answers before it: what stage 00
    fed the target for that turn."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    sp = Splicer(tok, suffix, template_kwargs)
    for j, i in enumerate(turns[: turn + 1]):
        prompt = sp.head(messages, i)
        if j == turn:
            return list(prompt)
        sp.answer(messages, i, answers[j])
    raise IndexError(f"turn {turn} of a conversation with {len(turns)} assistant turns")


def reencode_differs(tok, messages: list[dict], answers: list[Answer], suffix: list[int],
                     template_kwargs: dict | None = None) -> list[bool]:
    """Per assistant turn: would rendering the decoded text (the stage-01 path for plain
    chats, `build_samples`) have given other ids than the generated ones? Compares each
    turn's masked span of the plain rendering with the generated ids (cut answers: the
    content part only)."""
    samples, _ = build_samples(tok, messages, suffix, template_kwargs)
    spans = [(s.ids, a, b) for s in samples for a, b in _runs(np.asarray(s.mask, dtype=np.int8))]
    out = []
    for j, ans in enumerate(answers):
        if j >= len(spans):
            out.append(True)
            continue
        ids, a, b = spans[j]
        got = ids[a:b]
        if not ans.finished and suffix and got[-1:] == suffix[:1]:
            got = got[:-1]  # the template closed a cut turn; the target did not
        out.append(got != list(ans.ids))
    return out


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    m = np.concatenate([[0], mask.astype(np.int8), [0]])
    d = np.diff(m)
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))
