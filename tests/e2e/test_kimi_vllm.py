"""The tiny Kimi-K2.5 target through vLLM's own `KimiK25ForConditionalGeneration` on CPU.

The tiny `kimi_k25` target (eagle3/demo/tiny.py: the tiny DeepSeek-V3's weights and
config nested as Kimi-K2.5 nests them, `text_config` and `language_model.*` weight names)
runs stages 00-05 with vLLM's CPU build wherever a stage runs vLLM: stage 00 generates the
answers, stage 02 extracts with the vllm backend (vLLM's Kimi class hands the aux capture
to its `language_model`, a DeepSeek model, and stage 02 asks for layer id N as well), and
each engine starts with `language_model_only` (no vision tower built or profiled). Stage
06 serves the plain target through its engine path; with a drafter it must stop in one line
before any engine starts: vLLM's CPU build has no block size that both its MLA attention and
the drafter's attention take (docs/KIMI_K25.md, "vLLM's KimiK25ForConditionalGeneration").

The store vLLM wrote is compared with the hf backend's on the same data, and both with
transformers' hidden_states of the tiny DeepSeek-V3 (the same weights, unnested): stored
layer k is hidden_states[k] and not a neighbour, so a wrong prefix (weights not loaded) or
an off-by-one in the capture fails. About 3 minutes on 2 cores (three engine starts).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures import copy_stages, first_chats, run_stages

from eagle3.artifacts.manifest import read_manifest, record_of
from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError

N_CHATS = 12
MAX_NEW = 12
AUX = [2, 4, 5]  # the default [2, N//2, N-3] of the tiny 8-layer target
H = 256


@pytest.fixture(scope="module")
def kimi_run(tiny_targets, tmp_path_factory):
    """Stages 00-05 on the tiny Kimi target, every engine stage on vLLM."""
    from eagle3.stages.s00_generate.config import GenerateConfig
    from eagle3.stages.s00_generate.run import generate_responses

    root = tmp_path_factory.mktemp("kimi-vllm")
    target = tiny_targets["kimi_k25"]
    work = root / "work"
    generate_responses(GenerateConfig(work_dir=work, target_model=str(target), max_new_tokens=MAX_NEW,
                                      data=[str(first_chats(root / "chats.jsonl", N_CHATS))]))
    run_stages(work, target, first="prepare", upto="export", chats=None,
               prepare=dict(data=["generated"], eval_fraction=0.25),
               extract=dict(backend="vllm", dtype="bfloat16", samples_per_file=4))
    return target, WorkDir(work)


def test_the_tiny_target_is_shaped_as_kimi_k25(tiny_targets):
    from safetensors import safe_open

    target = tiny_targets["kimi_k25"]
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"]["model_type"] == "deepseek_v3" and "vision_config" in cfg
    with safe_open(str(target / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith("language_model.") for n in names)
    assert {"language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
            "language_model.model.norm.weight"} <= set(names)


def test_stage_00_generated_with_vllms_kimi_class(kimi_run):
    _, workdir = kimi_run
    g = record_of(read_manifest(workdir, "generate", needed_by="test"))
    assert g.turns_regenerated > N_CHATS and g.generated_tokens > 0
    lines = [json.loads(x) for f in sorted(workdir.generate_chunks().glob("*.jsonl")) for x in f.read_text().splitlines()]
    ids = [t for ln in lines for gen in ln.get("generated", []) for t in gen["ids"]]
    assert len(ids) == g.generated_tokens and len(set(ids)) > 5  # a model answered, not a constant


def _tok_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16 MLA against float32, with MoE routing near-ties of random weights (as
    tests/stages/test_extract.py's DeepSeek-V3 tolerance); neighbouring layers differ by ~50%."""
    e = _tok_err(a, b)
    return e.median().item() < 0.04 and e.quantile(0.9).item() < 0.10


