"""The data-parallel supervisor of stages 00 and 02 (eagle3/engines/parallel.py), with plain workers.

Spawns 6 small processes in all (no model, no vLLM): ~5 s on 2 cores.
"""
from __future__ import annotations

import os

import pytest

from eagle3.engines import parallel


def _square_worker(offset: int, share: list[int], rank: int, report) -> None:
    report.ready()
    for x in share:
        report.progress(rank, x * x + offset)


def _failing_worker(share: list[int], rank: int, report) -> None:
    report.ready()
    if rank == 1:
        raise ValueError(f"bad item {share[0]}")


def _dying_worker(share: list[int], rank: int, report) -> None:
    os._exit(3)  # killed without a word, as the OOM killer would


def test_every_item_is_done_once_by_the_rank_it_was_dealt_to():
    seen, ready = [], []
    parallel.run_data_parallel(_square_worker, (100,), list(range(7)), 2, on_ready=lambda: ready.append(1),
                               on_progress=lambda rank, v: seen.append((rank, v)), what="stage 99")
    assert sorted(seen) == sorted((x % 2, x * x + 100) for x in range(7))  # items[rank::dp]
    assert ready == [1]  # the first engine up starts the clock, once


def test_a_worker_error_is_raised_with_its_rank_and_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)stage 99 failed in a data-parallel worker: data-parallel rank 1:"
                                           r".*ValueError: bad item 1"):
        parallel.run_data_parallel(_failing_worker, (), [0, 1, 2, 3], 2, on_ready=lambda: None,
                                   on_progress=lambda *a: None, what="stage 99")


def test_a_worker_that_dies_silently_ends_the_run(monkeypatch):
    monkeypatch.setattr(parallel, "POLL_S", 0.2)
    with pytest.raises(RuntimeError, match=r"died with exit code \[3"):
        parallel.run_data_parallel(_dying_worker, (), [0, 1], 2, on_ready=lambda: None,
                                   on_progress=lambda *a: None, what="stage 99")


def test_use_gpu_group_gives_each_rank_its_tensor_parallel_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    parallel.use_gpu_group(1, tensor_parallel_size=2, data_parallel_size=2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    parallel.use_gpu_group(2, tensor_parallel_size=1, data_parallel_size=4)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
