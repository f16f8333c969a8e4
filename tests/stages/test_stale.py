"""Stale artifacts are named, not used (eagle3/artifacts/manifest.py).

Two halves. The mechanism on manifests alone, on every edge of the stage graph: a
stage rebuilt after its consumers read it makes every stage built on it refuse, with
the stages to rerun in order, unless `--allow-stale` (recorded). Then the real stages:
each records the manifests it read, and the issue's scenario through the command line
(stage 03 rerun with another draft vocab after stage 04; stage 05 exits 2 naming stage
04; `--allow-stale` exports and says so in its manifest). About 40 s: stages 01-05 once
on the tiny Llama, a few CLI runs.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import ROOT, TINY_TRAIN

from eagle3.artifacts.manifest import (_load, completed, find_stale, manifest_fingerprint, read_manifest, stage_run,
                                       write_manifest)
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.core.stages import STAGE

# The stage graph (README): which manifests each stage reads.
GRAPH = {
    "generate": [],
    "prepare": ["generate"],
    "extract": ["prepare"],
    "vocab": ["prepare"],
    "train": ["prepare", "extract", "vocab"],
    "export": ["train", "extract", "vocab"],
    "evaluate": ["prepare", "export"],
}
if "generate" not in STAGE:  # stage 00 not in this checkout yet
    GRAPH.pop("generate")
    GRAPH["prepare"] = []
ORDER = list(GRAPH)
EDGES = [(up, down) for down, ups in GRAPH.items() for up in ups]
FOLDER = {s: STAGE[s].folder for s in STAGE}


def descendants(stage: str) -> set[str]:
    out = {d for d, ups in GRAPH.items() if stage in ups}
    for d in list(out):
        out |= descendants(d)
    return out


def ancestors_or_self(stage: str) -> set[str]:
    out = {stage}
    for u in GRAPH[stage]:
        out |= ancestors_or_self(u)
    return out


def fake_stage(workdir: WorkDir, stage: str, version: int = 0) -> None:
    """A stage as far as manifests go: read its inputs, write its manifest."""
    for up in GRAPH[stage]:
        read_manifest(workdir, up, needed_by=f"fake {stage}")
    write_manifest(workdir, stage, params={"version": version}, inputs={}, counts={}, outputs=[], record=None)


@pytest.fixture
def chain(tmp_path) -> WorkDir:
    workdir = WorkDir(tmp_path / "work")
    for s in ORDER:
        fake_stage(workdir, s)
    return workdir


def test_each_manifest_records_what_its_stage_read(chain):
    for s in ORDER:
        m = json.loads(chain.manifest(s).read_text())
        assert sorted(m["consumed"]) == sorted(GRAPH[s]) and m["stale"] == []


@pytest.mark.parametrize("up,down", EDGES, ids=[f"{u}->{d}" for u, d in EDGES])
def test_every_edge_a_rebuilt_input_makes_its_consumers_refuse(chain, up, down):
    fake_stage(chain, up, version=1)  # e.g. stage 03 rerun with another --draft-vocab-size
    for reader in ORDER:
        if not descendants(up) & ancestors_or_self(reader):
            read_manifest(chain, reader, needed_by="test")  # fresh: no complaint
            continue
        with pytest.raises(PipelineError) as e:
            read_manifest(chain, reader, needed_by="test")
        msg = str(e.value)
        if reader == down:
            assert f"{FOLDER[up]} was rebuilt after {FOLDER[down]} consumed it" in msg
        # every stage built on the rebuilt one, each by its script with --force, in pipeline order
        hints = [f"`python {STAGE[s].script} --work-dir {chain.root} --force` (with your --config)"
                 for s in sorted(descendants(up), key=ORDER.index)]
        assert "rerun " + ", then ".join(hints) + "; or pass --allow-stale" in msg, msg
        # the reader's own chain: the links and the stages between the rebuilt one and the reader
        links, rerun = find_stale(chain, _load(chain.manifest(reader)))
        assert rerun == sorted(descendants(up) & ancestors_or_self(reader), key=ORDER.index)
        assert links and all(k.upstream == up for k in links)


def test_transitive_05_refuses_when_01_changed_and_names_the_chain(chain):
    fake_stage(chain, "prepare", version=1)
    with pytest.raises(PipelineError) as e:
        read_manifest(chain, "train", needed_by="stage 05")
    msg = str(e.value)
    assert "01_dataset was rebuilt after 02_hidden_states consumed it" in msg
    assert "01_dataset was rebuilt after 03_vocab consumed it" in msg
    assert msg.index("02_extract_hidden_states.py") < msg.index("03_build_vocab_mapping.py") \
        < msg.index("04_train_drafter.py")
    # Rerunning in that order repairs it.
    for s in ("extract", "vocab", "train"):
        fake_stage(chain, s, version=1)
    read_manifest(chain, "train", needed_by="stage 05")


def test_allow_stale_proceeds_and_records_it(chain, caplog):
    fake_stage(chain, "vocab", version=1)
    with stage_run(allow_stale=True, config="configs/tiny-llama.yaml"), caplog.at_level(logging.WARNING):
        fake_stage(chain, "export", version=1)
    assert "--allow-stale: 03_vocab was rebuilt after 04_train consumed it" in caplog.text
    assert "`python 04_train_drafter.py --config configs/tiny-llama.yaml --force`" in caplog.text
    m = json.loads(chain.manifest("export").read_text())
    assert m["stale"] == ["03_vocab was rebuilt after 04_train consumed it (read through 04_train)"]
    # The setting ends with the stage: the next one refuses again, naming the config.
    with pytest.raises(PipelineError, match="03_vocab was rebuilt after 04_train consumed it"):
        fake_stage(chain, "export", version=2)
    with stage_run(config="configs/x.yaml"), pytest.raises(PipelineError, match="--config configs/x.yaml --force"):
        fake_stage(chain, "export", version=2)


def test_a_rebuild_with_the_same_content_is_not_stale(chain):
    before = manifest_fingerprint(_load(chain.manifest("vocab")))
    fake_stage(chain, "vocab", version=0)  # --force with the same inputs: same manifest but for `created`
    assert manifest_fingerprint(_load(chain.manifest("vocab"))) == before
    for s in ORDER:
        read_manifest(chain, s, needed_by="test")


def test_an_unreadable_upstream_is_stale_and_a_removed_one_is_only_warned(chain, caplog):
    chain.manifest("vocab").write_text("{not json")
    with pytest.raises(PipelineError, match="03_vocab was changed \\(unreadable now\\) after 04_train consumed it, so .*: "
                                            "rerun .*03_build_vocab_mapping.py.*, then .*04_train_drafter.py"):
        read_manifest(chain, "train", needed_by="test")
    shutil.rmtree(chain.stage_dir("vocab"))  # freed for space after training: nothing to disagree with
    with caplog.at_level(logging.WARNING):
        read_manifest(chain, "train", needed_by="test")
    assert "which is gone" in caplog.text


def test_reads_are_kept_per_work_dir_and_only_upstream_stages_are_recorded(tmp_path):
    a, b = WorkDir(tmp_path / "a"), WorkDir(tmp_path / "b")
    for s in ORDER:
        fake_stage(a, s)
    fake_stage(b, ORDER[0])
    read_manifest(a, "export", needed_by="a summary")  # a read in another work dir ...
    read_manifest(b, ORDER[0], needed_by="test")
    read_manifest(a, "evaluate", needed_by="a summary")
    write_manifest(a, "vocab", params={}, inputs={}, counts={}, outputs=[], record=None)  # ... and of later stages
    assert json.loads(a.manifest("vocab").read_text())["consumed"] == {}
    write_manifest(b, "extract", params={}, inputs={}, counts={}, outputs=[], record=None)
    assert sorted(json.loads(b.manifest("extract").read_text())["consumed"]) == [ORDER[0]]
    # A stage that finds itself complete ends its run: its reads are not carried into the next one.
    read_manifest(b, ORDER[0], needed_by="test")
    done = completed(b, "extract", {}, {})  # the manifest on disk, as written above
    assert done.path == b.manifest("extract") and done.to_json() == json.loads(b.manifest("extract").read_text())
    assert done.stage == "extract" and sorted(done.consumed) == [ORDER[0]]
    write_manifest(b, "vocab", params={}, inputs={}, counts={}, outputs=[], record=None)
    assert json.loads(b.manifest("vocab").read_text())["consumed"] == {}


# -- the real stages ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline(stage_runs, tiny_llama):
    """Stages 01-05 on 60 demo chats (draft vocab 64); read-only: tests copy it."""
    return WorkDir(stage_runs(tiny_llama, upto="export", prepare=dict(eval_fraction=0.2),
                              extract=dict(dtype="bfloat16"), vocab=dict(draft_vocab_size=64), train=TINY_TRAIN))


def cli(script: str, workdir: WorkDir, target: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / script), "--work-dir", str(workdir.root),
                           "--target-model", str(target), *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_real_stages_record_the_manifests_they_read(pipeline):
    expected = {"prepare": [], "extract": ["prepare"], "vocab": ["prepare"], "train": ["extract", "prepare", "vocab"],
                "export": ["extract", "prepare", "train", "vocab"]}  # the model card describes stage 01's data
    for stage, ups in expected.items():
        m = read_manifest(pipeline, stage, needed_by="test")
        assert sorted(m.consumed) == ups, stage
        for up in ups:  # each is the fingerprint of the manifest now on disk
            assert m.consumed[up] == manifest_fingerprint(
                read_manifest(pipeline, up, needed_by="test"))


def test_vocab_rebuilt_after_training_stops_export_until_allowed_or_retrained(pipeline, tiny_llama, tmp_path):
    from eagle3.stages.s04_train.config import TrainConfig
    from eagle3.stages.s04_train.run import train_drafter

    workdir = WorkDir(tmp_path / "work")
    shutil.copytree(pipeline.root, workdir.root)
    r = cli("03_build_vocab_mapping.py", workdir, tiny_llama, "--draft-vocab-size", "48")
    assert r.returncode == 0, r.stderr[-2000:]

    r = cli("05_export_drafter.py", workdir, tiny_llama, "--force")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "03_vocab was rebuilt after 04_train consumed it" in r.stderr
    assert f"rerun `python 04_train_drafter.py --work-dir {workdir.root} --force` (with your --config)" in r.stderr
    assert "Traceback" not in r.stderr
    exported = json.loads(workdir.manifest("export").read_text())
    assert exported["stale"] == []  # the refused run left the old export as it was

    # Stage 06 reads stage 05's manifest before starting any engine: it refuses too.
    r = cli("06_evaluate_drafter.py", workdir, tiny_llama)
    assert r.returncode == 2 and "03_vocab was rebuilt after 04_train consumed it" in r.stderr, r.stderr[-2000:]

    r = cli("05_export_drafter.py", workdir, tiny_llama, "--force", "--allow-stale")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--allow-stale: 03_vocab was rebuilt after 04_train consumed it" in r.stderr
    m = json.loads(workdir.manifest("export").read_text())
    assert m["stale"] == ["03_vocab was rebuilt after 04_train consumed it (read through 04_train)"]
    assert json.loads((workdir.export_dir() / "config.json").read_text())["draft_vocab_size"] == 64  # the old drafter

    # Retraining on the new mapping repairs the chain: export runs without the flag.
    train_drafter(TrainConfig(work_dir=workdir.root, target_model=str(tiny_llama), force=True, **TINY_TRAIN))
    r = cli("05_export_drafter.py", workdir, tiny_llama)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(workdir.manifest("export").read_text())
    assert m["stale"] == [] and json.loads((workdir.export_dir() / "config.json").read_text())["draft_vocab_size"] == 48


def test_dataset_rebuilt_names_every_stage_to_rerun(pipeline, tiny_llama, tmp_path):
    from eagle3.stages.s05_export.config import ExportConfig
    from eagle3.stages.s05_export.run import export_drafter

    workdir = WorkDir(tmp_path / "work")
    shutil.copytree(pipeline.root, workdir.root)
    m01 = json.loads(workdir.manifest("prepare").read_text())
    data = next(k.split(":", 1)[1] for k in m01["inputs"] if k.startswith("data:"))
    r = cli("01_prepare_dataset.py", workdir, tiny_llama, "--data", data, "--max-length", "256", "--eval-fraction", "0.3",
            "--num-workers", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    with pytest.raises(PipelineError) as e:
        export_drafter(ExportConfig(work_dir=workdir.root, target_model=str(tiny_llama), force=True))
    msg = str(e.value)
    assert "01_dataset was rebuilt after 02_hidden_states consumed it" in msg  # its first input
    # One message lists every rerun the work dir needs, in order (stage 05 itself last).
    order = [msg.index(f"`python {s} --work-dir {workdir.root} --force`") for s in (
        "02_extract_hidden_states.py", "03_build_vocab_mapping.py", "04_train_drafter.py", "05_export_drafter.py")]
    assert order == sorted(order) and "01_prepare_dataset.py" not in msg
