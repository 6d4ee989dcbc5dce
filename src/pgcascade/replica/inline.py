"""A small batch applied in one round trip to the subscriber.

A consumer that keeps up gets each batch with its events inline (`next_batch_events`, one
round trip to the provider), and the worker applies it in one message on the subscriber: the
transaction's settings (the events' JSON among them), `apply_begin` (locks the node row,
checks that the batch starts where this node's record is, records the batch's tick), one
set-based statement per table that has events, reading them from that JSON, the followed
sequences, the commit, and the WAL position after it, and the node and its tables for the
next round (unless those the round started from were read a moment ago) - one message of the
simple query protocol, values as literals, the statements prepared (prepared.py).  In a batch
of at most ONE_KIND_MAX row events, a table whose events are all inserts (all updates, all
deletes) is applied by a statement of that kind alone over its rows, sent as one argument
(applysql.one_kind_sql); if its precondition fails (a row to update missing here), the message
is sent again with the set-based statements.  The server runs them in order and stops at the
first failure (the worker then rolls the transaction back), so nothing in between waits for a
result.  Nothing is staged: a row written to a temporary table and the table's truncation at
commit cost more than the rest of a small batch (0.5 ms of the subscriber's 1.9 ms at 300 tps).

Batches this path does not take go the general way (worker.process_batch): barrier events
(TRUNCATE, EXECUTE, the table list, the set's own events), a table applied row by row (partial
SQL, no unique key), a node that carries events on (branch, merge-leaf), a two-way peer, a
parallel apply, and a batch whose set-based statement failed here (a unique violation that the
general path resolves row by row).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg.pq.abc import PGresult

from pgcascade.capture.pgoutput import lsn_int
from pgcascade.core import roundtrip
from pgcascade.core.errors import db_error_line
from pgcascade.pgq import node as nodes
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica import applysql, prepared
from pgcascade.replica import seqs as subscriber_seqs
from pgcascade.replica import tables as subscriber
from pgcascade.replica.apply import MAX_EV_ID, BatchStats, TableApplier

# the events of next_batch_events, as [ev_id, ev_txid, ev_type, ev_data, ev_extra1, ev_time,
# ev_extra2, ev_extra3, ev_extra4], into the staging table (every column: a branch carries them)
STAGE_INLINE = (
    "insert into pg_temp.pgcascade_stage"
    " (ev_id, ev_txid, ev_type, ev_data, ev_extra1, ev_time, ev_extra2, ev_extra3, ev_extra4)"
    " select (e->>0)::int8, (e->>1)::int8, e->>2, e->>3, e->>4, (e->>5)::timestamptz, e->>6, e->>7, e->>8"
    " from json_array_elements(%s::json) e"
)
# the transaction's settings, and the batch's events for every table's statement (INLINE_EVENTS);
# generic plans: a one-kind statement's custom plan (its parameters: the rows, their count) is
# cheaper by the planner's estimate than the generic one, so it was planned again at every
# batch (10% of the subscriber's CPU at 500 tps); its generic plan probes the key's index
SETTINGS = (
    "select set_config('session_replication_role', 'replica', true), set_config('synchronous_commit', %s, true),"
    " set_config('plan_cache_mode', 'force_generic_plan', true),"
    f" set_config('{applysql.INLINE_SETTING}', %s, true)"
)
log = logging.getLogger("pgcascade.replay")

# a batch of at most this many row events is read here, so that each table whose events are all
# of one kind is applied by its one_kind_sql statement (applysql.py); a larger one is not read
ONE_KIND_MAX = 200
# the errors of a one-kind statement whose precondition did not hold (a row missing here, a key
# twice): the batch is applied again with the set-based statements, and its tables' next
# batches too for ONE_KIND_PAUSE seconds (a node that lacks rows would otherwise pay two round
# trips a batch)
ONE_KIND_FAILED = frozenset({"PCROW", "21000"})
ONE_KIND_PAUSE = 60.0
# the set-based statement of a table over the batch's events, by its composed SQL and table
_SET_STATEMENTS: dict[tuple[bytes, str], bytes] = {}
# the node's and its tables' reads after the commit, by queue
_READS: dict[str, list[bytes]] = {}
# the node and its tables, as read after a batch's commit (the next round starts from them)
Fresh = tuple[nodes.Node, list[subscriber.SubscriberTable]]


class NotAtRecord(Exception):
    """The batch does not start at the node's record (its last tick): nothing was applied."""

    def __init__(self, last_tick: int):
        super().__init__(f"the node applied up to tick {last_tick}")
        self.last_tick = last_tick


class Moved(Exception):
    """The node's provider or type changed since the round began: nothing was applied."""


