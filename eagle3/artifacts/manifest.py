"""Stage manifests: what each stage wrote, from what, with which parameters.

Every stage finishes by writing `WORK/<stage>/manifest.json` (last, atomically), so
a manifest's presence means the stage completed. It records the format version,
the stage's identity parameters, fingerprints of its inputs, counts, and the size
and sha256 of every output file. A stage reads its inputs' manifests before any
work (`read_manifest`), and skips itself when its own manifest already matches
its parameters and inputs (`completed`).

Typed records. The facts a later stage or tool reads from a stage (aux layer ids,
tokenizer fingerprint, ttt_steps, the best checkpoint, ...) are the manifest's `record`
section: one frozen dataclass per stage (eagle3/artifacts/records.py), written through
`write_manifest(..., record=...)` and read back through `read_record` / `record_of`,
which refuse a manifest without one (format version 1) or with a field missing,
naming the manifest and the rerun. `counts` keeps figures that are only reported.

Stale artifacts. Reading a manifest through `read_manifest` registers it as
consumed by the running stage (stage key -> `manifest_fingerprint`), and
`write_manifest` records that set as `consumed`, so each manifest says which
upstream manifests it was built from. Before a stage uses an input,
`read_manifest` checks, transitively, that every manifest the input was built
from is still the one on disk (05 reads 04, which consumed 03, which consumed
01: if 01 was rebuilt since, 05 refuses and names the stages to rerun, in order).
`--allow-stale` (every script, `stage_run`) turns the refusal into a warning and
the manifest records it under `stale`. The fingerprint leaves out the creation
time, so a rerun that rebuilds the same bytes does not make its consumers stale.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from eagle3.artifacts.atomic import write_json
from eagle3.artifacts.records import RECORDS, Record, record_from_json
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.core.stages import STAGE, stage_index

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: the typed `record` section (eagle3/artifacts/records.py)


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
    extra: dict = field(default_factory=dict)  # notes for a human reader; no stage reads them
    record: dict | None = None  # the stage's typed record (records.py), as `dataclasses.asdict` wrote it
    consumed: dict = field(default_factory=dict)  # upstream stage key -> manifest_fingerprint it was built from
    stale: list = field(default_factory=list)  # what --allow-stale let through, one line each
    format_version: int = FORMAT_VERSION
    created: str = ""
    path: Path | None = None  # where it was read from; not serialized

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("path")
        return d


def write_manifest(
    workdir: WorkDir,
    stage: str,
    *,
    params: dict,
    inputs: dict,
    counts: dict,
    outputs: Iterable[Path],
    record: Record | None,
    extra: dict | None = None,
    hash_outputs: bool = True,
) -> Manifest:
    """Record a finished stage. Call last: the manifest is the completion mark.

    `record`: the stage's record of eagle3/artifacts/records.py, the facts later stages read
    (None writes a manifest whose record every reader refuses: tests' stand-ins only).

    `hash_outputs=False` records sizes only, for outputs too large to re-read
    (the hidden-state store keeps its own per-shard checksums).
    """
    assert record is None or type(record) is RECORDS[stage], (stage, type(record))
    base = workdir.stage_dir(stage)
    out = {}
    for f in _output_files(outputs):
        rel = f.relative_to(base).as_posix()
        out[rel] = {"bytes": f.stat().st_size, "sha256": sha256_file(f) if hash_outputs else None}
    consumed, stale = _run.take(workdir, stage)
    m = Manifest(
        stage=stage, params=params, inputs=inputs, counts=counts, outputs=out, extra=extra or {},
        record=None if record is None else asdict(record), consumed=consumed, stale=stale,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    write_json(workdir.manifest(stage), m.to_json())
    m.path = workdir.manifest(stage)
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


def previous_manifest(workdir: WorkDir, stage: str) -> Manifest | None:
    """The manifest an earlier run of `stage` wrote, as it is (not checked against the stages
    before it, which may have run again since), or None when there is none readable: what a
    stage asks before it replaces what that run wrote."""
    path = workdir.manifest(stage)
    try:
        m = _load(path) if path.is_file() else None
    except PipelineError:
        return None
    return m if m is not None and m.format_version == FORMAT_VERSION else None


def _outputs_intact(manifest: Manifest, base: Path) -> str | None:
    """None when every recorded output exists with its recorded size, else the first problem."""
    for rel, info in manifest.outputs.items():
        f = base / rel
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != info["bytes"]:
            return f"{f} has {f.stat().st_size} bytes, the manifest recorded {info['bytes']}"
    return None


def read_manifest(workdir: WorkDir, stage: str, *, needed_by: str) -> Manifest:
    """Read and check the manifest of `stage` before a later stage uses its outputs."""
    path = workdir.manifest(stage)
    fix = f"run `python {workdir.script(stage)} --work-dir {workdir.root}` (with your --config) first"
    if not path.is_file():
        raise PipelineError(f"{needed_by} needs {path}, which does not exist: {fix}.")
    m = _load(path)
    if m.format_version != FORMAT_VERSION:
        raise PipelineError(
            f"{path} has format version {m.format_version}, this code reads {FORMAT_VERSION} (version 2 holds "
            f"the stage's typed record, eagle3/artifacts/records.py): rerun `python {workdir.script(stage)} --force`.")
    problem = _outputs_intact(m, workdir.stage_dir(stage))
    if problem:
        raise PipelineError(f"{needed_by}: {problem} ({path}); rerun `python {workdir.script(stage)} --force`.")
    check_fresh(workdir, m, needed_by=needed_by)
    _run.register(workdir, stage, manifest_fingerprint(m))
    return m


def record_of(manifest: Manifest) -> Record:
    """The typed record of a manifest already read (`read_manifest`, `already_complete`, a
    stage's own return value); refused, naming the manifest and the rerun, when it has none
    or its fields are not its class's."""
    return record_from_json(manifest.stage, manifest.record, manifest.path)


def read_record(workdir: WorkDir, stage: str, *, needed_by: str) -> Record:
    """`read_manifest` (existence, version, outputs, staleness), then its typed record:
    the one way a stage or tool reads another stage's facts."""
    return record_of(read_manifest(workdir, stage, needed_by=needed_by))


def manifest_fingerprint(manifest: Manifest) -> str:
    """The identity a downstream stage records for this input."""
    return sha256_json({k: v for k, v in manifest.to_json().items() if k != "created"})


def completed(workdir: WorkDir, stage: str, params: dict, inputs: dict) -> Manifest | None:
    """The existing manifest if the stage already ran with these params and inputs."""
    path = workdir.manifest(stage)
    if not path.is_file():
        return None
    try:
        m = _load(path)
    except PipelineError:
        return None
    if m.format_version != FORMAT_VERSION or m.params != _jsonable(params) or m.inputs != _jsonable(inputs):
        return None
    if _outputs_intact(m, workdir.stage_dir(stage)):
        return None
    _run.take(workdir, stage)  # the stage ends here without a new manifest: its reads are done
    return m


def already_complete(workdir: WorkDir, stage: str, params: dict, inputs: dict, *, force: bool,
                     intact: Callable[[Manifest], bool] | None = None) -> Manifest | None:
    """`completed(...)` unless `force`, saying so in the log: every stage's first check.

    `intact(manifest)`: the stage's own check that what the manifest lists is still whole
    and finished (a store's checksums, a drafter folder's files); False means redo.
    """
    done = completed(workdir, stage, params, inputs)
    if done is None or force or (intact is not None and not intact(done)):
        return None
    log.info("stage %s already complete with these inputs (%s); nothing to do. Pass --force to redo it.",
             workdir.number(stage), done.path)
    return done


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))


