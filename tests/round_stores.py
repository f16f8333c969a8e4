"""Round folders of a windowed store, as stage 02 writes them (eagle3/artifacts/windows.py), in
milliseconds: store.json, index.json, window.json and a few small train files, for tests of
stage 04's side (eagle3/stages/s04_train/windows.py `Rounds`) that need no target.

    write_round(windows_dir, r, num_files=2)  -> the round's folder
    MAIN                                      the main store as `Rounds` reads it (its identity)

Imported as a top-level module by tests in tests/unit and by tests/collectives_worker.py.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from eagle3.artifacts import store, windows
from eagle3.artifacts.manifest import sha256_json

H, LAYERS = 8, [1, 2, 3]
SAMPLES_PER_FILE, TOKENS = 2, 5
IDENTITY = {"store_format": store.STORE_FORMAT, "aux_layers": LAYERS, "hidden_size": H, "num_layers": 5,
            "vocab_size": 50, "tokenizer_fingerprint": "t", "target_model": "m", **store.identity_fields("bf16")}
MAIN = SimpleNamespace(index={"identity": IDENTITY})


def write_round(wdir: Path, r: int, num_files: int = 2) -> Path:
    """Round r's complete folder under `wdir`: `num_files` train files of 2 samples of 5 tokens."""
    d = Path(wdir) / windows.round_name(r)
    d.mkdir(parents=True)
    n = num_files * SAMPLES_PER_FILE
    ident = {**IDENTITY, "num_samples": {"train": n, "eval": 0}, "round": r, "window": r}
    h = sha256_json(ident)
    entries = []
    for k in range(num_files):
        partial = d / store.partial_name("train", k)
        ids = [[(7 * k + 3 * j + t) % 50 for t in range(TOKENS)] for j in range(SAMPLES_PER_FILE)]
        lay = store.create_partial_file(partial, split="train", file_no=k, first_sample=k * SAMPLES_PER_FILE,
                                        input_ids=ids, loss_masks=[[1] * TOKENS] * SAMPLES_PER_FILE,
                                        hidden_size=H, aux_layers=LAYERS, identity_hash=h)
        for j in range(SAMPLES_PER_FILE):
            g = torch.Generator().manual_seed(100 * r + 10 * k + j)
            store.write_sample_states(partial, j * TOKENS, torch.randn(TOKENS, 3, H, generator=g),
                                      torch.randn(TOKENS, H, generator=g), lay)
        entries.append(store.finalize_file(partial, d / store.file_name("train", k), split="train", file_no=k,
                                           first_sample=k * SAMPLES_PER_FILE,
                                           sample_ids=[f"r{r}-{k}-{j}" for j in range(SAMPLES_PER_FILE)],
                                           identity_hash=h, normalize=lambda x: x,
                                           argmax=lambda x: torch.zeros(x.shape[0], dtype=torch.int64)))
    store.write_index(d, ident, entries, {"train": n, "eval": 0}, samples_per_file=SAMPLES_PER_FILE)
    windows.write_complete(d, {"round": r, "window": r, "pass": 0, "num_samples": n, "identity_hash": h,
                               "files": [{k: e[k] for k in ("name", "bytes", "checksum")} for e in entries]})
    return d


def flip_a_byte(path: Path) -> None:
    """Change one byte near the end of `path` (its size stays): only a checksum sees it."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
