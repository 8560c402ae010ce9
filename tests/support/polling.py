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


async def wait_until_async(
    condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30.0, every_s: float = 0.05
) -> None:
    """`wait_until` for a coroutine condition, sleeping on the event loop between checks."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        await asyncio.sleep(every_s)
