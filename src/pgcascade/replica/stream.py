"""A large batch applied while it streams, its chunks decoded by a second session.

A batch goes into the apply session's stage and is applied there by one statement per table
(apply.py): its one backend streams the events in, decodes every event's JSON, sorts by key
and writes, each in turn, on one core - a 5M-row UPDATE took 1.5x native's apply, whose
walsender decodes while its apply worker writes.  Past `stream_chunk_events` events, the
batch is cut into chunks as it streams, still in one transaction of the apply session:

- the first chunk stays in the apply session's stage and is applied there as any batch,
  once it holds only row changes of tables with a set-based statement (anything else - a
  TRUNCATE, DDL, partial SQL - and the rest of the batch joins it in the stage: applied whole);
- every later chunk is relayed into a second session of the worker (`Streamer`), which checks
  it likewise, decodes it, and reduces each table's events to the last one per key into an
  unlogged table of plain typed columns (`pgcascade.pgcascade_chunk_*`), while the apply
  session writes the chunk before it from its table (a MERGE over typed rows in key order:
  5M rows 30 -> 18 s on the same machine, the decoding, 8 s, done beside it);
- a chunk applied after another must not undo a later change: the stream is in the queue's
  physical order, which is not ev_id order (concurrent backends fill pages of their own), so
  an event at or below the highest ev_id of the chunks before it is late: it is kept aside,
  and once every chunk is applied each key with a late event is written again from its last
  event in the whole batch.  A key without a late event had its events applied in ev_id order.
- a chunk the second session refuses (an event of another kind) or any failure of a chunk's
  statement rolls the batch's transaction back, and the batch is applied whole, the old way.

Exactly once is the batch's transaction's, as before: the chunks' tables are a cache (unlogged,
dropped after each batch, and those a crash left by the worker's first batch after it starts).
The second session is closed after each large batch: a leaf keeps one connection otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import queue as queues
import threading
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from pgcascade.core import catalog, pgconn, roundtrip
from pgcascade.core.errors import db_error_line
from pgcascade.core.hooks import pause_point
from pgcascade.pgq import queue as q
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica import applysql
from pgcascade.replica.apply import MAX_EV_ID, BatchStats, TableApplier, Writes, apply_staged
from pgcascade.replica.stage import STAGE_COLUMNS, STAGE_TABLE, stage_statements

log = logging.getLogger("pgcascade.replay")

LANDING = "pg_temp.pgcascade_landing"
# a table of raw events (STAGE_COLUMNS), as they come from the provider's queue
RAW_EVENTS = "(ev_id int8, ev_txid int8, ev_type text, ev_data text, ev_extra1 text)"
LANDING_DDL = f"create temp table if not exists pgcascade_landing {RAW_EVENTS}"
LANDING_COPY = f"copy {LANDING} ({STAGE_COLUMNS}) from stdin".encode()
# per table of a staged chunk: its row events, whether all are in JSON, the highest ev_id,
# whether any is an insert, how many are at or below the chunks' highest before it, whether all are
ROW_SUMMARY = (
    "select ev_extra1, count(*), bool_and(left(ev_data, 1) = '{{'), max(ev_id), bool_or(ev_type = 'I'),"
    " count(*) filter (where ev_id <= %s), bool_and(ev_type = 'I') from {}"
    " where ev_type in ('I', 'U', 'D') group by 1"
)
# the chunk's other events: only the set's own (locations, watermarks: apply_cascade_event),
# which no row depends on, can be applied after the chunk's rows (staged without ev_extra2,
# as apply_staged has them)
OTHER_EVENTS = (
    "select ev_id, ev_type, ev_data, ev_extra1, null::text from {} where ev_type not in ('I', 'U', 'D')"
    " order by ev_id"
)
CASCADE_EVENT = "select pgcascade.apply_cascade_event(%s, %s, %s, %s, %s)"
# how the apply session writes a chunk: in key order, by the key's index (a hash join over a
# scan of the destination would read it whole for every chunk)
NESTED = b"set local enable_hashjoin = off; set local enable_mergejoin = off"
UNNESTED = b"reset enable_hashjoin; reset enable_mergejoin"


class NotStreamed(Exception):
    """The batch cannot be applied in chunks: it is applied whole."""


@dataclass
class Streamer:
    """The worker's second session on its node, which decodes a large batch's chunks."""

    db: str
    name: str  # the worker's queue: its chunk tables' prefix
    chunk_events: int
    conn: psycopg.Connection | None = None
    whole: int | None = None  # a batch to apply whole: streaming it failed
    dirty: bool = True  # chunk tables may exist (made since the last drop_chunks, or by a crash)

    @property
    def prefix(self) -> str:
        return "pgcascade_chunk_" + hashlib.sha1(self.name.encode()).hexdigest()[:8] + "_"

    def session(self) -> psycopg.Connection:
        """The second session, connected on first use."""
        if self.conn is None or self.conn.closed:
            self.conn = pgconn.connect(self.db, autocommit=True, connect_timeout=10)
            self.conn.execute("set application_name = 'pgcascade worker stream'")
            self.conn.execute(LANDING_DDL)
        return self.conn

    def drop_chunks(self, conn: psycopg.Connection) -> None:
        """Drop the chunk tables of this worker (the last batch's, or a crash's) on `conn`."""
        drop_tables(conn, self.prefix)
        self.dirty = False

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None


def drop_tables(conn: psycopg.Connection, prefix: str) -> None:
    """Drop the tables in schema pgcascade whose names start with `prefix` (a worker's)."""
    names = conn.execute(
        "select format('pgcascade.%%I', relname) from pg_class where relnamespace = 'pgcascade'::regnamespace"
        " and relkind = 'r' and starts_with(relname::text, %s)",
        (prefix,),
    ).fetchall()
    if names:
        conn.execute(
            sql.SQL("drop table if exists {}").format(sql.SQL(", ").join(sql.SQL(n) for (n,) in names))
        )


@dataclass
class Chunk:
    """One chunk decoded by the second session: its tables' net rows, by table."""

    number: int
    tables: list[tuple[TableApplier, str, Writes]]  # applier, chunk table, what its events are
    cascade: list[tuple]  # the set's own events (OTHER_EVENTS)
    late: list[tuple[TableApplier, str]] = field(default_factory=list)  # late events' table
    stats: BatchStats = field(default_factory=BatchStats)  # its events, by table
    top: int = 0  # its highest ev_id
    raw: list[TableApplier] = field(default_factory=list)  # inserts alone, left in the landed table


def decode_chunk(
    s: psycopg.Connection,
    landed: str,
    appliers: dict,
    prefix: str,
    top: int,
    number: int = 1,
    whole: bool = False,
) -> Chunk:
    """The events in table `landed` of session s, checked (summary) and decoded per table into
    unlogged tables named from `prefix` - those above ev_id `top` reduced to the last event per
    key, those at or below it (late) each kept.  NotStreamed if it holds other events.  With
    `whole` (the chunk is a whole batch), a table's inserts alone are left where they are, for
    one plain INSERT from there (applysql.insert_sql: nothing to reduce; a chunk of a streamed
    batch may hold a key an earlier chunk left)."""
    found = summary(s, landed, appliers, top)
    if found is None:
        raise NotStreamed(f"chunk {number} holds other than row changes of set-based tables")
    rows, others = found
    chunk = Chunk(number, [], others)
    chunk.stats.count += len(others)
    for i, (t, n, _plain, _top, inserts, late, only) in enumerate(sorted(rows, key=lambda r: str(r[0]))):
        chunk.stats.count += n
        chunk.stats.per_table[t] = chunk.stats.per_table.get(t, 0) + n
        a = appliers.get(t)
        if a is None:
            chunk.stats.ignored += n
            continue
        if whole and only and a.shape is not None and applysql.insert_sql(a.shape) is not None:
            chunk.raw.append(a)
            continue
        name = f"{prefix}{i}"
        s.execute(decode_sql(a, name, top, late=False, source=landed), {"t": t})
        chunk.tables.append((a, name, Writes.of(bool(inserts), bool(only))))
        if late:
            s.execute(decode_sql(a, name + "_late", top, late=True, source=landed), {"t": t})
            chunk.late.append((a, name + "_late"))
    chunk.top = max([top, *(r[3] for r in rows)])
    return chunk


def apply_chunk(
    sub: psycopg.Connection, chunk: Chunk, columns: dict[str, list[str]], queue: str, landed: str = ""
) -> None:
    """Write a decoded chunk's net rows, table by table, then its set's own events, in the
    batch's transaction on sub (`columns`: each destination's, in order; `landed`: the table
    the chunk's raw inserts are in, decode_chunk's `whole`)."""
    for a in chunk.raw:
        assert a.shape is not None
        statement = applysql.insert_sql(a.shape, sql.SQL(landed))
        assert statement is not None  # (decode_chunk left it raw for that)
        sub.execute(statement, {"t": a.table, "lo": 0, "hi": MAX_EV_ID, "skip": None}, prepare=False)
    for a, name, writes in chunk.tables:
        net = sql.SQL("select pgcascade_ev_type as ev_type, {} as pgcascade_row from pgcascade.{} c").format(
            row_of(a, columns[a.table]), sql.Identifier(name)
        )
        write(sub, a, net, writes is not Writes.NO_INSERTS)
    for _id, *event in chunk.cascade:
        sub.execute(CASCADE_EVENT, (queue, *event))


def write(sub: psycopg.Connection, a: TableApplier, net: sql.Composable, inserts: bool) -> None:
    """One table's net rows, by the key's index in key order."""
    assert a.shape is not None
    statement = applysql.set_based_sql(a.shape, net=net) if inserts else applysql.merge_sql(a.shape, net=net)
    sub.execute(NESTED)
    sub.execute(statement, {"t": a.table, "lo": 0, "hi": 0, "skip": None}, prepare=False)
    sub.execute(UNNESTED)


def stage(
    streamer: Streamer,
    prov: psycopg.Connection,
    sub: psycopg.Connection,
    info: BatchInfo,
    appliers: dict,
    queue: str,
) -> BatchStats | None:
    """Stage the batch in the apply session's stage (None: apply_staged follows), or, past
    `chunk_events` events of row changes alone, apply it in chunks: the batch's stats."""
    copy_out, into_stage = stage_statements(prov, sub, info)
    source = roundtrip.CopyOut(prov, copy_out)
    try:
        source.relay(sub, into_stage, streamer.chunk_events)
        if source.ended:
            return None
        first = summary(sub, STAGE_TABLE, appliers, 0)
        if first is None or info.batch_id == streamer.whole:
            source.relay(sub, into_stage)
            return None
        return Chunks(streamer, sub, appliers, queue, first[0]).run(source)
    finally:
        source.close()


def summary(
    conn: psycopg.Connection, table: str, appliers: dict, late_below: int
) -> tuple[list[tuple], list[tuple]] | None:
    """A staged chunk's tables (ROW_SUMMARY) and other events, or None when it holds other
    than row changes in JSON of tables applied set-based and the set's own events."""
    rows = conn.execute(sql.SQL(ROW_SUMMARY).format(sql.SQL(table)), (late_below,)).fetchall()
    for t, _n, plain, *_ in rows:
        a = appliers.get(t)
        if not plain or (a is not None and (not a.set_based or a.shape is None)):
            return None
    others = conn.execute(sql.SQL(OTHER_EVENTS).format(sql.SQL(table))).fetchall()
    if any(not e[1].startswith("pgcascade.") or e[1] == q.REPAIR_EVENT for e in others):
        return None
    return rows, others


class Chunks:
    """One streamed batch: the second session decodes chunk after chunk (a thread), the apply
    session writes each as it comes."""

    def __init__(
        self, streamer: Streamer, sub: psycopg.Connection, appliers: dict, queue: str, first: list[tuple]
    ):
        self.streamer, self.sub, self.appliers, self.queue = streamer, sub, appliers, queue
        self.stats, self.decoded_stats = BatchStats(), BatchStats()  # the first's, the thread's
        self.top = max((r[3] for r in first), default=0)
        self.ready: queues.Queue[Chunk | BaseException | None] = queues.Queue()
        self.stop = threading.Event()
        self.columns: dict[str, list[str]] = {}
        self.done: list[Chunk] = []

    def run(self, source: roundtrip.CopyOut) -> BatchStats:
        """Apply the first chunk (staged here), then each chunk the thread decodes, then the
        keys with late events."""
        try:
            s = self.streamer.session()
        except psycopg.OperationalError as e:  # a connection limit, say: the batch goes whole
            raise NotStreamed(f"no second session: {db_error_line(e)}") from e
        self.streamer.drop_chunks(s)
        s.execute(f"truncate {LANDING}")
        for a in self.appliers.values():
            # every column in order: the row type's, which json_populate_record fills
            self.columns[a.table] = [c.name for c in catalog.columns(self.sub, a.dest)]
        decoder = threading.Thread(target=self.decode, args=(source, s), name="stream-decoder", daemon=True)
        decoder.start()
        try:
            self.stats.add(apply_staged(self.sub, self.appliers, queue=self.queue))
            applied = self.stats.count
            pause_point("stream-chunk", events=applied)
            while (chunk := self.ready.get()) is not None:
                if isinstance(chunk, BaseException):
                    raise chunk
                self.apply_chunk(chunk)
                applied += chunk.stats.count
                pause_point("stream-chunk", events=applied)
        except psycopg.OperationalError:
            raise
        except psycopg.Error as e:
            raise NotStreamed(f"a chunk failed: {db_error_line(e)}") from e
        finally:
            self.stop.set()
            decoder.join()
        self.rewrite_late()
        self.stats.add(self.decoded_stats)
        return self.stats

    def decode(self, source: roundtrip.CopyOut, s: psycopg.Connection) -> None:
        """The thread: chunk after chunk into the landing table, checked and decoded."""
        try:
            number = 0
            while not source.ended and not self.stop.is_set():
                number += 1
                s.execute(f"truncate {LANDING}")
                if source.relay(s, LANDING_COPY, self.streamer.chunk_events)[0]:
                    self.ready.put(self.decoded(s, number))
            self.ready.put(None)
        except BaseException as e:  # to the apply session's thread, which raises it
            self.ready.put(e)

    def decoded(self, s: psycopg.Connection, number: int) -> Chunk:
        self.streamer.dirty = True
        chunk = decode_chunk(s, LANDING, self.appliers, f"{self.streamer.prefix}{number}_", self.top, number)
        self.decoded_stats.add(chunk.stats)
        self.top = max(self.top, chunk.top)
        return chunk

    def apply_chunk(self, chunk: Chunk) -> None:
        """Write a chunk's net rows, table by table, in the batch's transaction."""
        apply_chunk(self.sub, chunk, self.columns, self.queue)
        self.done.append(chunk)

    def rewrite_late(self) -> None:
        """Each key with a late event, written again from its last event in the whole batch."""
        late: dict[str, list[str]] = {}
        for chunk in self.done:
            for a, name in chunk.late:
                late.setdefault(a.table, []).append(name)
        for table, names in late.items():
            a = self.appliers[table]
            mine = [name for chunk in self.done for t, name, _ in chunk.tables if t.table == table]
            write(self.sub, a, late_net(a, self.columns[table], [*mine, *names], names), inserts=True)


def row_of(a: TableApplier, columns: list[str]) -> sql.Composed:
    """A chunk table's row (alias c) as the destination's row type."""
    return sql.SQL("row({})::{}").format(
        sql.SQL(", ").join(sql.SQL("c.{}").format(sql.Identifier(c)) for c in columns), sql.SQL(a.dest)
    )


def keys_of(a: TableApplier, alias: str) -> sql.Composed:
    return sql.SQL(", ").join(
        sql.SQL("{}.{}").format(sql.Identifier(alias), sql.Identifier(k)) for k in a.keys
    )


def decode_sql(a: TableApplier, name: str, top: int, late: bool, source: str = LANDING) -> sql.Composed:
    """The second session's statement: a table's events of the landed chunk (`source`) above
    the chunks' highest ev_id before it, decoded and reduced to the last one per key, into table
    `name` - or (`late`) those at or below it, every one."""
    assert a.shape is not None
    body = sql.SQL(
        "select {distinct} s.ev_id as pgcascade_ev_id, s.ev_type as pgcascade_ev_type, r.*"
        " from {landing} s cross join lateral {populate} r"
        " where s.ev_extra1 = %(t)s and s.ev_id {cmp} {top}{order}"
    ).format(
        distinct=sql.SQL("") if late else sql.SQL("distinct on ({})").format(keys_of(a, "r")),
        landing=sql.SQL(source),
        populate=applysql.populate(a.shape),
        cmp=sql.SQL("<=" if late else ">"),
        top=sql.Literal(top),
        order=sql.SQL("") if late else sql.SQL(" order by {}, s.ev_id desc").format(keys_of(a, "r")),
    )
    return sql.SQL("create unlogged table pgcascade.{} as {}").format(sql.Identifier(name), body)


def late_net(a: TableApplier, columns: list[str], tables: list[str], late: list[str]) -> sql.Composed:
    """The last event in the whole batch of each key with a late event: from the chunks'
    tables, the late events' and the first chunk's stage."""
    assert a.shape is not None
    cols = sql.SQL(", ").join(sql.SQL("c.{}").format(sql.Identifier(c)) for c in columns)
    branches = [
        sql.SQL("select c.pgcascade_ev_id, c.pgcascade_ev_type, {} from pgcascade.{} c").format(
            cols, sql.Identifier(n)
        )
        for n in tables
    ]
    branches.append(
        sql.SQL(
            "select s.ev_id, s.ev_type, {} from {} s cross join lateral {} c"
            " where s.ev_extra1 = %(t)s and s.ev_type in ('I', 'U', 'D')"
        ).format(cols, sql.SQL(STAGE_TABLE), applysql.populate(a.shape))
    )
    keys = keys_of(a, "c")
    late_keys = sql.SQL(" union ").join(
        sql.SQL("select {} from pgcascade.{} c").format(keys, sql.Identifier(n)) for n in late
    )
    return sql.SQL(
        "select distinct on ({keys}) c.pgcascade_ev_type as ev_type, {row} as pgcascade_row"
        " from ({all}) c where ({keys}) in ({late}) order by {keys}, c.pgcascade_ev_id desc"
    ).format(keys=keys, row=row_of(a, columns), all=sql.SQL(" union all ").join(branches), late=late_keys)
