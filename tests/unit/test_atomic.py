"""Atomic writes are durable (eagle3/artifacts/atomic.py): what was written is fsynced before the
rename that makes it visible, and the folder that holds the new name after it. Every fsync
and rename is recorded in order; no disk is harmed. Well under a second."""
from pathlib import Path

import pytest
from fixtures import record_fsyncs_and_renames

from eagle3.artifacts.atomic import atomic_path, save_torch, write_json


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, str]]:
    return record_fsyncs_and_renames(monkeypatch)


def test_a_file_is_fsynced_before_its_rename_and_its_folder_after(tmp_path, events):
    """Before, nothing was fsynced: after a power loss (or on NFS, from a client's page cache)
    the new name could point to bytes never written, while a deletion made after it was not."""
    tmp_path = tmp_path.resolve()
    for write, name in ((lambda p: write_json(p, {"a": 1}), "a.json"), (lambda p: save_torch(p, {"b": 2}), "b.pt")):
        events.clear()
        write(tmp_path / name)
        (kind, written), renamed, folder = events
        assert kind == "fsync" and Path(written).name == name and Path(written).parent.parent == tmp_path
        assert renamed == ("rename", str(tmp_path / name)) and folder == ("fsync", str(tmp_path))


def test_a_written_folder_is_fsynced_file_by_file_before_its_rename(tmp_path, events):
    """A folder target (a `datasets.save_to_disk`): every file and sub-folder, then the folder."""
    tmp_path = tmp_path.resolve()
    with atomic_path(tmp_path / "ds") as tmp:
        (tmp / "sub").mkdir(parents=True)
        (tmp / "data.arrow").write_text("1")
        (tmp / "sub" / "state.json").write_text("2")
    renamed = events.index(("rename", str(tmp_path / "ds")))
    flushed = {str(Path(p).relative_to(tmp)) for kind, p in events[:renamed] if kind == "fsync"}
    assert flushed == {"data.arrow", "sub", "sub/state.json", "."}
    assert events[renamed + 1:] == [("fsync", str(tmp_path))]
