"""One writer per folder: a claim made atomically before any byte is written, and its heartbeat.

Stage 02 claims the store folder (`WORK/02_hidden_states/`) while it writes the whole store
or the held-out split, and each round's folder (`windows/window-NNNNN/`, possibly on a
folder shared by several boxes) while it writes that round. Files, inside the claimed folder:

    .claim.json         who holds the folder: host, pid (and the process's start time and the
                        machine's boot id, so a pid reused after a reboot or a restart is not
                        taken for the holder), a random token, what it writes and when it
                        started (the holder's clock, for people only). Created with link(2),
                        which fails when the name exists (atomic on local file systems and on
                        NFS alike), from a temporary file already complete: a claim file is
                        never seen half-written.
    .claim-TOKEN.beat   the holder's heartbeat: a counter rewritten (atomically) every
                        `HEARTBEAT_S` seconds by a thread of the holding process.

A second writer is refused in one line naming the holder. A claim is taken over only when
its holder is provably gone (made on this machine since its last boot, and that process no
longer runs: a stage killed with -9 and run again), or on request (`take_over_stale_s`): when
the heartbeat did not change for that many seconds, watched from here. A waiter measures a
heartbeat's age by its own monotonic clock from the moment it saw the counter change, never
by comparing a time written on another machine (or a file's modification time set by a
file server) with its own clock.

Reads and writes only these two files; the caller decides what the folder holds, and a
--force run empties the folder it claimed with `empty_but_claim`, which keeps them.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from eagle3.artifacts.atomic import write_json
from eagle3.core.errors import PipelineError

log = logging.getLogger(__name__)

# Dot-named, as the store's other files that are not results (partial files): a listing of the
# finished files, and a copy of them, leaves the claim out.
CLAIM_JSON = ".claim.json"
HEARTBEAT_S = 30.0  # how often a holder rewrites its beat file
STALE_MIN_BEATS = 3  # a claim is stale after at least this many missed heartbeats


def beat_name(token: str) -> str:
    return f".claim-{token}.beat"


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' when unknown, gone, or a zombie
    that no parent reaped: it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[-1].split()  # from field 3 (state) on; the name before ')' may hold spaces
    return "" if fields[0] in ("Z", "X") else fields[19]  # field 22: start time


def writer_name() -> str:
    """This process as a file-name part: host and pid ('gpu-box-3-12345'), e.g. of a partial file."""
    host = "".join(c if c.isalnum() or c in "-_" else "-" for c in socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


@dataclass(frozen=True)
class Holder:
    """What a claim file says."""

    host: str
    pid: int
    token: str
    what: str
    started: str  # the holder's clock (UTC), for people only
    boot: str = ""
    pid_start: str = ""

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"

    @classmethod
    def this_process(cls, what: str) -> "Holder":
        return cls(host=socket.gethostname(), pid=os.getpid(), token=secrets.token_hex(8), what=what,
                   started=_utc_now(), boot=_boot_id(), pid_start=_process_start(os.getpid()))

    def gone(self) -> bool:
        """True when the holder provably no longer runs: it claimed on this machine (since
        this boot, or before it), and its process is gone (or the pid now names another)."""
        if self.host != socket.gethostname():
            return False  # another machine: only its heartbeat can tell
        if self.boot and self.boot != _boot_id():
            return True  # claimed before this machine's last boot
        if Path("/proc/self/stat").is_file():
            start = _process_start(self.pid)
            return not start or (bool(self.pid_start) and start != self.pid_start)
        try:  # no /proc (macOS): whether the pid exists is all we know
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def read_holder(folder: Path) -> Holder | None:
    """The folder's holder; None when it is not claimed (or the claim was just released)."""
    try:
        return Holder(**json.loads((Path(folder) / CLAIM_JSON).read_text()))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
        # Never half-written (link(2) of a complete file): another program wrote it.
        raise PipelineError(f"{Path(folder) / CLAIM_JSON} is not a claim this code wrote; look at it, and delete it "
                            f"if no stage 02 writes into {folder}.") from None


