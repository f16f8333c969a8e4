"""Reading chat records and normalising them to `[{"role", "content"}]` messages.

Accepts the shapes users have, from local JSON/JSONL files, gzip'd or not (read here,
so a bad line can be named by file and line), anything `datasets.load_dataset` accepts
(a hub id, a folder of parquet/arrow/json files) or a folder written by `save_to_disk`
(`record_turns`):

    OpenAI     {"messages": [{"role", "content"}, ...]}
    ShareGPT   {"conversations": [{"from", "value"}, ...]}
    a prompt   {"prompt" | "instruction" | "question": "text"}   one user turn
               (Alpaca: a non-empty `input` beside `instruction` is appended to it)
    MT-Bench   {"turns": ["text", ...]}                          one user turn each
    any field  named by the caller (`prompt_field`, the stages' --prompt-field): a string,
               a list of strings (user turns) or a list of turns

Two readings of the turns: stage 01 trains on finished conversations (`normalize`:
user/assistant alternating, a trailing user turn trimmed); stage 00 answers them
(`answer_slots`: an assistant turn after every user turn that has none). A record
that cannot become a clean conversation raises `BadRecord` with a reason; the caller
counts reasons, nothing is dropped silently, and `likely_fix` turns the most common
reason into the one-line advice a stage prints when nothing usable is left. Bad bytes
are bad records too: a line that is not UTF-8, an item of a JSON array holding such
bytes, text with unpaired surrogates (the tokenizer would raise), and the point where a
truncated or corrupt gzip stream stops are each one record with a reason and a line,
never a traceback.

No file is read whole: a JSONL file goes line by line, a `.json` file item by item
(eagle3/target/json_items.py), and a record longer than MAX_RECORD_BYTES is a bad record
(`record_too_long`) skipped without being held. An exact duplicate, a record whose
conversation (the messages a stage reads from it) equals an earlier record's, is a bad
record too (`duplicate`, `mark_duplicates`): a copy on each side of the held-out split
would make every held-out figure a figure on training data.
"""
from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from eagle3.core.errors import PipelineError
from eagle3.target.json_items import json_items, text_pieces

ROLES = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant",
}
LOCAL_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")
# The longest record a chat file may hold: bytes of a JSONL line, characters of a .json item.
# 16 MiB of JSON is several million tokens, many times the longest context any target serves
# (262,144 for Kimi-K2.5); a longer line is a bad record (`record_too_long`), skipped without
# being held whole, so one runaway line cannot take the stage's memory.
MAX_RECORD_BYTES = 16 << 20
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


def iter_records(source: str, split: str = "train", max_record_bytes: int | None = None) -> Iterator[RawRecord]:
    """The records of a chat file or `datasets` source, in order. A local file's record longer than
    `max_record_bytes` (default MAX_RECORD_BYTES) is a bad record, `record_too_long`."""
    if is_local_file_name(source):
        check_local_files([source])
        yield from _iter_local(Path(source), max_record_bytes or MAX_RECORD_BYTES)
        return
    for i, row in enumerate(_load_dataset(source, split)):
        yield RawRecord(source, i + 1, row)


