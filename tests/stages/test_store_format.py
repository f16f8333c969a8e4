"""The store's encodings (eagle3/core/store.py): fp8 states, the store size, the disk-space refusal.

Unit part (no model): the fp8 quantiser's bounds, the fp8 file layout and bytes per
token, a killed finalize, files of two encodings mixed, `require_free_space` and
`file_bytes`. Stage part (tiny Llama, hf backend, 40 demo chats): an fp8 store against
the bf16 one (same argmax, states within the backends' bf16 tolerance, 2x fewer bytes),
a rerun with the other encoding refused, kill -9 and resume, two shards, the refusal
before the engine loads, and `diagnose store-size` against the stores' real sizes.
The integrity tests of test_store.py run for both encodings; test_faults.py runs its
disk-full and flipped-byte tests for both.
"""
from __future__ import annotations

import json
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from fixtures import ROOT, copy_stages, kill_after_entries
from safetensors import safe_open

from eagle3.core import store
from eagle3.core.errors import PipelineError
from eagle3.core.manifest import record_of
from eagle3.core.workdir import WorkDir

H, A = 32, 3
N_CHATS = 40
DiskUsage = namedtuple("DiskUsage", "total used free")
IDENTITY = "e" * 64  # the length of stage 02's identity hash (sha256 hex)


# --------------------------------------------------------------------------- unit: the quantiser


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


# --------------------------------------------------------------------------- unit: fp8 files


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


# --------------------------------------------------------------------------- stage 02 on the tiny Llama


@pytest.fixture(scope="module")
def prepared(stage_runs, tiny_llama) -> Path:
    """Stage 01 on the first N_CHATS demo chats (the one test_extract.py reads)."""
    return stage_runs(tiny_llama, upto="prepare", chats=N_CHATS, prepare=dict(max_length=512, eval_fraction=0.2))


def fresh_wd(prepared: Path, dst: Path) -> Path:
    return copy_stages(prepared, dst, ("prepare",))


def cfg_for(wd: Path, target: Path, **kw):
    from eagle3.stages.s02_extract.config import ExtractConfig

    return ExtractConfig(**{"work_dir": wd, "target_model": str(target), "backend": "hf", "samples_per_file": 4, **kw})


def store_files(wd: Path) -> dict[str, bytes]:
    d = WorkDir(wd).store()
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())
            if p.suffix in (".safetensors", ".json") and p.name != "manifest.json"}


