"""Alembic migrations: the only way Kaizen's schema changes. Add a new version; never edit a released one."""
