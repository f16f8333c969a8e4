"""The vLLM backend of stage 02: vLLM's own hidden-state extraction, written into the store.

The only module (with vllm_connector.py, which vLLM loads in its own processes)
that imports vllm. One `LLM` engine runs the target with tensor parallelism and the
`extract_hidden_states` speculative method, asking for the aux layer ids plus id N
(the last layer's output before the final norm, from which stage 02 derives the
normed final state and the argmax). Each request is a prompt-only prefill
(`max_tokens=1`); the project's KV connector writes its states into the partial
store file at the request's token offset.

Settings that keep the stored states exact (`extraction_engine`): prefix caching off (a
cached prefix would skip its forward and its hidden-state rows), and every prompt prefilled
in one forward: chunked prefill off, `max_num_batched_tokens >= max_model_len`. vLLM 0.32
does not require chunked prefill off for extraction: its cache-only layer writes each
scheduled token's states at the token's KV slot, chunk by chunk
(vllm/model_executor/models/extract_hidden_states.py, `basic_cache`), and the connectors read a
request's rows only once it has finished (its `ExampleHiddenStatesConnector.request_finished`;
ours, vllm_connector.py, the same way), so a chunked prompt stores the same rows. It is off
here because the stored states were measured against the hf backend that way (docs/STAGES.md);
turning it on would let `max_num_batched_tokens` drop below the context length (less
activation memory at Kimi-K2.5's 262,144 positions) at the price of re-measuring that.

A multimodal target (Kimi-K2.5's `KimiK25ForConditionalGeneration`) runs as its text model
(`language_model_only`, eagle3/engines/config.py `text_only`): vLLM's class delegates the aux
capture to its `language_model` (a DeepSeek-V2/V3 model), whose layer ids are the text
model's, and the vision tower is neither built nor profiled (docs/KIMI_K25.md).

The rest is the stage's `EngineConfig` (eagle3/engines/config.py), started by
eagle3/engines/vllm_engine.py's `start_llm`: on the CPU build (no CUDA)
`gpu_memory_utilization` is the share of RAM, the KV cache gets a fixed size
(`kv_cache_gib`, default 1 GiB) and the engine process is spawned unless
`engine_in_process`, so callers need an `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from eagle3.engines.config import EngineConfig
from eagle3.engines.vllm_engine import on_cpu, quiet_vllm, start_llm
from eagle3.engines.vllm_shutdown import shutdown_llm
from eagle3.target.info import TargetInfo

log = logging.getLogger(__name__)

CONNECTOR = "Eagle3StoreConnector"
CONNECTOR_MODULE = "eagle3.stages.s02_extract.vllm_connector"  # imports vLLM; loaded by vLLM's workers only
PARAMS_KEY = "eagle3_store"  # where a request's kv_transfer_params tell the connector its store file
DONE_TIMEOUT_S = 600.0  # how long to wait for the worker to write a file's last rows


def extraction_engine(engine: EngineConfig, batch_tokens: int) -> EngineConfig:
    """`engine` with the settings that keep stored states exact (module doc), shared by the
    extraction engine and the benchmark's plain one. `engine.max_model_len` must be set."""
    assert engine.max_model_len is not None, "stage 02 sizes its context from its longest sample"
    return dataclasses.replace(engine, max_num_batched_tokens=max(batch_tokens, engine.max_model_len),
                               enable_prefix_caching=False, enable_chunked_prefill=False, seed=0,
                               disable_log_stats=True)


