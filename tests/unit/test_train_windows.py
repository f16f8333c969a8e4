"""Stage 04 over windows (eagle3/stages/s04_train/windows.py): one step counter, known at step 0;
a resume under another process count maps by rounds; the checkpoint is the record of what is
trained (progress.json follows it, down too); nothing is deleted before the checkpoint is on
disk; every rank lets go of a round's files and checks its share of their checksums.
No stage runs; about a second."""
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fixtures import record_fsyncs_and_renames, train_checkpoint
from round_stores import MAIN, flip_a_byte, write_round

from eagle3.artifacts import store, windows
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train.checkpoint import save_checkpoint
from eagle3.stages.s04_train.data import Batching
from eagle3.stages.s04_train.windows import Rounds, RoundSchedule, mapped_files


def schedule(passes: int, epochs: int, trainable=None, world: int = 1) -> RoundSchedule:
    lengths = [(13 * i) % 90 + 10 for i in range(200)]
    plan = windows.make_plan(lengths, [20] * 5, disk_budget=1_500_000, seed=3, passes=passes, windows_in_budget=1,
                             spf=8, H=64, A=3, dtype="bf16")
    ok = np.ones(len(lengths), dtype=bool) if trainable is None else trainable
    return RoundSchedule(plan, lengths, ok, Batching(256, 128, seed=5), rank=0, world=world, grad_accum=1,
                         epochs=epochs)


def rounds_of(tmp_path: Path, sched, *, rank: int = 0, world: int = 1, main=None) -> Rounds:
    """Stage 04's view of the windows folder tmp_path/windows, as rank `rank` of `world`."""
    return Rounds(WorkDir(tmp_path), main, sched, windows_dir=str(tmp_path / "windows"), keep=False, wait_s=0,
                  rank=rank, world=world)


def checkpoint_at(sched: RoundSchedule, step: int, processes: int):
    """The record stage 04 saves at `step` of `sched`, written by `processes` processes."""
    return train_checkpoint({}, {}, step=step, **sched.position(step), rounds_trained=sched.rounds_done(step),
                            batch_geometry={"processes": processes, "grad_accum": 1, "batch_tokens": 256,
                                            "max_seq_len": 128, "packing": False})


def fake_round(wdir: Path, r: int) -> None:
    """A round's folder as far as deletion sees it (a name and a file)."""
    (wdir / windows.round_name(r)).mkdir(parents=True)
    (wdir / windows.round_name(r) / "train-00000.safetensors").write_bytes(b"x" * 10)


def test_rounds_follow_each_other_on_one_step_counter():
    s = schedule(passes=1, epochs=1)
    assert s.plan.rounds >= 3
    assert s.total == sum(s.steps) and s.starts == [sum(s.steps[:r]) for r in range(s.plan.rounds)]
    for r in range(s.plan.rounds):
        assert s.locate(s.starts[r]) == (r, 0) and s.locate(s.end(r) - 1) == (r, s.steps[r] - 1)
        assert s.rounds_done(s.end(r)) == r + 1 and s.rounds_done(s.end(r) - 1) == r
        seen = sorted(i for step in range(s.starts[r], s.end(r)) for b in s.micro_batches(step)[1] for i in b)
        assert seen == list(range(len(s.plan.window_of(r)["samples"])))  # one epoch: every sample once
    assert s.position(s.end(0)) == {"epoch": 0, "batch_in_epoch": s.steps[0]}


def test_passes_within_a_round_and_new_extractions_per_pass():
    one, within, again = schedule(1, 1), schedule(1, 2), schedule(2, 1)
    W = one.plan.num_windows
    assert sum(within.steps) >= 2 * sum(one.steps) - W  # two epochs per round (packing may differ by a row)
    assert again.plan.rounds == 2 * W and again.plan.window_of(W) == again.plan.window_of(0)
    # round W trains window 0 again, in another order than round 0
    first = [b for step in range(again.starts[0], again.end(0)) for b in again.micro_batches(step)[1]]
    second = [b for step in range(again.starts[W], again.end(W)) for b in again.micro_batches(step)[1]]
    assert sorted(i for b in first for i in b) == sorted(i for b in second for i in b) and first != second


def test_samples_without_a_loss_position_stay_out():
    keep = np.ones(200, dtype=bool)
    keep[::2] = False
    s = schedule(1, 1, keep)
    for r in range(s.plan.rounds):
        samples = s.plan.window_of(r)["samples"]
        seen = {i for step in range(s.starts[r], s.end(r)) for b in s.micro_batches(step)[1] for i in b}
        assert seen == {k for k, i in enumerate(samples) if keep[i]}


