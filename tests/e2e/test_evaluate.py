"""Stage 06: prompts from stage 01 and from prompt sets of every shape, the figures and the
break-even formula on fabricated engine results, the untrained baseline drafter, the
training-time expectation, the layers each engine captures, the errors, and the
package's steps (run figures, engine shutdown, plot). One test serves a real engine: a
drafter from elsewhere measured on a new work directory (~50 s, one engine start);
tests/e2e/test_pipeline_e2e.py serves the pipeline's own. About 75 s on 2 cores."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.artifacts.records import TrainRecord
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.serving.drafter_io import (CONFIG_NAME, WEIGHTS_NAME, hf_config_from_drafter_config, load_drafter_dir,
                                       save_drafter_dir)
from eagle3.serving.model_card import CARD_NAME, evaluate_section
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s06_evaluate.config import EVAL_SPLIT, EvaluateConfig
from eagle3.stages.s06_evaluate.figures import (acceptance_figures, histogram_counts, ratio_interval, timing_figures,
                                                timing_problems)
from eagle3.stages.s06_evaluate.prompts import (Prompt, assistant_turns, categories, file_prompts, held_out_prompts,
                                                timing_subset)
from eagle3.stages.s06_evaluate.report import report_lines, summarise
from eagle3.stages.s06_evaluate.run import evaluate_drafter, training_expectation, write_untrained_drafter

ROOT = Path(__file__).resolve().parents[2]
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
    workdir = WorkDir(prepared_llama)
    prompts, info = held_out_prompts(workdir, None, max_prompt_len=10_000)
    assert info["count"] == info["available"] == len(prompts) > info["conversations"] > 0  # multi-turn chats
    for p in prompts:
        assert p.prompt_ids[-len(header):] == header  # the generation prompt: the model answers next
        assert p.reference_ids[-1] == eot  # the answer's content and its end-of-turn token
    turns = [p.turn for p in prompts]
    assert turns == sorted(turns)  # first turns of every conversation come first
    few, info = held_out_prompts(workdir, 5, max_prompt_len=10_000)
    assert [p.prompt_ids for p in few] == [p.prompt_ids for p in prompts[:5]] and info["count"] == 5
    short = min(len(p.prompt_ids) for p in prompts)
    _, info = held_out_prompts(workdir, None, max_prompt_len=short)
    assert info["skipped_too_long"] > 0 and info["available"] < len(prompts)
    with pytest.raises(PipelineError, match="no assistant turn"):
        held_out_prompts(workdir, None, max_prompt_len=1)


# -- prompt sets ---------------------------------------------------------------------------

def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompt_file_renders_with_the_chat_template_and_keeps_categories(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    from eagle3.target.loss_mask import render

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "What is 6 times 7?", "category": "math"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Spell cat."},
                      {"role": "assistant", "content": "C, A, T."}], "category": "spell"},  # reference dropped
        {"conversations": [{"from": "human", "value": "Count from 1 to 3."}], "category": "count"},
        {"prompt": ["Name a color.", "Now another one."], "category": "math"},  # MT-Bench turns: the first
    ])
    prompts, info = file_prompts(str(f), "test", tok, None, "category", None, max_prompt_len=10_000)
    assert [p.category for p in prompts] == ["math", "spell", "count", "math"]
    assert prompts[0].prompt_ids == render(tok, [{"role": "user", "content": "What is 6 times 7?"}],
                                           add_generation_prompt=True)
    assert prompts[1].prompt_ids == render(tok, [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Spell cat."}], add_generation_prompt=True)
    assert prompts[3].prompt_ids == render(tok, [{"role": "user", "content": "Name a color."}],
                                           add_generation_prompt=True)
    header = tok.encode("<|start_header_id|>assistant<|end_header_id|>\n\n", add_special_tokens=False)
    assert all(p.prompt_ids[-len(header):] == header and p.reference_ids is None for p in prompts)
    assert info["count"] == info["available"] == 4 and info["category_field"] == "category"
    assert categories(prompts) == ["math", "spell", "count"]
    # A JSON list holds the same records; --num-prompts takes the first ones.
    g = tmp_path / "p.json"
    g.write_text(json.dumps([json.loads(line) for line in f.read_text().splitlines()]))
    few, info = file_prompts(str(g), "test", tok, None, None, 2, max_prompt_len=10_000)
    assert [p.prompt_ids for p in few] == [p.prompt_ids for p in prompts[:2]] and few[0].category is None
    short = len(prompts[0].prompt_ids)
    _, info = file_prompts(str(f), "test", tok, None, None, None, max_prompt_len=short)
    longer = sum(len(p.prompt_ids) > short for p in prompts)
    assert longer >= 1 and info["skipped_too_long"] == longer and info["count"] == 4 - longer


def test_prompt_file_errors_name_the_record_and_the_flag(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi", "category": "a"}, {"question": "Why?"}])
    with pytest.raises(PipelineError, match=r"p.jsonl:2: .*no_prompt.*--prompt-field"):
        file_prompts(str(f), "test", tok, "prompt", None, None, 10_000)
    prompts, _ = file_prompts(str(write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?"}])), "test", tok,
                              "question", None, None, 10_000)
    assert len(prompts) == 1
    with pytest.raises(PipelineError, match=r"p.jsonl:2: no `category` value \(--category-field\)"):
        file_prompts(str(write_jsonl(f, [{"prompt": "Hi", "category": "a"}, {"prompt": "Yo"}])), "test", tok,
                     "prompt", "category", None, 10_000)
    with pytest.raises(PipelineError, match="does not exist"):
        file_prompts(str(tmp_path / "missing.jsonl"), "test", tok, "prompt", None, None, 10_000)
    only_answers = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(PipelineError, match="no_user_turn"):
        file_prompts(str(only_answers), "test", tok, None, None, None, 10_000)


def test_prompt_sets_in_stage_00_shapes_give_their_first_unanswered_turn(tmp_path, tiny_llama):
    """The shapes stage 00 reads are stage 06's too; user turns without answers between them
    (the demo's prompt files, MT-Bench `turns`) give their first turn, system kept."""
    from transformers import AutoTokenizer

    from eagle3.target.loss_mask import render

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    system = {"role": "system", "content": "Be brief."}
    f = write_jsonl(tmp_path / "p.jsonl", [
        {"instruction": "Summarize.", "input": "Cats purr."},
        {"question": "Why?"},
        {"turns": ["First.", "Second."]},
        {"messages": [system, {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
    ])
    prompts, _ = file_prompts(str(f), "test", tok, None, None, None, 10_000)
    firsts = [[{"role": "user", "content": "Summarize.\n\nCats purr."}], [{"role": "user", "content": "Why?"}],
              [{"role": "user", "content": "First."}], [system, {"role": "user", "content": "a"}]]
    assert [p.prompt_ids for p in prompts] == [render(tok, m, add_generation_prompt=True) for m in firsts]
    assert [p.turn for p in prompts] == [0, 0, 0, 0]
    f.write_text(json.dumps({"text": "named", "prompt": "not this"}) + "\n")
    (named,), _ = file_prompts(str(f), "test", tok, "text", None, None, 10_000)
    f.write_text(json.dumps({"prompt": "Hi"}) + "\n" + json.dumps({"text": "unnamed"}) + "\n")
    with pytest.raises(PipelineError, match=r"p.jsonl:2: no_messages: .*--prompt-field"):
        file_prompts(str(f), "test", tok, None, None, None, 10_000)
    assert named.prompt_ids == render(tok, [{"role": "user", "content": "named"}], add_generation_prompt=True)
    held_out = file_prompts(str(ROOT / "data" / "demo_prompts_heldout.jsonl"), "test", tok, None, "category",
                            None, 10_000)[0]
    assert len(held_out) == 60 and len(categories(held_out)) == 6


def test_timing_subset_round_robins_over_categories():
    def P(cat):
        return Prompt("s", 0, [1], None, cat)

    prompts = [P("a"), P("a"), P("a"), P("b"), P("b"), P("c")]
    assert timing_subset(prompts, 4) == [0, 1, 3, 5]  # a, b, c, then a again
    assert timing_subset(prompts, 2) == [0, 3]
    assert timing_subset(prompts, 0) == []
    assert timing_subset(prompts, 99) == list(range(6))
    assert timing_subset([P(None)] * 5, 3) == [0, 1, 2]


# -- figures -------------------------------------------------------------------------------

def counters(drafts: int, per_pos: list[int]) -> dict:
    return {"vllm:spec_decode_num_drafts": drafts, "vllm:spec_decode_num_draft_tokens": K * drafts,
            "vllm:spec_decode_num_accepted_tokens": sum(per_pos),
            "vllm:spec_decode_num_accepted_tokens_per_pos": per_pos}


def test_histogram_counts_follow_chain_drafting():
    # 2 steps accepted nothing, 1 accepted one draft, 1 accepted all three.
    assert histogram_counts([2, 1, 0, 1], K) == (4, 4, [2, 1, 1])
    assert histogram_counts([0, 0, 1, 3], K) == (4, 11, [4, 4, 3])
    assert histogram_counts([], K) == (0, 0, [0, 0, 0])


def test_acceptance_over_prompts_with_interval_and_per_category():
    hists = [[2, 1, 0, 1], [0, 0, 1, 3], [4, 0, 0, 0]]  # accepted 4, 11, 0 over 4 steps each
    p = {"temperature": 0.7, "wall_s": 2.0, "tokens": [[1] * 9, [1] * 16, [1] * 5],
         "counters": counters(12, [6, 5, 4]), "histograms": hists}
    f = acceptance_figures(p, K, ["math", "code", "math"])
    assert f["acceptance_length"] == pytest.approx(1 + 15 / 12)
    assert f["acceptance_per_position"] == pytest.approx([6 / 12, 5 / 12, 4 / 12])
    assert f["histograms_match_counters"] and f["tokens"] == 30 and f["temperature"] == 0.7
    # Delta method by hand: R = 15/12, residuals a_i - R d_i = -1, 6, -5.
    assert f["ci95"] == pytest.approx(1.96 * math.sqrt((1 + 36 + 25) / (3 * 2)) / 4)
    math_, code = f["by_category"]["math"], f["by_category"]["code"]
    assert list(f["by_category"]) == ["math", "code"]
    assert math_["acceptance_length"] == pytest.approx(1 + 4 / 8) and math_["prompts"] == 2
    assert math_["acceptance_per_position"] == pytest.approx([2 / 8, 1 / 8, 1 / 8])
    assert code["acceptance_length"] == pytest.approx(1 + 11 / 4) and code["ci95"] is None  # one prompt


def test_ratio_interval_shrinks_with_more_prompts_and_matches_a_bootstrap():
    rng = np.random.default_rng(0)
    steps = rng.integers(10, 30, size=400)
    accepted = rng.binomial(steps * 3, 0.5)
    ci = ratio_interval(accepted.tolist(), steps.tolist())
    boot = []
    for _ in range(2000):
        i = rng.integers(0, 400, size=400)
        boot.append(accepted[i].sum() / steps[i].sum())
    assert ci == pytest.approx(1.96 * np.std(boot), rel=0.15)  # two different estimates of one spread
    assert ratio_interval(accepted[:100].tolist(), steps[:100].tolist()) > ci
    assert ratio_interval([3], [4]) is None


def timing_run(tokens: list[list[int]], step_s: float, request_wall_s: list[float],
               histograms: list[list[int]] | None = None, slow: float = 1.0) -> dict:
    """A single-stream timing pass as `serve_blocks` returns it; decode steps `step_s` apart
    (a request's steps: its histogram's, or one per decode token without a drafter)."""
    steps = [histogram_counts(h, K)[0] for h in histograms] if histograms else [len(t) - 1 for t in tokens]
    ts, t = [], 100.0
    for n in steps:
        ts.append([t, t + n * step_s * slow])
        t += 10
    return {"wall_s": sum(request_wall_s) * slow, "request_wall_s": [w * slow for w in request_wall_s],
            "token_ts": ts, "tokens": tokens, "histograms": histograms}


def test_single_stream_timing_break_even_and_summary():
    tokens = [list(range(21)), list(range(100, 121))]  # 2 requests x 21 tokens: 40 decode tokens
    plain_pass = timing_run(tokens, 0.010, [0.25, 0.25])
    plain = timing_figures([plain_pass, plain_pass], K, speculative=False)  # two passes, identical work
    assert plain["decode_tokens"] == 80 and plain["step_s"] == pytest.approx(0.010)
    assert plain["tokens_per_s"] == pytest.approx(84 / 1.0) and plain["request_step_s"] == pytest.approx([0.01] * 2)
    assert plain["request_wall_s"] == pytest.approx([0.5, 0.5]) and plain["pass_wall_s"] == [0.5, 0.5]
    # 16 verification steps (8 per request) for the same 40 decode tokens; 24 accepted.
    hists = [[1, 3, 3, 1], [1, 3, 3, 1]]  # per request: 8 steps, 0*1 + 1*3 + 2*3 + 3*1 = 12 accepted
    spec_pass = timing_run(tokens, 0.025, [0.2, 0.25], histograms=hists)
    trained = timing_figures([spec_pass, spec_pass], K, speculative=True)
    assert trained["step_s"] == pytest.approx(0.025) and trained["acceptance_length"] == pytest.approx(2.5)
    assert trained["request_steps"] == [16, 16] and trained["request_step_s"] == pytest.approx([0.025] * 2)

    hists = [[0, 2, 1, 1], [0, 2, 1, 1], [1, 2, 1, 0]]  # all prompts: 12 steps, 15 accepted
    acc = acceptance_figures({"temperature": 0.0, "wall_s": 1.0, "tokens": [[1] * 10] * 3,
                              "counters": counters(12, [11, 4, 0]), "histograms": hists}, K, [None] * 3)
    sampled = acceptance_figures({"temperature": 0.7, "wall_s": 1.0, "tokens": [[1] * 10] * 3,
                                  "counters": counters(12, [6, 0, 0]), "histograms": None}, K, [None] * 3)
    floor = acceptance_figures({"temperature": 0.0, "wall_s": 1.5, "tokens": [[1] * 10] * 3,
                                "counters": counters(30, [0, 0, 0]), "histograms": None}, K, [None] * 3)
    runs = {"plain": {"acceptance": [{"temperature": 0.0, "tokens": 30, "wall_s": 0.6}], "timing": plain},
            "trained": {"acceptance": [acc, sampled], "timing": trained, "outputs_match_plain": 1.0},
            "untrained": {"acceptance": [floor], "timing": None}}  # served at the first temperature only
    r = summarise(runs, K, [0.0, 0.7], {"value": 2.4, "k": 3, "full_acc": [0.9, 0.4, 0.1]},
                  {"count": 3, "category_field": None}, {"dtype": "bfloat16", "max_num_seqs": 64},
                  {"name": "vllm", "version": "0.32.0", "platform": "cpu"}, {"greedy_equals_dataset_answer": 0.5})
    assert r["acceptance_length"] == pytest.approx(1 + 15 / 12) and r["acceptance_temperature"] == 0.0
    assert [row["trained"]["acceptance_length"] for row in r["acceptance"]] == pytest.approx([2.25, 1.5])
    assert r["untrained_acceptance_length"] == 1.0
    # A speculative step costs 2.5 plain steps: L = 2.25 falls short of it, but over 3 prompts its
    # 95% interval holds 2.5, so no difference is shown (tests/unit/test_speed_verdicts.py).
    assert r["acceptance_length_ci95"] > 0.25
    assert r["break_even_acceptance_length"] == pytest.approx(2.5) and r["beats_break_even"] is None
    assert r["speedup"] == pytest.approx(0.5 / 0.45) and r["timing_problems"] == []
    assert r["timing"]["speedup_per_prompt"] == pytest.approx({"min": 1.0, "median": 1.125, "max": 1.25})
    assert r["timing"]["acceptance_length"] == pytest.approx(2.5) and r["timing"]["prompts"] == 2
    assert r["timing"]["passes"] == 2 and r["timing"]["pass_speedups"] == pytest.approx([0.5 / 0.45] * 2)
    assert r["batched"]["tokens_per_s"] == pytest.approx({"plain": 50.0, "speculative": 30.0})
    text = "\n".join(report_lines(r))
    # Rounded to the interval's precision (eagle3/core/readable.py): 2.25 ±0.5 prints as 2.2 ±0.5.
    assert "acceptance length (K=3): 2.2 ±0.5 " in text and "training-time expected 2.40" in text
    assert "greedy: trained 2.2 ±0.5" in text and "| untrained 1.00" in text
    assert r["acceptance"][1]["untrained"] is None and text.count("untrained 1.00") == 1
    assert "T=0.7: trained 1.50 per position 0.50 0.00 0.00\n" in text + "\n"
    assert "single stream, 2 of 3 prompts in 2 interleaved passes" in text and "per prompt 1.00-1.25x" in text
    # Every request's speculative step costs 2.5 plain ones: a zero-width interval, L's decides nothing.
    assert r["break_even_ci95"] == pytest.approx([2.5, 2.5]) and "break-even acceptance length 2.5" in text
    assert "]: no difference shown (speculative step 25.0 ms / plain step 10.0 ms" in text


def test_each_prompts_timings_are_summed_over_the_passes():
    tokens = [list(range(11)), list(range(5))]
    hists = [[0, 5, 0, 0], [0, 2, 0, 0]]
    slow = timing_run(tokens, 0.02, [1.0, 0.5], histograms=hists, slow=3.0)
    fast = timing_run(tokens, 0.02, [1.0, 0.5], histograms=hists)
    f = timing_figures([slow, fast], K, speculative=True)
    assert f["request_wall_s"] == pytest.approx([4.0, 2.0]) and f["pass_wall_s"] == pytest.approx([4.5, 1.5])
    assert f["wall_s"] == pytest.approx(6.0) and f["tokens"] == 32 and f["tokens_per_s"] == pytest.approx(32 / 6)
    assert f["steps"] == 14 and f["step_s"] == pytest.approx((3 * 0.14 + 0.14) / 14)
    assert [p["step_s"] for p in f["passes"]] == pytest.approx([0.06, 0.02])
    assert f["acceptance_length"] == pytest.approx(2.0) and f["acceptance_per_position"] == [1.0, 0.0, 0.0]
    assert timing_figures([], K, speculative=True) is None


def test_training_expectation_reads_the_exported_steps_heldout_eval(tmp_path):
    workdir = WorkDir(tmp_path)
    workdir.stage_dir("train").mkdir(parents=True)
    rows = [{"split": "eval", "step": 0, "full_acc_0": 0.0, "full_acc_1": 0.0, "expected_accept_length": 1.0},
            {"split": "train", "step": 10, "full_acc_0": 0.9, "full_acc_1": 0.9, "expected_accept_length": 2.8},
            {"split": "eval", "step": 30, "full_acc_0": 0.7, "full_acc_1": 0.4, "expected_accept_length": 2.1},
            {"split": "eval", "step": 60, "full_acc_0": 0.6, "full_acc_1": 0.3, "expected_accept_length": 1.9}]
    workdir.train_metrics().write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = TrainRecord(ttt_steps=2, aux_layer_ids=[2, 4, 5], steps=60, best_step=30, best_expected_accept_length=2.1,
                        best_eval=rows[2], best_checkpoint="checkpoints/best.pt")
    e = training_expectation(workdir, 3, 30, train)
    # Only 2 TTT steps were trained (stage 04's record), so K = 3 can only count 2 positions.
    assert e["value"] == pytest.approx(2.1) and e["k"] == 2 and e["ttt_steps"] == 2
    assert training_expectation(workdir, 1, 60, train)["value"] == pytest.approx(1.6)
    # A step without a held-out row (a step checkpoint saved between evaluations): stage 04's best.
    best = training_expectation(workdir, 3, 45, train)
    assert best["value"] == pytest.approx(2.1) and "best held-out eval, step 30" in best["source"]
    assert training_expectation(WorkDir(tmp_path / "none"), 3, None, None)["value"] is None


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
        EvaluateConfig(work_dir=Path("w"), target_model="t", timed_passes=1)  # nothing to check one pass against
    with pytest.raises(PipelineError, match="temperature"):
        EvaluateConfig(work_dir=Path("w"), target_model="t", temperature=[0.0, -0.5])
    with pytest.raises(PipelineError, match="distinct"):
        EvaluateConfig(work_dir=Path("w"), target_model="t", temperature=[0.7, 0.7])
    with pytest.raises(PipelineError, match="needs a prompt set"):
        EvaluateConfig(work_dir=Path("w"), target_model="t", category_field="category")
    assert EvaluateConfig(work_dir=Path("w"), target_model="t").temperature == [0.0, 0.7]
    # `--prompts eval-split` undoes a config's prompt file, and that file's fields with it.
    split = EvaluateConfig(work_dir=Path("w"), target_model="t", prompts=EVAL_SPLIT, category_field="category",
                           prompt_field="question")
    assert split.prompts is None and split.category_field is None and split.prompt_field is None
    from eagle3.core.config import build_config

    cfg = build_config(EvaluateConfig, "evaluate", ROOT / "configs" / "tiny-llama.yaml", sections=STAGE_CONFIGS)
    assert cfg.num_speculative_tokens == 3 and cfg.num_prompts is None and cfg.timed_passes == 2
    assert cfg.temperature == [0.0, 0.7] and cfg.timing_prompts == 16


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
    m["record"]["tokenizer_fingerprint"] = "0" * 64
    mpath.write_text(json.dumps(m))
    with pytest.raises(PipelineError, match="not the one stage 01 tokenized with"):
        evaluate_drafter(EvaluateConfig(work_dir=work, target_model=str(tiny_llama), drafter_dir=drafter))


def test_a_failing_engine_run_names_its_log(tmp_path, prepared_llama, tiny_llama, monkeypatch):
    import eagle3.stages.s06_evaluate.engine as ev

    drafter = write_drafter(tmp_path / "d")
    monkeypatch.setattr(ev, "_worker_cmd", lambda req, out: [
        sys.executable, "-c", "import sys; print('RuntimeError: engine exploded'); sys.exit(3)"])
    work = tmp_path / "work"
    shutil.copytree(prepared_llama, work)
    with pytest.raises(PipelineError) as e:
        evaluate_drafter(EvaluateConfig(work_dir=work, target_model=str(tiny_llama), drafter_dir=drafter,
                                        num_prompts=2))
    msg = str(e.value)
    # Timed (the default): plain and trained share one worker, and its failure names both.
    assert "plain+trained engine run failed (exit status 3)" in msg and "engine exploded" in msg
    assert str(WorkDir(work).stage_dir("evaluate") / "logs" / "plain+trained.log") in msg
    assert "engines that live side by side" in msg and "--timing-order passes" in msg
    assert not WorkDir(work).manifest("evaluate").exists()  # nothing looks complete


def test_layer_capture_names_each_engines_layers_and_flags_a_mismatch(tmp_path, tiny_llama, caplog):
    from eagle3.stages.s06_evaluate.run import (
        _log_capture,
        capture_lines,
        layer_capture,
    )
    from eagle3.target.info import read_target_info

    info = read_target_info(str(tiny_llama))
    cfg = json.loads((write_drafter(tmp_path / "d") / CONFIG_NAME).read_text())
    ours = layer_capture(cfg, info)
    assert ours["trained"] == [2, 4, 5] and set(ours["captured"]) == {"vllm", "vllm-v2", "sglang"}
    assert all(ids == [2, 4, 5] for ids in ours["captured"].values())
    assert not any("NOT the trained" in line for line in capture_lines(ours))
    # A config written for SGLang only (nested ids): vLLM's V1 runner reads them as they are,
    # its V2 runner falls back to [2, N//2, N-3]; both differ from the layers SGLang feeds.
    sglang_only = {k: v for k, v in cfg.items() if k != "eagle_aux_hidden_state_layer_ids"}
    sglang_only["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}
    theirs = layer_capture(sglang_only, info)
    assert theirs["trained"] == [3, 4, 5] and theirs["captured"] == {"vllm": [2, 3, 4], "vllm-v2": [2, 4, 5],
                                                                     "sglang": [3, 4, 5]}
    lines = capture_lines(theirs)
    assert sum("NOT the trained layers" in line for line in lines) == 2 and "8-layer target" in lines[0]
    with caplog.at_level("INFO"):
        _log_capture(theirs, tmp_path / "d")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "vllm [2, 3, 4], vllm-v2 [2, 4, 5], trained [3, 4, 5]" in warning and "diagnose inspect" in warning


def test_any_drafter_is_measured_on_a_new_work_dir(tmp_path, tiny_llama):
    """A drafter from elsewhere (as a published one), prompts, a work dir where no stage ran:
    stage 06 serves it (one engine: a sampled pass only, no untrained floor, no timing),
    logs the layers each engine captures, and writes only 06_evaluate/ (and its log, logs/06_evaluate.log):
    not even the drafter's model card, whose table its own run measured on its own prompts."""
    drafter = write_drafter(tmp_path / "published")
    card = f"# a drafter exported elsewhere\n{evaluate_section('| its own | figures |')}\n"
    (drafter / CARD_NAME).write_text(card)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "What is 6 times 7?"}, {"question": "Why is the sky blue?"},
                                                 {"turns": ["Name a color.", "Another?"]},
                                                 {"messages": [{"role": "user", "content": "Spell cat."}]}])
    work = tmp_path / "new"
    p = subprocess.run([sys.executable, str(ROOT / "06_evaluate_drafter.py"), "--target-model", str(tiny_llama),
                        "--drafter-dir", str(drafter), "--prompts", str(prompts), "--work-dir", str(work),
                        "--temperature", "0.7", "--timing-prompts", "0", "--no-baseline-untrained",
                        "--max-new-tokens", "8"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "the drafter was trained on target layers [2, 4, 5]" in p.stderr
    assert "vLLM V1 runner" in p.stderr and "vLLM V2 runner" in p.stderr and "SGLang: [2, 4, 5]" in p.stderr
    assert "untrained drafter" not in p.stderr and "training-time expected" not in p.stderr  # nothing to say
    assert sorted(x.name for x in work.iterdir()) == ["06_evaluate", "logs"]
    assert (drafter / CARD_NAME).read_text() == card and "its model card is left as it is" in p.stderr
    assert [x.name for x in (work / "logs").iterdir()] == ["06_evaluate.log"]
    r = json.loads(WorkDir(work).evaluate_results().read_text())
    assert r["prompts"]["count"] == 4 and r["acceptance"][0]["temperature"] == 0.7
    assert r["acceptance_length"] >= 1.0 and r["untrained_acceptance_length"] is None
    assert r["settings"]["aux_layers"]["captured"]["vllm"] == [2, 4, 5]
    assert r["expected_accept_length_training"]["value"] is None


def test_script_reports_bad_input_in_one_line(tmp_path, tiny_llama):
    p = subprocess.run([sys.executable, str(ROOT / "06_evaluate_drafter.py"), "--work-dir", str(tmp_path / "w"),
                        "--target-model", str(tiny_llama)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "01_prepare_dataset.py" in p.stderr and "Traceback" not in p.stderr
    w = subprocess.run([sys.executable, "-m", "eagle3.stages.s06_evaluate"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert w.returncode != 0 and "06_evaluate_drafter.py" in w.stderr


def test_timings_whose_passes_disagree_are_flagged():
    def timing(speedup_per_pass, step_s_per_pass):
        return {"passes": [{"tokens_per_s": s, "step_s": c} for s, c in zip(speedup_per_pass, step_s_per_pass)]}

    plain = timing([100.0, 50.0, 80.0], [0.010, 0.020, 0.0125])  # the machine slowed in pass 2: both sides
    calm = timing([150.0, 75.0, 120.0], [0.012, 0.024, 0.015])
    assert timing_problems(plain, calm) == []  # every pass: 1.5x, L* 1.2
    noisy = timing([150.0, 75.0, 200.0], [0.012, 0.024, 0.015])  # pass 3 read 2.5x
    assert timing_problems(plain, noisy) == ["the 3 interleaved timing passes' speedups by 67% differ (largest over "
                                             "smallest); passes of identical work agree within 20%"]
    steps = timing([150.0, 75.0, 120.0], [0.012, 0.024, 0.030])  # pass 3's L* 2.4 against 1.2
    assert timing_problems(plain, steps)[0].startswith("the 3 interleaved timing passes' break-evens L* by 100% differ")
    assert timing_problems(plain, None) == [] and timing_problems(None, None) == []  # nothing timed


def test_per_token_expansion_used_for_sampled_verification():
    from eagle3.stages.s06_evaluate.engine import _expand_per_token

    # Request temperatures spread over their draft tokens (2, 3 and 1 of them).
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = _expand_per_token(torch.tensor([0.7, 1.0, 0.3]), cu, 6)
    assert out.dtype == torch.float32 and out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 0.3])
    # top-k: 0 ("off") replaced by the vocabulary size.
    assert _expand_per_token(torch.tensor([0, 5, 0]), cu, 6, replace_from=0, replace_to=960).tolist() == \
        [960, 960, 5, 5, 5, 960]


# -- the package's steps (eagle3/stages/s06_evaluate/) ---------------------------------------------------

def spec_pass(temperature: float, tokens: list[list[int]]) -> dict:
    """One acceptance pass of a drafter run as `serve_and_measure` returns it (4 steps, 6 accepted)."""
    return {"temperature": temperature, "wall_s": 1.0, "tokens": tokens, "counters": counters(4, [3, 2, 1]),
            "histograms": None}


def test_run_figures_compare_greedy_outputs_with_plain_and_check_the_teacher():
    from eagle3.stages.s06_evaluate.figures import run_figures, teacher_check

    plain = [[1, 2, 3], [4, 5], [6]]
    raw = {"plain": {"init_s": 2.0, "acceptance": [{"temperature": 0.0, "wall_s": 0.5, "tokens": plain}],
                     "timing": []},
           "trained": {"init_s": 3.0, "per_request_metrics": False, "timing": [],
                       "acceptance": [spec_pass(0.7, [[9]] * 3), spec_pass(0.0, [[1, 2, 3], [4, 5], [7]])]},
           # The floor is served at the first temperature only: no greedy pass to compare.
           "untrained": {"init_s": 3.0, "timing": [], "acceptance": [spec_pass(0.7, [[1]] * 3)]}}
    runs = run_figures(raw, K, [None] * 3, [0.7, 0.0])
    assert runs["trained"]["outputs_match_plain"] == pytest.approx(2 / 3)
    assert "outputs_match_plain" not in runs["untrained"]
    assert runs["plain"]["acceptance"] == [{"temperature": 0.0, "tokens": 6, "wall_s": 0.5}]
    assert runs["plain"]["init_s"] == 2.0 and runs["plain"]["timing"] is None
    assert [a["acceptance_length"] for a in runs["trained"]["acceptance"]] == pytest.approx([2.5, 2.5])
    assert runs["trained"]["acceptance"][1]["tokens"] == 6
    # Greedy first: every drafter run is compared with plain.
    first = {**raw, "untrained": {"init_s": 3.0, "timing": [], "acceptance": [spec_pass(0.0, plain)]}}
    assert run_figures(first, K, [None] * 3, [0.0, 0.7])["untrained"]["outputs_match_plain"] == 1.0
    # The teacher check: the target's greedy answer starts with the dataset's answer.
    assert teacher_check([[1, 2], None, [5, 5]], [[1, 2, 3], [4], [5, 6]]) == {"greedy_equals_dataset_answer": 0.5}
    assert teacher_check([None, None], [[1], [2]]) == {"greedy_equals_dataset_answer": None}
    assert teacher_check([[1]], None) == {"greedy_equals_dataset_answer": None}


def test_config_shares_the_stage_fields_and_the_dtype_table():
    from eagle3.core.config import StageConfig, build_config, identity_params

    cfg = EvaluateConfig(work_dir=Path("w"), target_model="t", dtype="bf16")
    assert isinstance(cfg, StageConfig) and cfg.dtype == "bfloat16" and cfg.force is False
    assert identity_params(cfg)["dtype"] == "bfloat16"  # a YAML `bf16` and a flag `bfloat16` are one run
    built = build_config(EvaluateConfig, "evaluate", None, {"work_dir": "w", "target_model": "t", "dtype": "fp32"})
    assert built.dtype == "float32"
    assert "force" not in identity_params(cfg) and identity_params(cfg)["trust_remote_code"] is False


def test_stage_06_file_names_come_from_the_work_dir():
    workdir = WorkDir(Path("w"))
    assert workdir.evaluate_results() == Path("w/06_evaluate/results.json")
    assert workdir.evaluate_plot() == Path("w/06_evaluate/evaluate.png")
    assert workdir.engine_log("plain") == Path("w/06_evaluate/logs/plain.log")
    assert workdir.engine_request("trained").parent == workdir.engine_result("trained").parent == Path("w/06_evaluate/runs")


def test_an_engines_result_is_read_from_whichever_run_served_it(tmp_path):
    """bench/served_pairs.py reads the trained engine's histograms: from the timed plain+trained
    run, or from its own run when nothing was timed; the newest file wins."""
    import os

    from eagle3.stages.s06_evaluate.engine import read_engine_result

    workdir = WorkDir(tmp_path)
    workdir.engine_result("x").parent.mkdir(parents=True)
    with pytest.raises(PipelineError, match="holds no result of a trained engine"):
        read_engine_result(workdir, "trained")
    workdir.engine_result("plain+trained").write_text(json.dumps({"runs": {"plain": {"id": 1}, "trained": {"id": 2}}}))
    assert read_engine_result(workdir, "trained") == {"id": 2} and read_engine_result(workdir, "plain") == {"id": 1}
    workdir.engine_result("trained").write_text(json.dumps({"runs": {"trained": {"id": 3}}}))
    os.utime(workdir.engine_result("plain+trained"), (1, 1))  # an older measurement's file
    assert read_engine_result(workdir, "trained") == {"id": 3}


def test_engine_shutdown_is_best_effort():
    from types import SimpleNamespace

    from eagle3.engines.vllm_shutdown import shutdown_llm

    def fake_llm(shutdown):
        return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(shutdown=shutdown)))

    calls = []
    shutdown_llm(fake_llm(lambda: calls.append("down")))
    assert calls == ["down"]

    def gone():
        raise RuntimeError("engine core already gone")

    shutdown_llm(fake_llm(gone))  # at exit a failed shutdown must not hide the result
    shutdown_llm(None)


def test_worker_shuts_the_engine_down_when_a_pass_fails(monkeypatch):
    """The engine is shut down on the way out of `serve_and_measure`, also after an error.
    (Imports vLLM's CPU build: ~5 s.)"""
    from types import SimpleNamespace

    import eagle3.stages.s06_evaluate.engine as engine
    from eagle3.engines.config import EngineConfig

    calls = []

    def generate(*a, **k):
        raise RuntimeError("pass failed")

    llm = SimpleNamespace(generate=generate, get_metrics=lambda: [],
                          llm_engine=SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: calls.append(1))))
    monkeypatch.setattr(engine, "_start_engine", lambda *a: llm)
    settings = engine.engine_request(EngineConfig(model="some/target", max_model_len=64))
    req = {**settings, "num_speculative_tokens": K, "max_new_tokens": 4, "prompts": [[1, 2]],
           "engines": [{"name": "plain", "drafter": None, "temperatures": [0.0]}], "timing_blocks": [],
           "warmup_prompts": 0}
    with pytest.raises(RuntimeError, match="pass failed"):
        engine.serve_and_measure(req)
    assert calls == [1]


def test_the_timed_worker_keeps_both_engines_alive_and_interleaves_their_requests(monkeypatch):
    """The timed run: the plain engine starts first (a new engine unregisters the metrics of
    the ones before it, and the drafter's counters are the ones read), each engine serves its
    acceptance passes, then the timed prompts alternate between the two engines, and both
    engines are shut down. (Imports vLLM's CPU build: ~5 s.)"""
    from dataclasses import astuple
    from types import SimpleNamespace

    import eagle3.stages.s06_evaluate.engine as engine
    from eagle3.engines.config import EngineConfig
    from eagle3.stages.s06_evaluate.timing import schedule

    events = []

    def fake_llm(name):
        def generate(prompts, params, use_tqdm=False):
            temperature = params[0].temperature if isinstance(params, list) else params.temperature
            events.append((name, len(prompts), temperature, params.max_tokens if not isinstance(params, list)
                           else params[0].max_tokens))
            metrics = SimpleNamespace(first_token_ts=1.0, last_token_ts=2.0)
            spec = SimpleNamespace(histogram=[0, 3, 0, 0]) if name == "trained" else None
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 7, 7, 7], finish_reason="length",
                                                             spec_decode_metrics=spec)], metrics=metrics)
                    for _ in prompts]

        return SimpleNamespace(generate=generate, get_metrics=lambda: [], llm_engine=SimpleNamespace(
            engine_core=SimpleNamespace(shutdown=lambda: events.append((name, "shutdown")))))

    started = []

    def start(cfg):
        name = "trained" if cfg.speculative_config else "plain"
        started.append((name, cfg.kv_cache_gib))
        return fake_llm(name)

    monkeypatch.setattr(engine, "_start_engine", start)
    monkeypatch.setattr(engine, "_fix_cpu_sampled_verification", lambda: False)  # patches vLLM process-wide
    settings = engine.engine_request(EngineConfig(model="some/target", max_model_len=64))
    req = {**settings, "num_speculative_tokens": K, "max_new_tokens": 4, "prompts": [[1, 2], [3], [4, 5, 6]],
           "engines": [{"name": "plain", "drafter": None, "temperatures": [0.0]},
                       {"name": "trained", "drafter": "some/drafter", "temperatures": [0.0, 0.7]}],
           "timing_blocks": [list(astuple(b)) for b in schedule([0, 2], 2, ["plain", "trained"])],
           "warmup_prompts": 1}
    out = engine.serve_and_measure(req)
    assert started == [("plain", 1.0), ("trained", 1.0)]  # each its own KV cache (the CPU default)
    acceptance = [(name, n, t) for name, n, t, _ in events[:3]]
    assert acceptance == [("plain", 3, 0.0), ("trained", 3, 0.0), ("trained", 3, 0.7)]
    warmups = events[3:5]
    assert [(name, n) for name, n, _, _ in warmups] == [("plain", 1), ("trained", 1)]
    timed = [name for name, *_ in events[5:-2]]
    assert timed == ["plain", "trained", "trained", "plain", "trained", "plain", "plain", "trained"]
    assert events[-2:] == [("trained", "shutdown"), ("plain", "shutdown")]
    runs = out["runs"]
    assert [len(p["request_wall_s"]) for p in runs["plain"]["timing"]] == [2, 2]
    assert runs["trained"]["timing"][0]["histograms"] == [[0, 3, 0, 0]] * 2
    assert runs["plain"]["timing"][0]["histograms"] is None and runs["plain"]["timing"][1]["prompts"] == [0, 2]
    assert [a["temperature"] for a in runs["trained"]["acceptance"]] == [0.0, 0.7]
    assert runs["plain"]["per_request_metrics"] is False and runs["trained"]["per_request_metrics"] is True
    with pytest.raises(AssertionError, match="the plain engine, then a drafter engine"):
        engine.serve_and_measure({**req, "engines": req["engines"][::-1]})


