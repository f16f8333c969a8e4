"""Bad bytes are bad records: invalid UTF-8, unpaired surrogates, gzip'd and truncated
files, `datasets` rows of the wrong shape. Each is counted by reason with its line, the
good records around it are kept (stage 01 counting them and `--strict` naming them:
tests/stages/test_prepare_bad_records.py). Large files are read a record at a time, an
over-long record is a bad record never held whole, and exact duplicates are marked. About
10 s (one `datasets.load_dataset` of a local parquet folder; files of 16 and 40 MB).
"""
import gzip
import json
from collections import Counter

import pytest
from fixtures import GOOD, GOOD_UNICODE, bad_utf8_line, good_line

from eagle3.core.errors import PipelineError
from eagle3.target.chats import FIXES, BadRecord, RawRecord, iter_records, normalize


def reasons(source) -> tuple[Counter, list]:
    """Bad-record reasons and the (line, record) of the good ones, as stage 01 sees them."""
    bad, good = Counter(), []
    for raw in iter_records(str(source)):
        try:
            normalize(raw.record)
            good.append(raw.line)
        except BadRecord as e:
            bad[e.reason] += 1
    return bad, good


def test_invalid_utf8_line_is_one_bad_record_with_its_line(tmp_path):
    f = tmp_path / "chats.jsonl"
    f.write_bytes(good_line() + bad_utf8_line() + good_line(GOOD_UNICODE) + b"\n" + good_line())
    raws = list(iter_records(str(f)))
    assert [r.line for r in raws] == [1, 2, 3, 5]  # the blank line 4 is skipped, numbering kept
    assert isinstance(raws[1].record, BadRecord) and raws[1].record.reason == "invalid_utf8"
    assert "0xe9 at column" in raws[1].record.detail
    assert raws[2].record == GOOD_UNICODE  # real non-ASCII text is untouched
    assert reasons(f) == (Counter(invalid_utf8=1), [1, 3, 5])


def test_bom_and_crlf_lines_are_read(tmp_path):
    f = tmp_path / "chats.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + good_line().replace(b"\n", b"\r\n") + good_line().replace(b"\n", b"\r\n"))
    assert reasons(f) == (Counter(), [1, 2])


def test_unpaired_surrogate_escape_is_a_bad_record_not_a_tokenizer_crash(tmp_path):
    f = tmp_path / "chats.jsonl"
    # Valid UTF-8 and valid JSON, but "\udc80" decodes to a lone surrogate, which the
    # tokenizer refuses with a TypeError; a paired escape (an emoji) is fine.
    f.write_bytes(good_line() + b'{"messages": [{"role": "user", "content": "a\\udc80b"}, '
                  b'{"role": "assistant", "content": "x"}]}\n'
                  + b'{"messages": [{"role": "user", "content": "\\ud83d\\ude0a"}, '
                    b'{"role": "assistant", "content": "x"}]}\n')
    with pytest.raises(BadRecord, match="U\\+DC80 at character 2 of a user turn") as e:
        normalize(list(iter_records(str(f)))[1].record)
    assert e.value.reason == "unpaired_surrogate"
    assert reasons(f) == (Counter(unpaired_surrogate=1), [1, 3])


def test_json_array_with_bad_bytes_keeps_the_other_items(tmp_path):
    items = [json.dumps(GOOD).encode(), json.dumps(GOOD).encode().replace(b"Paris", b"Par\xffis"),
             json.dumps(GOOD_UNICODE, ensure_ascii=False).encode()]
    f = tmp_path / "chats.json"
    f.write_bytes(b"[" + b",\n".join(items) + b"]")
    raws = list(iter_records(str(f)))
    assert [r.line for r in raws] == [1, 2, 3]
    assert raws[1].record.reason == "invalid_utf8" and raws[2].record == GOOD_UNICODE
    assert reasons(f) == (Counter(invalid_utf8=1), [1, 3])
    # Bad bytes between items break the array itself: the items before are kept (the file is
    # read item by item), one malformed_json record says where reading stopped, no traceback.
    f.write_bytes(b"[" + items[0] + b",\xff" + items[2] + b"]")
    assert reasons(f) == (Counter(malformed_json=1), [1])
    assert "item 2 starts with byte 0xff (not UTF-8)" in list(iter_records(str(f)))[1].record.detail


