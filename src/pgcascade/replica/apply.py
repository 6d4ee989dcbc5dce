"""Turning a batch's events into changes on the subscriber, set-based.

Python never loops over events.  A batch travels as one COPY stream from the provider's queue
into `pg_temp.pgcascade_stage` on the subscriber (stage.py); then, per table, one
statement (applysql.py) reduces the staged events to their net effect per key (the last event
of each key wins) and applies it: a DELETE for keys whose last event is D (or, with a row
filter, whose last row fails it), and an upsert of the rest.  That is correct because a batch
is applied in one transaction, so only its end state is ever visible, and because each key's
events are ordered by ev_id (a later change of a row always has a later event id: the row lock
orders them).

Where that is unsafe the table's events go through `pgcascade.apply_rows` one by one, in
ev_id order: the seed's partial-SQL events, a key unique on neither side, or a set-based
statement that broke another unique constraint (rolled back to a savepoint).

Barrier events split a batch into segments applied in order: TRUNCATE (R) - consecutive
ones in one TRUNCATE statement, as the provider's cascade did - and EXECUTE (DDL). The
table-list event (T) needs no action here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import psycopg
from psycopg import sql

from pgcascade.core import catalog
from pgcascade.core.errors import RuntimeFailure, db_error_line
from pgcascade.core.hooks import pause_point
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import queue as q
from pgcascade.replica import applysql, peer_apply
from pgcascade.replica.peer_apply import PeerBatch
from pgcascade.replica.peer_truncate import apply_peer_truncate
from pgcascade.replica.tables import SubscriberTable

log = logging.getLogger("pgcascade.apply")

ROW_EVENTS = ("I", "U", "D")
MAX_EV_ID = 2**63 - 1

# Every apply transaction: replica role (no capture, no protection triggers, no FK triggers),
# and a durable commit even where the server runs with synchronous_commit = off - the batch is
# finished on the provider right after, so a commit lost in a crash would lose the batch.
APPLY_SETTINGS = "set local session_replication_role = replica; set local synchronous_commit = on"

# The worker's subscriber session holds the role for its whole life: PostgreSQL empties a
# session's plan cache whenever session_replication_role changes value, so SET LOCAL at each
# batch (and its reset at commit) had every statement planned again at every batch - the
# PL/pgSQL functions' too (pg_stat_statements: 0.1-1 ms of planning per statement).  The SET
# LOCALs stay (other sessions apply too: copies, the Spark copy); under the session's own
# value they change nothing.  Plans now outlive a batch, so the set-based statements of this
# module are never prepared (prepare=False): a batch's size and range vary from one event to
# millions, and a plan made for one must not serve the other.
REPLICA_SESSION = "set session_replication_role = replica"


class Writes(Enum):
    """What a table's row events in a segment are, which chooses its set-based statement."""

    NO_INSERTS = "updates and deletes"  # MERGE
    SOME_INSERTS = "inserts among others"  # the CTE form (applysql.set_based_sql)
    ONLY_INSERTS = "inserts only"  # a plain INSERT (applysql.insert_sql)

    @classmethod
    def of(cls, inserts: bool, only_inserts: bool) -> Writes:
        """The kind of a segment's events of a table: whether any, and whether all, are inserts."""
        return cls.ONLY_INSERTS if only_inserts else cls.SOME_INSERTS if inserts else cls.NO_INSERTS


