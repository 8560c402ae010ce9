"""Rewarded trajectories (and unrewarded demonstrations) written straight to the database, the way the capture path
writes them, for tests that train without serving traffic first."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from storage.calls import write_calls
from storage.database import Database
from storage.models import Reward
from storage.records import CallRecord

#: Collapse bounds that never stop a run: for tests about something else than the collapse guard.
NO_COLLAPSE_BOUNDS = {
    "min_distinct_ratio": 0.0,
    "min_distinct_share": 0.0,
    "max_empty_share": 1.0,
    "max_repetition": 1.0,
    "min_length_ratio": 0.0,
    "min_entropy_ratio": 0.0,
    "max_kl_to_base": 100.0,
}


@dataclass(frozen=True)
class RewardedReply:
    """One single-call episode: a reply to the group's prompt, its rule reward and what the engine captured."""

    text: str
    reward: float
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None


async def write_rewarded_groups(
    db: Database, policy: str, groups: Sequence[tuple[str, Sequence[RewardedReply]]], reward_name: str
) -> None:
    """One episode per reply; the replies to the i-th prompt share the `group_key` ``task-i``."""
    records, rewards = [], []
    now = time.time()
    for index, (prompt, replies) in enumerate(groups):
        for reply in replies:
            call_id = uuid.uuid4().hex
            records.append(
                CallRecord(
                    id=call_id,
                    episode_id=uuid.uuid4().hex,
                    episode_resolved=True,
                    policy=policy,
                    model=policy,
                    request={"messages": [{"role": "user", "content": prompt}], "params": {}},
                    response={
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text}}]
                    },
                    prompt_token_ids=reply.prompt_token_ids,
                    completion_token_ids=None if reply.token_ids is None else [reply.token_ids],
                    completion_logprobs=[reply.logprobs] if reply.logprobs else None,
                    group_key=f"task-{index}",
                    created_at=now,
                )
            )
            rewards.append(Reward(call_id=call_id, source="rule", name=reward_name, value=reply.reward))
    async with db.session() as session:
        await write_calls(session, records)
        session.add_all(rewards)
        await session.commit()


async def write_demonstrations(
    db: Database, policy: str, conversations: Sequence[tuple[str, str]], source: str
) -> list[str]:
    """One unrewarded single-call episode per (prompt, reply), without token ids (as an import stores them);
    returns the episode ids."""
    records = [
        CallRecord(
            id=uuid.uuid4().hex,
            episode_id=uuid.uuid4().hex,
            episode_resolved=True,
            policy=policy,
            model=policy,
            request={"messages": [{"role": "user", "content": prompt}], "params": {}},
            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]},
            source=source,
            created_at=time.time(),
        )
        for prompt, reply in conversations
    ]
    async with db.session() as session:
        await write_calls(session, records)
    return [r.episode_id for r in records]
