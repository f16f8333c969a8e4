"""The windows part of the fault soak (bench/soak_faults.py --windows): faults an operator meets
over weeks of windows, each ending with a check that every round's data was trained exactly once.

On the tiny Llama (eagle3/demo/tiny.py), stages 01 and 03 on 60 demo chats once, then a
windowed run of `ROUNDS_WANTED` or more rounds (a disk budget of two windows), driven
through the real scripts as an operator drives them:

  kill     `python -m eagle3.tools.window_loop` run twice with kill -9 of the stage it runs
           (the trainer or the producer, whichever runs at a seeded random time), then rerun
           to the end.
  procs    the loop under `--nproc-per-node 2` killed -9 (torchrun and its workers) at a random
           time, then resumed with 1 process: a checkpoint at a round's end maps by rounds; one in
           a round's middle is refused with the command that finishes the round under 2
           processes, which is run as the message says before the 1-process loop again.
  ckpt     the loop killed -9 at a random time once a round is covered; the newest checkpoint
           file truncated (a power loss, a torn copy), the loop rerun: it falls back to the
           previous intact checkpoint and trains the rewound steps (stage 02 extracts again a
           round it needs that was deleted). When the truncated file was the only checkpoint,
           stage 04 refuses naming --force; the soak runs stage 04 --force as told, then the loop.
  claim    a producer over a shared --windows-dir and a consumer; while the producer holds a
           round's claim (frozen with SIGSTOP, or running), a second producer of the same shard
           and the `--window r` recovery are started: each refused in one line naming the
           holder, or finding nothing left to write; never a round of zeros.
  force    producers of shards 0 and 1 on two work dirs over one shared --windows-dir, the
           consumer in the first; the second box's producer killed -9 at a random time and
           restarted with --force: it deletes only its own shard's untrained rounds (never the
           other shard's, never progress.json) and writes them again.

What "no round lost" means here: every trial ends with the run complete (its manifest written,
progress.json and the last checkpoint's record at every round of the plan, no round folder
left), and its final weights bitwise equal to those of an unbroken run with the same process
counts: a round skipped, trained twice, trained on zeros or on a partial round gives other
weights. With one process count the metrics log (one line per step, lines past a resumed
checkpoint dropped) must hold every step of every round once; a round whose steps are not all
there is counted lost.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fixtures import copy_stages, run_stages, torchrun  # noqa: E402

from eagle3.artifacts import windows  # noqa: E402
from eagle3.artifacts.train_outputs import read_checkpoint  # noqa: E402
from eagle3.artifacts.workdir import WorkDir  # noqa: E402

SCENARIOS = ("kill", "procs", "ckpt", "claim", "force")
# Bytes: the held-out file (~1.1 MB) and two windows of ~2.6 MB: 4 rounds of the 60 chats' train split.
BUDGET = 6_400_000
ROUNDS_WANTED = 4
TIMEOUT_S = 600  # one command; far above what any takes on 2 cores


def write_config(path: Path, target: Path, work: Path, save_every: int = 3) -> Path:
    """The run's settings: the HF backend in float32, 8 samples per file, two windows in the budget;
    a few steps per round. `save_every` changes which checkpoints exist, never the weights."""
    cfg = {
        "work_dir": str(work), "target_model": str(target),
        "extract": {"backend": "hf", "samples_per_file": 8, "dtype": "float32", "disk_budget": BUDGET,
                    "windows_in_budget": 2},
        "vocab": {"draft_vocab_size": 128},
        "train": {"batch_tokens": 512, "max_seq_len": 256, "log_every": 1, "eval_every": 1000,
                  "save_every": save_every, "keep_checkpoints": 2, "ttt_steps": 2, "warmup_steps": 1,
                  "learning_rate": 3e-3},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def loop_cmd(config: Path, nproc: int = 1) -> list[str]:
    return [sys.executable, "-m", "eagle3.tools.window_loop", "--config", str(config), "--nproc-per-node", str(nproc)]


def extract_cmd(config: Path, *args: str) -> list[str]:
    return [sys.executable, WorkDir.script("extract"), "--config", str(config), *args]


def train_cmd(config: Path, *args: str) -> list[str]:
    return [sys.executable, WorkDir.script("train"), "--config", str(config), *args]


def run(cmd: list[str], log: Path) -> int:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        return subprocess.call(cmd, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "a")
    out.write(f"\n$ {' '.join(cmd)}\n")
    out.flush()
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


# -- processes -----------------------------------------------------------------------------------
def _parents() -> dict[int, int]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            out[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun puts its workers in sessions of their own: a kill of
    the process group would miss them)."""
    parents, out, todo = _parents(), [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_tree(proc: subprocess.Popen) -> None:
    """kill -9 of `proc` and everything under it (a box going down)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def running_stage(proc: subprocess.Popen) -> tuple[int, str] | None:
    """The stage script a window loop runs now (the process nearest the loop), as (pid, "02"/"04")."""
    for pid in descendants(proc.pid):
        line = cmdline(pid)
        for key, script in (("02", "02_extract"), ("04", "04_train")):
            if script in line:
                return pid, key
    return None


# -- the check ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    planned: int = 0
    trained: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.planned - self.trained


def final_weights(workdir: WorkDir) -> dict:
    info = json.loads(workdir.latest_checkpoint().read_text())
    return torch.load(workdir.checkpoint(info["step"]), map_location="cpu", weights_only=True)["model"]


def covered_rounds(workdir: WorkDir) -> int:
    """The rounds the newest readable checkpoint covers (0 when none can be read)."""
    steps = sorted((s for s in map(workdir.checkpoint_step, workdir.checkpoints().glob("step-*.pt")) if s is not None),
                   reverse=True) if workdir.checkpoints().is_dir() else []
    for step in steps:
        try:
            return read_checkpoint(workdir.checkpoint(step)).rounds_trained or 0
        except Exception:  # noqa: BLE001 -- an unreadable file is skipped, as a resume skips it
            continue
    return 0


def stopped_short(workdir: WorkDir, planned: int, problem: str, notes: list[str] | None = None) -> Outcome:
    """A trial whose run did not complete: the rounds its checkpoints cover count as trained,
    the others as lost (the operator is left without them)."""
    return Outcome(planned, covered_rounds(workdir), [problem], list(notes or []))


def check_run(workdir: WorkDir, wdir: Path, reference: dict, *, one_count: bool) -> Outcome:
    """What the run trained, against the plan and the unbroken run (see the module docstring)."""
    plan = windows.read_plan(workdir.store())
    out = Outcome(planned=plan.rounds if plan else reference["rounds"])
    if not workdir.manifest("train").is_file():
        out.problems.append(f"{workdir.manifest('train')} missing: the run did not complete")
        return out
    last = read_checkpoint(workdir.checkpoint(json.loads(workdir.latest_checkpoint().read_text())["step"]))
    progress = windows.read_progress(wdir)
    if last.rounds_trained != out.planned or progress["trained_rounds"] != out.planned:
        out.problems.append(f"the last checkpoint covers {last.rounds_trained} round(s), progress.json says "
                            f"{progress['trained_rounds']}, the plan has {out.planned}")
    left = windows.present_rounds(wdir)
    if left:
        out.problems.append(f"round folders {left} left in {wdir}")
    counts = json.loads(workdir.manifest("train").read_text())["counts"]
    trained = out.planned
    if one_count:
        per = counts["steps_per_round"]
        steps = [json.loads(x)["step"] for x in workdir.train_metrics().read_text().splitlines()
                 if json.loads(x)["split"] == "train"]
        seen = {s: steps.count(s) for s in set(steps)}
        starts = [sum(per[:r]) for r in range(len(per))]
        whole = [r for r in range(len(per))
                 if all(seen.get(s) == 1 for s in range(starts[r] + 1, starts[r] + per[r] + 1))]
        trained = len(whole)
        if trained != out.planned:
            out.problems.append(f"the metrics log holds every step once for rounds {whole} only")
    a, b = final_weights(workdir), reference["weights"]
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    if differ:  # some round went wrong, which one is unknown: none counts as verified
        out.problems.append(f"final weights differ from the unbroken run's ({differ[:3]})")
        trained = 0
    out.trained = min(trained, last.rounds_trained or 0)
    return out


# -- the shared inputs and the unbroken runs -----------------------------------------------------
class Soak:
    def __init__(self, root: Path, target: Path, seed: int):
        self.root, self.target, self.seed = root, target, seed
        self.base = run_stages(root / "base", target, upto="prepare", chats=60)
        run_stages(self.base, target, first="vocab", upto="vocab")
        self.n = 0
        self.trial = 0  # the trial of the scenario running: some scenarios alternate a choice by it
        self._refs: dict[tuple, dict] = {}

    def new_run(self, name: str, save_every: int = 3) -> tuple[Path, WorkDir, Path]:
        self.n += 1
        d = self.root / f"{self.n:03d}-{name}"
        work = copy_stages(self.base, d / "work", stages=("prepare", "vocab"))
        return write_config(d / "c.yaml", self.target, work, save_every), WorkDir(work), d

    def reference(self, counts: tuple[int, ...] = ()) -> dict:
        """The unbroken run: round r extracted then trained by `counts[r]` processes (1 when not
        given): stage 02 --window r, then stage 04, which trains round r and stops at round r + 1
        (not extracted yet), as the loop does; torchrun for 2 processes."""
        key = tuple(c for c in counts)
        while key and key[-1] == 1:
            key = key[:-1]
        if key in self._refs:
            return self._refs[key]
        config, workdir, d = self.new_run("reference-" + ("".join(map(str, key)) or "1"))
        log = d / "log"
        t0 = time.monotonic()
        for r in range(64):
            plan = windows.read_plan(workdir.store())
            if plan is not None and r >= plan.rounds:
                break
            assert run(extract_cmd(config, "--window", str(r)), log) == 0, f"reference: stage 02 round {r}: {log}"
            nproc = key[r] if r < len(key) else 1
            if nproc == 1:
                assert run(train_cmd(config), log) == 0, f"reference: stage 04 round {r}: {log}"
            else:
                res = torchrun(nproc, [WorkDir.script("train"), "--config", config], TIMEOUT_S, d / f"torchrun-{r}")
                assert res.returncode == 0, f"reference: stage 04 round {r} on {nproc}: {res.stderr[-2000:]}"
        plan = windows.read_plan(workdir.store())
        assert workdir.manifest("train").is_file() and plan.rounds >= ROUNDS_WANTED, (plan.rounds, log)
        ref = {"weights": final_weights(workdir), "rounds": plan.rounds, "seconds": time.monotonic() - t0,
               "steps_per_round": json.loads(workdir.manifest("train").read_text())["counts"]["steps_per_round"]}
        print(f"reference {key or '(1 process)'}: {plan.rounds} rounds, steps per round {ref['steps_per_round']}, "
              f"{ref['seconds']:.0f} s", flush=True)
        shutil.rmtree(d)
        self._refs[key] = ref
        return ref


# -- scenarios: each returns an Outcome ----------------------------------------------------------
def loop_until_done(config: Path, log: Path, nproc: int = 1, tries: int = 3) -> int:
    rc = 1
    for _ in range(tries):
        rc = run(loop_cmd(config, nproc), log)
        if rc == 0:
            break
    return rc


def kill_a_stage_at(config: Path, log: Path, delay: float) -> str:
    """Start the loop; at `delay` s kill -9 the stage it runs then (or the loop between stages)."""
    proc = start(loop_cmd(config), log)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < delay:
            if proc.poll() is not None:
                return "none (the loop finished first)"
            time.sleep(0.02)
        found = running_stage(proc)
        if found is None:
            kill_tree(proc)
            return f"the loop between stages at {delay:.1f} s"
        pid, key = found
        for p in [pid, *descendants(pid)]:
            os.kill(p, signal.SIGKILL)
        proc.wait(timeout=TIMEOUT_S)
        return f"stage {key} at {delay:.1f} s"
    finally:
        if proc.poll() is None:
            kill_tree(proc)


def scenario_kill(soak: Soak, rng: random.Random) -> Outcome:
    ref = soak.reference()
    config, workdir, d = soak.new_run("kill", save_every=rng.choice([1, 3, 1000]))
    notes = []
    for _ in range(2):
        notes.append(kill_a_stage_at(config, d / "log", rng.uniform(0, ref["seconds"])))
    rc = loop_until_done(config, d / "log", tries=1)
    out = check_run(workdir, workdir.store() / windows.WINDOWS_DIR, ref, one_count=True) if rc == 0 else stopped_short(
        workdir, ref["rounds"], f"the loop rerun exited {rc}: {d / 'log'}")
    out.notes = [f"killed: {', '.join(notes)}"]
    return out


_FIX = re.compile(r"torchrun --nproc-per-node (\d+) \S+ ARGS --stop-after (\d+)")


def scenario_procs(soak: Soak, rng: random.Random) -> Outcome:
    # The unbroken run to compare with depends on where the count changed (known at the end);
    # torchrun's start makes a 2-process round about 1.5 times as long as a 1-process one.
    ref1 = soak.reference()
    config, workdir, d = soak.new_run("procs", save_every=rng.choice([1, 2, 1000]))
    log = d / "log"
    proc = start(loop_cmd(config, 2), log)
    delay = rng.uniform(0.05, 1.0) * 1.5 * ref1["seconds"]
    t0 = time.monotonic()
    while time.monotonic() - t0 < delay and proc.poll() is None:
        time.sleep(0.05)
    finished = proc.poll() is not None
    kill_tree(proc)
    notes = [f"2 processes killed -9 at {delay:.0f} s" if not finished else "2 processes finished first"]
    rc = run(loop_cmd(config, 1), log)
    if rc != 0:
        fix = _FIX.findall(log.read_text())
        if not fix:
            return stopped_short(workdir, ref1["rounds"], f"1 process refused without the command that fixes it: {log}",
                                 notes)
        nproc, stop = fix[-1]
        notes.append(f"1 process refused mid-round, ran the fix (--stop-after {stop} on {nproc})")
        res = torchrun(int(nproc), [WorkDir.script("train"), "--config", config, "--stop-after", stop], TIMEOUT_S,
                       d / "fix")
        if res.returncode != 0:
            return stopped_short(workdir, ref1["rounds"], f"the fix exited {res.returncode}: {res.stderr[-1000:]}", notes)
        rc = run(loop_cmd(config, 1), log)
    if rc != 0:
        return stopped_short(workdir, ref1["rounds"], f"the 1-process loop exited {rc}: {log}", notes)
    # Which rounds 2 processes trained: the checkpoints' records (the 1-process run resumed at a round's end).
    twos = ref1["rounds"] if finished else _rounds_on_two(log)
    notes.append(f"rounds on 2 processes: {twos}")
    ref = soak.reference((2,) * twos)
    out = check_run(workdir, workdir.store() / windows.WINDOWS_DIR, ref, one_count=twos == 0)
    out.notes = notes
    return out


def _rounds_on_two(log: Path) -> int:
    """The rounds the 1-process run found trained: its 'it covers N round(s)' line, or 0 (from scratch)."""
    found = re.findall(r"it covers (\d+) round\(s\), so training goes on", log.read_text())
    return int(found[0]) if found else 0


_NO_CHECKPOINT = re.compile(r"no checkpoint in \S+ can be read: .* pass --force to train from scratch", re.DOTALL)


def scenario_ckpt(soak: Soak, rng: random.Random) -> Outcome:
    ref = soak.reference()
    # Even trials keep an older checkpoint to fall back to (save_every 2), odd ones only the
    # truncated one (1000: a checkpoint at each round's end only): each run meets both.
    config, workdir, d = soak.new_run("ckpt", save_every=(2, 1000)[soak.trial % 2])
    log, wdir = d / "log", workdir.store() / windows.WINDOWS_DIR
    covered = rng.randrange(1, ref["rounds"])  # kill once this many rounds are covered, at a random later time
    proc = start(loop_cmd(config), log)
    try:
        while windows.read_progress(wdir)["trained_rounds"] < covered:
            assert proc.poll() is None, f"the loop ended before round {covered} was covered: {log}"
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5 * ref["seconds"] / ref["rounds"]))  # within the next round, mostly
    finally:
        kill_tree(proc)
    info = json.loads(workdir.latest_checkpoint().read_text())
    newest = workdir.checkpoint(info["step"])
    size = newest.stat().st_size
    with open(newest, "r+b") as f:
        f.truncate(size // 2)
    notes = [f"killed after round {covered} covered; {newest.name} truncated to {size // 2} of {size} B "
             f"(progress: {windows.read_progress(wdir)['trained_rounds']} round(s))"]
    rc = loop_until_done(config, log, tries=1)
    text = log.read_text()
    if rc != 0 and _NO_CHECKPOINT.search(text):
        # The only checkpoint was the truncated one: stage 04 refuses, naming --force. The
        # operator runs it; a round lost is one the run cannot train again from scratch.
        notes.append("no older checkpoint: refused naming --force, which was run as the message says")
        run(train_cmd(config, "--force"), log)
        rc = loop_until_done(config, log, tries=1)
        text = log.read_text()
    elif "newest readable checkpoint; skipped" not in text:
        notes.append("no fallback logged")
    if rc != 0:
        return stopped_short(workdir, ref["rounds"], f"the rerun exited {rc}: {log}", notes)
    out = check_run(workdir, wdir, ref, one_count=True)
    rewound = re.findall(r"says (\d+) round\(s\) trained, but the checkpoint this run resumes \((\S+)\) covers (\d+)",
                         text)
    out.notes = notes + [f"progress {a} -> {c} (resumed {Path(b).name})" for a, b, c in rewound]
    return out


def _wait(procs: list[subprocess.Popen], deadline: float) -> None:
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(p)


def finish(workdir: WorkDir, shared: Path, ref: dict, problems: list[str], notes: list[str],
           failure: str | None) -> Outcome:
    """A shared-folder trial's outcome: stopped short on `failure`, else checked; the problems
    seen along the way first."""
    out = stopped_short(workdir, ref["rounds"], failure, notes) if failure else check_run(workdir, shared, ref, one_count=True)
    out.problems = problems + out.problems
    out.notes = notes
    return out


def scenario_claim(soak: Soak, rng: random.Random) -> Outcome:
    ref = soak.reference()
    config, workdir, d = soak.new_run("claim")
    log, shared = d / "log", d / "shared"
    common = ["--windows-dir", str(shared)]
    producer = extract_cmd(config, *common, "--produce", "--wait-s", "300")
    first = start(producer, log)
    consumer = None
    r = rng.randrange(ref["rounds"])
    frozen = rng.random() < 0.5
    rd = shared / windows.round_name(r)
    notes, problems = [f"round {r}, first producer {'frozen' if frozen else 'running'}"], []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not (rd / ".claim.json").is_file():
            if consumer is None and workdir.manifest("extract").is_file():
                consumer = start(train_cmd(config, *common, "--window-wait-s", "300"), log)
            if first.poll() is not None or time.monotonic() > deadline:
                return stopped_short(workdir, ref["rounds"], f"the producer never claimed round {r}: {log}", notes)
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.5))
        if frozen:
            os.kill(first.pid, signal.SIGSTOP)
        # The same command again (box 0 twice: refused at the store folder's claim), and the recovery
        # `--window r` as another shard (it meets round r's own claim).
        recovery = extract_cmd(config, *common, "--num-shards", "2", "--shard-index", "1", "--window", str(r))
        for second in (producer, recovery):
            res = subprocess.run(second, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
            lines = res.stderr.strip().splitlines()
            what = "--window" if "--window" in second else "second producer"
            if res.returncode != 0:
                claimed = bool(lines) and "is claimed by" in lines[-1]
                notes.append(f"{what}: refused{'' if claimed else ' (other reason)'}")
                if not claimed:
                    problems.append(f"{what} failed without naming the holder: {lines[-1:] }")
            else:
                notes.append(f"{what}: exit 0")
                if frozen:
                    problems.append(f"{what} ran while the holder of round {r} was frozen in it")
        if frozen:
            os.kill(first.pid, signal.SIGCONT)
        while consumer is None and first.poll() is None:
            if workdir.manifest("extract").is_file():
                consumer = start(train_cmd(config, *common, "--window-wait-s", "300"), log)
            time.sleep(0.05)
        if consumer is None:
            consumer = start(train_cmd(config, *common, "--window-wait-s", "300"), log)
        _wait([first, consumer], deadline)
    finally:
        for p in (first, consumer):
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                kill_tree(p)
    failed = first.returncode != 0 or consumer.returncode != 0
    return finish(workdir, shared, ref, problems, notes,
                  f"producer exited {first.returncode}, consumer {consumer.returncode}: {log}" if failed else None)


def scenario_force(soak: Soak, rng: random.Random) -> Outcome:
    ref = soak.reference()
    config, workdir, d = soak.new_run("force")
    config_b, wd_b, _ = soak.new_run("force-box-b")
    log, shared = d / "log", d / "shared"
    common = ["--windows-dir", str(shared), "--produce", "--wait-s", "300", "--num-shards", "2"]
    box_a = start(extract_cmd(config, *common, "--shard-index", "0"), log)
    box_b = start(extract_cmd(config_b, *common, "--shard-index", "1"), d / "log-b")
    consumer = None
    problems, notes = [], []
    deadline = time.monotonic() + TIMEOUT_S
    delay = rng.uniform(0, ref["seconds"] * 0.6)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < delay or consumer is None:
            if consumer is None and workdir.manifest("extract").is_file():
                consumer = start(train_cmd(config, "--windows-dir", str(shared), "--window-wait-s", "300"), log)
            if time.monotonic() > deadline:
                return stopped_short(workdir, ref["rounds"], f"the held-out split never came: {log}")
            time.sleep(0.02)
        kill_tree(box_b)
        progress_before = (shared / windows.PROGRESS_JSON).is_file()
        complete0 = [r for r in windows.present_rounds(shared)
                     if r % 2 == 0 and windows.read_complete(shared / windows.round_name(r)) is not None]
        b_force = start(extract_cmd(config_b, *common, "--shard-index", "1", "--force"), d / "log-b")
        line = None
        while line is None and b_force.poll() is None and time.monotonic() < deadline:
            found = re.findall(r"--force: deleted this shard's round\(s\) (\[[^\]]*\]).*?kept the other shards' "
                               r"round\(s\) (\[[^\]]*\])", (d / "log-b").read_text())
            line = found[-1] if found else None
            time.sleep(0.01)
        trained = windows.read_progress(shared)["trained_rounds"]
        after = windows.present_rounds(shared)
        gone0 = [r for r in complete0 if r not in after and r >= trained]
        if gone0:
            problems.append(f"shard 0's untrained round(s) {gone0} went with shard 1's --force")
        if progress_before and not (shared / windows.PROGRESS_JSON).is_file():
            problems.append("progress.json went with --force")
        if line is None:
            notes.append("--force logged no deletion line" + (f" (exit {b_force.returncode})" if b_force.poll() is
                                                               not None else ""))
        else:
            deleted = json.loads(line[0])
            notes.append(f"box B killed at {delay:.0f} s; --force deleted {deleted}, kept {line[1]}")
            if any(r % 2 != 1 for r in deleted):
                problems.append(f"--force on shard 1 deleted rounds {deleted}")
        _wait([box_a, b_force, consumer], deadline)
    finally:
        for p in (box_a, box_b, consumer):
            if p is not None and p.poll() is None:
                kill_tree(p)
    rcs = (box_a.returncode, b_force.returncode, consumer.returncode)
    return finish(workdir, shared, ref, problems, notes,
                  f"exit statuses (box A, box B --force, consumer) {rcs}: {log}" if any(rcs) else None)


RUNNERS = {"kill": scenario_kill, "procs": scenario_procs, "ckpt": scenario_ckpt, "claim": scenario_claim,
           "force": scenario_force}


def soak(root: Path, target: Path, scenarios: list[str], trials: int, budget_s: float, seed: int) -> bool:
    """Run `trials` trials of each scenario in turn (round robin) until `budget_s`; print the table.
    True when every trial passed."""
    t_start = time.monotonic()
    s = Soak(root, target, seed)
    s.reference()
    results: dict[str, list[Outcome]] = {name: [] for name in scenarios}
    for k in range(trials):
        for i, name in enumerate(scenarios):
            if time.monotonic() - t_start > budget_s:
                break
            rng = random.Random(seed * 1000 + k * 10 + i)
            s.trial = k
            t1 = time.monotonic()
            try:
                o = RUNNERS[name](s, rng)
            except (AssertionError, subprocess.TimeoutExpired) as e:
                o = Outcome(s.reference()["rounds"], 0, [f"{type(e).__name__}: {str(e)[:600]}"])
            results[name].append(o)
            print(f"{name:6s} trial {k}: {o.trained}/{o.planned} rounds trained, {'pass' if not o.problems else 'FAIL'}"
                  f" ({time.monotonic() - t1:.0f} s); {'; '.join(o.notes)}", flush=True)
            for p in o.problems:
                print(f"    {p}", flush=True)
    print(f"\n== windows fault soak: {time.monotonic() - t_start:.0f} s, seed {seed}")
    print("| scenario | trials | rounds planned | rounds trained | rounds lost | result |")
    print("|---|---|---|---|---|---|")
    for name, outs in results.items():
        ok = sum(not o.problems for o in outs)
        print(f"| {name} | {len(outs)} | {sum(o.planned for o in outs)} | {sum(o.trained for o in outs)} | "
              f"{sum(o.lost for o in outs)} | {ok}/{len(outs)} pass |")
    return all(not o.problems for outs in results.values() for o in outs)
