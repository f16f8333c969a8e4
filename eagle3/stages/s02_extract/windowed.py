"""Stage 02 under `--disk-budget`: the held-out split once, then the train split by windows.

Reads what stage 02 reads, plus `windows/progress.json` (the rounds stage 04 has trained);
writes `02_hidden_states/windows.json` (the plan), the held-out split into the store folder
(with the stage's manifest, as without a budget), and one folder per round
(eagle3/artifacts/windows.py has the names and the plan). Run by `extract_hidden_states` when
`--disk-budget` is given:

    python 02_extract_hidden_states.py --config C --disk-budget 2TB              # the next round
    python 02_extract_hidden_states.py --config C --disk-budget 2TB --window 3   # round 3
    python 02_extract_hidden_states.py --config C --disk-budget 2TB --produce \\
        --windows-dir /mnt/shared/windows --num-shards 2 --shard-index 1 --wait-s 86400

A round is written like the whole store (partial files renamed when complete, so a kill
leaves nothing that looks finished; a rerun keeps complete files and redoes the rest),
and finished by `window.json`, written last with every file's bytes and checksum. The
engine is loaded once per run, and only when there is work.

Several boxes: box i of N (`--num-shards N --shard-index i`) extracts rounds i, i + N, ...;
box 0 also extracts the held-out split. Before each round a producer waits (`--wait-s`)
while the held-out files and the rounds present in the windows folder, with this one,
would exceed the budget: stage 04 deletes each round after its checkpoint.
"""
from __future__ import annotations

import dataclasses
import logging
import shutil
import time

from tqdm import tqdm

from eagle3.artifacts import store, windows
from eagle3.artifacts.manifest import Manifest, already_complete, read_manifest, sha256_json
from eagle3.artifacts.workdir import SPLITS
from eagle3.core.errors import PipelineError
from eagle3.stages.s02_extract.config import ExtractConfig
# run.py dispatches here under --disk-budget and this module uses its steps: a module
# reference (resolved at call time), so either may be imported first.
from eagle3.stages.s02_extract import run as _run

log = logging.getLogger(__name__)


def window_plan(cfg: ExtractConfig, p: _run.Prepared) -> windows.WindowPlan:
    lengths = {s: _run.split_lengths(p.wd, s).tolist() for s in SPLITS}
    return windows.make_plan(lengths["train"], lengths["eval"], disk_budget=windows.parse_bytes(cfg.disk_budget),
                             seed=cfg.window_seed, passes=cfg.extraction_passes,
                             windows_in_budget=cfg.windows_in_budget, spf=cfg.samples_per_file,
                             H=p.info.hidden_size, A=len(p.aux_layers), dtype=cfg.store_dtype)


def held_out_prepared(p: _run.Prepared, plan: windows.WindowPlan) -> _run.Prepared:
    """The store folder's own identity: the held-out split only, under this window plan."""
    ident = {**p.identity, "num_samples": {"train": 0, "eval": p.num_samples["eval"]},
             "window_plan": plan.fingerprint}
    params = {**p.params, "window_plan": plan.fingerprint}
    return dataclasses.replace(p, identity=ident, identity_hash=sha256_json(ident), params=params,
                               num_samples=ident["num_samples"])


def round_prepared(main: _run.Prepared, plan: windows.WindowPlan, r: int) -> _run.Prepared:
    w = plan.window_of(r)
    ident = {**main.identity, "num_samples": {"train": len(w["samples"]), "eval": 0}, "round": r,
             "window": r % plan.num_windows}
    return dataclasses.replace(main, identity=ident, identity_hash=sha256_json(ident),
                               num_samples=ident["num_samples"])


class _Engine:
    """The backend, loaded on first use and closed at the end."""

    def __init__(self, cfg: ExtractConfig, p: "_run.Prepared"):
        self.cfg, self.p, self.loaded = cfg, p, None

    def get(self):
        if self.loaded is None:
            t0 = time.perf_counter()
            self.loaded = _run.load_engine(self.cfg, self.p)
            # Paid once per round on one box (the loop restarts stage 02 for each round).
            log.info("stage 02: engine (%s) loaded in %.1f s", self.cfg.backend, time.perf_counter() - t0)
        return self.loaded

    def close(self):
        if self.loaded is not None:
            self.loaded[0].close()


def _extract(engine: _Engine, cfg: ExtractConfig, p: _run.Prepared, d, splits: dict, lengths: dict, what: str) -> list:
    """Extract every file of `p`'s splits into folder d not yet complete there; the plan of files."""
    plan = _run.plan_files(p.num_samples, cfg.samples_per_file)
    for spec in plan:  # leftovers of a killed run: never read, always redone
        store.remove_partial(d, spec.split, spec.file_no)
    todo = [s for s in plan if not _run._file_complete(d, s, p.identity_hash, cfg.verify_checksums)]
    log.info("stage 02: %s: %d files, %d to do -> %s", what, len(plan), len(todo), d)
    if todo:
        sizes = [(s.count, sum(lengths[s.split][s.first:s.first + s.count])) for s in todo]
        store.require_free_space(d, sizes, p.info.hidden_size, len(p.aux_layers), cfg.store_dtype)
        backend, head = engine.get()
        with tqdm(total=sum(t for _, t in sizes), unit="tok", unit_scale=True, desc=what, smoothing=0.05) as bar:
            _run.write_files(p, backend, head, todo, bar.update, store_dir=d, splits=splits)
    return plan


