"""The vLLM engine of stage 00: the only module of eagle3/stages/s00_generate/ that imports vllm.

One offline `LLM` serves the target as it will be served: its own weights and
tokenizer, tensor parallel. Prompts go in as token ids (stage 00 renders the chat
template itself, so the context is exactly what stage 01 will tokenize) and the
generated ids come back untouched (no detokenize round trip). Prefix caching stays on:
turn j+1's prompt starts with turn j's, so a multi-turn round reuses the earlier KV.

The engine's settings are the stage's `EngineConfig` (eagle3/engines/config.py), started
by eagle3/engines/vllm_engine.py's `start_llm`: on the CPU build `gpu_memory_utilization`
is the share of RAM, the KV cache gets a fixed size (`kv_cache_gib`, default 1 GiB) and
engine processes are spawned unless `engine_in_process`, so callers need an
`if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from eagle3.engines.config import EngineConfig
from eagle3.engines.vllm_engine import start_llm
from eagle3.engines.vllm_shutdown import shutdown_llm
from eagle3.stages.s00_generate.conversation import Generation, Request

log = logging.getLogger(__name__)


def generation_engine(engine: EngineConfig) -> EngineConfig:
    """`engine` as stage 00 runs it: prefix caching on (a multi-turn round reuses the earlier
    turns' KV), no per-step stats."""
    return dataclasses.replace(engine, enable_prefix_caching=True, disable_log_stats=True)


class VllmEngine:
    """`generate(requests) -> generations`, in request order, with the sampling of `set_sampling`."""

    def __init__(self, engine: EngineConfig):
        self.set_sampling(0.0, 1.0, [])
        log.info("starting vLLM for %s (tp=%d, dtype=%s%s)", engine.model, engine.tensor_parallel_size, engine.dtype,
                 ", engine core in this process" if engine.engine_in_process else "")
        self.llm = start_llm(generation_engine(engine), fix="check the model, --tensor-parallel-size, "
                                                            "--max-model-len and --gpu-memory-utilization")
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)

    def set_sampling(self, temperature: float, top_p: float, stop_ids: Sequence[int]) -> None:
        self.temperature, self.top_p, self.stop_ids = temperature, top_p, sorted(set(stop_ids))

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (a fresh engine's state; tests share one engine across runs)."""
        self.llm.reset_prefix_cache()

    def sampling_params(self, r: Request):
        from vllm import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=r.max_tokens,
                              seed=r.seed, stop_token_ids=self.stop_ids, detokenize=False)

    def generate(self, requests: Sequence[Request]) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outs = self.llm.generate(prompts, [self.sampling_params(r) for r in requests], use_tqdm=False)
        gens = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            # The id the answer stopped on belongs to it (the drafter learns to end turns);
            # keep it even if an engine version leaves a stop_token_ids hit out of token_ids.
            if c.finish_reason == "stop" and isinstance(c.stop_reason, int) and ids[-1:] != [c.stop_reason]:
                ids.append(c.stop_reason)
            gens.append(Generation(ids, c.finish_reason))
        return gens

    def close(self) -> None:
        shutdown_llm(getattr(self, "llm", None))
        self.llm = None
