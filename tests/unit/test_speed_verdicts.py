"""Stage 06's speed verdicts do not flip on noise: the speedup and the break-even carry 95%
intervals paired over the timed prompts, and an interval holding 1.0 (or L* overlapping L)
says "no difference shown" (eagle3/stages/s06_evaluate/figures.py, report.py). Pure
functions on fabricated single-stream passes; well under a second."""
from __future__ import annotations

import numpy as np
import pytest

from eagle3.stages.s06_evaluate.figures import paired_ratio_interval, timing_figures
from eagle3.stages.s06_evaluate.report import report_lines, summarise

K = 3


def timed_pass(walls: list[float], tokens: int, steps: list[int] | None, step_s: list[float]) -> dict:
    """One single-stream pass: request i takes walls[i] s for `tokens` tokens, its decode
    `step_s[i]` s per step (`steps[i]` verification steps, or tokens - 1 plain steps)."""
    n = len(walls)
    plain_steps = [tokens - 1] * n
    st = steps or plain_steps
    ts = [[100.0 + 10 * i, 100.0 + 10 * i + s * c] for i, (s, c) in enumerate(zip(st, step_s))]
    hists = [[0, s, 0, 0] for s in steps] if steps else None  # one accepted draft per step
    counters = ({"vllm:spec_decode_num_drafts": sum(steps), "vllm:spec_decode_num_accepted_tokens": sum(steps),
                 "vllm:spec_decode_num_accepted_tokens_per_pos": [sum(steps), 0, 0]} if steps else {})
    return {"wall_s": sum(walls), "request_wall_s": walls, "token_ts": ts, "tokens": [[1] * tokens] * n,
            "counters": counters, "histograms": hists}


def results_for(plain_walls, spec_walls, plain_step, spec_step, L=2.0, ci=0.05) -> dict:
    tokens = 33
    plain = timing_figures([timed_pass(plain_walls, tokens, None, plain_step)], K, speculative=False)
    spec = timing_figures([timed_pass(spec_walls, tokens, [16] * len(spec_walls), spec_step)], K, speculative=True)
    acc = {"temperature": 0.0, "acceptance_length": L, "ci95": ci, "acceptance_per_position": [L - 1, 0, 0],
           "tokens": 1, "wall_s": 1.0,
           "by_category": {}}
    runs = {"plain": {"acceptance": [{"temperature": 0.0, "tokens": 1, "wall_s": 1.0}], "timing": plain},
            "trained": {"acceptance": [acc], "timing": spec}}
    return summarise(runs, K, [0.0], {"value": None, "k": K}, {"count": 60, "category_field": None},
                     {"dtype": "bfloat16"}, {"name": "vllm", "version": "0.32.0", "platform": "cpu"}, {})


def test_noisy_timings_give_no_verdict_and_a_clear_gain_gives_one():
    rng = np.random.default_rng(0)
    base = rng.uniform(1.0, 3.0, size=4)  # 4 prompts of different lengths
    # The same drafter timed on 4 prompts: per-prompt noise of +-10% around no gain at all.
    noise = np.array([0.90, 1.10, 0.95, 1.06])
    noisy = results_for(base.tolist(), (base * noise).tolist(), [0.01] * 4, (0.02 * noise[::-1]).tolist(),
                        L=2.0, ci=0.1)
    lo, hi = noisy["speedup_ci95"]
    assert lo < 1.0 < hi and noisy["speedup_verdict"] == "no difference shown"
    text = "\n".join(report_lines(noisy))
    assert "no difference shown" in text and "speedup " in text and "[" in text
    # L* = 2.0 +- noise against L = 2.0 +- 0.1: the intervals overlap, no verdict either way.
    assert noisy["beats_break_even"] is None and "break-even acceptance length" in text
    # 24 prompts all about 1.5x faster with little noise: a verdict, with the interval excluding 1.0.
    base = rng.uniform(1.0, 3.0, size=24)
    clear = results_for(base.tolist(), (base / 1.5 * rng.uniform(0.97, 1.03, size=24)).tolist(),
                        [0.01] * 24, [0.012] * 24, L=2.0, ci=0.05)
    assert clear["speedup_ci95"][0] > 1.0 and clear["speedup_verdict"] == "faster"
    assert clear["speedup"] == pytest.approx(1.5, rel=0.05)
    assert clear["break_even_acceptance_length"] == pytest.approx(1.2) and clear["beats_break_even"] is True
    assert clear["break_even_ci95"] == pytest.approx([1.2, 1.2], rel=1e-6)  # every prompt's step costs 1.2
    slow = results_for(base.tolist(), (base * 1.4).tolist(), [0.01] * 24, [0.03] * 24, L=2.0, ci=0.05)
    assert slow["speedup_verdict"] == "slower" and slow["beats_break_even"] is False


def test_pairing_cancels_what_both_runs_share():
    # Prompts of very different lengths, each 1.2x faster with the drafter: paired, the interval
    # is tight; the same walls shuffled between prompts (unpaired) would not be.
    rng = np.random.default_rng(1)
    walls = rng.uniform(0.5, 5.0, size=12)
    tokens = [64.0] * 12
    paired = paired_ratio_interval(tokens, list(walls / 1.2), tokens, list(walls))
    shuffled = paired_ratio_interval(tokens, list(rng.permutation(walls) / 1.2), tokens, list(walls))
    assert paired == pytest.approx((1.0, 1.0), abs=1e-9)
    assert shuffled[1] - shuffled[0] > 0.3
    assert paired_ratio_interval([1.0], [1.0], [1.0], [1.0]) is None  # one prompt: no interval
