"""Stage 02: run the target over stage 01's samples and fill the hidden-state store.

Reads `01_dataset/{train,eval}` and its manifest, the target's config, tokenizer,
final norm and lm_head; writes `02_hidden_states/` (format in eagle3/artifacts/store/format.py) and
its manifest. Run: `python 02_extract_hidden_states.py --config configs/tiny-llama.yaml`.

This module chooses between the whole store (below) and windows under --disk-budget
(windowed.py); the steps both take live in their own modules, named in the order of work.

Order of work:
1. Validate before loading any model (inputs.py): stage 01's manifest, the aux layer ids
   against the target's layer count (read from the text config wherever it sits), the
   tokenizer fingerprint, the store's identity (`store.json`) if one exists.
2. Plan (plan.py): each split is cut into files of `samples_per_file` consecutive samples;
   files are numbered train first, then eval, and box `shard_index` of `num_shards`
   takes every `num_shards`-th file. The plan depends only on the dataset and
   `samples_per_file`, so boxes run separately produce exactly the files one run
   would, and the union of their folders is the whole store.
3. Skip files already complete (index entry present, size and checksum right);
   redo the rest with the engine (engine.py, loaded once), each written as
   `.NAME.partial` and renamed when complete (write.py). A run killed at any point
   leaves only partial files (removed on restart) and complete ones.
4. Rebuild `index.json` and the manifest from every complete file in the folder (results.py);
   the manifest says which files are missing (its record's `missing_files` and
   `missing_shard_indices`) while other boxes have not finished or their files are
   not copied in yet.

No silent empty store: an empty train split stops the stage before any model loads,
and a complete store whose every train sample was rejected for NaN/Inf gets no
manifest; both say so in one line with the counts and the likely fix. More than half
of a split rejected is a warning.
"""
from __future__ import annotations

import logging

from tqdm import tqdm

from eagle3.artifacts import claims, store
from eagle3.artifacts.manifest import Manifest, already_complete
from eagle3.artifacts.workdir import SPLITS
from eagle3.engines.parallel import Reporter, run_data_parallel, use_gpu_group
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.inputs import Prepared, check_store_identity, split_lengths, validate
from eagle3.stages.s02_extract.plan import FileSpec, box_files, plan_files
from eagle3.stages.s02_extract.results import store_intact, write_results
from eagle3.stages.s02_extract.windowed import extract_windowed
from eagle3.stages.s02_extract.write import file_complete, run_files

log = logging.getLogger(__name__)


def extract_hidden_states(cfg: ExtractConfig) -> Manifest | None:
    if cfg.disk_budget is not None:
        return extract_windowed(cfg)
    p = validate(cfg)
    d = p.workdir.store()
    done = already_complete(p.workdir, "extract", p.params, p.inputs, force=cfg.force,
                            intact=lambda m: store_intact(d, m, verify_checksums=cfg.verify_checksums))
    if done:
        return done
    # One writer per store folder (two runs on one folder would write the same files):
    # claimed before any byte is written or deleted, released when the manifest is written.
    with claims.Claim.acquire(d, what=f"stage 02, shard {cfg.shard_index} of {cfg.num_shards}",
                              take_over_stale_s=cfg.take_over_stale_s) as claim:
        check_store_identity(p, cfg.force, claim)
        return _extract_whole_store(cfg, p, claim)


def _extract_whole_store(cfg: ExtractConfig, prepared: Prepared, claim: claims.Claim) -> Manifest:
    """This box's files of the whole store, then the index and the manifest (the folder claimed)."""
    d = prepared.workdir.store()
    plan = plan_files(prepared.num_samples, cfg.samples_per_file)
    mine = box_files(plan, cfg.num_shards, cfg.shard_index)
    for spec in mine:  # leftovers of a killed run (the claim says no other writer runs): redone
        store.remove_partial(d, spec.split, spec.file_no)
    todo = [s for s in mine if not file_complete(d, s, prepared.identity_hash, cfg.verify_checksums)]
    log.info("stage 02: %d files in the store, %d for this box (shard %d/%d), %d to do", len(plan), len(mine),
             cfg.shard_index, cfg.num_shards, len(todo))
    if todo:
        lengths = {s: split_lengths(prepared.workdir, s) for s in SPLITS}
        total = sum(int(lengths[s.split][s.first:s.first + s.count].sum()) for s in todo)
        store.require_free_space(d, [(s.count, int(lengths[s.split][s.first:s.first + s.count].sum())) for s in todo],
                                 prepared.info.hidden_size, len(prepared.aux_layers), cfg.store_dtype, cfg.data_parallel_size)
        with tqdm(total=total, unit="tok", unit_scale=True, desc="extract", smoothing=0.05) as bar:
            if cfg.data_parallel_size > 1:
                # tokens/s and ETA count from the first engine up, not from the start
                run_data_parallel(_dp_worker, (cfg,), todo, cfg.data_parallel_size,
                                  on_ready=lambda: bar.reset(bar.total), on_progress=bar.update, what="stage 02")
            else:
                run_files(cfg, prepared, todo, bar.update, on_ready=lambda: bar.reset(total), still_ours=claim.check)
    claim.check()
    return write_results(cfg, prepared, plan)


def _dp_worker(cfg: ExtractConfig, files: list[FileSpec], rank: int, report: Reporter) -> None:
    """One engine of `run_data_parallel`, in its own process: its GPUs, its files."""
    device = None
    if cfg.backend == "vllm":
        use_gpu_group(rank, cfg.tensor_parallel_size, cfg.data_parallel_size)
    else:
        import torch

        device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
    p = validate(cfg)
    run_files(cfg, p, files, report.progress, device, report.ready)
