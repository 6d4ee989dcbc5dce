"""The lake sink: every batch's row changes as Parquet, per table, exactly once per tick.

Layout under the sink's path (readable by Spark, DuckDB, pyarrow as a partitioned dataset):

    DIR/_sink.json                        consumer, registration tick, tables and their keys
    DIR/<schema.table>/tick_id=<T>/part-0.parquet   changes of batch T (or the initial snapshot)
    DIR/_current/<schema.table>/          `sink compact`: each table's current state

DIR is a local path or a URI (file://, s3a://, hdfs://, gs://): the sink daemon writes through
pyarrow's filesystem layer, compaction through it and Spark's (see Lake).

Columns: op (S snapshot, I, U, D), tick_id, ev_id, txid, ev_time (the writing transaction's
now()), commit_time (pg_xact_commit_timestamp when track_commit_timestamp is on, else null),
then the table's columns, typed (PostgreSQL parses the event's row image with
pgcascade.event_row into the table's own row type).  D rows carry the deleted row.

Exactly once, across crashes: a batch is written table by table, each into a hidden
`_tmp.tick_id=T` directory renamed into place (atomic), and only then finished on the queue.
A batch that comes back after a crash has the same tick and the same events: tables already
in place are skipped, the others written.  A leftover hidden directory is removed first.
(On an object store a rename is what pyarrow's filesystem makes of it, not atomic: untested.)

The first start registers the consumer, then writes each table's rows (op S, tick_id = the
registration tick) under a snapshot taken after it: an event after the registration tick that
the snapshot already shows comes again as a later change, whose full row image wins in
compaction (the last change of a key by tick_id, ev_id), so the result is exact.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import psycopg
from psycopg import sql

from pgcascade.capture import tables as set_tables
from pgcascade.core import catalog, pgconn
from pgcascade.core.config import JobConfig
from pgcascade.core.daemon import Daemon
from pgcascade.core.errors import UserError
from pgcascade.core.hooks import pause_point
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import queue as q

log = logging.getLogger("pgcascade.sink")

META = "_sink.json"
CHUNK_ROWS = 50_000
META_COLUMNS = ("op", "tick_id", "ev_id", "txid", "ev_time", "commit_time")


def arrow_type(pg_type: str):
    """The Parquet (arrow) type for a PostgreSQL type; text for whatever has no exact match."""
    import pyarrow as pa

    base = pg_type.split("(")[0].strip()
    simple = {
        "smallint": pa.int16(),
        "integer": pa.int32(),
        "bigint": pa.int64(),
        "boolean": pa.bool_(),
        "real": pa.float32(),
        "double precision": pa.float64(),
        "date": pa.date32(),
        "timestamp without time zone": pa.timestamp("us"),
        "timestamp with time zone": pa.timestamp("us", tz="UTC"),
        "bytea": pa.binary(),
    }
    if base in simple:
        return simple[base]
    if base == "numeric" and "(" in pg_type:
        p, _, s = pg_type.split("(")[1].rstrip(")").partition(",")
        if int(p) <= 38:
            return pa.decimal128(int(p), int(s or 0))
    return pa.string()


def needs_text(arrow) -> bool:
    import pyarrow as pa

    return arrow == pa.string()


class Lake:
    """The sink's directory, on any filesystem pyarrow's layer reaches: a local path, file://,
    s3:// (s3a:// as Spark names it), hdfs://, gs://.  Every file operation of the sink and of
    its compaction goes through it; Spark reads and writes the data at `uri(...)`."""

    def __init__(self, location: str):
        from pyarrow import fs

        if "://" in location:
            self.base_uri = location.replace("s3://", "s3a://", 1).rstrip("/")
            self.fs, self.root = fs.FileSystem.from_uri(location.replace("s3a://", "s3://", 1))
        else:  # a local path: explicit file:// for Spark, whose default filesystem may be HDFS
            self.root = str(Path(location).expanduser().absolute())
            self.base_uri = "file://" + self.root
            self.fs = fs.LocalFileSystem()
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, fs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def uri(self, *parts: str) -> str:
        return "/".join([self.base_uri, *parts])

    def exists(self, path: str) -> bool:
        from pyarrow import fs

        return self.fs.get_file_info(path).type != fs.FileType.NotFound

    def remove_dir(self, path: str) -> None:
        if self.exists(path):
            self.fs.delete_dir(path)

    def make_dir(self, path: str) -> None:
        self.fs.create_dir(path, recursive=True)

    def move(self, src: str, dest: str) -> None:
        """A rename: atomic on a local filesystem and HDFS; on object stores pyarrow's own emulation."""
        self.fs.move(src, dest)

    def meta(self) -> dict | None:
        p = self.path(META)
        if not self.exists(p):
            return None
        with self.fs.open_input_stream(p) as f:
            return json.loads(f.read().decode())

    def save_meta(self, meta: dict) -> None:
        tmp = self.path(f".{META}.tmp")
        with self.fs.open_output_stream(tmp) as f:
            f.write(json.dumps(meta, indent=1).encode())
        self.move(tmp, self.path(META))

    def sync(self, path: str) -> None:
        """On a local filesystem: the file is on disk before its directory is renamed into place
        (remote stores make a file durable when its upload completes)."""
        if self.local:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def table_dir(self, table: str) -> str:
        return self.path(table)

    def final(self, table: str, tick: int) -> str:
        return self.path(table, f"tick_id={tick}")

    def staging(self, table: str, tick: int) -> str:
        return self.path(table, f"_tmp.tick_id={tick}")


