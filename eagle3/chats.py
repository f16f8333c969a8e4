"""Reading chat records and normalising them to `[{"role", "content"}]` messages.

Accepts the two shapes users have: ShareGPT (`conversations` of `from`/`value`) and
OpenAI (`messages` of `role`/`content`), from local JSON/JSONL files (read here, so
a bad line can be named by file and line) or anything `datasets.load_dataset`
accepts. A record that cannot become a clean conversation raises `BadRecord` with
a reason; the caller counts reasons, nothing is dropped silently.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ROLES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant",
}
LOCAL_SUFFIXES = (".json", ".jsonl")


class BadRecord(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class RawRecord:
    source: str  # file path or dataset id
    line: int  # 1-based line (JSONL), item number (JSON list) or row number (datasets)
    record: Any  # parsed JSON object, or a BadRecord for unparseable lines

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


def iter_records(source: str, split: str = "train") -> Iterator[RawRecord]:
    path = Path(source)
    if path.suffix in LOCAL_SUFFIXES and path.is_file():
        yield from _iter_local(path)
        return
    import datasets

    ds = datasets.load_dataset(source, split=split)
    for i, row in enumerate(ds):
        yield RawRecord(source, i + 1, row)


def _iter_local(path: Path) -> Iterator[RawRecord]:
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield RawRecord(str(path), n, json.loads(line))
                except json.JSONDecodeError as e:
                    yield RawRecord(str(path), n, BadRecord("malformed_json", str(e)))
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        yield RawRecord(str(path), e.lineno, BadRecord("malformed_json", str(e)))
        return
    if isinstance(data, dict):  # {"data": [...]} style wrappers are common
        data = next((v for v in data.values() if isinstance(v, list)), [data])
    for n, rec in enumerate(data, 1):
        yield RawRecord(str(path), n, rec)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise BadRecord("non_text_content", f"content part {str(part)[:60]!r}")
        return "".join(texts)
    raise BadRecord("empty_content" if content is None else "non_text_content", f"content {content!r:.60}")


def normalize(record: Any) -> tuple[list[dict], bool]:
    """Messages in `role`/`content` form, and whether a trailing user turn was trimmed.

    Rules: an optional leading system message, then user/assistant alternating,
    starting with user. A trailing user turn (no reply) is trimmed and reported.
    """
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("not_an_object", f"got {type(record).__name__}")
    if isinstance(record.get("messages"), list):
        turns, role_key, text_key = record["messages"], "role", "content"
    elif isinstance(record.get("conversations"), list):
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise BadRecord("no_messages", f"keys {sorted(record)[:8]}; expected `messages` or `conversations`")
    messages = []
    for t in turns:
        if not isinstance(t, dict):
            raise BadRecord("not_an_object", f"turn {t!r:.60}")
        raw_role = t.get(role_key, t.get("role", t.get("from")))
        role = ROLES.get(str(raw_role).lower())
        if role is None:
            raise BadRecord("unknown_role", f"role {raw_role!r}")
        text = _content_text(t.get(text_key, t.get("content", t.get("value"))))
        if not text.strip():
            raise BadRecord("empty_content", f"empty {role} turn")
        messages.append({"role": role, "content": text})
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise BadRecord("non_alternating", f"turn {i + 1} is {m['role']}, expected {expected}")
    trimmed = bool(body) and body[-1]["role"] == "user"
    if trimmed:
        messages = messages[:-1]
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant_turn")
    return messages, trimmed


def sample_id(raw: RawRecord) -> str:
    rid = raw.record.get("id") if isinstance(raw.record, dict) else None
    base = Path(raw.source).name if Path(raw.source).suffix in LOCAL_SUFFIXES else raw.source
    # The line keeps ids unique even when a dataset repeats its own `id` field.
    return f"{base}:{raw.line}" + (f":{rid}" if isinstance(rid, (str, int)) else "")
