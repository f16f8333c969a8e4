"""Stage 01 end to end on small files: records, bad-record accounting, split, outputs."""
import json

import numpy as np
import pytest
from fixtures import DEMO_CHATS, numbered

from eagle3.artifacts.manifest import read_manifest, record_of
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s01_prepare.config import PrepareConfig
from eagle3.stages.s01_prepare.run import is_eval, prepare_dataset
from eagle3.target.chats import BadRecord, normalize

GOOD_OPENAI = {"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "What is the capital of France?"},
                            {"role": "assistant", "content": "The capital of France is Paris."}]}
GOOD_SHAREGPT = {"conversations": [{"from": "human", "value": "Count from 1 to 3."},
                                   {"from": "gpt", "value": "Sure, here is the count: 1, 2, 3."},
                                   {"from": "human", "value": "Thanks!"},
                                   {"from": "gpt", "value": "You are welcome."}]}
BAD = {
    "unknown_role": {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
    "empty_content": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
    "no_assistant_turn": {"messages": [{"role": "user", "content": "hi"}]},
    "non_alternating": {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                     {"role": "assistant", "content": "c"}]},
    "no_messages": {"text": "plain"},
}


def write_jsonl(path, records, raw_lines=()):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return path


def test_normalize_both_shapes_and_trailing_user_turn():
    msgs, trimmed = normalize(GOOD_SHAREGPT)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"] and not trimmed
    rec = {"messages": GOOD_OPENAI["messages"] + [{"role": "user", "content": "And Spain?"}]}
    msgs, trimmed = normalize(rec)
    assert trimmed and msgs[-1]["role"] == "assistant" and len(msgs) == 3
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "you"}]},
                          {"role": "assistant", "content": "Hello."}]}
    assert normalize(parts)[0][0]["content"] == "Hi you"


@pytest.mark.parametrize("reason", sorted(BAD))
def test_normalize_reasons(reason):
    with pytest.raises(BadRecord) as e:
        normalize(BAD[reason])
    assert e.value.reason == reason


def test_bad_records_are_counted_by_reason(tmp_path, tiny_llama):
    chats = [numbered(r, i) for i in range(5) for r in (GOOD_OPENAI, GOOD_SHAREGPT)]
    data = write_jsonl(tmp_path / "chats.jsonl", chats + list(BAD.values()),
                       raw_lines=["{not json"])
    workdir = tmp_path / "w"
    m = prepare_dataset(PrepareConfig(work_dir=workdir, target_model=str(tiny_llama), data=[str(data)],
                                      eval_fraction=0.0, num_workers=1))
    rec = record_of(m)
    assert rec.bad_records == {**{r: 1 for r in BAD}, "malformed_json": 1}
    assert rec.samples == {"train": 10, "eval": 0}
    assert rec.records == 10 + len(BAD) + 1


def test_strict_stops_at_first_bad_record_naming_file_and_line(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "chats.jsonl", [numbered(GOOD_OPENAI, 1), numbered(GOOD_OPENAI, 2),
                                                  BAD["unknown_role"], numbered(GOOD_OPENAI, 3)])
    with pytest.raises(PipelineError, match=r"chats\.jsonl:3: bad record \(unknown_role"):
        prepare_dataset(PrepareConfig(work_dir=tmp_path / "w", target_model=str(tiny_llama), data=[str(data)],
                                      strict=True, num_workers=1))
    assert not (tmp_path / "w" / "01_dataset" / "manifest.json").exists()


def test_outputs_split_frequencies_and_rerun(prepared_llama, tiny_llama, caplog):
    import datasets

    workdir = WorkDir(prepared_llama)
    m = read_manifest(workdir, "prepare", needed_by="test")
    r = record_of(m)
    train, evals = datasets.load_from_disk(str(workdir.dataset("train"))), datasets.load_from_disk(str(workdir.dataset("eval")))
    assert len(train) == r.samples["train"] and len(evals) == r.samples["eval"]
    # The demo's 400 chats hold a few exact copies (the same messages): each is dropped, counted.
    distinct = {json.dumps(normalize(json.loads(line))[0]) for line in DEMO_CHATS.read_text().splitlines()}
    assert r.records == 400 and r.bad_records == {"duplicate": 400 - len(distinct)}
    assert r.samples["train"] + r.samples["eval"] == len(distinct)
    assert 20 <= len(evals) <= 60  # ~10% of 400, by hash
    assert not set(train["sample_id"]) & set(evals["sample_id"])
    assert all(is_eval(s, 0, 0.1) for s in evals["sample_id"])
    # the split is by conversation and independent of order: recompute from ids
    assert not any(is_eval(s, 0, 0.1) for s in train["sample_id"])
    freq = np.load(workdir.token_freq("train"))
    expect = np.zeros_like(freq)
    for row in train.with_format("numpy"):
        ids, mask = row["input_ids"], row["loss_mask"].astype(bool)
        assert len(ids) == len(mask) == row["num_tokens"] <= 512
        np.add.at(expect, ids[mask], 1)
    assert np.array_equal(freq, expect) and freq.sum() == r.assistant_tokens["train"]
    assert freq.shape == (r.vocab_size,)

    # same inputs: nothing to do, manifest untouched
    before = workdir.manifest("prepare").read_text()
    with caplog.at_level("INFO"):
        prepare_dataset(PrepareConfig(work_dir=prepared_llama, target_model=str(tiny_llama),
                                      data=m.params["data"], max_length=512, eval_fraction=0.1, num_workers=1))
    assert "already complete" in caplog.text
    assert workdir.manifest("prepare").read_text() == before


