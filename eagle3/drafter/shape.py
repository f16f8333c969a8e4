"""A new drafter's shape, read from its target's config: shape policy, not the serving format.

Stage 04 builds a fresh drafter with `drafter_config_for_target` (the target's attention
and MLP sizes unless the config overrides them; MLA targets get a plain attention shape).

The drafter's kind is one of `SHAPES` (stage 04's `--drafter-shape`): "eagle3", or
"eagle3.1", which adds an RMSNorm per aux layer before `fc` (`fc_norm`) and feeds the
post-norm output to the next draft step (`norm_output`); eagle3/drafter/model.py says where
each norm sits. `shape_name` names the kind of any config (a published drafter may set one
of the two alone).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig

if TYPE_CHECKING:
    from eagle3.target.info import TargetInfo


MLA_HEAD_DIM, MLA_KV_HEADS = 128, 8  # default drafter attention shape for DeepSeek-V3/Kimi (MLA) targets

# name -> the DrafterConfig switches it sets (EAGLE 3.1: arXiv 2605.09992; served by vLLM
# PR #42764 and SGLang, docs/CONVENTIONS.md §6 and §8)
SHAPES: dict[str, dict[str, bool]] = {
    "eagle3": {"fc_norm": False, "norm_output": False},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}
DEFAULT_SHAPE = "eagle3"


def shape_switches(name: str) -> dict[str, bool]:
    """The DrafterConfig fields of a shape name (`SHAPES`)."""
    if name not in SHAPES:
        raise PipelineError(f"drafter shape {name!r} is not one of {list(SHAPES)}; pass --drafter-shape "
                            f"{' or '.join(SHAPES)}.")
    return dict(SHAPES[name])


def shape_name(fc_norm: bool, norm_output: bool) -> str:
    """The name of a drafter's kind: a `SHAPES` key, or what a config that sets one switch alone has."""
    switches = {"fc_norm": bool(fc_norm), "norm_output": bool(norm_output)}
    for name, table in SHAPES.items():
        if table == switches:
            return name
    return "eagle3 + " + " + ".join(k for k, on in switches.items() if on)


def drafter_config_for_target(info: TargetInfo, cfg, draft_vocab: int) -> DrafterConfig:
    """The drafter's shape: the target's attention/MLP sizes unless overridden.

    `cfg` carries the overrides (stage 04's TrainConfig): num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size; None keeps the target's.
    `cfg.drafter_shape` picks the kind (`SHAPES`; None: eagle3).

    MLA targets (DeepSeek-V3, Kimi) have no plain attention shape to copy; unless the
    user sets one, the drafter gets head_dim 128 and 8 kv heads (see MLA_HEAD_DIM).
    """

    t = info.text_config
    H = info.hidden_size
    mla = "kv_lora_rank" in t  # DeepSeek-V3/Kimi: head sizes in the config describe MLA, not a plain layer
    user_shape = cfg.num_attention_heads or cfg.num_key_value_heads or cfg.head_dim
    if mla and not user_shape and H % MLA_HEAD_DIM == 0:
        # No plain attention to copy: pick head_dim 128 (FlashInfer serves head_dim
        # 64/128/256/512 only; 7168 / 64 heads = 112 is refused there) and 8 kv heads,
        # SpecForge's DeepSeek-V3 drafter shape (56 x 128, 8 kv heads at hidden 7168).
        heads = H // MLA_HEAD_DIM
        kv = MLA_KV_HEADS if heads % MLA_KV_HEADS == 0 else heads
        head_dim = MLA_HEAD_DIM
    else:
        heads = cfg.num_attention_heads or int(t["num_attention_heads"])
        kv = cfg.num_key_value_heads or (heads if mla else int(t.get("num_key_value_heads") or heads))
        head_dim = cfg.head_dim or (int(t["head_dim"]) if t.get("head_dim") and not mla else H // heads)
    rope = t.get("rope_scaling") or t.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type"))
    # The target's scaling when this drafter implements it (Kimi-K2.5: yarn, factor 64, original
    # 4096), so the drafter is trained with the positions the engines then compute for it.
    rope_scaling = ({k: v for k, v in rope.items() if k != "rope_theta"}
                    if rope_type in ("linear", "llama3", "yarn") else None)
    return DrafterConfig(
        hidden_size=H, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        intermediate_size=cfg.intermediate_size or int(t.get("intermediate_size") or 4 * H),
        target_hidden_size=H, draft_vocab_size=draft_vocab, target_vocab_size=info.vocab_size,
        max_position_embeddings=max(info.max_position_embeddings, 2048),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(t.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=rope_scaling,
        **shape_switches(cfg.drafter_shape or DEFAULT_SHAPE),
    )
