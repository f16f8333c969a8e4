"""How much data reaches a target acceptance: stage 04 on nested fractions, and a fitted law.

    python -m eagle3.tools.diagnose forecast --work-dir W --target-al 2.46 [--config C]
        [--fractions 0.125,0.25,0.5,1] [--fit-upto 0.5] [--law log]

Reads W's stages 01-03 and runs stage 04 once per fraction f of the train split, in
its own work dir `W/forecast/frac-<f>/`, whose 00_generate, 01_dataset,
02_hidden_states and 03_vocab are symlinks to W's (stage 04 writes
`W/forecast/frac-<f>/04_train/` there and nothing in W changes). Each run trains on
the first ceil(f * n) samples of a seeded order (`--train-fraction f`: a smaller
fraction's samples are a subset of a larger one's) with a budget proportional to its
size: `round(f * S)` steps and `round(f * Wu)` warmup steps (at least 1 each), S and
Wu being the full run's (the config's train.max_steps, or its epochs' steps, and
train.warmup_steps). Every fraction thus makes the same number of passes over its own
data. A fraction whose stage-04 manifest already holds these settings is read, not
retrained (stage 04's own completion check).

One point per fraction: D, the training tokens (the loss-carrying positions of the
fraction's samples: the data a user collects, each pass counted once), and the best
held-out expected accept length of stage 04's record (eagle3/stages/s04_train/run.py
`finish`, docs/CONVENTIONS.md §5). A law g(AL) = a + b ln D is fitted by least
squares; the laws, the interval arithmetic and how to read the report are in
docs/FORECAST.md. The fit and the report are pure functions (`fit_law`,
`Fit.predict`, `Fit.tokens_for`, `build_report`); `run_forecast` runs the fractions.
Writes nothing besides the fraction work dirs; logs, never prints.

The command line is here too (`NAME`, `add_parser`, `run`: the subcommand protocol of
eagle3/tools/diagnose/__init__.py, which prints the report): exit status 1 when the check
(the fit on the smaller fractions against the largest run) lands outside its interval.
"""
from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from eagle3.artifacts.manifest import record_of, stage_run
from eagle3.artifacts.store import HiddenStateStore
from eagle3.artifacts.train_outputs import read_train_metrics
from eagle3.artifacts.vocab_map import load_mapping
from eagle3.artifacts.workdir import WorkDir
from eagle3.core.config import build_config
from eagle3.core.errors import PipelineError
from eagle3.stages.configs import STAGE_CONFIGS
from eagle3.stages.s04_train.config import TrainConfig
from eagle3.stages.s04_train.data import Batching, EpochPlan, nested_share
from eagle3.stages.s04_train.loss_positions import count_loss_positions
from eagle3.stages.s04_train.run import train_drafter

log = logging.getLogger(__name__)

DEFAULT_FRACTIONS = (0.125, 0.25, 0.5, 1.0)
DEFAULT_FIT_UPTO = 0.5
UPSTREAM = ("generate", "prepare", "extract", "vocab")  # the stages a fraction's work dir links to W's
FORECAST_DIR = "forecast"
MORE_DATA = (2, 4, 10)  # the report's AL at these multiples of the largest run's tokens


# =========================================================================== statistics

