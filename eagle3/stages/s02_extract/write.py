"""Stage 02's writing: the store files of a plan, filled by a loaded engine, into one folder.

Reads stage 01's samples; writes each file as `.NAME.partial` (named after this process,
`claims.writer_name()`), renamed when complete, with its index entry. Used alike for the
whole store (run.py) and for a window's round (windowed.py), which pass the folder and the
samples. `file_complete` says which files a rerun keeps.
"""
from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from eagle3.artifacts import claims, store
from eagle3.artifacts.atomic import DiskFullError
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.engine import load_engine
from eagle3.stages.s02_extract.inputs import Prepared, load_split
from eagle3.stages.s02_extract.plan import FileSpec

# Logged under the name these lines carried while stage 02 was one module, so the log
# lines (and whatever greps them) stay the same.
log = logging.getLogger("eagle3.stages.s02_extract.run")


def file_complete(folder: Path, spec: FileSpec, identity_hash: str, verify: bool) -> bool:
    """Whether `spec`'s file in folder d can be kept: its index entry is this store's (identity,
    sample count) and the file is whole (with `verify`, its checksum too); else it is redone."""
    entry = store.read_entry(folder, spec.split, spec.file_no)
    if entry is None:
        return False
    if entry.get("identity") != identity_hash or entry["num_samples"] != spec.count:
        log.warning("%s belongs to another store; redoing it", spec.name)
        return False
    problem = store.file_problem(folder, entry, verify_checksum=verify)
    if problem:
        log.warning("%s; redoing it", problem)
        return False
    return True


def _finish_file(written: Callable[[], None], still_ours: Callable[[], None], *args, **kwargs) -> dict:
    written()  # the backend's writes of this file are complete
    still_ours()  # the folder's claim: nothing is finished in a folder another run took over
    return store.finalize_file(*args, **kwargs)


def write_files(prepared: Prepared, backend, head, files: list[FileSpec], on_tokens: Callable[[int], None],
                store_dir: Path | None = None, splits: dict | None = None,
                still_ours: Callable[[], None] = lambda: None) -> None:
    """Extract `files` into the store with a loaded backend: partial file, fill, finalize.

    `store_dir`, `splits`: a window's folder and its samples (eagle3/artifacts/windows.py);
    by default the store folder and stage 01's splits. `still_ours()` raises when the
    folder's claim was lost (eagle3/artifacts/claims.py); called before each finalize.
    Partial files carry this process's name (`claims.writer_name()`)."""
    d = store_dir or prepared.workdir.store()
    writer = claims.writer_name()
    splits = splits or {s: load_split(prepared.workdir, s) for s in {f.split for f in files}}
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
                loss_masks=masks, hidden_size=prepared.info.hidden_size, aux_layers=prepared.aux_layers,
                identity_hash=prepared.identity_hash)
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
                first_sample=spec.first, sample_ids=sample_ids, identity_hash=prepared.identity_hash,
                normalize=head.normalize, argmax=head.argmax, store_dtype=prepared.params["store_dtype"])
        if pending is not None:
            pending.result()


def run_files(cfg: ExtractConfig, prepared: Prepared, files: list[FileSpec], on_tokens: Callable[[int], None],
              device: str | None = None, on_ready: Callable[[], None] = lambda: None, **where) -> None:
    """Extract `files` with one engine in this process; `on_ready` once it is loaded;
    `where`: write_files' store_dir and splits (a window)."""
    backend, head = load_engine(cfg, prepared, device)
    try:
        on_ready()
        write_files(prepared, backend, head, files, on_tokens, **where)
    finally:
        backend.close()
