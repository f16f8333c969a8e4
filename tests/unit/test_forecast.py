"""The data forecast: the fitted laws on synthetic points (the subcommand on the tiny Llama:
tests/stages/test_forecast_run.py)."""
import math
import random

import pytest

from eagle3.core.errors import PipelineError
from eagle3.tools.forecast import (LAWS, Point, build_report, fit_law, format_report, fraction_budget, parse_fractions,
                                   per_position_acceptance, t_quantile_two_sided)

K = 3
TOKENS = [4_000, 8_000, 16_000, 32_000, 64_000, 128_000]
# (a, b) of each law that put AL between about 1.3 and 2.2 over TOKENS
TRUE = {"log": (-0.8, 0.2), "ceiling": (-2.4, 0.15), "per-position": (-4.0, 0.35)}


def synthetic(law: str, tokens=TOKENS, noise: float = 0.0, rng: random.Random | None = None) -> list[float]:
    """Held-out AL on the law's curve, plus Gaussian noise of std `noise` in g's units."""
    a, b = TRUE[law]
    return [LAWS[law].g_inv(a + b * math.log(D) + (rng.gauss(0, noise) if noise else 0.0), K) for D in tokens]


@pytest.mark.parametrize("dof,t", [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (10, 2.228), (30, 2.042),
                                   (1000, 1.962)])
def test_t_quantile_matches_the_tables(dof, t):
    assert t_quantile_two_sided(0.95, dof) == pytest.approx(t, abs=1e-3)


def test_per_position_acceptance_inverts_the_chain_sum():
    for p in (0.05, 0.4, 0.9):
        assert per_position_acceptance(1 + p + p * p + p ** 3, 3) == pytest.approx(p, abs=1e-12)


@pytest.mark.parametrize("law", list(LAWS))
def test_fit_recovers_known_parameters(law):
    exact = fit_law(law, TOKENS, synthetic(law), K)
    assert (exact.a, exact.b) == pytest.approx(TRUE[law], abs=1e-9)
    assert exact.s == pytest.approx(0.0, abs=1e-9)
    noisy = fit_law(law, TOKENS, synthetic(law, noise=0.01, rng=random.Random(3)), K)
    # within 3 standard errors of the truth, and the standard errors are of the noise's size
    assert abs(noisy.a - TRUE[law][0]) < 3 * noisy.se_a and abs(noisy.b - TRUE[law][1]) < 3 * noisy.se_b
    assert 0.003 < noisy.s < 0.03
    assert noisy.dof == len(TOKENS) - 2 and noisy.t == pytest.approx(2.776, abs=1e-3)


@pytest.mark.parametrize("law", ["log", "ceiling"])
def test_prediction_interval_covers_95_percent_of_new_runs(law):
    """Fit 4 noisy points, predict a 5th at twice the largest D: its 95% prediction
    interval must hold the new point in about 95% of 2,000 seeded repetitions."""
    rng, fit_at, new_at, n, hits = random.Random(0), TOKENS[:4], 2 * TOKENS[3], 2000, 0
    for _ in range(n):
        fit = fit_law(law, fit_at, synthetic(law, fit_at, noise=0.02, rng=rng), K)
        new = synthetic(law, [new_at], noise=0.02, rng=rng)[0]
        p = fit.predict(new_at)
        hits += p.lo <= new <= p.hi
    assert 0.93 <= hits / n <= 0.97  # binomial sd of the share: 0.005


def test_tokens_interval_covers_95_percent_of_new_runs():
    """Inverse prediction: from a new run's AL at known D, the interval of tokens that
    reach that AL holds D in about 95% of repetitions."""
    rng, n, hits = random.Random(1), 2000, 0
    D = TOKENS[4]
    for _ in range(n):
        fit = fit_law("log", TOKENS[:4], synthetic("log", TOKENS[:4], noise=0.02, rng=rng), K)
        new = synthetic("log", [D], noise=0.02, rng=rng)[0]
        r = fit.tokens_for(new)
        hits += r.reachable and r.lo <= D <= r.hi
    assert 0.93 <= hits / n <= 0.97


