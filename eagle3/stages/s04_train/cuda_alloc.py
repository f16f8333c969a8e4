"""Stage 04's setting of PyTorch's CUDA caching allocator: expandable segments, unless the user chose.

Reads and writes this process's environment, nothing else. `train_drafter`
(eagle3/stages/s04_train/run.py) calls `configure_cuda_allocator` once the device is
picked and before `init_distributed`, whose `torch.cuda.set_device` is stage 04's first
CUDA call that initialises CUDA; bench/bench_memory.py --cuda (scripts/gpu_check_train.sh)
calls it before its first allocation, so the GPU check measures what stage 04 runs with.

Why. A training step allocates and frees tensors whose sizes change from step to step
(packed rows hold different samples; the K draft steps keep activations of different
shapes). The default allocator carves fixed segments and can run out of memory with
gigabytes reserved but unused between them; with expandable segments a segment grows
in place instead ("expandable_segments:True", documented by PyTorch for allocation
sizes that change often). Near the top of a GPU, as the reference config runs, that
difference is an out-of-memory error or not, so stage 04 turns it on unless the user
set the allocator's variables.

When torch reads it (torch 2.13): the CUDA settings are parsed once, the first time the
caching allocator asks for one (a function-local static, "construct on first use":
`CUDAAllocatorConfig::instance()` in c10/cuda/CUDAAllocatorConfig.h and
`AcceleratorAllocatorConfig::instance()` in c10/core/AllocatorConfig.h, which
`expandable_segments()` reads), that is when CUDA is initialised (`torch.cuda._lazy_init`,
which every first CUDA use calls: `set_device`, a tensor moved to the GPU) or later;
a change of the environment after that is never seen. `torch.cuda.is_available()`
(pick_device) only counts devices. The names: `PYTORCH_CUDA_ALLOC_CONF`, then
`PYTORCH_HIP_ALLOC_CONF` on ROCm builds, then `PYTORCH_ALLOC_CONF`, the first one set
wins (`CUDAAllocatorConfig::instance()`); AllocatorConfig.h calls `PYTORCH_ALLOC_CONF`
the device-generic name and keeps the CUDA one for backward compatibility. Stage 04
writes `PYTORCH_CUDA_ALLOC_CONF`, the name every torch release reads, and treats any of
the three as the user's choice.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

log = logging.getLogger(__name__)

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def alloc_conf_to_set(device: torch.device, environ: Mapping[str, str]) -> str | None:
    """The value stage 04 gives PYTORCH_CUDA_ALLOC_CONF for a run on `device`, or None to
    leave the environment as it is: not a CUDA run, or the user set one of the allocator's
    variables (even to an empty string: that is a choice of torch's defaults)."""
    if device.type != "cuda":
        return None
    if any(name in environ for name in ALLOC_CONF_VARS):
        return None
    return EXPANDABLE_SEGMENTS


def configure_cuda_allocator(device: torch.device) -> None:
    """Set PYTORCH_CUDA_ALLOC_CONF for a CUDA run before CUDA is initialised (module doc)."""
    value = alloc_conf_to_set(device, os.environ)
    if value is None:
        if device.type == "cuda":
            chosen = {name: os.environ[name] for name in ALLOC_CONF_VARS if name in os.environ}
            log.info("CUDA allocator settings from the environment: %s", chosen)
        return
    if torch.cuda.is_initialized():
        # Whoever called stage 04 used CUDA first: torch has read its settings already.
        log.warning("CUDA was initialised before stage 04, so its allocator runs without expandable segments; "
                    "start the process with PYTORCH_CUDA_ALLOC_CONF=%s for less fragmentation", value)
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = value
    log.info("PYTORCH_CUDA_ALLOC_CONF=%s (stage 04's default; set PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF "
             "yourself to choose otherwise)", value)
