"""--select-checkpoint: which of stage 04's kept checkpoints the engine serves best.

Stage 04 picks best.pt by a training-time figure (the held-out expected accept length);
served acceptance and training figures can part ways late in training. With
`04_train_drafter.py --keep-evaluated N` (N > 1) the newest N evaluated checkpoints stay on
disk; this module lists them (best.pt too when its step is no longer among them), writes
each as a scratch drafter folder (the export's config.json, the checkpoint's weights),
compares what vLLM served for each, greedy, on the same prompts (each against the last
checkpoint, with the paired 95% interval of eagle3/serving/acceptance_pairs.py), chooses
the best and builds the command that has stage 05 export it. The engine runs themselves
are run.py's (`select_checkpoint`), like the stage's other runs.

The choice: the highest served acceptance length; a tie goes to the later step (the
one with more training). The best of N estimates is an optimistic estimate of that
checkpoint, so the table gives each one's paired interval against the last: a chosen
checkpoint whose interval holds 0 is not shown to serve better than simply the last.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle3.artifacts.train_outputs import TrainCheckpoint, evaluated_checkpoints, read_checkpoint
from eagle3.artifacts.workdir import REPO_ROOT, WorkDir
from eagle3.core import readable
from eagle3.core.errors import PipelineError
from eagle3.serving.acceptance_pairs import PerPrompt, acceptance_length, paired_interval
from eagle3.serving.drafter_io import load_drafter_dir, save_drafter_dir
from eagle3.serving.engine_rules import D2T, EMBED_NAME as EMBED, T2D
from eagle3.stages.s06_evaluate.figures import histogram_counts, ratio_interval

FIX = (f"rerun `python {WorkDir.script('train')} --keep-evaluated N --force` (N >= 2; a finished run keeps "
       f"only best.pt and its last checkpoints), or run stage 06 without --select-checkpoint")


@dataclass(frozen=True)
class Candidate:
    step: int
    path: Path
    held_out: float | None  # stage 04's held-out expected accept length at this step


def candidates(workdir: WorkDir) -> list[Candidate]:
    """The checkpoints to serve, by step: every step file holding held-out metrics, and
    best.pt when its step is not among them (pruned as older than the last N). Refused
    below two: there would be nothing to choose."""
    found = [Candidate(workdir.checkpoint_step(p), p, c.eval.get("expected_accept_length"))
             for p, c in evaluated_checkpoints(workdir)]
    best = workdir.best_checkpoint()
    if best.is_file():
        ckpt = read_checkpoint(best)
        if ckpt.step not in {c.step for c in found}:
            found.append(Candidate(ckpt.step, best, (ckpt.eval or {}).get("expected_accept_length")))
    found.sort(key=lambda c: c.step)
    if len(found) < 2:
        raise PipelineError(f"--select-checkpoint needs at least 2 evaluated checkpoints in {workdir.checkpoints()}, "
                            f"found {len(found)} ({', '.join(c.path.name for c in found) or 'none'}); {FIX}.")
    return found


def write_candidate_drafter(ckpt: TrainCheckpoint, source: Path, export_dir: Path, out_dir: Path,
                            dtype: str) -> Path:
    """`ckpt`'s weights as a drafter folder beside the export: its config.json, the same
    tensor names and shapes (else the checkpoint is another run's, refused naming both)."""
    hf, exported = load_drafter_dir(export_dir)
    # The export leaves out embed_tokens (the engines use the target's) and an identity d2t.
    state = {k: v for k, v in ckpt.model.items() if k != EMBED and (k in exported or k not in (D2T, T2D))}
    ours = {k: tuple(v.shape) for k, v in state.items()}
    theirs = {k: tuple(v.shape) for k, v in exported.items() if k != EMBED}
    differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if differ:
        raise PipelineError(f"{source} is not of the drafter exported in {export_dir}: tensors {differ[:6]} differ "
                            f"(checkpoint {[ours.get(k) for k in differ[:3]]}, export "
                            f"{[theirs.get(k) for k in differ[:3]]}); export this run first (`python "
                            f"{WorkDir.script('export')} --force`), then select.")
    save_drafter_dir(out_dir, state, hf, dtype=dtype, overwrite=True,
                     allow_engine_mismatch=True)
    return out_dir


def per_prompt_counts(histograms: list[list[int]], K: int) -> PerPrompt:
    """(accepted draft tokens, verification steps) per prompt from the engine's per-request histograms."""
    counts = [histogram_counts(h, K) for h in histograms]
    return np.array([c[1] for c in counts], float), np.array([c[0] for c in counts], float)


def compare(cands: list[Candidate], served: dict[int, PerPrompt]) -> list[dict]:
    """One row per candidate, by step: its held-out figure, its served acceptance length with
    its own 95% half-width, and the paired 95% interval of it minus the last candidate's."""
    last = served[cands[-1].step]
    rows = []
    for c in cands:
        a = served[c.step]
        rows.append({"step": c.step, "checkpoint": str(c.path), "held_out_expected_accept_length": c.held_out,
                     "acceptance_length": acceptance_length(a), "ci95": ratio_interval(list(a[0]), list(a[1])),
                     "vs_last": None if c is cands[-1] else list(paired_interval(a, last))})
    return rows


def choose(rows: list[dict]) -> dict:
    """The row with the highest served acceptance length; a tie goes to the later step."""
    return max(rows, key=lambda r: (r["acceptance_length"], r["step"]))


def chosen_by(rows: list[dict], chosen: dict, prompts: int, own_prompts: bool = False) -> str:
    """The model card's line on how the exported checkpoint was chosen; `own_prompts`: on a
    prompt set of its own, not the one the card's figures are measured on."""
    last = rows[-1]
    steps = ", ".join(str(r["step"]) for r in rows)
    which = "held-out prompts of their own (not the measured ones)" if own_prompts else "held-out prompts"
    head = (f"the best greedy acceptance length served in vLLM of {len(rows)} kept checkpoints (steps {steps}) on "
            f"{prompts} {which}: {readable.fixed(chosen['acceptance_length'], 3)} at step {chosen['step']}")
    if chosen is last:
        return head + " (the last one)"
    lo, hi = chosen["vs_last"]
    return (head + f", {chosen['acceptance_length'] - last['acceptance_length']:+.3f} against the last (step "
                   f"{last['step']}, {readable.fixed(last['acceptance_length'], 3)}), paired 95% interval "
                   f"[{lo:+.3f}, {hi:+.3f}]")


def table_lines(rows: list[dict], chosen: dict) -> list[str]:
    """The comparison as the log shows it, one line per checkpoint."""
    lines = [f"stage 06 --select-checkpoint: {len(rows)} checkpoints served greedy on the same prompts "
             f"(paired 95% interval of each minus the last, step {rows[-1]['step']}):",
             f"  {'step':>8}  {'held-out':>8}  {'served L':>16}  {'vs last':>20}"]
    for r in rows:
        served = f"{r['acceptance_length']:.3f}" + (f" ±{r['ci95']:.3f}" if r["ci95"] is not None else "")
        vs = "-" if r["vs_last"] is None else (f"{r['acceptance_length'] - rows[-1]['acceptance_length']:+.3f} "
                                               f"[{r['vs_last'][0]:+.3f}, {r['vs_last'][1]:+.3f}]")
        mark = "  <- exported" if r is chosen else ""
        lines.append(f"  {r['step']:>8}  {readable.fixed(r['held_out_expected_accept_length'], 3):>8}  "
                     f"{served:>16}  {vs:>20}{mark}")
    return lines


def export_command(params: dict, checkpoint: Path, chosen_by_text: str) -> list[str]:
    """Stage 05's command line that exports `checkpoint` as the last export did (its manifest's
    identity parameters), with the card's line on how it was chosen. Stage 05 runs as its own
    script, as a user would run it: no stage imports another."""
    args = {**params, "checkpoint": str(checkpoint), "chosen_by": chosen_by_text}
    cmd = [sys.executable, str(REPO_ROOT / WorkDir.script("export"))]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            cmd += [flag, ",".join(map(str, value))]
        else:
            cmd += [flag, str(value)]
    return cmd
