"""eagle3/stages/s04_train/distributed.py: the process group a GPU run creates and the collectives it
hands tensors to, held on CPU to a real NCCL group's contract (a group refuses tensors
of a device type it holds no backend for), and each rank's own RNG state in checkpoints.

The two-process cases run tests/collectives_worker.py under torchrun with gloo.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from collectives_worker import K, rank_metrics

from eagle3.core.errors import PipelineError
from eagle3.stages.s04_train import checkpoint
from eagle3.stages.s04_train import distributed
from eagle3.stages.s04_train.distributed import all_gather_object, all_reduce_sum, backend_for, ddp_buffer_sync_off
from eagle3.stages.s04_train.metrics import MetricSum

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(scenario: str, out: Path) -> list[dict]:
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), str(ROOT / "tests" / "collectives_worker.py"), scenario, str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, res in enumerate(results):
        assert "crash" not in res, f"rank {rank}:\n{res.get('crash')}"
    return results


def test_backend_for_a_gpu_run_serves_host_and_gpu_tensors():
    # torch's own parse of the string (distributed_c10d.BackendConfig): which backend
    # takes a tensor of each device type
    served = dist.BackendConfig(dist.Backend(backend_for(torch.device("cuda", 0)))).get_device_backend_map()
    assert served == {"cpu": "gloo", "cuda": "nccl"}
    assert dist.BackendConfig(dist.Backend(backend_for(torch.device("cpu")))).get_device_backend_map() == {
        "cpu": "gloo", "cuda": "gloo"}
    with pytest.raises(PipelineError, match="--device cpu or --device cuda"):
        backend_for(torch.device("meta"))


def test_the_gpu_runs_group_reduces_the_held_out_metrics(tmp_path):
    """Stage 04's group setup for a CUDA device, emulated on gloo with the device types
    the requested backend serves; then the metric reduction every evaluation runs.

    Before the fix the stage asked for "nccl" (served: cuda only) and reduced the host
    float64 sums on it: "No backend type associated with device type cpu" on every rank."""
    results = two_ranks("cuda_group", tmp_path / "out")
    want = MetricSum(K)
    for rank in range(2):
        for m in rank_metrics(rank):
            want.add(m)
    want = want.result()
    for rank, seen in enumerate(results):
        assert seen.get("error") is None, f"rank {rank}: {seen['error']} (group {seen['backend']!r})"
        assert (seen["world"], seen["rank"]) == (2, rank)
        # the GPU is this rank's own, for the group (device_id) and for the process
        assert seen["device_id"] == f"cuda:{rank}" and seen["set_device"] == [f"cuda:{rank}"]
        got = seen["result"]
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-12), key
    assert want["num_valid"] == 10 + 11 + 17 + 18


def test_a_group_that_serves_no_host_tensors_is_refused_by_name(tmp_path):
    for seen in two_ranks("foreign", tmp_path / "out"):
        assert seen["error"] and "cuda:gloo" in seen["error"] and "no backend for cpu tensors" in seen["error"]
        assert "cpu:gloo,cuda:nccl" in seen["error"]  # the fix


def test_each_rank_restores_its_own_rng_state(tmp_path):
    for rank, seen in enumerate(two_ranks("rng", tmp_path / "out")):
        assert seen["entries"] == 2 and seen["entries_differ"]
        assert seen["resumed"] == seen["expected"], rank  # the same generator replayed: bitwise


def test_ranks_with_unequal_forward_counts_finish(tmp_path):
    """A forward of the DDP-wrapped drafter is no collective (its d2t/t2d buffers are not
    broadcast): rank 0 runs two, rank 1 none, and both reach the sum. With DDP's default
    the first forward's broadcast meets the other rank's sum: gloo's 60 s timeout."""
    for rank, seen in enumerate(two_ranks("uneven", tmp_path / "out")):
        assert seen["error"] is None, (rank, seen["error"])
        assert seen["total"] == 2.0
        assert not [w for w in seen["warnings"] if "broadcast_buffers" in w], seen["warnings"]