@pytest.mark.parametrize("law", list(LAWS))
def test_tokens_to_reach_a_target_invert_the_law(law):
    fit = fit_law(law, TOKENS, synthetic(law, noise=0.01, rng=random.Random(5)), K)
    target = 2.46
    r = fit.tokens_for(target)
    assert r.reachable and r.lo < r.tokens < r.hi
    assert fit.predict(r.tokens).al == pytest.approx(target, abs=1e-9)
    # the interval's ends are where the 95% prediction band meets the target
    assert fit.predict(r.lo).hi == pytest.approx(target, abs=1e-6)
    assert fit.predict(r.hi).lo == pytest.approx(target, abs=1e-6)


@pytest.mark.parametrize("law", list(LAWS))
def test_target_at_or_beyond_saturation_is_unreachable(law):
    fit = fit_law(law, TOKENS, synthetic(law, noise=0.01, rng=random.Random(2)), K)
    for target in (K + 1, K + 1.5):
        r = fit.tokens_for(target)
        assert not r.reachable and r.tokens is None and "K + 1 = 4" in r.why
    report = build_report([Point(f, 10, D, 1, 1, al, 1) for f, D, al in
                           zip((0.1, 0.2, 0.3, 0.4, 0.5, 1.0), TOKENS, synthetic(law))],
                          target_al=4.2, K=K, law=law, tokens_per_conversation=100.0)
    assert "AL 4.2: not reachable under this law" in format_report(report)


def test_falling_acceptance_is_unreachable_and_two_points_have_unknown_uncertainty():
    falling = fit_law("log", TOKENS[:3], [1.6, 1.5, 1.4], K)
    assert falling.b < 0 and not falling.tokens_for(2.0).reachable
    two = fit_law("per-position", TOKENS[:2], synthetic("per-position", TOKENS[:2]), K)
    assert two.s is None and two.predict(TOKENS[3]).lo is None
    r = two.tokens_for(2.46)
    assert r.reachable and r.lo is None and "uncertainty unknown" in r.why


def test_a_flat_fit_gives_an_unbounded_interval():
    # a slope well inside its noise: the band never leaves the target on the far side
    fit = fit_law("log", TOKENS[:4], [1.40, 1.45, 1.39, 1.46], K)
    r = fit.tokens_for(1.6)
    assert r.reachable and r.hi == math.inf and "not significant" in r.why


def test_a_far_extrapolation_saturates_at_infinity_instead_of_raising():
    fit = fit_law("log", TOKENS[:3], [1.4000, 1.4001, 1.4002], K)  # ~1e-4 AL per doubling
    r = fit.tokens_for(2.46)
    assert r.reachable and r.tokens == math.inf


def test_points_outside_a_laws_range_are_refused_with_the_value():
    with pytest.raises(PipelineError, match="1.0000"):
        fit_law("per-position", TOKENS[:3], [1.0, 1.1, 1.2], K)
    with pytest.raises(PipelineError, match="same training tokens"):
        fit_law("log", [100, 100], [1.1, 1.2], K)


def test_check_predicts_the_largest_fraction_from_the_smaller_ones():
    fractions = (0.125, 0.25, 0.5, 1.0)
    tokens = [16_000, 32_000, 64_000, 128_000]
    al = synthetic("per-position", tokens, noise=0.01, rng=random.Random(7))
    pts = [Point(f, int(D / 100), D, 10, 2, v, 10) for f, D, v in zip(fractions, tokens, al)]
    r = build_report(pts, target_al=2.46, K=K, tokens_per_conversation=100.0)
    c = r["chosen"]["check"]
    assert c["ran"] and c["fractions"] == [0.125, 0.25, 0.5] and c["predicted_tokens"] == 128_000
    assert c["measured_al"] == pytest.approx(al[3]) and c["lo"] < c["predicted_al"] < c["hi"]
    assert r["chosen"]["fit"]["points"] == 4  # the forecast itself uses every point
    reach = r["chosen"]["reach"]
    assert reach["conversations"] == pytest.approx(reach["tokens"] / 100.0)
    assert reach["times_this_data"] == pytest.approx(reach["tokens"] / 128_000)


def test_budget_and_fraction_parsing():
    assert fraction_budget(0.125, 150, 20) == (19, 2)
    assert fraction_budget(0.01, 40, 5) == (1, 1)  # at least one step of each
    assert parse_fractions("1/8, 0.25,0.5,1,0.5") == [0.125, 0.25, 0.5, 1.0]
    for bad in ("0,0.5", "0.5", "0.5,1.5", "a,1"):
        with pytest.raises(PipelineError):
            parse_fractions(bad)
