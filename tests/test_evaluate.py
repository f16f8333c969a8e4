"""Stage 06 without an engine: prompts from stage 01, the figures and the break-even
formula on fabricated engine results, the untrained baseline drafter, the training-time
expectation, and the errors. (tests/test_pipeline_e2e.py serves real engines.)"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.drafter_io import (CONFIG_NAME, WEIGHTS_NAME, hf_config_from_drafter_config, load_drafter_dir,
                               save_drafter_dir)
from eagle3.errors import PipelineError
from eagle3.evaluate import (EvaluateConfig, assistant_turns, evaluate_drafter, held_out_prompts, report_lines,
                             run_figures, summarise, training_expectation, write_untrained_drafter)
from eagle3.model import DrafterConfig, Eagle3Drafter
from eagle3.workdir import WorkDir

ROOT = Path(__file__).resolve().parent.parent
K = 3


# -- prompts ------------------------------------------------------------------------------

def test_assistant_turns_are_the_runs_of_the_loss_mask():
    assert assistant_turns(np.array([0, 0, 1, 1, 0, 1, 0, 0, 1])) == [(2, 4), (5, 6), (8, 9)]
    assert assistant_turns(np.zeros(4)) == []
    assert assistant_turns(np.ones(3)) == [(0, 3)]


def test_held_out_prompts_end_where_the_assistant_turn_starts(prepared_llama, tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    header = tok.encode("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    wd = WorkDir(prepared_llama)
    prompts, info = held_out_prompts(wd, None, max_prompt_len=10_000)
    assert info["count"] == info["available"] == len(prompts) > info["conversations"] > 0  # multi-turn chats
    for p in prompts:
        assert p.prompt_ids[-len(header):] == header  # the generation prompt: the model answers next
        assert p.reference_ids[-1] == eot  # the answer's content and its end-of-turn token
    turns = [p.turn for p in prompts]
    assert turns == sorted(turns)  # first turns of every conversation come first
    few, info = held_out_prompts(wd, 5, max_prompt_len=10_000)
    assert [p.prompt_ids for p in few] == [p.prompt_ids for p in prompts[:5]] and info["count"] == 5
    short = min(len(p.prompt_ids) for p in prompts)
    _, info = held_out_prompts(wd, None, max_prompt_len=short)
    assert info["skipped_too_long"] > 0 and info["available"] < len(prompts)
    with pytest.raises(PipelineError, match="no assistant turn"):
        held_out_prompts(wd, None, max_prompt_len=1)


# -- figures -------------------------------------------------------------------------------

def engine_result(tokens: list[list[int]], step_s: float, wall_s: float, drafts: int = 0,
                  accepted_per_pos: list[int] | None = None, passes: int = 1, slow_first: bool = False) -> dict:
    """An engine run as `serve_and_measure` returns it; decode steps are `step_s` apart."""
    out = []
    for i in range(passes):
        slow = 3.0 if (slow_first and i == 0) else 1.0
        n_steps = [max(0, len(t) - 1) for t in tokens] if not drafts else None
        ts, t = [], 100.0
        for j, toks in enumerate(tokens):
            steps = n_steps[j] if n_steps is not None else drafts // len(tokens)
            ts.append([t, t + steps * step_s * slow])
            t += 10
        out.append({"wall_s": wall_s * slow, "token_ts": ts, "tokens": tokens,
                    "finish_reasons": ["stop"] * len(tokens)})
    counters = {}
    if drafts:
        per = accepted_per_pos or [0] * K
        counters = {"vllm:spec_decode_num_drafts": drafts * passes,
                    "vllm:spec_decode_num_draft_tokens": K * drafts * passes,
                    "vllm:spec_decode_num_accepted_tokens": sum(per) * passes,
                    "vllm:spec_decode_num_accepted_tokens_per_pos": [a * passes for a in per]}
    return {"vllm_version": "0.32.0", "platform": "cpu", "enforce_eager": True, "init_s": 5.0,
            "counters": counters, "passes": out}


def test_acceptance_and_break_even_from_engine_counters_and_timings():
    tokens = [list(range(21)), list(range(100, 121))]  # 2 requests x 21 tokens: 40 decode tokens
    plain = run_figures(engine_result(tokens, step_s=0.010, wall_s=0.5), K)
    assert plain["decode_tokens"] == 40 and plain["step_s"] == pytest.approx(0.010)
    assert plain["tokens_per_s"] == pytest.approx(42 / 0.5) and "acceptance_length" not in plain
    # 16 verification steps for the same 40 decode tokens; 24 accepted: 14 at position 0, 7 at 1, 3 at 2.
    trained = run_figures(engine_result(tokens, step_s=0.025, wall_s=0.45, drafts=16, accepted_per_pos=[14, 7, 3]),
                          K, plain_tokens=tokens)
    assert trained["acceptance_length"] == pytest.approx(1 + 24 / 16)
    assert trained["acceptance_per_position"] == pytest.approx([14 / 16, 7 / 16, 3 / 16])
    assert trained["step_s"] == pytest.approx(0.025) and trained["outputs_match_plain"] == 1.0
    untrained = run_figures(engine_result(tokens, step_s=0.025, wall_s=1.1, drafts=40), K,
                            plain_tokens=[tokens[0], tokens[1][:-1] + [7]])
    assert untrained["acceptance_length"] == 1.0 and untrained["outputs_match_plain"] == 0.5

    r = summarise({"plain": plain, "trained": trained, "untrained": untrained}, K,
                  {"value": 2.4, "k": 3, "full_acc": [0.9, 0.4, 0.1]}, {"count": 2}, {"dtype": "bfloat16"},
                  {"name": "vllm", "version": "0.32.0", "platform": "cpu"}, {"greedy_equals_dataset_answer": 0.5})
    # A speculative step costs 2.5 plain steps: L = 2.5 exactly ties.
    assert r["break_even_acceptance_length"] == pytest.approx(2.5)
    assert r["beats_break_even"] is False  # L = 2.5 is not above 2.5
    assert r["speedup"] == pytest.approx(0.5 / 0.45)
    assert r["untrained_acceptance_length"] == 1.0
    text = "\n".join(report_lines(r))
    assert "acceptance length (K=3): 2.500" in text and "training-time expected 2.400" in text
    assert "break-even acceptance length 2.50" in text and "does NOT beat it" in text


def test_timings_come_from_the_fastest_pass_counters_from_all():
    tokens = [list(range(11))]
    res = engine_result(tokens, step_s=0.02, wall_s=1.0, drafts=4, accepted_per_pos=[3, 2, 1], passes=2,
                        slow_first=True)
    f = run_figures(res, K)
    assert f["wall_s"] == 1.0 and f["pass_wall_s"] == [3.0, 1.0]
    assert f["step_s"] == pytest.approx(0.02)  # per pass: 4 verification steps
    assert f["acceptance_length"] == pytest.approx(1 + 6 / 4)


def test_training_expectation_reads_the_exported_steps_heldout_eval(tmp_path):
    wd = WorkDir(tmp_path)
    wd.stage_dir("train").mkdir(parents=True)
    rows = [{"split": "eval", "step": 0, "full_acc_0": 0.0, "full_acc_1": 0.0, "expected_accept_length": 1.0},
            {"split": "train", "step": 10, "full_acc_0": 0.9, "full_acc_1": 0.9, "expected_accept_length": 2.8},
            {"split": "eval", "step": 30, "full_acc_0": 0.7, "full_acc_1": 0.4, "expected_accept_length": 2.1},
            {"split": "eval", "step": 60, "full_acc_0": 0.6, "full_acc_1": 0.3, "expected_accept_length": 1.9}]
    wd.train_metrics().write_text("".join(json.dumps(r) + "\n" for r in rows))
    e = training_expectation(wd, 3, {"checkpoint": {"step": 30}})
    # Only 2 TTT steps were trained, so K = 3 can only count 2 positions.
    assert e["value"] == pytest.approx(2.1) and e["k"] == 2 and e["ttt_steps"] == 2
    assert training_expectation(wd, 1, {"checkpoint": {"step": 60}})["value"] == pytest.approx(1.6)
    assert training_expectation(WorkDir(tmp_path / "none"), 3, None)["value"] is None


# -- the untrained baseline ------------------------------------------------------------------

TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
            target_hidden_size=256, draft_vocab_size=256, target_vocab_size=960, max_position_embeddings=4096,
            rms_norm_eps=1e-5)


def write_drafter(folder: Path, seed: int = 0) -> Path:
    """A drafter folder as stage 05 writes it, for the tiny Llama (layers [2, 4, 5])."""
    g = torch.Generator().manual_seed(seed)
    m = Eagle3Drafter(DrafterConfig(**TINY))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    ids = torch.sort(torch.randperm(960, generator=g)[:256]).values
    m.set_vocab_mapping(ids - torch.arange(256), torch.zeros(960, dtype=torch.bool).index_fill_(0, ids, True))
    save_drafter_dir(folder, m.state_dict(), hf_config_from_drafter_config(m.config, [2, 4, 5]))
    return folder


def test_untrained_drafter_keeps_config_and_mapping_with_fresh_weights(tmp_path):
    trained = write_drafter(tmp_path / "trained")
    out = write_untrained_drafter(trained, tmp_path / "untrained", seed=0)
    cfg_a, ta = load_drafter_dir(trained)
    cfg_b, tb = load_drafter_dir(out)
    assert cfg_a == cfg_b and set(ta) == set(tb)
    assert torch.equal(ta["d2t"], tb["d2t"]) and torch.equal(ta["t2d"], tb["t2d"])
    assert {k: v.shape for k, v in ta.items()} == {k: v.shape for k, v in tb.items()}
    assert not torch.equal(ta["fc.weight"], tb["fc.weight"])
    assert not torch.equal(ta["lm_head.weight"], tb["lm_head.weight"])
    again = write_untrained_drafter(trained, tmp_path / "again", seed=0)
    assert torch.equal(load_drafter_dir(again)[1]["fc.weight"], tb["fc.weight"])  # seeded: reproducible


# -- config and errors -----------------------------------------------------------------------

def test_config_validation():
    with pytest.raises(PipelineError, match="num_speculative_tokens"):
        EvaluateConfig(work_dir=Path("w"), target_model="t", num_speculative_tokens=0)
    with pytest.raises(PipelineError, match="dtype"):
        EvaluateConfig(work_dir=Path("w"), target_model="t", dtype="int4")
    with pytest.raises(PipelineError, match="timed_passes"):
        EvaluateConfig(work_dir=Path("w"), target_model="t", timed_passes=0)
    from eagle3.config import build_config

    cfg = build_config(EvaluateConfig, "evaluate", ROOT / "configs" / "tiny-llama.yaml")
    assert cfg.num_speculative_tokens == 3 and cfg.num_prompts is None and cfg.timed_passes == 2


def test_evaluate_needs_stage_01_and_a_drafter(tmp_path, prepared_llama, tiny_llama):
    with pytest.raises(PipelineError, match="01_prepare_dataset.py"):
        evaluate_drafter(EvaluateConfig(work_dir=tmp_path / "empty", target_model=str(tiny_llama)))
    with pytest.raises(PipelineError, match="05_export_drafter.py"):
        evaluate_drafter(EvaluateConfig(work_dir=prepared_llama, target_model=str(tiny_llama)))
    with pytest.raises(PipelineError, match="no config.json"):
        evaluate_drafter(EvaluateConfig(work_dir=prepared_llama, target_model=str(tiny_llama),
                                        drafter_dir=tmp_path))


def test_evaluate_refuses_another_target(tmp_path, prepared_llama, tiny_llama):
    drafter = write_drafter(tmp_path / "d")
    cfg = json.loads((drafter / CONFIG_NAME).read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / CONFIG_NAME).write_text(json.dumps({**cfg, "vocab_size": 1024}))
    (other / WEIGHTS_NAME).write_bytes((drafter / WEIGHTS_NAME).read_bytes())
    with pytest.raises(PipelineError, match="target vocab size mismatch: 1024"):
        evaluate_drafter(EvaluateConfig(work_dir=prepared_llama, target_model=str(tiny_llama), drafter_dir=other))
    # Prompts are stage 01's token ids: a work dir tokenized by another tokenizer is refused.
    work = tmp_path / "work"
    shutil.copytree(prepared_llama, work)
    mpath = WorkDir(work).manifest("prepare")
    m = json.loads(mpath.read_text())
    m["extra"]["tokenizer_fingerprint"] = "0" * 64
    mpath.write_text(json.dumps(m))
    with pytest.raises(PipelineError, match="not the one stage 01 tokenized with"):
        evaluate_drafter(EvaluateConfig(work_dir=work, target_model=str(tiny_llama), drafter_dir=drafter))


def test_a_failing_engine_run_names_its_log(tmp_path, prepared_llama, tiny_llama, monkeypatch):
    import eagle3.evaluate as ev

    drafter = write_drafter(tmp_path / "d")
    monkeypatch.setattr(ev, "_worker_cmd", lambda req, out: [
        sys.executable, "-c", "import sys; print('RuntimeError: engine exploded'); sys.exit(3)"])
    work = tmp_path / "work"
    shutil.copytree(prepared_llama, work)
    with pytest.raises(PipelineError) as e:
        evaluate_drafter(EvaluateConfig(work_dir=work, target_model=str(tiny_llama), drafter_dir=drafter,
                                        num_prompts=2))
    msg = str(e.value)
    assert "plain engine run failed (exit status 3)" in msg and "engine exploded" in msg
    assert str(WorkDir(work).stage_dir("evaluate") / "logs" / "plain.log") in msg
    assert not WorkDir(work).manifest("evaluate").exists()  # nothing looks complete


def test_script_reports_bad_input_in_one_line(tmp_path, tiny_llama):
    p = subprocess.run([sys.executable, str(ROOT / "06_evaluate_drafter.py"), "--work-dir", str(tmp_path / "w"),
                        "--target-model", str(tiny_llama)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "01_prepare_dataset.py" in p.stderr and "Traceback" not in p.stderr
    w = subprocess.run([sys.executable, "-m", "eagle3.evaluate"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert w.returncode != 0 and "06_evaluate_drafter.py" in w.stderr


def test_timings_disturbed_by_other_load_are_flagged():
    from eagle3.evaluate import timing_problems

    calm = {"plain": {"pass_wall_s": [6.5, 6.6], "step_s": 0.0055},
            "trained": {"pass_wall_s": [5.4, 5.5], "step_s": 0.0113},
            "untrained": {"pass_wall_s": [12.0, 12.3], "step_s": 0.0116}}
    assert timing_problems(calm) == []
    noisy = {**calm, "trained": {"pass_wall_s": [75.6, 64.7], "step_s": 0.139}}
    problems = timing_problems(noisy)
    assert len(problems) == 1 and "139.0 ms with the trained drafter and 11.6 ms" in problems[0]
    bursty = {**calm, "plain": {"pass_wall_s": [6.5, 20.0], "step_s": 0.0055}}
    assert "plain run's timed passes took 6.5 / 20.0 s" in timing_problems(bursty)[0]
