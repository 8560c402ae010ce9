"""The canary's always-valid test: the interval by hand and from its definition, the decisions, and monitored
streams that look after every batch without promoting a candidate at the margin more often than alpha
allows."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from trainer.control.sequential import (
    TAU,
    Decision,
    Interval,
    Sample,
    confidence_sequence,
    confidence_sequence_paired,
    decide,
)

IntervalOf = Callable[[Sample, Sample], Interval | None]
#: Simulated canaries per scenario: enough to judge a promotion share against alpha = 0.1, few enough to be
#: fast.
STREAMS = 300

# n = 50 per arm, means 0.6 / 0.5, variances 0.24 / 0.25, alpha = 0.05, τ = 0.1:
#   d̂ = 0.6 - 0.5                                     = 0.1
#   V = 0.24/50 + 0.25/50 = 0.0048 + 0.005            = 0.0098
#   2 V (V + τ²) / τ² = 2 · 0.0098 · 0.0198 / 0.01    = 0.038808
#   ln(1/alpha) = ln 20                               = 2.995732
#   ½ ln((V + τ²)/V) = ½ ln(0.0198/0.0098) = ½ · 0.703299 = 0.351650
#   half-width = sqrt(0.038808 · 3.347382) = sqrt(0.129905) = 0.360424
#   interval = 0.1 ± 0.360424                         = [-0.2604, 0.4604]
CANDIDATE = Sample(n=50, mean=0.6, variance=0.24)
BASELINE = Sample(n=50, mean=0.5, variance=0.25)


def _mixture_ratio(estimate: float, theta: float, variance: float, tau: float) -> float:
    """Λ(θ) from its definition: the likelihood ratio of d = θ + λ against d = θ given d̂ ~ N(d, V),
    averaged over λ ~ N(0, τ²) by the midpoint rule."""
    step, total = 1e-4, 0.0
    for i in range(-20_000, 20_000):
        lam = (i + 0.5) * step
        ratio = math.exp((2 * lam * (estimate - theta) - lam * lam) / (2 * variance))
        prior = math.exp(-lam * lam / (2 * tau * tau)) / (tau * math.sqrt(2 * math.pi))
        total += ratio * prior * step
    return total


def test_interval_by_hand() -> None:
    interval = confidence_sequence(CANDIDATE, BASELINE, alpha=0.05, tau=0.1)
    assert interval is not None
    assert interval.low == pytest.approx(-0.2604, abs=5e-5)
    assert interval.high == pytest.approx(0.4604, abs=5e-5)
    assert interval.high - 0.1 == pytest.approx(0.360424, abs=1e-6)
    # The ends are where the mixture ratio reaches 1/alpha = 20, and inside it stays below.
    assert _mixture_ratio(0.1, interval.low, 0.0098, 0.1) == pytest.approx(20.0, rel=1e-6)
    assert _mixture_ratio(0.1, interval.high, 0.0098, 0.1) == pytest.approx(20.0, rel=1e-6)
    assert _mixture_ratio(0.1, 0.0, 0.0098, 0.1) < 20.0


def test_paired_interval_is_the_same_interval_on_the_differences() -> None:
    # Paired differences of variance 0.49 over 50 pairs give the same V = 0.0098 as the two arms above.
    paired = confidence_sequence_paired(50, 0.1, 0.49, alpha=0.05, tau=0.1)
    assert paired is not None
    assert paired.low == pytest.approx(-0.2604, abs=5e-5)
    assert paired.high == pytest.approx(0.4604, abs=5e-5)
    assert confidence_sequence_paired(1, 0.1, 0.0, alpha=0.05) is None


def test_no_interval_below_two_rewards_an_arm() -> None:
    assert confidence_sequence(Sample(1, 0.6, 0.0), BASELINE, alpha=0.05) is None
    assert confidence_sequence(CANDIDATE, Sample(0, 0.0, 0.0), alpha=0.05) is None
    assert confidence_sequence(Sample(2, 0.6, 0.0), Sample(2, 0.5, 0.0), alpha=0.05) is not None


def test_zero_variance_gives_a_point_not_a_division_by_zero() -> None:
    ones, zeros = Sample(30, 1.0, 0.0), Sample(30, 0.0, 0.0)
    same = confidence_sequence(ones, ones, alpha=0.05)
    assert same is not None
    assert -1e-5 < same.low < 0.0 < same.high < 1e-5
    assert decide(same, margin=0.05, min_samples_met=True) == "promote"
    worse = confidence_sequence(zeros, ones, alpha=0.05)
    assert worse is not None
    assert worse.high == pytest.approx(-1.0, abs=1e-5)
    assert decide(worse, margin=0.05, min_samples_met=True) == "rollback"
    paired = confidence_sequence_paired(30, 0.0, 0.0, alpha=0.05)
    assert paired is not None
    assert paired.high - paired.low < 2e-5


def test_invalid_alpha_or_tau_is_refused() -> None:
    with pytest.raises(ValueError, match="alpha"):
        confidence_sequence(CANDIDATE, BASELINE, alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        confidence_sequence_paired(50, 0.1, 0.49, alpha=1.0)
    with pytest.raises(ValueError, match="tau"):
        confidence_sequence(CANDIDATE, BASELINE, alpha=0.05, tau=0.0)


def test_interval_shrinks_as_rewards_accrue() -> None:
    widths = []
    for n in (2, 10, 50, 200, 1000, 10_000, 100_000):
        interval = confidence_sequence(Sample(n, 0.6, 0.24), Sample(n, 0.5, 0.25), alpha=0.05)
        assert interval is not None
        assert interval.low < 0.1 < interval.high
        widths.append(interval.high - interval.low)
    assert widths == sorted(widths, reverse=True)
    assert len(set(widths)) == len(widths)
    assert widths[-1] < 0.03


def test_decide_in_each_branch() -> None:
    margin = 0.05
    assert decide(Interval(-0.04, 0.2), margin=margin, min_samples_met=True) == "promote"
    assert decide(Interval(-0.3, -0.06), margin=margin, min_samples_met=True) == "rollback"
    assert decide(Interval(-0.1, 0.1), margin=margin, min_samples_met=True) == "continue"
    # The margin itself is not "at most margin worse with confidence": strict on both ends.
    assert decide(Interval(-0.05, 0.1), margin=margin, min_samples_met=True) == "continue"
    assert decide(Interval(-0.2, -0.05), margin=margin, min_samples_met=True) == "continue"
    assert decide(Interval(-0.04, 0.2), margin=margin, min_samples_met=False) == "continue"
    assert decide(Interval(-0.3, -0.06), margin=margin, min_samples_met=False) == "continue"
    assert decide(None, margin=margin, min_samples_met=True) == "continue"


def _arm(rewards: int, n: int) -> Sample:
    """A Bernoulli arm from its count of rewards 1: the sample variance of n rewards in {0, 1}."""
    mean = rewards / n
    return Sample(n, mean, n / (n - 1) * mean * (1 - mean))


def _fixed_sample(candidate: Sample, baseline: Sample) -> Interval:
    """The 90% z-interval a fixed-sample test would use, wrongly read at every look."""
    estimate = candidate.mean - baseline.mean
    half_width = 1.645 * math.sqrt(candidate.variance / candidate.n + baseline.variance / baseline.n)
    return Interval(estimate - half_width, estimate + half_width)


def _always_valid(candidate: Sample, baseline: Sample) -> Interval | None:
    return confidence_sequence(candidate, baseline, alpha=0.1, tau=TAU)


def _monitor(rng: random.Random, p_candidate: float, p_baseline: float, interval_of: IntervalOf) -> Decision:
    """One canary with margin 0.05: 10 more rewards an arm between looks, up to 2000 an arm, deciding from 30
    an arm on."""
    won_c = won_b = 0
    for n in range(10, 2001, 10):
        won_c += sum(rng.random() < p_candidate for _ in range(10))
        won_b += sum(rng.random() < p_baseline for _ in range(10))
        decision = decide(interval_of(_arm(won_c, n), _arm(won_b, n)), margin=0.05, min_samples_met=n >= 30)
        if decision != "continue":
            return decision
    return "continue"


def _shares(
    p_candidate: float, p_baseline: float, *, seed: int, interval_of: IntervalOf = _always_valid
) -> dict[Decision, float]:
    rng = random.Random(seed)
    outcomes = [_monitor(rng, p_candidate, p_baseline, interval_of) for _ in range(STREAMS)]
    return {d: outcomes.count(d) / STREAMS for d in ("promote", "rollback", "continue")}


def test_a_candidate_at_the_margin_is_rarely_promoted_however_often_it_is_checked() -> None:
    # d = -margin exactly, alpha = 0.1, 200 looks a stream: the bound is alpha/(2 - alpha) = 0.053 (observed:
    # 0.027, and 0.028 over 3000 streams). The fixed-sample interval, one-sided level 0.05 too, promotes 0.26
    # when read at every look: the streams are long enough to tell the two apart.
    assert _shares(0.45, 0.5, seed=7)["promote"] <= 0.1
    assert _shares(0.45, 0.5, seed=7, interval_of=_fixed_sample)["promote"] > 0.2


def test_a_clearly_worse_candidate_is_rolled_back_and_a_better_one_promoted() -> None:
    assert _shares(0.3, 0.6, seed=8)["rollback"] >= 0.98
    assert _shares(0.55, 0.5, seed=9)["promote"] >= 0.9
