"""Statements a worker's subscriber session prepares, then executes batch after batch.

A batch applied in one message of the simple query protocol (inline.py) had every statement
parsed and planned again at each batch: a table's set-based statement took 0.8-1.1 ms to plan
(pg_stat_statements, pgbench -N at 300 tps), more than it took to run.  Prepared (SQL
`PREPARE`, so that the batch stays one message) with its values as literals (no parameters), a
statement has one plan, made at its first execution.

That plan is only as good as the table was then: one made while `pgbench_history` was empty
scanned the whole table at every batch once it had grown (a sequential scan of an empty table
costs nothing, so no index probe beats it).  PostgreSQL plans a statement again when the
table's definition or statistics change (DDL, ANALYZE), not when it grows, so each statement
is prepared again once its plan is PLAN_SECONDS old: a plan is made every second instead of at
every batch, and a stale one lasts that long at most.  It was 5 s: pgbench's history table,
empty when the first plans were made, was scanned whole by every batch for those 5 s (at 500
tps its statement took 2.0 s of a 20 s run, 0.7 s with plans made every second); planning a
batch's statements once a second costs about a millisecond a second.

A prepared statement belongs to its session: the registry is per connection, and a new
connection prepares again.
"""

from __future__ import annotations

import functools
import hashlib
import time
import weakref

import psycopg
from psycopg.pq.abc import PGresult

from pgcascade.core import roundtrip

PLAN_SECONDS = 1.0

# what makes forget() worth calling: a changed result type, an unknown statement name
STALE = frozenset({"0A000", "26000"})

# per connection: statement name -> when it was prepared (time.monotonic())
_PREPARED: weakref.WeakKeyDictionary[psycopg.Connection, dict[str, float]] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=4096)
def name_of(body: bytes) -> str:
    """The statement's name: from its text, so a statement composed again after DDL is a new one."""
    return "pgcascade_" + hashlib.sha1(body).hexdigest()[:20]


def ensure(conn: psycopg.Connection, bodies: list[bytes]) -> None:
    """Prepare in one round trip what this session has not prepared, or prepared more than
    PLAN_SECONDS ago.  Outside a transaction, so a batch that fails after it takes nothing
    back."""
    done = _PREPARED.setdefault(conn, {})
    now = time.monotonic()
    todo = {
        name_of(body): body for body in bodies if now - done.get(name_of(body), -PLAN_SECONDS) >= PLAN_SECONDS
    }
    if not todo:
        return
    statements = []
    for name, body in todo.items():
        if name in done:
            statements.append(b"deallocate " + name.encode())
        statements.append(b"prepare %s as %s" % (name.encode(), body))
    try:
        conn.execute(b";\n".join(statements))
    except psycopg.Error:
        # stopped part-way (a statement composed before DDL here no longer prepares): which of
        # them this session holds is unknown, and a deallocate of one it lacks would fail every
        # later try (a two-way master's peers then went step by step for good)
        done.update(dict.fromkeys(todo, now))
        if not conn.closed:
            forget(conn)
        raise
    done.update(dict.fromkeys(todo, now))


def execute(body: bytes, args: bytes = b"") -> bytes:
    """The EXECUTE of a statement `ensure` prepared, with `args` (literals, comma-separated)
    for its parameters if it has any."""
    return b"execute " + name_of(body).encode() + (b"(" + args + b")" if args else b"")


def forget(conn: psycopg.Connection) -> None:
    """Drop this session's statements after an error that may have come from one of them (a
    result type that a schema upgrade changed, a session that discarded them): the next
    batch prepares them again."""
    for name in sorted(_PREPARED.pop(conn, {})):
        try:
            conn.execute(b"deallocate " + name.encode())
        except psycopg.OperationalError:
            raise
        except psycopg.Error:  # already gone
            continue


def run(conn: psycopg.Connection, statements: list[bytes]) -> list[PGresult]:
    """Send `statements` as one message of the simple query protocol (one round trip, read by
    libpq: core/roundtrip.py; the server stops at the first error) and return their results,
    one per statement.  On an error the transaction is rolled back, and this session's
    statements are forgotten if one of them may be the cause."""
    try:
        return roundtrip.send(conn, b";\n".join(statements))
    except psycopg.Error as e:
        if not conn.closed and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.execute("rollback")
        if e.sqlstate in STALE:
            forget(conn)
        raise
