"""The window plan (eagle3/artifacts/windows.py): sizes, the one shuffle, deletions that survive a kill
and NFS's kept files, a progress record that is never read as zero when it cannot be read."""
import errno
import logging
import shutil
from pathlib import Path

import pytest

from eagle3.artifacts import store, windows
from eagle3.core.errors import PipelineError


def test_parse_bytes_reads_decimal_and_binary_units_and_names_a_bad_value():
    assert windows.parse_bytes("2TB") == 2 * 10 ** 12
    assert windows.parse_bytes("500GB") == 500 * 10 ** 9
    assert windows.parse_bytes("1.5 TiB") == int(1.5 * 2 ** 40)
    assert windows.parse_bytes("123456") == 123456
    with pytest.raises(PipelineError, match=r"--disk-budget '2 parsecs' is not a size"):
        windows.parse_bytes("2 parsecs")


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_every_window_fits_its_share_of_the_budget_and_the_windows_cover_the_split_once(dtype):
    lengths = [(37 * i) % 300 + 20 for i in range(500)]  # tokens per sample
    H, A, spf = 64, 3, 8
    held = [50] * 20
    budget = 3_000_000
    plan = windows.make_plan(lengths, held, disk_budget=budget, seed=7, passes=2, windows_in_budget=2, spf=spf,
                             H=H, A=A, dtype=dtype)
    assert plan.num_windows >= 4 and plan.rounds == 2 * plan.num_windows
    everything = [i for w in plan.windows for i in w["samples"]]
    assert sorted(everything) == list(range(len(lengths)))  # each sample once
    assert everything != list(range(len(lengths)))  # shuffled
    for w in plan.windows:
        files = [(len(w["samples"][a:a + spf]), sum(lengths[i] for i in w["samples"][a:a + spf]))
                 for a in range(0, len(w["samples"]), spf)]
        assert w["bytes"] == store.bytes_to_write(files, H, A, dtype)  # the files stage 02 writes
        assert w["bytes"] <= plan.window_capacity
        assert w["tokens"] == sum(lengths[i] for i in w["samples"])
    assert plan.peak_bytes <= budget
    assert plan.window_of(plan.num_windows + 1) == plan.windows[1]  # round W+1 = window 1 of pass 1
    same = windows.make_plan(lengths, held, disk_budget=budget, seed=7, passes=2, windows_in_budget=2, spf=spf,
                             H=H, A=A, dtype=dtype)
    assert same.fingerprint == plan.fingerprint
    other = windows.make_plan(lengths, held, disk_budget=budget, seed=8, passes=2, windows_in_budget=2, spf=spf,
                              H=H, A=A, dtype=dtype)
    assert other.windows[0]["samples"] != plan.windows[0]["samples"]


def test_a_budget_below_the_held_out_split_or_one_sample_is_refused():
    with pytest.raises(PipelineError, match="does not even hold the held-out split"):
        windows.make_plan([100] * 10, [100] * 10, disk_budget=1000, seed=0, passes=1, windows_in_budget=1, spf=4,
                          H=64, A=3, dtype="bf16")
    one = store.bytes_to_write([(1, 100)], 64, 3)
    with pytest.raises(PipelineError, match="less than one sample"):
        windows.make_plan([100, 5000], [], disk_budget=one + 10, seed=0, passes=1, windows_in_budget=1, spf=4,
                          H=64, A=3, dtype="bf16")


def test_the_plan_is_written_once_and_another_plan_is_refused(tmp_path):
    a = windows.make_plan([100] * 40, [], disk_budget=10 ** 7, seed=0, passes=1, windows_in_budget=1, spf=4, H=64,
                          A=3, dtype="bf16")
    b = windows.make_plan([100] * 40, [], disk_budget=10 ** 6, seed=0, passes=1, windows_in_budget=1, spf=4, H=64,
                          A=3, dtype="bf16")
    windows.write_or_check_plan(tmp_path, a)
    windows.write_or_check_plan(tmp_path, a)
    assert windows.read_plan(tmp_path).fingerprint == a.fingerprint
    with pytest.raises(PipelineError, match="disk_budget"):
        windows.write_or_check_plan(tmp_path, b)


def test_a_deletion_killed_half_way_never_leaves_a_complete_looking_round_and_is_finished_by_sweep(tmp_path):
    for r in range(3):
        d = tmp_path / windows.round_name(r)
        d.mkdir()
        (d / "train-00000.safetensors").write_bytes(b"x" * 10)
        windows.write_complete(d, {"round": r, "files": []})
    # A deletion killed after its rename: the folder is gone under its own name.
    (tmp_path / windows.round_name(0)).rename(tmp_path / f".deleting-{windows.round_name(0)}")
    assert windows.present_rounds(tmp_path) == [1, 2]
    assert windows.sweep(tmp_path, trained_rounds=2) == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [windows.round_name(2)]


