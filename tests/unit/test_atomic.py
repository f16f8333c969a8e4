"""Atomic writes are durable (eagle3/artifacts/atomic.py): what was written is fsynced before the
rename that makes it visible, and the folder that holds the new name after it. Every fsync
and rename is recorded in order; no disk is harmed. A folder replaced is never lost: its
removal failing, or a stop or kill between the renames, leaves the complete old or new one.
About a second."""
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import record_fsyncs_and_renames

from eagle3.artifacts.atomic import atomic_path, save_torch, write_json

ROOT = Path(__file__).resolve().parents[2]


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


# -- replacing a folder: at every instant the complete old folder or the complete new one ----
def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


OLD = {"config.json": b'{"old": 1}\n', "model.safetensors": b"old weights \x00\x01", "sub/state.json": b"old state"}
NEW = {"config.json": b'{"new": 2}\n', "model.safetensors": b"new weights \x02\x03\x04", "extra.txt": b"new only"}


def write_files(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def test_a_failed_removal_of_the_old_folder_keeps_the_new_one_and_names_the_leftover(tmp_path, monkeypatch,
                                                                                      caplog):
    """Before, the old folder was rmtree'd in place: a removal failing partway (an NFS `.nfsXXXX`
    file a server still holds open) left it half-deleted and the error handler deleted the new
    one too. Now the new folder is in place and a warning names what is left of the old one."""
    out = tmp_path / "drafter"
    write_files(out, {**OLD, ".nfs000000000001": b"held open"})
    real_rmtree = shutil.rmtree

    def rmtree(p, ignore_errors=False, **kw):
        if ignore_errors:  # the temporary folder's cleanup
            return real_rmtree(p, ignore_errors=True, **kw)
        (Path(p) / "config.json").unlink()  # partway: one file gone, then the held one refuses
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(Path(p) / ".nfs000000000001"))

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    with caplog.at_level(logging.WARNING, logger="eagle3.artifacts.atomic"), atomic_path(out) as tmp:
        write_files(tmp, NEW)
    assert files_under(out) == NEW
    leftovers = [p for p in tmp_path.iterdir() if p != out]
    assert [p.name[:len(".drafter.old-")] for p in leftovers] == [".drafter.old-"]  # no temporary either
    assert str(leftovers[0]) in caplog.text and "could not delete the old one" in caplog.text
    assert ".nfs000000000001" in files_under(leftovers[0])


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), OSError(errno.EIO, os.strerror(errno.EIO))],
                         ids=["interrupt", "oserror"])
def test_a_stop_before_the_new_folder_is_renamed_into_place_puts_the_old_one_back(tmp_path, monkeypatch, stop):
    """Before, the old folder was gone before the new one's rename was tried: stopping there left
    nothing at the path. Now the old folder, moved aside, is renamed back, complete."""
    out = tmp_path / "train"
    write_files(out, OLD)
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name == "train" and Path(src).parent.name.endswith(".tmp"):  # the new folder's rename
            raise stop
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(type(stop)), atomic_path(out) as tmp:
        write_files(tmp, NEW)
    assert files_under(out) == OLD
    assert os.listdir(tmp_path) == ["train"]  # the aside name and the temporary are gone


def test_a_kill_between_the_two_renames_leaves_the_complete_old_folder_aside(tmp_path):
    """A real SIGKILL right after the old folder is moved aside: before, the old folder had been
    deleted by then; now it is complete under `.<name>.old-<random>`, for a person or a rerun."""
    out = tmp_path / "train"
    write_files(out, OLD)
    child = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys; from pathlib import Path; from eagle3.artifacts.atomic import atomic_path\n"
        "real = os.replace\n"
        "def replace(src, dst):\n"
        "    if Path(src).parent.name.endswith('.tmp'): os.kill(os.getpid(), signal.SIGKILL)\n"
        "    real(src, dst)\n"
        "os.replace = replace\n"
        "with atomic_path(Path(sys.argv[1])) as tmp:\n"
        "    tmp.mkdir(); (tmp / 'config.json').write_bytes(b'new')\n"), str(out)], check=False, cwd=ROOT)
    assert child.returncode == -signal.SIGKILL
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".train.old-")]
    assert len(aside) == 1 and files_under(aside[0]) == OLD
