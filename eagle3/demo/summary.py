"""The demo's closing summary: what each stage produced, in one screen.

    python -m eagle3.demo.summary --config configs/tiny-llama.yaml [--elapsed-s SECONDS]

Reads the records (eagle3/artifacts/records.py) of stages 00, 01, 03 and 04 (those that ran)
and 06 of the config's work directory, stage 04's metrics.jsonl, stage 06's results.json and, when given, the
per-stage wall times scripts/demo.sh records (`--stage-times FILE`: lines `name seconds`);
writes nothing. `summary_text` returns the text (tests read it); `main` prints it.

The closing `verdict` judges the run only by what it measured: the trained drafter
against the untrained one, the served acceptance against the training-time estimate,
the measured acceptance against the measured break-even (and the speedup). A figure
that was not measured leaves its line out; timings stage 06 found unreliable give
"timings unreliable: no verdict" and no speed figure.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eagle3.artifacts.manifest import read_record
from eagle3.artifacts.train_outputs import read_train_metrics
from eagle3.artifacts.workdir import WorkDir
from eagle3.core import readable
from eagle3.core.config import load_yaml
from eagle3.core.errors import PipelineError
from eagle3.serving.model_card import CARD_NAME
from eagle3.stages.s06_evaluate.report import NO_VERDICT, speed_phrase

CURVE_ROWS = 8  # held-out evaluations shown in the training table (evenly spaced)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _spark(values: list[float], lo: float = 0.0, hi: float = 1.0) -> str:
    """A one-line bar chart: the training curve at a glance in any terminal."""
    bars = "▁▂▃▄▅▆▇█"
    if not values:
        return ""
    span = (hi - lo) or 1.0
    return "".join(bars[min(len(bars) - 1, max(0, int((v - lo) / span * (len(bars) - 1) + 0.5)))] for v in values)


def _evenly(rows: list, n: int) -> list:
    if len(rows) <= n:
        return rows
    idx = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in idx]


def training_table(metrics: list[dict], K: int, ttt_steps: int) -> list[str]:
    """Stage 04's held-out curve: full_acc_k for the first min(K, ttt_steps) positions."""
    evals = [m for m in metrics if m.get("split") == "eval"]
    trains = [m for m in metrics if m.get("split") == "train"]
    if not evals:
        return ["  (no held-out evaluations in stage 04's metrics)"]
    ks = list(range(min(K, ttt_steps)))
    head = "  step    loss_0  " + "  ".join(f"full_acc_{k}" for k in ks) + f"  expected L (K={len(ks)})"
    lines = [head]
    for m in _evenly(evals, CURVE_ROWS):
        acc = [m[f"full_acc_{k}"] for k in ks]
        lines.append(f"  {m['step']:>5d}  {m['loss_0']:>7.3f}  " + "  ".join(f"{a:>10.3f}" for a in acc)
                     + f"  {1 + sum(acc):>14.3f}")
    if trains:
        lines.append(f"  full_acc_0 over {len(trains)} train log windows: {_spark([m['full_acc_0'] for m in trains])}"
                     f"  ({trains[0]['full_acc_0']:.2f} -> {trains[-1]['full_acc_0']:.2f})")
    return lines


def read_stage_times(path: Path | str | None) -> list[tuple[str, float]]:
    """`name seconds` per line, as scripts/demo.sh appends them; missing file -> []."""
    if path is None or not Path(path).is_file():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((parts[0], float(parts[1])))
    return rows


