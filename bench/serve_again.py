"""Drafters already trained and served, served again on a second prompt set, paired.

    python bench/serve_again.py --work-dir W --drafter NAME=RUN [--drafter NAME=RUN ...] --reference NAME
                                [--prompts eval-split|FILE] [--out DIR] [--config C] [--target-model M]

When a lever's paired interval on the held-out prompts holds 0 by a few thousandths, more
prompts decide, not a rerun on the same ones. RUN is a work dir where stages 05 and 06 ran
(a lever of bench_levers.py, a side of bench_quality.py): its export is served again by
stage 06 (greedy, acceptance only, no untrained floor, no timing) on --prompts, by default
every assistant turn of stage 01's eval split in W (never trained on, and not the prompts
the first measurement used), in OUT/NAME, a work dir whose 00-03 folders are symlinks to
W's. The export is read through --drafter-dir, so its folder and model card stay as they
are. A drafter served there already is not served again, so an interrupted run resumes.

Prints per drafter, against --reference: the acceptance length on the second set with its
95% interval, the difference with its paired interval (the same prompts resampled together),
and the two sets pooled: the first set's prompts (RUN/06_evaluate) and the second's, one
paired interval over all of them. Pair drafters trained on the same seed: the reference's
seed and the lever's, or ours and a peer's (the bench gives one --reference per call).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from served_pairs import paired_interval, per_prompt, verdict  # noqa: E402

from eagle3.artifacts.manifest import read_manifest, record_of  # noqa: E402
from eagle3.artifacts.workdir import WorkDir  # noqa: E402
from eagle3.serving.acceptance_pairs import acceptance_length  # noqa: E402

SHARED = ("00_generate", "01_dataset", "02_hidden_states", "03_vocab")


def export_of(run: Path) -> Path:
    """The drafter folder stage 05 wrote in RUN (its manifest says where)."""
    return Path(record_of(read_manifest(WorkDir(run), "export", needed_by="bench/serve_again.py")).drafter_dir)


def serve(name: str, run: Path, base: Path, out: Path, config: Path, target: str | None, prompts: str) -> Path:
    """Stage 06 of RUN's export on the second prompt set, in OUT/NAME -> that work dir."""
    workdir = out / name
    workdir.mkdir(parents=True, exist_ok=True)
    for stage in SHARED:
        link = workdir / stage
        if (base / stage).exists() and not link.exists():
            link.symlink_to((base / stage).resolve(), target_is_directory=True)
    if not WorkDir(workdir).evaluate_results().is_file():
        subprocess.run([sys.executable, str(next(ROOT.glob("06_*.py"))), "--config", str(config),
                        "--work-dir", str(workdir), "--drafter-dir", str(export_of(run)), "--prompts", prompts,
                        "--temperature", "0", "--no-baseline-untrained", "--timing-prompts", "0",
                        *(["--target-model", target] if target else [])], cwd=ROOT, check=True)
    return workdir


def pooled(first: Path, second: Path) -> tuple[np.ndarray, np.ndarray]:
    """One drafter's per-prompt counts over both prompt sets, the first set's prompts first."""
    a, b = per_prompt(first), per_prompt(second)
    return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])


def report(names: list[str], runs: dict[str, Path], again: dict[str, Path], reference: str) -> list[str]:
    ref_second, ref_both = per_prompt(again[reference]), pooled(runs[reference], again[reference])
    lines = [f"{'drafter':28s}{'second set L':>14s}{'vs ' + reference + ' (paired 95%)':>40s}"
             f"{'both sets pooled (paired 95%)':>40s}"]
    for name in names:
        second = per_prompt(again[name])
        row = f"{name:28s}{acceptance_length(second):>14.3f}"
        if name != reference:
            both = pooled(runs[name], again[name])
            for mine, theirs in ((second, ref_second), (both, ref_both)):
                lo, hi = paired_interval(mine, theirs)
                d = acceptance_length(mine) - acceptance_length(theirs)
                row += f"{f'{d:+.3f} [{lo:+.3f}, {hi:+.3f}] {verdict(lo, hi)}':>40s}"
        lines.append(row)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, required=True, help="the base work dir (stages 00-03; stage 01's "
                                                                 "eval split is the default second set)")
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=RUN",
                    help="a work dir where stages 05 and 06 ran, under a name; repeatable")
    ap.add_argument("--reference", required=True, help="the NAME every other drafter is paired against")
    ap.add_argument("--prompts", default="eval-split", help="stage 06's --prompts for the second set")
    ap.add_argument("--out", type=Path, help="where the new work dirs go (default: W-served-again)")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-135m.yaml")
    ap.add_argument("--target-model", help="override the config's target_model")
    a = ap.parse_args()
    runs = {}
    for item in a.drafter:
        name, sep, run = item.partition("=")
        if not sep or not name or name in runs:
            raise SystemExit(f"--drafter {item}: give NAME=RUN, each NAME once")
        if not WorkDir(Path(run)).evaluate_results().is_file():
            raise SystemExit(f"--drafter {item}: {run} has no 06_evaluate/results.json (the first set's "
                             f"measurement, pooled with the second)")
        runs[name] = Path(run).resolve()
    if a.reference not in runs:
        raise SystemExit(f"--reference {a.reference} is none of the drafters {list(runs)}")
    base = a.work_dir.resolve()
    out = (a.out or base.with_name(base.name + "-served-again")).resolve()
    again = {name: serve(name, run, base, out, a.config.resolve(), a.target_model, a.prompts)
             for name, run in runs.items()}
    count = len(per_prompt(again[a.reference])[0])
    print(f"== {len(runs)} drafters served again on {a.prompts} ({count} prompts), greedy; work dirs under {out}")
    print("\n".join(report(list(runs), runs, again, a.reference)))


if __name__ == "__main__":
    main()
