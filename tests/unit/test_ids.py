"""Call and episode ids: unique, well formed, and in the order they were made (time first)."""

from __future__ import annotations

import re
import time

from gateway.episodes import new_id, valid_id


def test_ids_are_32_hex_digits_and_unique() -> None:
    ids = [new_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) and valid_id(i) for i in ids)


def test_an_id_made_in_a_later_millisecond_sorts_after_the_earlier_ones() -> None:
    made = []
    for _ in range(5):
        now = time.time_ns() // 1_000_000
        made.append(new_id())
        while time.time_ns() // 1_000_000 == now:  # the next millisecond
            pass
    assert made == sorted(made)
    assert abs(int(made[-1][:12], 16) - time.time_ns() // 1_000_000) < 60_000  # the time, in milliseconds
