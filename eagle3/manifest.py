"""Stage manifests: what each stage wrote, from what, with which parameters.

Every stage finishes by writing `WORK/<stage>/manifest.json` (last, atomically), so
a manifest's presence means the stage completed. It records the format version,
the stage's identity parameters, fingerprints of its inputs, counts, and the size
and sha256 of every output file. A stage reads its inputs' manifests before any
work (`read_manifest`), and skips itself when its own manifest already matches
its parameters and inputs (`completed`).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .atomic import write_json
from .errors import PipelineError
from .workdir import WorkDir

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def sha256_file(path: Path | str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Fingerprint of a JSON-able object, independent of key order."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _output_files(paths: Iterable[Path]) -> list[Path]:
    files = []
    for p in paths:
        p = Path(p)
        files += sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    return files


@dataclass
class Manifest:
    stage: str
    params: dict
    inputs: dict  # name -> fingerprint (sha256 hex or a manifest fingerprint)
    counts: dict
    outputs: dict  # path relative to the stage folder -> {"bytes": int, "sha256": str|None}
    extra: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    created: str = ""
    path: Path | None = None  # where it was read from; not serialized

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("path")
        return d


def write_manifest(
    wd: WorkDir,
    stage: str,
    *,
    params: dict,
    inputs: dict,
    counts: dict,
    outputs: Iterable[Path],
    extra: dict | None = None,
    hash_outputs: bool = True,
) -> Manifest:
    """Record a finished stage. Call last: the manifest is the completion mark.

    `hash_outputs=False` records sizes only, for outputs too large to re-read
    (the hidden-state store keeps its own per-shard checksums).
    """
    base = wd.stage_dir(stage)
    out = {}
    for f in _output_files(outputs):
        rel = f.relative_to(base).as_posix()
        out[rel] = {"bytes": f.stat().st_size, "sha256": sha256_file(f) if hash_outputs else None}
    m = Manifest(
        stage=stage, params=params, inputs=inputs, counts=counts, outputs=out, extra=extra or {},
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    write_json(wd.manifest(stage), m.to_json())
    m.path = wd.manifest(stage)
    return m


def _load(path: Path) -> Manifest:
    try:
        d = json.loads(path.read_text())
        d.pop("path", None)
        m = Manifest(**d)
    except (json.JSONDecodeError, TypeError) as e:
        raise PipelineError(f"{path} is not a valid manifest ({e}); rerun the stage with --force.") from e
    m.path = path
    return m


def _outputs_intact(m: Manifest, base: Path) -> str | None:
    """None when every recorded output exists with its recorded size, else the first problem."""
    for rel, info in m.outputs.items():
        f = base / rel
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != info["bytes"]:
            return f"{f} has {f.stat().st_size} bytes, the manifest recorded {info['bytes']}"
    return None


def read_manifest(wd: WorkDir, stage: str, *, needed_by: str) -> Manifest:
    """Read and check the manifest of `stage` before a later stage uses its outputs."""
    path = wd.manifest(stage)
    fix = f"run `python {wd.script(stage)} --work-dir {wd.root}` (with your --config) first"
    if not path.is_file():
        raise PipelineError(f"{needed_by} needs {path}, which does not exist: {fix}.")
    m = _load(path)
    if m.format_version != FORMAT_VERSION:
        raise PipelineError(
            f"{path} has format version {m.format_version}, this code reads {FORMAT_VERSION}: "
            f"rerun `python {wd.script(stage)} --force`.")
    problem = _outputs_intact(m, wd.stage_dir(stage))
    if problem:
        raise PipelineError(f"{needed_by}: {problem} ({path}); rerun `python {wd.script(stage)} --force`.")
    return m


def manifest_fingerprint(m: Manifest) -> str:
    """The identity a downstream stage records for this input."""
    return sha256_json({k: v for k, v in m.to_json().items() if k != "created"})


def completed(wd: WorkDir, stage: str, params: dict, inputs: dict) -> Manifest | None:
    """The existing manifest if the stage already ran with these params and inputs."""
    path = wd.manifest(stage)
    if not path.is_file():
        return None
    try:
        m = _load(path)
    except PipelineError:
        return None
    if m.format_version != FORMAT_VERSION or m.params != _jsonable(params) or m.inputs != _jsonable(inputs):
        return None
    if _outputs_intact(m, wd.stage_dir(stage)):
        return None
    return m


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def check_same(what: str, ours, theirs, *, ours_from: str, theirs_from: str, fix: str) -> None:
    """Raise a PipelineError naming both values when two stages disagree."""
    if ours != theirs:
        raise PipelineError(f"{what} mismatch: {ours!r} ({ours_from}) vs {theirs!r} ({theirs_from}); {fix}.")
