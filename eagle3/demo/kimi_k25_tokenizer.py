"""A stand-in for Kimi-K2.5's tokenizer: its chat template's rules and its special-token ids.

Kimi-K2.5's own tokenizer is tiktoken-based remote code over a 163,840-token vocabulary;
the tests and tiny targets cannot load it. `build_tokenizer()` returns a fast byte-level
BPE tokenizer (trained here on the shipped chats, a few hundred merges) laid out like the
real one: ordinary tokens below 163584, then the 256 special-token slots 163584-163839
with every named token at its real id (`SPECIAL_TOKENS`) and `<|reserved_token_N|>` in
the others, eos `[EOS]` 163585, and `CHAT_TEMPLATE`, our rewrite of the rules of
Kimi-K2.5's `chat_template.jinja` (sources and the rules in docs/KIMI_K25.md, "Chat
template and turns"):

- no default system prompt (Kimi-K2-Instruct's and K2-Thinking's templates add one; K2.5's does not);
- `tools` become a `tool_declare` system turn first (`tools_ts_str`, when the caller passes
  the TypeScript form Kimi's tokenizer class computes, replaces the JSON);
- every message is `<|im_user|>` / `<|im_assistant|>` / `<|im_system|>` + its name (or role)
  + `<|im_middle|>` + its content + `<|im_end|>`; a tool result reads `## Return of <id>\n`;
- the messages are split after the last assistant message without tool calls: up to and
  including it (history) an assistant message is `<think></think>` + its content, its
  reasoning dropped; after it (the tool-call chain of the turn in progress) an assistant
  message keeps `<think>` + its `reasoning_content` + `</think>`, unless `thinking` is false;
- tool calls follow the content in a `<|tool_calls_section_begin|>` block, one
  `<|tool_call_begin|>id<|tool_call_argument_begin|>arguments<|tool_call_end|>` each;
- the generation prompt is `<|im_assistant|>assistant<|im_middle|><think>`, or
  `...<think></think>` with `thinking=False`.

So in a chat without tool calls every earlier answer is served as `<think></think>` +
its answer, whatever the target reasoned. Images and videos are not rendered (the
pipeline's chats are text).

Imported by the tests (tests/fixtures.py) and by tiny Kimi targets; no command line.
Building takes a few seconds (the 163,584-entry vocabulary).
"""
from __future__ import annotations

import json
from typing import Iterable

from eagle3.artifacts.workdir import REPO_ROOT

FIRST_SPECIAL_ID = 163584  # the real tokenizer's base vocabulary size
VOCAB_SIZE = FIRST_SPECIAL_ID + 256  # 163840: the target's vocab_size

# Kimi-K2.x's named special tokens: id -> (content, special). "special": false marks the
# tool-call tokens as the real tokenizer_config.json does; <think>/</think> are taken as
# not special too, since vLLM's kimi_k2 reasoning parser finds `</think>` in decoded text
# (docs/KIMI_K25.md).
SPECIAL_TOKENS: dict[int, tuple[str, bool]] = {
    163584: ("[BOS]", True), 163585: ("[EOS]", True), 163586: ("<|im_end|>", True),
    163587: ("<|im_user|>", True), 163588: ("<|im_assistant|>", True),
    163590: ("<|start_header_id|>", True), 163591: ("<|end_header_id|>", True), 163593: ("[EOT]", True),
    163594: ("<|im_system|>", True),
    163595: ("<|tool_calls_section_begin|>", False), 163596: ("<|tool_calls_section_end|>", False),
    163597: ("<|tool_call_begin|>", False), 163598: ("<|tool_call_argument_begin|>", False),
    163599: ("<|tool_call_end|>", False),
    163601: ("<|im_middle|>", True),
    163602: ("<|media_begin|>", True), 163603: ("<|media_content|>", True), 163604: ("<|media_end|>", True),
    163605: ("<|media_pad|>", True),
    163606: ("<think>", False), 163607: ("</think>", False),
    163838: ("[UNK]", True), 163839: ("[PAD]", True),
}
SPECIAL_IDS = {content: i for i, (content, _) in SPECIAL_TOKENS.items()}
EOS_ID = SPECIAL_IDS["[EOS]"]  # config.json's eos_token_id
END_OF_TURN_ID = SPECIAL_IDS["<|im_end|>"]  # generation_config.json's eos_token_id: what ends an answer

