"""kill -9 at a random point of a stage, then the same command again.

Used by tests/e2e/test_faults.py (one kill per stage) and bench/soak_faults.py (several).
One row of `ROWS` per stage: the script, the stages whose outputs it reads (copied
from an unbroken reference run), and how its artifacts compare with the reference's.
A trial:

1. copies the inputs into a fresh work dir and starts the script in its own process
   group (vLLM's engine processes included);
2. waits until the stage's folder appears (imports and model loading write nothing),
   then a seeded random fraction of the rest of the reference run's duration, and
   sends SIGKILL to the whole group;
3. checks that no file that looks complete is partial: every visible file (not a
   dot-named temporary) is byte-equal to the reference's file of that name
   (deterministic stages) or loads and parses (training checkpoints, results);
4. reruns the same command, which must exit 0, and compares the artifacts with the
   reference run's: bitwise for stages 01, 02, 03, 05 and the trained weights of 04
   (a resumed run equals an unbroken one); stage 00's chats exactly (greedy); stage
   06's acceptance counts exactly (greedy: tokens, drafts, accepted tokens per
   position), its timings not at all (volatile);
5. checks that the stage's manifest describes files that are all there, and that the
   inputs it read were left as they were.

Stage 01 reads stage 00's regenerated chats (`--data generated`, as the pipeline
does), so the drafter learns the tiny target's own answers and stage 06 measures an
acceptance above 1: a rerun that served another drafter would show.
`run_plan` runs the reference and the trials on two workers at once, critical path
first (the CI test); the soak runs them one at a time.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3.artifacts.workdir import WorkDir  # noqa: E402
from eagle3.core.stages import STAGE  # noqa: E402
from eagle3.serving.model_card import CARD_NAME, EVALUATE_BEGIN, EVALUATE_END  # noqa: E402


def write_config(path: Path, target: Path, chats: Path) -> Path:
    """Small settings for every stage on the tiny Llama: each runs in seconds (00 and 06, with vLLM,
    in 30-40 s). Stage 01 reads stage 00's output; vLLM gets 10% of the RAM (two engines may run at once)."""
    cfg = {
        "work_dir": str(path.parent / "work"),
        "target_model": str(target),
        "generate": {"data": [str(chats)], "max_new_tokens": 8, "chunk_size": 3, "gpu_memory_utilization": 0.1},
        "prepare": {"data": ["generated"], "max_length": 256, "eval_fraction": 0.25, "num_workers": 1},
        "extract": {"backend": "hf", "samples_per_file": 6},
        "vocab": {"draft_vocab_size": 64},
        "train": {"max_steps": 12, "batch_tokens": 1024, "max_seq_len": 256, "log_every": 1, "eval_every": 4,
                  "save_every": 2, "ttt_steps": 2, "warmup_steps": 1, "learning_rate": 3.0e-3},
        "export": {"dtype": "bf16"},
        "evaluate": {"num_speculative_tokens": 2, "num_prompts": 4, "max_new_tokens": 8, "temperature": [0.0],
                     "timing_prompts": 1, "warmup_prompts": 0, "timed_passes": 2, "baseline_untrained": False,
                     "gpu_memory_utilization": 0.1},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def write_chats(path: Path, count: int) -> Path:
    """The first `count` demo chats (stage 00 regenerates their answers)."""
    path.write_text("\n".join((ROOT / "data" / "demo_chats.jsonl").read_text().splitlines()[:count]) + "\n")
    return path


def visible_files(d: Path) -> list[Path]:
    """Files a user or a later stage would take as finished: no dot-named part (temporaries)."""
    if not d.is_dir():
        return []
    return sorted(p for p in d.rglob("*") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(d).parts))


def _rel(p: Path, d: Path) -> str:
    return p.relative_to(d).as_posix()


# -- per-stage rules -------------------------------------------------------------------------
def _equal_files(names: Callable[[str], bool]):
    """Visible files selected by `names` must be byte-equal to the reference's."""

    def check(workdir: WorkDir, ref: WorkDir, stage: str, *, final: bool) -> list[str]:
        d, rd = workdir.stage_dir(stage), ref.stage_dir(stage)
        bad = []
        got = {_rel(p, d) for p in visible_files(d) if names(_rel(p, d))}
        want = {_rel(p, rd) for p in visible_files(rd) if names(_rel(p, rd))}
        for rel in sorted(got):
            if rel not in want:
                bad.append(f"{d / rel}: not in the unbroken run")
            elif (d / rel).read_bytes() != (rd / rel).read_bytes():
                bad.append(f"{d / rel}: differs from the unbroken run's")
        if final and got != want:
            bad.append(f"{d}: files {sorted(want - got)} missing after the rerun")
        return bad

    return check


