"""`read_manifest` (eagle3/artifacts/manifest.py) refuses what a later stage must not build on: a
manifest of another format version (older or newer), and a recorded output that was deleted,
truncated or grew since; each refusal names the file and the rerun. Manifests and small files
only (the typed records: test_records.py; staleness across stages: tests/stages/test_stale.py)."""
from __future__ import annotations

import json

import pytest

from eagle3.artifacts.manifest import FORMAT_VERSION, read_manifest, write_manifest
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.core.stages import STAGE

STAGE_NAME = "vocab"


def _stage(tmp_path) -> tuple[WorkDir, list]:
    """A finished stage with two outputs (one in a subfolder), its manifest written last."""
    workdir = WorkDir(tmp_path)
    d = workdir.stage_dir(STAGE_NAME)
    (d / "sub").mkdir(parents=True)
    outs = [d / "mapping.bin", d / "sub" / "counts.json"]
    outs[0].write_bytes(bytes(range(200)))
    outs[1].write_text('{"a": 1}')
    write_manifest(workdir, STAGE_NAME, params={"k": 1}, inputs={}, counts={}, outputs=outs, record=None)
    return workdir, outs


def _refusal(workdir: WorkDir) -> str:
    with pytest.raises(PipelineError) as e:
        read_manifest(workdir, STAGE_NAME, needed_by="stage 04 (train)")
    msg = str(e.value)
    assert f"python {STAGE[STAGE_NAME].script}" in msg and "--force" in msg
    return msg


def test_an_intact_stage_reads_back_with_its_outputs_sizes_and_hashes(tmp_path):
    workdir, outs = _stage(tmp_path)
    m = read_manifest(workdir, STAGE_NAME, needed_by="test")
    assert m.format_version == FORMAT_VERSION and m.params == {"k": 1}
    assert {k: v["bytes"] for k, v in m.outputs.items()} == {"mapping.bin": 200, "sub/counts.json": 8}
    assert all(len(v["sha256"]) == 64 for v in m.outputs.values())


@pytest.mark.parametrize("version", [FORMAT_VERSION - 1, FORMAT_VERSION + 1])
def test_a_manifest_of_another_format_version_is_refused(tmp_path, version):
    """Older: written before the typed records. Newer: written by later code, whose
    fields this code would misread."""
    workdir, _ = _stage(tmp_path)
    on_disk = json.loads(workdir.manifest(STAGE_NAME).read_text())
    on_disk["format_version"] = version
    workdir.manifest(STAGE_NAME).write_text(json.dumps(on_disk))
    msg = _refusal(workdir)
    assert str(workdir.manifest(STAGE_NAME)) in msg
    assert f"format version {version}, this code reads {FORMAT_VERSION}" in msg


def test_a_deleted_output_is_refused(tmp_path):
    workdir, outs = _stage(tmp_path)
    outs[1].unlink()
    msg = _refusal(workdir)
    assert msg.startswith(f"stage 04 (train): {outs[1]} is missing ({workdir.manifest(STAGE_NAME)})")


@pytest.mark.parametrize("size", [199, 201, 0])
def test_an_output_of_another_size_is_refused(tmp_path, size):
    """Truncated (a copy cut short, a full disk), emptied, or grown (appended to)."""
    workdir, outs = _stage(tmp_path)
    outs[0].write_bytes(bytes(size))
    msg = _refusal(workdir)
    assert f"{outs[0]} has {size} bytes, the manifest recorded 200" in msg
