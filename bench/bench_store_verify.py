"""What checking the store's xxh3 checksums costs stage 04, against what reading the store costs.

    python bench/bench_store_verify.py [--hidden 1024] [--tokens 40000] [--files 8]

Writes a synthetic store (3 aux layers, bf16, random states) of `--files` files, then
on a warm page cache:
  1. verification alone: `buffer_checksum` over each mapped file (what the reader does
     lazily before a file's first read) and `file_checksum` (read into memory, what
     stage 02 and `verify="open"` do), in GB/s;
  2. one pass of training-shaped reads (samples into padded batches with
     `eagle3.artifacts.store.collate`, shuffled) with `verify="off"` and with the default
     `verify="lazy"`, in GB/s of store bytes; the difference is the first epoch's
     cost of the check (later epochs reuse the mapped, verified files: zero).
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3.artifacts import store# noqa: E402


def build(d: Path, hidden: int, tokens: int, files: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    per_file = tokens // files
    entries, first = [], 0
    for k in range(files):
        lengths = []
        while sum(lengths) < per_file:
            lengths.append(int(rng.integers(64, 512)))
        ids = [rng.integers(0, 1000, n).astype(np.int32) for n in lengths]
        masks = [np.ones(n, np.int8) for n in lengths]
        partial = d / store.partial_name("train", k)
        lay = store.create_partial_file(partial, split="train", file_no=k, first_sample=first, input_ids=ids,
                                        loss_masks=masks, hidden_size=hidden, aux_layers=[2, 4, 6], identity_hash="b")
        row = 0
        for n in lengths:
            store.write_sample_states(partial, row, torch.randn(n, 3, hidden, generator=g),
                                      torch.randn(n, hidden, generator=g), lay)
            row += n
        entries.append(store.finalize_file(partial, d / store.file_name("train", k), split="train", file_no=k,
                                           first_sample=first, sample_ids=[f"s{first + i}" for i in range(len(lengths))],
                                           identity_hash="b", normalize=lambda x: x,
                                           argmax=lambda x: torch.zeros(x.shape[0], dtype=torch.int64)))
        first += len(lengths)
    return entries


def open_store(d: Path, entries: list[dict], hidden: int, verify: str) -> store.HiddenStateStore:
    n = sum(e["num_samples"] for e in entries)
    index = {"store_format": store.STORE_FORMAT,
             "identity": {"aux_layers": [2, 4, 6], "hidden_size": hidden, "num_layers": 8, "vocab_size": 1000,
                          "tokenizer_fingerprint": "t", "target_model": "m"},
             "splits": {"train": {"num_samples": n, "samples_per_file": n, "num_files": len(entries),
                                  "files": entries}}}
    return store.HiddenStateStore(d, index, None, verify=verify, needed_by="bench")


def read_pass(s: store.HiddenStateStore, batch_tokens: int = 8192) -> float:
    split = s.split("train")
    lengths = _lengths(s)  # untimed, and maps no file (the lazy check happens inside the pass)
    order = list(range(len(split)))
    random.Random(0).shuffle(order)
    t0 = time.perf_counter()
    batch, longest = [], 0
    for i in order + [None]:
        if i is None or (batch and max(longest, lengths[i]) * (len(batch) + 1) > batch_tokens):
            store.collate([split[j] for j in batch])
            batch, longest = [], 0
        if i is not None:
            batch.append(i)
            longest = max(longest, lengths[i])
    return time.perf_counter() - t0


def _lengths(s: store.HiddenStateStore) -> list[int]:
    # sample lengths from the index sizes, without mapping (and so verifying) any file first
    out = []
    for e in s.split("train").files:
        lay, _ = store.FileLayout.read(s.dir / e["name"])
        with open(s.dir / e["name"], "rb") as f:
            f.seek(lay.offset("sample_offsets"))
            offs = np.frombuffer(f.read(8 * (lay.num_samples + 1)), dtype=np.int64)
        out += np.diff(offs).tolist()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        entries = build(d, a.hidden, a.tokens, a.files)
        total = sum(e["bytes"] for e in entries)
        tokens = sum(e["num_tokens"] for e in entries)
        paths = [d / e["name"] for e in entries]
        for p in paths:  # warm the page cache: the figures compare CPU costs, not the disk
            p.read_bytes()

        def best(fn) -> float:
            return min(fn() for _ in range(a.repeats))

        def mapped() -> float:
            import mmap
            t0 = time.perf_counter()
            for p in paths:
                with open(p, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                    store.buffer_checksum(mm)
                    mm.close()
            return time.perf_counter() - t0

        def readfile() -> float:
            t0 = time.perf_counter()
            for p in paths:
                store.file_checksum(p)
            return time.perf_counter() - t0

        t_map, t_read = best(mapped), best(readfile)
        t_off = best(lambda: read_pass(open_store(d, entries, a.hidden, "off")))
        t_lazy = best(lambda: read_pass(open_store(d, entries, a.hidden, "lazy")))
        gb = total / 1e9
        print(f"\n== store checksum cost: {len(entries)} files, {total / 1e6:.0f} MB, {tokens} tokens, hidden "
              f"{a.hidden}, {store.bytes_per_token(a.hidden, 3)} B/token, warm page cache, best of {a.repeats}")
        print(f"xxh3 over the mapped file (lazy check):  {gb / t_map:6.2f} GB/s")
        print(f"xxh3 over read() chunks (stage 02):      {gb / t_read:6.2f} GB/s")
        print(f"training-shaped read pass, verify=off:   {gb / t_off:6.2f} GB/s  ({tokens / t_off:,.0f} tokens/s)")
        print(f"training-shaped read pass, verify=lazy:  {gb / t_lazy:6.2f} GB/s  (first epoch "
              f"{100 * (t_lazy - t_off) / t_off:+.0f}% time; later epochs: no check)")


if __name__ == "__main__":
    main()
