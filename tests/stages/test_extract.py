"""Stage 02 (eagle3/stages/s02_extract/): both backends, resume, shards, validation, the next reader.

Runs on the tiny targets on CPU. vLLM's CPU build is required, not optional: the
vLLM tests fail (never skip) when it cannot run. One vLLM engine per target
(module-scoped fixture), a few dozen samples, `gpu_memory_utilization` 0.3.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import ROOT, copy_stages, kill_after_entries

from eagle3.artifacts import store
from eagle3.artifacts.manifest import read_manifest, read_record, record_of
from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s02_extract import engine as extract_engine
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.plan import box_files, plan_files
from eagle3.stages.s02_extract.run import extract_hidden_states

N_CHATS = 40
PREPARE = dict(max_length=512, eval_fraction=0.2)  # stage 01's settings (test_store_format.py's too)
AUX = [2, 4, 5]  # the default [2, N//2, N-3] for the 8-layer tiny targets


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def prepared(stage_runs, tiny_targets):
    """kind -> a work dir where stage 01 ran on the first N_CHATS demo chats (built lazily)."""
    class Prepared(dict):
        def __missing__(self, kind):
            self[kind] = stage_runs(tiny_targets[kind], upto="prepare", chats=N_CHATS, prepare=PREPARE)
            return self[kind]

    return Prepared()


def fresh_wd(prepared_wd: Path, dst: Path) -> Path:
    """A new work dir holding a copy of stage 01's output (and no store)."""
    return copy_stages(prepared_wd, dst, ("prepare",))


def cfg_for(workdir: Path, target: Path, **kw) -> ExtractConfig:
    base = dict(work_dir=workdir, target_model=str(target), backend="hf", samples_per_file=4,
                gpu_memory_utilization=0.3, enforce_eager=True)
    base.update(kw)
    return ExtractConfig(**base)


def store_files(workdir: Path) -> dict[str, bytes]:
    """The store's content: data files and their index entries (the manifest has a timestamp)."""
    d = WorkDir(workdir).store()
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())
            if p.suffix in (".safetensors", ".json") and p.name not in ("manifest.json",)}


@pytest.fixture(scope="module")
def hf_store(prepared, tiny_targets, tmp_path_factory):
    """kind -> a work dir with a complete hf-backend store (built lazily, once)."""
    class Stores(dict):
        def __missing__(self, kind):
            workdir = fresh_wd(prepared[kind], tmp_path_factory.mktemp(f"hf-{kind}"))
            extract_hidden_states(cfg_for(workdir, tiny_targets[kind]))
            self[kind] = workdir
            return workdir

    return Stores()


@pytest.fixture(scope="module")
def vllm_store(prepared, tiny_targets, tmp_path_factory):
    """kind -> a work dir with a complete vLLM-backend store: one engine start per target."""
    class Stores(dict):
        def __missing__(self, kind):
            workdir = fresh_wd(prepared[kind], tmp_path_factory.mktemp(f"vllm-{kind}"))
            extract_hidden_states(cfg_for(workdir, tiny_targets[kind], backend="vllm"))
            self[kind] = workdir
            return workdir

    return Stores()




# --------------------------------------------------------------------------- backends agree