def test_ranks_agree_on_a_round_found_by_one_rank_only(tmp_path):
    """Stage 04 over windows: rank 0 finds round 1 complete, rank 1 not within
    --window-wait-s (a round completed right at the deadline). Both stop; one training on
    alone would wait forever in its first collective. A round one rank finds damaged
    stops both, the other naming that rank's finding."""
    results = two_ranks("rounds", tmp_path / "out")
    for rank, seen in enumerate(results):
        assert seen["goes_on"] is False and seen["current"] is None, (rank, seen)
    first, second = (seen["damaged_error"] or "" for seen in results)
    assert "another rank found round 1 damaged" in first and "round 1 is damaged (a file's checksum" in second


def test_every_rank_lets_go_of_a_round_before_rank_0_deletes_it(tmp_path):
    """Before, rank 1 kept its mappings of a covered round until it opened the next one, and
    rank 0's store and split (which reference each other) kept theirs until a garbage
    collection: on NFS the deletion left .nfs files and the folder's removal failed."""
    results = two_ranks("release", tmp_path / "out")
    for rank, seen in enumerate(results):
        assert all(n > 0 for n in seen["tokens"]) and seen["mapped_before"] == 2, (rank, seen)
    assert results[0]["mapped_at_deletion"] == [], results[0]["mapped_at_deletion"]
    assert results[0]["deleted"] and results[0]["progress"] == 1


def test_the_process_group_gets_the_configured_timeout(monkeypatch):
    """--dist-timeout-s reaches the group: torch's default (30 min gloo, 10 min NCCL) is shorter
    than what a collective may wait for (docs/OPERATIONS.md)."""
    from datetime import timedelta

    from eagle3.stages.s04_train.config import TrainConfig

    made = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: made.update(backend=backend, **kwargs))
    monkeypatch.setattr(dist, "get_backend_config", lambda: "cpu:gloo,cuda:gloo")  # a gloo group's
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    d = distributed.init_distributed(torch.device("cpu"), timeout_s=5400)
    assert made == {"backend": "gloo", "timeout": timedelta(seconds=5400)} and (d.rank, d.world) == (1, 2)
    default = TrainConfig.__dataclass_fields__["dist_timeout_s"].default
    assert default > 1800  # above torch's own defaults


def test_the_ddp_keyword_follows_torchs_signature(monkeypatch):
    """torch 2.13 renamed DDP's switch (broadcast_buffers deprecated, forward_sync_buffers);
    a GPU box's older torch knows only broadcast_buffers."""
    assert ddp_buffer_sync_off() == {"forward_sync_buffers": False}  # the torch installed here

    class TorchBefore213:
        def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                     init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False):
            pass

    monkeypatch.setattr(distributed, "DistributedDataParallel", TorchBefore213)
    assert ddp_buffer_sync_off() == {"broadcast_buffers": False}


def test_one_process_collectives_are_the_identity():
    assert not dist.is_initialized()
    t = torch.arange(4, dtype=torch.float64)
    assert all_reduce_sum(t) is t
    assert all_gather_object({"a": 1}) == [{"a": 1}]


def test_rng_state_reads_and_restores_only_this_ranks_gpu(monkeypatch):
    """On a GPU each rank saves and restores its own device's generator, never every GPU's."""
    calls = []

    def get_rng_state(device="cuda"):
        calls.append(("get", str(device)))
        return torch.tensor([torch.device(device).index], dtype=torch.uint8)  # a state naming its GPU

    def set_rng_state(state, device="cuda"):
        calls.append(("set", str(device), int(state[0])))

    def every_gpu(*args):
        pytest.fail("get/set_rng_state_all touch every GPU from every rank")

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu1 = torch.device("cuda", 1)
    states = [checkpoint.rng_state(torch.device("cuda", 0)), checkpoint.rng_state(gpu1)]
    assert calls == [("get", "cuda:0"), ("get", "cuda:1")]
    calls.clear()
    checkpoint.set_rng_state(states, 1, 2, gpu1)
    assert calls == [("set", "cuda:1", 1)]  # rank 1 takes its own entry, onto its own GPU
    # a CPU run has no GPU entry
    assert checkpoint.rng_state(torch.device("cpu")).keys() == {"torch"}
