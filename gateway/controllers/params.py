"""Bounded types for path, query and body integers: a number the database cannot store is the client's error
(a 400 from validation), not an overflow deep in the driver."""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar.params import Parameter

from storage.models import POLICY_NAME_LENGTH

# Row ids and versions are 64-bit signed integers in PostgreSQL and SQLite.
ROW_ID_MAX = 2**63 - 1

RowId = Annotated[int, Parameter(ge=1, le=ROW_ID_MAX)]
"""A database row id in a path, e.g. `/admin/runs/{run_id}`."""

PageLimit = Annotated[int, Parameter(ge=1, le=1000)]
"""How many rows a list returns."""

Version = Annotated[int, msgspec.Meta(ge=0, le=ROW_ID_MAX)]
"""An adapter version in a JSON body."""

PathName = Annotated[str, Parameter(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f\x7f]+$")]
"""A name or id in a path (policy name, episode id): no control characters, which PostgreSQL cannot store
or compare (a NUL byte fails inside the driver) and no real name contains."""

PolicyName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=POLICY_NAME_LENGTH, pattern=r"^[^\x00-\x1f\x7f@/]+$")
]
"""A new policy's name in a JSON body: it becomes a path segment, a directory and part of `policy@N`."""
