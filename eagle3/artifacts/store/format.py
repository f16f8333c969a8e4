"""The hidden-state store's format: file names, encodings, file layout, identity.

What stage 02 writes (eagle3/artifacts/store/writer.py) and stage 04 and the tools read
(eagle3/artifacts/store/reader.py) agree on through this module alone; it reads and writes
only store.json (the identity) and file headers. All store file names live here,
inside `WorkDir.store()` (`WORK/02_hidden_states/`):

    store.json                 THE identity of the store (layers, hidden size, tokenizer,
                               encoding, ...): its one source, written once before the first
                               file (`write_identity`); a rerun with other settings is refused
                               until --force. Read with `read_identity`.
    {split}-{nnnnn}.safetensors one file of `samples_per_file` consecutive samples of a split
    {split}-{nnnnn}.json        its index entry: sample ids, byte size, xxh3-128 checksum,
                               rejected (NaN/Inf) samples, the identity's hash; written after the
                               file is renamed, so a file without one is incomplete.
    index.json                 all entries of the files present and the identity's hash
                               (`identity_hash`, sha256 of store.json's content, as in every file
                               header and entry), written with the manifest. An index.json of
                               earlier code holds a copy of the identity instead of its hash; the
                               reader accepts it when the copy equals store.json.
    .{split}-{nnnnn}.partial-{writer}  a file being written by process `writer` (host-pid; never
                               read; removed by the next run that holds the folder's claim).
    .{split}-{nnnnn}.partial-{writer}.out  fp8 only: the compact file being written from the
                               partial one (never read; removed likewise).
    .claim.json, .claim-*.beat  the claim of the stage 02 run writing the folder, and its
                               heartbeat (eagle3/artifacts/claims.py): one writer at a time.

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
`store_dtype` and recorded in store.json (the identity), stage 02's manifest and every
file's header (`dtype`, `scale`):

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
(`write_sample_states`, which then sets the sample's byte of `valid`: in a partial file that
column records which samples were written, and `finalize_file` refuses a file with a sample
never written, whose zero states would otherwise pass for data under a valid checksum);
`finalize_file` then applies the final norm, computes the
argmax (from the bf16 final state, for every encoding: both stores hold the same
target argmax), rejects non-finite samples, and either keeps the file (bf16) or writes
the fp8 file beside it, then checksums and renames.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3.artifacts.atomic import write_json
from eagle3.artifacts.manifest import sha256_json
from eagle3.core.errors import PipelineError

__all__ = ['STORE_FORMAT', 'STORE_JSON', 'INDEX_JSON', 'CHECKSUM', 'STORE_DTYPE', 'FINALIZE_CHUNK_ELEMS', 'FP8_DTYPE',
           'FP8_HEADROOM_BITS', 'SCALE_LOG2_MIN', 'SCALE_LOG2_MAX', 'file_name', 'entry_name', 'FILE_NAME_PATTERN',
           'is_file_name', 'partial_name', 'out_name', 'Encoding', 'BF16', 'FP8', 'ENCODINGS', 'encoding_named',
           'encoding_of', 'identity_fields',
           'encoding_fields', 'bytes_per_token', 'identity_hash', 'write_identity', 'read_identity', 'quantize_fp8',
           'dequantize_fp8', 'FileLayout', 'file_bytes', 'file_checksum', 'buffer_checksum', 'label_positions',
           'file_problem']

STORE_FORMAT = 1  # version of the file layout and index; the encoding is recorded beside it
STORE_JSON = "store.json"
INDEX_JSON = "index.json"
CHECKSUM = "xxh3_128"
STORE_DTYPE = "bfloat16"  # dtype of the reference encoding (bf16); each store records its own `dtype`
FINALIZE_CHUNK_ELEMS = 1 << 24  # aux+final elements per finalize step (~64 MB as float32)
_ALIGN = 64  # data section starts at a multiple of this (safetensors allows header padding)
_ST_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.bfloat16: "BF16",
              torch.float8_e4m3fn: "F8_E4M3"}
FP8_DTYPE = torch.float8_e4m3fn
FP8_HEADROOM_BITS = 8  # scaled magnitudes stay below 2**8 <= 448, e4m3's largest value
SCALE_LOG2_MIN, SCALE_LOG2_MAX = -126, 126  # 2**e and 2**-e are both normal float32 numbers


def file_name(split: str, file_no: int) -> str:
    return f"{split}-{file_no:05d}.safetensors"


def entry_name(split: str, file_no: int) -> str:
    return f"{split}-{file_no:05d}.json"


# What a store file's name looks like (`file_name`): names read from an index entry or a
# round's window.json are accepted only when they match, so none can point outside the folder.
FILE_NAME_PATTERN = r"(?:train|eval)-\d{5,}\.safetensors"


def is_file_name(name) -> bool:
    return isinstance(name, str) and re.fullmatch(FILE_NAME_PATTERN, name) is not None


def partial_name(split: str, file_no: int, writer: str = "") -> str:
    """The file being written; `writer` (`claims.writer_name()`: host and pid) names the process
    writing it, so no two processes ever write, remove or finalize the same partial file."""
    return f".{split}-{file_no:05d}.partial" + (f"-{writer}" if writer else "")


def out_name(partial: Path) -> Path:
    """Where finalize writes a compact (fp8) file from the bf16 partial file `partial`."""
    return partial.with_name(partial.name + ".out")


# --------------------------------------------------------------------------- encodings


@dataclass(frozen=True)
class Encoding:
    """How a store file holds aux and final (the module docstring says why fp8 is scaled so)."""

    name: str  # stage 02's `store_dtype` value
    dtype: str  # recorded as `dtype` in store.json, stage 02's manifest and file headers
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


# --------------------------------------------------------------------------- identity


def identity_hash(identity: dict) -> str:
    """The identity as every file header (`identity`), index entry (`identity`) and index.json
    (`identity_hash`) records it: sha256 of its JSON. A file is part of a store iff it holds its hash."""
    return sha256_json(identity)


def write_identity(store_dir: Path, identity: dict) -> Path:
    """Write store.json, the store's identity: once, before its first file."""
    path = Path(store_dir) / STORE_JSON
    write_json(path, identity)
    return path


