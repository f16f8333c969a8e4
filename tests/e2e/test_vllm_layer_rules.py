"""The vLLM layer rules of eagle3/serving/engine_rules.py against vLLM's own functions.

`captured_layers(VLLM, ...)` and `captured_layers(VLLM_V2, ...)` say which target layers
vLLM 0.32's two model runners capture for a drafter config. tests/unit/test_engine_rules.py
checks them against values read from vLLM's source; here the installed vLLM answers
itself, on a grid of drafter configs (top-level ids, SGLang's nested ids, both, empty
lists, the nested `layer_ids` key) times targets (flat configs of several depths, and
multimodal ones whose language model is nested under `text_config`):

- the ids a runner takes from the config: V1's `GPUModelRunner._get_eagle3_aux_layers_from_config`,
  V2's `get_eagle3_aux_layers_from_config` (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py),
  given the draft's hf_config as vLLM's `SpeculativeConfig` builds it for EAGLE-3 (the
  config.json loaded by transformers, wrapped in vLLM's `EAGLEConfig`);
- when the config names none, the model's default, `SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`,
  on a stand-in model with as many decoder layers as vLLM's text config
  (`get_hf_text_config`) holds, nested under `language_model` for a multimodal target;
- the target's depth as this pipeline reads it (`read_target_info`) equals vLLM's.

Imports vLLM (about 10 s and more); starts no engine.
"""
from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest

from eagle3.serving import engine_rules as er
from eagle3.target.info import read_target_info

pytest.importorskip("vllm")
from transformers import AutoConfig, LlamaConfig  # noqa: E402
from vllm.model_executor.models.interfaces import SupportsEagle3  # noqa: E402
from vllm.transformers_utils.config import get_hf_text_config  # noqa: E402
from vllm.transformers_utils.configs.eagle import EAGLEConfig  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, vocab_size=100, max_position_embeddings=256)

# (id, model_type, kwargs): the target's config.
TARGETS = [
    *[(f"llama-{n}", "llama", dict(TEXT, num_hidden_layers=n)) for n in (4, 5, 8, 32, 61)],
    # the language model's depth is text_config's, not the vision tower's
    ("llava-13", "llava", dict(text_config=dict(TEXT, model_type="llama", num_hidden_layers=13),
                               vision_config=dict(model_type="clip_vision_model", num_hidden_layers=5))),
    ("qwen2_5_vl-9", "qwen2_5_vl", dict(text_config=dict(TEXT, num_hidden_layers=9), vision_config=dict(depth=3))),
]

# (id, keys added to the drafter's config.json)
DRAFTS = [
    ("none", {}),
    ("both", er.aux_layer_config([2, 3, 4])),
    ("top", {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}),
    ("top-two-ids", {"eagle_aux_hidden_state_layer_ids": [2, 3]}),
    ("nested", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}}),
    ("top-empty+nested", {"eagle_aux_hidden_state_layer_ids": [],
                          "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}),
    ("nested-empty", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": []}}),
    ("nested-layer_ids", {"eagle_config": {"layer_ids": [3, 4, 5]}}),
    ("nested-both-keys", {"eagle_config": {"layer_ids": [3, 4, 5], "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}),
    ("top+nested-disagree", {"eagle_aux_hidden_state_layer_ids": [2, 3, 4],
                             "eagle_config": {"eagle_aux_hidden_state_layer_ids": [6, 6, 6]}}),
]

DRAFTER = {"architectures": [er.ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1, **TEXT}


def vllm_spec(draft: dict) -> NS:
    """The draft part of a `SpeculativeConfig` as vLLM builds it for method "eagle3"."""
    hf = EAGLEConfig(LlamaConfig(**draft), method="eagle3", model_type="eagle")
    return NS(draft_model_config=NS(hf_config=hf))


def vllm_captures(draft: dict, target_config) -> tuple[list[int], list[int]]:
    """The layers vLLM's V1 and V2 runners capture: the config's ids, else the model's default."""
    spec = vllm_spec(draft)
    text = get_hf_text_config(target_config)
    layers = NS(layers=[None] * text.num_hidden_layers)  # the decoder's layer list
    nested = text is not target_config
    model = NS(language_model=NS(model=layers)) if nested else NS(model=layers)
    default = SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(model)
    v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(NS(speculative_config=spec))
    v2 = get_eagle3_aux_layers_from_config(spec)
    return list(v1 or default), list(v2 or default)


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict:
    """id -> (vLLM's view of the target config, this pipeline's TargetInfo of its config.json)."""
    out = {}
    for name, model_type, kw in TARGETS:
        cfg = AutoConfig.for_model(model_type, **kw)
        d = tmp_path_factory.mktemp(name)
        (d / "config.json").write_text(json.dumps(cfg.to_dict()))
        out[name] = (cfg, read_target_info(d))
    return out


def test_the_target_depth_is_vllms(targets):
    for name, (cfg, info) in targets.items():
        assert info.num_layers == get_hf_text_config(cfg).num_hidden_layers, name
    assert targets["llava-13"][1].num_layers == 13 and targets["llava-13"][1].text_config_key == "text_config"


@pytest.mark.parametrize("draft_name, extra", DRAFTS, ids=[d[0] for d in DRAFTS])
def test_captured_layers_are_what_vllms_runners_capture(targets, draft_name, extra):
    draft = {**DRAFTER, **extra}
    for name, (cfg, info) in targets.items():
        v1, v2 = vllm_captures(draft, cfg)
        assert er.captured_layers(er.VLLM, draft, info.num_layers) == v1, (name, "V1")
        assert er.captured_layers(er.VLLM_V2, draft, info.num_layers) == v2, (name, "V2")
    # Without a target, the rules answer only when the config alone decides.
    spec = vllm_spec(draft)
    from_config_v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(NS(speculative_config=spec))
    from_config_v2 = get_eagle3_aux_layers_from_config(spec)
    assert er.captured_layers(er.VLLM, draft, None) == (list(from_config_v1) if from_config_v1 else None)
    assert er.captured_layers(er.VLLM_V2, draft, None) == (list(from_config_v2) if from_config_v2 else None)


def test_the_grid_exercises_every_branch(targets):
    """The grid holds configs on which the two runners disagree, and ones that take the default."""
    drafts = [{**DRAFTER, **extra} for _, extra in DRAFTS]
    cfg = targets["llama-32"][0]
    pairs = [vllm_captures(d, cfg) for d in drafts]
    assert any(v1 != v2 for v1, v2 in pairs)
    assert any(v1 == v2 == [2, 16, 29] for v1, v2 in pairs)  # the default [2, N//2, N-3]
