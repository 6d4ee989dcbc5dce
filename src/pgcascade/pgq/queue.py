"""The transactional queue, from Python: thin calls of the SQL API plus a streaming consumer.

The queue's correctness lives in the SQL functions (`sql/functions`): a batch is the events
committed between two ticks (snapshots), and finishing it moves the consumer to the later tick.
This module adds what only a client can do well:

- `Batch.events()` streams the batch through a server-side cursor (`batch_event_sql`), so a
  batch of ten million events is read in bounded memory;
- `Consumer` runs the loop next_batch -> process_batch -> finish_batch, finishing a batch only
  when `process_batch` returned, in the same transaction as the batch's retries.  A consumer
  that dies or fails gets the same batch again.
- Waiting for work uses LISTEN on the `pgcascade_tick` channel that every tick notifies,
  rather than sleeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg
from psycopg.rows import class_row

from pgcascade.core import pgconn

log = logging.getLogger(__name__)

TICK_CHANNEL = "pgcascade_tick"


@dataclass(frozen=True, slots=True)
class Event:
    ev_id: int
    ev_time: datetime
    ev_txid: int
    ev_retry: int | None
    ev_type: str | None
    ev_data: str | None
    ev_extra1: str | None
    ev_extra2: str | None
    ev_extra3: str | None
    ev_extra4: str | None


@dataclass(frozen=True, slots=True)
class BatchInfo:
    batch_id: int | None
    cur_tick_id: int | None
    prev_tick_id: int
    cur_tick_time: datetime | None
    prev_tick_time: datetime
    cur_tick_event_seq: int | None
    prev_tick_event_seq: int


class Batch:
    """An open batch.  Read it with `events()`; `retry()` sends an event back for later."""

    def __init__(self, conn: psycopg.Connection, info: BatchInfo, fetch_size: int = 5000):
        assert info.batch_id is not None
        self.conn = conn
        self.info = info
        self.batch_id: int = info.batch_id
        self.fetch_size = fetch_size
        self.retried = 0

    def events(self) -> Iterator[Event]:
        """The batch's events in ev_id order, fetched `fetch_size` at a time."""
        sql = self.conn.execute("select pgcascade.batch_event_sql(%s)", (self.batch_id,)).fetchone()[0]
        with self.conn.cursor(name=f"pgcascade_batch_{self.batch_id}", row_factory=class_row(Event)) as cur:
            cur.itersize = self.fetch_size
            cur.execute(sql)
            yield from cur

    def retry(self, ev: Event, seconds: float) -> None:
        """Deliver `ev` again to this consumer after `seconds`, once this batch is finished."""
        self.conn.execute(
            "select pgcascade.event_retry_raw(%s, %s, now() + %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                self.batch_id,
                ev.ev_id,
                timedelta(seconds=seconds),
                ev.ev_time,
                ev.ev_retry,
                ev.ev_type,
                ev.ev_data,
                ev.ev_extra1,
                ev.ev_extra2,
                ev.ev_extra3,
                ev.ev_extra4,
            ),
        )
        self.retried += 1


# --- the SQL API, one call each -------------------------------------------------------------


def create_queue(conn: psycopg.Connection, queue: str) -> bool:
    return conn.execute("select pgcascade.create_queue(%s)", (queue,)).fetchone()[0] == 1


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
    row = conn.execute(
        "select pgcascade.insert_event(%s, %s, %s, %s, %s, %s, %s)", (queue, ev_type, ev_data, *extras)
    ).fetchone()
    return int(row[0])


def ticker(conn: psycopg.Connection, queue: str | None = None) -> int:
    """Tick `queue` now (returns the tick id), or every queue that needs it (returns the count)."""
    if queue is None:
        return int(conn.execute("select pgcascade.ticker()").fetchone()[0])
    return int(conn.execute("select pgcascade.ticker(%s)", (queue,)).fetchone()[0])


def register_consumer(conn: psycopg.Connection, queue: str, consumer: str) -> bool:
    return conn.execute("select pgcascade.register_consumer(%s, %s)", (queue, consumer)).fetchone()[0] == 1


def unregister_consumer(conn: psycopg.Connection, queue: str, consumer: str) -> None:
    conn.execute("select pgcascade.unregister_consumer(%s, %s)", (queue, consumer))


def next_batch_info(conn: psycopg.Connection, queue: str, consumer: str) -> BatchInfo:
    with conn.cursor(row_factory=class_row(BatchInfo)) as cur:
        return cur.execute("select * from pgcascade.next_batch_info(%s, %s)", (queue, consumer)).fetchone()


def finish_batch(conn: psycopg.Connection, batch_id: int) -> None:
    conn.execute("select pgcascade.finish_batch(%s)", (batch_id,))


def queue_info(conn: psycopg.Connection, queue: str | None = None) -> list[dict]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute("select * from pgcascade.get_queue_info(%s)", (queue,)).fetchall()


def consumer_info(
    conn: psycopg.Connection, queue: str | None = None, consumer: str | None = None
) -> list[dict]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute("select * from pgcascade.get_consumer_info(%s, %s)", (queue, consumer)).fetchall()


class Consumer:
    """Base class for queue consumers: subclass it and implement `process_batch`.

    The batch is finished only after `process_batch` returns, in one transaction with the
    retries it asked for.  If it raises (or the process dies), nothing is finished and the
    same batch comes back on the next call.  Work done elsewhere (another database) is
    exactly-once only if it records the batch's tick id there - replication does that.
    """

    def __init__(self, connstr: str, queue: str, consumer: str, fetch_size: int = 5000):
        self.connstr = connstr
        self.queue = queue
        self.consumer = consumer
        self.fetch_size = fetch_size
        self._conn: psycopg.Connection | None = None
        self.stopping = False

    @property
    def conn(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = pgconn.connect(self.connstr, autocommit=True)
            self._conn.execute(f"listen {TICK_CHANNEL}")
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def register(self) -> bool:
        return register_consumer(self.conn, self.queue, self.consumer)

    def unregister(self) -> None:
        unregister_consumer(self.conn, self.queue, self.consumer)

    def process_batch(self, batch: Batch) -> None:
        """Handle one batch; iterate `batch.events()`.  Raise to leave the batch unfinished."""
        raise NotImplementedError

    def run_once(self) -> BatchInfo | None:
        """Process the next batch if there is one; returns its info, or None when idle."""
        conn = self.conn
        info = next_batch_info(conn, self.queue, self.consumer)
        if info.batch_id is None:
            return None
        with conn.transaction():
            self.process_batch(Batch(conn, info, self.fetch_size))
            finish_batch(conn, info.batch_id)
        return info

    def wait_for_tick(self, timeout: float) -> None:
        """Sleep until a tick is announced on any queue of this database, or `timeout` passes."""
        for _ in self.conn.notifies(timeout=timeout, stop_after=1):
            pass

    def run(self, max_idle: float = 1.0, stop_after: float | None = None) -> None:
        """Process batches until `stop()` or until `stop_after` seconds have passed."""
        deadline = None if stop_after is None else time.monotonic() + stop_after
        while not self.stopping and (deadline is None or time.monotonic() < deadline):
            if self.run_once() is None:
                self.wait_for_tick(max_idle)

    def stop(self) -> None:
        """Make `run()` return after the batch in hand (callable from another thread)."""
        self.stopping = True
