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
box 0 also extracts the held-out split. One writer per folder: a run claims a round's folder
(and box 0 the store folder) before it writes a byte there (eagle3/artifacts/claims.py), and a
second writer is refused in one line naming the holder. The budget is counted after the
claim (claim, recount, back off): the held-out files and every round present in the windows
folder, this one included, must fit, else the claim is released and the producer waits
(`--wait-s`, logging every few minutes what it waits for) until stage 04 has deleted a
round after its checkpoint. Two producers that claim at once both count both rounds, so
neither goes past the budget.

--force removes only what this run owns: the store folder's files on box 0 (never the
folder), and with --windows-dir this shard's round folders, each only when it holds nothing
but a round's files and no other run holds its claim; never another shard's rounds, never
stage 04's progress.json, never the --windows-dir folder itself.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import time

from tqdm import tqdm

from eagle3.artifacts import claims, store, windows
from eagle3.artifacts.manifest import Manifest, already_complete, read_manifest, sha256_json
from eagle3.artifacts.workdir import SPLITS
from eagle3.core.errors import PipelineError
from eagle3.stages.s02_extract.config import ExtractConfig
from eagle3.stages.s02_extract.engine import load_engine
from eagle3.stages.s02_extract.inputs import Prepared, check_store_identity, load_split, split_lengths, validate
from eagle3.stages.s02_extract.plan import plan_files
from eagle3.stages.s02_extract.results import store_intact, write_results
from eagle3.stages.s02_extract.write import file_complete, write_files

log = logging.getLogger(__name__)


def window_plan(cfg: ExtractConfig, prepared: Prepared) -> windows.WindowPlan:
    lengths = {s: split_lengths(prepared.workdir, s).tolist() for s in SPLITS}
    return windows.make_plan(lengths["train"], lengths["eval"], disk_budget=windows.parse_bytes(cfg.disk_budget),
                             seed=cfg.window_seed, passes=cfg.extraction_passes,
                             windows_in_budget=cfg.windows_in_budget, spf=cfg.samples_per_file,
                             H=prepared.info.hidden_size, A=len(prepared.aux_layers), dtype=cfg.store_dtype)


def held_out_prepared(prepared: Prepared, plan: windows.WindowPlan) -> Prepared:
    """The store folder's own identity: the held-out split only, under this window plan."""
    ident = {**prepared.identity, "num_samples": {"train": 0, "eval": prepared.num_samples["eval"]},
             "window_plan": plan.fingerprint}
    params = {**prepared.params, "window_plan": plan.fingerprint}
    return dataclasses.replace(prepared, identity=ident, identity_hash=sha256_json(ident), params=params,
                               num_samples=ident["num_samples"])


def round_prepared(main: Prepared, plan: windows.WindowPlan, round_index: int) -> Prepared:
    w = plan.window_of(round_index)
    ident = {**main.identity, "num_samples": {"train": len(w["samples"]), "eval": 0}, "round": round_index,
             "window": round_index % plan.num_windows}
    return dataclasses.replace(main, identity=ident, identity_hash=sha256_json(ident),
                               num_samples=ident["num_samples"])


class _Engine:
    """The backend, loaded on first use and closed at the end."""

    def __init__(self, cfg: ExtractConfig, prepared: Prepared):
        self.cfg, self.p, self.loaded = cfg, prepared, None

    def get(self):
        if self.loaded is None:
            t0 = time.perf_counter()
            self.loaded = load_engine(self.cfg, self.p)
            # Paid once per round on one box (the loop restarts stage 02 for each round).
            log.info("stage 02: engine (%s) loaded in %.1f s", self.cfg.backend, time.perf_counter() - t0)
        return self.loaded

    def close(self):
        if self.loaded is not None:
            self.loaded[0].close()


