"""Served as trained, shown by the engines' own code (eagle3/tools/parity): vLLM's
`Eagle3LlamaForCausalLM` and SGLang's `LlamaForCausalLMEagle3`, each built from an exported
folder and run on the same aux states, tokens and positions as the drafter as trained, agree
with it over K chained steps on every shape we export; five plausible export bugs are each
caught with a message naming the field, and four for the EAGLE 3.1 shape's norms.

All cases run in one worker process per engine (the module fixture): vLLM in this python,
SGLang in `.venv-sglang` (scripts/setup_cpu.sh). When SGLang cannot be imported the fixture
raises, so every test here fails: the check is never skipped.

The grid is `GRID`: a shape is one more row (DrafterConfig fields over `BASE`, and the aux
layers it is trained on); each row runs requests at positions 0-23 (inside the trained reach)
and 100,000-100,009 (far past it). The EAGLE 3.1 rows (`--drafter-shape eagle3.1`: `fc_norm`
and `norm_output`) run on both engines' own handling of the two keys (vLLM's and SGLang's
llama_eagle3.py build one RMSNorm per aux layer, counted from the nested layer ids, and feed
the post-norm state to the next step), with plain rope and with K2.5's yarn.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fixtures import TINY_TRAIN
from safetensors.torch import load_file, save_file

from eagle3.artifacts.manifest import read_record
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3.drafter.shape import shape_switches
from eagle3.serving.drafter_io import CONFIG_NAME, WEIGHTS_NAME, hf_config_from_drafter_config, save_drafter_dir
from eagle3.serving.engine_rules import served_yarn_attention_factor
from eagle3.tools import diagnose
from eagle3.tools.parity.check import (FAR_POSITION, LOGIT_TOLERANCE, ParityCase, check_parity, format_report,
                                       reference_from_checkpoint, reference_from_drafter)

LAYERS = [2, 4, 5]
K25_YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # Kimi-K2.5's text_config.rope_scaling
BASE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=256,
            target_hidden_size=128, draft_vocab_size=64, target_vocab_size=300, max_position_embeddings=131072)
MHA, GQA = dict(num_key_value_heads=4), dict(num_key_value_heads=2)
PLAIN = dict(rope_theta=10000.0)
YARN = dict(rope_theta=50000.0, rope_scaling=K25_YARN, max_position_embeddings=262144)
SMALL_VOCAB, FULL_VOCAB = dict(draft_vocab_size=64), dict(draft_vocab_size=300)
EAGLE31 = shape_switches("eagle3.1")


@dataclass(frozen=True)
class GridRow:
    name: str
    shape: dict  # DrafterConfig fields over BASE
    layers: tuple[int, ...] = tuple(LAYERS)  # the aux layers it is trained on (convention 1 ids)


GRID = [GridRow(f"{att}-{rope}-{vocab}", {**a, **r, **v})
        for att, a in (("mha", MHA), ("gqa", GQA))
        for rope, r in (("plain", PLAIN), ("yarn", YARN))
        for vocab, v in (("draft64", SMALL_VOCAB), ("full", FULL_VOCAB))]
# EAGLE 3.1, and four aux layers (both engines size fc and the fc norms by num_aux_hidden_states)
GRID += [GridRow("eagle3.1-gqa-plain-draft64", {**GQA, **PLAIN, **SMALL_VOCAB, **EAGLE31}),
         GridRow("eagle3.1-gqa-yarn-draft64", {**GQA, **YARN, **SMALL_VOCAB, **EAGLE31}),
         GridRow("eagle3.1-gqa-plain-draft64-aux4", {**GQA, **PLAIN, **SMALL_VOCAB, **EAGLE31, "num_aux_layers": 4},
                 layers=(2, 3, 4, 5))]
PLANT_BASE, PLANT_BASE_31 = "gqa-yarn-draft64", "eagle3.1-gqa-yarn-draft64"


def trained_drafter(shape: dict, seed: int = 0) -> Eagle3Drafter:
    """A drafter with random weights (norms away from 1, so a swap or a norm left at its
    initial ones shows) and a random mapping."""
    cfg = DrafterConfig(**{**BASE, **shape})
    g = torch.Generator().manual_seed(seed)
    m = Eagle3Drafter(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            norm = name.endswith("norm.weight") or name.startswith("fc_norm.")
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if norm else 0.1 * torch.randn(p.shape, generator=g))
    V, Vd = cfg.target_vocab_size, cfg.draft_vocab_size
    if Vd < V:
        ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
        m.set_vocab_mapping(ids - torch.arange(Vd), torch.zeros(V, dtype=torch.bool).index_fill_(0, ids, True))
    return m


def export(drafter: Eagle3Drafter, out: Path, layers=tuple(LAYERS)) -> Path:
    save_drafter_dir(out, drafter.state_dict(), hf_config_from_drafter_config(drafter.config, list(layers)))
    return out


def _edit_config(folder: Path, edit) -> None:
    cfg = json.loads((folder / CONFIG_NAME).read_text())
    edit(cfg)
    (folder / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))


def _edit_tensors(folder: Path, edit) -> None:
    t = load_file(folder / WEIGHTS_NAME)
    edit(t)
    save_file({k: v.contiguous() for k, v in t.items()}, folder / WEIGHTS_NAME, metadata={"format": "pt"})


def shift_layer_ids(folder: Path) -> None:
    def edit(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = [k + 1 for k in cfg["eagle_aux_hidden_state_layer_ids"]]
        nested = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [k + 1 for k in nested]
    _edit_config(folder, edit)


def absolute_d2t(folder: Path) -> None:
    _edit_tensors(folder, lambda t: t.update(d2t=t["d2t"] + torch.arange(t["d2t"].shape[0])))


def drop_yarn_mscale(folder: Path) -> None:
    _edit_config(folder, lambda cfg: [cfg["rope_scaling"].pop(k) for k in ("mscale", "mscale_all_dim")])


def swap_norms(folder: Path) -> None:
    a, b = "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight"
    _edit_tensors(folder, lambda t: t.update({a: t[b], b: t[a]}))


def transpose_fc(folder: Path) -> None:
    _edit_tensors(folder, lambda t: t.update({"fc.weight": t["fc.weight"].T.contiguous()}))


def drop_fc_norm_tensors(folder: Path) -> None:
    _edit_tensors(folder, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("fc_norm.")]])


def rename_fc_norm_tensors(folder: Path) -> None:
    """`fc_norms.{i}.weight`: the name a trainer's ModuleList called `fc_norms` gives (neither engine has it)."""
    _edit_tensors(folder, lambda t: t.update({k.replace("fc_norm.", "fc_norms."): t.pop(k)
                                              for k in [k for k in t if k.startswith("fc_norm.")]}))


