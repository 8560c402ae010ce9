"""Synthetic captured traffic for the dashboard's benchmark and query tests: calls over 30 days in episodes
of three policies with six versions each, rewards on half the episodes, judge groups, training runs and
promotions, bulk-loaded with the drivers' fastest paths (sqlite3 `executemany`, PostgreSQL `COPY`)."""

from __future__ import annotations

import random
import sqlite3
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import msgspec

from migrations.runner import upgrade_database

POLICIES = ("support", "triage", "search")
VERSIONS = 6
DAYS = 30
WORDS = [
    "refund",
    "invoice",
    "password",
    "delivery",
    "upgrade",
    "cancel",
    "warranty",
    "address",
    "coupon",
    "login",
]


def _chunks(rows: Iterator[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    batch: list[dict[str, Any]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class Traffic:
    """Deterministic synthetic data: which episode each call belongs to, when, and what it says."""

    def __init__(self, calls: int, now: datetime, seed: int = 0) -> None:
        self.calls = calls
        self.start = now - timedelta(days=DAYS)
        self.span = timedelta(days=DAYS).total_seconds()
        self.random = random.Random(seed)
        self.episodes: list[
            tuple[str, str, datetime, int, float | None, str]
        ] = []  # id, policy, at, n, reward, src

    def at(self, index: int) -> datetime:
        return self.start + timedelta(seconds=self.span * index / self.calls)

    def version(self, at: datetime) -> int:
        return min(VERSIONS - 1, int((at - self.start).total_seconds() / self.span * VERSIONS))

    def plan(self) -> None:
        """Cut the calls into episodes (1 to 3 calls each), each with its policy, start, reward and source."""
        rnd = self.random
        index = number = 0
        while index < self.calls:
            length = min(rnd.choice((1, 1, 2, 3)), self.calls - index)
            created = self.at(index)
            rewarded = rnd.random() < 0.5
            mean = 0.3 + 0.1 * self.version(created)
            reward = min(1.0, max(0.0, rnd.gauss(mean, 0.2))) if rewarded else None
            source = "import" if number % 100 == 0 else "traffic"
            self.episodes.append(
                (f"ep{number:08d}", POLICIES[number % len(POLICIES)], created, length, reward, source)
            )
            index += length
            number += 1

    def call_rows(self) -> Iterator[dict[str, Any]]:
        rnd = self.random
        index = 0
        for number, (episode, policy, created, length, _, _) in enumerate(self.episodes):
            version = self.version(created)
            word = WORDS[number % len(WORDS)]
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": f"You are the {policy} assistant."},
                {
                    "role": "user",
                    "content": f"customer {number} asks about {word} for order {number * 7 % 9973}",
                },
            ]
            for position in range(length):
                reply = {
                    "role": "assistant",
                    "content": f"about your {word}: step {position} for order {number}",
                }
                status = "error" if rnd.random() < 0.02 else "ok"
                prompt, completion = rnd.randint(20, 400), rnd.randint(5, 300)
                yield {
                    "id": f"c{index:09d}",
                    "client_request_id": None,
                    "episode_id": episode,
                    "position": position,
                    "policy": policy,
                    "model": policy,
                    "adapter_version": version,
                    "engine_model": f"{policy}@{version}",
                    "stream": False,
                    "request": {"messages": list(messages), "tools": None, "tool_choice": None, "params": {}},
                    "response": None
                    if status == "error"
                    else {
                        "id": f"chatcmpl-{index}",
                        "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}],
                    },
                    "usage": {"prompt_tokens": prompt, "completion_tokens": completion},
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "latency_ms": rnd.uniform(50, 2000),
                    "ttft_ms": None,
                    "status": status,
                    "error": {"message": "engine error"} if status == "error" else None,
                    "context_hash": f"{number % 5000:032x}",
                    "created_at": self.at(index),
                }
                messages = [*messages, reply, {"role": "user", "content": f"and then {position}?"}]
                index += 1

    def episode_rows(self) -> Iterator[dict[str, Any]]:
        for episode, policy, created, _, reward, source in self.episodes:
            yield {
                "id": episode,
                "policy": policy,
                "project": "default",
                "source": source,
                "metadata": {},
                "tags": [],
                "reward": reward,
                "reward_provenance": {"rule": "priority"} if reward is not None else None,
                "created_at": created,
                "updated_at": created,
            }

    def reward_rows(self) -> Iterator[dict[str, Any]]:
        for number, (episode, _, created, _, reward, _) in enumerate(self.episodes):
            if reward is None:
                continue
            source = "feedback" if number % 5 == 0 else "judge"
            yield {
                "episode_id": episode,
                "call_id": None,
                "source": source,
                "name": "user" if source == "feedback" else "ruler",
                "value": reward,
                "comment": None if source == "feedback" else "the reply answers the question",
                "metadata": {},
                "status": "linked",
                "created_at": created + timedelta(minutes=5),
            }

    def judge_rows(self, groups: int) -> Iterator[dict[str, Any]]:
        for number in range(groups):
            at = self.start + timedelta(seconds=self.span * number / groups)
            failed = number % 20 == 0
            yield {
                "policy": POLICIES[number % len(POLICIES)],
                "group_key": f"prompt:{number:032x}",
                "episode_ids": [f"ep{number:08d}"],
                "scorer": "judge",
                "model": "judge-model",
                "status": "failed" if failed else "judged",
                "attempts": 3 if failed else 1,
                "error": "timed out" if failed else None,
                "latency_ms": 800.0,
                "cost_usd": None if failed else 0.0004,
                "created_at": at,
            }


def _stored(value: Any, sqlite: bool) -> Any:
    """A value as the bulk loader hands it to the driver: JSON as text, SQLite timestamps as SQLAlchemy writes them."""
    if isinstance(value, dict | list):
        return msgspec.json.encode(value).decode()
    if sqlite and isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    if sqlite and isinstance(value, bool):
        return int(value)
    return value


def _table_rows(traffic: Traffic) -> Iterator[tuple[str, Iterator[dict[str, Any]]]]:
    now = traffic.start + timedelta(days=DAYS)
    yield "episodes", traffic.episode_rows()
    yield "calls", traffic.call_rows()
    yield "rewards", traffic.reward_rows()
    yield "judge_groups", traffic.judge_rows(20_000)
    yield (
        "policies",
        iter(
            {
                "id": n + 1,
                "name": p,
                "base_model": "base",
                "active_version": VERSIONS - 1,
                "config": {},
                "created_at": now,
            }
            for n, p in enumerate(POLICIES)
        ),
    )
    runs, audit = [], []
    for n, policy in enumerate(POLICIES):
        for version in range(1, VERSIONS):
            at = traffic.start + timedelta(days=DAYS * version / VERSIONS)
            gate = {
                "decision": "promote",
                "candidate_version": version,
                "candidate_reward": 0.4,
                "active_reward": 0.3,
            }
            runs.append(
                {
                    "policy_id": n + 1,
                    "kind": "train",
                    "status": "succeeded",
                    "from_version": version - 1,
                    "to_version": version,
                    "config": {},
                    "metrics": {"reward_mean": 0.3 + 0.05 * version, "loss": 0.1, "gate": gate},
                    "error": None,
                    "started_at": at - timedelta(minutes=20),
                    "finished_at": at,
                }
            )
            audit.append(
                {
                    "at": at,
                    "actor": "admin-key",
                    "action": "policy.promote",
                    "target": policy,
                    "details": {"version": version},
                }
            )
    yield "training_runs", iter(runs)
    yield "audit", iter(audit)


async def load(url: str, calls: int) -> dict[str, Any]:
    """Fill a migrated database with `calls` synthetic calls and everything around them; returns counts.

    Bulk-loaded with the drivers' fastest paths (sqlite3 `executemany`, PostgreSQL `COPY`), not through the
    gateway: the point is the dashboard's reads of a large table, not how the capture writer fills it."""
    await upgrade_database(url)
    traffic = Traffic(calls, datetime.now(UTC))
    traffic.plan()
    sqlite = url.startswith("sqlite")
    started = time.perf_counter()
    counts: dict[str, int] = {}
    if sqlite:
        connection = sqlite3.connect(url.split("///", 1)[1])
        for table, rows in _table_rows(traffic):
            for batch in _chunks(rows, 10_000):
                columns = list(batch[0])
                connection.executemany(
                    f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                    [tuple(_stored(row[c], True) for c in columns) for row in batch],
                )
                counts[table] = counts.get(table, 0) + len(batch)
        connection.commit()
        connection.close()
    else:
        connection = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        for table, rows in _table_rows(traffic):
            for batch in _chunks(rows, 10_000):
                columns = list(batch[0])
                await connection.copy_records_to_table(
                    table,
                    columns=columns,
                    records=[tuple(_stored(row[c], False) for c in columns) for row in batch],
                )
                counts[table] = counts.get(table, 0) + len(batch)
        await connection.execute("SELECT setval('policies_id_seq', 10)")
        await connection.close()
    return {**counts, "load_s": round(time.perf_counter() - started, 1)}
