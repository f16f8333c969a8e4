"""The hidden-state store: what stage 02 writes and stage 04 reads.

Reads nothing of its own; `eagle3/stages/s02_extract/run.py` writes it, the trainer reads it
with `HiddenStateStore.open(wd, needed_by=...)`. All store file names live here,
inside `WorkDir.store()` (`WORK/02_hidden_states/`):

    store.json                 identity of the store (layers, hidden size, tokenizer, ...),
                               written before the first file; a rerun with other settings
                               is refused until --force.
    {split}-{nnnnn}.safetensors one file of `samples_per_file` consecutive samples of a split
    {split}-{nnnnn}.json        its index entry: sample ids, byte size, xxh3-128 checksum,
                               rejected (NaN/Inf) samples; written after the file is renamed,
                               so a file without one is incomplete.
    index.json                 all entries of the files present, written with the manifest.
    .{split}-{nnnnn}.partial    a file being written (never read; removed on resume).
    .{split}-{nnnnn}.partial.out  fp8 only: the compact file being written from the partial
                               one (never read; removed on resume).

One file holds, for its S samples and their T tokens in total (safetensors layout,
each tensor concatenated over the samples, read by memory map):

    sample_offsets  int64 [S+1]   token offset of each sample inside the file
    target_argmax   int32 [T]     argmax of the target's full-vocab logits at position t
                                  (its prediction of token t+1) where loss_mask[t] or
                                  loss_mask[t+1] is 1; -1 elsewhere (never a label) and
                                  for rejected samples
    input_ids       int32 [T]
    aux             [T, A*H]      residual stream after each aux layer (convention 1),
                                  concatenated in ascending layer order
    final           [T, H]        last layer's output AFTER the target's final norm, so
                                  target logits = final @ lm_head.T (no norm to re-apply)
    scale_log2      int8  [T, A+1] fp8 only: row t of aux layer k (k < A) and of final
                                  (k = A) is stored divided by 2**scale_log2[t, k]
    loss_mask       int8  [T]     1 = assistant token carrying loss (from stage 01)
    valid           int8  [S]     0 = rejected for NaN/Inf (its data is zeroed, mask 0)

aux and final are stored in one of two encodings, chosen per store by stage 02's
`store_dtype` and recorded in store.json, index.json, the manifest and every file's
header (`dtype`, `scale`):

    bf16  bfloat16 values as they are (the reference). Bytes per token:
          2*A*H + 2*H + 4 + 4 + 1 = 2H(A+1) + 9; A = 3, H = 7168: 57,353 B.
    fp8   float8_e4m3fn with a power-of-two scale per token and tensor (one per aux
          layer, one for final). Bytes per token: H(A+1) + (A+1) + 9 = 4H + 13 for
          A = 3; H = 7168: 28,685 B. The reader hands back bf16 (`Sample`), so stage 04
          is the same for both.

Why these fp8 scales: the exponent `e` of a row's scale is the exponent of its largest
magnitude minus 8, so every scaled value is below 2**8 (at most 2**8 once rounded; e4m3
holds up to 448) and none saturates. A power of two scales exactly in both directions, so the one rounding is
the cast to e4m3 (3 mantissa bits: at most 2**-4 relative error per value); dequantised
values are exact in bf16; and the scale fits one byte. A row's largest values are what
its L2 error is made of, and e4m3's range below them (2**17) covers the rest. Other
schemes cost more bytes: a bf16 scale (amax / 256) would store each token's largest value
exactly (in residual streams with massive activations, the value its norm is made of), at
2 bytes a scale (4H + 17 per token); per-block scales
cost one byte per block and tensor. bench/bench_store_format.py measures their error
beside this one's, and the argmax agreement of the final state.

The temporary file is always bf16 and created with its final size (header, token ids
and mask written, hidden states zero) so the backends, including vLLM's worker process
through the KV connector, write each sample's states at its own offset
(`write_sample_states`); `finalize_file` then applies the final norm, computes the
argmax (from the bf16 final state, for every encoding: both stores hold the same
target argmax), rejects non-finite samples, and either keeps the file (bf16) or writes
the fp8 file beside it, then checksums and renames.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from eagle3.core.atomic import DiskFullError, disk_full_error, free_bytes, is_disk_full, write_json
from eagle3.core.errors import PipelineError
from eagle3.core.manifest import Manifest, check_same, read_manifest
from eagle3.core.workdir import WorkDir

log = logging.getLogger(__name__)

STORE_FORMAT = 1  # version of the file layout and index; the encoding is recorded beside it
STORE_JSON = "store.json"
INDEX_JSON = "index.json"
CHECKSUM = "xxh3_128"
STORE_DTYPE = "bfloat16"  # dtype of the reference encoding (bf16); each store records its own `dtype`
FINALIZE_CHUNK_ELEMS = 1 << 24  # aux+final elements per finalize step (~64 MB as float32)
_ALIGN = 64  # data section starts at a multiple of this (safetensors allows header padding)
_ST_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.bfloat16: "BF16",
              torch.float8_e4m3fn: "F8_E4M3"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
FP8_DTYPE = torch.float8_e4m3fn
FP8_HEADROOM_BITS = 8  # scaled magnitudes stay below 2**8 <= 448, e4m3's largest value
SCALE_LOG2_MIN, SCALE_LOG2_MAX = -126, 126  # 2**e and 2**-e are both normal float32 numbers


def file_name(split: str, file_no: int) -> str:
    return f"{split}-{file_no:05d}.safetensors"


def entry_name(split: str, file_no: int) -> str:
    return f"{split}-{file_no:05d}.json"


def partial_name(split: str, file_no: int) -> str:
    return f".{split}-{file_no:05d}.partial"


def out_name(partial: Path) -> Path:
    """Where finalize writes a compact (fp8) file from the bf16 partial file `partial`."""
    return partial.with_name(partial.name + ".out")


# --------------------------------------------------------------------------- encodings


@dataclass(frozen=True)
class Encoding:
    """How a store file holds aux and final (the module docstring says why fp8 is scaled so)."""

    name: str  # stage 02's `store_dtype` value
    dtype: str  # recorded as `dtype` in store.json, index.json, the manifest and file headers
    scale: str  # the scale scheme in words, recorded beside it ("none": values as they are)

    @property
    def scaled(self) -> bool:
        return self.scale != "none"

    def bytes_per_token(self, hidden_size: int, num_aux: int) -> int:
        """aux + final (+ scales) + target_argmax + input_ids (int32) + loss_mask (int8)."""
        if self.scaled:
            return (num_aux + 1) * hidden_size + (num_aux + 1) + 4 + 4 + 1
        return 2 * (num_aux + 1) * hidden_size + 4 + 4 + 1


BF16 = Encoding("bf16", STORE_DTYPE, "none")
FP8 = Encoding("fp8", "float8_e4m3fn",
               "power of two per token and tensor: value = e4m3 * 2**scale_log2[t, k] (int8 [T, A+1]; "
               "k < A: aux layer k, k = A: final)")
ENCODINGS = {e.name: e for e in (BF16, FP8)}


def encoding_named(name: str) -> Encoding:
    """The encoding of a `store_dtype` value ('bf16', 'fp8')."""
    if name not in ENCODINGS:
        raise PipelineError(f"store_dtype {name!r} is not one of {', '.join(ENCODINGS)} (--store-dtype).")
    return ENCODINGS[name]


def encoding_of(record: dict) -> Encoding | None:
    """The encoding a store.json / index identity / file header records; None when this
    code does not know it. Stores written before fp8 existed record no `scale`: bf16."""
    dtype, scale = record.get("dtype", STORE_DTYPE), record.get("scale", "none")
    return next((e for e in ENCODINGS.values() if (e.dtype, e.scale) == (dtype, scale)), None)


def identity_fields(store_dtype: str) -> dict[str, str]:
    """What store.json records about the encoding. bf16 records `dtype` alone, as stores did
    before fp8 existed, so their identity (and a resume of them) is unchanged."""
    enc = encoding_named(store_dtype)
    return {"dtype": enc.dtype, "scale": enc.scale} if enc.scaled else {"dtype": enc.dtype}


def encoding_fields(store_dtype: str) -> dict[str, str]:
    """The encoding as stage 02's manifest records it (`store_dtype`, `dtype`, `scale`)."""
    enc = encoding_named(store_dtype)
    return {"store_dtype": enc.name, "dtype": enc.dtype, "scale": enc.scale}


