"""Health signals of the calls a version served, and the guards that stop a canary whose health is worse.

The reward decides a canary slowly and only where feedback comes; a broken candidate shows at once in what it
answers. The guards compare, per version over the same window, the shares of failed calls, empty replies,
refusals, looping replies and failed tool calls, and the mean reply length. A guard trips when the candidate's
share exceeds the baseline's by more than its bound even at the low end of a one-sided normal interval:
(p_c - p_b) - z·√(p_c(1-p_c)/n_c + p_b(1-p_b)/n_b) > bound, with z the (1 - alpha) quantile. Repeated looks make
a false trip likelier than alpha; a false trip is a rollback, the safe side. Refusals are recognised by the
`refusal` field of a reply or its opening words ("I'm sorry", "I can't", "As an AI" …): a heuristic for open
models, which do not fill the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from statistics import NormalDist
from typing import Any

from trainer.control.collapse import repetition

_REFUSAL = re.compile(
    r"^\W*(i'?m sorry|i am sorry|sorry, (?:but )?i|i can(?:'|no)t|i cannot|i won'?t|i'?m (?:not able|unable)|"
    r"i am (?:not able|unable)|as an ai)",
    re.IGNORECASE,
)


def is_refusal(message: dict[str, Any]) -> bool:
    if message.get("refusal"):
        return True
    content = message.get("content")
    return isinstance(content, str) and bool(_REFUSAL.match(content[:120]))


@dataclass(frozen=True)
class ServedCall:
    """What the guards read of one call: whether it was answered, and the first choice's message."""

    ok: bool
    message: dict[str, Any] | None


@dataclass(frozen=True)
class LiveHealth:
    """One version's calls over a window. Shares are of answered calls, except `error_share` (of all calls)."""

    calls: int
    answered: int
    error_share: float
    empty_share: float
    refusal_share: float
    repetition: float
    mean_length: float
    tool_calls: int
    tool_error_share: float

    @classmethod
    def of(cls, calls: Sequence[ServedCall], tool_errors: Iterable[bool] = ()) -> LiveHealth:
        answered = [c.message or {} for c in calls if c.ok]
        texts = [_text(m) for m in answered]
        empty = sum(
            1 for m, t in zip(answered, texts, strict=True) if not t.strip() and not m.get("tool_calls")
        )
        tools = list(tool_errors)
        return cls(
            calls=len(calls),
            answered=len(answered),
            error_share=_share(len(calls) - len(answered), len(calls)),
            empty_share=_share(empty, len(answered)),
            refusal_share=_share(sum(1 for m in answered if is_refusal(m)), len(answered)),
            repetition=repetition(texts) if texts else 0.0,
            mean_length=sum(len(t) for t in texts) / len(texts) if texts else 0.0,
            tool_calls=len(tools),
            tool_error_share=_share(sum(tools), len(tools)),
        )


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _share(count: int, total: int) -> float:
    return count / total if total else 0.0


@dataclass(frozen=True)
class HealthBounds:
    """How much worse than the baseline's each signal of the candidate may be before the canary rolls back."""

    error_share: float = 0.05
    empty_share: float = 0.1
    refusal_share: float = 0.1
    repetition: float = 0.15
    tool_error_share: float = 0.1
    #: The candidate's mean reply length may fall to this fraction of the baseline's, no lower.
    length_ratio: float = 0.3


HEALTH_BOUND_NAMES = frozenset(f.name for f in fields(HealthBounds))

#: (signal, the count its share is of) for the guards on shares.
_SHARES = (
    ("error_share", "calls"),
    ("empty_share", "answered"),
    ("refusal_share", "answered"),
    ("repetition", "answered"),
    ("tool_error_share", "tool_calls"),
)


def health_problems(
    candidate: LiveHealth, baseline: LiveHealth, bounds: HealthBounds, *, alpha: float, min_calls: int
) -> list[str]:
    """The guards the candidate trips against the baseline; none until both served `min_calls` calls."""
    if candidate.calls < min_calls or baseline.calls < min_calls:
        return []
    z = NormalDist().inv_cdf(1 - alpha)
    problems = []
    for name, of in _SHARES:
        n_c, n_b = getattr(candidate, of), getattr(baseline, of)
        if n_c == 0 or n_b == 0:
            continue
        p_c, p_b = getattr(candidate, name), getattr(baseline, name)
        bound = getattr(bounds, name)
        # p_c, p_b in [0, 1]; `repetition` is a mean of per-reply shares, treated as one.
        low = (p_c - p_b) - z * math.sqrt(p_c * (1 - p_c) / n_c + p_b * (1 - p_b) / n_b)
        if low > bound:
            problems.append(f"{name} {p_c:.3f} vs {p_b:.3f} (more by over {bound:g})")
    if baseline.mean_length > 0 and candidate.answered and baseline.answered:
        ratio = candidate.mean_length / baseline.mean_length
        if ratio < bounds.length_ratio:
            problems.append(
                f"mean_length {candidate.mean_length:.1f} vs {baseline.mean_length:.1f} "
                f"(below {bounds.length_ratio:g} of it)"
            )
    return problems
