"""The drafter folder format: config mapping, atomic save, load of published variants."""
from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.serving.drafter_io import (CONFIG_NAME, WEIGHTS_NAME, drafter_config_from_hf_config,
                                       hf_config_from_drafter_config, load_drafter_dir, read_drafter_dir,
                                       save_drafter_dir)
from eagle3.serving.engine_rules import WEIGHT_NAMES

LAYERS = [2, 4, 5]


def make_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    """A small random drafter with a random ascending vocab mapping (draft 16 of 100)."""
    kw = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=128,
              target_hidden_size=64, draft_vocab_size=16, target_vocab_size=100, max_position_embeddings=2048)
    kw.update(overrides)
    cfg = DrafterConfig(**kw)
    g = torch.Generator().manual_seed(seed)
    m = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    if cfg.draft_vocab_size < cfg.target_vocab_size:
        ids = torch.sort(torch.randperm(cfg.target_vocab_size, generator=g)[:cfg.draft_vocab_size]).values
        t2d = torch.zeros(cfg.target_vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        m.set_vocab_mapping(ids - torch.arange(cfg.draft_vocab_size), t2d)
    return m


def test_hf_config_has_every_key_convention_6_and_7_ask_for():
    m = make_drafter()
    hf = hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=4096)
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["model_type"] == "llama"
    assert hf["num_hidden_layers"] == 1 and hf["head_dim"] == 32  # explicit: 64 / 2 heads = 32 here by chance
    assert hf["draft_vocab_size"] == 16 and hf["vocab_size"] == 100
    assert hf["tie_word_embeddings"] is False and hf["torch_dtype"] == "bfloat16"
    assert "target_hidden_size" not in hf  # only written when it differs
    assert hf["max_position_embeddings"] == 4096  # raised to the target's
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert hf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    # never lowered below the drafter's own
    assert hf_config_from_drafter_config(m.config, LAYERS, max_position_embeddings=512)[
        "max_position_embeddings"] == 2048


def test_hf_config_refuses_a_layer_count_the_drafter_does_not_fuse():
    with pytest.raises(PipelineError, match="fuses 3 aux layers"):
        hf_config_from_drafter_config(make_drafter().config, [2, 4])


def test_config_round_trip_and_transformers_reads_it(tmp_path):
    from transformers import AutoConfig

    rs = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}
    m = make_drafter(rope_scaling=rs, rope_theta=500000.0)
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    assert drafter_config_from_hf_config(hf, m.state_dict()) == m.config.to_dict()
    assert drafter_config_from_hf_config(hf) == m.config.to_dict()  # without tensors too
    (tmp_path / "config.json").write_text(json.dumps(hf))
    ac = AutoConfig.from_pretrained(tmp_path)
    assert ac.head_dim == 32 and ac.draft_vocab_size == 16 and ac.eagle_config["use_aux_hidden_state"]
    # transformers 5 folds the legacy rope keys into rope_parameters; reading that back works too
    saved = ac.to_dict()
    assert saved["rope_parameters"]["rope_type"] == "llama3"
    again = drafter_config_from_hf_config({k: v for k, v in saved.items() if k not in ("rope_theta", "rope_scaling")})
    assert again["rope_theta"] == 500000.0 and again["rope_scaling"]["factor"] == 8.0


