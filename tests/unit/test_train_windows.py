"""Stage 04's schedule over rounds (eagle3/stages/s04_train/windows.py): one step counter, known at step 0."""
import numpy as np

from eagle3.artifacts import windows
from eagle3.stages.s04_train.data import Batching
from eagle3.stages.s04_train.windows import RoundSchedule


def schedule(passes: int, epochs: int, trainable=None) -> RoundSchedule:
    lengths = [(13 * i) % 90 + 10 for i in range(200)]
    plan = windows.make_plan(lengths, [20] * 5, disk_budget=1_500_000, seed=3, passes=passes, windows_in_budget=1,
                             spf=8, H=64, A=3, dtype="bf16")
    ok = np.ones(len(lengths), dtype=bool) if trainable is None else trainable
    return RoundSchedule(plan, lengths, ok, Batching(256, 128, seed=5), rank=0, world=1, grad_accum=1,
                         epochs=epochs)


def test_rounds_follow_each_other_on_one_step_counter():
    s = schedule(passes=1, epochs=1)
    assert s.plan.rounds >= 3
    assert s.total == sum(s.steps) and s.starts == [sum(s.steps[:r]) for r in range(s.plan.rounds)]
    for r in range(s.plan.rounds):
        assert s.locate(s.starts[r]) == (r, 0) and s.locate(s.end(r) - 1) == (r, s.steps[r] - 1)
        assert s.rounds_done(s.end(r)) == r + 1 and s.rounds_done(s.end(r) - 1) == r
        seen = sorted(i for step in range(s.starts[r], s.end(r)) for b in s.micro_batches(step)[1] for i in b)
        assert seen == list(range(len(s.plan.window_of(r)["samples"])))  # one epoch: every sample once
    assert s.position(s.end(0)) == {"epoch": 0, "batch_in_epoch": s.steps[0]}


def test_passes_within_a_round_and_new_extractions_per_pass():
    one, within, again = schedule(1, 1), schedule(1, 2), schedule(2, 1)
    W = one.plan.num_windows
    assert sum(within.steps) >= 2 * sum(one.steps) - W  # two epochs per round (packing may differ by a row)
    assert again.plan.rounds == 2 * W and again.plan.window_of(W) == again.plan.window_of(0)
    # round W trains window 0 again, in another order than round 0
    first = [b for step in range(again.starts[0], again.end(0)) for b in again.micro_batches(step)[1]]
    second = [b for step in range(again.starts[W], again.end(W)) for b in again.micro_batches(step)[1]]
    assert sorted(i for b in first for i in b) == sorted(i for b in second for i in b) and first != second


def test_samples_without_a_loss_position_stay_out():
    keep = np.ones(200, dtype=bool)
    keep[::2] = False
    s = schedule(1, 1, keep)
    for r in range(s.plan.rounds):
        samples = s.plan.window_of(r)["samples"]
        seen = {i for step in range(s.starts[r], s.end(r)) for b in s.micro_batches(step)[1] for i in b}
        assert seen == {k for k, i in enumerate(samples) if keep[i]}
