"""Rope and length as served (docs/KIMI_K25.md, "Rope and length as served"): the drafter
of a yarn target trains with the engines' yarn and exports it; a YAML whose stage 00
answers outrun stages 01/04 is refused; the K2.5 recipe holds a thinking turn in memory;
warmup is a share of the run; the trained reach is said against the served context."""
from __future__ import annotations

import json
import math

import pytest
import torch

from eagle3.core.config import build_config
from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig, rope_cos_sin, rope_inv_freq
from eagle3.drafter.shape import drafter_config_for_target
from eagle3.serving.drafter_io import hf_config_from_drafter_config
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.target.info import read_target_info

# Kimi-K2.5's text_config rope (config.json of moonshotai/Kimi-K2.5)
K25_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _cfg(rope_scaling, head_dim=64, theta=50000.0) -> DrafterConfig:
    return DrafterConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim,
                         intermediate_size=256, target_hidden_size=128, draft_vocab_size=16, target_vocab_size=100,
                         max_position_embeddings=262144, rope_theta=theta, rope_scaling=rope_scaling)


@pytest.mark.parametrize("scaling", [
    K25_YARN,                                                                       # mscale ratio: 1.0
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048},  # 0.1 ln 8 + 1
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16,
     "attention_factor": 1.2},
])
def test_yarn_is_what_vllm_computes_for_the_drafter(scaling):
    """cos/sin of the drafter's yarn at served positions equal vLLM 0.32's rotary embedding
    for the same config.json entry (what its Llama EAGLE-3 layer builds)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from eagle3.drafter.model import rope_attention_factor

    c = _cfg(scaling)
    params = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn", "rope_theta": c.rope_theta}
    with set_current_vllm_config(VllmConfig()):  # vLLM's rotary embedding is a CustomOp: it reads the config
        rope = get_rope(c.head_dim, max_position=c.max_position_embeddings, is_neox_style=True,
                        rope_parameters=params, dtype=torch.float32)
    # the frequencies themselves (a phase at position 10^5 amplifies float32 rounding of two computations)
    torch.testing.assert_close(rope_inv_freq(c), rope._compute_inv_freq(rope.scaling_factor), rtol=1e-5, atol=0)
    pos = torch.tensor([[p for p in (0, 1, 7, 100, 1000, 4095, 4096) if p < rope.cos_sin_cache.shape[0]]])
    cos, sin = rope_cos_sin(pos, rope_inv_freq(c), torch.float32, rope_attention_factor(c))  # [1, T, D]
    cache = rope.cos_sin_cache[pos[0]]  # [T, D]: cos halves then sin halves
    half = c.head_dim // 2
    torch.testing.assert_close(cos[0, :, :half], cache[:, :half], rtol=0, atol=1e-3)
    torch.testing.assert_close(sin[0, :, :half], cache[:, half:], rtol=0, atol=1e-3)
    assert math.isclose(rope_attention_factor(c), rope.mscale, rel_tol=1e-6)


@pytest.fixture
def kimi_target(tmp_path):
    folder = tmp_path / "kimi"
    folder.mkdir()
    text = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8,
            "hidden_size": 256, "vocab_size": 960, "max_position_embeddings": 262144, "num_attention_heads": 4,
            "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16, "intermediate_size": 512,
            "rope_theta": 50000.0, "rope_scaling": dict(K25_YARN)}
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}))
    return folder


def test_a_yarn_targets_drafter_trains_and_exports_its_yarn(tmp_path, kimi_target):
    info = read_target_info(kimi_target)
    tc = TrainConfig(work_dir=tmp_path, target_model=str(kimi_target))
    dc = drafter_config_for_target(info, tc, 32)
    assert dc.rope_scaling is not None and dc.rope_scaling["factor"] == 64.0
    assert dc.rope_scaling["original_max_position_embeddings"] == 4096 and dc.rope_theta == 50000.0
    hf = hf_config_from_drafter_config(dc, [2, 4, 5], max_position_embeddings=info.max_position_embeddings)
    rs = hf["rope_scaling"]
    assert rs["rope_type"] == "yarn" and rs["factor"] == 64.0  # the key vLLM's get_rope reads
    assert rs["original_max_position_embeddings"] == 4096 and hf["rope_theta"] == 50000.0
    assert hf["max_position_embeddings"] == 262144
    # the plain rope would rotate position 20000 differently: the drafter and the engines agree on yarn
    assert not torch.allclose(rope_inv_freq(dc), rope_inv_freq(_cfg(None, dc.head_dim, dc.rope_theta)))


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_a_config_whose_answers_outrun_training_is_refused(tmp_path):
    y = _yaml(tmp_path, "work_dir: w\ntarget_model: t\ngenerate:\n  max_new_tokens: 8192\n"
                        "prepare:\n  max_length: 4096\ntrain:\n  max_seq_len: 4096\n  batch_tokens: 8192\n")
    with pytest.raises(PipelineError) as e:
        build_config(TrainConfig, "train", y, sections=STAGE_CONFIGS)
    msg = str(e.value)
    assert "generate.max_new_tokens = 8192 exceeds prepare.max_length = 4096, train.max_seq_len = 4096" in msg
    assert str(y) in msg and "raise prepare.max_length and train.max_seq_len to at least 8192" in msg
    # the stage default counts when the section leaves it out (train.max_seq_len 2048)
    y2 = _yaml(tmp_path, "work_dir: w\ntarget_model: t\ngenerate:\n  max_new_tokens: 3000\n"
                         "prepare:\n  max_length: 8192\n")
    with pytest.raises(PipelineError, match=r"train.max_seq_len = 2048"):
        build_config(TrainConfig, "train", y2, sections=STAGE_CONFIGS)
    ok = _yaml(tmp_path, "work_dir: w\ntarget_model: t\ngenerate:\n  max_new_tokens: 1024\n"
                         "prepare:\n  max_length: 4096\ntrain:\n  max_seq_len: 4096\n  batch_tokens: 8192\n")
    assert build_config(TrainConfig, "train", ok, sections=STAGE_CONFIGS).max_seq_len == 4096


def test_the_k25_recipe_holds_a_thinking_turn_within_a_gpu():
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "configs" / "kimi-k2.5.yaml").read_text())
    new, prep, tr = data["generate"]["max_new_tokens"], data["prepare"]["max_length"], data["train"]
    assert prep >= new + 2048 and tr["max_seq_len"] >= new + 2048  # the answer and a prompt of 2K
    sys.path.insert(0, str(root / "bench"))
    from bench_memory import GIB, KIMI
    from eagle3.stages.s04_train.memory import predict_peak
    from eagle3.stages.s04_train.run import warmup_plan

    peak = predict_peak(DrafterConfig(**KIMI), ttt_steps=tr["ttt_steps"], batch_tokens=tr["batch_tokens"],
                        row_len=tr["max_seq_len"], checkpoint_steps=bool(tr.get("checkpoint_steps")), ddp=True)
    assert peak.total / GIB < 0.85 * 80 * 1e9 / GIB  # under stage 04's warning level on an 80 GB GPU
    text = (root / "configs" / "kimi-k2.5.yaml").read_text()
    assert f"{peak.total / GIB:.1f} GiB" in text  # the comment states the prediction for these values
    # warmup is a share of the run: ~760 planned steps (8 GPUs x 16384 tokens, ~50M tokens, 2 epochs)
    total = round(50e6 * tr["epochs"] / (8 * tr["batch_tokens"] * tr.get("grad_accum", 1)))
    warmup, warning = warmup_plan(tr.get("warmup_steps", 50), tr.get("warmup_ratio"), total)
    assert warning is None and 0.015 <= warmup / total <= 0.2


def test_warmup_share_and_the_warning_past_a_third():
    from eagle3.stages.s04_train.run import warmup_plan

    assert warmup_plan(500, None, 760)[0] == 500
    w, msg = warmup_plan(500, None, 760)
    assert "500 of the 760 planned steps (66%, more than a third)" in msg and "warmup_ratio" in msg
    assert warmup_plan(500, 0.05, 760) == (38, None)
    assert warmup_plan(50, None, 1000) == (50, None)
    assert warmup_plan(0, 0.5, 100)[1] is not None
    with pytest.raises(PipelineError):
        TrainConfig(work_dir=".", target_model="t", warmup_ratio=1.5)


def test_reach_of_the_k25_recipe():
    from eagle3.serving.positions import position_reach, reach_line

    r = position_reach(max_seq_len=16384, ttt_steps=4, served_context=262144, rope_scaling=K25_YARN,
                       rope_theta=50000.0)
    assert r["longest_trained_position"] == 16386  # row position 16383 + draft step 3
    line = reach_line(r)
    assert "positions 0-16,386" in line and "yarn rope (theta 50000, factor 64.0, original 4096 positions)" in line
    assert "262,144 positions: 6.3% of them were trained" in line
    short = reach_line(position_reach(max_seq_len=512, ttt_steps=3, served_context=256))
    assert "all within the trained ones" in short