def stage_inline(sub: psycopg.Connection, events: str) -> None:
    """Stage a batch whose events came inline (next_batch_events)."""
    sub.execute(STAGE_INLINE, (events,))


def takes(info: BatchInfo, appliers: dict[str, TableApplier]) -> bool:
    """Whether this path can apply the batch: events inline, row events only, and every table
    with events applied set-based (tables without an applier are ignored, as elsewhere)."""
    if info.events is None or info.other_events or info.row_counts is None:
        return False
    return all(appliers[t].set_based for t in info.row_counts if t in appliers)


def set_statement(sub: psycopg.Connection, a: TableApplier) -> bytes:
    """The table's set-based statement over the batch's events, its values as literals:
    prepared without parameters, its plan is made every second (prepared.py)."""
    key = (a.inline_sql or b"", a.table)
    if key not in _SET_STATEMENTS:
        if len(_SET_STATEMENTS) > 1000:  # composed again after DDL: old ones are dropped
            _SET_STATEMENTS.clear()
        _SET_STATEMENTS[key] = roundtrip.binder(sub).mogrify(key[0], a.params(0, MAX_EV_ID, None)).encode()
    return _SET_STATEMENTS[key]


def read_statements(sub: psycopg.Connection, queue: str, known: Fresh | None) -> list[bytes]:
    """The node's and its tables' reads after the commit, for the next round - none when
    `known` (those the round started from, read a moment ago) serve."""
    if known is not None:
        return []
    if queue not in _READS:
        bind = roundtrip.binder(sub).mogrify
        _READS[queue] = [bind(q, (queue,)).encode() for q in (nodes.NODE_QUERY, subscriber.TABLES_QUERY)]
    return _READS[queue]


def fresh_after(
    sub: psycopg.Connection, results: list[PGresult], known: Fresh | None, tick: int, position: str | None
) -> Fresh:
    """The node and its tables for the next round: read after the commit (the message's last
    two `results`), or `known` with the node's record at the batch's `tick` and `position`."""
    if known is not None:
        return known[0].applied(tick, position), known[1]
    node, tables = results[-2:]
    return roundtrip.load_rows(sub, node, nodes.node_from)[0], roundtrip.load_rows(
        sub, tables, subscriber.table_from
    )


def one_kind_statements(
    sub: psycopg.Connection, events: str, todo: list[TableApplier]
) -> dict[str, tuple[bytes, bytes]]:
    """The one-kind statement and its EXECUTE (its rows as a JSON array) of each table in
    `todo` whose events in this batch are all of one kind, by table."""
    by_table: dict[str, list[list]] = {}
    for e in json.loads(events):  # [ev_id, ev_txid, ev_type, ev_data, ev_extra1, ...], by ev_id
        by_table.setdefault(e[4], []).append(e)
    quote = psycopg.pq.Escaping(sub.pgconn).escape_literal
    out = {}
    now = time.monotonic()
    for a in todo:
        if a.one_kind_after > now:
            continue
        evs = by_table.get(a.table, [])
        kinds = {e[2] for e in evs}
        body = a.one_kind.get(kinds.pop()) if len(kinds) == 1 else None
        rows = [e[3] for e in evs]
        if body is None or None in rows:
            continue
        args = b"%s, %d" % (quote(("[" + ",".join(rows) + "]").encode()), len(rows))
        out[a.table] = (body, prepared.execute(body, args))
    return out


@dataclass
class Applied:
    """What one round trip applied, and what the next round needs, read after the commit."""

    stats: BatchStats
    lsn: str  # the subscriber's WAL position after the commit
    fresh: Fresh


def apply_batch(
    sub: psycopg.Connection,
    queue: str,
    node: nodes.Node,
    info: BatchInfo,
    appliers: dict[str, TableApplier],
    seqs: list[tuple[str, str]],
    durable: bool,
    before_commit: Callable[[], object] | None = None,
    known: Fresh | None = None,
) -> Applied:
    """Apply and commit the batch in one round trip, and read the node and its tables again
    after the commit (the next round starts from them), unless `known` serve.  `durable`:
    commit with synchronous_commit on.  `before_commit`: called between the apply and the
    commit, which then go in two round trips.  Raises NotAtRecord or Moved when apply_begin
    refused the batch, or the statement's error."""
    assert info.events is not None and info.row_counts is not None
    message = functools.partial(apply_message, before_commit=before_commit, known=known)
    if sum(info.row_counts.values()) <= ONE_KIND_MAX:
        try:
            return message(sub, queue, node, info, appliers, seqs, durable, one_kind=True)
        except psycopg.Error as e:
            if e.sqlstate not in ONE_KIND_FAILED:
                raise
            # a row to update missing here is worth a line: this node had lost it
            log.info(
                "batch %s: %s; applying it with the set-based statements", info.batch_id, db_error_line(e)
            )
            for t in info.row_counts:
                if t in appliers:
                    appliers[t].one_kind_after = time.monotonic() + ONE_KIND_PAUSE
    return message(sub, queue, node, info, appliers, seqs, durable, one_kind=False)


