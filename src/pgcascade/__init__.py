"""pgcascade: cascaded, exactly-once replication for PostgreSQL."""

__version__ = "0.1.0"
