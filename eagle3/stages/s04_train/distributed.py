"""Stage 04's process group, and the one door every collective outside DDP goes through.

Under `torchrun` (WORLD_SIZE > 1) `init_distributed` creates the default process group;
with one process nothing is created and every collective here is the identity.

Why a seam. A process group reduces a tensor only on a device type it holds a backend
for. torch 2.13 maps the backend string to device types in `BackendConfig`
(torch/distributed/distributed_c10d.py): "nccl" alone gives {cuda: nccl}, "gloo" gives
{cpu: gloo, cuda: gloo}, and a list of "device:backend" pairs such as
"cpu:gloo,cuda:nccl" gives exactly those pairs. A collective on a tensor of any other
device type fails in `ProcessGroup::getBackend` (torch/csrc/distributed/c10d/
ProcessGroup.cpp) with "No backend type associated with device type cpu": the fate of
a host-side metric sum on an NCCL-only group. A CPU run never shows it (its gloo group
serves CPU tensors), so the rules live here, in one place a CPU test can hold them to:

- `init_distributed` creates the group with an explicit timeout (stage 04's
  --dist-timeout-s: how long a rank waits in a collective for the others; torch's own
  defaults are 30 min for gloo and 10 min for NCCL, less than the wait for a rank that
  verifies its share of a large window or writes a large checkpoint) and with a backend
  for every device type stage 04
  hands a collective: "gloo" on CPU; "cpu:gloo,cuda:nccl" on GPUs, NCCL for DDP's
  gradients and gloo for what lives on the host (the metric sums, the pickled RNG
  states of `all_gather_object`). On a GPU it also makes this rank's GPU the current
  device (`torch.cuda.set_device`) and binds the group to it (`device_id=`): torch's
  `barrier` runs on the bound device, NCCL forms its communicator there at once, and
  without either every rank's barrier would run on the current device, GPU 0.
- `wrap_ddp` puts the model under DistributedDataParallel with the forward's buffer
  broadcast off, so DDP's only collectives are the gradient all-reduces of backward
  (and its one-off sync at construction).
- `all_reduce_sum`, `all_gather_object` and `barrier` are the only collectives stage 04
  calls besides DDP's own. `all_reduce_sum` reduces a tensor where it lives when the
  group serves that device type (a host tensor stays on the host, as torch's own object
  collectives prefer: `_get_object_coll_device` picks cpu when the group serves it),
  and otherwise on the training device, the current CUDA device; a group that serves
  neither (one created before stage 04, by other code) is refused with the fix.
"""
from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from eagle3.core.errors import PipelineError

log = logging.getLogger(__name__)


@dataclass
class Dist:
    """This process's place in the run: rank 0 alone writes checkpoints and logs."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    """The backend string of the group for a run on `device` (see the module docstring)."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device.type == "cpu":
        return "gloo"
    raise PipelineError(f"a multi-process stage 04 runs on cpu or cuda devices, not {device}; pass --device cpu "
                        f"or --device cuda.")


def served_device_types() -> set[str]:
    """The device types the default group holds a backend for ("cpu:gloo,cuda:nccl" -> {cpu, cuda})."""
    return {pair.split(":")[0] for pair in dist.get_backend_config().split(",")}


def init_distributed(device: torch.device, timeout_s: float | None = None) -> Dist:
    """Join the run `torchrun` started (WORLD_SIZE, RANK, LOCAL_RANK), training on `device`;
    a rank waits `timeout_s` seconds in a collective (None: torch's default) before failing."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        assert device.index is not None, "pick_device gives every CUDA device an index"
        torch.cuda.set_device(device)  # also for a group created before stage 04: collectives find it here
    if not dist.is_initialized():
        bind = {"device_id": device} if device.type == "cuda" else {}
        if timeout_s is not None:
            bind["timeout"] = timedelta(seconds=timeout_s)
        dist.init_process_group(backend_for(device), **bind)
    served = served_device_types()
    if device.type not in served:
        raise PipelineError(f"the process group created before stage 04 (backend {dist.get_backend_config()}) "
                            f"cannot reduce {device.type} tensors; let stage 04 create it, or create it with "
                            f"backend {backend_for(device)!r}.")
    log.info("process group: rank %d of %d, backend %s, device %s, collective timeout %s", dist.get_rank(),
             dist.get_world_size(), dist.get_backend_config(), device,
             f"{timeout_s:g} s" if timeout_s is not None else "torch's default")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank)


def ddp_buffer_sync_off() -> dict:
    """DistributedDataParallel's keyword that stops the per-forward buffer broadcast.

    torch 2.13 renamed it (torch/nn/parallel/distributed.py: `broadcast_buffers` is
    deprecated with a FutureWarning, `forward_sync_buffers` replaces it and, unlike the
    old flag, still syncs the buffers once at construction); older torch, such as a GPU
    box's 2.11, knows only `broadcast_buffers`, which skips the construction sync too.
    Either is fine here: every rank installs the same mapping from stage 03's files."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def wrap_ddp(module: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """`module` under DistributedDataParallel on this rank's device, without the buffer broadcast.

    DDP's default broadcasts every buffer from rank 0 at the start of each forward
    (`_pre_forward` -> `_sync_buffers` while `will_sync_module_buffers()`), which makes
    every forward a collective. The drafter's only buffers are its vocabulary mapping,
    d2t [V_d] and t2d [V_t] (eagle3/drafter/model.py): installed before this wrap, identical
    on every rank and never changed by training, so the broadcast moves ~0.4 MB per
    forward at K2.5's sizes for nothing, and it would hang a held-out evaluation in which one rank runs
    a forward fewer than another (eagle3/stages/s04_train/evaluation.py). `device_ids`:
    exactly this GPU for a CUDA module, None for a CPU one (`DistributedDataParallel.__init__`).
    """
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=device_ids, **ddp_buffer_sync_off())


def close_distributed(d: Dist) -> None:
    if d.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def collective_device(tensor: torch.Tensor) -> torch.device:
    """Where the default group can reduce `tensor`: its own device if served, else the training GPU."""
    served = served_device_types()
    if tensor.device.type in served:
        return tensor.device
    if "cuda" in served and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # init_distributed made it the training GPU
    raise PipelineError(f"the process group (backend {dist.get_backend_config()}) has no backend for "
                        f"{tensor.device.type} tensors, and this process has no CUDA device to reduce them on; "
                        f"create the group with init_distributed (eagle3/stages/s04_train/distributed.py) or "
                        f"with backend "
                        f"'cpu:gloo,cuda:nccl'.")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of `tensor` over all ranks, on `tensor`'s device (`tensor` itself
    when it was reduced in place, and with one process)."""
    if not _active():
        return tensor
    on = collective_device(tensor)
    t = tensor.to(on)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.to(tensor.device)


def all_gather_object(obj) -> list:
    """Every rank's `obj` (picklable), indexed by rank; `[obj]` with one process.

    torch picks the device itself (`_get_object_coll_device`): cpu when the group serves
    it, else the current device, which init_distributed set to the training GPU."""
    if not _active():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    """Wait for every rank (on a GPU run, on the device the group is bound to)."""
    if _active():
        dist.barrier()
