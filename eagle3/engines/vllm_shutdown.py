"""Shutting a vLLM engine down: one way, for every stage that starts one.

`LLM` has no public close in vLLM 0.32; dropping the object leaves its engine core
(an in-process core, or a process of its own with VLLM_ENABLE_V1_MULTIPROCESSING=1)
to the garbage collector. Shutting the core down explicitly frees its memory (the CPU
build reserves a share of RAM) and ends its process before the next engine starts.

No vLLM import: the caller hands over the engine it built.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def shutdown_llm(llm) -> None:
    """Shut down the engine core of a `vllm.LLM` (None: nothing to do); best effort, never raises."""
    if llm is None:
        return
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - best effort at exit: a failed shutdown must not hide the result
        log.debug("vLLM engine shutdown failed: %s", e)
