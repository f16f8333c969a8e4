"""A `.json` chat file's records read one at a time, never the whole file (eagle3/target/chats.py).

`json_items(pieces, max_chars)` takes a file's text in pieces (`text_pieces` decodes a binary
file, gzip'd or not, a megabyte at a time) and yields one `Item` per record: each item of the
top-level array, or of the first array-valued member of a top-level object (the
`{"data": [...]}` wrappers datasets are shipped in), or the top-level value itself when it is
neither. Memory stays about one piece plus one record whatever the file's size, where
`json.loads` of the whole file needs its text and every parsed record at once (a file of
several GB is killed for memory with no message). A top-level object holding an array under
one of the caller's `record_keys` (a chat's `messages`) is one record, not a wrapper.

Each item's extent is found by scanning its brackets and strings (a regex search jumps between
them), then it is parsed by `json` itself; an item that fits in the text already read is
parsed at once (`raw_decode`), which is most of them. So a record is a record as `json.loads`
reads it, and a bad one is one bad item, the ones around it kept:

    malformed_json   the item is not valid JSON (its neighbours are still read), or the
                     array's structure breaks (a missing comma, the file ends inside an
                     item): then the items before are kept and nothing after is read
    record_too_long  the item is longer than `max_chars` characters; its text is dropped as
                     it is scanned, never held whole
    invalid_utf8     the item's bytes are not UTF-8 (decoded as U+DC80..U+DCFF by
                     `surrogateescape` so the scan goes on; a JSON escape such as "\\udc80"
                     is ASCII text here and is left to the caller)

Reads nothing itself and writes nothing: the caller opens the file.
"""
from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from typing import IO, Any, Generator, Iterator

PIECE_BYTES = 1 << 20  # what `text_pieces` reads at a time
# JSON's whitespace; the structural characters an item's scan stops at outside strings; the
# rest of a string after its opening quote (stops at the closing quote, or before a backslash
# that ends the text read so far); the rest of a number, true, false or null.
_SPACE = re.compile(r"[ \t\n\r]*")
_STRUCTURE = re.compile(r'["\[\]{}]')
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
_SCALAR_REST = re.compile(r"[^,\]}\s]*")
_VALUE_START = frozenset('{["-0123456789tfn')
# What `surrogateescape` makes of bytes that are not UTF-8; a strict decode never yields these.
_ESCAPED_BYTES = re.compile("[\udc80-\udcff]")
_DECODER = json.JSONDecoder()


@dataclass
class Item:
    number: int  # 1-based position in the array (1 for a file holding one value)
    value: Any = None  # the parsed record, when `problem` is None
    problem: str | None = None  # malformed_json, record_too_long, invalid_utf8
    detail: str = ""


def text_pieces(f: IO[bytes], piece_bytes: int = PIECE_BYTES) -> Iterator[str]:
    """A binary file's text, `piece_bytes` at a time: UTF-8 with an optional BOM; bytes that are
    not UTF-8 become U+DC80..U+DCFF (the scan goes on; the item holding them is reported)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    first = True
    while True:
        raw = f.read(piece_bytes)
        if first and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8):]
        first = False
        text = decoder.decode(raw, final=not raw)
        if text:
            yield text
        if not raw:
            return


class _Broken(Exception):
    """The file's structure breaks at record `number`: nothing after can be read."""

    def __init__(self, message: str, number: int | None = None):
        super().__init__(message)
        self.number = number