def test_truncation_and_changed_params_redo(tmp_path, tiny_llama):
    data = write_jsonl(tmp_path / "c.jsonl", [numbered(GOOD_SHAREGPT, i) for i in range(3)])
    cfg = dict(work_dir=tmp_path / "w", target_model=str(tiny_llama), data=[str(data)], eval_fraction=0.0,
               num_workers=1)
    full = prepare_dataset(PrepareConfig(**cfg, max_length=4096))
    short = prepare_dataset(PrepareConfig(**cfg, max_length=24))  # other params: redone, not skipped
    assert full.counts["truncated"] == 0 and short.counts["truncated"] == 3
    assert record_of(short).tokens["train"] == 3 * 24 < record_of(full).tokens["train"]


def test_data_generated_needs_a_complete_stage00_and_cannot_be_mixed(tmp_path, tiny_llama):
    with pytest.raises(PipelineError, match="00_generate_responses.py"):  # stage 00 never ran here
        prepare_dataset(PrepareConfig(work_dir=tmp_path, target_model=str(tiny_llama), data=["generated"],
                                      num_workers=1))
    with pytest.raises(PipelineError, match="cannot be mixed"):
        prepare_dataset(PrepareConfig(work_dir=tmp_path, target_model=str(tiny_llama),
                                      data=["generated", "chats.jsonl"], num_workers=1))


def test_no_training_sample_is_one_line_with_the_counts_and_the_fix(tmp_path, tiny_llama):
    prompts = [{"messages": [{"role": "user", "content": f"Hi, how are you doing {i}?"}]} for i in range(30)]
    data = write_jsonl(tmp_path / "prompts.jsonl", prompts + [BAD["unknown_role"]], raw_lines=["{not json"])
    cfg = dict(work_dir=tmp_path / "w", target_model=str(tiny_llama), num_workers=1)
    with pytest.raises(PipelineError) as e:
        prepare_dataset(PrepareConfig(**cfg, data=[str(data)]))
    msg = str(e.value)
    assert "\n" not in msg and str(data) in msg and "32 records, 0 usable" in msg
    assert "no_assistant_turn 30, malformed_json 1, unknown_role 1" in msg
    assert "these are prompts" in msg and "00_generate_responses.py" in msg  # the most common reason's fix
    assert not (tmp_path / "w" / "01_dataset" / "manifest.json").exists()
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(PipelineError, match=r"0 records, 0 usable.*the input holds no record: check --data"):
        prepare_dataset(PrepareConfig(**cfg, data=[str(empty)]))
    # Usable samples that all fall in the held-out split are not a training set either.
    seed = next(s for s in range(100) if is_eval("one.jsonl:1", s, 0.5))
    one = write_jsonl(tmp_path / "one.jsonl", [GOOD_OPENAI])
    with pytest.raises(PipelineError, match=r"1 records, 1 usable.*every usable sample fell in the held-out split "
                                            r"\(--eval-fraction 0.5\)"):
        prepare_dataset(PrepareConfig(**cfg, data=[str(one)], eval_fraction=0.5, seed=seed))


def test_dropping_most_records_warns_with_the_counts(tmp_path, tiny_llama, caplog):
    data = write_jsonl(tmp_path / "mixed.jsonl", [numbered(GOOD_OPENAI, i) for i in range(2)] + [{"prompt": "Hi"}] * 3)
    with caplog.at_level("WARNING"):
        m = prepare_dataset(PrepareConfig(work_dir=tmp_path / "w", target_model=str(tiny_llama), data=[str(data)],
                                          eval_fraction=0.0, num_workers=1))
    assert record_of(m).samples["train"] == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "only 2 of 5 records" in line and "no_assistant_turn 3" in line and "00_generate_responses.py" in line


