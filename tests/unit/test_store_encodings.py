"""The store's encodings and integrity checks on synthetic files (eagle3/artifacts/store/format.py,
writer.py, reader.py), no model: the fp8 quantiser's bounds and exact decode (values, both
decode paths, threads), bytes per token, the fp8 file layout, a killed finalize, files of
two encodings mixed, `file_bytes`, `require_free_space`, checksums over several chunks and
`file_problem` on a file that changed size. Stage 02 writing such stores on the tiny Llama:
tests/stages/test_store_format.py."""
from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from eagle3.artifacts import store
from eagle3.core.errors import PipelineError

H, A = 32, 3
DiskUsage = namedtuple("DiskUsage", "total used free")
IDENTITY = "e" * 64  # the length of stage 02's identity hash (sha256 hex)


# --------------------------------------------------------------------------- the quantiser


def test_fp8_scales_are_powers_of_two_that_never_saturate():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows over 6 decades
    x[5, 17] = 4000.0  # a massive activation in one channel
    x[9] = 0.0  # a zeroed (rejected or padding) row
    q, e = store.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and e.dtype == torch.int8 and q.shape == x.shape and e.shape == (64,)
    peak = q.float().abs().amax(-1)  # [R] largest scaled magnitude per row
    live = peak > 0
    # 2**7 <= scaled max < 2**8 before rounding (which may reach 2**8): far below e4m3's 448, no saturation
    assert ((peak[live] >= 128) & (peak[live] <= 256)).all()
    assert (q[9].float() == 0).all()
    deq = store.dequantize_fp8(q, e)  # [R, H] bf16
    scale = torch.tensor([2.0 ** int(v) for v in e])[:, None]  # [R, 1] exact powers of two
    # Exact: 4 significant bits times a power of two fit bf16 (the definition, in exact arithmetic).
    assert torch.equal(deq.float(), q.float() * scale)
    # e4m3 rounds to 3 mantissa bits: at most 2**-4 relative where the scaled value is normal
    # (>= 2**-6), at most half the subnormal step (2**-10 scaled) below that.
    err = (deq.float() - x).abs()
    normal = x.abs() >= 2.0 ** -6 * scale
    assert (err[normal] <= 2.0 ** -4 * x.abs()[normal]).all()
    assert (err[~normal] <= 2.0 ** -10 * scale.expand_as(x)[~normal]).all()
    assert abs(deq[5, 17].item() - 4000.0) <= 4000.0 / 16
    rel = (deq.float() - x).norm(dim=-1)[live] / x.norm(dim=-1)[live]  # per-row relative L2
    assert rel.max().item() < 0.05
    # Rows at the ends of the float range take the float path instead of the exponent add: same definition.
    y = torch.randn(4, 256, generator=g) * torch.tensor([1e-36, 1e-30, 1e30, 1.0])[:, None]
    q, e = store.quantize_fp8(y)
    assert int(e.min()) < -117  # outside the exponent-add range
    scale = torch.tensor([2.0 ** int(v) for v in e])[:, None]
    assert torch.equal(store.dequantize_fp8(q, e).float(), (q.float() * scale).to(torch.bfloat16).float())


def test_fp8_decode_split_over_threads_equals_one_thread(monkeypatch):
    """Large reads are decoded by several threads, each its share of rows: integer table
    look-ups and adds, so the result is the one-thread result bit for bit."""
    x = torch.randn(1500, 1024, generator=torch.Generator().manual_seed(3)) * 7  # 1.5M values: above the threshold
    x[11] = 0.0
    q, e = store.quantize_fp8(x)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = store.dequantize_fp8(q, e)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    three = store.dequantize_fp8(q, e)
    assert torch.equal(one, three) and (three[11] == 0).all()
    scale = torch.tensor([2.0 ** int(v) for v in e])[:, None]
    assert torch.equal(three.float(), q.float() * scale)


def test_bytes_per_token_meet_the_goal_at_both_widths():
    for hidden in (576, 7168):  # SmolLM2, Kimi-K2.5
        assert store.bytes_per_token(hidden, 3) == 8 * hidden + 9
        assert store.bytes_per_token(hidden, 3, "fp8") == 4 * hidden + 13 <= 4 * hidden + 16
    assert store.bytes_per_token(7168, 3, "fp8") == 28685 and store.bytes_per_token(576, 3, "fp8") == 2317
    with pytest.raises(PipelineError, match=r"store_dtype 'fp4' is not one of bf16, fp8 \(--store-dtype\)"):
        store.bytes_per_token(576, 3, "fp4")


def test_config_choices_are_the_store_encodings():
    from eagle3.stages.s02_extract.config import STORE_DTYPES

    assert STORE_DTYPES == tuple(store.ENCODINGS)


# --------------------------------------------------------------------------- fp8 files


def _norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


LM_HEAD = torch.randn(50, H, generator=torch.Generator().manual_seed(1))


def _argmax(h):
    return (h.float() @ LM_HEAD.T).argmax(-1)