@dataclass
class TableApplier:
    """How one table's events are applied; built from both catalogs, reused batch after batch."""

    table: str  # the provider's name, as in ev_extra1
    dest: str
    keys: list[str]
    cols: list[str]  # columns both sides have (not generated on the subscriber), of its --columns
    set_based: bool
    set_sql: bytes | None = field(default=None, repr=False)  # composed once: composing costs ~1 ms
    merge_sql: bytes | None = field(default=None, repr=False)  # the same as a MERGE (PostgreSQL 15+)
    insert_sql: bytes | None = field(default=None, repr=False)  # a segment of inserts only
    inline_sql: bytes | None = field(default=None, repr=False)  # the same over a batch's JSON (inline.py)
    one_kind: dict[str, bytes] = field(default_factory=dict, repr=False)  # by kind: applysql.one_kind_sql
    one_kind_after: float = 0.0  # not before this time.monotonic(): its last one failed (inline.py)
    event_format: str = "json"
    dest_names: frozenset[str] = frozenset()  # every column of dest when cols was computed
    json_nulls: bool = False  # dest has json/jsonb columns: read events with pgcascade.event_row
    row_filter: str | None = None  # add-table --where (filters.py)
    column_list: list[str] | None = None  # add-table --columns
    unique_at_provider: bool = False  # the provider's key is unique: update-then-insert is exact
    merge_refused: bool = False  # the server refused this table's MERGE (rules, foreign partitions)
    shape: applysql.Shape | None = field(default=None, repr=False)  # of the set-based statements
    # a two-way peer's apply statements, by (peer, this master, policy): replica/peer_apply.py
    peer_sql: dict[tuple[str, str, str, bool], tuple[bytes, bytes]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, sub: psycopg.Connection, prov: psycopg.Connection | None, st: SubscriberTable, event_format: str
    ) -> TableApplier:
        dest_cols = catalog.columns(sub, st.dest_table)
        if prov is not None and catalog.table_exists(prov, st.table_name):
            prov_names = {c.name for c in catalog.columns(prov, st.table_name)}
            unique = catalog.has_unique_index_on(prov, st.table_name, st.key_columns)
        else:  # a queue-only branch carries the events of a table it does not have itself
            prov_names, unique = {c.name for c in dest_cols}, False
        cols = st.applied_columns([c.name for c in dest_cols if c.name in prov_names and not c.generated])
        a = cls(st.table_name, st.dest_table, st.key_columns, cols, False, event_format=event_format)
        a.row_filter, a.column_list, a.unique_at_provider = st.row_filter, st.column_list, unique
        a.dest_names = frozenset(c.name for c in dest_cols)
        a.compose(sub, dest_cols)
        return a

    def compose(self, sub: psycopg.Connection, dest_cols: list[catalog.Column]) -> None:
        """Choose the set-based statement's shape (applysql.py) for the destination as it is, or none."""
        on_conflict = catalog.has_unique_index_on(sub, self.dest, self.keys)
        self.set_based = self.event_format == "json" and (on_conflict or self.unique_at_provider)
        self.json_nulls = catalog.has_json_columns(sub, self.dest)
        self.set_sql = self.merge_sql = self.inline_sql = self.insert_sql = None
        self.one_kind = {}
        self.peer_sql = {}
        if self.set_based:
            identity = any(c.identity for c in dest_cols if c.name in self.cols)
            shape = applysql.Shape(
                self.dest, self.keys, self.cols, identity, self.json_nulls, on_conflict, self.row_filter
            )
            self.shape, self.set_sql = shape, applysql.set_based_sql(shape).as_bytes(sub)
            if not self.merge_refused and sub.info.server_version >= 150000:
                self.merge_sql = applysql.merge_sql(shape).as_bytes(sub)
            self.inline_sql = applysql.set_based_sql(shape, applysql.INLINE_EVENTS).as_bytes(sub)
            if (insert := applysql.insert_sql(shape)) is not None:
                self.insert_sql = insert.as_bytes(sub)
            for kind in applysql.ONE_KIND:
                if (one := applysql.one_kind_sql(shape, kind)) is not None:
                    self.one_kind[kind] = one.as_bytes(sub)

    def after_ddl(self, sub: psycopg.Connection) -> None:
        """A script from the queue ran here as on the provider: a column it added exists on both
        sides, and the batch's later events carry it, so they must be applied with it (unless
        the table has a column list)."""
        if not catalog.table_exists(sub, self.dest):
            return
        dest_cols = catalog.columns(sub, self.dest)
        added = [c.name for c in dest_cols if c.name not in self.dest_names and self.column_list is None]
        self.cols = [
            c.name for c in dest_cols if not c.generated and (c.name in self.cols or c.name in added)
        ]
        self.dest_names = frozenset(c.name for c in dest_cols)
        self.compose(sub, dest_cols)

    def apply_repair(self, sub: psycopg.Connection, ev_id: int) -> None:
        """A repair the root sent down the cascade (sql/replica/94_repair.sql), at its place,
        within this node's row filter and column list."""
        try:
            sub.execute(
                "select pgcascade.apply_repair(%s, %s::regclass, %s, %s, %s)",
                (ev_id, self.dest, self.keys, self.cols, self.row_filter),
            )
        except psycopg.OperationalError:
            raise
        except psycopg.Error as e:
            raise ApplyError(f"repair of {self.table} (event {ev_id}): {db_error_line(e)}") from e

    def params(self, lo: int, hi: int, skip: str | None) -> dict:
        return {"t": self.table, "lo": lo, "hi": hi, "skip": skip}

    def statement(self, writes: Writes) -> bytes:
        """The set-based statement for a segment of `writes`.  Inserts among others go the CTE
        way - MERGE joins every net row to the table, and one empty when planned is scanned
        whole for each (100,000 inserts: 41 s against 1.5 with ON CONFLICT's probes)."""
        if writes is Writes.ONLY_INSERTS and self.insert_sql:
            return self.insert_sql
        return (self.merge_sql if writes is Writes.NO_INSERTS and self.merge_sql else self.set_sql) or b""

    def apply(
        self,
        sub: psycopg.Connection,
        lo: int,
        hi: int,
        skip: str | None,
        rowwise: bool = False,
        writes: Writes = Writes.SOME_INSERTS,
    ) -> None:
        params = self.params(lo, hi, skip)
        if self.set_based and not rowwise:
            try:
                with sub.transaction():  # a savepoint: a failed set-based attempt leaves nothing behind
                    sub.execute(self.statement(writes), params, prepare=False)
                return
            except psycopg.errors.FeatureNotSupported as e:
                # ON CONFLICT refuses a table with rules, unfired
                if writes is not Writes.NO_INSERTS or self.merge_sql is None:
                    log.info("%s: %s; applying row by row", self.dest, db_error_line(e))
                else:  # MERGE refuses a table with rules or foreign partitions: the CTE form
                    log.info("%s: %s; applying with INSERT, UPDATE and DELETE", self.dest, db_error_line(e))
                    self.merge_refused, self.merge_sql = True, None
                    return self.apply(sub, lo, hi, skip, writes=writes)
            except (psycopg.errors.UniqueViolation, psycopg.errors.ExclusionViolation) as e:
                if writes is Writes.ONLY_INSERTS and self.insert_sql:  # a row here already: upserted
                    log.info("%s: a key inserted is here already; applying with ON CONFLICT", self.dest)
                    return self.apply(sub, lo, hi, skip, writes=Writes.SOME_INSERTS)
                log.info("%s: set-based apply hit %s; applying row by row", self.dest, type(e).__name__)
        if rowwise and (self.row_filter is not None or self.column_list is not None):
            raise ApplyError(
                f"{self.table}: partial-SQL events cannot be filtered (--where/--columns): add the table"
                " on the root with --format=json"
            )
        sub.execute(
            "select pgcascade.apply_rows(%s, %s::regclass, %s, %s, %s, %s, %s::pg_snapshot, %s)",
            (self.table, self.dest, self.keys, self.cols, lo, hi, skip, self.row_filter),
        )


