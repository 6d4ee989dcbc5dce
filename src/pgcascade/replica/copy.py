"""The copy process: initial copy of one table and its hand-over to the worker (seed 000).

States this process owns, and what it does in each:

    in-copy      register a consumer of its own on the provider's queue, then copy the table
                 under a REPEATABLE READ snapshot, in one subscriber transaction: drop indexes
                 and constraints, truncate, COPY, restore them, record the snapshot, set
                 catching-up.  Dying here rolls it all back; a restart copies again.
    catching-up  replay this table's events from its own consumer, skipping those visible in
                 the copy's snapshot (they are in the copied rows), until no batch is waiting;
                 then wanna-sync:<its tick>.
    do-sync:T    catch up to exactly tick T, where the worker waits; set ok and leave.

Each batch it applies records its tick in `subscriber_table.copy_tick` in the same transaction,
so a copy process killed at any moment continues where it was, applying nothing twice.
The COPY streams bytes from one connection to the other; rows never become Python objects.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Protocol

import psycopg
from psycopg import sql

from pgcascade.capture import logical
from pgcascade.capture import tables as set_tables
from pgcascade.core import catalog, copystream, pgconn, privileges
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import Daemon
from pgcascade.core.errors import UserError
from pgcascade.core.hooks import pause_point
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.replica import filters
from pgcascade.replica import state as states
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import APPLY_SETTINGS, TableApplier, apply_staged
from pgcascade.replica.definitions import SavedDefinitions
from pgcascade.replica.peer_apply import peer_batch
from pgcascade.replica.stage import stage_batch
from pgcascade.replica.state import Phase

log = logging.getLogger("pgcascade.copy")


def copy_consumer_name(worker_name: str, table: str) -> str:
    return f"{worker_name}.copy.{table}"


class BulkCopier(Protocol):
    """A faster in-copy step for large tables, plugged in by the command that starts the
    processes (the Spark pipeline provides one: pipeline/copy.py).  Without one, or when it
    declines a table, the copy process streams the table itself."""

    def wanted(
        self, cfg: JobConfig, sub: psycopg.Connection, prov: psycopg.Connection, queue: str, table: str
    ) -> bool: ...

    def run(self, process: CopyProcess, st: subscriber.SubscriberTable) -> bool:
        """Copy the table (or resume); False when it must wait (see CopyProcess.ddl_pending)."""
        ...

    def forget(self, sub: psycopg.Connection, queue: str, table: str) -> None:
        """A new copy of the table starts (NULL -> in-copy): what an earlier one left goes."""


def copy_table(
    prov_dsn: str,
    snapshot: str,
    sub: psycopg.Connection,
    table: str,
    dest: str,
    cols: list[str],
    partitioned: bool,
    row_filter: str | None = None,
) -> tuple[int, int]:
    """COPY the table (the rows its filter passes), as of the exported snapshot, into dest in
    sub's transaction; (rows, bytes)."""
    collist = sql.SQL(", ").join(map(sql.Identifier, cols))
    only = sql.SQL("" if partitioned else "only ")
    where = sql.SQL(" where {}").format(filters.embedded(row_filter)) if row_filter else sql.SQL("")
    out = sql.SQL("copy (select {} from {}{}{}) to stdout").format(collist, only, sql.SQL(table), where)
    into = sql.SQL("copy {} ({}) from stdin").format(sql.SQL(dest), collist)
    return copystream.stream_copy(prov_dsn, snapshot, out, sub, into, copystream.Progress(table))


