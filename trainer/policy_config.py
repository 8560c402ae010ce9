"""Per-policy reward configuration, stored under the `rewards` key of `policies.config`.

One typed structure with defaults, so a policy without configuration (or feedback for an episode whose policy
has no row) behaves sensibly: thumbs map to 1/0, a few common labels map to numbers, explicit feedback wins
over scorers and the judge, and RULER with the default rubric scores what nobody gave feedback for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec
from msgspec import Struct, field

DEFAULT_RUBRIC = """\
- A trajectory that achieves the user's goal scores higher than one that does not.
- Among trajectories that achieve the goal, prefer the one that is more correct, complete and efficient \
(fewer wasted steps or tool calls, no invented facts).
- A trajectory that fails, refuses without reason, or gives a wrong answer scores low, but one that makes \
real progress scores higher than one that makes none.
- Judge only what the trajectory did, not how long or polite it is.
- Use the whole range from 0 to 1; give similar scores only to trajectories of similar quality."""

# Order in which signal sources win under the `priority` rule (first source with a signal decides).
DEFAULT_PRIORITY = ["feedback", "function", "webhook", "judge"]


class FeedbackConfig(Struct, forbid_unknown_fields=True):
    """How a feedback value becomes a number, and which numbers are accepted."""

    labels: dict[str, float] = field(
        default_factory=lambda: {"good": 1.0, "bad": 0.0, "thumbs_up": 1.0, "thumbs_down": 0.0}
    )
    true_value: float = 1.0  # thumbs up (`true`)
    false_value: float = 0.0  # thumbs down (`false`)
    min_value: float | None = None  # numeric values below are rejected (labels and thumbs are trusted)
    max_value: float | None = None


class RewardRule(Struct, forbid_unknown_fields=True):
    """How an episode's training reward is derived from its signals.

    `priority`: the first source in `priority` that has any signal decides; within it, the latest value of
    each reward name counts and the names are averaged. `weighted`: every term of `weights` (a source such as
    `judge`, or `source:name` such as `feedback:user`) with a signal contributes its latest value times its
    weight; with `normalize` the sum is divided by the weights present (a weighted mean).
    """

    kind: Literal["priority", "weighted"] = "priority"
    priority: list[str] = field(default_factory=lambda: list(DEFAULT_PRIORITY))
    weights: dict[str, float] = field(default_factory=dict)
    normalize: bool = True


class ScorerConfig(Struct, forbid_unknown_fields=True):
    """How trajectories nobody gives feedback for are scored: the first of function, webhook, RULER that is set."""

    function: str | None = None  # `package.module:function`, receives the trajectory dict, returns a number
    webhook_url: str | None = None  # Kaizen POSTs the signed trajectory and reads back {"score": x}
    webhook_timeout_s: float = 30.0
    webhook_retries: int = 2
    min_group_size: int = 2  # RULER compares trajectories: smaller groups wait for more attempts

    @property
    def kind(self) -> Literal["function", "webhook", "judge"]:
        if self.function:
            return "function"
        if self.webhook_url:
            return "webhook"
        return "judge"


class JudgeConfig(Struct, forbid_unknown_fields=True):
    """Per-policy RULER settings; unset fields fall back to the process-wide `KAIZEN_JUDGE_*` settings."""

    rubric: str = DEFAULT_RUBRIC
    model: str | None = None
    api_base: str | None = None


class RewardConfig(Struct, forbid_unknown_fields=True):
    feedback: FeedbackConfig = field(default_factory=FeedbackConfig)
    rule: RewardRule = field(default_factory=RewardRule)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


class InvalidPolicyConfig(ValueError):
    pass


def reward_config(policy_config: Mapping[str, Any] | None) -> RewardConfig:
    """The reward configuration of a policy (defaults when absent); a malformed one is a clear error."""
    raw = (policy_config or {}).get("rewards") or {}
    try:
        return msgspec.convert(raw, RewardConfig)
    except msgspec.ValidationError as exc:
        raise InvalidPolicyConfig(f"invalid `rewards` policy configuration: {exc}") from exc