def _extract(engine: _Engine, cfg: ExtractConfig, prepared: Prepared, folder, splits: dict, lengths: dict, what: str,
             claim: claims.Claim) -> list:
    """Extract every file of `prepared`'s splits into `folder` not yet complete there; the plan of files.
    `claim`: this run's claim on `folder` (so every partial file in it is a dead writer's)."""
    plan = plan_files(prepared.num_samples, cfg.samples_per_file)
    for spec in plan:  # leftovers of a killed run: never read, always redone
        store.remove_partial(folder, spec.split, spec.file_no)
    todo = [s for s in plan if not file_complete(folder, s, prepared.identity_hash, cfg.verify_checksums)]
    log.info("stage 02: %s: %d files, %d to do -> %s", what, len(plan), len(todo), folder)
    if todo:
        sizes = [(s.count, sum(lengths[s.split][s.first:s.first + s.count])) for s in todo]
        store.require_free_space(folder, sizes, prepared.info.hidden_size, len(prepared.aux_layers), cfg.store_dtype)
        backend, head = engine.get()
        with tqdm(total=sum(t for _, t in sizes), unit="tok", unit_scale=True, desc=what, smoothing=0.05) as bar:
            write_files(prepared, backend, head, todo, bar.update, store_dir=folder, splits=splits, still_ours=claim.check)
    return plan


def _round_done(folder, prepared: Prepared, verify: bool) -> bool:
    done = windows.read_complete(folder)
    return (done is not None and done.get("identity_hash") == prepared.identity_hash
            and windows.window_problem(folder, verify_checksums=verify) is None)


def budget_need(plan: windows.WindowPlan, present, round_no: int) -> int:
    """Bytes on disk at the peak if round `round_no` is written beside the rounds `present`
    (folders in the windows folder, complete or being written): the held-out split, each of
    those rounds and this one, counted once whether its own folder is among them or not."""
    rounds = set(present) | {round_no}
    return plan.held_out_bytes + sum(plan.window_of(other)["bytes"] for other in rounds)


def _round_states(wdir, rounds, watch: claims.Watch) -> str:
    return "; ".join(f"round {other}: {windows.round_state(wdir / windows.round_name(other), watch)}"
                     for other in rounds) or "none"


def _wait_for_room(cfg: ExtractConfig, plan: windows.WindowPlan, wdir, round_index: int) -> claims.Claim:
    """Claim round r's folder and return the claim once the round fits the budget beside the
    held-out files and the rounds present (complete or being written, by any box).

    Claim, recount, back off: the count is taken after the claim, so of two producers that
    claim at once each counts the other's round too; one over the budget releases its claim
    (and the folder, if it made it and it is empty) and tries again after a second or so
    (jittered, so the two do not collide again), for up to --wait-s. Another writer's claim on
    round r is refused at once (claims.Claim.acquire). While waiting it logs, at once and every
    `windows.WAIT_LOG_S` seconds, the round it waits for and the state of each round on disk."""
    rd = wdir / windows.round_name(round_index)
    started = time.monotonic()
    deadline, next_log, watch = started + cfg.wait_s, started, claims.Watch()
    what = f"stage 02, round {round_index} (shard {cfg.shard_index} of {cfg.num_shards})"
    while True:
        made = not rd.exists()
        claim = claims.Claim.acquire(rd, what=what, take_over_stale_s=cfg.take_over_stale_s)
        present = windows.present_rounds(wdir)
        need = budget_need(plan, present, round_index)
        if need <= plan.disk_budget:
            return claim
        claim.release()
        if made:
            _remove_if_empty(rd)
        others = [other for other in present if other != round_index]
        now = time.monotonic()
        if now >= deadline:
            raise PipelineError(
                f"stage 02: round {round_index} ({plan.window_of(round_index)['bytes']:,} bytes) does not fit the --disk-budget "
                f"{plan.disk_budget:,} beside the held-out split and the untrained round(s) {others} in {wdir} "
                f"({_round_states(wdir, others, watch)}): train them first (`python 04_train_drafter.py` deletes "
                f"each once its checkpoint covers it), or pass --wait-s SECONDS to wait for that.")
        if now >= next_log:
            log.info("stage 02: round %d (%s) waits for room in the --disk-budget %s (it needs %s with it): on disk "
                     "beside the held-out split: %s; waited %.0f s of --wait-s %.0f", round_index, rd,
                     windows.human(plan.disk_budget), windows.human(need), _round_states(wdir, others, watch),
                     now - started, cfg.wait_s)
            next_log = now + windows.WAIT_LOG_S
        time.sleep(min(random.uniform(0.5, 1.5), max(0.05, deadline - now)))


