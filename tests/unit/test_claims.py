"""One writer per folder (eagle3/artifacts/claims.py): the claim, its refusal, its heartbeat, takeovers."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.artifacts import claims
from eagle3.core.errors import PipelineError

ROOT = Path(__file__).resolve().parents[2]


def fake_claim(folder, *, host="other-box", pid=4242, token="0123456789abcdef", beat=None):
    """A claim as another process (by default on another machine) leaves it."""
    folder.mkdir(parents=True, exist_ok=True)
    holder = {"host": host, "pid": pid, "token": token, "what": "stage 02, round 3 (shard 1 of 2)",
              "started": "2026-12-01T00:00:00Z", "boot": "", "pid_start": ""}
    (folder / claims.CLAIM_JSON).write_text(json.dumps(holder))
    if beat is not None:
        (folder / claims.beat_name(token)).write_text(json.dumps({"beat": beat}))
    return holder


def test_a_second_writer_is_refused_in_one_line_naming_the_holder(tmp_path):
    with claims.Claim.acquire(tmp_path / "window-00003", what="stage 02, round 3") as first:
        with pytest.raises(PipelineError) as refused:
            claims.Claim.acquire(tmp_path / "window-00003", what="stage 02, round 3")
        msg = str(refused.value)
        assert "\n" not in msg
        assert f"claimed by {socket.gethostname()}:{os.getpid()}" in msg and "stage 02, round 3" in msg
        assert "--take-over-stale-s" in msg
        first.check()  # the refused attempt left the first claim alone
    assert not (tmp_path / "window-00003" / claims.CLAIM_JSON).exists()  # released
    claims.Claim.acquire(tmp_path / "window-00003", what="again").release()  # and free again


def test_a_claim_of_another_machine_is_never_taken_over_without_the_option(tmp_path):
    fake_claim(tmp_path, beat=7)
    with pytest.raises(PipelineError, match=r"claimed by other-box:4242 .*no new heartbeat"):
        claims.Claim.acquire(tmp_path, what="me")
    assert claims.read_holder(tmp_path).host == "other-box"


def test_a_stale_claim_is_taken_over_only_with_the_option_and_after_the_stated_time(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "HEARTBEAT_S", 0.05)
    with pytest.raises(PipelineError, match="shorter than 3 heartbeats"):
        claims.Claim.acquire(tmp_path, what="me", take_over_stale_s=0.1)
    fake_claim(tmp_path, beat=7)
    with claims.Claim.acquire(tmp_path, what="me", take_over_stale_s=0.3) as mine:
        assert claims.read_holder(tmp_path).token == mine.holder.token
        assert not (tmp_path / claims.beat_name("0123456789abcdef")).exists()  # the old heartbeat went with it


def test_a_live_heartbeat_keeps_the_claim_against_the_option(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "HEARTBEAT_S", 0.05)
    # Another process holds the folder and beats (a live writer on the same machine).
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from eagle3.artifacts import claims; "
        "claims.HEARTBEAT_S = 0.05; c = claims.Claim.acquire(Path(sys.argv[1]), what='the live one'); "
        "print('held', flush=True); time.sleep(60)"), str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(PipelineError, match=rf"claimed by \S+:{child.pid} .*the live one"):
            claims.Claim.acquire(tmp_path, what="me", take_over_stale_s=5.0)  # refused at its next beat
    finally:
        child.kill()
        child.wait()
    # Its process is gone now: the claim is replaced without the option.
    with claims.Claim.acquire(tmp_path, what="me") as mine:
        assert claims.read_holder(tmp_path).token == mine.holder.token


def test_the_heartbeat_advances_and_a_taken_over_claim_stops_its_old_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(claims, "HEARTBEAT_S", 0.02)
    claim = claims.Claim.acquire(tmp_path, what="me")
    try:
        first = claims.read_beat(tmp_path, claim.holder)
        watch = claims.Watch()
        assert watch.silent_s(tmp_path, claim.holder) == 0.0
        for _ in range(1000):  # a busy machine may delay the thread; the beat must come
            if claims.read_beat(tmp_path, claim.holder) > first:
                break
            claim._stop.wait(0.02)
        assert claims.read_beat(tmp_path, claim.holder) > first
        # Someone took it over (e.g. --take-over-stale-s on another box while this one hung).
        (tmp_path / claims.CLAIM_JSON).unlink()
        fake_claim(tmp_path, token="fedcba9876543210")
        with pytest.raises(PipelineError, match="taken over by other-box:4242"):
            claim.check()
    finally:
        claim.release()
    assert claims.read_holder(tmp_path).token == "fedcba9876543210"  # a lost claim's release leaves the new one


def test_a_dead_process_on_this_machine_is_gone_and_a_live_one_or_a_remote_one_is_not(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    me = claims.Holder.this_process("me")
    dead = claims.Holder(host=me.host, pid=child.pid, token="a", what="x", started="", boot=me.boot, pid_start="1")
    assert dead.gone()
    assert not me.gone()
    assert claims.Holder(host=me.host, pid=os.getpid(), token="b", what="x", started="", boot="another boot").gone()
    assert not claims.Holder(host="other-box", pid=child.pid, token="c", what="x", started="").gone()
    # Exited but not reaped (a zombie: a parent that never waits, a container without init): gone.
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # it has exited; it stays in the process table
    try:
        assert claims.Holder(host=me.host, pid=zombie.pid, token="d", what="x", started="", boot=me.boot).gone()
    finally:
        zombie.wait()