def test_gzip_files_are_read_and_a_truncated_one_keeps_its_complete_lines(tmp_path):
    lines = [good_line({"messages": [{"role": "user", "content": f"question {i} " + "x" * 40},
                                     {"role": "assistant", "content": f"answer {i}"}]}) for i in range(400)]
    whole = tmp_path / "chats.jsonl.gz"
    whole.write_bytes(gzip.compress(b"".join(lines)))
    assert reasons(whole) == (Counter(), list(range(1, 401)))

    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole.read_bytes()[: len(whole.read_bytes()) // 2])
    bad, good = reasons(cut)
    assert bad == Counter(truncated_gzip=1)
    assert 0 < len(good) < 400 and good == list(range(1, len(good) + 1))  # every kept line is whole
    last = list(iter_records(str(cut)))[-1]
    assert last.line == len(good) + 1 and "after line" in last.record.detail

    not_gz = tmp_path / "plain.jsonl.gz"
    not_gz.write_bytes(b"".join(lines[:3]))
    assert reasons(not_gz) == (Counter(corrupt_gzip=1), [])

    arr = tmp_path / "chats.json.gz"
    arr.write_bytes(gzip.compress(json.dumps([GOOD, GOOD_UNICODE]).encode()))
    assert reasons(arr) == (Counter(), [1, 2])
    arr.write_bytes(arr.read_bytes()[:-12])
    assert reasons(arr) == (Counter(truncated_gzip=1), [])


def test_missing_gzip_file_is_named(tmp_path):
    with pytest.raises(PipelineError, match=r"data file .*nope\.jsonl\.gz does not exist"):
        list(iter_records(str(tmp_path / "nope.jsonl.gz")))


def test_datasets_rows_of_the_wrong_shape_are_counted(tmp_path):
    import datasets

    good_turns = GOOD["messages"]
    rows = [{"messages": good_turns}, {"messages": None}, {"messages": []},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
            {"messages": [{"role": "tool", "content": "hi"}, {"role": "assistant", "content": "x"}]}]
    folder = tmp_path / "ds"
    folder.mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(folder / "train.parquet"))
    bad, good = reasons(folder)
    assert good == [1]
    assert bad == Counter(no_messages=1, no_assistant_turn=1, empty_content=1, unknown_role=1)
    # `datasets` hands a Sequence of dicts back as a dict of lists: read as turns, not refused.
    columns = {"messages": {"role": ["user", "assistant"], "content": ["hi", "yo"]}}
    assert normalize(columns)[0] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(BadRecord) as e:
        normalize({"messages": {"role": ["user", "assistant"], "content": ["hi"]}})
    assert e.value.reason == "malformed_turns"
    with pytest.raises(PipelineError, match="datasets.load_dataset"):
        list(iter_records(str(tmp_path / "no-such-dataset-folder")))


# -- large files: read a record at a time, an over-long record refused unread ---------------

