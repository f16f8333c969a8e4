"""Stage 06's speed verdicts do not flip on noise and cannot be faked by load: the speedup and
the break-even carry 95% intervals paired over the timed prompts, an interval holding 1.0 (or
L* overlapping L) says "no difference shown", the plain and the drafter's requests interleave
(eagle3/stages/s06_evaluate/timing.py), and passes that disagree give "timings unreliable: no
verdict" and no speed figure (figures.py, report.py, the model card's table, the demo summary).
Pure functions on fabricated passes, and the timing loop driven by a fake engine and a fake
clock (no engine, no sleeping); well under a second."""
from __future__ import annotations

import numpy as np
import pytest

from eagle3.stages.s06_evaluate.figures import MAX_PASS_DISAGREEMENT, paired_ratio_interval, run_figures, timing_figures
from eagle3.stages.s06_evaluate.report import NO_VERDICT, card_table, report_lines, summarise
from eagle3.stages.s06_evaluate.timing import Block, pass_segments, schedule, serve_blocks
from eagle3.demo.summary import served_lines, verdict_lines

K = 3


def timed_pass(walls: list[float], tokens: int, steps: list[int] | None, step_s: list[float]) -> dict:
    """One single-stream pass: request i takes walls[i] s for `tokens` tokens, its decode
    `step_s[i]` s per step (`steps[i]` verification steps, or tokens - 1 plain steps)."""
    n = len(walls)
    plain_steps = [tokens - 1] * n
    st = steps or plain_steps
    ts = [[100.0 + 10 * i, 100.0 + 10 * i + s * c] for i, (s, c) in enumerate(zip(st, step_s))]
    hists = [[0, s, 0, 0] for s in steps] if steps else None  # one accepted draft per step
    return {"wall_s": sum(walls), "request_wall_s": walls, "token_ts": ts, "tokens": [[1] * tokens] * n,
            "histograms": hists}


def summary(runs: dict) -> dict:
    return summarise(runs, K, [0.0], {"value": None, "k": K}, {"count": 60, "category_field": None},
                     {"dtype": "bfloat16"}, {"name": "vllm", "version": "0.32.0", "platform": "cpu"}, {})


def results_for(plain_walls, spec_walls, plain_step, spec_step, L=2.0, ci=0.05) -> dict:
    """Two identical timed passes per configuration (the passes agree) and a greedy acceptance."""
    tokens = 33
    plain = timing_figures([timed_pass(plain_walls, tokens, None, plain_step)] * 2, K, speculative=False)
    spec = timing_figures([timed_pass(spec_walls, tokens, [16] * len(spec_walls), spec_step)] * 2, K,
                          speculative=True)
    acc = {"temperature": 0.0, "acceptance_length": L, "ci95": ci, "acceptance_per_position": [L - 1, 0, 0],
           "tokens": 1, "wall_s": 1.0,
           "by_category": {}}
    runs = {"plain": {"acceptance": [{"temperature": 0.0, "tokens": 1, "wall_s": 1.0}], "timing": plain},
            "trained": {"acceptance": [acc], "timing": spec}}
    return summary(runs)


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
    assert clear["speedup"] == pytest.approx(1.5, rel=0.05) and clear["timing_problems"] == []
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


# -- interleaved timing under load ---------------------------------------------------------------

def test_each_prompt_is_served_on_both_engines_back_to_back_and_neither_always_goes_first():
    blocks = schedule([3, 5, 8], passes=2, runs=["plain", "trained"])
    assert blocks[:6] == [Block(0, 3, "plain"), Block(0, 3, "trained"), Block(0, 5, "trained"),
                          Block(0, 5, "plain"), Block(0, 8, "plain"), Block(0, 8, "trained")]
    # The second pass flips every pair: each prompt goes first on each engine once.
    assert [b.run for b in blocks[6:]] == ["trained", "plain", "plain", "trained", "trained", "plain"]
    assert [(b.timing_pass, b.prompt) for b in blocks[::2]] == [(n, i) for n in (0, 1) for i in (3, 5, 8)]


PREFILL_S, PLAIN_STEP_S, DRAFTED_STEP_S = 0.02, 0.010, 0.012
NEW_TOKENS, DRAFTED_STEPS = 33, 16  # 32 decode tokens: 32 plain steps, or 16 verification steps accepting 1 draft each
TRUE_SPEEDUP = (PREFILL_S + 32 * PLAIN_STEP_S) / (PREFILL_S + DRAFTED_STEPS * DRAFTED_STEP_S)
TRUE_BREAK_EVEN = DRAFTED_STEP_S / PLAIN_STEP_S


class FakeMachine:
    """An engine pair and a clock: a request takes its prefill and decode steps times
    `slowdown(now, run)` (other load on the machine), and the clock advances by that much."""

    def __init__(self, slowdown=lambda now, run: 1.0):
        self.now = 0.0
        self.slowdown = slowdown

    def clock(self) -> float:
        return self.now

    def serve(self, run: str, prompt: int) -> dict:
        factor = self.slowdown(self.now, run)
        drafted = run != "plain"
        decode_s = (DRAFTED_STEPS * DRAFTED_STEP_S if drafted else (NEW_TOKENS - 1) * PLAIN_STEP_S) * factor
        first = self.now + PREFILL_S * factor
        self.now = first + decode_s
        return {"tokens": [prompt] * NEW_TOKENS, "token_ts": [first, self.now],
                "histogram": [0, DRAFTED_STEPS, 0, 0] if drafted else None}


