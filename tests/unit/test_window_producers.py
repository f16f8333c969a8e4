"""Producers and waiters of windows without an engine: stage 02's rounds to do and its budget
(eagle3/stages/s02_extract/windowed.py), what stage 04 logs while it waits for a round
(eagle3/stages/s04_train/windows.py) and the window loop's freshness check
(eagle3/tools/window_loop.py). The same runs with processes: tests/e2e/test_windows.py."""
import json
import logging
import os
import threading
from types import SimpleNamespace

import pytest
import yaml

from eagle3.artifacts import windows
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s02_extract import windowed
from eagle3.stages.s04_train.windows import Rounds
from eagle3.tools import window_loop

H, A, SPF = 64, 3, 4
CLAIM_JSON = ".claim.json"  # eagle3/artifacts/claims.py's; spelled out so this file runs against older code too


def plan_of(windows_in_budget: int = 1, samples: int = 64) -> windows.WindowPlan:
    """A plan whose budget holds the held-out split and `windows_in_budget` windows, never one more."""
    probe = windows.make_plan([100] * 8, [100] * 4, disk_budget=10 ** 9, seed=0, passes=1, windows_in_budget=1,
                              spf=SPF, H=H, A=A, dtype="bf16")
    held, eight = probe.held_out_bytes, probe.windows[0]["bytes"]  # the held-out split; a window of 8 samples
    plan = windows.make_plan([100] * samples, [100] * 4, disk_budget=held + windows_in_budget * (eight + eight // 2),
                             seed=0, passes=1, windows_in_budget=windows_in_budget, spf=SPF, H=H, A=A, dtype="bf16")
    sizes = sorted(w["bytes"] for w in plan.windows)
    assert plan.held_out_bytes == held
    assert held + sum(sizes[-windows_in_budget:]) <= plan.disk_budget < held + sum(sizes[:windows_in_budget + 1])
    return plan


def producer(**kw) -> SimpleNamespace:
    """The fields of stage 02's config these functions read."""
    return SimpleNamespace(**{"wait_s": 0.0, "take_over_stale_s": None, "num_shards": 1, "shard_index": 0,
                              "window": None, "produce": True, **kw})


def complete_round(wdir, r: int) -> None:
    d = wdir / windows.round_name(r)
    d.mkdir(parents=True, exist_ok=True)
    windows.write_complete(d, {"round": r, "files": []})


# --------------------------------------------------------------------------- what a producer writes


def test_a_producer_starts_at_the_next_untrained_round_of_its_shard(tmp_path):
    plan = plan_of()
    assert plan.rounds >= 5
    windows.write_progress(tmp_path, 2, "step-10", 10)
    assert windowed.rounds_to_do(producer(num_shards=2, shard_index=0), plan, None, tmp_path) == list(
        range(2, plan.rounds, 2))
    assert windowed.rounds_to_do(producer(num_shards=2, shard_index=1), plan, None, tmp_path) == list(
        range(3, plan.rounds, 2))
    assert windowed.rounds_to_do(producer(num_shards=2, shard_index=1), plan, None, tmp_path)[0] == 3
    assert windowed.rounds_to_do(producer(num_shards=1, shard_index=0), plan, None, tmp_path)[0] == 2


def test_a_round_that_would_pass_the_budget_is_refused_counting_its_own_bytes(tmp_path):
    """The budget holds the held-out split and one window: beside a complete round 0, round 1
    does not fit; alone (round 0 trained and deleted), it does."""
    plan = plan_of(windows_in_budget=1)
    complete_round(tmp_path, 0)
    with pytest.raises(PipelineError, match=r"round 1 \(.* bytes\) does not fit the --disk-budget"):
        windowed._wait_for_room(producer(), plan, tmp_path, 1)
    assert windows.present_rounds(tmp_path) == [0]  # the producer that backed off left no folder
    windows.delete_round(tmp_path, 0)
    claim = windowed._wait_for_room(producer(), plan, tmp_path, 1)  # fits: returns (with its claim)
    if claim is not None:
        claim.release()
    # Its own folder already there (a rerun after a kill) is counted once, not twice.
    complete_round(tmp_path, 1)
    claim = windowed._wait_for_room(producer(), plan, tmp_path, 1)
    if claim is not None:
        claim.release()


def test_two_producers_that_check_at_once_never_pass_the_budget_together(tmp_path, monkeypatch):
    """Both count the rounds on disk before either has written a byte: the count comes after
    each one's claim on its round, so at most one goes ahead (the other backs off)."""
    plan = plan_of(windows_in_budget=1)
    meet = threading.Barrier(2, timeout=10)
    counted = threading.local()
    real = windows.present_rounds

    def present_rounds_at_once(wdir):
        seen = real(wdir)
        if not getattr(counted, "once", False):  # each producer's first count: neither goes on before both counted
            counted.once = True
            meet.wait()
        return seen

    monkeypatch.setattr(windows, "present_rounds", present_rounds_at_once)
    went_ahead, refused = [], []

    def produce(r: int) -> None:
        try:
            claim = windowed._wait_for_room(producer(wait_s=1.5), plan, tmp_path, r)
        except PipelineError as e:
            refused.append((r, str(e)))
            return
        (tmp_path / windows.round_name(r)).mkdir(exist_ok=True)  # it writes its round
        went_ahead.append(r)
        (tmp_path / windows.round_name(r) / "train-00000.safetensors").write_bytes(b"x")
        if claim is not None:
            claim.release()

    threads = [threading.Thread(target=produce, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(went_ahead) <= 1, f"rounds {went_ahead} were both written against a budget of one round"
    assert len(went_ahead) + len(refused) == 2 and all("--disk-budget" in msg for _, msg in refused)


def test_a_waiting_producer_says_what_it_waits_for(tmp_path, caplog):
    plan = plan_of(windows_in_budget=1)
    other = tmp_path / windows.round_name(0)
    other.mkdir()
    (other / CLAIM_JSON).write_text(json.dumps({
        "host": "other-box", "pid": 4242, "token": "0123456789abcdef", "what": "stage 02, round 0 (shard 0 of 2)",
        "started": "2026-12-01T00:00:00Z"}))
    with caplog.at_level(logging.INFO), pytest.raises(PipelineError, match="does not fit"):
        windowed._wait_for_room(producer(wait_s=0.3, num_shards=2, shard_index=1), plan, tmp_path, 1)
    waits = [r.getMessage() for r in caplog.records if "waits for room" in r.getMessage()]
    assert waits, "the producer waited without a word"
    assert "round 1" in waits[0] and "round 0: claimed by other-box:4242" in waits[0]
    assert "no new heartbeat" in waits[0] and "0 file(s) complete" in waits[0]


def test_a_second_writer_of_a_round_is_refused_naming_the_first(tmp_path):
    plan = plan_of(windows_in_budget=2)
    first = windowed._wait_for_room(producer(), plan, tmp_path, 0)
    try:
        with pytest.raises(PipelineError, match=rf"window-00000 is claimed by \S+:{os.getpid()} "):
            windowed._wait_for_room(producer(), plan, tmp_path, 0)
    finally:
        if first is not None:
            first.release()


# --------------------------------------------------------------------------- what the trainer says


class _Schedule:
    total = 40

    @staticmethod
    def locate(step):
        return 1, 0


def test_the_trainer_logs_the_round_it_waits_for_and_its_advice_names_the_windows_dir(tmp_path, caplog):
    workdir = WorkDir(tmp_path / "work")
    shared = tmp_path / "shared"
    d = shared / windows.round_name(1)
    d.mkdir(parents=True)
    (d / CLAIM_JSON).write_text(json.dumps({
        "host": "other-box", "pid": 4242, "token": "0123456789abcdef", "what": "stage 02, round 1 (shard 1 of 2)",
        "started": "2026-12-01T00:00:00Z"}))
    rounds = Rounds(workdir, None, _Schedule(), windows_dir=str(shared), keep=False, wait_s=0.3, rank=0, world=1)
    with caplog.at_level(logging.INFO):
        assert rounds.ensure(20) is False
    lines = [r.getMessage() for r in caplog.records]
    waits = [x for x in lines if "waiting for round 1" in x]
    assert waits and "claimed by other-box:4242" in waits[0] and "no new heartbeat" in waits[0]
    advice = [x for x in lines if "is not extracted yet" in x]
    assert advice and f"--window 1 --windows-dir {shared}`" in advice[0]


# --------------------------------------------------------------------------- the one-box loop


def run_the_loop(config) -> int:
    """window_loop's run over `config` on one process, its log file's handler removed after."""
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        args = SimpleNamespace(config=str(config), work_dir=None, disk_budget=None, extract_args="", train_args="",
                               nproc_per_node=1)
        return window_loop.run_loop(args)
    finally:
        for h in [h for h in root.handlers if h not in before]:  # the loop's log file
            root.removeHandler(h)
            h.close()


def test_the_loop_never_compares_a_manifest_time_with_its_own_clock(tmp_path, monkeypatch):
    """A stage 04 manifest left from before, dated ahead of this machine's clock (a file
    server's clock): the loop still runs every round, then stops once stage 04 wrote it anew."""
    work = tmp_path / "work"
    workdir = WorkDir(work)
    plan = plan_of(samples=16)
    windows.write_or_check_plan(workdir.store(), plan)
    manifest = workdir.manifest("train")
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    ahead = manifest.stat().st_mtime + 3600
    os.utime(manifest, (ahead, ahead))
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"work_dir": str(work), "target_model": "unused",
                                      "extract": {"disk_budget": plan.disk_budget}}))
    ran = []

    def fake_stage(cmd, what):
        ran.append(what)
        if what.startswith("stage 04"):
            trained = windows.read_progress(workdir.store() / windows.WINDOWS_DIR)["trained_rounds"] + 1
            windows.write_progress(workdir.store() / windows.WINDOWS_DIR, trained, f"step-{trained}", trained)
            if trained == plan.rounds:
                manifest.write_text('{"written": "now"}')

    monkeypatch.setattr(window_loop, "_run", fake_stage)
    assert run_the_loop(config) == 0
    assert ran == ["stage 02, round 0", "stage 04, round 0", "stage 02, round 1", "stage 04, round 1"]


