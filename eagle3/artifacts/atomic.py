"""Atomic file writes: write under a temporary name in the same folder, then rename.

A stage killed midway must never leave a file that looks complete. `os.replace`
within one filesystem is atomic, so readers see either the old file or the new
one, never half of one.

A rename is atomic, not durable: after a power loss (or, on a network filesystem,
when the client's page cache never reached the server) the new name can point to a
file whose bytes were never written, while a deletion made after it was committed at
once. So `atomic_path` fsyncs what it wrote (the file, or every file and folder of a
written folder) before the rename, and the folder that holds the name after it:
once it returns, the file and its name are on disk. Stage 04 relies on that before it
deletes a trained window (eagle3/stages/s04_train/windows.py).

A full disk (ENOSPC, or a quota: EDQUOT) while writing becomes a `DiskFullError`
naming the path, the bytes it needs and the bytes free; the temporary file is
removed, so the next run after space is freed starts that file again.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eagle3.core.errors import PipelineError

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# fsync of a folder: some filesystems refuse it (EINVAL); its entries are then as durable
# as that filesystem makes them, and nothing more can be asked of it.
_NO_DIR_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF)

log = logging.getLogger(__name__)


class DiskFullError(PipelineError):
    """No space left where a stage writes; the message says how much is needed and free."""


# Below this many free bytes a failed write is taken for a full disk: not every writer
# says ENOSPC (measured on a full tmpfs: numpy raises "N requested and M written"
# without errno, torch.save a RuntimeError "unexpected pos").
NEARLY_FULL_BYTES = 1 << 20


def is_disk_full(e: BaseException) -> bool:
    return isinstance(e, OSError) and (e.errno in DISK_FULL_ERRNOS or "No space left on device" in str(e))


def _looks_disk_full(e: BaseException, path: Path) -> bool:
    return is_disk_full(e) or (isinstance(e, (OSError, RuntimeError)) and free_bytes(path) < NEARLY_FULL_BYTES)


def free_bytes(path: Path | str) -> int:
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def disk_full_error(path: Path | str, *, needed: int | None, written: int | None = None) -> DiskFullError:
    if needed is not None:
        need = f"it needs {needed:,} bytes"
    elif written:
        need = f"it needs more than the {written:,} bytes written before the disk filled"
    else:
        need = "the disk filled before any byte of it was written"
    return DiskFullError(
        f"no space left on the device writing {path}: {need}, {free_bytes(path):,} bytes are free there. Free "
        f"space (or use a --work-dir on a larger disk) and rerun the same command: finished files are kept, "
        f"the partial one was removed.")


def _bytes_under(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(q.stat().st_size for q in p.rglob("*") if q.is_file()) if p.is_dir() else 0


def fsync_path(path: Path | str) -> None:
    """Flush a file's (or a folder's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (os.path.isdir(path) and e.errno in _NO_DIR_FSYNC):
            raise
        log.debug("fsync of folder %s refused by its filesystem (%s)", path, e)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync a file, or every file and folder under a folder and the folder itself."""
    if path.is_dir() and not path.is_symlink():
        for root, dirs, files in os.walk(path):
            for name in files:
                if not os.path.islink(os.path.join(root, name)):
                    fsync_path(os.path.join(root, name))
            for name in dirs:
                fsync_path(os.path.join(root, name))
    if path.exists():
        fsync_path(path)


def _replace_folder(new: Path, path: Path) -> None:
    """Put folder `new` at `path` in place of the folder there, which is renamed aside to
    `.<name>.old-<random>` beside it and deleted last. A kill between the two renames leaves
    it complete under that name; a failed deletion leaves it there with a warning."""
    # Not rmtree then rename: a deletion failing partway (an NFS `.nfsXXXX` file a server still
    # holds open, EACCES) or a kill before the rename would lose the old folder and the new.
    # mkdtemp reserves a unique aside name; renaming a folder onto an empty one replaces it.
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
    try:
        os.replace(path, aside)
        os.replace(new, path)
    except BaseException:
        _put_back(aside, path)
        raise
    try:
        # The new name must be on disk before the old content is deleted.
        fsync_path(path.parent)
    except BaseException:
        log.warning("the old folder of %s is kept, complete, at %s", path, aside)
        raise
    try:
        shutil.rmtree(aside)
    except OSError as e:
        # The new folder is complete and in place: leave the rest of the old one to a person.
        log.warning("replaced the folder %s but could not delete the old one, left (partly) at %s: %s",
                    path, aside, e)


def _put_back(aside: Path, path: Path) -> None:
    """After a failed (or interrupted) `_replace_folder`: the old folder at `path` again."""
    try:
        if os.path.lexists(path):
            os.rmdir(aside)  # the old folder never left: only the reserved empty name is removed
        else:
            os.replace(aside, path)
    except OSError as e:
        log.error("could not put the old folder %s back (%s): it is complete at %s", path, e, aside)


@contextmanager
def atomic_path(path: Path | str, expected_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` on success.

    Works for files and for folders (e.g. a `datasets.save_to_disk` target).
    `expected_bytes` (when the caller knows it) is what a disk-full message names.
    What was written is fsynced before the rename, `path`'s folder after it.
    A folder already at `path` is deleted only once the new one is in place.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(path, needed=expected_bytes) from e
        raise
    target = tmp / path.name
    try:
        yield target
        fsync_tree(target)
        if path.is_dir() and not path.is_symlink():
            _replace_folder(target, path)
        else:
            os.replace(target, path)
            fsync_path(path.parent)
    except (OSError, RuntimeError) as e:
        full, written = _looks_disk_full(e, path.parent), _bytes_under(target)
        shutil.rmtree(tmp, ignore_errors=True)  # first, so the message counts the space it held as free
        if full:
            raise disk_full_error(path, needed=expected_bytes, written=written) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path | str, obj) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    with atomic_path(path, expected_bytes=len(text.encode())) as tmp:
        tmp.write_text(text)


def save_numpy(path: Path | str, array) -> None:
    import numpy as np

    array = np.asanyarray(array)
    with atomic_path(path, expected_bytes=array.nbytes + 128) as tmp:  # + the .npy header
        with open(tmp, "wb") as f:
            np.save(f, array)


def save_torch(path: Path | str, obj) -> None:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
