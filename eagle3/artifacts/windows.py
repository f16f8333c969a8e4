"""Windows of the store: more data than the disk holds, extracted and trained in turns.

Stage 02 with `--disk-budget BYTES` writes this module's files; stage 04 reads them and
deletes each window once a checkpoint covers it; `python -m eagle3.tools.window_loop`
drives both on one box. File names (all inside the store folder `WORK/02_hidden_states/`,
the window folders inside `--windows-dir` when given, e.g. a shared mount):

    windows.json                the plan: the train split shuffled once with `seed`, cut into
                                windows that each fit the budget (sample indices of stage 01's
                                train split, tokens and planned bytes of each), the held-out
                                split's bytes, the number of extraction passes. Written once;
                                a rerun with other settings is refused.
    windows/window-NNNNN/       round N's store: round N holds window N % W of extraction pass
                                N // W (W windows), as a store of its own (store.json,
                                index.json, train-*.safetensors in window order).
    windows/window-NNNNN/window.json  written last, once every file is complete: the round,
                                its counts, and each file's bytes and checksum. A folder
                                without it is being written and is never trained on. Its file
                                names are accepted only when they are store file names.
    windows/window-NNNNN/.claim.json  the claim of the stage 02 run writing the round, made
                                before its first byte, and `.claim-TOKEN.beat`, its heartbeat
                                (eagle3/artifacts/claims.py): one writer per round.
    windows/progress.json       rounds trained (`read_progress`, `write_progress`): derived from
                                stage 04's checkpoint, the record of what is trained. Stage 04
                                writes it after the checkpoint that covers the rounds is on disk
                                (fsynced), before it deletes their folders, and rewrites it to
                                its checkpoint's rounds at every start (down too, when the
                                checkpoint it resumes is older). Missing: no round trained; torn
                                or unreadable: an error naming the file (never a zero), which
                                stage 04's next start repairs.
    windows/.deleting-window-NNNNN/  a folder being deleted (renamed first, so a kill during
                                the deletion never leaves a folder that looks complete). On NFS a
                                file still open somewhere is kept as a `.nfsXXXX` file until it
                                is closed: the removal retries, then leaves the folder to the
                                next `sweep` and says so.

The held-out split is extracted once, into the store folder itself, and kept.

The budget covers the store on disk at its peak: the held-out files plus
`windows_in_budget` windows (one on one box, where extraction and training take turns),
each counted with `store.bytes_to_write` (for fp8 the bf16 partial files that exist while
it is written).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.artifacts import claims, store
from eagle3.artifacts.atomic import write_json
from eagle3.artifacts.claims import Watch  # what a waiter keeps between looks at a round (`round_state`)
from eagle3.artifacts.manifest import sha256_json
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError

log = logging.getLogger(__name__)

PLAN_JSON = "windows.json"
WINDOWS_DIR = "windows"
COMPLETE_JSON = "window.json"
PROGRESS_JSON = "progress.json"
WAIT_LOG_S = 300.0  # a producer waiting for room, or the trainer for a round, logs what it waits for this often
_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "PB": 10 ** 15,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_bytes(text: str | int, what: str = "--disk-budget") -> int:
    """'2TB' -> 2e12, '500GB', '1.5TiB', '123456' (bytes). Decimal units as disks are sold."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise PipelineError(f"{what} {text!r} is not a size: write bytes or a number with a unit, e.g. 2TB, "
                            f"500GB, 1.5TiB ({', '.join(u for u in _UNITS if u)}).")
    return int(float(m.group(1)) * _UNITS[unit])