def _not_volatile(rel: str) -> bool:
    # manifests carry a timestamp; datasets' state.json a random fingerprint; reports and the
    # model card (README.md, whose serve commands name the exported folder) name the work dir
    name = rel.rsplit("/", 1)[-1]
    return name not in ("manifest.json", "state.json", "export_report.json", "export_report.md", "README.md")


def _train_check(workdir: WorkDir, ref: WorkDir, stage: str, *, final: bool) -> list[str]:
    import torch

    bad = []
    d = workdir.stage_dir(stage)
    for p in visible_files(d):
        try:
            if p.suffix == ".pt":
                torch.load(p, weights_only=True)
            elif p.suffix == ".json":
                json.loads(p.read_text())
            elif p.suffix == ".jsonl":
                for line in p.read_text().splitlines():
                    json.loads(line)
        except Exception as e:  # noqa: BLE001 -- any failure to read is the finding
            bad.append(f"{p}: does not load ({type(e).__name__}: {str(e)[:80]})")
    if final:
        mine, theirs = (json.loads(w.manifest(stage).read_text()) for w in (workdir, ref))
        a = torch.load(d / mine["record"]["best_checkpoint"], weights_only=True)["model"]
        b = torch.load(ref.stage_dir(stage) / theirs["record"]["best_checkpoint"], weights_only=True)["model"]
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            bad.append(f"{d}: best checkpoint weights differ from the unbroken run's")
        if mine["record"]["best_step"] != theirs["record"]["best_step"]:
            bad.append(f"{d}: best step {mine['record']['best_step']} vs {theirs['record']['best_step']}")
    return bad


def _without_timings(x):
    """results.json's acceptance section minus wall-clock times (volatile; the counts are not, under greedy)."""
    if isinstance(x, dict):
        return {k: _without_timings(v) for k, v in x.items() if k != "wall_s"}
    if isinstance(x, list):
        return [_without_timings(v) for v in x]
    return x


def _evaluate_check(workdir: WorkDir, ref: WorkDir, stage: str, *, final: bool) -> list[str]:
    bad = []
    d = workdir.stage_dir(stage)
    for p in visible_files(d):
        try:
            if p.suffix == ".json":
                json.loads(p.read_text())
            elif p.suffix == ".png" and p.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
                raise ValueError("not a PNG")
        except Exception as e:  # noqa: BLE001
            bad.append(f"{p}: does not load ({type(e).__name__}: {str(e)[:80]})")
    if final:
        a = json.loads((d / "results.json").read_text())
        b = json.loads((ref.stage_dir(stage) / "results.json").read_text())
        for key in ("acceptance", "acceptance_length", "acceptance_per_position", "outputs_match_plain"):
            if _without_timings(a.get(key)) != _without_timings(b.get(key)):
                bad.append(f"{d}: results.json {key} {a.get(key)} differs from the unbroken run's {b.get(key)}")
    return bad


def _store_names(rel: str) -> bool:
    return rel.endswith((".safetensors", ".json")) and _not_volatile(rel)


@dataclass(frozen=True)
class Row:
    stage: str  # WorkDir stage key
    inputs: tuple[str, ...]  # stages whose outputs the trial copies from the reference run
    check: Callable[..., list[str]]  # (wd, ref, stage, final=) -> problems
    engine: bool = False  # starts vLLM (slow; the short test kills it once)
    extra_args: tuple[str, ...] = field(default=())

    @property
    def script(self) -> str:
        return STAGE[self.stage].script


_UP = ("generate", "prepare", "extract", "vocab", "train", "export")  # upstream stages, in order
ROWS = [
    Row("generate", (), _equal_files(lambda r: r.endswith((".jsonl", ".json")) and _not_volatile(r)), engine=True),
    Row("prepare", _UP[:1], _equal_files(_not_volatile)),
    Row("extract", _UP[:2], _equal_files(_store_names)),
    Row("vocab", _UP[:2], _equal_files(_not_volatile)),
    Row("train", _UP[:4], _train_check),
    Row("export", _UP[:5], _equal_files(_not_volatile)),
    Row("evaluate", _UP[:6], _evaluate_check, engine=True),
]
ROWS = [r for r in ROWS if r.stage in STAGE]  # stage 00 only where it exists