class ApplyError(RuntimeFailure):
    """An event could not be applied; the message names the table and the server's reason."""


@dataclass
class BatchStats:
    count: int = 0
    ignored: int = 0
    executed: int = 0  # EXECUTE (DDL) events run
    conflicts: int = 0  # two-way: conflicts found (and resolved) at apply
    table_list: list[str] | None = None  # the set's tables, from the last T event
    per_table: dict[str, int] = field(default_factory=dict)  # row events by table

    def add(self, other: BatchStats) -> None:
        self.count += other.count
        self.ignored += other.ignored
        for t, n in other.per_table.items():
            self.per_table[t] = self.per_table.get(t, 0) + n


DdlRunner = Callable[
    [psycopg.Connection, int, str, str | None, dict[str, TableApplier], PeerBatch | None], bool
]


def apply_staged(
    sub: psycopg.Connection,
    appliers: dict[str, TableApplier],
    skip: str | None = None,
    queue: str | None = None,
    peer: PeerBatch | None = None,
    ddl: DdlRunner | None = None,
) -> BatchStats:
    """Apply the staged batch: segments of row events between barrier events, in ev_id order.
    Copy processes pass the copy's snapshot as `skip`; the worker passes its `queue`, for the
    set's own events (locations, watermark), which copy processes leave to it, its `ddl` runner
    for EXECUTE events (replica/ddl.py: runs one if it concerns this node, and says whether it
    did), and `peer` for a two-way peer's batch."""
    stats = BatchStats()
    if peer is not None and skip is not None:  # the peer's apply takes no snapshot: drop them here
        sub.execute(
            "delete from pg_temp.pgcascade_stage where ev_type in ('I', 'U', 'D')"
            " and pg_visible_in_snapshot(ev_txid::text::xid8, %s::pg_snapshot)",
            (skip,),
        )
    # one pass over the staged events (5M of them take seconds to read): the tables, and whether
    # there are barriers at all
    summary = sub.execute(STAGE_SUMMARY).fetchall()
    barriers: list[tuple] = []
    only_segment: list[tuple] | None = [
        (t, n, partial, ins, only) for t, n, partial, ins, only, _ in summary if n
    ]
    if any(others for *_, others in summary):
        barriers = sub.execute(  # a repair's rows stay in the database: its function reads them
            "select ev_id, ev_type, case when ev_type <> %s then ev_data end, ev_extra1, ev_extra2"
            " from pg_temp.pgcascade_stage where ev_type not in ('I', 'U', 'D') order by ev_id",
            (q.REPAIR_EVENT,),
        ).fetchall()
        only_segment = None
    pending_truncate: list[str] = []
    lo = 0
    for ev_id, ev_type, ev_data, ev_extra1, ev_extra2 in [*barriers, (MAX_EV_ID, None, None, None, None)]:
        apply_segment(sub, appliers, lo, ev_id, skip, stats, pending_truncate, only_segment, peer)
        lo = ev_id + 1
        if ev_type is None:
            flush_truncate(sub, pending_truncate)
            break
        stats.count += 1
        if ev_type == "R":
            a = appliers.get(ev_extra1)
            if a is None:
                stats.ignored += 1
            elif skip is not None and visible_in(sub, ev_id, skip):
                pass  # before the copy's snapshot: the copied rows are after it
            elif peer is not None:  # by the rules of two-way TRUNCATE: masters converge
                stats.conflicts += apply_peer_truncate(sub, a.table, a.dest, a.keys, ev_id, peer)
            else:
                pending_truncate.append(a.dest)
            continue
        flush_truncate(sub, pending_truncate)
        if ev_type == "EXECUTE":
            if skip is None and ddl is not None:  # copy processes leave DDL to the main worker
                pause_point("execute")
                if ddl(sub, ev_id, ev_data, ev_extra1, appliers, peer):
                    stats.executed += 1
                else:
                    stats.ignored += 1
        elif ev_type == q.REPAIR_EVENT:
            a = appliers.get(ev_extra1)
            if a is None or peer is not None:  # a peer's repairs are for the nodes under that peer
                stats.ignored += 1
            elif skip is None or not visible_in(sub, ev_id, skip):
                a.apply_repair(sub, ev_id)
        elif ev_type == "T":
            stats.table_list = [t for t in (ev_data or "").split(",") if t]
        elif ev_type.startswith("pgcascade.") and queue is not None:
            sub.execute(
                "select pgcascade.apply_cascade_event(%s, %s, %s, %s, %s)",
                (queue, ev_type, ev_data, ev_extra1, ev_extra2),
            )
        else:
            stats.ignored += 1
    return stats