def drop_config_key(key: str):
    def edit(folder: Path) -> None:
        _edit_config(folder, lambda cfg: cfg.pop(key))
    return edit


@dataclass(frozen=True)
class Plant:
    edit: object  # Path -> None, applied to a copy of the base row's export
    field: str  # what every engine's error finding must name
    phrase: str  # and a phrase of its message
    base: str = PLANT_BASE


PLANTS = {
    "layer-ids-shifted": Plant(shift_layer_ids, "eagle_aux_hidden_state_layer_ids", "trained on [2, 4, 5]"),
    "d2t-absolute": Plant(absolute_d2t, "d2t", "absolute target ids"),
    "yarn-mscale-dropped": Plant(drop_yarn_mscale, "rope_scaling", "lacks mscale, mscale_all_dim"),
    "norms-swapped": Plant(swap_norms, "midlayer.input_layernorm.weight", "is the trained midlayer.hidden_norm.weight"),
    "fc-transposed": Plant(transpose_fc, "fc.weight", "transposed"),
    # EAGLE 3.1: vLLM and SGLang both run a norm whose tensor is missing with its initial ones
    "fc-norm-dropped": Plant(drop_fc_norm_tensors, "fc_norm.0.weight", "the folder has no fc_norm.0.weight",
                             PLANT_BASE_31),
    # vLLM's loader refuses the unknown name, SGLang ignores it: both run the norms as initialised
    "fc-norm-renamed": Plant(rename_fc_norm_tensors, "fc_norm.0.weight", "in the folder as fc_norms.0.weight",
                             PLANT_BASE_31),
    # the tensors kept, the key gone: vLLM refuses the tensors, SGLang drops them; neither norms
    "fc-norm-key-dropped": Plant(drop_config_key("fc_norm"), "fc_norm", "the engine builds no fc_norm",
                                 PLANT_BASE_31),
    # step 0 as trained; every later step reads the pre-norm state
    "norm-output-dropped": Plant(drop_config_key("norm_output"), "norm_output", "trained on the post-norm one",
                                 PLANT_BASE_31),
}


