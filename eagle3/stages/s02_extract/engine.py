"""Stage 02's engine: the backend (transformers or vLLM) and the target head, loaded once per process.

Reads the target's weights; writes nothing. The backends' own modules (`hf_backend`,
`vllm_backend`) say how each runs the target.
"""
from __future__ import annotations

from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.hf_backend import HFBackend
from eagle3.stages.s02_extract.inputs import Prepared
from eagle3.stages.s02_extract.vllm_backend import VllmBackend
from eagle3.target.head import TargetHead


def make_backend(cfg: ExtractConfig, prepared: Prepared, device: str | None = None):
    if cfg.backend == "hf":

        return HFBackend(prepared.info, prepared.aux_layers, dtype=cfg.dtype, batch_tokens=cfg.batch_tokens,
                         trust_remote_code=cfg.trust_remote_code, device=device)

    engine = cfg.engine_config(model=prepared.info.source, max_model_len=cfg.max_model_len or prepared.max_tokens + 1)
    return VllmBackend(prepared.info, prepared.aux_layers, engine, cfg.batch_tokens)


def load_engine(cfg: ExtractConfig, prepared: Prepared, device: str | None = None):
    """(backend, target head): everything loaded once per process."""

    head = TargetHead.load(prepared.info, device)
    return make_backend(cfg, prepared, device), head