def test_exact_duplicates_are_dropped_before_the_split_and_counted(tmp_path, tiny_llama):
    """20 copies of one chat used to land on both sides of the split (17 train, 3 held out),
    which inflates every held-out figure; now the first copy is kept and the rest counted."""
    chat = numbered(GOOD_OPENAI, 0)
    sharegpt_copy = {"conversations": [{"from": "system", "value": "Be brief."},
                                       {"from": "human", "value": chat["messages"][1]["content"]},
                                       {"from": "gpt", "value": chat["messages"][2]["content"]}]}
    asked_again = {"messages": chat["messages"] + [{"role": "user", "content": "And Spain?"}]}  # trimmed: the same
    spaced = {"messages": chat["messages"][:2] + [{"role": "assistant",
                                                   "content": "The capital of France is  Paris. (0)"}]}
    others = [numbered(GOOD_SHAREGPT, i) for i in range(6)]
    first = write_jsonl(tmp_path / "chats.jsonl", [chat] * 20 + others + [sharegpt_copy, asked_again, spaced])
    second = write_jsonl(tmp_path / "more.jsonl", [others[2], numbered(GOOD_SHAREGPT, 6)])
    seed = next(s for s in range(100) if len({is_eval(f"chats.jsonl:{i}", s, 0.5) for i in range(1, 21)}) == 2)
    m = prepare_dataset(PrepareConfig(work_dir=tmp_path / "w", target_model=str(tiny_llama),
                                      data=[str(first), str(second)], eval_fraction=0.5, seed=seed, num_workers=1))
    rec = record_of(m)
    assert rec.records == 31 and rec.bad_records == {"duplicate": 19 + 2 + 1}
    kept = {s for name in ("train", "eval") for s in load_ids(WorkDir(tmp_path / "w").dataset(name))}
    # the first copy of each conversation, wherever the split put it; a changed space is another chat
    assert kept == {"chats.jsonl:1", *(f"chats.jsonl:{21 + i}" for i in range(6)), "chats.jsonl:29", "more.jsonl:2"}
    assert rec.samples["train"] + rec.samples["eval"] == len(kept)

    # --strict stops at the first copy, naming it and the record it repeats
    with pytest.raises(PipelineError, match=r"chats\.jsonl:2: bad record \(duplicate: the same conversation as "
                                            r"\S*chats\.jsonl:1\); fix or remove it"):
        prepare_dataset(PrepareConfig(work_dir=tmp_path / "w2", target_model=str(tiny_llama), data=[str(first)],
                                      strict=True, num_workers=1))


def load_ids(path) -> list[str]:
    import datasets

    return datasets.load_from_disk(str(path))["sample_id"]


def test_stage00_answers_a_duplicate_once_and_stage01_counts_it(tmp_path, tiny_llama):
    from eagle3.stages.s00_generate.config import GenerateConfig
    from eagle3.stages.s00_generate.conversation import Generation
    from eagle3.stages.s00_generate.run import generate_responses

    class Echo:  # a scripted engine: the same short answer to every prompt
        max_model_len = 4096

        def __init__(self):
            self.prompts = 0

        def set_sampling(self, temperature, top_p, stop_ids):
            self.stop = stop_ids[0]

        def generate(self, requests):
            self.prompts += len(requests)
            return [Generation([5, 6, 7, self.stop], "stop") for _ in requests]

    prompts = [{"prompt": f"Name a colour ({i})."} for i in range(4)]
    data = write_jsonl(tmp_path / "prompts.jsonl", prompts + [prompts[1]] * 3 + [{"messages": [
        {"role": "user", "content": "Name a colour (2)."}]}])  # the same turns in another shape
    engine = Echo()
    m0 = generate_responses(GenerateConfig(work_dir=tmp_path / "w", target_model=str(tiny_llama), data=[str(data)],
                                           max_new_tokens=8), engine=engine)
    assert engine.prompts == 4 and record_of(m0).conversations == 4
    assert m0.counts["bad_records"] == {"duplicate": 4}
    lines = [json.loads(x) for x in WorkDir(tmp_path / "w").generate_chunk(0).read_text().splitlines()]
    assert [ln.get("bad") for ln in lines] == [None] * 4 + ["duplicate"] * 4
    assert lines[4]["detail"].endswith("prompts.jsonl:2") and lines[7]["detail"].endswith("prompts.jsonl:3")
    # stage 01 reads the duplicates' lines as duplicates; the 4 answered prompts differ, so all stay
    m1 = prepare_dataset(PrepareConfig(work_dir=tmp_path / "w", target_model=str(tiny_llama), data=["generated"],
                                       eval_fraction=0.0, num_workers=1))
    assert record_of(m1).bad_records == {"duplicate": 4} and record_of(m1).samples["train"] == 4
