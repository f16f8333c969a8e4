"""The aux-layer translation per engine rule, the engines' tensor-name rules (engine_rules.py), and the
drafter checker that holds a drafter to them (drafter_check.py)."""
from __future__ import annotations

import math

import pytest
import torch

from eagle3.artifacts.vocab_map import target_ids
from eagle3.serving.drafter_check import TargetFacts, check_drafter, d2t_summary, errors
from eagle3.serving import engine_rules as er
from eagle3.target.info import default_aux_layers

# -- the translation (docs/CONVENTIONS.md §7) ------------------------------------------

def test_translation_for_kimi_k25_default_layers():
    cfg = er.aux_layer_config([2, 30, 58])
    assert cfg == {"eagle_aux_hidden_state_layer_ids": [2, 30, 58],
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}}


def test_vllm_reads_top_level_as_is():
    cfg = er.aux_layer_config([2, 30, 58])
    assert er.captured_layers(er.VLLM, cfg, 61) == [2, 30, 58]
    # Top-level wins over nested even when they disagree.
    assert er.captured_layers(er.VLLM, {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [9, 9, 9]}},
                              61) == [2, 30, 58]


def test_vllm_reads_nested_ids_as_is_when_top_level_is_absent():
    # vLLM 0.32's fallback takes SGLang's nested ids WITHOUT adding one: an SGLang-only
    # config is read one layer off by vLLM.
    sglang_only = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    assert er.captured_layers(er.VLLM, sglang_only, 61) == [1, 29, 57]
    assert er.captured_layers(er.VLLM, {}, 61) == [2, 30, 58]  # default [2, N//2, N-3]
    assert er.captured_layers(er.VLLM, {}, None) is None


def test_vllm_v2_reads_top_level_and_never_the_nested_ids():
    # vLLM 0.32's V2 model runner (GPU default): the same top-level reading as V1 ...
    cfg = er.aux_layer_config([2, 30, 58])
    assert er.captured_layers(er.VLLM_V2, cfg, 61) == [2, 30, 58]
    # ... but an SGLang-only config falls back to [2, N//2, N-3], not to the nested ids
    sglang_only = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 9, 20]}}
    assert er.captured_layers(er.VLLM_V2, sglang_only, 32) == [2, 16, 29]
    assert er.captured_layers(er.VLLM, sglang_only, 32) == [3, 9, 20]  # V1: as-is
    assert er.captured_layers(er.VLLM_V2, sglang_only, None) is None  # depends on the target
    # the only nested key V2 reads is `layer_ids`, as-is
    assert er.captured_layers(er.VLLM_V2, {"eagle_config": {"layer_ids": [4, 8, 12]}}, 32) == [4, 8, 12]


def test_published_kimi_style_config_per_runner():
    # A SpecForge-style Kimi drafter: nested [1, 29, 57] only, meant as layers [2, 30, 58].
    kimi = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True}}
    assert er.captured_layers(er.VLLM, kimi, 61) == [1, 29, 57]  # one layer off
    assert er.captured_layers(er.VLLM_V2, kimi, 61) == [2, 30, 58]  # right, by the default
    assert er.captured_layers(er.SGLANG_DEEPSEEK, kimi, 61) == [2, 30, 58]
    # without a target, inspect warns that the runners disagree
    cfg, t = _drafter()
    cfg = {k: v for k, v in cfg.items() if k != "eagle_aux_hidden_state_layer_ids"}
    msgs = [f.message for f in check_drafter(cfg, t) if f.level == "warning" and f.engine == "vllm"]
    assert any("V2 model runner" in m and "[2, 4, 5]" in m for m in msgs)
    # with a target, V1 (nested as-is) and V2 (default [2, 4, 5] for 8 layers) are judged apart
    target = TargetFacts(num_layers=8, hidden_size=64, vocab_size=100, max_position_embeddings=4096,
                         family="llama")
    bad = errors(check_drafter(cfg, t, target))
    assert len(bad) == 1 and bad[0].message.startswith("vLLM V1 runner") and "captures [1, 3, 4]" in bad[0].message


