"""Episode assignment: explicit ids, and prefix stitching of multi-turn conversations.

A conversation is hashed message by message in a chain (h_i = H(h_{i-1} || m_i)), so every prefix has a hash
in one pass. A call registers the hash of `messages + reply` for each of its choices; a later call whose
messages extend one of those is the same episode. Recent tails live in an in-memory LRU so the request path
never waits on the database. Behind a load balancer the earlier turn may have been served by another replica:
a miss is looked up in the `stitch_keys` table while the engine answers (the chat service), and what is still
unknown then is resolved by the capture writer, which waits a short grace period for the other replica's
write. Until then the tail a call registers is provisional: a hit on it does not settle a follow-up's episode.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.errors import InvalidRequest
from storage.models import DEFAULT_PROJECT

_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")
_encode = msgspec.json.encode
_decode = msgspec.json.decode


def new_id() -> str:
    """A call's or an episode's id: 32 hex digits, the time in milliseconds (12) and then 80 random bits. Ids
    made one after another sort together, so the database adds each row at the end of its primary-key index,
    not at a random page of it. With random ids the capture writer spent about 40% more CPU per row on SQLite
    (`tests/bench/bench_writer.py`; no difference on PostgreSQL at that size)."""
    return f"{time.time_ns() // 1_000_000:012x}{os.urandom(10).hex()}"


def valid_id(value: str) -> bool:
    return bool(_ID_PATTERN.match(value))


def _json_value(text: str) -> str:
    """A JSON object or array as one canonical text (no whitespace, sorted keys, escapes decoded), so clients
    that re-serialise what they got back (`{"city":"Paris"}` for `{"city": "Paris"}`) send the same thing;
    any other text as it is, including text that opens like JSON nested past what the decoder takes (a reply
    of a thousand brackets): that is no client's re-serialised JSON."""
    stripped = text.lstrip()
    if not stripped.startswith(("{", "[")):
        return text
    try:
        value = _decode(stripped)
        return _encode(value, order="sorted").decode()
    except (msgspec.DecodeError, RecursionError):
        return text


def _text(content: Any) -> str:
    """Content as one text: a string, or the texts of its parts (extra part fields such as `cache_control`
    do not count); non-text parts by their canonical JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _json_value(content)
    if isinstance(content, list):
        return _json_value(
            "".join(
                p["text"]
                if isinstance(p, dict) and isinstance(p.get("text"), str)
                else _encode(p, order="sorted").decode()
                for p in content
            )
        )
    return str(content)


def _arguments(call: Mapping[str, Any]) -> list[Any]:
    function = call.get("function")
    if not isinstance(function, dict):
        return [None, None]
    arguments = function.get("arguments")
    return [function.get("name"), _json_value(arguments) if isinstance(arguments, str) else arguments]


def _canonical(message: Mapping[str, Any]) -> bytes:
    """The parts of a message that identify it when a client sends it back, compared by value: ids and nulls
    vary by SDK, and so do JSON formatting and whether content is a string or text parts. Plain text hashes
    exactly as it did before JSON was compared by value, so stored keys of text conversations stay valid."""
    calls = message.get("tool_calls") or []
    return _encode(
        [
            message.get("role"),
            _text(message.get("content")),
            [_arguments(c) for c in calls if isinstance(c, dict)],
            message.get("tool_call_id"),
        ]
    )


def _chain(previous: bytes, message: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(previous + _canonical(message), digest_size=16).digest()


@dataclass
class ConversationHashes:
    """Prefix hashes of a request's messages, computed once per call."""

    prefixes: list[bytes]  # prefixes[i] is the hash of messages[:i+1]
    context_hash: str  # up to (excluding) the first assistant turn: what `prompt` grouping compares
    lookup: list[str] = field(default_factory=list)  # candidate earlier tails, longest first

    @classmethod
    def of(cls, messages: Sequence[Mapping[str, Any]], project: str = DEFAULT_PROJECT) -> ConversationHashes:
        """The built-in project hashes as before projects existed; any other seeds the chain with its name."""
        prefixes: list[bytes] = []
        previous = (
            b"" if project == DEFAULT_PROJECT else hashlib.blake2b(project.encode(), digest_size=16).digest()
        )
        context: bytes | None = None
        for message in messages:
            if context is None and message.get("role") == "assistant":
                context = previous
            previous = _chain(previous, message)
            prefixes.append(previous)
        lookup = [
            prefixes[i].hex()
            for i in range(len(messages) - 1, -1, -1)
            if messages[i].get("role") == "assistant"
        ]
        return cls(prefixes, (context if context is not None else previous).hex(), lookup)

    def continuation(self, reply: Mapping[str, Any]) -> str:
        """The key a follow-up call will look for: hash of these messages plus `reply`."""
        return _chain(self.prefixes[-1] if self.prefixes else b"", reply).hex()


class StitchCache:
    """Bounded LRU from conversation-tail hash to (episode id, settled).

    An entry is unsettled while the call that registered it had no final episode (a provisional id the capture
    writer may still link to an earlier turn stored by another replica); `settle` makes it final.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[str, bool]] = OrderedDict()

    def find(self, keys: Sequence[str]) -> tuple[str, bool] | None:
        """The episode of the longest known tail among `keys`, preferring a settled one; None when unknown."""
        provisional: str | None = None
        for key in keys:
            entry = self._items.get(key)
            if entry is None:
                continue
            if entry[1]:
                self._items.move_to_end(key)
                return entry
            if provisional is None:
                provisional = entry[0]
        return (provisional, False) if provisional is not None else None

    def remember(self, keys: Sequence[str], episode_id: str, settled: bool = True) -> None:
        if self.size == 0:
            return
        for key in keys:
            self._items[key] = (episode_id, settled)
            self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def settle(self, keys: Sequence[str], episode_id: str) -> None:
        """The writer decided the episode of the call that registered `keys`: replace provisional entries."""
        for key in keys:
            entry = self._items.get(key)
            if entry is not None and not entry[1]:
                self._items[key] = (episode_id, True)


@dataclass
class EpisodeAssignment:
    episode_id: str
    resolved: bool  # final now (explicit or a settled cache hit); otherwise the database may still link it


def assign_episode(
    header_id: str | None, metadata: Mapping[str, str] | None, hashes: ConversationHashes, cache: StitchCache
) -> EpisodeAssignment:
    explicit = header_id or (metadata or {}).get("episode_id")
    if explicit is not None:
        if not valid_id(explicit):
            param = None if header_id else "metadata.episode_id"
            raise InvalidRequest(
                "episode id must be 1-64 characters of letters, digits, '_', '.', ':' or '-'",
                param=param,
                code="invalid_episode_id",
            )
        return EpisodeAssignment(explicit, True)
    found = cache.find(hashes.lookup)
    if found is not None:
        # A provisional hit keeps the conversation under one id; the writer links the whole chain.
        return EpisodeAssignment(found[0], found[1])
    return EpisodeAssignment(new_id(), not hashes.lookup)