@pytest.fixture(scope="module")
def pipeline(stage_runs, tiny_llama) -> WorkDir:
    """Stages 01-05 on the tiny Llama: the run tests/stages/test_stale.py and test_model_card_export.py
    share (the same arguments, so built once per session); read-only."""
    return WorkDir(stage_runs(tiny_llama, upto="export", prepare=dict(eval_fraction=0.2),
                              extract=dict(dtype="bfloat16"), vocab=dict(draft_vocab_size=64), train=TINY_TRAIN))


@pytest.fixture(scope="module")
def parity(tmp_path_factory, pipeline):
    """Every grid row, every planted defect and stage 05's own export (against stage 04's best
    checkpoint) through both engines: one worker per engine."""
    root = tmp_path_factory.mktemp("parity")
    drafters = {row.name: trained_drafter(row.shape) for row in GRID}
    cases = []
    for row in GRID:
        folder = export(drafters[row.name], root / row.name, row.layers)
        cases.append(ParityCase(row.name, folder, reference_from_drafter(drafters[row.name], row.layers),
                                chains=[(24, 0), (10, FAR_POSITION)]))
    for name, plant in PLANTS.items():
        folder = root / name
        shutil.copytree(root / plant.base, folder)
        plant.edit(folder)
        cases.append(ParityCase(name, folder, reference_from_drafter(drafters[plant.base], LAYERS)))
    best = pipeline.stage_dir("train") / read_record(pipeline, "train", needed_by="test").best_checkpoint
    cases.append(ParityCase("stage-05-export", pipeline.export_dir(), reference_from_checkpoint(best),
                            chains=[(24, 0), (10, 1000)], target_layers=8, family="llama"))
    report = check_parity(cases, work=root / "work")
    print(format_report(report))  # the figures, in the test log
    return {c["name"]: c for c in report["cases"]}


@pytest.mark.parametrize("row", GRID, ids=[r.name for r in GRID])
def test_each_exported_shape_is_served_as_trained_by_both_engines(parity, row):
    case = parity[row.name]
    cfg = DrafterConfig(**{**BASE, **row.shape})
    for engine, r in case["engines"].items():
        assert r["ok"], (engine, r["findings"])
        assert len(r["steps"]) == 3  # K chained steps, each judged
        for s in r["steps"]:
            assert s["relative"] <= LOGIT_TOLERANCE, (engine, s)
            assert s["ids_agree"] == 1.0, (engine, s)
        assert r["captured"]["vllm" if engine == "vllm" else "sglang"] == list(row.layers)
        # the engine's class built the shape that was trained (one norm per aux layer for EAGLE 3.1)
        assert r["built"] == {"fc_norm": cfg.num_aux_layers if cfg.fc_norm else 0, "norm_output": cfg.norm_output}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_each_planted_mismatch_is_caught_naming_the_field(parity, plant):
    field_name, phrase = PLANTS[plant].field, PLANTS[plant].phrase
    for engine, r in parity[plant]["engines"].items():
        assert not r["ok"], (engine, plant)
        named = [f for f in r["findings"] if f["level"] == "error" and f["field"] and field_name in f["field"]
                 and phrase in f["message"]]
        assert named, (engine, plant, r["findings"])