def test_sglang_old_rule_adds_one_to_each_nested_id():
    cfg = er.aux_layer_config([2, 30, 58])
    assert er.captured_layers(er.SGLANG, cfg, 61) == [2, 30, 58]
    assert er.captured_layers(er.SGLANG, {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 28]}},
                              32) == [3, 16, 29]
    # Top-level ids are not read by SGLang: without nested ids it uses its default.
    assert er.captured_layers(er.SGLANG, {"eagle_aux_hidden_state_layer_ids": [3, 9, 20]}, 32) == [2, 16, 29]


def test_sglang_deepseek_rule_adds_one_only_when_first_id_is_1():
    # [1, 29, 57] starts with 1, so every id gets +1: the same layers as the old rule.
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    assert er.captured_layers(er.SGLANG_DEEPSEEK, nested, 61) == [2, 30, 58]
    assert er.captured_layers(er.SGLANG, nested, 61) == [2, 30, 58]
    # Any other first id: taken as-is, so the old and new rules disagree by one.
    other = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 29, 57]}}
    assert er.captured_layers(er.SGLANG_DEEPSEEK, other, 61) == [2, 29, 57]
    assert er.captured_layers(er.SGLANG, other, 61) == [3, 30, 58]
    zero = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 29, 57]}}
    assert er.captured_layers(er.SGLANG_DEEPSEEK, zero, 61) == [0, 29, 57]  # layer 0 = the embeddings


def capture_problems(layers: list[int], family: str | None, num_layers: int = 61) -> list[str]:
    """The layer-capture errors `check_drafter` finds in the config the pipeline writes for
    `layers` (its one answer to "will every engine capture these layers"); family None: no target."""
    target = None if family is None else TargetFacts(num_layers=num_layers, hidden_size=64, vocab_size=100,
                                                     max_position_embeddings=4096, family=family)
    return [f.message for f in check_drafter(er.aux_layer_config(layers), {}, target)
            if f.topic == er.CAPTURE_TOPIC and f.level == "error"]


def test_default_layers_translate_for_every_engine_and_family():
    for n in (8, 16, 32, 61, 80):
        layers = default_aux_layers(n)
        for family in ("llama", "deepseek", None):
            assert capture_problems(layers, family, n) == [], (n, family)


def test_layer_1_cannot_be_expressed_for_the_deepseek_rule():
    assert capture_problems([1, 30, 58], "llama") == []  # old rule: nested 0 + 1 = 1
    problems = capture_problems([1, 30, 58], "deepseek")
    assert len(problems) == 1 and "nested id 0" in problems[0] and "captures [0, 29, 57]" in problems[0]


def test_first_layer_other_than_2_breaks_only_the_deepseek_rule():
    assert capture_problems([3, 30, 58], "llama") == []
    (p,) = capture_problems([3, 30, 58], "deepseek")
    assert "captures [2, 29, 57], but the drafter was trained on [3, 30, 58]" in p


def test_layer_range_problems():
    assert er.layer_range_problems([2, 4, 5], 8) == []
    assert any("negative" in p for p in er.layer_range_problems([-1, 4, 5], 8))
    assert any("embedding" in p for p in er.layer_range_problems([0, 4, 5], 8))
    assert any(">=" in p for p in er.layer_range_problems([2, 4, 8], 8))
    assert any("ascending" in p for p in er.layer_range_problems([5, 4, 2], 8))


def test_intended_layers():
    assert er.intended_layers(er.aux_layer_config([2, 4, 5]))[0] == [2, 4, 5]
    layers, where = er.intended_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}})
    assert layers == [2, 4, 5] and "SGLang" in where
    assert er.intended_layers({})[0] is None


