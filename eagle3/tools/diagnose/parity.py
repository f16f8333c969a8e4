"""`diagnose parity DIR [--checkpoint CKPT | --work-dir W]`: a drafter as vLLM's and SGLang's own classes serve it.

The check itself is eagle3/tools/parity/check.py: each engine's EAGLE-3 class is built from the
folder on the CPU (vLLM with this python, SGLang with `.venv-sglang`'s, which
scripts/setup_cpu.sh makes) and run on the same aux states, tokens and positions as the
drafter as trained, over K chained steps; the report gives per engine and step the largest
logit difference and the agreement of the proposed target ids, and names the field behind
any difference (a tensor, d2t, rope_scaling, the aux layer ids).

The drafter as trained: `--checkpoint` (a stage 04 checkpoint), else `--work-dir`'s best
checkpoint (stage 04's record; DIR's parent when DIR is a work dir's 05_export), else the folder
itself as this project reads it (then only the engines' reading of it is checked, not the
export). Exit status 1 when an engine serves it otherwise than trained (a logit difference past
--tolerance of the largest logit, a proposed id that differs where the margin is clear, or a
named field), 0 otherwise, 2 when it cannot run (e.g. SGLang not installed: every engine asked
for must run).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from eagle3.artifacts.manifest import read_record
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.errors import PipelineError
from eagle3.serving.drafter_io import CONFIG_NAME
from eagle3.serving.drafter_check import TargetFacts
from eagle3.target.info import read_target_info
from eagle3.tools.parity import check

NAME = "parity"


def reference_for(folder: Path, checkpoint: str | None, work_dir: str | None) -> check.Reference:
    """The drafter as trained, from the most direct source given (module doc)."""
    dtype = json.loads((folder / CONFIG_NAME).read_text()).get("torch_dtype") or "bfloat16"
    if checkpoint:
        return check.reference_from_checkpoint(checkpoint, dtype)
    workdir = WorkDir(work_dir) if work_dir else WorkDir(folder.parent)
    if work_dir or (folder.resolve() == workdir.stage_dir("export").resolve() and workdir.manifest("train").is_file()):
        train = read_record(workdir, "train", needed_by=f"diagnose {NAME}")
        return check.reference_from_checkpoint(workdir.stage_dir("train") / train.best_checkpoint, dtype)
    return check.reference_from_folder(folder)


def parity_case(folder: Path, reference: check.Reference, target_config: str | None, prefix: int,
                offsets: list[int], steps: int) -> check.ParityCase:
    target = TargetFacts.from_info(read_target_info(target_config)) if target_config else None
    reach = reference.config.max_position_embeddings - prefix - steps
    chains = [(prefix, min(offset, reach)) for offset in offsets]
    return check.ParityCase(folder.name or "drafter", folder, reference, chains=chains, steps=steps,
                            target_layers=target.num_layers if target else None,
                            family=target.family if target else None)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="run a drafter folder in vLLM's and SGLang's own classes against the drafter "
                                  "as trained")
    p.add_argument("dir", help="drafter folder (config.json + model.safetensors), e.g. WORK/05_export")
    p.add_argument("--checkpoint", help="the stage 04 checkpoint it was exported from (the drafter as trained)")
    p.add_argument("--work-dir", help="the work dir whose best stage 04 checkpoint it was exported from")
    p.add_argument("--target-config", help="the target's folder or config.json: its layer count and family "
                                           "(which SGLang target class reads the layer ids)")
    p.add_argument("--engines", default="vllm,sglang", help="comma-separated (default %(default)s)")
    p.add_argument("--steps", type=int, default=check.DEFAULT_STEPS, help="chained draft steps (default %(default)s)")
    p.add_argument("--prefix", type=int, default=24, help="tokens per request (default %(default)s)")
    p.add_argument("--positions", default=f"0,{check.FAR_POSITION}",
                   help="first position of each request, comma-separated (default %(default)s; capped to the "
                        "drafter's max_position_embeddings)")
    p.add_argument("--tolerance", type=float, default=check.LOGIT_TOLERANCE,
                   help="largest logit difference allowed, as a share of the largest logit (default %(default)s)")
    p.add_argument("--sglang-python", help="a python that imports SGLang (default: .venv-sglang's)")
    return p


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    folder = Path(args.dir)
    if not (folder / CONFIG_NAME).is_file():
        raise PipelineError(f"{folder} has no {CONFIG_NAME}; pass a drafter folder (e.g. WORK/05_export).")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ("vllm", "sglang")]
    if unknown or not engines:
        raise PipelineError(f"--engines {args.engines!r}: name vllm and/or sglang.")
    reference = reference_for(folder, args.checkpoint, args.work_dir)
    offsets = [int(x) for x in args.positions.split(",") if x.strip()]
    case = parity_case(folder, reference, args.target_config, args.prefix, offsets, args.steps)
    report = check.check_parity([case], engines, tolerance=args.tolerance, sglang=args.sglang_python)
    return report, check.format_report(report), (0 if report["ok"] else 1)