def test_another_process_count_resumes_a_round_end_checkpoint_at_the_next_rounds_start():
    """The issue's case: a checkpoint of 1 process at the end of round 1 (2 rounds trained),
    resumed by 2. Before, its step number was read in the 2-process schedule, where it lies
    past rounds never trained (they were deleted, the run ended "complete"); 2 -> 1 read it
    as a step inside round 0, whose folder was gone."""
    one, two = schedule(1, 1), schedule(1, 1, world=2)
    assert one.plan.rounds >= 3 and two.steps != one.steps  # steps per round scale with the count
    assert two.rounds_done(one.end(1)) > 2  # what the old resume took as trained
    assert two.resume_step(checkpoint_at(one, one.end(1), 1), Path("c.pt"), world=2) == two.starts[2]
    assert one.resume_step(checkpoint_at(two, two.end(0), 2), Path("c.pt"), world=1) == one.starts[1]
    last = one.plan.rounds - 1
    assert two.resume_step(checkpoint_at(one, one.end(last), 1), Path("c.pt"), world=2) == two.total
    mid = one.starts[1] + 1  # the same count: the step itself, mid-round too
    assert one.resume_step(checkpoint_at(one, mid, 1), Path("c.pt"), world=1) == mid
    assert two.resume_step(checkpoint_at(one, 0, 1), Path("c.pt"), world=2) == 0


def test_a_mid_round_checkpoint_under_another_count_is_refused_with_the_command_that_finishes_the_round():
    one, two = schedule(1, 1), schedule(1, 1, world=2)
    ckpt = checkpoint_at(one, one.starts[1] + 1, 1)
    with pytest.raises(PipelineError, match=rf"step-x\.pt was written by 1 process\(es\) in the middle of round 1 "
                                            rf"\(1 of its {one.steps[1]} steps done\); this run has 2.*"
                                            rf"--nproc-per-node 1 .*--stop-after {one.end(1)}.*--force"):
        two.resume_step(ckpt, Path("step-x.pt"), world=2)


def test_a_checkpoint_of_older_code_is_taken_as_this_counts_only_where_its_data_position_agrees():
    """A version 1 checkpoint records no process count and no rounds. Where this run's schedule
    puts its step where the checkpoint's data stood, the count was this one and the rounds are
    this schedule's; elsewhere counting rounds under this count could delete a round never
    trained, so the resume is refused naming the fix."""
    one, two = schedule(1, 1), schedule(1, 1, world=2)
    for step in (0, one.starts[1] + 1, one.end(1)):
        old = dataclasses.replace(checkpoint_at(one, step, 1), batch_geometry={}, rounds_trained=None)
        filled = one.fill_unrecorded(old, Path("c.pt"), world=1)
        assert (filled.rounds_trained, filled.batch_geometry) == (one.rounds_done(step), {"processes": 1})
        assert one.resume_step(filled, Path("c.pt"), world=1) == step
    old = dataclasses.replace(checkpoint_at(one, one.end(1), 1), batch_geometry={}, rounds_trained=None)
    with pytest.raises(PipelineError, match=r"c\.pt was written by older code that did not record its process "
                                            r"count.*--nproc-per-node N.*--force"):
        two.fill_unrecorded(old, Path("c.pt"), world=2)
    recorded = checkpoint_at(one, one.end(1), 1)
    assert two.fill_unrecorded(recorded, Path("c.pt"), world=2) is recorded  # version 2: as it is


def test_a_checkpoint_older_than_progress_json_rewrites_it_down_and_deletes_no_round_it_needs(tmp_path):
    """The newest checkpoint (4 rounds) was lost; the one resumed covers 2. Before, the start
    deleted rounds 2 and 3 (progress.json said trained) and stage 02 then refused to extract
    them again ("already trained"): only --force recovered."""
    s = schedule(2, 1)
    wdir = tmp_path / "windows"
    for r in (2, 3, 4):
        fake_round(wdir, r)
    windows.write_progress(wdir, 4, "step-0000099.pt", s.end(3))
    rounds_of(tmp_path, s).resumed(2, s.end(1), tmp_path / "step-0000042.pt")
    assert windows.present_rounds(wdir) == [2, 3, 4]
    assert windows.read_progress(wdir) == {"trained_rounds": 2, "checkpoint": "step-0000042.pt", "step": s.end(1)}


def test_a_start_from_scratch_or_a_torn_progress_json_is_rewritten_from_the_checkpoint(tmp_path):
    s = schedule(1, 1)
    wdir = tmp_path / "windows"
    fake_round(wdir, 0)
    windows.write_progress(wdir, 2, "step-0000099.pt", s.end(1))  # no checkpoint survived
    rounds_of(tmp_path, s).resumed(0, 0, None)
    assert windows.read_progress(wdir)["trained_rounds"] == 0 and windows.present_rounds(wdir) == [0]
    (wdir / windows.PROGRESS_JSON).write_text('{"trained_rou')  # torn
    rounds_of(tmp_path, s).resumed(1, s.end(0), tmp_path / "step-0000007.pt")
    assert windows.read_progress(wdir)["trained_rounds"] == 1 and windows.present_rounds(wdir) == []