class TableWriter:
    """Rows of one table of one batch into one Parquet file, in row groups of CHUNK_ROWS."""

    def __init__(self, lake: Lake, table: str, tick: int, columns: list[tuple[str, str]]):
        import pyarrow as pa

        self.lake, self.table, self.tick = lake, table, tick
        self.columns = columns
        meta = [
            pa.field("op", pa.string()),
            pa.field("tick_id", pa.int64()),
            pa.field("ev_id", pa.int64()),
            pa.field("txid", pa.int64()),
            pa.field("ev_time", pa.timestamp("us", tz="UTC")),
            pa.field("commit_time", pa.timestamp("us", tz="UTC")),
        ]
        self.schema = pa.schema(meta + [pa.field(c, arrow_type(t)) for c, t in columns])

    def write(self, cursor) -> int:
        """Stream the cursor's rows (in schema order) into the staged file, then rename it in."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        lake = self.lake
        stage = lake.staging(self.table, self.tick)
        lake.remove_dir(stage)
        lake.make_dir(stage)
        part = f"{stage}/part-0.parquet"
        n = 0
        with pq.ParquetWriter(part, self.schema, filesystem=lake.fs) as w:
            while rows := cursor.fetchmany(CHUNK_ROWS):
                cols = list(zip(*rows, strict=True))
                w.write_batch(
                    pa.RecordBatch.from_arrays(
                        [pa.array(c, type=f.type) for c, f in zip(cols, self.schema, strict=True)],
                        schema=self.schema,
                    )
                )
                n += len(rows)
        lake.sync(part)
        lake.move(stage, lake.final(self.table, self.tick))
        return n


def select_list(columns: list[tuple[str, str]], source: str) -> sql.Composable:
    """The table's columns from `source`, as text where the arrow type is text."""
    parts = []
    for c, t in columns:
        col = sql.SQL("{}.{}").format(sql.Identifier(source), sql.Identifier(c))
        parts.append(sql.SQL("{}::text").format(col) if needs_text(arrow_type(t)) else col)
    return sql.SQL(", ").join(parts)


def commit_time_expr(conn: psycopg.Connection) -> sql.Composable:
    on = scalar(conn, "select current_setting('track_commit_timestamp')::bool")
    if on:
        # (no % in the text: the statement runs with parameters)
        return sql.SQL("pgcascade.commit_time(e.ev_txid::text::xid8)")
    return sql.SQL("null::timestamptz")


