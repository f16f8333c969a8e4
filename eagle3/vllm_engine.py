"""Starting a vLLM engine the way every stage that runs one does (stages 00 and 02).

What the stages share: the CPU build's settings (a fixed KV cache size instead of
vLLM's profiling), quiet engine processes unless -v, and one refusal naming the
target and what to check when the engine does not start. Stopping one is
eagle3/vllm_shutdown.py's `shutdown_llm`.

`vllm` is imported only inside `start_llm`: this module is importable without it.
"""
from __future__ import annotations

import logging
import os

from .errors import PipelineError

log = logging.getLogger(__name__)

CPU_KV_CACHE_GIB = 1.0  # a fixed size also skips the CPU build's profiling warm-up


def on_cpu() -> bool:
    """No CUDA device: the vLLM CPU build."""
    import torch

    return not torch.cuda.is_available()


def kv_cache_kwargs(kv_cache_gib: float | None) -> dict:
    """`kv_cache_memory_bytes` for `vllm.LLM` (on CPU, CPU_KV_CACHE_GIB unless given; on GPU, vLLM sizes it)."""
    if kv_cache_gib is None and on_cpu():
        kv_cache_gib = CPU_KV_CACHE_GIB
    return {} if kv_cache_gib is None else {"kv_cache_memory_bytes": int(kv_cache_gib * (1 << 30))}


def quiet_vllm() -> None:
    """vLLM's engine processes log per weight and per step; keep progress bars readable unless -v.
    vLLM reads this when first imported: call it before any `import vllm`."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if log.isEnabledFor(logging.DEBUG) else "ERROR")


def bind_cpu_threads(tensor_parallel_size: int, env=os.environ) -> None:
    """On vLLM's CPU build, give the model's worker every core this process may use.

    vLLM's automatic binding reserves one core per worker for its scheduler process
    (which polls even when idle) and binds the model's OpenMP threads to the rest: on a
    2-core machine the model gets one core. Measured here (stage 00, SmolLM2-135M,
    256 prompts x 128 new tokens, 2 cores): 307 generated tokens/s with the automatic
    binding, 522 with both cores bound to the worker, 251 unbound. Nothing changes
    when the user chose a binding (VLLM_CPU_OMP_THREADS_BIND), under tensor parallel
    (one core list per worker, "0|1": the user's to give), or on a GPU. A data-parallel
    rank has its share of the cores in the variable already (`parallel.use_device_share`).
    `env`: the environment to set (a subprocess's copy, or this process's).
    """
    if "VLLM_CPU_OMP_THREADS_BIND" in env or tensor_parallel_size != 1 or not on_cpu():
        return
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def start_llm(engine_kw: dict, *, fix: str):
    """`vllm.LLM(**engine_kw)`, or a PipelineError naming the model, vLLM's error and `fix`."""
    quiet_vllm()
    # The binding is read while the engine starts its processes: set it for this start
    # only, so that a later engine in this process (another stage, a test) chooses afresh.
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")}
    bind_cpu_threads(engine_kw.get("tensor_parallel_size", 1))
    from vllm import LLM

    try:
        return LLM(**engine_kw)
    except Exception as e:  # noqa: BLE001 - vLLM raises many types; the fix is the same
        raise PipelineError(f"vLLM could not start {engine_kw['model']} ({type(e).__name__}: {e}); "
                            f"{fix}.") from e
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