def measure(machine: FakeMachine, blocks: list[Block]) -> dict:
    """What stage 06 makes of the timed passes (figures.py's `run_figures`, report.py's `summarise`)."""
    passes = serve_blocks(blocks, machine.serve, clock=machine.clock)
    acceptance = {"temperature": 0.0, "wall_s": 1.0, "tokens": [[1]] * 4, "histograms": [[0, 4, 0, 0]] * 4,
                  "counters": {"vllm:spec_decode_num_drafts": 16, "vllm:spec_decode_num_accepted_tokens": 16,
                               "vllm:spec_decode_num_accepted_tokens_per_pos": [16, 0, 0]}}
    raw = {"plain": {"init_s": 1.0, "acceptance": [{"temperature": 0.0, "wall_s": 1.0, "tokens": [[1]] * 4}],
                     "timing": passes["plain"]},
           "trained": {"init_s": 1.0, "acceptance": [acceptance], "timing": passes["trained"]}}
    return summary(run_figures(raw, K, [None] * 4, [0.0]))


TIMED = list(range(12))
PAIR_S = 2 * PREFILL_S + (NEW_TOKENS - 1) * PLAIN_STEP_S + DRAFTED_STEPS * DRAFTED_STEP_S  # one prompt on both


def test_on_an_idle_machine_the_interleaved_passes_give_the_true_speedup_and_break_even():
    r = measure(FakeMachine(), schedule(TIMED, 2, ["plain", "trained"]))
    assert r["timing_problems"] == [] and r["timing"]["passes"] == 2
    assert r["speedup"] == pytest.approx(TRUE_SPEEDUP) and r["speedup_verdict"] == "faster"
    assert r["break_even_acceptance_length"] == pytest.approx(TRUE_BREAK_EVEN) and r["beats_break_even"] is True
    assert r["timing"]["pass_speedups"] == pytest.approx([TRUE_SPEEDUP] * 2)


def test_a_slowdown_while_one_configuration_runs_gives_no_verdict_anywhere():
    """The issue's demo: a machine slowed while the plain requests ran read as a 4.2x speedup.
    Here the load keeps time with the plain engine's requests during the first pass only (it
    stops in the second): the passes disagree, and the report, the model card and the demo
    summary say so instead of giving a speedup or a break-even."""
    first_pass_s = len(TIMED) * PAIR_S
    machine = FakeMachine(lambda now, run: 3.0 if run == "plain" and now < first_pass_s else 1.0)
    r = measure(machine, schedule(TIMED, 2, ["plain", "trained"]))
    ups = r["timing"]["pass_speedups"]
    assert ups[0] > MAX_PASS_DISAGREEMENT * ups[1] and ups[1] == pytest.approx(TRUE_SPEEDUP)
    assert r["timing_problems"] == ["the 2 interleaved timing passes' speedups by 100% and break-evens L* by 100% "
                                    "differ (largest over smallest); passes of identical work agree within 20%"]
    for key in ("speedup", "speedup_ci95", "speedup_verdict", "break_even_acceptance_length", "break_even_ci95",
                "beats_break_even", "decode_speedup"):
        assert r[key] is None, key
    assert r["tokens_per_s"]["plain"] is None and r["tokens_per_s"]["speculative"] is None
    assert r["acceptance_length"] == pytest.approx(2.0)  # acceptance is unaffected

    report = "\n".join(report_lines(r))
    assert f"(single stream, 12 of 60 prompts in 2 interleaved passes, greedy): {NO_VERDICT}" in report
    assert "UNRELIABLE TIMINGS: the 2 interleaved timing passes' speedups" in report
    assert "x [" not in report and "-> speedup" not in report and "break-even acceptance length" not in report
    card = card_table(r, "2026-12-06")
    assert f"12 prompts timed in 2 interleaved passes: {NO_VERDICT} (the 2 interleaved" in card
    assert "tokens/s without" not in card and "; speedup " not in card and "Break-even acceptance length" not in card
    served = "\n".join(served_lines(r))
    verdict = "\n".join(verdict_lines(r))
    assert f"tokens/s            {NO_VERDICT}: the 2 interleaved" in served and "break-even   " not in served
    assert f"speed and break-even: {NO_VERDICT}" in verdict and "L*" not in verdict