# per table: its row events, whether any is partial SQL, whether any and all are inserts, its
# other events
STAGE_SUMMARY = (
    "select ev_extra1, count(*) filter (where ev_type in ('I', 'U', 'D')),"
    " coalesce(bool_or(left(ev_data, 1) <> '{') filter (where ev_type in ('I', 'U', 'D')), false),"
    " coalesce(bool_or(ev_type = 'I'), false),"
    " coalesce(bool_and(ev_type = 'I') filter (where ev_type in ('I', 'U', 'D')), false),"
    " count(*) filter (where ev_type not in ('I', 'U', 'D'))"
    " from pg_temp.pgcascade_stage group by 1 order by 1"
)

# the tables with row events in a segment: their count, whether any is partial SQL, whether
# any and all are inserts
SEGMENT_TABLES = (
    "select ev_extra1, count(*), bool_or(left(ev_data, 1) <> '{'), bool_or(ev_type = 'I'), bool_and(ev_type = 'I')"
    " from pg_temp.pgcascade_stage"
    " where ev_id >= %s and ev_id < %s and ev_type in ('I', 'U', 'D') group by 1 order by 1"
)


def visible_in(sub: psycopg.Connection, ev_id: int, snapshot: str) -> bool:
    return scalar(
        sub,
        "select txid_visible_in_snapshot(ev_txid, %s::txid_snapshot) from pg_temp.pgcascade_stage"
        " where ev_id = %s",
        (snapshot, ev_id),
    )


