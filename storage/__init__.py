"""Persistence: SQLAlchemy models, the session factory and repository functions. Knows nothing of HTTP or torch."""
