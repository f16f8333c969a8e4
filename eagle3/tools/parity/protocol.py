"""What the parity check's parent and its engine workers hand each other, and the one layout both follow.

The parent (eagle3/tools/parity/check.py) writes one request per engine, REQUEST.json:

    {"engine": "vllm" | "sglang", "cases": [CASE, ...], "captures": [CAPTURE, ...]}
    CASE     {"name", "folder", "inputs": FILE, "out": FILE, "chains": [[prefix_len, offset], ...],
              "steps": K, "target_layers": N}
    CAPTURE  {"name", "target": DIR, "nested_ids": [...], "samples": FILE, "out": FILE}

and a worker (eagle3/tools/parity/worker.py, one process per engine for the whole request)
writes, per case, OUT.safetensors and OUT.json (`write_result`). The inputs FILE holds

    aux       [T, A*H_t]  the aux hidden states of every prefix token, requests one after another
    embeds.0  [T, H]      the embedding of the token each position reads at step 0
    embeds.k  [R, H]      for k >= 1: the embedding of the token step k reads, one row per request
                          (the target id the reference drafter proposed at step k-1)

A request (a "chain") of prefix length L at position offset o runs as an engine serves it:
step 0 extends its L tokens at positions o .. o+L-1 (every position's logits are kept),
then each further step k decodes one token at position o+L-1+k, reading its own previous
step's output hidden state and the KV cache of the prefix and of its earlier steps
(docs/CONVENTIONS.md §4: the step-k query of position t sits at t + k).

Results per case: logits.k (draft vocabulary, step 0 [T, V_d], steps k >= 1 [R, V_d]), ids.k
(the target ids the engine's own mapping proposes for the same rows), target_ids [V_d] (the
engine's draft -> target map), held.NAME (each weight as the engine holds it after its own
loader, under docs/CONVENTIONS.md §6 names: `held_weights`), rope [P, D] (the engine's cos|sin
rows at `rope_positions`). OUT.json: {"error": null | {"where", "message"}, "rope_scale",
"captured": {rule: [layer ids]}, "built": BUILT, "versions": {...}}, where BUILT is what the
engine's class made of config.json's EAGLE 3.1 keys (`built_shape`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

ENGINES = ("vllm", "sglang")


def chain_positions(chains: list[list[int]]) -> torch.Tensor:
    """Step 0's positions of every prefix token, requests one after another: [T]."""
    return torch.cat([offset + torch.arange(length) for length, offset in chains])


def last_rows(chains: list[list[int]]) -> torch.Tensor:
    """Index of each request's last prefix token among step 0's rows: [R]."""
    ends = torch.tensor([length for length, _ in chains]).cumsum(0)
    return ends - 1


def decode_positions(chains: list[list[int]], step: int) -> torch.Tensor:
    """Step `step`'s (>= 1) position of each request: offset + L - 1 + step -> [R]."""
    return torch.tensor([offset + length - 1 + step for length, offset in chains])


def rope_positions(chains: list[list[int]], steps: int) -> torch.Tensor:
    """The positions whose rope rows a worker reports: each request's first and last step's."""
    rows = [offset for _, offset in chains] + [offset + length - 1 + steps - 1 for length, offset in chains]
    return torch.tensor(sorted(set(rows)))


def split_rows(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, sizes, dim=0))


def held_weights(params: Mapping[str, torch.Tensor], heads: int, kv_heads: int, head_dim: int, draft_vocab: int
                 ) -> dict[str, torch.Tensor]:
    """An engine's drafter parameters under docs/CONVENTIONS.md §6 names.

    Both engines name them alike: `model.` before everything but lm_head, `layers.0.` for
    `midlayer.`, q/k/v stacked as `qkv_proj` (rows q, then k, then v) and gate/up as
    `gate_up_proj` (gate rows first) (vLLM 0.32 models/llama_eagle3.py `hf_to_vllm_mapper`,
    SGLang 0.5.23 models/llama_eagle3.py `stacked_params_mapping`); lm_head's rows past the
    draft vocabulary are the engines' padding to a multiple of 64 (`ParallelLMHead`), dropped
    here. The target's embedding
    the engines would share in is left out: the parity check feeds embeddings itself.
    """
    out: dict[str, torch.Tensor] = {}
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    for name, t in params.items():
        t = t.detach().float().cpu()
        short = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        if "embed_tokens" in short or "draft_id_to_target_id" in short:
            continue
        if short.endswith("qkv_proj.weight"):
            stem = short.removesuffix("qkv_proj.weight")
            q, k, v = torch.split(t, [q_rows, kv_rows, kv_rows], dim=0)
            out.update({stem + "q_proj.weight": q, stem + "k_proj.weight": k, stem + "v_proj.weight": v})
        elif short.endswith("gate_up_proj.weight"):
            stem = short.removesuffix("gate_up_proj.weight")
            gate, up = t.chunk(2, dim=0)
            out.update({stem + "gate_proj.weight": gate, stem + "up_proj.weight": up})
        elif short == "lm_head.weight":
            out[short] = t[:draft_vocab]
        else:
            out[short] = t
    return out


def built_shape(inner_model) -> dict[str, Any]:
    """The EAGLE 3.1 switches of an engine's drafter as built (both engines' inner `LlamaModel`
    holds `fc_norm`, a ModuleList or None, and `norm_output`; releases before EAGLE 3.1 hold
    neither): {"fc_norm": how many per-aux-layer norms, "norm_output": bool}."""
    norms = getattr(inner_model, "fc_norm", None)
    return {"fc_norm": len(norms) if norms is not None else 0,
            "norm_output": bool(getattr(inner_model, "norm_output", False))}


def write_json(path: Path | str, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


def read_json(path: Path | str) -> Any:
    return json.loads(Path(path).read_text())


def write_result(out: Path | str, tensors: Mapping[str, torch.Tensor], facts: Mapping[str, Any]) -> None:
    """A worker's result for one case: OUT.safetensors (tensors) and OUT.json (facts)."""
    from safetensors.torch import save_file

    out = Path(out)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out.with_suffix(".safetensors")))
    write_json(out.with_suffix(".json"), dict(facts))


def read_result(out: Path | str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    out = Path(out)
    facts = read_json(out.with_suffix(".json"))
    tensors = load_file(str(out.with_suffix(".safetensors"))) if out.with_suffix(".safetensors").is_file() else {}
    return tensors, facts
