"""Stage 02: run the target over stage 01's samples and fill the hidden-state store.

Reads `01_dataset/{train,eval}` and its manifest, the target's config, tokenizer,
final norm and lm_head; writes `02_hidden_states/` (format in eagle3/artifacts/store/format.py) and
its manifest. Run: `python 02_extract_hidden_states.py --config configs/tiny-llama.yaml`.

Order of work:
1. Validate before loading any model: stage 01's manifest, the aux layer ids against
   the target's layer count (read from the text config wherever it sits), the
   tokenizer fingerprint, the store's identity (`store.json`) if one exists.
2. Plan: each split is cut into files of `samples_per_file` consecutive samples;
   files are numbered train first, then eval, and box `shard_index` of `num_shards`
   takes every `num_shards`-th file. The plan depends only on the dataset and
   `samples_per_file`, so boxes run separately produce exactly the files one run
   would, and the union of their folders is the whole store.
3. Skip files already complete (index entry present, size and checksum right);
   redo the rest, each written as `.NAME.partial` and renamed when complete. A run
   killed at any point leaves only partial files (removed on restart) and complete
   ones.
4. Rebuild `index.json` and the manifest from every complete file in the folder;
   the manifest says which files are missing (its record's `missing_files` and
   `missing_shard_indices`) while other boxes have not finished or their files are
   not copied in yet.

No silent empty store: an empty train split stops the stage before any model loads,
and a complete store whose every train sample was rejected for NaN/Inf gets no
manifest; both say so in one line with the counts and the likely fix. More than half
of a split rejected is a warning.
"""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from eagle3.artifacts import claims, store, windows
from eagle3.artifacts.atomic import DiskFullError
from eagle3.artifacts.dataset import load_split as load_prepared
from eagle3.artifacts.manifest import (Manifest, already_complete, check_same, manifest_fingerprint, read_manifest,
                                       record_of, sha256_json, write_manifest)
from eagle3.artifacts.records import ExtractRecord, PrepareRecord
from eagle3.artifacts.workdir import SPLITS, WorkDir
from eagle3.core.config import identity_params
from eagle3.core.errors import PipelineError
from eagle3.engines.parallel import Reporter, run_data_parallel, use_gpu_group
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.hf_backend import HFBackend
from eagle3.stages.s02_extract.vllm_backend import VllmBackend
from eagle3.target.head import TargetHead
from eagle3.target.info import (TargetInfo, load_tokenizer, read_target_info, tokenizer_fingerprint,
                                validate_aux_layers, weights_fingerprint)

from eagle3.stages.s02_extract import windowed  # noqa: E402 - uses this module's steps at call time

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileSpec:
    """One store file: `count` samples of `split` starting at sample `first`."""

    split: str
    file_no: int
    first: int
    count: int

    @property
    def name(self) -> str:
        return store.file_name(self.split, self.file_no)


def plan_files(num_samples: dict[str, int], samples_per_file: int) -> list[FileSpec]:
    """All files of the store, train first: the same list on every box."""
    plan = []
    for split in SPLITS:
        n = num_samples.get(split, 0)
        for k, a in enumerate(range(0, n, samples_per_file)):
            plan.append(FileSpec(split, k, a, min(samples_per_file, n - a)))
    return plan


def box_files(plan: list[FileSpec], num_shards: int, shard_index: int) -> list[FileSpec]:
    """The files box `shard_index` of `num_shards` writes: every num_shards-th of the plan."""
    return plan[shard_index::num_shards]


# --------------------------------------------------------------------------- validation


@dataclass
class Prepared:
    """Everything checked before any model is loaded."""

    wd: WorkDir
    info: TargetInfo
    aux_layers: list[int]
    params: dict
    inputs: dict
    identity: dict
    identity_hash: str
    num_samples: dict[str, int]
    max_tokens: int