def test_stage_02_captures_through_language_model_and_layer_id_n(kimi_run, tiny_targets, tmp_path):
    """vLLM's store against the hf backend's on the same samples, and both against
    transformers' hidden_states of the same weights unnested (the tiny DeepSeek-V3)."""
    from transformers import AutoModelForCausalLM

    from eagle3.stages.s02_extract.config import ExtractConfig
    from eagle3.stages.s02_extract.run import extract_hidden_states

    target, workdir = kimi_run
    m = read_manifest(workdir, "extract", needed_by="test")
    assert m.params["backend"] == "vllm" and record_of(m).aux_layer_ids == AUX
    hf_wd = copy_stages(workdir.root, tmp_path / "hf", ("prepare",))
    extract_hidden_states(ExtractConfig(work_dir=hf_wd, target_model=str(target), backend="hf", samples_per_file=4))
    vl = HiddenStateStore.open(workdir, needed_by="test").split("train")
    hf = HiddenStateStore.open(WorkDir(hf_wd), needed_by="test").split("train")
    assert len(vl) == len(hf) > 0 and vl.sample_ids == hf.sample_ids
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_targets["deepseek_v3"]), dtype=torch.float32).eval()
    for i in (0, len(vl) - 1):
        x, y = hf[i], vl[i]
        assert torch.equal(x.input_ids, y.input_ids)
        assert _close(y.aux.view(-1, H), x.aux.view(-1, H)) and _close(y.final, x.final)
        with torch.no_grad():
            hs = plain(y.input_ids.long()[None], output_hidden_states=True).hidden_states
        aux = y.aux.view(y.num_tokens, len(AUX), H)  # [T, 3H] -> [T, 3, H]
        for j, k in enumerate(AUX):
            err = _tok_err(aux[:, j], hs[k][0]).median().item()
            assert err < 0.04, (k, err)
            assert all(_tok_err(aux[:, j], hs[nb][0]).median().item() > max(0.2, 5 * err) for nb in (k - 1, k + 1))
        # The final state comes from vLLM's layer id N (before the norm), normed by stage 02:
        # transformers' hidden_states[N] is after the norm.
        assert _close(y.final, hs[8][0])


def test_stages_03_to_05_ran_on_the_vllm_store(kimi_run):
    _, workdir = kimi_run
    exported = json.loads((workdir.export_dir() / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLMEagle3"] and exported["vocab_size"] == 960
    assert exported["eagle_aux_hidden_state_layer_ids"] == AUX  # what vLLM reads (docs/CONVENTIONS.md §7)
    assert (workdir.export_dir() / "model.safetensors").is_file()


def test_stage_06_serves_the_plain_target_and_refuses_a_drafter_in_one_line(kimi_run, tmp_path):
    from eagle3.stages.s06_evaluate import engine as evaluate_engine
    from eagle3.stages.s06_evaluate.config import EvaluateConfig
    from eagle3.stages.s06_evaluate.run import evaluate_drafter

    target, workdir = kimi_run
    cfg = EvaluateConfig(work_dir=workdir.root, target_model=str(target), max_new_tokens=8, timing_prompts=0)
    with pytest.raises(PipelineError) as e:
        evaluate_drafter(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "no common block size" in msg and "kv_lora_rank 512" in msg, msg
    assert not workdir.engine_request("plain").exists()  # refused before any engine started

    # The plain passes, through stage 06's own engine path (its worker process, its settings).
    prompts = [ids.tolist()[:40] for ids in
               (HiddenStateStore.open(workdir, needed_by="test").split("eval")[i].input_ids for i in range(2))]
    req = {**evaluate_engine.engine_request(cfg.engine_config(max_model_len=128)),
           "engines": [{"name": "plain", "drafter": None, "temperatures": [0.0]}],
           "num_speculative_tokens": 3, "max_new_tokens": 8, "warmup_prompts": 0,
           "prompts": prompts, "timing_blocks": []}
    assert req["language_model_only"] is True
    out = evaluate_engine.run_engine("plain", req, WorkDir(tmp_path / "wd6"), cfg)
    (acc,) = out["runs"]["plain"]["acceptance"]
    assert len(acc["tokens"]) == 2 and all(len(t) == 8 for t in acc["tokens"]), acc["tokens"]
