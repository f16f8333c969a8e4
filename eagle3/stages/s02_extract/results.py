"""Stage 02's results: the index and the manifest, rebuilt from the complete files in the folder.

Reads every index entry the plan names in the store folder; writes `index.json` and stage
02's manifest (its `ExtractRecord` says which files are still missing while other boxes have
not finished). Refuses a complete store with no usable train sample (no manifest then), and
warns when most of a split was rejected for NaN/Inf. `store_intact` is the stage's own resume
check on a finished store.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from eagle3.artifacts import store
from eagle3.artifacts.manifest import Manifest, record_of, write_manifest
from eagle3.artifacts.records import ExtractRecord
from eagle3.artifacts.workdir import SPLITS
from eagle3.core.errors import PipelineError
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.inputs import Prepared
from eagle3.stages.s02_extract.plan import FileSpec

# Logged under the name these lines carried while stage 02 was one module, so the log
# lines (and whatever greps them) stay the same.
log = logging.getLogger("eagle3.stages.s02_extract.run")


def write_results(cfg: ExtractConfig, prepared: Prepared, plan: list[FileSpec]) -> Manifest:
    d = prepared.workdir.store()
    entries, missing = [], []
    for k, spec in enumerate(plan):
        entry = store.read_entry(d, spec.split, spec.file_no)
        ok = (entry is not None and entry.get("identity") == prepared.identity_hash
              and store.file_problem(d, entry, verify_checksum=False) is None)
        if ok:
            entries.append(entry)
        else:
            missing.append((k, spec))
    index_path = store.write_index(d, prepared.identity, entries, prepared.num_samples, cfg.samples_per_file)
    counts: dict = {}
    for split in SPLITS:
        es = [e for e in entries if e["split"] == split]
        counts[f"{split}_samples"] = sum(e["num_samples"] for e in es)
        counts[f"{split}_tokens"] = sum(e["num_tokens"] for e in es)
        counts[f"{split}_rejected_nonfinite"] = sum(len(e["rejected"]) for e in es)
    counts["files_expected"] = len(plan)
    counts["files_present"] = len(entries)
    counts["bytes"] = sum(e["bytes"] for e in entries)
    counts["bytes_per_token"] = store.bytes_per_token(prepared.info.hidden_size, len(prepared.aux_layers), cfg.store_dtype)
    rejected = {e["name"]: [e["sample_ids"][i] for i in e["rejected"]] for e in entries if e["rejected"]}
    _refuse_or_warn_rejected(cfg, d, counts, complete=not missing)
    encoding = store.encoding_fields(cfg.store_dtype)
    shard_indices = sorted({k % cfg.num_shards for k, _ in missing})
    # The store's identity is store.json (eagle3/artifacts/store/format.py); the record's copies of
    # it are taken from there, for the manifest's reader (docs/RECORDS.md).
    ident = prepared.identity
    record = ExtractRecord(
        target_model=ident["target_model"], tokenizer_fingerprint=ident["tokenizer_fingerprint"],
        aux_layer_ids=list(ident["aux_layers"]), hidden_size=ident["hidden_size"], num_layers=ident["num_layers"],
        vocab_size=ident["vocab_size"], store_dtype=encoding["store_dtype"], complete=not missing,
        missing_files=len(missing), missing_shard_indices=shard_indices)
    extra = {
        "layer_ids": "docs/CONVENTIONS.md §1: id k = residual stream after k decoder layers",
        "dtype": encoding["dtype"], "scale": encoding["scale"], "store_format": store.STORE_FORMAT,
        "loss_target": "final = target hidden state after its final norm (read as bf16), so target logits = "
                       "final @ lm_head.T; target_argmax = full-vocab argmax of those logits (int32) where "
                       "loss_mask[t] or loss_mask[t+1] is 1, -1 elsewhere",
        "missing_files_first_100": [s.name for _, s in missing][:100],
        "rejected_sample_ids": rejected,
        "identity_hash": prepared.identity_hash,
    }
    outputs = [d / store.STORE_JSON, index_path]
    outputs += [x for e in entries for x in (d / e["name"], d / store.entry_name(e["split"], e["file_no"]))]
    m = write_manifest(prepared.workdir, "extract", params=prepared.params, inputs=prepared.inputs, counts=counts, outputs=outputs,
                       record=record, extra=extra, hash_outputs=False)
    tok = counts["train_tokens"] + counts["eval_tokens"]
    log.info("stage 02: %d/%d files, %d train / %d eval samples, %d tokens, %.1f MB (%d B/token); "
             "rejected for NaN/Inf: %d train, %d eval -> %s", len(entries), len(plan), counts["train_samples"],
             counts["eval_samples"], tok, counts["bytes"] / 1e6, counts["bytes_per_token"],
             counts["train_rejected_nonfinite"], counts["eval_rejected_nonfinite"], d)
    if missing:
        log.warning("the store lacks %d file(s) (%s...): run the other boxes (--num-shards %d --shard-index %s), "
                    "copy their files into %s, then rerun this command once to complete the manifest",
                    len(missing), missing[0][1].name, cfg.num_shards, shard_indices, d)
    return m


def _refuse_or_warn_rejected(cfg: ExtractConfig, folder: Path, counts: dict, *, complete: bool) -> None:
    """No usable train sample in a complete store is an error (no manifest: stage 04 must not
    train on nothing; the files stay, so a rerun says the same without extracting again);
    more than half of a split rejected is a warning. Same counts in both lines."""
    line = "; ".join(f"{s}: {counts[f'{s}_rejected_nonfinite']} of {counts[f'{s}_samples']} samples rejected "
                     f"for NaN/Inf hidden states" for s in SPLITS)
    fix = ("float16 overflows: run the target in bfloat16 or float32 (--dtype)" if cfg.dtype == "float16" else
           f"the target's forward in {cfg.dtype} is not finite: check its weights for NaN/Inf, or run it in "
           f"float32 (--dtype float32)")
    usable = counts["train_samples"] - counts["train_rejected_nonfinite"]
    if complete and counts["train_samples"] and not usable:
        raise PipelineError(f"stage 02: no usable train sample in {folder} ({line}); {fix}; then rerun with --force.")
    if any(2 * counts[f"{s}_rejected_nonfinite"] > counts[f"{s}_samples"] for s in SPLITS):
        log.warning("stage 02: most samples of a split were rejected (%s); %s", line, fix)


def store_intact(folder: Path, manifest: Manifest, *, verify_checksums: bool) -> bool:
    """A finished store whose every file is still there, whole (and, when asked, with its checksum)."""
    if not record_of(manifest).complete:
        return False
    entries = json.loads((folder / store.INDEX_JSON).read_text())["splits"]
    bad = [store.file_problem(folder, e, verify_checksum=verify_checksums)
           for info in entries.values() for e in info["files"]]
    if any(bad):
        log.warning("stage 02's store is damaged (%s); redoing the damaged files", next(b for b in bad if b))
    return not any(bad)
