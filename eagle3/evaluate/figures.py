"""Stage 06's figures: pure functions from engine results (plain dicts) to what is reported.

No engine, no disk (except `write_plot`'s one file): the tests feed these fabricated
engine results. The engine side (eagle3/evaluate.py, `serve_and_measure`) returns,
per engine run:

    acceptance  one pass per sampling temperature over ALL prompts, many sequences at once:
                output tokens, vLLM's spec-decode counters for the pass, and (vLLM >= 0.32)
                each request's histogram of accepted draft tokens per verification step
                (`hist[j]` = steps that accepted j drafts), or, from an older vLLM, the
                counters of one pass per category
    timing      greedy passes over a subset, one request at a time (single stream):
                per request wall seconds, engine timestamps of its first and last token,
                tokens, and the pass's counters

Definitions (docs/CONVENTIONS.md, section 5, for the training-time side):
    acceptance length     L = 1 + accepted draft tokens / verification steps
    per position k        share of verification steps that accepted drafts 0..k
                          (chain drafting: the served counterpart of full_acc_k)
    95% interval of L     over prompts: L is a ratio of sums, sum a_i / sum d_i + 1, and
                          its standard error by the delta method is
                          sqrt(sum (a_i - R d_i)^2 / (n (n - 1))) / mean(d), R = sum a / sum d
    c_t                   plain decode seconds per token (first token excluded: prefill)
    c_s                   speculative decode seconds per verification step
    break-even L*         c_s / c_t: drafting pays off iff L > L*; decode speedup ~ L / L*
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

# Timing sanity limits. The passes of one run serve identical work; a trained and an
# untrained drafter of one shape do identical work per speculative step; the requests
# of one single-stream pass differ only in context length, which moves a decode step's
# cost by far less than this. A larger spread means something else used the machine.
MAX_PASS_SPREAD = 1.3
MAX_STEP_COST_RATIO = 1.5
MAX_REQUEST_STEP_SPREAD = 1.6
STAGE_SCRIPT = "06_evaluate_drafter.py"


# --------------------------------------------------------------------------- acceptance

def counter_diff(after: dict, before: dict) -> dict:
    """Counters of one pass: `after - before`, per-position vectors element-wise."""
    out = {}
    for name, v in after.items():
        b = before.get(name)
        if isinstance(v, list):
            out[name] = [x - y for x, y in zip(v, b)] if b else list(v)
        else:
            out[name] = v - (b or 0)
    return out


def histogram_counts(hist: list[int], K: int) -> tuple[int, int, list[int]]:
    """(verification steps, accepted draft tokens, accepted at each position) of one request.

    `hist[j]` counts the steps that accepted exactly j drafts; chain drafting accepts
    position k exactly when j > k."""
    h = list(hist) + [0] * (K + 1 - len(hist))
    steps = sum(h)
    accepted = sum(j * c for j, c in enumerate(h))
    per_pos = [sum(h[k + 1:]) for k in range(K)]
    return steps, accepted, per_pos


def ratio_interval(accepted: list[int], steps: list[int]) -> float | None:
    """Half-width of the 95% interval of 1 + sum(accepted) / sum(steps) over prompts
    (delta method for a ratio of sums; None below 2 prompts with steps)."""
    a = np.asarray(accepted, dtype=np.float64)
    d = np.asarray(steps, dtype=np.float64)
    keep = d > 0
    a, d = a[keep], d[keep]
    n = len(d)
    if n < 2:
        return None
    r = a.sum() / d.sum()
    se = math.sqrt(float(((a - r * d) ** 2).sum()) / (n * (n - 1))) / float(d.mean())
    return 1.96 * se


def acceptance_block(steps: int, accepted: int, per_pos: list[int], K: int) -> dict[str, Any]:
    """L and per-position acceptance from summed counts."""
    per_pos = (list(per_pos) + [0] * K)[:K]
    return {"drafts": steps, "accepted_tokens": accepted,
            "acceptance_length": 1.0 + accepted / steps if steps else None,
            "acceptance_per_position": [a / steps for a in per_pos] if steps else None}


def acceptance_figures(p: dict, K: int, prompt_categories: list[str | None]) -> dict[str, Any]:
    """One acceptance pass of a speculative run: overall (from the engine's counters), the
    95% interval over prompts and per category (from per-request histograms, else from
    per-category counters)."""
    c = p["counters"]
    out = acceptance_block(int(c.get(DRAFTS, 0)), int(c.get(ACCEPTED, 0)),
                           [int(x) for x in (c.get(ACCEPTED_PER_POS) or [0] * K)], K)
    out.update({"temperature": p["temperature"], "tokens": sum(len(t) for t in p["tokens"]),
                "wall_s": p["wall_s"], "ci95": None, "by_category": {}})
    hists = p.get("histograms")
    names = [c for c in dict.fromkeys(prompt_categories) if c is not None]
    if hists is not None:
        counts = [histogram_counts(h, K) for h in hists]
        out["ci95"] = ratio_interval([a for _, a, _ in counts], [s for s, _, _ in counts])
        # The per-request histograms and the engine's counters count the same steps.
        out["histograms_match_counters"] = sum(s for s, _, _ in counts) == out["drafts"]
        for name in names:
            sel = [cnt for cnt, cat in zip(counts, prompt_categories) if cat == name]
            block = acceptance_block(sum(s for s, _, _ in sel), sum(a for _, a, _ in sel),
                                     [sum(pp[k] for _, _, pp in sel) for k in range(K)], K)
            block["prompts"] = len(sel)
            block["ci95"] = ratio_interval([a for _, a, _ in sel], [s for s, _, _ in sel])
            out["by_category"][name] = block
    elif p.get("group_counters") is not None:
        for name, gc in zip(names, p["group_counters"]):
            block = acceptance_block(int(gc.get(DRAFTS, 0)), int(gc.get(ACCEPTED, 0)),
                                     [int(x) for x in (gc.get(ACCEPTED_PER_POS) or [0] * K)], K)
            block["prompts"] = sum(cat == name for cat in prompt_categories)
            block["ci95"] = None
            out["by_category"][name] = block
    return out


def outputs_match(tokens: list[list[int]], reference: list[list[int]]) -> float | None:
    """Share of requests whose output equals the reference's token for token."""
    same = [t == r for t, r in zip(tokens, reference)]
    return sum(same) / len(same) if same else None


# --------------------------------------------------------------------------- single-stream timing

def _spread(values: list[float]) -> dict[str, float] | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"min": float(min(v)), "median": float(np.median(v)), "max": float(max(v))}