def test_target_family():
    assert er.target_family("LlamaForCausalLM", "llama") == "llama"
    assert er.target_family("DeepseekV3ForCausalLM", "deepseek_v3") == "deepseek"
    assert er.target_family("KimiK25ForConditionalGeneration", "deepseek_v3") == "deepseek"
    assert er.target_family("Qwen3ForCausalLM", "qwen3") == "llama"
    assert er.rules_for("llama") == (er.VLLM, er.VLLM_V2, er.SGLANG)
    assert er.rules_for("deepseek") == (er.VLLM, er.VLLM_V2, er.SGLANG, er.SGLANG_DEEPSEEK)
    assert er.SGLANG_DEEPSEEK in er.rules_for("deepseek") and er.SGLANG_DEEPSEEK in er.rules_for(None)


# -- tensor names ----------------------------------------------------------------------

def test_vllm_name_rules():
    assert er.vllm_name("fc.weight") == ("load", "fc.weight")
    assert er.vllm_name("midlayer.self_attn.q_proj.weight") == ("load", "midlayer.self_attn.q_proj.weight")
    assert er.vllm_name("layers.0.mlp.up_proj.weight") == ("load", "midlayer.mlp.up_proj.weight")
    assert er.vllm_name("lm_head.weight") == ("load", "lm_head.weight")
    assert er.vllm_name("d2t") == ("load", "d2t")
    assert er.vllm_name("t2d") == ("skip", "t2d")
    assert er.vllm_name("model.fc.weight")[0] == "reject"  # vLLM prepends model. itself
    assert er.vllm_name("extra.weight")[0] == "reject"
    assert er.vllm_name("fc.bias")[0] == "ignore"


def test_sglang_name_rules():
    assert er.sglang_name("fc.weight") == ("load", "fc.weight")
    assert er.sglang_name("model.fc.weight") == ("load", "fc.weight")
    assert er.sglang_name("midlayer.mlp.gate_proj.weight") == ("load", "midlayer.mlp.gate_proj.weight")
    assert er.sglang_name("layers.0.mlp.gate_proj.weight")[0] == "ignore"  # silently: weights stay random
    assert er.sglang_name("model.lm_head.weight")[0] == "ignore"
    assert er.sglang_name("d2t") == ("load", "d2t") and er.sglang_name("t2d")[0] == "skip"


# -- check_drafter on synthetic tensors ---------------------------------------------------

