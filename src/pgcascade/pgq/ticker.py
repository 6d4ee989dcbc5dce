"""The ticker daemon (pgqd's job): ticks and queue maintenance for many databases.

For every database it serves it asks `pgcascade.ticker_round()` to tick the queues that need it
(the thresholds live in each queue's row), and asks again when that says a tick can next be due:
after `ticker_period` at the least, `MAX_SLEEP` at the most.  It moves due retry events back
every `retry_period`, runs what `pgcascade.maint_operations()` lists (rotation, tick cleanup)
every `maint_period`, and VACUUMs the small queue tables every `vacuum_period`.  Each call
is a transaction of its own.  A database that goes away is retried with back-off; the others
are served meanwhile.  Maintenance that did something is logged, one line per action.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import psycopg
from psycopg import sql

from pgcascade.core import metrics, pgconn, privileges
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import Daemon
from pgcascade.core.daemonlock import AlreadyRunning, DaemonLock, DaemonRole
from pgcascade.core.errors import db_error_line
from pgcascade.core.pgconn import scalar

log = logging.getLogger("pgcascade.ticker")

REFUSED_RETRY = 30.0  # seconds before a database another ticker serves is tried again
# the longest sleep between rounds: a new queue, a burst of events (ticker_max_count) or a stop
# request waits no longer than this (the defaults ask every ticker_max_lag, 50 ms)
MAX_SLEEP = 0.25


def conninfo_for(base: str, dbname: str) -> str:
    return psycopg.conninfo.make_conninfo(base, dbname=dbname)


@dataclass
class DatabaseTicker:
    """The ticker's state for one database.  Its connection is the one that holds the ticker's
    lock in that database (core/daemonlock.py): one ticker per database, whatever its config."""

    name: str
    lock: DaemonLock
    conn: psycopg.Connection | None = None
    down_since: float | None = None
    reconnect_at: float = 0.0
    backoff: float = 0.0
    next_retry: float = 0.0
    next_maint: float = 0.0
    next_vacuum: float = 0.0
    ticks: int = 0
    due_at: float = 0.0  # when a tick can next be due here (ticker_round)
    refused: str | None = None  # another ticker serves this database: its description

    def connect(self) -> psycopg.Connection:
        """The lock's connection: taken (again) first, and a heartbeat at most once a second."""
        conn = self.lock.keep()
        if conn is not self.conn:
            self.conn = conn
            if self.down_since is not None:
                log.info("db %s: connected again after %.1fs", self.name, time.monotonic() - self.down_since)
            self.down_since = None
            self.backoff = 0.0
            self.refused = None
        return conn

    def lost(self, err: Exception) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            log.warning(
                "db %s: %s; retrying",
                self.name,
                db_error_line(err) if isinstance(err, psycopg.Error) else err,
            )
        self.backoff = min(max(self.backoff * 2, 0.5), 10.0)
        self.reconnect_at = now + self.backoff
        self.lock.close()
        self.conn = None

    def served_elsewhere(self, err: AlreadyRunning) -> None:
        """Another ticker holds this database's lock: leave it to that one, look again later."""
        if self.refused != str(err):
            log.error("db %s: %s; not ticking it while that one runs", self.name, err)
        self.refused = str(err)
        self.reconnect_at = time.monotonic() + REFUSED_RETRY
        self.lock.close()
        self.conn = None

    def close(self) -> None:
        self.lock.release()
        self.conn = None