class _Scanner:
    """The text read so far (`buf`), a position in it, and the pieces still to come."""

    def __init__(self, pieces: Iterator[str], max_chars: int, record_keys: tuple[str, ...]):
        self.pieces, self.max_chars, self.record_keys = pieces, max_chars, record_keys
        self.buf, self.pos, self.at_end = "", 0, False

    def more(self) -> None:
        """Drop the text before `pos` and append the next piece (`at_end` when there is none)."""
        piece = next(self.pieces, None)
        if piece is None:
            self.at_end = True
            return
        self.buf = self.buf[self.pos:] + piece
        self.pos = 0

    def peek(self) -> str | None:
        """The next character that is not whitespace (not consumed), or None at the end."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            self.more()
            if self.at_end:
                return None

    def value(self, number: int) -> Item:
        """The JSON value starting at `pos`, parsed, or its problem; `pos` moves past it."""
        first = self.buf[self.pos]
        if first not in _VALUE_START:
            shown = f"byte 0x{ord(first) - 0xDC00:02x} (not UTF-8)" if _ESCAPED_BYTES.match(first) else repr(first)
            raise _Broken(f"item {number} starts with {shown}, which no JSON value starts with", number)
        if first in '{["':  # the common case: the whole item is in the text read so far
            try:  # (a number may go on in the next piece: those are scanned)
                value, end = _DECODER.raw_decode(self.buf, self.pos)
                start, self.pos = self.pos, end
                return self._checked(number, value, end - start, _ESCAPED_BYTES.search(self.buf, start, end))
            except json.JSONDecodeError:
                pass  # cut by the end of the text read so far, or malformed: scan for its end
        try:
            text, chars = self._scan()
        except _Broken as e:
            raise _Broken(str(e), number) from None
        if text is None:
            return self._checked(number, None, chars, None)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return Item(number, problem="malformed_json", detail=str(e))
        return self._checked(number, value, chars, _ESCAPED_BYTES.search(text))

    def _checked(self, number: int, value: Any, chars: int, bad_bytes: re.Match | None) -> Item:
        """The item, unless it is longer than `max_chars` or holds bytes that are not UTF-8."""
        if chars > self.max_chars:
            return Item(number, problem="record_too_long", detail=f"{chars:,} characters, over the limit of "
                                                                  f"{self.max_chars:,} on one record")
        if bad_bytes:
            return Item(number, problem="invalid_utf8", detail="the item holds bytes that are not UTF-8")
        return Item(number, value)

    def _scan(self) -> tuple[str | None, int]:
        """The text of the value at `pos` and its length, reading on as needed; the text is None
        when the value is longer than `max_chars` (dropped as the scan goes: what was read of it
        is kept in a list of pieces, never one growing string). `pos` ends past the value."""
        kept: list[str] | None = []
        chars = 0

        def read_on(upto: int) -> None:  # keep the value's text before `upto`, read the next piece
            nonlocal kept, chars
            if kept is not None:
                kept.append(self.buf[self.pos:upto])
                if chars + upto - self.pos > self.max_chars:
                    kept = None
            chars += upto - self.pos
            self.pos = upto
            self.more()

        first, cursor = self.buf[self.pos], self.pos + 1
        depth, in_string = (1, False) if first in "[{" else (0, first == '"')
        while True:
            if in_string:
                cursor = _STRING_REST.match(self.buf, cursor).end()
                if cursor < len(self.buf) and self.buf[cursor] == '"':
                    cursor, in_string = cursor + 1, False
                    if depth == 0:
                        break
                    continue
            elif depth == 0:  # a number, true, false or null: up to the next delimiter
                cursor = _SCALAR_REST.match(self.buf, cursor).end()
                if cursor < len(self.buf) or self.at_end:
                    break
            else:
                found = _STRUCTURE.search(self.buf, cursor)
                if found is not None:
                    cursor, char = found.end(), found.group()
                    if char == '"':
                        in_string = True
                    elif char in "[{":
                        depth += 1
                    else:
                        depth -= 1
                        if depth == 0:
                            break
                    continue
                cursor = len(self.buf)
            # the text read so far ends inside the value (perhaps right after a backslash)
            read_on(cursor)
            cursor = 0
            if self.at_end and (in_string or depth > 0):
                raise _Broken("the file ends inside this item")
        chars += cursor - self.pos
        text = None if kept is None or chars > self.max_chars else "".join(kept) + self.buf[self.pos:cursor]
        self.pos = cursor
        return text, chars


def json_items(pieces: Iterator[str], max_chars: int, record_keys: tuple[str, ...] = ()) -> Iterator[Item]:
    """The records of a `.json` file's text, one `Item` each, in order (see the module docstring).
    A top-level object with an array under one of `record_keys` (a chat's `messages`) is one
    record, not a wrapper of records."""
    scan = _Scanner(pieces, max_chars, record_keys)
    try:
        first = scan.peek()
        if first is None:
            raise _Broken("the file is empty; expected a JSON array", 1)
        if first == "[":
            count = yield from _array(scan)
            if scan.peek() is not None:
                raise _Broken(f"text after the array's end (`]` after item {count})", count + 1)
        elif first == "{":
            yield from _object_records(scan)
        else:
            yield scan.value(1)
            if scan.peek() is not None:
                raise _Broken("text after the file's one value", 2)
    except _Broken as e:
        yield Item(e.number or 1, problem="malformed_json", detail=f"{e}; nothing after it could be read")


def _array(scan: _Scanner) -> Generator[Item, None, int]:
    """The items of the array whose `[` is at the scan's position; returns how many."""
    scan.pos += 1
    if scan.peek() == "]":
        scan.pos += 1
        return 0
    number = 0
    while True:
        if scan.peek() is None:
            raise _Broken(f"the file ends inside the array, after item {number}", number + 1)
        number += 1
        yield scan.value(number)
        after = scan.peek()
        if after == "]":
            scan.pos += 1
            return number
        if after != ",":
            raise _Broken(f"expected `,` or `]` after item {number}, found {after!r}", number + 1)
        scan.pos += 1


def _object_records(scan: _Scanner) -> Iterator[Item]:
    """A top-level object: the items of its first array-valued member (a `{"data": [...]}`
    wrapper), or the object itself as one record when it has none."""
    members: dict[str, Item] = {}
    chars = 0  # the members' size, for the one-record case
    scan.pos += 1
    while (char := scan.peek()) != "}":
        if char is None:
            raise _Broken("the file ends inside the top-level object")
        if char != '"':
            raise _Broken(f"expected a member name in the top-level object, found {char!r}")
        name = scan.value(1)
        if name.problem is not None or scan.peek() != ":":
            raise _Broken(f"expected `\"name\": value` in the top-level object ({name.detail or name.value!r})")
        scan.pos += 1
        if scan.peek() == "[" and name.value not in scan.record_keys:
            yield from _array(scan)
            return
        begin = scan.pos
        members[name.value] = scan.value(1)
        chars += scan.pos - begin
        if scan.peek() == ",":
            scan.pos += 1
        elif scan.peek() != "}":
            raise _Broken(f"expected `,` or `}}` after the member {name.value!r}")
    bad = next((m for m in members.values() if m.problem is not None), None)
    if chars > scan.max_chars:
        yield Item(1, problem="record_too_long", detail=f"the top-level object is over the limit of "
                                                       f"{scan.max_chars:,} characters on one record")
    elif bad is not None:
        yield Item(1, problem=bad.problem, detail=bad.detail)
    else:
        yield Item(1, {name: m.value for name, m in members.items()})