def _drafter(H=64, nh=1, nkv=1, D=64, inter=128, V=100, Vd=16, layers=(2, 4, 5)):
    cfg = {"architectures": [er.ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1, "hidden_size": H,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": D, "intermediate_size": inter,
           "vocab_size": V, "draft_vocab_size": Vd, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           **er.aux_layer_config(list(layers))}
    shapes = er.expected_shapes(cfg, len(layers))
    t = {n: torch.zeros(shapes[n], dtype=torch.bfloat16) for n in er.WEIGHT_NAMES}
    ids = torch.arange(0, 2 * Vd, 2) if 2 * Vd <= V else torch.arange(Vd)
    t["d2t"] = ids - torch.arange(Vd)
    t["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True)
    return cfg, t


def test_clean_synthetic_drafter_has_no_errors_or_warnings():
    cfg, t = _drafter()
    target = TargetFacts(num_layers=8, hidden_size=64, vocab_size=100, max_position_embeddings=4096,
                         family="llama")
    assert [f for f in check_drafter(cfg, t, target) if f.level != "info"] == []


def test_four_aux_layers_serve_in_both_engines_and_a_count_that_disagrees_with_fc_is_an_error():
    # vLLM 0.32 and SGLang from 0.5.12 on size fc by num_aux_hidden_states, else the nested id
    # count, else 3 (drafter_check `aux_count`); an earlier check held SGLang to exactly three.
    cfg, t = _drafter(layers=(1, 2, 4, 5))
    target = TargetFacts(num_layers=8, hidden_size=64, vocab_size=100, max_position_embeddings=4096,
                         family="llama")
    assert errors(check_drafter(cfg, t, target)) == []
    cfg["num_aux_hidden_states"] = 3
    bad = errors(check_drafter(cfg, t, target))
    assert [(f.engine, f.topic) for f in bad] == [("both", "layers")], bad
    assert "fc fuses 4 aux states" in bad[0].message and "num_aux_hidden_states" in bad[0].message


def test_deepseek_target_with_layers_starting_at_3_is_an_error():
    cfg, t = _drafter(layers=(3, 4, 5))
    target = TargetFacts(num_layers=8, hidden_size=64, vocab_size=100, max_position_embeddings=4096,
                         family="deepseek")
    bad = errors(check_drafter(cfg, t, target))
    assert len(bad) == 1 and "captures [2, 3, 4]" in bad[0].message


def test_d2t_with_equal_vocabs_is_refused_by_vllm():
    cfg, t = _drafter(V=16, Vd=16)
    t["d2t"] = torch.zeros(16, dtype=torch.int64)
    t["t2d"] = torch.ones(16, dtype=torch.bool)
    bad = errors(check_drafter(cfg, t))
    assert [f.engine for f in bad] == ["vllm"] and "drop d2t" in bad[0].message


def test_d2t_summary():
    s = d2t_summary(torch.tensor([0, 0, 1, -1]), 10)  # ids 0, 1, 3, 2
    assert s["duplicates"] == 0 and not s["ascending"] and s["out_of_range"] == 0
    s = d2t_summary(torch.tensor([5, 5, 8]), 10)  # ids 5, 6, 10
    assert s["out_of_range"] == 1 and s["ascending"]


LLAMA_8 = dict(num_layers=8, hidden_size=64, vocab_size=100, max_position_embeddings=4096, family="llama")


def _errors_on(cfg, t, topic, **target):
    return [f.message for f in errors(check_drafter(cfg, t, TargetFacts(**{**LLAMA_8, **target})))
            if f.topic == topic]


def test_d2t_pointing_outside_the_target_vocab_is_an_error():
    for bad_id in (100, -1):  # one past the last id; below the first
        cfg, t = _drafter()
        ids = target_ids(t["d2t"]).clone()
        ids[-1 if bad_id >= 0 else 0] = bad_id
        t["d2t"] = ids - torch.arange(16)
        msgs = _errors_on(cfg, t, "d2t")
        assert msgs == ["1 target id(s) i + d2t[i] outside [0, 100): the engines index out of bounds"], bad_id


def test_two_draft_rows_mapping_to_one_target_id_is_an_error():
    cfg, t = _drafter()
    ids = target_ids(t["d2t"]).clone()
    ids[1] = ids[0]
    t["d2t"] = ids - torch.arange(16)
    (msg,) = _errors_on(cfg, t, "d2t")
    assert msg.startswith("1 duplicate target id(s) among i + d2t[i]")


def test_a_vocab_size_other_than_the_targets_is_an_error():
    cfg, t = _drafter()
    (msg,) = _errors_on(cfg, t, "config", vocab_size=128)
    assert msg.startswith("vocab_size = 100, the target's is 128")


def test_a_hidden_size_other_than_the_targets_is_an_error_for_fc_and_for_the_shared_embedding():
    cfg, t = _drafter()
    msgs = _errors_on(cfg, t, "config", hidden_size=96)
    assert len(msgs) == 2
    assert msgs[0].startswith("target_hidden_size = 64 (hidden_size when absent) but the target's hidden size is 96")
    assert msgs[1].startswith("hidden_size 64 != the target's 96 and no embed_tokens")
    # a drafter of another width that reads aux states of the target's width is right for fc
    cfg["target_hidden_size"] = 96
    t["fc.weight"] = torch.zeros(er.expected_shapes(cfg, 3)["fc.weight"], dtype=torch.bfloat16)
    (msg,) = _errors_on(cfg, t, "config", hidden_size=96)
    assert msg.startswith("hidden_size 64 != the target's 96 and no embed_tokens")


def test_a_context_shorter_than_the_targets_is_an_sglang_error():
    cfg, t = _drafter()
    target = TargetFacts(**{**LLAMA_8, "max_position_embeddings": 8192})
    bad = errors(check_drafter(cfg, t, target))
    assert [f.engine for f in bad] == ["sglang"]
    assert bad[0].message.startswith("max_position_embeddings = 4096 < the target's 8192: SGLang refuses")
    assert not errors(check_drafter(cfg, t, TargetFacts(**{**LLAMA_8, "max_position_embeddings": 4096})))


# -- EAGLE 3.1 (docs/CONVENTIONS.md §6 and §8) ------------------------------------------------

def _eagle31(**extra):
    cfg, t = _drafter()
    cfg.update(fc_norm=True, norm_output=True, **extra)
    t.update({n: torch.ones(64, dtype=torch.bfloat16) for n in er.fc_norm_names(3)})
    return cfg, t


def test_an_eagle31_drafter_is_clean_for_both_engines_and_says_which_releases_serve_it():
    cfg, t = _eagle31()
    findings = check_drafter(cfg, t, TargetFacts(**LLAMA_8))
    assert [f for f in findings if f.level != "info"] == []
    (shape,) = [f for f in findings if f.topic == "shape"]
    assert shape.message == ("EAGLE 3.1 (fc_norm True, norm_output True): served by vLLM >= 0.22.0 and "
                             "SGLang >= 0.5.12")
    # norm_output alone adds no tensor and is read by both engines as well
    cfg, t = _drafter()
    cfg["norm_output"] = True
    assert [f.level for f in check_drafter(cfg, t) if f.topic == "shape"] == ["info"]
    assert not errors(check_drafter(cfg, t))


def test_fc_norm_names_per_engine():
    # vLLM prepends "model." and loads model.fc_norm.{i}.weight (a parameter when config.json sets fc_norm)
    assert er.vllm_name("fc_norm.2.weight") == ("load", "fc_norm.2.weight")
    assert er.vllm_name("model.fc_norm.0.weight")[0] == "reject"  # vLLM prepends model. itself
    assert er.vllm_name("aux_norm_low.weight")[0] == "reject"  # the legacy names: vLLM knows none
    # SGLang: unprefixed or model.-prefixed, and the legacy names renamed
    assert er.sglang_name("fc_norm.1.weight") == ("load", "fc_norm.1.weight")
    assert er.sglang_name("model.fc_norm.1.weight") == ("load", "fc_norm.1.weight")
    assert er.sglang_name("aux_norm_high.weight") == ("load", "fc_norm.2.weight")
    assert er.is_known_name("fc_norm.7.weight") and not er.is_known_name("fc_norm.x.weight")


def test_fc_norm_tensors_and_config_must_agree():
    cfg, t = _eagle31()
    del t["fc_norm.1.weight"]
    (msg,) = [f.message for f in errors(check_drafter(cfg, t))]
    assert msg.startswith("fc_norm is on but ['fc_norm.1.weight'] are missing: the engine keeps those norms at "
                          "their initial weight (ones)")
    cfg, t = _eagle31()
    del cfg["fc_norm"]  # tensors without the switch: vLLM has no parameter, SGLang drops them
    bad = errors(check_drafter(cfg, t))
    assert [f.engine for f in bad] == ["both"] and 'does not set "fc_norm": true' in bad[0].message
    cfg, t = _eagle31()
    t["fc_norm.3.weight"] = torch.ones(64, dtype=torch.bfloat16)
    assert any("beyond the 3 aux layers" in f.message for f in errors(check_drafter(cfg, t)))
    cfg, t = _eagle31()
    t["fc_norm.0.weight"] = torch.ones(32, dtype=torch.bfloat16)
    assert any(f.message.startswith("fc_norm.0.weight has shape (32,), config.json implies (64,)")
               for f in errors(check_drafter(cfg, t)))


def test_the_legacy_spelling_is_an_sglang_only_drafter():
    cfg, t = _eagle31()
    del cfg["fc_norm"]
    cfg["use_aux_norm"] = True
    legacy = dict(zip(er.fc_norm_names(3), er.LEGACY_FC_NORM_NAMES))
    t = {legacy.get(n, n): v for n, v in t.items()}
    bad = errors(check_drafter(cfg, t))
    assert sorted(f.engine for f in bad) == ["vllm", "vllm"]  # its names and its key: SGLang reads both
    assert any("vLLM reads only `fc_norm`" in f.message for f in bad)


def test_every_supported_engine_serves_every_drafter_shape():
    from packaging.version import Version

    from eagle3.drafter.shape import SHAPES

    assert set(er.SHAPE_FIRST_VERSIONS) | {"eagle3"} == set(SHAPES)
    for shape, first in er.SHAPE_FIRST_VERSIONS.items():
        for package, version in first.items():
            assert Version(er.minimum_version(package)) >= Version(version), (shape, package)


# -- yarn rope as served (docs/KIMI_K25.md, "Rope and length as served") ---------------------

K25_YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_sglang_reads_yarn_mscale_from_0_5_16_and_vllm_always():
    ignored = 0.1 * math.log(64.0) + 1  # mscale(factor): what an engine that ignores the keys uses
    assert er.served_yarn_attention_factor("sglang", "0.5.15.post1", K25_YARN) == pytest.approx(ignored)
    assert er.served_yarn_attention_factor("sglang", "0.5.10", K25_YARN) == pytest.approx(ignored)
    assert er.served_yarn_attention_factor("sglang", er.SGLANG_YARN_MSCALE_READ_FROM, K25_YARN) == 1.0
    assert er.served_yarn_attention_factor("sglang", "0.5.23", K25_YARN) == 1.0
    assert er.served_yarn_attention_factor("vllm", "0.32.0", K25_YARN) == 1.0
    dropped = {k: v for k, v in K25_YARN.items() if k not in ("mscale", "mscale_all_dim")}
    assert er.served_yarn_attention_factor("vllm", "0.32.0", dropped) == pytest.approx(ignored)
    assert er.served_yarn_attention_factor("sglang", "0.5.23", dropped) == pytest.approx(ignored)
    # the keys each engine reads and the other does not
    assert er.served_yarn_attention_factor("vllm", "0.32.0", {**dropped, "attention_factor": 0.5}) == 0.5
    assert er.served_yarn_attention_factor("sglang", "0.5.23", {**dropped, "attention_factor": 0.5}) == \
        pytest.approx(ignored)
    assert er.served_yarn_attention_factor("sglang", "0.5.23", {**K25_YARN, "attn_factor": 2.0}) == 2.0
    assert er.served_yarn_attention_factor("sglang", "0.5.10", {"rope_type": "linear", "factor": 4.0}) == 1.0


def test_yarn_reading_warnings_name_the_engine_the_factor_and_the_fix():
    config = {"rope_scaling": K25_YARN}
    lines = er.yarn_reading_warnings(config, {"vllm": "0.32.0", "sglang": "0.5.15.post1"})
    assert len(lines) == 1 and lines[0].startswith("sglang 0.5.15.post1 scales")
    sharper = (0.1 * math.log(64.0) + 1) ** 2
    assert f"{sharper:.4f}x" in lines[0] and f">= {er.SGLANG_YARN_MSCALE_READ_FROM}" in lines[0]
    assert er.yarn_reading_warnings(config, {"vllm": "0.32.0", "sglang": "0.5.16"}) == []
    assert er.yarn_reading_warnings(config, {"vllm": None, "sglang": None}) == []
    assert er.yarn_reading_warnings({"rope_scaling": None}, {"sglang": "0.5.10"}) == []
