"""Target-side parity (eagle3/tools/parity/capture.py): SGLang's own Llama target, run on the CPU
with aux-state capture for the drafter config stage 05 writes, captures the states stage 02
stored for the tiny Llama, within check_stores' tolerance; the classic off-by-one (nested ids
written without the -1 SGLang expects) captures the next layers and is caught.

One SGLang worker runs both configs. SGLang must import (`.venv-sglang`, scripts/setup_cpu.sh):
otherwise the fixture raises and both tests fail, never skip."""
from __future__ import annotations

import pytest

from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.workdir import WorkDir
from eagle3.tools.check_stores import TOL_MEDIAN, TOL_P90
from eagle3.tools.parity.capture import capture_parity, format_capture


@pytest.fixture(scope="module")
def captures(stages_123):
    layers = HiddenStateStore.open(WorkDir(stages_123), needed_by="test").aux_layers
    reports = capture_parity(stages_123, samples=4, variants={"exported": None, "not-lowered": list(layers)})
    for r in reports.values():
        print(format_capture(r))  # the figures, in the test log
    return reports


def test_sglangs_llama_target_captures_what_stage_02_stored(captures):
    r = captures["exported"]
    assert r["error"] is None, r["error"]
    assert r["captured_layers"] == r["trained_layers"]  # SGLang adds one to the nested ids stage 05 writes
    assert r["nested_ids"] == [k - 1 for k in r["trained_layers"]]
    for e in r["layers"]:
        assert e["median"] < TOL_MEDIAN and e["p90"] < TOL_P90, e
    assert r["final"]["ok"], r["final"]
    assert r["ok"]


def test_nested_ids_not_lowered_by_one_capture_the_next_layers_and_fail(captures):
    r = captures["not-lowered"]
    assert r["error"] is None, r["error"]
    assert r["captured_layers"] == [k + 1 for k in r["trained_layers"]]
    assert all(not e["ok"] and e["median"] > TOL_MEDIAN for e in r["layers"]), r["layers"]
    assert not r["ok"]
