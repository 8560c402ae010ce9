"""Import: conversations a team already has become episodes of a policy, to start it from that data.

The file is JSON lines in OpenAI's chat format, one conversation a line, optionally rewarded:

    {"messages": [...], "tools": [...], "reward": 0.8, "metadata": {...}, "group_key": "...", "id": "..."}

Only `messages` is required; it must end with the assistant's reply (text or tool calls). `reward` is a
number, `true`/`false` or one of the policy's feedback labels, mapped as feedback would be, and is stored as a
reward of source `feedback` named `import` (`--reward-name`), so the policy's reward rule derives the episode's
reward from it. `id` is the conversation's id in the team's own system (kept in the episode's metadata as
`import_id`).

The whole file is validated before anything is written: a bad line stops the import with errors that name
the line, and nothing is stored, unless `skip_bad_lines` (then the good lines are stored and the bad ones
reported). Each episode's id is derived from the project, the policy and the line's `id` (else its
conversation), so importing a file again stores nothing new, and an interrupted import is completed by running
it again. A policy with a `privacy` section gets the conversations redacted as its captured calls would be.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from gateway.body_depth import MAX_JSON_DEPTH, depth_exceeds
from gateway.episodes import ConversationHashes
from gateway.errors import APIError
from gateway.feedback import to_number
from gateway.protocol import AssistantMessage, Message, Tool
from gateway.redaction import Redactor, load_redaction_key, redact_call
from gateway.settings import Settings
from storage.database import Database
from storage.imports import store_conversations, stored_episode_ids
from storage.models import DEFAULT_PROJECT
from storage.policies import get_policy
from storage.records import CallRecord
from storage.rewards import NewReward, insert_rewards
from trainer.control.policy_config import FeedbackConfig, PrivacyConfig, load_policy_config
from trainer.control.rewards import refresh_episode_rewards

log = logging.getLogger(__name__)

IMPORT_SOURCE = "import"
MAX_SHOWN_ERRORS = 20


class ImportLine(Struct, forbid_unknown_fields=True):
    """One line of an import file (validation only; the stored messages are the line's own JSON)."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: list[Tool] | None = None
    parallel_tool_calls: bool | None = None
    reward: bool | float | str | None = None
    metadata: dict[str, Any] = {}
    group_key: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    id: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


class ImportFailed(Exception):
    """The file has bad lines (and they were not to be skipped), or the policy is missing: nothing was stored."""


@dataclass
class ImportReport:
    lines: int = 0  # conversations read (blank lines not counted)
    imported: int = 0  # new episodes stored
    existing: int = 0  # already stored by an earlier import: left as they were
    repeated: int = 0  # the same conversation twice in this file: stored once
    rewards: int = 0  # reward rows written
    bad_lines: int = 0  # refused (and skipped, with skip_bad_lines)
    errors: list[str] = field(default_factory=list)  # the first MAX_SHOWN_ERRORS of them


@dataclass(frozen=True)
class Conversation:
    line: int
    raw: dict[str, Any]
    reward: float | None


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


def parse_line(line: bytes, feedback: FeedbackConfig) -> tuple[dict[str, Any], float | None]:
    """The line's JSON object and its reward as a number. Raises ValueError saying what is wrong."""
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError("a line must be a JSON object with `messages`")
    if depth_exceeds(raw, MAX_JSON_DEPTH):  # as the gateway refuses such a body: it could not be stored
        raise ValueError(f"the line is nested more than {MAX_JSON_DEPTH} levels deep")
    try:
        parsed = msgspec.convert(raw, ImportLine)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from exc
    last = parsed.messages[-1]
    if not isinstance(last, AssistantMessage) or (last.content in (None, "", []) and not last.tool_calls):
        raise ValueError(
            "the last message must be the assistant's reply (content or tool_calls) - at `$.messages`"
        )
    if parsed.group_key is not None and "\x00" in parsed.group_key:
        raise ValueError("group_key must not contain NUL characters - at `$.group_key`")
    reward: float | None = None
    if parsed.reward is not None:
        if isinstance(parsed.reward, float) and not math.isfinite(parsed.reward):
            raise ValueError("reward must be a finite number - at `$.reward`")
        try:
            reward, _ = to_number(parsed.reward, feedback, "reward")
        except APIError as exc:
            raise ValueError(f"{exc.message} - at `$.reward`") from exc
    return raw, reward


def episode_id(project: str, policy: str, raw: dict[str, Any]) -> str:
    """Stable per conversation: from the line's own id, else from its content (so a re-import matches)."""
    identity = raw.get("id") if raw.get("id") is not None else [raw["messages"], raw.get("tools")]
    digest = hashlib.sha256(msgspec.json.encode([project, policy, identity])).hexdigest()
    return f"imp-{digest[:40]}"


def call_record(conversation: Conversation, policy: str, project: str, source_name: str) -> CallRecord:
    """The conversation as a captured call: the messages before the reply, and the reply."""
    raw = conversation.raw
    ident = episode_id(project, policy, raw)
    context, reply = raw["messages"][:-1], raw["messages"][-1]
    now = time.time()
    metadata = {
        **(raw.get("metadata") or {}),
        "import_file": source_name,
        "import_line": conversation.line,
        **({"import_id": raw["id"]} if raw.get("id") is not None else {}),
    }
    params = {"parallel_tool_calls": raw["parallel_tool_calls"]} if "parallel_tool_calls" in raw else {}
    finish = "tool_calls" if reply.get("tool_calls") else "stop"
    return CallRecord(
        id=ident,
        episode_id=ident,
        episode_resolved=True,
        policy=policy,
        model=policy,
        request={"messages": context, "tools": raw.get("tools"), "tool_choice": None, "params": params},
        response={
            "id": f"chatcmpl-{ident}",
            "object": "chat.completion",
            "created": int(now),
            "model": policy,
            "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
        },
        status="ok",
        context_hash=ConversationHashes.of(context, project).context_hash,
        group_key=raw.get("group_key"),
        episode_metadata=metadata,
        key_id=IMPORT_SOURCE,
        project=project,
        created_at=now,
    )


def _redactor(settings: Settings, policy: str, section: Any) -> Redactor | None:
    config = PrivacyConfig.model_validate(section or {})
    if config.mode == "off":
        return None
    key = load_redaction_key(settings.redaction_key, settings.data_dir) if config.mode == "hash" else b""
    return Redactor(config, key, policy=policy)


async def import_conversations(
    settings: Settings,
    database: Database,
    path: Path,
    policy: str,
    *,
    project: str | None = None,
    reward_name: str = IMPORT_SOURCE,
    skip_bad_lines: bool = False,
    batch_size: int = 500,
) -> ImportReport:
    """Validate the whole file, then store its conversations in batches, as episodes of `project` (None: the
    policy's owner, else the built-in project). Raises ImportFailed (nothing stored), also for a project other
    than the owner of an owned policy: that policy would never train on them."""
    async with database.session() as session:
        info = await get_policy(session, policy)
    if info is None:
        raise ImportFailed(f"no policy named {policy!r}: create it first (`kaizen policy create {policy}`)")
    if project is None:
        project = info.project or DEFAULT_PROJECT
    elif info.project is not None and project != info.project:
        raise ImportFailed(
            f"policy {policy!r} is owned by project {info.project!r} and trains on its episodes only: "
            f"import them into that project (leave out --project)"
        )
    config = load_policy_config(info.config)
    report = ImportReport()
    for number, line in _lines(path):
        report.lines += 1
        try:
            parse_line(line, config.rewards.feedback)
        except ValueError as exc:
            report.bad_lines += 1
            if len(report.errors) < MAX_SHOWN_ERRORS:
                report.errors.append(f"line {number}: {exc}")
    if report.bad_lines and not skip_bad_lines:
        raise ImportFailed(_refusal(path, report))
    redactor = _redactor(settings, policy, info.config.get("privacy"))
    seen: set[str] = set()
    batch: list[Conversation] = []
    for number, line in _lines(path):
        try:
            raw, reward = parse_line(line, config.rewards.feedback)
        except ValueError:
            continue  # counted and reported in the validation pass
        ident = episode_id(project, policy, raw)
        if ident in seen:
            report.repeated += 1
            continue
        seen.add(ident)
        batch.append(Conversation(number, raw, reward))
        if len(batch) >= batch_size:
            await _store(database, batch, policy, project, path.name, reward_name, redactor, report)
            batch = []
    await _store(database, batch, policy, project, path.name, reward_name, redactor, report)
    return report


def _refusal(path: Path, report: ImportReport) -> str:
    more = report.bad_lines - len(report.errors)
    shown = "\n".join(report.errors) + (f"\n... and {more} more" if more > 0 else "")
    return (
        f"{path}: {report.bad_lines} of {report.lines} lines are invalid; nothing was imported "
        f"(fix them, or pass --skip-bad-lines to import the others):\n{shown}"
    )


async def _store(
    database: Database,
    batch: list[Conversation],
    policy: str,
    project: str,
    source_name: str,
    reward_name: str,
    redactor: Redactor | None,
    report: ImportReport,
) -> None:
    if not batch:
        return
    records = [call_record(c, policy, project, source_name) for c in batch]
    if redactor is not None:
        records = [redact_call(r, redactor) for r in records]
    rewards = [
        NewReward(
            source="feedback",
            name=reward_name,
            value=c.reward,
            call_id=r.id,
            episode_id=r.episode_id,
            metadata={"import_file": source_name, "import_line": c.line},
            idempotency_key=f"import:{r.episode_id}:{reward_name}",
            key_id=IMPORT_SOURCE,
        )
        for c, r in zip(batch, records, strict=True)
        if c.reward is not None
    ]
    async with database.session() as session:
        stored = await stored_episode_ids(session, [r.episode_id for r in records])
        fresh = [r for r in records if r.episode_id not in stored]
        report.existing += len(records) - len(fresh)
        report.imported += await store_conversations(session, fresh, IMPORT_SOURCE)
    if rewards:
        async with database.session() as session:
            inserted = await insert_rewards(session, rewards)
            report.rewards += sum(1 for _, new in inserted if new)
            await refresh_episode_rewards(session, [r.episode_id for r in rewards if r.episode_id])
            await session.commit()
