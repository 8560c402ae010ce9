"""Backups of a Kaizen installation: the database, the adapter files its versions name and the capture log's
calls not stored yet, taken while the gateway serves (`take`), checked and put back (`restore`).

`manifest` describes a backup and checks its files; `databases` snapshots and restores SQLite (the online backup
API) and PostgreSQL (`pg_dump` and `pg_restore`).
"""
