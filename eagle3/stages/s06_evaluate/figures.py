"""Stage 06's figures: pure functions from engine results (plain dicts) to what is reported.

No engine, no disk: the tests feed these fabricated engine results. The engine side
(eagle3/stages/s06_evaluate/engine.py, `serve_and_measure`) returns, per engine run:

    acceptance  one pass per sampling temperature over ALL prompts, many sequences at once:
                output tokens, vLLM's spec-decode counters for the pass, and, in a run
                with a drafter, each request's histogram of accepted draft tokens per
                verification step (`hist[j]` = steps that accepted j drafts; vLLM's
                per-request spec-decode metrics), which give the interval over prompts
                and the per-category figures
    timing      greedy passes over a subset, one request at a time (single stream), the
                plain and the drafter's requests interleaved (timing.py): per request wall
                seconds, engine timestamps of its first and last token, tokens and (with
                a drafter) histogram

run.py calls `run_figures` (every run's results -> its acceptance and timing figures) and
`teacher_check`; report.py `summarise` combines the runs' figures with the paired
speedup and break-even intervals, the verdicts and the timing checks defined here.

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
    95% interval of a     speedup and L* are ratios of two ratios of sums over the same timed
    paired ratio          prompts, R = (sum x_i / sum y_i) / (sum u_i / sum v_i) (x, y from the
                          run with the drafter, u, v from the plain run, prompt i in both, each
                          summed over the passes); by the delta method on log R, each prompt's
                          influence is
                          z_i = x_i / mean(x) - y_i / mean(y) - u_i / mean(u) + v_i / mean(v),
                          se(log R) = std(z) / sqrt(n), interval R * exp(+-1.96 se). Pairing
                          cancels what the two runs share: a long prompt is slow in both, and
                          a prompt's two requests run back to back, so a slowdown of the
                          machine longer than the pair slows both.
    passes' agreement     every pass serves the same prompts greedy, to the same outputs: its
                          speedup and its L* must equal the other passes' but for timing
                          noise. Largest over smallest beyond MAX_PASS_DISAGREEMENT: the
                          timings are unreliable and no speed figure or verdict is given.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

# How far the interleaved passes' speedups (and break-evens) may differ, largest over
# smallest, before the timings are called unreliable (docs/DEMO.md, "Timing that drift cannot
# fake"). The passes do identical work, so on an idle machine they differ by timing noise
# only; a load that keeps time with one engine's requests moves them by more.
MAX_PASS_DISAGREEMENT = 1.2


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
    95% interval over prompts and per category (from the per-request histograms)."""
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


def _request_sums(p: dict, K: int, speculative: bool) -> dict[str, Any]:
    """One pass's per-request counts and seconds, the parts every timing figure is a ratio of
    (summable over passes: the passes list the same prompts in the same order)."""
    tokens = [len(t) for t in p["tokens"]]
    ts = p["token_ts"]
    complete = all(a is not None and b is not None for a, b in ts)
    hists = p.get("histograms")
    counts = [histogram_counts(h, K) for h in hists] if speculative and hists is not None else None
    decode_tokens = [max(0, n - 1) for n in tokens]  # the first token comes from prefill
    return {
        "prompts": list(p.get("prompts") or range(len(tokens))),
        "request_tokens": tokens, "request_wall_s": list(p["request_wall_s"]),
        "request_decode_s": [b - a for a, b in ts] if complete else None,
        "request_decode_tokens": decode_tokens,
        # A plain decode step yields one token; a speculative one is a verification step
        # (the engine's per-request histogram counts them).
        "request_steps": (decode_tokens if not speculative else
                          [s for s, _, _ in counts] if counts is not None else None),
        "request_accepted": [a for _, a, _ in counts] if counts is not None else None,
        "request_accepted_per_pos": [pp for _, _, pp in counts] if counts is not None else None,
    }


def _add_sums(a: dict, b: dict) -> dict:
    """Two passes' per-request sums, request by request (None when either lacks a figure)."""
    assert a["prompts"] == b["prompts"], "timed passes must serve the same prompts in the same order"
    out = {"prompts": a["prompts"]}
    for key, x in a.items():
        if key == "prompts":
            continue
        y = b[key]
        if x is None or y is None:
            out[key] = None
        elif key == "request_accepted_per_pos":
            out[key] = [[u + v for u, v in zip(xs, ys)] for xs, ys in zip(x, y)]
        else:
            out[key] = [u + v for u, v in zip(x, y)]
    return out


def _ratio_or_none(num, den):
    return num / den if num is not None and den else None


