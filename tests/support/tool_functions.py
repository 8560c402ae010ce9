"""Python functions the tests configure as a policy's tools (`tools.functions`)."""

from __future__ import annotations

import asyncio
import time
from typing import Literal


def capital(country: str, unit: Literal["name", "code"] = "name") -> str:
    """Give the capital of a country.

    Only a few countries are known."""
    capitals = {"zorland": ("Quix", "QX"), "vellmar": ("Ostra", "OS")}
    if country not in capitals:
        raise KeyError(f"unknown country {country!r}")
    name, code = capitals[country]
    return name if unit == "name" else code


async def population(country: str, year: int | None = None) -> dict[str, object]:
    """The population of a country (a JSON object)."""
    await asyncio.sleep(0)
    return {"country": country, "year": year or 2026, "people": len(country) * 1000}


def sleepy(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "awake"


def essay(words: int) -> str:
    """A long answer."""
    return " ".join(["word"] * words)
