"""Published DeepSeek/Kimi drafters, on tiny configs shaped like each (docs/KIMI_K25.md,
"Aux layer ids of published DeepSeek/Kimi drafters" and "The reference recipe against the
published drafters'"): which layers each was trained on, what `diagnose inspect`, stage 06's
layer check and `--init-from` make of it, and the shapes `--init-from` takes or refuses.

The shapes, scaled to an 8-layer target of hidden 64 (default layers [2, 4, 5]):
- SpecForge-style (AQ-MedAI's Kimi-K2 drafter too): nested ids only, first id 1
  ([1, 29, 57] for 61 layers -> [1, 3, 4] here), a 32K-style draft vocabulary with d2t,
  `model.`-prefixed names and the target's embedding;
- k-l-lambda's K2.5 fine-tunes: nested ids only, first id 2 ([2, 30, 58] -> [2, 4, 5]),
  yarn rope (factor 64, original 4096);
- lightseekorg's K2.5 drafter: the full vocabulary (no d2t, or an identity one) and as many
  KV heads as attention heads (64 of 64 -> 4 of 4 here);
- an MLA-attention drafter (lightseekorg's "-mla" variant): refused in one line;
- EAGLE 3.1 drafters in the three spellings published trainers write (docs/CONVENTIONS.md §6,
  "EAGLE 3.1", names the source of each): SpecForge's (top-level `fc_norm`/`norm_output`,
  unprefixed `fc_norm.{i}.weight`, the target's embedding), NeMo Automodel's (vLLM's module
  names: `model.fc_norm.{i}.weight`, `model.layers.0.*`) and the legacy one SGLang still reads
  (`use_aux_norm`, `aux_norm_{low,mid,high}.weight`).
"""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.serving import engine_rules as er
from eagle3.serving.drafter_io import CONFIG_NAME, WEIGHTS_NAME, hf_config_from_drafter_config
from eagle3.stages.s04_train.finetune import load_initial_drafter
from eagle3.stages.s06_evaluate.run import layer_capture
from eagle3.target.info import read_target_info
from eagle3.tools import diagnose

LAYERS = [2, 4, 5]  # [2, N//2, N-3] of the 8-layer target
YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def _drafter(seed=0, **kw) -> Eagle3Drafter:
    base = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                target_hidden_size=64, draft_vocab_size=16, target_vocab_size=100, max_position_embeddings=2048)
    base.update(kw)
    m = Eagle3Drafter(DrafterConfig(**base))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    V, Vd = m.config.target_vocab_size, m.config.draft_vocab_size
    if Vd < V:
        ids = torch.arange(0, V, V // Vd)[:Vd]
        m.set_vocab_mapping(ids - torch.arange(Vd), torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True))
    return m


def _write(folder, config, tensors):
    folder.mkdir()
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_NAME))
    return folder


def specforge_style(tmp_path):
    """Nested [1, 3, 4] only, `model.` prefix, embed_tokens: AQ-MedAI's K2 / SpecForge layout."""
    m = _drafter(seed=1)
    hf = hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=4096)
    del hf["eagle_aux_hidden_state_layer_ids"]
    t = {(k if k in ("lm_head.weight", "d2t", "t2d") else "model." + k): v for k, v in m.state_dict().items()}
    t["model.embed_tokens.weight"] = torch.randn(100, 64)
    return m, _write(tmp_path / "specforge", hf, t)


def kll_k25_style(tmp_path, yarn: bool = True):
    """Nested [2, 4, 5] only (the K2.5 fine-tunes' [2, 30, 58]), yarn rope."""
    m = _drafter(seed=2, rope_scaling=dict(YARN) if yarn else None, rope_theta=50000.0)
    hf = hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=4096)
    del hf["eagle_aux_hidden_state_layer_ids"]
    hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(LAYERS)  # as-is, not minus one
    return m, _write(tmp_path / ("kll" if yarn else "kll-plain"), hf, dict(m.state_dict()))


@pytest.fixture
def kimi_target(tmp_path):
    """A tiny Kimi-K2.5-shaped target config (text model under text_config, DeepSeek-V3)."""
    folder = tmp_path / "kimi"
    folder.mkdir()
    text = {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8,
            "hidden_size": 64, "vocab_size": 100, "max_position_embeddings": 4096, "num_attention_heads": 2,
            "rope_scaling": dict(YARN)}
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}))
    return folder


