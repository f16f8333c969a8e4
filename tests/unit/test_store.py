"""The hidden-state store format (eagle3/artifacts/store.py): layout, writer, finalize, zero-copy reader.

No model here: files are filled with known tensors, finalized with a known norm and
argmax, and read back. The stage-level behaviour (resume, shards, validation by
the next reader) is in tests/stages/test_extract.py; what is particular to the fp8
encoding in test_store_encodings.py (synthetic files) and tests/stages/test_store_format.py
(stage 02). The integrity tests here run for both encodings (`ENCODINGS`).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle3.artifacts import store
from eagle3.artifacts.store import format as store_format
from eagle3.core.errors import PipelineError

H, A = 32, 3
ENCODINGS = ["bf16", "fp8"]
NORM_W = torch.linspace(0.5, 1.5, H)
LM_HEAD = torch.randn(50, H, generator=torch.Generator().manual_seed(1))


def _norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * NORM_W


def _argmax(h):
    return (h.float() @ LM_HEAD.T).argmax(-1)


def _samples(lengths, seed=0):
    g = np.random.default_rng(seed)
    ids = [g.integers(0, 50, n).astype(np.int32) for n in lengths]
    masks = [(g.random(n) < 0.5).astype(np.int8) for n in lengths]
    aux = [torch.randn(n, A, H, generator=torch.Generator().manual_seed(seed + i)) for i, n in enumerate(lengths)]
    pre = [torch.randn(n, H, generator=torch.Generator().manual_seed(100 + seed + i)) * 3
           for i, n in enumerate(lengths)]
    return ids, masks, aux, pre


def _build(tmp_path, lengths, *, nan_sample=None, order=None, store_dtype="bf16"):
    ids, masks, aux, pre = _samples(lengths)
    if nan_sample is not None:
        aux[nan_sample][1, 0, 3] = float("nan")
    partial = tmp_path / store.partial_name("train", 0)
    lay = store.create_partial_file(partial, split="train", file_no=0, first_sample=0, input_ids=ids,
                                    loss_masks=masks, hidden_size=H, aux_layers=[1, 2, 3], identity_hash="h")
    rows = np.cumsum([0] + lengths)[:-1]
    for i in order or range(len(lengths)):  # any order: vLLM finishes requests out of order
        store.write_sample_states(partial, int(rows[i]), aux[i], pre[i])
    final = tmp_path / store.file_name("train", 0)
    entry = store.finalize_file(partial, final, split="train", file_no=0, first_sample=0,
                                sample_ids=[f"s{i}" for i in range(len(lengths))], identity_hash="h",
                                normalize=_norm, argmax=_argmax, store_dtype=store_dtype)
    return lay, entry, final, (ids, masks, aux, pre)


def _reader(tmp_path, entries, n, store_dtype="bf16"):
    ident = {"aux_layers": [1, 2, 3], "hidden_size": H, "num_layers": 5, "vocab_size": 50,
             "tokenizer_fingerprint": "t", "target_model": "m", **store.identity_fields(store_dtype)}
    index = {"store_format": store.STORE_FORMAT, "identity": ident,
             "splits": {"train": {"num_samples": n, "samples_per_file": n, "num_files": 1, "files": entries}}}
    return store.HiddenStateStore(tmp_path, index, None)


def test_round_trip_values_and_layout(tmp_path):
    lengths = [5, 9, 1, 7]
    lay, entry, path, (ids, masks, aux, pre) = _build(tmp_path, lengths, order=[2, 0, 3, 1])
    assert not (tmp_path / store.partial_name("train", 0)).exists()
    assert path.stat().st_size == entry["bytes"] == lay.total_bytes
    assert lay.data_start % 64 == 0
    # Bytes per token: everything but the header and the per-sample arrays.
    T, S = sum(lengths), len(lengths)
    assert lay.data_bytes == T * store.bytes_per_token(H, A) + 8 * (S + 1) + S
    assert store.bytes_per_token(7168, 3) == 57353  # the reference case, in the module docstring

    split = _reader(tmp_path, [entry], S).split("train")
    assert len(split) == S and split.num_tokens == T
    for i in range(S):
        s = split[i]
        assert s.sample_id == f"s{i}"
        assert torch.equal(s.input_ids, torch.from_numpy(ids[i]))
        assert torch.equal(s.loss_mask, torch.from_numpy(masks[i]))
        assert s.aux.dtype == torch.bfloat16 and s.aux.shape == (lengths[i], A * H)
        assert torch.equal(s.aux, aux[i].reshape(lengths[i], A * H).to(torch.bfloat16))
        want_final = _norm(pre[i].to(torch.bfloat16).float()).to(torch.bfloat16)  # pre-norm travels as bf16
        # The store normalises a file's tokens in one chunk, this test one sample: other
        # shapes, so not bitwise equal on every CPU; one bf16 rounding step apart at most.
        torch.testing.assert_close(s.final.float(), want_final.float(), rtol=8e-3, atol=1e-5)
        # The argmax exists where mask[t] or mask[t+1] is 1; elsewhere it is never a label.
        m = s.loss_mask.bool()
        need = m | torch.cat([m[1:], torch.zeros(1, dtype=torch.bool)])
        assert torch.equal(s.target_argmax[~need], torch.full(((~need).sum(),), -1, dtype=torch.int32))
        # where needed, it picks a top logit (a near-tie may resolve either way on another CPU)
        logits = s.final.float() @ LM_HEAD.T  # [t, 50]
        picked = logits[need].gather(-1, s.target_argmax[need].long()[:, None])[:, 0]
        torch.testing.assert_close(picked, logits[need].amax(-1), rtol=1e-5, atol=1e-5)


def test_label_positions_stay_inside_samples():
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 1, 0, 0, 1], dtype=torch.int8)
    offs = torch.tensor([0, 6, 10])  # samples [0, 6) and [6, 10)
    # t=1 precedes an assistant token; t=5 does not, because t+1=6 starts the next sample.
    assert store.label_positions(mask, offs).int().tolist() == [0, 1, 1, 1, 0, 0, 1, 0, 1, 1]


def test_file_is_plain_safetensors(tmp_path):
    lay, entry, path, _ = _build(tmp_path, [4, 6])
    tensors = load_file(path)
    assert set(tensors) == {n for n, _, _ in lay.tensors()}
    assert tensors["sample_offsets"].tolist() == [0, 4, 10]
    assert tensors["aux"].shape == (10, A * H) and tensors["final"].dtype == torch.bfloat16
    assert tensors["valid"].tolist() == [1, 1]


def test_reader_is_zero_copy(tmp_path):
    _, entry, _, _ = _build(tmp_path, [3, 4])
    split = _reader(tmp_path, [entry], 2).split("train")
    a, b = split[0], split[1]
    # Both samples are views of one mapping of the file: no per-sample copy was made.
    assert a.aux.untyped_storage().data_ptr() == b.aux.untyped_storage().data_ptr()
    assert b.aux.data_ptr() - a.aux.data_ptr() == 3 * A * H * 2
    assert split.location(1) == (store.file_name("train", 0), 3, 4)


@pytest.mark.parametrize("store_dtype", ENCODINGS)
def test_nonfinite_sample_is_rejected_not_dropped(tmp_path, store_dtype):
    _, entry, path, _ = _build(tmp_path, [4, 5, 6], nan_sample=1, store_dtype=store_dtype)
    assert entry["rejected"] == [1]
    t = load_file(path)
    assert t["valid"].tolist() == [1, 0, 1]
    assert (t["target_argmax"][4:9] == -1).all() and (t["loss_mask"][4:9] == 0).all()
    assert torch.isfinite(t["aux"].float()).all() and (t["aux"][4:9].float() == 0).all()
    split = _reader(tmp_path, [entry], 3, store_dtype).split("train")
    assert len(split) == 2 and split.sample_ids == ["s0", "s2"] and split.num_rejected == 1


@pytest.mark.parametrize("store_dtype", ENCODINGS)
def test_truncated_and_corrupted_files_are_detected(tmp_path, store_dtype):
    _, entry, path, _ = _build(tmp_path, [4, 5], store_dtype=store_dtype)
    assert store.file_problem(tmp_path, entry, verify_checksum=True) is None
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "corrupted" in store.file_problem(tmp_path, entry, verify_checksum=True)
    assert store.file_problem(tmp_path, entry, verify_checksum=False) is None  # same size
    path.write_bytes(bytes(data) + b"\0")  # grew: e.g. appended to after its entry was written
    assert store.file_problem(tmp_path, entry, verify_checksum=False) == (
        f"{path} has {entry['bytes'] + 1} bytes, its index entry says {entry['bytes']} (truncated?)")
    path.write_bytes(bytes(data[:-100]))
    assert "truncated" in store.file_problem(tmp_path, entry, verify_checksum=False)
    path.unlink()
    assert "missing" in store.file_problem(tmp_path, entry, verify_checksum=False)


@pytest.mark.parametrize("store_dtype", ENCODINGS)
def test_entry_written_after_rename(tmp_path, store_dtype):
    _, entry, path, _ = _build(tmp_path, [2], store_dtype=store_dtype)
    on_disk = json.loads(path.with_suffix(".json").read_text())
    assert on_disk == entry and store.read_entry(tmp_path, "train", 0) == entry
    assert entry["checksum"] == store.file_checksum(path) and entry["bytes"] == path.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.with_suffix(".json").name, path.name]  # no temporaries


def test_header_garbage_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{{{{{")
    with pytest.raises(PipelineError, match="corrupt header"):
        store.FileLayout.read(bad)


def test_header_of_another_layout_is_a_clear_error(tmp_path):
    # Valid JSON, but not this format's tensors (another format version, or a foreign file).
    for header in ({"weights": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, [1, 2]):
        raw = json.dumps(header).encode()
        bad = tmp_path / "x.safetensors"
        bad.write_bytes(len(raw).to_bytes(8, "little") + raw)
        with pytest.raises(PipelineError, match=r"x\.safetensors: its header does not lay out a store file.*"
                                                r"rerun stage 02"):
            store.FileLayout.read(bad)
    _, _, path, _ = _build(tmp_path, [3, 2])  # a real file still reads
    assert store.FileLayout.read(path)[0].num_samples == 2


@pytest.mark.parametrize("store_dtype", ENCODINGS)
def test_collate_pads_right(tmp_path, store_dtype):
    _, entry, _, _ = _build(tmp_path, [3, 5], store_dtype=store_dtype)
    split = _reader(tmp_path, [entry], 2, store_dtype).split("train")
    b = store.collate([split[0], split[1]])
    assert b["aux"].dtype == b["final"].dtype == torch.bfloat16  # the training dtype, whatever the encoding
    assert b["aux"].shape == (2, 5, A * H) and b["final"].shape == (2, 5, H)
    assert b["attention_mask"].tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert (b["target_argmax"][0, 3:] == -1).all()
    assert torch.equal(b["aux"][1], split[1].aux)


@pytest.mark.parametrize("store_dtype", ENCODINGS)
def test_reader_verifies_each_file_once_before_its_first_read(tmp_path, monkeypatch, store_dtype):
    _, entry, path, (ids, _, _, _) = _build(tmp_path, [4, 5], store_dtype=store_dtype)
    calls = []
    real = store.buffer_checksum
    monkeypatch.setattr(store_format, "buffer_checksum", lambda buf: calls.append(1) or real(buf))
    split = _reader(tmp_path, [entry], 2, store_dtype).split("train")  # lazy: nothing hashed at open
    assert calls == []
    assert split[0].input_ids.tolist() == ids[0].tolist() and split[1].input_ids.tolist() == ids[1].tolist()
    assert len(calls) == 1  # once per file and process, not per sample
    assert real(split._files[0].mm) == entry["checksum"] == store.file_checksum(path)


@pytest.mark.parametrize("store_dtype", ENCODINGS)
def test_flipped_byte_is_refused_before_training_reads_it(tmp_path, store_dtype):
    _, entry, path, _ = _build(tmp_path, [4, 5], store_dtype=store_dtype)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of the aux states: same size, plausible values
    path.write_bytes(bytes(data))
    split = _reader(tmp_path, [entry], 2, store_dtype).split("train")
    with pytest.raises(PipelineError, match=r"train-00000\.safetensors has checksum xxh3_128:\w+, its index entry "
                                            r"says xxh3_128:\w+ \(corrupted .*rerun `python 02_extract_hidden_states"):
        split[0]
    with pytest.raises(PipelineError, match="corrupted"):  # and again: a failed file is not cached
        split[1]
    # verify="off" reads it (sizes only): what the flag is for is a measured choice, not a default
    ident = _reader(tmp_path, [entry], 2, store_dtype)
    off = store.HiddenStateStore(tmp_path, ident.index, None, verify="off").split("train")
    assert off[0].num_tokens == 4


@pytest.mark.parametrize("store_dtype", ENCODINGS)
def test_finalize_refuses_a_file_with_a_sample_never_written(tmp_path, store_dtype):
    """Sample 1's states were never written (a second writer recreated the file, a request the
    engine dropped): its zeros must not become data with a valid checksum."""
    with pytest.raises(PipelineError, match=r"1 of 3 samples were never written \(positions \[1\]"):
        _build(tmp_path, [4, 5, 6], order=[2, 0], store_dtype=store_dtype)
    assert not (tmp_path / store.file_name("train", 0)).exists() and store.read_entry(tmp_path, "train", 0) is None


def test_two_writers_of_one_file_never_share_a_partial_file(tmp_path):
    """Each process writes its own partial file; one cleaning up its leftovers leaves the other's."""
    ids, masks, _, _ = _samples([4, 5])
    partials = {}
    for writer in ("box-a-101", "box-b-202"):
        partials[writer] = tmp_path / store.partial_name("train", 0, writer)
        store.create_partial_file(partials[writer], split="train", file_no=0, first_sample=0, input_ids=ids,
                                  loss_masks=masks, hidden_size=H, aux_layers=[1, 2, 3], identity_hash="h")
    assert partials["box-a-101"] != partials["box-b-202"]
    store.remove_partial(tmp_path, "train", 0, writer="box-b-202")
    assert partials["box-a-101"].exists() and not partials["box-b-202"].exists()
    store.remove_partial(tmp_path, "train", 0)  # the holder of the folder's claim: every writer's leftovers
    assert not partials["box-a-101"].exists()


def test_a_write_must_cover_whole_samples_of_the_file(tmp_path):
    ids, masks, aux, pre = _samples([4, 5])
    partial = tmp_path / store.partial_name("train", 0)
    lay = store.create_partial_file(partial, split="train", file_no=0, first_sample=0, input_ids=ids, loss_masks=masks,
                                    hidden_size=H, aux_layers=[1, 2, 3], identity_hash="h")
    with pytest.raises(AssertionError, match="not whole samples"):
        store.write_sample_states(partial, 2, aux[1][:4], pre[1][:4], lay)  # rows 2..6 straddle samples 0 and 1