def check_same(what: str, ours, theirs, *, ours_from: str, theirs_from: str, fix: str) -> None:
    """Raise a PipelineError naming both values when two stages disagree."""
    if ours != theirs:
        raise PipelineError(f"{what} mismatch: {ours!r} ({ours_from}) vs {theirs!r} ({theirs_from}); {fix}.")


# -- stale artifacts ---------------------------------------------------------------
def _order(stage: str) -> int:
    return stage_index(stage)


class _StageRun:
    """What the running stage read (per work dir) and whether it may use stale inputs.

    One stage per process from the command line (`stage_run` in `run_stage`); tests and
    the demo run several in one process, so reads are kept per work dir, cleared when a
    stage writes its manifest or finds itself complete, and only manifests of stages
    earlier in the pipeline than the writer are recorded (a summary read elsewhere in
    the process cannot become an edge that is not in the stage graph).
    """

    def __init__(self):
        self.allow_stale = False
        self.config: str | None = None
        self.reads: dict[Path, dict[str, str]] = {}
        self.stale: dict[Path, list[str]] = {}

    def register(self, workdir: WorkDir, stage: str, fingerprint: str) -> None:
        self.reads.setdefault(workdir.root.resolve(), {})[stage] = fingerprint

    def note_stale(self, workdir: WorkDir, line: str) -> None:
        lines = self.stale.setdefault(workdir.root.resolve(), [])
        if line not in lines:
            lines.append(line)

    def take(self, workdir: WorkDir, stage: str) -> tuple[dict[str, str], list[str]]:
        key = workdir.root.resolve()
        reads, stale = self.reads.pop(key, {}), self.stale.pop(key, [])
        return {s: fp for s, fp in sorted(reads.items()) if _order(s) < _order(stage)}, stale


_run = _StageRun()


@contextmanager
def stage_run(*, allow_stale: bool = False, config: str | None = None) -> Iterator[None]:
    """Run one stage: `allow_stale` lets it use inputs built from manifests that have
    changed since (recorded in its manifest); `config` is named in the rerun hints."""
    global _run
    _run = _StageRun()
    _run.allow_stale, _run.config = allow_stale, config
    try:
        yield
    finally:
        _run = _StageRun()