def human(n: int) -> str:
    """Bytes in the largest decimal unit that keeps a number >= 1: '1.93 TB', '2.80 MB'."""
    for unit, size in (("PB", 10 ** 15), ("TB", 10 ** 12), ("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def round_name(round_index: int) -> str:
    return f"window-{round_index:05d}"


def round_of(name: str) -> int | None:
    m = re.fullmatch(r"window-(\d+)", name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- the plan


def _file_sizes(lengths: list[int], spf: int, H: int, A: int, dtype: str) -> int:
    files = [(len(lengths[a:a + spf]), sum(lengths[a:a + spf])) for a in range(0, len(lengths), spf)]
    return store.bytes_to_write(files, H, A, dtype, engines=1) if files else 0


class _FileBound:
    """An upper bound of `store.file_bytes(S, T)` in O(1): the header at its longest (as if T
    were 10**12 tokens, so every offset has the most digits) plus T times the bytes per token."""

    BIG = 10 ** 12

    def __init__(self, H: int, A: int, dtype: str):
        self.H, self.A, self.dtype = H, A, dtype
        self.per_token = store.bytes_per_token(H, A, dtype)
        self._head: dict[int, int] = {}

    def __call__(self, S: int, T: int) -> int:
        if S not in self._head:
            self._head[S] = store.file_bytes(S, self.BIG, self.H, self.A, self.dtype) - self.BIG * self.per_token
        return self._head[S] + T * self.per_token


def cut_windows(order: list[int], lengths: list[int], capacity: int, *, spf: int, H: int, A: int,
                dtype: str) -> list[list[int]]:
    """Consecutive runs of `order` whose store (files of `spf` samples) fits `capacity` bytes.

    Greedy: a sample joins the current window while the window's bytes (its files, plus for
    fp8 the two largest bf16 partial files written before them: `store.bytes_to_write`)
    stay within the capacity, each file counted by an upper bound of its size (`_FileBound`),
    so a plan of 600K samples takes a second, and the window's exact bytes stay below it.
    """
    size = _FileBound(H, A, dtype)
    scaled = store.encoding_named(dtype).scaled
    partial = _FileBound(H, A, "bf16") if scaled else None
    windows: list[list[int]] = []
    cur: list[int] = []
    closed, top2 = 0, [0, 0]  # bytes of the window's full files; its two largest partial files
    S = T = 0  # the open file's samples and tokens

    def total(S: int, T: int) -> int:
        out = closed + (size(S, T) if S else 0)
        if scaled:
            out += sum(sorted(top2 + [partial(S, T) if S else 0], reverse=True)[:2])
        return out

    for i in order:
        n = lengths[i]
        if total(S + 1, T + n) > capacity:
            if cur:
                windows.append(cur)
                cur, closed, top2, S, T = [], 0, [0, 0], 0, 0
            if total(1, n) > capacity:
                raise PipelineError(
                    f"--disk-budget leaves {capacity:,} bytes per window, less than one sample of {n:,} tokens "
                    f"needs ({total(1, n):,} bytes); raise --disk-budget.")
        cur.append(i)
        S, T = S + 1, T + n
        if S == spf:
            closed += size(S, T)
            if scaled:
                top2 = sorted(top2 + [partial(S, T)], reverse=True)[:2]
            S = T = 0
    if cur:
        windows.append(cur)
    return windows


@dataclass
class WindowPlan:
    seed: int
    disk_budget: int
    windows_in_budget: int
    passes: int
    store_dtype: str
    bytes_per_token: int
    held_out_bytes: int
    window_capacity: int
    windows: list[dict]  # {"samples": [...], "tokens": int, "bytes": int}

    @property
    def num_windows(self) -> int:
        return len(self.windows)

    @property
    def rounds(self) -> int:
        """Windows extracted over the whole run: every window once per extraction pass."""
        return self.passes * self.num_windows

    def window_of(self, round_index: int) -> dict:
        return self.windows[round_index % self.num_windows]

    @property
    def peak_bytes(self) -> int:
        """The store's planned peak on disk: held-out plus the largest windows the budget admits."""
        sizes = sorted((w["bytes"] for w in self.windows), reverse=True)
        return self.held_out_bytes + sum(sizes[:self.windows_in_budget])

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @property
    def fingerprint(self) -> str:
        return sha256_json(self.to_json())

    def summary(self) -> str:
        toks = [w["tokens"] for w in self.windows]
        return (f"{self.num_windows} window(s) x {self.passes} extraction pass(es) = {self.rounds} rounds; tokens per "
                f"window {min(toks):,}-{max(toks):,}; largest window {human(max(w['bytes'] for w in self.windows))}; "
                f"held-out {human(self.held_out_bytes)}; planned peak {human(self.peak_bytes)} of the "
                f"{human(self.disk_budget)} budget")


def make_plan(train_lengths: list[int], eval_lengths: list[int], *, disk_budget: int, seed: int, passes: int,
              windows_in_budget: int, spf: int, H: int, A: int, dtype: str) -> WindowPlan:
    """Shuffle the train split once (seeded) and cut it into windows that fit the budget."""
    held = _file_sizes(eval_lengths, spf, H, A, dtype)
    capacity = (disk_budget - held) // windows_in_budget
    if capacity <= 0:
        raise PipelineError(f"--disk-budget {disk_budget:,} bytes does not even hold the held-out split "
                            f"({held:,} bytes, kept for the whole run); raise --disk-budget.")
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train_lengths), generator=g).tolist()
    cut = cut_windows(order, train_lengths, capacity, spf=spf, H=H, A=A, dtype=dtype)
    windows = [{"samples": w, "tokens": int(sum(train_lengths[i] for i in w)),
                "bytes": _file_sizes([train_lengths[i] for i in w], spf, H, A, dtype)} for w in cut]
    return WindowPlan(seed=seed, disk_budget=disk_budget, windows_in_budget=windows_in_budget, passes=passes,
                      store_dtype=dtype, bytes_per_token=store.bytes_per_token(H, A, dtype), held_out_bytes=held,
                      window_capacity=capacity, windows=windows)


def read_plan(store_dir: Path) -> WindowPlan | None:
    p = Path(store_dir) / PLAN_JSON
    if not p.is_file():
        return None
    return WindowPlan(**json.loads(p.read_text()))


def write_or_check_plan(store_dir: Path, plan: WindowPlan) -> None:
    """Write the plan once; a later run must plan the same windows (else the trained rounds mean others)."""
    old = read_plan(store_dir)
    if old is None:
        write_json(Path(store_dir) / PLAN_JSON, plan.to_json())
        return
    if old.fingerprint != plan.fingerprint:
        diff = [k for k in plan.to_json() if k != "windows" and old.to_json()[k] != plan.to_json()[k]]
        raise PipelineError(f"{Path(store_dir) / PLAN_JSON} holds another window plan ({', '.join(diff) or 'windows'} "
                            f"differ): this run's windows would not be the ones trained so far. Rerun with the "
                            f"settings it was made with, or pass --force to stage 02 to start over.")


# --------------------------------------------------------------------------- window folders


def windows_dir(store_dir: Path, override: str | Path | None) -> Path:
    return Path(override) if override else Path(store_dir) / WINDOWS_DIR


def read_complete(folder: Path) -> dict | None:
    try:
        return json.loads((Path(folder) / COMPLETE_JSON).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def window_problem(folder: Path, *, verify_checksums: bool) -> str | None:
    """None when the round's folder is complete and whole (and its checksums hold, when asked)."""
    done = read_complete(folder)
    if done is None:
        return f"{folder} has no {COMPLETE_JSON} (not finished)"
    for e in done["files"]:
        problem = store.file_problem(Path(folder), e, verify_checksum=verify_checksums)
        if problem:
            return problem
    return None


def write_complete(folder: Path, info: dict) -> None:
    write_json(Path(folder) / COMPLETE_JSON, info)


def read_progress(wdir: Path) -> dict:
    """progress.json: {"trained_rounds": N, "checkpoint": name, "step": S}; N = 0 when it
    does not exist. A torn or unreadable file is an error naming it: read as 0, it would
    make producers extract again, and a trainer delete nothing, every round trained."""
    path = Path(wdir) / PROGRESS_JSON
    try:
        progress = json.loads(path.read_text())
    except FileNotFoundError:
        return {"trained_rounds": 0}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _progress_error(path, f"cannot be read ({type(e).__name__}: {e})") from e
    trained = progress.get("trained_rounds") if isinstance(progress, dict) else None
    if not isinstance(trained, int) or isinstance(trained, bool) or trained < 0:
        raise _progress_error(path, f"holds no count of trained rounds ({str(progress)[:200]!r})")
    return progress


def _progress_error(path: Path, what: str) -> PipelineError:
    return PipelineError(
        f"{path} {what}: it records the rounds stage 04 has trained. Rerun stage 04 (`python "
        f"{WorkDir.script('train')}` with your --config and --windows-dir): at its start it rewrites the file from "
        f"its latest checkpoint, the record of what is trained.")


def write_progress(wdir: Path, trained_rounds: int, checkpoint: str | None, step: int) -> None:
    """Record `trained_rounds` (covered by `checkpoint` at `step`; None: no checkpoint yet)."""
    Path(wdir).mkdir(parents=True, exist_ok=True)
    write_json(Path(wdir) / PROGRESS_JSON, {"trained_rounds": trained_rounds, "checkpoint": checkpoint,
                                            "step": step})


# A file deleted on NFS while a process still has it open (or mapped) is renamed by the
# client to `.nfsXXXX` and removed only once the last holder closes it; until then its
# folder cannot be removed. The removal retries for a while, then leaves the folder.
NFS_LEFTOVER = ".nfs"
REMOVE_RETRIES = 10
REMOVE_RETRY_S = 1.0


def _remove_tree(path: Path) -> list[str]:
    """Remove a folder, retrying while only `.nfs*` files keep it; those files' names when
    they still do (empty: it is gone). Any other failure raises."""
    left: list[str] = []
    for attempt in range(REMOVE_RETRIES):
        if attempt:
            time.sleep(REMOVE_RETRY_S)
        try:
            shutil.rmtree(path)
            return []
        except OSError:
            if not path.exists():
                return []
            left = sorted(str(f.relative_to(path)) for f in path.rglob("*") if not f.is_dir())
            if any(not Path(name).name.startswith(NFS_LEFTOVER) for name in left):
                raise
    return left


def delete_round(wdir: Path, round_index: int) -> bool:
    """Delete round r's folder: renamed first (one atomic step: it no longer looks like a
    window), then removed. True when something was deleted. Files some process still
    holds open on NFS (`.nfs*`) keep the renamed folder: a warning names them and a later
    `sweep` removes it."""
    d = Path(wdir) / round_name(round_index)
    gone = Path(wdir) / f".deleting-{round_name(round_index)}"
    if d.exists():
        if gone.exists() and _remove_tree(gone):  # an older leftover still held: keep it aside
            os.replace(gone, Path(wdir) / f".deleting-{round_name(round_index)}.{time.time_ns()}")
        os.replace(d, gone)
    if not gone.exists():
        return False
    left = _remove_tree(gone)
    if left:
        log.warning("round %d: %s still holds %s after %d tries %.0f s apart: files deleted while some process "
                    "has them open (NFS keeps them as .nfs files until the last holder closes them: a process "
                    "outside this run, or on another box). Their space is freed when it closes them; a later "
                    "start of stage 04 removes the folder.", round_index, gone, ", ".join(left[:5]), REMOVE_RETRIES,
                    REMOVE_RETRY_S)
    return True


def sweep(wdir: Path, trained_rounds: int) -> list[int]:
    """Delete every folder of a round already trained (rounds < `trained_rounds`), and
    leftovers of a killed or held deletion; never a round at or after `trained_rounds`."""
    wdir = Path(wdir)
    if not wdir.is_dir():
        return []
    done = set()
    for p in sorted(wdir.iterdir()):
        deleting = p.name.startswith(".deleting-")
        r = round_of(p.name.removeprefix(".deleting-").split(".")[0])
        if r is None or not (deleting or r < trained_rounds):
            continue
        if deleting and p.name != f".deleting-{round_name(r)}":  # a leftover kept aside by delete_round
            _remove_tree(p)
        else:
            delete_round(wdir, r)
        done.add(r)
    return sorted(done)


def present_rounds(wdir: Path) -> list[int]:
    """Rounds with a folder (complete or being written), in order."""
    if not Path(wdir).is_dir():
        return []
    return sorted(r for r in (round_of(p.name) for p in Path(wdir).iterdir()) if r is not None)


def dir_bytes(folder: Path) -> int:
    """Bytes of the files under d (what the store holds on disk right now)."""
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


# --------------------------------------------------------------------------- what a waiter sees


def is_round_file(name: str) -> bool:
    """A name a round's folder holds: the store's files (complete, partial, index entries,
    store.json, index.json, their atomic writes' temporary folders), window.json, the claim."""
    base = name.lstrip(".")  # a dot-named file's atomic write goes through "..NAME.*.tmp"
    fixed = (store.STORE_JSON, store.INDEX_JSON, COMPLETE_JSON, claims.CLAIM_JSON)
    shard_file = r"(?:train|eval)-\d{5,}\.(?:safetensors|json(?:\..*\.tmp)?|partial(?:[-.].*)?)"
    return (re.fullmatch(shard_file, base) is not None
            or any(base == known.lstrip(".") or base.startswith(known.lstrip(".") + ".") for known in fixed)
            or re.fullmatch(r"claim-[0-9a-f]+\.beat(?:\..*)?", base) is not None)


def round_state(folder: Path, watch: Watch) -> str:
    """A round's folder as a waiter sees it: missing, claimed by host:pid (heartbeat age as seen
    by `watch`) with its files complete so far, not claimed though unfinished, or complete;
    and how long this process has seen it so."""
    folder = Path(folder)
    if not folder.is_dir():
        kind = text = "missing (no writer has started it)"
    elif read_complete(folder) is not None:
        kind = text = "complete"
    else:
        files = sum(1 for path in folder.glob("*.safetensors") if (folder / (path.stem + ".json")).is_file())
        holder = claims.holder_of(folder)
        if holder is None:
            kind, text = "unclaimed", "not claimed: no writer holds it (its last one stopped before it finished)"
        else:
            kind, text = f"claimed {holder.token}", watch.describe(folder, holder)
        text += f", {files} file(s) complete"
    return f"{text}; so for {watch.same_for(str(folder), kind):.0f} s"