def test_implicit_head_dim_is_taken_from_q_proj():
    m = make_drafter(num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # 4 x 32 != 64 hidden
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    del hf["head_dim"]
    assert drafter_config_from_hf_config(hf, m.state_dict())["head_dim"] == 32
    assert drafter_config_from_hf_config(hf)["head_dim"] == 16  # what an engine would assume


def test_save_writes_exactly_the_format(tmp_path):
    m = make_drafter()
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    out = tmp_path / "drafter"
    findings = save_drafter_dir(out, m.state_dict(), hf)
    assert not [f for f in findings if f.level == "error"]
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no temporary folder left behind
    assert json.loads((out / CONFIG_NAME).read_text()) == hf
    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as st:
        assert st.metadata() == {"format": "pt"}
        names = set(st.keys())
        assert names == set(WEIGHT_NAMES) | {"d2t", "t2d"}
        for n in WEIGHT_NAMES:
            assert st.get_tensor(n).dtype == torch.bfloat16
        assert st.get_tensor("d2t").dtype == torch.int64 and st.get_tensor("t2d").dtype == torch.bool
        assert torch.equal(st.get_tensor("d2t"), m.d2t)


def test_save_refuses_to_replace_a_non_empty_folder_unless_asked(tmp_path):
    m = make_drafter()
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(PipelineError, match="not empty"):
        save_drafter_dir(tmp_path, m.state_dict(), hf)
    assert (tmp_path / "keep.txt").read_text() == "mine"
    save_drafter_dir(tmp_path, m.state_dict(), hf, overwrite=True)
    assert not (tmp_path / "keep.txt").exists()


def test_save_refuses_unknown_tensors_and_engine_errors_before_writing(tmp_path):
    m = make_drafter()
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    with pytest.raises(PipelineError, match="no engine format knows"):
        save_drafter_dir(tmp_path / "a", {**m.state_dict(), "extra.weight": torch.zeros(2)}, hf)
    with pytest.raises(PipelineError, match="tie_word_embeddings"):
        save_drafter_dir(tmp_path / "b", m.state_dict(), {**hf, "tie_word_embeddings": True})
    assert list(tmp_path.iterdir()) == []


def test_embed_tokens_only_when_asked(tmp_path):
    m = make_drafter()
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    sd = {**m.state_dict(), "embed_tokens.weight": torch.randn(100, 64)}
    save_drafter_dir(tmp_path / "a", sd, hf)
    assert "embed_tokens.weight" not in read_drafter_dir(tmp_path / "a").tensors
    save_drafter_dir(tmp_path / "b", sd, hf, include_embed_tokens=True)
    assert read_drafter_dir(tmp_path / "b").tensors["embed_tokens.weight"].shape == (100, 64)
    with pytest.raises(PipelineError, match="no embed_tokens"):
        save_drafter_dir(tmp_path / "c", m.state_dict(), hf, include_embed_tokens=True)


def test_identity_d2t_is_left_out_when_draft_vocab_is_the_target_vocab(tmp_path):
    m = make_drafter(draft_vocab_size=100)
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    save_drafter_dir(tmp_path / "d", m.state_dict(), hf)
    assert "d2t" not in read_drafter_dir(tmp_path / "d").tensors  # vLLM has no parameter for it


def test_save_in_fp32(tmp_path):
    m = make_drafter()
    save_drafter_dir(tmp_path / "d", m.state_dict(), hf_config_from_drafter_config(m.config, LAYERS, dtype="fp32"),
                     dtype="fp32")
    _, t = load_drafter_dir(tmp_path / "d")
    assert all(torch.equal(t[n], m.state_dict()[n]) for n in WEIGHT_NAMES)


# -- EAGLE 3.1 and the plain export's bytes ------------------------------------------------

# A drafter as an old stage 04 checkpoint records it (no fc_norm / norm_output keys), yarn rope.
GOLDEN_CONFIG = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
                     target_hidden_size=32, draft_vocab_size=16, target_vocab_size=40, max_position_embeddings=256,
                     rms_norm_eps=1e-5, rope_theta=50000.0,
                     rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                   "mscale": 1.0, "mscale_all_dim": 1.0})
# sha256 of the export of `integer_drafter(GOLDEN_CONFIG)` written by the base commit 6ed9f89
# (before the EAGLE 3.1 shape): `git archive 6ed9f89 | tar -x -C BASE`, then in BASE the body of
# `golden_export` below with PYTHONPATH=BASE. Every weight is k/256 for an integer k from
# torch.randint, exact in bf16 and drawn without float arithmetic, so the bytes are the same
# on every CPU; only another safetensors/json serialisation would change them.
GOLDEN_SHA256 = {CONFIG_NAME: "5726355964aac3da4394c004a52977d91a2e59657b84022aafd8176ce87fa0a2",
                 WEIGHTS_NAME: "30e5dc2e94e4ceba2caf9781090fa954e3ccfb2e99104d8cab57af58348a2e4e"}


def integer_drafter(config: DrafterConfig) -> Eagle3Drafter:
    g = torch.Generator().manual_seed(38)
    m = Eagle3Drafter(config)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-128, 128, p.shape, generator=g).float() / 256)
    ids = torch.arange(40)[torch.randint(0, 2, (40,), generator=g).bool()][:16]
    m.set_vocab_mapping(ids - torch.arange(16), torch.zeros(40, dtype=torch.bool).index_fill_(0, ids, True))
    return m


def golden_export(config: DrafterConfig, out) -> dict[str, str]:
    m = integer_drafter(config)
    save_drafter_dir(out, m.state_dict(), hf_config_from_drafter_config(m.config, [2, 4, 5],
                                                                         max_position_embeddings=4096))
    return {n: hashlib.sha256((out / n).read_bytes()).hexdigest() for n in (CONFIG_NAME, WEIGHTS_NAME)}


