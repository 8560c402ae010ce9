"""The canary's statistical test: is a candidate version no worse than the active one, as rewards arrive?

The decision is taken again whenever new rewards arrive. A fixed-sample test read that way is peeked at: each
look is another chance of a false promotion, and over an unbounded canary one becomes certain. So the test is
always valid: the normal mixture sequential probability ratio test (mSPRT; Johari, Pekelis and Walsh,
"Always valid inference"), read as a confidence sequence for d = mean_candidate - mean_baseline, an interval
that covers d at every look at once with probability at least 1 - alpha.

The model. Each arm's mean reward is normal (central limit theorem) with its sample variance taken as known,
so d̂ ~ N(d, V) with V = var_c/n_c + var_b/n_b (paired shadow replies: V = var_diff/n). Against a hypothesised
d = θ, the likelihood ratio of θ + λ is exp(λS - λ²I/2) with S = (d̂ - θ)/V and I = 1/V, a martingale of mean
1 when d = θ. Mixed over λ ~ N(0, τ²) it is

    Λ(θ) = sqrt(V / (V + τ²)) · exp(τ² (d̂ - θ)² / (2 V (V + τ²))),

still a mean-1 martingale, so by Ville's inequality P(Λ(d) ≥ 1/alpha at any look, ever) ≤ alpha. The interval
is the θ with Λ(θ) < 1/alpha:

    d̂ ± sqrt((2 V (V + τ²) / τ²) · (ln(1/alpha) + ½ ln((V + τ²) / V))).

The one-sided guarantee. A candidate is promoted when the interval's low end passes -margin. If its true d is
at most -margin, that needs d̂ - d above the half-width: S ≥ 0 and Λ(d) ≥ 1/alpha at some look. Split the
prior into its halves, Λ = ½Λ₊ + ½Λ₋ (λ > 0 and λ < 0, each renormalised), each a mean-1 martingale. With
S ≥ 0 every term of Λ₋ is at most 1, so Λ₊ = 2Λ - Λ₋ ≥ 2/alpha - 1, and Ville's inequality on Λ₊ bounds the
chance of a false promotion, over the whole monitoring however long it runs, by alpha/(2 - alpha): alpha/2 to
first order (0.0256 for alpha = 0.05). A rollback of a candidate whose d is at least -margin is bounded the
same way. The bound holds exactly for normal means of known variance and asymptotically otherwise (with the
arms growing in a roughly fixed ratio, as a canary share does); rewards are bounded, so it is reasonable once
each arm has a few dozen episodes, which `decide`'s ``min_samples_met`` waits for.

The choice of τ. τ is the size of difference the test is tuned to resolve: for a given V the interval is
narrowest when τ² ≈ 8 V (alpha = 0.05), where it is about 1.5 times the fixed-sample interval. A larger τ
makes it narrower early and wider late, a smaller one the reverse; it stays valid either way, as long as τ is
fixed before the data are seen. `TAU` = 0.1 suits rewards in [0, 1]: with reward variances near 0.25, the
interval is narrowest around 400 episodes per arm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

#: The mixing prior's standard deviation for rewards in [0, 1] (see the module docstring).
TAU = 0.1
#: Lower bound on V: arms whose rewards are all equal have zero sample variance, and V = 0 would divide by
#: zero. The interval then shrinks to d̂ ± about 5e-6; `decide`'s ``min_samples_met`` is what keeps a few
#: identical early rewards from deciding.
VARIANCE_FLOOR = 1e-12

Decision = Literal["promote", "rollback", "continue"]


@dataclass(frozen=True)
class Sample:
    """One arm's rewards, summarised: their count, mean and sample variance (n - 1; 0.0 when n < 2)."""

    n: int
    mean: float
    variance: float


@dataclass(frozen=True)
class Interval:
    low: float
    high: float


def confidence_sequence(
    candidate: Sample, baseline: Sample, *, alpha: float, tau: float = TAU
) -> Interval | None:
    """The always-valid (1 - alpha) interval for mean_candidate - mean_baseline; None while an arm has under
    two rewards (no variance yet)."""
    if candidate.n < 2 or baseline.n < 2:
        return None
    variance = candidate.variance / candidate.n + baseline.variance / baseline.n
    return _interval(candidate.mean - baseline.mean, variance, alpha, tau)


def confidence_sequence_paired(
    n: int, mean_diff: float, variance_diff: float, *, alpha: float, tau: float = TAU
) -> Interval | None:
    """The same interval for paired differences (candidate minus active on the same request, as shadow pairs
    are): V = variance_diff / n. None under two pairs."""
    if n < 2:
        return None
    return _interval(mean_diff, variance_diff / n, alpha, tau)


def _interval(estimate: float, variance: float, alpha: float, tau: float) -> Interval:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if not tau > 0.0:
        raise ValueError(f"tau must be positive, got {tau}")
    # V, floored (see VARIANCE_FLOOR)
    v = max(variance, VARIANCE_FLOOR)
    t2 = tau * tau
    # ln(1/alpha) + ½ ln((V + τ²) / V)
    threshold = math.log(1.0 / alpha) + 0.5 * math.log((v + t2) / v)
    # sqrt((2 V (V + τ²) / τ²) · threshold)
    half_width = math.sqrt(2.0 * v * (v + t2) / t2 * threshold)
    return Interval(estimate - half_width, estimate + half_width)


def decide(interval: Interval | None, *, margin: float, min_samples_met: bool) -> Decision:
    """Promote once the candidate is, with confidence, at most ``margin`` worse than the active version; roll
    back once it is, with confidence, worse by more; otherwise keep watching."""
    if not min_samples_met or interval is None:
        return "continue"
    if interval.low > -margin:
        return "promote"
    if interval.high < -margin:
        return "rollback"
    return "continue"
