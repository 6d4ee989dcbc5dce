"""Resumable parallel copy: a large table's initial copy as Spark tasks, one key range each.

It replaces only the in-copy step of the copy state machine (replica/copy.py); catching-up, wanna-sync
and do-sync are unchanged.  Steps, each durable:

1. Plan (one subscriber transaction): register the copy consumer (its first tick is where
   catch-up starts), open a provider REPEATABLE READ transaction and export its snapshot S1,
   drop the destination's indexes and constraints (their DDL is kept in copy_plan), truncate,
   and record the key ranges in copy_range.
2. Ranges: one Spark task per range not done: import the coordinator's exported snapshot on
   the provider; in one subscriber transaction COPY out / COPY in and mark the range done (so a
   range not done never holds rows of ours, and a retried task needs no cleanup).
3. Finish (one subscriber transaction): restore indexes and constraints, set catching-up with
   copy_snapshot = S1 and copy_tick = the consumer's first tick.

A copy that dies continues at step 2 with the ranges not done, under a new snapshot S2 (S1
died with its transaction).  That is still exact: catch-up applies every event not visible in
S1, and the apply is an upsert of each key's last row (apply.py), so events between S1 and S2
that the S2 ranges already contain are applied again to the same result.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time

import psycopg
from psycopg import sql

from pgcascade.core import catalog, copystream, pgconn
from pgcascade.core.config import JobConfig
from pgcascade.core.pgconn import one, scalar
from pgcascade.pipeline import segments as sg
from pgcascade.pipeline.session import build_session, cluster_parallelism, is_local, master_of
from pgcascade.replica import state as states
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import APPLY_SETTINGS
from pgcascade.replica.copy import CopyProcess
from pgcascade.replica.definitions import SavedDefinitions

log = logging.getLogger("pgcascade.copy")

PROGRESS_EVERY = 5.0
RANGE_APP_PREFIX = "pgcascade copy range "


def min_rows(cfg: JobConfig) -> int | None:
    """spark_copy_min_rows: tables with at least this many rows (estimated) copy through Spark;
    0 or off: never."""
    return cfg.pipeline.spark_copy_min_rows


def estimated_rows(prov: psycopg.Connection, table: str) -> int:
    est = catalog.estimated_rows(prov, table)
    if est is None:  # never analysed
        est = scalar(prov, sql.SQL("select count(*) from {}").format(sql.SQL(table)))
    return est


def has_plan(sub: psycopg.Connection, queue: str, table: str) -> bool:
    return scalar(
        sub,
        "select exists (select 1 from pgcascade.copy_plan where queue_name = %s and table_name = %s and finished is null)",
        (queue, table),
    )


def wanted(cfg: JobConfig, sub: psycopg.Connection, prov: psycopg.Connection, queue: str, table: str) -> bool:
    """Whether this table's copy runs as Spark tasks: a plan in progress always continues."""
    if has_plan(sub, queue, table):
        return True
    threshold = min_rows(cfg)
    return threshold is not None and several_streams(cfg) and estimated_rows(prov, table) >= threshold


def several_streams(cfg: JobConfig) -> bool:
    """Whether the Spark copy would copy ranges side by side.  One local stream is slower than
    the single pipe (2.4-3.3x on 2 cores: JVM start, a Python relay per range), so a host with
    under 4 cores in local mode copies through the pipe - unless spark_copy_streams is set,
    which asks for the Spark copy (resumable by range) whatever it costs."""
    p = cfg.pipeline
    if p.spark_copy_streams or p.spark_remote or not is_local(p.spark_master):
        return True
    return local_streams() >= 2


