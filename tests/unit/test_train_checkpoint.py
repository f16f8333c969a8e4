"""Stage 04's checkpoint as a typed record (eagle3/artifacts/train_outputs.py `TrainCheckpoint`):
written by stage 04's `save_checkpoint`, read back by the one reader `read_checkpoint`
(memory-mapped, weights_only) equal field by field; a file that lacks a field, holds one
this code does not know, or is of a newer format is refused naming the file. No stage
runs; well under a second."""
from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch
from fixtures import train_checkpoint

from eagle3.artifacts.train_outputs import CHECKPOINT_FORMAT, TrainCheckpoint, read_checkpoint
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train.checkpoint import checkpoints_to_prune, latest_checkpoint, save_checkpoint


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
    workdir = WorkDir(tmp_path)
    ckpt = sample()
    path = save_checkpoint(workdir, ckpt, keep=2, is_best=True)
    for back in (read_checkpoint(path), read_checkpoint(workdir.best_checkpoint()), latest_checkpoint(workdir, "x")):
        assert isinstance(back, TrainCheckpoint)
        for f in dataclasses.fields(TrainCheckpoint):
            assert same(getattr(back, f.name), getattr(ckpt, f.name)), f.name
    # On disk a plain dict of the fields and the format version (torch.load(weights_only=True) reads it).
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert set(raw) == {f.name for f in dataclasses.fields(TrainCheckpoint)} | {"format_version"}
    assert raw["format_version"] == CHECKPOINT_FORMAT == 2


def test_a_file_without_a_format_version_is_read_as_version_1_with_its_new_fields_not_recorded(tmp_path):
    """What stage 04 wrote before the record had a version: the version 1 keys. An upgrade must
    not throw weeks of training away: the file is read, the process count and the rounds it
    never recorded come back as `{}` and None (stage 04's resume fills them in or refuses:
    tests/unit/test_train_windows.py), and export reads neither."""
    raw = {f.name: getattr(sample(), f.name) for f in dataclasses.fields(TrainCheckpoint)
           if f.name not in ("batch_geometry", "rounds_trained")}
    torch.save(raw, tmp_path / "step_00000003.pt")
    back = read_checkpoint(tmp_path / "step_00000003.pt")
    assert back.batch_geometry == {} and back.rounds_trained is None
    assert back.step == sample().step and same(back.model, sample().model)
    torch.save({**raw, "rounds_trained": 2}, tmp_path / "half.pt")  # one of version 2's fields: not version 1
    with pytest.raises(PipelineError, match=r"half\.pt has checkpoint format 1, this code reads 2"):
        read_checkpoint(tmp_path / "half.pt")


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


def saved_steps(workdir: WorkDir, steps, identity: str = "x") -> None:
    for step in steps:
        save_checkpoint(workdir, dataclasses.replace(sample(), step=step, identity=identity), keep=3, is_best=False)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_newest_readable_one_and_says_which_it_skipped(tmp_path,
                                                                                                     caplog):
    """Before, a truncated step-0000004.pt stopped the resume ("delete it"); deleted, latest.json
    named a missing file ("pass --force"): the intact step-0000003.pt was never tried."""
    workdir = WorkDir(tmp_path)
    saved_steps(workdir, [2, 3, 4])
    newest = workdir.checkpoint(4)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a power loss, a full disk
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(workdir, "x").step == 3
    assert f"resuming from {workdir.checkpoint(3)}" in caplog.text
    assert f"skipped: {newest} (cannot read checkpoint" in caplog.text
    newest.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(workdir, "x").step == 3
    assert f"skipped: {newest} (missing)" in caplog.text


def test_a_torn_latest_json_scans_the_checkpoints(tmp_path, caplog):
    """Before: a bare JSONDecodeError traceback."""
    workdir = WorkDir(tmp_path)
    saved_steps(workdir, [3, 4])
    pointer = workdir.latest_checkpoint()
    pointer.write_text(pointer.read_text()[:9])
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(workdir, "x").step == 4
    assert f"skipped: {pointer} (unreadable: JSONDecodeError" in caplog.text


def test_no_readable_checkpoint_is_an_error_naming_each_file_and_no_checkpoint_is_a_fresh_start(tmp_path):
    workdir = WorkDir(tmp_path)
    assert latest_checkpoint(workdir, "x") is None
    saved_steps(workdir, [3])
    workdir.checkpoint(3).write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(PipelineError, match=rf"no checkpoint in {workdir.checkpoints()} can be read: "
                                            rf"{workdir.checkpoint(3)} \(cannot read checkpoint.*--force"):
        latest_checkpoint(workdir, "x")


def test_a_checkpoint_of_another_run_is_refused_not_skipped(tmp_path):
    workdir = WorkDir(tmp_path)
    saved_steps(workdir, [3, 4], identity="another run")
    with pytest.raises(PipelineError, match=rf"{workdir.checkpoint(4)} belongs to a run with other parameters or inputs "
                                            r"\(identity another run, this run x\); pass --force"):
        latest_checkpoint(workdir, "x")
    workdir.latest_checkpoint().write_text("{")  # a torn pointer: the scan refuses it too
    with pytest.raises(PipelineError, match=r"step-0000004\.pt belongs to a run with other parameters"):
        latest_checkpoint(workdir, "x")