def _hf_reference(target: Path, input_ids: torch.Tensor):
    """transformers float32: all hidden states [N+1] of [T, H] and the logits [T, V]."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        out = m(input_ids.long()[None], output_hidden_states=True)
    return [h[0] for h in out.hidden_states], out.logits[0]


def _tok_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 error of a against b: [T, H] x [T, H] -> [T]."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


# bf16 tolerance on the per-token relative error (median, 90th percentile). Llama's two
# bf16 runs differ by rounding (~0.5%); DeepSeek-V3's by more (bf16 MLA, and MoE routing
# near-ties of random tiny weights flip experts for a few tokens). Neighbouring layers
# differ by ~50%, so an off-by-one fails either way.
TOL = {"llama": (0.02, 0.02), "deepseek_v3": (0.04, 0.10)}


def _close(a: torch.Tensor, b: torch.Tensor, kind: str) -> bool:
    e = _tok_err(a, b)
    return e.median().item() < TOL[kind][0] and e.quantile(0.9).item() < TOL[kind][1]


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_vllm_and_hf_backends_store_the_same_states(kind, hf_store, vllm_store, tiny_targets):
    wd_hf, wd_vllm = hf_store[kind], vllm_store[kind]
    hf = HiddenStateStore.open(WorkDir(wd_hf), needed_by="test")
    vl = HiddenStateStore.open(WorkDir(wd_vllm), needed_by="test")
    assert hf.aux_layers == vl.aux_layers == AUX
    m = read_manifest(WorkDir(wd_vllm), "extract", needed_by="test")
    assert record_of(m).aux_layer_ids == AUX and record_of(m).hidden_size == 256 and m.extra["dtype"] == "bfloat16"
    assert m.counts["bytes_per_token"] == 2 * 3 * 256 + 2 * 256 + 9

    agree = total = 0
    for split in ("train", "eval"):
        a, b = hf.split(split), vl.split(split)
        assert len(a) == len(b) > 0 and a.sample_ids == b.sample_ids
        aux_a, aux_b, fin_a, fin_b = [], [], [], []
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
            aux_a.append(x.aux.view(-1, 256))  # [T, 3H] -> [3T, H]
            aux_b.append(y.aux.view(-1, 256))
            fin_a.append(x.final)
            fin_b.append(y.final)
            m = store.label_positions(x.loss_mask, torch.tensor([0, x.num_tokens]))
            assert (x.target_argmax[~m] == -1).all() and (y.target_argmax[~m] == -1).all()
            agree += int((x.target_argmax[m] == y.target_argmax[m]).sum())
            total += int(m.sum())
        assert _close(torch.cat(aux_b), torch.cat(aux_a), kind), split
        assert _close(torch.cat(fin_b), torch.cat(fin_a), kind), split
    assert agree / total > 0.85  # random tiny weights: small logit margins flip some argmaxes

    # Against transformers' own hidden_states (float32): stored layer k matches
    # hidden_states[k] and not its neighbours k-1, k+1, so an off-by-one in either
    # backend fails here.
    for s in (hf.split("train")[0], vl.split("train")[0]):
        hs, logits = _hf_reference(tiny_targets[kind], s.input_ids)
        aux = s.aux.view(s.num_tokens, len(AUX), 256)  # [T, 3H] -> [T, 3, H]
        for j, k in enumerate(AUX):
            assert _close(aux[:, j], hs[k], kind), k
            err = _tok_err(aux[:, j], hs[k]).median().item()
            for nb in (k - 1, k + 1):
                nb_err = _tok_err(aux[:, j], hs[nb]).median().item()
                assert nb_err > max(0.2, 5 * err), (k, nb, nb_err, err)
        assert _close(s.final, hs[8], kind)  # transformers' hidden_states[N] is after the final norm
        m = store.label_positions(s.loss_mask, torch.tensor([0, s.num_tokens]))
        assert (s.target_argmax[m] == logits.argmax(-1)[m]).float().mean() > 0.85


def test_in_process_engine_stores_what_a_spawned_one_does(prepared, vllm_store, tiny_targets, tmp_path):
    """`--engine-in-process` (the SmolLM2 config's setting): the engine core runs in the
    stage's process, which steps it until each file's last requests are written. Run as
    the script (a process of its own: an in-process engine pins its caller's threads)."""
    workdir = fresh_wd(prepared["llama"], tmp_path)
    cmd = [sys.executable, str(ROOT / "02_extract_hidden_states.py"), "--work-dir", str(workdir),
           "--target-model", str(tiny_targets["llama"]), "--backend", "vllm", "--samples-per-file", "4",
           "--gpu-memory-utilization", "0.3", "--enforce-eager", "--engine-in-process"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = HiddenStateStore.open(WorkDir(vllm_store["llama"]), needed_by="test")
    got = HiddenStateStore.open(WorkDir(workdir), needed_by="test")
    assert got.index["splits"]["train"]["files"] and len(got.index["splits"]["train"]["files"]) > 1
    for split in ("train", "eval"):
        a, b = ref.split(split), got.split(split)
        assert a.sample_ids == b.sample_ids and len(a) > 0
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
            # The same engine and kernels; batches may differ, so a tolerance, not equality.
            assert _close(y.aux.view(-1, 256), x.aux.view(-1, 256), "llama"), (split, i)
            assert _close(y.final, x.final, "llama"), (split, i)


def test_hf_backend_loads_kimi_k25_text_model(prepared, hf_store, tiny_targets, tmp_path):
    # Same weights as the tiny DeepSeek-V3, nested as Kimi-K2.5 (text_config, language_model.*).
    workdir = fresh_wd(prepared["deepseek_v3"], tmp_path)
    extract_hidden_states(cfg_for(workdir, tiny_targets["kimi_k25"]))
    a = HiddenStateStore.open(WorkDir(workdir), needed_by="test").split("train")
    b = HiddenStateStore.open(WorkDir(hf_store["deepseek_v3"]), needed_by="test").split("train")
    for i in (0, len(a) - 1):
        assert torch.equal(a[i].aux, b[i].aux) and torch.equal(a[i].final, b[i].final)
        assert torch.equal(a[i].target_argmax, b[i].target_argmax)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("ids, msg", [
    ([-1, 4, 5], "negative"), ([2, 2, 5], "distinct and ascending"), ([5, 4, 2], "distinct and ascending"),
    ([0, 4, 5], "out of range"), ([2, 4, 8], "out of range"),
])
def test_bad_layer_ids_refused_before_loading(ids, msg, prepared, tiny_targets, tmp_path, no_model_load):
    workdir = fresh_wd(prepared["llama"], tmp_path)
    with pytest.raises(PipelineError, match=msg):
        extract_hidden_states(cfg_for(workdir, tiny_targets["llama"], aux_layers=ids))


def test_layer_count_read_from_text_config(prepared, tiny_targets, tmp_path, no_model_load):
    workdir = fresh_wd(prepared["deepseek_v3"], tmp_path)
    with pytest.raises(PipelineError, match="8-layer"):
        extract_hidden_states(cfg_for(workdir, tiny_targets["kimi_k25"], aux_layers=[2, 4, 8]))


def test_other_tokenizer_refused_before_loading(prepared, tiny_targets, tmp_path, no_model_load):
    other = tmp_path / "other-target"
    shutil.copytree(tiny_targets["llama"], other)
    (other / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                                               "{% endfor %}")
    workdir = fresh_wd(prepared["llama"], tmp_path / "wd")
    with pytest.raises(PipelineError, match="tokenizer fingerprint mismatch") as e:
        extract_hidden_states(cfg_for(workdir, other))
    prep_fp = read_record(WorkDir(workdir), "prepare", needed_by="test").tokenizer_fingerprint
    assert prep_fp in str(e.value)


def test_next_reader_refuses_other_layers_or_tokenizer(hf_store):
    workdir = WorkDir(hf_store["llama"])
    fp = HiddenStateStore.open(workdir, needed_by="t").tokenizer_fingerprint
    with pytest.raises(PipelineError, match="aux layer ids mismatch") as e:
        HiddenStateStore.open(workdir, needed_by="04_train_drafter.py", aux_layers=[1, 4, 5])
    assert "[2, 4, 5]" in str(e.value) and "[1, 4, 5]" in str(e.value)
    with pytest.raises(PipelineError, match="tokenizer fingerprint mismatch") as e:
        HiddenStateStore.open(workdir, needed_by="04_train_drafter.py", tokenizer_fingerprint="f" * 64)
    assert fp in str(e.value) and "f" * 64 in str(e.value)
    HiddenStateStore.open(workdir, needed_by="t", aux_layers=AUX, tokenizer_fingerprint=fp, hidden_size=256)


def test_rerun_with_other_layers_refused_without_force(hf_store, tiny_targets, tmp_path, no_model_load):
    workdir = tmp_path / "wd"
    shutil.copytree(hf_store["llama"], workdir)
    with pytest.raises(PipelineError, match=r"aux_layers: \[2, 4, 5\].*vs \[1, 4, 5\]"):
        extract_hidden_states(cfg_for(workdir, tiny_targets["llama"], aux_layers=[1, 4, 5]))


def test_nonfinite_samples_are_counted_not_dropped_silently(prepared, tiny_targets, tmp_path, monkeypatch):
    from eagle3.stages.s02_extract import hf_backend

    real, poisoned = hf_backend.HFBackend.forward, []

    def forward(self, input_ids):
        out = real(self, input_ids)
        if not poisoned:  # the first sample of the first batch: train sample 0
            out[0][0][1, 0, 7] = float("nan")
            poisoned.append(True)
        return out

    monkeypatch.setattr(hf_backend.HFBackend, "forward", forward)
    workdir = fresh_wd(prepared["llama"], tmp_path)
    m = extract_hidden_states(cfg_for(workdir, tiny_targets["llama"]))
    first = HiddenStateStore.open(WorkDir(workdir), needed_by="t").index["splits"]["train"]["files"][0]["sample_ids"][0]
    assert m.counts["train_rejected_nonfinite"] == 1 and m.counts["eval_rejected_nonfinite"] == 0
    assert m.extra["rejected_sample_ids"] == {store.file_name("train", 0): [first]}
    split = HiddenStateStore.open(WorkDir(workdir), needed_by="t").split("train")
    assert first not in split.sample_ids and split.num_rejected == 1
    assert len(split) == m.counts["train_samples"] - 1


# --------------------------------------------------------------------------- resume


def test_rerun_of_complete_store_does_nothing(hf_store, tiny_targets, no_model_load):
    m = extract_hidden_states(cfg_for(hf_store["llama"], tiny_targets["llama"]))
    assert record_of(m).complete


def test_kill_and_resume_equals_unbroken_run(prepared, hf_store, tiny_targets, tmp_path):
    workdir = fresh_wd(prepared["llama"], tmp_path)
    cmd = [sys.executable, str(ROOT / "02_extract_hidden_states.py"), "--work-dir", str(workdir),
           "--target-model", str(tiny_targets["llama"]), "--backend", "hf", "--samples-per-file", "4"]
    d = WorkDir(workdir).store()
    kill_after_entries(cmd, d)
    n_plan = len(plan_files({s: len(HiddenStateStore.open(WorkDir(hf_store["llama"]), needed_by="t")
                                    .split(s)) for s in ("train", "eval")}, 4))
    assert len(list(d.glob("*-0*.json"))) < n_plan, "killed too late to test a resume"
    assert not (WorkDir(workdir).manifest("extract")).exists()
    extract_hidden_states(cfg_for(workdir, tiny_targets["llama"]))
    assert not list(d.glob(".*partial*"))
    assert store_files(workdir) == store_files(hf_store["llama"])


def test_corrupted_and_truncated_files_are_redone(hf_store, tiny_targets, tmp_path, caplog):
    workdir = tmp_path / "wd"
    shutil.copytree(hf_store["llama"], workdir)
    d = WorkDir(workdir).store()
    f1, f2 = d / store.file_name("train", 1), d / store.file_name("train", 2)
    data = bytearray(f1.read_bytes())
    data[len(data) // 2] ^= 0x55  # same size: only the checksum can tell
    f1.write_bytes(bytes(data))
    f2.write_bytes(f2.read_bytes()[:-1000])
    with pytest.raises(PipelineError, match="has .* bytes"):  # the next reader refuses the truncated one
        HiddenStateStore.open(WorkDir(workdir), needed_by="t")
    extract_hidden_states(cfg_for(workdir, tiny_targets["llama"]))
    assert "corrupted" in caplog.text and "truncated" in caplog.text
    assert store_files(workdir) == store_files(hf_store["llama"])


# --------------------------------------------------------------------------- several boxes


def test_two_shards_combine_into_one_run(prepared, hf_store, tiny_targets, tmp_path, monkeypatch):
    boxes = [fresh_wd(prepared["llama"], tmp_path / f"box{i}") for i in range(2)]
    for i, workdir in enumerate(boxes):
        extract_hidden_states(cfg_for(workdir, tiny_targets["llama"], num_shards=2, shard_index=i))
    m0 = read_manifest(WorkDir(boxes[0]), "extract", needed_by="t")
    assert not record_of(m0).complete and record_of(m0).missing_shard_indices == [1]
    with pytest.raises(PipelineError, match="lacks .* file"):
        HiddenStateStore.open(WorkDir(boxes[0]), needed_by="t")
    partial = HiddenStateStore.open(WorkDir(boxes[0]), needed_by="t", allow_missing=True)
    assert partial.missing_files() and len(partial.split("train")) < len(
        HiddenStateStore.open(WorkDir(hf_store["llama"]), needed_by="t").split("train"))

    # Copy box 1's files next to box 0's; one more run (no model needed) completes the manifest.
    d0, d1 = WorkDir(boxes[0]).store(), WorkDir(boxes[1]).store()
    for f in d1.glob("*-0*"):
        shutil.copy2(f, d0 / f.name)
    monkeypatch.setattr(extract_engine, "make_backend", lambda *a, **k: pytest.fail("no model should be needed"))
    m = extract_hidden_states(cfg_for(boxes[0], tiny_targets["llama"]))
    assert record_of(m).complete and m.counts["files_present"] == m.counts["files_expected"]
    assert store_files(boxes[0]) == store_files(hf_store["llama"])


def test_data_parallel_workers_write_the_same_store(prepared, hf_store, tiny_targets, tmp_path):
    workdir = fresh_wd(prepared["llama"], tmp_path)
    extract_hidden_states(cfg_for(workdir, tiny_targets["llama"], data_parallel_size=2))
    assert store_files(workdir) == store_files(hf_store["llama"])


def test_plan_is_deterministic_and_partitioned():
    plan = plan_files({"train": 10, "eval": 3}, 4)
    assert [(f.split, f.file_no, f.first, f.count) for f in plan] == [
        ("train", 0, 0, 4), ("train", 1, 4, 4), ("train", 2, 8, 2), ("eval", 0, 0, 3)]
    parts = [box_files(plan, 3, i) for i in range(3)]
    assert sorted((f for p in parts for f in p), key=plan.index) == plan
    assert not set(parts[0]) & set(parts[1])


def test_a_retrained_target_does_not_reuse_the_store(tmp_path, tiny_llama):
    import shutil

    from safetensors.torch import load_file, save_file

    from eagle3.stages.s01_prepare.config import PrepareConfig
    from eagle3.stages.s01_prepare.run import prepare_dataset
    from eagle3.stages.s02_extract.config import ExtractConfig
    from eagle3.stages.s02_extract.run import extract_hidden_states

    target = tmp_path / "target"
    shutil.copytree(tiny_llama, target)
    data = tmp_path / "c.jsonl"
    data.write_text("\n".join((ROOT / "data" / "demo_chats.jsonl").read_text().splitlines()[:6]) + "\n")
    prepare_dataset(PrepareConfig(work_dir=tmp_path / "w", target_model=str(target), data=[str(data)],
                                  eval_fraction=0.0, num_workers=1))
    cfg = dict(work_dir=tmp_path / "w", target_model=str(target), backend="hf", samples_per_file=4)
    extract_hidden_states(ExtractConfig(**cfg))
    w = load_file(target / "model.safetensors")
    w["model.norm.weight"] = w["model.norm.weight"] * 2  # "retrained": same config and tokenizer
    save_file(w, target / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PipelineError, match="target_weights"):
        extract_hidden_states(ExtractConfig(**cfg))