class Sink(Daemon):
    name = "sink"

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        if not cfg.db or not cfg.queue_name:
            raise UserError(f"{cfg.path}: db and queue_name must be set")
        path = cfg.pipeline.sink_path
        if not path:
            raise UserError("sink needs --path DIR (or sink_path in the config)")
        self.lake = Lake(path)
        self.lake.make_dir(self.lake.root)
        self.db: str = cfg.db
        self.queue: str = cfg.queue_name
        self.consumer = cfg.pipeline.sink_consumer or cfg.job_name
        self.conn: psycopg.Connection | None = None

    def connect(self) -> psycopg.Connection:
        if self.conn is None or self.conn.closed:
            self.conn = pgconn.connect(self.db, autocommit=True, connect_timeout=10)
            self.conn.execute("set application_name = 'pgcascade sink'")
            self.conn.execute("set timezone = 'UTC'")
            q.listen(self.conn)
        return self.conn

    def drop_connections(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def shutdown(self) -> None:
        self.drop_connections()

    def tables(self, conn: psycopg.Connection) -> dict[str, dict]:
        out = {}
        for name, keys in set_tables.set_tables(conn, self.queue).items():
            cols = [(c.name, c.type) for c in catalog.columns(conn, name) if not c.generated]
            out[name] = {"keys": keys, "columns": cols}
        return out

    def work(self) -> bool:
        conn = self.connect()
        meta = self.lake.meta()
        if meta is None or not meta.get("snapshot_done"):
            self.initial_snapshot(conn)
            return True
        info = q.next_batch_info(conn, self.queue, self.consumer)
        if info.batch_id is None:
            return False
        self.write_batch(conn, info, meta)
        pause_point("sink-written")
        q.finish_batch(conn, info.batch_id)
        return True

    def initial_snapshot(self, conn: psycopg.Connection) -> None:
        """Register, then write every table's rows as op S under a snapshot taken after that."""
        q.register_consumer(conn, self.queue, self.consumer)
        reg = q.consumer_last_tick(conn, self.queue, self.consumer)
        assert reg is not None
        tables = self.tables(conn)
        with pgconn.connect(self.db, connect_timeout=10) as snap:
            snap.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            snap.read_only = True
            snap.execute("set local timezone = 'UTC'")
            for name, t in tables.items():
                self.lake.remove_dir(self.lake.final(name, reg))
                query = sql.SQL(
                    "select 'S', %s::int8, 0::int8, null::int8, null::timestamptz, null::timestamptz, {} from only {} s"
                ).format(select_list(t["columns"], "s"), sql.SQL(name))
                with snap.cursor(name="pgcascade_sink_snapshot") as cur:
                    cur.execute(query, (reg,))
                    n = TableWriter(self.lake, name, reg, t["columns"]).write(cur)
                log.info("%s: initial snapshot of %d rows at tick %d", name, n, reg)
        self.lake.save_meta(
            {
                "consumer": self.consumer,
                "queue": self.queue,
                "registered_tick": reg,
                "snapshot_done": True,
                "tables": tables,
            }
        )

    def write_batch(self, conn: psycopg.Connection, info: q.BatchInfo, meta: dict) -> None:
        batch_sql = scalar(conn, "select pgcascade.batch_event_sql(%s)", (info.batch_id,))
        names = [
            r[0]
            for r in conn.execute(
                sql.SQL("select distinct ev_extra1 from ({}) b where ev_type in ('I', 'U', 'D')").format(
                    sql.SQL(batch_sql)
                )
            )
        ]
        tick = info.cur_tick_id
        assert tick is not None
        commit_time = commit_time_expr(conn)
        for name in names:
            if name not in meta["tables"]:  # added to the set after the sink started
                meta["tables"][name] = self.tables(conn)[name]
                self.lake.save_meta(meta)
            if self.lake.exists(self.lake.final(name, tick)):
                continue  # written before a crash: exactly once
            cols = meta["tables"][name]["columns"]
            query = sql.SQL(
                "select e.ev_type, %s::int8, e.ev_id, e.ev_txid, e.ev_time, {}, {}"
                " from ({}) e cross join lateral pgcascade.event_row(null::{}, e.ev_data) r"
                " where e.ev_extra1 = %s and e.ev_type in ('I', 'U', 'D') order by e.ev_id"
            ).format(commit_time, select_list(cols, "r"), sql.SQL(batch_sql), sql.SQL(name))
            with conn.transaction(), conn.cursor(name="pgcascade_sink_batch") as cur:
                cur.execute(query, (tick, name))
                n = TableWriter(self.lake, name, tick, cols).write(cur)
            log.info("%s: tick %d: %d changes", name, tick, n)
            pause_point("sink-table-written", name)


# --- compaction (Spark) -----------------------------------------------------------------------


def current_state(changes, keys: list[str]):
    """DataFrame of changes (META_COLUMNS + the table's) -> the table's current rows: per key the
    last change by (tick_id, ev_id), unless it is a delete."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    w = Window.partitionBy(*keys).orderBy(F.col("tick_id").desc(), F.col("ev_id").desc())
    latest = changes.withColumn("_n", F.row_number().over(w)).filter(F.col("_n") == 1)
    return latest.filter(F.col("op") != "D").drop("_n", *META_COLUMNS)


def compact(spark, location: str) -> dict[str, int]:
    """Write DIR/_current/<table> for every table of the lake; returns rows per table."""
    lake = Lake(location)
    meta = lake.meta()
    if meta is None:
        raise UserError(f"{location} is not a pgcascade sink directory (no {META})")
    out = {}
    for name, t in meta["tables"].items():
        if not lake.exists(lake.table_dir(name)):
            continue
        # recursive: the tick_id=T directories are not partitions (tick_id is a column already);
        # Spark skips the _tmp. staging directories (a leading underscore)
        changes = spark.read.option("recursiveFileLookup", "true").parquet(lake.uri(name))
        state = current_state(changes, t["keys"])
        tmp = f"_tmp.{name}"
        lake.remove_dir(lake.path("_current", tmp))
        state.write.mode("overwrite").parquet(lake.uri("_current", tmp))
        lake.remove_dir(lake.path("_current", name))
        lake.move(lake.path("_current", tmp), lake.path("_current", name))
        out[name] = spark.read.parquet(lake.uri("_current", name)).count()
    return out
