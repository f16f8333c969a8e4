"""Stage 06's report: results.json's layout (`summarise`), the report lines and the plot.

`summarise` gathers every run's figures (eagle3/stages/s06_evaluate/figures.py) into the dict
written as WORK/06_evaluate/results.json; its keys of earlier versions are kept
(eagle3/demo/summary.py reads them). `report_lines` is what the stage logs; `write_plot`
draws evaluate.png. Pure functions, except `write_plot`'s one file.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.artifacts.atomic import atomic_path
from eagle3.artifacts.workdir import WorkDir
from eagle3.core import readable
from eagle3.stages.s06_evaluate.figures import (MAX_PASS_DISAGREEMENT, _spread, break_even_interval,
                                                break_even_verdict, pass_ratios, paired_speedups, speed_verdict,
                                                speedup_interval, timing_problems)

# What the report, the model card and the demo summary say instead of a speed figure when the
# interleaved timing passes disagree (figures.py, `timing_problems`).
NO_VERDICT = "timings unreliable: no verdict"

# How each headline figure is computed, written into results.json beside the figures.
FORMULAS = {
    "acceptance_length": "1 + accepted_tokens / drafts (vLLM's spec_decode counters), all prompts at once",
    "acceptance_length_ci95": "1.96 x delta-method standard error of sum(accepted_i) / sum(drafts_i) over "
                              "prompts (vLLM's per-request acceptance histograms)",
    "acceptance_per_position": "accepted_per_position[k] / drafts (served counterpart of full_acc_k)",
    "break_even_acceptance_length": "c_s / c_t; c_t = plain decode seconds per token, c_s = speculative "
                                    "decode seconds per verification step (prefill excluded), both single "
                                    "stream on the timing subset, summed over the interleaved passes",
    "expected_accept_length_training": "1 + sum_{k<K} full_acc_k of stage 04's held-out eval",
    "speedup": "speculative tokens/s / plain tokens/s, single stream, end to end (prefill included), summed "
               "over the interleaved passes (each prompt served on both engines back to back)",
    "speedup_ci95": "speedup x exp(+-1.96 se), se of log((sum tokens_s / sum wall_s) / (sum tokens_p / sum "
                    "wall_p)) by the delta method, paired over the timed prompts",
    "break_even_ci95": "L* x exp(+-1.96 se), se of log((sum decode_s_s / sum steps_s) / (sum decode_s_p / sum "
                       "decode_tokens_p)) by the delta method, paired over the timed prompts",
    "timing_problems": f"the interleaved passes' speedups or L* differ by more than {MAX_PASS_DISAGREEMENT:g}x "
                       f"(largest / smallest), or one pass only: then no tokens/s, speedup, L* or verdict "
                       f"({NO_VERDICT!r})",
    "speedup_verdict": "faster / slower when speedup_ci95 excludes 1.0, else no difference shown",
    "beats_break_even": "true / false when L +- its interval and L* +- its interval do not overlap, null when "
                        "they do (no difference shown) or a figure is missing",
}


# --------------------------------------------------------------------------- results.json

def _ratio(a, b):
    return a / b if a and b else None


def _by_temperature(trained: dict, untrained: dict | None, temperatures: list[float]) -> list[dict[str, Any]]:
    """One row per temperature: the trained drafter's acceptance and the untrained one's (the
    floor is served at the first temperature only)."""
    rows = []
    u = (untrained or {}).get("acceptance") or []
    for i, t in enumerate(temperatures):
        rows.append({"temperature": t, "trained": trained["acceptance"][i], "untrained": u[i] if i < len(u) else None})
    return rows


def _timing_summary(tp: dict | None, ts: dict | None, settings: dict, reliable: bool) -> dict[str, Any]:
    """The single-stream subset: how many prompts and passes, its acceptance, each pass's speedup
    and L* (what the passes' agreement compares) and, when the timings are reliable, the
    per-prompt spreads."""
    tp, ts = tp or {}, ts or {}
    per_pass = pass_ratios(tp, ts)
    return {
        "prompts": (tp or ts).get("requests", 0), "max_num_seqs": 1, "temperature": 0.0,
        "indices": settings.get("timing_indices"), "passes": len((tp or ts).get("passes") or []),
        "order": settings.get("timing_order"),  # pairs or passes (eagle3/stages/s06_evaluate/timing.py)
        "acceptance_length": ts.get("acceptance_length"),
        "pass_speedups": per_pass["speedup"], "pass_break_evens": per_pass["break_even"],
        "max_pass_disagreement": MAX_PASS_DISAGREEMENT,
        "speedup_per_prompt": _spread(paired_speedups(tp, ts) or []) if reliable else None,
        "tokens_per_s_per_prompt": ({"plain": _spread(tp.get("request_tokens_per_s") or []),
                                     "speculative": _spread(ts.get("request_tokens_per_s") or [])}
                                    if reliable else None),
    }


def _batched_throughput(plain: dict, trained: dict, temperatures: list[float], settings: dict) -> dict[str, Any]:
    """End-to-end tokens/s of the greedy acceptance passes (many sequences at once)."""
    greedy = next((i for i, t in enumerate(temperatures) if t == 0), None)
    plain_batched = (plain.get("acceptance") or [None])[0]
    spec_batched = trained["acceptance"][greedy] if greedy is not None else None
    return {"max_num_seqs": settings.get("max_num_seqs"),
            "tokens_per_s": {
                "plain": _ratio(plain_batched["tokens"], plain_batched["wall_s"]) if plain_batched else None,
                "speculative": _ratio(spec_batched["tokens"], spec_batched["wall_s"]) if spec_batched else None}}


def summarise(runs: dict[str, dict], K: int, temperatures: list[float], expectation: dict, prompts: dict,
              settings: dict, engine: dict, teacher: dict) -> dict[str, Any]:
    """results.json: every figure, the keys of earlier versions kept (eagle3/demo/summary.py reads them).

    `runs[name]` holds `acceptance` (list of `acceptance_figures`, one per temperature;
    the plain run: its greedy pass), `timing` (`timing_figures` or None), `init_s` and,
    for drafter runs, `outputs_match_plain` (figures.py, `run_figures`)."""
    plain, trained = runs.get("plain") or {}, runs["trained"]
    untrained = runs.get("untrained")
    problems = timing_problems(plain.get("timing"), trained.get("timing"))
    timing = _timing_summary(plain.get("timing"), trained.get("timing"), settings, reliable=not problems)
    # Unreliable timings give no speed figure at all: the figures below read nothing.
    tp, ts = ({}, {}) if problems else (plain.get("timing") or {}, trained.get("timing") or {})
    tu = (untrained or {}).get("timing") or {}
    c_t, c_s = tp.get("step_s"), ts.get("step_s")
    break_even = c_s / c_t if c_t and c_s else None
    speedup = _ratio(ts.get("tokens_per_s"), tp.get("tokens_per_s"))
    speedup_ci = speedup_interval(tp, ts, speedup)
    break_even_ci = break_even_interval(tp, ts, break_even)
    by_temp = _by_temperature(trained, untrained, temperatures)
    # The headline figures are at the first temperature (greedy by default).
    primary, primary_u = by_temp[0]["trained"], by_temp[0]["untrained"] or {}
    by_category = primary.get("by_category") or {}
    L = primary.get("acceptance_length")
    return {
        "engine": engine,
        "settings": settings,
        "prompts": prompts,
        "num_speculative_tokens": K,
        "temperatures": temperatures,
        "acceptance_temperature": temperatures[0],
        "acceptance_length": L,
        "acceptance_length_ci95": primary.get("ci95"),
        "acceptance_per_position": primary.get("acceptance_per_position"),
        "untrained_acceptance_length": primary_u.get("acceptance_length"),
        "untrained_acceptance_per_position": primary_u.get("acceptance_per_position"),
        "acceptance": by_temp,
        "categories": {"field": prompts.get("category_field"), "names": list(by_category),
                       "prompts": {n: b["prompts"] for n, b in by_category.items()}},
        "expected_accept_length_training": expectation,
        "tokens_per_s": {"plain": tp.get("tokens_per_s"), "speculative": ts.get("tokens_per_s"),
                         "untrained": tu.get("tokens_per_s")},
        "decode_tokens_per_s": {"plain": tp.get("decode_tokens_per_s"), "speculative": ts.get("decode_tokens_per_s")},
        "speedup": speedup,
        "speedup_ci95": speedup_ci,
        "speedup_verdict": speed_verdict(speedup_ci, speedup),
        "decode_speedup": _ratio(ts.get("decode_tokens_per_s"), tp.get("decode_tokens_per_s")),
        "timing": timing,
        "batched": _batched_throughput(plain, trained, temperatures, settings),
        "step_cost_s": {"plain_decode_step": c_t, "speculative_step": c_s,
                        "untrained_speculative_step": tu.get("step_s")},
        "break_even_acceptance_length": break_even,
        "break_even_ci95": break_even_ci,
        "beats_break_even": break_even_verdict(L, primary.get("ci95"), break_even, break_even_ci),
        "timing_problems": problems,
        "outputs_match_plain": trained.get("outputs_match_plain"),
        "teacher": teacher,
        "runs": runs,
        "formulas": dict(FORMULAS),
    }


# --------------------------------------------------------------------------- the report

def _fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _ms(v):
    return None if v is None else 1000 * v


def _pm(block: dict | None) -> str:
    """`2.41 ±0.06` (the 95% interval over prompts, rounded to its precision), or just the value."""
    if not block:
        return "n/a"
    return readable.with_interval(block.get("acceptance_length"), block.get("ci95"))


def _temp(t: float) -> str:
    return "greedy" if t == 0 else f"T={t:g}"


def _per_position(values) -> str:
    """Shares in [0, 1]: two decimals each (a percent point is what a 60-prompt run resolves)."""
    return " ".join(_fmt(a) for a in (values or []))


def speed_phrase(results: dict) -> str:
    """"1.07x [0.96, 1.19]: no difference shown" (the speedup, its paired 95% interval, the verdict)."""
    sp, ci = results.get("speedup"), results.get("speedup_ci95") or [None, None]
    verdict = results.get("speedup_verdict")
    text = readable.with_range(sp, ci[0], ci[1], unit="x")
    # results.json of earlier versions has no interval key at all: nothing to say about it then.
    missing = "speedup_ci95" in results and results["speedup_ci95"] is None and sp is not None
    return text + (f": {verdict}" if verdict else "") + (" (no interval: fewer than 2 timed prompts)" if missing
                                                         else "")


def break_even_phrase(results: dict) -> str:
    """"1.39 [1.31, 1.48]: the drafter beats it" (L*, its paired interval, the comparison with L)."""
    be, ci = results.get("break_even_acceptance_length"), results.get("break_even_ci95") or [None, None]
    verdict = {True: "the drafter beats it", False: "the drafter does NOT beat it",
               None: "no difference shown" if be is not None and results.get("acceptance_length") is not None
               else "n/a"}[results.get("beats_break_even")]
    return f"{readable.with_range(be, ci[0], ci[1])}: {verdict}"


def _timed(timing: dict, n) -> str:
    """"16 of 77 prompts in 2 interleaved passes" (results.json of earlier versions: no passes)."""
    passes = timing.get("passes")
    return f"{timing['prompts']} of {n} prompts" + (f" in {passes} interleaved passes" if passes else "")


def report_lines(results: dict) -> list[str]:
    K = results["num_speculative_tokens"]
    exp = results["expected_accept_length_training"]
    tps = results["tokens_per_s"]
    n = (results.get("prompts") or {}).get("count")
    ci = results.get("acceptance_length_ci95")
    # A figure this run has no source for (no training here, no baseline served) leaves its part out.
    lines = [
        f"acceptance length (K={K}): {readable.with_interval(results['acceptance_length'], ci)}"
        + f" ({_temp(results.get('acceptance_temperature', 0.0))}, {n} prompts) measured in {results['engine']['name']} "
        f"{results['engine']['version']} ({results['engine']['platform']})"
        + (f", training-time expected {readable.num(exp['value'])} (1 + sum of full_acc_k, k<{exp.get('k')})"
           if exp.get("value") is not None else f"; no training-time estimate ({exp.get('source')})"),
        f"acceptance per position: measured {_per_position(results['acceptance_per_position'])}"
        + (f" | training full_acc {_per_position(exp.get('full_acc'))}" if exp.get("full_acc") else ""),
    ]
    if results["untrained_acceptance_length"] is not None:
        lines.append(f"untrained drafter: acceptance length {readable.num(results['untrained_acceptance_length'])}")
    for row in results.get("acceptance") or []:
        t, u = row["trained"], row.get("untrained")
        lines.append(f"  {_temp(row['temperature']):>7}: trained {_pm(t)} per position "
                     f"{_per_position(t.get('acceptance_per_position'))}"
                     + (f" | untrained {_pm(u)}" if u else ""))
    cats = (results.get("categories") or {}).get("names") or []
    if cats:
        head = " | ".join(_temp(row["temperature"]) for row in results["acceptance"])
        lines.append(f"acceptance length by {results['categories']['field']} ({head}):")
        for name in cats:
            vals = " | ".join(_pm(row["trained"]["by_category"].get(name)) for row in results["acceptance"])
            lines.append(f"  {name} (n={results['categories']['prompts'][name]}): {vals}")
    timing = results.get("timing") or {}
    problems = results.get("timing_problems") or []
    if timing.get("prompts") and problems:
        lines.append(f"tokens/s, speedup and break-even (single stream, {_timed(timing, n)}, greedy): {NO_VERDICT}")
    elif timing.get("prompts"):
        sp = timing.get("speedup_per_prompt") or {}
        lines += [
            f"tokens/s (single stream, {_timed(timing, n)}, greedy): plain "
            f"{readable.num(tps['plain'])}, "
            f"with drafter {readable.num(tps['speculative'])} -> speedup {speed_phrase(results)} "
            f"(per prompt {readable.num(sp.get('min'))}-{readable.num(sp.get('max'))}x, decode only "
            f"{readable.num(results['decode_speedup'])}x; acceptance length on these prompts "
            f"{readable.num(timing.get('acceptance_length'))})",
            f"break-even acceptance length {break_even_phrase(results)} (speculative step "
            f"{readable.num(_ms(results['step_cost_s']['speculative_step']))} ms / plain step "
            f"{readable.num(_ms(results['step_cost_s']['plain_decode_step']))} ms; measured L "
            f"{readable.with_interval(results['acceptance_length'], ci)})",
        ]
    else:
        lines.append("tokens/s, speedup and break-even: not measured (--timing-prompts 0)")
    for problem in problems:
        lines.append(f"UNRELIABLE TIMINGS: {problem}; other load on the machine? Rerun `python "
                     f"{WorkDir.script('evaluate')} --force` on an idle machine (acceptance figures are unaffected).")
    if results.get("outputs_match_plain") is not None and results["outputs_match_plain"] < 1.0:
        lines.append(f"note: {readable.pct(results['outputs_match_plain'], 2)} of greedy speculative outputs equal plain "
                     f"greedy ones (greedy verification is exact up to {results['settings']['dtype']} rounding of batched "
                     f"verify)")
    return lines


# --------------------------------------------------------------------------- the model card's table

def hardware(engine: dict, settings: dict) -> str:
    """What the engine ran on: the GPU model (vLLM's name for it) x tensor parallel, or this
    CPU's model name and the cores this process may use."""
    tp = settings.get("tensor_parallel_size") or 1
    if engine.get("platform") != "cpu":
        return f"{tp} x {engine.get('platform')}"
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {name}, {len(os.sched_getaffinity(0))} cores"


def card_table(results: dict, when: str) -> str:
    """Stage 06's section of the model card (Markdown): acceptance per temperature, position and
    category with 95% intervals, the untrained floor, speed and break-even with their intervals,
    the engine and the hardware. `when`: the date of the measurement."""
    K = results["num_speculative_tokens"]
    rows = results.get("acceptance") or []
    eng, settings = results["engine"], results.get("settings") or {}
    prompts = results.get("prompts") or {}
    heads = [_temp(row["temperature"]) for row in rows]
    out = [f"Measured by `{WorkDir.script('evaluate')}` on {when}: vLLM {eng.get('version')} on "
           f"{hardware(eng, settings)}, K = {K} speculative tokens, {prompts.get('count')} prompts "
           f"(`{prompts.get('source')}`), up to {settings.get('max_new_tokens')} new tokens each. Intervals are "
           f"95% over prompts.", "",
           "| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    out.append("| acceptance length | " + " | ".join(_pm(row["trained"]) for row in rows) + " |")
    for k in range(K):
        out.append(f"| accepted through position {k} | "
                   + " | ".join(_fmt((row["trained"].get("acceptance_per_position") or [None] * K)[k])
                                for row in rows) + " |")
    if rows and rows[0].get("untrained"):
        out.append("| untrained drafter (the floor) | " + " | ".join(
            _pm(row.get("untrained")) if row.get("untrained") else "-" for row in rows) + " |")
    cats = (results.get("categories") or {}).get("names") or []
    for name in cats:
        out.append(f"| {results['categories']['field']}: {name} (n={results['categories']['prompts'][name]}) | "
                   + " | ".join(_pm(row["trained"]["by_category"].get(name)) for row in rows) + " |")
    exp = results.get("expected_accept_length_training") or {}
    out.append("")
    if exp.get("value") is not None:
        out.append(f"Training-time estimate for K = {exp.get('k')}: {readable.num(exp['value'])}.")
    timing = results.get("timing") or {}
    tps = results.get("tokens_per_s") or {}
    problems = results.get("timing_problems") or []
    passes = f" in {timing['passes']} interleaved passes" if timing.get("passes") else ""
    if timing.get("prompts") and problems:
        out.append(f"Speed, single stream, greedy, {timing['prompts']} prompts timed{passes}: {NO_VERDICT} ("
                   + "; ".join(problems) + "). No speedup or break-even is given; the acceptance figures above "
                   "are unaffected.")
    elif timing.get("prompts"):
        out += [f"Speed, single stream, greedy, {timing['prompts']} prompts timed{passes}: "
                f"{readable.num(tps.get('plain'))} tokens/s without the drafter, "
                f"{readable.num(tps.get('speculative'))} with it; speedup {speed_phrase(results)}.",
                f"Break-even acceptance length L* (a speculative step's cost in plain steps, decode only): "
                f"{break_even_phrase(results)}. Timings hold for this hardware and these engine settings only."]
    else:
        out.append("Speed: not measured (--timing-prompts 0).")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- plot

def _plot_positions(a, results: dict) -> None:
    """Acceptance per draft position: trained at each temperature, untrained, training full_acc_k."""
    K = results["num_speculative_tokens"]
    rows = results.get("acceptance") or []
    x = np.arange(K)
    bars = [(f"trained {_temp(row['temperature'])} (L={_fmt(row['trained'].get('acceptance_length'))})",
             row["trained"].get("acceptance_per_position") or [0.0] * K) for row in rows]
    if rows and rows[0].get("untrained"):
        u = rows[0]["untrained"]
        bars.append((f"untrained {_temp(rows[0]['temperature'])} (L={_fmt(u.get('acceptance_length'))})",
                     u.get("acceptance_per_position") or [0.0] * K))
    w = 0.8 / max(1, len(bars))
    for i, (label, vals) in enumerate(bars):
        a.bar(x - 0.4 + w * (i + 0.5), vals, w, label=label,
              color="tab:gray" if label.startswith("untrained") else None)
    exp = results["expected_accept_length_training"].get("full_acc")
    if exp:
        a.plot(np.arange(len(exp)), exp, "o--", color="black", label="training full_acc_k (held-out)")
    a.set_xticks(x, [str(k) for k in x])
    a.set_xlabel("draft position k")
    a.set_ylabel("share of drafts accepted through k")
    a.set_ylim(0, 1)
    a.set_title(f"served acceptance, K={K}")
    a.legend(fontsize=7)


def _plot_categories(c, results: dict, cats: list[str]) -> None:
    """Acceptance length per category and temperature, with the 95% interval over prompts."""
    K = results["num_speculative_tokens"]
    rows = results.get("acceptance") or []
    y = np.arange(len(cats))
    h = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        vals = [(row["trained"]["by_category"].get(n) or {}).get("acceptance_length") or 0.0 for n in cats]
        err = [(row["trained"]["by_category"].get(n) or {}).get("ci95") or 0.0 for n in cats]
        c.barh(y - 0.4 + h * (i + 0.5), vals, h, xerr=err, label=_temp(row["temperature"]))
    c.set_yticks(y, cats, fontsize=7)
    c.set_xlabel(f"acceptance length (K={K}; bars: 95% interval over prompts)")
    c.set_xlim(1, K + 1)
    c.set_title(f"by {results['categories']['field']}")
    c.legend(fontsize=7)


def _plot_training(b, curve: list[dict], ttt_steps: int, colors: list[str]) -> None:
    """full_acc_k (k < ttt_steps) over stage 04's steps: held-out evals as markers, train windows
    as faint lines."""
    evals = [m for m in curve if m.get("split") == "eval"]
    trains = [m for m in curve if m.get("split") == "train"]
    n_steps = ttt_steps if curve else 0
    for k in range(n_steps):
        col = colors[k % len(colors)]
        if trains:
            b.plot([m["step"] for m in trains], [m[f"full_acc_{k}"] for m in trains], "-", color=col, alpha=0.35)
        if evals:
            b.plot([m["step"] for m in evals], [m[f"full_acc_{k}"] for m in evals], "o-", color=col, ms=3,
                   label=f"full_acc_{k}")
    b.set_xlabel("stage 04 step")
    b.set_ylabel("full_acc_k (held-out: markers)")
    b.set_ylim(0, 1)
    b.set_title("training curves")
    if n_steps:
        b.legend(fontsize=7, ncol=2)
    else:
        b.text(0.5, 0.5, "no stage 04 metrics", ha="center", va="center", transform=b.transAxes)


def write_plot(path: Path, results: dict, curve: list[dict], ttt_steps: int) -> None:
    """Left: acceptance per draft position (trained at each temperature, untrained, training
    full_acc_k). Middle (with categories): acceptance length per category and temperature.
    Right: full_acc_k over stage 04's steps (held-out evals as markers, train windows as lines);
    `curve`: stage 04's metrics.jsonl rows, `ttt_steps`: stage 04's record's."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt


    cats = (results.get("categories") or {}).get("names") or []
    fig, axes = plt.subplots(1, 3 if cats else 2, figsize=(15 if cats else 10, 3.8))
    _plot_positions(axes[0], results)
    if cats:
        _plot_categories(axes[1], results, cats)
    _plot_training(axes[-1], curve, ttt_steps, plt.rcParams["axes.prop_cycle"].by_key()["color"])
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