def test_an_absolute_d2t_proposes_other_ids_in_sglang_and_stops_vllm(parity):
    """Logits as trained, proposals elsewhere: SGLang proposes other target ids without a word
    (its hot_token_id is d2t + arange, read by index); vLLM's compute_logits indexes its
    target-vocabulary row with the out-of-range ids and raises."""
    engines = parity["d2t-absolute"]["engines"]
    sglang = engines["sglang"]
    assert sglang["steps"] and all(s["relative"] <= LOGIT_TOLERANCE for s in sglang["steps"])
    assert all(s["ids_agree"] < 0.5 for s in sglang["steps"]), sglang["steps"]
    assert any(f["topic"] == "forward" and "IndexError" in f["message"] for f in engines["vllm"]["findings"])


def test_the_installed_engines_read_k25_yarn_as_the_versions_table_says(parity):
    """SGLang's and vLLM's own rope modules, as built for the yarn rows, scale cos/sin by the
    factor `served_yarn_attention_factor` gives for the installed version (1.0 for K2.5's keys
    from SGLang 0.5.16 and in vLLM 0.32; 1.4159 when the mscale keys are ignored)."""
    for name in ("gqa-yarn-draft64", "yarn-mscale-dropped"):
        case = parity[name]
        folder_cfg = json.loads((Path(case["folder"]) / CONFIG_NAME).read_text())
        for engine, r in case["engines"].items():
            version = r["versions"][engine]
            want = served_yarn_attention_factor(engine, version, folder_cfg["rope_scaling"])
            assert abs(r["rope_scale"] - want) < 1e-4, (engine, version, name, r["rope_scale"], want)


def test_stage_05s_export_is_served_as_stage_04_trained_it(parity):
    """The tiny Llama's real export (head_dim 64, GQA, draft vocab 64) against its best checkpoint."""
    for engine, r in parity["stage-05-export"]["engines"].items():
        assert r["ok"], (engine, r["findings"])
        assert all(s["ids_agree"] == 1.0 for s in r["steps"]), (engine, r["steps"])


def test_diagnose_parity_fails_loudly_naming_the_field(pipeline, tmp_path, capsys):
    """`python -m eagle3.tools.diagnose parity DIR --work-dir W` on an export whose layer ids were
    shifted after the fact: exit 1, and the JSON report names the key SGLang read. (SGLang only,
    from .venv-sglang found by itself: the module fixture runs both engines on the same code.)"""
    folder = tmp_path / "export"
    shutil.copytree(pipeline.export_dir(), folder)
    shift_layer_ids(folder)
    rc = diagnose.main(["parity", str(folder), "--work-dir", str(pipeline.root), "--positions", "0,1000",
                        "--engines", "sglang", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and not report["ok"] and report["engines"] == ["sglang"]
    for engine in ("sglang",):
        r = report["cases"][0]["engines"][engine]
        assert r["steps"] and all(s["relative"] <= LOGIT_TOLERANCE for s in r["steps"])  # the forward is as trained
        assert any(f["field"] and "eagle_aux_hidden_state_layer_ids" in f["field"] for f in r["findings"]), r


def test_a_missing_sglang_environment_is_an_error_before_any_work(pipeline, capsys):
    rc = diagnose.main(["parity", str(pipeline.export_dir()), "--sglang-python", "/nonexistent/python"])
    err = capsys.readouterr().err
    assert rc == 2 and "scripts/setup_cpu.sh" in err and "/nonexistent/python" in err
    with pytest.raises(PipelineError, match="setup_cpu.sh"):
        check_parity([], sglang="/nonexistent/python")