def test_a_slowdown_of_the_whole_machine_cancels_in_the_pairs():
    """A load over a stretch of time, whatever ran: timed one configuration after the other (as
    stage 06 did before), a load for as long as the plain passes took fakes a speedup that
    agreeing passes cannot reveal; interleaved, it slows both halves of every pair it spans
    and the verdict is the idle machine's."""
    plain_passes_s = 2 * len(TIMED) * (PREFILL_S + (NEW_TOKENS - 1) * PLAIN_STEP_S) * 3.0

    def load(now, run):
        return 3.0 if now < plain_passes_s else 1.0

    one_after_the_other = [Block(n, i, run) for run in ("plain", "trained") for n in (0, 1) for i in TIMED]
    faked = measure(FakeMachine(load), one_after_the_other)
    assert faked["timing_problems"] == [] and faked["speedup"] > 2 * TRUE_SPEEDUP  # agreeing passes, wrong
    r = measure(FakeMachine(load), schedule(TIMED, 2, ["plain", "trained"]))
    assert r["timing_problems"] == [] and r["speedup_verdict"] == "faster" and r["beats_break_even"] is True
    assert r["speedup"] == pytest.approx(TRUE_SPEEDUP, rel=0.05)
    assert r["break_even_acceptance_length"] == pytest.approx(TRUE_BREAK_EVEN, rel=0.05)


def test_one_timed_pass_is_not_enough_for_a_verdict():
    r = measure(FakeMachine(), schedule(TIMED, 1, ["plain", "trained"]))
    assert r["timing_problems"] == ["1 timed pass: nothing to check it against (--timed-passes 2 or more)"]
    assert r["speedup"] is None and r["break_even_acceptance_length"] is None


def serve_plan(machine: FakeMachine, timing_order: str, tmp_path, monkeypatch) -> dict:
    """Stage 06's plan of worker runs (run.py) served by a fake engine on `machine`: the runs'
    timing blocks in order, each engine's passes gathered over its starts, then the figures."""
    from pathlib import Path

    from eagle3.artifacts.workdir import WorkDir
    from eagle3.stages.s06_evaluate import run as stage
    from eagle3.stages.s06_evaluate.config import EvaluateConfig

    cfg = EvaluateConfig(work_dir=tmp_path, target_model="t", temperature=[0.0], baseline_untrained=False,
                         timing_order=timing_order)
    acceptance = {"temperature": 0.0, "wall_s": 1.0, "tokens": [[1]] * 4, "histograms": [[0, 4, 0, 0]] * 4,
                  "counters": {"vllm:spec_decode_num_drafts": 16, "vllm:spec_decode_num_accepted_tokens": 16,
                               "vllm:spec_decode_num_accepted_tokens_per_pos": [16, 0, 0]}}
    starts = []

    def run_engine(name, req, workdir, cfg):
        starts.append((name, [e["name"] for e in req["engines"]]))
        passes = serve_blocks([Block(*b) for b in req["timing_blocks"]], machine.serve, clock=machine.clock)
        return {"vllm_version": "0.32.0", "platform": "cpu", "runs": {e["name"]: {
            "init_s": 1.0, "timing": passes.get(e["name"], []),
            "acceptance": [acceptance if e["drafter"] else {**acceptance, "histograms": None}] * len(e["temperatures"])}
            for e in req["engines"]}}

    monkeypatch.setattr(stage, "run_engine", run_engine)
    plan = stage._plan_runs(WorkDir(tmp_path), cfg, Path("drafter"), TIMED)
    raw = stage._serve(plan, {}, WorkDir(tmp_path), cfg)
    r = summary(run_figures(raw, K, [None] * 4, [0.0]))
    return {**r, "starts": starts}


def test_one_engine_at_a_time_the_passes_alternate_and_a_load_during_one_start_gives_no_verdict(tmp_path, monkeypatch):
    """--timing-order passes, for a target that cannot be served twice at once: whole passes,
    one engine start each, in the order plain, trained, trained, plain (an engine that ends one
    pass and starts the next keeps running). Idle, the verdict is the true one; a load during
    the first start (the plain engine's first pass) makes the passes disagree."""
    assert pass_segments(2, ["plain", "trained"]) == [("plain", [0]), ("trained", [0, 1]), ("plain", [1])]
    assert pass_segments(3, ["plain", "trained"]) == [("plain", [0]), ("trained", [0, 1]), ("plain", [1, 2]),
                                                      ("trained", [2])]
    idle = serve_plan(FakeMachine(), "passes", tmp_path, monkeypatch)
    assert idle["starts"] == [("plain", ["plain"]), ("trained", ["trained"]), ("plain.2", ["plain"])]
    assert idle["timing_problems"] == [] and idle["speedup"] == pytest.approx(TRUE_SPEEDUP)
    assert idle["acceptance_length"] == pytest.approx(2.0) and idle["timing"]["passes"] == 2
    first_start_s = len(TIMED) * (PREFILL_S + (NEW_TOKENS - 1) * PLAIN_STEP_S) * 3.0
    loaded = serve_plan(FakeMachine(lambda now, run: 3.0 if now < first_start_s else 1.0), "passes", tmp_path,
                        monkeypatch)
    assert loaded["timing_problems"] and loaded["speedup"] is None and loaded["break_even_acceptance_length"] is None
    # The default order: one worker, both engines alive, the same verdicts.
    pairs = serve_plan(FakeMachine(), "pairs", tmp_path, monkeypatch)
    assert pairs["starts"] == [("plain+trained", ["plain", "trained"])]
    assert pairs["speedup"] == pytest.approx(TRUE_SPEEDUP) and pairs["timing_problems"] == []