def peak_bytes_reading(source) -> tuple[list, int]:
    """(line, bad reason or None) of each record of `source`, and the most memory Python held
    while reading them (tracemalloc), the records dropped as they come."""
    import tracemalloc

    tracemalloc.start()
    try:
        seen = [(r.line, getattr(r.record, "reason", None)) for r in iter_records(str(source))]
        return seen, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_over_long_record_is_a_bad_record_and_never_held_whole(tmp_path):
    from eagle3.target.chats import MAX_RECORD_BYTES

    # A record of 2.5 times the limit, between two good ones: once as a JSONL line (plain and
    # gzip'd), once as an item of a .json array. It used to be read whole, and parsed.
    huge = {"messages": [{"role": "user", "content": "x" * (MAX_RECORD_BYTES * 5 // 2)}, A("ok")]}
    text = json.dumps(huge)
    line = tmp_path / "chats.jsonl"
    line.write_bytes(good_line() + text.encode() + b"\n" + good_line(GOOD_UNICODE))
    packed = tmp_path / "chats.jsonl.gz"
    packed.write_bytes(gzip.compress(line.read_bytes(), compresslevel=1))
    array = tmp_path / "chats.json"
    array.write_text("[" + json.dumps(GOOD) + ",\n" + text + ",\n" + json.dumps(GOOD_UNICODE) + "]")
    for source in (line, packed, array):
        seen, peak = peak_bytes_reading(source)
        assert seen == [(1, None), (2, "record_too_long"), (3, None)], source
        assert peak < len(text) / 2, (source, peak)  # the record's text was never held whole
    detail = list(iter_records(str(line)))[1].record.detail
    assert f"{len(text) + 1:,} bytes, over the limit of {MAX_RECORD_BYTES:,}" in detail
    assert "record_too_long" in FIXES and f"{MAX_RECORD_BYTES >> 20} MiB" in FIXES["record_too_long"]


def test_a_large_json_array_is_read_one_item_at_a_time(tmp_path):
    items = [{"id": i, "messages": [U(f"question {i} " + "y" * (1 << 20)), A(f"answer {i}")]} for i in range(16)]
    for name, write in (("chats.json", lambda p, b: p.write_bytes(b)),
                        ("chats.json.gz", lambda p, b: p.write_bytes(gzip.compress(b, compresslevel=1)))):
        f = tmp_path / name
        body = json.dumps(items).encode()
        write(f, body)
        seen, peak = peak_bytes_reading(f)
        assert seen == [(i, None) for i in range(1, 17)]
        assert peak < len(body) / 2, (name, peak)  # json.loads held the text and every record at once
    raws = list(iter_records(str(tmp_path / "chats.json")))
    assert [r.record["messages"][1]["content"] for r in raws] == [f"answer {i}" for i in range(16)]


def test_a_malformed_item_of_a_json_array_is_one_bad_record_its_neighbours_kept(tmp_path):
    f = tmp_path / "chats.json"
    good = json.dumps(GOOD)
    # a trailing comma inside item 2: the array's shape holds, so only that item is bad
    f.write_text(f'[{good}, {{"messages": [{{"role": "user", "content": "a"}},]}}, {good}]')
    assert reasons(f) == (Counter(malformed_json=1), [1, 3])
    # a wrapper object: the records are its first array-valued member
    f.write_text(f'{{"version": 2, "meta": {{"n": [1]}}, "data": [{good}, {good}]}}')
    assert reasons(f) == (Counter(), [1, 2])
    # the file ends inside item 2: item 1 kept, one bad record says where reading stopped
    f.write_text(f'[{good}, {good[:-9]}')
    raws = list(iter_records(str(f)))
    assert [r.line for r in raws] == [1, 2] and raws[1].record.reason == "malformed_json"
    assert "the file ends inside this item" in raws[1].record.detail
    # one object, and a top-level string, are one record each (a string is not a record)
    f.write_text(good)
    assert reasons(f) == (Counter(), [1])
    f.write_text('"just text"')
    assert reasons(f) == (Counter(not_an_object=1), [])


def test_json_items_equal_json_loads_whatever_the_piece_boundaries():
    from eagle3.target.json_items import json_items

    # strings holding every character the scan looks for, escapes cut after the backslash,
    # numbers cut mid-way, nesting, non-ASCII text
    records = [{"messages": [U('a "quoted" [x] {y}, \\'), A("\\\"\u00e9 😊\n")]}, [1, [2, {"k": []}]],
               {"n": -12.5e3, "t": True, "f": False, "z": None, "s": "]}"}, 1234567890, "x,y", {}, []]
    for text in (json.dumps(records), json.dumps(records, indent=2, ensure_ascii=False),
                 json.dumps({"count": 7, "rows": records})):
        for size in range(1, 40):
            pieces = (text[i:i + size] for i in range(0, len(text), size))
            items = list(json_items(pieces, max_chars=1000))
            assert [(x.problem, x.value) for x in items] == [(None, r) for r in records], (text, size)


def test_exact_duplicates_are_marked_naming_the_first_copy():
    from eagle3.target.chats import mark_duplicates

    chat = {"messages": [SYSTEM, U("Hi"), A("Hello!")]}
    same_in_sharegpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                          {"from": "gpt", "value": "Hello!"}]}
    in_parts = {"messages": [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "H"},
                                                                  {"type": "text", "text": "i"}]}, A("Hello!")]}
    with_a_last_question = {"messages": chat["messages"] + [U("Why?")]}  # trimmed by normalize: the same
    other_space = {"messages": [SYSTEM, U("Hi "), A("Hello!")]}
    no_system = {"messages": [U("Hi"), A("Hello!")]}
    records = [chat, same_in_sharegpt, in_parts, with_a_last_question, other_space, no_system, {"text": "x"},
               {"text": "x"}, chat]
    raws = mark_duplicates([RawRecord("a.jsonl", i + 1, r) for i, r in enumerate(records)],
                           lambda record: normalize(record)[0])
    marked = [(r.line, r.record.detail) for r in raws if isinstance(r.record, BadRecord)]
    assert marked == [(2, "the same conversation as a.jsonl:1"), (3, "the same conversation as a.jsonl:1"),
                      (4, "the same conversation as a.jsonl:1"), (9, "the same conversation as a.jsonl:1")]
    assert all(r.record.reason == "duplicate" for r in raws if isinstance(r.record, BadRecord))
    # records that are no conversation keep their own record (and reason), whatever they repeat
    assert [r.record for r in raws[6:8]] == [{"text": "x"}, {"text": "x"}]
    assert "duplicate" in FIXES


