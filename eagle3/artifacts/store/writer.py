"""The store's write side: stage 02's partial files, their finalization, the index.

Stage 02 (eagle3/stages/s02_extract/write.py) and its backends (the hf backend and, inside
vLLM's worker process, the project's KV connector) call these; the layout they write
is eagle3/artifacts/store/format.py's. A file is created at its final size as a bf16
partial file (`create_partial_file`), the backends write each sample's states at its
own offset (`write_sample_states`), `finalize_file` turns it into a complete file of
the store's encoding and writes its index entry, and `write_index` lists the complete
files. `require_free_space` refuses a run the disk cannot hold before any model loads.
"""
from __future__ import annotations

import errno
import json
import logging
import mmap
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from eagle3.artifacts.atomic import DiskFullError, disk_full_error, free_bytes, is_disk_full, write_json
from eagle3.artifacts.store.format import (FINALIZE_CHUNK_ELEMS, FP8, INDEX_JSON, STORE_FORMAT, STORE_JSON, Encoding,
                                           FileLayout, _views, encoding_named, entry_name, file_bytes, file_checksum,
                                           identity_hash, label_positions, out_name, partial_name, quantize_fp8,
                                           write_identity)
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError

__all__ = ['create_partial_file', 'remove_partial', 'write_sample_states', 'bytes_to_write', 'require_free_space',
           'finalize_file', 'read_entry', 'write_index']

log = logging.getLogger(__name__)


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().cpu().view(torch.uint8).numpy()).cast("B")


def create_partial_file(path: Path, *, split: str, file_no: int, first_sample: int,
                        input_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]],
                        hidden_size: int, aux_layers: Sequence[int], identity_hash: str) -> FileLayout:
    """Create the temporary (bf16) file at its final size with token ids, masks and offsets.

    Hidden states stay zero until the backend writes them.
    """
    lengths = [len(x) for x in input_ids]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    meta = {"store_format": str(STORE_FORMAT), "split": split, "file_no": str(file_no),
            "first_sample": str(first_sample), "aux_layers": json.dumps(list(aux_layers)),
            "identity": identity_hash}
    lay, header = FileLayout.build(len(lengths), int(offsets[-1]), hidden_size, len(aux_layers), meta)
    ids = np.concatenate([np.asarray(x, dtype=np.int32) for x in input_ids]) if lengths else np.zeros(0, np.int32)
    mask = np.concatenate([np.asarray(x, dtype=np.int8) for x in loss_masks]) if lengths else np.zeros(0, np.int8)
    assert ids.shape == mask.shape, "input_ids and loss_mask lengths differ"
    _create_file(path, lay, header, {"sample_offsets": memoryview(offsets).cast("B"),
                                     "input_ids": memoryview(ids).cast("B"), "loss_mask": memoryview(mask).cast("B")})
    return lay


def remove_partial(store_dir: Path, split: str, file_no: int, writer: str | None = None) -> None:
    """Remove what an unfinished file left in `store_dir`: its partial file and the files
    beside it (fp8's `.out`, vLLM's done log). Never read, always redone.

    `writer`: only that process's (`partial_name`); None: every writer's, which only the
    holder of the folder's claim may do (eagle3/artifacts/claims.py: the others are gone)."""
    for leftover in store_dir.glob(partial_name(split, file_no, writer or "") + "*"):
        leftover.unlink(missing_ok=True)


