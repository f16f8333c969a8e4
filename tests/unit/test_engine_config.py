"""eagle3/engines/config.py: the engine settings of stages 00, 02 and 06 are declared once.

The three stage configs inherit `EngineSettings`; a stage that redeclares one of its
fields (another default or identity flag) must be listed in INTENDED with the reason,
so a copy that drifts (0.9 in one stage, 0.85 in two) fails here. No vLLM import, no
engine started.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from eagle3.core.config import StageConfig, build_config, identity_params
from eagle3.core.errors import PipelineError
from eagle3.engines.config import EngineConfig, EngineSettings
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s00_generate.config import GenerateConfig
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s06_evaluate.config import EvaluateConfig

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"generate": GenerateConfig, "extract": ExtractConfig, "evaluate": EvaluateConfig}
REQUIRED = {"generate": {"data": ["chats.jsonl"]}, "extract": {}, "evaluate": {}}
ENGINE_FIELDS = [f.name for f in dataclasses.fields(EngineSettings)
                 if f.name not in {g.name for g in dataclasses.fields(StageConfig)}]

# (stage, field) -> what differs from EngineSettings' declaration, and why (the comment at
# the redeclaration says the same).
INTENDED = {
    # Stage 00's context length decides where a conversation ends: part of what it generates.
    ("generate", "max_model_len"): {"identity": True},
    # Stage 06's engine runs in a worker process of its own, which the CPU fix patches.
    ("evaluate", "engine_in_process"): {"default": True},
}


def _cfg(stage: str, **kw):
    return STAGES[stage](work_dir=Path("w"), target_model="some/target", **REQUIRED[stage], **kw)


def _declared(f: dataclasses.Field) -> dict:
    return {"default": f.default, "identity": f.metadata["identity"],
            **{k: v for k, v in f.metadata.items() if k not in ("help", "identity")}}


def test_the_engine_fields_are_the_ones_engine_settings_declares():
    assert ENGINE_FIELDS == ["dtype", "tensor_parallel_size", "max_model_len", "gpu_memory_utilization",
                             "kv_cache_gib", "enforce_eager", "engine_in_process"]
    for cls in STAGES.values():
        assert issubclass(cls, EngineSettings)


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_shares_the_declared_fields_and_defaults(stage):
    """Same type, default, identity flag and allowed values as EngineSettings, but for the
    intended overrides; a stage redeclares no engine field outside INTENDED."""
    ours = {f.name: f for f in dataclasses.fields(STAGES[stage])}
    base = {f.name: f for f in dataclasses.fields(EngineSettings)}
    own = set(vars(STAGES[stage]).get("__annotations__", {}))
    for name in ENGINE_FIELDS:
        want = {**_declared(base[name]), **INTENDED.get((stage, name), {})}
        assert _declared(ours[name]) == want, (stage, name)
        assert ours[name].type == base[name].type, (stage, name)
        assert (name in own) == ((stage, name) in INTENDED), f"{stage} redeclares {name} without a reason"


def test_every_intended_override_is_still_one():
    """An INTENDED entry that no longer differs is stale: drop it (and the redeclaration)."""
    base = {f.name: _declared(f) for f in dataclasses.fields(EngineSettings)}
    for (stage, name), diff in INTENDED.items():
        f = {g.name: g for g in dataclasses.fields(STAGES[stage])}[name]
        assert all(base[name][k] != v for k, v in diff.items()), (stage, name)
        assert all(_declared(f)[k] == v for k, v in diff.items()), (stage, name)


def test_identity_flags_stay_per_field():
    """What a stage's manifest records (identity) of the engine and engine-adjacent settings."""
    want = {
        "generate": {"dtype", "max_model_len", "seed"},
        "extract": {"dtype"},
        "evaluate": {"dtype", "seed", "max_num_seqs"},
    }
    for stage, fields in want.items():
        recorded = set(identity_params(_cfg(stage)))
        candidates = set(ENGINE_FIELDS) | {"seed", "max_num_seqs"}
        assert recorded & candidates == fields, stage


def test_one_gpu_memory_default():
    """No stage sets its own number: None, filled per platform when the engine starts."""
    for stage in STAGES:
        assert _cfg(stage).gpu_memory_utilization is None


@pytest.mark.parametrize("stage", STAGES)
def test_engine_config_carries_the_settings_and_what_the_stage_adds(stage):
    cfg = _cfg(stage, dtype="bf16", tensor_parallel_size=2, max_model_len=1024, gpu_memory_utilization=0.7,
               kv_cache_gib=2.5, enforce_eager=True, engine_in_process=True, trust_remote_code=True)
    assert cfg.dtype == "bfloat16"  # one spelling
    e = cfg.engine_config()
    assert isinstance(e, EngineConfig)
    assert (e.model, e.dtype, e.tensor_parallel_size, e.max_model_len, e.gpu_memory_utilization, e.kv_cache_gib,
            e.enforce_eager, e.engine_in_process, e.trust_remote_code) == (
        "some/target", "bfloat16", 2, 1024, 0.7, 2.5, True, True, True)
    # The stage's own values may replace any of them (stage 02: the resolved target, its context).
    e = cfg.engine_config(model="/resolved/target", max_model_len=99)
    assert (e.model, e.max_model_len, e.dtype) == ("/resolved/target", 99, "bfloat16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.dtype = "float16"  # type: ignore[misc]


def test_stage_specific_engine_settings():
    """Stages 00 and 06 add their batch limit and seed; stage 02 its context, at run time."""
    g = _cfg("generate", seed=5, max_num_seqs=32).engine_config()
    assert (g.seed, g.max_num_seqs) == (5, 32)
    v = _cfg("evaluate", seed=2, max_num_seqs=8).engine_config()
    assert (v.seed, v.max_num_seqs, v.engine_in_process) == (2, 8, True)
    x = _cfg("extract").engine_config()
    assert (x.seed, x.max_num_seqs, x.engine_in_process) == (0, None, False)


@pytest.mark.parametrize("stage", STAGES)
def test_engine_settings_are_checked_naming_the_flag(stage):
    with pytest.raises(PipelineError, match=r"`gpu_memory_utilization` = 1.5 is not allowed.*--gpu-memory-util"):
        _cfg(stage, gpu_memory_utilization=1.5)
    with pytest.raises(PipelineError, match=r"`kv_cache_gib` = 0.0 is not allowed.*--kv-cache-gib"):
        _cfg(stage, kv_cache_gib=0.0)
    with pytest.raises(PipelineError, match=r"`dtype` = 'fp64' is not allowed"):
        _cfg(stage, dtype="fp64")


@pytest.mark.parametrize("yaml_path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_file_still_builds_the_engine_stages(yaml_path):
    """The YAML keys stay the field names: each configs/*.yaml builds stages 00, 02 and 06."""
    for stage, cls in STAGES.items():
        overrides = {"work_dir": "w", "target_model": "some/target", **REQUIRED[stage]}
        cfg = build_config(cls, stage, yaml_path, overrides, sections=STAGE_CONFIGS)
        assert cfg.engine_config().model == "some/target"


def test_the_smollm2_engine_settings_reach_the_engine():
    cfg = build_config(GenerateConfig, "generate", ROOT / "configs" / "smollm2-135m.yaml", {"work_dir": "w"},
                       sections=STAGE_CONFIGS)
    e = cfg.engine_config()
    assert e.kv_cache_gib == 4 and e.engine_in_process is True