def _mmss(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"


def _optional(workdir: WorkDir, stage: str, need: str):
    """A stage's record when that stage ran here (stage 06 alone may measure a drafter from elsewhere)."""
    return read_record(workdir, stage, needed_by=need) if workdir.manifest(stage).is_file() else None


def pipeline_lines(workdir: WorkDir, K: int, need: str) -> list[str]:
    """What stages 00-04 made, one block each, for the stages that ran in this work directory."""
    gen, prep = _optional(workdir, "generate", need), _optional(workdir, "prepare", need)
    vocab, train = _optional(workdir, "vocab", need), _optional(workdir, "train", need)
    lines = []
    if gen:
        new = gen.new_turns
        lines.append(f"answers   stage 00: the target answered {gen.turns_regenerated} turns of "
                     f"{gen.conversations} conversations itself"
                     + (f" ({new} of them prompts without an answer in the data)" if new else "")
                     + f", {gen.generated_tokens} tokens; the drafter learns those, token-exact")
    if prep:
        n, t, a = prep.samples, prep.tokens, prep.assistant_tokens
        lines.append(f"data      {n['train']} train / {n['eval']} held-out conversations; "
                     f"{t['train']:,} / {t['eval']:,} tokens ({a['train']:,} / "
                     f"{a['eval']:,} assistant tokens carry the loss)")
    if vocab:
        lines.append(f"vocab     draft vocab {vocab.draft_vocab_size} ids; coverage of assistant tokens: train "
                     f"{_pct(vocab.coverage_train)}, held-out {_pct(vocab.coverage_eval)}")
    if train:
        metrics = read_train_metrics(workdir)
        lines += [f"training  {train.steps} steps; best held-out expected accept length "
                  f"{_num(train.best_expected_accept_length, '.3f')} (all {train.ttt_steps} TTT steps) "
                  f"at step {train.best_step}", *training_table(metrics, K, train.ttt_steps)]
    return lines


def served_lines(results: dict) -> list[str]:
    """What vLLM measured; a figure that was not measured (no baseline, no timing, no dataset
    answer to compare with) leaves its line out."""
    K = results["num_speculative_tokens"]
    exp = results["expected_accept_length_training"]
    L, L0 = results["acceptance_length"], results["untrained_acceptance_length"]
    t = results.get("acceptance_temperature", 0.0)
    eng, tps = results["engine"], results["tokens_per_s"]
    head = [f"trained {_num(L, '.2f')}"] + ([f"untrained {_num(L0, '.2f')}"] if L0 is not None else []) + (
        [f"training-time estimate {_num(exp.get('value'), '.2f')}"] if exp.get("value") is not None else [])
    per = " ".join(_num(a, ".2f") for a in results["acceptance_per_position"] or [])
    per0 = " ".join(_num(a, ".2f") for a in results["untrained_acceptance_per_position"] or [])
    lines = [
        f"served    {eng['name']} {eng['version']} ({eng['platform']}), target in "
        f"{(results.get('settings') or {}).get('dtype', 'n/a')}, K = {K}, "
        f"{'greedy' if t == 0 else f'T = {t:g}'}, {results['prompts']['count']} held-out prompts",
        "  acceptance length   " + "  |  ".join(head),
        f"  per draft position  trained {per}" + (f"  |  untrained {per0}" if per0 else ""),
        *_acceptance_rows(results),
    ]
    problems = results.get("timing_problems") or []
    if problems:  # results.json of earlier versions kept the figures beside the problems: not shown
        lines.append(f"  tokens/s            {NO_VERDICT}: " + "; ".join(problems)
                     + " (other load on the machine?); rerun 06 with --force on an idle machine")
    elif tps.get("plain") is not None and tps.get("speculative") is not None:
        lines.append(f"  tokens/s            plain {readable.num(tps['plain'])}  |  with drafter "
                     f"{readable.num(tps['speculative'])}  |  speedup {speed_phrase(results)}"
                     + (f" ({results['timing']['prompts']} prompts timed single stream)"
                        if (results.get("timing") or {}).get("prompts") else ""))
    if results.get("break_even_acceptance_length") is not None and not problems:
        lo_hi = results.get("break_even_ci95") or [None, None]
        be = readable.with_range(results["break_even_acceptance_length"], *lo_hi)
        lines.append(f"  break-even          L* = {be}"
                     f" (a speculative step costs that many plain steps on this machine)")
    teacher = (results.get("teacher") or {}).get("greedy_equals_dataset_answer")
    if teacher is not None:
        lines.append(f"  teacher check       {_pct(teacher)} of the target's greedy answers repeat the dataset's "
                     f"word for word (the drafter learns the target, not the dataset)")
    return lines


def verdict_lines(results: dict) -> list[str]:
    """The run judged by what it measured, one line per comparison it can make: trained
    against untrained, served against the training-time estimate, measured acceptance
    against the measured break-even (with the speedup)."""
    L, L0 = results["acceptance_length"], results["untrained_acceptance_length"]
    ci = results.get("acceptance_length_ci95")
    est = (results.get("expected_accept_length_training") or {}).get("value")
    be = results.get("break_even_acceptance_length")
    out = []
    if L is None:
        return ["verdict   the drafter's acceptance was not measured (see stage 06's log)"]
    served = f"{L:.2f}" + (f" ±{ci:.2f}" if ci is not None else "")
    if L0 is not None:
        if L > L0 + (ci or 0.0):
            out.append(f"trained beats untrained: {served} vs {L0:.2f} tokens per step; the drafter learned "
                       f"what the target writes")
        else:
            out.append(f"trained does NOT beat untrained: {served} vs {L0:.2f} tokens per step; the target "
                       f"accepts nothing the drafter learned (check the training curve and the layers stage 06 "
                       f"logs as served)")
    if est is not None:
        rel = (L - est) / est
        where = ("agrees with it (within the 95% interval)" if ci is not None and abs(L - est) <= ci else
                 f"{abs(rel) * 100:.1f}% {'above' if rel > 0 else 'below'} it")
        out.append(f"served {served} vs the training-time estimate {est:.2f}: {where}")
    if results.get("timing_problems"):
        out.append(f"speed and break-even: {NO_VERDICT} (see tokens/s above)")
    elif be is not None:
        # With intervals (stage 06 since the paired speed intervals), beats_break_even is None
        # when they overlap: a verdict that noise could flip is not given.
        pays = results.get("beats_break_even", L > be)
        lo_hi = results.get("break_even_ci95") or [None, None]
        sp = results.get("speedup")
        verb = {True: ">", False: "<=", None: "vs"}[pays]
        what = {True: "drafting pays off on this machine", False: "drafting does NOT pay off on this machine",
                None: "no difference shown (the 95% intervals overlap; time more prompts with "
                      "--timing-prompts, on an idle machine)"}[pays]
        out.append(f"measured L {readable.with_interval(L, ci)} {verb} break-even L* "
                   f"{readable.with_range(be, lo_hi[0], lo_hi[1])}: {what}"
                   + (f"; speedup {speed_phrase(results)} single stream" if sp is not None else ""))
    return [("verdict   " if i == 0 else "          ") + line for i, line in enumerate(out)]


def summary_text(work_dir: Path | str, elapsed_s: float | None = None,
                 stage_times: list[tuple[str, float]] | None = None) -> str:
    workdir = WorkDir(work_dir)
    need = "the demo summary"
    ev = read_record(workdir, "evaluate", needed_by=need)
    results = json.loads(workdir.evaluate_results().read_text())
    K = results["num_speculative_tokens"]
    lines = ["", f"== EAGLE-3 pipeline summary ({workdir.root}) ==",
             *pipeline_lines(workdir, K, need),
             *served_lines(results), *verdict_lines(results)]
    if elapsed_s is not None:
        lines.append(f"wall time {_mmss(elapsed_s)} for the whole run (target build to stage 06)")
    if stage_times:
        lines.append("  per stage  " + "  ".join(f"{name} {_mmss(sec)}" for name, sec in stage_times))
    card = Path(ev.drafter_dir) / CARD_NAME
    lines += [f"files     {workdir.evaluate_results()}, {workdir.evaluate_plot()}, "
              f"drafter {ev.drafter_dir}"
              + (f" (model card {card}: publish with `hf upload`)" if card.is_file() else ""),
              ""]
    return "\n".join(lines)


def _acceptance_rows(results: dict) -> list[str]:
    """One line per served temperature (greedy and sampled side by side), then per category."""
    def fmt(block):
        if not block or block.get("acceptance_length") is None:
            return "n/a"
        return readable.with_interval(block["acceptance_length"], block.get("ci95"))

    rows = results.get("acceptance") or []
    lines = []
    for row in rows:
        t = row["temperature"]
        per = " ".join(_num(a, ".2f") for a in (row["trained"].get("acceptance_per_position") or []))
        lines.append(f"  {'greedy' if t == 0 else f'T = {t:g}':>18}  trained {fmt(row['trained'])} (per position "
                     f"{per})  |  untrained {fmt(row.get('untrained'))}")
    names = (results.get("categories") or {}).get("names") or []
    if names and rows:
        head = " | ".join("greedy" if r["temperature"] == 0 else f"T={r['temperature']:g}" for r in rows)
        lines.append(f"  by {results['categories']['field']} ({head}): " + ";  ".join(
            f"{n} " + " | ".join(fmt((r["trained"].get("by_category") or {}).get(n)) for r in rows) for n in names))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print the demo's summary of a finished pipeline run.")
    p.add_argument("--config", help="YAML in configs/ (its work_dir is summarised)")
    p.add_argument("--work-dir", help="work directory (overrides the config's)")
    p.add_argument("--elapsed-s", type=float, help="wall time of the run, printed as is")
    p.add_argument("--stage-times", help="file of `name seconds` lines (scripts/demo.sh writes it)")
    a = p.parse_args(argv)
    work = a.work_dir or (load_yaml(a.config).get("work_dir") if a.config else None)
    if not work:
        p.error("pass --config or --work-dir")
    try:
        text = summary_text(work, a.elapsed_s, read_stage_times(a.stage_times))
    except PipelineError as e:
        sys.stderr.write(f"demo summary: {e}\n")
        return 2
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
