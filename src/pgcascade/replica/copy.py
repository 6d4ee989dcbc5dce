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

import psycopg
from psycopg import sql

from pgcascade.core import catalog, copystream, pgconn
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import Daemon
from pgcascade.core.errors import UserError
from pgcascade.pgq import node as nodes
from pgcascade.pgq import queue as q
from pgcascade.pgq.queue import TICK_CHANNEL
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import APPLY_SETTINGS, TableApplier, apply_staged, stage_batch
from pgcascade.replica.worker import next_batch, provider_formats, resume_at, state_tick

log = logging.getLogger("pgcascade.copy")


def pause_point(name: str, table: str) -> None:
    """Test hook: with PGCASCADE_PAUSE_AT=name in the environment, log and sleep here, so a
    test can SIGKILL the process at exactly this point of the state machine."""
    if os.environ.get("PGCASCADE_PAUSE_AT") == name and os.environ.get("PGCASCADE_PAUSE_TABLE") in (
        None,
        table,
    ):
        log.info("pause point %s (pid %d)", name, os.getpid())
        time.sleep(float(os.environ.get("PGCASCADE_PAUSE_SECONDS", "60")))


def copy_consumer_name(worker_name: str, table: str) -> str:
    return f"{worker_name}.copy.{table}"


class SavedDefinitions:
    """Indexes and constraints of a table (and foreign keys pointing at it), dropped around COPY."""

    def __init__(self, conn: psycopg.Connection, table: str):
        self.constraints = conn.execute(
            "select format('%%I.%%I', n.nspname, c.relname), con.conname, pg_get_constraintdef(con.oid), con.contype"
            " from pg_constraint con join pg_class c on c.oid = con.conrelid"
            " join pg_namespace n on n.oid = c.relnamespace"
            " where (con.conrelid = %s::regclass and con.contype in ('p', 'u', 'x', 'f'))"
            "    or (con.confrelid = %s::regclass and con.contype = 'f' and con.conrelid <> %s::regclass)"
            " order by con.contype = 'f' desc",
            (table, table, table),
        ).fetchall()
        self.indexes = conn.execute(
            "select format('%%I.%%I', n.nspname, ic.relname), pg_get_indexdef(i.indexrelid)"
            " from pg_index i join pg_class ic on ic.oid = i.indexrelid join pg_namespace n on n.oid = ic.relnamespace"
            " where i.indrelid = %s::regclass"
            " and not exists (select 1 from pg_constraint con where con.conindid = i.indexrelid)",
            (table,),
        ).fetchall()

    def drop(self, conn: psycopg.Connection) -> None:
        for owner, name, _, _ in self.constraints:  # foreign keys first: they depend on the keys
            conn.execute(
                sql.SQL("alter table {} drop constraint {}").format(sql.SQL(owner), sql.Identifier(name))
            )
        for name, _ in self.indexes:
            conn.execute(sql.SQL("drop index {}").format(sql.SQL(name)))

    def restore(self, conn: psycopg.Connection) -> None:
        for _, ddl in self.indexes:
            conn.execute(ddl.encode())
        for owner, name, definition, contype in reversed(self.constraints):
            add = sql.SQL("alter table {} add constraint {} {}").format(
                sql.SQL(owner), sql.Identifier(name), sql.SQL(definition)
            )
            if contype != "f":
                conn.execute(add)
                continue
            # a foreign key may point at rows another table has not received yet: add it
            # NOT VALID (enforcement is off under replication anyway) and validate when it holds
            conn.execute(sql.SQL("{} not valid").format(add))
            try:
                with conn.transaction():
                    conn.execute(
                        sql.SQL("alter table {} validate constraint {}").format(
                            sql.SQL(owner), sql.Identifier(name)
                        )
                    )
            except psycopg.errors.ForeignKeyViolation:
                log.warning(
                    "foreign key %s on %s left NOT VALID: rows refer to rows not copied yet", name, owner
                )


