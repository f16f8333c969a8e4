"""More data than the disk holds, on the tiny Llama (HF backend of stage 02, CPU):

- the one-box loop (`python -m eagle3.tools.window_loop`) killed -9 at three points (between
  the checkpoint covering a round and the round's deletion, inside stage 02, inside stage 04)
  and rerun each time ends with the weights of an unbroken windowed run, bitwise;
- a consumer (stage 04) and two producers (stage 02, --num-shards 2) over a shared folder:
  the producers never hold more than the budget, the consumer trains the rounds in order
  and ends with the same weights;
- one writer per round: while a producer writes a round, a second one with the same
  --shard-index and the `--window r` recovery run are each refused in one line naming it,
  and the round ends complete, every sample with the states the first one wrote.

The reference is the same windowed run with the stages called in this process, one round
at a time, as the loop calls them.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from fixtures import ROOT, copy_stages, run_stages

from eagle3.artifacts import windows
from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import build_config
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.run import extract_hidden_states
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.run import train_drafter
from eagle3.stages.s04_train.windows import KILL_ENV

BUDGET = 8_000_000  # bytes: the held-out file (~1.1 MB) and two windows of ~3.4 MB: 3 rounds


def write_config(path: Path, target: Path, work: Path) -> Path:
    cfg = {
        "work_dir": str(work), "target_model": str(target),
        "extract": {"backend": "hf", "samples_per_file": 8, "dtype": "float32", "disk_budget": BUDGET,
                    "windows_in_budget": 2},
        "vocab": {"draft_vocab_size": 128},
        "train": {"batch_tokens": 512, "max_seq_len": 256, "log_every": 1, "eval_every": 1000, "save_every": 1,
                  "keep_checkpoints": 2, "ttt_steps": 2, "warmup_steps": 1, "learning_rate": 3e-3},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_llama) -> Path:
    """Stages 01 and 03 (the vocabulary reads stage 01 only) on 60 demo chats."""
    work = tmp_path_factory.mktemp("windows-base")
    run_stages(work, tiny_llama, upto="prepare", chats=60)
    run_stages(work, tiny_llama, first="vocab", upto="vocab")
    return work


@pytest.fixture(scope="module")
def reference(tmp_path_factory, base, tiny_llama) -> dict:
    """The unbroken windowed run: round after round, stage 02 then stage 04, in this process."""
    root = tmp_path_factory.mktemp("windows-ref")
    work = copy_stages(base, root / "work", stages=("prepare", "vocab"))
    config = write_config(root / "c.yaml", tiny_llama, work)
    for _ in range(20):
        extract_hidden_states(build_config(ExtractConfig, "extract", config, {}, sections=STAGE_CONFIGS))
        if train_drafter(build_config(TrainConfig, "train", config, {}, sections=STAGE_CONFIGS)) is not None:
            break
    workdir = WorkDir(work)
    plan = windows.read_plan(workdir.store())
    progress = windows.read_progress(workdir.store() / windows.WINDOWS_DIR)
    assert plan.rounds == 3 and progress["trained_rounds"] == 3
    counts = json.loads(workdir.manifest("train").read_text())["counts"]
    return {"weights": final_weights(workdir), "plan": plan, "steps_per_round": counts["steps_per_round"]}


def final_weights(workdir: WorkDir) -> dict:
    info = json.loads(workdir.latest_checkpoint().read_text())
    return torch.load(workdir.checkpoint(info["step"]), map_location="cpu", weights_only=True)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"weights differ from the unbroken run's: {differ}"


def loop_cmd(config: Path) -> list[str]:
    return [sys.executable, "-m", "eagle3.tools.window_loop", "--config", str(config)]


def kill_when(cmd: list[str], ready, timeout_s: float = 300, env: dict | None = None) -> None:
    """Start `cmd` in its own process group and SIGKILL the group once `ready()` holds."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    deadline = time.monotonic() + timeout_s
    try:
        while not ready():
            assert proc.poll() is None, f"{cmd} ended (status {proc.returncode}) before the kill point"
            assert time.monotonic() < deadline, "the kill point never came"
            time.sleep(0.01)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_loop_killed_at_three_points_ends_with_the_unbroken_runs_weights(tmp_path, base, tiny_llama, reference):
    work = copy_stages(base, tmp_path / "work", stages=("prepare", "vocab"))
    config = write_config(tmp_path / "c.yaml", tiny_llama, work)
    workdir = WorkDir(work)
    wdir = workdir.store() / windows.WINDOWS_DIR
    round_dir = lambda r: wdir / windows.round_name(r)  # noqa: E731

    # 1. Between the checkpoint that covers round 0 and the round's deletion (stage 04 kills itself there).
    rc = subprocess.call(loop_cmd(config), cwd=ROOT, env={**os.environ, KILL_ENV: "covered:0"},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert rc != 0
    assert windows.read_progress(wdir)["trained_rounds"] == 0
    assert windows.window_problem(round_dir(0), verify_checksums=True) is None  # not deleted yet
    assert json.loads(workdir.latest_checkpoint().read_text())["step"] == reference["steps_per_round"][0]

    # 2. Inside stage 02, while round 1 is written: one file complete, the round not.
    kill_when(loop_cmd(config), lambda: (round_dir(1) / "train-00000.json").is_file())
    assert windows.read_complete(round_dir(1)) is None, "round 1 finished before the kill: the point was missed"
    assert not round_dir(0).exists(), "round 0 survived a rerun whose checkpoint covers it"
    assert windows.read_progress(wdir)["trained_rounds"] == 1

    # 3. Inside stage 04, on round 2: a checkpoint past the end of round 1, round 2 not finished.
    def mid_round_2() -> bool:
        p = windows.read_progress(wdir)
        return p["trained_rounds"] == 2 and workdir.checkpoint(p["step"] + 1).is_file()

    kill_when(loop_cmd(config), mid_round_2)
    assert windows.read_progress(wdir)["trained_rounds"] == 2

    # The same command, to the end.
    subprocess.run(loop_cmd(config), cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert windows.read_progress(wdir)["trained_rounds"] == 3
    assert windows.present_rounds(wdir) == []  # every round deleted after its checkpoint
    assert workdir.manifest("train").is_file()
    assert_same_weights(final_weights(workdir), reference["weights"])
    lines = [x for x in workdir.log_file("window_loop").read_text().splitlines() if "peak store disk" in x]
    assert len(lines) >= 3 and all("covered by step-" in x for x in lines)
    assert workdir.log_file("02_extract").is_file() and workdir.log_file("04_train").is_file()


def rounds_holding_data(wdir: Path) -> dict[int, list[str]]:
    """Round folders holding any file but a claim, with their files: a producer claims a
    round's folder before it counts the budget, and one over the budget removes it, data-less."""
    out = {}
    for r in windows.present_rounds(wdir):
        try:
            names = sorted(p.name for p in (wdir / windows.round_name(r)).iterdir())
        except FileNotFoundError:  # deleted (or backed off from) since it was listed
            continue
        if any(not n.lstrip(".").startswith("claim") for n in names):  # the heartbeat's write: "..claim-*.tmp"
            out[r] = names
    return out


def test_producers_and_a_consumer_over_a_shared_folder(tmp_path, base, tiny_llama, reference):
    work = copy_stages(base, tmp_path / "work", stages=("prepare", "vocab"))
    config = write_config(tmp_path / "c.yaml", tiny_llama, work)
    workdir = WorkDir(work)
    shared = tmp_path / "shared"
    common = ["--config", str(config), "--windows-dir", str(shared)]
    producers = [subprocess.Popen([sys.executable, WorkDir.script("extract"), *common, "--produce", "--wait-s", "300",
                                   "--num-shards", "2", "--shard-index", str(i)], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
    consumer = None
    most, most_seen, peak = 0, {}, 0
    deadline = time.monotonic() + 400
    try:
        while any(p.poll() is None for p in producers) or (consumer and consumer.poll() is None):
            assert time.monotonic() < deadline
            if consumer is None and workdir.manifest("extract").is_file():  # the held-out split is there
                consumer = subprocess.Popen([sys.executable, WorkDir.script("train"), *common, "--window-wait-s",
                                             "300"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            seen = rounds_holding_data(shared)
            if len(seen) > most:
                most, most_seen = len(seen), seen
            peak = max(peak, windows.dir_bytes(workdir.store()) + windows.dir_bytes(shared))
            time.sleep(0.05)
    finally:
        for p in producers + [consumer]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in producers] == [0, 0]
    assert consumer is not None and consumer.returncode == 0
    assert most <= 2, f"{most} rounds on disk at once; the budget holds 2: {most_seen}"
    # The budget counts the stored files; one file of slack covers the small JSON files beside them.
    one_file = reference["plan"].bytes_per_token * 8 * 256  # 8 samples of at most 256 tokens
    assert peak <= BUDGET + one_file, peak
    assert windows.read_progress(shared)["trained_rounds"] == 3 and windows.present_rounds(shared) == []
    assert_same_weights(final_weights(workdir), reference["weights"])


def test_a_second_writer_of_a_round_is_refused_and_the_first_ones_round_is_whole(tmp_path, base, tiny_llama):
    """The same --shard-index on a second box (or a second loop after an SSH drop), and the
    `--window r` recovery, while a producer writes round 0: both refused in one line naming it.
    The producer is frozen (SIGSTOP) while it holds the round, so the others meet it there."""
    work = copy_stages(base, tmp_path / "work", stages=("prepare", "vocab"))
    config = write_config(tmp_path / "c.yaml", tiny_llama, work)
    shared = tmp_path / "shared"
    producer = [sys.executable, WorkDir.script("extract"), "--config", str(config), "--windows-dir", str(shared),
                "--produce", "--num-shards", "2", "--shard-index", "0"]
    first = subprocess.Popen(producer, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    round0 = shared / windows.round_name(0)
    try:
        deadline = time.monotonic() + 300
        # Its claim on round 0 (or, with code that made none, its first partial file there).
        while not ((round0 / ".claim.json").is_file() or any(round0.glob(".train-*.partial*"))):
            assert first.poll() is None, f"the producer ended (status {first.returncode}) before it wrote round 0"
            assert time.monotonic() < deadline, "the producer never started round 0"
            time.sleep(0.005)
        os.kill(first.pid, signal.SIGSTOP)
        holder = f"{socket.gethostname()}:{first.pid}"
        for second in (producer, [*producer[:-5], "--num-shards", "2", "--shard-index", "1", "--window", "0"]):
            r = subprocess.run(second, cwd=ROOT, capture_output=True, text=True, timeout=300)
            last = r.stderr.strip().splitlines()[-1]
            assert r.returncode != 0 and f"is claimed by {holder} " in last, (second, r.returncode, r.stderr[-2000:])
        os.kill(first.pid, signal.SIGCONT)
        assert first.wait(timeout=300) == 0
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
            first.wait()
    for r in (0, 2):  # shard 0's rounds of 3
        d = shared / windows.round_name(r)
        assert windows.window_problem(d, verify_checksums=True) is None
        index = json.loads((d / "index.json").read_text())
        split = HiddenStateStore(d, {**index, "identity": json.loads((d / "store.json").read_text())}, None,
                                 verify="lazy").split("train")
        empty = [s.sample_id for s in split if not s.aux.abs().sum() or not s.final.abs().sum()]
        assert len(split) and not empty, f"round {r}: samples {empty} hold no states"
        assert sorted(p.name for p in d.iterdir() if p.name.startswith(("claim", "."))) == []  # claim released
