"""Stage 06's --select-checkpoint, its pure parts (eagle3/stages/s06_evaluate/selection.py) and
the paired interval it reports (eagle3/serving/acceptance_pairs.py): which checkpoints are
candidates, the table's figures, the choice, the card's line and stage 05's command line.
No engine runs (tests/e2e/test_evaluate.py serves two kept checkpoints); well under a second."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from fixtures import train_checkpoint

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.serving.acceptance_pairs import acceptance_length, paired_interval
from eagle3.stages.s04_train.checkpoint import save_checkpoint
from eagle3.stages.s06_evaluate import selection


def ckpt(step: int, evaluated: bool):
    return train_checkpoint({"fc.weight": torch.zeros(2, 2)}, {"hidden_size": 2}, step=step,
                            eval={"expected_accept_length": 1.0 + step / 100} if evaluated else {})


def test_candidates_are_the_evaluated_files_and_best_pt_when_pruned(tmp_path):
    workdir = WorkDir(tmp_path)
    for step, evaluated in ((10, True), (20, True), (25, False), (30, True), (40, True)):
        save_checkpoint(workdir, ckpt(step, evaluated), keep=1, is_best=step == 10, keep_evaluated=2)
    got = selection.candidates(workdir)
    assert [(c.step, c.path.name) for c in got] == [(10, "best.pt"), (30, workdir.checkpoint(30).name),
                                                    (40, workdir.checkpoint(40).name)]
    assert [c.held_out for c in got] == [1.1, 1.3, 1.4]


def test_fewer_than_two_candidates_are_refused_naming_the_setting(tmp_path):
    workdir = WorkDir(tmp_path)
    save_checkpoint(workdir, ckpt(10, True), keep=2, is_best=True)  # today's default: best.pt, its step file
    with pytest.raises(PipelineError, match="at least 2 evaluated checkpoints.*found 1.*--keep-evaluated"):
        selection.candidates(workdir)


def counts(accepted, steps):
    return np.array(accepted, float), np.array(steps, float)


def test_paired_interval_of_identical_runs_is_zero_and_other_prompts_are_refused():
    a = counts([3, 5, 1, 8], [4, 4, 4, 4])
    assert acceptance_length(a) == 1.0 + 17 / 16
    assert paired_interval(a, a) == (0.0, 0.0)
    lo, hi = paired_interval(counts([4, 6, 2, 9], [4, 4, 4, 4]), a)  # one more token accepted on every prompt
    assert lo == hi == pytest.approx(0.25)
    with pytest.raises(PipelineError, match="served 4 and 3 prompts"):
        paired_interval(a, counts([1, 2, 3], [4, 4, 4]))


def rows_for(served: dict[int, tuple]):
    cands = [selection.Candidate(s, f"/w/step-{s}.pt", 1.5) for s in served]
    return selection.compare(cands, served)


def test_the_table_pairs_each_with_the_last_and_the_choice_is_the_highest_served_later_on_a_tie():
    rows = rows_for({100: counts([4, 6, 2, 9], [4, 4, 4, 4]), 200: counts([4, 6, 2, 9], [4, 4, 4, 4]),
                     300: counts([3, 5, 1, 8], [4, 4, 4, 4])})
    assert [r["vs_last"] for r in rows][2] is None
    assert rows[0]["vs_last"] == pytest.approx([0.25, 0.25])
    chosen = selection.choose(rows)
    assert chosen["step"] == 200  # ties with 100, later
    line = selection.chosen_by(rows, chosen, 4)
    assert "of 3 kept checkpoints (steps 100, 200, 300) on 4 held-out prompts: 2.312 at step 200" in line
    assert "+0.250 against the last (step 300, 2.062), paired 95% interval [+0.250, +0.250]" in line
    text = "\n".join(selection.table_lines(rows, chosen))
    assert "200" in text.splitlines()[3] and "<- exported" in text.splitlines()[3]
    last_best = rows_for({100: counts([1, 1, 1, 1], [4, 4, 4, 4]), 200: counts([2, 2, 2, 2], [4, 4, 4, 4])})
    assert selection.chosen_by(last_best, selection.choose(last_best), 4).endswith("at step 200 (the last one)")


def test_stage_05_is_asked_for_the_last_exports_settings_with_the_chosen_checkpoint(tmp_path):
    params = {"work_dir": "/w", "target_model": "t", "trust_remote_code": False, "checkpoint": None,
              "out_dir": "/w/05_export", "include_embed_tokens": True, "base_model": None, "dtype": "bfloat16"}
    cmd = selection.export_command(params, tmp_path / "step-0000200.pt", "served best")
    assert cmd[1].endswith("05_export_drafter.py")
    args = cmd[2:]
    assert args[args.index("--checkpoint") + 1] == str(tmp_path / "step-0000200.pt")
    assert args[args.index("--chosen-by") + 1] == "served best"
    assert "--no-trust-remote-code" in args and "--include-embed-tokens" in args and "--base-model" not in args


def test_the_card_line_says_when_the_checkpoints_were_compared_on_prompts_of_their_own():
    rows = rows_for({100: counts([4, 6], [4, 4]), 200: counts([1, 1], [4, 4])})
    line = selection.chosen_by(rows, selection.choose(rows), 2, own_prompts=True)
    assert "on 2 held-out prompts of their own (not the measured ones): 2.250 at step 100" in line
    assert "of their own" not in selection.chosen_by(rows, selection.choose(rows), 2)


def test_selection_prompts_replace_the_measured_ones_only_for_the_choice(tmp_path):
    from eagle3.stages.s06_evaluate.config import EVAL_SPLIT, EvaluateConfig

    base = dict(work_dir=tmp_path, target_model="t", select_checkpoint=True, num_prompts=6)
    measured = EvaluateConfig(**base, prompts="bench.jsonl", category_field="category")
    assert measured.selection_config() is measured  # the default: choose on the measured prompts
    on_split = EvaluateConfig(**base, prompts="bench.jsonl", category_field="category", selection_prompts=EVAL_SPLIT)
    chooser = on_split.selection_config()
    assert (chooser.prompts, chooser.category_field, chooser.num_prompts) == (None, None, 6)
    assert on_split.prompts == "bench.jsonl"  # the measurement keeps its prompts
    on_file = EvaluateConfig(**base, selection_prompts="other.jsonl").selection_config()
    assert on_file.prompts == "other.jsonl" and on_file.select_checkpoint


@pytest.mark.parametrize("given, fix", [
    (dict(selection_prompts="eval-split"), "--select-checkpoint"),  # nothing to choose
    (dict(select_checkpoint=True, selection_prompts="eval-split"), "drop the flag"),  # the measured split itself
    (dict(select_checkpoint=True, prompts="a.jsonl", selection_prompts="a.jsonl"), "drop the flag"),
])
def test_selection_prompts_that_would_do_nothing_are_refused_with_the_fix(tmp_path, given, fix):
    from eagle3.stages.s06_evaluate.config import EvaluateConfig

    with pytest.raises(PipelineError, match=fix):
        EvaluateConfig(work_dir=tmp_path, target_model="t", **given)