def command(row: Row, config: Path, work: Path) -> list[str]:
    return [sys.executable, str(ROOT / row.script), "--config", str(config), "--work-dir", str(work), *row.extra_args]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}  # (TQDM_DISABLE breaks vLLM: it divides by the bar's elapsed time)


@dataclass
class Timing:
    first_write: float  # seconds from start until the stage folder appeared
    total: float


def reference_run(row: Row, config: Path, ref: Path, timeout: float = 600) -> Timing:
    """The unbroken run of one stage (its upstream stages already in `ref`), timed."""
    d = WorkDir(ref).stage_dir(row.stage)
    t0 = time.monotonic()
    proc = subprocess.Popen(command(row, config, ref), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    first = None
    out = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()  # drain the pipe: a full one would block the stage
    while proc.poll() is None:
        if first is None and d.exists():
            first = time.monotonic() - t0
        time.sleep(0.01)
        if time.monotonic() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join()
    text = b"".join(out).decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"reference run of {row.script} failed ({proc.returncode}):\n{text[-3000:]}")
    total = time.monotonic() - t0
    return Timing(first if first is not None else total, total)


def run_reference(config: Path, ref: Path, rows=ROWS, timeout: float = 600) -> dict[str, Timing]:
    """The unbroken run of every stage, in order, timed."""
    return {row.stage: reference_run(row, config, ref, timeout) for row in rows}


@dataclass
class Trial:
    stage: str
    seed: int
    killed_at: float  # seconds after start
    killed: bool  # False when the stage finished before the kill point
    problems_after_kill: list[str]
    rerun_rc: int
    problems_after_rerun: list[str]
    rerun_output: str = ""

    @property
    def passed(self) -> bool:
        return not self.problems_after_kill and self.rerun_rc == 0 and not self.problems_after_rerun