def test_the_loop_extracts_again_a_round_stage_04_rewound(tmp_path, monkeypatch):
    """progress.json says round 0 is trained, but the checkpoint that covered it was unreadable
    (truncated by a power loss): stage 04 resumes an older one and rewrites progress.json down to
    it (eagle3/stages/s04_train/windows.py `Rounds.resumed`), then stops at round 0, deleted.
    The loop goes on with round 0, extracted again, instead of stopping on an error."""
    work = tmp_path / "work"
    workdir = WorkDir(work)
    plan = plan_of(samples=16)
    assert plan.rounds == 2
    windows.write_or_check_plan(workdir.store(), plan)
    wdir = workdir.store() / windows.WINDOWS_DIR
    windows.write_progress(wdir, 1, "step-1", 1)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"work_dir": str(work), "target_model": "unused",
                                      "extract": {"disk_budget": plan.disk_budget}}))
    ran = []

    def fake_stage(cmd, what):
        ran.append(what)
        if what.startswith("stage 04"):
            if len(ran) == 2:  # the first start: the newest checkpoint unreadable, the one before covers nothing
                windows.write_progress(wdir, 0, None, 0)
                return
            trained = windows.read_progress(wdir)["trained_rounds"] + 1
            windows.write_progress(wdir, trained, f"step-{trained}", trained)
            if trained == plan.rounds:
                workdir.manifest("train").parent.mkdir(parents=True, exist_ok=True)
                workdir.manifest("train").write_text("{}")

    monkeypatch.setattr(window_loop, "_run", fake_stage)
    assert run_the_loop(config) == 0
    assert ran == ["stage 02, round 1", "stage 04, round 1", "stage 02, round 0", "stage 04, round 0",
                   "stage 02, round 1", "stage 04, round 1"]
    assert "rewound" in workdir.log_file("window_loop").read_text()