def _init(path, m, *, family, mode="keep", our_ids=None, shape=None):
    ids = our_ids if our_ids is not None else (m.d2t + torch.arange(m.config.draft_vocab_size)).numpy()
    kw = {"target_family": family} if family is not None else {}  # None: the default, family unknown
    kw.update({"shape": shape} if shape is not None else {})
    return load_initial_drafter(path, aux_layers=LAYERS, num_target_layers=8, target_hidden=64, target_vocab=100,
                                our_ids=ids, mode=mode, target_rows=lambda x: torch.zeros(len(x), 64),
                                expected_from="test store", **kw)


# -- point 5: the layers each published drafter was trained on ------------------------------

def test_sglang_rule_per_release():
    assert er.sglang_rules_for("llama", "0.5.16") == (er.SGLANG,)
    assert er.sglang_rules_for("deepseek", "0.5.16") == (er.SGLANG_DEEPSEEK,)
    assert er.sglang_rules_for("deepseek", "0.5.13") == (er.SGLANG_DEEPSEEK,)
    assert er.sglang_rules_for("deepseek", "0.5.12") == (er.SGLANG, er.SGLANG_DEEPSEEK)  # either rule
    assert er.sglang_rules_for("deepseek") == (er.SGLANG, er.SGLANG_DEEPSEEK)


def test_intended_layers_follow_the_targets_sglang_reading():
    kll = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
    spec = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    assert er.intended_layers(kll, "deepseek")[0] == [2, 30, 58]  # never 3/31/59 on a Kimi target
    assert er.intended_layers(spec, "deepseek")[0] == [2, 30, 58]
    assert er.intended_layers(spec, "llama")[0] == [2, 30, 58]
    assert er.intended_layers(kll, "llama")[0] == [3, 31, 59]  # SGLang's Llama classes add one
    layers, where = er.intended_layers(kll)  # family unknown: says what a Kimi target reads
    assert layers == [3, 31, 59] and "DeepSeek/Kimi target reads [2, 30, 58] as they are" in where


def test_inspect_a_k25_drafter_on_a_kimi_target(tmp_path, kimi_target, capsys):
    _, pub = kll_k25_style(tmp_path)
    diagnose.main(["inspect", str(pub), "--json", "--target-config", str(kimi_target)])
    r = json.loads(capsys.readouterr().out)
    assert r["layers"]["trained"] == LAYERS
    cap = r["layers"]["captured"]
    assert cap["vllm"] == LAYERS and cap["vllm-v2"] == LAYERS and cap["sglang-deepseek"] == LAYERS
    assert cap["sglang"] == [3, 5, 6]  # SGLang before PR #25454 only: a warning, not an error
    capture = [f for f in r["findings"] if f["topic"] == er.CAPTURE_TOPIC]
    assert [f["level"] for f in capture] == ["warning"] and ">= 0.5.13" in capture[0]["message"]
    assert not any(f["level"] == "error" and f["topic"] in ("layers", er.CAPTURE_TOPIC) for f in r["findings"])


def test_inspect_and_stage06_read_a_k25_drafters_nested_ids_as_they_are(tmp_path, kimi_target, capsys):
    """The layer reading alone (plain rope): trained on [2, 4, 5], not [3, 5, 6]."""
    _, pub = kll_k25_style(tmp_path, yarn=False)
    diagnose.main(["inspect", str(pub), "--json", "--target-config", str(kimi_target)])
    r = json.loads(capsys.readouterr().out)
    assert r["layers"]["trained"] == LAYERS
    cap = layer_capture(json.loads((pub / CONFIG_NAME).read_text()), read_target_info(kimi_target))
    assert cap["trained"] == LAYERS


def test_inspect_a_specforge_drafter_on_a_kimi_target(tmp_path, kimi_target, capsys):
    _, pub = specforge_style(tmp_path)
    diagnose.main(["inspect", str(pub), "--json", "--target-config", str(kimi_target)])
    r = json.loads(capsys.readouterr().out)
    assert r["layers"]["trained"] == LAYERS
    assert r["layers"]["captured"]["sglang"] == LAYERS and r["layers"]["captured"]["sglang-deepseek"] == LAYERS
    assert r["layers"]["captured"]["vllm"] == [1, 3, 4]  # V1 reads nested ids as-is: one layer off