def load_split(wd: WorkDir, split: str):

    path = wd.dataset(split)
    try:
        return load_prepared(path).with_format("numpy")
    except FileNotFoundError as e:
        raise PipelineError(f"{path} is missing although stage 01's manifest lists it; rerun "
                            f"`python {wd.script('prepare')} --force`.") from e


def split_lengths(wd: WorkDir, split: str) -> np.ndarray:
    return np.asarray(load_split(wd, split)["num_tokens"], dtype=np.int64)  # [num_samples]


def validate(cfg: ExtractConfig) -> Prepared:
    wd = WorkDir(cfg.work_dir)
    script = wd.script("extract")
    prep = read_manifest(wd, "prepare", needed_by=script)
    pr: PrepareRecord = record_of(prep)
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    aux = validate_aux_layers(cfg.aux_layers if cfg.aux_layers is not None else info.default_aux_layers(),
                              info.num_layers, source=f"extract.aux_layers (--aux-layers) for {cfg.target_model}")
    tok = load_tokenizer(cfg.target_model, cfg.trust_remote_code)
    fp = tokenizer_fingerprint(tok)
    check_same("tokenizer fingerprint", pr.tokenizer_fingerprint, fp,
               ours_from=f"{prep.path} (stage 01, target {pr.target_model})",
               theirs_from=f"tokenizer of {cfg.target_model}",
               fix=f"pass the target stage 01 used, or rerun `python {wd.script('prepare')} --force` with "
                   f"--target-model {cfg.target_model}")
    if pr.vocab_size != info.vocab_size:
        raise PipelineError(f"stage 01 ({prep.path}) used vocab_size {pr.vocab_size}, "
                            f"{cfg.target_model} has {info.vocab_size}; rerun stage 01 with this target.")
    lengths = {s: split_lengths(wd, s) for s in SPLITS}
    num_samples = {s: int(len(v)) for s, v in lengths.items()}
    if not num_samples["train"]:
        raise PipelineError(
            f"stage 02: {wd.dataset('train')} holds 0 samples (stage 01 counted {pr.records} records, "
            f"{num_samples['eval']} held-out samples, bad records: {pr.bad_records or 'none'}); rerun "
            f"`python {wd.script('prepare')} --force` with records that hold assistant turns and a lower "
            f"--eval-fraction.")
    max_tokens = max((int(v.max()) for v in lengths.values() if len(v)), default=1)

    params = identity_params(cfg)
    params["aux_layers"] = aux  # resolved: the default is recorded as the ids it means
    # The weights too: a retrained target with the same config must not reuse a store.
    inputs = {"prepare": manifest_fingerprint(prep), "target_config": sha256_json(info.text_config),
              "target_weights": weights_fingerprint(cfg.target_model)}
    identity = {
        "store_format": store.STORE_FORMAT, "aux_layers": aux, "hidden_size": info.hidden_size,
        "num_layers": info.num_layers, "vocab_size": info.vocab_size, **store.identity_fields(cfg.store_dtype),
        "tokenizer_fingerprint": fp, "target_model": cfg.target_model, "compute_dtype": cfg.dtype,
        "backend": cfg.backend, "samples_per_file": cfg.samples_per_file, "num_samples": num_samples,
        "inputs": inputs,
    }
    return Prepared(wd, info, aux, params, inputs, identity, store.identity_hash(identity), num_samples, max_tokens)


def check_store_identity(p: Prepared, force: bool, claim: claims.Claim | None = None) -> None:
    """Refuse to mix files of two different stores in one folder. `force`: delete the store's
    files first (`delete_store_files`; `claim`: this run's claim on the folder, kept)."""
    d = p.wd.store()
    path = d / store.STORE_JSON
    if force and d.exists():
        delete_store_files(d, claim)
    d.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(p.identity) if old.get(k) != p.identity.get(k))
        if diff:
            both = "; ".join(f"{k}: {old.get(k)!r} (in {path}) vs {p.identity.get(k)!r} (this run)" for k in diff)
            raise PipelineError(f"the store in {d} was built with other settings: {both}. Pass --force to "
                                f"delete it and start over, or rerun with its settings.")
    else:
        store.write_identity(d, p.identity)