@pytest.fixture(scope="module")
def stores(prepared, tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """store_dtype -> a work dir with a complete store of that encoding (built lazily, once)."""
    from eagle3.stages.s02_extract.run import extract_hidden_states

    class Stores(dict):
        def __missing__(self, name):
            wd = fresh_wd(prepared, tmp_path_factory.mktemp(f"store-{name}"))
            extract_hidden_states(cfg_for(wd, tiny_llama, store_dtype=name))
            self[name] = wd
            return wd

    return Stores()




def test_fp8_store_holds_the_bf16_stores_states_in_half_the_bytes(stores):
    from eagle3.core.manifest import read_manifest
    from eagle3.tools.check_stores import compare_stores

    bf, f8 = stores["bf16"], stores["fp8"]
    m = read_manifest(WorkDir(f8), "extract", needed_by="test")
    assert m.params["store_dtype"] == "fp8"
    assert (record_of(m).store_dtype, m.extra["dtype"], m.extra["scale"]) == ("fp8", "float8_e4m3fn", store.FP8.scale)
    assert m.counts["bytes_per_token"] == 4 * 256 + 13
    ident = json.loads((WorkDir(f8).store() / store.STORE_JSON).read_text())
    assert (ident["dtype"], ident["scale"]) == ("float8_e4m3fn", store.FP8.scale)
    m16 = read_manifest(WorkDir(bf), "extract", needed_by="test")
    assert m16.extra["dtype"] == "bfloat16" and "scale" not in json.loads(
        (WorkDir(bf).store() / store.STORE_JSON).read_text())  # bf16 identity as before fp8 existed
    ratio = m.counts["bytes"] / m16.counts["bytes"]
    assert abs(ratio - (4 * 256 + 13) / (8 * 256 + 9)) < 0.01, ratio

    # Read through the reader stage 04 uses: per-layer states within the bf16 tolerance of
    # two backends (check_stores), and the target argmax of the bf16 final state in both
    # (taken from the fp8 state instead, the tiny target's small logit margins would flip
    # several times the 1% allowed here for two runs of the forward).
    checks = compare_stores(f8, bf, samples=8)
    assert all(c.ok for c in checks), [c.line() for c in checks]
    a, b = (store.HiddenStateStore.open(WorkDir(w), needed_by="test") for w in (f8, bf))
    assert a.encoding is store.FP8 and a.bytes_per_token == 4 * 256 + 13
    same = total = 0
    for split in ("train", "eval"):
        sa, sb = a.split(split), b.split(split)
        assert sa.sample_ids == sb.sample_ids
        for i in range(len(sa)):
            m = store.label_positions(sa[i].loss_mask, torch.tensor([0, sa[i].num_tokens]))
            same += int((sa[i].target_argmax[m] == sb[i].target_argmax[m]).sum())
            total += int(m.sum())
    assert same / total >= 0.99, (same, total)


def test_rerun_with_the_other_encoding_is_refused_until_force(stores, tiny_llama, tmp_path, no_model_load):
    from eagle3.stages.s02_extract.run import extract_hidden_states

    wd = tmp_path / "wd"
    shutil.copytree(stores["fp8"], wd)
    with pytest.raises(PipelineError, match=r"dtype: 'float8_e4m3fn' \(in .*store\.json\) vs 'bfloat16' \(this run\)"
                                            r".*Pass --force"):
        extract_hidden_states(cfg_for(wd, tiny_llama, store_dtype="bf16"))


def test_stage02_refuses_a_too_small_disk_before_the_engine_loads(stores, prepared, tiny_llama, tmp_path,
                                                                   monkeypatch, no_model_load):
    from eagle3.stages.s02_extract import run as run_mod
    from eagle3.stages.s02_extract.run import extract_hidden_states

    wd = fresh_wd(prepared, tmp_path / "wd")
    lengths = {s: run_mod.split_lengths(WorkDir(wd), s) for s in ("train", "eval")}
    plan = run_mod.plan_files({s: len(v) for s, v in lengths.items()}, 4)
    files = [(f.count, int(lengths[f.split][f.first:f.first + f.count].sum())) for f in plan]
    need = store.bytes_to_write(files, 256, 3, "fp8")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10 ** 12, 0, need - 1))
    with pytest.raises(PipelineError) as e:
        extract_hidden_states(cfg_for(wd, tiny_llama, store_dtype="fp8"))
    assert f"needs {need:,} bytes" in str(e.value) and f"has {need - 1:,} bytes" in str(e.value)
    assert "--num-shards" in str(e.value)

    # A resume counts only what is still to be written: one file missing from a complete store.
    wd2 = tmp_path / "wd2"
    shutil.copytree(stores["fp8"], wd2)
    d = WorkDir(wd2).store()
    (d / store.file_name("train", 1)).unlink()
    (d / store.entry_name("train", 1)).unlink()
    one = store.bytes_to_write([files[1]], 256, 3, "fp8")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10 ** 12, 0, one - 1))
    with pytest.raises(PipelineError, match=f"needs {one:,} bytes .* to write 1 file"):
        extract_hidden_states(cfg_for(wd2, tiny_llama, store_dtype="fp8"))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10 ** 12, 0, one))
    with pytest.raises(AssertionError, match="a model was loaded"):  # enough: the run goes on to the engine
        extract_hidden_states(cfg_for(wd2, tiny_llama, store_dtype="fp8"))


