"""Mode-collapse signals over sampled replies, and bounds that stop a run before it ships a broken adapter.

Measured on our machine: GRPO on format rewards collapsed within minutes to one constant reply,
to empty replies, or to short nonsense; at lr 1e-3 it collapsed within 5 steps. Rewards can keep
rising while this happens (a constant reply that satisfies the format scores well), so the
trainer measures these signals on held-out samples and treats any violated bound as a failed run.

Two kinds of bound. *Health* bounds (distinct share, empty share, repetition) describe replies that are
broken whatever the task asks: the same reply to different contexts, nothing, a loop. *Movement* bounds
(length and entropy against the baseline, KL to the version the run started from or to the base model)
describe how far the policy moved; moving far is what a reward that asks for terse, sure answers should
cause, so a movement bound is waived when the same replies earned a higher reward than the baseline's and
pass every health bound (`backed_by_reward`). Without reward evidence every bound applies.
"""

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

#: Word n-gram size for ``repetition``: trigrams catch loops ("ok ok ok", repeated sentences)
#: without flagging ordinary reuse of common word pairs.
REPETITION_NGRAM = 3

_WHITESPACE = re.compile(r"\s+")


def _normalise(reply: str) -> str:
    return _WHITESPACE.sub(" ", reply).strip()


def _require(replies: Sequence[str]) -> None:
    if not replies:
        raise ValueError("collapse signals need at least one reply")


def distinct_share(replies: Sequence[str], contexts: Sequence[object] | None = None) -> float:
    """Distinct replies / replies, after collapsing whitespace. 1/n means one constant reply.

    With `contexts` (what each reply answers, e.g. its prompt), repeats of one reply to the same context count
    once: a model that is sure of each answer has not collapsed; one that gives the same reply to different
    questions has.
    """
    _require(replies)
    keys = contexts if contexts is not None else range(len(replies))
    if len(keys) != len(replies):
        raise ValueError("one context per reply")
    answers = {(key, _normalise(reply)) for key, reply in zip(keys, replies, strict=True)}
    return len({reply for _, reply in answers}) / len(answers)


def empty_share(replies: Sequence[str]) -> float:
    """Share of replies that are empty or whitespace only."""
    _require(replies)
    return sum(1 for r in replies if not r.strip()) / len(replies)


def mean_length(replies: Sequence[str]) -> float:
    """Mean reply length in characters; a sharp drop is the 'short nonsense' failure."""
    _require(replies)
    return sum(len(r) for r in replies) / len(replies)


def repetition(replies: Sequence[str], n: int = REPETITION_NGRAM) -> float:
    """Mean, over replies with at least one word n-gram, of the share of n-grams that repeat within it.

    A reply's score is ``1 - distinct n-grams / n-grams``: 0 for text without repeats, close to 1
    for a reply that loops on one phrase. Replies shorter than n words have no n-grams and are
    left out (empty and short replies are caught by the other signals); 0 if none qualify.
    """
    _require(replies)
    scores = []
    for reply in replies:
        words = reply.split()
        grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        if grams:
            scores.append(1.0 - len(set(grams)) / len(grams))
    return sum(scores) / len(scores) if scores else 0.0


@dataclass(frozen=True)
class CollapseSignals:
    """Signals of one sample set; entropy, KL and reward are present when the caller computed them."""

    count: int
    distinct_share: float
    empty_share: float
    mean_length: float
    repetition: float
    #: Mean per-token entropy (nats) of the policy on its sampled replies.
    mean_entropy: float | None = None
    #: Mean per-token KL to the base model (adapter disabled), nats.
    kl_to_base: float | None = None
    #: Mean per-token KL to the version the run started from, nats: how far this run alone moved.
    kl_to_start: float | None = None
    #: Mean reward of these replies by the policy's scorer.
    reward: float | None = None


def measure(
    replies: Sequence[str],
    token_entropies: Sequence[float] | None = None,
    kl_to_base: float | None = None,
    contexts: Sequence[object] | None = None,
    *,
    kl_to_start: float | None = None,
    rewards: Sequence[float] | None = None,
) -> CollapseSignals:
    """Compute every signal for one set of sampled replies (`rewards`: the scores of those that were scored)."""
    _require(replies)
    entropy = None
    if token_entropies is not None and len(token_entropies) > 0:
        entropy = math.fsum(token_entropies) / len(token_entropies)
    return CollapseSignals(
        count=len(replies),
        distinct_share=distinct_share(replies, contexts),
        empty_share=empty_share(replies),
        mean_length=mean_length(replies),
        repetition=repetition(replies),
        mean_entropy=entropy,
        kl_to_base=kl_to_base,
        kl_to_start=kl_to_start,
        reward=math.fsum(rewards) / len(rewards) if rewards else None,
    )


