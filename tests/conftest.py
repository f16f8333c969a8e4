"""Shared fixtures (tiny targets, the stages run on a few chats, built once per session) and the tiers.

The suite is three folders, each a marker of the same name, cheapest first:

    tests/unit/    pure functions and single modules on tensors built in the test (under a minute)
    tests/stages/  one or a few stages on the tiny targets, on CPU, without an engine
    tests/e2e/     vLLM's CPU engine, kill -9 faults, the real small target, the demo

`pytest tests/unit` (or `-m unit`) is the quick check; CI runs `pytest tests`, all three.
Helpers the fixtures and tests share (stage builder, chat templates, tiny settings) are in
tests/fixtures.py, imported as a top-level module: tests/ is on sys.path (pytest puts this
file's folder there).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, for `eagle3`

from fixtures import DEMO_CHATS, run_stages  # noqa: E402

from eagle3.stages.s02_extract import engine as extract_engine  # noqa: E402
from eagle3.target import head as target_head  # noqa: E402
from eagle3.demo.tiny import build_tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory) -> dict[str, Path]:
    """Lazily built tiny targets, keyed by kind (llama, deepseek_v3, kimi_k25)."""
    root = tmp_path_factory.mktemp("targets")

    class Targets(dict):
        def __missing__(self, kind):
            self[kind] = build_tiny_target(kind, root / kind)
            return self[kind]

    return Targets()


@pytest.fixture(scope="session")
def tiny_llama(tiny_targets) -> Path:
    return tiny_targets["llama"]


@pytest.fixture(scope="session")
def stage_runs(tmp_path_factory):
    """`stage_runs(target, upto="vocab", chats=60, **overrides)`: a work dir where stages 01..upto
    ran on the first `chats` demo chats (fixtures.run_stages: its tiny defaults, per-stage
    overrides), built once per session for each set of arguments and shared by every test
    that asks for the same. Read-only: a test that writes works on
    `copy_stages(work, tmp_path / ...)`."""
    built: dict[str, Path] = {}

    def run(target: Path, upto: str = "vocab", **kw) -> Path:
        key = repr((str(target), upto, sorted(kw.items())))
        if key not in built:
            built[key] = run_stages(tmp_path_factory.mktemp(f"stages-{upto}"), target, upto=upto, **kw)
        return built[key]

    return run


@pytest.fixture(scope="session")
def prepared_llama(tmp_path_factory, tiny_llama) -> Path:
    """A work dir where stage 01 ran on the shipped demo chats with the tiny Llama. Not from
    `stage_runs`: tests/stages/test_vocab.py builds stage 03 in it."""
    return run_stages(tmp_path_factory.mktemp("work-llama"), tiny_llama, upto="prepare", chats=DEMO_CHATS,
                      prepare=dict(max_length=512, eval_fraction=0.1))


@pytest.fixture(scope="session")
def stages_123(stage_runs, tiny_llama) -> Path:
    """Stages 01-03 on 60 demo chats with the tiny Llama (fixtures.TINY's sizes); read-only."""
    return stage_runs(tiny_llama)


@pytest.fixture
def no_model_load(monkeypatch):
    """Make any attempt to load a model fail loudly: for checks that must happen before."""
    def boom(*a, **k):
        raise AssertionError("a model was loaded although the run should not need one")

    monkeypatch.setattr(extract_engine, "make_backend", boom)
    monkeypatch.setattr(target_head.TargetHead, "load", classmethod(boom))


TIERS = {
    "unit": "pure functions and single modules (tests/unit, under a minute in all)",
    "stages": "stages on the tiny targets, no engine (tests/stages)",
    "e2e": "vLLM's CPU engine, faults, the real target, the demo (tests/e2e)",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "fault: kill -9 / disk-full fault tests (run in CI; the soak is bench/soak_faults.py)")
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what}")


def pytest_collection_modifyitems(config, items):
    """Each test carries its folder's tier as a marker, so `-m unit` selects what `tests/unit` does."""
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
