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
    """Sums of per-batch metrics, each weighted by the count of positions it is a mean over.

    full_acc_k (and with `sampling` sample_full_acc_k) are means over the step-0 positions
    (num_valid), accept_prob_k over step k's own (num_valid_k): exact over the summed
    positions. cond_acc_k is derived from full_acc (full_k / full_{k-1}). loss_k and ce_k,
    means over step k's positions, are weighted by num_valid (step 0's count). `sampling`:
    the held-out figures under sampling (TTTOutput's docstring) are summed too; every rank
    must pass the same value, so every rank's vector has the same layout.
    """

    def __init__(self, K: int, sampling: bool = False):
        self.K = K
        self.sampling = sampling
        names = ("loss", "ce", "full_acc") + (("sample_full_acc",) if sampling else ())
        # (metric, the count it is a mean over), then the counts themselves
        self.means = [(f"{name}_{k}", "num_valid") for name in names for k in range(K)]
        self.counts = ["num_valid"]
        if sampling:
            self.means += [(f"accept_prob_{k}", f"num_valid_{k}") for k in range(K)]
            self.counts += [f"num_valid_{k}" for k in range(K)]
        self.v = torch.zeros(len(self.means) + len(self.counts), dtype=torch.float64)

    def add(self, metrics: dict) -> None:
        self.v += torch.tensor([metrics[key] * metrics[count] for key, count in self.means] + [metrics[c] for c in self.counts],
                               dtype=torch.float64)

    def all_reduce(self, world: int) -> None:
        """Sum over the `world` ranks. The sums live on the host (float64); an NCCL-only
        group cannot reduce them, so they go through the seam, which reduces them where the
        group can (eagle3/stages/s04_train/distributed.py)."""
        if world > 1:
            self.v = all_reduce_sum(self.v)

    def result(self) -> dict:
        K = self.K
        counts = {c: float(x) for c, x in zip(self.counts, self.v[len(self.means):])}
        sums = {key: float(x) for (key, _), x in zip(self.means, self.v)}

        def mean(key: str, count: str, empty: float) -> float:
            return sums[key] / counts[count] if counts[count] else empty

        n = counts["num_valid"]
        out: dict = {"num_valid": n}
        full = [mean(f"full_acc_{k}", "num_valid", 0.0) for k in range(K)]
        for k in range(K):
            out[f"loss_{k}"] = mean(f"loss_{k}", "num_valid", float("nan"))
            out[f"ce_{k}"] = mean(f"ce_{k}", "num_valid", float("nan"))
            out[f"full_acc_{k}"] = full[k]
            prev = 1.0 if k == 0 else full[k - 1]
            out[f"cond_acc_{k}"] = full[k] / prev if prev > 0 else 0.0
        out["expected_accept_length"] = 1.0 + sum(full)
        if self.sampling:
            for k in range(K):
                out[f"accept_prob_{k}"] = mean(f"accept_prob_{k}", f"num_valid_{k}", 0.0)
                out[f"num_valid_{k}"] = counts[f"num_valid_{k}"]
                out[f"sample_full_acc_{k}"] = mean(f"sample_full_acc_{k}", "num_valid", 0.0)
            out["sample_accept_length"] = 1.0 + sum(out[f"sample_full_acc_{k}"] for k in range(K))
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

    def __init__(self, workdir: WorkDir, enabled: bool, resume_step: int, report_to: list[str] | None = None,
                 run_config: dict | None = None):
        self.enabled = enabled
        self.path = workdir.train_metrics()
        self.trackers: list[Tracker] = []
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():  # drop lines past the checkpoint we resume from
            text = "".join(k + "\n" for k in read_lines_up_to(self.path, resume_step))
            with atomic_path(self.path, expected_bytes=len(text.encode())) as tmp:
                tmp.write_text(text)
        self.trackers = open_trackers(resolve(report_to or ["auto"]), workdir, run_config or {})

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


def fmt(split: str, step: int, total: int, metrics: dict, K: int, extra: str = "") -> str:
    """One fixed-format log line; `K`: the TTT steps, whose full_acc_k it shows, and on
    held-out lines the acceptance under sampling per step and its expected length."""
    accs = " ".join(f"{metrics[f'full_acc_{k}']:.3f}" for k in range(K))
    sampled = ""
    if "sample_accept_length" in metrics:
        probs = " ".join(f"{metrics[f'accept_prob_{k}']:.3f}" for k in range(K))
        sampled = f" | sampled: accept {probs}, len {metrics['sample_accept_length']:.3f}"
    return (f"{split:5s} step {step:6d}/{total} | loss_0 {metrics['loss_0']:.4f} | full_acc {accs} | "
            f"accept_len {metrics['expected_accept_length']:.3f}{sampled}{extra}")
