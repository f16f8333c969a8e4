"""Soak: kill -9 every stage at several random points, rerun, compare with an unbroken run.

    python bench/soak_faults.py [--trials 5] [--stages prepare,extract] [--budget-s 1500] [--seed 1]
    python bench/soak_faults.py --windows [--scenarios kill,procs,ckpt,claim,force] [--trials 2] [--budget-s 900]

The short version (one kill per stage) runs in CI as tests/e2e/test_faults.py; this one runs
`--trials` seeded kill points per stage on the tiny Llama (built here) with the
harness's small settings (tests/fault_harness.py), stops starting trials when
`--budget-s` is spent, and prints trials / passes per stage and each failure. Run it
under the heavy lock on a shared machine: `flock /tmp/eagle3-heavy.lock python
bench/soak_faults.py`. Exit status 1 when any trial failed.

With --windows it runs the windows scenarios instead (bench/soak_windows.py: kill -9 of the
trainer and of a producer, a resume under 2 processes then 1, a truncated newest checkpoint,
a second producer on a claimed round, a --force from a second work dir on a shared windows
folder), each trial checked for a round lost, and prints their table.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import fault_harness as fh  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5, help="kill points per stage")
    ap.add_argument("--stages", default=None, help="comma-separated stage keys (default: all rows)")
    ap.add_argument("--budget-s", type=float, default=1500, help="stop starting trials after this many seconds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--chats", type=int, default=24, help="demo chats stage 00 regenerates (the CI test's 24)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--windows", action="store_true", help="the windows scenarios instead of the stage kills")
    ap.add_argument("--scenarios", default=None,
                    help="with --windows: comma-separated, of kill,procs,ckpt,claim,force (default: all)")
    a = ap.parse_args()

    from eagle3.demo.tiny import build_tiny_target

    if a.windows:
        return windows_soak(a, build_tiny_target)

    rows = [r for r in fh.ROWS if a.stages is None or r.stage in a.stages.split(",")]
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.work or tmp)
        root.mkdir(parents=True, exist_ok=True)
        target = build_tiny_target("llama", root / "target")
        config = fh.write_config(root / "config.yaml", target, fh.write_chats(root / "chats.jsonl", a.chats))
        # The reference needs every stage upstream of the chosen ones.
        needed = {s for r in rows for s in (*r.inputs, r.stage)}
        timings = fh.run_reference(config, root / "ref", [r for r in fh.ROWS if r.stage in needed])
        for s, t in timings.items():
            print(f"reference {s:9s} {t.total:6.1f} s (folder after {t.first_write:5.1f} s)", flush=True)
        results: dict[str, list[fh.Trial]] = {r.stage: [] for r in rows}
        for k in range(a.trials):
            for i, row in enumerate(rows):
                if time.monotonic() - t_start > a.budget_s:
                    break
                t1 = time.monotonic()
                t = fh.trial(row, config, root / "ref", timings[row.stage], root / f"trial-{row.stage}",
                             seed=a.seed * 1000 + k * 10 + i)
                results[row.stage].append(t)
                print(f"{row.stage:9s} trial {k}: kill at {t.killed_at:6.2f} s ({'killed' if t.killed else 'finished first'})"
                      f" -> {'pass' if t.passed else 'FAIL'} ({time.monotonic() - t1:.0f} s with the rerun)", flush=True)
                if not t.passed:
                    print(f"    after kill: {t.problems_after_kill}\n    rerun rc {t.rerun_rc}: {t.rerun_output[-800:]}"
                          f"\n    after rerun: {t.problems_after_rerun}", flush=True)
    print(f"\n== kill -9 soak: {time.monotonic() - t_start:.0f} s, seed {a.seed}")
    print(f"{'stage':10s} {'trials':>6s} {'killed':>6s} {'passes':>6s}")
    for stage, ts in results.items():
        print(f"{stage:10s} {len(ts):6d} {sum(t.killed for t in ts):6d} {sum(t.passed for t in ts):6d}")
    return 0 if all(t.passed for ts in results.values() for t in ts) else 1


def windows_soak(a, build_tiny_target) -> int:
    import soak_windows

    names = a.scenarios.split(",") if a.scenarios else list(soak_windows.SCENARIOS)
    unknown = sorted(set(names) - set(soak_windows.SCENARIOS))
    if unknown:
        sys.exit(f"--scenarios: no scenario {unknown}; they are {','.join(soak_windows.SCENARIOS)}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.work or tmp)
        root.mkdir(parents=True, exist_ok=True)
        target = build_tiny_target("llama", root / "target")
        ok = soak_windows.soak(root, target, names, a.trials, a.budget_s, a.seed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
