"""What stage 06 may replace in its folder: a complete measurement is kept before another
replaces it (other prompts, another drafter, --force), its figures copied to
06_evaluate/previous/WHEN-ID/ before the new measurement writes a byte
(eagle3/stages/s06_evaluate/previous.py); and one measurement runs per work dir at a time
(06_evaluate is claimed, eagle3/artifacts/claims.py)."""
from __future__ import annotations

import json
import shutil

import pytest
from fixtures import TINY_TRAIN, claim_held_elsewhere

from eagle3.artifacts.manifest import write_manifest
from eagle3.artifacts.records import EvaluateRecord
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.stages.s06_evaluate.config import EvaluateConfig
from eagle3.stages.s06_evaluate.previous import PREVIOUS, keep_previous_measurement


class EngineStarted(Exception):
    pass


def measured(workdir: WorkDir, marker: str) -> dict:
    """A complete measurement as stage 06 leaves one (its files' bytes by relative path)."""
    d = workdir.evaluate_dir()
    (d / "runs").mkdir(parents=True, exist_ok=True)
    (d / "logs").mkdir(exist_ok=True)
    (d / "untrained_drafter").mkdir(exist_ok=True)
    (d / "untrained_drafter" / "model.safetensors").write_bytes(b"scratch weights")
    workdir.evaluate_results().write_text(json.dumps({"acceptance_length": 1.5, "prompts": marker}))
    workdir.engine_result("trained").write_text(json.dumps({"runs": {"trained": {"prompts": marker}}}))
    workdir.engine_log("trained").write_text(f"served {marker}\n")
    workdir.selection_results().write_text(json.dumps({"chosen_step": 4}))
    write_manifest(workdir, "evaluate", params={"prompts": marker}, inputs={}, counts={},
                   outputs=[workdir.evaluate_results()], record=EvaluateRecord(drafter_dir="d", target_model="t"))
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and not p.is_relative_to(d / "untrained_drafter")}


def exported_work_dir(stage_runs, tiny_llama, tmp_path, monkeypatch):
    """(evaluate_drafter, a private work dir where stages 01-05 ran): its engines replaced by
    one that stops the stage as it starts (EngineStarted), after every file check."""
    from eagle3.stages.s06_evaluate import run as evaluate_run

    def no_engine(name, *a, **k):
        raise EngineStarted(name)

    monkeypatch.setattr(evaluate_run, "run_engine", no_engine)
    base = WorkDir(stage_runs(tiny_llama, upto="export", prepare=dict(eval_fraction=0.2),
                              extract=dict(dtype="bfloat16"), vocab=dict(draft_vocab_size=64), train=TINY_TRAIN))
    shutil.copytree(base.root, tmp_path / "work", ignore=shutil.ignore_patterns("06_*"))
    return evaluate_run.evaluate_drafter, WorkDir(tmp_path / "work")


def test_a_measurement_is_copied_once_with_every_figure_but_the_scratch_weights(tmp_path):
    workdir = WorkDir(tmp_path / "w")
    assert keep_previous_measurement(workdir) is None  # nothing measured yet
    figures = measured(workdir, "mt-bench")
    kept = keep_previous_measurement(workdir)
    assert kept.parent == workdir.evaluate_dir() / PREVIOUS
    assert {str(p.relative_to(kept)): p.read_bytes() for p in sorted(kept.rglob("*")) if p.is_file()} == figures
    assert keep_previous_measurement(workdir) == kept  # a second ask (selection, then measurement): one copy
    assert [p.name for p in (workdir.evaluate_dir() / PREVIOUS).iterdir()] == [kept.name]


def test_a_new_measurement_keeps_the_previous_one_before_it_writes(stage_runs, tiny_llama, tmp_path, monkeypatch):
    """Measured on MT-Bench, then rerun on another prompt set: by the time the first engine
    starts, the MT-Bench figures are kept whole under previous/ (the manifest that marked
    them complete is dropped from the top level at that point)."""
    evaluate, workdir = exported_work_dir(stage_runs, tiny_llama, tmp_path, monkeypatch)
    work = workdir.root
    figures = measured(workdir, "mt-bench")
    with pytest.raises(EngineStarted):
        evaluate(EvaluateConfig(work_dir=work, target_model=str(tiny_llama), max_new_tokens=8, timing_prompts=0))
    assert not workdir.manifest("evaluate").exists()
    (kept,) = (workdir.evaluate_dir() / PREVIOUS).iterdir()
    assert {str(p.relative_to(kept)): p.read_bytes() for p in sorted(kept.rglob("*")) if p.is_file()} == figures


def test_a_second_measurement_on_one_work_dir_is_refused_while_one_runs(stage_runs, tiny_llama, tmp_path,
                                                                        monkeypatch):
    """While a live process holds 06_evaluate (a measurement under way), another is refused in
    one line before it writes a byte: the folder's files stay as they were."""
    evaluate, workdir = exported_work_dir(stage_runs, tiny_llama, tmp_path, monkeypatch)
    work = workdir.root
    figures = measured(workdir, "mt-bench")
    with claim_held_elsewhere(workdir.evaluate_dir(), "stage 06"):
        with pytest.raises(PipelineError, match="one writer per folder"):
            evaluate(EvaluateConfig(work_dir=work, target_model=str(tiny_llama), max_new_tokens=8, timing_prompts=0,
                                    force=True))
        d = workdir.evaluate_dir()
        assert {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
                and not p.is_relative_to(d / "untrained_drafter") and not p.name.startswith(".claim")} == figures
    with pytest.raises(EngineStarted):  # its holder gone: taken over, and measured (up to the first engine)
        evaluate(EvaluateConfig(work_dir=work, target_model=str(tiny_llama), max_new_tokens=8, timing_prompts=0))
    assert not (workdir.evaluate_dir() / ".claim.json").exists()
