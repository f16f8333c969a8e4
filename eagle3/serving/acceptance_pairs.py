"""Two drafters served on the same prompts: the difference of their acceptance lengths with
its own 95% interval (stage 06's --select-checkpoint; bench/served_pairs.py for the benches).

One drafter's interval over prompts (about ±0.055 on the demo's 60 prompts) is mostly how
hard the prompts are, which two drafters share. Resampling the prompts together for both (a
percentile bootstrap over prompts, seeded: the same counts give the same interval) gives
their difference a far narrower interval. Each drafter is given per prompt as (accepted
draft tokens, verification steps), from the engine's per-request acceptance histograms.
"""
from __future__ import annotations

import numpy as np

from eagle3.core.errors import PipelineError

PerPrompt = tuple[np.ndarray, np.ndarray]  # (accepted draft tokens, verification steps), one entry per prompt


def acceptance_length(a: PerPrompt) -> float:
    """1 + accepted / steps over all prompts (the engine's own figure: a ratio of sums)."""
    return 1.0 + float(np.sum(a[0])) / float(np.sum(a[1]))


def paired_interval(a: PerPrompt, b: PerPrompt, resamples: int = 4000) -> tuple[float, float]:
    """95% interval of L_a - L_b over the same prompts, resampled together."""
    if len(a[0]) != len(b[0]):
        raise PipelineError(f"paired acceptance: the two runs served {len(a[0])} and {len(b[0])} prompts, not the "
                            f"same prompts; serve both drafters on one prompt set.")
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(a[0]), size=(resamples, len(a[0])))  # [R, P]
    diff = a[0][idx].sum(1) / a[1][idx].sum(1) - b[0][idx].sum(1) / b[1][idx].sum(1)  # [R]
    lo, hi = np.percentile(diff, [2.5, 97.5])
    return float(lo), float(hi)
