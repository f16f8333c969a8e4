"""Stages 05 and 06 say how far into the served context the drafter was trained, and
export the rope it was trained with (docs/KIMI_K25.md, "Rope and length as served")."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

from test_export import fake_target, make_work_dir, random_drafter

from eagle3.artifacts.manifest import read_record, write_manifest
from eagle3.serving.drafter_io import CONFIG_NAME
from eagle3.stages.s05_export.config import ExportConfig
from eagle3.stages.s05_export.run import REPORT_JSON, export_drafter
from eagle3.target.info import read_target_info

YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_export_and_evaluate_state_the_trained_reach_and_rope(tmp_path, caplog):
    m = random_drafter(rope_scaling=dict(YARN), rope_theta=50000.0)
    target = fake_target(tmp_path / "kimi", architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2",
                         max_position_embeddings=262144, rope_theta=50000.0, rope_scaling=dict(YARN))
    workdir = make_work_dir(tmp_path / "w", m)
    write_manifest(workdir, "train", params={"max_seq_len": 16384, "ttt_steps": 4}, inputs={}, counts={},
                   outputs=[workdir.best_checkpoint()], record=read_record(workdir, "train", needed_by="test"))
    with caplog.at_level(logging.INFO, logger="eagle3.stages.s05_export.run"):
        out = export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(target)))
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 64.0
    assert cfg["rope_scaling"]["original_max_position_embeddings"] == 4096 and cfg["rope_theta"] == 50000.0
    r = json.loads((workdir.export_dir() / REPORT_JSON).read_text())
    assert r["positions"]["longest_trained_position"] == 16386 and r["positions"]["served_context"] == 262144
    (line,) = [x.getMessage() for x in caplog.records if "trained at positions" in x.getMessage()]
    assert "0-16,386" in line and "yarn rope" in line and "262,144 positions: 6.3% of them were trained" in line
    from eagle3.stages.s06_evaluate.run import _trained_reach

    reach = _trained_reach(workdir, SimpleNamespace(config=cfg), read_target_info(target))
    assert reach == r["positions"]
