"""Wait on progress, not on the clock: poll a condition until it holds or a deadline passes.

A loaded CI machine may take seconds for what takes milliseconds here, so tests wait for the state they need
(with a generous deadline) instead of sleeping a fixed time and hoping it was enough.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


def wait_until(
    condition: Callable[[], bool], what: str, timeout_s: float = 30.0, every_s: float = 0.05
) -> None:
    """Return as soon as `condition()` is true; fail the test naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(every_s)


async def poll(condition: Callable[[], Awaitable[bool]], timeout_s: float, every_s: float = 0.05) -> bool:
    """Re-check a coroutine condition until it holds or `timeout_s` passes; returns whether it held (for a test
    that reports what was missing itself)."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(every_s)
    return True


async def wait_until_async(
    condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30.0, every_s: float = 0.05
) -> None:
    """`wait_until` for a coroutine condition, sleeping on the event loop between checks."""
    assert await poll(condition, timeout_s, every_s), f"timed out after {timeout_s:g} s waiting for {what}"