def test_stage06_layer_check_of_published_drafters(tmp_path, kimi_target):
    info = read_target_info(kimi_target)
    for make in (kll_k25_style, specforge_style):
        _, pub = make(tmp_path)
        cap = layer_capture(json.loads((pub / CONFIG_NAME).read_text()), info)
        assert cap["target_family"] == "deepseek" and cap["trained"] == LAYERS, make.__name__
        assert cap["captured"]["sglang-deepseek"] == LAYERS and cap["captured"]["vllm-v2"] == LAYERS


def test_init_from_a_k25_drafter_keeps_its_layers_and_rope(tmp_path):
    m, pub = kll_k25_style(tmp_path)
    cfg, state, report = _init(pub, m, family="deepseek")
    assert report.layers == LAYERS and "as they are" in report.layers_from
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 64.0
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 4096 and cfg["rope_theta"] == 50000.0
    d = Eagle3Drafter(DrafterConfig.from_dict(cfg))
    d.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)


def test_init_from_never_asks_to_retrain_on_shifted_layers(tmp_path):
    """A Kimi store at [2, 4, 5] and a K2.5 drafter at nested [2, 4, 5]: no "rerun stage 02
    with --aux-layers 3,5,6" (the 3/31/59 of the real target)."""
    m, pub = kll_k25_style(tmp_path)
    try:
        _init(pub, m, family="deepseek")
    except PipelineError as e:  # pragma: no cover - the failure this test exists for
        pytest.fail(f"refused: {e}")


def test_init_from_a_specforge_drafter(tmp_path):
    m, pub = specforge_style(tmp_path)
    for family in ("deepseek", "llama"):
        _, state, report = _init(pub, m, family=family)
        assert report.layers == LAYERS and "embed_tokens.weight" not in state


# -- point 7: the shapes --init-from takes ---------------------------------------------------

@pytest.mark.parametrize("d2t", ["none", "identity"])
def test_init_from_a_full_vocabulary_drafter_with_as_many_kv_heads(tmp_path, caplog, d2t):
    """lightseekorg's K2.5 shape: every token has a row (no d2t, or an identity one), 64 KV heads."""
    m = _drafter(seed=4, num_attention_heads=4, num_key_value_heads=4, head_dim=16, draft_vocab_size=100)
    hf = hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=4096)
    t = {k: v for k, v in m.state_dict().items() if k not in ("d2t", "t2d")}
    if d2t == "identity":
        t["d2t"] = torch.zeros(100, dtype=torch.int64)
    pub = _write(tmp_path / "full", hf, t)
    ours = np.arange(3, 100, 6, dtype=np.int64)[:16]  # stage 03's 16 tokens
    with caplog.at_level(logging.INFO, logger="eagle3.stages.s04_train.finetune"):
        cfg, state, report = _init(pub, m, family=None, mode="remap", our_ids=ours)
    rep = report.to_json()
    assert rep["full_vocabulary"] is True and rep["num_key_value_heads"] == 4 == rep["num_attention_heads"]
    assert report.rows_copied == 16 and report.rows_new == 0  # every token of ours has its trained row
    assert any("full-vocabulary drafter" in r.message for r in caplog.records)
    assert cfg["num_key_value_heads"] == 4 and cfg["draft_vocab_size"] == 16
    assert torch.equal(state["lm_head.weight"], m.lm_head.weight.detach()[torch.from_numpy(ours)])
    d = Eagle3Drafter(DrafterConfig.from_dict(cfg))
    d.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    # keep: the whole vocabulary is trained, under an identity mapping
    _, kept, rep_keep = _init(pub, m, family=None, mode="keep", our_ids=ours)
    assert rep_keep.to_json()["full_vocabulary"] is True and torch.equal(kept["d2t"], torch.zeros(100).long())


