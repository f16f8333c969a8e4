"""vLLM KV connector that writes extracted hidden states straight into the project's store.

Loaded by vLLM through `kv_connector_module_path="eagle3.stages.s02_extract.vllm_connector"`
(see vllm_backend.py), in the scheduler process and in every worker process.
vLLM's `extract_hidden_states` speculative method stores, per token, the residual
streams of the requested layer ids in a cache-only attention layer's KV cache
(blocks of `[num_layers_requested, H]` rows). When a request finishes, this
connector keeps its blocks alive, gathers its rows, and writes them at the
request's token offset of a partial store file (`eagle3.artifacts.store.write_sample_states`):
no file per request, no CUDA streams or pinned memory (vLLM's stock
`ExampleHiddenStatesConnector` needs both and fails on the CPU build).

Each request names its destination in `SamplingParams.extra_args["kv_transfer_params"]`:
`{"eagle3_store": {"path": partial file, "row": token offset, "done_log": path}}`.
The worker copies a finished request's rows out of the cache (then vLLM may free
the blocks), a writer thread writes them and appends the row to `done_log` (or an
`E ...` line on failure), which the driver waits on: vLLM returns a finished
request before its blocks are read.

Only tensor-parallel rank 0 writes (every rank holds the full hidden states).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
                                                               SupportsHMA)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from eagle3.artifacts.store import FileLayout, write_sample_states
from eagle3.stages.s02_extract.vllm_backend import PARAMS_KEY

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

MAX_PENDING_STEPS = 8  # engine steps whose states may wait in memory for the writer thread


@dataclass
class PendingWrite:
    req_id: str
    path: str
    row: int
    done_log: str
    num_tokens: int
    block_ids: list[int]


@dataclass
class Eagle3StoreMetadata(KVConnectorMetadata):
    writes: list[PendingWrite] = field(default_factory=list)


def _hidden_state_group(kv_cache_config: "KVCacheConfig | None") -> int:
    """Index of the KV cache group of the cache-only (hidden-states) layer."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [g for g, grp in enumerate(groups) if isinstance(grp.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise ValueError(f"cannot find the one hidden-states KV cache group among {len(groups)} groups")


class Eagle3StoreConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        assert vllm_config.speculative_config is not None, "needs the extract_hidden_states speculative method"
        self._group = _hidden_state_group(kv_cache_config)
        if kv_cache_config is not None:
            self._block_size = kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
        else:
            self._block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._pending: dict[str, PendingWrite] = {}
        # worker side
        self._kv_cache: torch.Tensor | None = None  # [num_blocks, L, block_size, H]
        self._rank0 = True
        self._written: set[str] = set()
        self._finished: set[str] = set()
        self._layouts: dict[str, FileLayout] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="eagle3-store-write")
        self._futures: list[Future] = []

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # store-only: nothing is ever loaded

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        assert num_external_tokens == 0

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = Eagle3StoreMetadata(writes=list(self._pending.values()))
        self._pending.clear()
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        dest = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if dest is None or request.prompt_token_ids is None:
            return False, None  # not one of ours (e.g. a warm-up request)
        self._pending[request.request_id] = PendingWrite(
            req_id=request.request_id, path=dest["path"], row=int(dest["row"]), done_log=dest["done_log"],
            num_tokens=len(request.prompt_token_ids), block_ids=list(block_ids))
        return True, None  # keep the blocks until the worker has read them

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 reports (it alone writes)

    # ---------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._rank0 = get_tensor_model_parallel_rank() == 0
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"expected one CacheOnlyAttentionLayer, found {layers}")
        self._kv_cache = kv_caches[layers[0]]
        if self._kv_cache.shape[2] != self._block_size:
            raise ValueError(f"hidden-states block size {self._kv_cache.shape[2]} != {self._block_size}")

    def start_load_kv(self, *args, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        pass  # the cache-only layer already holds the states; read when the request finishes

    def wait_for_save(self) -> None:
        pass

    def _gather(self, writes: list[PendingWrite]) -> None:
        """Copy out the rows of all requests finished last step (one gather), queue the disk writes.

        After the copy the blocks may be freed; the disk writes run in a thread so the
        next forward does not wait for them.
        """
        assert self._kv_cache is not None
        bs = self._block_size
        # Slot ids in numpy and one gather for the whole step: a few torch ops per step,
        # not per request (each small op costs milliseconds on a busy CPU).
        slots = np.concatenate([
            (np.asarray(w.block_ids, dtype=np.int64)[:, None] * bs + np.arange(bs)).ravel()[: w.num_tokens]
            for w in writes])  # [sum T]
        idx = torch.from_numpy(slots).to(self._kv_cache.device)
        states = self._kv_cache[idx // bs, :, idx % bs]  # [sum T, L, H]; L = aux ids + id N
        aux = states[:, :-1].reshape(len(slots), -1).cpu()  # [sum T, A*H]
        final = states[:, -1].contiguous().cpu()  # [sum T, H], pre-norm (id N)
        while len(self._futures) >= MAX_PENDING_STEPS:  # disk slower than the engine: wait for it
            self._futures.pop(0).result()
        self._futures.append(self._pool.submit(self._write, writes, aux, final))
        self._written |= {w.req_id for w in writes}

    def _write(self, writes: list[PendingWrite], aux: torch.Tensor, final: torch.Tensor) -> None:
        """Writer thread: each request's rows at its offset, then its row in the done log."""
        row = 0
        for w in writes:
            try:
                if w.path not in self._layouts:
                    self._layouts = {w.path: FileLayout.read(w.path)[0]}  # one file is filled at a time
                write_sample_states(w.path, w.row, aux[row: row + w.num_tokens], final[row: row + w.num_tokens],
                                    self._layouts[w.path])
                line = f"{w.row}\n"
            except Exception as e:  # noqa: BLE001 - reported to the driver through the done log
                log.exception("writing hidden states of request %s to %s failed", w.req_id, w.path)
                line = f"E {type(e).__name__}: {e}".replace("\n", " ") + "\n"
            row += w.num_tokens
            fd = os.open(w.done_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())  # one small O_APPEND write: atomic
            finally:
                os.close(fd)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self._rank0:
            return None, None
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, Eagle3StoreMetadata) and meta.writes:
                self._gather(meta.writes)
        # vLLM wants finished-sending ids it has announced as finished (now or before).
        self._finished |= finished_req_ids
        done = self._written & self._finished
        self._written -= done
        self._finished -= done
        self._futures = [f for f in self._futures if not f.done()]
        return done or None, None

    def shutdown(self):
        self._pool.shutdown(wait=True)