def timing_pass(p: dict, K: int, speculative: bool) -> dict[str, Any]:
    """Tokens/s and decode step cost of one single-stream pass (one request at a time)."""
    tokens = [len(t) for t in p["tokens"]]
    ts = p["token_ts"]
    complete = all(a is not None and b is not None for a, b in ts)
    decode = [b - a for a, b in ts] if complete else None
    decode_tokens = sum(max(0, n - 1) for n in tokens)  # the first token comes from prefill
    decode_s = sum(decode) if decode else None
    c = p.get("counters") or {}
    out: dict[str, Any] = {
        "requests": len(tokens), "tokens": sum(tokens), "wall_s": p["wall_s"],
        "tokens_per_s": sum(tokens) / p["wall_s"] if p["wall_s"] > 0 else None,
        "decode_tokens": decode_tokens, "decode_s": decode_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s else None,
        "request_tokens_per_s": [n / w if w > 0 else None for n, w in zip(tokens, p["request_wall_s"])],
    }
    if speculative:
        steps = int(c.get(DRAFTS, 0))
        out.update(acceptance_block(steps, int(c.get(ACCEPTED, 0)),
                                    [int(x) for x in (c.get(ACCEPTED_PER_POS) or [0] * K)], K))
        out["step_s"] = decode_s / steps if decode_s and steps else None
        hists = p.get("histograms")
        req_steps = [histogram_counts(h, K)[0] for h in hists] if hists is not None else None
    else:
        out["step_s"] = decode_s / decode_tokens if decode_s and decode_tokens else None
        req_steps = [max(0, n - 1) for n in tokens]
    out["request_step_s"] = ([d / s if s else None for d, s in zip(decode, req_steps)]
                             if decode and req_steps is not None else None)
    return out


def timing_figures(passes: list[dict], K: int, speculative: bool) -> dict[str, Any] | None:
    """The fastest pass's figures (other load only slows a pass down) and all passes' walls."""
    if not passes:
        return None
    figs = [timing_pass(p, K, speculative) for p in passes]
    best = min(figs, key=lambda f: f["wall_s"])
    return {**best, "pass_wall_s": [f["wall_s"] for f in figs]}


def request_step_spread(step_s: list[float | None] | None) -> float | None:
    """Largest per-request decode step cost over the median one (1.0 = perfectly even)."""
    v = [x for x in (step_s or []) if x]
    if len(v) < 2:
        return None
    return float(max(v) / np.median(v))