def delete_store_files(store_dir: Path, claim: claims.Claim | None) -> None:
    """--force: delete what the store folder holds, never the folder itself, and nothing while
    another run holds the folder or a round folder in it (its claim, eagle3/artifacts/claims.py)."""
    rounds_dir = store_dir / windows.WINDOWS_DIR
    inside = [store_dir] + ([sub for sub in rounds_dir.iterdir() if sub.is_dir()] if rounds_dir.is_dir() else [])
    busy = [(folder, holder) for folder, holder in claims.live_claims(inside)
            if claim is None or holder.token != claim.holder.token]
    if busy:
        folder, holder = busy[0]
        raise PipelineError(f"--force would delete {store_dir}, but {claims.refusal(folder, holder)}")
    log.warning("--force: deleting the existing store's files in %s", store_dir)
    ours = {claims.CLAIM_JSON, claims.beat_name(claim.holder.token)} if claim is not None else set()
    for entry in store_dir.iterdir():
        if entry.name in ours:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)


# --------------------------------------------------------------------------- the work


def _file_complete(d: Path, spec: FileSpec, identity_hash: str, verify: bool) -> bool:
    entry = store.read_entry(d, spec.split, spec.file_no)
    if entry is None:
        return False
    if entry.get("identity") != identity_hash or entry["num_samples"] != spec.count:
        log.warning("%s belongs to another store; redoing it", spec.name)
        return False
    problem = store.file_problem(d, entry, verify_checksum=verify)
    if problem:
        log.warning("%s; redoing it", problem)
        return False
    return True


def make_backend(cfg: ExtractConfig, p: Prepared, device: str | None = None):
    if cfg.backend == "hf":

        return HFBackend(p.info, p.aux_layers, dtype=cfg.dtype, batch_tokens=cfg.batch_tokens,
                         trust_remote_code=cfg.trust_remote_code, device=device)

    engine = cfg.engine_config(model=p.info.source, max_model_len=cfg.max_model_len or p.max_tokens + 1)
    return VllmBackend(p.info, p.aux_layers, engine, cfg.batch_tokens)


def load_engine(cfg: ExtractConfig, p: Prepared, device: str | None = None):
    """(backend, target head): everything loaded once per process."""

    head = TargetHead.load(p.info, device)
    return make_backend(cfg, p, device), head


def _finish_file(written: Callable[[], None], still_ours: Callable[[], None], *args, **kwargs) -> dict:
    written()  # the backend's writes of this file are complete
    still_ours()  # the folder's claim: nothing is finished in a folder another run took over
    return store.finalize_file(*args, **kwargs)


