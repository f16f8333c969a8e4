"""Target-side parity (eagle3/tools/parity/capture.py): SGLang's own target classes, run on the CPU
with aux-state capture for the drafter config stage 05 writes, capture the states stage 02
stored, within check_stores' tolerance: its Llama class on the tiny Llama, and its DeepSeek-V3
class (MLA + MoE, the Kimi family) on the tiny DeepSeek-V3 given what SGLang's CPU path needs
of a real DeepSeek-V3 config (`deepseek_as_released`). The classic off-by-one (nested ids
written without the -1 SGLang expects) captures the next layers and is caught.

One SGLang worker runs every case. SGLang must import (`.venv-sglang`, scripts/setup_cpu.sh):
otherwise the fixture raises and every test here fails, never skips."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.workdir import WorkDir
from eagle3.tools.check_stores import TOL_MEDIAN, TOL_P90
from eagle3.tools.parity.capture import CaptureCase, capture_parity, format_capture

# Kimi-K2.5's text_config.rope_scaling. SGLang's CPU rope for DeepSeek models takes only its
# yarn (rotary_embedding/factory.py `get_rope_cpu` asserts a "deepseek_yarn" scaling).
K25_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
# Keys every released DeepSeek-V3 / Kimi-K2 config.json has and transformers' own
# DeepseekV3Config does not write, which SGLang's DeepSeek class reads (models/deepseek_v2.py).
RELEASED_KEYS = {"moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "ep_size": 1}


def deepseek_as_released(tiny: Path, out: Path) -> Path:
    """The tiny DeepSeek-V3 with K2.5's yarn rope and the released config keys."""
    shutil.copytree(tiny, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(RELEASED_KEYS, rope_scaling=K25_YARN, rope_theta=10000.0, max_position_embeddings=262144)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


@pytest.fixture(scope="module")
def captures(stages_123, stage_runs, tiny_targets, tmp_path_factory):
    layers = HiddenStateStore.open(WorkDir(stages_123), needed_by="test").aux_layers
    deepseek = deepseek_as_released(tiny_targets["deepseek_v3"], tmp_path_factory.mktemp("ds") / "deepseek_v3")
    work_ds = stage_runs(deepseek, upto="extract")
    reports = capture_parity([CaptureCase("llama", stages_123), CaptureCase("llama-not-lowered", stages_123, layers),
                              CaptureCase("deepseek", work_ds)], samples=4)
    for r in reports.values():
        print(format_capture(r))  # the figures, in the test log
    return reports


@pytest.mark.parametrize("case", ["llama", "deepseek"])
def test_sglangs_target_captures_what_stage_02_stored(captures, case):
    r = captures[case]
    assert r["error"] is None, r["error"]
    # SGLang adds one to the nested ids stage 05 writes (its DeepSeek class too: the first id is 1)
    assert r["nested_ids"] == [k - 1 for k in r["trained_layers"]]
    assert r["captured_layers"] == r["trained_layers"]
    for e in r["layers"]:
        assert e["median"] < TOL_MEDIAN and e["p90"] < TOL_P90, e
    assert r["final"]["ok"], r["final"]
    assert r["ok"]


def test_nested_ids_not_lowered_by_one_capture_the_next_layers_and_fail(captures):
    r = captures["llama-not-lowered"]
    assert r["error"] is None, r["error"]
    assert r["captured_layers"] == [k + 1 for k in r["trained_layers"]]
    assert all(not e["ok"] and e["median"] > TOL_MEDIAN for e in r["layers"]), r["layers"]
    assert not r["ok"]
