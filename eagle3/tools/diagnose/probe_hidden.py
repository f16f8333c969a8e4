"""`diagnose probe-hidden WORK_A WORK_B [--split eval] [--max-samples N]`: two targets' hidden states compared.

Opens both stage 02 stores (eagle3/artifacts/store/reader.py `HiddenStateStore.open`) of two
work dirs extracted from the same samples and reports the cosine similarity per aux layer
and per position range, to judge whether a drafter trained on one target can serve the
other.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError

NAME = "probe-hidden"
DEFAULT_RANGES = (0, 64, 256, 1024)


def _work_dir_of(path: Path) -> WorkDir:
    """Accept a work dir or its 02_hidden_states folder."""
    path = Path(path)
    if path.name == WorkDir(path.parent).store().name:  # given WORK/02_hidden_states itself
        return WorkDir(path.parent)
    return WorkDir(path)


def probe_hidden(a_path: str, b_path: str, split: str = "eval", max_samples: int = 200,
                 ranges: tuple[int, ...] = DEFAULT_RANGES) -> dict[str, Any]:
    """Cosine similarity of two stores' hidden states on the samples both hold with equal tokens."""

    sa = HiddenStateStore.open(_work_dir_of(Path(a_path)), needed_by="diagnose probe-hidden", allow_missing=True)
    sb = HiddenStateStore.open(_work_dir_of(Path(b_path)), needed_by="diagnose probe-hidden", allow_missing=True)
    if sa.hidden_size != sb.hidden_size:
        raise PipelineError(f"hidden sizes differ ({sa.hidden_size} in {sa.dir}, {sb.hidden_size} in {sb.dir}); "
                            f"cosine similarity needs the same width (e.g. Kimi-K2 vs K2.5).")
    if sa.num_aux != sb.num_aux:
        raise PipelineError(f"{sa.dir} holds {sa.num_aux} aux layers, {sb.dir} {sb.num_aux}; extract the same "
                            f"number of layers from both targets.")
    va, vb = sa.split(split), sb.split(split)
    where_b = {sid: i for i, sid in enumerate(vb.sample_ids)}
    H, A = sa.hidden_size, sa.num_aux
    edges = list(ranges) + [None]
    names = [f"{la}/{lb}" for la, lb in zip(sa.aux_layers, sb.aux_layers)] + ["final"]
    sums = torch.zeros(len(names), len(ranges), dtype=torch.float64)
    counts = torch.zeros(len(ranges), dtype=torch.float64)
    compared = skipped_tokens = 0
    for i, sid in enumerate(va.sample_ids):
        if compared >= max_samples:
            break
        j = where_b.get(sid)
        if j is None:
            continue
        x, y = va[i], vb[j]
        if x.num_tokens != y.num_tokens or not torch.equal(x.input_ids, y.input_ids):
            skipped_tokens += 1
            continue
        T = x.num_tokens
        per = [(x.aux[:, k * H:(k + 1) * H], y.aux[:, k * H:(k + 1) * H]) for k in range(A)]  # A x [T, H]
        per.append((x.final, y.final))
        cos = torch.stack([torch.nn.functional.cosine_similarity(p.float(), q.float(), dim=-1, eps=1e-6)
                           for p, q in per])  # [A+1, T]
        pos = torch.arange(T)
        for r, lo in enumerate(ranges):
            hi = edges[r + 1]
            sel = (pos >= lo) & (pos < hi) if hi is not None else pos >= lo
            sums[:, r] += cos[:, sel].double().sum(-1)
            counts[r] += int(sel.sum())
        compared += 1
    if compared == 0:
        raise PipelineError(f"no sample of split {split!r} is in both stores with the same tokens ({sa.dir}, "
                            f"{sb.dir}); extract both targets from the same stage 01 dataset (same tokenizer).")
    labels = [f"[{lo},{edges[r + 1]})" if edges[r + 1] is not None else f"[{lo},...)" for r, lo in enumerate(ranges)]
    total = counts.sum()
    table = {}
    for n, name in enumerate(names):
        row = {"all": float(sums[n].sum() / total)}
        for r, lab in enumerate(labels):
            row[lab] = float(sums[n, r] / counts[r]) if counts[r] else None
        table[name] = row
    return {"a": {"store": str(sa.dir), "target": sa.target_model, "aux_layers": sa.aux_layers},
            "b": {"store": str(sb.dir), "target": sb.target_model, "aux_layers": sb.aux_layers},
            "split": split, "samples_compared": compared, "samples_skipped_other_tokens": skipped_tokens,
            "tokens_compared": int(total), "tokens_per_range": dict(zip(labels, counts.long().tolist())),
            "cosine": table}


def format_probe(report: dict[str, Any]) -> str:
    labels = list(report["tokens_per_range"])
    out = [f"A: {report['a']['store']} ({report['a']['target']}, layers {report['a']['aux_layers']})",
           f"B: {report['b']['store']} ({report['b']['target']}, layers {report['b']['aux_layers']})",
           f"split {report['split']}: {report['samples_compared']} samples, {report['tokens_compared']} tokens compared; "
           f"{report['samples_skipped_other_tokens']} skipped (different tokens)",
           "", "mean cosine similarity (layer A/B x position range)",
           f"{'layer':10s} {'all':>7s} " + " ".join(f"{lab:>12s}" for lab in labels)]
    for name, row in report["cosine"].items():
        cells = " ".join(f"{row[lab]:12.4f}" if row[lab] is not None else f"{'-':>12s}" for lab in labels)
        out.append(f"{name:10s} {row['all']:7.4f} {cells}")
    out.append(f"{'tokens':10s} {report['tokens_compared']:7d} " + " ".join(f"{report['tokens_per_range'][lab]:12d}"
                                                                      for lab in labels))
    return "\n".join(out)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="cosine similarity of two targets' hidden-state stores")
    p.add_argument("a", help="work dir (or its 02_hidden_states folder) of target A")
    p.add_argument("b", help="the same for target B, extracted from the same stage 01 samples")
    p.add_argument("--split", default="eval", choices=("train", "eval"))
    p.add_argument("--max-samples", type=int, default=200)
    p.add_argument("--ranges", default=",".join(map(str, DEFAULT_RANGES)),
                   help="position range starts, comma-separated (default %(default)s)")
    return p


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    ranges = tuple(sorted({int(x) for x in args.ranges.split(",") if x.strip()} | {0}))
    r = probe_hidden(args.a, args.b, args.split, args.max_samples, ranges)
    return r, format_probe(r), 0
