"""Data parallelism on one box: one spawned process per engine, supervised by the stage.

Stages 00 and 02 can run `data_parallel_size` engines side by side when the target fits
`tensor_parallel_size` GPUs. Each engine lives in its own process, spawned (not forked)
so CUDA and vLLM start clean, and works on its share `items[rank::dp]`. It talks to the
parent over one queue: "ready" when its engine is up (progress rates count from the
first one), "progress" as work completes, then "done" or "error" with its traceback.
The parent also polls for a worker that died without a word (e.g. OOM-killed), so a
lost engine ends the stage instead of hanging it.

    run_data_parallel(_worker, (cfg,), todo, cfg.data_parallel_size,
                      on_ready=bar_start, on_progress=bar_update, what="stage 02")

where `_worker(cfg, share, rank, report)` is a module-level function (it is pickled to
the child) that calls `report.ready()` and `report.progress(...)`.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue as queue_mod
import traceback
from typing import Any, Callable, Sequence

from eagle3.core.errors import PipelineError
from eagle3.core.logs import setup_logging

POLL_S = 5.0  # how often the parent looks for a worker that died silently


class Reporter:
    """A worker's end of the queue."""

    def __init__(self, queue, rank: int):
        self.queue, self.rank = queue, rank

    def ready(self) -> None:
        self.queue.put(("ready", self.rank))

    def progress(self, *value) -> None:
        self.queue.put(("progress", value))


def use_gpu_group(rank: int, tensor_parallel_size: int, data_parallel_size: int) -> None:
    """Let this process see only rank's tensor-parallel group of GPUs (CUDA_VISIBLE_DEVICES).

    Call it first thing in a spawned worker: CUDA reads the variable once, when this process
    first initializes it, and vLLM's workers (spawned or forked after) inherit it. A list
    shorter than dp x tp would leave a rank fewer GPUs than its tensor parallel size (an
    empty list: none), which vLLM reports only once that engine starts.
    """
    tp, need = tensor_parallel_size, data_parallel_size * tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible else [str(i) for i in range(need)]
    if len(gpus) < need:
        raise PipelineError(f"CUDA_VISIBLE_DEVICES={visible} lists {len(gpus)} GPU(s), but --data-parallel-size "
                            f"{data_parallel_size} x --tensor-parallel-size {tp} needs {need}; list more GPUs or "
                            f"lower --data-parallel-size.")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[rank * tp:(rank + 1) * tp])


def _child(worker: Callable, args: tuple, share: list, rank: int, queue) -> None:
    try:

        setup_logging(logging.WARNING if rank else logging.INFO)  # one rank speaks
        worker(*args, share, rank, Reporter(queue, rank))
        queue.put(("done", rank))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        queue.put(("error", f"data-parallel rank {rank}:\n{traceback.format_exc()}"))


def run_data_parallel(worker: Callable, args: tuple, items: Sequence[Any], data_parallel_size: int, *,
                      on_ready: Callable[[], None], on_progress: Callable[..., None], what: str) -> None:
    """Run `worker(*args, items[rank::dp], rank, reporter)` in dp spawned processes until all end.

    `on_ready()` runs once, when the first engine is up; `on_progress(*value)` for each
    `reporter.progress(*value)`. Raises RuntimeError naming `what` if a worker failed or died.
    """
    dp = min(data_parallel_size, len(items))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(worker, args, list(items[r::dp]), r, queue)) for r in range(dp)]
    for pr in procs:
        pr.start()
    running, error, ready = dp, None, False
    try:
        while running:
            try:
                kind, val = queue.get(timeout=POLL_S)
            except queue_mod.Empty:
                dead = [pr.exitcode for pr in procs if pr.exitcode not in (None, 0)]
                if dead:
                    error = error or f"data-parallel worker(s) died with exit code {dead}"
                    break
                continue
            if kind == "ready":
                if not ready:
                    on_ready()
                ready = True
            elif kind == "progress":
                on_progress(*val)
            elif kind == "done":
                running -= 1
            else:
                assert kind == "error", kind
                error, running = val, running - 1
    finally:
        for pr in procs:
            pr.join(timeout=None if error is None else 30)
            if pr.is_alive():
                pr.terminate()
    if error:
        raise RuntimeError(f"{what} failed in a data-parallel worker: {error}")