def test_a_plain_eagle3_export_is_byte_identical_to_the_base_commits(tmp_path):
    old_checkpoint = DrafterConfig.from_dict(GOLDEN_CONFIG)  # the keys a checkpoint from before holds
    assert golden_export(old_checkpoint, tmp_path / "old") == GOLDEN_SHA256
    new_checkpoint = DrafterConfig.from_dict(old_checkpoint.to_dict())  # with fc_norm / norm_output false
    assert new_checkpoint.to_dict()["fc_norm"] is False
    assert golden_export(new_checkpoint, tmp_path / "new") == GOLDEN_SHA256


def test_an_eagle31_export_writes_the_engines_keys_and_names(tmp_path):
    m = make_drafter(fc_norm=True, norm_output=True)
    with torch.no_grad():
        for i, norm in enumerate(m.fc_norm):
            norm.weight.fill_(1.0 + i)
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    assert hf["fc_norm"] is True and hf["norm_output"] is True
    assert "fc_norm" not in hf_config_from_drafter_config(make_drafter(norm_output=True).config, LAYERS)
    findings = save_drafter_dir(tmp_path / "d", m.state_dict(), hf)
    assert not [f for f in findings if f.level != "info"]
    assert any(f.topic == "shape" and "vLLM >= 0.22.0 and SGLang >= 0.5.12" in f.message for f in findings)
    with safe_open(str(tmp_path / "d" / WEIGHTS_NAME), framework="pt") as st:
        assert set(st.keys()) == set(WEIGHT_NAMES) | {"d2t", "t2d", "fc_norm.0.weight", "fc_norm.1.weight",
                                                       "fc_norm.2.weight"}
        assert st.get_tensor("fc_norm.2.weight").shape == (64,) and float(st.get_tensor("fc_norm.2.weight")[0]) == 3
    cfg, tensors = load_drafter_dir(tmp_path / "d")
    dc = DrafterConfig.from_dict(drafter_config_from_hf_config(cfg, tensors))
    assert dc.fc_norm and dc.norm_output and dc == m.config


def test_the_legacy_eagle31_spelling_is_read_as_fc_norm(tmp_path, caplog):
    """The legacy 3.1 spelling: config `use_aux_norm`, tensors `aux_norm_{low,mid,high}.weight` (the
    names SGLang >= 0.5.12 renames to fc_norm.{0,1,2}; docs/CONVENTIONS.md §6)."""
    m = make_drafter(fc_norm=True, norm_output=True)
    hf = {k: v for k, v in hf_config_from_drafter_config(m.config, LAYERS).items() if k != "fc_norm"}
    hf["use_aux_norm"] = True
    legacy = {"fc_norm.0.weight": "aux_norm_low.weight", "fc_norm.1.weight": "aux_norm_mid.weight",
              "fc_norm.2.weight": "aux_norm_high.weight"}
    sd = m.state_dict()
    _write_variant(tmp_path / "ts", hf, {legacy.get(k, k): v for k, v in sd.items()})
    with caplog.at_level(logging.WARNING, logger="eagle3.serving.drafter_io"):
        cfg, t = load_drafter_dir(tmp_path / "ts")
    assert set(t) == set(sd) and all(torch.equal(t[k], sd[k]) for k in sd)
    assert "aux_norm_low.weight -> fc_norm.0.weight" in caplog.text
    assert DrafterConfig.from_dict(drafter_config_from_hf_config(cfg, t)).fc_norm is True


def _write_variant(folder, config, tensors):
    folder.mkdir()
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_NAME))


def test_load_normalises_published_names_and_reports_it(tmp_path, caplog):
    m = make_drafter()
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    sd = m.state_dict()
    variant = {}
    for k, v in sd.items():
        k2 = ("model." + k) if k.startswith(("fc.", "norm.")) else k.replace("midlayer.", "layers.0.")
        variant[k2] = v
    variant["some.unknown"] = torch.zeros(1)
    _write_variant(tmp_path / "pub", hf, variant)
    with caplog.at_level(logging.WARNING, logger="eagle3.serving.drafter_io"):
        cfg, t = load_drafter_dir(tmp_path / "pub")
    assert set(t) == set(sd) and all(torch.equal(t[k], sd[k]) for k in sd)
    text = caplog.text
    assert "normalised 12 tensor name(s)" in text and "layers.0.hidden_norm.weight -> midlayer.hidden_norm.weight" in text
    assert "dropping 1 tensor(s)" in text and "some.unknown" in text


def test_load_sharded_safetensors(tmp_path):
    m = make_drafter()
    sd = m.state_dict()
    folder = tmp_path / "sharded"
    folder.mkdir()
    names = sorted(sd)
    halves = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for fname, part in halves.items():
        save_file({n: sd[n].contiguous() for n in part}, str(folder / fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in halves.items() for n in part}}))
    (folder / CONFIG_NAME).write_text(json.dumps(hf_config_from_drafter_config(m.config, LAYERS)))
    _, t = load_drafter_dir(folder)
    assert set(t) == set(sd)


