"""Bad bytes are bad records: invalid UTF-8, unpaired surrogates, gzip'd and truncated
files, `datasets` rows of the wrong shape. Each is counted by reason with its line (and
named by `--strict`), the good records around it are kept. About 15 s (two stage-01 runs
on the tiny Llama, one `datasets.load_dataset` of a local parquet folder).
"""
import gzip
import json
from collections import Counter

import pytest

from eagle3.chats import BadRecord, iter_records, normalize
from eagle3.errors import PipelineError
from eagle3.prepare import PrepareConfig, prepare_dataset

GOOD = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "The capital of France is Paris."}]}
GOOD_UNICODE = {"messages": [{"role": "user", "content": "Grüße aus Köln ☕"},
                             {"role": "assistant", "content": "Danke schön 😊"}]}


def good_line(rec=GOOD) -> bytes:
    return json.dumps(rec, ensure_ascii=False).encode("utf-8") + b"\n"


def bad_utf8_line() -> bytes:
    # A Latin-1 encoded line, as found in real dumps: 0xe9 alone is not UTF-8.
    return good_line({"messages": [{"role": "user", "content": "caf\u00e9?"},
                                   {"role": "assistant", "content": "oui"}]}).replace(b"\xc3\xa9", b"\xe9")


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
    # Bad bytes between items break the JSON itself: one malformed_json record, no traceback.
    f.write_bytes(b"[" + items[0] + b",\xff" + items[2] + b"]")
    assert reasons(f) == (Counter(malformed_json=1), [])


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


def test_stage01_counts_bad_bytes_and_strict_names_file_and_line(tmp_path, tiny_llama):
    f = tmp_path / "chats.jsonl.gz"
    body = good_line() * 4 + bad_utf8_line() + good_line(GOOD_UNICODE) * 2
    f.write_bytes(gzip.compress(body))
    cut = tmp_path / "cut.jsonl.gz"
    numbered = b"".join(good_line({"messages": [{"role": "user", "content": f"Is {i * 7919} prime?"},
                                                {"role": "assistant", "content": f"{i * 7919 % 97} ..."}]})
                        for i in range(200))
    packed = gzip.compress(numbered)
    cut.write_bytes(packed[: len(packed) // 2])
    m = prepare_dataset(PrepareConfig(work_dir=tmp_path / "w", target_model=str(tiny_llama),
                                      data=[str(f), str(cut)], eval_fraction=0.0, num_workers=1))
    assert m.counts["bad_records"] == {"invalid_utf8": 1, "truncated_gzip": 1}
    n_cut = sum(1 for r in iter_records(str(cut)) if not isinstance(r.record, BadRecord))
    assert 0 < n_cut < 200 and m.counts["train_samples"] == 6 + n_cut
    with pytest.raises(PipelineError, match=r"chats\.jsonl\.gz:5: bad record \(invalid_utf8: byte 0xe9"):
        prepare_dataset(PrepareConfig(work_dir=tmp_path / "w2", target_model=str(tiny_llama), data=[str(f)],
                                      strict=True, num_workers=1))
    assert not (tmp_path / "w2" / "01_dataset" / "manifest.json").exists()