def bytes_per_token(hidden_size: int, num_aux: int, store_dtype: str = "bf16") -> int:
    """Bytes a store file takes per token (headers and per-sample arrays aside)."""
    return encoding_named(store_dtype).bytes_per_token(hidden_size, num_aux)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """float32 2**e for integers e in [-126, 127], built from the exponent bits: exact."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, H] -> ([R, H] float8_e4m3fn, [R] int8 scale_log2) with x ~ q * 2**scale_log2 per row.

    Non-finite rows give garbage here; finalize zeroes their samples.
    """
    x = x.float()
    _, k = torch.frexp(x.abs().amax(-1))  # [R]: row max = m * 2**k, 0.5 <= m < 1 (k = 0 for a zero row)
    e = (k - FP8_HEADROOM_BITS).clamp(SCALE_LOG2_MIN, SCALE_LOG2_MAX)  # [R]
    q = (x * _pow2(-e)[:, None]).to(FP8_DTYPE)  # [R, H]: |x| * 2**-e < 2**8, no saturation
    return q, e.to(torch.int8)


# The bf16 bit pattern of each of the 256 e4m3 codes. Dequantising to bf16 is then a table
# look-up plus an add to the exponent field (the scale is a power of two): exact, and one
# pass over one-byte codes instead of a float32 round trip (stage 04 reads every token so).
_E4M3_AS_BF16_BITS = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).to(torch.bfloat16).view(torch.int16).numpy()
# Nonzero e4m3 magnitudes lie in [2**-9, 2**8.8]: with these exponents the add stays in bf16's
# normal range; rows scaled outside it (near-zero or overflowing states) take the float path.
_EXPONENT_ADD_RANGE = (-117, 119)


