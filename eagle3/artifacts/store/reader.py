"""The store's read side: `HiddenStateStore.open`, the one reader of the store.

Stage 04, `tools/diagnose/probe_hidden.py`, `tools/check_stores.py` and `tools/forecast.py` open the
store with `HiddenStateStore.open(workdir, needed_by=...)`: it checks stage 02's manifest,
the identity (store.json, eagle3/artifacts/store/format.py) against what the caller expects
and the index against the identity, then memory-maps each file when it is first read
and verifies its checksum before any tensor of it is handed out. `collate` pads
samples into a training batch.
"""
from __future__ import annotations

import json
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from eagle3.artifacts.manifest import Manifest, check_same, read_manifest
# buffer_checksum is looked up through its module at call time, so a test can count the calls
from eagle3.artifacts.store import format as store_format
from eagle3.artifacts.store.format import (BF16, ENCODINGS, FP8_DTYPE, INDEX_JSON, STORE_FORMAT, STORE_JSON, Encoding,
                                           FileLayout, _pow2, _views, dequantize_fp8, encoding_of, file_name,
                                           file_problem, identity_hash, read_identity)
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError

__all__ = ['Sample', 'SplitView', 'collate', 'decode_states', 'HiddenStateStore', 'index_identity']


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

    `SplitView.encoded(i)` of an fp8 store leaves aux and final as the file's e4m3 codes
    (views, [T, A*H] and [T, H]) with `scale_log2` int8 [T, A+1]; `decode_states` turns
    a batch of them into bf16 on whatever device it lies (stage 04 decodes on the GPU).
    """

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    target_argmax: torch.Tensor
    scale_log2: torch.Tensor | None = None  # fp8, not decoded (`SplitView.encoded`) only

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class _MappedFile:
    def __init__(self, path: Path, checksum: str | None = None, needed_by: str = "the reader",
                 encoding: Encoding = BF16, identity_path: Path | None = None):
        self.path = path
        self.layout, self.meta = FileLayout.read(path)
        if self.layout.encoding != encoding:
            raise PipelineError(
                f"{needed_by}: {path} holds {self.layout.encoding.name} states ({self.layout.encoding.dtype}), "
                f"the store's identity {identity_path or path.parent / STORE_JSON} says {encoding.name} "
                f"({encoding.dtype}): files of two stores were mixed (e.g. copied from a box that ran another "
                f"--store-dtype). Run every box with the same --store-dtype, then rerun `python "
                f"{WorkDir.script('extract')}` with it: it redoes the files of the other store.")
        with open(path, "rb") as f:
            # ACCESS_COPY: a private mapping, so torch gets a writable buffer (no
            # warning) while pages are still shared with the page cache until written.
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if checksum is not None:
            # Verified before any tensor view exists: a flipped byte never reaches training.
            got = store_format.buffer_checksum(self.mm)
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
                                               self.store.dir / STORE_JSON)
        return self._files[file_no]

    def location(self, i: int) -> tuple[str, int, int]:
        """(file name, token offset in the file, number of tokens) of sample i."""
        file_no, j = self._loc[i]
        mf = self._file(file_no)
        return mf.path.name, mf.offsets[j], mf.offsets[j + 1] - mf.offsets[j]

    def __getitem__(self, i: int) -> Sample:
        return self._sample(i, decode=True)

    def encoded(self, i: int) -> Sample:
        """Sample i as the file holds it: in an fp8 store aux and final stay e4m3 codes with
        their `scale_log2` (a quarter of the bytes of the float32 detour, half of bf16's)."""
        return self._sample(i, decode=False)

    def _sample(self, i: int, decode: bool) -> Sample:
        file_no, j = self._loc[i]
        mf = self._file(file_no)
        a, b = mf.offsets[j], mf.offsets[j + 1]
        t = mf.t
        scale = None
        if mf.layout.encoding.scaled and decode:
            aux, final = _dequantized(t, a, b, mf.layout.num_aux, mf.layout.hidden_size)
        else:
            aux, final = t["aux"][a:b], t["final"][a:b]
            scale = t["scale_log2"][a:b] if mf.layout.encoding.scaled else None
        return Sample(self.sample_ids[i], t["input_ids"][a:b], t["loss_mask"][a:b], aux, final,
                      t["target_argmax"][a:b], scale)

    def file_names(self, indices: Sequence[int]) -> list[str]:
        """The files samples `indices` lie in (without mapping them), for error messages."""
        return sorted({file_name(self.split, self._loc[i][0]) for i in indices})

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


_NUMPY_VIEWS = {torch.bfloat16: torch.int16, FP8_DTYPE: torch.uint8}  # dtypes numpy lacks, by their bits


def _np(t: torch.Tensor) -> np.ndarray:
    """A numpy view (bf16 as int16, e4m3 as uint8): numpy copies run on one thread, with no
    OpenMP start-up per call, which dominates small copies on busy CPUs."""
    return (t.view(_NUMPY_VIEWS[t.dtype]) if t.dtype in _NUMPY_VIEWS else t).numpy()


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=_NUMPY_VIEWS.get(dtype, dtype)).numpy().dtype