class Ticker(Daemon):
    name = "ticker"

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        self.dbs: dict[str, DatabaseTicker] = {}
        self.next_discover = 0.0
        self.reload()

    def reload(self) -> None:
        self.settings = self.cfg.ticker
        self.loop_delay = self.settings.ticker_period
        self.next_discover = 0.0

    # --- which databases ---
    def configured_databases(self) -> dict[str, str] | None:
        """name -> connstr of the databases named in the config, or None to discover them."""
        if self.settings.database_list:
            return {d: conninfo_for(self.settings.base_connstr, d) for d in self.settings.database_list}
        if self.cfg.db:
            dbname = psycopg.conninfo.conninfo_to_dict(self.cfg.db).get("dbname", "db")
            return {str(dbname): self.cfg.db}
        return None

    def discover(self) -> dict[str, str]:
        """Every database of the server (through initial_database) that has pgcascade installed."""
        found: dict[str, str] = {}
        with pgconn.connect(
            conninfo_for(self.settings.base_connstr, self.settings.initial_database),
            autocommit=True,
            connect_timeout=5,
        ) as conn:
            names = [
                r[0] for r in conn.execute("select datname from pg_database where datallowconn order by 1")
            ]
        for name in names:
            cs = conninfo_for(self.settings.base_connstr, name)
            try:
                with pgconn.connect(cs, autocommit=True, connect_timeout=5) as c:
                    if scalar(c, "select to_regclass('pgcascade.queue') is not null"):
                        found[name] = cs
            except psycopg.Error:
                continue
        return found

    def refresh_databases(self, now: float) -> None:
        if now < self.next_discover:
            return
        wanted = self.configured_databases()
        if wanted is None:
            try:
                wanted = self.discover()
            except psycopg.Error as e:
                log.warning("database discovery failed: %s", db_error_line(e))
                self.next_discover = now + min(self.settings.discover_period, 5.0)
                return
            self.next_discover = now + self.settings.discover_period
        else:
            self.next_discover = float("inf")
        for name in set(self.dbs) - set(wanted):
            log.info("db %s: no longer served", name)
            self.dbs.pop(name).close()
        for name, cs in wanted.items():
            if name not in self.dbs:
                log.info("db %s: serving", name)
                lock = DaemonLock(cs, DaemonRole.TICKER, "", self.cfg.job_name, str(self.cfg.path))
                self.dbs[name] = DatabaseTicker(name, lock)

    def claim(self) -> None:
        """Before the first round: a database another ticker serves refuses the start."""
        self.refresh_databases(time.monotonic())
        for db in self.dbs.values():
            try:
                db.connect()
            except psycopg.Error as e:
                db.lost(e)

    # --- the work ---
    def work(self) -> bool:
        now = time.monotonic()
        self.refresh_databases(now)
        for db in list(self.dbs.values()):
            if self.stop_requested:
                break
            if db.reconnect_at > now or db.due_at > now:
                continue
            try:
                self.serve(db, now)
            except AlreadyRunning as e:
                db.served_elsewhere(e)
            except psycopg.OperationalError as e:
                db.lost(e)
            except psycopg.Error as e:
                log.error("db %s: %s", db.name, privileges.explain(e, db.lock.dsn))
                db.lost(e)
        self.loop_delay = self.next_round(time.monotonic())
        return False

    def next_round(self, now: float) -> float:
        """Seconds to sleep: until the first database may need a tick or a reconnect, bounded
        by ticker_period and MAX_SLEEP."""
        wake = min((max(db.due_at, db.reconnect_at) for db in self.dbs.values()), default=now)
        period = self.settings.ticker_period
        return max(period, min(wake - now, MAX_SLEEP))

    def serve(self, db: DatabaseTicker, now: float) -> None:
        conn = db.connect()
        row = conn.execute("select ticks, due_in from pgcascade.ticker_round()").fetchone()
        assert row is not None
        n, due_in = row
        # a round's maintenance below comes due on its own timers, at most MAX_SLEEP late
        db.due_at = now + min(due_in if due_in is not None else 0.0, MAX_SLEEP)
        db.ticks += n
        if self.metrics and n:
            metrics.TICKS.labels(db.name).inc(n)
        if now >= db.next_retry:
            db.next_retry = now + self.settings.retry_period
            moved = scalar(conn, "select pgcascade.maint_retry_events()")
            if moved:
                log.info("db %s: maint_retry_events: %d events back in their queues", db.name, moved)
        if now >= db.next_maint:
            db.next_maint = now + self.settings.maint_period
            self.maintain(db, conn)
        if now >= db.next_vacuum:
            db.next_vacuum = now + self.settings.vacuum_period
            self.vacuum(db, conn)

    def maintain(self, db: DatabaseTicker, conn: psycopg.Connection) -> None:
        ops = conn.execute("select func_name, func_arg from pgcascade.maint_operations()").fetchall()
        for func, arg in ops:
            if func == "pgcascade.maint_retry_events":
                continue  # on its own, faster schedule
            schema, fname = func.split(".", 1)
            call = sql.SQL("select {}({})").format(
                sql.Identifier(schema, fname), sql.Literal(arg) if arg is not None else sql.SQL("")
            )
            result = scalar(conn, call)
            if result:
                log.info("db %s: %s(%s): %s", db.name, fname, arg or "", result)

    def vacuum(self, db: DatabaseTicker, conn: psycopg.Connection) -> None:
        tables = [r[0] for r in conn.execute("select pgcascade.maint_tables_to_vacuum()")]
        started = time.monotonic()
        for t in tables:
            schema, name = t.split(".", 1)
            conn.execute(sql.SQL("vacuum {}").format(sql.Identifier(schema, name)))
        log.info("db %s: vacuum of %d queue tables: %.2fs", db.name, len(tables), time.monotonic() - started)

    def shutdown(self) -> None:
        for db in self.dbs.values():
            db.close()