@dataclass(frozen=True)
class CollapseBounds:
    """Limits a candidate adapter's samples must respect; ratios compare against the baseline (the version the
    run started from, or the active version at the gate)."""

    # --- health: always enforced
    #: Distinct share must stay ≥ this fraction of the baseline's: halving diversity on the same
    #: prompts is already the road to one constant reply.
    min_distinct_ratio: float = 0.5
    #: Absolute floor used with or without a baseline; a set that is 3/4 duplicates has collapsed.
    min_distinct_share: float = 0.25
    #: More than 1 in 20 replies empty is a failure users notice.
    max_empty_share: float = 0.05
    #: Trigram repeat share above one half means replies loop.
    max_repetition: float = 0.5

    # --- movement: waived when the reward backs the move (`backed_by_reward`)
    #: Mean length must stay ≥ this fraction of the baseline's (the 'short nonsense' collapse).
    min_length_ratio: float = 0.3
    #: Entropy must stay ≥ this fraction of the baseline's; near-zero entropy means a deterministic policy.
    min_entropy_ratio: float = 0.2
    #: Mean per-token KL to the version the run started from, nats: one run rewriting the model's language
    #: rather than nudging its choices. Per run, so a policy may travel far from the base in steps that each
    #: passed the gate.
    max_kl_to_start: float = 0.5
    #: Mean per-token KL to the base model, nats; off by default: a cap on the total distance freezes a
    #: policy that keeps improving (measured: the demo stopped at its fifth version under 0.3).
    max_kl_to_base: float = math.inf
    #: How much higher than the baseline's the replies' mean reward must be to waive the movement bounds.
    min_reward_gain: float = 0.05


def health_problems(
    signals: CollapseSignals, bounds: CollapseBounds, baseline: CollapseSignals | None = None
) -> list[str]:
    """Violated health bounds: replies that are the same across contexts, empty, or looping."""
    problems: list[str] = []
    if signals.distinct_share < bounds.min_distinct_share:
        problems.append(
            f"distinct_share {signals.distinct_share:.3f} < floor {bounds.min_distinct_share:.3f} "
            f"({signals.count} replies)"
        )
    if signals.empty_share > bounds.max_empty_share:
        problems.append(f"empty_share {signals.empty_share:.3f} > {bounds.max_empty_share:.3f}")
    if signals.repetition > bounds.max_repetition:
        problems.append(f"repetition {signals.repetition:.3f} > {bounds.max_repetition:.3f}")
    if baseline is not None:
        problems += _below(
            "distinct_share",
            signals.distinct_share,
            bounds.min_distinct_ratio,
            baseline.distinct_share,
            "",
            3,
        )
    return problems


def movement_problems(
    signals: CollapseSignals, bounds: CollapseBounds, baseline: CollapseSignals | None = None
) -> list[str]:
    """Violated movement bounds: the policy became much shorter or surer, or moved far in KL."""
    problems: list[str] = []
    if signals.kl_to_start is not None and signals.kl_to_start > bounds.max_kl_to_start:
        problems.append(f"kl_to_start {signals.kl_to_start:.4f} > {bounds.max_kl_to_start:.4f} nats/token")
    if signals.kl_to_base is not None and signals.kl_to_base > bounds.max_kl_to_base:
        problems.append(f"kl_to_base {signals.kl_to_base:.4f} > {bounds.max_kl_to_base:.4f} nats/token")
    if baseline is None:
        return problems
    problems += _below(
        "mean_length", signals.mean_length, bounds.min_length_ratio, baseline.mean_length, " chars", 1
    )
    if signals.mean_entropy is not None and baseline.mean_entropy is not None:
        problems += _below(
            "mean_entropy", signals.mean_entropy, bounds.min_entropy_ratio, baseline.mean_entropy, " nats", 3
        )
    return problems


def _below(name: str, value: float, ratio: float, baseline: float, unit: str, digits: int) -> list[str]:
    """The problem line when `value` fell below `ratio` times the baseline's, else nothing."""
    limit = ratio * baseline
    if value >= limit:
        return []
    return [
        f"{name} {value:.{digits}f} < {limit:.{digits}f}{unit} ({ratio} × baseline {baseline:.{digits}f})"
    ]


def backed_by_reward(
    signals: CollapseSignals, bounds: CollapseBounds, baseline: CollapseSignals | None
) -> bool:
    """The replies earned at least `min_reward_gain` more than the baseline's and are healthy: the reward asked
    for the move. A reward that rises on empty, constant or looping replies is being gamed, not backing."""
    if baseline is None or signals.reward is None or baseline.reward is None:
        return False
    if health_problems(signals, bounds, baseline):
        return False
    return signals.reward >= baseline.reward + bounds.min_reward_gain


def check(
    signals: CollapseSignals, bounds: CollapseBounds, baseline: CollapseSignals | None = None
) -> list[str]:
    """Return one human-readable line per violated bound; an empty list means no collapse detected."""
    if backed_by_reward(signals, bounds, baseline):
        return []
    return health_problems(signals, bounds, baseline) + movement_problems(signals, bounds, baseline)