def timing_problems(timings: dict[str, dict | None]) -> list[str]:
    """Reasons to distrust this measurement's timings (acceptance is unaffected)."""
    out = []
    for name, r in timings.items():
        if not r:
            continue
        walls = r.get("pass_wall_s") or []
        if len(walls) > 1 and max(walls) > MAX_PASS_SPREAD * min(walls):
            out.append(f"the {name} run's timed passes took {' / '.join(f'{w:.1f}' for w in walls)} s for the same "
                       f"work")
        spread = request_step_spread(r.get("request_step_s"))
        if spread is not None and spread > MAX_REQUEST_STEP_SPREAD:
            out.append(f"one {name} request's decode steps took {spread:.1f}x the median request's (single "
                       f"stream, same model)")
    a = (timings.get("trained") or {}).get("step_s")
    b = (timings.get("untrained") or {}).get("step_s")
    if a and b and max(a, b) > MAX_STEP_COST_RATIO * min(a, b):
        out.append(f"a speculative step took {1000 * a:.1f} ms with the trained drafter and {1000 * b:.1f} ms with "
                   f"the untrained one, which does the same work")
    return out


def paired_speedups(plain: dict | None, spec: dict | None) -> list[float] | None:
    """Per-prompt end-to-end speedup: the same prompt served with and without the drafter."""
    if not plain or not spec:
        return None
    return [s / p for p, s in zip(plain["request_tokens_per_s"], spec["request_tokens_per_s"]) if p and s]


# --------------------------------------------------------------------------- the summary

def summarise(runs: dict[str, dict], K: int, temperatures: list[float], expectation: dict, prompts: dict,
              settings: dict, engine: dict, teacher: dict) -> dict[str, Any]:
    """results.json: every figure, the keys of earlier versions kept (eagle3/demo.py reads them).

    `runs[name]` holds `acceptance` (list of `acceptance_figures`, one per temperature;
    the plain run: its greedy pass), `timing` (`timing_figures` or None), `init_s` and,
    for drafter runs, `outputs_match_plain`."""
    plain, trained = runs.get("plain") or {}, runs["trained"]
    untrained = runs.get("untrained")
    tp, ts = plain.get("timing"), trained.get("timing")
    c_t, c_s = (tp or {}).get("step_s"), (ts or {}).get("step_s")
    break_even = c_s / c_t if c_t and c_s else None

    def ratio(a, b):
        return a / b if a and b else None

    by_temp = []
    for i, t in enumerate(temperatures):
        row: dict[str, Any] = {"temperature": t, "trained": trained["acceptance"][i]}
        u = (untrained or {}).get("acceptance") or []
        row["untrained"] = u[i] if i < len(u) else None  # the floor is served at the first temperature
        by_temp.append(row)
    primary = by_temp[0]["trained"]
    primary_u = by_temp[0]["untrained"] or {}
    L = primary.get("acceptance_length")
    speedups = paired_speedups(tp, ts)
    greedy = next((i for i, t in enumerate(temperatures) if t == 0), None)
    plain_batched = (plain.get("acceptance") or [None])[0]
    return {
        "engine": engine,
        "settings": settings,
        "prompts": prompts,
        "num_speculative_tokens": K,
        "temperatures": temperatures,
        # The headline figures are at the first temperature (greedy by default).
        "acceptance_temperature": temperatures[0],
        "acceptance_length": L,
        "acceptance_length_ci95": primary.get("ci95"),
        "acceptance_per_position": primary.get("acceptance_per_position"),
        "untrained_acceptance_length": primary_u.get("acceptance_length"),
        "untrained_acceptance_per_position": primary_u.get("acceptance_per_position"),
        "acceptance": by_temp,
        "categories": {"field": prompts.get("category_field"), "names": list(primary.get("by_category") or {}),
                       "prompts": {n: b["prompts"] for n, b in (primary.get("by_category") or {}).items()}},
        "expected_accept_length_training": expectation,
        "tokens_per_s": {"plain": (tp or {}).get("tokens_per_s"), "speculative": (ts or {}).get("tokens_per_s"),
                         "untrained": ((untrained or {}).get("timing") or {}).get("tokens_per_s")},
        "decode_tokens_per_s": {"plain": (tp or {}).get("decode_tokens_per_s"),
                                "speculative": (ts or {}).get("decode_tokens_per_s")},
        "speedup": ratio((ts or {}).get("tokens_per_s"), (tp or {}).get("tokens_per_s")),
        "decode_speedup": ratio((ts or {}).get("decode_tokens_per_s"), (tp or {}).get("decode_tokens_per_s")),
        "timing": {
            "prompts": (tp or ts or {}).get("requests", 0), "max_num_seqs": 1, "temperature": 0.0,
            "indices": settings.get("timing_indices"),
            "acceptance_length": (ts or {}).get("acceptance_length"),
            "speedup_per_prompt": _spread(speedups or []),
            "tokens_per_s_per_prompt": {"plain": _spread((tp or {}).get("request_tokens_per_s") or []),
                                        "speculative": _spread((ts or {}).get("request_tokens_per_s") or [])},
        },
        "batched": {
            "max_num_seqs": settings.get("max_num_seqs"),
            "tokens_per_s": {
                "plain": ratio(plain_batched["tokens"], plain_batched["wall_s"]) if plain_batched else None,
                "speculative": (ratio(trained["acceptance"][greedy]["tokens"], trained["acceptance"][greedy]["wall_s"])
                                if greedy is not None else None)},
        },
        "step_cost_s": {"plain_decode_step": c_t, "speculative_step": c_s,
                        "untrained_speculative_step": ((untrained or {}).get("timing") or {}).get("step_s")},
        "break_even_acceptance_length": break_even,
        "beats_break_even": (L > break_even) if L is not None and break_even is not None else None,
        "timing_problems": timing_problems({n: (r or {}).get("timing") for n, r in runs.items()}),
        "outputs_match_plain": trained.get("outputs_match_plain"),
        "teacher": teacher,
        "runs": runs,
        "formulas": {
            "acceptance_length": "1 + accepted_tokens / drafts (vLLM's spec_decode counters), all prompts at once",
            "acceptance_length_ci95": "1.96 x delta-method standard error of sum(accepted_i) / sum(drafts_i) over "
                                      "prompts (vLLM's per-request acceptance histograms)",
            "acceptance_per_position": "accepted_per_position[k] / drafts (served counterpart of full_acc_k)",
            "break_even_acceptance_length": "c_s / c_t; c_t = plain decode seconds per token, c_s = speculative "
                                            "decode seconds per verification step (prefill excluded), both single "
                                            "stream on the timing subset",
            "expected_accept_length_training": "1 + sum_{k<K} full_acc_k of stage 04's held-out eval",
            "speedup": "speculative tokens/s / plain tokens/s, single stream, end to end (prefill included)",
        },
    }