def _create_file(path: Path, lay: FileLayout, header: bytes, columns: dict[str, memoryview]) -> None:
    """A file of `lay.total_bytes` with its header and `columns` written, the rest zero;
    on a full disk it is removed and the error names the bytes it needs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _allocate(fd, lay.total_bytes)
        _pwrite_all(fd, memoryview(header), 0)
        for name, buf in columns.items():
            _pwrite_all(fd, buf, lay.offset(name))
    except OSError as e:
        os.close(fd)
        fd = -1
        path.unlink(missing_ok=True)
        if is_disk_full(e):
            raise disk_full_error(path, needed=lay.total_bytes) from e
        raise
    finally:
        if fd >= 0:
            os.close(fd)


def _allocate(fd: int, size: int) -> None:
    """Reserve the file's blocks now. A sparse file on a disk that fills later fails
    when its holes are written: with pwrite an ENOSPC hours into the run, through
    finalize's memory map a SIGBUS that kills the process without a message. So the
    space is claimed up front (ENOSPC here names the bytes needed); file systems
    without fallocate fall back to a sparse file."""
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def write_sample_states(path: Path | str, row: int, aux: torch.Tensor, final_prenorm: torch.Tensor,
                        layout: FileLayout | None = None) -> None:
    """Write one sample's states at token row `row` of a partial file, then mark it written.

    aux: [T, A, H] or [T, A*H]; final_prenorm: [T, H] (the residual stream after all
    N layers, before the final norm: vLLM id N). Called by the hf backend and, inside
    vLLM's worker process, by the project's KV connector; samples may arrive in any
    order and from another process. Rows [row, row + T) must be whole samples of the
    file: their bytes of `valid` are set after the states (`finalize_file` checks them).
    """
    lay = layout or FileLayout.read(path)[0]
    assert not lay.encoding.scaled, f"{path}: partial files are bf16"
    T = aux.shape[0]
    aux = aux.reshape(T, -1).to(torch.bfloat16)  # [T, A, H] -> [T, A*H]
    assert aux.shape[1] == lay.num_aux * lay.hidden_size, (aux.shape, lay)
    assert final_prenorm.shape == (T, lay.hidden_size), (final_prenorm.shape, lay)
    assert 0 <= row and row + T <= lay.num_tokens, (row, T, lay.num_tokens)
    fd = os.open(path, os.O_RDWR)
    try:
        first, last = _samples_at(fd, lay, row, T, path)
        _pwrite_all(fd, _as_bytes(aux), lay.offset("aux") + row * lay.num_aux * lay.hidden_size * 2)
        _pwrite_all(fd, _as_bytes(final_prenorm.to(torch.bfloat16)), lay.offset("final") + row * lay.hidden_size * 2)
        # After the states: a kill in between leaves the samples unmarked, never marked and empty.
        _pwrite_all(fd, memoryview(b"\x01" * (last - first)), lay.offset("valid") + first)
    except OSError as e:  # only where the file could not be allocated up front (sparse)
        if is_disk_full(e):
            raise disk_full_error(path, needed=lay.total_bytes) from e
        raise
    finally:
        os.close(fd)


def _samples_at(fd: int, lay: FileLayout, row: int, T: int, path) -> tuple[int, int]:
    """The samples [first, last) that token rows [row, row + T) of the file are made of."""
    raw = os.pread(fd, 8 * (lay.num_samples + 1), lay.offset("sample_offsets"))
    offsets = np.frombuffer(raw, dtype=np.int64)  # [S+1]
    first, last = np.searchsorted(offsets, [row, row + T])
    assert first < last and offsets[first] == row and offsets[last] == row + T, \
        f"{path}: rows {row}..{row + T} are not whole samples of the file (sample offsets {offsets[:8].tolist()}...)"
    return int(first), int(last)


def bytes_to_write(files: Sequence[tuple[int, int]], hidden_size: int, num_aux: int, store_dtype: str = "bf16",
                   engines: int = 1) -> int:
    """Free bytes stage 02 needs to write `files` ((samples, tokens) of each) in `store_dtype`.

    Their sizes, plus for fp8 the bf16 partial files that exist beside them while they are
    written: per engine one being filled and one being finalized (eagle3/stages/s02_extract/write.py
    finalizes a file while the engine fills the next), the largest ones counted.
    """
    total = sum(file_bytes(S, T, hidden_size, num_aux, store_dtype) for S, T in files)
    if encoding_named(store_dtype).scaled:
        partials = sorted((file_bytes(S, T, hidden_size, num_aux) for S, T in files), reverse=True)
        total += sum(partials[:2 * engines])
    return total


def require_free_space(store_dir: Path, files: Sequence[tuple[int, int]], hidden_size: int, num_aux: int,
                       store_dtype: str = "bf16", engines: int = 1) -> None:
    """Refuse, before any model loads, to start writing `files` ((samples, tokens) of each)
    into `store_dir` when its file system has less free space than they need."""
    need = bytes_to_write(files, hidden_size, num_aux, store_dtype, engines)
    free = free_bytes(store_dir)
    if free >= need:
        return
    tokens = sum(T for _, T in files)
    enc = encoding_named(store_dtype)
    fp8_bytes = bytes_to_write(files, hidden_size, num_aux, 'fp8', engines)
    other = "" if enc.scaled else (f" --store-dtype fp8 needs {fp8_bytes:,} "
                                   f"bytes ({FP8.bytes_per_token(hidden_size, num_aux):,} B/token);")
    raise PipelineError(
        f"stage 02 needs {need:,} bytes ({need / 1e9:.2f} GB) free in {store_dir} to write {len(files)} file(s) "
        f"of {tokens:,} tokens as {enc.name} ({enc.bytes_per_token(hidden_size, num_aux):,} B/token"
        f"{', with the bf16 partial files written before each fp8 file' if enc.scaled else ''}); its file system "
        f"has {free:,} bytes ({free / 1e9:.2f} GB) free. Free space there or use a --work-dir on a larger disk;"
        f"{other} or split the files over boxes with --num-shards N --shard-index i (each box writes about 1/N). "
        f"`python -m eagle3.tools.diagnose store-size --config ...` prints the sizes.")


def finalize_file(partial: Path, final_path: Path, *, split: str, file_no: int, first_sample: int,
                  sample_ids: Sequence[str], identity_hash: str,
                  normalize: Callable[[torch.Tensor], torch.Tensor],
                  argmax: Callable[[torch.Tensor], torch.Tensor], store_dtype: str = "bf16") -> dict:
    """Turn a filled (bf16) partial file into a complete file of `store_dtype`; return its index entry.

    `normalize`: [t, H] pre-norm -> [t, H] float (the target's final norm);
    `argmax`: [t, H] bf16 normed -> [t] int (the target's lm_head argmax), taken only
    at `label_positions` (-1 elsewhere). Both run over chunks of tokens: a few large
    ops per file, not a few per sample (small ops are slow on busy CPUs). The argmax
    is taken from the bf16 normed `final`, what a bf16 store holds and stage 04 turns
    into draft logits, so "target argmax" means the same in both stages and in both
    encodings. A sample with any non-finite aux or final value is rejected: zeroed,
    masked, `valid` 0, listed in the entry.

    bf16: the partial file is finalized in place and renamed. fp8: the compact file is
    written beside it (`out_name`), renamed, and the partial file removed; a run killed
    at any point leaves only dot-named files or a file without an index entry, all redone.
    """
    enc = encoding_named(store_dtype)
    lay, meta = FileLayout.read(partial)
    assert not lay.encoding.scaled, f"{partial}: partial files are bf16"
    _refuse_unwritten(partial, lay)
    out = out_name(partial) if enc.scaled else partial
    try:
        with open(partial, "r+b") as f:
            mm = mmap.mmap(f.fileno(), lay.total_bytes)
            try:
                src = _views(mm, lay)
                if enc.scaled:
                    out_lay = _create_encoded(out, src, lay, meta, enc)
                    rejected = _finalize_into(out, out_lay, src, normalize, argmax)
                else:
                    out_lay = lay
                    rejected = _finalize_states(src, src, lay, normalize, argmax)
                    mm.flush()
                del src  # views of the mapping: drop before closing it
            finally:
                mm.close()
            if not enc.scaled:
                os.fsync(f.fileno())
    except DiskFullError:
        # Nothing of this file survives the stopped run: free the bf16 partial's space too.
        partial.unlink(missing_ok=True)
        raise
    if rejected:
        log.warning("%s: %d sample(s) rejected for NaN/Inf hidden states: %s", final_path.name,
                    len(rejected), [sample_ids[i] for i in rejected[:10]])
    entry = {
        "name": final_path.name, "split": split, "file_no": file_no, "first_sample": first_sample,
        "num_samples": lay.num_samples, "num_tokens": lay.num_tokens, "bytes": out_lay.total_bytes,
        "checksum": file_checksum(out), "rejected": rejected, "sample_ids": list(sample_ids),
        "identity": identity_hash,
    }
    os.replace(out, final_path)
    if out != partial:
        partial.unlink()
    # The entry is written after the rename: a file without an entry is incomplete.
    write_json(final_path.parent / entry_name(split, file_no), entry)
    return entry


def _refuse_unwritten(partial: Path, lay: FileLayout) -> None:
    """Every sample of a partial file must have been written (`valid` 1, set by
    `write_sample_states`): a sample never written holds zeros that would be finalized into
    data with a valid checksum (two writers on one file, a request the engine dropped)."""
    with open(partial, "rb") as f:
        f.seek(lay.offset("valid"))
        written = np.frombuffer(f.read(lay.num_samples), dtype=np.int8)  # [S]
    missing = np.flatnonzero(written != 1)
    if len(missing):
        raise PipelineError(
            f"{partial}: {len(missing)} of {lay.num_samples} samples were never written (positions "
            f"{missing[:10].tolist()}{'...' if len(missing) > 10 else ''} in the file): it is not finalized. Was "
            f"another process writing the same file? Rerun `python {WorkDir.script('extract')}` with your "
            f"--config: it redoes the file.")


def _create_encoded(out: Path, src: dict[str, torch.Tensor], lay: FileLayout, meta: dict[str, str],
                    enc: Encoding) -> FileLayout:
    """The compact file `out` for the partial file's tensors `src`, with the columns that
    do not change (offsets, token ids, mask) copied; states and argmax follow."""
    out_lay, header = FileLayout.build(lay.num_samples, lay.num_tokens, lay.hidden_size, lay.num_aux,
                                       {k: v for k, v in meta.items() if k not in ("dtype", "scale")}, enc)
    _create_file(out, out_lay, header, {k: _as_bytes(src[k]) for k in ("sample_offsets", "input_ids", "loss_mask")})
    return out_lay


def _finalize_into(out: Path, out_lay: FileLayout, src: dict[str, torch.Tensor],
                   normalize: Callable[[torch.Tensor], torch.Tensor],
                   argmax: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
    """`_finalize_states` into the mapped compact file `out`, flushed to disk."""
    with open(out, "r+b") as f:
        mm = mmap.mmap(f.fileno(), out_lay.total_bytes)
        try:
            dst = _views(mm, out_lay)
            rejected = _finalize_states(src, dst, out_lay, normalize, argmax)
            del dst
            mm.flush()
        finally:
            mm.close()
        os.fsync(f.fileno())
    return rejected


def _finalize_states(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], lay: FileLayout,
                     normalize: Callable[[torch.Tensor], torch.Tensor],
                     argmax: Callable[[torch.Tensor], torch.Tensor]) -> list[int]:
    """Norm, non-finite check, argmax and encoding from the partial file's views `src` into
    `dst` (the same views for bf16); returns the rejected samples' positions in the file."""
    T, A, H = lay.num_tokens, lay.num_aux, lay.hidden_size
    scaled = lay.encoding.scaled
    bad = torch.zeros(T, dtype=torch.bool)  # [T] token has a non-finite value
    offs = src["sample_offsets"]  # [S+1]
    need = label_positions(src["loss_mask"], offs)  # [T] bool
    rows = max(1, FINALIZE_CHUNK_ELEMS // (H * (A + 1)))
    for a in range(0, T, rows):
        b = min(T, a + rows)
        normed32 = normalize(src["final"][a:b].float())  # [c, H] float32
        aux32 = src["aux"][a:b].float()  # [c, A*H]
        # A row sum is non-finite iff a value is (or the row overflows float32,
        # which only garbage states do); much faster than isfinite on bf16.
        bad[a:b] = ~torch.isfinite(normed32.sum(-1) + aux32.sum(-1))
        normed = normed32.to(torch.bfloat16)
        # Only where a label can be needed: the full-vocab matmul is the costliest step.
        keep = need[a:b].nonzero().flatten()  # [k]
        am = torch.full((b - a,), -1, dtype=torch.int32)
        if len(keep):
            am[keep] = argmax(normed[keep]).to(torch.int32)  # [k, H] -> [k]
        dst["target_argmax"][a:b] = am
        if scaled:
            c = b - a
            q, e = quantize_fp8(aux32.view(c * A, H))  # [c, A*H] -> [c*A, H] one row per token and layer
            dst["aux"][a:b] = q.view(c, A * H)
            dst["scale_log2"][a:b, :A] = e.view(c, A)
            q, e = quantize_fp8(normed32)  # from float32: one rounding, not two
            dst["final"][a:b] = q
            dst["scale_log2"][a:b, A] = e
        else:
            dst["final"][a:b] = normed
    nbad = torch.cat([torch.zeros(1, dtype=torch.int64), bad.cumsum(0)])  # [T+1]
    ok = (nbad[offs[1:]] - nbad[offs[:-1]]) == 0  # [S]
    dst["valid"][:] = ok.to(torch.int8)
    rejected = (~ok).nonzero().flatten().tolist()
    for i in rejected:
        # Zeroed and masked, so a reader that ignores `valid` still takes no loss here.
        a, b = int(offs[i]), int(offs[i + 1])
        for name in ("aux", "final", "scale_log2") if scaled else ("aux", "final"):
            dst[name][a:b] = 0
        dst["target_argmax"][a:b] = -1
        dst["loss_mask"][a:b] = 0
    return rejected


def read_entry(store_dir: Path, split: str, file_no: int) -> dict | None:
    p = store_dir / entry_name(split, file_no)
    try:
        return json.loads(p.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_index(store_dir: Path, identity: dict, entries: list[dict], num_samples: dict[str, int],
                samples_per_file: int) -> Path:
    """index.json: each split's complete files (`entries`) and the hash of the identity they
    belong to. The identity itself is store.json's (stage 02 writes it before its first file;
    it is written here when missing, for a store built without stage 02) and never copied."""
    id_path = store_dir / STORE_JSON
    if not id_path.is_file():
        write_identity(store_dir, identity)
    elif json.loads(id_path.read_text()) != json.loads(json.dumps(identity)):
        raise PipelineError(f"{id_path} records another identity than the index being written for {store_dir}: "
                            f"files of two stores were mixed; rerun `python {WorkDir.script('extract')} --force`.")
    splits = {}
    for split, n in num_samples.items():
        files = sorted((e for e in entries if e["split"] == split), key=lambda e: e["file_no"])
        splits[split] = {"num_samples": n, "samples_per_file": samples_per_file,
                         "num_files": -(-n // samples_per_file), "files": files}
    path = store_dir / INDEX_JSON
    write_json(path, {"store_format": STORE_FORMAT, "identity_hash": identity_hash(identity), "splits": splits})
    return path


