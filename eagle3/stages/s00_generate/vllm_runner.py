"""The vLLM engine of stage 00: the only module of eagle3/stages/s00_generate/ that imports vllm.

One offline `LLM` serves the target as it will be served: its own weights and
tokenizer, tensor parallel. Prompts go in as token ids (stage 00 renders the chat
template itself, so the context is exactly what stage 01 will tokenize) and the
generated ids come back untouched (no detokenize round trip). Prefix caching stays on:
turn j+1's prompt starts with turn j's, so a multi-turn round reuses the earlier KV.

On the CPU build, `gpu_memory_utilization` is the share of RAM, the KV cache gets a
fixed size (`kv_cache_gib`, default 1 GiB) and engine processes are spawned, so
callers need an `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import logging
from typing import Sequence

from eagle3.engines.vllm_engine import kv_cache_kwargs, on_cpu, start_llm
from eagle3.engines.vllm_shutdown import shutdown_llm
from eagle3.stages.s00_generate.conversation import Generation, Request

log = logging.getLogger(__name__)


def engine_kwargs(target_model: str, *, tensor_parallel_size: int = 1, dtype: str = "bfloat16",
                  max_model_len: int | None = None, max_num_seqs: int = 256,
                  gpu_memory_utilization: float | None = None, kv_cache_gib: float | None = None,
                  enforce_eager: bool | None = None, trust_remote_code: bool = False, seed: int = 0) -> dict:
    """Arguments of `vllm.LLM`, shared by the stage and its benchmark's bare engine."""
    cpu = on_cpu()
    kw = dict(model=target_model, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
              max_num_seqs=max_num_seqs, trust_remote_code=trust_remote_code, seed=seed,
              gpu_memory_utilization=gpu_memory_utilization or (0.3 if cpu else 0.9),
              enforce_eager=cpu if enforce_eager is None else enforce_eager,
              enable_prefix_caching=True, disable_log_stats=True)
    if max_model_len is not None:
        kw["max_model_len"] = max_model_len
    return {**kw, **kv_cache_kwargs(kv_cache_gib)}


class VllmEngine:
    """`generate(requests) -> generations`, in request order, with the sampling of `set_sampling`."""

    def __init__(self, target_model: str, in_process: bool = False, **engine_kw):
        self.set_sampling(0.0, 1.0, [])
        kw = engine_kwargs(target_model, **engine_kw)
        log.info("starting vLLM for %s (tp=%d, dtype=%s%s)", target_model, kw["tensor_parallel_size"], kw["dtype"],
                 ", engine core in this process" if in_process else "")
        self.llm = start_llm(kw, fix="check the model, --tensor-parallel-size, --max-model-len and "
                                     "--gpu-memory-utilization", in_process=in_process)
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