def test_plot_draws_positions_categories_and_training_curves(tmp_path):
    from eagle3.stages.s06_evaluate.report import write_plot

    block = {"acceptance_length": 2.0, "acceptance_per_position": [0.5, 0.3, 0.2], "ci95": 0.1,
             "by_category": {"math": {"acceptance_length": 2.2, "ci95": 0.2}, "code": {"acceptance_length": 1.8}}}
    r = {"num_speculative_tokens": K, "categories": {"field": "category", "names": ["math", "code"]},
         "acceptance": [{"temperature": 0.0, "trained": block, "untrained": {"acceptance_length": 1.0}},
                        {"temperature": 0.7, "trained": block, "untrained": None}],
         "expected_accept_length_training": {"full_acc": [0.6, 0.4, 0.2]}}
    curve = [{"split": s, "step": n, "full_acc_0": 0.1 * n, "full_acc_1": 0.05 * n} for n in (1, 2, 3)
             for s in ("train", "eval")]

    def png_width(path: Path) -> int:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        return int.from_bytes(data[16:20], "big")  # IHDR width

    write_plot(tmp_path / "cats.png", r, curve, 2)
    no_cats = {**r, "categories": {"field": None, "names": []}}
    write_plot(tmp_path / "plain.png", no_cats, [], 0)
    assert png_width(tmp_path / "cats.png") == 15 * 110 and png_width(tmp_path / "plain.png") == 10 * 110
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cats.png", "plain.png"]  # no temporary file left