def flush_truncate(sub: psycopg.Connection, dests: list[str]) -> None:
    if dests:
        sub.execute(
            sql.SQL("truncate {}").format(sql.SQL(", ").join(sql.SQL(d) for d in dict.fromkeys(dests)))
        )
        dests.clear()


def apply_segment(
    sub: psycopg.Connection,
    appliers: dict[str, TableApplier],
    lo: int,
    hi: int,
    skip: str | None,
    stats: BatchStats,
    pending_truncate: list[str],
    rows: list[tuple] | None = None,
    peer: PeerBatch | None = None,
) -> None:
    """Apply the row events with lo <= ev_id < hi; truncates that precede them go first
    (consecutive TRUNCATE events with no rows between them become one statement).  `rows`:
    the segment's tables (SEGMENT_TABLES), when read already."""
    if rows is None:
        rows = sub.execute(SEGMENT_TABLES, (lo, hi)).fetchall()
    if rows:
        flush_truncate(sub, pending_truncate)
    todo: list[tuple[TableApplier, bool, Writes]] = []
    for table, n, partial_sql, inserts, only_inserts in rows:
        stats.count += n
        stats.per_table[table] = stats.per_table.get(table, 0) + n
        a = appliers.get(table)
        if a is None:
            stats.ignored += n
        else:
            todo.append((a, bool(partial_sql), Writes.of(inserts, only_inserts)))
    if peer is not None:
        stats.conflicts += apply_peer_tables(sub, [a for a, *_ in todo], lo, hi, peer)
        return
    done = apply_set_based_together(
        sub, [(a, writes) for a, partial, writes in todo if a.set_based and not partial], lo, hi, skip
    )
    for a, partial, writes in todo:
        if a.table in done:
            continue
        try:
            a.apply(sub, lo, hi, skip, rowwise=partial, writes=writes)
        except psycopg.OperationalError:
            raise
        except psycopg.Error as e:
            raise ApplyError(f"applying events of {a.table} to {a.dest}: {db_error_line(e)}") from e


def apply_peer_tables(
    sub: psycopg.Connection, appliers: list[TableApplier], lo: int, hi: int, peer: PeerBatch
) -> int:
    """A two-way peer's events of these tables, each table's statement (peer_apply.py) sent in
    one pipeline: one round trip for the segment.  Conflicts found."""
    if not appliers:
        return 0
    statements = [(a, peer_apply.statement(sub, a, peer)) for a in appliers]
    try:
        with sub.pipeline():
            results = []
            for a, (lock, stmt) in statements:
                sub.execute(lock, peer_apply.params(a, lo, hi, peer), prepare=False)
                results.append(sub.execute(stmt, peer_apply.params(a, lo, hi, peer), prepare=False))
    except psycopg.Error as e:
        for a in appliers:  # composed again next time: a table's columns may have changed
            a.peer_sql.clear()
        if isinstance(e, psycopg.OperationalError):
            raise
        names = [a.dest for a in appliers if a.dest.rsplit(".", 1)[-1].strip('"') == e.diag.table_name]
        where = names[0] if names else ", ".join(a.dest for a in appliers)
        raise ApplyError(f"applying events of {peer.peer} to {where}: {db_error_line(e)}") from e
    return sum(int(row[0]) for cur in results if (row := cur.fetchone()) is not None)


def apply_set_based_together(
    sub: psycopg.Connection, appliers: list[tuple[TableApplier, Writes]], lo: int, hi: int, skip: str | None
) -> set[str]:
    """The set-based statements of several tables under one savepoint, in one pipeline: two
    round trips for all of them instead of three per table.  The tables applied return; if
    any statement fails, none is, and each table goes again on its own (TableApplier.apply
    falls back to row by row, or names the table in the error)."""
    if len(appliers) < 2:
        return set()
    try:
        with sub.pipeline(), sub.transaction():
            for a, writes in appliers:
                sub.execute(a.statement(writes), a.params(lo, hi, skip), prepare=False)
    except psycopg.OperationalError:
        raise
    except psycopg.Error:
        return set()
    return {a.table for a, _ in appliers}
