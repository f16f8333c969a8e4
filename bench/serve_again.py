"""Drafters already trained and served, served again on a second prompt set, paired.

    python bench/serve_again.py --work-dir W --drafter NAME=RUN [--drafter NAME=RUN ...] --pair A:B [--pair C:D ...]
                                [--prompts eval-split|FILE] [--out DIR] [--config C] [--target-model M]

When a lever's paired interval on the held-out prompts holds 0 by a few thousandths, more
prompts decide, not a rerun on the same ones. RUN is a work dir where stages 05 and 06 ran
(a lever of bench_levers.py, a side of bench_quality.py): its export is served again by
stage 06 (greedy, acceptance only, no untrained floor, no timing) on --prompts, by default
every assistant turn of stage 01's eval split in W (never trained on, and not the prompts
the first measurement used), in OUT/NAME, a work dir whose 00-03 folders are symlinks to
W's. The export is read through --drafter-dir, so its folder and model card stay as they
are. A drafter served there already is not served again, so an interrupted run resumes.

Prints per pair A:B (A minus B; pair drafters trained on the same seed: a lever and its
seed's baseline, or ours and a peer's): both acceptance lengths on the second set, their
difference with its paired 95% interval (the same prompts resampled together) on the first
set (RUN/06_evaluate), on the second, and on both pooled (one interval over the prompts of
both). With several pairs, also their mean difference, every pair resampled over the
same prompts at once: the lift averaged over the training seeds, its interval from the
prompts (three seeds are too few to resample).
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
from eagle3.serving.acceptance_pairs import PerPrompt, acceptance_length  # noqa: E402
from eagle3.serving.drafter_io import CONFIG_NAME  # noqa: E402

SHARED = ("00_generate", "01_dataset", "02_hidden_states", "03_vocab")


def export_of(run: Path) -> Path:
    """The drafter folder stage 05 wrote for RUN: its 05_export, or the --out-dir its manifest names."""
    if (run / "05_export" / CONFIG_NAME).is_file():
        return run / "05_export"
    recorded = Path(record_of(read_manifest(WorkDir(run), "export", needed_by="bench/serve_again.py")).drafter_dir)
    if not (recorded / CONFIG_NAME).is_file():
        raise SystemExit(f"{run}: its export is neither in 05_export nor at {recorded}, which its manifest names "
                         f"(a relative path is relative to where stage 05 ran)")
    return recorded


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


def mean_paired_interval(pairs: list[tuple[PerPrompt, PerPrompt]], resamples: int = 4000) -> tuple[float, float]:
    """95% interval of the mean over pairs of L_a - L_b, the prompts resampled together for
    every pair (the same prompts in each; seeded, as `paired_interval`)."""
    n = len(pairs[0][0][0])
    if any(len(x[0]) != n for pair in pairs for x in pair):
        raise SystemExit("every pair must be served on the same prompts")
    idx = np.random.default_rng(0).integers(0, n, size=(resamples, n))
    diff = np.mean([a[0][idx].sum(1) / a[1][idx].sum(1) - b[0][idx].sum(1) / b[1][idx].sum(1) for a, b in pairs],
                   axis=0)
    lo, hi = np.percentile(diff, [2.5, 97.5])
    return float(lo), float(hi)


def diff_cell(a: PerPrompt, b: PerPrompt) -> str:
    lo, hi = paired_interval(a, b)
    d = acceptance_length(a) - acceptance_length(b)
    return f"{d:+.3f} [{lo:+.3f}, {hi:+.3f}] {verdict(lo, hi)}"


def report(pairs: list[tuple[str, str]], runs: dict[str, Path], again: dict[str, Path]) -> list[str]:
    sets = {"first": {name: per_prompt(runs[name]) for name in runs},
            "second": {name: per_prompt(again[name]) for name in runs},
            "both": {name: pooled(runs[name], again[name]) for name in runs}}
    lines = [f"{'A - B':36s}{'A, second':>10s}{'B, second':>10s}  {'first set (paired 95%)':46s}"
             f"{'second set (paired 95%)':46s}{'both sets pooled (paired 95%)':46s}"]
    for a, b in pairs:
        second = sets["second"]
        lines.append(f"{a + ' - ' + b:36s}{acceptance_length(second[a]):>10.3f}{acceptance_length(second[b]):>10.3f}  "
                     + "".join(f"{diff_cell(c[a], c[b]):46s}" for c in sets.values()))
    if len(pairs) > 1:
        cells = []
        for counts in sets.values():
            both = [(counts[a], counts[b]) for a, b in pairs]
            d = float(np.mean([acceptance_length(x) - acceptance_length(y) for x, y in both]))
            lo, hi = mean_paired_interval(both)
            cells.append(f"{f'{d:+.3f} [{lo:+.3f}, {hi:+.3f}] {verdict(lo, hi)}':46s}")
        lines.append(f"{f'mean over the {len(pairs)} pairs':56s}  " + "".join(cells))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, required=True, help="the base work dir (stages 00-03; stage 01's "
                                                                 "eval split is the default second set)")
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=RUN",
                    help="a work dir where stages 05 and 06 ran, under a name; repeatable")
    ap.add_argument("--pair", action="append", required=True, metavar="A:B",
                    help="two of the NAMEs, reported as A minus B; repeatable")
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
    pairs = [tuple(p.split(":", 1)) for p in a.pair]
    bad = [p for p, pair in zip(a.pair, pairs) if len(pair) != 2 or not set(pair) <= set(runs)]
    if bad:
        raise SystemExit(f"--pair {bad}: give A:B, both among the drafters {list(runs)}")
    base = a.work_dir.resolve()
    out = (a.out or base.with_name(base.name + "-served-again")).resolve()
    again = {name: serve(name, run, base, out, a.config.resolve(), a.target_model, a.prompts)
             for name, run in runs.items()}
    count = len(per_prompt(next(iter(again.values())))[0])
    print(f"== {len(runs)} drafters served again on {a.prompts} ({count} prompts), greedy; work dirs under {out}")
    print("\n".join(report(pairs, runs, again)))


if __name__ == "__main__":
    main()
