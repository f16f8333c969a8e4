"""Two drafters served on the same prompts, read from two stage 06 folders (bench-only
helper of bench_levers.py and bench_quality.py). The paired interval itself is the
library's (eagle3/serving/acceptance_pairs.py, which stage 06's --select-checkpoint uses).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3.artifacts.workdir import WorkDir
from eagle3.serving.acceptance_pairs import paired_interval  # noqa: F401 - the benches import it from here
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


def verdict(lo: float, hi: float) -> str:
    return "better" if lo > 0 else "worse" if hi < 0 else "no difference shown"