def _partial(d: Path, lengths: list[int], file_no: int = 0) -> tuple[Path, list]:
    g = np.random.default_rng(file_no)
    ids = [g.integers(0, 50, n).astype(np.int32) for n in lengths]
    masks = [(g.random(n) < 0.6).astype(np.int8) for n in lengths]
    partial = d / store.partial_name("train", file_no)
    lay = store.create_partial_file(partial, split="train", file_no=file_no, first_sample=0, input_ids=ids,
                                    loss_masks=masks, hidden_size=H, aux_layers=[1, 2, 3], identity_hash=IDENTITY)
    row, states = 0, []
    for i, n in enumerate(lengths):
        gen = torch.Generator().manual_seed(10 * file_no + i)
        aux, pre = torch.randn(n, A, H, generator=gen) * 4, torch.randn(n, H, generator=gen) * 3
        store.write_sample_states(partial, row, aux, pre, lay)
        states.append((aux, pre))
        row += n
    return partial, states


def _finalize(partial: Path, store_dtype: str, file_no: int = 0) -> dict:
    return store.finalize_file(partial, partial.parent / store.file_name("train", file_no), split="train",
                               file_no=file_no, first_sample=0, sample_ids=["a", "b", "c"], identity_hash=IDENTITY,
                               normalize=_norm, argmax=_argmax, store_dtype=store_dtype)


def _index(entries: list[dict], store_dtype: str) -> dict:
    ident = {"aux_layers": [1, 2, 3], "hidden_size": H, "num_layers": 5, "vocab_size": 50,
             "tokenizer_fingerprint": "t", "target_model": "m", **store.identity_fields(store_dtype)}
    n = sum(e["num_samples"] for e in entries)
    return {"store_format": store.STORE_FORMAT, "identity": ident,
            "splits": {"train": {"num_samples": n, "samples_per_file": n, "num_files": len(entries),
                                 "files": entries}}}


def test_fp8_file_layout_header_and_values(tmp_path):
    lengths = [6, 11, 3]
    T, S = sum(lengths), len(lengths)
    (tmp_path / "b").mkdir()
    (tmp_path / "f").mkdir()
    ref = _finalize(_partial(tmp_path / "b", lengths)[0], "bf16")
    partial, states = _partial(tmp_path / "f", lengths)
    entry = _finalize(partial, "fp8")
    path = tmp_path / "f" / entry["name"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["train-00000.json", "train-00000.safetensors"]
    # Plain safetensors, the encoding in its header; bytes per token as documented.
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert meta["dtype"] == "float8_e4m3fn" and meta["scale"] == store.FP8.scale and meta["identity"] == IDENTITY
    assert dtypes == {"sample_offsets": "I64", "target_argmax": "I32", "input_ids": "I32", "aux": "F8_E4M3",
                      "final": "F8_E4M3", "scale_log2": "I8", "loss_mask": "I8", "valid": "I8"}
    lay = store.FileLayout.read(path)[0]
    assert lay.encoding is store.FP8 and lay.data_start % 64 == 0
    assert lay.data_bytes == T * store.bytes_per_token(H, A, "fp8") + 8 * (S + 1) + S
    assert entry["bytes"] == path.stat().st_size < ref["bytes"]

    bf = store.HiddenStateStore(tmp_path / "b", _index([ref], "bf16"), None).split("train")
    f8 = store.HiddenStateStore(tmp_path / "f", _index([entry], "fp8"), None).split("train")
    for i in range(S):
        x, y = bf[i], f8[i]
        assert y.aux.dtype == y.final.dtype == torch.bfloat16 and y.aux.shape == (lengths[i], A * H)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        # Both encodings take the argmax from the same bf16 normed state: the same computation.
        assert torch.equal(x.target_argmax, y.target_argmax)
        aux = states[i][0].reshape(lengths[i] * A, H)  # [T, A, H] -> [T*A, H]
        rel = (y.aux.float().view(-1, H) - aux).norm(dim=-1) / aux.norm(dim=-1)
        assert rel.max().item() < 0.05
        rel = (y.final.float() - x.final.float()).norm(dim=-1) / x.final.float().norm(dim=-1)
        assert rel.max().item() < 0.05


def test_killed_fp8_finalize_leaves_only_dot_named_files(tmp_path, monkeypatch):
    """A kill before the rename leaves the bf16 partial and the compact file being written,
    both dot-named (never read) and both matched by the leftover pattern stage 02 removes
    on restart (`partial_name(...) + "*"`, eagle3/stages/s02_extract/run.py)."""
    import os

    partial, _ = _partial(tmp_path, [4, 5])

    def killed(src, dst):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _finalize(partial, "fp8")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".train-00000.partial", ".train-00000.partial.out"]
    assert sorted(p.name for p in tmp_path.glob(store.partial_name("train", 0) + "*")) == left


