"""What redacting one captured call costs on the hot path (`redact_call`, before the capture log append).

Builds call records like the gateway's (a system prompt, a few user and assistant turns, one reply) with and
without PII in them and times `redact_call` per mode; `off` is the cost of looking up no redactor.

    python -m tests.bench.bench_redaction [--calls 2000]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

from gateway.redaction import Redactor, redact_call
from storage.records import CallRecord
from trainer.control.policy_config import PrivacyConfig

logger = logging.getLogger("bench_redaction")

SYSTEM = "You are a helpful support assistant for an online shop. Answer briefly and politely. " * 3
PLAIN = [
    "Hi, my order has not arrived yet and it has been two weeks. What can I do about it?",
    "I am sorry to hear that. Could you tell me the order number so that I can look it up?",
    "Sure, it is order 77812, placed on the 3rd of March. I paid with my usual card.",
]
WITH_PII = [
    "Hi, my order has not arrived. Reach me at jane.roe@example.org or +44 20 7946 0958.",
    "I am sorry to hear that. Could you tell me the order number so that I can look it up?",
    "It is 77812; I paid with 4111 1111 1111 1111 and refunds go to DE89 3704 0044 0532 0130 00.",
]
REPLY = (
    "Thank you. I have found your order; it left our warehouse yesterday and should arrive within two days."
)


def record(turns: list[str]) -> CallRecord:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for index, text in enumerate(turns):
        messages.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return CallRecord(
        id="c",
        episode_id="e",
        episode_resolved=True,
        model="m",
        request={"messages": messages, "tools": None, "tool_choice": None, "params": {"temperature": 0.7}},
        response={
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop"}
            ],
        },
        prompt_token_ids=list(range(300)),
        completion_token_ids=[list(range(40))],
        created_at=0.0,
    )


def time_per_call(redactor: Redactor | None, sample: CallRecord, calls: int) -> float:
    """Median over 5 runs of the mean microseconds per call."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            if redactor is not None:
                redact_call(sample, redactor)
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    samples = {"no PII": record(PLAIN), "with PII": record(WITH_PII)}
    chars = sum(len(m["content"]) for m in samples["no PII"].request["messages"]) + len(REPLY)
    logger.info("call of about %d characters (4 messages and a reply)", chars)
    for mode in ("off", "mask", "hash"):
        redactor = None if mode == "off" else Redactor(PrivacyConfig(mode=mode), b"bench-key", policy="p")
        for name, sample in samples.items():
            logger.info(
                "%-4s %-8s %7.1f µs per call", mode, name, time_per_call(redactor, sample, args.calls)
            )


if __name__ == "__main__":
    main()