def test_the_checkpoint_and_latest_json_are_on_disk_before_progress_and_before_a_round_is_deleted(tmp_path,
                                                                                                  monkeypatch):
    """Every fsync and rename, in order: the checkpoint file and latest.json are fsynced
    before their rename and their folder after it, all before progress.json is written, and
    progress.json (fsynced) before the round's folder is renamed away. Before, nothing was
    fsynced: on NFS the deletion was committed while the checkpoint sat in the page cache."""
    events = record_fsyncs_and_renames(monkeypatch)
    tmp_path = tmp_path.resolve()
    s = schedule(1, 1)
    workdir, wdir = WorkDir(tmp_path), tmp_path / "windows"
    fake_round(wdir, 0)
    path = save_checkpoint(workdir, checkpoint_at(s, s.end(0), 1), keep=2, is_best=False)
    rounds_of(tmp_path, s).covered(s.end(0), path)

    def at(event) -> int:
        assert event in events, (event, events)
        return events.index(event)

    progress, gone = wdir / windows.PROGRESS_JSON, wdir / f".deleting-{windows.round_name(0)}"
    for written in (path, workdir.latest_checkpoint(), progress):
        renamed = at(("rename", str(written)))
        flushed = [i for i, (kind, p) in enumerate(events) if kind == "fsync" and Path(p).name == written.name]
        assert flushed and flushed[0] < renamed, f"{written.name} renamed before its bytes were fsynced"
        assert ("fsync", str(written.parent)) in events[renamed:], f"{written.name}'s folder not fsynced after it"
    folder_after = lambda f: max(i for i, e in enumerate(events) if e == ("fsync", str(f.parent)))  # noqa: E731
    assert folder_after(workdir.latest_checkpoint()) < at(("rename", str(progress))) < at(("rename", str(gone)))
    assert not gone.exists() and windows.read_progress(wdir)["trained_rounds"] == 1


def test_each_rank_checks_the_checksums_of_its_share_of_a_rounds_files(tmp_path, monkeypatch):
    """Rank r of W reads files r, r + W, ...: the ranks read at once, and the collective after
    it waits for one share, not for rank 0 reading a whole window (~27 min for 1.8 TB at
    1.1 GB/s) past the group's timeout. A flipped byte (same size) is found by its reader."""
    d = write_round(tmp_path / "windows", 0, num_files=3)
    flip_a_byte(d / store.file_name("train", 1))
    read = []
    real = store.format.file_checksum
    monkeypatch.setattr(store.format, "file_checksum", lambda path, *a: read.append(Path(path).name) or real(path, *a))
    sched = SimpleNamespace(starts=[0], end=lambda r: 4)
    assert rounds_of(tmp_path, sched, rank=0, world=2, main=MAIN)._open(0)
    assert read == [store.file_name("train", 0), store.file_name("train", 2)]
    read.clear()
    with pytest.raises(PipelineError, match=r"round 0 is damaged \(.*train-00001.safetensors has checksum"):
        rounds_of(tmp_path, sched, rank=1, world=2, main=MAIN)._open(0)
    assert read == [store.file_name("train", 1)]
    with pytest.raises(PipelineError, match="round 0 is damaged"):  # one process reads them all
        rounds_of(tmp_path, sched, main=MAIN)._open(0)


def test_every_rank_lets_go_of_a_covered_rounds_files(tmp_path):
    """Before, only rank 0 dropped its reference (and the store and split, which reference each
    other, kept their mappings until a garbage collection); the other ranks kept theirs until
    the next round: on NFS the deletion left .nfs files and its folder could not be removed."""
    wdir = tmp_path / "windows"
    d = write_round(wdir, 0)
    sched = SimpleNamespace(starts=[0, 4], end=lambda r: 4 * (r + 1), rounds_done=lambda step: step // 4,
                            locate=lambda step: (step // 4, step % 4))
    other = rounds_of(tmp_path, sched, rank=1, world=2, main=MAIN)
    assert other.ensure(0)
    assert other.split[3].num_tokens > 0  # reading a sample maps its file
    assert mapped_files(d)
    other.covered(4, tmp_path / "step-0000004.pt")  # rank 1: lets go, rank 0 deletes
    assert mapped_files(d) == [] and other.split is None and other.current is None
    assert d.is_dir()  # not rank 1's to delete