def apply_message(
    sub: psycopg.Connection,
    queue: str,
    node: nodes.Node,
    info: BatchInfo,
    appliers: dict[str, TableApplier],
    seqs: list[tuple[str, str]],
    durable: bool,
    one_kind: bool,
    before_commit: Callable[[], object] | None,
    known: Fresh | None,
) -> Applied:
    """apply_batch's one round trip (two with `before_commit`); with `one_kind`, tables whose
    events are all of one kind are applied by their one-kind statements."""
    assert info.events is not None and info.row_counts is not None
    stats = BatchStats()
    todo = []
    for table, n in info.row_counts.items():
        stats.count += n
        stats.per_table[table] = n
        if table in appliers:
            todo.append(appliers[table])
        else:
            stats.ignored += n
    bind = functools.partial(roundtrip.compose, sub)
    ones = one_kind_statements(sub, info.events, todo) if one_kind else {}
    sets = {a.table: set_statement(sub, a) for a in todo if a.table not in ones}
    reads = read_statements(sub, queue, known)
    prepared.ensure(sub, [*sets.values(), *(body for body, _ in ones.values()), *reads])
    applies = [ones[a.table][1] if a.table in ones else prepared.execute(sets[a.table]) for a in todo]
    statements = [
        b"begin",
        # the batch's events for the set-based statements only (none: an empty array)
        bind(SETTINGS, ("on" if durable else "off", info.events if sets else "[]")),
        bind(
            "select pgcascade.apply_begin(%s, %s, %s, %s, %s, %s, %s)",
            (
                queue,
                info.prev_tick_id,
                info.prev_position,
                info.cur_tick_id,
                info.cur_position,
                node.provider_node,
                node.node_type.value,
            ),
        ),
        *applies,
        *(
            bind(subscriber_seqs.SETVAL, (v, queue, dest, v))
            for (_seq, dest), v in zip(seqs, info.seq_values or [], strict=False)
            if v is not None
        ),
        b"commit",
        WAL_AFTER_COMMIT,
        *(prepared.execute(body) for body in reads),
    ]
    try:
        # one message: one round trip (psycopg's pipeline mode took several wake-ups per batch)
        if before_commit is not None:
            commit = statements.index(b"commit")
            prepared.run(sub, statements[:commit])
            call_in_transaction(sub, before_commit)
            statements = statements[commit:]
        results = prepared.run(sub, statements)
    except psycopg.Error as e:
        if e.sqlstate == "PCRES":
            raise NotAtRecord(int(e.diag.message_detail or 0)) from None
        if e.sqlstate == "PCMOV":
            raise Moved(str(e)) from None
        raise
    lsn = results[-1 - len(reads)].get_value(0, 0).decode()  # type: ignore[union-attr]
    assert info.cur_tick_id is not None
    return Applied(stats, lsn, fresh_after(sub, results, known, info.cur_tick_id, info.cur_position))


def call_in_transaction(sub: psycopg.Connection, call: Callable[[], object]) -> None:
    """`call()` while sub's transaction is open; rolled back if it fails."""
    try:
        call()
    except BaseException:
        if not sub.closed:
            with contextlib.suppress(psycopg.Error):
                sub.execute("rollback")
        raise


# read right after a batch's commit: the batch is durable once the WAL is flushed up to there
WAL_AFTER_COMMIT = b"select pg_current_wal_insert_lsn()::text"


@dataclass
class Durability:
    """Which applied ticks are on the subscriber's disk.  A node that commits its batches
    asynchronously reports to its provider (the watermark that keeps the provider's ticks and
    events) only ticks whose commit its WAL has flushed: if the subscriber crashes and loses
    the commits after them, the provider still has what the node applies again."""

    pending: deque[tuple[int, int]]  # (tick, WAL position after its commit), oldest first
    durable: int | None = None  # the newest tick known to be flushed

    @classmethod
    def new(cls) -> Durability:
        return cls(deque())

    def committed(self, tick: int, lsn: str) -> None:
        self.pending.append((tick, lsn_int(lsn)))

    def flushed(self, flush_lsn: str) -> int | None:
        """The newest tick whose commit is at or before `flush_lsn` (or an older known one)."""
        upto = lsn_int(flush_lsn)
        while self.pending and self.pending[0][1] <= upto:
            self.durable = self.pending.popleft()[0]
        return self.durable
