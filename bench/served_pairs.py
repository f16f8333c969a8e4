"""Two drafters served on the same prompts: the difference of their acceptance lengths
with its own 95% interval (bench-only helper of bench_levers.py and bench_quality.py).

Stage 06's interval for one drafter (about ±0.055 on the demo's 60 prompts) is mostly
how hard the prompts are, which two drafters share. Resampling the prompts together for
both (a percentile bootstrap over prompts) gives their difference a far narrower
interval, from stage 06's per-request acceptance histograms.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3.artifacts.workdir import WorkDir
from eagle3.stages.s06_evaluate.engine import read_engine_result
from eagle3.stages.s06_evaluate.figures import histogram_counts


def per_prompt(work_dir: Path, temperature: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(accepted draft tokens, verification steps) per prompt of one stage-06 pass, in
    prompt order."""
    run = read_engine_result(WorkDir(work_dir), "trained")
    passes = [a for a in run["acceptance"] if a["temperature"] == temperature]
    if not passes or not passes[0].get("histograms"):
        raise SystemExit(f"{work_dir}/06_evaluate has no per-request histograms at T = {temperature:g}")
    hists = passes[0]["histograms"]
    counts = [histogram_counts(h, len(hists[0]) - 1) for h in hists]
    return np.array([c[1] for c in counts], float), np.array([c[0] for c in counts], float)


def paired_interval(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray],
                    resamples: int = 4000) -> tuple[float, float]:
    """95% interval of L_a - L_b over the same prompts, resampled together."""
    if len(a[0]) != len(b[0]):
        raise SystemExit(f"the two runs served {len(a[0])} and {len(b[0])} prompts: not the same prompts")
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(a[0]), size=(resamples, len(a[0])))  # [R, P]
    diff = a[0][idx].sum(1) / a[1][idx].sum(1) - b[0][idx].sum(1) / b[1][idx].sum(1)  # [R]
    lo, hi = np.percentile(diff, [2.5, 97.5])
    return float(lo), float(hi)


def verdict(lo: float, hi: float) -> str:
    return "better" if lo > 0 else "worse" if hi < 0 else "no difference shown"