def _timing_from_sums(sums: dict, K: int, speculative: bool) -> dict[str, Any]:
    """Tokens/s, decode step cost and (with a drafter) acceptance from per-request sums."""
    tokens, walls = sums["request_tokens"], sums["request_wall_s"]
    decode, steps = sums["request_decode_s"], sums["request_steps"]
    wall_s = sum(walls)
    decode_s = sum(decode) if decode else None
    out: dict[str, Any] = {
        "requests": len(tokens), "tokens": sum(tokens), "wall_s": wall_s,
        "tokens_per_s": sum(tokens) / wall_s if wall_s > 0 else None,
        "decode_tokens": sum(sums["request_decode_tokens"]), "decode_s": decode_s,
        "decode_tokens_per_s": _ratio_or_none(sum(sums["request_decode_tokens"]), decode_s),
        "request_tokens_per_s": [n / w if w > 0 else None for n, w in zip(tokens, walls)],
        # Per request, for the paired intervals of the speedup and the break-even.
        **{k: v for k, v in sums.items() if k not in ("request_accepted", "request_accepted_per_pos")},
        "steps": sum(steps) if steps is not None else None,
        "step_s": _ratio_or_none(decode_s, sum(steps) if steps is not None else None),
        "request_step_s": ([d / s if s else None for d, s in zip(decode, steps)]
                           if decode and steps is not None else None),
    }
    if speculative and sums["request_accepted"] is not None:
        per_pos = [sum(pp[k] for pp in sums["request_accepted_per_pos"]) for k in range(K)]
        out.update(acceptance_block(out["steps"], sum(sums["request_accepted"]), per_pos, K))
    return out


def timing_pass(p: dict, K: int, speculative: bool) -> dict[str, Any]:
    """Tokens/s and decode step cost of one single-stream pass (one request at a time)."""
    return _timing_from_sums(_request_sums(p, K, speculative), K, speculative)


def timing_figures(passes: list[dict], K: int, speculative: bool) -> dict[str, Any] | None:
    """One run's timed passes (eagle3/stages/s06_evaluate/timing.py, `serve_blocks`) together:
    each prompt's requests summed over the passes, then the figures of `timing_pass`; and, under
    `passes`, each pass's own tokens/s and step cost, which the passes' agreement compares."""
    if not passes:
        return None
    sums = [_request_sums(p, K, speculative) for p in passes]
    total = sums[0]
    for s in sums[1:]:
        total = _add_sums(total, s)
    per_pass = [_timing_from_sums(s, K, speculative) for s in sums]
    return {**_timing_from_sums(total, K, speculative), "pass_wall_s": [f["wall_s"] for f in per_pass],
            "passes": [{k: f[k] for k in ("wall_s", "tokens", "tokens_per_s", "decode_s", "steps", "step_s")}
                       for f in per_pass]}


def pass_ratios(plain: dict | None, spec: dict | None) -> dict[str, list[float | None]]:
    """Each timed pass's own speedup (speculative tokens/s over plain tokens/s) and break-even
    (speculative step cost over plain step cost): one value per pass, the same work each time."""
    pairs = list(zip((plain or {}).get("passes") or [], (spec or {}).get("passes") or []))
    return {"speedup": [_ratio_or_none(s["tokens_per_s"], p["tokens_per_s"]) for p, s in pairs],
            "break_even": [_ratio_or_none(s["step_s"], p["step_s"]) for p, s in pairs]}


def disagreement(values: list[float | None]) -> float | None:
    """Largest over smallest of the values (1.0: they agree); None below two values."""
    v = [x for x in values if x]
    return max(v) / min(v) if len(v) >= 2 else None


def timing_problems(plain: dict | None, spec: dict | None) -> list[str]:
    """Reasons not to trust the speed figures: the interleaved passes, identical work, disagree
    beyond `MAX_PASS_DISAGREEMENT` (module docstring), or there is a single pass to check.
    Empty when both runs were timed and their passes agree; acceptance is unaffected either way."""
    if not plain or not spec:
        return []
    ratios = pass_ratios(plain, spec)
    n = len(ratios["speedup"])
    if n < 2:
        return [f"{n} timed pass: nothing to check it against (--timed-passes 2 or more)"]
    # The passes' own figures stay in results.json (timing.pass_speedups, pass_break_evens): the
    # message gives how far apart they are, not a speed figure to quote.
    apart = []
    for key, label in (("speedup", "speedups"), ("break_even", "break-evens L*")):
        spread = disagreement(ratios[key])
        if spread is not None and spread > MAX_PASS_DISAGREEMENT:
            apart.append(f"{label} by {100 * (spread - 1):.0f}%")
    if not apart:
        return []
    return [f"the {n} interleaved timing passes' {' and '.join(apart)} differ (largest over smallest); passes of "
            f"identical work agree within {100 * (MAX_PASS_DISAGREEMENT - 1):.0f}%"]


def paired_speedups(plain: dict | None, spec: dict | None) -> list[float] | None:
    """Per-prompt end-to-end speedup: the same prompt served with and without the drafter."""
    if not plain or not spec:
        return None
    return [s / p for p, s in zip(plain["request_tokens_per_s"], spec["request_tokens_per_s"]) if p and s]