def _remove_if_empty(folder) -> None:
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty (or gone): another writer's or ours to keep


def shard_rounds(rounds: int, num_shards: int, shard_index: int, trained: int) -> list[int]:
    """The rounds box `shard_index` of `num_shards` writes (i, i + N, ...) not yet trained."""
    return [round_no for round_no in range(rounds) if round_no % num_shards == shard_index and round_no >= trained]


def rounds_to_do(cfg: ExtractConfig, plan: windows.WindowPlan, main: Prepared, wdir) -> list[int]:
    trained = windows.read_progress(wdir)["trained_rounds"]
    if cfg.window is not None:
        if cfg.window >= plan.rounds:
            raise PipelineError(f"--window {cfg.window}: the plan in {main.workdir.store() / windows.PLAN_JSON} has "
                                f"rounds 0..{plan.rounds - 1} ({plan.summary()}).")
        if cfg.window < trained:
            log.info("stage 02: round %d is already trained (%s): nothing to do", cfg.window,
                     wdir / windows.PROGRESS_JSON)
            return []
        return [cfg.window]
    todo = shard_rounds(plan.rounds, cfg.num_shards, cfg.shard_index, trained)
    if cfg.produce:
        return todo
    for r in todo:  # the next round this box writes that is not on disk already
        if not _round_done(wdir / windows.round_name(r), round_prepared(main, plan, r), verify=False):
            return [r]
    return []


def _force_own_rounds(cfg: ExtractConfig, wdir) -> None:
    """--force with --windows-dir: delete this shard's round folders there (with --window, that
    round's), each only when no other run holds it and it holds nothing but a round's files;
    never another shard's, never progress.json, never the folder itself (it may be a share)."""
    mine = [r for r in windows.present_rounds(wdir)
            if (r == cfg.window if cfg.window is not None else r % cfg.num_shards == cfg.shard_index)]
    for r in mine:
        rd = wdir / windows.round_name(r)
        busy = claims.live_claims([rd])
        if busy:
            raise PipelineError(f"--force would delete round {r}, but {claims.refusal(rd, busy[0][1])}")
        strange = sorted(path.name for path in rd.iterdir() if not windows.is_round_file(path.name))
        if strange:
            raise PipelineError(f"--force: {rd} holds {strange[:5]}, which are not a round's files: not deleting it. "
                                f"Is --windows-dir {wdir} the folder of the rounds? Move those files, or delete the "
                                f"folder yourself if it is a round.")
    for r in mine:
        windows.delete_round(wdir, r)
    others = [r for r in windows.present_rounds(wdir) if r not in mine]
    trained = windows.read_progress(wdir)["trained_rounds"]
    log.warning("--force: deleted this shard's round(s) %s in %s; kept the other shards' round(s) %s and %s "
                "(%d round(s) trained: rounds below it are not extracted again until stage 04 starts over with "
                "--force). Run every box with --force to start the whole run over.", mine, wdir, others,
                windows.PROGRESS_JSON, trained)


