"""`diagnose store-size --config CFG [--work-dir W] [--store-dtype fp8] [--disk-budget 2TB]`: the bytes stage 02 will write.

Reads stage 01's record (samples and tokens per split, eagle3/artifacts/manifest.py
`read_record`), the target's config (hidden size, layers) and the run's extract section,
and reports the store's size in every encoding (eagle3/artifacts/store), the free space where
the work dir lies, and with a disk budget the window plan (eagle3/artifacts/windows.py). Exit
status 1 when the chosen encoding does not fit.
"""
from __future__ import annotations

import argparse
from typing import Any

from eagle3.artifacts import store, windows
from eagle3.artifacts.atomic import free_bytes
from eagle3.artifacts.dataset import load_split
from eagle3.artifacts.manifest import read_record
from eagle3.artifacts.workdir import SPLITS, WorkDir
from eagle3.core.config import build_config
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s02_extract.config import STORE_DTYPES, ExtractConfig
from eagle3.target.info import read_target_info, validate_aux_layers

NAME = "store-size"


def store_size(config: str | None, work_dir: str | None = None, store_dtype: str | None = None,
               disk_budget: str | None = None) -> dict[str, Any]:
    """The store stage 02 would write with this config, in each encoding (a JSON-able dict);
    with a disk budget (flag or extract.disk_budget), also its window plan."""

    cfg = build_config(ExtractConfig, "extract", config, {"work_dir": work_dir, "store_dtype": store_dtype,
                                                          "disk_budget": disk_budget}, sections=STAGE_CONFIGS)
    workdir = WorkDir(cfg.work_dir)
    prep = read_record(workdir, "prepare", needed_by="diagnose store-size")
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
        lengths = {s: [int(n) for n in load_split(workdir.dataset(s))["num_tokens"]] for s in SPLITS}
        p = windows.make_plan(lengths["train"], lengths["eval"], disk_budget=windows.parse_bytes(cfg.disk_budget),
                              seed=cfg.window_seed, passes=cfg.extraction_passes,
                              windows_in_budget=cfg.windows_in_budget, spf=spf, H=H, A=A, dtype=cfg.store_dtype)
        plan = {"disk_budget": p.disk_budget, "windows": p.num_windows, "passes": p.passes, "rounds": p.rounds,
                "windows_in_budget": p.windows_in_budget, "held_out_bytes": p.held_out_bytes,
                "peak_bytes": p.peak_bytes, "seed": p.seed,
                "per_window": [{"samples": len(w["samples"]), "tokens": w["tokens"], "bytes": w["bytes"]}
                               for w in p.windows]}
    free = free_bytes(workdir.root)
    present = sum(f.stat().st_size for f in workdir.store().glob("*.safetensors")) if workdir.store().is_dir() else 0
    return {"config": config, "work_dir": str(workdir.root), "prepare_manifest": str(workdir.manifest("prepare")),
            "target_model": cfg.target_model, "hidden_size": H, "num_layers": info.num_layers, "aux_layers": aux,
            "samples": samples, "tokens": tokens, "files": len(files), "samples_per_file": spf,
            "store_dtype": cfg.store_dtype, "encodings": encodings, "free_bytes": free, "present_bytes": present,
            "windows": plan,
            "ok": free >= (plan["peak_bytes"] if plan else encodings[cfg.store_dtype]["needed_bytes"]) - present}


def format_store_size(report: dict[str, Any]) -> str:
    def gb(n: int) -> str:
        return f"{n / 1e9:,.2f} GB"

    s, t = report["samples"], report["tokens"]
    out = [f"store of stage 02 for {report['config'] or 'the flags given'} (work dir {report['work_dir']})",
           f"dataset: {s['train']:,} train + {s['eval']:,} eval samples, {t['train'] + t['eval']:,} tokens "
           f"({report['prepare_manifest']}); {report['files']} files of up to {report['samples_per_file']} samples",
           f"target:  {report['target_model']}: hidden {report['hidden_size']}, {report['num_layers']} layers, aux layers "
           f"{report['aux_layers']}", "",
           f"{'store_dtype':12s}{'dtype':15s}{'B/token':>9s}{'store size':>28s}{'free needed to write':>24s}"]
    for name, e in report["encodings"].items():
        mark = "   <- this run (--store-dtype)" if name == report["store_dtype"] else ""
        out.append(f"{name:12s}{e['dtype']:15s}{e['bytes_per_token']:>9,}{e['store_bytes']:>18,} B {gb(e['store_bytes']):>8s}"
                   f"{gb(e['needed_bytes']):>24s}{mark}")
    out.append("")
    w = report.get("windows")
    if w:
        out.append(f"windows under --disk-budget {windows.human(w['disk_budget'])} (seed {w['seed']}, {w['windows_in_budget']} "
                   f"window(s) on disk at once): {w['windows']} windows x {w['passes']} extraction pass(es) = "
                   f"{w['rounds']} rounds; held-out {windows.human(w['held_out_bytes'])} kept; peak store disk "
                   f"{windows.human(w['peak_bytes'])}")
        out.append(f"{'window':>8s}{'samples':>10s}{'tokens':>16s}{'bytes':>20s}")
        for i, x in enumerate(w["per_window"]):
            out.append(f"{i:>8d}{x['samples']:>10,}{x['tokens']:>16,}{x['bytes']:>20,}")
        out.append("")
    if report["present_bytes"]:
        out.append(f"already in the store: {gb(report['present_bytes'])} (a rerun writes only the missing files)")
    need = report["encodings"][report["store_dtype"]]["needed_bytes"] - report["present_bytes"]
    out.append(f"free where the work dir lies: {gb(report['free_bytes'])}: "
               + (f"enough for {report['store_dtype']}" if report["ok"] else
                  f"NOT enough for {report['store_dtype']} (needs {gb(need)}): stage 02 will refuse to start; free space, "
                  f"use another --work-dir, --store-dtype fp8, or split over boxes with --num-shards"))
    return "\n".join(out)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="bytes stage 02 will write for this dataset, target and encoding")
    p.add_argument("--config", help="the YAML file of the run (configs/*.yaml)")
    p.add_argument("--work-dir", help="work dir holding stage 01's output (default: the config's)")
    p.add_argument("--store-dtype", choices=STORE_DTYPES, help="encoding (default: the config's extract.store_dtype)")
    p.add_argument("--disk-budget", help="bytes the store may take (e.g. 2TB): also print the window plan "
                                         "(default: the config's extract.disk_budget)")
    return p


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    r = store_size(args.config, args.work_dir, args.store_dtype, args.disk_budget)
    return r, format_store_size(r), (0 if r["ok"] else 1)
