"""Every connection pgcascade opens: one place, so every session parses what it reads, and
notices a dead network link.

psycopg loads dates, timestamps and intervals from their text, which it can read only in
DateStyle ISO and IntervalStyle postgres; a database or role may default to others ('SQL, DMY',
'sql_standard').  The startup options set both for our sessions, overriding those defaults,
and are added to any `options` the connection string already has.  Values themselves never
depend on them: capture and the copy fix their own output settings.  They also set
`pgcascade.auto_ddl = off`: the DDL pgcascade runs itself is never captured by auto-ddl.

A link that dies without a word (a partition, a firewall that forgot the connection, a host
that lost power) leaves a half-open socket: a process waiting for a reply waits until TCP
gives up, which is hours when nothing is being sent (the kernel's keepalive starts after 2 h)
and about 15 minutes when something is.  So every connection asks for TCP keepalives and a
TCP user timeout, on our side (libpq's `keepalives*`, `tcp_user_timeout`) and on the server's
(the `tcp_keepalives_*` and `tcp_user_timeout` settings of the session, so that a backend of a
vanished worker ends and lets go of what it held).  A dead link then fails the statement within
about `tcp_user_timeout` seconds, and the daemon's one reconnect rule takes over.  The values
are the ini's (`configure`, from the CLI); a connection string's own values win.  Unix-socket
connections ignore them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

# pgcascade.auto_ddl=off: DDL pgcascade runs itself (install, add-table's triggers, a copy's
# indexes, `execute`, which queues its script itself) is never captured by auto-ddl
SESSION_OPTIONS = "-c datestyle=ISO,YMD -c intervalstyle=postgres -c pgcascade.auto_ddl=off"
# what a connection string may hold that pgcascade never stores or sends (docs/operations.md)
SECRET_KEYS = ("password", "sslpassword")


@dataclass(frozen=True)
class TcpSettings:
    """How soon a dead link is noticed (seconds; 0: the system's default)."""

    keepalives_idle: int = 15  # an idle connection is probed after this long
    keepalives_interval: int = 5  # between probes
    keepalives_count: int = 3  # probes unanswered before the link counts as dead
    user_timeout: float = 60.0  # data (or probes) unacknowledged this long: the link is dead


_tcp = TcpSettings()


def configure(tcp: TcpSettings) -> None:
    """Use these TCP settings for every connection this process opens from now on."""
    global _tcp
    _tcp = tcp


def network_params() -> dict[str, str]:
    """libpq's parameters for the TCP settings (a connection string may set its own)."""
    params = {"keepalives": "1"}
    for key, value in (
        ("keepalives_idle", _tcp.keepalives_idle),
        ("keepalives_interval", _tcp.keepalives_interval),
        ("keepalives_count", _tcp.keepalives_count),
        ("tcp_user_timeout", round(_tcp.user_timeout * 1000)),
    ):
        if value:
            params[key] = str(value)
    return params


def server_options() -> str:
    """The same settings for the server's end of the session."""
    return " ".join(
        f"-c {name}={value}"
        for name, value in (
            ("tcp_keepalives_idle", _tcp.keepalives_idle),
            ("tcp_keepalives_interval", _tcp.keepalives_interval),
            ("tcp_keepalives_count", _tcp.keepalives_count),
            ("tcp_user_timeout", round(_tcp.user_timeout * 1000)),
        )
        if value
    )


def with_network_params(params: dict[str, Any]) -> dict[str, Any]:
    """`params` (a parsed connection string) with the TCP settings it does not set itself."""
    return {**network_params(), **params}


def with_session_options(dsn: str) -> str:
    params = with_network_params(conninfo_to_dict(dsn))
    # ours first, then the string's own (a later -c wins), then the settings we parse by
    params["options"] = " ".join(
        str(o) for o in (server_options(), params.get("options"), SESSION_OPTIONS) if o
    )
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
