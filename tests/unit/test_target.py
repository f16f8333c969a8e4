"""Target facts read from config.json, including Kimi-K2.5's nested text_config."""
import json

import pytest
import torch

from eagle3.core.errors import PipelineError
from eagle3.target.info import (default_aux_layers, load_tokenizer, read_target_info, tokenizer_fingerprint,
                                validate_aux_layers)


def test_default_aux_layers_reference_case():
    assert default_aux_layers(61) == [2, 30, 58]
    assert default_aux_layers(32) == [2, 16, 29]
    assert default_aux_layers(8) == [2, 4, 5]


@pytest.mark.parametrize("ids,match", [
    ([-1, 2, 5], "negative"), ([0, 2, 5], "out of range"), ([2, 4, 8], "out of range"),
    ([4, 2, 5], "distinct and ascending"), ([2, 2, 5], "distinct and ascending"), ([], "empty"),
])
def test_layer_id_validation(ids, match):
    with pytest.raises(PipelineError, match=match):
        validate_aux_layers(ids, 8)
    assert validate_aux_layers([1, 4, 7], 8) == [1, 4, 7]


def test_kimi_k25_sizes_come_from_text_config(tiny_targets):
    kimi = tiny_targets["kimi_k25"]
    cfg = json.loads((kimi / "config.json").read_text())
    assert "num_hidden_layers" not in cfg and cfg["text_config"]["num_hidden_layers"] == 8
    info = read_target_info(kimi)
    assert (info.num_layers, info.hidden_size, info.vocab_size, info.text_config_key) == (8, 256, 960, "text_config")
    assert info.default_aux_layers() == [2, 4, 5]
    ds = read_target_info(tiny_targets["deepseek_v3"])
    assert ds.architecture == "DeepseekV3ForCausalLM" and ds.text_config_key is None


def test_reference_case_config_shape(tmp_path):
    # Kimi-K2.5's published config nests the DeepSeek-V3 text model like this.
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 7168,
                        "vocab_size": 163840, "max_position_embeddings": 262144, "num_attention_heads": 64}}))
    info = read_target_info(tmp_path)
    assert info.default_aux_layers() == [2, 30, 58] and info.max_position_embeddings == 262144


def test_tiny_targets_are_deterministic_and_load(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    from eagle3.demo.tiny import build_tiny_target

    again = build_tiny_target("llama", tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()
    tok = load_tokenizer(tiny_llama)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(load_tokenizer(again))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    out = model(torch.tensor([tok.encode("The capital of France is")]), output_hidden_states=True)
    assert len(out.hidden_states) == 9 and out.logits.shape[-1] == 960


def test_tiny_deepseek_v3_is_mla_moe(tiny_targets):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_targets["deepseek_v3"])
    cfg = model.config
    assert cfg.kv_lora_rank == 512 and cfg.qk_rope_head_dim == 64 and cfg.topk_method == "noaux_tc"
    assert cfg.n_routed_experts > 1 and model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 960)


def test_weights_fingerprint_tells_a_retrained_target_apart(tmp_path, tiny_llama):
    import shutil

    from safetensors.torch import load_file, save_file

    from eagle3.target.info import weights_fingerprint

    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama, copy)
    assert weights_fingerprint(copy) == weights_fingerprint(tiny_llama)
    w = load_file(copy / "model.safetensors")
    w["lm_head.weight"] = w["lm_head.weight"] + 1e-3  # same config, same shapes, other values
    save_file(w, copy / "model.safetensors", metadata={"format": "pt"})
    assert weights_fingerprint(copy) != weights_fingerprint(tiny_llama)
