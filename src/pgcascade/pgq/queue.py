"""The transactional queue's API: one Python call per SQL function, the only place that does.

The queue's correctness lives in the SQL functions (`sql/pgq`): a batch is the events
committed between two ticks (snapshots), and finishing it moves the consumer to the later tick.
Every package that reads or writes a queue - the consumer, the worker, the copy process, the
cascade, the ticker - goes through these functions; `consumer.py` builds the streaming
consumer on them.  Waiting for work uses LISTEN on `TICK_CHANNEL`, which every tick notifies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import class_row

from pgcascade.core import roundtrip
from pgcascade.core.pgconn import scalar

TICK_CHANNEL = "pgcascade_tick"
# a repair's fix that the root sends down the cascade (sql/capture/96_repair.sql)
REPAIR_EVENT = "pgcascade.repair"


@dataclass(frozen=True, slots=True)
class BatchInfo:
    batch_id: int | None
    cur_tick_id: int | None
    prev_tick_id: int
    cur_tick_time: datetime | None
    prev_tick_time: datetime
    cur_tick_event_seq: int | None
    prev_tick_event_seq: int
    event_sql: str | None = None  # the query of the batch's events (next_batch gives it)
    # the later tick's snapshot, if next_batch's statement saw the tick (tick_snapshot if not)
    cur_tick_snapshot: str | None = None
    # next_batch_events: a small batch's events inline (JSON, see 52_fetch.sql), the row events
    # per table and the count of the others; and the values of the sequences asked for
    events: str | None = None
    row_counts: dict[str, int] | None = None
    other_events: int | None = None
    seq_values: list[int | None] | None = None
    # next_batch_events with `listen` and no batch: the doorbell rung, and whether events may be
    # pending all the same (consumer_listens' answer)
    pending: bool | None = None
    # next_position_events: the positions between ticks the batch starts and ends at (None: at
    # its tick), and whether the consumer is its queue's only reader (sql/pgq/53_position.sql)
    prev_position: str | None = None
    cur_position: str | None = None
    alone: bool | None = None
    by_ticks: bool | None = None

    @property
    def numbered(self) -> int:
        """The events numbered between its two ticks: its size, known before reading it (a tick
        taken during a transaction counts that one's events numbered so far)."""
        return (self.cur_tick_event_seq or 0) - self.prev_tick_event_seq


# --- the SQL API, one call each -------------------------------------------------------------


def create_queue(conn: psycopg.Connection, queue: str) -> bool:
    return scalar(conn, "select pgcascade.create_queue(%s)", (queue,)) == 1


def drop_queue(conn: psycopg.Connection, queue: str, force: bool = False) -> None:
    conn.execute("select pgcascade.drop_queue(%s, %s)", (queue, force))


def set_queue_config(conn: psycopg.Connection, queue: str, param: str, value: object) -> None:
    conn.execute("select pgcascade.set_queue_config(%s, %s, %s)", (queue, param, str(value)))


def insert_event(
    conn: psycopg.Connection, queue: str, ev_type: str, ev_data: str | None, *extras: str | None
) -> int:
    if len(extras) > 4:
        raise ValueError("at most 4 extra fields")
    extras = tuple(extras) + (None,) * (4 - len(extras))
    return int(
        scalar(
            conn,
            "select pgcascade.insert_event(%s, %s, %s, %s, %s, %s, %s)",
            (queue, ev_type, ev_data, *extras),
        )
    )


def ticker(conn: psycopg.Connection, queue: str | None = None) -> int:
    """Tick `queue` now (returns the tick id), or every queue that needs it (returns the count)."""
    if queue is None:
        return int(scalar(conn, "select pgcascade.ticker()"))
    return int(scalar(conn, "select pgcascade.ticker(%s)", (queue,)))


# a tick in the calling transaction, its own events in it (tick_now in 52_fetch.sql): the
# capture daemon sends it with a commit group's last rows, in one round trip
TICK_NOW = "select pgcascade.tick_now(%s)"


def register_consumer(conn: psycopg.Connection, queue: str, consumer: str) -> bool:
    return scalar(conn, "select pgcascade.register_consumer(%s, %s)", (queue, consumer)) == 1


def unregister_consumer(conn: psycopg.Connection, queue: str, consumer: str) -> None:
    conn.execute("select pgcascade.unregister_consumer(%s, %s)", (queue, consumer))


def next_batch_info(conn: psycopg.Connection, queue: str, consumer: str) -> BatchInfo:
    with conn.cursor(row_factory=class_row(BatchInfo)) as cur:
        row = cur.execute("select * from pgcascade.next_batch_info(%s, %s)", (queue, consumer)).fetchone()
    assert row is not None
    return row


def finish_batch(conn: psycopg.Connection, batch_id: int) -> None:
    conn.execute("select pgcascade.finish_batch(%s)", (batch_id,))


def next_batch(
    conn: psycopg.Connection,
    queue: str,
    consumer: str,
    max_events: int | None = None,
    max_tick: int | None = None,
) -> BatchInfo:
    """The consumer's next batch: several ticks at once up to about `max_events` events, never
    past `max_tick` (next_batch_custom), with the query of its events and the later tick's
    snapshot (one round trip)."""
    with conn.cursor(row_factory=class_row(BatchInfo)) as cur:
        row = cur.execute(
            "select b.*, case when b.batch_id is not null then pgcascade.batch_event_sql(b.batch_id) end"
            " as event_sql, (select t.tick_snapshot::text from pgcascade.tick t join pgcascade.queue q"
            " on q.queue_id = t.tick_queue where q.queue_name = %s and t.tick_id = b.cur_tick_id)"
            " as cur_tick_snapshot from pgcascade.next_batch_custom(%s, %s, %s, %s) b",
            (queue, queue, consumer, max_events, max_tick),
        ).fetchone()
    assert row is not None
    return row


def delayed_tick(
    conn: psycopg.Connection, queue: str, after_tick: int, delay: float
) -> tuple[int | None, float | None]:
    """A delayed consumer at `after_tick`: the newest tick at least `delay` seconds old (None:
    none yet), and the seconds until the next one is (None: no younger tick yet)."""
    row = conn.execute(
        "select tick_id, extract(epoch from next_due)::float8 from pgcascade.delayed_tick(%s, %s, %s)",
        (queue, after_tick, timedelta(seconds=delay)),
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def next_batch_events(
    conn: psycopg.Connection,
    queue: str,
    consumer: str,
    *,
    finish: int | None,
    max_events: int | None,
    max_tick: int | None,
    inline_events: int,
    seqs: list[str] | None = None,
    tick: bool = True,
    commit_times: bool = False,
    early: bool = False,
    meanwhile: Callable[[], None] | None = None,
    listen: float | None = None,
) -> BatchInfo:
    """One round trip: finish batch `finish` (if still open), tick the queue if `tick`, the
    consumer is caught up and committed events wait, open the next batch and return it - with
    its events inline when it holds at most `inline_events` events (their time their
    transaction's commit time, with `commit_times`) - and the values of `seqs`.  With `early`,
    a batch comes back before the call's commit is done (a tick it made waits for its WAL
    flush): roundtrip.settle(conn) waits for it, and must come before the batch is applied
    anywhere and before any other use of conn.  `meanwhile` is called while the provider runs
    it.  With `listen`, a call that finds no batch rings the queue's doorbell for `listen`
    seconds as consumer_listens does, and says in `pending` what that would."""
    # a worker's call at every batch: sent and read by libpq (core/roundtrip.py)
    query = roundtrip.compose(
        conn,
        "select * from pgcascade.next_batch_events(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
        (
            queue,
            consumer,
            finish,
            max_events,
            max_tick,
            tick,
            inline_events,
            seqs,
            commit_times,
            None if listen is None else round(listen * 1000),
        ),
    )
    return fetch_batch(conn, query, early, meanwhile)


def fetch_batch(
    conn: psycopg.Connection, query: bytes, early: bool, meanwhile: Callable[[], None] | None
) -> BatchInfo:
    """The batch a fetch function's one row describes."""
    if early:
        result = roundtrip.send_early(conn, query, meanwhile)
    else:
        (result,) = roundtrip.send(conn, query, meanwhile)
    names = roundtrip.column_names(result)
    (row,) = roundtrip.load_rows(
        conn, result, lambda values: BatchInfo(**dict(zip(names, values, strict=True)))
    )
    if row.batch_id is None:
        roundtrip.settle(conn)  # nothing to apply meanwhile
    return row


def resume_at(conn: psycopg.Connection, queue: str, consumer: str, tick: int) -> None:
    """Put a consumer back at `tick`, the last tick it applied durably elsewhere."""
    conn.execute("select pgcascade.set_consumer_position(%s, %s, %s)", (queue, consumer, tick))


def register_consumer_at(conn: psycopg.Connection, queue: str, consumer: str, tick: int) -> None:
    conn.execute("select pgcascade.register_consumer_at(%s, %s, %s)", (queue, consumer, tick))


def consumer_tick(conn: psycopg.Connection, queue: str, consumer: str) -> tuple[int, datetime, int] | None:
    """(tick id, time, event sequence) of the tick a consumer is at; None when not registered."""
    return conn.execute(
        "select tick_id, tick_time, tick_event_seq from pgcascade.consumer_tick(%s, %s)", (queue, consumer)
    ).fetchone()


def consumer_last_tick(conn: psycopg.Connection, queue: str, consumer: str) -> int | None:
    row = conn.execute(
        "select last_tick from pgcascade.get_consumer_info(%s, %s)", (queue, consumer)
    ).fetchone()
    return row[0] if row else None


def consumers_named(conn: psycopg.Connection, queue: str, prefix: str) -> list[str]:
    """The consumers of the queue whose names start with `prefix`."""
    rows = conn.execute(
        "select consumer_name from pgcascade.get_consumer_info(%s) where starts_with(consumer_name, %s)",
        (queue, prefix),
    ).fetchall()
    return [r[0] for r in rows]


def unregister_consumers(conn: psycopg.Connection, queue: str, name: str, prefix: str) -> None:
    """Unregister consumer `name` and every consumer whose name starts with `prefix`."""
    conn.execute(
        "select pgcascade.unregister_consumer(%s, s.consumer_name) from pgcascade.get_consumer_info(%s) s"
        " where s.consumer_name = %s or starts_with(s.consumer_name, %s)",
        (queue, queue, name, prefix),
    )


def last_tick_id(conn: psycopg.Connection, queue: str) -> int | None:
    """The newest tick of the queue."""
    row = conn.execute("select last_tick_id from pgcascade.get_queue_info(%s)", (queue,)).fetchone()
    return row[0] if row else None


def has_tick(conn: psycopg.Connection, queue: str, tick: int) -> bool:
    row = conn.execute(
        "select exists (select 1 from pgcascade.tick t join pgcascade.queue q on q.queue_id = t.tick_queue"
        " where q.queue_name = %s and t.tick_id = %s)",
        (queue, tick),
    ).fetchone()
    return bool(row and row[0])


def tick_age(conn: psycopg.Connection, queue: str, tick: int) -> timedelta | None:
    """How long ago tick `tick` was made; None when the queue no longer has it."""
    row = conn.execute(
        "select now() - t.tick_time from pgcascade.tick t join pgcascade.queue q on q.queue_id = t.tick_queue"
        " where q.queue_name = %s and t.tick_id = %s",
        (queue, tick),
    ).fetchone()
    return row[0] if row else None


def tick_snapshot(conn: psycopg.Connection, queue: str, tick: int) -> str | None:
    """The snapshot tick `tick` recorded, as text; None when the queue no longer has it."""
    row = conn.execute(
        "select t.tick_snapshot::text from pgcascade.tick t join pgcascade.queue q on q.queue_id = t.tick_queue"
        " where q.queue_name = %s and t.tick_id = %s",
        (queue, tick),
    ).fetchone()
    return row[0] if row else None


def tick_covers_snapshot(conn: psycopg.Connection, queue: str, tick: int, snapshot: str) -> bool:
    """Whether tick `tick` was taken after every transaction visible in `snapshot`."""
    row = conn.execute(
        "select pgcascade.tick_covers_snapshot(%s, %s, %s::pg_snapshot)", (queue, tick, snapshot)
    ).fetchone()
    return bool(row and row[0])


def pending_event_count(
    conn: psycopg.Connection, queue: str, after_tick: int, snapshot: str, types: tuple[str, ...]
) -> int:
    """Events of these types committed after tick `after_tick` and visible in `snapshot`."""
    row = conn.execute(
        "select pgcascade.pending_event_count(%s, %s, %s::pg_snapshot, %s)",
        (queue, after_tick, snapshot, list(types)),
    ).fetchone()
    return int(row[0]) if row else 0


def batch_event_sql(conn: psycopg.Connection, batch_id: int) -> str:
    """The query that reads a batch's events (composed by the queue, with quoted literals)."""
    row = conn.execute("select pgcascade.batch_event_sql(%s)", (batch_id,)).fetchone()
    assert row is not None
    return row[0]


def unordered(event_sql: str) -> str:
    """A batch's query (batch_event_sql, which ends by ordering the events) without its ORDER BY,
    for a reader that stores the events and orders them itself (a staging table): the provider
    then streams them as it reads them instead of sorting the whole batch first."""
    return event_sql.removesuffix(" order by 1")


def queue_id(conn: psycopg.Connection, queue: str) -> int:
    return int(scalar(conn, "select queue_id from pgcascade.queue where queue_name = %s", (queue,)))


def exists(conn: psycopg.Connection, queue: str) -> bool:
    row = conn.execute(
        "select exists (select 1 from pgcascade.queue where queue_name = %s)", (queue,)
    ).fetchone()
    return bool(row and row[0])


def ticks_on_demand(conn: psycopg.Connection, queue: str) -> bool:
    """Whether the queue ticks when its consumers ask (next_batch_events): it makes its own
    ticks (not a branch's, which repeats its provider's)."""
    row = conn.execute(
        "select not queue_external_ticker from pgcascade.queue where queue_name = %s", (queue,)
    ).fetchone()
    return bool(row and row[0])


def wake_payload(queue: str) -> str:
    """The tick channel's payload that wakes the queue's consumers, paused ones too (a tick's
    payload is the queue's name: a paused worker does not wake for it)."""
    return f"wake {queue}"


def wake_consumers(conn: psycopg.Connection, queue: str) -> None:
    """Wake every consumer waiting on the tick channel now, not at the next tick."""
    conn.execute("select pg_notify(%s, %s)", (TICK_CHANNEL, wake_payload(queue)))


def consumer_listens(conn: psycopg.Connection, queue: str, wait: float, seen_event_seq: int | None) -> bool:
    """Set the queue's doorbell for `wait` seconds (producers notify while it rings), then say
    whether events numbered after `seen_event_seq` exist, committed or not (05_doorbell.sql)."""
    row = conn.execute(
        "select pgcascade.consumer_listens(%s, %s, %s)", (queue, round(wait * 1000), seen_event_seq)
    ).fetchone()
    return bool(row and row[0])


def listen(conn: psycopg.Connection) -> None:
    conn.execute(f"listen {TICK_CHANNEL}")


# --- cascaded queues (a branch carries its provider's batches, pgq_node) ------------------------


def create_branch_queue(
    conn: psycopg.Connection, queue: str, tick: int, tick_time: datetime, event_seq: int
) -> None:
    """A branch's own copy of the set's queue, starting at the provider's tick `tick`."""
    conn.execute("select pgcascade.create_branch_queue(%s, %s, %s, %s)", (queue, tick, tick_time, event_seq))


def branch_tick(
    conn: psycopg.Connection, queue: str, tick: int, tick_time: datetime | None, event_seq: int | None
) -> None:
    """Make the provider's tick `tick` in this node's queue, with the same id (time: now when None)."""
    conn.execute(
        "select pgcascade.branch_tick(%s, %s, coalesce(%s::timestamptz, now()), %s)",
        (queue, tick, tick_time, event_seq),
    )


def carry_events(conn: psycopg.Connection, queue: str, source: str) -> int:
    """Insert the events staged in temp table `source` into this node's queue, each with its
    provider's id, time and fields (the transaction id is this node's own, as local ticks need)."""
    return conn.execute(
        sql.SQL(
            "insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1, ev_rare)"
            " select s.ev_id, s.ev_time, q.queue_id * 16 + q.queue_cur_table, s.ev_type, s.ev_data, s.ev_extra1,"
            "        case when s.ev_extra2 is not null or s.ev_extra3 is not null or s.ev_extra4 is not null"
            "             then row(s.ev_extra2, s.ev_extra3, s.ev_extra4, null, null)::pgcascade.event_rare end"
            "   from {} s, pgcascade.queue q where q.queue_name = %s order by s.ev_id"
        ).format(sql.SQL(source)),
        (queue,),
    ).rowcount


def insert_staged(conn: psycopg.Connection, queue: str, source: str, tables: list[str]) -> int:
    """Insert the row events (I/U/D) and repairs of `tables` staged in temp table `source` as new
    events of this queue: new ids, the same order (a merge-leaf's combined queue)."""
    return conn.execute(
        sql.SQL(
            "insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1)"
            " select nextval(q.queue_event_seq), s.ev_time, q.queue_id * 16 + q.queue_cur_table, s.ev_type,"
            "        s.ev_data, s.ev_extra1"
            "   from (select * from {} where ev_type in ('I', 'U', 'D', %s)"
            "          and ev_extra1 = any(%s) order by ev_id) s, pgcascade.queue q"
            "  where q.queue_name = %s"
        ).format(sql.SQL(source)),
        (REPAIR_EVENT, tables, queue),
    ).rowcount


def emit_event(
    conn: psycopg.Connection, queue: str, ev_type: str, data: str | None, extra1: str | None
) -> None:
    """An event of the root's own (table list, DDL): on a root with logical capture it travels
    through the WAL, so it keeps its place among the row changes."""
    conn.execute("select pgcascade.emit_event(%s, %s, %s, %s)", (queue, ev_type, data, extra1))


def queue_info(conn: psycopg.Connection, queue: str | None = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute("select * from pgcascade.get_queue_info(%s)", (queue,)).fetchall()


def consumer_info(
    conn: psycopg.Connection, queue: str | None = None, consumer: str | None = None
) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute("select * from pgcascade.get_consumer_info(%s, %s)", (queue, consumer)).fetchall()


@dataclass(frozen=True, slots=True)
class Retained:
    events: int  # between the oldest and the newest tick kept
    bytes: int  # the event partitions on disk
    oldest_tick_time: datetime | None


def retained(conn: psycopg.Connection, queue: str) -> Retained:
    """What the queue keeps for its slowest consumer (no scan of the events)."""
    with conn.cursor(row_factory=class_row(Retained)) as cur:
        row = cur.execute("select * from pgcascade.queue_retained(%s)", (queue,)).fetchone()
    assert row is not None
    return row


@dataclass(frozen=True, slots=True)
class Pending:
    table_name: str
    events: int
    oldest: datetime  # ev_time of the oldest event not applied


def pending_by_table(conn: psycopg.Connection, queue: str, after_tick: int) -> dict[str, Pending]:
    """Per table, the row events a consumer at `after_tick` has still to apply."""
    with conn.cursor(row_factory=class_row(Pending)) as cur:
        rows = cur.execute("select * from pgcascade.pending_by_table(%s, %s)", (queue, after_tick))
        return {p.table_name: p for p in rows}
