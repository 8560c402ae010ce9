"""What the demo measures per cycle of traffic, and the files it leaves behind (`demo.json`, `demo.png`)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.demo.traffic import CallResult
from trainer.control.collapse import distinct_share, empty_share

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Cycle:
    """One batch of live traffic: which version served it and how well it did."""

    cycle: int
    version: int | None  # the version that served most of the cycle's calls
    mean_reward: float
    n_calls: int
    elapsed_s: float  # since the traffic started, at the end of the cycle
    distinct_share: float  # distinct replies, a repeated answer to the same question counted once
    empty_share: float
    errors: int
    versions: dict[str, int] = field(default_factory=dict)  # calls per serving version
    #: Agent tasks: the share of episodes that called the tool, called it rightly, answered from its result.
    tool_call_share: float | None = None
    right_call_share: float | None = None
    answered_from_result_share: float | None = None


def summarise(index: int, calls: Sequence[CallResult]) -> Cycle:
    answered = [c for c in calls if c.error is None]
    counts = Counter(c.version for c in answered)
    replies = [c.reply for c in answered] or [""]
    agent = [c for c in answered if c.called_tool is not None]

    def share(flag: str) -> float | None:
        return round(sum(bool(getattr(c, flag)) for c in agent) / len(agent), 4) if agent else None

    return Cycle(
        tool_call_share=share("called_tool"),
        right_call_share=share("right_call"),
        answered_from_result_share=share("answered_from_result"),
        cycle=index,
        version=counts.most_common(1)[0][0] if counts else None,
        mean_reward=sum(c.reward for c in calls) / len(calls) if calls else 0.0,
        n_calls=len(calls),
        elapsed_s=round(max((c.finished_s for c in calls), default=0.0), 1),
        distinct_share=distinct_share(replies, [c.question for c in answered] or ["-"]),
        empty_share=empty_share(replies),
        errors=len(calls) - len(answered),
        versions={str(v): n for v, n in sorted(counts.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))},
    )


def write_json(path: Path, cycles: Sequence[Cycle], summary: dict[str, Any]) -> None:
    path.write_text(json.dumps({"summary": summary, "cycles": [asdict(c) for c in cycles]}, indent=2) + "\n")


def write_chart(path: Path, cycles: Sequence[Cycle], title: str) -> None:
    """Reward of live traffic over time; each promotion is a vertical line labelled with the new version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [c.elapsed_s / 60 for c in cycles]
    figure, axes = plt.subplots(figsize=(9, 4.5), dpi=120)
    axes.plot(minutes, [c.mean_reward for c in cycles], marker="o", color="tab:blue", label="mean reward")
    axes.plot(minutes, [c.distinct_share for c in cycles], ls=":", color="tab:green", label="distinct share")
    previous = cycles[0].version if cycles else None
    for minute, cycle in zip(minutes, cycles, strict=True):
        if cycle.version != previous:
            axes.axvline(minute, color="tab:gray", ls="--", lw=0.8)
            axes.annotate(f"v{cycle.version}", (minute, 1.02), ha="center", fontsize=8, color="tab:gray")
            previous = cycle.version
    axes.set_ylim(0, 1.08)
    save_chart(figure, axes, path, title, ylabel="per cycle", legend="lower right")


def save_chart(figure: Any, axes: Any, path: Path, title: str, *, ylabel: str, legend: str) -> None:
    """Label a chart of something per cycle over minutes of live traffic, write it as PNG and close it."""
    import matplotlib.pyplot as plt

    axes.set_xlabel("minutes of live traffic")
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(loc=legend)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
