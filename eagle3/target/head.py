"""The target's final norm and lm_head, read from its checkpoint without loading the model.

Both backends hand over the last layer's output before the final norm (vLLM id N;
the input of the final norm in transformers). Stage 02 then applies the target's
RMSNorm itself and takes the full-vocab argmax in chunks, so the store holds the
normed final state and the argmax, and stage 04 never needs the whole lm_head
(163840 x 7168 for Kimi-K2.5): it loads only the draft vocabulary's rows with
`load_lm_head(target, rows=draft_ids)`. `load_embedding` reads the input embedding.

Reads `model.safetensors` / `model.safetensors.index.json` of a local folder or a
hub id (hub: downloads only the files holding these two tensors).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

import torch

from eagle3.core.errors import PipelineError
from eagle3.target.info import TargetInfo

log = logging.getLogger(__name__)

# Names under which multimodal checkpoints nest the language model's weights.
PREFIXES = ("", "language_model.", "model.language_model.", "text_model.")
# Model types whose final norm is not `w * x / rms(x)` (Gemma uses 1 + w).
UNSUPPORTED_NORMS = ("gemma", "gemma2", "gemma3", "gemma3_text")
LOGITS_CHUNK_BYTES = 256 << 20  # [rows, V] float32 logits per matmul chunk


def resolve_file(model: str, filename: str) -> Path | None:
    """`filename` of a local model folder or hub repo (downloaded), or None if absent."""
    p = Path(model)
    if p.is_dir():
        return p / filename if (p / filename).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(model, filename))
    except EntryNotFoundError:
        return None


def weight_map(model: str) -> dict[str, str]:
    """tensor name -> safetensors file name."""
    idx = resolve_file(model, "model.safetensors.index.json")
    if idx is not None:
        return json.loads(idx.read_text())["weight_map"]
    single = resolve_file(model, "model.safetensors")
    if single is None:
        raise PipelineError(f"{model} has neither model.safetensors nor model.safetensors.index.json; "
                            f"the pipeline reads the target's final norm, lm_head and embedding from its "
                            f"safetensors weights (stage 02, and stages 04-05 for the embedding).")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {k: "model.safetensors" for k in f.keys()}


def load_tensors(model: str, names: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """For each key, the first of its candidate tensor names found in the checkpoint."""
    from safetensors import safe_open

    wmap = weight_map(model)
    out = {}
    for key, candidates in names.items():
        name = next((n for n in candidates if n in wmap), None)
        if name is None:
            raise PipelineError(
                f"{model}: none of {candidates} is in the checkpoint (is {key} quantized or named "
                f"differently?); the pipeline reads the unquantized {key} from the target's checkpoint.")
        with safe_open(str(resolve_file(model, wmap[name])), "pt") as f:
            out[key] = f.get_tensor(name)
    return out


def _candidates(info: TargetInfo, suffix: str) -> list[str]:
    """Tensor names to try; prefixed (language model) names first for nested targets,
    so a vision tower's own norm is never taken for the text model's."""
    order = PREFIXES[1:] + PREFIXES[:1] if info.text_config_key else PREFIXES
    return [p + suffix for p in order]


def load_lm_head(info: TargetInfo, rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """The target's lm_head [V, H] (or only `rows` of it: [len(rows), H]), checkpoint dtype."""
    names = _candidates(info, "lm_head.weight")
    if info.text_config.get("tie_word_embeddings", False):
        names = _candidates(info, "model.embed_tokens.weight") + names
    w = load_tensors(info.source, {"lm_head": names})["lm_head"]
    return w if rows is None else w[torch.as_tensor(rows, dtype=torch.long)]


def load_layer_tensors(info: TargetInfo, layer: int, suffixes: Sequence[str]) -> dict[str, torch.Tensor]:
    """Tensors of decoder layer `layer` by suffix (e.g. "self_attn.q_proj.weight"), checkpoint dtype."""
    return load_tensors(info.source, {sfx: _candidates(info, f"model.layers.{layer}.{sfx}") for sfx in suffixes})


def load_final_norm(info: TargetInfo) -> torch.Tensor:
    """The target's final RMSNorm weight [H], checkpoint dtype."""
    return load_tensors(info.source, {"final norm": _candidates(info, "model.norm.weight")})["final norm"]


def load_embedding(info: TargetInfo) -> torch.Tensor:
    """The target's input embedding [V, H], checkpoint dtype (stage 04's frozen
    embedding; stage 05's `--include-embed-tokens`)."""
    emb = load_tensors(info.source, {"embed_tokens": _candidates(info, "model.embed_tokens.weight")})["embed_tokens"]
    if tuple(emb.shape) != (info.vocab_size, info.hidden_size):
        raise PipelineError(f"{info.source}: embed_tokens has shape {tuple(emb.shape)}, expected "
                            f"({info.vocab_size}, {info.hidden_size}) from its config.json.")
    return emb


class TargetHead:
    """Final RMSNorm + chunked lm_head argmax of the target."""

    def __init__(self, norm_weight: torch.Tensor, eps: float, lm_head: torch.Tensor, device: str = "cpu"):
        self.device = torch.device(device)
        self.norm_weight = norm_weight.float()  # [H], on the CPU: the norm runs where the store is mapped
        self.eps = float(eps)
        # float32 on CPU (exact reference); bf16 on GPU, where the full lm_head of a
        # large vocab would otherwise double its memory.
        self.head_dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.lm_head = lm_head.to(self.device, self.head_dtype)  # [V, H]
        self.chunk = max(1, LOGITS_CHUNK_BYTES // (4 * self.lm_head.shape[0]))

    @classmethod
    def load(cls, info: TargetInfo, device: str | None = None) -> "TargetHead":
        if info.model_type in UNSUPPORTED_NORMS or info.text_config.get("model_type") in UNSUPPORTED_NORMS:
            raise PipelineError(f"{info.source}: model type {info.model_type!r} uses a final norm this "
                                f"pipeline does not implement (only w * x / rms(x)).")
        eps = info.text_config.get("rms_norm_eps")
        if eps is None:
            raise PipelineError(f"{info.source}/config.json has no rms_norm_eps; stage 02 needs the "
                                f"target's final RMSNorm.")
        norm = load_final_norm(info)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        log.info("target head: final norm [%d], lm_head [%d, %d] on %s", norm.shape[0], info.vocab_size,
                 info.hidden_size, device)
        lm_head = load_lm_head(info)
        want = (info.vocab_size, info.hidden_size)
        if tuple(lm_head.shape) != want or tuple(norm.shape) != want[1:]:
            raise PipelineError(f"{info.source}: lm_head {tuple(lm_head.shape)} / final norm {tuple(norm.shape)} "
                                f"do not match vocab_size x hidden_size {want} of its config (quantized or "
                                f"packed weights?); stage 02 needs them unquantized.")
        return cls(norm, eps, lm_head, device)

    @torch.no_grad()
    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm in float32: [t, H] -> [t, H] float32 (on x's device)."""
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight.to(x.device)

    @torch.no_grad()
    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocab argmax of the logits h @ lm_head.T, in row chunks: [t, H] -> [t] int32 (CPU)."""
        out = torch.empty(h.shape[0], dtype=torch.int32)
        for a in range(0, h.shape[0], self.chunk):
            x = h[a:a + self.chunk].to(self.device, self.head_dtype)  # [c, H]
            out[a:a + self.chunk] = (x @ self.lm_head.T).argmax(-1).to(torch.int32).cpu()  # [c, V] -> [c]
        return out
