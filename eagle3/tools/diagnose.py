"""Diagnostics for drafters, vocab mappings and hidden-state stores.

    python -m eagle3.tools.diagnose inspect DIR [--target-config PATH_OR_DIR] [--json]
    python -m eagle3.tools.diagnose compare-vocab A B [--dataset WORK_DIR] [--json]
    python -m eagle3.tools.diagnose probe-hidden WORK_A WORK_B [--split eval] [--max-samples N] [--json]
    python -m eagle3.tools.diagnose versions [--json]
    python -m eagle3.tools.diagnose store-size --config CFG [--work-dir W] [--store-dtype fp8] [--json]
    python -m eagle3.tools.diagnose forecast --work-dir W --target-al 2.46 [--config CFG] [--fractions 0.125,0.25,0.5,1]
                                       [--fit-upto 0.5] [--law log] [--json]

`inspect` reads any drafter folder (ours, or a published one such as an SGLang-format
drafter) and says what vLLM and SGLang will do with it: tensor names and shapes, d2t
sanity, the layers each engine (and each of vLLM's two model runners) captures,
context length and tie_word_embeddings against a target. It exits 1 when anything would fail or silently misbehave in an
engine, 0 otherwise, and 2 when the folder cannot be read.

`compare-vocab` compares two draft vocabularies (a drafter folder, a stage 03 folder
or work dir, or a d2t/t2d file): positions differing, tokens shared or only in one,
and with `--dataset` the coverage each gets on a stage 01 dataset's assistant tokens.

`probe-hidden` compares two targets' hidden-state stores (stage 02 of two work dirs
over the same samples): cosine similarity per aux layer and per position range, to
judge whether a drafter trained on one target can serve the other.

`store-size` prints the bytes stage 02 will write for this dataset (stage 01's
record: samples and tokens per split), target (hidden size, aux layer count
from its config and `extract.aux_layers`) and store encoding (`extract.store_dtype`,
or `--store-dtype`), for every encoding side by side, and the free space where the work
dir lies. It exits 1 when the chosen encoding does not fit: stage 02 itself refuses to
start then (eagle3/core/store/writer.py `require_free_space`, on what is still to be written).

`forecast` trains stage 04 on nested fractions of W's train split (budgets proportional
to their size, each in W/forecast/frac-<f>/ over symlinks to W's stages 00-03; a
finished fraction is reused), fits held-out acceptance length against training tokens
with a documented law, and prints the points, the law, the tokens (and conversations)
expected to reach --target-al with a 95% interval, and the check: the fit on fractions
<= --fit-upto against the largest run. It exits 1 when that check lands outside its
interval (eagle3/tools/forecast.py, docs/FORECAST.md).

`versions` prints the installed vllm, sglang, torch and transformers against the
minimums the drafters and engine rules here are right for (eagle3/core/engine_rules.py
`VERSION_RULES`), with a verdict; it exits 1 when one is too old (or may be).

This module prints its reports (that is its product); everything else logs.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.core import store, windows
from eagle3.core.atomic import free_bytes
from eagle3.core.config import build_config
from eagle3.core.dataset import load_split, load_token_freq
from eagle3.core.drafter_io import CONFIG_NAME, normalise_names, read_drafter_dir
from eagle3.core.engine_rules import (RULES, VERSION_RULES, TargetFacts, VersionRule, captured_layers, check_drafter,
                                      d2t_summary, errors, implied_head_dim, intended_layers, rules_for, sglang_name,
                                      vllm_name)
from eagle3.core.errors import PipelineError
from eagle3.core.logs import setup_logging
from eagle3.core.manifest import read_record
from eagle3.core.store import HiddenStateStore
from eagle3.core.target import read_target_info, validate_aux_layers
from eagle3.core.vocab_map import VocabMapping, compare_mappings, coverage, target_ids
from eagle3.core.workdir import SPLITS, WorkDir
from eagle3.stages.s02_extract.config import STORE_DTYPES, ExtractConfig
from eagle3.tools import forecast

log = logging.getLogger(__name__)


# =========================================================================== inspect

def inspect_drafter(path: Path | str, target_config: str | None = None) -> dict[str, Any]:
    """Everything `inspect` reports, as a JSON-able dict (key "ok": no errors)."""
    files = read_drafter_dir(path)
    cfg, tensors = files.config, files.tensors
    target = None
    if target_config is not None:

        target = TargetFacts.from_info(read_target_info(target_config))
    findings = check_drafter(cfg, tensors, target, pipeline_format=False)
    N = target.num_layers if target else None
    layers, where = intended_layers(cfg, target.family if target else None)
    canon, _ = normalise_names(tensors)
    d2t = canon.get("d2t")
    return {
        "path": str(files.path),
        "weight_files": [p.name for p in files.weight_files],
        "config": {k: cfg.get(k) for k in (
            "architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "draft_vocab_size",
            "target_hidden_size", "max_position_embeddings", "tie_word_embeddings", "torch_dtype")},
        "head_dim_used": implied_head_dim(cfg),
        "tensors": [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                     "vllm": vllm_name(n)[0], "sglang": sglang_name(n)[0]} for n, t in tensors.items()],
        "d2t": d2t_summary(d2t, cfg.get("vocab_size")) if d2t is not None else None,
        "layers": {
            "trained": layers, "from": where,
            "config_top_level": cfg.get("eagle_aux_hidden_state_layer_ids"),
            "config_nested": (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            if isinstance(cfg.get("eagle_config"), dict) else None,
            "captured": {rule: captured_layers(rule, cfg, N) for rule in rules_for(target.family if target else None)},
        },
        "target": asdict(target) if target else None,
        "findings": [asdict(f) for f in findings],
        "errors": len(errors(findings)),
        "ok": not errors(findings),
    }


def format_inspect(r: dict[str, Any]) -> str:
    c = r["config"]
    out = [f"drafter {r['path']}  ({', '.join(r['weight_files'])})", ""]
    out.append(f"config: {c['architectures']} model_type={c['model_type']} layers={c['num_hidden_layers']} "
               f"hidden={c['hidden_size']} heads={c['num_attention_heads']}/{c['num_key_value_heads']} "
               f"head_dim={c['head_dim'] if c['head_dim'] is not None else 'absent -> ' + str(r['head_dim_used'])} "
               f"intermediate={c['intermediate_size']}")
    out.append(f"        vocab={c['vocab_size']} draft_vocab={c['draft_vocab_size']} "
               f"target_hidden={c['target_hidden_size']} max_position_embeddings={c['max_position_embeddings']} "
               f"tie_word_embeddings={c['tie_word_embeddings']} dtype={c['torch_dtype']}")
    out += ["", f"{'tensor':44s} {'shape':>16s} {'dtype':9s} {'vLLM':7s} SGLang"]
    for t in r["tensors"]:
        out.append(f"{t['name']:44s} {str(t['shape']):>16s} {t['dtype']:9s} {t['vllm']:7s} {t['sglang']}")
    d = r["d2t"]
    out.append("")
    if d:
        out.append(f"d2t: {d['size']} ids, {d['dtype']}, target ids {d.get('min_target_id')}..{d.get('max_target_id')}, "
                   f"ascending={d['ascending']} duplicates={d['duplicates']} out_of_range={d['out_of_range']}")
    else:
        out.append("d2t: absent")
    L = r["layers"]
    out += ["", f"aux layers: trained on {L['trained']} ({L['from']}); config top-level {L['config_top_level']}, "
                f"eagle_config {L['config_nested']}"]
    width = max((len(RULES[rule].split(":")[0]) for rule in L["captured"]), default=0)
    for rule, got in L["captured"].items():
        mark = "" if got is None or got == L["trained"] or L["trained"] is None else "   <-- differs"
        label = RULES[rule].split(":")[0]
        out.append(f"  {label:{width}s} captures {got if got is not None else '[2, N//2, N-3] of the target'}{mark}")
    if r["target"]:
        t = r["target"]
        out.append(f"target {t['source']}: {t['family']} family, {t['num_layers']} layers, hidden {t['hidden_size']}, "
                   f"vocab {t['vocab_size']}, context {t['max_position_embeddings']}")
    out.append("")
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(r["findings"], key=lambda f: order[f["level"]]):
        out.append(f"{f['level'].upper():7s} [{f['engine']}] {f['topic']}: {f['message']}")
    out += ["", "OK: both engines load this drafter as trained" if r["ok"]
            else f"FAIL: {r['errors']} problem(s) that fail or silently misbehave in an engine"]
    return "\n".join(out)


# =========================================================================== compare-vocab

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


def load_mapping(path: Path | str) -> VocabMapping:
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
    wd = WorkDir(path)
    for folder in (path, wd.stage_dir("vocab")):  # a stage 03 folder, or a work dir holding one
        for d2t in (folder / wd.d2t(suffix).name for suffix in ("npy", "pt")):
            if d2t.is_file():
                t2d = folder / wd.t2d("npy").name
                V = int(np.load(t2d).shape[0]) if t2d.is_file() else None
                return VocabMapping(str(d2t), _ids_from_array(_load_array(d2t), str(d2t)), V)
    raise PipelineError(f"{path} holds no drafter ({CONFIG_NAME}), no {wd.d2t('npy').name}/{wd.d2t('pt').name}, "
                        f"and no {wd.stage_dir('vocab').name}/ folder.")


def mapping_coverage(m: VocabMapping, freq: np.ndarray) -> float:
    """Share of token occurrences (a stage 01 frequency array) the mapping can predict."""

    t2d = np.zeros(len(freq), dtype=bool)
    ids = m.target_ids[(m.target_ids >= 0) & (m.target_ids < len(freq))]
    t2d[ids] = True
    return coverage(freq, t2d)


def compare_vocab(a_path: str, b_path: str, dataset: str | None = None) -> dict[str, Any]:
    a, b = load_mapping(a_path), load_mapping(b_path)
    r = compare_mappings(a, b)
    if dataset is not None:
        wd = WorkDir(dataset)
        r["coverage"] = {}
        for split in ("train", "eval"):
            f = wd.token_freq(split)
            if not f.is_file():
                continue
            freq = load_token_freq(wd, split)
            for m in (a, b):
                if m.vocab_size is not None and m.vocab_size != len(freq):
                    raise PipelineError(f"{m.source} is for a vocab of {m.vocab_size}, {f} counts {len(freq)} "
                                        f"ids: another target's dataset.")
            r["coverage"][split] = {"assistant_tokens": int(freq.sum()), "a": mapping_coverage(a, freq),
                                    "b": mapping_coverage(b, freq)}
        if not r["coverage"]:
            raise PipelineError(f"{wd.stage_dir('prepare')} has no token_freq_*.npy; run "
                                f"`python {wd.script('prepare')} --work-dir {dataset}` first.")
    return r


def format_compare(r: dict[str, Any]) -> str:
    out = [f"A: {r['a']['source']} (draft vocab {r['a']['draft_vocab_size']}, target vocab {r['a']['vocab_size']})",
           f"B: {r['b']['source']} (draft vocab {r['b']['draft_vocab_size']}, target vocab {r['b']['vocab_size']})",
           f"positions differing: {r['positions_differing']}/{r['positions_compared']}",
           f"tokens shared: {r['tokens_shared']}; only in A: {r['only_in_a']}; only in B: {r['only_in_b']}"]
    for split, c in (r.get("coverage") or {}).items():
        out.append(f"coverage of {split} assistant tokens ({c['assistant_tokens']}): A {100 * c['a']:.2f}%, "
                   f"B {100 * c['b']:.2f}%")
    if r["positions_differing"]:
        out.append("note: lm_head rows follow d2t (convention 3); weights of one with the mapping of the other "
                   "predict the wrong tokens")
    return "\n".join(out)


# =========================================================================== probe-hidden

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


def format_probe(r: dict[str, Any]) -> str:
    labels = list(r["tokens_per_range"])
    out = [f"A: {r['a']['store']} ({r['a']['target']}, layers {r['a']['aux_layers']})",
           f"B: {r['b']['store']} ({r['b']['target']}, layers {r['b']['aux_layers']})",
           f"split {r['split']}: {r['samples_compared']} samples, {r['tokens_compared']} tokens compared; "
           f"{r['samples_skipped_other_tokens']} skipped (different tokens)",
           "", "mean cosine similarity (layer A/B x position range)",
           f"{'layer':10s} {'all':>7s} " + " ".join(f"{lab:>12s}" for lab in labels)]
    for name, row in r["cosine"].items():
        cells = " ".join(f"{row[lab]:12.4f}" if row[lab] is not None else f"{'-':>12s}" for lab in labels)
        out.append(f"{name:10s} {row['all']:7.4f} {cells}")
    out.append(f"{'tokens':10s} {r['tokens_compared']:7d} " + " ".join(f"{r['tokens_per_range'][lab]:12d}"
                                                                      for lab in labels))
    return "\n".join(out)


# =========================================================================== versions

def installed_versions(rules: tuple[VersionRule, ...] = VERSION_RULES) -> dict[str, tuple[str, str] | None]:
    """package -> (version, distribution name) as installed, or None; read from package
    metadata, so nothing is imported (importing vllm takes seconds)."""
    from importlib import metadata

    out: dict[str, tuple[str, str] | None] = {}
    for r in rules:
        out[r.package] = None
        for dist in r.distributions:
            try:
                out[r.package] = (metadata.version(dist), dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def check_versions(installed: dict[str, tuple[str, str] | None],
                   rules: tuple[VersionRule, ...] = VERSION_RULES) -> dict[str, Any]:
    """Each package's status against its rule: ok, too-old, too-new, unsure, missing, absent
    (not installed and not needed here); "ok" overall when none is below its minimum,
    unsure or a required one missing."""
    from packaging.version import InvalidVersion, Version

    rows = []
    for r in rules:
        got = installed.get(r.package)
        row = {"package": r.package, "installed": got[0] if got else None,
               "distribution": got[1] if got else None, "minimum": r.minimum, "below": r.below,
               "why": r.why}
        if got is None:
            row["status"] = "missing" if r.required else "absent"
        else:
            try:
                v = Version(got[0]).release  # 2.13.0+cpu and 0.32.0rc1 compare by their release numbers
            except InvalidVersion:
                v = None
            if v is None:
                row["status"] = "unsure"
            elif v < Version(r.minimum).release:
                unsure = r.unsure_from is not None and v >= Version(r.unsure_from).release
                row["status"] = "unsure" if unsure else "too-old"
            elif r.below is not None and v >= Version(r.below).release:
                row["status"] = "too-new"
            else:
                row["status"] = "ok"
        rows.append(row)
    bad = [x for x in rows if x["status"] in ("too-old", "too-new", "unsure", "missing")]
    return {"packages": rows, "ok": not bad, "problems": [x["package"] for x in bad]}


def format_versions(r: dict[str, Any]) -> str:
    out = [f"{'package':13s} {'installed':22s} {'needed':18s} status"]
    notes = {"ok": "ok", "too-old": "TOO OLD", "too-new": "TOO NEW", "missing": "MISSING (required)",
             "absent": "not installed (only needed to serve with it)",
             "unsure": "CHECK: may predate the fixes below"}
    for x in r["packages"]:
        have = x["installed"] or "-"
        if x["distribution"] and x["distribution"] != x["package"]:
            have += f" ({x['distribution']})"
        need = f">= {x['minimum']}" + (f", < {x['below']}" if x["below"] else "")
        out.append(f"{x['package']:13s} {have:22s} {need:18s} {notes[x['status']]}")
    out.append("")
    for x in r["packages"]:
        if x["status"] != "ok":
            out.append(f"{x['package']} >= {x['minimum']}: {x['why']}")
    if r["ok"]:
        out.append("OK: every installed engine meets the minimums for serving and training these drafters")
    else:
        out.append(f"FAIL: {', '.join(r['problems'])} outside the supported versions; install the versions "
                   f"above (README, \"Engine versions\")")
    return "\n".join(out)


# =========================================================================== store-size

def store_size(config: str | None, work_dir: str | None = None, store_dtype: str | None = None,
               disk_budget: str | None = None) -> dict[str, Any]:
    """The store stage 02 would write with this config, in each encoding (a JSON-able dict);
    with a disk budget (flag or extract.disk_budget), also its window plan."""

    cfg = build_config(ExtractConfig, "extract", config, {"work_dir": work_dir, "store_dtype": store_dtype,
                                                          "disk_budget": disk_budget})
    wd = WorkDir(cfg.work_dir)
    prep = read_record(wd, "prepare", needed_by="diagnose store-size")
    info = read_target_info(cfg.target_model, cfg.trust_remote_code)
    aux = validate_aux_layers(cfg.aux_layers if cfg.aux_layers is not None else info.default_aux_layers(),
                              info.num_layers, source=f"extract.aux_layers for {cfg.target_model}")
    H, A, spf = info.hidden_size, len(aux), cfg.samples_per_file
    files: list[tuple[int, int]] = []  # (samples, tokens) per file, in stage 02's plan
    samples, tokens = {}, {}
    for split in SPLITS:
        n, t = prep.samples[split], prep.tokens[split]
        samples[split], tokens[split] = n, t
        counts = [min(spf, n - a) for a in range(0, n, spf)]
        # The record has each split's token total, not each file's: only the total matters
        # to the size (headers are counted at their largest), so share it out by samples.
        shares = [t * c // n for c in counts]
        if shares:
            shares[-1] += t - sum(shares)
        files += list(zip(counts, shares))
    encodings = {}
    for name in store.ENCODINGS:
        size = store.bytes_to_write(files, H, A, name, engines=0)
        encodings[name] = {**store.encoding_fields(name), "bytes_per_token": store.bytes_per_token(H, A, name),
                           "store_bytes": size,
                           "needed_bytes": store.bytes_to_write(files, H, A, name, cfg.data_parallel_size)}
    plan = None
    if cfg.disk_budget is not None:
        lengths = {s: [int(n) for n in load_split(wd.dataset(s))["num_tokens"]] for s in SPLITS}
        p = windows.make_plan(lengths["train"], lengths["eval"], disk_budget=windows.parse_bytes(cfg.disk_budget),
                              seed=cfg.window_seed, passes=cfg.extraction_passes,
                              windows_in_budget=cfg.windows_in_budget, spf=spf, H=H, A=A, dtype=cfg.store_dtype)
        plan = {"disk_budget": p.disk_budget, "windows": p.num_windows, "passes": p.passes, "rounds": p.rounds,
                "windows_in_budget": p.windows_in_budget, "held_out_bytes": p.held_out_bytes,
                "peak_bytes": p.peak_bytes, "seed": p.seed,
                "per_window": [{"samples": len(w["samples"]), "tokens": w["tokens"], "bytes": w["bytes"]}
                               for w in p.windows]}
    free = free_bytes(wd.root)
    present = sum(f.stat().st_size for f in wd.store().glob("*.safetensors")) if wd.store().is_dir() else 0
    return {"config": config, "work_dir": str(wd.root), "prepare_manifest": str(wd.manifest("prepare")),
            "target_model": cfg.target_model, "hidden_size": H, "num_layers": info.num_layers, "aux_layers": aux,
            "samples": samples, "tokens": tokens, "files": len(files), "samples_per_file": spf,
            "store_dtype": cfg.store_dtype, "encodings": encodings, "free_bytes": free, "present_bytes": present,
            "windows": plan,
            "ok": free >= (plan["peak_bytes"] if plan else encodings[cfg.store_dtype]["needed_bytes"]) - present}


def format_store_size(r: dict[str, Any]) -> str:
    def gb(n: int) -> str:
        return f"{n / 1e9:,.2f} GB"

    s, t = r["samples"], r["tokens"]
    out = [f"store of stage 02 for {r['config'] or 'the flags given'} (work dir {r['work_dir']})",
           f"dataset: {s['train']:,} train + {s['eval']:,} eval samples, {t['train'] + t['eval']:,} tokens "
           f"({r['prepare_manifest']}); {r['files']} files of up to {r['samples_per_file']} samples",
           f"target:  {r['target_model']}: hidden {r['hidden_size']}, {r['num_layers']} layers, aux layers "
           f"{r['aux_layers']}", "",
           f"{'store_dtype':12s}{'dtype':15s}{'B/token':>9s}{'store size':>28s}{'free needed to write':>24s}"]
    for name, e in r["encodings"].items():
        mark = "   <- this run (--store-dtype)" if name == r["store_dtype"] else ""
        out.append(f"{name:12s}{e['dtype']:15s}{e['bytes_per_token']:>9,}{e['store_bytes']:>18,} B {gb(e['store_bytes']):>8s}"
                   f"{gb(e['needed_bytes']):>24s}{mark}")
    out.append("")
    w = r.get("windows")
    if w:
        out.append(f"windows under --disk-budget {windows.human(w['disk_budget'])} (seed {w['seed']}, {w['windows_in_budget']} "
                   f"window(s) on disk at once): {w['windows']} windows x {w['passes']} extraction pass(es) = "
                   f"{w['rounds']} rounds; held-out {windows.human(w['held_out_bytes'])} kept; peak store disk "
                   f"{windows.human(w['peak_bytes'])}")
        out.append(f"{'window':>8s}{'samples':>10s}{'tokens':>16s}{'bytes':>20s}")
        for i, x in enumerate(w["per_window"]):
            out.append(f"{i:>8d}{x['samples']:>10,}{x['tokens']:>16,}{x['bytes']:>20,}")
        out.append("")
    if r["present_bytes"]:
        out.append(f"already in the store: {gb(r['present_bytes'])} (a rerun writes only the missing files)")
    need = r["encodings"][r["store_dtype"]]["needed_bytes"] - r["present_bytes"]
    out.append(f"free where the work dir lies: {gb(r['free_bytes'])}: "
               + (f"enough for {r['store_dtype']}" if r["ok"] else
                  f"NOT enough for {r['store_dtype']} (needs {gb(need)}): stage 02 will refuse to start; free space, "
                  f"use another --work-dir, --store-dtype fp8, or split over boxes with --num-shards"))
    return "\n".join(out)


# =========================================================================== CLI

def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(prog="python -m eagle3.tools.diagnose", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pi = sub.add_parser("inspect", help="check a drafter folder against vLLM's and SGLang's rules")
    pi.add_argument("dir", help="drafter folder (config.json + model.safetensors)")
    pi.add_argument("--target-config", help="the target's model folder or config.json (or hub id)")
    pc = sub.add_parser("compare-vocab", help="compare two draft vocabularies")
    pc.add_argument("a", help="drafter folder, stage 03 folder, work dir, or d2t/t2d file (.npy/.pt)")
    pc.add_argument("b")
    pc.add_argument("--dataset", help="work dir whose stage 01 token frequencies give the coverage")
    pp = sub.add_parser("probe-hidden", help="cosine similarity of two targets' hidden-state stores")
    pp.add_argument("a", help="work dir (or its 02_hidden_states folder) of target A")
    pp.add_argument("b", help="the same for target B, extracted from the same stage 01 samples")
    pp.add_argument("--split", default="eval", choices=("train", "eval"))
    pp.add_argument("--max-samples", type=int, default=200)
    pp.add_argument("--ranges", default=",".join(map(str, DEFAULT_RANGES)),
                    help="position range starts, comma-separated (default %(default)s)")
    pv = sub.add_parser("versions", help="installed vllm, sglang, torch, transformers against the minimums")
    ps = sub.add_parser("store-size", help="bytes stage 02 will write for this dataset, target and encoding")
    ps.add_argument("--config", help="the YAML file of the run (configs/*.yaml)")
    ps.add_argument("--work-dir", help="work dir holding stage 01's output (default: the config's)")
    ps.add_argument("--store-dtype", choices=STORE_DTYPES, help="encoding (default: the config's extract.store_dtype)")
    ps.add_argument("--disk-budget", help="bytes the store may take (e.g. 2TB): also print the window plan "
                                          "(default: the config's extract.disk_budget)")
    pf = sub.add_parser("forecast", help="train on nested fractions of the data and forecast the training tokens "
                                         "that reach a target acceptance (docs/FORECAST.md)")
    pf.add_argument("--work-dir", required=True, help="work dir with stages 01-03 done (its fraction runs go to "
                                                      "WORK/forecast/)")
    pf.add_argument("--target-al", type=float, required=True, help="held-out expected accept length to reach "
                                                                   "(e.g. a deployment's break-even)")
    pf.add_argument("--config", help="the YAML file of the run: its train section is the full run's settings")
    pf.add_argument("--target-model", help="target model folder (default: the config's target_model)")
    pf.add_argument("--fractions", default=",".join(f"{f:g}" for f in forecast.DEFAULT_FRACTIONS),
                    help="fractions of the train split, comma-separated (default %(default)s)")
    pf.add_argument("--fit-upto", type=float, default=forecast.DEFAULT_FIT_UPTO,
                    help="the check fits on the fractions up to this one and predicts the largest (default "
                         "%(default)s)")
    pf.add_argument("--law", choices=tuple(forecast.LAWS), default=forecast.DEFAULT_LAW,
                    help="the law fitted (default %(default)s; docs/FORECAST.md compares them)")
    pf.add_argument("--max-steps", type=int, help="the full run's steps (default: train.max_steps, or its epochs' "
                                                  "steps); a fraction f runs round(f * this)")
    pf.add_argument("--warmup-steps", type=int, help="the full run's warmup steps (default: train.warmup_steps)")
    pf.add_argument("--device", help="stage 04's --device (default: the config's)")
    for sp in (pi, pc, pp, pv, ps, pf):
        sp.add_argument("--json", action="store_true", help="print the report as JSON")
        sp.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    # forecast trains for minutes: stage 04's progress lines are its only sign of life
    setup_logging(logging.DEBUG if a.verbose else logging.INFO if a.cmd == "forecast" else logging.WARNING)
    try:
        if a.cmd == "inspect":
            r = inspect_drafter(a.dir, a.target_config)
            text, rc = format_inspect(r), (0 if r["ok"] else 1)
        elif a.cmd == "compare-vocab":
            r = compare_vocab(a.a, a.b, a.dataset)
            text, rc = format_compare(r), 0
        elif a.cmd == "versions":
            r = check_versions(installed_versions())
            text, rc = format_versions(r), (0 if r["ok"] else 1)
        elif a.cmd == "store-size":
            r = store_size(a.config, a.work_dir, a.store_dtype, a.disk_budget)
            text, rc = format_store_size(r), (0 if r["ok"] else 1)
        elif a.cmd == "forecast":
            r = forecast.run_forecast(a.work_dir, target_al=a.target_al, config=a.config, target_model=a.target_model,
                                      fractions=forecast.parse_fractions(a.fractions), fit_upto=a.fit_upto,
                                      law=a.law, max_steps=a.max_steps, warmup_steps=a.warmup_steps,
                                      device=a.device)
            text, rc = forecast.format_report(r), (1 if r["chosen"].get("check", {}).get("inside") is False else 0)
        else:
            ranges = tuple(sorted({int(x) for x in a.ranges.split(",") if x.strip()} | {0}))
            r = probe_hidden(a.a, a.b, a.split, a.max_samples, ranges)
            text, rc = format_probe(r), 0
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2, default=str) if a.json else text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