class RunsCode:
    """Unpickled, calls os.mkdir(path): what a checkpoint from elsewhere could do instead."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_checkpoint_that_unpickles_code_is_refused_before_running_it(tmp_path):
    """read_checkpoint loads with weights_only=True: tensors and plain containers only."""
    ran = tmp_path / "ran"
    import torch

    torch.save({**sample().to_file(), "eval": RunsCode(ran)}, tmp_path / "c.pt")
    with pytest.raises(PipelineError, match=r"cannot read checkpoint .*c\.pt with torch\.load\(weights_only=True"):
        read_checkpoint(tmp_path / "c.pt")
    assert not ran.exists()


def test_a_save_keeps_its_own_file_after_a_resume_that_renumbered_the_steps(tmp_path):
    """A resume under another process count goes on at a lower step number (1 -> 2 processes):
    pruning by step number alone deleted the checkpoint just written, which latest.json names.
    Files above the saved step are superseded by it."""
    workdir = WorkDir(tmp_path)
    saved_steps(workdir, [24, 25])  # written by 1 process
    save_checkpoint(workdir, dataclasses.replace(sample(), step=13), keep=2, is_best=False)  # 2 processes, round start
    assert sorted(p.name for p in workdir.checkpoints().glob("step-*.pt")) == [workdir.checkpoint(13).name]
    assert latest_checkpoint(workdir, "x").step == 13
    save_checkpoint(workdir, dataclasses.replace(sample(), step=14), keep=2, is_best=False)
    save_checkpoint(workdir, dataclasses.replace(sample(), step=15), keep=2, is_best=False)
    assert sorted(p.name for p in workdir.checkpoints().glob("step-*.pt")) == [workdir.checkpoint(14).name,
                                                                          workdir.checkpoint(15).name]


def _rule_before_keep_evaluated(steps, current, keep):
    """save_checkpoint's pruning before --keep-evaluated existed, as it was written then."""
    if keep <= 0:
        return []
    older = [s for s in sorted(steps) if s < current]
    return older[:max(0, len(older) - (keep - 1))] + [s for s in sorted(steps) if s > current]


def test_keep_evaluated_1_prunes_exactly_what_stage_04_pruned_before_it():
    """The default (1) must leave a run's folder as it was: the same files deleted, whatever
    is marked evaluated, over every small folder."""
    import itertools
    pool = [1, 2, 3, 5, 8]
    for n in range(len(pool) + 1):
        for steps in itertools.combinations(pool, n):
            for current in steps or (4,):
                for keep in (-1, 0, 1, 2, 3):
                    expected = _rule_before_keep_evaluated(steps, current, keep)
                    # the written step evaluated or not (stage 04 saves steps between evaluations too)
                    for evaluated in (set(steps), set(steps) - {current}):
                        got = checkpoints_to_prune(list(steps), current, keep=keep, evaluated=evaluated,
                                                   keep_evaluated=1)
                        assert got == expected, (steps, current, keep, evaluated)


def test_keep_evaluated_spares_the_newest_evaluated_and_never_the_resume_point():
    # steps 100..500 on disk, 500 just written (the resume point) and not evaluated
    steps, evaluated = [100, 200, 300, 400, 500], {100, 200, 300, 400}
    assert checkpoints_to_prune(steps, 500, keep=1, evaluated=evaluated, keep_evaluated=3) == [100]
    # evaluated ones count toward N at or below the written step only; newer files always go
    assert checkpoints_to_prune(steps + [600], 500, keep=1, evaluated=evaluated | {600},
                                keep_evaluated=2) == [100, 200, 600]
    # the written step is never pruned, however small keep and N are
    for keep, n in ((1, 2), (2, 5), (1, 1)):
        assert 500 not in checkpoints_to_prune(steps, 500, keep=keep, evaluated=evaluated, keep_evaluated=n)


def test_save_checkpoint_keeps_the_last_n_evaluated_files_and_best(tmp_path):
    """Saves as stage 04 makes them under --keep-evaluated 3 --keep-checkpoints 1: every
    evaluation (held-out metrics in the file) and a save_every step between (none)."""
    workdir = WorkDir(tmp_path)
    for step, evaluated in ((10, True), (15, False), (20, True), (30, True), (35, False), (40, True)):
        ckpt = dataclasses.replace(sample(), step=step, eval={"expected_accept_length": 1.0 + step / 100}
                                   if evaluated else {})
        save_checkpoint(workdir, ckpt, keep=1, is_best=step == 20, keep_evaluated=3)
    names = sorted(p.name for p in workdir.checkpoints().glob("*.pt"))
    assert names == sorted(["best.pt"] + [workdir.checkpoint(s).name for s in (20, 30, 40)])
    assert read_checkpoint(workdir.best_checkpoint()).step == 20
    assert latest_checkpoint(workdir, "x").step == 40
