"""Start a fresh drafter from the target's own weights (--init-layer, --init-head).

A fresh drafter starts from random weights and learns language from the store alone.
Copying a trained target layer gives it the target's attention and MLP to start from:

    hidden half of q/k/v_proj   <- the target layer's q/k/v_proj   [out, H]
    embedding half of q/k/v     <- 0 (the layer starts as the target layer applied to
                                   the projected aux state; training learns the rest)
    o_proj, gate/up/down_proj   <- the target layer's
    hidden_norm, input_layernorm <- the target layer's input norm
    post_attention_layernorm    <- the target layer's

--init-head starts the rest of the drafter as the target's tail:

    fc       passes the deepest aux layer through (identity on its block, 0 elsewhere)
    norm     <- the target's final norm
    lm_head  <- the target's lm_head rows of the draft vocabulary

so with both, the drafter's first prediction is the target's last layer and head
applied to its residual stream a few layers early (id N-3 by default), instead of
noise.

--init-layer is only for targets whose layer has the drafter's shapes (Llama-style attention with the
same heads and MLP width; not DeepSeek's MLA and MoE layers): anything else is refused
with the shapes that differ.
"""
from __future__ import annotations

import torch

from eagle3.core.errors import PipelineError
from eagle3.drafter.model import Eagle3Drafter
from eagle3.target.head import load_final_norm, load_layer_tensors, load_lm_head
from eagle3.target.info import TargetInfo

# drafter parameter (under midlayer.) -> target layer tensor suffix
COPIED = {
    "self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "input_layernorm.weight",
}
HALVED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def resolve_layer(layer: int, num_layers: int) -> int:
    resolved = layer + num_layers if layer < 0 else layer
    if not 0 <= resolved < num_layers:
        raise PipelineError(f"--init-layer {layer} is not a layer of the target (it has {num_layers}: 0 .. "
                            f"{num_layers - 1}, or -1 for the last).")
    return resolved


@torch.no_grad()
def init_from_target_layer(drafter: Eagle3Drafter, info: TargetInfo, layer: int) -> int:
    """Overwrite `drafter.midlayer` from target layer `layer`; returns the layer's index."""
    L = resolve_layer(layer, info.num_layers)
    tensors = load_layer_tensors(info, L, sorted(set(COPIED.values()) | set(HALVED)))
    own = dict(drafter.midlayer.named_parameters())
    H = drafter.config.hidden_size
    wrong = []
    for name in HALVED:
        want = (own[name].shape[0], H)
        if tuple(tensors[name].shape) != want:
            wrong.append(f"{name} {tuple(tensors[name].shape)} vs {want}")
    for name, sfx in COPIED.items():
        if tensors[sfx].shape != own[name].shape:
            wrong.append(f"{sfx} {tuple(tensors[sfx].shape)} vs {tuple(own[name].shape)}")
    if wrong:
        raise PipelineError(f"--init-layer {layer}: target layer {L} of {info.source} does not have the drafter's "
                            f"shapes ({'; '.join(wrong)}); leave --init-layer unset, or give the drafter the "
                            f"target's heads, head dim and MLP width.")
    for name in HALVED:
        w = own[name]  # [out, 2H]: columns [:H] read the embedding, [H:] the hidden state
        w.zero_()
        w[:, H:] = tensors[name].float()
    for name, sfx in COPIED.items():
        own[name].copy_(tensors[sfx].float())
    return L


@torch.no_grad()
def init_head_from_target(drafter: Eagle3Drafter, info: TargetInfo, aux_layers: list[int]) -> None:
    """fc passes the deepest of `aux_layers` (the store's order, which fc's input
    blocks follow), norm and lm_head are the target's (module doc)."""
    c = drafter.config
    if c.hidden_size != c.target_hidden_size:
        raise PipelineError(f"--init-head needs the drafter's hidden size to be the target's ({c.hidden_size} vs "
                            f"{c.target_hidden_size}): fc cannot pass a target state through otherwise.")
    H = c.hidden_size
    deepest = aux_layers.index(max(aux_layers))
    drafter.fc.weight.zero_()  # [H, A*H]: one [H, H] block per aux layer
    drafter.fc.weight[:, deepest * H:(deepest + 1) * H] = torch.eye(H)
    drafter.norm.weight.copy_(load_final_norm(info).float())
    drafter.lm_head.weight.copy_(load_lm_head(info, rows=drafter.draft_ids().cpu()).float())
