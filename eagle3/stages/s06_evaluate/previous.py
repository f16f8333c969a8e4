"""Stage 06 keeps every complete measurement.

A measurement is hours of GPU time on a large target, and stage 06 is rerun on purpose with
other settings: another prompt set (MT-Bench, then gsm8k), another drafter (--drafter-dir),
another temperature, --select-checkpoint, --force. Its figures live at fixed paths
(results.json, evaluate.png, runs/, logs/, selection.json), so before a new measurement
writes its first byte, the complete one there (its manifest marks it complete) is copied to

    06_evaluate/previous/<UTC time of its manifest>-<first 8 hex of the manifest's sha256>/

with the same names. The copy is made once per measurement (a selection and the measurement
after it both ask), written beside its name and renamed into place, and never deleted by
the pipeline. Left out: the untrained drafter and the selection's candidate folders,
scratch weights that the next run writes again from the same inputs.
"""
from __future__ import annotations

import datetime
import logging
import shutil
from pathlib import Path

from eagle3.artifacts.atomic import atomic_path
from eagle3.artifacts.manifest import sha256_file
from eagle3.artifacts.workdir import MANIFEST_NAME, WorkDir

log = logging.getLogger(__name__)

PREVIOUS = "previous"
KEPT = ("results.json", "evaluate.png", MANIFEST_NAME, "selection.json", "runs", "logs")


def keep_previous_measurement(workdir: WorkDir) -> Path | None:
    """Copy the complete measurement in 06_evaluate to previous/ (once); its folder there, or
    None when there is no complete measurement to keep."""
    manifest = workdir.manifest("evaluate")
    if not manifest.is_file():
        return None
    when = datetime.datetime.fromtimestamp(manifest.stat().st_mtime, datetime.timezone.utc)
    dest = workdir.evaluate_dir() / PREVIOUS / f"{when:%Y%m%dT%H%M%SZ}-{sha256_file(manifest)[:8]}"
    if dest.is_dir():
        return dest
    with atomic_path(dest) as tmp:
        tmp.mkdir()
        for name in KEPT:
            src = workdir.evaluate_dir() / name
            if src.is_dir():
                shutil.copytree(src, tmp / name)
            elif src.is_file():
                shutil.copy2(src, tmp / name)
    log.info("stage 06: the previous measurement in %s is kept in %s before this one replaces it",
             workdir.evaluate_dir(), dest)
    return dest
