"""The staging table: a batch's events on the subscriber, in one temporary table per session.

A batch travels as one COPY stream from the provider's queue (`batch_event_sql`) into
`pg_temp.pgcascade_stage`, where apply.py's set-based statements read it; emptied at commit.
"""

from __future__ import annotations

import weakref
from typing import Any

import psycopg
from psycopg import sql

from pgcascade.core import roundtrip
from pgcascade.core.pgconn import scalar
from pgcascade.pgq import queue as q
from pgcascade.pgq.queue import BatchInfo
from pgcascade.replica.peer_apply import PEER_SEEN, PEER_SELECT, PEER_TIME

STAGE_TABLE = "pg_temp.pgcascade_stage"
STAGE_COLUMNS = "ev_id, ev_txid, ev_type, ev_data, ev_extra1"
# a branch carries every field of the event into its own queue
CARRY_COLUMNS = STAGE_COLUMNS + ", ev_time, ev_extra2, ev_extra3, ev_extra4"
STAGE_DDL = (
    "create temp table if not exists pgcascade_stage"
    " (ev_id int8, ev_txid int8, ev_type text, ev_data text, ev_extra1 text,"
    "  ev_time timestamptz, ev_extra2 text, ev_extra3 text, ev_extra4 text) on commit delete rows"
)


_STAGED: weakref.WeakSet[psycopg.Connection] = weakref.WeakSet()


def ensure_stage(sub: psycopg.Connection) -> None:
    """The staging table lives as long as the session: made once per connection when made
    outside a transaction (inside one, a rollback would take it back, so it is made each time)."""
    if sub in _STAGED:
        return
    idle = sub.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    sub.execute(STAGE_DDL)
    if idle and sub.autocommit:
        _STAGED.add(sub)


def stage_batch(prov: psycopg.Connection, sub: psycopg.Connection, batch: BatchInfo, **options: Any) -> int:
    """Stream the batch's events from the provider into the subscriber's staging table; bytes
    moved.  `options`: stage_statements'."""
    copy_out, copy_in = stage_statements(prov, sub, batch, **options)
    return roundtrip.relay_copy(prov, copy_out, sub, copy_in)


def stage_statements(
    prov: psycopg.Connection,
    sub: psycopg.Connection,
    batch: BatchInfo,
    only_tables: list[str] | None = None,
    carry: bool = False,
    row_events: bool = True,
    peer: bool = False,
    peer_logical: bool = False,
) -> tuple[bytes, bytes]:
    """The provider's COPY of the batch's events and the stage's COPY that takes them (the
    stage made).  `only_tables`: those tables' events only; `row_events=False`: all but row
    events (applied elsewhere); `carry`: every field, for a branch that inserts them into its
    queue; `peer`: a two-way peer's batch (PEER_SELECT; `peer_logical`: it captures logically)."""
    ensure_stage(sub)
    assert batch.batch_id is not None
    batch_sql = q.unordered(batch.event_sql or q.batch_event_sql(prov, batch.batch_id))
    cols = sql.SQL(CARRY_COLUMNS if carry or peer else STAGE_COLUMNS)
    select = sql.SQL(PEER_SELECT.format(PEER_TIME[peer_logical])) if peer else cols
    conditions: list[sql.Composable] = [sql.SQL("(ev_extra4 is null or ev_type = 'EXECUTE')")] if peer else []
    if only_tables is not None:
        of_tables = sql.SQL("ev_extra1 = any({}::text[])").format(sql.Literal(only_tables))
        if peer:  # a peer's markers say what it had seen: its conflicts are judged by them
            of_tables = sql.SQL("({} or ev_type = {})").format(of_tables, sql.Literal(PEER_SEEN))
        conditions.append(of_tables)
    if not row_events:
        conditions.append(sql.SQL("ev_type not in ('I', 'U', 'D')"))
    query = sql.SQL("copy (select {} from ({}) b{}) to stdout").format(
        select,
        sql.SQL(batch_sql),  # composed by the provider's own function, with quoted literals
        sql.SQL(" where ") + sql.SQL(" and ").join(conditions) if conditions else sql.SQL(""),
    )
    copy_in = sql.SQL("copy {} ({}) from stdin").format(sql.SQL(STAGE_TABLE), cols)
    return query.as_bytes(prov), copy_in.as_bytes(sub)


def staged_barriers(sub: psycopg.Connection) -> int:
    """TRUNCATE, EXECUTE and repair events staged: they order the row events around them."""
    barriers = ["R", "EXECUTE", q.REPAIR_EVENT]
    return int(scalar(sub, f"select count(*) from {STAGE_TABLE} where ev_type = any(%s)", (barriers,)))


def clear_stage(sub: psycopg.Connection) -> None:
    """Empty the stage inside a transaction (its commit would, too)."""
    sub.execute(f"delete from {STAGE_TABLE}")