# -- prompt shapes: what stage 00 answers (record_turns + answer_slots) ---------------------

def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Be brief."}
SLOT = A("")  # an assistant turn stage 00 generates


def slots(record, prompt_field=None):
    from eagle3.target.chats import answer_slots, record_turns

    return answer_slots(record_turns(record, prompt_field))


def test_a_single_user_turn_gets_one_answer_after_it():
    assert slots({"messages": [U("Hi, how are you doing?")]}) == ([U("Hi, how are you doing?"), SLOT], [1])
    assert slots({"conversations": [{"from": "human", "value": "Hi"}]}) == ([U("Hi"), SLOT], [1])


def test_several_user_turns_get_one_answer_after_each_in_order_and_system_turns_stay():
    messages, turns = slots({"messages": [SYSTEM, U("a"), U("b"), U("c")]})
    assert messages == [SYSTEM, U("a"), SLOT, U("b"), SLOT, U("c"), SLOT] and turns == [2, 4, 6]


def test_a_chat_ending_on_a_user_turn_is_regenerated_and_gets_a_new_last_answer():
    messages, turns = slots({"messages": [SYSTEM, U("a"), A("x"), U("b")]})
    assert messages == [SYSTEM, U("a"), A("x"), U("b"), SLOT] and turns == [2, 4]
    # A finished chat: every assistant turn is regenerated, nothing is added.
    assert slots({"messages": [U("a"), A("x")]}) == ([U("a"), A("x")], [1])


@pytest.mark.parametrize("record, reason", [
    ({"messages": [U("a"), A("x"), U("b"), U("c")]}, "non_alternating"),  # answered and unanswered mixed
    ({"messages": [A("x"), U("a")]}, "non_alternating"),
    ({"messages": [SYSTEM]}, "no_user_turn"),
    ({"messages": []}, "no_user_turn"),
    ({"text": "plain"}, "no_messages"),
    ({"prompt": "   "}, "empty_content"),
    ({"turns": ["a", ""]}, "empty_content"),
    ({"prompt": 7}, "non_text_content"),
])
def test_records_that_cannot_be_answered_name_their_reason(record, reason):
    with pytest.raises(BadRecord) as e:
        slots(record)
    assert e.value.reason == reason


