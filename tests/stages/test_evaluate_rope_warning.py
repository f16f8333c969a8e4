"""Stage 06 warns, before any engine starts, when an SGLang installed beside vLLM (here or in
`.venv-sglang`) scales the drafter's yarn rope otherwise than training did (SGLang up to
0.5.15.post1 ignores mscale / mscale_all_dim: eagle3/serving/engine_rules.py `yarn_reading_warnings`)."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
from fixtures import TINY_TRAIN

from eagle3.artifacts.workdir import WorkDir
from eagle3.serving.drafter_io import CONFIG_NAME

K25_YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


class EngineStarted(Exception):
    pass


@pytest.mark.parametrize("sglang, warned", [("0.5.15.post1", True), ("0.5.16", False)])
def test_stage_06_warns_of_an_sglang_that_reads_the_yarn_rope_otherwise(sglang, warned, stage_runs, tiny_llama,
                                                                         tmp_path, monkeypatch, caplog):
    from eagle3.stages.s06_evaluate import run as evaluate_run
    from eagle3.stages.s06_evaluate.config import EvaluateConfig

    def no_engine(name, *a, **k):
        raise EngineStarted(name)

    monkeypatch.setattr(evaluate_run, "run_engine", no_engine)
    monkeypatch.setattr(evaluate_run, "installed_engine_versions", lambda: {"vllm": "0.32.0", "sglang": sglang})
    workdir = WorkDir(stage_runs(tiny_llama, upto="export", prepare=dict(eval_fraction=0.2), extract=dict(dtype="bfloat16"),
                            vocab=dict(draft_vocab_size=64), train=TINY_TRAIN))  # the run test_stale.py shares
    drafter = tmp_path / "drafter"
    shutil.copytree(workdir.export_dir(), drafter)
    cfg = json.loads((drafter / CONFIG_NAME).read_text())
    cfg["rope_scaling"] = K25_YARN
    (drafter / CONFIG_NAME).write_text(json.dumps(cfg))
    work = tmp_path / "work"
    shutil.copytree(workdir.root, work, ignore=shutil.ignore_patterns("06_*"))
    with caplog.at_level(logging.WARNING), pytest.raises(EngineStarted):
        evaluate_run.evaluate_drafter(EvaluateConfig(work_dir=work, target_model=str(tiny_llama), drafter_dir=drafter,
                                                     max_new_tokens=8))
    lines = [r.getMessage() for r in caplog.records if "scales this drafter's yarn rope" in r.getMessage()]
    if warned:
        assert len(lines) == 1 and f"sglang {sglang} scales this drafter's yarn rope by 1.4159" in lines[0], lines
        assert str(drafter) in lines[0]
    else:
        assert lines == []
