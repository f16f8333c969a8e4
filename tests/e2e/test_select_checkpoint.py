"""Stage 06 --select-checkpoint on the tiny Llama in vLLM's CPU build: stage 04 keeps its two
evaluated checkpoints (--keep-evaluated 2), each is served greedy on the same few held-out
prompts (stage 01's eval split, `--selection-prompts eval-split`, while the measurement after
it would serve a prompt file), and stage 05 exports the one served best, its model card
saying how it was chosen.

Two engine starts (one per checkpoint) and one stage 05 run; the figures of the full
measurement after it are tests/e2e/test_pipeline_e2e.py's. About 2 minutes on 2 idle cores.
"""
from __future__ import annotations

import json

from fixtures import copy_stages, run_stages

from eagle3.artifacts.manifest import read_manifest, record_of
from eagle3.artifacts.workdir import WorkDir
from eagle3.serving.model_card import CARD_NAME


def test_two_kept_checkpoints_are_served_and_the_best_is_exported_with_its_reason(tmp_path, stages_123, tiny_llama):
    from eagle3.stages.s06_evaluate.config import EVAL_SPLIT, EvaluateConfig
    from eagle3.stages.s06_evaluate.run import select_checkpoint

    work = copy_stages(stages_123, tmp_path / "work")
    run_stages(work, tiny_llama, first="train", upto="export",
               train=dict(max_steps=4, eval_every=2, keep_evaluated=2, learning_rate=3e-3))
    workdir = WorkDir(work)
    first_export = record_of(read_manifest(workdir, "export", needed_by="test")).checkpoint_step
    measured = tmp_path / "measured.jsonl"  # the measurement's prompts; the choice is made on others
    measured.write_text(json.dumps({"prompt": "Name three colours."}) + "\n")
    cfg = EvaluateConfig(work_dir=work, target_model=str(tiny_llama), select_checkpoint=True, num_prompts=6,
                         max_new_tokens=16, temperature=[0.0], timing_prompts=0, baseline_untrained=False,
                         dtype="float32", prompts=str(measured), selection_prompts=EVAL_SPLIT)
    prep = read_manifest(workdir, "prepare", needed_by="test")
    out = select_checkpoint(cfg, workdir, prep)

    rows = out["candidates"]
    assert [r["step"] for r in rows] == [2, 4]
    assert all(r["acceptance_length"] >= 1.0 and r["held_out_expected_accept_length"] >= 1.0 for r in rows)
    lo, hi = rows[0]["vs_last"]
    assert lo <= rows[0]["acceptance_length"] - rows[1]["acceptance_length"] <= hi and rows[1]["vs_last"] is None
    chosen = max(rows, key=lambda r: (r["acceptance_length"], r["step"]))
    assert out["chosen_step"] == chosen["step"]
    assert json.loads(workdir.selection_results().read_text()) == out
    assert out["prompts"]["source"] == str(workdir.dataset("eval")) and out["prompts"]["count"] == 6
    assert out["chosen_on_measured_prompts"] is False
    # Stage 05 exported the chosen one (its own manifest), and the card says why.
    export = record_of(read_manifest(workdir, "export", needed_by="test"))
    assert export.checkpoint_step == chosen["step"], (first_export, chosen)
    card = (WorkDir(work).export_dir() / CARD_NAME).read_text()
    assert ("chosen by the best greedy acceptance length served in vLLM of 2 kept checkpoints (steps 2, 4) on 6 "
            "held-out prompts of their own (not the measured ones)") in card
    report = json.loads(workdir.export_report("json").read_text())
    assert report["checkpoint"]["path"] == chosen["checkpoint"]
