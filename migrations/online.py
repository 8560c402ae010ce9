"""Whether a migration may run while gateways of the previous revision keep serving (a rolling upgrade).

Every module in `migrations/versions` declares `ONLINE_SAFETY`: `Online(why)` or `Offline(why)`, and
`kaizen db upgrade` applies an `Offline` one only when told that every gateway and worker is stopped
(`--gateways-stopped`). `kaizen serve` applies online-safe migrations at start and refuses to start while an
offline one is pending. The verdict is judged for PostgreSQL, the database replicas share:

- **Online**: it only adds what the previous revision's code does not read (a table, a view, a nullable column
  or one with a constant default, which PostgreSQL 11+ adds without rewriting the table), and the locks it
  takes stop no read. An index built on an existing table without `CONCURRENTLY` makes writes to that table wait
  for the build: online only where those writes are the capture writer's (the capture log holds the calls, the
  writer retries) and the build takes seconds, not minutes; `why` names the wait.
- **Offline**: it rewrites or replaces a table (an `ACCESS EXCLUSIVE` lock for the whole copy), renames, drops or
  retypes something the previous code uses, adds a constraint its writes could break, or blocks request-path
  writes for minutes. `why` says which, and what the previous revision's gateways would do meanwhile.

Online revisions compose: code of any earlier revision keeps working on a database upgraded through online
revisions alone, which is how a gateway started on a database newer than its code decides to serve
(`migrations.runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: The databases Kaizen runs on, as SQLAlchemy names their dialects.
DIALECTS = ("postgresql", "sqlite")


@dataclass(frozen=True)
class Online:
    """Safe while gateways of the previous revision serve; `why` says what it does and why that is harmless."""

    why: str

    def safe_on(self, dialect: str) -> bool:
        return True


@dataclass(frozen=True)
class Offline:
    """Every gateway and worker of the previous revision must be stopped first; `why` says what would break.

    `dialects`: where it is unsafe (a revision that only changes PostgreSQL is safe on SQLite)."""

    why: str
    dialects: tuple[str, ...] = DIALECTS

    def safe_on(self, dialect: str) -> bool:
        return dialect not in self.dialects


OnlineSafety = Online | Offline
