"""The typed records of eagle3/artifacts/records.py through the manifest's one writer and one reader
(eagle3/artifacts/manifest.py `write_manifest(record=...)`, `read_record`, `record_of`): every
record comes back equal and of its class; a manifest of the previous format, one without a
record, and a record with a field missing or unknown are refused naming the manifest and the
rerun. Manifests only, no stage runs; well under a second."""
from __future__ import annotations

import dataclasses
import json

import pytest

from eagle3.artifacts.manifest import FORMAT_VERSION, read_record, record_of, write_manifest
from eagle3.artifacts.records import (RECORDS, EvaluateRecord, ExportRecord, ExtractRecord, GenerateRecord,
                                      PrepareRecord, TrainRecord, VocabRecord)
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.core.stages import STAGE

# One record per stage, every field set to a value a real run could write (JSON types only).
SAMPLES = {
    "generate": GenerateRecord(
        target_model="/models/tiny", tokenizer_fingerprint="a" * 64, chat_template_kwargs={"thinking": False},
        stop_token_ids=[2, 7], complete=False, num_chunks=4, missing_chunks=1, missing_shard_indices=[1],
        conversations=10, turns_regenerated=12, new_turns=3, generated_tokens=900),
    "prepare": PrepareRecord(
        target_model="/models/tiny", tokenizer_fingerprint="a" * 64, vocab_size=960, chat_template_kwargs={},
        assistant_suffix=[5, 6], records=12, bad_records={"no_messages": 2}, samples={"train": 9, "eval": 1},
        tokens={"train": 900, "eval": 100}, assistant_tokens={"train": 400, "eval": 40}),
    "extract": ExtractRecord(
        target_model="/models/tiny", tokenizer_fingerprint="a" * 64, aux_layer_ids=[2, 4, 5], hidden_size=256,
        num_layers=8, vocab_size=960, store_dtype="fp8", complete=True, missing_files=0, missing_shard_indices=[]),
    "vocab": VocabRecord(tokenizer_fingerprint="a" * 64, target_vocab_size=960, draft_vocab_size=256,
                         coverage_train=0.99, coverage_eval=0.97),
    "train": TrainRecord(ttt_steps=3, aux_layer_ids=[2, 4, 5], steps=150, best_step=120,
                         best_expected_accept_length=1.7, best_eval={"full_acc_0": 0.5, "expected_accept_length": 1.7},
                         best_checkpoint="checkpoints/best.pt"),
    "export": ExportRecord(drafter_dir="/w/05_export", drafter_files={"config.json": "b" * 64}, aux_layer_ids=[2, 4, 5],
                           checkpoint_step=120, expected_accept_length=None),
    "evaluate": EvaluateRecord(drafter_dir="/w/05_export", target_model="/models/tiny"),
}


def write(workdir: WorkDir, stage: str, record) -> None:
    write_manifest(workdir, stage, params={}, inputs={}, counts={}, outputs=[], record=record)


def test_one_record_class_per_stage():
    assert set(RECORDS) == set(STAGE) == set(SAMPLES)
    assert all(type(SAMPLES[s]) is RECORDS[s] and RECORDS[s].STAGE == s for s in STAGE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SAMPLES["train"].ttt_steps = 7


@pytest.mark.parametrize("stage", list(STAGE))
def test_every_record_round_trips_through_the_manifest(tmp_path, stage):
    workdir = WorkDir(tmp_path)
    workdir.stage_dir(stage).mkdir(parents=True)
    write(workdir, stage, SAMPLES[stage])
    on_disk = json.loads(workdir.manifest(stage).read_text())
    assert on_disk["format_version"] == FORMAT_VERSION == 2
    assert on_disk["record"] == dataclasses.asdict(SAMPLES[stage])
    got = read_record(workdir, stage, needed_by="test")
    assert type(got) is RECORDS[stage] and got == SAMPLES[stage]


def test_the_writer_takes_only_the_stages_own_record(tmp_path):
    workdir = WorkDir(tmp_path)
    workdir.stage_dir("prepare").mkdir(parents=True)
    with pytest.raises(AssertionError):
        write(workdir, "prepare", SAMPLES["vocab"])


def test_a_manifest_of_the_previous_format_is_refused_naming_the_file_and_the_fix(tmp_path):
    workdir = WorkDir(tmp_path)
    workdir.stage_dir("extract").mkdir(parents=True)
    write(workdir, "extract", SAMPLES["extract"])
    old = json.loads(workdir.manifest("extract").read_text())
    old["format_version"] = 1
    old.pop("record")
    old["extra"] = {"aux_layers": [2, 4, 5]}  # where version 1 kept them
    workdir.manifest("extract").write_text(json.dumps(old))
    with pytest.raises(PipelineError) as e:
        read_record(workdir, "extract", needed_by="test")
    msg = str(e.value)
    assert str(workdir.manifest("extract")) in msg and "format version 1, this code reads 2" in msg
    assert f"{STAGE['extract'].script} --force" in msg


def test_a_manifest_without_a_record_is_refused(tmp_path):
    workdir = WorkDir(tmp_path)
    workdir.stage_dir("train").mkdir(parents=True)
    write(workdir, "train", None)
    with pytest.raises(PipelineError) as e:
        read_record(workdir, "train", needed_by="test")
    msg = str(e.value)
    assert str(workdir.manifest("train")) in msg and "no record section" in msg
    assert f"rerun `python {STAGE['train'].script} --force`" in msg


@pytest.mark.parametrize("change, said", [
    (lambda r: r.pop("ttt_steps"), "TrainRecord lacks ['ttt_steps']"),
    (lambda r: r.update(ttt_step=3), "TrainRecord holds unknown ['ttt_step']"),
])
def test_a_record_with_a_field_missing_or_unknown_is_refused_not_defaulted(tmp_path, change, said):
    workdir = WorkDir(tmp_path)
    workdir.stage_dir("train").mkdir(parents=True)
    write(workdir, "train", SAMPLES["train"])
    m = json.loads(workdir.manifest("train").read_text())
    change(m["record"])
    workdir.manifest("train").write_text(json.dumps(m))
    with pytest.raises(PipelineError) as e:
        read_record(workdir, "train", needed_by="test")
    msg = str(e.value)
    assert str(workdir.manifest("train")) in msg and said in msg
    assert f"rerun `python {STAGE['train'].script} --force`" in msg


def test_record_of_reads_a_manifest_already_in_hand(tmp_path):
    workdir = WorkDir(tmp_path)
    workdir.stage_dir("vocab").mkdir(parents=True)
    m = write_manifest(workdir, "vocab", params={}, inputs={}, counts={"padded_ids": 0}, outputs=[],
                       record=SAMPLES["vocab"])
    assert record_of(m) == SAMPLES["vocab"] and m.counts == {"padded_ids": 0}