_HEADER = (
    "{%- macro header(m) -%}"
    "{%- set name = m.get('name') or m['role'] -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>{{ name }}<|im_middle|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>{{ name }}<|im_middle|>"
    "{%- else -%}<|im_system|>{{ name }}<|im_middle|>{%- endif -%}"
    "{%- endmacro -%}")
_TEXT = (
    "{%- macro text(m) -%}"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- elif m['content'] is not none -%}"
    "{%- for part in m['content'] -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}")
_CALLS = (
    "{%- macro calls(m) -%}<|tool_calls_section_begin|>"
    "{%- for call in m['tool_calls'] -%}<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}<|tool_call_end|>"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endmacro -%}")
# One message; `keep` decides whether an assistant message shows its reasoning.
_MESSAGE = (
    "{%- macro message(m, keep) -%}{{ header(m) }}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- if keep -%}<think>{{ m.get('reasoning_content') or '' }}</think>{%- else -%}<think></think>{%- endif -%}"
    "{{ text(m) }}{%- if m.get('tool_calls') -%}{{ calls(m) }}{%- endif -%}"
    "{%- elif m['role'] == 'tool' -%}## Return of {{ m['tool_call_id'] }}\n{{ text(m) }}"
    "{%- else -%}{{ text(m) }}{%- endif -%}<|im_end|>"
    "{%- endmacro -%}")
CHAT_TEMPLATE = (
    _HEADER + _TEXT + _CALLS + _MESSAGE
    + "{%- set no_think = thinking is defined and thinking is false -%}"
    # the split: after the last assistant message that calls no tool
    + "{%- set split = namespace(at=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}{%- set split.at = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>"
    "{%- if tools_ts_str -%}{{ tools_ts_str }}{%- else -%}{{ tools | tojson(separators=(',', ':')) }}{%- endif -%}"
    "<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}{{ message(m, loop.index0 > split.at and not no_think) }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if no_think -%}<think></think>{%- else -%}<think>{%- endif -%}{%- endif -%}")


def demo_texts() -> list[str]:
    """The shipped demo chats' turns: the default training text of the BPE merges."""
    texts = []
    for line in (REPO_ROOT / "data" / "demo_chats.jsonl").read_text().splitlines():
        rec = json.loads(line)
        for m in rec.get("messages") or rec.get("conversations") or []:
            texts.append(m.get("content") or m.get("value") or "")
    return texts


def build_tokenizer(texts: Iterable[str] | None = None, merges_vocab: int = 1024):
    """A `PreTrainedTokenizerFast` with Kimi-K2.5's special-token ids and chat template.

    `texts` train the byte-level BPE (default: the demo chats); `merges_vocab` bounds its
    ordinary tokens. Ids between those and 163584 are placeholders the BPE never produces,
    so every id the tokenizer emits is below the first special id or a special token.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=merges_vocab, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(list(texts) if texts is not None else demo_texts(), trainer=trainer)
    # Pad the ordinary vocabulary to the real size, so the special tokens that follow land
    # on their real ids.
    spec = json.loads(bpe.to_str())
    vocab = spec["model"]["vocab"]
    assert len(vocab) < FIRST_SPECIAL_ID, "the trained vocabulary cannot exceed the real one"
    for i in range(len(vocab), FIRST_SPECIAL_ID):
        vocab[f"<|unused_{i}|>"] = i
    tok = Tokenizer.from_str(json.dumps(spec))
    for i in range(FIRST_SPECIAL_ID, VOCAB_SIZE):  # one at a time: each takes the next id
        content, special = SPECIAL_TOKENS.get(i, (f"<|reserved_token_{i}|>", True))
        token = AddedToken(content, special=special, normalized=False)
        tok.add_special_tokens([token]) if special else tok.add_tokens([token])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]",
                                   pad_token="[PAD]", chat_template=CHAT_TEMPLATE, model_max_length=262144)
    assert len(fast) == VOCAB_SIZE and all(fast.convert_tokens_to_ids(c) == i for c, i in SPECIAL_IDS.items())
    return fast


def write_added_tokens_decoder(folder) -> None:
    """Add to a saved tokenizer's `tokenizer_config.json` the `added_tokens_decoder` the real
    target ships: its named special tokens at their ids (the reserved slots are not listed;
    Moonshot's class fills them in). transformers 5.x keeps added tokens in tokenizer.json
    only; the real K2.5 has no tokenizer.json, and this map is what eagle3/target/tokenizer_check.py
    compares a loaded tokenizer with."""
    from pathlib import Path

    path = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["added_tokens_decoder"] = {
        str(i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": special}
        for i, (content, special) in sorted(SPECIAL_TOKENS.items())}
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