def read_beat(folder: Path, holder: Holder) -> int | None:
    try:
        return int(json.loads((Path(folder) / beat_name(holder.token)).read_text())["beat"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


class Watch:
    """The heartbeats a waiting process has seen: each holder's last counter and when it changed,
    by this process's monotonic clock."""

    def __init__(self):
        self._seen: dict[tuple[str, str], tuple[int | None, float]] = {}
        self._states: dict[str, tuple[str, float]] = {}

    def silent_s(self, folder: Path, holder: Holder) -> float:
        """Seconds since this process last saw the holder's heartbeat change (0 at first sight)."""
        key, beat, now = (str(folder), holder.token), read_beat(folder, holder), time.monotonic()
        last = self._seen.get(key)
        if last is None or last[0] != beat:
            self._seen[key] = (beat, now)
            return 0.0
        return now - last[1]

    def same_for(self, key: str, state: str) -> float:
        """Seconds this process has seen `key` in `state` (0 when it changed just now)."""
        now = time.monotonic()
        last = self._states.get(key)
        if last is None or last[0] != state:
            self._states[key] = (state, now)
            return 0.0
        return now - last[1]

    def describe(self, folder: Path, holder: Holder) -> str:
        silent = self.silent_s(folder, holder)
        gone = " (that process is gone)" if holder.gone() else ""
        return (f"claimed by {holder}{gone} since {holder.started} ({holder.what}), no new heartbeat for "
                f"{silent:.0f} s as seen from here (it beats every {HEARTBEAT_S:.0f} s)")


def refusal(folder: Path, holder: Holder, watch: Watch | None = None) -> str:
    """The one line that refuses a second writer."""
    return (f"{folder} is {(watch or Watch()).describe(folder, holder)}: one writer per folder. If that process "
            f"still runs, let it finish (or stop it); if its box is gone for good, rerun with --take-over-stale-s "
            f"SECONDS (at least {STALE_MIN_BEATS * HEARTBEAT_S:.0f}): the claim is taken over when its heartbeat "
            f"has not changed for that long (docs/OPERATIONS.md, 'Handing a dead box's shard to another box').")


class Claim:
    """This process's claim on a folder, from `acquire` to `release` (a context manager);
    a daemon thread beats while it is held. `check()` raises once the claim was taken over."""

    def __init__(self, folder: Path, holder: Holder):
        self.folder, self.holder = Path(folder), holder
        self._stop = threading.Event()
        self._lost: Holder | None = None
        self._beats = 0
        try:
            self._beat()
        except BaseException:
            (self.folder / CLAIM_JSON).unlink(missing_ok=True)
            raise
        self._thread = threading.Thread(target=self._run, name=f"claim-{folder.name}", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, folder: Path, *, what: str, take_over_stale_s: float | None = None) -> "Claim":
        """Claim `folder` (created if missing) or raise a PipelineError naming its holder.

        A holder that is provably gone (`Holder.gone`) is replaced, as is, with
        `take_over_stale_s`, one whose heartbeat did not change for that many seconds (this
        call watches that long before it takes over)."""
        if take_over_stale_s is not None and take_over_stale_s < STALE_MIN_BEATS * HEARTBEAT_S:
            raise PipelineError(f"--take-over-stale-s {take_over_stale_s:g} is shorter than {STALE_MIN_BEATS} "
                                f"heartbeats ({STALE_MIN_BEATS * HEARTBEAT_S:.0f} s): a live writer could lose its "
                                f"folder. Pass at least {STALE_MIN_BEATS * HEARTBEAT_S:.0f}.")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        me = Holder.this_process(what)
        watch = Watch()
        while True:
            if _create(folder, me):
                return cls(folder, me)
            holder = read_holder(folder)
            if holder is None:
                continue  # released between our attempt and the read: try again
            if holder.gone():
                log.warning("%s: taking over the claim of %s (%s): that process no longer runs", folder, holder,
                            holder.what)
            elif take_over_stale_s is not None:
                if not _silent_for(folder, holder, take_over_stale_s, watch):
                    if holder_of(folder) == holder:
                        raise PipelineError(refusal(folder, holder, watch))  # it beats: alive
                    continue  # released or taken meanwhile: try again
                log.warning("%s: taking over the claim of %s (%s): no new heartbeat for %.0f s (--take-over-stale-s)",
                            folder, holder, holder.what, take_over_stale_s)
            else:
                raise PipelineError(refusal(folder, holder, watch))
            _remove_claim_of(folder, holder)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            holder = holder_of(self.folder)
            if holder is None or holder.token != self.holder.token:
                self._lost = holder
                log.error("%s: this run's claim is gone (%s); it stops before its next file is complete",
                          self.folder, f"taken over by {holder}" if holder else f"{CLAIM_JSON} removed")
                return
            try:
                self._beat()
            except (OSError, PipelineError) as e:  # a full disk, a lost mount: the claim ages; the writes fail too
                log.warning("%s: could not write this run's heartbeat (%s)", self.folder, e)

    def _beat(self) -> None:
        self._beats += 1
        write_json(self.folder / beat_name(self.holder.token), {"beat": self._beats, "time": _utc_now()})

    def check(self) -> None:
        """Raise when this process no longer holds the folder: nothing more may be finished in it."""
        holder = holder_of(self.folder)
        if holder is None or holder.token != self.holder.token:
            how = f"taken over by {holder}" if holder else "removed"
            raise PipelineError(f"{self.folder}: this run's claim was {how} while it wrote; it stops without "
                                f"finishing the folder (the holder, if any, writes it).")

    def release(self) -> None:
        """Stop beating and remove the claim, if it is still ours."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        holder = holder_of(self.folder)
        if holder is not None and holder.token == self.holder.token:
            (self.folder / CLAIM_JSON).unlink(missing_ok=True)
        (self.folder / beat_name(self.holder.token)).unlink(missing_ok=True)

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder_of(folder: Path) -> Holder | None:
    """`read_holder`, with a claim file this code did not write read as no claim."""
    try:
        return read_holder(folder)
    except PipelineError:
        return None


def _create(folder: Path, me: Holder) -> bool:
    """Create folder/.claim.json for `me` unless it exists: a complete temporary file, linked."""
    tmp = folder / f"{CLAIM_JSON}.{me.token}.tmp"
    tmp.write_text(json.dumps(asdict(me), indent=2, sort_keys=True) + "\n")
    try:
        os.link(tmp, folder / CLAIM_JSON)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _silent_for(folder: Path, holder: Holder, seconds: float, watch: Watch) -> bool:
    """Watch the holder's heartbeat for `seconds`: True when it never changed (and the claim stayed)."""
    first = read_beat(folder, holder)
    watch.silent_s(folder, holder)
    deadline = time.monotonic() + seconds
    log.info("%s: %s; watching its heartbeat for %.0f s before taking it over", folder,
             watch.describe(folder, holder), seconds)
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.01, deadline - time.monotonic())))
        now = holder_of(folder)
        if now is None or now.token != holder.token or read_beat(folder, holder) != first:
            return False
    return True