def trial(row: Row, config: Path, ref: Path, timing: Timing, work: Path, seed: int, timeout: float = 600,
          attempts: int = 4) -> Trial:
    """Kill the stage at a seeded point of its writing phase, then rerun it and compare.

    The point is drawn from the reference run's timing; when the stage finishes before it
    (this run was faster: other jobs share the cores), the attempt starts over from the
    same inputs with the point halved, so the kill lands inside the run however the
    machine's load moves."""
    rwd = WorkDir(ref)
    rng = random.Random(seed)
    # The writing phase in the reference run: from the folder's appearance to the end.
    delay = rng.uniform(0.0, max(0.05, timing.total - timing.first_write))
    for _ in range(attempts):
        killed, killed_at = _run_and_kill(row, config, rwd, work, delay, timeout)
        if killed:
            break
        delay /= 2
    workdir = WorkDir(work)
    after_kill = row.check(workdir, rwd, row.stage, final=False) + _manifest_problems(workdir, row.stage)
    r = subprocess.run(command(row, config, work), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    after_rerun = []
    if r.returncode == 0:
        after_rerun = (row.check(workdir, rwd, row.stage, final=True) + _manifest_problems(workdir, row.stage, final=True)
                       + _inputs_changed(workdir, rwd, row.inputs))
    return Trial(row.stage, seed, round(killed_at, 2), killed, after_kill, r.returncode, after_rerun,
                 (r.stdout + r.stderr)[-3000:] if r.returncode else "")


def _run_and_kill(row: Row, config: Path, rwd: WorkDir, work: Path, delay: float,
                  timeout: float) -> tuple[bool, float]:
    """Start the stage on a fresh copy of its inputs; SIGKILL its process group `delay` s
    after its folder appears. (killed, seconds from start to the kill or the end)."""
    if work.exists():
        shutil.rmtree(work)
    workdir = WorkDir(work)
    for s in row.inputs:
        shutil.copytree(rwd.stage_dir(s), workdir.stage_dir(s))
    d = workdir.stage_dir(row.stage)
    t0 = time.monotonic()
    proc = subprocess.Popen(command(row, config, work), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    appeared = None
    while proc.poll() is None:
        now = time.monotonic()
        if appeared is None and d.exists():
            appeared = now
        if (appeared is not None and now - appeared >= delay) or now - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    proc.wait()
    killed = proc.returncode == -signal.SIGKILL
    _reap(proc.pid)
    return killed, time.monotonic() - t0


def _reap(pgid: int) -> None:
    """Make sure nothing of the killed group is left (engine processes die with it)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _input_bytes(p: Path, rel: str) -> bytes:
    """A copied input's bytes, but for the one section a later stage writes by design: stage 06's
    table in the exported model card, between its markers (eagle3/serving/model_card.py)."""
    data = p.read_bytes()
    if rel != CARD_NAME:
        return data
    text = data.decode()
    begin, end = text.find(EVALUATE_BEGIN), text.find(EVALUATE_END)
    return (text[:begin] + text[end:]).encode() if 0 <= begin < end else data


def _inputs_changed(workdir: WorkDir, ref: WorkDir, stages: tuple[str, ...]) -> list[str]:
    """The upstream stages' folders (copied from the reference) must come out of the trial as they went in."""
    bad = []
    for s in stages:
        d, rd = workdir.stage_dir(s), ref.stage_dir(s)
        mine = {_rel(p, d): _input_bytes(p, _rel(p, d)) for p in d.rglob("*") if p.is_file()}
        theirs = {_rel(p, rd): _input_bytes(p, _rel(p, rd)) for p in rd.rglob("*") if p.is_file()}
        if mine != theirs:
            changed = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            bad.append(f"{d}: input files changed by the stage: {changed[:5]}")
    return bad


def _manifest_problems(workdir: WorkDir, stage: str, *, final: bool = False) -> list[str]:
    """A manifest that exists must be whole and describe files that are all there (after a rerun: must exist)."""
    from eagle3.artifacts.manifest import sha256_file

    path = workdir.manifest(stage)
    if not path.exists():
        return [f"{path}: missing after the rerun"] if final else []
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return [f"{path}: partial manifest ({e})"]
    bad = []
    for rel, info in m["outputs"].items():
        f = workdir.stage_dir(stage) / rel
        if not f.is_file() or f.stat().st_size != info["bytes"] or (info["sha256"] and sha256_file(f) != info["sha256"]):
            bad.append(f"{f}: does not match the manifest")
    return bad


# -- the reference and one trial per stage, on two workers -------------------------------------
def run_plan(config: Path, root: Path, rows=ROWS, seeds: dict[str, int] | None = None, workers: int = 2,
             timeout: float = 600) -> tuple[dict[str, Timing], dict[str, Trial]]:
    """Reference runs of every stage (in `root/ref`) and one trial per row (in `root/trial-STAGE`).

    A task starts when the tasks it needs are done: a stage's reference after its upstream
    references, a trial after its own stage's reference (its kill point is drawn from that
    run's duration). Free workers take the first ready task of the critical path (the
    reference chain, then stage 06's trial), then the other trials. The stages are small, so
    two at once on two cores share the CPU well; each waits on imports and engine starts.
    """
    seeds = seeds or {}
    ref = root / "ref"
    by_stage = {r.stage: r for r in rows}
    tasks: list[tuple[str, str, tuple[str, ...]]] = [("ref", r.stage, r.inputs) for r in rows]
    last = rows[-1].stage
    tasks += [("trial", last, (last,))] + [("trial", r.stage, (r.stage,)) for r in rows if r.stage != last]
    done_refs: set[str] = set()
    timings: dict[str, Timing] = {}
    trials: dict[str, Trial] = {}
    errors: list[BaseException] = []
    lock = threading.Condition()

    def next_task():
        with lock:
            while True:
                if errors or not tasks:
                    return None
                for t in tasks:
                    if all(s in done_refs for s in t[2]):
                        tasks.remove(t)
                        return t
                lock.wait()

    def worker():
        while (t := next_task()) is not None:
            kind, stage, _ = t
            try:
                row = by_stage[stage]
                if kind == "ref":
                    timings[stage] = reference_run(row, config, ref, timeout)
                else:
                    trials[stage] = trial(row, config, ref, timings[stage], root / f"trial-{stage}",
                                          seeds.get(stage, 0), timeout)
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
                with lock:
                    errors.append(e)
                    lock.notify_all()
                return
            with lock:
                if kind == "ref":
                    done_refs.add(stage)
                lock.notify_all()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return timings, trials
