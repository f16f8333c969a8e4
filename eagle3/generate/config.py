"""Stage 00's config: which target, how to sample, how to split the work.

Filled from the shared YAML keys, the `generate:` section and flags (eagle3/config.py).
Fields with `identity=False` change how the work is done, not what is generated, so
finished chunks are not redone when only they change.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import param
from ..errors import PipelineError

DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class GenerateConfig:
    work_dir: Path = param(help="work directory; the regenerated chats go to 00_generate/")
    target_model: str = param(help="target model folder or hub id: the model the drafter will serve with")
    data: list[str] = param(help="chat files (.json/.jsonl, ShareGPT or OpenAI messages) or datasets ids: "
                                 "the same inputs as stage 01")
    data_split: str = param("train", help="split to read from datasets ids")
    trust_remote_code: bool = param(False, help="allow the target's custom code (Kimi needs it)")
    chat_template_kwargs: dict | None = param(None, help="JSON object passed to the chat template, e.g. "
                                                         "'{\"thinking\": false}' (stage 01 uses the same)")
    temperature: float = param(0.0, help="sampling temperature; 0 = greedy, which matches greedy serving")
    top_p: float = param(1.0, help="nucleus sampling threshold (1 = off)")
    max_new_tokens: int = param(2048, help="cap on generated tokens per assistant turn; cut answers are "
                                           "counted and kept")
    seed: int = param(0, help="sampling seed; each request's seed derives from (seed, sample id, turn)")
    max_model_len: int | None = param(None, help="context length; longer prompts are counted and their "
                                                 "conversation ends before that turn (default: the target's)")
    dtype: str = param("bfloat16", help="dtype the target runs in")
    chunk_size: int = param(256, help="conversations per output chunk: the unit of resume, of multi-box "
                                      "splitting, and of batching (all turn-k prompts of a chunk go together)")
    # --- how the work is done (not part of what is generated) ---
    num_shards: int = param(1, identity=False, help="number of boxes splitting the work")
    shard_index: int = param(0, identity=False, help="this box's index in [0, num_shards)")
    tensor_parallel_size: int = param(1, identity=False, help="GPUs per engine (8 for Kimi-K2.5)")
    data_parallel_size: int = param(1, identity=False, help="engines on this box, one process each")
    max_num_seqs: int = param(256, identity=False, help="vLLM: concurrent sequences per engine")
    gpu_memory_utilization: float | None = param(None, identity=False, help="share of GPU memory (on the CPU "
                                                                            "build: of RAM) the engine "
                                                                            "reserves (default 0.3 CPU, "
                                                                            "0.9 GPU)")
    kv_cache_gib: float | None = param(None, identity=False, help="fixed KV cache size in GiB (default: "
                                                                  "vLLM sizes it; 1 on CPU)")
    enforce_eager: bool | None = param(None, identity=False, help="no compilation / CUDA graphs (default: "
                                                                  "on for CPU, off on GPU)")
    force: bool = param(False, identity=False, help="delete what this stage wrote and start over")

    def __post_init__(self):
        if isinstance(self.data, str):
            self.data = [self.data]
        if not self.data:
            raise PipelineError("generate.data is empty; pass --data FILE.jsonl (or a datasets id).")
        if isinstance(self.chat_template_kwargs, str):
            try:
                self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
            except json.JSONDecodeError as e:
                raise PipelineError(f"--chat-template-kwargs {self.chat_template_kwargs!r} is not JSON ({e}); "
                                    f"e.g. --chat-template-kwargs '{{\"thinking\": false}}'.") from e
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise PipelineError(f"generate.chat_template_kwargs = {self.chat_template_kwargs!r} must be a JSON "
                                f"object, e.g. '{{\"thinking\": false}}'.")
        if self.temperature < 0:
            raise PipelineError(f"generate.temperature = {self.temperature} must be >= 0 (0 = greedy).")
        if not 0 < self.top_p <= 1:
            raise PipelineError(f"generate.top_p = {self.top_p} must be in (0, 1].")
        for name in ("max_new_tokens", "chunk_size", "tensor_parallel_size", "data_parallel_size",
                     "max_num_seqs"):
            if getattr(self, name) < 1:
                raise PipelineError(f"generate.{name} = {getattr(self, name)} must be >= 1 "
                                    f"(--{name.replace('_', '-')}).")
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise PipelineError(f"--shard-index {self.shard_index} with --num-shards {self.num_shards}: "
                                f"need 0 <= shard_index < num_shards.")
        if self.dtype not in DTYPES:
            raise PipelineError(f"generate.dtype = {self.dtype!r}; choose one of {list(DTYPES)} (--dtype).")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise PipelineError(f"generate.gpu_memory_utilization = {self.gpu_memory_utilization} must be in "
                                f"(0, 1].")

    @property
    def template_kwargs(self) -> dict:
        return dict(self.chat_template_kwargs or {})