def test_pickled_weights_are_refused_with_the_conversion_command(tmp_path):
    m = make_drafter()
    (tmp_path / CONFIG_NAME).write_text(json.dumps(hf_config_from_drafter_config(m.config, LAYERS)))
    torch.save(m.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(PipelineError, match="pickled weights") as e:
        load_drafter_dir(tmp_path)
    assert "weights_only=True" in str(e.value) and "save_file" in str(e.value)


def test_missing_files_and_multi_layer_are_refused(tmp_path):
    with pytest.raises(PipelineError, match="not a folder"):
        load_drafter_dir(tmp_path / "nope")
    with pytest.raises(PipelineError, match="no config.json"):
        load_drafter_dir(tmp_path)
    m = make_drafter()
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    _write_variant(tmp_path / "two", {**hf, "num_hidden_layers": 2}, m.state_dict())
    with pytest.raises(PipelineError, match="num_hidden_layers = 2"):
        load_drafter_dir(tmp_path / "two")


# -- fine-tuning from published drafters (--init-from) -----------------------------------------
# Folders shaped like the published Kimi-K2/K2.5 and DeepSeek drafters (SpecForge's format),
# at tiny widths: only the nested eagle_config ids (SGLang's reading: + 1), the target's
# embedding saved beside the drafter's weights, and in some `model.`-prefixed names.

def _published(tmp_path, name, *, embed: bool, prefix: str = "", layers_0: bool = False):
    m = make_drafter(seed=3)
    hf = hf_config_from_drafter_config(m.config, LAYERS)
    del hf["eagle_aux_hidden_state_layer_ids"]  # nested [1, 3, 4] only, as SpecForge writes
    t = {}
    for k, v in m.state_dict().items():
        if k == "lm_head.weight" or k in ("d2t", "t2d"):
            t[k] = v
        else:
            t[prefix + (k.replace("midlayer.", "layers.0.") if layers_0 else k)] = v
    if embed:
        t[prefix + "embed_tokens.weight"] = torch.randn(100, 64)  # the target's vocab x hidden
    _write_variant(tmp_path / name, hf, t)
    return m, tmp_path / name


def _init_from(path, m):
    from eagle3.stages.s04_train.finetune import load_initial_drafter

    ids = (m.d2t + torch.arange(16)).numpy()
    return load_initial_drafter(path, aux_layers=LAYERS, num_target_layers=8, target_hidden=64, target_vocab=100,
                                our_ids=ids, mode="keep", target_rows=lambda ids: torch.zeros(len(ids), 64),
                                expected_from="test store")


@pytest.mark.parametrize("embed, prefix, layers_0", [
    (True, "", False),           # SpecForge Kimi-K2.5 style: unprefixed, with embed_tokens
    (False, "", False),          # the same without embed_tokens
    (True, "model.", False),     # model.-prefixed names, model.embed_tokens.weight
    (True, "model.", True),      # model.layers.0.* (vLLM's internal names), DeepSeek drafters
])
def test_init_from_published_drafter_shapes(tmp_path, caplog, embed, prefix, layers_0):
    m, path = _published(tmp_path, "pub", embed=embed, prefix=prefix, layers_0=layers_0)
    with caplog.at_level(logging.WARNING, logger="eagle3.stages.s04_train.finetune"):
        cfg, state, report = _init_from(path, m)
    assert "embed_tokens.weight" not in state
    dropped = [r.message for r in caplog.records if r.name == "eagle3.stages.s04_train.finetune" and "embed_tokens" in r.message]
    if embed:
        assert len(dropped) == 1 and "target's own frozen embedding" in dropped[0] and "(100, 64)" in dropped[0]
        assert report.to_json()["tensors_dropped"] == ["embed_tokens.weight"]
    else:
        assert dropped == [] and "tensors_dropped" not in report.to_json()
    # the nested ids were read as SGLang reads them: [1, 3, 4] + 1 = the store's layers
    assert report.layers == LAYERS and "SGLang" in report.layers_from
    # what stage 04 does next: the drafter takes exactly these tensors (it refused embed_tokens before)
    d = Eagle3Drafter(DrafterConfig.from_dict(cfg))
    d.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=True)
    for k, v in m.state_dict().items():
        assert torch.equal(d.state_dict()[k], v), k


def test_init_from_published_drafter_with_other_nested_layers_is_refused(tmp_path):
    m, path = _published(tmp_path, "pub", embed=True)
    cfg = json.loads((path / CONFIG_NAME).read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]  # trained on layers [2, 3, 5]
    (path / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(PipelineError, match=r"trained on layers \[2, 3, 5\].*--aux-layers 2,3,5"):
        _init_from(path, m)