def test_prompt_fields_instruction_question_and_mt_bench_turns():
    assert slots({"prompt": "Hi", "id": 3}) == ([U("Hi"), SLOT], [1])
    assert slots({"question": "Why is the sky blue?", "answer": "Rayleigh"}) == ([U("Why is the sky blue?"), SLOT],
                                                                                 [1])
    # Alpaca: the `input` is the instruction's context; an empty one adds nothing.
    assert slots({"instruction": "Summarize.", "input": "Cats purr.", "output": "x"})[0][0] == U("Summarize.\n\nCats purr.")
    assert slots({"instruction": "Say hi.", "input": ""})[0][0] == U("Say hi.")
    messages, turns = slots({"turns": ["Write a poem.", "Shorter, please."], "category": "writing"})
    assert messages == [U("Write a poem."), SLOT, U("Shorter, please."), SLOT] and turns == [1, 3]
    # `messages` comes first when a record has both (UltraChat has `prompt` and `messages`).
    both = {"prompt": "first only", "messages": [U("first only"), A("x"), U("then")]}
    assert slots(both)[1] == [1, 3]


def test_prompt_field_names_the_one_field_read():
    rec = {"prompt": "first only", "messages": [U("first only"), A("x"), U("then")], "text": "Hello?"}
    assert slots(rec, "prompt") == ([U("first only"), SLOT], [1])  # the named field wins over `messages`
    assert slots(rec, "text") == ([U("Hello?"), SLOT], [1])
    assert slots({"qs": ["a", "b"]}, "qs")[1] == [1, 3]
    chat = {"conversation": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}]}
    assert slots(chat, "conversation") == ([U("a"), A("x")], [1])
    with pytest.raises(BadRecord) as e:
        slots({"prompt": "Hi"}, "text")
    assert e.value.reason == "no_prompt_field" and "`text` (--prompt-field)" in e.value.detail


def test_stage01_reads_a_prompt_as_a_record_without_an_answer():
    with pytest.raises(BadRecord) as e:
        normalize({"prompt": "Hi"})
    assert e.value.reason == "no_assistant_turn"


def test_datasets_folders_saved_to_disk_and_parquet_give_the_same_prompts(tmp_path):
    import datasets

    from eagle3.target.chats import record_turns

    rows = [{"instruction": "Say hi.", "input": "", "turns": ["t1", "t2"]},
            {"instruction": "Add.", "input": "2 + 2", "turns": ["u1", "u2"]}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "saved_dict"))
    (tmp_path / "pq").mkdir()
    ds.to_parquet(str(tmp_path / "pq" / "train.parquet"))
    expected = [[U("Say hi.")], [U("Add.\n\n2 + 2")]]
    for source in ("saved", "saved_dict", "pq"):
        raws = list(iter_records(str(tmp_path / source)))
        assert [r.line for r in raws] == [1, 2]
        assert [record_turns(r.record) for r in raws] == expected  # `instruction` before `turns`
        assert [record_turns(r.record, "turns") for r in raws] == [[U("t1"), U("t2")], [U("u1"), U("u2")]]
    assert len(list(iter_records(str(tmp_path / "saved_dict"), "test"))) == 1
    with pytest.raises(PipelineError, match=r"no split 'validation'; its splits are \['test', 'train'\]"):
        list(iter_records(str(tmp_path / "saved_dict"), "validation"))


def test_likely_fix_names_the_most_common_reason():
    from eagle3.target.chats import likely_fix, reasons_text

    assert reasons_text({"unknown_role": 2, "no_messages": 5}) == "no_messages 5, unknown_role 2"
    assert reasons_text({}) == "none"
    assert "--prompt-field" in likely_fix({"unknown_role": 2, "no_messages": 5})
    assert "00_generate_responses.py" in likely_fix({"no_assistant_turn": 9})
    assert likely_fix({"odd": 1}, {"odd": "do this"}) == "do this"
