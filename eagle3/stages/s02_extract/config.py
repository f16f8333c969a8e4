"""Stage 02's config: which target, which layers, which backend, how to split the work.

Filled from the shared YAML keys, the `extract:` section and flags (eagle3/core/config.py).
The vllm backend's engine settings (memory, eager, ...) are eagle3/engines/config.py's
`EngineSettings`, shared with stages 00 and 06.
Fields with `identity=False` change how the work is done, not what is stored, so a
finished store is not redone when only they change.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.core.config import ShardedStageConfig, param
from eagle3.engines.config import EngineSettings

BACKENDS = ("vllm", "hf")
STORE_DTYPES = ("bf16", "fp8")  # the encodings of eagle3/artifacts/store/format.py (`store.ENCODINGS`)


@dataclass(kw_only=True)
class ExtractConfig(EngineSettings, ShardedStageConfig):
    work_dir: Path = param(help="work directory (stage 01 output in it; the store goes to 02_hidden_states/)")
    target_model: str = param(help="target model folder or hub id (the one served, same tokenizer as stage 01)")
    backend: str = param("vllm", choices=BACKENDS, help="vllm (GPU box, tensor/data parallel) or hf (transformers; CPU "
                                      "reference and small targets)")
    aux_layers: list[int] | None = param(None, help="aux layer ids, convention 1 (default [2, N//2, N-3])")
    store_dtype: str = param("bf16", choices=STORE_DTYPES, help="how the store holds the aux and final states: bf16 "
                             "(the reference) or fp8 (e4m3 with a power-of-two scale per token and tensor, "
                             "dequantised to bf16 when read; 4H + 13 bytes per token for 3 aux layers instead of "
                             "8H + 9)")
    samples_per_file: int = param(256, min=1, help="samples per store file: the unit of resume and of multi-box "
                                            "splitting")
    # --- windows: more data than the disk holds (eagle3/artifacts/windows.py; recorded in windows.json) ---
    disk_budget: str | None = param(None, identity=False, help="bytes the store may take on disk (e.g. 2TB, 500GB): "
                                    "the train split is cut into windows that fit, extracted one at a time "
                                    "(default: none, the whole store at once)")
    window: int | None = param(None, min=0, identity=False, help="with --disk-budget: extract this round (window "
                               "i %% W of extraction pass i // W); default: the next one not yet trained")
    windows_dir: str | None = param(None, identity=False, help="with --disk-budget: where the window folders go "
                                    "(default 02_hidden_states/windows; a shared mount for several boxes)")
    window_seed: int = param(0, identity=False, help="with --disk-budget: seed of the one shuffle of the train split")
    extraction_passes: int = param(1, min=1, identity=False, help="with --disk-budget: passes over the data, each "
                                   "a new extraction of every window (stage 04's --epochs are passes within a window)")
    windows_in_budget: int = param(1, min=1, identity=False, help="with --disk-budget: windows the budget holds at "
                                   "once (1 on one box; more to let producers run ahead of the trainer)")
    produce: bool = param(False, identity=False, help="with --disk-budget: extract every round of this shard in "
                          "order (a producer of a several-box run), waiting while the budget is full")
    wait_s: float = param(0.0, min=0.0, identity=False, help="with --produce: seconds to wait for budget room "
                          "before giving up (0: give up at once)")
    take_over_stale_s: float | None = param(None, min=0.0, identity=False, help="take over a folder (the store's "
                                            "or a round's) claimed by a writer whose heartbeat has not changed for "
                                            "this many seconds, watched from here (a dead box's shard; at least 90). "
                                            "Default: never; a writer whose process is gone on this machine is "
                                            "replaced without it")
    # --- how the work is done (not part of the store's identity) ---
    batch_tokens: int = param(16384, min=1, identity=False, help="tokens per forward batch (vllm: "
                                                          "max_num_batched_tokens, at least max_model_len)")
    verify_checksums: bool = param(True, identity=False, help="on resume, re-read finished files and "
                                                              "redo any whose checksum differs")
    force: bool = param(False, identity=False, help="delete the existing store's files (every box's files in this "
                                                    "work dir's store folder; with --windows-dir only this shard's "
                                                    "rounds there) and start over; refused while another run holds "
                                                    "them")
