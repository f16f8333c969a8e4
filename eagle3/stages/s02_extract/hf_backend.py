"""The transformers backend of stage 02: the CPU reference and the fallback for small targets.

Runs the target with `output_hidden_states=True` (`hidden_states[k]` is the residual
stream after k layers, convention 1) and a hook on the final norm's input (the last
layer's output before the norm, vLLM id N), over right-padded batches of at most
`batch_tokens` tokens formed in file order, so a file redone after a crash gets
the same batches and the same numbers. Writes into the same partial store files as
the vLLM backend.

Multimodal targets that nest the text model (Kimi-K2.5: sizes under `text_config`,
weights under `language_model.`) are loaded as their text model alone.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from eagle3.artifacts.store import FileLayout, write_sample_states
from eagle3.core.batching import group_by_padded_tokens
from eagle3.core.config import torch_dtype
from eagle3.core.errors import PipelineError
from eagle3.drafter.cpu import bf16_fused_attention_ok
from eagle3.target.head import PREFIXES, weight_map
from eagle3.target.info import TargetInfo

log = logging.getLogger(__name__)



def _load_nested_text_model(info: TargetInfo, dtype: torch.dtype, trust_remote_code: bool):
    """The text model of a multimodal checkpoint, from `text_config` and prefixed weights.

    transformers loads it itself, with the prefix mapped away (`key_mapping`), so its own
    conversions apply: a checkpoint keeps one `experts.<e>.down_proj.weight` per routed expert
    (Kimi-K2.5's do), which transformers 5 fuses into `experts.down_proj` in memory."""
    import re

    from transformers import AutoConfig, AutoModelForCausalLM

    text = dict(info.text_config)
    model_type = text.pop("model_type", None)
    if model_type is None:
        raise PipelineError(f"{info.source}/config.json [{info.text_config_key}] has no model_type; cannot "
                            f"build its text model.")
    cfg = AutoConfig.for_model(model_type, **text)
    wmap = weight_map(info.source)
    prefix = next((p for p in PREFIXES if p and any(k.startswith(p) for k in wmap)), None)
    if prefix is None:
        raise PipelineError(f"{info.source}: no weights under any of {PREFIXES[1:]}; cannot find the text model.")
    model, loading = AutoModelForCausalLM.from_pretrained(
        info.source, config=cfg, dtype=dtype, trust_remote_code=trust_remote_code,
        key_mapping={f"^{re.escape(prefix)}": ""}, output_loading_info=True)
    missing = sorted(loading.get("missing_keys") or [])
    if missing:
        raise PipelineError(f"{info.source}: the text model's weights {missing[:5]} are not under "
                            f"{prefix!r} in the checkpoint.")
    return model


def _attention_kernels(device: str | torch.device, dtype: torch.dtype):
    """The math attention kernel where the fused CPU one refuses bf16 (eagle3/drafter/cpu.py)."""
    if torch.device(device).type == "cpu" and dtype == torch.bfloat16 and not bf16_fused_attention_ok():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def load_model(info: TargetInfo, dtype: str, device: str, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    td = torch_dtype(dtype)
    if info.text_config_key is not None:
        model = _load_nested_text_model(info, td, trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(info.source, dtype=td, trust_remote_code=trust_remote_code)
    return model.to(device).eval()


def _final_norm(model) -> torch.nn.Module:
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if norm is None:
        raise PipelineError(f"{type(model).__name__} has no `model.norm`; the hf backend supports Llama- and "
                            f"DeepSeek-style models (final norm at model.norm).")
    return norm


def make_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive sample indices per batch, padded size (B * longest) <= batch_tokens."""
    return group_by_padded_tokens(range(len(lengths)), lengths, batch_tokens)


class HFBackend:
    """Fills partial store files with aux states and the pre-norm final state via transformers."""

    def __init__(self, info: TargetInfo, aux_layers: Sequence[int], *, dtype: str, batch_tokens: int,
                 trust_remote_code: bool, device: str | None = None):
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.aux_layers = list(aux_layers)
        self.batch_tokens = batch_tokens
        log.info("loading %s with transformers (%s, %s)", info.source, dtype, self.device)
        self.model = load_model(info, dtype, self.device, trust_remote_code)
        n = self.model.config.num_hidden_layers
        assert n == info.num_layers, (n, info.num_layers)
        self._prenorm: torch.Tensor | None = None
        _final_norm(self.model).register_forward_hook(self._capture)

    def _capture(self, module, inputs, output) -> None:
        self._prenorm = inputs[0]  # [B, T, H], the residual stream after all N layers

    @torch.no_grad()
    def forward(self, input_ids: Sequence[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample: (aux [T, A, H], final pre-norm [T, H]), on the CPU."""
        lengths = [len(x) for x in input_ids]
        B, T = len(lengths), max(lengths)
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.long)
        for b, x in enumerate(input_ids):
            ids[b, : lengths[b]] = torch.as_tensor(np.asarray(x), dtype=torch.long)
            mask[b, : lengths[b]] = 1
        with _attention_kernels(self.device, self.model.dtype):
            out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                             output_hidden_states=True, use_cache=False, logits_to_keep=1)
        aux = torch.stack([out.hidden_states[k] for k in self.aux_layers], dim=2)  # [B, T, A, H]
        pre = self._prenorm  # [B, T, H]
        assert pre is not None and pre.shape[:2] == (B, T)
        aux, pre = aux.cpu(), pre.cpu()
        return [(aux[b, : lengths[b]], pre[b, : lengths[b]]) for b in range(B)]

    def extract_file(self, partial: Path, input_ids: Sequence[np.ndarray], rows: Sequence[int],
                     on_tokens: Callable[[int], None]) -> Callable[[], None]:
        """Write the file's states; return the (here trivial) wait for them, as the vLLM backend does."""
        layout = FileLayout.read(partial)[0]
        for batch in make_batches([len(x) for x in input_ids], self.batch_tokens):
            states = self.forward([input_ids[i] for i in batch])
            for i, (aux, pre) in zip(batch, states):
                write_sample_states(partial, rows[i], aux, pre, layout)
            on_tokens(sum(len(input_ids[i]) for i in batch))
        return lambda: None

    def close(self) -> None:
        self.model = None