def write_files(p: Prepared, backend, head, files: list[FileSpec], on_tokens: Callable[[int], None],
                store_dir: Path | None = None, splits: dict | None = None,
                still_ours: Callable[[], None] = lambda: None) -> None:
    """Extract `files` into the store with a loaded backend: partial file, fill, finalize.

    `store_dir`, `splits`: a window's folder and its samples (eagle3/artifacts/windows.py);
    by default the store folder and stage 01's splits. `still_ours()` raises when the
    folder's claim was lost (eagle3/artifacts/claims.py); called before each finalize.
    Partial files carry this process's name (`claims.writer_name()`)."""
    d = store_dir or p.wd.store()
    writer = claims.writer_name()
    splits = splits or {s: load_split(p.wd, s) for s in {f.split for f in files}}
    # Waiting for a file's last writes and finalizing it (norm, argmax, checksum: a full
    # pass over it) run in a thread while the engine works on the next file; at most
    # one file waits, to bound memory.
    pending = None
    with ThreadPoolExecutor(1, thread_name_prefix="finalize") as pool:
        for spec in files:
            rows_ = splits[spec.split][spec.first: spec.first + spec.count]
            ids = [np.asarray(x, dtype=np.int32) for x in rows_["input_ids"]]
            masks = [np.asarray(x, dtype=np.int8) for x in rows_["loss_mask"]]
            sample_ids = [str(s) for s in rows_["sample_id"]]
            partial = d / store.partial_name(spec.split, spec.file_no, writer)
            store.create_partial_file(
                partial, split=spec.split, file_no=spec.file_no, first_sample=spec.first, input_ids=ids,
                loss_masks=masks, hidden_size=p.info.hidden_size, aux_layers=p.aux_layers,
                identity_hash=p.identity_hash)
            rows = np.cumsum([0] + [len(x) for x in ids])[:-1].tolist()  # token offset of each sample
            written = None
            try:
                written = backend.extract_file(partial, ids, rows, on_tokens)
                if pending is not None:
                    pending.result()
            except DiskFullError:
                # The file before could not be finalized for want of space (or this one's
                # writes hit it): the stop frees this file's space too, once the engine has
                # stopped writing into it; the rerun redoes it.
                if written is not None:
                    with contextlib.suppress(Exception):
                        written()
                store.remove_partial(d, spec.split, spec.file_no, writer)
                raise
            pending = pool.submit(
                _finish_file, written, still_ours, partial, d / spec.name, split=spec.split, file_no=spec.file_no,
                first_sample=spec.first, sample_ids=sample_ids, identity_hash=p.identity_hash,
                normalize=head.normalize, argmax=head.argmax, store_dtype=p.params["store_dtype"])
        if pending is not None:
            pending.result()


def run_files(cfg: ExtractConfig, p: Prepared, files: list[FileSpec], on_tokens: Callable[[int], None],
              device: str | None = None, on_ready: Callable[[], None] = lambda: None, **where) -> None:
    """Extract `files` with one engine in this process; `on_ready` once it is loaded;
    `where`: write_files' store_dir and splits (a window)."""
    backend, head = load_engine(cfg, p, device)
    try:
        on_ready()
        write_files(p, backend, head, files, on_tokens, **where)
    finally:
        backend.close()


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


# --------------------------------------------------------------------------- the stage