def paired_ratio_interval(x: list, y: list, u: list, v: list) -> tuple[float, float] | None:
    """Relative 95% interval (low, high factors around 1) of R = (sum x / sum y) / (sum u / sum v),
    the four lists indexed by the same prompts (delta method on log R, module docstring);
    None below 2 complete prompts or when a sum is zero."""
    rows = [r for r in zip(x, y, u, v) if all(a is not None for a in r)]
    n = len(rows)
    if n < 2:
        return None
    a = np.asarray(rows, dtype=np.float64)  # [n, 4]
    means = a.mean(axis=0)
    if not np.all(means > 0):
        return None
    z = a[:, 0] / means[0] - a[:, 1] / means[1] - a[:, 2] / means[2] + a[:, 3] / means[3]
    se = float(np.std(z, ddof=1)) / math.sqrt(n)
    return math.exp(-1.96 * se), math.exp(1.96 * se)


def speedup_interval(plain: dict | None, spec: dict | None, speedup: float | None) -> list[float] | None:
    """[low, high] of the end-to-end speedup: tokens per wall second with the drafter over without,
    paired over the timed prompts (the headline `speedup` scaled by the relative interval)."""
    if not plain or not spec or speedup is None or "request_wall_s" not in plain or "request_wall_s" not in spec:
        return None
    rel = paired_ratio_interval(spec["request_tokens"], spec["request_wall_s"], plain["request_tokens"],
                                plain["request_wall_s"])
    return [speedup * rel[0], speedup * rel[1]] if rel else None


def break_even_interval(plain: dict | None, spec: dict | None, break_even: float | None) -> list[float] | None:
    """[low, high] of L* = c_s / c_t: decode seconds per verification step with the drafter over
    decode seconds per token without, paired over the timed prompts (None without per-request
    step counts, i.e. without the engine's per-request histograms)."""
    if not plain or not spec or break_even is None:
        return None
    if not spec.get("request_decode_s") or spec.get("request_steps") is None or not plain.get("request_decode_s"):
        return None
    rel = paired_ratio_interval(spec["request_decode_s"], spec["request_steps"], plain["request_decode_s"],
                                plain["request_decode_tokens"])
    return [break_even * rel[0], break_even * rel[1]] if rel else None


def speed_verdict(interval: list[float] | None, value: float | None) -> str | None:
    """"faster" / "slower" when the speedup's 95% interval excludes 1.0, "no difference shown" when
    it holds 1.0; without an interval (fewer than 2 timed prompts) the point value decides."""
    if value is None:
        return None
    lo, hi = interval if interval else (value, value)
    if lo > 1.0:
        return "faster"
    if hi < 1.0:
        return "slower"
    return "no difference shown"


def break_even_verdict(L: float | None, L_ci: float | None, be: float | None,
                       be_interval: list[float] | None) -> bool | None:
    """True when the measured L beats the break-even L* beyond both 95% intervals, False when it
    falls short beyond them, None when the intervals overlap (no difference shown) or a figure is
    missing. Without intervals the point values decide."""
    if L is None or be is None:
        return None
    lo_L, hi_L = L - (L_ci or 0.0), L + (L_ci or 0.0)
    lo_b, hi_b = be_interval if be_interval else (be, be)
    if lo_L > hi_b:
        return True
    if hi_L < lo_b or (not L_ci and not be_interval and L <= be):
        return False
    return None


# --------------------------------------------------------------------------- every run's figures

def run_figures(raw: dict[str, dict], K: int, prompt_categories: list[str | None],
                temperatures: list[float]) -> dict[str, dict]:
    """Engine results (`raw[name]`, one per run) -> the figures `summarise` reads, per run:
    acceptance per temperature, single-stream timing and, for drafter runs, the share of
    greedy outputs equal to the plain run's."""
    greedy = temperatures.index(0.0) if 0.0 in temperatures else None
    plain_greedy = raw["plain"]["acceptance"][0]["tokens"] if "plain" in raw and greedy is not None else None
    runs: dict[str, dict] = {}
    for name, res in raw.items():
        speculative = name != "plain"
        acc = ([acceptance_figures(p, K, prompt_categories) for p in res["acceptance"]] if speculative else
               [{"temperature": p["temperature"], "tokens": sum(len(t) for t in p["tokens"]), "wall_s": p["wall_s"]}
                for p in res["acceptance"]])
        runs[name] = {"init_s": res["init_s"], "per_request_metrics": res.get("per_request_metrics"),
                      "acceptance": acc, "timing": timing_figures(res["timing"], K, speculative)}
        # The untrained run is served at the first temperature only: no greedy pass when that is not 0.
        if speculative and plain_greedy is not None and greedy < len(res["acceptance"]):
            runs[name]["outputs_match_plain"] = outputs_match(res["acceptance"][greedy]["tokens"], plain_greedy)
    return runs


def teacher_check(references: list[list[int] | None], plain_greedy: list[list[int]] | None) -> dict:
    """How often the target's greedy answer starts with the dataset's answer. A target that
    rarely reproduces its training chats is a noisy teacher for the drafter."""
    refs = [(r, t) for r, t in zip(references, plain_greedy or []) if r]
    return {"greedy_equals_dataset_answer": sum(r == t[:len(r)] for r, t in refs) / len(refs) if refs else None}