def read_identity(store_dir: Path, *, needed_by: str, fix: str) -> dict:
    """The store's identity (store.json), its one source; `fix`: the rerun that rewrites it."""
    path = Path(store_dir) / STORE_JSON
    try:
        identity = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise PipelineError(f"{needed_by}: {path}, the store's identity, is missing or unreadable ({e}); {fix}.") from e
    if not isinstance(identity, dict):
        raise PipelineError(f"{needed_by}: {path} holds {type(identity).__name__}, not the store's identity; {fix}.")
    return identity


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
            states = [("aux", FP8_DTYPE, (T, A * H)), ("final", FP8_DTYPE, (T, H)),
                      ("scale_log2", torch.int8, (T, A + 1))]
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




def file_bytes(num_samples: int, num_tokens: int, hidden_size: int, num_aux: int, store_dtype: str = "bf16") -> int:
    """Bytes of one store file, its header's metadata counted at its longest (file and
    sample numbers, layer ids): an upper bound by at most one 64-byte header padding step."""
    enc = encoding_named(store_dtype)
    meta = {"store_format": str(STORE_FORMAT), "split": "train", "file_no": str(10 ** 6),
            "first_sample": str(10 ** 12), "aux_layers": json.dumps([9999] * num_aux), "identity": "f" * 64}
    return FileLayout.build(num_samples, num_tokens, hidden_size, num_aux, meta, enc)[0].total_bytes



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



def file_problem(store_dir: Path, entry: dict, *, verify_checksum: bool) -> str | None:
    """None when the file of `entry` is intact, else what is wrong with it."""
    if not is_file_name(entry.get("name")):
        return (f"{store_dir} lists a file named {entry.get('name')!r}, not a store file name "
                f"({FILE_NAME_PATTERN}): refused unread (an index or window.json of another program, or damaged)")
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


