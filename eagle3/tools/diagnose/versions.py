"""`diagnose versions`: the installed vllm, sglang, torch and transformers against the minimums.

The minimums are eagle3/serving/engine_rules.py `VERSION_RULES` (what the drafters and the
engine rules here are right for); versions are read from package metadata, so nothing is
imported (SGLang also in `.venv-sglang`, eagle3/serving/installed.py). Each installed engine is
also asked how it reads a yarn drafter's rope (`yarn_reading_warnings`): Kimi-K2.5's, or with
`--drafter-dir` that drafter's; an engine that scales it otherwise than training is a problem.
Exit status 1 when one is too old (or may be), or reads the rope otherwise.
"""
from __future__ import annotations

import argparse
from typing import Any

from eagle3.serving.drafter_io import read_drafter_dir
from eagle3.serving.engine_rules import VERSION_RULES, VersionRule, yarn_reading_warnings
from eagle3.serving.installed import installed_version

NAME = "versions"


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
        if out[r.package] is None and r.package == "sglang":
            found = installed_version("sglang")  # its own environment, .venv-sglang
            out[r.package] = (found[0], found[1]) if found else None
    return out


# Kimi-K2.5's text_config.rope_scaling: the reference case's yarn, read by each installed engine
# when no drafter is named.
KIMI_K25_ROPE = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def rope_warnings(installed: dict[str, tuple[str, str] | None], drafter_dir: str | None = None) -> list[str]:
    """How each installed engine would scale a yarn drafter's rope, where it differs from training."""
    config = read_drafter_dir(drafter_dir).config if drafter_dir else {"rope_scaling": KIMI_K25_ROPE}
    versions = {p: (v[0] if v else None) for p, v in installed.items()}
    what = f"the drafter in {drafter_dir}" if drafter_dir else "a Kimi-K2.5 drafter (yarn, factor 64, mscale 1)"
    return [f"{line} [{what}]" for line in yarn_reading_warnings(config, versions)]


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
    return {"packages": rows, "ok": not bad, "problems": [x["package"] for x in bad], "rope": []}


def format_versions(report: dict[str, Any]) -> str:
    out = [f"{'package':13s} {'installed':22s} {'needed':18s} status"]
    notes = {"ok": "ok", "too-old": "TOO OLD", "too-new": "TOO NEW", "missing": "MISSING (required)",
             "absent": "not installed (only needed to serve with it)",
             "unsure": "CHECK: may predate the fixes below"}
    for x in report["packages"]:
        have = x["installed"] or "-"
        if x["distribution"] and x["distribution"] != x["package"]:
            have += f" ({x['distribution']})"
        need = f">= {x['minimum']}" + (f", < {x['below']}" if x["below"] else "")
        out.append(f"{x['package']:13s} {have:22s} {need:18s} {notes[x['status']]}")
    out.append("")
    for x in report["packages"]:
        if x["status"] != "ok":
            out.append(f"{x['package']} >= {x['minimum']}: {x['why']}")
    for line in report.get("rope", []):
        out.append(f"ROPE: {line}")
    if report["ok"]:
        out.append("OK: every installed engine meets the minimums for serving and training these drafters")
    else:
        out.append(f"FAIL: {', '.join(report['problems'])} outside the supported versions; install the versions "
                   f"above (README, \"Engine versions\")")
    return "\n".join(out)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="installed vllm, sglang, torch, transformers against the minimums")
    p.add_argument("--drafter-dir", help="a drafter folder whose rope each installed engine is asked about "
                                         "(default: Kimi-K2.5's yarn)")
    return p


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    installed = installed_versions()
    r = check_versions(installed)
    r["rope"] = rope_warnings(installed, getattr(args, "drafter_dir", None))
    if r["rope"]:
        r["ok"] = False
        r["problems"] = sorted(set(r["problems"]) | {line.split(" ")[0] for line in r["rope"]})
    return r, format_versions(r), (0 if r["ok"] else 1)