# --------------------------------------------------------------------------- the report

def _fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _ms(v):
    return None if v is None else 1000 * v


def _pm(block: dict | None, spec: str = ".2f") -> str:
    """`2.41 ±0.06` (the 95% interval over prompts), or just the value."""
    if not block:
        return "n/a"
    ci = block.get("ci95")
    return _fmt(block.get("acceptance_length"), spec) + (f" ±{ci:{spec}}" if ci is not None else "")


def _temp(t: float) -> str:
    return "greedy" if t == 0 else f"T={t:g}"


def report_lines(r: dict) -> list[str]:
    K = r["num_speculative_tokens"]
    exp = r["expected_accept_length_training"]
    per = " ".join(_fmt(a, ".3f") for a in (r["acceptance_per_position"] or []))
    exp_per = " ".join(_fmt(a, ".3f") for a in exp.get("full_acc", []))
    tps = r["tokens_per_s"]
    n = (r.get("prompts") or {}).get("count")
    ci = r.get("acceptance_length_ci95")
    lines = [
        f"acceptance length (K={K}): {_fmt(r['acceptance_length'], '.3f')}"
        + (f" ±{ci:.3f}" if ci is not None else "")
        + f" ({_temp(r.get('acceptance_temperature', 0.0))}, {n} prompts) measured in {r['engine']['name']} "
        f"{r['engine']['version']} ({r['engine']['platform']}), "
        f"training-time expected {_fmt(exp.get('value'), '.3f')} (1 + sum of full_acc_k, k<{exp.get('k')})",
        f"acceptance per position: measured {per} | training full_acc {exp_per or 'n/a'}",
        f"untrained drafter: acceptance length {_fmt(r['untrained_acceptance_length'], '.3f')}",
    ]
    for row in r.get("acceptance") or []:
        t, u = row["trained"], row.get("untrained")
        lines.append(f"  {_temp(row['temperature']):>7}: trained {_pm(t)} per position "
                     f"{' '.join(_fmt(a) for a in (t.get('acceptance_per_position') or []))}"
                     + (f" | untrained {_pm(u)}" if u else ""))
    cats = (r.get("categories") or {}).get("names") or []
    if cats:
        head = " | ".join(_temp(row["temperature"]) for row in r["acceptance"])
        lines.append(f"acceptance length by {r['categories']['field']} ({head}):")
        for name in cats:
            vals = " | ".join(_pm(row["trained"]["by_category"].get(name)) for row in r["acceptance"])
            lines.append(f"  {name} (n={r['categories']['prompts'][name]}): {vals}")
    timing = r.get("timing") or {}
    if timing.get("prompts"):
        sp = timing.get("speedup_per_prompt") or {}
        lines += [
            f"tokens/s (single stream, {timing['prompts']} of {n} prompts, greedy): plain {_fmt(tps['plain'], '.1f')}, "
            f"with drafter {_fmt(tps['speculative'], '.1f')} -> speedup {_fmt(r['speedup'], '.2f')}x "
            f"(per prompt {_fmt(sp.get('min'))}-{_fmt(sp.get('max'))}x, decode only "
            f"{_fmt(r['decode_speedup'], '.2f')}x; acceptance length on these prompts "
            f"{_fmt(timing.get('acceptance_length'))})",
            f"break-even acceptance length {_fmt(r['break_even_acceptance_length'], '.2f')} (speculative step "
            f"{_fmt(_ms(r['step_cost_s']['speculative_step']), '.1f')} ms / plain step "
            f"{_fmt(_ms(r['step_cost_s']['plain_decode_step']), '.1f')} ms): "
            + {True: "the drafter beats it", False: "the drafter does NOT beat it",
               None: "n/a"}[r["beats_break_even"]],
        ]
    else:
        lines.append("tokens/s, speedup and break-even: not measured (--timing-prompts 0)")
    for problem in r.get("timing_problems") or []:
        lines.append(f"UNRELIABLE TIMINGS: {problem}; other load on the machine? Rerun `python {STAGE_SCRIPT} "
                     f"--force` on an idle machine (acceptance figures are unaffected).")
    if r.get("outputs_match_plain") is not None and r["outputs_match_plain"] < 1.0:
        lines.append(f"note: {100 * r['outputs_match_plain']:.0f}% of greedy speculative outputs equal plain greedy "
                     f"ones (greedy verification is exact up to {r['settings']['dtype']} rounding of batched verify)")
    return lines


