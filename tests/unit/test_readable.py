"""eagle3/core/readable.py: printed figures keep the digits that mean something."""
from __future__ import annotations

from eagle3.core import readable


def test_significant_digits_without_an_interval():
    assert readable.num(1.7722471613414312) == "1.77"  # what export_report.md printed in full
    assert readable.num(0.071234) == "0.0712" and readable.num(41.43) == "41.4"
    assert readable.num(9.996) == "10.0"  # the carry into a new digit keeps 3 significant digits
    assert readable.num(142469.0) == "142,469"
    assert readable.num(None) == "n/a" and readable.num(float("nan")) == "n/a" and readable.num(True) == "n/a"


def test_a_value_takes_the_precision_of_its_interval():
    assert readable.with_interval(1.667, 0.0712) == "1.67 ±0.07"
    assert readable.with_interval(2.912, 0.1034) == "2.91 ±0.10"  # leading 1: two digits of the interval
    assert readable.with_interval(12.3, 3.4) == "12 ±3"
    assert readable.with_interval(1.5, None) == "1.50"
    assert readable.with_range(1.0712, 0.962, 1.193, unit="x") == "1.07x [0.96, 1.19]"
    assert readable.with_range(1.0712, None, None, unit="x") == "1.07x"


def test_counts_shares_and_durations():
    assert readable.count(142469) == "142,469"
    assert readable.pct(0.94812) == "94.8%" and readable.pct(1.0) == "100%" and readable.pct(0.00123) == "0.12%"
    assert readable.seconds(42) == "42 s" and readable.seconds(187) == "3m07s" and readable.seconds(3720) == "1h02m"
