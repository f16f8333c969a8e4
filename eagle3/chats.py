"""Reading chat records and normalising them to `[{"role", "content"}]` messages.

Accepts the two shapes users have: ShareGPT (`conversations` of `from`/`value`) and
OpenAI (`messages` of `role`/`content`), from local JSON/JSONL files, gzip'd or not
(read here, so a bad line can be named by file and line) or anything
`datasets.load_dataset` accepts. A record that cannot become a clean conversation
raises `BadRecord` with a reason; the caller counts reasons, nothing is dropped
silently. Bad bytes are bad records too: a line that is not UTF-8, an item of a JSON
array holding such bytes, text with unpaired surrogates (the tokenizer would raise),
and the point where a truncated or corrupt gzip stream stops are each one record
with a reason and a line, never a traceback.
"""
from __future__ import annotations

import codecs
import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import PipelineError

ROLES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant",
}
LOCAL_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
# What a gzip stream raises when it was cut short (EOFError) or its bytes are wrong.
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def is_local_file_name(source: str) -> bool:
    """True for a name this module reads itself (JSON / JSONL, optionally .gz)."""
    return str(source).endswith(LOCAL_SUFFIXES)


def check_local_files(sources: list[str]) -> None:
    """Refuse a missing local chat file before any source is read (a datasets id may be slow)."""
    for source in sources:
        if is_local_file_name(source) and not Path(source).is_file():
            raise PipelineError(f"data file {source} does not exist; check --data.")


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
    if is_local_file_name(source):
        check_local_files([source])
        yield from _iter_local(Path(source))
        return
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # noqa: BLE001 -- any loader failure is the user's source, not our bug
        raise PipelineError(
            f"datasets.load_dataset({source!r}, split={split!r}) failed: {type(e).__name__}: {e}; check --data "
            f"and --data-split (local files must end in {', '.join(LOCAL_SUFFIXES)}).") from e
    for i, row in enumerate(ds):
        yield RawRecord(source, i + 1, row)


def _iter_local(path: Path) -> Iterator[RawRecord]:
    if str(path).endswith((".jsonl", ".jsonl.gz")):
        yield from _iter_jsonl(path)
    else:
        yield from _iter_json_array(path)


def _gzip_bad_record(e: Exception, lines_read: int) -> BadRecord:
    reason = "truncated_gzip" if isinstance(e, EOFError) else "corrupt_gzip"
    return BadRecord(reason, f"{e}; nothing after line {lines_read} could be read")


def _iter_jsonl(path: Path) -> Iterator[RawRecord]:
    # Bytes, decoded line by line: one undecodable line is one bad record, not a
    # UnicodeDecodeError that ends the stage.
    opener = gzip.open if path.suffix == ".gz" else open
    n = 0
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if n == 1 and raw.startswith(codecs.BOM_UTF8):
                    raw = raw[len(codecs.BOM_UTF8):]
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield RawRecord(str(path), n, BadRecord(
                        "invalid_utf8", f"byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8"))
                    continue
                if not line.strip():
                    continue
                try:
                    yield RawRecord(str(path), n, json.loads(line))
                except json.JSONDecodeError as e:
                    yield RawRecord(str(path), n, BadRecord("malformed_json", str(e)))
    except _GZIP_ERRORS as e:
        # The lines before the damage were complete and are kept; the stream's end is one bad record.
        yield RawRecord(str(path), n + 1, _gzip_bad_record(e, n))


def _iter_json_array(path: Path) -> Iterator[RawRecord]:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except _GZIP_ERRORS as e:
        yield RawRecord(str(path), 1, _gzip_bad_record(e, 0))
        return
    try:
        text, bad_bytes = raw.decode("utf-8-sig"), False
    except UnicodeDecodeError:
        # Keep the undecodable bytes as U+DC80..U+DCFF so the JSON still parses; the
        # items that hold them become bad records below, the others are used.
        text, bad_bytes = raw.decode("utf-8-sig", errors="surrogateescape"), True
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        yield RawRecord(str(path), e.lineno, BadRecord("malformed_json", str(e)))
        return
    if isinstance(data, dict):  # {"data": [...]} style wrappers are common
        data = next((v for v in data.values() if isinstance(v, list)), [data])
    for n, rec in enumerate(data, 1):
        if bad_bytes and _holds_escaped_bytes(rec):
            rec = BadRecord("invalid_utf8", "the item holds bytes that are not UTF-8")
        yield RawRecord(str(path), n, rec)


def _holds_escaped_bytes(obj: Any) -> bool:
    if isinstance(obj, str):
        return any("\udc80" <= c <= "\udcff" for c in obj) if not obj.isascii() else False
    if isinstance(obj, dict):
        return any(_holds_escaped_bytes(k) or _holds_escaped_bytes(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_holds_escaped_bytes(v) for v in obj)
    return False


def _check_encodable(text: str, role: str) -> str:
    """Text the tokenizer can take: JSON escapes such as "\\udc80" decode to unpaired
    surrogates, on which a fast tokenizer raises a TypeError."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRecord("unpaired_surrogate",
                            f"U+{ord(text[e.start]):04X} at character {e.start + 1} of a {role} turn") from None
    return text


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
    if isinstance(record.get("messages"), (list, dict)):
        turns, role_key, text_key = record["messages"], "role", "content"
    elif isinstance(record.get("conversations"), (list, dict)):
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise BadRecord("no_messages", f"keys {sorted(map(str, record))[:8]}; expected `messages` or `conversations`")
    if isinstance(turns, dict):
        turns = _turns_from_columns(turns)
    messages = []
    for t in turns:
        m = chat_turn(t, role_key, text_key)
        m["content"] = _check_encodable(m["content"], m["role"])
        if not m["content"].strip():
            raise BadRecord("empty_content", f"empty {m['role']} turn")
        messages.append(m)
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


def chat_turn(turn, role_key: str = "role", text_key: str = "content") -> dict[str, str]:
    """One turn of a chat record as `{"role", "content"}`: the role normalised (ShareGPT's
    `human`/`gpt` -> user/assistant), the text flattened from content parts. `role_key` and
    `text_key` are the record format's (`role`/`content` for OpenAI messages, `from`/`value`
    for ShareGPT); the other format's keys are accepted too. Raises BadRecord."""
    if not isinstance(turn, dict):
        raise BadRecord("not_an_object", f"turn {turn!r:.60}")
    raw_role = turn.get(role_key, turn.get("role", turn.get("from")))
    role = ROLES.get(str(raw_role).lower())
    if role is None:
        raise BadRecord("unknown_role", f"role {raw_role!r}")
    return {"role": role, "content": _content_text(turn.get(text_key, turn.get("content", turn.get("value"))))}


def _turns_from_columns(columns: dict) -> list:
    """`datasets` returns a `Sequence` of dicts as one dict of lists; turn it back into turns."""
    lengths = {len(v) if isinstance(v, list) else -1 for v in columns.values()}
    if not columns or len(lengths) != 1 or -1 in lengths:
        raise BadRecord("malformed_turns", f"turns are a dict that is not equal-length columns: {str(columns)[:60]!r}")
    keys = list(columns)
    return [dict(zip(keys, row)) for row in zip(*(columns[k] for k in keys))]


def sample_id(raw: RawRecord) -> str:
    rid = raw.record.get("id") if isinstance(raw.record, dict) else None
    base = Path(raw.source).name if is_local_file_name(raw.source) else raw.source
    # The line keeps ids unique even when a dataset repeats its own `id` field.
    return f"{base}:{raw.line}" + (f":{rid}" if isinstance(rid, (str, int)) else "")
