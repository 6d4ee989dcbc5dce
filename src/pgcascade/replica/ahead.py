"""A catching-up leaf fetches, stages and decodes its next large batch while it applies the
current one.

A batch of a backlog (W2a: 200,000 events) was applied in two steps on one backend of the
subscriber: its events streamed into the stage, then the set-based statements parsed each
event's JSON, sorted by key and wrote - while the other core mostly waited.  So while a leaf
applies a large batch, a thread fetches the next one on a second provider session (finishing
the current one there, which a leaf may do before its commit: see below), streams its events
into an unlogged table of the worker (`pgcascade.pgcascade_ahead_*`) through a second
subscriber session, and decodes them there as stream.py decodes a chunk: each table's events
parsed into the destination's column types and reduced to the last one per key, into an
unlogged table per table.  The next batch's transaction then only writes those rows (by the
key's index).  A batch that cannot be decoded so (a TRUNCATE, DDL, partial SQL, a table applied
row by row), that was decoded for tables whose definitions changed since (DDL in the batch
before), or whose decoded write fails, takes its raw events into the stage with one
INSERT ... SELECT and is applied as any batch.

Exactly once is untouched: the next batch is still applied in its own transaction, after the
check that the node is at its first tick.  What changes is when the provider learns that the
current batch is done - before its commit here instead of after.  A leaf already allows that:
it commits asynchronously, its provider keeps every tick above its durable watermark, and a
batch that does not start at the node's record puts the provider back there (`resume_at`).  So
a worker that dies, or a batch that fails, after the fetch ahead gets the same events again.
The tables are a cache: emptied before each use, dropped when the catch-up ends, and those a
crash left when the worker connects again.  Only plain leaf batches qualify (no
lanes, no chunks, no branch or merge-leaf, no delay and no table waiting for a copy).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from pgcascade.core import catalog, pgconn, roundtrip
from pgcascade.core.errors import db_error_line
from pgcascade.core.hooks import pause_point
from pgcascade.pgq import queue as q
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica import stream
from pgcascade.replica.apply import BatchStats, TableApplier
from pgcascade.replica.stage import STAGE_COLUMNS, STAGE_TABLE, stage_statements
from pgcascade.replica.stream import Chunk

log = logging.getLogger("pgcascade.replay")

# a batch this large (numbered events) has its successor staged ahead: below it, the stream
# is short beside the batch's fixed costs and a second session's round trips
AHEAD_MIN_EVENTS = 20_000


@dataclass
class Fetch:
    """What the worker's own fetch asks for, repeated by the fetch ahead."""

    queue: str
    consumer: str
    max_events: int | None
    inline_events: int
    seqs: list[str] | None


@dataclass
class Staged:
    """A batch fetched ahead (open on the provider), its events in `table` unless they came
    inline or it streams too large for one stage (then it is staged as any batch)."""

    info: BatchInfo
    provider: str | None  # the provider node it was fetched from
    table: str | None
    chunk: Chunk | None = None  # its row changes decoded per table (None: to be applied from the stage)
    appliers: dict[str, TableApplier] = field(default_factory=dict)  # what decoded them