def collate(samples: Sequence[Sample], pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded training batch (copies into new tensors; the only copy on the read path).

    -> input_ids [B, T] int64, loss_mask [B, T] int8, attention_mask [B, T] bool,
       aux [B, T, A*H] bf16, final [B, T, H] bf16, target_argmax [B, T] int64 (-1 on padding)
    Samples of `SplitView.encoded` (fp8): aux and final stay e4m3 codes, plus
    scale_log2 [B, T, A+1] int8 (padding: code 0, scale 0, i.e. zeros once decoded).
    """
    B = len(samples)
    T = pad_to or max(s.num_tokens for s in samples)
    s0 = samples[0]
    AH, H, states = s0.aux.shape[1], s0.final.shape[1], s0.aux.dtype
    # numpy allocations (calloc: zero pages on demand) viewed as torch tensors
    dst = {
        "input_ids": np.zeros((B, T), np.int64), "loss_mask": np.zeros((B, T), np.int8),
        "attention_mask": np.zeros((B, T), np.bool_), "aux": np.zeros((B, T, AH), _np_dtype(states)),
        "final": np.zeros((B, T, H), _np_dtype(states)), "target_argmax": np.full((B, T), -1, np.int64),
    }
    if s0.scale_log2 is not None:
        dst["scale_log2"] = np.zeros((B, T, s0.scale_log2.shape[1]), np.int8)
    out = {k: torch.from_numpy(v) for k, v in dst.items()}
    out["aux"], out["final"] = out["aux"].view(states), out["final"].view(states)
    for b, s in enumerate(samples):
        n = min(s.num_tokens, T)
        dst["input_ids"][b, :n] = _np(s.input_ids[:n])
        dst["loss_mask"][b, :n] = _np(s.loss_mask[:n])
        dst["attention_mask"][b, :n] = True
        dst["aux"][b, :n] = _np(s.aux[:n])
        dst["final"][b, :n] = _np(s.final[:n])
        dst["target_argmax"][b, :n] = _np(s.target_argmax[:n])
        if s.scale_log2 is not None:
            dst["scale_log2"][b, :n] = _np(s.scale_log2[:n])
    return out


def decode_states(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch of encoded fp8 samples (`collate` of `SplitView.encoded`, on any device) with
    aux and final as bf16, scale_log2 dropped; other batches as they are.

    aux [..., A*H] e4m3 + scale_log2 [..., A+1] -> aux [..., A*H] bf16; final likewise with
    the last scale. The values equal `dequantize_fp8`'s (an e4m3 code times a power of two
    is exact in float32 and in bf16, whichever path computes it); one aux layer at a time,
    so the float32 temporary is [..., H].
    """
    if "scale_log2" not in batch:
        return batch
    out = dict(batch)
    scale = out.pop("scale_log2")  # [..., A+1]
    aux, final = out["aux"], out["final"]
    H = final.shape[-1]
    A = aux.shape[-1] // H
    dec = torch.empty(aux.shape, dtype=torch.bfloat16, device=aux.device)  # [..., A*H]
    for k in range(A):
        block = slice(k * H, (k + 1) * H)
        dec[..., block] = (aux[..., block].to(torch.float32) * _pow2(scale[..., k])[..., None]).to(torch.bfloat16)
    out["aux"] = dec
    out["final"] = (final.to(torch.float32) * _pow2(scale[..., A])[..., None]).to(torch.bfloat16)  # [..., H]
    return out


class HiddenStateStore:
    """Read side of the store. Open with `HiddenStateStore.open(workdir, needed_by=...)`."""

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
                f"{needed_by}: {self.dir / STORE_JSON} records stored states of dtype {ident.get('dtype')!r} with "
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
    def open(cls, workdir: WorkDir, *, needed_by: str, aux_layers: Sequence[int] | None = None,
             tokenizer_fingerprint: str | None = None, hidden_size: int | None = None,
             allow_missing: bool = False, expected_from: str | Mapping[str, str] = "your config",
             verify: str = "lazy") -> "HiddenStateStore":
        """Check stage 02's manifest and the expected values, then map the store.

        `aux_layers`, `tokenizer_fingerprint`, `hidden_size`: what the caller expects
        (None: accept the store's); a mismatch raises naming both values and where each
        comes from: the store's from its identity (store.json, not the manifest), the
        expected one from `expected_from` (one label for all, or one per argument name).
        A store with missing files (a box of a multi-box run not finished or not copied
        here) is refused unless `allow_missing`.

        `verify`: when the xxh3 checksums of the index are compared with the files.
        "lazy" (default): each file when it is first mapped, before any of its tensors
        is read, in place over the mapping, so the pages it reads are the ones training
        reads next (cost measured in bench/bench_store_verify.py); "open": all files now
        (reads the whole store before the first step); "off": sizes only.
        """
        m = read_manifest(workdir, "extract", needed_by=needed_by)
        store_dir = workdir.store()
        script = workdir.script("extract")
        try:
            index = json.loads((store_dir / INDEX_JSON).read_text())
        except (FileNotFoundError, json.JSONDecodeError) as e:
            raise PipelineError(f"{needed_by}: {store_dir / INDEX_JSON} is missing or unreadable ({e}); "
                                f"rerun `python {script} --work-dir {workdir.root}`.") from e
        if index.get("store_format") != STORE_FORMAT:
            raise PipelineError(f"{store_dir / INDEX_JSON} has store format {index.get('store_format')}, this "
                                f"code reads {STORE_FORMAT}; rerun `python {script} --force`.")
        ident = read_identity(store_dir, needed_by=needed_by, fix=f"rerun `python {script} --force`")
        index = {**index, "identity": index_identity(index, ident, store_dir, needed_by=needed_by, script=script)}
        ours = str(store_dir / STORE_JSON)

        def same(what: str, have, want, key: str) -> None:
            theirs = expected_from if isinstance(expected_from, str) else expected_from[key]
            check_same(what, have, want, ours_from=ours, theirs_from=theirs,
                       fix=f"rerun `python {script} --force` with the settings you want, or change {theirs}")

        if aux_layers is not None:
            same("aux layer ids", list(ident["aux_layers"]), list(aux_layers), "aux_layers")
        if tokenizer_fingerprint is not None:
            same("tokenizer fingerprint", ident["tokenizer_fingerprint"], tokenizer_fingerprint,
                 "tokenizer_fingerprint")
        if hidden_size is not None:
            same("target hidden size", int(ident["hidden_size"]), int(hidden_size), "hidden_size")
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



def index_identity(index: dict, identity: dict, store_dir: Path, *, needed_by: str, script: str) -> dict:
    """`identity` (store.json's) once index.json is shown to list files of it: by its hash, or
    in an index.json of earlier code by a copy of the identity equal to it. Refused otherwise."""
    if "identity_hash" in index:
        same, theirs = index["identity_hash"] == identity_hash(identity), f"identity hash {index['identity_hash']}"
    elif isinstance(index.get("identity"), dict):  # written before the index named the identity by its hash
        same, theirs = index["identity"] == identity, "a copy of another identity"
    else:
        same, theirs = False, "no identity"
    if not same:
        raise PipelineError(
            f"{needed_by}: {store_dir / INDEX_JSON} holds {theirs}, not that of {store_dir / STORE_JSON} "
            f"(hash {identity_hash(identity)}): the index and the identity come from two stores (files copied "
            f"from another work dir?). Rerun `python {script}` to rebuild the index from the files of this "
            f"store, or `python {script} --force` to start over.")
    return identity