def local_streams() -> int:
    """Ranges copied at once in local mode: half this host's cores (a COPY stream keeps about
    two busy)."""
    return max(1, (os.cpu_count() or 2) // 2)


def forget_plan(sub: psycopg.Connection, queue: str, table: str) -> None:
    """Before a new copy of the table: drop an old plan, putting back the indexes and
    constraints an unfinished one had dropped (the new copy saves and drops them again)."""
    row = sub.execute(
        "select definitions, finished from pgcascade.copy_plan where queue_name = %s and table_name = %s",
        (queue, table),
    ).fetchone()
    if row is None:
        return
    with sub.transaction():
        if row[1] is None:
            st = subscriber.get_table(sub, queue, table)
            if st is not None and catalog.table_exists(sub, st.dest_table):
                SavedDefinitions.from_json(row[0]).restore(sub)
        sub.execute(
            "delete from pgcascade.copy_plan where queue_name = %s and table_name = %s", (queue, table)
        )


@dataclasses.dataclass(frozen=True)
class RangeTask:
    """What one Spark task needs (pickled into it)."""

    range_no: int
    lo: list[str] | None
    hi: list[str] | None


@dataclasses.dataclass(frozen=True)
class CopyContext:
    queue: str
    table: str
    prov_dsn: str
    sub_dsn: str
    snapshot: str  # exported snapshot id of this attempt
    attempt: int
    spec: sg.TableSpec


def copy_range(ctx: CopyContext, r: RangeTask) -> tuple[int, int]:
    """Copy one key range and mark it done, in one subscriber transaction; (rows, bytes)."""
    spec = ctx.spec
    where = sg.key_range(spec, r.lo, r.hi)
    cols = sql.SQL(", ").join(map(sql.Identifier, spec.columns))
    out = sql.SQL("copy (select {} from {} where {}) to stdout").format(cols, spec.relation("prov"), where)
    into = sql.SQL("copy {} ({}) from stdin").format(sql.SQL(spec.dest), cols)
    started = time.monotonic()
    with pgconn.connect(ctx.sub_dsn, connect_timeout=10) as sub:
        sub.execute(APPLY_SETTINGS)
        # names the range in pg_stat_activity: the monitor's per-range progress and ETA
        sub.execute(
            sql.SQL("set application_name = {}").format(sql.Literal(f"{RANGE_APP_PREFIX}{r.range_no}"))
        )
        done = scalar(
            sub,
            "select done from pgcascade.copy_range where queue_name = %s and table_name = %s and range_no = %s"
            " for update",
            (ctx.queue, ctx.table, r.range_no),
        )
        if done:  # a retried task: this range committed in its first try
            return 0, 0
        # no DELETE of the range first: the COPY and the done mark commit together, so a range
        # not marked done holds none of our rows (and a DELETE on the unindexed table would
        # scan all of it, per range)
        rows, moved = copystream.stream_copy(ctx.prov_dsn, ctx.snapshot, out, sub, into)
        sub.execute(
            "update pgcascade.copy_range set done = true, rows = %s, bytes = %s, seconds = %s, done_at = now(),"
            " attempt = %s where queue_name = %s and table_name = %s and range_no = %s",
            (rows, moved, time.monotonic() - started, ctx.attempt, ctx.queue, ctx.table, r.range_no),
        )
        sub.commit()
    return rows, moved


def copy_ranges(spark, ctx: CopyContext, ranges: list[RangeTask], streams: int):
    """-> DataFrame(range_no, rows, bytes): `streams` Spark tasks, task i copying ranges i,
    i + streams, ... one after the other (each range in its own transaction)."""
    n = max(1, min(streams, len(ranges)))

    def task(batches):
        import pyarrow as pa

        schema = pa.schema([("range_no", pa.int32()), ("rows", pa.int64()), ("bytes", pa.int64())])
        for b in batches:
            for i in b.column(0).to_pylist():
                for r in ranges[i::n]:
                    rows, moved = copy_range(ctx, r)
                    yield pa.RecordBatch.from_pylist(
                        [{"range_no": r.range_no, "rows": rows, "bytes": moved}], schema=schema
                    )

    return spark.range(0, n, 1, n).mapInArrow(task, "range_no int, rows long, bytes long")


def copy_streams(cfg: JobConfig, spark, dsns: list[str]) -> int:
    """spark_copy_streams: ranges copied at once.  Default: in local mode half the cores of this
    host (a COPY stream keeps about two cores busy - the provider's COPY TO, the subscriber's
    COPY FROM - and the databases share this host's cores); on a cluster its cores.  Either way
    at most half the free connection slots of each database: the application keeps the rest."""
    if cfg.pipeline.spark_copy_streams:
        return cfg.pipeline.spark_copy_streams
    local = is_local(master_of(spark))
    wanted = local_streams() if local else cluster_parallelism(spark)
    return max(1, min(wanted, *(connection_room(dsn) // 2 for dsn in dsns)))


def connection_room(dsn: str) -> int:
    """Connections a database still takes from ordinary roles."""
    with pgconn.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        return int(
            scalar(
                conn,
                "select current_setting('max_connections')::int"
                " - current_setting('superuser_reserved_connections')::int"
                " - (select count(*) from pg_stat_activity where backend_type = 'client backend')",
            )
        )


def progress(conn: psycopg.Connection, queue: str, table: str | None = None) -> list[dict]:
    """Per table with a copy plan: ranges done, rows and bytes copied, rate and ETA of this attempt."""
    rows = conn.execute(
        "select p.table_name, p.attempt, p.est_rows, p.finished is not null,"
        " count(*) filter (where r.done), count(*), coalesce(sum(r.rows), 0)::int8, coalesce(sum(r.bytes), 0)::int8,"
        " coalesce(sum(r.rows) filter (where r.attempt = p.attempt), 0)::int8,"
        " coalesce(sum(r.bytes) filter (where r.attempt = p.attempt), 0)::int8,"
        " extract(epoch from coalesce(p.finished, now()) - p.attempt_started)::float8"
        " from pgcascade.copy_plan p join pgcascade.copy_range r using (queue_name, table_name)"
        " where p.queue_name = %s and (%s::text is null or p.table_name = %s)"
        " group by p.table_name, p.attempt, p.est_rows, p.finished, p.attempt_started order by 1",
        (queue, table, table),
    ).fetchall()
    out = []
    for name, attempt, est, finished, done, total, nrows, nbytes, arows, abytes, secs in rows:
        secs = float(secs or 0)
        rate_rows = arows / secs if secs > 0 else 0
        eta = max((est or 0) - nrows, 0) / rate_rows if rate_rows > 0 and not finished else None
        out.append(
            {
                "table": name,
                "attempt": attempt,
                "finished": finished,
                "ranges_done": done,
                "ranges": total,
                "rows": nrows,
                "rows_total": est,
                "bytes": nbytes,
                "mb_per_s": abytes / secs / 1e6 if secs > 0 else 0.0,
                "rows_per_s": rate_rows,
                "eta": eta,
            }
        )
    return out


def progress_line(p: dict) -> str:
    eta = "-" if p["eta"] is None else f"{p['eta']:.0f} s"
    state = "done" if p["finished"] else f"attempt {p['attempt']}"
    return (
        f"spark copy {p['table']}: {p['ranges_done']}/{p['ranges']} ranges, {p['rows']} rows,"
        f" {p['bytes'] / 1e6:.1f} MB, {p['mb_per_s']:.1f} MB/s, ETA {eta} ({state})"
    )


class SparkCopy:
    """The in-copy step of one table as Spark tasks (run by the table's copy process)."""

    def __init__(self, proc: CopyProcess, st: subscriber.SubscriberTable):
        self.proc = proc  # the CopyProcess: its connections, queue, consumer name, config
        self.st = st
        self.queue = proc.queue
        self.table = proc.table
        self.sub, self.prov = proc.connect()

    def spec(self, prov: psycopg.Connection) -> sg.TableSpec:
        dest_cols = {c.name for c in catalog.columns(self.sub, self.st.dest_table) if not c.generated}
        st = self.st
        spec = sg.table_spec(
            0, prov, self.sub, self.table, st.dest_table, st.key_columns, st.row_filter, st.column_list
        )
        keep = [(c, t) for c, t in zip(spec.columns, spec.types, strict=True) if c in dest_cols]
        return dataclasses.replace(spec, columns=tuple(c for c, _ in keep), types=tuple(t for _, t in keep))

    def run(self) -> bool:
        sub, prov = self.sub, self.prov
        # the consumer first, then the snapshot: every event the snapshot misses is after its tick
        reg_tick = None if has_plan(sub, self.queue, self.table) else self.proc.register_own_consumer()
        with pgconn.connect(self.proc.prov_location, connect_timeout=10) as holder:
            holder.execute(sg.SESSION_SETTINGS)
            holder.commit()
            holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            holder.read_only = True
            # this attempt's snapshot: exported for the tasks, held until they are done
            exported = scalar(holder, "select pg_export_snapshot()")
            current = scalar(holder, "select pg_current_snapshot()::text")
            if reg_tick is not None and self.proc.ddl_pending(current):
                return False
            spec = self.spec(holder)
            if reg_tick is not None:
                self.plan(holder, spec, current, reg_tick)
                attempt = 1
            else:
                attempt = scalar(
                    sub,
                    "update pgcascade.copy_plan set attempt = attempt + 1, attempt_started = now()"
                    " where queue_name = %s and table_name = %s returning attempt",
                    (self.queue, self.table),
                )
            pending = [
                RangeTask(n, lo, hi)
                for n, lo, hi in sub.execute(
                    "select range_no, lo, hi from pgcascade.copy_range"
                    " where queue_name = %s and table_name = %s and not done order by range_no",
                    (self.queue, self.table),
                )
            ]
            log.info("%s: spark copy attempt %d: %d range(s) to copy", self.table, attempt, len(pending))
            if pending:
                ctx = CopyContext(
                    self.queue, self.table, self.proc.prov_location, self.proc.db, exported, attempt, spec
                )
                self.run_tasks(ctx, pending)
        self.finish(prov)
        return True

    def plan(self, holder: psycopg.Connection, spec: sg.TableSpec, snapshot: str, reg_tick: int) -> None:
        sub = self.sub
        cuts = sg.split_points(holder, spec, range_rows(self.proc.cfg), 100_000)
        bounds = [None, *cuts, None]
        with sub.transaction():
            sub.execute(APPLY_SETTINGS)
            saved = SavedDefinitions.read(sub, self.st.dest_table)
            saved.drop(sub)
            if not self.st.skip_truncate:
                only = "" if catalog.is_partitioned(sub, self.st.dest_table) else "only "
                sub.execute(sql.SQL(f"truncate {only}{{}}").format(sql.SQL(self.st.dest_table)))
            sub.execute(
                "insert into pgcascade.copy_plan (queue_name, table_name, reg_tick, first_snapshot, definitions, est_rows)"
                " values (%s, %s, %s, %s::pg_snapshot, %s::jsonb, %s)",
                (
                    self.queue,
                    self.table,
                    reg_tick,
                    snapshot,
                    saved.to_json(),
                    estimated_rows(holder, self.table),
                ),
            )
            with sub.cursor() as cur:
                cur.executemany(
                    "insert into pgcascade.copy_range (queue_name, table_name, range_no, lo, hi) values (%s, %s, %s, %s, %s)",
                    [
                        (self.queue, self.table, i, lo, hi)
                        for i, (lo, hi) in enumerate(itertools.pairwise(bounds))
                    ],
                )
        log.info(
            "%s: spark copy planned: %d range(s), catch-up from tick %d",
            self.table,
            len(bounds) - 1,
            reg_tick,
        )

    def run_tasks(self, ctx: CopyContext, pending: list[RangeTask]) -> None:
        spark = build_session(self.proc.cfg, f"pgcascade copy {self.table}")
        stop = threading.Event()
        watcher = threading.Thread(target=self.report_progress, args=(stop,), daemon=True)
        watcher.start()
        try:
            streams = copy_streams(self.proc.cfg, spark, [ctx.prov_dsn, ctx.sub_dsn])
            log.info("%s: %d range(s) at once on %s", self.table, streams, master_of(spark))
            copy_ranges(spark, ctx, pending, streams).collect()
        finally:
            stop.set()
            watcher.join()

    def report_progress(self, stop: threading.Event) -> None:
        with pgconn.connect(self.proc.db, autocommit=True, connect_timeout=10) as conn:
            while not stop.wait(PROGRESS_EVERY):
                for p in progress(conn, self.queue, self.table):
                    log.info("%s", progress_line(p))

    def finish(self, prov: psycopg.Connection) -> None:
        sub = self.sub
        started = time.monotonic()
        with sub.transaction():
            sub.execute(APPLY_SETTINGS)
            defs, reg_tick, snapshot = one(
                sub,
                "select definitions, reg_tick, first_snapshot::text from pgcascade.copy_plan"
                " where queue_name = %s and table_name = %s for update",
                (self.queue, self.table),
            )
            SavedDefinitions.from_json(defs).restore(sub)
            sub.execute(
                "update pgcascade.copy_plan set finished = now() where queue_name = %s and table_name = %s",
                (self.queue, self.table),
            )
            subscriber.set_state(
                sub, self.queue, self.table, states.CATCHING_UP, copy_snapshot=snapshot, copy_tick=reg_tick
            )
        for p in progress(sub, self.queue, self.table):
            log.info("%s", progress_line(p))
        log.info(
            "%s: spark copy done, indexes and constraints in %.2fs: catching-up",
            self.table,
            time.monotonic() - started,
        )


def range_rows(cfg: JobConfig) -> int:
    return cfg.pipeline.spark_copy_range_rows


class SparkCopier:
    """The Spark copy as the copy process's BulkCopier (replica/copy.py): the `worker` and
    `copy` commands plug it in."""

    def wanted(
        self, cfg: JobConfig, sub: psycopg.Connection, prov: psycopg.Connection, queue: str, table: str
    ) -> bool:
        return wanted(cfg, sub, prov, queue, table)

    def run(self, process: CopyProcess, st: subscriber.SubscriberTable) -> bool:
        return SparkCopy(process, st).run()

    def forget(self, sub: psycopg.Connection, queue: str, table: str) -> None:
        forget_plan(sub, queue, table)