def copy_table(
    prov_dsn: str,
    snapshot: str,
    sub: psycopg.Connection,
    table: str,
    dest: str,
    cols: list[str],
    partitioned: bool,
) -> tuple[int, int]:
    """COPY the table, as of the exported snapshot, into dest in sub's transaction; (rows, bytes)."""
    collist = sql.SQL(", ").join(map(sql.Identifier, cols))
    only = sql.SQL("" if partitioned else "only ")
    out = sql.SQL("copy (select {} from {}{}) to stdout").format(collist, only, sql.SQL(table))
    into = sql.SQL("copy {} ({}) from stdin").format(sql.SQL(dest), collist)
    return copystream.stream_copy(prov_dsn, snapshot, out, sub, into, copystream.Progress(table))


class CopyProcess(Daemon):
    name = "copy"

    def __init__(self, cfg: JobConfig, table: str):
        super().__init__(cfg)
        if not cfg.queue_name or not cfg.db:
            raise UserError(f"{cfg.path}: db and queue_name must be set")
        self.queue = cfg.queue_name
        self.table = table
        self.loop_delay = 0.05  # polls its own table's state: the worker's hand-over is awaited here
        self.max_batch_events = int(cfg.raw.get("max_batch_events", 200000))
        cfg.pidfile = None  # the worker's pidfile is not ours; copy_pid in the database tells who runs
        self.sub: psycopg.Connection | None = None
        self.prov: psycopg.Connection | None = None
        self.connect()
        self.consumer = copy_consumer_name(self.node.worker_name or self.node.node_name, table)
        self.applier: TableApplier | None = None

    def connect(self) -> None:
        """(Re)connect to both databases; after a server restart the next round does this."""
        if self.sub is None or self.sub.closed:
            self.sub = pgconn.connect(self.cfg.db, autocommit=True, connect_timeout=10)
            self.sub.execute("set application_name = 'pgcascade copy'")
            self.node = nodes.require_node(self.sub, self.queue)
            self.prov_location = nodes.provider_location(self.sub, self.node)
        if self.prov is None or self.prov.closed:
            self.prov = pgconn.connect(self.prov_location, autocommit=True, connect_timeout=10)

    def table_state(self) -> subscriber.SubscriberTable | None:
        return subscriber.get_table(self.sub, self.queue, self.table)

    def work(self) -> bool:
        try:
            return self.step()
        except psycopg.OperationalError:
            self.shutdown()  # reconnect in the next round
            raise

    def step(self) -> bool:
        self.connect()
        st = self.table_state()
        if st is None or st.state is None or st.state == "ok":
            log.info(
                "%s: state %s, nothing for a copy process to do", self.table, st.state if st else "(removed)"
            )
            self.stop_requested = True
            return False
        if st.copy_pid != os.getpid():
            subscriber.set_state(self.sub, self.queue, self.table, st.state, copy_pid=os.getpid())
        if st.state == "in-copy":
            lacking = subscriber.provider_lacks(self.prov, self.queue, [self.table])
            if lacking:
                log.info("%s: waiting for the provider to hold it (%s)", self.table, lacking[self.table])
                return False
            self.initial_copy(st)
            return True
        if st.state == "catching-up":
            if self.apply_next_batch(st, max_tick=None):
                return True
            covered = self.prov.execute(
                "select pgcascade.tick_covers_snapshot(%s, %s, %s::pg_snapshot)",
                (self.queue, st.copy_tick, st.copy_snapshot),
            ).fetchone()[0]
            if not covered:
                return False  # hand over only at a tick taken after the copy's snapshot
            subscriber.set_state(self.sub, self.queue, self.table, f"wanna-sync:{st.copy_tick}")
            log.info("%s: caught up at tick %d: wanna-sync:%d", self.table, st.copy_tick, st.copy_tick)
            # wake the worker (it waits on the provider's tick channel) for the hand-over now,
            # not at the next tick: with no writes that is up to ticker_idle_period away
            self.prov.execute("select pg_notify(%s, %s)", (TICK_CHANNEL, self.queue))
            pause_point("wanna-sync", self.table)
            return False
        if st.state.startswith("do-sync"):
            pause_point("do-sync", self.table)
            target = state_tick(st.state)
            if (st.copy_tick or 0) >= target:
                self.finish(st)
                return False
            self.apply_next_batch(st, max_tick=target)
            return True
        return False  # wanna-sync: the worker's turn

    def initial_copy(self, st: subscriber.SubscriberTable) -> None:
        from pgcascade.pipeline import copy as spark_copy

        if spark_copy.wanted(self.cfg, self.sub, self.prov, self.queue, self.table):
            # a large table: key ranges copied by Spark tasks, resumable (pipeline/copy.py)
            spark_copy.SparkCopy(self, st).run()
            return
        with contextlib.suppress(psycopg.errors.NoDataFound, psycopg.errors.RaiseException):
            q.unregister_consumer(self.prov, self.queue, self.consumer)
        q.register_consumer(self.prov, self.queue, self.consumer)
        reg_tick = self.prov.execute(
            "select last_tick from pgcascade.get_consumer_info(%s, %s)", (self.queue, self.consumer)
        ).fetchone()[0]
        started = time.monotonic()
        dest_cols = {c.name for c in catalog.columns(self.sub, st.dest_table) if not c.generated}
        cols = [
            c.name for c in catalog.columns(self.prov, self.table) if c.name in dest_cols and not c.generated
        ]
        with pgconn.connect(self.prov_location, connect_timeout=10) as snap_conn:
            snap_conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            snap_conn.read_only = True
            # the transaction's snapshot: every event committed before it is in the copied rows
            snapshot = snap_conn.execute("select pg_current_snapshot()::text").fetchone()[0]
            log.info("%s: copying under snapshot %s, catch-up from tick %d", self.table, snapshot, reg_tick)
            with self.sub.transaction():
                self.sub.execute(APPLY_SETTINGS)
                saved = SavedDefinitions(self.sub, st.dest_table)
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
                )
                copied = time.monotonic()
                pause_point("in-copy", self.table)
                saved.restore(self.sub)
                subscriber.set_state(
                    self.sub,
                    self.queue,
                    self.table,
                    "catching-up",
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

    def apply_next_batch(self, st: subscriber.SubscriberTable, max_tick: int | None) -> bool:
        info = next_batch(self.prov, self.queue, self.consumer, self.max_batch_events, max_tick)
        if info.batch_id is None:
            return False
        if self.applier is None:
            fmt = provider_formats(self.prov, self.queue).get(self.table, "json")
            self.applier = TableApplier.build(self.sub, self.prov, st, fmt)
        started = time.monotonic()
        with self.sub.transaction():
            self.sub.execute(APPLY_SETTINGS)
            done = self.sub.execute(
                "select copy_tick from pgcascade.subscriber_table where queue_name = %s and table_name = %s for update",
                (self.queue, self.table),
            ).fetchone()[0]
            stats = None
            if done is None or done == info.prev_tick_id:
                stage_batch(self.prov, self.sub, info.batch_id, only_table=self.table)
                stats = apply_staged(self.sub, {self.table: self.applier}, skip=st.copy_snapshot)
                self.sub.execute(
                    "update pgcascade.subscriber_table set copy_tick = %s where queue_name = %s and table_name = %s",
                    (info.cur_tick_id, self.queue, self.table),
                )
        if stats is None:  # the batch does not start at our record (see Worker.process_batch)
            resume_at(self.prov, self.queue, self.consumer, done)
            return True
        if st.state == "catching-up":
            pause_point("catching-up", self.table)  # applied and recorded, not finished on the provider
        self.prov.execute("select pgcascade.finish_batch(%s)", (info.batch_id,))
        log.info(
            "%s: {count: %d, ignored: %d, duration: %.3f}",
            self.table,
            stats.count,
            stats.ignored,
            time.monotonic() - started,
        )
        return True

    def finish(self, st: subscriber.SubscriberTable) -> None:
        subscriber.set_state(self.sub, self.queue, self.table, "ok", copy_snapshot=None, copy_pid=None)
        with contextlib.suppress(psycopg.Error):
            q.unregister_consumer(self.prov, self.queue, self.consumer)
        log.info("%s: in sync at tick %d: ok", self.table, st.copy_tick)
        self.stop_requested = True

    def shutdown(self) -> None:
        for c in (self.sub, self.prov):
            if c is not None:
                c.close()
        self.sub = self.prov = None