@dataclass
class Ahead:
    """The worker's fetch ahead: its two sessions, its thread, and the batch it staged."""

    db: str
    name: str  # the worker's queue: its tables' prefix
    chunk_events: int  # a batch past this streams in chunks (stream.py): not staged ahead
    sub: psycopg.Connection | None = None
    prov: psycopg.Connection | None = None
    prov_node: str | None = None
    thread: threading.Thread | None = None
    outcome: list[Staged | BaseException | None] = field(default_factory=list)
    staged: Staged | None = None
    turn: int = 0  # which of the two tables the batch fetched goes into

    @property
    def prefix(self) -> str:
        return "pgcascade_ahead_" + hashlib.sha1(self.name.encode()).hexdigest()[:8] + "_"

    def table(self, turn: int) -> str:
        """The table of the raw events of turn 0 or 1 (its decoded tables' names follow it)."""
        return f"{self.prefix}{turn}"

    def start(
        self,
        provider_dsn: Callable[[], str],
        prov_node: str | None,
        fetch: Fetch,
        finish: int,
        reading: str | None,
        appliers: dict[str, TableApplier],
    ) -> None:
        """Fetch the batch after `finish`, stage it into the table the worker's transaction is
        not `reading` and decode it for `appliers`, in a thread (`join` gets it)."""
        assert self.thread is None
        self.turn = 1 if reading == self.table(0) else 0
        if self.prov_node != prov_node:
            self.close()
        if self.sub is None or self.prov is None:
            self.connect(provider_dsn(), prov_node)
        self.outcome = []
        self.thread = threading.Thread(
            target=self.run, args=(fetch, finish, dict(appliers)), name="fetch-ahead", daemon=True
        )
        self.thread.start()

    def connect(self, provider_dsn: str, prov_node: str | None) -> None:
        self.sub = pgconn.connect(self.db, autocommit=True, connect_timeout=10)
        self.sub.execute("set application_name = 'pgcascade worker ahead'")
        # never waits on the worker's own transaction (which holds only the table it read)
        self.sub.execute("set lock_timeout = '10s'")
        for turn in (0, 1):
            t = sql.Identifier(self.table(turn))
            self.sub.execute(
                sql.SQL("create unlogged table if not exists pgcascade.{} {}").format(
                    t, sql.SQL(stream.RAW_EVENTS)
                )
            )
        self.prov = pgconn.connect(provider_dsn, autocommit=True, connect_timeout=10)
        self.prov.execute("set synchronous_commit = off")  # as the worker's own (worker.connect)
        self.prov.execute("set application_name = 'pgcascade worker ahead'")
        self.prov_node = prov_node

    def run(self, fetch: Fetch, finish: int, appliers: dict[str, TableApplier]) -> None:
        """The thread: the next batch, staged into the next table and decoded."""
        try:
            self.outcome.append(self.fetch_and_stage(fetch, finish, appliers))
        except BaseException as e:  # to the worker's thread (join)
            self.outcome.append(e)

    def fetch_and_stage(self, fetch: Fetch, finish: int, appliers: dict[str, TableApplier]) -> Staged | None:
        assert self.sub is not None and self.prov is not None
        info = q.next_batch_events(
            self.prov,
            fetch.queue,
            fetch.consumer,
            finish=finish,
            max_events=fetch.max_events,
            max_tick=None,
            inline_events=fetch.inline_events,
            seqs=fetch.seqs,
        )
        if info.batch_id is None:
            return None
        if info.events is not None or info.numbered > self.chunk_events:
            return Staged(info, self.prov_node, None)
        table = sql.Identifier(self.table(self.turn))
        self.sub.execute(sql.SQL("truncate pgcascade.{}").format(table))
        copy_out, _ = stage_statements(self.prov, self.sub, info)
        copy_in = sql.SQL("copy pgcascade.{} ({}) from stdin").format(table, sql.SQL(STAGE_COLUMNS))
        roundtrip.relay_copy(self.prov, copy_out, self.sub, copy_in.as_bytes(self.sub))
        staged = Staged(info, self.prov_node, self.table(self.turn), appliers=appliers)
        stream.drop_tables(self.sub, f"{staged.table}_")  # the turn before last's (committed since)
        # other events than row changes of set-based tables (NotStreamed): applied from the stage
        with contextlib.suppress(stream.NotStreamed):
            staged.chunk = stream.decode_chunk(
                self.sub, f"pgcascade.{staged.table}", appliers, f"{staged.table}_", 0, whole=True
            )
        pause_point("staged-ahead", events=info.numbered)
        return staged

    def join(self) -> bool:
        """Wait for the thread; whether the batch it was given is finished on the provider (a
        failure leaves that unknown: the worker's next fetch finishes it if still open)."""
        if self.thread is None:
            return False
        self.thread.join()
        self.thread = None
        (outcome,) = self.outcome
        if isinstance(outcome, BaseException):
            detail = db_error_line(outcome) if isinstance(outcome, psycopg.Error) else repr(outcome)
            log.info("fetch ahead: %s; fetching the next batch the usual way", detail)
            self.close()
            return False
        self.staged = outcome
        return True

    def take(self) -> Staged | None:
        """The batch staged ahead, once (after the commit of the batch it was fetched during:
        that one's transaction may hold the table it was staged from)."""
        staged, self.staged = self.staged, None
        if self.sub is not None and (staged is None or staged.table is None):
            self.drop_tables()  # caught up, or a batch that goes its own way: the catch-up is over
        return staged

    @staticmethod
    def decoded(staged: Staged, appliers: dict[str, TableApplier]) -> bool:
        """Whether the batch's decoded tables serve: decoded for these very appliers (a DDL
        or a table that came or went since makes new ones)."""
        return (
            staged.chunk is not None
            and staged.appliers.keys() == appliers.keys()
            and all(appliers[t] is a for t, a in staged.appliers.items())
        )

    @staticmethod
    def apply_decoded(sub: psycopg.Connection, staged: Staged, queue: str) -> BatchStats:
        """Into the batch's transaction on sub: its decoded rows (stream.apply_chunk).  A
        failure raises NotStreamed, after which the batch goes through the stage."""
        chunk = staged.chunk
        assert chunk is not None
        staged.chunk = None  # once: a retry goes the other way
        try:
            columns = {a.table: [c.name for c in catalog.columns(sub, a.dest)] for a, _, _ in chunk.tables}
            stream.apply_chunk(sub, chunk, columns, queue, landed=f"pgcascade.{staged.table}")
        except psycopg.OperationalError:
            raise
        except psycopg.Error as e:
            raise stream.NotStreamed(f"its rows decoded ahead failed: {db_error_line(e)}") from e
        return chunk.stats

    def unload(self, sub: psycopg.Connection, staged: Staged) -> None:
        """Into the batch's transaction on `sub`: its events, from the table into the stage."""
        assert staged.table is not None
        cols = sql.SQL(STAGE_COLUMNS)
        sub.execute(
            sql.SQL("insert into {} ({}) select {} from pgcascade.{}").format(
                sql.SQL(STAGE_TABLE), cols, cols, sql.Identifier(staged.table)
            )
        )

    def drop_tables(self, conn: psycopg.Connection | None = None) -> None:
        """Drop every table of the fetch ahead (on `conn`, or this catch-up's session, which is
        then closed): at the end of a catch-up, and when the worker connects (a crash's)."""
        conn = conn or self.sub
        if conn is not None and not conn.closed:
            try:
                stream.drop_tables(conn, self.prefix)
            except psycopg.Error as e:
                log.info("fetch ahead: %s", db_error_line(e))
        if conn is self.sub:
            self.close()

    def close(self) -> None:
        """Close both sessions (a running thread is joined first)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        for c in (self.sub, self.prov):
            if c is not None:
                c.close()
        self.sub = self.prov = None
        self.prov_node = None
        self.staged = None