class CopyProcess(Daemon):
    name = "copy"
    default_loop_delay = 0.05  # polls its own table's state: the worker's hand-over is awaited here

    def __init__(self, cfg: JobConfig, table: str, bulk: BulkCopier | None = None):
        # the worker's pidfile and metrics port are not ours; copy_pid in the database tells who runs
        super().__init__(cfg.with_changes(pidfile=None, loop_delay=None, metrics_port=None))
        if not cfg.queue_name or not cfg.db:
            raise UserError(f"{cfg.path}: db and queue_name must be set")
        self.db = cfg.db
        self.queue = cfg.queue_name
        self.table = table
        self.bulk = bulk
        self.sub: psycopg.Connection | None = None
        self.prov: psycopg.Connection | None = None
        self.origin: str | None = None  # a logical master's: the replication origin it writes under
        self.connect()
        self.consumer = copy_consumer_name(self.node.consumer, table)
        self.applier: TableApplier | None = None

    def connect(self) -> tuple[psycopg.Connection, psycopg.Connection]:
        """Both databases; after a server restart the next round connects again."""
        if self.sub is None or self.sub.closed:
            self.sub = pgconn.connect(self.db, autocommit=True, connect_timeout=10)
            self.sub.execute("set application_name = 'pgcascade copy'")
            self.node = nodes.require_node(self.sub, self.queue)
            st = subscriber.get_table(self.sub, self.queue, self.table)
            # the copy and its catch-up read the copy node's queue (--copy-node): a branch
            # repeats the root's tick ids, so the hand-over to the worker is at the same tick
            self.prov_location = subscriber.copy_source(
                self.sub, self.node, self.table, st.copy_node if st is not None else None
            )
            if self.node.is_peer:
                assert self.node.peer_of is not None and self.node.provider_node is not None
                if logical.is_logical(self.sub, self.node.peer_of):  # as the worker's apply does
                    self.origin = logical.copy_origin(self.node.provider_node, self.queue, self.table)
                    logical.ensure_origin(self.sub, self.origin)
                    logical.use_origin(self.sub, self.origin)
        if self.prov is None or self.prov.closed:
            self.prov = pgconn.connect(self.prov_location, autocommit=True, connect_timeout=10)
            self.prov_logical = self.node.is_peer and logical.is_logical(self.prov, self.queue)
        return self.sub, self.prov

    def report_error(self, e: Exception) -> None:
        """The failure shows in `status` with the table (and with the grant to run if a privilege
        is missing); a connection of its own, as the worker's."""
        version = self.sub.info.server_version if self.sub is not None and not self.sub.closed else 0
        with (
            contextlib.suppress(psycopg.Error),
            pgconn.connect(self.db, autocommit=True, connect_timeout=5) as conn,
        ):
            subscriber.record_copy_error(
                conn, self.queue, self.table, privileges.explain(e, self.db, version)
            )

    def recovered(self) -> None:
        if self.sub is not None and not self.sub.closed:
            subscriber.record_copy_error(self.sub, self.queue, self.table, None)

    def drop_connections(self) -> None:
        for c in (self.sub, self.prov):
            if c is not None:
                c.close()
        self.sub = self.prov = None

    def shutdown(self) -> None:
        self.drop_connections()

    def work(self) -> bool:
        sub, prov = self.connect()
        st = subscriber.get_table(sub, self.queue, self.table)
        if st is None or st.state in (states.NEW, states.OK):
            log.info(
                "%s: state %s, nothing for a copy process to do", self.table, st.state if st else "(removed)"
            )
            self.stop_requested = True
            return False
        if st.copy_pid != os.getpid():
            subscriber.set_state(sub, self.queue, self.table, st.state, copy_pid=os.getpid())
        phase = st.state.phase
        if phase is Phase.IN_COPY:
            return self.in_copy(sub, prov, st)
        if phase is Phase.CATCHING_UP:
            return self.catching_up(sub, prov, st)
        if phase is Phase.DO_SYNC:
            return self.do_sync(st)
        return False  # wanna-sync: the worker's turn

    # --- the states this process owns ---
    def in_copy(
        self, sub: psycopg.Connection, prov: psycopg.Connection, st: subscriber.SubscriberTable
    ) -> bool:
        lacking = subscriber.provider_lacks(prov, self.queue, [self.table])
        if lacking:
            log.info("%s: waiting for the provider to hold it (%s)", self.table, lacking[self.table])
            return False
        # a copy from a two-way peer is this process's own: it tags what it writes as the peer's
        bulk = self.bulk if not self.node.is_peer else None
        if bulk is not None and bulk.wanted(self.cfg, sub, prov, self.queue, self.table):
            return bulk.run(self, st)  # a large table: key ranges copied by Spark tasks, resumable
        return self.initial_copy(st)

    def ddl_pending(self, snapshot: str) -> bool:
        """Whether `snapshot` sees DDL (EXECUTE events) that this node's worker has not run yet.

        The copy takes the columns the subscriber's table has now; a column that a queued
        script adds would be copied as its default, not as the provider's values: such a copy
        waits for the worker, which runs the script at its place in the queue."""
        assert self.sub is not None and self.prov is not None
        applied = nodes.applied_tick(self.sub, self.queue)
        if not applied:
            return False
        n = q.pending_event_count(self.prov, self.queue, applied, snapshot, ("EXECUTE",))
        if n:
            log.info("%s: waiting for the worker to run %d queued DDL script(s) first", self.table, n)
        return n > 0

    def catching_up(
        self, sub: psycopg.Connection, prov: psycopg.Connection, st: subscriber.SubscriberTable
    ) -> bool:
        if self.apply_next_batch(st, max_tick=None):
            return True
        assert st.copy_tick is not None and st.copy_snapshot is not None
        if not q.tick_covers_snapshot(prov, self.queue, st.copy_tick, st.copy_snapshot):
            return False  # hand over only at a tick taken after the copy's snapshot
        subscriber.set_state(sub, self.queue, self.table, states.TableState.wanna_sync(st.copy_tick))
        log.info("%s: caught up at tick %d: wanna-sync:%d", self.table, st.copy_tick, st.copy_tick)
        # wake the worker (it waits on the provider's tick channel) for the hand-over now,
        # not at the next tick: with no writes that is up to ticker_idle_period away
        q.wake_consumers(prov, self.queue)
        pause_point("wanna-sync", self.table)
        return False

    def do_sync(self, st: subscriber.SubscriberTable) -> bool:
        pause_point("do-sync", self.table)
        target = st.state.tick or 0
        if (st.copy_tick or 0) >= target:
            self.finish(st)
            return False
        self.apply_next_batch(st, max_tick=target)
        return True

    def register_own_consumer(self) -> int:
        """A fresh consumer of this copy on the provider's queue; returns the tick it starts at."""
        assert self.prov is not None
        with contextlib.suppress(psycopg.errors.NoDataFound, psycopg.errors.RaiseException):
            q.unregister_consumer(self.prov, self.queue, self.consumer)
        q.register_consumer(self.prov, self.queue, self.consumer)
        tick = q.consumer_last_tick(self.prov, self.queue, self.consumer)
        assert tick is not None
        return tick

    def initial_copy(self, st: subscriber.SubscriberTable) -> bool:
        assert self.sub is not None and self.prov is not None
        reg_tick = self.register_own_consumer()
        started = time.monotonic()
        with pgconn.connect(self.prov_location, connect_timeout=10) as snap_conn:
            snap_conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            snap_conn.read_only = True
            # the transaction's snapshot: every event committed before it is in the copied rows
            snapshot = copystream.current_snapshot(snap_conn)
            if self.ddl_pending(snapshot):
                return False
            # the columns once no queued DDL is ahead of the copy
            dest_cols = {c.name for c in catalog.columns(self.sub, st.dest_table) if not c.generated}
            cols = st.applied_columns(
                [
                    c.name
                    for c in catalog.columns(snap_conn, self.table)
                    if c.name in dest_cols and not c.generated
                ]
            )
            log.info("%s: copying under snapshot %s, catch-up from tick %d", self.table, snapshot, reg_tick)
            with self.sub.transaction():
                self.sub.execute(APPLY_SETTINGS)
                peer = peer_batch(self.sub, self.node, reg_tick)
                saved = SavedDefinitions.read(self.sub, st.dest_table)
                saved.drop(self.sub)
                if not st.skip_truncate:
                    only = "" if catalog.is_partitioned(self.sub, st.dest_table) else "only "
                    self.sub.execute(sql.SQL(f"truncate {only}{{}}").format(sql.SQL(st.dest_table)))
                rows, moved = copy_table(
                    self.prov_location,
                    copystream.export_snapshot(snap_conn),
                    self.sub,
                    self.table,
                    st.dest_table,
                    cols,
                    catalog.is_partitioned(snap_conn, self.table),
                    st.row_filter,
                )
                copied = time.monotonic()
                pause_point("in-copy", self.table)
                saved.restore(self.sub)
                if peer is not None:
                    self.copied_from_peer(snap_conn, st)
                subscriber.set_state(
                    self.sub,
                    self.queue,
                    self.table,
                    states.CATCHING_UP,
                    copy_snapshot=snapshot,
                    copy_tick=reg_tick,
                )
        log.info(
            "%s: copied %d rows (%.1f MB) in %.2fs, indexes and constraints in %.2fs: catching-up",
            self.table,
            rows,
            moved / 1e6,
            copied - started,
            time.monotonic() - copied,
        )
        return True

    def copied_from_peer(self, snap_conn: psycopg.Connection, st: subscriber.SubscriberTable) -> None:
        """In the copy's transaction, a copy from a two-way peer: the copied rows count as the
        peer's, older than any change and seen by every master (one peer_copy row, not a version
        per row), and this master's other peers replay their changes to the table from where the
        copy leaves them - the tick of their queue that the source had applied in the copy's
        snapshot."""
        assert self.sub is not None and self.node.peer_of is not None
        self.sub.execute(
            "insert into pgcascade.peer_copy (table_name, xid, origin) values (%s, pg_current_xact_id(), %s)"
            " on conflict (table_name) do update set xid = excluded.xid, origin = excluded.origin",
            (self.table, self.node.provider_node),
        )
        applied = nodes.peer_ticks(snap_conn, self.queue)
        for other in nodes.peers(self.sub, self.node.peer_of):
            if other.queue_name == self.queue:
                continue
            since = applied.get(other.queue_name)
            if since is not None:
                with pgconn.connect(
                    nodes.provider_location(self.sub, other), autocommit=True, connect_timeout=10
                ) as prov:
                    consumer = copy_consumer_name(other.consumer, self.table)
                    with contextlib.suppress(psycopg.errors.NoDataFound, psycopg.errors.RaiseException):
                        q.unregister_consumer(prov, other.queue_name, consumer)
                    q.register_consumer_at(prov, other.queue_name, consumer, since)
            subscriber.catch_up_peer_table(self.sub, other.queue_name, self.table, st.key_columns, since)
            log.info(
                "%s: changes from %s replayed from tick %s of its queue",
                self.table,
                other.provider_node,
                since,
            )

    def apply_next_batch(self, st: subscriber.SubscriberTable, max_tick: int | None) -> bool:
        sub, prov = self.connect()
        info = q.next_batch(prov, self.queue, self.consumer, self.cfg.worker.max_batch_events, max_tick)
        if info.batch_id is None:
            return False
        if self.applier is None:
            fmt = set_tables.event_formats(prov, self.queue).get(self.table, "json")
            self.applier = TableApplier.build(sub, prov, st, fmt)
        started = time.monotonic()
        with sub.transaction():
            sub.execute(APPLY_SETTINGS)
            done = subscriber.lock_copy_tick(sub, self.queue, self.table)
            stats = None
            if done is None or done == info.prev_tick_id:
                assert info.cur_tick_id is not None
                peer = peer_batch(sub, self.node, info.cur_tick_id)
                stage_batch(
                    prov,
                    sub,
                    info,
                    only_tables=[self.table],
                    peer=peer is not None,
                    peer_logical=self.prov_logical,
                )
                stats = apply_staged(sub, {self.table: self.applier}, skip=st.copy_snapshot, peer=peer)
                subscriber.set_copy_tick(sub, self.queue, self.table, info.cur_tick_id)
        if stats is None:  # the batch does not start at our record (see Worker.process_batch)
            assert done is not None
            q.resume_at(prov, self.queue, self.consumer, done)
            return True
        if st.state.phase is Phase.CATCHING_UP:
            pause_point("catching-up", self.table)  # applied and recorded, not finished on the provider
        q.finish_batch(prov, info.batch_id)
        log.info(
            "%s: {count: %d, ignored: %d, duration: %.3f}",
            self.table,
            stats.count,
            stats.ignored,
            time.monotonic() - started,
        )
        return True

    def finish(self, st: subscriber.SubscriberTable) -> None:
        assert self.sub is not None and self.prov is not None
        # the copy's consumer goes first: a table in state ok has no copy to drop it later, and
        # a registration left behind (the provider lost while dropping it) would hold the
        # provider's ticks and events for ever.  Gone already: a finish begun before
        with contextlib.suppress(psycopg.errors.NoDataFound):
            q.unregister_consumer(self.prov, self.queue, self.consumer)
        subscriber.set_state(self.sub, self.queue, self.table, states.OK, copy_snapshot=None, copy_pid=None)
        if self.origin is not None:
            self.sub.execute("select pg_replication_origin_session_reset()")
            logical.drop_origin(self.sub, self.origin)
        log.info("%s: in sync at tick %d: ok", self.table, st.copy_tick)
        self.stop_requested = True
