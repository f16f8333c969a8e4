"""Figures people can read: round every printed number to the digits that mean something.

Machine files (results.json, manifests, metrics.jsonl) keep full precision; what a
person reads (logs, export_report.md, the model card, the demo summary) goes through
these helpers. The rules:

- a figure with a 95% interval is printed to the interval's precision: the half-width
  to two significant digits when its first digit is 1 or 2 (0.12, 0.026), else one
  (0.07, 0.4), and the value to the same decimal place (1.667 +-0.0712 -> "1.67 ±0.07");
- a figure without an interval keeps `sig` significant digits (default 3:
  1.7722471613414312 -> "1.77", 0.0712 -> "0.0712", 1234.5 -> "1,235");
- counts get thousands separators (142469 -> "142,469");
- a missing or non-finite figure prints as "n/a".

Pure functions, no imports beyond the standard library.
"""
from __future__ import annotations

import math

NA = "n/a"


def _missing(x) -> bool:
    return x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)


def decimals_for(x: float, sig: int) -> int:
    """Decimal places that leave `sig` significant digits in `x` (0 for large numbers)."""
    if x == 0:
        return max(0, sig - 1)
    return max(0, sig - 1 - math.floor(math.log10(abs(x))))


def num(x, sig: int = 3) -> str:
    """`x` to `sig` significant digits (integers above that keep all their digits, with
    thousands separators): 1.7722471613414312 -> "1.77", 0.071234 -> "0.0712", 41.43 -> "41.4"."""
    if _missing(x):
        return NA
    d = decimals_for(float(x), sig)
    # Rounding can carry into a new digit (9.996 -> 10.0): recompute the places from the rounded value.
    r = round(float(x), d)
    d = decimals_for(r, sig) if r != 0 else d
    return f"{r:,.{d}f}"


def fixed(x, decimals: int = 2) -> str:
    """`x` to a fixed number of decimals, for figures on a known scale (a speedup near 1.0x,
    a share in [0, 1]): 0.8 -> "0.80"."""
    if _missing(x):
        return NA
    return f"{float(x):.{decimals}f}"


def count(n) -> str:
    """An integer count with thousands separators: 142469 -> "142,469"."""
    if _missing(n):
        return NA
    return f"{int(round(n)):,}"


def pct(x, sig: int = 3) -> str:
    """A share as a percentage to `sig` significant digits (at most 2 decimals): 0.94812 -> "94.8%"."""
    if _missing(x):
        return NA
    v = 100 * float(x)
    d = min(2, decimals_for(v, sig))
    return f"{v:.{d}f}%"


def interval_decimals(half_width: float) -> int:
    """Decimal places of a 95% interval's half-width: two significant digits when its first
    digit is 1 or 2, else one (the usual convention for uncertainties)."""
    if half_width <= 0:
        return 3
    lead = half_width / 10 ** math.floor(math.log10(half_width))
    return decimals_for(half_width, 2 if lead < 3 else 1)


def with_interval(x, half_width, sig: int = 3) -> str:
    """`x ±half_width`, both to the interval's precision; without one, `num(x, sig)`:
    (1.667, 0.0712) -> "1.67 ±0.07", (2.912, 0.1034) -> "2.91 ±0.10"."""
    if _missing(x):
        return NA
    if _missing(half_width) or half_width <= 0:  # no spread measured (e.g. nothing ever accepted)
        return num(x, sig)
    d = interval_decimals(float(half_width))
    return f"{float(x):.{d}f} ±{float(half_width):.{d}f}"


def with_range(x, lo, hi, sig: int = 3, unit: str = "") -> str:
    """`x [lo, hi]` for an asymmetric 95% interval of a ratio near 1 (a speedup, a break-even),
    rounded to the interval's precision: (1.0712, 0.962, 1.193) -> "1.07x [0.96, 1.19]" with
    unit "x"; without an interval, two decimals."""
    if _missing(x):
        return NA
    if _missing(lo) or _missing(hi):
        return fixed(x, 2) + unit  # a ratio without its interval: hundredths, as a reader compares them
    d = interval_decimals(max(1e-12, (float(hi) - float(lo)) / 2))
    return f"{float(x):.{d}f}{unit} [{float(lo):.{d}f}, {float(hi):.{d}f}]"


def seconds(s) -> str:
    """A duration: "42 s", "3m07s", "1h02m"."""
    if _missing(s):
        return NA
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