def test_init_from_refuses_an_mla_drafter_in_one_line(tmp_path):
    m = _drafter(seed=5)
    hf = hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=4096)
    hf.update(architectures=["DeepseekV3ForCausalLMEagle3"], model_type="deepseek_v3", kv_lora_rank=16,
              q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    t = {k: v for k, v in m.state_dict().items() if "self_attn" not in k}
    t["midlayer.self_attn.kv_a_proj_with_mqa.weight"] = torch.randn(24, 128)
    t["midlayer.self_attn.kv_b_proj.weight"] = torch.randn(64, 16)
    pub = _write(tmp_path / "mla", hf, t)
    with pytest.raises(PipelineError) as e:
        _init(pub, m, family=None)
    msg = str(e.value)
    assert "\n" not in msg and "MLA-attention drafter" in msg and "kv_lora_rank = 16" in msg
    assert "from scratch" in msg


# -- EAGLE 3.1 drafters as published trainers write them ------------------------------------

LEGACY_NORMS = {"fc_norm.0.weight": "aux_norm_low.weight", "fc_norm.1.weight": "aux_norm_mid.weight",
                "fc_norm.2.weight": "aux_norm_high.weight"}


def eagle31_style(tmp_path, spelling: str):
    """An EAGLE 3.1 drafter written the way `spelling` writes one (module doc)."""
    m = _drafter(seed=7, fc_norm=True, norm_output=True)
    hf = hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=4096)
    sd = m.state_dict()
    if spelling == "specforge":  # SpecForge/configs/qwen3-30B-A3B-eagle3.1.json: no aux ids (the engines' default)
        for key in ("eagle_aux_hidden_state_layer_ids", "eagle_config"):
            del hf[key]
        t = {**sd, "embed_tokens.weight": torch.randn(100, 64)}
    elif spelling == "nemo":
        t = {k if k in ("lm_head.weight", "d2t", "t2d") else "model." + k.replace("midlayer.", "layers.0."): v
             for k, v in sd.items()}
    else:  # legacy
        del hf["fc_norm"]
        hf["use_aux_norm"] = True
        t = {LEGACY_NORMS.get(k, k): v for k, v in sd.items()}
    return m, _write(tmp_path / spelling, hf, t)


@pytest.mark.parametrize("spelling", ["specforge", "nemo", "legacy"])
def test_init_from_a_published_eagle31_drafter_trains_it_as_one(tmp_path, spelling):
    m, pub = eagle31_style(tmp_path, spelling)
    for wanted in (None, "eagle3.1"):  # no --drafter-shape, or the drafter's own
        cfg, state, report = _init(pub, m, family="llama", shape=wanted)
        assert cfg["fc_norm"] is True and cfg["norm_output"] is True
        assert report.to_json()["drafter_shape"] == "eagle3.1" and report.layers == LAYERS
        d = Eagle3Drafter(DrafterConfig.from_dict(cfg))
        d.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
        for i in range(3):  # each aux layer's norm is the published one, in fc's input order
            assert torch.equal(d.fc_norm[i].weight, m.fc_norm[i].weight)
    with pytest.raises(PipelineError) as e:
        _init(pub, m, family="llama", shape="eagle3")
    assert "--drafter-shape eagle3, but" in str(e.value) and "is an eagle3.1 drafter" in str(e.value)


def test_init_from_refuses_a_plain_drafter_as_eagle31_and_a_layer_variant(tmp_path):
    m, pub = kll_k25_style(tmp_path, yarn=False)
    with pytest.raises(PipelineError, match="pass --drafter-shape eagle3 .or leave it out."):
        _init(pub, m, family="deepseek", shape="eagle3.1")
    assert _init(pub, m, family="deepseek")[2].to_json()["drafter_shape"] == "eagle3"
    # speculators' first "3.1" recipe: one norm over the concatenated aux states (norm_before_fc)
    hf = json.loads((pub / CONFIG_NAME).read_text())
    (pub / CONFIG_NAME).write_text(json.dumps({**hf, "norm_before_fc": True}))
    with pytest.raises(PipelineError, match=r"sets \['norm_before_fc'\]: a layer variant"):
        _init(pub, m, family="deepseek")


@pytest.mark.parametrize("spelling", ["specforge", "nemo", "legacy"])
def test_inspect_names_the_shape_of_a_published_eagle31_drafter(tmp_path, capsys, spelling):
    _, pub = eagle31_style(tmp_path, spelling)
    diagnose.main(["inspect", str(pub), "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["shape"]["name"] == "eagle3.1"
    errors = {(f["engine"], f["topic"]) for f in r["findings"] if f["level"] == "error"}
    if spelling == "legacy":  # SGLang reads it; vLLM neither the key nor the names
        assert errors == {("vllm", "config"), ("vllm", "tensors")}
    elif spelling == "nemo":  # vLLM prepends model. itself: the prefixed names are refused there
        assert ("vllm", "tensors") in errors and ("vllm", "config") not in errors
    else:
        assert not any(topic in ("tensors", "config") for _, topic in errors)