def test_files_of_another_encoding_are_refused_by_the_reader(tmp_path):
    partial, _ = _partial(tmp_path, [4, 5])
    entry = _finalize(partial, "fp8")
    split = store.HiddenStateStore(tmp_path, _index([entry], "bf16"), None, needed_by="stage 04 (train)").split("train")
    with pytest.raises(PipelineError, match=r"stage 04 \(train\): .*train-00000\.safetensors holds fp8 states "
                                            r"\(float8_e4m3fn\), the store's identity .*store\.json says bf16 "
                                            r"\(bfloat16\).*--store-dtype"):
        split[0]
    unknown = _index([entry], "fp8")
    unknown["identity"]["dtype"] = "float4_e2m1"
    with pytest.raises(PipelineError, match=r"records stored states of dtype 'float4_e2m1'.*this code reads bf16 "
                                            r"\(bfloat16\), fp8 \(float8_e4m3fn\).*--force --store-dtype"):
        store.HiddenStateStore(tmp_path, unknown, None)
    # A store written before the encodings existed records no `scale`: it reads as bf16.
    assert store.encoding_of({"dtype": "bfloat16"}) is store.BF16 and store.encoding_of({}) is store.BF16


@pytest.mark.parametrize("store_dtype", ["bf16", "fp8"])
def test_file_bytes_is_a_tight_upper_bound(tmp_path, store_dtype):
    partial, _ = _partial(tmp_path, [7, 2, 9])
    entry = _finalize(partial, store_dtype)
    bound = store.file_bytes(3, 18, H, A, store_dtype)
    assert entry["bytes"] <= bound <= entry["bytes"] + 64


def test_require_free_space_names_both_numbers_and_the_fixes(tmp_path, monkeypatch):
    files = [(64, 20_000)] * 10 + [(64, 30_000), (10, 9_000)]  # (samples, tokens)
    need16 = store.bytes_to_write(files, 576, 3, "bf16")
    need8 = store.bytes_to_write(files, 576, 3, "fp8")
    # fp8 counts its two largest bf16 partial files on top of the fp8 files (one engine).
    assert need8 == (sum(store.file_bytes(s, t, 576, 3, "fp8") for s, t in files)
                     + store.file_bytes(64, 30_000, 576, 3) + store.file_bytes(64, 20_000, 576, 3)) < need16
    assert store.bytes_to_write(files, 576, 3, "fp8", engines=2) == need8 + 2 * store.file_bytes(64, 20_000, 576, 3)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10 ** 12, 0, need16 - 1))
    with pytest.raises(PipelineError) as e:
        store.require_free_space(tmp_path, files, 576, 3, "bf16")
    msg = str(e.value)
    assert f"needs {need16:,} bytes" in msg and f"has {need16 - 1:,} bytes" in msg and str(tmp_path) in msg
    assert f"--store-dtype fp8 needs {need8:,} bytes" in msg and "--num-shards" in msg and "--work-dir" in msg
    store.require_free_space(tmp_path, files, 576, 3, "fp8")  # fits: no error
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10 ** 12, 0, need16))
    store.require_free_space(tmp_path, files, 576, 3, "bf16")


# --------------------------------------------------------------------------- values and checksums


def test_fp8_decode_gives_code_times_two_to_the_scale_on_both_paths():
    """Hand-made codes and scales against values worked out by hand: both decode paths
    (the bf16 exponent add, and the float path for other dtypes and far exponents)."""
    codes = torch.tensor([1.0, -1.5, 0.0, 448.0, 2.0 ** -9]).to(torch.float8_e4m3fn)  # 2**-9: smallest subnormal
    assert codes.float().tolist() == [1.0, -1.5, 0.0, 448.0, 2.0 ** -9]  # each exact in e4m3
    q = codes.expand(3, 5).contiguous()  # [3, 5]
    e = torch.tensor([3, -2, 0], dtype=torch.int8)
    want = torch.tensor([[8.0, -12.0, 0.0, 3584.0, 2.0 ** -6],
                         [0.25, -0.375, 0.0, 112.0, 2.0 ** -11],
                         [1.0, -1.5, 0.0, 448.0, 2.0 ** -9]])
    for dtype in (torch.bfloat16, torch.float32):  # the exponent add (bf16), the float path (float32)
        got = store.dequantize_fp8(q, e, dtype)
        assert got.dtype == dtype and got.float().tolist() == want.tolist()
    far = torch.tensor([-120, 120, 0], dtype=torch.int8)  # outside the exponent add's range: the float path
    scale = torch.tensor([2.0 ** -120, 2.0 ** 120, 1.0])[:, None]
    assert store.dequantize_fp8(q, far).float().tolist() == (codes.float() * scale).tolist()


def test_checksums_cover_every_chunk(tmp_path):
    """File and buffer checksums read in chunks equal one hash of the whole, and a byte
    changed after the first chunk changes them."""
    import xxhash

    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    want = f"{store.CHECKSUM}:{xxhash.xxh3_128(data).hexdigest()}"
    for chunk in (1000, 4096, 1 << 20):  # many chunks, a short last chunk, one chunk
        assert store.file_checksum(path, chunk) == want
        assert store.buffer_checksum(bytearray(data), chunk) == want
    changed = bytearray(data)
    changed[9_000] ^= 1  # in the tenth of ten 1000-byte chunks
    path.write_bytes(changed)
    assert store.file_checksum(path, 1000) != want and store.buffer_checksum(changed, 1000) != want
