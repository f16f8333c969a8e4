"""eagle3/serving/model_card.py and stage 06's card table: a front matter the Hub's own parser reads,
stage 06's section replaced between its markers and nowhere else, serve commands equal to the
README's, and the measured table with its intervals."""
from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard

from eagle3.serving.engine_rules import minimum_version
from eagle3.serving.model_card import (CARD_NAME, EVALUATE_BEGIN, EVALUATE_END, evaluate_section, front_matter, hub_id,
                                       replace_evaluate_section, serve_commands, target_license, write_evaluate_section)
from eagle3.stages.s06_evaluate.report import card_table

ROOT = Path(__file__).resolve().parents[2]


def test_front_matter_parses_with_huggingface_hubs_model_card():
    card = ModelCard(front_matter("moonshotai/Kimi-K2.5", None) + "# a drafter\n")
    assert card.data.base_model == "moonshotai/Kimi-K2.5"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"eagle3", "speculative-decoding"} <= set(card.data.tags)
    assert card.data.license is None  # the target's card states none: no license key
    assert ModelCard(front_matter("t/x", "apache-2.0") + "x\n").data.license == "apache-2.0"
    assert ModelCard(front_matter(None, None) + "x\n").data.base_model is None


def test_base_model_is_a_hub_id_never_a_local_path(tmp_path):
    assert hub_id("moonshotai/Kimi-K2.5", None) == "moonshotai/Kimi-K2.5"
    assert hub_id(str(tmp_path), None) is None and hub_id("work/targets/x", None) is None
    assert hub_id(str(tmp_path), "HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_license_comes_only_from_the_targets_own_card(tmp_path):
    assert target_license(str(tmp_path)) is None  # no card
    (tmp_path / CARD_NAME).write_text("---\nlicense: mit\ntags: [x]\n---\n# model\n")
    assert target_license(str(tmp_path)) == "mit"
    (tmp_path / CARD_NAME).write_text("# a card without front matter\nlicense: mit\n")
    assert target_license(str(tmp_path)) is None


def test_stage_06s_section_is_replaced_between_its_markers_only(tmp_path):
    card = ("---\nbase_model: t\n---\n# Mine\nuser text above\n\n" + evaluate_section("old table")
            + "\n\nuser text below\n")
    new = replace_evaluate_section(card, "| new | table |")
    assert new == card.replace("old table", "| new | table |")
    assert replace_evaluate_section(new, "| new | table |") == new  # a rerun changes nothing
    # A card without markers (hand-written) gets the section at its end; the rest is untouched.
    plain = "# hand written\nkeep me\n"
    assert replace_evaluate_section(plain, "t").startswith(plain.rstrip("\n"))
    assert replace_evaluate_section(plain, "t").endswith(f"{EVALUATE_BEGIN}\nt\n{EVALUATE_END}\n")
    # On disk: only a card with our markers is edited; another author's card, or none, is left alone.
    assert write_evaluate_section(tmp_path, "t") is None and not (tmp_path / CARD_NAME).exists()
    (tmp_path / CARD_NAME).write_text(plain)
    assert write_evaluate_section(tmp_path, "t") is None and (tmp_path / CARD_NAME).read_text() == plain
    (tmp_path / CARD_NAME).write_text(card)
    assert write_evaluate_section(tmp_path, "fresh") == tmp_path / CARD_NAME
    assert (tmp_path / CARD_NAME).read_text() == card.replace("old table", "fresh")


def test_serve_commands_are_the_readmes_with_the_minimum_versions():
    cmds = serve_commands("moonshotai/Kimi-K2.5", "/data/eagle3/kimi-k2.5/05_export", k=3, tensor_parallel=8,
                          trust_remote_code=True)
    readme = (ROOT / "README.md").read_text()
    assert cmds["sglang"] in readme and cmds["vllm"] in readme
    assert minimum_version("vllm") == "0.32.0" and minimum_version("sglang") == "0.5.16"
    assert f"vLLM | {minimum_version('vllm')[:4]}" in readme and f"SGLang | {minimum_version('sglang')}" in readme


def results() -> dict:
    def block(L, ci, per, cats=None):
        return {"acceptance_length": L, "ci95": ci, "acceptance_per_position": per, "by_category": cats or {}}

    greedy = block(1.6712, 0.0712, [0.43, 0.18, 0.07], {"code": {**block(1.99, 0.21, None), "prompts": 10}})
    sampled = block(1.4731, 0.0644, [0.33, 0.11, 0.03], {"code": {**block(1.71, 0.18, None), "prompts": 10}})
    return {
        "num_speculative_tokens": 3, "engine": {"name": "vllm", "version": "0.32.0", "platform": "NVIDIA H200"},
        "settings": {"tensor_parallel_size": 8, "max_new_tokens": 64},
        "prompts": {"count": 60, "source": "data/demo_prompts_heldout.jsonl"},
        "acceptance": [{"temperature": 0.0, "trained": greedy, "untrained": block(1.0, 0.0, [0, 0, 0])},
                       {"temperature": 0.7, "trained": sampled, "untrained": None}],
        "categories": {"field": "category", "names": ["code"], "prompts": {"code": 10}},
        "expected_accept_length_training": {"value": 1.7722471613414312, "k": 3},
        "timing": {"prompts": 24}, "tokens_per_s": {"plain": 35.123, "speculative": 37.61},
        "speedup": 1.0708, "speedup_ci95": [0.962, 1.193], "speedup_verdict": "no difference shown",
        "acceptance_length": 1.6712, "break_even_acceptance_length": 1.3912, "break_even_ci95": [1.31, 1.48],
        "beats_break_even": True, "timing_problems": [],
    }


def test_the_card_table_holds_positions_categories_intervals_speed_engine_and_hardware():
    text = card_table(results(), "2026-12-02")
    assert "vLLM 0.32.0 on 8 x NVIDIA H200, K = 3 speculative tokens, 60 prompts" in text
    assert "| | greedy | T=0.7 |" in text
    assert "| acceptance length | 1.67 ±0.07 | 1.47 ±0.06 |" in text
    assert "| accepted through position 0 | 0.43 | 0.33 |" in text and "position 2 | 0.07 | 0.03 |" in text
    assert "| untrained drafter (the floor) | 1.00 | - |" in text
    assert "| category: code (n=10) | 1.99 ±0.21 | 1.71 ±0.18 |" in text
    assert "Training-time estimate for K = 3: 1.77." in text  # never 1.7722471613414312
    assert "speedup 1.07x [0.96, 1.19]: no difference shown" in text
    assert "1.39 [1.31, 1.48]: the drafter beats it" in text
    # The table sits inside a card that still parses.
    card = ModelCard(front_matter("t", None) + "# d\n\n" + evaluate_section(text))
    assert EVALUATE_BEGIN in card.content and card.data.base_model == "t"
