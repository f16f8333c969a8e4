"""Which train-time-test length serves best at K = 3, at equal wall-clock.

    python bench/bench_ttt_budget.py --work-dir W [--config configs/tiny-llama.yaml]
                                     [--ttt 2,3,4,5,7] [--reference 3] [--calib-steps 12] [--equal-steps]

W is a work dir where stages 01-03 ran under --config (the `--tiny` demo's by default).
A longer unroll costs more per optimizer step, so comparing lengths at equal steps
favours the long ones unfairly: this bench gives every length the same training time.

1. Calibration: stage 04 runs `--calib-steps` steps at each length (log every 4 steps, no
   evaluation) and the median training tokens/s of its log windows after the first is
   taken as that length's rate.
2. Budget: the reference length trains the config's `max_steps`; every other length
   trains `max_steps x rate(K) / rate(reference)` steps, the same seconds of training.
3. Each length then runs as a lever of bench/bench_levers.py (stage 04 with those steps
   and `--ttt-steps K`, stage 05, stage 06 greedy at the config's K): served acceptance
   with its 95% interval, the paired difference to the reference length, and the verdict.

Prints the calibration table and the levers' table (its `04 s` column: each stage 04's
wall time, which shows how equal the budgets came out: on a shared machine the
calibration's few steps can be off by a factor 2-3). `--equal-steps` skips the
calibration and gives every length the config's steps: a longer unroll then gets more
compute than the reference, so a longer length served below it there is below it at
equal time too. A length whose stage 06 results exist is not rerun, so an interrupted
bench resumes (the calibration is redone).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_levers  # noqa: E402
from bench_levers import SHARED, report, run_lever, script  # noqa: E402


def calibrate(K: int, base: Path, out: Path, config: Path, steps: int) -> float:
    """Stage 04's training tokens/s at ttt_steps K (median over log windows after the first)."""
    workdir = out / f"calib-ttt-{K}"
    workdir.mkdir(parents=True, exist_ok=True)
    for stage in SHARED + ("03_vocab",):
        link = workdir / stage
        if (base / stage).exists() and not link.exists():
            link.symlink_to((base / stage).resolve(), target_is_directory=True)
    subprocess.run([sys.executable, str(script("04")), "--config", str(config), "--work-dir", str(workdir),
                    "--ttt-steps", str(K), "--max-steps", str(steps), "--log-every", "4", "--eval-every", "100000",
                    "--save-every", "100000", "--force"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rates = [json.loads(line).get("tokens_per_s") for line in (workdir / "04_train" / "metrics.jsonl").open()]
    rates = [r for r in rates if r]
    if len(rates) < 2:
        raise SystemExit(f"{workdir}/04_train/metrics.jsonl has {len(rates)} rate window(s); raise --calib-steps")
    return statistics.median(rates[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, default=ROOT / "work" / "tiny-llama")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-llama.yaml")
    ap.add_argument("--ttt", default="2,3,4,5,7", help="the train-time-test lengths to compare")
    ap.add_argument("--reference", type=int, default=3, help="the length that trains the config's max_steps")
    ap.add_argument("--calib-steps", type=int, default=12)
    ap.add_argument("--equal-steps", action="store_true",
                    help="no calibration: every length trains the config's max_steps (a longer unroll then gets "
                         "more compute than the reference)")
    ap.add_argument("--out", type=Path, help="where the work dirs go (default: W-ttt)")
    a = ap.parse_args()
    import yaml

    lengths = sorted({int(k) for k in a.ttt.split(",")} | {a.reference})
    base = a.work_dir.resolve()
    if not (base / "03_vocab" / "manifest.json").is_file():
        raise SystemExit(f"{base}/03_vocab/manifest.json is missing: run stages 01-03 of {a.config} in {base} first.")
    out = (a.out or base.with_name(base.name + "-ttt")).resolve()
    cfg = yaml.safe_load(a.config.read_text())
    ref_steps = int(cfg["train"]["max_steps"])
    served_k = int(cfg["evaluate"]["num_speculative_tokens"])

    t0 = time.perf_counter()
    if a.equal_steps:
        steps = {K: ref_steps for K in lengths}
        calib = [f"equal steps: every length trains {ref_steps} steps"]
    else:
        rate = {K: calibrate(K, base, out, a.config.resolve(), a.calib_steps) for K in lengths}
        steps = {K: max(1, round(ref_steps * rate[K] / rate[a.reference])) for K in lengths}
        calib = [f"{'ttt':>4}{'train tokens/s':>16}{'steps in the budget':>21}"]
        calib += [f"{K:>4}{rate[K]:>16.0f}{steps[K]:>21d}" for K in lengths]
    print(f"== budget ({time.perf_counter() - t0:.0f} s): {ref_steps} steps at ttt {a.reference}\n"
          + "\n".join(calib), flush=True)

    rows = []
    names = []
    for K in lengths:
        name = f"ttt-{K}" + ("" if K != a.reference else "-ref")
        bench_levers.LEVERS[name] = ([], ["--ttt-steps", str(K), "--max-steps", str(steps[K])])
        names.append(name)
    # bench_levers.report compares against the lever named "baseline": the reference length
    ref_name = f"ttt-{a.reference}-ref"
    bench_levers.LEVERS["baseline"] = bench_levers.LEVERS[ref_name]
    for name in ["baseline"] + [n for n in names if n != ref_name]:
        r, m04, secs = run_lever(name, base, out, a.config.resolve(), None, None, [])
        rows.append((name if name != "baseline" else f"ttt-{a.reference} (ref)", r, m04, secs))
    print(f"\n== train-time-test length at {'equal steps' if a.equal_steps else 'equal wall-clock'}, served greedy "
          f"at K = {served_k}, "
          f"{rows[0][1]['prompts']['count']} held-out prompts; work dirs under {out}")
    print("\n".join(calib))
    # report() looks rows up by work-dir name; restore the names it knows
    print("\n".join(report([("baseline" if n.endswith("(ref)") else n, r, m, s) for n, r, m, s in rows], out)))


if __name__ == "__main__":
    main()