@dataclass(frozen=True)
class StaleLink:
    upstream: str  # stage key whose manifest changed (or vanished, or cannot be read)
    consumer: str  # stage key whose manifest recorded the older one
    why: str  # "rebuilt" | "unreadable"


def _current_fingerprint(workdir: WorkDir, stage: str) -> str | None:
    path = workdir.manifest(stage)
    if not path.is_file():
        return None
    try:
        return manifest_fingerprint(_load(path))
    except PipelineError:
        return "unreadable"


def find_stale(workdir: WorkDir, manifest: Manifest) -> tuple[list[StaleLink], list[str]]:
    """Every link upstream of `m` (transitively) whose recorded fingerprint is not the
    manifest on disk, and the stages to rerun to repair it, in pipeline order (the
    consumers of those links and every stage built on them, `m`'s own stage included).

    An upstream manifest that is gone is skipped with a warning: a user may delete a
    finished stage's folder to free space, and there is nothing on disk to disagree.
    """
    links: list[StaleLink] = []
    needs_rerun: dict[str, bool] = {}
    manifests: dict[str, Manifest | None] = {manifest.stage: manifest}

    def load(stage: str) -> Manifest | None:
        if stage not in manifests:
            try:
                manifests[stage] = _load(workdir.manifest(stage)) if workdir.manifest(stage).is_file() else None
            except PipelineError:
                manifests[stage] = None
        return manifests[stage]

    def visit(stage: str) -> bool:
        if stage in needs_rerun:
            return needs_rerun[stage]
        needs_rerun[stage] = False  # a cycle cannot happen (earlier stages only); guard anyway
        cur = load(stage)
        rerun = False
        for up, fp in sorted((cur.consumed if cur else {}).items(), key=lambda kv: _order(kv[0])):
            now = _current_fingerprint(workdir, up)
            if now is None:
                log.warning("%s was built from %s, which is gone: its freshness cannot be checked",
                            workdir.manifest(stage), workdir.manifest(up))
                continue
            if now != fp:
                links.append(StaleLink(up, stage, "unreadable" if now == "unreadable" else "rebuilt"))
                rerun = True
                if now == "unreadable":
                    needs_rerun[up] = True  # its own manifest must be rewritten too
            rerun = visit(up) or rerun
        needs_rerun[stage] = rerun
        return rerun

    visit(manifest.stage)
    return links, sorted((s for s, r in needs_rerun.items() if r), key=_order)


def stale_stages(workdir: WorkDir) -> list[str]:
    """Every stage of the work dir whose manifest is stale (transitively), in pipeline order:
    what to rerun, in that order, to make the whole work dir consistent again."""
    out: set[str] = set()
    for stage in STAGE:
        if workdir.manifest(stage).is_file():
            try:
                out |= set(find_stale(workdir, _load(workdir.manifest(stage)))[1])
            except PipelineError:
                continue  # an unreadable manifest shows up as a link of the stages built on it
    return sorted(out, key=_order)


def _rerun_hint(workdir: WorkDir, stage: str) -> str:
    if _run.config:
        return f"`python {workdir.script(stage)} --config {_run.config} --force`"
    return f"`python {workdir.script(stage)} --work-dir {workdir.root} --force` (with your --config)"


def check_fresh(workdir: WorkDir, manifest: Manifest, *, needed_by: str) -> None:
    """Refuse `m` (about to be consumed by `needed_by`) when it was built from upstream
    manifests that have changed since, naming the stages to rerun; under
    `stage_run(allow_stale=True)` warn and record it instead."""
    links, rerun = find_stale(workdir, manifest)
    if not links:
        return
    # Name every stale stage of the work dir, not only this input's chain: a stage reads
    # several inputs, and one message should list all the reruns, not one per attempt.
    rerun = sorted(set(rerun) | set(stale_stages(workdir)), key=_order)
    folder = {s: STAGE[s].folder for s in STAGE}
    what = "; ".join(
        f"{folder[k.upstream]} was {'rebuilt' if k.why == 'rebuilt' else 'changed (unreadable now)'} after "
        f"{folder[k.consumer]} consumed it" for k in links)
    fix = ", then ".join(_rerun_hint(workdir, s) for s in rerun)
    if not _run.allow_stale:
        raise PipelineError(
            f"{needed_by}: {what}, so {manifest.path} describes outputs built from inputs that are no longer on disk: "
            f"rerun {fix}; or pass --allow-stale to use them as they are (recorded in the manifest).")
    log.warning("--allow-stale: %s; %s uses %s as it is (rerun %s to repair it)", what, needed_by, manifest.path, fix)
    for k in links:
        _run.note_stale(workdir, f"{folder[k.upstream]} was {k.why} after {folder[k.consumer]} consumed it "
                            f"(read through {folder[manifest.stage]})")