def _remove_claim_of(folder: Path, holder: Holder) -> None:
    """Remove `holder`'s claim: renamed aside first (only one of two takers can), then deleted,
    unless the name held another claim by then (put back)."""
    aside = folder / f"{CLAIM_JSON}.{holder.token}.taken"
    try:
        os.rename(folder / CLAIM_JSON, aside)
    except FileNotFoundError:
        return  # another taker, or the holder's release, came first
    try:
        moved = Holder(**json.loads(aside.read_text()))
    except (OSError, json.JSONDecodeError, TypeError):
        moved = None
    if moved is not None and moved.token != holder.token:
        # A third writer claimed the folder between our read and the rename: give it back.
        try:
            os.link(aside, folder / CLAIM_JSON)
        except FileExistsError:
            pass
    aside.unlink(missing_ok=True)
    (folder / beat_name(holder.token)).unlink(missing_ok=True)


def live_claims(folders) -> list[tuple[Path, Holder]]:
    """The claims in `folders` whose holders may still run (not provably gone)."""
    out = []
    for folder in folders:
        holder = holder_of(Path(folder))
        if holder is not None and not holder.gone():
            out.append((Path(folder), holder))
    return out


def empty_but_claim(folder: Path, claim: Claim | None) -> None:
    """Delete what `folder` holds but `claim`'s own files (a --force run emptying the folder it
    claimed; the folder itself stays)."""
    own = {CLAIM_JSON, beat_name(claim.holder.token)} if claim is not None else set()
    for entry in folder.iterdir():
        if entry.name in own:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink(missing_ok=True)