def extract_windowed(cfg: ExtractConfig) -> Manifest | None:
    if cfg.data_parallel_size > 1:
        raise PipelineError("--disk-budget with --data-parallel-size > 1 is not supported yet: run one engine per "
                            "box (tensor parallel), or several boxes with --num-shards.")
    p = validate(cfg)
    plan = window_plan(cfg, p)
    main = held_out_prepared(p, plan)
    d = p.workdir.store()
    wdir = windows.windows_dir(d, cfg.windows_dir)
    # Box 0 writes the store folder (the held-out split): it holds that folder's claim for
    # the whole run, so a second box 0 is refused before it writes or deletes anything.
    store_claim = (claims.Claim.acquire(d, what=f"stage 02 held-out split (shard 0 of {cfg.num_shards})",
                                        take_over_stale_s=cfg.take_over_stale_s) if cfg.shard_index == 0 else None)
    engine = _Engine(cfg, p)
    try:
        if cfg.force:
            if cfg.windows_dir:
                _force_own_rounds(cfg, wdir)
            if cfg.shard_index != 0:  # the identity and the plan, written alike by every box; not the held-out files
                for name in (store.STORE_JSON, windows.PLAN_JSON):
                    (d / name).unlink(missing_ok=True)
        check_store_identity(main, cfg.force and cfg.shard_index == 0, store_claim)
        windows.write_or_check_plan(d, plan)
        wdir.mkdir(parents=True, exist_ok=True)
        log.info("stage 02: window plan %s: %s", d / windows.PLAN_JSON, plan.summary())
        if store_claim is not None:  # the held-out split, once, kept for the whole run
            done = already_complete(p.workdir, "extract", main.params, main.inputs, force=False,
                                    intact=lambda m: store_intact(d, m, verify_checksums=cfg.verify_checksums))
            if not done:
                eval_files = _extract(engine, cfg, main, d, {"eval": load_split(p.workdir, "eval")},
                                      {"eval": split_lengths(p.workdir, "eval").tolist()}, "held-out", store_claim)
                store_claim.check()
                write_results(cfg, main, eval_files)
        train = None
        for r in rounds_to_do(cfg, plan, main, wdir):
            rp = round_prepared(main, plan, r)
            rd = wdir / windows.round_name(r)
            if _round_done(rd, rp, cfg.verify_checksums):
                log.info("stage 02: round %d is complete in %s", r, rd)
                continue
            claim = _wait_for_room(cfg, plan, wdir, r)
            try:
                if r < windows.read_progress(wdir)["trained_rounds"] or _round_done(rd, rp, verify=False):
                    log.info("stage 02: round %d was finished (or trained) while this run waited", r)
                    continue
                if train is None:
                    train, train_lengths = load_split(p.workdir, "train"), split_lengths(p.workdir, "train").tolist()
                _write_round(engine, cfg, plan, rp, rd, r, train, train_lengths, claim)
            finally:
                claim.release()
                _remove_if_empty(rd)  # a round left unwritten leaves no folder to count against the budget
    finally:
        engine.close()
        if store_claim is not None:
            store_claim.release()
    return read_manifest(p.workdir, "extract", needed_by="stage 02") if p.workdir.manifest("extract").is_file() else None


def _write_round(engine: _Engine, cfg: ExtractConfig, plan: windows.WindowPlan, rp: Prepared, round_dir, round_index: int, train,
                 train_lengths: list[int], claim: claims.Claim) -> None:
    """Round r's files, index and, last, window.json, in its folder (claimed by this run)."""
    window = plan.window_of(round_index)
    files = _extract(engine, cfg, rp, round_dir, {"train": train.select(window["samples"])},
                     {"train": [train_lengths[i] for i in window["samples"]]}, f"round {round_index}", claim)
    entries = [store.read_entry(round_dir, s.split, s.file_no) for s in files]
    claim.check()  # window.json only from the folder's holder
    store.write_index(round_dir, rp.identity, entries, rp.num_samples, cfg.samples_per_file)
    windows.write_complete(round_dir, {
        "round": round_index, "window": round_index % plan.num_windows, "pass": round_index // plan.num_windows,
        "num_samples": len(window["samples"]), "tokens": window["tokens"], "bytes": sum(e["bytes"] for e in entries),
        "identity_hash": rp.identity_hash, "plan": plan.fingerprint,
        "files": [{k: e[k] for k in ("name", "bytes", "checksum")} for e in entries]})
    log.info("stage 02: round %d (window %d, pass %d): %d samples, %d tokens, %.1f MB -> %s", round_index,
             round_index % plan.num_windows, round_index // plan.num_windows, len(window["samples"]), window["tokens"],
             sum(e["bytes"] for e in entries) / 1e6, round_dir)