def is_saved_dataset(source: str) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (which
    `datasets.load_dataset` refuses: it must be read with `load_from_disk`)."""
    p = Path(source)
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def _load_dataset(source: str, split: str):
    import datasets

    if is_saved_dataset(source):
        ds = datasets.load_from_disk(source)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise PipelineError(f"{source} (saved with save_to_disk) has no split {split!r}; its splits are "
                                    f"{sorted(ds)}: pass one with --data-split.")
            ds = ds[split]
        return ds
    try:
        return datasets.load_dataset(source, split=split)
    except Exception as e:  # noqa: BLE001 -- any loader failure is the user's source, not our bug
        raise PipelineError(
            f"datasets.load_dataset({source!r}, split={split!r}) failed: {type(e).__name__}: {e}; check --data "
            f"and --data-split (local files must end in {', '.join(LOCAL_SUFFIXES)}).") from e


def _iter_local(path: Path, max_bytes: int) -> Iterator[RawRecord]:
    if str(path).endswith((".jsonl", ".jsonl.gz")):
        yield from _iter_jsonl(path, max_bytes)
    else:
        yield from _iter_json_array(path, max_bytes)


def _gzip_bad_record(e: Exception, records_read: int, unit: str = "line") -> BadRecord:
    reason = "truncated_gzip" if isinstance(e, EOFError) else "corrupt_gzip"
    return BadRecord(reason, f"{e}; nothing after {unit} {records_read} could be read")


def _iter_jsonl(path: Path, max_bytes: int) -> Iterator[RawRecord]:
    # Bytes, decoded line by line: one undecodable line is one bad record, not a
    # UnicodeDecodeError that ends the stage.
    opener = gzip.open if path.suffix == ".gz" else open
    n = 0
    try:
        with opener(path, "rb") as f:
            for n, raw in enumerate(_bounded_lines(f, max_bytes), 1):
                if isinstance(raw, int):
                    yield RawRecord(str(path), n, _too_long(raw, max_bytes))
                    continue
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


def _bounded_lines(f, max_bytes: int) -> Iterator[bytes | int]:
    """A binary file's lines, each as bytes, or as its length in bytes when it holds more than
    `max_bytes` (the line end aside): such a line is read on a megabyte at a time and dropped,
    never held whole."""
    step = min(max_bytes + 1, 1 << 20)
    while raw := f.readline(step):
        parts: list[bytes] | None = [raw]
        length = len(raw)
        while len(raw) == step and not raw.endswith(b"\n"):  # the line goes on
            raw = f.readline(step)
            length += len(raw)
            if parts is not None:
                parts.append(raw)
                if length > max_bytes + 2:  # more than any line end can explain: drop what was read
                    parts = None
        if parts is not None:
            line = parts[0] if len(parts) == 1 else b"".join(parts)
            if length <= max_bytes or len(line.rstrip(b"\r\n")) <= max_bytes:
                yield line
                continue
        yield length


def _too_long(length: int, max_bytes: int) -> BadRecord:
    return BadRecord("record_too_long", f"{length:,} bytes, over the limit of {max_bytes:,} on one record")


def _iter_json_array(path: Path, max_bytes: int) -> Iterator[RawRecord]:
    """A `.json` file's records, streamed (eagle3/target/json_items.py): an item's problem is one
    bad record, and where the file breaks (or its gzip stream ends early) reading stops with one."""
    opener = gzip.open if path.suffix == ".gz" else open
    n = 0
    try:
        with opener(path, "rb") as f:
            # a file holding one chat ({"messages": [...]}) is that chat, not a wrapper of its turns
            one_record = ("messages", "conversations") + PROMPT_FIELDS
            for item in json_items(text_pieces(f), max_bytes, record_keys=one_record):
                n = item.number
                record = item.value if item.problem is None else BadRecord(item.problem, item.detail)
                yield RawRecord(str(path), n, record)
    except _GZIP_ERRORS as e:
        yield RawRecord(str(path), n + 1, _gzip_bad_record(e, n, "item"))


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


# Text fields read as a prompt when a record has no `messages` / `conversations` and the
# caller names no field, in this order (the first one present is used).
PROMPT_FIELDS = ("prompt", "instruction", "question", "turns")
ALPACA_INPUT = "input"  # Alpaca's context for an `instruction`; appended to it


def _field_turns(record: dict, name: str, value: Any) -> list[tuple[Any, str, str]]:
    """A prompt field's turns as (turn, role key, text key): a string is one user turn, a
    list of strings one user turn each, a list of turns (or `datasets` columns) a chat."""
    if isinstance(value, str):
        extra = record.get(ALPACA_INPUT) if name == "instruction" else None
        if isinstance(extra, str) and extra.strip():
            value = f"{value}\n\n{extra}"
        return [({"role": "user", "content": value}, "role", "content")]
    if isinstance(value, dict):
        value = _turns_from_columns(value)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [({"role": "user", "content": v}, "role", "content") for v in value]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [(t, "role", "content") for t in value]
    raise BadRecord("empty_content" if value in (None, [], "") else "non_text_content",
                    f"`{name}` holds {value!r:.60}; expected a string, a list of strings or a list of turns")


def _raw_turns(record: dict, prompt_field: str | None) -> list[tuple[Any, str, str]]:
    if prompt_field is not None:
        if record.get(prompt_field) is None:
            raise BadRecord("no_prompt_field", f"no `{prompt_field}` (--prompt-field) in keys "
                                               f"{sorted(map(str, record))[:8]}")
        return _field_turns(record, prompt_field, record[prompt_field])
    for key, role_key, text_key in (("messages", "role", "content"), ("conversations", "from", "value")):
        turns = record.get(key)
        if isinstance(turns, (list, dict)):
            turns = _turns_from_columns(turns) if isinstance(turns, dict) else turns
            return [(t, role_key, text_key) for t in turns]
    for name in PROMPT_FIELDS:
        if record.get(name) is not None:
            return _field_turns(record, name, record[name])
    raise BadRecord("no_messages", f"keys {sorted(map(str, record))[:8]}; expected `messages`, `conversations` or "
                                   f"a prompt field ({', '.join(PROMPT_FIELDS)})")


def record_turns(record: Any, prompt_field: str | None = None) -> list[dict]:
    """The record's turns as `{"role", "content"}` messages, each checked (known role, text,
    encodable, not empty), in the order given; the order of roles is the caller's rule.

    `prompt_field` names the field to read (and only that one); by default `messages`,
    `conversations`, then the first of PROMPT_FIELDS the record has.
    """
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord("not_an_object", f"got {type(record).__name__}")
    messages = []
    for t, role_key, text_key in _raw_turns(record, prompt_field):
        m = chat_turn(t, role_key, text_key)
        m["content"] = _check_encodable(m["content"], m["role"])
        if not m["content"].strip():
            raise BadRecord("empty_content", f"empty {m['role']} turn")
        messages.append(m)
    return messages


def _check_alternating(body: list[dict]) -> None:
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise BadRecord("non_alternating", f"turn {i + 1} is {m['role']}, expected {expected}")


def _body(messages: list[dict]) -> list[dict]:
    """The turns after an optional leading system message."""
    return messages[1:] if messages and messages[0]["role"] == "system" else messages


def normalize(record: Any) -> tuple[list[dict], bool]:
    """A finished conversation to train on (stage 01): messages in `role`/`content` form, and
    whether a trailing user turn was trimmed.

    Rules: an optional leading system message, then user/assistant alternating,
    starting with user. A trailing user turn (no reply) is trimmed and reported.
    A record without an assistant turn (a prompt) is a bad record: stage 00 answers it.
    """
    messages = record_turns(record)
    body = _body(messages)
    _check_alternating(body)
    trimmed = bool(body) and body[-1]["role"] == "user"
    if trimmed:
        messages = messages[:-1]
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant_turn")
    return messages, trimmed


def answer_slots(messages: list[dict]) -> tuple[list[dict], list[int]]:
    """Stage 00's reading of a record's turns: the messages with an assistant turn after every
    user turn, and the index of each assistant turn (all are generated, in order).

    Two orders of roles are accepted after an optional leading system message:
    user/assistant alternating (each assistant turn is regenerated; a trailing user turn
    gets a new one after it), or user turns only (a prompt, or several: one new answer
    after each). A new assistant turn's content is empty until it is generated.
    """
    body = _body(messages)
    if not body or body[0]["role"] != "user":
        raise BadRecord("no_user_turn" if not body else "non_alternating",
                        "no user turn to answer" if not body else f"turn 1 is {body[0]['role']}, expected user")
    if all(m["role"] == "user" for m in body):
        out = messages[: len(messages) - len(body)]
        for m in body:
            out += [m, {"role": "assistant", "content": ""}]
    else:
        _check_alternating(body)
        out = list(messages) + ([{"role": "assistant", "content": ""}] if body[-1]["role"] == "user" else [])
    return out, [i for i, m in enumerate(out) if m["role"] == "assistant"]


# Per bad-record reason: the likely fix, for the one line a stage prints when no record was
# usable (and the warning when most were dropped). Stages add their own reasons' fixes.
FIXES = {
    "no_messages": "give each record `messages` (OpenAI), `conversations` (ShareGPT) or a prompt field ("
                   + ", ".join(PROMPT_FIELDS) + "), or name the field holding the prompt with --prompt-field",
    "no_prompt_field": "--prompt-field names a field these records do not have; check the field name",
    "no_assistant_turn": "every record lacks an assistant turn: these are prompts, so let the target answer "
                         "them first (`python 00_generate_responses.py --data FILE`, then this stage with "
                         "--data generated)",
    "no_user_turn": "the records hold no user turn to answer; pass prompts as a last user turn, or name the "
                    "prompt's field with --prompt-field",
    "non_alternating": "turns must alternate user/assistant after an optional system turn (or be user turns "
                       "only, for stage 00)",
    "unknown_role": "roles must be system, user/human or assistant/gpt",
    "empty_content": "turns must hold non-empty text",
    "non_text_content": "turns must hold text (or OpenAI text parts)",
    "malformed_json": "the file must be JSON Lines (one object per line, .jsonl) or one JSON array (.json)",
    "not_an_object": "each record must be a JSON object",
    "invalid_utf8": "the file must be UTF-8 encoded",
    "record_too_long": f"a record may hold at most {MAX_RECORD_BYTES >> 20} MiB of JSON: split the conversation or "
                       f"drop what no turn needs (attachments, tool dumps)",
    "duplicate": "the input repeats conversations (records whose messages equal an earlier record's); the first of "
                 "each is kept: remove the copies, and check that no file was passed twice or concatenated with "
                 "itself",
}


def reasons_text(reasons: dict) -> str:
    """`{'no_messages': 1200}` as `no_messages 1200`, most common first."""
    return ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"


def likely_fix(reasons: dict, fixes: dict | None = None) -> str:
    """The fix for the most common reason (`fixes` first, then FIXES), or a general hint."""
    table = {**FIXES, **(fixes or {})}
    for reason, _ in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        if reason in table:
            return table[reason]
    return "check the records' shape (docs/STAGES.md, stages 00 and 01)"


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


def conversation_key(messages: list[dict]) -> bytes:
    """Two conversations have the same key exactly when their messages are equal: the same
    roles and the same text, turn by turn (no whitespace or case folding). Each text goes in
    with its length, so no two lists of texts hash the same bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for m in messages:
        for text in (m["role"], m["content"]):
            data = text.encode("utf-8", "surrogatepass")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
    return digest.digest()


def mark_duplicates(records: list[RawRecord], messages_of: Callable[[Any], list[dict]]) -> list[RawRecord]:
    """`records` with each exact duplicate turned into a bad record, `duplicate`, naming the first
    copy: a later record whose `messages_of(record)` equals an earlier one's. The first copy (in
    input order, over all sources) is kept, so the result does not depend on workers or the split.
    Records `messages_of` refuses (BadRecord) are left as they are: each is counted by its own
    reason."""
    first: dict[bytes, str] = {}
    out = []
    for raw in records:
        try:
            key = conversation_key(messages_of(raw.record))
        except BadRecord:
            out.append(raw)
            continue
        if key in first:
            raw = RawRecord(raw.source, raw.line, BadRecord("duplicate", f"the same conversation as {first[key]}"))
        else:
            first[key] = raw.where
        out.append(raw)
    return out


def sample_id(raw: RawRecord) -> str:
    rid = raw.record.get("id") if isinstance(raw.record, dict) else None
    base = Path(raw.source).name if is_local_file_name(raw.source) else raw.source
    # The line keeps ids unique even when a dataset repeats its own `id` field.
    return f"{base}:{raw.line}" + (f":{rid}" if isinstance(rid, (str, int)) else "")