def test_fp8_kill_and_resume_equals_unbroken_run(prepared, stores, tiny_llama, tmp_path):
    from eagle3.stages.s02_extract.run import extract_hidden_states

    wd = fresh_wd(prepared, tmp_path)
    cmd = [sys.executable, str(ROOT / "02_extract_hidden_states.py"), "--work-dir", str(wd),
           "--target-model", str(tiny_llama), "--backend", "hf", "--samples-per-file", "4", "--store-dtype", "fp8"]
    d = WorkDir(wd).store()
    kill_after_entries(cmd, d)
    n_files = len([n for n in store_files(stores["fp8"]) if n.endswith(".safetensors")])
    assert len(list(d.glob("*-0*.json"))) < n_files, "killed too late to test a resume"
    assert not WorkDir(wd).manifest("extract").exists()
    extract_hidden_states(cfg_for(wd, tiny_llama, store_dtype="fp8"))
    assert not list(d.glob(".*partial*"))
    assert store_files(wd) == store_files(stores["fp8"])


def test_fp8_shards_combine_into_one_run(prepared, stores, tiny_llama, tmp_path, monkeypatch):
    from eagle3.stages.s02_extract import run as run_mod
    from eagle3.stages.s02_extract.run import extract_hidden_states

    boxes = [fresh_wd(prepared, tmp_path / f"box{i}") for i in range(2)]
    for i, wd in enumerate(boxes):
        extract_hidden_states(cfg_for(wd, tiny_llama, store_dtype="fp8", num_shards=2, shard_index=i))
    d0, d1 = WorkDir(boxes[0]).store(), WorkDir(boxes[1]).store()
    for f in d1.glob("*-0*"):
        shutil.copy2(f, d0 / f.name)
    monkeypatch.setattr(run_mod, "make_backend", lambda *a, **k: pytest.fail("no model should be needed"))
    m = extract_hidden_states(cfg_for(boxes[0], tiny_llama, store_dtype="fp8"))
    assert record_of(m).complete and m.counts["files_present"] == m.counts["files_expected"]
    assert store_files(boxes[0]) == store_files(stores["fp8"])


def test_diagnose_store_size_matches_the_stores_written(stores, prepared, tiny_llama, tmp_path, monkeypatch, capsys):
    from eagle3.core.manifest import read_manifest
    from eagle3.tools import diagnose
    from eagle3.tools.diagnose.store_size import store_size

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"work_dir": str(prepared), "target_model": str(tiny_llama),
                                   "extract": {"backend": "hf", "samples_per_file": 4}}))
    r = store_size(str(cfg), store_dtype="fp8")
    assert r["store_dtype"] == "fp8" and r["hidden_size"] == 256 and r["aux_layers"] == [2, 4, 5] and r["ok"]
    for name in ("bf16", "fp8"):
        m = read_manifest(WorkDir(stores[name]), "extract", needed_by="test")
        got, predicted = m.counts["bytes"], r["encodings"][name]["store_bytes"]
        assert got <= predicted <= got + 64 * m.counts["files_expected"], (name, got, predicted)
        assert r["encodings"][name]["bytes_per_token"] == m.counts["bytes_per_token"]
    assert r["encodings"]["fp8"]["needed_bytes"] > r["encodings"]["fp8"]["store_bytes"]  # + bf16 partial files
    assert r["encodings"]["bf16"]["needed_bytes"] == r["encodings"]["bf16"]["store_bytes"]

    assert diagnose.main(["store-size", "--config", str(cfg), "--store-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "fp8" in out and f"{r['encodings']['fp8']['store_bytes']:,} B" in out and "enough for fp8" in out
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10 ** 12, 0, 1000))
    assert diagnose.main(["store-size", "--config", str(cfg)]) == 1  # the config's bf16 does not fit 1000 bytes
    assert "NOT enough for bf16" in capsys.readouterr().out
