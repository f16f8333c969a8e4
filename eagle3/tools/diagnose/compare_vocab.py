"""`diagnose compare-vocab A B [--dataset WORK_DIR]`: two draft vocabularies side by side.

A and B are each a drafter folder (its d2t, read by eagle3/serving/drafter_io.py
`read_drafter_dir`), a work dir or its stage 03 folder (read by eagle3/artifacts/vocab_map.py
`load_mapping`, stage 03's one reader), or a d2t/t2d file (.npy, .pt or .safetensors, e.g.
another project's). Reports the positions differing, the tokens shared or only in one,
and with `--dataset` the coverage each gets on a stage 01 dataset's assistant tokens
(eagle3/artifacts/dataset.py `load_token_freq`).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.artifacts import vocab_map
from eagle3.artifacts.dataset import load_token_freq
from eagle3.artifacts.vocab_map import VocabMapping, compare_mappings, coverage, target_ids
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.serving.drafter_io import CONFIG_NAME, normalise_names, read_drafter_dir

NAME = "compare-vocab"


def _ids_from_array(a: np.ndarray, source: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == bool:
        return np.flatnonzero(a).astype(np.int64)  # a t2d
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise PipelineError(f"{source}: expected a 1-D integer d2t or a bool t2d, got {a.dtype} {a.shape}.")
    return target_ids(a)


def _load_array(path: Path) -> np.ndarray:
    if path.suffix == ".npy":
        return np.load(path)
    if path.suffix in (".pt", ".pth"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, dict):
            obj = obj.get("d2t", obj.get("t2d"))
        if not isinstance(obj, torch.Tensor):
            raise PipelineError(f"{path} holds no d2t/t2d tensor.")
        return obj.numpy()
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        t = load_file(path)
        t, _ = normalise_names(t)
        if "d2t" not in t:
            raise PipelineError(f"{path} has no d2t tensor.")
        return t["d2t"].numpy()
    raise PipelineError(f"{path}: unknown mapping file type; pass a .npy/.pt d2t or t2d, a drafter folder, "
                        f"a stage 03 folder or a work dir.")


def draft_vocabulary(path: Path | str) -> VocabMapping:
    """A draft vocabulary from a drafter folder, a stage 03 folder, a work dir, or a d2t/t2d file."""
    path = Path(path)
    if path.is_file():
        return VocabMapping(str(path), _ids_from_array(_load_array(path), str(path)), None)
    if not path.is_dir():
        raise PipelineError(f"{path} does not exist; pass a drafter folder, a stage 03 folder, a work dir, "
                            f"or a d2t/t2d file.")
    if (path / CONFIG_NAME).is_file():
        files = read_drafter_dir(path)
        t, _ = normalise_names(files.tensors)
        V = files.config.get("vocab_size")
        if "d2t" in t:
            ids = _ids_from_array(t["d2t"].numpy(), str(path))
        else:  # no d2t: both engines use the identity over draft_vocab_size
            ids = np.arange(int(files.config.get("draft_vocab_size") or V), dtype=np.int64)
        return VocabMapping(str(path), ids, int(V) if V else None)
    workdir = _work_dir_of(path)
    if workdir.stage_dir("vocab").is_dir():  # stage 03's files, through their one reader
        d2t, t2d = vocab_map.load_mapping(workdir)
        return VocabMapping(str(workdir.d2t()), _ids_from_array(d2t.numpy(), str(workdir.d2t())), int(t2d.shape[0]))
    raise PipelineError(f"{path} holds no drafter ({CONFIG_NAME}) and is neither a work dir with a "
                        f"{workdir.stage_dir('vocab').name}/ folder nor that folder; pass a drafter folder, a stage 03 "
                        f"folder, a work dir, or a d2t/t2d file.")


def _work_dir_of(path: Path) -> WorkDir:
    """Accept a work dir or its stage 03 folder."""
    if path.name == WorkDir(path.parent).stage_dir("vocab").name:  # given WORK/03_vocab itself
        return WorkDir(path.parent)
    return WorkDir(path)


def mapping_coverage(m: VocabMapping, freq: np.ndarray) -> float:
    """Share of token occurrences (a stage 01 frequency array) the mapping can predict."""

    t2d = np.zeros(len(freq), dtype=bool)
    ids = m.target_ids[(m.target_ids >= 0) & (m.target_ids < len(freq))]
    t2d[ids] = True
    return coverage(freq, t2d)


def compare_vocab(a_path: str, b_path: str, dataset: str | None = None) -> dict[str, Any]:
    a, b = draft_vocabulary(a_path), draft_vocabulary(b_path)
    r = compare_mappings(a, b)
    if dataset is not None:
        workdir = WorkDir(dataset)
        r["coverage"] = {}
        for split in ("train", "eval"):
            f = workdir.token_freq(split)
            if not f.is_file():
                continue
            freq = load_token_freq(workdir, split)
            for m in (a, b):
                if m.vocab_size is not None and m.vocab_size != len(freq):
                    raise PipelineError(f"{m.source} is for a vocab of {m.vocab_size}, {f} counts {len(freq)} "
                                        f"ids: another target's dataset.")
            r["coverage"][split] = {"assistant_tokens": int(freq.sum()), "a": mapping_coverage(a, freq),
                                    "b": mapping_coverage(b, freq)}
        if not r["coverage"]:
            raise PipelineError(f"{workdir.stage_dir('prepare')} has no token_freq_*.npy; run "
                                f"`python {workdir.script('prepare')} --work-dir {dataset}` first.")
    return r


def format_compare(report: dict[str, Any]) -> str:
    out = [f"A: {report['a']['source']} (draft vocab {report['a']['draft_vocab_size']}, target vocab {report['a']['vocab_size']})",
           f"B: {report['b']['source']} (draft vocab {report['b']['draft_vocab_size']}, target vocab {report['b']['vocab_size']})",
           f"positions differing: {report['positions_differing']}/{report['positions_compared']}",
           f"tokens shared: {report['tokens_shared']}; only in A: {report['only_in_a']}; only in B: {report['only_in_b']}"]
    for split, c in (report.get("coverage") or {}).items():
        out.append(f"coverage of {split} assistant tokens ({c['assistant_tokens']}): A {100 * c['a']:.2f}%, "
                   f"B {100 * c['b']:.2f}%")
    if report["positions_differing"]:
        out.append("note: lm_head rows follow d2t (convention 3); weights of one with the mapping of the other "
                   "predict the wrong tokens")
    return "\n".join(out)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="compare two draft vocabularies")
    p.add_argument("a", help="drafter folder, stage 03 folder, work dir, or d2t/t2d file (.npy/.pt)")
    p.add_argument("b")
    p.add_argument("--dataset", help="work dir whose stage 01 token frequencies give the coverage")
    return p


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    r = compare_vocab(args.a, args.b, args.dataset)
    return r, format_compare(r), 0
