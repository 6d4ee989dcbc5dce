"""A streaming queue consumer: subclass `Consumer`, implement `process_batch`.

- `Batch.events()` streams the batch through a server-side cursor (`batch_event_sql`), so a
  batch of ten million events is read in bounded memory;
- `Consumer` runs the loop next_batch -> process_batch -> finish_batch, finishing a batch only
  when `process_batch` returned, in the same transaction as the batch's retries.  A consumer
  that dies or fails gets the same batch again.
- Waiting for work uses LISTEN on the tick channel rather than sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg
from psycopg.rows import class_row

from pgcascade.core import pgconn
from pgcascade.pgq import queue as q
from pgcascade.pgq.queue import BatchInfo


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
        sql = q.batch_event_sql(self.conn, self.batch_id)
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
            q.listen(self._conn)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def register(self) -> bool:
        return q.register_consumer(self.conn, self.queue, self.consumer)

    def unregister(self) -> None:
        q.unregister_consumer(self.conn, self.queue, self.consumer)

    def process_batch(self, batch: Batch) -> None:
        """Handle one batch; iterate `batch.events()`.  Raise to leave the batch unfinished."""
        raise NotImplementedError

    def run_once(self) -> BatchInfo | None:
        """Process the next batch if there is one; returns its info, or None when idle."""
        conn = self.conn
        info = q.next_batch_info(conn, self.queue, self.consumer)
        if info.batch_id is None:
            return None
        with conn.transaction():
            self.process_batch(Batch(conn, info, self.fetch_size))
            q.finish_batch(conn, info.batch_id)
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
