"""One command on one box: extract round i, train on it, delete it, next; resumable.

    python -m eagle3.tools.window_loop --config C --disk-budget 2TB \\
        [--extract-args "--tensor-parallel-size 8"] [--train-args "..."] [--nproc-per-node 8]

Runs the numbered scripts in turn, each in its own process (so the target's engine and
the trainer never hold the GPUs at once): `02_extract_hidden_states.py --window i`, then
`04_train_drafter.py` (under `torchrun --nproc-per-node N` when N > 1), which trains
round i, saves the checkpoint that covers it, deletes the round's folder and stops at
round i + 1, not yet extracted. Then the next round, until stage 04 writes its manifest.

Killed anywhere (inside either stage, between them, during a deletion), the same
command continues: stage 02 keeps the complete files of the round it was writing, stage
04 resumes from its last checkpoint, and `windows/progress.json` (written by stage 04
after the covering checkpoint) says which round is next. When the newest checkpoint is
unreadable, stage 04 resumes an older one and rewrites progress.json down to it; the loop
then extracts the rounds after it again (they were deleted once trained) and goes on. The final weights equal those
of an unbroken run (tests/e2e/test_windows.py).

Reads the config and the work dir's window plan and progress; writes
`WORK/logs/window_loop.log` (appended across reruns): per round its tokens, the seconds
of extraction and training, the store's peak bytes on disk while it ran (sampled every
0.2 s) and the checkpoint that covers it. Each stage appends its own log to
`WORK/logs/NN_stage.log`. Each round starts the target's engine once (the engine-restart
cost: docs/OPERATIONS.md).
"""
from __future__ import annotations

import argparse
import logging
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from eagle3.artifacts import windows
from eagle3.artifacts.workdir import REPO_ROOT, WorkDir
from eagle3.core.config import build_config
from eagle3.core.errors import PipelineError
from eagle3.core.logs import log_to_file, setup_logging
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s02_extract.config import ExtractConfig

log = logging.getLogger("eagle3.window_loop")


class PeakDisk:
    """The largest size the store folders reached while running (a sampling thread)."""

    def __init__(self, dirs: list[Path], every_s: float = 0.2):
        self.dirs, self.every_s, self.peak = dirs, every_s, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.peak = max(self.peak, sum(windows.dir_bytes(d) for d in self.dirs if d.is_dir()))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self):
        self._sample()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sample()


def _run(cmd: list[str], what: str) -> None:
    log.info("%s: %s", what, shlex.join(cmd))
    rc = subprocess.call(cmd, cwd=REPO_ROOT)
    if rc != 0:
        raise PipelineError(f"{what} exited with status {rc} ({shlex.join(cmd)}); its log is in the work dir's "
                            f"logs/ folder. Fix the cause and rerun this command: it continues where it stopped.")


def file_stamp(path: Path) -> tuple | None:
    """What identifies one writing of a file: its inode, size and modification time, or None
    when it is missing. Only compared with another stamp of the same file, never with this
    machine's clock: on a network file system the server sets the time, by its own clock."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def written_since(path: Path, stamp_at_start: tuple | None) -> bool:
    """True when `path` exists and was (re)written after `stamp_at_start` was taken."""
    now = file_stamp(path)
    return now is not None and now != stamp_at_start


def run_loop(args) -> int:
    overrides = {"work_dir": args.work_dir, "disk_budget": args.disk_budget}
    cfg = build_config(ExtractConfig, "extract", args.config, overrides, sections=STAGE_CONFIGS)
    if cfg.disk_budget is None:
        raise PipelineError("the window loop needs a disk budget: pass --disk-budget (e.g. 2TB) or set "
                            "extract.disk_budget in the config.")
    workdir = WorkDir(Path(cfg.work_dir).resolve())  # the scripts run from the repository root
    log_to_file(workdir.log_file("window_loop"))
    common = (["--config", str(Path(args.config).resolve())] if args.config else []) + ["--work-dir", str(workdir.root)]
    extract = [sys.executable, WorkDir.script("extract"), *common, "--disk-budget", str(cfg.disk_budget),
               *shlex.split(args.extract_args)]
    train_head = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc_per_node)]
                  if args.nproc_per_node > 1 else [sys.executable])
    train = [*train_head, WorkDir.script("train"), *common, *shlex.split(args.train_args)]
    wdir = windows.windows_dir(workdir.store(), cfg.windows_dir)
    dirs = [workdir.store()] + ([wdir] if cfg.windows_dir else [])
    manifest = workdir.manifest("train")
    manifest_at_start = file_stamp(manifest)  # stage 04's manifest, written anew when the last round is trained
    while True:
        plan = windows.read_plan(workdir.store())
        trained = windows.read_progress(wdir)["trained_rounds"]
        if plan is not None and (trained >= plan.rounds or written_since(manifest, manifest_at_start)):
            if not manifest.is_file():  # every round trained, the manifest not yet written (killed just before)
                _run(train, "stage 04")
            log.info("window loop: done, %d round(s) trained -> %s", trained, workdir.stage_dir("train"))
            return 0
        r = trained
        with PeakDisk(dirs) as peak:
            t0 = time.perf_counter()
            _run([*extract, "--window", str(r)], f"stage 02, round {r}")
            t1 = time.perf_counter()
            _run(train, f"stage 04, round {r}")
            t2 = time.perf_counter()
        plan = windows.read_plan(workdir.store())
        progress = windows.read_progress(wdir)
        if progress["trained_rounds"] < r:
            # Stage 04 resumed an older checkpoint than the one progress.json named (that one was
            # unreadable: a power loss, a torn copy) and rewrote progress.json down to it; the
            # rounds after it were deleted once trained, so they are extracted again, from here.
            log.warning("window loop: stage 04 rewound to %s, which covers %d round(s) (its log says which checkpoint "
                        "it skipped and why): round %d is extracted and trained again, then the ones after it",
                        progress.get("checkpoint"), progress["trained_rounds"], progress["trained_rounds"])
            continue
        if progress["trained_rounds"] == r and not written_since(manifest, manifest_at_start):
            raise PipelineError(f"stage 04 stopped before finishing round {r} ({wdir / windows.PROGRESS_JSON} says "
                                f"{progress['trained_rounds']} round(s) trained); see {workdir.log_file('04_train')}.")
        w = plan.window_of(r)
        log.info("window loop: round %d/%d (window %d, pass %d): %d samples, %d tokens; extract %.1f s, train %.1f s; "
                 "peak store disk %s (%d B; budget %s); covered by %s", r + 1, plan.rounds, r % plan.num_windows,
                 r // plan.num_windows, len(w["samples"]), w["tokens"], t1 - t0, t2 - t1, windows.human(peak.peak),
                 peak.peak, windows.human(plan.disk_budget), progress.get("checkpoint"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="the YAML file of the run (configs/*.yaml)")
    ap.add_argument("--work-dir", help="work dir (default: the config's)")
    ap.add_argument("--disk-budget", help="bytes the store may take (e.g. 2TB; default: extract.disk_budget)")
    ap.add_argument("--extract-args", default="", help="more flags for stage 02, one quoted string")
    ap.add_argument("--train-args", default="", help="more flags for stage 04, one quoted string")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="stage 04 under torchrun with this many processes")
    args = ap.parse_args(argv)
    setup_logging()
    try:
        return run_loop(args)
    except PipelineError as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
