"""Stage 02 never shares a folder with another writer, and --force removes only what it owns
(eagle3/artifacts/claims.py, eagle3/stages/s02_extract/{run,windowed}.py).

Each run here must stop, or finish, before a model loads (`no_model_load`): the claims are
taken and --force's deletions done before any byte is written. Two real producers on one
round: tests/e2e/test_windows.py.
"""
from __future__ import annotations

import json

import pytest
from fixtures import copy_stages

from eagle3.artifacts import windows
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.run import extract_hidden_states

CLAIM_JSON = ".claim.json"


@pytest.fixture(scope="module")
def prepared(stage_runs, tiny_llama):
    """Stage 01 on 40 demo chats (the same work dir tests/stages/test_extract.py builds)."""
    return stage_runs(tiny_llama, upto="prepare", chats=40, prepare=dict(max_length=512, eval_fraction=0.2))


def cfg_for(work, target, **kw) -> ExtractConfig:
    return ExtractConfig(**{"work_dir": work, "target_model": str(target), "backend": "hf", "samples_per_file": 4,
                            **kw})


def claim_of_another_box(folder, what="stage 02, shard 0 of 1"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CLAIM_JSON).write_text(json.dumps({
        "host": "other-box", "pid": 4242, "token": "0123456789abcdef", "what": what,
        "started": "2026-12-01T00:00:00Z"}))


def test_a_second_run_on_a_store_folder_is_refused_naming_the_first(prepared, tiny_llama, tmp_path, no_model_load):
    work = copy_stages(prepared, tmp_path / "work", ("prepare",))
    d = WorkDir(work).store()
    claim_of_another_box(d)
    with pytest.raises(PipelineError, match=r"02_hidden_states is claimed by other-box:4242 .*stage 02, shard 0 of 1"):
        extract_hidden_states(cfg_for(work, tiny_llama))
    with pytest.raises(PipelineError, match="claimed by other-box:4242"):  # nor deleted with --force
        extract_hidden_states(cfg_for(work, tiny_llama, force=True))
    assert sorted(p.name for p in d.iterdir()) == [CLAIM_JSON]  # nothing written, nothing deleted


def windowed_cfg(work, target, shared, **kw) -> ExtractConfig:
    # Two extraction passes over one window: rounds 0 and 1, whatever the split's size.
    return cfg_for(work, target, disk_budget="1GB", extraction_passes=2, windows_dir=str(shared), num_shards=2,
                   shard_index=1, **kw)


def test_a_round_claimed_by_another_box_is_refused_naming_it(prepared, tiny_llama, tmp_path, no_model_load):
    """The recovery `--window 1` run while another box writes round 1."""
    work = copy_stages(prepared, tmp_path / "work", ("prepare",))
    shared = tmp_path / "shared"
    claim_of_another_box(shared / windows.round_name(1), "stage 02, round 1 (shard 1 of 2)")
    with pytest.raises(PipelineError, match=r"window-00001 is claimed by other-box:4242 .*round 1 \(shard 1 of 2\)"):
        extract_hidden_states(windowed_cfg(work, tiny_llama, shared, window=1))
    assert sorted(p.name for p in (shared / windows.round_name(1)).iterdir()) == [CLAIM_JSON]


def test_force_with_a_windows_dir_removes_only_this_shards_rounds(prepared, tiny_llama, tmp_path, no_model_load):
    work = copy_stages(prepared, tmp_path / "work", ("prepare",))
    shared = tmp_path / "shared"
    theirs, mine = shared / windows.round_name(0), shared / windows.round_name(1)
    theirs.mkdir(parents=True)
    (theirs / "train-00000.safetensors").write_bytes(b"shard 0's")
    windows.write_complete(theirs, {"round": 0, "files": []})
    mine.mkdir()
    (mine / ".train-00000.partial-box-b-77").write_bytes(b"a killed run's")
    windows.write_progress(shared, 2, "step-40", 40)  # stage 04's: both rounds trained
    (shared / "README.txt").write_text("the team's notes")
    try:
        extract_hidden_states(windowed_cfg(work, tiny_llama, shared, force=True, produce=True))
    finally:  # checked even when the run went on to extract (older code: it deleted the folder first)
        assert sorted(p.name for p in shared.iterdir()) == ["README.txt", windows.PROGRESS_JSON, theirs.name]
    assert (theirs / "train-00000.safetensors").read_bytes() == b"shard 0's"
    assert windows.read_progress(shared)["trained_rounds"] == 2


def test_force_refuses_a_round_folder_holding_other_files(prepared, tiny_llama, tmp_path, no_model_load):
    """A mistyped --windows-dir (a share's root) whose folder happens to be named like a round."""
    work = copy_stages(prepared, tmp_path / "work", ("prepare",))
    share = tmp_path / "share"
    (share / "projects").mkdir(parents=True)
    (share / "projects" / "plan.txt").write_text("keep")
    (share / windows.round_name(1)).mkdir()
    (share / windows.round_name(1) / "thesis.pdf").write_bytes(b"keep too")
    try:
        with pytest.raises(PipelineError, match=r"holds \['thesis.pdf'\], which are not a round's files"):
            extract_hidden_states(windowed_cfg(work, tiny_llama, share, force=True, produce=True))
    finally:  # checked even when the run went on (older code: it deleted the share first)
        assert sorted(p.name for p in share.iterdir()) == ["projects", windows.round_name(1)]
    assert (share / "projects" / "plan.txt").read_text() == "keep"
    assert (share / windows.round_name(1) / "thesis.pdf").read_bytes() == b"keep too"
