"""Stage 02 writing fp8 and bf16 stores (tiny Llama, hf backend, 40 demo chats): an fp8 store
against the bf16 one (same argmax, states within the backends' bf16 tolerance, 2x fewer
bytes), a rerun with the other encoding refused, kill -9 and resume, two shards, the refusal
before the engine loads, and `diagnose store-size` against the stores' real sizes.
The encodings on synthetic files, without a model (the quantiser, the file layout, mixed
encodings, the disk-space refusal): tests/unit/test_store_encodings.py. The integrity tests
of tests/unit/test_store.py run for both encodings; test_faults.py runs its disk-full and
flipped-byte tests for both.
"""
from __future__ import annotations

import json
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import yaml
from fixtures import ROOT, copy_stages, kill_after_entries

from eagle3.artifacts import store
from eagle3.artifacts.manifest import record_of
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError

N_CHATS = 40
DiskUsage = namedtuple("DiskUsage", "total used free")


# --------------------------------------------------------------------------- stage 02 on the tiny Llama


@pytest.fixture(scope="module")
def prepared(stage_runs, tiny_llama) -> Path:
    """Stage 01 on the first N_CHATS demo chats (the one test_extract.py reads)."""
    return stage_runs(tiny_llama, upto="prepare", chats=N_CHATS, prepare=dict(max_length=512, eval_fraction=0.2))


def fresh_wd(prepared: Path, dst: Path) -> Path:
    return copy_stages(prepared, dst, ("prepare",))


def cfg_for(workdir: Path, target: Path, **kw):
    from eagle3.stages.s02_extract.config import ExtractConfig

    return ExtractConfig(**{"work_dir": workdir, "target_model": str(target), "backend": "hf", "samples_per_file": 4, **kw})


def store_files(workdir: Path) -> dict[str, bytes]:
    d = WorkDir(workdir).store()
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())
            if p.suffix in (".safetensors", ".json") and p.name != "manifest.json"}


@pytest.fixture(scope="module")
def stores(prepared, tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """store_dtype -> a work dir with a complete store of that encoding (built lazily, once)."""
    from eagle3.stages.s02_extract.run import extract_hidden_states

    class Stores(dict):
        def __missing__(self, name):
            workdir = fresh_wd(prepared, tmp_path_factory.mktemp(f"store-{name}"))
            extract_hidden_states(cfg_for(workdir, tiny_llama, store_dtype=name))
            self[name] = workdir
            return workdir

    return Stores()




def test_fp8_store_holds_the_bf16_stores_states_in_half_the_bytes(stores):
    from eagle3.artifacts.manifest import read_manifest
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

    workdir = tmp_path / "wd"
    shutil.copytree(stores["fp8"], workdir)
    with pytest.raises(PipelineError, match=r"dtype: 'float8_e4m3fn' \(in .*store\.json\) vs 'bfloat16' \(this run\)"
                                            r".*Pass --force"):
        extract_hidden_states(cfg_for(workdir, tiny_llama, store_dtype="bf16"))


def test_stage02_refuses_a_too_small_disk_before_the_engine_loads(stores, prepared, tiny_llama, tmp_path,
                                                                   monkeypatch, no_model_load):
    from eagle3.stages.s02_extract.inputs import split_lengths
    from eagle3.stages.s02_extract.plan import plan_files
    from eagle3.stages.s02_extract.run import extract_hidden_states

    workdir = fresh_wd(prepared, tmp_path / "wd")
    lengths = {s: split_lengths(WorkDir(workdir), s) for s in ("train", "eval")}
    plan = plan_files({s: len(v) for s, v in lengths.items()}, 4)
    files = [(f.count, int(lengths[f.split][f.first:f.first + f.count].sum())) for f in plan]
    need = store.bytes_to_write(files, 256, 3, "fp8")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: DiskUsage(10 ** 12, 0, need - 1))
    with pytest.raises(PipelineError) as e:
        extract_hidden_states(cfg_for(workdir, tiny_llama, store_dtype="fp8"))
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

    workdir = fresh_wd(prepared, tmp_path)
    cmd = [sys.executable, str(ROOT / "02_extract_hidden_states.py"), "--work-dir", str(workdir),
           "--target-model", str(tiny_llama), "--backend", "hf", "--samples-per-file", "4", "--store-dtype", "fp8"]
    d = WorkDir(workdir).store()
    kill_after_entries(cmd, d)
    n_files = len([n for n in store_files(stores["fp8"]) if n.endswith(".safetensors")])
    assert len(list(d.glob("*-0*.json"))) < n_files, "killed too late to test a resume"
    assert not WorkDir(workdir).manifest("extract").exists()
    extract_hidden_states(cfg_for(workdir, tiny_llama, store_dtype="fp8"))
    assert not list(d.glob(".*partial*"))
    assert store_files(workdir) == store_files(stores["fp8"])


def test_fp8_shards_combine_into_one_run(prepared, stores, tiny_llama, tmp_path, monkeypatch):
    from eagle3.stages.s02_extract import engine as extract_engine
    from eagle3.stages.s02_extract.run import extract_hidden_states

    boxes = [fresh_wd(prepared, tmp_path / f"box{i}") for i in range(2)]
    for i, workdir in enumerate(boxes):
        extract_hidden_states(cfg_for(workdir, tiny_llama, store_dtype="fp8", num_shards=2, shard_index=i))
    d0, d1 = WorkDir(boxes[0]).store(), WorkDir(boxes[1]).store()
    for f in d1.glob("*-0*"):
        shutil.copy2(f, d0 / f.name)
    monkeypatch.setattr(extract_engine, "make_backend", lambda *a, **k: pytest.fail("no model should be needed"))
    m = extract_hidden_states(cfg_for(boxes[0], tiny_llama, store_dtype="fp8"))
    assert record_of(m).complete and m.counts["files_present"] == m.counts["files_expected"]
    assert store_files(boxes[0]) == store_files(stores["fp8"])


def test_diagnose_store_size_matches_the_stores_written(stores, prepared, tiny_llama, tmp_path, monkeypatch, capsys):
    from eagle3.artifacts.manifest import read_manifest
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