def t_two_sided_coverage(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with an integer number of degrees of freedom.

    The closed forms of Abramowitz & Stegun 26.7.3 (odd dof) and 26.7.4 (even dof), in
    theta = atan(t / sqrt(dof)): exact for integer dof, which is what a fit of n points
    with 2 parameters has (n - 2).
    """
    assert dof >= 1, dof
    theta = math.atan(t / math.sqrt(dof))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if dof % 2 == 1:
        if dof == 1:
            return 2 * theta / math.pi
        term = total = math.cos(theta)  # cos(theta) + 2/3 cos^3 + (2*4)/(3*5) cos^5 + ... up to cos^(dof-2)
        for k in range(1, (dof - 3) // 2 + 1):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + s * total)
    term = total = 1.0  # 1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ... up to cos^(dof-2)
    for k in range(1, (dof - 2) // 2 + 1):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return s * total


def t_quantile_two_sided(coverage: float, dof: int) -> float:
    """t such that P(|T| <= t) = coverage (1.96 for 0.95 as dof grows; 12.71 at dof 1)."""
    lo, hi = 0.0, 1.0
    while t_two_sided_coverage(hi, dof) < coverage:
        hi *= 2
    for _ in range(200):  # bisection: the coverage rises with t
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_two_sided_coverage(mid, dof) < coverage else (lo, mid)
    return (lo + hi) / 2


def per_position_acceptance(al: float, K: int) -> float:
    """p with 1 + p + p^2 + ... + p^K = al: the acceptance of each draft position of a
    greedy chain whose positions accept alike (the demo's cond_acc_k are within a few
    hundredths of each other). The sum rises with p on (0, 1), from 1 to K + 1."""
    assert 1 < al < K + 1, (al, K)
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** k for k in range(K + 1)) < al else (lo, mid)
    return (lo + hi) / 2


def _exp(v: float) -> float:
    """exp that saturates at inf: a far extrapolation's bound is unbounded, not an error."""
    return math.exp(v) if v < 700 else math.inf


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _sigmoid(y: float) -> float:
    return 1 / (1 + math.exp(-y)) if y >= 0 else math.exp(y) / (1 + math.exp(y))


@dataclass(frozen=True)
class Law:
    """g(AL) = a + b ln D, with g rising in AL (b > 0: acceptance rises with data)."""

    name: str
    formula: str  # the law in words, in a, b, D, K
    g: Callable[[float, int], float]  # (AL, K) -> the fitted quantity
    g_inv: Callable[[float, int], float]  # (value, K) -> AL
    domain: Callable[[float, int], bool]  # which measured AL values the law can take
    domain_text: str  # the same in words, for messages


LAWS: dict[str, Law] = {law.name: law for law in (
    Law("log", "AL = a + b ln D",
        g=lambda al, K: al, g_inv=lambda y, K: y, domain=lambda al, K: True, domain_text="any AL"),
    Law("ceiling", "AL = (K+1) - exp(-a) D^-b  (the distance to the ceiling K+1 falls as a power of D)",
        g=lambda al, K: -math.log(K + 1 - al), g_inv=lambda y, K: K + 1 - math.exp(-y),
        domain=lambda al, K: al < K + 1, domain_text="AL < K+1"),
    Law("per-position", "AL = 1 + p + ... + p^K,  logit p = a + b ln D  (p: each draft position's acceptance)",
        g=lambda al, K: _logit(per_position_acceptance(al, K)),
        g_inv=lambda y, K: sum(_sigmoid(y) ** k for k in range(K + 1)),
        domain=lambda al, K: 1 < al < K + 1, domain_text="1 < AL < K+1"),
)}
# Chosen on the SmolLM2 demo's points: the smallest error predicting the full run from
# the fractions up to 1/2, and the smallest residuals in AL (docs/FORECAST.md has the
# figures of all three laws).
DEFAULT_LAW = "log"


@dataclass(frozen=True)
class Prediction:
    al: float
    lo: float | None  # 95% prediction interval of one run's held-out AL; None when unknown (2 points)
    hi: float | None


@dataclass(frozen=True)
class Reach:
    """The training tokens at which the law puts a run's held-out AL at the target."""

    reachable: bool
    why: str = ""  # when not reachable, or when the interval is unknown or unbounded
    tokens: float | None = None
    lo: float | None = None  # 95% interval (inverse prediction); hi may be math.inf
    hi: float | None = None


@dataclass(frozen=True)
class Fit:
    """Least squares of y = g(AL) on x = ln D over n points, with its uncertainty.

    a, b and their standard errors; s is the residual standard error (None with 2
    points: a line through two points has no residual, so no uncertainty); t the 95%
    two-sided Student-t quantile at n - 2 degrees of freedom.
    """

    law: Law
    K: int
    n: int
    a: float
    b: float
    x_mean: float
    y_mean: float
    sxx: float
    s: float | None
    t: float | None
    residuals: list[float] = field(default_factory=list)  # in g's units, one per point

    @property
    def dof(self) -> int:
        return self.n - 2

    @property
    def se_a(self) -> float | None:
        return None if self.s is None else self.s * math.sqrt(1 / self.n + self.x_mean ** 2 / self.sxx)

    @property
    def se_b(self) -> float | None:
        return None if self.s is None else self.s / math.sqrt(self.sxx)

    def _half_width(self, x: float) -> float | None:
        """Half the 95% prediction interval of one new point at x, in g's units."""
        if self.s is None:
            return None
        return self.t * self.s * math.sqrt(1 + 1 / self.n + (x - self.x_mean) ** 2 / self.sxx)

    def predict(self, tokens: float) -> Prediction:
        """One run's held-out AL at `tokens` training tokens, with its 95% prediction interval."""
        x = math.log(tokens)
        y = self.a + self.b * x
        half = self._half_width(x)
        inv = self.law.g_inv
        if half is None:
            return Prediction(inv(y, self.K), None, None)
        return Prediction(inv(y, self.K), inv(y - half, self.K), inv(y + half, self.K))

    def tokens_for(self, target_al: float) -> Reach:
        """The tokens at which the law puts a run's AL at `target_al`, and the 95% interval
        of tokens whose prediction interval holds the target (inverse prediction, Fieller).

        With u = ln D - mean(ln D) and d = g(target) - mean(g), the target lies inside
        the prediction interval at u where (d - b u)^2 <= q (1 + 1/n) + q u^2 / Sxx,
        q = t^2 s^2: a quadratic A u^2 - 2 d b u + (d^2 - q (1 + 1/n)) <= 0 with
        A = b^2 - q / Sxx. A > 0 (the slope is significant at 95%) gives a bounded
        interval; otherwise the side away from the data is unbounded.
        """
        K = self.K
        if not target_al < K + 1:
            return Reach(False, f"AL can never reach K + 1 = {K + 1} (the whole chain of K = {K} draft tokens "
                                f"accepted every time): not reachable under any law")
        if not self.law.domain(target_al, K):
            return Reach(False, f"AL {target_al} is outside what the {self.law.name} law can take")
        if not self.b > 0:
            return Reach(False, f"the fitted slope b = {self.b:.4g} is not positive: held-out AL does not rise "
                                f"with data under this fit, so no amount of data reaches {target_al}")
        d = self.law.g(target_al, K) - self.y_mean
        u_hat = d / self.b
        tokens = _exp(self.x_mean + u_hat)
        if self.s is None:
            return Reach(True, "uncertainty unknown: a line through 2 points has no residual (run 3+ fractions "
                               "at or below --fit-upto)", tokens)
        q = self.t ** 2 * self.s ** 2
        A = self.b ** 2 - q / self.sxx
        B = -2 * d * self.b
        C = d ** 2 - q * (1 + 1 / self.n)
        disc = B * B - 4 * A * C
        if A > 0:  # the point estimate lies inside, so disc > 0 and the roots bracket it
            r = math.sqrt(max(disc, 0.0))
            u_lo, u_hi = (-B - r) / (2 * A), (-B + r) / (2 * A)
            return Reach(True, "", tokens, _exp(self.x_mean + u_lo), _exp(self.x_mean + u_hi))
        why = (f"the slope is not significant at 95% (b = {self.b:.4g} +- {self.se_b:.2g}, t = {self.t:.3g}): "
               f"the interval is unbounded")
        if disc <= 0 or A == 0:
            return Reach(True, why, tokens, 0.0, math.inf)
        # A < 0: the set is the two half-lines outside the roots; keep the one holding u_hat.
        r = math.sqrt(disc)
        roots = sorted(((-B - r) / (2 * A), (-B + r) / (2 * A)))
        if u_hat <= roots[0]:
            return Reach(True, why, tokens, 0.0, _exp(self.x_mean + roots[0]))
        return Reach(True, why, tokens, _exp(self.x_mean + roots[1]), math.inf)


def fit_law(law: Law | str, tokens: list[float], accept_lengths: list[float], K: int) -> Fit:
    """Least squares of g(AL) on ln D. Needs 2+ points with distinct token counts and every
    AL inside the law's domain (PipelineError naming the point otherwise)."""
    law = LAWS[law] if isinstance(law, str) else law
    if len(tokens) != len(accept_lengths) or len(tokens) < 2:
        raise PipelineError(f"a fit needs 2 or more points, got {len(tokens)}; pass more --fractions.")
    for D, v in zip(tokens, accept_lengths):
        if not D > 0:
            raise PipelineError(f"a point has {D} training tokens; every fraction must train on some.")
        if not law.domain(v, K):
            raise PipelineError(f"held-out AL {v:.4f} (at {D:,.0f} tokens) is outside the {law.name} law's range "
                                f"({law.domain_text}, K+1 = {K + 1}); pick another --law.")
    n = len(tokens)
    x = [math.log(D) for D in tokens]
    y = [law.g(v, K) for v in accept_lengths]
    xm, ym = sum(x) / n, sum(y) / n
    sxx = sum((xi - xm) ** 2 for xi in x)
    if sxx <= 0:
        raise PipelineError(f"every point has the same training tokens ({tokens[0]:,.0f}): the fractions are too "
                            f"close for this data; pass fractions further apart.")
    b = sum((xi - xm) * (yi - ym) for xi, yi in zip(x, y)) / sxx
    a = ym - b * xm
    res = [yi - (a + b * xi) for xi, yi in zip(x, y)]
    s = t = None
    if n > 2:
        s = math.sqrt(sum(r * r for r in res) / (n - 2))
        t = t_quantile_two_sided(0.95, n - 2)
    return Fit(law, K, n, a, b, xm, ym, sxx, s, t, res)


# =========================================================================== points

@dataclass(frozen=True)
class Point:
    """One fraction's stage-04 run."""

    fraction: float
    samples: int  # conversations trained on
    tokens: int  # D: their loss-carrying positions (each counted once)
    steps: int
    warmup_steps: int
    held_out_al: float  # best held-out expected accept length (stage 04's record)
    best_step: int | None
    tokens_seen: int | None = None  # loss-carrying positions over all steps (metrics.jsonl), passes * tokens
    reused: bool = False  # read from a finished run with these settings


def fraction_budget(fraction: float, full_steps: int, full_warmup: int) -> tuple[int, int]:
    """(steps, warmup steps) of a fraction's run: proportional to its share, at least 1 each."""
    return max(1, round(fraction * full_steps)), max(1, round(fraction * full_warmup))


def parse_fractions(text: str) -> list[float]:
    """'0.125,0.25,0.5,1' -> sorted distinct fractions in (0, 1] (also accepts 1/8)."""
    out = set()
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            num, _, den = item.partition("/")
            f = float(num) / float(den) if den else float(num)
        except (ValueError, ZeroDivisionError) as e:
            raise PipelineError(f"--fractions item {item!r} is not a number (e.g. 0.125,0.25,0.5,1).") from e
        if not 0 < f <= 1:
            raise PipelineError(f"--fractions item {item!r} is outside (0, 1]: a fraction of the train split.")
        out.add(f)
    if len(out) < 2:
        raise PipelineError(f"--fractions {text!r} gives {len(out)} distinct fraction(s); a fit needs 2 or more "
                            f"(e.g. 0.125,0.25,0.5,1).")
    return sorted(out)


# =========================================================================== the report

def al_residual_se(fit: Fit, tokens: list[float], accept_lengths: list[float]) -> float | None:
    """sqrt(sum (AL - the law's AL)^2 / (n - 2)): the fit's residuals in AL itself, the one
    unit in which laws fitted on different g compare (None with 2 points)."""
    if fit.n <= 2:
        return None
    return math.sqrt(sum((v - fit.predict(D).al) ** 2 for D, v in zip(tokens, accept_lengths)) / (fit.n - 2))


def _fit_json(fit: Fit, tokens: list[float], accept_lengths: list[float]) -> dict:
    return {"law": fit.law.name, "formula": fit.law.formula, "points": fit.n, "a": fit.a, "b": fit.b,
            "se_a": fit.se_a, "se_b": fit.se_b, "residual_se": fit.s, "dof": fit.dof, "t95": fit.t,
            "residuals": fit.residuals, "al_residual_se": al_residual_se(fit, tokens, accept_lengths)}


def _reach_json(r: Reach, tokens_per_conversation: float, full_tokens: int) -> dict:
    out = {"reachable": r.reachable, "why": r.why, "tokens": r.tokens, "tokens_lo": r.lo, "tokens_hi": r.hi}
    if r.tokens is not None:
        def conv(v):
            return None if v is None else v / tokens_per_conversation

        out.update(conversations=conv(r.tokens), conversations_lo=conv(r.lo), conversations_hi=conv(r.hi),
                   times_this_data=r.tokens / full_tokens)
    return out


def check_fit(law: Law | str, points: list[Point], fit_upto: float, K: int) -> dict:
    """Fit on the fractions <= fit_upto and predict the largest fraction's run: the check.
    {"ran": False, "why": ...} when there are not 2 points below and one above."""
    below = [p for p in points if p.fraction <= fit_upto + 1e-12]
    largest = max(points, key=lambda p: p.fraction)
    if len(below) < 2 or largest.fraction <= fit_upto + 1e-12:
        return {"ran": False, "why": f"the check needs 2+ fractions at or below --fit-upto {fit_upto} and one above "
                                     f"it (have {len(below)} at or below, largest {largest.fraction:g})"}
    D, AL = [p.tokens for p in below], [p.held_out_al for p in below]
    fit = fit_law(law, D, AL, K)
    pred = fit.predict(largest.tokens)
    inside = None if pred.lo is None else pred.lo <= largest.held_out_al <= pred.hi
    return {"ran": True, "fit": _fit_json(fit, D, AL), "fractions": [p.fraction for p in below],
            "predicted_fraction": largest.fraction, "predicted_tokens": largest.tokens,
            "predicted_al": pred.al, "lo": pred.lo, "hi": pred.hi, "measured_al": largest.held_out_al,
            "error": largest.held_out_al - pred.al, "inside": inside}


def build_report(points: list[Point], *, target_al: float, K: int, law: str = DEFAULT_LAW,
                 fit_upto: float = DEFAULT_FIT_UPTO, tokens_per_conversation: float,
                 full: dict | None = None) -> dict:
    """Everything the forecast reports, as a JSON-able dict: the points, the chosen law
    fitted on all points with the tokens to reach `target_al`, the check of the fit on
    the fractions <= fit_upto against the largest run, and the same for every law."""
    points = sorted(points, key=lambda p: p.fraction)
    D = [p.tokens for p in points]
    AL = [p.held_out_al for p in points]
    largest = points[-1]
    laws = {}
    for name in LAWS:
        row: dict = {}
        try:
            fit = fit_law(name, D, AL, K)
            row["fit"] = _fit_json(fit, D, AL)
            row["reach"] = _reach_json(fit.tokens_for(target_al), tokens_per_conversation, largest.tokens)
            row["more_data"] = {f"{m:g}x": vars(fit.predict(m * largest.tokens)) for m in MORE_DATA}
            row["check"] = check_fit(name, points, fit_upto, K)
        except PipelineError as e:
            row["error"] = str(e)
        laws[name] = row
    return {"target_al": target_al, "K": K, "ceiling": K + 1, "law": law, "fit_upto": fit_upto,
            "tokens_per_conversation": tokens_per_conversation, "full": full or {},
            "points": [vars(p) for p in points], "laws": laws, "chosen": laws[law]}


def _num(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "?"
    if math.isinf(v):
        return "unbounded"
    av = abs(v)
    if av >= 1e9:
        return f"{v / 1e9:.{digits}g}G"
    if av >= 1e6:
        return f"{v / 1e6:.{digits}g}M"
    if av >= 1e4:
        return f"{v / 1e3:.{digits}g}K"
    return f"{v:,.0f}" if av >= 100 else f"{v:.{digits}g}"


def _reach_text(report: dict, target: float) -> str:
    if not report["reachable"]:
        return f"AL {target}: not reachable under this law: {report['why']}"
    text = f"AL {target} at {_num(report['tokens'])} training tokens"
    if report["tokens_lo"] is not None:
        text += f" [95% interval {_num(report['tokens_lo'])} .. {_num(report['tokens_hi'])}]"
    text += (f", {_num(report['conversations'])} conversations"
             + (f" [{_num(report['conversations_lo'])} .. {_num(report['conversations_hi'])}]"
                if report["conversations_lo"] is not None else "")
             + f" ({report['times_this_data']:.3g}x the data here)")
    if report["why"]:
        text += f"; {report['why']}"
    return text


def _check_text(c: dict) -> str:
    if not c["ran"]:
        return f"not run: {c['why']}"
    fr = ", ".join(f"{f:g}" for f in c["fractions"])
    head = (f"the fit on fractions {fr} predicts the fraction-{c['predicted_fraction']:g} run "
            f"({_num(c['predicted_tokens'])} tokens) at {c['predicted_al']:.3f}")
    if c["lo"] is None:
        return head + f" (uncertainty unknown with 2 points); measured {c['measured_al']:.3f}"
    return (head + f" -{c['predicted_al'] - c['lo']:.3f}/+{c['hi'] - c['predicted_al']:.3f} "
            f"(95% prediction interval {c['lo']:.3f} .. {c['hi']:.3f}); measured {c['measured_al']:.3f} "
            f"(error {c['error']:+.3f}): {'INSIDE' if c['inside'] else 'OUTSIDE'}")


def format_report(report: dict) -> str:
    K, target = report["K"], report["target_al"]
    full = report["full"]
    out = [f"forecast: training tokens to reach held-out expected accept length {target} "
           f"(K = {K} draft steps, so AL <= {K + 1})"]
    if full:
        out.append(f"work dir {full.get('work_dir')}; full run {full.get('steps')} steps ({full.get('steps_from')}), "
                   f"warmup {full.get('warmup_steps')}; fraction runs in {full.get('runs_dir')}")
    out.append(f"training tokens D = loss-carrying positions of a fraction's conversations, each counted once; "
               f"{report['tokens_per_conversation']:.1f} per conversation on average in this train split")
    out += ["", f"{'fraction':>8s} {'samples':>8s} {'tokens':>9s} {'steps':>6s} {'warmup':>6s} {'passes':>6s} "
                f"{'held-out AL':>11s} {'best step':>9s}"]
    for p in report["points"]:
        passes = f"{p['tokens_seen'] / p['tokens']:.2f}" if p["tokens_seen"] else "-"
        out.append(f"{p['fraction']:8g} {p['samples']:8d} {p['tokens']:9d} {p['steps']:6d} {p['warmup_steps']:6d} "
                   f"{passes:>6s} {p['held_out_al']:11.4f} {str(p['best_step']):>9s}"
                   + ("   (reused)" if p["reused"] else ""))
    c = report["chosen"]
    out.append("")
    if "error" in c:
        out.append(f"law {report['law']}: cannot be fitted: {c['error']}")
    else:
        f = c["fit"]
        out.append(f"law {f['law']} (fit on all {f['points']} points, D in tokens): {f['formula']}")
        if f["residual_se"] is None:
            out.append(f"  a = {f['a']:.4f}  b = {f['b']:.4f}  (2 points: no residual, uncertainty unknown)")
        else:
            out.append(f"  a = {f['a']:.4f} +- {f['se_a']:.4f}   b = {f['b']:.4f} +- {f['se_b']:.4f}   residual "
                       f"standard error {f['residual_se']:.4f} ({f['dof']} degrees of freedom, t95 = {f['t95']:.3f})")
        more = ", ".join(f"{m}: {_al_text(p)}" for m, p in c["more_data"].items())
        out.append(f"more data (times the largest run's tokens): {more}")
        out.append(f"forecast: {_reach_text(c['reach'], target)}")
        out.append(f"check: {_check_text(c['check'])}")
    out += ["", "laws compared (each fitted on all points; AL resid SE: the residuals in AL, n - 2 degrees of "
                "freedom; check: as above)",
            f"{'law':13s} {'b':>8s} {'AL resid SE':>11s} {'tokens to reach [95%]':>29s} "
            f"{'check prediction [95%]':>26s} {'error':>7s} verdict"]
    for name, row in report["laws"].items():
        if "error" in row:
            out.append(f"{name:13s} not applicable: {row['error']}")
            continue
        f, reach, chk = row["fit"], row["reach"], row["check"]
        tok = "unreachable"
        if reach["reachable"]:
            tok = _num(reach["tokens"]) + ("" if reach["tokens_lo"] is None else
                                           f" [{_num(reach['tokens_lo'])}..{_num(reach['tokens_hi'])}]")
        if chk["ran"]:
            rng = "" if chk["lo"] is None else f" [{chk['lo']:.3f}..{chk['hi']:.3f}]"
            pred = f"{chk['predicted_al']:.3f}{rng}"
            verdict = "?" if chk["inside"] is None else ("inside" if chk["inside"] else "OUTSIDE")
            err = f"{chk['error']:+.3f}"
        else:
            pred, err, verdict = "-", "-", "not run"
        resid = "-" if f["al_residual_se"] is None else f"{f['al_residual_se']:.4f}"
        out.append(f"{name:13s} {f['b']:8.4f} {resid:>11s} {tok:>29s} {pred:>26s} {err:>7s} {verdict}"
                   + ("   <- chosen" if name == report["law"] else ""))
    return "\n".join(out)


def _al_text(p: dict) -> str:
    return f"{p['al']:.3f}" + ("" if p["lo"] is None else f" [{p['lo']:.3f}..{p['hi']:.3f}]")


# =========================================================================== the runs

def fraction_dir(work_dir: Path | str, fraction: float) -> Path:
    return Path(work_dir) / FORECAST_DIR / f"frac-{fraction:g}"


def link_upstream(src: WorkDir, dest: Path) -> None:
    """Make dest's stage 00-03 folders symlinks to src's (stage 00 only when src has one)."""
    dest.mkdir(parents=True, exist_ok=True)
    for stage in UPSTREAM:
        folder = src.stage_dir(stage)
        link = WorkDir(dest).stage_dir(stage)
        if not folder.is_dir():
            if stage == "generate":  # optional: a dataset may come from files, not stage 00
                continue
            raise PipelineError(f"diagnose forecast needs {folder}: run `python {src.script(stage)} --work-dir "
                                f"{src.root}` (with your --config) first.")
        if link.is_symlink():
            if link.resolve() == folder.resolve():
                continue
            link.unlink()  # a link to another work dir's stage: point it at this one
        elif link.exists():
            raise PipelineError(f"{link} is a folder, not a link to {folder}: the forecast links each fraction's "
                                f"stages 00-03 to the work dir's; remove {link} (or {dest}) and rerun.")
        link.symlink_to(folder.resolve(), target_is_directory=True)


def _tokens_seen(workdir: WorkDir) -> int | None:
    """Loss-carrying positions summed over the train rows of metrics.jsonl (each window's
    step-0 valid count; eagle3/artifacts/train_outputs.py `read_train_metrics`, the file's one
    reader), or None when the file is absent."""
    if not workdir.train_metrics().is_file():
        return None
    return sum(int(row.get("num_valid", 0)) for row in read_train_metrics(workdir) if row.get("split") == "train")


def run_forecast(work_dir: Path | str, *, target_al: float, config: str | None = None,
                 target_model: str | None = None, fractions: list[float] | tuple[float, ...] = DEFAULT_FRACTIONS,
                 fit_upto: float = DEFAULT_FIT_UPTO, law: str = DEFAULT_LAW, max_steps: int | None = None,
                 warmup_steps: int | None = None, device: str | None = None) -> dict:
    """Run (or reuse) stage 04 for each fraction and build the report (see `build_report`).

    `max_steps`/`warmup_steps`: the full run's budget, overriding the config's.
    """
    import dataclasses


    if law not in LAWS:
        raise PipelineError(f"--law {law!r} is not one of {', '.join(LAWS)}.")
    if not 0 < fit_upto <= 1:
        raise PipelineError(f"--fit-upto {fit_upto} is outside (0, 1]: the largest fraction the check fits on.")
    workdir = WorkDir(work_dir)
    overrides = {"work_dir": str(workdir.root), "target_model": target_model, "device": device}
    base = build_config(TrainConfig, "train", config, overrides, sections=STAGE_CONFIGS)
    if base.init_from:
        raise PipelineError(f"train.init_from = {base.init_from}: the forecast trains from scratch (a fine-tune's "
                            f"data need depends on its start); remove init_from from {config}.")
    K = base.ttt_steps
    with stage_run(config=config):
        # The points' D: the loss-carrying positions of each fraction's samples, chosen by
        # the functions stage 04 itself uses (same vocabulary, crop and loss_on).
        store = HiddenStateStore.open(workdir, needed_by="diagnose forecast")
        _, t2d = load_mapping(workdir)
        lp = count_loss_positions(store.split("train"), t2d, base.max_seq_len,
                                  assistant_only=base.loss_on == "assistant")
        trainable = lp.trainable()
        if max_steps:
            full_steps, steps_from = max_steps, "--max-steps"
        elif base.max_steps:
            full_steps, steps_from = base.max_steps, "train.max_steps"
        else:
            plan = EpochPlan(store.split("train").lengths(), Batching(base.batch_tokens, base.max_seq_len, base.seed,
                                                                      packed=base.packing),
                             rank=0, world=1, grad_accum=base.grad_accum, samples=trainable)
            full_steps, steps_from = plan.steps_for_epochs(base.epochs), f"{base.epochs} epoch(s) of the full data"
        full_warmup = warmup_steps if warmup_steps is not None else base.warmup_steps
        per_sample = lp.per_sample

        points = []
        for f in fractions:
            share = nested_share(trainable, f, base.seed)
            steps, warm = fraction_budget(f, full_steps, full_warmup)
            dest = fraction_dir(workdir.root, f)
            link_upstream(workdir, dest)
            cfg = dataclasses.replace(base, work_dir=dest, train_fraction=f, max_steps=steps, warmup_steps=warm)
            fwd = WorkDir(dest)
            before = fwd.manifest("train").stat().st_mtime_ns if fwd.manifest("train").is_file() else None
            log.info("fraction %g: %d of %d conversations, %d steps (warmup %d) in %s", f, len(share),
                     len(trainable), steps, warm, fwd.stage_dir("train"))
            m = train_drafter(cfg)
            assert m is not None, "one process, no --stop-after: stage 04 returns its manifest"
            reused = before is not None and fwd.manifest("train").stat().st_mtime_ns == before
            if reused:
                log.info("fraction %g: reused %s (same settings)", f, fwd.manifest("train"))
            r = record_of(m)
            points.append(Point(fraction=f, samples=len(share), tokens=int(per_sample[share].sum()),
                                steps=r.steps, warmup_steps=warm,
                                held_out_al=float(r.best_expected_accept_length), best_step=r.best_step,
                                tokens_seen=_tokens_seen(fwd), reused=reused))
    full = {"work_dir": str(workdir.root), "runs_dir": str(workdir.root / FORECAST_DIR), "steps": full_steps,
            "steps_from": steps_from, "warmup_steps": full_warmup, "conversations": len(trainable),
            "tokens": int(per_sample[trainable].sum())}
    return build_report(points, target_al=target_al, K=K, law=law, fit_upto=fit_upto,
                        tokens_per_conversation=full["tokens"] / len(trainable), full=full)


# =========================================================================== the `diagnose forecast` command

NAME = "forecast"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="train on nested fractions of the data and forecast the training tokens "
                                  "that reach a target acceptance (docs/FORECAST.md)")
    p.add_argument("--work-dir", required=True, help="work dir with stages 01-03 done (its fraction runs go to "
                                                     "WORK/forecast/)")
    p.add_argument("--target-al", type=float, required=True, help="held-out expected accept length to reach "
                                                                  "(e.g. a deployment's break-even)")
    p.add_argument("--config", help="the YAML file of the run: its train section is the full run's settings")
    p.add_argument("--target-model", help="target model folder (default: the config's target_model)")
    p.add_argument("--fractions", default=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                   help="fractions of the train split, comma-separated (default %(default)s)")
    p.add_argument("--fit-upto", type=float, default=DEFAULT_FIT_UPTO,
                   help="the check fits on the fractions up to this one and predicts the largest (default "
                        "%(default)s)")
    p.add_argument("--law", choices=tuple(LAWS), default=DEFAULT_LAW,
                   help="the law fitted (default %(default)s; docs/FORECAST.md compares them)")
    p.add_argument("--max-steps", type=int, help="the full run's steps (default: train.max_steps, or its epochs' "
                                                 "steps); a fraction f runs round(f * this)")
    p.add_argument("--warmup-steps", type=int, help="the full run's warmup steps (default: train.warmup_steps)")
    p.add_argument("--device", help="stage 04's --device (default: the config's)")
    return p


def run(args: argparse.Namespace) -> tuple[dict[str, Any], str, int]:
    r = run_forecast(args.work_dir, target_al=args.target_al, config=args.config, target_model=args.target_model,
                     fractions=parse_fractions(args.fractions), fit_upto=args.fit_upto,
                     law=args.law, max_steps=args.max_steps, warmup_steps=args.warmup_steps, device=args.device)
    return r, format_report(r), (1 if r["chosen"].get("check", {}).get("inside") is False else 0)
