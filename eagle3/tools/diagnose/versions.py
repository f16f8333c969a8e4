"""`diagnose versions`: the installed vllm, sglang, torch and transformers against the minimums.

The minimums are eagle3/serving/engine_rules.py `VERSION_RULES` (what the drafters and the
engine rules here are right for); versions are read from package metadata, so nothing is
imported. Exit status 1 when one is too old (or may be).
"""
from __future__ import annotations

import argparse
from typing import Any

from eagle3.serving.engine_rules import VERSION_RULES, VersionRule

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


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(NAME, help="installed vllm, sglang, torch, transformers against the minimums")


def run(a: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    r = check_versions(installed_versions())
    return r, format_versions(r), (0 if r["ok"] else 1)
