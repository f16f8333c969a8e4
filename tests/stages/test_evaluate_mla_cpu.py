"""Stage 06 on vLLM's CPU build with an MLA target: one line, before any engine starts.

vLLM 0.32's CPU MLA backend takes KV blocks of 16 tokens, its CPU attention (the drafter's)
multiples of 32, and one engine needs one size: the engine would stop at start with "No
common block size" after stage 06 had spent an engine start on the plain target
(docs/KIMI_K25.md, "vLLM's KimiK25ForConditionalGeneration"). Stages 01-05 run on the hf
backend here; no engine starts (tests/e2e/test_kimi_vllm.py serves the plain passes).
"""
from __future__ import annotations

import pytest

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_k25"])
def test_a_drafter_on_an_mla_target_is_refused_in_one_line(kind, tiny_targets, stage_runs, monkeypatch):
    from eagle3.stages.s06_evaluate import run as evaluate_run
    from eagle3.stages.s06_evaluate.config import EvaluateConfig
    from eagle3.stages.s06_evaluate.run import evaluate_drafter

    def no_engine(name, *a, **k):
        raise AssertionError(f"stage 06 started its {name} engine on an MLA target on vLLM's CPU build")

    monkeypatch.setattr(evaluate_run, "run_engine", no_engine)
    target = tiny_targets[kind]
    workdir = WorkDir(stage_runs(target, upto="export", chats=24))
    with pytest.raises(PipelineError) as e:
        evaluate_drafter(EvaluateConfig(work_dir=workdir.root, target_model=str(target), max_new_tokens=8))
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert "no common block size" in msg and "kv_lora_rank 512" in msg and "GPU box" in msg, msg
    assert not workdir.engine_request("plain+trained").exists() and not workdir.engine_log("plain+trained").exists()