def extracting(engine: EngineConfig, layer_ids: Sequence[int]) -> EngineConfig:
    """What turns a plain engine into an extracting one: the spec method + our connector."""
    from vllm.config import KVTransferConfig

    return dataclasses.replace(
        engine,
        speculative_config={
            "method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        kv_transfer_config=KVTransferConfig(
            kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_producer"),
    )


def _done_lines(done_log: Path) -> list[str]:
    return done_log.read_text().splitlines() if done_log.exists() else []


class VllmBackend:
    """Fills partial store files with aux states and the pre-norm final state via vLLM."""

    def __init__(self, info: TargetInfo, aux_layers: Sequence[int], engine: EngineConfig, batch_tokens: int):
        """`engine`: the stage's engine settings for `info`'s target, its context length set."""
        quiet_vllm()  # before `extracting` imports vllm
        self.info = info
        self._threads = None
        # Ascending ids; vLLM returns them in layer order, id N last.
        self.layer_ids = list(aux_layers) + [info.num_layers]
        log.info("starting vLLM (tp=%d, dtype=%s, max_model_len=%d) extracting layer ids %s",
                 engine.tensor_parallel_size, engine.dtype, engine.max_model_len, self.layer_ids)
        self.in_process = in_process = engine.engine_in_process
        self.llm = start_llm(extracting(extraction_engine(engine, batch_tokens), self.layer_ids),
                             fix="check the model, --tensor-parallel-size and --gpu-memory-utilization, or use "
                                 "--backend hf for a small target")
        if on_cpu() and not in_process:
            import torch

            # The engine's processes own the cores; this process only finalizes files
            # (norm, argmax, checksum). One torch thread here avoids oversubscribing
            # them (restored by close()).
            self._threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def extract_file(self, partial: Path, input_ids: Sequence[np.ndarray], rows: Sequence[int],
                     on_tokens: Callable[[int], None]) -> Callable[[], None]:
        """Run the file's prompts; return a function that waits until all their states are written.

        The engine's writer thread may still be writing the last requests when this
        returns: the caller waits (in its finalize thread) while the next file runs.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt


        done_log = partial.with_name(partial.name + ".done")
        done_log.unlink(missing_ok=True)
        prompts = [TokensPrompt(prompt_token_ids=np.asarray(ids).tolist()) for ids in input_ids]
        params = [SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args={
            "kv_transfer_params": {PARAMS_KEY: {"path": str(partial), "row": int(r), "done_log": str(done_log)}}})
            for r in rows]
        self.llm.generate(prompts, params, use_tqdm=False)
        on_tokens(sum(len(x) for x in input_ids))
        want = {int(r) for r in rows}
        if self.in_process:
            self._flush_in_process(done_log, want)
        return lambda: self._wait_done(done_log, want)

    def _flush_in_process(self, done_log: Path, rows: set[int]) -> None:
        """Step an in-process engine until the file's last requests reach the writer.

        The connector learns that a request finished one engine step after it did. A
        spawned engine core keeps stepping on its own; an in-process one steps only when
        asked, and `generate` returns as soon as the outputs are done.
        """
        t0 = time.monotonic()
        while True:
            lines = _done_lines(done_log)
            if any(ln.startswith("E ") for ln in lines) or rows <= {int(x) for x in lines if x[:2] != "E "}:
                return  # all written, or an error that _wait_done reports
            if time.monotonic() - t0 > DONE_TIMEOUT_S:
                return  # _wait_done reports what is missing
            self.llm.llm_engine.step()
            time.sleep(0.001)

    @staticmethod
    def _wait_done(done_log: Path, rows: set[int]) -> None:
        """Poll the done log until every row is written; raise on a reported write error."""
        t0, delay = time.monotonic(), 0.0005
        while True:
            lines = _done_lines(done_log)
            errors = [ln[2:] for ln in lines if ln.startswith("E ")]
            if errors:
                raise RuntimeError(f"vLLM's worker failed to write hidden states into {done_log.parent}: "
                                   f"{errors[0]}")
            if rows <= {int(x) for x in lines}:
                done_log.unlink()
                return
            if time.monotonic() - t0 > DONE_TIMEOUT_S:
                raise RuntimeError(f"vLLM's worker wrote {len(rows & {int(x) for x in lines})}/{len(rows)} samples "
                                   f"of {done_log} within {DONE_TIMEOUT_S}s; is the KV connector loaded?")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def close(self) -> None:
        shutdown_llm(getattr(self, "llm", None))
        self.llm = None
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)
            self._threads = None