def _round_done(d, p: _run.Prepared, verify: bool) -> bool:
    done = windows.read_complete(d)
    return (done is not None and done.get("identity_hash") == p.identity_hash
            and windows.window_problem(d, verify_checksums=verify) is None)


def _wait_for_room(cfg: ExtractConfig, plan: windows.WindowPlan, wdir, r: int) -> None:
    """Wait (up to --wait-s) until round r fits the budget beside the held-out files and the
    rounds present (complete or being written, by any box)."""
    deadline = time.monotonic() + cfg.wait_s
    while True:
        others = [x for x in windows.present_rounds(wdir) if x != r]
        need = plan.held_out_bytes + sum(plan.window_of(x)["bytes"] for x in others) + plan.window_of(r)["bytes"]
        if need <= plan.disk_budget:
            return
        if time.monotonic() >= deadline:
            raise PipelineError(
                f"stage 02: round {r} ({plan.window_of(r)['bytes']:,} bytes) does not fit the --disk-budget "
                f"{plan.disk_budget:,} beside the held-out split and the untrained round(s) {others} in {wdir}: "
                f"train them first (`python 04_train_drafter.py` deletes each once its checkpoint covers it), "
                f"or pass --wait-s SECONDS to wait for that.")
        time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))


def rounds_to_do(cfg: ExtractConfig, plan: windows.WindowPlan, main: _run.Prepared, wdir) -> list[int]:
    trained = windows.read_progress(wdir)["trained_rounds"]
    mine = [r for r in range(plan.rounds) if r % cfg.num_shards == cfg.shard_index]
    if cfg.window is not None:
        if cfg.window >= plan.rounds:
            raise PipelineError(f"--window {cfg.window}: the plan in {main.wd.store() / windows.PLAN_JSON} has "
                                f"rounds 0..{plan.rounds - 1} ({plan.summary()}).")
        if cfg.window < trained:
            log.info("stage 02: round %d is already trained (%s): nothing to do", cfg.window,
                     wdir / windows.PROGRESS_JSON)
            return []
        return [cfg.window]
    todo = [r for r in mine if r >= trained]
    if cfg.produce:
        return todo
    for r in todo:  # the next round this box writes that is not on disk already
        if not _round_done(wdir / windows.round_name(r), round_prepared(main, plan, r), verify=False):
            return [r]
    return []


def extract_windowed(cfg: ExtractConfig) -> Manifest | None:
    if cfg.data_parallel_size > 1:
        raise PipelineError("--disk-budget with --data-parallel-size > 1 is not supported yet: run one engine per "
                            "box (tensor parallel), or several boxes with --num-shards.")
    p = _run.validate(cfg)
    plan = window_plan(cfg, p)
    main = held_out_prepared(p, plan)
    d = p.wd.store()
    wdir = windows.windows_dir(d, cfg.windows_dir)
    if cfg.force and cfg.windows_dir and wdir.exists():
        log.warning("--force: deleting the window folders in %s", wdir)
        shutil.rmtree(wdir)
    _run.check_store_identity(main, cfg.force)
    windows.write_or_check_plan(d, plan)
    wdir.mkdir(parents=True, exist_ok=True)
    log.info("stage 02: window plan %s: %s", d / windows.PLAN_JSON, plan.summary())
    engine = _Engine(cfg, p)
    try:
        if cfg.shard_index == 0:  # the held-out split, once, kept for the whole run
            done = already_complete(p.wd, "extract", main.params, main.inputs, force=False,
                                    intact=lambda m: _run.store_intact(d, m, verify_checksums=cfg.verify_checksums))
            if not done:
                eval_files = _extract(engine, cfg, main, d, {"eval": _run.load_split(p.wd, "eval")},
                                      {"eval": _run.split_lengths(p.wd, "eval").tolist()}, "held-out")
                _run.write_results(cfg, main, eval_files)
        train = None
        for r in rounds_to_do(cfg, plan, main, wdir):
            rp = round_prepared(main, plan, r)
            rd = wdir / windows.round_name(r)
            if _round_done(rd, rp, cfg.verify_checksums):
                log.info("stage 02: round %d is complete in %s", r, rd)
                continue
            _wait_for_room(cfg, plan, wdir, r)
            rd.mkdir(parents=True, exist_ok=True)
            if train is None:
                train, train_lengths = _run.load_split(p.wd, "train"), _run.split_lengths(p.wd, "train").tolist()
            w = plan.window_of(r)
            files = _extract(engine, cfg, rp, rd, {"train": train.select(w["samples"])},
                             {"train": [train_lengths[i] for i in w["samples"]]}, f"round {r}")
            entries = [store.read_entry(rd, s.split, s.file_no) for s in files]
            store.write_index(rd, rp.identity, entries, rp.num_samples, cfg.samples_per_file)
            windows.write_complete(rd, {
                "round": r, "window": r % plan.num_windows, "pass": r // plan.num_windows,
                "num_samples": len(w["samples"]), "tokens": w["tokens"], "bytes": sum(e["bytes"] for e in entries),
                "identity_hash": rp.identity_hash, "plan": plan.fingerprint,
                "files": [{k: e[k] for k in ("name", "bytes", "checksum")} for e in entries]})
            log.info("stage 02: round %d (window %d, pass %d): %d samples, %d tokens, %.1f MB -> %s", r,
                     r % plan.num_windows, r // plan.num_windows, len(w["samples"]), w["tokens"],
                     sum(e["bytes"] for e in entries) / 1e6, rd)
    finally:
        engine.close()
    return read_manifest(p.wd, "extract", needed_by="stage 02") if p.wd.manifest("extract").is_file() else None
