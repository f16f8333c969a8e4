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
"""
from __future__ import annotations

import numpy as np

from .chats import BadRecord

_PROBE_CONTENTS = ("Alpha bravo charlie", "7")


def render(tok, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    # The rendered text already holds the template's BOS; don't add another.
    return tok.encode(text, add_special_tokens=False)


def assistant_suffix(tok) -> list[int]:
    """Tokens the template appends after every assistant message's content."""
    seqs = [render(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": c}])
            for c in _PROBE_CONTENTS]
    a, b = seqs
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n:] if n else []


def _is_prefix(short: list[int], long: list[int]) -> bool:
    return len(short) <= len(long) and long[: len(short)] == short


def build_sample(tok, messages: list[dict], suffix: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """Token ids, loss mask (1 = assistant content or its end-of-turn token), and the
    number of assistant turns whose end did not match the probed suffix (masked to
    the end of their rendering instead)."""
    ids = render(tok, messages)
    mask = np.zeros(len(ids), dtype=np.int8)
    fuzzy_ends = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = render(tok, messages[:i], add_generation_prompt=True)
        upto = render(tok, messages[: i + 1])
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
