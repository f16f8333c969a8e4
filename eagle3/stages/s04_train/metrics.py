"""Stage 04's metrics: sums over batches and ranks, metrics.jsonl, the trackers, log lines.

Writes `WorkDir.train_metrics()` (one JSON line per log interval and evaluation,
docs/CONVENTIONS.md §5) and feeds the same keys and steps to the trackers --report-to
names (eagle3/stages/s04_train/trackers.py; by default TensorBoard when installed).
Rank 0 only; the sums are reduced over the ranks through eagle3/stages/s04_train/distributed.py
first. A resumed run drops the lines past the checkpoint it resumes from and
continues the file, so a finished run has each step once.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from eagle3.artifacts.atomic import atomic_path, disk_full_error, is_disk_full
from eagle3.artifacts.workdir import WorkDir
from eagle3.stages.s04_train.distributed import all_reduce_sum
from eagle3.stages.s04_train.trackers import Tracker, open_trackers, resolve, scalars

log = logging.getLogger(__name__)


class MetricSum:
    """Sums of per-batch metrics weighted by each batch's valid-position count.

    full_acc_k are exact over the summed positions; cond_acc_k is then derived
    from them (full_k / full_{k-1}); loss_k is the valid-weighted mean.
    """

    def __init__(self, K: int):
        self.K = K
        self.v = torch.zeros(2 * K + 1, dtype=torch.float64)  # loss_k*n, full_k*n, n

    def add(self, m: dict) -> None:
        n = m["num_valid"]
        self.v += torch.tensor([m[f"loss_{k}"] * n for k in range(self.K)]
                               + [m[f"full_acc_{k}"] * n for k in range(self.K)] + [n], dtype=torch.float64)

    def all_reduce(self, world: int) -> None:
        """Sum over the `world` ranks. The sums live on the host (float64); an NCCL-only
        group cannot reduce them, so they go through the seam, which reduces them where the
        group can (eagle3/stages/s04_train/distributed.py)."""
        if world > 1:
            self.v = all_reduce_sum(self.v)

    def result(self) -> dict:
        K, n = self.K, float(self.v[-1])
        out: dict = {"num_valid": n}
        full = [float(self.v[K + k]) / n if n else 0.0 for k in range(K)]
        for k in range(K):
            out[f"loss_{k}"] = float(self.v[k]) / n if n else float("nan")
            out[f"full_acc_{k}"] = full[k]
            prev = 1.0 if k == 0 else full[k - 1]
            out[f"cond_acc_{k}"] = full[k] / prev if prev > 0 else 0.0
        out["expected_accept_length"] = 1.0 + sum(full)
        return out


def append_line(path: Path, line: str) -> None:
    """Append one line; on a full disk, cut the file back to its old length (no torn
    line for the next run to read) and raise `DiskFullError` naming the path and bytes."""
    data = (line + "\n").encode()
    size = path.stat().st_size if path.is_file() else 0
    try:
        with open(path, "ab") as f:
            f.write(data)
    except OSError as e:
        try:
            with open(path, "r+b") as f:
                f.truncate(size)
        except OSError:
            log.warning("could not cut %s back to %d bytes after a failed write", path, size)
        if is_disk_full(e):
            raise disk_full_error(path, needed=len(data)) from e
        raise


def read_lines_up_to(path: Path, step: int) -> list[str]:
    """The lines of `path` at or before `step`; a torn last line (a kill mid-write) is dropped."""
    keep = []
    for i, line in enumerate(path.read_text().splitlines()):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s line %d is not JSON (a write cut short); dropped", path, i + 1)
            continue
        if row["step"] <= step:
            keep.append(line)
    return keep


class MetricsLog:
    """Rank 0: metrics.jsonl (appended; resumed runs continue it) and the trackers of --report-to."""

    def __init__(self, wd: WorkDir, enabled: bool, resume_step: int, report_to: list[str] | None = None,
                 run_config: dict | None = None):
        self.enabled = enabled
        self.path = wd.train_metrics()
        self.trackers: list[Tracker] = []
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():  # drop lines past the checkpoint we resume from
            text = "".join(k + "\n" for k in read_lines_up_to(self.path, resume_step))
            with atomic_path(self.path, expected_bytes=len(text.encode())) as tmp:
                tmp.write_text(text)
        self.trackers = open_trackers(resolve(report_to or ["auto"]), wd, run_config or {})

    def write(self, split: str, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        append_line(self.path, json.dumps({"split": split, "step": step, **metrics}))
        values = scalars(split, metrics)
        for t in self.trackers:
            t.log(step, values)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def fmt(split: str, step: int, total: int, m: dict, K: int, extra: str = "") -> str:
    """One fixed-format log line; `K`: the TTT steps, whose full_acc_k it shows."""
    accs = " ".join(f"{m[f'full_acc_{k}']:.3f}" for k in range(K))
    return (f"{split:5s} step {step:6d}/{total} | loss_0 {m['loss_0']:.4f} | full_acc {accs} | "
            f"accept_len {m['expected_accept_length']:.3f}{extra}")
