"""Atomic file writes: write under a temporary name in the same folder, then rename.

A stage killed midway must never leave a file that looks complete. `os.replace`
within one filesystem is atomic, so readers see either the old file or the new
one, never half of one.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` on success.

    Works for files and for folders (e.g. a `datasets.save_to_disk` target).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    target = tmp / path.name
    try:
        yield target
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        os.replace(target, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: Path | str, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_numpy(path: Path | str, array) -> None:
    import numpy as np

    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, array)


def save_torch(path: Path | str, obj) -> None:
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
