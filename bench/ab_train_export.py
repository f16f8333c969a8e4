"""Stages 04 and 05 under two checkouts on the same inputs: are the numbers the same?

    python bench/ab_train_export.py --work-dir W --repo A=/path/to/old --repo B=. \\
        [--windows-from WW] [--max-steps 40] [--config configs/smollm2-135m.yaml] [--out DIR]

A code change that only moves code (a refactor) must leave every figure as it was. For
each checkout given with --repo, stage 04 trains --max-steps steps on W's stages 01-03
(W: a work dir where they ran, the demo's by default) and stage 05 exports the drafter;
each run gets its own work dir OUT/<label>/whole/ with W's stages as symlinks, so the
inputs are the same bytes for every checkout. With --windows-from WW (a work dir whose
02_hidden_states/ holds the rounds of a disk budget, written by stage 02's
`--disk-budget B --windows-in-budget N --produce` with N at least the number of rounds),
each checkout also trains over those rounds, on its own copy (stage 04 writes
progress.json into the rounds' folder), in OUT/<label>/windows/.

Prints, per mode, each run's held-out figures at every evaluation (all digits), the
SHA-256 of its exported model.safetensors and config.json, and whether all checkouts
agree on every one of them. Throughput and time figures differ run to run and are left
out of the comparison. Exits 1 when the checkouts disagree.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
VARYING = {"tokens_per_s", "seconds", "elapsed_s", "time"}  # figures of the machine, not of the weights


def link_stages(src: Path, dst: Path, stages: tuple[str, ...]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        if not (dst / stage).exists():
            (dst / stage).symlink_to((src / stage).resolve(), target_is_directory=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_mode(repo: Path, work: Path, config: Path, target: str, max_steps: int, extra: list[str]) -> dict:
    """Stage 04 then 05 of `repo` in `work`; the figures that must not move."""
    common = ["--config", str(config.resolve()), "--work-dir", str(work), "--target-model", target]
    if not (work / "05_export" / "model.safetensors").is_file():
        subprocess.run([sys.executable, "04_train_drafter.py", *common, "--max-steps", str(max_steps), *extra],
                       cwd=repo, check=True)
        subprocess.run([sys.executable, "05_export_drafter.py", *common], cwd=repo, check=True)
    evals = [json.loads(line) for line in (work / "04_train" / "metrics.jsonl").read_text().splitlines()
             if line.strip()]
    return {
        "metrics": [{k: v for k, v in record.items() if k not in VARYING} for record in evals],
        "model.safetensors": sha256(work / "05_export" / "model.safetensors"),
        "config.json": sha256(work / "05_export" / "config.json"),
    }


def compare(mode: str, runs: dict[str, dict]) -> bool:
    labels = list(runs)
    first = runs[labels[0]]
    same = all(runs[label] == first for label in labels[1:])
    print(f"\n## {mode}: {'the same' if same else 'DIFFERENT'} across {', '.join(labels)}")
    for label, run in runs.items():
        print(f"  {label}: model.safetensors {run['model.safetensors'][:16]}  config.json {run['config.json'][:16]}")
    for record in first["metrics"]:
        if record.get("split") == "eval":
            figures = {k: record[k] for k in ("loss_0", "full_acc_0", "expected_accept_length") if k in record}
            print(f"  step {record['step']} held-out: {json.dumps(figures)}")
    if not same:
        for label in labels[1:]:
            for a, b in zip(first["metrics"], runs[label]["metrics"]):
                diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}
                if diff:
                    print(f"  first difference, {labels[0]} vs {label}, step {a.get('step')} "
                          f"({a.get('split')}): {diff}")
                    break
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, required=True, help="work dir where stages 01-03 ran (the inputs)")
    ap.add_argument("--repo", action="append", required=True, metavar="LABEL=DIR",
                    help="a checkout to run (give two or more)")
    ap.add_argument("--windows-from", type=Path, help="work dir whose 02_hidden_states/ holds produced rounds")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-135m.yaml")
    ap.add_argument("--target-model", help="the target's folder (default: the config's, relative to this checkout, "
                                           "so every checkout reads the same one)")
    ap.add_argument("--max-steps", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "work" / "ab-train-export")
    args = ap.parse_args()
    repos = dict(item.split("=", 1) for item in args.repo)
    target = args.target_model or str(ROOT / yaml.safe_load(args.config.read_text())["target_model"])
    modes = {"whole": {}, **({"windows": {}} if args.windows_from else {})}
    for label, repo in repos.items():
        whole = args.out / label / "whole"
        link_stages(args.work_dir, whole, ("00_generate", "01_dataset", "02_hidden_states", "03_vocab"))
        modes["whole"][label] = run_mode(Path(repo).resolve(), whole, args.config, target,
                                         args.max_steps, [])
        if args.windows_from:
            windowed = args.out / label / "windows"
            link_stages(args.work_dir, windowed, ("00_generate", "01_dataset", "03_vocab"))
            if not (windowed / "02_hidden_states").exists():
                shutil.copytree(args.windows_from / "02_hidden_states", windowed / "02_hidden_states")
            modes["windows"][label] = run_mode(Path(repo).resolve(), windowed, args.config, target,
                                               args.max_steps, ["--keep-windows"])
    same = [compare(mode, runs) for mode, runs in modes.items()]
    sys.exit(0 if all(same) else 1)


if __name__ == "__main__":
    main()
