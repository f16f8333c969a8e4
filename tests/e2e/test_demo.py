"""The demo's closing summary (eagle3/demo/summary.py) on fabricated stage results: it judges the
run by what it measured and leaves out what was not measured. No engine; about 2 s;
the last test runs scripts/demo.sh itself with a stand-in python.
(tests/e2e/test_pipeline_e2e.py reads the summary of a real run.)"""
from __future__ import annotations

import json

from eagle3.artifacts.manifest import write_manifest
from eagle3.artifacts.records import EvaluateRecord, GenerateRecord, PrepareRecord, TrainRecord, VocabRecord
from eagle3.artifacts.workdir import WorkDir
from eagle3.demo.summary import served_lines, summary_text, verdict_lines


def results(**over) -> dict:
    """A results.json of stage 06 (eagle3/stages/s06_evaluate/report.py) with the figures the summary reads."""
    r = {
        "engine": {"name": "vllm", "version": "0.32.0", "platform": "cpu"}, "num_speculative_tokens": 3,
        "prompts": {"count": 60}, "acceptance_temperature": 0.0,
        "acceptance_length": 1.57, "acceptance_length_ci95": 0.05, "acceptance_per_position": [0.38, 0.14, 0.06],
        "untrained_acceptance_length": 1.0, "untrained_acceptance_per_position": [0.0, 0.0, 0.0],
        "acceptance": [], "categories": {"names": []},
        "expected_accept_length_training": {"value": 1.64, "k": 3, "ttt_steps": 3, "full_acc": [0.4, 0.16, 0.08]},
        "tokens_per_s": {"plain": 20.9, "speculative": 28.4}, "speedup": 1.35,
        "break_even_acceptance_length": 1.10, "beats_break_even": True, "timing_problems": [],
        "teacher": {"greedy_equals_dataset_answer": None}, "settings": {"dtype": "float32"},
    }
    r.update(over)
    return r


def test_no_hard_coded_goal_and_no_line_without_a_figure():
    text = "\n".join(served_lines(results()) + verdict_lines(results()))
    assert "goal" not in text and "2.3" not in text
    assert "teacher check" not in text  # no dataset answer to compare with: nothing to say
    r = results(teacher={"greedy_equals_dataset_answer": 0.25})
    assert any("teacher check       25.0% of the target's greedy answers" in line for line in served_lines(r))


def test_verdict_judges_trained_untrained_estimate_and_break_even():
    lines = verdict_lines(results())
    assert lines[0] == ("verdict   trained beats untrained: 1.57 ±0.05 vs 1.00 tokens per step; the drafter learned "
                        "what the target writes")
    assert lines[1] == "          served 1.57 ±0.05 vs the training-time estimate 1.64: 4.3% below it"
    assert lines[2] == ("          measured L 1.57 ±0.05 > break-even L* 1.10: drafting pays off on this machine; "
                        "speedup 1.35x single stream")
    close = verdict_lines(results(acceptance_length=1.62))
    assert "agrees with it (within the 95% interval)" in close[1]
    worse = verdict_lines(results(acceptance_length=1.03, speedup=0.8, beats_break_even=False))
    assert worse[0].startswith("verdict   trained does NOT beat untrained: 1.03 ±0.05 vs 1.00")
    assert "measured L 1.03 ±0.05 <= break-even L* 1.10: drafting does NOT pay off on this machine; speedup 0.80x" \
        in worse[2]
    # Stage 06 with paired speed intervals: overlapping intervals give no verdict either way.
    noisy = verdict_lines(results(acceptance_length=1.12, beats_break_even=None, break_even_ci95=[1.02, 1.19],
                                  speedup=0.97, speedup_ci95=[0.88, 1.07], speedup_verdict="no difference shown"))
    assert noisy[2] == ("          measured L 1.12 ±0.05 vs break-even L* 1.10 [1.02, 1.19]: no difference shown (the "
                        "95% intervals overlap; time more prompts with --timing-prompts, on an idle machine); "
                        "speedup 0.97x [0.88, 1.07]: no difference shown single stream")
    # Passes that disagree (stage 06 then writes no speed figure; results.json of earlier
    # versions kept them beside the problem): no speed figure and no verdict either way.
    unreliable = results(timing_problems=["the 2 interleaved timing passes' speedups by 40% differ"])
    lines = verdict_lines(unreliable)
    assert lines[2] == "          speed and break-even: timings unreliable: no verdict (see tokens/s above)"
    served = "\n".join(served_lines(unreliable))
    assert ("tokens/s            timings unreliable: no verdict: the 2 interleaved timing passes' speedups by 40% "
            "differ (other load on the machine?); rerun 06 with --force on an idle machine") in served
    assert "1.35x" not in served + "\n".join(lines) and "L* = " not in served