def write_results(cfg: ExtractConfig, p: Prepared, plan: list[FileSpec]) -> Manifest:
    d = p.wd.store()
    entries, missing = [], []
    for k, spec in enumerate(plan):
        entry = store.read_entry(d, spec.split, spec.file_no)
        ok = (entry is not None and entry.get("identity") == p.identity_hash
              and store.file_problem(d, entry, verify_checksum=False) is None)
        if ok:
            entries.append(entry)
        else:
            missing.append((k, spec))
    index_path = store.write_index(d, p.identity, entries, p.num_samples, cfg.samples_per_file)
    counts: dict = {}
    for split in SPLITS:
        es = [e for e in entries if e["split"] == split]
        counts[f"{split}_samples"] = sum(e["num_samples"] for e in es)
        counts[f"{split}_tokens"] = sum(e["num_tokens"] for e in es)
        counts[f"{split}_rejected_nonfinite"] = sum(len(e["rejected"]) for e in es)
    counts["files_expected"] = len(plan)
    counts["files_present"] = len(entries)
    counts["bytes"] = sum(e["bytes"] for e in entries)
    counts["bytes_per_token"] = store.bytes_per_token(p.info.hidden_size, len(p.aux_layers), cfg.store_dtype)
    rejected = {e["name"]: [e["sample_ids"][i] for i in e["rejected"]] for e in entries if e["rejected"]}
    _refuse_or_warn_rejected(cfg, d, counts, complete=not missing)
    encoding = store.encoding_fields(cfg.store_dtype)
    shard_indices = sorted({k % cfg.num_shards for k, _ in missing})
    # The store's identity is store.json (eagle3/artifacts/store/format.py); the record's copies of
    # it are taken from there, for the manifest's reader (docs/RECORDS.md).
    ident = p.identity
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
        "identity_hash": p.identity_hash,
    }
    outputs = [d / store.STORE_JSON, index_path]
    outputs += [x for e in entries for x in (d / e["name"], d / store.entry_name(e["split"], e["file_no"]))]
    m = write_manifest(p.wd, "extract", params=p.params, inputs=p.inputs, counts=counts, outputs=outputs,
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


def _refuse_or_warn_rejected(cfg: ExtractConfig, d: Path, counts: dict, *, complete: bool) -> None:
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
        raise PipelineError(f"stage 02: no usable train sample in {d} ({line}); {fix}; then rerun with --force.")
    if any(2 * counts[f"{s}_rejected_nonfinite"] > counts[f"{s}_samples"] for s in SPLITS):
        log.warning("stage 02: most samples of a split were rejected (%s); %s", line, fix)


def store_intact(d: Path, m: Manifest, *, verify_checksums: bool) -> bool:
    """A finished store whose every file is still there, whole (and, when asked, with its checksum)."""
    if not record_of(m).complete:
        return False
    entries = json.loads((d / store.INDEX_JSON).read_text())["splits"]
    bad = [store.file_problem(d, e, verify_checksum=verify_checksums)
           for info in entries.values() for e in info["files"]]
    if any(bad):
        log.warning("stage 02's store is damaged (%s); redoing the damaged files", next(b for b in bad if b))
    return not any(bad)


def extract_hidden_states(cfg: ExtractConfig) -> Manifest | None:
    if cfg.disk_budget is not None:
        return windowed.extract_windowed(cfg)
    p = validate(cfg)
    d = p.wd.store()
    done = already_complete(p.wd, "extract", p.params, p.inputs, force=cfg.force,
                            intact=lambda m: store_intact(d, m, verify_checksums=cfg.verify_checksums))
    if done:
        return done
    # One writer per store folder (two runs on one folder would write the same files):
    # claimed before any byte is written or deleted, released when the manifest is written.
    with claims.Claim.acquire(d, what=f"stage 02, shard {cfg.shard_index} of {cfg.num_shards}",
                              take_over_stale_s=cfg.take_over_stale_s) as claim:
        check_store_identity(p, cfg.force, claim)
        return _extract_whole_store(cfg, p, claim)


def _extract_whole_store(cfg: ExtractConfig, p: Prepared, claim: claims.Claim) -> Manifest:
    """This box's files of the whole store, then the index and the manifest (the folder claimed)."""
    d = p.wd.store()
    plan = plan_files(p.num_samples, cfg.samples_per_file)
    mine = box_files(plan, cfg.num_shards, cfg.shard_index)
    for spec in mine:  # leftovers of a killed run (the claim says no other writer runs): redone
        store.remove_partial(d, spec.split, spec.file_no)
    todo = [s for s in mine if not _file_complete(d, s, p.identity_hash, cfg.verify_checksums)]
    log.info("stage 02: %d files in the store, %d for this box (shard %d/%d), %d to do", len(plan), len(mine),
             cfg.shard_index, cfg.num_shards, len(todo))
    if todo:
        lengths = {s: split_lengths(p.wd, s) for s in SPLITS}
        total = sum(int(lengths[s.split][s.first:s.first + s.count].sum()) for s in todo)
        store.require_free_space(d, [(s.count, int(lengths[s.split][s.first:s.first + s.count].sum())) for s in todo],
                                 p.info.hidden_size, len(p.aux_layers), cfg.store_dtype, cfg.data_parallel_size)
        with tqdm(total=total, unit="tok", unit_scale=True, desc="extract", smoothing=0.05) as bar:
            if cfg.data_parallel_size > 1:
                # tokens/s and ETA count from the first engine up, not from the start
                run_data_parallel(_dp_worker, (cfg,), todo, cfg.data_parallel_size,
                                  on_ready=lambda: bar.reset(bar.total), on_progress=bar.update, what="stage 02")
            else:
                run_files(cfg, p, todo, bar.update, on_ready=lambda: bar.reset(total), still_ours=claim.check)
    claim.check()
    return write_results(cfg, p, plan)