@pytest.mark.parametrize("text", ['{"trained_rounds": 3, "checkp', "", '{"trained_rounds": -1}', '[3]', '\udcff'])
def test_an_unreadable_progress_json_is_an_error_naming_the_file_never_zero_trained(tmp_path, text):
    """Before, a torn progress.json read as 0 rounds trained: restarted producers extracted
    every trained round again. A missing one still means none trained."""
    assert windows.read_progress(tmp_path) == {"trained_rounds": 0}
    (tmp_path / windows.PROGRESS_JSON).write_text(text, errors="surrogateescape")
    with pytest.raises(PipelineError, match=rf"{tmp_path / windows.PROGRESS_JSON} (cannot be read|holds no count).*"
                                            r"04_train_drafter\.py.*rewrites the file from its latest checkpoint"):
        windows.read_progress(tmp_path)
    windows.write_progress(tmp_path, 3, "step-0000010.pt", 10)
    assert windows.read_progress(tmp_path)["trained_rounds"] == 3


def test_a_round_whose_files_nfs_keeps_is_left_for_a_later_sweep_with_a_warning(tmp_path, monkeypatch, caplog):
    """NFS renames a deleted file that a process still has open to .nfsXXXX and keeps it until
    it is closed; until then the folder cannot be removed (ENOTEMPTY). Before, that error
    stopped stage 04 after progress.json was written. Now the removal retries, then leaves the
    renamed folder (never a round) to a later sweep, and says so."""
    d = tmp_path / windows.round_name(0)
    d.mkdir()
    (d / "train-00000.safetensors").write_bytes(b"x" * 10)
    (d / ".nfs0000000000b16d00000001").write_bytes(b"x" * 10)  # a deleted file some process still maps
    real_rmtree, tries = shutil.rmtree, []

    def nfs_rmtree(path, *args, **kwargs):  # the files go, the held one stays, the folder cannot go
        tries.append(path)
        for f in Path(path).iterdir():
            if not f.name.startswith(".nfs"):
                f.unlink()
        raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path))

    monkeypatch.setattr(windows, "REMOVE_RETRY_S", 0.0)
    monkeypatch.setattr(shutil, "rmtree", nfs_rmtree)
    with caplog.at_level(logging.WARNING, logger=windows.__name__):
        assert windows.delete_round(tmp_path, 0)
    left = tmp_path / f".deleting-{windows.round_name(0)}"
    assert len(tries) == windows.REMOVE_RETRIES
    assert windows.present_rounds(tmp_path) == [] and [p.name for p in left.iterdir()] == [".nfs0000000000b16d00000001"]
    assert f"{left} still holds .nfs0000000000b16d00000001" in caplog.text
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)  # the holder closed it: the next start's sweep removes it
    assert windows.sweep(tmp_path, trained_rounds=0) == [0] and list(tmp_path.iterdir()) == []


def test_a_removal_that_fails_for_another_reason_still_raises(tmp_path, monkeypatch):
    d = tmp_path / windows.round_name(0)
    d.mkdir()
    (d / "train-00000.safetensors").write_bytes(b"x")

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(windows, "REMOVE_RETRY_S", 0.0)
    monkeypatch.setattr(shutil, "rmtree", denied)
    with pytest.raises(PermissionError):
        windows.delete_round(tmp_path, 0)


def test_names_in_window_json_outside_the_store_pattern_are_refused_unread(tmp_path, monkeypatch):
    """A window.json on a shared folder naming an absolute or ../ path would make rank 0 read
    and hash any file; such a name is a problem before anything is opened."""
    from eagle3.artifacts.store import format as store_format

    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not a store file")
    d = tmp_path / "shared" / windows.round_name(0)
    d.mkdir(parents=True)
    checksum = store.file_checksum(secret)
    hashed = []
    monkeypatch.setattr(store_format, "file_checksum", lambda path, *a: hashed.append(path) or checksum)
    for name in (str(secret), "../../secret.txt", "train-00000.safetensors/../../../secret.txt"):
        windows.write_complete(d, {"round": 0, "files": [{"name": name, "bytes": secret.stat().st_size,
                                                           "checksum": checksum}]})
        problem = windows.window_problem(d, verify_checksums=True)
        assert problem is not None and "not a store file name" in problem and repr(name) in problem
    assert hashed == []


def test_a_round_folder_is_told_from_other_folders_by_its_file_names():
    """--force deletes a round folder of a shared --windows-dir only when it holds a round's files."""
    round_files = ["train-00000.safetensors", "train-00000.json", ".train-00001.partial-box-7.out", "store.json",
                   "index.json", "window.json", ".claim.json", ".claim-0123abcd.beat", "..claim-0123abcd.beat.x.tmp",
                   ".window.json.x.tmp", ".train-00000.json.x.tmp"]
    assert all(windows.is_round_file(name) for name in round_files)
    assert not any(windows.is_round_file(name) for name in ("thesis.pdf", "train-00000.safetensors.bak", "projects",
                                                            "claims.txt", "window-00001"))
