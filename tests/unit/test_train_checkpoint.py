"""Stage 04's checkpoint as a typed record (eagle3/artifacts/train_outputs.py `TrainCheckpoint`):
written by stage 04's `save_checkpoint`, read back by the one reader `read_checkpoint`
(memory-mapped, weights_only) equal field by field; a file that lacks a field, holds one
this code does not know, or is of a newer format is refused naming the file. No stage
runs; well under a second."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from fixtures import train_checkpoint

from eagle3.artifacts.train_outputs import CHECKPOINT_FORMAT, TrainCheckpoint, read_checkpoint
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train.checkpoint import latest_checkpoint, save_checkpoint


def sample() -> TrainCheckpoint:
    g = torch.Generator().manual_seed(0)
    return train_checkpoint(
        {"fc.weight": torch.randn(8, 12, generator=g), "d2t": torch.arange(4)}, {"hidden_size": 8},
        optimizer={"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 12, generator=g)}},
                   "param_groups": [{"lr": 1e-3, "params": [0]}]},
        scheduler={"last_epoch": 3}, step=3, epoch=1, batch_in_epoch=1,
        best={"expected_accept_length": 1.5, "step": 3, "metrics": {"expected_accept_length": 1.5}},
        eval={"expected_accept_length": 1.5})


def same(a, b) -> bool:
    """Equal values, tensors compared exactly (a round trip copies bytes, it computes nothing)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_checkpoint_comes_back_field_by_field(tmp_path):
    wd = WorkDir(tmp_path)
    ckpt = sample()
    path = save_checkpoint(wd, ckpt, keep=2, is_best=True)
    for back in (read_checkpoint(path), read_checkpoint(wd.best_checkpoint()), latest_checkpoint(wd, "x")):
        assert isinstance(back, TrainCheckpoint)
        for f in dataclasses.fields(TrainCheckpoint):
            assert same(getattr(back, f.name), getattr(ckpt, f.name)), f.name
    # On disk a plain dict of the fields and the format version (torch.load(weights_only=True) reads it).
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert set(raw) == {f.name for f in dataclasses.fields(TrainCheckpoint)} | {"format_version"}
    assert raw["format_version"] == CHECKPOINT_FORMAT == 1


def test_a_file_without_a_format_version_is_read_as_version_1(tmp_path):
    """What stage 04 wrote before the record existed: the same keys, no version."""
    raw = {f.name: getattr(sample(), f.name) for f in dataclasses.fields(TrainCheckpoint)}
    torch.save(raw, tmp_path / "step_00000003.pt")
    assert read_checkpoint(tmp_path / "step_00000003.pt").step == 3


def test_a_missing_field_is_refused_naming_the_file(tmp_path):
    raw = sample().to_file()
    del raw["aux_layers"]
    torch.save(raw, tmp_path / "step_00000003.pt")
    with pytest.raises(PipelineError, match=r"step_00000003\.pt is not a stage 04 checkpoint of this code: it lacks "
                                            r"\['aux_layers'\].*--force"):
        read_checkpoint(tmp_path / "step_00000003.pt")


def test_an_unknown_field_is_refused(tmp_path):
    torch.save({**sample().to_file(), "scaler": {}}, tmp_path / "c.pt")
    with pytest.raises(PipelineError, match=r"c\.pt .* holds unknown \['scaler'\]"):
        read_checkpoint(tmp_path / "c.pt")


def test_a_newer_format_is_refused(tmp_path):
    torch.save({**sample().to_file(), "format_version": CHECKPOINT_FORMAT + 1}, tmp_path / "c.pt")
    with pytest.raises(PipelineError, match=rf"c\.pt has checkpoint format {CHECKPOINT_FORMAT + 1}, this code reads "
                                            rf"{CHECKPOINT_FORMAT}"):
        read_checkpoint(tmp_path / "c.pt")


def test_not_a_checkpoint_and_no_file_are_refused(tmp_path):
    torch.save(torch.zeros(2), tmp_path / "t.pt")
    with pytest.raises(PipelineError, match=r"t\.pt is not a stage 04 checkpoint: it holds a Tensor"):
        read_checkpoint(tmp_path / "t.pt")
    with pytest.raises(PipelineError, match="missing.pt does not exist"):
        read_checkpoint(tmp_path / "missing.pt")
