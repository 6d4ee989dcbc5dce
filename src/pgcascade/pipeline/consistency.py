"""The sync point (seed 000): both sides frozen at the same position, then snapshots exported.

1. Lock the provider's tables IN SHARE MODE (writers wait; readers do not) with a lock_timeout,
   so a long-running writer makes us give up instead of queueing every writer behind us.
2. Fix the position: on a root, a tick taken now (it holds every change committed before the
   lock: SHARE waits for open writers of these tables to finish); on a branch, its last tick.
3. Wait until the subscriber's worker has applied that tick (node.last_tick), at most
   `sync_timeout` seconds (10, the seed's hardwired limit); else release and give up.
4. Open REPEATABLE READ transactions on both sides and export their snapshots
   (pg_export_snapshot); Spark tasks import them, so every task sees the same rows.
5. Release the lock.  Writers continue; the compare reads the frozen snapshots.

The exporting transactions stay open until the compare ends (`SyncPoint.close`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from pgcascade.capture import logical
from pgcascade.core import pgconn
from pgcascade.core.errors import RuntimeFailure, UserError, db_error_line
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pipeline.segments import SESSION_SETTINGS
from pgcascade.replica import tables as subscriber

log = logging.getLogger("pgcascade.pipeline")

DEFAULT_SYNC_TIMEOUT = 10.0
LOCK_TIMEOUT = "5s"


@dataclass
class SyncPoint:
    prov_dsn: str
    sub_dsn: str
    prov_snapshot: str
    sub_snapshot: str
    tick: int
    locked_for: float  # seconds the provider's tables were locked
    holders: list[psycopg.Connection] = field(default_factory=list, repr=False)

    def close(self) -> None:
        for c in self.holders:
            with contextlib.suppress(psycopg.Error):
                c.close()
        self.holders.clear()


def snapshot_holder(dsn: str) -> tuple[psycopg.Connection, str]:
    """A REPEATABLE READ, read-only transaction left open, and its exported snapshot id."""
    conn = pgconn.connect(dsn, autocommit=True, connect_timeout=10)
    conn.execute("set application_name = 'pgcascade compare'")
    conn.execute(SESSION_SETTINGS)
    conn.autocommit = False
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = True
    snap = scalar(conn, "select pg_export_snapshot()")
    return conn, snap


def target_tick(prov: psycopg.Connection, queue: str, timeout: float = DEFAULT_SYNC_TIMEOUT) -> int:
    """The provider's position under the lock.  A root with logical capture first waits until
    its capture daemon has read the WAL up to now: a change committed before the lock and not
    read yet would be in the provider's rows and not in the queue."""
    pnode = nodes.get_node(prov, queue)
    if pnode is not None and pnode.role.is_root:
        if logical.is_logical(prov, queue):
            logical.wait_captured(prov, queue, timeout)
        return q.ticker(prov, queue)
    return q.last_tick_id(prov, queue) or 0


def wait_applied(sub: psycopg.Connection, queue: str, tick: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        last = nodes.applied_tick(sub, queue)
        if last >= tick:
            return
        if time.monotonic() >= deadline:
            raise RuntimeFailure(
                f"subscriber did not catch up within {timeout:g} s (applied tick {last}, needs {tick}):"
                " lock released, nothing compared; is the worker running? (pgcascade CONFIG worker -d)"
            )
        time.sleep(0.02)


def sync_point(
    sub_dsn: str, queue: str, tables: list[subscriber.SubscriberTable], timeout: float = DEFAULT_SYNC_TIMEOUT
) -> SyncPoint:
    """Freeze both sides at one position and export a snapshot of each (see module doc)."""
    with pgconn.connect(sub_dsn, autocommit=True, connect_timeout=10) as sub:
        node = nodes.require_node(sub, queue)
        if node.role.captures_changes:
            raise UserError(f"{node.node_name} is the root: run compare with a subscriber's config")
        prov_dsn = nodes.provider_location(sub, node)
        with pgconn.connect(prov_dsn, autocommit=True, connect_timeout=10) as prov:
            prov.execute("set application_name = 'pgcascade compare'")
            lock = pgconn.connect(prov_dsn, connect_timeout=10)
            try:
                started = time.monotonic()
                try:
                    lock.execute(sql.SQL("set local lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
                    lock.execute(
                        sql.SQL("lock table {} in share mode").format(
                            sql.SQL(", ").join(sql.SQL(t.table_name) for t in tables)
                        )
                    )
                except psycopg.errors.LockNotAvailable:
                    raise RuntimeFailure(
                        f"could not lock the provider's tables within {LOCK_TIMEOUT}: a long transaction writes to them"
                    ) from None
                locked = time.monotonic()
                tick = target_tick(prov, queue, timeout)
                log.debug("provider tables locked; waiting for the subscriber to apply tick %d", tick)
                wait_applied(sub, queue, tick, timeout)
                prov_holder, prov_snap = snapshot_holder(prov_dsn)
                sub_holder, sub_snap = snapshot_holder(sub_dsn)
            except psycopg.Error as e:
                raise RuntimeFailure(f"sync point: {db_error_line(e)}") from None
            finally:
                lock.close()  # rolls back: the lock is released
            held = time.monotonic() - locked
            log.debug(
                "sync point at tick %d; provider locked %.2f s (lock taken in %.2f s)",
                tick,
                held,
                locked - started,
            )
    return SyncPoint(prov_dsn, sub_dsn, prov_snap, sub_snap, tick, held, [prov_holder, sub_holder])
