"""Stage 03 on the tiny Llama: the mapping files and both coverages it records, and its refusals.
The selection and the mapping arithmetic alone: tests/unit/test_vocab_selection.py and
tests/unit/test_vocab_map.py."""
import numpy as np
import pytest
import torch
from fixtures import TEMPLATES, make_tokenizer

from eagle3.artifacts.manifest import read_manifest, read_record, record_of
from eagle3.artifacts.vocab_map import coverage
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s03_vocab.config import VocabConfig
from eagle3.stages.s03_vocab.run import build_vocab_mapping, select_draft_ids


def test_stage_writes_mapping_and_both_coverages(prepared_llama, tiny_llama):
    workdir = WorkDir(prepared_llama)
    m = build_vocab_mapping(VocabConfig(work_dir=prepared_llama, target_model=str(tiny_llama), draft_vocab_size=128))
    d2t, t2d = torch.load(workdir.d2t(), weights_only=True), torch.load(workdir.t2d(), weights_only=True)
    assert sorted(m.outputs) == ["d2t.pt", "t2d.pt"]  # one copy, read through vocab_map.load_mapping
    freq = {s: np.load(workdir.token_freq(s)) for s in ("train", "eval")}
    expect_ids = select_draft_ids(freq["train"], 128)
    assert torch.equal(d2t + torch.arange(128), torch.from_numpy(expect_ids))
    assert int(t2d.sum()) == 128 and t2d.shape[0] == read_record(workdir, "prepare", needed_by="t").vocab_size
    r = record_of(m)
    assert r.draft_vocab_size == 128 and r.target_vocab_size == 960
    assert r.coverage_train == pytest.approx(coverage(freq["train"], t2d.numpy()))
    assert r.coverage_eval == pytest.approx(coverage(freq["eval"], t2d.numpy()))
    assert r.coverage_eval < 1.0  # 128 of 360 seen ids cannot cover everything


def test_refuses_oversized_draft_vocab(prepared_llama):
    with pytest.raises(PipelineError, match=r"draft_vocab_size = 5000 is larger than the target vocab \(960"):
        build_vocab_mapping(VocabConfig(work_dir=prepared_llama, draft_vocab_size=5000))


def test_refuses_frequency_file_of_another_size(tmp_path, prepared_llama):
    import shutil

    workdir = WorkDir(tmp_path / "copy")
    shutil.copytree(prepared_llama / "01_dataset", workdir.stage_dir("prepare"))
    np.save(workdir.token_freq("train"), np.zeros(1000, dtype=np.int64))  # same bytes? no: size differs too
    with pytest.raises(PipelineError):
        build_vocab_mapping(VocabConfig(work_dir=workdir.root, draft_vocab_size=64))
    # a file of the right byte size but the wrong shape passes the manifest check and is caught by shape
    man = read_manifest(WorkDir(prepared_llama), "prepare", needed_by="t")
    good = np.load(WorkDir(prepared_llama).token_freq("train"))
    np.save(workdir.token_freq("train"), good.reshape(2, -1))
    import json
    d = json.loads(workdir.manifest("prepare").read_text())
    d["outputs"]["token_freq_train.npy"]["bytes"] = workdir.token_freq("train").stat().st_size
    workdir.manifest("prepare").write_text(json.dumps(d))
    with pytest.raises(PipelineError, match=r"token_freq_train\.npy has shape \(2, 480\), the target vocab is 960"):
        build_vocab_mapping(VocabConfig(work_dir=workdir.root, draft_vocab_size=64))
    assert record_of(man).vocab_size == 960


def test_refuses_stage01_from_another_tokenizer(tmp_path, prepared_llama):
    other = tmp_path / "other-target"
    make_tokenizer(TEMPLATES["chatml"]).save_pretrained(other)
    with pytest.raises(PipelineError, match=r"built with another tokenizer .* rerun `python 01_prepare_dataset.py"):
        build_vocab_mapping(VocabConfig(work_dir=prepared_llama, target_model=str(other), draft_vocab_size=64))


def test_refuses_missing_stage01(tmp_path):
    with pytest.raises(PipelineError, match=r"01_dataset/manifest.json, which does not exist: run `python 01_prepare_dataset.py"):
        build_vocab_mapping(VocabConfig(work_dir=tmp_path, draft_vocab_size=64))
