"""One vLLM engine's settings (`EngineConfig`) and the stage settings that fill them (`EngineSettings`).

Stages 00, 02 and 06 each run the target in a vLLM engine. What an engine is given is
one frozen `EngineConfig`; eagle3/engines/vllm_engine.py's `start_llm` is the one place
that turns it into `vllm.LLM(**kwargs)`, filling the settings left to the platform
(None here) from vLLM's answer to "CPU or GPU?". The fields a user sets for any of the
three stages (dtype, tensor parallel size, context length, memory share, KV cache size,
eager mode, in-process engine core) are declared once, on `EngineSettings`, which the
three stage configs inherit; each stage adds its own engine settings (its batch limits,
its seed, stage 02's extraction and stage 06's drafter) when it asks
`cfg.engine_config(...)` for its engine.

No vLLM import: a stage's config, and stage 06's parent process, stay importable without it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from eagle3.core.config import DTYPE_CHOICES, StageConfig, dtype_name, param
from eagle3.core.errors import PipelineError
from eagle3.target.info import text_config_of

# Settings left to the platform (None) become these when the engine starts.
CPU_MEMORY_SHARE = 0.3  # the CPU build reads gpu_memory_utilization as a share of RAM
# The share of the GPU every stage's engine reserves unless told, below vLLM's own 0.9:
# stage 02's process keeps the target head (final norm + lm_head) on GPU 0 outside vLLM's
# budget, and stage 06 (a drafter beside the target in one engine) has been checked on the
# GPU box at this share (scripts/gpu_check.sh). Stage 00 (0.9 before) fits either way; one
# default keeps one number to reason about when a stage runs out of GPU memory.
GPU_MEMORY_SHARE = 0.85
CPU_KV_CACHE_GIB = 1.0  # a fixed size also skips the CPU build's profiling warm-up

# The stages' `engine_in_process` setting. Off by default: an in-process engine pins the
# calling process's threads to its cores (vLLM's CPU worker), which a long-lived caller
# such as a test session must not inherit; a script run is a process of its own.
IN_PROCESS_HELP = ("run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): on CPU the "
                   "engine starts sooner (no engine process to spawn and connect)")


@dataclass(frozen=True)
class EngineConfig:
    """What one `vllm.LLM` is given. None means "the platform's default" (filled by
    `vllm_engine.for_platform`) or, for the optional limits, "vLLM's own default".

    `engine_in_process` is how `start_llm` starts the engine, not an argument of `vllm.LLM`;
    `kv_cache_gib` becomes `kv_cache_memory_bytes`; `extra` holds any other `EngineArgs`
    field a stage needs (e.g. stage 06's per-request spec-decode metrics).
    """

    model: str
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None: the target's
    gpu_memory_utilization: float | None = None  # None: CPU_MEMORY_SHARE on CPU, GPU_MEMORY_SHARE on GPU
    kv_cache_gib: float | None = None  # None: CPU_KV_CACHE_GIB on CPU; vLLM sizes it on GPU
    enforce_eager: bool | None = None  # None: on for CPU, off on GPU (compiled, CUDA graphs)
    engine_in_process: bool = False
    trust_remote_code: bool = False
    # A multimodal target (Kimi-K2.5) served as its text model: vLLM 0.32 then builds no vision
    # tower (`_mark_tower_model` leaves placeholders on the meta device, loads no weights for it)
    # and profiles no image input; set from the target's config.json (`text_only`).
    language_model_only: bool = False
    seed: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    disable_log_stats: bool = True  # stage 06 turns stats on: its spec-decode counters come from them
    speculative_config: Mapping[str, Any] | None = None
    kv_transfer_config: Any = None  # a vllm.config.KVTransferConfig (stage 02's connector)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        named = {f.name for f in dataclasses.fields(self)} | {"kv_cache_memory_bytes"}
        clash = sorted(set(self.extra) & named)
        if clash:
            raise PipelineError(f"EngineConfig.extra sets {clash}, which EngineConfig names itself; set the field "
                                f"instead (kv_cache_gib for kv_cache_memory_bytes).")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise PipelineError(f"gpu_memory_utilization = {self.gpu_memory_utilization} must be in (0, 1] "
                                f"(--gpu-memory-utilization).")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise PipelineError(f"kv_cache_gib = {self.kv_cache_gib} must be > 0 (--kv-cache-gib).")


@dataclass(kw_only=True)
class EngineSettings(StageConfig):
    """The settings of a stage that runs the target in vLLM (stages 00, 02 and 06), declared
    once. A stage may redeclare one to change its default or identity flag, with a comment
    saying why (tests/unit/test_engine_config.py lists the intended ones)."""

    dtype: str = param("bfloat16", choices=DTYPE_CHOICES, help="dtype the target runs in")
    # --- how the engine runs (not part of what a stage writes) ---
    tensor_parallel_size: int = param(1, min=1, identity=False, help="GPUs per engine (8 for Kimi-K2.5)")
    max_model_len: int | None = param(None, min=1, identity=False,
                                      help="engine context length (default: what the stage's longest input needs)")
    gpu_memory_utilization: float | None = param(
        None, gt=0, max=1, identity=False,
        help=f"share of GPU memory (on the CPU build: of RAM) the engine reserves (default: {CPU_MEMORY_SHARE} "
             f"on CPU, {GPU_MEMORY_SHARE} on GPU)")
    kv_cache_gib: float | None = param(None, gt=0, identity=False,
                                       help=f"fixed KV cache size in GiB (default: vLLM sizes it; "
                                            f"{CPU_KV_CACHE_GIB:g} on CPU)")
    # On CPU, vLLM's worker compiles the model at engine start, which costs a long warm-up, and
    # then runs no faster than eager (docs/results.md): eager by default there.
    enforce_eager: bool | None = param(None, identity=False, help="no compilation / CUDA graphs (default: on for "
                                                                  "CPU, off on GPU, as production serves)")
    engine_in_process: bool = param(False, identity=False, help=IN_PROCESS_HELP)

    def __post_init__(self):
        super().__post_init__()  # the choices and ranges declared with the fields
        self.dtype = dtype_name(self.dtype)  # one spelling: `bf16` in a YAML file runs as bfloat16

    def engine_config(self, **stage_specific: Any) -> EngineConfig:
        """This stage's engine: the settings above, then what only the stage sets
        (`max_num_seqs`, `seed`, a `speculative_config`...), which may replace any of them
        (stage 02 serves the resolved target folder and its own context length)."""
        shared = dict(model=self.target_model, dtype=self.dtype, tensor_parallel_size=self.tensor_parallel_size,
                      max_model_len=self.max_model_len, gpu_memory_utilization=self.gpu_memory_utilization,
                      kv_cache_gib=self.kv_cache_gib, enforce_eager=self.enforce_eager,
                      engine_in_process=self.engine_in_process, trust_remote_code=self.trust_remote_code)
        kw = {**shared, **stage_specific}
        kw.setdefault("language_model_only", text_only(kw["model"]))
        return EngineConfig(**kw)


def text_only(model: str) -> bool:
    """Serve `model` as its text model: its config.json nests the text model's config (a
    multimodal target such as Kimi-K2.5, `text_config`; eagle3/target/info.py `text_config_of`).

    Read from a local folder, or from the hub cache for a hub id (the stages read the target's
    config.json before they start an engine, which puts it there); never over the network.
    Every stage trains and serves text: the vision tower is dead weight in the engine, and
    vLLM would profile it with a dummy image at start (docs/KIMI_K25.md, "vLLM's
    KimiK25ForConditionalGeneration")."""
    path = Path(model) / "config.json"
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(str(model), "config.json")
        except Exception:  # noqa: BLE001 - not a hub id either: nothing to read, serve it as it is
            hit = None
        if not isinstance(hit, str):
            return False
        path = Path(hit)
    try:
        return text_config_of(json.loads(path.read_text()))[1] is not None
    except (OSError, ValueError):
        return False