# Below this many values one thread decodes; above it, torch.get_num_threads() threads share
# the rows (numpy releases the GIL in both steps, so the read path scales with the cores
# the process is given, e.g. by OMP_NUM_THREADS under torchrun).
_PARALLEL_DECODE_VALUES = 1 << 20


@functools.lru_cache(maxsize=None)
def _decode_pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="fp8-decode")


os.register_at_fork(after_in_child=_decode_pool.cache_clear)  # a forked child has none of the parent's threads


def dequantize_fp8(q: torch.Tensor, scale_log2: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[R, H] float8_e4m3fn, [R] int8 -> [R, H] `dtype` (exact in bf16: 4 significant bits times 2**e)."""
    lo, hi = _EXPONENT_ADD_RANGE
    if dtype != torch.bfloat16 or not len(scale_log2) or not lo <= int(scale_log2.min()) <= int(scale_log2.max()) <= hi:
        return (q.to(torch.float32) * _pow2(scale_log2)[:, None]).to(dtype)
    codes = q.contiguous().view(torch.uint8).numpy()  # [R, H]
    exponent = (scale_log2.numpy().astype(np.int16) << 7)[:, None]  # [R, 1]: 2**e in the exponent field
    bits = np.empty(codes.shape, np.int16)  # [R, H] bf16 bit patterns

    def rows(a: int, b: int) -> None:
        np.take(_E4M3_AS_BF16_BITS, codes[a:b], out=bits[a:b], mode="clip")  # codes are 0..255: never clipped
        np.add(bits[a:b], exponent[a:b], out=bits[a:b], where=(codes[a:b] & 0x7F) != 0)  # zeros stay zero

    R, workers = codes.shape[0], min(torch.get_num_threads(), codes.shape[0])
    if workers < 2 or codes.size < _PARALLEL_DECODE_VALUES:
        rows(0, R)
    else:
        cuts = np.linspace(0, R, workers + 1).astype(int).tolist()
        list(_decode_pool(workers).map(rows, cuts[:-1], cuts[1:]))
    return torch.from_numpy(bits).view(torch.bfloat16)


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class FileLayout:
    """Where each tensor of one store file lies; identical for writer and reader."""

    num_samples: int
    num_tokens: int
    hidden_size: int
    num_aux: int
    data_start: int  # byte offset of the data section (after the padded header)
    encoding: Encoding = BF16  # partial files are always bf16

    def tensors(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        # Ordered by item size (8, 4, 2, 1 bytes) so each tensor is aligned to its
        # item size without gaps (safetensors forbids holes in the data section).
        S, T, H, A = self.num_samples, self.num_tokens, self.hidden_size, self.num_aux
        if self.encoding.scaled:
            states = [("aux", FP8_DTYPE, (T, A * H)), ("final", FP8_DTYPE, (T, H)), ("scale_log2", torch.int8, (T, A + 1))]
        else:
            states = [("aux", torch.bfloat16, (T, A * H)), ("final", torch.bfloat16, (T, H))]
        return [
            ("sample_offsets", torch.int64, (S + 1,)),
            ("target_argmax", torch.int32, (T,)),
            ("input_ids", torch.int32, (T,)),
            *states,
            ("loss_mask", torch.int8, (T,)),
            ("valid", torch.int8, (S,)),
        ]

    def spans(self) -> dict[str, tuple[int, int]]:
        """name -> (start, end) offsets relative to the data section."""
        out, pos = {}, 0
        for name, dtype, shape in self.tensors():
            n = int(np.prod(shape)) * dtype.itemsize
            out[name] = (pos, pos + n)
            pos += n
        return out

    @property
    def data_bytes(self) -> int:
        return max(e for _, e in self.spans().values())

    @property
    def total_bytes(self) -> int:
        return self.data_start + self.data_bytes

    def offset(self, name: str) -> int:
        """Absolute byte offset of tensor `name` in the file."""
        return self.data_start + self.spans()[name][0]

    def header_tensors(self) -> dict[str, dict]:
        """The safetensors header entries of this layout's tensors."""
        spans = self.spans()
        return {name: {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": list(spans[name])}
                for name, dtype, shape in self.tensors()}

    @classmethod
    def build(cls, num_samples: int, num_tokens: int, hidden_size: int, num_aux: int,
              metadata: dict[str, str], encoding: Encoding = BF16) -> tuple["FileLayout", bytes]:
        """The layout and the safetensors header bytes (length prefix included)."""
        lay = cls(num_samples, num_tokens, hidden_size, num_aux, 0, encoding)
        metadata = {**metadata, "dtype": encoding.dtype, "scale": encoding.scale}
        header = {"__metadata__": metadata, **lay.header_tensors()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        pad = (-(8 + len(raw))) % _ALIGN
        raw += b" " * pad
        return dataclasses.replace(lay, data_start=8 + len(raw)), struct.pack("<Q", len(raw)) + raw

    @classmethod
    def read(cls, path: Path | str) -> tuple["FileLayout", dict[str, str]]:
        """Parse a store file's header (also accepts a partial file)."""
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise PipelineError(f"{path} is too short to be a store file; rerun stage 02 to redo it.")
            (n,) = struct.unpack("<Q", head)
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise PipelineError(f"{path} has a corrupt header ({e}); rerun stage 02 to redo it.") from e
        meta = header.pop("__metadata__", {}) if isinstance(header, dict) else {}
        try:
            aux, offs, final = header["aux"]["shape"], header["sample_offsets"]["shape"], header["final"]["shape"]
            enc = FP8 if "scale_log2" in header else BF16  # the tensors say which encoding the file holds
            lay = cls(offs[0] - 1, aux[0], final[1], aux[1] // final[1], 8 + n, enc)
            laid_out = lay.header_tensors() == header
        except (KeyError, IndexError, TypeError, ZeroDivisionError):
            laid_out = False
        if not laid_out:  # a file of another format version, or a header damaged into other valid JSON
            raise PipelineError(f"{path}: its header does not lay out a store file of this format "
                                f"(tensors {sorted(header) if isinstance(header, dict) else type(header).__name__}); "
                                f"rerun stage 02 to redo it.")
        return lay, meta


# --------------------------------------------------------------------------- writing


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
    """Write one sample's states at token row `row` of a partial file.

    aux: [T, A, H] or [T, A*H]; final_prenorm: [T, H] (the residual stream after all
    N layers, before the final norm: vLLM id N). Called by the hf backend and, inside
    vLLM's worker process, by the project's KV connector; samples may arrive in any
    order and from another process.
    """
    lay = layout or FileLayout.read(path)[0]
    assert not lay.encoding.scaled, f"{path}: partial files are bf16"
    T = aux.shape[0]
    aux = aux.reshape(T, -1).to(torch.bfloat16)  # [T, A, H] -> [T, A*H]
    assert aux.shape[1] == lay.num_aux * lay.hidden_size, (aux.shape, lay)
    assert final_prenorm.shape == (T, lay.hidden_size), (final_prenorm.shape, lay)
    assert 0 <= row and row + T <= lay.num_tokens, (row, T, lay.num_tokens)
    fd = os.open(path, os.O_WRONLY)
    try:
        _pwrite_all(fd, _as_bytes(aux), lay.offset("aux") + row * lay.num_aux * lay.hidden_size * 2)
        _pwrite_all(fd, _as_bytes(final_prenorm.to(torch.bfloat16)), lay.offset("final") + row * lay.hidden_size * 2)
    except OSError as e:  # only where the file could not be allocated up front (sparse)
        if is_disk_full(e):
            raise disk_full_error(path, needed=lay.total_bytes) from e
        raise
    finally:
        os.close(fd)


def file_bytes(num_samples: int, num_tokens: int, hidden_size: int, num_aux: int, store_dtype: str = "bf16") -> int:
    """Bytes of one store file, its header's metadata counted at its longest (file and
    sample numbers, layer ids): an upper bound by at most one 64-byte header padding step."""
    enc = encoding_named(store_dtype)
    meta = {"store_format": str(STORE_FORMAT), "split": "train", "file_no": str(10 ** 6),
            "first_sample": str(10 ** 12), "aux_layers": json.dumps([9999] * num_aux), "identity": "f" * 64}
    return FileLayout.build(num_samples, num_tokens, hidden_size, num_aux, meta, enc)[0].total_bytes


def bytes_to_write(files: Sequence[tuple[int, int]], hidden_size: int, num_aux: int, store_dtype: str = "bf16",
                   engines: int = 1) -> int:
    """Free bytes stage 02 needs to write `files` ((samples, tokens) of each) in `store_dtype`.

    Their sizes, plus for fp8 the bf16 partial files that exist beside them while they are
    written: per engine one being filled and one being finalized (eagle3/stages/s02_extract/run.py
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
    other = "" if enc.scaled else (f" --store-dtype fp8 needs {bytes_to_write(files, hidden_size, num_aux, 'fp8', engines):,} "
                                   f"bytes ({FP8.bytes_per_token(hidden_size, num_aux):,} B/token);")
    raise PipelineError(
        f"stage 02 needs {need:,} bytes ({need / 1e9:.2f} GB) free in {store_dir} to write {len(files)} file(s) "
        f"of {tokens:,} tokens as {enc.name} ({enc.bytes_per_token(hidden_size, num_aux):,} B/token"
        f"{', with the bf16 partial files written before each fp8 file' if enc.scaled else ''}); its file system "
        f"has {free:,} bytes ({free / 1e9:.2f} GB) free. Free space there or use a --work-dir on a larger disk;"
        f"{other} or split the files over boxes with --num-shards N --shard-index i (each box writes about 1/N). "
        f"`python -m eagle3.tools.diagnose store-size --config ...` prints the sizes.")


def file_checksum(path: Path | str, chunk: int = 64 << 20) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return f"{CHECKSUM}:{h.hexdigest()}"


def buffer_checksum(buf, chunk: int = 64 << 20) -> str:
    """`file_checksum` of a mapped file, hashed in place (no copy into Python bytes); the
    pages it touches are the ones training reads next, so the disk is read once."""
    import xxhash

    h = xxhash.xxh3_128()
    with memoryview(buf) as mv:
        for a in range(0, len(mv), chunk):
            h.update(mv[a:a + chunk])
    return f"{CHECKSUM}:{h.hexdigest()}"


def label_positions(loss_mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[T] bool: positions t whose target logits can be a training label, i.e. where
    loss_mask[t] or loss_mask[t+1] (same sample) is 1.

    Covers both alignments stage 04 may use for convention 4: the mask of the token
    the logits predict (t+1), or the mask of the logits' own position (t).
    """
    m = loss_mask.bool()
    need = m.clone()
    need[:-1] |= m[1:]
    ends = offsets[1:] - 1  # last token of each sample: its t+1 belongs to the next sample
    ends = ends[ends >= 0]
    need[ends] = m[ends]
    return need


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


def file_problem(store_dir: Path, entry: dict, *, verify_checksum: bool) -> str | None:
    """None when the file of `entry` is intact, else what is wrong with it."""
    f = store_dir / entry["name"]
    if not f.is_file():
        return f"{f} is missing"
    size = f.stat().st_size
    if size != entry["bytes"]:
        return f"{f} has {size} bytes, its index entry says {entry['bytes']} (truncated?)"
    if verify_checksum:
        got = file_checksum(f)
        if got != entry["checksum"]:
            return f"{f} has checksum {got}, its index entry says {entry['checksum']} (corrupted)"
    return None


def read_entry(store_dir: Path, split: str, file_no: int) -> dict | None:
    p = store_dir / entry_name(split, file_no)
    try:
        return json.loads(p.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_index(store_dir: Path, identity: dict, entries: list[dict], num_samples: dict[str, int],
                samples_per_file: int) -> Path:
    splits = {}
    for split, n in num_samples.items():
        files = sorted((e for e in entries if e["split"] == split), key=lambda e: e["file_no"])
        splits[split] = {"num_samples": n, "samples_per_file": samples_per_file,
                         "num_files": -(-n // samples_per_file), "files": files}
    path = store_dir / INDEX_JSON
    write_json(path, {"store_format": STORE_FORMAT, "identity": identity, "splits": splits})
    return path


# --------------------------------------------------------------------------- reading


def _views(buf, lay: FileLayout) -> dict[str, torch.Tensor]:
    """Tensors over `buf` (an mmap) without copying."""
    out = {}
    spans = lay.spans()
    for name, dtype, shape in lay.tensors():
        a, b = spans[name]
        n = (b - a) // dtype.itemsize
        t = torch.frombuffer(buf, dtype=dtype, count=n, offset=lay.data_start + a) if n else torch.zeros(0, dtype=dtype)
        out[name] = t.view(shape)
    return out


@dataclass
class Sample:
    """One sample's tensors, views into the memory-mapped file (do not write to them);
    in an fp8 store aux and final are bf16 copies, dequantised when the sample is taken.

    input_ids      int32 [T]
    loss_mask      int8  [T]   1 = assistant token carrying loss
    aux            bf16  [T, A*H]  aux layers concatenated (fc input of the drafter)
    final          bf16  [T, H]    target's final hidden state after its final norm
    target_argmax  int32 [T]   target's full-vocab argmax at t (its prediction of token t+1)
                               where loss_mask[t] or loss_mask[t+1] is 1, else -1 (no label)

    Convention 4 at position t (drafter input: aux[t], embed(input_ids[t+1]), predicts
    token t+2): the label distribution is softmax(final[t+1] @ lm_head[draft_ids].T);
    the position carries loss iff the assistant mask holds (loss_mask[t+2], the
    predicted token, is the usual choice; loss_mask[t+1] also works) and
    target_argmax[t+1] is in the draft vocab. target_argmax is present for both.
    """

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    target_argmax: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class _MappedFile:
    def __init__(self, path: Path, checksum: str | None = None, needed_by: str = "the reader",
                 encoding: Encoding = BF16, index_path: Path | None = None):
        self.path = path
        self.layout, self.meta = FileLayout.read(path)
        if self.layout.encoding != encoding:
            raise PipelineError(
                f"{needed_by}: {path} holds {self.layout.encoding.name} states ({self.layout.encoding.dtype}), "
                f"the store's index {index_path or path.parent / INDEX_JSON} says {encoding.name} "
                f"({encoding.dtype}): files of two stores were mixed (e.g. copied from a box that ran another "
                f"--store-dtype). Run every box with the same --store-dtype, then rerun `python "
                f"{WorkDir.script('extract')}` with it: it redoes the files of the other store.")
        with open(path, "rb") as f:
            # ACCESS_COPY: a private mapping, so torch gets a writable buffer (no
            # warning) while pages are still shared with the page cache until written.
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if checksum is not None:
            # Verified before any tensor view exists: a flipped byte never reaches training.
            got = buffer_checksum(self.mm)
            if got != checksum:
                self.mm.close()
                raise PipelineError(
                    f"{needed_by}: {path} has checksum {got}, its index entry says {checksum} (corrupted on disk "
                    f"or in a copy); rerun `python {WorkDir.script('extract')}` with your --config: it checks "
                    f"every file and redoes this one.")
        self.t = _views(self.mm, self.layout)
        self.offsets = self.t["sample_offsets"].tolist()


class SplitView:
    """The valid (not rejected) samples of one split, in dataset order."""

    def __init__(self, store: "HiddenStateStore", split: str, info: dict):
        self.store, self.split = store, split
        self.files = info["files"]
        self._entries = {e["file_no"]: e for e in self.files}
        self._files: dict[int, _MappedFile] = {}
        loc, ids = [], []
        for e in self.files:
            rej = set(e["rejected"])
            for j in range(e["num_samples"]):
                if j not in rej:
                    loc.append((e["file_no"], j))
                    ids.append(e["sample_ids"][j])
        self._loc = loc  # sample -> (file number, position in file)
        self.sample_ids = ids
        self.num_tokens = sum(e["num_tokens"] for e in self.files)
        self.num_rejected = sum(len(e["rejected"]) for e in self.files)
        self.num_samples_total = info["num_samples"]

    def __len__(self) -> int:
        return len(self._loc)

    def _file(self, file_no: int) -> _MappedFile:
        if file_no not in self._files:
            checksum = self._entries[file_no]["checksum"] if self.store.verify_mode == "lazy" else None
            self._files[file_no] = _MappedFile(self.store.dir / file_name(self.split, file_no), checksum,
                                               self.store.needed_by, self.store.encoding,
                                               self.store.dir / INDEX_JSON)
        return self._files[file_no]

    def location(self, i: int) -> tuple[str, int, int]:
        """(file name, token offset in the file, number of tokens) of sample i."""
        file_no, j = self._loc[i]
        mf = self._file(file_no)
        return mf.path.name, mf.offsets[j], mf.offsets[j + 1] - mf.offsets[j]

    def __getitem__(self, i: int) -> Sample:
        file_no, j = self._loc[i]
        mf = self._file(file_no)
        a, b = mf.offsets[j], mf.offsets[j + 1]
        t = mf.t
        if mf.layout.encoding.scaled:
            aux, final = _dequantized(t, a, b, mf.layout.num_aux, mf.layout.hidden_size)
        else:
            aux, final = t["aux"][a:b], t["final"][a:b]
        return Sample(self.sample_ids[i], t["input_ids"][a:b], t["loss_mask"][a:b], aux, final,
                      t["target_argmax"][a:b])

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def lengths(self) -> list[int]:
        return [self.location(i)[2] for i in range(len(self))]


def _dequantized(t: dict[str, torch.Tensor], a: int, b: int, A: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [a, b) of an fp8 file's aux and final as bf16: ([n, A*H], [n, H])."""
    n = b - a
    scale = t["scale_log2"][a:b]  # [n, A+1]
    aux = dequantize_fp8(t["aux"][a:b].view(n * A, H), scale[:, :A].reshape(n * A))  # [n*A, H]
    final = dequantize_fp8(t["final"][a:b], scale[:, A].contiguous())  # [n, H]
    return aux.view(n, A * H), final


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view (bf16 as int16): numpy copies run on one thread, with no OpenMP
    start-up per call, which dominates small copies on busy CPUs."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def collate(samples: Sequence[Sample], pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded training batch (copies into new tensors; the only copy on the read path).

    -> input_ids [B, T] int64, loss_mask [B, T] int8, attention_mask [B, T] bool,
       aux [B, T, A*H] bf16, final [B, T, H] bf16, target_argmax [B, T] int64 (-1 on padding)
    """
    B = len(samples)
    T = pad_to or max(s.num_tokens for s in samples)
    AH, H = samples[0].aux.shape[1], samples[0].final.shape[1]
    # numpy allocations (calloc: zero pages on demand) viewed as torch tensors
    dst = {
        "input_ids": np.zeros((B, T), np.int64), "loss_mask": np.zeros((B, T), np.int8),
        "attention_mask": np.zeros((B, T), np.bool_), "aux": np.zeros((B, T, AH), np.int16),
        "final": np.zeros((B, T, H), np.int16), "target_argmax": np.full((B, T), -1, np.int64),
    }
    out = {k: torch.from_numpy(v) for k, v in dst.items()}
    out["aux"], out["final"] = out["aux"].view(torch.bfloat16), out["final"].view(torch.bfloat16)
    for b, s in enumerate(samples):
        n = min(s.num_tokens, T)
        dst["input_ids"][b, :n] = _np(s.input_ids[:n])
        dst["loss_mask"][b, :n] = _np(s.loss_mask[:n])
        dst["attention_mask"][b, :n] = True
        dst["aux"][b, :n] = _np(s.aux[:n])
        dst["final"][b, :n] = _np(s.final[:n])
        dst["target_argmax"][b, :n] = _np(s.target_argmax[:n])
    return out


class HiddenStateStore:
    """Read side of the store. Open with `HiddenStateStore.open(wd, needed_by=...)`."""

    VERIFY_MODES = ("lazy", "open", "off")

    def __init__(self, store_dir: Path, index: dict, manifest: Manifest | None, *, verify: str = "lazy",
                 needed_by: str = "the reader"):
        assert verify in self.VERIFY_MODES, verify
        self.dir = Path(store_dir)
        self.index = index
        self.manifest = manifest
        self.verify_mode = verify
        self.needed_by = needed_by
        ident = index["identity"]
        self.aux_layers: list[int] = list(ident["aux_layers"])
        self.hidden_size: int = int(ident["hidden_size"])
        self.num_layers: int = int(ident["num_layers"])
        self.vocab_size: int = int(ident["vocab_size"])
        self.tokenizer_fingerprint: str = ident["tokenizer_fingerprint"]
        self.target_model: str = ident["target_model"]
        encoding = encoding_of(ident)
        if encoding is None:
            raise PipelineError(
                f"{needed_by}: {self.dir / INDEX_JSON} records stored states of dtype {ident.get('dtype')!r} with "
                f"scale {ident.get('scale', 'none')!r}; this code reads "
                f"{', '.join(f'{e.name} ({e.dtype})' for e in ENCODINGS.values())}. Run the code that wrote the "
                f"store, or rerun `python {WorkDir.script('extract')} --force --store-dtype fp8` (or bf16).")
        self.encoding: Encoding = encoding
        self.dtype = encoding.dtype
        self._splits = {s: SplitView(self, s, info) for s, info in index["splits"].items()}

    @property
    def num_aux(self) -> int:
        return len(self.aux_layers)

    @property
    def bytes_per_token(self) -> int:
        return self.encoding.bytes_per_token(self.hidden_size, self.num_aux)

    def split(self, name: str) -> SplitView:
        if name not in self._splits:
            raise PipelineError(f"{self.dir / INDEX_JSON} has no split {name!r}; it has {sorted(self._splits)}.")
        return self._splits[name]

    def missing_files(self) -> list[str]:
        out = []
        for split, info in self.index["splits"].items():
            have = {e["file_no"] for e in info["files"]}
            out += [file_name(split, k) for k in range(info["num_files"]) if k not in have]
        return out

    def verify(self) -> None:
        """Re-read every file and compare its checksum with the index (slow: reads it all)."""
        for split, info in self.index["splits"].items():
            for e in info["files"]:
                problem = file_problem(self.dir, e, verify_checksum=True)
                if problem:
                    raise PipelineError(f"{problem}; rerun `python {WorkDir.script('extract')}` to redo it.")

    @classmethod
    def open(cls, wd: WorkDir, *, needed_by: str, aux_layers: Sequence[int] | None = None,
             tokenizer_fingerprint: str | None = None, hidden_size: int | None = None,
             allow_missing: bool = False, expected_from: str = "your config",
             verify: str = "lazy") -> "HiddenStateStore":
        """Check stage 02's manifest and the expected values, then map the store.

        `aux_layers`, `tokenizer_fingerprint`, `hidden_size`: what the caller expects
        (None: accept the store's); a mismatch raises naming both values. A store with
        missing files (a box of a multi-box run not finished or not copied here) is
        refused unless `allow_missing`.

        `verify`: when the xxh3 checksums of the index are compared with the files.
        "lazy" (default): each file when it is first mapped, before any of its tensors
        is read, in place over the mapping, so the pages it reads are the ones training
        reads next (cost measured in bench/bench_store_verify.py); "open": all files now
        (reads the whole store before the first step); "off": sizes only.
        """
        m = read_manifest(wd, "extract", needed_by=needed_by)
        store_dir = wd.store()
        script = wd.script("extract")
        try:
            index = json.loads((store_dir / INDEX_JSON).read_text())
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise PipelineError(f"{needed_by}: {store_dir / INDEX_JSON} is missing or unreadable ({e}); "
                                f"rerun `python {script} --work-dir {wd.root}`.") from e
        if index.get("store_format") != STORE_FORMAT:
            raise PipelineError(f"{store_dir / INDEX_JSON} has store format {index.get('store_format')}, this "
                                f"code reads {STORE_FORMAT}; rerun `python {script} --force`.")
        ident = index["identity"]
        fix = f"rerun `python {script} --force` with the settings you want, or change {expected_from}"
        if aux_layers is not None:
            check_same("aux layer ids", list(ident["aux_layers"]), list(aux_layers),
                       ours_from=str(m.path), theirs_from=expected_from, fix=fix)
        if tokenizer_fingerprint is not None:
            check_same("tokenizer fingerprint", ident["tokenizer_fingerprint"], tokenizer_fingerprint,
                       ours_from=str(m.path), theirs_from=expected_from, fix=fix)
        if hidden_size is not None:
            check_same("target hidden size", int(ident["hidden_size"]), int(hidden_size),
                       ours_from=str(m.path), theirs_from=expected_from, fix=fix)
        if verify not in cls.VERIFY_MODES:
            raise PipelineError(f"verify={verify!r}: choose one of {', '.join(cls.VERIFY_MODES)}.")
        store = cls(store_dir, index, m, verify=verify, needed_by=needed_by)
        missing = store.missing_files()
        if missing and not allow_missing:
            raise PipelineError(
                f"{needed_by}: the store in {store_dir} lacks {len(missing)} file(s) (e.g. {missing[:3]}): "
                f"a box of a multi-box run has not finished, or its files were not copied here. Run the "
                f"missing --shard-index values (see {m.path} record.missing_shard_indices), copy all files into {store_dir}, "
                f"then rerun `python {script}` once to rebuild the index.")
        for e in (e for info in index["splits"].values() for e in info["files"]):
            problem = file_problem(store_dir, e, verify_checksum=False)
            if problem:
                raise PipelineError(f"{needed_by}: {problem}; rerun `python {script}` to redo it.")
        if verify == "open":
            store.verify()
        return store