def test_verdict_leaves_out_what_was_not_measured():
    # A drafter from elsewhere, no untrained floor, no timing: only what was measured.
    alone = results(untrained_acceptance_length=None, untrained_acceptance_per_position=None,
                    expected_accept_length_training={"value": None, "k": 3}, break_even_acceptance_length=None,
                    speedup=None, tokens_per_s={"plain": None, "speculative": None})
    assert verdict_lines(alone) == []
    served = "\n".join(served_lines(alone))
    assert "untrained" not in served and "estimate" not in served and "tokens/s" not in served
    assert "break-even" not in served and "acceptance length   trained 1.57" in served
    assert verdict_lines(results(acceptance_length=None)) == [
        "verdict   the drafter's acceptance was not measured (see stage 06's log)"]


def test_summary_of_a_work_dir_where_only_stage_06_ran_and_of_a_full_one(tmp_path):
    workdir = WorkDir(tmp_path / "w")
    workdir.evaluate_dir().mkdir(parents=True)
    workdir.evaluate_results().write_text(json.dumps(results()))
    write_manifest(workdir, "evaluate", params={}, inputs={}, counts={}, outputs=[workdir.evaluate_results()],
                   record=EvaluateRecord(drafter_dir="/d", target_model="t"))
    alone = summary_text(workdir.root)
    assert "data " not in alone and "training " not in alone and "verdict   trained beats untrained" in alone
    assert "served    vllm 0.32.0 (cpu), target in float32, K = 3, greedy" in alone  # a demo.sh on an AVX2 CPU
    write_manifest(workdir, "generate", params={}, inputs={}, outputs=[], counts={}, record=GenerateRecord(
        target_model="t", tokenizer_fingerprint="f", chat_template_kwargs={}, stop_token_ids=[2], complete=True,
        num_chunks=1, missing_chunks=0, missing_shard_indices=[],
        turns_regenerated=1268, conversations=1012, new_turns=1268, generated_tokens=120000))
    write_manifest(workdir, "prepare", params={}, inputs={}, outputs=[], counts={}, record=PrepareRecord(
        target_model="t", tokenizer_fingerprint="f", vocab_size=32000, chat_template_kwargs={}, assistant_suffix=[2],
        records=1012, bad_records={}, samples={"train": 960, "eval": 52}, tokens={"train": 200000, "eval": 10000},
        assistant_tokens={"train": 110000, "eval": 5000}))
    write_manifest(workdir, "vocab", params={}, inputs={}, outputs=[], counts={}, record=VocabRecord(
        tokenizer_fingerprint="f", target_vocab_size=32000, draft_vocab_size=4096, coverage_train=0.99,
        coverage_eval=0.97))
    write_manifest(workdir, "train", params={}, inputs={}, outputs=[], counts={}, record=TrainRecord(
        ttt_steps=3, aux_layer_ids=[2, 4, 5], steps=150, best_expected_accept_length=1.7, best_step=150,
        best_eval=None, best_checkpoint="checkpoints/best.pt"))
    full = summary_text(workdir.root, elapsed_s=807, stage_times=[("00", 190.0)])
    assert ("answers   stage 00: the target answered 1268 turns of 1012 conversations itself (1268 of them prompts "
            "without an answer in the data)") in full
    assert "960 train / 52 held-out conversations" in full and "held-out 97.0%" in full
    assert "training  150 steps; best held-out expected accept length 1.700 (all 3 TTT steps) at step 150" in full
    assert "drafter /d" in full
    assert "wall time 13m27s" in full and "per stage  00 3m10s" in full and "goal" not in full



FAKE_PYTHON = """#!/bin/bash
# A stand-in for python3: the target builder writes a new marker, the bf16 probe says yes,
# every stage and the summary succeed without doing anything.
case "$*" in
    *eagle3.demo.tiny*) mkdir -p work/targets/tiny-llama && date +%s%N > work/targets/tiny-llama/TINY_TARGET.json ;;
    -c*) echo 1 ;;
esac
exit 0
"""


def test_a_rebuilt_target_moves_the_old_work_dir_aside_instead_of_deleting_it(tmp_path):
    """scripts/demo.sh, when it rebuilt the target, used to `rm -rf` the work dir computed from the
    previous one, with whatever else it held (a bench's runs inside it). It is moved aside, whole."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(root / "scripts" / "demo.sh", repo / "scripts" / "demo.sh")
    for n in ("01_prepare", "02_extract", "03_vocab", "04_train", "05_export", "06_evaluate"):
        (repo / f"{n}.py").write_text("")
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    kept = repo / "work" / "tiny-llama" / "bench_quality" / "run.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("48 minutes of a peer's training")
    (repo / "work" / "targets" / "tiny-llama").mkdir(parents=True)
    (repo / "work" / "targets" / "tiny-llama" / "TINY_TARGET.json").write_text("the previous target")
    p = subprocess.run(["bash", "scripts/demo.sh", "--tiny", "--skip-setup"], cwd=repo, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHON": str(python)})
    assert p.returncode == 0, p.stderr
    (aside,) = (repo / "work").glob("tiny-llama.previous-target-*")
    assert (aside / "bench_quality" / "run.json").read_text() == "48 minutes of a peer's training"
    assert f"moved to work/{aside.name}" in p.stderr
