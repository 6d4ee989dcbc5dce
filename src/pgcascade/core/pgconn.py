"""Every connection pgcascade opens: one place, so every session parses what it reads.

psycopg loads dates, timestamps and intervals from their text, which it can read only in
DateStyle ISO and IntervalStyle postgres; a database or role may default to others ('SQL, DMY',
'sql_standard').  The startup options set both for our sessions, overriding those defaults,
and are added to any `options` the connection string already has.  Values themselves never
depend on them: capture and the copy fix their own output settings.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

SESSION_OPTIONS = "-c datestyle=ISO,YMD -c intervalstyle=postgres"
# what a connection string may hold that pgcascade never stores or sends (docs/operations.md)
SECRET_KEYS = ("password", "sslpassword")


def with_session_options(dsn: str) -> str:
    params = conninfo_to_dict(dsn)
    params["options"] = " ".join(str(o) for o in (params.get("options"), SESSION_OPTIONS) if o)
    return make_conninfo("", **params)


def has_secret(dsn: str) -> bool:
    """Whether the connection string holds a password (or an SSL key's)."""
    return any(k in conninfo_to_dict(dsn) for k in SECRET_KEYS)


def without_secrets(dsn: str) -> str:
    """The connection string without its password: what a node's location may carry.  The node
    that connects finds the password where libpq looks (~/.pgpass, a service file, PGPASSWORD).
    A URI comes back as key=value pairs; a string without a secret comes back unchanged."""
    params = conninfo_to_dict(dsn)
    if not any(k in params for k in SECRET_KEYS):
        return dsn
    return make_conninfo("", **{k: v for k, v in params.items() if k not in SECRET_KEYS})


def connect(
    dsn: str, autocommit: bool = False, connect_timeout: int = 10, **kwargs: Any
) -> psycopg.Connection:
    return psycopg.connect(
        with_session_options(dsn), autocommit=autocommit, connect_timeout=connect_timeout, **kwargs
    )


def one(conn: psycopg.Connection, query: Any, params: Any = None) -> tuple[Any, ...]:
    """The query's one row (a query that returns no row here is a bug)."""
    row = conn.execute(query, params).fetchone()
    if row is None:
        raise RuntimeError(f"query returned no row: {str(query)[:80]}")
    return row


def scalar(conn: psycopg.Connection, query: Any, params: Any = None) -> Any:
    """The first column of the query's one row."""
    return one(conn, query, params)[0]