# --------------------------------------------------------------------------- plot

def write_plot(path: Path, r: dict, curve: list[dict]) -> None:
    """Left: acceptance per draft position (trained at each temperature, untrained, training
    full_acc_k). Middle (with categories): acceptance length per category and temperature.
    Right: full_acc_k over stage 04's steps (held-out evals as markers, train windows as lines)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    from ..atomic import atomic_path

    K = r["num_speculative_tokens"]
    rows = r.get("acceptance") or []
    cats = (r.get("categories") or {}).get("names") or []
    fig, axes = plt.subplots(1, 3 if cats else 2, figsize=(15 if cats else 10, 3.8))
    a, b = axes[0], axes[-1]
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
    exp = r["expected_accept_length_training"].get("full_acc")
    if exp:
        a.plot(np.arange(len(exp)), exp, "o--", color="black", label="training full_acc_k (held-out)")
    a.set_xticks(x, [str(k) for k in x])
    a.set_xlabel("draft position k")
    a.set_ylabel("share of drafts accepted through k")
    a.set_ylim(0, 1)
    a.set_title(f"served acceptance, K={K}")
    a.legend(fontsize=7)

    if cats:
        c = axes[1]
        y = np.arange(len(cats))
        h = 0.8 / max(1, len(rows))
        for i, row in enumerate(rows):
            vals = [(row["trained"]["by_category"].get(n) or {}).get("acceptance_length") or 0.0 for n in cats]
            err = [(row["trained"]["by_category"].get(n) or {}).get("ci95") or 0.0 for n in cats]
            c.barh(y - 0.4 + h * (i + 0.5), vals, h, xerr=err, label=_temp(row["temperature"]))
        c.set_yticks(y, cats, fontsize=7)
        c.set_xlabel(f"acceptance length (K={K}; bars: 95% interval over prompts)")
        c.set_xlim(1, K + 1)
        c.set_title(f"by {r['categories']['field']}")
        c.legend(fontsize=7)

    evals = [m for m in curve if m.get("split") == "eval"]
    trains = [m for m in curve if m.get("split") == "train"]
    n_steps = max((sum(1 for k in m if k.startswith("full_acc_")) for m in curve), default=0)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
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
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
